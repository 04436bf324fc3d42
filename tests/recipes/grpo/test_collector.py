"""GRPO's rollout choices (recipes/grpo/collector.py): the generation settings each ``rollout.env`` takes, and the
``chat`` rollout (TorchRL's chat stack) trained in the recipe's dense layout as TorchRL trains it ragged."""

from __future__ import annotations

import pytest
import torch
from _chat_rollouts import GENERATION, sample_two_prompts
from _grpo_helpers import loss_settings, torchrl_actor
from omegaconf import OmegaConf

from recipes.common.chat import pad_rollout
from recipes.common.config import ConfigError
from recipes.grpo.collector import check_generation_settings
from recipes.grpo.log_probs import ResponseLogProbs, ScoreLogProbs


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


class TestSampling:
    @pytest.fixture(scope="class")
    def rollout(self, tiny_policy):
        return sample_two_prompts(
            tiny_policy, group_size=2, seed=0, generation={**GENERATION, "return_log_probs": True}
        )

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
        return sample_two_prompts(tiny_policy, group_size=3, seed=3, generation=GENERATION)

    def test_grpo_loss_and_gradients_match_the_ragged_layout(self, tiny_policy, rollout):
        """The recipe's padded batch and response-only loss (``GRPOObjective``, bnpo: a token mean, as TorchRL's
        ``aggregation="token_mean"``) train as TorchRL's ``GRPOLoss`` with its ragged actor trains on the rollout as
        sampled: a faster layout, not another objective."""
        from torchrl.objectives.llm import GRPOLoss

        from recipes.grpo.batch import ADVANTAGE, LOSS_MASK, REF_LOG_PROBS, response_mask
        from recipes.grpo.loss import GRPOObjective, Scale

        model, tokenizer = tiny_policy
        advantage = torch.linspace(-1.0, 1.0, 6).reshape(6, 1, 1)  # as the recipe writes it
        ragged = rollout.copy()
        ragged_actor = torchrl_actor(model, tokenizer, padded=False)
        with torch.no_grad():
            scored = ragged_actor(ragged.select(("tokens", "full"), ("masks", "all_attention_mask")))
        for sample, log_probs, value in zip(
            ragged.unbind(0), scored.get(("log_probs", "full"), as_list=True), advantage, strict=True
        ):
            sample.set(("log_probs", "full"), log_probs * 1.3)  # an older policy: ratios differ from 1, some clip
            sample.set("advantage", value)
        padded = pad_rollout(rollout, pad_token_id=tokenizer.pad_token_id)
        ScoreLogProbs(ResponseLogProbs(model), out_key=REF_LOG_PROBS)(padded)
        padded.set(("log_probs", "full"), padded.get(REF_LOG_PROBS) * 1.3)
        padded.set(ADVANTAGE, advantage)
        padded.set(LOSS_MASK, response_mask(padded))

        model.zero_grad()
        ragged_out = GRPOLoss(ragged_actor, masking_strategy="sft", entropy_bonus=False, aggregation="token_mean")(
            ragged
        )
        ragged_out.loss_objective.backward()
        ragged_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        objective = GRPOObjective(ResponseLogProbs(model), loss_settings(), max_completion_length=12)
        padded_out = objective(padded, scale=Scale(1, 1.0))
        padded_out["loss"].backward()
        padded_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        assert ragged_out.clip_fraction > 0
        torch.testing.assert_close(padded_out["loss"], ragged_out.loss_objective, atol=1e-5, rtol=1e-4)
        for got, expected in zip(padded_grads, ragged_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_the_learner_samples_and_evaluates_on_learner_sampling_threads_and_trains_on_num_threads(
    compose_config, tmp_path, monkeypatch
):
    """``num_threads=2 rollout.learner_sampling_threads=1``: every forward pass of the policy that samples (training
    batches and evaluation, in inference mode) runs on 1 thread, every pass of the update on 2."""
    from _small_runs import GRPO_SMALL

    import recipes.grpo_torchrl_rm as recipe

    seen: list[tuple[str, bool, int]] = []  # (where, inference mode, threads)
    where = ["training"]
    load_models, evaluate = recipe.load_models, recipe.evaluate

    def recording_models(*args, **kwargs):
        models = load_models(*args, **kwargs)
        models.policy.get_input_embeddings().register_forward_pre_hook(
            lambda module, inputs: seen.append((where[0], torch.is_inference_mode_enabled(), torch.get_num_threads()))
        )
        return models

    def recording_evaluation(*args, **kwargs):
        where[0] = "eval"
        try:
            return evaluate(*args, **kwargs)
        finally:
            where[0] = "training"

    monkeypatch.setattr(recipe, "load_models", recording_models)
    monkeypatch.setattr(recipe, "evaluate", recording_evaluation)
    before = torch.get_num_threads()
    overrides = ["num_threads=2", "rollout.learner_sampling_threads=1", "train.steps=1", "eval.every_n_steps=1"]
    overrides += ["eval.group_size=2", "data.num_eval_prompts=2", f"output_dir={tmp_path}"]
    try:
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, *overrides]))
    finally:
        torch.set_num_threads(before)

    sampling = {(place, threads) for place, inference, threads in seen if inference}
    assert sampling == {("training", 1), ("eval", 1)}
    assert {threads for _, inference, threads in seen if not inference} == {2}  # the learner's own passes
