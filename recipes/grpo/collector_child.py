"""The first code a background collector process runs: light on purpose.

A spawned process imports its target's module, and unpickles its arguments, before it runs any of its code; the
collector's module and its shared weights import torch and TorchRL, seconds of work during which a learner killed
by SIGKILL would leave the child running on its own. So the target is :func:`start`, here, with only the standard
library imported, which the library's child entry (``interop.sampling._child.run``: the parent-death signal, the
learner's environment) runs; it receives what the collector needs (its factory, the shared weights) through a pipe and
hands over to ``recipes.grpo.collector_modes.collect``. (The parent also starts it without re-importing its own
``__main__``: ``interop.sampling.child_processes.start_child``.)

Dependencies: the standard library.
"""

from __future__ import annotations

__all__ = ["start"]


def start(connection, version, lock, wake, batches, stop) -> None:
    """The collector process's target (run once the child dies with its parent): collects."""
    factory, weights, options = connection.recv()  # the heavy imports (torch, the recipe's modules) happen here
    connection.close()
    from recipes.grpo.collector_modes import collect

    collect(factory, weights, version, lock, wake, batches, stop, **options)
