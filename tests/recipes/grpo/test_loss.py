"""recipes/grpo/loss.py on the batches the recipe's sampling policy writes: the advantages of whole groups, the loss
where TorchRL's GRPOLoss computes the same thing (bnpo, no KL term: its token mean), the ratio of 1 on the recorded
sampling log-probs, on-policy batches without old log-probs, and a KL term that padding does not change.

(trl's own loss and advantages against these: test_loss_parity.py; the padded chat rollouts against the ragged ones:
test_rollout.py, beside pad_rollout.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _grpo_helpers import MAX_COMPLETION_LENGTH, loss_settings, torchrl_actor
from tensordict import TensorDict

from recipes.grpo.batch import ADVANTAGE, LOSS_MASK, REF_LOG_PROBS, response_mask
from recipes.grpo.log_probs import ResponseLogProbs, ScoreLogProbs
from recipes.grpo.loss import GroupAdvantage, GRPOObjective, Scale

SETTINGS = loss_settings()
ONE_STEP = Scale(accumulation=1, step_tokens=1.0)


def test_advantages_are_normalised_within_each_contiguous_group():
    rewards = torch.tensor([1.0, 2.0, 6.0, 5.0, 5.0, 5.0])
    batch = TensorDict({"next": {"reward": rewards.view(6, 1, 1)}}, batch_size=[6])
    GroupAdvantage(3, scale="group")(batch)
    first = batch["advantage"].view(-1)[:3]
    torch.testing.assert_close(first, (rewards[:3] - rewards[:3].mean()) / (rewards[:3].std() + 1e-4))
    assert (batch["advantage"].view(-1)[3:] == 0).all()  # a group whose rewards tie teaches nothing
    with pytest.raises(ValueError, match="whole groups of 4"):
        GroupAdvantage(4, scale="group")(batch)


@pytest.fixture(scope="module")
def batch(tiny_policy):
    from interop.sampling import CausalLMSampler, SamplingSettings
    from recipes.grpo.prompt_env import PromptEnv

    model, tokenizer = tiny_policy
    prompts = ["Review the mug.", "What do you think of the bike and of its color?"]
    env = PromptEnv(prompts, tokenizer=tokenizer, group_size=3, num_prompts=2, shuffle=False)
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=48, top_k=50))
    torch.manual_seed(5)
    batch = policy(env.reset()).select(
        ("tokens", "prompt"), ("tokens", "full"), ("masks", "all_attention_mask"), ("log_probs", "full")
    )
    assert batch["masks", "all_attention_mask"][:, -1].sum() < 6  # some responses end early: really padded
    ScoreLogProbs(ResponseLogProbs(model), out_key=REF_LOG_PROBS)(batch)
    batch.set(ADVANTAGE, torch.linspace(-1.0, 1.0, 6).reshape(6, 1, 1))
    batch.set(LOSS_MASK, response_mask(batch))
    return batch


def _loss_and_gradients(model, batch, settings=SETTINGS):
    model.zero_grad()
    objective = GRPOObjective(ResponseLogProbs(model), settings, max_completion_length=MAX_COMPLETION_LENGTH)
    out = objective(batch, scale=ONE_STEP)
    out["loss"].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out, grads


def test_bnpo_without_kl_is_torchrls_grpo_loss(tiny_policy, batch):
    """Old log-probs of an older policy (ratios far from 1, some clipped): the token mean of TorchRL's GRPOLoss, its
    loss and gradients, through its own LLM actor over the whole sequence."""
    from torchrl.objectives.llm import GRPOLoss

    model, tokenizer = tiny_policy
    older = batch.clone()
    older.set(("log_probs", "full"), batch.get(REF_LOG_PROBS) * 1.3)
    actor = torchrl_actor(model, tokenizer, padded=True)
    reference = GRPOLoss(actor, masking_strategy="sft", entropy_bonus=False, aggregation="token_mean")
    model.zero_grad()
    expected = reference(older.clone())
    expected.loss_objective.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    got, grads = _loss_and_gradients(model, older)
    assert float(got["clip_fraction"]) > 0
    torch.testing.assert_close(got["loss"], expected.loss_objective, atol=1e-5, rtol=1e-4)
    for got_grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-5, rtol=1e-4)


def test_on_the_sampling_log_probs_the_ratio_is_one(tiny_policy, batch):
    """As collected: the behaviour log-probs recorded while sampling are the loss's own, so nothing clips."""
    model, _ = tiny_policy
    got, _ = _loss_and_gradients(model, batch.clone())
    assert float(got["clip_fraction"]) == 0
    # The loss is then -advantage per token: its token mean.
    mask = batch.get(LOSS_MASK).float()
    expected = -(batch.get(ADVANTAGE).view(-1, 1) * mask).sum() / mask.sum()
    torch.testing.assert_close(got["loss"], expected, atol=1e-5, rtol=1e-4)


def test_without_old_log_probs_it_trains_on_policy(tiny_policy, batch):
    """No old log-probs (a chat rollout trained once): the current ones, detached; the caller's batch untouched."""
    model, _ = tiny_policy
    bare = batch.exclude(("log_probs", "full"))
    with_old = bare.clone()
    ScoreLogProbs(ResponseLogProbs(model), out_key=("log_probs", "full"))(with_old)
    got, grads = _loss_and_gradients(model, bare)
    expected, expected_grads = _loss_and_gradients(model, with_old)
    torch.testing.assert_close(got["loss"], expected["loss"], atol=1e-6, rtol=1e-5)
    for got_grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-6, rtol=1e-5)
    assert ("log_probs", "full") not in bare.keys(True)


def _left_padded(batch: TensorDict, extra: int, pad_token_id: int) -> TensorDict:
    padded = batch.clone()
    for key, value in ((("tokens", "prompt"), pad_token_id), (("tokens", "full"), pad_token_id)):
        padded.set(key, torch.nn.functional.pad(batch.get(key), (extra, 0), value=value))
    padded.set(
        ("masks", "all_attention_mask"), torch.nn.functional.pad(batch["masks", "all_attention_mask"], (extra, 0))
    )
    for key in (("log_probs", "full"), REF_LOG_PROBS):
        padded.set(key, torch.nn.functional.pad(batch.get(key), (extra, 0)))
    return padded


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo"])
def test_the_kl_term_of_the_same_responses_ignores_prompt_padding(tiny_policy, batch, loss_type):
    """50 more pad columns before the prompts: the KL term (and the loss) of the same responses stay where they were.
    (TorchRL 0.14.1's GRPOLoss averages the KL over every position of the batch: it would shrink it.)"""
    model, tokenizer = tiny_policy
    settings = dataclasses.replace(SETTINGS, type=loss_type, kl_to_ref_coeff=0.5)
    older = batch.clone()
    older.set(REF_LOG_PROBS, batch.get(REF_LOG_PROBS) * 1.2)
    scale = Scale(accumulation=1, step_tokens=float(older.get(LOSS_MASK).sum()))
    objective = GRPOObjective(ResponseLogProbs(model), settings, max_completion_length=MAX_COMPLETION_LENGTH)
    plain = objective(older, scale=scale)
    padded = objective(_left_padded(older, 50, tokenizer.pad_token_id), scale=scale)
    assert float(plain["kl_to_ref"]) > 1e-3
    torch.testing.assert_close(padded["kl_to_ref"], plain["kl_to_ref"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(padded["loss"], plain["loss"], atol=1e-5, rtol=1e-4)
