"""Log-probs of the response tokens of dense ``[B, T]`` batches, computed over the response positions only.

A GRPO step scores its sequences three times (the policy with gradients, the frozen reference, and, off-policy, the
old policy), and only the response tokens count. Running the whole causal LM gives ``[B, T, V]`` logits, prompt
positions included, and a log-softmax over them: at a real vocabulary (V = 152k) that is 15 GB of float32 for 64
sequences of 400 tokens, and most of the compute. Here the backbone runs once and the LM head projects only the
positions that predict a response token, in chunks of the vocabulary, so that no more than ``chunk_elements`` logits
exist at once, forward or backward (the backward recomputes each chunk's logits instead of keeping them).

- :class:`ResponseLogProbs`: an ``nn.Module`` over a causal LM: ``(tokens, attention_mask, response_start)`` ->
  per-token log-probs (and entropies) of the response tokens, laid out ``[B, T]`` with zeros elsewhere. Wrap it (not
  the bare model) in ``DistributedDataParallel`` so that its backward averages the gradients. A GRPO batch repeats
  each prompt ``group_size`` times: by default each distinct prompt (:func:`distinct_prompts`) runs once and its
  responses read its keys and values from a cache (prefix sharing; verl's ``PrefixGrouper`` gets there with a custom
  attention mask instead, which costs SDPA on CPU the whole group's square).
- :class:`ShardedResponseLogProbs`: the same over a policy FSDP2 sharded (``recipes.common.sharding``). It runs the
  backbone and the LM head itself, outside the policy's ``forward``, where FSDP2 would leave the root's weights
  sharded: its scoring is registered as one of the policy's forward methods, so that FSDP2 gathers them around it
  (and reduce-scatters their gradients after the backward) as it does around ``forward``.
- :class:`AdapterDisabledLogProbs`: a LoRA policy's log-probs with its adapters switched off, i.e. the frozen base
  model's: GRPO's KL reference without a second copy of the model in memory.
- :class:`ScoreLogProbs`: writes such log-probs into a batch without gradients (the reference's, the old policy's).
- :func:`make_policy_scorer`: the policy's scorer as the loss sees it (DDP-wrapped, or FSDP2-sharded, under a
  launcher); :func:`make_reference_scorer`: the reference's (loaded model, sharded model, or adapters off).

Dependencies: torch, tensordict, accelerate, and the ``transformers`` model the caller passes in.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
from accelerate import PartialState
from tensordict import NestedKey, TensorDictBase
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel
from transformers.cache_utils import Cache, DynamicLayer

from recipes.common.lora import is_peft_model
from recipes.common.sharding import is_sharded, shard_policy
from recipes.grpo.batch import ATTENTION_MASK, TOKENS, response_start
from recipes.grpo.distributed import STRATEGIES

__all__ = [
    "CACHE_CHUNK_ELEMENTS",
    "CHUNK_ELEMENTS",
    "KEEP_ELEMENTS",
    "AdapterDisabledLogProbs",
    "ResponseLogProbs",
    "ScoreLogProbs",
    "ShardedResponseLogProbs",
    "chunk_columns",
    "distinct_prompts",
    "make_data_parallel_policy",
    "make_policy_scorer",
    "make_reference_scorer",
]

# ResponseLogProbs' default budget: at most this many logits (rows x vocabulary, float32) exist at once; within it
# the head is computed all at once (autograd's own log-softmax).
CHUNK_ELEMENTS = 2**23
# Beyond it, each chunk of the vocabulary holds about this many logits: 2**23 (32 MiB of float32, 16,384 columns at
# 512 rows). Smaller chunks keep the passes over a chunk in the last-level cache (32 MiB here), but each chunk is a
# dozen parallel ops, and with other jobs on the cores every op waits on its thread barrier. Measured at 512 rows x
# 151,936, 2 threads, forward and backward alternated in one process: alone (load average 0.5), medians 1.46 s at
# 16,384 columns, 1.40 s at 4,096, 1.43 s at 2,048 (-4%); with other jobs on the 2 cores, 1.3-2.2x slower at 4,096 and
# 2,048 than at 16,384 as the load came and went. A 4% gain alone is not worth that.
CACHE_CHUNK_ELEMENTS = 2**23
# ... unless the backward may keep a forward's logits instead of recomputing them: up to this many in all (float32,
# 512 MiB; trl's update holds all of its [B, R, V] logits and their log-softmax), beyond which the chunks are
# recomputed. Keeping them saves one of the LM head's four matmuls in an update, the largest cost at a real
# vocabulary.
KEEP_ELEMENTS = 2**27

# The responses' passes under prompt sharing: at most this many buckets of response lengths, a bucket added while it
# saves at least this share of one pass's positions (each pass costs a model call: tiny models pay that, too).
MAX_BUCKETS = 4
BUCKET_SAVING = 0.1

# Configuration entries by which some models rescale or cap their logits after the LM head: such models are scored
# through their own forward (logits_to_keep) instead of the chunked head, which would miss the rescaling.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def _log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    log_softmax = logits.log_softmax(-1)
    log_probs = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    return log_probs, (-(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else None)


def chunk_columns(rows: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """The vocabulary columns of one chunk of the head's logits over ``rows`` rows: about
    :data:`CACHE_CHUNK_ELEMENTS` logits, never more than ``chunk_elements``, at least one column.

    Examples:
        >>> chunk_columns(512), chunk_columns(512, chunk_elements=512 * 100), chunk_columns(2**24)
        (16384, 100, 1)
    """
    return max(1, min(chunk_elements, CACHE_CHUNK_ELEMENTS) // rows)


class _HeadWorkspace:
    """The chunked head's large buffers (chunks of logits and exps, the kept logits, the weight's gradient), kept by a
    scorer from one call to the next. At a real vocabulary each is tens to hundreds of MB, which glibc serves (over 32
    MiB) with a fresh mapping that is returned at free, so every step page-faulted on each of them anew: a GRPO step's
    update mapped about 700 MB a step that way (512 rows at 151,936, counted with ``getrusage``'s minor faults), and a
    fresh page costs several times its later writes.

    A buffer is taken (:meth:`take`: the pool's when it is large enough, else a new one) and given back (:meth:`give`)
    once its holder is done with it; while taken it is not in the pool, so two graphs alive at once (two forwards
    before their backwards) never share one: the second finds the pool empty and allocates, as without a pool."""

    def __init__(self) -> None:
        self._pool: dict[str, torch.Tensor] = {}
        # The memory of the last weight gradient handed to autograd (0: none), which only it may take back.
        self.lent_gradient = 0

    def take(self, name: str, numel: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements of ``dtype`` (``like``'s by default) on ``like``'s device."""
        dtype = dtype or like.dtype
        buffer = self._pop(name, lambda b: b.numel() >= numel and b.dtype == dtype and b.device == like.device)
        return buffer if buffer is not None else like.new_empty(numel, dtype=dtype)

    def take_like(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s shape, dtype and device (not a view of a larger buffer: what autograd can adopt as
        a parameter's ``.grad``)."""
        buffer = self._pop(name, lambda b: b.shape == like.shape and b.dtype == like.dtype and b.device == like.device)
        return buffer if buffer is not None else torch.empty_like(like)

    def _pop(self, name: str, fits) -> torch.Tensor | None:
        """The pool's ``name`` buffer if it ``fits``; one that does not is dropped (freed before a new one is made)."""
        buffer = self._pool.pop(name, None)
        return buffer if buffer is not None and fits(buffer) else None

    def give(self, name: str, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._pool[name] = buffer


def _take(workspace: _HeadWorkspace | None, name: str, numel: int, like: torch.Tensor, dtype) -> torch.Tensor:
    """``workspace.take(...)``, or a new flat buffer without a workspace."""
    return workspace.take(name, numel, like, dtype) if workspace is not None else like.new_empty(numel, dtype=dtype)


class _ChunkBuffer:
    """One ``[rows, chunk]`` buffer for a loop over the vocabulary's chunks, taken from ``workspace`` (or allocated) at
    the first chunk; ``get`` hands a contiguous ``[rows, columns]`` view of it (the last chunk may be narrower),
    ``release`` gives it back to the workspace."""

    def __init__(
        self,
        rows: int,
        chunk: int,
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
        *,
        workspace: _HeadWorkspace | None = None,
        name: str = "",
    ) -> None:
        self.rows, self.chunk, self.like, self.dtype = rows, chunk, like, dtype or like.dtype
        self.workspace, self.name = workspace, name
        self._flat: torch.Tensor | None = None

    def get(self, columns: int) -> torch.Tensor:
        if self._flat is None:
            self._flat = _take(self.workspace, self.name, self.rows * self.chunk, self.like, self.dtype)
        return self._flat[: self.rows * columns].view(self.rows, columns)

    def release(self) -> None:
        if self.workspace is not None:
            self.workspace.give(self.name, self._flat)
        self._flat = None


def _chunk_logits(hidden, weight, bias, columns: slice, buffer: _ChunkBuffer | None, *, out=None) -> torch.Tensor:
    """``linear(hidden, weight[columns], bias[columns])`` in float32, into ``out`` or ``buffer`` when given (a new
    tensor otherwise): the same product ``nn.functional.linear`` makes (``mm``, ``addmm`` with a bias)."""
    chunk_weight = weight[columns]
    if (buffer is None and out is None) or hidden.dtype != torch.float32 or weight.dtype != torch.float32:
        return nn.functional.linear(hidden, chunk_weight, bias[columns] if bias is not None else None).float()
    if out is None:
        out = buffer.get(chunk_weight.shape[0])
    if bias is None:
        return torch.mm(hidden, chunk_weight.t(), out=out)
    return torch.addmm(bias[columns], hidden, chunk_weight.t(), out=out)


def _shifted_exp_sums(logits, shift, out, with_entropy: bool):
    """Per row, ``sum(exp(logits - shift))`` and (``with_entropy``) ``sum(exp(logits - shift) * logits)``, the exps
    written into ``out``. The dot product by einsum reads the two chunks once, where (exp * logits).sum(-1) writes and
    reads a third (3.4 against 10.2 ms a [512, 16384] chunk at 2 threads)."""
    exp = torch.sub(logits, shift[:, None], out=out).exp_()
    return exp.sum(-1), (torch.einsum("rv,rv->r", exp, logits) if with_entropy else None)


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T + bias)[target]`` (and the entropy) per row, ``chunk`` vocabulary columns at a
    time: the log-normaliser is accumulated online over the chunks (running max and sums), and the backward
    recomputes each chunk's logits rather than keeping ``[N, V]`` of them (with ``keep``, it keeps them). Chunking the
    vocabulary (not the rows) lets each chunk's weight gradient be written once, where row chunks would each add a
    ``[V, H]`` product. The large buffers come from ``workspace`` (a :class:`_HeadWorkspace`, or ``None``: new ones)
    and go back to it when done: the forward's chunks at its end, the kept logits at the end of the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, with_entropy: bool, keep: bool, workspace):
        rows, vocabulary = hidden.shape[0], weight.shape[0]
        ctx.workspace = workspace
        ctx.kept, ctx.kept_flat = None, None
        if keep:
            ctx.kept = []
            if hidden.dtype == weight.dtype == torch.float32:  # else each chunk's float32 cast is a new tensor
                # One [rows, V] buffer whose consecutive [rows, chunk] pieces hold the chunks' logits.
                ctx.kept_flat = _take(workspace, "kept", rows * vocabulary, hidden, torch.float32)
        running_max = hidden.new_full((rows,), float("-inf"), dtype=torch.float32)
        sum_exp = hidden.new_zeros(rows, dtype=torch.float32)
        sum_exp_logit = hidden.new_zeros(rows, dtype=torch.float32) if with_entropy else None
        target_logit = hidden.new_zeros(rows, dtype=torch.float32)
        # Kept logits fill the pieces of one buffer; otherwise one buffer serves every chunk, as one does the exps: a
        # fresh [rows, chunk] buffer is a fresh mapping whose first write page-faults (32 MiB: about as slow as the
        # pass).
        logits_buffer = None if keep else _ChunkBuffer(rows, chunk, hidden, workspace=workspace, name="logits")
        exp_buffer = _ChunkBuffer(rows, chunk, hidden, dtype=torch.float32, workspace=workspace, name="exp")
        for start in range(0, vocabulary, chunk):
            columns = slice(start, start + chunk)
            if keep:
                width = min(chunk, vocabulary - start)
                piece = None
                if ctx.kept_flat is not None:
                    piece = ctx.kept_flat[rows * start : rows * (start + width)].view(rows, width)
                logits = _chunk_logits(hidden, weight, bias, columns, None, out=piece)
                ctx.kept.append(logits)
            else:
                logits = _chunk_logits(hidden, weight, bias, columns, logits_buffer)
            exp_out = exp_buffer.get(logits.shape[-1])
            sums = None
            if start > 0 and hidden.device.type == "cpu":
                # Shifted by the chunks' max so far, not by this chunk's own: the same sums, and one pass over the
                # chunk fewer (its max). Unless a logit passes the shift by more than float32's exp range, caught
                # by the sums (then this chunk's max is taken after all); on CPU, where that check costs no sync.
                sums = _shifted_exp_sums(logits, running_max, exp_out, with_entropy)
                if not all(bool(torch.isfinite(value).all()) for value in sums if value is not None):
                    sums = None
            if sums is None:
                new_max = torch.maximum(running_max, logits.max(-1).values)
                rescale = (running_max - new_max).exp()
                sum_exp = sum_exp * rescale
                sum_exp_logit = sum_exp_logit * rescale if with_entropy else None
                running_max = new_max
                sums = _shifted_exp_sums(logits, running_max, exp_out, with_entropy)
            sum_exp = sum_exp + sums[0]
            if with_entropy:
                sum_exp_logit = sum_exp_logit + sums[1]
            local = targets - start
            here = (local >= 0) & (local < logits.shape[-1])
            picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(-1)
            target_logit = torch.where(here, picked, target_logit)
        for buffer in (logits_buffer, exp_buffer):
            if buffer is not None:
                buffer.release()
        normaliser = running_max + sum_exp.log()
        # H = log Z - E_p[logit]
        entropy = normaliser - sum_exp_logit / sum_exp if with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser, entropy)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(targets)
        # An output no loss term uses (the entropy, logged only, without an entropy bonus) gets None, not zeros.
        ctx.set_materialize_grads(False)
        return target_logit - normaliser, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, normaliser, entropy = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_hidden else None
        grad_weight = None
        if want_weight:
            # Where the weight has no gradient yet, autograd adopts this tensor as its .grad (nothing else holds it):
            # the workspace's, which ResponseLogProbs.recycle_head_gradient takes back after the optimizer's step.
            # Every row is written below. Into an existing .grad (a later micro-batch) autograd adds a new tensor.
            recycled = ctx.workspace is not None and weight.grad is None
            grad_weight = ctx.workspace.take_like("weight_grad", weight) if recycled else torch.empty_like(weight)
            if recycled:
                ctx.workspace.lent_gradient = grad_weight.data_ptr()
        grad_bias = torch.empty_like(bias) if bias is not None and want_bias else None
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        # d log p[target] / d logits = onehot(target) - p and d H / d logits = -p * (log p + H), so the gradient of the
        # logits is p * (scale * log p + shift), plus grad_log_probs at the target: three in place passes over a chunk
        # after its exp, where the two terms apart take five. An unused output (None) adds no term.
        if grad_entropy is not None:
            scale = -grad_entropy[:, None]
            shift = -grad_entropy * entropy - (grad_log_probs if grad_log_probs is not None else 0.0)
        else:
            scale, shift = None, -grad_log_probs
        workspace = ctx.workspace
        # For the chunks recomputed (none when all were kept), and the probabilities with an entropy term.
        logits_buffer = _ChunkBuffer(hidden.shape[0], ctx.chunk, hidden, workspace=workspace, name="logits")
        probs_buffer = (
            _ChunkBuffer(hidden.shape[0], ctx.chunk, hidden, torch.float32, workspace=workspace, name="exp")
            if scale is not None
            else None
        )
        for index, start in enumerate(range(0, weight.shape[0], ctx.chunk)):
            columns = slice(start, start + ctx.chunk)
            chunk_weight = weight[columns]
            if ctx.kept is not None and ctx.kept[index] is not None:
                # Handed over (and changed in place below): a second backward through this graph recomputes.
                logits, ctx.kept[index] = ctx.kept[index], None
            else:
                logits = _chunk_logits(hidden, weight, bias, columns, logits_buffer)
            # In place, each [rows, chunk] buffer reused: at a real vocabulary these passes over the chunk cost about
            # as much as its matmuls. Without an entropy term the log-softmax is not read again: exp in place.
            log_softmax = logits.sub_(normaliser[:, None])
            if probs_buffer is not None:
                probs = torch.exp(log_softmax, out=probs_buffer.get(log_softmax.shape[-1]))
            else:
                probs = log_softmax.exp_()
            if scale is not None:
                grad_logits = log_softmax.mul_(scale).add_(shift[:, None]).mul_(probs)
            else:
                grad_logits = probs.mul_(shift[:, None])
            if grad_log_probs is not None:
                local = targets - start
                here = (local >= 0) & (local < logits.shape[-1])
                grad_logits[rows[here], local[here]] += grad_log_probs[here]
            grad_logits = grad_logits.to(weight.dtype)
            if want_hidden:
                if grad_logits.dtype == torch.float32:
                    grad_hidden.addmm_(grad_logits, chunk_weight)  # in place: no [rows, H] product to add
                else:
                    grad_hidden += (grad_logits @ chunk_weight).float()
            if want_weight:
                # Written into its rows of the gradient (contiguous), not into a [chunk, H] product then copied.
                torch.mm(grad_logits.T, hidden.to(weight.dtype), out=grad_weight[columns])
            if grad_bias is not None:
                grad_bias[columns] = grad_logits.sum(0)
        for buffer in (logits_buffer, probs_buffer):
            if buffer is not None:
                buffer.release()
        if ctx.kept_flat is not None and workspace is not None and all(logits is None for logits in ctx.kept):
            # Every kept chunk was used (and written over): the buffer goes back for the next forward.
            workspace.give("kept", ctx.kept_flat)
            ctx.kept_flat = None
        grad_hidden = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _EmbeddingRowsGradient(torch.autograd.Function):
    """``nn.functional.embedding`` whose weight gradient is left to :class:`_TiedEmbeddingRows`: the backward hands
    it the ids and their rows' gradients and returns none for the weight."""

    @staticmethod
    def forward(ctx, ids, weight, rows: _TiedEmbeddingRows):
        ctx.save_for_backward(ids)
        ctx.rows = rows
        return nn.functional.embedding(ids, weight, rows.embedding.padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ctx.rows.pending.append((ids, grad))
        return None, None, None


class _TiedEmbeddingRows:
    """The input embedding's gradient of a model whose LM head shares its weight, added into the weight's gradient
    row by row (``index_add_`` of the rows the batch used) once autograd has accumulated the head's into it.

    Autograd's own embedding backward writes a dense ``[V, H]`` gradient, zeros but for the batch's rows, which it
    then adds to the head's: at a real vocabulary two passes over 311 MB (and the zeros' fresh pages) for a few
    hundred rows. The same sum, in another order for a token the batch holds several times (float rounding).

    Used by :class:`ResponseLogProbs` with gradients in one process only: under DDP or FSDP2 the gradient is
    reduced as soon as autograd has accumulated it, before these rows would be added."""

    def __init__(self, embedding: nn.Embedding) -> None:
        self.embedding = embedding
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        embedding.weight.register_post_accumulate_grad_hook(self._add_rows)

    @classmethod
    def of(cls, model) -> _TiedEmbeddingRows | None:
        """The rows' gradient of ``model``'s input embedding, if its head shares the weight and nothing else changes
        the lookup's gradient (``max_norm``, ``scale_grad_by_freq``, a sparse or replaced embedding); else ``None``."""
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if (
            type(embedding) is not nn.Embedding
            or not isinstance(head, nn.Linear)
            or head.weight is not embedding.weight
            or embedding.max_norm is not None
            or embedding.scale_grad_by_freq
            or embedding.sparse
            or "forward" in vars(embedding)
            or not embedding.weight.requires_grad  # frozen (LoRA's base, a reference): no gradient to add to
            or _distributed()
        ):
            return None
        return cls(embedding)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The embedding's lookups inside leave their weight gradient to the rows (with gradients of a trained
        weight only); its ``forward`` is restored on leaving."""
        if not (torch.is_grad_enabled() and self.embedding.weight.requires_grad) or _distributed():
            yield
            return
        self.embedding.forward = self._lookup  # this instance only, undone below
        try:
            yield
        finally:
            del self.embedding.forward

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return _EmbeddingRowsGradient.apply(ids, self.embedding.weight, self)

    def _add_rows(self, weight: torch.Tensor) -> None:
        if weight is not self.embedding.weight:  # a copy of the model (deepcopy copies the hook): not its rows
            return
        padding = self.embedding.padding_idx
        for ids, grad in self.pending:
            ids, grad = ids.reshape(-1), grad.reshape(ids.numel(), -1)
            if padding is not None:  # the padding row gets no gradient, as in the dense backward
                used = ids != padding
                ids, grad = ids[used], grad[used]
            weight.grad.index_add_(0, ids, grad.to(weight.grad.dtype))
        self.pending.clear()


class _RecordedLayer(DynamicLayer):
    """A cache layer that keeps the keys and values of one pass (the distinct prompts'), replacing rather than
    appending: a checkpointed layer's recomputation in the backward writes the same values again, harmlessly."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states


class _SharedPromptLayer(DynamicLayer):
    """A read-only cache layer: each row's prompt keys and values (gathered from the distinct prompts' pass) before the
    response's own. Nothing is stored, so a checkpointed layer's recomputation sees exactly what its forward saw."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@contextlib.contextmanager
def _cache_kept_under_checkpointing(model: nn.Module) -> Iterator[None]:
    """Lets checkpointed decoder layers keep the prompt-sharing caches, which transformers otherwise drops under
    gradient checkpointing (a growing cache would be written twice by the recomputation; these two are not)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def distinct_prompts(tokens: torch.Tensor, attention_mask: torch.Tensor, response_start: int):
    """The distinct prompts of a dense batch (columns ``[:response_start]``, pads ignored): ``(rows, inverse)``, the
    batch row of each distinct prompt's first occurrence, and each row's distinct prompt.

    Examples:
        >>> tokens = torch.tensor([[0, 5, 9], [0, 5, 8], [6, 7, 9], [0, 5, 7]])
        >>> distinct_prompts(tokens, tokens != 0, response_start=2)
        (tensor([0, 2]), tensor([0, 0, 1, 0]))
    """
    prompts = torch.where(attention_mask[:, :response_start].bool(), tokens[:, :response_start], -1)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    rows = torch.full((int(inverse.max()) + 1,), tokens.shape[0], dtype=torch.long, device=tokens.device)
    rows = rows.scatter_reduce(0, inverse, torch.arange(tokens.shape[0], device=tokens.device), reduce="amin")
    return rows, inverse


def response_buckets(
    lengths: torch.Tensor, *, max_buckets: int = MAX_BUCKETS, min_saving: float = BUCKET_SAVING
) -> list[torch.Tensor]:
    """The rows of a batch in buckets of similar response length (``lengths``, ``[B]``), for passes each padded to its
    own longest response instead of the batch's: a bucket is split in two where that saves the most padded positions,
    while a split saves at least ``min_saving`` of the one-pass positions, into at most ``max_buckets``. One bucket
    (every row, in order) when no split pays.

    Examples:
        >>> response_buckets(torch.tensor([3, 20, 2, 19, 4, 20]))
        [tensor([2, 0, 4]), tensor([3, 1, 5])]
        >>> response_buckets(torch.tensor([18, 20, 19]))
        [tensor([0, 1, 2])]
    """
    order = torch.argsort(lengths, stable=True)
    ordered = lengths[order].tolist()

    def positions(start: int, stop: int) -> int:
        return (stop - start) * ordered[stop - 1]

    bounds, one_pass = [(0, len(ordered))], positions(0, len(ordered))
    while len(bounds) < max_buckets:
        best = (0, 0, 0)  # (positions saved, bucket, split)
        for index, (start, stop) in enumerate(bounds):
            for split in range(start + 1, stop):
                if ordered[split - 1] != ordered[split]:
                    saved = positions(start, stop) - positions(start, split) - positions(split, stop)
                    best = max(best, (saved, index, split))
        saved, index, split = best
        if saved < max(1, min_saving * one_pass):
            break
        start, stop = bounds[index]
        bounds[index : index + 1] = [(start, split), (split, stop)]
    if len(bounds) == 1:
        return [torch.arange(len(ordered), device=lengths.device)]
    return [order[start:stop] for start, stop in bounds]


def _only_full_attention(config) -> bool:
    """Whether every layer of the model attends to the whole sequence: the one case the prompt-sharing cache serves
    (a sliding-window or linear-attention layer keeps other state)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return set(layer_types) == {"full_attention"} and not getattr(config, "use_sliding_window", False)


class ResponseLogProbs(nn.Module):
    """The log-prob (and entropy) of every response token of a dense batch under ``model``, response positions only.

    A batch row is ``[pads | prompt | response | pads]`` with every response starting at column ``response_start``
    (``interop.sampling.CausalLMSampler`` and ``recipes.common.chat.pad_rollout`` lay them out so).
    Positions follow the attention mask (``cumsum - 1``), as generation set them. The result is ``[B, T]``, zero
    outside the response tokens: column ``t`` holds ``log p(tokens[t] | tokens[:t])``, TorchRL's layout of
    ``("log_probs", "full")``.

    Args:
        model: a ``transformers`` causal LM, or a ``peft.PeftModel`` over one (its adapters active).

    Keyword Args:
        chunk_elements: at most this many logits (rows x vocabulary) exist at once, unless ``keep_elements`` allows
            the backward to keep them: within it the head is computed whole, beyond it in chunks of the vocabulary
            (:func:`chunk_columns`: at most this many).
        keep_elements: with gradients, a backward keeps the forward's chunks of logits up to this many in all (and
            recomputes them beyond): one matmul of the LM head less for that memory. 0: always recompute.
        share_prompt: run each distinct prompt of a batch once (``train.share_prompt``): its keys and values, recorded
            per layer, are gathered for the rows that share it and read by one pass over the responses alone, whose
            gradients flow back through the prompt's single pass. The same numbers as ``False`` (every row whole) to
            float rounding; a batch of distinct prompts (but under FSDP2, where every process must make the same
            calls), or a model with sliding-window or linear-attention layers, takes the padded path.

    Examples:
        >>> import torch
        >>> from transformers import AutoModelForCausalLM
        >>> from recipes.common.config import PROJECT_ROOT
        >>> model = AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "tiny" / "policy").eval()
        >>> tokens = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 0]])  # prompts of 2 and 3 tokens, start column 3
        >>> mask = tokens != 0
        >>> log_probs, _ = ResponseLogProbs(model)(tokens, mask, response_start=3)
        >>> log_probs.shape, bool((log_probs[:, :3] == 0).all()), bool(log_probs[1, 4] == 0), bool(log_probs[0, 3] < 0)
        (torch.Size([2, 5]), True, True, True)
    """

    def __init__(
        self,
        model,
        *,
        chunk_elements: int = CHUNK_ELEMENTS,
        share_prompt: bool = True,
        keep_elements: int = KEEP_ELEMENTS,
    ) -> None:
        super().__init__()
        if chunk_elements < 1:
            raise ValueError(f"ResponseLogProbs: chunk_elements must be >= 1, got {chunk_elements}.")
        self.keep_elements = keep_elements
        # A peft model: score through the model its LoRA layers were injected into (they stay active), whose
        # backbone and LM head are a plain transformers model's.
        if callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        self.model = model
        self.chunk_elements = chunk_elements
        config = getattr(model, "config", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._chunked = isinstance(head, nn.Linear) and not any(
            getattr(config, name, None) is not None for name in _LOGIT_TRANSFORMS
        )
        self.share_prompt = share_prompt and _only_full_attention(config)
        self._tied_rows = _TiedEmbeddingRows.of(model)
        # The chunked head's buffers on CPU, kept from one call to the next (scripts/estimate_memory.py counts them).
        self._workspace = _HeadWorkspace()
        # Under FSDP2 every process must make the same calls of the sharded layers (each gathers its weights from
        # all): a batch of distinct prompts takes the shared path too there, whatever the other processes' batches.
        self._same_path_on_every_process = False

    def forward(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, *, response_start: int, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not 0 < response_start < tokens.shape[-1]:
            raise ValueError(
                f"ResponseLogProbs: response_start={response_start} must leave a prompt and a response in "
                f"sequences of {tokens.shape[-1]} tokens."
            )
        scored = attention_mask[:, response_start:].bool()  # [B, R]: the response tokens
        targets = tokens[:, response_start:][scored]
        with self._tied_rows.active() if self._tied_rows is not None else contextlib.nullcontext():
            states = self._response_states(tokens, attention_mask, response_start, scored)
        if not self._chunked:
            log_probs, entropy = _log_probs_and_entropy(states.float(), targets, with_entropy)
        else:
            head = self.model.get_output_embeddings()
            logits = states.shape[0] * head.weight.shape[0]
            if logits <= self.chunk_elements:
                # Every logit fits at once: autograd's own log-softmax is then the faster way.
                log_probs, entropy = _log_probs_and_entropy(head(states).float(), targets, with_entropy)
            else:
                chunk = chunk_columns(states.shape[0], self.chunk_elements)
                keep = torch.is_grad_enabled() and logits <= self.keep_elements
                # On CPU only: a GPU's caching allocator already reuses freed blocks without new pages.
                workspace = self._workspace if states.device.type == "cpu" else None
                log_probs, entropy = _ChunkedHeadLogProbs.apply(
                    states, head.weight, head.bias, targets, chunk, with_entropy, keep, workspace
                )

        def laid_out(values: torch.Tensor) -> torch.Tensor:
            # masked_scatter keeps the graph; the prompt columns are zeros.
            response = values.new_zeros(scored.shape).masked_scatter(scored, values)
            return torch.cat([values.new_zeros(tokens.shape[0], response_start), response], dim=-1)

        return laid_out(log_probs), (laid_out(entropy) if entropy is not None else None)

    def recycle_head_gradient(self) -> None:
        """Takes the LM head weight's gradient back (its ``.grad`` set to ``None``) for the next backward to write
        into instead of a new ``[V, H]`` tensor (at a real vocabulary, 311 MB of fresh pages every step): call it
        where the gradients would be set to ``None``, after the optimizer's step. Only a gradient nothing else can
        hold is taken: a plain tensor on CPU (not a view, as DDP's bucket views are) in a single process."""
        if not self._chunked or _distributed():
            return
        weight = self.model.get_output_embeddings().weight
        grad = weight.grad
        if grad is None or grad._base is not None or type(grad) is not torch.Tensor or grad.device.type != "cpu":
            return
        # Only the workspace's own: a gradient autograd made (a head scored whole, within chunk_elements) is dropped
        # as the optimizer would, not kept for a backward that would never take it.
        if grad.data_ptr() != self._workspace.lent_gradient:
            return
        weight.grad = None
        self._workspace.lent_gradient = 0
        self._workspace.give("weight_grad", grad)

    def _response_states(self, tokens, attention_mask, response_start: int, scored) -> torch.Tensor:
        """The final hidden states (or logits) at the positions that predict the ``scored`` response tokens."""
        prompts, inverse = (None, None)
        if self.share_prompt:
            prompts, inverse = distinct_prompts(tokens, attention_mask, response_start)
        if prompts is not None and (len(prompts) < tokens.shape[0] or self._same_path_on_every_process):
            # Column t - 1 predicts the token at column t: the prompt's last state, then the response's but its last.
            states = self._shared_prompt_states(tokens, attention_mask, response_start, prompts, inverse)
        else:
            mask = attention_mask.long()
            states = self._states(tokens, mask, (mask.cumsum(-1) - 1).clamp_min(0), None, tokens.shape[-1])
            states = states[:, response_start - 1 : -1]
        return states[scored]

    def _states(self, tokens, mask, positions, cache, keep: int) -> torch.Tensor:
        """The last ``keep`` columns' final hidden states (chunked head) or logits (the model's own forward)."""
        if self._chunked:
            # No KV cache unless one is given: nothing decodes after this pass, and a cache would hold every layer's
            # keys and values.
            hidden = self.model.get_decoder()(
                input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None
            )
            return hidden.last_hidden_state[:, -keep:]
        return self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
        ).logits

    def _shared_prompt_states(self, tokens, attention_mask, response_start, prompts, inverse) -> torch.Tensor:
        """:meth:`_states` of columns ``response_start - 1 .. T - 2``, each distinct prompt run once: its keys and
        values, recorded per layer, are gathered for every row that shares it and read (not recomputed) by the passes
        over the responses, one per bucket of response lengths (:func:`response_buckets`), each as wide as its longest
        response. Under autograd the gathers sum each row's gradient into its prompt's single pass."""
        mask = attention_mask.long()
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        layers = self.model.config.num_hidden_layers
        recorded = Cache(layers=[_RecordedLayer() for _ in range(layers)])
        width = tokens.shape[-1] - response_start
        # Under FSDP2 every process makes the same calls: one pass, whatever its batch's lengths.
        # Each response's extent: up to its last real column (a mask with holes inside a response keeps them).
        columns = torch.arange(1, width + 1, device=mask.device)
        lengths = (mask[:, response_start:] * columns).amax(-1)
        buckets = [None] if self._same_path_on_every_process else response_buckets(lengths)
        with _cache_kept_under_checkpointing(self.model):
            prompt_states = self._states(
                tokens[prompts, :response_start],
                mask[prompts, :response_start],
                positions[prompts, :response_start],
                recorded,
                1,
            )
            pieces = []
            for bucket in buckets:
                # A bucket's columns end at its longest response (rows are padded on the right).
                end = response_start + (max(1, int(lengths[bucket].max())) if bucket is not None else width)
                # One bucket holds every row in order: a slice, not a gathered copy of the batch and the caches.
                rows = slice(None) if bucket is None or len(buckets) == 1 else bucket
                shared = Cache(
                    layers=[
                        _SharedPromptLayer(layer.keys[inverse[rows]], layer.values[inverse[rows]])
                        for layer in recorded.layers
                    ]
                )
                states = self._states(
                    tokens[rows, response_start:end],
                    mask[rows, :end],
                    positions[rows, response_start:end],
                    shared,
                    end - response_start,
                )
                pieces.append(nn.functional.pad(states, (0, 0, 0, tokens.shape[-1] - end)))
        response_states = pieces[0] if len(pieces) == 1 else torch.cat(pieces)[torch.cat(buckets).argsort()]
        return torch.cat([prompt_states[inverse], response_states[:, :-1]], dim=1)


class ScoreLogProbs:
    """Writes a model's log-probs of a dense batch's response tokens into the batch, in place, without gradients.

    The frozen reference's go to ``("next", "ref_log_probs", "full")`` (what the loss reads for its KL term);
    the policy's own, when the batch lacks the sampling log-probs, to ``("log_probs", "full")``.

    Args:
        scorer: a :class:`ResponseLogProbs` (or a ``DistributedDataParallel`` wrapping one).

    Keyword Args:
        out_key: where the ``[B, T]`` log-probs go.
        micro_batch_size: sequences per forward pass; ``None``: the whole batch at once.
    """

    def __init__(self, scorer, *, out_key: NestedKey, micro_batch_size: int | None = None) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"ScoreLogProbs: micro_batch_size must be >= 1 or None, got {micro_batch_size}.")
        self.scorer = scorer
        self.out_key = out_key
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        tokens = batch.get(TOKENS)
        mask = batch.get(ATTENTION_MASK)
        start = response_start(batch)
        size = self.micro_batch_size or tokens.shape[0]
        chunks = [
            self.scorer(tokens[i : i + size], mask[i : i + size], response_start=start)[0]
            for i in range(0, tokens.shape[0], size)
        ]
        batch.set(self.out_key, torch.cat(chunks))
        return batch

    def __repr__(self) -> str:
        return f"{type(self).__name__}(out_key={self.out_key!r}, micro_batch_size={self.micro_batch_size})"


# The policy's method that ShardedResponseLogProbs registers as an FSDP2 forward.
_SCORE_METHOD = "score_response_log_probs"


class ShardedResponseLogProbs(ResponseLogProbs):
    """:class:`ResponseLogProbs` over a policy sharded by ``recipes.common.sharding.shard_policy``.

    The scoring reads the embeddings and the LM head weight directly, which FSDP2 gathers only inside the policy's
    forward hooks: it is therefore run as a forward method of the policy (``register_fsdp_forward_method``), and the
    root's gradients are reduce-scattered after the backward as those of ``forward`` would be. The gradients of every
    rank's batch are averaged, as under ``DistributedDataParallel``.

    Args:
        model: a causal LM sharded by :func:`shard_policy`.

    Keyword Args:
        chunk_elements, share_prompt: as :class:`ResponseLogProbs`'s.
    """

    def __init__(self, model, *, chunk_elements: int = CHUNK_ELEMENTS, share_prompt: bool = True) -> None:
        if not is_sharded(model):
            raise ValueError("ShardedResponseLogProbs: the model is not sharded; call shard_policy(model) first.")
        super().__init__(model, chunk_elements=chunk_elements, share_prompt=share_prompt)
        self._same_path_on_every_process = True
        # A plain attribute, not a submodule: the policy's state dict does not change.
        object.__setattr__(model, _SCORE_METHOD, functools.partial(ResponseLogProbs.forward, self))
        register_fsdp_forward_method(model, _SCORE_METHOD)
        # The root's wrapped method, kept here: self.model is a peft model's base model (what the scoring reads),
        # while the root, on which the method is registered, is the peft model.
        self._score = getattr(model, _SCORE_METHOD)

    def forward(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, *, response_start: int, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._score(tokens, attention_mask, response_start=response_start, with_entropy=with_entropy)


class AdapterDisabledLogProbs(nn.Module):
    """A LoRA policy's response log-probs with its adapters switched off: the frozen base model's, GRPO's reference.

    The base weights never train under LoRA, so the initial policy need not be loaded a second time.

    Args:
        model: a ``peft.PeftModel`` over a causal LM.

    Keyword Args:
        chunk_elements: passed to :class:`ResponseLogProbs`.
        scorer: the scorer to run with the adapters off instead of a new :class:`ResponseLogProbs`: that of a sharded
            ``model`` (:class:`ShardedResponseLogProbs`), whose weights only its registered
            forward gathers. The adapters are switched off before it gathers them; peft's switch is a flag on each
            LoRA layer (and ``requires_grad`` on its sharded adapters, which FSDP2 copies to the gathered ones).
    """

    def __init__(self, model, *, chunk_elements: int = CHUNK_ELEMENTS, scorer: nn.Module | None = None) -> None:
        super().__init__()
        if not is_peft_model(model):
            raise TypeError(f"AdapterDisabledLogProbs: expected a peft.PeftModel, got {type(model).__name__}.")
        self.peft_model = model
        self.scorer = scorer if scorer is not None else ResponseLogProbs(model, chunk_elements=chunk_elements)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        with self.peft_model.disable_adapter():
            return self.scorer(tokens, attention_mask, **kwargs)


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


def make_policy_scorer(policy, *, strategy: str, device: str, share_prompt: bool = True):
    """The policy's :class:`ResponseLogProbs` as the loss must see it, averaging the
    gradients over the processes. ``strategy="ddp"``: wrapped in ``DistributedDataParallel``. ``strategy="fsdp"``:
    ``policy`` is sharded in place (``recipes.common.sharding.shard_policy``; build the optimizer afterwards). In
    a single process, the plain scorer either way. ``share_prompt``: ``train.share_prompt``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"make_policy_scorer: strategy={strategy!r}, expected one of {list(STRATEGIES)}.")
    if strategy == "fsdp" and PartialState().use_distributed:
        return ShardedResponseLogProbs(shard_policy(policy), share_prompt=share_prompt)
    return make_data_parallel_policy(_scorer(policy, share_prompt), device=device)


def _scorer(model, share_prompt: bool) -> ResponseLogProbs:
    """A :class:`ResponseLogProbs`; over several processes it takes the same path for every batch as a sharded one
    does (DDP and FSDP2 runs then compute the same numbers, which a bf16 run would otherwise not to 1e-4)."""
    scorer = ResponseLogProbs(model, share_prompt=share_prompt)
    scorer._same_path_on_every_process = PartialState().use_distributed
    return scorer


def make_reference_scorer(reference, *, policy, policy_scorer=None, share_prompt: bool = True):
    """The frozen reference's log-prob scorer (the KL term's): over ``reference``, the initial policy loaded beside
    the policy (sharded too under FSDP2), or, with ``reference=None`` and a LoRA ``policy``, the policy with its
    adapters switched off (its base weights never train). A sharded LoRA policy is scored through ``policy_scorer``,
    the FSDP2 forward that gathers its weights (which shares prompts as the policy's does)."""
    if reference is None:
        if not is_peft_model(policy):
            raise ValueError("make_reference_scorer: no reference model, and the policy has no adapters to switch off.")
        if is_sharded(policy):
            return AdapterDisabledLogProbs(policy, scorer=policy_scorer)
        return AdapterDisabledLogProbs(policy, scorer=_scorer(policy, share_prompt))
    if is_sharded(reference):
        return ShardedResponseLogProbs(reference, share_prompt=share_prompt)
    return _scorer(reference, share_prompt)
