"""Stops a local Ray cluster whose driver was killed: the standard library only, on purpose (it starts in a blink).

``ray.init()`` with no cluster to join starts one (GCS, raylet, agents, workers) as the driver's children. Ray ties
the GCS and the raylet to the driver, but on a SIGKILL of the driver Ray 2.60's dashboard and runtime-env agents
outlive it (measured: still running a minute later, re-parented to init). ``interop.sampling.workers.connect_ray``
starts this watcher beside a cluster it started: it notes the driver's descendants every half second and, when the
driver is gone without saying so (its end of the pipe closes with no ``done``), kills the ones it saw that still run
(matched by pid and start time, so a reused pid is never hit).

Run as ``python -m interop.sampling._ray_janitor <driver pid>``, the pipe on its standard input.
"""

from __future__ import annotations

import os
import select
import signal
import sys

__all__ = ["main"]

_INTERVAL_S = 0.5


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, start time), from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), fields[19])  # ppid, starttime (clock ticks since boot)
    return table


def _descendants(root: int, table: dict[int, tuple[int, str]]) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid == os.getpid() or pid in found:
            continue
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return found


def main(driver: int) -> None:
    seen: dict[int, str] = {}
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], _INTERVAL_S)
        if ready:
            line = stdin.readline()
            if line.strip() == b"done":
                return  # the driver shut its cluster down itself
            if not line:  # the driver is gone without a word
                break
        seen.update(_descendants(driver, _processes()))
    table = _processes()
    for pid, started in seen.items():
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
