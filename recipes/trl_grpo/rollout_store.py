"""Every completion trl trains on, in a TorchRL storage under ``<run dir>/rollouts/``, written as the run trains.

Layout: one folder per process, ``rank_<r>/``, and in it one ``part_<k>/`` per start of the run (a resumed run opens
the next part, so nothing written before the kill is overwritten). A part holds

- ``storage/``: a TorchRL ``LazyMemmapStorage`` (a memory-mapped TensorDict, readable with
  ``TensorDict.load_memmap(..., allow_pickle=False)`` while the run still writes it), one entry per completion:
  ``prompt_ids`` (left-padded) and ``prompt_length``, ``completion_ids`` (right-padded) and ``completion_length``,
  ``logprobs`` (the behaviour policy's, 0 on padding), ``rewards`` (``[K]``, each reward source's value, NaN where a
  reward function returned ``None``), ``reward`` (their weighted sum, trl's), ``advantage`` (trl's), ``env_mask`` (1 on
  the model's tokens, 0 on tool messages' and padding: trl's env_mask), ``tool_calls``, ``tool_errors`` and ``turns``
  (the dialog's counts; 0, 0, 1 without tools), ``step`` (the optimizer step it trains: 1 for the first), ``row``
  (its index among every completion this process wrote), and the
  prompt's and completion's text as UTF-8 bytes (``prompt_text`` / ``completion_text`` with ``*_text_length``, cut at
  ``max_text_bytes``, ``*_text_cut`` saying where the cut lost text). The prompt is stored whole, as JSON: a
  conversation keeps its system prompt and earlier turns.
- ``progress.json`` (replaced atomically before and after every batch): the rows written, the rows being written
  (``writing``), the capacity and the rows dropped (the storage is a ring of ``max_rows`` entries: the oldest go
  first), the completion tokens written, the reward sources' names, the widths.

Readers never see a half-written row: :func:`load_rollouts` reads ``progress.json``, then the storage, then
``progress.json`` again, and keeps only rows written before its first read and not overwritten by a batch begun before
its last (each kept slot's ``row`` must be the row it should hold). A damaged part (a storage file shorter than its
``meta.json`` says, a row count no slot agrees with, a ``progress.json`` that does not parse) is refused, naming the
file, never read as zeros.

:class:`RolloutStore` writes a part; :func:`load_rollouts` reads every part of every process back as one TensorDict in
the order they were written; :func:`texts` decodes its text columns and :func:`prompts` its whole prompts;
:func:`stored_totals` counts what the folder holds without reading the rows.

Dependencies: torch, tensordict, torchrl.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyMemmapStorage, ReplayBuffer

from interop.trl.rollout_func import TOOL_COUNTS, message_text
from recipes.common.config import RunStopped

__all__ = [
    "ROLLOUTS_DIR",
    "DamagedRollouts",
    "RolloutStore",
    "load_rollouts",
    "prompts",
    "row_bytes",
    "stored_group_sizes",
    "stored_sources",
    "stored_totals",
    "texts",
    "texts_cut",
]

ROLLOUTS_DIR = "rollouts"
PROGRESS_FILE = "progress.json"
STORAGE_DIR = "storage"
# Bumped when what a part holds changes meaning; 2: prompts stored whole as JSON, text cut flags, the write protocol.
FORMAT = 2
# Free space kept beyond what a batch needs: the memmap's pages are allocated as rows are written, and a write that
# finds the disk full kills the process with SIGBUS, with no line in any log.
_FREE_SPACE_MARGIN = 64 << 20


class DamagedRollouts(ValueError):
    """A stored rollouts part whose files disagree with each other; the message names the file and what to do."""


def _utf8_rows(strings: list[str], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, width]`` uint8, ``[B]`` lengths and ``[B]`` cut flags: each string's UTF-8 bytes, cut at a character
    boundary."""
    rows = torch.zeros(len(strings), width, dtype=torch.uint8)
    lengths = torch.zeros(len(strings), dtype=torch.long)
    cut = torch.zeros(len(strings), dtype=torch.bool)
    for i, string in enumerate(strings):
        encoded = string.encode("utf-8")
        data = encoded[:width].decode("utf-8", errors="ignore").encode("utf-8")
        rows[i, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else rows[i, :0]
        lengths[i] = len(data)
        cut[i] = len(data) < len(encoded)
    return rows, lengths, cut


def _write_json_atomically(path: Path, content: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(content, indent=1))
    os.replace(partial, path)


def _prompt_json(prompt) -> str:
    """A prompt as trl passes it (a string or a message list), as the JSON the store keeps."""
    return json.dumps(prompt if isinstance(prompt, str) else [dict(message) for message in prompt], ensure_ascii=False)


class RolloutStore:
    """Writes the scored completions of one process into ``<folder>/rank_<rank>/part_<k>/``.

    Args:
        folder: the run's ``rollouts/`` folder.

    Keyword Args:
        rank: the process's index.
        max_rows: the storage's capacity; past it the oldest rows are overwritten (and counted as dropped).
        prompt_width: the longest prompt, in tokens (prompts are stored left-padded to it).
        completion_width: the longest completion, in tokens (trl's ``max_completion_length``).
        source_names: the reward sources, in the order of the ``rewards`` column.
        max_text_bytes: the bytes kept of each prompt's and completion's text.
        pad_token_id: the pad of the id columns.
        tokenizer: the fingerprint of the tokenizer that made the ids (``recipes.common.models.tokenizer_fingerprint``),
            which a run loading the folder's groups checks against its own.
        group_size: the completions sampled per prompt (trl's ``num_generations``): a run loading the folder's
            groups must sample groups of that size (a group of 8 would otherwise load as two groups of 4).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        rank: int,
        max_rows: int,
        prompt_width: int,
        completion_width: int,
        source_names: list[str],
        max_text_bytes: int,
        pad_token_id: int,
        tokenizer: dict | None = None,
        group_size: int | None = None,
    ) -> None:
        rank_dir = Path(folder) / f"rank_{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        part = len(list(rank_dir.glob("part_*")))
        self.folder = rank_dir / f"part_{part}"
        self.folder.mkdir()
        self.buffer = ReplayBuffer(storage=LazyMemmapStorage(max_rows, scratch_dir=self.folder / STORAGE_DIR))
        self.max_rows, self.prompt_width, self.completion_width = max_rows, prompt_width, completion_width
        self.source_names, self.max_text_bytes, self.pad_token_id = list(source_names), max_text_bytes, pad_token_id
        self.tokenizer, self.group_size = tokenizer, group_size
        self.rows = 0
        self.tokens = 0  # completion tokens written
        self.last_step = 0

    def extend(self, rows: TensorDictBase) -> None:
        """Appends the rows ``interop.TorchRLRolloutFunc`` writes for one scored generation batch (ragged, one per
        completion, in order: ids, log-probs, ``prompt``, ``completion_text``, ``rewards``, ``reward``,
        ``advantage``, ``step``, ``train_step``): the store's ``replay_buffer`` face. ``step`` there counts the updates
        the sampling weights had had (kept as ``policy_version``); here ``step`` is the optimizer step the batch
        trains first (``train_step`` + 1: one more than the sampler's in async mode)."""
        pad = self.pad_token_id
        prompt_rows = rows.get("prompt_ids", as_list=True)
        completion_rows = rows.get("completion_ids", as_list=True)
        rollout = TensorDict(
            {
                "prompt_ids": rows.get("prompt_ids", as_padded_tensor=True, padding_side="left", padding_value=pad),
                "prompt_length": torch.tensor([len(ids) for ids in prompt_rows]),
                "completion_ids": rows.get(
                    "completion_ids", as_padded_tensor=True, padding_side="right", padding_value=pad
                ),
                "completion_length": torch.tensor([len(ids) for ids in completion_rows]),
                "logprobs": rows.get("logprobs", as_padded_tensor=True, padding_side="right", padding_value=0.0),
                "truncated": rows.get("truncated"),
            },
            batch_size=[len(prompt_rows)],
        )
        if "env_mask" in rows.keys():  # a tool-calling rollout: which tokens are the model's, and its counts
            rollout.set("env_mask", rows.get("env_mask", as_padded_tensor=True, padding_side="right", padding_value=0))
            for name in TOOL_COUNTS:
                rollout.set(name, rows.get(name))
        self.write(
            rollout,
            prompt_texts=_objects(rows, "prompt"),
            completion_texts=list(_objects(rows, "completion_text")),
            rewards=rows.get("rewards"),
            reward=rows.get("reward"),
            advantages=rows.get("advantage"),
            step=int(rows.get("train_step", rows.get("step"))[0]) + 1,
            policy_version=int(rows.get("step")[0]),
        )

    def write(
        self,
        rollout: TensorDictBase,
        *,
        prompt_texts: list,
        completion_texts: list[str],
        rewards: torch.Tensor,
        reward: torch.Tensor,
        advantages: torch.Tensor,
        step: int,
        policy_version: int | None = None,
    ) -> None:
        """Appends one generation batch: ``rollout`` as ``interop.TorchRLRolloutFunc.rollout`` returns it, the prompts
        as trl passed them (strings or message lists, kept whole), the completions' text, and the scores trl gave it
        (``rewards`` ``[B, K]``, ``reward`` and ``advantages`` ``[B]``)."""
        batch = rollout.shape[0]
        prompt_ids = rollout.get("prompt_ids")
        if prompt_ids.shape[-1] > self.prompt_width:
            raise ValueError(
                f"RolloutStore: a prompt of {prompt_ids.shape[-1]} tokens, longer than the {self.prompt_width} the "
                "store was made for."
            )
        prompt_ids = torch.nn.functional.pad(
            prompt_ids, (self.prompt_width - prompt_ids.shape[-1], 0), value=self.pad_token_id
        )
        right = self.completion_width - rollout.get("completion_ids").shape[-1]
        prompt_json = [_prompt_json(prompt) for prompt in prompt_texts]
        prompt_text, prompt_text_length, prompt_cut = _utf8_rows(prompt_json, self.max_text_bytes)
        completion_text, completion_text_length, completion_cut = _utf8_rows(completion_texts, self.max_text_bytes)
        tools = _tool_columns(rollout, right)
        entry = TensorDict(
            {
                **tools,
                "prompt_ids": prompt_ids,
                "prompt_length": rollout.get("prompt_length"),
                "completion_ids": torch.nn.functional.pad(
                    rollout.get("completion_ids"), (0, right), value=self.pad_token_id
                ),
                "completion_length": rollout.get("completion_length"),
                "logprobs": torch.nn.functional.pad(rollout.get("logprobs"), (0, right), value=0.0),
                "truncated": rollout.get("truncated"),
                "rewards": rewards.detach().float().cpu().reshape(batch, len(self.source_names)),
                "reward": reward.detach().float().cpu().reshape(batch),
                "advantage": advantages.detach().float().cpu().reshape(batch),
                "step": torch.full((batch,), step, dtype=torch.long),
                # The updates the sampling weights had had: step - 1, or fewer in async mode (the lag).
                "policy_version": torch.full((batch,), step - 1 if policy_version is None else policy_version),
                "row": torch.arange(self.rows, self.rows + batch),
                "prompt_text": prompt_text,
                "prompt_text_length": prompt_text_length,
                "prompt_text_cut": prompt_cut,
                "completion_text": completion_text,
                "completion_text_length": completion_text_length,
                "completion_text_cut": completion_cut,
            },
            batch_size=[batch],
        )
        self._check_free_space(entry)
        # Announced first: a reader that finds these rows' slots mid-write leaves them out.
        self._write_progress(writing=[self.rows, self.rows + batch])
        self.buffer.extend(entry)
        self.rows += batch
        self.tokens += int(rollout.get("completion_length").sum())
        self.last_step = step
        self._write_progress(writing=None)

    def _check_free_space(self, entry: TensorDictBase) -> None:
        needed = sum(value.numel() * value.element_size() for value in entry.values(True, True)) + _FREE_SPACE_MARGIN
        free = shutil.disk_usage(self.folder).free
        if free < needed:
            raise RunStopped(
                f"The disk holding {self.folder} has {free / 2**20:.0f} MiB free, less than the "
                f"{needed / 2**20:.0f} MiB the next batch of rollouts needs (a memory-mapped write to a full disk "
                "kills the process without a word). Free space, move the run (hydra.run.dir=...), or lower "
                "rollout.store.max_rows / rollout.store.max_text_bytes; rows written so far are kept."
            )

    def _write_progress(self, *, writing: list[int] | None) -> None:
        _write_json_atomically(
            self.folder / PROGRESS_FILE,
            {
                "format": FORMAT,
                "rows_written": self.rows,
                "writing": writing,
                "capacity": self.max_rows,
                "rows_dropped": self.dropped,
                "sources": self.source_names,
                "prompt_width": self.prompt_width,
                "completion_width": self.completion_width,
                "max_text_bytes": self.max_text_bytes,
                "pad_token_id": self.pad_token_id,
                "tokenizer": self.tokenizer,
                "group_size": self.group_size,
                "last_step": self.last_step,
                "tokens_written": self.tokens,
            },
        )

    @property
    def dropped(self) -> int:
        return max(0, self.rows - self.max_rows)


def row_bytes(*, prompt_width: int, completion_width: int, max_text_bytes: int) -> int:
    """The bytes one stored row takes (a part's files hold ``max_rows`` of them once its ring is full): the id and
    ``env_mask`` columns as int64, ``logprobs`` as float32, the two texts and the scalar columns."""
    return 8 * (prompt_width + 2 * completion_width) + 4 * completion_width + 2 * max_text_bytes + 256


def _tool_columns(rollout: TensorDictBase, right: int) -> dict[str, torch.Tensor]:
    """``env_mask`` (1 on the model's tokens, 0 on tool messages' and padding: trl's env_mask) padded to the store's
    width, and the dialogs' :data:`~interop.trl.rollout_func.TOOL_COUNTS`; a run without tools stores its completions as
    all the model's, one turn, no calls, so every part has the same columns."""
    lengths = rollout.get("completion_length")
    if "env_mask" in rollout.keys():
        env_mask = rollout.get("env_mask").long()
        counts = {name: rollout.get(name).long() for name in TOOL_COUNTS}
    else:
        width = rollout.get("completion_ids").shape[-1]
        env_mask = (torch.arange(width)[None] < lengths[:, None]).long()
        zeros = torch.zeros_like(lengths, dtype=torch.long)
        counts = {"tool_calls": zeros, "tool_errors": zeros, "turns": torch.ones_like(zeros)}
    return {"env_mask": torch.nn.functional.pad(env_mask, (0, right), value=0), **counts}


def _objects(rows: TensorDictBase, key: str) -> list:
    """One Python object per row of a non-tensor entry."""
    values = rows.get(key)
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _read_progress(part: Path) -> dict | None:
    progress_file = part / PROGRESS_FILE
    if not progress_file.is_file():
        return None  # started, nothing written yet
    try:
        progress = json.loads(progress_file.read_text())
        int(progress["rows_written"]), int(progress["capacity"])
    except (ValueError, KeyError, TypeError) as error:
        raise DamagedRollouts(
            f"{progress_file} is damaged ({type(error).__name__}: {error}); the part's rows cannot be placed. Move "
            f"{part} aside to read the other parts."
        ) from None
    if progress.get("format", 1) > FORMAT:
        raise DamagedRollouts(
            f"{progress_file} was written by a newer version of the store (format {progress['format']}, this one "
            f"reads up to {FORMAT}); read it with that version."
        )
    return progress


def _check_storage_files(storage: Path) -> None:
    """Every memory-mapped file as long as ``meta.json`` says: a cut file would otherwise be read (and re-extended)
    as zeros."""
    meta_file = storage / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as error:
        raise DamagedRollouts(f"{meta_file} cannot be read ({error}); the storage's layout is unknown.") from None
    for name, layout in meta.items():
        if not isinstance(layout, dict) or "shape" not in layout:
            continue
        dtype = getattr(torch, str(layout["dtype"]).removeprefix("torch."))
        expected = torch.Size(layout["shape"]).numel() * torch.empty((), dtype=dtype).element_size()
        path = storage / f"{name}.memmap"
        found = path.stat().st_size if path.is_file() else None
        if found != expected:
            raise DamagedRollouts(
                f"{path} holds {found} bytes where {meta_file} says {expected}: the file was cut or replaced, and its "
                "rows would read as zeros. The part is damaged; restore it from a copy, or move "
                f"{storage.parent} aside to read the other parts."
            )


def _read_part(part: Path, columns: tuple[str, ...] | None = None) -> tuple[TensorDictBase, dict] | None:
    """The part's rows that were whole while read (oldest first, off the memmap), with its progress; ``columns``:
    only those (and ``row`` and ``step``) are read."""
    before = _read_progress(part)
    if before is None or before["rows_written"] == 0:
        return None
    _check_storage_files(part / STORAGE_DIR)
    stored = TensorDict.load_memmap(part / STORAGE_DIR, allow_pickle=False)
    if columns is not None:
        stored = stored.select(*{*columns, "row", "step"})
    capacity, written = before["capacity"], before["rows_written"]
    slots = stored[: min(written, capacity)].clone()
    after = _read_progress(part)
    # Rows a batch begun before the second read may have overwritten: every row older than its end minus the ring.
    overwritten_below = max(after["rows_written"], (after.get("writing") or [0, 0])[1]) - capacity
    first = min(max(written - capacity, overwritten_below, 0), written)  # a writer a whole ring ahead: none
    expected = torch.arange(first, written)
    rows = slots[expected % capacity]
    held = rows.get("row")
    wrong = held != expected
    if bool(wrong.any()):
        bad = int(wrong.nonzero()[0, 0])
        raise DamagedRollouts(
            f"{part / PROGRESS_FILE} says {written} rows were written, but slot {int(expected[bad] % capacity)} of "
            f"{part / STORAGE_DIR} holds row {int(held[bad])} where row {int(expected[bad])} belongs: the files "
            f"disagree (a progress file edited or copied from elsewhere, or a storage cut). Move {part} aside to read "
            "the other parts."
        )
    return rows, before


def load_rollouts(folder: str | os.PathLike) -> TensorDict:
    """Every stored completion of a run's ``rollouts/`` folder, all processes' (a ``rank`` column says whose), oldest
    first. A resumed run's part replaces the steps an earlier part wrote from the step it resumed at (those updates
    were lost with the killed process, and were trained again). Safe while the run writes (see the module docstring).

    Raises:
        FileNotFoundError: the folder holds no stored rollouts.
        DamagedRollouts: a part whose files disagree, named.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"load_rollouts: {folder} holds no stored rollouts: it is not a folder (pass a run's rollouts/)."
        )
    tables = [(rows, progress) for rows, progress, _ in _kept_parts(folder) if rows.shape[0]]
    if not tables:
        raise FileNotFoundError(f"load_rollouts: {folder} holds no stored rollouts (no rank_*/part_*/progress.json).")
    table = torch.cat(_same_widths(tables))
    order = torch.argsort(table.get("step") * (table.get("rank").max() + 1) + table.get("rank"), stable=True)
    return table[order]


def _kept_parts(folder: Path, columns: tuple[str, ...] | None = None) -> list[tuple[TensorDictBase, dict, int]]:
    """Every part's rows that :func:`load_rollouts` keeps (a resumed part replaces the steps an earlier one wrote
    from the step it resumed at), with the part's progress and its rows before that cut, rank by rank."""
    kept = []
    for rank_dir in sorted(folder.glob("rank_*"), key=lambda path: int(path.name.removeprefix("rank_"))):
        parts = sorted(rank_dir.glob("part_*"), key=lambda path: int(path.name.removeprefix("part_")))
        read = [found for found in (_read_part(part, columns) for part in parts) if found is not None]
        for index, (rows, progress) in enumerate(read):
            held = rows
            later = [int(other.get("step").min()) for other, _ in read[index + 1 :] if other.shape[0]]
            if later:
                rows = rows[rows.get("step") < min(later)]
            rows.set("rank", torch.full((rows.shape[0],), int(rank_dir.name.removeprefix("rank_"))))
            kept.append((rows, progress, held))
    return kept


def stored_totals(folder: str | os.PathLike) -> dict[str, int]:
    """What a run's ``rollouts/`` folder holds, over every part of every process, reading only the ``step`` and
    ``completion_length`` columns: ``rows`` (each step's completions once, as :func:`load_rollouts` reads them),
    ``rows_dropped`` (by the parts' rings of ``max_rows``) and ``tokens`` (the completion tokens generated, those of
    steps a resumed part trained again included). Zeros for a folder that holds none.

    Raises:
        DamagedRollouts: a part whose files disagree, named.
    """
    folder = Path(folder)
    totals = {"rows": 0, "rows_dropped": 0, "tokens": 0}
    if not folder.is_dir():
        return totals
    for rows, progress, held in _kept_parts(folder, columns=("completion_length",)):
        totals["rows"] += rows.shape[0]
        totals["rows_dropped"] += int(progress.get("rows_dropped", 0))
        # Parts written before the store counted its tokens: those of the rows it still holds.
        totals["tokens"] += int(progress.get("tokens_written", int(held.get("completion_length").sum())))
    return totals


def stored_sources(folder: str | os.PathLike) -> list[str] | None:
    """The reward sources (names, in the order of the ``rewards`` column) of the newest part of a run's
    ``rollouts/`` folder that wrote rows; ``None`` if it holds none (or names none). A resumed run must score with the
    same ones: parts scored by other sources cannot be read as one table."""
    found = None
    for progress_file in sorted(Path(folder).glob(f"rank_0/part_*/{PROGRESS_FILE}"), key=_part_number):
        progress = _read_progress(progress_file.parent)
        if progress is not None and progress["rows_written"] and "sources" in progress:
            found = list(progress["sources"])
    return found


def stored_group_sizes(folder: str | os.PathLike) -> list[int]:
    """The group sizes (trl's ``num_generations``) the parts of a rollouts folder that wrote rows recorded, each once,
    in the order written (parts written before the size was recorded say nothing)."""
    sizes = []
    for part in sorted(Path(folder).glob("rank_*/part_*"), key=lambda path: (path.parent.name, int(path.name[5:]))):
        progress = _read_progress(part) or {}
        size = progress.get("group_size")
        if progress.get("rows_written") and size is not None and size not in sizes:
            sizes.append(int(size))
    return sizes


def _part_number(progress_file: Path) -> int:
    return int(progress_file.parent.name.removeprefix("part_"))


# Columns whose width is a setting of the part that wrote them, and the side their padding goes.
_LEFT_PADDED = ("prompt_ids",)
_RIGHT_PADDED = ("completion_ids", "logprobs", "env_mask", "prompt_text", "completion_text")


def _same_widths(tables: list) -> list[TensorDictBase]:
    """The parts' rows with their id, log-prob and text columns padded to the widest part's (a resumed run may store
    longer completions or texts); parts that score with other reward sources cannot share a table and are refused."""
    sources = {tuple(progress.get("sources", [])) for _, progress in tables}
    if len(sources) > 1:
        raise DamagedRollouts(
            f"the parts of this rollouts folder were scored by different reward sources ({sorted(sources)}), so their "
            "reward columns cannot be read as one table; read each run's folder apart."
        )
    widths = {
        key: max(rows.get(key).shape[-1] for rows, _ in tables)
        for key in (*_LEFT_PADDED, *_RIGHT_PADDED)
        if all(key in rows.keys() for rows, _ in tables)  # env_mask: parts written before it was stored lack it
    }
    padded = []
    for rows, progress in tables:
        rows = rows.clone(recurse=False)
        for key, width in widths.items():
            value = rows.get(key)
            missing = width - value.shape[-1]
            if missing:
                fill = progress.get("pad_token_id", 0) if key.endswith("_ids") else 0
                left = key in _LEFT_PADDED
                rows.set(key, torch.nn.functional.pad(value, (missing, 0) if left else (0, missing), value=fill))
        padded.append(rows)
    return padded


def _decoded(rows: TensorDictBase, name: str) -> list[str]:
    data, lengths = rows.get(f"{name}_text"), rows.get(f"{name}_text_length")
    return [bytes(row[:n].tolist()).decode("utf-8") for row, n in zip(data, lengths.tolist(), strict=True)]


def prompts(rows: TensorDictBase) -> list:
    """The prompts of stored rows, whole, as trl passed them: a string, or a conversation (every message, the system
    prompt included).

    Raises:
        DamagedRollouts: a prompt cut at ``max_text_bytes`` (its JSON no longer parses).
    """
    values = []
    for text, cut in zip(_decoded(rows, "prompt"), _cut(rows, "prompt"), strict=True):
        if cut:
            raise DamagedRollouts(
                "a stored prompt was cut at the store's max_text_bytes, so it cannot be read whole; raise "
                "rollout.store.max_text_bytes for runs whose prompts are longer, or skip cut rows (texts_cut())."
            )
        values.append(json.loads(text))
    return values


def _cut(rows: TensorDictBase, name: str) -> list[bool]:
    cut = rows.get(f"{name}_text_cut", None)
    return [False] * rows.shape[0] if cut is None else cut.tolist()


def texts_cut(rows: TensorDictBase, name: str) -> list[bool]:
    """Whether each row's ``prompt`` or ``completion`` text lost bytes to the store's ``max_text_bytes``."""
    return _cut(rows, name)


def texts(rows: TensorDictBase, name: str) -> list[str]:
    """The ``prompt`` or ``completion`` texts of stored rows; a prompt's text is its last message's (the user's
    request), :func:`prompts` gives the whole conversation."""
    if name != "prompt":
        return _decoded(rows, name)
    stored = _decoded(rows, "prompt")
    if rows.get("prompt_text_cut", None) is None:  # format 1: the last message's text
        return stored
    return [
        message_text(json.loads(text)) if not cut else text
        for text, cut in zip(stored, _cut(rows, "prompt"), strict=True)
    ]


def stored_tokenizer(folder: str | os.PathLike) -> dict | None:
    """The tokenizer fingerprint the newest part of a rollouts folder recorded (``None``: not recorded)."""
    parts = sorted(Path(folder).glob("rank_*/part_*"), key=lambda path: (path.parent.name, int(path.name[5:])))
    progress = _read_progress(parts[-1]) if parts else None
    return (progress or {}).get("tokenizer")
