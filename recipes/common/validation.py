"""What every recipe's ``validated()`` does with Hydra's composed config, in one place: a resumed run's own settings
restored, the config checked and built into the recipe's typed settings (``recipes.common.schema.checked_tree``), the
recipe's own checks run on them, and the resolved config kept beside them as the run's record.

- :class:`ValidatedRun`: the typed settings the run reads, and the record (``resolved_config.yaml`` and the logger's
  config, secrets masked: ``recipes.common.run.start_run``; what a resume compares with the run it continues).
- :func:`validated_run`: builds one, given the recipe's schema and checks.

Dependencies: omegaconf, and ``recipes.common``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

from omegaconf import DictConfig

from recipes.common.run_folder import input_paths
from recipes.common.schema import Aliases, checked_tree

__all__ = ["ValidatedRun", "validated_run"]

SettingsT = TypeVar("SettingsT")


class ValidatedRun(NamedTuple, Generic[SettingsT]):
    """A config that passed every check: the typed settings the run reads, and the resolved config they were built
    from, which stays the run's record only (``resolved_config.yaml`` and the logger's config, secrets masked:
    ``recipes.common.run.start_run``; the masked ``train:`` fields: ``recipes.common.config.masked_fields``; what a
    resume changes)."""

    settings: SettingsT
    run_record: DictConfig


def validated_run(
    cfg: DictConfig,
    schema: type[SettingsT],
    *,
    recipe: str,
    check: Callable[..., None],
    renamed: Mapping[str, str] = {},
    aliases: Aliases | None = None,
    resumed_config: Callable[[DictConfig], DictConfig] | None = None,
    resume_changes: Callable[[DictConfig], dict[str, Any]] | None = None,
) -> ValidatedRun[SettingsT]:
    """``cfg`` checked against ``schema`` and built (``checked_tree``), then ``check(settings, inputs=...)`` (the
    recipe's checks across nodes, files and the machine; ``inputs``: the paths the run reads, by setting).

    Keyword Args:
        recipe, renamed, aliases: as ``checked_tree`` takes them.
        resumed_config: for a recipe that resumes: with ``resume=true``, the run's own settings under the command
            line's (what is checked is then the run being continued).
        resume_changes: for a recipe that resumes: what a resume changes, from the run's record; ``check`` then gets
            ``changes``, a function that computes them (only a resume calls it).
    """
    if resumed_config is not None and cfg.resume:
        cfg = resumed_config(cfg)
    run_record, settings = checked_tree(cfg, schema, recipe=recipe, renamed=renamed, aliases=aliases)
    # input_paths reads every recipe's optional path keys with OmegaConf.select: the record holds them all.
    inputs = input_paths(run_record)
    if resume_changes is None:
        check(settings, inputs=inputs)
    else:
        # A resume compares the run's records: both sides as resolved_config.yaml holds them (secrets masked).
        check(settings, inputs=inputs, changes=functools.partial(resume_changes, run_record))
    return ValidatedRun(settings, run_record)
