"""What the recipes measure of generated text, the same way in each.

- :func:`distinct_bigrams`: distinct-2 of a batch of responses (how varied they are).
- :func:`message_text`: the text of a prompt or completion as trl passes it (a string, or a message list).

Dependencies: torch.
"""

from __future__ import annotations

import torch

__all__ = ["distinct_bigrams", "message_text"]


def distinct_bigrams(tokens: torch.Tensor, mask: torch.Tensor) -> float:
    """Distinct-2 of a step's responses: distinct token bigrams over all token bigrams (1.0: no bigram repeats; a
    policy that says one thing again and again drifts towards 0). Under torchrun, each process's responses (the
    logged figure is rank 0's).

    Examples:
        >>> tokens = torch.tensor([[5, 6, 5, 6, 0], [5, 6, 7, 0, 0]])
        >>> distinct_bigrams(tokens, tokens != 0)  # (5,6) (6,5) (5,6) | (5,6) (6,7): 3 distinct of 5
        0.6
    """
    pairs = tokens[:, :-1].long() * (1 << 32) + tokens[:, 1:].long()
    kept = pairs[mask[:, :-1] & mask[:, 1:]]
    return kept.unique().numel() / kept.numel() if kept.numel() else 0.0


def message_text(value) -> str:
    """The text of a prompt or completion as trl passes it: a string, or a message list (the last message's)."""
    if isinstance(value, str):
        return value
    content = value[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)
