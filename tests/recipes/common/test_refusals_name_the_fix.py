"""Settings that used to be accepted, or refused without a fix (issue 39's earlier unclear cases): each refusal names
the key and what to write instead, before any model loads (``validate`` of each recipe)."""

from __future__ import annotations

import importlib

import pytest
from _small_runs import GRPO_SMALL, REWARD_SMALL, TRL_SMALL

from recipes.common.config import ConfigError

RECIPES = {
    "trl_grpo_torchrl_rollouts": (TRL_SMALL, "recipes.trl_grpo.checks"),
    "grpo_torchrl_rm": (GRPO_SMALL, "recipes.grpo.checks"),
    "reward_trainer_from_buffer": (REWARD_SMALL, "recipes.reward.checks"),
}
LENGTH = ["reward_model=none", "+reward.functions.a.function=_reward_functions.length_reward"]


@pytest.mark.parametrize(
    ("root", "overrides", "message"),
    [
        (
            "trl_grpo_torchrl_rollouts",
            ["train.warmup_steps=1.5", "train.lr_scheduler_type=linear"],
            r"train.warmup_steps=1.5: .* Write train.warmup_steps=2 \(steps\) or a fraction below 1",
        ),
        (
            "reward_trainer_from_buffer",
            ["train.warmup_steps=1.5", "train.lr_scheduler_type=linear"],
            r"train.warmup_steps=1.5: .* Write train.warmup_steps=2 \(steps\) or a fraction below 1",
        ),
        (
            "grpo_torchrl_rm",
            ["train.warmup_steps=1.5", "train.lr_scheduler=linear"],
            r"train.warmup_steps=1.5: a fraction .* below 1 \(e.g. train.warmup_steps=0.1\); .* train.warmup_steps=2",
        ),
        (
            "trl_grpo_torchrl_rollouts",
            ["reward.model_weight=0.0"],
            r"weighted 0 \(reward.model_weight=0.0\): .* nonzero",
        ),
        ("grpo_torchrl_rm", ["reward.model_weight=0"], r"weighted 0 \(reward.model_weight=0\): .* nonzero weight"),
        (
            "trl_grpo_torchrl_rollouts",
            [*LENGTH, "+reward.functions.a.weight=0.0"],
            r"weighted 0 \(reward.functions.a.weight=0.0\)",
        ),
        ("grpo_torchrl_rm", [*LENGTH, "+reward.functions.a.weight=0"], r"weighted 0 \(reward.functions.a.weight=0\)"),
        (
            "trl_grpo_torchrl_rollouts",
            ["+train.push_to_hub=true"],
            r"train.push_to_hub=True, but HF_HUB_OFFLINE is set: .* Drop push_to_hub .* or unset HF_HUB_OFFLINE",
        ),
        (
            "reward_trainer_from_buffer",
            ["+train.push_to_hub=true"],
            r"train.push_to_hub=True, but HF_HUB_OFFLINE is set",
        ),
    ],
)
def test_a_setting_that_cannot_work_is_refused_naming_the_key_and_the_fix(
    compose_config, tmp_path, monkeypatch, root, overrides, message
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    small, checks = RECIPES[root]
    validate = importlib.import_module(checks).validate
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(root, [*small, *overrides, f"output_dir={tmp_path}"]))


@pytest.mark.parametrize("root", ["trl_grpo_torchrl_rollouts", "grpo_torchrl_rm"])
def test_one_nonzero_weight_among_zeros_is_accepted(compose_config, tmp_path, root):
    small, checks = RECIPES[root]
    overrides = [*small, "reward.model_weight=0", "+reward.functions.a.function=_reward_functions.length_reward"]
    importlib.import_module(checks).validate(compose_config(root, [*overrides, f"output_dir={tmp_path}"]))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_raising_trl_reward_function_is_named_with_the_row_it_fails_on(kind):
    """In the trl recipe the error came from deep inside trl, naming neither the setting nor the row."""
    import asyncio

    from recipes.trl_grpo.rewards import checked_reward_function

    def no_b(completions, **kwargs):
        if any("b" in completion for completion in completions):
            raise ValueError("cannot score a b")
        return [1.0] * len(completions)

    async def no_b_async(completions, **kwargs):
        return no_b(completions)

    named = checked_reward_function(no_b if kind == "sync" else no_b_async, name="strict")
    arguments = {"prompts": ["p", "q"], "completions": ["a", "b"], "completion_ids": [[1], [2]]}
    row = " on row 1 of the step's responses (prompt 'q', completion 'b')" if kind == "sync" else ""
    message = f"The reward function reward.functions.strict raised ValueError: cannot score a b{row}. Fix the function"
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        result = named(**arguments)
        if kind == "async":
            asyncio.run(result)
    assert isinstance(raised.value.__cause__, ValueError)  # its traceback follows in the log


def test_completions_every_reward_function_declines_are_warned_of_once_naming_the_functions(caplog):
    """trl gives them a NaN reward and warns "All reward functions returned None" naming no setting; the run ended on
    "reward nan -> nan" at INFO."""
    from recipes.trl_grpo.rewards import DeclinedByEverySource, checked_reward_function

    declined = DeclinedByEverySource(["format", "answer"])
    functions = [
        checked_reward_function(lambda completions, **kw: [None, 1.0], name="format", declined=declined),
        checked_reward_function(lambda completions, **kw: [None, None], name="answer", declined=declined),
    ]
    arguments = {"prompts": ["p", "q"], "completions": ["a", "b"], "completion_ids": [[1], [2]]}
    with caplog.at_level("WARNING"):
        for _ in range(2):  # two batches: said once
            for function in functions:
                function(**arguments)
    warned = [record.message for record in caplog.records if "returned None" in record.message]
    assert warned == [
        "Every reward source (reward.functions.format, reward.functions.answer) returned None for 1 of 2 completions "
        "of a batch: their reward is NaN and they train nothing. Make one function return a number wherever the "
        "others do not apply."
    ]
