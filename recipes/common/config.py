"""Hydra glue shared by the recipes: the ``${project_root:...}``, ``${if_set:...}`` and ``${trl_default:...}``
resolvers, and config checks that run before any load."""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "PROJECT_ROOT",
    "ConfigError",
    "RunStopped",
    "check_local_path",
    "check_run_settings",
    "command_line_keys",
    "config_record",
    "first_items",
    "hand_token_to_environment",
    "hub_reachable",
    "is_secret_key",
    "is_secret_setting",
    "MASKED_URL_PASSWORD",
    "mask_hydra_record",
    "mask_hydra_record_file",
    "mask_hydra_records",
    "hydra_records",
    "write_hydra_records",
    "mask_override",
    "mask_overrides_in_text",
    "mask_secrets_in_text",
    "mask_sweep_record",
    "mask_url_passwords",
    "masked_fields",
    "register_resolvers",
    "resolved",
    "run_config",
    "setting_message",
    "tensordict_key",
    "trl_default",
    "write_run_config",
]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A config value that cannot work; the message says which key, what was found and what to change."""


class RunStopped(RuntimeError):
    """A run stopped for a reason its message says in full, with what to do (a full disk, a non-finite loss): the
    run's log shows the message alone, as for a :class:`ConfigError`."""


def setting_message(error, key: str) -> str:
    """A library refusal (``interop.errors.SettingError``) under the config key its value came from: ``<key>.<detail>``
    where it names its field (its detail starts with the field), else ``<key>: <detail>``; the text is the library's.

    Examples:
        >>> from interop.errors import SettingError
        >>> error = SettingError("SamplingSettings", "top_p=2 must be in (0, 1].", field="top_p")
        >>> setting_message(error, "rollout.generation")
        'rollout.generation.top_p=2 must be in (0, 1].'
        >>> setting_message(SettingError("ToolSet", "two tools are named 'add'."), "tools")
        "tools: two tools are named 'add'."
    """
    return f"{key}.{error.detail}" if error.field is not None else f"{key}: {error.detail}"


def first_items(items: list, count: int = 10) -> str:
    """The first ``count`` of ``items`` for an error message, with ``...`` when there are more.

    Examples:
        >>> first_items([3, 7, 9], count=2)
        '[3, 7]...'
    """
    return f"{items[:count]}{'...' if len(items) > count else ''}"


def tensordict_key(node) -> str | tuple[str, ...]:
    """A TensorDict key from a config value: a nested key (tuple) from a list, such as ``[text, full]``, a plain key
    from a string.

    Examples:
        >>> tensordict_key(["text", "full"]), tensordict_key("reward")
        (('text', 'full'), 'reward')
    """
    return tuple(str(part) for part in node) if isinstance(node, (list, tuple, ListConfig)) else str(node)


def trl_default(name: str):
    """The default of ``trl.GRPOConfig``'s field ``name``, as the installed trl declares it (an enum as its value):
    what ``${trl_default:<field>}`` reads, so that a preset of trl's defaults (``conf/experiment/trl_defaults.yaml``)
    follows trl rather than a copy of it. trl is imported on first use.

    Examples:
        >>> trl_default("loss_type"), trl_default("epsilon_high")
        ('dapo', None)
    """
    import dataclasses
    import enum

    from trl import GRPOConfig

    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    if name not in fields:
        raise ConfigError(
            f"${{trl_default:{name}}}: trl.GRPOConfig (trl {__import__('trl').__version__}) has no field {name!r}; "
            "name one of its fields (trl's documentation lists them)."
        )
    field = fields[name]
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    return value.value if isinstance(value, enum.Enum) else value


def register_resolvers() -> None:
    """Registers ``${project_root:relative/path}``, so the tiny kit resolves wherever the repository is cloned,
    ``${if_set:value,then,otherwise}`` and ``${trl_default:field}`` (:func:`trl_default`)."""
    if not OmegaConf.has_resolver("project_root"):
        OmegaConf.register_new_resolver("project_root", lambda relative="": str(PROJECT_ROOT / relative))
    if not OmegaConf.has_resolver("if_set"):
        # ${if_set:${a.b},x,y}: x when a.b is set (not null), else y; e.g. a metric that needs the data's oracle.
        OmegaConf.register_new_resolver(
            "if_set", lambda value, then, otherwise: then if value is not None else otherwise
        )
    if not OmegaConf.has_resolver("trl_default"):
        OmegaConf.register_new_resolver("trl_default", trl_default)


def _offline() -> bool:
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_local_path(value: str, *, key: str, what: str) -> None:
    """Fails early when ``value`` names a local folder that does not exist, or a hub id that cannot be reached.

    A local path is one that exists, starts with ``/``, ``./``, ``../`` or ``~``, or has more than one ``/`` (a hub id
    is ``name`` or ``org/name``): a missing one fails at once, rather than being tried on the hub. A hub id passes
    through to ``from_pretrained``, except offline (``HF_HUB_OFFLINE=1``), where it must be in the local cache.
    """
    path = Path(value).expanduser()
    looks_local = value.startswith(("/", "./", "../", "~")) or value.count("/") > 1 or path.exists()
    if looks_local and not path.exists():
        raise ConfigError(
            f"{key}={value!r}: no such {what} folder. Pass an existing local folder or a hub id (org/name); for the "
            "built-in tiny models run `python scripts/build_tiny_models.py` (they ship in tiny/)."
        )
    if looks_local:
        return
    cached = isinstance(try_to_load_from_cache(value, "config.json"), str)
    if not cached and _offline():
        raise ConfigError(
            f"{key}={value!r}: not a local folder, and not in the Hugging Face cache while offline "
            "(HF_HUB_OFFLINE=1). Download it where the hub is reachable, or pass a local folder."
        )
    if not cached and not hub_reachable():
        # from_pretrained would retry for about a minute, then fail with a raw OSError.
        raise ConfigError(
            f"{key}={value!r}: not a local folder, not in the Hugging Face cache, and the hub "
            f"({_HUB_HOST}) cannot be reached from here. Pass a local folder, or download it where the hub is "
            "reachable; offline, set HF_HUB_OFFLINE=1 so that cached models load without trying the network."
        )


_HUB_HOST = "huggingface.co"


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout_s`` (asked once per process)."""
    import socket

    endpoint = os.environ.get("HF_ENDPOINT", f"https://{_HUB_HOST}")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    try:
        with socket.create_connection((host, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_run_settings(cfg: DictConfig) -> None:
    """The rules between the settings every recipe has, checked before anything loads: a device this machine has, and
    a dtype that works on it. Each of these fails deep inside torch (or, worse, does not fail) when wrong; the ranges
    of single settings (threads, learning rate, clipping, batch size) are the schema's (``recipes.common.schema``).

    Args:
        cfg: the recipe config (``device`` and ``dtype`` at its root).
    """
    device = str(cfg.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device=cpu.")
    if cfg.dtype == "float16" and device == "cpu":
        raise ConfigError(
            "dtype=float16 on the CPU: half precision overflows and runs slowly there; use dtype=float32 (or "
            "bfloat16, on a CPU that supports it)."
        )


def command_line_keys() -> dict[str, str]:
    """The settings this run's command line changed, as ``{key: "change" | "add" | "delete"}`` (Hydra's own
    ``hydra.*`` ones left out); empty outside a Hydra run (a config built by hand)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return {}
    # Unresolved: an override's value may be an interpolation (labeler.score=${data.oracle}), which read through the
    # config would become the node it points to, not an override Hydra can parse again.
    task = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
    overrides = OverridesParser.create().parse_overrides(list(task))
    kinds = {}
    for override in overrides:
        if override.key_or_group == "hydra" or override.key_or_group.startswith("hydra."):
            continue
        kinds[override.key_or_group] = "delete" if override.is_delete() else "add" if override.is_add() else "change"
    return kinds


def run_config(cfg: DictConfig) -> DictConfig:
    """The run's own settings: the composed config without Hydra's ``hydra`` node."""
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def resolved(cfg: DictConfig) -> DictConfig:
    """The run's settings (:func:`run_config`) with every interpolation resolved, once: whoever reads the config
    later (the logged config, a background process) sees the same values. Struct mode stays on (a key read that the
    config lacks raises). The settings that came from the environment (``${oc.env:...}``) are remembered, so that
    what the run records shows the interpolation, never the value (:func:`config_record`)."""
    own = run_config(cfg)  # one masked copy (it copies every node: 0.02-0.05 s), read twice
    settled = OmegaConf.create(OmegaConf.to_container(own, resolve=True))
    OmegaConf.set_struct(settled, True)
    from_environment = {**_from_environment(own), **getattr(cfg, "__dict__", {}).get(_FROM_ENV, {})}
    object.__setattr__(settled, _FROM_ENV, from_environment)
    return settled


# Where a resolved config keeps the text of the settings it read from the environment: path -> "${oc.env:NAME}".
_FROM_ENV = "_from_environment"
# Leaf names whose values are secrets: transformers masks every TrainingArguments field ending in "_token" (hub_token);
# the rest are the usual names of keys and passwords.
_SECRET_SUFFIXES = (
    "_token",
    "_api_key",
    "_apikey",
    "_secret",
    "_password",
    "_passwd",
    "_pass",
    "_pwd",
    "_passphrase",
    "_access_key",
    "_secret_key",
    "_private_key",
    "_credentials",
)
_SECRET_NAMES = (
    "token",
    "key",
    "api_key",
    "apikey",
    "secret",
    "password",
    "passwd",
    "pass",
    "pwd",
    "passphrase",
    "access_key",
    "secret_key",
    "private_key",
    "credentials",
)
# A misspelt secret name (hub_tokn, api_secert) is refused by the schema, but Hydra has written it to the run folder
# by then: a name whose last word is one typo from one of these is masked too. "tokens" is a count (max_new_tokens).
_SECRET_WORDS = ("token", "secret", "password", "passwd", "passphrase", "credentials", "apikey")
_NOT_SECRET_WORDS = ("tokens",)
# A tokenizer's special tokens are words of its vocabulary, not credentials: trl's RewardConfig takes eos_token (a
# masked one would also be refused on resume as a secret to give again).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def _one_typo_apart(word: str, target: str) -> bool:
    """Whether ``word`` is ``target``, or becomes it by one insertion, deletion, substitution or swap of adjacent
    letters."""
    if word == target:
        return True
    if len(word) == len(target):
        differ = [index for index, (a, b) in enumerate(zip(word, target)) if a != b]
        swapped = (
            len(differ) == 2
            and differ[1] == differ[0] + 1
            and word[differ[0] : differ[1] + 1] == (target[differ[1]] + target[differ[0]])
        )
        return len(differ) == 1 or swapped
    shorter, longer = sorted((word, target), key=len)
    if len(longer) - len(shorter) != 1:
        return False
    return any(longer[:index] + longer[index + 1 :] == shorter for index in range(len(longer)))


def is_secret_key(name: str) -> bool:
    """Whether a setting named ``name`` holds a secret (``hub_token``, ``api_key``, ``password``, ``key``...), a
    misspelling of one (``hub_tokn``) included.

    Examples:
        >>> is_secret_key("hub_token"), is_secret_key("max_new_tokens"), is_secret_key("WANDB_API_KEY")
        (True, False, True)
        >>> is_secret_key("hub_tokn"), is_secret_key("accessToken"), is_secret_key("reward_key")
        (True, True, False)
    """
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower().replace("-", "_")
    if snake in _SPECIAL_TOKENS:
        return False
    if snake in _SECRET_NAMES or snake.endswith(_SECRET_SUFFIXES):
        return True
    last_word = re.split(r"[^a-z0-9]+", snake.strip("_"))[-1]
    return last_word not in _NOT_SECRET_WORDS and any(_one_typo_apart(last_word, word) for word in _SECRET_WORDS)


# Settings whose values are secrets whatever their names: an MCP server's environment (its API keys and URLs with
# passwords, under names of the server's choosing).
_SECRET_PATHS = (re.compile(r"tools\.[^.]+\.mcp\.servers\.[^.]+\.env\.[^.]+"),)


def is_secret_setting(path: str) -> bool:
    """Whether the setting at dotted ``path`` holds a secret: its name says so (:func:`is_secret_key`), or it is a
    value of an MCP server's ``env`` (``tools.<label>.mcp.servers.<server>.env.<NAME>``).

    Examples:
        >>> is_secret_setting("train.hub_token"), is_secret_setting("tools.calc.mcp.servers.calc.env.DB_URL")
        (True, True)
        >>> is_secret_setting("tools.calc.mcp.servers.calc.command")
        False
    """
    path = path.lstrip("+~")
    return is_secret_key(path.rsplit(".", 1)[-1]) or any(pattern.fullmatch(path) for pattern in _SECRET_PATHS)


# The password of a URL's userinfo (scheme://user:password@host), whatever the setting holding the URL is named.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<password>[^/\s@]+)(?=@)")
MASKED_URL_PASSWORD = "<PASSWORD>"


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:password@host``) shown as ``<PASSWORD>``; an
    interpolation in its place (``${oc.env:DB_PASSWORD}``) is kept.

    Examples:
        >>> mask_url_passwords("pg://me:pw-31@db/x and https://host/a:b@c")
        'pg://me:<PASSWORD>@db/x and https://host/a:b@c'
    """

    def replace(match: re.Match) -> str:
        if match.group("password").startswith("${"):
            return match.group(0)
        return match.group("head") + MASKED_URL_PASSWORD

    return _URL_PASSWORD.sub(replace, text)


def _masked(record, path: str = "", kept: Mapping[str, str] | None = None):
    """``record`` (plain dicts and lists) with every secret (:func:`is_secret_setting`) shown as ``<NAME>``, every
    override written in a text (:func:`mask_overrides_in_text`) masked and every URL's password shown as
    ``<PASSWORD>``, except the ``kept`` paths (read from the environment), shown as their text, and
    interpolations (``${...}``), kept. A boolean is never a secret (``use_auth_token: true``)."""
    kept = kept or {}
    if isinstance(record, dict):
        return {key: _masked(value, f"{path}.{key}" if path else str(key), kept) for key, value in record.items()}
    if isinstance(record, list):
        return [_masked(value, f"{path}.{index}", kept) for index, value in enumerate(record)]
    if path in kept:
        return kept[path]
    if isinstance(record, str) and record.startswith("${"):
        return record
    if record not in (None, "") and not isinstance(record, bool) and is_secret_setting(path):
        return f"<{path.rsplit('.', 1)[-1].lstrip('+~').upper()}>"
    if not isinstance(record, str):
        return record
    # A setting made of overrides (a wandb run name of ${hydra:job.override_dirname}) holds their secrets too.
    return mask_overrides_in_text(record) if "=" in record else mask_url_passwords(record)


def _from_environment(cfg: DictConfig, prefix: str = "") -> dict[str, str]:
    """Every setting of ``cfg`` that is (or contains) an ``${oc.env:...}`` interpolation: its path and its text."""
    found = {}
    keys = list(cfg.keys()) if isinstance(cfg, DictConfig) else range(len(cfg))
    for key in keys:
        node = cfg._get_node(key)
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(node, (DictConfig, ListConfig)):
            found.update(_from_environment(node, path))
        elif node._is_interpolation() and "oc.env" in str(node._value()):
            found[path] = str(node._value())
    return found


def config_record(cfg: DictConfig) -> dict:
    """The run's settings as the run records them (``resolved_config.yaml``, the wandb run config): resolved, except
    that every setting read from the environment keeps its ``${oc.env:...}`` text and every other secret (a key named
    like ``hub_token``, ``api_key``, ``password``) shows as ``<HUB_TOKEN>``, as transformers shows it.

    Examples:
        >>> cfg = resolved(OmegaConf.create({"train": {"hub_token": "hf_abc", "lr": 0.1}}))
        >>> config_record(cfg)
        {'train': {'hub_token': '<HUB_TOKEN>', 'lr': 0.1}}
    """
    record = OmegaConf.to_container(run_config(cfg), resolve=True)
    return _masked(record, kept=getattr(cfg, "__dict__", {}).get(_FROM_ENV, {}))


def masked_fields(cfg: DictConfig, node: str) -> dict[str, str]:
    """The settings of ``cfg[node]`` (a trainer config such as ``train:``) that its record masks
    (:func:`config_record`), with what the record shows instead: ``field -> "${oc.env:NAME}"`` or ``"<FIELD>"``."""
    record = config_record(cfg).get(node) or {}
    values = OmegaConf.to_container(cfg[node], resolve=True) if node in cfg else {}
    return {str(key): shown for key, shown in record.items() if key in values and shown != values[key]}


def hand_token_to_environment(args) -> None:
    """Moves a trl / transformers config's ``hub_token`` to ``HF_TOKEN`` in this process's environment (where
    ``huggingface_hub`` reads it, for pushes too): the trainer pickles its whole config into every checkpoint
    (``training_args.bin``), which would otherwise keep the token in clear in the run folder."""
    token = getattr(args, "hub_token", None)
    if token:
        os.environ["HF_TOKEN"] = token
        args.hub_token = None


def write_run_config(cfg: DictConfig, output_dir: Path) -> None:
    """Creates ``output_dir`` and writes ``resolved_config.yaml`` there: the run's settings, interpolations resolved
    (what ``scripts/sweep_report.py`` reads the ranking metric from), secrets masked (:func:`config_record`). Hydra's
    own copies of the config in ``output_dir/.hydra/`` are masked the same way (:func:`mask_hydra_records`)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = config_record(cfg)
    if "resume_allow_changes" in record:  # one resume's permission, not a setting of the run
        record["resume_allow_changes"] = []
    OmegaConf.save(OmegaConf.create(record), output_dir / "resolved_config.yaml")
    mask_hydra_records(output_dir)


def hydra_records(cfg: DictConfig) -> dict[str, str]:
    """The records Hydra keeps of a run in ``<run>/.hydra/`` (``config.yaml``: the composed config ``cfg``,
    ``hydra.yaml``, ``overrides.yaml``), as text with every secret masked (:func:`mask_hydra_record`); empty outside a
    Hydra run. The recipes' configs set ``hydra.output_subdir: null``, so that Hydra writes none of them at start: a
    run refused because its folder is another run's (in use, or holding an earlier run) would otherwise have replaced
    that run's records before the refusal. :func:`write_hydra_records` writes them once the run holds its folder."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.instance().cfg
    records = {"config.yaml": cfg, "hydra.yaml": hydra_cfg, "overrides.yaml": hydra_cfg.hydra.overrides.task}
    return {
        name: OmegaConf.to_yaml(OmegaConf.create(mask_hydra_record(OmegaConf.to_container(record, resolve=False))))
        for name, record in records.items()
    }


def write_hydra_records(output_dir: Path, records: dict[str, str]) -> None:
    """Writes :func:`hydra_records` to ``output_dir/.hydra/``, each file whole or not at all."""
    folder = output_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in records.items():
        partial = folder / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, folder / name)


def mask_hydra_records(output_dir: Path) -> None:
    """Hydra writes the composed config and the command line's overrides to ``<run>/.hydra/`` as typed: each secret
    there (:func:`is_secret_setting`, a URL's password) is masked (:func:`mask_hydra_record_file`)."""
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        mask_hydra_record_file(output_dir / ".hydra" / name)


def mask_sweep_record() -> None:
    """In a Hydra multirun, masks the sweep folder's ``multirun.yaml`` (the composed config, the command line's
    overrides and ``override_dirname``), which Hydra writes before any job starts; each job of the sweep calls it, so
    whatever launcher runs the jobs, the first to start masks it. Nothing outside a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        mask_hydra_record_file(Path(str(HydraConfig.get().sweep.dir)) / "multirun.yaml")


def mask_hydra_record_file(path: Path) -> None:
    """Rewrites one of Hydra's records (``config.yaml``, ``hydra.yaml``, ``overrides.yaml``, ``multirun.yaml``) with
    every secret masked, when it holds one (:func:`mask_hydra_record`); a missing file is left missing."""
    if not path.is_file():
        return
    text = path.read_text()
    try:
        record = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except Exception:  # not YAML OmegaConf reads: masked line by line
        masked_text = mask_url_passwords(mask_secrets_in_text(text))
    else:
        masked = mask_hydra_record(record)
        masked_text = text if masked == record else OmegaConf.to_yaml(OmegaConf.create(masked))
    if masked_text != text:
        # A name of its own: the jobs of a sweep in parallel processes mask the sweep's multirun.yaml together.
        handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        with os.fdopen(handle, "w") as written:
            written.write(masked_text)
        os.chmod(partial, path.stat().st_mode & 0o777)  # mkstemp's file is private; the record keeps Hydra's mode
        os.replace(partial, path)


def mask_hydra_record(record: dict | list) -> dict | list:
    """One of Hydra's records, read as plain data, with every secret masked: the config's settings by name and path
    (:func:`config_record`'s rules), each override of ``hydra.overrides`` (or of an ``overrides.yaml`` list) as Hydra
    parses it (:func:`mask_override`), and ``hydra.job.override_dirname`` rebuilt from the masked overrides.

    Examples:
        >>> mask_hydra_record(["+train.hub_token='hf_a,TAIL'", "seed=1"])
        ["+train.hub_token='<HUB_TOKEN>'", 'seed=1']
        >>> job = {"override_dirname": "+train.hub_token=hf_a,seed=1", "config": {"override_dirname": {}}}
        >>> record = {"hydra": {"overrides": {"task": ["seed=1", "+train.hub_token=hf_a"]}, "job": job}}
        >>> mask_hydra_record(record)["hydra"]["job"]["override_dirname"]
        "+train.hub_token='<HUB_TOKEN>',seed=1"
    """
    if isinstance(record, list):
        return [mask_override(str(line)) for line in record]
    masked = _masked(record)
    hydra = record.get("hydra")
    overrides = hydra.get("overrides") if isinstance(hydra, dict) else None
    if not isinstance(overrides, dict):
        return masked
    for kind in ("task", "hydra"):
        if isinstance(overrides.get(kind), list):
            masked["hydra"]["overrides"][kind] = [mask_override(str(line)) for line in overrides[kind]]
    job = masked["hydra"].get("job")
    if isinstance(job, dict) and "override_dirname" in job and isinstance(overrides.get("task"), list):
        settings = (job.get("config") or {}).get("override_dirname") or {}
        job["override_dirname"] = _override_dirname(masked["hydra"]["overrides"]["task"], settings)
    return masked


def _override_dirname(task: list[str], settings: Mapping) -> str:
    """``hydra.job.override_dirname`` of these overrides, built as Hydra builds it (``get_overrides_dirname``: sorted
    input lines, ``exclude_keys`` left out, joined with ``item_sep``, ``=`` replaced by ``kv_sep``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    excluded = set(settings.get("exclude_keys") or [])
    lines = sorted(line for line in task if parser.parse_override(line).key_or_group not in excluded)
    return (settings.get("item_sep") or ",").join(lines).replace("=", settings.get("kv_sep") or "=")


def mask_override(line: str) -> str:
    """One command-line argument as the run records it: a Hydra override is parsed as Hydra parses it (so a value
    holding ``,`` or ``]`` is one value) and its secrets masked (a secret setting's whole value shown as
    ``'<NAME>'``, a secret inside a ``{...}`` or ``[...]`` value by its path, a URL's password); an argument that is
    no override (a script's path, ``-m``) is masked as text (:func:`mask_secrets_in_text`). An override without a
    secret is returned as typed.

    Examples:
        >>> mask_override('+train.hub_token="hf_a]TAIL"'), mask_override("seed=0,1")
        ("+train.hub_token='<HUB_TOKEN>'", 'seed=0,1')
        >>> mask_override("+tools.t.function={_target_:m.make,key:sk-1,url:'https://me:pw@host'}")
        "+tools.t.function={_target_:m.make,key:'<KEY>',url:'https://me:<PASSWORD>@host'}"
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, ValueType

    try:
        override = OverridesParser.create().parse_override(line)
    except Exception:  # not an override (Hydra would have refused it): masked as text
        return mask_url_passwords(mask_secrets_in_text(line))
    if override.value_type is None:  # ~key: no value
        return line
    key, value = override.key_or_group, override.value()
    if override.value_type == ValueType.ELEMENT:
        masked = _masked(value, key)
        text = None if masked == value else _override_value_text(masked)
    elif is_secret_setting(key):  # a sweep over secrets: all of it
        text = _override_value_text(f"<{key.rsplit('.', 1)[-1].upper()}>")
    elif isinstance(value, ChoiceSweep):
        masked = [_masked(choice, key) for choice in value.list]
        texts = [_override_value_text(choice) for choice in masked]
        text = None if masked == value.list else ",".join(texts) if value.simple_form else f"choice({','.join(texts)})"
    else:  # range(...), interval(...), glob(...): numbers and group options
        text = None
    return line if text is None else f"{override.get_key_element()}={text}"


def mask_overrides_in_text(text: str) -> str:
    """``text`` with each override in it (``key=value`` between commas or spaces, as Hydra's ``override_dirname`` and
    its launchers' job lists write them: ``#0 : seed=0 +train.hub_token=hf_x``) masked as :func:`mask_override` masks
    it; a quoted or bracketed value holding commas or spaces stays one override. The rest of ``text`` is kept, but
    for URLs' passwords.

    Examples:
        >>> mask_overrides_in_text('#0 : seed=0 +train.hub_token="hf a]b" x=1')
        "#0 : seed=0 +train.hub_token='<HUB_TOKEN>' x=1"
        >>> mask_overrides_in_text('+train.hub_token="hf_a,TAIL",data.x={a:1,b:2},seed=0')
        "+train.hub_token='<HUB_TOKEN>',data.x={a:1,b:2},seed=0"
    """
    masked, group = [], ""
    for piece in re.split(r"([,\s])", text):
        group += piece
        if not _opened(group):
            masked.append(mask_override(group) if "=" in group else mask_url_passwords(group))
            group = ""
    if group:
        masked.append(mask_override(group) if "=" in group else mask_url_passwords(group))
    return "".join(masked)


def _opened(text: str) -> bool:
    """Whether ``text`` ends inside a quoted string or a bracket (``'``, ``"``, ``[``, ``{``, ``(``) it opened."""
    quote, depth, escaped = None, 0, False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
    return quote is not None or depth > 0


def _override_value_text(value) -> str:
    """``value`` written in Hydra's override grammar, read back as the same value (strings quoted where needed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override

    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_override_value_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_override_value_text(item) for item in value) + "]"
    plain = Override._get_value_element_as_str(value)
    if not isinstance(value, str):
        return plain
    parser = OverridesParser.create()
    quoted = [quote + value.replace(quote, "\\" + quote) + quote for quote in ("'", '"')]
    # Unquoted when it needs no escape (readable as typed), else quoted rather than escaped (a\,b reads badly).
    for text in ([plain] if plain == value else []) + quoted + [plain]:
        try:
            if parser.parse_override(f"x={text}").value() == value:
                return text
        except Exception:
            continue
    return "'<MASKED>'"  # a string no quoting reads back (backslashes before a quote): dropped, not kept in clear


# An env given whole on a command line (`...mcp.servers.<server>.env={API_KEY:abc}`, or inside a larger node).
_BRACED_ENV = re.compile(r"(?P<head>\benv\s*[:=]\s*\{)(?P<body>(?:[^{}]|\$\{[^{}]*\})*)\}")
_ENV_ENTRY = re.compile(r"(?P<name>[\w.-]+)\s*:\s*(?P<value>(?:[^,{}]|\$\{[^{}]*\})*)")


def _mask_braced_env(match: re.Match) -> str:
    def entry(found: re.Match) -> str:
        value = found.group("value").strip(" '\"")
        if not value or value.startswith("${") or value.startswith("<"):
            return found.group(0)
        return f"{found.group('name')}:<{found.group('name').upper()}>"

    return match.group("head") + _ENV_ENTRY.sub(entry, match.group("body")) + "}"


def mask_secrets_in_text(text: str) -> str:
    """Each ``name: value`` or ``name=value`` (one of a comma-separated list too, as Hydra's ``override_dirname`` and
    a command line write them) of a secret-named key whose value is not an interpolation, masked.

    Examples:
        >>> mask_secrets_in_text("+train.hub_token=hf_abc,seed=1")
        '+train.hub_token=<HUB_TOKEN>,seed=1'
        >>> mask_secrets_in_text("  hub_token: hf_abc")
        '  hub_token: <HUB_TOKEN>'
        >>> mask_secrets_in_text("hub_token: ${oc.env:HF_TOKEN}")
        'hub_token: ${oc.env:HF_TOKEN}'
        >>> mask_secrets_in_text("+tools.c.mcp.servers.c.env.DB_URL=pg://me:pw@db,+tools.c.mcp.servers.d.env={K:v}")
        '+tools.c.mcp.servers.c.env.DB_URL=<DB_URL>,+tools.c.mcp.servers.d.env={K:<K>}'
    """

    def replace(match: re.Match) -> str:
        key, separator, value = match.group("key"), match.group("sep"), match.group("value")
        name = key.rsplit(".", 1)[-1].lstrip("+~")
        bare = value.strip(" '\"")
        if not is_secret_setting(key) or bare.startswith("${") or bare in ("", "null") or bare.startswith("<"):
            return match.group(0)
        return f"{key}{separator}<{name.upper()}>"

    assignments = r"(?P<key>[+~]?[A-Za-z_][\w.]*)(?P<sep>=)(?P<value>[^,\n\]]*)"
    entries = r"(?P<key>[A-Za-z_][\w.]*)(?P<sep>: )(?P<value>[^\n]*)"
    text = _BRACED_ENV.sub(_mask_braced_env, text)
    return re.sub(entries, replace, re.sub(assignments, replace, text))


register_resolvers()
