"""The first code a background sampler process runs: the standard library only, on purpose.

A spawned process unpickles its arguments before it runs any of its code; the sampler's (a model on shared memory)
import torch and transformers, seconds during which a trainer killed by SIGKILL would leave the child running on its
own. So the child starts here: it asks Linux to kill it with its parent (``PR_SET_PDEATHSIG``), then receives the
model through its pipe and hands over to ``interop.sampling.background.serve``.

Dependencies: the standard library.
"""

from __future__ import annotations

import ctypes
import signal
import sys

__all__ = ["start"]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def start(connection) -> None:
    """The sampler process's target: dies with its parent from here on, then serves sampling requests."""
    _die_with_parent()
    from interop.sampling.background import serve  # the heavy imports happen here, once the child can die with us

    serve(connection)
