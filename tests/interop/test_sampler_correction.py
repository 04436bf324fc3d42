"""trl's sampler/trainer mismatch correction (GRPOConfig.vllm_importance_sampling_*) on TorchRL-sampled completions,
with trl's own code as the reference: for the same completions, sampler log-probs and rewards,
interop.TorchRLGRPOTrainer gives the correction ratio, loss and gradients of trl's GRPOTrainer in its vLLM configuration
(the rollout's log-probs standing for vLLM's), in each of trl's four modes; the mismatch metrics hold their values on a
constructed batch; settings trl would fail on late, and a rollout function with no sampler log-probs, are refused
naming the key."""

from __future__ import annotations

import copy
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from tensordict.nn import TensorDictModuleBase

from interop import TorchRLRolloutFunc
from interop.errors import SettingError
from interop.trl.trainer import (
    TorchRLGRPOTrainer,
    check_importance_sampling_settings,
    sampler_mismatch_counts,
    sampler_mismatch_metrics,
)

PROMPTS = [[{"role": "user", "content": "Review the mug."}], [{"role": "user", "content": "Review the lamp."}]]
GROUP = 4
# log(pi_trainer / pi_sampler) per token, cycled along each completion: ratios 0.30, 0.74, 1, 1.22 and 2.46 against
# the clip range [0.5, 2.0] below, so that every mode clips or masks some tokens or completions and keeps others.
LOG_RATIOS = (-1.2, -0.3, 0.0, 0.2, 0.9)
CLIP_MIN, CLIP_MAX = 0.5, 2.0


class FixedCompletions(TensorDictModuleBase):
    """A "sampler" that answers every batch with the same completions and the log-probs it is given: the batch the
    two trainers score is then the same, and the sampler's log-probs are what the test sets."""

    in_keys = [("tokens", "prompt")]
    out_keys = [("tokens", "response"), ("log_probs", "response")]

    def __init__(self, model, tokens: torch.Tensor) -> None:
        super().__init__()
        self.model, self.tokens = model, tokens
        self.log_probs = torch.zeros(tokens.shape)

    def forward(self, td):
        td["tokens", "response"] = self.tokens.clone()
        td["log_probs", "response"] = self.log_probs.clone()
        return td


def _completion_tokens(tokenizer) -> torch.Tensor:
    """Eight completions of 5 to 12 tokens (pad after them), the odd ones ending at EOS: rewards by length differ."""
    generator = torch.Generator().manual_seed(0)
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    vocabulary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    tokens = torch.full((2 * GROUP, 12), tokenizer.pad_token_id)
    for row, length in enumerate((5, 12, 7, 9, 12, 6, 8, 10)):
        tokens[row, :length] = vocabulary[torch.randint(len(vocabulary), (length,), generator=generator)]
        if row % 2:
            tokens[row, length - 1] = tokenizer.eos_token_id
    return tokens


def _length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def _args(tmp_path, **overrides):
    from trl import GRPOConfig

    settings = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "report_to": "none",
        "bf16": False,
        "per_device_train_batch_size": 2 * GROUP,
        "num_generations": GROUP,
        "max_completion_length": 12,
        "beta": 0.0,
        "disable_tqdm": True,
        "activation_checkpointing": False,
        "vllm_importance_sampling_clip_min": CLIP_MIN,
        "vllm_importance_sampling_clip_max": CLIP_MAX,
        **overrides,
    }
    return GRPOConfig(**settings)


def _trainer(trainer_class, tiny_policy, tmp_path, **overrides):
    import datasets

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    policy = FixedCompletions(model, _completion_tokens(tokenizer))
    trainer = trainer_class(
        model=model,
        reward_funcs=_length_reward,
        args=_args(tmp_path, **overrides),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * GROUP}),
        processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(policy, tokenizer),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets before a step
    return trainer


def _trl_with_vllm_correction(tiny_policy, tmp_path, **overrides):
    """trl's own GRPOTrainer in its vLLM configuration: ``use_vllm`` read true (its importance-sampling block and loss
    weighting run) with the vLLM weight sync marked done, so that the rollout function's log-probs stand for vLLM's.
    (A GRPOTrainer built with use_vllm=True would start vLLM, which these machines do not have.)"""
    from trl import GRPOTrainer

    trainer = _trainer(GRPOTrainer, tiny_policy, tmp_path / "trl", **overrides)
    trainer.use_vllm, trainer._last_loaded_step = True, trainer.state.global_step
    return trainer


def _inputs():
    return [{"prompt": prompt} for prompt in PROMPTS for _ in range(GROUP)]


def _sampler_log_probs(trainer) -> torch.Tensor:
    """Sampler log-probs ``LOG_RATIOS`` away from the trainer's own scoring of the completions (even rows 10x closer,
    so that some completions' summed log-ratio stays inside the clip range)."""
    trainer.rollout_func.policy.log_probs.zero_()
    scored = trainer._generate_and_score_completions(_inputs())
    trainer_log_probs = scored["old_per_token_logps"].detach()
    rows, width = trainer_log_probs.shape
    pattern = torch.tensor(LOG_RATIOS)[(torch.arange(rows)[:, None] + torch.arange(width)) % len(LOG_RATIOS)]
    pattern = pattern * torch.where(torch.arange(rows) % 2 == 0, 0.1, 1.0)[:, None]
    sampler = (trainer_log_probs - pattern) * scored["completion_mask"]
    return torch.nn.functional.pad(sampler, (0, trainer.rollout_func.policy.tokens.shape[1] - width))


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_the_correction_gives_trls_ratio_loss_and_gradients_for_the_sampler_log_probs(tiny_policy, tmp_path, mode):
    ours = _trainer(TorchRLGRPOTrainer, tiny_policy, tmp_path / "ours", vllm_importance_sampling_mode=mode)
    theirs = _trl_with_vllm_correction(tiny_policy, tmp_path, vllm_importance_sampling_mode=mode)
    sampler = _sampler_log_probs(ours)
    ours.rollout_func.policy.log_probs.copy_(sampler)
    theirs.rollout_func.policy.log_probs.copy_(sampler)
    ours._metrics["train"].clear()

    batch = ours._generate_and_score_completions(_inputs())
    reference = theirs._generate_and_score_completions(_inputs())

    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(batch["sampling_per_token_logps"], reference["sampling_per_token_logps"])
    torch.testing.assert_close(batch["old_per_token_logps"][mask], reference["old_per_token_logps"][mask])
    torch.testing.assert_close(batch["advantages"], reference["advantages"])
    ratio = batch["importance_sampling_ratio"]
    torch.testing.assert_close(ratio, reference["importance_sampling_ratio"])
    assert ratio.shape[1] == (1 if mode.startswith("sequence") else mask.shape[1])
    kept = ratio.expand_as(mask)[mask]
    if mode.endswith("_mask"):
        assert (kept == 0).any() and (kept > 0).any(), "some ratios masked, some kept"
    else:
        assert torch.isclose(kept, torch.tensor(CLIP_MIN)).any() or torch.isclose(kept, torch.tensor(CLIP_MAX)).any()
        assert ((kept > CLIP_MIN) & (kept < CLIP_MAX)).any(), "some ratios clipped, some kept"

    loss, grads = _loss_and_grads(ours, batch)
    trl_loss, trl_grads = _loss_and_grads(theirs, reference)
    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=1e-5)
    for mine, trls in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(mine, trls, atol=1e-6, rtol=1e-5)
    theirs.use_vllm = False  # trl's loss without the correction: the ratio must have changed the loss
    uncorrected, _ = _loss_and_grads(theirs, reference)
    assert not torch.allclose(uncorrected, trl_loss, atol=1e-4), "the correction changes nothing on this batch"

    # trl's own mismatch metrics, and ours beside them, for the TorchRL-sampled batch.
    for name in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"):
        assert ours._metrics["train"][name] == pytest.approx(theirs._metrics["train"][name])
    expected = sampler_mismatch_metrics(
        sampler_mismatch_counts(
            reference["old_per_token_logps"],
            reference["sampling_per_token_logps"],
            reference["completion_mask"],
            mode=mode,
            clip_min=CLIP_MIN,
            clip_max=CLIP_MAX,
        )
    )
    for name, value in expected.items():
        assert ours._metrics["train"][name] == [pytest.approx(value)]
    fraction = ours._metrics["train"]["sampling/importance_sampling_clipped_or_masked/token_fraction"][0]
    assert 0.0 < fraction < 1.0


def test_mismatch_metrics_on_a_constructed_batch():
    """Two completions, the second one token shorter; log(pi_trainer / pi_sampler) = [ln 4, 0, -ln 4] and
    [ln 1.5, ln 1.5, pad]; a sampler log-prob unknown (NaN) in neither."""
    trainer = torch.zeros(2, 3)
    sampler = -torch.tensor([[math.log(4.0), 0.0, -math.log(4.0)], [math.log(1.5), math.log(1.5), 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    def figures(mode, clip_min=0.5, clip_max=3.0):
        counts = sampler_mismatch_counts(trainer, sampler, mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
        return sampler_mismatch_metrics(counts)

    def k3(r):
        return r - 1 - math.log(r)

    token = figures("token_mask")
    assert token["sampling/sampler_kl_k3"] == pytest.approx((k3(4.0) + k3(0.25) + 2 * k3(1.5)) / 5)
    # ratios 4 and 0.25 fall outside [0.5, 3], 1 and 1.5 inside: 2 tokens of 5, 1 completion of 2.
    assert token["sampling/importance_sampling_clipped_or_masked/token_fraction"] == pytest.approx(2 / 5)
    assert token["sampling/importance_sampling_clipped_or_masked/sequence_fraction"] == pytest.approx(1 / 2)
    assert figures("token_truncate") == token, "truncating and masking touch the same tokens"
    # Per completion: ratios 4 x 1 x 0.25 = 1 (kept) and 1.5 x 1.5 = 2.25 (above 2.0: all its 2 tokens).
    sequence = figures("sequence_mask", clip_max=2.0)
    assert sequence["sampling/importance_sampling_clipped_or_masked/token_fraction"] == pytest.approx(2 / 5)
    assert sequence["sampling/importance_sampling_clipped_or_masked/sequence_fraction"] == pytest.approx(1 / 2)
    assert figures("sequence_truncate", clip_max=None)[
        "sampling/importance_sampling_clipped_or_masked/sequence_fraction"
    ] == pytest.approx(0.0)
    # An unknown sampler log-prob (vLLM's None) is left out of the KL, and counts as ratio 1 as in trl.
    sampler[0, 0] = float("nan")
    token = figures("token_mask")
    assert token["sampling/sampler_kl_k3"] == pytest.approx((k3(0.25) + 2 * k3(1.5)) / 4)
    assert token["sampling/importance_sampling_clipped_or_masked/token_fraction"] == pytest.approx(1 / 5)


_GOOD = {
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0,
    "loss_type": "dapo",
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"vllm_importance_sampling_mode": "token_clip"},
            r"^GRPOConfig: vllm_importance_sampling_mode='token_clip' is not one",
        ),
        (
            {"vllm_importance_sampling_mode": "token_clip", "vllm_importance_sampling_correction": False},
            r"^GRPOConfig: vllm_importance_sampling_mode='token_clip'",
        ),
        (
            {"vllm_importance_sampling_clip_min": 4.0},
            r"^GRPOConfig: vllm_importance_sampling_clip_min=4.0 is not below .*=3.0",
        ),
        (
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
            r"^GRPOConfig: vllm_importance_sampling_clip_max=None with vllm_importance_sampling_clip_min=None",
        ),
        ({"loss_type": "vespo"}, r"^GRPOConfig: vllm_importance_sampling_mode='sequence_mask' with loss_type='vespo'"),
    ],
)
def test_settings_trl_would_fail_on_late_are_refused_naming_the_field(changes, message):
    with pytest.raises(SettingError, match=message) as refused:
        check_importance_sampling_settings(SimpleNamespace(**{**_GOOD, **changes}))
    assert refused.value.detail.startswith(refused.value.field)  # a caller puts its key for the field in front
    check_importance_sampling_settings(SimpleNamespace(**_GOOD))
    check_importance_sampling_settings(SimpleNamespace(**{**_GOOD, "vllm_importance_sampling_correction": False}))


def test_the_trainer_refuses_a_mode_trl_does_not_have_when_built(tiny_policy, tmp_path):
    """trl's GRPOConfig takes any mode and its trainer fails only at the first scored batch."""
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence'"):
        _trainer(TorchRLGRPOTrainer, tiny_policy, tmp_path, vllm_importance_sampling_mode="sequence")


def test_the_correction_with_a_rollout_function_that_returns_no_sampler_log_probs_is_refused(tiny_policy, tmp_path):
    class NoLogProbs(TorchRLRolloutFunc):
        def __call__(self, prompts, trainer):
            return {**super().__call__(prompts, trainer), "logprobs": None}

    trainer = _trainer(TorchRLGRPOTrainer, tiny_policy, tmp_path)
    policy, tokenizer = trainer.rollout_func.policy, trainer.rollout_func.tokenizer
    trainer.rollout_func = NoLogProbs(policy, tokenizer)
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction=True .* no sampler log-prob row for 8"):
        trainer._generate_and_score_completions(_inputs())
    trainer.args.vllm_importance_sampling_correction = trainer.corrects_sampler = False
    trainer.vllm_importance_sampling_correction = False
    assert trainer._generate_and_score_completions(_inputs())["completion_ids"].shape[0] == 2 * GROUP


def test_under_trls_own_trainer_the_rollout_function_says_once_that_the_correction_is_not_applied(tiny_policy):
    model, tokenizer = tiny_policy
    rollout_func = TorchRLRolloutFunc(FixedCompletions(model, _completion_tokens(tokenizer)), tokenizer)
    prompts = [prompt for prompt in PROMPTS for _ in range(GROUP)]
    trainer = SimpleNamespace(model=model, args=SimpleNamespace(vllm_importance_sampling_correction=True))
    with pytest.warns(UserWarning, match="vllm_importance_sampling_correction=True to vLLM's completions only"):
        rollout_func(prompts, trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rollout_func(prompts, trainer)  # said once
        ours = SimpleNamespace(model=model, args=trainer.args, corrects_sampler=True)
        TorchRLRolloutFunc(FixedCompletions(model, _completion_tokens(tokenizer)), tokenizer)(prompts, ours)
