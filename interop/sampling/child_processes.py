"""How the library starts its child processes (:class:`~interop.sampling.BackgroundSampler`'s, and the recipes'
collectors through the same helper): forked from Python's fork server, so that only the first child of a process
pays for importing torch, tensordict and transformers.

A spawned child is a new Python that imports everything it needs again: seconds of CPU before it does any work (2.8
for a sampler of the tiny policy, ``scripts/bench_child_start.py``; more for the recipe's collector), paid
by every child (every async job of a Hydra sweep, which runs its jobs one after another in one process, and every test
that starts one). With ``start_method="forkserver"`` (the default) multiprocessing starts one server process the first
time, which imports the modules named in ``preload`` once, and forks every child from it in milliseconds.

Public names:

- :data:`START_METHODS`: the start methods the library's children take.
- :func:`child_context`: the multiprocessing context of a start method, with the modules the fork server preloads.
- :func:`start_child`: a child process started on a target, as the library's children start.

What a child still gets as a spawned one did: the caller's current environment (``os.environ`` is sent with the
process and applied before the target runs; a variable that a preloaded module reads when imported keeps the value
it had when the server started), standard output and error (sent as file descriptors: the server's are those of its
start), working directory and ``sys.path`` (multiprocessing sends them); the caller's
``__main__`` is not imported again (:func:`main_module_hidden`); ``multiprocessing.parent_process()`` is the caller.

Process hygiene. The fork server is a process that multiprocessing starts for us (the first time a child starts) and
that stops when this process exits: it exits when the pipe it holds from this process reaches its end. Every child
dies with its parent, the server (``PR_SET_PDEATHSIG``, the child's first act: ``interop.sampling._child``), and the
server dies with this process (the same signal, set by the first module it preloads,
``interop.sampling._fork_server_guard``, when this process starts it from its main thread: Linux sends the signal
when the thread that started a process ends), so that a caller killed by SIGKILL leaves no process. The server forks
with one thread (no preloaded module starts one; ``tests/interop/test_child_processes.py`` checks it).

Where the fork server is not available (Windows), :func:`child_context` falls back to ``spawn``.

Dependencies: the standard library.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from interop.sampling import _child

__all__ = ["START_METHODS", "child_context", "main_module_hidden", "start_child"]

START_METHODS = ("forkserver", "spawn")

if TYPE_CHECKING:  # Windows has no ForkServerContext to name at run time
    from multiprocessing.context import ForkServerContext, SpawnContext

    ChildContext = SpawnContext | ForkServerContext

_GUARD = "interop.sampling._fork_server_guard"
# What the fork server of this process imports when it starts: every module asked for so far, in the order asked.
_preloaded: list[str] = []


def _preload(modules: Iterable[str]) -> None:
    for name in modules:
        if name and name not in ("__main__", "__mp_main__") and name not in _preloaded:
            _preloaded.append(name)


def child_context(start_method: str = "forkserver", *, preload: Iterable[str] = ()) -> ChildContext:
    """The multiprocessing context the library's children start in.

    Args:
        start_method: ``"forkserver"`` (children forked from a server that imported ``preload`` once) or ``"spawn"``
            (each child a new Python). ``"forkserver"`` falls back to ``"spawn"`` where the platform has no fork
            server (Windows).

    Keyword Args:
        preload: modules the fork server imports when it starts (what the children import: the target's module, the
            classes of the objects they receive). They add to those asked for before, and count if asked for before
            the server starts (the first child of this process); a child imports any other module itself. The caller's
            ``__main__`` is never preloaded.

    >>> child_context("spawn").get_start_method()
    'spawn'
    >>> child_context("fork")
    Traceback (most recent call last):
    ...
    ValueError: child_context: start_method must be one of ('forkserver', 'spawn'), got 'fork'.
    """
    if start_method not in START_METHODS:
        raise ValueError(f"child_context: start_method must be one of {START_METHODS}, got {start_method!r}.")
    if start_method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    _preload(preload)
    return multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """A child started by ``spawn`` or the fork server imports its parent's ``__main__`` (a training script, with all
    its imports) before it runs its target; the library's children need nothing from it, so it is hidden while they
    start."""
    main = sys.modules["__main__"]
    spec, path = getattr(main, "__spec__", None), main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = spec
        if path is not None:
            main.__file__ = path


class _StandardStreams:
    """This process's standard output and error, pickled as the file descriptors they are when a child starts (what
    a spawned child inherits; a forked one would write to the fork server's)."""

    def __reduce__(self):
        from multiprocessing import reduction

        def sent(number: int):
            try:
                os.fstat(number)
            except OSError:  # closed here: the child keeps its own
                return None
            return reduction.DupFd(number)

        return (tuple, ([sent(1), sent(2)],))


if hasattr(os, "register_at_fork"):
    # A process forked from this one (with a server running) must not hold on to this process's server.
    os.register_at_fork(after_in_child=_child.forget_fork_server)


def _ensure_fork_server() -> None:
    """Starts this process's fork server, with the modules asked for, if it is not running. The server is made to die
    with this process only when started from the main thread (see the module's docstring)."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload([_GUARD, *_preloaded])
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    os.environ[_child.FORK_SERVER_STARTER] = str(
        os.getpid()
    )  # what the guard checks: the server inherits this environment
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[_child.FORK_SERVER_STARTER]


def start_child(
    context: ChildContext,
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    name: str | None = None,
) -> multiprocessing.process.BaseProcess:
    """A daemon child process of ``context`` (:func:`child_context`) running ``target(*args)``, started.

    In the child, before ``target`` runs: it dies with its parent (``PR_SET_PDEATHSIG``), takes this process's
    environment, standard output and error of now, and lets go of the fork server's liveness pipe (which only this
    process should hold, so that the server exits with it). ``target``'s module should be light (the standard
    library): a ``spawn`` child imports it before any of that. With the fork server, the first call returns once the
    server has imported its preloaded modules (the seconds a spawned child spends on them after its start
    returned)."""
    streams = _StandardStreams() if context.get_start_method() == "forkserver" else None
    process = context.Process(
        target=_child.run, args=(dict(os.environ), streams, target, *args), daemon=True, name=name
    )
    with main_module_hidden():
        if context.get_start_method() == "forkserver":
            _ensure_fork_server()
        process.start()
    return process
