"""TorchRL rollout building blocks (recipes/common/rollout.py) on the shipped tiny policy: prompts, env, sampling,
recomputed log-probs, reward terms."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict, lazy_stack

from recipes.common.rollout import (
    EndlessShuffleSampler,
    LengthPenalty,
    RecomputeLogProbs,
    TextScoreReward,
    make_chat_env,
    make_log_prob_scorer,
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


def _sample_two_prompts(tiny_policy, *, group_size: int, seed: int, generation):
    """One ragged rollout of the tiny policy: two prompts, ``group_size`` responses each."""
    model, tokenizer = tiny_policy
    torch.manual_seed(seed)
    loader = make_prompt_dataloader(["Review the mug.", "What do you think of the bike?"], seed=0)
    env = make_chat_env(loader, tokenizer=tokenizer, group_size=group_size, num_prompts=2)
    return make_policy(model, tokenizer, generation=generation)(env.reset())


def _grpo_loss_and_gradients(loss_class, scorer, batch):
    """One GRPO loss (KL and entropy terms on) over ``batch`` and the gradients it gives the scorer's model."""
    loss = loss_class(scorer, kl_to_ref_coeff=0.1, entropy_bonus=True, entropy_coeff=0.01, masking_strategy="sft")
    scorer.model.zero_grad()
    out = loss(batch)
    (out.loss_objective + out.loss_entropy + out.loss_kl_to_ref).backward()
    grads = [p.grad.clone() for p in scorer.model.parameters()]
    scorer.model.zero_grad()
    return out, grads


class TestSamplingAndLogProbs:
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

    def test_recomputed_log_probs_match_a_manual_forward(self, tiny_policy, rollout):
        model, tokenizer = tiny_policy
        RecomputeLogProbs(make_log_prob_scorer(model, tokenizer), micro_batch_size=3)(rollout)
        full = rollout.get(("tokens", "full"), as_list=True)
        recomputed = rollout.get(("log_probs", "full"), as_list=True)
        generated = rollout.get(("log_probs", "response"), as_list=True)
        prompts = rollout.get(("tokens", "prompt"), as_list=True)
        for tokens, log_probs, gen_log_probs, prompt in zip(full, recomputed, generated, prompts, strict=True):
            assert log_probs.shape == tokens.shape
            with torch.no_grad():
                logits = model(input_ids=tokens[None]).logits[0]
            manual = logits[:-1].log_softmax(-1).gather(-1, tokens[1:, None]).squeeze(-1)
            torch.testing.assert_close(log_probs[1:], manual, atol=1e-4, rtol=1e-4)
            assert log_probs[0] == 0  # nothing predicts the first token
            # TorchRL 0.14.1's generate mode zeroes the first response log-prob: why the recipe recomputes them.
            response = log_probs[prompt.numel() :]
            assert gen_log_probs[0] == 0 and response[0] < 0
            torch.testing.assert_close(gen_log_probs[1:], response[1:], atol=1e-4, rtol=1e-4)

    def test_reference_log_probs_go_where_the_loss_reads_them(self, tiny_policy, rollout):
        model, tokenizer = tiny_policy
        RecomputeLogProbs(make_log_prob_scorer(model, tokenizer), out_key=("next", "ref_log_probs", "full"))(rollout)
        ref = rollout.get(("next", "ref_log_probs", "full"), as_list=True)
        assert [r.numel() for r in ref] == [t.numel() for t in rollout.get(("tokens", "full"), as_list=True)]


class TestPaddedBatches:
    """``pad_rollout`` + ``make_log_prob_scorer(padded=True)``: what the GRPO recipe trains on, the same numbers as the
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

    @pytest.mark.parametrize("micro_batch_size", [None, 4])
    def test_padded_log_probs_equal_the_per_sample_ones(self, tiny_policy, rollout, micro_batch_size):
        model, tokenizer = tiny_policy
        ragged = RecomputeLogProbs(make_log_prob_scorer(model, tokenizer))(rollout.copy())
        padded = pad_rollout(rollout, pad_token_id=tokenizer.pad_token_id)
        scorer = make_log_prob_scorer(model, tokenizer, padded=True)
        RecomputeLogProbs(scorer, micro_batch_size=micro_batch_size)(padded)
        log_probs, mask = padded["log_probs", "full"], padded["masks", "all_attention_mask"]
        assert log_probs.shape == mask.shape
        for row, row_mask, expected in zip(
            log_probs, mask, ragged.get(("log_probs", "full"), as_list=True), strict=True
        ):
            torch.testing.assert_close(row[row_mask], expected, atol=1e-5, rtol=1e-5)

    def test_grpo_loss_and_gradients_match_the_ragged_layout(self, tiny_policy, rollout):
        """The recipe's padded training batch is a faster layout, not another objective."""
        from torchrl.objectives.llm import GRPOLoss

        model, tokenizer = tiny_policy
        pad_id = tokenizer.pad_token_id
        advantage = torch.linspace(-1.0, 1.0, 6).reshape(6, 1, 1)  # as MCAdvantage writes it
        ragged = rollout.copy()
        ragged_scorer = make_log_prob_scorer(model, tokenizer)
        RecomputeLogProbs(ragged_scorer)(ragged)
        RecomputeLogProbs(ragged_scorer, out_key=("next", "ref_log_probs", "full"))(ragged)
        for sample, value in zip(ragged.unbind(0), advantage, strict=True):
            sample.set("advantage", value)
        # An older policy, so that the ratios differ from 1 and some get clipped.
        with torch.no_grad():
            for sample in ragged.unbind(0):
                sample.set(("log_probs", "full"), sample.get(("log_probs", "full")) * 1.3)
        padded = pad_rollout(rollout, pad_token_id=pad_id)
        padded_scorer = make_log_prob_scorer(model, tokenizer, padded=True)
        RecomputeLogProbs(padded_scorer, out_key=("next", "ref_log_probs", "full"))(padded)
        padded.set(("log_probs", "full"), padded.get(("next", "ref_log_probs", "full")) * 1.3)
        padded.set("advantage", advantage)

        ragged_out, ragged_grads = _grpo_loss_and_gradients(GRPOLoss, ragged_scorer, ragged)
        padded_out, padded_grads = _grpo_loss_and_gradients(GRPOLoss, padded_scorer, padded)
        assert ragged_out.clip_fraction > 0
        for name in ("loss_objective", "loss_entropy", "loss_kl_to_ref", "clip_fraction", "kl_to_ref", "entropy"):
            torch.testing.assert_close(padded_out.get(name), ragged_out.get(name), atol=1e-5, rtol=1e-4, msg=name)
        for got, expected in zip(padded_grads, ragged_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


class TestOnPolicyGRPOLoss:
    """One update per step: the recipe does not recompute the old log-probs, ``OnPolicyGRPOLoss`` takes the current."""

    @pytest.fixture(scope="class")
    def batch(self, tiny_policy):
        model, tokenizer = tiny_policy
        rollout = _sample_two_prompts(tiny_policy, group_size=3, seed=5, generation=GENERATION)
        batch = pad_rollout(rollout, pad_token_id=tokenizer.pad_token_id)
        scorer = make_log_prob_scorer(model, tokenizer, padded=True)
        RecomputeLogProbs(scorer, out_key=("next", "ref_log_probs", "full"))(batch)
        batch.set("advantage", torch.linspace(-1.0, 1.0, 6).reshape(6, 1, 1))
        return batch

    @staticmethod
    def _loss_and_gradients(loss_class, tiny_policy, batch):
        model, tokenizer = tiny_policy
        return _grpo_loss_and_gradients(loss_class, make_log_prob_scorer(model, tokenizer, padded=True), batch)

    def _assert_same(self, got, expected):
        (got_out, got_grads), (expected_out, expected_grads) = got, expected
        for name in ("loss_objective", "loss_entropy", "loss_kl_to_ref", "clip_fraction", "kl_to_ref", "entropy"):
            torch.testing.assert_close(got_out.get(name), expected_out.get(name), atol=1e-6, rtol=1e-5, msg=name)
        for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
            torch.testing.assert_close(got_grad, expected_grad, atol=1e-6, rtol=1e-5)

    def test_without_old_log_probs_it_trains_as_grpo_with_recomputed_ones(self, tiny_policy, batch):
        from torchrl.objectives.llm import GRPOLoss

        from recipes.common.losses import OnPolicyGRPOLoss

        model, tokenizer = tiny_policy
        recomputed = batch.clone()
        RecomputeLogProbs(make_log_prob_scorer(model, tokenizer, padded=True))(recomputed)
        expected = self._loss_and_gradients(GRPOLoss, tiny_policy, recomputed)
        on_policy = self._loss_and_gradients(OnPolicyGRPOLoss, tiny_policy, batch)
        self._assert_same(on_policy, expected)
        assert on_policy[0].clip_fraction == 0  # the ratio is exactly 1
        assert ("log_probs", "full") not in batch.keys(True)  # the caller's batch is left as it was

    def test_with_old_log_probs_it_is_grpo_loss(self, tiny_policy, batch):
        from torchrl.objectives.llm import GRPOLoss

        from recipes.common.losses import OnPolicyGRPOLoss

        off_policy = batch.clone()
        off_policy.set(("log_probs", "full"), batch.get(("next", "ref_log_probs", "full")) * 1.3)
        expected = self._loss_and_gradients(GRPOLoss, tiny_policy, off_policy)
        assert expected[0].clip_fraction > 0
        self._assert_same(self._loss_and_gradients(OnPolicyGRPOLoss, tiny_policy, off_policy), expected)


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
