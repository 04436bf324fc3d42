"""Processes for the multi-process tests: forked ranks in one gloo group (no launcher), and a free port for those a
launcher starts."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable


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


def free_port() -> int:
    """A port no process listens on now: other tests (and other runs on this machine) start process groups too, so a
    launcher's default port cannot be relied on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
