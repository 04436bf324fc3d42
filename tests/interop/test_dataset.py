"""interop.TorchRLBufferDataset and interop.tensordict_collate.

Covers: TorchRL's TRL-interop tutorial (dataset parts) with only the import changed, parity with TorchRL's reference
adapter, ragged rollouts (where the reference crashes), keys / warnings / device, DataLoader workers and
``torch.distributed`` ranks, the collate round trip and the ``datasets`` view with its features.
"""

from __future__ import annotations

import copy
import itertools
import json
import multiprocessing
import sys
import warnings
from functools import partial

import pytest
import torch
from _processes import run_gloo_ranks
from _tiny_models import ToyRewardModel
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack
from torch.utils.data import DataLoader
from torchrl.data import (
    LazyStackStorage,
    LazyTensorStorage,
    ListStorage,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from torchrl.modules.llm.trl_interop import TorchRLBufferDataset as ReferenceDataset

import interop.dataset as dataset_module
from interop import TorchRLBufferDataset, tensordict_collate


def make_rollouts(lengths: list[int], *, seed: int = 0) -> LazyStackedTensorDict:
    """Rollouts laid out as ``TransformersWrapper(pad_output=False)`` returns them: one tensordict per sample."""
    gen = torch.Generator().manual_seed(seed)
    return lazy_stack(
        [
            TensorDict(
                {
                    "id": torch.tensor(i),
                    "tokens": {"full": torch.randint(3, 100, (n,), generator=gen)},
                    "masks": {"all_attention_mask": torch.ones(n, dtype=torch.bool)},
                    "text": {"prompt": f"prompt {i}"},
                    "reward": torch.randn((), generator=gen),
                },
                batch_size=[],
            )
            for i, n in enumerate(lengths)
        ]
    )


def dense_batch(num: int, length: int = 6) -> TensorDict:
    return TensorDict(
        {
            "id": torch.arange(num),
            "tokens": {"full": torch.arange(num * length).reshape(num, length)},
            "masks": {"all_attention_mask": torch.ones(num, length, dtype=torch.bool)},
            "text": {"prompt": [f"prompt {i}" for i in range(num)]},
            "reward": torch.arange(num, dtype=torch.float32) / 10,
        },
        batch_size=[num],
    )


def assert_same_samples(ours: list[dict], reference: list[dict]) -> None:
    assert len(ours) == len(reference) > 0
    for mine, theirs in zip(ours, reference, strict=True):
        assert list(mine) == list(theirs)
        for name, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert isinstance(mine[name], torch.Tensor)
                assert mine[name].shape == value.shape and mine[name].dtype == value.dtype
                assert torch.equal(mine[name], value)
            else:
                assert mine[name] == value


# ---------------------------------------------------------------------------------------------------------------
# TorchRL's tutorial, with only the import changed
# ---------------------------------------------------------------------------------------------------------------


def test_torchrl_tutorial_dataset_examples_pass_unchanged():
    """The dataset steps and assertions of TorchRL's TRL-interoperability tutorials, verbatim but for the import."""
    from interop import HFRewardModelWrapper, TorchRLBufferDataset

    seq_len, n_samples, batch_size = 16, 40, 8
    rb = ReplayBuffer(storage=ListStorage(max_size=200), batch_size=batch_size)
    for _ in range(n_samples):
        rb.add(
            TensorDict(
                {
                    "prompt": "Explain one reinforcement-learning concept.",
                    "input_ids": torch.randint(0, 1000, (seq_len,)),
                    "attention_mask": torch.ones(seq_len, dtype=torch.long),
                    "labels": torch.randint(0, 2, (seq_len,)),
                    "reward": torch.randn(()),
                },
                batch_size=[],
            )
        )
    dataset = TorchRLBufferDataset(rb, batch_size=batch_size, num_batches=1)
    samples = list(dataset)
    sample = samples[0]
    assert "input_ids" in sample
    assert sample["input_ids"].shape == torch.Size([seq_len])
    assert len(samples) == batch_size

    dataset_filtered = TorchRLBufferDataset(rb, batch_size=batch_size, keys=["input_ids", "attention_mask"])
    filtered_sample = next(iter(dataset_filtered))
    assert set(filtered_sample.keys()) == {"input_ids", "attention_mask"}

    dataset_cpu = TorchRLBufferDataset(rb, batch_size=batch_size, device="cpu")
    for s in dataset_cpu:
        for v in s.values():
            if isinstance(v, torch.Tensor):
                assert v.device == torch.device("cpu")

    rb_nested = ReplayBuffer(storage=ListStorage(max_size=200), batch_size=batch_size)
    for _ in range(n_samples):
        rb_nested.add(
            TensorDict(
                {
                    "tokens": TensorDict({"full": torch.randint(0, 1000, (seq_len,))}, batch_size=[]),
                    "masks": TensorDict({"all_attention_mask": torch.ones(seq_len, dtype=torch.long)}, batch_size=[]),
                },
                batch_size=[],
            )
        )
    dataset_nested = TorchRLBufferDataset(
        rb_nested, batch_size=batch_size, keys=[("tokens", "full"), ("masks", "all_attention_mask")]
    )
    nested_sample = next(iter(dataset_nested))
    assert "tokens.full" in nested_sample
    assert "masks.all_attention_mask" in nested_sample

    # Part 3: sample through the dataset, re-batch by hand, score with the reward wrapper.
    ds_rt = TorchRLBufferDataset(rb_nested, batch_size=8, keys=[("tokens", "full"), ("masks", "all_attention_mask")])
    samples_rt = list(ds_rt)
    batch_ids = torch.stack([s["tokens.full"] for s in samples_rt])
    batch_mask = torch.stack([s["masks.all_attention_mask"] for s in samples_rt])
    td_rt = TensorDict(
        {
            "tokens": TensorDict({"full": batch_ids}, batch_size=[8]),
            "masks": TensorDict({"all_attention_mask": batch_mask}, batch_size=[8]),
        },
        batch_size=[8],
    )
    result_rt = HFRewardModelWrapper(ToyRewardModel(seq_len), inference_mode=True)(td_rt)
    assert result_rt["reward"].shape == torch.Size([8])

    # Part 4: a preference buffer exposed to trl.
    preference_rb = ReplayBuffer(storage=ListStorage(max_size=32), batch_size=8)
    for i in range(32):
        preference_rb.add(
            TensorDict(
                {
                    "prompt": f"Explain RL concept #{i}.",
                    "chosen": f"The chosen answer for concept #{i}.",
                    "rejected": f"The rejected answer for concept #{i}.",
                },
                batch_size=[],
            )
        )
    assert len(preference_rb) == 32
    preference_dataset = TorchRLBufferDataset(
        preference_rb, batch_size=8, keys=["prompt", "chosen", "rejected"], num_batches=1
    )
    preference_sample = next(iter(preference_dataset))
    assert set(preference_sample) == {"prompt", "chosen", "rejected"}

    # The reward-model tutorial: an unbounded datasets view of chosen/rejected pairs.
    trl_dataset = TorchRLBufferDataset(
        preference_rb, batch_size=8, keys=["chosen", "rejected"], num_batches=None
    ).as_hf_dataset()
    first_item = next(iter(trl_dataset))
    assert "chosen" in first_item and "rejected" in first_item


# ---------------------------------------------------------------------------------------------------------------
# parity with the reference on equal-length data
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [LazyTensorStorage, ListStorage])
@pytest.mark.parametrize("keys", [None, ["reward", ("tokens", "full"), ("text", "prompt")]])
def test_same_samples_as_reference(storage, keys):
    rb = ReplayBuffer(storage=storage(32))
    rb.extend(dense_batch(32))
    torch.manual_seed(3)
    reference = list(ReferenceDataset(rb, batch_size=8, keys=keys, num_batches=3))
    torch.manual_seed(3)
    ours = list(TorchRLBufferDataset(rb, batch_size=8, keys=keys, num_batches=3))
    assert_same_samples(ours, reference)
    assert len(ours) == 24
    expected = ["id", "tokens.full", "masks.all_attention_mask", "text.prompt", "reward"] if keys is None else None
    assert set(ours[0]) == set(expected or ["reward", "tokens.full", "text.prompt"])
    assert isinstance(ours[0]["text.prompt"], str)


def test_samples_match_the_buffer_contents():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    rb.extend(dense_batch(16))
    for sample in TorchRLBufferDataset(rb, batch_size=16, num_batches=2):
        i = int(sample["id"])
        assert int(sample["index"]) == i
        assert torch.equal(sample["tokens.full"], torch.arange(i * 6, i * 6 + 6))
        assert sample["text.prompt"] == f"prompt {i}"
        assert sample["reward"].item() == pytest.approx(i / 10)


def test_endless_stream_and_empty_buffer():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(dense_batch(8))
    endless = TorchRLBufferDataset(rb, batch_size=4, num_batches=None)
    assert len(list(itertools.islice(endless, 50))) == 50
    with pytest.raises(RuntimeError, match="TorchRLBufferDataset: the replay buffer is empty"):
        next(iter(TorchRLBufferDataset(ReplayBuffer(storage=LazyTensorStorage(8)), batch_size=2)))


# ---------------------------------------------------------------------------------------------------------------
# ragged rollouts
# ---------------------------------------------------------------------------------------------------------------


def test_ragged_rollouts_reference_crashes_ours_yields_own_lengths():
    lengths = [3, 7, 5, 9, 2, 6]
    rollouts = make_rollouts(lengths)
    rb = ReplayBuffer(storage=LazyStackStorage(16))
    rb.extend(rollouts)

    # The reference stacks every key of the sampled batch, requested or not.
    with pytest.raises(RuntimeError, match="Failed to stack"):
        list(ReferenceDataset(rb, batch_size=16, keys=["id"]))
    with pytest.raises(RuntimeError, match="Failed to stack"):
        list(ReferenceDataset(rb, batch_size=16))

    samples = list(TorchRLBufferDataset(rb, batch_size=16, num_batches=2))
    assert len(samples) == 32
    assert {len(s["tokens.full"]) for s in samples} > {lengths[0]}
    for sample in samples:
        stored = rollouts[int(sample["id"])]
        assert torch.equal(sample["tokens.full"], stored["tokens", "full"])
        assert sample["masks.all_attention_mask"].shape == stored["tokens", "full"].shape
        assert sample["text.prompt"] == stored["text", "prompt"]
        assert sample["reward"].shape == ()

    only_ids = list(TorchRLBufferDataset(rb, batch_size=16, keys=["id", "text.prompt"]))
    assert all(set(s) == {"id", "text.prompt"} for s in only_ids)


def test_ragged_rollouts_from_transformers_wrapper(tiny_policy):
    """Real rollouts: TransformersWrapper(pad_output=False) generations of different lengths, in a LazyStackStorage."""
    from torchrl.modules.llm import TransformersWrapper

    model, tokenizer = tiny_policy
    policy = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="text",
        generate=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 5, "do_sample": True},
    )
    prompts = ["hi", "what is the answer to this question", "say something nice", "ok"]
    torch.manual_seed(0)
    with torch.no_grad():
        rollouts = policy(lazy_stack([TensorDict({"text": {"prompt": p}}) for p in prompts]))
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    rb.extend(rollouts)
    full = rollouts.get(("tokens", "full"), as_list=True)
    assert len({len(t) for t in full}) > 1, "the prompts must give rollouts of different lengths"

    with pytest.raises(RuntimeError, match="Failed to stack"):
        list(ReferenceDataset(rb, batch_size=8, keys=[("text", "prompt")]))

    dataset = TorchRLBufferDataset(rb, batch_size=8, keys=[("tokens", "full"), ("text", "prompt"), "masks"])
    for sample in dataset:
        i = prompts.index(sample["text.prompt"])
        assert torch.equal(sample["tokens.full"], full[i])
        assert sample["masks.all_attention_mask"].shape == full[i].shape
        assert sample["masks.padded"] is False  # MetaData leaves come out as their Python value


# ---------------------------------------------------------------------------------------------------------------
# keys, warnings, device, argument checks
# ---------------------------------------------------------------------------------------------------------------


def test_missing_key_is_skipped_with_one_warning_per_iterator():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(dense_batch(8))
    dataset = TorchRLBufferDataset(rb, batch_size=4, keys=["id", "absent", ("nested", "absent")], num_batches=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = list(dataset)
    messages = [str(w.message) for w in caught if "TorchRLBufferDataset" in str(w.message)]
    assert len(messages) == 2
    assert all(m.startswith("TorchRLBufferDataset: key") and "skipping it" in m for m in messages)
    assert len(samples) == 12 and all(set(s) == {"id"} for s in samples)


def test_sub_tensordict_keys_and_dot_keys_select_leaves():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(dense_batch(8))
    sample = next(iter(TorchRLBufferDataset(rb, batch_size=4, keys=["tokens", "masks.all_attention_mask"])))
    assert list(sample) == ["tokens.full", "masks.all_attention_mask"]


@pytest.mark.parametrize("storage", ["dense", "ragged"])
def test_device_moves_every_tensor(storage):
    rb = ReplayBuffer(storage=LazyTensorStorage(8) if storage == "dense" else LazyStackStorage(8))
    rb.extend(dense_batch(8) if storage == "dense" else make_rollouts([2, 4, 3, 5, 1, 6, 2, 3]))
    # The meta device proves the move without a GPU: every tensor must end up there, with its own shape.
    samples = list(TorchRLBufferDataset(rb, batch_size=8, device="meta"))
    for sample in samples:
        tensors = [v for v in sample.values() if isinstance(v, torch.Tensor)]
        assert len(tensors) == 4 and all(t.device.type == "meta" for t in tensors)
        assert sample["tokens.full"].shape == sample["masks.all_attention_mask"].shape
        assert isinstance(sample["text.prompt"], str)
    if storage == "ragged":
        assert len({s["tokens.full"].shape for s in samples}) > 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"replay_buffer": [1, 2]}, TypeError, "TorchRLBufferDataset: replay_buffer must be a torchrl ReplayBuffer"),
        ({"batch_size": 0}, ValueError, "TorchRLBufferDataset: batch_size must be a positive integer"),
        ({"batch_size": True}, ValueError, "TorchRLBufferDataset: batch_size"),
        ({"num_batches": 0}, ValueError, "TorchRLBufferDataset: num_batches must be a positive integer or None"),
        ({"keys": "prompt"}, TypeError, r"TorchRLBufferDataset: keys must be a list of keys.*keys=\['prompt'\]"),
        ({"keys": [1]}, TypeError, "TorchRLBufferDataset: each key must be a str or a tuple of str"),
        ({"device": "not-a-device"}, ValueError, "TorchRLBufferDataset: device 'not-a-device'"),
    ],
)
def test_argument_checks(kwargs, error, match):
    rb = ReplayBuffer(storage=LazyTensorStorage(4))
    arguments = {"replay_buffer": rb, "batch_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        TorchRLBufferDataset(arguments.pop("replay_buffer"), arguments.pop("batch_size"), **arguments)


def test_repr_names_the_configuration():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(dense_batch(8))
    text = repr(TorchRLBufferDataset(rb, batch_size=4, keys=["id"], num_batches=None))
    assert text == (
        "TorchRLBufferDataset(storage=LazyTensorStorage, len=8, batch_size=4, keys=['id'], device=None, "
        "num_batches=None)"
    )


# ---------------------------------------------------------------------------------------------------------------
# DataLoader workers and ranks
# ---------------------------------------------------------------------------------------------------------------


def epoch_buffer(num: int = 64) -> TensorDictReplayBuffer:
    """A buffer sampled without replacement: within an epoch, a duplicated index is a duplicated draw."""
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(num), sampler=SamplerWithoutReplacement())
    rb.extend(dense_batch(num))
    return rb


def drawn_indices(dataset, **loader_kwargs) -> list[int]:
    loader = DataLoader(dataset, batch_size=None, **loader_kwargs)
    return [int(sample["index"]) for sample in loader]


def test_workers_draw_disjoint_shares_where_reference_duplicates():
    # fork starts workers in a fraction of a second; the spawn start method torchrl sets is covered below.
    fork = multiprocessing.get_context("fork")
    ours = drawn_indices(
        TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=8), num_workers=2, multiprocessing_context=fork
    )
    assert sorted(ours) == list(range(64)), "one epoch split between two workers: every index exactly once"

    reference = drawn_indices(
        ReferenceDataset(epoch_buffer(), batch_size=8, num_batches=8), num_workers=2, multiprocessing_context=fork
    )
    assert len(reference) == 128 and len(set(reference)) == 64  # each worker draws all num_batches

    # Each worker draws its share with the stream it replays: an odd split gives 3 and 2 batches.
    five = drawn_indices(
        TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=5), num_workers=2, multiprocessing_context=fork
    )
    assert len(five) == 40 and len(set(five)) == 40


def test_workers_with_random_sampler_draw_different_batches():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(4096), sampler=RandomSampler())
    rb.extend(TensorDict({"x": torch.zeros(4096)}, batch_size=[4096]))
    rb.set_rng(torch.Generator().manual_seed(0))  # a buffer RNG is pickled into every worker alike
    fork = multiprocessing.get_context("fork")
    ours = drawn_indices(
        TorchRLBufferDataset(rb, batch_size=64, num_batches=2), num_workers=2, multiprocessing_context=fork
    )
    # The loader alternates between its two workers, sample by sample.
    assert len(ours) == 128 and ours[0::2] != ours[1::2]
    reference = drawn_indices(ReferenceDataset(rb, batch_size=64), num_workers=2, multiprocessing_context=fork)
    assert reference[0::2] == reference[1::2], "the reference's workers replay the same draws"


def test_persistent_workers_draw_a_new_split_each_epoch():
    fork = multiprocessing.get_context("fork")
    dataset = TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=8)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=fork)
    epochs = [[int(sample["index"]) for sample in loader] for _ in range(2)]
    assert all(sorted(epoch) == list(range(64)) for epoch in epochs)
    assert epochs[0] != epochs[1]


@pytest.mark.slow
def test_workers_with_torchrl_spawn_start_method():
    ours = drawn_indices(TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=8), num_workers=2)
    assert sorted(ours) == list(range(64))


def test_list_storage_with_workers_names_the_fix():
    rb = ReplayBuffer(storage=ListStorage(8))
    rb.extend(dense_batch(8))
    loader = DataLoader(TorchRLBufferDataset(rb, batch_size=4), batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match=r"TorchRLBufferDataset: .*ListStorage.*LazyTensorStorage.*num_workers=0"):
        list(loader)
    ragged = ReplayBuffer(storage=LazyStackStorage(8))
    ragged.extend(make_rollouts([1, 2, 3]))
    with pytest.raises(RuntimeError, match=r"LazyStackStorage.*num_workers=0"):
        list(DataLoader(TorchRLBufferDataset(ragged, batch_size=2).as_hf_dataset(), batch_size=None, num_workers=1))
    # Without workers list storages work as usual.
    assert len(list(DataLoader(TorchRLBufferDataset(rb, batch_size=4), batch_size=None))) == 4


def test_ranks_draw_disjoint_shares(monkeypatch):
    """Simulated ranks: each process holds its own copy of the buffer and all are seeded alike."""
    per_rank = []
    for rank in range(2):
        monkeypatch.setattr(dataset_module, "_distributed_rank_world", lambda rank=rank: (rank, 2))
        torch.manual_seed(0)
        per_rank.append(drawn_indices(TorchRLBufferDataset(copy.deepcopy(epoch_buffer()), batch_size=8, num_batches=8)))
    assert [len(indices) for indices in per_rank] == [32, 32]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(64))

    # A single rank keeps drawing from the buffer's own RNG, exactly as before.
    monkeypatch.setattr(dataset_module, "_distributed_rank_world", lambda: (0, 1))
    torch.manual_seed(1)
    alone = drawn_indices(TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=2))
    torch.manual_seed(1)
    reference = drawn_indices(ReferenceDataset(epoch_buffer(), batch_size=8, num_batches=2))
    assert alone == reference


def _gloo_rank(rank: int, folder: str) -> None:
    torch.manual_seed(0)
    indices = drawn_indices(TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=8))
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(indices, f)


def test_two_gloo_ranks_draw_disjoint_shares(tmp_path):
    assert run_gloo_ranks(_gloo_rank, str(tmp_path)) == [0, 0]
    per_rank = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [len(indices) for indices in per_rank] == [32, 32]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(64))


# ---------------------------------------------------------------------------------------------------------------
# collate
# ---------------------------------------------------------------------------------------------------------------


def test_collate_round_trip_dense():
    rb = ReplayBuffer(storage=LazyTensorStorage(16))
    rb.extend(dense_batch(16))
    torch.manual_seed(0)
    expected = rb.sample(8)
    torch.manual_seed(0)
    td = tensordict_collate(list(TorchRLBufferDataset(rb, batch_size=8)))
    assert td.batch_size == torch.Size([8])
    for key in [("tokens", "full"), ("masks", "all_attention_mask"), "reward", "id"]:
        assert torch.equal(td[key], expected[key])
    assert td.get(("text", "prompt")).tolist() == expected.get(("text", "prompt")).tolist()
    assert ("tokens", "full_mask") not in td.keys(True)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_collate_round_trip_ragged(padding_side):
    rollouts = make_rollouts([3, 7, 5, 2])
    rb = ReplayBuffer(storage=LazyStackStorage(4))
    rb.extend(rollouts)
    samples = list(TorchRLBufferDataset(rb, batch_size=4))
    td = tensordict_collate(samples, padding_side=padding_side, padding_value={"tokens.full": -1})
    order = td["id"].tolist()
    batch = lazy_stack([rollouts[i] for i in order])
    expected = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side=padding_side, padding_value=-1)
    assert torch.equal(td["tokens", "full"], expected)
    assert torch.equal(td["tokens", "full_mask"], expected != -1)
    # Boolean entries pad with False whatever the token pad value.
    assert torch.equal(td["masks", "all_attention_mask"], expected != -1)
    assert torch.equal(td["masks", "all_attention_mask_mask"], expected != -1)
    assert td.get(("text", "prompt")).tolist() == [f"prompt {i}" for i in order]
    assert td["reward"].shape == (4,)


def test_collate_as_dataloader_collate_fn_and_options():
    rb = ReplayBuffer(storage=LazyStackStorage(8))
    rb.extend(make_rollouts([4, 4, 4, 4, 4, 4, 4, 4]))
    collate = partial(tensordict_collate, mask_keys=["tokens.full"], mask_suffix="_valid")
    loader = DataLoader(TorchRLBufferDataset(rb, batch_size=8), batch_size=4, collate_fn=collate)
    batches = list(loader)
    assert [b.batch_size for b in batches] == [torch.Size([4])] * 2
    # Equal lengths in this batch, but the key is listed: the mask is there, all True.
    assert batches[0]["tokens", "full_valid"].all() and batches[0]["tokens", "full_valid"].shape == (4, 4)

    hf_like = [{"input_ids": [1, 2, 3], "label": 1.0}, {"input_ids": [4], "label": 0.0}]
    td = tensordict_collate(hf_like)
    assert td["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]] and td["input_ids_mask"].sum().item() == 4
    assert td["label"].tolist() == [1.0, 0.0]


def test_collate_errors():
    with pytest.raises(ValueError, match="tensordict_collate: got no samples"):
        tensordict_collate([])
    with pytest.raises(KeyError, match="tensordict_collate: sample 1 has keys"):
        tensordict_collate([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(ValueError, match="tensordict_collate: padding_side must be"):
        tensordict_collate([{"a": torch.ones(1)}], padding_side="middle")


# ---------------------------------------------------------------------------------------------------------------
# the datasets view
# ---------------------------------------------------------------------------------------------------------------


def test_hf_dataset_declares_features_and_supports_feature_ops():
    import datasets

    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(dense_batch(8))
    hf = TorchRLBufferDataset(rb, batch_size=4, num_batches=2).as_hf_dataset()
    assert isinstance(hf, datasets.IterableDataset)
    assert hf.features == datasets.Features(
        {
            "id": datasets.Value("int64"),
            "tokens.full": datasets.List(datasets.Value("int64")),
            "masks.all_attention_mask": datasets.List(datasets.Value("bool")),
            "text.prompt": datasets.Value("string"),
            "reward": datasets.Value("float32"),
        }
    )
    examples = list(hf)
    assert len(examples) == 8
    for example in examples:
        i = example["id"]
        assert example["tokens.full"] == list(range(i * 6, i * 6 + 6))
        assert example["text.prompt"] == f"prompt {i}"

    # Operations that need declared features (column_names is None and cast_column fails without them).
    assert hf.column_names == list(hf.features)
    selected = next(iter(hf.select_columns(["text.prompt", "reward"])))
    assert set(selected) == {"text.prompt", "reward"}
    cast = hf.cast_column("reward", datasets.Value("float64"))
    assert cast.features["reward"] == datasets.Value("float64")
    removed = hf.remove_columns(["tokens.full"])
    assert "tokens.full" not in removed.features and "tokens.full" not in next(iter(removed))
    mapped = hf.map(lambda e: {"length": len(e["tokens.full"])}, remove_columns=["tokens.full"])
    assert next(iter(mapped))["length"] == 6 and "tokens.full" not in next(iter(mapped))
    tensors = next(iter(hf.with_format("torch")))
    assert tensors["tokens.full"].dtype == torch.int64


def test_hf_dataset_of_ragged_rollouts():
    import datasets

    rollouts = make_rollouts([3, 7, 5])
    rb = ReplayBuffer(storage=LazyStackStorage(4))
    rb.extend(rollouts)
    hf = TorchRLBufferDataset(rb, batch_size=6, keys=["id", ("tokens", "full")]).as_hf_dataset()
    assert hf.features["tokens.full"] == datasets.List(datasets.Value("int64"))
    for example in hf:
        assert example["tokens.full"] == rollouts[example["id"]]["tokens", "full"].tolist()


def test_hf_dataset_errors_and_explicit_features(monkeypatch):
    import datasets

    empty = TorchRLBufferDataset(ReplayBuffer(storage=LazyTensorStorage(4)), batch_size=2)
    with pytest.raises(RuntimeError, match="TorchRLBufferDataset.as_hf_dataset: the replay buffer is empty"):
        empty.as_hf_dataset()
    declared = empty.as_hf_dataset(features={"prompt": datasets.Value("string")})
    assert declared.features == datasets.Features({"prompt": datasets.Value("string")})

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="TorchRLBufferDataset.as_hf_dataset needs the optional `datasets` package"):
        empty.as_hf_dataset()


def test_hf_dataset_does_not_pickle_the_buffer(monkeypatch):
    """datasets fingerprints its generator by pickling it: that must not serialize the replay buffer."""
    rb = ReplayBuffer(storage=ListStorage(16))
    rb.extend(dense_batch(16))
    dataset = TorchRLBufferDataset(rb, batch_size=4)
    pickled = []
    original = TorchRLBufferDataset.__getstate__
    monkeypatch.setattr(TorchRLBufferDataset, "__getstate__", lambda self: pickled.append(1) or original(self))
    hf = dataset.as_hf_dataset()
    assert len(list(hf.select_columns(["id"]).shuffle(seed=0, buffer_size=4))) == 4
    assert copy.deepcopy(hf).features == hf.features
    assert pickled == []


def test_hf_dataset_in_dataloader_workers_draws_each_index_once():
    hf = TorchRLBufferDataset(epoch_buffer(), batch_size=8, num_batches=8).as_hf_dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datasets stops the worker it has no shard for
        indices = drawn_indices(hf, num_workers=2, multiprocessing_context=multiprocessing.get_context("fork"))
    assert sorted(indices) == list(range(64))


# ---------------------------------------------------------------------------------------------------------------
# benchmark smoke run
# ---------------------------------------------------------------------------------------------------------------


def test_benchmark_quick_run(repo_root, capfd):
    """Its command line, ``__main__`` included (in this process: tests/_in_process.run_script)."""
    from _in_process import run_script

    returncode = run_script(repo_root / "scripts" / "bench_interop.py", "--quick", "--skip-reward")
    output = capfd.readouterr()
    assert returncode == 0, output.err[-2000:]
    for row in ["LazyTensorStorage", "ListStorage", "LazyStackStorage (ragged)", "ours/reference >= 4x"]:
        assert row in output.out
    assert "crash (RuntimeError" in output.out  # the reference on ragged rollouts


def test_keys_that_would_leave_samples_empty_or_a_hf_view_without_a_column_raise():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(dense_batch(8))
    with pytest.raises(KeyError, match=r"none of keys \['rejectd'\] is in the sampled batch \(its keys: \["):
        next(iter(TorchRLBufferDataset(rb, batch_size=4, keys=["rejectd"], num_batches=1)))
    with pytest.raises(KeyError, match=r"as_hf_dataset: keys \['rejectd'\] are not in the buffer's samples"):
        TorchRLBufferDataset(rb, batch_size=4, keys=["id", "rejectd"], num_batches=1).as_hf_dataset()
