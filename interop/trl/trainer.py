"""trl's ``GRPOTrainer`` sampling through TorchRL, every scored rollout written to a TorchRL buffer.

Public names:

- :class:`TorchRLGRPOTrainer`: ``trl.GRPOTrainer`` with an :class:`~interop.trl.rollout_func.TorchRLRolloutFunc` as its
  ``rollout_func`` (by default one that samples with an :class:`~interop.sampling.CausalLMSampler` around the model
  trl trains, at the ``GRPOConfig``'s sampling settings). Everything trl computes is unchanged; it also reads the
  rewards trl's ``_calculate_rewards`` returns and the advantages ``_generate_and_score_completions`` returns, so that
  each generation batch reaches the ``replay_buffer`` once scored: token ids, behaviour log-probs, the prompt and the
  completion's text, each reward function's value, trl's reward and advantage, the step.

A plain ``trl.GRPOTrainer(rollout_func=TorchRLRolloutFunc(...))`` samples the same way; its buffer rows are written
when sampled, without the scores (a ``rollout_func`` never sees them).

With ``TorchRLRolloutFunc(mode="async")`` the trainer also reads its prompt stream one generation batch ahead of trl
(the rollout function samples that batch in a child process while trl updates), gives trl's loss the sampling
log-probs as its old log-probs (trl treats a batch generated in step with the optimizer as on-policy and would
otherwise use the current weights' log-probs: a batch sampled one update ago is not), and logs ``policy_lag``,
``rollout/resampled``, ``rollout/withheld``, ``rollout/withheld_s`` and ``rollout/lookahead_misses`` with trl's
metrics (the rollout function's ``past_lag_bound`` says which of the two a batch past the lag bound gets).

The sampler/trainer mismatch correction: trl 1.16 applies its ``GRPOConfig`` ``vllm_importance_sampling_correction``
(``vllm_importance_sampling_mode``, ``..._clip_min``, ``..._clip_max``) only to vLLM's completions.
``TorchRLGRPOTrainer`` lets trl's own code apply them to the TorchRL sampler's: trl scores the batch's tokens with the
trainer's weights (its old log-probs) and weights the loss by its ratio to the sampler's log-probs, truncated or masked
as the mode says. With it on, an async batch keeps those old log-probs (the ratio then carries the lag too) and replayed
groups train against their sampling log-probs with a ratio of 1. Beside trl's own mismatch metrics it logs the k3 KL
between the two and the share of tokens and sequences the mode clips or masks (:func:`sampler_mismatch_metrics`).

- :func:`check_importance_sampling_settings`: the settings refused before anything loads (a mode trl does not have,
  ``clip_min >= clip_max``...), each error starting with the field's name.

Dependencies: ``torch``, ``datasets``, ``trl`` (imported with this module: ``interop`` imports it only when this class
is used).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import uuid
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from interop.errors import SettingError
from interop.trl.group_replay import GroupReplay, pad_rows
from interop.trl.importance_sampling import IMPORTANCE_SAMPLING_MODES, sampler_mismatch_counts, sampler_mismatch_metrics
from interop.trl.rollout_func import TorchRLRolloutFunc

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "TorchRLGRPOTrainer",
    "check_importance_sampling_settings",
    "sampler_mismatch_counts",
    "sampler_mismatch_metrics",
]


# trl's private names this module relies on, and nothing else in the repository does (the recipes reach trl through
# this class and trl's public API). Checked against trl 1.16.0, the version range pyproject.toml pins (>=1.16,<1.17).
# Each method: the leading parameters this module overrides it with or passes to it, in order; each attribute: set by
# ``GRPOTrainer.__init__``. tests/interop/test_trl_private_api.py fails naming the one a trl release changes.
TRL_CHECKED_VERSION = "1.16.0"
TRL_PRIVATE_METHODS = {
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),  # overridden: reads rewards
    "_generate": ("prompts",),  # overridden: checks the sampler's log-probs; returns (..., logprobs at [4], ...)
    "_compute_loss": ("model", "inputs"),  # overridden: trl's loss with the sampler correction
    "_generate_and_score_completions": ("inputs",),  # overridden: records, replays, corrects
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep"),  # called
}
TRL_PRIVATE_ATTRIBUTES = ("_metrics", "_tokenizer", "use_vllm")  # read (and use_vllm set around trl's correction)

_LIVE_LOOKAHEADS: dict[str, PromptLookahead] = {}


class PromptLookahead:
    """A prompt stream (a ``datasets.IterableDataset``) read one generation batch ahead of trl.

    :meth:`dataset` is what trl iterates in its place: the same records, in the same order, drawn from the source
    ``ahead`` records before trl takes them and remembered. Called with the prompts trl passed for a generation batch
    (each repeated ``num_generations`` times), the object returns the next batch's, as trl will pass them, once they
    have been drawn; ``None`` before.

    Args:
        source: the prompt stream (``interop.TorchRLBufferDataset(...).as_hf_dataset()``, a deterministic stream).

    Keyword Args:
        prompts_per_generation: distinct prompts per generation batch (trl's ``generation_batch_size //
            num_generations``).
        num_generations: completions per prompt.
    """

    def __init__(self, source, *, prompts_per_generation: int, num_generations: int) -> None:
        self.source = source
        self.prompts_per_generation, self.num_generations = prompts_per_generation, num_generations
        self.drawn: list[Any] = []  # every prompt drawn so far, in order, across passes over the source
        self.token = uuid.uuid4().hex
        _LIVE_LOOKAHEADS[self.token] = self

    def dataset(self):
        """The stream trl iterates: the source's records, drawn ahead and remembered."""
        import datasets

        return datasets.IterableDataset.from_generator(_LookaheadGenerator(self.token), features=self.source.features)

    def records(self):
        pending: list[dict] = []
        iterator = iter(self.source)
        exhausted = False
        while True:
            while not exhausted and len(pending) <= self.prompts_per_generation:
                try:
                    record = next(iterator)
                except StopIteration:
                    exhausted = True
                    break
                self.drawn.append(record["prompt"])
                pending.append(record)
            if not pending:
                return
            yield pending.pop(0)

    def __call__(self, prompts: list) -> list | None:
        group = self.num_generations
        distinct = list(prompts[::group])
        if [prompt for prompt in distinct for _ in range(group)] != list(prompts):
            return None  # not trl's grouping: nothing to predict
        width = len(distinct)
        for end in range(len(self.drawn), width - 1, -1):  # the most recent place these prompts were drawn
            if self.drawn[end - width : end] == distinct:
                upcoming = self.drawn[end : end + self.prompts_per_generation]
                if len(upcoming) < self.prompts_per_generation:
                    return None
                return [prompt for prompt in upcoming for _ in range(group)]
        return None


def _passes_over(dataset, *, shuffle: bool, seed: int):
    """``dataset`` (a ``datasets.Dataset``) as an endless ``datasets.IterableDataset``: pass after pass over its rows,
    each pass in an order drawn from ``seed`` and the pass's number when ``shuffle``."""
    import datasets

    return datasets.IterableDataset.from_generator(_Passes(dataset, shuffle, seed), features=dataset.features)


class _Passes:
    """The generator of :func:`_passes_over` (an object: ``datasets`` pickles it)."""

    def __init__(self, dataset, shuffle: bool, seed: int) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed

    def __call__(self):
        if len(self.dataset) == 0:
            return
        for number in itertools.count():
            order: range | torch.Tensor = range(len(self.dataset))
            if self.shuffle:
                order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + number))
            for index in order:
                yield self.dataset[int(index)]


class _LookaheadGenerator:
    """The generator handed to ``datasets``: pickles (and deep-copies) to a token that finds the live lookahead."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self):
        yield from _LIVE_LOOKAHEADS[self.token].records()

    def __reduce__(self) -> tuple:
        return (_LookaheadGenerator, (self.token,))


class TorchRLGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose completions TorchRL samples, each scored generation batch written to a TorchRL buffer.

    Args:
        *args, **kwargs: ``trl.GRPOTrainer``'s own (``model``, ``reward_funcs``, ``args``, ``train_dataset``,
            ``processing_class``, ``peft_config``...).

    Keyword Args:
        rollout_func: a :class:`~interop.trl.rollout_func.TorchRLRolloutFunc`; ``None``: ``TorchRLRolloutFunc()``, a
            :class:`~interop.sampling.CausalLMSampler` around the trained model at the ``GRPOConfig``'s settings.
        replay_buffer: where each scored batch goes, one row per completion (the rollout function's
            ``replay_buffer``; give one or the other, not both). ``None``: the rollout function's, or none.

    Attributes:
        last_scored: the rows of the last training batch, as written (``None`` before the first).
        scored_batches: how many training batches were scored (a counter a callback can watch).

    Examples:
        A trl script, sampling through TorchRL and keeping every rollout::

            from torchrl.data import LazyStackStorage, ReplayBuffer
            from trl import GRPOConfig
            from interop import TorchRLGRPOTrainer

            rollouts = ReplayBuffer(storage=LazyStackStorage(100_000))
            trainer = TorchRLGRPOTrainer(
                model=model, reward_funcs=reward_funcs, train_dataset=dataset, processing_class=tokenizer,
                args=GRPOConfig(max_completion_length=16, temperature=0.7, ...), replay_buffer=rollouts,
            )
            trainer.train()
            rollouts[:4]["completion_text"], rollouts[:4]["advantage"]
    """

    # trl's attributes, typed as they are here (transformers' Trainer and trl declare wider types, for mypy).
    args: GRPOConfig
    """trl's config, validated (``num_generations`` is set)."""
    num_generations: int
    """Completions per prompt: trl's ``num_generations``."""
    model: torch.nn.Module
    """The model trl trains."""
    rollout_func: TorchRLRolloutFunc
    """What samples each generation batch: the ``rollout_func`` given, or the default ``TorchRLRolloutFunc()``."""

    def __init__(
        self,
        *args,
        rollout_func: TorchRLRolloutFunc | None = None,
        replay_buffer=None,
        replay: GroupReplay | None = None,
        **kwargs,
    ) -> None:
        if rollout_func is not None and getattr(rollout_func, "mode", "sync") == "async":
            kwargs = _reading_ahead(rollout_func, args, kwargs)
        if rollout_func is None:
            rollout_func = TorchRLRolloutFunc(replay_buffer=replay_buffer)
        elif not isinstance(rollout_func, TorchRLRolloutFunc):
            raise TypeError(
                f"TorchRLGRPOTrainer: rollout_func must be an interop.TorchRLRolloutFunc (it keeps the sampled tokens "
                f"the buffer stores), got {type(rollout_func).__name__}; use trl.GRPOTrainer for another one."
            )
        elif replay_buffer is not None:
            if rollout_func.replay_buffer is not None and rollout_func.replay_buffer is not replay_buffer:
                raise ValueError(
                    "TorchRLGRPOTrainer: replay_buffer= and the rollout function's replay_buffer differ; give one."
                )
            rollout_func.replay_buffer = replay_buffer
        if replay is not None and rollout_func.tools is not None:
            raise ValueError(
                "TorchRLGRPOTrainer: replay= with a rollout function that runs tools is not supported yet: a stored "
                "group would train without the env_mask that keeps its tool messages out of the loss. Drop one."
            )
        rollout_func.writes_scored_rows = True
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:
            check_importance_sampling_settings(config)  # trl would refuse a wrong mode only at the first batch
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is what this class is for
        # mypy: *args could reach trl's 13th parameter, rollout_func, positionally; trl's scripts pass a few at most.
        super().__init__(*args, rollout_func=rollout_func, **kwargs)  # type: ignore[misc]
        if config is None:
            check_importance_sampling_settings(self.args)
        # trl's own vllm_importance_sampling_* code corrects the TorchRL sampler's log-probs (with vLLM it runs anyway).
        self.corrects_sampler = bool(self.args.vllm_importance_sampling_correction) and not self.args.use_vllm
        if self.rollout_func.mode == "async":  # a withheld batch starts once the weights are recent enough
            self.add_callback(_OptimizerSteps(self))
        self.last_scored: TensorDictBase | None = None
        self.scored_batches = 0
        self._scored: tuple[list, list, torch.Tensor] | None = None  # the last batch's (_calculate_rewards)
        self.replay = replay

    def train(self, *args, **kwargs):
        try:
            # The async mode's sampling process starts (imports, a copy of the model) before the first step.
            self.rollout_func.prepare(self)
            return super().train(*args, **kwargs)
        finally:
            self.rollout_func.close()  # the async mode's sampling process ends with training, however it ends

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scored = (prompts, completions, rewards_per_func)
        return rewards_per_func

    @contextlib.contextmanager
    def _reads_use_vllm_as(self, value: bool):
        """trl 1.16 applies the ``vllm_importance_sampling_*`` settings where it reads ``self.use_vllm`` true, and
        nowhere else in ``_generate_and_score_completions`` and ``_compute_loss`` but inside ``_generate`` (vLLM's
        weight sync): reading it true around those two (and the real value inside ``_generate``) runs trl's own
        correction, metrics and loss weighting on the TorchRL sampler's log-probs. Checked against trl 1.16.0."""
        real = self.use_vllm
        self.use_vllm = value
        try:
            yield
        finally:
            self.use_vllm = real

    def _generate(self, prompts: list):
        # trl 1.16's _generate returns (prompt_ids, completion_ids, tool_mask, completions, logprobs, ...).
        with self._reads_use_vllm_as(self.args.use_vllm):
            generated = super()._generate(prompts)
        if self.corrects_sampler:
            _check_sampler_log_probs(completion_ids=generated[1], log_probs=generated[4])
        return generated

    def _compute_loss(self, model, inputs):
        with self._reads_use_vllm_as(self.use_vllm or self.corrects_sampler):
            return super()._compute_loss(model, inputs)

    def _generate_and_score_completions(self, inputs):
        with self._reads_use_vllm_as(self.use_vllm or self.corrects_sampler):
            output = super()._generate_and_score_completions(inputs)
        if self.corrects_sampler:
            self._log_sampler_mismatch(output)
        if self.model.training:
            if self.rollout_func.mode == "async" or self.replay is not None:
                if not self.corrects_sampler:  # with it, trl's ratio to the sampling log-probs corrects the lag
                    self._behaviour_log_probs_as_old(output)
            if self.rollout_func.backend != "learner":
                self._log_rollout_stats()
            self._record(output)  # the batch as sampled and scored
            if self.replay is not None:
                output = self._replay_tied_groups(output)
        return output

    def _replay_tied_groups(self, output: dict) -> dict:
        """Stored groups in the places of this batch's groups whose rewards all tie (zero advantages: they move
        nothing), drawn by reward spread; this batch's informative groups stored. The replayed rows keep their stored
        sampling log-probs as old log-probs (and reference log-probs), so trl's ratio corrects for their age; with the
        sampler correction on, their correction ratio is 1 (the rows trained fresh keep trl's)."""
        assert self.last_scored is not None and self.replay is not None  # _record() ran; replay= was given
        group, step = self.num_generations, self.state.global_step
        rewards = self.last_scored.get("reward")
        count = rewards.shape[0] // group
        spreads = [_spread(rewards[g * group : (g + 1) * group]) for g in range(count)]
        tied = [g for g, spread in enumerate(spreads) if spread == 0.0]
        drawn = self.replay.sample(len(tied)) if tied and self.replay.drawable() else []
        with_ref = output.get("ref_per_token_logps") is not None
        # What a stored group trains against later: the log-probs it was sampled with.
        sampling_key = "sampling_per_token_logps" if self.corrects_sampler else "old_per_token_logps"
        for g, spread in enumerate(spreads):
            if spread > 0.0:
                stored = _group_rows(output, g, group, with_ref=with_ref, old_key=sampling_key)
                self.replay.add(stored, reward_std=spread, step=step)
        self._metrics["train"]["rollout/replayed_share"].append(len(drawn) / max(count, 1))
        if not drawn:
            return self._with_token_count(output)
        self._metrics["train"]["rollout/replayed_age"].append(
            sum(step - int(stored["step"][0]) for stored in drawn) / len(drawn)
        )
        slots = dict(zip(tied, drawn, strict=False))
        corrected = self.corrects_sampler
        rows = [
            self._as_replayed(slots[g])
            if g in slots
            else _group_rows(output, g, group, with_ref=with_ref, corrected=corrected)
            for g in range(count)
        ]
        if with_ref and any("ref_logps" not in entry.keys() for entry in rows):
            rows = [entry if "ref_logps" in entry.keys() else self._with_reference(entry) for entry in rows]
        stacked = _stacked(rows, pad_token_id=self._tokenizer.pad_token_id, device=self.accelerator.device)
        return self._with_token_count({**output, **stacked})

    def _as_replayed(self, entry: TensorDictBase) -> TensorDictBase:
        """A stored group as it trains under the sampler correction: its sampling log-probs are its old log-probs
        already, so its correction ratio is 1 (one per token, or per completion in the ``sequence_*`` modes)."""
        if not self.corrects_sampler:
            return entry
        entry = entry.clone()
        old = entry["old_logps"]
        width = 1 if self.args.vllm_importance_sampling_mode.startswith("sequence_") else old.shape[1]
        entry.set("sampling_logps", old.clone())
        entry.set("is_ratio", torch.ones(old.shape[0], width))
        return entry

    def _with_token_count(self, output: dict) -> dict:
        """trl's ``num_items_in_batch`` (the loss's token normaliser) of the batch as trained, every process's: each
        process gathers it at every batch, replayed or not, so that none waits on a collective the others skip."""
        return {**output, "num_items_in_batch": self.accelerator.gather(output["completion_mask"].sum()).sum()}

    def _with_reference(self, entry: TensorDictBase) -> TensorDictBase:
        """A stored group's reference log-probs, scored as trl scores its own batches' (a group loaded from another
        run's rollouts has none)."""
        from trl.trainer.utils import use_adapter

        device = self.accelerator.device
        ids = torch.cat([entry["prompt_ids"], entry["completion_ids"]], dim=1).to(device)
        mask = torch.cat([entry["prompt_mask"], entry["completion_mask"]], dim=1).to(device)
        width = entry["completion_ids"].shape[1]
        with torch.no_grad():
            if self.ref_model is not None:
                ref, _, _ = self._get_per_token_logps_and_entropies(self.ref_model, ids, mask, width)
            else:
                model = self.accelerator.unwrap_model(self.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    ref, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, width)
        entry = entry.clone()
        entry.set("ref_logps", ref.cpu())
        return entry

    def _behaviour_log_probs_as_old(self, output: dict) -> None:
        """trl's old log-probs := the log-probs the completions were sampled with (at trl's temperature), so that its
        ratio and clipping correct the policy lag."""
        rollout = self.rollout_func.last_rollout
        assert rollout is not None  # the rollout function sampled this batch
        width = output["completion_ids"].shape[1]
        behaviour = rollout.get("logprobs")[:, :width]
        behaviour = torch.nn.functional.pad(behaviour, (0, width - behaviour.shape[1]))
        output["old_per_token_logps"] = behaviour.to(self.accelerator.device)

    def _log_rollout_stats(self) -> None:
        """The samplers' figures of the batch into trl's metrics: ``policy_lag``, ``rollout/resampled``,
        ``rollout/withheld``, ``rollout/withheld_s``, ``rollout/lookahead_misses``, ``rollout/workers``,
        ``rollout/worker_restarts`` and each worker's ``rollout/worker_<i>/tokens_per_s``."""
        for name, value in self.rollout_func.stats.items():
            self._metrics["train"][name if name == "policy_lag" else f"rollout/{name}"].append(value)

    def _log_sampler_mismatch(self, output: dict) -> None:
        """:func:`sampler_mismatch_metrics` of the batch, every process's, beside trl's own mismatch metrics."""
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        args = self.args
        counts = sampler_mismatch_counts(
            output["old_per_token_logps"],
            output["sampling_per_token_logps"],
            mask,
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
        )
        totals = self.accelerator.gather(counts[None]).sum(0)
        mode = "train" if self.model.training else "eval"
        for name, value in sampler_mismatch_metrics(totals).items():
            self._metrics[mode][name].append(value)

    def _record(self, output: dict) -> None:
        assert self._scored is not None  # _calculate_rewards() ran in this batch's scoring
        prompts, completions, rewards_all = self._scored
        rank, rows = self.accelerator.process_index, len(prompts)
        rewards = rewards_all[rank * rows : (rank + 1) * rows].detach().float().cpu()
        # trl's reward: the weighted sum of the sources that applied (NaN when none did), as trl logs it.
        reward = (rewards * self.reward_weights.cpu()[None]).nansum(dim=1)
        reward[torch.isnan(rewards).all(dim=1)] = float("nan")
        self.last_scored = self.rollout_func.record_scored(
            prompts=prompts,
            completions=completions,
            rewards=rewards,
            reward=reward,
            advantages=output["advantages"].detach().float().cpu(),
            train_step=self.state.global_step,
        )
        self.scored_batches += 1


class _OptimizerSteps(TrainerCallback):
    """Tells the async rollout function of each optimizer step (:meth:`TorchRLRolloutFunc.on_optimizer_step`)."""

    def __init__(self, trainer: TorchRLGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.rollout_func.on_optimizer_step(self.trainer)


def _reading_ahead(rollout_func: TorchRLRolloutFunc, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``train_dataset`` read ahead for the async rollout function, after the checks that make the
    prompts trl will pass next knowable: one process, a stream trl does not shuffle, no DataLoader workers."""
    import datasets

    config = kwargs.get("args", args[2] if len(args) > 2 else None)
    dataset = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
    if config is None or dataset is None or len(args) > 2:
        raise ValueError(
            "TorchRLGRPOTrainer: mode='async' needs args= and train_dataset= as keyword arguments (it reads the prompt "
            "stream ahead of trl)."
        )
    problems = []
    if isinstance(dataset, datasets.Dataset):
        # Read as a stream of passes over it, each shuffled as trl's sampler would (args.shuffle_dataset, args.seed):
        # trl then reads the stream in order, so that the next batch's prompts are known ahead.
        if config.max_steps is None or config.max_steps <= 0:
            problems.append("a datasets.Dataset is read as a stream here, which has no length: set args.max_steps")
        dataset = _passes_over(dataset, shuffle=config.shuffle_dataset, seed=config.seed)
        config = copy.copy(config)
        config.shuffle_dataset = False
        kwargs = {**kwargs, "args": config}
    elif not isinstance(dataset, datasets.IterableDataset):
        problems.append(
            f"train_dataset is a {type(dataset).__name__}: pass a datasets.Dataset or a stream (a datasets."
            "IterableDataset such as interop.TorchRLBufferDataset(...).as_hf_dataset(), whose TorchRL sampler shuffles)"
        )
    elif config.shuffle_dataset:
        problems.append("args.shuffle_dataset=True reorders the stream in a buffer: set shuffle_dataset=False")
    if config.dataloader_num_workers:
        problems.append("args.dataloader_num_workers > 0 draws the stream in other processes: set it to 0")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        problems.append("several processes: the async mode runs in one (use mode='sync' under a launcher)")
    if problems:
        raise ValueError(
            "TorchRLGRPOTrainer: mode='async' samples the next generation batch before trl asks for it, so trl's "
            f"prompts must be knowable ahead: {'; '.join(problems)}."
        )
    per_generation = config.per_device_train_batch_size * config.steps_per_generation // config.num_generations
    lookahead = PromptLookahead(dataset, prompts_per_generation=per_generation, num_generations=config.num_generations)
    rollout_func.lookahead = lookahead
    return {**kwargs, "train_dataset": lookahead.dataset()}


def check_importance_sampling_settings(args) -> None:
    """Refuses ``vllm_importance_sampling_*`` settings trl would fail on only once a batch is scored, or not at all.

    Each refusal is an ``interop.errors.SettingError`` of ``GRPOConfig`` naming its field: a mode trl 1.16 does not
    have, ``clip_min >= clip_max``, a ``*_truncate`` mode with no bound, and a ``vespo`` loss with a ``sequence_*`` mode
    (trl refuses that pair only with vLLM). A wrong mode is refused even with the correction off.

    Args:
        args: a ``trl.GRPOConfig`` (or any object with its fields).

    Examples:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(
        ...     vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_clip",
        ...     vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0, loss_type="dapo",
        ... )
        >>> check_importance_sampling_settings(settings)
        Traceback (most recent call last):
        ...
        interop.errors.SettingError: GRPOConfig: vllm_importance_sampling_mode='token_clip' is not one of trl's ...
    """
    mode = args.vllm_importance_sampling_mode
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise SettingError(
            "GRPOConfig",
            f"vllm_importance_sampling_mode={mode!r} is not one of trl's modes: {', '.join(IMPORTANCE_SAMPLING_MODES)} "
            "(token_*: a ratio per token; sequence_*: one per completion, from its summed log-ratio; *_truncate clips "
            "the ratio into [clip_min, clip_max], *_mask zeroes it outside).",
            field="vllm_importance_sampling_mode",
        )
    if not args.vllm_importance_sampling_correction:
        return
    if low is not None and high is not None and low >= high:
        raise SettingError(
            "GRPOConfig",
            f"vllm_importance_sampling_clip_min={low} is not below vllm_importance_sampling_clip_max={high}: the "
            f"ratios kept would be an empty range. Set clip_min below clip_max (e.g. clip_min=0.5, clip_max=2.0).",
            field="vllm_importance_sampling_clip_min",
        )
    if mode.endswith("_truncate") and low is None and high is None:
        raise SettingError(
            "GRPOConfig",
            f"vllm_importance_sampling_clip_max=None with vllm_importance_sampling_clip_min=None: {mode} clips the "
            "ratio into [clip_min, clip_max] and needs one bound at least (trl's default clip_max is 3.0).",
            field="vllm_importance_sampling_clip_max",
        )
    if args.loss_type == "vespo" and mode.startswith("sequence_"):
        raise SettingError(
            "GRPOConfig",
            f"vllm_importance_sampling_mode={mode!r} with loss_type='vespo': VESPO weighs sequences itself and takes "
            "a per-token correction only; use token_truncate or token_mask.",
            field="vllm_importance_sampling_mode",
        )


def _check_sampler_log_probs(*, completion_ids: list, log_probs) -> None:
    """The correction needs the sampler's log-prob of every completion token: a rollout function that returns none
    (or rows of other lengths) is refused before trl weighs a loss with them."""
    rows = [] if log_probs is None else list(log_probs)
    bad = [i for i, ids in enumerate(completion_ids) if i >= len(rows) or rows[i] is None or len(rows[i]) != len(ids)]
    if bad:
        raise ValueError(
            f"TorchRLGRPOTrainer: GRPOConfig.vllm_importance_sampling_correction=True weighs the loss by the trainer's "
            f"and the sampler's log-probs, but the rollout function returned no sampler log-prob row for "
            f"{len(bad)} of {len(completion_ids)} completions (e.g. row {bad[0]}; 'logprobs' must hold one value per "
            "completion token). Return them, or set vllm_importance_sampling_correction=False."
        )


def _spread(rewards: torch.Tensor) -> float:
    """A group's reward spread (standard deviation over the rewards that apply): 0 when they all tie."""
    finite = rewards[torch.isfinite(rewards)].double()
    if finite.numel() < 2 or bool(torch.isclose(finite, finite[0]).all()):
        return 0.0
    return float(finite.std(unbiased=True))


def _group_rows(
    output: dict, index: int, group: int, *, with_ref: bool, old_key: str = "old_per_token_logps", corrected=False
) -> TensorDict:
    """Group ``index`` of a scored batch (trl's output) as a stored group: its rows' tensors on the CPU, its old
    log-probs from ``old_key``; ``corrected``: with its sampling log-probs and correction ratio too (trl's)."""
    rows = slice(index * group, (index + 1) * group)
    fields = {
        "prompt_ids": output["prompt_ids"][rows],
        "prompt_mask": output["prompt_mask"][rows],
        "completion_ids": output["completion_ids"][rows],
        "completion_mask": output["completion_mask"][rows],
        "advantages": output["advantages"][rows].float(),
        "old_logps": output[old_key][rows].float(),
    }
    if with_ref:
        fields["ref_logps"] = output["ref_per_token_logps"][rows].float()
    if corrected:
        fields["sampling_logps"] = output["sampling_per_token_logps"][rows].float()
        fields["is_ratio"] = output["importance_sampling_ratio"][rows].float()
    return TensorDict({key: value.detach().cpu() for key, value in fields.items()}, batch_size=[group])


def _stacked(groups: list, *, pad_token_id: int, device) -> dict:
    """trl's batch tensors from groups of other widths: prompts left-padded, completions right-padded."""
    prompt_ids = pad_rows([g["prompt_ids"] for g in groups], side="left", value=pad_token_id)
    prompt_mask = pad_rows([g["prompt_mask"] for g in groups], side="left", value=0)
    completion_ids = pad_rows([g["completion_ids"] for g in groups], side="right", value=pad_token_id)
    completion_mask = pad_rows([g["completion_mask"] for g in groups], side="right", value=0)
    stacked = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.cat([g["advantages"] for g in groups]),
        "old_per_token_logps": pad_rows([g["old_logps"] for g in groups], side="right", value=0.0),
    }
    if "ref_logps" in groups[0].keys():
        stacked["ref_per_token_logps"] = pad_rows([g["ref_logps"] for g in groups], side="right", value=0.0)
    if "is_ratio" in groups[0].keys():
        stacked["sampling_per_token_logps"] = pad_rows([g["sampling_logps"] for g in groups], side="right", value=0.0)
        stacked["importance_sampling_ratio"] = pad_rows([g["is_ratio"] for g in groups], side="right", value=1.0)
    return {key: value.to(device) for key, value in stacked.items()}
