"""The processes that run tool calls for ``interop.tools.ToolRunner``: the standard library only, on purpose.

``ToolRunner`` starts this file as a script (``python interop/tools/_tool_worker.py <fd> <parent pid>``), not as a
module of the ``interop`` package, whose ``__init__`` imports torch and torchrl: it starts in a few tens of
milliseconds, which a restart after a timeout pays again. Two processes come of it:

- the *keeper* (the process ``ToolRunner`` started; it runs no tool code, so it always answers signals): it becomes a
  child subreaper (``PR_SET_CHILD_SUBREAPER``: every process started below it that loses its parent, a double-forked
  daemon in a session of its own included, is re-parented to it rather than to init), asks Linux for ``SIGTERM`` when
  the process that started it ends (``PR_SET_PDEATHSIG``), and forks the *caller*. When the caller ends, or on
  ``SIGTERM``, ``SIGHUP`` or ``SIGINT`` (the runner's stop, the trainer's death), it kills every process below it, found
  by parent links in ``/proc``, until none is left, then ends with the caller's exit status;
- the *caller*, dead with the keeper (``PR_SET_PDEATHSIG``, ``SIGKILL``), reads on the connection whose file
  descriptor it is given:

  1. ``(sys_path, pickled_tools)``: the parent's import path and the tools (pickled with ``cloudpickle``: functions of
     an importable module by reference, those of the parent's ``__main__`` script by value, so that no script of the
     parent's runs here); it calls the ``start_in_worker()`` method of each tool that has one (an MCP tool starts its
     server there, so that the server's start is not counted in a call's timeout) and answers ``("ready", said)`` (what
     those methods returned as text: which server started) or ``("failed", traceback)``;
  2. then calls, ``(name, arguments, char_limit)``, one at a time, answering ``("ok", (text, cut))`` with the result
     as text (``str(result)``, as trl writes a tool's result into its message; cut at ``char_limit`` characters when
     that is not None) or ``("raised", "<error text>")``.

What escapes (Linux): a process a tool hands its work to outside this tree (``systemd-run``, a container runtime,
``ssh``...); and, when the keeper itself is killed with ``SIGKILL`` (by a person or the OOM killer: the runner and the
trainer's death send ``SIGTERM``), the processes below it, which then go to init. Elsewhere than Linux (no subreaper,
no parent-death signal, no ``/proc``) only the runner's kill of the keeper's process group holds, while the runner
lives.

Dependencies: the standard library (and ``cloudpickle``, which torch's ecosystem installs, to read the tools).
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# What the keeper waits for: its caller's end (SIGCHLD), or a request to stop everything.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_parent(parent: int, death_signal: int = signal.SIGKILL) -> None:
    """Asks Linux to send ``death_signal`` to this process when ``parent`` (its parent now) ends; ends at once if it
    has ended already (before the request took effect)."""
    _prctl(_PR_SET_PDEATHSIG, death_signal)
    if os.getppid() != parent:
        os._exit(1)


def _load_tools(sys_path: list[str], pickled: bytes) -> tuple[dict, list[str]]:
    """The tools, and what their ``start_in_worker()`` calls said (an MCP server started, or why not)."""
    sys.path[:] = sys_path
    tools = pickle.loads(pickled)
    started = []
    for tool in tools.values():
        start = getattr(tool, "start_in_worker", None)
        if callable(start):
            said = start()
            if isinstance(said, str) and said not in started:  # the tools of one server say it once
                started.append(said)
    return tools, started


def _call(tool, arguments: dict):
    result = tool(**arguments)
    if inspect.isawaitable(result):  # an async tool (trl takes those too)

        async def wait():
            return await result

        result = asyncio.run(wait())
    return result


def serve(connection: Connection) -> None:
    """Answers the tool calls that arrive on ``connection`` until it closes."""
    try:
        tools, started = _load_tools(*connection.recv())
    except BaseException:
        connection.send(("failed", traceback.format_exc()))
        return
    connection.send(("ready", started))
    while True:
        try:
            name, arguments, char_limit = connection.recv()
        except (EOFError, OSError):
            return
        try:
            text = str(_call(tools[name], arguments))
        except TimeoutError as error:  # a tool that gave up waiting (a subprocess's timeout): counted as a timeout
            connection.send(("timeout", str(error)))
            continue
        except Exception as error:  # the tool's failure is the model's answer, as in trl: its text
            connection.send(("raised", str(error)))
            continue
        cut = char_limit is not None and len(text) > char_limit
        connection.send(("ok", (text[:char_limit] if cut else text, cut)))


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` that have not ended (zombies left out), read from the parent links in ``/proc``."""
    children: dict[int, list[int]] = {}
    running = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:  # ended meanwhile
            continue
        state, parent = stat[stat.rindex(b")") + 2 :].split()[:2]  # the name, in parentheses, may hold spaces
        children.setdefault(int(parent), []).append(int(entry))
        if state not in (b"Z", b"X"):
            running.add(int(entry))
    below, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            below.append(child)
            stack.append(child)
    return [pid for pid in below if pid in running]


def _reap(caller: int, statuses: dict) -> None:
    """Collects every ended child (its own, and the orphans re-parented to it), keeping the caller's wait status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == caller:
            statuses[caller] = status


def _kill_everything_below(caller: int, statuses: dict, within_s: float = 10.0) -> None:
    # A killed process's children are re-parented to this subreaper as it dies, so the tree is read again until
    # nothing runs below; a process in uninterruptible sleep may take a while to die.
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        below = _descendants(os.getpid())
        if not below:
            break
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
        _reap(caller, statuses)
    _reap(caller, statuses)


def keep(fd: int, parent: int) -> None:
    """The keeper (see the module docstring): forks the caller, which serves on ``fd``, then waits for the caller's
    end or a stop request and kills every process below it; ends with the caller's exit status."""
    watched = {signal.SIGCHLD, *_STOP_SIGNALS}
    # Blocked before anything else, so that a stop request or the caller's end is never lost: read by sigtimedwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    _die_with_parent(parent, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    keeper = os.getpid()
    caller = os.fork()
    if caller == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        _die_with_parent(keeper)
        _serve_and_exit(Connection(fd))
    os.close(fd)  # the caller's end of the pipe: the runner sees EOF as soon as the caller ends
    statuses: dict = {}
    while caller not in statuses:
        received = signal.sigtimedwait(watched, 1.0)
        if received is None:
            if os.getppid() != parent:  # the parent-death signal is tied to the thread that started us: a backstop
                break
            continue
        if received.si_signo != signal.SIGCHLD:
            break
        _reap(caller, statuses)
    _kill_everything_below(caller, statuses)
    code = os.waitstatus_to_exitcode(statuses[caller]) if caller in statuses else 1
    if code < 0:  # the caller was killed by a signal: end by it too, so that the runner reports what the caller got
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(keeper, -code)
        code = 128 - code
    os._exit(code)


def _serve_and_exit(connection: Connection) -> None:
    code = 0
    try:
        serve(connection)
    except SystemExit as stop:  # a tool that called sys.exit(): its code, as a process would end with it
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if hasattr(signal, "sigtimedwait") and os.path.isdir("/proc"):
        keep(int(sys.argv[1]), int(sys.argv[2]))
    else:  # no subreaper nor /proc to find what the tools started: one process, as good as the runner's group kill
        _die_with_parent(int(sys.argv[2]))
        serve(Connection(int(sys.argv[1])))
