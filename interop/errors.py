"""The errors ``interop`` raises for a value it refuses, carrying what the value was given as.

- :class:`SettingError`: a ``ValueError`` whose ``detail`` is the message without the refusing class's name, starting
  with ``field`` (the argument at fault) where there is one. A caller that knows where the value came from (a config
  key) writes ``f"{key}.{error.detail}"`` instead of editing the message's text.

Dependencies: none.
"""

from __future__ import annotations

__all__ = ["SettingError"]


class SettingError(ValueError):
    """A value a class or function of ``interop`` refuses; ``str()`` is ``"<owner>: <detail>"``.

    Args:
        owner: who refuses it (a class or function name), the message's first word.
        detail: what is wrong and what to do, starting with ``field`` where one is given (``"top_p=2 must be in
            (0, 1]"``).

    Keyword Args:
        field: the argument (or setting) at fault, or ``None`` where no one argument is.

    Examples:
        >>> error = SettingError("SamplingSettings", "top_p=2 must be in (0, 1].", field="top_p")
        >>> str(error), error.field
        ('SamplingSettings: top_p=2 must be in (0, 1].', 'top_p')
        >>> f"rollout.generation.{error.detail}"
        'rollout.generation.top_p=2 must be in (0, 1].'
    """

    def __init__(self, owner: str, detail: str, *, field: str | None = None):
        if field is not None and not detail.startswith(field):
            raise ValueError(f"SettingError: detail={detail!r} must start with field={field!r}.")
        super().__init__(f"{owner}: {detail}")
        self.owner, self.detail, self.field = owner, detail, field
