"""What the GRPO loss tests share: TorchRL's own LLM actor, the reference the response-only scorer must agree with."""

from __future__ import annotations


def torchrl_actor(model, tokenizer, *, padded: bool):
    """TorchRL's ``TransformersWrapper`` as ``GRPOLoss``'s actor (non-generating, tokens in): the reference the
    recipe's response-only scorer must agree with. ``padded``: ``[B, T]`` tensors, else one tensor per sample."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        input_key=("tokens", "full"),
        generate=False,
        return_log_probs=True,
        pad_output=padded,
    )


# dr_grpo's normaliser in the tests that do not set one (the recipe's rollout.generation.max_new_tokens).
MAX_COMPLETION_LENGTH = 48


def loss_settings(**changes):
    """The ``loss:`` node (``recipes.grpo.schema.Loss``) of a bnpo loss without a KL term, masks or sampler correction
    (trl's values for sapo's and vespo's own), with ``changes`` on top."""
    from recipes.grpo.schema import Loss, SamplerCorrection, Sapo, Vespo

    settings = {
        "type": "bnpo",
        "importance_sampling_level": "token",
        "clip_epsilon": 0.2,
        "clip_epsilon_high": 0.2,
        "delta": None,
        "kl_to_ref_coeff": 0.0,
        "kl_bias_correction": True,
        "entropy_coeff": 0.0,
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "mask_truncated_completions": False,
        "sync_ref_model": False,
        "ref_model_mixup_alpha": 0.6,
        "ref_model_sync_steps": 512,
        "sapo": Sapo(temperature_pos=1.0, temperature_neg=1.05),
        "vespo": Vespo(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0),
        "sampler_correction": SamplerCorrection(enabled=False, mode="sequence_mask", clip_min=None, clip_max=3.0),
    }
    return Loss(**{**settings, **changes})


def trl_cpu_config(output_dir, **settings):
    """A ``trl.GRPOConfig`` for a trainer whose loss a test calls on CPU (no reporting, no bf16, no progress bar),
    with ``settings`` on top."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, report_to="none", bf16=False, disable_tqdm=True, **settings
    )
