"""Sampling in a child process while the caller trains: what lets ``TorchRLRolloutFunc(mode="async")`` sample trl's
next generation batch during trl's update on the current one.

Public names:

- :class:`BackgroundSampler`: a copy of a causal LM, on shared memory, that a child process samples with
  (:class:`~interop.sampling.CausalLMSampler`). The caller publishes its weights (:meth:`BackgroundSampler.publish`,
  a copy into the shared tensors, tagged with a version) and submits left-padded prompt ids
  (:meth:`BackgroundSampler.submit`); :meth:`BackgroundSampler.result` waits for the rollout. One request at a
  time: weights are only written while the child is idle, so every rollout is sampled by one version of the weights.

The child is forked from Python's fork server by default, which imports torch, tensordict and transformers once per
process (``interop.sampling.child_processes``: the server is a process multiprocessing starts with the first child and
stops when the caller's process exits); ``start_method="spawn"`` starts each child as a new Python.

Process hygiene: the child dies with its parent (``PR_SET_PDEATHSIG`` on Linux, set before it imports anything heavy:
``interop.sampling._child``; with the fork server its parent is the server, which dies with the caller), a failure in
the child is raised in the caller with the child's traceback, and :meth:`BackgroundSampler.close` stops and joins it
(also at interpreter exit).

Dependencies: torch, tensordict, and the ``transformers`` model the caller passes in.
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from interop.sampling import _child
from interop.sampling.child_processes import child_context, start_child
from interop.sampling.rollouts import RolloutSampler
from interop.sampling.sampler import SamplingSettings

__all__ = [
    "BackgroundSampler",
    "SamplerExited",
    "build_rollout_sampler",
    "pushed_names",
    "sampler_options",
    "sampler_tokenizer",
    "serve",
]

_POLL_S = 0.25  # how often a waiting side checks that the other is still alive


def pushed_names(model: torch.nn.Module) -> frozenset[str] | None:
    """The weights a push must carry: where ``model`` freezes some (LoRA: the base under its adapters), only the ones
    that train, since a sampler's copy already holds the others and no update changes them; ``None``: all of them.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> pushed_names(model) is None
    True
    >>> _ = model[0].requires_grad_(False)
    >>> sorted(pushed_names(model))
    ['1.bias', '1.weight']
    """
    trained = frozenset(name for name, parameter in model.named_parameters() if parameter.requires_grad)
    return trained if 0 < len(trained) < len(list(model.parameters())) else None


class SamplerExited(RuntimeError):
    """The sampling process is gone (killed, or crashed outside Python) without answering: what a caller that runs
    several samplers (``interop.sampling.workers.RolloutWorkers``) restarts, unlike an error the sampler raised."""


class _TokenIds:
    """What the child needs of the tokenizer: its pad and EOS ids (the caller tokenizes; the child only samples)."""

    def __init__(self, tokenizer) -> None:
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token = getattr(tokenizer, "pad_token", None)
        self.eos_token = getattr(tokenizer, "eos_token", None)


def sampler_tokenizer(tokenizer, dialogs: dict | None):
    """What of the tokenizer a sampler apart from the trainer needs: its pad and EOS ids (the caller tokenizes); the
    whole tokenizer for dialogs, which render tool messages with the chat template."""
    return _TokenIds(tokenizer) if dialogs is None else tokenizer


def sampler_options(
    *,
    settings: SamplingSettings,
    log_probs_at_temperature: bool,
    eos_token_ids: Sequence[int],
    num_threads: int,
    seed: int,
    dialogs: dict | None,
) -> dict:
    """The picklable description of a sampler that :func:`build_rollout_sampler` builds (see
    :class:`BackgroundSampler`'s arguments of the same names)."""
    return {
        "settings": settings,
        "log_probs_at_temperature": log_probs_at_temperature,
        "eos_token_ids": list(eos_token_ids),
        "num_threads": num_threads,
        "seed": seed,
        "dialogs": dialogs,
    }


class BackgroundSampler:
    """A causal LM sampling in a child process, on weights the caller publishes.

    Args:
        model: the model being trained; a copy of it, on shared CPU memory, is what the child samples with.
        tokenizer: its tokenizer (only the pad and EOS ids reach the child).

    Keyword Args:
        settings: the :class:`~interop.sampling.SamplingSettings`.
        dialogs: with tools, the child samples dialogs (:class:`~interop.tools.dialogs.DialogSampler`) and runs the
            calls in a tool worker of its own: ``tools`` (the functions), ``timeout_s``, ``max_result_tokens``,
            ``max_turns``, ``max_completion_tokens``, ``chat_template_kwargs``. ``None``: single-turn completions.
        log_probs_at_temperature: as :class:`~interop.sampling.CausalLMSampler`'s.
        eos_token_ids: the ids that end a response.
        num_threads: torch threads of the child (1: on a busy CPU the trainer and the sampler each keep a core).
        seed: the child's torch seed.
        timeout_s: how long :meth:`result` waits before it gives up.
        start_method: ``"forkserver"``: the child is forked from this process's fork server, which imports the
            sampler's modules once (the first child's start waits for them; later ones start in well under a second);
            ``"spawn"``: each child a new Python that imports them again (``interop.sampling.child_processes``).

    Examples:
        A sketch (the child takes a few seconds to start)::

            sampler = BackgroundSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=16))
            sampler.publish(model, version=0)
            sampler.submit([[5, 6, 7], [5, 8]])
            ...  # train meanwhile
            rollout, version = sampler.result()  # completion_ids, logprobs... sampled by version 0
            sampler.close()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        settings: SamplingSettings,
        log_probs_at_temperature: bool = False,
        eos_token_ids: Sequence[int],
        num_threads: int = 1,
        seed: int = 0,
        timeout_s: float = 1800.0,
        dialogs: dict | None = None,
        start_method: str = "forkserver",
    ) -> None:
        # What the child imports: its entry and the sampler, the model's class (and for dialogs, the tokenizer's and
        # the tool modules).
        modules = ["interop.sampling.background", type(model).__module__]
        if dialogs is not None:
            modules += ["interop.tools.dialogs", "interop.tools.runner", type(tokenizer).__module__]
        context = child_context(start_method, preload=modules)
        # The shared copy: the child's model aliases these tensors; publish() copies the trained weights into them.
        self._shared = copy.deepcopy(model).to("cpu").eval()
        self._shared.requires_grad_(False)
        self._shared.share_memory()
        self._shared_tensors = dict(self._shared.state_dict(keep_vars=True))
        self.timeout_s = timeout_s
        self.version: int | None = None
        self._waiting = False
        self._closed = False
        self._connection, child_connection = context.Pipe()
        self.process = start_child(context, _child.start, (child_connection,))
        child_connection.close()
        self._connection.send(
            (
                self._shared,
                sampler_tokenizer(tokenizer, dialogs),
                sampler_options(
                    settings=settings,
                    log_probs_at_temperature=log_probs_at_temperature,
                    eos_token_ids=eos_token_ids,
                    num_threads=num_threads,
                    seed=seed,
                    dialogs=dialogs,
                ),
            )
        )
        # Not waited for here: the child's start (the model, and a spawned child's imports) overlaps whatever the
        # caller does next; the first submit() waits for it. (The first child forked from this process's fork server
        # waited in start_child for the server's imports, about 3 s, that a spawned child makes after its start: its
        # callers, TorchRLRolloutFunc.prepare and RolloutWorkers, wait for it to be ready at once anyway.)
        self._ready = False
        # Stopped when closed, garbage collected, or at interpreter exit (weakref.finalize runs then too).
        self._finalizer = weakref.finalize(self, BackgroundSampler._stop, self.process, self._connection)

    def publish(self, model: torch.nn.Module, *, version: int) -> None:
        """Copies ``model``'s weights into the child's (by name, cast to its copy's dtype), as ``version`` (the
        updates they have had); only the ones that train where ``model`` freezes others (:func:`pushed_names`)."""
        if self._waiting:
            raise RuntimeError("BackgroundSampler.publish: a rollout is being sampled; wait for result() first.")
        names = pushed_names(model)
        with torch.no_grad():
            for name, value in model.state_dict().items():
                if names is not None and name not in names:
                    continue
                target = self._shared_tensors.get(name)
                if target is None:
                    raise KeyError(f"BackgroundSampler.publish: the sampler's model has no {name!r}.")
                target.copy_(value.detach())
        self.version = version

    def submit(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        """Starts sampling one completion per prompt (token ids, unpadded) with the published weights."""
        if self._waiting:
            raise RuntimeError("BackgroundSampler.submit: one request at a time; wait for result() first.")
        if self.version is None:
            raise RuntimeError("BackgroundSampler.submit: publish() the weights first.")
        self.wait_until_ready()
        self._connection.send(("sample", [list(map(int, row)) for row in prompt_ids]))
        self._waiting = True

    def wait_until_ready(self) -> None:
        """Waits for the child to have started (imports, the model); :meth:`submit` does, the first time."""
        if self._ready:
            return
        kind, payload = self._receive()
        if kind != "ready":
            raise RuntimeError(f"BackgroundSampler: the sampler process failed to start:\n{payload}")
        self._ready = True

    @property
    def busy(self) -> bool:
        """Whether a submitted rollout has not been collected yet."""
        return self._waiting

    def result(self) -> tuple[TensorDict, int]:
        """The submitted request's rollout (as ``interop.TorchRLRolloutFunc.rollout`` lays it out, with ``sample_s``,
        the child's sampling time) and the weights' version, once the child has it."""
        if not self._waiting:
            raise RuntimeError("BackgroundSampler.result: nothing was submitted.")
        kind, payload = self._receive()
        self._waiting = False
        if kind == "error":
            raise RuntimeError(f"BackgroundSampler: the sampler process failed:\n{payload}")
        data, batch_size, seconds = payload
        rollout = TensorDict(data, batch_size=batch_size)
        rollout.set("sample_s", torch.full(batch_size, seconds))
        assert self.version is not None  # submit() refuses to start before publish()
        return rollout, self.version

    def _receive(self) -> tuple[str, Any]:
        waited = 0.0
        while not self._connection.poll(_POLL_S):
            waited += _POLL_S
            if not self.process.is_alive():
                raise SamplerExited(
                    f"BackgroundSampler: the sampler process exited (code {self.process.exitcode}) without an answer; "
                    "see its output above."
                )
            if waited > self.timeout_s:
                raise TimeoutError(f"BackgroundSampler: no rollout within {self.timeout_s:.0f} s.")
        try:
            return self._connection.recv()
        except (EOFError, ConnectionError) as error:  # the child's end closed: it is gone
            raise SamplerExited(
                f"BackgroundSampler: the sampler process ended (code {self.process.exitcode}) without an answer."
            ) from error

    @staticmethod
    def _stop(process, connection) -> None:
        with contextlib.suppress(Exception):
            connection.send(None)
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
        with contextlib.suppress(Exception):
            connection.close()

    def close(self) -> None:
        """Stops the child and waits for it (killing it if it has not stopped within a few seconds)."""
        if self._closed:
            return
        self._closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            self._stop(self.process, self._connection)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def model(self) -> torch.nn.Module:
        """The shared copy the child samples with: the weights last published."""
        return self._shared


def _dialog_rollout_sampler(model, tokenizer, options: dict) -> RolloutSampler:
    """The child's sampler for tools: an :class:`~interop.tools.dialogs.DialogSampler` on the shared model, its calls
    answered by a tool worker of the child's own (a ``ToolRunner`` cannot be pickled; its functions can)."""
    from interop.tools.dialogs import DialogSampler
    from interop.tools.runner import ToolRunner

    dialogs = options["dialogs"]
    runner = ToolRunner(
        dialogs["tools"],
        timeout_s=dialogs["timeout_s"],
        max_result_tokens=dialogs["max_result_tokens"],
        tokenizer=tokenizer,
    )
    policy = DialogSampler(
        model,
        tokenizer,
        runner,
        settings=options["settings"],
        max_turns=dialogs["max_turns"],
        max_completion_tokens=dialogs["max_completion_tokens"],
        stop_at_call_end=False,
        eos_token_ids=options["eos_token_ids"],
        log_probs_at_temperature=options["log_probs_at_temperature"],
        chat_template_kwargs=dialogs["chat_template_kwargs"],
    )
    return RolloutSampler(policy, tokenizer, model=model, dialogs=True)


def build_rollout_sampler(model: torch.nn.Module, token_ids, options: dict) -> RolloutSampler:
    """What a sampler apart from the trainer samples with: the sync rollout core
    (:class:`~interop.sampling.rollouts.RolloutSampler`, as ``TorchRLRolloutFunc`` samples in the trainer's process)
    around ``model`` (a :class:`~interop.sampling.CausalLMSampler`, or a dialog sampler with a tool worker of its own
    when ``options["dialogs"]`` names tools), with the torch threads and seed ``options`` gives. The child process of
    :class:`BackgroundSampler` and each Ray worker of ``interop.sampling.workers`` build theirs here."""
    from tensordict import set_list_to_stack

    from interop.sampling.sampler import CausalLMSampler

    set_list_to_stack(True).set()
    torch.set_num_threads(options["num_threads"])
    torch.manual_seed(options["seed"])
    if options["dialogs"] is not None:
        return _dialog_rollout_sampler(model, token_ids, options)
    sampler = CausalLMSampler(
        model,
        token_ids,
        settings=options["settings"],
        eos_token_ids=options["eos_token_ids"],
        log_probs_at_temperature=options["log_probs_at_temperature"],
    )
    return RolloutSampler(sampler, token_ids, model=model)


def serve(connection) -> None:
    """The child's loop: build the sampler on the shared model, then answer each request until told to stop (or the
    pipe closes: the parent is gone)."""
    try:
        model, token_ids, options = connection.recv()
        sampler = build_rollout_sampler(model, token_ids, options)
    except Exception:  # noqa: BLE001 - the parent reports it
        connection.send(("error", traceback.format_exc()))
        return
    connection.send(("ready", None))
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            started = time.perf_counter()
            rollout = sampler.sample(request[1])
            data = {key: value for key, value in rollout.items()}
            connection.send(("done", (data, rollout.batch_size, time.perf_counter() - started)))
        except Exception:  # noqa: BLE001 - the parent reports it
            connection.send(("error", traceback.format_exc()))
