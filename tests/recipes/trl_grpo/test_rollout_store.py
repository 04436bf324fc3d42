"""recipes.trl_grpo.rollout_store: the ring of max_rows (oldest dropped, counted), readable while written, a
resumed run's part replacing the steps it trained again, text kept as UTF-8; and scripts/rollouts_to_pairs.py's best
vs worst pair of each group."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from recipes.trl_grpo.rollout_store import RolloutStore, load_rollouts, texts


def _store(folder, *, max_rows=100, rank=0):
    return RolloutStore(
        folder,
        rank=rank,
        max_rows=max_rows,
        prompt_width=5,
        completion_width=4,
        source_names=["rm", "fmt"],
        max_text_bytes=16,
        pad_token_id=0,
    )


def _write(store, step, *, prompts=("a", "a", "b", "b"), rewards=None, completions=None):
    batch = len(prompts)
    rollout = TensorDict(
        {
            "prompt_ids": torch.full((batch, 3), 7),
            "prompt_length": torch.full((batch,), 3),
            "completion_ids": torch.arange(batch * 2).reshape(batch, 2) + 1,
            "completion_length": torch.full((batch,), 2),
            "logprobs": -torch.ones(batch, 2),
            "truncated": torch.zeros(batch, dtype=torch.bool),
        },
        batch_size=[batch],
    )
    rewards = rewards if rewards is not None else torch.arange(batch * 2, dtype=torch.float).reshape(batch, 2)
    store.write(
        rollout,
        prompt_texts=list(prompts),
        completion_texts=completions or [f"step {step} row {i}" for i in range(batch)],
        rewards=rewards,
        reward=rewards.nansum(1),
        advantages=torch.linspace(-1, 1, batch),
        step=step,
    )


def test_rows_read_back_while_written_and_the_oldest_dropped_past_max_rows(tmp_path):
    store = _store(tmp_path, max_rows=10)
    _write(store, 1)
    assert load_rollouts(tmp_path)["step"].tolist() == [1] * 4, "readable after the first batch"
    _write(store, 2)
    _write(store, 3)
    stored = load_rollouts(tmp_path)
    assert stored.shape[0] == 10 and store.dropped == 2
    assert stored["row"].tolist() == list(range(2, 12)), "oldest first, the two oldest dropped"
    assert stored["step"].tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert stored["completion_ids"][0].tolist() == [5, 6, 0, 0], "right-padded to the completion width"
    assert stored["prompt_ids"][0].tolist() == [0, 0, 7, 7, 7], "left-padded to the prompt width"
    progress = json.loads((tmp_path / "rank_0" / "part_0" / "progress.json").read_text())
    assert progress["rows_written"] == 12 and progress["rows_dropped"] == 2 and progress["sources"] == ["rm", "fmt"]


def test_a_resumed_part_replaces_the_steps_it_trained_again(tmp_path):
    first = _store(tmp_path)
    for step in (1, 2, 3):
        _write(first, step, completions=[f"killed run {step}"] * 4)
    resumed = _store(tmp_path)  # the run resumed from its step-2 checkpoint: trains steps 3 and 4 again
    for step in (3, 4):
        _write(resumed, step, completions=[f"resumed run {step}"] * 4)
    stored = load_rollouts(tmp_path)
    assert stored["step"].tolist() == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert set(texts(stored[stored["step"] == 3], "completion")) == {"resumed run 3"}
    assert (tmp_path / "rank_0" / "part_1").is_dir()


def test_ranks_load_together_and_text_is_cut_at_a_character_boundary(tmp_path):
    _write(_store(tmp_path, rank=0), 1, completions=["é" * 10, "ok", "ok", "ok"])
    _write(_store(tmp_path, rank=1), 1)
    stored = load_rollouts(tmp_path)
    assert stored["rank"].tolist() == [0] * 4 + [1] * 4
    assert texts(stored, "completion")[0] == "é" * 8, "16 bytes: 8 two-byte characters"
    with pytest.raises(FileNotFoundError, match="no stored rollouts"):
        load_rollouts(tmp_path / "nothing")


def test_rollouts_to_pairs_takes_the_best_and_worst_of_each_group(tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "scripts"))
    import rollouts_to_pairs

    store = _store(tmp_path / "rollouts")
    rewards = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [2.0, 0.0]])  # group b: a tie, no pair
    _write(store, 1, rewards=rewards, completions=["meh", "great", "same", "same"])
    out = tmp_path / "pairs.jsonl"
    assert rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(out)]) == 0
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    assert pairs == [
        {
            "prompt": [{"role": "user", "content": "a"}],
            "chosen": [{"role": "assistant", "content": "great"}],
            "rejected": [{"role": "assistant", "content": "meh"}],
        }
    ]
