"""TorchRL advantages and losses as the recipes use them.

- :class:`GroupAdvantage`: TorchRL's ``MCAdvantage`` (GRPO's group normalisation) run over the three entries it reads.
- :class:`ResponseGRPOLoss`: TorchRL's ``GRPOLoss`` whose policy log-probs are computed over the response positions
  of a dense batch only (``recipes.grpo.log_probs.ResponseLogProbs``), never as ``[B, T, V]`` logits.
- :func:`make_loss`: the loss of the recipe's ``loss:`` node; :func:`training_loss`: the sum its backward runs on.

Dependencies: torch, tensordict, torchrl.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from tensordict import NestedKey, TensorDictBase
from torch.distributions import Distribution
from torchrl.objectives.llm import GRPOLoss, MCAdvantage

from recipes.grpo.batch import ADVANTAGE, ATTENTION_MASK, DONE, PROMPT_INDEX, REWARD, response_start

__all__ = ["GroupAdvantage", "ResponseGRPOLoss", "make_loss", "training_loss"]


class GroupAdvantage:
    """Writes GRPO advantages into a batch of whole groups: TorchRL's ``MCAdvantage`` over a slim copy of it.

    ``MCAdvantage`` queues, concatenates and re-splits every sample it is given, one at a time, with all its entries;
    given the prompt id, reward and done flag alone (and a sample index, to put each advantage back in its row), it
    computes the same advantages at a third of the cost of going through a replay buffer's transforms with the token
    tensors. The batch must hold whole groups (``group_size`` samples per prompt id), as a GRPO step does.

    Args:
        group_size: samples per prompt (``MCAdvantage``'s ``grpo_size``).

    Keyword Args:
        prompt_key: the group id of each sample.
        reward_key: the reward of each sample (``[N, 1, 1]`` for single-turn rollouts).
        done_key: the done flag of each sample.
        advantage_key: where the advantages go, shaped like the rewards.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> rewards = torch.tensor([1.0, 5.0, 3.0, 5.0]).view(4, 1, 1)
        >>> batch = TensorDict(
        ...     {"prompt_index": torch.tensor([0, 1, 0, 1]),
        ...      "next": {"reward": rewards, "done": torch.ones(4, 1, dtype=torch.bool)}},
        ...     batch_size=[4],
        ... )
        >>> GroupAdvantage(2)(batch)["advantage"].view(-1)
        tensor([-0.7071,  0.0000,  0.7071,  0.0000])
    """

    def __init__(
        self,
        group_size: int,
        *,
        prompt_key: NestedKey = PROMPT_INDEX,
        reward_key: NestedKey = REWARD,
        done_key: NestedKey = DONE,
        advantage_key: NestedKey = ADVANTAGE,
    ) -> None:
        self.keys = (prompt_key, reward_key, done_key)
        self.advantage_key = advantage_key
        self.transform = MCAdvantage(
            grpo_size=group_size,
            prompt_key=prompt_key,
            rewards_key=reward_key,
            done_key=done_key,
            advantage_key=advantage_key,
        )

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        if batch.ndim != 1:
            raise ValueError(f"GroupAdvantage: expected a flat batch, got batch size {tuple(batch.batch_size)}.")
        slim = batch.select(*self.keys).to_tensordict()
        slim.set("_row", torch.arange(batch.shape[0]))
        scored = self.transform.inv(slim)
        if scored is None or scored.shape[0] != batch.shape[0]:
            self.transform.queues.clear()  # never leave a partial group to mix with the next batch
            raise ValueError(
                f"GroupAdvantage: the batch of {batch.shape[0]} samples does not hold whole groups of "
                f"{self.transform.grpo_size} samples per {self.keys[0]!r}."
            )
        advantage = torch.empty_like(scored.get(self.advantage_key))
        advantage[scored.get("_row")] = scored.get(self.advantage_key)
        batch.set(self.advantage_key, advantage)
        return batch


class _ScoredTokens(Distribution):
    """What ``GRPOLoss`` reads of a token distribution, already computed: the log-probs of the tokens it is asked
    about, the entropies, and the mask of the positions that count (the response tokens)."""

    arg_constraints = {}

    def __init__(self, log_probs: torch.Tensor, entropy: torch.Tensor | None, mask: torch.Tensor) -> None:
        super().__init__(batch_shape=log_probs.shape, validate_args=False)
        self._log_probs, self._entropy, self.mask = log_probs, entropy, mask

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self._log_probs

    def entropy(self) -> torch.Tensor:
        if self._entropy is None:
            raise RuntimeError("ResponseGRPOLoss: entropies were not computed (entropy_bonus=False).")
        return self._entropy


class ResponseGRPOLoss(GRPOLoss):
    """``GRPOLoss`` over dense ``[B, T]`` batches, scoring the response positions only.

    TorchRL's LLM actors compute ``[B, T, V]`` logits and a log-softmax over every position, prompt included, to take
    the response tokens' log-probs and entropies. This loss gets them from a
    :class:`~recipes.grpo.log_probs.ResponseLogProbs` (chunked LM head over the response positions), in the same
    ``[B, T]`` layout, zero outside the response, with the response tokens as the mask (``masking_strategy="sft"``):
    the objective, clipping, KL terms, aggregation and diagnostics are ``GRPOLoss``'s own, with the same values.

    A batch without old log-probs (at ``tensor_keys.sample_log_prob``) is read as on-policy: it trains the very
    policy that sampled it, so the current log-probs, detached, stand in for them (as ``trl.GRPOTrainer`` does with
    one update per generation batch): the ratio is exactly 1, and a forward pass is saved.

    Args:
        scorer: a ``ResponseLogProbs`` over the policy (or a ``DistributedDataParallel`` wrapping one, so that the
            backward averages the gradients over the processes).

    Keyword Args:
        The keyword arguments of ``GRPOLoss`` (``masking_strategy`` must stay ``"sft"``).
    """

    def __init__(self, scorer, **kwargs) -> None:
        if kwargs.get("masking_strategy", "sft") != "sft":
            raise ValueError("ResponseGRPOLoss: the loss counts the response tokens only (masking_strategy='sft').")
        super().__init__(scorer, **kwargs)

    def _get_cur_log_prob(self, tensordict):
        tokens = tensordict.get(self.tensor_keys.action)
        mask = tensordict.get(ATTENTION_MASK).bool()
        start = response_start(tensordict)
        log_prob, entropy = self.actor_network(tokens, mask, response_start=start, with_entropy=self.entropy_bonus)
        response = mask.clone()
        response[:, :start] = False
        # GRPOLoss.forward works on a shallow copy of the batch: writing here leaves the caller's batch untouched.
        if tensordict.get(self.tensor_keys.sample_log_prob, None) is None:
            tensordict.set(self.tensor_keys.sample_log_prob, log_prob.detach())
        return log_prob, _ScoredTokens(log_prob, entropy, response), False


def make_loss(cfg: DictConfig, scorer) -> ResponseGRPOLoss:
    """``GRPOLoss`` over the response positions of the policy's ``scorer``, as ``loss:`` sets it; a batch without old
    log-probs (on-policy chat) takes the current ones."""
    return ResponseGRPOLoss(
        scorer,
        clip_epsilon=cfg.loss.clip_epsilon,
        entropy_bonus=True,  # also what reports train/entropy; its weight in the loss is entropy_coeff
        entropy_coeff=cfg.loss.entropy_coeff,
        kl_to_ref_coeff=cfg.loss.kl_to_ref_coeff or None,
        aggregation=cfg.loss.aggregation,
        masking_strategy="sft",
    )


def training_loss(out, *, entropy_coeff: float) -> torch.Tensor:
    """The sum of ``GRPOLoss``'s ``loss_*`` terms, without the entropy term when its coefficient is 0.

    That term is then ``0 * entropy``: nothing to the loss, but its backward would run through a softmax over the whole
    vocabulary at every position of the batch (``entropy_bonus=True`` stays on for the ``train/entropy`` metric)."""
    skipped = set() if entropy_coeff else {"loss_entropy"}
    terms = [value for key, value in out.items() if key.startswith("loss_") and key not in skipped]
    return sum(value for value in terms if value is not None)
