"""Shared fixtures: the shipped tiny model kit, offline HF settings, Hydra state, and GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the hub: everything loads from local folders exactly as a hub id would.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"

# A script the MCP tests start as a server, not a test module: --doctest-modules would import it (and the mcp package).
collect_ignore = ["interop/mcp_calculator_server.py"]


def pytest_configure(config):
    # One torch thread per test worker when the suite runs on every core (pytest-xdist): two workers with a thread per
    # core each would thrash (2-thread ops on 2 busy cores ran 2-40x slower).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    # Hydra parses conf/'s YAML again at every compose; most tests compose (tests/_parsed_yaml.py).
    from _parsed_yaml import parse_each_yaml_text_once

    parse_each_yaml_text_once()


def pytest_collection_modifyitems(config, items):
    # The tests on the shared two-node Ray cluster first, in their order: pytest-xdist's worksteal gives each worker a
    # contiguous half of the collection and steals from the end of a queue, so they all run on the first worker, which
    # starts the cluster once (in the slow suite the second worker started another: 3.9 s of setup, 2026-12-06).
    items.sort(key=lambda item: "two_node_cluster" not in getattr(item, "fixturenames", ()))
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The shipped tiny kit: ``policy``, ``reward_base`` and ``reward_model`` checkpoint folders."""
    return REPO_ROOT / "tiny"


@pytest.fixture(scope="session")
def tiny_policy(tiny_dir):
    """``(model, tokenizer)``: the shipped tiny policy in eval mode and its tokenizer with left padding (generation's).

    Shared by the whole session: tests read it, copy the tokenizer before changing it and zero the gradients they make.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "policy", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def other_rm_dir(tmp_path_factory) -> Path:
    """A reward model with a tokenizer of its own: other vocabulary, other pad id, other chat template."""
    from _tiny_models import build_reward_model_with_own_tokenizer

    return build_reward_model_with_own_tokenizer(tmp_path_factory.mktemp("other_rm"))


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> Path:
    """The session's folder of runs several tests read (``_shared_runs.shared_run``), one for every xdist worker."""
    from _shared_runs import shared_runs_root

    return shared_runs_root(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _list_to_stack():
    """TorchRL's LLM stack needs tensordict's list-to-stack mode: every test runs in it, as the recipes do."""
    from tensordict import set_list_to_stack

    with set_list_to_stack(True):
        yield


@pytest.fixture(autouse=True)
def _clear_hydra():
    """Each test composes its own config: no GlobalHydra state leaks between tests."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.fixture
def compose_config():
    """``compose_config("grpo_torchrl_rm", ["key=value", ...])`` -> the composed DictConfig, in-process.

    ``hydra:`` interpolations are resolved as for a run (return_hydra_config), so the output dir can be overridden
    with ``hydra.run.dir=<tmp_path>``.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    import recipes.common.config  # noqa: F401  (registers ${project_root:})

    def _compose(config_name: str, overrides: list[str] | None = None):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            return cfg

    return _compose


@pytest.fixture
def compose_settings(compose_config, tmp_path):
    """``compose_settings("grpo_torchrl_rm", ["key=value", ...])`` -> the recipe's typed settings (its schema's
    dataclasses, resolved, LoRA settled as the command line says), as its checks build them
    (``recipes.common.schema.checked_tree``) but without the checks that read files: what a recipe's room reads."""
    from recipes.common.schema import checked_tree
    from recipes.grpo.schema import GRPORecipeConfig
    from recipes.reward.schema import RewardRecipeConfig
    from recipes.trl_grpo.schema import TrlGRPORecipeConfig

    schemas = {
        "grpo_torchrl_rm": GRPORecipeConfig,
        "trl_grpo_torchrl_rollouts": TrlGRPORecipeConfig,
        "reward_trainer_from_buffer": RewardRecipeConfig,
    }

    def _settings(config_name: str, overrides: list[str] | None = None):
        overrides = list(overrides or [])
        if not any(override.startswith("output_dir=") for override in overrides):
            overrides.append(f"output_dir={tmp_path}")  # a run's folder, as Hydra gives one: the schema reads it
        cfg = compose_config(config_name, overrides)
        return checked_tree(cfg, schemas[config_name], recipe=config_name)[1]

    return _settings


class _SessionCluster:
    """The Ray cluster the session's ``two_node_cluster`` tests share on one test worker: starting one takes 10-20 s
    on 2 cores, a check that it is idle (and a new second node where a test removed it) about 2 s."""

    def __init__(self):
        self.cluster = self.second = None

    def ready(self):
        """``(cluster, second node)``: two nodes of 1 CPU each, nothing running on them."""
        if self.cluster is not None and not self._idle():
            self.close()
        if self.cluster is None:
            from ray.cluster_utils import Cluster

            self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
            self.second = None
        if self.second is None or self.second not in self.cluster.worker_nodes:
            self.second = self.cluster.add_node(num_cpus=1, resources={"second": 1})
            self.cluster.wait_for_nodes()
        return self.cluster, self.second

    def _idle(self, within_s: float = 10.0) -> bool:
        """The head alive, and every CPU of the cluster free within ``within_s`` (a test's actors end as it ends;
        anything still holding a CPU then gets the next test a new cluster)."""
        import time

        import ray

        if not self.cluster.head_node.remaining_processes_alive():
            return False
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        try:
            deadline = time.monotonic() + within_s
            while True:
                total, free = ray.cluster_resources(), ray.available_resources()
                if free.get("CPU", 0.0) == total.get("CPU", -1.0):
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
        finally:
            ray.shutdown()

    def close(self):
        if self.cluster is not None:
            self.cluster.shutdown()
        self.cluster = self.second = None


@pytest.fixture(scope="session")
def _session_cluster():
    holder = _SessionCluster()
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture
def two_node_cluster(_session_cluster):
    """A Ray cluster of two simulated nodes of 1 CPU each (the head and one more, which also offers a custom resource
    ``second``), idle when the test starts (the tests of one test worker share it: see ``_SessionCluster``), Ray
    disconnected however the test ends: ``(cluster, second node)``. A test may kill its actors or remove the second
    node. A recipe joins it with ``ray.address=<cluster.address>``."""
    ray = pytest.importorskip("ray")
    try:
        yield _session_cluster.ready()
    finally:
        if ray.is_initialized():
            ray.shutdown()
