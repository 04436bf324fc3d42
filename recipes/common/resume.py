"""Training checkpoints a run can resume from: the model as a Hugging Face folder, the rest as a weights-only file.

A checkpoint is a folder ``<root>/step_<N>`` written atomically (``write_folder_atomically``): either it is complete
or it does not exist under that name, so a run killed at any instant (even ``SIGKILL`` during a save) leaves the
previous checkpoint as the latest. It holds:

- ``model/``: ``save_pretrained`` of the model and its tokenizer (safetensors), loadable by ``from_pretrained`` like
  any hub checkpoint; for a LoRA model (peft) the adapter only (``adapter_config.json`` +
  ``adapter_model.safetensors``), and, on request, ``merged_model/``: the full model with the adapter merged in;
- ``training_state.pt``: the optimizer state, the step, RNG states and whatever small state the recipe adds (only
  tensors, numbers, strings, lists and dicts, so that it loads with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import csv
import json
import random
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from recipes.common.checkpoint import save_merged_model_folder, save_model_folder, write_folder_atomically
from recipes.common.config import ConfigError

__all__ = [
    "MERGED_MODEL_FOLDER",
    "MODEL_FOLDER",
    "RESUMES_FILE",
    "STATE_FILE",
    "broken_checkpoint_advice",
    "capture_rng_state",
    "checkpoint_folder",
    "config_changes",
    "latest_checkpoint",
    "list_checkpoints",
    "load_training_state",
    "record_resume",
    "restore_rng_state",
    "save_checkpoint",
    "truncate_metrics_csv",
]

MODEL_FOLDER = "model"
MERGED_MODEL_FOLDER = "merged_model"
STATE_FILE = "training_state.pt"
RESUMES_FILE = "resumes.jsonl"  # one line per resume of the run: when, from which step, what changed
_STEP_FOLDER = re.compile(r"^step_(\d+)$")


def checkpoint_folder(root: str | Path, step: int) -> Path:
    """``<root>/step_<step>``, zero-padded so folders sort by step."""
    return Path(root) / f"step_{step:07d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, folder)``, oldest first (staging folders are hidden)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        match = _STEP_FOLDER.match(folder.name)
        if match and (folder / STATE_FILE).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint with the highest step under ``root``, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def capture_rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states (CUDA too when present), in a weights-only-loadable form."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts back what :func:`capture_rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int | None = None,
    model_state_dict: dict[str, torch.Tensor] | None = None,
    optimizer_state_dict: dict[str, Any] | None = None,
    save_merged: bool = False,
) -> Path:
    """Writes ``<root>/step_<step>`` atomically, then deletes all but the ``keep_last`` newest checkpoints.

    Args:
        root: the folder holding the run's checkpoints.
        step: the number of optimizer steps done.

    Keyword Args:
        model: a ``transformers`` model (``save_pretrained``).
        tokenizer: its tokenizer, saved beside it.
        optimizer: its state is saved.
        state: extra training state (numbers, strings, tensors, lists, dicts; the caller's RNG states among them,
            e.g. every rank's :func:`capture_rng_state`); ``step`` is added.
        keep_last: how many checkpoints to keep; ``None`` keeps all.
        model_state_dict: the weights to save instead of ``model``'s own (those of a sharded model, gathered:
            ``recipes.common.sharding.gather_full_state``).
        optimizer_state_dict: the optimizer state to save instead of ``optimizer.state_dict()`` (likewise).
        save_merged: a LoRA model's merged full model too, in ``merged_model/``.
    """

    if save_merged and model_state_dict is not None:
        raise ValueError(
            "save_checkpoint: save_merged=True merges the adapters of the model itself, but model_state_dict is "
            "given (a sharded model's gathered weights): save the adapter only, and merge it after loading."
        )

    def write(folder: Path) -> None:
        save_model_folder(model, tokenizer, folder / MODEL_FOLDER, state_dict=model_state_dict)
        if save_merged:
            save_merged_model_folder(model, tokenizer, folder / MERGED_MODEL_FOLDER)
        optimizer_state = optimizer_state_dict if optimizer_state_dict is not None else optimizer.state_dict()
        payload = {**state, "step": step, "optimizer": optimizer_state}
        torch.save(payload, folder / STATE_FILE)

    folder = write_folder_atomically(write, checkpoint_folder(root, step))
    if keep_last is not None:
        for _, old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def load_training_state(folder: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The ``training_state.pt`` of a checkpoint folder, loaded with ``weights_only=True``.

    A missing or unreadable file is refused with a :class:`ConfigError` naming it and the checkpoint to fall back to.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"The checkpoint {folder} has no {STATE_FILE}. {broken_checkpoint_advice(folder)}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError or EOFError, depending on the damage
        reason = str(error).split(". ")[0].splitlines()[0] if str(error) else "the file ends early"
        # Not chained: torch's message advises weights_only=False, which would run whatever code the file holds.
        raise ConfigError(
            f"{path} cannot be loaded ({type(error).__name__}: {reason}): it is corrupted or truncated (a disk that "
            f"filled up, a copy cut short), or no training state this recipe wrote. {broken_checkpoint_advice(folder)}"
        ) from None


def broken_checkpoint_advice(folder: str | Path) -> str:
    """What to do about the broken checkpoint ``folder``: delete it to resume from the previous one, if there is one.

    Returns "" for a folder that is no ``step_<N>`` checkpoint.
    """
    folder = Path(folder)
    match = _STEP_FOLDER.match(folder.name)
    if match is None:
        return ""
    earlier = [previous for step, previous in list_checkpoints(folder.parent) if step < int(match.group(1))]
    if earlier:
        return f"Delete the corrupted checkpoint folder {folder} to resume from {earlier[-1]} (the previous one)."
    return (
        f"No earlier checkpoint in {folder.parent} holds a training state: start the run afresh (drop resume=true, "
        "pass overwrite=true) or resume from a copy of the run made before this checkpoint was written."
    )


def truncate_metrics_csv(path: str | Path, last_step: int) -> None:
    """Drops the rows of ``metrics.csv`` logged after ``last_step``, so a resumed run's rows follow on without repeats.

    Rows written between the last checkpoint and a crash are recomputed by the resumed run.
    """
    path = Path(path)
    if not path.exists():
        return
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        return
    header, body = rows[0], rows[1:]
    step_column = header.index("step")
    kept = [row for row in body if row and int(float(row[step_column])) <= last_step]
    staging = path.with_name(f".{path.name}.tmp")
    with open(staging, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(kept)
    staging.replace(path)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        flat = {}
        for key, value in tree.items():
            flat.update(_flat(value, f"{prefix}{key}."))
        return flat if flat or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: list(tree) if isinstance(tree, (list, tuple)) else tree}


def config_changes(saved: Mapping, current: Mapping, *, ignored: Iterable[str] = ()) -> dict[str, tuple[Any, Any]]:
    """The settings that differ between two resolved configs, as ``{"a.b": (saved, current)}``; a key missing on one
    side reads as ``None``. A key of ``ignored`` (a dotted key, or the prefix of a group such as ``"logger"``) is left
    out.

    Examples:
        >>> config_changes({"lr": 1.0, "logger": {"kind": "csv"}}, {"lr": 2.0, "logger": {"kind": "none"}},
        ...                ignored=["logger"])
        {'lr': (1.0, 2.0)}
    """
    before, after = _flat(saved), _flat(current)
    skipped = tuple(ignored)

    def kept(key: str) -> bool:
        return not any(key == prefix or key.startswith(prefix + ".") for prefix in skipped)

    return {
        key: (before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if kept(key) and before.get(key) != after.get(key)
    }


def record_resume(folder: str | Path, *, step: int, changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Appends one line to ``<folder>/resumes.jsonl``: when the run resumed, from which step, with which changes."""
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "step": step,
        "changes": {k: list(v) for k, v in changes.items()},
    }
    with open(Path(folder) / RESUMES_FILE, "a") as handle:
        handle.write(json.dumps(entry) + "\n")
