"""GRPO's data-parallel helpers under ``torchrun``, over accelerate's processes.

The processes are accelerate's ``PartialState`` (:func:`recipes.common.run.start_run` sets it up): its collectives
(``gather``, ``reduce``) are no-ops in a plain ``python recipes/x.py`` run, so the recipe has one code path for one
process and for many. What accelerate does not have is here: pooling values that live on any device, averaging a
step's metrics, and the check that the ranks' weights agree. The policy's DDP wrapper or FSDP2 sharding is built with
its log-prob scorer (``recipes.grpo.log_probs.make_policy_scorer``).
"""

from __future__ import annotations

import typing

import torch
from accelerate import PartialState
from accelerate.utils import gather, reduce

from recipes.common.sharding import is_sharded
from recipes.grpo.schema import Strategy

__all__ = ["STRATEGIES", "check_ranks_in_sync", "mean_over_processes", "pool_over_processes"]

# distributed.strategy's choices (recipes.grpo.schema.Strategy).
STRATEGIES = typing.get_args(Strategy)


def _comm_device() -> torch.device:
    # nccl moves only CUDA tensors (this process's GPU); gloo, CPU ones.
    return PartialState().device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def pool_over_processes(values: torch.Tensor) -> torch.Tensor:
    """``values`` of every process concatenated in rank order (each passes the same shape), on ``values``' device."""
    if not PartialState().use_distributed:
        return values
    return gather(values.to(_comm_device())).to(values.device)


def mean_over_processes(metrics: dict[str, float]) -> dict[str, float]:
    """Every metric averaged over the processes (all hold the same keys)."""
    if not PartialState().use_distributed:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    return dict(zip(keys, reduce(values, reduction="mean").tolist(), strict=True))


def check_ranks_in_sync(model) -> None:
    """Raises on every rank if the ranks' weights differ (each update must have applied the same gradients). A
    sharded model passes: each of its parameters exists once, split between the ranks, with nothing to compare."""
    processes = PartialState()
    if processes.num_processes == 1 or is_sharded(model):
        return
    fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()])
    gathered = pool_over_processes(fingerprint).reshape(processes.num_processes, -1)
    if not torch.equal(gathered, gathered[:1].expand_as(gathered)):
        raise RuntimeError(
            "The policy's weights differ between the data-parallel ranks; the gradient all-reduce did not keep them "
            "in sync. Check that every rank runs the same config and code."
        )
