"""recipes/trl_grpo_torchrl_rollouts.py with tools: bad tools and trl's tool names are refused before any model loads,
naming the key; a run whose tools raise and overrun completes with them counted (rollout/tool_errors in metrics.csv
and the summary), its stored rows keep the env_mask and the tool counts, its samples mark the tool messages, and its
held-out evaluation logs eval/accuracy."""

from __future__ import annotations

import logging
from itertools import count

import pytest
from _processes import kill_recipe_run_when
from _small_runs import TRL_SMALL, read_metrics
from _tool_policy import build_tool_policy, inject_turns, tool_call

import recipes.trl_grpo_torchrl_rollouts as recipe
from recipes.common.config import ConfigError
from recipes.trl_grpo.rollout_store import load_rollouts

ARITHMETIC = [
    "reward_model=none",
    "data=arithmetic",
    "+reward.functions.exact.function=recipes.tasks.arithmetic.exact_answer_reward",
    "metric=rollout/reward_mean_last",
]
MULTIPLY = "+tools.multiply.function=recipes.tasks.calculator.multiply"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+tools.multiply.function=recipes.tasks.calculator.nope"], r"tools.multiply.function=.*cannot be loaded"),
        (["+tools.join.function=os.path.join"], r"tools.join.function=os.path.join: .*"),
        (["+tools.times.function=recipes.tasks.calculator.multiply"], r"rename the key to tools.multiply"),
        (["+tools.multiply=3"], r"tools.multiply: expected \{function: "),
        ([MULTIPLY, "tools.timeout_s=0"], r"tools.timeout_s=0 must be a finite number of seconds > 0"),
        (["+train.max_tool_calling_iterations=2"], r"train.max_tool_calling_iterations=2: .*set rollout.max_turns"),
        (["+train.tools=[a]"], r"train.tools: .*tools.<name>.function=<dotted path>"),
        ([MULTIPLY, "rollout.replay.enabled=true"], r"rollout.replay.enabled=true with tools: "),
        (
            ["+tools.python.torchrl._target_=torchrl.envs.llm.transforms.PythonInterpreter"],
            r"tools: a TorchRL piece here reads calls in its own format .* run the piece in the GRPO recipe",
        ),
        (["rollout.max_turns=0"], r"rollout.max_turns"),
        (["eval.every_n_steps=2"], r"eval.accuracy_source=null with 0 reward functions \(\[\]\): name the 0/1 check"),
        (
            [*ARITHMETIC, "eval.every_n_steps=2", "eval.accuracy_source=exakt"],
            r"'exakt' is not a reward.functions name",
        ),
    ],
)
def test_bad_tools_and_trl_tool_names_are_refused_before_any_model_loads(
    compose_config, tmp_path, monkeypatch, overrides, message
):
    loads = []
    monkeypatch.setattr(recipe, "load_causal_lm", lambda *args, **kwargs: loads.append(1))
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, f"output_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError, match=message):
        recipe.train(cfg)
    assert loads == []


def test_a_run_whose_tools_raise_and_overrun_completes_with_them_counted(compose_config, tmp_path, monkeypatch, caplog):
    model_dir = tmp_path / "policy"
    _, tokenizer = build_tool_policy(model_dir, ["What is 3 + 4?", "Tools: multiply boom sleepy", "The answer is 7."])
    calls = count()

    def turn(context: list[int]) -> str:
        text = tokenizer.decode(context)
        if "<tool_response>" in text:
            return "The answer is 7."
        # Every dialog calls a tool: most call one that raises, every eighth one that overruns tools.timeout_s.
        return tool_call("sleepy", '{"seconds": 30}') if next(calls) % 8 == 0 else tool_call("boom", '{"reason": "no"}')

    inject_turns(monkeypatch, tokenizer, turn)
    overrides = [
        *TRL_SMALL,
        *ARITHMETIC,
        f"output_dir={tmp_path / 'run'}",
        f"model.name_or_path={model_dir}",
        "rollout.generation.max_new_tokens=256",
        MULTIPLY,
        "+tools.boom.function=_tool_functions.boom",
        "+tools.sleepy.function=_tool_functions.sleepy",
        "tools.timeout_s=1",
        "rollout.max_turns=2",
        "eval.every_n_steps=3",
        "eval.num_prompts=4",
        "logger=csv",
    ]
    cfg = compose_config("trl_grpo_torchrl_rollouts", overrides)
    with caplog.at_level(logging.INFO):
        summary = recipe.train(cfg)
    assert summary["train/steps"] == 3
    rows = [row for row in read_metrics(tmp_path / "run") if "rollout/tool_errors" in row]
    assert [row["rollout/tool_errors"] for row in rows] == [8.0, 8.0, 8.0]  # every call failed, none crashed the run
    assert all(row["rollout/tool_calls_per_dialog"] == 1.0 and row["rollout/turns"] == 2.0 for row in rows)
    assert summary["rollout/tool_errors_last"] == 8.0 and summary["rollout/turns_first"] == 2.0
    # eval before the first step and at the last: every answer "7" to "What is a + b?" prompts.
    assert {"eval/accuracy_first", "eval/accuracy_last", "eval/tool_calls_per_dialog_last"} <= set(summary)
    assert summary["eval/tool_calls_per_dialog_last"] == 1.0
    stored = load_rollouts(tmp_path / "run" / "rollouts")
    assert stored.shape[0] == 24
    assert stored.get("tool_calls").tolist() == [1] * 24 and stored.get("tool_errors").tolist() == [1] * 24
    env_mask, lengths = stored.get("env_mask"), stored.get("completion_length")
    assert all(0 < int(env_mask[i, : lengths[i]].sum()) < int(lengths[i]) for i in range(24))
    assert int(env_mask.sum()) < int(lengths.sum())
    assert any("A dialog:" in record.message and "[tool]" in record.message for record in caplog.records)


@pytest.mark.slow
def test_dialogs_whose_tool_results_do_not_fit_are_counted_truncated_and_warned_of(
    compose_config, tmp_path, monkeypatch, caplog
):
    """The docs' key-by-key calculator command ran with the default max_completion_length of 32: no tool result fit,
    nothing trained, and rollout/frac_truncated read 0 (trl counts only completions without a final EOS, and a dialog
    whose result was left out ends on its call turn's EOS)."""
    model_dir = tmp_path / "policy"
    _, tokenizer = build_tool_policy(model_dir, ["What is 3 + 4?", "Tools: multiply", "The answer is 7."])
    call = tool_call("multiply", '{"a": 3, "b": 4}')
    inject_turns(monkeypatch, tokenizer, lambda context: call)
    budget = len(tokenizer.encode(call + tokenizer.eos_token, add_special_tokens=False)) + 2  # the call, no result
    overrides = [
        *TRL_SMALL,
        *ARITHMETIC,
        f"output_dir={tmp_path / 'run'}",
        f"model.name_or_path={model_dir}",
        f"rollout.generation.max_new_tokens={budget}",
        MULTIPLY,
        "rollout.max_turns=2",
        "logger=csv",
    ]
    with caplog.at_level(logging.INFO):
        summary = recipe.train(compose_config("trl_grpo_torchrl_rollouts", overrides))
    assert summary["rollout/frac_truncated_first"] == 1.0 and summary["rollout/frac_results_dropped_first"] == 1.0
    warnings = [r.message for r in caplog.records if "called a tool and none got its result back" in r.message]
    assert len(warnings) == 1 and f"rollout.generation.max_new_tokens={budget}" in warnings[0]


def test_a_tool_using_run_killed_after_its_checkpoint_resumes_with_its_dialogs_counted(compose_config, tmp_path):
    """experiment=calculator (tiny/calculator_policy calls the tool in about a third of its answers), killed by
    SIGKILL after its step-2 checkpoint and step 3's log: the resumed run trains steps 3-4 again, each step's rows are
    stored once with their env_mask and tool counts, metrics.csv has each training step once, and the summary's first
    figures (tool calls, evaluation) are the killed part's."""
    run_dir = tmp_path / "run"
    overrides = [
        "experiment=calculator",
        "train.max_steps=4",
        "train.per_device_train_batch_size=16",
        "rollout.group_size=4",
        "rollout.prompts_per_draw=8",
        "train.save_strategy=steps",
        "train.save_steps=2",
        "eval.every_n_steps=2",
        "eval.num_prompts=8",
        "logger=csv",
    ]

    def checkpoint_2_and_step_3_done() -> bool:
        checkpointed = (run_dir / "trainer" / "checkpoint-2").is_dir()
        metrics = run_dir / "metrics.csv"
        return checkpointed and metrics.exists() and any(row.get("step") == 3.0 for row in read_metrics(run_dir))

    run = [*overrides, f"hydra.run.dir={run_dir}"]  # in a process forked from this one (its imports done)
    kill_recipe_run_when("trl_grpo_torchrl_rollouts.py", run, ready=checkpoint_2_and_step_3_done, forked=True)
    killed = read_metrics(run_dir)
    first_eval = next(row for row in killed if "eval/accuracy" in row)
    first_step = next(row for row in killed if "rollout/tool_calls_per_dialog" in row)
    summary = recipe.train(
        compose_config("trl_grpo_torchrl_rollouts", [*overrides, f"output_dir={run_dir}", "resume=true"])
    )
    assert summary["train/steps"] == 4
    stored = load_rollouts(run_dir / "rollouts")
    assert sorted(stored["step"].tolist()) == [step for step in (1, 2, 3, 4) for _ in range(16)]
    assert (run_dir / "rollouts" / "rank_0" / "part_1").is_dir()
    assert int(stored["tool_calls"].sum()) > 0, "the policy called its tool"
    lengths, env_mask = stored["completion_length"], stored["env_mask"]
    # Tool tokens only in dialogs that called (a result that would not fit the budget is left out, as trl does).
    with_tool_tokens = [int(env_mask[i, : lengths[i]].sum()) < int(lengths[i]) for i in range(stored.shape[0])]
    assert any(with_tool_tokens)
    assert all(int(stored["tool_calls"][i]) > 0 for i, has in enumerate(with_tool_tokens) if has)
    steps = [row["step"] for row in read_metrics(run_dir) if "rollout/tool_calls_per_dialog" in row]
    assert steps == [1.0, 2.0, 3.0, 4.0]
    assert summary["rollout/tool_calls_per_dialog_first"] == pytest.approx(first_step["rollout/tool_calls_per_dialog"])
    assert summary["eval/accuracy_first"] == pytest.approx(first_eval["eval/accuracy"])


@pytest.mark.parametrize(
    "seed", [pytest.param(0, marks=pytest.mark.slow), *(pytest.param(seed, marks=pytest.mark.seeds) for seed in (1, 2))]
)
def test_experiment_calculator_learns_to_use_its_tool_on_every_seed_in_the_trl_recipe(compose_config, tmp_path, seed):
    """Held-out accuracy from <= 0.3 to >= 0.8 on seeds 0, 1 and 2, in 20 steps of the preset's 30 (its cosine
    schedule over 20; the whole preset's figures are in docs/trl_grpo_rollouts.md). Over seeds 0-4 at 1 torch thread:
    0.19 / 0.09 / 0.09 / 0.25 / 0.13 -> 0.94 / 0.91 / 0.98 / 0.94 / 0.92, the same at 2 (2026-12-06; at 15 steps
    seed 3 reached only 0.81; `python scripts/check_learning.py --only trl_calculator_20_steps`). CI runs seed 0
    (`pytest -m slow`); seeds 1 and 2 run with `pytest -m seeds` (README)."""
    overrides = ["experiment=calculator", "train.max_steps=20", f"seed={seed}", f"output_dir={tmp_path}"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", overrides)
    summary = recipe.train(cfg)
    assert summary["eval/accuracy_first"] <= 0.3, (seed, summary["eval/accuracy_first"])
    assert summary["eval/accuracy_last"] >= 0.8, (seed, summary["eval/accuracy_last"])
