"""A trained reward model measured on the held-out pairs, scored as the GRPO recipe scores
(``interop.HFRewardModelWrapper(tokenizer=...)``): pairwise accuracy, mean margin, and on the synthetic task the
Spearman correlation of its scores with the oracle's.

Dependencies: torch, tensordict, torchrl, and the project's ``interop`` package.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict
from torchrl.data.llm import History

from interop import HFRewardModelWrapper
from recipes.common.config import tensordict_key
from recipes.reward.pairs import LabelledPairs
from recipes.reward.schema import Eval

__all__ = ["evaluate", "score_sequences", "spearman"]


def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks from 0, ties sharing their average rank (what Spearman's coefficient needs)."""
    ordered, order = values.double().sort()
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0)
    ranks = torch.empty_like(ordered)
    ranks[order] = ((ends - counts + ends - 1).double() / 2.0)[inverse]
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation (Pearson correlation of average ranks); nan when either side is constant."""
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denominator) if denominator > 0 else float("nan")


def score_sequences(model, tokenizer, sequences: list, eval_cfg: Eval, *, conversational: bool) -> torch.Tensor:
    """Reward of each sequence (a message list or a text) through ``interop.HFRewardModelWrapper(tokenizer=...)``."""
    history_key, text_key = tensordict_key(eval_cfg.history_key), tensordict_key(eval_cfg.text_key)
    scorer = HFRewardModelWrapper(
        model,
        tokenizer=tokenizer,
        history_key=history_key if conversational else None,
        text_key=text_key,
        reward_key=tensordict_key(eval_cfg.reward_key),
        inference_mode=True,
        micro_batch_size=eval_cfg.micro_batch_size,
        check_finite=True,
    )
    td = TensorDict(batch_size=[len(sequences)])
    if conversational:
        td.set(history_key, History.from_chats(sequences))
    else:
        td.set(text_key, NonTensorStack.from_list(sequences))
    return scorer(td).get(tensordict_key(eval_cfg.reward_key))


def evaluate(model, tokenizer, labelled: LabelledPairs, eval_cfg: Eval) -> dict[str, float]:
    """Pairwise accuracy and mean reward margin on the held-out pairs; Spearman vs the oracle when it is known.

    ``labelled`` holds the pairs to score as they are (:func:`limit_eval_to_max_length` left out the long ones).
    """
    model.eval()
    conversational = labelled.conversational
    scores = {
        side: score_sequences(
            model, tokenizer, [p["prompt"] + p[side] for p in labelled.eval], eval_cfg, conversational=conversational
        )
        for side in ("chosen", "rejected")
    }
    metrics = {
        "eval/accuracy": float((scores["chosen"] > scores["rejected"]).float().mean()),
        "eval/margin_mean": float((scores["chosen"] - scores["rejected"]).mean()),
        "eval/num_pairs": len(labelled.eval),
    }
    if labelled.eval_responses:
        responses = [r["prompt"] + [{"role": "assistant", "content": r["response"]}] for r in labelled.eval_responses]
        rewards = score_sequences(model, tokenizer, responses, eval_cfg, conversational=True)
        metrics["eval/spearman"] = spearman(rewards, torch.tensor([r["oracle"] for r in labelled.eval_responses]))
    return metrics
