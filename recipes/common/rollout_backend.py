"""Where a GRPO recipe samples its training batches (``rollout.backend``, ``rollout.workers``,
``rollout.worker_resources``, ``ray:``): the checks that run before anything loads, and the Ray connection a run holds
while it trains.

:data:`ROLLOUT_BACKENDS` is the one table of backends (``rollout.backend`` -> :class:`RolloutBackend`: what each
honours and refuses); the checks read its rows, never a backend's name:

- ``learner``: in the trainer's process (sync mode only).
- ``processes``: ``rollout.workers`` local processes, each a copy of the policy (``interop.sampling.workers``).
- ``ray``: ``rollout.workers`` Ray actors, each taking ``rollout.worker_resources``, on the cluster at ``ray.address``
  (null: a local cluster this run starts, and stops).

Each function takes a recipe's settings as its typed tree (its schema's dataclasses) or as a composed ``DictConfig``:
it reads them by attribute alone.

Dependencies: ``ray`` for the Ray backend (the ``ray`` extra).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from recipes.common.config import ConfigError

__all__ = [
    "ROLLOUT_BACKENDS",
    "RolloutBackend",
    "RolloutBackendName",
    "backend_of",
    "samples_apart",
    "check_rollout_backend",
    "ray_connection",
    "worker_resources",
]


@dataclass(frozen=True)
class RolloutBackend:
    """What one ``rollout.backend`` honours and refuses (:func:`check_rollout_backend` reads these, no backend's name).

    Attributes:
        summary: where it samples, for people (``docs/configuration.md`` and the ``rollout.backend`` comment of the
            recipes' YAML name every backend).
        apart_from_learner: its samplers are copies of the policy apart from the learner's process: it runs async
            mode and several workers, and takes weight pushes (``rollout.weight_sync_every``) and a sampler dtype.
        cpu_workers_only: its workers sample on CPU copies (``rollout.worker_resources.num_gpus`` refused).
        gpus_by_request: a worker gets a GPU only if it asks for one (a CUDA run with ``num_gpus=0`` refused).
        reads_ray_address: it joins the cluster at ``ray.address`` (refused with the others).
        per_launcher_process: it runs under a launcher when the recipe gives every process its own workers.
        package: the module it imports, and the project's extra that installs it (``None``: nothing beyond the
            recipe's own).
    """

    summary: str
    apart_from_learner: bool
    cpu_workers_only: bool = False
    gpus_by_request: bool = False
    reads_ray_address: bool = False
    per_launcher_process: bool = False
    package: str | None = None


# Every rollout.backend: adding one is a row here, its name in the rollout.backend Literal of recipes/grpo/schema.py
# and recipes/trl_grpo/schema.py, its comment in the YAML and docs/configuration.md (tests/test_registries.py holds them
# together), and the sampler that runs it (interop.sampling.workers.BACKENDS for one apart from the learner).
ROLLOUT_BACKENDS: dict[str, RolloutBackend] = {
    "learner": RolloutBackend("in the trainer's process (sync mode only)", apart_from_learner=False),
    "processes": RolloutBackend(
        "rollout.workers local processes, each a copy of the policy on CPU",
        apart_from_learner=True,
        cpu_workers_only=True,
        per_launcher_process=True,
    ),
    "ray": RolloutBackend(
        "rollout.workers Ray actors, each taking rollout.worker_resources, on the cluster at ray.address",
        apart_from_learner=True,
        gpus_by_request=True,
        reads_ray_address=True,
        package="ray",
    ),
}

# The choices of rollout.backend in both recipes' schemas: the table's names (a Literal built from them, so that a row
# added here is a choice there).
RolloutBackendName = Literal[tuple(ROLLOUT_BACKENDS)]  # type: ignore[valid-type]


def _apart() -> str:
    """The backends apart from the learner, as a message offers them."""
    return " or ".join(name for name, backend in ROLLOUT_BACKENDS.items() if backend.apart_from_learner)


def backend_of(cfg) -> str:
    """``rollout.backend``, its ``null`` read as the mode's default: the learner in sync mode, one local process in
    async mode (what ``rollout.mode=async`` has always meant)."""
    backend = cfg.rollout.backend
    if backend is None:
        return "learner" if cfg.rollout.mode == "sync" else "processes"
    return str(backend)


def samples_apart(cfg) -> bool:
    """Whether ``cfg``'s backend samples apart from the learner's process (its row's ``apart_from_learner``)."""
    return ROLLOUT_BACKENDS[backend_of(cfg)].apart_from_learner


def worker_resources(cfg):
    """``rollout.worker_resources`` as ``interop.sampling.workers.WorkerResources``."""
    from interop.sampling.workers import WorkerResources

    node = cfg.rollout.worker_resources
    return WorkerResources(
        num_cpus=float(node.num_cpus),
        num_gpus=float(node.num_gpus),
        resources={str(name): float(value) for name, value in (node.resources or {}).items()},
    )


def check_rollout_backend(cfg, *, workers_per_process: bool = False) -> None:
    """What the backend cannot do with the rest of the config, refused naming the keys (no Ray is started here).

    ``workers_per_process``: the recipe gives every process of a launcher its own local workers (the GRPO recipe, whose
    every rank collects its own batch), so ``rollout.backend=processes`` runs under a launcher; ``ray`` never does
    (each process would start or join a cluster of its own)."""
    backend, workers = backend_of(cfg), cfg.rollout.workers
    row = ROLLOUT_BACKENDS[backend]
    if not row.apart_from_learner:
        if cfg.rollout.mode == "async":
            raise ConfigError(
                f"rollout.backend={backend} with rollout.mode=async: async mode samples apart from the learner while "
                f"it trains. Use rollout.backend={_apart()}, or rollout.mode=sync."
            )
        if workers != 1:
            raise ConfigError(
                f"rollout.workers={workers} with rollout.backend={backend}: the learner's process is one sampler. Use "
                f"rollout.backend={_apart()} for several workers."
            )
    if cfg.ray.address is not None and not row.reads_ray_address:
        readers = " or ".join(name for name, other in ROLLOUT_BACKENDS.items() if other.reads_ray_address)
        raise ConfigError(
            f"ray.address={cfg.ray.address!r} with rollout.backend={backend}: only rollout.backend={readers} reads it. "
            f"Set rollout.backend={readers}, or drop ray.address."
        )
    gpus = cfg.rollout.worker_resources.num_gpus
    if row.cpu_workers_only and gpus:
        raise ConfigError(
            f"rollout.worker_resources.num_gpus={gpus} with rollout.backend={backend}: local worker processes sample "
            "on CPU copies of the policy. Use rollout.backend=ray for GPU workers, or "
            "rollout.worker_resources.num_gpus=0."
        )
    if row.gpus_by_request and str(cfg.device).startswith("cuda") and not gpus:
        raise ConfigError(
            f"device={cfg.device} with rollout.backend={backend} and rollout.worker_resources.num_gpus=0: Ray "
            "gives a worker no GPU unless it asks for one, so the workers would sample on CPU (or fail to load on "
            "CUDA). Set rollout.worker_resources.num_gpus=1 (a GPU each; 0.5 shares one between two), or device=cpu."
        )
    _check_weight_push(cfg, backend)
    if not row.apart_from_learner:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (workers_per_process and row.per_launcher_process):
        raise ConfigError(
            f"rollout.backend={backend} under a launcher ({os.environ['WORLD_SIZE']} processes): the samplers feed "
            "one learner process. Use rollout.backend=learner with several processes, or one learner process."
        )
    if row.package is not None and importlib.util.find_spec(row.package) is None:
        raise ConfigError(
            f'rollout.backend={backend}, but {row.package} is not installed: pip install -e ".[{row.package}]" (the '
            f"project's {row.package} extra), or use rollout.backend=processes."
        )


def _check_weight_push(cfg, backend: str) -> None:
    """``rollout.weight_sync_every`` and ``rollout.sampler_dtype``: what a copy of the policy apart from the learner
    takes, refused with the learner (it samples with the weights it trains) and beyond the lag bound."""
    every, sampler_dtype = cfg.rollout.weight_sync_every, cfg.rollout.sampler_dtype
    in_learner = not ROLLOUT_BACKENDS[backend].apart_from_learner
    if in_learner and every != 1:
        raise ConfigError(
            f"rollout.weight_sync_every={every} with rollout.backend={backend}: the learner samples with the weights "
            f"it trains, so nothing is pushed. Use rollout.backend={_apart()}, or rollout.weight_sync_every=1."
        )
    if in_learner and sampler_dtype != cfg.dtype:
        raise ConfigError(
            f"rollout.sampler_dtype={sampler_dtype} with rollout.backend={backend}: the learner samples with the "
            f"weights it trains (dtype={cfg.dtype}); a sampler of another dtype is a copy apart from it. Use "
            f"rollout.backend={_apart()}, or rollout.sampler_dtype={cfg.dtype}."
        )
    if sampler_dtype == "float16" and cfg.device == "cpu" and cfg.dtype != "float16":  # dtype=float16: its own check
        raise ConfigError(
            "rollout.sampler_dtype=float16 on the CPU: CPU kernels have no float16 for most of a model's layers. Use "
            "rollout.sampler_dtype=bfloat16 (or float32), or device=cuda."
        )
    # Weights pushed every k updates: a batch sampled right before a push is k - 1 updates old in sync mode, and one
    # more in async mode (sampled during the update before its own).
    lookahead = int(cfg.rollout.mode == "async")
    reached, bound = every - 1 + lookahead, cfg.rollout.max_policy_lag
    if every > 1 and reached > bound:  # every=1 pushes each update: the lag is the mode's own, bounded as always
        raise ConfigError(
            f"rollout.weight_sync_every={every} with rollout.mode={cfg.rollout.mode}: a batch can then be {reached} "
            f"updates old, more than rollout.max_policy_lag={bound} allows. Set rollout.max_policy_lag={reached} or "
            f"more, or rollout.weight_sync_every={max(1, bound + 1 - lookahead)} or less."
        )


@contextlib.contextmanager
def ray_connection(cfg) -> Iterator[None]:
    """With ``rollout.backend=ray``: joined to (or started) the cluster of ``ray:``, with room checked for
    ``rollout.workers`` workers, for the run's duration; a cluster this run started is stopped at the end, a joined
    one left running. Other backends: nothing."""
    if not ROLLOUT_BACKENDS[backend_of(cfg)].reads_ray_address:
        yield
        return
    from interop.sampling.workers import check_placement, connect_ray, disconnect_ray

    try:
        connect_ray(
            None if cfg.ray.address is None else str(cfg.ray.address),
            num_cpus=cfg.ray.num_cpus,
        )
    except ConnectionError as error:
        raise ConfigError(str(error)) from None
    try:
        try:
            check_placement(cfg.rollout.workers, worker_resources(cfg))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        yield
    finally:
        disconnect_ray()
