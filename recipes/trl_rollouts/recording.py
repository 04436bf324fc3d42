"""``trl.GRPOTrainer`` that keeps what it trains on: each generation batch, as trl scored it, goes to a
:class:`~recipes.trl_rollouts.rollout_store.RolloutStore`, with the figures the recipe logs beside trl's.

:class:`RecordingGRPOTrainer` changes nothing trl computes: it reads the rewards trl's ``_calculate_rewards`` returns
(every process's, gathered) and the batch ``_generate_and_score_completions`` returns (the advantages of this process's
rows), and the completions the rollout function (``interop.TorchRLRolloutFunc``) sampled for them, in the same order.

Dependencies: torch, trl.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from recipes.grpo.report import distinct_bigrams

__all__ = ["RecordingGRPOTrainer", "message_text"]


def message_text(value) -> str:
    """The text of a prompt or completion as trl passes it: a string, or a message list (the last message's)."""
    if isinstance(value, str):
        return value
    content = value[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)


class RecordingGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` writing every training generation batch to ``rollout_store`` (``None``: nowhere).

    Keyword Args:
        rollout_store: where each scored batch goes (this process's rows).
        oracle: ``text -> float``, the data's ground truth; its mean over the batch (every process's) is logged as
            ``rollout/oracle_mean``.
        Everything else: ``trl.GRPOTrainer``'s arguments; ``rollout_func`` must be an ``interop.TorchRLRolloutFunc``
        (its ``last_rollout`` holds the batch's tokens).

    :attr:`figures` maps an optimizer step to the recipe's figures of the batch it trained on (the oracle's mean and
    the distinct bigrams), for the metrics callback to log with trl's.
    """

    def __init__(self, *args, rollout_store=None, oracle=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not hasattr(self.rollout_func, "last_rollout"):
            raise ValueError(
                "RecordingGRPOTrainer: rollout_func must be an interop.TorchRLRolloutFunc (it records the sampled "
                f"tokens the store keeps); got {type(self.rollout_func).__name__}."
            )
        self.rollout_store = rollout_store
        self.oracle = oracle
        self.figures: dict[int, dict[str, float]] = {}
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
        # trl's reward: the weighted sum of the sources that applied (NaN when none did).
        reward = (rewards * self.reward_weights.cpu()[None]).nansum(dim=1)
        reward[torch.isnan(rewards).all(dim=1)] = float("nan")
        rollout = self.rollout_func.last_rollout
        completion_texts = [message_text(completion) for completion in completions]
        step = self.state.global_step + 1  # the optimizer step this batch trains (its first, with several per batch)
        if self.rollout_store is not None:
            self.rollout_store.write(
                rollout,
                prompt_texts=[message_text(prompt) for prompt in prompts],
                completion_texts=completion_texts,
                rewards=rewards,
                reward=reward,
                advantages=output["advantages"],
                step=step,
            )
        self.figures[step] = self._figures(rollout, completion_texts)

    def _figures(self, rollout, completion_texts: list[str]) -> dict[str, float]:
        device = self.accelerator.device
        lengths = rollout.get("completion_length")
        mask = torch.arange(rollout.get("completion_ids").shape[-1]) < lengths[:, None]
        figures = {"rollout/distinct_2": distinct_bigrams(rollout.get("completion_ids"), mask)}
        if self.oracle is not None:
            scores = [float(self.oracle(text)) for text in completion_texts]
            totals = self.accelerator.gather(torch.tensor([[sum(scores), len(scores)]], device=device)).sum(0)
            figures["rollout/oracle_mean"] = float(totals[0] / totals[1])
        return figures
