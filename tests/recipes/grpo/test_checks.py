"""recipes/grpo/checks.py and schema.py: a key the recipe does not read, a wrong type or a non-finite number is refused
before anything loads; LoRA turns on from the command line as users type it; a resumed run trains with its own
settings, not the YAML defaults; the config is resolved once."""

from __future__ import annotations

import json

import pytest
from _small_runs import GRPO_SMALL, read_metrics
from omegaconf import OmegaConf

import recipes.grpo_torchrl_rm as recipe
from recipes.common.config import ConfigError
from recipes.grpo.checks import validate


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    for name in ("load_causal_lm", "load_reward_model", "load_tokenizer", "load_policy"):
        monkeypatch.setattr(recipe, name, refuse)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+loss.clip_epsilon_hihg=0.28", r"loss.clip_epsilon_hihg: grpo_torchrl_rm has no such setting.*loss.clip_eps"),
        ("+train.gradient_acumulation_steps=2", r"train.gradient_acumulation_steps: grpo_torchrl_rm has no such"),
        ("+rollout.tempreature=0.7", r"rollout.tempreature: .*no such setting"),
        ("+optimizer.momentum=0.9", r"optimizer.momentum: .*no such setting"),
        ("+seeds=1", r"seeds: .*Did you mean seed or samples\?"),
    ],
)
def test_a_key_the_recipe_does_not_read_is_refused_with_the_nearest(
    compose_config, tmp_path, nothing_loads, override, message
):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.alpha=true", r"model.lora.alpha=True: expected a number"),
        ("train.steps=ten", r"train.steps='ten': expected an integer"),
        ("rollout.generation.temperature=nan", r"rollout.generation.temperature=nan: not a finite number"),
        ("+rollout.generation.repetition_penalty=nan", r"rollout.generation.repetition_penalty=nan: not a finite"),
        ("loss.kl_to_ref_coeff=nan", r"loss.kl_to_ref_coeff=nan: not a finite number"),
        ("loss.clip_epsilon=inf", r"loss.clip_epsilon=inf: not a finite number"),
        ("optimizer.betas=[1.5,0.9]", r"optimizer.betas\[0\]=1.5 must be >= 0 and < 1"),
        ("optimizer.weight_decay=-1", r"optimizer.weight_decay=-1 must be >= 0"),
        ("seed=-1", r"seed=-1 must be >= 0"),
        ("reward.micro_batch_size=0", r"reward.micro_batch_size=0 must be >= 1"),
        ("rollout.log_prob_micro_batch_size=0", r"rollout.log_prob_micro_batch_size=0 must be >= 1"),
        ("loss.clip_epsilon=-0.2", r"loss.clip_epsilon=-0.2 must be > 0"),
        ("loss.clip_epsilon=wide", r"loss.clip_epsilon='wide': expected a number"),
    ],
)
def test_a_wrong_type_or_a_non_finite_number_is_refused(compose_config, tmp_path, nothing_loads, override, message):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], None),
        (["model.lora.r=8"], {"enabled": True, "r": 8, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}),
        (["model.lora.enabled=true"], {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0}),
        (["model.lora.r=8", "model.lora.enabled=false"], None),
        (["model.lora={r:4,alpha:8,dropout:0.0,target_modules:[q_proj]}"], {"enabled": True, "r": 4, "alpha": 8}),
        (["model.lora=null"], None),
    ],
)
def test_lora_turns_on_as_users_type_it(compose_config, tmp_path, overrides, expected):
    cfg = validate(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", *overrides]))
    lora = cfg.model.lora
    if expected is None:
        assert lora is None
    else:
        assert {key: lora[key] for key in expected} == expected


def test_the_config_is_resolved_once(compose_config, tmp_path, monkeypatch):
    """Every later reader (the logged config, the background collector) sees the values of the run's start."""
    monkeypatch.setenv("GRPO_SYSTEM_PROMPT", "Be brief.")
    cfg = compose_config(
        "grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", "rollout.system_prompt=${oc.env:GRPO_SYSTEM_PROMPT}"]
    )
    settled = validate(cfg)
    monkeypatch.setenv("GRPO_SYSTEM_PROMPT", "Ramble on.")
    assert settled.rollout.system_prompt == "Be brief."
    assert not OmegaConf.is_interpolation(settled, "output_dir") and settled.output_dir == str(tmp_path)


def test_a_resumed_run_keeps_its_own_settings(compose_config, tmp_path):
    """resume=true with the folder alone continues the run as configured (its group size, logger, step count), not
    with the YAML defaults; a setting given on the command line applies on top."""
    run = [*GRPO_SMALL, "train.steps=3", "checkpoint.every_n_steps=1", "logger=csv", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", [*run, "train.steps=2"]))
    assert [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0]

    summary = recipe.train(
        compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}", "train.steps=3"])
    )
    assert summary["train/steps"] == 3
    assert [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]  # logger=csv kept
    saved = OmegaConf.load(tmp_path / "resolved_config.yaml")
    assert saved.rollout.group_size == 2 and saved.train.steps == 3 and saved.logger.kind == "csv"
    (resume,) = [json.loads(line) for line in (tmp_path / "resumes.jsonl").read_text().splitlines()]
    assert resume["step"] == 2 and resume["changes"] == {}


def test_a_resume_below_the_checkpoint_or_without_the_run_config_is_refused(compose_config, tmp_path):
    run = [*GRPO_SMALL, "train.steps=2", "checkpoint.every_n_steps=1", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", run))
    with pytest.raises(ConfigError, match=r"train.steps=1 is below the step of the checkpoint to resume \(2"):
        validate(compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}", "train.steps=1"]))
    (tmp_path / "resolved_config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"resolved_config.yaml is missing: the run's settings cannot be restored"):
        validate(compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}"]))
