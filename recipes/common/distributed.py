"""Data-parallel helpers for recipes launched with ``torchrun`` or ``accelerate launch``, over accelerate's processes.

The processes are accelerate's ``PartialState`` (what trl's trainers run on; :func:`recipes.common.run.start_run`
sets it up): its collectives (``gather``, ``gather_object``, ``reduce``) are no-ops in a plain ``python recipes/x.py``
run, so a recipe has one code path for one process and for many. What accelerate does not have is here: the policy's
DDP wrapper, pooling values that live on any device, and the check that the ranks' weights agree.
"""

from __future__ import annotations

import inspect

import torch
from accelerate import PartialState
from accelerate.utils import gather, reduce
from torch.nn.parallel import DistributedDataParallel

__all__ = ["check_ranks_in_sync", "make_data_parallel_policy", "mean_over_processes", "pool_over_processes"]


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


def make_data_parallel_policy(model, *, device: str):
    """The policy as the loss must see it: wrapped in ``DistributedDataParallel`` (which also copies rank 0's weights
    to every rank) so that each backward pass averages the gradients over the ranks; the model itself otherwise."""
    if not PartialState().use_distributed:
        return model
    device_ids = [torch.cuda.current_device()] if str(device).startswith("cuda") else None
    # The policy's buffers are constants (rotary frequencies): syncing them at each forward would put a collective
    # into every log-prob recomputation for nothing. Newer torch names the option forward_sync_buffers.
    options = inspect.signature(DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in options else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, **no_sync)


def check_ranks_in_sync(model) -> None:
    """Raises on every rank if the ranks' weights differ (each update must have applied the same gradients)."""
    processes = PartialState()
    if processes.num_processes == 1:
        return
    fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()])
    gathered = pool_over_processes(fingerprint).reshape(processes.num_processes, -1)
    if not torch.equal(gathered, gathered[:1].expand_as(gathered)):
        raise RuntimeError(
            "The policy's weights differ between the data-parallel ranks; the gradient all-reduce did not keep them "
            "in sync. Check that every rank runs the same config and code."
        )
