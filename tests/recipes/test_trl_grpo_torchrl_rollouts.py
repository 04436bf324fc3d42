"""recipes/trl_grpo_torchrl_rollouts.py on CPU: trl's GRPOTrainer sampling through interop.TorchRLRolloutFunc. The
stored rollouts are exactly what trl trained on; a step with the adapter is trl's step on the same completions; bad
settings are refused before any model loads; the default run learns (slow); a killed run resumes (slow); two
processes share one rollouts folder (slow)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from _processes import accelerate_launch_forked, free_port, kill_recipe_run_when
from _small_runs import REPO_ROOT, TRL_SMALL, read_metrics
from transformers import AutoTokenizer
from trl import GRPOConfig

import recipes.trl_grpo_torchrl_rollouts as recipe
from interop import TorchRLRolloutFunc
from interop.sampling import CausalLMSampler, SamplingSettings
from interop.trl.trainer import TorchRLGRPOTrainer
from recipes.common.config import ConfigError, RunStopped
from recipes.common.schema import trainer_config_view
from recipes.tasks.synthetic import make_prompts
from recipes.trl_grpo.rollout_store import load_rollouts, texts

SMALL = TRL_SMALL  # 3 steps of 8 completions (2 prompts x 4) of at most 8 tokens, 16 prompts.
SMALL_ON_A_FILE = [override for override in SMALL if not override.startswith("data.")]


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
    from recipes.trl_grpo.report import summary_keys

    batches = _capture_batches(monkeypatch)
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", "logger=csv"])
    expected_keys = summary_keys(cfg, trainer_config_view(cfg.train, GRPOConfig))
    summary = recipe.train(cfg)

    assert set(summary) == expected_keys  # what metric= is checked against before the run
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
        (["rollout.group_size=3"], "rollout.group_size=3 does not divide the generation batch of 8"),
        (["rollout.group_size=1"], "rollout.group_size=1: GRPO scores each completion against the other"),
        (["rollout.generation.do_sample=false"], "do_sample=false with rollout.group_size=4: greedy decoding"),
        (["+train.use_vllm=true"], "completions come from TorchRL"),
        (["+rollout.generation.typical_p=0.9"], "rollout.generation.typical_p: trl_grpo_torchrl_rollouts has no such"),
        (["rollout.generation.temperature=0"], "rollout.generation.temperature=0 must be > 0 when sampling"),
        (["+train.num_generation=4"], "trl.GRPOConfig has no such field"),
        (["train.report_to=wandb"], "train.report_to is set by the recipe"),
        (["train.max_steps=0"], "train.max_steps=0"),
        (["reward_model=none"], "nothing would score the completions"),
        (["+reward.functions.exact.function=recipes.tasks.arithmetic.exact_answer_reward"], "solution"),
        (["resume=true"], "holds no trl checkpoint"),
        (["model.lora.target_modules=[q_proj,lm_head]"], "model.lora.target_modules names lm_head"),
        (["model.lora.target_modules=[q_projection]"], "model.lora.target_modules"),
        (["reward_model.lora.r=8"], "reward_model.lora is set, but the reward model is frozen"),
        (["+train.eval_strategy=steps", "+train.eval_steps=1"], "this recipe hands trl no eval_dataset yet"),
        (["dtype=float8"], "dtype='float8': expected one of"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm=-1 must be >= 0 (the largest gradient norm kept)"),
        (["+train.reward_weights=[5.0]"], "from reward.model_weight (the reward model's) and reward.functions"),
        (["+train.resume_from_checkpoint=/tmp/checkpoint-2"], "a run resumes with resume=true"),
        (["train.warmup_steps=5"], "train.warmup_steps=5 with train.lr_scheduler_type=constant: that schedule ignores"),
        (["train.warmup_steps=0.1"], "Use train.lr_scheduler_type=constant_with_warmup (warm-up, then constant)"),
        (["metric=rollout/reward_mena_last"], "metric='rollout/reward_mena_last' is not a summary.json entry"),
        (
            [
                "reward_model=none",
                "+reward.functions.length.function=_reward_functions.length_reward",
                "metric=rollout/rewards/reward_model/mean_last",
            ],
            "'rollout/rewards/length/mean_last'",
        ),
        (["train.beta=0", "metric=train/kl_to_ref_last"], "metric='train/kl_to_ref_last' is not a summary.json"),
        (["data=arithmetic", "metric=rollout/oracle_mean_last"], "needs an oracle, but data.oracle is null"),
        # Where sampling runs (rollout.backend): refused before any model loads, and before Ray starts.
        (["rollout.mode=async", "rollout.backend=learner"], "rollout.backend=learner with rollout.mode=async"),
        (["rollout.workers=2"], "rollout.workers=2 with rollout.backend=learner: the learner's process is one"),
        (["rollout.workers=0"], "rollout.workers=0"),
        (["rollout.backend=cluster"], "rollout.backend='cluster'"),
        (["rollout.past_lag_bound=drop"], "rollout.past_lag_bound='drop': expected one of .'withhold', 'resample'."),
        (["ray.address=auto"], "ray.address='auto' with rollout.backend=learner: only rollout.backend=ray reads it"),
        (
            ["rollout.backend=processes", "rollout.worker_resources.num_gpus=1"],
            "local worker processes sample on CPU copies of the policy",
        ),
        (["rollout.backend=ray", "rollout.worker_resources.num_cpus=-1"], "rollout.worker_resources.num_cpus=-1"),
        (
            ["train.vllm_importance_sampling_mode=token_clip"],
            "train.vllm_importance_sampling_mode='token_clip' is not one of trl's modes",
        ),
        (
            ["train.vllm_importance_sampling_correction=true", "train.vllm_importance_sampling_clip_min=4.0"],
            "train.vllm_importance_sampling_clip_min=4.0 is not below vllm_importance_sampling_clip_max=3.0",
        ),
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


def test_warm_up_with_a_schedule_that_warms_up_and_a_known_metric_are_accepted(compose_config, tmp_path):
    from recipes.trl_grpo.checks import validate

    overrides = ["train.warmup_steps=2", "train.lr_scheduler_type=constant_with_warmup", "metric=train/loss_last"]
    cfg = validate(compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", *overrides]))
    assert cfg.train["warmup_steps"] == 2 and cfg.metric == "train/loss_last"


def test_a_trainer_folder_outside_the_run_folder_is_refused(compose_config, tmp_path, monkeypatch):
    """Run B given run A's trainer folder would delete and overwrite A's checkpoints (save_total_limit): refused,
    naming the folder and the fix, before anything loads or is written."""
    loads = []
    monkeypatch.setattr(recipe, "load_causal_lm", lambda *args, **kwargs: loads.append(1))
    (tmp_path / "a" / "trainer" / "checkpoint-2").mkdir(parents=True)
    overrides = [f"output_dir={tmp_path / 'b'}", f"train.output_dir={tmp_path / 'a' / 'trainer'}"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, *overrides, "+train.save_total_limit=1"])
    message = rf"train.output_dir='{tmp_path / 'a' / 'trainer'}' is outside this run's folder \({tmp_path / 'b'}\)"
    with pytest.raises(ConfigError, match=message + r".*Drop train.output_dir"):
        recipe.train(cfg)
    assert loads == [] and not (tmp_path / "b").exists() and (tmp_path / "a" / "trainer" / "checkpoint-2").is_dir()


def test_held_out_data_read_by_no_evaluation_is_refused(compose_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Review the mug {i}."}) + "\n" for i in range(8)))
    overrides = ["data=file", f"data.path={data}", f"data.eval_path={data}", "metric=rollout/reward_mean_last"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL_ON_A_FILE, f"output_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError, match=r"data.eval_path='.*prompts.jsonl': held-out data is read only by .*off"):
        recipe.train(cfg)


def test_prompts_too_long_for_the_policy_are_refused_before_any_model_loads(compose_config, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(recipe, "load_causal_lm", lambda *args, **kwargs: loads.append(1))
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Review the mug."}] * 7 + [{"prompt": "Review the mug, " * 80 + "then the kettle."}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = ["data=file", f"data.path={data}", "metric=rollout/reward_mean_last"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL_ON_A_FILE, f"output_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(
        ConfigError,
        match=r"1 of 8 prompts \(rows \[7\]\) are too long for the policy: .* with "
        r"rollout.generation.max_new_tokens=8 the sequence passes the 256 positions",
    ):
        recipe.train(cfg)
    assert loads == []


def test_a_non_finite_reward_stops_the_run_naming_its_source_before_anything_is_saved(compose_config, tmp_path):
    """1e39 is a finite Python float but infinite in trl's float32 rewards: trl would train a zero loss on it and save
    the model."""
    overrides = ["reward_model=none", "+reward.functions.huge.function=_reward_functions.huge_reward"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", *overrides])
    with pytest.raises(RunStopped, match=r"reward function reward.functions.huge returned 1e\+39 for row 0 at step 1"):
        recipe.train(cfg)
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()


def test_a_non_finite_reward_model_score_stops_the_run_naming_the_reward_model(compose_config, tmp_path, monkeypatch):
    load_reward_model = recipe.load_reward_model

    def overflowing(*args, **kwargs):
        model = load_reward_model(*args, **kwargs)
        model.score.weight.data.fill_(float("inf"))
        return model

    monkeypatch.setattr(recipe, "load_reward_model", overflowing)
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}"])
    with pytest.raises(RunStopped, match=r"The reward model \(reward_model.name_or_path='.*reward_model'\) gave 8 "):
        recipe.train(cfg)
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("progress_bar", [True, False])
def test_the_run_prints_its_progress_line_not_trls_raw_dict_of_figures(
    compose_config, tmp_path, capsys, caplog, progress_bar
):
    """``progress_bar`` as the GRPO recipe's: trl's bar of the steps, or none; trl's dict of figures never."""
    overrides = [*SMALL, f"output_dir={tmp_path}", "train.logging_steps=1", f"progress_bar={progress_bar}"]
    with caplog.at_level("INFO"):
        recipe.train(compose_config("trl_grpo_torchrl_rollouts", overrides))
    printed = capsys.readouterr()
    assert "'loss':" not in printed.out + printed.err and "Step 3/3:" in caplog.text
    assert ("3/3 [" in printed.err) is progress_bar  # tqdm's "3/3 [00:01<00:00, ...]"


def test_the_rollout_count_is_what_the_store_holds(compose_config, tmp_path, caplog):
    """A ring of 4 rows keeps the newest 4 of 24: the summary and the closing line count what the store holds."""
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*SMALL, f"output_dir={tmp_path}", "rollout.store.max_rows=4"])
    with caplog.at_level("INFO"):
        summary = recipe.train(cfg)
    assert summary["rollouts/rows"] == 4 == load_rollouts(tmp_path / "rollouts").shape[0]
    assert summary["rollouts/rows_dropped"] == 20
    assert f"4 rollouts in {tmp_path / 'rollouts'} (the 20 oldest dropped" in caplog.text


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
    """By at least 0.6 in 30 steps: 0.87-1.01 over seeds 0-4 (library sampler of 2026-12-03); 0.88-0.98 at 1 torch
    thread, 0.89-1.00 at 2 (2026-12-06, `python scripts/check_learning.py --only trl_default --threads 1 2`)."""
    summary = recipe.train(compose_config("trl_grpo_torchrl_rollouts", [f"output_dir={tmp_path}"]))
    assert summary["train/steps"] == 30
    assert summary["rollout/oracle_mean_last"] - summary["rollout/oracle_mean_first"] >= 0.6, summary


@pytest.mark.slow
def test_resume_after_sigkill_continues_from_trls_checkpoint(compose_config, tmp_path):
    """Killed after its step-2 checkpoint (and step 3's log), the run resumes from it; the stored rollouts keep each
    step once, the resumed part's for the steps it trained again; metrics.csv holds each step once; the summary covers
    the whole run (its first figures are the killed part's) and counts every part's rows."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.max_steps=6", "train.save_strategy=steps", "train.save_steps=2", "logger=csv"]

    def checkpoint_2_and_step_3_done() -> bool:
        metrics = run_dir / "metrics.csv"
        checkpointed = (run_dir / "trainer" / "checkpoint-2").is_dir()
        return checkpointed and metrics.exists() and any(row["step"] == 3.0 for row in read_metrics(run_dir))

    recipe_run = [*overrides, f"hydra.run.dir={run_dir}"]
    # Forked from this process, its imports done (_in_process.ForkedScript): a process of its own for the SIGKILL.
    kill_recipe_run_when("trl_grpo_torchrl_rollouts.py", recipe_run, ready=checkpoint_2_and_step_3_done, forked=True)

    first_part = read_metrics(run_dir)[0]
    summary = recipe.train(
        compose_config("trl_grpo_torchrl_rollouts", [*overrides, f"output_dir={run_dir}", "resume=true"])
    )
    assert summary["train/steps"] == 6
    stored = load_rollouts(run_dir / "rollouts")
    assert sorted(set(stored["step"].tolist())) == [1, 2, 3, 4, 5, 6]
    assert stored.shape[0] == 6 * 8, "each step's completions once"
    assert (run_dir / "rollouts" / "rank_0" / "part_1").is_dir()
    assert [row["step"] for row in read_metrics(run_dir)] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    for name in ("rollout/reward_mean", "rollout/oracle_mean", "train/loss"):
        assert summary[f"{name}_first"] == pytest.approx(first_part[name]), name
    assert summary["rollouts/rows"] == 6 * 8
    assert json.loads((run_dir / "resumes.jsonl").read_text())["step"] == 2


@pytest.mark.slow
def test_two_processes_each_generate_and_store_their_own_rollouts(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` of the recipe, through accelerate's own launcher code in
    this process, its two ranks forked from it (``_processes.accelerate_launch_forked``: a launched run's three new
    Pythons cost 9-11 CPU-s of imports; a real ``accelerate launch`` command line is run by the reward recipe's
    test_two_processes_split_every_step_of_the_single_process_run)."""
    run_dir = tmp_path / "run"
    launch = ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    accelerate_launch_forked(
        *launch, "recipes/trl_grpo_torchrl_rollouts.py", *SMALL, "device=cpu", f"hydra.run.dir={run_dir}"
    )
    stored = load_rollouts(run_dir / "rollouts")
    assert sorted(set(stored["rank"].tolist())) == [0, 1]
    assert stored.shape[0] == 2 * 3 * 8, "3 steps of 8 completions per process"
    for rank in (0, 1):
        mine = stored[stored["rank"] == rank]
        assert sorted(set(mine["step"].tolist())) == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train/steps"] == 3
    assert summary["rollouts/rows"] == 2 * 3 * 8, "every process's rows"


@pytest.mark.slow
def test_weights_pushed_every_second_step_reach_a_bf16_worker_and_every_row_keeps_its_version(compose_config, tmp_path):
    """rollout.weight_sync_every=2 (sync, one local worker, a bfloat16 sampler): the worker samples steps 1-2 with the
    weights of step 0 and steps 3-4 with those of step 2; the stored rows carry that version and the logged lag
    alternates 0, 1 (within rollout.max_policy_lag=1)."""
    overrides = [*TRL_SMALL, "train.max_steps=4", "logger=csv", f"output_dir={tmp_path}"]
    overrides += ["rollout.backend=processes", "rollout.weight_sync_every=2", "rollout.sampler_dtype=bfloat16"]
    summary = recipe.train(compose_config("trl_grpo_torchrl_rollouts", overrides))
    assert summary["train/steps"] == 4
    assert [row["train/policy_lag"] for row in read_metrics(tmp_path)] == [0.0, 1.0, 0.0, 1.0]
    rows = load_rollouts(tmp_path / "rollouts")
    versions = {int(step): sorted(set(rows["policy_version"][rows["step"] == step].tolist())) for step in range(1, 5)}
    assert versions == {1: [0], 2: [0], 3: [2], 4: [2]}
