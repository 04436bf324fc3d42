"""Prompt and preference-pair sources from a ``data=`` config node: the synthetic task, a user file, an HF dataset;
and the endless, seeded, resumable order in which a run draws its prompts (:class:`EndlessShuffleSampler`).

Formats are trl's standard ones: prompts in a ``prompt`` column; preference pairs in ``chosen``/``rejected`` with an
optional ``prompt`` (explicit prompt) or without one (implicit prompt), each as plain text or as conversational
message lists (``[{"role": ..., "content": ...}, ...]``). Column names come from the config node.
"""

from __future__ import annotations

import itertools
import json
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.utils.data import Sampler

from recipes.common.config import ConfigError, first_items
from recipes.tasks import arithmetic, calculator, synthetic

# datasets is imported where a file or hub dataset loads: it takes about half a second, which the synthetic task,
# `--help` and config validation need not spend.

__all__ = [
    "BadJsonLine",
    "EndlessShuffleSampler",
    "RESERVED_COLUMNS",
    "SYNTHETIC_TASKS",
    "PromptRows",
    "load_preference_pairs",
    "load_prompt_rows",
    "load_prompts",
    "load_table",
    "parse_json_lines",
    "prompt_text",
]

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_table(data: DictConfig, split: str, *, columns: list[str] | None = None):
    """The ``datasets.Dataset`` behind a ``file`` or ``hf`` data node for ``split`` ("train" or "eval").

    A file node reads ``path`` (train) and ``eval_path`` (eval); an HF node reads ``name_or_path`` (a folder written
    by ``save_to_disk``, or a hub name) with ``split`` / ``eval_split``. Returns None when no eval source is set.
    A file that is empty, or not valid in its format, is refused naming the file (and the line, for JSON); ``columns``
    (those the caller reads) make the message say what a row should hold.
    """
    if data.source == "file":
        key = "data.path" if split == "train" else "data.eval_path"
        path = data.path if split == "train" else data.eval_path
        return None if path is None else _load_file(Path(path).expanduser(), key=key, columns=columns or [])
    if data.source == "hf":
        return _load_hf(data, split)
    raise ConfigError(f"data.source={data.source!r} has no table; expected 'file' or 'hf'.")


def _load_file(path: Path, *, key: str, columns: list[str]):
    import datasets

    if not path.exists():
        raise ConfigError(f"{key}={str(path)!r}: no such file.")
    if path.suffix not in _FILE_FORMATS:
        raise ConfigError(f"{key}={str(path)!r}: unknown file type; use one of {sorted(_FILE_FORMATS)}.")
    # The text formats are read once here, for the checks; parquet is binary (its reader says what is wrong).
    text = None if path.suffix == ".parquet" else _read_utf8(path, key=key)
    if path.stat().st_size == 0 or (text is not None and not text.strip()):
        raise ConfigError(f"{key}={str(path)!r}: the file is empty. {_what_a_file_holds(path, columns)}")
    if path.suffix in (".jsonl", ".json"):
        _check_json_file(path, text, key=key, columns=columns)
    try:
        table = datasets.load_dataset(_FILE_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as error:  # whatever the reader trips on, the user needs the file named, not its internals
        reason = error.__cause__ or error
        if "corresponds to no data" in str(reason):  # datasets' words for a table with a header and no rows
            raise ConfigError(
                f"{key}={str(path)!r}: the file has no rows. {_what_a_file_holds(path, columns)}"
            ) from None
        raise ConfigError(
            f"{key}={str(path)!r}: the file cannot be read as {path.suffix}: {type(reason).__name__}: {reason}. "
            f"{_what_a_file_holds(path, columns)}"
        ) from error
    if len(table) == 0:
        raise ConfigError(f"{key}={str(path)!r}: the file has no rows. {_what_a_file_holds(path, columns)}")
    return table


def _read_utf8(path: Path, *, key: str) -> str:
    """The file's text; a file that is not UTF-8 (latin-1, say) is refused naming where it stops being so."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError(
            f"{key}={str(path)!r}, line {line}: not UTF-8 (byte {data[error.start]:#04x} at offset {error.start}). "
            f"Datasets read text files as UTF-8: re-encode it, e.g. `iconv -f latin1 -t utf-8 {path.name} > "
            f"{path.stem}.utf8{path.suffix}`."
        ) from None


def _what_a_file_holds(path: Path, columns: list[str]) -> str:
    example = json.dumps({column: "..." for column in columns} or {"<column>": "..."})
    if path.suffix == ".jsonl":
        return f"It should hold one JSON object per line, e.g. {example}."
    if path.suffix == ".json":
        return f"It should hold JSON objects, one per line (e.g. {example}) or in one list."
    named = f"column(s) {columns}" if columns else "the columns the data.*_column keys name"
    return f"It should hold a table with a header and {named}, one row per example."


def _check_json_file(path: Path, text: str, *, key: str, columns: list[str]) -> None:
    """Refuses a JSON file (its ``text``) with a syntax error naming the line (datasets' own error names neither line
    nor file).

    A ``.jsonl`` file holds one object per line; a ``.json`` file either that or one document (a list of objects).
    """
    lines = text.splitlines()
    first_bad = _first_bad_json_line(lines)
    if first_bad is None:
        return
    line_number, reason = first_bad
    first_line = next(number for number, line in enumerate(lines, 1) if line.strip())
    try:
        json.loads(text)
        return  # one JSON document spread over lines: datasets reads that too
    except json.JSONDecodeError as error:
        if path.suffix == ".json" and line_number == first_line:  # not JSON lines: the document's error is the one
            line_number, reason = error.lineno, error.msg
    shown = lines[line_number - 1].strip()
    raise ConfigError(
        f"{key}={str(path)!r}, line {line_number}: {reason}: {shown[:80]!r}{'...' if len(shown) > 80 else ''}. "
        f"Fix or remove that line. {_what_a_file_holds(path, columns)}"
    )


class BadJsonLine(ValueError):
    """A line of a JSON-lines file that is not a JSON object: its 1-based number and why."""

    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.line_number, self.reason = line_number, reason


def parse_json_lines(lines) -> list[dict]:
    """The JSON objects of the non-blank ``lines``; the first line that is not one raises :class:`BadJsonLine`."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise BadJsonLine(number, f"not valid JSON ({error.msg}, column {error.colno})") from None
        if not isinstance(row, dict):
            raise BadJsonLine(number, f"a JSON {type(row).__name__}, not an object of columns")
        rows.append(row)
    return rows


def _first_bad_json_line(lines: list[str]) -> tuple[int, str] | None:
    """``(1-based line number, reason)`` of the first non-blank line that is not a JSON object, or None."""
    try:
        parse_json_lines(lines)
    except BadJsonLine as bad:
        return bad.line_number, bad.reason
    return None


def _load_hf(data: DictConfig, split: str):
    import datasets

    split_name = data.split if split == "train" else data.eval_split
    if split_name is None:
        return None
    location = Path(str(data.name_or_path)).expanduser()
    if not location.exists():
        try:
            return datasets.load_dataset(str(data.name_or_path), split=split_name)
        except (ConnectionError, FileNotFoundError, OSError, ValueError) as error:
            raise ConfigError(
                f"data.name_or_path={str(data.name_or_path)!r}: no such folder, and the hub dataset of that name "
                f"cannot be loaded ({type(error).__name__}: {str(error).splitlines()[0][:200]}). Offline, a hub "
                "dataset must be in the local cache; or save it with `Dataset.save_to_disk(folder)` and pass the "
                "folder."
            ) from None
    if not any((location / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json")):
        raise ConfigError(
            f"data.name_or_path={str(location)!r} is a folder, but not one `save_to_disk` wrote (no "
            "dataset_dict.json or state.json). data=hf reads such folders (or hub names); for files of rows use "
            "data=file data.path=<file>."
        )
    loaded = datasets.load_from_disk(str(location))
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if split_name not in loaded:
        raise ConfigError(
            f"data.name_or_path={str(location)!r} has splits {sorted(loaded)}, not {split_name!r}; set "
            f"data.{'split' if split == 'train' else 'eval_split'} to one of them."
        )
    return loaded[split_name]


def _require_columns(table, required: list[str], *, data: DictConfig, split: str, what: str) -> None:
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise ConfigError(
            f"The {what} data ({_source(data, split)}, split {split}) lacks column(s) {missing}. Found columns: "
            f"{table.column_names}; expected: {required}. Rename the columns in the file or point the data.*_column "
            "keys at the ones you have."
        )


def prompt_text(prompt) -> str | list[dict[str, str]]:
    """A prompt (or response) as stored: plain text, or a conversational list of ``{"role", "content"}`` messages.

    Anything else is refused with a :class:`ConfigError` that says what was found; callers add where (row, column).
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise ConfigError(
            f"expected text or a list of {{role, content}} messages; got {type(prompt).__name__} {_shown(prompt)}."
        )
    for index, message in enumerate(prompt):
        if not (isinstance(message, dict) and {"role", "content"} <= set(message)):
            raise ConfigError(
                f"message {index} of the list is {_shown(message)}; each message must be a {{role, content}} dict."
            )
        if not (isinstance(message["role"], str) and isinstance(message["content"], str)):
            raise ConfigError(
                f"message {index} has role {_shown(message['role'])} and content {_shown(message['content'])}; "
                "both must be text."
            )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _shown(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _source(data: DictConfig, split: str) -> str:
    """Where ``split``'s rows come from, for messages: the split's own file (``data.eval_path`` for "eval")."""
    if data.source == "file":
        return f"file: {data.path if split == 'train' else data.eval_path}"
    if data.source == "hf":
        return f"hf: {data.name_or_path}[{data.split if split == 'train' else data.eval_split}]"
    return f"{data.source}: {data.get('name_or_path')}"


# The built-in tasks (data.source): name -> (the training prompts' maker, the eval prompts'), each
# ``make(count, seed=...) -> (prompts, columns)``.
SYNTHETIC_TASKS = {
    "synthetic": (synthetic.make_task, synthetic.make_task),
    "arithmetic": (arithmetic.make_task, arithmetic.make_eval_task),
    "calculator": (calculator.make_task, calculator.make_eval_task),
}

# The arguments trl passes every reward function besides the data's columns: a column of one of these names would
# reach it twice.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class PromptRows:
    """The prompts of a split and every other column of their rows, row-aligned (what trl hands a reward function
    beside the prompt and the completion, e.g. a ``solution``).

    Args:
        prompts: text or message lists, one per row.
        columns: column name -> one value per row.
    """

    prompts: list
    columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompts(data: DictConfig, split: str) -> list:
    """The prompts of ``split`` ("train" or "eval"): text or message lists. Empty list when no eval set is set."""
    return load_prompt_rows(data, split).prompts


def load_prompt_rows(data: DictConfig, split: str) -> PromptRows:
    """The prompts of ``split`` ("train" or "eval") with their rows' other columns (:class:`PromptRows`); empty when
    no eval set is set. The synthetic tasks provide their own columns (``recipes.tasks.synthetic``)."""
    if data.source in SYNTHETIC_TASKS:
        count = data.num_train_prompts if split == "train" else data.num_eval_prompts
        # Distinct seeds keep the eval prompts' draws independent of the train prompts'.
        make = SYNTHETIC_TASKS[data.source][0 if split == "train" else 1]
        prompts, columns = make(count, seed=data.seed if split == "train" else data.seed + 1)
        return PromptRows(prompts, columns)
    table = load_table(data, split, columns=[data.prompt_column])
    if table is None:
        return PromptRows([])
    _require_columns(table, [data.prompt_column], data=data, split=split, what="prompt")
    prompts = []
    for row, prompt in enumerate(table[data.prompt_column]):
        try:
            prompts.append(prompt_text(prompt))
        except ConfigError as error:
            raise ConfigError(
                f"The prompt data ({_source(data, split)}, split {split}), row {row} (counting data rows from 0), "
                f"column data.prompt_column={data.prompt_column!r}: {error} Fix or remove that row."
            ) from None
    empty = [row for row, prompt in enumerate(prompts) if not _has_content(prompt)]
    if empty:
        raise ConfigError(
            f"The prompt data ({_source(data, split)}, split {split}) has {len(empty)} empty prompt(s) in "
            f"column {data.prompt_column!r} (rows {first_items(empty)}): "
            "a model asked nothing learns nothing. Remove or fill them."
        )
    others = [name for name in table.column_names if name != data.prompt_column]
    clashing = [name for name in others if name in RESERVED_COLUMNS]
    if clashing:
        raise ConfigError(
            f"The prompt data ({_source(data, split)}) has column(s) {clashing}, which are the names of arguments trl "
            f"passes every reward function ({', '.join(RESERVED_COLUMNS)}): rename them in the data."
        )
    return PromptRows(prompts, {name: list(table[name]) for name in others})


def _has_content(prompt) -> bool:
    if isinstance(prompt, str):
        return _visible(prompt)
    return any(_visible(str(message["content"])) for message in prompt)


def _visible(text: str) -> bool:
    """Whether ``text`` holds a character that shows: not only spaces, line breaks, zero-width or control ones."""
    return any(not (char.isspace() or unicodedata.category(char) in ("Cf", "Cc", "Zs", "Zl", "Zp")) for char in text)


def load_preference_pairs(data: DictConfig, split: str) -> list[dict]:
    """Preference pairs of a ``file``/``hf`` node: dicts with ``chosen``, ``rejected`` and, if present, ``prompt``."""
    columns = [data.chosen_column, data.rejected_column]
    table = load_table(data, split, columns=[data.prompt_column, *columns])
    if table is None:
        return []
    _require_columns(table, columns, data=data, split=split, what="preference")
    for key in ("chosen_column", "rejected_column"):
        _refuse_nulls(table, data=data, key=key, split=split)
    has_prompt = data.prompt_column in table.column_names
    pairs = []
    for row in table:
        pair = {"chosen": row[data.chosen_column], "rejected": row[data.rejected_column]}
        if has_prompt:
            pair["prompt"] = row[data.prompt_column]
        pairs.append(pair)
    return pairs


def _refuse_nulls(table, *, data: DictConfig, key: str, split: str) -> None:
    column = data[key]
    nulls = [row for row, value in enumerate(table[column]) if value is None]
    if nulls:
        raise ConfigError(
            f"The preference data ({_source(data, split)}, split {split}) has {len(nulls)} null value(s) in column "
            f"data.{key}={column!r} (rows {first_items(nulls)}, counting data rows from 0; "
            "a row without that column counts as null): every pair needs both a chosen and a rejected response. "
            "Fill them or remove those rows."
        )


class EndlessShuffleSampler(Sampler[int]):
    """Indices of ``num_items`` items forever: pass ``k`` is ``randperm(num_items)`` seeded with ``seed + k``.

    The stream is a pure function of ``(seed, position)``, so ``start=position`` resumes it exactly where a run
    stopped, whatever happened to the process. Data-parallel replicas share the one stream and deal it out: replica
    ``rank`` of ``num_replicas`` takes positions ``start + rank``, ``start + rank + num_replicas``..., so no two
    replicas draw the same position and the replicas together consume the stream as a single process would.

    Args:
        num_items: how many items there are.

    Keyword Args:
        seed: seed of the first pass's permutation.
        start: position in the (shared) endless stream where the replicas start dealing.
        shuffle: ``False`` yields ``0, 1, ..., num_items - 1`` over and over.
        num_replicas: how many data-parallel replicas share the stream.
        rank: which of them this sampler serves, in ``[0, num_replicas)``.
    """

    def __init__(
        self,
        num_items: int,
        *,
        seed: int,
        start: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if num_items < 1:
            raise ValueError(f"EndlessShuffleSampler: there must be at least one item, got num_items={num_items}.")
        if start < 0:
            raise ValueError(f"EndlessShuffleSampler: start must be >= 0, got {start}.")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"EndlessShuffleSampler: need num_replicas >= 1 and 0 <= rank < num_replicas, got "
                f"num_replicas={num_replicas}, rank={rank}."
            )
        self.num_items = num_items
        self.seed = seed
        self.start = start
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def _stream(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.num_items)
        while True:
            yield from self._order(epoch)[offset:]
            epoch, offset = epoch + 1, 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._stream(), self.rank, None, self.num_replicas)
