"""interop.tools.ToolRunner: no process a tool starts outlives the run. A child of the tool, one in a session of its
own (``start_new_session=True``) and a double-forked daemon each end when the runner closes, when a call overruns its
timeout, and when the training process is killed with SIGKILL; so do those of TorchRL's ``PythonInterpreter`` code.
Processes are counted by id: the tools answer the ids of what they started."""

from __future__ import annotations

import os

from _processes import kill_leftovers, left_after_sigkill, running, still_running
from _tool_functions import start_sleeper, start_sleepers_and_hang

from interop.tools import ToolCall, ToolRunner

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("child", "session", "daemon")


def _answer(runner: ToolRunner, name: str, **arguments) -> str:
    result = runner.run_one(ToolCall(name, arguments, ""))
    assert result.error is None, result.content
    return result.content


def test_what_a_tool_started_ends_with_the_runner_even_in_a_session_of_its_own():
    pids = []
    try:
        with ToolRunner([start_sleeper], timeout_s=30.0, max_result_tokens=None) as runner:
            pids = [int(_answer(runner, "start_sleeper", how=how)) for how in KINDS]
            assert all(running(pid) for pid in pids)
        assert still_running(pids, 10.0) == [], "left after close(), in the order child, session, daemon"
    finally:
        kill_leftovers(pids)


def test_what_an_overrunning_tool_started_ends_with_its_worker(tmp_path):
    pid_file, pids = tmp_path / "pids", []
    try:
        with ToolRunner([start_sleepers_and_hang, start_sleeper], timeout_s=3.0, max_result_tokens=None) as runner:
            result = runner.run_one(ToolCall("start_sleepers_and_hang", {"pid_file": str(pid_file)}, ""))
            pids = [int(line) for line in pid_file.read_text().split()]
            assert result.error == "timeout" and len(pids) == 3
            assert still_running(pids, 10.0) == [], "left after the timeout, in the order child, session, daemon"
            pids.append(int(_answer(runner, "start_sleeper", how="child")))  # the next call has a fresh worker
    finally:
        kill_leftovers(pids)


# The script loads interop/tools/runner.py by its path: importing the interop package (torch, torchrl) would take most
# of the test's time.
TRAINER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("interop_tools", {tools!r})
tools = importlib.util.module_from_spec(spec); sys.modules["interop_tools"] = tools; spec.loader.exec_module(tools)
from _tool_functions import start_sleeper

runner = tools.ToolRunner([start_sleeper], timeout_s=30.0, max_result_tokens=None)
for how in {kinds!r}:
    print(runner.run_one(tools.ToolCall("start_sleeper", {{"how": how}}, "")).content, flush=True)
print(runner._process.pid, flush=True)
time.sleep(600)
"""


def test_what_a_tool_started_dies_with_the_trainer_killed_by_sigkill(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(tools=os.path.join(REPO_ROOT, "interop", "tools", "runner.py"), kinds=KINDS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")])}
    left = left_after_sigkill(script, len(KINDS) + 1, env=env)  # the sleepers, then the worker
    assert left == [], "left after SIGKILL (the ids in the order child, session, daemon, worker)"


def test_what_python_interpreter_code_started_ends_with_the_runner():
    """TorchRL's PythonInterpreter runs each call's code in a process of its own, which ends; a process that code
    started in a session of its own outlived it."""
    from interop.tools.torchrl_tools import PythonCodeTool

    code = (  # its output not inherited: the interpreter reads the code's output to its end
        "import subprocess as s\n"
        "print(s.Popen(['sleep', '600'], start_new_session=True, stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
    )
    pids = []
    try:
        with ToolRunner([PythonCodeTool(timeout_s=20.0)], timeout_s=60.0, max_result_tokens=None) as runner:
            pids = [int(_answer(runner, "python", code=code))]
            assert running(pids[0])
        assert still_running(pids, 10.0) == []
    finally:
        kill_leftovers(pids)
