"""Model folders without weights, with pickled weights or with damaged ones: a ConfigError naming the folder and file,
at validation (before anything loads) and at load time."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from recipes.common.checkpoint import STATE_FILE, checkpoint_folder
from recipes.common.config import ConfigError
from recipes.common.models import load_causal_lm, load_reward_model, validate_model_node


def _node(folder):
    return OmegaConf.create({"name_or_path": str(folder), "tokenizer_name_or_path": None, "trust_remote_code": False})


@pytest.fixture
def policy_copy(tiny_dir, tmp_path):
    """A copy of the tiny policy folder, free to damage."""
    return shutil.copytree(tiny_dir / "policy", tmp_path / "policy")


def test_a_folder_without_weights_is_refused_at_validation(policy_copy):
    (policy_copy / "model.safetensors").unlink()
    pattern = f"model.name_or_path='{policy_copy}' has a config.json but no weights: neither model.safetensors"
    with pytest.raises(ConfigError, match=pattern):
        validate_model_node(_node(policy_copy), key="model", kind="policy")


def test_pickled_weights_are_refused_with_the_conversion(policy_copy):
    (policy_copy / "model.safetensors").rename(policy_copy / "pytorch_model.bin")
    with pytest.raises(ConfigError) as error:
        validate_model_node(_node(policy_copy), key="reward_model")
    message = str(error.value)
    assert f"reward_model.name_or_path='{policy_copy}' holds its weights as pytorch_model.bin" in message
    assert "loads safetensors only" in message and "save_pretrained(folder, safe_serialization=True)" in message


def test_missing_shards_are_listed(policy_copy):
    (policy_copy / "model.safetensors").rename(policy_copy / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (policy_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError, match=r"lists 1 shard\(s\) that are not there \(\['model-00002-of-00002"):
        validate_model_node(_node(policy_copy), key="model")


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty"])
def test_corrupted_weights_are_named_at_validation_and_at_load(policy_copy, damage):
    weights = policy_copy / "model.safetensors"
    content = weights.read_bytes()
    damaged = {
        "truncated": content[: len(content) // 2],
        "random bytes": random.Random(0).randbytes(4096),
        "empty": b"",
    }
    weights.write_bytes(damaged[damage])
    pattern = f"model.name_or_path='{policy_copy}': {weights}: corrupted or truncated .*Re-download it, or re-save"
    with pytest.raises(ConfigError, match=pattern):
        validate_model_node(_node(policy_copy), key="model", kind="policy")
    with pytest.raises(ConfigError, match=pattern):
        load_causal_lm(_node(policy_copy), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="reward_model.name_or_path=.*corrupted or truncated"):
        load_reward_model(_node(policy_copy), device="cpu", dtype="float32", trained=False)


def test_a_damaged_config_json_is_named(policy_copy):
    (policy_copy / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"],')
    with pytest.raises(ConfigError, match=f"model.name_or_path='{policy_copy}': config.json is not valid JSON"):
        validate_model_node(_node(policy_copy), key="model")


def test_a_checkpoint_with_corrupted_weights_points_at_the_previous_checkpoint(tiny_dir, tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        shutil.copytree(tiny_dir / "policy", checkpoint_folder(root, step) / "model")
        torch.save({"step": step}, checkpoint_folder(root, step) / STATE_FILE)
    (checkpoint_folder(root, 4) / "model" / "model.safetensors").write_bytes(b"\x00" * 16)
    pattern = (
        f"Delete the corrupted checkpoint folder {checkpoint_folder(root, 4)} to resume from "
        f"{checkpoint_folder(root, 2)}"
    )
    with pytest.raises(ConfigError, match=pattern):
        load_causal_lm(_node(checkpoint_folder(root, 4) / "model"), device="cpu", dtype="float32")


def test_a_safetensors_error_inside_from_pretrained_is_named(policy_copy, monkeypatch):
    """What the header check cannot see (a hub download, a file damaged after validation) is caught at load time."""
    weights = policy_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.setattr("recipes.common.models._check_weights", lambda folder, *, key: None)
    with pytest.raises(ConfigError, match="model.name_or_path=.*: its safetensors weights: corrupted or truncated"):
        load_causal_lm(_node(policy_copy), device="cpu", dtype="float32")


def test_a_model_of_its_own_code_names_trust_remote_code(policy_copy):
    config = json.loads((policy_copy / "config.json").read_text())
    config.update({"model_type": "my_own_model", "auto_map": {"AutoModelForCausalLM": "modeling_mine.MyModel"}})
    (policy_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"defines its model in code of its own .* set model.trust_remote_code=true"):
        validate_model_node(_node(policy_copy), key="model", kind="policy")


def test_a_hub_id_the_hub_cannot_serve_is_refused_at_once(monkeypatch):
    import recipes.common.config as config

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(config, "hub_reachable", lambda: False)  # as on a machine without network; nothing is sent
    with pytest.raises(ConfigError, match=r"the hub \(huggingface.co\) cannot be reached from here.*HF_HUB_OFFLINE=1"):
        validate_model_node(_node("someone/some-model"), key="model", kind="policy")


def test_a_tokenizer_with_ids_past_the_model_vocabulary_is_refused(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    from recipes.common.models import check_tokenizer_fits_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "reward_model")
    # A pad token added without resizing the model's embeddings: every padded batch would index past them.
    tokenizer.add_special_tokens({"pad_token": "<a_new_pad>"})
    tokenizer.save_pretrained(tmp_path / "bigger")
    node = OmegaConf.create(
        {
            "name_or_path": str(tiny_dir / "reward_model"),
            "tokenizer_name_or_path": str(tmp_path / "bigger"),
            "trust_remote_code": False,
        }
    )
    with pytest.raises(
        ConfigError, match=r"reward_model: the tokenizer of .* gives ids up to \d+, but the model .* embeds"
    ):
        check_tokenizer_fits_model(node, key="reward_model")
    check_tokenizer_fits_model(_node(tiny_dir / "reward_model"), key="reward_model")
