"""recipes/grpo_torchrl_rm.py with TorchRL's tool pieces (``tools.<label>.torchrl``): bad pieces refused before a model
loads, naming the key; rollout.env=chat with tools refused with the route that works; a short run with a
PythonInterpreter answers the code the policy writes (in a fresh process, its errors and timeouts counted) and writes
the tool metrics, the tool messages out of the loss.

The shipped tiny policy writes no code: its turns are scripted (the dialog sampler's turn replaced by given texts)."""

from __future__ import annotations

import pytest
import torch
from _small_runs import GRPO_SMALL, read_metrics

import recipes.grpo_torchrl_rm as recipe
from interop.tools.dialogs import DialogSampler, _Turn
from recipes.common.config import ConfigError
from recipes.common.data import load_prompt_rows
from recipes.grpo.batch import ASSISTANT_MASK, ATTENTION_MASK, LOSS_MASK, response_start
from recipes.grpo.collector import make_collector
from recipes.grpo.learner import make_learner
from recipes.grpo.report import TOOL_SERIES

SMALL = [*GRPO_SMALL, "train.steps=2", "logger=csv"]
TRANSFORMS = "torchrl.envs.llm.transforms"
PYTHON = [f"+tools.python.torchrl._target_={TRANSFORMS}.PythonInterpreter", "+tools.python.torchrl.timeout=1"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+tools.py.torchrl._target_=no_such_module.Interpreter"], r"tools\.py\.torchrl\._target_=no_such_module"),
        (["+tools.od.torchrl._target_=collections.OrderedDict"], r"tools\.od\.torchrl.*not a TorchRL tool piece"),
        ([*PYTHON, "+tools.python.torchrl.persistent=true"], r"tools\.python\.torchrl.*persistent=True"),
        ([f"+tools.pool.torchrl._target_={TRANSFORMS}.PythonExecutorService"], r"tools\.pool\.torchrl.*persistent"),
        (
            [f"+tools.mcp.torchrl._target_={TRANSFORMS}.MCPToolTransform"],
            r"tools\.mcp\.torchrl.*not built here.*tools\.<label>\.mcp\.servers",
        ),
        (["+tools.python.torchrl=PythonInterpreter"], r"tools\.python\.torchrl: expected a \{_target_"),
        ([*PYTHON, "+tools.python.function=x.y"], r"tools\.python: unknown key\(s\) \['torchrl'\]"),
        ([*PYTHON, "rollout.env=chat"], r"rollout\.env=chat.*'<none>'.*Use rollout\.env=prompt.*torchrl"),
    ],
)
def test_bad_torchrl_tools_are_refused_before_any_model_loads(
    compose_config, tmp_path, nothing_loads, overrides, message
):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", *overrides]))


# Row r's first turn is FIRST_TURNS[r % 4]; its second answers.
FIRST_TURNS = (
    "```python\nprint(6 * 7)\n```<|im_end|>",  # answered: 42
    "```python\nraise ValueError('no luck')\n```<|im_end|>",  # raised: its traceback is the answer
    "```python\nimport time\ntime.sleep(30)\n```<|im_end|>",  # past PythonInterpreter's timeout (1 s): stopped
    "The answer is 42.<|im_end|>",  # no code: nothing runs
)


def _scripted_turns(self, contexts, dialogs, rows):
    turns = []
    for row in rows:
        text = FIRST_TURNS[row % 4] if dialogs.stats[row].turns == 0 else "The answer is 42.<|im_end|>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        turns.append(_Turn(ids, [-1.0] * len(ids), "eos"))
    return turns


# Results cut at 40 tokens: a traceback fits the 160-token completion, and the dialog goes on to its answer.
SCRIPTED = [
    *SMALL,
    *PYTHON,
    "rollout.max_turns=2",
    "rollout.generation.max_new_tokens=160",
    "tools.max_result_tokens=40",
]


def test_a_run_with_a_python_interpreter_answers_the_code_and_writes_the_tool_metrics(
    compose_config, tmp_path, monkeypatch
):
    monkeypatch.setattr(DialogSampler, "_sample_turn", _scripted_turns)
    summary = recipe.train(compose_config("grpo_torchrl_rm", [*SCRIPTED, f"output_dir={tmp_path}"]))
    rows = [row for row in read_metrics(tmp_path) if "rollout/turns" in row]
    assert [row["step"] for row in rows] == [1.0, 2.0]
    for row in rows:  # 4 dialogs a step, one per script
        assert row["rollout/tool_calls_per_dialog"] == 0.75
        assert row["rollout/tool_errors"] == 2  # the exception and the timeout
        assert row["rollout/turns"] == 1.75
    for name in TOOL_SERIES:
        assert f"{name}_last" in summary


@pytest.mark.slow
def test_the_code_s_output_is_out_of_the_loss(compose_config, tmp_path, monkeypatch):
    monkeypatch.setattr(DialogSampler, "_sample_turn", _scripted_turns)
    cfg = recipe.validate(compose_config("grpo_torchrl_rm", [*SCRIPTED, f"output_dir={tmp_path}"]))
    models = recipe.load_models(cfg, resume_from=None)
    learner = make_learner(cfg, models)
    collector = make_collector(cfg, models, prompts=load_prompt_rows(cfg.data, "train"), start_step=0)
    try:
        batch = next(iter(collector))
    finally:
        collector.shutdown()
    learner.prepare(batch)
    start = response_start(batch)
    attention = batch.get(ATTENTION_MASK)[:, start:]
    mine = batch.get(ASSISTANT_MASK)[:, start:] & attention
    tool = attention & ~mine
    assert tool[:3].any(-1).all() and not tool[3].any()  # the three rows that wrote code got a tool message
    assert torch.equal(batch.get(LOSS_MASK), mine)
