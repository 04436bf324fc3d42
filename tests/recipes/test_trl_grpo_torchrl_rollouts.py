"""recipes/trl_grpo_torchrl_rollouts.py on CPU: trl's GRPOTrainer sampling through interop.TorchRLRolloutFunc. The
stored rollouts are exactly what trl trained on; a step with the adapter is trl's step on the same completions; bad
settings are refused before any model loads; the default run learns (slow); a killed run resumes (slow); two
processes share one rollouts folder (slow)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from _processes import free_port, kill_recipe_run_when
from _small_runs import REPO_ROOT, read_metrics
from transformers import AutoTokenizer

import recipes.trl_grpo_torchrl_rollouts as recipe
from interop import TorchRLRolloutFunc
from interop.sampling import CausalLMSampler, SamplingSettings
from interop.trl_grpo import TorchRLGRPOTrainer
from recipes.common.config import ConfigError
from recipes.common.synthetic import make_prompts
from recipes.trl_grpo.rollout_store import load_rollouts, texts

# 3 steps of 8 completions (2 prompts x 4) of at most 8 tokens, 16 prompts.
SMALL = [
    "train.max_steps=3",
    "train.per_device_train_batch_size=8",
    "train.num_generations=4",
    "train.max_completion_length=8",
    "data.num_train_prompts=16",
    "rollout.prompts_per_draw=8",
]


def _capture_batches(monkeypatch) -> list[dict]:
    """What trl trains on: every batch ``_generate_and_score_completions`` returns, with the rewards it computed."""
    batches = []
    generate_and_score = TorchRLGRPOTrainer._generate_and_score_completions

    def recorded(self, inputs):
        output = generate_and_score(self, inputs)
        batches.append(
            {
                **{k: v.clone() for k, v in output.items() if torch.is_tensor(v)},
                "step": self.state.global_step + 1,
                "rewards": self._scored[2].clone(),
            }
        )
        return output

    monkeypatch.setattr(TorchRLGRPOTrainer, "_generate_and_score_completions", recorded)
    return batches


def test_stored_rollouts_are_exactly_what_trl_trained_on(compose_config, tmp_path, monkeypatch):
    batches = _capture_batches(monkeypatch)
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", "logger=csv"])
    summary = recipe.train(cfg)

    assert summary["train/steps"] == 3 and summary["rollouts/rows"] == 24 and summary["rollouts/rows_dropped"] == 0
    stored = load_rollouts(tmp_path / "rollouts")
    assert stored.shape[0] == 24 and len(batches) == 3
    assert summary["rollout/generated_tokens"] == int(stored["completion_length"].sum())
    # The GRPO recipe's summary names, where they mean the same thing.
    for name in ("rollout/reward_mean", "rollout/oracle_mean", "rollout/distinct_2", "rollout/response_length"):
        assert f"{name}_first" in summary and f"{name}_last" in summary, name
    for index, batch in enumerate(batches):
        rows = stored[stored["step"] == batch["step"]]
        assert rows.shape[0] == 8 and batch["step"] == index + 1
        completion_mask, prompt_mask = batch["completion_mask"].bool(), batch["prompt_mask"].bool()
        for row in range(8):
            length = int(rows["completion_length"][row])
            assert (
                rows["completion_ids"][row, :length].tolist()
                == batch["completion_ids"][row][completion_mask[row]].tolist()
            )
            prompt_length = int(rows["prompt_length"][row])
            assert (
                rows["prompt_ids"][row, -prompt_length:].tolist() == batch["prompt_ids"][row][prompt_mask[row]].tolist()
            )
        torch.testing.assert_close(rows["advantage"], batch["advantages"].float())
        torch.testing.assert_close(rows["rewards"], batch["rewards"].float())
    assert set(texts(stored, "prompt")) <= set(make_prompts(16, seed=cfg.data.seed))
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "tiny" / "policy")
    for row, text in enumerate(texts(stored, "completion")):
        ids = stored["completion_ids"][row, : int(stored["completion_length"][row])]
        assert text == tokenizer.decode(ids, skip_special_tokens=True)

    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1.0, 2.0, 3.0]
    assert all("rollout/oracle_mean" in row and "rollout/reward_mean" in row and "train/loss" in row for row in rows)
    assert json.loads((tmp_path / "rollouts" / "rank_0" / "part_0" / "progress.json").read_text())["rows_written"] == 24
    assert (tmp_path / "model" / "config.json").is_file()


def _trainer(tiny_policy, tmp_path, *, rollout_func_for):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    model = copy.deepcopy(tiny_policy[0])
    tokenizer = tiny_policy[1]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=10,
        top_k=50,  # the adapter's sampler below samples among the top 50, as trl is told
        beta=0.1,
        disable_tqdm=True,
        activation_checkpointing=False,
        loss_type="dapo",
    )
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(len(str(completion))) for completion in completions],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "Review the mug."}]] * 8}),
        processing_class=tokenizer,
        rollout_func=rollout_func_for(model, tokenizer),
    )


def test_a_step_with_the_adapter_is_trls_step_on_the_same_completions(tiny_policy, tmp_path, monkeypatch):
    """The completions the adapter sampled, injected into trl's own generation path (``_generate_single_turn``), give
    trl the same batch (ids, masks, advantages, reference log-probs) and the same loss."""
    trainer = _trainer(
        tiny_policy,
        tmp_path,
        rollout_func_for=lambda model, tokenizer: TorchRLRolloutFunc(
            CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=10, top_k=50)), tokenizer
        ),
    )
    prompts = ["Review the mug.", "Write a review of the new kettle."]
    inputs = [{"prompt": [{"role": "user", "content": text}]} for text in prompts for _ in range(4)]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets before a step
    torch.manual_seed(0)
    with_adapter = trainer._generate_and_score_completions(copy.deepcopy(inputs))
    sampled = trainer.rollout_func.last_rollout
    completion_ids = [
        row[:n].tolist() for row, n in zip(sampled["completion_ids"], sampled["completion_length"], strict=True)
    ]
    logprobs = [row[:n].tolist() for row, n in zip(sampled["logprobs"], sampled["completion_length"], strict=True)]

    trainer.rollout_func = None  # trl's own path: its tokenization, its generation call (answered with the same tokens)
    monkeypatch.setattr(trainer, "_generate_single_turn", lambda *args, **kwargs: (completion_ids, logprobs))
    trls_own = trainer._generate_and_score_completions(copy.deepcopy(inputs))

    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "ref_per_token_logps"):
        torch.testing.assert_close(with_adapter[key], trls_own[key], msg=key)
    assert len(set(map(len, completion_ids))) > 1 or len(completion_ids[0]) == 10
    loss_with_adapter = trainer.compute_loss(trainer.model, with_adapter)
    loss_trls_own = trainer.compute_loss(trainer.model, trls_own)
    torch.testing.assert_close(loss_with_adapter, loss_trls_own)
    assert torch.isfinite(loss_with_adapter) and with_adapter["advantages"].abs().sum() > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.num_generations=3"], "train.num_generations=3 does not divide the generation batch of 8"),
        (["+train.use_vllm=true"], "completions come from TorchRL"),
        (["+train.generation_kwargs.typical_p=0.9"], "train.generation_kwargs.typical_p"),
        (["+train.num_generation=4"], "trl.GRPOConfig has no such field"),
        (["train.report_to=wandb"], "train.report_to is set by the recipe"),
        (["train.max_steps=0"], "train.max_steps=0"),
        (["reward_model=none"], "nothing would score the completions"),
        (["+reward.functions.exact.function=recipes.common.arithmetic.exact_answer_reward"], "solution"),
        (["resume=true"], "holds no trl checkpoint"),
        (["model.lora.target_modules=[q_proj,lm_head]"], "model.lora.target_modules names lm_head"),
        (["model.lora.target_modules=[q_projection]"], "model.lora.target_modules"),
        (["reward_model.lora.r=8"], "reward_model.lora is set, but the reward model is frozen"),
        (["+train.eval_strategy=steps", "+train.eval_steps=1"], "this recipe hands trl no eval_dataset yet"),
        (["dtype=float8"], "dtype='float8': expected one of"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm=-1 must be >= 0 (the largest gradient norm kept)"),
    ],
)
def test_bad_settings_are_refused_before_any_model_loads(compose_config, tmp_path, monkeypatch, overrides, message):
    loads = []
    monkeypatch.setattr(recipe, "load_causal_lm", lambda *args, **kwargs: loads.append(1))
    if overrides == ["train.report_to=wandb"]:
        overrides = ["+train.report_to=wandb"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        recipe.train(cfg)
    assert loads == []


def test_model_lora_trains_adapters_that_the_torchrl_sampler_samples_with(compose_config, tmp_path, monkeypatch):
    """``model.lora`` becomes trl's ``peft_config``: the sampler's model holds the very adapter parameters trl's
    optimizer trains, the base weights stay as loaded, the reference is the model with its adapters off (a KL > 0 once
    they moved), and ``<run>/model`` is the adapter folder."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    made = []
    make_trainer = recipe.make_trainer

    def recorded_make_trainer(*args, **kwargs):
        made.append((make_trainer(*args, **kwargs), kwargs))
        return made[-1][0]

    monkeypatch.setattr(recipe, "make_trainer", recorded_make_trainer)
    lora = "model.lora={r:4,alpha:8,dropout:0.0,target_modules:[q_proj,v_proj]}"
    summary = recipe.train(compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", lora]))
    trainer, built_with = made[0]

    sampler_model = built_with["rollout_func"].policy.model
    adapters = {id(p) for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and adapters <= {id(p) for p in sampler_model.parameters()}  # the same tensors, no copy
    assert any(isinstance(module, LoraLayer) for module in sampler_model.modules())
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(".lora_" in name for name in trained)
    assert any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)  # lora_B starts at 0: it trained
    assert summary["train/kl_to_ref_last"] > 0

    base = AutoModelForCausalLM.from_pretrained(REPO_ROOT / "tiny" / "policy")
    shipped = load_file(REPO_ROOT / "tiny" / "policy" / "model.safetensors")
    compared = 0
    for name, weight in trainer.model.get_base_model().state_dict().items():
        plain = name.replace(".base_layer", "")
        if plain in shipped:
            torch.testing.assert_close(weight, shipped[plain], rtol=0, atol=0)
            compared += 1
    assert compared == len(shipped)  # every shipped weight, the adapted q_proj / v_proj ones included
    assert (tmp_path / "model" / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "model"))
    tokens = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, trainer.model(input_ids=tokens).logits)


def test_a_folder_holding_another_runs_rollouts_is_refused(compose_config, tmp_path):
    (tmp_path / "rollouts" / "rank_0" / "part_0").mkdir(parents=True)
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"already holds an earlier run \(rollouts\)"):
        recipe.train(cfg)


@pytest.mark.slow
def test_the_default_run_raises_the_oracle(compose_config, tmp_path):
    summary = recipe.train(compose_config("trl_grpo_torchrl_rollouts", [f"output_dir={tmp_path}"]))
    assert summary["train/steps"] == 30
    assert summary["rollout/oracle_mean_last"] - summary["rollout/oracle_mean_first"] >= 0.6, summary


@pytest.mark.slow
def test_resume_after_sigkill_continues_from_trls_checkpoint(compose_config, tmp_path):
    """Killed after its step-2 checkpoint, the run resumes from it; the stored rollouts keep each step once, the
    resumed part's for the steps it trained again."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.max_steps=6", "train.save_strategy=steps", "train.save_steps=2", "logger=csv"]

    def checkpoint_2_and_step_3_done() -> bool:
        metrics = run_dir / "metrics.csv"
        checkpointed = (run_dir / "trainer" / "checkpoint-2").is_dir()
        return checkpointed and metrics.exists() and any(row["step"] == 3.0 for row in read_metrics(run_dir))

    recipe_run = [*overrides, f"hydra.run.dir={run_dir}"]
    kill_recipe_run_when("trl_grpo_torchrl_rollouts.py", recipe_run, ready=checkpoint_2_and_step_3_done)

    summary = recipe.train(
        compose_config("trl_grpo_torchrl_rollouts", [*overrides, f"output_dir={run_dir}", "resume=true"])
    )
    assert summary["train/steps"] == 6
    stored = load_rollouts(run_dir / "rollouts")
    assert sorted(set(stored["step"].tolist())) == [1, 2, 3, 4, 5, 6]
    assert stored.shape[0] == 6 * 8, "each step's completions once"
    assert (run_dir / "rollouts" / "rank_0" / "part_1").is_dir()


@pytest.mark.slow
def test_two_processes_each_generate_and_store_their_own_rollouts(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "recipes/trl_grpo_torchrl_rollouts.py",
        *SMALL,
        "device=cpu",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    stored = load_rollouts(run_dir / "rollouts")
    assert sorted(set(stored["rank"].tolist())) == [0, 1]
    assert stored.shape[0] == 2 * 3 * 8, "3 steps of 8 completions per process"
    for rank in (0, 1):
        mine = stored[stored["rank"] == rank]
        assert sorted(set(mine["step"].tolist())) == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train/steps"] == 3
