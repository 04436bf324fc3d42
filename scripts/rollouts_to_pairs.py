"""Preference pairs from the rollouts a GRPO run stored: the best and the worst completion of each group.

    python recipes/trl_grpo_torchrl_rollouts.py hydra.run.dir=outputs/trl_rollouts
    python scripts/rollouts_to_pairs.py outputs/trl_rollouts/rollouts --out outputs/pairs.jsonl
    python recipes/reward_trainer_from_buffer.py data=file data.path=outputs/pairs.jsonl

Reads ``<run dir>/rollouts`` (``recipes.trl_grpo.rollout_store.load_rollouts``: every process's rows, oldest
first). A group is the completions trl sampled for one prompt in one step (consecutive rows of a process with the same
prompt). Each group whose best and worst rewards differ by at least ``--min-gap`` gives one pair, in trl's
conversational preference format: ``{"prompt": [the whole prompt: system message, earlier turns, the request],
"chosen": [assistant message], "rejected": [...]}``, the format ``reward_trainer_from_buffer.py data=file`` reads.
``--steps-from N`` keeps the groups of step N onwards. A completion or prompt whose stored text was cut at the store's
``max_text_bytes`` is left out (a pair of cut texts would teach the reward model the cut), and counted. ``--out``
never replaces a file of a run folder, nor lands among its records (``recipes.common.run_folder``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def groups(rows) -> list[list[int]]:
    """Row indices of each group: consecutive rows of one process and step with the same prompt."""
    from recipes.trl_grpo.rollout_store import texts

    prompts = texts(rows, "prompt")
    steps, ranks = rows["step"].tolist(), rows["rank"].tolist()
    found: list[list[int]] = []
    for index, key in enumerate(zip(ranks, steps, prompts, strict=True)):
        if found and index - 1 == found[-1][-1] and key == (ranks[index - 1], steps[index - 1], prompts[index - 1]):
            found[-1].append(index)
        else:
            found.append([index])
    return found


def best_and_worst_pairs(rows, *, min_gap: float, steps_from: int) -> tuple[list[dict], int]:
    """The pairs, and the number of completions left out because their text (or their prompt's) was cut."""
    from recipes.trl_grpo.rollout_store import prompts, texts, texts_cut

    completions = texts(rows, "completion")
    cut = [a or b for a, b in zip(texts_cut(rows, "completion"), texts_cut(rows, "prompt"), strict=True)]
    rewards, steps = rows["reward"].tolist(), rows["step"].tolist()
    pairs, left_out = [], 0
    for group in groups(rows):
        left_out += sum(cut[i] for i in group if steps[i] >= steps_from)
        scored = [i for i in group if not math.isnan(rewards[i]) and steps[i] >= steps_from and not cut[i]]
        if len(scored) < 2:
            continue
        best, worst = max(scored, key=rewards.__getitem__), min(scored, key=rewards.__getitem__)
        if rewards[best] - rewards[worst] < min_gap or completions[best] == completions[worst]:
            continue
        prompt = prompts(rows[best : best + 1])[0]
        pairs.append(
            {
                "prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                "chosen": [{"role": "assistant", "content": completions[best]}],
                "rejected": [{"role": "assistant", "content": completions[worst]}],
            }
        )
    return pairs, left_out


def _refuse_output_inside(rollouts: Path, out: Path) -> None:
    """No script writes into its input: a file of the storage it reads would be overwritten."""
    folder, target = rollouts.resolve(), out.resolve()
    if target == folder or folder in target.parents:
        raise SystemExit(
            f"rollouts_to_pairs: --out {out} is inside the rollouts folder it reads ({rollouts}); writing there could "
            "overwrite the storage's own files. Write the pairs elsewhere, e.g. --out pairs.jsonl."
        )


def _refuse_replacing_run_files(out: Path) -> None:
    """A run folder's files are the run's own: pairs written over its model's config.json or its summary.json would
    leave a model that no longer loads, a run that no longer resumes."""
    from recipes.common.run_folder import RECORDS, run_folder_holding

    folder = run_folder_holding(out.parent)
    if folder is None:
        return
    target = out.resolve()
    record = target.relative_to(folder).parts[0] if target != folder else None
    if target.exists():
        problem = f"would replace {target}, a file of the run folder {folder}"
    elif record in RECORDS:
        problem = f"would write among the records of the run folder {folder} ({record}: a run rewrites or clears them)"
    else:
        return
    raise SystemExit(
        f"rollouts_to_pairs: --out {out} {problem}. Write the pairs outside the run's files, e.g. "
        f"--out {folder.parent / 'pairs.jsonl'}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rollouts", type=Path, help="a run's rollouts/ folder")
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines file of pairs to write")
    parser.add_argument("--min-gap", type=float, default=1e-6, help="the smallest reward gap a pair keeps")
    parser.add_argument("--steps-from", type=int, default=1, help="only the groups of this step onwards")
    args = parser.parse_args(argv)
    _refuse_output_inside(args.rollouts, args.out)
    _refuse_replacing_run_files(args.out)

    from recipes.trl_grpo.rollout_store import DamagedRollouts, load_rollouts

    try:
        rows = load_rollouts(args.rollouts)
        pairs, left_out = best_and_worst_pairs(rows, min_gap=args.min_gap, steps_from=args.steps_from)
    except (FileNotFoundError, DamagedRollouts) as error:
        raise SystemExit(f"rollouts_to_pairs: {error}") from None
    if left_out:
        print(
            f"rollouts_to_pairs: {left_out} completions left out: their text or their prompt's was cut at the store's "
            "max_text_bytes (raise rollout.store.max_text_bytes in the run to keep them).",
            file=sys.stderr,
        )
    if not pairs:
        raise SystemExit(f"rollouts_to_pairs: no group of {args.rollouts} has two completions whose rewards differ.")
    if not args.out.parent.is_dir():
        raise SystemExit(f"rollouts_to_pairs: --out {args.out}: no folder {args.out.parent}; create it first.")
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    partial.replace(args.out)
    print(f"{len(pairs)} pairs from {rows.shape[0]} stored completions written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
