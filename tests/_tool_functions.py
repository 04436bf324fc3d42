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


# What start_sleeper starts: a child of the tool's process, a child in a session of its own (out of the worker's
# process group), a daemon (double-forked: its parent gone at once, in a session of its own).
_DAEMON = (
    "import subprocess as s; "
    "print(s.Popen(['sleep', '600'], start_new_session=True, stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
)


def start_sleeper(how: Literal["child", "session", "daemon"]) -> int:
    """Starts a `sleep 600` and answers its process id.

    Args:
        how: "child", "session" (start_new_session=True) or "daemon" (double-forked, in a session of its own).
    """
    import subprocess
    import sys

    if how == "daemon":
        return int(subprocess.run([sys.executable, "-c", _DAEMON], capture_output=True, text=True).stdout)
    return subprocess.Popen(["sleep", "600"], start_new_session=how == "session").pid


def start_sleepers_and_hang(pid_file: str) -> str:
    """Starts a sleeper of each kind, writes their process ids to a file, then hangs.

    Args:
        pid_file: where the process ids go, one a line.
    """
    pids = [start_sleeper(how) for how in ("child", "session", "daemon")]
    with open(pid_file, "w") as out:
        out.write("".join(f"{pid}\n" for pid in pids))
    time.sleep(600)
    return "never"
