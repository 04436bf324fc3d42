"""``python <script> <arguments>`` run in the test's own process: its ``__main__`` block as a user types it (the
recipes' refusal of unknown keys, Hydra's command line, a multirun's launcher and exit status), without the 3.5-4 s a
new Python process spends importing torch, tensordict, transformers and torchrl again.

A test that is about the process itself (a signal, its lifetime, the processes it leaves, a launcher's worker
processes) still starts one. What a script changes of the process is put back: the command line, the working folder,
``sys.path``, the environment, the random generators, torch's thread count, the logging configuration Hydra replaces
(each logger's handlers, level and filters; Python warnings routed to logging), the warning filters, Hydra's global
state and the failed jobs a sweep records. The test reads what the script printed with pytest's ``capfd``.
"""

from __future__ import annotations

import logging
import os
import random
import runpy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def import_script(name: str):
    """``scripts/<name>.py`` imported as the module ``name``, for a test that calls its functions: the scripts folder on
    ``sys.path`` while it imports, as ``python scripts/<name>.py`` puts it first (the scripts import each other)."""
    import importlib

    folder = str(REPO_ROOT / "scripts")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def run_script(script: str | Path, *arguments: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT) -> int:
    """Runs ``script`` (relative to the repository's root, or absolute) as ``__main__`` with ``arguments``, from
    ``cwd``, with ``env`` added to the environment; returns its exit status (0 when it returns)."""
    from hydra.core.global_hydra import GlobalHydra

    import recipes.common.run as run_module

    path = Path(script) if Path(script).is_absolute() else REPO_ROOT / script
    saved_argv, saved_path, saved_cwd, saved_env = sys.argv[:], sys.path[:], os.getcwd(), dict(os.environ)
    saved_random, saved_numpy, threads = random.getstate(), np.random.get_state(), torch.get_num_threads()
    saved_loggers, saved_warning_filters = _logging_state(), warnings.filters[:]
    warnings_to_logging = logging._warnings_showwarning is not None  # type: ignore[attr-defined]
    saved_jobs, saved_own_file = list(run_module._FAILED_JOBS), run_module._OWN_FAILED_JOBS_FILE
    try:
        with torch.random.fork_rng(devices=[]):
            os.chdir(cwd)
            os.environ.update(env or {})
            sys.argv = [str(path), *arguments]
            sys.path.insert(0, str(path.parent))  # as ``python <script>`` puts the script's folder first
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as stop:
                return _exit_status(stop.code)
            return 0
    finally:
        GlobalHydra.instance().clear()
        if not warnings_to_logging:
            logging.captureWarnings(False)
        _restore_logging(saved_loggers)
        warnings.filters[:] = saved_warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
        run_module._FAILED_JOBS[:] = saved_jobs
        run_module._OWN_FAILED_JOBS_FILE = saved_own_file
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        random.setstate(saved_random)
        np.random.set_state(saved_numpy)
        torch.set_num_threads(threads)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # as Python does with a message given to sys.exit
    return 1


def _loggers() -> dict[str, logging.Logger]:
    loggers = {"": logging.getLogger()}
    for name, logger in logging.root.manager.loggerDict.items():
        if isinstance(logger, logging.Logger):  # not a placeholder of a dotted name's parent
            loggers[name] = logger
    return loggers


def _logging_state() -> dict[str, tuple]:
    return {
        name: (logger.handlers[:], logger.level, logger.filters[:], logger.propagate, logger.disabled)
        for name, logger in _loggers().items()
    }


def _restore_logging(saved: dict[str, tuple]) -> None:
    """Every logger as it was; the handlers the script opened (a run's log file) closed. A logger the script created
    keeps no handler of its own, so that it says nothing elsewhere than through the test's root logger."""
    kept = {id(handler) for handlers, *_ in saved.values() for handler in handlers}
    for name, logger in _loggers().items():
        for handler in logger.handlers:
            if id(handler) not in kept:
                handler.close()
        if name in saved:
            handlers, level, filters, propagate, disabled = saved[name]
            logger.handlers[:], logger.filters[:] = handlers, filters
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, disabled
        else:
            logger.handlers.clear()


class ForkedScript:
    """``python <script> <arguments>`` in a process of its own forked from this one, for the tests about that process
    (a signal it gets, its exit status, the processes it leaves): :func:`run_script` in the child, which has this
    process's imports already, so it starts in milliseconds instead of 4-5 s. Forked by multiprocessing, which resets
    its own state in the child (the file-descriptor sharer that hands tensors to a spawned collector, whose thread a
    bare fork would leave dead). SIGINT and SIGTERM are Python's defaults in the child (a test worker may ignore
    SIGINT), its standard output goes nowhere and its standard error to ``stderr_path``. ``poll``, ``wait``,
    ``send_signal``, ``kill`` and ``pid`` as a ``subprocess.Popen``'s. ``prepare()``, if given, runs in the child first
    (to drop state of this process's that a new Python would not have)."""

    def __init__(
        self,
        script: str | Path,
        *arguments: str,
        stderr_path: Path,
        env: dict[str, str] | None = None,
        prepare: Callable[[], None] | None = None,
    ):
        import multiprocessing

        self.stderr_path = Path(stderr_path)
        self._process = multiprocessing.get_context("fork").Process(
            target=_run_forked, args=(str(script), arguments, env, str(stderr_path), prepare), name=f"forked {script}"
        )
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float) -> int:
        self._process.join(timeout)
        if self._process.is_alive():
            raise TimeoutError(f"process {self.pid} still running after {timeout} s")
        return self._process.exitcode

    def send_signal(self, signal_number: int) -> None:
        if self._process.is_alive():
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join(30)

    def stderr_text(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""


def _run_forked(
    script: str,
    arguments: tuple[str, ...],
    env: dict[str, str] | None,
    stderr_path: str,
    prepare: Callable[[], None] | None = None,
) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with open(os.devnull, "w") as devnull, open(stderr_path, "w") as stderr:
        os.dup2(devnull.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
    # The test's sys.stdout and sys.stderr write to pytest's capture, not to the descriptors: the child's own.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's, open until it exits
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if prepare is not None:
        prepare()
    sys.exit(run_script(script, *arguments, env=env))
