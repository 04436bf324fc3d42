"""A run's labelled preference pairs kept in a folder, which a later run's ``buffer.load_from`` reuses (no generation,
no labelling): the text of every pair, and the training pairs' TorchRL storage (their token ids), checked on load.

- :func:`save_labelled_pairs`: writes the folder atomically (``pairs.jsonl``, ``eval_pairs.jsonl``,
  ``eval_responses.jsonl``, ``storage/``, ``meta.json``).
- :func:`load_labelled_pairs`: reads it back; a cut or damaged folder is refused, naming the file. With the tokenizer
  that wrote it (:func:`tokenizer_fingerprint`) the run trains from ``storage/`` itself, with another it re-tokenizes
  the text.
- :func:`read_meta`: the folder's ``meta.json``, the cheap check a recipe runs before anything loads.

Dependencies: torch, tensordict, omegaconf.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from tensordict import TensorDict

from recipes.common.checkpoint import write_folder_atomically
from recipes.common.config import ConfigError, tensordict_key
from recipes.common.data import BadJsonLine, parse_json_lines
from recipes.common.models import tokenizer_fingerprint
from recipes.reward.pairs import LabelledPairs, drop_identical_pairs, tokenize_pairs
from recipes.reward.schema import PairKeys

__all__ = [
    "EVAL_PAIRS_FILE",
    "EVAL_RESPONSES_FILE",
    "META_FILE",
    "STORAGE_FOLDER",
    "TRAIN_PAIRS_FILE",
    "load_labelled_pairs",
    "read_meta",
    "save_labelled_pairs",
    "tokenizer_fingerprint",
    "write_jsonl",
]

log = logging.getLogger(__name__)
# A labelled-data folder (buffer.path / buffer.load_from)
TRAIN_PAIRS_FILE, EVAL_PAIRS_FILE, EVAL_RESPONSES_FILE = "pairs.jsonl", "eval_pairs.jsonl", "eval_responses.jsonl"
STORAGE_FOLDER, META_FILE = "storage", "meta.json"
# What to do with a buffer folder that is incomplete or damaged.
REBUILD_BUFFER = (
    "Restore the folder from a copy, or rebuild it with a run of buffer=memmap (it writes <run dir>/buffer) and point "
    "buffer.load_from at that."
)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object a line."""
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the buffer folder is incomplete. {REBUILD_BUFFER}")
    try:
        return parse_json_lines(path.read_text().splitlines())
    except BadJsonLine as bad:
        raise ConfigError(f"{path}, line {bad.line_number}: {bad.reason}. {REBUILD_BUFFER}") from None


def _pair_keys_layout(keys: PairKeys) -> dict:
    return dataclasses.asdict(keys)


def save_labelled_pairs(
    folder: str | os.PathLike, labelled: LabelledPairs, pairs_td, *, tokenizer, pair_keys: PairKeys
) -> Path:
    """Writes a run's labelled data atomically, for a later run's ``buffer.load_from``.

    ``pairs.jsonl`` / ``eval_pairs.jsonl`` / ``eval_responses.jsonl`` hold the text (re-tokenized by a run with another
    reward model), ``storage/`` the buffer's tensors as a tensordict memmap (what ``buffer=memmap`` samples from, and
    what a later run with the same tokenizer trains from). ``meta.json`` holds the row counts, the tokenizer's
    fingerprint and the keys of ``storage/``, which :func:`load_labelled_pairs` checks.
    """

    def write(staging: Path) -> None:
        write_jsonl(staging / TRAIN_PAIRS_FILE, labelled.train)
        write_jsonl(staging / EVAL_PAIRS_FILE, labelled.eval)
        write_jsonl(staging / EVAL_RESPONSES_FILE, labelled.eval_responses)
        # copy_existing: the pairs may be a reloaded buffer's memory-mapped storage, which memmap() will not move.
        pairs_td.memmap(staging / STORAGE_FOLDER, copy_existing=True)
        meta = {
            "conversational": labelled.conversational,
            "num_pairs": len(labelled.train),
            "num_eval_pairs": len(labelled.eval),
            "num_eval_responses": len(labelled.eval_responses),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "pair_keys": _pair_keys_layout(pair_keys),
            "storage_bytes": _storage_file_sizes(staging / STORAGE_FOLDER),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2))

    return write_folder_atomically(write, folder)


def _storage_file_sizes(path: Path) -> dict[str, int]:
    """The size of each tensor file of a tensordict memmap folder: tensordict zero-fills a cut file when it loads it."""
    return {str(file.relative_to(path)): file.stat().st_size for file in sorted(path.rglob("*.memmap"))}


def read_meta(folder: Path) -> dict:
    """The ``meta.json`` of a folder written by :func:`save_labelled_pairs`, refused when missing or unreadable."""
    path = folder / META_FILE
    if not path.is_file():
        raise ConfigError(
            f"buffer.load_from={str(folder)!r} is not a saved preference buffer (no {META_FILE} in it). Point it at "
            "the buffer folder of an earlier run made with buffer=memmap (<run dir>/buffer)."
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}). {REBUILD_BUFFER}") from err
    missing = [name for name in ("conversational", "num_pairs") if not isinstance(meta, dict) or name not in meta]
    if missing:
        raise ConfigError(f"{path} lacks {missing}. {REBUILD_BUFFER}")
    return meta


def _check_row_counts(folder: Path, meta: dict, labelled: LabelledPairs) -> None:
    """Each text file holds as many rows as the meta says were written: a cut or padded file is refused."""
    expected = {
        TRAIN_PAIRS_FILE: ("num_pairs", labelled.train),
        EVAL_PAIRS_FILE: ("num_eval_pairs", labelled.eval),
        EVAL_RESPONSES_FILE: ("num_eval_responses", labelled.eval_responses),
    }
    for name, (count_key, rows) in expected.items():
        if count_key in meta and len(rows) != meta[count_key]:  # folders of older versions record num_pairs only
            raise ConfigError(
                f"{folder / name} holds {len(rows)} rows, but {folder / META_FILE} says {meta[count_key]} were "
                f"written ({count_key}): the file was cut or edited. {REBUILD_BUFFER}"
            )


def _load_storage(folder: Path, meta: dict):
    """The stored token ids (memory-mapped, nothing read yet), refused unless they are the meta's ``num_pairs`` rows."""
    path = folder / STORAGE_FOLDER
    if not path.is_dir():
        raise ConfigError(f"{path} is missing: the buffer folder is incomplete. {REBUILD_BUFFER}")
    # Checked before loading: tensordict would read a cut tensor file as zeros (and grow it to size on disk).
    expected, found = meta.get("storage_bytes"), _storage_file_sizes(path)
    if expected is not None and found != expected:  # folders of older versions record no sizes
        changed = sorted(name for name in {*expected, *found} if expected.get(name) != found.get(name))
        raise ConfigError(
            f"{path} cannot be read as the tensordict memmap it was written as: {changed} differ from the sizes in "
            f"{folder / META_FILE} (bytes written: {[expected.get(name) for name in changed]}, found: "
            f"{[found.get(name) for name in changed]}). {REBUILD_BUFFER}"
        )
    pickled = sorted(str(file.relative_to(folder)) for file in path.rglob("*.pickle"))
    if pickled:
        raise ConfigError(_PICKLED.format(path=path, files=pickled, rebuild=REBUILD_BUFFER))
    try:
        # allow_pickle=False: a pickled entry would run whatever code it holds as it loads.
        stored = TensorDict.load_memmap(path, allow_pickle=False)
    except Exception as err:  # a damaged memmap fails in many ways (json, sizes, missing files, pickled entries)
        if "pickle" in str(err).lower():
            raise ConfigError(_PICKLED.format(path=path, files="its entries", rebuild=REBUILD_BUFFER)) from None
        raise ConfigError(f"{path} cannot be read as a tensordict memmap ({err!r:.300}). {REBUILD_BUFFER}") from err
    rows = stored.batch_size[0] if stored.batch_size else None
    if rows != meta["num_pairs"]:
        raise ConfigError(
            f"{path} holds {rows} pairs, but {folder / META_FILE} says {meta['num_pairs']} were written (num_pairs): "
            f"the storage and the text disagree. {REBUILD_BUFFER}"
        )
    return stored


_PICKLED = (
    "{path} holds pickled entries ({files}): this project never unpickles a buffer folder, since a pickle runs "
    "whatever code it holds as it loads. A buffer this recipe wrote holds tensors only; {rebuild}"
)
# At most this many rows of pairs.jsonl are tokenized again and compared with storage/ when a run reuses its ids.
_TEXT_CHECK_ROWS = 64


def _check_text_matches_storage(folder: Path, labelled: LabelledPairs, stored, tokenizer, pair_keys) -> None:
    """Refuses a folder whose ``pairs.jsonl`` no longer says what ``storage/`` holds (chosen and rejected swapped, a
    pair edited while the storage was kept): rows spread over the file are tokenized again and compared."""
    count = len(labelled.train)
    checked = min(count, _TEXT_CHECK_ROWS)
    rows = sorted({round(i * (count - 1) / max(1, checked - 1)) for i in range(checked)})
    expected = tokenize_pairs(tokenizer, [labelled.train[row] for row in rows], conversational=labelled.conversational)
    for side, ids in zip(("chosen", "rejected"), expected, strict=True):
        tokens = stored.get(tensordict_key(getattr(pair_keys, f"{side}_tokens")))
        lengths = stored.get(tensordict_key(getattr(pair_keys, f"{side}_length")))
        for row, row_ids in zip(rows, ids, strict=True):
            if tokens[row, : int(lengths[row])].tolist() != row_ids:
                raise ConfigError(
                    f"{folder / TRAIN_PAIRS_FILE}, row {row} (counting from 0): its {side} text is not what "
                    f"{folder / STORAGE_FOLDER} holds for that pair (the text was edited, or chosen and rejected "
                    f"swapped, after the buffer was saved): training from the storage would learn other pairs than the "
                    f"file says. {REBUILD_BUFFER}"
                )


def _why_tokenize_again(meta: dict, tokenizer, pair_keys: PairKeys) -> str | None:
    """Why this run cannot train from the stored token ids, or None when it can."""
    if "tokenizer" not in meta:
        return "its meta.json records no tokenizer (written by an older version of the recipe)"
    if meta["tokenizer"] != tokenizer_fingerprint(tokenizer):
        return "it was tokenized by another tokenizer than this run's reward model's"
    if meta.get("pair_keys") != _pair_keys_layout(pair_keys):
        return f"it stores keys {meta.get('pair_keys')}, this run reads buffer.pair_keys={_pair_keys_layout(pair_keys)}"
    return None


def load_labelled_pairs(folder: str | os.PathLike, *, tokenizer, pair_keys: PairKeys) -> LabelledPairs:
    """The labelled pairs of a folder written by :func:`save_labelled_pairs`: no generation, no labelling.

    Cheap checks refuse a cut or damaged folder (row counts, JSON lines, the storage's size). With the tokenizer the
    folder was written with, the run trains from ``storage/`` itself (memory-mapped); with another it re-tokenizes
    the text of ``pairs.jsonl``, and says so.
    """
    folder = Path(folder).expanduser()
    meta = read_meta(folder)
    labelled = LabelledPairs(
        train=_read_jsonl(folder / TRAIN_PAIRS_FILE),
        eval=_read_jsonl(folder / EVAL_PAIRS_FILE),
        eval_responses=_read_jsonl(folder / EVAL_RESPONSES_FILE),
        conversational=meta["conversational"],
    )
    _check_row_counts(folder, meta, labelled)
    stored = _load_storage(folder, meta)
    reason = _why_tokenize_again(meta, tokenizer, pair_keys)
    if reason is not None:
        log.warning("buffer.load_from=%s: %s; re-tokenizing the text of its %s.", folder, reason, TRAIN_PAIRS_FILE)
    else:
        layout = _pair_keys_layout(pair_keys)
        needed = [tensordict_key(key) for name, key in layout.items() if name != "margin" or labelled.has_margin]
        missing = [key for key in needed if key not in stored.keys(include_nested=True)]
        if missing:
            raise ConfigError(f"{folder / STORAGE_FOLDER} lacks the keys {missing}. {REBUILD_BUFFER}")
        _check_text_matches_storage(folder, labelled, stored, tokenizer, pair_keys)
        log.info("buffer.load_from=%s: training from its stored token ids (%s).", folder, STORAGE_FOLDER)
        labelled.train_tokens = stored
    return drop_identical_pairs(labelled, source=str(folder))
