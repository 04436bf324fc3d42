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


def loss_settings(**changes):
    """``LossSettings`` of a bnpo loss without a KL term or masks (trl's values for sapo's and vespo's own), with
    ``changes`` on top."""
    from recipes.grpo.loss import LossSettings

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
        "max_completion_length": 48,
        "sapo_temperature_pos": 1.0,
        "sapo_temperature_neg": 1.05,
        "vespo_k_pos": 2.0,
        "vespo_lambda_pos": 3.0,
        "vespo_k_neg": 3.0,
        "vespo_lambda_neg": 2.0,
    }
    return LossSettings(**{**settings, **changes})
