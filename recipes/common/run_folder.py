"""One output folder, one run: an earlier run's records are continued or cleared, never mixed with a new run's, and
nothing a user keeps is deleted.

Rerunning a recipe into a folder that holds an earlier run would append to its ``metrics.csv`` (steps ``1 2 3 1 2 3``)
and overwrite its model. :func:`check_output_folder` refuses that before anything loads, unless the run continues the
earlier one (``resume=true``, GRPO) or asks for the folder to be cleared (``overwrite=true``), which
:func:`clear_records` then does: only the records a recipe writes, by name, inside the folder, a link deleted as a
link (never what it points to). An input of the run inside what would be cleared (a model, a tokenizer, data) is
refused first (:func:`check_inputs_survive_overwrite`). Hydra's records (``.hydra/``, the log file) and
``resolved_config.yaml`` are not records: a run that holds the folder rewrites them, a refused run leaves them be.

:class:`RunFolderLock` holds an exclusive lock on the folder for a run's life: a second run started on the same
folder is refused, naming the first one's process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from omegaconf import OmegaConf

from recipes.common.config import ConfigError
from recipes.common.metrics import WANDB_ID_FILE

__all__ = [
    "LOCK_FILE",
    "FolderInUse",
    "TRAINER_RECORD",
    "RECORDS",
    "RunFolderLock",
    "check_inputs_survive_overwrite",
    "check_output_folder",
    "check_trainer_output_dir",
    "check_writable",
    "clear_records",
    "earlier_records",
    "input_paths",
    "run_folder_holding",
]

LOCK_FILE = ".run.lock"
TRAINER_RECORD = "trainer"  # where a recipe's trl trainer writes its checkpoints, inside the run folder

# What a run leaves in its folder (either recipe).
RECORDS = (
    "metrics.csv",
    "summary.json",
    "checkpoints",
    "model",
    "buffer",
    TRAINER_RECORD,
    "trainer_log.json",
    "eval_pairs.jsonl",
    "batches",
    "rollouts",
    "resumes.jsonl",  # the resumes of the run (recipes.grpo.checkpointing)
    "failed.json",  # why a multirun job failed (recipes.common.run)
    WANDB_ID_FILE,
)


def earlier_records(folder: str | Path) -> list[str]:
    """The records of an earlier run in ``folder``, by name (empty for a new or missing folder)."""
    folder = Path(folder)
    return [name for name in RECORDS if (folder / name).exists()]


def run_folder_holding(path: str | Path) -> Path | None:
    """The run folder ``path`` lies in (links followed): the nearest of ``path`` and the folders above it that holds a
    run's records or its lock; ``None`` when there is none."""
    path = Path(path).expanduser().resolve()
    for folder in (path, *path.parents):
        if folder.is_dir() and (earlier_records(folder) or (folder / LOCK_FILE).exists()):
            return folder
    return None


def check_output_folder(
    folder: str | Path,
    *,
    overwrite: bool,
    resume: bool | None = None,
    inputs: Mapping[str, str | None] | None = None,
    keep: Iterable[str | Path] = (),
) -> None:
    """Refuses a folder that holds an earlier run's records unless ``resume`` or ``overwrite`` says what to do, and,
    with ``overwrite``, one whose records hold an input of the run (:func:`check_inputs_survive_overwrite`).

    Args:
        folder: the run's output folder.

    Keyword Args:
        overwrite: the records may be cleared (:func:`clear_records`) and the run started afresh.
        resume: the run continues the earlier one; ``None`` for a recipe that cannot resume.
        inputs: what the run reads, ``{setting: path}`` (:func:`input_paths`).
        keep: records the run keeps when it clears the folder (a buffer it reloads from there).
    """
    _check_writable(Path(folder))
    found = earlier_records(folder)
    if resume and overwrite:
        raise ConfigError(
            "resume=true continues the run in the folder and overwrite=true clears it: pass one of them, not both."
        )
    if found and not (resume or overwrite):
        continue_it = "pass resume=true to continue it, " if resume is not None else ""
        raise ConfigError(
            f"{folder} already holds an earlier run ({', '.join(found)}): {continue_it}pass overwrite=true to clear "
            "it and start afresh, or choose another output folder (hydra.run.dir=...)."
        )
    if overwrite and inputs:
        check_inputs_survive_overwrite(folder, inputs, keep=keep)


def check_trainer_output_dir(output_dir: str | os.PathLike, trainer_output_dir: str | os.PathLike) -> None:
    """trl writes its checkpoints to ``train.output_dir`` and deletes the old ones there (``save_total_limit``):
    only inside the run folder's ``trainer/`` do the run's lock, its check for an earlier run, ``resume`` and
    ``overwrite=true`` cover them."""
    record = Path(str(output_dir)).expanduser().resolve() / TRAINER_RECORD
    given = Path(str(trainer_output_dir)).expanduser().resolve()
    if given != record and record not in given.parents:
        raise ConfigError(
            f"train.output_dir={str(trainer_output_dir)!r} is outside this run's folder ({record.parent}): trl writes "
            "its checkpoints there and deletes old ones past train.save_total_limit, where neither this run's lock "
            "nor its checks for an earlier run (resume, overwrite=true) reach, so it could delete or overwrite "
            f"another run's checkpoints. Drop train.output_dir (it defaults to {record}), or point it inside {record}; "
            "to keep runs elsewhere, move the whole run (hydra.run.dir=... or output_dir=...)."
        )


def _check_writable(folder: Path) -> None:
    check_writable(
        folder,
        what="the run's output folder",
        fix="choose a folder this user may write (hydra.run.dir=... or output_dir=...), or fix its permissions",
    )


def check_writable(folder: str | os.PathLike, *, what: str, fix: str) -> None:
    """Creates ``folder`` and writes a scratch file in it: a folder the run cannot write fails at start-up, not after
    its first trained steps (a read-only ``checkpoints/``...).

    Keyword Args:
        what: the folder, as the message names it ("the run's checkpoints folder").
        fix: what to do, for the message.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_check"):
            pass
    except OSError as error:
        raise ConfigError(f"Cannot write {what} {folder} ({error.strerror or error}): {fix}.") from None


def _holds(record: Path, path: Path) -> bool:
    """Whether ``path`` is ``record`` or lies inside it, as written or once links are followed."""
    candidates = {path.absolute(), path.resolve()}
    places = {record.absolute()} | (set() if record.is_symlink() else {record.resolve()})
    return any(place == candidate or place in candidate.parents for place in places for candidate in candidates)


def clear_records(folder: str | Path, *, keep: Iterable[str | Path] = ()) -> list[str]:
    """Deletes the earlier run's records from ``folder``, except those holding a path of ``keep`` (a buffer this run
    reads, say). Only what a recipe writes, by name, inside ``folder``: a record that is a link is deleted as a link,
    what it points to is left alone. Returns the names deleted."""
    folder = Path(folder)
    kept = [Path(path).expanduser() for path in keep]
    deleted = []
    for name in earlier_records(folder):
        record = folder / name
        if any(_holds(record, path) for path in kept):
            continue
        if record.is_symlink() or not record.is_dir():
            record.unlink()
        else:
            shutil.rmtree(record)
        deleted.append(name)
    return deleted


def check_inputs_survive_overwrite(
    folder: str | Path, inputs: Mapping[str, str | None], *, keep: Iterable[str | Path] = ()
) -> None:
    """Refuses, before anything is deleted, an input of the run (``{setting: path}``: a model, a tokenizer, data)
    inside a record that ``overwrite=true`` would clear from ``folder`` (a run that would delete what it reads).
    Hub ids and unset inputs pass; ``keep`` are the records :func:`clear_records` will keep."""
    folder = Path(folder)
    kept = [Path(path).expanduser() for path in keep]
    for name in earlier_records(folder):
        record = folder / name
        if any(_holds(record, path) for path in kept):
            continue
        for setting, value in inputs.items():
            if value is not None and _holds(record, Path(str(value)).expanduser()):
                raise ConfigError(
                    f"overwrite=true would delete {record}, which {setting}={value!r} reads: the run would delete its "
                    f"own input. Copy it out of {folder} first (and point {setting} at the copy), or run in another "
                    "folder (hydra.run.dir=...)."
                )


def input_paths(cfg) -> dict[str, str | None]:
    """The paths a run of any recipe reads, by setting: its models' and tokenizers' folders (or hub ids), its data
    files or dataset folder, a buffer folder it reloads, the stored rollouts its replay loads."""
    paths = {}
    for node in ("model", "reward_model"):
        for key in ("name_or_path", "tokenizer_name_or_path"):
            paths[f"{node}.{key}"] = OmegaConf.select(cfg, f"{node}.{key}")
    for key in ("data.path", "data.eval_path", "data.name_or_path", "buffer.load_from", "rollout.replay.load_from"):
        paths[key] = OmegaConf.select(cfg, key, default=None)
    return paths


class FolderInUse(ConfigError):
    """The run folder is held by another run (:class:`RunFolderLock`)."""

    def __init__(self, folder: Path, message: str) -> None:
        super().__init__(message)
        self.folder = folder


class RunFolderLock:
    """An exclusive lock on a run folder for a run's life (``fcntl.flock`` on ``<folder>/.run.lock``, which holds the
    locking process's id). The kernel drops it when the process ends, however it ends.

    Raises:
        FolderInUse: another process holds the folder, naming its process id.
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._handle = open(self.path, "a+")  # noqa: SIM115 - held open for the run's life
        try:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "unknown"
            self._handle.close()
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise FolderInUse(
                Path(folder),
                f"{Path(folder)} is in use by another run (process {holder}): two runs in one folder would interleave "
                "their metrics and checkpoints. Wait for it to end, stop it, or run in another folder "
                "(hydra.run.dir=...).",
            ) from None
        self._handle.truncate(0)
        self._handle.write(str(os.getpid()))
        self._handle.flush()

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()
