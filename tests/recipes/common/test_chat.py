"""TorchRL's chat stack (recipes/common/chat.py) and the prompt stream (recipes/common/data.py) on the shipped tiny
policy: prompts, the chat env, sampling, the padded layout."""

from __future__ import annotations

import pytest
import torch
from _chat_rollouts import GENERATION, sample_two_prompts

from recipes.common.chat import make_chat_env, make_policy, make_prompt_dataloader, pad_rollout, response_texts
from recipes.common.config import ConfigError
from recipes.common.data import EndlessShuffleSampler


class TestPromptStream:
    def test_each_pass_is_a_permutation_and_passes_differ(self):
        stream = iter(EndlessShuffleSampler(10, seed=3))
        first, second = [next(stream) for _ in range(10)], [next(stream) for _ in range(10)]
        assert sorted(first) == sorted(second) == list(range(10))
        assert first != second

    def test_start_resumes_the_same_stream(self):
        full = iter(EndlessShuffleSampler(7, seed=5))
        expected = [next(full) for _ in range(30)][13:]
        resumed = iter(EndlessShuffleSampler(7, seed=5, start=13))
        assert [next(resumed) for _ in range(17)] == expected

    @pytest.mark.parametrize("start", [0, 5])
    def test_replicas_deal_out_the_one_stream(self, start):
        """Data-parallel ranks draw disjoint positions of the shared stream and together consume it in order."""
        single = iter(EndlessShuffleSampler(6, seed=2, start=start))
        expected = [next(single) for _ in range(12)]
        ranks = [iter(EndlessShuffleSampler(6, seed=2, start=start, num_replicas=3, rank=r)) for r in range(3)]
        dealt = [[next(stream) for _ in range(4)] for stream in ranks]
        assert [dealt[r][i] for i in range(4) for r in range(3)] == expected
        assert dealt[0] != dealt[1] != dealt[2]

    def test_dataloader_deals_prompts_between_ranks(self):
        prompts = ["a", "b", "c", "d"]
        loaders = [iter(make_prompt_dataloader(prompts, seed=0, shuffle=False, num_replicas=2, rank=r)) for r in (0, 1)]
        assert [next(loaders[0])["query"] for _ in range(3)] == [["a"], ["c"], ["a"]]
        assert [next(loaders[1])["query"] for _ in range(3)] == [["b"], ["d"], ["b"]]

    @pytest.mark.parametrize(("num_replicas", "rank"), [(0, 0), (2, 2), (2, -1)])
    def test_bad_replica_settings_are_refused(self, num_replicas, rank):
        with pytest.raises(ValueError, match="EndlessShuffleSampler: need num_replicas >= 1"):
            EndlessShuffleSampler(4, seed=0, num_replicas=num_replicas, rank=rank)

    def test_dataloader_yields_queries_one_prompt_at_a_time(self):
        loader = make_prompt_dataloader(["a", "b", "c"], seed=0, shuffle=False, start=2)
        batches = iter(loader)
        drawn = [next(batches) for _ in range(4)]
        assert [batch["query"] for batch in drawn] == [["c"], ["a"], ["b"], ["c"]]
        assert [batch["prompt_index"].tolist() for batch in drawn] == [[2], [0], [1], [2]]

    def test_no_prompts_is_an_error(self):
        with pytest.raises(ValueError, match="no prompts"):
            make_prompt_dataloader([], seed=0)


class TestChatEnv:
    def test_reset_groups_copies_of_each_prompt_contiguously(self, tiny_policy):
        _, tokenizer = tiny_policy
        loader = make_prompt_dataloader(["Review the mug.", "Review the lamp."], seed=0, shuffle=False)
        env = make_chat_env(loader, tokenizer=tokenizer, group_size=3, num_prompts=2)
        assert env.batch_size == torch.Size([6])
        reset = env.reset()
        assert reset["query"] == ["Review the mug."] * 3 + ["Review the lamp."] * 3
        assert reset["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1]  # the group id MCAdvantage reads
        # The next reset draws the next prompts of the stream.
        assert env.reset()["query"] == ["Review the mug."] * 3 + ["Review the lamp."] * 3

    def test_conversational_prompts_become_histories(self, tiny_policy):
        _, tokenizer = tiny_policy
        conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Review the mug."}]
        env = make_chat_env(make_prompt_dataloader([conversation], seed=0), tokenizer=tokenizer, group_size=2)
        prompt = env.reset()["history", "prompt"]
        assert prompt.role == [["system", "user"], ["system", "user"]]
        assert prompt.content[0] == ["Be kind.", "Review the mug."]

    def test_tokenizer_with_pad_equal_to_eos_is_refused(self, tiny_policy):
        import copy

        model, tokenizer = tiny_policy
        broken = copy.deepcopy(tokenizer)
        broken.pad_token = broken.eos_token
        with pytest.raises(ValueError, match="pad token distinct from EOS"):
            make_policy(model, broken, generation=GENERATION)


class TestGenerationSettings:
    """The chat policy's generation settings are checked by key, naming where they come from."""

    def test_make_policy_names_where_its_settings_come_from(self, tiny_policy):
        model, tokenizer = tiny_policy
        with pytest.raises(ConfigError, match=r"generation.generate_kwargs: \['max_new_token'\]"):
            make_policy(model, tokenizer, generation={"max_new_token": 8}, generation_key="generation.generate_kwargs")


class TestSampling:
    @pytest.fixture(scope="class")
    def rollout(self, tiny_policy):
        return sample_two_prompts(
            tiny_policy, group_size=2, seed=0, generation={**GENERATION, "return_log_probs": True}
        )

    def test_generation_settings_come_from_the_config_node(self, tiny_policy, rollout):
        _, tokenizer = tiny_policy
        lengths = [t.numel() for t in rollout.get(("tokens", "response"), as_list=True)]
        assert max(lengths) <= GENERATION.max_new_tokens and min(lengths) >= 1
        texts = response_texts(rollout, tokenizer)
        assert len(texts) == 4 and all(isinstance(t, str) and "<|im_end|>" not in t for t in texts)

    def test_settings_torchrl_does_not_know_still_reach_generate(self, tiny_policy):
        """TorchRL 0.14.1's wrapper drops min_new_tokens (and other GenerationConfig fields); make_policy does not."""
        natural = sample_two_prompts(tiny_policy, group_size=4, seed=0, generation={**GENERATION, "max_new_tokens": 40})
        assert min(t.numel() for t in natural.get(("tokens", "response"), as_list=True)) < 40  # EOS comes earlier
        generation = {**GENERATION, "max_new_tokens": 40, "min_new_tokens": 40}
        forced = sample_two_prompts(tiny_policy, group_size=4, seed=0, generation=generation)
        assert [t.numel() for t in forced.get(("tokens", "response"), as_list=True)] == [40] * 8

    def test_a_misspelt_generation_setting_is_refused(self, tiny_policy):
        model, tokenizer = tiny_policy
        with pytest.raises(ValueError, match=r"\['max_new_token'\] are not generation settings"):
            make_policy(model, tokenizer, generation={"max_new_token": 8, "do_sample": True})


class TestPaddedBatches:
    """``pad_rollout``: the chat rollout in the dense layout the GRPO recipe trains on, with the same numbers as the
    ragged per-sample layout the policy samples in."""

    @pytest.fixture(scope="class")
    def rollout(self, tiny_policy):
        return sample_two_prompts(tiny_policy, group_size=3, seed=3, generation=GENERATION)

    def test_every_response_starts_after_the_longest_prompt(self, tiny_policy, rollout):
        _, tokenizer = tiny_policy
        padded = pad_rollout(rollout, pad_token_id=tokenizer.pad_token_id)
        prompts = rollout.get(("tokens", "prompt"), as_list=True)
        responses = rollout.get(("tokens", "response"), as_list=True)
        assert len({p.numel() for p in prompts}) > 1 and len({r.numel() for r in responses}) > 1  # really ragged
        width = max(p.numel() for p in prompts)
        full, mask = padded["tokens", "full"], padded["masks", "all_attention_mask"]
        assert full.shape == (6, width + max(r.numel() for r in responses)) and mask.dtype == torch.bool
        for row, row_mask, prompt, response in zip(full, mask, prompts, responses, strict=True):
            assert torch.equal(row[row_mask], torch.cat([prompt, response]))
            assert torch.equal(row[width : width + response.numel()], response)
            assert row_mask[width:].sum() == response.numel() and row_mask[:width].sum() == prompt.numel()
            assert (row[~row_mask] == tokenizer.pad_token_id).all()
