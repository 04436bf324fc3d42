"""recipes/reward_trainer_from_buffer.py: a saved buffer is reloaded as saved (or refused), degenerate pairs are caught.

One buffer folder, written by a real ``buffer=memmap`` run, is shared by the module; each test damages its own copy.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
from _batch_recording import install_batch_recorder

import recipes.reward.pairs as preference
import recipes.reward_trainer_from_buffer as recipe
from recipes.common.config import ConfigError
from recipes.reward import pair_store
from recipes.tasks.synthetic import PRODUCTS, make_review

# A reward run small enough for a test: one or two steps of 8 pairs.
TINY_RUN = ["train.max_steps=2", "train.per_device_train_batch_size=8", "train.logging_steps=1"]
NUM_TRAIN, NUM_EVAL = 24, 6
CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def _pairs(n: int, *, seed: int, sentences: int = 1) -> list[dict]:
    """Conversational pairs (positive vs negative review); ``sentences`` repeats each review to make it longer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        product = rng.choice(PRODUCTS)
        good, bad = (" ".join([make_review(product, rng, sentiment=s)] * sentences) for s in (1.0, -1.0))
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Review the {product}."}],
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
        )
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="reward_trainer_from_buffer", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    GlobalHydra.instance().clear()
    return cfg


def _file_run(tmp_path: Path, train_rows, eval_rows=None, *extra: str) -> list[str]:
    """Overrides of a data=file run on ``train_rows`` (and ``eval_rows`` as its eval file) into ``tmp_path/run``."""
    overrides = ["data=file", f"data.path={_write(tmp_path / 'train.jsonl', train_rows)}", *TINY_RUN]
    if eval_rows is not None:
        overrides.append(f"data.eval_path={_write(tmp_path / 'eval.jsonl', eval_rows)}")
    return [*overrides, f"output_dir={tmp_path / 'run'}", *extra]


@pytest.fixture(scope="module")
def saved_buffer(tmp_path_factory) -> Path:
    """The buffer folder of a buffer=memmap run on a file of pairs (read-only: tests copy it)."""
    tmp_path = tmp_path_factory.mktemp("saved")
    recipe.train(_compose(_file_run(tmp_path, _pairs(NUM_TRAIN, seed=0), _pairs(NUM_EVAL, seed=1), "buffer=memmap")))
    return tmp_path / "run" / "buffer"


@pytest.fixture
def buffer_copy(saved_buffer, tmp_path) -> Path:
    return Path(shutil.copytree(saved_buffer, tmp_path / "buffer"))


@pytest.fixture
def no_model_loads(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the data must be refused before the reward model loads")

    monkeypatch.setattr(recipe, "load_reward_model", forbidden)


@pytest.fixture
def record_batches(monkeypatch):
    """Each process of the test's runs writes the pairs it trains on to <run dir>/batches/rank<r>.jsonl."""
    install_batch_recorder(monkeypatch.setattr)


def _trained_pairs(run_dir: Path) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (chosen_ids, rejected_ids) of every pair the run's process trained on (the record_batches fixture)."""
    batches = [json.loads(line) for line in (run_dir / "batches" / "rank0.jsonl").read_text().splitlines()]
    return {(tuple(chosen), tuple(rejected)) for batch in batches for chosen, rejected in batch}


def _stored_pairs(storage) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The stored pairs' token ids with the storage's right padding cut off."""
    sides = [
        [ids[:n].tolist() for ids, n in zip(storage.get(("tokens", side)), storage.get(("length", side)))]
        for side in ("chosen", "rejected")
    ]
    return {(tuple(c), tuple(r)) for c, r in zip(*sides)}


def test_saved_meta_records_the_tokenizer_the_counts_and_the_key_layout(saved_buffer, tiny_dir):
    from transformers import AutoTokenizer

    meta = json.loads((saved_buffer / "meta.json").read_text())
    assert (meta["num_pairs"], meta["num_eval_pairs"], meta["num_eval_responses"]) == (NUM_TRAIN, NUM_EVAL, 0)
    assert meta["tokenizer"] == pair_store.tokenizer_fingerprint(
        AutoTokenizer.from_pretrained(tiny_dir / "reward_base")
    )
    assert meta["pair_keys"]["chosen_tokens"] == ["tokens", "chosen"]


@pytest.mark.parametrize("storage", ["lazy_tensor", "memmap"])
def test_reload_trains_from_the_stored_token_ids(buffer_copy, tmp_path, caplog, storage, record_batches):
    from tensordict import TensorDict

    stored = TensorDict.load_memmap(buffer_copy / "storage")
    overrides = [*TINY_RUN, f"buffer={storage}", f"buffer.load_from={buffer_copy}"]
    with caplog.at_level(logging.INFO, logger=pair_store.__name__):
        summary = recipe.train(_compose([*overrides, f"output_dir={tmp_path / 'run'}"]))

    assert summary["train/steps"] == 2 and summary["train/num_pairs"] == NUM_TRAIN
    assert f"buffer.load_from={buffer_copy}: training from its stored token ids" in caplog.text
    trained = _trained_pairs(tmp_path / "run")
    assert len(trained) >= 16 and trained <= _stored_pairs(stored)
    if storage == "memmap":  # the run's own buffer folder holds the same tensors it sampled from
        written = TensorDict.load_memmap(tmp_path / "run" / "buffer" / "storage")
        assert (written == stored).all()


@pytest.mark.parametrize("edit", ["swapped", "rewritten"])
def test_text_that_disagrees_with_the_kept_storage_is_refused(buffer_copy, tmp_path, no_model_loads, edit):
    """pairs.jsonl edited after the save (chosen and rejected swapped, or a pair rewritten) while storage/ was kept:
    training from the storage would learn other pairs than the file says."""
    pairs = _read(buffer_copy / "pairs.jsonl")
    row = len(pairs) // 2
    if edit == "swapped":
        pairs[row]["chosen"], pairs[row]["rejected"] = pairs[row]["rejected"], pairs[row]["chosen"]
    else:
        pairs[row]["chosen"][0]["content"] = "it is great and it is great."
    _write(buffer_copy / "pairs.jsonl", pairs)
    with pytest.raises(ConfigError, match=rf"pairs.jsonl, row {row} \(counting from 0\): its chosen text is not what"):
        recipe.train(_compose([*TINY_RUN, f"buffer.load_from={buffer_copy}", f"output_dir={tmp_path / 'run'}"]))


def test_a_storage_with_pickled_entries_is_refused_without_running_them(buffer_copy, tmp_path, no_model_loads):
    import os

    from tensordict import NonTensorData, TensorDict

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    crafted = TensorDict({"x": NonTensorData(Payload(), batch_size=[NUM_TRAIN])}, batch_size=[NUM_TRAIN])
    crafted.memmap(buffer_copy / "storage" / "extra")
    meta = json.loads((buffer_copy / "meta.json").read_text())
    meta.pop("storage_bytes")  # an older folder's meta: the size check cannot see the extra entry
    (buffer_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"storage holds pickled entries \(\['storage/extra/x/other.pickle'\]\)"):
        recipe.train(_compose([*TINY_RUN, f"buffer.load_from={buffer_copy}", f"output_dir={tmp_path / 'run'}"]))
    assert not marker.exists()


def test_another_tokenizer_re_tokenizes_the_text_and_says_so(
    buffer_copy, tmp_path, caplog, other_rm_dir, record_batches
):
    from transformers import AutoTokenizer

    overrides = [*TINY_RUN, f"buffer.load_from={buffer_copy}"]
    overrides += [f"reward_model.name_or_path={other_rm_dir}", f"output_dir={tmp_path / 'run'}"]
    with caplog.at_level(logging.INFO, logger=pair_store.__name__):
        summary = recipe.train(_compose(overrides))

    assert summary["train/steps"] == 2
    assert f"buffer.load_from={buffer_copy}: it was tokenized by another tokenizer" in caplog.text
    assert "re-tokenizing the text of its pairs.jsonl" in caplog.text
    tokenizer = AutoTokenizer.from_pretrained(other_rm_dir)
    pairs = _read(buffer_copy / "pairs.jsonl")
    from_text = set(
        zip(*(map(tuple, side) for side in preference.tokenize_pairs(tokenizer, pairs, conversational=True)))
    )
    trained = _trained_pairs(tmp_path / "run")
    assert len(trained) >= 16 and trained <= from_text


def _cut_pairs(folder: Path) -> str:
    lines = (folder / "pairs.jsonl").read_text().splitlines()[:10]
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return rf"{folder / 'pairs.jsonl'} holds 10 rows, but .*meta.json says {NUM_TRAIN} were written \(num_pairs\)"


def _break_json_line(folder: Path) -> str:
    lines = (folder / "eval_pairs.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-5]
    (folder / "eval_pairs.jsonl").write_text("\n".join(lines) + "\n")
    return rf"{folder / 'eval_pairs.jsonl'}, line 3: not valid JSON"


def _drop_storage(folder: Path) -> str:
    shutil.rmtree(folder / "storage")
    return rf"{folder / 'storage'} is missing"


def _drop_meta(folder: Path) -> str:
    (folder / "meta.json").unlink()
    return r"is not a saved preference buffer \(no meta.json in it\)"


def _shrink_storage(folder: Path) -> str:
    from tensordict import TensorDict

    smaller = TensorDict.load_memmap(folder / "storage")[:5].clone()
    shutil.rmtree(folder / "storage")
    smaller.memmap(folder / "storage")
    meta = json.loads((folder / "meta.json").read_text())
    del meta["storage_bytes"]  # as a folder of an older version, which recorded no file sizes
    (folder / "meta.json").write_text(json.dumps(meta))
    return rf"{folder / 'storage'} holds 5 pairs, but .*meta.json says {NUM_TRAIN}"


def _damage_storage(folder: Path) -> str:
    for path in (folder / "storage").rglob("*.memmap"):
        path.write_bytes(b"")  # a disk that filled up while writing: tensordict would read zeros
    return rf"{folder / 'storage'} cannot be read as the tensordict memmap it was written as: \['length/chosen.memmap'"


def _garble_storage_meta(folder: Path) -> str:
    (folder / "storage" / "meta.json").write_text("{not json")
    return rf"{folder / 'storage'} cannot be read as a tensordict memmap \("


@pytest.mark.parametrize(
    "damage",
    [_cut_pairs, _break_json_line, _drop_storage, _drop_meta, _shrink_storage, _damage_storage, _garble_storage_meta],
)
def test_a_damaged_buffer_is_refused_naming_the_file_and_the_fix(buffer_copy, tmp_path, no_model_loads, damage):
    message = damage(buffer_copy)
    cfg = _compose([*TINY_RUN, f"buffer.load_from={buffer_copy}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=message) as error:
        recipe.train(cfg)
    if damage is not _drop_meta:
        assert "rebuild it with a run of buffer=memmap" in str(error.value)


def test_identical_pairs_are_dropped_and_counted(tmp_path, caplog):
    train, held_out = _pairs(20, seed=0), _pairs(6, seed=1)
    for pair in train[:3] + held_out[:2]:
        pair["rejected"] = list(pair["chosen"])
    with caplog.at_level(logging.WARNING, logger=preference.__name__):
        summary = recipe.train(_compose(_file_run(tmp_path, train, held_out)))

    assert summary["train/pairs_identical_dropped"] == 3 and summary["train/num_pairs"] == 17
    assert summary["eval/pairs_identical_dropped"] == 2 and summary["eval/num_pairs"] == 4
    assert "Dropped 3 of 20 train pairs" in caplog.text and "Dropped 2 of 6 eval pairs" in caplog.text


def test_a_file_of_identical_pairs_is_refused(tmp_path, no_model_loads):
    train = _pairs(12, seed=0)
    for pair in train:
        pair["rejected"] = pair["chosen"]
    with pytest.raises(ConfigError, match=r"All 12 train pairs of data=file .* have chosen == rejected"):
        recipe.train(_compose(_file_run(tmp_path, train)))


def _max_length_between(short_rows, long_rows, tiny_dir) -> int:
    """A train.max_length every short pair fits in and no long pair does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "reward_base")
    longest = [
        max(map(len, sides))
        for rows in (short_rows, long_rows)
        for sides in zip(*preference.tokenize_pairs(tokenizer, rows, conversational=True))
    ]
    short_max, long_min = max(longest[: len(short_rows)]), min(longest[len(short_rows) :])
    assert short_max < long_min
    return short_max


def test_evaluation_keeps_to_train_max_length_and_warns_with_counts(tmp_path, caplog, tiny_dir):
    short, long = _pairs(20, seed=0), _pairs(4, seed=2, sentences=6)
    max_length = _max_length_between(short + _pairs(6, seed=1), long, tiny_dir)
    train, held_out = short[:18] + long[:2], _pairs(6, seed=1) + long[2:]
    with caplog.at_level(logging.WARNING, logger=preference.__name__):
        summary = recipe.train(_compose(_file_run(tmp_path, train, held_out, f"train.max_length={max_length}")))

    assert summary["train/pairs_over_max_length"] == 2 and summary["train/num_pairs"] == 20
    assert summary["eval/pairs_over_max_length"] == 2 and summary["eval/num_pairs"] == 6
    assert f"2 of 20 training pairs (10.0%) are longer than train.max_length={max_length}" in caplog.text
    assert f"2 of 8 held-out pairs (25.0%) are longer than train.max_length={max_length}" in caplog.text
    assert _read(tmp_path / "run" / "eval_pairs.jsonl") == _pairs(6, seed=1)  # what was evaluated


def test_no_held_out_pair_within_max_length_is_refused(tmp_path, tiny_dir, no_model_loads):
    short, long = _pairs(16, seed=0), _pairs(3, seed=2, sentences=6)
    max_length = _max_length_between(short, long, tiny_dir)
    with pytest.raises(ConfigError, match=rf"All 3 held-out pairs are longer than train.max_length={max_length}"):
        recipe.train(_compose(_file_run(tmp_path, short, long, f"train.max_length={max_length}")))


@pytest.mark.parametrize(("count", "fraction", "left"), [(1, 0.1, 0), (2, 0.9, 0)])
def test_too_few_pairs_for_the_held_out_split_are_refused(tmp_path, no_model_loads, count, fraction, left):
    overrides = _file_run(tmp_path, _pairs(count, seed=0), None, f"eval.holdout_fraction={fraction}")
    with pytest.raises(ConfigError, match=rf"has {count} preference pair\(s\).*leaves {left} to train on") as error:
        recipe.train(_compose(overrides))
    assert "eval.holdout_fraction" in str(error.value) and "data.eval_path" in str(error.value)
