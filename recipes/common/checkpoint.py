"""Checkpoint folders: their layout, and atomic writes so that a crash never leaves a half-written folder behind.

A training checkpoint is a folder ``<root>/step_<N>`` (:func:`checkpoint_folder`) written atomically
(:func:`write_folder_atomically`): either it is complete or it does not exist under that name, so a run killed at any
instant (even ``SIGKILL`` during a save) leaves the previous checkpoint as the latest. It holds ``model/``
(:data:`MODEL_FOLDER`: ``save_pretrained`` of the model and its tokenizer, loadable by ``from_pretrained`` as any hub
checkpoint), optionally ``merged_model/`` (:data:`MERGED_MODEL_FOLDER`: a LoRA model's adapters merged in) and
``training_state.pt`` (:data:`STATE_FILE`: what a recipe needs to resume, loadable with
``torch.load(weights_only=True)``), and, written last, ``manifest.json`` (:func:`write_manifest`: every file with its
size, and a hash of the small ones), which :func:`check_manifest` compares with the folder before a run resumes from
it: a file deleted or changed since the save (a tokenizer gone, a weight file cut) names the checkpoint as damaged.
This module knows the layout; what goes into the state is the recipe's (``recipes.grpo.checkpointing``), and model
loading (``recipes.common.models``) reads the layout to name the way out of a damaged checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "MANIFEST_FILE",
    "MERGED_MODEL_FOLDER",
    "MODEL_FOLDER",
    "STATE_FILE",
    "broken_checkpoint_advice",
    "check_manifest",
    "checkpoint_folder",
    "latest_checkpoint",
    "latest_trl_checkpoint",
    "list_checkpoints",
    "recover_interrupted_writes",
    "save_model_folder",
    "write_folder_atomically",
    "write_manifest",
]

MODEL_FOLDER = "model"
MERGED_MODEL_FOLDER = "merged_model"
STATE_FILE = "training_state.pt"
MANIFEST_FILE = "manifest.json"
_HASHED_BYTES = 32 * 2**20  # files up to this size get a hash in the manifest (weights are checked by size)
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


def latest_trl_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest of a trl trainer's ``checkpoint-<step>`` folders in ``output_dir`` (its ``output_dir``), or
    ``None``."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(output_dir)
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def broken_checkpoint_advice(folder: str | os.PathLike) -> str:
    """What to do about the broken checkpoint ``folder``: delete it to resume from the previous one, if there is one.

    Returns "" for a folder that is no ``step_<N>`` checkpoint.
    """
    folder = Path(folder)
    match = _STEP_FOLDER.match(folder.name)
    if match is None:
        return ""
    earlier = [
        previous
        for step, previous in list_checkpoints(folder.parent)
        if step < int(match.group(1)) and not check_manifest(previous)
    ]
    if earlier:
        return (
            f"Delete the corrupted checkpoint folder {folder} to resume from {earlier[-1]} (the newest earlier one "
            "whose files match its manifest)."
        )
    return (
        f"No earlier checkpoint in {folder.parent} holds a training state: start the run afresh (drop resume=true, "
        "pass overwrite=true) or resume from a copy of the run made before this checkpoint was written."
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _listing(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(folder: str | os.PathLike) -> None:
    """Writes ``<folder>/manifest.json``: every file under ``folder`` with its size, and the sha256 of those up to
    32 MiB (configs, tokenizers, the training state; weight files by size). Call it last, once the folder is whole."""
    folder = Path(folder)
    files = {}
    for path in _listing(folder):
        size = path.stat().st_size
        entry = {"bytes": size}
        if size <= _HASHED_BYTES:
            entry["sha256"] = _sha256(path)
        files[path.relative_to(folder).as_posix()] = entry
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def check_manifest(folder: str | os.PathLike) -> list[str]:
    """What differs between ``folder`` and its ``manifest.json``: files missing, resized, changed or added, one line
    each; empty when the folder is as it was saved. A folder without a manifest (saved by an older version of the
    project) gives ``[]``: there is nothing to check it against."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return []
    try:
        expected = json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        return [f"{MANIFEST_FILE} is not a manifest this project wrote"]
    problems = []
    for name, entry in expected.items():
        file = folder / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, {entry['bytes']} were saved")
        elif "sha256" in entry and _sha256(file) != entry["sha256"]:
            problems.append(f"{name} was changed since it was saved")
    problems += [
        f"{p.relative_to(folder).as_posix()} was added"
        for p in _listing(folder)
        if p.relative_to(folder).as_posix() not in expected
    ]
    return problems
