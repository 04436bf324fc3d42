"""recipes/grpo/loss.py against trl 1.16's own GRPO loss: for every loss.type and importance-sampling level, with
clip-higher, two-sided clipping, the entropy and off-policy masks, a bias-corrected KL term, truncated responses
masked and gradient accumulation, the recipe's loss and its gradients equal what ``trl.GRPOTrainer._compute_loss``
computes on the same weights and the same batch (prompts and responses of different lengths). The advantages equal
the ones trl's own ``_generate_and_score_completions`` computes from the same rewards."""

from __future__ import annotations

import copy

import pytest
import torch
from _grpo_helpers import loss_settings, trl_cpu_config
from tensordict import TensorDict

from recipes.grpo.batch import (
    ADVANTAGE,
    ATTENTION_MASK,
    LOG_PROBS,
    LOSS_MASK,
    PROMPT_TOKENS,
    REF_LOG_PROBS,
    RESPONSE_TOKENS,
    REWARD,
    TOKENS,
)
from recipes.grpo.log_probs import ResponseLogProbs
from recipes.grpo.loss import LOSS_TYPES, GRPOObjective, Scale, group_advantages
from recipes.grpo.schema import Loss

B, GROUP = 8, 4
MAX_COMPLETION = 7


@pytest.fixture(scope="module")
def trl_trainer(tiny_policy, tmp_path_factory):
    """A trl GRPOTrainer over a copy of the tiny policy: its ``_compute_loss`` is what the recipe must equal."""
    import datasets
    from trl import GRPOTrainer

    model, tokenizer = tiny_policy
    args = trl_cpu_config(
        tmp_path_factory.mktemp("trl"),
        per_device_train_batch_size=B,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        beta=0.1,
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["Review the mug."] * B})
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    trainer.model.train()  # trl's "train" mode (the tiny policy has no dropout: the same forward as eval)
    return trainer


def _batch(seed: int, *, vocab: int) -> dict:
    """Left-padded prompts of 3-6 tokens and right-padded responses of 2-7, old log-probs off the current ones by
    noise, reference log-probs, advantages of both signs, in trl's layout."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(3, 7, (B,), generator=generator)
    response_lengths = torch.randint(2, MAX_COMPLETION + 1, (B,), generator=generator)
    prompt = torch.randint(5, vocab, (B, 6), generator=generator)
    prompt_mask = torch.arange(6) >= 6 - prompt_lengths[:, None]
    completion = torch.randint(5, vocab, (B, MAX_COMPLETION), generator=generator)
    completion_mask = torch.arange(MAX_COMPLETION) < response_lengths[:, None]
    return {
        "prompt_ids": prompt.masked_fill(~prompt_mask, 0),
        "prompt_mask": prompt_mask.long(),
        "completion_ids": completion.masked_fill(~completion_mask, 0),
        "completion_mask": completion_mask.long(),
        "advantages": torch.randn(B, generator=generator),
        "noise": 0.3 * torch.randn(B, MAX_COMPLETION, generator=generator),
        "ref_noise": 0.5 * torch.randn(B, MAX_COMPLETION, generator=generator),
    }


def _current_log_probs(model, raw: dict) -> torch.Tensor:
    tokens = torch.cat([raw["prompt_ids"], raw["completion_ids"]], dim=1)
    mask = torch.cat([raw["prompt_mask"], raw["completion_mask"]], dim=1).bool()
    with torch.no_grad():
        log_probs, _ = ResponseLogProbs(model)(tokens, mask, response_start=raw["prompt_ids"].shape[1])
    return log_probs[:, raw["prompt_ids"].shape[1] :]


def _trl_loss(trainer, raw: dict, old, ref, loss_mask, *, settings: dict) -> tuple[torch.Tensor, list]:
    trainer.loss_type = settings["type"]
    trainer.importance_sampling_level = settings["importance_sampling_level"]
    trainer.epsilon_low, trainer.epsilon_high = settings["clip_epsilon"], settings["clip_epsilon_high"]
    trainer.beta = settings["kl_to_ref_coeff"]
    trainer.args.delta = settings["delta"]
    trainer.args.use_bias_correction_kl = settings["kl_bias_correction"]
    trainer.top_entropy_quantile = settings["top_entropy_quantile"]
    trainer.off_policy_mask_threshold = settings["off_policy_mask_threshold"]
    trainer.entropy_coef, trainer._entropy_bonus_enabled = settings["entropy_coeff"], settings["entropy_coeff"] != 0
    trainer.current_gradient_accumulation_steps = settings["accumulation"]
    trainer.args.steps_per_generation = settings["accumulation"] * settings["optimizer_steps"]
    inputs = {
        "prompt_ids": raw["prompt_ids"],
        "prompt_mask": raw["prompt_mask"],
        "completion_ids": raw["completion_ids"],
        "completion_mask": loss_mask.long(),
        "advantages": raw["advantages"],
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": settings["generation_tokens"],
    }
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


def _recipe_loss(model, raw: dict, old, ref, loss_mask, *, settings: dict) -> tuple[torch.Tensor, list]:
    prompt_width = raw["prompt_ids"].shape[1]
    zeros = torch.zeros(B, prompt_width)
    batch = TensorDict(batch_size=[B])
    batch.set(PROMPT_TOKENS, raw["prompt_ids"])
    batch.set(RESPONSE_TOKENS, raw["completion_ids"])
    batch.set(TOKENS, torch.cat([raw["prompt_ids"], raw["completion_ids"]], dim=1))
    batch.set(ATTENTION_MASK, torch.cat([raw["prompt_mask"], raw["completion_mask"]], dim=1).bool())
    batch.set(LOSS_MASK, loss_mask)
    batch.set(LOG_PROBS, torch.cat([zeros, old], dim=1))
    batch.set(REF_LOG_PROBS, torch.cat([zeros, ref], dim=1))
    batch.set(ADVANTAGE, raw["advantages"].view(B, 1, 1))
    chosen = {key: settings[key] for key in Loss.__dataclass_fields__ if key in settings}
    objective = GRPOObjective(ResponseLogProbs(model), loss_settings(**chosen), max_completion_length=MAX_COMPLETION)
    scale = Scale(settings["accumulation"], float(settings["generation_tokens"]) / settings["optimizer_steps"])
    model.zero_grad()
    out = objective(batch, scale=scale)
    out["loss"].backward()
    return out["loss"].detach(), [p.grad.clone() for p in model.parameters()]


BASE = {
    "importance_sampling_level": "token",
    "clip_epsilon": 0.2,
    "clip_epsilon_high": 0.2,
    "delta": None,
    "kl_to_ref_coeff": 0.1,
    "kl_bias_correction": True,
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "entropy_coeff": 0.0,
    "accumulation": 1,
    "optimizer_steps": 1,
}
CASES = [
    *({"type": loss_type} for loss_type in LOSS_TYPES),
    *({"type": loss_type, "importance_sampling_level": "sequence"} for loss_type in LOSS_TYPES),
    {"type": "dapo", "clip_epsilon_high": 0.28},
    {"type": "grpo", "delta": 1.5, "clip_epsilon_high": 0.28},
    {"type": "cispo", "clip_epsilon_high": 1.1},
    {"type": "bnpo", "top_entropy_quantile": 0.5},
    {"type": "dapo", "top_entropy_quantile": 0.0},  # trl's lower end: the highest-entropy token(s) alone
    {"type": "dapo", "entropy_coeff": 0.05},
    {"type": "grpo", "entropy_coeff": 0.05, "top_entropy_quantile": 0.5, "accumulation": 2},
    {"type": "dapo", "off_policy_mask_threshold": 0.05},
    {"type": "dapo", "kl_bias_correction": False, "kl_to_ref_coeff": 0.5},
    {"type": "grpo", "kl_to_ref_coeff": 0.0},
    {"type": "dapo", "truncated": True},
    {"type": "dapo", "accumulation": 2, "optimizer_steps": 2},
    {"type": "grpo", "accumulation": 2, "optimizer_steps": 1},
    {"type": "dr_grpo", "accumulation": 4, "optimizer_steps": 2},
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(f"{k}={v}" for k, v in case.items()))
def test_the_loss_and_its_gradients_equal_trls(tiny_policy, trl_trainer, case):
    model, _ = tiny_policy
    policy = copy.deepcopy(model).eval()
    trl_trainer.model.load_state_dict(policy.state_dict())
    settings = {**BASE, **case}
    raw = _batch(seed=len(str(case)), vocab=model.config.vocab_size)
    current = _current_log_probs(policy, raw)
    old = current + raw["noise"]  # an older policy: ratios away from 1, some clipped
    ref = current + raw["ref_noise"]
    loss_mask = raw["completion_mask"].bool()
    if settings.pop("truncated", False):  # as loss.mask_truncated_completions masks them (trl does it upstream)
        loss_mask = loss_mask & (torch.arange(B) % 3 != 0)[:, None]
    # The generation batch's tokens: this mini-batch's and, with accumulation or several optimizer steps, those of
    # other mini-batches, longer ones (dapo divides by the accumulated batch's tokens, not this mini-batch's).
    mini_batches = settings["accumulation"] * settings["optimizer_steps"]
    settings["generation_tokens"] = loss_mask.sum() * mini_batches + 5 * (mini_batches - 1)

    expected, expected_grads = _trl_loss(trl_trainer, raw, old, ref, loss_mask, settings=settings)
    got, grads = _recipe_loss(policy, raw, old, ref, loss_mask, settings=settings)

    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-4)
    assert any(g.abs().sum() > 0 for g in grads)
    for name, got_grad, expected_grad in zip(
        [n for n, _ in policy.named_parameters()], grads, expected_grads, strict=True
    ):
        torch.testing.assert_close(got_grad, expected_grad, atol=2e-5, rtol=2e-3, msg=name)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_equal_trls_for_the_same_rewards(tiny_policy, trl_trainer, scale):
    """trl's ``_generate_and_score_completions`` (its completions from a rollout_func, its rewards from a reward
    function returning these rewards) against :func:`group_advantages`."""
    _, tokenizer = tiny_policy
    rewards = torch.tensor([1.0, 0.5, 0.5, 2.0, 3.0, 3.0, 3.0, 3.0])  # the second group ties: advantage 0
    prompts = ["Review the mug."] * (B // GROUP)

    def rollout(prompt_texts, trainer):
        ids = tokenizer(prompt_texts[0])["input_ids"]
        return {
            "prompt_ids": [ids] * len(prompt_texts),
            "completion_ids": [[7, 8, tokenizer.eos_token_id]] * len(prompt_texts),
            "logprobs": [[-1.0, -1.0, -1.0]] * len(prompt_texts),
        }

    trainer = trl_trainer
    trainer.rollout_func, trainer.scale_rewards = rollout, scale
    trainer.reward_funcs[0] = lambda completions, **kwargs: rewards.tolist()
    trainer.model.eval()
    try:
        scored = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(GROUP)])
    finally:
        trainer.model.train()
    torch.testing.assert_close(group_advantages(rewards, GROUP, scale=scale), scored["advantages"].float())


def test_batch_rewards_reach_the_batch():
    """The advantage of a batch is laid out like its rewards, ``[B, 1, 1]``."""
    from recipes.grpo.loss import GroupAdvantage

    batch = TensorDict(batch_size=[4])
    batch.set(REWARD, torch.tensor([1.0, 3.0, 5.0, 5.0]).view(4, 1, 1))
    GroupAdvantage(2, scale="none")(batch)
    assert batch.get(ADVANTAGE).shape == (4, 1, 1)
