"""TorchRL ``ToolService``s for the tests of TorchRL's tool pieces: plain classes (the standard library only), in a
module of their own because the tool worker unpickles them by importing it."""

from __future__ import annotations


class AddService:
    """Adds two integers."""

    name = "add"
    schema_in = {"a": int, "b": int}
    schema_out = {"result": int}

    def __call__(self, a: int, b: int, **kwargs) -> dict:
        return {"result": a + b}


class FailingService:
    """Always fails."""

    name = "fail"
    schema_in = {"why": str}
    schema_out = {}

    def __call__(self, why: str, **kwargs) -> dict:
        raise RuntimeError(why)


def shout(text: str) -> str:
    """Shouts.

    Args:
        text: what to shout.
    """
    return text.upper() + "!"
