"""A TorchRL replay buffer as a PyTorch / Hugging Face iterable dataset, and the way back to a TensorDict.

Public names:

- :class:`TorchRLBufferDataset`: takes the same arguments as ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset``
  and yields the same flat samples, but also works on ragged LLM rollouts (lazy stacks), shards its draws across
  DataLoader workers and ``torch.distributed`` ranks, declares ``features`` on its ``datasets`` view, and reads each
  key once per sampled batch instead of indexing the batch sample by sample.
- :func:`tensordict_collate`: turns a list of yielded samples back into a batched ``TensorDict`` (dot keys nested
  again, ragged tensors padded with a mask, strings as non-tensor stacks); usable as a DataLoader ``collate_fn``.

Dependencies: ``torch``, ``tensordict`` and ``torchrl``; ``datasets`` is imported only by
:meth:`TorchRLBufferDataset.as_hf_dataset`.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.context import get_spawning_popen
from numbers import Number
from typing import Any, Literal

import torch
import torch.distributed
from tensordict import (
    LazyStackedTensorDict,
    NestedKey,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensor_collection,
)
from tensordict.utils import unravel_key
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import IterableDataset, get_worker_info
from torchrl.data import ReplayBuffer
from torchrl.data.replay_buffers.storages import ListStorage

__all__ = ["TorchRLBufferDataset", "tensordict_collate"]

_SEED_MASK = (1 << 63) - 1

_TORCH_TO_ARROW_DTYPE = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    # Arrow has no bfloat16: the python floats that ``tolist`` gives fit float32 exactly.
    torch.bfloat16: "float32",
    torch.float32: "float32",
    torch.float64: "float64",
}


def _is_non_tensor(cls: type) -> bool:
    """NonTensorData, NonTensorStack and their kin (torchrl's ``MetaData``, which subclasses neither)."""
    return issubclass(cls, (NonTensorData, NonTensorStack)) or bool(getattr(cls, "_is_non_tensor", False))


def _is_leaf(cls: type) -> bool:
    """Leaves are tensors and non-tensor data (strings...): not the TensorDicts or tensorclasses that hold them."""
    return not is_tensor_collection(cls) or _is_non_tensor(cls)


def _key_name(key: NestedKey) -> str:
    return key if isinstance(key, str) else ".".join(key)


def _names_of(keys: Sequence[NestedKey]) -> list[str]:
    return [_key_name(key) for key in keys]


def _distributed_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _sampling_with(replay_buffer: ReplayBuffer, generator: torch.Generator) -> Iterator[None]:
    """Lets the buffer's sampler draw from ``generator`` for one batch, then gives the buffer its own RNG back."""
    previous = getattr(replay_buffer, "_rng", None)
    replay_buffer.set_rng(generator)
    try:
        yield
    finally:
        replay_buffer.set_rng(previous)


def _sample_leaf(sample: TensorDictBase, key: tuple[str, ...]) -> Any:
    """Walks the entry dicts of a sample (TensorDicts and the tensorclasses LLM wrappers store) down to a leaf."""
    node = sample
    for part in key:
        entries = getattr(node, "_tensordict", None)
        if entries is not None and not isinstance(entries, dict):
            entries = getattr(entries, "_tensordict", None)  # a tensorclass keeps its entries in a TensorDict
        if not isinstance(entries, dict):
            raise LookupError(part)
        node = entries[part]
    return node


def _sample_leaves(samples: list[TensorDictBase], key: NestedKey) -> list[Any]:
    """``key`` read from each sample of a lazy stack (``None`` where a sample lacks it).

    A lazy-stacked batch of 256 rollouts means 256 reads per key and batch: ``TensorDict.get`` and even its private
    ``_get_tuple`` cost microseconds each, most of the adapter's time. The entry dicts of tensordict 0.14 are read
    directly, with ``_get_tuple`` (the same objects, slower) as the fallback for any other layout.
    """
    path = (key,) if isinstance(key, str) else key
    try:
        return [_sample_leaf(sample, path) for sample in samples]
    except (LookupError, AttributeError, TypeError):
        return [sample._get_tuple(path, None) for sample in samples]


class _MissingKey(KeyError):
    """A key that the first sample of a lazy stack has and some other sample lacks."""


def _ragged_column(tensors: list[torch.Tensor], device: torch.device | None) -> Sequence[torch.Tensor]:
    """One tensor per sample, of its own shape, moved to ``device`` in one concatenation and one transfer (``None``:
    the tensors themselves, as ``rb.sample()`` on a lazy-stack storage returns them)."""
    if device is None:
        return tensors
    try:
        if tensors[0].ndim == 0:
            return torch.stack(tensors).to(device).unbind(0)
        try:
            # Ragged along the first dimension only (token sequences): one concatenation, split back by length.
            flat = torch.cat(tensors)
            sizes = list(map(len, tensors))
        except RuntimeError:
            # Ragged along later dimensions too: flatten each sample, split by size, restore its shape.
            parts = torch.cat([t.reshape(-1) for t in tensors]).to(device).split([t.numel() for t in tensors])
            return [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]
    except TypeError as err:  # not all tensors: the key holds something else in some sample
        raise _MissingKey() from err
    return flat.to(device).split(sizes)


def _non_tensor_value(value: Any) -> Any:
    """The Python object inside a ``NonTensorData`` (the list of them for a ``NonTensorStack``).

    ``NonTensorData.data`` goes through the tensorclass attribute machinery (about 15 us a call, more than the whole
    rest of a sample's cost), so the stored field is read directly when it is where tensordict 0.14 keeps it.
    """
    if isinstance(value, NonTensorStack):
        return value.tolist()
    store = getattr(value, "_non_tensordict", None)
    if isinstance(store, dict) and "data" in store:
        return store["data"]
    return value.data


def _non_tensor_list(stack: NonTensorStack) -> list:
    """The per-sample Python objects of a one-dimensional ``NonTensorStack`` (``tolist`` is ~15 us per item)."""
    items = stack.tensordicts if stack.batch_dims == 1 else None
    if items is not None and all(_is_non_tensor(type(item)) and not isinstance(item, NonTensorStack) for item in items):
        return [_non_tensor_value(item) for item in items]
    return stack.tolist()


def _lazy_samples(batch: TensorDictBase) -> list[TensorDictBase] | None:
    """The per-sample tensordicts of a batch that is a lazy stack along its first dimension, else ``None``.

    A ``LazyStackStorage`` sample is such a stack of the stored rollouts. Reading a key through the lazy stack builds
    nested lazy stacks per call; reading it from each sample directly costs a fraction of that.
    """
    if not isinstance(batch, LazyStackedTensorDict) or batch.stack_dim != 0 or batch.batch_dims != 1:
        return None
    samples = batch.tensordicts
    if not samples or not all(type(sample) is TensorDict for sample in samples):
        return None
    return samples


def _read_column(
    batch: TensorDictBase,
    samples: list[TensorDictBase] | None,
    key: NestedKey,
    size: int,
    device: torch.device | None,
    python: bool,
) -> Sequence:
    """Reads ``key`` once for the whole batch and returns one value per sample.

    A dense batch gives one tensor that is split into per-sample views. A lazy-stacked batch (ragged rollouts) is
    read sample by sample, so nothing is ever stacked across samples of different lengths.
    """
    if samples is not None:
        values = _sample_leaves(samples, key)
        first = values[0]
        if any(v is None for v in values):
            raise _MissingKey(key)
        if isinstance(first, torch.Tensor):
            if python:
                return [v.tolist() for v in values]
            return _ragged_column(values, device)
        return [_non_tensor_value(v) if _is_non_tensor(type(v)) else v for v in values]
    value = batch.get(key, as_list=True)
    if isinstance(value, torch.Tensor):
        if python:
            return value.tolist()
        if device is not None:
            value = value.to(device)
        return value.unbind(0)
    if isinstance(value, NonTensorStack):
        return _non_tensor_list(value)
    if _is_non_tensor(type(value)):
        return [_non_tensor_value(value)] * size
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [v.tolist() for v in value] if python else _ragged_column(value, device)
    return list(value)


@functools.lru_cache(maxsize=64)
def _row_builder(names: tuple[str, ...]) -> Callable[[Sequence[Sequence]], list[dict[str, Any]]]:
    """A function turning per-key columns into per-sample dicts, compiled for these key names.

    A dict display with fixed keys builds each sample about four times faster than ``dict(zip(names, row))``, which
    matters at a few hundred thousand samples per second. Only generated identifiers enter the source; the key
    names are bound as values.
    """
    fields = ", ".join(f"_n{i}: _v{i}" for i in range(len(names)))
    targets = "".join(f"_v{i}, " for i in range(len(names)))
    namespace: dict[str, Any] = {f"_n{i}": name for i, name in enumerate(names)}
    namespace["zip"] = zip
    return eval(f"lambda columns: [{{{fields}}} for {targets.rstrip(', ')}, in zip(*columns)]", namespace)  # noqa: S307


# Datasets behind live ``as_hf_dataset()`` views, by token (see _HFGenerator).
_LIVE_DATASETS: weakref.WeakValueDictionary[str, TorchRLBufferDataset] = weakref.WeakValueDictionary()


class _HFGenerator:
    """The generator ``as_hf_dataset`` hands to ``datasets``, cheap to fingerprint.

    ``datasets`` fingerprints a generator by pickling it, which for a bound method pickles the whole replay buffer
    (a minute for a 4096-item ListStorage). Outside process spawning this object pickles to a token that finds the
    dataset again in this process; when a DataLoader spawns workers it pickles the dataset itself.
    """

    def __init__(self, dataset: TorchRLBufferDataset) -> None:
        self.dataset = dataset
        self.token = uuid.uuid4().hex
        _LIVE_DATASETS[self.token] = dataset

    def __call__(self) -> Iterator[dict[str, Any]]:
        yield from self.dataset._hf_examples()

    def __reduce__(self) -> tuple:
        if get_spawning_popen() is not None:
            return (_HFGenerator, (self.dataset,))
        return (_hf_generator_from_token, (self.token,))


def _hf_generator_from_token(token: str) -> _HFGenerator:
    dataset = _LIVE_DATASETS.get(token)
    if dataset is None:
        raise RuntimeError(
            "TorchRLBufferDataset.as_hf_dataset: this datasets view was pickled outside DataLoader worker spawning "
            "and its TorchRLBufferDataset no longer exists in this process; call as_hf_dataset() again."
        )
    return _HFGenerator(dataset)


class TorchRLBufferDataset(IterableDataset):
    """A TorchRL :class:`~torchrl.data.ReplayBuffer` as a :class:`torch.utils.data.IterableDataset`.

    Each iterator draws ``num_batches`` batches of ``batch_size`` samples from the buffer (``None``: an endless stream,
    the consumer sets the step limit) and yields one flat ``dict[str, Any]`` per sample: nested keys become dot-joined
    strings (``("tokens", "full")`` -> ``"tokens.full"``), non-tensor data (strings) come out as plain Python values,
    tensors come out on ``device``. :meth:`as_hf_dataset` gives the same samples as a ``datasets.IterableDataset``
    with declared features, the form ``trl`` trainers take.

    It takes the arguments of ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset`` and yields the same samples for
    the same draws, and differs where that version fails:

    - **Ragged rollouts.** Rollouts from ``TransformersWrapper(pad_output=False)`` stored in a ``LazyStackStorage``
      hold one tensor per sample, of different lengths. Each sample is yielded with tensors of its own length;
      nothing is stacked across samples, so keys that were not requested are never touched either. As with
      ``rb.sample()`` on such a storage, the yielded tensors are the stored ones (``clone()`` before editing one in
      place); with ``device`` set they are moved in one concatenation and one transfer per key. Dense storages
      yield views of the freshly sampled batch, as ``rb.sample()`` returns a copy there.
    - **DataLoader workers and ranks.** With ``num_workers > 0`` and/or under an initialised ``torch.distributed``
      process group, the ``num_batches`` draws are dealt round-robin among all consumers (``world_size *
      num_workers``): consumer ``c`` fetches batches ``c, c + C, c + 2C, ...``. All consumers replay one common index
      stream, seeded per DataLoader iterator from the DataLoader's base seed (from ``torch.initial_seed()`` without
      workers), and each fetches only its own batches, so the draws of different consumers never duplicate one
      another: with a ``SamplerWithoutReplacement``, an epoch is split between workers without overlap. The
      buffer's own RNG is restored after each of our draws. Disjoint draws across ranks need ranks seeded alike (as
      ``transformers.Trainer`` does) and holding the same buffer; with per-rank buffers each rank simply draws its
      share from its own data.
    - **Storages that cannot be shared.** TorchRL sets the ``spawn`` start method, so DataLoader workers receive a
      pickled copy of the dataset; list-based storages (``ListStorage``, ``LazyStackStorage``) cannot be sent and
      raise an error that names the fix.
    - **Speed.** Each requested key is read once per batch and split into samples, instead of indexing the batch
      sample by sample (``scripts/bench_interop.py`` measures it against the reference).

    DataLoader workers sample with copies of the sampler made when their iterator started (the tensors of list-free
    storages are shared). A buffer with ``prefetch`` hands out batches drawn before the common stream applies: keep
    ``prefetch`` off when sharding.

    Args:
        replay_buffer (ReplayBuffer): the buffer to draw from. Draws go through ``replay_buffer.sample``, so its
            sampler, transforms and (for ``TensorDictReplayBuffer``) the ``"index"`` entry apply as usual.
        batch_size (int): samples per draw; each yielded item is one sample of it (no batch dimension).

    Keyword Args:
        keys (list of NestedKey, optional): the keys to yield, in this order. A key naming a sub-tensordict yields
            all its leaves; the dot form (``"tokens.full"``) is accepted too; a key absent from the sampled batch is
            skipped with a warning (once per iterator). Defaults to ``None``: every leaf, tensors and non-tensors.
        device (torch.device or str, optional): tensors are moved there (one transfer per key and batch). Defaults
            to ``None`` (left where the buffer keeps them).
        num_batches (int or None, optional): draws per iterator, shared among workers and ranks. ``None`` draws
            forever. Defaults to ``1``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer
        >>> from interop import TorchRLBufferDataset
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(16))
        >>> _ = rb.extend(TensorDict({"tokens": {"full": torch.ones(16, 8, dtype=torch.long)},
        ...                           "text": ["a prompt"] * 16}, batch_size=[16]))
        >>> sample = next(iter(TorchRLBufferDataset(rb, batch_size=4)))
        >>> sorted(sample), sample["tokens.full"].shape, sample["text"]
        (['text', 'tokens.full'], torch.Size([8]), 'a prompt')

        Ragged rollouts (lazy stacks of different lengths) keep their own lengths:

        >>> rb = ReplayBuffer(storage=LazyStackStorage(8))
        >>> _ = rb.extend(lazy_stack([TensorDict({"tokens": {"full": torch.arange(n)}}) for n in (3, 5, 7)]))
        >>> lengths = {len(s["tokens.full"]) for s in TorchRLBufferDataset(rb, batch_size=64)}
        >>> lengths <= {3, 5, 7}
        True
    """

    def __init__(
        self,
        replay_buffer: ReplayBuffer,
        batch_size: int,
        *,
        keys: list[NestedKey] | None = None,
        device: torch.device | str | None = None,
        num_batches: int | None = 1,
    ) -> None:
        if not isinstance(replay_buffer, ReplayBuffer):
            raise TypeError(
                "TorchRLBufferDataset: replay_buffer must be a torchrl ReplayBuffer, got "
                f"{type(replay_buffer).__name__}. Put the data in a ReplayBuffer(storage=LazyTensorStorage(n)) "
                "(or LazyStackStorage for ragged data)."
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"TorchRLBufferDataset: batch_size must be a positive integer, got {batch_size!r}.")
        if num_batches is not None and (
            isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches <= 0
        ):
            raise ValueError(
                f"TorchRLBufferDataset: num_batches must be a positive integer or None (endless), got {num_batches!r}."
            )
        if keys is not None:
            if isinstance(keys, (str, tuple)) or not isinstance(keys, Sequence):
                raise TypeError(
                    f"TorchRLBufferDataset: keys must be a list of keys, got {keys!r}; wrap a single key in a list, "
                    "e.g. keys=['prompt'] or keys=[('tokens', 'full')]."
                )
            for key in keys:
                if not (
                    isinstance(key, str) or (isinstance(key, tuple) and key and all(isinstance(k, str) for k in key))
                ):
                    raise TypeError(
                        f"TorchRLBufferDataset: each key must be a str or a tuple of str, got {key!r} in keys={keys!r}."
                    )
            keys = [unravel_key(key) for key in keys]
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as err:
                raise ValueError(
                    f"TorchRLBufferDataset: device {device!r} is not a torch device (e.g. 'cpu', 'cuda:0')."
                ) from err
        self._replay_buffer = replay_buffer
        self._batch_size = batch_size
        self._keys = keys
        self._device = device
        self._num_batches = num_batches
        # Iterators started in this process: varies the common index stream between epochs of persistent workers.
        self._iterations = 0

    @property
    def replay_buffer(self) -> ReplayBuffer:
        """The wrapped replay buffer."""
        return self._replay_buffer

    @property
    def batch_size(self) -> int:
        """Samples per draw."""
        return self._batch_size

    @property
    def keys(self) -> list[NestedKey] | None:
        """The requested keys, or ``None`` for every leaf."""
        return self._keys

    @property
    def device(self) -> torch.device | None:
        """Where yielded tensors are moved, or ``None``."""
        return self._device

    @property
    def num_batches(self) -> int | None:
        """Draws per iterator (shared among workers and ranks), or ``None`` for an endless stream."""
        return self._num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Draws this consumer's share of the batches and yields one flat dict per sample."""
        rank, world = _distributed_rank_world()
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self._samples(shard=rank * workers + worker, num_shards=world * workers, python=False)

    def __repr__(self) -> str:
        rb = self._replay_buffer
        storage = type(rb._storage).__name__ if getattr(rb, "_storage", None) is not None else "?"
        keys = "<all>" if self._keys is None else self._keys
        return (
            f"{type(self).__name__}(storage={storage}, len={len(rb)}, batch_size={self._batch_size}, keys={keys}, "
            f"device={self._device}, num_batches={self._num_batches})"
        )

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None and isinstance(self._replay_buffer.storage, ListStorage):
            raise RuntimeError(
                f"TorchRLBufferDataset: the replay buffer's {type(self._replay_buffer.storage).__name__} keeps its "
                "items in a Python list, which cannot be sent to DataLoader worker processes (torchrl sets the "
                "'spawn' start method). Either store the data in a LazyTensorStorage or LazyMemmapStorage "
                "(equal-length samples; pad ragged rollouts first), or iterate with num_workers=0 (the only choice "
                "for ragged LazyStackStorage rollouts)."
            )
        return self.__dict__.copy()

    # ------------------------------------------------------------------------------------------------------------
    # datasets view
    # ------------------------------------------------------------------------------------------------------------

    def as_hf_dataset(self, *, features: Any = None) -> Any:
        """The same samples as a Hugging Face ``datasets.IterableDataset``, with declared features.

        Tensors come out as (nested) Python lists, what ``datasets`` and trl's collators expect
        (``.with_format("torch")`` turns them back into tensors); ``device`` does not apply here. Features are
        inferred from the buffer's first item (one list level per tensor dimension, any length, so ragged data
        fits), which lets ``datasets`` operations that need them work (``column_names``, ``cast_column``,
        ``select_columns``...).

        Sharding is left to the Hugging Face stack, which splits ``datasets`` iterables itself: the view is one shard,
        so ``datasets`` runs it in a single DataLoader worker (it stops the others, with a warning), and ``accelerate``
        either dispatches its batches from rank 0 or lets each rank keep its slice of identical streams (ranks seeded
        alike, as ``transformers.Trainer`` does). Drawing a share per rank here as well would drop data.

        Keyword Args:
            features (datasets.Features or dict, optional): declare the features yourself, e.g. for a buffer that
                is still empty. Defaults to ``None`` (inferred from the buffer's first item).

        Returns:
            A ``datasets.IterableDataset`` yielding this dataset's samples.

        Raises:
            ImportError: when the optional ``datasets`` package is not installed.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
            >>> from interop import TorchRLBufferDataset
            >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
            >>> _ = rb.extend(TensorDict({"prompt": ["Say hi."] * 8, "score": torch.ones(8)}, batch_size=[8]))
            >>> hf = TorchRLBufferDataset(rb, batch_size=2).as_hf_dataset()
            >>> hf.features
            {'prompt': Value('string'), 'score': Value('float32')}
            >>> next(iter(hf))
            {'prompt': 'Say hi.', 'score': 1.0}
        """
        try:
            import datasets
        except ImportError as err:
            raise ImportError(
                "TorchRLBufferDataset.as_hf_dataset needs the optional `datasets` package: `pip install datasets`."
            ) from err
        if features is None:
            features = self._infer_features(datasets)
        elif not isinstance(features, datasets.Features):
            features = datasets.Features(features)
        return datasets.IterableDataset.from_generator(_HFGenerator(self), features=features)

    def _hf_examples(self) -> Iterator[dict[str, Any]]:
        yield from self._samples(shard=0, num_shards=1, python=True)

    def _infer_features(self, datasets: Any) -> Any:
        rb = self._replay_buffer
        if len(rb) == 0:
            raise RuntimeError(
                "TorchRLBufferDataset.as_hf_dataset: the replay buffer is empty, and features are inferred from its "
                "first item. Fill the buffer first, or pass features=datasets.Features({...})."
            )
        # A one-item batch read by index (no RNG, no sampler state) through the buffer's collate and transforms.
        batch = rb[torch.zeros(1, dtype=torch.long)]
        samples = _lazy_samples(batch)
        first = samples[0] if samples is not None else batch
        keys, names = self._resolve_keys(first, warned=set(), warn=False)
        self._refuse_missing_keys(first, keys)
        features = {}
        others = {}
        for key, name in zip(keys, names, strict=True):
            value = _read_column(batch, samples, key, 1, None, python=False)[0]
            if isinstance(value, torch.Tensor):
                if value.dtype not in _TORCH_TO_ARROW_DTYPE:
                    raise TypeError(
                        f"TorchRLBufferDataset.as_hf_dataset: key {name!r} holds {value.dtype} tensors, which have no "
                        "Arrow type; cast them, leave the key out with keys=[...], or pass features=..."
                    )
                feature = datasets.Value(_TORCH_TO_ARROW_DTYPE[value.dtype])
                for _ in range(value.ndim):
                    feature = datasets.List(feature)
                features[name] = feature
            else:
                others[name] = value
        if others:
            import pyarrow as pa

            inferred = datasets.Features.from_arrow_schema(pa.Table.from_pylist([others]).schema)
            features.update(inferred)
        return datasets.Features({name: features[name] for name in names})

    # ------------------------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------------------------

    def _stream_seed(self) -> int:
        """A seed common to all consumers of one epoch, different between epochs."""
        info = get_worker_info()
        # DataLoader seeds worker i with base_seed + i, base_seed drawn afresh by the main process for each iterator.
        base = info.seed - info.id if info is not None else torch.initial_seed()
        return (base * 0x9E3779B97F4A7C15 + self._iterations) & _SEED_MASK

    def _batches(self, shard: int, num_shards: int) -> Iterator[TensorDictBase]:
        """Consumer ``shard`` of ``num_shards`` (ranks x workers) takes every ``num_shards``-th batch of one stream."""
        rb = self._replay_buffer
        if len(rb) == 0:
            raise RuntimeError("TorchRLBufferDataset: the replay buffer is empty; add data before iterating.")
        bound = self._num_batches
        if num_shards == 1:
            # The only consumer: plain draws from the buffer's own RNG, exactly as the buffer samples itself.
            drawn = 0
            while bound is None or drawn < bound:
                yield rb.sample(self._batch_size)
                drawn += 1
            return
        generator = torch.Generator(device=self._generator_device())
        generator.manual_seed(self._stream_seed())
        sampler, storage = rb.sampler, rb.storage
        index = 0
        while bound is None or index < bound:
            with _sampling_with(rb, generator):
                if index % num_shards == shard:
                    batch = rb.sample(self._batch_size)
                else:
                    # Another consumer's batch: advance the common stream without fetching any data.
                    sampler.sample(storage, self._batch_size)
                    batch = None
            if batch is not None:
                yield batch
            index += 1

    def _generator_device(self) -> torch.device:
        device = getattr(self._replay_buffer.storage, "device", None)
        try:
            device = torch.device(device) if device is not None else torch.device("cpu")
        except (RuntimeError, TypeError):
            device = torch.device("cpu")
        return device if device.type == "cuda" else torch.device("cpu")

    def _resolve_keys(self, batch: TensorDictBase, warned: set, warn: bool = True) -> tuple[list[NestedKey], list[str]]:
        leaves = list(batch.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf))
        if self._keys is None:
            keys = leaves
        else:
            leaf_set = set(leaves)
            keys = []
            for key in self._keys:
                if key in leaf_set:
                    keys.append(key)
                    continue
                prefix = (key,) if isinstance(key, str) else key
                below = [leaf for leaf in leaves if isinstance(leaf, tuple) and leaf[: len(prefix)] == prefix]
                if below:
                    keys.extend(below)
                    continue
                if isinstance(key, str) and "." in key and tuple(key.split(".")) in leaf_set:
                    keys.append(tuple(key.split(".")))
                    continue
                if warn:
                    self._warn_missing(key, warned, f"is not in the sampled batch (its keys: {_names_of(leaves)})")
        return keys, _names_of(keys)

    def _refuse_missing_keys(self, sample: TensorDictBase, resolved: list[NestedKey]) -> None:
        """A Hugging Face view names its columns once: a requested key the buffer lacks is an error there (a typo
        would otherwise give a dataset without that column), naming the keys the buffer holds."""
        if self._keys is None:
            return
        found = set(_names_of(resolved))
        missing = [
            key
            for key in self._keys
            if _key_name(key) not in found and not any(name.startswith(_key_name(key) + ".") for name in found)
        ]
        if missing:
            leaves = _names_of(list(sample.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf)))
            raise KeyError(
                f"TorchRLBufferDataset.as_hf_dataset: keys {missing} are not in the buffer's samples (they hold "
                f"{leaves}); fix keys=[...]."
            )

    @staticmethod
    def _warn_missing(key: NestedKey, warned: set, why: str) -> None:
        if key in warned:
            return
        warned.add(key)
        warnings.warn(f"TorchRLBufferDataset: key {key!r} {why}; skipping it.", stacklevel=4)

    def _samples(self, *, shard: int, num_shards: int, python: bool) -> Iterator[dict[str, Any]]:
        self._iterations += 1
        warned: set = set()
        device = None if python else self._device
        dense_keys = None  # a dense batch's keys are fixed by its storage: resolved once per iterator
        for batch in self._batches(shard, num_shards):
            samples = _lazy_samples(batch)
            if samples is not None:
                resolved = self._resolve_keys(samples[0], warned)
            else:
                resolved = dense_keys = dense_keys or self._resolve_keys(batch, warned)
            try:
                names, columns = self._read_batch(batch, samples, resolved, device, python, warned)
            except KeyError:
                if samples is not None:
                    raise
                resolved = dense_keys = self._resolve_keys(batch, warned)
                names, columns = self._read_batch(batch, samples, resolved, device, python, warned)
            if not columns:
                leaves = batch.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf)
                raise KeyError(
                    f"TorchRLBufferDataset: none of keys {self._keys} is in the sampled batch (its keys: "
                    f"{_names_of(list(leaves))}): every sample would be empty. Fix keys=[...]."
                )
            yield from _row_builder(names)(columns)

    def _read_batch(
        self,
        batch: TensorDictBase,
        samples: list[TensorDictBase] | None,
        resolved: tuple[list[NestedKey], list[str]],
        device: torch.device | None,
        python: bool,
        warned: set,
    ) -> tuple[tuple[str, ...], list[Sequence]]:
        size = batch.batch_size[0]
        names, columns = [], []
        for key, name in zip(*resolved, strict=True):
            try:
                columns.append(_read_column(batch, samples, key, size, device, python))
            except _MissingKey:
                self._warn_missing(key, warned, "is missing from some samples of the batch")
                continue
            names.append(name)
        return tuple(names), columns


# ----------------------------------------------------------------------------------------------------------------
# collate
# ----------------------------------------------------------------------------------------------------------------


def _is_numeric_list(value: Any) -> bool:
    while isinstance(value, (list, tuple)):
        if not value:
            return False
        value = value[0]
    return isinstance(value, Number) and not isinstance(value, str)


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Number):
        return torch.as_tensor(value)
    if isinstance(value, (list, tuple)) and _is_numeric_list(value):
        return torch.as_tensor(value)
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return torch.as_tensor(value)
    return None


def _pad(tensors: list[torch.Tensor], padding_side: str, padding_value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads per-sample tensors (any number of ragged dimensions) into one; returns it and its True-where-real mask."""
    ndim = tensors[0].ndim
    if any(t.ndim != ndim for t in tensors):
        raise ValueError(
            f"tensordict_collate: cannot pad tensors of different numbers of dimensions "
            f"({sorted({t.ndim for t in tensors})})."
        )
    dtype = tensors[0].dtype
    if ndim == 1 and all(t.dtype == dtype for t in tensors):
        # Token sequences, the usual case: one pad_sequence call and a mask from the lengths, no per-sample writes.
        out = pad_sequence(tensors, batch_first=True, padding_value=padding_value, padding_side=padding_side)
        lengths = torch.tensor([len(t) for t in tensors], device=out.device)[:, None]
        positions = torch.arange(out.shape[1], device=out.device)
        return out, (positions < lengths if padding_side == "right" else positions >= out.shape[1] - lengths)
    shape = [max(t.shape[d] for t in tensors) for d in range(ndim)]
    out = torch.full((len(tensors), *shape), padding_value, dtype=dtype, device=tensors[0].device)
    mask = torch.zeros((len(tensors), *shape), dtype=torch.bool, device=tensors[0].device)
    for i, tensor in enumerate(tensors):
        region: tuple[int | slice, ...]
        if padding_side == "right":
            region = (i, *(slice(0, s) for s in tensor.shape))
        else:
            region = (i, *(slice(m - s, m) for m, s in zip(shape, tensor.shape, strict=True)))
        out[region] = tensor
        mask[region] = True
    return out, mask


def tensordict_collate(
    samples: Sequence[Mapping[str, Any]],
    *,
    padding_side: Literal["right", "left"] = "right",
    padding_value: float | Mapping[str, float] = 0,
    mask_suffix: str = "_mask",
    mask_keys: Sequence[str] | None = None,
    separator: str = ".",
) -> TensorDict:
    """Turns samples yielded by :class:`TorchRLBufferDataset` back into one batched ``TensorDict``.

    - Dot keys become nested keys again (``"tokens.full"`` -> ``("tokens", "full")``).
    - Tensors of equal shapes are stacked. Ragged tensors (different lengths, as yielded from ``LazyStackStorage``
      rollouts) are padded to the longest on ``padding_side`` with ``padding_value``, and a boolean mask (True on real
      entries) is written next to them under the same key with ``mask_suffix`` appended to its last part:
      ``"tokens.full"`` -> ``("tokens", "full_mask")``. A key gets a mask only when its batch is ragged, unless it is
      listed in ``mask_keys`` (then always, all-True when nothing was padded): list the keys whose batches may happen
      to be all of one length when downstream code needs the mask every time.
    - Boolean tensors are padded with ``False`` unless ``padding_value`` names them explicitly, so attention masks stay
      masks whatever the token pad id.
    - Python numbers and (nested) lists of numbers (what ``as_hf_dataset`` yields) become tensors; strings and other
      objects become a non-tensor stack (``td.get("text").tolist()`` gives the strings back).

    Usable as a DataLoader ``collate_fn`` (with ``functools.partial`` for the options).

    Args:
        samples (sequence of dict): the samples of one batch, with the same keys.

    Keyword Args:
        padding_side ("right" or "left"): where padding goes. Defaults to ``"right"``.
        padding_value (number or dict): the pad value, or a dict ``{dot key: value}`` (missing keys pad with 0,
            boolean keys with ``False``). Defaults to ``0``.
        mask_suffix (str): appended to the last part of a padded key to name its mask. Defaults to ``"_mask"``.
        mask_keys (list of str, optional): dot keys that always get a mask. Defaults to ``None``.
        separator (str): the separator of nested keys. Defaults to ``"."``.

    Returns:
        A ``TensorDict`` of batch size ``[len(samples)]``.

    Examples:
        >>> import torch
        >>> from interop import tensordict_collate
        >>> samples = [
        ...     {"tokens.full": torch.tensor([5, 6, 7]), "text": "abc", "reward": torch.tensor(1.0)},
        ...     {"tokens.full": torch.tensor([8]), "text": "d", "reward": torch.tensor(0.0)},
        ... ]
        >>> td = tensordict_collate(samples, padding_value={"tokens.full": 1})
        >>> td["tokens", "full"]
        tensor([[5, 6, 7],
                [8, 1, 1]])
        >>> td["tokens", "full_mask"]
        tensor([[ True,  True,  True],
                [ True, False, False]])
        >>> td.get("text").tolist(), td["reward"]
        (['abc', 'd'], tensor([1., 0.]))
    """
    names = _check_samples(samples, padding_side)
    always_masked = set(mask_keys or ())
    out = TensorDict(batch_size=[len(samples)])
    for name in names:
        key = tuple(name.split(separator)) if separator in name else name
        values = [sample[name] for sample in samples]
        value, mask = _collate_column(values, name, padding_side, padding_value, masked=name in always_masked)
        out.set(key, value)
        if mask is not None:
            mask_key = (*key[:-1], key[-1] + mask_suffix) if isinstance(key, tuple) else key + mask_suffix
            out.set(mask_key, mask.to(value.device))
    return out


def _check_samples(samples: Sequence[Mapping[str, Any]], padding_side: str) -> list[str]:
    """The keys of a batch of samples, checked: a valid ``padding_side``, at least one sample, dicts with one set of
    keys."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"tensordict_collate: padding_side must be 'right' or 'left', got {padding_side!r}.")
    if not samples:
        raise ValueError("tensordict_collate: got no samples; a batch needs at least one.")
    if not all(isinstance(sample, Mapping) for sample in samples):
        raise TypeError(
            "tensordict_collate: samples must be dicts as TorchRLBufferDataset yields them, got "
            f"{type(next(s for s in samples if not isinstance(s, Mapping))).__name__}."
        )
    names = list(samples[0])
    name_set = set(names)
    for i, sample in enumerate(samples):
        if set(sample) != name_set:
            raise KeyError(
                f"tensordict_collate: sample {i} has keys {sorted(sample)} but sample 0 has {sorted(names)}; "
                "all samples of a batch need the same keys (select them with TorchRLBufferDataset(keys=[...]))."
            )
    return names


def _collate_column(values: list, name: str, padding_side: str, padding_value, *, masked: bool):
    """Key ``name``'s values as one batched entry and its mask (``None`` unless padded, or ``masked``): stacked
    tensors, padded ragged tensors, or a non-tensor stack."""
    tensors = [t for t in map(_as_tensor, values) if t is not None]
    if len(tensors) < len(values):  # a value that is not numeric
        return NonTensorStack.from_list(values), None
    shape = tensors[0].shape
    if all(t.shape == shape for t in tensors):
        mask = torch.ones((len(tensors), *shape), dtype=torch.bool) if masked else None
        return torch.stack(tensors), mask
    # Boolean tensors (attention masks) pad with False unless the padding_value mapping names their key.
    default = False if tensors[0].dtype == torch.bool else 0
    if isinstance(padding_value, Mapping):
        pad = padding_value.get(name, default)
    else:
        pad = default if tensors[0].dtype == torch.bool else padding_value
    return _pad(tensors, padding_side, pad)
