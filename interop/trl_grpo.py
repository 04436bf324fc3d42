"""trl's ``GRPOTrainer`` sampling through TorchRL, every scored rollout written to a TorchRL buffer.

Public names:

- :class:`TorchRLGRPOTrainer`: ``trl.GRPOTrainer`` with an :class:`~interop.rollout_func.TorchRLRolloutFunc` as its
  ``rollout_func`` (by default one that samples with an :class:`~interop.sampling.CausalLMSampler` around the model
  trl trains, at the ``GRPOConfig``'s sampling settings). Everything trl computes is unchanged; it also reads the
  rewards trl's ``_calculate_rewards`` returns and the advantages ``_generate_and_score_completions`` returns, so that
  each generation batch reaches the ``replay_buffer`` once scored: token ids, behaviour log-probs, the prompt and the
  completion's text, each reward function's value, trl's reward and advantage, the step.

A plain ``trl.GRPOTrainer(rollout_func=TorchRLRolloutFunc(...))`` samples the same way; its buffer rows are written
when sampled, without the scores (a ``rollout_func`` never sees them).

Dependencies: ``torch``, ``trl`` (imported with this module: ``interop`` imports it only when this class is used).
"""

from __future__ import annotations

import os

import torch
from tensordict import TensorDictBase
from trl import GRPOTrainer

from interop.rollout_func import TorchRLRolloutFunc

__all__ = ["TorchRLGRPOTrainer"]


class TorchRLGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose completions TorchRL samples, each scored generation batch written to a TorchRL buffer.

    Args:
        *args, **kwargs: ``trl.GRPOTrainer``'s own (``model``, ``reward_funcs``, ``args``, ``train_dataset``,
            ``processing_class``, ``peft_config``...).

    Keyword Args:
        rollout_func: a :class:`~interop.rollout_func.TorchRLRolloutFunc`; ``None``: ``TorchRLRolloutFunc()``, a
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

    def __init__(self, *args, rollout_func: TorchRLRolloutFunc | None = None, replay_buffer=None, **kwargs) -> None:
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
        rollout_func.writes_scored_rows = True
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is what this class is for
        super().__init__(*args, rollout_func=rollout_func, **kwargs)
        self.last_scored: TensorDictBase | None = None
        self.scored_batches = 0
        self._scored = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scored = (prompts, completions, rewards_per_func)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self._record(output)
        return output

    def _record(self, output: dict) -> None:
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
        )
        self.scored_batches += 1
