"""No secret reaches a run folder, a log or wandb in clear: settings read from the environment keep their
``${oc.env:...}`` text in what the run records, secrets given in clear (``+train.hub_token=hf_...``) are masked in the
resolved config, Hydra's own records, wandb's copy of the command line, and trl's pickled checkpoint config."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _small_runs import REPO_ROOT
from omegaconf import OmegaConf

from recipes.common.config import (
    config_record,
    hand_token_to_environment,
    mask_hydra_records,
    mask_secrets_in_text,
    resolved,
)


def test_the_record_keeps_environment_interpolations_and_masks_secrets_given_in_clear(monkeypatch):
    monkeypatch.setenv("PROBE_ID", "me/secret-repo")
    monkeypatch.setenv("PROBE_TOKEN", "hf_env_secret")
    cfg = OmegaConf.create(
        {
            "train": {"hub_token": "hf_clear_secret", "hub_model_id": "${oc.env:PROBE_ID}", "lr": 0.1},
            "logger": {"wandb": {"api_key": "${oc.env:PROBE_TOKEN}", "project": "p-${oc.env:PROBE_ID}"}},
            "rollout": {"generation": {"max_new_tokens": 8}},
        }
    )
    settled = resolved(cfg)
    assert settled.train.hub_model_id == "me/secret-repo", "the run itself reads the value"
    record = config_record(settled)
    assert record["train"] == {"hub_token": "<HUB_TOKEN>", "hub_model_id": "${oc.env:PROBE_ID}", "lr": 0.1}
    assert record["logger"]["wandb"] == {"api_key": "${oc.env:PROBE_TOKEN}", "project": "p-${oc.env:PROBE_ID}"}
    assert record["rollout"]["generation"]["max_new_tokens"] == 8, "max_new_tokens is not a token"


def test_command_lines_and_hydra_records_are_masked():
    assert mask_secrets_in_text("+train.hub_token=hf_x,data.num_train_prompts=16") == (
        "+train.hub_token=<HUB_TOKEN>,data.num_train_prompts=16"
    )
    assert mask_secrets_in_text("- +train.hub_token=hf_x") == "- +train.hub_token=<HUB_TOKEN>"
    assert mask_secrets_in_text("  hub_token: hf_x\n  lr: 1") == "  hub_token: <HUB_TOKEN>\n  lr: 1"
    assert mask_secrets_in_text("hub_token: null") == "hub_token: null"


def test_an_mcp_server_s_env_is_masked_whatever_its_names(tmp_path, monkeypatch):
    """tools.<label>.mcp.servers.<server>.env holds keys under names of the server's choosing (DB_URL, PORT): every
    value is masked in the record and in Hydra's records, command lines included; one read from the environment keeps
    its interpolation; the server's command and args stay readable."""
    monkeypatch.setenv("PROBE_KEY", "env-value-77")
    env = {"DB_URL": "pg://me:pw-31@db", "KEY": "${oc.env:PROBE_KEY}", "PORT": 5432}
    server = {"command": "python", "args": ["server.py"], "env": env}
    cfg = OmegaConf.create({"tools": {"calc": {"mcp": {"servers": {"calc": server}}}}})
    record = config_record(resolved(cfg))["tools"]["calc"]["mcp"]["servers"]["calc"]
    assert record == {
        "command": "python",
        "args": ["server.py"],
        "env": {"DB_URL": "<DB_URL>", "KEY": "${oc.env:PROBE_KEY}", "PORT": "<PORT>"},
    }
    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    (hydra / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    overrides = [
        "+tools.calc.mcp.servers.calc.env.DB_URL=pg://me:pw-31@db",
        "+tools.more.mcp={servers:{more:{command:x,env:{ORG:org-4242,KEY:${oc.env:PROBE_KEY}}}}}",
    ]
    (hydra / "overrides.yaml").write_text("".join(f"- {override}\n" for override in overrides))
    mask_hydra_records(tmp_path)
    written = (hydra / "config.yaml").read_text() + (hydra / "overrides.yaml").read_text()
    for secret in ("pw-31", "5432", "org-4242", "env-value-77"):
        assert secret not in written
    assert "DB_URL: <DB_URL>" in written and "KEY: ${oc.env:PROBE_KEY}" in written and "command: python" in written
    assert "ORG:<ORG>" in written


def test_trainer_configs_hand_their_token_to_the_environment_not_to_checkpoints(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    args = SimpleNamespace(hub_token="hf_x")
    hand_token_to_environment(args)
    assert args.hub_token is None and os.environ["HF_TOKEN"] == "hf_x"


TRL_ROLLOUTS_RUN = [
    "recipes/trl_grpo_torchrl_rollouts.py",
    "train.max_steps=2",
    "train.per_device_train_batch_size=8",
    "train.num_generations=4",
    "train.max_completion_length=8",
    "data.num_train_prompts=16",
    "rollout.prompts_per_draw=8",
]
REWARD_RUN = [
    "recipes/reward_trainer_from_buffer.py",
    "train.max_steps=2",
    "data.num_train_prompts=24",
    "data.num_eval_prompts=8",
]


# The reward recipe's run is slow: its candidate pairs are sampled and labelled before trl trains (about 20 s more).
@pytest.mark.parametrize(
    "run",
    [pytest.param(TRL_ROLLOUTS_RUN, id="trl_rollouts"), pytest.param(REWARD_RUN, id="reward", marks=pytest.mark.slow)],
)
def test_a_trl_run_given_a_token_in_clear_and_one_from_the_environment_writes_neither(tmp_path, run):
    """As a user types it (logger=wandb offline, trl checkpoints saved), in both recipes that hand ``train:`` to a trl
    trainer: no file of the run folder (``training_args.bin`` included), and not the log, holds either secret."""
    run_dir = tmp_path / "run"
    env = dict(
        os.environ,
        PROBE_REPO="me/probe-repo-4321",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    completed = subprocess.run(
        [
            sys.executable,
            *run,
            f"hydra.run.dir={run_dir}",
            "logger=wandb",
            "train.save_strategy=steps",
            "train.save_steps=1",
            "+train.hub_token=hf_clear_8765",
            "+train.hub_model_id=${oc.env:PROBE_REPO}",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert any(run_dir.glob("trainer/checkpoint-*/training_args.bin")) and any(run_dir.glob("wandb/*/*.wandb"))
    for secret in (b"hf_clear_8765", b"me/probe-repo-4321"):
        leaks = [str(path) for path in run_dir.rglob("*") if path.is_file() and secret in path.read_bytes()]
        assert not leaks, (secret, leaks)
        assert secret.decode() not in completed.stdout + completed.stderr
    record = (run_dir / "resolved_config.yaml").read_text()
    assert "hub_token: <HUB_TOKEN>" in record and "hub_model_id: ${oc.env:PROBE_REPO}" in record


@pytest.mark.parametrize("recipe", ["grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"])
def test_an_mcp_server_that_prints_its_key_as_it_fails_leaves_the_key_out_of_the_run_s_log(tmp_path, recipe):
    """Both GRPO recipes refuse a server that ends before answering, quoting its stderr (its reason), with the value
    of each of its env settings shown as its name: the run's log and output keep the reason, not the key."""
    pytest.importorskip("mcp")
    server = tmp_path / "server.py"
    server.write_text("import os, sys\nsys.exit(f\"refusing to start: API_KEY={os.environ['API_KEY']} is invalid\")\n")
    run_dir = tmp_path / "run"
    completed = subprocess.run(
        [
            sys.executable,
            f"recipes/{recipe}.py",
            f"hydra.run.dir={run_dir}",
            f"+tools.c.mcp.servers.c.command={sys.executable}",
            f"+tools.c.mcp.servers.c.args=[{server}]",
            "+tools.c.mcp.servers.c.env.API_KEY=sk-live-2468",
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 1
    log = (run_dir / f"{recipe}.log").read_text()
    assert "tools.c.mcp.servers.c: MCP server 'c'" in log and "API_KEY=<API_KEY> is invalid" in log
    leaks = [str(path) for path in run_dir.rglob("*") if path.is_file() and b"sk-live-2468" in path.read_bytes()]
    assert not leaks and "sk-live-2468" not in completed.stdout + completed.stderr
