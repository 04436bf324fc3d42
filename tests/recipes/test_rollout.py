"""TorchRL rollout building blocks (recipes/common/rollout.py) on the shipped tiny policy: prompts, the chat env,
sampling, the padded layout, reward terms."""

from __future__ import annotations

import pytest
import torch
from _grpo_helpers import grpo_loss_and_gradients, torchrl_actor
from omegaconf import OmegaConf
from tensordict import TensorDict, lazy_stack

from recipes.common.config import ConfigError
from recipes.common.log_probs import ResponseLogProbs, ScoreLogProbs
from recipes.common.losses import ResponseGRPOLoss
from recipes.common.rollout import (
    EndlessShuffleSampler,
    LengthPenalty,
    TextScoreReward,
    check_generation_settings,
    make_chat_env,
    make_policy,
    make_prompt_dataloader,
    pad_rollout,
    response_texts,
)
from recipes.common.synthetic import oracle_score

GENERATION = OmegaConf.create({"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "do_sample": True})


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
    """One check of rollout.generation's keys, for the recipe's validation and make_policy alike."""

    @pytest.mark.parametrize(
        ("env", "generation"),
        [
            ("prompt", {"max_new_tokens": 8, "min_new_tokens": 2, "top_k": 50, "min_p": 0.05}),
            ("chat", {"max_new_tokens": 8, "typical_p": 0.9, "return_log_probs": True}),
        ],
    )
    def test_settings_the_sampler_takes_pass(self, env, generation):
        check_generation_settings(OmegaConf.create(generation), env=env)

    @pytest.mark.parametrize(
        ("env", "generation", "message"),
        [
            ("prompt", {"max_new_token": 8}, "rollout.generation.max_new_token: not a generation setting of"),
            ("prompt", {"max_new_tokens": 8, "typical_p": 0.9}, "or use rollout.env=chat"),
            ("chat", {"max_new_tokens": 8, "max_new_token": 8}, "rollout.generation: ['max_new_token'] are not"),
        ],
    )
    def test_an_unknown_key_is_refused_by_name(self, env, generation, message):
        with pytest.raises(ConfigError) as error:
            check_generation_settings(generation, env=env)
        assert message in str(error.value)

    def test_make_policy_names_where_its_settings_come_from(self, tiny_policy):
        model, tokenizer = tiny_policy
        with pytest.raises(ConfigError, match=r"generation.generate_kwargs: \['max_new_token'\]"):
            make_policy(model, tokenizer, generation={"max_new_token": 8}, generation_key="generation.generate_kwargs")


def _sample_two_prompts(tiny_policy, *, group_size: int, seed: int, generation):
    """One ragged rollout of the tiny policy: two prompts, ``group_size`` responses each."""
    model, tokenizer = tiny_policy
    torch.manual_seed(seed)
    loader = make_prompt_dataloader(["Review the mug.", "What do you think of the bike?"], seed=0)
    env = make_chat_env(loader, tokenizer=tokenizer, group_size=group_size, num_prompts=2)
    return make_policy(model, tokenizer, generation=generation)(env.reset())


class TestSampling:
    @pytest.fixture(scope="class")
    def rollout(self, tiny_policy):
        return _sample_two_prompts(
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
        natural = _sample_two_prompts(
            tiny_policy, group_size=4, seed=0, generation={**GENERATION, "max_new_tokens": 40}
        )
        assert min(t.numel() for t in natural.get(("tokens", "response"), as_list=True)) < 40  # EOS comes earlier
        generation = {**GENERATION, "max_new_tokens": 40, "min_new_tokens": 40}
        forced = _sample_two_prompts(tiny_policy, group_size=4, seed=0, generation=generation)
        assert [t.numel() for t in forced.get(("tokens", "response"), as_list=True)] == [40] * 8

    def test_a_misspelt_generation_setting_is_refused(self, tiny_policy):
        model, tokenizer = tiny_policy
        with pytest.raises(ValueError, match=r"\['max_new_token'\] are not generation settings"):
            make_policy(model, tokenizer, generation={"max_new_token": 8, "do_sample": True})

    def test_torchrl_zeroes_the_first_response_log_prob_which_the_padded_scorer_does_not(self, tiny_policy, rollout):
        """Why ``rollout.env=chat`` scores the old log-probs again: TorchRL 0.14.1's generate mode sets the first
        response log-prob to 0; ``ResponseLogProbs`` over the padded rollout gives every response token's."""
        model, tokenizer = tiny_policy
        padded = pad_rollout(rollout, pad_token_id=tokenizer.pad_token_id)
        start = padded["tokens", "prompt"].shape[-1]
        with torch.no_grad():
            scored, _ = ResponseLogProbs(model)(
                padded["tokens", "full"], padded["masks", "all_attention_mask"], response_start=start
            )
        generated = rollout.get(("log_probs", "response"), as_list=True)
        for row, mask, gen_log_probs in zip(scored, padded["masks", "all_attention_mask"], generated, strict=True):
            response = row[start:][mask[start:]]
            assert gen_log_probs[0] == 0 and response[0] < 0
            torch.testing.assert_close(gen_log_probs[1:], response[1:], atol=1e-4, rtol=1e-4)


class TestPaddedBatches:
    """``pad_rollout``: the chat rollout in the dense layout the GRPO recipe trains on, with the same numbers as the
    ragged per-sample layout the policy samples in."""

    @pytest.fixture(scope="class")
    def rollout(self, tiny_policy):
        return _sample_two_prompts(tiny_policy, group_size=3, seed=3, generation=GENERATION)

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

    def test_grpo_loss_and_gradients_match_the_ragged_layout(self, tiny_policy, rollout):
        """The recipe's padded batch and response-only loss (``ResponseGRPOLoss``) train as TorchRL's ``GRPOLoss``
        with its ragged actor trains on the rollout as sampled: a faster layout, not another objective."""
        from torchrl.objectives.llm import GRPOLoss

        model, tokenizer = tiny_policy
        advantage = torch.linspace(-1.0, 1.0, 6).reshape(6, 1, 1)  # as MCAdvantage writes it
        ragged = rollout.copy()
        ragged_actor = torchrl_actor(model, tokenizer, padded=False)
        with torch.no_grad():
            scored = ragged_actor(ragged.select(("tokens", "full"), ("masks", "all_attention_mask")))
        for sample, log_probs, value in zip(
            ragged.unbind(0), scored.get(("log_probs", "full"), as_list=True), advantage, strict=True
        ):
            sample.set(("next", "ref_log_probs", "full"), log_probs)
            sample.set(("log_probs", "full"), log_probs * 1.3)  # an older policy: ratios differ from 1, some clip
            sample.set("advantage", value)
        padded = pad_rollout(rollout, pad_token_id=tokenizer.pad_token_id)
        ScoreLogProbs(ResponseLogProbs(model), out_key=("next", "ref_log_probs", "full"))(padded)
        padded.set(("log_probs", "full"), padded.get(("next", "ref_log_probs", "full")) * 1.3)
        padded.set("advantage", advantage)

        ragged_out, ragged_grads = grpo_loss_and_gradients(GRPOLoss, ragged_actor, ragged)
        padded_out, padded_grads = grpo_loss_and_gradients(ResponseGRPOLoss, ResponseLogProbs(model), padded)
        assert ragged_out.clip_fraction > 0
        for name in ("loss_objective", "loss_entropy", "loss_kl_to_ref", "clip_fraction", "kl_to_ref", "entropy"):
            torch.testing.assert_close(padded_out.get(name), ragged_out.get(name), atol=1e-5, rtol=1e-4, msg=name)
        for got, expected in zip(padded_grads, ragged_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


class TestRewardTerms:
    def test_length_penalty_counts_tokens_beyond_the_free_ones(self):
        td = lazy_stack([TensorDict({"tokens": {"response": torch.tensor([5, 6, 0, 0])}}) for _ in range(2)])
        out = LengthPenalty(coefficient=0.5, free_tokens=1, pad_token_id=0)(td)
        assert out["length_penalty"].tolist() == [-0.5, -0.5]

    def test_terms_add_to_the_reward_model_score_in_the_env(self, tiny_policy):
        from interop import HFRewardModelWrapper, RewardModelTransform

        model, tokenizer = tiny_policy

        class ConstantRewardModel(torch.nn.Module):
            def forward(self, input_ids, attention_mask=None):
                return torch.full((input_ids.shape[0], 1), 2.0)

        transforms = [
            RewardModelTransform(HFRewardModelWrapper(ConstantRewardModel(), inference_mode=True)),
            RewardModelTransform(TextScoreReward(oracle_score, weight=10.0), accumulate=True),
            RewardModelTransform(LengthPenalty(coefficient=0.1), accumulate=True),
        ]
        loader = make_prompt_dataloader(["Review the mug."], seed=0)
        env = make_chat_env(loader, tokenizer=tokenizer, group_size=4, transforms=transforms)
        assert env.full_reward_spec["reward"].shape == torch.Size([4, 1, 1])
        policy = make_policy(model, tokenizer, generation=GENERATION)
        torch.manual_seed(1)
        step = env.step(policy(env.reset()))
        texts = step.get(("text", "response")).tolist()
        lengths = [t.numel() for t in step.get(("tokens", "response"), as_list=True)]
        expected = [2.0 + 10.0 * oracle_score(t) - 0.1 * n for t, n in zip(texts, lengths, strict=True)]
        torch.testing.assert_close(step["next", "reward"].reshape(-1), torch.tensor(expected))
