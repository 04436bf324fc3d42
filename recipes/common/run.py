"""One start and one finish for every recipe, so that each recipe's own code is its builds and its loop.

:func:`start_run` does what any run does before its models load: torch threads, tensordict's list-to-stack mode, the
processes (one, or those of ``torchrun`` / ``accelerate launch``, through accelerate's ``PartialState``), one output
folder for all of them (tidied of interrupted writes, cleared with ``overwrite=true``), the resolved config and the
metric logger on the main process. :meth:`Run.finish` writes ``summary.json``, puts the summary in the logger (the wandb
run's summary) and logs the closing message. :func:`seed_everything` is the one way the recipes seed.
:func:`run_recipe` wraps a recipe's ``train`` in its Hydra entry point so that the run's log says how it ended.
:func:`check_sharded_launch` refuses an ``accelerate launch --use_fsdp`` that accelerate would not shard.

A plain ``python recipes/x.py`` run is process 0 of 1, and every collective here is then a no-op.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, set_seed
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from tensordict import set_list_to_stack

from recipes.common.checkpoint import latest_checkpoint, recover_interrupted_writes
from recipes.common.config import (
    ConfigError,
    RunStopped,
    config_record,
    hydra_records,
    mask_overrides_in_text,
    mask_sweep_record,
    write_hydra_records,
    write_run_config,
)
from recipes.common.metrics import MetricLogger, make_logger
from recipes.common.run_folder import (
    LOCK_FILE,
    FolderInUse,
    RunFolderLock,
    check_writable,
    clear_records,
    earlier_records,
)

__all__ = [
    "FAILED_FILE",
    "SUMMARY_FILE",
    "Interrupted",
    "Run",
    "RunFolderCheck",
    "accelerate_shards_on",
    "check_sharded_launch",
    "end_processes",
    "exit_if_jobs_failed",
    "mask_sweep_logs",
    "track_failed_jobs",
    "run_recipe",
    "seed_everything",
    "start_run",
]

SUMMARY_FILE = "summary.json"

log = logging.getLogger(__name__)


@dataclass
class Run:
    """A started run: its config, its processes, its folder and its logger (a no-op logger off the main process)."""

    cfg: DictConfig
    processes: PartialState
    output_dir: Path
    logger: MetricLogger
    started: float = field(default_factory=time.perf_counter)
    lock: RunFolderLock | None = None  # the main process's lock on the output folder

    @property
    def is_main(self) -> bool:
        return self.processes.is_main_process

    def broadcast(self, obj):
        """The main process's ``obj`` on every process (the others wait for it)."""
        return broadcast_object_list([obj])[0] if self.processes.use_distributed else obj

    def finish(self, summary: dict, closing_message: str, *, warn: bool = False) -> dict:
        """Puts ``summary`` in the logger, closes it and, on the main process, writes ``summary.json`` and logs
        ``closing_message`` (where the run is, its headline figures, what to run next; as a warning with ``warn``)."""
        try:
            self.logger.log_summary(summary)
        finally:
            self.logger.close()
        if self.is_main:
            (self.output_dir / SUMMARY_FILE).write_text(json.dumps(_json_numbers(summary), indent=2, allow_nan=False))
            (log.warning if warn else log.info)(closing_message)
        return summary

    def close(self) -> None:
        """Closes the logger (a wandb run): Hydra multirun jobs share a process, and a run left open would swallow the
        next job's metrics. :meth:`finish` closes it too; a second close does nothing. Releases the folder's lock."""
        try:
            self.logger.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _json_numbers(summary: dict) -> dict:
    """``summary`` with NaN and infinities as null: ``summary.json`` stays valid JSON (a Spearman coefficient over
    constant scores is NaN)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def start_run(
    cfg: DictConfig,
    *,
    tidy: Iterable[Path] = (),
    keep: Iterable[str | Path] = (),
    resume: bool = False,
    before_config: Callable[[Path], None] | None = None,
    backend: str | None = None,
) -> Run:
    """Starts a run of ``cfg`` (``num_threads``, ``output_dir``, ``overwrite``, ``logger``); every process calls it.

    Keyword Args:
        tidy: folders where a kill may have left an atomic write half done (the output folder is always one).
        keep: what ``overwrite=true`` must not delete (a buffer this run reads).
        resume: the run continues the folder's run: its wandb run goes on.
        before_config: called on the main process with the output folder before the resolved config replaces the
            previous one (a resume records what it changes).
        backend: the process group's backend under a launcher (None: nccl on CUDA, gloo on CPU). A process group
            already set up (trl's config sets one up) is joined as it is.
    """
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    set_list_to_stack(True).set()  # TorchRL's LLM wrappers keep lists of strings as non-tensor stacks
    # CPU processes under a launcher on a GPU node must say so (gloo, not nccl); a single process takes the defaults
    # (trl's config sets the same state up afterwards with its own device choice).
    launched_on_cpu = "WORLD_SIZE" in os.environ and not str(cfg.device).startswith("cuda")
    processes = PartialState(cpu=launched_on_cpu, **({"backend": backend} if backend else {}))
    run = Run(cfg, processes, Path(cfg.output_dir), MetricLogger("none", Path(cfg.output_dir)))
    # Hydra names each process's folder from its own clock: every process writes where the main process does.
    run.output_dir = Path(run.broadcast(str(cfg.output_dir)))
    cfg.output_dir = str(run.output_dir)
    if run.is_main:
        run.lock = RunFolderLock(run.output_dir)  # a second run on this folder is refused, naming this process
        for folder in {run.output_dir, *map(Path, tidy)}:
            for done in recover_interrupted_writes(folder):
                log.warning("Interrupted writes of an earlier run in %s: %s.", folder, done)
        if cfg.overwrite:
            clear_records(run.output_dir, keep=keep)
        if before_config is not None:
            before_config(run.output_dir)
        write_hydra_records(run.output_dir, _hydra_records_due.pop(str(run.output_dir), {}))
        write_run_config(cfg, run.output_dir)
        if cfg.logger.kind != "none":
            run.logger = make_logger(cfg.logger, run.output_dir, config=config_record(cfg), resume=resume)
    processes.wait_for_everyone()  # the others go on once the folder is ready
    return run


def seed_everything(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's generators (every device's): the one way the recipes seed. accelerate's
    ``set_seed`` seeds what transformers' does; transformers' would import its Trainer utilities, and peft with them
    (0.7 s of every process's start, a refused run's too)."""
    set_seed(seed)


def accelerate_shards_on(device: str) -> bool:
    """Whether ``accelerate launch --use_fsdp`` shards a model on processes of ``device``. accelerate 1.x turns FSDP
    on for GPU-like process groups only: on CPU processes it keeps DDP, every process holding the whole model."""
    return torch.device(device).type != "cpu"


def check_sharded_launch(device: str) -> None:
    """Refuses, before anything loads, a launch with ``--use_fsdp`` (accelerate's ``ACCELERATE_USE_FSDP``) on a device
    where accelerate would train every process on a whole copy of the model without a word; warns when it would
    shard the model as one unit (no ``--fsdp_auto_wrap_policy``), gathering all its weights at once."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if not accelerate_shards_on(device):
        raise ConfigError(
            f"accelerate launch --use_fsdp with device={device}: accelerate shards models on GPUs only, and on CPU "
            "processes it would silently keep a whole copy of the model on every process (DDP). Launch CPU "
            "processes with --multi_gpu instead of --use_fsdp (the same training, not sharded), or shard on GPUs: "
            "device=cuda."
        )
    if os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper() == "NO_WRAP":
        log.warning(
            "accelerate launch --use_fsdp without --fsdp_auto_wrap_policy: the model is one FSDP unit, whose forward "
            "gathers all of its weights on every process at once. Add --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP "
            "(a unit per decoder layer)."
        )


def end_processes() -> None:
    """Destroys the process group a launcher's run set up, once per process after its last Hydra job: left alive,
    gloo's threads can abort the interpreter's shutdown ("terminate called without an active exception")."""
    PartialState().destroy_process_group()


class Interrupted(BaseException):
    """The run got SIGINT or SIGTERM (a BaseException, as KeyboardInterrupt: no ``except Exception`` swallows it)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextlib.contextmanager
def _interruptions_raised() -> Iterator[None]:
    """SIGTERM (a scheduler's or ``kill``'s stop) raises :class:`Interrupted` in the run, as SIGINT raises
    KeyboardInterrupt, so that ``finally`` blocks run (a background collector is stopped) and the log says so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# Hydra's records of each run this process started (recipes.common.config.hydra_records) by folder, until the run
# holds its folder: a run refused on another run's folder must not replace that run's records.
_hydra_records_due: dict[str, dict[str, str]] = {}

# Jobs of this process's Hydra multirun that failed (their folders hold failed.json); the sweep goes on past them.
_FAILED_JOBS: list[str] = []
FAILED_FILE = "failed.json"
# A file the jobs of a sweep append their failures to, one folder a line: a launcher that runs the jobs in other
# processes (joblib's workers) leaves the sweep's own process no other way to learn of them.
FAILED_JOBS_ENV = "RECIPES_FAILED_JOBS_FILE"
_OWN_FAILED_JOBS_FILE: str | None = None


def track_failed_jobs() -> None:
    """Called before Hydra starts the jobs (a recipe's ``__main__``): every job process, a launcher's workers included,
    inherits the file its failures go to (:data:`FAILED_JOBS_ENV`), which :func:`exit_if_jobs_failed` reads."""
    global _OWN_FAILED_JOBS_FILE
    if FAILED_JOBS_ENV in os.environ:
        return
    handle, path = tempfile.mkstemp(prefix="recipes_failed_jobs_", suffix=".txt")
    os.close(handle)
    os.environ[FAILED_JOBS_ENV] = _OWN_FAILED_JOBS_FILE = path


# The loggers of Hydra's launchers (basic, joblib, submitit): each lists every job's overrides before the job starts
# ("#0 : seed=0 +train.hub_token=hf_..."), on the terminal and in whatever captures it (a CI or SLURM log).
_LAUNCHER_LOGGERS = (
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
)


class _MaskedOverrides(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = mask_overrides_in_text(record.getMessage()), None
        return True


def mask_sweep_logs() -> None:
    """Called before Hydra starts the jobs (a recipe's ``__main__``): the job lists Hydra's launchers log show each
    override with its secrets masked (``recipes.common.config.mask_override``). A filter on the logger itself:
    Hydra replaces the handlers when it configures logging, not the loggers' filters."""
    for name in _LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _MaskedOverrides) for existing in logger.filters):
            logger.addFilter(_MaskedOverrides())


def _record_failed_job(folder: str) -> None:
    _FAILED_JOBS.append(folder)
    path = os.environ.get(FAILED_JOBS_ENV)
    if path:
        with open(path, "a") as handle:  # one short line per append: whole lines, whatever the process
            handle.write(folder + "\n")


def run_recipe(
    train: Callable[[DictConfig], dict],
    cfg: DictConfig,
    *,
    last_checkpoint: Callable[[DictConfig], Path | str | None] | None = None,
) -> dict:
    """Runs ``train(cfg)`` and returns its summary; on failure, logs why and exits with status 1 (in a Hydra
    multirun: records the failure in the job's folder and returns, so that the sweep goes on; the process exits
    non-zero at the end, listing the failed jobs: :func:`exit_if_jobs_failed`).

    A :class:`ConfigError` (bad settings or data, raised before the expensive work) or a
    :class:`~recipes.common.config.RunStopped` (a full disk, a non-finite value) is logged as its message alone:
    the message names the setting and the fix, and a traceback would only bury it. Any other error is logged with its
    traceback. SIGINT and SIGTERM are logged with the run's last checkpoint (``last_checkpoint(cfg)``; by default the
    newest of ``<output_dir>/checkpoints``). Python warnings go to the log as well. Hydra's records of the run
    (``.hydra/``, secrets masked) are written once the run holds its folder, or at its refusal in a folder of its own:
    a run refused on another run's folder changes nothing there (not its records, not its log). In a multirun, the
    sweep folder's ``multirun.yaml`` has its secrets masked before anything else runs.
    """
    logging.captureWarnings(True)
    folder = Path(str(cfg.output_dir))
    _hydra_records_due[str(folder)] = hydra_records(cfg)  # written by start_run, once the run holds the folder
    mask_sweep_record()
    try:
        with _interruptions_raised():
            return train(cfg)
    except (KeyboardInterrupt, Interrupted) as stop:
        name = stop.signal_name if isinstance(stop, Interrupted) else "SIGINT"
        checkpoint = (
            last_checkpoint(cfg)
            if last_checkpoint is not None
            else latest_checkpoint(Path(str(cfg.output_dir)) / "checkpoints")
        )
        log.error(
            "The run was interrupted by %s. Its last checkpoint: %s.",
            name,
            f"{checkpoint} (resume=true continues from it)" if checkpoint else "none",
        )
        raise SystemExit(128 + signal.Signals[name].value) from None
    except (ConfigError, RunStopped) as error:
        if isinstance(error, FolderInUse):
            _stop_logging_into(error.folder)  # the log there is the other run's
        log.error("%s", error)
        reason = str(error)
    except Exception as error:
        log.exception("The run failed; the traceback follows.")
        reason = f"{type(error).__name__}: {error}"
    # The folder is this run's when start_run took its records (the run held it) or it holds no other run's.
    records = _hydra_records_due.pop(str(folder), None)
    own_folder = records is None or not (earlier_records(folder) or (folder / LOCK_FILE).exists())
    if own_folder and records:
        write_hydra_records(folder, records)  # a run refused in a folder of its own keeps its records of what was run
    if not _in_multirun():
        raise SystemExit(1)
    _record_failed_job(str(folder))
    if own_folder:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FAILED_FILE).write_text(json.dumps({"reason": reason}, indent=2))
    return {cfg.metric: float("nan")}


class RunFolderCheck(Callback):
    """A Hydra callback (``hydra.callbacks`` of every recipe's config) that checks, before Hydra creates the run's
    folder (a multirun's sweep folder) and opens its log there, that the folder can be written: otherwise Hydra's own
    ``mkdir`` or log handler fails with a raw traceback. Says which folder, why, and what to do; exits with status 1."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, "hydra.run.dir", "the run's output folder")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, "hydra.sweep.dir", "the sweep's folder")

    @staticmethod
    def _check(config: DictConfig, key: str, what: str) -> None:
        try:
            folder = Path(str(OmegaConf.select(config, key)))
        except Exception:  # an interpolation only a job can resolve: Hydra creates and reports that folder itself
            return
        try:
            check_writable(
                folder, what=what, fix=f"choose a folder this user may write ({key}=...), or fix its permissions"
            )
        except ConfigError as error:
            print(error, file=sys.stderr)
            raise SystemExit(1) from None


def _stop_logging_into(folder: Path) -> None:
    """Closes the log files Hydra opened inside ``folder`` for this run: what this run says goes to the terminal."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == folder.resolve():
            root.removeHandler(handler)
            handler.close()


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def exit_if_jobs_failed() -> None:
    """At the end of a Hydra multirun, whatever its launcher: exits with status 1 listing the jobs that failed (each
    folder's ``failed.json`` says why); nothing when every job finished."""
    failed = list(_FAILED_JOBS)
    path = os.environ.get(FAILED_JOBS_ENV)
    if path and os.path.isfile(path):
        with open(path) as handle:
            failed += [line.strip() for line in handle if line.strip()]
        if path == _OWN_FAILED_JOBS_FILE:
            os.remove(path)
    failed = list(dict.fromkeys(failed))
    if failed:
        listed = "\n".join(f"  {folder} (see its {FAILED_FILE})" for folder in failed)
        print(f"{len(failed)} job(s) of the sweep failed:\n{listed}", file=sys.stderr)
        raise SystemExit(1)
