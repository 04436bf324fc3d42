"""recipes/grpo_torchrl_rm.py with tools: bad tools refused before a model loads, every tool failure answered, counted
in metrics.csv and summary.json while the run completes, the tool messages' tokens out of the loss (zero gradient)
while every turn's own tokens are in it, and one turn without calls trains exactly as a run without tools.

Two ways to get calls out of the shipped tiny policy, which knows no tools: scripted turns (the dialog sampler's turn
replaced by given texts: every kind of call, well-formed or not, on chosen rows), or a call format it writes all the
time (a "call" opens at "the" and closes at " and": malformed calls, answered with errors, in real sampled dialogs)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _small_runs import GRPO_SMALL, read_metrics

import interop.tools.dialog_policy as dialog_policy_module
import recipes.grpo_torchrl_rm as recipe
from interop.tools import ToolCallFormat
from interop.tools.dialogs import DialogSampler, _Turn
from recipes.common.config import ConfigError
from recipes.common.data import load_prompt_rows
from recipes.grpo.batch import ASSISTANT_MASK, ATTENTION_MASK, LOSS_MASK, PROMPT_TOKENS, REWARD, response_start
from recipes.grpo.collector import make_collector
from recipes.grpo.learner import make_learner, step_scale
from recipes.grpo.report import TOOL_SERIES

SMALL = [*GRPO_SMALL, "train.steps=2", "logger=csv"]
MULTIPLY = "+tools.multiply.function=_tool_functions.multiply"


def no_docstring(a: int) -> int:
    return a


NOT_CALLABLE = 42


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+tools.multiply.function=no_such_module.multiply"], r"tools\.multiply\.function=no_such_module"),
        ([f"+tools.NOT_CALLABLE.function={__name__}.NOT_CALLABLE"], r"tools\.NOT_CALLABLE\.function=.*not a function"),
        ([f"+tools.no_docstring.function={__name__}.no_docstring"], r"tools\.no_docstring\.function=.*docstring"),
        ([MULTIPLY, "tools.timeout_s=0"], r"tools\.timeout_s=0"),
        ([MULTIPLY, "rollout.max_turns=0"], r"rollout\.max_turns=0"),
        ([MULTIPLY, "rollout.env=chat"], r"tools with rollout\.env=chat: .*Use rollout\.env=prompt"),
    ],
)
def test_bad_tools_are_refused_before_any_model_loads(compose_config, tmp_path, nothing_loads, overrides, message):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", *overrides]))


# Turn 1 of row r is FIRST_TURNS[r % 5]; turn 2 answers.
_CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call><|im_end|>'
FIRST_TURNS = (
    _CALL.format("boom", '{"reason": "no luck"}'),  # raises
    _CALL.format("sleepy", '{"seconds": 30}'),  # runs past tools.timeout_s
    _CALL.format("long_text", '{"words": 300}'),  # a result longer than tools.max_result_tokens: cut, not an error
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 2,\n</tool_call><|im_end|>',  # bad JSON
    _CALL.format("multiply", '{"a": 6, "b": 7}'),  # answered
)
SECOND_TURN = "The answer is 42.<|im_end|>"
ERRORS_PER_FIVE_ROWS = 3  # boom, the timeout, the bad JSON


def _scripted_turns(self, contexts, dialogs, rows):
    turns = []
    for row in rows:
        text = FIRST_TURNS[row % 5] if dialogs.stats[row].turns == 0 else SECOND_TURN
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        turns.append(_Turn(ids, [-1.0] * len(ids), "eos"))
    return turns


def test_every_tool_failure_is_answered_counted_and_the_run_completes(compose_config, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(DialogSampler, "_sample_turn", _scripted_turns)
    tools = [f"+tools.{name}.function=_tool_functions.{name}" for name in ("boom", "sleepy", "long_text", "multiply")]
    overrides = [
        *SMALL,
        "rollout.responses_per_step=10",
        "train.mini_batch_size=5",
        "rollout.max_turns=2",
        "rollout.generation.max_new_tokens=160",
        "tools.timeout_s=0.5",
        "tools.max_result_tokens=40",
        "samples.print_count=10",
        # The held-out answers are dialogs too, their calls answered by the evaluation's own tool worker.
        "eval.every_n_steps=2",
        "eval.num_prompts=4",
        "eval.group_size=2",
        f"output_dir={tmp_path}",
        *tools,
    ]
    with caplog.at_level("INFO"):
        summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    rows = [row for row in read_metrics(tmp_path) if "rollout/turns" in row]  # eval-only rows have no rollout
    assert [row["step"] for row in rows] == [1.0, 2.0]
    assert summary["eval/response_length_last"] > 0
    eval_shown = [record.getMessage() for record in caplog.records if "Eval sample: " in record.getMessage()]
    assert eval_shown and all("[tool]" in line for line in eval_shown)
    for row in rows:
        assert row["rollout/tool_calls_per_dialog"] == 1.0
        assert row["rollout/turns"] == 2.0
        assert row["rollout/tool_errors"] == 2 * ERRORS_PER_FIVE_ROWS  # 10 rows: each failing call twice
        assert math.isfinite(row["train/loss"])
    saved = json.loads((tmp_path / "summary.json").read_text())
    for name in TOOL_SERIES:
        assert f"{name}_first" in saved and f"{name}_last" in saved and f"{name}_last" in summary
    # The samples show the whole dialog, the tool messages marked; the model read each failure's error text.
    shown = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Step ")]
    shown = [line for line in shown if " sample: " in line]
    assert shown and all("[tool]" in line and "[/tool]" in line for line in shown)
    dialogs = "\n".join(shown)
    assert "no luck" in dialogs and "timed out" in dialogs and "42" in dialogs and "word word" in dialogs


def _collected_batch(compose_config, tmp_path, overrides):
    """One step of a tool-using run built as the recipe builds it, prepared by its learner (advantages, loss mask,
    reference log-probs), with the learner."""
    cfg = recipe.validate(compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", *overrides]))
    models = recipe.load_models(cfg, resume_from=None)
    learner = make_learner(cfg, models)
    collector = make_collector(cfg, models, prompts=load_prompt_rows(cfg.data, "train"), start_step=0)
    try:
        torch.manual_seed(0)
        batch = next(iter(collector))
    finally:
        collector.shutdown()
    learner.prepare(batch)
    return cfg, learner, batch


class _Recording(torch.nn.Module):
    """The policy scorer, its log-probs and entropies kept with their gradients."""

    def __init__(self, scorer):
        super().__init__()
        self.scorer, self.outputs = scorer, None

    def forward(self, *args, **kwargs):
        log_probs, entropies = self.scorer(*args, **kwargs)
        log_probs.retain_grad()
        entropies.retain_grad()
        self.outputs = (log_probs, entropies)
        return log_probs, entropies


def test_tool_tokens_get_no_gradient_and_every_turns_tokens_do(compose_config, tmp_path, monkeypatch):
    """In the recipe's loss (policy term, KL to the reference, entropy bonus) the tool messages' tokens get a zero
    gradient, and every policy token of every turn of a row with an advantage gets one."""
    monkeypatch.setattr(dialog_policy_module, "ToolCallFormat", lambda: ToolCallFormat(open="the", close=" and"))
    overrides = [
        MULTIPLY,
        "rollout.group_size=4",
        "rollout.responses_per_step=16",
        "train.mini_batch_size=16",
        "rollout.generation.max_new_tokens=96",
        "tools.max_result_tokens=12",  # the parse errors, cut: room for the turns after them
        "rollout.max_turns=3",
        "loss.entropy_coeff=0.01",
    ]
    cfg, learner, batch = _collected_batch(compose_config, tmp_path, overrides)
    start = response_start(batch)
    attention = batch.get(ATTENTION_MASK)[:, start:]
    mine = batch.get(ASSISTANT_MASK)[:, start:] & attention
    tool = attention & ~mine
    assert tool.any(), "no tool message in the batch: the test exercises nothing"
    assert torch.equal(batch.get(LOSS_MASK), mine)  # the loss mask is the policy's own tokens

    recording = _Recording(learner.loss.scorer)
    learner.loss.scorer = recording
    out = learner.loss(batch, scale=step_scale(cfg, batch))
    out["loss"].backward()
    log_probs, entropies = recording.outputs
    grad, entropy_grad = log_probs.grad[:, start:], entropies.grad[:, start:]
    assert (grad[tool] == 0).all() and (entropy_grad[tool] == 0).all()
    rewards = batch.get(REWARD).reshape(-1, cfg.rollout.group_size)
    informative = (rewards.std(-1) > 0).repeat_interleave(cfg.rollout.group_size)
    multi_turn = informative & tool.any(-1)
    assert multi_turn.any(), "no row with an advantage and a tool message"
    assert (grad[informative][mine[informative]] != 0).all()
    assert (entropy_grad[mine] != 0).all()
    # A policy token after a tool message (a later turn's) is among those with a gradient.
    later = mine & (tool.long().cumsum(-1) > 0)
    assert (later & informative[:, None]).any()


def test_one_turn_without_calls_trains_as_a_run_without_tools(compose_config, tmp_path):
    """rollout.max_turns=1, and a policy that writes no call: the same samples, rewards and loss as without tools (the
    DialogPolicy's one turn is CausalLMSampler's loop on the same random stream; tests/interop/test_dialog_policy.py
    checks it token for token)."""
    base = [*SMALL, "train.steps=3"]
    recipe.train(compose_config("grpo_torchrl_rm", [*base, f"output_dir={tmp_path / 'plain'}"]))
    with_tools = [*base, MULTIPLY, "rollout.max_turns=1", f"output_dir={tmp_path / 'tools'}"]
    recipe.train(compose_config("grpo_torchrl_rm", with_tools))
    plain, tools = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "tools")
    for ours, theirs in zip(tools, plain, strict=True):
        assert ours["rollout/tool_calls_per_dialog"] == 0 and ours["rollout/turns"] == 1
        for key in ("rollout/reward_mean", "rollout/oracle_mean", "rollout/response_length", "train/loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (ours["step"], key)


def test_async_collection_with_tools_runs(compose_config, tmp_path):
    """The background collector builds its own DialogPolicy and tool runner in its process."""
    overrides = [*SMALL, MULTIPLY, "rollout.mode=async", "train.steps=3", f"output_dir={tmp_path}"]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1.0, 2.0, 3.0]
    assert all(row["rollout/turns"] >= 1 for row in rows)
    assert summary["rollout/turns_last"] >= 1
    assert PROMPT_TOKENS  # the batch layout the child sends is the sync one (checked in the sync tests)
