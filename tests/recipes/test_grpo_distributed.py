"""recipes/grpo_torchrl_rm.py under torchrun: two CPU processes (gloo) train one policy, rank 0 alone writes the run,
and a resumed data-parallel run replays the uninterrupted one (out of CI: ``pytest -m extended``; the resumed FSDP2
run covers it). The CUDA variant (nccl) is marked ``gpu``.

A launched run takes 8-16 s, a forked one 2-5 s: a run that several tests read (DDP and FSDP2 for 2 steps, DDP for
4) is made once per session (``_shared_runs``), and a resume continues a copy of the shared 2-step run (a copied run
folder resumes as itself, ``recipes.common.resume``); every test here is in the slow suite, or out of CI as marked.
The 4-step DDP run is launched by torchrun as a user types it; the runs compared with it (FSDP2, LoRA, the memory
switches, resumes) fork their two ranks from the test process with torchrun's environment
(``_processes.run_forked_ranks``), which spares the launcher's three new Pythons and their imports (9 CPU-s a run
here), and the comparison with the launched run checks that a forked rank trains as a launched one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import run_forked_ranks
from _shared_runs import copy_run, shared_run
from _small_runs import GRPO_SMALL, REPO_ROOT, read_metrics

from recipes.common.checkpoint import MERGED_MODEL_FOLDER, MODEL_FOLDER, list_checkpoints

SMALL = [*GRPO_SMALL, "logger=csv"]
# A checkpoint every 2 steps, all kept: a 2-step run is also the first half of a resumed 4-step one.
CHECKPOINTS = ["checkpoint.every_n_steps=2", "checkpoint.keep_last=null"]
FSDP = "distributed.strategy=fsdp"
LORA = "model.lora={r:4,alpha:8,dropout:0.0,target_modules:[q_proj,v_proj,lm_head]}"
# The runs several tests read, by name: DDP and FSDP2 for 2 steps, DDP for 4 (the uninterrupted run the resumed DDP
# and FSDP2 runs replay, FSDP2 training as DDP does), FSDP2 with LoRA for 2.
SHARED_RUNS = {
    "ddp_2": [*SMALL, *CHECKPOINTS, "train.steps=2"],
    "fsdp_2": [*SMALL, *CHECKPOINTS, FSDP, "train.steps=2"],
    "ddp_4": [*SMALL, *CHECKPOINTS, "train.steps=4"],
    # FSDP2 with LoRA and the merged save for 2 steps: the LoRA test's run, and the first half of its resume test's.
    "fsdp_lora_2": [*SMALL, *CHECKPOINTS, LORA, FSDP, "checkpoint.save_merged=true", "train.steps=2"],
}

# The run torchrun launches as a user types it (the others fork their ranks: the module's docstring).
LAUNCHED_RUN = "ddp_4"

# The recipe, with each rank writing its weights to <run dir>/rank_weights/rank_<rank>.safetensors at every checkpoint.
RANK_WEIGHTS_LAUNCH = "tests/recipes/_rank_weights_launch.py"


def _torchrun(num_processes: int, overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N recipes/grpo_torchrl_rm.py ...`` as a user types it, the recipe
    started through :data:`RANK_WEIGHTS_LAUNCH`."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={num_processes}",
        RANK_WEIGHTS_LAUNCH,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _run(overrides: list[str], run_dir: Path) -> None:
    """The run of :func:`_torchrun` with 2 processes, its ranks forked from this one (``run_forked_ranks``)."""
    run_forked_ranks(RANK_WEIGHTS_LAUNCH, [*overrides, f"hydra.run.dir={run_dir}"])


def _load_rank_weights(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "rank_weights" / f"rank_{rank}.safetensors")


def _assert_same_steps(run_dir: Path, other_dir: Path, keys: tuple[str, ...], steps: int) -> None:
    """Both runs logged steps 1..``steps`` with the same ``keys`` (float tolerance)."""
    rows, other_rows = read_metrics(run_dir), read_metrics(other_dir)
    assert [row["step"] for row in rows] == [float(step) for step in range(1, steps + 1)]
    for a, b in zip(rows, other_rows, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)


def _assert_same_weights(run_dir: Path, other_dir: Path, rank: int = 0) -> None:
    weights, other = _load_rank_weights(run_dir, rank), _load_rank_weights(other_dir, rank)
    assert weights.keys() == other.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], other[name], rtol=1e-4, atol=1e-5)


def _shared(shared_runs: Path, name: str) -> Path:
    """The folder of the shared run ``name`` (:data:`SHARED_RUNS`), made by the first test of the session to ask."""

    def make(folder: Path) -> None:
        if name == LAUNCHED_RUN:
            _torchrun(2, SHARED_RUNS[name], folder)
        else:
            _run(SHARED_RUNS[name], folder)

    return shared_run(shared_runs, name, make)


def _to_4_steps(overrides: list[str]) -> list[str]:
    return [("train.steps=4" if item == "train.steps=2" else item) for item in overrides]


def _resume_to_4_steps(shared_runs: Path, first_2_steps: str, tmp_path: Path) -> Path:
    """The shared 2-step run ``first_2_steps`` resumed to 4 steps, in a copy of its folder: the copy."""
    run_dir = copy_run(_shared(shared_runs, first_2_steps), tmp_path / "run")
    _run([*_to_4_steps(SHARED_RUNS[first_2_steps]), "resume=true"], run_dir)
    return run_dir


@pytest.mark.slow  # a multi-process run: the slow suite's (the default suite's budget is 8 minutes)
def test_two_cpu_processes_train_one_policy(shared_runs, tiny_dir):
    """Read from the shared uninterrupted 4-step DDP run (checkpoints at steps 2 and 4) that the resumed FSDP2 run
    replays. (A last step off the checkpoint interval is saved too: the single-process resume test's [3, 6, 7].)"""
    from transformers import AutoModelForCausalLM

    run_dir = _shared(shared_runs, "ddp_4")

    # The gradients are averaged over both ranks at every update: the two copies of the policy end bit-identical.
    rank0, rank1 = _load_rank_weights(run_dir, 0), _load_rank_weights(run_dir, 1)
    assert rank0.keys() == rank1.keys() and len(rank0) > 0
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    # ... and they trained: every parameter moved away from the shipped initial policy.
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").named_parameters())
    assert rank0.keys() == initial.keys()
    assert all(not torch.equal(rank0[name], initial[name].detach()) for name in rank0)

    # Rank 0 alone wrote the run: one summary, one metrics row per step, one checkpoint set holding those weights.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train/num_processes"] == 2 and summary["train/steps"] == 4
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_0000004" / MODEL_FOLDER)
    assert all(torch.equal(p, rank0[name]) for name, p in saved.named_parameters())
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == [
        "checkpoints",
        "grpo_torchrl_rm.log",
        "metrics.csv",
        "rank_weights",
        "resolved_config.yaml",
        "summary.json",
    ]
    # The rollout figures pool both ranks' responses: 2 ranks x 4 responses per step.
    assert summary["rollout/generated_tokens"] == pytest.approx(sum(row["rollout/response_length"] * 8 for row in rows))


@pytest.mark.extended  # a third 4-step torchrun (15-20 s): out of CI, which covers its parts (docstring)
def test_a_resumed_data_parallel_run_replays_the_uninterrupted_one(shared_runs, tmp_path):
    """Each rank's RNG state is in the checkpoint and the prompt stream is shared: stop, resume, same run.

    Out of CI (`pytest -m extended`). CI covers its parts: test_a_resumed_fsdp_run_replays_the_uninterrupted_one
    resumes two ranks from their checkpoint against this same uninterrupted DDP run (each rank's RNG state and the
    shared prompt stream: its rollout figures pool both ranks' responses), and
    tests/recipes/test_grpo_torchrl_rm.py::test_resume_after_sigkill_continues_the_same_run restores the whole
    optimizer state, as each DDP rank does, and replays the uninterrupted run."""
    run_dir, reference_dir = _resume_to_4_steps(shared_runs, "ddp_2", tmp_path), _shared(shared_runs, "ddp_4")
    keys = ("rollout/reward_mean", "rollout/oracle_mean", "rollout/response_length", "train/loss")
    _assert_same_steps(run_dir, reference_dir, keys, steps=4)
    for rank in (0, 1):
        final, reference = _load_rank_weights(run_dir, rank), _load_rank_weights(reference_dir, rank)
        for name in final:
            torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_processes", [1, 2])
def test_torchrun_on_cuda_with_nccl_and_bfloat16(tmp_path, tiny_dir, num_processes):
    """One process per GPU: nccl and bf16 train (the weights move from the initial policy's, every figure finite)
    and, with 2 GPUs, the ranks stay in sync. On a one-GPU machine the 2-process case is skipped, not run as one
    process with nothing to compare (what this test did before)."""
    from transformers import AutoModelForCausalLM

    if torch.cuda.device_count() < num_processes:
        pytest.skip(f"{num_processes} processes need {num_processes} GPUs (nccl: one per process)")
    overrides = [*SMALL, "device=cuda", "dtype=bfloat16", "train.steps=3"]
    _torchrun(num_processes, overrides, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["train/num_processes"] == num_processes and summary["train/steps"] == 3
    rows = read_metrics(tmp_path)
    assert all(math.isfinite(row[key]) for row in rows for key in ("train/loss", "rollout/reward_mean"))
    weights = [_load_rank_weights(tmp_path, rank) for rank in range(num_processes)]
    assert all(t.dtype == torch.bfloat16 for t in weights[0].values())
    initial = {
        name: parameter.detach().to(torch.bfloat16)
        for name, parameter in AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").named_parameters()
    }
    assert weights[0].keys() == initial.keys()
    moved = [name for name in initial if not torch.equal(weights[0][name].cpu(), initial[name])]
    # The same 3 steps in bf16 on CPU (one process, gloo) move 24 of the 26 tensors: two norms' weights of 1.0 are
    # below one bf16 step of theirs after 3 updates of 2e-3 (2026-12-06).
    assert len(moved) >= len(initial) // 2, f"3 bf16 updates moved only {moved}"
    for other in weights[1:]:
        assert all(torch.equal(weights[0][name], other[name]) for name in weights[0])


def _rank_sizes(run_dir: Path, rank: int, model: str = "") -> dict[str, int]:
    return json.loads((run_dir / "rank_weights" / f"rank_{rank}{model}.json").read_text())


@pytest.mark.slow  # a multi-process or benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_fsdp_shards_the_policy_trains_it_and_saves_one_loadable_folder(shared_runs, tiny_dir):
    from transformers import AutoModelForCausalLM

    run_dir = _shared(shared_runs, "fsdp_2")

    # Each process holds about half of the parameters (each tensor split along its first dimension).
    sizes = [_rank_sizes(run_dir, rank) for rank in (0, 1)]
    full = sizes[0]["full_numel"]
    assert sum(size["local_numel"] for size in sizes) == full
    for size in sizes:
        assert size["local_numel"] / full == pytest.approx(0.5, abs=0.01)
    # So do the frozen reference and reward models, sharded alike.
    for model in ("_reference", "_reward"):
        frozen = [_rank_sizes(run_dir, rank, model) for rank in (0, 1)]
        assert frozen[0]["full_numel"] == frozen[1]["full_numel"] == sum(size["local_numel"] for size in frozen)
        for size in frozen:
            assert size["local_numel"] / size["full_numel"] == pytest.approx(0.5, abs=0.01), model
    assert _rank_sizes(run_dir, 0, "_reference")["full_numel"] == full
    # The gathered weights moved away from the initial policy, and the checkpoint holds them as one
    # from_pretrained folder.
    gathered = _load_rank_weights(run_dir, 0)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").named_parameters())
    assert gathered.keys() == initial.keys()
    assert all(not torch.equal(gathered[name], initial[name].detach()) for name in gathered)
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_0000002" / MODEL_FOLDER)
    assert type(saved).__name__ == "Qwen2ForCausalLM"
    for name, parameter in saved.named_parameters():
        assert torch.equal(parameter, gathered[name]), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train/num_processes"] == 2 and summary["train/steps"] == 2


@pytest.mark.slow  # the plain case reads the two shared 2-step runs, which the slow suite's other tests read too
@pytest.mark.parametrize(
    "memory_switches",
    [
        pytest.param([], id="plain"),
        pytest.param(["train.gradient_checkpointing=true", "train.mixed_precision=bf16"], id="checkpointing-bf16"),
    ],
)
def test_fsdp_trains_as_ddp_does(shared_runs, tmp_path, memory_switches):
    """Same seeds, same samples, gradients averaged the same way: the per-step figures and the weights agree, with
    the update's memory switches too (checkpointed layers recompute inside FSDP2's gathered units)."""
    if memory_switches:
        overrides = [*SMALL, *CHECKPOINTS, "train.steps=2", *memory_switches]
        fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
        _run([*overrides, FSDP], fsdp)
        _run(overrides, ddp)
    else:
        fsdp, ddp = _shared(shared_runs, "fsdp_2"), _shared(shared_runs, "ddp_2")
    keys = ("rollout/reward_mean", "rollout/response_length", "train/loss", "train/grad_norm", "train/kl_to_ref")
    _assert_same_steps(fsdp, ddp, keys, steps=2)
    _assert_same_weights(fsdp, ddp)


@pytest.mark.slow  # a two-process run, and the two shared 2-step runs
def test_shared_prompts_train_as_the_padded_path_under_ddp_and_fsdp(shared_runs, tmp_path):
    """train.share_prompt (each group's prompt run once, gradients through its one pass) under DDP and under FSDP2
    (its scoring a registered forward of the sharded policy, two decoder passes inside): the same figures and weights
    as DDP with every row run whole."""
    padded = tmp_path / "padded"
    _run([*SHARED_RUNS["ddp_2"], "train.share_prompt=false"], padded)
    keys = ("rollout/reward_mean", "rollout/response_length", "train/loss", "train/grad_norm", "train/kl_to_ref")
    for shared in ("ddp_2", "fsdp_2"):
        _assert_same_steps(_shared(shared_runs, shared), padded, keys, steps=2)
        _assert_same_weights(_shared(shared_runs, shared), padded)


@pytest.mark.slow
def test_a_resumed_fsdp_run_replays_the_uninterrupted_one(shared_runs, tmp_path):
    """The gathered optimizer state is sharded again on resume; the RNG states and the prompt stream as under DDP:
    stopped after 2 steps and resumed to 4, the run logs and ends with what the uninterrupted 4-step run does (the
    DDP one, which FSDP2 trains as: test_fsdp_trains_as_ddp_does)."""
    run_dir, reference_dir = _resume_to_4_steps(shared_runs, "fsdp_2", tmp_path), _shared(shared_runs, "ddp_4")
    keys = ("rollout/reward_mean", "rollout/oracle_mean", "rollout/response_length", "train/loss")
    _assert_same_steps(run_dir, reference_dir, keys, steps=4)
    final, reference = _load_rank_weights(run_dir, 0), _load_rank_weights(reference_dir, 0)
    for name in final:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a multi-process or benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_fsdp_with_lora_trains_as_ddp_does_and_saves_the_adapter(shared_runs, tmp_path, tiny_dir):
    """The adapters are sharded with the frozen base layers they sit in; the reference (adapters off) is scored
    through the sharded forward; the checkpoint holds the adapter, gathered, and the merged model, as under DDP."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fsdp, ddp = _shared(shared_runs, "fsdp_lora_2"), tmp_path / "ddp"
    _run([item for item in SHARED_RUNS["fsdp_lora_2"] if item != FSDP], ddp)
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/kl_to_ref")
    _assert_same_steps(fsdp, ddp, keys, steps=2)
    _assert_same_weights(fsdp, ddp)
    fsdp_weights = _load_rank_weights(fsdp, 0)

    # Only the adapters trained: the base weights are the shipped policy's, the adapters' B moved away from 0.
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").named_parameters())
    adapters = [name for name in fsdp_weights if "lora_" in name]
    assert adapters and all(fsdp_weights[name].any() for name in adapters if "lora_B" in name)
    for name in fsdp_weights.keys() - adapters:
        base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(fsdp_weights[name], initial[base_name].detach()), name

    # The checkpoint's model/ is the adapter, which peft puts back onto the base: the gathered weights again; the
    # optimizer state covers the adapters alone.
    checkpoint = fsdp / "checkpoints" / "step_0000002"
    saved_files = {path.name for path in (checkpoint / MODEL_FOLDER).iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved_files
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy")
    reloaded = dict(PeftModel.from_pretrained(base, checkpoint / MODEL_FOLDER).named_parameters())
    assert reloaded.keys() == fsdp_weights.keys()
    for name, parameter in reloaded.items():
        assert torch.equal(parameter, fsdp_weights[name]), name
    optimizer_state = torch.load(checkpoint / "training_state.pt", weights_only=True)["optimizer"]["state"]
    assert sorted(optimizer_state) == sorted(adapters)
    # The merged model (rebuilt whole on rank 0 from the gathered weights) is DDP's, and loads without peft.
    merged = [
        load_file(run / "checkpoints" / "step_0000002" / MERGED_MODEL_FOLDER / "model.safetensors")
        for run in (fsdp, ddp)
    ]
    assert merged[0].keys() == merged[1].keys() == initial.keys() | {"lm_head.weight"}  # the adapted head, untied
    for name in merged[0]:
        torch.testing.assert_close(merged[0][name], merged[1][name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(merged[0][name], initial[name].detach()) for name in initial)  # the adapters merged in
    AutoModelForCausalLM.from_pretrained(checkpoint / MERGED_MODEL_FOLDER)


@pytest.mark.slow
def test_a_resumed_fsdp_lora_run_replays_the_uninterrupted_one(shared_runs, tmp_path):
    """The adapter loads onto the base before sharding, its gathered optimizer state is sharded again; the merged
    save (checkpoint.save_merged) leaves the run's random stream alone. (The rebuild the merged save merges drew from
    the main process's generator, and the uninterrupted run sampled differently from step 3 on, 2026-12-06.) The
    first 2 steps are the LoRA test's shared run, resumed in a copy of its folder."""
    run_dir, reference_dir = _resume_to_4_steps(shared_runs, "fsdp_lora_2", tmp_path), tmp_path / "uninterrupted"
    _run(_to_4_steps(SHARED_RUNS["fsdp_lora_2"]), reference_dir)
    keys = ("rollout/reward_mean", "rollout/response_length", "train/loss", "train/kl_to_ref")
    _assert_same_steps(run_dir, reference_dir, keys, steps=4)
    _assert_same_weights(run_dir, reference_dir)
