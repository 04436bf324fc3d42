"""Fixtures of the GRPO recipe's tests."""

from __future__ import annotations

import pytest

import recipes.grpo.rewards as rewards_module
import recipes.grpo_torchrl_rm as recipe


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every model and tokenizer load of the recipe fails the test: what a check refuses is refused before them."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    for name in ("load_causal_lm", "load_tokenizer", "load_policy"):
        monkeypatch.setattr(recipe, name, refuse)
    monkeypatch.setattr(rewards_module, "load_reward_model", refuse)
