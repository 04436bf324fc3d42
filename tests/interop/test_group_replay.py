"""interop.GroupReplay under interop.TorchRLGRPOTrainer, with trl's own scoring: a group whose rewards all tie (zero
advantages: it trains nothing) is replaced by a stored informative group, whose stored tokens, advantages and sampling
log-probs are what trl trains on; the replay's share and age are logged; groups that tie are never stored."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from tensordict import TensorDict

from interop import TorchRLRolloutFunc
from interop.trl.group_replay import GroupReplay
from interop.trl.trainer import TorchRLGRPOTrainer

TIED = [{"role": "user", "content": "Review the mug."}]
INFORMATIVE = [{"role": "user", "content": "Review the lamp."}]


def _reward(prompts, completions, **kwargs):
    """Every completion to the mug prompt scores 1 (a tied group); the lamp's score by length."""
    return [
        1.0 if prompt[-1]["content"] == TIED[0]["content"] else float(len(completion[0]["content"]))
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


def _trainer(tiny_policy, tmp_path, replay):
    import datasets
    from trl import GRPOConfig

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        beta=0.1,
        disable_tqdm=True,
        activation_checkpointing=False,
    )
    return TorchRLGRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": [TIED, INFORMATIVE] * 4}),
        processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(tokenizer=tokenizer),
        replay=replay,
    )


def _batch(trainer, first, second):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer._generate_and_score_completions([{"prompt": p} for p in [first] * 4 + [second] * 4])


def test_a_tied_group_trains_on_a_stored_group_with_its_own_log_probs(tiny_policy, tmp_path):
    replay = GroupReplay(capacity=16)
    trainer = _trainer(tiny_policy, tmp_path, replay)
    torch.manual_seed(0)
    first = _batch(trainer, INFORMATIVE, TIED)
    assert len(replay) == 1, "the informative group is stored, the tied one is not"
    stored = replay.buffer.storage[0]
    trainer.state.global_step = 1
    second = _batch(trainer, TIED, INFORMATIVE)

    replayed = slice(0, 4)  # the tied group's place
    width = stored["completion_ids"].shape[1]
    assert second["completion_ids"][replayed, :width].tolist() == stored["completion_ids"].tolist()
    assert second["completion_mask"][replayed, width:].sum() == 0
    torch.testing.assert_close(second["advantages"][replayed], stored["advantages"])
    torch.testing.assert_close(second["advantages"][replayed], first["advantages"][:4].float())
    torch.testing.assert_close(second["old_per_token_logps"][replayed, :width], stored["old_logps"])
    torch.testing.assert_close(second["ref_per_token_logps"][replayed, :width], stored["ref_logps"])
    assert second["num_items_in_batch"] == second["completion_mask"].sum()
    # trl's sampler correction (on by default): a stored group keeps the sampler's log-probs, and trains against them
    # with a correction ratio of 1; the fresh group keeps trl's ratio.
    assert trainer.corrects_sampler
    torch.testing.assert_close(stored["old_logps"], first["sampling_per_token_logps"][:4, :width].float())
    torch.testing.assert_close(second["sampling_per_token_logps"][replayed, :width], stored["old_logps"])
    assert second["importance_sampling_ratio"].shape == (8, 1), "sequence_mask: one ratio per completion"
    assert second["importance_sampling_ratio"][replayed].eq(1.0).all()
    assert trainer._metrics["train"]["rollout/replayed_share"] == [0.0, 0.5]
    assert trainer._metrics["train"]["rollout/replayed_age"] == [1.0]
    loss = trainer.compute_loss(trainer.model, second)
    assert torch.isfinite(loss) and second["advantages"].abs().sum() > 0


def test_groups_that_tie_are_never_drawn_and_loaded_rows_regroup():
    replay = GroupReplay(capacity=8, seed=1)
    replay.add(_group(5), reward_std=2.0, step=0)
    replay.add(_group(6), reward_std=0.0, step=0)
    replay.add(_group(7), reward_std=1.0, step=0)
    drawn = [int(g["completion_ids"][0, 0]) for g in replay.sample(400)]
    assert 6 not in drawn and 250 < drawn.count(5) < 300, "proportional to the spread: 2/3 of the draws"

    rows = TensorDict(
        {
            "prompt_ids": torch.tensor([[0, 4, 4]] * 2 + [[9, 9, 9]] * 2),
            "prompt_length": torch.tensor([2, 2, 3, 3]),
            "completion_ids": torch.tensor([[1, 2], [3, 0], [4, 0], [5, 6]]),
            "completion_length": torch.tensor([2, 1, 1, 2]),
            "logprobs": -torch.ones(4, 2),
            "advantage": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "reward": torch.tensor([2.0, 0.0, 1.0, 0.0]),
            "step": torch.tensor([3, 3, 3, 3]),
        },
        batch_size=[4],
    )
    loaded = GroupReplay(capacity=8)
    assert loaded.load_rows(rows, group_size=2, pad_token_id=0) == 2
    first = loaded.buffer.storage[0]
    assert first["prompt_mask"].tolist() == [[0, 1, 1], [0, 1, 1]] and first["old_logps"][1].tolist() == [-1.0, 0.0]


@pytest.mark.parametrize("spreads", [[0.2, 0.3, 0.25], [4.0, 5.0, 4.5]], ids=["below_1", "above_1"])
def test_a_large_alpha_still_draws_the_group_with_the_largest_spread(spreads):
    """Spreads raised to the 1000th power underflow below 1 (the draw turned uniform) and overflow above 1 (multinomial
    refused the infinities): the draw must still go to the largest spread, at any reward scale."""
    replay = GroupReplay(capacity=4, alpha=1000.0, seed=0)
    for value, spread in enumerate(spreads):
        replay.add(_group(value), reward_std=spread, step=0)
    drawn = [int(g["completion_ids"][0, 0]) for g in replay.sample(50)]
    assert drawn == [1] * 50


def _group(value):
    return TensorDict(
        {
            "prompt_ids": torch.full((2, 3), value),
            "prompt_mask": torch.ones(2, 3, dtype=torch.long),
            "completion_ids": torch.full((2, 2), value),
            "completion_mask": torch.ones(2, 2, dtype=torch.long),
            "advantages": torch.tensor([-1.0, 1.0]),
            "old_logps": -torch.ones(2, 2),
        },
        batch_size=[2],
    )


def test_groups_loaded_from_another_run_are_never_younger_than_this_runs_first_step():
    """Their steps are the other run's (up to 30 there): as they were, a draw at this run's step 1 logged
    rollout/replayed_age -6. The newest loaded group counts as sampled at step 0, the others older by their distance."""
    groups = [_group(value) for value in range(3)]
    rows = TensorDict(
        {
            "prompt_ids": torch.cat([g["prompt_ids"] for g in groups]),
            "prompt_length": torch.full((6,), 3),
            "completion_ids": torch.cat([g["completion_ids"] for g in groups]),
            "completion_length": torch.full((6,), 2),
            "logprobs": -torch.ones(6, 2),
            "advantage": torch.tensor([1.0, -1.0] * 3),
            "reward": torch.tensor([1.0, 0.0] * 3),
            "step": torch.tensor([28, 28, 30, 30, 7, 7]),
        },
        batch_size=[6],
    )
    replay = GroupReplay(capacity=8)
    assert replay.load_rows(rows, group_size=2, pad_token_id=0) == 3
    assert [int(replay.buffer.storage[i]["step"][0]) for i in range(3)] == [-2, 0, -23]
