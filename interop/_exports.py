"""How ``interop`` hands out its names: lazy exports (PEP 562) for the package and its wings, and the module paths
that moved when the library was split into wings (``interop.sampling``, ``interop.tools``, ``interop.trl``).

A package's public names are imported from their module when first read, so that importing a light module of a wing
(a tool worker's ``interop.tools.runner``, a sampler child's ``interop.sampling._child``) costs no torch, torchrl or
trl import: Python runs every parent package's ``__init__`` first.

A moved path (``interop.rollout_func``...) is no file: ``interop`` adds a finder that answers for these names only
(first, so that an editable install of another checkout cannot answer with its old file), and importing the old path
warns (``DeprecationWarning``, naming the new path) and gives the new module itself, so every name read from it is the
new module's own object. No file at the old path keeps git's rename detection (and merges of edits made to the old
file) working.

Dependencies: the standard library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "lazy_exports"]

# Each module path the wings replaced -> the module that now holds its code.
MOVED_MODULES = {
    "interop.background_sampler": "interop.sampling.background",
    "interop.dialog_policy": "interop.tools.dialog_policy",
    "interop.dialogs": "interop.tools.dialogs",
    "interop.group_replay": "interop.trl.group_replay",
    "interop.importance_sampling": "interop.trl.importance_sampling",
    "interop.mcp_tools": "interop.tools.mcp_tools",
    "interop.rollout_func": "interop.trl.rollout_func",
    "interop.rollout_workers": "interop.sampling.workers",
    "interop.torchrl_tools": "interop.tools.torchrl_tools",
    "interop.trl_grpo": "interop.trl.trainer",
}


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``exports`` maps each public name to the module defining it; the
    value read is that module's own object (not a copy), kept in the package once read."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports each path of ``moved`` as the module it moved to (the same module object), with a
    ``DeprecationWarning`` naming the new path. It answers for those names only."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module; exec_module swaps the new one in

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        new = self.moved[old]
        warnings.warn(
            f"{old} moved to {new}: import from {new} (the old path gives the same module and will be removed).",
            DeprecationWarning,
            stacklevel=2,  # warnings skips importlib's frames: the line that imported the old path
        )
        # The import system returns what sys.modules holds once this returns: the new module itself.
        sys.modules[old] = importlib.import_module(new)
