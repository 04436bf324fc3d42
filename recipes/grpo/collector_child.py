"""The first code a background collector process runs: light on purpose.

A spawned process imports its target's module, and unpickles its arguments, before it runs any of its code; the
collector's module and its shared weights import torch and TorchRL, seconds of work during which a learner killed
by SIGKILL would leave the child running on its own. So the target is :func:`start`, here, with only the standard
library imported: it asks Linux to kill this process with its parent (``PR_SET_PDEATHSIG``), then receives what the
collector needs (its factory, the shared weights) through a pipe and hands over to
``recipes.grpo.collector_modes.collect``. (The parent also starts it without re-importing its own ``__main__``:
``recipes.grpo.collector_modes.BackgroundCollector``.)

Dependencies: the standard library.
"""

from __future__ import annotations

import ctypes
import signal
import sys

__all__ = ["die_with_parent", "start"]


def die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent dies, even by SIGKILL (elsewhere: the collector's polling of
    its parent suffices)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def start(connection, version, lock, wake, batches, stop) -> None:
    """The collector process's target: dies with its parent from here on, then collects."""
    die_with_parent()
    factory, weights, options = connection.recv()  # the heavy imports (torch, the recipe's modules) happen here
    connection.close()
    from recipes.grpo.collector_modes import collect

    collect(factory, weights, version, lock, wake, batches, stop, **options)
