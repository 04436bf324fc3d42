"""What a GRPO step collects, built from the recipe config: env -> policy -> reward -> dense batch.

Two rollouts, chosen by ``rollout.env``:

- ``prompt`` (the default): :class:`~recipes.grpo.prompt_env.PromptEnv` (dense prompt batches) + the reward
  transforms (``recipes.grpo.rewards``), stepped by :class:`~interop.sampling.CausalLMSampler` (one decoding loop
  per step, recording the behaviour log-probs), driven by a TorchRL ``Collector``. When ``tools:`` names tools the
  policy is :class:`~interop.tools.dialog_policy.DialogPolicy` instead: multi-turn dialogs whose tool calls run in a
  worker process, up to ``rollout.max_turns`` turns, in the same layout (the response is the whole dialog; the batch
  adds ``recipes.grpo.batch.DIALOG_KEYS``). With ``rollout.mode=async`` that collector runs in a child process
  (:class:`~recipes.grpo.collector_modes.BackgroundCollector`, which builds its own tool runner there) one batch ahead
  of the learner; with ``rollout.backend=processes|ray``, ``rollout.workers`` of them feed the learner, in local
  processes or Ray actors (:class:`~recipes.grpo.collector_workers.CollectorWorkers`), each built by
  :func:`collector_factory`.
- ``chat``: TorchRL's ``ChatEnv`` + ``TransformersWrapper`` + ``LLMCollector`` (``recipes.common.chat``), for users
  who plug in TorchRL's multi-turn and tool transforms; its ragged rollout is padded into the same dense layout.

Both yield the same batch (``recipes.grpo.batch.BATCH_KEYS``), which the learner completes (advantages, reference
and, where missing, old log-probs: ``recipes.grpo.learner.PrepareBatch``).

Dependencies: torch, tensordict, torchrl, transformers, and the project's ``interop`` package.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from tensordict import TensorDictBase
from torchrl.collectors import Collector
from torchrl.collectors.llm import LLMCollector

from interop.errors import SettingError
from interop.sampling import CausalLMSampler, end_of_response_ids
from interop.tools.dialog_policy import DialogPolicy
from recipes.common.chat import (
    check_chat_generation_settings,
    make_chat_env,
    make_policy,
    make_prompt_dataloader,
    pad_rollout,
)
from recipes.common.config import ConfigError
from recipes.common.data import PromptRows, load_prompt_rows
from recipes.common.models import load_tokenizer
from recipes.common.prompts import PromptTable
from recipes.common.rollout_backend import backend_of, samples_apart, worker_resources
from recipes.common.sampling import sampler_settings as common_sampler_settings
from recipes.common.schema import config_view
from recipes.common.tools import make_tool_runner, resolve_call_format, resolve_tools, resolving_tools_once
from recipes.grpo.batch import (
    BATCH_KEYS,
    DIALOG_KEYS,
    DONE,
    POLICY_VERSION,
    PROMPT_INDEX,
    RESPONSE_TOKENS,
    REWARD,
    REWARD_LOGS,
    SOURCE_REWARDS,
    TRUNCATED,
)
from recipes.grpo.collector_modes import LocalCollector
from recipes.grpo.collector_workers import CollectorWorkers
from recipes.grpo.policy import load_policy
from recipes.grpo.prompt_env import PromptEnv
from recipes.grpo.rewards import load_reward_scorer, make_reward_transform
from recipes.grpo.rollout_envs import ROLLOUT_ENVS
from recipes.grpo.schema import GRPORecipeConfig

__all__ = [
    "build_prompt_collector",
    "check_generation_settings",
    "check_tool_template",
    "collector_factory",
    "make_collector",
    "make_prompt_table",
    "make_sampling_policy",
    "sampler_settings",
]


def check_generation_settings(generation: Mapping, *, env: str, key: str = "rollout.generation") -> None:
    """Refuses a ``generation`` key that the rollout's sampler does not take, before anything loads.

    ``env="prompt"`` (:class:`~interop.sampling.CausalLMSampler`) takes the
    :class:`~interop.sampling.SamplingSettings` fields; ``env="chat"`` (TorchRL's ``TransformersWrapper``) any
    ``transformers.GenerationConfig`` field, and ``return_log_probs``.

    Keyword Args:
        env: ``"prompt"`` or ``"chat"``, as ``rollout.env``.
        key: where ``generation`` sits in the config, named in the error.

    Raises:
        ConfigError: an unknown key (a typo would otherwise go unnoticed, or fail deep inside generation).

    Examples:
        >>> check_generation_settings({"max_new_tokens": 8, "min_p": 0.05}, env="prompt")
        >>> check_generation_settings({"max_new_tokens": 8, "max_new_token": 8}, env="chat")
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: rollout.generation: ['max_new_token'] are not generation settings ...
    """
    if ROLLOUT_ENVS[env].takes_sampler_settings:
        sampler_settings(generation, key=key, check_only=True)
    else:
        check_chat_generation_settings(generation, key=key)


# rollout.env=prompt's sampler takes SamplingSettings' fields; for any other generation setting:
_CHAT_TAKES_ANY = (
    "use rollout.env=chat (TorchRL's TransformersWrapper passes any transformers GenerationConfig field to generate())"
)


def sampler_settings(generation: Mapping, *, key: str = "rollout.generation", check_only: bool = False):
    """``recipes.common.sampling.sampler_settings``, naming ``rollout.env=chat`` for a key the sampler does not take
    (TorchRL's ``TransformersWrapper`` takes any ``transformers.GenerationConfig`` field)."""
    return common_sampler_settings(generation, key=key, check_only=check_only, elsewhere=_CHAT_TAKES_ANY)


def make_prompt_table(cfg: GRPORecipeConfig, prompts: PromptRows, tokenizer) -> PromptTable:
    """The prompts as the policy reads them: its chat template, the system prompt, and the tools' schemas when
    ``tools:`` names tools (as trl renders a tool-calling run's prompts)."""
    tools = resolve_tools(cfg.tools)
    return PromptTable(
        prompts,
        tokenizer=tokenizer,
        system_prompt=cfg.rollout.system_prompt,
        tools=tools.schemas if tools is not None else None,
    )


def check_tool_template(cfg: GRPORecipeConfig, tokenizer) -> None:
    """Refuses, before the policy loads, a tokenizer whose chat template cannot carry tool dialogs token by token
    (``interop.tools.dialog_policy.DialogPolicy``'s checks, run on the tokenizer alone: no model, no tool worker
    started)."""
    tools = resolve_tools(cfg.tools)
    if tools is None:
        return
    try:
        DialogPolicy(
            None,  # the checks read the tokenizer and its template only
            tokenizer,
            make_tool_runner(cfg.tools, tools, tokenizer=tokenizer),
            settings=sampler_settings(cfg.rollout.generation),
            max_turns=cfg.rollout.max_turns,
            call_format=resolve_call_format(cfg.tools),
        )
    except ValueError as error:  # a SettingError of DialogSampler's, or check_pad_token's (which names its owner)
        detail = error.detail if isinstance(error, SettingError) else str(error)
        raise ConfigError(
            f"tools: model.name_or_path={str(cfg.model.name_or_path)!r}'s tokenizer cannot sample tool dialogs: "
            + detail
        ) from None


def make_sampling_policy(
    cfg: GRPORecipeConfig, model, tokenizer, *, generation: Mapping, key: str, num_threads: int | None = None
):
    """The policy module that answers a ``PromptEnv``'s prompts: ``interop.CausalLMSampler`` (one response each), or,
    when ``tools:`` names tools, ``interop.tools.dialog_policy.DialogPolicy`` (multi-turn dialogs, up to
    ``rollout.max_turns`` turns, calls answered by a ToolRunner of its own, in a worker process). ``generation``'s
    ``max_new_tokens`` bounds each turn and the whole completion, tool messages included (trl's
    ``max_completion_length``). ``num_threads``: torch's threads while it samples (``None``: the process's)."""
    settings = sampler_settings(generation, key=key)
    tools = resolve_tools(cfg.tools)
    if tools is None:
        return CausalLMSampler(model, tokenizer, settings=settings, num_threads=num_threads)
    runner = make_tool_runner(cfg.tools, tools, tokenizer=tokenizer)
    return DialogPolicy(
        model,
        tokenizer,
        runner,
        settings=settings,
        max_turns=cfg.rollout.max_turns,
        max_completion_tokens=settings.max_new_tokens,
        call_format=resolve_call_format(cfg.tools),  # None: Qwen2.5's <tool_call>; TorchRL pieces may bring theirs
        num_threads=num_threads,
    )


def _dense_batch(rollout: TensorDictBase) -> TensorDictBase:
    """A collector's ``[B, 1]`` output (one step per dialog) as the flat batch of :data:`BATCH_KEYS`, with
    :data:`REWARD_LOGS` where reward functions log and :data:`DIALOG_KEYS` where the policy calls tools (a view: the
    collector copies what its postproc returns)."""
    present = rollout.keys(include_nested=True)
    optional = [key for key in (REWARD_LOGS, *DIALOG_KEYS) if key in present]
    return rollout.reshape(-1).select(*BATCH_KEYS, *optional)


def _stream_start(start_step: int, *, prompts_per_batch: int, num_replicas: int) -> int:
    # The prompt stream is a function of the step (each step draws prompts_per_batch prompts per replica): resuming
    # continues it.
    return start_step * prompts_per_batch * num_replicas


def _prompt_collector(
    cfg: GRPORecipeConfig,
    prompts: PromptRows,
    *,
    policy_model,
    tokenizer,
    reward_model,
    reward_tokenizer,
    start_step: int,
    num_replicas: int,
    rank: int,
    responses: int,
    sampling_threads: int | None = None,
) -> tuple[Collector, CausalLMSampler | DialogPolicy]:
    """``PromptEnv`` + reward transforms, stepped by a ``CausalLMSampler`` (a ``DialogPolicy`` with tools), driven by
    a TorchRL ``Collector`` that yields ``responses`` responses per batch (replica ``rank`` of ``num_replicas``
    sharing the prompt stream), sampling on ``sampling_threads`` torch threads (``None``: the process's)."""
    group = cfg.rollout.group_size
    prompts = make_prompt_table(cfg, prompts, tokenizer)
    env = PromptEnv(
        prompts,
        tokenizer=tokenizer,
        group_size=group,
        num_prompts=responses // group,
        seed=cfg.seed,
        start=_stream_start(start_step, prompts_per_batch=responses // group, num_replicas=num_replicas),
        num_replicas=num_replicas,
        rank=rank,
        device=cfg.device,
    )
    env = env.append_transform(
        make_reward_transform(cfg, reward_model, reward_tokenizer, tokenizer, prompts=prompts, start_step=start_step)
    )
    policy = make_sampling_policy(
        cfg,
        policy_model,
        tokenizer,
        generation=cfg.rollout.generation,
        key="rollout.generation",
        num_threads=sampling_threads,
    )
    # One env step per batch: B dialogs of one turn each. Endless: the learner decides when to stop.
    collector = Collector(
        env,
        policy,
        frames_per_batch=responses,
        total_frames=-1,
        postproc=_dense_batch,
        use_buffers=False,
        auto_register_policy_transforms=False,  # the policy reads no recurrent state: nothing to register
    )
    return collector, policy


@resolving_tools_once()  # this sampling process lists each MCP server of tools: once
def build_prompt_collector(
    cfg: GRPORecipeConfig, *, start_step: int, num_replicas: int, rank: int, workers: int = 1, worker: int = 0
) -> tuple[Collector, CausalLMSampler | DialogPolicy]:
    """Loads the models a ``rollout.env=prompt`` collector needs and builds it: what a background collector runs.

    Args:
        cfg: the run's typed settings (dataclasses: picklable, resolved, no Hydra state needed).

    Keyword Args:
        start_step: the steps done before its first batch (where its prompt stream starts).
        num_replicas, rank: the data-parallel processes and this one's rank.
        workers, worker: the collectors feeding this process's learner and which one this is: it samples
            ``rollout.responses_per_step / workers`` responses per batch, replica ``rank * workers + worker`` of the
            ``num_replicas * workers`` that deal out the prompt stream, so that no two collectors draw the same
            position and together they draw what one collector per process would.
    """
    tokenizer = load_tokenizer(config_view(cfg.model), padding_side="left")
    reward_tokenizer, reward_model = load_reward_scorer(cfg)
    return _prompt_collector(
        cfg,
        load_prompt_rows(config_view(cfg.data), "train"),
        # The weights are the learner's, loaded over these by the background collector before every batch.
        # With LoRA, built as the learner builds its policy: the parameter names match, so all of them (the
        # unchanging base included) are copied; a resumed run's adapter weights arrive the same way.
        # In rollout.sampler_dtype: the learner's weights are cast to it as they are pushed.
        policy_model=load_policy(cfg.model, device=cfg.device, dtype=cfg.rollout.sampler_dtype).eval(),
        tokenizer=tokenizer,
        reward_model=reward_model,
        reward_tokenizer=reward_tokenizer,
        start_step=start_step,
        num_replicas=num_replicas * workers,
        rank=rank * workers + worker,
        responses=cfg.rollout.responses_per_step // workers,
    )


def collector_factory(
    cfg: GRPORecipeConfig, *, num_replicas: int, rank: int, workers: int, worker: int, start_step: int
):
    """The picklable factory of collector ``worker`` (of ``workers``) starting at ``start_step``: what
    ``recipes.grpo.collector_workers.CollectorWorkers`` builds each worker's collector from, and rebuilds it from
    when the worker is replaced."""
    return functools.partial(
        build_prompt_collector,
        cfg,
        start_step=start_step,
        num_replicas=num_replicas,
        rank=rank,
        workers=workers,
        worker=worker,
    )


def _chat_collector(
    cfg: GRPORecipeConfig, prompts: list, models, *, start_step: int, num_replicas: int, rank: int
) -> LocalCollector:
    """TorchRL's ``ChatEnv`` + ``TransformersWrapper`` + ``LLMCollector``, its rollouts padded into dense batches."""
    group, per_step = cfg.rollout.group_size, cfg.rollout.responses_per_step
    loader = make_prompt_dataloader(
        prompts,
        seed=cfg.seed,
        start=_stream_start(start_step, prompts_per_batch=per_step // group, num_replicas=num_replicas),
        num_replicas=num_replicas,
        rank=rank,
    )
    env = make_chat_env(
        loader,
        tokenizer=models.tokenizer,
        group_size=group,
        num_prompts=per_step // group,
        system_prompt=cfg.rollout.system_prompt,
        transforms=[
            make_reward_transform(
                cfg, models.reward_model, models.reward_tokenizer, models.tokenizer, start_step=start_step
            )
        ],
    )
    version = torch.zeros((), dtype=torch.long)
    pad_token_id = models.tokenizer.pad_token_id
    eos = torch.tensor(end_of_response_ids(models.policy, models.tokenizer))
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
        batch.update(rollout.select(PROMPT_INDEX, REWARD, SOURCE_REWARDS, DONE).to_tensordict())
        batch.set(POLICY_VERSION, version.expand(batch.shape[0]).clone())
        # A response that ends without an EOS hit max_new_tokens (what trl calls truncated).
        last = torch.stack([response[-1] for response in rollout.get(RESPONSE_TOKENS, as_list=True)])
        batch.set(TRUNCATED, ~torch.isin(last, eos))
        return batch

    # Enough turns for every step, and for the extra batches dynamic sampling may draw.
    batches_per_step = 1 + (cfg.advantage.max_extra_batches if cfg.advantage.filter_zero_std_groups else 0)
    collector = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=per_step,
        total_dialog_turns=max(cfg.train.steps - start_step, 1) * per_step * batches_per_step,
        postproc=to_dense,
    )
    return LocalCollector(collector, policy, version)


def make_collector(
    cfg: GRPORecipeConfig, models, *, prompts: PromptRows, start_step: int, num_replicas: int = 1, rank: int = 0
):
    """The collector of ``cfg.rollout``: yields one step's dense batch (:data:`BATCH_KEYS`) per iteration and takes
    the learner's weights with ``update_policy_weights_(model, version=...)``; ``shutdown()`` when done.

    ``models``: the learner's models (``policy``, ``tokenizer``, and, unless the collector runs in the background,
    ``reward_model`` and ``reward_tokenizer``). ``prompts``: the training prompts and their columns, already read (a
    background collector reads them again in its own process)."""
    if cfg.rollout.env == "chat":
        return _chat_collector(
            cfg, prompts.prompts, models, start_step=start_step, num_replicas=num_replicas, rank=rank
        )
    if samples_apart(cfg):
        backend = backend_of(cfg)
        workers = cfg.rollout.workers
        return CollectorWorkers(
            functools.partial(
                collector_factory,
                cfg,  # dataclasses: pickled into each worker's process (or Ray actor) as they are
                num_replicas=num_replicas,
                rank=rank,
                workers=workers,
            ),
            models.policy,
            backend=backend,
            workers=workers,
            start_version=start_step,
            # Sync mode: every batch waits for the weights of the update before it (with rollout.weight_sync_every=k,
            # for the last push: k - 1 updates at most, which the checks hold within rollout.max_policy_lag).
            max_policy_lag=(
                cfg.rollout.max_policy_lag if cfg.rollout.mode == "async" else cfg.rollout.weight_sync_every - 1
            ),
            past_lag_bound=cfg.rollout.past_lag_bound if cfg.rollout.mode == "async" else "withhold",
            dtype=getattr(torch, cfg.rollout.sampler_dtype),
            num_threads=cfg.rollout.collector_threads,
            # Its own sampling noise per worker (seed + worker index), per rank and per resumed segment of the run.
            seed=cfg.seed + rank * workers + 7919 * start_step,
            pad_token_id=models.tokenizer.pad_token_id,
            resources=worker_resources(cfg) if backend == "ray" else None,
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
        responses=cfg.rollout.responses_per_step,
        sampling_threads=cfg.rollout.learner_sampling_threads,
    )
    policy.version.fill_(start_step)
    return LocalCollector(collector, policy, policy.version)
