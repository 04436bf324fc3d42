"""interop.TorchRLRolloutFunc on what a user may hand it: TorchRL's ragged wrapper output (pad_output=False), a
tokenizer of another vocabulary than the trainer's, a policy that returns non-finite log-probs (issue 29); prompts past
the model's context, infinite sampling settings, a pad id sampled mid-response, another tokenizer than the policy's."""

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


def _grpo_trainer(model, tokenizer, **args):
    """What TorchRLRolloutFunc reads of a trl GRPOTrainer: its model, GRPOConfig sampling fields, tokenizer, step."""
    fields = dict(
        max_completion_length=8, temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
        generation_kwargs=None,
    )  # fmt: skip
    return types.SimpleNamespace(
        model=model,
        args=types.SimpleNamespace(**{**fields, **args}),
        processing_class=tokenizer,
        state=types.SimpleNamespace(global_step=0),
    )


def test_prompts_and_completions_past_the_models_context_are_refused(tiny_policy):
    """As the recipes refuse them before loading: a prompt that with the completion budget passes the model's
    max_position_embeddings, and a completion budget that alone fills it."""
    model, tokenizer = tiny_policy
    positions = model.config.max_position_embeddings
    long_prompt = " ".join(["kettle"] * positions)
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4))
    with pytest.raises(
        ValueError, match=rf"1 of 2 prompts \(rows \[1\]\) take up to \d+ tokens.*{positions} positions"
    ):
        TorchRLRolloutFunc(policy, tokenizer)(["Hi", long_prompt], trainer=None)
    trainer = _grpo_trainer(model, tokenizer, max_completion_length=positions + 10)
    with pytest.raises(ValueError, match=rf"up to {positions + 10} tokens.*{positions} positions.*Lower max_comp"):
        TorchRLRolloutFunc()(["Hi", "Hi"], trainer)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_an_infinite_sampling_setting_of_the_trainer_is_refused(tiny_policy, field):
    model, tokenizer = tiny_policy
    trainer = _grpo_trainer(model, tokenizer, **{field: float("inf")})
    with pytest.raises(ValueError, match=rf"GRPOConfig: SamplingSettings: {field}=inf must be a finite number"):
        TorchRLRolloutFunc()(["Hi", "Hi"], trainer)


def test_a_pad_id_sampled_inside_a_response_keeps_the_rest_of_it_and_its_eos(tiny_policy):
    """A policy that writes no attention mask: the pad id it sampled mid-response is one of the response's tokens,
    and the response ends at its EOS (not at the pad, which lost the EOS and marked the row truncated)."""
    model, tokenizer = tiny_policy
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampled = [[5, pad, 7, eos], [9, eos, pad, pad]]

    class SamplesThePad(TensorDictModuleBase):
        in_keys, out_keys = [("tokens", "prompt")], [("tokens", "response"), ("log_probs", "response")]

        def forward(self, td):
            td["tokens", "response"] = torch.tensor(sampled)
            td["log_probs", "response"] = -torch.ones(2, 4)
            return td

    out = TorchRLRolloutFunc(SamplesThePad(), tokenizer, model=model).rollout(["Hi", "Hello"])
    assert out["completion_length"].tolist() == [4, 2]
    assert out["completion_ids"][0].tolist() == [5, pad, 7, eos] and out["truncated"].tolist() == [False, False]
    assert out["logprobs"].tolist() == [[-1.0] * 4, [-1.0, -1.0, 0.0, 0.0]]


def test_a_tokenizer_that_is_not_the_policys_is_refused_without_a_trainer(tiny_policy, tiny_dir):
    model, tokenizer = tiny_policy
    other = AutoTokenizer.from_pretrained(tiny_dir / "arithmetic_policy", padding_side="left")
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"the tokenizer \(\d+ tokens\) is not the policy's CausalLMSampler.tokenizer"):
        TorchRLRolloutFunc(policy, other)


def test_the_settings_refusal_names_every_setting_that_differs(tiny_policy):
    model, tokenizer = tiny_policy
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4, top_k=50))
    trainer = _grpo_trainer(model, tokenizer, max_completion_length=8, temperature=0.7)
    with pytest.raises(ValueError) as refused:
        TorchRLRolloutFunc(policy, tokenizer)(["Hi", "Hi"], trainer)
    for shown in (
        "max_new_tokens: policy 4, GRPOConfig 8",
        "temperature: policy 1.0, GRPOConfig 0.7",
        "top_k: policy 50, GRPOConfig None",
        "log_probs_at_temperature: policy False, GRPOConfig True",
    ):
        assert shown in str(refused.value)


@pytest.mark.parametrize(
    ("prompts", "refusal"),
    [
        (
            ["Hi", [{"role": "user", "content": "Hi"}]],
            r"prompt 0 is text and prompt 1 is conversation: .* all strings or",
        ),
        (
            [{"role": "user", "content": "Hi"}],
            r"prompt 0 is \{'role': 'user', 'content': 'Hi'\}; trl passes each prompt",
        ),
        ([[{"content": "Hi"}]], r"prompt 0 is \[\{'content': 'Hi'\}\]; trl passes each prompt as a string or as a con"),
        ([["Hi", "there"]], r"prompt 0 is \['Hi', 'there'\]; trl passes"),
        (["Hi", ""], r"prompt\(s\) \[1\] tokenize to no tokens .* Drop empty prompts"),
    ],
)
def test_prompts_in_a_shape_trl_never_passes_are_refused_naming_the_row(tiny_policy, prompts, refusal):
    model, tokenizer = tiny_policy
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match=refusal):
        TorchRLRolloutFunc(policy, tokenizer)(prompts, trainer=None)
