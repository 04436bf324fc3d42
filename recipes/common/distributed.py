"""Data-parallel helpers for recipes launched with ``torchrun`` or ``accelerate launch``, over accelerate's processes.

The processes are accelerate's ``PartialState`` (what trl's trainers run on; :func:`recipes.common.run.start_run`
sets it up): its collectives (``gather``, ``gather_object``, ``reduce``) are no-ops in a plain ``python recipes/x.py``
run, so a recipe has one code path for one process and for many. What accelerate does not have is here: the policy's
DDP wrapper (or, with ``distributed.strategy=fsdp``, its FSDP2 sharding: ``recipes.common.sharding``), pooling values
that live on any device, and the check that the ranks' weights agree.
"""

from __future__ import annotations

import inspect

import torch
from accelerate import PartialState
from accelerate.utils import gather, reduce
from torch.nn.parallel import DistributedDataParallel

from recipes.common.log_probs import ResponseLogProbs
from recipes.common.sharding import ShardedResponseLogProbs, is_sharded, shard_policy

__all__ = [
    "STRATEGIES",
    "check_ranks_in_sync",
    "make_data_parallel_policy",
    "make_policy_scorer",
    "mean_over_processes",
    "pool_over_processes",
]

# ddp: every process holds the whole policy and its optimizer state; fsdp: 1/N of them each (FSDP2).
STRATEGIES = ("ddp", "fsdp")


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


def make_policy_scorer(policy, *, strategy: str, device: str):
    """The policy's :class:`~recipes.common.log_probs.ResponseLogProbs` as the loss must see it, averaging the
    gradients over the processes. ``strategy="ddp"``: wrapped in ``DistributedDataParallel``. ``strategy="fsdp"``:
    ``policy`` is sharded in place (:func:`~recipes.common.sharding.shard_policy`; build the optimizer afterwards). In
    a single process, the plain scorer either way."""
    if strategy not in STRATEGIES:
        raise ValueError(f"make_policy_scorer: strategy={strategy!r}, expected one of {list(STRATEGIES)}.")
    if strategy == "fsdp" and PartialState().use_distributed:
        return ShardedResponseLogProbs(shard_policy(policy))
    return make_data_parallel_policy(ResponseLogProbs(policy), device=device)


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
