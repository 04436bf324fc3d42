"""The GPU check, one call on a lent GPU machine: does every recipe run on CUDA, how fast, and in how much memory.

Run it through ``scripts/gpu_check.sh`` (which first installs the wheels ``scripts/gpu_wheels.sh`` fetched). Parts,
each in its own process under its own time limit, so that one slow or broken part cannot eat the others' time:

1. ``versions``: the packages, the GPU, and every carried package's requirements met by what the machine holds;
2. ``build_models``: offline, a randomly initialised Qwen2-shaped policy of Qwen2.5-0.5B's shapes (hidden 896,
   24 layers, 151,936-token vocabulary) and a sequence-classification reward model of the same shape, with the tiny
   tokenizer (ids past it decode to nothing: the speed and memory are a real 0.5B model's, the text is not);
3. ``gpu_tests``: the ``gpu``-marked tests;
4. ``grpo_sync``, ``grpo_async``, ``grpo_lora``, ``grpo_gradient_checkpointing``: the GRPO recipe for a few steps on
   CUDA with the 0.5B policy and reward model (bf16 weights; the last with float32 weights under bf16 autocast);
5. ``reward``: the reward recipe, training the 0.5B reward model for a few steps (the tiny policy samples pairs);
6. ``bench``: ``scripts/bench_grpo.py``, ours against trl's ``GRPOTrainer`` (its own ``generate``), at the 0.5B build;
7. ``estimate_memory``: ``scripts/estimate_memory.py --measure``, one real update on CUDA against the estimate.

Everything goes to ``<out>/gpu_check.json`` (per part: passed, seconds, figures, the error's last lines; figures:
tokens/s and s/step per side and phase, peak CUDA memory per run, the estimator's ratio) and the full log to
``<out>/gpu_check.log``. ``--dry-run`` runs the same parts on this CPU machine with a small build of the same shape
family and fewer steps: everything but CUDA itself is proven here (a slow test runs it).

    bash scripts/gpu_check.sh --dry-run           # here: CPU, small models, about 5 minutes on 2 cores
    bash scripts/gpu_check.sh                     # there, $OUT set by the device tool, carry=[".whl"]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = REPO_ROOT / "tiny" / "policy"
# The packages the recipes import that the GPU machine does not hold (scripts/gpu_wheels.sh carries them).
CARRIED = ("torchrl", "tensordict", "trl", "datasets", "hydra-core", "omegaconf")
REPORTED = ("torch", "transformers", "accelerate", "peft", "safetensors", "pyarrow", *CARRIED)

# Qwen2.5-0.5B's shapes, randomly initialised; the dry run's build is the same family at a size a CPU steps fast.
SHAPES = {
    "qwen2_5_0_5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
    ),
    # A vocabulary past the tokenizer's 463 tokens, as the real build's is: out-of-tokenizer ids take the same path.
    "small": dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=512,
        rope_theta=10_000.0,
    ),
}


@dataclass(frozen=True)
class Mode:
    """What differs between the real check and its dry run."""

    device: str
    dtype: str
    shape: str
    grpo_steps: int
    reward_steps: int
    bench_args: tuple[str, ...]
    # Seconds per part: they add up to under 9 minutes on the GPU machine, install included.
    budgets: dict[str, int] = field(default_factory=dict)


GPU = Mode(
    device="cuda",
    dtype="bfloat16",
    shape="qwen2_5_0_5b",
    grpo_steps=3,
    reward_steps=10,
    bench_args=("--rounds", "2", "--steps", "4", "--sync-threads", "1", "--trl-threads", "1"),
    budgets=dict(
        versions=20,
        build_models=50,
        gpu_tests=70,
        grpo_sync=45,
        grpo_async=50,
        grpo_lora=40,
        grpo_gradient_checkpointing=40,
        reward=45,
        bench=110,
        estimate_memory=40,
    ),
)
DRY_RUN = Mode(
    device="cpu",
    dtype="float32",
    shape="small",
    grpo_steps=2,
    reward_steps=4,
    bench_args=("--rounds", "1", "--steps", "2", "--sync-threads", "1", "--trl-threads", "1"),
    budgets=dict(
        versions=30,
        build_models=60,
        gpu_tests=120,
        grpo_sync=60,
        grpo_async=90,
        grpo_lora=60,
        grpo_gradient_checkpointing=60,
        reward=90,
        bench=240,
        estimate_memory=60,
    ),
)


class Check:
    """Runs the parts one after another, each a child process under its budget, and records what each gave."""

    def __init__(self, out: Path, scratch: Path, mode: Mode) -> None:
        self.out, self.scratch, self.mode = out, scratch, mode
        self.log = (out / "gpu_check.log").open("a", encoding="utf-8")
        self.results: dict[str, dict] = {}
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            WANDB_MODE="disabled",
            TOKENIZERS_PARALLELISM="false",
        )

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def part(self, name: str, command: list[str], figures=None) -> bool:
        """Runs ``command``; on success ``figures()`` reads what it wrote. Returns whether it passed."""
        budget = self.mode.budgets[name]
        self.say(f"\n=== {name} (at most {budget} s): {' '.join(command)}")
        start, timed_out = time.perf_counter(), False
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: a timeout ends its children too (torchrun, collectors)
        )
        tail: list[str] = []

        def copy_output() -> None:  # the child's output, as it comes, to the console, the log and the tail
            for line in process.stdout:
                sys.stdout.write(line)
                self.log.write(line)
                tail.append(line.rstrip("\n"))
                del tail[:-40]

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        try:
            process.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(timeout=10)
        self.log.flush()
        seconds = time.perf_counter() - start
        result = {"passed": process.returncode == 0 and not timed_out, "seconds": round(seconds, 1)}
        if timed_out:
            result["error"] = [f"timed out after {budget} s"] + tail[-15:]
        elif process.returncode != 0:
            result["error"] = [f"exit status {process.returncode}"] + tail[-15:]
        elif figures is not None:
            try:
                result["figures"] = figures(tail)
            except Exception as error:  # a run that passed but left no figures is a failure of this part
                result.update(passed=False, error=[f"no figures: {type(error).__name__}: {error}"] + tail[-10:])
        self.results[name] = result
        self.say(f"=== {name}: {'passed' if result['passed'] else 'FAILED'} in {seconds:.1f} s")
        self.write()
        return result["passed"]

    def write(self) -> None:
        report = {"mode": "dry-run" if self.mode is DRY_RUN else "gpu", "parts": self.results}
        path = self.out / "gpu_check.json"
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(report, indent=2))
        temporary.replace(path)


def summary_figures(run_dir: Path):
    """A recipe run's summary.json, the figures that say how fast and how big."""

    def read(_tail) -> dict:
        summary = json.loads((run_dir / "summary.json").read_text())
        keep = ("train/steps", "rollout/generated_tokens", "train/loss_first", "train/loss_last")
        return {key: value for key, value in summary.items() if key.startswith("perf/") or key in keep}

    return read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on this CPU machine, small models, fewer steps")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or REPO_ROOT / "outputs" / "gpu_check"),
        help="where gpu_check.json and gpu_check.log go (default: $OUT, else outputs/gpu_check)",
    )
    parser.add_argument("--scratch", type=Path, default=None, help="models and run folders (default: a temp folder)")
    parser.add_argument("--build-models", type=Path, default=None, help=argparse.SUPPRESS)  # internal: one part
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_models is not None:
        return build_models(args.build_models, shape=args.shape, device="cpu" if args.dry_run else "cuda")
    if args.versions:
        return print_versions(gpu=not args.dry_run)

    mode = DRY_RUN if args.dry_run else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    check = Check(args.out, scratch, mode)
    python = sys.executable
    dry = ["--dry-run"] if args.dry_run else []
    policy, reward_model = scratch / "models" / "policy", scratch / "models" / "reward_model"

    check.part("versions", [python, __file__, "--versions", *dry], figures=_json_line)
    built = check.part(
        "build_models",
        [python, __file__, "--build-models", str(scratch / "models"), "--shape", mode.shape, *dry],
        figures=_json_line,
    )
    check.part(
        "gpu_tests",
        # One process (-n 0, not pyproject's -n auto): the gpu tests share one device, and workers that only find
        # skips here would each collect the whole suite again.
        [python, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider", "tests"],
        figures=_pytest_counts,
    )
    if built:
        common = [
            f"model.name_or_path={policy}",
            f"reward_model.name_or_path={reward_model}",
            f"device={mode.device}",
            "logger=csv",
            "progress_bar=false",
        ]
        grpo = [python, "recipes/grpo_torchrl_rm.py", *common, f"train.steps={mode.grpo_steps}"]
        runs = {
            "grpo_sync": [f"dtype={mode.dtype}"],
            "grpo_async": [f"dtype={mode.dtype}", "rollout.mode=async"],
            "grpo_lora": [f"dtype={mode.dtype}", "model.lora.r=16"],
            # float32 master weights under bf16 autocast: the mixed-precision path, with activation checkpointing.
            "grpo_gradient_checkpointing": [
                "dtype=float32",
                "train.mixed_precision=bf16",
                "train.gradient_checkpointing=true",
            ],
        }
        for name, overrides in runs.items():
            run_dir = scratch / "runs" / name
            check.part(name, [*grpo, *overrides, f"hydra.run.dir={run_dir}"], figures=summary_figures(run_dir))
        reward_dir = scratch / "runs" / "reward"
        check.part(
            "reward",
            [
                python,
                "recipes/reward_trainer_from_buffer.py",
                f"reward_model.name_or_path={reward_model}",  # trained into a reward model; the tiny policy samples
                f"device={mode.device}",
                f"train.max_steps={mode.reward_steps}",
                "train.warmup_steps=0",
                "generation.prompts_per_batch=32",
                f"hydra.run.dir={reward_dir}",
            ],
            figures=summary_figures(reward_dir),
        )
        bench_json = scratch / "bench.json"
        check.part(
            "bench",
            [
                python,
                "scripts/bench_grpo.py",
                *mode.bench_args,
                "--json",
                str(bench_json),
                f"model.name_or_path={policy}",
                f"reward_model.name_or_path={reward_model}",
                f"device={mode.device}",
                f"dtype={mode.dtype}",
            ],
            figures=lambda _tail: json.loads(bench_json.read_text()),
        )
        estimate_json = scratch / "estimate.json"
        check.part(
            "estimate_memory",
            [
                python,
                "scripts/estimate_memory.py",
                "--measure",
                "--json",
                str(estimate_json),
                f"model.name_or_path={policy}",
                f"reward_model.name_or_path={reward_model}",
                f"device={mode.device}",
                f"dtype={mode.dtype}",
            ],
            figures=lambda _tail: _estimate_figures(json.loads(estimate_json.read_text())),
        )
    failed = [name for name, result in check.results.items() if not result["passed"]]
    skipped = [] if built else ["every recipe part (no models were built)"]
    check.say(
        f"\ngpu_check ({'dry run' if args.dry_run else 'GPU'}): {len(check.results) - len(failed)} of "
        f"{len(check.results)} parts passed{'; failed: ' + ', '.join(failed) if failed else ''}"
        f"{'; skipped: ' + ', '.join(skipped) if skipped else ''}. Figures: {args.out / 'gpu_check.json'}"
    )
    return 1 if failed or skipped else 0


def print_versions(*, gpu: bool) -> int:
    """The packages' versions and the device; fails when a carried package's requirement is not met."""
    import importlib.metadata

    import torch
    from packaging.requirements import Requirement

    figures = {name: importlib.metadata.version(name) for name in REPORTED}
    figures["python"] = sys.version.split()[0]
    figures["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        figures["torch_cuda"] = torch.version.cuda
    unmet = []
    for name in CARRIED:
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                unmet.append(f"{name} needs {requirement}: not installed")
                continue
            if found not in requirement.specifier:
                unmet.append(f"{name} needs {requirement}: {found} installed")
    figures["unmet_requirements"] = unmet
    print(json.dumps(figures))
    for line in unmet:
        print(f"gpu_check: {line}", file=sys.stderr)
    if gpu and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 1
    return 1 if unmet else 0


def build_models(folder: Path, *, shape: str, device: str) -> int:
    """A randomly initialised Qwen2 policy and reward model of ``SHAPES[shape]``, saved as safetensors with the tiny
    tokenizer, loadable with ``from_pretrained`` as a hub checkpoint would be."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    dims = SHAPES[shape]
    if dims["vocab_size"] < len(tokenizer):
        raise SystemExit(f"gpu_check: shape {shape}'s vocabulary is smaller than the tokenizer's {len(tokenizer)}")
    config = Qwen2Config(
        **dims,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    figures = {"shape": shape}
    for name, model_class, extra in (
        ("policy", Qwen2ForCausalLM, {}),
        ("reward_model", Qwen2ForSequenceClassification, {"num_labels": 1}),
    ):
        for key, value in extra.items():
            setattr(config, key, value)
        with torch.device(device):
            model = model_class(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
        model.save_pretrained(folder / name, safe_serialization=True)
        tokenizer.save_pretrained(folder / name)
        figures[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
        del model
    figures["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(figures))
    return 0


def _json_line(tail: list[str]) -> dict:
    """The last line of a part's output that is a JSON object."""
    for line in reversed(tail):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("the part printed no JSON line")


def _pytest_counts(tail: list[str]) -> dict:
    """pytest's closing line, as counts: {"passed": 3, "skipped": 1}."""
    import re

    for line in reversed(tail):
        counts = dict((word, int(number)) for number, word in re.findall(r"(\d+) (\w+)", line))
        if {"passed", "skipped", "deselected", "failed", "error"} & counts.keys():
            return counts
    raise ValueError("no pytest summary line")


def _estimate_figures(figures: dict) -> dict:
    """The estimate's peak and update phase, the measured update and their ratio."""
    keep = ("peak", "update_phase", "measured_update", "measured_estimate", "setting")
    result = {key: figures[key] for key in keep if key in figures}
    result["measured_over_estimated"] = figures["measured_update"] / figures["measured_estimate"]
    return result


if __name__ == "__main__":
    sys.exit(main())
