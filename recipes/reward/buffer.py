"""The reward recipe's TorchRL replay buffer of preference pairs, and the streams trl reads.

- :func:`make_training_stream`: the training pairs tokenized into a ``ReplayBuffer`` (persisted with
  ``buffer.path``), opened for trl through ``interop.TorchRLBufferDataset(...).as_hf_dataset()``
  (:func:`make_preference_buffer`, :func:`make_train_dataset`).
- :func:`make_eval_dataset`: the held-out pairs as the finite ``datasets.Dataset`` trl evaluates.

Dependencies: torch, tensordict, torchrl, datasets, hydra, and the project's ``interop`` package.
"""

from __future__ import annotations

import dataclasses

import hydra
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorStorage

from interop import TorchRLBufferDataset
from recipes.common.config import ConfigError, tensordict_key
from recipes.reward.pair_store import STORAGE_FOLDER, save_labelled_pairs
from recipes.reward.pairs import LabelledPairs, count_over_max_length, pairs_to_tensordict, tokenize_pairs
from recipes.reward.schema import Buffer, PairKeys, RewardRecipeConfig, reward_trainer_view

__all__ = ["make_eval_dataset", "make_preference_buffer", "make_train_dataset", "make_training_stream"]

# datasets is imported where a dataset is made: it takes about two seconds, which `--help` and a config refused by
# validate() need not wait for (as in recipes.common.data).


def _key_name(key) -> str:
    """The column name ``TorchRLBufferDataset`` gives a key (nested keys dot-joined)."""
    return ".".join(key) if isinstance(key, tuple) else key


def make_preference_buffer(buffer_cfg: Buffer, pairs_td, *, batch_size: int, seed: int):
    """A ReplayBuffer over the pairs: copied into a LazyTensorStorage, or (memmap) sampled in place from the tensordict.

    The sampler draws from the buffer's own generator, seeded with ``seed``: its draws depend on nothing else the
    process does with torch's global RNG (generation, dropout), so every process of a multi-process run draws the same
    stream and takes its own slice of it.
    """
    sampler = hydra.utils.instantiate(buffer_cfg.sampler)
    generator = torch.Generator().manual_seed(seed)
    if buffer_cfg.storage == "memmap":  # sampled in place: the memory-mapped folder on the main process
        return ReplayBuffer(
            storage=TensorStorage(pairs_td), sampler=sampler, batch_size=batch_size, generator=generator
        )
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(pairs_td.batch_size[0]), sampler=sampler, batch_size=batch_size, generator=generator
    )
    buffer.extend(pairs_td)
    return buffer


def make_train_dataset(buffer, keys: PairKeys, *, samples_per_epoch: int, with_margin: bool):
    """The buffer as the ``datasets.IterableDataset`` RewardTrainer reads: trl's ``chosen_ids``/``rejected_ids``.

    Each pass draws ``samples_per_epoch`` pairs in one ``buffer.sample`` (without replacement: no pair twice in an
    epoch, so none twice in a step), then strips the storage's padding so that trl pads each batch to its own longest.
    """
    import datasets

    read = [keys.chosen_tokens, keys.chosen_length, keys.rejected_tokens, keys.rejected_length]
    read += [keys.margin] if with_margin else []
    stream = TorchRLBufferDataset(buffer, samples_per_epoch, keys=[tensordict_key(k) for k in read], num_batches=1)
    stream = stream.as_hf_dataset()
    # the columns as the stream names them
    names = {field: _key_name(tensordict_key(node)) for field, node in dataclasses.asdict(keys).items()}

    def to_trl_columns(batch: dict) -> dict:
        out = {
            f"{side}_ids": [ids[:n] for ids, n in zip(batch[names[f"{side}_tokens"]], batch[names[f"{side}_length"]])]
            for side in ("chosen", "rejected")
        }
        if with_margin:
            out["margin"] = batch[names["margin"]]
        return out

    features = {
        "chosen_ids": datasets.List(datasets.Value("int64")),
        "rejected_ids": datasets.List(datasets.Value("int64")),
    }
    if with_margin:
        features["margin"] = datasets.Value("float32")
    return stream.map(
        to_trl_columns, batched=True, remove_columns=stream.column_names, features=datasets.Features(features)
    )


def make_eval_dataset(tokenizer, labelled: LabelledPairs, *, with_margin: bool):
    """The held-out pairs, tokenized, as the finite ``datasets.Dataset`` trl evaluates during training."""
    import datasets

    chosen_ids, rejected_ids = tokenize_pairs(tokenizer, labelled.eval, conversational=labelled.conversational)
    columns = {"chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    if with_margin:
        columns["margin"] = [pair["margin"] for pair in labelled.eval]
    return datasets.Dataset.from_dict(columns)


def make_training_stream(
    cfg: RewardRecipeConfig, labelled: LabelledPairs, tokenizer, *, num_processes: int = 1, persist: bool = True
) -> tuple[object, dict]:
    """Tokenizes the training pairs into the buffer (persisted when ``buffer.path`` is set) and opens it for trl.

    Every process of a multi-process run opens the same stream; accelerate hands each its slice of every batch.
    ``persist=False`` (the other processes) keeps the pairs in memory, so they never wait on the main process's disk.

    Returns the ``datasets.IterableDataset`` and facts about it for the summary.
    """
    keys, train = cfg.buffer.pair_keys, reward_trainer_view(cfg.train)
    step_pairs = train.per_device_train_batch_size * train.gradient_accumulation_steps * num_processes
    if len(labelled.train) < step_pairs:
        raise ConfigError(
            f"Only {len(labelled.train)} training pairs, fewer than one optimizer step takes "
            "(train.per_device_train_batch_size * train.gradient_accumulation_steps * processes = "
            f"{train.per_device_train_batch_size} * {train.gradient_accumulation_steps} * {num_processes} = "
            f"{step_pairs}). Lower the batch size, use fewer processes or add data (more prompts, "
            "generation.responses_per_prompt, labeler.max_pairs_per_prompt)."
        )
    pairs_td = labelled.train_tokens  # a reloaded buffer's own storage, when this run's tokenizer wrote it
    if pairs_td is None:
        pairs_td = pairs_to_tensordict(labelled.train, tokenizer, keys, conversational=labelled.conversational)
    if cfg.buffer.path is not None and persist:
        folder = save_labelled_pairs(cfg.buffer.path, labelled, pairs_td, tokenizer=tokenizer, pair_keys=keys)
        if cfg.buffer.storage == "memmap":
            pairs_td = TensorDict.load_memmap(folder / STORAGE_FOLDER, allow_pickle=False)  # what this run wrote
    longest = torch.maximum(
        pairs_td.get(tensordict_key(keys.chosen_length)), pairs_td.get(tensordict_key(keys.rejected_length))
    )
    too_long = count_over_max_length(longest, train.max_length, what="training")
    # Whole optimizer steps per epoch, so that no step mixes the end of one epoch with the start of the next (and
    # accelerate never pads a short last batch with pairs from the start of the epoch).
    samples_per_epoch = len(labelled.train) // step_pairs * step_pairs
    buffer = make_preference_buffer(cfg.buffer, pairs_td, batch_size=samples_per_epoch, seed=cfg.seed)
    stream = make_train_dataset(buffer, keys, samples_per_epoch=samples_per_epoch, with_margin=cfg.margin_in_loss)
    facts = {
        "train/num_pairs": len(labelled.train),
        "train/pairs_over_max_length": too_long,
        "train/num_processes": num_processes,
        "train/pairs_per_step": step_pairs,
    }
    return stream, facts
