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
7. ``estimate_memory``: ``scripts/estimate_memory.py --measure``, one real update on CUDA against the estimate;
8. ``grpo_ray``: the GRPO recipe with ``rollout.backend=ray rollout.workers=1``, its one worker a Ray actor on the GPU
   (``rollout.worker_resources.num_gpus=1``: the learner, Ray's driver, is outside Ray's books and shares the GPU)
   in a local cluster the run starts: the worker's sampling tokens/s, the learner's weight push into Ray's object
   store (``perf/weight_sync_s``) and the step time, per step and their mean after the first. Skipped, with a line
   saying so, where ``ray`` cannot be imported: on the GPU machine it comes in a second call
   (``scripts/gpu_check.sh`` says why and how).

Everything goes to ``<out>/gpu_check.json`` (per part: passed, seconds, figures, the error's last lines; figures:
tokens/s and s/step per side and phase, peak CUDA memory per run, the estimator's ratio) and the full log to
``<out>/gpu_check.log``. ``--dry-run`` runs the same parts on this CPU machine with a small build of the same shape
family and fewer steps (the Ray worker on a CPU): everything but CUDA itself is proven here.
``--only NAME[,NAME...]`` runs those parts (and ``versions``), reusing the models an earlier run left in the scratch
folder (building them otherwise), and adds their results to that run's ``gpu_check.json``.

    bash scripts/gpu_check.sh --dry-run           # here: CPU, small models, about 5 minutes on 2 cores
    bash scripts/gpu_check.sh                     # there, $OUT set by the device tool, carry=[".whl"]
    bash scripts/gpu_check.sh --only grpo_ray     # there, next call, carry=[".whl", ".whl-ray"]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = REPO_ROOT / "tiny" / "policy"
# The packages the recipes import that the GPU machine does not hold (scripts/gpu_wheels.sh carries them).
CARRIED = ("torchrl", "tensordict", "trl", "datasets", "hydra-core", "omegaconf")
REPORTED = ("torch", "transformers", "accelerate", "peft", "safetensors", "pyarrow", *CARRIED)
# The Ray part's call also carries these (scripts/gpu_wheels.sh --ray).
RAY_CARRIED = ("ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py")

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
    # The Ray part's steps: its first builds the worker's collector and warms up, the others are what it measures.
    ray_steps: int = 2
    # Seconds per part: the parts before grpo_ray add up to under 9 minutes on the GPU machine, install included;
    # grpo_ray runs in a call of its own there (scripts/gpu_check.sh).
    budgets: dict[str, int] = field(default_factory=dict)


GPU = Mode(
    device="cuda",
    dtype="bfloat16",
    shape="qwen2_5_0_5b",
    grpo_steps=3,
    reward_steps=10,
    bench_args=("--rounds", "2", "--steps", "4", "--sync-threads", "1", "--trl-threads", "1"),
    ray_steps=4,
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
        grpo_ray=150,
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
        grpo_ray=120,
    ),
)


class Check:
    """Runs the parts one after another, each a child process under its budget, and records what each gave."""

    def __init__(self, out: Path, scratch: Path, mode: Mode, *, earlier: dict[str, dict] | None = None) -> None:
        self.out, self.scratch, self.mode = out, scratch, mode
        self.log = (out / "gpu_check.log").open("a", encoding="utf-8")
        self.results: dict[str, dict] = dict(earlier or {})  # an earlier call's parts, which a part run again replaces
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

    def skip(self, name: str, reason: str) -> None:
        """Records that ``name`` did not run, and why: a line in the log, ``{"passed": null, "skipped": reason}`` in
        the report."""
        self.results[name] = {"passed": None, "skipped": reason}
        self.say(f"\n=== {name}: skipped: {reason}")
        self.write()

    def write(self) -> None:
        report = {"mode": _mode_name(self.mode), "parts": self.results}
        # The scratch copy is what a later --only call on the same machine adds its parts to ($OUT is emptied).
        for folder in (self.out, self.scratch):
            path = folder / "gpu_check.json"
            temporary = path.with_suffix(".json.tmp")
            temporary.write_text(json.dumps(report, indent=2))
            temporary.replace(path)


def _mode_name(mode: Mode) -> str:
    return "dry-run" if mode is DRY_RUN else "gpu"


def earlier_results(scratch: Path, mode: Mode) -> dict[str, dict]:
    """The parts an earlier run of the same mode recorded in ``scratch`` (none if it holds no report)."""
    path = scratch / "gpu_check.json"
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    return report["parts"] if report.get("mode") == _mode_name(mode) else {}


@dataclass(frozen=True)
class Part:
    """One part of the check: the command it runs and what reads its figures once it passed."""

    name: str
    command: list[str]
    figures: Callable[[list[str]], dict] | None = None
    needs_models: bool = False  # runs on the models the build_models part writes
    needs_module: str | None = None  # skipped, with a line saying so, where this module cannot be imported


def summary_figures(run_dir: Path):
    """A recipe run's summary.json, the figures that say how fast and how big."""

    def read(_tail) -> dict:
        summary = json.loads((run_dir / "summary.json").read_text())
        keep = ("train/steps", "rollout/generated_tokens", "train/loss_first", "train/loss_last")
        return {key: value for key, value in summary.items() if key.startswith("perf/") or key in keep}

    return read


def ray_figures(run_dir: Path):
    """The Ray part's figures: per step (``metrics.csv``) the one worker's sampling throughput
    (``rollout/worker_0/tokens_per_s``), the learner's push of its weights into Ray's object store
    (``perf/weight_sync_s``) and the step's time, each with its mean over the steps after the first (which builds the
    worker's collector and warms up); where the worker ran (``resolved_config.yaml``); the run's summary figures."""

    def read(tail) -> dict:
        import yaml

        with (run_dir / "metrics.csv").open(newline="") as file:
            rows = list(csv.DictReader(file))
        if not rows or not rows[0].get("rollout/worker_0/tokens_per_s"):
            raise ValueError(f"{run_dir / 'metrics.csv'} has no rollout/worker_0/tokens_per_s: no Ray worker sampled")
        figures = summary_figures(run_dir)(tail)
        for key, name in RAY_FIGURES.items():
            values = [float(row[key]) for row in rows]
            figures[name] = values
            measured = values[1:] or values
            figures[f"{name}_mean_after_first"] = sum(measured) / len(measured)
        figures["worker_restarts"] = sum(float(row["rollout/worker_restarts"]) for row in rows)
        config = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
        figures["device"] = config["device"]
        figures["worker_resources"] = config["rollout"]["worker_resources"]
        return figures

    return read


# The Ray part's per-step figures: metrics.csv's column -> the name in gpu_check.json.
RAY_FIGURES = {
    "rollout/worker_0/tokens_per_s": "worker_tokens_per_s",
    "perf/weight_sync_s": "weight_sync_s",
    "perf/step_time_s": "step_time_s",
}
# Why a part that needs a module is skipped where it cannot be imported, and how to get it.
MISSING_MODULE = {
    "ray": "ray cannot be imported: on the GPU machine the Ray part runs in a call of its own, carrying the wheels "
    "of `bash scripts/gpu_wheels.sh --ray` (carry=['.whl', '.whl-ray'], `bash scripts/gpu_check.sh --only grpo_ray`);"
    ' here, pip install -e ".[ray]"',
}


def importable(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it: ray's import takes seconds)."""
    return importlib.util.find_spec(module) is not None


def models_ready(folder: Path, shape: str) -> bool:
    """Whether ``folder`` holds a policy and a reward model of ``SHAPES[shape]`` (an earlier run's build)."""
    for name in ("policy", "reward_model"):
        path = folder / name / "config.json"
        if not path.exists():
            return False
        config = json.loads(path.read_text())
        if any(config.get(key) != SHAPES[shape][key] for key in ("hidden_size", "num_hidden_layers", "vocab_size")):
            return False
    return True


def plan(mode: Mode, scratch: Path, *, python: str = sys.executable) -> list[Part]:
    """Every part of the check in ``mode``, in the order they run; models and run folders under ``scratch``."""
    dry = ["--dry-run"] if mode is DRY_RUN else []
    models = scratch / "models"
    policy, reward_model = models / "policy", models / "reward_model"
    parts = [
        Part("versions", [python, str(Path(__file__)), "--versions", *dry], figures=_json_line),
        Part(
            "build_models",
            [python, str(Path(__file__)), "--build-models", str(models), "--shape", mode.shape, *dry],
            figures=_json_line,
        ),
        # One process (-n 0, not pyproject's -n auto): the gpu tests share one device, and workers that only find
        # skips here would each collect the whole suite again.
        Part(
            "gpu_tests",
            [python, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider", "tests"],
            figures=_pytest_counts,
        ),
    ]
    common = [
        f"model.name_or_path={policy}",
        f"reward_model.name_or_path={reward_model}",
        f"device={mode.device}",
        "logger=csv",
        "progress_bar=false",
    ]
    grpo = [python, "recipes/grpo_torchrl_rm.py", *common]
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
        parts.append(
            Part(
                name,
                [*grpo, f"train.steps={mode.grpo_steps}", *overrides, f"hydra.run.dir={run_dir}"],
                figures=summary_figures(run_dir),
                needs_models=True,
            )
        )
    reward_dir = scratch / "runs" / "reward"
    parts.append(
        Part(
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
            needs_models=True,
        )
    )
    bench_json = scratch / "bench.json"
    parts.append(
        Part(
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
            needs_models=True,
        )
    )
    estimate_json = scratch / "estimate.json"
    parts.append(
        Part(
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
            needs_models=True,
        )
    )
    ray_dir = scratch / "runs" / "grpo_ray"
    parts.append(
        Part(
            "grpo_ray",
            [
                *grpo,
                f"dtype={mode.dtype}",
                f"train.steps={mode.ray_steps}",
                "rollout.backend=ray",  # a local cluster the run starts (ray.address null) and stops
                "rollout.workers=1",
                # On CUDA the worker asks Ray for the GPU; the learner, Ray's driver, is outside Ray's books and uses
                # the same one. On the CPU a worker that asks for no GPU samples on its CPU.
                f"rollout.worker_resources.num_gpus={1 if mode.device == 'cuda' else 0}",
                f"hydra.run.dir={ray_dir}",
            ],
            figures=ray_figures(ray_dir),
            needs_models=True,
            needs_module="ray",
        )
    )
    return parts


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
    parser.add_argument(
        "--only",
        default=None,
        metavar="NAME[,NAME...]",
        help="run these parts (and versions) only, on the models an earlier run left in --scratch (built otherwise); "
        "their results join that run's gpu_check.json",
    )
    parser.add_argument("--build-models", type=Path, default=None, help=argparse.SUPPRESS)  # internal: one part
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_models is not None:
        return build_models(args.build_models, shape=args.shape, device="cpu" if args.dry_run else "cuda")
    if args.versions:
        return print_versions(gpu=not args.dry_run)

    mode = DRY_RUN if args.dry_run else GPU
    scratch = args.scratch or Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check"
    parts = plan(mode, scratch)
    names = [part.name for part in parts]
    only = None if args.only is None else [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        parser.error(f"--only {args.only}: no part named {unknown}; the parts are {', '.join(names)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if only is None and scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, scratch, mode, earlier=earlier_results(scratch, mode) if only else None)

    selected = [part for part in parts if only is None or part.name in ("versions", *only)]
    models = scratch / "models"
    built = only is not None and models_ready(models, mode.shape)  # --only: an earlier run's models, if it left them
    if built:
        check.say(f"\n=== build_models: reusing the models of an earlier run in {models}")
    elif any(part.needs_models for part in selected) and "build_models" not in [part.name for part in selected]:
        selected.insert(1, next(part for part in parts if part.name == "build_models"))
    not_built = []
    for part in selected:
        if part.needs_models and not built:
            not_built.append(part.name)
            check.skip(part.name, "no models were built")
        elif part.needs_module is not None and not importable(part.needs_module):
            check.skip(part.name, MISSING_MODULE.get(part.needs_module, f"{part.needs_module} cannot be imported"))
        else:
            shutil.rmtree(scratch / "runs" / part.name, ignore_errors=True)  # --only again: the part starts afresh
            passed = check.part(part.name, part.command, figures=part.figures)
            built = passed if part.name == "build_models" else built
    check.write()  # in $OUT, the earlier call's parts too, whatever ran in this one
    failed = [name for name, result in check.results.items() if result["passed"] is False]
    skipped = [name for name, result in check.results.items() if result["passed"] is None]
    ran = len(check.results) - len(skipped)
    check.say(
        f"\ngpu_check ({'dry run' if args.dry_run else 'GPU'}): {ran - len(failed)} of {ran} parts passed"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}"
        f"{'; skipped: ' + ', '.join(skipped) if skipped else ''}. Figures: {args.out / 'gpu_check.json'}"
    )
    return 1 if failed or not_built else 0


def print_versions(*, gpu: bool) -> int:
    """The packages' versions and the device; fails when a carried package's requirement is not met."""
    import importlib.metadata

    import torch
    from packaging.requirements import Requirement

    # Ray where it was carried (the Ray part's call): the versions, and their requirements met like the others'.
    carried = (*CARRIED, *RAY_CARRIED) if importable("ray") else CARRIED
    figures = {name: importlib.metadata.version(name) for name in dict.fromkeys((*REPORTED, *carried))}
    figures["python"] = sys.version.split()[0]
    figures["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        figures["torch_cuda"] = torch.version.cuda
    unmet = []
    for name in carried:
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
