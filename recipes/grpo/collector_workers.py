"""Several TorchRL collectors feeding one GRPO learner (``rollout.backend=processes|ray``, ``rollout.workers=N``).

:class:`CollectorWorkers` runs ``N`` collectors, each built from the same picklable factory as the async mode's one
(env + sampler policy + reward: ``recipes.grpo.collector.build_prompt_collector``), each producing
``responses_per_step / N`` responses per batch in whole groups. Collector ``i`` is replica ``i`` of the ``N`` that
deal out the prompt stream (``recipes.common.data.EndlessShuffleSampler``: positions ``start + i``, ``start + i + N``,
...), so no two draw the same prompt position and each step they draw together the prompts one collector would (in
another order); it samples with its own torch seed (``seed + i``). The learner takes one part from each per step and
concatenates them (``recipes.grpo.batch.merge_batches``: prompts left-padded, responses right-padded to the widest
part); every row carries the policy version it was sampled with (``"policy_version"``).

Where the collectors run:

- ``processes``: each in a local child process, a :class:`~recipes.grpo.collector_modes.BackgroundCollector` (the one
  place this recipe's child-process plumbing lives: shared-memory weights, parent-death signal, lag bound).
- ``ray``: on Ray actors (each taking ``rollout.worker_resources``) that build the collector from the factory and
  return one batch per call, loading the published weights of that batch's version first. The learner puts its
  weights into Ray's object store once per version (``ray.put``), as ``interop.sampling.workers.RolloutWorkers`` does
  (its docstring says why not TorchRL's ``RayWeightSyncScheme``: a gloo group of fixed size, which a replaced worker
  cannot rejoin).

The policy lag: batch ``k`` (counted from ``start_version``) is trained on when the learner holds version
``start_version + k - 1``, so it is sampled only once the learner holds at least ``start_version + k - 1 -
max_policy_lag``: with ``max_policy_lag=0`` (sync mode) every batch waits for the update before it; with 1 the next
batch is dispatched with the current weights right after each update and sampled while the learner trains. That is
``past_lag_bound="withhold"``; with ``"resample"`` (async mode only) each share samples up to ``max_policy_lag + 1``
batches ahead with whatever weights it has, and the learner throws away a part that arrives past the bound (counted)
and takes the share's next one, sampled with newer weights.

Faults: a worker that dies in the middle of a batch (its process SIGKILLed, its actor killed) is replaced, with a
warning naming it, and the replacement samples its share again from where its prompt stream stood (the batches it had
not delivered); a Ray worker whose node has left the cluster is dropped with a warning naming the node, and a
surviving worker builds that share's collector beside its own and samples both.

Dependencies: torch, tensordict; ``ray`` for the Ray backend.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict, TensorDictBase, set_list_to_stack

from interop.sampling.background import pushed_names
from interop.sampling.workers import PublishedWeights, RemoteWorker, kill_actor, node_alive
from interop.trl.rollout_func import PAST_LAG_BOUND
from recipes.common.rollout_backend import ROLLOUT_BACKENDS
from recipes.grpo.batch import POLICY_VERSION, merge_batches, response_mask
from recipes.grpo.collector_modes import BackgroundCollector, CollectorExited, timed_batches

__all__ = ["BACKENDS", "CollectorWorkers"]

log = logging.getLogger(__name__)

BACKENDS = tuple(name for name, backend in ROLLOUT_BACKENDS.items() if backend.apart_from_learner)
# How often one step may lose a worker before the run fails: a worker that dies at every try is a bug, not bad luck.
_MAX_RESTARTS_PER_STEP = 4
# Segments of a run (a replacement's collector) seed their sampling apart from the workers' seeds (seed + index).
_SEGMENT_SEED_STRIDE = 7919
_POLL_S = 0.5  # how often a replacement waiting for its place checks that the node it replaces is still there


def _collector_actor_class(ray):
    """The Ray actor a worker is: the collectors of one or more shares, each built from its factory, each returning
    one batch per call sampled by the weights of the version the call names."""

    class CollectorActor:
        def __init__(self, num_threads: int) -> None:
            torch.set_num_threads(num_threads)
            set_list_to_stack(True).set()
            self.shares: dict[int, dict] = {}

        def where(self) -> tuple[str, int]:
            return ray.get_runtime_context().get_node_id(), os.getpid()

        def build(self, share: int, factory: Callable, seed: int) -> None:
            collector, policy = factory()
            torch.manual_seed(seed)
            self.shares[share] = {
                "batches": timed_batches(collector, policy),
                "policy": policy,
                "version": None,
            }

        def sample(self, share: int, weights: list, version: int) -> tuple[dict, tuple, dict]:
            state = self.shares[share]
            if state["version"] != version:
                # Inside a list: fetched here, only when this share lacks the version; mapped out of the object store.
                ray.get(weights[0]).load_into(state["policy"].model, share=True)
                state["policy"].version.fill_(version)
                state["version"] = version
            batch, timings = next(state["batches"])
            return batch.to_dict(), tuple(batch.batch_size), timings

    return ray.remote(CollectorActor)


_Worker = RemoteWorker  # one worker and where it runs (for the warnings)


def _withheld(timings: list[dict]) -> dict[str, float]:
    """``withheld``: the share of a step's parts whose sampling waited for weights within the lag bound;
    ``withheld_s``: the longest such wait."""
    return {
        "withheld": sum(timing["withheld"] for timing in timings) / len(timings),
        "withheld_s": max(timing["withheld_s"] for timing in timings),
    }


class CollectorWorkers:
    """``workers`` TorchRL collectors apart from the learner, one batch of all of them per step.

    Args:
        factory_for: ``factory_for(worker=i, start_step=s)`` returns the picklable factory of collector ``i`` whose
            first batch is step ``s + 1``'s; the factory returns ``(collector, policy)`` as
            :class:`~recipes.grpo.collector_modes.BackgroundCollector`'s does.
        model: the learner's policy; its parameters (by name) are what the workers sample with.

    Keyword Args:
        backend: ``"processes"`` (local child processes) or ``"ray"`` (Ray actors on the connected cluster).
        workers: how many collectors (each a share of the step's responses).
        start_version: the updates ``model`` has had (a resumed run's step).
        max_policy_lag: the most updates a batch may be behind the learner when trained on (0: sync).
        past_lag_bound: what happens to a part that would be trained past ``max_policy_lag``: ``"withhold"`` (not
            sampled until the weights are recent enough) or ``"resample"`` (sampled ahead anyway; thrown away on
            arrival and the share's next part taken).
        num_threads: torch threads of each worker.
        seed: worker ``i`` samples with torch seed ``seed + i``.
        pad_token_id: what pads the parts to the widest one.
        resources: what each Ray worker takes (``interop.sampling.workers.WorkerResources``).
        dtype: what the factories' models sample in (``None``: the learner's): the weights are cast to it as they are
            pushed.
        timeout_s: how long the learner waits for a part before it gives up.

    Attributes:
        last_timings: the last batch's ``collect_s`` and ``generate_s``: its slowest part's (the parts are sampled at
            the same time).
        last_stats: the last batch's ``workers`` (alive), ``worker_restarts`` (during it),
            ``worker_<i>/tokens_per_s`` (response tokens per second of worker ``i``'s collection), ``resampled``
            (parts thrown away past the bound, in batches: parts / workers) and, with ``processes``, ``withheld`` and
            ``withheld_s`` (:func:`_withheld`).
        restarts: workers replaced since the start.
    """

    def __init__(
        self,
        factory_for: Callable[..., Callable],
        model: torch.nn.Module,
        *,
        backend: str,
        workers: int,
        start_version: int,
        max_policy_lag: int,
        num_threads: int,
        seed: int,
        pad_token_id: int,
        past_lag_bound: str = "withhold",
        resources=None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"CollectorWorkers: backend must be one of {BACKENDS}, got {backend!r}.")
        if workers < 1 or max_policy_lag < 0:
            raise ValueError(
                f"CollectorWorkers: need workers >= 1 and max_policy_lag >= 0, got workers={workers}, "
                f"max_policy_lag={max_policy_lag}."
            )
        if past_lag_bound not in PAST_LAG_BOUND:
            raise ValueError(
                f"CollectorWorkers: past_lag_bound must be one of {PAST_LAG_BOUND}, got {past_lag_bound!r}."
            )
        self.backend, self.timeout_s, self.dtype = backend, timeout_s, dtype
        self._factory_for, self._model = factory_for, model
        self._num_threads, self._seed, self._pad_token_id = num_threads, seed, pad_token_id
        self.start_version, self.version, self.max_policy_lag = start_version, start_version, max_policy_lag
        self.past_lag_bound = past_lag_bound
        self.shares = workers
        self.delivered = [0] * workers  # parts each share has handed over (those thrown away past the bound too)
        self.handed = 0  # batches handed to the learner: it trains the next one holding start_version + handed
        self.restarts = 0
        self.dropped_nodes: list[str] = []
        self.last_timings = {"collect_s": 0.0, "generate_s": 0.0}
        self.last_stats: dict[str, float] = {}
        self._workers: list[_Worker] = []
        self._stopped = False
        if backend == "ray":
            import ray

            self._ray = ray
            if not ray.is_initialized():
                raise RuntimeError("CollectorWorkers(backend='ray'): connect to a cluster first (ray.init).")
            self._actor_class = _collector_actor_class(ray)
            self._resources = resources
            self._weights_ref = ray.put(self._state())
            self._host: dict[int, _Worker] = {}  # share -> the worker sampling it
            self._in_flight = {share: collections.deque() for share in range(workers)}
        try:
            self._start_all()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------------ workers

    def _start_version(self, share: int) -> int:
        """The version the learner holds when share ``share``'s next undelivered batch is trained on."""
        return self.start_version + self.delivered[share]

    def _share_seed(self, share: int) -> int:
        return self._seed + share + _SEGMENT_SEED_STRIDE * (self._start_version(share) - self.start_version)

    def _factory(self, share: int) -> Callable:
        return self._factory_for(worker=share, start_step=self._start_version(share))

    def _start_all(self) -> None:
        if self.backend == "processes":
            for share in range(self.shares):
                self._workers.append(self._start_process(share, wait_ready=False))
            for worker in self._workers:  # the children build their collectors at the same time
                worker.handle.wait_until_ready()
            return
        self._workers = [self._start_actor(index) for index in range(self.shares)]
        building = [self._build(share, self._workers[share]) for share in range(self.shares)]
        self._wait(building)
        self._submit_due()

    def _start_process(self, share: int, *, wait_ready: bool = True) -> _Worker:
        collector = BackgroundCollector(
            self._factory(share),
            self._model,
            start_version=self._start_version(share),
            max_policy_lag=self.max_policy_lag,
            past_lag_bound=self.past_lag_bound,
            num_threads=self._num_threads,
            seed=self._share_seed(share),
            timeout_s=self.timeout_s,
            wait_ready=wait_ready,
            dtype=self.dtype,
        )
        return _Worker(share, collector, "this machine", collector.pid)

    def _start_actor(self, index: int, *, unless_lost: str | None = None) -> _Worker | None:
        """A new worker actor, placed by Ray. ``unless_lost``: the node of the worker it replaces; if that node turns
        out to have left the cluster while the new actor waits for a place (the cluster may learn of a node's loss
        after the actor's), the new one is given up and ``None`` returned."""
        resources = self._resources
        options = {"max_restarts": 0}  # replaced by this class, which samples the share again and counts it
        if resources is not None:
            options.update(
                num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, resources=dict(resources.resources) or None
            )
        actor = self._actor_class.options(**options).remote(self._num_threads)
        where = actor.where.remote()
        deadline = time.monotonic() + self.timeout_s
        while not self._ray.wait([where], timeout=_POLL_S)[0]:
            if unless_lost is not None and not node_alive(unless_lost):
                kill_actor(actor)
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"CollectorWorkers: no Ray worker started within {self.timeout_s:.0f} s.")
        node, pid = self._ray.get(where)
        return _Worker(index, actor, node, pid)

    def _build(self, share: int, worker: _Worker):
        """Share ``share``'s collector built on ``worker`` (from where its prompt stream stands); its batches in
        flight elsewhere are dropped (sampled again)."""
        self._host[share] = worker
        self._in_flight[share].clear()
        return worker.handle.build.remote(share, self._factory(share), self._share_seed(share))

    def _wait(self, futures):
        try:
            return self._ray.get(futures, timeout=self.timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"CollectorWorkers: no answer from the Ray workers within {self.timeout_s:.0f} s."
            ) from None

    @property
    def workers(self) -> int:
        """The workers alive."""
        return len(self._workers)

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids (local processes, or the Ray actors' on their nodes)."""
        return [worker.pid for worker in self._workers]

    @property
    def actors(self) -> list:
        """The Ray workers' actor handles."""
        return [worker.handle for worker in self._workers]

    @property
    def nodes(self) -> list[str]:
        """Where each worker runs (Ray node ids)."""
        return [worker.node for worker in self._workers]

    # ------------------------------------------------------------------------------------------------ batches

    def _allowed(self, batch: int) -> bool:
        """Whether batch ``batch`` (1-based since ``start_version``) may be sampled with the current weights."""
        return self.version >= self.start_version + batch - 1 - self.max_policy_lag

    def _may_submit(self, share: int) -> bool:
        in_flight = len(self._in_flight[share])
        if self.past_lag_bound == "resample":  # as far ahead as a local collector's queue lets it run
            return in_flight <= self.max_policy_lag
        return self._allowed(self.delivered[share] + in_flight + 1)

    def _submit_due(self) -> None:
        for share, in_flight in self._in_flight.items():
            while self._may_submit(share):
                worker = self._host[share]
                in_flight.append(worker.handle.sample.remote(share, [self._weights_ref], self.version))

    def _receive(self, share: int) -> tuple[TensorDictBase, dict, _Worker]:
        if self.backend == "processes":
            worker = self._workers[share]
            batch = worker.handle.next()
            return batch, worker.handle.last_timings, worker
        worker = self._host[share]
        data, batch_size, timings = self._wait(self._in_flight[share][0])
        self._in_flight[share].popleft()
        # Ray hands tensors over read-only, out of its object store: the learner writes into its batch.
        return TensorDict(data, batch_size=batch_size).clone(), timings, worker

    def _died(self) -> tuple[type[BaseException], ...]:
        if self.backend == "processes":
            return (CollectorExited,)
        # A batch too large to travel inline is kept on its worker's node, lost with it.
        return (self._ray.exceptions.RayActorError, self._ray.exceptions.ObjectLostError)

    def __iter__(self) -> Iterator[TensorDictBase]:
        while True:
            yield self.next()

    def next(self) -> TensorDictBase:
        """The next step's batch: every share's part, in share order, each within the lag bound."""
        parts, timings, seconds, tokens = [], [], {}, {}
        restarts = resampled = 0
        trained_at = self.start_version + self.handed  # the version the learner holds when it trains this batch
        for share in range(self.shares):
            while True:
                part, timing, worker, restarts = self._next_part(share, restarts)
                seconds[worker.index] = seconds.get(worker.index, 0.0) + timing["collect_s"]
                tokens[worker.index] = tokens.get(worker.index, 0) + int(response_mask(part).sum())
                stale = trained_at - int(part[POLICY_VERSION].min()) > self.max_policy_lag
                if not (stale and self.past_lag_bound == "resample"):  # withhold: the recipe refuses a stale one
                    break
                resampled += 1  # thrown away; the share's next part is sampled with newer weights
                if self.backend == "ray":
                    self._submit_due()
            parts.append(part)
            timings.append(timing)
        self.handed += 1
        if self.backend == "ray":
            self._submit_due()
        self.last_timings = max(timings, key=lambda timing: timing["collect_s"])
        self.last_stats = {
            "workers": float(len(self._workers)),
            "worker_restarts": float(restarts),
            "resampled": resampled / self.shares,
            # How long the parts were held back for the lag bound (the longest part's; local processes only: a Ray
            # part is held back by the learner, which submits it once the bound allows).
            **(_withheld(timings) if self.backend == "processes" else {}),
            **{f"worker_{index}/tokens_per_s": tokens[index] / max(seconds[index], 1e-9) for index in sorted(tokens)},
        }
        return merge_batches(parts, pad_token_id=self._pad_token_id)

    def _next_part(self, share: int, restarts: int) -> tuple[TensorDictBase, dict, _Worker, int]:
        """Share ``share``'s next part, its timings and worker, and the step's restarts so far (a worker that dies
        while sampling it is replaced and samples it again)."""
        while True:
            try:
                part, timing, worker = self._receive(share)
                self.delivered[share] += 1
                return part, timing, worker, restarts
            except self._died() as error:
                restarts += 1
                if restarts > _MAX_RESTARTS_PER_STEP:
                    raise RuntimeError(
                        f"CollectorWorkers: workers died {restarts} times during one step; the last: {error}"
                    ) from error
                self._recover(share, error)

    def update_policy_weights_(self, model: torch.nn.Module, *, version: int) -> None:
        """Publishes ``model``'s parameters as policy ``version`` (the number of updates it has had)."""
        self.version = version
        if self.backend == "processes":
            for worker in self._workers:
                worker.handle.update_policy_weights_(model, version=version)
            return
        self._weights_ref = self._ray.put(self._state(model))  # once per version, whatever the number of workers
        self._submit_due()

    def _state(self, model: torch.nn.Module | None = None) -> PublishedWeights:
        model = self._model if model is None else model
        return PublishedWeights(model, dtype=self.dtype, names=pushed_names(model))

    # ------------------------------------------------------------------------------------------------ faults

    def _recover(self, share: int, error: BaseException) -> None:
        """The worker sampling ``share`` died: replaced (its shares sampled again from where they stood), or, a Ray
        worker whose node left the cluster, dropped and its shares handed to the others."""
        self.restarts += 1
        if self.backend == "processes":
            worker = self._workers[share]
            self._warn_replaced(worker, error)
            worker.handle.shutdown()
            self._workers[share] = self._start_process(share)
            return
        worker = self._host[share]
        hosted = [other for other, host in self._host.items() if host is worker]
        position = self._workers.index(worker)
        self._stop(worker)
        replacement = None
        if node_alive(worker.node):
            replacement = self._start_actor(worker.index, unless_lost=worker.node)
        if replacement is not None:
            self._warn_replaced(worker, error)
            self._workers[position] = replacement
            self._wait([self._build(other, replacement) for other in hosted])
        else:
            self._workers.pop(position)
            self.dropped_nodes.append(worker.node)
            if not self._workers:
                raise RuntimeError(f"CollectorWorkers: no worker left (the last one's node {worker.node} left).")
            log.warning(
                "CollectorWorkers: worker %d's node %s left the Ray cluster; its share of each step goes to the %d "
                "remaining worker(s).",
                worker.index,
                worker.node,
                len(self._workers),
            )
            building = []
            for other in hosted:
                host = min(self._workers, key=lambda alive: sum(h is alive for h in self._host.values()))
                building.append(self._build(other, host))
            self._wait(building)
        self._submit_due()

    def _warn_replaced(self, worker: _Worker, error: BaseException) -> None:
        log.warning(
            "CollectorWorkers: worker %d (pid %s on %s) died during a batch (%s); started another, which samples its "
            "share again.",
            worker.index,
            worker.pid,
            worker.node,
            type(error).__name__,
        )

    def _stop(self, worker: _Worker) -> None:
        if self.backend == "processes":
            worker.handle.shutdown()
            return
        kill_actor(worker.handle)

    def shutdown(self) -> None:
        """Stops every worker (local processes joined, Ray actors killed)."""
        if self._stopped:
            return
        self._stopped = True
        for worker in self._workers:
            self._stop(worker)
