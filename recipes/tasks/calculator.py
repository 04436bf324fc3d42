"""The tool-use task: products of two 2-3 digit numbers, which a tiny policy cannot compute but a tool can.

A prompt asks for a product (``What is 23 * 417?``); its row's ``solution`` column holds the answer (``"9591"``),
which :func:`exact_answer_reward`, a reward function written as trl's are (``f(completions, solution, **kwargs) ->
list[float]``), checks on the dialog's final message: 1.0 when its last number is the solution. The policy may call
:func:`multiply` (a trl tool: a typed function with a docstring; ``interop.tools.ToolSet([multiply])``) and state the
tool's result. Problems are split once, by their unordered pair of numbers, into training and held-out ones
(:func:`is_held_out`): the eval prompts never share a problem with the training prompts.

``tiny/calculator_policy`` (``scripts/build_tiny_models.py --task calculator``) is pretrained on
:func:`make_sft_conversations`: a share (:data:`TOOL_SHARE`) of the answers call the tool, a few of those with a
mistyped argument (:data:`TYPO_SHARE`), and the rest guess a number of about the right size (nearly always wrong).
Sampled, it calls the tool about a quarter of the time and is right nearly whenever it calls; GRPO, rewarded for
right answers only, can raise its accuracy by calling the tool more often. Everything here is
offline and deterministic given a seed; the standard library only (the tool also runs in ``interop.tools``' worker
process, which imports this module).
"""

from __future__ import annotations

import random
import re

__all__ = [
    "TOOLS",
    "TOOL_SHARE",
    "TYPO_SHARE",
    "exact_answer_reward",
    "final_text",
    "is_held_out",
    "make_eval_task",
    "make_sft_conversations",
    "make_task",
    "multiply",
]

LOW, HIGH = 10, 999  # the factors: every 2 and 3 digit number
_TEMPLATES = ("What is {} * {}?", "Multiply {} by {}.", "Compute {} x {}.", "What is the product of {} and {}?")
# The pretraining answers: a quarter call the tool (a twentieth of those with one argument mistyped, so that the
# stated product is wrong), the rest guess. Sampled at temperature 1, the policy then calls the tool about a quarter
# of the time and is right nearly every time it does (measured in docs/tiny_models.md): held-out accuracy near 0.25,
# which GRPO can raise to the share of dialogs that call the tool. More typos would make a call's answer unreliable
# and leave GRPO less to gain by calling.
TOOL_SHARE = 0.25
TYPO_SHARE = 0.05
_NUMBER = re.compile(r"-?\d+")
# What the final message is read from when a completion is one decoded text: the part after the last tool result,
# without any tool call in it (Qwen2.5's markers, what tiny/calculator_policy's template renders).
_TOOL_RESPONSE_END = "</tool_response>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.

    Returns:
        The product a * b.
    """
    return a * b


# The task's tools, as a trl GRPOTrainer(tools=...) or interop.tools.ToolSet takes them.
TOOLS = (multiply,)


def is_held_out(a: int, b: int) -> bool:
    """Whether ``a * b`` is a held-out problem (never a training prompt): a fifth of the unordered pairs, so that
    ``b * a`` is held out with ``a * b``.

    Examples:
        >>> is_held_out(23, 417) == is_held_out(417, 23)
        True
        >>> pairs = [(a, b) for a in range(10, 100) for b in range(100, 1000, 7)]
        >>> round(sum(is_held_out(a, b) for a, b in pairs) / len(pairs), 2)
        0.2
    """
    low, high = min(a, b), max(a, b)
    return (7 * low + 3 * high) % 10 < 2


def _draw_problem(rng: random.Random, *, held_out: bool) -> tuple[int, int]:
    while True:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        if is_held_out(a, b) == held_out:
            return a, b


def make_task(num_prompts: int, *, seed: int, held_out: bool = False) -> tuple[list[str], dict[str, list]]:
    """``num_prompts`` prompts drawn with ``random.Random(seed)`` from the training problems (or the held-out ones),
    and their ``solution`` column.

    Examples:
        >>> make_task(2, seed=0)  # doctest: +NORMALIZE_WHITESPACE
        (['What is the product of 786 and 921?', 'What is the product of 51 and 275?'],
         {'solution': ['723906', '14025']})
    """
    rng = random.Random(seed)
    prompts, solutions = [], []
    for _ in range(num_prompts):
        a, b = _draw_problem(rng, held_out=held_out)
        prompts.append(rng.choice(_TEMPLATES).format(a, b))
        solutions.append(str(a * b))
    return prompts, {"solution": solutions}


def make_eval_task(num_prompts: int, *, seed: int) -> tuple[list[str], dict[str, list]]:
    """:func:`make_task` over the held-out problems."""
    return make_task(num_prompts, seed=seed, held_out=True)


def _mistyped(number: int, rng: random.Random) -> int:
    """``number`` with one digit changed (never to a leading zero)."""
    digits = list(str(number))
    position = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[position] and not (position == 0 and d == "0")]
    digits[position] = rng.choice(choices)
    return int("".join(digits))


def _guess(a: int, b: int, rng: random.Random) -> int:
    """A number of about the product's size: what answering at once looks like without the tool."""
    return max(1, round(a * b * rng.uniform(0.6, 1.4)))


def make_sft_conversations(num_conversations: int, *, seed: int, tool_share: float = TOOL_SHARE) -> list[list[dict]]:
    """Prompt/answer conversations over every problem (held-out ones included: pretraining is not the RL task's
    training set), in trl's tool-calling message format: with probability ``tool_share`` (:data:`TOOL_SHARE`) the
    assistant calls ``multiply`` (one argument mistyped with probability :data:`TYPO_SHARE`), gets the result in a
    ``tool`` message and states it; otherwise it states a guess.

    Examples:
        >>> [message["role"] for message in make_sft_conversations(1, seed=0)[0]]
        ['user', 'assistant', 'tool', 'assistant']
    """
    rng = random.Random(seed)
    conversations = []
    for _ in range(num_conversations):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        user = {"role": "user", "content": rng.choice(_TEMPLATES).format(a, b)}
        if rng.random() < tool_share:
            x, y = a, b
            if rng.random() < TYPO_SHARE:
                x, y = (_mistyped(a, rng), b) if rng.random() < 0.5 else (a, _mistyped(b, rng))
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": x, "b": y}}}
            conversations.append(
                [
                    user,
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "multiply", "content": str(x * y)},
                    {"role": "assistant", "content": f"The answer is {x * y}."},
                ]
            )
        else:
            conversations.append([user, {"role": "assistant", "content": f"The answer is {_guess(a, b, rng)}."}])
    return conversations


def final_text(completion) -> str:
    """The text of a completion's final message, without tool calls: the last message's content when the completion
    is a message list (nothing when that message is a tool result), or the text; and of that, what follows the last
    tool result, for a whole dialog decoded into one text (as trl passes a ``rollout_func``'s completions: one
    assistant message holding every turn's tokens, tool messages' included).

    Examples:
        >>> final_text([{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        ...     "name": "multiply", "arguments": {"a": 12, "b": 34}}}]}, {"role": "tool", "content": "408"},
        ...     {"role": "assistant", "content": "The answer is 408."}])
        'The answer is 408.'
        >>> final_text('<tool_call>\\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\\n</tool_call>')
        ''
        >>> final_text([{"role": "assistant", "content": "<tool_response>\\n408\\n</tool_response>\\nDone."}])
        '\\nDone.'
    """
    if isinstance(completion, str):
        text = completion
    else:
        last = completion[-1] if completion else {"role": "assistant", "content": ""}
        text = (last.get("content") or "") if last.get("role") == "assistant" else ""
        if not isinstance(text, str):  # content blocks: their text parts
            text = " ".join(part.get("text", "") for part in text if isinstance(part, dict))
    return _TOOL_CALL_BLOCK.sub("", text.rsplit(_TOOL_RESPONSE_END, 1)[-1])


def exact_answer_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the last number of the completion's final message (:func:`final_text`) equals the row's
    ``solution``, else 0.0 (trl's reward-function form: ``completions`` are texts, or message lists for conversational
    prompts). A dialog that ends on a tool call or a tool result has no answer: 0.0.

    Examples:
        >>> exact_answer_reward(["The answer is 408.", "408 or 409", "four hundred and eight"], solution=["408"] * 3)
        [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, answer in zip(completions, solution, strict=True):
        numbers = _NUMBER.findall(final_text(completion))
        rewards.append(1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0)
    return rewards
