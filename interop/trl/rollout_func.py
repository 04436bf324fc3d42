"""A TorchRL LLM policy as trl's ``rollout_func``: trl's ``GRPOTrainer`` sampling through TorchRL.

Public names:

- :class:`TorchRLRolloutFunc`: wraps a TensorDict policy that reads left-padded prompt tokens and writes response
  tokens and their log-probs in TorchRL's layout (``interop.CausalLMSampler``, TorchRL's ``TransformersWrapper`` in
  generate mode, or any module with the same keys) as the ``rollout_func`` of ``trl.GRPOTrainer``. Built without a
  policy, it samples with a :class:`~interop.sampling.CausalLMSampler` around the trainer's model, with the
  trainer's ``GRPOConfig`` sampling settings. Optionally writes every rollout into a TorchRL ``ReplayBuffer``.
- :data:`PAST_LAG_BOUND`: the choices of its ``past_lag_bound`` (what async mode does with a batch that would train
  past ``max_policy_lag``: ``"withhold"`` or ``"resample"``).

trl's contract (trl 1.16, ``GRPOTrainer._generate``): the function gets the process's prompts (trl's sampler has already
repeated each prompt ``num_generations`` times, consecutively) and the trainer, and returns one completion per prompt:
``prompt_ids``, ``completion_ids`` and ``logprobs`` as lists of lists (the sampled tokens' log-probs under the sampling
weights). Chat templating is the function's job: conversational prompts go through the tokenizer's chat template
with ``add_generation_prompt=True`` and the trainer's ``chat_template_kwargs``, plain ones through the tokenizer, as
trl's own generation tokenizes them, so that both paths train on the same tokens.

Which weights sample: the policy module must hold the very model trl trains (the same ``nn.Module``, not a copy), so
that every optimizer step is seen by the next generation with no weight sync. The adapter checks it on each call, and
that the policy samples as the trainer's ``GRPOConfig`` says (``max_completion_length``, ``temperature``, ``top_k``,
``top_p``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``): a policy built with other settings is refused,
naming both values.

Tools: built with ``tools=[functions]`` (trl's tools: typed functions with docstrings; or an
:class:`interop.tools.ToolSet` / :class:`interop.tools.ToolRunner`), it samples each prompt's whole dialog with
:class:`interop.tools.dialogs.DialogSampler`: the model writes, its tool calls run in a worker process, their results
join the completion as the chat template's ``tool`` messages, and it writes on, up to ``max_turns`` assistant turns,
within ``max_completion_length`` tokens in all. It returns trl's contract for a tool-calling rollout:
``completion_ids`` with the tool messages' tokens inside, ``logprobs`` (0 on tool tokens) and ``env_mask`` (0 on tool
tokens: trl's loss skips them), laid out as trl's own ``tools=`` path lays out the same dialog.

Dependencies: ``torch``, ``tensordict``, ``torchrl``; ``transformers`` tokenizers are duck-typed (``pad_token_id``,
``__call__``, ``apply_chat_template``, ``batch_decode``).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDict, TensorDictBase
from tensordict.utils import unravel_key

from interop.sampling.rollouts import RESPONSE_LOG_PROBS, TOOL_COUNTS, RolloutSampler
from interop.sampling.sampler import LOG_PROBS as FULL_LOG_PROBS
from interop.sampling.sampler import (
    PROMPT_MASK,
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    CausalLMSampler,
    SamplingSettings,
    check_pad_token,
)
from interop.tools.runner import DEFAULT_TIMEOUT_S, ToolRunner, ToolSet

if TYPE_CHECKING:  # for annotations; imported where the workers start
    from interop.sampling.workers import RolloutWorkers

__all__ = ["PAST_LAG_BOUND", "TorchRLRolloutFunc", "message_text"]

# What happens to an async batch that would train past max_policy_lag: not sampled ahead, or sampled again.
PAST_LAG_BOUND = ("withhold", "resample")

# Distinct prompts whose token ids are kept (a dataset's worth; past it the cache starts again).
_MAX_CACHED_PROMPTS = 1 << 16
# The keys the adapter can fill for a policy: the prompts, left-padded, and their mask.
_INPUTS = (PROMPT_TOKENS, PROMPT_MASK)
# TorchRL TransformersWrapper generate_kwargs -> the trl GRPOConfig field that sets the same thing.
_WRAPPER_SETTINGS = {
    "max_new_tokens": "max_completion_length",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def _check_prompt_shapes(prompts: list) -> None:
    """Refuses prompts in a shape trl never passes, naming the first: each must be a string or a conversation (a list
    of messages, each with a ``"role"``), all of one kind (a dataset's prompt column holds one)."""
    kinds = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            kinds.append("text")
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(message, Mapping) and "role" in message for message in prompt)
        ):
            kinds.append("conversation")
        else:
            raise ValueError(
                f"TorchRLRolloutFunc: prompt {row} is {_shown(prompt)}; trl passes each prompt as a string or as a "
                'conversation, a list of {"role": ..., "content": ...} messages. Give the dataset\'s "prompt" column '
                "one of these."
            )
        if kinds[-1] != kinds[0]:
            raise ValueError(
                f"TorchRLRolloutFunc: prompt 0 is {kinds[0]} and prompt {row} is {kinds[-1]}: one batch is rendered "
                "one way (conversations through the chat template, text as it is). Make the dataset's prompt column "
                "all strings or all conversations."
            )


def _shown(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _declares(out_keys: Sequence[NestedKey], key: tuple) -> bool:
    """Whether ``out_keys`` names ``key`` or a parent of it (TorchRL's wrapper declares ``"log_probs"`` whole)."""
    for declared in out_keys:
        declared = unravel_key(declared)
        declared = (declared,) if isinstance(declared, str) else declared
        if key[: len(declared)] == declared:
            return True
    return False


def message_text(value: Any) -> str:
    """The text of a prompt or completion as trl passes it: a string, or a message list (its last message's).

    Examples:
        >>> message_text("Hi"), message_text([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
        ('Hi', 'b')
    """
    if isinstance(value, str):
        return value
    content = value[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)


def _worker_resources(value):
    """``worker_resources`` as given, or built from a dict of its fields."""
    if isinstance(value, dict):
        from interop.sampling.workers import WorkerResources

        return WorkerResources(**value)
    return value


def _model_of(module: torch.nn.Module) -> torch.nn.Module:
    """The innermost model a (DDP / accelerate / PEFT) wrapper holds."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


class TorchRLRolloutFunc:
    """A TorchRL LLM policy as ``trl.GRPOTrainer(rollout_func=...)``.

    Args:
        policy: a TensorDict module that reads ``("tokens", "prompt")`` (left-padded ``[B, P]``; it may also read
            ``("masks", "prompt")``, True on real tokens) and writes ``("tokens", "response")`` and the sampled tokens'
            log-probs, either ``("log_probs", "response")`` (``[B, R]``, TorchRL's ``TransformersWrapper``) or
            ``("log_probs", "full")`` (``[B, P + R]``, the response from column ``P``: :class:`CausalLMSampler`).
            The response mask is read from ``("masks", "all_attention_mask")`` when written (``[B, P + R]``), else it
            is the response tokens that are not the pad id. Ragged (lazily stacked) outputs are padded on read.
            ``None``: at the first call, a :class:`~interop.sampling.CausalLMSampler` around the trainer's model, with
            its ``GRPOConfig``'s sampling settings (:meth:`SamplingSettings.from_grpo_config`) and its log-probs at
            trl's temperature.
        tokenizer: the policy's tokenizer (its pad id must differ from EOS, and its chat template renders
            conversational prompts); ``None``: the trainer's ``processing_class``, at the first call.

    Keyword Args:
        replay_buffer: a TorchRL ``ReplayBuffer`` that every rollout is written into, one entry per completion, each
            unpadded (TorchRL's ragged LLM layout: give it a ``LazyStackStorage``): ``prompt_ids``,
            ``completion_ids``, ``logprobs``, ``truncated``, ``step`` (the trainer's ``global_step`` when it was
            sampled: the updates the sampling weights had had) and ``completion_text``. Under
            ``interop.TorchRLGRPOTrainer`` the rows are written once trl has scored them, with ``prompt``, ``rewards``
            (``[K]``, each reward function's value, NaN where one returned ``None``), ``reward`` (trl's weighted sum),
            ``advantage`` (trl's) and ``train_step`` (the trainer's ``global_step`` when it trains on them) too.
            ``None``: none.
        model: the ``nn.Module`` that samples, checked against the trainer's model at each call; ``None``: the
            policy's ``model`` attribute (TorchRL's wrappers and :class:`CausalLMSampler` have one).
        mode: ``"sync"``: each generation batch is sampled when trl asks for it, with the weights trl trains (the same
            module, no copy). ``"async"``: while trl updates on generation batch ``k``, a child process
            (:class:`~interop.sampling.background.BackgroundSampler`, a :class:`CausalLMSampler` on a copy of the
            weights published at each call) samples batch ``k + 1``, whose prompts ``interop.TorchRLGRPOTrainer``
            reads ahead from the prompt stream; the trainer gives trl the sampling log-probs as its old log-probs, so
            that its importance ratio corrects the lag. A pre-sampled batch is used only for the very prompts trl
            passes (anything else is sampled again, counted) and at most ``max_policy_lag`` updates old. Every
            training batch is sampled there, at ``sampler_dtype``: the first one, and any sampled again, with the
            current weights while trl waits.
        max_policy_lag: async: the most optimizer steps a batch's sampling weights may be behind the weights it is
            trained at (what happens to a batch past it: ``past_lag_bound``).
        past_lag_bound: async: what happens to the next generation batch when sampling it ahead would train it more
            than ``max_policy_lag`` steps old (trl updates ``steps_per_generation * num_iterations /
            gradient_accumulation_steps`` times per generation batch, rounded up). ``"withhold"``: it is not sampled
            ahead but once the weights are recent enough: at the optimizer step ``max_policy_lag`` steps before trl
            asks for it (:meth:`on_optimizer_step`, which ``interop.TorchRLGRPOTrainer`` calls), or when trl asks
            for it (``stats["withheld"]``, and ``"withheld_s"``: how long trl waited for it). ``"resample"``: it is
            sampled ahead anyway, and sampled again with the current weights when trl asks for it past the bound
            (``stats["resampled"]``). Either way no batch trains past the bound; ``"resample"`` throws the first
            sampling away.
        backend: where training batches are sampled. ``"learner"``: in this process (sync mode only);
            ``"processes"``: in ``workers`` local child processes; ``"ray"``: in ``workers`` Ray actors on the
            cluster this process is connected to (:func:`interop.sampling.workers.connect_ray`). Apart from the
            learner, each worker samples with a :class:`CausalLMSampler` on a copy of the weights, published after
            every update (:class:`interop.sampling.workers.RolloutWorkers`), and each prompt group goes to exactly one
            worker; in sync mode the batch trl asks for is sampled there with the current weights, in async mode one
            generation batch ahead. ``None``: ``"learner"`` in sync mode, ``"processes"`` in async mode.
            Evaluation batches (trl's model in eval mode) are sampled here in every case.
        workers: apart from the learner: how many samplers.
        worker_resources: ``"ray"``: what each worker takes of the cluster
            (:class:`interop.sampling.workers.WorkerResources`, or a dict of its fields).
        sampler_threads: apart from the learner: torch threads of each sampler.
        weight_sync_every: apart from the learner: the weights are published every this many optimizer steps (1:
            each); every row keeps the version that sampled it (``step``). A batch is then up to
            ``weight_sync_every - 1`` steps old in sync mode, ``weight_sync_every`` in async mode: refused beyond
            ``max_policy_lag``.
        sampler_dtype: apart from the learner: what the samplers compute in (``None``: the model's; e.g.
            ``torch.bfloat16``), a copy cast at each publication; the log-probs returned are that sampler's.
        seed: apart from the learner: the samplers' torch seed (worker ``i``: ``seed + i``).
        tools: the tools the model may call (trl's form: typed functions with a docstring), an
            :class:`interop.tools.ToolSet`, or a :class:`interop.tools.ToolRunner` (the caller's, which the caller
            closes); each prompt is then sampled as a dialog (:class:`interop.tools.dialogs.DialogSampler`, turns ending
            at EOS as trl's do) and the output has ``env_mask``. Needs ``policy=None`` (the dialog sampler runs around
            the trainer's model); in async mode the sampling process runs the dialogs with a tool worker of its own.
            Refused beside trl's own ``tools=`` (two tool loops).
            ``None``: single-turn completions.
        max_turns: tools: assistant turns per dialog, at most (trl's ``max_tool_calling_iterations`` + 1). ``None``:
            the trainer's ``GRPOConfig.max_tool_calling_iterations`` + 1, or, where that is ``None`` (trl: no limit),
            as many as ``max_completion_length`` allows. A value that disagrees with a set
            ``max_tool_calling_iterations`` is refused, naming both.
        tool_timeout_s: tools given as functions: the longest a call may run (its worker process is killed past it).
        max_result_tokens: tools given as functions: a result longer than this many tokens is cut (``None``: never).

    TorchRL 0.14.1's ``TransformersWrapper`` writes 0 as the first response token's log-prob in generate mode; the
    adapter computes that one log-prob again from a forward pass over the prompts (logits of the last position only),
    so the log-probs trl gets are the sampling policy's from the first token.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModuleBase
        >>> class Echo(TensorDictModuleBase):  # "samples" the prompt's last token twice, log-prob -1 each
        ...     in_keys, out_keys = [("tokens", "prompt")], [("tokens", "response"), ("log_probs", "response")]
        ...     def forward(self, td):
        ...         last = td["tokens", "prompt"][:, -1:]
        ...         td["tokens", "response"] = last.repeat(1, 2)
        ...         td["log_probs", "response"] = -torch.ones(last.shape[0], 2)
        ...         return td
        >>> class Tokenizer:
        ...     pad_token_id, eos_token_id = 0, 1
        ...     def __call__(self, text):
        ...         return {"input_ids": [[ord(c) for c in t] for t in text]}
        ...     def batch_decode(self, rows, skip_special_tokens=True):
        ...         return ["".join(map(chr, row)) for row in rows]
        >>> rollout_func = TorchRLRolloutFunc(Echo(), Tokenizer(), model=torch.nn.Linear(1, 1))
        >>> out = rollout_func(["ab", "ab", "c", "c"], trainer=None)
        >>> out["prompt_ids"], out["completion_ids"], out["logprobs"][0]
        ([[97, 98], [97, 98], [99], [99]], [[98, 98], [98, 98], [99, 99], [99, 99]], [-1.0, -1.0])

        With trl, the policy and tokenizer can come from the trainer (a ``CausalLMSampler`` at the ``GRPOConfig``'s
        settings)::

            trainer = GRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(max_completion_length=16, ...),
                                  train_dataset=..., processing_class=tokenizer, rollout_func=TorchRLRolloutFunc())
    """

    def __init__(
        self,
        policy=None,
        tokenizer=None,
        *,
        replay_buffer=None,
        model: torch.nn.Module | None = None,
        mode: str = "sync",
        max_policy_lag: int = 1,
        past_lag_bound: str = "withhold",
        backend: str | None = None,
        workers: int = 1,
        worker_resources=None,
        sampler_threads: int = 1,
        weight_sync_every: int = 1,
        sampler_dtype: torch.dtype | None = None,
        seed: int = 0,
        tools=None,
        max_turns: int | None = None,
        tool_timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_tokens: int | None = None,
    ):
        backend = self._checked_backend(
            policy,
            mode=mode,
            max_policy_lag=max_policy_lag,
            past_lag_bound=past_lag_bound,
            backend=backend,
            workers=workers,
            weight_sync_every=weight_sync_every,
            sampler_dtype=sampler_dtype,
            tools=tools,
            max_turns=max_turns,
        )
        if policy is not None:
            self._check_policy(policy)
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        self.policy = policy
        self.tokenizer = tokenizer
        self.replay_buffer = replay_buffer
        self.model: Any = model if model is not None else getattr(policy, "model", None)  # None until built
        if policy is not None and not isinstance(self.model, torch.nn.Module):
            raise ValueError(
                f"TorchRLRolloutFunc: {type(policy).__name__} has no `model` attribute; pass model=<the nn.Module that "
                "samples>, so that the adapter can check it is the model trl trains."
            )
        if policy is not None and tokenizer is not None:
            self._check_policy_tokenizer(policy, tokenizer, self.model)
        self._sampler: RolloutSampler | None = None  # the sync core around the policy (_rollout_sampler)
        self.last_rollout: TensorDictBase | None = None
        self._ids: dict[tuple[str, str], list[int]] = {}  # prompt -> token ids (:meth:`tokenize`)
        self._vocab_checked = False
        # Rows are written once trl has scored them when a trainer reports the scores (record_scored).
        self.writes_scored_rows = False
        self.mode, self.max_policy_lag, self.past_lag_bound = mode, max_policy_lag, past_lag_bound
        self.backend, self.workers = backend, workers
        self.worker_resources = _worker_resources(worker_resources)
        self.sampler_threads, self.seed = sampler_threads, seed
        self.weight_sync_every, self.sampler_dtype = weight_sync_every, sampler_dtype
        # async: the prompts of the generation batch after a given one (interop.TorchRLGRPOTrainer sets it), the
        # child process, and the batch it samples.
        self.lookahead: Any = None  # prompts -> the next batch's prompts (a PromptLookahead)
        self._background: Any = None  # interop.sampling.workers.RolloutWorkers, once started
        self._forget_next_batch()
        self._release_step = 0
        # The last call's figures: policy_lag, resampled, withheld, withheld_s, lookahead_misses.
        self.stats: dict[str, float] = {}
        # tools: what the dialogs run (a ToolRunner built at the first call when functions were given), the turn
        # limit, and the last batch's dialogs (their messages show what the model saw).
        self.tools, self.max_turns = tools, max_turns
        self.tool_timeout_s, self.max_result_tokens = tool_timeout_s, max_result_tokens
        self.runner: ToolRunner | None = tools if isinstance(tools, ToolRunner) else None
        self._owns_runner = False
        self.last_dialogs = None
        self._correction_warned = False

    def _forget_next_batch(self) -> None:
        """Async: no next batch being sampled, none withheld."""
        self._pending: list | None = None  # the prompts of the batch the workers sample ahead
        # withhold: the next batch's prompts, when it is not sampled ahead (from self._release_step on it may be).
        self._withheld: list | None = None
        self._pending_withheld = False  # whether the batch being sampled was withheld first

    @classmethod
    def _checked_backend(
        cls,
        policy,
        *,
        mode: str,
        max_policy_lag: int,
        past_lag_bound: str,
        backend: str | None,
        workers: int,
        weight_sync_every: int,
        sampler_dtype,
        tools,
        max_turns: int | None,
    ) -> str:
        """Refuses, before anything is built, a way of sampling that cannot work (the mode, the lag bound, where it
        samples and how the weights get there, tools with a policy); returns the backend (``None``: the mode's)."""
        if mode not in ("sync", "async"):
            raise ValueError(f"TorchRLRolloutFunc: mode must be 'sync' or 'async', got {mode!r}.")
        if tools is not None:
            cls._check_tool_options(tools, policy=policy, max_turns=max_turns)
        if max_policy_lag < 0:
            raise ValueError(f"TorchRLRolloutFunc: max_policy_lag must be >= 0, got {max_policy_lag}.")
        if past_lag_bound not in PAST_LAG_BOUND:
            raise ValueError(
                f"TorchRLRolloutFunc: past_lag_bound must be one of {PAST_LAG_BOUND}, got {past_lag_bound!r}."
            )
        backend = cls._check_backend(mode, backend, workers)
        cls._check_weight_push(mode, backend, max_policy_lag, weight_sync_every, sampler_dtype)
        if backend != "learner" and policy is not None and not isinstance(policy, CausalLMSampler):
            raise ValueError(
                f"TorchRLRolloutFunc: mode={mode!r}, backend={backend!r} samples with a CausalLMSampler on a copy of "
                f"the weights apart from the learner; a {type(policy).__name__} cannot be copied there. Pass no policy "
                "(the default CausalLMSampler at the trainer's GRPOConfig settings) or a CausalLMSampler."
            )
        return backend

    @staticmethod
    def _check_weight_push(mode: str, backend: str, max_policy_lag: int, every: int, dtype) -> None:
        """``weight_sync_every`` and ``sampler_dtype``: a copy apart from the learner, within the lag bound."""
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"TorchRLRolloutFunc: weight_sync_every must be an integer >= 1, got {every!r}.")
        if backend == "learner" and (every != 1 or dtype is not None):
            raise ValueError(
                "TorchRLRolloutFunc: weight_sync_every and sampler_dtype set how the weights reach a copy apart from "
                "the learner; backend='learner' samples with the weights it trains. Use backend='processes' or 'ray'."
            )
        reached = every - 1 + (mode == "async")
        if every > 1 and reached > max_policy_lag:  # every=1: each update pushed, the mode's own lag bound holds
            raise ValueError(
                f"TorchRLRolloutFunc: weight_sync_every={every} in {mode} mode lets a batch be {reached} steps old, "
                f"more than max_policy_lag={max_policy_lag}; raise max_policy_lag or lower weight_sync_every."
            )

    @staticmethod
    def _check_backend(mode: str, backend: str | None, workers: int) -> str:
        """The backend, checked against the mode and the number of workers (``None``: the mode's default)."""
        choices = ("learner", "processes", "ray")
        if backend is None:
            backend = "learner" if mode == "sync" else "processes"
        if backend not in choices:
            raise ValueError(f"TorchRLRolloutFunc: backend must be one of {choices}, got {backend!r}.")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"TorchRLRolloutFunc: workers must be an integer >= 1, got {workers!r}.")
        if backend == "learner" and mode == "async":
            raise ValueError(
                "TorchRLRolloutFunc: mode='async' samples apart from the learner while it trains; backend='learner' "
                "samples in its process. Use backend='processes' (local) or backend='ray', or mode='sync'."
            )
        if backend == "learner" and workers != 1:
            raise ValueError(
                f"TorchRLRolloutFunc: workers={workers} with backend='learner': the learner's process is one sampler. "
                "Use backend='processes' or backend='ray' for several."
            )
        return backend

    @staticmethod
    def _check_tokenizer(tokenizer) -> None:
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "TorchRLRolloutFunc: the tokenizer has no pad token; give it one distinct from EOS "
                "(tokenizer.add_special_tokens({'pad_token': '<|pad|>'}) and resize the model's embeddings)."
            )

    @staticmethod
    def _check_policy_tokenizer(policy, tokenizer, model) -> None:
        """A tokenizer that is not the policy's would hand it ids that it reads as other tokens, or past its model's
        vocabulary: refused when built, trainer or not."""
        own = getattr(policy, "tokenizer", None)
        if own is not None and own is not tokenizer and callable(getattr(own, "get_vocab", None)):
            theirs = tokenizer.get_vocab() if callable(getattr(tokenizer, "get_vocab", None)) else None
            if theirs is not None and theirs != own.get_vocab():
                raise ValueError(
                    f"TorchRLRolloutFunc: the tokenizer ({len(theirs)} tokens) is not the policy's "
                    f"{type(policy).__name__}.tokenizer ({len(own.get_vocab())} tokens): the prompts' ids would be "
                    "read as other tokens. Pass the policy's tokenizer (or none with a trainer: its processing_class)."
                )
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(size, int) and hasattr(tokenizer, "__len__") and len(tokenizer) > size:
            raise ValueError(
                f"TorchRLRolloutFunc: the tokenizer has {len(tokenizer)} tokens and the policy's model "
                f"{type(model).__name__} {size} (config.vocab_size): ids past {size - 1} have no embedding. Pass the "
                "model's own tokenizer, or resize its embeddings (model.resize_token_embeddings(len(tokenizer)))."
            )

    @staticmethod
    def _check_tool_options(tools, *, policy, max_turns: int | None) -> None:
        if policy is not None:
            raise ValueError(
                f"TorchRLRolloutFunc: tools= samples whole dialogs with interop.DialogSampler around the trainer's "
                f"model; a {type(policy).__name__} policy cannot run the tool calls between turns. Pass no policy."
            )
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(
                f"TorchRLRolloutFunc: max_turns={max_turns!r} must be an integer >= 1 (assistant turns per dialog; "
                "trl's max_tool_calling_iterations + 1), or None (the trainer's)."
            )
        if not isinstance(tools, (ToolRunner, ToolSet)):
            ToolSet(tools)  # refuses a tool trl would refuse (no docstring, no type hints), naming it

    @staticmethod
    def _check_policy(policy) -> None:
        in_keys = [unravel_key(key) for key in getattr(policy, "in_keys", [])]
        unknown = [key for key in in_keys if key not in _INPUTS]
        if unknown:
            raise ValueError(
                f"TorchRLRolloutFunc: the policy reads {unknown}, which a rollout_func cannot give it; it gets the "
                f"prompts as {list(_INPUTS)} (left-padded tokens and their mask). For TorchRL's TransformersWrapper "
                "use input_mode='tokens'."
            )
        if PROMPT_TOKENS not in in_keys:
            raise ValueError(
                f"TorchRLRolloutFunc: the policy does not read {PROMPT_TOKENS} (its in_keys: {in_keys}); it must "
                "generate from prompt tokens (TransformersWrapper(input_mode='tokens', generate=True))."
            )
        out_keys = list(getattr(policy, "out_keys", []))
        missing: list[object] = []
        if not _declares(out_keys, RESPONSE_TOKENS):
            missing.append(RESPONSE_TOKENS)
        if not (_declares(out_keys, RESPONSE_LOG_PROBS) or _declares(out_keys, FULL_LOG_PROBS)):
            missing.append(f"{RESPONSE_LOG_PROBS} or {FULL_LOG_PROBS}")
        if missing:
            raise ValueError(
                f"TorchRLRolloutFunc: the policy writes no {' and no '.join(map(str, missing))} (its out_keys: "
                f"{out_keys}); trl needs the response tokens and the sampling log-probs. For TorchRL's "
                "TransformersWrapper set generate=True and return_log_probs=True."
            )

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        """trl's ``rollout_func``: one completion per prompt, in the prompts' order."""
        if self.policy is None:
            self._build_policy(trainer)
        if trainer is not None:
            self._check_same_model(trainer)
            self._check_settings(trainer)
            self._check_tokenizer_matches(trainer)
            if self.tools is not None:
                self._check_trainer_tools(trainer)
            self._warn_if_correction_inert(trainer)
        training = trainer is not None and bool(getattr(getattr(trainer, "model", None), "training", False))
        if self.mode == "async" and training:
            rollout = self._async_rollout(prompts, trainer)
        elif self.backend != "learner" and training:
            rollout = self._remote_rollout(prompts, trainer)
        else:
            rollout = self.rollout(prompts, trainer=trainer)
            rollout.set("step", torch.full((rollout.shape[0],), self._step(trainer), dtype=torch.long))
        self.last_rollout = rollout
        if self.replay_buffer is not None and not self.writes_scored_rows:
            self.replay_buffer.extend(self._ragged_rows(rollout))
        prompt_lengths = rollout.get("prompt_length").tolist()
        lengths = rollout.get("completion_length").tolist()
        prompt_ids = rollout.get("prompt_ids").tolist()
        completion_ids = rollout.get("completion_ids").tolist()
        log_probs = rollout.get("logprobs").tolist()
        width = rollout.get("prompt_ids").shape[-1]
        output = {
            "prompt_ids": [row[width - n :] for row, n in zip(prompt_ids, prompt_lengths, strict=True)],
            "completion_ids": [row[:n] for row, n in zip(completion_ids, lengths, strict=True)],
            "logprobs": [row[:n] for row, n in zip(log_probs, lengths, strict=True)],
        }
        if "env_mask" in rollout.keys():
            env_mask = rollout.get("env_mask").tolist()
            output["env_mask"] = [row[:n] for row, n in zip(env_mask, lengths, strict=True)]
            self._log_tool_metrics(trainer, rollout)
        return output

    def _log_tool_metrics(self, trainer, rollout: TensorDictBase) -> None:
        """The batch's tool figures, every process's, into trl's metrics (trl logs no ``tools/*`` of its own for a
        ``rollout_func``): ``rollout/tool_calls_per_dialog``, ``rollout/tool_errors`` (failed calls in the batch) and
        ``rollout/turns`` (assistant turns per dialog)."""
        metrics = getattr(trainer, "_metrics", None)
        if metrics is None:
            return
        totals = torch.stack(
            [rollout.get(name).sum().float() for name in TOOL_COUNTS] + [torch.tensor(1.0 * len(rollout))]
        )
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            totals = accelerator.gather(totals.to(accelerator.device)[None]).sum(0).cpu()
        calls, errors, turns, dialogs = totals.tolist()
        mode = "train" if bool(getattr(trainer.model, "training", True)) else "eval"
        metrics[mode]["rollout/tool_calls_per_dialog"].append(calls / dialogs)
        metrics[mode]["rollout/tool_errors"].append(errors)
        metrics[mode]["rollout/turns"].append(turns / dialogs)

    def _async_rollout(self, prompts: list, trainer) -> TensorDict:
        """This generation batch: pre-sampled by the workers when they hold these very prompts and it is recent
        enough, else sampled by them now with the current weights while trl waits; then the next batch's sampling
        started with the current weights, unless it would train past the lag bound and ``past_lag_bound`` withholds
        it. ``step`` is the version of the weights that sampled each row (the updates they had had)."""
        if self.lookahead is None:
            raise ValueError(
                "TorchRLRolloutFunc: mode='async' needs the next generation batch's prompts ahead of time, which "
                "interop.TorchRLGRPOTrainer reads from its prompt stream; use TorchRLGRPOTrainer (or mode='sync' with "
                "trl.GRPOTrainer)."
            )
        step = self._step(trainer)
        if self._background is None:
            self._start_background()
        rollout, stats = None, {"resampled": 0.0, "withheld": 0.0, "withheld_s": 0.0, "lookahead_misses": 0.0}
        if self._pending is not None:
            started = time.perf_counter()
            sampled, version = self._background.result()
            if self._pending_withheld:
                stats["withheld"], stats["withheld_s"] = 1.0, time.perf_counter() - started
            stats.update(self._background.last_stats)
            if self._pending != list(prompts):
                stats["lookahead_misses"] = 1.0  # the stream moved otherwise than read ahead: never paired
            elif step - version > self.max_policy_lag:
                stats["resampled"] = 1.0  # too stale to train on
            else:
                rollout = sampled
            self._pending = None
        if rollout is None:  # the first batch, one withheld, or one sampled again: by the workers, with these weights
            started = time.perf_counter()
            rollout, version = self._sample_now(prompts, trainer, step)
            if self._withheld == list(prompts):
                stats["withheld"], stats["withheld_s"] = 1.0, time.perf_counter() - started
            stats.update(self._background.last_stats)
        self._withheld, self._pending_withheld = None, False
        rollout.set("step", torch.full((rollout.shape[0],), version, dtype=torch.long))
        stats["policy_lag"] = float(step - version)
        self.stats = stats
        self._start_next(prompts, trainer, step)
        return rollout

    def _start_next(self, prompts: list, trainer, step: int) -> None:
        """The next generation batch's sampling, by the workers, with the weights of ``step``; withheld instead when
        it would train past the lag bound and ``past_lag_bound="withhold"``."""
        upcoming = self.lookahead(prompts)
        if not upcoming:
            return
        updates = self._updates_per_generation(trainer)
        if self.past_lag_bound == "withhold" and updates > self.max_policy_lag:
            # Sampled from the update max_policy_lag steps before trl asks for it (on_optimizer_step), or then.
            self._withheld, self._release_step = list(upcoming), step + updates - self.max_policy_lag
            return
        self._submit(upcoming, trainer, step)
        self._pending = list(upcoming)

    def _submit(self, prompts: list, trainer, step: int) -> None:
        """``prompts``' sampling started on the workers, each group on one, with the weights of ``step`` (published
        first, where due)."""
        self._publish_due(trainer, step)
        self._background.submit(self.tokenize(prompts, trainer), group_size=self._group_size(trainer, prompts))

    def on_optimizer_step(self, trainer) -> None:
        """Async mode, ``past_lag_bound="withhold"``: starts the sampling of a withheld generation batch once trl's
        weights are recent enough for it (``max_policy_lag`` optimizer steps before trl asks for it), so that it
        overlaps trl's last updates on the batch before. A trainer calls it after each optimizer step
        (``interop.TorchRLGRPOTrainer`` does); without it, a withheld batch is sampled when trl asks for it."""
        step = self._step(trainer)
        if self._withheld is None or self._pending is not None or step < self._release_step:
            return
        self._publish_due(trainer, step)
        if self._background.version < self._release_step:  # weight_sync_every > 1: not pushed yet, wait for the push
            return
        self._submit(self._withheld, trainer, step)
        self._pending, self._withheld, self._pending_withheld = self._withheld, None, True

    @staticmethod
    def _updates_per_generation(trainer) -> int:
        """The most optimizer steps trl takes on one generation batch (the lag of a batch sampled one ahead): trl
        generates every ``steps_per_generation * num_iterations`` micro-steps and steps every
        ``gradient_accumulation_steps``."""
        args = getattr(trainer, "args", None)
        micro_steps = int(getattr(args, "steps_per_generation", 1) or 1) * int(getattr(trainer, "num_iterations", 1))
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        return -(-micro_steps // accumulation)

    def _sample_now(self, prompts: list, trainer, step: int) -> tuple[TensorDict, int]:
        """``prompts`` sampled by the workers with the weights of ``step`` (:meth:`_submit`), waited for. Returns the
        batch and the version that sampled it."""
        self._submit(prompts, trainer, step)
        return self._background.result()

    def _remote_rollout(self, prompts: list, trainer) -> TensorDict:
        """Sync mode apart from the learner: this generation batch, sampled by the workers with the current weights
        (published first), each group on one worker."""
        step = self._step(trainer)
        if self._background is None:
            self._start_background()
        rollout, version = self._sample_now(prompts, trainer, step)
        rollout.set("step", torch.full((rollout.shape[0],), version, dtype=torch.long))
        self.stats = {"policy_lag": float(step - version), **self._background.last_stats}
        return rollout

    def _publish_due(self, trainer, step: int) -> None:
        """The trainer's weights of ``step`` to the samplers, unless they hold a version less than
        ``weight_sync_every`` steps older (their rows then carry that version)."""
        published = self._background.version
        if published is None or step - published >= self.weight_sync_every or step < published:
            self._background.publish(_model_of(trainer.model), version=step)

    @staticmethod
    def _group_size(trainer, prompts: list) -> int:
        """trl's ``num_generations``, where it divides the batch (trl repeats each prompt that many times in a row)."""
        size = int(getattr(getattr(trainer, "args", None), "num_generations", 1) or 1)
        return size if size >= 1 and len(prompts) % size == 0 else 1

    def prepare(self, trainer) -> None:
        """Builds what the first call would (the default policy; apart from the learner the samplers, waited for), so
        that a trainer can start them before its first step: ``interop.TorchRLGRPOTrainer.train`` does."""
        if self.policy is None:
            self._build_policy(trainer)
        if self.backend != "learner" and self._background is None:
            self._start_background().wait_until_ready()

    def _start_background(self) -> RolloutWorkers:
        from interop.sampling.workers import RolloutWorkers

        dialogs = None
        if self.tools is not None:  # the child runs the same dialogs with a tool worker of its own
            sampler = self.policy
            dialogs = {
                "tools": sampler.runner.tools,  # a ToolSet: the functions of the script that was run travel by value
                "timeout_s": sampler.runner.timeout_s,
                "max_result_tokens": sampler.runner.max_result_tokens,
                "max_turns": sampler.max_turns,
                "max_completion_tokens": sampler.max_completion_tokens,
                "chat_template_kwargs": sampler.chat_template_kwargs,
            }
        self._background = RolloutWorkers(
            self.policy.model,
            self.tokenizer,
            settings=self.policy.settings,
            log_probs_at_temperature=self.policy.log_probs_at_temperature,
            eos_token_ids=self.policy.eos_token_ids,
            backend=self.backend,
            workers=self.workers,
            resources=self.worker_resources,
            dtype=self.sampler_dtype,
            num_threads=self.sampler_threads,
            seed=self.seed,
            dialogs=dialogs,
        )
        return self._background

    def close(self) -> None:
        """Stops the samplers apart from the learner, if any (``interop.TorchRLGRPOTrainer`` does at the end of
        ``train()``)."""
        if self._background is not None:
            self._background.close()
            self._background = None
        self._forget_next_batch()
        if self._owns_runner and self.runner is not None:  # the tool worker built here (a caller's runner is theirs)
            self.runner.close()

    def _warn_if_correction_inert(self, trainer) -> None:
        """trl 1.16's ``GRPOTrainer`` applies ``vllm_importance_sampling_correction`` (on by default) to vLLM's
        completions only: under it, said once rather than dropped silently. ``interop.TorchRLGRPOTrainer`` applies it
        (its ``corrects_sampler``)."""
        correction = getattr(getattr(trainer, "args", None), "vllm_importance_sampling_correction", False)
        if self._correction_warned or not correction or getattr(trainer, "use_vllm", False):
            return
        if hasattr(trainer, "corrects_sampler"):
            return
        self._correction_warned = True
        warnings.warn(
            "TorchRLRolloutFunc: trl.GRPOTrainer applies GRPOConfig.vllm_importance_sampling_correction=True to vLLM's "
            "completions only; these TorchRL-sampled ones train without it. Use interop.TorchRLGRPOTrainer (trl's own "
            "correction on the sampler's log-probs), or set vllm_importance_sampling_correction=False.",
            stacklevel=3,
        )

    def _check_tokenizer_matches(self, trainer) -> None:
        """A tokenizer of another vocabulary than the trainer's would hand trl ids its decoding and rewards misread."""
        theirs = getattr(trainer, "processing_class", None)
        if theirs is None or theirs is self.tokenizer or self._vocab_checked:
            return
        mine_vocab = getattr(self.tokenizer, "get_vocab", None)
        their_vocab = getattr(theirs, "get_vocab", None)
        if callable(mine_vocab) and callable(their_vocab) and mine_vocab() != their_vocab():
            raise ValueError(
                f"TorchRLRolloutFunc: its tokenizer ({len(mine_vocab())} tokens) is not the trainer's processing_class "
                f"({len(their_vocab())} tokens): trl decodes and scores the completion ids with its own. Pass the same "
                "tokenizer to both (or none here: the trainer's is used)."
            )
        self._vocab_checked = True

    def _build_policy(self, trainer) -> None:
        """The default policy: a :class:`CausalLMSampler` around the trainer's model, at its ``GRPOConfig``'s
        sampling settings, recording log-probs as trl scores them (logits divided by its temperature)."""
        if trainer is None or getattr(trainer, "args", None) is None:
            raise ValueError(
                "TorchRLRolloutFunc: built without a policy, it samples with the trainer's model and GRPOConfig, but "
                "was called without a trainer; pass a policy (e.g. CausalLMSampler(model, tokenizer, settings=...)) "
                "or use it as trl.GRPOTrainer's rollout_func."
            )
        if self.tokenizer is None:
            self.tokenizer = getattr(trainer, "processing_class", None)
            self._check_tokenizer(self.tokenizer)
        model = _model_of(trainer.model)
        check_pad_token(self.tokenizer, owner="TorchRLRolloutFunc: the trainer's processing_class")
        try:
            settings = SamplingSettings.from_grpo_config(trainer.args)
        except ValueError as error:
            raise ValueError(f"TorchRLRolloutFunc: the trainer's GRPOConfig: {error}") from None
        self.model = model
        if self.tools is not None:
            self.policy = self._dialog_sampler(model, trainer, settings)
            return
        self.policy = CausalLMSampler(model, self.tokenizer, settings=settings, log_probs_at_temperature=True)

    def _dialog_sampler(self, model, trainer, settings: SamplingSettings):
        """The tools' sampler: each turn at trl's settings, ``max_completion_length`` the whole dialog's budget (as
        trl's tool loop counts it), turns ending at EOS (so the end-of-turn token after a call is the model's, in the
        loss, as in trl's layout), log-probs at trl's temperature."""
        from interop.tools.dialogs import DialogSampler

        if self.runner is None:
            self.runner = ToolRunner(
                self.tools,
                timeout_s=self.tool_timeout_s,
                max_result_tokens=self.max_result_tokens,
                tokenizer=self.tokenizer,
            )
            self._owns_runner = True
        iterations = getattr(trainer.args, "max_tool_calling_iterations", None)
        if self.max_turns is None:
            # trl's None is "no limit": every turn takes a token at least, so the budget bounds the dialog.
            self.max_turns = iterations + 1 if iterations is not None else int(trainer.args.max_completion_length)
        return DialogSampler(
            model,
            self.tokenizer,
            self.runner,
            settings=settings,
            max_turns=self.max_turns,
            max_completion_tokens=int(trainer.args.max_completion_length),
            stop_at_call_end=False,
            log_probs_at_temperature=True,
            chat_template_kwargs=getattr(trainer, "chat_template_kwargs", None) or {},
        )

    def _check_trainer_tools(self, trainer) -> None:
        """Refuses a trainer that would run tools itself too, or whose turn limit is not this one."""
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise ValueError(
                "TorchRLRolloutFunc: the trainer was given tools too (GRPOTrainer(tools=...) or environment_factory): "
                "trl would run its own tool loop over the dialogs this function already ran, calling each tool twice. "
                "Give the tools to one of them: TorchRLRolloutFunc(tools=...) and no tools= for the trainer."
            )
        iterations = getattr(getattr(trainer, "args", None), "max_tool_calling_iterations", None)
        if iterations is not None and self.max_turns != iterations + 1:
            raise ValueError(
                f"TorchRLRolloutFunc: max_turns={self.max_turns} disagrees with the trainer's GRPOConfig."
                f"max_tool_calling_iterations={iterations} (trl's iterations are the turns after the first: "
                f"max_turns = {iterations + 1}). Set one of them, or make max_turns = max_tool_calling_iterations + 1."
            )

    def _check_settings(self, trainer) -> None:
        """Refuses a policy that samples otherwise than the trainer's ``GRPOConfig`` asks, naming both values."""
        args = getattr(trainer, "args", None)
        if args is None or not hasattr(args, "max_completion_length"):
            return
        if isinstance(self.policy, CausalLMSampler) or self.tools is not None:
            wanted = SamplingSettings.from_grpo_config(args)
            differences = self.policy.settings.differences(wanted)
            if wanted.temperature != 1.0 and not self.policy.log_probs_at_temperature:
                differences["log_probs_at_temperature"] = (False, True)
        else:
            given = dict(getattr(self.policy, "generate_kwargs", None) or {})
            differences = {
                name: (given[name], getattr(args, field))
                for name, field in _WRAPPER_SETTINGS.items()
                if name in given and (given[name] or None) != (getattr(args, field) or None)
            }
        if differences:
            shown = ", ".join(
                f"{name}: policy {mine!r}, GRPOConfig {theirs!r}" for name, (mine, theirs) in differences.items()
            )
            raise ValueError(
                f"TorchRLRolloutFunc: the policy samples otherwise than the trainer's GRPOConfig asks ({shown}); trl "
                "scores and logs the completions with its own settings. Build the policy with the GRPOConfig's "
                "settings (CausalLMSampler(model, tokenizer, settings=SamplingSettings.from_grpo_config(args), "
                "log_probs_at_temperature=True)), or pass no policy: TorchRLRolloutFunc() builds that one."
            )

    def _ragged_rows(self, rollout: TensorDictBase, scored: Mapping | None = None) -> LazyStackedTensorDict:
        """One entry per completion, each unpadded: TorchRL's ragged LLM layout (a ``LazyStackStorage`` keeps it),
        with trl's scores when ``scored`` holds them (``prompts``, ``completions``, ``rewards`` ``[B, K]``,
        ``reward`` ``[B]``, ``advantages`` ``[B]``)."""
        width = rollout.get("prompt_ids").shape[-1]
        texts = self._completion_texts(rollout) if scored is None else [message_text(c) for c in scored["completions"]]
        rows = []
        for index, row in enumerate(rollout.unbind(0)):
            prompt, length = int(row.get("prompt_length")), int(row.get("completion_length"))
            entry = TensorDict(
                {
                    "prompt_ids": row.get("prompt_ids")[width - prompt :],
                    "completion_ids": row.get("completion_ids")[:length],
                    "logprobs": row.get("logprobs")[:length],
                    "truncated": row.get("truncated"),
                    "step": row.get("step"),
                }
            )
            if "env_mask" in row.keys():  # tools: which tokens are the model's, and the dialog's counts
                entry.set("env_mask", row.get("env_mask")[:length])
                for name in TOOL_COUNTS:
                    entry.set(name, row.get(name))
            entry.set_non_tensor("completion_text", texts[index])
            if scored is not None:
                entry.set_non_tensor("prompt", scored["prompts"][index])
                entry.set("rewards", scored["rewards"][index].float())
                entry.set("reward", scored["reward"][index].float())
                entry.set("advantage", scored["advantages"][index].float())
            rows.append(entry)
        return LazyStackedTensorDict(*rows)

    def _completion_texts(self, rollout: TensorDictBase) -> list[str]:
        """The completions' text as trl decodes them (special tokens skipped)."""
        lengths = rollout.get("completion_length").tolist()
        ids = [row[:n] for row, n in zip(rollout.get("completion_ids").tolist(), lengths, strict=True)]
        return list(self.tokenizer.batch_decode(ids, skip_special_tokens=True))

    def record_scored(
        self, *, prompts: list, completions: list, rewards, reward, advantages, train_step: int | None = None
    ) -> TensorDictBase:
        """Writes the last rollout, as trl scored it, into the replay buffer (one row per completion, in order); returns
        the rows. ``interop.TorchRLGRPOTrainer`` calls it once trl has scored each generation batch (and then the rows
        are written only here, not when sampled)."""
        if self.last_rollout is None:
            raise RuntimeError("TorchRLRolloutFunc.record_scored: nothing was sampled yet.")
        scored = {"prompts": prompts, "completions": completions, "rewards": rewards, "reward": reward}
        rows = self._ragged_rows(self.last_rollout, {**scored, "advantages": advantages})
        if train_step is not None:  # the updates before the batch trains (one more than its sampler's, in async mode)
            rows.set("train_step", torch.full((rows.shape[0],), int(train_step), dtype=torch.long))
        if self.replay_buffer is not None:
            self.replay_buffer.extend(rows)
        return rows

    @staticmethod
    def _step(trainer) -> int:
        state = getattr(trainer, "state", None)
        return int(getattr(state, "global_step", 0) or 0)

    def _check_same_model(self, trainer) -> None:
        trained = _model_of(trainer.model)
        sampling = _model_of(self.model)
        if sampling is trained:
            return
        trained_first = next(trained.parameters(), None)
        sampling_first = next(sampling.parameters(), None)
        if trained_first is not None and sampling_first is not None and trained_first is sampling_first:
            return  # e.g. a PEFT model and its base: the same parameters
        raise ValueError(
            f"TorchRLRolloutFunc: the policy samples with a {type(sampling).__name__} that is not the model the "
            f"trainer trains ({type(trained).__name__}); its samples would come from weights no update reaches. Build "
            "the policy around the trainer's model (e.g. TransformersWrapper(trainer.model, ...)) or the model you "
            "pass to GRPOTrainer."
        )

    def tokenize(self, prompts: list, trainer=None) -> list[list[int]]:
        """The prompts' token ids as trl tokenizes them for its own generation (``GRPOTrainer._tokenize_prompts``).

        trl hands over each prompt ``num_generations`` times and the same prompts again every epoch: each distinct
        prompt is tokenized once (per chat template settings) and kept.
        """
        if not prompts:
            raise ValueError("TorchRLRolloutFunc: no prompts to generate for.")
        _check_prompt_shapes(prompts)
        conversational = _is_conversational(prompts[0])
        options = {
            "chat_template": getattr(trainer, "chat_template", None),
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        }
        if self.tools is not None:
            # Rendered as trl renders a tool-calling run's prompts: the tools' schemas in the template, and a text
            # prompt as one user message (trl's tool loop reads conversations only).
            options["tools"] = self._tool_set().schemas
            if not conversational:
                prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
                conversational = True
        settings = json.dumps(options, sort_keys=True, default=str) if conversational else ""
        keys = [(settings, json.dumps(prompt, sort_keys=True, default=str)) for prompt in prompts]
        missing = list({key: prompt for key, prompt in zip(keys, prompts, strict=True) if key not in self._ids}.items())
        if missing:
            new = [prompt for _, prompt in missing]
            if conversational:
                ids = self.tokenizer.apply_chat_template(
                    conversation=new, add_generation_prompt=True, tokenize=True, return_dict=True, **options
                )["input_ids"]
            else:
                ids = self.tokenizer(text=new)["input_ids"]
            if len(self._ids) + len(missing) > _MAX_CACHED_PROMPTS:
                self._ids.clear()
            self._ids.update({key: list(map(int, row)) for (key, _), row in zip(missing, ids, strict=True)})
        ids = [list(self._ids[key]) for key in keys]
        empty = [row for row, row_ids in enumerate(ids) if not row_ids]
        if empty:
            raise ValueError(
                f"TorchRLRolloutFunc: prompt(s) {empty[:10]} tokenize to no tokens (an empty string?): the model needs "
                "at least one token to write after. Drop empty prompts from the dataset."
            )
        return ids

    @torch.inference_mode()  # nothing sampled here is differentiated; cheaper than no_grad per decoding step
    def rollout(self, prompts: list, *, trainer=None) -> TensorDict:
        """Samples one completion per prompt; returns a ``[B]`` TensorDict, one row per completion:

        - ``prompt_ids`` ``[B, P]`` (left-padded with the pad id) and ``prompt_length`` ``[B]``;
        - ``completion_ids`` ``[B, R]`` (right-padded) and ``completion_length`` ``[B]`` (EOS included);
        - ``logprobs`` ``[B, R]``: each sampled token's log-prob under the sampling weights, 0 on padding;
        - ``truncated`` ``[B]``: the completion has no EOS.
        """
        return self.rollout_ids(self.tokenize(prompts, trainer))

    def _tool_set(self) -> ToolSet:
        if isinstance(self.tools, ToolRunner):
            return self.tools.tools
        if not isinstance(self.tools, ToolSet):
            self.tools = ToolSet(self.tools)
        return self.tools

    def rollout_ids(self, prompt_ids: list[list[int]]) -> TensorDict:
        """:meth:`rollout` from the prompts' token ids (unpadded): :meth:`RolloutSampler.sample
        <interop.sampling.rollouts.RolloutSampler.sample>` with this function's policy (the dialogs sampled, with
        tools, kept in :attr:`last_dialogs`)."""
        sampler = self._rollout_sampler()
        rollout = sampler.sample(prompt_ids)
        if sampler.dialogs:
            self.last_dialogs = sampler.last_dialogs
        return rollout

    def _rollout_sampler(self) -> RolloutSampler:
        """The sync core around the current policy and model (built again if either was replaced)."""
        sampler = self._sampler
        if sampler is None or sampler.policy is not self.policy or sampler.model is not self.model:
            sampler = RolloutSampler(self.policy, self.tokenizer, model=self.model, dialogs=self.tools is not None)
            self._sampler = sampler
        return sampler
