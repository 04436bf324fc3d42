"""What a GRPO step collects, built from the recipe config: env -> policy -> reward -> dense batch.

Two rollouts, chosen by ``rollout.env``:

- ``prompt`` (the default): :class:`~recipes.common.prompt_env.PromptEnv` (dense prompt batches) + the reward
  transforms, stepped by :class:`~recipes.common.sampling.SamplingPolicy` (one decoding loop per step, recording the
  behaviour log-probs), driven by a TorchRL ``Collector``. With ``rollout.mode=async`` that collector runs in a child
  process (:class:`~recipes.common.collectors.BackgroundCollector`) one batch ahead of the learner.
- ``chat``: TorchRL's ``ChatEnv`` + ``TransformersWrapper`` + ``LLMCollector``, for users who plug in TorchRL's
  multi-turn and tool transforms; its ragged rollout is padded into the same dense layout.

Both yield the same batch (:data:`BATCH_KEYS`, ``[B, T]`` tensors in ``generate``'s layout), which
:class:`PrepareBatch` completes on the learner's side (advantages, reference and, where missing, old log-probs).

Dependencies: torch, tensordict, torchrl, transformers, and the project's ``interop`` package.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Mapping

import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.collectors.llm import LLMCollector

from interop import HFRewardModelWrapper, RewardModelTransform
from recipes.common.collectors import BackgroundCollector, LocalCollector
from recipes.common.config import ConfigError, run_config, tensordict_key
from recipes.common.data import load_prompts
from recipes.common.log_probs import ResponseLogProbs, ScoreLogProbs
from recipes.common.lora import load_policy
from recipes.common.losses import GroupAdvantage
from recipes.common.models import load_reward_model, load_tokenizer
from recipes.common.prompt_env import PromptEnv, PromptTable, ResponseText
from recipes.common.rollout import CHAT_STEP_KEYS, make_chat_env, make_policy, make_prompt_dataloader, pad_rollout
from recipes.common.sampling import SamplingPolicy, SamplingSettings

__all__ = [
    "BATCH_KEYS",
    "PrepareBatch",
    "build_prompt_collector",
    "check_reward_keys",
    "make_collector",
    "make_reward_transforms",
    "rollout_step_keys",
]

# What a step hands the learner: the dense sequences, the behaviour log-probs, the group ids, rewards and the policy
# version the responses were sampled with.
BATCH_KEYS = (
    ("tokens", "prompt"),
    ("tokens", "response"),
    ("tokens", "full"),
    ("masks", "all_attention_mask"),
    ("log_probs", "full"),
    "prompt_index",
    "policy_version",
    ("next", "reward"),
    ("next", "done"),
)
REWARD_INPUTS = ("history", "text", "tokens")
# The reward.read_keys entries the reward model reads, for each reward.input.
READ_KEYS_OF_INPUT = {"history": ("history",), "text": ("text",), "tokens": ("tokens", "attention_mask")}


def _as_tuple(key: NestedKey) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def rollout_step_keys(cfg: DictConfig) -> list[tuple]:
    """The entries a step of ``cfg.rollout.env``'s rollout holds when the reward transforms read it.

    ``prompt``: what :class:`PromptEnv` resets, what :class:`SamplingPolicy` writes, and the text and conversations
    :class:`ResponseText` decodes for the rewards that read them. ``chat``: TorchRL's layout
    (``recipes.common.rollout.CHAT_STEP_KEYS``), with ``("log_probs", "response")`` when
    ``rollout.generation.return_log_probs`` asks for it.
    """
    if cfg.rollout.env == "chat":
        keys = list(CHAT_STEP_KEYS)
        generation = cfg.rollout.generation
        if "return_log_probs" in generation and generation.return_log_probs:
            keys.append(("log_probs", "response"))
    else:
        keys = [*PromptEnv.RESET_KEYS, *SamplingPolicy.OUT_KEYS, *ResponseText.KEYS]
    return [_as_tuple(key) for key in keys]


def _term_read_keys(node: DictConfig) -> dict:
    """The settings of a reward term's node that name an entry the term reads: its ``_target_``'s parameters
    annotated ``NestedKey`` (as ``LengthPenalty``'s and ``TextScoreReward``'s are), but ``reward_key``, the entry it
    writes. Only the target is imported; nothing is built."""
    if "_target_" not in node:
        return {}
    parameters = inspect.signature(get_object(node._target_)).parameters
    return {
        name: node[name]
        for name in node
        if name in parameters
        and name != "reward_key"
        and "NestedKey" in str(parameters[name].annotation)
        and node[name] is not None
    }


def check_reward_keys(cfg: DictConfig) -> None:
    """Refuses a key the rewards would read that the rollout does not hold, before anything loads.

    Checks the ``reward.read_keys`` entries that ``reward.input`` reads (call it once ``reward.input`` is known to be
    one of :data:`REWARD_INPUTS`), and the keys the extra reward terms (``reward.terms``) are set to read.

    Raises:
        ConfigError: naming the setting, the key, and the entries :func:`rollout_step_keys` lists.
    """
    held = rollout_step_keys(cfg)
    listed = ", ".join(f"[{', '.join(entry)}]" for entry in held)
    read = {}
    for name in READ_KEYS_OF_INPUT[cfg.reward.input]:
        if name not in cfg.reward.read_keys:
            raise ConfigError(
                f"reward.input={cfg.reward.input} reads reward.read_keys.{name}, which is not set. Set it to the entry "
                f"to score; a step of rollout.env={cfg.rollout.env} holds {listed}."
            )
        read[f"reward.read_keys.{name}"] = cfg.reward.read_keys[name]
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


def make_reward_transforms(
    cfg: DictConfig, reward_model, reward_tokenizer, policy_tokenizer, *, prompts: PromptTable | None = None
) -> list:
    """``RewardModelTransform`` over the reward model, then one accumulating transform per extra reward term.

    ``prompts``: the :class:`PromptTable` of a ``PromptEnv``, whose steps hold tokens only: text and conversations
    are then decoded for the modules that read them (:class:`ResponseText`), inside the transform. ``None`` for
    TorchRL's ``ChatEnv``, whose policy writes them.
    """
    keys = {name: tensordict_key(key) for name, key in cfg.reward.read_keys.items()}
    common = {
        "inference_mode": True,
        "micro_batch_size": cfg.reward.micro_batch_size,
        "max_length": cfg.reward.max_length,
    }
    if cfg.reward.input == "tokens":
        if reward_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
            raise ConfigError(
                "reward.input=tokens feeds the policy's token ids to the reward model, but the two tokenizers differ "
                f"({cfg.model.name_or_path} vs {cfg.reward_model.name_or_path}); use reward.input=history or text."
            )
        scorer = HFRewardModelWrapper(
            reward_model, token_key=keys["tokens"], attention_mask_key=keys["attention_mask"], **common
        )
    elif cfg.reward.input == "text":
        scorer = HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, text_key=keys["text"], **common)
    else:
        scorer = HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, history_key=keys["history"], **common)
    modules = [scorer, *(instantiate(term) for term in cfg.reward.terms.values())]
    if prompts is not None:
        modules = [_with_response_text(module, prompts, policy_tokenizer) for module in modules]
    return [RewardModelTransform(modules[0])] + [RewardModelTransform(m, accumulate=True) for m in modules[1:]]


def _dense_batch(rollout: TensorDictBase) -> TensorDictBase:
    """A collector's ``[B, 1]`` output (one step per dialog) as the flat batch of :data:`BATCH_KEYS` (a view: the
    collector copies what its postproc returns)."""
    return rollout.reshape(-1).select(*BATCH_KEYS)


def _stream_start(cfg: DictConfig, start_step: int, num_replicas: int) -> int:
    # The prompt stream is a function of the step (each step draws per_step / group prompts per process): resuming
    # continues it.
    return start_step * (cfg.rollout.responses_per_step // cfg.rollout.group_size) * num_replicas


def _prompt_collector(
    cfg: DictConfig,
    prompts: list,
    *,
    policy_model,
    tokenizer,
    reward_model,
    reward_tokenizer,
    start_step: int,
    num_replicas: int,
    rank: int,
) -> tuple[Collector, SamplingPolicy]:
    """``PromptEnv`` + reward transforms, stepped by a ``SamplingPolicy``, driven by a TorchRL ``Collector``."""
    group, per_step = cfg.rollout.group_size, cfg.rollout.responses_per_step
    prompts = PromptTable(prompts, tokenizer=tokenizer, system_prompt=cfg.rollout.system_prompt)
    env = PromptEnv(
        prompts,
        tokenizer=tokenizer,
        group_size=group,
        num_prompts=per_step // group,
        seed=cfg.seed,
        start=_stream_start(cfg, start_step, num_replicas),
        num_replicas=num_replicas,
        rank=rank,
        device=cfg.device,
    )
    for transform in make_reward_transforms(cfg, reward_model, reward_tokenizer, tokenizer, prompts=prompts):
        env = env.append_transform(transform)
    policy = SamplingPolicy(policy_model, tokenizer, settings=SamplingSettings.from_mapping(cfg.rollout.generation))
    # One env step per batch: B dialogs of one turn each. Endless: the learner decides when to stop.
    collector = Collector(
        env,
        policy,
        frames_per_batch=per_step,
        total_frames=-1,
        postproc=_dense_batch,
        use_buffers=False,
        auto_register_policy_transforms=False,  # the policy reads no recurrent state: nothing to register
    )
    return collector, policy


def build_prompt_collector(
    config: Mapping, *, start_step: int, num_replicas: int, rank: int
) -> tuple[Collector, SamplingPolicy]:
    """Loads the models a ``rollout.env=prompt`` collector needs and builds it: what a background collector runs.

    Args:
        config: the recipe config as a plain, resolved mapping (picklable, no Hydra state needed).
    """
    cfg = OmegaConf.create(dict(config))
    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    reward_tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
    reward_model = load_reward_model(
        cfg.reward_model, device=cfg.device, dtype=cfg.dtype, pad_token_id=reward_tokenizer.pad_token_id
    ).eval()
    return _prompt_collector(
        cfg,
        load_prompts(cfg.data, "train"),
        # The weights are the learner's, loaded over these by the background collector before every batch.
        # With LoRA, built as the learner builds its policy: the parameter names match, so all of them (the
        # unchanging base included) are copied; a resumed run's adapter weights arrive the same way.
        policy_model=load_policy(cfg.model, device=cfg.device, dtype=cfg.dtype).eval(),
        tokenizer=tokenizer,
        reward_model=reward_model,
        reward_tokenizer=reward_tokenizer,
        start_step=start_step,
        num_replicas=num_replicas,
        rank=rank,
    )


def _chat_collector(
    cfg: DictConfig, prompts: list, models, *, start_step: int, num_replicas: int, rank: int
) -> LocalCollector:
    """TorchRL's ``ChatEnv`` + ``TransformersWrapper`` + ``LLMCollector``, its rollouts padded into dense batches."""
    group, per_step = cfg.rollout.group_size, cfg.rollout.responses_per_step
    loader = make_prompt_dataloader(
        prompts,
        seed=cfg.seed,
        start=_stream_start(cfg, start_step, num_replicas),
        num_replicas=num_replicas,
        rank=rank,
    )
    env = make_chat_env(
        loader,
        tokenizer=models.tokenizer,
        group_size=group,
        num_prompts=per_step // group,
        system_prompt=cfg.rollout.system_prompt,
        transforms=make_reward_transforms(cfg, models.reward_model, models.reward_tokenizer, models.tokenizer),
    )
    version = torch.zeros((), dtype=torch.long)
    pad_token_id = models.tokenizer.pad_token_id
    policy = make_policy(
        models.policy,
        models.tokenizer,
        generation=cfg.rollout.generation,
        device=cfg.device,
        generation_key="rollout.generation",
    )

    def to_dense(rollout: TensorDictBase) -> TensorDictBase:
        # Only what the loss and the metrics read goes on, as dense [B, T] tensors: the ragged per-sample tensors,
        # chat histories and texts would cost more to move around than the forward passes. TorchRL's wrapper
        # zeroes the first response log-prob: the old log-probs are scored again where a step needs them.
        rollout = rollout.reshape(-1)  # [B, 1]: one step per dialog
        batch = pad_rollout(rollout, pad_token_id=pad_token_id)
        batch.update(rollout.select("prompt_index", ("next", "reward"), ("next", "done")).to_tensordict())
        batch.set("policy_version", version.expand(batch.shape[0]).clone())
        return batch

    collector = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=per_step,
        total_dialog_turns=max(cfg.train.steps - start_step, 1) * per_step,
        postproc=to_dense,
    )
    return LocalCollector(collector, policy, version)


def make_collector(cfg: DictConfig, models, *, prompts: list, start_step: int, num_replicas: int = 1, rank: int = 0):
    """The collector of ``cfg.rollout``: yields one step's dense batch (:data:`BATCH_KEYS`) per iteration and takes
    the learner's weights with ``update_policy_weights_(model, version=...)``; ``shutdown()`` when done.

    ``models``: the learner's models (``policy``, ``tokenizer``, and, unless the collector runs in the background,
    ``reward_model`` and ``reward_tokenizer``). ``prompts``: the training prompts, already read (a background
    collector reads them again in its own process)."""
    if cfg.rollout.env == "chat":
        return _chat_collector(cfg, prompts, models, start_step=start_step, num_replicas=num_replicas, rank=rank)
    if cfg.rollout.mode == "async":
        factory = functools.partial(
            build_prompt_collector,
            OmegaConf.to_container(run_config(cfg), resolve=True),
            start_step=start_step,
            num_replicas=num_replicas,
            rank=rank,
        )
        return BackgroundCollector(
            factory,
            models.policy,
            start_version=start_step,
            max_policy_lag=cfg.rollout.max_policy_lag,
            num_threads=cfg.rollout.collector_threads,
            # Its own sampling noise per rank and per resumed segment of the run.
            seed=cfg.seed + rank + 7919 * start_step,
        )
    collector, policy = _prompt_collector(
        cfg,
        prompts,
        policy_model=models.policy,
        tokenizer=models.tokenizer,
        reward_model=models.reward_model,
        reward_tokenizer=models.reward_tokenizer,
        start_step=start_step,
        num_replicas=num_replicas,
        rank=rank,
    )
    policy.version.fill_(start_step)
    return LocalCollector(collector, policy, policy.version)


class PrepareBatch:
    """The learner's side of a step: group advantages, then the log-probs a batch still needs, in place.

    Args:
        group_size: responses per prompt (each batch holds whole groups).

    Keyword Args:
        reference: a ``ResponseLogProbs`` over the frozen reference model, or ``None`` (no KL term).
        policy: a ``ResponseLogProbs`` over the policy, to score the old log-probs of batches whose collector records
            none usable (TorchRL's ``TransformersWrapper``) when a step makes several updates; ``None``: the batch
            carries them, or is trained on-policy (the loss takes its own log-probs).
        micro_batch_size: sequences per scoring forward pass; ``None``: all at once.
    """

    def __init__(
        self,
        group_size: int,
        *,
        reference: ResponseLogProbs | None,
        policy: ResponseLogProbs | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.advantage = GroupAdvantage(group_size, prompt_key="prompt_index")
        self.reference = None
        if reference is not None:
            self.reference = ScoreLogProbs(
                reference, out_key=("next", "ref_log_probs", "full"), micro_batch_size=micro_batch_size
            )
        self.policy = (
            ScoreLogProbs(policy, out_key=("log_probs", "full"), micro_batch_size=micro_batch_size) if policy else None
        )

    def __call__(self, batch: TensorDictBase) -> dict[str, float]:
        """Completes ``batch`` in place; returns how long it took (``advantage_s``, ``log_probs_s``)."""
        start = time.perf_counter()
        self.advantage(batch)
        scored = time.perf_counter()
        if self.reference is not None:
            self.reference(batch)
        if self.policy is not None:
            self.policy(batch)
        return {"advantage_s": scored - start, "log_probs_s": time.perf_counter() - scored}
