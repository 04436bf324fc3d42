"""recipes/trl_grpo/resume.py through the trl-rollouts recipe: a resume trains as the run it continues (its
resolved_config.yaml under the command line; changes refused unless allowed, recorded; a masked secret given again),
a finished run has nothing to resume, a run stopped after its checkpoint resumes with the whole run's summary, a copied
run folder resumes as itself. In-process runs of a few seconds (the SIGKILL resume is in
tests/recipes/test_trl_grpo_torchrl_rollouts.py, slow)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from _shared_runs import shared_run
from _small_runs import TRL_SMALL, read_metrics
from omegaconf import OmegaConf

import recipes.trl_grpo_torchrl_rollouts as recipe
from recipes.common.config import ConfigError
from recipes.trl_grpo.checks import validate
from recipes.trl_grpo.rollout_store import load_rollouts

SAVED = [*TRL_SMALL, "train.save_strategy=steps", "train.save_steps=1", "logger=csv"]


def _run(compose_config, run_dir, overrides):
    return recipe.train(compose_config("trl_grpo_torchrl_rollouts", [*overrides, f"output_dir={run_dir}"]))


def _two_saved_steps(shared_runs, compose_config) -> Path:
    """The folder of a 2-step run saved at each step (``SAVED``, ``train.max_steps=2``), made once per session: four
    tests resume such a run (about 1 s of a 2.3 s test here), each its own copy of it. Never written to."""

    def make(folder: Path) -> None:
        _run(compose_config, folder, [*SAVED, "train.max_steps=2"])

    return shared_run(shared_runs, "trl_two_saved_steps", make)


def _capture_trainer_args(monkeypatch) -> list:
    made = []
    make_trainer = recipe.make_trainer

    def recorded(model, tokenizer, args, *rest, **kwargs):
        made.append(args)
        return make_trainer(model, tokenizer, args, *rest, **kwargs)

    monkeypatch.setattr(recipe, "make_trainer", recorded)
    return made


def test_a_finished_run_has_nothing_to_resume(compose_config, tmp_path, monkeypatch, caplog):
    """Resumed from its last checkpoint (step 3 of 3), trl would train a 4th step and overwrite model/ and
    summary.json: the recipe returns the finished run's summary instead, and trains nothing."""
    finished = _run(compose_config, tmp_path, SAVED)
    before = {name: (tmp_path / name).stat().st_mtime_ns for name in ("summary.json", "model", "metrics.csv")}
    monkeypatch.setattr(recipe, "make_trainer", lambda *args, **kwargs: pytest.fail("a finished run trained again"))
    with caplog.at_level(logging.INFO):
        summary = _run(compose_config, tmp_path, [*SAVED, "resume=true"])
    assert summary == json.loads((tmp_path / "summary.json").read_text()) and summary["train/steps"] == 3
    assert summary["rollout/reward_mean_last"] == finished["rollout/reward_mean_last"]
    assert "already finished its 3 steps: nothing to resume" in caplog.text
    assert before == {name: (tmp_path / name).stat().st_mtime_ns for name in before}
    assert not (tmp_path / "trainer" / "checkpoint-4").exists()


def test_a_resume_trains_with_the_runs_own_settings_not_the_yaml_defaults(compose_config, tmp_path, monkeypatch):
    """Resumed with only train.max_steps on the command line, the run keeps its loss, beta and learning rate (the
    YAML's are dapo, 0.2 and 2e-3), its resolved_config.yaml keeps them, and resumes.jsonl records the resume."""
    own = ["train.loss_type=grpo", "train.beta=0.0", "train.learning_rate=1e-4", "train.max_steps=2"]
    _run(compose_config, tmp_path, [*SAVED, *own])
    made = _capture_trainer_args(monkeypatch)

    summary = _run(compose_config, tmp_path, ["resume=true", "train.max_steps=3"])

    args = made[0]
    assert (args.loss_type, args.beta, args.learning_rate, args.per_device_train_batch_size) == ("grpo", 0.0, 1e-4, 8)
    assert summary["train/steps"] == 3 and "train/kl_to_ref_last" not in summary  # beta 0: trl logs no KL
    saved = OmegaConf.load(tmp_path / "resolved_config.yaml")
    assert (saved.train.loss_type, saved.train.beta, saved.train.learning_rate) == ("grpo", 0.0, 1e-4)
    assert saved.train.max_steps == 3
    lines = (tmp_path / "resumes.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 2 and json.loads(lines[0])["changes"] == {}
    assert [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]


def test_a_run_started_with_overwrite_resumes(compose_config, tmp_path):
    """overwrite=true said what to do with the folder at the start; the resume's command line says resume=true only."""
    _run(compose_config, tmp_path, [*SAVED, "train.max_steps=2", "overwrite=true"])
    summary = _run(compose_config, tmp_path, ["resume=true", "train.max_steps=3"])
    assert summary["train/steps"] == 3 and [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]
    assert OmegaConf.load(tmp_path / "resolved_config.yaml").overwrite is False


def test_a_resume_through_a_linked_rollouts_folder_is_refused(compose_config, tmp_path, shared_runs):
    """The run's rollouts/ moved elsewhere and linked back: a resume would write its new rows into the linked storage
    (another run's); it is refused, and that storage keeps its rows."""
    run, elsewhere = tmp_path / "run", tmp_path / "other_run" / "rollouts"
    shutil.copytree(_two_saved_steps(shared_runs, compose_config), run)
    elsewhere.parent.mkdir()
    shutil.move(run / "rollouts", elsewhere)
    (run / "rollouts").symlink_to(elsewhere, target_is_directory=True)
    rows = load_rollouts(elsewhere).shape[0]
    with pytest.raises(ConfigError, match=rf"{run}/rollouts is a link to {elsewhere}: the resumed run would write"):
        _run(compose_config, run, ["resume=true", "train.max_steps=3"])
    assert load_rollouts(elsewhere).shape[0] == rows and len(list(elsewhere.glob("rank_0/part_*"))) == 1


def test_a_changed_setting_is_refused_unless_named_and_then_applied_and_recorded(
    compose_config, tmp_path, monkeypatch, shared_runs
):
    run = tmp_path / "run"
    shutil.copytree(_two_saved_steps(shared_runs, compose_config), run)
    with pytest.raises(
        ConfigError,
        match=r"differ from the run being continued \(train.learning_rate: 0.002 -> 0.0005\).*"
        r"resume_allow_changes=\[train.learning_rate\]",
    ):
        _run(compose_config, run, ["resume=true", "train.max_steps=3", "train.learning_rate=5e-4"])
    made = _capture_trainer_args(monkeypatch)

    allowed = ["train.learning_rate=5e-4", "resume_allow_changes=[train.learning_rate]"]
    _run(compose_config, run, ["resume=true", "train.max_steps=3", *allowed])

    assert made[0].learning_rate == 5e-4
    recorded = json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])
    assert recorded["step"] == 2 and recorded["changes"] == {"train.learning_rate": [0.002, 0.0005]}


def test_a_change_allowed_to_one_resume_is_not_allowed_to_the_next(compose_config, tmp_path, shared_runs):
    """resume_allow_changes is the resume's own: kept in resolved_config.yaml, it let a later resume change the
    learning rate again without naming it."""
    run = tmp_path / "run"
    shutil.copytree(_two_saved_steps(shared_runs, compose_config), run)
    allowed = ["train.learning_rate=5e-4", "resume_allow_changes=[train.learning_rate]"]
    _run(compose_config, run, ["resume=true", "train.max_steps=3", *allowed])
    assert list(OmegaConf.load(run / "resolved_config.yaml").resume_allow_changes) == []
    with pytest.raises(ConfigError, match=r"train.learning_rate: 0.0005 -> 0.0001\).*resume_allow_changes="):
        _run(compose_config, run, ["resume=true", "train.max_steps=4", "train.learning_rate=1e-4"])


def test_a_changed_reward_function_is_refused_and_other_sources_even_when_allowed(compose_config, tmp_path):
    """Another function under the same name is a change to name; another set of sources would leave the store with
    parts no reader can put in one table, so it is refused even when allowed."""
    functions = ["reward_model=none", "+reward.functions.pos.function=_reward_functions.positivity_reward"]
    _run(compose_config, tmp_path, [*SAVED, *functions, "train.max_steps=2"])
    changed = ["resume=true", "train.max_steps=3", "+reward.functions.pos.function=_reward_functions.length_reward"]
    with pytest.raises(ConfigError, match=r"reward.functions.pos.function: '_reward_functions.positivity_reward' ->"):
        _run(compose_config, tmp_path, changed)
    added = [
        "resume=true",
        "train.max_steps=3",
        "+reward.functions.len.function=_reward_functions.length_reward",
        "resume_allow_changes=[reward.functions]",
    ]
    with pytest.raises(ConfigError, match=r"reward sources \['pos', 'len'\], but the run's stored rollouts .* were "):
        _run(compose_config, tmp_path, added)
    assert not (tmp_path / "resumes.jsonl").exists()


def test_a_masked_secret_is_refused_on_resume_unless_given_again(compose_config, tmp_path, monkeypatch):
    """resolved_config.yaml keeps <HUB_TOKEN>, never the token: a resume would otherwise hand that text to the hub."""
    monkeypatch.delenv("HF_TOKEN", raising=False)  # the run hands its token there; monkeypatch restores it after
    _run(compose_config, tmp_path, [*SAVED, "train.max_steps=2", "+train.hub_token=hf_secret"])
    assert "<HUB_TOKEN>" in (tmp_path / "resolved_config.yaml").read_text()
    resume = ["resume=true", "train.max_steps=3", f"output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"train.hub_token is masked in .*resolved_config.yaml \(<HUB_TOKEN>"):
        validate(compose_config("trl_grpo_torchrl_rollouts", resume))
    cfg = validate(compose_config("trl_grpo_torchrl_rollouts", [*resume, "+train.hub_token=hf_secret"]))
    assert cfg.train["hub_token"] == "hf_secret"  # train: is trl's, a plain mapping in the typed settings


def test_a_run_stopped_after_its_checkpoint_resumes_with_the_whole_runs_summary(compose_config, tmp_path):
    """Stopped after step 3 was logged and stored but before its checkpoint (checkpoint-2 is the newest): the resume
    trains step 3 again; metrics.csv holds each step once, the summary's first figures are the first part's, and its
    rows count every part's (step 3 once)."""
    first = _run(compose_config, tmp_path, [*TRL_SMALL, "train.save_strategy=steps", "train.save_steps=2"])
    shutil.rmtree(tmp_path / "trainer" / "checkpoint-3")
    shutil.rmtree(tmp_path / "model")
    (tmp_path / "summary.json").unlink()

    saved_every_2 = [*TRL_SMALL, "train.save_strategy=steps", "train.save_steps=2"]
    summary = _run(compose_config, tmp_path, [*saved_every_2, "resume=true"])

    assert [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]
    for name in ("rollout/reward_mean_first", "rollout/oracle_mean_first", "train/loss_first"):
        assert summary[name] == first[name], name
    assert summary["train/steps"] == 3
    assert summary["rollouts/rows"] == 24 == load_rollouts(tmp_path / "rollouts").shape[0]
    assert (tmp_path / "rollouts" / "rank_0" / "part_1").is_dir()
    assert summary["rollout/generated_tokens"] > first["rollout/generated_tokens"]  # step 3 was generated twice


def test_a_copied_run_folder_resumes_as_itself_and_leaves_the_original_alone(compose_config, tmp_path, shared_runs):
    original, copy = _two_saved_steps(shared_runs, compose_config), tmp_path / "copy"
    shutil.copytree(original, copy)

    summary = _run(compose_config, copy, ["resume=true", "train.max_steps=3"])

    assert summary["train/steps"] == 3 and (copy / "trainer" / "checkpoint-3").is_dir()
    assert not (original / "trainer" / "checkpoint-3").exists()
    assert OmegaConf.load(copy / "resolved_config.yaml").train.output_dir == str(copy / "trainer")
