"""Runs the reward recipe under ``accelerate launch --use_fsdp --fsdp_version 2`` on CPU processes (gloo).

accelerate 1.15 enables FSDP only for GPU-like devices: on ``MULTI_CPU`` it silently keeps DDP (every process holds
the whole model), although ``torch.distributed.fsdp.fully_shard`` works on CPU. This launcher lets the tests run the
recipe through accelerate's own FSDP2 path (``fsdp2_prepare_model``, its state-dict gathering) as a GPU launch runs
it: it makes accelerate take the FSDP plugin on CPU, then runs ``recipes/reward_trainer_from_buffer.py`` as
``__main__`` with the recipe's overrides. After training, each process writes how many of the model's parameters it
holds and in how many FSDP units to ``<run folder>/shards/rank<r>.json`` (``{"held": ..., "total": ..., "units":
...}``)::

    python -m accelerate.commands.launch --num_processes 2 --use_fsdp --fsdp_version 2 \
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP tests/recipes/_accelerate_fsdp_on_cpu.py seed=1
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from trl import RewardTrainer

import recipes.common.run

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reward_trainer_from_buffer.py"


def allow_fsdp_on_cpu() -> None:
    """From now on, an ``Accelerator`` built with an FSDP plugin (``--use_fsdp``) shards on CPU processes too, and the
    recipe's check of that limit (``recipes.common.run.accelerate_shards_on``) knows it."""
    build = AcceleratorState.__init__

    def build_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        build(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # The Accelerator passes the plugin it built from --use_fsdp's environment; later bare calls pass none.
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = build_with_fsdp_on_cpu
    recipes.common.run.accelerate_shards_on = lambda device: True


def record_shard_sizes() -> None:
    """Makes every ``trl.RewardTrainer`` write, once trained, the parameters its process holds (a sharded parameter's
    local slice) against the model's total."""
    train = RewardTrainer.train

    def train_and_record(self, *args, **kwargs):
        result = train(self, *args, **kwargs)
        params = list(self.model.parameters())
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        folder = Path(self.args.output_dir).parent / "shards"  # the conf puts trl's output_dir in the run folder
        folder.mkdir(exist_ok=True)
        units = sum(isinstance(module, FSDPModule) for module in self.model.modules())
        sizes = {"held": held, "total": sum(p.numel() for p in params), "units": units}
        (folder / f"rank{self.args.process_index}.json").write_text(json.dumps(sizes))
        return result

    RewardTrainer.train = train_and_record


if __name__ == "__main__":
    allow_fsdp_on_cpu()
    record_shard_sizes()
    sys.argv = [str(RECIPE), *sys.argv[1:]]
    runpy.run_path(str(RECIPE), run_name="__main__")
