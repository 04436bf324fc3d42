"""The labelled preference pairs a reward-model run trains and evaluates on.

- :class:`LabelledPairs`: the training pairs, the held-out pairs and (synthetic task) the scored held-out responses.
- Pairs sampled and labelled: :func:`load_sampling_policy`, :func:`generate_responses` (single-turn TorchRL
  ``ChatEnv`` rollouts), :func:`label_responses`; the whole step: :func:`pairs_from_policy`.
- Pairs read from a dataset (trl's preference formats): :func:`normalize_pairs`, :func:`hold_out_pairs`; the whole
  step: :func:`pairs_from_dataset`.
- Pairs that teach nothing or that trl would drop: :func:`drop_identical_pairs`, :func:`count_over_max_length`,
  :func:`limit_eval_to_max_length`.
- Tokenized as ``trl.RewardTrainer`` tokenizes: :func:`tokenize_pairs`, :func:`tokenize_sequences`,
  :func:`pairs_to_tensordict`.

Kept in a folder for a later run: ``recipes.reward.pair_store``.

The settings come typed (``recipes.reward.schema``); ``recipes.common.data`` and ``recipes.common.models`` read
their nodes as DictConfig views of them (``recipes.common.schema.config_view``).

Dependencies: torch, tensordict, torchrl (TorchRL's chat stack, ``recipes.common.chat``), omegaconf.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from tensordict import TensorDict

from recipes.common import chat
from recipes.common.config import ConfigError, tensordict_key
from recipes.common.data import load_preference_pairs, load_prompts, prompt_text
from recipes.common.models import load_causal_lm, load_tokenizer
from recipes.common.schema import FileData, HFData, ModelNode, SyntheticData, config_view
from recipes.reward.schema import PairKeys

__all__ = [
    "LabelledPairs",
    "count_over_max_length",
    "drop_identical_pairs",
    "generate_responses",
    "hold_out_pairs",
    "label_responses",
    "limit_eval_to_max_length",
    "load_sampling_policy",
    "normalize_pairs",
    "pairs_from_dataset",
    "pairs_from_policy",
    "pairs_to_tensordict",
    "tokenize_pairs",
    "tokenize_sequences",
]

log = logging.getLogger(__name__)


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


def load_sampling_policy(model_cfg: ModelNode, *, generate_kwargs, device: str, dtype: str):
    """The policy that samples candidate responses (TorchRL's ``TransformersWrapper`` in generate mode over the
    ``model=`` node's causal LM) and its tokenizer, with the left padding the wrapper generates with."""
    tokenizer = load_tokenizer(model_cfg, padding_side="left")
    # load_causal_lm merges the node with OmegaConf for an adapter folder's base: it takes a DictConfig view.
    model = load_causal_lm(config_view(model_cfg), device=device, dtype=dtype).eval()
    return chat.make_policy(model, tokenizer, generation=generate_kwargs), tokenizer


def generate_responses(
    policy, tokenizer, prompts: list, *, responses_per_prompt: int, prompts_per_batch: int, seed: int
) -> list[tuple[list[dict], list[str]]]:
    """``responses_per_prompt`` sampled responses to each prompt, by single-turn rollouts of TorchRL's ``ChatEnv``
    (``prompts_per_batch`` prompts per reset).

    Returns ``(prompt messages, response texts)`` per prompt, the prompt as the rollout's own history holds it.
    """
    group, per_reset = responses_per_prompt, prompts_per_batch
    results = []
    for start in range(0, len(prompts), per_reset):
        count = min(per_reset, len(prompts) - start)
        loader = chat.make_prompt_dataloader(prompts, seed=seed, start=start, shuffle=False)
        env = chat.make_chat_env(loader, tokenizer=tokenizer, group_size=group, num_prompts=count)
        with torch.no_grad():
            out = policy(env.reset())
        texts = chat.response_texts(out, tokenizer)
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


def hold_out_pairs(labelled: LabelledPairs, *, fraction: float, seed: int, source: str) -> LabelledPairs:
    """``fraction`` (``eval.holdout_fraction``) of the training pairs moved to the held-out set, drawn with ``seed``."""
    total = len(labelled.train)
    held_count = max(1, round(fraction * total))
    if total - held_count < 1:
        raise ConfigError(
            f"{source} has {total} preference pair(s): holding out eval.holdout_fraction={fraction} "
            f"of them ({held_count}) leaves {max(0, total - held_count)} to train on. Add pairs, lower "
            "eval.holdout_fraction, or give the held-out pairs a set of their own (data.eval_path=... with data=file, "
            "data.eval_split=... with data=hf)."
        )
    order = list(range(total))
    random.Random(seed).shuffle(order)
    held_out = set(order[:held_count])
    return replace(
        labelled,
        train=[p for i, p in enumerate(labelled.train) if i not in held_out],
        eval=[p for i, p in enumerate(labelled.train) if i in held_out],
    )


def pairs_from_policy(
    policy,
    tokenizer,
    data_cfg: SyntheticData,
    *,
    labeler: Callable,
    oracle: Callable | None,
    responses_per_prompt: int,
    prompts_per_batch: int,
    seed: int,
) -> LabelledPairs:
    """Conversational pairs labelled by ``labeler`` from the policy's responses to the train and eval prompts of
    ``data_cfg`` (``data=synthetic``), without identical pairs; the held-out responses scored by ``oracle``."""
    labelled = {}
    for split in ("train", "eval"):
        generated = generate_responses(
            policy,
            tokenizer,
            load_prompts(config_view(data_cfg), split),
            responses_per_prompt=responses_per_prompt,
            prompts_per_batch=prompts_per_batch,
            seed=seed,
        )
        labelled[split] = label_responses(labeler, generated, oracle if split == "eval" else None)
    pairs = LabelledPairs(
        train=labelled["train"][0],
        eval=labelled["eval"][0],
        eval_responses=labelled["eval"][1],
        conversational=True,
    )
    return drop_identical_pairs(pairs, source="the labeller")


def pairs_from_dataset(data_cfg: FileData | HFData, *, holdout_fraction: float, seed: int) -> LabelledPairs:
    """The pairs of a file or HF dataset (``data=file|hf``), without identical pairs, the held-out ones from its eval
    set or, without one, ``holdout_fraction`` of them (:func:`hold_out_pairs`)."""
    source = f"data={data_cfg.source} ({data_cfg.path if data_cfg.source == 'file' else data_cfg.name_or_path})"
    data = config_view(data_cfg)  # recipes.common.data reads the columns by name (data[key])
    train, conversational = normalize_pairs(load_preference_pairs(data, "train"), what="train")
    raw_eval = load_preference_pairs(data, "eval")
    eval_pairs = []
    if raw_eval:
        eval_pairs, eval_conversational = normalize_pairs(raw_eval, what="eval")
        if eval_conversational != conversational:
            raise ConfigError("The train and eval pairs have different formats (text vs conversational).")
    # Degenerate pairs go before the split: the held-out fraction is a fraction of the pairs worth training on.
    pairs = drop_identical_pairs(LabelledPairs(train, eval_pairs, conversational), source=source)
    return pairs if raw_eval else hold_out_pairs(pairs, fraction=holdout_fraction, seed=seed, source=source)


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


# ---------------------------------------------------------------------------------------------------- tokenization


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


def pairs_to_tensordict(pairs: list[dict], tokenizer, keys: PairKeys, *, conversational: bool):
    """What the trainer reads of each pair, as one TensorDict: right-padded token ids, their lengths, the margin.

    The text stays out of the buffer: indexing strings (non-tensor stacks) costs ~0.2 s per thousand pairs drawn,
    as much as several optimizer steps of a small model, and torchrl's memmap storage cannot hold them.
    """
    chosen_ids, rejected_ids = tokenize_pairs(tokenizer, pairs, conversational=conversational)
    width = max(len(seq) for seq in chosen_ids + rejected_ids)
    pad = tokenizer.pad_token_id
    td = TensorDict(batch_size=[len(pairs)])
    for side, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        tokens, lengths = getattr(keys, f"{side}_tokens"), getattr(keys, f"{side}_length")
        td.set(tensordict_key(tokens), torch.tensor([seq + [pad] * (width - len(seq)) for seq in ids]))
        td.set(tensordict_key(lengths), torch.tensor([len(seq) for seq in ids]))
    if all("margin" in pair for pair in pairs):
        td.set(tensordict_key(keys.margin), torch.tensor([pair["margin"] for pair in pairs], dtype=torch.float32))
    return td
