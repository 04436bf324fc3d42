"""A checkpoint whose training state is missing or damaged: a ConfigError naming the file and the way out."""

from __future__ import annotations

import pytest
import torch

from recipes.common.checkpoint import STATE_FILE, checkpoint_folder
from recipes.common.config import ConfigError
from recipes.grpo.checkpointing import load_training_state


def _checkpoints(root, steps):
    for step in steps:
        checkpoint_folder(root, step).mkdir(parents=True)
        torch.save({"step": step, "weights": torch.ones(3)}, checkpoint_folder(root, step) / STATE_FILE)


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty"])
def test_a_corrupted_state_names_the_file_and_the_previous_checkpoint(tmp_path, damage):
    _checkpoints(tmp_path, [2, 4])
    state = checkpoint_folder(tmp_path, 4) / STATE_FILE
    content = state.read_bytes()
    state.write_bytes(
        {"truncated": content[: len(content) // 2], "random bytes": b"\x80\x02junk" * 40, "empty": b""}[damage]
    )
    with pytest.raises(ConfigError) as error:
        load_training_state(checkpoint_folder(tmp_path, 4))
    message = str(error.value)
    assert f"{state} cannot be loaded" in message and "corrupted or truncated" in message
    assert f"Delete the corrupted checkpoint folder {checkpoint_folder(tmp_path, 4)} to resume from " in message
    assert str(checkpoint_folder(tmp_path, 2)) in message
    assert "weights_only=False" not in message  # torch's advice would run whatever code the file holds
    assert load_training_state(checkpoint_folder(tmp_path, 2))["step"] == 2


def test_the_only_checkpoint_corrupted_says_to_start_afresh(tmp_path):
    _checkpoints(tmp_path, [3])
    (checkpoint_folder(tmp_path, 3) / STATE_FILE).write_bytes(b"PK\x03\x04")
    with pytest.raises(ConfigError, match="No earlier checkpoint in .* holds a training state: start the run afresh"):
        load_training_state(checkpoint_folder(tmp_path, 3))


def test_a_missing_state_is_named(tmp_path):
    _checkpoints(tmp_path, [1])
    checkpoint_folder(tmp_path, 5).mkdir()
    pattern = f"The checkpoint {checkpoint_folder(tmp_path, 5)} has no {STATE_FILE}. Delete the corrupted"
    with pytest.raises(ConfigError, match=pattern):
        load_training_state(checkpoint_folder(tmp_path, 5))
