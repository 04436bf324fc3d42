"""Builds the tiny model kit, offline and deterministically: a tokenizer, a policy and a reward-model base.

    python scripts/build_tiny_models.py --overwrite     # rebuilds tiny/policy and tiny/reward_base
    python scripts/build_tiny_models.py --task arithmetic   # writes tiny/arithmetic_policy (about 4 minutes)
    python scripts/build_tiny_models.py --task calculator   # writes tiny/calculator_policy
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
(``recipes/common/arithmetic.py``): a Qwen2 of about 0.4M parameters pretrained on sums answered in three forms, of
which only the written-out one is reliable. ``--task calculator`` builds the tool-use task's policy
(``recipes/common/calculator.py``): a Qwen2 with Qwen2.5's own chat template (tools in the system message,
``<tool_call>`` blocks in assistant turns, tool results in ``<tool_response>`` blocks), its tokenizer holding
``<tool_call>`` and ``</tool_call>`` as single tokens as Qwen2.5's does, pretrained on products answered sometimes by
calling the ``multiply`` tool and otherwise by a guess.

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

from recipes.common import arithmetic, calculator
from recipes.common.checkpoint import write_folder_atomically
from recipes.common.synthetic import make_sft_conversations

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


# Qwen2.5's chat template, verbatim from its tokenizer_config.json (trl ships the same file as
# trl/chat_templates/qwen2_5.jinja and recognises the template by identity): the tools' JSON schemas in the system
# message, `<tool_call>` blocks in assistant turns, tool results as `<tool_response>` blocks in a user turn. The
# calculator policy's template.
QWEN2_5_CHAT_TEMPLATE = (Path(__file__).resolve().parent / "qwen2_5_chat_template.jinja").read_text(encoding="utf-8")
# Single tokens in Qwen2.5's tokenizer (added, not special: decoding keeps them), so a turn can stop at the closing one.
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
CALCULATOR_MAX_POSITIONS = 512


# Each task's build settings. The arithmetic policy needs more capacity and steps to learn every sum under the noise
# of its replies (recipes/common/arithmetic.py); smaller builds learn too few sums for GRPO to reach 0.9 held out.
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
        vocab_size=1000,
        hidden_size=128,
        num_layers=2,
        pretrain_steps=1500,
        batch_size=16,
        lr=2e-3,
    ),
}


def build_tokenizer(corpus: list[str], *, vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on ``corpus`` and wraps it as a standard HF fast tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
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
    """Next-token pretraining on the corpus, padding excluded from the loss. Returns (first, last) loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    tokenizer.padding_side = "right"
    losses = []
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(corpus), (batch_size,), generator=generator).tolist()
        batch = tokenizer([corpus[i] for i in rows], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    tokenizer.padding_side = "left"
    model.eval()
    return losses[0], sum(losses[-20:]) / len(losses[-20:])


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
    problems (``recipes.common.arithmetic.make_sft_conversations``)."""
    start = time.perf_counter()
    conversations = arithmetic.make_sft_conversations(args.num_conversations, seed=args.seed)
    policy, tokenizer, description = pretrained_policy(conversations, args)
    print(f"arithmetic policy: {parameter_count(policy)}, {description}")
    save_policy(policy, tokenizer, args.out / "arithmetic_policy", max_new_tokens=16)
    print(f"wrote {args.out / 'arithmetic_policy'} in {time.perf_counter() - start:.0f}s")


def build_calculator_policy(args: argparse.Namespace) -> None:
    """``<out>/calculator_policy``: the tool-use task's policy, pretrained on products answered with or without the
    ``multiply`` tool (``recipes.common.calculator.make_sft_conversations``), rendered with Qwen2.5's chat template and
    the tool's schema as a trl tool-calling run renders them."""
    start = time.perf_counter()
    conversations = calculator.make_sft_conversations(args.num_conversations, seed=args.seed)
    # The BPE is trained on the dialogs as the template renders them (the system message's tool instructions and
    # schema included), so it needs a template to render with first: a throwaway tokenizer of the messages' text.
    draft = build_tokenizer([str(m["content"]) for c in conversations for m in c], vocab_size=args.vocab_size)
    draft.chat_template = QWEN2_5_CHAT_TEMPLATE
    rendered = tool_dialogs(draft, conversations)
    tokenizer = build_tokenizer(rendered, vocab_size=args.vocab_size)
    tokenizer.add_tokens(list(TOOL_CALL_TOKENS))
    tokenizer.chat_template = QWEN2_5_CHAT_TEMPLATE
    # Qwen2.5's tool instructions alone take about 200 tokens: a dialog with one tool call about 300.
    tokenizer.model_max_length = CALCULATOR_MAX_POSITIONS
    policy = build_policy(
        tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers, max_positions=CALCULATOR_MAX_POSITIONS
    )
    tokenizer = as_loaded(tokenizer, policy)
    corpus = tool_dialogs(tokenizer, conversations)
    longest = max(len(ids) for ids in tokenizer(corpus)["input_ids"])
    first, last = pretrain(policy, tokenizer, corpus, steps=args.pretrain_steps, batch_size=args.batch_size, lr=args.lr)
    print(
        f"calculator policy: {parameter_count(policy)}, pretraining loss {first:.2f} -> {last:.2f}, longest "
        f"pretraining dialog {longest} tokens"
    )
    save_policy(policy, tokenizer, args.out / "calculator_policy", max_new_tokens=48)
    print(f"wrote {args.out / 'calculator_policy'} in {time.perf_counter() - start:.0f}s")


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
        "verifiable task's policy (recipes/common/arithmetic.py), its answers pretrained right about a third of the "
        "time; calculator: <out>/calculator_policy, the tool-use task's policy (recipes/common/calculator.py), which "
        "calls its multiply tool about a third of the time",
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
    if args.resize_vocab is not None:
        if args.resize_vocab < len(tokenizer):
            parser.error(f"--resize-vocab {args.resize_vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
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
