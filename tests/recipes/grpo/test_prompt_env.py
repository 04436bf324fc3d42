"""recipes/grpo/prompt_env.py and rewards.py: the dense prompt env, its prompt table and the text it derives for
rewards."""

from __future__ import annotations

import pytest
import torch

from recipes.common.prompts import PromptTable
from recipes.grpo.prompt_env import PromptEnv
from recipes.grpo.rewards import ResponseText


class TestPromptEnv:
    def test_a_reset_is_dense_left_padded_and_grouped(self, tiny_policy):
        _, tokenizer = tiny_policy
        prompts = ["Review the mug.", "What do you think of the bike and of its color?"]
        env = PromptEnv(prompts, tokenizer=tokenizer, group_size=3, num_prompts=2, shuffle=False)
        assert env.batch_size == torch.Size([6])
        reset = env.reset()
        assert reset["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1]
        tokens, mask = reset["tokens", "prompt"], reset["masks", "prompt"]
        assert tokens.shape == mask.shape and mask.dtype == torch.bool
        for row, keep, index in zip(tokens, mask, reset["prompt_index"].tolist(), strict=True):
            expected = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompts[index]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
            assert row[keep].tolist() == list(expected)
            assert keep[-1] and (row[~keep] == tokenizer.pad_token_id).all()  # padding on the left
            assert torch.equal(keep, torch.arange(keep.numel()) >= keep.numel() - keep.sum())
        assert not reset["done"].any()

    def test_a_step_ends_every_dialog_and_keeps_the_prompt(self, tiny_policy):
        _, tokenizer = tiny_policy
        env = PromptEnv(["Review the mug."], tokenizer=tokenizer, group_size=2)
        reset = env.reset()
        reset.set(("tokens", "response"), torch.ones(2, 3, dtype=torch.long))
        step = env.step(reset)
        assert step["next", "done"].all() and step["next", "terminated"].all()
        assert torch.equal(step["next", "tokens", "prompt"], reset["tokens", "prompt"])

    def test_the_stream_resumes_and_is_dealt_out_between_replicas(self, tiny_policy):
        _, tokenizer = tiny_policy
        prompts = [f"Review the item {i}." for i in range(7)]

        def drawn(env, resets):
            return [env.reset()["prompt_index"][::2].tolist() for _ in range(resets)]

        whole = drawn(PromptEnv(prompts, tokenizer=tokenizer, group_size=2, num_prompts=2, seed=4), 6)
        resumed = drawn(PromptEnv(prompts, tokenizer=tokenizer, group_size=2, num_prompts=2, seed=4, start=4), 4)
        assert resumed == whole[2:]
        ranks = [
            drawn(PromptEnv(prompts, tokenizer=tokenizer, group_size=2, seed=4, num_replicas=2, rank=r), 4)
            for r in (0, 1)
        ]
        assert [ranks[r][i][0] for i in range(4) for r in (0, 1)] == [i for pair in whole[:4] for i in pair]

    def test_each_prompt_is_rendered_once_for_the_whole_run(self, tiny_policy, monkeypatch):
        _, tokenizer = tiny_policy
        env = PromptEnv(["Review the mug.", "Review the lamp."], tokenizer=tokenizer, group_size=4, num_prompts=2)
        calls = []
        render = env.prompts.tokenizer.apply_chat_template
        monkeypatch.setattr(
            env.prompts.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or render(*a, **k)
        )
        for _ in range(5):
            env.reset()
        assert len(calls) == 2

    def test_system_prompt_and_conversational_prompts(self, tiny_policy):
        _, tokenizer = tiny_policy
        conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Review the mug."}]
        table = PromptTable(["Review the lamp.", conversation], tokenizer=tokenizer, system_prompt="Be brief.")
        assert table.conversations[0] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Review the lamp."},
        ]
        assert table.conversations[1] == conversation  # its own system message is kept
        text, ids = table.rendered(1)
        assert text.startswith("<|im_start|>system\nBe kind.") and text.endswith("<|im_start|>assistant\n")
        assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]

    @pytest.mark.parametrize(("group_size", "num_prompts"), [(0, 1), (2, 0)])
    def test_bad_sizes_are_refused(self, tiny_policy, group_size, num_prompts):
        _, tokenizer = tiny_policy
        with pytest.raises(ValueError, match="PromptEnv: group_size and num_prompts must be >= 1"):
            PromptEnv(["a"], tokenizer=tokenizer, group_size=group_size, num_prompts=num_prompts)

    def test_no_prompts_is_an_error(self, tiny_policy):
        _, tokenizer = tiny_policy
        with pytest.raises(ValueError, match="no prompts"):
            PromptEnv([], tokenizer=tokenizer, group_size=2)


def test_response_text_writes_what_torchrl_wrappers_write(tiny_policy):
    """``("text", "response")`` keeps the special tokens, ``("text", "full")`` is the rendered prompt + it, and the
    conversation's assistant message is the response without them."""
    from tensordict import TensorDict

    _, tokenizer = tiny_policy
    table = PromptTable(["Review the mug.", "Review the lamp."], tokenizer=tokenizer)
    reply = tokenizer("it is good.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    response = torch.tensor([reply, reply[:2] + [tokenizer.pad_token_id] * (len(reply) - 2)])
    prompt_width = 4
    mask = torch.cat([torch.ones(2, prompt_width, dtype=torch.bool), response != tokenizer.pad_token_id], -1)
    td = TensorDict(
        {"tokens": {"response": response}, "masks": {"all_attention_mask": mask}, "prompt_index": torch.tensor([1, 0])},
        batch_size=[2],
    )
    out = ResponseText(table, tokenizer)(td.clone())
    assert list(out["text", "response"]) == ["it is good.<|im_end|>", tokenizer.decode(reply[:2])]
    assert out["text", "full"][0] == table.rendered(1)[0] + "it is good.<|im_end|>"
    assert out["history", "full"][0] == [
        {"role": "user", "content": "Review the lamp."},
        {"role": "assistant", "content": "it is good."},
    ]
    only_history = ResponseText(table, tokenizer, keys=[("history", "full")])(td.clone())
    assert ("history", "full") in only_history.keys(True) and ("text", "response") not in only_history.keys(True)


def test_response_texts_decode_each_asked_row_once_in_order_around_mask_holes():
    """The rows asked, in their order, each its masked tokens only (a hole inside a response skipped), decoded once
    per run of the policy's own tokens."""
    from tensordict import TensorDict

    from recipes.grpo.batch import response_texts

    class Characters:  # one character per token id; counts its calls
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            Characters.calls += 1
            return "".join(chr(i) for i in ids)

    response = torch.tensor([[97, 98, 99], [100, 101, 0], [102, 103, 104]])
    hole = torch.tensor([[True, False, True], [True, True, False], [True, True, True]])
    batch = TensorDict(
        {
            "tokens": {"prompt": torch.zeros(3, 1, dtype=torch.long), "response": response},
            "masks": {"all_attention_mask": torch.cat([torch.ones(3, 1, dtype=torch.bool), hole], -1)},
        },
        batch_size=[3],
    )
    assert response_texts(batch, Characters()) == ["ac", "de", "fgh"]
    assert response_texts(batch, Characters(), rows=[2, 0]) == ["fgh", "ac"]
    assert Characters.calls == 5
