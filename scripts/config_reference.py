"""Writes ``docs/config_reference.md``: every setting of the three recipes, one row each, generated from the two
places a setting is written (nowhere else):

- its default and its help: the YAML under ``conf/`` that sets it in the recipe's default composition (the value, and
  the comment above the key or after it);
- its type, its choices and its range: the recipe's schema (``recipes/<room>/schema.py``), which the checks run on.

A group's other options (``data=file``, ``reward_model=none``...) are documented in their own YAML files; a node whose
settings depend on one of them (``data.source``) gets a row per setting of each variant.

    python scripts/config_reference.py            # write docs/config_reference.md
    python scripts/config_reference.py --check    # exit 1 when the file is not what the YAML and schemas give

``tests/test_config_reference.py`` runs the check, and refuses a setting without help.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from recipes.common.schema import Variant, iter_settings  # noqa: E402

CONF = ROOT / "conf"
OUT = ROOT / "docs" / "config_reference.md"
# recipe -> its schema's dotted path (imported when the reference is built)
RECIPES = {
    "grpo_torchrl_rm": "recipes.grpo.schema.GRPORecipeConfig",
    "trl_grpo_torchrl_rollouts": "recipes.trl_grpo.schema.TrlGRPORecipeConfig",
    "reward_trainer_from_buffer": "recipes.reward.schema.RewardRecipeConfig",
}
_DEFAULTS_ENTRY = re.compile(r"^\s*-\s*/?(?P<group>[\w/]+)(@(?P<package>[\w.]+))?\s*:[^#]*#(?P<help>.*)$")
_KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w-]*)\s*:(?P<rest>.*)$")


@dataclass(frozen=True)
class Setting:
    """One row of the reference."""

    key: str
    kind: str
    default: str
    help: str


def yaml_help(text: str, package: str = "") -> dict[str, str]:
    """``{dotted key: help}`` of a YAML file's text: the comment lines right above a key (no blank line between)
    and the comment after its value, joined; ``package`` prefixes every key (a group file's node).

    Examples:
        >>> yaml_help("# A task.\\n\\n# How many.\\nrollout:\\n  # Rows a step.\\n  size: 4   # at least 1\\n", "data")
        {'data': 'A task.', 'data.rollout': 'How many.', 'data.rollout.size': 'Rows a step. at least 1'}
    """
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    opening = True  # the file's opening comment is the node's help (a group file's), not its first key's
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# @package"):
            continue
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("#").strip())
            continue
        if opening:
            opening = False
            if package and comments:
                found[package] = " ".join(comments)
            comments = []
        choice = _DEFAULTS_ENTRY.match(line)
        if choice is not None and choice["help"]:  # a group's line in the defaults list names what the group is
            key = ".".join(part for part in (package, choice["package"] or choice["group"]) if part)
            found.setdefault(key, choice["help"].strip())
        match = _KEY_LINE.match(line)
        if not stripped or stripped.startswith("- ") or match is None:
            comments = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        key = ".".join(part for part in [package, *(name for _, name in stack)] if part)
        inline = _inline_comment(match["rest"])
        found[key] = " ".join(part for part in [*comments, inline] if part)
        comments = []
    return found


def _inline_comment(value: str) -> str:
    # A '#' starts a comment only after whitespace and outside quotes (YAML's rule, for the values the conf holds).
    quote = None
    for index, char in enumerate(value):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (index == 0 or value[index - 1].isspace()):
            return value[index + 1 :].strip()
    return ""


def _package(path: Path, group: str) -> str:
    """The node a group file's keys land in: its ``# @package`` line, the defaults entry's ``@pkg``, or the group."""
    group, _, override = group.partition("@")
    first = path.read_text().splitlines()[:1]
    declared = first[0].removeprefix("# @package").strip() if first and first[0].startswith("# @package") else None
    package = declared if declared is not None else override or group.replace("/", ".")
    return "" if package == "_global_" else package


def _composed(recipe: str) -> tuple[Any, dict[str, str]]:
    """The recipe's default config (interpolations as written) and the help of every key its files set: the root
    file's, then each chosen group option's (a group file's comment wins: it is the one next to the value)."""
    from hydra import compose, initialize_config_dir

    import recipes.common.config  # noqa: F401  (registers the project's resolvers)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=recipe, return_hydra_config=True)
    help_texts = yaml_help((CONF / f"{recipe}.yaml").read_text())
    for group, option in cfg.hydra.runtime.choices.items():
        path = CONF / group.partition("@")[0] / f"{option}.yaml"
        if option is None or group.startswith("hydra/") or not path.is_file():
            continue
        for key, text in yaml_help(path.read_text(), _package(path, group)).items():
            if text or key not in help_texts:
                help_texts[key] = text
    values = OmegaConf.to_container(cfg, resolve=False)
    values.pop("hydra")
    return values, help_texts


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict | list):
        text = str(value)
        return text if len(text) <= 60 else f"{len(value)} entries"
    return str(value)


def _walk(schema: type, values: Any, help_texts: dict[str, str], prefix: str) -> Iterator[Setting]:
    """The rows of ``schema``'s keys under ``prefix`` (``recipes.common.schema.iter_settings``), ``values`` the YAML's
    node there."""
    for item in iter_settings(schema, prefix):
        value = _value_at(values, item.key[len(prefix) :].lstrip("."))
        if item.kind == "entries":
            # The node's other keys are the user's own (tools.<name>): one row for them, the YAML's entries as default.
            node_key = item.key.rpartition(".")[0]
            node_values = _value_at(values, node_key[len(prefix) :].lstrip(".")) or {}
            names = [name for name in node_values if name not in {f.name for f in dataclasses.fields(item.node)}]
            default = _shown({name: node_values[name] for name in names}) if names else "none"
            yield Setting(item.key, "the user's entries, one per key", default, _help(node_key, help_texts))
        elif item.kind == "variant":
            yield from _walk_variants(item.key, item.variant, value, help_texts)
        elif item.kind == "optional node":
            # A node that may be null (reward_model: none, model.lora off): the node's row, then its settings'.
            kind = f"{item.node.__name__} settings or null"
            yield Setting(item.key, kind, "null" if value is None else "set", help_texts.get(item.key, ""))
        elif item.kind == "mapping":
            yield Setting(item.key, "a mapping of the user's entries", _shown(value), _help(item.key, help_texts))
        elif item.kind == "setting" and "<name>" in item.key:
            # A setting of each of the user's entries (reward.functions.<name>.weight): no YAML sets it.
            default = _shown(item.default) if item.has_default else "required"
            yield Setting(item.key, item.description, default, _help(item.key, help_texts))
        elif item.kind == "setting":
            yield Setting(item.key, item.description, _shown(value), _help(item.key, help_texts))


def _value_at(values: Any, key: str) -> Any:
    """The YAML's value at the dotted ``key`` of ``values``; ``None`` where it has none."""
    for part in key.split(".") if key else []:
        values = values.get(part) if isinstance(values, dict) else None
    return values


def _help(key: str, help_texts: dict[str, str]) -> str:
    """A setting's own comment, or, where one comment above a node documents its settings together (``samples:``),
    a pointer to that node's."""
    if help_texts.get(key):
        return help_texts[key]
    parent = key.rpartition(".")[0]
    while parent and not help_texts.get(parent):
        parent = parent.rpartition(".")[0]
    return f"see `{parent}`" if parent else ""


def _walk_variants(key: str, variant: Variant, value: Any, help_texts: dict[str, str]) -> Iterator[Setting]:
    """A node whose settings depend on ``variant.key``: the composed variant's, then each other option's from its
    group file (``conf/<node>/<option>.yaml``), every key marked with the option it belongs to."""
    chosen = value.get(variant.key) if value else None
    for option, schema in sorted(variant.schemas.items(), key=lambda item: item[0] != chosen):
        path = CONF / key / f"{option}.yaml"
        if option == chosen:
            values, texts = value, help_texts
        elif path.is_file():
            values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            texts = {**help_texts, **yaml_help(path.read_text(), key)}
        else:
            values, texts = None, help_texts
        label = f"({key}.{variant.key}={option})"
        yield Setting(f"{key} {label}", f"{schema.__name__} settings", option, texts.get(key, ""))
        for setting in _walk(schema, values, texts, key):
            yield dataclasses.replace(setting, key=f"{setting.key} {label}")


def settings(recipe: str) -> list[Setting]:
    """Every setting of ``recipe``, in its schema's order."""
    from hydra.utils import get_object

    values, help_texts = _composed(recipe)
    return list(_walk(get_object(RECIPES[recipe]), values, help_texts, ""))


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated by `python scripts/config_reference.py` from the YAML under `conf/` (each setting's default, and",
        "its help: the comment next to it) and the recipes' schemas (`recipes/<room>/schema.py`: its type, choices",
        "and range, which the checks enforce); `tests/test_config_reference.py` fails when this page is not what they",
        "give. Edit those, then run the script. What the settings do together: [configuration.md](configuration.md).",
    ]
    for recipe in RECIPES:
        lines += ["", f"## {recipe}", "", "| setting | type | default | help |", "| --- | --- | --- | --- |"]
        lines += [f"| `{s.key}` | {_cell(s.kind)} | `{_cell(s.default)}` | {_cell(s.help)} |" for s in settings(recipe)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config_reference.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
