"""Data-parallel plumbing for recipes launched with ``torchrun``: the process group, DDP, rank-aware collectives.

A plain ``python recipes/x.py`` run is rank 0 of 1 and every helper here is then a no-op, so a recipe has one code
path for one process and for many.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DataParallel",
    "check_ranks_in_sync",
    "make_data_parallel_policy",
    "save_rank_weights",
    "setup_data_parallel",
]


@dataclass
class DataParallel:
    """Where this process stands among the data-parallel processes; a plain run is rank 0 of 1, not ``active``.

    ``active``: a process group is in use (under torchrun, even with one process); ``owns_group``: ``train`` created
    it and destroys it; ``comm_device``: where tensors go for collectives (nccl only moves CUDA tensors).
    """

    rank: int = 0
    world_size: int = 1
    active: bool = False
    owns_group: bool = False
    comm_device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` of every rank concatenated in rank order (each rank passes the same shape)."""
        if not self.active:
            return values
        local = values.to(self.comm_device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, local)
        return torch.cat(parts).to(values.device)

    def gather_objects(self, obj: Any) -> list:
        if not self.active:
            return [obj]
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Every metric averaged over the ranks (all ranks hold the same keys)."""
        if not self.active or self.world_size == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=self.comm_device)
        torch.distributed.all_reduce(values)  # SUM: gloo has no AVG
        return {key: value / self.world_size for key, value in zip(keys, values.tolist(), strict=True)}

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src=0)
        return holder[0]

    def close(self) -> None:
        if self.owns_group:
            torch.distributed.destroy_process_group()


def setup_data_parallel(*, device: str, backend: str) -> DataParallel:
    """Joins the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), or one already set up
    by the caller; without either, the run is a single process. ``backend="auto"``: nccl on CUDA, gloo otherwise."""
    import torch.distributed as dist

    on_cuda = str(device).startswith("cuda")
    if dist.is_available() and dist.is_initialized():
        comm_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return DataParallel(dist.get_rank(), dist.get_world_size(), active=True, comm_device=comm_device)
    if "WORLD_SIZE" not in os.environ:
        return DataParallel()
    if backend == "auto":
        backend = "nccl" if on_cuda else "gloo"
    if on_cuda:
        # From here on "cuda" (the config's device) means this process's own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend)
    comm_device = "cuda" if backend == "nccl" else "cpu"
    return DataParallel(dist.get_rank(), dist.get_world_size(), active=True, owns_group=True, comm_device=comm_device)


def make_data_parallel_policy(model, data_parallel: DataParallel, *, device: str):
    """The policy as the loss must see it: wrapped in ``DistributedDataParallel`` (which also copies rank 0's weights
    to every rank) so that each backward pass averages the gradients over the ranks; the model itself otherwise."""
    if not data_parallel.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if str(device).startswith("cuda") else None
    # The policy's buffers are constants (rotary frequencies): syncing them at each forward would put a collective
    # into every log-prob recomputation for nothing. Newer torch names the option forward_sync_buffers.
    options = inspect.signature(DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in options else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, **no_sync)


def check_ranks_in_sync(model, data_parallel: DataParallel) -> None:
    """Raises on every rank if the ranks' weights differ (each update must have applied the same gradients)."""
    if not data_parallel.active or data_parallel.world_size == 1:
        return
    fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()])
    gathered = data_parallel.gather(fingerprint).reshape(data_parallel.world_size, -1)
    if not torch.equal(gathered, gathered[:1].expand_as(gathered)):
        raise RuntimeError(
            "The policy's weights differ between the data-parallel ranks; the gradient all-reduce did not keep them "
            "in sync. Check that every rank runs the same config and code."
        )


def save_rank_weights(model, folder: Path, rank: int) -> None:
    """``<folder>/rank_<rank>.safetensors``: this rank's policy weights (a debugging aid: compare the ranks)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: p.detach().cpu().clone() for name, p in model.named_parameters()}, folder / f"rank_{rank}.safetensors"
    )
