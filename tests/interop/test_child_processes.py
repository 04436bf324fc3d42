"""How the library's child processes start (``interop.sampling.child_processes``): forked from the fork server, they
still see what a spawned child saw of the caller (its environment of now, its working directory and ``sys.path``,
``parent_process()``), the server forks with one thread, and a caller killed by SIGKILL leaves no process."""

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
from _processes import left_after_sigkill

from interop.sampling import child_processes
from interop.sampling.child_processes import child_context, start_child

# What the library's and the GRPO recipe's children preload (BackgroundSampler, BackgroundCollector).
PRELOADED = [
    "interop.sampling.background",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen2.tokenization_qwen2",
    "interop.tools.dialogs",
    "interop.tools.runner",
    "recipes.grpo.collector_modes",
    "recipes.grpo.collector",
]


def _report(connection, name: str) -> None:
    """A child's target: what it sees of its starter, sent back."""
    parent = multiprocessing.parent_process()
    connection.send(
        {
            "variable": os.environ.get(name),
            "cwd": os.getcwd(),
            "sys_path_0": sys.path[0],
            "parent_pid": parent.pid if parent is not None else None,
            "parent_alive": parent is not None and parent.is_alive(),
            "ppid": os.getppid(),
            "main_file": getattr(sys.modules["__main__"], "__file__", None),
        }
    )
    connection.close()


def _seen_by_a_child(context, name: str) -> dict:
    receiving, sending = context.Pipe(duplex=False)
    process = start_child(context, _report, (sending, name))
    sending.close()
    try:
        return receiving.recv()
    finally:
        process.join(timeout=30)


def test_a_child_sees_the_environment_cwd_and_sys_path_of_its_start_not_of_the_fork_servers(tmp_path, monkeypatch):
    """The fork server holds the environment, directory and path of its own start: a child started after they changed
    must see them as the caller has them now, as a spawned child does (the variable fails with a bare fork server)."""
    context = child_context("forkserver")
    name = "INTEROP_TEST_CHILD_VARIABLE"
    monkeypatch.delenv(name, raising=False)
    assert _seen_by_a_child(context, name)["variable"] is None  # the server is running from here on
    monkeypatch.setenv(name, "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = _seen_by_a_child(context, name)
    assert seen["variable"] == "set after the server started"
    assert seen["cwd"] == str(tmp_path)
    assert seen["sys_path_0"] == str(tmp_path)
    monkeypatch.delenv(name)
    assert _seen_by_a_child(context, name)["variable"] is None


def _say(words: str) -> None:
    os.write(1, f"{words} (out)".encode())
    os.write(2, f"{words} (err)".encode())


def test_a_child_writes_to_the_standard_output_and_error_its_caller_has_when_it_starts(capfd):
    """The fork server holds the streams of its start; a child writes to the caller's of now, as a spawned child does
    (what a test's captured output, or a caller that redirected its own, expects)."""
    with capfd.disabled():  # the fork server, if it starts here, gets other streams than the test's
        _seen_by_a_child(child_context("forkserver"), "UNUSED")
    start_child(child_context("forkserver"), _say, ("from the child",)).join(timeout=30)
    out, err = capfd.readouterr()
    assert "from the child (out)" in out and "from the child (err)" in err


def test_a_forked_child_has_the_caller_as_parent_process_and_the_server_as_parent():
    """``multiprocessing.parent_process()`` in the child tracks the caller (what the collector polls to stop when the
    learner is gone), while its parent process is the fork server (what its PR_SET_PDEATHSIG follows); the caller's
    ``__main__`` is not imported in the child."""
    from multiprocessing import forkserver

    seen = _seen_by_a_child(child_context("forkserver"), "UNUSED")
    assert seen["parent_pid"] == os.getpid() and seen["parent_alive"]
    assert seen["ppid"] == forkserver._forkserver._forkserver_pid != os.getpid()
    assert seen["main_file"] is None


_SERVER_THREADS = """
import os, sys, time
from multiprocessing import forkserver
from interop.sampling.child_processes import child_context, start_child
child = start_child(child_context("forkserver", preload={preloaded!r}), time.sleep, (0,))
child.join(30)  # started: the server has imported every module and forked
print(len(os.listdir(f"/proc/{{forkserver._forkserver._forkserver_pid}}/task")), flush=True)
"""


def test_the_fork_server_forks_with_one_thread_after_importing_what_the_children_need(repo_root):
    """Forking a process that runs other threads leaves their locks held in the child: the server, once it imported
    the library's and the recipe's modules (a new process's server, started with exactly those), holds one thread."""
    script = _SERVER_THREADS.format(preloaded=PRELOADED)
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "1"


def test_spawn_is_kept_and_the_fork_server_falls_back_to_it_where_the_platform_has_none(monkeypatch):
    assert _seen_by_a_child(child_context("spawn"), "UNUSED")["ppid"] == os.getpid()
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # Windows
    assert child_context("forkserver").get_start_method() == "spawn"
    with pytest.raises(ValueError, match=r"start_method must be one of \('forkserver', 'spawn'\), got 'fork'"):
        child_context("fork")


_KILLED_STARTER = """
import sys, time
sys.path.insert(0, {root!r})
from multiprocessing import forkserver
from interop.sampling.child_processes import child_context, start_child
child = start_child(child_context("forkserver"), time.sleep, (600,))
print(child.pid, flush=True)
print(forkserver._forkserver._forkserver_pid, flush=True)
time.sleep(600)
"""


def test_a_caller_killed_by_sigkill_leaves_neither_its_child_nor_the_fork_server(tmp_path, repo_root):
    """The child dies with the server (its parent), the server with the caller: nothing is left 10 s after the
    caller's SIGKILL (without the server's own parent-death signal, a child would keep the server alive)."""
    script = tmp_path / "starter.py"
    script.write_text(textwrap.dedent(_KILLED_STARTER.format(root=str(repo_root))))
    assert left_after_sigkill(script, 2, env={**os.environ, "PYTHONPATH": str(repo_root)}) == []


def test_the_server_guard_does_nothing_in_a_process_that_merely_imports_it():
    """Importing every module (doctest collection) must not set a parent-death signal on the importing process."""
    import ctypes
    import importlib

    importlib.import_module("interop.sampling._fork_server_guard")
    signal_number = ctypes.c_int(-1)
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(signal_number))  # PR_GET_PDEATHSIG
    assert signal_number.value == 0
    assert child_processes.START_METHODS == ("forkserver", "spawn")
