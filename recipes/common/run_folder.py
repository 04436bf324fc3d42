"""One output folder, one run: an earlier run's records are continued or cleared, never mixed with a new run's.

Rerunning a recipe into a folder that holds an earlier run would append to its ``metrics.csv`` (steps ``1 2 3 1 2 3``)
and overwrite its model. :func:`check_output_folder` refuses that before anything loads, unless the run continues the
earlier one (``resume=true``, GRPO) or asks for the folder to be cleared (``overwrite=true``), which
:func:`clear_records` then does. What Hydra writes at every start (``.hydra/``, the log file) and
``resolved_config.yaml`` are not records: a run rewrites them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from recipes.common.config import ConfigError
from recipes.common.metrics import WANDB_ID_FILE

__all__ = ["RECORDS", "check_output_folder", "clear_records", "earlier_records"]

# What a run leaves in its folder (either recipe).
RECORDS = (
    "metrics.csv",
    "summary.json",
    "checkpoints",
    "model",
    "buffer",
    "trainer",
    "trainer_log.json",
    "eval_pairs.jsonl",
    "batches",
    WANDB_ID_FILE,
)


def earlier_records(folder: str | Path) -> list[str]:
    """The records of an earlier run in ``folder``, by name (empty for a new or missing folder)."""
    folder = Path(folder)
    return [name for name in RECORDS if (folder / name).exists()]


def check_output_folder(folder: str | Path, *, overwrite: bool, resume: bool | None = None) -> None:
    """Refuses a folder that holds an earlier run's records unless ``resume`` or ``overwrite`` says what to do.

    Args:
        folder: the run's output folder.

    Keyword Args:
        overwrite: the records may be cleared (:func:`clear_records`) and the run started afresh.
        resume: the run continues the earlier one; ``None`` for a recipe that cannot resume.
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


def _check_writable(folder: Path) -> None:
    """Creates ``folder`` and writes a scratch file in it: a folder the run cannot write fails now, not at its first
    checkpoint."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_check"):
            pass
    except OSError as error:
        raise ConfigError(
            f"Cannot write the run's output folder {folder} ({error.strerror or error}): choose a folder this user "
            "may write (hydra.run.dir=... or output_dir=...), or fix its permissions."
        ) from None


def clear_records(folder: str | Path, *, keep: Iterable[str | Path] = ()) -> list[str]:
    """Deletes the earlier run's records from ``folder``, except those holding a path of ``keep`` (a buffer this run
    reads, say). Returns the names deleted."""
    folder = Path(folder)
    kept = [Path(path).expanduser().resolve() for path in keep]
    deleted = []
    for name in earlier_records(folder):
        record = (folder / name).resolve()
        if any(path == record or record in path.parents for path in kept):
            continue
        if record.is_dir():
            shutil.rmtree(record)
        else:
            record.unlink()
        deleted.append(name)
    return deleted
