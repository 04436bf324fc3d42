"""Builds the tiny model kit, offline and deterministically: a tokenizer, a policy and a reward-model base.

    python scripts/build_tiny_models.py --overwrite     # rebuilds tiny/policy and tiny/reward_base
    python scripts/build_tiny_models.py --task arithmetic   # writes tiny/arithmetic_policy (about 4 minutes)
    python scripts/build_tiny_models.py --task calculator   # writes tiny/calculator_policy (22 min on 2 busy cores)
    python scripts/build_tiny_models.py --out /tmp/kit --pretrain-steps 50
    # a speed model at a real checkpoint's cost: ~97M parameters, Qwen2.5's 151,936-token vocabulary
    python scripts/build_tiny_models.py --out /tmp/real_vocab --hidden-size 512 --num-layers 6 --pretrain-steps 20 \
        --resize-vocab 151936

Each output folder is a standard Hugging Face checkpoint (config, safetensors weights, tokenizer), loaded with
``from_pretrained(folder)``: exactly the code path a hub id takes. The tokenizer is a byte-level BPE trained on the
synthetic task's corpus, with a ChatML chat template (the one TorchRL falls back to, with ``{% generation %}`` tags
for assistant masks), its own pad token distinct from EOS. The policy, a Qwen2 causal LM of about 0.1M parameters, is
pretrained briefly on reviews of mixed sentiment so that it writes on-distribution text; the reward base is a Qwen2
sequence classifier (num_labels=1) initialised from that policy's backbone, ready for
``recipes/reward_trainer_from_buffer.py``. The trained tiny reward model (tiny/reward_model) is that recipe's output:
``--train-reward-model`` runs it after the build. ``--task arithmetic`` builds the verifiable task's policy instead
(``recipes/tasks/arithmetic.py``): a Qwen2 of about 0.4M parameters pretrained on sums answered in three forms, of
which only the written-out one is reliable. ``--task calculator`` builds the tool-use task's policy
(``recipes/tasks/calculator.py``): a Qwen2 with Qwen2.5's tool-call format in a compact template
(scripts/calculator_chat_template.jinja: ``<tool_call>`` blocks in assistant turns, tool results in
``<tool_response>`` blocks, the tools in one system line), its tokenizer holding the four tool markers as single tokens
as Qwen2.5's does and every digit as its own token, pretrained on the assistant's turns of products answered sometimes
by calling the ``multiply`` tool and otherwise by a guess.

``--resize-vocab N`` gives the policy (and so the reward base) an N-token embedding table and LM head after
pretraining, the new rows drawn around the trained ones (``resize_token_embeddings``, mean resizing): the tokenizer
keeps its own small vocabulary and the text stays on it, but every forward pass pays for a real vocabulary's LM head
and softmax, which is what dominates real checkpoints (Qwen2.5: 151,936 tokens) and what the tiny vocabulary hides. A
speed model for benchmarks, not a text model.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from recipes.common.checkpoint import write_folder_atomically
from recipes.tasks import arithmetic, calculator
from recipes.tasks.synthetic import make_sft_conversations

REPO_ROOT = Path(__file__).resolve().parents[1]
# Qwen's special tokens: pad <|endoftext|> distinct from EOS <|im_end|>; AutoTokenizer then loads this as a
# Qwen2Tokenizer (from config.model_type) with nothing added.
PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
# ChatML, as TorchRL's `chatml_format`: TorchRL renders and parses histories with it, trl with the tokenizer's own.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


# The calculator policy's chat template: Qwen2.5's tool-calling format (`<tool_call>` blocks in assistant turns, tool
# results as `<tool_response>` blocks, prefix-preserving) with the tools listed in one short system line. Qwen2.5's own
# template (scripts/qwen2_5_chat_template.jinja, as trl ships it) spends about 200 tokens on instructions before the
# question, which a tiny model pays for in every pretraining step and every sampled turn.
CALCULATOR_CHAT_TEMPLATE = (Path(__file__).resolve().parent / "calculator_chat_template.jinja").read_text(
    encoding="utf-8"
)
# Single tokens in Qwen2.5's tokenizer (added, not special: decoding keeps them), so a turn can stop at the closing
# tool-call marker.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# A dialog with one tool call renders to about 75 tokens with the compact template.
CALCULATOR_MAX_POSITIONS = 256


# Each task's build settings. The arithmetic policy needs more capacity and steps to learn every sum under the noise
# of its replies (recipes/tasks/arithmetic.py); smaller builds learn too few sums for GRPO to reach 0.9 held out.
TASK_DEFAULTS = {
    "reviews": dict(
        num_conversations=4000, vocab_size=600, hidden_size=64, num_layers=2, pretrain_steps=600, batch_size=32, lr=3e-3
    ),
    "arithmetic": dict(
        num_conversations=8000,
        vocab_size=300,
        hidden_size=128,
        num_layers=2,
        pretrain_steps=4000,
        batch_size=32,
        lr=2e-3,
    ),
    "calculator": dict(
        num_conversations=8000,
        copy_conversations=16000,
        vocab_size=400,
        hidden_size=128,
        num_layers=2,
        pretrain_steps=2500,
        batch_size=32,
        lr=3e-3,
    ),
}


def build_tokenizer(corpus: list[str], *, vocab_size: int, split_digits: bool = False) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on ``corpus`` and wraps it as a standard HF fast tokenizer. ``split_digits``: every
    digit its own pre-token, as Qwen2's pre-tokenizer splits them, so no merge is spent on digit groups."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=PAD, eos_token=EOS, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 256
    return tokenizer


def build_policy(
    tokenizer: PreTrainedTokenizerFast, *, hidden_size: int, num_layers: int, max_positions: int = 256
) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def pretrain(model: Qwen2ForCausalLM, tokenizer, corpus: list[str], *, steps: int, batch_size: int, lr: float):
    """Next-token pretraining on the corpus's texts, padding excluded from the loss. Returns (first, last) loss."""
    ids = tokenizer(corpus)["input_ids"]
    examples = [(row, [1] * len(row)) for row in ids]
    return pretrain_on_tokens(
        model, examples, pad_token_id=tokenizer.pad_token_id, steps=steps, batch_size=batch_size, lr=lr
    )


def pretrain_on_tokens(
    model: Qwen2ForCausalLM,
    examples: list[tuple[list[int], list[int]]],
    *,
    pad_token_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    pack_length: int | None = None,
):
    """Next-token pretraining on ``(token ids, loss mask)`` examples, ``batch_size`` of them a step: only the tokens
    whose mask is 1 are predicted. Each example is a row, right-padded to the batch's longest; with ``pack_length``,
    the step's examples are packed one after another into rows of that many tokens instead, each attending only to
    itself (position ids restart per example, which transformers turns into a block-causal mask), so that no compute
    goes to padding when lengths vary. Returns (first, last) loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    model.train()
    for _ in range(steps):
        drawn = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=generator).tolist()]
        rows = _packed(drawn, pack_length) if pack_length else [[example] for example in drawn]
        width = pack_length or max(len(ids) for ids, _ in drawn)
        input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        position_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
        for index, row in enumerate(rows):
            start = 0
            for ids, mask in row:
                end = start + len(ids)
                input_ids[index, start:end] = torch.tensor(ids)
                labels[index, start:end] = torch.tensor(ids).masked_fill(torch.tensor(mask) == 0, -100)
                position_ids[index, start:end] = torch.arange(len(ids))
                attention_mask[index, start:end] = 1
                start = end
            position_ids[index, start:] = torch.arange(width - start)  # the padding: one more sequence, no labels
        # Packed rows need attention_mask=None and no cache: transformers then reads the sequences off position_ids.
        inputs = dict(position_ids=position_ids) if pack_length else dict(attention_mask=attention_mask)
        loss = model(input_ids=input_ids, labels=labels, use_cache=False, **inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses[0], sum(losses[-20:]) / len(losses[-20:])


def _packed(examples: list, length: int) -> list[list]:
    """The examples in order, in rows of at most ``length`` tokens (a row is closed when the next does not fit)."""
    rows, used = [[]], 0
    for example in examples:
        if len(example[0]) > length:
            raise ValueError(
                f"build_tiny_models: an example of {len(example[0])} tokens does not fit a packed row of {length}."
            )
        if used + len(example[0]) > length:
            rows, used = rows + [[]], 0
        rows[-1].append(example)
        used += len(example[0])
    return rows


def as_loaded(tokenizer: PreTrainedTokenizerFast, policy: Qwen2ForCausalLM):
    """The tokenizer as ``AutoTokenizer.from_pretrained`` will load it beside the policy: a Qwen2Tokenizer, whose own
    pre-tokenizer splits every digit apart (the trained BPE's would merge " 3"). Pretraining on the tokens the
    recipes will feed the model matters where the text has digits."""
    with tempfile.TemporaryDirectory() as folder:
        policy.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return AutoTokenizer.from_pretrained(folder)


def pretrained_policy(conversations: list, args: argparse.Namespace) -> tuple[Qwen2ForCausalLM, object, str]:
    """A tokenizer trained on ``conversations`` and a Qwen2 policy pretrained on them; returns both and a line saying
    the pretraining loss."""
    tokenizer = build_tokenizer(
        [f"{m['role']}\n{m['content']}" for c in conversations for m in c], vocab_size=args.vocab_size
    )
    if args.resize_vocab is not None and args.resize_vocab < len(tokenizer):  # before the pretraining, the long part
        raise SystemExit(
            f"build_tiny_models: --resize-vocab {args.resize_vocab} is smaller than the trained tokenizer's "
            f"{len(tokenizer)} tokens; pass at least that many (or leave --resize-vocab out)."
        )
    policy = build_policy(tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers)
    tokenizer = as_loaded(tokenizer, policy)
    corpus = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    first, last = pretrain(policy, tokenizer, corpus, steps=args.pretrain_steps, batch_size=args.batch_size, lr=args.lr)
    return policy, tokenizer, f"pretraining loss {first:.2f} -> {last:.2f}"


def parameter_count(policy: Qwen2ForCausalLM) -> str:
    return f"{sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters"


def save_policy(policy: Qwen2ForCausalLM, tokenizer, folder: Path, *, max_new_tokens: int) -> None:
    """Writes the policy and its tokenizer as one ``from_pretrained`` folder, atomically."""
    policy.generation_config = GenerationConfig(
        do_sample=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens,
    )

    def write(staging: Path) -> None:
        policy.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    write_folder_atomically(write, folder)


def build_arithmetic_policy(args: argparse.Namespace) -> None:
    """``<out>/arithmetic_policy``: the verifiable task's policy, pretrained on noisy answers to the 100 addition
    problems (``recipes.tasks.arithmetic.make_sft_conversations``)."""
    start = time.perf_counter()
    conversations = arithmetic.make_sft_conversations(args.num_conversations, seed=args.seed)
    policy, tokenizer, description = pretrained_policy(conversations, args)
    print(f"arithmetic policy: {parameter_count(policy)}, {description}")
    save_policy(policy, tokenizer, args.out / "arithmetic_policy", max_new_tokens=16)
    print(f"wrote {args.out / 'arithmetic_policy'} in {time.perf_counter() - start:.0f}s")


def build_calculator_policy(args: argparse.Namespace) -> None:
    """``<out>/calculator_policy``: the tool-use task's policy, pretrained on products answered with or without the
    ``multiply`` tool (``recipes.tasks.calculator.make_sft_conversations``), rendered with the compact Qwen2.5-format
    template (:data:`CALCULATOR_CHAT_TEMPLATE`) and the tool's schema as a trl tool-calling run renders them."""
    start = time.perf_counter()
    # A model this small gains nothing from a second intra-op thread, and on 2 shared cores loses a lot (NOTES.md).
    torch.set_num_threads(1)
    conversations = calculator.make_sft_conversations(args.num_conversations, seed=args.seed)
    # The BPE is trained on the dialogs as the template renders them (the system line included), so it needs a
    # template to render with first: a throwaway tokenizer of the messages' text.
    draft = build_tokenizer([str(m["content"]) for c in conversations for m in c], vocab_size=args.vocab_size)
    draft.chat_template = CALCULATOR_CHAT_TEMPLATE
    # Digits one token each: copying a number into the call's arguments, and the tool's result into the answer, is
    # then copying token by token, which a 2-layer model's induction heads learn; merged digit groups would each be a
    # token to learn separately.
    tokenizer = build_tokenizer(tool_dialogs(draft, conversations), vocab_size=args.vocab_size, split_digits=True)
    tokenizer.add_tokens(list(TOOL_TOKENS))
    tokenizer.chat_template = CALCULATOR_CHAT_TEMPLATE
    tokenizer.model_max_length = CALCULATOR_MAX_POSITIONS
    policy = build_policy(
        tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers, max_positions=CALCULATOR_MAX_POSITIONS
    )
    tokenizer = as_loaded(tokenizer, policy)
    # Only the assistant's tokens are predicted: the question's numbers and the tool's results are random, and a
    # loss on them would only add noise to what the policy has to learn (when to call, and copying).
    examples = [assistant_tokens(tokenizer, conversation) for conversation in conversations]
    # Copying takes far more practice than the call decision: extra dialogs that all call the tool train the copying
    # with their first token (the decision to call) left out of the loss, so that the policy still calls in
    # TOOL_SHARE of its answers.
    call_id = tokenizer.convert_tokens_to_ids(TOOL_TOKENS[0])
    practice = calculator.make_sft_conversations(args.copy_conversations, seed=args.seed + 1, tool_share=1.0)
    for conversation in practice:
        ids, mask = assistant_tokens(tokenizer, conversation)
        mask[ids.index(call_id)] = 0
        examples.append((ids, mask))
    longest = max(len(ids) for ids, _ in examples)
    first, last = pretrain_on_tokens(
        policy,
        examples,
        pad_token_id=tokenizer.pad_token_id,
        steps=args.pretrain_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        pack_length=CALCULATOR_MAX_POSITIONS,
    )
    print(
        f"calculator policy: {parameter_count(policy)}, {len(tokenizer)} tokens, pretraining loss (assistant tokens) "
        f"{first:.2f} -> {last:.2f}, longest pretraining dialog {longest} tokens"
    )
    save_policy(policy, tokenizer, args.out / "calculator_policy", max_new_tokens=48)
    print(f"wrote {args.out / 'calculator_policy'} in {time.perf_counter() - start:.0f}s")


def assistant_tokens(tokenizer, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """The conversation's tokens as the template renders it with the task's tools, and its assistant mask."""
    encoded = tokenizer.apply_chat_template(
        conversation, tools=list(calculator.TOOLS), return_dict=True, return_assistant_tokens_mask=True
    )
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def tool_dialogs(tokenizer, conversations: list) -> list[str]:
    """The conversations as the tokenizer's chat template renders them with the task's tools."""
    return [tokenizer.apply_chat_template(c, tools=list(calculator.TOOLS), tokenize=False) for c in conversations]


def output_folders(args: argparse.Namespace) -> list[Path]:
    """The checkpoint folders this build writes."""
    if args.task == "arithmetic":
        return [args.out / "arithmetic_policy"]
    if args.task == "calculator":
        return [args.out / "calculator_policy"]
    names = ["policy", "reward_base", *(["reward_model"] if args.train_reward_model else [])]
    return [args.out / name for name in names]


def refuse_to_overwrite(args: argparse.Namespace) -> None:
    """Stops before any work when a folder this build writes already holds a checkpoint, unless ``--overwrite``: the
    default ``--out`` is the committed tiny/ kit, which every test and default run loads."""
    existing = [folder for folder in output_folders(args) if folder.is_dir() and any(folder.iterdir())]
    if existing and not args.overwrite:
        raise SystemExit(
            f"build_tiny_models: {', '.join(map(str, existing))} already hold(s) a checkpoint (the default --out is "
            "the committed tiny/ kit). Pass --overwrite to replace it, or --out <another folder> to build beside it."
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tiny", help="folder that receives the checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    # Defaults per --task (TASK_DEFAULTS): the settings the shipped tiny/ folders were built with.
    parser.add_argument("--num-conversations", type=int, default=None)
    parser.add_argument(
        "--copy-conversations",
        type=int,
        default=None,
        help="calculator: extra dialogs that all call the tool, their call decision left out of the loss",
    )
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--pretrain-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument(
        "--resize-vocab",
        type=int,
        default=None,
        help="after pretraining, resize the policy's embeddings and LM head to this many tokens (a speed model)",
    )
    parser.add_argument(
        "--task",
        choices=("reviews", "arithmetic", "calculator"),
        default="reviews",
        help="reviews: the policy and reward base of the review task; arithmetic: <out>/arithmetic_policy, the "
        "verifiable task's policy (recipes/tasks/arithmetic.py), its answers pretrained right about a third of the "
        "time; calculator: <out>/calculator_policy, the tool-use task's policy (recipes/tasks/calculator.py), which "
        "calls its multiply tool in about a quarter of its answers",
    )
    parser.add_argument(
        "--train-reward-model",
        action="store_true",
        help="then run recipes/reward_trainer_from_buffer.py and store its model as <out>/reward_model",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace checkpoint folders that already exist in --out (the committed tiny/ kit included)",
    )
    args = parser.parse_args(argv)
    if args.resize_vocab is not None and args.task != "reviews":
        parser.error(f"--resize-vocab resizes the review task's policy (a speed model); --task {args.task} has none")
    refuse_to_overwrite(args)
    for name, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.task == "arithmetic":
        build_arithmetic_policy(args)
        return
    if args.task == "calculator":
        build_calculator_policy(args)
        return
    conversations = make_sft_conversations(args.num_conversations, seed=args.seed)
    policy, tokenizer, description = pretrained_policy(conversations, args)
    if args.resize_vocab is not None:  # at least the tokenizer's size: pretrained_policy checked it
        policy.resize_token_embeddings(args.resize_vocab, mean_resizing=True)
    print(f"policy: {parameter_count(policy)}, {description}")  # after any resize: the size a run pays for
    save_policy(policy, tokenizer, args.out / "policy", max_new_tokens=48)

    def save_reward_base(folder: Path) -> None:
        torch.manual_seed(args.seed)  # the score head's initialisation
        reward_base = AutoModelForSequenceClassification.from_pretrained(args.out / "policy", num_labels=1)
        reward_base.config.pad_token_id = tokenizer.pad_token_id
        reward_base.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    write_folder_atomically(save_reward_base, args.out / "reward_base")
    print(f"wrote {args.out / 'policy'} and {args.out / 'reward_base'} in {time.perf_counter() - start:.0f}s")

    if args.train_reward_model:
        with tempfile.TemporaryDirectory() as run_dir:
            command = [
                sys.executable,
                str(REPO_ROOT / "recipes" / "reward_trainer_from_buffer.py"),
                f"model.name_or_path={args.out / 'policy'}",
                f"reward_model.name_or_path={args.out / 'reward_base'}",
                f"hydra.run.dir={run_dir}",
            ]
            subprocess.run(command, check=True)
            write_folder_atomically(
                lambda folder: shutil.copytree(Path(run_dir) / "model", folder, dirs_exist_ok=True),
                args.out / "reward_model",
            )
        print(f"wrote {args.out / 'reward_model'}")


if __name__ == "__main__":
    main()
