"""recipes.trl_grpo.rollout_store: the ring of max_rows (oldest dropped, counted), readable while written, a
resumed run's part replacing the steps it trained again, text kept as UTF-8; and scripts/rollouts_to_pairs.py's best
vs worst pair of each group."""

from __future__ import annotations

import json

import pytest
import torch
from _small_runs import TRL_SMALL
from tensordict import TensorDict

from recipes.common.config import ConfigError
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


# ------------------------------------------------------------------------------------- damaged, cut, concurrent reads


def _pairs_script():
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parents[3] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import rollouts_to_pairs

    return rollouts_to_pairs


def test_a_reader_leaves_out_the_rows_a_batch_is_overwriting(tmp_path):
    """The write protocol: rows whose ring slots a batch announced (progress.json's ``writing``) are not read, even
    though the batch has not finished; every row read is whole."""
    store = _store(tmp_path, max_rows=8)
    _write(store, 1)
    _write(store, 2)  # rows 0-7 fill the ring
    store._write_progress(writing=[8, 12])  # batch 3 announced: its rows go to the slots of rows 0-3
    half = TensorDict({"row": torch.arange(8, 10), "step": torch.full((2,), 3)}, batch_size=[2])
    store.buffer.storage.set(torch.arange(2), half)  # and it has written two slots, not yet the others
    stored = load_rollouts(tmp_path)
    assert stored["row"].tolist() == [4, 5, 6, 7], "rows 0-3 are being overwritten: left out"
    assert texts(stored, "completion") == [f"step 2 row {i}" for i in range(4)]


def _wrap_the_ring_again_and_again(folder: str) -> None:
    """The writer: 299 batches of 4 rows into a ring of 8, each completion's text the list of its ids."""
    store = RolloutStore(
        folder,
        rank=0,
        max_rows=8,
        prompt_width=3,
        completion_width=2,
        source_names=["rm"],
        max_text_bytes=16,
        pad_token_id=0,
    )
    for step in range(1, 300):
        ids = torch.arange(4 * step, 4 * step + 8).reshape(4, 2)
        rollout = TensorDict(
            {
                "prompt_ids": torch.ones(4, 3, dtype=torch.long),
                "prompt_length": torch.full((4,), 3),
                "completion_ids": ids,
                "completion_length": torch.full((4,), 2),
                "logprobs": -torch.ones(4, 2),
                "truncated": torch.zeros(4, dtype=torch.bool),
            },
            batch_size=[4],
        )
        store.write(
            rollout,
            prompt_texts=["p"] * 4,
            completion_texts=[str(row.tolist()) for row in ids],
            rewards=torch.zeros(4, 1),
            reward=torch.zeros(4),
            advantages=torch.zeros(4),
            step=step,
        )


def test_a_reader_running_beside_a_writer_never_sees_a_half_written_row(tmp_path):
    """A writer process wraps a ring of 8 rows again and again while this process reads it: every row read has the
    text of its own ids. (The writer is forked from this process, its imports done: a new Python spent 3-4 s importing
    torch and tensordict while this one polled for the store.)"""
    import multiprocessing

    process = multiprocessing.get_context("fork").Process(target=_wrap_the_ring_again_and_again, args=(str(tmp_path),))
    process.start()
    try:
        reads = 0
        while process.is_alive() or reads == 0:
            try:
                stored = load_rollouts(tmp_path)
            except FileNotFoundError:
                continue  # not started yet
            for row, text in zip(stored["completion_ids"].tolist(), texts(stored, "completion"), strict=True):
                assert text == str(row), "a row whose text is another completion's: torn"
            reads += 1
    finally:
        process.join(timeout=60)
    assert process.exitcode == 0 and reads > 5


def test_a_storage_file_cut_short_is_refused_naming_it_and_left_as_it_is(tmp_path):
    from recipes.trl_grpo.rollout_store import DamagedRollouts

    _write(_store(tmp_path), 1)
    victim = tmp_path / "rank_0" / "part_0" / "storage" / "completion_ids.memmap"
    with open(victim, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(DamagedRollouts, match=r"completion_ids\.memmap holds 100 bytes"):
        load_rollouts(tmp_path)
    assert victim.stat().st_size == 100, "the reader does not re-extend a damaged file"


def test_a_row_count_no_slot_agrees_with_is_refused(tmp_path):
    from recipes.trl_grpo.rollout_store import DamagedRollouts

    _write(_store(tmp_path, max_rows=100), 1)
    progress_file = tmp_path / "rank_0" / "part_0" / "progress.json"
    progress = json.loads(progress_file.read_text())
    progress["rows_written"] = 60  # 4 were written
    progress_file.write_text(json.dumps(progress))
    with pytest.raises(DamagedRollouts, match="says 60 rows were written, but slot 4"):
        load_rollouts(tmp_path)


def test_pairs_keep_the_whole_prompt_and_leave_out_text_cut_by_the_store(tmp_path, capsys):
    rollouts_to_pairs = _pairs_script()
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Review it."}]
    store = _store(tmp_path / "rollouts")  # max_text_bytes=16: the conversation's JSON is cut
    _write(store, 1, prompts=["a", "a", "b", "b"], completions=["meh", "a much longer answer", "x", "y"])
    wide = RolloutStore(
        tmp_path / "rollouts",
        rank=1,
        max_rows=10,
        prompt_width=5,
        completion_width=4,
        source_names=["rm", "fmt"],
        max_text_bytes=400,
        pad_token_id=0,
    )
    _write(wide, 1, prompts=[conversation] * 2 + ["b"] * 2, completions=["bad", "good", "x", "y"])
    out = tmp_path / "pairs.jsonl"
    assert rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(out)]) == 0
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [pair["prompt"] for pair in pairs] == [
        [{"role": "user", "content": "b"}],
        conversation,
        [{"role": "user", "content": "b"}],
    ]
    assert all("a much longer" not in json.dumps(pair) for pair in pairs), "a cut completion makes no pair"
    assert "1 completions left out" in capsys.readouterr().err


def test_the_pairs_script_never_writes_into_its_input_and_says_what_is_wrong(tmp_path):
    rollouts_to_pairs = _pairs_script()
    _write(_store(tmp_path / "rollouts"), 1)
    progress_file = tmp_path / "rollouts" / "rank_0" / "part_0" / "progress.json"
    before = progress_file.read_bytes()
    with pytest.raises(SystemExit, match="inside the rollouts folder it reads"):
        rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(progress_file)])
    assert progress_file.read_bytes() == before
    progress_file.write_text("{not json")
    with pytest.raises(SystemExit, match=r"rollouts_to_pairs: .*progress\.json is damaged"):
        rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(tmp_path / "pairs.jsonl")])


@pytest.mark.parametrize("target", ["model/config.json", "summary.json"])
def test_the_pairs_script_never_replaces_a_file_of_a_run_folder(tmp_path, target):
    """The rollouts' own run folder: pairs over its model's config.json or its summary.json would break the run."""
    rollouts_to_pairs = _pairs_script()
    rewards = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    _write(_store(tmp_path / "rollouts"), 1, rewards=rewards, completions=["meh", "great", "good", "bad"])
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "summary.json").write_text('{"train/steps": 1}')
    before = (tmp_path / target).read_text()
    with pytest.raises(SystemExit, match=rf"--out .*{target} would replace .*{target}, a file of the run folder"):
        rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(tmp_path / target)])
    assert (tmp_path / target).read_text() == before
    with pytest.raises(SystemExit, match=r"would write among the records of the run folder .* \(model: "):
        rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(tmp_path / "model" / "pairs.jsonl")])
    assert rollouts_to_pairs.main([str(tmp_path / "rollouts"), "--out", str(tmp_path / "pairs.jsonl")]) == 0


def test_a_disk_too_full_for_the_next_batch_stops_the_run_with_a_message(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from recipes.common.config import RunStopped

    store = _store(tmp_path)
    _write(store, 1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(RunStopped, match="1 MiB free.*rollout.store.max_rows"):
        _write(store, 2)
    assert load_rollouts(tmp_path)["step"].tolist() == [1] * 4, "what was written before stays readable"


@pytest.mark.parametrize("setting", ["rollout.store.max_text_bytes=10000000000", "rollout.store.max_rows=100000000000"])
def test_a_store_larger_than_the_free_disk_is_refused_before_any_model_loads(compose_config, tmp_path, setting):
    """Such a store failed at its first write (an allocation of the text columns, "File too large") after the models
    had loaded."""
    from recipes.trl_grpo.checks import validate

    cfg = compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, setting, f"output_dir={tmp_path}"])
    refusal = r"rollout.store.max_rows=\d+ rows of rollout.store.max_text_bytes=\d+ bytes .* GiB free on the disk"
    with pytest.raises(ConfigError, match=refusal):
        validate(cfg)


def test_a_whole_number_written_as_a_float_is_refused_saying_how_to_write_it(compose_config, tmp_path):
    from recipes.trl_grpo.checks import validate

    overrides = [*TRL_SMALL, "rollout.store.max_rows=1e11", f"output_dir={tmp_path}"]
    refusal = r"max_rows=100000000000.0: expected an integer; write it as one \(rollout.store.max_rows=100000000000\)"
    with pytest.raises(ConfigError, match=refusal):
        validate(compose_config("trl_grpo_torchrl_rollouts", overrides))
