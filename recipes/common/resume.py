"""How a run continues: the same settings as the run it resumes, its changes named and recorded, its records cut back
to the step it resumes at. Shared by the recipes that resume (``recipes.grpo.checkpointing``,
``recipes.trl_grpo.resume``); each says where its checkpoints are and which settings may change freely.

- :func:`resumed_config`: the run's own ``resolved_config.yaml`` under this command line (never the YAML defaults),
  in this folder; a masked secret (``<HUB_TOKEN>``) is refused unless the command line gives it again.
- :func:`resume_changes` / :func:`config_changes`: what a resume changes against the run's settings;
  :func:`check_resume_changes` refuses those not named in ``resume_allow_changes``; :func:`record_resume` keeps a
  line per resume in ``resumes.jsonl``.
- :func:`truncate_metrics_csv` / :func:`read_metrics_rows`: ``metrics.csv`` without the rows logged after the step a
  run resumes at (they are logged again).

Dependencies: omegaconf, hydra (the command line's overrides).
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes.common.config import (
    MASKED_URL_PASSWORD,
    ConfigError,
    command_line_keys,
    config_record,
    is_secret_setting,
)

__all__ = [
    "RESOLVED_CONFIG_FILE",
    "RESUMES_FILE",
    "check_resume_changes",
    "config_changes",
    "read_metrics_rows",
    "record_resume",
    "resume_changes",
    "resumed_config",
    "truncate_metrics_csv",
]

RESOLVED_CONFIG_FILE = "resolved_config.yaml"  # the run's settings (recipes.common.config.write_run_config)
RESUMES_FILE = "resumes.jsonl"  # one line per resume of the run: when, from which step, what changed


def resumed_config(cfg: DictConfig, *, has_checkpoint: bool, paths_in_run: Iterable[str] = ()) -> DictConfig:
    """The config a resumed run trains with: the run's own ``resolved_config.yaml``, with what this command line sets
    on top (a setting it leaves out keeps the run's value, not the YAML default). ``output_dir`` is always this run's
    own: a copied or moved run folder resumes as itself, where it is, and never writes into the folder it was copied
    from; so are the settings of ``paths_in_run`` (folders inside the run folder, such as trl's ``train.output_dir``)
    that the command line leaves alone. ``overwrite`` and ``resume_allow_changes`` are always this command line's: a
    run started with ``overwrite=true`` resumes, and a change allowed to one resume is not allowed to the next.

    Args:
        cfg: the composed config of this command line (``output_dir`` the run folder).

    Keyword Args:
        has_checkpoint: the folder holds a checkpoint to resume (without one and without the file, ``cfg`` is
            returned: the recipe's own check then says there is nothing to resume).
        paths_in_run: dotted keys of folders inside the run folder, re-rooted in this folder.

    Raises:
        ConfigError: the folder holds a checkpoint but no ``resolved_config.yaml``; or a secret the run's record
            masks (``<HUB_TOKEN>``) that this command line does not give again.
    """
    saved_file = Path(cfg.output_dir) / RESOLVED_CONFIG_FILE
    if not saved_file.is_file():
        if not has_checkpoint:
            return cfg
        raise ConfigError(
            f"resume=true but {saved_file} is missing: the run's settings cannot be restored, and a resume with "
            "the YAML defaults in their place would train another run. Restore the file from a copy of the run, or "
            "start afresh in another folder."
        )
    saved = OmegaConf.load(saved_file)
    old_root = Path(str(saved.output_dir))  # where the run was, before this command line's settings
    command_line = command_line_keys()
    for key, kind in command_line.items():
        if kind == "delete":
            _delete(saved, key)
        elif OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT:
            _copy_setting(saved, cfg, key)
        # else a preset group (experiment=, sweep=: `# @package _global_`) that is no setting itself: the run's
        # record holds what it set, and what this command line sets on top is copied above.
    for key in paths_in_run:
        if not _set_on(command_line, key):
            _reroot(saved, key, old_root=old_root, new_root=Path(str(cfg.output_dir)))
    saved.output_dir = str(cfg.output_dir)
    # Whether to clear the folder is this command's decision, not a setting of the run: a run started with
    # overwrite=true resumes without clearing what it continues.
    saved.overwrite = cfg.overwrite
    # So are the changes this resume allows: allowed once, a change is not allowed to every later resume.
    if "resume_allow_changes" in cfg:
        saved.resume_allow_changes = cfg.resume_allow_changes
    _refuse_masked_secrets(saved, saved_file)
    OmegaConf.set_struct(saved, True)
    return saved


_ABSENT = object()


def _set_on(command_line: Mapping[str, str], key: str) -> bool:
    return any(key == given or key.startswith(f"{given}.") for given in command_line)


def _reroot(saved: DictConfig, key: str, *, old_root: Path, new_root: Path) -> None:
    value = OmegaConf.select(saved, key)
    if value is None:
        return
    path = Path(str(value))
    if path == old_root or old_root in path.parents:
        OmegaConf.update(saved, key, str(new_root / path.relative_to(old_root)), merge=False)


def _refuse_masked_secrets(saved: DictConfig | ListConfig, saved_file: Path, prefix: str = "") -> None:
    """A secret the record shows as ``<NAME>`` (or a URL whose password it shows as ``<PASSWORD>``) would reach the
    run as that text (a hub token ``<HUB_TOKEN>``)."""
    keys = saved.keys() if isinstance(saved, DictConfig) else range(len(saved))
    for key in keys:
        path = f"{prefix}.{key}" if prefix else str(key)
        node = saved._get_node(key)
        if isinstance(node, (DictConfig, ListConfig)):
            _refuse_masked_secrets(node, saved_file, path)
            continue
        value = node._value()
        masked_secret = is_secret_setting(path) and value == f"<{str(key).upper()}>"
        masked_url = isinstance(value, str) and f":{MASKED_URL_PASSWORD}@" in value
        if not node._is_interpolation() and (masked_secret or masked_url):
            raise ConfigError(
                f"resume=true: {path} is masked in {saved_file} ({value}: run records never keep a secret), so "
                f"the run cannot be continued with it. Give it again on the command line ({path}=<value>, or "
                f"{path}='${{oc.env:NAME}}' to read it from the environment), or drop it ('~{path}') if the run no "
                "longer needs it."
            )


def _copy_setting(saved: DictConfig, cfg: DictConfig, key: str) -> None:
    """``cfg``'s value at ``key`` (a setting, or a whole group node) written into ``saved``: at ``key`` when its
    parent exists there, else at the nearest ancestor that does."""
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        head = ".".join(parts[:depth])
        parent = ".".join(parts[: depth - 1])
        if depth == 1 or isinstance(OmegaConf.select(saved, parent), DictConfig):
            OmegaConf.update(saved, head, OmegaConf.select(cfg, head), merge=False, force_add=True)
            return


def _delete(saved: DictConfig, key: str) -> None:
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(saved, parent) if parent else saved
    if isinstance(node, DictConfig) and name in node:
        del node[name]


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


def resume_changes(cfg: DictConfig, *, free_keys: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """The settings of ``cfg`` that differ from the run being continued (its ``resolved_config.yaml``), as
    ``{"a.b": (old, new)}``, leaving out those a resumed run may change freely (``free_keys``). Both sides as the
    run records them (``recipes.common.config.config_record``): a secret or a setting read from the environment
    compares as its record, not its value."""
    saved = Path(cfg.output_dir) / RESOLVED_CONFIG_FILE
    if not saved.is_file():
        return {}
    return config_changes(OmegaConf.to_container(OmegaConf.load(saved)), config_record(cfg), ignored=free_keys)


def check_resume_changes(changes: Mapping[str, tuple[Any, Any]], *, allowed: Iterable[str]) -> None:
    """Refuses the changes of a resume (:func:`resume_changes`) that ``allowed`` (``resume_allow_changes``: dotted
    keys, or the prefix of a group) does not name, listing them and the ways out."""
    allowed = [str(name) for name in allowed]
    refused = {
        key: change
        for key, change in changes.items()
        if not any(key == name or key.startswith(f"{name}.") for name in allowed)
    }
    if refused:
        listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
        raise ConfigError(
            f"resume=true with settings that differ from the run being continued ({listed}). A resumed run must "
            "train as the run it continues: pass the same settings, or name the changes you mean "
            f"(resume_allow_changes=[{','.join(refused)}]), or start a new run in another folder."
        )


def record_resume(folder: str | Path, *, step: int, changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Appends one line to ``<folder>/resumes.jsonl``: when the run resumed, from which step, with which changes."""
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "step": step,
        "changes": {k: list(v) for k, v in changes.items()},
    }
    with open(Path(folder) / RESUMES_FILE, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def truncate_metrics_csv(path: str | Path, last_step: int) -> None:
    """Drops the rows of ``metrics.csv`` logged after ``last_step``, so a resumed run's rows follow on without repeats.

    Rows written between the last checkpoint and a crash are recomputed by the resumed run.
    """
    path = Path(path)
    if not path.exists():
        return
    header, rows = read_metrics_rows(path)
    if header is None:
        return
    staging = path.with_name(f".{path.name}.tmp")
    with open(staging, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(row for step, row in rows if step <= last_step)
    staging.replace(path)


def read_metrics_rows(path: str | Path) -> tuple[list[str] | None, list[tuple[float, list[str]]]]:
    """``metrics.csv``'s header and its rows with their step; a file this recipe did not write (no step column, a
    step that is no number) is refused naming the line."""
    path = Path(path)
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        return None, []
    header, body = rows[0], rows[1:]
    if "step" not in header:
        raise ConfigError(f"{path} has no step column (its header: {header}); it is no metrics file this recipe wrote.")
    column = header.index("step")
    stepped = []
    for number, row in enumerate(body, 2):
        if not row:
            continue
        try:
            stepped.append((float(row[column]), row))
        except (ValueError, IndexError):
            raise ConfigError(
                f"{path}, line {number}: its step {row[column] if len(row) > column else None!r} is no number: the "
                "file was edited or damaged. Fix or delete that line (the checkpoint holds the run's history)."
            ) from None
    return header, stepped
