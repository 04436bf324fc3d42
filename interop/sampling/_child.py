"""The first code a child process of the library runs: the standard library only, on purpose.

A spawned process unpickles its arguments before it runs any of its code; the sampler's (a model on shared memory)
import torch and transformers, seconds during which a trainer killed by SIGKILL would leave the child running on its
own. So the child starts here (:func:`run`, the target :func:`interop.sampling.child_processes.start_child` gives
every child): it asks Linux to kill it with its parent (``PR_SET_PDEATHSIG``), takes the environment its starter had
(a fork server holds the one of its own start), then runs its real target: for a
:class:`~interop.sampling.BackgroundSampler`, :func:`start`, which receives the model through its pipe and hands
over to ``interop.sampling.background.serve``.

Dependencies: the standard library.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["FORK_SERVER_STARTER", "die_with_parent", "run", "start"]

# The environment variable naming the process that starts the fork server: interop.sampling._fork_server_guard acts
# only in a process whose parent it names.
FORK_SERVER_STARTER = "INTEROP_FORK_SERVER_STARTER"


def die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent dies, even by SIGKILL (elsewhere: the children's own checks
    of their parent suffice)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def _release_fork_server() -> None:
    """A child forked by the fork server inherits the write end of the pipe whose end tells the server that its
    starter is gone; closed here, so that the server exits when the starter does, not when the last child does (the
    children die with the server)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    if server is None or server._forkserver_alive_fd is None or server._forkserver_pid is not None:
        return  # not forked by a fork server, or the descriptor is of a server of this process's own
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None


def run(environment: dict[str, str], streams: tuple | None, target: Callable[..., Any], *args: Any) -> None:
    """A child's first code: dies with its parent from here on, takes ``environment`` and ``streams`` (its starter's
    at the start: standard output and error as received file descriptors, or ``None`` to keep its own), then runs
    ``target(*args)``."""
    die_with_parent()
    starter = multiprocessing.parent_process()
    if starter is not None and not starter.is_alive():  # it died before the signal was set: it will never come
        os._exit(1)
    for number, stream in zip((1, 2), streams or ()):
        if stream is not None:
            received = stream.detach()
            os.dup2(received, number)
            os.close(received)
    os.environ.clear()
    os.environ.update(environment)
    _release_fork_server()
    target(*args)


def start(connection) -> None:
    """The sampler process's target: serves sampling requests."""
    from interop.sampling.background import serve  # the heavy imports happen here, once the child can die with us

    serve(connection)
