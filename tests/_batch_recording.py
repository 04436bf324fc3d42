"""What each process of a reward run trains on, recorded by the tests: ``<run folder>/batches/rank<r>.jsonl``.

One JSON line per micro-batch trl's collator assembles, in the order the process trains on them:
``[[chosen_ids, rejected_ids], ...]``. The dataloader prefetches: the last line of a run may be a batch that was
collated and never trained on.

In-process tests call :func:`install_batch_recorder` with ``monkeypatch.setattr`` (undone after the test). A run
under ``accelerate launch`` / ``torchrun`` starts this file in place of the recipe, with the recipe's overrides; it
installs the recorder and runs ``recipes/reward_trainer_from_buffer.py`` as ``__main__``, as a user's launch does::

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 tests/_batch_recording.py seed=1
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from trl import RewardTrainer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "reward_trainer_from_buffer.py"


def batches_file(args) -> Path:
    """Where the process of ``args`` (trl's ``RewardConfig``) records.

    The conf puts trl's ``output_dir`` in the run folder, and the recipe gives every process the main process's: the
    processes of one launch record side by side even when Hydra gave each a folder of its own.
    """
    return Path(args.output_dir).parent / "batches" / f"rank{args.process_index}.jsonl"


def _recording(collator, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")

    def record_and_collate(examples: list[dict]) -> dict:
        with open(path, "a") as handle:
            handle.write(json.dumps([[e["chosen_ids"], e["rejected_ids"]] for e in examples]) + "\n")
        return collator(examples)

    return record_and_collate


def install_batch_recorder(patch=setattr) -> None:
    """Makes every ``trl.RewardTrainer`` built from now on record its micro-batches (:func:`batches_file`).

    ``patch``: how ``RewardTrainer.__init__`` is replaced; ``monkeypatch.setattr`` restores it after the test.
    """
    build = RewardTrainer.__init__

    def build_and_record(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.data_collator = _recording(self.data_collator, batches_file(self.args))

    patch(RewardTrainer, "__init__", build_and_record)


if __name__ == "__main__":
    install_batch_recorder()
    # Started as a script, this folder comes first on sys.path, where tests/recipes would stand in for the project's
    # recipes package: the recipe runs with the repository first, as `python recipes/...` runs it.
    sys.path[0] = str(RECIPE.parents[1])
    sys.argv = [str(RECIPE), *sys.argv[1:]]
    runpy.run_path(str(RECIPE), run_name="__main__")
