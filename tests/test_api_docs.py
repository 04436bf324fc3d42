"""The API reference (``scripts/build_api_docs.py``, pdoc): it builds, and every public name of ``interop`` is in it
with its docstring. CI builds it here, on every run."""

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build_api_docs  # noqa: E402

pytest.importorskip("pdoc")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    modules = build_api_docs.build(out)
    return out, modules


def _page(out: Path, module: str) -> str:
    parts = module.split(".")
    return (out.joinpath(*parts[:-1]) / f"{parts[-1]}.html").read_text()


def _public_members(module_name: str) -> list[tuple[str, object]]:
    """Classes and functions a module defines (not imports) and does not mark private; ``interop``'s own: its
    ``__all__``."""
    module = importlib.import_module(module_name)
    if module_name == "interop":
        return [(name, getattr(module, name)) for name in module.__all__]
    names = getattr(module, "__all__", None) or [name for name in vars(module) if not name.startswith("_")]
    return [
        (name, value)
        for name, value in ((name, getattr(module, name)) for name in names)
        if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == module_name
    ]


def test_every_public_module_has_a_page_and_every_public_name_an_entry(reference):
    out, modules = reference
    assert (out / "index.html").is_file()
    wings = {"interop.sampling", "interop.sampling.workers", "interop.tools", "interop.tools.runner", "interop.trl"}
    assert wings <= set(modules)
    assert not [module for module in modules if any(part.startswith("_") for part in module.split("."))]
    missing = []
    for module in modules:
        page = _page(out, module)
        for name, _ in _public_members(module):
            if f'id="{name}"' not in page:
                missing.append(f"{module}.{name}")
    assert not missing, f"not in the API reference: {missing}"


def test_the_reference_shows_the_docstrings(reference):
    out, _ = reference
    page = _page(out, "interop")
    # The first line of each public class's docstring is rendered on the package's page.
    for name in ("TorchRLBufferDataset", "HFRewardModelWrapper", "TorchRLRolloutFunc", "RolloutWorkers"):
        first_words = " ".join(inspect.getdoc(getattr(importlib.import_module("interop"), name)).split()[:4])
        text = re.sub(r"<[^>]+>", "", page)
        assert " ".join(first_words.replace("``", "").split()) in " ".join(text.split()), name


def test_every_public_class_function_and_method_has_a_docstring(reference):
    _, modules = reference
    undocumented = []
    for module in modules:
        for name, value in _public_members(module):
            if not inspect.getdoc(value):
                undocumented.append(f"{module}.{name}")
            if inspect.isclass(value):
                for attr, member in vars(value).items():
                    member = getattr(member, "__func__", member)  # classmethods and staticmethods
                    if attr.startswith("_") or not inspect.isfunction(member):
                        continue
                    # inspect.getdoc falls back on the overridden base method's docstring (TorchRL's Sampler API).
                    if not inspect.getdoc(getattr(value, attr)):
                        undocumented.append(f"{module}.{name}.{attr}")
    assert not undocumented, f"public, without a docstring: {undocumented}"
