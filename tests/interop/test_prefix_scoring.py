"""Prefix sharing in the reward model's pass (``HFRewardModelWrapper(share_prefixes=True)``, the GRPO recipe's
``reward.share_prompt``): each prompt a group of rows shares runs once, and every reward equals the padded pass's.

Runs offline on the shipped tiny reward model (``tiny/reward_model``, a Qwen2 sequence classifier with its chat
template).
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from interop import HFRewardModelWrapper
from interop.prefix_scoring import can_share_prefixes, plan_shared_prefixes

_WORDS = "the phone is great and it looks nice camera feels bad very really price".split()
_PROMPTS = ("Write a review of the phone.", "Review the lamp.", "What do you think of the bag?", "Review the desk.")


@pytest.fixture(scope="module")
def reward_model(tiny_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_dir / "reward_model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "reward_model", padding_side="right")
    return model, tokenizer


def _grpo_conversations(group_size: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """A GRPO batch's conversations: every prompt ``group_size`` times in a row, responses of ragged lengths."""
    rng = random.Random(seed)
    return [
        [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 14)))},
        ]
        for prompt in _PROMPTS
        for _ in range(group_size)
    ]


class _PositionCounter:
    """Counts the token positions each forward pass of ``model`` computes (padding included)."""

    def __init__(self, model):
        self.positions, self.passes = 0, 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        self.positions += kwargs["input_ids"].numel()
        self.passes += 1

    def remove(self):
        self._handle.remove()


def _rewards(model, wrapper, td) -> tuple[torch.Tensor, _PositionCounter]:
    counter = _PositionCounter(model)
    try:
        return wrapper(td.clone())["reward"], counter
    finally:
        counter.remove()


def _wrappers(model, **kwargs):
    padded = HFRewardModelWrapper(model, inference_mode=True, **kwargs)
    shared = HFRewardModelWrapper(model, inference_mode=True, share_prefixes=True, **kwargs)
    assert shared.share_prefixes
    return padded, shared


@pytest.mark.parametrize("micro_batch_size", [None, 5])
def test_shared_prompts_give_the_padded_rewards_with_fewer_positions(reward_model, micro_batch_size):
    """History input (the recipe's default): the rewards equal the padded pass's to float rounding, in chunks that
    cut groups apart too, and fewer positions are computed."""
    model, tokenizer = reward_model
    conversations = _grpo_conversations(group_size=8)
    td = TensorDict({"history": NonTensorStack(*conversations)}, batch_size=[len(conversations)])
    padded, shared = _wrappers(model, tokenizer=tokenizer, history_key="history", micro_batch_size=micro_batch_size)
    expected, padded_count = _rewards(model, padded, td)
    got, shared_count = _rewards(model, shared, td)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.shape == (32,)
    assert shared_count.passes == 2 * padded_count.passes  # the prefixes' pass and the rest's, per chunk
    assert shared_count.positions < 0.8 * padded_count.positions


def test_text_and_ragged_token_inputs_share_too(reward_model):
    model, tokenizer = reward_model
    conversations = _grpo_conversations(group_size=4, seed=1)
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    td = TensorDict({"text": NonTensorStack(*texts)}, batch_size=[len(texts)])
    padded, shared = _wrappers(model, tokenizer=tokenizer, text_key="text")
    expected, padded_count = _rewards(model, padded, td)
    got, shared_count = _rewards(model, shared, td)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert shared_count.positions < padded_count.positions

    # Dense [B, T] token ids padded on the right with an attention mask: scored as the ragged rows they hold.
    rows = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True)["input_ids"]
    longest = max(len(row) for row in rows)
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (longest - len(row)) for row in rows])
    mask = (torch.arange(longest) < torch.tensor([len(row) for row in rows])[:, None]).long()
    td = TensorDict({"tokens": {"full": ids}, "masks": {"all_attention_mask": mask}}, batch_size=[len(rows)])
    padded, shared = _wrappers(model)
    expected, _ = _rewards(model, padded, td)
    got, shared_count = _rewards(model, shared, td)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert shared_count.passes == 2


def test_a_batch_without_repeated_prompts_takes_the_padded_pass(reward_model):
    model, tokenizer = reward_model
    conversations = _grpo_conversations(group_size=1)
    td = TensorDict({"history": NonTensorStack(*conversations)}, batch_size=[len(conversations)])
    padded, shared = _wrappers(model, tokenizer=tokenizer, history_key="history")
    expected, _ = _rewards(model, padded, td)
    got, counter = _rewards(model, shared, td)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert counter.passes == 1


def test_the_token_a_classifier_pools_stays_after_the_shared_prefix():
    """A row ending in pad-id tokens (a classifier pools its last token that is not the pad id): the group's prefix
    stops before that token, wherever the rows' common prefix ends."""
    pad = 0
    seqs = [[5, 6, 7, 8, 9, 3], [5, 6, 7, 8, 9, 4, 4], [5, 6, 7, 8, 9, 0, 0]]
    plan = plan_shared_prefixes(seqs, pad_token_id=pad, min_saving=0.0)
    assert plan is not None and plan.groups == [(0, 3)]
    assert plan.prefix_lengths == [4]  # the rows share 5 tokens, but row 3 pools its token 4 (9): it stays after
    assert plan_shared_prefixes([[1, 2], [3, 4]], pad_token_id=pad) is None  # nothing shared


def test_models_that_cannot_share_take_the_padded_pass(reward_model, tiny_dir):
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = reward_model
    assert can_share_prefixes(model)
    windowed = AutoModelForSequenceClassification.from_pretrained(
        tiny_dir / "reward_model", use_sliding_window=True, sliding_window=8
    )
    assert not can_share_prefixes(windowed)  # a sliding window's cache is not the whole prefix

    class SumRewardModel(torch.nn.Module):  # not a transformers model: no cache to share
        def forward(self, input_ids, attention_mask=None):
            return (input_ids * attention_mask).sum(-1, keepdim=True).float()

    assert not HFRewardModelWrapper(SumRewardModel(), share_prefixes=True).share_prefixes
    # Positions follow the mask in the shared passes; a left-padded pass puts its pads at the first positions.
    left = HFRewardModelWrapper(model, tokenizer=tokenizer, history_key="h", padding_side="left", share_prefixes=True)
    assert not left.share_prefixes


def test_the_forward_signature_is_read_once_per_model_class_not_per_batch(reward_model, monkeypatch):
    """Which argument takes the cache is a property of the model's class: reading ``forward``'s signature on every
    scored batch cost tens of microseconds per call for nothing."""
    import inspect

    import interop.prefix_scoring as prefix_scoring

    model, tokenizer = reward_model
    calls = []
    real_signature = inspect.signature
    monkeypatch.setattr(prefix_scoring.inspect, "signature", lambda f: calls.append(f) or real_signature(f))
    prefix_scoring._cache_argument.cache_clear()
    conversations = _grpo_conversations(group_size=4)
    td = TensorDict({"history": NonTensorStack(*conversations)}, batch_size=[len(conversations)])
    padded, shared = _wrappers(model, tokenizer=tokenizer, history_key="history")
    first = shared(td.clone())["reward"]
    torch.testing.assert_close(shared(td.clone())["reward"], first)
    torch.testing.assert_close(first, padded(td.clone())["reward"], rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
