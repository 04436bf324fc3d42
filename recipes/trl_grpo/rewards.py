"""trl's reward sources as the trl-rollouts recipe hands them over: each one's values checked as they are made, so that
a reward that cannot be trusted (infinite, NaN, past float32's range) stops the run naming its source, before anything
is trained on it or saved (trl itself would sum an infinite reward, train a zero loss and save the model).

- :func:`checked_reward_function`: a ``reward.functions`` entry, named as trl logs it, its values checked
  (``recipes.common.reward_functions.checked_rewards``: one per completion, finite, or ``None``).
- :func:`refuse_non_finite_scores`: the reward model's scores checked after each forward pass.

Dependencies: torch, the recipes' own modules.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch

from recipes.common.config import RunStopped
from recipes.common.reward_functions import checked_rewards, reward_function_failure

__all__ = ["DeclinedByEverySource", "checked_reward_function", "refuse_non_finite_scores"]

log = logging.getLogger(__name__)


class DeclinedByEverySource:
    """Warns once when every reward source (the functions of a run without a reward model) returned ``None`` for a
    completion: trl gives it a NaN reward ("All reward functions returned None", naming no setting) and it trains
    nothing. Each function reports its values in the order trl calls them; the last one of a batch checks."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.declined, self.reported, self.warned = list(names), None, 0, False

    def report(self, values: list) -> None:
        declined = [value is None for value in values]
        self.declined = declined if self.declined is None else [a and b for a, b in zip(self.declined, declined)]
        self.reported += 1
        if self.reported < len(self.names):
            return
        count, self.declined, self.reported = sum(self.declined), None, 0
        if count and not self.warned:
            self.warned = True
            settings = ", ".join(f"reward.functions.{name}" for name in self.names)
            log.warning(
                "Every reward source (%s) returned None for %d of %d completions of a batch: their reward is NaN and "
                "they train nothing. Make one function return a number wherever the others do not apply.",
                settings,
                count,
                len(values),
            )


def checked_reward_function(
    function: Callable, *, name: str, declined: DeclinedByEverySource | None = None
) -> Callable:
    """``function`` (a trl reward function, sync or async) under the name trl logs it by (``rewards/<name>/mean``),
    its values checked on every call; a bad one raises :class:`~recipes.common.config.RunStopped` naming
    ``reward.functions.<name>``. ``declined``: told each call's values (:class:`DeclinedByEverySource`)."""
    setting = f"reward.functions.{name}"

    def checked(values, kwargs: dict) -> list[float | None]:
        checked_values = checked_rewards(values, setting=setting, arguments=kwargs)
        if declined is not None:
            declined.report(checked_values)
        return checked_values

    if inspect.iscoroutinefunction(function):

        async def named(**kwargs):
            try:
                values = await function(**kwargs)
            except Exception as error:
                raise reward_function_failure(function, setting, error, kwargs) from error
            return checked(values, kwargs)

    else:

        def named(**kwargs):
            try:
                values = function(**kwargs)
            except Exception as error:
                raise reward_function_failure(function, setting, error, kwargs) from error
            return checked(values, kwargs)

    named.__name__ = str(name)
    return named


def refuse_non_finite_scores(model: torch.nn.Module, *, setting: str):
    """Checks every score ``model`` (a sequence classifier trl calls as a reward function) computes; a non-finite one
    raises :class:`~recipes.common.config.RunStopped` naming ``setting`` (``reward_model.name_or_path=...``) and the
    rows. Returns the hook's handle."""

    def check(module, args, output):
        scores = output.logits if hasattr(output, "logits") else output[0]
        bad = (~torch.isfinite(scores)).any(dim=-1).nonzero().flatten().tolist()
        if bad:
            values = scores[bad[:5]].flatten().tolist()
            raise RunStopped(
                f"The reward model ({setting}) gave {len(bad)} non-finite score(s) (rows {bad[:10]}, e.g. {values}): "
                "a reward that cannot be trusted is never trained on, and nothing is saved. Check the model's dtype "
                "(float16 overflows: dtype=float32 or bfloat16) and its weights."
            )

    return model.register_forward_hook(check)
