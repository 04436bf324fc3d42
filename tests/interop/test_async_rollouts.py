"""TorchRLRolloutFunc(mode="async") under interop.TorchRLGRPOTrainer, with trl's own code: a child process samples the
next generation batch while trl updates; each completion is paired with the prompt trl passed (the look-ahead is
checked, a wrong one never pairs); a batch sampled one update ago reaches trl's loss with the sampling log-probs as
its old log-probs (trl's own _compute_loss: same loss and gradients as with old log-probs trl scored itself at the
sampling weights), or, with trl's sampler correction on, in its correction ratio; the child ends with the trainer
however training ends."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement

from interop import TorchRLBufferDataset, TorchRLRolloutFunc
from interop.trl.trainer import TorchRLGRPOTrainer

PRODUCTS = ("mug", "lamp", "bike", "desk", "chair", "phone", "bag", "watch")
PROMPTS = [[{"role": "user", "content": f"Review the {product}."}] for product in PRODUCTS]


def _stream(seed: int = 0):
    """The prompts in a TorchRL buffer drawn without replacement, as trl's IterableDataset."""
    rows = TensorDict({"prompt": NonTensorStack(*[NonTensorData(p) for p in PROMPTS])}, batch_size=[len(PROMPTS)])
    generator = torch.Generator().manual_seed(seed)
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(len(PROMPTS)), sampler=SamplerWithoutReplacement(), generator=generator
    )
    buffer.extend(rows)
    return TorchRLBufferDataset(buffer, batch_size=4, keys=["prompt"], num_batches=None).as_hf_dataset()


def _length_reward(completions, **kwargs):
    return [len(completion[0]["content"]) / 10 for completion in completions]


def _args(tmp_path, **overrides):
    from trl import GRPOConfig

    settings = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "report_to": "none",
        "bf16": False,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 12,
        "max_steps": 4,
        "shuffle_dataset": False,
        "disable_tqdm": True,
        "activation_checkpointing": False,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        **overrides,
    }
    return GRPOConfig(**settings)


def _trainer(tiny_policy, tmp_path, *, reward=_length_reward, buffer=None, rollout_options=None, **overrides):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    options = rollout_options or {}
    return TorchRLGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=_args(tmp_path, **overrides),
        train_dataset=_stream(),
        processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(tokenizer=tokenizer, mode="async", replay_buffer=buffer, **options),
    )


def _encoded(tokenizer, prompt) -> list[int]:
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def test_async_training_samples_ahead_and_pairs_each_completion_with_the_prompt_trl_passed(tiny_policy, tmp_path):
    """The default max_policy_lag=1 with one update per generation batch: every batch after the first is sampled while
    the one before trains, and with past_lag_bound=withhold (the default, named here) nothing is withheld or sampled
    again."""
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    trainer = _trainer(tiny_policy, tmp_path, buffer=buffer, rollout_options={"past_lag_bound": "withhold"})
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "policy_lag" in entry]
    assert [entry["policy_lag"] for entry in logs] == [0.0, 1.0, 1.0, 1.0], "batch k+1 sampled while k trains"
    assert all(entry["rollout/lookahead_misses"] == 0 and entry["rollout/resampled"] == 0 for entry in logs)
    assert all(entry["rollout/withheld"] == 0.0 for entry in logs)
    assert trainer.rollout_func._background is None, "the sampling process ends with train()"
    rows = buffer[: len(buffer)]
    assert len(buffer) == 4 * 8 and rows["step"].tolist() == [0] * 8 + [0] * 8 + [1] * 8 + [2] * 8
    tokenizer = tiny_policy[1]
    for prompt, prompt_ids in zip(rows.get("prompt").tolist(), rows.get("prompt_ids", as_list=True), strict=True):
        assert prompt_ids.tolist() == _encoded(tokenizer, prompt), "each completion beside the prompt trl passed"
    # The stream's order: groups of 4 of one prompt, 2 prompts a batch, every prompt once in the pass of 8.
    prompts = [prompt[0]["content"] for prompt in rows.get("prompt").tolist()]
    groups = [prompts[i] for i in range(0, 32, 4)]
    assert all(prompts[i : i + 4] == [prompts[i]] * 4 for i in range(0, 32, 4))
    assert sorted(groups) == sorted(prompt[0]["content"] for prompt in PROMPTS)


def test_a_wrong_look_ahead_is_never_paired_it_is_sampled_again(tiny_policy, tmp_path):
    """A stream that moved otherwise than read ahead (shuffled, restarted): the pre-sampled batch is dropped,
    counted, and the batch trl asked for is sampled for its own prompts."""
    trainer = _trainer(tiny_policy, tmp_path)
    lookahead = trainer.rollout_func.lookahead
    wrong = [PROMPTS[7]] * 4 + [PROMPTS[6]] * 4
    trainer.rollout_func.lookahead = lambda prompts: wrong if lookahead(prompts) != wrong else None
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    trainer.rollout_func.replay_buffer = buffer
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "policy_lag" in entry]
    assert sum(entry["rollout/lookahead_misses"] for entry in logs) >= 1
    rows = buffer[: len(buffer)]
    for prompt, prompt_ids in zip(rows.get("prompt").tolist(), rows.get("prompt_ids", as_list=True), strict=True):
        assert prompt_ids.tolist() == _encoded(tiny_policy[1], prompt)


@pytest.mark.parametrize("past_lag_bound", ["withhold", "resample"])
def test_past_the_lag_bound_the_next_batch_is_withheld_or_sampled_again_as_chosen(
    tiny_policy, tmp_path, past_lag_bound
):
    """max_policy_lag=0: a batch read ahead would train one update old. withhold: it is not sampled ahead but when trl
    asks for it, counted with trl's wait (rollout/withheld, rollout/withheld_s); resample: it is sampled ahead, then
    again (rollout/resampled). Either way every batch trains at lag 0, sampled by the workers: the log-probs recorded
    for each batch are the fp32 trainer's at the weights of its step to float noise (the sampler at the model's dtype,
    sampler_dtype=None; a bf16 sampler's:
    test_every_async_batch_is_sampled_at_the_sampler_dtype_the_first_and_the_resampled_ones_too)."""
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    options = {"max_policy_lag": 0, "past_lag_bound": past_lag_bound, "sampler_dtype": None}
    trainer = _trainer(tiny_policy, tmp_path, buffer=buffer, rollout_options=options)
    weights = _keep_weights(trainer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "policy_lag" in entry]
    assert [entry["policy_lag"] for entry in logs] == [0.0] * 4
    counted, other = ("withheld", "resampled") if past_lag_bound == "withhold" else ("resampled", "withheld")
    assert [entry[f"rollout/{counted}"] for entry in logs] == [0.0, 1.0, 1.0, 1.0], "every batch after the first"
    assert all(entry[f"rollout/{other}"] == 0.0 for entry in logs)
    waits = [entry["rollout/withheld_s"] for entry in logs]
    assert all(wait > 0 for wait in waits[1:]) if past_lag_bound == "withhold" else all(wait == 0 for wait in waits)
    rows = buffer[: len(buffer)]
    assert rows["step"].tolist() == [0] * 8 + [1] * 8 + [2] * 8 + [3] * 8
    for step in range(4):
        gap = _largest_log_prob_gap(tiny_policy[0], weights[step], rows[rows["step"] == step])
        assert gap < 1e-4, f"batch {step}: an fp32 sampler's log-probs are the trainer's (gap {gap:.2e})"


def _keep_weights(trainer) -> dict:
    """The trainer's weights before training (0) and after each optimizer step (its number), as training goes."""
    from transformers import TrainerCallback

    weights = {0: copy.deepcopy(trainer.model.state_dict())}

    class KeepWeights(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            weights[state.global_step] = copy.deepcopy(trainer.model.state_dict())

    trainer.add_callback(KeepWeights())
    return weights


def _largest_log_prob_gap(model, weights: dict, batch) -> float:
    """The largest gap between the log-probs recorded for ``batch``'s completions and those a copy of ``model`` at
    ``weights`` scores (trl's temperature is 1 here: the log-probs of the logits as they are)."""
    model = copy.deepcopy(model)
    model.load_state_dict(weights)
    assert batch.shape[0] == 8
    gap = 0.0
    for prompt, completion, recorded in zip(
        *(batch.get(key, as_list=True) for key in ("prompt_ids", "completion_ids", "logprobs")), strict=True
    ):
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]
        scored = logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]
        gap = max(gap, (scored - recorded).abs().max().item())
    return gap


def _train_recording_each_call(trainer) -> list[dict]:
    """Trains, and returns the rollout function's figures of each generation batch (trl logs per optimizer step)."""
    rollout_func, calls = trainer.rollout_func, []
    sample = rollout_func._async_rollout

    def recording(prompts, trainer):
        rollout = sample(prompts, trainer)
        calls.append(dict(rollout_func.stats))
        return rollout

    rollout_func._async_rollout = recording
    trainer.train()
    return calls


@pytest.mark.parametrize("past_lag_bound", ["withhold", "resample"])
def test_a_withheld_batch_starts_as_soon_as_the_bound_allows_a_resampled_one_when_trl_asks(
    tiny_policy, tmp_path, past_lag_bound
):
    """steps_per_generation=2: trl updates twice per generation batch, so one read ahead would train two updates old,
    past max_policy_lag=1. withhold starts it after the first of the two updates (it overlaps the second) and it
    trains one update old; resample samples it ahead, throws it away when trl asks for it, and samples it again."""
    options = {"past_lag_bound": past_lag_bound}
    trainer = _trainer(tiny_policy, tmp_path, rollout_options=options, steps_per_generation=2, max_steps=6)
    calls = _train_recording_each_call(trainer)
    assert len(calls) == 3
    if past_lag_bound == "withhold":
        assert [call["policy_lag"] for call in calls] == [0.0, 1.0, 1.0]
        assert [(call["withheld"], call["resampled"]) for call in calls] == [(0.0, 0.0), (1.0, 0.0), (1.0, 0.0)]
    else:
        assert [call["policy_lag"] for call in calls] == [0.0, 0.0, 0.0]
        assert [(call["withheld"], call["resampled"]) for call in calls] == [(0.0, 0.0), (0.0, 1.0), (0.0, 1.0)]


def test_a_withheld_batch_waits_for_a_weight_push_recent_enough_under_weight_sync_every(tiny_policy, tmp_path):
    """steps_per_generation=3 with max_policy_lag=2 and weights pushed every second update: a withheld batch may start
    after the first update of the three, but only with weights pushed at or after it (an older push would train it
    three updates old); every batch stays within the bound and none is sampled again."""
    options = {"max_policy_lag": 2, "weight_sync_every": 2}
    trainer = _trainer(tiny_policy, tmp_path, rollout_options=options, steps_per_generation=3, max_steps=9)
    calls = _train_recording_each_call(trainer)
    assert len(calls) == 3
    assert all(call["policy_lag"] <= 2 for call in calls) and all(call["resampled"] == 0 for call in calls)
    assert [call["withheld"] for call in calls] == [0.0, 1.0, 1.0]


def test_past_lag_bound_is_refused_unless_one_of_its_choices(tiny_policy):
    with pytest.raises(ValueError, match=r"past_lag_bound must be one of \('withhold', 'resample'\), got 'drop'"):
        TorchRLRolloutFunc(tokenizer=tiny_policy[1], mode="async", past_lag_bound="drop")


def test_every_async_batch_is_sampled_at_the_sampler_dtype_the_first_and_the_resampled_ones_too(tiny_policy, tmp_path):
    """The log-probs recorded for the first batch and for one sampled again past the bound (resample,
    max_policy_lag=0: every batch after the first) against the fp32 trainer's at the weights that sampled them: a bf16
    sampler's differ by far more than float noise (they used to be the trainer's own: these batches were sampled in
    its process at fp32). An fp32 sampler's (sampler_dtype=None: the model's dtype) agree to float noise, every batch
    of a resample run: test_past_the_lag_bound_the_next_batch_is_withheld_or_sampled_again_as_chosen."""
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    options = {"max_policy_lag": 0, "past_lag_bound": "resample", "sampler_dtype": torch.bfloat16}
    trainer = _trainer(tiny_policy, tmp_path, buffer=buffer, rollout_options=options, max_steps=2)
    weights = _keep_weights(trainer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "policy_lag" in entry]
    assert [entry["rollout/resampled"] for entry in logs] == [0.0, 1.0]
    rows = buffer[: len(buffer)]
    for step in (0, 1):
        gap = _largest_log_prob_gap(tiny_policy[0], weights[step], rows[rows["step"] == step])
        assert gap > 1e-3, f"batch {step}'s log-probs are the fp32 trainer's (largest gap {gap:.2e})"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"shuffle_dataset": True}, "shuffle_dataset=False"),
        ({"dataloader_num_workers": 1}, "dataloader_num_workers"),
    ],
)
def test_streams_that_cannot_be_read_ahead_are_refused(tiny_policy, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tiny_policy, tmp_path, **override)


def _stale_batch(trainer):
    """Batch 2 sampled (in the child) by the weights of call 1, then the weights moved (an update); returns trl's scored
    batch and a copy of the sampling weights."""
    first = [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4
    second = [PROMPTS[2]] * 4 + [PROMPTS[3]] * 4
    trainer.rollout_func.lookahead = lambda prompts: second if prompts == first else None
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    try:
        torch.manual_seed(0)
        trainer._generate_and_score_completions([{"prompt": p} for p in first])
        sampling_weights = copy.deepcopy(trainer.model)
        with torch.no_grad():
            trainer.model.model.norm.weight.mul_(1.5)  # the update between sampling and training
        trainer.state.global_step = 1
        stale = trainer._generate_and_score_completions([{"prompt": p} for p in second])
    finally:
        trainer.rollout_func.close()
    assert trainer.rollout_func.stats["policy_lag"] == 1.0
    return stale, sampling_weights


def test_a_stale_batch_reaches_trls_loss_with_its_sampling_log_probs_as_old(tiny_policy, tmp_path):
    """Without trl's sampler correction: trl's _compute_loss on our output equals, in loss and gradients, its loss on
    the same batch with the old log-probs trl itself scores at the sampling weights; trl's default (no old log-probs:
    on-policy) differs."""
    trainer = _trainer(tiny_policy, tmp_path, vllm_importance_sampling_correction=False)
    stale, sampling_weights = _stale_batch(trainer)
    ids = torch.cat([stale["prompt_ids"], stale["completion_ids"]], dim=1)
    mask = torch.cat([stale["prompt_mask"], stale["completion_mask"]], dim=1)
    with torch.no_grad():
        trls_old, _, _ = trainer._get_per_token_logps_and_entropies(
            sampling_weights, ids, mask, stale["completion_ids"].shape[1]
        )
    completion = stale["completion_mask"].bool()
    torch.testing.assert_close(stale["old_per_token_logps"][completion], trls_old[completion], atol=2e-5, rtol=0)

    def loss_and_grads(old):
        trainer.model.zero_grad()
        inputs = (
            {**stale, "old_per_token_logps": old}
            if old is not None
            else {k: v for k, v in stale.items() if k != "old_per_token_logps"}
        )
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    ours, our_grads = loss_and_grads(stale["old_per_token_logps"])
    trls, trl_grads = loss_and_grads(torch.where(completion, trls_old, 0.0))
    torch.testing.assert_close(ours, trls, atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(our_grads, trl_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    on_policy, _ = loss_and_grads(None)
    assert not torch.allclose(on_policy, ours, atol=1e-4), "without the sampling log-probs the lag goes uncorrected"


def test_with_trls_sampler_correction_a_stale_batch_keeps_trls_old_log_probs_and_the_ratio_carries_the_lag(
    tiny_policy, tmp_path
):
    """With vllm_importance_sampling_correction on (trl's default), trl's old log-probs are its own at the current
    weights and its correction ratio, exp(current - sampling log-prob) clipped at clip_max, corrects the lag."""
    trainer = _trainer(tiny_policy, tmp_path, vllm_importance_sampling_mode="token_truncate")
    stale, sampling_weights = _stale_batch(trainer)
    ids = torch.cat([stale["prompt_ids"], stale["completion_ids"]], dim=1)
    mask = torch.cat([stale["prompt_mask"], stale["completion_mask"]], dim=1)
    width = stale["completion_ids"].shape[1]
    with torch.no_grad():
        at_sampling, _, _ = trainer._get_per_token_logps_and_entropies(sampling_weights, ids, mask, width)
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    completion = stale["completion_mask"].bool()
    torch.testing.assert_close(stale["old_per_token_logps"][completion], current[completion], atol=2e-5, rtol=0)
    torch.testing.assert_close(
        stale["sampling_per_token_logps"][completion], at_sampling[completion], atol=2e-5, rtol=0
    )
    lag_ratio = torch.exp(current - at_sampling).clamp(max=trainer.args.vllm_importance_sampling_clip_max)
    ratio = stale["importance_sampling_ratio"]
    torch.testing.assert_close(ratio[completion], lag_ratio[completion], atol=1e-4, rtol=1e-4)
    assert (ratio[completion] - 1).abs().max() > 1e-2, "the update between sampling and training is in the ratio"
    assert trainer._metrics["train"]["sampling/sampling_logp_difference/max"][-1] > 1e-2


def test_the_sampling_process_ends_when_a_reward_function_raises(tiny_policy, tmp_path):
    calls = []

    def fails_at_the_third_batch(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("reward service down")
        return [1.0] * len(completions)

    trainer = _trainer(tiny_policy, tmp_path, reward=fails_at_the_third_batch)
    with pytest.raises(RuntimeError, match="reward service down"):
        trainer.train()
    assert trainer.rollout_func._background is None


_KILLED_TRAINER = """
import os, sys, time, torch
sys.path.insert(0, {tests!r})
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
from tensordict import set_list_to_stack
set_list_to_stack(True).set()
from transformers import AutoModelForCausalLM, AutoTokenizer
import test_async_rollouts as t
tokenizer = AutoTokenizer.from_pretrained({policy!r}, padding_side="left")
model = AutoModelForCausalLM.from_pretrained({policy!r})
trainer = t._trainer((model, tokenizer), {out!r}, max_steps=100000)
trainer.train()
"""


@pytest.mark.slow  # a multi-process run: the slow suite's (the default suite's budget is 8 minutes)
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_the_sampling_process_dies_with_its_trainer(tmp_path, repo_root, signal_name):
    import signal

    script = _KILLED_TRAINER.format(
        tests=str(repo_root / "tests" / "interop"), policy=str(repo_root / "tiny" / "policy"), out=str(tmp_path)
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(repo_root)}, stderr=subprocess.PIPE
    )
    try:
        deadline, children = time.monotonic() + 180, []
        while time.monotonic() < deadline and not children:
            assert trainer.poll() is None, trainer.stderr.read().decode()[-3000:]
            children = psutil.Process(trainer.pid).children(recursive=True)
            time.sleep(0.2)
        assert children, "the sampling process never started"
        trainer.send_signal(getattr(signal, signal_name))
        trainer.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running after {signal_name} of the trainer: {alive}"
    finally:
        trainer.kill()


def test_async_mode_takes_a_datasets_dataset_and_shuffles_each_pass_as_trl_would(tiny_policy, tmp_path):
    """A library user's map-style dataset with trl's default shuffle_dataset=True (refused before: async mode needed a
    stream and shuffle_dataset=False, said only in an error): read as passes over it, each in its own seeded order;
    every batch pre-sampled for the very prompts trl then passes."""
    import datasets

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    buffer = ReplayBuffer(storage=LazyStackStorage(100))
    trainer = TorchRLGRPOTrainer(
        model=model,
        reward_funcs=_length_reward,
        args=_args(tmp_path, shuffle_dataset=True),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(tokenizer=tokenizer, mode="async", replay_buffer=buffer),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "policy_lag" in entry]
    assert [entry["policy_lag"] for entry in logs] == [0.0, 1.0, 1.0, 1.0]
    assert all(entry["rollout/lookahead_misses"] == 0 for entry in logs)
    prompts = [prompt[0]["content"] for prompt in buffer[: len(buffer)].get("prompt").tolist()]
    groups = [prompts[i] for i in range(0, 32, 4)]
    assert sorted(groups) == sorted(prompt[0]["content"] for prompt in PROMPTS), "one pass: every prompt once"
    assert groups != [prompt[0]["content"] for prompt in PROMPTS], "in a shuffled order"


def test_async_mode_refuses_a_dataset_without_max_steps_at_construction(tiny_policy, tmp_path):
    import datasets

    with pytest.raises(ValueError, match=r"a datasets.Dataset is read as a stream here, which has no length: set args"):
        TorchRLGRPOTrainer(
            model=tiny_policy[0],
            reward_funcs=_length_reward,
            args=_args(tmp_path, max_steps=-1),
            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=tiny_policy[1],
            rollout_func=TorchRLRolloutFunc(tokenizer=tiny_policy[1], mode="async"),
        )
