"""Atomic checkpoint folders: a crash during a save never leaves a half-written checkpoint behind."""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["recover_interrupted_writes", "save_merged_model_folder", "save_model_folder", "write_folder_atomically"]

_STAGING = re.compile(r"^\..+\.staging\..+$")
_PREVIOUS = re.compile(r"^\.(.+)\.previous$")


def save_model_folder(model, tokenizer, folder: str | os.PathLike, *, state_dict: dict | None = None) -> None:
    """``save_pretrained`` of a ``transformers`` model (safetensors) and its tokenizer into one folder, loadable with
    ``from_pretrained`` as a hub id is. ``state_dict``: the weights to write instead of the model's own (the full
    weights of a sharded model, gathered)."""
    model.save_pretrained(folder, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
    tokenizer.save_pretrained(folder)


def save_merged_model_folder(model, tokenizer, folder: str | os.PathLike) -> None:
    """A LoRA model (``peft.PeftModel``) saved as one full ``transformers`` model, its adapters merged in: loadable
    without peft, computing what the adapted model does (``recipes.common.models.merge_adapters``). The merge runs on
    a copy (the model's own base weights stay untouched, bit for bit), which costs a second copy of the model in
    memory while it saves."""
    from recipes.common.models import merge_adapters  # models imports this module (through resume)

    save_model_folder(merge_adapters(copy.deepcopy(model)), tokenizer, folder)


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
