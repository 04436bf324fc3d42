"""One vocabulary for the two GRPO recipes: the ``trl.GRPOConfig`` fields of the settings both recipes have, and the key
that sets each in both (docs/configuration.md#one-vocabulary-for-both-grpo-recipes). The GRPO recipe names that key
for a config that writes trl's name (``recipes.grpo.schema.TRL_NAMES``); the trl recipe sets trl's field from it and
refuses the field under ``train:`` (``recipes.trl_grpo.schema.GRPO_CONFIG_FIELDS``).
"""

from __future__ import annotations

__all__ = ["SHARED_KEYS_OF_TRL_FIELDS"]

# trl.GRPOConfig field -> the key both recipes read for it (or a few words naming it, where it is not one value).
SHARED_KEYS_OF_TRL_FIELDS = {
    "num_generations": "rollout.group_size",
    "max_completion_length": "rollout.generation.max_new_tokens",
    "temperature": "rollout.generation.temperature",
    "top_k": "rollout.generation.top_k",
    "top_p": "rollout.generation.top_p",
    "min_p": "rollout.generation.min_p",
    "repetition_penalty": "rollout.generation.repetition_penalty",
    "generation_kwargs": "rollout.generation (its keys: min_new_tokens, do_sample; the sampler takes no other)",
    "multi_objective_aggregation": "reward.aggregation",
    "disable_tqdm": "progress_bar (its opposite: disable_tqdm=true is progress_bar=false)",
}
