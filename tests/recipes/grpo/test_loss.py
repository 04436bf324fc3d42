"""recipes/grpo/loss.py: GroupAdvantage gives MCAdvantage's advantages, each in its own row; ResponseGRPOLoss
trains as TorchRL's GRPOLoss with its own LLM actor, on the batches the recipe's sampling policy writes.

(The padded chat rollouts against the ragged ones: test_rollout.py, beside pad_rollout.)"""

from __future__ import annotations

import pytest
import torch
from _grpo_helpers import grpo_loss_and_gradients, torchrl_actor
from tensordict import TensorDict

from recipes.grpo.log_probs import ResponseLogProbs, ScoreLogProbs
from recipes.grpo.loss import GroupAdvantage, ResponseGRPOLoss


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


class TestResponseGRPOLoss:
    """The recipe's loss on the batches its ``PromptEnv`` + ``SamplingPolicy`` collect."""

    NAMES = ("loss_objective", "loss_entropy", "loss_kl_to_ref", "clip_fraction", "kl_to_ref", "entropy", "ESS")

    @pytest.fixture(scope="class")
    def batch(self, tiny_policy):
        from recipes.grpo.prompt_env import PromptEnv
        from recipes.grpo.sampling import SamplingPolicy, SamplingSettings

        model, tokenizer = tiny_policy
        prompts = ["Review the mug.", "What do you think of the bike and of its color?"]
        env = PromptEnv(prompts, tokenizer=tokenizer, group_size=3, num_prompts=2, shuffle=False)
        policy = SamplingPolicy(model, tokenizer, settings=SamplingSettings(max_new_tokens=48, top_k=50))
        torch.manual_seed(5)
        batch = policy(env.reset()).select(
            ("tokens", "prompt"), ("tokens", "full"), ("masks", "all_attention_mask"), ("log_probs", "full")
        )
        assert batch["masks", "all_attention_mask"][:, -1].sum() < 6  # some responses end early: really padded
        ScoreLogProbs(ResponseLogProbs(model), out_key=("next", "ref_log_probs", "full"))(batch)
        batch.set("advantage", torch.linspace(-1.0, 1.0, 6).reshape(6, 1, 1))
        return batch

    def _assert_same(self, got, expected, *, names=NAMES):
        (got_out, got_grads), (expected_out, expected_grads) = got, expected
        for name in names:
            torch.testing.assert_close(got_out.get(name), expected_out.get(name), atol=1e-5, rtol=1e-4, msg=name)
        for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
            torch.testing.assert_close(got_grad, expected_grad, atol=1e-5, rtol=1e-4)

    def test_equal_to_grpo_loss_with_torchrl_actor_off_policy(self, tiny_policy, batch):
        """Old log-probs of an older policy (ratios far from 1, some clipped), KL and entropy terms on."""
        from torchrl.objectives.llm import GRPOLoss

        model, tokenizer = tiny_policy
        older = batch.clone()
        older.set(("log_probs", "full"), batch["next", "ref_log_probs", "full"] * 1.3)
        expected = grpo_loss_and_gradients(GRPOLoss, torchrl_actor(model, tokenizer, padded=True), older)
        got = grpo_loss_and_gradients(ResponseGRPOLoss, ResponseLogProbs(model), older)
        assert expected[0].clip_fraction > 0
        self._assert_same(got, expected)

    def test_on_the_sampling_log_probs_the_ratio_is_one(self, tiny_policy, batch):
        """As collected: the behaviour log-probs recorded while sampling are the loss's own, so nothing clips and
        the loss is GRPOLoss's with those old log-probs."""
        from torchrl.objectives.llm import GRPOLoss

        model, tokenizer = tiny_policy
        got = grpo_loss_and_gradients(ResponseGRPOLoss, ResponseLogProbs(model), batch.clone())
        expected = grpo_loss_and_gradients(GRPOLoss, torchrl_actor(model, tokenizer, padded=True), batch.clone())
        assert got[0].clip_fraction == 0 and got[0].kl_approx.abs() < 1e-5
        self._assert_same(got, expected)

    def test_without_old_log_probs_it_trains_on_policy(self, tiny_policy, batch):
        """No old log-probs (a chat rollout trained once): the current ones, detached, as GRPOLoss with them."""
        from torchrl.objectives.llm import GRPOLoss

        model, tokenizer = tiny_policy
        bare = batch.exclude(("log_probs", "full"))
        recomputed = bare.clone()
        ScoreLogProbs(ResponseLogProbs(model), out_key=("log_probs", "full"))(recomputed)
        expected = grpo_loss_and_gradients(GRPOLoss, torchrl_actor(model, tokenizer, padded=True), recomputed)
        got = grpo_loss_and_gradients(ResponseGRPOLoss, ResponseLogProbs(model), bare)
        assert got[0].clip_fraction == 0
        self._assert_same(got, expected)
        assert ("log_probs", "full") not in bare.keys(True)  # the caller's batch is left as it was

    def test_only_the_response_tokens_count(self, tiny_policy):
        model, _ = tiny_policy
        with pytest.raises(ValueError, match="masking_strategy='sft'"):
            ResponseGRPOLoss(ResponseLogProbs(model), masking_strategy="rlhf")
