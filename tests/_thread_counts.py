"""The torch thread counts a model's forward passes run on (a sampler's ``num_threads`` tests)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def threads_seen_by(model, *, process_threads: int = 2):
    """Yields the list of ``torch.get_num_threads()`` at each forward pass of ``model`` inside the block, where the
    process runs on ``process_threads``; the process's own count and the model are restored after."""
    seen: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, inputs: seen.append(torch.get_num_threads())
    )
    before = torch.get_num_threads()
    torch.set_num_threads(process_threads)
    try:
        yield seen
    finally:
        hook.remove()
        torch.set_num_threads(before)
