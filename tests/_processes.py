"""Processes for the multi-process tests: forked ranks in one gloo group (no launcher), a free port for those a
launcher starts, a recipe run killed with SIGKILL once it has got somewhere, and processes counted by id (those a test
started, still running or left over)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_gloo_ranks(worker: Callable[[int, str], None], folder: str, *, world_size: int = 2, timeout: float = 120):
    """Runs ``worker(rank, folder)`` in ``world_size`` forked processes joined in one gloo group (its store a file in
    ``folder``, where the workers also write what the test reads). Returns the exit codes in rank order: 0 for a
    worker that returned, None for one still running after ``timeout`` seconds (killed: a rank left waiting on a
    collective the others never ran)."""
    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=_in_group, args=(worker, rank, world_size, folder)) for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=timeout)
    exit_codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
    return exit_codes


def _in_group(worker: Callable[[int, str], None], rank: int, world_size: int, folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size)
    try:
        worker(rank, folder)
    finally:
        dist.destroy_process_group()


def run_forked_ranks(script: str, arguments: list[str], *, world_size: int = 2, timeout: float = 600) -> None:
    """``torchrun --standalone --nproc_per_node <world_size> <script> <arguments>`` without the launcher: each rank
    forked from this process, its imports already done (``_in_process.ForkedScript``: the script as ``__main__``),
    with the environment torchrun gives its workers (torch.distributed.elastic's ``LocalElasticAgent``: ranks, sizes,
    the rendezvous address; rank 0 holds the store, as without an agent) and none of this process's accelerate state.
    A launched run spent 9-11 CPU-s more here, on three new Pythons importing torch, transformers and torchrl again.
    Fails, with the ranks' stderr, unless every rank exits 0 within ``timeout`` seconds (the others are killed when
    one fails: they would wait on its collectives)."""
    import tempfile

    from _in_process import ForkedScript

    port, folder = free_port(), Path(tempfile.mkdtemp(prefix="forked_ranks_"))
    shared = {"LOCAL_WORLD_SIZE": str(world_size), "WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1"}
    shared |= {"ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world_size), "GROUP_RANK": "0"}
    shared |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}
    shared |= {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}
    shared |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ranks = [
        ForkedScript(
            script,
            *arguments,
            stderr_path=folder / f"rank{rank}.txt",
            env={**shared, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)},
            prepare=_without_accelerate_state,
        )
        for rank in range(world_size)
    ]
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(rank.poll() is None for rank in ranks):
            if any(rank.poll() not in (None, 0) for rank in ranks):
                break
            time.sleep(0.05)
        exit_codes = [rank.poll() for rank in ranks]
        errors = "\n".join(f"rank {i}: ...{rank.stderr_text()[-3000:]}" for i, rank in enumerate(ranks))
        assert exit_codes == [0] * world_size, f"exit codes {exit_codes} (None: still running)\n{errors}"
    finally:
        for rank in ranks:
            rank.kill()
        shutil.rmtree(folder, ignore_errors=True)


def accelerate_launch_forked(*arguments: str, timeout: float = 600) -> None:
    """``accelerate launch <arguments>`` through accelerate's own launcher code, in this process (its checks and the
    environment it makes for the ranks: ``--use_fsdp``'s plugin settings, the process counts), up to where it would
    start torchrun: there the ranks are forked instead (:func:`run_forked_ranks`), in that environment."""
    from unittest import mock

    import accelerate.commands.launch as launch

    def forked_torchrun(args) -> None:
        run_forked_ranks(
            args.training_script, list(args.training_script_args), world_size=int(args.nproc_per_node), timeout=timeout
        )

    with mock.patch.object(launch, "_run_torchrun", forked_torchrun):
        launch.launch_command(launch.launch_command_parser().parse_args(list(arguments)))


def _without_accelerate_state() -> None:
    """A forked rank starts with no accelerate state, as a new process does (this one may hold a single-process
    ``PartialState`` of an earlier in-process run, which the rank would otherwise take for its own)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def free_port() -> int:
    """A port no process listens on now: other tests (and other runs on this machine) start process groups too, so a
    launcher's default port cannot be relied on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_recipe_run_when(
    recipe: str,
    overrides: list[str],
    *,
    ready: Callable[[], bool],
    timeout: float = 480,
    before_kill: Callable[[int], None] | None = None,
    forked: bool = False,
) -> None:
    """Runs ``python recipes/<recipe> <overrides>`` and kills it with SIGKILL as soon as ``ready()`` holds (a checkpoint
    written, a step logged...); ``before_kill(pid)`` sees the run just before. Fails, with the run's stderr, if the run
    ends or the timeout passes first. ``forked``: the run's process is forked from this one, its imports already done
    (``_in_process.ForkedScript``), rather than a new Python that spends 4-5 s importing them again."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if forked:
        import tempfile

        from _in_process import ForkedScript

        stderr_path = Path(tempfile.mkdtemp(prefix="killed_run_")) / "stderr.txt"
        process = ForkedScript(f"recipes/{recipe}", *overrides, stderr_path=stderr_path, env=env)
        stderr_text = process.stderr_text
    else:
        command = [sys.executable, f"recipes/{recipe}", *overrides]
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        stderr_text = lambda: process.stderr.read().decode()  # noqa: E731
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None and not ready():
            time.sleep(0.02)
        assert process.poll() is None, stderr_text()[-3000:]
        # Killed at the deadline, the run would leave less than the test expects (no checkpoint yet) and fail later
        # with a misleading message (as a Ray resume test did on a loaded machine): say what did not happen in time.
        assert ready(), f"the run did not reach the point to kill it at within {timeout:.0f} s (a loaded machine?)"
        if before_kill is not None:
            before_kill(process.pid)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        if forked:
            shutil.rmtree(stderr_path.parent, ignore_errors=True)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def still_running(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` that still run after ``within_s`` seconds (sooner when none does)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [pid for pid in pids if running(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_leftovers(pids: list[int]) -> None:
    """Kills those of ``pids`` (processes a test started) that still run: a failing test leaves nothing behind."""
    for pid in pids:
        if running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def left_after_sigkill(script: Path, count: int, *, env: dict) -> list[int]:
    """Runs ``python script``, reads ``count`` process ids from its output (processes it started, all running), kills
    it with SIGKILL and returns those ids still running 10 s later (then killed: a failing test leaves nothing)."""
    trainer = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(trainer.stdout.readline()) for _ in range(count)]
        assert all(running(pid) for pid in pids), pids
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        return still_running(pids, 10.0)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        kill_leftovers(pids)


def kill_ray_run_when(recipe: str, overrides: list[str], *, ready: Callable[[], bool]) -> None:
    """:func:`kill_recipe_run_when` for a run that started its own local Ray cluster (``rollout.backend=ray``, no
    ``ray.address``): fails unless Ray's processes (GCS, raylet) were among its children and every one of its
    children is gone within 30 s of the SIGKILL. The run is a new Python, not forked: a process forked from a test
    process that had already joined a Ray cluster hung starting its own (its GCS up, no raylet; 2026-12-06)."""
    import psutil

    started: dict[psutil.Process, str] = {}

    def note_its_processes(pid: int) -> None:
        # Each one's name read now, while it runs: after the kill it may be gone before it is read.
        for process in psutil.Process(pid).children(recursive=True):
            try:
                started[process] = process.name()
            except psutil.NoSuchProcess:  # a short-lived child, ended before the kill: not one left behind
                pass

    kill_recipe_run_when(recipe, overrides, ready=ready, before_kill=note_its_processes)
    names = " ".join(started.values())
    assert "raylet" in names and "gcs_server" in names, names
    _, alive = psutil.wait_procs(list(started), timeout=30)
    left = [(process.pid, started[process]) for process in alive if running(process.pid)]
    assert left == [], "Ray processes of the killed run still running"
