"""The trl-rollouts recipe's rollout.mode=async (TorchRL samples the next generation batch in a child process while
trl updates) and rollout.replay (groups whose rewards tie train on stored groups): a run logs the policy lag and the
replay's share, an async run killed after a checkpoint resumes and trains each step on the prompts an unkilled run
trains on, and a replay source that is foreign, empty or damaged is refused before any model loads."""

from __future__ import annotations

import json

import pytest
import torch
from _processes import kill_recipe_run_when
from _small_runs import TRL_SMALL, read_metrics

import recipes.trl_grpo_torchrl_rollouts as recipe
from recipes.common.config import ConfigError
from recipes.trl_grpo.checks import validate
from recipes.trl_grpo.rollout_store import RolloutStore, load_rollouts, texts


def _train(compose_config, *overrides):
    return recipe.train(compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, *overrides]))


def test_an_async_run_trains_each_batch_one_update_behind_and_logs_it(compose_config, tmp_path, monkeypatch):
    """Each batch after the first trains one update behind; metrics.csv and wandb (logger=wandb writes both) get the
    lag, wandb each logged step's train/policy_lag_histogram of every batch so far, with nothing dropped."""
    import wandb
    from _wandb_run import StrictRun

    run = StrictRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    summary = _train(
        compose_config, "rollout.mode=async", "train.max_steps=4", "logger=wandb", f"output_dir={tmp_path}"
    )
    rows = read_metrics(tmp_path)
    assert summary["train/steps"] == 4
    assert [row["train/policy_lag"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert run.dropped == []
    lags = [run.history[step]["train/policy_lag"] for step in (1, 2, 3, 4)]
    assert lags == [0.0, 1.0, 1.0, 1.0]
    for step in (1, 2, 3, 4):
        histogram = run.history[step]["train/policy_lag_histogram"]
        assert sum(histogram.histogram) == step
        assert histogram.bins[0] <= min(lags[:step]) and histogram.bins[-1] >= max(lags[:step])
    assert all(row["rollout/lookahead_misses"] == 0.0 and row["rollout/resampled"] == 0.0 for row in rows)
    stored = load_rollouts(tmp_path / "rollouts")
    assert stored.shape[0] == 4 * 8 and sorted(set(stored["step"].tolist())) == [1, 2, 3, 4]


@pytest.mark.parametrize("past_lag_bound", ["withhold", "resample"])
def test_past_the_lag_bound_a_batch_is_withheld_or_sampled_again_as_set(compose_config, tmp_path, past_lag_bound):
    """rollout.max_policy_lag=0: a batch read ahead would train one update old. withhold: it is sampled only when trl
    asks for it (rollout/withheld, and trl's wait in rollout/withheld_s); resample: sampled ahead, then again
    (rollout/resampled). Every batch trains at lag 0 either way."""
    overrides = ["rollout.mode=async", "rollout.max_policy_lag=0", f"rollout.past_lag_bound={past_lag_bound}"]
    _train(compose_config, *overrides, f"output_dir={tmp_path}")
    rows = read_metrics(tmp_path)
    assert [row["train/policy_lag"] for row in rows] == [0.0, 0.0, 0.0]
    counted, other = ("withheld", "resampled") if past_lag_bound == "withhold" else ("resampled", "withheld")
    assert [row[f"rollout/{counted}"] for row in rows] == [0.0, 1.0, 1.0]
    assert [row[f"rollout/{other}"] for row in rows] == [0.0, 0.0, 0.0]
    waited = [row["rollout/withheld_s"] > 0 for row in rows]
    assert waited == ([False, True, True] if past_lag_bound == "withhold" else [False, False, False])


@pytest.mark.slow  # two runs, about 12 s on 2 busy cores
def test_a_zero_lag_async_run_trains_as_the_sync_run_on_the_same_prompts(compose_config, tmp_path):
    """rollout.max_policy_lag=0: every batch read ahead would be one update old when trl asks for it, so it is
    withheld (the default rollout.past_lag_bound) and sampled then, by the sampling process with trl's current weights,
    as a sync run with rollout.backend=processes samples each batch (same seed): the same rewards, lengths, losses and
    gradient norms step for step (float tolerance: trl's old log-probs are the sampler's in async mode, the trained
    weights' in sync). The sync run reads its prompts unshuffled as async mode does (train.shuffle_dataset=false: the
    TorchRL stream shuffles them once; trl's own shuffle on top of it is the one difference left)."""
    runs = {}
    for mode, extra in (("sync", ["+train.shuffle_dataset=false", "rollout.backend=processes"]), ("async", [])):
        _train(
            compose_config, f"rollout.mode={mode}", "rollout.max_policy_lag=0", f"output_dir={tmp_path / mode}", *extra
        )
        runs[mode] = read_metrics(tmp_path / mode)
    assert [row["rollout/withheld"] for row in runs["async"]] == [0.0, 1.0, 1.0]
    for sync, async_ in zip(runs["sync"], runs["async"], strict=True):
        for key in ("rollout/reward_mean", "rollout/response_length", "train/grad_norm"):
            assert async_[key] == pytest.approx(sync[key], rel=1e-5), key
        assert async_["train/loss"] == pytest.approx(sync["train/loss"], abs=1e-6)


def test_async_refuses_what_would_make_the_next_prompts_unknowable(compose_config, tmp_path):
    with pytest.raises(ConfigError, match="train.shuffle_dataset=true with rollout.mode=async"):
        _train(compose_config, "rollout.mode=async", "+train.shuffle_dataset=true", f"output_dir={tmp_path}")


def test_replay_trains_stored_groups_in_the_places_of_tied_ones_and_logs_their_share(compose_config, tmp_path):
    """A reward under which each batch's first group ties and the second does not: from the second step on, the tied
    group's place holds a stored group (half of the batch)."""
    overrides = [
        "reward_model=none",
        "+reward.functions.ties.function=_reward_functions.first_group_ties",
        "rollout.replay.enabled=true",
        "train.max_steps=4",
        f"output_dir={tmp_path}",
    ]
    _train(compose_config, *overrides)
    rows = read_metrics(tmp_path)
    assert [row["rollout/frac_reward_zero_std"] for row in rows] == [0.5] * 4
    assert [row["rollout/replayed_share"] for row in rows] == [0.0, 0.5, 0.5, 0.5], "nothing stored before step 1"
    assert all(row["rollout/replayed_age"] >= 1.0 for row in rows[1:])


def _stored_folder(
    folder, *, fingerprint, group_size=4, groups_per_step=1, steps=1, max_rows=16, recorded_group_size=None
):
    """A rollouts folder of ``steps`` batches of ``groups_per_step`` groups of ``group_size`` rows (each group its own
    prompt), in a ring of ``max_rows``; ``recorded_group_size``: the num_generations its progress.json records."""
    from tensordict import TensorDict

    store = RolloutStore(
        folder,
        rank=0,
        max_rows=max_rows,
        prompt_width=4,
        completion_width=4,
        source_names=["exact"],
        max_text_bytes=32,
        pad_token_id=0,
        tokenizer=fingerprint,
        **({} if recorded_group_size is None else {"group_size": recorded_group_size}),
    )
    rows = group_size * groups_per_step
    prompt_ids = torch.arange(1, groups_per_step + 1).repeat_interleave(group_size)[:, None].expand(rows, 4)
    rollout = {
        "prompt_ids": prompt_ids.clone(),
        "prompt_length": torch.full((rows,), 4),
        "completion_ids": torch.ones(rows, 2, dtype=torch.long),
        "completion_length": torch.full((rows,), 2),
        "logprobs": -torch.ones(rows, 2),
        "truncated": torch.zeros(rows, dtype=torch.bool),
    }
    reward = torch.tensor([0.0, 1.0]).repeat(rows // 2)
    for step in range(1, steps + 1):
        store.write(
            TensorDict(rollout, batch_size=[rows]),
            prompt_texts=["p"] * rows,
            completion_texts=["c"] * rows,
            rewards=reward[:, None],
            reward=reward,
            advantages=torch.zeros(rows),
            step=step,
        )


def _policy_fingerprint(compose_config):
    from recipes.common.models import load_tokenizer, tokenizer_fingerprint

    cfg = compose_config("trl_grpo_torchrl_rollouts", TRL_SMALL)
    return tokenizer_fingerprint(load_tokenizer(cfg.model, padding_side="left"))


@pytest.mark.parametrize("case", ["empty", "damaged", "foreign"])
def test_a_replay_source_that_cannot_be_trusted_is_refused_before_any_model_loads(
    compose_config, tmp_path, monkeypatch, case
):
    source = tmp_path / "source" / "rollouts"
    if case == "empty":
        source.mkdir(parents=True)
        message = "holds no stored rollouts"
    elif case == "damaged":
        _stored_folder(source, fingerprint=None)
        (source / "rank_0" / "part_0" / "progress.json").write_text("{not json")
        message = "progress.json is damaged"
    else:
        _stored_folder(source, fingerprint={"vocab_size": 7})
        message = "was written with another tokenizer"
    monkeypatch.setattr(recipe, "load_causal_lm", pytest.fail)
    overrides = ["rollout.replay.enabled=true", f"rollout.replay.load_from={source}", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=rf"rollout.replay.load_from=.*{message}"):
        _train(compose_config, *overrides)


@pytest.mark.parametrize(
    ("stored", "num_generations", "runs"),
    [
        ({"group_size": 4, "groups_per_step": 2}, 8, r"\[4\]"),  # another group size
        ({"group_size": 4, "groups_per_step": 4, "max_rows": 14}, 4, r"\[2, 4\]"),  # a ring cut a group
    ],
)
def test_a_replay_source_not_in_whole_groups_is_refused_naming_the_runs_found(
    compose_config, tmp_path, stored, num_generations, runs
):
    """Read in blocks of rollout.group_size, such a source's groups all straddle two prompts: none would load."""
    source = tmp_path / "source" / "rollouts"
    _stored_folder(source, fingerprint=_policy_fingerprint(compose_config), **stored)
    replay = ["rollout.replay.enabled=true", f"rollout.replay.load_from={source}", f"output_dir={tmp_path / 'run'}"]
    refusal = rf"load_from=.* groups of rollout.group_size={num_generations}: they hold runs of {runs}"
    other_group_size = [*TRL_SMALL, *replay, f"rollout.group_size={num_generations}"]
    with pytest.raises(ConfigError, match=refusal):
        validate(compose_config("trl_grpo_torchrl_rollouts", other_group_size))
    if "max_rows" not in stored:
        validate(compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, *replay]))  # its groups of 4 load


def test_a_replay_source_of_larger_groups_is_refused_naming_both_group_sizes(compose_config, tmp_path):
    """Groups of 8 split evenly in blocks of 4, so the stored runs alone cannot tell: the store records its group size,
    and a run that samples another one is refused rather than loading each group as two halves."""
    source = tmp_path / "source" / "rollouts"
    fingerprint = _policy_fingerprint(compose_config)
    _stored_folder(source, fingerprint=fingerprint, group_size=8, recorded_group_size=8)
    replay = ["rollout.replay.enabled=true", f"rollout.replay.load_from={source}", f"output_dir={tmp_path / 'run'}"]
    refusal = r"holds groups of 8 completions per prompt .* rollout.group_size=4.* Set rollout.group_size=8"
    with pytest.raises(ConfigError, match=refusal):
        validate(compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, *replay]))
    validate(compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, *replay, "rollout.group_size=8"]))


def test_overwrite_refuses_to_delete_the_rollouts_its_replay_loads(compose_config, tmp_path, monkeypatch):
    """overwrite=true in the folder whose rollouts/ the replay loads would delete them, then find its source empty."""
    run = tmp_path / "run"
    _stored_folder(run / "rollouts", fingerprint=_policy_fingerprint(compose_config))
    (run / "summary.json").write_text("{}")
    monkeypatch.setattr(recipe, "load_causal_lm", pytest.fail)
    overrides = ["overwrite=true", "rollout.replay.enabled=true", f"rollout.replay.load_from={run / 'rollouts'}"]
    refusal = rf"overwrite=true would delete {run}/rollouts, which rollout.replay.load_from"
    with pytest.raises(ConfigError, match=refusal):
        _train(compose_config, *overrides, f"output_dir={run}")
    assert load_rollouts(run / "rollouts").shape[0] == 4 and (run / "summary.json").is_file()


def test_groups_stored_by_a_run_of_this_policy_fill_the_replay(compose_config, tmp_path, caplog):
    _train(compose_config, "train.max_steps=2", f"output_dir={tmp_path / 'first'}")
    overrides = [
        "rollout.replay.enabled=true",
        f"rollout.replay.load_from={tmp_path / 'first' / 'rollouts'}",
        "train.max_steps=1",
        f"output_dir={tmp_path / 'second'}",
    ]
    with caplog.at_level("INFO"):
        _train(compose_config, *overrides)
    assert "rollout.replay: 4 groups loaded from" in caplog.text, "2 steps of 2 groups of 4"


@pytest.mark.slow
def test_an_async_run_killed_after_a_checkpoint_resumes_on_the_prompts_it_would_have_had(compose_config, tmp_path):
    """The prompt stream continues where it stopped: steps 3-5 of the resumed run train on the prompts steps 3-5 of
    an unkilled run train on, in async mode."""
    overrides = [*TRL_SMALL, "rollout.mode=async", "train.max_steps=5", "train.save_strategy=steps"]
    overrides += ["train.save_steps=2", "logger=csv"]
    straight = recipe.train(compose_config("trl_grpo_torchrl_rollouts", [*overrides, f"output_dir={tmp_path / 's'}"]))
    assert straight["train/steps"] == 5
    run_dir = tmp_path / "k"

    def checkpoint_2_done() -> bool:
        return (run_dir / "trainer" / "checkpoint-2" / "trainer_state.json").is_file()

    # The killed run forked from this process, its imports done (_in_process.ForkedScript): a process of its own that
    # the SIGKILL ends with its collector, as a launched one.
    kill_recipe_run_when(
        "trl_grpo_torchrl_rollouts.py", [*overrides, f"hydra.run.dir={run_dir}"], ready=checkpoint_2_done, forked=True
    )
    resumed = recipe.train(
        compose_config("trl_grpo_torchrl_rollouts", [*overrides, f"output_dir={run_dir}", "resume=true"])
    )
    assert resumed["train/steps"] == 5
    expected, got = load_rollouts(tmp_path / "s" / "rollouts"), load_rollouts(run_dir / "rollouts")
    for step in (3, 4, 5):
        want = texts(expected[expected["step"] == step], "prompt")
        have = texts(got[got["step"] == step], "prompt")
        assert have == want, (step, have, want)
    assert json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])["step"] == 2
