"""A small ragged rollout of TorchRL's chat stack on the tiny policy, for the chat-stack and GRPO rollout tests."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from recipes.common.chat import make_chat_env, make_policy, make_prompt_dataloader

GENERATION = OmegaConf.create({"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "do_sample": True})


def sample_two_prompts(tiny_policy, *, group_size: int, seed: int, generation):
    """One ragged rollout of the tiny policy: two prompts, ``group_size`` responses each."""
    model, tokenizer = tiny_policy
    torch.manual_seed(seed)
    loader = make_prompt_dataloader(["Review the mug.", "What do you think of the bike?"], seed=0)
    env = make_chat_env(loader, tokenizer=tokenizer, group_size=group_size, num_prompts=2)
    return make_policy(model, tokenizer, generation=generation)(env.reset())
