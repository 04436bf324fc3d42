"""Render the API reference of ``interop`` (the library) from its docstrings, with pdoc.

    python scripts/build_api_docs.py              # writes site/api/index.html and one page per public module
    python scripts/build_api_docs.py --out /tmp/api

Documented: the package ``interop`` (every name of its ``__all__``), its wings (``interop.sampling``,
``interop.tools``, ``interop.trl``) and each public module in them (those whose name does not start with ``_``; the
underscored ones are process entry points, not API). The docstrings are reStructuredText
(``:class:`...```). ``tests/test_api_docs.py`` builds it and checks that every public name has its entry, so CI builds
it on every run. pdoc is in the ``dev`` extra.
"""

from __future__ import annotations

import argparse
import pkgutil
import warnings
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "site" / "api"


def public_modules() -> list[str]:
    """``interop``, its wings (``interop.sampling``, ``interop.tools``, ``interop.trl``) and their public modules, in
    the order the reference lists them."""
    import interop

    found = pkgutil.walk_packages(interop.__path__, prefix="interop.")
    submodules = sorted(info.name for info in found if not any(part.startswith("_") for part in info.name.split(".")))
    return ["interop", *submodules]


def build(out: Path) -> list[str]:
    """Writes the reference under ``out`` (``index.html``, ``interop.html``, ``interop/<module>.html``); returns the
    modules documented."""
    import pdoc
    import pdoc.render

    modules = public_modules()
    pdoc.render.configure(docformat="restructuredtext", search=True)
    with warnings.catch_warnings():
        # Annotations that TorchRL's base classes leave unresolvable (e.g. Transform.collector's ``BaseCollector``)
        # are TorchRL's, shown as written; they are not ours to fix.
        warnings.filterwarnings("ignore", message="Error parsing type annotation", category=UserWarning)
        pdoc.pdoc(*modules, output_directory=out)
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write the HTML into")
    args = parser.parse_args()
    modules = build(args.out)
    print(f"API reference of {len(modules)} modules written to {args.out / 'index.html'}")


if __name__ == "__main__":
    main()
