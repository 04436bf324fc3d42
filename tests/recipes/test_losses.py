"""recipes/common/losses.py: GroupAdvantage gives MCAdvantage's advantages, each in its own row.

(OnPolicyGRPOLoss is tested with the tiny policy in test_rollout.py, beside the padded batches it trains on.)"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from recipes.common.losses import GroupAdvantage


def _batch(prompt_index: list[int], *, seed: int = 0) -> TensorDict:
    n = len(prompt_index)
    generator = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "prompt_index": torch.tensor(prompt_index),
            "tokens": {"full": torch.randint(0, 9, (n, 5), generator=generator)},
            "next": {"reward": torch.randn(n, 1, 1, generator=generator), "done": torch.ones(n, 1, dtype=torch.bool)},
        },
        batch_size=[n],
    )


def _through_a_replay_buffer(batch: TensorDict, group_size: int) -> TensorDict:
    """TorchRL's own way: MCAdvantage as the transform of a LazyStackStorage buffer."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    buffer = ReplayBuffer(storage=LazyStackStorage(batch.shape[0]))
    buffer.append_transform(MCAdvantage(grpo_size=group_size, prompt_key="prompt_index"))
    buffer.extend(batch.clone())
    return buffer[:]


@pytest.mark.parametrize(
    "prompt_index",
    [
        [0, 0, 0, 1, 1, 1],  # contiguous groups, as the GRPO env makes them
        [2, 1, 2, 1, 1, 2],  # interleaved
        [4, 4, 7, 4, 7, 7, 4, 4, 4, 7, 7, 7],  # one prompt drawn twice in a step: two groups of the same id
    ],
)
def test_same_advantages_as_mcadvantage_in_a_replay_buffer(prompt_index):
    batch = _batch(prompt_index)
    expected = _through_a_replay_buffer(batch, group_size=3)
    GroupAdvantage(3)(batch)
    # The buffer's MCAdvantage hands the samples back grouped; match them to the batch's rows by their tokens.
    rows = [int((batch["tokens", "full"] == tokens).all(-1).nonzero()) for tokens in expected["tokens", "full"]]
    assert sorted(rows) == list(range(len(prompt_index)))
    torch.testing.assert_close(batch["advantage"][rows], expected["advantage"])
    assert batch["advantage"].shape == batch["next", "reward"].shape
    # Within each group of 3 the advantages are normalised: mean 0, std 1.
    for prompt in set(prompt_index[:6]):
        if prompt_index.count(prompt) == 3:
            group = batch["advantage"][batch["prompt_index"] == prompt].view(-1)
            assert abs(float(group.mean())) < 1e-5 and float(group.std()) == pytest.approx(1.0, abs=1e-4)


def test_an_incomplete_group_is_refused_and_forgotten():
    advantage = GroupAdvantage(3)
    with pytest.raises(ValueError, match="does not hold whole groups of 3"):
        advantage(_batch([0, 0, 1, 1, 1]))
    # The two samples of prompt 0 are not left behind to be mixed into the next batch's groups.
    batch = _batch([0, 0, 0], seed=1)
    advantage(batch)
    rewards = batch["next", "reward"].view(-1)
    torch.testing.assert_close(batch["advantage"].view(-1), (rewards - rewards.mean()) / rewards.std())
