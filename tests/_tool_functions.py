"""Tools for the tool tests: each misbehaves in one way. A module of its own (the standard library only), because
the tool worker imports a tool's module to find it, and a test module would pull pytest and torch into the worker."""

from __future__ import annotations

import os
import time
from typing import Literal


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def boom(reason: str) -> str:
    """Always raises.

    Args:
        reason: the error's text.
    """
    raise ValueError(reason)


def sleepy(seconds: float) -> str:
    """Sleeps, then answers.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def long_text(words: int) -> str:
    """A long answer.

    Args:
        words: how many words.
    """
    return " ".join(["word"] * words)


def die(code: int) -> str:
    """Ends its own process.

    Args:
        code: the exit code.
    """
    os._exit(code)


def worker_pid() -> int:
    """The process the tool runs in."""
    return os.getpid()


def bad_text() -> str:
    """Answers with a lone surrogate, text no tokenizer takes (what decoding bytes with errors="surrogateescape"
    gives)."""
    return "ok \udcff"


_CALLS = [0]


def count_calls() -> int:
    """How many times this tool ran in its process (state kept between calls)."""
    _CALLS[0] += 1
    return _CALLS[0]


def pick(kind: Literal["tea", "coffee"], sizes: list[int], note: str | None = None) -> str:
    """Picks a drink.

    Args:
        kind: the drink.
        sizes: cup sizes.
        note: an optional note.
    """
    return f"{kind} {sizes} {note}"


async def slow_echo(text: str) -> str:
    """An async tool.

    Args:
        text: what to echo.
    """
    return text


def make_lookup(key: str, url: str):
    """A tool built by a factory from its settings (``tools.<name>.function: {_target_: ..., key: ..., url: ...}``),
    as a tool holding an API key and a database URL is built."""

    def lookup(name: str) -> str:
        """Looks a name up.

        Args:
            name: what to look up.
        """
        return f"{name}: found"

    return lookup
