"""trl's trainers read TorchRL buffers through ``TorchRLBufferDataset.as_hf_dataset()``.

``RewardTrainer`` learns from a buffer of preference pairs (its loss falls), and ``GRPOTrainer`` takes its prompts
from a buffer and trains a few steps with a callable reward. Tiny shipped checkpoints, on CPU.
"""

from __future__ import annotations

import os

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer

from interop import TorchRLBufferDataset

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CPU_ARGS = {"use_cpu": True, "bf16": False, "fp16": False, "report_to": "none", "save_strategy": "no"}


def preference_buffer(num: int = 64) -> ReplayBuffer:
    """Pairs whose preferred answer is always the polite one: a signal a tiny reward model picks up in a few steps."""
    rb = ReplayBuffer(storage=ListStorage(num))
    topics = ["the weather", "a recipe", "the news", "a poem", "the answer", "some music", "a story", "the game"]
    for i in range(num):
        topic = topics[i % len(topics)]
        rb.add(
            TensorDict(
                {
                    "prompt": f"Tell me about {topic}.",
                    "chosen": f"Thank you for asking, here is {topic}, I hope it helps.",
                    "rejected": f"No. Go away, {topic} is boring.",
                },
                batch_size=[],
            )
        )
    return rb


def test_reward_trainer_learns_from_a_torchrl_buffer(tiny_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "reward_base")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_dir / "reward_base", num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    train = TorchRLBufferDataset(
        preference_buffer(), batch_size=16, keys=["prompt", "chosen", "rejected"], num_batches=None
    ).as_hf_dataset()
    assert train.features is not None and set(train.features) == {"prompt", "chosen", "rejected"}

    torch.manual_seed(0)
    args = RewardConfig(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=1,
        gradient_checkpointing=False,
        activation_checkpointing=False,
        max_length=64,
        **CPU_ARGS,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 10 and len(losses) == 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 0.5, f"the untrained model should be near chance (log 2), got {first:.3f}"
    assert last < 0.5 * first, f"loss should fall: first steps {first:.3f}, last steps {last:.3f}"

    # The trained model now prefers the polite answer to an unseen prompt.
    model.eval()
    with torch.no_grad():
        scores = [
            model(**tokenizer(text + tokenizer.eos_token, return_tensors="pt")).logits.item()
            for text in ["Thank you for asking, here is a joke, I hope it helps.", "No. Go away, a joke is boring."]
        ]
    assert scores[0] > scores[1]


def test_grpo_trainer_reads_prompts_from_a_torchrl_buffer(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    prompts = [f"Count to {n}:" for n in range(1, 17)]
    rb = ReplayBuffer(storage=LazyTensorStorage(len(prompts)))
    rb.extend(TensorDict({"prompt": prompts, "difficulty": torch.arange(16)}, batch_size=[16]))
    train = TorchRLBufferDataset(rb, batch_size=8, keys=["prompt"], num_batches=None).as_hf_dataset()

    seen: list[str] = []

    def reward_length(prompts, completions, **kwargs):
        seen.extend(prompts)
        return [float(len(completion)) for completion in completions]

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "policy")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy")
    before = [p.detach().clone() for p in model.parameters()]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        learning_rate=1e-3,
        logging_steps=1,
        activation_checkpointing=False,
        **CPU_ARGS,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_length, args=args, train_dataset=train, processing_class=tokenizer
    )
    trainer.train()

    assert trainer.state.global_step == 2
    assert len(seen) >= 8 and set(seen) <= set(prompts), "every prompt the trainer scored came from the buffer"
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    assert changed, "the policy's weights should move after two GRPO steps"
