"""Prompt and preference-pair sources from a ``data=`` config node: the synthetic task, a user file, an HF dataset.

Formats are trl's standard ones: prompts in a ``prompt`` column; preference pairs in ``chosen``/``rejected`` with an
optional ``prompt`` (explicit prompt) or without one (implicit prompt), each as plain text or as conversational
message lists (``[{"role": ..., "content": ...}, ...]``). Column names come from the config node.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from recipes.common.config import ConfigError
from recipes.common.synthetic import make_prompts

__all__ = ["load_preference_pairs", "load_prompts", "load_table", "prompt_text"]

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_table(data: DictConfig, split: str):
    """The ``datasets.Dataset`` behind a ``file`` or ``hf`` data node for ``split`` ("train" or "eval").

    A file node reads ``path`` (train) and ``eval_path`` (eval); an HF node reads ``name_or_path`` (a folder written
    by ``save_to_disk``, or a hub name) with ``split`` / ``eval_split``. Returns None when no eval source is set.
    """
    import datasets

    if data.source == "file":
        path = data.path if split == "train" else data.eval_path
        if path is None:
            return None
        path = Path(path).expanduser()
        if not path.exists():
            raise ConfigError(f"data.{'path' if split == 'train' else 'eval_path'}={str(path)!r}: no such file.")
        if path.suffix not in _FILE_FORMATS:
            raise ConfigError(f"data.path={str(path)!r}: unknown file type; use one of {sorted(_FILE_FORMATS)}.")
        return datasets.load_dataset(_FILE_FORMATS[path.suffix], data_files=str(path), split="train")
    if data.source == "hf":
        split_name = data.split if split == "train" else data.eval_split
        if split_name is None:
            return None
        location = Path(str(data.name_or_path)).expanduser()
        if location.exists():
            loaded = datasets.load_from_disk(str(location))
            if isinstance(loaded, datasets.DatasetDict):
                if split_name not in loaded:
                    raise ConfigError(
                        f"data.name_or_path={str(location)!r} has splits {sorted(loaded)}, not {split_name!r}; set "
                        f"data.{'split' if split == 'train' else 'eval_split'} to one of them."
                    )
                return loaded[split_name]
            return loaded
        return datasets.load_dataset(str(data.name_or_path), split=split_name)
    raise ConfigError(f"data.source={data.source!r} has no table; expected 'file' or 'hf'.")


def _require_columns(table, required: list[str], *, data: DictConfig, what: str) -> None:
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise ConfigError(
            f"The {what} data ({data.source}: {data.get('path') or data.get('name_or_path')}) lacks column(s) "
            f"{missing}. Found columns: {table.column_names}; expected: {required}. Rename the columns in the file "
            f"or point the data.*_column keys at the ones you have."
        )


def prompt_text(prompt) -> str | list[dict[str, str]]:
    """A prompt as stored: plain text, or a conversational list of ``{"role", "content"}`` messages."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ConfigError(f"A prompt must be text or a list of {{role, content}} messages; got {type(prompt).__name__}.")


def load_prompts(data: DictConfig, split: str) -> list:
    """The prompts of ``split`` ("train" or "eval"): text or message lists. Empty list when no eval set is set."""
    if data.source == "synthetic":
        count = data.num_train_prompts if split == "train" else data.num_eval_prompts
        # Distinct seeds keep the eval prompts' draws independent of the train prompts'.
        return make_prompts(count, seed=data.seed if split == "train" else data.seed + 1)
    table = load_table(data, split)
    if table is None:
        return []
    _require_columns(table, [data.prompt_column], data=data, what="prompt")
    prompts = [prompt_text(p) for p in table[data.prompt_column]]
    empty = [row for row, prompt in enumerate(prompts) if not _has_content(prompt)]
    if empty:
        raise ConfigError(
            f"The prompt data ({data.source}: {data.get('path') or data.get('name_or_path')}, split {split}) has "
            f"{len(empty)} empty prompt(s) in column {data.prompt_column!r} (rows {empty[:10]}"
            f"{'...' if len(empty) > 10 else ''}): a model asked nothing learns nothing. Remove or fill them."
        )
    return prompts


def _has_content(prompt) -> bool:
    if isinstance(prompt, str):
        return bool(prompt.strip())
    return any(str(message["content"]).strip() for message in prompt)


def load_preference_pairs(data: DictConfig, split: str) -> list[dict]:
    """Preference pairs of a ``file``/``hf`` node: dicts with ``chosen``, ``rejected`` and, if present, ``prompt``."""
    table = load_table(data, split)
    if table is None:
        return []
    _require_columns(table, [data.chosen_column, data.rejected_column], data=data, what="preference")
    has_prompt = data.prompt_column in table.column_names
    pairs = []
    for row in table:
        pair = {"chosen": row[data.chosen_column], "rejected": row[data.rejected_column]}
        if has_prompt:
            pair["prompt"] = row[data.prompt_column]
        pairs.append(pair)
    return pairs
