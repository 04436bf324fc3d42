"""Tiny tokenizers and Qwen2 configs built in-test, for tests that need a tokenizer other than the shipped kit's."""

from __future__ import annotations

import torch
import transformers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(
    folder,
    corpus,
    vocab_size,
    *,
    special_tokens=("<|pad|>", "<|im_start|>", "<|im_end|>"),
    pad_token="<|pad|>",
    eos_token="<|im_end|>",
    chat_template=CHATML,
):
    """A byte-level BPE tokenizer (ChatML, pad distinct from EOS by default), saved and reloaded from ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=pad_token, eos_token=eos_token)
    tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def qwen2_config(tok, **overrides):
    """A tiny Qwen2 config over ``tok``'s vocabulary and special ids; ``overrides`` replace or add fields."""
    fields = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    return transformers.Qwen2Config(**{**fields, **overrides})


def build_reward_model_with_own_tokenizer(folder):
    """A Qwen2 reward model (``num_labels=1``, untrained) whose tokenizer is not the tiny policy's: another
    vocabulary, pad id and chat template. Saved to ``folder``, which is returned."""
    from recipes.tasks.synthetic import make_sft_conversations

    corpus = [m["content"] for c in make_sft_conversations(300, seed=7) for m in c]
    tokenizer = build_tokenizer(
        folder,
        corpus,
        350,
        special_tokens=("<eos>", "<pad>", "<u>", "<a>"),
        pad_token="<pad>",
        eos_token="<eos>",
        chat_template="{% for m in messages %}{{ '<u>' if m['role'] == 'user' else '<a>' }}{{ m['content'] }}<eos>"
        "{% endfor %}",
    )
    torch.manual_seed(0)
    config = qwen2_config(tokenizer, num_hidden_layers=1, num_labels=1)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    return folder


class ToyRewardModel(torch.nn.Linear):
    """The stand-in reward model of TorchRL's TRL-interoperability tutorial (Linear over the token ids)."""

    def __init__(self, seq_len):
        super().__init__(seq_len, 1, bias=False)

    def forward(self, input_ids, attention_mask=None):
        x = input_ids.float()
        if attention_mask is not None:
            x = x * attention_mask.float()

        class _Out:
            pass

        out = _Out()
        out.logits = super().forward(x)
        return out


def load_build_script(repo_root):
    """``scripts/build_tiny_models.py`` as a module (scripts/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny_models", repo_root / "scripts" / "build_tiny_models.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def run_build_script(repo_root, *arguments: str) -> None:
    """``python scripts/build_tiny_models.py <arguments>`` through its ``main(argv)``, in this process: a process of
    its own would spend 4-5 s importing torch and transformers again (tests/recipes/common/test_common.py keeps one
    run as a user types it). The script seeds torch's generator and may set one torch thread: both are put back."""
    build = load_build_script(repo_root)
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            build.main(list(arguments))
    finally:
        torch.set_num_threads(threads)
