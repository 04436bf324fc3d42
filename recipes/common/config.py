"""Hydra glue shared by the recipes: the ``${project_root:...}`` resolver and config checks that run before any load."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

__all__ = ["PROJECT_ROOT", "ConfigError", "check_local_path", "register_resolvers", "run_config", "write_run_config"]

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


def run_config(cfg: DictConfig) -> DictConfig:
    """The run's own settings: the composed config without Hydra's ``hydra`` node."""
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def write_run_config(cfg: DictConfig, output_dir: Path) -> None:
    """Creates ``output_dir`` and writes ``resolved_config.yaml`` there: the run's settings, interpolations resolved
    (what ``scripts/sweep_report.py`` reads the ranking metric from)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(run_config(cfg), output_dir / "resolved_config.yaml", resolve=True)


register_resolvers()
