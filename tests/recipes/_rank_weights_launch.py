"""``recipes/grpo_torchrl_rm.py`` as ``torchrun`` starts it, with each rank also writing its policy weights, at every
checkpoint, to ``<hydra.run.dir>/rank_weights/rank_<rank>.safetensors``: what the data-parallel tests compare (the
ranks must hold identical weights). Under ``distributed.strategy=fsdp`` the weights written are the full ones,
gathered from the shards, and ``rank_<rank>.json`` records how many parameter elements the rank itself holds
(``local_numel``) of how many in all (``full_numel``); ``rank_<rank>_reference.json`` and ``rank_<rank>_reward.json``
record the same of the frozen reference and reward models, as the collector is built (after any sharding). The recipe
is untouched; this wraps its check that the ranks agree and its collector's factory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

import recipes.grpo_torchrl_rm as recipe

RANK_WEIGHTS_FOLDER = "rank_weights"
check_ranks_in_sync = recipe.check_ranks_in_sync


make_collector = recipe.make_collector


def _rank_folder() -> tuple[Path, str]:
    run_dir = next(Path(arg.split("=", 1)[1]) for arg in sys.argv if arg.startswith("hydra.run.dir="))
    folder = run_dir / RANK_WEIGHTS_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    return folder, os.environ.get("RANK", "0")


def _sizes(parameters) -> dict[str, int]:
    # A sharded parameter is a DTensor: its local shard is what this rank holds, numel() counts the whole.
    return {
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in parameters),
        "full_numel": sum(p.numel() for p in parameters),
    }


def check_and_save_rank_weights(model) -> None:
    check_ranks_in_sync(model)
    folder, rank = _rank_folder()
    parameters = dict(model.named_parameters())
    # full_tensor() gathers a sharded parameter's whole.
    weights = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for name, p in parameters.items()
    }
    save_file(weights, folder / f"rank_{rank}.safetensors")
    (folder / f"rank_{rank}.json").write_text(json.dumps(_sizes(list(parameters.values()))))


def measure_frozen_models_and_make_collector(cfg, models, **kwargs):
    folder, rank = _rank_folder()
    for name, model in (("reference", models.reference), ("reward", models.reward_model)):
        if model is not None:
            (folder / f"rank_{rank}_{name}.json").write_text(json.dumps(_sizes(list(model.parameters()))))
    return make_collector(cfg, models, **kwargs)


if __name__ == "__main__":
    recipe.check_ranks_in_sync = check_and_save_rank_weights
    recipe.make_collector = measure_frozen_models_and_make_collector
    # Hydra finds the config relative to the recipe's file only when the recipe is the script run: say where it is.
    sys.argv[1:1] = ["--config-path", str(Path(recipe.__file__).resolve().parents[1] / "conf")]
    sys.argv.append("hydra.job.name=grpo_torchrl_rm")  # the recipe's log file name, not this script's
    recipe.main()
    recipe.end_processes()
