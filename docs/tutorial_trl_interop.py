"""
TorchRL <-> trl interoperability: replay buffers as trl datasets, HF reward models as TorchRL rewards
=====================================================================================================

This tutorial walks the two adapters of :mod:`interop` in both directions, then composes them:

* **TorchRL -> trl**: :class:`interop.TorchRLBufferDataset` exposes a TorchRL replay buffer as a PyTorch / Hugging
  Face iterable dataset that ``trl`` trainers consume; :func:`interop.tensordict_collate` turns its samples back
  into a batched ``TensorDict``.
* **trl -> TorchRL**: :class:`interop.HFRewardModelWrapper` scores TorchRL rollouts with a Hugging Face reward model
  (for instance one trained by ``trl.RewardTrainer``); :class:`interop.RewardModelTransform` turns it into the
  reward of a TorchRL LLM env, with the shape ``MCAdvantage`` and ``GRPOLoss`` expect.
* **Both**: a preference buffer trains a reward model with ``trl.RewardTrainer``; that model then rewards a TorchRL
  GRPO step.

It follows TorchRL's own TRL-interoperability tutorial (same calls; only the import line changes to
``from interop import ...``) and adds what real LLM rollouts need: ragged (unpadded) rollouts, and a reward model
whose tokenizer is not the policy's.

Everything runs offline on CPU in well under a minute: the tokenizers and models are tiny and built right here.

Run it with ``python docs/tutorial_trl_interop.py``.
"""

# %%
# Setup
# -----
# TorchRL's LLM stack stores lists (strings, chat histories) in tensordicts: enable that first.

import atexit
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import tensordict
import torch
from tensordict import TensorDict, lazy_stack

tensordict.set_list_to_stack(True).set()
warnings.filterwarnings("ignore")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from torchrl.data import LazyStackStorage, ListStorage, ReplayBuffer  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

from interop import HFRewardModelWrapper, RewardModelTransform, TorchRLBufferDataset, tensordict_collate  # noqa: E402

torch.manual_seed(0)
random.seed(0)
WORKDIR = Path(tempfile.mkdtemp(prefix="trl_interop_tutorial_"))
atexit.register(shutil.rmtree, WORKDIR, ignore_errors=True)  # the tutorial's models and trainer output go with it

# %%
# Two tiny tokenizers and models stand in for real checkpoints. The policy and the reward model deliberately have
# **different tokenizers** (different vocabularies), as a real policy and a real reward model usually do. Each is
# saved to a folder and loaded back with ``from_pretrained``, the code path a hub checkpoint takes. Both use ChatML
# and a pad token distinct from EOS (a sequence classifier scores the last non-pad token: if pad were EOS, the final
# EOS would be taken for padding).

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(name: str, corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", eos_token="<|im_end|>")
    tok.chat_template = CHATML
    tok.save_pretrained(WORKDIR / name)
    return AutoTokenizer.from_pretrained(WORKDIR / name)


def tiny_config(tok, **kwargs) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **kwargs,
    )


GOOD, BAD = ["good", "great", "fine"], ["bad", "awful", "poor"]
policy_tok = make_tokenizer("policy", ["Hello world, what is two plus two? It is four. 0123456789 plus."] * 20, 320)
policy_tok.padding_side = "left"  # TorchRL's TransformersWrapper generates with left padding
reward_tok = make_tokenizer("reward", [" ".join(["what is the answer", *GOOD, *BAD])] * 20, 270)
policy = Qwen2ForCausalLM(tiny_config(policy_tok))
with torch.no_grad():  # an untrained policy rarely stops; make EOS likely so that answers have various lengths
    policy.lm_head.weight[policy_tok.eos_token_id] = torch.randn(32)
print(f"policy vocabulary: {len(policy_tok)} tokens, reward-model vocabulary: {len(reward_tok)} tokens")

# %%
# Part 1 -- TorchRL -> trl: TorchRLBufferDataset
# ==============================================
#
# A replay buffer filled by a collector becomes an iterable dataset: each iterator draws ``num_batches`` batches of
# ``batch_size`` and yields one flat ``dict`` per sample.

SEQ_LEN, BATCH_SIZE = 16, 8
rb = ReplayBuffer(storage=ListStorage(max_size=200), batch_size=BATCH_SIZE)
for _ in range(40):
    rb.add(
        TensorDict(
            {
                "prompt": "Explain one reinforcement-learning concept.",
                "input_ids": torch.randint(0, 1000, (SEQ_LEN,)),
                "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long),
                "reward": torch.randn(()),
            },
            batch_size=[],
        )
    )
samples = list(TorchRLBufferDataset(rb, batch_size=BATCH_SIZE, num_batches=1))
assert len(samples) == BATCH_SIZE and samples[0]["input_ids"].shape == (SEQ_LEN,)
assert samples[0]["prompt"] == "Explain one reinforcement-learning concept."  # strings come out as plain str

# %%
# ``keys`` restricts the output; nested keys come out dot-joined (``("tokens", "full")`` -> ``"tokens.full"``),
# the string keys Hugging Face collators expect; ``device`` moves tensors.

filtered = next(iter(TorchRLBufferDataset(rb, batch_size=BATCH_SIZE, keys=["input_ids", "attention_mask"])))
assert set(filtered) == {"input_ids", "attention_mask"}
on_cpu = next(iter(TorchRLBufferDataset(rb, batch_size=BATCH_SIZE, device="cpu")))
assert all(v.device.type == "cpu" for v in on_cpu.values() if isinstance(v, torch.Tensor))

# %%
# Ragged rollouts
# ---------------
# TorchRL's LLM wrappers with ``pad_output=False`` (what TorchRL's GRPO uses) store one tensor per sample, each of its
# own length, in a ``LazyStackStorage``. Each sample keeps its length; ``tensordict_collate`` pads a batch of them back
# into a ``TensorDict``, with a mask of the real tokens.


def rollout_like(lengths: list[int]) -> TensorDict:
    """The layout of ``TransformersWrapper(pad_output=False)`` rollouts: per-sample tensors of different lengths."""
    return lazy_stack(
        [
            TensorDict(
                {
                    "tokens": {"full": torch.randint(3, len(reward_tok), (n,))},
                    "masks": {"all_attention_mask": torch.ones(n, dtype=torch.bool)},
                }
            )
            for n in lengths
        ]
    )


ragged_rb = ReplayBuffer(storage=LazyStackStorage(64))
ragged_rb.extend(rollout_like([5, 9, 3, 12, 7, 4]))
ragged_ds = TorchRLBufferDataset(ragged_rb, batch_size=4, keys=[("tokens", "full"), ("masks", "all_attention_mask")])
ragged_samples = list(ragged_ds)
print("sample lengths:", [len(s["tokens.full"]) for s in ragged_samples])
batch = tensordict_collate(ragged_samples, padding_value={"tokens.full": reward_tok.pad_token_id})
print("collated:", batch["tokens", "full"].shape, "mask of real tokens per row:", batch["tokens", "full_mask"].sum(-1))

# %%
# For ``trl`` trainers, ``as_hf_dataset()`` gives the same samples as a ``datasets.IterableDataset`` with declared
# features (``num_batches=None`` streams forever; the trainer's ``max_steps`` stops it).

hf_ds = TorchRLBufferDataset(rb, batch_size=BATCH_SIZE, keys=["prompt", "reward"], num_batches=None).as_hf_dataset()
print("datasets features:", hf_ds.features)

# %%
# Part 2 -- trl -> TorchRL: HFRewardModelWrapper
# ==============================================
#
# The wrapper reads token ids (and the attention mask) from a tensordict, calls the reward model and writes one
# float32 reward per sample. First, TorchRL's tutorial as is, with its toy model:


class ToyRewardModel(torch.nn.Linear):
    """Mimics ``AutoModelForSequenceClassification``: returns an output with ``logits`` of shape ``[B, 1]``."""

    def __init__(self):
        super().__init__(SEQ_LEN, 1, bias=False)

    def forward(self, input_ids, attention_mask=None):
        x = input_ids.float() if attention_mask is None else input_ids.float() * attention_mask.float()

        class _Out:
            pass

        out = _Out()
        out.logits = super().forward(x)
        return out


reward_fn = HFRewardModelWrapper(
    ToyRewardModel(),
    token_key=("tokens", "full"),
    attention_mask_key=("masks", "all_attention_mask"),
    reward_key="reward",
    inference_mode=True,  # torch.no_grad(): no graph, and the reward stays usable in later autograd code
)
assert ("tokens", "full") in reward_fn.in_keys and "reward" in reward_fn.out_keys
B = 4
td = TensorDict(
    {
        "tokens": TensorDict({"full": torch.randint(0, 1000, (B, SEQ_LEN))}, batch_size=[B]),
        "masks": TensorDict({"all_attention_mask": torch.ones(B, SEQ_LEN, dtype=torch.long)}, batch_size=[B]),
    },
    batch_size=[B],
)
result = reward_fn(td)
assert result["reward"].shape == (B,) and result["reward"].dtype == torch.float32

# custom keys, nested reward key
reward_fn_custom = HFRewardModelWrapper(
    ToyRewardModel(),
    token_key="input_ids",
    attention_mask_key="attention_mask",
    reward_key=("reward", "value"),
    inference_mode=True,
)
td2 = TensorDict(
    {"input_ids": torch.randint(0, 1000, (B, SEQ_LEN)), "attention_mask": torch.ones(B, SEQ_LEN, dtype=torch.long)},
    batch_size=[B],
)
assert reward_fn_custom(td2).get(("reward", "value")).shape == (B,)

# %%
# A real reward model on ragged rollouts
# --------------------------------------
# A Hugging Face sequence classifier (``num_labels=1``) on the ragged rollouts of Part 1. TorchRL's reference wrapper
# cannot read them (``Failed to stack tensors``); ours pads each batch itself, with the reward model's pad id (right
# padding by default) and a correct attention mask, so every sample gets the score it would get alone.

reward_model = Qwen2ForSequenceClassification(tiny_config(reward_tok, num_labels=1)).eval()
rollouts = rollout_like([5, 9, 3, 12])
try:
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as ReferenceWrapper

    ReferenceWrapper(reward_model, inference_mode=True)(rollouts)
except RuntimeError as err:
    print("TorchRL's reference wrapper:", str(err).splitlines()[0])

scorer = HFRewardModelWrapper(reward_model, inference_mode=True)
ragged_reward = scorer(rollouts)["reward"]
with torch.no_grad():
    alone = torch.stack(
        [reward_model(input_ids=ids[None]).logits.view(()) for ids in rollouts.get(("tokens", "full"), as_list=True)]
    )
torch.testing.assert_close(ragged_reward, alone, atol=1e-5, rtol=1e-5)
print("ragged rewards:", ragged_reward)

# %%
# The collated batch of Part 1 (padded by ``tensordict_collate``) scores the same as the ragged samples it came from:
# the two directions compose.

from_collated = scorer(batch.clone())["reward"]  # dense [4, T] ids and mask: passed to the model as they are
ragged_again = lazy_stack(
    [
        TensorDict(
            {"tokens": {"full": s["tokens.full"]}, "masks": {"all_attention_mask": s["masks.all_attention_mask"]}}
        )
        for s in ragged_samples
    ]
)
from_ragged = scorer(ragged_again)["reward"]
torch.testing.assert_close(from_collated, from_ragged, atol=1e-5, rtol=1e-5)

# %%
# ``micro_batch_size`` scores a large rollout batch in chunks (each padded to its own longest sequence) so it never
# goes through the model at once; ``max_length`` truncates. Rewards are float32 on the tensordict's device whatever
# the model's dtype and device.

chunked = HFRewardModelWrapper(reward_model, inference_mode=True, micro_batch_size=2)(rollout_like([5, 9, 3, 12]))
assert chunked["reward"].shape == (4,)

# %%
# Tokenizer mismatch
# ------------------
# The policy's token ids mean nothing to a reward model with another tokenizer (here some are even past the end of
# its embedding table). Give the wrapper the reward model's ``tokenizer``: it then scores the *text* at ``text_key``
# (``("text", "full")``: prompt + response as TorchRL's wrappers write it), or, with ``history_key``, the chat
# ``History`` rendered with the reward tokenizer's own chat template. It tokenizes exactly as ``trl.RewardTrainer``
# did in training: plain text gets the EOS string appended (when missing) and special tokens; conversations go
# through ``apply_chat_template(messages, tokenize=True)``.

from torchrl.data.llm import History  # noqa: E402

chats = [
    [{"role": "user", "content": "what is the answer?"}, {"role": "assistant", "content": "the answer is good"}],
    [{"role": "user", "content": "what is the answer?"}, {"role": "assistant", "content": "awful"}],
]
mismatch_td = TensorDict(
    {
        "history": {"full": History.from_chats(chats)},
        "text": {"full": [policy_tok.apply_chat_template(c, tokenize=False) for c in chats]},
    },
    batch_size=[2],
)
by_history = HFRewardModelWrapper(
    reward_model, tokenizer=reward_tok, history_key=("history", "full"), inference_mode=True
)
by_text = HFRewardModelWrapper(reward_model, tokenizer=reward_tok, text_key=("text", "full"), inference_mode=True)
with torch.no_grad():
    manual = torch.stack(
        [
            reward_model(
                input_ids=torch.tensor([reward_tok.apply_chat_template(c, tokenize=True)["input_ids"]])
            ).logits.view(())
            for c in chats
        ]
    )
torch.testing.assert_close(by_history(mismatch_td.clone())["reward"], manual.float(), atol=1e-5, rtol=1e-5)
print("scored with the reward tokenizer:", by_text(mismatch_td.clone())["reward"])

# %%
# Part 3 -- Both directions: a preference buffer trains a reward model that rewards GRPO
# =====================================================================================
#
# Step 1: preference pairs in a TorchRL buffer -> ``as_hf_dataset()`` -> ``trl.RewardTrainer``. The prompts are
# stored as the policy's chat-rendered text, the layout TorchRL's text rollouts have, so that the trained model later
# scores ``("text", "full")`` in the same format it was trained on.

from trl import RewardConfig, RewardTrainer  # noqa: E402

preference_rb = ReplayBuffer(storage=ListStorage(max_size=64))
for i in range(32):
    question = [{"role": "user", "content": f"what is {i} plus two?"}]
    preference_rb.add(
        TensorDict(
            {
                "prompt": policy_tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True),
                "chosen": f"the answer is {random.choice(GOOD)}",
                "rejected": f"the answer is {random.choice(BAD)}",
            },
            batch_size=[],
        )
    )
train_stream = TorchRLBufferDataset(
    preference_rb, batch_size=16, keys=["prompt", "chosen", "rejected"], num_batches=None
).as_hf_dataset()
trained_rm = Qwen2ForSequenceClassification(tiny_config(reward_tok, num_labels=1))
trainer = RewardTrainer(
    model=trained_rm,
    args=RewardConfig(
        output_dir=str(WORKDIR / "rm"),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=4,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        activation_checkpointing=False,
        disable_tqdm=True,
    ),
    train_dataset=train_stream,
    processing_class=reward_tok,
)
trainer.train()
losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
print(f"RewardTrainer loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
trained_rm.eval()

# %%
# Step 2: the trained model scores TorchRL text exactly as RewardTrainer tokenized it. A prompt + response gets the
# score of ``reward_tok(prompt + response + EOS)``, the ids the trainer trained on:

pair = preference_rb[0]
check_td = TensorDict({"text": {"full": [pair["prompt"] + pair["chosen"], pair["prompt"] + pair["rejected"]]}}, [2])
rm_scorer = HFRewardModelWrapper(trained_rm, tokenizer=reward_tok, text_key=("text", "full"), inference_mode=True)
scores = rm_scorer(check_td)["reward"]
with torch.no_grad():
    trainer_view = [reward_tok(t + reward_tok.eos_token)["input_ids"] for t in check_td.get(("text", "full")).tolist()]
    expected = torch.stack([trained_rm(input_ids=torch.tensor([ids])).logits.view(()) for ids in trainer_view])
torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
print(f"chosen {scores[0]:+.3f} vs rejected {scores[1]:+.3f}")

# %%
# Step 3: the reward model rewards a TorchRL GRPO step. ``RewardModelTransform`` declares the env's reward
# (``ChatEnv`` has none) with shape ``batch + (1, 1)`` and scores each step; an ``LLMCollector`` writes the ragged
# rollouts through ``MCAdvantage`` into a ``LazyStackStorage`` buffer; ``GRPOLoss`` takes a backward step.

from torchrl.collectors.llm import LLMCollector  # noqa: E402
from torchrl.envs import StepCounter  # noqa: E402
from torchrl.envs.llm import ChatEnv  # noqa: E402
from torchrl.modules.llm import TransformersWrapper  # noqa: E402
from torchrl.objectives.llm import GRPOLoss, MCAdvantage  # noqa: E402

GROUP = 4


class Prompts:
    """``ChatEnv.from_dataloader`` reads ``{"query": [str]}`` batches of size 1; each prompt is repeated GROUP times."""

    batch_size = 1

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return {"query": [f"what is {self.i} plus two?"]}


env = ChatEnv.from_dataloader(
    dataloader=Prompts(), repeats=GROUP, batch_size=(GROUP,), tokenizer=policy_tok, input_mode="history"
)
env = env.append_transform(StepCounter(max_steps=1))  # single-turn episodes
env = env.append_transform(RewardModelTransform(rm_scorer))  # reads ("text", "full") of each step
print("reward spec shape:", env.full_reward_spec["reward"].shape)

generator = TransformersWrapper(
    policy,
    tokenizer=policy_tok,
    input_mode="history",
    generate=True,
    return_log_probs=True,
    pad_output=False,
    generate_kwargs={"max_new_tokens": 12, "do_sample": True},
)
# the learner re-reads the sampled tokens (input_mode="tokens"): re-tokenizing the history could disagree with them
learner = TransformersWrapper(
    policy, tokenizer=policy_tok, input_mode="tokens", generate=False, return_log_probs=True, pad_output=False
)


def with_old_log_probs(data):
    """Generation leaves ("log_probs", "full") empty; GRPOLoss needs the old log-probs of the whole sequence."""
    with torch.no_grad():
        for sample in data.unbind(0):
            out = learner(sample.select(("tokens", "full"), ("masks", "all_attention_mask")).copy())
            sample.set(("log_probs", "full"), out.get(("log_probs", "full")))
    return data


grpo_rb = ReplayBuffer(storage=LazyStackStorage(4 * GROUP), batch_size=GROUP)
grpo_rb.append_transform(MCAdvantage(grpo_size=GROUP))
collector = LLMCollector(
    env,
    policy=generator,
    dialog_turns_per_batch=GROUP,
    total_dialog_turns=2 * GROUP,
    replay_buffer=grpo_rb,
    postproc=with_old_log_probs,
)
for _ in collector:
    pass
stored = grpo_rb[:]
print("rollout lengths:", [len(t) for t in stored.get(("tokens", "full"), as_list=True)])
print("rewards:", stored.get(("next", "reward")).view(-1))
print("advantages:", stored.get("advantage").view(-1))

loss_fn = GRPOLoss(learner, clip_epsilon=0.2, masking_strategy="sft")
losses = loss_fn(grpo_rb.sample(GROUP))
total = sum(value for key, value in losses.items() if key.startswith("loss_"))
total.backward()
grad_norm = sum(p.grad.abs().sum() for p in policy.parameters() if p.grad is not None)
assert torch.isfinite(total) and grad_norm > 0
print(f"GRPO loss {total.item():.4f}, gradient L1 norm {grad_norm.item():.3f}")

# %%
# Conclusion
# ----------
# * ``TorchRLBufferDataset`` feeds a TorchRL buffer to ``trl`` (``as_hf_dataset()``), ragged rollouts included, and
#   ``tensordict_collate`` brings samples back to a ``TensorDict``.
# * ``HFRewardModelWrapper`` scores TorchRL data with an HF reward model: padded or ragged token ids, or text /
#   conversations re-tokenized with the reward model's own tokenizer exactly as ``trl.RewardTrainer`` trained it.
# * ``RewardModelTransform`` makes that score the reward of a TorchRL LLM env, in the shape ``MCAdvantage`` and
#   ``GRPOLoss`` take as is.
