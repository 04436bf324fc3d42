"""Held-out evaluation during GRPO training (recipes/grpo/evaluation.py) and reward functions in whole runs: when the
policy is evaluated, on which prompts, that the same seed gives the same figures and that a resume keeps the
schedule; a run without a reward model; per-source figures in metrics.csv and summary.json."""

from __future__ import annotations

import json
import math

import _reward_functions
import pytest
from _small_runs import GRPO_SMALL, read_metrics
from omegaconf import OmegaConf

import recipes.grpo.rewards as rewards_module
import recipes.grpo_torchrl_rm as recipe
from recipes.common.config import ConfigError, RunStopped
from recipes.common.data import load_prompt_rows
from recipes.tasks import arithmetic

EVAL = ["eval.every_n_steps=2", "eval.group_size=2", "checkpoint.every_n_steps=2"]
REVIEW_EVAL = [*EVAL, "data.num_eval_prompts=4"]
EVAL_KEYS = ("eval/reward_mean", "eval/rewards/reward_model/mean", "eval/oracle_mean", "eval/response_length")


def _numbers(prompt: str) -> tuple[int, ...]:
    return tuple(int(word) for word in prompt.rstrip("?.").split() if word.isdigit())


def _eval_rows(run_dir) -> dict[int, dict]:
    return {int(row["step"]): row for row in read_metrics(run_dir) if "eval/reward_mean" in row}


def test_the_policy_is_evaluated_before_training_every_n_steps_and_at_the_end(compose_config, tmp_path):
    summary = recipe.train(
        compose_config("grpo_torchrl_rm", [*GRPO_SMALL, *REVIEW_EVAL, "train.steps=5", f"output_dir={tmp_path}"])
    )

    rows = _eval_rows(tmp_path)
    assert sorted(rows) == [0, 2, 4, 5]
    for row in rows.values():
        assert set(EVAL_KEYS) <= set(row)
        assert 1 <= row["eval/response_length"] <= 8 and -1.0 <= row["eval/oracle_mean"] <= 1.0
    # The step-0 row holds the evaluation alone; training rows hold no eval figure between evaluations.
    assert "train/loss" not in rows[0]
    assert [int(row["step"]) for row in read_metrics(tmp_path) if "train/loss" in row] == [1, 2, 3, 4, 5]
    assert summary["eval/reward_mean_first"] == pytest.approx(rows[0]["eval/reward_mean"])
    assert summary["eval/reward_mean_last"] == pytest.approx(rows[5]["eval/reward_mean"])
    # With eval on, the metric a sweep optimises is the held-out oracle.
    assert summary["eval/oracle_mean_last"] == pytest.approx(rows[5]["eval/oracle_mean"])


def test_same_seed_same_figures_and_a_resume_keeps_the_schedule(compose_config, tmp_path):
    """A 4-step run, and the same run stopped after 2 steps and resumed to 4: the same evaluations at 0 and 2 (same
    seed, same weights), and the resumed run evaluates at 4 without repeating 0."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    base = [*GRPO_SMALL, *REVIEW_EVAL]
    recipe.train(compose_config("grpo_torchrl_rm", [*base, "train.steps=4", f"output_dir={straight}"]))
    recipe.train(compose_config("grpo_torchrl_rm", [*base, "train.steps=2", f"output_dir={resumed}"]))
    summary = recipe.train(
        compose_config("grpo_torchrl_rm", [*base, "train.steps=4", f"output_dir={resumed}", "resume=true"])
    )

    straight_rows, resumed_rows = _eval_rows(straight), _eval_rows(resumed)
    assert sorted(straight_rows) == sorted(resumed_rows) == [0, 2, 4]
    for step in (0, 2):
        for key in EVAL_KEYS:
            assert resumed_rows[step][key] == straight_rows[step][key], (step, key)
    assert summary["eval/reward_mean_first"] == straight_rows[0]["eval/reward_mean"]
    assert summary["eval/reward_mean_last"] == pytest.approx(resumed_rows[4]["eval/reward_mean"])


def test_evaluation_reads_the_eval_split_only(compose_config, tmp_path):
    """A file's eval_path prompts (and their columns) reach the reward functions during evaluation, the training
    file's during training, and no prompt of one is in the other."""
    train = [{"prompt": f"Review the {p}.", "product": p} for p in ("phone", "lamp", "chair")]
    held_out = [{"prompt": f"What do you think of the {p}?", "product": p} for p in ("mug", "desk")]
    for name, rows in (("train", train), ("eval", held_out)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    _reward_functions.SEEN.clear()
    overrides = [
        *GRPO_SMALL,
        *EVAL,
        "train.steps=2",
        "data=file",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}",
        "eval.num_prompts=2",
        "+reward.functions.rows.function=_reward_functions.record_rows",
        f"output_dir={tmp_path / 'run'}",
    ]
    recipe.train(compose_config("grpo_torchrl_rm", overrides))

    seen = set(_reward_functions.SEEN)
    train_seen = {(row["prompt"], row["product"]) for row in train} & seen
    eval_seen = {(row["prompt"], row["product"]) for row in held_out} & seen
    assert eval_seen == {(row["prompt"], row["product"]) for row in held_out}  # every eval prompt, its own column
    assert train_seen and seen == train_seen | eval_seen  # nothing else, and rows never mixed


def test_the_arithmetic_tasks_eval_problems_are_never_training_problems():
    data = OmegaConf.create(
        {"source": "arithmetic", "num_train_prompts": 512, "num_eval_prompts": 64, "seed": 1, "oracle": None}
    )
    train, held_out = load_prompt_rows(data, "train"), load_prompt_rows(data, "eval")
    train_problems = {_numbers(prompt) for prompt in train.prompts}
    eval_problems = {_numbers(prompt) for prompt in held_out.prompts}
    assert train_problems and eval_problems and not train_problems & eval_problems
    assert all(arithmetic.is_held_out(*problem) for problem in eval_problems)
    assert [int(s) for s in held_out.columns["solution"]] == [sum(_numbers(p)) for p in held_out.prompts]


def test_evaluation_needs_an_eval_split_naming_the_key(compose_config, tmp_path, monkeypatch):
    monkeypatch.setattr(rewards_module, "load_reward_model", pytest.fail)
    cfg = compose_config(
        "grpo_torchrl_rm", [*GRPO_SMALL, "eval.every_n_steps=2", "data.num_eval_prompts=0", f"output_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match=r"eval.every_n_steps=2, but data=synthetic has no held-out prompts: set "):
        recipe.train(cfg)


def test_without_a_reward_model_none_loads_and_functions_score(compose_config, tmp_path, monkeypatch):
    """reward_model=none: no reward model is loaded (counted), the functions' weighted sum is the reward, and each
    source has its figures in metrics.csv and summary.json."""
    loads = []
    real_load = rewards_module.load_reward_model
    monkeypatch.setattr(rewards_module, "load_reward_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    overrides = [
        *[o for o in GRPO_SMALL if not o.startswith("reward_model=")],
        "reward_model=none",
        "train.steps=2",
        "+reward.functions.positive.function=_reward_functions.positivity_reward",
        "+reward.functions.positive.weight=2.0",
        "+reward.functions.rows.function=_reward_functions.record_rows",
        f"output_dir={tmp_path}",
    ]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))

    assert loads == []
    for row in read_metrics(tmp_path):
        assert row["rollout/reward_mean"] == pytest.approx(2.0 * row["rollout/rewards/positive/mean"], abs=1e-6)
        assert row["rollout/rewards/rows/mean"] == 0.0 and row["rollout/rewards/rows/std"] == 0.0
    for key in ("rollout/rewards/positive/mean", "rollout/rewards/rows/mean"):
        assert {f"{key}_first", f"{key}_last"} <= set(summary)


@pytest.mark.slow
def test_without_a_reward_model_a_positivity_function_teaches_the_review_task(compose_config, tmp_path, monkeypatch):
    """reward_model=none and a trl-style function alone: the default 30 steps raise the function's mean and the
    oracle's (the function is not the oracle: it counts positive words among all words, which a well-formed review
    keeps near 0.25, "the design looks excellent and the price feels perfect." 2 of 9, and a policy may also raise it
    with fragments the oracle scores low). Margins that hold on any seed: over seeds 0-4 the function's mean rose by
    0.27-0.34 and the oracle's by 0.29-1.02 (its last value 0.24-0.93), with the library sampler of 2026-12-03."""
    monkeypatch.setattr(rewards_module, "load_reward_model", pytest.fail)
    overrides = [
        "reward_model=none",
        "+reward.functions.positive.function=_reward_functions.positivity_reward",
        "progress_bar=false",
        f"output_dir={tmp_path}",
    ]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    assert summary["rollout/oracle_mean_last"] > summary["rollout/oracle_mean_first"] + 0.2
    assert summary["rollout/rewards/positive/mean_last"] > summary["rollout/rewards/positive/mean_first"] + 0.2


@pytest.mark.slow
def test_the_arithmetic_experiment_learns_the_held_out_sums(compose_config, tmp_path, monkeypatch):
    """experiment=arithmetic (seed 0): held-out accuracy from at most 0.5 before training to at least 0.9 after its
    30 steps, with no reward model loaded; the run's metric is that accuracy."""
    monkeypatch.setattr(rewards_module, "load_reward_model", pytest.fail)
    cfg = compose_config("grpo_torchrl_rm", ["experiment=arithmetic", "progress_bar=false", f"output_dir={tmp_path}"])
    summary = recipe.train(cfg)
    assert summary["eval/accuracy_first"] <= 0.5 and summary["eval/accuracy_last"] >= 0.9
    assert summary["eval/accuracy_last"] == summary["eval/rewards/exact_answer/mean_last"]
    assert sorted(_eval_rows(tmp_path)) == [0, 5, 10, 15, 20, 25, 30]


def test_an_eval_file_without_the_prompt_column_is_named_not_the_train_file(compose_config, tmp_path, monkeypatch):
    """The eval file's own path, before any model loads (the message named data.path, the training file)."""
    monkeypatch.setattr(rewards_module, "load_reward_model", pytest.fail)
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "Review the mug."}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"question": "Review the lamp."}) + "\n")
    overrides = [
        *GRPO_SMALL,
        *EVAL,
        "data=file",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}",
        f"output_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError) as error:
        recipe.train(compose_config("grpo_torchrl_rm", overrides))
    message = str(error.value)
    assert f"(file: {tmp_path / 'eval.jsonl'}, split eval) lacks column(s) ['prompt']" in message
    assert "train.jsonl" not in message and "Found columns: ['question']" in message


def test_a_function_that_scores_none_of_a_batch_logs_nan_and_the_run_goes_on(compose_config, tmp_path):
    """trl logs NaN for a reward function that returned None for a whole batch, and trains on; the step's reward is
    the other sources' (here the reward model's). It stopped the run with "Lower optimizer.lr"."""
    overrides = [
        *GRPO_SMALL,
        "train.steps=2",
        "+reward.functions.late.function=_reward_functions.unscored_at_the_first_step",
        f"output_dir={tmp_path}",
    ]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))

    first, second = read_metrics(tmp_path)
    assert math.isnan(first["rollout/rewards/late/mean"]) and math.isnan(first["rollout/rewards/late/std"])
    assert first["rollout/reward_mean"] == pytest.approx(first["rollout/rewards/reward_model/mean"], abs=1e-6)
    assert second["rollout/rewards/late/mean"] == 1.0
    assert math.isfinite(first["train/loss"]) and math.isfinite(second["train/loss"])
    assert summary["train/steps"] == 2 and summary["rollout/rewards/late/mean_last"] == 1.0


ARITHMETIC_SMALL = [
    "experiment=arithmetic",
    *GRPO_SMALL[1:],  # the experiment's reward_model=none
    "train.steps=1",
    "eval.every_n_steps=1",
    "eval.num_prompts=4",
    "eval.group_size=2",
]
# A 0/1 format check listed before the exact-answer check: the first 0/1 source was taken for the accuracy.
FORMAT_FIRST = [
    "~reward.functions.exact_answer",
    "+reward.functions.format.function=_reward_functions.always_well_formed",
    "+reward.functions.exact_answer.function=recipes.tasks.arithmetic.exact_answer_reward",
]


def test_eval_accuracy_is_the_named_source_not_the_first_0_1_one(compose_config, tmp_path):
    """experiment=arithmetic names its exact-answer check (eval.accuracy_source): a 0/1 format reward listed first no
    longer passes for the accuracy (it showed 1.0 while the answers were mostly wrong)."""
    overrides = [*ARITHMETIC_SMALL, *FORMAT_FIRST, f"output_dir={tmp_path}"]
    cfg = compose_config("grpo_torchrl_rm", overrides)
    assert list(cfg.reward.functions) == ["format", "exact_answer"] and cfg.metric == "eval/accuracy_last"
    summary = recipe.train(cfg)

    rows = _eval_rows(tmp_path)
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert row["eval/rewards/format/mean"] == 1.0
        assert row["eval/accuracy"] == row["eval/rewards/exact_answer/mean"] < 1.0
    assert summary["eval/accuracy_last"] == rows[1]["eval/accuracy"]


def test_several_sources_that_could_be_the_accuracy_must_be_named_before_anything_loads(
    compose_config, tmp_path, monkeypatch
):
    monkeypatch.setattr(recipe, "load_policy", pytest.fail)
    overrides = [*ARITHMETIC_SMALL, *FORMAT_FIRST, "eval.accuracy_source=null", f"output_dir={tmp_path}"]
    with pytest.raises(ConfigError) as error:
        recipe.train(compose_config("grpo_torchrl_rm", overrides))
    assert str(error.value).startswith(
        "eval.accuracy_source=null, but 2 reward sources could be the accuracy (['format', 'exact_answer'])"
    )
    assert str(error.value).endswith(
        "Name the one that checks the answer: eval.accuracy_source=format or eval.accuracy_source=exact_answer."
    )
    with pytest.raises(ConfigError, match=r"eval.accuracy_source=reward_model: the reward model's scores are not"):
        recipe.train(
            compose_config(
                "grpo_torchrl_rm",
                [*GRPO_SMALL, *REVIEW_EVAL, "eval.accuracy_source=reward_model", f"output_dir={tmp_path}"],
            )
        )


def test_a_named_accuracy_source_that_is_no_0_1_check_stops_at_the_first_evaluation(compose_config, tmp_path):
    overrides = [
        *GRPO_SMALL,
        *REVIEW_EVAL,
        "train.steps=1",
        "+reward.functions.positive.function=_reward_functions.positivity_reward",
        "eval.accuracy_source=positive",
        f"output_dir={tmp_path}",
    ]
    with pytest.raises(RunStopped, match=r"eval.accuracy_source=positive scored an eval answer .*no such check"):
        recipe.train(compose_config("grpo_torchrl_rm", overrides))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.fixture
def logged_samples(monkeypatch):
    """The sample rows every run logs (the wandb samples table's rows), by step."""
    from recipes.common.metrics import MetricLogger

    tables = {}
    monkeypatch.setattr(MetricLogger, "log_samples", lambda self, rows, step: tables.setdefault(step, rows))
    return tables


WORD_COUNTS = "+reward.functions.words.function=_reward_functions.counts_words"


def test_what_reward_functions_log_is_reported(compose_config, tmp_path, logged_samples, caplog):
    """trl's log_metric(name, value) -> rollout/<name> (eval/<name> for the eval answers) in metrics.csv and
    summary.json; log_extra(column, values) -> a column of the sample rows (the wandb table, the printed samples).
    They were accepted and dropped."""
    overrides = [*GRPO_SMALL, *REVIEW_EVAL, "train.steps=2", WORD_COUNTS, f"output_dir={tmp_path}"]
    with caplog.at_level("INFO", logger="recipes.grpo_torchrl_rm"):
        summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))

    rows = read_metrics(tmp_path)
    for row in rows:
        if "train/loss" in row:
            assert 1.0 <= row["rollout/words/mean"] <= 8.0
        if "eval/reward_mean" in row:
            assert 1.0 <= row["eval/words/mean"] <= 8.0
    assert summary["rollout/words/mean_last"] == pytest.approx(rows[-1]["rollout/words/mean"])
    assert summary["eval/words/mean_first"] == rows[0]["eval/words/mean"]
    assert sorted(logged_samples) == [1, 2]
    for samples in logged_samples.values():
        assert samples and all(sample["words"] == len(sample["response"].split()) for sample in samples)
    printed = [
        json.loads(record.getMessage().split("sample: ", 1)[1])
        for record in caplog.records
        if "sample: " in record.getMessage()
    ]
    assert printed and all(line["words"] == len(line["response"].split()) for line in printed)
    assert any(record.getMessage().startswith("Eval sample: ") for record in caplog.records)
