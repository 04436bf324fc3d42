"""interop.tools: tools as trl takes them (schemas, refusals), tool calls parsed from text, and a worker process that
answers every call (results, errors by kind, timeouts, cut results), kept across calls (that it dies with its parent,
and what its tools started with it: tests/interop/test_tool_processes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from _tool_functions import (
    bad_text,
    boom,
    count_calls,
    die,
    long_text,
    multiply,
    pick,
    sleepy,
    slow_echo,
    worker_pid,
)
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from interop.tools import ToolCall, ToolCallFormat, ToolResult, ToolRunner, ToolSet, ToolStats, error_content

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS_DIR = os.path.join(REPO_ROOT, "tests")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped is a zombie: gone for our purposes.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir / "policy")


# --- ToolSet -------------------------------------------------------------------------------------------------------


def test_schemas_are_get_json_schemas_and_render_as_trl_renders_the_functions(tokenizer):
    tools = ToolSet([multiply, pick])
    assert tools.names == ["multiply", "pick"]
    assert tools.schemas == [get_json_schema(multiply), get_json_schema(pick)]
    template = "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ messages[0]['content'] }}"
    messages = [{"role": "user", "content": "hi"}]
    as_functions = tokenizer.apply_chat_template(
        messages, tools=[multiply, pick], chat_template=template, tokenize=False
    )
    as_schemas = tokenizer.apply_chat_template(messages, tools=tools.schemas, chat_template=template, tokenize=False)
    assert as_functions == as_schemas


def _no_docstring(a: int) -> int:
    return a


def _no_hints(a, b: int) -> int:
    """Adds.

    Args:
        a: one.
        b: two.
    """
    return a + b


def _undocumented_argument(a: int, b: int) -> int:
    """Adds.

    Args:
        a: one.
    """
    return a + b


@pytest.mark.parametrize(
    ("tool", "words"),
    [
        (42, ["tool 0", "int", "not callable"]),
        (_no_docstring, ["'_no_docstring'", "no docstring", "Args:"]),
        (_no_hints, ["'_no_hints'", "no type hint", "['a']"]),
        (_undocumented_argument, ["'_undocumented_argument'", "no description for the argument 'b'"]),
    ],
)
def test_a_tool_trl_could_not_render_is_refused_by_name(tool, words):
    with pytest.raises(ValueError) as error:
        ToolSet([multiply, tool] if not isinstance(tool, int) else [tool])
    for word in words:
        assert word in str(error.value)


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        ToolSet([multiply, multiply])


@pytest.mark.parametrize(
    ("name", "arguments", "kind", "words"),
    [
        ("divide", {"a": 1}, "unknown_tool", "Tool divide not found."),
        ("multiply", {"a": 1, "c": 2}, "bad_arguments", "unexpected argument(s) ['c']"),
        ("multiply", {"a": 1}, "bad_arguments", "missing argument(s) ['b']"),
        ("multiply", {"a": 1, "b": "2"}, "bad_arguments", "argument 'b' must be integer, got str '2'"),
        ("multiply", {"a": 1.5, "b": 2}, "bad_arguments", "argument 'a' must be integer, got float 1.5"),
        ("multiply", {"a": True, "b": 2}, "bad_arguments", "argument 'a' must be integer, got bool True"),
        ("multiply", [1, 2], "bad_arguments", "must be a JSON object, got [1, 2]"),
        ("pick", {"kind": "milk", "sizes": [1]}, "bad_arguments", "must be one of ['tea', 'coffee']"),
        ("pick", {"kind": "tea", "sizes": [1, "2"]}, "bad_arguments", "argument 'sizes' item 1 must be integer"),
    ],
)
def test_calls_that_do_not_fit_the_schema_are_named(name, arguments, kind, words):
    found_kind, message = ToolSet([multiply, pick]).check_call(name, arguments)
    assert found_kind == kind and words in message


def test_calls_that_fit_the_schema_pass():
    tools = ToolSet([multiply, pick])
    assert tools.check_call("multiply", {"a": 3, "b": -4}) is None
    assert tools.check_call("pick", {"kind": "tea", "sizes": [1, 2], "note": None}) is None
    assert tools.check_call("pick", {"kind": "coffee", "sizes": [], "note": "hot"}) is None


# --- ToolCallFormat ------------------------------------------------------------------------------------------------


def test_parse_reads_each_call_and_the_text_before_them():
    text = (
        'Let me see.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "pick", "arguments": "{\\"kind\\": \\"tea\\"}"}\n</tool_call>'
    )
    turn = ToolCallFormat().parse(text)
    assert turn.content == "Let me see."
    assert [(call.name, call.arguments) for call in turn.calls] == [
        ("multiply", {"a": 2, "b": 3}),
        ("pick", {"kind": "tea"}),  # arguments written as a JSON string
    ]
    assert ToolCallFormat().parse("The answer is 6.").calls == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('{"name": "multiply", "arguments": {"a": 2,}}', "not valid JSON"),
        ('["multiply", 2, 3]', "a JSON list, not an object"),
        ('{"arguments": {"a": 2}}', 'no "name" string'),
        ('{"name": "multiply", "arguments": [2, 3]}', '"arguments" is not a JSON object'),
    ],
)
def test_a_malformed_call_says_why(body, words):
    (call,) = ToolCallFormat().parse(f"<tool_call>\n{body}\n</tool_call>").calls
    assert call.malformed and words in call.error


def test_an_unclosed_call_is_malformed_and_markers_are_parameters():
    (call,) = ToolCallFormat().parse('<tool_call>{"name": "multiply"').calls
    assert call.malformed and "no closing </tool_call>" in call.error
    (call,) = ToolCallFormat("[CALL]", "[/CALL]").parse('x [CALL]{"name": "f", "arguments": {}}[/CALL]').calls
    assert (call.name, call.arguments, call.error) == ("f", {}, None)


# --- ToolRunner ----------------------------------------------------------------------------------------------------


def test_results_and_every_kind_of_failure_are_answered_and_counted(tokenizer):
    tools = [multiply, boom, sleepy, long_text, pick, slow_echo]
    calls = [
        ToolCall("multiply", {"a": 12, "b": 34}, ""),
        ToolCall("boom", {"reason": "no such thing"}, ""),
        ToolCall("divide", {"a": 1}, ""),
        ToolCall("multiply", {"a": "12", "b": 34}, ""),
        ToolCall(None, None, "<tool_call>{</tool_call>", "the call is not valid JSON"),
        ToolCall("long_text", {"words": 5000}, ""),
        ToolCall("slow_echo", {"text": "async"}, ""),
        ToolCall("sleepy", {"seconds": 60.0}, ""),
        ToolCall("multiply", {"a": 2, "b": 3}, ""),  # after the timeout: a fresh worker
    ]
    with ToolRunner(tools, timeout_s=2.0, max_result_tokens=100, tokenizer=tokenizer) as runner:
        results = runner.run(calls)
        assert runner.restarts == 1  # the call after the timeout started a new worker
    contents = [result.content for result in results]
    assert contents[0] == "408" and contents[8] == "6" and contents[6] == "async"
    assert contents[1] == "{'error': 'no such thing'}"  # trl's form: str({"error": str(exception)})
    assert contents[2] == "{'error': 'Tool divide not found.'}"  # and trl's words for an unknown tool
    assert contents[3] == error_content("multiply: argument 'a' must be integer, got str '12'.")
    assert contents[4] == error_content("Malformed tool call: the call is not valid JSON")
    assert contents[7] == error_content("sleepy timed out after 2 s.")
    assert [result.error for result in results] == [
        None, "raised", "unknown_tool", "bad_arguments", "malformed", None, None, "timeout", None,
    ]  # fmt: skip
    assert results[5].cut and len(tokenizer(contents[5], add_special_tokens=False)["input_ids"]) == 100
    assert contents[5].startswith("word word")
    assert results[7].seconds >= 2.0
    stats = ToolStats()
    for result in results:
        stats.record(result)
    assert (stats.calls, stats.failures, stats.timeouts, stats.cut_results) == (9, 5, 1, 1)
    assert stats.as_metrics() == {
        "tools/calls": 9,
        "tools/failures": 5,
        "tools/cut_results": 1,
        "tools/errors/bad_arguments": 1,
        "tools/errors/malformed": 1,
        "tools/errors/raised": 1,
        "tools/errors/timeout": 1,
        "tools/errors/unknown_tool": 1,
    }


def test_text_that_is_not_valid_unicode_is_answered_as_the_tools_error(tokenizer):
    """A result holding a lone surrogate would stop the run in the tokenizer. (An exception's text cannot: trl's error
    form, ``str({"error": ...})``, escapes it.)"""
    with ToolRunner([bad_text], timeout_s=10.0, max_result_tokens=100, tokenizer=tokenizer) as runner:
        result = runner.run_one(ToolCall("bad_text", {}, ""))
    assert result.error == "raised"
    assert result.content.startswith("{'error': 'bad_text answered with text that is not valid Unicode (")
    tokenizer(result.content)  # the message joins the dialog


@pytest.mark.parametrize("max_result_tokens", [None, 10**12])
def test_a_huge_result_is_read_up_to_a_bound_whatever_max_result_tokens_says(tokenizer, max_result_tokens):
    """A 50 MB result with no token cut (or one no result reaches) came whole through the pipe into the tokenizer: no
    progress for minutes. It is cut at MAX_RESULT_CHARS characters in the worker, and the cut counted."""
    from interop.tools import MAX_RESULT_CHARS

    with ToolRunner([long_text], timeout_s=60.0, max_result_tokens=max_result_tokens, tokenizer=tokenizer) as runner:
        result = runner.run_one(ToolCall("long_text", {"words": 10_000_000}, ""))
    assert result.error is None and result.cut
    assert len(result.content) == MAX_RESULT_CHARS and result.content.startswith("word word")


def test_the_worker_is_kept_across_calls_and_replaced_after_a_timeout_or_a_crash():
    with ToolRunner([worker_pid, count_calls, sleepy, die], timeout_s=1.0, max_result_tokens=None) as runner:
        first = int(runner.run_one(ToolCall("worker_pid", {}, "")).content)
        assert [runner.run_one(ToolCall("count_calls", {}, "")).content for _ in range(3)] == ["1", "2", "3"]
        assert int(runner.run_one(ToolCall("worker_pid", {}, "")).content) == first  # one worker, state kept
        assert runner.run_one(ToolCall("sleepy", {"seconds": 30.0}, "")).error == "timeout"
        assert _gone_within(first, 5.0)  # the overrunning worker was killed
        second = int(runner.run_one(ToolCall("worker_pid", {}, "")).content)
        assert second != first and runner.restarts == 1
        crashed = runner.run_one(ToolCall("die", {"code": 3}, ""))
        assert crashed.error == "crashed" and "exit code 3" in crashed.content
        third = int(runner.run_one(ToolCall("worker_pid", {}, "")).content)
        assert third not in (first, second) and runner.restarts == 2
    assert _gone_within(third, 5.0)  # close() ends it


def test_calls_refused_before_running_start_no_worker():
    runner = ToolRunner([multiply], timeout_s=1.0, max_result_tokens=None)
    results = runner.run([ToolCall("divide", {}, ""), ToolCall("multiply", {"a": 1}, "")])
    assert [result.error for result in results] == ["unknown_tool", "bad_arguments"]
    assert runner._process is None


def test_a_tool_the_worker_cannot_import_is_refused_up_front(tokenizer):
    def local(a: int) -> int:
        """A local function.

        Args:
            a: a number.
        """
        return a

    with pytest.raises(ValueError, match="tool 'local' cannot be sent to the worker process"):
        ToolRunner([local], max_result_tokens=None)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        ToolRunner([multiply], max_result_tokens=10)
    with pytest.raises(ValueError, match="timeout_s=0"):
        ToolRunner([multiply], timeout_s=0, tokenizer=tokenizer)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"timeout_s": float("inf")}, "timeout_s=inf must be a finite number of seconds > 0"),
        ({"start_timeout_s": float("inf")}, "start_timeout_s=inf must be a finite number of seconds > 0"),
        ({"max_result_tokens": 1.5}, "max_result_tokens=1.5 must be a whole number of tokens"),
        ({"max_result_tokens": True}, "max_result_tokens=True must be a whole number of tokens"),
    ],
)
def test_settings_a_call_would_fail_on_are_refused_at_construction(tokenizer, options, words):
    with pytest.raises(ValueError, match=rf"^ToolRunner: {words}"):
        ToolRunner([multiply], tokenizer=tokenizer, **options)


def test_tool_results_message_is_trls():
    assert ToolResult("multiply", "6").message == {"role": "tool", "name": "multiply", "content": "6"}


# The script loads interop/tools/runner.py by its path: importing the interop package (torch, torchrl) would take most
# of the test's time.
TOOLS_FILE = os.path.join(REPO_ROOT, "interop", "tools", "runner.py")
LOAD_TOOLS_MODULE = (
    f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('interop_tools', {TOOLS_FILE!r}); "
    "tools = importlib.util.module_from_spec(spec); sys.modules['interop_tools'] = tools; "
    "spec.loader.exec_module(tools); ToolCall, ToolRunner = tools.ToolCall, tools.ToolRunner"
)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, TESTS_DIR])}


def test_a_tool_defined_in_the_script_that_runs_is_found(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            '''
            {LOAD_TOOLS_MODULE}

            def add(a: int, b: int) -> int:
                """Adds.

                Args:
                    a: one.
                    b: two.
                """
                return a + b

            if __name__ == "__main__":
                with ToolRunner([add], timeout_s=30.0, max_result_tokens=None) as runner:
                    print(runner.run_one(ToolCall("add", {"a": 2, "b": 3}, "")).content)
            '''
        ).replace("{LOAD_TOOLS_MODULE}", LOAD_TOOLS_MODULE)
    )
    out = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "5"
