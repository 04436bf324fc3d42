"""interop.TorchRLRolloutFunc built without a policy and interop.TorchRLGRPOTrainer, with trl's own GRPOTrainer code:
the sampling follows the trainer's GRPOConfig (length, temperature) and the log-probs it hands trl are trl's own
scoring of the same tokens; a policy built with other settings is refused, naming both values; every scored batch
lands in the buffer with trl's rewards and advantages."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torchrl.data import LazyStackStorage, ReplayBuffer

from interop import CausalLMSampler, SamplingSettings, TorchRLRolloutFunc
from interop.trl.trainer import TorchRLGRPOTrainer

PROMPTS = ["Review the mug.", "Write a review of the new kettle."]


def _length_reward(completions, **kwargs):
    return [float(len(completion[0]["content"])) for completion in completions]


def _trainer(tiny_policy, tmp_path, *, trainer_class=TorchRLGRPOTrainer, **kwargs):
    import datasets
    from trl import GRPOConfig

    model, tokenizer = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        temperature=0.7,
        beta=0.0,
        disable_tqdm=True,
        activation_checkpointing=False,
    )
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in PROMPTS * 4]})
    return trainer_class(
        model=model,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )


def _inputs():
    """A generation batch as trl's sampler hands it over: each prompt num_generations (4) times in a row."""
    return [{"prompt": [{"role": "user", "content": text}]} for text in PROMPTS for _ in range(4)]


def _score(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets before a step
    return trainer._generate_and_score_completions(copy.deepcopy(inputs))


def test_without_a_policy_it_samples_as_the_grpo_config_says_and_trl_scores_the_same_log_probs(tiny_policy, tmp_path):
    from trl import GRPOTrainer

    trainer = _trainer(tiny_policy, tmp_path, trainer_class=GRPOTrainer, rollout_func=TorchRLRolloutFunc())
    torch.manual_seed(0)
    output = _score(trainer, _inputs())

    sampler = trainer.rollout_func.policy
    assert isinstance(sampler, CausalLMSampler) and sampler.model is trainer.model
    assert sampler.settings.temperature == 0.7 and sampler.settings.max_new_tokens == 16
    assert sampler.settings.top_k is None, "trl's top_k=0: the whole vocabulary"
    rollout = trainer.rollout_func.last_rollout
    assert int(rollout["completion_length"].max()) <= 16 and output["completion_ids"].shape[1] <= 16
    # trl's own scoring of the same tokens (its logits divided by its temperature).
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad():
        trls, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, output["completion_ids"].shape[1]
        )
    completion_mask = output["completion_mask"].bool()
    width = output["completion_ids"].shape[1]
    ours = torch.nn.functional.pad(rollout["logprobs"], (0, width - rollout["logprobs"].shape[1]))
    torch.testing.assert_close(ours[completion_mask], trls[completion_mask], atol=2e-5, rtol=0)
    # The raw logits score the same tokens otherwise: the log-probs are at trl's temperature, not at 1.
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -width - 1 : -1]
    raw = logits.float().log_softmax(-1).gather(-1, output["completion_ids"][..., None]).squeeze(-1)
    assert not torch.allclose(ours[completion_mask], raw[completion_mask], atol=1e-2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_new_tokens": 24, "temperature": 0.7}, "max_new_tokens: policy 24, GRPOConfig 16"),
        ({"max_new_tokens": 16}, "temperature: policy 1.0, GRPOConfig 0.7"),
        ({"max_new_tokens": 16, "temperature": 0.7, "top_k": 50}, "top_k: policy 50, GRPOConfig None"),
    ],
)
def test_a_policy_that_samples_otherwise_than_trl_asks_is_refused_naming_both_values(
    tiny_policy, tmp_path, settings, message
):
    from trl import GRPOTrainer

    model, tokenizer = tiny_policy

    def rollout_func_for(trainer_model):
        return TorchRLRolloutFunc(CausalLMSampler(trainer_model, tokenizer, settings=SamplingSettings(**settings)))

    trainer = _trainer(tiny_policy, tmp_path, trainer_class=GRPOTrainer, rollout_func=None)
    trainer.rollout_func = rollout_func_for(trainer.model)
    with pytest.raises(ValueError, match=message):
        _score(trainer, _inputs())


def test_a_sampler_at_trls_temperature_must_record_its_log_probs_there(tiny_policy, tmp_path):
    from trl import GRPOTrainer

    trainer = _trainer(tiny_policy, tmp_path, trainer_class=GRPOTrainer)
    settings = SamplingSettings(max_new_tokens=16, temperature=0.7)
    trainer.rollout_func = TorchRLRolloutFunc(CausalLMSampler(trainer.model, tiny_policy[1], settings=settings))
    with pytest.raises(ValueError, match="log_probs_at_temperature: policy False, GRPOConfig True"):
        _score(trainer, _inputs())


def test_every_scored_batch_lands_in_the_buffer_with_trls_rewards_and_advantages(tiny_policy, tmp_path):
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    trainer = _trainer(tiny_policy, tmp_path, replay_buffer=buffer)
    torch.manual_seed(0)
    output = _score(trainer, _inputs())

    assert len(buffer) == 8 and trainer.scored_batches == 1
    rows = buffer[:8]
    completion_mask = output["completion_mask"].bool()
    tokenizer = tiny_policy[1]
    texts, prompts = rows.get("completion_text").tolist(), rows.get("prompt").tolist()
    for row in range(8):
        ids = output["completion_ids"][row][completion_mask[row]].tolist()
        assert rows[row]["completion_ids"].tolist() == ids
        assert texts[row] == tokenizer.decode(ids, skip_special_tokens=True)
        assert prompts[row] == _inputs()[row]["prompt"]
    torch.testing.assert_close(rows["advantage"], output["advantages"].float())
    torch.testing.assert_close(rows["rewards"][:, 0], torch.tensor([float(len(text)) for text in texts]))
    torch.testing.assert_close(rows["reward"], rows["rewards"][:, 0])
    assert rows["step"].tolist() == [0] * 8, "the updates the sampling weights had had"


def test_the_trainer_takes_one_buffer(tiny_policy, tmp_path):
    with pytest.raises(ValueError, match="give one"):
        _trainer(
            tiny_policy,
            tmp_path,
            rollout_func=TorchRLRolloutFunc(replay_buffer=ReplayBuffer(storage=LazyStackStorage(4))),
            replay_buffer=ReplayBuffer(storage=LazyStackStorage(4)),
        )
