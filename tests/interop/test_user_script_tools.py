"""A tool defined in a trl user's own script (a typed, documented function beside the trainer, as trl's docs write
it, and no ``if __name__ == "__main__":`` guard) works in sync and async mode, and no other process runs the script:
the tool travels by value to the tool worker (and to the async sampling process), which never re-import ``__main__``.
The processes such a tool starts die with the trainer killed by SIGKILL, through the async sampling process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _processes import REPO_ROOT, kill_leftovers, still_running

# The user's script. Its top level notes each process that runs it; the tool notes each process that calls it.
SCRIPT = '''
import os, sys

with open(os.environ["SCRIPT_RUNS"], "a") as runs:
    runs.write(f"{os.getpid()}\\n")

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from interop import TorchRLRolloutFunc
from recipes.tasks.calculator import exact_answer_reward, make_task


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    with open(os.environ["TOOL_CALLS"], "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    if os.environ.get("SLEEPERS"):  # a tool that starts a process per call (a command it runs)
        import subprocess

        with open(os.environ["SLEEPERS"], "a") as sleepers:
            sleepers.write(f"{subprocess.Popen(['sleep', '600'], start_new_session=True).pid}\\n")
    return a * b


tiny, mode, output_dir = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(f"{tiny}/calculator_policy", padding_side="left")
model = AutoModelForCausalLM.from_pretrained(f"{tiny}/calculator_policy")
prompts, columns = make_task(16, seed=0)
rows = {"prompt": [[{"role": "user", "content": p}] for p in prompts], "solution": columns["solution"]}
args = GRPOConfig(
    output_dir=output_dir, use_cpu=True, report_to="none", bf16=False, per_device_train_batch_size=8,
    num_generations=4, max_completion_length=160, max_tool_calling_iterations=1, max_steps=3, disable_tqdm=True,
    activation_checkpointing=False, shuffle_dataset=mode == "sync",
)
if mode == "sync":
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact_answer_reward, args=args, train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=tokenizer, rollout_func=TorchRLRolloutFunc(tools=[multiply]),
    )
else:  # async mode samples from a TorchRL prompt stream
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement

    from interop import TorchRLBufferDataset
    from interop.trl.trainer import TorchRLGRPOTrainer

    source = ReplayBuffer(storage=LazyTensorStorage(16), sampler=SamplerWithoutReplacement())
    source.extend(TensorDict({key: NonTensorStack(*map(NonTensorData, value)) for key, value in rows.items()}, [16]))
    stream = TorchRLBufferDataset(source, batch_size=4, keys=list(rows), num_batches=None).as_hf_dataset()
    trainer = TorchRLGRPOTrainer(
        model=model, reward_funcs=exact_answer_reward, args=args, train_dataset=stream, processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(tools=[multiply], mode="async"),
    )
trainer.train()
print("steps", trainer.state.global_step)
'''


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_tool_in_an_unguarded_user_script_is_called_and_the_script_runs_once(tiny_dir, tmp_path, mode):
    """tiny/calculator_policy calls its tool in about a third of its answers: 24 dialogs without a call, ~6e-5."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runs, calls = tmp_path / "runs", tmp_path / "calls"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SCRIPT_RUNS": str(runs), "TOOL_CALLS": str(calls)}
    env.update(HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    command = [sys.executable, str(script), str(tiny_dir), mode, str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["steps", "3"]
    assert len(runs.read_text().split()) == 1, "another process ran the user's script"
    callers = set(calls.read_text().split()) if calls.exists() else set()
    assert callers and runs.read_text().split()[0] not in callers, "the tool ran, in a worker process"


@pytest.mark.slow
def test_what_a_tool_started_in_async_mode_dies_with_the_trainer_killed_by_sigkill(tiny_dir, tmp_path):
    """Trainer -> sampling process -> tool worker -> the tool's processes (in sessions of their own)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    sleepers = tmp_path / "sleepers"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SCRIPT_RUNS": str(tmp_path / "runs")}
    env.update(TOOL_CALLS=str(tmp_path / "calls"), SLEEPERS=str(sleepers), TRL_EXPERIMENTAL_SILENCE="1")
    pids = []

    def read_pids() -> list[int]:
        pids[:] = [int(pid) for pid in sleepers.read_text().split()] if sleepers.exists() else []
        return pids

    trainer = subprocess.Popen([sys.executable, str(script), str(tiny_dir), "async", str(tmp_path / "out")], env=env)
    try:
        deadline = time.monotonic() + 300
        while len(read_pids()) < 2 and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.poll() is None and len(pids) >= 2, "the run ended, or called no tool twice, in 300 s"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert still_running(read_pids(), 10.0) == [], "the tool's processes outlived the trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        kill_leftovers(read_pids())
