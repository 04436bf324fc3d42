"""The reward of a GRPO step: what scores each response, how it is built from the config, and what it may read.

Every reward is a named, weighted source (trl's ``reward_funcs`` and ``reward_weights``): the reward model
(``interop.HFRewardModelWrapper``), the trl reward functions of ``reward.functions``
(:class:`RewardFunction`, each called as trl calls it) and the TorchRL reward terms of ``reward.terms``. One
``interop.RewardModelTransform`` scores them all at every step where the step is collected (in the learner's process,
or in the background collector's) and writes their NaN-skipping weighted sum and each source's own values.

- :func:`reward_sources`: the sources the config names, in order; :func:`check_reward_sources` refuses none or a
  name used twice.
- :func:`make_reward_transform`: the env's reward transform (the sources scored by :func:`make_reward_scorer`, what
  the trl reward functions logged written into the batch by :class:`RewardLogsToBatch`, then
  :class:`TrainerStepCounter` moving the step they read); :func:`score_sources` the scorer of ``(RewardSource,
  module)`` pairs; :func:`logged_in_batch` reads the logs back.
- :class:`ResponseText`: decodes a ``PromptEnv`` step's responses into the text and conversations text-reading
  rewards read, on a scratch copy inside the transform.
- Reward terms, TensorDict modules with one reward per sample: :class:`LengthPenalty`, :class:`TextScoreReward`.
- Checks before anything loads: :func:`check_reward_keys` (every key a reward reads is one the rollout holds,
  :func:`rollout_step_keys`), :func:`reward_prompt_lengths` (how long each prompt is as the reward model reads it).

Dependencies: torch, tensordict, torchrl, hydra, transformers, and the project's ``interop`` package.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hydra.utils import get_object, instantiate
from omegaconf import ListConfig
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from torchrl.envs import Compose, Transform

from interop import HFRewardModelWrapper, RewardModelTransform
from interop.sampling import CausalLMSampler
from interop.tools.dialog_policy import DialogPolicy
from recipes.common.chat import CHAT_STEP_KEYS
from recipes.common.config import ConfigError, tensordict_key
from recipes.common.dotted_paths import resolve_function
from recipes.common.models import load_reward_model, load_tokenizer
from recipes.common.prompts import PromptTable, non_tensor_rows
from recipes.common.reward_functions import (
    RewardLogs,
    check_reward_weights,
    checked_rewards,
    reward_function_failure,
)
from recipes.common.schema import config_view
from recipes.common.tools import tool_entries
from recipes.grpo.batch import (
    ATTENTION_MASK,
    PROMPT_INDEX,
    RESPONSE_TOKENS,
    REWARD,
    REWARD_LOGS,
    SOURCE_REWARDS,
    kept_token_ids,
)
from recipes.grpo.prompt_env import PromptEnv
from recipes.grpo.schema import GRPORecipeConfig

if TYPE_CHECKING:
    from transformers import TrainerState

__all__ = [
    "RewardFunction",
    "READ_KEYS_OF_INPUT",
    "LengthPenalty",
    "ResponseText",
    "RewardLogsToBatch",
    "RewardSource",
    "TextScoreReward",
    "TrainerStepCounter",
    "check_reward_keys",
    "check_reward_sources",
    "load_reward_scorer",
    "logged_in_batch",
    "make_reward_scorer",
    "make_reward_transform",
    "reward_prompt_lengths",
    "reward_sources",
    "rollout_step_keys",
    "score_sources",
    "source_names",
]

# The reward.read_keys entries the reward model reads, for each reward.input.
READ_KEYS_OF_INPUT = {"history": ("history",), "text": ("text",), "tokens": ("tokens", "attention_mask")}


class RewardFunction(TensorDictModuleBase):
    """A trl reward function over a ``PromptEnv`` step, called once for the whole batch as trl calls it: decodes the
    responses as trl does, looks up each row's prompt and columns, and writes one reward per response, NaN where it
    returned ``None`` (trl's "not applicable"). A function that raises fails the step naming itself and the first row
    it fails on; a wrong count or a NaN fails it naming the function.

    Args:
        function: the reward function.

    Keyword Args:
        name: what messages call it (``reward.functions.<name>``).
        prompts: the env's ``PromptTable`` (the prompts as the data holds them, and their columns).
        tokenizer: the policy's tokenizer (responses are decoded without special tokens, as trl decodes them).
        trainer_state: the ``TrainerState`` handed to the function; its owner moves its step.
        logs: where the function's ``log_metric`` / ``log_extra`` calls go (:class:`RewardLogs`, shared by the
            functions of one scorer, whose owner reports them); ``None``: kept here, in a :class:`RewardLogs` of its
            own (``self.logs``).

    Writes ``"score"``: one float per response, NaN where the function returned ``None``.
    """

    def __init__(
        self,
        function: Callable,
        *,
        name: str,
        prompts,
        tokenizer,
        trainer_state: TrainerState,
        logs: RewardLogs | None = None,
    ) -> None:
        super().__init__()
        self.function = function
        self.name = name
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.trainer_state = trainer_state
        self.logs = logs if logs is not None else RewardLogs()
        self._extra: dict[str, list] = {}  # this call's log_extra columns, checked once the call returns
        self.in_keys = [RESPONSE_TOKENS, ATTENTION_MASK, PROMPT_INDEX]
        self.out_keys = ["score"]

    def arguments(self, tensordict: TensorDictBase) -> dict:
        """What trl passes the function for these responses (keyword arguments)."""
        tokens = tensordict.get(RESPONSE_TOKENS)
        mask = tensordict.get(ATTENTION_MASK)[..., -tokens.shape[-1] :]
        flat_tokens, flat_mask = tokens.reshape(-1, tokens.shape[-1]).cpu(), mask.reshape(-1, mask.shape[-1]).cpu()
        completion_ids = kept_token_ids(flat_tokens, flat_mask)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        indices = tensordict.get(PROMPT_INDEX).reshape(-1).tolist()
        # The policy answers every prompt rendered with its chat template: a conversation, as trl's GRPOTrainer (and
        # the trl recipe) passes it, with message-list completions.
        prompts = [self.prompts.conversations[index] for index in indices]
        completions = [[{"role": "assistant", "content": text}] for text in texts]
        columns = {name: [values[index] for index in indices] for name, values in self.prompts.columns.items()}
        return {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **columns,
            "trainer_state": self.trainer_state,
            "log_extra": self._log_extra,
            "log_metric": self._log_metric,
        }

    def _log_extra(self, column: str, values: list) -> None:
        self._extra[column] = list(values)

    def _log_metric(self, name: str, value: float) -> None:
        self.logs.metric(name, value, function=self.name)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        kwargs = self.arguments(tensordict)
        count = len(kwargs["completions"])
        self._extra = {}
        try:
            values = self.function(**kwargs)
        except Exception as error:
            raise reward_function_failure(self.function, f"reward.functions.{self.name}", error, kwargs) from error
        for column, logged in self._extra.items():
            self.logs.column(column, logged, function=self.name, count=count)
        checked = checked_rewards(values, setting=f"reward.functions.{self.name}", arguments=kwargs)
        # None is trl's "not applicable": NaN, left out of this source's mean and the sum.
        scores = [math.nan if value is None else value for value in checked]
        shape = tensordict.batch_size
        tensordict.set("score", torch.tensor(scores, dtype=torch.float32).reshape(shape))
        return tensordict


def _as_tuple(key: NestedKey) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def rollout_step_keys(cfg: GRPORecipeConfig) -> list[tuple]:
    """The entries a step of ``cfg.rollout.env``'s rollout holds when the reward transforms read it.

    ``prompt``: what :class:`PromptEnv` resets, what :class:`CausalLMSampler` (with tools,
    ``interop.tools.dialog_policy.DialogPolicy``) writes, and the text and conversations
    :class:`ResponseText` decodes for the rewards that read them. ``chat``: TorchRL's layout
    (``recipes.common.chat.CHAT_STEP_KEYS``), with ``("log_probs", "response")`` when
    ``rollout.generation.return_log_probs`` asks for it.
    """
    if cfg.rollout.env == "chat":
        keys = list(CHAT_STEP_KEYS)
        generation = cfg.rollout.generation
        if "return_log_probs" in generation and generation["return_log_probs"]:
            keys.append(("log_probs", "response"))
    else:
        # With tools the policy is a DialogPolicy, whose per-dialog counts a reward term may read (a cost per call).
        policy_keys = DialogPolicy.OUT_KEYS if tool_entries(cfg.tools) else CausalLMSampler.OUT_KEYS
        keys = [*PromptEnv.RESET_KEYS, *policy_keys, *ResponseText.KEYS]
    return [_as_tuple(key) for key in keys]


def _term_read_keys(node: Mapping) -> dict:
    """The settings of a reward term's node that name an entry the term reads: its ``_target_``'s parameters
    annotated ``NestedKey`` (as ``LengthPenalty``'s and ``TextScoreReward``'s are), but ``reward_key``, the entry it
    writes. Only the target is imported; nothing is built."""
    if "_target_" not in node:
        return {}
    parameters = inspect.signature(get_object(node["_target_"])).parameters
    return {
        name: node[name]
        for name in node
        if name in parameters
        and name != "reward_key"
        and "NestedKey" in str(parameters[name].annotation)
        and node[name] is not None
    }


def check_reward_keys(cfg: GRPORecipeConfig) -> None:
    """Refuses a key the rewards would read that the rollout does not hold, before anything loads.

    Checks the ``reward.read_keys`` entries that ``reward.input`` reads (call it once ``reward.input`` is known to be
    one of ``recipes.grpo.schema.RewardInput``), and the keys the extra reward terms (``reward.terms``) are set to read.

    Raises:
        ConfigError: naming the setting, the key, and the entries :func:`rollout_step_keys` lists.
    """
    held = rollout_step_keys(cfg)
    listed = ", ".join(f"[{', '.join(entry)}]" for entry in held)
    read = {}
    read_keys = dataclasses.asdict(cfg.reward.read_keys)
    for name in READ_KEYS_OF_INPUT[cfg.reward.input] if cfg.reward_model is not None else ():
        read[f"reward.read_keys.{name}"] = read_keys[name]  # every one is set: the schema requires them
    for term, node in cfg.reward.terms.items():
        for setting, value in _term_read_keys(node).items():
            read[f"reward.terms.{term}.{setting}"] = value
    for setting, value in read.items():
        if not isinstance(value, (str, ListConfig, list, tuple)):
            raise ConfigError(f"{setting}={value!r}: expected a key, a name or a list of names such as [text, full].")
        key = _as_tuple(tensordict_key(value))
        if key not in held:
            raise ConfigError(
                f"{setting}=[{', '.join(key)}]: a step of rollout.env={cfg.rollout.env} holds no such entry when the "
                f"rewards read it. It holds {listed}. Point {setting} at one of those."
            )


def _with_response_text(module, prompts: PromptTable, tokenizer):
    """``module`` preceded by a :class:`ResponseText` writing the text / conversation entries it reads, if any."""
    wanted = (
        [tuple(key) for key in module.in_keys if tuple(key) in ResponseText.KEYS] if hasattr(module, "in_keys") else []
    )
    if not wanted:
        return module
    return TensorDictSequential(
        ResponseText(prompts, tokenizer, keys=wanted), module, selected_out_keys=module.out_keys
    )


@dataclass(frozen=True)
class RewardSource:
    """One named, weighted reward of a step: the reward model, a trl reward function or a TorchRL reward term.

    Attributes:
        name: ``reward_model``, or the key under ``reward.functions`` / ``reward.terms`` (the metrics'
            ``rollout/rewards/<name>/*``, trl's ``rewards/<name>/*``).
        setting: where the config sets it.
        weight: its weight in the sum (trl's ``reward_weights``).
        kind: ``model``, ``function`` or ``term``.
    """

    name: str
    setting: str
    weight: float
    kind: str


def reward_sources(cfg: GRPORecipeConfig) -> list[RewardSource]:
    """The step's reward sources in their fixed order (the columns of ``("next", "source_rewards")``): the reward
    model (unless ``reward_model=null``), then ``reward.functions``, then ``reward.terms``. Reads the config only."""
    sources = []
    if cfg.reward_model is not None:
        sources.append(RewardSource("reward_model", "reward_model", float(cfg.reward.model_weight), "model"))
    for name, function in cfg.reward.functions.items():
        sources.append(RewardSource(str(name), f"reward.functions.{name}", float(function.weight), "function"))
    for name, term in cfg.reward.terms.items():
        weight = float(term.get("weight", 1.0)) if isinstance(term, Mapping) else 1.0
        sources.append(RewardSource(str(name), f"reward.terms.{name}", weight, "term"))
    return sources


def source_names(cfg: GRPORecipeConfig) -> list[str]:
    """The names of :func:`reward_sources`, in order: the columns of ``("next", "source_rewards")``."""
    return [source.name for source in reward_sources(cfg)]


def check_reward_sources(cfg: GRPORecipeConfig) -> None:
    """Refuses a run with no reward source, or two sources of one name, before anything loads."""
    sources = reward_sources(cfg)
    if not sources:
        raise ConfigError(
            "reward_model=null and no reward.functions or reward.terms: nothing would score the responses. Set "
            "reward_model=<a group option>, or add a function, e.g. "
            "'+reward.functions.format={function:trl.rewards.think_format_reward}'."
        )
    seen: dict[str, str] = {}
    for source in sources:
        if source.name in seen:
            raise ConfigError(
                f"{source.setting} and {seen[source.name]} share the name {source.name!r}, which names both in the "
                "metrics (rollout/rewards/<name>/mean); rename one."
            )
        seen[source.name] = source.setting
    check_reward_weights(cfg)


def _term_module(node: Mapping):
    """A reward term's module: its node without ``weight`` (the source's weight, applied in the sum)."""
    return instantiate({key: node[key] for key in node if key != "weight"})


def load_reward_scorer(cfg: GRPORecipeConfig) -> tuple:
    """The reward model (eval mode) and its tokenizer, or ``(None, None)`` with ``reward_model=null``."""
    if cfg.reward_model is None:
        return None, None
    node = config_view(cfg.reward_model)
    tokenizer = load_tokenizer(node, padding_side="right")
    model = load_reward_model(node, device=cfg.device, dtype=cfg.dtype, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, model.eval()


def make_reward_transform(
    cfg: GRPORecipeConfig,
    reward_model,
    reward_tokenizer,
    policy_tokenizer,
    *,
    prompts: PromptTable | None = None,
    start_step: int = 0,
) -> Compose:
    """The env's reward transform: every source of :func:`reward_sources` scored and summed
    (:func:`make_reward_scorer`), then the step the trl reward functions read moved on (:class:`TrainerStepCounter`).

    ``prompts``: the :class:`PromptTable` of a ``PromptEnv``, whose steps hold tokens only: text and conversations
    are then decoded for the modules that read them (:class:`ResponseText`), inside the transform, and trl reward
    functions read the prompts and columns there. ``None`` for TorchRL's ``ChatEnv``, whose policy writes them.
    ``start_step``: the GRPO steps done before the first batch this transform scores (a resumed run's), from which
    the ``trainer_state`` handed to reward functions counts.
    """
    from transformers import TrainerState  # with transformers' Trainer utilities and peft: 0.7 s, so not at import

    trainer_state, logs = TrainerState(global_step=start_step, max_steps=cfg.train.steps), RewardLogs()
    scorer = make_reward_scorer(
        cfg, reward_model, reward_tokenizer, policy_tokenizer, prompts=prompts, trainer_state=trainer_state, logs=logs
    )
    if not cfg.reward.functions:
        return Compose(scorer, TrainerStepCounter(trainer_state))
    return Compose(scorer, RewardLogsToBatch(logs), TrainerStepCounter(trainer_state))


def make_reward_scorer(
    cfg: GRPORecipeConfig,
    reward_model,
    reward_tokenizer,
    policy_tokenizer,
    *,
    prompts: PromptTable | None = None,
    trainer_state: TrainerState,
    logs: RewardLogs,
) -> RewardModelTransform:
    """The modules of :func:`reward_sources` built from the config, scored by :func:`score_sources`; the trl reward
    functions get ``trainer_state`` (whoever holds it moves its step), and what they log goes to ``logs`` (whoever
    holds it reports it). ``prompts``: as in :func:`make_reward_transform`."""
    sources = []
    for source in reward_sources(cfg):
        if source.kind == "model":
            module = _reward_model_module(cfg, reward_model, reward_tokenizer, policy_tokenizer)
        elif source.kind == "function":
            function = resolve_function(f"{source.setting}.function", cfg.reward.functions[source.name].function)
            module = RewardFunction(
                function,
                name=source.name,
                prompts=prompts,
                tokenizer=policy_tokenizer,
                trainer_state=trainer_state,
                logs=logs,
            )
        else:
            module = _term_module(cfg.reward.terms[source.name])
        if prompts is not None and source.kind != "function":
            module = _with_response_text(module, prompts, policy_tokenizer)
        sources.append((source, module))
    return score_sources(sources)


def score_sources(sources: Sequence[tuple[RewardSource, TensorDictModuleBase]]) -> RewardModelTransform:
    """The ``interop.RewardModelTransform`` that scores ``(RewardSource, module)`` pairs at every step, as trl's
    ``GRPOTrainer`` sums its ``reward_funcs`` with ``reward_weights``.

    Each module scores a scratch selection of the keys it reads, under ``torch.no_grad()``. The transform writes each
    source's own values at ``("next", "source_rewards")`` (``batch + (K,)``, NaN where a trl function returned
    ``None``) and their weighted sum, that NaN left out, at ``("next", "reward")`` (``batch + (1, 1)``). Messages name
    each source by its setting (``reward.functions.<name>``): a non-finite value from the reward model or a term (an
    infinite one from a function) stops the step, and so does a response that no source scores.
    """
    return RewardModelTransform(
        {source.setting: module for source, module in sources},
        weights={source.setting: source.weight for source, _ in sources},
        allow_nan=[source.setting for source, _ in sources if source.kind == "function"],  # trl's None
        reward_key=REWARD[-1],  # both written under "next", where the batch reads them
        source_rewards_key=SOURCE_REWARDS[-1],
        check_finite=True,
    )


class RewardLogsToBatch(Transform):
    """Writes what the trl reward functions logged while a step was scored into the step, at
    :data:`~recipes.grpo.batch.REWARD_LOGS`: one JSON object per response, ``{"columns": {column: its value}}``
    (``log_extra``), the first response's with ``"metrics": {name: [values]}`` too (``log_metric``: the batch's, once
    wherever its responses go). The logs then travel with the batch: out of a background collector's process, and
    through dynamic sampling's selection of groups (:func:`logged_in_batch` reads them back).

    Append it after the reward transform (:func:`make_reward_transform` does).

    Args:
        logs: the :class:`~recipes.common.reward_functions.RewardLogs` the step's reward functions log to.
    """

    def __init__(self, logs: RewardLogs) -> None:
        super().__init__(in_keys=[], out_keys=[])
        self.logs = logs

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        metrics, columns = self.logs.pop()
        count = next_tensordict.batch_size.numel()  # a PromptEnv step: one row per response
        rows = [{"columns": {name: values[row] for name, values in columns.items()}} for row in range(count)]
        rows[0]["metrics"] = metrics
        next_tensordict.set(REWARD_LOGS[-1], non_tensor_rows([json.dumps(row, default=str) for row in rows]))
        return next_tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict


def logged_in_batch(batch: TensorDictBase) -> tuple[dict[str, list[float]], list[dict]]:
    """What :class:`RewardLogsToBatch` wrote into ``batch`` (a batch of any number of responses, from any number of
    collected batches): every value logged per metric, and each response's extra columns. Empty without
    :data:`~recipes.grpo.batch.REWARD_LOGS` (no reward function).

    Examples:
        >>> from tensordict import TensorDict
        >>> rows = non_tensor_rows(['{"columns": {"c": 1}, "metrics": {"m": [0.5]}}', '{"columns": {"c": 2}}'])
        >>> logged_in_batch(TensorDict({"next": {"reward_logs": rows}}, batch_size=[2]))
        ({'m': [0.5]}, [{'c': 1}, {'c': 2}])
    """
    if REWARD_LOGS not in batch.keys(include_nested=True):
        return {}, [{} for _ in range(len(batch))]
    texts = batch.get(REWARD_LOGS)
    rows = [json.loads(text) for text in ([texts] if isinstance(texts, str) else texts.tolist())]
    metrics: dict[str, list[float]] = {}
    for row in rows:
        for name, values in row.get("metrics", {}).items():
            metrics.setdefault(name, []).extend(values)
    return metrics, [row["columns"] for row in rows]


class TrainerStepCounter(Transform):
    """Moves ``trainer_state.global_step`` on by one per env step, after the step's rewards are scored: the
    ``trainer_state`` trl hands its reward functions, whose step trl moves once per scored generation batch.

    Append it after the reward transform (:func:`make_reward_transform` does). Outside an env (``forward``, scoring
    stored responses) it moves nothing: whoever scores them sets the step.

    Args:
        trainer_state: the ``transformers.TrainerState`` the reward functions share.
    """

    def __init__(self, trainer_state: TrainerState) -> None:
        super().__init__(in_keys=[], out_keys=[])
        self.trainer_state = trainer_state

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        self.trainer_state.global_step += 1
        return next_tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict


def _reward_model_module(
    cfg: GRPORecipeConfig, reward_model, reward_tokenizer, policy_tokenizer
) -> HFRewardModelWrapper:
    keys = {name: tensordict_key(key) for name, key in dataclasses.asdict(cfg.reward.read_keys).items()}
    common = {
        "inference_mode": True,
        "micro_batch_size": cfg.reward.micro_batch_size,
        "max_length": cfg.reward.max_length,
        "check_finite": True,  # a NaN reward stops the run, naming the reward model
        "share_prefixes": cfg.reward.share_prompt,
    }
    if cfg.reward.input == "tokens":
        if reward_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
            raise ConfigError(
                "reward.input=tokens feeds the policy's token ids to the reward model, but the two tokenizers differ "
                f"({cfg.model.name_or_path} vs {cfg.reward_model.name_or_path}); use reward.input=history or text."
            )
        return HFRewardModelWrapper(
            reward_model, token_key=keys["tokens"], attention_mask_key=keys["attention_mask"], **common
        )
    if cfg.reward.input == "text":
        return HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, text_key=keys["text"], **common)
    return HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, history_key=keys["history"], **common)


class ResponseText(TensorDictModuleBase):
    """Decodes the responses of a :class:`PromptEnv` step into what text-reading reward modules read.

    Writes, as TorchRL's LLM wrappers lay them out: ``("text", "response")`` (the response with its special tokens,
    padding removed), ``("text", "full")`` (the rendered prompt + that response) and ``("history", "full")`` (the
    prompt's messages + ``{"role": "assistant", "content": <the response without special tokens>}``), one Python
    object per row. Put it in front of such a module inside ``interop.RewardModelTransform`` (e.g. in a
    ``TensorDictSequential``): the transform scores a scratch selection of the step, so these objects never enter
    the rollout that a collector copies.

    Args:
        prompts: the env's :class:`PromptTable`.
        tokenizer: the policy's tokenizer.

    Keyword Args:
        keys: which of the three entries to write (decoding only what is asked).
    """

    KEYS = (("text", "response"), ("text", "full"), ("history", "full"))

    def __init__(self, prompts: PromptTable, tokenizer, *, keys: Sequence = KEYS) -> None:
        super().__init__()
        keys = [tuple(key) for key in keys]
        unknown = [key for key in keys if key not in self.KEYS]
        if unknown:
            raise ValueError(f"ResponseText: {unknown} are not among the entries it writes, {list(self.KEYS)}.")
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.in_keys = [RESPONSE_TOKENS, ATTENTION_MASK, PROMPT_INDEX]
        self.out_keys = keys

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tokens = tensordict.get(RESPONSE_TOKENS)
        mask = tensordict.get(ATTENTION_MASK)[..., -tokens.shape[-1] :]
        rows = kept_token_ids(tokens.reshape(-1, tokens.shape[-1]).cpu(), mask.reshape(-1, mask.shape[-1]).cpu())
        indices = tensordict.get(PROMPT_INDEX).reshape(-1).tolist()
        keys = set(self.out_keys)
        if keys & {("text", "response"), ("text", "full")}:
            texts = self.tokenizer.batch_decode(rows, skip_special_tokens=False)
            if ("text", "response") in keys:
                tensordict.set(("text", "response"), non_tensor_rows(texts))
            if ("text", "full") in keys:
                full = [self.prompts.rendered(i)[0] + text for i, text in zip(indices, texts, strict=True)]
                tensordict.set(("text", "full"), non_tensor_rows(full))
        if ("history", "full") in keys:
            replies = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
            conversations = [
                [*self.prompts.conversations[i], {"role": "assistant", "content": reply}]
                for i, reply in zip(indices, replies, strict=True)
            ]
            tensordict.set(("history", "full"), non_tensor_rows(conversations))
        return tensordict


class LengthPenalty(TensorDictModuleBase):
    """Reward term ``-coefficient * max(0, response_tokens - free_tokens)``: discourages rambling responses.

    Keyword Args:
        coefficient: penalty per token beyond ``free_tokens``.
        free_tokens: response length that costs nothing.
        tokens_key: the response token ids: one tensor per sample (TorchRL's ragged layout), or a dense ``[B, R]``
            tensor, whose length per row is then read from the last ``R`` columns of ``mask_key``.
        mask_key: the attention mask of dense rows (``[pads | prompt | response | pads]``, as
            ``interop.sampling.CausalLMSampler`` writes it); ignored for ragged samples.
        pad_token_id: with ragged samples, or dense ones without a mask: the id not counted as a token; ``None``
            counts every position.
        reward_key: the entry written, one float per sample.

    Examples:
        >>> import torch
        >>> from tensordict import lazy_stack, TensorDict
        >>> td = lazy_stack([TensorDict({"tokens": {"response": torch.ones(n, dtype=torch.long)}}) for n in (3, 12)])
        >>> LengthPenalty(coefficient=0.5, free_tokens=10)(td)["length_penalty"]
        tensor([ 0., -1.])
        >>> dense = TensorDict(
        ...     {"tokens": {"response": torch.tensor([[5, 1, 0], [5, 6, 1]])},
        ...      "masks": {"all_attention_mask": torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]).bool()}},
        ...     batch_size=[2],
        ... )
        >>> LengthPenalty(coefficient=1.0, free_tokens=2)(dense)["length_penalty"]
        tensor([ 0., -1.])
    """

    def __init__(
        self,
        *,
        coefficient: float,
        free_tokens: int = 0,
        tokens_key: NestedKey = RESPONSE_TOKENS,
        mask_key: NestedKey | None = ATTENTION_MASK,
        pad_token_id: int | None = None,
        reward_key: NestedKey = "length_penalty",
    ) -> None:
        super().__init__()
        self.coefficient = coefficient
        self.free_tokens = free_tokens
        self.tokens_key = tokens_key
        self.mask_key = mask_key
        self.pad_token_id = pad_token_id
        self.in_keys = [tokens_key] + ([mask_key] if mask_key is not None else [])
        self.out_keys = [reward_key]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        flat = tensordict.reshape(-1)
        tokens = flat.get(self.tokens_key, as_list=True)
        mask = flat.get(self.mask_key, None, as_list=True) if self.mask_key is not None else None
        if isinstance(tokens, torch.Tensor) and isinstance(mask, torch.Tensor):
            lengths = mask[:, -tokens.shape[-1] :].sum(-1).float()  # dense rows: the response's mask columns
        else:
            lengths = torch.tensor(
                [float(t.numel() if self.pad_token_id is None else (t != self.pad_token_id).sum()) for t in tokens]
            )
        penalty = 0.0 - self.coefficient * (lengths - self.free_tokens).clamp_min(0.0)  # 0.0 - x: no -0.0
        tensordict.set(self.out_keys[0], penalty.reshape(tensordict.batch_size))
        return tensordict


class TextScoreReward(TensorDictModuleBase):
    """Reward term ``score(response_text)`` from any text scorer (a rule, a verifier, the task's oracle); as a
    ``reward.terms`` entry its ``weight`` scales it in the sum.

    Args:
        score: ``callable(str) -> float``, e.g. ``recipes.tasks.synthetic.oracle_score``.

    Keyword Args:
        text_key: the response text (TorchRL's wrappers write ``("text", "response")``, special tokens included).
        strip: substrings removed from the text before scoring (e.g. the EOS string).
        reward_key: the entry written, one float per sample.

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"text": {"response": ["it is good.", "it is bad."]}}, batch_size=[2])
        >>> TextScoreReward(len)(td)["text_score"]
        tensor([11., 10.])
    """

    def __init__(
        self,
        score: Callable[[str], float],
        *,
        text_key: NestedKey = ("text", "response"),
        strip: Sequence[str] = (),
        reward_key: NestedKey = "text_score",
    ) -> None:
        super().__init__()
        if not callable(score):
            raise TypeError(f"TextScoreReward: score must be callable(str) -> float, got {type(score).__name__}.")
        self.score = score
        self.text_key = text_key
        self.strip = tuple(strip)
        self.in_keys = [text_key]
        self.out_keys = [reward_key]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        texts = tensordict.reshape(-1).get(self.text_key)
        texts = [texts] if isinstance(texts, str) else texts.tolist()  # a NonTensorStack of one string per sample
        values = []
        for text in texts:
            for piece in self.strip:
                text = text.replace(piece, "")
            values.append(float(self.score(text)))
        tensordict.set(self.out_keys[0], torch.tensor(values).reshape(tensordict.batch_size))
        return tensordict


def reward_prompt_lengths(cfg: GRPORecipeConfig, table: PromptTable, policy_lengths: torch.Tensor) -> list[int]:
    """Each prompt's length as the reward model reads it (``reward.input``): the prefix before any response token."""
    if cfg.reward.input == "tokens":  # the policy's own token ids
        return policy_lengths.tolist()
    reward_tokenizer = load_tokenizer(config_view(cfg.reward_model), padding_side="right")
    if cfg.reward.input == "text":  # the policy's rendered prompt, re-tokenized
        texts = [table.rendered(index)[0] for index in range(len(table))]
        return [len(ids) for ids in reward_tokenizer(texts)["input_ids"]]
    rendered = reward_tokenizer.apply_chat_template(table.conversations, tokenize=True, return_dict=True)
    return [len(ids) for ids in rendered["input_ids"]]
