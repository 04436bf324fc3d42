"""What the typed-settings tests of each recipe share (``tests/recipes/*/test_typed_settings.py``): an AST walk of a
recipe's files that finds every place a function takes the composed ``DictConfig`` (a parameter annotated so, or one
the test lists) and every use of the resolved config kept as the run's record (``run_record``), so that a test can
hold them to the places it lists, each with its reason."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where every recipe hands the resolved DictConfig kept beside its typed settings (``run_record``): the places where a
# DictConfig is the point. (``recipes.common.validation.validated_run`` builds the record, reads the paths a run reads
# from it and hands it to train() beside the settings: the recipes' rooms do none of that themselves.)
EVERY_RECIPES_RECORD_USES = {
    "start_run": "writes resolved_config.yaml and the logger's config, secrets masked (recipes.common.config)",
    "masked_fields": "the train: fields the record masks, so that trl's logs mask them too",
}


def every_recipes_raw_parameters(recipe: str, *, resumes: bool) -> dict[tuple[str, str, str], tuple[str, set[str]]]:
    """The places every recipe takes the composed DictConfig (in :func:`check_raw_config_reads`'s form): its
    ``train(composed)``, which turns it into the typed settings first thing; its ``main``, Hydra's entry point; its
    checks' ``validate`` and ``validated`` (which hands it to ``recipes.common.validation.validated_run``, with, in
    a recipe that ``resumes``, its ``resumed_config``: it merges a resumed run's ``resolved_config.yaml`` with the
    command line's config). A recipe that resumes returns from ``main`` the metric that run's own config names."""
    resumed = {".resume", "resumed_config"} if resumes else set()
    return {
        (f"{recipe}.py", "train", "composed"): (
            "Hydra's composed config: validated() turns it into the typed settings first thing",
            {"validated"},
        ),
        (f"{recipe}.py", "main", "cfg"): (
            "Hydra's entry point hands it to train(), which checks it; metric names the summary's figure a sweeper "
            "optimises (a resumed run's own, from its resolved_config.yaml)",
            {"run_recipe", ".metric", *resumed},
        ),
        ("checks.py", "validate", "cfg"): ("the config being checked", {"validated"}),
        ("checks.py", "validated", "cfg"): (
            "the config being checked (a resumed run's own settings restored first), then built",
            {"validated_run"},
        ),
    }


def recipe_files(recipe: str, room: str) -> list[Path]:
    """The recipe's script and the modules of its room (``recipes/<room>/``)."""
    return [ROOT / "recipes" / f"{recipe}.py", *sorted((ROOT / "recipes" / room).glob("*.py"))]


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, parents


def _annotation(arg: ast.arg) -> str:
    return ast.unparse(arg.annotation) if arg.annotation is not None else ""


def _uses(function, name: str, parents) -> set[str]:
    """How ``function``'s body reads ``name``: ``.attr`` for an attribute read, the callee for an argument (for
    ``functools.partial(f, name)``: ``f``, the function it will be handed to)."""
    uses = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents[node]
        if isinstance(parent, ast.keyword):
            parent = parents[parent]
        if isinstance(parent, ast.Attribute):
            uses.add(f".{parent.attr}")
        elif isinstance(parent, ast.Call) and node is not parent.func:
            callee = ast.unparse(parent.func).rsplit(".", 1)[-1]
            if callee == "partial" and parent.args and node is not parent.args[0]:
                callee = ast.unparse(parent.args[0]).rsplit(".", 1)[-1]
            uses.add(callee)
        else:
            uses.add(f"<{type(parent).__name__} at line {node.lineno}>")
    return uses


def check_raw_config_reads(
    path: Path,
    *,
    raw_parameters: Mapping[tuple[str, str, str], tuple[str, set[str]]],
    run_record_uses: Mapping[str, str],
    settings_class: str,
) -> None:
    """Fails naming the place where ``path`` reads the composed config beyond what the lists allow.

    Args:
        path: one file of the recipe.

    Keyword Args:
        raw_parameters: ``(file, function, parameter) -> (why, allowed uses)``: the parameters that are the composed
            ``DictConfig``, and what each may do with it (the callees named, the attributes named as ``".metric"``).
        run_record_uses: callee -> why: where the resolved config kept as the run's record (``run_record``) may go.
        settings_class: the typed settings' class, which every parameter named ``cfg`` elsewhere is annotated with.
    """
    found = {}
    for function, parents in _functions(path):
        for arg in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]:
            key = (path.name, function.name, arg.arg)
            annotation = _annotation(arg)
            if "DictConfig" in annotation or key in raw_parameters:
                assert key in raw_parameters, f"{key}: a DictConfig parameter; take the typed node instead"
                found[key] = _uses(function, arg.arg, parents)
            elif arg.arg == "cfg":
                assert annotation == settings_class, f"{key}: cfg is the typed settings here, annotated so"
        unexpected = _uses(function, "run_record", parents) - set(run_record_uses)
        assert not unexpected, f"{path.name}:{function.name} uses run_record as {unexpected}: read the typed settings"
    for key, uses in found.items():
        _, allowed = raw_parameters[key]
        assert uses <= allowed, f"{key}: reads {uses - allowed} of the composed config; read the typed settings"
    assert set(found) == {key for key in raw_parameters if key[0] == path.name}, "a listed place is gone"
    # No module of the recipe reads a config through OmegaConf itself.
    assert "OmegaConf" not in {node.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Name)}
