"""An HF causal LM as a TorchRL policy: batched sampling with a KV cache that records each sampled token's log-prob.

Public names:

- :class:`SamplingSettings`: how responses are sampled (``max_new_tokens``, ``min_new_tokens``, ``do_sample``,
  ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``: the ``transformers.GenerationConfig``
  fields of the same names), from keyword arguments, a mapping (:meth:`SamplingSettings.from_mapping`) or a trl
  ``GRPOConfig`` (:meth:`SamplingSettings.from_grpo_config`).
- :func:`sample_responses`: one decoding loop over a dense left-padded batch of prompts, with a KV cache. At every
  step it keeps the sampled token's log-prob (under the raw logits, or at the sampling temperature as trl scores
  them), so the behaviour policy's log-probs cost no second forward pass, the first response token's included. A
  prompt held by several rows (a GRPO group) is run through the model once, a row that has ended leaves the
  decoding batch, and each token is drawn with one uniform number per row.
- :class:`CausalLMSampler`: that loop as a TensorDict module (a TorchRL policy), reading the prompt tokens an env
  wrote and writing the response, the dense ``[B, T]`` sequences, masks, log-probs and the policy version (tensors
  only). ``interop.TorchRLRolloutFunc`` samples with it for ``trl.GRPOTrainer``.
- :class:`KeptCache`: every row's KV cache after the loop (``sample_responses(keep_cache=True)``), which a later call
  over the same rows, their prompts grown (a dialog's next turn), takes as ``past`` to run only the new tokens.
- :func:`end_of_response_ids`: the token ids that end a response (the tokenizer's EOS and the model's).

Why not ``model.generate``: ``generate`` returns processed scores or, with ``output_logits=True``, every step's
``[B, V]`` logits (1.2 GB for 64 responses x 32 tokens at a 152k vocabulary); this loop keeps one log-prob per
token. It also samples among the top-k candidates instead of over the whole vocabulary, which is the same
distribution at a fraction of the cost.

Dependencies: torch, tensordict, and the ``transformers`` model and tokenizer the caller passes in (duck-typed: a
causal LM with a KV cache; a tokenizer with ``pad_token_id`` and ``eos_token_id``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from interop.errors import SettingError
from interop.sampling.decode_step import DecodeStep

__all__ = [
    "CausalLMSampler",
    "KeptCache",
    "check_pad_token",
    "SampledResponses",
    "SamplingSettings",
    "end_of_response_ids",
    "sample_responses",
]

# The keys :class:`CausalLMSampler` reads and writes: TorchRL's LLM layout (``TransformersWrapper``'s names).
PROMPT_TOKENS = ("tokens", "prompt")
PROMPT_MASK = ("masks", "prompt")
RESPONSE_TOKENS = ("tokens", "response")
TOKENS = ("tokens", "full")
ATTENTION_MASK = ("masks", "all_attention_mask")
LOG_PROBS = ("log_probs", "full")
TRUNCATED = "truncated"
POLICY_VERSION = "policy_version"
# trl.GRPOConfig's generation_kwargs that are sampler settings (trl names the others as GRPOConfig fields).
_GENERATION_KWARGS = ("min_new_tokens", "do_sample")


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled; the fields are the ``transformers.GenerationConfig`` fields of the same names.

    Keyword Args:
        max_new_tokens: the longest response, in tokens.
        min_new_tokens: EOS cannot be sampled before this many tokens.
        do_sample: ``False`` takes the most likely token at every step (greedy).
        temperature: divides the logits before sampling.
        top_k: sample among the ``top_k`` most likely tokens; ``None`` or 0: the whole vocabulary.
        top_p: then among the most likely tokens whose probability adds up to ``top_p`` (nucleus sampling).
        min_p: then drop the tokens less likely than ``min_p`` times the most likely one; ``None``: off.
        repetition_penalty: divides the positive logits (multiplies the negative ones) of every token already in the
            sequence, as ``transformers`` does; 1.0: off.
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        problems = []  # (field, what is wrong): the first is refused, naming its field (interop.errors.SettingError)
        if self.max_new_tokens < 1:
            problems.append(("max_new_tokens", f"max_new_tokens={self.max_new_tokens} must be >= 1"))
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(
                (
                    "min_new_tokens",
                    f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens] = [0, {self.max_new_tokens}]",
                )
            )
        if self.do_sample and self.temperature <= 0:
            problems.append(("temperature", f"temperature={self.temperature} must be > 0 when sampling"))
        elif self.do_sample and not math.isfinite(self.temperature):
            problems.append(
                ("temperature", f"temperature={self.temperature} must be a finite number (every logit divided by it)")
            )
        if self.top_k is not None and self.top_k < 0:
            problems.append(("top_k", f"top_k={self.top_k} must be >= 0 (0 or null: off)"))
        if not 0 < self.top_p <= 1:
            problems.append(("top_p", f"top_p={self.top_p} must be in (0, 1]"))
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            problems.append(("min_p", f"min_p={self.min_p} must be in [0, 1]"))
        if self.repetition_penalty <= 0:
            problems.append(("repetition_penalty", f"repetition_penalty={self.repetition_penalty} must be > 0"))
        elif not math.isfinite(self.repetition_penalty):
            problems.append(
                (
                    "repetition_penalty",
                    f"repetition_penalty={self.repetition_penalty} must be a finite number (1.0: off)",
                )
            )
        if problems:
            field, problem = problems[0]
            raise SettingError("SamplingSettings", problem + ".", field=field)

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names, in declaration order (what a config section may hold)."""
        return [field.name for field in fields(cls)]

    @classmethod
    def check_keys(cls, generation: Mapping) -> None:
        """Refuses a key of ``generation`` that is not a setting, naming it and the settings there are.

        Raises:
            SettingError: an unknown key (its ``field``).

        Examples:
            >>> SamplingSettings.check_keys({"max_new_tokens": 8, "typical_p": 0.9})
            Traceback (most recent call last):
            ...
            interop.errors.SettingError: SamplingSettings: typical_p: not a generation setting of CausalLMSampler ...
        """
        unknown = sorted(set(map(str, generation)) - set(cls.names()))
        if unknown:
            raise SettingError(
                "SamplingSettings",
                f"{unknown[0]}: not a generation setting of CausalLMSampler ({unknown} not supported; the settings "
                f"are {cls.names()}); check the spelling.",
                field=unknown[0],
            )

    @classmethod
    def from_mapping(cls, generation: Mapping) -> SamplingSettings:
        """The settings of a mapping (e.g. a config's generation node); a key that is not a field is refused
        (:meth:`check_keys`).

        Examples:
            >>> settings = SamplingSettings.from_mapping({"max_new_tokens": 8, "top_k": 50})
            >>> settings.top_k, settings.temperature, settings.min_new_tokens
            (50, 1.0, 0)
        """
        cls.check_keys(generation)
        return cls(**{str(name): value for name, value in dict(generation).items()})

    @classmethod
    def from_grpo_config(cls, args) -> SamplingSettings:
        """The settings a ``trl.GRPOConfig`` asks its generation for: ``max_completion_length``, ``temperature``,
        ``top_k`` (0 or ``None``: off), ``top_p``, ``min_p``, ``repetition_penalty``, and ``generation_kwargs``'
        ``min_new_tokens`` / ``do_sample``. Any other ``generation_kwargs`` entry is refused (the sampler would not
        apply it). ``args`` is read by attribute: a ``GRPOConfig``, or any object with those fields.

        Examples:
            >>> from types import SimpleNamespace
            >>> args = SimpleNamespace(max_completion_length=16, temperature=0.7, top_k=0, top_p=1.0, min_p=None,
            ...                        repetition_penalty=1.0, generation_kwargs=None)
            >>> SamplingSettings.from_grpo_config(args)
            SamplingSettings(max_new_tokens=16, min_new_tokens=0, do_sample=True, temperature=0.7, top_k=None, ...)
        """
        extra = dict(getattr(args, "generation_kwargs", None) or {})
        unknown = sorted(set(map(str, extra)) - set(_GENERATION_KWARGS))
        if unknown:
            raise ValueError(
                f"generation_kwargs.{unknown[0]}: CausalLMSampler does not take it (it takes "
                f"{list(_GENERATION_KWARGS)} there, and temperature, top_k, top_p, min_p, repetition_penalty as "
                "GRPOConfig fields); drop it."
            )
        return cls(
            max_new_tokens=int(args.max_completion_length),
            min_new_tokens=int(extra.get("min_new_tokens", 0)),
            do_sample=bool(extra.get("do_sample", True)),
            temperature=float(args.temperature),
            top_k=int(args.top_k) if args.top_k else None,
            top_p=float(args.top_p if args.top_p is not None else 1.0),
            min_p=args.min_p,
            repetition_penalty=float(args.repetition_penalty if args.repetition_penalty is not None else 1.0),
        )

    def differences(self, other: SamplingSettings) -> dict[str, tuple]:
        """The settings whose values differ: name -> (this value, the other's); ``top_k`` 0 and ``None`` alike.

        Examples:
            >>> SamplingSettings(max_new_tokens=8, top_k=0).differences(SamplingSettings(max_new_tokens=16))
            {'max_new_tokens': (8, 16)}
        """
        mine, theirs = self._normalised(), other._normalised()
        return {name: (mine[name], theirs[name]) for name in self.names() if mine[name] != theirs[name]}

    def _normalised(self) -> dict:
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        values["top_k"] = values["top_k"] or None
        values["min_p"] = values["min_p"] or None
        return values


@dataclass
class SampledResponses:
    """What :func:`sample_responses` returns, each ``[B, R]`` with ``R`` the longest response of the batch."""

    tokens: torch.Tensor  # the sampled tokens, the pad id after EOS
    mask: torch.Tensor  # bool, True up to and including EOS
    log_probs: torch.Tensor  # float32, each sampled token's log-prob under the model; 0 after EOS
    truncated: torch.Tensor  # [B] bool: no EOS within max_new_tokens
    kept: KeptCache | None = None  # with keep_cache=True, where the model's cache allows it: every row's KV cache


def check_thread_count(num_threads, *, owner: str) -> None:
    """Refuses a ``num_threads`` that is neither ``None`` nor a positive int, naming ``owner``."""
    if num_threads is None:
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(
            f"{owner}: num_threads must be a positive int, or None for the process's, got {num_threads!r}."
        )


@contextlib.contextmanager
def intra_op_threads(num_threads: int | None):
    """torch's intra-op thread count is ``num_threads`` inside the block and what it was after (``None``: unchanged).

    A decoding step of a small model is many small ops between Python calls, which more threads slow down while the
    same model's training passes gain from them (docs/benchmarks.md): a sampler can run on fewer threads than its
    process trains on."""
    previous = torch.get_num_threads()
    if num_threads is None or num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _forward_options(model) -> tuple[dict, str]:
    """``logits_to_keep=1`` where the model takes it (no prefill logits over the whole prompt), and the name of its
    KV-cache argument (``cache`` in recent transformers 5 releases, ``past_key_values`` before)."""
    parameters = inspect.signature(model.forward).parameters
    prefill = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
    return prefill, "cache" if "cache" in parameters else "past_key_values"


def _forwards_are_collective(model) -> bool:
    # FSDP2 gathers the weights in each forward: every rank of the group must run as many forward passes.
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and torch.distributed.is_initialized()


def _any_rank_running(decoding: bool, synced: bool, device: torch.device) -> bool:
    """Whether this rank (any rank, when ``synced``) still has a row decoding."""
    if not synced:
        return decoding
    flag = torch.tensor(int(decoding), device=device)  # on the model's device: the one this rank's backend moves
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag)


def _penalise_repetitions(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
    return torch.where(seen, penalised, scores)


def _shifted_exp(scores: torch.Tensor, temperature: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``exp((scores - max) / temperature)`` per row, into ``out`` when given: probabilities up to a factor per row,
    the most likely token's exactly 1."""
    peak = scores.amax(-1, keepdim=True)
    out = torch.sub(scores, peak, out=out) if out is not None else scores - peak
    if temperature != 1.0:
        out.div_(temperature)
    return out.exp_()


def _draw(weights: torch.Tensor, uniform: torch.Tensor | None = None, *, ordered: bool | None = None) -> torch.Tensor:
    """One column per row, column ``i`` with probability ``weights[i] / sum(weights)`` (``weights`` >= 0, not
    normalised; overwritten with their cumulative sum).

    Inverse-CDF sampling: one uniform number per row (``uniform``, ``[B, 1]``; drawn here when ``None``) and a binary
    search of the row's cumulative sum. Why not ``torch.multinomial`` or ``argmax(p / E)`` with ``E ~ Exp(1)``: both
    draw a random number per column, which over a 152k vocabulary costs about as much as the model's forward pass
    (a whole sampling step at 16 x 152k on one core: 101 ms with ``argmax(p / E)``, 9 ms this way). A column of
    weight 0 spans an empty interval (its cumulative sum equals the previous one) and is never drawn.

    ``ordered``: whether ``cumsum`` adds in column order, as torch's CPU kernel does (in float64): its sums then never
    decrease and stay equal across a zero. A parallel scan (CUDA) may round two equal prefixes one ulp apart, so
    otherwise :func:`_flat_across_zeros` evens them out. ``None``: ordered on CPU only.
    """
    if uniform is None:
        uniform = torch.rand(weights.shape[0], 1, device=weights.device)
    empty = None if (weights.device.type == "cpu" if ordered is None else ordered) else weights == 0
    cdf = weights.cumsum_(-1)
    if empty is not None:
        cdf = _flat_across_zeros(cdf, empty)
    total = cdf[:, -1:]
    # rand() < 1, but rand() * total can round up to total: keep the point strictly inside the last interval.
    point = torch.minimum(uniform * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_max(weights.shape[-1] - 1)


def _flat_across_zeros(cdf: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Cumulative sums with the bound of each ``empty`` (zero-weight) column taken from the columns before it (-inf
    before the first weight), and nondecreasing: whatever the sums' rounding, such a column's interval is empty."""
    return cdf.masked_fill_(empty, float("-inf")).cummax(-1).values


# Top-k over a large vocabulary looks only at the columns of the k blocks of _TOP_K_BLOCK columns with the highest
# maxima (when they are at most a quarter of the row): torch's CPU topk costs about 1.3 ns a column, a blocked
# maximum about 0.2 ns (k=50 of 16 rows x 151,936 columns: 3.20 -> 1.24 ms a token at 1 thread, 1.64 -> 0.69 ms at
# 2; scripts/bench_sampler_head.py).
_TOP_K_BLOCK = 64


def _top_k(scores: torch.Tensor, settings: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, token ids)`` of each row's ``settings.top_k`` highest scores (in order when top-p needs them).

    Over a large vocabulary, the k highest of the columns of the k blocks with the highest maxima: the same values as
    ``topk`` over the whole row. Each of those k maxima is a column of its own, so the row's k-th highest score is at
    least the k-th highest maximum, and a block left out holds no score above it. Only which of several equal scores
    is taken may differ (``topk`` itself leaves that unspecified)."""
    assert settings.top_k is not None, "_top_k is called only with a top_k set"
    rows, vocabulary = scores.shape
    k, ordered = min(settings.top_k, vocabulary), settings.top_p < 1.0
    blocks = vocabulary // _TOP_K_BLOCK
    if 4 * k > blocks or scores.stride(-1) != 1 or scores.device.type != "cpu":  # CUDA's topk: not measured
        return scores.topk(k, dim=-1, sorted=ordered)
    body = blocks * _TOP_K_BLOCK
    maxima = scores[:, :body].unflatten(-1, (blocks, _TOP_K_BLOCK)).amax(-1)
    chosen = maxima.topk(k, dim=-1, sorted=False).indices
    offsets = torch.arange(_TOP_K_BLOCK, device=scores.device)
    columns = (chosen[:, :, None] * _TOP_K_BLOCK + offsets).flatten(1)
    if body < vocabulary:  # the last, partial block: always a candidate
        tail = torch.arange(body, vocabulary, device=scores.device).expand(rows, -1)
        columns = torch.cat([columns, tail], dim=1)
    values, where = scores.gather(-1, columns).topk(k, dim=-1, sorted=ordered)
    return values, columns.gather(-1, where)


def _choose(
    scores: torch.Tensor,
    settings: SamplingSettings,
    *,
    uniform: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row from already penalised scores: greedy, or sampled after temperature, top-k, top-p, min-p.

    ``uniform`` (``[B, 1]``): the row's uniform number for :func:`_draw` (drawn here when ``None``). ``workspace``: a
    ``[B, V]`` float32 buffer the whole-vocabulary probabilities may be written into (no allocation per token).
    ``top_k``: :func:`_top_k` of ``scores``, when the caller has taken it already.
    """
    if not settings.do_sample:
        return scores.argmax(-1)
    candidates = None  # column -> token id, when the scores are narrowed or sorted
    nucleus = settings.top_p < 1.0  # the only filter that needs the candidates in order
    if settings.top_k:
        scores, candidates = top_k if top_k is not None else _top_k(scores, settings)
    elif nucleus:
        scores, candidates = scores.sort(dim=-1, descending=True)
    # Temperature after narrowing, which a positive temperature does not reorder: k divisions instead of V.
    weights = _shifted_exp(scores, settings.temperature, out=workspace if candidates is None else None)
    if nucleus:
        # Keep a token while the tokens more likely than it add up to less than top_p (always the most likely one).
        cumulative = weights.cumsum(-1)
        weights.masked_fill_(cumulative - weights >= settings.top_p * cumulative[:, -1:], 0.0)
    if settings.min_p:
        weights.masked_fill_(weights < settings.min_p, 0.0)  # relative to the most likely token's weight, 1
    column = _draw(weights, uniform)
    return column if candidates is None else candidates.gather(-1, column[:, None]).squeeze(-1)


def _log_normaliser(
    logits: torch.Tensor, temperature: float | None, workspace: torch.Tensor, *, peak: torch.Tensor | None = None
) -> torch.Tensor:
    """``(logits / temperature).logsumexp(-1)`` with its ``[B, V]`` intermediate, ``exp((logits - max) / temperature)``,
    left in ``workspace``: one buffer for the whole decoding loop, where ``logsumexp`` allocates one at every call (64
    rows at a 152k vocabulary, this buffer and the draw's: 4.19 -> 3.44 s CPU per 32-token batch; alike at 16
    rows). ``peak``: each row's largest logit (``[B, 1]``), when the caller knows it (no pass over the vocabulary
    for it)."""
    if peak is None:
        peak = logits.amax(-1, keepdim=True)
    peak = peak.masked_fill(~peak.isfinite(), 0.0)
    torch.sub(logits, peak, out=workspace)
    if temperature:
        workspace.div_(temperature)
        peak = peak / temperature
    return workspace.exp_().sum(-1).log_().add_(peak.squeeze(-1))


def _draws_from_the_normaliser(settings: SamplingSettings, *, penalised: bool, temperature: float) -> bool:
    """Whether a token is drawn from the whole vocabulary's logits as they are, at ``temperature``: sampling with no
    top-k, top-p, min-p or repetition penalty (trl's defaults), at the temperature the log-probs are scored at."""
    narrowed = settings.top_k or settings.top_p < 1.0 or settings.min_p
    return settings.do_sample and not narrowed and not penalised and settings.temperature == temperature


def _next_tokens(
    logits: torch.Tensor,
    *,
    step: int,
    settings: SamplingSettings,
    eos: torch.Tensor,
    seen,
    scaled: bool,
    uniform: torch.Tensor | None,
    workspace: torch.Tensor,
):
    """Every row's next token from the raw logits of its last position (repetition penalty, ``min_new_tokens``, then
    :func:`_choose` with ``uniform``), and each token's log-prob under those logits (divided by
    ``settings.temperature`` first when ``scaled``, as trl scores them).

    ``logits`` (``[B, V]`` float32) is this step's own and may be written over: held-back EOS columns are set to -inf
    in place, after the log-prob's normaliser is taken and without changing any sampled token's logit (a held-back EOS
    is never sampled). A copy would cost a ``[B, V]`` write per token (37 ms for 64 rows at a 152k vocabulary).
    ``workspace`` is a ``[B, V]`` float32 buffer for the normaliser's and the draw's intermediates, reused at every
    step.
    """
    temperature = settings.temperature if scaled and settings.temperature != 1.0 else None
    top_k, peak = None, None
    if settings.do_sample and settings.top_k and seen is None:
        # Top-k of the scores the draw reads (no penalty): its candidates, and their largest value is the row's
        # largest logit, the normaliser's peak, but for the EOS columns held back, whose own logits are the rest of
        # it: one pass over the vocabulary fewer (its amax).
        if step < settings.min_new_tokens and eos.numel():
            held = logits[:, eos]
            logits.index_fill_(-1, eos, float("-inf"))
            top_k = _top_k(logits, settings)
            logits[:, eos] = held  # the normaliser sums every token's probability, EOS's included
            peak = torch.maximum(top_k[0].amax(-1, keepdim=True), held.amax(-1, keepdim=True))
        else:
            top_k = _top_k(logits, settings)
            peak = top_k[0].amax(-1, keepdim=True)
    normaliser = _log_normaliser(logits, temperature, workspace, peak=peak)
    if _draws_from_the_normaliser(settings, penalised=seen is not None, temperature=temperature or 1.0):
        # The normaliser left exp((logits - max) / temperature) in the workspace: the draw's weights already, a
        # held-back EOS given weight 0 (16 rows at a 152k vocabulary: 11% less CPU per batch than recomputing them).
        if step < settings.min_new_tokens:
            workspace.index_fill_(-1, eos, 0.0)
        token = _draw(workspace, uniform)
    else:
        scores = logits
        if seen is not None:
            scores = _penalise_repetitions(scores, seen, settings.repetition_penalty)
        if step < settings.min_new_tokens:
            scores.index_fill_(-1, eos, float("-inf"))
        token = _choose(scores, settings, uniform=uniform, workspace=workspace, top_k=top_k)
    chosen = logits.gather(-1, token[:, None]).squeeze(-1)
    return token, (chosen / temperature if temperature else chosen) - normaliser


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def _rows_can_be_copied(cache) -> bool:
    """Whether a KV cache's rows can be repeated or dropped (``batch_repeat_interleave``, ``batch_select_indices``)
    with nothing left behind: a ``DynamicCache`` of attention layers, whose rows are keys and values only. A
    recurrent, static, quantized or offloaded cache keeps state that such a copy would miss."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:
        return False
    return (
        type(cache) is DynamicCache
        and not getattr(cache, "offloading", False)
        and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)
    )


def _rows_can_be_kept(cache) -> bool:
    """Whether each row's cache can be kept past the loop and extended later (:class:`KeptCache`): rows that can be
    copied, of full-attention layers only. A sliding-window layer drops its oldest columns, which the kept attention
    mask would still count."""
    if not _rows_can_be_copied(cache):
        return False
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


class KeptCache:
    """The KV cache of every row of a :func:`sample_responses` batch, kept after its loop
    (``sample_responses(keep_cache=True)``), so that a later call over the same rows, their contexts now longer
    (a dialog's next turn), runs only the tokens the cache does not hold yet.

    A row's cache holds its prompt and every response token but the last (sampled, never fed to the model).
    Rows leave the decoding loop at different steps, so each row is kept with its own columns and the mask of the
    columns that hold its tokens; :meth:`select` picks the rows that go on, in a new order.
    """

    def __init__(self, pieces: list, held: list[torch.Tensor], where: list[tuple[int, int]]):
        # pieces: (per-layer (keys, values) [n, H, L, D], mask [n, L] bool) of rows that left the loop together;
        # held: each row's token ids in its cache, in order; where: each row's (piece, row in the piece).
        self._pieces, self._held, self._where = pieces, held, where

    def __len__(self) -> int:
        return len(self._held)

    def held_ids(self, row: int) -> list[int]:
        """The token ids row ``row``'s cache holds (its prompt and its response but the last token)."""
        return self._held[row].tolist()

    def select(self, rows: Sequence[int]) -> KeptCache:
        """The rows ``rows`` (indices into this batch), in that order; the tensors are shared, not copied."""
        return KeptCache(self._pieces, [self._held[row] for row in rows], [self._where[row] for row in rows])

    def _assemble(self):
        """``(layers, mask, counts)``: the rows' caches as one batch, each row's tokens in its last ``counts[row]``
        columns (left-padded with zeros, mask 0), so that appended tokens follow every row's own last token."""
        counts = torch.tensor([len(ids) for ids in self._held])
        width = int(counts.max())
        first_layers, first_mask = self._pieces[0]
        device = first_mask.device
        counts = counts.to(device)
        layers = [
            tuple(part.new_zeros(len(self), part.shape[1], width, part.shape[3]) for part in pair)
            for pair in first_layers
        ]
        by_piece: dict[int, list[tuple[int, int]]] = {}
        for out_row, (piece, in_piece) in enumerate(self._where):
            by_piece.setdefault(piece, []).append((out_row, in_piece))
        for piece, pairs in by_piece.items():
            piece_layers, piece_mask = self._pieces[piece]
            out_rows = torch.tensor([out_row for out_row, _ in pairs], device=device)
            in_rows = torch.tensor([in_piece for _, in_piece in pairs], device=device)
            held = piece_mask[in_rows]
            row, column = held.nonzero(as_tuple=True)  # row-major: each row's columns in order
            rank = held.long().cumsum(-1)[row, column] - 1
            target_row = out_rows[row]
            target_column = width - counts[target_row] + rank
            for (keys, values), (piece_keys, piece_values) in zip(layers, piece_layers):
                keys[target_row, :, target_column] = piece_keys[in_rows[row], :, column]
                values[target_row, :, target_column] = piece_values[in_rows[row], :, column]
        mask = torch.arange(width, device=device) >= width - counts[:, None]
        return layers, mask.long(), counts


def _distinct_prompts(tokens: torch.Tensor, mask: torch.Tensor):
    """``(first, inverse, repeats)``: one row of each distinct prompt (``[D]``, in order of first appearance), each
    row's prompt among them (``[B]``), and ``n`` when the rows are ``D`` consecutive groups of ``n`` (GRPO's layout;
    ``None`` otherwise). ``None`` when no two rows hold the same prompt."""
    distinct, inverse = torch.unique(tokens.masked_fill(mask == 0, -1), dim=0, return_inverse=True)
    count, batch = distinct.shape[0], tokens.shape[0]
    if count == batch:
        return None
    rows = torch.arange(batch, device=tokens.device)
    first = rows.new_full((count,), batch).scatter_reduce_(0, inverse, rows, "amin")
    order = first.argsort()  # unique sorts the prompts; number them by first appearance instead
    inverse = order.argsort()[inverse]
    repeats = batch // count
    grouped = batch % count == 0 and torch.equal(inverse, rows[:count].repeat_interleave(repeats))
    return first[order], inverse, repeats if grouped else None


def _prefill(model, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, options: dict, *, share: bool):
    """The forward pass over the prompts: the logits of each row's last position (``[B, V]``) and the KV cache.

    ``share``: a prompt held by several rows (GRPO samples a group of responses to each prompt) is run once and its
    cache rows and logits repeated across its rows: the same keys and values for a fraction of the prefill's cost.
    When the model's cache cannot be copied row to row (:func:`_rows_can_be_copied`, known only once a forward pass
    has returned it), every row is run after all: the distinct prompts' pass, a fraction of the prefill, is lost.
    """
    distinct = _distinct_prompts(tokens, mask) if share else None
    if distinct is not None:
        first, inverse, repeats = distinct
        out = model(
            input_ids=tokens[first],
            attention_mask=mask[first],
            position_ids=positions[first],
            use_cache=True,
            **options,
        )
        cache = _cache_of(out)
        if _rows_can_be_copied(cache):
            if repeats is not None:
                cache.batch_repeat_interleave(repeats)
                return out.logits[:, -1].repeat_interleave(repeats, dim=0), cache
            cache.batch_select_indices(inverse)
            return out.logits[:, -1][inverse], cache
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, **options)
    return out.logits[:, -1], _cache_of(out)


def _prefill_after(
    model, past: KeptCache, tokens: torch.Tensor, mask: torch.Tensor, options: dict, cache_argument: str, pad: int
):
    """The forward pass over what each row's context (``tokens``, left-padded, ``mask`` its real tokens) adds to the
    tokens ``past`` holds: ``(logits [B, V], cache, mask of the cache's columns, positions of the appended tokens)``.

    The appended tokens differ in number from row to row: they are left-padded after the kept columns (mask 0 in the
    holes), and their positions are counted from each row's own tokens, as a forward pass over the whole context
    would number them.
    """
    from transformers.cache_utils import DynamicCache

    if len(past) != tokens.shape[0]:
        raise ValueError(f"sample_responses: past holds {len(past)} rows, the batch has {tokens.shape[0]}.")
    contexts = [row[keep.bool()] for row, keep in zip(tokens, mask)]
    tails = []
    for index, context in enumerate(contexts):
        held = past._held[index].to(context.device)
        if len(held) >= len(context) or not torch.equal(context[: len(held)], held):
            raise ValueError(
                f"sample_responses: row {index}'s context ({len(context)} tokens) does not extend the {len(held)} "
                "tokens its kept cache holds; pass past only with the same rows, their contexts grown by new tokens "
                "(KeptCache.select picks and orders the rows)."
            )
        tails.append(context[len(held) :])
    width = max(len(tail) for tail in tails)
    new_tokens = tokens.new_full((len(tails), width), pad)
    new_mask = mask.new_zeros(len(tails), width, dtype=torch.long)
    for index, tail in enumerate(tails):
        new_tokens[index, width - len(tail) :] = tail
        new_mask[index, width - len(tail) :] = 1
    layers, kept_mask, counts = past._assemble()
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    full_mask = torch.cat([kept_mask.to(new_mask.device), new_mask], dim=-1)
    positions = (counts.to(new_mask.device)[:, None] + new_mask.cumsum(-1) - 1).clamp_min(0)
    out = model(
        input_ids=new_tokens,
        attention_mask=full_mask,
        position_ids=positions,
        use_cache=True,
        **{cache_argument: cache},
        **options,
    )
    return out.logits[:, -1], _cache_of(out), full_mask, positions


class _Keeper:
    """Collects each row's KV cache as rows leave the decoding loop, for :class:`KeptCache`."""

    def __init__(self):
        self.pieces, self.rows = [], []

    def take(self, cache, rows: torch.Tensor, which: torch.Tensor | None, mask: torch.Tensor) -> None:
        """Keeps rows ``which`` of the decoding batch (all when ``None``), ``rows`` their rows in the whole batch."""
        # Indexing copies: the kept tensors outlive the batch's cache, which drops or grows rows after this.
        layers = [
            (layer.keys, layer.values) if which is None else (layer.keys[which], layer.values[which])
            for layer in cache.layers
        ]
        self.pieces.append((layers, (mask if which is None else mask[which]).bool()))
        self.rows.append(rows if which is None else rows[which])

    def kept(self, prompt_tokens, prompt_mask, responses: _ResponsesSoFar, prefilled: int) -> KeptCache:
        """The :class:`KeptCache`: each row's columns past the first ``prefilled`` (the response's) count only up to
        the row's last fed token (a finished row still in the batch fed pads after its EOS)."""
        lengths = responses.lengths
        where: dict[int, tuple[int, int]] = {}  # every row: the last take() keeps the rows still decoding
        for piece, ((_, mask), rows) in enumerate(zip(self.pieces, self.rows)):
            steps = torch.arange(mask.shape[1] - prefilled, device=mask.device)
            mask[:, prefilled:] &= steps < (lengths[rows] - 1)[:, None]
            for in_piece, row in enumerate(rows.tolist()):
                where[row] = (piece, in_piece)
        held = [
            torch.cat([context[keep.bool()], response[: int(length) - 1]]).cpu()
            for context, keep, response, length in zip(prompt_tokens, prompt_mask, responses.tokens, lengths)
        ]
        return KeptCache(self.pieces, held, [where[row] for row in range(prompt_tokens.shape[0])])


# Finished rows leave the decoding batch once more than this fraction of its rows have finished: at every step that
# finishes one. Leaving copies the kept rows' KV cache (as DynamicCache's own concatenation does at every step) and
# their per-row buffers, once; a finished row that stays costs its forward pass and its [V] normaliser at every later
# step. CPU time of one 32-token batch (one thread, shared machine) when rows leave past 0 / 25% / 50% finished /
# never: 16 rows at a 152k vocabulary, no top-k 0.94 / 1.05 / 1.10 / 1.13 s, top-k 50 0.66 / 0.70 / 0.74 / 0.74 s;
# 64 rows of the tiny policy 155 / 151 / 154 / 160 ms (alike within noise).
_DROP_FINISHED_AT = 0.0


# The output head's product is computed weight-first (``W @ x.T``) during sampling where that is faster than
# ``F.linear``'s ``x @ W.T``: on CPU, for a float32 head of at least this many weights. Decoding feeds the head a few
# rows at a time, and CPU GEMM kernels run ``x @ W.T`` with few rows of ``x`` far below their speed with many rows of
# ``W`` (2 threads, 16 rows: 169 -> 84 ms at 151,936 x 512, 9.4 -> 4.8 ms at 16,384 x 256; 1 thread: 188 -> 132 ms
# and 9.4 -> 7.8 ms). Smaller heads are left alone (0.6-0.8x at the tiny models' 463 x 64, where it costs 0.01 ms).
# On a GPU both orders run at the same speed.
_ROWS_FIRST_MIN_WEIGHTS = 1 << 21


_FEW_ROWS_HEAD = "_few_rows_head"  # the head's attribute holding its _FewRowsHead while a sampling loop runs


# MKL's ``W @ x.T`` at a real vocabulary is far from monotonic in the number of rows of ``x``: 1 row and 12-15 rows
# take longer than 2 and 16 (2 threads, 151,936 x 512, ms per product alone on the machine: 1: 36.6, 2: 10.9,
# 9: 28.7, 10: 36.0, 11: 45.9, 12: 55.6, 13: 67.6, 14: 67.7, 15: 77.4, 16: 46.2). Those counts are padded with zero
# rows up to the faster one; only the real rows are copied out, so the logits are the same products, summed in the
# order the kernel picks for that width (equal up to float rounding). Side by side in one process
# (``scripts/bench_sampler_head.py``, a loaded machine, medians of 15-21 rounds), padded / as is: 1 -> 2 rows
# 0.52-0.83, 12 -> 16 0.75-0.90, 13-15 -> 16 0.65-0.83. Left as they are: 11 (0.90-1.02), 9-10 (1.06-1.34) and 3-8
# (no larger count is faster there). Splitting the weight into row blocks of 2,048-16,384 was slower at 16 rows
# (1.4-4.3x). Decoding hits these counts whenever responses end at EOS and their rows leave the batch, in a loop that
# holds no packed weight (below) or, for 1 row, in any.
_HEAD_PADDED_ROWS = {1: 2, 12: 16, 13: 16, 14: 16, 15: 16}


# From this many rows on, oneDNN's linear over a weight packed once into its blocked layout
# (``torch.ops.mkldnn._reorder_linear_weight``, the packing inductor's CPU freezing uses) runs the head's product far
# faster than MKL's ``W @ x.T``: the weights stay fixed for a whole sampling loop, so the loop packs them once, at its
# first head call with at least ``_PACKED_MIN_ROWS`` rows, and drops the copy on leaving (``V x H`` more floats while
# it runs: 311 MB at 151,936 x 512). 2 threads, 151,936 x 512, ms per product (``scripts/bench_sampler_head.py``):
#   rows                      1     2     3     4     8    12    16    32
#   MKL's W @ x.T          33.9   9.6  11.3  17.0  20.2  55.3  48.0  66.3   (1 row padded to 2: 10.2, 12 to 16: 47.8)
#   oneDNN, packed weight  13.3  14.4  12.6  11.7  13.4  14.5  17.0  27.4
# 1-3 rows stay on MKL's (padded) product. Packing costs 100-140 ms, which a 16-row loop wins back in 4-5 decoding
# steps (9-11 rows: 4-9); a loop that starts with fewer than 9 rows gains at most 5-9 ms a token, and one of fewer than
# 8 tokens (a short dialog turn) cannot win the packing back: neither packs. The logits are the same products summed
# in another order: within 2.5e-6 of float64's at logits of about 2 (MKL's: 1.0e-6).
_PACKED_FROM_ROWS = 4
_PACKED_MIN_ROWS = 9
_PACKED_MIN_CALLS = 8


def _loop_packs_head(rows: int, head_calls: int) -> bool:
    """Whether a sampling loop that starts with ``rows`` rows and makes at most ``head_calls`` head calls (its
    ``max_new_tokens``) packs a weight-first head's weight, where this torch can (:func:`_packing_available`)."""
    return rows >= _PACKED_MIN_ROWS and head_calls >= _PACKED_MIN_CALLS


def _packing_available() -> bool:
    """Whether the sampler packs the head's weight: this torch's CPU build has oneDNN and its weight packing, on
    x86-64, where the figures above were measured (Arm builds' oneDNN runs on other kernels, unmeasured here)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class _FewRowsHead:
    """A sampling loop's state for its output head, reused from one decoding step to the next.

    The weight-first product's buffers: the ``[padded, H]`` input (its padding rows zero), the ``[V, padded]`` product
    and two ``[rows, V]`` outputs. At a real vocabulary each output is megabytes that a fresh allocation maps anew and
    page-faults on its first write (16 rows at 152k: 9.7 MB each, every token). The row-layout logits alternate
    between two buffers, so that a step's logits stay intact while the next step's are computed. Only the current
    shape's are held: the rows only shrink within a sampling loop (finished rows are dropped), and a shape once left
    does not come back.

    And the weight packed for oneDNN (:meth:`packed_weight`), once per loop where ``packing``
    (:func:`_loop_packs_head`)."""

    def __init__(self, *, packing: bool = True) -> None:
        self._key: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self._packed: torch.Tensor | None = None
        self._packing = packing and _packing_available()

    def take(self, rows: int, vocabulary: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input, product, out)`` for ``rows`` rows of ``like``'s width: ``input`` has
        ``_HEAD_PADDED_ROWS.get(rows, rows)`` rows, the extra ones zero."""
        key = (rows, vocabulary, like.shape[-1], like.dtype, like.device)
        if key != self._key:
            self._buffers = []  # the old shape's freed before the new one's are allocated
            padded = _HEAD_PADDED_ROWS.get(rows, rows)
            self._key = key
            self._buffers = [like.new_zeros(padded, like.shape[-1]), like.new_empty(vocabulary, padded)]
            self._buffers += [like.new_empty(rows, vocabulary), like.new_empty(rows, vocabulary)]
        source, product, *outs = self._buffers
        self._turn ^= 1
        return source, product, outs[self._turn]

    def packed_weight(self, weight: torch.Tensor, rows: int) -> torch.Tensor | None:
        """``weight`` packed for oneDNN's linear when ``rows`` rows are best computed with it (from
        ``_PACKED_FROM_ROWS`` rows, in a loop that packs), packed at the loop's first such call; ``None``: the
        weight-first product."""
        if rows < _PACKED_FROM_ROWS or not self._packing:
            return None
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        return self._packed


def _head_for_few_rows(self, hidden: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` for a sampling loop's few rows: oneDNN's product over the packed weight where the loop
    holds one (:meth:`_FewRowsHead.packed_weight`), else ``(W @ x.T).T``, ``x`` padded with zero rows where that count
    is faster (``_HEAD_PADDED_ROWS``). The same products, summed in another order (equal up to float rounding)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows, vocabulary = flat.shape[0], self.weight.shape[0]
    state = getattr(self, _FEW_ROWS_HEAD, None)
    # oneDNN's op has no autocast rule: under autocast (or with hidden states of another dtype) torch.mm casts.
    plain_float32 = flat.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    packed = state.packed_weight(self.weight, rows) if state is not None and plain_float32 else None
    if packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
        return out.reshape(*hidden.shape[:-1], vocabulary)
    if state is None:  # called outside a sampling loop: fresh tensors (autograd refuses ``out=`` with a gradient)
        padding = flat.new_zeros(_HEAD_PADDED_ROWS.get(rows, rows) - rows, flat.shape[-1])
        product = torch.mm(self.weight, torch.cat([flat, padding]).t())
        out = torch.empty(rows, vocabulary, dtype=product.dtype, device=product.device)
    else:
        source, product, out = state.take(rows, vocabulary, flat)
        if source.shape[0] > rows:  # padded: the real rows first, the zero rows after them untouched
            source[:rows] = flat
            flat = source
        torch.mm(self.weight, flat.t(), out=product)
    _into_rows(product, out)
    if self.bias is not None:
        out += self.bias
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


def _into_rows(product: torch.Tensor, out: torch.Tensor) -> None:
    """The first ``out.shape[0]`` columns of the ``[V, padded]`` product into the ``[rows, V]`` ``out``, through a 3D
    view: torch copies a 2D transposed tensor (``.t().contiguous()``) on one thread by blocks, a 3D permuted one with
    its parallel copy kernel (16 rows at a 152k vocabulary, 2 threads: 1.8 -> 0.9 ms a token). The same values."""
    rows = out.shape[0]
    out.view(rows, 1, -1).copy_(product[:, None, :rows].permute(2, 1, 0))


@contextlib.contextmanager
def _output_head_for_few_rows(model, *, skip: bool = False, rows: int, head_calls: int):
    """While sampling, the model's output head (``get_output_embeddings()``) computes its product weight-first
    (:func:`_head_for_few_rows`) where that is faster: a plain float32 ``nn.Linear`` on CPU of at least
    ``_ROWS_FIRST_MIN_WEIGHTS`` weights, whose ``forward`` no one else has replaced (accelerate's hooks, an adapter).
    The model's own forward still runs (any scaling or capping after the head included); the head's ``forward`` is
    restored on leaving, whatever happens inside. ``skip``: leave the head alone (FSDP2 shards it); ``rows`` and
    ``head_calls``: the loop's, which decide whether it packs the weight for oneDNN (:func:`_loop_packs_head`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) and not skip else None
    if (
        type(head) is not torch.nn.Linear
        or "forward" in vars(head)
        or type(head.weight.data) is not torch.Tensor
        or head.weight.device.type != "cpu"
        or head.weight.dtype != torch.float32
        or head.weight.numel() < _ROWS_FIRST_MIN_WEIGHTS
    ):
        yield
        return
    head.forward = _head_for_few_rows.__get__(head)  # type: ignore[method-assign]  # this instance only, undone below
    setattr(head, _FEW_ROWS_HEAD, _FewRowsHead(packing=_loop_packs_head(rows, head_calls)))
    try:
        yield
    finally:
        del head.forward
        delattr(head, _FEW_ROWS_HEAD)


def sample_responses(
    model,
    prompt_tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    settings: SamplingSettings,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    log_probs_at_temperature: bool = False,
    keep_cache: bool = False,
    past: KeptCache | None = None,
) -> SampledResponses:
    """Samples one response per row of a left-padded batch of prompts.

    Positions follow the attention mask (``cumsum - 1``), as ``generate`` sets them, so a row scores the same
    whatever padding it shares a batch with. Decoding stops once every row has sampled an EOS id, or after
    ``settings.max_new_tokens`` tokens.

    With a ``DynamicCache`` of attention layers (``transformers``' default), a prompt held by several rows (a GRPO
    group) is run through the model once and its KV cache repeated across its rows, and a row that has sampled EOS
    leaves the decoding batch: later forward passes compute only the rows still decoding. Neither changes what a row
    samples: each step draws one uniform number per row of the whole batch, whichever rows are still decoding.

    A model sharded with FSDP2 (``torch``'s ``fully_shard``) all-gathers its weights in every forward pass, a
    collective that every rank must join: there every row goes through every forward pass (no shared prefill, no
    dropped rows), decoding stops once every row of every rank has sampled an EOS id, and the responses are those the
    rank would have sampled alone.

    With ``keep_cache``, each row's KV cache is returned (:attr:`SampledResponses.kept`, a :class:`KeptCache`), and a
    later call given it as ``past`` with the same rows, each row's prompt now its earlier prompt, its response and
    more tokens (a dialog's next turn), runs only the tokens the cache does not hold: the last response token and
    what follows it. The draw is the one a full forward pass over the prompts would give (the logits agree up to
    float rounding), from the same random numbers. ``kept`` is ``None`` where the cache cannot be kept: under FSDP2
    (every row stays in every forward pass), or a cache that is not a ``DynamicCache`` of full-attention layers
    (:func:`_rows_can_be_kept`); the caller then passes the whole prompts again.

    Args:
        model: a ``transformers`` causal LM (with a KV cache).
        prompt_tokens: ``[B, P]`` token ids, left-padded.
        prompt_mask: ``[B, P]``, 1 or ``True`` on real tokens.

    Keyword Args:
        settings: the sampling settings.
        eos_token_ids: the ids that end a response (the tokenizer's EOS, and any the model's generation config adds).
        pad_token_id: written after a row's EOS.
        log_probs_at_temperature: record ``log_softmax(logits / temperature)[token]``, as trl's ``GRPOTrainer``
            scores its completions, instead of the raw logits' log-prob.
        keep_cache: return every row's KV cache in :attr:`SampledResponses.kept`, where the model's cache allows.
        past: the rows' caches from an earlier call (:meth:`KeptCache.select` to pick and order them); each row of
            ``prompt_tokens`` must start with the tokens its cache holds.

    Returns:
        :class:`SampledResponses`. Each log-prob is ``log_softmax(logits)[token]`` of the model's raw logits
        (float32; divided by the temperature first with ``log_probs_at_temperature``), before any top-k, top-p or
        penalty: the quantity a loss recomputes.
    """
    synced = _forwards_are_collective(model)
    # Inference mode spares every op autograd's bookkeeping (64 rows x 32 tokens of the tiny policy, one thread: 133
    # -> 117 ms a batch on a loaded machine); not under FSDP2, whose forward writes the gathered weights into the
    # model's parameters. What comes back is copied out as ordinary tensors, that a loss may read and a caller change
    # in place; a kept cache's tensors stay inference tensors, for a later call's ``past``.
    head = _output_head_for_few_rows(model, skip=synced, rows=len(prompt_tokens), head_calls=settings.max_new_tokens)
    with torch.no_grad() if synced else torch.inference_mode(), head:
        eos = torch.tensor(sorted(set(eos_token_ids)), device=prompt_tokens.device)
        responses = _ResponsesSoFar(prompt_tokens, settings.max_new_tokens, pad_token_id=pad_token_id, eos=eos)
        logits, batch = _prefilled_batch(model, prompt_tokens, prompt_mask, settings, past, pad_token_id, synced=synced)
        drop_finished = not synced and _rows_can_be_copied(batch.cache)
        keeper = _Keeper() if keep_cache and drop_finished and _rows_can_be_kept(batch.cache) else None
        prefilled = batch.mask.shape[1]  # the cache's columns before the response's
        options = {"scaled": log_probs_at_temperature, "synced": synced, "drop_finished": drop_finished}
        _decode(model, logits, batch, responses, settings, eos=eos, keeper=keeper, **options)
        sampled = responses.sampled()
        if keeper is not None:
            keeper.take(batch.cache, batch.rows, None, batch.mask)
            sampled.kept = keeper.kept(prompt_tokens, prompt_mask, responses, prefilled)
    if not synced:
        sampled.tokens, sampled.mask, sampled.log_probs, sampled.truncated = (
            value.clone() for value in (sampled.tokens, sampled.mask, sampled.log_probs, sampled.truncated)
        )
    return sampled


def _prefilled_batch(
    model,
    prompt_tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings,
    past: KeptCache | None,
    pad_token_id: int,
    *,
    synced: bool,
) -> tuple[torch.Tensor, _DecodingBatch]:
    """:func:`sample_responses`' prefill: the prompts' forward pass (only what ``past`` does not hold, when given;
    each distinct prompt once, unless ``synced``), as the first logits and the decoding batch of every row."""
    mask = prompt_mask.long()
    prefill, cache_argument = _forward_options(model)
    if past is not None:
        if synced:
            raise ValueError("sample_responses: past cannot be used under FSDP2 (no cache is kept there).")
        logits, cache, mask, positions = _prefill_after(
            model, past, prompt_tokens, mask, prefill, cache_argument, pad_token_id
        )
    else:
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        logits, cache = _prefill(model, prompt_tokens, mask, positions, prefill, share=not synced)
    seen = None  # [B, V]: the tokens of each sequence so far, for the repetition penalty
    prepared = _takes_prepared_decoding_masks(model)
    if settings.repetition_penalty != 1.0:
        seen = torch.zeros_like(logits, dtype=torch.float32).scatter_add_(-1, prompt_tokens, prompt_mask.float()) > 0
    return logits, _DecodingBatch(
        cache,
        mask,
        positions[:, -1:] + 1,
        seen,
        cache_argument=cache_argument,
        prepared_masks=prepared,
        # The step reads the prepared masks (a 2D mask would need the model's own mask building).
        step=DecodeStep.of(model, cache) if prepared and not synced else None,
    )


# Model types whose forward reads the attention mask only to build the attention's mask (transformers'
# ``create_causal_mask``, which returns a 4D mask it is given as it is): read in their ``modeling_*.py``.
_PREPARED_MASK_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _takes_prepared_decoding_masks(model) -> bool:
    """Whether a decoding step may hand ``model`` the 4D mask its SDPA attention reads instead of the 2D mask it would
    build it from: a model type of ``_PREPARED_MASK_MODEL_TYPES`` with SDPA attention and full-attention layers only
    (a sliding-window layer builds a mask of its own from the 2D one)."""
    config = getattr(model, "config", None)
    return (
        config is not None
        and getattr(config, "model_type", None) in _PREPARED_MASK_MODEL_TYPES
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and getattr(config, "is_causal", True)
        and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())
    )


class _DecodingBatch:
    """The rows still in the decoding loop: which rows of the whole batch they are, their attention mask, the position
    of the token each feeds next, their KV cache and the tokens each has seen (``None`` without repetition penalty).

    ``prepared_masks``: each step hands the model the mask its SDPA attention reads (``[rows, 1, 1, columns]``, bool:
    a single new query attends to every real column of its row), which transformers otherwise rebuilds from the 2D
    mask at every step (its ``create_causal_mask``: about 0.1 ms of a tiny model's 1.3 ms step). The same mask, so the
    same logits; left to the model where no row has padding (it then passes no mask at all to the attention).

    ``step``: the model's :class:`~interop.sampling.decode_step.DecodeStep` where it has one (the same logits without
    the wrappers' Python: 64 rows of the tiny policy, 1.4 -> 1.0 ms a step), else ``None``: each step calls the
    model."""

    def __init__(
        self,
        cache,
        mask: torch.Tensor,
        next_position: torch.Tensor,
        seen,
        *,
        cache_argument: str,
        prepared_masks: bool = False,
        step: DecodeStep | None = None,
    ):
        self.cache, self.mask, self.next_position, self.seen = cache, mask, next_position, seen
        self.step = step
        self.rows = torch.arange(mask.shape[0], device=mask.device)
        # How the rows' entries of the whole batch's tensors are read: every row a plain slice (a view), until rows
        # leave (then an index, a copy).
        self.index: slice | torch.Tensor = slice(None)
        self.cache_argument = cache_argument
        self.prepared_masks = prepared_masks
        # Decoding appends real columns only: only rows leaving the batch can end the padding.
        self.padded = prepared_masks and not bool(mask.all())

    def drop(self, running: torch.Tensor, keeper: _Keeper | None) -> None:
        """Only the ``running`` rows stay (the others' caches to ``keeper`` first, when it keeps them)."""
        keep = running.nonzero().squeeze(-1)
        if keeper is not None:
            keeper.take(self.cache, self.rows, (~running).nonzero().squeeze(-1), self.mask)
        self.cache.batch_select_indices(keep)
        self.rows, self.mask, self.next_position = self.rows[keep], self.mask[keep], self.next_position[keep]
        self.index = self.rows
        self.seen = self.seen[keep] if self.seen is not None else None
        self.padded = self.prepared_masks and not bool(self.mask.all())

    def forward(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Feeds each row's last token (``[rows, 1]``); returns the next logits (``[rows, V]``)."""
        # Finished rows still in the batch decode pads (their outputs are discarded).
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        prepared = self.mask.bool()[:, None, None, :] if self.padded else None
        if self.step is not None:
            logits = self.step(tokens, prepared, self.next_position, self.cache)
        else:
            out = model(
                input_ids=tokens,
                attention_mask=prepared if prepared is not None else self.mask,
                position_ids=self.next_position,
                use_cache=True,
                **{self.cache_argument: self.cache},
            )
            self.cache = _cache_of(out)
            logits = out.logits[:, -1]
        self.next_position = self.next_position + 1
        return logits


def _decode(
    model,
    logits: torch.Tensor,
    batch: _DecodingBatch,
    responses: _ResponsesSoFar,
    settings: SamplingSettings,
    *,
    eos: torch.Tensor,
    scaled: bool,
    synced: bool,
    drop_finished: bool,
    keeper: _Keeper | None,
) -> None:
    """:func:`sample_responses`' decoding loop, from the prefill's ``logits``: a token drawn for every row still
    decoding (into ``responses``), then a forward pass over the new tokens, until every row has ended (on every rank,
    ``synced``) or ``settings.max_new_tokens``; finished rows leave ``batch`` when ``drop_finished``."""
    size, device = batch.rows.shape[0], batch.rows.device
    workspace = torch.empty_like(logits, dtype=torch.float32)  # [B, V], reused at every step
    decoding = True  # a row of this rank has not sampled EOS yet
    for step in range(settings.max_new_tokens):
        # A rank done before the others only runs the forward passes (their collectives need it): drawing no tokens,
        # it leaves its RNG where a rank decoding alone would have left it.
        if decoding:
            # One uniform per row of the whole batch, so that a row draws the same whichever rows have left.
            uniform = torch.rand(size, 1, device=device)[batch.index] if settings.do_sample else None
            token, token_log_prob = _next_tokens(
                logits.float(),
                step=step,
                settings=settings,
                eos=eos,
                seen=batch.seen,
                scaled=scaled,
                uniform=uniform,
                workspace=workspace[: batch.rows.shape[0]],
            )
            running = responses.record(step, batch.index, token, token_log_prob)
            if batch.seen is not None:
                batch.seen.scatter_(-1, token[:, None], True)
            still_running = int(running.sum())  # the step's one host sync (two when rows leave: nonzero)
            decoding = still_running > 0
        if step + 1 == settings.max_new_tokens or not _any_rank_running(decoding, synced, device):
            break
        if drop_finished and still_running < (1.0 - _DROP_FINISHED_AT) * batch.rows.shape[0]:
            batch.drop(running, keeper)
        logits = batch.forward(model, responses.tokens[batch.index, step : step + 1])


class _ResponsesSoFar:
    """The tokens and log-probs sampled so far, ``[B, max_new_tokens]``, and which rows are still decoding."""

    def __init__(self, prompt_tokens: torch.Tensor, max_new_tokens: int, *, pad_token_id: int, eos: torch.Tensor):
        batch, device = prompt_tokens.shape[0], prompt_tokens.device
        self.tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=prompt_tokens.dtype, device=device)
        self.log_probs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
        self.running = torch.ones(batch, dtype=torch.bool, device=device)  # rows that have not sampled EOS yet
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.pad_token_id, self.eos = pad_token_id, eos

    def record(
        self, step: int, rows: torch.Tensor | slice, token: torch.Tensor, log_prob: torch.Tensor
    ) -> torch.Tensor:
        """Writes step ``step``'s tokens of the running rows among ``rows`` (indices, or ``slice(None)``: every row;
        pads for the others; a row not in ``rows`` has finished and keeps its pad); returns which of ``rows`` still
        run."""
        running = self.running[rows]
        self.tokens[rows, step] = torch.where(running, token, self.pad_token_id)
        self.log_probs[rows, step] = torch.where(running, log_prob, 0.0)
        self.lengths[rows] += running
        running = running & ~torch.isin(token, self.eos)
        self.running[rows] = running
        return running

    def sampled(self) -> SampledResponses:
        width = int(self.lengths.max())
        mask = torch.arange(width, device=self.tokens.device) < self.lengths[:, None]
        return SampledResponses(self.tokens[:, :width], mask, self.log_probs[:, :width], self.running.clone())


def end_of_response_ids(model, tokenizer) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and those the model's generation config adds."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return sorted(set(ids))


def check_pad_token(tokenizer, *, owner: str) -> None:
    """Refuses a tokenizer whose pad token is missing or is EOS: responses are masked with ``tokens != pad`` (here and
    in TorchRL's wrappers), so a pad equal to EOS would mask the generated EOS out as padding.

    Raises:
        ValueError: naming ``owner``, the two tokens and the fix.
    """
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if pad is None or pad == eos:
        raise ValueError(
            f"{owner} has no pad token distinct from EOS (pad={getattr(tokenizer, 'pad_token', pad)!r}, "
            f"eos={getattr(tokenizer, 'eos_token', eos)!r}); with pad == EOS the generated EOS is masked out as "
            "padding. Use a tokenizer with its own pad token (e.g. Qwen's <|endoftext|> when EOS is <|im_end|>), or "
            "add one: tokenizer.add_special_tokens({'pad_token': '<|pad|>'}) and resize the model's embeddings."
        )


class CausalLMSampler(TensorDictModuleBase):
    """An HF causal LM as a TorchRL policy that samples one response per row of a batch of prompts:
    :func:`sample_responses` in TensorDict form, in the dense layout a GRPO learner trains on.

    It reads the left-padded ``("tokens", "prompt")`` and ``("masks", "prompt")`` (True on real tokens) an env wrote
    and writes, every ``[B, ...]`` tensor dense:

    - ``("tokens", "response")`` ``[B, R]`` (pad after EOS) and ``("tokens", "full")`` ``[B, P + R]``: every row is
      ``[pads | prompt | response | pads]``, every response starting at column ``P``;
    - ``("masks", "all_attention_mask")`` ``[B, P + R]`` (bool, True on real tokens);
    - ``("log_probs", "full")`` ``[B, P + R]``: the sampled tokens' log-probs under the sampling weights (the
      behaviour policy's, which a loss reads as the old log-probs), 0 on the prompt and padding;
    - ``"policy_version"`` ``[B]``: :attr:`version` when sampled, so that a learner can tell how many updates old
      a batch is;
    - ``"truncated"`` ``[B]``: the response reached ``max_new_tokens`` without an EOS.

    Tensors only: a reward that reads text decodes the responses itself.

    Args:
        model: a ``transformers`` causal LM.
        tokenizer: its tokenizer (its pad id, distinct from EOS, and its EOS id).

    Keyword Args:
        settings: the :class:`SamplingSettings`.
        eos_token_ids: ids that end a response; ``None``: the tokenizer's EOS and those of
            ``model.generation_config.eos_token_id``.
        log_probs_at_temperature: record each token's log-prob under ``logits / settings.temperature``, as trl's
            ``GRPOTrainer`` scores completions (``TorchRLRolloutFunc`` sets it); ``False``: under the raw logits.
        num_threads: torch's intra-op threads while it samples, restored after (:func:`intra_op_threads`); ``None``:
            the process's. A small model on CPU decodes faster on fewer threads than it trains on. The count is the
            process's (``torch.set_num_threads``): a training pass in another thread meanwhile runs on it too.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1)
        >>> model = LlamaForCausalLM(config).eval()
        >>> class Tokenizer:  # the sampler reads the pad and EOS ids only
        ...     pad_token_id, eos_token_id = 0, 1
        >>> sampler = CausalLMSampler(model, Tokenizer(), settings=SamplingSettings(max_new_tokens=5, top_k=8))
        >>> prompts = TensorDict(
        ...     {("tokens", "prompt"): torch.tensor([[0, 5, 6], [7, 8, 9]]),
        ...      ("masks", "prompt"): torch.tensor([[False, True, True], [True, True, True]])},
        ...     batch_size=[2],
        ... )
        >>> out = sampler(prompts)
        >>> out["tokens", "full"].shape == out["log_probs", "full"].shape == out["masks", "all_attention_mask"].shape
        True
        >>> bool((out["log_probs", "full"][:, 3:][out["masks", "all_attention_mask"][:, 3:]] < 0).all())
        True
    """

    OUT_KEYS = (
        RESPONSE_TOKENS,
        TOKENS,
        ATTENTION_MASK,
        LOG_PROBS,
        POLICY_VERSION,
        TRUNCATED,
    )

    def __init__(
        self,
        model,
        tokenizer,
        *,
        settings: SamplingSettings,
        eos_token_ids: Sequence[int] | None = None,
        log_probs_at_temperature: bool = False,
        num_threads: int | None = None,
    ) -> None:
        super().__init__()
        check_thread_count(num_threads, owner="CausalLMSampler")
        if not isinstance(settings, SamplingSettings):
            raise TypeError(
                f"CausalLMSampler: settings must be a SamplingSettings, got {type(settings).__name__} (build one with "
                "SamplingSettings(max_new_tokens=...) or SamplingSettings.from_mapping({...}))."
            )
        check_pad_token(tokenizer, owner="CausalLMSampler: the tokenizer")
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.log_probs_at_temperature = log_probs_at_temperature
        self.num_threads = num_threads
        self.eos_token_ids = (
            sorted(set(eos_token_ids)) if eos_token_ids is not None else end_of_response_ids(model, tokenizer)
        )
        # Bumped by whoever updates the weights; written into every batch, so that the batch says its age.
        self.register_buffer("version", torch.zeros((), dtype=torch.long))
        self.in_keys = [PROMPT_TOKENS, PROMPT_MASK]
        self.out_keys = list(self.OUT_KEYS)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        prompt = tensordict.get(PROMPT_TOKENS)
        prompt_mask = tensordict.get(PROMPT_MASK).bool()
        with intra_op_threads(self.num_threads):
            sampled = sample_responses(
                self.model,
                prompt,
                prompt_mask,
                settings=self.settings,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.tokenizer.pad_token_id,
                log_probs_at_temperature=self.log_probs_at_temperature,
            )
        batch = prompt.shape[0]
        tensordict.set(RESPONSE_TOKENS, sampled.tokens)
        tensordict.set(TOKENS, torch.cat([prompt, sampled.tokens], dim=-1))
        tensordict.set(ATTENTION_MASK, torch.cat([prompt_mask, sampled.mask], dim=-1))
        prompt_log_probs = torch.zeros_like(prompt, dtype=torch.float32)
        tensordict.set(LOG_PROBS, torch.cat([prompt_log_probs, sampled.log_probs], dim=-1))
        tensordict.set(POLICY_VERSION, self.version.expand(batch).clone())
        tensordict.set(TRUNCATED, sampled.truncated)
        return tensordict
