"""Runs that several tests read: made once per test session, whichever test asks first, on whichever pytest-xdist
worker it runs (the folder and its lock sit in the session's temporary root, which the workers share), then only read.

Where tests assert different things of the same run (a multi-process run takes 10-30 s), each keeps its own name and
assertions and gets the run from :func:`shared_run`; a test that changes a run (a resume) copies its folder first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

_DONE = ".made"  # written last: a folder without it is an attempt that failed, made again by the next test to ask


def shared_runs_root(tmp_path_factory) -> Path:
    """The session's folder for shared runs: under xdist, the temporary root every worker's own root sits in (one per
    session); in a single process, that process's root (the parent would be shared with earlier sessions)."""
    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared_runs"
    folder.mkdir(exist_ok=True)
    return folder


def shared_run(root: Path, name: str, make: Callable[[Path], object]) -> Path:
    """The run folder ``root/name``, made by ``make(folder)`` unless a test of this session already made it. The lock
    is held while the run is made, so a second test asking for it waits for it rather than running it again."""
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (folder / _DONE).exists():
                shutil.rmtree(folder, ignore_errors=True)
                make(folder)
                (folder / _DONE).touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def copy_run(run: Path, to: Path) -> Path:
    """A copy of a shared run to change (a resume): the shared folder stays as its other readers expect it."""
    shutil.copytree(run, to, ignore=shutil.ignore_patterns(_DONE))
    return to
