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

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["FORK_SERVER_STARTER", "die_with_parent", "forget_fork_server", "run", "start"]

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


def forget_fork_server() -> None:
    """Lets go of a fork server this process holds only as a copy: in a child the server forked, or in a process
    forked from one that runs a server (a test's forked script, a user's ``fork``). Its copy of the pipe whose end
    tells the server that its starter is gone is closed, so that the server exits with its starter, not with the last
    child (the children die with the server); and the server is forgotten (multiprocessing would fail to check on a
    server that is not this process's child): this process starts one of its own when it needs one."""
    forkserver = sys.modules.get("multiprocessing.forkserver")  # not imported: no server to let go of
    server = getattr(forkserver, "_forkserver", None)
    if server is None or server._forkserver_alive_fd is None:
        return
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


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
    forget_fork_server()
    target(*args)


def start(connection) -> None:
    """The sampler process's target: serves sampling requests."""
    from interop.sampling.background import serve  # the heavy imports happen here, once the child can die with us

    serve(connection)
