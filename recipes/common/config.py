"""Hydra glue shared by the recipes: the ``${project_root:...}`` resolver and config checks that run before any load."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

__all__ = ["PROJECT_ROOT", "ConfigError", "check_local_path", "register_resolvers"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A config value that cannot work; the message says which key, what was found and what to change."""


def register_resolvers() -> None:
    """Registers ``${project_root:relative/path}``, so the tiny kit resolves wherever the repository is cloned."""
    if not OmegaConf.has_resolver("project_root"):
        OmegaConf.register_new_resolver("project_root", lambda relative="": str(PROJECT_ROOT / relative))


def check_local_path(value: str, *, key: str, what: str) -> None:
    """Fails early when ``value`` looks like a local path (absolute or ./relative) that does not exist.

    Hub ids (``org/name``) pass through: they are resolved by ``from_pretrained`` itself.
    """
    looks_local = value.startswith(("/", "./", "../", "~")) or Path(value).exists()
    if looks_local and not Path(value).expanduser().exists():
        raise ConfigError(
            f"{key}={value!r}: no such {what} folder. Pass an existing local folder or a hub id; for the built-in "
            f"tiny models run `python scripts/build_tiny_models.py` (they ship in tiny/)."
        )


register_resolvers()
