"""interop.tools.torchrl_tools: TorchRL 0.14.1's tool pieces (ToolRegistry, ExecuteToolsInOrder with its parsers,
SimpleToolTransform, PythonInterpreter) as tools and call formats of the dialog sampler. A piece's call is answered in
a dialog (the tool message holds its result), Python code runs only where a PythonInterpreter is named, in a fresh
process per call, stopped at its timeout and counted, its exceptions answered as errors and counted."""

from __future__ import annotations

import os
import time

import pytest
from _torchrl_services import AddService, FailingService, shout
from test_dialogs import ScriptedDialogSampler
from torchrl.envs.llm.transforms import (
    ExecuteToolsInOrder,
    JSONCallParser,
    PythonInterpreter,
    SimpleToolTransform,
    ToolRegistry,
    XMLBlockParser,
)
from transformers import AutoTokenizer

from interop.sampling import SamplingSettings
from interop.tools import ToolCall, ToolCallFormat, ToolRunner, ToolSet
from interop.tools.torchrl_tools import (
    CombinedCallFormat,
    PythonBlockFormat,
    PythonCodeTool,
    ServiceTool,
    torchrl_tools,
)

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir / "calculator_policy")


def test_each_piece_brings_its_tools_and_call_format():
    registry = torchrl_tools(ToolRegistry([AddService()]))
    assert isinstance(registry.call_format, ToolCallFormat)  # what chat templates render
    tools = ToolSet(registry.tools)
    properties = tools.schemas[0]["function"]["parameters"]["properties"]
    assert properties == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert tools.check_call("add", {"a": 1, "b": "2"})[0] == "bad_arguments"

    xml = torchrl_tools(ExecuteToolsInOrder(ToolRegistry([AddService()]), XMLBlockParser()))
    turn = xml.call_format.parse('Adding.\n<tool name="add">{"a": 2, "b": 3}</tool>')
    assert (turn.content, turn.calls[0].name, turn.calls[0].arguments) == ("Adding.", "add", {"a": 2, "b": 3})
    assert xml.tools[0].pass_state  # ExecuteToolsInOrder passes _state={} to its services, and so does the adapter
    assert xml.tools[0](a=2, b=3) == {"result": 5}

    as_json = torchrl_tools(ExecuteToolsInOrder(ToolRegistry([AddService()]), JSONCallParser()))
    turn = as_json.call_format.parse('{"message": "Adding.", "tools": [{"tool": "add", "args": {"a": 1, "b": 1}}]}')
    assert (turn.content, turn.calls[0].arguments) == ("Adding.", {"a": 1, "b": 1})
    assert as_json.call_format.parse("no JSON here").calls == []

    simple = torchrl_tools(SimpleToolTransform(tools={"shout": shout}))
    turn = simple.call_format.parse('<tool>shout\n{"text": "hi"}</tool> and <tool>shout\n{"text": </tool>')
    assert [call.arguments for call in turn.calls] == [{"text": "hi"}, None]
    assert turn.calls[1].malformed  # bad JSON: answered with an error, counted
    assert ToolSet(simple.tools).schemas[0]["function"]["parameters"]["required"] == ["text"]

    python = torchrl_tools(PythonInterpreter(timeout=3.0))
    assert [tool.__name__ for tool in python.tools] == ["python"]
    turn = python.call_format.parse("Let me.\n```python\nprint(6 * 7)\n```\nDone.")
    assert (turn.content, turn.calls[0].arguments) == ("Let me.", {"code": "print(6 * 7)"})


@pytest.mark.parametrize("pattern", [r"<tool>(.*?)</tool>", r"<tool>.*?</tool>"])
def test_a_call_pattern_without_name_and_arguments_groups_is_refused_when_built(pattern):
    # Before, it was taken and every turn holding a call then raised a TypeError from inside parse().
    with pytest.raises(ValueError, match=r"PatternCallFormat: pattern .* captures \d group.*the tool's name then"):
        torchrl_tools(SimpleToolTransform(tools={"shout": shout}, tool_call_pattern=pattern))


def test_code_runs_only_where_a_python_interpreter_is_named():
    written = "Let me.\n```python\nimport os; os.remove('precious')\n```"
    assert ToolCallFormat().parse(written).calls == []  # Python function tools, or a registry: the block is text
    assert (
        torchrl_tools(ExecuteToolsInOrder(ToolRegistry([AddService()]), XMLBlockParser()))
        .call_format.parse(written)
        .calls
        == []
    )
    both = CombinedCallFormat((ToolCallFormat(), PythonBlockFormat()))
    assert [call.name for call in both.parse(written + '\n<tool_call>{"name": "add"}</tool_call>').calls] == [
        "add",
        "python",
    ]


@pytest.mark.parametrize(
    ("piece", "message"),
    [
        (PythonInterpreter(persistent=True), r"persistent=True.*one dialog's variables"),
        (object(), r"builtins\.object, not a TorchRL tool piece"),
        (ToolRegistry(), r"holds no service"),
    ],
)
def test_what_cannot_be_adapted_is_refused_with_the_reason(piece, message):
    with pytest.raises(ValueError, match=message):
        torchrl_tools(piece)


def test_torchrl_pieces_answer_calls_in_a_dialog_errors_and_timeouts_counted(tokenizer):
    """One dialog per case, a registry's service in XML blocks and Python code beside it: the tool messages hold the
    results; code that raises is answered with its traceback (raised), code past PythonInterpreter's timeout is
    stopped (timeout); the dialog goes on to its answer either way."""
    services = torchrl_tools(ExecuteToolsInOrder(ToolRegistry([AddService(), FailingService()]), XMLBlockParser()))
    python = torchrl_tools(PythonInterpreter(timeout=1.0))
    call_format = CombinedCallFormat((services.call_format, python.call_format))
    runner = ToolRunner([*services.tools, *python.tools], timeout_s=30.0, max_result_tokens=None)
    scripts = [
        ['<tool name="add">{"a": 2, "b": 3}</tool>' + END],
        ["```python\nprint(6 * 7)\n```" + END],
        ["```python\nraise ValueError('no luck')\n```" + END],
        ["```python\nimport time\ntime.sleep(30)\n```" + END],
        ['<tool name="fail">{"why": "down"}</tool>' + END],
    ]
    scripts = [[first, "Done." + END] for (first,) in scripts]
    with runner:
        sampler = ScriptedDialogSampler(
            tokenizer,
            runner,
            scripts=scripts,
            settings=SamplingSettings(max_new_tokens=64),
            max_turns=3,
            call_format=call_format,
            stop_at_call_end=False,
        )
        start = time.perf_counter()
        dialogs = sampler.sample_prompts(["Go."] * len(scripts))
        took = time.perf_counter() - start
    tool_messages = [[m["content"] for m in messages if m["role"] == "tool"] for messages in dialogs.messages]
    assert tool_messages[0] == ["{'result': 5}"]
    assert tool_messages[1] == ["42\n"]
    assert "ValueError: no luck" in tool_messages[2][0] and tool_messages[2][0].startswith("{'error': ")
    assert "ran past 1 s" in tool_messages[3][0]
    assert tool_messages[4] == ["{'error': 'down'}"]
    errors = [dict(stats.tools.errors) for stats in dialogs.stats]
    assert errors == [{}, {}, {"raised": 1}, {"timeout": 1}, {"raised": 1}]
    assert [stats.ended for stats in dialogs.stats] == ["answer"] * 5
    assert all(0 in mask for mask in dialogs.model_mask)  # the tool messages' tokens, out of the loss
    assert took < 25  # the 30 s sleep was stopped at PythonInterpreter's 1 s, not waited for


@pytest.mark.slow
def test_a_call_past_the_runner_timeout_ends_the_code_s_process_too(tmp_path):
    """tools.timeout_s below PythonInterpreter's own: the worker is killed with its process group, so the Python
    process running the code ends too (it would otherwise sleep on as an orphan)."""
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    with ToolRunner([PythonCodeTool(timeout_s=60.0)], timeout_s=15.0, max_result_tokens=None) as runner:
        runner.run_one(ToolCall("python", {"code": "print(1)"}, ""))  # the worker started (torchrl imported)
        runner.timeout_s = 2.0
        result = runner.run_one(ToolCall("python", {"code": code}, ""))
    assert result.error == "timeout"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the code's process {pid} outlived its call's timeout")


def test_a_service_tool_refuses_a_nameless_service():
    class Nameless:
        def __call__(self, **kwargs):
            return {}

    with pytest.raises(ValueError, match="ServiceTool: Nameless has no name"):
        ServiceTool(Nameless())
