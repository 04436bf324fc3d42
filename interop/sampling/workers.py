"""Sampling workers apart from the learner, on this machine or on a Ray cluster: what lets
``TorchRLRolloutFunc(backend="processes" | "ray", workers=N)`` spread trl's generation batches over several samplers.

Public names:

- :class:`RolloutWorkers`: ``N`` copies of the policy that sample, each in a local process
  (:class:`~interop.sampling.background.BackgroundSampler`) or a Ray actor. The caller publishes its weights with a
  version (:meth:`RolloutWorkers.publish`), submits a batch of prompts in groups (:meth:`RolloutWorkers.submit`: each
  group goes to exactly one worker) and collects the batch (:meth:`RolloutWorkers.result`), every row sampled by the
  published version. A worker that dies in the middle of a batch (its process killed, its actor killed, its node
  gone) is replaced and its groups are sampled again, so no group is lost or returned twice; a worker whose node has
  left the cluster is dropped with a warning naming the node, and the others share its groups.
- :class:`WorkerResources`: what one worker takes of a Ray cluster (CPUs, GPUs, custom resources).
- :func:`connect_ray`: joins the Ray cluster at an address, or starts a local one (and says so); :func:`check_placement`
  refuses a number of workers the cluster cannot place, naming the resources missing.

Weights. Local workers read the caller's weights from shared memory (``BackgroundSampler.publish`` copies them there).
Ray workers read them from Ray's object store: :meth:`RolloutWorkers.publish` puts one CPU copy of the weights per
version (``ray.put`` of a :class:`PublishedWeights`, numpy arrays), and each worker maps it, without a copy, before its
first batch of that version. TorchRL 0.14.1's
``RayWeightSyncScheme`` was the other candidate; it sends over a gloo process group of fixed size formed at the first
sync, which a worker that is killed and replaced cannot rejoin (every worker's group would have to be formed again),
while an object in Ray's store is read by whichever actor holds the batch, restarted or not.

Process hygiene: local workers die with the caller (``PR_SET_PDEATHSIG``, see ``interop.sampling._child``); Ray
actors are killed by :meth:`RolloutWorkers.close`; a local cluster that :func:`connect_ray` started is shut down by
:func:`disconnect_ray`, and if the caller is killed its watcher (``interop.sampling._ray_janitor``) kills what Ray
leaves.

Dependencies: torch, tensordict; ``ray`` for the Ray backend (``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Collection, Sequence
from typing import Any, overload

import numpy as np
import torch
from tensordict import TensorDict

from interop.sampling.background import (
    BackgroundSampler,
    SamplerExited,
    build_rollout_sampler,
    pushed_names,
    sampler_options,
    sampler_tokenizer,
)
from interop.sampling.sampler import SamplingSettings

__all__ = [
    "BACKENDS",
    "PublishedWeights",
    "RolloutWorkers",
    "WorkerResources",
    "check_placement",
    "RemoteWorker",
    "connect_ray",
    "disconnect_ray",
    "kill_actor",
    "node_alive",
    "published_state",
    "split_groups",
]

log = logging.getLogger(__name__)

BACKENDS = ("processes", "ray")
# How often one batch may lose a worker before the batch fails (a worker that dies at every try is a bug, not bad luck).
_MAX_RESTARTS_PER_BATCH = 4
# How long a replacement Ray worker may wait to be placed before it is given up (its node's share then goes to the
# others): a node that is leaving can still look alive for a few seconds after its worker died.
_REPLACEMENT_PLACEMENT_S = 60.0


@dataclasses.dataclass(frozen=True)
class WorkerResources:
    """What one Ray worker takes: ``num_cpus``, ``num_gpus`` and custom ``resources`` (e.g. ``{"sampler": 1}`` to pin
    workers to the nodes started with that resource)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in (("num_cpus", self.num_cpus), ("num_gpus", self.num_gpus), *self.resources.items()):
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"WorkerResources: {name} must be a number >= 0, got {value!r}.")

    def as_dict(self) -> dict[str, float]:
        """The resources as Ray counts them (``CPU``, ``GPU`` and the custom names)."""
        custom = {name: float(value) for name, value in self.resources.items()}
        return {"CPU": float(self.num_cpus), "GPU": float(self.num_gpus), **custom}


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            "The Ray backend needs ray, which is not installed: pip install -e \".[ray]\" (or pip install 'ray>=2.40')."
        ) from error
    return ray


# The watcher of the local cluster connect_ray started (interop.sampling._ray_janitor); None: none started.
_janitor: subprocess.Popen | None = None


def connect_ray(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = False) -> bool:
    """Joins the Ray cluster at ``address`` (``"auto"``: the one this machine's ``ray start`` runs; ``"ray://...``"),
    or, with ``address=None``, starts a local one on this machine (``num_cpus`` of its CPUs; ``None``: all).

    Returns whether this call started a cluster (then :func:`disconnect_ray` stops it; a joined cluster is left
    running). Already connected: nothing is done. An unreachable address raises ``ConnectionError`` naming it.
    """
    global _janitor
    ray = _import_ray()
    if ray.is_initialized():
        return False
    options = {"include_dashboard": False, "log_to_driver": log_to_driver, "configure_logging": False}
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, **options)  # "local": a new one, even where RAY_ADDRESS is set
        log.info("Ray: no cluster address given (ray.address=null): started a local Ray cluster on this machine.")
        _janitor = subprocess.Popen(
            [sys.executable, "-m", "interop.sampling._ray_janitor", str(os.getpid())], stdin=subprocess.PIPE
        )
        return True
    try:
        _probe(address)  # ray.init retries an address nobody answers at for minutes, then exits the process
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ConnectionError(
            f"Ray: could not join the cluster at ray.address={address!r} ({type(error).__name__}: {error}). Start its "
            "head first (ray start --head on that machine), check the address and port, or leave ray.address unset "
            "to start a local cluster."
        ) from error
    log.info("Ray: joined the cluster at %s (%s).", address, _describe(ray.cluster_resources()))
    return False


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Raises ``ConnectionError`` when nothing listens at a ``host:port`` (or ``ray://host:port``) address."""
    import socket

    host_port = address.removeprefix("ray://")
    if address == "auto" or ":" not in host_port:
        return  # ray.init finds (or fails to find) this machine's cluster at once
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as error:
        raise ConnectionError(f"nothing answers at {host_port} ({error})") from error


def disconnect_ray() -> None:
    """Stops Ray in this process: a cluster :func:`connect_ray` started is shut down (its processes end), a joined one
    is only left."""
    global _janitor
    ray = _import_ray()
    if ray.is_initialized():
        ray.shutdown()
    janitor, _janitor = _janitor, None
    if janitor is not None:
        try:
            janitor.communicate(b"done\n", timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            janitor.kill()
            janitor.wait()


def _describe(resources: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in sorted(resources.items()) if not name.startswith("node:"))


def check_placement(workers: int, resources: WorkerResources, *, setting: str = "rollout.workers") -> None:
    """Refuses ``workers`` workers of ``resources`` each that the connected cluster cannot place, naming what is
    missing (counted over the whole cluster's total: a worker takes one node's share, which this cannot see)."""
    ray = _import_ray()
    total = ray.cluster_resources()
    wanted = {name: value * workers for name, value in resources.as_dict().items() if value > 0}
    missing = {name: value - total.get(name, 0.0) for name, value in wanted.items() if total.get(name, 0.0) < value}
    if missing:
        raise ValueError(
            f"{setting}={workers}: the Ray cluster cannot place {workers} worker(s) of "
            f"{_describe(resources.as_dict())} each: missing {_describe(missing)} (the cluster has "
            f"{_describe(total)}). Lower the number of workers or what each takes, or add nodes."
        )


def split_groups(rows: int, group_size: int, workers: int) -> list[range]:
    """The row ranges each worker samples: whole groups of ``group_size`` consecutive rows, as even as possible over
    at most ``workers`` workers (fewer when there are fewer groups).

    >>> split_groups(8, 2, 3)
    [range(0, 2), range(2, 4), range(4, 8)]
    """
    if group_size < 1 or rows % group_size:
        raise ValueError(f"split_groups: {rows} rows are not whole groups of {group_size}.")
    groups = rows // group_size
    used = max(1, min(workers, groups))
    bounds = [index * groups // used * group_size for index in range(used + 1)]
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


def _sampling_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of ``model`` that computes with its own weights. A trainer patches its model's ``forward`` on the
    instance (accelerate wraps it to convert outputs, trl for its own needs) with functions that close over the
    trainer's module; ``deepcopy`` keeps functions as they are, so the copy's patched ``forward`` would still run the
    trainer's module (in a Ray worker: a stale copy of it, whatever weights the worker loads). The class's ``forward``
    is the model's computation."""
    clone = copy.deepcopy(model).to("cpu").eval().requires_grad_(False)
    for module in clone.modules():
        module.__dict__.pop("forward", None)
    return clone


class PublishedWeights:
    """A model's weights as one Ray object: each tensor once, as a numpy array on the CPU.

    Why numpy: ``ray.put`` writes a numpy array into the object store with one copy, and ``ray.get`` on a worker's
    node maps it out of the store with none (pickle 5 buffers); a torch tensor is pickled byte by byte on both sides
    (at the real-vocabulary build, 369 MiB: 0.6 s to put, 0.4 s to load inside each worker's batch, measured with
    ``scripts/bench_rollout_workers.py``). Tied weights (the output head and the embeddings of most causal LMs) appear
    under two names: kept once, since the worker's copy ties them too and one load sets both.

    Args:
        model: the model whose weights are published.

    Keyword Args:
        dtype: the dtype the sampler computes in (``None``: the model's): the weights are cast here, once per push,
            not at every sampling step. numpy has no bfloat16: such a tensor travels as its bits (int16) and is read
            back as bfloat16.
        names: publish only these weights (LoRA's adapters, where the sampler holds the base:
            :func:`~interop.sampling.background.pushed_names`); ``None``: all.

    Examples:
        >>> model = torch.nn.Linear(2, 2)
        >>> weights = PublishedWeights(model, dtype=torch.bfloat16)
        >>> sampler = torch.nn.Linear(2, 2).to(torch.bfloat16)
        >>> weights.load_into(sampler)
        >>> bool(torch.equal(sampler.weight, model.weight.to(torch.bfloat16)))
        True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        seen = set()
        for name, value in model.state_dict().items():
            key = (value.data_ptr(), tuple(value.shape), tuple(value.stride()))
            if key in seen or (names is not None and name not in names):
                continue
            seen.add(key)
            value = value.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            value = value.to("cpu").contiguous()
            self.dtypes[name] = value.dtype
            if value.dtype == torch.bfloat16:
                value = value.view(torch.int16)
            self.arrays[name] = value.numpy()

    @property
    def nbytes(self) -> int:
        """The size of the published weights."""
        return sum(array.nbytes for array in self.arrays.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights as torch tensors on the arrays' memory (read-only where Ray mapped them: do not write)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {name: torch.from_numpy(array).view(self.dtypes[name]) for name, array in self.arrays.items()}

    def load_into(self, model: torch.nn.Module, *, share: bool = False) -> None:
        """Sets ``model``'s weights (by name) to these. ``share``: a CPU model's tensors take these arrays' memory
        instead of a copy of them (a Ray worker: the object store's, mapped read-only, which sampling never writes);
        a model on a GPU is always copied to."""
        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in self.tensors().items():
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"PublishedWeights.load_into: the model has no {name!r}.")
                if share and target.device.type == "cpu" and target.dtype == value.dtype:
                    target.data = value
                else:
                    target.copy_(value)


def published_state(model: torch.nn.Module, *, dtype: torch.dtype | None = None) -> PublishedWeights:
    """The weights a Ray worker loads (:class:`PublishedWeights`). Not copied here but by ``ray.put``, into the
    object store, before it returns."""
    return PublishedWeights(model, dtype=dtype)


def _ray_worker_class(ray):
    """The Ray actor a worker is: a copy of the policy with its sampler, loading each version's weights once."""

    class RaySamplerWorker:
        def __init__(self, model: torch.nn.Module, tokenizer, options: dict) -> None:
            # Ray hands over read-only tensors: each gets memory of its own, in place.
            self.model = model.eval().requires_grad_(False)
            with torch.no_grad():
                for tensor in self.model.state_dict(keep_vars=True).values():
                    tensor.data = tensor.data.clone()
            if ray.get_gpu_ids():  # a worker given a GPU (WorkerResources.num_gpus) samples on it
                self.model.to("cuda")
            self.sampler = build_rollout_sampler(self.model, tokenizer, options)
            self.version: int | None = None

        def where(self) -> tuple[str, int]:
            import os

            return ray.get_runtime_context().get_node_id(), os.getpid()

        def sample(self, weights: list, version: int, prompt_ids: list[list[int]]):
            if version != self.version:
                # Inside a list: fetched only when this worker lacks the version; mapped out of the object store.
                ray.get(weights[0]).load_into(self.model, share=True)
                self.version = version
            started = time.perf_counter()
            rollout = self.sampler.sample(prompt_ids)
            return dict(rollout.items()), tuple(rollout.batch_size), time.perf_counter() - started

    return ray.remote(RaySamplerWorker)


class RemoteWorker:
    """One sampling worker (a local process's handle or a Ray actor) and where it runs (for the warnings)."""

    def __init__(self, index: int, handle: Any, node: str, pid: int | None) -> None:
        self.index, self.handle, self.node, self.pid = index, handle, node, pid


def node_alive(node: str) -> bool:
    """Whether the Ray node ``node`` (an id) is still in the cluster."""
    return any(entry["NodeID"] == node and entry["Alive"] for entry in _import_ray().nodes())


def kill_actor(handle) -> None:
    """Kills a Ray actor for good (no restart); one already gone is fine."""
    try:
        _import_ray().kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


class RolloutWorkers:
    """Several copies of a causal LM sampling apart from the caller, on weights it publishes.

    Args:
        model: the model being trained; each worker samples with a copy of it.
        tokenizer: its tokenizer (only the pad and EOS ids reach single-turn workers; dialogs need all of it).

    Keyword Args:
        settings, log_probs_at_temperature, eos_token_ids, dialogs, timeout_s: as
            :class:`~interop.sampling.background.BackgroundSampler`'s.
        backend: ``"processes"`` (local child processes) or ``"ray"`` (Ray actors on the connected cluster: call
            :func:`connect_ray` first).
        workers: how many.
        num_threads: torch threads of each worker.
        seed: worker ``i`` samples with torch seed ``seed + i``.
        resources: what each Ray worker takes (:class:`WorkerResources`).
        dtype: what the workers sample in (``None``: the model's): each holds a copy in it, and the weights are cast
            to it as they are published, not at every step. The log-probs they record are that copy's.

    Examples:
        A sketch (Ray backend, two workers on a local cluster)::

            connect_ray()
            workers = RolloutWorkers(model, tokenizer, settings=SamplingSettings(max_new_tokens=16),
                                     eos_token_ids=[tokenizer.eos_token_id], backend="ray", workers=2)
            workers.publish(model, version=0)
            workers.submit(prompt_ids, group_size=8)  # each group of 8 rows to one worker
            rollout, version = workers.result()
            workers.close(); disconnect_ray()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        settings: SamplingSettings,
        eos_token_ids: Sequence[int],
        backend: str = "processes",
        workers: int = 1,
        log_probs_at_temperature: bool = False,
        num_threads: int = 1,
        seed: int = 0,
        dialogs: dict | None = None,
        resources: WorkerResources | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"RolloutWorkers: backend must be one of {BACKENDS}, got {backend!r}.")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"RolloutWorkers: workers must be an integer >= 1, got {workers!r}.")
        self.backend, self.timeout_s = backend, timeout_s
        self.dtype = dtype
        self._model = _sampling_copy(model)  # what every worker starts from
        if dtype is not None:
            self._model.to(dtype)
        self._tokenizer, self._dialogs = tokenizer, dialogs
        self._options: dict[str, Any] = {
            "settings": settings,
            "log_probs_at_temperature": log_probs_at_temperature,
            "eos_token_ids": list(eos_token_ids),
            "num_threads": num_threads,
            "dialogs": dialogs,
        }
        self._seed = seed
        self.resources = resources or WorkerResources()
        self.version: int | None = None
        self._weights_ref = None
        self._pending: list[tuple[RemoteWorker, range, Any]] | None = None
        self._prompt_ids: list[list[int]] = []  # the submitted batch's
        self._closed = False
        self.restarts = 0  # workers replaced since the start
        self.dropped_nodes: list[str] = []
        self.last_stats: dict[str, float] = {}
        if backend == "ray":
            self._ray = _import_ray()
            if not self._ray.is_initialized():
                raise RuntimeError("RolloutWorkers(backend='ray'): connect to a cluster first (connect_ray()).")
            self._actor_class = _ray_worker_class(self._ray)
            self._model_ref = self._ray.put(self._model)
        self._workers = [self._start(index) for index in range(workers)]

    # ------------------------------------------------------------------------------------------------ workers

    @overload
    def _start(
        self, index: int, *, placement_s: None = None, weights: torch.nn.Module | None = None
    ) -> RemoteWorker: ...

    @overload
    def _start(
        self, index: int, *, placement_s: float, weights: torch.nn.Module | None = None
    ) -> RemoteWorker | None: ...

    def _start(
        self, index: int, *, placement_s: float | None = None, weights: torch.nn.Module | None = None
    ) -> RemoteWorker | None:
        """Worker ``index`` (a local one starting from ``weights``' copy, by default the first weights); with
        ``placement_s``, ``None`` when Ray cannot place it within that many seconds (a Ray worker starts from the first
        weights and loads the published ones with its next batch)."""
        seed = self._seed + index
        if self.backend == "processes":
            sampler = BackgroundSampler(
                self._model if weights is None else weights,
                self._tokenizer,
                settings=self._options["settings"],
                log_probs_at_temperature=self._options["log_probs_at_temperature"],
                eos_token_ids=self._options["eos_token_ids"],
                num_threads=self._options["num_threads"],
                seed=seed,
                dialogs=self._dialogs,
                timeout_s=self.timeout_s,
            )
            return RemoteWorker(index, sampler, "this machine", sampler.pid)
        options = sampler_options(seed=seed, **self._options)
        resources = self.resources
        actor = self._actor_class.options(
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            resources=dict(resources.resources) or None,
            max_restarts=0,  # replaced by this class, which resubmits the batch and counts it
        ).remote(self._model_ref, sampler_tokenizer(self._tokenizer, self._dialogs), options)
        try:
            node, pid = self._ray.get(actor.where.remote(), timeout=placement_s or self.timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            if placement_s is None:
                raise
            kill_actor(actor)
            return None
        return RemoteWorker(index, actor, node, pid)

    def wait_until_ready(self) -> None:
        """Waits for every worker to have started (local processes start in the background)."""
        if self.backend == "processes":
            for worker in self._workers:
                worker.handle.wait_until_ready()

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids (local processes, or the Ray actors' on their nodes)."""
        return [worker.pid for worker in self._workers]

    @property
    def busy(self) -> bool:
        return self._pending is not None

    # ------------------------------------------------------------------------------------------------ batches

    def publish(self, model: torch.nn.Module, *, version: int) -> None:
        """The weights every batch from now on is sampled with, as ``version`` (cast to the workers' ``dtype``; where
        ``model`` freezes some weights, LoRA's base, only the others: the workers' copies hold those already)."""
        if self._pending is not None:
            raise RuntimeError("RolloutWorkers.publish: a batch is being sampled; wait for result() first.")
        if self.backend == "processes":
            for worker in self._workers:
                worker.handle.publish(model, version=version)
        else:
            self._weights_ref = self._ray.put(PublishedWeights(model, dtype=self.dtype, names=pushed_names(model)))
        self.version = version

    def submit(self, prompt_ids: Sequence[Sequence[int]], *, group_size: int = 1) -> None:
        """Starts sampling one completion per prompt (token ids, unpadded), each group of ``group_size`` consecutive
        prompts on one worker."""
        if self._pending is not None:
            raise RuntimeError("RolloutWorkers.submit: one batch at a time; wait for result() first.")
        if self.version is None:
            raise RuntimeError("RolloutWorkers.submit: publish() the weights first.")
        self._prompt_ids = [list(map(int, row)) for row in prompt_ids]
        shards = split_groups(len(self._prompt_ids), group_size, len(self._workers))
        self._pending = [(worker, rows, self._send(worker, rows)) for worker, rows in zip(self._workers, shards)]

    def _send(self, worker: RemoteWorker, rows: range):
        prompts = [self._prompt_ids[row] for row in rows]
        if self.backend == "processes":
            worker.handle.submit(prompts)
            return None
        return worker.handle.sample.remote([self._weights_ref], self.version, prompts)

    def _receive(self, worker: RemoteWorker, future) -> tuple[TensorDict, float]:
        if self.backend == "processes":
            rollout, _ = worker.handle.result()
            seconds = float(rollout.get("sample_s")[0]) if rollout.shape[0] else 0.0
            return rollout.exclude("sample_s"), seconds
        data, batch_size, seconds = self._ray.get(future, timeout=self.timeout_s)
        # Ray hands tensors back on its object store's read-only memory: the batch is the caller's to change.
        return TensorDict({key: value.clone() for key, value in data.items()}, batch_size=batch_size), seconds

    def _died(self) -> tuple[type[BaseException], ...]:
        if self.backend == "processes":
            return (SamplerExited,)
        return (self._ray.exceptions.RayActorError,)

    def result(self) -> tuple[TensorDict, int]:
        """The submitted batch, rows in the submitted order, and the weights' version that sampled every row.

        ``last_stats``: ``workers`` (alive), ``worker_restarts`` (this batch), ``worker_<i>/tokens_per_s`` (each
        worker's completion tokens per second of its sampling)."""
        if self._pending is None:
            raise RuntimeError("RolloutWorkers.result: nothing was submitted.")
        pending, self._pending = self._pending, None
        parts: dict[int, TensorDict] = {}
        stats: dict[str, float] = {}
        restarts = 0
        while pending:
            worker, rows, future = pending.pop(0)
            try:
                part, seconds = self._receive(worker, future)
            except self._died() as error:
                restarts += 1
                if restarts > _MAX_RESTARTS_PER_BATCH:
                    raise RuntimeError(
                        f"RolloutWorkers: workers died {restarts} times during one batch; the last: {error}"
                    ) from error
                replacement = self._replace(worker, error)
                if replacement is None:  # its node left: a surviving worker takes the groups
                    replacement = min(self._workers, key=lambda alive: sum(p[0] is alive for p in pending))
                pending.append((replacement, rows, self._send(replacement, rows)))
                continue
            parts[rows.start] = part
            tokens = float(part.get("completion_length").sum()) if part.shape[0] else 0.0
            stats[f"worker_{worker.index}/tokens_per_s"] = tokens / max(seconds, 1e-9)
        stats["workers"] = float(len(self._workers))
        stats["worker_restarts"] = float(restarts)
        self.last_stats = stats
        assert self.version is not None  # submit() refuses to start before publish()
        return _concatenate([parts[start] for start in sorted(parts)], self._pad_id()), self.version

    def _pad_id(self) -> int:
        return int(self._tokenizer.pad_token_id)

    def _replace(self, worker: RemoteWorker, error: BaseException) -> RemoteWorker | None:
        """A worker that died: replaced (the same index), or dropped when its node has left the cluster or no node
        can take a replacement (``None``: the others share its groups)."""
        self.restarts += 1
        position = self._workers.index(worker)
        self._stop(worker)
        replacement = None
        if self.backend == "processes":  # the dead one's shared copy, in this process, holds the published weights
            replacement = self._start(worker.index, weights=worker.handle.model)
            replacement.handle.publish(worker.handle.model, version=self.version)
        elif node_alive(worker.node):
            replacement = self._start(worker.index, placement_s=_REPLACEMENT_PLACEMENT_S)
        if replacement is not None:
            log.warning(
                "RolloutWorkers: worker %d (pid %s on %s) died during a batch (%s); started another (pid %s on %s), "
                "which samples its groups again.",
                worker.index,
                worker.pid,
                worker.node,
                type(error).__name__,
                replacement.pid,
                replacement.node,
            )
            self._workers[position] = replacement
            return replacement
        self._workers.pop(position)
        self.dropped_nodes.append(worker.node)
        log.warning(
            "RolloutWorkers: worker %d's node %s left the Ray cluster (or has no room for it any more); its groups go "
            "to the %d remaining worker(s).",
            worker.index,
            worker.node,
            len(self._workers),
        )
        if not self._workers:
            raise RuntimeError(f"RolloutWorkers: no worker left (the last one ran on node {worker.node}).") from error
        return None

    def _stop(self, worker: RemoteWorker) -> None:
        if self.backend == "processes":
            worker.handle.close()
            return
        kill_actor(worker.handle)

    def close(self) -> None:
        """Stops every worker (local processes are joined; Ray actors killed)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            self._stop(worker)
        self._pending = None


def _concatenate(parts: list[TensorDict], pad_id: int) -> TensorDict:
    """The workers' parts as one batch: prompts left-padded, completions right-padded to the widest part."""
    if len(parts) == 1:
        return parts[0]
    fills = {"prompt_ids": (pad_id, "left"), "completion_ids": (pad_id, "right")}
    keys = parts[0].keys()
    joined = {}
    for key in keys:
        values = [part.get(key) for part in parts]
        if values[0].ndim == 2:
            fill, side = fills.get(key, (0, "right"))
            width = max(value.shape[1] for value in values)
            padded = []
            for value in values:
                extra = width - value.shape[1]
                pad = (extra, 0) if side == "left" else (0, extra)
                padded.append(torch.nn.functional.pad(value, pad, value=fill))
            values = padded
        joined[key] = torch.cat(values)
    return TensorDict(joined, batch_size=[sum(part.shape[0] for part in parts)])
