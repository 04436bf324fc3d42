"""interop.TorchRLRolloutFunc on what a user may hand it: TorchRL's ragged wrapper output (pad_output=False), a
tokenizer of another vocabulary than the trainer's, a policy that returns non-finite log-probs (issue 29)."""

from __future__ import annotations

import types

import pytest
import torch
from tensordict.nn import TensorDictModuleBase
from transformers import AutoTokenizer

from interop import TorchRLRolloutFunc
from interop.sampling import CausalLMSampler, SamplingSettings

PROMPTS = ["Review the mug.", "Review the mug.", "Write a short review of the new electric kettle please.", "Hi"]


def _forward_log_probs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Each completion token's log-prob under ``model``, scoring the sequence alone (no padding)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def test_ragged_transformers_wrapper_output_is_padded_on_read(tiny_policy):
    """TransformersWrapper(pad_output=False) hands back lazily stacked rows of different lengths: each completion
    comes back whole, unpadded, with its sampling log-probs (the first one recomputed: TorchRL's wrapper writes 0)."""
    from torchrl.modules.llm import TransformersWrapper

    model, tokenizer = tiny_policy
    wrapper = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 24, "do_sample": True},
    )
    torch.manual_seed(0)
    out = TorchRLRolloutFunc(wrapper, tokenizer)(PROMPTS, trainer=None)

    assert len(out["completion_ids"]) == len(PROMPTS)
    assert len({len(ids) for ids in out["prompt_ids"]}) == 3, "ragged prompts, each unpadded"
    for prompt_ids, completion_ids, log_probs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        assert 1 <= len(completion_ids) <= 24 and len(log_probs) == len(completion_ids)
        assert tokenizer.pad_token_id not in completion_ids
        expected = _forward_log_probs(model, prompt_ids, completion_ids)
        torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-5, rtol=0)


def test_a_tokenizer_of_another_vocabulary_than_the_trainers_is_refused(tiny_policy, tiny_dir):
    model, tokenizer = tiny_policy
    other = AutoTokenizer.from_pretrained(tiny_dir / "arithmetic_policy", padding_side="left")
    assert other.get_vocab() != tokenizer.get_vocab()
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4))
    trainer = types.SimpleNamespace(model=model, processing_class=other, state=types.SimpleNamespace(global_step=0))
    with pytest.raises(ValueError, match=r"its tokenizer \(\d+ tokens\) is not the trainer's processing_class"):
        TorchRLRolloutFunc(policy, tokenizer)(PROMPTS, trainer)


def test_non_finite_log_probs_are_refused_naming_the_rows(tiny_policy):
    model, tokenizer = tiny_policy
    sampler = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4))

    class NaNLogProbs(TensorDictModuleBase):
        """The sampler, with the second row's log-probs NaN (what a float16 overflow gives)."""

        in_keys, out_keys = sampler.in_keys, sampler.out_keys

        def forward(self, tensordict):
            out = sampler(tensordict)
            log_probs = out.get(("log_probs", "full")).clone()
            log_probs[1] = float("nan")
            return out.set(("log_probs", "full"), log_probs)

    with pytest.raises(ValueError, match=r"non-finite log-probs for 1 completion\(s\) \(rows \[1\]\)"):
        TorchRLRolloutFunc(NaNLogProbs(), tokenizer, model=model)(PROMPTS, trainer=None)
