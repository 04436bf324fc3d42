"""No secret reaches a run folder, a log or wandb in clear: settings read from the environment keep their
``${oc.env:...}`` text in what the run records, secrets given in clear (``+train.hub_token=hf_...``) are masked in the
resolved config, Hydra's own records, wandb's copy of the command line, and trl's pickled checkpoint config."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _in_process import run_script
from _small_runs import GRPO_SMALL, MCP_MULTIPLY, REPO_ROOT, SMALL_CALCULATOR, TRL_SMALL
from omegaconf import OmegaConf

from recipes.common.config import (
    ConfigError,
    config_record,
    hand_token_to_environment,
    is_secret_key,
    mask_hydra_records,
    mask_secrets_in_text,
    resolved,
)
from recipes.common.resume import resumed_config


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
    assert "env:{ORG:'<ORG>'" in written, "still an override Hydra reads"


def test_trainer_configs_hand_their_token_to_the_environment_not_to_checkpoints(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    args = SimpleNamespace(hub_token="hf_x")
    hand_token_to_environment(args)
    assert args.hub_token is None and os.environ["HF_TOKEN"] == "hf_x"


TRL_ROLLOUTS_RUN = [
    "recipes/trl_grpo_torchrl_rollouts.py",
    "train.max_steps=2",
    "train.per_device_train_batch_size=8",
    "rollout.group_size=4",
    "rollout.generation.max_new_tokens=8",
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
def test_a_trl_run_given_a_token_in_clear_and_one_from_the_environment_writes_neither(tmp_path, capfd, run):
    """As a user types it (logger=wandb offline, trl checkpoints saved), in both recipes that hand ``train:`` to a trl
    trainer: no file of the run folder (``training_args.bin`` included), and not the log, holds either secret. (The
    recipe's command line in this process: what its own process would print is tested by the refused run below.)"""
    run_dir = tmp_path / "run"
    env = dict(
        PROBE_REPO="me/probe-repo-4321",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    returncode = run_script(
        *run,
        f"hydra.run.dir={run_dir}",
        "logger=wandb",
        "train.save_strategy=steps",
        "train.save_steps=1",
        "+train.hub_token=hf_clear_8765",
        "+train.hub_model_id=${oc.env:PROBE_REPO}",
        env=env,
    )
    output = capfd.readouterr()
    assert returncode == 0, output.err[-3000:]
    assert any(run_dir.glob("trainer/checkpoint-*/training_args.bin")) and any(run_dir.glob("wandb/*/*.wandb"))
    for secret in (b"hf_clear_8765", b"me/probe-repo-4321"):
        leaks = [str(path) for path in run_dir.rglob("*") if path.is_file() and secret in path.read_bytes()]
        assert not leaks, (secret, leaks)
        assert secret.decode() not in output.out + output.err
    record = (run_dir / "resolved_config.yaml").read_text()
    assert "hub_token: <HUB_TOKEN>" in record and "hub_model_id: ${oc.env:PROBE_REPO}" in record


def test_misspelt_and_camel_cased_secret_names_are_secrets_and_names_of_counts_and_fields_are_not():
    for name in ("hub_tokn", "api_secert", "db_pasword", "accessToken", "key", "DB_PASS", "passwd", "HF_TOKEN"):
        assert is_secret_key(name), name
    for name in ("max_new_tokens", "chosen_tokens", "reward_key", "text_key", "pad_token_id", "exclude_keys", "url"):
        assert not is_secret_key(name), name


def test_a_tokenizer_s_special_tokens_are_recorded_readable_and_resume_as_they_are(tmp_path):
    """trl's RewardConfig takes eos_token: a word of the vocabulary, not a credential. Masked, it would also be
    refused on resume as a secret to give again."""
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "overwrite": False, "train": {"eos_token": "<|im_end|>"}})
    record = config_record(resolved(cfg))
    assert record["train"] == {"eos_token": "<|im_end|>"}
    OmegaConf.save(OmegaConf.create(record), tmp_path / "resolved_config.yaml")
    assert resumed_config(cfg, has_checkpoint=True).train.eos_token == "<|im_end|>"


def test_a_tool_factory_s_key_argument_and_a_url_s_password_are_masked_in_the_record():
    """A tool built by a ``_target_`` factory takes its settings as arguments: ``key`` is a secret by its name, and a
    URL's password is masked wherever the URL is (its user, host and path stay readable)."""
    factory = {"_target_": "tests._tool_functions.make_lookup", "key": "sk-4444", "url": "https://me:pw-5555@db.x/y"}
    cfg = OmegaConf.create({"tools": {"lookup": {"function": factory}, "timeout_s": 10}})
    record = config_record(resolved(cfg))["tools"]
    assert record == {
        "lookup": {
            "function": {
                "_target_": "tests._tool_functions.make_lookup",
                "key": "<KEY>",
                "url": "https://me:<PASSWORD>@db.x/y",
            }
        },
        "timeout_s": 10,
    }


def test_hydra_s_records_mask_each_override_whole_as_hydra_parses_it(tmp_path):
    """A quoted value holding ``,`` or ``]`` is one value to Hydra: it is masked whole in ``overrides.yaml``, in
    ``hydra.yaml``'s task list and in its ``override_dirname`` (rebuilt from the masked overrides, as Hydra builds it);
    the other overrides stay as typed."""
    task = [
        '+train.hub_token="hf_a,TAIL_1111"',
        "+train.hub_tokn='hf_b]TAIL_2222'",
        '+tools.c.mcp.servers.c.env.DB_PASS="pw,TAIL_3333"',
        "seed=0",
    ]
    dirname = ",".join(sorted(task))
    hydra = {
        "overrides": {"hydra": ["hydra.run.dir=out"], "task": task},
        "job": {"override_dirname": dirname, "config": {"override_dirname": {"kv_sep": "=", "item_sep": ","}}},
    }
    folder = tmp_path / ".hydra"
    folder.mkdir()
    OmegaConf.save(OmegaConf.create({"hydra": hydra}), folder / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(task), folder / "overrides.yaml")
    mask_hydra_records(tmp_path)
    records = OmegaConf.load(folder / "hydra.yaml").hydra, OmegaConf.load(folder / "overrides.yaml")
    written = (folder / "hydra.yaml").read_text() + (folder / "overrides.yaml").read_text()
    assert "TAIL" not in written and "hf_" not in written and "pw," not in written
    masked = [
        "+train.hub_token='<HUB_TOKEN>'",
        "+train.hub_tokn='<HUB_TOKN>'",
        "+tools.c.mcp.servers.c.env.DB_PASS='<DB_PASS>'",
        "seed=0",
    ]
    assert list(records[0].overrides.task) == list(records[1]) == masked
    assert records[0].job.override_dirname == ",".join(sorted(masked))
    assert list(records[0].overrides.hydra) == ["hydra.run.dir=out"]


# As a shell passes them: a token holding `,`, a token under a misspelt name (trl has no such field: the run is refused)
# holding `]`, an MCP server's password holding `,`, a tool built by a factory from an API key and a database URL.
TYPED_WITH_SECRETS = [
    '+train.hub_token="hf_a,TAIL_1111"',
    '+train.hub_tokn="hf_b]TAIL_2222"',
    '+tools.c.mcp.servers.c.env.DB_PASS="pw,TAIL_3333"',
    "+tools.lookup.function={_target_:tests._tool_functions.make_lookup,key:sk-4444,"
    "url:'https://me:pw-5555@db.example/x'}",
]
SECRET_PARTS = ["TAIL_1111", "TAIL_2222", "TAIL_3333", "sk-4444", "pw-5555"]


def test_a_refused_run_keeps_no_secret_of_its_command_line_in_its_folder_or_output(tmp_path):
    """The run is refused (train.hub_tokn), and neither its folder (Hydra's ``.hydra/`` records, its log) nor what it
    prints holds any part of a secret; what is not secret reads as typed."""
    run_dir = tmp_path / "run"
    completed = subprocess.run(
        [
            sys.executable,
            "recipes/trl_grpo_torchrl_rollouts.py",
            f"hydra.run.dir={run_dir}",
            "train.max_steps=1",
            f"+tools.c.mcp.servers.c.command={sys.executable}",
            *TYPED_WITH_SECRETS,
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 1 and "train.hub_tokn: trl.GRPOConfig has no such field" in output
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert {path.name for path in files} >= {"config.yaml", "hydra.yaml", "overrides.yaml"}
    for secret in SECRET_PARTS:
        leaks = [str(path) for path in files if secret.encode() in path.read_bytes()]
        assert not leaks, (secret, leaks)
        assert secret not in output
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "- train.max_steps=1\n" in overrides and "+train.hub_token='<HUB_TOKEN>'" in overrides
    assert "key:'<KEY>',url:'https://me:<PASSWORD>@db.example/x'" in overrides
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "hub_tokn: <HUB_TOKN>" in config and "DB_PASS: <DB_PASS>" in config and "max_steps: 1" in config


# A sweep of two one-step jobs per recipe, a secret on its command line: the GRPO recipe's under an MCP server's env
# (the calculator task's multiply served over MCP).
SWEEPS = {
    "trl_grpo_torchrl_rollouts": [
        *[setting for setting in TRL_SMALL if not setting.startswith("train.max_steps=")],
        "train.max_steps=1",
        "+train.hub_token=hf_sweep_7777",
    ],
    "reward_trainer_from_buffer": [*REWARD_RUN[1:], "+train.hub_token=hf_sweep_7777"],
    "grpo_torchrl_rm": [
        *GRPO_SMALL,
        *SMALL_CALCULATOR,
        "train.steps=1",
        "~tools.multiply",
        *MCP_MULTIPLY,
        "+tools.calc.mcp.servers.calc.env.API_KEY=hf_sweep_7777",
    ],
}


@pytest.mark.parametrize(
    "recipe",
    [
        "grpo_torchrl_rm",
        # Out of CI (pytest -m extended): the reward recipe's sweep masks its folder with the code the other two use,
        # and CI's test_a_sweep_preset_names_each_wandb_run_by_its_overrides_masked sweeps it with a secret too.
        pytest.param("reward_trainer_from_buffer", marks=pytest.mark.extended),
        "trl_grpo_torchrl_rollouts",
    ],
)
def test_a_sweep_that_succeeds_keeps_its_secret_out_of_the_sweep_folder_and_its_output(tmp_path, capfd, recipe):
    """Hydra writes the sweep's ``multirun.yaml`` (the composed config, the task overrides, ``override_dirname``)
    before any job runs: the jobs mask it, as they mask their own folders. Nothing under the sweep folder, and nothing
    the sweep prints, holds the secret; ``multirun.yaml`` still says what was swept. (The sweep's command line in this
    process, Hydra's launcher included; tests/recipes/test_sweeps.py starts sweeps as processes.)"""
    sweep_dir = tmp_path / "sweep"
    returncode = run_script(
        f"recipes/{recipe}.py",
        "-m",
        "seed=0,1",
        *SWEEPS[recipe],
        f"hydra.sweep.dir={sweep_dir}",
        env=dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )
    output = capfd.readouterr()
    assert returncode == 0, output.err[-3000:]
    assert all((sweep_dir / job / "summary.json").is_file() for job in ("0", "1"))
    leaks = [str(path) for path in sweep_dir.rglob("*") if path.is_file() and b"hf_sweep_7777" in path.read_bytes()]
    assert not leaks
    assert "hf_sweep_7777" not in output.out + output.err
    multirun = OmegaConf.load(sweep_dir / "multirun.yaml")
    assert "seed=0,1" in multirun.hydra.overrides.task and "seed=0,1" in multirun.hydra.job.override_dirname


@pytest.mark.parametrize("recipe", ["grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"])
def test_an_mcp_server_that_prints_its_key_as_it_fails_leaves_the_key_out_of_the_run_s_log(tmp_path, capfd, recipe):
    """Both GRPO recipes refuse a server that ends before answering, quoting its stderr (its reason), with the value
    of each of its env settings shown as its name: the run's log and output keep the reason, not the key. (The
    recipe's command line in this process; the server is a process of its own, as in a user's run.)"""
    pytest.importorskip("mcp")
    server = tmp_path / "server.py"
    server.write_text("import os, sys\nsys.exit(f\"refusing to start: API_KEY={os.environ['API_KEY']} is invalid\")\n")
    run_dir = tmp_path / "run"
    returncode = run_script(
        f"recipes/{recipe}.py",
        f"hydra.run.dir={run_dir}",
        f"+tools.c.mcp.servers.c.command={sys.executable}",
        f"+tools.c.mcp.servers.c.args=[{server}]",
        "+tools.c.mcp.servers.c.env.API_KEY=sk-live-2468",
        env=dict(HF_HUB_OFFLINE="1"),
    )
    output = capfd.readouterr()
    assert returncode == 1
    log = (run_dir / f"{recipe}.log").read_text()
    assert "tools.c.mcp.servers.c: MCP server 'c'" in log and "API_KEY=<API_KEY> is invalid" in log
    leaks = [str(path) for path in run_dir.rglob("*") if path.is_file() and b"sk-live-2468" in path.read_bytes()]
    assert not leaks and "sk-live-2468" not in output.out + output.err


def test_a_resume_refuses_a_url_whose_password_the_record_masks(tmp_path):
    """resolved_config.yaml keeps a URL's password as <PASSWORD>: a resume would otherwise connect with that text."""
    record = {"output_dir": str(tmp_path), "overwrite": False, "db": {"urls": ["https://me:<PASSWORD>@db.x/y"]}}
    OmegaConf.save(OmegaConf.create(record), tmp_path / "resolved_config.yaml")
    cfg = OmegaConf.create({**record, "db": {"urls": ["https://me:pw-5555@db.x/y"]}})
    with pytest.raises(ConfigError, match=r"db\.urls\.0 is masked in .*resolved_config.yaml \(https://me:<PASSWORD>@"):
        resumed_config(cfg, has_checkpoint=True)


def test_a_sweep_preset_names_each_wandb_run_by_its_overrides_masked(tmp_path, capfd):
    """sweep=reward_lr_seed names each job's wandb run ${hydra:job.override_dirname}, the job's overrides as typed: the
    name the run records (resolved_config.yaml, wandb) shows a token holding `,` masked whole, the rest readable.
    (The sweep's command line in this process.)"""
    sweep_dir = tmp_path / "sweep"
    returncode = run_script(
        "recipes/reward_trainer_from_buffer.py",
        "-m",
        "sweep=reward_lr_seed",
        "hydra.sweeper.params={seed:0}",  # the preset's two learning rates, one seed
        *REWARD_RUN[1:],
        '+train.hub_token="hf_a,TAIL_6666"',
        f"hydra.sweep.dir={sweep_dir}",
        env=dict(HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true"),
    )
    assert returncode == 0, capfd.readouterr().err[-3000:]
    leaks = [str(path) for path in sweep_dir.rglob("*") if path.is_file() and b"TAIL_6666" in path.read_bytes()]
    assert not leaks and any(sweep_dir.glob("*/wandb/*/*.wandb"))
    name = OmegaConf.load(sweep_dir / "0" / "resolved_config.yaml").logger.wandb.name
    assert name.startswith("+train.hub_token='<HUB_TOKEN>',data.num_eval_prompts=8,") and "seed=0" in name
