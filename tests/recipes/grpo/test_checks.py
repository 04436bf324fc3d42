"""recipes/grpo/checks.py and schema.py: a key the recipe does not read, a wrong type or a non-finite number is refused
before anything loads; LoRA turns on from the command line as users type it; a resumed run trains with its own
settings, not the YAML defaults; the config is resolved once."""

from __future__ import annotations

import json
import math

import pytest
from _small_runs import GRPO_SMALL, read_metrics
from omegaconf import OmegaConf

import recipes.grpo.rewards as rewards_module
import recipes.grpo_torchrl_rm as recipe
from recipes.common.config import ConfigError
from recipes.grpo.checks import validate, validated


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+loss.clip_epsilon_hihg=0.28", r"loss.clip_epsilon_hihg: grpo_torchrl_rm has no such setting.*loss.clip_eps"),
        ("+train.gradient_acumulation_steps=2", r"train.gradient_acumulation_steps: grpo_torchrl_rm has no such"),
        ("+rollout.tempreature=0.7", r"rollout.tempreature: .*no such setting"),
        ("+optimizer.momentum=0.9", r"optimizer.momentum: .*no such setting"),
        ("+seeds=1", r"seeds: .*Did you mean seed or samples\?"),
    ],
)
def test_a_key_the_recipe_does_not_read_is_refused_with_the_nearest(
    compose_config, tmp_path, nothing_loads, override, message
):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.alpha=true", r"model.lora.alpha=True: expected a number"),
        ("train.steps=ten", r"train.steps='ten': expected an integer"),
        ("rollout.generation.temperature=nan", r"rollout.generation.temperature=nan: not a finite number"),
        ("rollout.generation.repetition_penalty=nan", r"rollout.generation.repetition_penalty=nan: not a finite"),
        ("loss.kl_to_ref_coeff=nan", r"loss.kl_to_ref_coeff=nan: not a finite number"),
        ("loss.clip_epsilon=inf", r"loss.clip_epsilon=inf: not a finite number"),
        ("optimizer.betas=[1.5,0.9]", r"optimizer.betas\[0\]=1.5 must be >= 0 and < 1"),
        ("optimizer.weight_decay=-1", r"optimizer.weight_decay=-1 must be >= 0"),
        ("seed=-1", r"seed=-1 must be >= 0"),
        ("reward.micro_batch_size=0", r"reward.micro_batch_size=0 must be >= 1"),
        ("rollout.log_prob_micro_batch_size=0", r"rollout.log_prob_micro_batch_size=0 must be >= 1"),
        ("rollout.learner_sampling_threads=0", r"rollout.learner_sampling_threads=0 must be >= 1"),
        ("loss.clip_epsilon=-0.2", r"loss.clip_epsilon=-0.2 must be > 0"),
        ("loss.clip_epsilon=wide", r"loss.clip_epsilon='wide': expected a number"),
    ],
)
def test_a_wrong_type_or_a_non_finite_number_is_refused(compose_config, tmp_path, nothing_loads, override, message):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dtype=float8"], "dtype='float8': expected one of ['float32', 'bfloat16', 'float16']."),
        (["reward.input=logits"], "reward.input='logits': expected one of ['history', 'text', 'tokens']."),
        (["rollout.past_lag_bound=drop"], "rollout.past_lag_bound='drop': expected one of ['withhold', 'resample']."),
        (
            ["rollout.group_size=4", "rollout.responses_per_step=6"],
            "rollout.responses_per_step=6 is not a multiple of rollout.group_size=4: every prompt gets a full group. "
            "Use a multiple, e.g. rollout.responses_per_step=4.",
        ),
        (
            ["loss.sync_ref_model=true", "loss.kl_to_ref_coeff=null"],
            "loss.sync_ref_model=true with no KL term (loss.kl_to_ref_coeff=0 or null): there is no reference to keep "
            "in sync. Set a KL coefficient, or loss.sync_ref_model=false.",
        ),
    ],
)
def test_a_choice_or_a_nodes_own_rule_is_refused_by_the_schema_before_anything_loads(
    compose_config, tmp_path, nothing_loads, overrides, message
):
    """The whole message: the key in full (a node's rule names its node's keys), what was found, the fix."""
    with pytest.raises(ConfigError) as error:
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", *overrides]))
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.entropy_coeff=0.01"], r"train.max_tokens_per_micro_batch=64 with loss.entropy_coeff=0.01 .* Set "),
        (["loss.top_entropy_quantile=0.2"], r"with .*loss.top_entropy_quantile=0.2: the entropy bonus is a token mean"),
        (["distributed.strategy=fsdp"], r"distributed.strategy=fsdp with train.max_tokens_per_micro_batch=64: every"),
    ],
)
def test_token_budget_micro_batches_refuse_what_they_cannot_make_exact(
    compose_config, tmp_path, nothing_loads, overrides, message
):
    with pytest.raises(ConfigError, match=message):
        recipe.train(
            compose_config(
                "grpo_torchrl_rm",
                [*GRPO_SMALL, f"output_dir={tmp_path}", "train.max_tokens_per_micro_batch=64", *overrides],
            )
        )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], None),
        (["model.lora.r=8"], {"enabled": True, "r": 8, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}),
        (["model.lora.enabled=true"], {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0}),
        (["model.lora.r=8", "model.lora.enabled=false"], None),
        (["model.lora={r:4,alpha:8,dropout:0.0,target_modules:[q_proj]}"], {"enabled": True, "r": 4, "alpha": 8}),
        (["model.lora=null"], None),
    ],
)
def test_lora_turns_on_as_users_type_it(compose_config, tmp_path, overrides, expected):
    cfg = validate(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", *overrides]))
    lora = cfg.model.lora
    if expected is None:
        assert lora is None
    else:
        assert {key: getattr(lora, key) for key in expected} == expected


def test_the_config_is_resolved_once(compose_config, tmp_path, monkeypatch):
    """Every later reader (the logged config, the background collector) sees the values of the run's start."""
    monkeypatch.setenv("GRPO_SYSTEM_PROMPT", "Be brief.")
    cfg = compose_config(
        "grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", "rollout.system_prompt=${oc.env:GRPO_SYSTEM_PROMPT}"]
    )
    settled, record = validated(cfg)
    monkeypatch.setenv("GRPO_SYSTEM_PROMPT", "Ramble on.")
    assert settled.rollout.system_prompt == record.rollout.system_prompt == "Be brief."
    assert not OmegaConf.is_interpolation(record, "output_dir") and settled.output_dir == str(tmp_path)


def test_a_resumed_run_keeps_its_own_settings(compose_config, tmp_path):
    """resume=true with the folder alone continues the run as configured (its group size, logger, step count), not
    with the YAML defaults; a setting given on the command line applies on top."""
    run = [*GRPO_SMALL, "train.steps=3", "checkpoint.every_n_steps=1", "logger=csv", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", [*run, "train.steps=2"]))
    assert [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0]

    summary = recipe.train(
        compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}", "train.steps=3"])
    )
    assert summary["train/steps"] == 3
    assert [row["step"] for row in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]  # logger=csv kept
    saved = OmegaConf.load(tmp_path / "resolved_config.yaml")
    assert saved.rollout.group_size == 2 and saved.train.steps == 3 and saved.logger.kind == "csv"
    (resume,) = [json.loads(line) for line in (tmp_path / "resumes.jsonl").read_text().splitlines()]
    assert resume["step"] == 2 and resume["changes"] == {}


def test_a_resume_below_the_checkpoint_or_without_the_run_config_is_refused(compose_config, tmp_path):
    run = [*GRPO_SMALL, "train.steps=2", "checkpoint.every_n_steps=1", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", run))
    with pytest.raises(ConfigError, match=r"train.steps=1 is below the step of the checkpoint to resume \(2"):
        validate(compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}", "train.steps=1"]))
    (tmp_path / "resolved_config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"resolved_config.yaml is missing: the run's settings cannot be restored"):
        validate(compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.target_modules=[q_prj,v_proj]", r"model.lora.target_modules: \['q_prj'\] match no linear layer"),
        ("optimizer._target_=torch.optim.SGD", r"optimizer._target_='torch.optim.SGD': the recipe trains with"),
        ("optimizer.lr=1e39", r"optimizer.lr=1e\+39: an Adam step moves every weight by about lr"),
    ],
)
def test_settings_that_fail_after_loading_are_refused_before(
    compose_config, tmp_path, nothing_loads, override, message
):
    with pytest.raises(ConfigError, match=message):
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))


def test_max_grad_norm_0_means_no_clipping_as_in_trl(compose_config, tmp_path):
    """0 clipped every gradient to nothing (the weights never moved); it now reads as trl reads it: no clipping."""
    from safetensors.torch import load_file

    from recipes.common.config import PROJECT_ROOT

    run = [*GRPO_SMALL, "train.steps=1", "train.max_grad_norm=0", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", run))
    trained = load_file(tmp_path / "checkpoints" / "step_0000001" / "model" / "model.safetensors")
    initial = load_file(PROJECT_ROOT / "tiny" / "policy" / "model.safetensors")
    assert any(not (trained[name] == initial[name]).all() for name in initial)
    assert read_metrics(tmp_path)[0]["train/grad_norm"] > 0  # measured all the same


def test_a_metrics_file_with_a_step_that_is_no_number_is_named_before_loading(compose_config, tmp_path):
    run = [*GRPO_SMALL, "train.steps=1", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", run))
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    (tmp_path / "metrics.csv").write_text("\n".join([lines[0], "one" + lines[1][1:]]) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.csv, line 2: its step 'one' is no number"):
        validate(compose_config("grpo_torchrl_rm", ["resume=true", f"output_dir={tmp_path}", "train.steps=2"]))


def test_a_non_finite_reward_stops_the_run_naming_its_source(compose_config, tmp_path, monkeypatch):
    import torch

    class NaNRewardModel(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.full((input_ids.shape[0], 1), float("nan"))

    monkeypatch.setattr(rewards_module, "load_reward_model", lambda *args, **kwargs: NaNRewardModel())
    run = [*GRPO_SMALL, "train.steps=2", "checkpoint.every_n_steps=1", f"output_dir={tmp_path}"]
    with pytest.raises(ValueError, match=r"the reward model 'NaNRewardModel' gave 4 non-finite reward\(s\)"):
        recipe.train(compose_config("grpo_torchrl_rm", run))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_warm_up_with_a_schedule_that_ignores_it_is_refused(compose_config, tmp_path, nothing_loads):
    """train.warmup_steps with the constant schedule (GRPO_SMALL's) warmed nothing up (trl's default is linear)."""
    overrides = [*GRPO_SMALL, f"output_dir={tmp_path}", "train.warmup_steps=5"]
    with pytest.raises(ConfigError) as error:
        recipe.train(compose_config("grpo_torchrl_rm", overrides))
    message = str(error.value)
    assert message.startswith("train.warmup_steps=5 with train.lr_scheduler=constant: that schedule has no warm-up")
    assert "constant_with_warmup, linear, cosine" in message and "train.warmup_steps=0" in message
    for schedule in ("constant_with_warmup", "linear", "cosine"):
        cfg = validate(
            compose_config(
                "grpo_torchrl_rm",
                [*GRPO_SMALL, f"output_dir={tmp_path}", "train.warmup_steps=5", f"train.lr_scheduler={schedule}"],
            )
        )
        assert cfg.train.warmup_steps == 5


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        (
            "+loss.beta=0.1",
            "loss.beta",
            "trl.GRPOConfig's beta is loss.kl_to_ref_coeff here: set loss.kl_to_ref_coeff=0.1.",
        ),
        ("+beta=0.04", "beta", "set loss.kl_to_ref_coeff=0.04."),
        ("+rollout.num_generations=4", "rollout.num_generations", "set rollout.group_size=4."),
        ("+loss.epsilon=0.3", "loss.epsilon", "set loss.clip_epsilon=0.3."),
        ("+loss.epsilon_high=0.28", "loss.epsilon_high", "set loss.clip_epsilon_high=0.28."),
        ("+loss.loss_type=grpo", "loss.loss_type", "set loss.type=grpo."),
        ("+scale_rewards=batch", "scale_rewards", "set advantage.scale_rewards=batch."),
        ("+max_completion_length=64", "max_completion_length", "set rollout.generation.max_new_tokens=64."),
        ("+train.learning_rate=1e-5", "train.learning_rate", "set optimizer.lr=1e-05."),
        ("+train.num_iterations=2", "train.num_iterations", "set train.epochs_per_step=2."),
        (
            "+train.steps_per_generation=4",
            "train.steps_per_generation",
            "mini-batches per generation = rollout.responses_per_step / train.mini_batch_size",
        ),
        ("+rollout.temperature=0.7", "rollout.temperature", "set rollout.generation.temperature=0.7."),
        ("+rollout.top_k=0", "rollout.top_k", "set rollout.generation.top_k=0."),
        ("+reward.reward_weights=[1.0,0.5]", "reward.reward_weights", "reward.functions.<name>.weight"),
    ],
)
def test_a_trl_name_is_refused_naming_this_recipes_key(compose_config, tmp_path, nothing_loads, override, key, fix):
    """trl's GRPOConfig names point at the key that does what trl's does, not at the nearest spelling (beta was
    answered with loss.delta)."""
    with pytest.raises(ConfigError) as error:
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))
    message = str(error.value)
    assert message.startswith(f"{key}: grpo_torchrl_rm has no such setting, so it would be ignored.")
    assert fix in message and "loss.delta" not in message


def test_every_trl_name_is_a_grpo_config_field_and_names_a_key_of_this_recipe(compose_config):
    import dataclasses
    import re

    from trl import GRPOConfig

    from recipes.grpo.schema import TRL_NAMES

    cfg = compose_config("grpo_torchrl_rm")
    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    assert set(TRL_NAMES.names) <= fields
    for name, target in TRL_NAMES.names.items():
        key = re.match(r"[\w.]+", target.replace("<name>", "x")).group(0)
        if not key.startswith("reward.functions"):
            assert OmegaConf.select(cfg, key, default="missing") != "missing", (name, key)


@pytest.mark.parametrize("quantile", [0, 0.0, 0.2, 1.0])
def test_top_entropy_quantile_takes_trls_range(compose_config, tmp_path, quantile):
    """trl's range is [0, 1]: 0 keeps the highest-entropy token(s) of the mini-batch alone (the loss is compared with
    trl's in test_loss_parity.py)."""
    override = f"loss.top_entropy_quantile={quantile}"
    cfg = validate(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", override]))
    assert cfg.loss.top_entropy_quantile == quantile
    with pytest.raises(ConfigError, match=r"loss.top_entropy_quantile=-0.1 must be >= 0 and <= 1"):
        validate(
            compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", "loss.top_entropy_quantile=-0.1"])
        )


def test_every_sampler_setting_has_its_yaml_default_and_the_default_run_samples_as_before(compose_config, tmp_path):
    """interop.SamplingSettings' fields are all in rollout.generation (overridable without +), the ones that were
    not there at their off values: the default run samples with the settings it always had."""
    from interop.sampling import SamplingSettings
    from recipes.grpo.collector import sampler_settings
    from recipes.grpo.evaluation import eval_generation

    cfg = validate(compose_config("grpo_torchrl_rm", [f"output_dir={tmp_path}"]))
    assert set(cfg.rollout.generation) == set(SamplingSettings.names()) == set(cfg.eval.generation)
    before = SamplingSettings(max_new_tokens=32, temperature=1.0, top_k=50, top_p=1.0, do_sample=True)
    assert sampler_settings(cfg.rollout.generation) == before
    assert sampler_settings(eval_generation(cfg), key="eval.generation") == before
    greedy = validate(
        compose_config(
            "grpo_torchrl_rm",
            [f"output_dir={tmp_path}", "rollout.generation.min_p=0.05", "eval.generation.do_sample=false"],
        )
    )
    assert greedy.rollout.generation["min_p"] == greedy.eval.generation["min_p"] == 0.05  # eval follows the rollout's
    assert greedy.eval.generation["do_sample"] is False and greedy.rollout.generation["do_sample"] is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["eval.every_n_steps=2", "eval.generation.temperature=0"],
            "eval.generation.temperature=0 must be > 0 when sampling. Set eval.generation.temperature > 0, or "
            "eval.generation.do_sample=false for greedy decoding.",
        ),
        (["eval.every_n_steps=2", "eval.generation.top_p=0"], "eval.generation.top_p=0 must be in (0, 1]."),
        (["rollout.generation.repetition_penalty=0"], "rollout.generation.repetition_penalty=0 must be > 0."),
        (["rollout.generation.min_p=2"], "rollout.generation.min_p=2 must be in [0, 1]."),
        (
            ["rollout.generation.min_new_tokens=9"],
            "rollout.generation.min_new_tokens=9 must be in [0, max_new_tokens] = [0, 8].",
        ),
    ],
)
def test_a_bad_sampling_value_is_refused_before_anything_loads_naming_the_key(
    compose_config, tmp_path, nothing_loads, overrides, message
):
    with pytest.raises(ConfigError) as error:
        recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", *overrides]))
    assert str(error.value) == message


# The GRPOConfig fields experiment=trl_defaults sets (all it covers have a key here: recipes.grpo.schema.TRL_NAMES).
TRL_DEFAULTS = [
    "beta",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "delta",
    "importance_sampling_level",
    "use_bias_correction_kl",
    "entropy_coef",
    "top_entropy_quantile",
    "mask_truncated_completions",
    "off_policy_mask_threshold",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "scale_rewards",
    "multi_objective_aggregation",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "learning_rate",
    "weight_decay",
    "num_iterations",
    "gradient_accumulation_steps",
    "lr_scheduler_type",
    "warmup_steps",
    "max_grad_norm",
    "gradient_checkpointing",
]


def test_the_trl_defaults_experiment_is_grpo_configs_defaults_read_from_trl(compose_config, tmp_path, monkeypatch):
    """experiment=trl_defaults: trl's GRPOConfig defaults under this recipe's keys (beta 0, top_k 0, the linear
    schedule, dapo, epsilon 0.2, 8 generations...), read from the installed trl: a changed trl default follows."""
    import dataclasses

    from trl import GRPOConfig

    from recipes.grpo.schema import TRL_NAMES

    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    # The preset as the YAML writes it (the run's record: clip_epsilon_high null, trl's None), then as the run reads it.
    cfg, record = validated(compose_config("grpo_torchrl_rm", ["experiment=trl_defaults", f"output_dir={tmp_path}"]))
    for name in TRL_DEFAULTS:
        default = fields[name].default
        assert OmegaConf.select(record, TRL_NAMES.names[name]) == getattr(default, "value", default), name
    assert list(cfg.optimizer.betas) == [fields["adam_beta1"].default, fields["adam_beta2"].default]
    assert cfg.eval.group_size == fields["num_generations"].default  # num_generations_eval null
    assert (cfg.loss.kl_to_ref_coeff, cfg.rollout.generation["top_k"], cfg.train.lr_scheduler) == (0.0, 0, "linear")
    assert (cfg.loss.type, cfg.loss.clip_epsilon, cfg.rollout.group_size) == ("dapo", 0.2, 8)
    assert (cfg.advantage.scale_rewards, cfg.train.epochs_per_step, cfg.rollout.generation["temperature"]) == (
        "group",
        1,
        1.0,
    )

    monkeypatch.setattr(fields["beta"], "default", 0.04)
    cfg = validate(compose_config("grpo_torchrl_rm", ["experiment=trl_defaults", f"output_dir={tmp_path}"]))
    assert cfg.loss.kl_to_ref_coeff == 0.04


def test_the_trl_defaults_experiment_trains(compose_config, tmp_path):
    """It trains as trl's defaults say: trl's learning rate on its decaying (linear) schedule, where this recipe's own
    default is cosine; no reference model (beta 0); gradients finite and nonzero."""
    from trl import GRPOConfig

    small = [override for override in GRPO_SMALL if not override.startswith("train.lr_scheduler=")]  # trl's, here
    overrides = ["experiment=trl_defaults", *small, "train.steps=2", "logger=csv", f"output_dir={tmp_path}"]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    assert summary["train/steps"] == 2 and "train/kl_to_ref_last" not in summary  # beta 0: no reference
    rows = read_metrics(tmp_path)
    first, last = rows[0]["train/lr"], rows[1]["train/lr"]
    assert GRPOConfig.learning_rate >= first > last > 0, "trl's rate, decaying (the recipe's constant would not)"
    assert all(math.isfinite(row["train/grad_norm"]) and row["train/grad_norm"] > 0 for row in rows)
