"""The GRPO recipe's two ways to run a TorchRL collector, behind one interface: in the learner's process, or in a
child process one batch ahead of the learner, with a bound on the policy lag.

Both iterate dense batches, take the learner's weights with ``update_policy_weights_(model, version=...)``, report
how long the last batch took (``last_timings``: ``collect_s``, of which ``generate_s`` in the policy) and stop with
``shutdown()``.

:class:`LocalCollector` iterates the collector in the learner's process, with the learner's own model.

:class:`BackgroundCollector` starts a process that builds a TorchRL collector (env + policy + reward, from a
picklable factory) and iterates it: while the learner updates the policy on batch ``t``, the child generates batch
``t + 1``. The learner pushes its weights after every update (:meth:`BackgroundCollector.update_policy_weights_`);
the child loads the newest ones before each batch, between batches only, so every batch is sampled by one version of
the policy. What it does with a batch that would be more than ``max_policy_lag`` updates old when trained on is
``past_lag_bound``: ``"withhold"`` (never started until the weights are recent enough: ``last_timings["withheld"]``,
whether it was, and ``"withheld_s"``, how long) or ``"resample"`` (sampled at once with the weights it has, up to
``max_policy_lag + 1`` batches ahead; the learner throws away one that arrives past the bound and takes the next:
``recipes.grpo.collector_workers``).
Each batch carries the version it was sampled with (``"policy_version"``, written by the policy module), from which
the learner measures the lag.

The child is forked from Python's fork server by default (the library's ``interop.sampling.child_processes``, with
this recipe's modules preloaded: the first collector of a process waits for the server's imports, every later one, as
in a sweep's next job, starts in well under a second); ``start_method="spawn"`` starts each as a new Python.

Process hygiene: the child dies with its parent (``PR_SET_PDEATHSIG`` on Linux, set before it imports anything
heavy: ``interop.sampling._child``; with the fork server its parent is the server, which dies with the learner; and a
check of the learner at every wait), a failure in the child is raised in the learner with the child's traceback, and
:meth:`shutdown` (also on a learner crash, from a ``finally``) stops and joins it. The fork server is a process
multiprocessing starts with the first child and stops when the learner's process exits.

Several of them feed one learner with ``rollout.backend=processes`` (``recipes.grpo.collector_workers``, which
replaces one whose process died: :class:`CollectorExited`).

Dependencies: torch, tensordict.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, set_list_to_stack

from interop.sampling.background import pushed_names
from interop.sampling.child_processes import child_context, start_child
from interop.trl.rollout_func import PAST_LAG_BOUND
from recipes.grpo import collector_child

__all__ = ["BackgroundCollector", "CollectorExited", "LocalCollector", "collect", "timed_batches"]

_POLL_S = 0.5  # how often a waiting side checks that the other is still alive


class CollectorExited(RuntimeError):
    """The collector process is gone (killed, or crashed outside Python) without a batch or an error: what a pool of
    collectors (``recipes.grpo.collector_workers``) replaces, unlike an error the collector raised."""


class _ForwardClock:
    """Adds up the time spent in a module's forward, through hooks (the module itself is not changed)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._started = 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, module, args) -> None:
        self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._started


def timed_batches(collector, policy: torch.nn.Module) -> Iterator[tuple[TensorDictBase, dict[str, float]]]:
    """``collector``'s batches, each with how long it took: ``collect_s`` in all, ``generate_s`` in ``policy``."""
    clock = _ForwardClock(policy)
    stream = iter(collector)
    while True:
        clock.seconds = 0.0
        start = time.perf_counter()
        batch = next(stream)
        yield batch, {"collect_s": time.perf_counter() - start, "generate_s": clock.seconds}


class LocalCollector:
    """A TorchRL collector iterated in the learner's process: the policy samples with the learner's model itself, so
    publishing weights only records their version (what the policy writes into every batch).

    Args:
        collector: an iterable of batches (a TorchRL collector).
        policy: the policy module it steps (timed).
        version: the tensor the policy writes into every batch as ``"policy_version"``.
    """

    def __init__(self, collector, policy: torch.nn.Module, version: torch.Tensor) -> None:
        self.collector = collector
        self.policy = policy
        self.version = version
        self.last_timings = {"collect_s": 0.0, "generate_s": 0.0}
        self.last_stats: dict[str, float] = {}  # no sampling workers to report on
        self._batches = timed_batches(collector, policy)

    def __iter__(self) -> Iterator[TensorDictBase]:
        for batch, timings in self._batches:
            self.last_timings = timings
            yield batch

    def update_policy_weights_(self, model: torch.nn.Module, *, version: int) -> None:
        self.version.fill_(version)

    def shutdown(self) -> None:
        self.collector.shutdown()
        # A tool-calling policy's ToolRunner holds a worker process (in the background mode it dies with its child).
        runner = getattr(self.policy, "runner", None)
        if runner is not None:
            runner.close()


def _parent_alive() -> bool:
    """Whether the learner lives (``parent_process()`` is the process that started this one, also when the fork
    server forked it)."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def collect(
    factory: Callable[[], tuple[Any, Any]],
    weights: dict[str, torch.Tensor],
    version,
    lock,
    wake,
    batches,
    stop,
    *,
    start_version: int,
    max_policy_lag: int,
    past_lag_bound: str,
    num_threads: int,
    seed: int,
) -> None:
    """The child: builds the collector, then produces batches under the lag bound until told to stop (its process
    starts in ``interop.sampling._child.run``, which set it to die with its parent, then
    ``recipes.grpo.collector_child.start``)."""
    torch.set_num_threads(num_threads)
    set_list_to_stack(True).set()
    try:
        collector, policy = factory()
        parameters = dict(policy.model.named_parameters())
        batches.put(("ready", None, None))
        torch.manual_seed(seed)
        stream = timed_batches(collector, policy)
        for index in range(1, sys.maxsize):
            # Batch `index` is trained on when the learner holds version start_version + index - 1: withhold keeps
            # it until the weights are recent enough, never sampled past the bound (resample samples it now).
            oldest_allowed = start_version + index - 1 - max_policy_lag
            started = time.perf_counter()
            withheld = past_lag_bound == "withhold" and version.value < oldest_allowed
            while withheld and version.value < oldest_allowed:
                if stop.is_set() or not _parent_alive():
                    return
                wake.acquire(timeout=_POLL_S)  # released by the learner at every update
            held_s = time.perf_counter() - started if withheld else 0.0
            with lock, torch.no_grad():  # the weights and their version, as the learner published them together
                for name, tensor in weights.items():
                    parameters[name].copy_(tensor)
                policy.version.fill_(version.value)
            batch, timings = next(stream)
            timings = {**timings, "withheld": float(withheld), "withheld_s": held_s}
            payload = ("batch", (batch.to_dict(), timings), tuple(batch.batch_size))
            while True:
                if stop.is_set() or not _parent_alive():
                    return
                try:
                    batches.put(payload, timeout=_POLL_S)
                    break
                except queue_module.Full:
                    continue
    except BaseException:  # noqa: BLE001 - everything goes to the learner, which raises it
        batches.put(("error", traceback.format_exc(), None))


class BackgroundCollector:
    """Iterates a TorchRL collector that runs in a child process while the learner trains.

    Args:
        factory: a picklable callable (e.g. a ``functools.partial`` of a module-level function) that, in the child,
            returns ``(collector, policy)``: an iterable of batches and the policy module that samples them, with the
            causal LM at ``policy.model`` and a ``version`` buffer it writes into every batch.
        model: the learner's copy of the policy's causal LM; its parameters (by name) are what the child samples
            with.

    Keyword Args:
        start_version: the number of updates ``model`` has had (a resumed run's step).
        max_policy_lag: the most updates a batch may be behind the learner when it is trained on; 1 lets the child
            generate batch ``t + 1`` while the learner trains on batch ``t``.
        past_lag_bound: ``"withhold"``: a batch that would be trained past ``max_policy_lag`` is not started until
            the weights are recent enough; ``"resample"``: every batch is sampled at once with the newest weights the
            child has (the learner throws away one past the bound).
        num_threads: torch threads of the child.
        seed: the child's torch seed.
        timeout_s: how long the learner waits for a batch before it gives up.
        wait_ready: wait here until the child has built its collector; ``False`` returns at once (call
            :meth:`wait_until_ready`), so that several children build theirs at the same time.
        dtype: what the factory's model samples in (``None``: ``model``'s): the shared weights are kept in it, cast
            as they are pushed.
        start_method: ``"forkserver"`` (the child forked from the fork server, which imports this module, the
            factory's and the model's once per process) or ``"spawn"`` (a new Python).
    """

    def __init__(
        self,
        factory: Callable[[], tuple[Any, Any]],
        model: torch.nn.Module,
        *,
        start_version: int,
        max_policy_lag: int = 1,
        past_lag_bound: str = "withhold",
        num_threads: int = 1,
        seed: int = 0,
        timeout_s: float = 1800.0,
        wait_ready: bool = True,
        dtype: torch.dtype | None = None,
        start_method: str = "forkserver",
    ) -> None:
        if max_policy_lag < 0:
            raise ValueError(f"BackgroundCollector: max_policy_lag must be >= 0, got {max_policy_lag}.")
        if past_lag_bound not in PAST_LAG_BOUND:
            raise ValueError(
                f"BackgroundCollector: past_lag_bound must be one of {PAST_LAG_BOUND}, got {past_lag_bound!r}."
            )
        preload = ["recipes.grpo.collector_modes", getattr(factory, "func", factory).__module__, type(model).__module__]
        context = child_context(start_method, preload=preload)
        self._weights = {
            name: p.detach().to("cpu", dtype=dtype or p.dtype, copy=True).share_memory_()
            for name, p in model.named_parameters()
        }
        # Where the model freezes some weights (LoRA's base), the child's collector has them already: pushed once.
        self._pushed = pushed_names(model)
        self._version = context.Value("q", start_version, lock=False)
        # A lock and a semaphore, not a Condition: a Condition's notify waits for every sleeper to wake, and a child
        # killed while waiting never does; a semaphore's release never waits.
        self._lock = context.Lock()
        self._wake = context.Semaphore(0)
        self._batches = context.Queue(maxsize=max_policy_lag + 1)
        self._stop = context.Event()
        self.timeout_s = timeout_s
        self.max_policy_lag = max_policy_lag
        self.last_timings = {"collect_s": 0.0, "generate_s": 0.0}
        self._stopped = False
        # The process gets only light arguments (the pipe and the synchronisation primitives, which can only be
        # inherited): it sets its parent-death signal before the factory and the shared weights, whose unpickling
        # imports torch and the recipe's modules, come through the pipe.
        receiving, sending = context.Pipe(duplex=False)
        self.process = start_child(
            context,
            collector_child.start,
            (receiving, self._version, self._lock, self._wake, self._batches, self._stop),
            name="grpo-collector",
        )
        receiving.close()
        options = {
            "start_version": start_version,
            "max_policy_lag": max_policy_lag,
            "past_lag_bound": past_lag_bound,
            "num_threads": num_threads,
        }
        sending.send((factory, self._weights, {**options, "seed": seed}))
        sending.close()
        self._pid = self.process.pid
        if wait_ready:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Waits for the child to have built its collector (imports, models: seconds of setup, not of the first
        step's collection); raises its error if it could not."""
        try:
            kind, payload, _ = self._receive()
        except CollectorExited:
            self.shutdown()
            raise
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"BackgroundCollector: the collector process failed to start:\n{payload}")

    def __iter__(self) -> Iterator[TensorDictBase]:
        while True:
            yield self.next()

    def next(self) -> TensorDictBase:
        """The next batch, as soon as the child has it."""
        kind, payload, batch_size = self._receive()
        if kind == "error":
            raise RuntimeError(f"BackgroundCollector: the collector process failed:\n{payload}")
        data, self.last_timings = payload
        return TensorDict(data, batch_size=batch_size)

    def _receive(self) -> tuple[str, Any, Any]:
        waited = 0.0
        while True:
            try:
                return self._batches.get(timeout=_POLL_S)
            except (OSError, EOFError) as error:
                # A batch's tensors travel as file descriptors the child hands out: one it queued before it was
                # killed cannot be read any more.
                raise CollectorExited(
                    f"BackgroundCollector: a batch of the collector process could not be read ({error!r}); the "
                    f"process {'exited' if not self.process.is_alive() else 'is unreachable'}."
                ) from error
            except queue_module.Empty:
                waited += _POLL_S
                if not self.process.is_alive():
                    raise CollectorExited(
                        f"BackgroundCollector: the collector process exited (code {self.process.exitcode}) "
                        "without a batch or an error; see its output above."
                    ) from None
                if waited > self.timeout_s:
                    raise TimeoutError(f"BackgroundCollector: no batch within {self.timeout_s:.0f} s.") from None

    def update_policy_weights_(self, model: torch.nn.Module, *, version: int) -> None:
        """Publishes ``model``'s parameters as policy ``version`` (the number of updates it has had). A child that
        died gets nothing (its death is raised by :meth:`next`)."""
        if not self._lock_while_alive():
            return
        try:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if self._pushed is None or name in self._pushed:
                        self._weights[name].copy_(p.detach())  # cast to the sampler's dtype here, once per push
            self._version.value = version
        finally:
            self._lock.release()
        self._wake.release()

    def _lock_while_alive(self) -> bool:
        """Takes the weights' lock, unless the child is dead: a child killed while holding it never releases it."""
        while not self._lock.acquire(timeout=_POLL_S):
            if not self.process.is_alive():
                return False
        return True

    def shutdown(self) -> None:
        """Stops the child and waits for it (killing it if it has not stopped within a few seconds)."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.is_alive():  # an Event takes a lock the child shares: one killed holding it never lets go
            self._stop.set()
        self._wake.release()
        deadline = time.monotonic() + 5.0
        while self.process.is_alive() and time.monotonic() < deadline:
            try:  # a child blocked on a full queue gets room at once
                self._batches.get(timeout=0.05)
            except queue_module.Empty:
                pass
            except (OSError, EOFError):  # a batch whose sender already exited cannot be unpickled: dropped anyway
                pass
            self.process.join(timeout=0.05)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._batches.close()
        self._batches.cancel_join_thread()
        self.process.close()
        # The queue, lock, semaphore and event hold named semaphores: released now rather than reported as leaked at
        # exit.
        del self._batches, self._lock, self._wake, self._stop

    @property
    def pid(self) -> int | None:
        """The collector process's id."""
        return self._pid
