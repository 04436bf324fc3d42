"""Every completion trl trains on, in a TorchRL storage under ``<run dir>/rollouts/``, written as the run trains.

Layout: one folder per process, ``rank_<r>/``, and in it one ``part_<k>/`` per start of the run (a resumed run opens
the next part, so nothing written before the kill is overwritten). A part holds

- ``storage/``: a TorchRL ``LazyMemmapStorage`` (a memory-mapped TensorDict, readable with
  ``TensorDict.load_memmap(..., allow_pickle=False)`` while the run still writes it), one entry per completion:
  ``prompt_ids`` (left-padded) and ``prompt_length``, ``completion_ids`` (right-padded) and ``completion_length``,
  ``logprobs`` (the behaviour policy's, 0 on padding), ``rewards`` (``[K]``, each reward source's value, NaN where a
  reward function returned ``None``), ``reward`` (their weighted sum, trl's), ``advantage`` (trl's), ``step`` (the
  optimizer step it trains: 1 for the first), ``row`` (its index among every completion this process wrote), and the
  prompt's and completion's text as UTF-8 bytes (``prompt_text`` / ``completion_text`` with ``*_text_length``,
  cut at ``max_text_bytes``);
- ``progress.json`` (written atomically after every batch): the rows written, the capacity and the rows dropped (the
  storage is a ring of ``max_rows`` entries: the oldest go first), the reward sources' names, the widths.

:class:`RolloutStore` writes a part; :func:`load_rollouts` reads every part of every process back as one TensorDict in
the order they were written, and :func:`texts` decodes its text columns.

Dependencies: torch, tensordict, torchrl.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyMemmapStorage, ReplayBuffer

from interop.rollout_func import message_text

__all__ = ["ROLLOUTS_DIR", "RolloutStore", "load_rollouts", "texts"]

ROLLOUTS_DIR = "rollouts"
PROGRESS_FILE = "progress.json"


def _utf8_rows(strings: list[str], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, width]`` uint8 and ``[B]`` lengths: each string's UTF-8 bytes, cut at a character boundary."""
    rows = torch.zeros(len(strings), width, dtype=torch.uint8)
    lengths = torch.zeros(len(strings), dtype=torch.long)
    for i, string in enumerate(strings):
        data = string.encode("utf-8")[:width].decode("utf-8", errors="ignore").encode("utf-8")
        rows[i, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else rows[i, :0]
        lengths[i] = len(data)
    return rows, lengths


def _write_json_atomically(path: Path, content: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(content, indent=1))
    os.replace(partial, path)


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
    ) -> None:
        rank_dir = Path(folder) / f"rank_{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        part = len(list(rank_dir.glob("part_*")))
        self.folder = rank_dir / f"part_{part}"
        self.folder.mkdir()
        self.buffer = ReplayBuffer(storage=LazyMemmapStorage(max_rows, scratch_dir=self.folder / "storage"))
        self.max_rows, self.prompt_width, self.completion_width = max_rows, prompt_width, completion_width
        self.source_names, self.max_text_bytes, self.pad_token_id = list(source_names), max_text_bytes, pad_token_id
        self.rows = 0
        self.tokens = 0  # completion tokens written

    def write(
        self,
        rollout: TensorDictBase,
        *,
        prompt_texts: list[str],
        completion_texts: list[str],
        rewards: torch.Tensor,
        reward: torch.Tensor,
        advantages: torch.Tensor,
        step: int,
    ) -> None:
        """Appends one generation batch: ``rollout`` as ``interop.TorchRLRolloutFunc.rollout`` returns it, and the
        scores trl gave it (``rewards`` ``[B, K]``, ``reward`` and ``advantages`` ``[B]``)."""
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
        prompt_text, prompt_text_length = _utf8_rows(prompt_texts, self.max_text_bytes)
        completion_text, completion_text_length = _utf8_rows(completion_texts, self.max_text_bytes)
        entry = TensorDict(
            {
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
                "row": torch.arange(self.rows, self.rows + batch),
                "prompt_text": prompt_text,
                "prompt_text_length": prompt_text_length,
                "completion_text": completion_text,
                "completion_text_length": completion_text_length,
            },
            batch_size=[batch],
        )
        self.buffer.extend(entry)
        self.rows += batch
        self.tokens += int(rollout.get("completion_length").sum())
        _write_json_atomically(
            self.folder / PROGRESS_FILE,
            {
                "rows_written": self.rows,
                "capacity": self.max_rows,
                "rows_dropped": max(0, self.rows - self.max_rows),
                "sources": self.source_names,
                "prompt_width": self.prompt_width,
                "completion_width": self.completion_width,
                "last_step": step,
            },
        )

    def extend(self, rows: TensorDictBase) -> None:
        """Appends the rows ``interop.TorchRLRolloutFunc`` writes for one scored generation batch (ragged, one per
        completion, in order: ids, log-probs, ``prompt``, ``completion_text``, ``rewards``, ``reward``,
        ``advantage``, ``step``): the store's ``replay_buffer`` face. ``step`` there counts the updates the sampling
        weights had had; here it is the optimizer step the batch trains first (that + 1)."""
        pad = self.pad_token_id
        prompts = rows.get("prompt_ids", as_list=True)
        completions = rows.get("completion_ids", as_list=True)
        rollout = TensorDict(
            {
                "prompt_ids": rows.get("prompt_ids", as_padded_tensor=True, padding_side="left", padding_value=pad),
                "prompt_length": torch.tensor([len(ids) for ids in prompts]),
                "completion_ids": rows.get(
                    "completion_ids", as_padded_tensor=True, padding_side="right", padding_value=pad
                ),
                "completion_length": torch.tensor([len(ids) for ids in completions]),
                "logprobs": rows.get("logprobs", as_padded_tensor=True, padding_side="right", padding_value=0.0),
                "truncated": rows.get("truncated"),
            },
            batch_size=[len(prompts)],
        )
        self.write(
            rollout,
            prompt_texts=[message_text(prompt) for prompt in _objects(rows, "prompt")],
            completion_texts=list(_objects(rows, "completion_text")),
            rewards=rows.get("rewards"),
            reward=rows.get("reward"),
            advantages=rows.get("advantage"),
            step=int(rows.get("step")[0]) + 1,
        )

    @property
    def dropped(self) -> int:
        return max(0, self.rows - self.max_rows)


def _objects(rows: TensorDictBase, key: str) -> list:
    """One Python object per row of a non-tensor entry."""
    values = rows.get(key)
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _read_part(part: Path) -> tuple[TensorDictBase, dict] | None:
    progress_file = part / PROGRESS_FILE
    if not progress_file.is_file():
        return None  # started, nothing written yet
    progress = json.loads(progress_file.read_text())
    stored = TensorDict.load_memmap(part / "storage", allow_pickle=False)
    kept = min(progress["rows_written"], progress["capacity"])
    rows = stored[:kept]
    return rows[rows.get("row").argsort()].clone(), progress  # the ring's rows, oldest first; off the memmap


def load_rollouts(folder: str | os.PathLike) -> TensorDict:
    """Every stored completion of a run's ``rollouts/`` folder, all processes' (a ``rank`` column says whose), oldest
    first. A resumed run's part replaces the steps an earlier part wrote from the step it resumed at (those updates
    were lost with the killed process, and were trained again).

    Raises:
        FileNotFoundError: the folder holds no stored rollouts.
    """
    folder = Path(folder)
    ranks = sorted(folder.glob("rank_*"), key=lambda path: int(path.name.removeprefix("rank_")))
    tables = []
    for rank_dir in ranks:
        parts = sorted(rank_dir.glob("part_*"), key=lambda path: int(path.name.removeprefix("part_")))
        read = [found for found in map(_read_part, parts) if found is not None]
        for index, (rows, _) in enumerate(read):
            later = [int(other.get("step").min()) for other, _ in read[index + 1 :] if other.shape[0]]
            if later:
                rows = rows[rows.get("step") < min(later)]
            rows.set("rank", torch.full((rows.shape[0],), int(rank_dir.name.removeprefix("rank_"))))
            tables.append(rows)
    if not tables:
        raise FileNotFoundError(f"load_rollouts: {folder} holds no stored rollouts (no rank_*/part_*/progress.json).")
    table = torch.cat(tables)
    order = torch.argsort(table.get("step") * (table.get("rank").max() + 1) + table.get("rank"), stable=True)
    return table[order]


def texts(rows: TensorDictBase, name: str) -> list[str]:
    """The ``prompt`` or ``completion`` texts of stored rows."""
    data, lengths = rows.get(f"{name}_text"), rows.get(f"{name}_text_length")
    return [bytes(row[:n].tolist()).decode("utf-8") for row, n in zip(data, lengths.tolist(), strict=True)]
