"""interop.sampling.workers: samplers apart from the learner, in local processes or Ray actors. Each prompt group is
sampled by one worker and the batch comes back in the submitted order; a worker killed in the middle of a batch is
replaced and its groups sampled again (none lost, none twice); a worker whose Ray node left is dropped with a warning
naming the node; a learner killed with SIGKILL leaves none of the Ray processes it started. The Ray tests start a
two-node local cluster (``ray.cluster_utils.Cluster``) and are slow."""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from interop import TorchRLRolloutFunc
from interop.sampling import SamplingSettings
from interop.sampling.workers import PublishedWeights, RolloutWorkers, WorkerResources, split_groups

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRODUCTS = ("mug", "lamp", "bike", "desk", "chair", "phone")


def _prompt_ids(tokenizer, group_size: int) -> list[list[int]]:
    """Each product's review prompt ``group_size`` times in a row, as trl hands them over."""
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Review the {product}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for product in PRODUCTS
    ]
    return [list(row) for row in ids for _ in range(group_size)]


def _unpadded_prompts(rollout) -> list[list[int]]:
    ids, lengths = rollout.get("prompt_ids").tolist(), rollout.get("prompt_length").tolist()
    return [row[len(row) - n :] for row, n in zip(ids, lengths)]


def _workers(tiny_policy, backend: str, workers: int, **kwargs) -> RolloutWorkers:
    model, tokenizer = tiny_policy
    return RolloutWorkers(
        model,
        tokenizer,
        settings=SamplingSettings(max_new_tokens=6),
        eos_token_ids=[tokenizer.eos_token_id],
        backend=backend,
        workers=workers,
        **kwargs,
    )


def _check_batch(rollout, prompts: list[list[int]]) -> None:
    """Every submitted prompt once, in order, with a completion whose log-probs are finite and negative."""
    assert _unpadded_prompts(rollout) == prompts
    lengths = rollout.get("completion_length")
    assert bool((lengths >= 1).all())
    mask = torch.arange(rollout.get("logprobs").shape[1])[None] < lengths[:, None]
    log_probs = rollout.get("logprobs")[mask]
    assert bool(torch.isfinite(log_probs).all()) and bool((log_probs <= 0).all())


@pytest.mark.parametrize(
    ("rows", "group_size", "workers", "expected"),
    [
        (12, 2, 2, [range(0, 6), range(6, 12)]),
        (12, 4, 2, [range(0, 4), range(4, 12)]),  # 3 groups over 2 workers: never half a group
        (4, 2, 8, [range(0, 2), range(2, 4)]),  # more workers than groups: the extra ones get nothing
        (6, 1, 4, [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]),
    ],
)
def test_each_group_goes_whole_to_one_worker(rows, group_size, workers, expected):
    shards = split_groups(rows, group_size, workers)
    assert shards == expected
    assert [row for shard in shards for row in shard] == list(range(rows))
    assert all(shard.start % group_size == 0 and len(shard) % group_size == 0 for shard in shards)


def test_rows_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="7 rows are not whole groups of 2"):
        split_groups(7, 2, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "async", "backend": "learner"}, "mode='async' samples apart from the learner"),
        ({"workers": 2}, "workers=2 with backend='learner'"),
        ({"backend": "processes", "workers": 0}, "workers must be an integer >= 1, got 0"),
        ({"backend": "cluster"}, "backend must be one of"),
        ({"weight_sync_every": 2}, "backend='learner' samples with the weights it trains"),
        ({"sampler_dtype": torch.bfloat16}, "backend='learner' samples with the weights it trains"),
        ({"backend": "processes", "weight_sync_every": 0}, "weight_sync_every must be an integer >= 1, got 0"),
        ({"backend": "processes", "weight_sync_every": 3}, "weight_sync_every=3 in sync mode lets a batch be 2 steps"),
        ({"mode": "async", "weight_sync_every": 2}, "weight_sync_every=2 in async mode lets a batch be 2 steps"),
    ],
)
def test_the_rollout_function_refuses_a_backend_it_cannot_honour(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TorchRLRolloutFunc(**kwargs)


def test_worker_resources_refuse_negative_or_nan_amounts():
    with pytest.raises(ValueError, match="num_gpus must be a number >= 0"):
        WorkerResources(num_gpus=-1)
    with pytest.raises(ValueError, match="sampler must be a number >= 0"):
        WorkerResources(resources={"sampler": float("nan")})
    assert WorkerResources(num_cpus=2, resources={"sampler": 1}).as_dict() == {"CPU": 2.0, "GPU": 0.0, "sampler": 1.0}


def test_the_ray_backend_without_ray_names_the_extra_to_install(tiny_policy, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does where ray is not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[ray\]"'):
        _workers(tiny_policy, "ray", 1)


def test_local_workers_sample_every_group_once_when_one_is_killed_mid_batch(tiny_policy, caplog):
    """Two local processes; the first is SIGKILLed during the second batch: a new one samples its groups, the batch
    holds every prompt once in order, sampled by the published version."""
    model, tokenizer = tiny_policy
    prompts = _prompt_ids(tokenizer, group_size=2)
    workers = _workers(tiny_policy, "processes", 2, seed=3)
    try:
        workers.wait_until_ready()
        workers.publish(model, version=0)
        workers.submit(prompts, group_size=2)
        first, version = workers.result()
        _check_batch(first, prompts)
        assert version == 0 and workers.last_stats["worker_restarts"] == 0
        assert set(workers.last_stats) >= {"worker_0/tokens_per_s", "worker_1/tokens_per_s", "workers"}
        killed = workers.pids[0]
        workers.publish(model, version=1)
        with caplog.at_level(logging.WARNING, logger="interop.sampling.workers"):
            workers.submit(prompts, group_size=2)
            os.kill(killed, signal.SIGKILL)  # at once: it has the request, and no answer can be sent in microseconds
            second, version = workers.result()
        _check_batch(second, prompts)
        assert version == 1
        assert workers.last_stats["worker_restarts"] == 1 and workers.restarts == 1
        assert f"worker 0 (pid {killed} on this machine) died during a batch" in caplog.text
        assert killed not in workers.pids and not psutil.pid_exists(killed)
    finally:
        pids = [pid for pid in workers.pids if pid is not None]
        workers.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


# ---------------------------------------------------------------------------------------------------- Ray (slow)


@pytest.fixture
def connected_two_node_cluster(two_node_cluster):
    """tests/conftest.py's two-node cluster, this process connected to it."""
    import ray

    ray.init(address=two_node_cluster[0].address, include_dashboard=False, log_to_driver=False)
    return two_node_cluster


@pytest.mark.slow
def test_ray_workers_on_two_nodes_lose_no_group_when_killed_twice_or_when_a_node_leaves(
    tiny_policy, connected_two_node_cluster, caplog
):
    """Four batches of six groups on two Ray workers (one per node): an actor killed with ray.kill during the second,
    a worker process SIGKILLed during the third, the second node removed during the fourth. Every batch holds every
    group once, in order; the first two faults replace the worker, the third drops it with a warning naming the node
    and the run goes on with the other."""
    import ray

    cluster, second = connected_two_node_cluster
    model, tokenizer = tiny_policy
    prompts = _prompt_ids(tokenizer, group_size=2)
    workers = _workers(tiny_policy, "ray", 2, seed=1)
    sampled_groups = 0
    try:
        nodes = {worker.node for worker in workers._workers}
        assert len(nodes) == 2, "one worker per node (one CPU each)"
        faults = [
            None,
            lambda: ray.kill(workers._workers[0].handle, no_restart=True),
            lambda: os.kill(workers.pids[1], signal.SIGKILL),
            lambda: cluster.remove_node(second),
        ]
        with caplog.at_level(logging.WARNING, logger="interop.sampling.workers"):
            for version, fault in enumerate(faults):
                workers.publish(model, version=version)
                workers.submit(prompts, group_size=2)
                if fault is not None:  # at once, while the batch is being sampled (it takes a fraction of a second)
                    fault()
                rollout, sampled_by = workers.result()
                _check_batch(rollout, prompts)
                assert sampled_by == version
                sampled_groups += rollout.shape[0] // 2
        assert sampled_groups == 4 * len(PRODUCTS), "every group of every batch once"
        assert workers.restarts == 3 and workers.workers == 1
        second_node = second.node_id
        assert workers.dropped_nodes == [second_node]
        assert f"node {second_node} left the Ray cluster" in caplog.text, caplog.text
        assert caplog.text.count("died during a batch") == 2
    finally:
        workers.close()


@pytest.mark.slow
def test_a_cluster_too_small_for_the_workers_is_refused_naming_what_is_missing(connected_two_node_cluster):
    from interop.sampling.workers import check_placement

    check_placement(2, WorkerResources(num_cpus=1))
    with pytest.raises(ValueError, match=r"rollout.workers=3: .* missing CPU 1 \(the cluster has CPU 2"):
        check_placement(3, WorkerResources(num_cpus=1))
    with pytest.raises(ValueError, match=r"missing GPU 2, second 1"):
        check_placement(2, WorkerResources(num_cpus=0.5, num_gpus=1, resources={"second": 1}))


@pytest.mark.slow
def test_an_unreachable_cluster_address_is_refused_naming_it():
    pytest.importorskip("ray")
    from interop.sampling.workers import connect_ray

    with pytest.raises(ConnectionError, match=r"ray.address='127.0.0.1:9'.*ray start --head"):
        connect_ray("127.0.0.1:9")


_LEARNER = """
import sys, time
from interop.sampling.workers import connect_ray
from transformers import AutoModelForCausalLM, AutoTokenizer
from interop.sampling.workers import RolloutWorkers
from interop.sampling import SamplingSettings
connect_ray(num_cpus=1)
tokenizer = AutoTokenizer.from_pretrained("tiny/policy")
model = AutoModelForCausalLM.from_pretrained("tiny/policy")
workers = RolloutWorkers(model, tokenizer, settings=SamplingSettings(max_new_tokens=4),
                         eos_token_ids=[tokenizer.eos_token_id], backend="ray", workers=1)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_learner_killed_with_sigkill_leaves_none_of_the_ray_processes_it_started():
    """The learner started a local cluster (ray.address null) and a worker actor; SIGKILLed, every process it had
    started (Ray's GCS, raylet, agents, the worker) is gone within seconds. Ray alone leaves its dashboard and
    runtime-env agents running: interop.sampling._ray_janitor stops them."""
    pytest.importorskip("ray")
    learner = subprocess.Popen(
        [sys.executable, "-c", _LEARNER], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert learner.stdout.readline().strip() == "ready"
        started = psutil.Process(learner.pid).children(recursive=True)
        names = " ".join(process.name() for process in started)
        assert "raylet" in names and "gcs_server" in names, names
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=30)
        left = [(process.pid, process.name()) for process in alive if process.status() != psutil.STATUS_ZOMBIE]
        assert left == [], "still running after the learner's SIGKILL"
    finally:
        if learner.poll() is None:
            learner.kill()


def test_workers_sample_with_the_published_weights_even_when_the_trainer_patched_its_models_forward(tiny_policy):
    """A trainer wraps its model's forward on the instance (accelerate does), closing over the trainer's module: a copy
    that kept that forward would sample with the trainer's weights as they were when copied, whatever is published."""
    model, tokenizer = tiny_policy
    patched = copy.deepcopy(model)
    original = patched.forward
    patched.forward = functools.wraps(original)(lambda *args, **kwargs: original(*args, **kwargs))
    prompts = _prompt_ids(tokenizer, group_size=2)[:4]
    workers = _workers((patched, tokenizer), "processes", 1)
    try:
        with torch.no_grad():
            for parameter in patched.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.3)
        workers.publish(patched, version=1)
        workers.submit(prompts, group_size=2)
        rollout, _ = workers.result()
    finally:
        workers.close()
    length = int(rollout.get("completion_length")[0])
    completion = rollout.get("completion_ids")[0, :length]
    full = torch.tensor(prompts[0] + completion.tolist())[None]
    with torch.no_grad():
        logits = patched(input_ids=full).logits[0, len(prompts[0]) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, completion[:, None]).squeeze(-1)
    torch.testing.assert_close(rollout.get("logprobs")[0, :length], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("recipe_name", ["trl_grpo_torchrl_rollouts", "grpo_torchrl_rm"])
def test_ray_workers_for_a_cuda_run_must_ask_for_gpus(compose_config, recipe_name):
    """Ray gives an actor no GPU unless it asks: with device=cuda and no GPU per worker, the workers would sample on
    CPU (the trl recipe's) or fail loading on CUDA (the GRPO recipe's collectors). Refused naming the key, in both."""
    from recipes.common.config import ConfigError
    from recipes.common.rollout_backend import check_rollout_backend

    cfg = compose_config(recipe_name, ["device=cuda", "rollout.backend=ray", "rollout.workers=2"])
    with pytest.raises(
        ConfigError, match=r"device=cuda with rollout.backend=ray and rollout.worker_resources.num_gpus=0"
    ):
        check_rollout_backend(cfg)
    check_rollout_backend(
        compose_config(recipe_name, ["device=cuda", "rollout.backend=ray", "rollout.worker_resources.num_gpus=1"])
    )


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_published_weights_travel_without_copies_and_load_as_the_learners(tiny_policy, dtype):
    """What a Ray worker gets: every weight as an out-of-band pickle buffer (Ray's object store maps those on the
    worker's node without a copy; a pickled torch tensor travels inside the pickle and is copied on both sides), tied
    weights once, and, loaded into the sampler's copy (its tensors then on those buffers), the learner's weights cast
    to the sampler's dtype, the head still tied to the embeddings."""
    model, _ = tiny_policy
    learner = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in learner.parameters():
            parameter.add_(torch.randn_like(parameter))
    buffers = []
    payload = pickle.dumps(PublishedWeights(learner, dtype=dtype), protocol=5, buffer_callback=buffers.append)
    published = pickle.loads(payload, buffers=buffers)
    distinct = {id(tensor) for tensor in learner.state_dict(keep_vars=True).values()}
    assert len(buffers) == len(published.arrays) == len(distinct) < len(learner.state_dict())
    assert len(payload) < 0.05 * published.nbytes, "the weights travel beside the pickle, not inside it"
    sampler = copy.deepcopy(model).to(dtype or torch.float32)
    published.load_into(sampler, share=True)
    for name, value in learner.state_dict().items():
        assert torch.equal(sampler.state_dict()[name], value.to(dtype or value.dtype)), name
    assert sampler.lm_head.weight is sampler.model.embed_tokens.weight
    shared = [
        name for name, array in published.arrays.items() if sampler.state_dict()[name].data_ptr() == array.ctypes.data
    ]
    assert shared == list(published.arrays), "share=True: the sampler's CPU tensors are the published memory"


@pytest.mark.parametrize("recipe_name", ["trl_grpo_torchrl_rollouts", "grpo_torchrl_rm"])
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.weight_sync_every=2"], r"rollout.weight_sync_every=2 with rollout.backend=learner"),
        (["rollout.sampler_dtype=bfloat16"], r"rollout.sampler_dtype=bfloat16 with rollout.backend=learner"),
        (  # sync: k - 1 = 2 updates old at most, over the bound of 1
            ["rollout.backend=processes", "rollout.weight_sync_every=3"],
            r"rollout.weight_sync_every=3 with rollout.mode=sync: a batch can then be 2 updates old, more than "
            r"rollout.max_policy_lag=1 allows. Set rollout.max_policy_lag=2 or more, or rollout.weight_sync_every=2",
        ),
        (  # async: one more (sampled during the update before its own)
            ["rollout.mode=async", "rollout.weight_sync_every=2"],
            r"a batch can then be 2 updates old, .* or rollout.weight_sync_every=1 or less",
        ),
    ],
)
def test_a_weight_push_the_backend_or_the_lag_bound_cannot_honour_is_refused(
    compose_config, recipe_name, overrides, message
):
    """rollout.weight_sync_every and rollout.sampler_dtype set how the weights reach a copy apart from the learner:
    refused with the learner's backend (it samples with the weights it trains), and a push interval whose stale
    batches the lag bound would not allow, in both recipes, naming the keys and the fix."""
    from recipes.common.config import ConfigError
    from recipes.common.rollout_backend import check_rollout_backend

    with pytest.raises(ConfigError, match=message):
        check_rollout_backend(compose_config(recipe_name, overrides))
    check_rollout_backend(compose_config(recipe_name, ["rollout.backend=processes", "rollout.weight_sync_every=2"]))
    check_rollout_backend(compose_config(recipe_name, ["rollout.backend=ray", "rollout.sampler_dtype=bfloat16"]))


def _lora(model):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # adapters that change the model (peft starts lora_B at zero)
        for name, parameter in lora.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return lora


def _merged(model) -> dict[str, torch.Tensor]:
    return {name: value.float() for name, value in copy.deepcopy(model).merge_and_unload().state_dict().items()}


def test_a_lora_learner_pushes_only_its_adapters_and_the_samplers_hold_its_merged_weights(tiny_policy):
    """LoRA: a push carries the adapters only (the samplers' copies hold the base, which no update changes), through
    Ray's object store (PublishedWeights) and into a local worker's shared copy alike; after it the sampler's weights,
    merged, equal the learner's merged weights (and a stale sampler's do not: the push is what made them equal)."""
    model, tokenizer = tiny_policy
    learner = _lora(model)
    sampler = copy.deepcopy(learner)
    with torch.no_grad():  # the learner's update: the adapters move, the base is frozen
        for parameter in learner.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    stale = _merged(sampler)
    expected = _merged(learner)
    assert not all(torch.equal(stale[name], value) for name, value in expected.items())
    adapters = {name for name, parameter in learner.named_parameters() if parameter.requires_grad}
    assert adapters and all("lora_" in name for name in adapters)

    buffers = []
    payload = pickle.dumps(PublishedWeights(learner, names=adapters), protocol=5, buffer_callback=buffers.append)
    published = pickle.loads(payload, buffers=buffers)
    assert set(published.arrays) == adapters
    published.load_into(sampler, share=True)
    for name, value in _merged(sampler).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)

    workers = _workers((learner, tokenizer), "processes", 1)
    try:
        before = {name: value.clone() for name, value in workers._workers[0].handle.model.state_dict().items()}
        with torch.no_grad():
            for parameter in learner.parameters():
                if parameter.requires_grad:
                    parameter.add_(torch.randn_like(parameter) * 0.1)
                else:  # a frozen weight no push carries (none changes in training: this shows which are sent)
                    parameter.add_(1.0)
        workers.publish(learner, version=1)
        shared = workers._workers[0].handle.model
        for name, value in shared.state_dict().items():
            changed = not torch.equal(value, before[name])
            assert changed == (name in adapters), name
    finally:
        workers.close()


def test_a_bf16_sampler_holds_the_learners_weights_cast_at_each_push_and_the_learner_keeps_float32(tiny_policy):
    """RolloutWorkers(dtype=torch.bfloat16): the worker's copy is bfloat16, the learner's weights are cast into it as
    they are published (each push, not each step: the copy equals the learner's weights cast), the learner stays in
    float32, and the worker samples valid completions with it."""
    model, tokenizer = tiny_policy
    learner = copy.deepcopy(model)
    workers = _workers((learner, tokenizer), "processes", 1, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            for parameter in learner.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.1)
        workers.publish(learner, version=3)
        copy_state = workers._workers[0].handle.model.state_dict()
        for name, value in learner.state_dict().items():
            assert value.dtype == torch.float32, name
            assert copy_state[name].dtype == torch.bfloat16 and torch.equal(copy_state[name], value.bfloat16()), name
        prompts = _prompt_ids(tokenizer, group_size=2)[:4]
        workers.submit(prompts, group_size=2)
        rollout, version = workers.result()
        assert version == 3
        _check_batch(rollout, prompts)
    finally:
        workers.close()
