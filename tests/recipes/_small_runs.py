"""Overrides that make a GRPO run small enough for a test: 2 prompts x 2 responses of at most 8 tokens per step,
scored by the untrained reward base (per process, under torchrun)."""

GRPO_SMALL = [
    "reward_model=tiny_base",
    "rollout.group_size=2",
    "rollout.responses_per_step=4",
    "rollout.generation.max_new_tokens=8",
    "train.mini_batch_size=2",
    "progress_bar=false",
]
