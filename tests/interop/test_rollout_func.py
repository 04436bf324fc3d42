"""interop.TorchRLRolloutFunc: trl's rollout_func contract (keys, one completion per prompt in order, lengths, the
sampling log-probs equal to a forward pass), with the recipes' sampling policy and TorchRL's TransformersWrapper, plain
and conversational prompts of ragged lengths; the replay buffer it fills; and the policies it refuses."""

from __future__ import annotations

import types

import pytest
import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.data import LazyStackStorage, ReplayBuffer

from interop import TorchRLRolloutFunc
from interop.sampling import CausalLMSampler, SamplingSettings

PLAIN = ["Review the mug.", "Write a short review of the new electric kettle please.", "Hi"]
CONVERSATIONAL = [[{"role": "user", "content": text}] for text in PLAIN]


def _repeated(prompts, group: int = 2) -> list:
    """As trl's sampler hands them over: each prompt ``group`` times, consecutively."""
    return [prompt for prompt in prompts for _ in range(group)]


def _sampling_policy(model, tokenizer, **settings):
    return CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=24, top_k=50, **settings))


def _transformers_wrapper(model, tokenizer, *, return_log_probs=True):
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=return_log_probs,
        pad_output=True,
        generate_kwargs={"max_new_tokens": 24, "do_sample": True},
    )


def _forward_log_probs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Each completion token's log-prob under ``model``, scoring the sequence alone (no padding)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def _expected_prompt_ids(tokenizer, prompts) -> list[list[int]]:
    """trl's own tokenization of prompts for generation (GRPOTrainer._tokenize_prompts, no tools, no images)."""
    if isinstance(prompts[0], list):
        return [
            tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
            for prompt in prompts
        ]
    return tokenizer(text=prompts)["input_ids"]


@pytest.mark.parametrize("policy_kind", ["sampling_policy", "transformers_wrapper"])
@pytest.mark.parametrize("prompt_kind", ["plain", "conversational"])
def test_output_keeps_trls_contract_and_log_probs_match_a_forward_pass(tiny_policy, policy_kind, prompt_kind):
    model, tokenizer = tiny_policy
    make = _sampling_policy if policy_kind == "sampling_policy" else _transformers_wrapper
    rollout_func = TorchRLRolloutFunc(make(model, tokenizer), tokenizer)
    prompts = _repeated(PLAIN if prompt_kind == "plain" else CONVERSATIONAL)
    torch.manual_seed(0)

    out = rollout_func(prompts, trainer=None)

    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == len(prompts)
    assert out["prompt_ids"] == _expected_prompt_ids(tokenizer, prompts), "row i is prompt i, tokenized as trl does"
    assert len({len(ids) for ids in out["prompt_ids"]}) == 3, "ragged prompts, each unpadded"
    for prompt_ids, completion_ids, log_probs in zip(*out.values(), strict=True):
        assert 1 <= len(completion_ids) <= 24 and len(log_probs) == len(completion_ids)
        assert tokenizer.pad_token_id not in completion_ids
        assert tokenizer.eos_token_id not in completion_ids[:-1], "a completion ends at its first EOS"
        expected = _forward_log_probs(model, prompt_ids, completion_ids)
        torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-5, rtol=0)
    assert len({len(ids) for ids in out["completion_ids"]}) > 1, "ragged completions"


def test_transformers_wrapper_first_log_prob_is_recomputed_not_torchrls_zero(tiny_policy):
    """TorchRL 0.14.1's wrapper writes 0 as the first response token's log-prob; trl must get the real one."""
    model, tokenizer = tiny_policy
    wrapper = _transformers_wrapper(model, tokenizer)
    torch.manual_seed(1)
    out = TorchRLRolloutFunc(wrapper, tokenizer)(_repeated(CONVERSATIONAL), trainer=None)
    firsts = torch.tensor([log_probs[0] for log_probs in out["logprobs"]])
    assert (firsts < 0).all()


def test_every_rollout_lands_in_the_replay_buffer_with_its_step(tiny_policy):
    model, tokenizer = tiny_policy
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    rollout_func = TorchRLRolloutFunc(_sampling_policy(model, tokenizer), tokenizer, replay_buffer=buffer)
    trainer = types.SimpleNamespace(model=model, state=types.SimpleNamespace(global_step=3))
    prompts = _repeated(CONVERSATIONAL)

    out = rollout_func(prompts, trainer)
    trainer.state.global_step = 4
    rollout_func(prompts[:2], trainer)

    assert len(buffer) == len(prompts) + 2
    stored = buffer[: len(prompts) + 2]
    assert stored["step"].tolist() == [3] * len(prompts) + [4, 4]
    assert [ids.tolist() for ids in stored.get("prompt_ids", as_list=True)[: len(prompts)]] == out["prompt_ids"]
    for row, (completion_ids, log_probs) in enumerate(zip(out["completion_ids"], out["logprobs"], strict=True)):
        assert stored[row]["completion_ids"].tolist() == completion_ids
        torch.testing.assert_close(stored[row]["logprobs"], torch.tensor(log_probs))


def test_the_trained_weights_are_the_ones_that_sample(tiny_policy):
    """Same module, no copy: after a change to the trainer's model, the log-probs trl gets are the changed model's."""
    model, tokenizer = tiny_policy
    rollout_func = TorchRLRolloutFunc(_sampling_policy(model, tokenizer), tokenizer)
    trainer = types.SimpleNamespace(model=model, state=types.SimpleNamespace(global_step=0))
    norm = model.model.norm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.mul_(1.5)  # an "update": sharper logits everywhere
        out = rollout_func(CONVERSATIONAL, trainer)
        updated = [
            _forward_log_probs(model, p, c) for p, c in zip(out["prompt_ids"], out["completion_ids"], strict=True)
        ]
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    before = [_forward_log_probs(model, p, c) for p, c in zip(out["prompt_ids"], out["completion_ids"], strict=True)]
    for log_probs, after_update, before_update in zip(out["logprobs"], updated, before, strict=True):
        torch.testing.assert_close(torch.tensor(log_probs), after_update, atol=1e-5, rtol=0)
        assert not torch.allclose(torch.tensor(log_probs), before_update, atol=1e-3)


def test_a_policy_around_another_model_is_refused_at_the_first_call(tiny_policy):
    import copy

    model, tokenizer = tiny_policy
    rollout_func = TorchRLRolloutFunc(_sampling_policy(copy.deepcopy(model), tokenizer), tokenizer)
    trainer = types.SimpleNamespace(model=model, state=types.SimpleNamespace(global_step=0))
    with pytest.raises(ValueError, match="not the model the trainer trains"):
        rollout_func(CONVERSATIONAL, trainer)


def test_a_policy_without_log_probs_is_refused_naming_the_key(tiny_policy):
    model, tokenizer = tiny_policy
    with pytest.raises(ValueError, match=r"writes no \('log_probs', 'response'\) or \('log_probs', 'full'\)"):
        TorchRLRolloutFunc(_transformers_wrapper(model, tokenizer, return_log_probs=False), tokenizer)

    class TokensOnly(TensorDictModuleBase):
        in_keys, out_keys = [("tokens", "prompt")], [("tokens", "response")]

        def forward(self, tensordict):
            return tensordict

    with pytest.raises(ValueError, match="return_log_probs=True"):
        TorchRLRolloutFunc(TokensOnly(), tokenizer, model=model)


def test_a_policy_that_reads_text_is_refused(tiny_policy):
    from torchrl.modules.llm import TransformersWrapper

    model, tokenizer = tiny_policy
    text_policy = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="text", generate=True, return_log_probs=True, pad_output=True
    )
    with pytest.raises(ValueError, match="input_mode='tokens'"):
        TorchRLRolloutFunc(text_policy, tokenizer)
