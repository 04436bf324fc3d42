"""The typed schema a recipe's composed config is checked against and read through, before anything loads.

Every default lives in the YAML (``conf/``); a schema says what each key may hold: its type, its range, its choices,
and the rules between the keys of one node. :func:`check_config` walks a resolved config against one and refuses,
naming the key and the fix:

- a key the recipe does not read (a typo, or a ``+key=value`` Hydra added although nothing reads it), with the
  nearest known keys, or, for a name another tool gives a setting (:class:`Aliases`: trl's ``beta``), the recipe's
  key for it: such a setting would otherwise be accepted and silently ignored;
- a key the recipe reads that the config lacks;
- a value of the wrong type (``true`` where a number is read, a string where a list is), outside its range, or not
  one of its choices; and any float anywhere in the config, open mappings included, that is NaN or infinite (NaN
  compares false with every bound, so range checks alone let it through);
- then a node whose own rules fail: each node is built (:func:`typed_config`), and a ``ValueError`` its
  ``__post_init__`` raises becomes a :class:`~recipes.common.config.ConfigError` naming the node's keys in full.

A schema is a dataclass whose fields carry types (``int``, ``float``, ``bool``, ``str``, ``None``, ``Literal[...]``,
``list[...]``, unions, nested dataclasses) and, through ``typing.Annotated``, a :class:`Range`, a :class:`Hint` (the
message a refusal gives instead of the generic one), an :data:`OPEN` mapping (its keys are the user's:
``reward.terms``, trl's ``train:`` node), an :data:`ENTRIES` field (a node's keys beside its settings, the user's:
``tools:``, :class:`ToolsNode`) or a :class:`Variant` (a node whose fields depend on one of them, as
``data.source``); an :data:`OPEN` mapping's values may be nodes themselves (``reward.functions``:
:class:`RewardFunctionNode`), and a :class:`Hint` on such a node is its refusal when a value is no node of it. The
dataclasses hold no defaults (those are the YAML's), but for a field of the user's own entries, which no YAML holds
(``reward.functions.<name>.weight``): such a field may be left out. A node is built from a config, and the
code that reads it reads typed values (``recipes.grpo.loss`` reads the ``Loss`` node). Modules that still need a list
of choices take it from the schema's ``Literal`` (``typing.get_args``).

- :func:`checked_config` / :func:`checked_tree`: what a recipe's ``validate`` starts with: the resolved config, and
  (``checked_tree``) its typed tree.
- :func:`typed_config`: one config (or sub-node) checked and built into its schema's dataclasses.
- :func:`config_view`: a typed node as a ``DictConfig`` again, for the shared helpers that merge nodes or read them
  by name.
- :func:`iter_settings`: every key of a schema with its type, choices and range (:class:`SchemaSetting`), as the
  refusal of an unknown command-line key and ``scripts/config_reference.py`` read them; one dispatch (a node, a
  :class:`Variant`, a mapping, a value) serves it, the checks and the building.
- :class:`TrainerNode`, :func:`checked_trainer_config`: trl's ``train:`` node, over trl's own defaults.

Dependencies: omegaconf.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Union

from omegaconf import DictConfig, OmegaConf

from recipes.common.config import ConfigError, command_line_keys, resolved
from recipes.common.lora import settle_lora_node

__all__ = [
    "OPEN",
    "Aliases",
    "DATA_SOURCES",
    "ArithmeticData",
    "CalculatorData",
    "DType",
    "DataNode",
    "ENTRIES",
    "FileData",
    "HFData",
    "Hint",
    "LoggerNode",
    "LoraNode",
    "MaxGradNorm",
    "ModelNode",
    "NumThreads",
    "Range",
    "SyntheticData",
    "ToolsNode",
    "TrainerNode",
    "Variant",
    "RayNode",
    "RewardFunctionNode",
    "SchemaSetting",
    "RewardFunctions",
    "WandbLogger",
    "WorkerResourcesNode",
    "check_config",
    "check_trainer_config_keys",
    "checked_config",
    "refuse_unknown_overrides",
    "trainer_aliases",
    "checked_trainer_config",
    "checked_tree",
    "config_view",
    "iter_settings",
    "setting_type",
    "trainer_config_view",
    "typed_config",
]


@dataclass(frozen=True)
class Range:
    """Bounds of a number: ``ge``/``gt`` below, ``le``/``lt`` above (``None``: unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def __str__(self) -> str:
        low = f">= {self.ge}" if self.ge is not None else f"> {self.gt}" if self.gt is not None else None
        high = f"<= {self.le}" if self.le is not None else f"< {self.lt}" if self.lt is not None else None
        return " and ".join(bound for bound in (low, high) if bound)


@dataclass(frozen=True)
class Hint:
    """The message a field's refusal (wrong type, not one of its choices, out of its range: written to read right for
    each) gives instead of the generic one, to say why the value cannot work and what to write; a NaN keeps its own. A
    template over ``{key}``, ``{value}`` (its repr), ``{choices}`` (a ``Literal``'s values) and ``{bounds}`` (its
    :class:`Range`).

    Examples:
        >>> Hint("{key}={value}: the recipe trains with {choices}.").message("opt", "SGD", Literal["Adam"], None)
        "opt='SGD': the recipe trains with ['Adam']."
    """

    template: str

    def message(self, key: str, value: Any, base: Any, bounds: Range | None) -> str:
        choices = list(typing.get_args(base)) if typing.get_origin(base) is Literal else []
        return self.template.format(key=key, value=repr(value), choices=choices, bounds=bounds)


class _Open:
    """Marks a mapping whose keys are the user's own (their values are still checked against the value type)."""

    def __repr__(self) -> str:
        return "OPEN"


OPEN = _Open()


class _Entries:
    """Marks the one field of a node that holds the node's other keys: the user's own entries beside its settings
    (``tools:``: ``timeout_s`` and ``max_result_tokens``, then one entry per tool). Its keys are not the node's fields:
    every key the node's other fields do not name is an entry, checked against the value type; the built field is a
    plain dict of them."""

    def __repr__(self) -> str:
        return "ENTRIES"


ENTRIES = _Entries()


@dataclass(frozen=True)
class Aliases:
    """Another tool's names for a recipe's settings: a config key named as ``source`` names a setting (wherever it is
    written: ``+loss.beta``, ``+beta``) is refused naming the recipe's own key for it, rather than the nearest
    spelling (trl's ``beta`` is not the recipe's ``loss.delta``).

    Args:
        source: whose names they are, for the message (``"trl.GRPOConfig"``).
        names: that name -> the recipe's key (or a few words naming the keys, where it is not one key).

    Examples:
        >>> @dataclass
        ... class Loss:
        ...     kl_to_ref_coeff: float
        ...     delta: float
        >>> check_config({"kl_to_ref_coeff": 0.0, "delta": 2.0, "beta": 0.1}, Loss, recipe="demo", key="loss",
        ...              aliases=Aliases("trl.GRPOConfig", {"beta": "loss.kl_to_ref_coeff"}))
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: loss.beta: ... is loss.kl_to_ref_coeff here: set loss.kl_to_ref_coeff=0.1...
    """

    source: str
    names: Mapping[str, str]

    def message(self, error: _UnknownKey) -> str | None:
        """The refusal of ``error``'s key when its name is one of :attr:`names`, else ``None``."""
        target = self.names.get(error.name)
        if target is None:
            return None
        fix = f"set {target}={_shown_value(error.value)}" if re.fullmatch(r"[\w.]+", target) else f"use {target}"
        # The node's own keys that spell the name out (loss.sapo.temperature_pos for temperature) stay suggested.
        spelled = [nearest for nearest in error.nearest if error.name in nearest.rsplit(".", 1)[-1]]
        suggestion = f"Did you mean {' or '.join(spelled)}? " if spelled else ""
        return (
            f"{error.key}: {error.recipe} has no such setting, so it would be ignored. {suggestion}{self.source}'s "
            f"{error.name} is {target} here: {fix}. {error.known_settings}"
        )


def refuse_unknown_overrides(
    argv: Sequence[str],
    schema: type,
    *,
    recipe: str,
    aliases: Aliases | Callable[[], Aliases] | None = None,
    renamed: Mapping[str, str] = {},
) -> None:
    """Before Hydra composes the config (a recipe's ``__main__``): a command-line override without ``+`` of a key that
    ``schema`` does not have is refused as :func:`check_config` refuses it, naming the nearest keys or, for another
    tool's name (``aliases``: ``num_generations=4``, ``train.learning_rate=1e-3``), the recipe's key for it, or, for a
    key of an earlier version (``renamed``, with or without ``+``), the key that replaced it. Hydra would answer only
    "Could not override ... Key ... is not in struct". Keys under an open mapping, a choice of schemas or Hydra's own
    are left to Hydra. Prints the refusal and exits with status 1.

    Keyword Args:
        aliases: another tool's names, or a function that builds them (called only for an unknown key).
        renamed: keys of earlier versions of the recipe and what replaced them (as :func:`check_config`'s).
    """
    for argument in argv:
        key, equals, value = argument.partition("=")
        if key == "experiment" and equals:
            _refuse_unfit_presets(value, recipe)
        if key.lstrip("+") in renamed:
            old = key.lstrip("+")
            print(_renamed_message(old, renamed[old], value if equals else None, recipe), file=sys.stderr)
            raise SystemExit(1)
        if not equals or key.startswith(("-", "+", "~", "hydra")) or "/" in key or "@" in key:
            continue
        if (_CONF_DIR / key.replace(".", "/")).is_dir():  # a config group (experiment=, sweep=): no setting itself
            continue
        error = _unknown_override(key, value, schema, recipe)
        if error is None:
            continue
        known = aliases() if callable(aliases) else aliases
        print((known.message(error) if known is not None else None) or str(error), file=sys.stderr)
        raise SystemExit(1)


def trainer_aliases(config_class: type) -> Aliases:
    """A trl / transformers trainer config's fields as the ``train.<field>`` keys of a recipe whose ``train:`` node
    takes them (``learning_rate=1e-3`` is ``train.learning_rate=1e-3`` there)."""
    names = {field.name: f"train.{field.name}" for field in dataclasses.fields(config_class)}
    return Aliases(f"trl.{config_class.__name__}", names)


_CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Presets that changed name: the old name -> the new one.
_RENAMED_PRESETS = {"calculator_trl": "calculator"}


def _refuse_unfit_presets(value: str, recipe: str) -> None:
    """Refuses ``experiment=<value>`` (a name, or a sweep's comma list) naming what fits, when a preset has no part in
    ``recipe``'s keys (``conf/experiment_for/<recipe>/<name>.yaml``: the preset fits the other recipe only) or changed
    name; a name that is no preset at all is left to Hydra, which lists the presets there are."""
    if "(" in value:  # a sweep function (choice(...), glob(...)): Hydra expands it
        return
    fitting = _CONF_DIR / "experiment_for" / recipe
    for name in (part.strip() for part in value.split(",")):
        if name in _RENAMED_PRESETS:
            message = (
                f"experiment={name}: this preset is experiment={_RENAMED_PRESETS[name]} now, one name in both GRPO "
                f"recipes: run python recipes/{recipe}.py experiment={_RENAMED_PRESETS[name]}."
            )
        elif not (_CONF_DIR / "experiment" / f"{name}.yaml").is_file() or (fitting / f"{name}.yaml").is_file():
            continue
        else:
            others = sorted(part.parent.name for part in (_CONF_DIR / "experiment_for").glob(f"*/{name}.yaml"))
            fits = " or ".join(f"recipes/{other}.py" for other in others) or "no recipe"
            own = sorted(part.stem for part in fitting.glob("*.yaml") if part.stem != "none")
            choices = f"this recipe's presets are {own}" if own else f"recipes/{recipe}.py takes no preset"
            message = (
                f"experiment={name} fits {fits}, not recipes/{recipe}.py (there is no "
                f"conf/experiment_for/{recipe}/{name}.yaml): {choices}; conf/experiment/{name}.yaml says what the "
                "preset is."
            )
        print(message, file=sys.stderr)
        raise SystemExit(1)


def _unknown_override(key: str, value: str, schema: type, recipe: str) -> _UnknownKey | None:
    """The refusal of ``key`` when the dataclasses of ``schema`` along its path do not have it; ``None`` when they do
    or the path leaves them (an open mapping, a choice of schemas, a value)."""
    settings = {setting.key: setting for setting in iter_settings(schema)}
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):
        setting = settings.get(".".join(parts[:depth]))
        if setting is None:
            break  # the first unknown part is the unknown key
        if depth == len(parts) or setting.kind != "node":
            return None
    parent, name = ".".join(parts[: depth - 1]), parts[depth - 1]
    known = [
        setting.key.rpartition(".")[2]
        for setting in settings.values()
        if setting.key.rpartition(".")[0] == parent and setting.kind != "entries"
    ]
    full = _join(parent, name)
    nearest = [_join(parent, n) for n in difflib.get_close_matches(name, known, n=3, cutoff=0.5)]
    message, settings = _unknown_key_message(full, nearest, known, parent, recipe)
    return _UnknownKey(message, key=full, value=value, recipe=recipe, nearest=nearest, known_settings=settings)


class _UnknownKey(ConfigError):
    """A key the schema does not have, with what :class:`Aliases` needs to name the recipe's own key for it."""

    def __init__(self, message: str, *, key: str, value: Any, recipe: str, nearest: list[str], known_settings: str):
        super().__init__(message)
        self.key, self.value, self.recipe, self.known_settings = key, value, recipe, known_settings
        self.nearest = nearest  # the node's keys nearest in spelling, in full
        self.name = key.rsplit(".", 1)[-1]


def _shown_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


@dataclass(frozen=True)
class Variant:
    """A node whose schema depends on the value of one of its keys: ``Variant("source", {"file": FileData, ...})``."""

    key: str
    schemas: Mapping[str, type]


def check_config(
    cfg,
    schema: type,
    *,
    recipe: str,
    renamed: Mapping[str, str] = {},
    aliases: Aliases | None = None,
    key: str = "",
) -> None:
    """Refuses a config that does not fit ``schema`` (see the module docstring), with one message naming the key.

    Args:
        cfg: the composed config (a ``DictConfig`` without Hydra's own ``hydra`` node, or a plain mapping); its
            interpolations are resolved first.
        schema: the recipe's schema dataclass.

    Keyword Args:
        recipe: the recipe's name, for the messages.
        renamed: keys of earlier versions of the recipe and what replaced them (named when a config still sets one).
        aliases: another tool's names for the recipe's settings (:class:`Aliases`), named when a config uses one.
        key: where ``cfg`` sits in the recipe's config, for the messages.

    Raises:
        ConfigError: the first key that does not fit.

    Examples:
        >>> @dataclass
        ... class Loss:
        ...     clip_epsilon: Annotated[float, Range(gt=0)]
        >>> check_config({"clip_epsilon": 0.2, "loss_type": "dapo"}, Loss, recipe="demo")
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: loss_type: demo has no such setting, so it would be ignored...
        >>> check_config({"clip_epsilon": float("nan")}, Loss, recipe="demo")
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: clip_epsilon=nan: not a finite number. ...
    """
    typed_config(cfg, schema, recipe=recipe, renamed=renamed, aliases=aliases, key=key)


def typed_config(
    cfg,
    schema: type,
    *,
    recipe: str = "this recipe",
    renamed: Mapping[str, str] = {},
    aliases: Aliases | None = None,
    key: str = "",
) -> Any:
    """``cfg`` checked against ``schema`` (:func:`check_config`) and built into its dataclasses: every node an
    instance of its schema class (a :class:`Variant` of the class its key picks), a ``float`` field a float, an
    :data:`OPEN` mapping a plain dict. Each node's ``__post_init__`` runs on the way: a ``ValueError`` it raises
    becomes a :class:`ConfigError` whose ``<field>=`` mentions name the node's keys in full.

    Keyword Args:
        key: where ``cfg`` sits in the recipe's config (``"loss"`` for ``cfg.loss``), for the messages.

    Examples:
        >>> @dataclass
        ... class Clip:
        ...     low: Annotated[float, Range(gt=0)]
        ...     high: Annotated[float, Range(gt=0)]
        ...     def __post_init__(self):
        ...         if self.high < self.low:
        ...             raise ValueError(f"high={self.high} is below low={self.low}: set high={self.low} or more.")
        >>> typed_config({"low": 1, "high": 2.5}, Clip)
        Clip(low=1.0, high=2.5)
        >>> typed_config({"low": 0.3, "high": 0.2}, Clip, key="loss.clip")
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: loss.clip.high=0.2 is below loss.clip.low=0.3: set loss.clip.high=0.3 or ...
    """
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    _refuse_renamed(values, renamed, recipe)
    try:
        _check(values, schema, key, recipe)
    except _UnknownKey as error:
        message = aliases.message(error) if aliases is not None else None
        raise ConfigError(message or str(error)) from None
    return _build(values, schema, key)


def checked_tree(
    cfg: DictConfig, schema: type, *, recipe: str, renamed: Mapping[str, str] = {}, aliases: Aliases | None = None
) -> tuple[DictConfig, Any]:
    """The config a run trains with and its typed tree: ``cfg``'s settings resolved once
    (``recipes.common.config.resolved``), checked against ``schema`` (:func:`check_config`), LoRA on or off in its
    ``model`` and ``reward_model`` nodes as the command line says (``recipes.common.lora.settle_lora_node``), then
    built into ``schema``'s dataclasses (:func:`typed_config`)."""
    cfg = resolved(cfg)
    check_config(cfg, schema, recipe=recipe, renamed=renamed, aliases=aliases)
    command_line = command_line_keys()
    for key in ("model", "reward_model"):
        settle_lora_node(cfg, key, command_line)
    return cfg, typed_config(cfg, schema, recipe=recipe)


def checked_config(
    cfg: DictConfig, schema: type, *, recipe: str, renamed: Mapping[str, str] = {}, aliases: Aliases | None = None
) -> DictConfig:
    """The resolved, checked config of :func:`checked_tree`, which the recipes read."""
    return checked_tree(cfg, schema, recipe=recipe, renamed=renamed, aliases=aliases)[0]


def config_view(node: Any) -> DictConfig:
    """A typed node (a schema dataclass :func:`typed_config` built) as a read-only ``DictConfig`` of the same values,
    for the shared helpers that need one rather than attribute reads: ``recipes.common.models`` merges a model node
    with OmegaConf (an adapter's base node), which a dataclass with a union field (``LoraNode.target_modules``) cannot
    go through; ``recipes.common.data`` reads a data node's columns by name (``data[key]``, ``data.get``). A node
    that is a ``DictConfig`` already (a composed config's, as scripts and tests hand the helpers) is returned as it is.

    Examples:
        >>> @dataclass
        ... class Data:
        ...     source: str
        ...     prompt_column: str
        >>> view = config_view(Data("file", "prompt"))
        >>> view["prompt_column"], view.source
        ('prompt', 'file')
    """
    if isinstance(node, DictConfig):
        return node
    view = OmegaConf.create(dataclasses.asdict(node))
    OmegaConf.set_struct(view, True)  # as the checked config: a key it lacks raises
    OmegaConf.set_readonly(view, True)  # a view: what a helper changed would not reach the typed tree
    return view


def _refuse_renamed(values: Any, renamed: Mapping[str, str], recipe: str) -> None:
    for old, new in renamed.items():
        parent, _, name = old.rpartition(".")
        node = values
        for part in parent.split(".") if parent else []:
            node = node.get(part, {}) if isinstance(node, Mapping) else {}
        if isinstance(node, Mapping) and name in node:
            raise ConfigError(_renamed_message(old, new, node[name], recipe))


def _renamed_message(old: str, new: str, value: Any, recipe: str) -> str:
    """The refusal of a key of an earlier version: the key that replaced it, with the value where that is one key.

    Examples:
        >>> _renamed_message("train.temperature", "rollout.generation.temperature", 0.7, "demo")
        'train.temperature is gone from demo: use rollout.generation.temperature=0.7.'
        >>> _renamed_message("loss.aggregation", "loss.type (token_mean is bnpo)", "token_mean", "demo")
        'loss.aggregation is gone from demo: use loss.type (token_mean is bnpo).'
    """
    plain = re.fullmatch(r"[\w.]+", new) and value is not None and not isinstance(value, (Mapping, list))
    return (
        f"{old} is gone from {recipe}: use {new}={_shown_value(value)}."
        if plain
        else f"{old} is gone from {recipe}: use {new}."
    )


# ------------------------------------------------------------------------------------------------ walking


@dataclass(frozen=True)
class _Shape:
    """How a schema type is read, the one dispatch of checking, building and walking: a ``variant`` node (its
    :class:`Variant`), a ``node`` (a dataclass), a ``mapping`` (:data:`OPEN`, ``dict[...]``, :data:`ENTRIES`: its
    values of :attr:`item_type`), or a ``value`` (a type, a union, a choice, a list)."""

    base: Any  # the type without its ``Annotated`` extras
    extras: tuple

    @property
    def variant(self) -> Variant | None:
        return next((extra for extra in self.extras if isinstance(extra, Variant)), None)

    @property
    def hint(self) -> Hint | None:
        return next((extra for extra in self.extras if isinstance(extra, Hint)), None)

    @property
    def kind(self) -> Literal["variant", "node", "mapping", "value"]:
        if self.variant is not None:
            return "variant"
        if dataclasses.is_dataclass(self.base):
            return "node"
        mapping = typing.get_origin(self.base) in (dict, Mapping) or self.base is dict
        return "mapping" if mapping or OPEN in self.extras or ENTRIES in self.extras else "value"

    @property
    def item_type(self) -> Any:
        """A mapping's value type (``dict[str, Any]``: ``Any``)."""
        args = typing.get_args(self.base)
        return args[1] if len(args) == 2 else Any


def _shape(expected: Any) -> _Shape:
    if typing.get_origin(expected) is Annotated:
        base, *extras = typing.get_args(expected)
        return _Shape(base, tuple(extras))
    return _Shape(expected, ())


@dataclass(frozen=True)
class SchemaSetting:
    """One key of a schema, as :func:`iter_settings` finds it.

    Attributes:
        key: dotted; ``<name>`` stands for a key that is the user's (``tools.<name>``,
            ``reward.functions.<name>.weight``).
        expected: its type as the schema writes it (``Annotated`` extras included).
        kind: ``setting`` (a value), ``node`` (a dataclass: its settings follow), ``optional node`` (a node or null:
            its settings follow), ``variant`` (a :class:`Variant` node: its settings depend on its key's value, walk
            ``variant.schemas[<value>]`` under this key), ``mapping`` (:data:`OPEN`: the user's names; where its values
            are nodes, their settings follow under ``<key>.<name>``), ``entries`` (an :data:`ENTRIES` field: the
            node's keys beside its settings).
        node: a node's dataclass (``node``, ``optional node``; ``entries``: the node holding them).
        variant: a ``variant``'s :class:`Variant`.
        has_default, default: whether the schema gives a default, and that default (a setting of the user's
            entries: ``reward.functions.<name>.weight``); every other default is the YAML's.
    """

    key: str
    expected: Any
    kind: Literal["setting", "node", "optional node", "variant", "mapping", "entries"]
    node: type | None = None
    variant: Variant | None = None
    has_default: bool = False
    default: Any = None

    @property
    def description(self) -> str:
        """Its type, choices and range, as refusals and ``docs/config_reference.md`` write them (``setting_type``)."""
        return setting_type(self.expected)


def iter_settings(schema: type, prefix: str = "") -> Iterator[SchemaSetting]:
    """Every key of ``schema``'s nodes, in their fields' order, dotted from ``prefix``: each node's settings after it
    (an optional node's too), a :class:`Variant` node alone, an :data:`OPEN` mapping's value node's settings under
    ``<key>.<name>`` (see :class:`SchemaSetting`).

    Examples:
        >>> [(s.key, s.kind, s.description) for s in iter_settings(ModelNode, "model")][2:6]
        [('model.trust_remote_code', 'setting', 'true or false'), ('model.lora', 'optional node', 'LoraNode or null'),
         ('model.lora.enabled', 'setting', 'true or false'), ('model.lora.r', 'setting', 'an integer >= 1')]
        >>> [(s.key, s.has_default, s.default) for s in iter_settings(RewardFunctionNode, "reward.functions.<name>")]
        [('reward.functions.<name>.function', False, None), ('reward.functions.<name>.weight', True, 1.0)]
    """
    hints = _type_hints(schema)
    entries = _entries_field(schema)
    for field in dataclasses.fields(schema):
        expected, key = hints[field.name], _join(prefix, field.name)
        shape = _shape(expected)
        optional = _optional_node(shape.base)
        if field.name == entries:
            yield SchemaSetting(_join(prefix, "<name>"), expected, "entries", node=schema)
        elif shape.variant is not None:
            yield SchemaSetting(key, expected, "variant", variant=shape.variant)
        elif shape.kind == "node" or optional is not None:
            node = shape.base if optional is None else optional
            yield SchemaSetting(key, expected, "node" if optional is None else "optional node", node=node)
            yield from iter_settings(node, key)
        elif shape.kind == "mapping":
            yield SchemaSetting(key, expected, "mapping")
            item = _shape(shape.item_type)
            if item.kind == "node":
                yield from iter_settings(item.base, _join(key, "<name>"))
        else:
            has_default = field.default is not dataclasses.MISSING
            default = field.default if has_default else None
            yield SchemaSetting(key, expected, "setting", has_default=has_default, default=default)


def _optional_node(expected: Any) -> type | None:
    """The node of a ``Node | None`` type (``model.lora``, ``reward_model``), else ``None``."""
    options = [option for option in typing.get_args(expected) if option is not type(None)]
    if typing.get_origin(expected) in (Union, types.UnionType) and len(options) == 1:
        return options[0] if dataclasses.is_dataclass(options[0]) and isinstance(options[0], type) else None
    return None


# ------------------------------------------------------------------------------------------------ checking


def _check(value: Any, expected: Any, key: str, recipe: str) -> None:
    shape = _shape(expected)
    if shape.variant is not None:
        _check_variant(value, shape.variant, key, recipe)
    elif shape.kind == "node":
        _check_node(value, shape.base, key, recipe, hint=shape.hint)
    elif shape.kind == "mapping":
        _check_open(value, shape, key, recipe)
    else:
        _check_leaf(value, shape.base, shape.extras, key, recipe)


def _check_node(value: Any, schema: type, key: str, recipe: str, hint: Hint | None = None) -> None:
    """``value`` as a node of ``schema``; ``hint``: the refusal of a value that is no such node (not a mapping, or
    without a key that has no default)."""
    if not isinstance(value, Mapping):
        if hint is not None:
            raise ConfigError(hint.message(key, value, schema, None))
        raise ConfigError(f"{key}={value!r}: expected a mapping of settings ({', '.join(_field_names(schema))}).")
    hints = _type_hints(schema)
    known = _field_names(schema)
    entries = _entries_field(schema)
    for name in value:
        if name not in known and entries is not None:
            _check(value[name], _shape(hints[entries]).item_type, _join(key, str(name)), recipe)
        elif name not in known:
            full = _join(key, str(name))
            nearest = [_join(key, n) for n in difflib.get_close_matches(str(name), known, n=3, cutoff=0.5)]
            message, settings = _unknown_key_message(full, nearest, known, key, recipe)
            raise _UnknownKey(
                message, key=full, value=value[name], recipe=recipe, nearest=nearest, known_settings=settings
            )
    for name in known:
        if name not in value and _has_default(schema, name):
            continue
        if name not in value and hint is not None:
            raise ConfigError(hint.message(key, value, schema, None))
        if name not in value:
            raise ConfigError(
                f"{_join(key, name)} is missing: {recipe} reads it. Restore it in the YAML (or pass "
                f"{_join(key, name)}=<value>). A run folder saved before this setting existed lacks it too: resume it "
                f"with {_join(key, name)}=<value> resume_allow_changes=[{_join(key, name)}] (its default: "
                "docs/config_reference.md)."
            )
        _check(value[name], hints[name], _join(key, name), recipe)


def _check_variant(value: Any, variant: Variant, key: str, recipe: str) -> None:
    if not isinstance(value, Mapping) or variant.key not in value:
        raise ConfigError(f"{key}: expected a mapping with a {variant.key!r} setting ({sorted(variant.schemas)}).")
    choice = value[variant.key]
    if choice not in variant.schemas:
        raise ConfigError(f"{_join(key, variant.key)}={choice!r}: expected one of {sorted(variant.schemas)}.")
    _check_node(value, variant.schemas[choice], key, recipe)


def _check_open(value: Any, shape: _Shape, key: str, recipe: str) -> None:
    if value is None and _allows_none(shape.base):
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value!r}: expected a mapping (name: setting).")
    for name, item in value.items():
        _check(item, shape.item_type, _join(key, str(name)), recipe)


def _check_leaf(value: Any, base: Any, extras: tuple, key: str, recipe: str) -> None:
    """A value of a type, a choice or a range; refused with the field's :class:`Hint` where it has one."""
    if base is Any:
        _check_finite(value, key)
        return
    bounds = next((extra for extra in extras if isinstance(extra, Range)), None)
    fits = _fits(value, base, key, recipe)
    if fits and (bounds is None or not _is_number(value) or bounds.holds(value)):
        return
    hint = next((extra for extra in extras if isinstance(extra, Hint)), None)
    if hint is not None:
        raise ConfigError(hint.message(key, value, base, bounds))
    if not fits and base is int and isinstance(value, float) and value.is_integer():
        # 1e10 on a command line is a float to Hydra's parser: the fix is to write the digits.
        raise ConfigError(f"{key}={value!r}: expected an integer; write it as one ({key}={int(value)}).")
    if not fits:
        raise ConfigError(f"{key}={value!r}: expected {_describe(base)}.")
    raise ConfigError(f"{key}={value!r} must be {bounds}.")


def _fits(value: Any, expected: Any, key: str, recipe: str) -> bool:
    """Whether ``value`` is of type ``expected`` (raising for a non-finite float or a bad item of a list)."""
    if dataclasses.is_dataclass(expected):
        if not isinstance(value, Mapping):
            return False
        _check_node(value, expected, key, recipe)
        return True
    origin = typing.get_origin(expected)
    if origin in (Union, types.UnionType):
        return any(_fits_quietly(value, option, key, recipe) for option in typing.get_args(expected))
    if origin is Literal:
        return value in typing.get_args(expected) and type(value) in {type(v) for v in typing.get_args(expected)}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        (item_type, *_) = typing.get_args(expected) or (Any,)
        for index, item in enumerate(value):
            _check(item, item_type, f"{key}[{index}]", recipe)
        return True
    if expected is type(None) or expected is None:
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        if not _is_number(value):
            return False
        _check_finite(value, key)
        return True
    if expected is str:
        return isinstance(value, str)
    if _shape(expected).extras:  # an annotated option of a union
        _check(value, expected, key, recipe)
        return True
    return isinstance(value, expected)


def _fits_quietly(value: Any, option: Any, key: str, recipe: str) -> bool:
    try:
        return _fits(value, option, key, recipe)
    except ConfigError:
        # A value that has this option's type but breaks its range or finiteness: say so, rather than "wrong type".
        if _has_type(value, option):
            raise
        return False


def _has_type(value: Any, expected: Any) -> bool:
    """Whether ``value`` is of ``expected``'s type, its bounds and its nodes' contents aside: what picks the option
    of a union a value is checked and built as."""
    shape = _shape(expected)
    base, origin = shape.base, typing.get_origin(shape.base)
    if shape.kind != "value":
        return isinstance(value, Mapping)
    if origin in (Union, types.UnionType):
        return any(_has_type(value, option) for option in typing.get_args(base))
    if origin is Literal:
        return value in typing.get_args(base)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if base is Any:
        return True
    if base is None or base is type(None):
        return value is None
    if base is float:
        return _is_number(value)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_finite(value: Any, key: str) -> None:
    """Any float in ``value`` (a leaf, or nested in lists and mappings) must be finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{key}={value}: not a finite number. NaN and infinity pass range checks unnoticed (NaN compares false "
            "with every bound) and would train garbage; give a finite value."
        )
    if isinstance(value, Mapping):
        for name, item in value.items():
            _check_finite(item, _join(key, str(name)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_finite(item, f"{key}[{index}]")


def _allows_none(expected: Any) -> bool:
    return expected is None or type(None) in typing.get_args(expected)


def _describe(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin in (Union, types.UnionType):
        options = typing.get_args(expected)
        if int in options and float in options:  # a number kept as written (10 stays 10): a number all the same
            options = tuple(option for option in options if option is not int)
        return " or ".join(_describe(option) for option in options)
    if origin is Literal:
        return f"one of {list(typing.get_args(expected))}"
    if origin in (list, tuple):
        args = typing.get_args(expected)
        return f"a list of {_describe(args[0]) if args else 'values'}"
    if origin in (dict, Mapping) or expected is dict:
        return "a mapping"
    if origin is Annotated:
        base, *extras = typing.get_args(expected)
        bounds = next((extra for extra in extras if isinstance(extra, Range)), None)
        return _describe(base) + (f" {bounds}" if bounds else "")
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(expected, getattr(expected, "__name__", str(expected)))


def _field_names(schema: type) -> list[str]:
    """The keys a node of ``schema`` has: its fields, less the one holding its :data:`ENTRIES`."""
    entries = _entries_field(schema)
    return [field.name for field in dataclasses.fields(schema) if field.name != entries]


def _has_default(schema: type, name: str) -> bool:
    """Whether the field ``name`` of ``schema`` has a default (a field of the user's entries may be left out)."""
    field = schema.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    """``schema``'s field types, Annotated extras kept; read-only. Evaluated once per class: under ``from __future__
    import annotations`` each call compiles every annotation's text again (a third of a config check's time)."""
    return typing.get_type_hints(schema, include_extras=True)


def _entries_field(schema: type) -> str | None:
    """The field of ``schema`` marked :data:`ENTRIES`, if it has one."""
    hints = _type_hints(schema)
    marked = [field.name for field in dataclasses.fields(schema) if ENTRIES in _shape(hints[field.name]).extras]
    return marked[0] if marked else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unknown_key_message(key: str, nearest: list[str], known: list[str], parent: str, recipe: str) -> tuple[str, str]:
    """The refusal of an unknown ``key``, with the ``nearest`` known keys; and its last sentence alone (the settings
    there are), which :class:`Aliases` reuses."""
    suggestion = f"Did you mean {' or '.join(nearest)}? " if nearest else ""
    where = f"under {parent}" if parent else "at the top level"
    settings = (
        f"The settings {where} are {sorted(known)}; see docs/configuration.md or `python recipes/{recipe}.py --cfg "
        "job` for what each does."
    )
    return f"{key}: {recipe} has no such setting, so it would be ignored. {suggestion}{settings}", settings


# ------------------------------------------------------------------------------------------------ building


def _build(value: Any, expected: Any, key: str) -> Any:
    """``value`` (already checked against ``expected``) as its schema's dataclasses and Python types."""
    shape = _shape(expected)
    base, origin = shape.base, typing.get_origin(shape.base)
    if shape.variant is not None:
        return _build_node(value, shape.variant.schemas[value[shape.variant.key]], key)
    if shape.kind == "node":
        return _build_node(value, base, key)
    if shape.kind == "mapping":
        if value is None:
            return None
        return {name: _build(item, shape.item_type, _join(key, str(name))) for name, item in value.items()}
    if origin in (Union, types.UnionType):
        option = next(option for option in typing.get_args(base) if _has_type(value, option))
        return _build(value, option, key)
    if origin in (list, tuple):
        (item_type, *_) = typing.get_args(base) or (Any,)
        return [_build(item, item_type, f"{key}[{index}]") for index, item in enumerate(value)]
    return float(value) if base is float else value


def _build_node(values: Mapping, schema: type, key: str) -> Any:
    hints = _type_hints(schema)
    names = _field_names(schema)
    fields = {name: _build(values[name], hints[name], _join(key, name)) for name in names if name in values}
    entries = _entries_field(schema)
    if entries is not None:
        item_type = _shape(hints[entries]).item_type
        fields[entries] = {
            name: _build(value, item_type, _join(key, str(name))) for name, value in values.items() if name not in names
        }
    try:
        return schema(**fields)
    except ConfigError:
        raise
    except ValueError as error:  # the node's own rules (its __post_init__)
        raise ConfigError(_qualified(str(error), key, names)) from None


def _qualified(message: str, key: str, names: list[str]) -> str:
    """A node's message with its settings named in full: a node writes ``high=0.2`` (``name=`` or ``name.sub``);
    under ``loss.clip`` it reads ``loss.clip.high=0.2``. A message that names none of them starts with the node's key.

    Examples:
        >>> _qualified("sync=true needs coeff > 0: set coeff=0.1, or sync=false.", "loss", ["sync", "coeff"])
        'loss.sync=true needs coeff > 0: set loss.coeff=0.1, or loss.sync=false.'
        >>> _qualified("the two bounds cross.", "loss.clip", ["low", "high"])
        'loss.clip: the two bounds cross.'
    """
    if not key:
        return message
    mention = r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?==|\.\w)"
    qualified = re.sub(mention, lambda match: f"{key}.{match.group(1)}", message)
    return qualified if key in qualified else f"{key}: {qualified}"


# ------------------------------------------------------------------------------------------------ shared nodes


# Settings every recipe has, each with the reason its bounds hold.
NumThreads = Annotated[
    int | None, Range(ge=1), Hint("{key}={value} must be >= 1, or null for torch's default (every core).")
]
DType = Literal["float32", "bfloat16", "float16"]
# clip_grad_norm_ with a negative norm multiplies every gradient by a negative factor: training runs backwards.
MaxGradNorm = Annotated[
    float | None,
    Range(ge=0),
    Hint("{key}={value} must be >= 0 (the largest gradient norm kept), or null not to clip."),
]


@dataclass
class LoraNode:
    """``model.lora`` / ``reward_model.lora`` as the YAML writes it (``recipes.common.lora``)."""

    enabled: bool
    r: Annotated[
        int, Range(ge=1), Hint("{key}={value}: the adapters' rank must be an integer >= 1 (8 or 16 are usual).")
    ]
    alpha: Annotated[float, Range(gt=0), Hint("{key}={value}: expected a number > 0 (alpha / r scales the update).")]
    dropout: Annotated[float, Range(ge=0, lt=1), Hint("{key}={value}: expected a probability in [0, 1).")]
    target_modules: str | list[str]

    def __post_init__(self) -> None:
        if not (self.target_modules == "all-linear" or isinstance(self.target_modules, list) and self.target_modules):
            raise ValueError(
                f"target_modules={self.target_modules!r}: expected a non-empty list of module names (the last part of "
                "the names of the linear layers to adapt, e.g. [q_proj,v_proj] in Qwen or Llama models), or "
                "all-linear."
            )


@dataclass
class ModelNode:
    """A ``model=`` / ``reward_model=`` node (``conf/model``, ``conf/reward_model``)."""

    name_or_path: str
    tokenizer_name_or_path: str | None
    trust_remote_code: bool
    lora: LoraNode | None


@dataclass
class SyntheticData:
    source: Literal["synthetic"]
    num_train_prompts: Annotated[int, Range(ge=1)]
    num_eval_prompts: Annotated[int, Range(ge=0)]
    seed: int
    oracle: Any


@dataclass
class ArithmeticData:
    source: Literal["arithmetic"]
    num_train_prompts: Annotated[int, Range(ge=1)]
    num_eval_prompts: Annotated[int, Range(ge=0)]
    seed: int
    oracle: None


@dataclass
class CalculatorData:
    source: Literal["calculator"]
    num_train_prompts: Annotated[int, Range(ge=1)]
    num_eval_prompts: Annotated[int, Range(ge=0)]
    seed: int
    oracle: None


@dataclass
class FileData:
    source: Literal["file"]
    path: str
    eval_path: str | None
    prompt_column: str
    chosen_column: str
    rejected_column: str
    oracle: Any


@dataclass
class HFData:
    source: Literal["hf"]
    name_or_path: str
    split: str
    eval_split: str | None
    prompt_column: str
    chosen_column: str
    rejected_column: str
    oracle: Any


# data.source -> its node (conf/data/<source>.yaml).
DATA_SOURCES = {
    "synthetic": SyntheticData,
    "arithmetic": ArithmeticData,
    "calculator": CalculatorData,
    "file": FileData,
    "hf": HFData,
}
DataNode = Annotated[dict, Variant("source", DATA_SOURCES)]


@dataclass
class _NoLogger:
    kind: Literal["none", "csv"]


@dataclass
class _WandbSettings:
    project: str
    group: str | None
    name: str | None
    mode: Literal["online", "offline", "disabled"]


@dataclass
class WandbLogger:
    kind: Literal["wandb"]
    wandb: _WandbSettings


LoggerNode = Annotated[dict, Variant("kind", {"none": _NoLogger, "csv": _NoLogger, "wandb": WandbLogger})]


@dataclass
class ToolsNode:
    """``tools:`` of both GRPO recipes: the settings of every tool, then the user's entries, one per tool or tool
    source (``<name>: {function}``, ``<label>: {torchrl}``, ``<label>: {mcp}``), which ``recipes.common.tools``
    resolves and checks. The settings' ranges are the runner's (``interop.tools.ToolRunner.check_settings``, which
    ``recipes.common.tools`` calls naming the key); here, their types, kept as written (``timeout_s=10`` stays 10)."""

    timeout_s: int | float  # a call running longer is stopped, its worker killed
    max_result_tokens: int | None  # a longer result is cut to this many tokens; null: no cut
    entries: Annotated[dict[str, Any], ENTRIES]


@dataclass
class RewardFunctionNode:
    """``reward.functions.<name>`` of both GRPO recipes: a trl reward function and its weight in the step's reward
    (trl's ``reward_funcs`` and ``reward_weights``). Whether the function loads and takes what trl passes it is
    ``recipes.common.reward_functions.check_reward_functions``'s (it needs the data's columns)."""

    # A dotted path (trl.rewards.think_format_reward; my_rewards.exact_match for a my_rewards.py where the run starts),
    # or a _target_ node whose target returns the function (recipes.common.dotted_paths resolves either).
    function: Annotated[
        str | Annotated[dict[str, Any], OPEN],
        Hint(
            "{key}={value}: expected a function's dotted path (<module>.<function>, e.g. "
            "trl.rewards.think_format_reward) or a {{_target_: ...}} node whose target returns the function."
        ),
    ]
    # Kept as written (weight=0 is refused quoting 0). The one default not in the YAML: the entries are the user's,
    # and trl weighs a reward function 1.0 when reward_weights is unset.
    weight: Annotated[
        int | float,
        Hint("{key}={value}: expected a finite number, the function's weight in the step's reward (e.g. {key}=0.5)."),
    ] = 1.0


# reward.functions: the user's names -> their nodes; a value that is no such node is refused showing the node's form.
RewardFunctions = Annotated[
    dict[
        str,
        Annotated[
            RewardFunctionNode,
            Hint(
                "{key}: expected {{function: <dotted path or _target_ node>, weight: <number, default 1.0>}}, got "
                "{value}. Name the function, e.g. {key}.function=trl.rewards.think_format_reward."
            ),
        ],
    ],
    OPEN,
]


# ------------------------------------------------------------------------------------------------ trl's configs


def check_trainer_config_keys(train: Mapping, config_class: type, *, key: str = "train") -> None:
    """Refuses a ``train:`` key that the trl config class (``trl.RewardConfig``, ``trl.GRPOConfig``) does not have,
    naming the nearest ones, and the keys the recipe decides itself (``report_to``: the run's ``logger=``; ``use_cpu``:
    its ``device``)."""
    fields = {field.name for field in dataclasses.fields(config_class) if field.init}
    trl_name = f"trl.{config_class.__name__}"
    for name in train:
        if name == "_target_":
            continue
        if name == "report_to":
            raise ConfigError(
                f"{key}.report_to is set by the recipe (its metrics go through logger=): use logger=wandb (or csv, "
                f"none) and drop {key}.report_to."
            )
        if name == "use_cpu":
            raise ConfigError(f"{key}.use_cpu is set by the recipe from device=: use device=cpu or device=cuda.")
        if name not in fields:
            nearest = difflib.get_close_matches(str(name), sorted(fields), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(f'{key}.{n}' for n in nearest)}?" if nearest else ""
            raise ConfigError(
                f"{key}.{name}: {trl_name} has no such field, so it would be ignored or fail inside trl.{hint} "
                f"{key}: takes {trl_name}'s fields (trl's documentation lists them)."
            )


def trainer_config_view(train: Mapping, config_class: type) -> SimpleNamespace:
    """``train:`` as the trl config class will read it, without building it (a ``TrainingArguments`` sets up devices
    and processes when built): every field at trl's own default, the config's values on top, read by attribute.

    Examples:
        >>> from trl import GRPOConfig
        >>> args = trainer_config_view({"temperature": 0.7}, GRPOConfig)
        >>> args.temperature, args.top_p == GRPOConfig.__dataclass_fields__["top_p"].default
        (0.7, True)
    """
    values = {}
    for field in dataclasses.fields(config_class):
        if field.default is not dataclasses.MISSING:
            values[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            values[field.name] = field.default_factory()
    values.update({str(key): value for key, value in dict(train).items() if key != "_target_"})
    return SimpleNamespace(**values)


@dataclass
class TrainerNode:
    """The fields of trl's config (``train:``) that the recipes rely on, read over trl's own defaults
    (:func:`trainer_config_view`): out of range, each fails deep inside trl, or trains garbage. A recipe's own
    subclass adds the fields it refuses."""

    # Both recipes hand trl an IterableDataset (no length): trl's -1 ("from the epochs") cannot work.
    max_steps: Annotated[
        int,
        Range(ge=1),
        Hint(
            "{key}={value}: trl reads this recipe's data as a stream (an IterableDataset with no length), so the "
            "number of optimizer steps must be given: {key}=<positive int>, e.g. {key}=300."
        ),
    ]
    learning_rate: Annotated[float, Range(gt=0), Hint("{key}={value} must be a positive number (e.g. {key}=1e-4).")]
    max_grad_norm: MaxGradNorm
    per_device_train_batch_size: Annotated[int, Range(ge=1)]
    warmup_steps: Annotated[float, Range(ge=0)]
    push_to_hub: bool

    def __post_init__(self) -> None:
        # transformers 5: an int counts optimizer steps, a float below 1 is a fraction of them; 1.5 is neither.
        if isinstance(self.warmup_steps, float) and self.warmup_steps >= 1 and not self.warmup_steps.is_integer():
            raise ValueError(
                f"warmup_steps={self.warmup_steps:g}: transformers reads a number below 1 as a fraction of the "
                f"training steps and a whole number as steps. Write warmup_steps={math.ceil(self.warmup_steps)} "
                f"(steps) or a fraction below 1 (warmup_steps=0.1: the first tenth of max_steps)."
            )
        offline = [name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _env_flag(name)]
        if self.push_to_hub and offline:
            raise ValueError(
                f"push_to_hub=True, but {offline[0]} is set: the push at the end of training would fail after the "
                f"whole run. Drop push_to_hub (the model is saved in the run folder either way), or unset {offline[0]} "
                "on a machine that can reach the hub."
            )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def checked_trainer_config(
    train: Mapping, config_class: type, *, node: type = TrainerNode, key: str = "train"
) -> SimpleNamespace:
    """``train:`` as the trl config class will read it (:func:`trainer_config_view`), once its keys are the class's
    own (:func:`check_trainer_config_keys`) and the fields ``node`` types (:class:`TrainerNode`, or a recipe's
    subclass) fit it.

    Examples:
        >>> from trl import RewardConfig
        >>> checked_trainer_config({"max_steps": 10}, RewardConfig).learning_rate == RewardConfig.learning_rate
        True
        >>> checked_trainer_config({"learning_rate": 1e-3}, RewardConfig)
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: train.max_steps=-1: trl reads this recipe's data as a stream ...
    """
    check_trainer_config_keys(train, config_class, key=key)
    view = trainer_config_view(train, config_class)
    typed_config({name: getattr(view, name) for name in _field_names(node)}, node, key=key)
    return view


@dataclass
class WorkerResourcesNode:
    """What one Ray sampling worker takes (``rollout.worker_resources``, as
    ``interop.sampling.workers.WorkerResources``)."""

    # Numbers kept as written (num_gpus=1 stays 1): a refusal quotes the user's value; WorkerResources takes floats.
    num_cpus: Annotated[int | float, Range(ge=0)]
    num_gpus: Annotated[int | float, Range(ge=0)]
    # A custom resource name -> amount, e.g. {sampler: 1} for nodes started with --resources='{"sampler": 4}'.
    resources: Annotated[dict[str, Any], OPEN]


@dataclass
class RayNode:
    """``ray:``: the cluster ``rollout.backend=ray`` samples on (``recipes.common.rollout_backend``)."""

    address: str | None  # null: start a local cluster on this machine; auto: the one `ray start` runs here
    num_cpus: Annotated[int, Range(ge=1)] | None  # a local cluster's CPUs (null: all of this machine's)


def setting_type(expected: Any) -> str:
    """How a setting's schema type reads, in refusals and in ``docs/config_reference.md``: ``an integer >= 1``, ``one
    of ['sync', 'async']``, ``a number or null``."""
    return "any value" if expected is Any else _describe(expected)
