"""recipes/reward_trainer_from_buffer.py in two CPU processes (gloo), started as a user starts them.

``accelerate launch --multi_gpu --num_processes 2`` runs the recipe (accelerate 1.x starts a single process for
``--cpu``; ``--multi_gpu`` is its torchrun launcher, and the recipe's ``device=cpu`` makes the group gloo). Started
through ``_batch_recording.py`` (and, in process, with the ``record_batches`` fixture), each process records what it
trained on. ``interop.TorchRLBufferDataset`` over the recipe's buffer deals its draws between the ranks itself: two
ranks forked with torchrun's environment. ``accelerate launch --use_fsdp --fsdp_version 2`` shards the reward model,
started through ``_accelerate_fsdp_on_cpu.py`` (accelerate shards on GPUs only; it lifts that limit for CPU processes).
The FSDP2 tests and their DDP references run accelerate's launcher code in the test process and fork the ranks from
it (``_processes.accelerate_launch_forked``: no new Pythons importing torch, transformers and trl again, 11 CPU-s a
launch here); the first test launches as a user does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _batch_recording import install_batch_recorder
from _processes import accelerate_launch_forked, free_port
from _small_runs import REWARD_SMALL

SMALL = REWARD_SMALL


def _launch(repo_root: Path, launcher: list[str], script: str, *arguments: str, timeout: int = 600):
    result = subprocess.run(
        [sys.executable, "-m", *launcher, script, *arguments],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _accelerate(*options: str) -> list[str]:
    """``accelerate launch <options>`` of 2 processes on this machine, on a free port."""
    launcher = ["accelerate.commands.launch", *options, "--num_processes", "2", "--num_machines", "1"]
    return [*launcher, "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]


def _accelerate_launch(repo_root: Path, *overrides: str, script: str = "recipes/reward_trainer_from_buffer.py"):
    return _launch(repo_root, _accelerate("--multi_gpu"), script, *overrides)


def _accelerate_forked(*overrides: str, fsdp: bool = False) -> None:
    """accelerate's launcher in this process, the ranks forked from it (``_processes.accelerate_launch_forked``):
    ``--use_fsdp`` (a unit per decoder layer, as the README launches it) through ``_accelerate_fsdp_on_cpu.py``, or
    ``--multi_gpu`` (DDP) the recipe itself."""
    if fsdp:
        options = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"]
        script = "tests/recipes/_accelerate_fsdp_on_cpu.py"
    else:
        options, script = ["--multi_gpu"], "recipes/reward_trainer_from_buffer.py"
    launcher = _accelerate(*options)[1:]  # the options, without the launcher's module
    accelerate_launch_forked(*launcher, script, *overrides)


@pytest.fixture
def record_batches(monkeypatch):
    """Each in-process run of the test writes the pairs it trains on to <run dir>/batches/rank0.jsonl."""
    install_batch_recorder(monkeypatch.setattr)


def _stored_pairs(buffer_folder: Path) -> Counter:
    """Every training pair of a run, as (chosen ids, rejected ids) without padding, from the buffer it wrote."""
    from tensordict import TensorDict

    storage = TensorDict.load_memmap(buffer_folder / "storage")
    chosen, rejected = storage.get(("tokens", "chosen")), storage.get(("tokens", "rejected"))
    chosen_length, rejected_length = storage.get(("length", "chosen")), storage.get(("length", "rejected"))
    return Counter(
        (tuple(chosen[i, : chosen_length[i]].tolist()), tuple(rejected[i, : rejected_length[i]].tolist()))
        for i in range(storage.batch_size[0])
    )


def _recorded_batches(run_dir: Path, rank: int) -> list[list[tuple]]:
    lines = (run_dir / "batches" / f"rank{rank}.jsonl").read_text().splitlines()
    return [[(tuple(chosen), tuple(rejected)) for chosen, rejected in json.loads(line)] for line in lines]


@pytest.mark.slow  # a multi-process run: the slow suite's (the default suite's budget is 8 minutes)
def test_two_processes_split_every_step_of_the_single_process_run(compose_config, repo_root, tmp_path, record_batches):
    """Two processes of 4 pairs draw, between them, the very 8 pairs one process of 8 trains on at each step: no pair
    twice in a step, the same gradients (averaged by DDP) and the same model up to float rounding."""
    import recipes.reward_trainer_from_buffer as recipe

    steps, two, one = 12, tmp_path / "two0", tmp_path / "one"  # 78 pairs: 9 steps of 8, then a new epoch
    result = _accelerate_launch(
        repo_root,
        *SMALL,
        f"train.max_steps={steps}",
        "train.per_device_train_batch_size=4",
        "buffer=memmap",
        "logger=csv",
        "labeler.corrupted_pairs_per_prompt=0",  # sampled pairs alone: an epoch shorter than the run
        # Each process's own Hydra folder (as clocks a second apart give): rank 1 must follow the main process's.
        f"hydra.run.dir={tmp_path}/two${{oc.env:RANK}}",
        script="tests/_batch_recording.py",
    )
    # Rank 1's own folder gets its log alone: the .hydra records are written by the process that holds the run folder.
    assert sorted(p.name for p in (tmp_path / "two1").iterdir()) == ["reward_trainer_from_buffer.log"]

    # One summary, printed once and written once by the main process; one model folder.
    summary = json.loads((two / "summary.json").read_text())
    assert result.stdout.count('"eval/accuracy"') == 1
    assert summary["train/steps"] == steps and summary["train/num_processes"] == 2
    assert summary["train/pairs_per_step"] == 2 * 4
    assert 0.0 <= summary["eval/accuracy"] <= 1.0 and summary["eval/num_pairs"] > 0
    # Everything in the run folder: one of each output (no per-process copies, no staging folder of a second writer).
    assert sorted(p.name for p in two.iterdir()) == [
        ".hydra",
        ".run.lock",  # the main process's lock on the folder (recipes.common.run_folder.RunFolderLock)
        "batches",
        "buffer",
        "eval_pairs.jsonl",
        "metrics.csv",
        "model",
        "resolved_config.yaml",
        "reward_trainer_from_buffer.log",
        "summary.json",
        "trainer",  # trl's own output_dir (train.output_dir), empty with save_strategy=no
        "trainer_log.json",
    ]
    assert sorted(p.name for p in (two / "model").iterdir() if p.suffix in (".safetensors", ".json")) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    header, *rows = (two / "metrics.csv").read_text().splitlines()
    assert "train/loss" in header.split(",") and len(rows) == 1 + steps // 2  # first step, then every 2 steps

    # The same pairs (the two-process run's buffer) in one process of 8 pairs a step.
    single = recipe.train(
        compose_config(
            "reward_trainer_from_buffer",
            [
                *SMALL,
                f"train.max_steps={steps}",
                "train.per_device_train_batch_size=8",
                f"buffer.load_from={two / 'buffer'}",
                f"output_dir={one}",
            ],
        )
    )

    data = _stored_pairs(two / "buffer")
    assert sum(data.values()) == summary["train/num_pairs"] == single["train/num_pairs"]
    alone = _recorded_batches(one, 0)[:steps]
    per_rank = [_recorded_batches(two, rank)[:steps] for rank in range(2)]
    assert [len(batches) for batches in (alone, *per_rank)] == [steps] * 3
    for step in range(steps):
        shares = [per_rank[rank][step] for rank in range(2)]
        assert [len(share) for share in shares] == [4, 4]
        assert shares[0] + shares[1] == alone[step]  # rank 0 the first half of the step's pairs, rank 1 the second
        used = Counter(alone[step])
        assert all(count <= data[pair] for pair, count in used.items()), f"a pair used twice in step {step}"
    # An epoch is whole steps: it visits each stored pair at most once, and the next epoch draws anew.
    steps_per_epoch = summary["train/num_pairs"] // 8
    assert steps_per_epoch < steps
    epoch = Counter(pair for step in range(steps_per_epoch) for pair in alone[step])
    assert sum(epoch.values()) == 8 * steps_per_epoch and all(count <= data[pair] for pair, count in epoch.items())

    # DDP averages the two halves' gradients: the very training of the single process.
    def logged(run_dir: Path) -> list[float]:
        history = json.loads((run_dir / "trainer_log.json").read_text())
        return [entry["loss"] for entry in history if "loss" in entry]

    assert len(logged(two)) == 1 + steps // 2
    torch.testing.assert_close(logged(two), logged(one), rtol=1e-4, atol=1e-5)
    from safetensors.torch import load_file

    weights = [load_file(run / "model" / "model.safetensors") for run in (two, one)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-4, atol=1e-5, msg=name)
    start = load_file(repo_root / "tiny" / "reward_base" / "model.safetensors")
    assert any(not torch.equal(start[name], weights[0][name]) for name in start)  # and it did train
    assert summary["eval/accuracy"] == single["eval/accuracy"]


def _labelled(n: int):
    import recipes.reward.pairs as preference
    from recipes.tasks.synthetic import make_prompts

    pairs = [
        {
            "prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": f"great {i}"}],
            "rejected": [{"role": "assistant", "content": f"awful {i}"}],
        }
        for i, prompt in enumerate(make_prompts(n, seed=0))
    ]
    return preference.LabelledPairs(train=pairs, eval=pairs[:1], conversational=True)


def test_every_process_opens_the_same_stream_whatever_its_global_rng(compose_config, tiny_dir, tmp_path):
    """accelerate slices one stream between the processes: it must not depend on what else each process drew."""
    from transformers import AutoTokenizer

    import recipes.reward.buffer as recipe
    from recipes.reward.checks import validate

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "reward_base")
    cfg = validate(  # the typed settings the run reads
        compose_config("reward_trainer_from_buffer", ["train.per_device_train_batch_size=4", f"output_dir={tmp_path}"])
    )
    labelled = _labelled(37)
    epochs = []
    for rank in range(2):
        stream, facts = recipe.make_training_stream(cfg, labelled, tokenizer, num_processes=2, persist=rank == 0)
        torch.manual_seed(100 + rank)  # as if generation, dropout... had used the global RNG differently
        epochs.append([[row["chosen_ids"] for row in stream] for _ in range(2)])
    assert facts["train/pairs_per_step"] == 8 and facts["train/num_processes"] == 2
    assert epochs[0] == epochs[1]
    assert [len(epoch) for epoch in epochs[0]] == [32, 32]  # whole steps of 2 x 4 pairs: 4 of the 37 left out
    assert epochs[0][0] != epochs[0][1]  # a new draw each epoch


def test_too_few_pairs_for_one_step_of_all_processes_names_the_fix(compose_config, tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    import recipes.reward.buffer as recipe
    from recipes.common.config import ConfigError
    from recipes.reward.checks import validate

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "reward_base")
    cfg = validate(  # the typed settings the run reads
        compose_config("reward_trainer_from_buffer", ["train.per_device_train_batch_size=8", f"output_dir={tmp_path}"])
    )
    labelled = _labelled(20)
    recipe.make_training_stream(cfg, labelled, tokenizer, num_processes=2)  # 16 pairs a step: fits
    with pytest.raises(ConfigError, match=r"Only 20 training pairs.*8 \* 1 \* 4 = 32.*fewer processes"):
        recipe.make_training_stream(cfg, labelled, tokenizer, num_processes=4)


def _draw_as_a_torchrun_rank(rank: int, folder: str, port: int) -> None:
    """One rank of a 2-process group as torchrun starts it: its environment (RANK, WORLD_SIZE, MASTER_ADDR...), from
    which accelerate's PartialState makes the group (gloo on CPU); then the recipe's buffer drawn through
    interop.TorchRLBufferDataset and a DataLoader, the rank's batches written to ``folder``."""
    import os

    from accelerate import PartialState
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from torch.utils.data import DataLoader

    import recipes.reward.buffer as recipe
    from interop import TorchRLBufferDataset

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    PartialState._reset_state()  # forked from a test process, which may hold a single-process state of its own
    state = PartialState(cpu=True)
    try:
        torch.manual_seed(0)  # ranks seeded alike, as transformers' Trainer seeds them
        buffer_cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "buffer" / "lazy_tensor.yaml")
        pairs = TensorDict({"pair": torch.arange(64)}, batch_size=[64])
        buffer = recipe.make_preference_buffer(buffer_cfg, pairs, batch_size=8, seed=0)
        dataset = TorchRLBufferDataset(buffer, batch_size=8, num_batches=8, keys=["pair"])
        drawn = [[int(p) for p in batch["pair"]] for batch in DataLoader(dataset, batch_size=8)]
        with open(f"{folder}/rank{state.process_index}.json", "w") as handle:
            json.dump({"world": state.num_processes, "backend": state.backend, "batches": drawn}, handle)
    finally:
        state.destroy_process_group()


def test_buffer_dataset_deals_its_draws_between_torchrun_ranks(tmp_path):
    """interop.TorchRLBufferDataset under a real process group: each rank draws its own batches of one stream. The
    two ranks are forked from this process with torchrun's environment (a launched process would spend 4-5 s on
    imports per rank, and the launcher as much again; the launchers themselves run the recipes in the slow tests)."""
    import multiprocessing

    fork, port = multiprocessing.get_context("fork"), free_port()
    ranks = [fork.Process(target=_draw_as_a_torchrun_rank, args=(rank, str(tmp_path), port)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    exit_codes = [process.exitcode for process in ranks]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert exit_codes == [0, 0]

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["world"], r["backend"]) for r in ranks] == [(2, "gloo"), (2, "gloo")]
    assert [len(r["batches"]) for r in ranks] == [4, 4]  # 8 draws dealt round-robin
    drawn = [pair for r in ranks for batch in r["batches"] for pair in batch]
    assert sorted(drawn) == list(range(64))  # without replacement: one epoch, split, nothing drawn twice


@pytest.mark.extended  # 30 s, a 60-step run in each setting: out of CI
def test_two_processes_match_the_single_process_run(compose_config, repo_root, tmp_path):
    """Same pairs, same steps: two processes (twice the pairs per step) rank the held-out pairs as well as one. Pairs of
    sampled responses only: the labeler's broken copies (one token apart) take more than these 60 steps to learn, and
    an unfinished model's accuracy moves with the step size, which is what differs here.

    Out of CI (``pytest -m extended``): CI checks that two processes train exactly what one does
    (test_two_processes_split_every_step_of_the_single_process_run) and that one reaches the target accuracy
    (tests/recipes/test_reward_trainer_from_buffer.py::test_default_run_reaches_the_target_accuracy)."""
    import recipes.reward_trainer_from_buffer as recipe

    steps = ["train.max_steps=60", "labeler.corrupted_pairs_per_prompt=0"]
    single = recipe.train(
        compose_config("reward_trainer_from_buffer", [*steps, "buffer=memmap", f"output_dir={tmp_path / 'one'}"])
    )
    _accelerate_launch(
        repo_root, *steps, f"buffer.load_from={tmp_path / 'one' / 'buffer'}", f"hydra.run.dir={tmp_path / 'two'}"
    )
    double = json.loads((tmp_path / "two" / "summary.json").read_text())

    assert (
        double["train/num_pairs"] == single["train/num_pairs"] and double["eval/num_pairs"] == single["eval/num_pairs"]
    )
    assert single["eval/accuracy"] >= 0.9
    assert double["eval/accuracy"] >= single["eval/accuracy"] - 0.05
    assert double["eval/spearman"] >= single["eval/spearman"] - 0.05
    assert (
        torch.isfinite(torch.tensor(double["train/loss_last"]))
        and double["train/loss_last"] < double["train/loss_first"]
    )


# 6 steps of 2 x 4 pairs, the same in every launch below.
FSDP_RUN = [*SMALL, "train.max_steps=6", "train.per_device_train_batch_size=4", "logger=csv"]
REWARD_LORA = "reward_model.lora={r:8,alpha:16,dropout:0.0,target_modules:[q_proj,k_proj,v_proj,o_proj]}"


def _held_shares(run_dir: Path, repo_root: Path) -> list[float]:
    """The share of the model's parameters each process held after training (``_accelerate_fsdp_on_cpu.py``)."""
    sizes = [json.loads((run_dir / "shards" / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sum(s["held"] for s in sizes) == sizes[0]["total"] == sizes[1]["total"]  # every parameter held once
    layers = json.loads((repo_root / "tiny" / "reward_base" / "config.json").read_text())["num_hidden_layers"]
    assert all(s["units"] >= layers + 1 for s in sizes)  # a unit per decoder layer, and the root
    return [s["held"] / s["total"] for s in sizes]


def _assert_same_weights(file: str, *run_dirs: Path) -> None:
    from safetensors.torch import load_file

    first, second = (load_file(run / "model" / file) for run in run_dirs)
    assert first.keys() == second.keys() and len(first) > 0
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # a multi-process or benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_accelerate_fsdp_shards_the_reward_model_and_trains_as_ddp(repo_root, tmp_path):
    """accelerate's FSDP2 over 2 processes: each holds half the model, and the recipe saves (gathered on the main
    process) and evaluates the very model DDP trains."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    sharded, replicated = tmp_path / "fsdp", tmp_path / "ddp"
    _accelerate_forked(*FSDP_RUN, f"hydra.run.dir={sharded}", fsdp=True)
    _accelerate_forked(*FSDP_RUN, f"hydra.run.dir={replicated}")

    assert all(0.45 <= share <= 0.55 for share in _held_shares(sharded, repo_root))
    _assert_same_weights("model.safetensors", sharded, replicated)
    start = load_file(repo_root / "tiny" / "reward_base" / "model.safetensors")
    trained = load_file(sharded / "model" / "model.safetensors")
    assert trained.keys() == start.keys() and any(not torch.equal(start[k], trained[k]) for k in start)
    # One whole save_pretrained folder, loadable without this project.
    model = AutoModelForSequenceClassification.from_pretrained(sharded / "model")
    torch.testing.assert_close(model.score.weight.detach(), trained["score.weight"], rtol=0, atol=0)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (sharded, replicated)]
    assert summaries[0]["train/num_processes"] == 2 and summaries[0]["train/steps"] == 6
    for key in ("train/loss_first", "train/loss_last", "eval/accuracy", "eval/margin_mean"):
        assert summaries[0][key] == pytest.approx(summaries[1][key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_accelerate_fsdp_with_lora_trains_the_adapters_as_ddp(repo_root, tmp_path):
    """The LoRA reward model sharded by accelerate's FSDP2: half of it on each process, and the adapter folder (score
    head included) that DDP with LoRA saves."""
    from safetensors.torch import load_file

    sharded, replicated = tmp_path / "fsdp", tmp_path / "ddp"
    _accelerate_forked(*FSDP_RUN, REWARD_LORA, f"hydra.run.dir={sharded}", fsdp=True)
    _accelerate_forked(*FSDP_RUN, REWARD_LORA, f"hydra.run.dir={replicated}")

    assert all(0.45 <= share <= 0.55 for share in _held_shares(sharded, repo_root))
    _assert_same_weights("adapter_model.safetensors", sharded, replicated)
    adapter = load_file(sharded / "model" / "adapter_model.safetensors")
    assert "base_model.model.score.weight" in adapter and any("lora_B" in name for name in adapter)
    # The recipe's evaluation loads the adapter folder (base + adapter) as GRPO would: the same figures as DDP's.
    summaries = [json.loads((run / "summary.json").read_text()) for run in (sharded, replicated)]
    for key in ("train/loss_last", "eval/accuracy", "eval/margin_mean"):
        assert summaries[0][key] == pytest.approx(summaries[1][key], rel=1e-4, abs=1e-6), key


def test_use_fsdp_on_cpu_processes_is_refused_before_anything_loads(compose_config, tmp_path, monkeypatch):
    """accelerate would silently keep a whole model per CPU process: the recipe says so instead."""
    import recipes.reward_trainer_from_buffer as recipe
    from recipes.common.config import ConfigError

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch --use_fsdp sets
    cfg = compose_config("reward_trainer_from_buffer", [f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"--use_fsdp with device=cpu.*--multi_gpu instead"):
        recipe.train(cfg)
    assert list((tmp_path / "run").iterdir()) == []  # refused before the pairs, the model or any record


def test_use_fsdp_without_a_wrap_policy_warns_that_the_model_is_one_unit(monkeypatch, caplog):
    import recipes.common.run as run

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    run.check_sharded_launch("cuda")  # where accelerate shards
    assert "--fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP" in caplog.text
    caplog.clear()
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")  # what --fsdp_auto_wrap_policy sets
    run.check_sharded_launch("cuda")
    assert caplog.text == ""
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    run.check_sharded_launch("cpu")  # no --use_fsdp: nothing to check
