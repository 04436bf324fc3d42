"""Checkpoint folders: their layout, and atomic writes so that a crash never leaves a half-written folder behind.

A training checkpoint is a folder ``<root>/step_<N>`` (:func:`checkpoint_folder`) written atomically
(:func:`write_folder_atomically`): either it is complete or it does not exist under that name, so a run killed at any
instant (even ``SIGKILL`` during a save) leaves the previous checkpoint as the latest. It holds ``model/``
(:data:`MODEL_FOLDER`: ``save_pretrained`` of the model and its tokenizer, loadable by ``from_pretrained`` as any hub
checkpoint), optionally ``merged_model/`` (:data:`MERGED_MODEL_FOLDER`: a LoRA model's adapters merged in) and
``training_state.pt`` (:data:`STATE_FILE`: what a recipe needs to resume, loadable with
``torch.load(weights_only=True)``). This module knows the layout; what goes into the state is the recipe's
(``recipes.grpo.checkpointing``), and model loading (``recipes.common.models``) reads the layout to name the way out of
a damaged checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "MERGED_MODEL_FOLDER",
    "MODEL_FOLDER",
    "STATE_FILE",
    "broken_checkpoint_advice",
    "checkpoint_folder",
    "latest_checkpoint",
    "list_checkpoints",
    "recover_interrupted_writes",
    "save_model_folder",
    "write_folder_atomically",
]

MODEL_FOLDER = "model"
MERGED_MODEL_FOLDER = "merged_model"
STATE_FILE = "training_state.pt"
_STEP_FOLDER = re.compile(r"^step_(\d+)$")
_STAGING = re.compile(r"^\..+\.staging\..+$")
_PREVIOUS = re.compile(r"^\.(.+)\.previous$")


def save_model_folder(model, tokenizer, folder: str | os.PathLike, *, state_dict: dict | None = None) -> None:
    """``save_pretrained`` of a ``transformers`` model (safetensors) and its tokenizer into one folder, loadable with
    ``from_pretrained`` as a hub id is. ``state_dict``: the weights to write instead of the model's own (the full
    weights of a sharded model, gathered)."""
    model.save_pretrained(folder, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
    tokenizer.save_pretrained(folder)


def write_folder_atomically(write: Callable[[Path], None], destination: str | os.PathLike) -> Path:
    """Calls ``write(staging_folder)`` then swaps the staging folder in as ``destination``.

    The staging folder lives beside ``destination`` (same file system, so the final ``rename`` is atomic). An existing
    ``destination`` is moved aside first and deleted only once the new folder is in place, so at every instant either
    the old or the new complete folder exists under a name a reader can find.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.staging.", dir=destination.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would make the checkpoint private to this user
    try:
        write(staging)
        for file in staging.rglob("*"):
            if file.is_file():
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    previous = None
    if destination.exists():
        previous = destination.with_name(f".{destination.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        destination.rename(previous)
    staging.rename(destination)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return destination


def recover_interrupted_writes(folder: str | os.PathLike) -> list[str]:
    """Tidies ``folder`` after a process was killed inside :func:`write_folder_atomically` there.

    A staging folder (a write that never finished) is deleted. A ``.<name>.previous`` folder is put back as ``<name>``
    when the new ``<name>`` never arrived (the kill fell between the two renames), and deleted otherwise. Run it before
    the folder is written again, by one process. Returns what it did, one line per entry.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for entry in sorted(folder.iterdir()):
        if _STAGING.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"deleted the unfinished {entry.name}")
        elif match := _PREVIOUS.match(entry.name):
            destination = folder / match.group(1)
            if destination.exists():
                shutil.rmtree(entry, ignore_errors=True)
                done.append(f"deleted {entry.name}")
            else:
                entry.rename(destination)
                done.append(f"restored {destination.name} from {entry.name}")
    return done


def checkpoint_folder(root: str | os.PathLike, step: int) -> Path:
    """``<root>/step_<step>``, zero-padded so folders sort by step."""
    return Path(root) / f"step_{step:07d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
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


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step under ``root``, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def broken_checkpoint_advice(folder: str | os.PathLike) -> str:
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
