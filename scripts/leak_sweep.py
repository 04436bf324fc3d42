"""Processes a tool starts, counted after the run that started them has ended: issue 39's "processes outliving the
run" cases, measured through the recipes as a user meets them.

Each case runs a recipe on the calculator task (``experiment=calculator`` in both recipes: the tiny policy calls
its ``multiply`` tool from the first step) with a ``multiply`` that also starts a ``sleep`` per call: a function tool
(a plain child, or one in a session of its own: ``start_new_session=True``) or the tool of an MCP server. The run is
killed with SIGKILL once a few of those ``sleep`` processes run, or left to end normally; then, 10 s later, the
script counts the ``sleep`` processes still running. Each case's ``sleep`` carries an argument of its own (``sleep 300
0.<tag>``: GNU sleep adds its arguments up), so only this script's are counted, and the script kills those it counted
(by process id) before the next case.

    python scripts/leak_sweep.py                    # every case, a table case -> processes left
    python scripts/leak_sweep.py --only grpo_sync_child_sigkill trl_async_session_sigkill
    python scripts/leak_sweep.py --list

Exits 1 if any case leaves a process or never started one (the tool never called: nothing measured)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

# Each call's sleep, in the function tool and in the MCP server's tool alike.
START_SLEEP = """    subprocess.Popen(
        ["sleep", "300", {tag!r}],
        start_new_session={new_session!r},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
"""

# The calculator task's own multiply, its description as the policy learned it, plus the sleep.
FUNCTION_TOOL = '''"""multiply, starting a tagged sleep per call (written by scripts/leak_sweep.py)."""
import subprocess

from recipes.tasks import calculator


def multiply(a: int, b: int) -> int:
{start_sleep}    return a * b


multiply.__doc__ = calculator.multiply.__doc__
'''

MCP_SERVER = '''"""An MCP server whose multiply starts a tagged sleep per call (written by scripts/leak_sweep.py)."""
import subprocess

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator", log_level="WARNING")


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiplies two integers."""
{start_sleep}    return a * b


if __name__ == "__main__":
    server.run()
'''

GRPO = ("grpo_torchrl_rm", ["experiment=calculator", "progress_bar=false"])
TRL = ("trl_grpo_torchrl_rollouts", ["experiment=calculator", "progress_bar=false"])


@dataclass(frozen=True)
class Case:
    recipe: tuple[str, list[str]]
    overrides: tuple[str, ...]
    tool: str  # "function" or "mcp" (the server started directly) or "mcp_bash" (through `bash -c "python ...; true"`)
    new_session: bool
    sigkill: bool  # killed once `calls` sleeps run; else the run ends on its own (train steps cut short)


# A run that ends on its own: two steps, no held-out evaluation (its accuracy is the preset's metric: another one).
NO_EVAL = ("eval.every_n_steps=null", "metric=rollout/reward_mean_last")
SHORT_GRPO, SHORT_TRL = ("train.steps=2", *NO_EVAL), ("train.max_steps=2", *NO_EVAL)
CASES = {
    "grpo_sync_child_sigkill": Case(GRPO, (), "function", False, True),
    "grpo_sync_session_sigkill": Case(GRPO, (), "function", True, True),
    "grpo_async_child_sigkill": Case(GRPO, ("rollout.mode=async",), "function", False, True),
    "grpo_async_session_sigkill": Case(GRPO, ("rollout.mode=async",), "function", True, True),
    "grpo_processes_session_sigkill": Case(GRPO, ("rollout.backend=processes",), "function", True, True),
    "grpo_ray_session_sigkill": Case(GRPO, ("rollout.backend=ray",), "function", True, True),
    "grpo_sync_session_normal_end": Case(GRPO, SHORT_GRPO, "function", True, False),
    "trl_sync_child_sigkill": Case(TRL, (), "function", False, True),
    "trl_sync_session_sigkill": Case(TRL, (), "function", True, True),
    "trl_async_child_sigkill": Case(TRL, ("rollout.mode=async",), "function", False, True),
    "trl_async_session_sigkill": Case(TRL, ("rollout.mode=async",), "function", True, True),
    "trl_ray_session_sigkill": Case(TRL, ("rollout.backend=ray",), "function", True, True),
    "grpo_mcp_child_normal_end": Case(GRPO, SHORT_GRPO, "mcp", False, False),
    "grpo_mcp_session_normal_end": Case(GRPO, SHORT_GRPO, "mcp", True, False),
    "grpo_mcp_child_sigkill": Case(GRPO, (), "mcp", False, True),
    "grpo_mcp_bash_launcher_sigkill": Case(GRPO, (), "mcp_bash", True, True),
    "trl_mcp_child_normal_end": Case(TRL, SHORT_TRL, "mcp", False, False),
    "trl_mcp_child_sigkill": Case(TRL, (), "mcp", False, True),
}


def tagged_sleeps(tag: str) -> list[psutil.Process]:
    """The running ``sleep`` processes whose arguments hold ``tag`` (zombies, already ended, are not counted)."""
    found = []
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        info = process.info
        if info["name"] == "sleep" and tag in (info["cmdline"] or []) and info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def tool_overrides(case: Case, folder: Path, module: str) -> list[str]:
    if case.tool == "function":
        return [f"tools.multiply.function={module}.multiply"]
    server = folder / f"{module}.py"
    if case.tool == "mcp":
        command, args = "python", f"[{server}]"
    else:  # a launcher's shape (npx, uvx): a shell that starts the real server as its child
        command, args = "bash", f"['-c','{sys.executable} {server}; true']"
    return [
        "~tools.multiply",
        f"+tools.calc.mcp.servers.calc.command={command}",
        f"+tools.calc.mcp.servers.calc.args={args}",
    ]


def run_case(name: str, case: Case, folder: Path, index: int, *, calls: int, timeout: float) -> tuple[int, int, str]:
    """Runs ``case``; returns (sleeps seen while it ran, sleeps left 10 s after it ended, a note)."""
    tag = f"0.000{os.getpid()}{index:02d}1"
    module = f"leak_sweep_{name}"
    source = FUNCTION_TOOL if case.tool == "function" else MCP_SERVER
    (folder / f"{module}.py").write_text(
        source.format(start_sleep=START_SLEEP.format(tag=tag, new_session=case.new_session))
    )
    recipe, preset = case.recipe
    command = [
        sys.executable,
        str(ROOT / "recipes" / f"{recipe}.py"),
        *preset,
        *tool_overrides(case, folder, module),
        *case.overrides,
        f"hydra.run.dir={folder / 'runs' / name}",
    ]
    python_path = os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = (folder / f"{name}.log").open("w")
    trainer = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    seen, note = 0, ""
    try:
        deadline = time.monotonic() + timeout
        while trainer.poll() is None and time.monotonic() < deadline:
            seen = max(seen, len(tagged_sleeps(tag)))
            if case.sigkill and seen >= calls:
                trainer.send_signal(signal.SIGKILL)
                break
            time.sleep(0.1)
        if trainer.poll() is None and not (case.sigkill and seen >= calls):
            note = f"timed out after {timeout:.0f} s (SIGKILL)"
            trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=60)
        if not case.sigkill and trainer.returncode != 0 and not note:
            note = f"exit {trainer.returncode}, see {folder / (name + '.log')}"
        time.sleep(10.0)
        left = tagged_sleeps(tag)
        return seen, len(left), note
    finally:
        if trainer.poll() is None:
            trainer.kill()
        log.close()
        for process in tagged_sleeps(tag):  # ours, by id: the next case starts clean
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="these cases (default: all)")
    parser.add_argument("--calls", type=int, default=3, help="SIGKILL once this many sleeps run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a case may take")
    parser.add_argument("--out", type=Path, default=None, help="run folders and logs (default: a temporary one)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args(argv)
    names = args.only or list(CASES)
    if args.list:
        print("\n".join(names))
        return 0
    folder = args.out or Path(tempfile.mkdtemp(prefix="leak_sweep."))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{len(names)} cases, run folders and logs under {folder}", flush=True)
    print(f"{'case':34s} {'sleeps seen':>11s} {'left':>5s}  note", flush=True)
    bad = 0
    for index, name in enumerate(names):
        start = time.time()
        seen, left, note = run_case(name, CASES[name], folder, index, calls=args.calls, timeout=args.timeout)
        if seen == 0 and not note:
            note = "the tool was never called: nothing measured"
        bad += left > 0 or seen == 0
        print(f"{name:34s} {seen:11d} {left:5d}  {note or 'ok'} ({time.time() - start:.0f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
