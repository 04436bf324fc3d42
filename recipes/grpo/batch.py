"""The dense batch a GRPO step trains on: its keys, and where its responses are.

Every rollout of the recipe (``rollout.env=prompt``'s sampler, ``rollout.env=chat``'s padded TorchRL rollout) hands the
learner one flat TensorDict of ``B`` responses whose rows are ``[pads | prompt | response | pads]``, every response
starting at the same column (``generate``'s layout, what TorchRL's padded ``GRPOLoss`` actor assumes):

- :data:`PROMPT_TOKENS` ``[B, P]``: the prompts, left-padded; :data:`PROMPT_MASK` ``[B, P]`` (a step of
  ``rollout.env=prompt`` only);
- :data:`RESPONSE_TOKENS` ``[B, R]``: the responses, right-padded, pad id after EOS;
- :data:`TOKENS` ``[B, P + R]``: both; :data:`ATTENTION_MASK` ``[B, P + R]``, True on real tokens;
- :data:`LOG_PROBS` ``[B, P + R]``: each response token's log-prob under the policy that sampled it (the behaviour,
  or "old", log-probs), 0 elsewhere (TorchRL's layout of ``("log_probs", "full")``);
- :data:`PROMPT_INDEX` ``[B]``: the prompt's row in the run's prompt table, the group id of GRPO's normalisation;
- :data:`POLICY_VERSION` ``[B]``: how many updates the sampling weights had had;
- :data:`TRUNCATED` ``[B]``: the response hit ``max_new_tokens`` before an EOS;
- :data:`REWARD` ``[B, 1, 1]`` and :data:`DONE` ``[B, 1]``: TorchRL's LLM reward and done layout; the reward is the
  weighted sum of :data:`SOURCE_REWARDS` ``[B, K]``, each reward source's own value (NaN where a trl reward function
  returned ``None``), in ``recipes.grpo.rewards.reward_sources`` order;
- :data:`REWARD_LOGS` ``[B]`` (with ``reward.functions`` only): what the trl reward functions logged while the batch
  was scored (``log_metric``, ``log_extra``), one JSON text per response (``recipes.grpo.rewards.RewardLogsToBatch``).

The learner then adds :data:`ADVANTAGE` (``[B, 1, 1]``), :data:`REF_LOG_PROBS` (``[B, P + R]``, the frozen
reference's) and :data:`LOSS_MASK` (``[B, R]``: the response tokens the loss counts, truncated responses left out
with ``loss.mask_truncated_completions``). :data:`BATCH_KEYS` is what a collector hands over; :func:`response_start`
and :func:`response_mask` are the one way to find the responses in it, :func:`merge_batches` the one way to join
batches of different widths.

Dependencies: torch, tensordict.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch.nn import functional

# What the sampler writes (interop.CausalLMSampler, TorchRL's layout) is the batch's own.
from interop.sampling import (
    ATTENTION_MASK,
    LOG_PROBS,
    POLICY_VERSION,
    PROMPT_MASK,
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    TOKENS,
    TRUNCATED,
)

__all__ = [
    "ADVANTAGE",
    "ATTENTION_MASK",
    "BATCH_KEYS",
    "DONE",
    "LOG_PROBS",
    "LOSS_MASK",
    "POLICY_VERSION",
    "PROMPT_INDEX",
    "PROMPT_MASK",
    "PROMPT_TOKENS",
    "REF_LOG_PROBS",
    "RESPONSE_TOKENS",
    "REWARD",
    "REWARD_LOGS",
    "SOURCE_REWARDS",
    "TOKENS",
    "TRUNCATED",
    "merge_batches",
    "response_mask",
    "response_start",
]

PROMPT_INDEX = "prompt_index"
REWARD = ("next", "reward")
SOURCE_REWARDS = ("next", "source_rewards")
REWARD_LOGS = ("next", "reward_logs")
DONE = ("next", "done")
ADVANTAGE = "advantage"
REF_LOG_PROBS = ("next", "ref_log_probs", "full")
LOSS_MASK = ("masks", "loss")

# What a step hands the learner: the dense sequences, the behaviour log-probs, the group ids, rewards and the policy
# version the responses were sampled with.
BATCH_KEYS = (
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    TOKENS,
    ATTENTION_MASK,
    LOG_PROBS,
    PROMPT_INDEX,
    POLICY_VERSION,
    TRUNCATED,
    REWARD,
    SOURCE_REWARDS,
    DONE,
)


def response_start(batch: TensorDictBase) -> int:
    """The column where every response starts in a dense batch: the width of :data:`PROMPT_TOKENS`."""
    return batch.get(PROMPT_TOKENS).shape[-1]


def response_mask(batch: TensorDictBase) -> torch.Tensor:
    """``[B, R]``, True on each row's response tokens (EOS included): the attention mask's response columns.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict(
        ...     {"tokens": {"prompt": torch.tensor([[0, 5], [6, 7]])},
        ...      "masks": {"all_attention_mask": torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]]).bool()}},
        ...     batch_size=[2],
        ... )
        >>> response_mask(batch)
        tensor([[ True, False],
                [ True,  True]])
    """
    return batch.get(ATTENTION_MASK)[:, response_start(batch) :].bool()


def merge_batches(batches: list[TensorDictBase], *, pad_token_id: int) -> TensorDictBase:
    """Dense batches of different widths as one: each widened to the longest prompt (padding on the left) and the
    longest response (on the right), so that every response still starts at one column. Pads carry ``pad_token_id``,
    a False mask and a log-prob of 0.

    Examples:
        >>> from tensordict import TensorDict
        >>> def batch(prompt, response):
        ...     full = torch.tensor([prompt + response])
        ...     return TensorDict({"tokens": {"prompt": torch.tensor([prompt]), "response": torch.tensor([response]),
        ...                                   "full": full}, "masks": {"all_attention_mask": full > 0}}, batch_size=[1])
        >>> merge_batches([batch([5], [6, 7]), batch([8, 9], [4])], pad_token_id=0)["tokens", "full"]
        tensor([[0, 5, 6, 7],
                [8, 9, 4, 0]])
    """
    if len(batches) == 1:
        return batches[0]
    prompt = max(batch.get(PROMPT_TOKENS).shape[-1] for batch in batches)
    response = max(batch.get(RESPONSE_TOKENS).shape[-1] for batch in batches)
    widened = []
    for batch in batches:
        batch = batch.clone(recurse=False) if hasattr(batch, "clone") else batch
        left = prompt - batch.get(PROMPT_TOKENS).shape[-1]
        right = response - batch.get(RESPONSE_TOKENS).shape[-1]
        pads = {TOKENS: pad_token_id, ATTENTION_MASK: False, LOG_PROBS: 0.0, REF_LOG_PROBS: 0.0, LOSS_MASK: False}
        for key, value in pads.items():
            if key in batch.keys(include_nested=True):
                columns = (0, right) if key == LOSS_MASK else (left, right)
                batch.set(key, functional.pad(batch.get(key), columns, value=value))
        batch.set(PROMPT_TOKENS, functional.pad(batch.get(PROMPT_TOKENS), (left, 0), value=pad_token_id))
        batch.set(RESPONSE_TOKENS, functional.pad(batch.get(RESPONSE_TOKENS), (0, right), value=pad_token_id))
        widened.append(batch)
    return torch.cat(widened)
