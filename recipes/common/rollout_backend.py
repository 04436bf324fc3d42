"""Where a GRPO recipe samples its training batches (``rollout.backend``, ``rollout.workers``,
``rollout.worker_resources``, ``ray:``): the checks that run before anything loads, and the Ray connection a run holds
while it trains.

- ``learner``: in the trainer's process (sync mode only).
- ``processes``: ``rollout.workers`` local processes, each a copy of the policy (``interop.rollout_workers``).
- ``ray``: ``rollout.workers`` Ray actors, each taking ``rollout.worker_resources``, on the cluster at ``ray.address``
  (null: a local cluster this run starts, and stops).

Dependencies: omegaconf; ``ray`` for the Ray backend (the ``ray`` extra).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

from omegaconf import DictConfig

from recipes.common.config import ConfigError

__all__ = ["backend_of", "check_rollout_backend", "ray_connection", "worker_resources"]


def backend_of(cfg: DictConfig) -> str:
    """``rollout.backend``, its ``null`` read as the mode's default: the learner in sync mode, one local process in
    async mode (what ``rollout.mode=async`` has always meant)."""
    backend = cfg.rollout.backend
    if backend is None:
        return "learner" if cfg.rollout.mode == "sync" else "processes"
    return str(backend)


def worker_resources(cfg: DictConfig):
    """``rollout.worker_resources`` as ``interop.rollout_workers.WorkerResources``."""
    from interop.rollout_workers import WorkerResources

    node = cfg.rollout.worker_resources
    return WorkerResources(
        num_cpus=float(node.num_cpus),
        num_gpus=float(node.num_gpus),
        resources={str(name): float(value) for name, value in (node.resources or {}).items()},
    )


def check_rollout_backend(cfg: DictConfig, *, workers_per_process: bool = False) -> None:
    """What the backend cannot do with the rest of the config, refused naming the keys (no Ray is started here).

    ``workers_per_process``: the recipe gives every process of a launcher its own local workers (the GRPO recipe, whose
    every rank collects its own batch), so ``rollout.backend=processes`` runs under a launcher; ``ray`` never does
    (each process would start or join a cluster of its own)."""
    backend, workers = backend_of(cfg), cfg.rollout.workers
    if backend == "learner":
        if cfg.rollout.mode == "async":
            raise ConfigError(
                "rollout.backend=learner with rollout.mode=async: async mode samples apart from the learner while it "
                "trains. Use rollout.backend=processes (local) or rollout.backend=ray, or rollout.mode=sync."
            )
        if workers != 1:
            raise ConfigError(
                f"rollout.workers={workers} with rollout.backend=learner: the learner's process is one sampler. Use "
                "rollout.backend=processes or rollout.backend=ray for several workers."
            )
    if cfg.ray.address is not None and backend != "ray":
        raise ConfigError(
            f"ray.address={cfg.ray.address!r} with rollout.backend={backend}: only rollout.backend=ray reads it. Set "
            "rollout.backend=ray, or drop ray.address."
        )
    if backend == "processes" and cfg.rollout.worker_resources.num_gpus:
        raise ConfigError(
            f"rollout.worker_resources.num_gpus={cfg.rollout.worker_resources.num_gpus} with "
            "rollout.backend=processes: local worker processes sample on CPU copies of the policy. Use "
            "rollout.backend=ray for GPU workers, or rollout.worker_resources.num_gpus=0."
        )
    if backend == "ray" and str(cfg.device).startswith("cuda") and not cfg.rollout.worker_resources.num_gpus:
        raise ConfigError(
            f"device={cfg.device} with rollout.backend=ray and rollout.worker_resources.num_gpus=0: Ray gives a worker "
            "no GPU unless it asks for one, so the workers would sample on CPU (or fail to load on CUDA). Set "
            "rollout.worker_resources.num_gpus=1 (a GPU each; 0.5 shares one between two), or device=cpu."
        )
    _check_weight_push(cfg, backend)
    if backend == "learner":
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (workers_per_process and backend == "processes"):
        raise ConfigError(
            f"rollout.backend={backend} under a launcher ({os.environ['WORLD_SIZE']} processes): the samplers feed "
            "one learner process. Use rollout.backend=learner with several processes, or one learner process."
        )
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError(
            'rollout.backend=ray, but ray is not installed: pip install -e ".[ray]" (the project\'s ray extra), or '
            "use rollout.backend=processes."
        )


def _check_weight_push(cfg: DictConfig, backend: str) -> None:
    """``rollout.weight_sync_every`` and ``rollout.sampler_dtype``: what a copy of the policy apart from the learner
    takes, refused with the learner (it samples with the weights it trains) and beyond the lag bound."""
    every, sampler_dtype = cfg.rollout.weight_sync_every, cfg.rollout.sampler_dtype
    if backend == "learner" and every != 1:
        raise ConfigError(
            f"rollout.weight_sync_every={every} with rollout.backend=learner: the learner samples with the weights "
            "it trains, so nothing is pushed. Use rollout.backend=processes or ray, or rollout.weight_sync_every=1."
        )
    if backend == "learner" and sampler_dtype != cfg.dtype:
        raise ConfigError(
            f"rollout.sampler_dtype={sampler_dtype} with rollout.backend=learner: the learner samples with the "
            f"weights it trains (dtype={cfg.dtype}); a sampler of another dtype is a copy apart from it. Use "
            f"rollout.backend=processes or ray, or rollout.sampler_dtype={cfg.dtype}."
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
def ray_connection(cfg: DictConfig) -> Iterator[None]:
    """With ``rollout.backend=ray``: joined to (or started) the cluster of ``ray:``, with room checked for
    ``rollout.workers`` workers, for the run's duration; a cluster this run started is stopped at the end, a joined
    one left running. Other backends: nothing."""
    if backend_of(cfg) != "ray":
        yield
        return
    from interop.rollout_workers import check_placement, connect_ray, disconnect_ray

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
