"""The synthetic task: product reviews whose quality an oracle can score.

Prompts ask for a review of a product; a response is a short review built from a small word list and grammar. The
oracle (:func:`well_formed_score`, the task's ``data.oracle``) scores a good review, positive and well-formed, in
[-1, 1], so the task has a ground truth that (a) labels preference pairs (:class:`OracleLabeler`, with
:func:`corrupt_review`'s broken copies), (b) measures a GRPO policy's true quality independently of the learned reward
model and (c) makes learning testable. :func:`oracle_score` counts adjectives only: the task's first oracle, which a
policy games by repeating a positive clause. Everything here is offline and deterministic given a seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

__all__ = [
    "NEGATIVE_WORDS",
    "NEUTRAL_WORDS",
    "POSITIVE_WORDS",
    "PRODUCTS",
    "OracleLabeler",
    "corrupt_review",
    "make_prompts",
    "make_review",
    "make_sft_conversations",
    "make_task",
    "oracle_score",
    "well_formed_score",
]

PRODUCTS = ("phone", "laptop", "camera", "kettle", "bike", "lamp", "chair", "watch", "radio", "bag", "desk", "mug")
POSITIVE_WORDS = ("great", "good", "excellent", "lovely", "perfect", "nice", "superb", "solid")
NEGATIVE_WORDS = ("bad", "poor", "awful", "broken", "terrible", "ugly", "flimsy", "cheap")
NEUTRAL_WORDS = ("big", "small", "red", "new", "heavy", "light", "plain", "round")

_PROMPT_TEMPLATES = ("Write a review of the {}.", "Review the {}.", "What do you think of the {}?")
_SUBJECTS = ("the {}", "it", "the price", "the color", "the design", "the box")
_VERBS = ("is", "looks", "feels", "seems")
_ADVERBS = ("", "very ", "really ", "quite ")
_POSITIVE, _NEGATIVE, _NEUTRAL = set(POSITIVE_WORDS), set(NEGATIVE_WORDS), set(NEUTRAL_WORDS)
_WORD = re.compile(r"[a-z]+")
# A clause of the grammar make_review writes: "<subject> <verb> [adverb] <adjective>".
_CLAUSE = re.compile(
    "(?:"
    + "|".join(dict.fromkeys(re.escape(subject.format(product)) for subject in _SUBJECTS for product in PRODUCTS))
    + ") (?:"
    + "|".join(_VERBS)
    + ") (?:(?:"
    + "|".join(adverb.strip() for adverb in _ADVERBS if adverb)
    + ") )?("
    + "|".join(POSITIVE_WORDS + NEGATIVE_WORDS + NEUTRAL_WORDS)
    + ")"
)


def make_prompts(num_prompts: int, *, seed: int) -> list[str]:
    """Returns ``num_prompts`` review requests drawn with ``random.Random(seed)``.

    Examples:
        >>> make_prompts(2, seed=0)
        ['Review the chair.', 'Write a review of the bike.']
    """
    rng = random.Random(seed)
    return [rng.choice(_PROMPT_TEMPLATES).format(rng.choice(PRODUCTS)) for _ in range(num_prompts)]


def make_task(num_prompts: int, *, seed: int) -> tuple[list[str], dict[str, list]]:
    """The task's prompts (:func:`make_prompts`) and their rows' columns: ``product``, the product each asks about
    (what a reward function may check the review against).

    Examples:
        >>> make_task(2, seed=0)
        (['Review the chair.', 'Write a review of the bike.'], {'product': ['chair', 'bike']})
    """
    prompts = make_prompts(num_prompts, seed=seed)
    return prompts, {"product": [next(p for p in PRODUCTS if p in prompt) for prompt in prompts]}


def make_review(product: str, rng: random.Random, *, sentiment: float | None = None) -> str:
    """Builds one review of ``product``; ``sentiment`` in [-1, 1] biases its adjectives (random when None)."""
    if sentiment is None:
        sentiment = rng.uniform(-1.0, 1.0)
    clauses = []
    for _ in range(rng.randint(2, 4)):
        if rng.random() < 0.25:
            adjective = rng.choice(NEUTRAL_WORDS)
        elif rng.random() < (1.0 + sentiment) / 2.0:
            adjective = rng.choice(POSITIVE_WORDS)
        else:
            adjective = rng.choice(NEGATIVE_WORDS)
        subject = rng.choice(_SUBJECTS).format(product)
        clauses.append(f"{subject} {rng.choice(_VERBS)} {rng.choice(_ADVERBS)}{adjective}")
    return " and ".join(clauses) + "."


def make_sft_conversations(num_conversations: int, *, seed: int) -> list[list[dict[str, str]]]:
    """Prompt/review conversations of mixed sentiment, the corpus the tiny policy is pretrained on."""
    rng = random.Random(seed)
    conversations = []
    for prompt in make_prompts(num_conversations, seed=seed):
        product = next(p for p in PRODUCTS if p in prompt)
        review = make_review(product, rng)
        conversations.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": review}])
    return conversations


def oracle_score(response: str) -> float:
    """Ground-truth quality of a response: (positive - negative adjectives) / all adjectives, in [-1, 1].

    A response without any adjective of the task scores 0.

    Examples:
        >>> oracle_score("the phone is great and it looks ugly and the box is red.")
        0.0
        >>> oracle_score("it is very good and the price seems nice.")
        1.0
    """
    words = _WORD.findall(response.lower())
    positive = sum(w in _POSITIVE for w in words)
    negative = sum(w in _NEGATIVE for w in words)
    neutral = sum(w in _NEUTRAL for w in words)
    total = positive + negative + neutral
    return (positive - negative) / total if total else 0.0


def well_formed_score(response: str) -> float:
    """A stricter ground truth than :func:`oracle_score`, in [-1, 1]: positive, and well-formed.

    The response is read as the task's own grammar writes reviews: clauses ``<subject> <verb> [adverb] <adjective>``
    joined by " and ", ending with a period. Each well-formed clause counts +1 (positive adjective), -1 (negative) or
    0 (neutral), once: a clause said again, a clause off the grammar (a word salad, a broken character) and a last
    clause cut off before its period count 0. The sum is divided by the number of clauses. So a review whose clauses
    are all distinct, well-formed and positive scores 1, and neither repeating a good clause nor stringing positive
    words together earns anything: the reward hacks that :func:`oracle_score` (which counts adjectives) and the tiny
    reward model trained from it let through. The task's oracle (``data.oracle``), and the labeler's score of the
    reward model's pairs (with :func:`corrupt_review`'s broken copies, so that the reward model knows those hacks).

    Examples:
        >>> well_formed_score("the phone is great and it looks nice.")
        1.0
        >>> well_formed_score("it is great and the box is awful and the color is red.")
        0.0
        >>> well_formed_score("it seems very nice and it seems very nice and it seems very nice.")
        0.3333333333333333
        >>> well_formed_score("good great superb nice perfect.")
        0.0
    """
    text = response.strip().lower()
    if not text:
        return 0.0
    finished = text.endswith(".")
    clauses = [clause.strip() for clause in text.removesuffix(".").split(" and ")]
    seen, total = set(), 0
    for index, clause in enumerate(clauses):
        match = _CLAUSE.fullmatch(clause)
        if match is None or clause in seen or (index == len(clauses) - 1 and not finished):
            continue
        seen.add(clause)
        adjective = match.group(1)
        total += 1 if adjective in _POSITIVE else -1 if adjective in _NEGATIVE else 0
    return total / len(clauses)


def corrupt_review(review: str, rng: random.Random) -> str:
    """``review`` broken one of the ways a policy that games a reward model breaks it: a clause said again, a word
    stuttered ("very very"), adjectives heaped on a clause, a stray word of the task's vocabulary ("it watch seems"),
    a word left out ("the box feels quite."), a broken character, a last clause cut off, or a bare adjective.

    Examples:
        >>> review = "it is great and the box looks nice."
        >>> [corrupt_review(review, random.Random(seed)) for seed in (1, 5, 11)]
        ['it is is great and the box looks nice.', 'it is great and box looks nice.', 'nice.']
        >>> rng = random.Random(0)
        >>> all(well_formed_score(corrupt_review(review, rng)) <= well_formed_score(review) for _ in range(100))
        True
    """
    clauses = review.strip().removesuffix(".").split(" and ")
    index = rng.randrange(len(clauses))
    words = clauses[index].split()
    kind = rng.randrange(8)
    if kind == 0:  # a clause said again
        clauses += [clauses[index]] * rng.randint(1, 3)
    elif kind == 1:  # a word stuttered
        position = rng.randrange(len(words))
        words[position:position] = [words[position]] * rng.randint(1, 2)
    elif kind == 2:  # adjectives heaped on
        words += rng.sample(POSITIVE_WORDS, rng.randint(1, 3))
    elif kind == 3:  # a broken character
        position = rng.randrange(len(words))
        cut = rng.randrange(len(words[position]) + 1)
        words[position] = words[position][:cut] + "\ufffd" + words[position][cut:]
    elif kind == 4:  # a stray word of the task's own vocabulary
        stray = rng.choice(PRODUCTS + _VERBS + tuple(adverb.strip() for adverb in _ADVERBS if adverb))
        words.insert(rng.randrange(len(words) + 1), stray)
    elif kind == 5:  # a word left out
        del words[rng.randrange(len(words))]
    elif kind == 6:  # a last clause cut off, no period
        return " and ".join(clauses + [" ".join(words[: rng.randint(1, max(1, len(words) - 1))])])
    else:  # a bare adjective
        return f"{words[-1]}."
    clauses[index] = " ".join(words)
    return " and ".join(clauses) + "."


class OracleLabeler:
    """Turns several responses to one prompt into preference pairs ranked by a ground-truth score.

    The labeler of the preference stage is application specific; this is the synthetic task's. Pairs whose scores
    differ by less than ``min_margin`` are dropped, never labelled at random. With ``corrupted_pairs_per_prompt``, the
    best response, when it scores above 0, is also paired with broken copies of itself (:func:`corrupt_review`) that
    score lower: the reward model then sees, from the start, the reward hacks a policy would otherwise find (a
    pretrained policy rarely writes them, so pairs of its own samples never show them).

    Keyword Args:
        max_pairs_per_prompt: at most this many pairs of sampled responses per prompt (best vs worst first, then the
            next ones inwards).
        min_margin: the smallest score difference that makes a pair.
        score: the ground truth, ``text -> float`` (the task's ``data.oracle`` in the reward recipe; ``None``:
            :func:`oracle_score`).
        corrupted_pairs_per_prompt: broken copies of the best response paired against it.
        seed: the corruptions' random stream.

    Examples:
        >>> labeler = OracleLabeler(max_pairs_per_prompt=1)
        >>> labeler("Review the mug.", ["it is bad.", "it is good.", "it is red."])
        [{'chosen': 'it is good.', 'rejected': 'it is bad.', 'margin': 2.0}]
    """

    def __init__(
        self,
        *,
        max_pairs_per_prompt: int = 1,
        min_margin: float = 1e-6,
        score=None,
        corrupted_pairs_per_prompt: int = 0,
        seed: int = 0,
    ) -> None:
        if max_pairs_per_prompt < 1:
            raise ValueError(f"OracleLabeler: max_pairs_per_prompt must be >= 1, got {max_pairs_per_prompt}.")
        if corrupted_pairs_per_prompt < 0:
            raise ValueError(
                f"OracleLabeler: corrupted_pairs_per_prompt must be >= 0, got {corrupted_pairs_per_prompt}."
            )
        self.max_pairs_per_prompt = max_pairs_per_prompt
        self.min_margin = min_margin
        self.score = score if score is not None else oracle_score
        self.corrupted_pairs_per_prompt = corrupted_pairs_per_prompt
        self._rng = random.Random(seed)

    def __call__(self, prompt: str, responses: Sequence[str]) -> list[dict[str, object]]:
        ranked = sorted(((self.score(r), r) for r in responses), key=lambda pair: pair[0], reverse=True)
        pairs = []
        for i in range(min(self.max_pairs_per_prompt, len(ranked) // 2)):
            (best_score, best), (worst_score, worst) = ranked[i], ranked[-1 - i]
            if best_score - worst_score >= self.min_margin and best != worst:
                pairs.append({"chosen": best, "rejected": worst, "margin": best_score - worst_score})
        best_score, best = ranked[0]
        if best_score > 0:
            for _ in range(self.corrupted_pairs_per_prompt):
                broken = corrupt_review(best, self._rng)
                margin = best_score - self.score(broken)
                if margin >= self.min_margin:
                    pairs.append({"chosen": best, "rejected": broken, "margin": margin})
        return pairs

    def __repr__(self) -> str:
        return (
            f"OracleLabeler(max_pairs_per_prompt={self.max_pairs_per_prompt}, min_margin={self.min_margin}, "
            f"score={getattr(self.score, '__name__', self.score)}, "
            f"corrupted_pairs_per_prompt={self.corrupted_pairs_per_prompt})"
        )
