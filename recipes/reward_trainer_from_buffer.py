"""Reward-model training from a TorchRL preference buffer with trl's ``RewardTrainer``, end to end.

1. Pairs. ``data=synthetic``: the policy (``model=``, TorchRL's ``TransformersWrapper``) samples several responses per
   prompt in single-turn ``ChatEnv`` rollouts (``recipes.common.rollout``, as the GRPO recipe does), and the labeler
   (``labeler._target_``, the synthetic oracle by default) turns them into chosen/rejected pairs, dropping ties.
   ``data=file|hf``: pairs in trl's preference formats (explicit or implicit prompt, text or conversational).
   Held-out pairs (eval prompts, the eval split or a held-out fraction) never enter the buffer.
2. Buffer. The pairs are tokenized once for the reward model, with trl's own convention (trl then skips its
   tokenization), into a TorchRL ``ReplayBuffer``: ``buffer=lazy_tensor`` in memory, or ``buffer=memmap`` on disk
   next to the labelled text, which a later run reuses with ``buffer.load_from`` (no generation, no labelling): it
   trains from the stored token ids when its reward model's tokenizer wrote them, from the re-tokenized text
   otherwise; a cut or damaged folder is refused. Pairs whose chosen and rejected are identical are dropped.
3. Training. ``RewardTrainer`` (``RewardConfig`` from ``train:``) reads the buffer through
   ``interop.TorchRLBufferDataset(...).as_hf_dataset()``: one draw without replacement per epoch.
4. Evaluation of the saved model, reloaded with ``from_pretrained`` and scored through
   ``interop.HFRewardModelWrapper(tokenizer=...)`` as the GRPO recipe scores: pairwise accuracy and margin on the
   held-out pairs and, on the synthetic task, the Spearman correlation of its scores with the oracle's. Like
   training, it keeps to sequences of at most ``train.max_length`` tokens (trl drops longer pairs).

Several processes (``accelerate launch`` / ``torchrun``): the main process makes the labelled pairs and hands them to
the others; every process fills the same buffer, whose sampler draws from its own generator seeded with ``seed``, so
all processes see one stream of pairs and accelerate gives each its own slice of every step (trl reads iterable
datasets with ``dispatch_batches=False``): no pair twice in an optimizer step, which takes
``per_device_train_batch_size * gradient_accumulation_steps * processes`` pairs. Only the main process writes the
buffer folder, the model, metrics and ``summary.json``, and evaluates.

    python recipes/reward_trainer_from_buffer.py
    python recipes/reward_trainer_from_buffer.py -m seed=0,1,2 train.learning_rate=1e-3,3e-3
    accelerate launch --multi_gpu --num_processes 2 recipes/reward_trainer_from_buffer.py hydra.run.dir=outputs/rm2
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes.common.checkpoint import recover_interrupted_writes, save_model_folder, write_folder_atomically
from recipes.common.config import ConfigError, check_run_settings, run_config, write_run_config
from recipes.common.data import load_preference_pairs, load_prompts, prompt_text
from recipes.common.distributed import setup_data_parallel
from recipes.common.logging import MetricLogger, make_logger
from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer, validate_model_node
from recipes.common.run import run_recipe
from recipes.common.run_folder import check_output_folder, clear_records

STORAGES = ("lazy_tensor", "memmap")
log = logging.getLogger(__name__)
# A labelled-data folder (buffer.path / buffer.load_from)
TRAIN_PAIRS_FILE, EVAL_PAIRS_FILE, EVAL_RESPONSES_FILE = "pairs.jsonl", "eval_pairs.jsonl", "eval_responses.jsonl"
STORAGE_FOLDER, META_FILE = "storage", "meta.json"


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that run before any model, tokenizer or dataset loads."""
    max_steps = (
        None if "max_steps" not in cfg.train or OmegaConf.is_missing(cfg.train, "max_steps") else cfg.train.max_steps
    )
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps <= 0:
        raise ConfigError(
            f"train.max_steps={max_steps!r}: RewardTrainer reads the buffer "
            "as a stream (an IterableDataset with no length), so the number of optimizer steps must be given. Set "
            "train.max_steps=<positive int>, e.g. train.max_steps=300."
        )
    if cfg.buffer.storage not in STORAGES:
        raise ConfigError(f"buffer.storage={cfg.buffer.storage!r}: expected one of {STORAGES} (buffer=memmap ...).")
    if cfg.buffer.storage == "memmap" and cfg.buffer.path is None:
        raise ConfigError("buffer=memmap needs buffer.path, the folder its pairs are written to.")
    if cfg.buffer.load_from is not None:
        _read_meta(Path(cfg.buffer.load_from).expanduser())  # the rest of the folder is checked as it loads
    elif cfg.data.source == "synthetic":
        validate_model_node(cfg.model, key="model", kind="policy")
        if cfg.generation.responses_per_prompt < 2:
            raise ConfigError(
                f"generation.responses_per_prompt={cfg.generation.responses_per_prompt}: a preference pair needs two "
                "responses to the same prompt; use 2 or more."
            )
    elif cfg.margin_in_loss:
        raise ConfigError(
            f"margin_in_loss=true, but data={cfg.data.source} pairs carry no margin; set margin_in_loss=false."
        )
    check_output_folder(cfg.output_dir, overwrite=cfg.overwrite)
    check_run_settings(
        cfg,
        lr_key="train.learning_rate",
        max_grad_norm_key="train.max_grad_norm",
        batch_size_key="train.per_device_train_batch_size",
    )
    if not 0.0 < cfg.eval.holdout_fraction < 1.0:
        raise ConfigError(f"eval.holdout_fraction={cfg.eval.holdout_fraction}: expected a fraction in (0, 1).")
    validate_model_node(cfg.reward_model, key="reward_model")


# ---------------------------------------------------------------------------------------------------- pairs


@dataclass
class LabelledPairs:
    """The labelled data of a run: training pairs (for the buffer), held-out pairs and scored held-out responses.

    A pair is ``{"prompt", "chosen", "rejected"}`` (+ ``"margin"``), every field text or, when ``conversational``, a
    list of ``{"role", "content"}`` messages; an implicit prompt is an empty prompt. ``eval_responses`` (synthetic
    task only) are ``{"prompt", "response", "oracle"}``.
    """

    train: list[dict]
    eval: list[dict]
    conversational: bool
    eval_responses: list[dict] = field(default_factory=list)
    # The training pairs' token ids, row for row, as a reloaded buffer stored them (buffer.load_from, same tokenizer):
    # the run trains on them instead of tokenizing the text again. None: tokenize ``train``.
    train_tokens: object = None
    # What the summary reports about how the pairs were made (degenerate pairs dropped...).
    facts: dict = field(default_factory=dict)

    @property
    def has_margin(self) -> bool:
        return bool(self.train) and all("margin" in pair for pair in self.train)


def make_policy(cfg: DictConfig):
    """The sampling policy (TorchRL's ``TransformersWrapper`` in generate mode) and its tokenizer."""
    from recipes.common import rollout  # TorchRL's LLM stack: loaded only by the runs that generate

    tokenizer = load_tokenizer(cfg.model, padding_side="left")  # the wrapper generates with left padding
    model = load_causal_lm(cfg.model, device=cfg.device, dtype=cfg.dtype).eval()
    return rollout.make_policy(model, tokenizer, generation=cfg.generation.generate_kwargs), tokenizer


def generate_responses(cfg: DictConfig, policy, tokenizer, prompts: list) -> list[tuple[list[dict], list[str]]]:
    """``responses_per_prompt`` sampled responses to each prompt, by single-turn rollouts of TorchRL's ``ChatEnv``.

    Returns ``(prompt messages, response texts)`` per prompt, the prompt as the rollout's own history holds it.
    """
    from recipes.common import rollout

    group, per_reset = cfg.generation.responses_per_prompt, cfg.generation.prompts_per_batch
    results = []
    for start in range(0, len(prompts), per_reset):
        count = min(per_reset, len(prompts) - start)
        loader = rollout.make_prompt_dataloader(prompts, seed=cfg.seed, start=start, shuffle=False)
        env = rollout.make_chat_env(loader, tokenizer=tokenizer, group_size=group, num_prompts=count)
        with torch.no_grad():
            out = policy(env.reset())
        texts = rollout.response_texts(out, tokenizer)
        histories = out.get(("history", "prompt")).tolist()
        for i in range(count):  # each prompt's copies are contiguous
            messages = [{"role": m["role"], "content": m["content"]} for m in histories[i * group]]
            results.append((messages, texts[i * group : (i + 1) * group]))
    return results


def label_responses(labeler, generated: list, oracle=None) -> tuple[list[dict], list[dict]]:
    """Conversational preference pairs from the labeler, and (with an oracle) every response with its score."""
    pairs, scored = [], []
    for messages, candidates in generated:
        for pair in labeler(messages[-1]["content"], candidates):
            labelled = {
                "prompt": messages,
                "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                "rejected": [{"role": "assistant", "content": pair["rejected"]}],
            }
            if "margin" in pair:
                labelled["margin"] = float(pair["margin"])
            pairs.append(labelled)
        if oracle is not None:
            scored.extend({"prompt": messages, "response": r, "oracle": float(oracle(r))} for r in candidates)
    return pairs, scored


def normalize_pairs(raw: list[dict], *, what: str) -> tuple[list[dict], bool]:
    """Pairs from a dataset in one format (all text or all conversational), with an empty prompt when implicit."""
    pairs, formats = [], set()
    for i, row in enumerate(raw):
        fields = {}
        for name in ("chosen", "rejected", "prompt"):
            if name == "prompt" and row.get("prompt") is None:  # an implicit prompt
                continue
            try:
                fields[name] = prompt_text(row[name])
            except ConfigError as err:
                raise ConfigError(f"{what} pair {i}, {name}: {err}") from None
        prompt = fields.pop("prompt", None)
        conversational = isinstance(fields["chosen"], list)
        if isinstance(fields["rejected"], list) != conversational or (
            prompt is not None and isinstance(prompt, list) != conversational
        ):
            raise ConfigError(f"{what} pair {i} mixes text and message lists in prompt/chosen/rejected.")
        formats.add(conversational)
        fields["prompt"] = prompt if prompt is not None else ([] if conversational else "")
        pairs.append(fields)
    if len(formats) > 1:
        raise ConfigError(f"The {what} pairs mix text and conversational rows; convert them to one format.")
    return pairs, formats == {True}


def drop_identical_pairs(labelled: LabelledPairs, *, source: str) -> LabelledPairs:
    """The pairs without those whose chosen and rejected are the same (same text, same message list once
    normalized): their loss is log(2) whatever the model does, they teach nothing. Counted in ``labelled.facts``."""
    kept = {}
    for split in ("train", "eval"):
        pairs = getattr(labelled, split)
        kept[split] = [row for row, pair in enumerate(pairs) if pair["chosen"] != pair["rejected"]]
        dropped = len(pairs) - len(kept[split])
        if pairs and not kept[split]:
            raise ConfigError(
                f"All {len(pairs)} {split} pairs of {source} have chosen == rejected: nothing to learn or measure. "
                "Check that the chosen and rejected columns are the right ones (data.chosen_column, "
                "data.rejected_column) and hold different responses."
            )
        if dropped:
            log.warning(
                "Dropped %d of %d %s pairs of %s whose chosen and rejected are identical (they teach nothing).",
                *(dropped, len(pairs), split, source),
            )
    tokens = labelled.train_tokens
    if tokens is not None and len(kept["train"]) < len(labelled.train):
        tokens = tokens[torch.tensor(kept["train"], dtype=torch.long)]
    facts = {f"{split}/pairs_identical_dropped": len(getattr(labelled, split)) - len(kept[split]) for split in kept}
    return replace(
        labelled,
        train=[labelled.train[row] for row in kept["train"]],
        eval=[labelled.eval[row] for row in kept["eval"]],
        train_tokens=tokens,
        facts={**labelled.facts, **facts},
    )


def hold_out_pairs(labelled: LabelledPairs, cfg: DictConfig, *, source: str) -> LabelledPairs:
    """``eval.holdout_fraction`` of the training pairs moved to the held-out set, drawn with the run's seed."""
    total = len(labelled.train)
    held_count = max(1, round(cfg.eval.holdout_fraction * total))
    if total - held_count < 1:
        raise ConfigError(
            f"{source} has {total} preference pair(s): holding out eval.holdout_fraction={cfg.eval.holdout_fraction} "
            f"of them ({held_count}) leaves {max(0, total - held_count)} to train on. Add pairs, lower "
            "eval.holdout_fraction, or give the held-out pairs a set of their own (data.eval_path=... with data=file, "
            "data.eval_split=... with data=hf)."
        )
    order = list(range(total))
    random.Random(cfg.seed).shuffle(order)
    held_out = set(order[:held_count])
    return replace(
        labelled,
        train=[p for i, p in enumerate(labelled.train) if i not in held_out],
        eval=[p for i, p in enumerate(labelled.train) if i in held_out],
    )


def make_labelled_pairs(cfg: DictConfig) -> LabelledPairs:
    """Generated and labelled pairs (``data=synthetic``) or pairs read from a file / HF dataset."""
    if cfg.data.source == "synthetic":
        policy, tokenizer = make_policy(cfg)
        labeler = hydra.utils.instantiate(cfg.labeler)
        oracle = hydra.utils.instantiate(cfg.data.oracle) if cfg.data.oracle is not None else None
        labelled = {}
        for split in ("train", "eval"):
            generated = generate_responses(cfg, policy, tokenizer, load_prompts(cfg.data, split))
            labelled[split] = label_responses(labeler, generated, oracle if split == "eval" else None)
        pairs = LabelledPairs(
            train=labelled["train"][0],
            eval=labelled["eval"][0],
            eval_responses=labelled["eval"][1],
            conversational=True,
        )
        return drop_identical_pairs(pairs, source="the labeller")
    source = f"data={cfg.data.source} ({cfg.data.path if cfg.data.source == 'file' else cfg.data.name_or_path})"
    train, conversational = normalize_pairs(load_preference_pairs(cfg.data, "train"), what="train")
    raw_eval = load_preference_pairs(cfg.data, "eval")
    eval_pairs = []
    if raw_eval:
        eval_pairs, eval_conversational = normalize_pairs(raw_eval, what="eval")
        if eval_conversational != conversational:
            raise ConfigError("The train and eval pairs have different formats (text vs conversational).")
    # Degenerate pairs go before the split: the held-out fraction is a fraction of the pairs worth training on.
    pairs = drop_identical_pairs(LabelledPairs(train, eval_pairs, conversational), source=source)
    return pairs if raw_eval else hold_out_pairs(pairs, cfg, source=source)


# ---------------------------------------------------------------------------------------------------- buffer


def _key(node) -> str | tuple[str, ...]:
    return tuple(node) if isinstance(node, (list, tuple, ListConfig)) else str(node)


def _key_name(key) -> str:
    """The column name ``TorchRLBufferDataset`` gives a key (nested keys dot-joined)."""
    return ".".join(key) if isinstance(key, tuple) else key


def tokenize_pairs(tokenizer, pairs: list[dict], *, conversational: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each pair's chosen and rejected sequence, as ``trl.RewardTrainer`` (1.16) tokenizes them.

    Conversational: ``apply_chat_template(prompt + completion, tokenize=True)``. Text: ``prompt + completion`` with
    the EOS string appended when missing, tokenized with special tokens. ``interop.HFRewardModelWrapper(tokenizer=)``
    scores text and conversations the same way, so a trained model is scored on the sequences it learned.
    """
    chosen, rejected = (
        tokenize_sequences(tokenizer, [pair["prompt"] + pair[side] for pair in pairs], conversational=conversational)
        for side in ("chosen", "rejected")
    )
    return chosen, rejected


def tokenize_sequences(tokenizer, sequences: list, *, conversational: bool) -> list[list[int]]:
    """Token ids of whole sequences (message lists or texts) in trl's convention (:func:`tokenize_pairs`)."""
    if not sequences:
        return []
    if conversational:
        ids = tokenizer.apply_chat_template(sequences, tokenize=True, return_dict=True)["input_ids"]
    else:
        eos = tokenizer.eos_token
        ids = tokenizer([t if t.endswith(eos) else t + eos for t in sequences])["input_ids"]
    return [list(seq) for seq in ids]


def tokenizer_fingerprint(tokenizer) -> dict:
    """What decides the token ids a tokenizer gives, cheaply: sizes, special ids, and one hash of its vocabulary
    and chat template. A reloaded buffer's stored ids are reused only for a tokenizer with the same fingerprint."""
    digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "vocab_and_chat_template_sha256": digest.hexdigest(),
    }


def pairs_to_tensordict(pairs: list[dict], tokenizer, keys: DictConfig, *, conversational: bool):
    """What the trainer reads of each pair, as one TensorDict: right-padded token ids, their lengths, the margin.

    The text stays out of the buffer: indexing strings (non-tensor stacks) costs ~0.2 s per thousand pairs drawn,
    as much as several optimizer steps of a small model, and torchrl's memmap storage cannot hold them.
    """
    from tensordict import TensorDict

    chosen_ids, rejected_ids = tokenize_pairs(tokenizer, pairs, conversational=conversational)
    width = max(len(seq) for seq in chosen_ids + rejected_ids)
    pad = tokenizer.pad_token_id
    td = TensorDict(batch_size=[len(pairs)])
    for side, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        td.set(_key(keys[f"{side}_tokens"]), torch.tensor([seq + [pad] * (width - len(seq)) for seq in ids]))
        td.set(_key(keys[f"{side}_length"]), torch.tensor([len(seq) for seq in ids]))
    if all("margin" in pair for pair in pairs):
        td.set(_key(keys.margin), torch.tensor([pair["margin"] for pair in pairs], dtype=torch.float32))
    return td


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


# What to do with a buffer folder that is incomplete or damaged.
REBUILD_BUFFER = (
    "Restore the folder from a copy, or rebuild it with a run of buffer=memmap (it writes <run dir>/buffer) and point "
    "buffer.load_from at that."
)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the buffer folder is incomplete. {REBUILD_BUFFER}")
    rows = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}, line {number}: not valid JSON ({err}). {REBUILD_BUFFER}") from err
            if not isinstance(row, dict):
                raise ConfigError(f"{path}, line {number}: expected a JSON object, got {row!r:.80}. {REBUILD_BUFFER}")
            rows.append(row)
    return rows


def _pair_keys_layout(keys: DictConfig) -> dict:
    return OmegaConf.to_container(keys, resolve=True)


def save_labelled_pairs(
    folder: str | os.PathLike, labelled: LabelledPairs, pairs_td, *, tokenizer, pair_keys: DictConfig
) -> Path:
    """Writes a run's labelled data atomically, for a later run's ``buffer.load_from``.

    ``pairs.jsonl`` / ``eval_pairs.jsonl`` / ``eval_responses.jsonl`` hold the text (re-tokenized by a run with another
    reward model), ``storage/`` the buffer's tensors as a tensordict memmap (what ``buffer=memmap`` samples from, and
    what a later run with the same tokenizer trains from). ``meta.json`` holds the row counts, the tokenizer's
    fingerprint and the keys of ``storage/``, which :func:`load_labelled_pairs` checks.
    """

    def write(staging: Path) -> None:
        _write_jsonl(staging / TRAIN_PAIRS_FILE, labelled.train)
        _write_jsonl(staging / EVAL_PAIRS_FILE, labelled.eval)
        _write_jsonl(staging / EVAL_RESPONSES_FILE, labelled.eval_responses)
        # copy_existing: the pairs may be a reloaded buffer's memory-mapped storage, which memmap() will not move.
        pairs_td.memmap(staging / STORAGE_FOLDER, copy_existing=True)
        meta = {
            "conversational": labelled.conversational,
            "num_pairs": len(labelled.train),
            "num_eval_pairs": len(labelled.eval),
            "num_eval_responses": len(labelled.eval_responses),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "pair_keys": _pair_keys_layout(pair_keys),
            "storage_bytes": _storage_file_sizes(staging / STORAGE_FOLDER),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2))

    return write_folder_atomically(write, folder)


def _storage_file_sizes(path: Path) -> dict[str, int]:
    """The size of each tensor file of a tensordict memmap folder: tensordict zero-fills a cut file when it loads it."""
    return {str(file.relative_to(path)): file.stat().st_size for file in sorted(path.rglob("*.memmap"))}


def _read_meta(folder: Path) -> dict:
    path = folder / META_FILE
    if not path.is_file():
        raise ConfigError(
            f"buffer.load_from={str(folder)!r} is not a saved preference buffer (no {META_FILE} in it). Point it at "
            "the buffer folder of an earlier run made with buffer=memmap (<run dir>/buffer)."
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}). {REBUILD_BUFFER}") from err
    missing = [name for name in ("conversational", "num_pairs") if not isinstance(meta, dict) or name not in meta]
    if missing:
        raise ConfigError(f"{path} lacks {missing}. {REBUILD_BUFFER}")
    return meta


def _check_row_counts(folder: Path, meta: dict, labelled: LabelledPairs) -> None:
    """Each text file holds as many rows as the meta says were written: a cut or padded file is refused."""
    expected = {
        TRAIN_PAIRS_FILE: ("num_pairs", labelled.train),
        EVAL_PAIRS_FILE: ("num_eval_pairs", labelled.eval),
        EVAL_RESPONSES_FILE: ("num_eval_responses", labelled.eval_responses),
    }
    for name, (count_key, rows) in expected.items():
        if count_key in meta and len(rows) != meta[count_key]:  # folders of older versions record num_pairs only
            raise ConfigError(
                f"{folder / name} holds {len(rows)} rows, but {folder / META_FILE} says {meta[count_key]} were "
                f"written ({count_key}): the file was cut or edited. {REBUILD_BUFFER}"
            )


def _load_storage(folder: Path, meta: dict):
    """The stored token ids (memory-mapped, nothing read yet), refused unless they are the meta's ``num_pairs`` rows."""
    from tensordict import TensorDict

    path = folder / STORAGE_FOLDER
    if not path.is_dir():
        raise ConfigError(f"{path} is missing: the buffer folder is incomplete. {REBUILD_BUFFER}")
    # Checked before loading: tensordict would read a cut tensor file as zeros (and grow it to size on disk).
    expected, found = meta.get("storage_bytes"), _storage_file_sizes(path)
    if expected is not None and found != expected:  # folders of older versions record no sizes
        changed = sorted(name for name in {*expected, *found} if expected.get(name) != found.get(name))
        raise ConfigError(
            f"{path} cannot be read as the tensordict memmap it was written as: {changed} differ from the sizes in "
            f"{folder / META_FILE} (bytes written: {[expected.get(name) for name in changed]}, found: "
            f"{[found.get(name) for name in changed]}). {REBUILD_BUFFER}"
        )
    try:
        stored = TensorDict.load_memmap(path)
    except Exception as err:  # a damaged memmap fails in many ways (json, sizes, missing files)
        raise ConfigError(f"{path} cannot be read as a tensordict memmap ({err!r:.300}). {REBUILD_BUFFER}") from err
    rows = stored.batch_size[0] if stored.batch_size else None
    if rows != meta["num_pairs"]:
        raise ConfigError(
            f"{path} holds {rows} pairs, but {folder / META_FILE} says {meta['num_pairs']} were written (num_pairs): "
            f"the storage and the text disagree. {REBUILD_BUFFER}"
        )
    return stored


def _why_tokenize_again(meta: dict, tokenizer, pair_keys: DictConfig) -> str | None:
    """Why this run cannot train from the stored token ids, or None when it can."""
    if "tokenizer" not in meta:
        return "its meta.json records no tokenizer (written by an older version of the recipe)"
    if meta["tokenizer"] != tokenizer_fingerprint(tokenizer):
        return "it was tokenized by another tokenizer than this run's reward model's"
    if meta.get("pair_keys") != _pair_keys_layout(pair_keys):
        return f"it stores keys {meta.get('pair_keys')}, this run reads buffer.pair_keys={_pair_keys_layout(pair_keys)}"
    return None


def load_labelled_pairs(folder: str | os.PathLike, *, tokenizer, pair_keys: DictConfig) -> LabelledPairs:
    """The labelled pairs of a folder written by :func:`save_labelled_pairs`: no generation, no labelling.

    Cheap checks refuse a cut or damaged folder (row counts, JSON lines, the storage's size). With the tokenizer the
    folder was written with, the run trains from ``storage/`` itself (memory-mapped); with another it re-tokenizes
    the text of ``pairs.jsonl``, and says so.
    """
    folder = Path(folder).expanduser()
    meta = _read_meta(folder)
    labelled = LabelledPairs(
        train=_read_jsonl(folder / TRAIN_PAIRS_FILE),
        eval=_read_jsonl(folder / EVAL_PAIRS_FILE),
        eval_responses=_read_jsonl(folder / EVAL_RESPONSES_FILE),
        conversational=meta["conversational"],
    )
    _check_row_counts(folder, meta, labelled)
    stored = _load_storage(folder, meta)
    reason = _why_tokenize_again(meta, tokenizer, pair_keys)
    if reason is not None:
        log.warning("buffer.load_from=%s: %s; re-tokenizing the text of its %s.", folder, reason, TRAIN_PAIRS_FILE)
    else:
        needed = [_key(pair_keys[name]) for name in pair_keys if name != "margin" or labelled.has_margin]
        missing = [key for key in needed if key not in stored.keys(include_nested=True)]
        if missing:
            raise ConfigError(f"{folder / STORAGE_FOLDER} lacks the keys {missing}. {REBUILD_BUFFER}")
        log.info("buffer.load_from=%s: training from its stored token ids (%s).", folder, STORAGE_FOLDER)
        labelled.train_tokens = stored
    return drop_identical_pairs(labelled, source=str(folder))


def make_preference_buffer(buffer_cfg: DictConfig, pairs_td, *, batch_size: int, seed: int):
    """A ReplayBuffer over the pairs: copied into a LazyTensorStorage, or (memmap) sampled in place from the tensordict.

    The sampler draws from the buffer's own generator, seeded with ``seed``: its draws depend on nothing else the
    process does with torch's global RNG (generation, dropout), so every process of a multi-process run draws the same
    stream and takes its own slice of it.
    """
    from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorStorage

    sampler = hydra.utils.instantiate(buffer_cfg.sampler)
    generator = torch.Generator().manual_seed(seed)
    if buffer_cfg.storage == "memmap":  # sampled in place: the memory-mapped folder on the main process
        return ReplayBuffer(
            storage=TensorStorage(pairs_td), sampler=sampler, batch_size=batch_size, generator=generator
        )
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(pairs_td.batch_size[0]), sampler=sampler, batch_size=batch_size, generator=generator
    )
    buffer.extend(pairs_td)
    return buffer


def make_train_dataset(buffer, keys: DictConfig, *, samples_per_epoch: int, with_margin: bool):
    """The buffer as the ``datasets.IterableDataset`` RewardTrainer reads: trl's ``chosen_ids``/``rejected_ids``.

    Each pass draws ``samples_per_epoch`` pairs in one ``buffer.sample`` (without replacement: no pair twice in an
    epoch, so none twice in a step), then strips the storage's padding so that trl pads each batch to its own longest.
    """
    import datasets

    from interop import TorchRLBufferDataset

    read = [keys.chosen_tokens, keys.chosen_length, keys.rejected_tokens, keys.rejected_length]
    read += [keys.margin] if with_margin else []
    stream = TorchRLBufferDataset(buffer, samples_per_epoch, keys=[_key(k) for k in read], num_batches=1)
    stream = stream.as_hf_dataset()
    names = {field: _key_name(_key(node)) for field, node in keys.items()}  # columns as the stream names them

    def to_trl_columns(batch: dict) -> dict:
        out = {
            f"{side}_ids": [ids[:n] for ids, n in zip(batch[names[f"{side}_tokens"]], batch[names[f"{side}_length"]])]
            for side in ("chosen", "rejected")
        }
        if with_margin:
            out["margin"] = batch[names["margin"]]
        return out

    features = {
        "chosen_ids": datasets.List(datasets.Value("int64")),
        "rejected_ids": datasets.List(datasets.Value("int64")),
    }
    if with_margin:
        features["margin"] = datasets.Value("float32")
    return stream.map(
        to_trl_columns, batched=True, remove_columns=stream.column_names, features=datasets.Features(features)
    )


def make_eval_dataset(tokenizer, labelled: LabelledPairs, *, with_margin: bool):
    """The held-out pairs, tokenized, as the finite ``datasets.Dataset`` trl evaluates during training."""
    import datasets

    chosen_ids, rejected_ids = tokenize_pairs(tokenizer, labelled.eval, conversational=labelled.conversational)
    columns = {"chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    if with_margin:
        columns["margin"] = [pair["margin"] for pair in labelled.eval]
    return datasets.Dataset.from_dict(columns)


# ---------------------------------------------------------------------------------------------------- training


def make_reward_config(cfg: DictConfig):
    """``trl.RewardConfig`` from ``train:``, with the device this run decides.

    trl reports to nothing itself: its logs go through the recipe's own logger (``logger=``), csv or wandb, as the
    GRPO recipe's do (:func:`make_metrics_callback`)."""
    return hydra.utils.instantiate(
        cfg.train,
        _convert_="all",  # trl/transformers check for plain lists and dicts
        use_cpu=cfg.device == "cpu",
        report_to="none",
    )


def make_metrics_callback(logger: MetricLogger, *, total_steps: int):
    """A TrainerCallback writing trl's training logs to ``logger`` as ``train/...`` metrics, one row per log, and a
    progress line to the run's log (every ``train.logging_steps`` steps).

    trl's periodic eval logs and end-of-training figures are in ``trainer_log.json``, and the final evaluation in
    ``summary.json`` (and the wandb run's summary).
    """
    from transformers import TrainerCallback

    class MetricLoggerCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                metrics = {
                    f"train/{name}": value
                    for name, value in logs.items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)
                }
                logger.log(metrics, step=state.global_step)
                shown = [f"{name} {logs[name]:.4g}" for name in ("loss", "accuracy", "margin") if name in logs]
                log.info("Step %d/%d: %s", state.global_step, total_steps, ", ".join(shown))

    return MetricLoggerCallback()


# ---------------------------------------------------------------------------------------------------- evaluation


def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks from 0, ties sharing their average rank (what Spearman's coefficient needs)."""
    ordered, order = values.double().sort()
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0)
    ranks = torch.empty_like(ordered)
    ranks[order] = ((ends - counts + ends - 1).double() / 2.0)[inverse]
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation (Pearson correlation of average ranks); nan when either side is constant."""
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denominator) if denominator > 0 else float("nan")


def score_sequences(model, tokenizer, sequences: list, eval_cfg: DictConfig, *, conversational: bool) -> torch.Tensor:
    """Reward of each sequence (a message list or a text) through ``interop.HFRewardModelWrapper(tokenizer=...)``."""
    from tensordict import NonTensorStack, TensorDict
    from torchrl.data.llm import History

    from interop import HFRewardModelWrapper

    history_key, text_key = _key(eval_cfg.history_key), _key(eval_cfg.text_key)
    scorer = HFRewardModelWrapper(
        model,
        tokenizer=tokenizer,
        history_key=history_key if conversational else None,
        text_key=text_key,
        reward_key=_key(eval_cfg.reward_key),
        inference_mode=True,
        micro_batch_size=eval_cfg.micro_batch_size,
    )
    td = TensorDict(batch_size=[len(sequences)])
    if conversational:
        td.set(history_key, History.from_chats(sequences))
    else:
        td.set(text_key, NonTensorStack.from_list(sequences))
    return scorer(td).get(_key(eval_cfg.reward_key))


def evaluate(model, tokenizer, labelled: LabelledPairs, eval_cfg: DictConfig) -> dict[str, float]:
    """Pairwise accuracy and mean reward margin on the held-out pairs; Spearman vs the oracle when it is known.

    ``labelled`` holds the pairs to score as they are (:func:`limit_eval_to_max_length` left out the long ones).
    """
    model.eval()
    conversational = labelled.conversational
    scores = {
        side: score_sequences(
            model, tokenizer, [p["prompt"] + p[side] for p in labelled.eval], eval_cfg, conversational=conversational
        )
        for side in ("chosen", "rejected")
    }
    metrics = {
        "eval/accuracy": float((scores["chosen"] > scores["rejected"]).float().mean()),
        "eval/margin_mean": float((scores["chosen"] - scores["rejected"]).mean()),
        "eval/num_pairs": len(labelled.eval),
    }
    if labelled.eval_responses:
        responses = [r["prompt"] + [{"role": "assistant", "content": r["response"]}] for r in labelled.eval_responses]
        rewards = score_sequences(model, tokenizer, responses, eval_cfg, conversational=True)
        metrics["eval/spearman"] = spearman(rewards, torch.tensor([r["oracle"] for r in labelled.eval_responses]))
    return metrics


# ---------------------------------------------------------------------------------------------------- recipe


def make_training_stream(
    cfg: DictConfig, labelled: LabelledPairs, tokenizer, *, num_processes: int = 1, persist: bool = True
) -> tuple[object, dict]:
    """Tokenizes the training pairs into the buffer (persisted when ``buffer.path`` is set) and opens it for trl.

    Every process of a multi-process run opens the same stream; accelerate hands each its slice of every batch.
    ``persist=False`` (the other processes) keeps the pairs in memory, so they never wait on the main process's disk.

    Returns the ``datasets.IterableDataset`` and facts about it for the summary.
    """
    from tensordict import TensorDict

    keys = cfg.buffer.pair_keys
    step_pairs = cfg.train.per_device_train_batch_size * cfg.train.gradient_accumulation_steps * num_processes
    if len(labelled.train) < step_pairs:
        raise ConfigError(
            f"Only {len(labelled.train)} training pairs, fewer than one optimizer step takes "
            "(train.per_device_train_batch_size * train.gradient_accumulation_steps * processes = "
            f"{cfg.train.per_device_train_batch_size} * {cfg.train.gradient_accumulation_steps} * {num_processes} = "
            f"{step_pairs}). Lower the batch size, use fewer processes or add data (more prompts, "
            "generation.responses_per_prompt, labeler.max_pairs_per_prompt)."
        )
    pairs_td = labelled.train_tokens  # a reloaded buffer's own storage, when this run's tokenizer wrote it
    if pairs_td is None:
        pairs_td = pairs_to_tensordict(labelled.train, tokenizer, keys, conversational=labelled.conversational)
    if cfg.buffer.path is not None and persist:
        folder = save_labelled_pairs(cfg.buffer.path, labelled, pairs_td, tokenizer=tokenizer, pair_keys=keys)
        if cfg.buffer.storage == "memmap":
            pairs_td = TensorDict.load_memmap(folder / STORAGE_FOLDER)
    longest = torch.maximum(pairs_td.get(_key(keys.chosen_length)), pairs_td.get(_key(keys.rejected_length)))
    too_long = count_over_max_length(longest, cfg.train.max_length, what="training")
    # Whole optimizer steps per epoch, so that no step mixes the end of one epoch with the start of the next (and
    # accelerate never pads a short last batch with pairs from the start of the epoch).
    samples_per_epoch = len(labelled.train) // step_pairs * step_pairs
    buffer = make_preference_buffer(cfg.buffer, pairs_td, batch_size=samples_per_epoch, seed=cfg.seed)
    stream = make_train_dataset(buffer, keys, samples_per_epoch=samples_per_epoch, with_margin=cfg.margin_in_loss)
    facts = {
        "train/num_pairs": len(labelled.train),
        "train/pairs_over_max_length": too_long,
        "train/num_processes": num_processes,
        "train/pairs_per_step": step_pairs,
    }
    return stream, facts


def count_over_max_length(longest: torch.Tensor, max_length: int | None, *, what: str) -> int:
    """How many pairs (``longest``: each pair's longer side, in tokens) exceed ``train.max_length``, said in a warning;
    refused when none fits: trl drops such pairs (it does not truncate them)."""
    if max_length is None or len(longest) == 0:
        return 0
    too_long = int((longest > max_length).sum())
    if too_long == len(longest):
        raise ConfigError(
            f"All {too_long} {what} pairs are longer than train.max_length={max_length} tokens (the longest has "
            f"{int(longest.max())}): trl drops such pairs, so no {what} pair is left. Raise train.max_length or "
            "shorten the data."
        )
    if too_long:
        log.warning(
            "%d of %d %s pairs (%.1f%%) are longer than train.max_length=%d tokens (the longest has %d): trl drops "
            "them, they are left out. Raise train.max_length to keep them.",
            *(too_long, len(longest), what, 100.0 * too_long / len(longest), max_length, int(longest.max())),
        )
    return too_long


def limit_eval_to_max_length(labelled: LabelledPairs, tokenizer, max_length: int | None) -> tuple[LabelledPairs, dict]:
    """The held-out pairs (and scored responses) trl would train on: both sides within ``train.max_length`` tokens.

    The evaluation measures the model on the sequences it learned, never on ones trl would have dropped.
    """
    chosen, rejected = tokenize_pairs(tokenizer, labelled.eval, conversational=labelled.conversational)
    longest = torch.tensor([max(len(c), len(r)) for c, r in zip(chosen, rejected)], dtype=torch.long)
    over_pairs = count_over_max_length(longest, max_length, what="held-out")
    responses = [r["prompt"] + [{"role": "assistant", "content": r["response"]}] for r in labelled.eval_responses]
    lengths = [len(ids) for ids in tokenize_sequences(tokenizer, responses, conversational=True)]
    limit = max_length if max_length is not None else float("inf")
    kept_responses = [r for r, n in zip(labelled.eval_responses, lengths) if n <= limit]
    if len(kept_responses) < len(responses):
        log.warning(
            "%d of %d held-out responses are longer than train.max_length=%s tokens: left out of eval/spearman.",
            *(len(responses) - len(kept_responses), len(responses), max_length),
        )
    evaluated = replace(
        labelled,
        eval=[pair for pair, n in zip(labelled.eval, longest.tolist()) if n <= limit],
        eval_responses=kept_responses,
    )
    facts = {
        "eval/pairs_over_max_length": over_pairs,
        "eval/responses_over_max_length": len(responses) - len(kept_responses),
    }
    return evaluated, facts


def make_or_load_labelled_pairs(cfg: DictConfig, tokenizer) -> LabelledPairs:
    """The run's labelled pairs: loaded from ``buffer.load_from`` (its stored token ids reused when ``tokenizer``
    wrote them), or made from ``data=``."""
    if cfg.buffer.load_from is not None:
        return load_labelled_pairs(cfg.buffer.load_from, tokenizer=tokenizer, pair_keys=cfg.buffer.pair_keys)
    return make_labelled_pairs(cfg)


def train(cfg: DictConfig) -> dict:
    """Runs the preference stage end to end and returns the summary written to ``<output_dir>/summary.json``.

    Under ``accelerate launch`` / ``torchrun`` every process calls it and gets the same summary back.
    """
    start = time.perf_counter()
    validate(cfg)
    from tensordict import set_list_to_stack
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
    from trl import RewardTrainer

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    set_list_to_stack(True).set()  # TorchRL's LLM wrappers keep lists of strings as non-tensor stacks
    set_seed(cfg.seed)
    # Building trl's config sets up the processes (torch.distributed under a launcher, gloo on CPU, nccl on GPU);
    # setup_data_parallel adopts that process group.
    args = make_reward_config(cfg)
    data_parallel = setup_data_parallel(device=str(args.device), backend="auto")
    # Hydra names each process's run folder from its own clock, so the processes of one launch may disagree by a
    # second: every process writes where the main process does (trl's RNG states in checkpoints).
    cfg.output_dir, args.output_dir = data_parallel.broadcast_object([str(cfg.output_dir), args.output_dir])
    main_process = data_parallel.is_main
    output_dir = Path(cfg.output_dir)
    if main_process:
        for folder in {output_dir, *([Path(cfg.buffer.path).parent] if cfg.buffer.path else [])}:
            for done in recover_interrupted_writes(folder):  # a kill during an atomic save leaves these
                log.warning("Folders of an interrupted run in %s: %s.", folder, done)
        if cfg.overwrite:  # keeping a buffer this run reuses, if it lies in the folder
            clear_records(output_dir, keep=[cfg.buffer.load_from] if cfg.buffer.load_from else [])
        write_run_config(cfg, output_dir)
    data_parallel.broadcast_object(None)  # the other processes go on once the folder is cleared

    tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
    # The main process makes (or loads) the pairs, the others receive them (waiting up to train.ddp_timeout seconds):
    # processes generating for themselves would agree only as far as their devices compute alike. A failure on the
    # main process ends the launch (torchrun stops the waiting processes).
    labelled = data_parallel.broadcast_object(make_or_load_labelled_pairs(cfg, tokenizer) if main_process else None)
    if cfg.margin_in_loss and not labelled.has_margin:
        raise ConfigError("margin_in_loss=true, but the pairs carry no margin; set margin_in_loss=false.")
    if not labelled.eval:
        raise ConfigError("No held-out pairs to evaluate on: add eval prompts, an eval split or more pairs.")
    train_dataset, facts = make_training_stream(
        cfg, labelled, tokenizer, num_processes=data_parallel.world_size, persist=main_process
    )
    # The buffer folder keeps every held-out pair (a later run may allow longer ones); this run evaluates those
    # trl would train on.
    labelled, eval_facts = limit_eval_to_max_length(labelled, tokenizer, cfg.train.max_length)
    facts = {**labelled.facts, **facts, **eval_facts}
    if main_process:
        _write_jsonl(output_dir / EVAL_PAIRS_FILE, labelled.eval)
        log.info(
            "Reward model training: %s trained from a TorchRL buffer (%s storage) of %d preference pairs (data=%s), "
            "%d steps of %d pairs, lr %s, seed %d, %s %s; %d held-out pairs; run folder %s",
            cfg.reward_model.name_or_path,
            cfg.buffer.storage,
            facts["train/num_pairs"],
            cfg.data.source,
            cfg.train.max_steps,
            facts["train/pairs_per_step"],
            cfg.train.learning_rate,
            cfg.seed,
            cfg.device,
            cfg.dtype,
            len(labelled.eval),
            output_dir,
        )
    labelling_s = time.perf_counter() - start

    # args.device: this process's own device (cuda:<local rank> under a launcher).
    # The model trained into a reward model: a classifier's base or a causal LM, whose score head may be new.
    model = load_reward_model(
        cfg.reward_model, device=args.device, dtype=cfg.dtype, pad_token_id=tokenizer.pad_token_id, trained=False
    )
    eval_dataset = None
    if args.eval_strategy != "no":  # trl's own periodic evaluation on the held-out pairs
        eval_dataset = make_eval_dataset(tokenizer, labelled, with_margin=cfg.margin_in_loss)
    logs = main_process and cfg.logger.kind != "none"
    # csv and/or a wandb run in this job's own folder (a multirun's jobs share the process: each opens and closes its
    # own run).
    metric_logger = (
        make_logger(cfg.logger, output_dir, config=run_config(cfg)) if logs else MetricLogger("none", output_dir)
    )
    summary = None
    try:
        trainer = RewardTrainer(
            model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=[make_metrics_callback(metric_logger, total_steps=cfg.train.max_steps)] if main_process else None,
        )
        train_start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - train_start
        if trainer.state.global_step == 0:
            raise RuntimeError(
                f"RewardTrainer made no optimizer step: {facts['train/pairs_over_max_length']} of "
                f"{facts['train/num_pairs']} training pairs are longer than train.max_length={cfg.train.max_length} "
                "tokens, and trl drops such pairs. Raise train.max_length (or shorten the data)."
            )
        if main_process:
            (output_dir / "trainer_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
            model_dir = write_folder_atomically(
                functools.partial(save_model_folder, trainer.model, tokenizer), output_dir / "model"
            )
            # Measure what ships: the saved folder, loaded as a user (or the GRPO recipe) loads it.
            saved = AutoModelForSequenceClassification.from_pretrained(model_dir, use_safetensors=True)
            metrics = evaluate(saved.to(args.device), AutoTokenizer.from_pretrained(model_dir), labelled, cfg.eval)
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry] or [float("nan")]
            summary = {
                **metrics,
                "train/steps": trainer.state.global_step,
                "train/loss_first": losses[0],
                "train/loss_last": losses[-1],
                **facts,
                "train/steps_per_s": trainer.state.global_step / train_s,
                "time/pairs_s": labelling_s,
                "time/train_s": train_s,
                "wall_time_s": time.perf_counter() - start,
            }
            metric_logger.log_summary(summary)
    finally:
        metric_logger.close()  # Hydra multirun jobs share this process: never leave a run open for the next one
    summary = data_parallel.broadcast_object(summary)  # the others wait while the main process saves and evaluates
    data_parallel.close()  # a no-op for the launcher's own process group
    if main_process:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        spearman = f", Spearman vs the oracle {summary['eval/spearman']:.3f}" if "eval/spearman" in summary else ""
        log.info(
            "Reward model trained: held-out accuracy %.3f, margin %.3f%s; saved to %s. Use it in GRPO: python "
            "recipes/grpo_torchrl_rm.py reward_model.name_or_path=%s",
            summary["eval/accuracy"],
            summary["eval/margin_mean"],
            spearman,
            output_dir / "model",
            output_dir / "model",
        )
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="reward_trainer_from_buffer")
def main(cfg: DictConfig) -> float:
    from accelerate import PartialState

    # accelerate says so at every evaluation of a stream (the buffer is one, on purpose): noise in the run's log.
    logging.getLogger("accelerate.accelerator").addFilter(
        lambda record: "The used dataset had no length" not in record.getMessage()
    )
    summary = run_recipe(train, cfg)
    if PartialState().is_main_process:
        print(json.dumps(summary, indent=2))
    return summary[cfg.metric]


if __name__ == "__main__":
    main()
    from accelerate import PartialState

    # Under a launcher trl's config set up the process group; left alive, gloo's threads can abort the interpreter's
    # shutdown ("terminate called without an active exception"). Once per process, after every Hydra job.
    PartialState().destroy_process_group()
