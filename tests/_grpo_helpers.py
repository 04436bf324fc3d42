"""What the GRPO loss tests share: TorchRL's own LLM actor as the reference, and one loss-and-gradients evaluation."""

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


def grpo_loss_and_gradients(loss_class, actor, batch, **options):
    """One GRPO loss (KL and entropy terms on) over ``batch`` and the gradients it gives the actor's model."""
    settings = {"kl_to_ref_coeff": 0.1, "entropy_bonus": True, "entropy_coeff": 0.01, "masking_strategy": "sft"}
    loss = loss_class(actor, **{**settings, **options})
    actor.model.zero_grad()
    out = loss(batch)
    (out.loss_objective + out.loss_entropy + out.loss_kl_to_ref).backward()
    grads = [p.grad.clone() for p in actor.model.parameters()]
    actor.model.zero_grad()
    return out, grads
