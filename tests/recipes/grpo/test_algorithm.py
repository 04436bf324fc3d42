"""The GRPO recipe's algorithm settings end to end: what cannot combine is refused with the reason, dynamic sampling
trains on informative groups only, TR-DPO moves the reference (and the checkpoint keeps it), the learning-rate
schedule and gradient accumulation resume as they would have run, and truncated responses are counted and masked."""

from __future__ import annotations

import pytest
import torch
from _small_runs import GRPO_SMALL, read_metrics

import recipes.grpo.rewards as rewards_module
import recipes.grpo_torchrl_rm as recipe
from recipes.common.config import ConfigError, RunStopped
from recipes.grpo import learner as learner_module
from recipes.grpo.batch import ADVANTAGE, REWARD

SMALL = [*GRPO_SMALL, "logger=csv"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["+loss.aggregation=token_mean"],
            r"loss.aggregation is gone .*use loss.type \(aggregation=token_mean is .*bnpo",
        ),
        (["loss.type=ppo"], r"loss.type='ppo': expected one of \['grpo', 'bnpo', 'dr_grpo', 'dapo'"),
        (["loss.importance_sampling_level=prompt"], r"loss.importance_sampling_level='prompt': expected one of"),
        (["loss.clip_epsilon=[0.2,0.28,0.3]"], r"loss.clip_epsilon=\[0.2, 0.28, 0.3\]: a list is TorchRL's"),
        (["loss.clip_epsilon=[0.2,0.28]", "loss.clip_epsilon_high=0.3"], r"a list is TorchRL's \(low, high\) pair"),
        (["loss.sync_ref_model=true", "loss.kl_to_ref_coeff=0"], r"loss.sync_ref_model=true with no KL term"),
        (["loss.sync_ref_model=true", "model.lora.r=4"], r"loss.sync_ref_model=true with model.lora: the reference"),
        (["advantage.filter_zero_std_groups=true", "rollout.mode=async"], r"filter_zero_std_groups=true with .*async"),
        (["advantage.scale_rewards=max"], r"advantage.scale_rewards='max': expected one of \['group', 'batch', 'none'"),
        (["train.gradient_accumulation_steps=3"], r"train.gradient_accumulation_steps=3 does not divide the 2 mini"),
        (["train.lr_scheduler=warmup_stable_decay"], r"train.lr_scheduler='warmup_stable_decay': expected one of"),
        (["train.warmup_steps=1.5"], r"train.warmup_steps=1.5: a fraction of the optimizer steps must be below 1"),
        (["loss.top_entropy_quantile=1.5"], r"loss.top_entropy_quantile=1.5 must be >= 0 and <= 1"),
        (["loss.delta=0.9"], r"loss.delta=0.9 must be > 1"),
    ],
)
def test_what_cannot_work_is_refused_before_anything_loads(compose_config, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        recipe.validate(compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", *overrides]))


def test_a_clip_epsilon_list_is_the_low_and_high_pair(compose_config, tmp_path):
    cfg = recipe.validate(
        compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", "loss.clip_epsilon=[0.2,0.28]"])
    )
    assert (cfg.loss.clip_epsilon, cfg.loss.clip_epsilon_high) == (
        0.2,
        0.28,
    )  # the typed loss node, as the loss reads it


def test_dynamic_sampling_trains_on_informative_groups_only(compose_config, tmp_path, monkeypatch):
    """Every trained batch holds groups whose rewards differ, as many responses as a step takes; the dropped groups
    and the extra batches are logged."""
    trained = []
    optimize = learner_module.optimize

    def recording(cfg, learner, batch):
        trained.append(batch.clone())
        return optimize(cfg, learner, batch)

    monkeypatch.setattr(recipe, "optimize", recording)
    # One-token responses: the untrained reward base scores a group's two alike often enough for some groups to tie on
    # any seed (seeds 0-3 checked), and extra batches are allowed until each step has 2 informative groups.
    overrides = [
        "train.steps=3",
        "rollout.generation.max_new_tokens=1",
        "advantage.filter_zero_std_groups=true",
        "advantage.max_extra_batches=12",
    ]
    recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, *overrides, f"output_dir={tmp_path}"]))
    for batch in trained:
        rewards = batch.get(REWARD).reshape(-1, 2)
        assert batch.shape[0] == 4 and (rewards.max(-1).values != rewards.min(-1).values).all()
        assert (batch.get(ADVANTAGE).abs() > 0).all()
    rows = read_metrics(tmp_path)
    assert sum(row["rollout/groups_filtered"] for row in rows) > 0  # the case under test: some groups tied
    for row in rows:  # a batch is drawn again only when groups were dropped
        assert row["rollout/extra_batches"] == 0 or row["rollout/groups_filtered"] > 0


def test_dynamic_sampling_on_a_reward_that_ties_everything_stops_clearly(compose_config, tmp_path, monkeypatch):
    class ConstantRewardModel(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.full((input_ids.shape[0], 1), 1.0)

    monkeypatch.setattr(rewards_module, "load_reward_model", lambda *args, **kwargs: ConstantRewardModel())
    overrides = ["train.steps=2", "advantage.filter_zero_std_groups=true", "advantage.max_extra_batches=2"]
    with pytest.raises(
        RunStopped, match=r"after 3 batches, only 0 of 4 responses came from groups whose rewards differ"
    ):
        recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, *overrides, f"output_dir={tmp_path}"]))


def test_sync_ref_model_moves_the_reference_and_the_checkpoint_keeps_it(compose_config, tmp_path):
    from safetensors.torch import load_file

    from recipes.common.config import PROJECT_ROOT

    overrides = [
        "train.steps=2",
        "loss.sync_ref_model=true",
        "loss.ref_model_sync_steps=1",
        "checkpoint.every_n_steps=1",
    ]
    recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, *overrides, f"output_dir={tmp_path}"]))
    initial = load_file(PROJECT_ROOT / "tiny" / "policy" / "model.safetensors")
    step = tmp_path / "checkpoints" / "step_0000002"
    reference = load_file(step / "reference_model" / "model.safetensors")
    policy = load_file(step / "model" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    # ref = 0.6 policy + 0.4 ref after each of the 2 optimizer steps per step: between the two, off both.
    assert not torch.equal(reference[name], initial[name]) and not torch.equal(reference[name], policy[name])
    resumed = recipe.train(
        compose_config(
            "grpo_torchrl_rm", [*SMALL, *overrides, f"output_dir={tmp_path}", "resume=true", "train.steps=3"]
        )
    )
    assert resumed["train/steps"] == 3


def test_a_schedule_and_accumulation_resume_as_the_run_would_have_gone(compose_config, tmp_path):
    """4 steps straight, and 2 + 2 with a resume: the same learning rates, losses and weights."""
    settings = [
        "train.lr_scheduler=cosine",
        "train.warmup_steps=0.25",
        "train.gradient_accumulation_steps=2",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=null",
    ]
    straight = [*SMALL, *settings, "train.steps=4", f"output_dir={tmp_path / 'straight'}"]
    recipe.train(compose_config("grpo_torchrl_rm", straight))
    first = [*SMALL, *settings, "train.steps=2", f"output_dir={tmp_path / 'resumed'}"]
    recipe.train(compose_config("grpo_torchrl_rm", first))
    second = ["resume=true", "train.steps=4", f"output_dir={tmp_path / 'resumed'}"]
    recipe.train(compose_config("grpo_torchrl_rm", second))
    straight_rows, resumed_rows = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [row["train/lr"] for row in resumed_rows] == pytest.approx([row["train/lr"] for row in straight_rows])
    assert len({row["train/lr"] for row in straight_rows}) > 2  # warming up, then decaying
    for key in ("train/loss", "rollout/reward_mean", "train/kl_to_ref"):
        assert [row[key] for row in resumed_rows] == pytest.approx([row[key] for row in straight_rows], rel=1e-4)


def test_truncated_responses_are_counted_and_masked_with_a_warning_when_all_are(compose_config, tmp_path, caplog):
    overrides = ["train.steps=1", "loss.mask_truncated_completions=true", "rollout.generation.min_new_tokens=8"]
    with caplog.at_level("WARNING"):
        recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, *overrides, f"output_dir={tmp_path}"]))
    (row,) = read_metrics(tmp_path)
    assert row["rollout/frac_truncated"] == 1.0
    assert (
        "every response hit rollout.generation.max_new_tokens=8, and loss.mask_truncated_completions=true"
        in caplog.text
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        # dapo, the default loss type: its run is the default run, which test_the_default_run_ends_stable
        # (tests/recipes/test_grpo_torchrl_rm.py) trains and holds to this margin (one run for both).
        *([f"loss.type={loss_type}"] for loss_type in ("grpo", "dr_grpo", "sapo", "luspo", "vespo")),
        ["loss.type=cispo", "loss.clip_epsilon_high=1.28"],  # cispo clamps the ratio itself at this bound
        ["loss.type=grpo", "loss.importance_sampling_level=sequence"],  # GSPO
        ["loss.clip_epsilon_high=0.28"],  # DAPO's clip-higher
        ["advantage.filter_zero_std_groups=true"],
    ],
    ids=lambda overrides: " ".join(overrides),
)
def test_every_loss_type_learns_the_default_task(compose_config, tmp_path, overrides):
    """The default task and step count: the (well-formed) oracle of the sampled reviews rises by at least 0.4, a
    margin that holds on any seed: over seeds 0-4 of every variant here the smallest rise was 0.73 (luspo, seed 4; the
    rises 0.73-1.04, vespo's 0.79-0.98), with the cosine schedule, 1 torch thread, 2026-12-06
    (`python scripts/check_learning.py`); at 2 threads 0.69 (gspo, seed 4; the rises 0.69-1.01, `--threads 2`)."""
    summary = recipe.train(
        compose_config("grpo_torchrl_rm", [*overrides, "progress_bar=false", f"output_dir={tmp_path}"])
    )
    assert summary["rollout/oracle_mean_last"] - summary["rollout/oracle_mean_first"] >= 0.4


def _oracle_rise(compose_config, run_dir, loss_type: str, seed: int) -> float:
    overrides = [f"loss.type={loss_type}", f"seed={seed}", "progress_bar=false", f"output_dir={run_dir}"]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    return summary["rollout/oracle_mean_last"] - summary["rollout/oracle_mean_first"]


@pytest.mark.slow
def test_bnpo_learns_the_default_task(compose_config, tmp_path):
    """CI's one seed of bnpo, the slowest loss type to learn here: the oracle rises by at least 0.3, below the
    smallest rise over seeds 0-4 (0.37 on seed 0; 0.82-1.02 on seeds 1-4; cosine schedule, 1 torch thread; at 2
    threads 0.56 on seed 0, 0.81-1.05 on seeds 1-4; 2026-12-06, `python scripts/check_learning.py --only
    grpo_loss_bnpo`). The mean over two seeds against the other
    loss types' 0.4 is the test below (`pytest -m seeds`)."""
    rise = _oracle_rise(compose_config, tmp_path, "bnpo", seed=0)
    assert rise >= 0.3, rise


@pytest.mark.seeds
@pytest.mark.parametrize("loss_type", ["bnpo", "vespo"])
def test_loss_types_slower_on_some_seeds_learn_the_default_task_on_average_over_two_seeds(
    compose_config, tmp_path, loss_type
):
    """bnpo and vespo learn the default task more slowly on some seeds and machines, so one seed is no margin for
    them: the mean rise over seeds 0 and 1 is at least 0.4. bnpo rose 0.37 on seed 0 and 0.82-1.02 on seeds 1-4 (mean
    over 0 and 1: 0.70; 2 threads: 0.56, 0.81-1.05, mean 0.81); vespo 0.79-0.98 on seeds 0-4 (cosine schedule,
    1 thread; 2 threads: 0.80-1.00, 2026-12-06,
    `python scripts/check_learning.py --only grpo_loss_bnpo grpo_loss_vespo`). At the constant schedule of before,
    vespo rose 0.25 on seed 0 at 1 thread on two machines of this kind (issue 39). Two runs each: out of CI (which runs
    one seed of each, above), `pytest -m seeds` (README)."""
    rises = [_oracle_rise(compose_config, tmp_path / str(seed), loss_type, seed) for seed in (0, 1)]
    assert sum(rises) / len(rises) >= 0.4, rises


def test_a_steps_buffer_hands_out_the_mini_batches_a_lazy_stack_storage_did():
    """The step's buffer indexes the dense batch where it lies; the mini-batches are the rows, in the order, that
    TorchRL's LazyStackStorage (one TensorDict per row) gave for the same seed: the runs train on what they did."""
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    rows = 8
    batch = TensorDict(
        {
            "tokens": {"full": torch.arange(rows * 5).reshape(rows, 5)},
            "masks": {"all_attention_mask": torch.rand(rows, 5) > 0.3},
            "advantage": torch.randn(rows, 1, 1),
        },
        batch_size=[rows],
    )
    cfg = OmegaConf.create({"train": {"mini_batch_size": 2}})
    buffer = learner_module.make_replay_buffer(cfg, batch)
    lazy = ReplayBuffer(
        storage=LazyStackStorage(rows), sampler=SamplerWithoutReplacement(), batch_size=2, generator=torch.Generator()
    )
    lazy.extend(batch)
    for seed in (0, 1):
        buffer.set_rng(torch.Generator().manual_seed(seed))
        lazy.set_rng(torch.Generator().manual_seed(seed))
        drawn = [buffer.sample().contiguous() for _ in range(rows // 2)]
        expected = [lazy.sample().contiguous() for _ in range(rows // 2)]
        for got, want in zip(drawn, expected, strict=True):
            assert set(got.keys(True, True)) == set(want.keys(True, True))
            assert all(torch.equal(got[key], want[key]) for key in want.keys(True, True))
        firsts = sorted(int(row) // 5 for part in drawn for row in part["tokens", "full"][:, 0])
        assert firsts == list(range(rows))  # each row once per pass
