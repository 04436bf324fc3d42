"""trl-style reward functions the recipe tests name by dotted path (``_reward_functions.<name>``): they are imported by
the recipe exactly as a user's module would be."""

from __future__ import annotations

from interop.trl.rollout_func import message_text
from recipes.tasks.synthetic import NEGATIVE_WORDS, POSITIVE_WORDS

# What record_rows saw: (prompt, product) per completion, in the order of the calls.
SEEN: list[tuple[str, str]] = []


def positivity_reward(completions: list, **kwargs) -> list[float]:
    """The share of a completion's words that are positive minus the share that are negative: a reward of its own, not
    the synthetic task's oracle (which scores the balance of the adjectives). Completions as trl passes them: texts, or
    message lists."""
    rewards = []
    for completion in completions:
        words = message_text(completion).lower().replace(".", " ").split()
        positive = sum(word in POSITIVE_WORDS for word in words)
        negative = sum(word in NEGATIVE_WORDS for word in words)
        rewards.append((positive - negative) / max(len(words), 1))
    return rewards


def record_rows(prompts: list, completions: list, product: list[str], **kwargs) -> list[float]:
    """Records each completion's prompt (its request's text) and ``product`` column; rewards nothing."""
    SEEN.extend(zip(map(message_text, prompts), product, strict=True))
    return [0.0] * len(completions)


def length_reward(completions: list, **kwargs) -> list[float]:
    """The completion's length in characters, over 100."""
    return [len(message_text(completion)) / 100 for completion in completions]


def huge_reward(completions: list, **kwargs) -> list[float]:
    """1e39 for every completion: a finite Python float, infinite in float32 (trl's reward dtype)."""
    return [1e39] * len(completions)


def first_group_ties(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 for every completion of the batch's first prompt (its group ties: zero advantages), the completion's length
    for the others: every batch of two or more groups holds a tied group and an informative one, on any seed."""
    first = prompts[0]
    return [
        1.0 if prompt == first else float(len(message_text(c))) for prompt, c in zip(prompts, completions, strict=True)
    ]


def unscored_at_the_first_step(completions: list, trainer_state, **kwargs) -> list[float | None]:
    """None (trl's "not applicable") for every completion of the run's first batch, 1.0 for every later one."""
    return [None if trainer_state.global_step == 0 else 1.0 for _ in completions]


def always_well_formed(completions: list, **kwargs) -> list[float]:
    """A 0/1 check every completion passes (as a format check the policy already meets)."""
    return [1.0] * len(completions)


def counts_words(completions: list, log_metric, log_extra, **kwargs) -> list[float]:
    """Rewards nothing; logs, as trl's callbacks take them, the batch's mean word count (``log_metric``) and each
    completion's word count (``log_extra``)."""
    words = [len(message_text(completion).split()) for completion in completions]
    log_metric("words/mean", sum(words) / len(words))
    log_extra("words", words)
    return [0.0] * len(completions)
