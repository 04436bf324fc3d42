"""The verifiable task: small-number addition, checked exactly (reinforcement learning with verifiable rewards).

A prompt asks for the sum of two numbers from 0 to 9 (``What is 3 + 4?``); its row's ``solution`` column holds the
answer (``"7"``), which :func:`exact_answer_reward`, a reward function written as trl's are
(``f(completions, solution, **kwargs) -> list[float]``), checks: 1.0 when the response's last number is the
solution, else 0.0. The 100 problems are split once, by problem, into training and held-out ones
(:func:`is_held_out`), so that held-out accuracy measures problems the run never trained on.

``tiny/arithmetic_policy`` (``scripts/build_tiny_models.py``) is pretrained on :func:`make_sft_conversations`, whose
answers are right only as often as their form makes them (:data:`REPLIES`): it starts well below perfect, and GRPO
has something to learn. Everything here is offline and deterministic given a seed.
"""

from __future__ import annotations

import random
import re

__all__ = [
    "PROBLEMS",
    "REPLIES",
    "exact_answer_reward",
    "is_held_out",
    "make_sft_conversations",
    "make_task",
]

PROBLEMS = tuple((a, b) for a in range(10) for b in range(10))
_TEMPLATES = ("What is {} + {}?", "Add {} and {}.", "Compute {} + {}.")
# The pretraining replies and how often each is right: writing the sum out is almost always right, a bare answer
# seldom (as a model that answers at once guesses where one that shows its work does not). Sampled, the pretrained
# policy is right a little over 40% of the time; GRPO, rewarded for right answers only, finds the reliable form, and
# because that form is the same for every problem, held-out problems improve with the trained ones.
REPLIES = (("{a} + {b} = {answer}", 0.99), ("{answer}", 0.15), ("The answer is {answer}.", 0.15))
_NUMBER = re.compile(r"-?\d+")


def is_held_out(a: int, b: int) -> bool:
    """Whether ``a + b`` is one of the 20 held-out problems (never a training prompt).

    Examples:
        >>> sum(is_held_out(a, b) for a, b in PROBLEMS)
        20
    """
    return (3 * a + 7 * b) % 5 == 0


def make_task(num_prompts: int, *, seed: int, held_out: bool = False) -> tuple[list[str], dict[str, list]]:
    """``num_prompts`` prompts drawn with ``random.Random(seed)`` from the training problems (or the held-out ones),
    and their ``solution`` column.

    Examples:
        >>> make_task(2, seed=0)
        (['Add 6 and 2.', 'Add 0 and 7.'], {'solution': ['8', '7']})
    """
    rng = random.Random(seed)
    problems = [problem for problem in PROBLEMS if is_held_out(*problem) == held_out]
    prompts, solutions = [], []
    for _ in range(num_prompts):
        a, b = rng.choice(problems)
        prompts.append(rng.choice(_TEMPLATES).format(a, b))
        solutions.append(str(a + b))
    return prompts, {"solution": solutions}


def make_eval_task(num_prompts: int, *, seed: int) -> tuple[list[str], dict[str, list]]:
    """:func:`make_task` over the held-out problems."""
    return make_task(num_prompts, seed=seed, held_out=True)


def make_sft_conversations(num_conversations: int, *, seed: int) -> list[list[dict[str, str]]]:
    """Prompt/answer conversations over every problem (held-out ones included: pretraining is not the RL task's
    training set), in the three reply forms of :data:`REPLIES`, each right as often as its form says and otherwise off
    by 1 to 3 either way."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(num_conversations):
        a, b = rng.choice(PROBLEMS)
        reply, right = rng.choice(REPLIES)
        answer = a + b if rng.random() < right else a + b + rng.choice((-3, -2, -1, 1, 2, 3))
        prompt = rng.choice(_TEMPLATES).format(a, b)
        content = reply.format(a=a, b=b, answer=answer)
        conversations.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": content}])
    return conversations


def exact_answer_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's last number equals the row's ``solution``, else 0.0 (trl's reward-function form:
    ``completions`` are texts, or message lists for conversational prompts).

    Examples:
        >>> exact_answer_reward(["The answer is 7.", "3 + 4 = 8", "seven"], solution=["7", "7", "7"])
        [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, answer in zip(completions, solution, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        numbers = _NUMBER.findall(text)
        rewards.append(1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0)
    return rewards
