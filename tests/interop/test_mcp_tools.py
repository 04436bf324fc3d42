"""interop.tools.mcp_tools: an MCP server (tests/interop/mcp_calculator_server.py, started over stdio with this Python)
as tools of a ToolSet. Its tools are listed with the server's names, descriptions and schemas; calls go through the
ToolRunner's worker to ONE server process per worker; an error result is answered as an error and counted; a call past
the timeout ends the worker and its server (no orphan, a server behind a launcher shell included), and the next call
starts both afresh; a process a server's tool started ends with the run, normal or killed; the server's start is
logged; bad servers are refused with the reason, their env values never shown."""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import psutil
import pytest
from _processes import REPO_ROOT, kill_leftovers, left_after_sigkill, running, still_running

pytest.importorskip("mcp")

from interop.tools import ToolCall, ToolRunner, ToolSet, ToolStats  # noqa: E402
from interop.tools.mcp_tools import MCPStdioServer, MCPTool, mcp_tools  # noqa: E402

SERVER = str(Path(__file__).with_name("mcp_calculator_server.py"))


def calculator(*args: str, **env: str) -> dict:
    """The test server as TorchRL's MCPToolTransform describes a server."""
    return {"command": sys.executable, "args": [SERVER, *args], "env": env}


@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    """The server's tools, listed once; the file where every start of the server writes its process id."""
    starts = tmp_path_factory.mktemp("mcp") / "starts"
    tools = mcp_tools({"calc": calculator(MCP_TEST_STARTS=str(starts), MCP_TEST_SECRET="s3cr3t-value")})
    return tools, starts


def _started(starts: Path) -> list[int]:
    return [int(line) for line in starts.read_text().split()] if starts.exists() else []


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_the_servers_tools_are_listed_with_its_names_descriptions_and_schemas(listed):
    tools, starts = listed
    assert [tool.__name__ for tool in tools] == ["multiply", "fail", "nap", "whoami", "spawn", "secret"]
    assert all(isinstance(tool, MCPTool) and tool.server is tools[0].server for tool in tools)
    assert all(_gone(pid) for pid in _started(starts)), "the listing's server outlived its short session"
    tool_set = ToolSet(tools)
    multiply = tool_set.schemas[0]["function"]
    assert multiply["description"] == "Multiplies two integers."
    assert multiply["parameters"]["required"] == ["a", "b"]
    assert {key: value["type"] for key, value in multiply["parameters"]["properties"].items()} == {
        "a": "integer",
        "b": "integer",
    }
    assert tool_set.check_call("multiply", {"a": 1, "b": "2"})[0] == "bad_arguments"  # refused before the server
    # The tools travel to the worker together: one server object there, no live session, the env kept but not shown.
    copies = pickle.loads(pickle.dumps(tools))
    assert copies[0].server is copies[3].server and copies[0].server._connection is None
    assert copies[0].server.env["MCP_TEST_SECRET"] == "s3cr3t-value"
    assert "s3cr3t-value" not in repr(copies[0].server) and "MCP_TEST_SECRET" in repr(copies[0].server)


def test_calls_reach_one_long_lived_server_through_the_worker(listed):
    tools, starts = listed
    before = len(_started(starts))
    stats = ToolStats()
    with ToolRunner(tools, timeout_s=20.0, max_result_tokens=None) as runner:
        results = runner.run(
            [
                ToolCall("multiply", {"a": 12, "b": 34}, ""),
                ToolCall("whoami", {}, ""),
                ToolCall("whoami", {}, ""),
                ToolCall("fail", {"why": "down"}, ""),
                ToolCall("secret", {}, ""),
            ]
        )
        for result in results:
            stats.record(result)
        worker = psutil.Process(runner._process.pid)
        servers = [child for child in worker.children(recursive=True) if SERVER in " ".join(child.cmdline())]
    assert results[0].content == "408" and results[0].error is None
    (pid_1, count_1), (pid_2, count_2) = [map(int, result.content.split()) for result in results[1:3]]
    assert pid_1 == pid_2 and count_2 == count_1 + 1, "every call of the worker reaches one server process"
    assert len(servers) == 1 and servers[0].pid == pid_1
    assert len(_started(starts)) == before + 1
    assert results[3].error == "raised" and "fail: down" in results[3].content
    assert results[4].content == "s3cr3t-value"  # the env given reaches the server
    assert (stats.calls, dict(stats.errors)) == (5, {"raised": 1})
    assert _gone(pid_1), "the server outlived its runner"


def test_a_call_past_the_timeout_ends_the_worker_and_its_server_and_the_next_call_starts_afresh(listed):
    tools, starts = listed
    with ToolRunner(tools, timeout_s=3.0, max_result_tokens=None) as runner:
        first = runner.run_one(ToolCall("whoami", {}, ""))
        server = int(first.content.split()[0])
        start = time.perf_counter()
        slow = runner.run_one(ToolCall("nap", {"seconds": 60}, ""))
        took = time.perf_counter() - start
        assert _gone(server), f"the MCP server {server} outlived its killed worker"
        after = runner.run_one(ToolCall("whoami", {}, ""))
        assert runner.restarts == 1
    assert slow.error == "timeout" and took < 10
    new_server, count = map(int, after.content.split())
    assert new_server != server and count == 1 and after.error is None
    assert all(_gone(pid) for pid in _started(starts)), "a server was left behind"


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ({"calc": {"command": "no-such-mcp-server-4321", "env": {"API_KEY": "k-999"}}}, r"'calc'.*is not found"),
        (
            {"calc": {"command": sys.executable, "args": ["-c", "import sys; sys.exit('no MCP here')"]}},
            r"ended before answering MCP's initialize.*stderr ends with: 'no MCP here'",
        ),
        ({"calc": calculator("--only", "", API_KEY="k-999")}, r"MCP server 'calc' .* lists no tools"),
        (
            {"a": calculator("--only", "multiply"), "b": calculator("--only", "whoami,multiply")},
            r"MCP servers 'a' and 'b' both list a tool named 'multiply'",
        ),
        ({"calc": {"args": [SERVER]}}, r"server 'calc': expected \{command"),
        ({"calc": {**calculator(), "cwd": "/"}}, r"unknown key\(s\) \['cwd'\]"),
    ],
)
def test_bad_servers_are_refused_with_the_reason_their_env_never_shown(servers, message):
    with pytest.raises(ValueError, match=message) as refused:
        mcp_tools(servers)
    assert "k-999" not in str(refused.value)


def test_a_server_that_prints_its_env_as_it_fails_is_quoted_with_every_env_value_masked():
    """The refusal quotes the server's stderr (the reason it gives), where a server may print its keys: each env value
    is shown as its name, the rest of the reason as the server wrote it (a short value only where it stands alone)."""
    prints = (
        "import os, sys; env = os.environ; sys.exit(f\"key {env['API_KEY']} refused at line 12, DEBUG={env['DEBUG']}\")"
    )
    server = MCPStdioServer("calc", sys.executable, ["-c", prints], env={"API_KEY": "sk-live-2468", "DEBUG": "1"})
    with pytest.raises(ValueError, match=r"stderr ends with: 'key <API_KEY> refused at line 12, DEBUG=<DEBUG>'") as err:
        server.list_tools()
    assert "sk-live-2468" not in str(err.value)


def test_a_server_silent_past_its_start_timeout_is_stopped_and_refused():
    server = MCPStdioServer("mute", sys.executable, ["-c", "import time; time.sleep(60)"], start_timeout_s=2.0)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"'mute' .* did not answer MCP's initialize within 2 s"):
        server.list_tools()
    assert time.perf_counter() - start < 10


def test_without_the_mcp_package_the_fix_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # `import mcp` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "\.\[mcp\]"'):
        mcp_tools({"calc": calculator()})


def test_torchrl_s_mcp_transform_is_refused_pointing_at_its_servers():
    from torchrl.envs.llm.transforms import MCPToolTransform

    from interop.tools.torchrl_tools import torchrl_tools

    with pytest.raises(ValueError, match=r"mcp_tools\(transform\.server_configs\)"):
        torchrl_tools(MCPToolTransform(servers={}))


def test_what_a_servers_tool_started_ends_with_the_run_and_the_start_is_logged(listed, caplog):
    tools, _ = listed
    pids = []
    try:
        with caplog.at_level("INFO", logger="interop.tools"):
            with ToolRunner(tools, timeout_s=20.0, max_result_tokens=None) as runner:
                pids = [int(runner.run_one(ToolCall("spawn", {}, "")).content)]
                pids.append(int(runner.run_one(ToolCall("whoami", {}, "")).content.split()[0]))  # the server
                assert all(running(pid) for pid in pids)
        assert still_running(pids, 10.0) == [], "left after close(): the server's child, the server"
    finally:
        kill_leftovers(pids)
    started = [record.getMessage() for record in caplog.records if "started" in record.getMessage()]
    assert len(started) == 1 and f"MCP server 'calc' ({sys.executable} {SERVER}) started." in started[0]


def test_a_server_behind_a_launcher_ends_at_each_timeout():
    """npx and uvx start the real server as their child: here a shell that does not exec it."""
    tools = mcp_tools({"calc": {"command": "bash", "args": ["-c", f"{sys.executable} {SERVER}; true"]}})
    servers = []
    try:
        with ToolRunner(tools, timeout_s=2.0, max_result_tokens=None) as runner:
            servers.append(int(runner.run_one(ToolCall("whoami", {}, "")).content.split()[0]))
            assert runner.run_one(ToolCall("nap", {"seconds": 60}, "")).error == "timeout"
            assert still_running(servers, 10.0) == [], "the real server outlived the timeout"
            servers.append(int(runner.run_one(ToolCall("whoami", {}, "")).content.split()[0]))  # a fresh one
    finally:
        kill_leftovers(servers)


TRAINER = """
import sys, time
from interop.tools.mcp_tools import mcp_tools
from interop.tools import ToolCall, ToolRunner

runner = ToolRunner(mcp_tools({{"calc": {{"command": sys.executable, "args": [{server!r}]}}}}), max_result_tokens=None)
print(runner.run_one(ToolCall("spawn", {{}}, "")).content, flush=True)
print(runner.run_one(ToolCall("whoami", {{}}, "")).content.split()[0], flush=True)
print(runner._process.pid, flush=True)
time.sleep(600)
"""


def test_a_server_and_what_its_tool_started_die_with_the_trainer_killed_by_sigkill(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(server=SERVER))
    left = left_after_sigkill(script, 3, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert left == [], "left after SIGKILL (the ids in the order the server's child, the server, the worker)"
