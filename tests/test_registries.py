"""The places things are added (issue 41): loss types (``recipes.grpo.loss.LOSS_RULES``), rollout backends
(``recipes.common.rollout_backend.ROLLOUT_BACKENDS``), the GRPO recipe's rollouts
(``recipes.grpo.rollout_envs.ROLLOUT_ENVS``) and kinds of tools: entries (``recipes.common.tools.TOOL_KINDS``). Every
registered entry is a choice of the schema, is documented where a user looks (the docs page and the YAML comment of
its key) and says what it is; a name in the docs or the schema that no entry backs fails too."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _comment_above(config: str, key_path: str) -> str:
    """The comment lines right above ``key_path`` (dotted, e.g. ``loss.type``) in ``conf/<config>.yaml``."""
    lines = (ROOT / "conf" / f"{config}.yaml").read_text().splitlines()
    *parents, leaf = key_path.split(".")
    index, indent = 0, ""
    for parent in parents:
        index = next(i for i in range(index, len(lines)) if lines[i] == f"{indent}{parent}:")
        indent += "  "
    index = next(i for i in range(index, len(lines)) if lines[i].startswith(f"{indent}{leaf}:"))
    comment = []
    for line in reversed(lines[:index]):
        if not line.strip().startswith("#"):
            break
        comment.append(line)
    return "\n".join(reversed(comment))


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def _documented(entries: dict, text: str, where: str) -> list[str]:
    return [f"{name} not named in {where}" for name in entries if not _named(name, text)]


def test_every_loss_type_is_the_schemas_documented_and_described():
    from recipes.grpo import schema
    from recipes.grpo.loss import LOSS_RULES, LOSS_TYPES

    assert LOSS_TYPES == typing.get_args(schema.LossType)  # adding a row without its schema choice fails here
    comment = _comment_above("grpo_torchrl_rm", "loss.type")
    (row,) = [line for line in (ROOT / "docs" / "grpo.md").read_text().splitlines() if "| `loss.type` |" in line]
    missing = _documented(LOSS_RULES, comment, "the loss.type comment") + _documented(LOSS_RULES, row, "docs/grpo.md")
    assert not missing
    # The docs list no type that the table lacks.
    assert set(re.findall(r"`(\w+)`", row.split("|")[1])) - {"loss_type"} == set(LOSS_RULES)
    for name, rule in LOSS_RULES.items():
        assert rule.summary and rule.policy_loss.__doc__, f"loss.type={name} is not described"


@pytest.mark.parametrize("recipe", ["grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"])
def test_every_rollout_backend_is_the_schemas_documented_and_described(recipe):
    from interop.sampling import workers as rollout_workers
    from recipes.common.rollout_backend import ROLLOUT_BACKENDS
    from recipes.grpo import collector_workers
    from recipes.grpo import schema as grpo_schema
    from recipes.trl_grpo import schema as trl_schema

    schema = grpo_schema if recipe == "grpo_torchrl_rm" else trl_schema
    literal, none = typing.get_args(typing.get_type_hints(schema.Rollout)["backend"])  # Literal[...] | None
    assert none is type(None) and typing.get_args(literal) == tuple(ROLLOUT_BACKENDS)
    apart = {name for name, backend in ROLLOUT_BACKENDS.items() if backend.apart_from_learner}
    assert apart == set(rollout_workers.BACKENDS) == set(collector_workers.BACKENDS)
    comment = _comment_above(recipe, "rollout.backend")
    docs = (ROOT / "docs" / "configuration.md").read_text()
    (listed,) = re.findall(r"`rollout\.backend=([\w|]+)`", docs)
    assert set(listed.split("|")) == set(ROLLOUT_BACKENDS)
    assert not _documented(ROLLOUT_BACKENDS, comment, f"{recipe}'s rollout.backend comment")
    for name, backend in ROLLOUT_BACKENDS.items():
        assert backend.summary, f"rollout.backend={name} is not described"


def test_every_kind_of_tool_entry_is_documented_and_described():
    from recipes.common.tools import TOOL_KINDS

    docs = (ROOT / "docs" / "tools.md").read_text()
    table = set(re.findall(r"^\| `tools\.<\w+>\.(\w+)", docs, flags=re.MULTILINE))
    assert table == set(TOOL_KINDS)  # docs/tools.md's table of keys has a row per kind, and none the code lacks
    for name, kind in TOOL_KINDS.items():
        assert kind.summary and kind.node and kind.build.__doc__, f"tools.<name>.{name} is not described"


def test_every_rollout_env_is_the_schemas_documented_and_described():
    from recipes.grpo import schema
    from recipes.grpo.rollout_envs import ROLLOUT_ENVS

    assert typing.get_args(typing.get_type_hints(schema.Rollout)["env"]) == tuple(ROLLOUT_ENVS)
    docs = (ROOT / "docs" / "configuration.md").read_text()
    (listed,) = re.findall(r"`rollout\.env=([\w|]+)`", docs)
    assert set(listed.split("|")) == set(ROLLOUT_ENVS)
    assert not _documented(ROLLOUT_ENVS, _comment_above("grpo_torchrl_rm", "rollout.env"), "the rollout.env comment")
    for name, env in ROLLOUT_ENVS.items():
        assert env.summary, f"rollout.env={name} is not described"
