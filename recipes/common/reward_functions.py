"""trl reward functions as reward sources of the TorchRL env: called exactly as ``trl.GRPOTrainer`` calls them.

A trl reward function is ``f(prompts, completions, completion_ids, **kwargs) -> list[float | None]``, where the
keyword arguments are every other column of the data row each prompt came from (repeated per completion),
``trainer_state`` (transformers' ``TrainerState``: the step, the total steps), and trl's ``log_extra`` /
``log_metric`` callbacks. ``reward.functions.<name>.function`` names one by its dotted path
(``trl.rewards.think_format_reward``), or builds one with a ``_target_`` node (a factory such as
``trl.rewards.get_soft_overlong_punishment``).

- :func:`check_reward_functions`: every function (resolved by ``recipes.common.dotted_paths``) importable, callable,
  able to take what trl passes with this data's columns, before any model loads (each entry's form and weight are
  the schema's: ``recipes.common.schema.RewardFunctionNode``); :func:`check_reward_weights`: not every source 0;
  :func:`checked_rewards`: what a function returned, one finite value (or ``None``) per completion.
- :class:`RewardLogs`: what the functions hand trl's ``log_metric`` (scalars, averaged per step as trl averages
  them) and ``log_extra`` (a column of values, one per completion, for the completions table), kept per batch until
  whoever reports the batch takes them (:meth:`RewardLogs.pop`).
- The recipes render every prompt with the policy's chat template, so a function gets what trl gives it for
  conversational data: ``prompts`` as message lists (the system prompt included) and ``completions`` as
  ``[{"role": "assistant", "content": text}]``, whatever form the data's prompt column has. The GRPO recipe calls
  them through ``recipes.grpo.rewards.RewardFunction`` (over its env's step), the trl recipe through trl itself.

Dependencies: torch, transformers, and ``recipes.common``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from recipes.common.config import ConfigError, RunStopped
from recipes.common.dotted_paths import function_name, resolve_function
from recipes.common.schema import RewardFunctionNode

__all__ = [
    "RewardLogs",
    "check_reward_functions",
    "check_reward_weights",
    "reward_function_failure",
    "checked_rewards",
]


def _call_arguments(columns: Sequence[str]) -> list[str]:
    return ["prompts", "completions", "completion_ids", *columns, "trainer_state", "log_extra", "log_metric"]


def check_reward_functions(functions: Mapping[str, RewardFunctionNode], columns: Sequence[str]) -> None:
    """Refuses, before anything loads, a ``reward.functions`` entry (its form and weight are the schema's:
    ``recipes.common.schema.RewardFunctionNode``) whose function cannot be loaded, or cannot be called with what trl
    passes (``prompts``, ``completions``, ``completion_ids``, the data's ``columns``, ``trainer_state``,
    ``log_extra``, ``log_metric``): a parameter it requires that none of these provides (a column the data lacks,
    say) is named with the columns there are."""
    for name, node in functions.items():
        setting = f"reward.functions.{name}"
        function = resolve_function(f"{setting}.function", node.function)
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check here
            continue
        arguments = _call_arguments(columns)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        required = [
            p.name
            for p in signature.parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        missing = [parameter for parameter in required if parameter not in arguments]
        if missing:
            raise ConfigError(
                f"{setting}.function={function_name(node.function)} requires {missing}, which trl's call does not "
                f"provide here: it passes prompts, completions, completion_ids, trainer_state, log_extra, "
                f"log_metric and the data's columns {list(columns)}. Add the column to the data, or give the "
                "parameter a default."
            )
        if not takes_any:
            raise ConfigError(
                f"{setting}.function={function_name(node.function)} takes no **kwargs: trl passes every column and "
                "more to each reward function, so it must accept them (def f(completions, **kwargs))."
            )


def check_reward_weights(cfg) -> None:
    """Every reward source weighted 0 makes every reward 0: every group ties, every advantage is 0, nothing trains.
    ``cfg``: a GRPO recipe's typed settings (its ``reward_model``, ``reward.model_weight``, ``reward.functions``, and
    ``reward.terms`` where it has them)."""
    weights = {"reward.model_weight": cfg.reward.model_weight} if cfg.reward_model is not None else {}
    for name, node in cfg.reward.functions.items():
        weights[f"reward.functions.{name}.weight"] = node.weight
    for name, term in (getattr(cfg.reward, "terms", None) or {}).items():  # the trl recipe has no terms
        weights[f"reward.terms.{name}.weight"] = term.get("weight", 1.0) if isinstance(term, Mapping) else 1.0
    if weights and all(weight == 0 for weight in weights.values()):
        shown = ", ".join(f"{key}={weight}" for key, weight in weights.items())
        raise ConfigError(
            f"Every reward source is weighted 0 ({shown}): every completion's reward would be 0, every advantage 0, "
            "and nothing would train. Give one of them a nonzero weight."
        )


class RewardLogs:
    """What reward functions log through trl's callbacks while a batch is scored, until it is reported.

    ``log_metric(name, value)``: a scalar; trl averages every value logged during a step and reports it as ``name``
    beside its own metrics. ``log_extra(column, values)``: one value per completion of the batch; trl adds the column
    to its completions table. Several functions share one :class:`RewardLogs` (a scorer's), and the owner of the
    batch takes them once it is scored (:meth:`pop`).

    Examples:
        >>> logs = RewardLogs()
        >>> logs.metric("format/ratio", 0.5, function="format"); logs.metric("format/ratio", 1.0, function="format")
        >>> logs.column("parsed", ["3", None], function="format", count=2)
        >>> logs.pop()
        ({'format/ratio': [0.5, 1.0]}, {'parsed': ['3', None]})
        >>> logs.pop()
        ({}, {})
    """

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}
        self.owners: dict[str, str] = {}  # metric or column name -> the function that logged it (for messages)

    def metric(self, name: str, value: float, *, function: str) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))
        self.owners[str(name)] = function

    def column(self, column: str, values: Sequence, *, function: str, count: int) -> None:
        """``values`` of ``column``, one per completion (``count`` of them)."""
        values = list(values)
        if len(values) != count:
            raise RuntimeError(
                f"The reward function reward.functions.{function} logged {len(values)} values of the column "
                f"{column!r} (log_extra) for {count} completions; log_extra takes one value per completion."
            )
        self.columns[str(column)] = values
        self.owners[str(column)] = function

    def pop(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        """``(metrics, columns)`` logged since the last call, which forgets them."""
        logged = (self.metrics, self.columns)
        self.metrics, self.columns = {}, {}
        return logged


def reward_function_failure(function: Callable, setting: str, error: Exception, kwargs: dict) -> RuntimeError:
    """The error to raise (``from error``: its traceback follows) when the reward function of ``setting`` raised
    ``error`` on the batch of ``kwargs``: naming the setting, the error and the first row it fails on alone."""
    return RuntimeError(
        f"The reward function {setting} raised {type(error).__name__}: {error}{_first_failing_row(function, kwargs)}. "
        "Fix the function (or the data): a reward it cannot compute is never counted as 0."
    )


def _first_failing_row(function: Callable, kwargs: dict) -> str:
    """`` on row i (prompt ..., completion ...)``: the function called again row by row (only now that it failed) to
    find the first row it fails on; empty if every row alone passes (or it is a coroutine function)."""
    if inspect.iscoroutinefunction(function):
        return ""
    per_row = [key for key, value in kwargs.items() if isinstance(value, list)]
    for row in range(len(kwargs["completions"])):
        single = {key: ([value[row]] if key in per_row else value) for key, value in kwargs.items()}
        try:
            function(**single)
        except Exception:  # noqa: BLE001 - looking for the row, the error itself is reported above
            return (
                f" on row {row} of the step's responses (prompt {_shown(kwargs['prompts'][row])}, completion "
                f"{_shown(kwargs['completions'][row])})"
            )
    return ""


def checked_rewards(values, *, setting: str, arguments: dict) -> list[float | None]:
    """What a trl reward function returned for the completions of ``arguments`` (the keywords it was called with),
    checked: one value per completion, each ``None`` (not applicable) or a number that is finite in float32 (trl's
    reward dtype: 1e39 would be infinite there). Returns the values as floats, ``None`` kept.

    Raises:
        RunStopped: naming ``setting``, the value, its row, prompt and completion (and the step, from trl's
            ``trainer_state``): a reward that cannot be trusted is never trained on.
    """
    values = list(values) if values is not None else []
    count = len(arguments["completions"])
    if len(values) != count:
        raise RunStopped(
            f"The reward function {setting} returned {len(values)} rewards for {count} completions; a trl reward "
            "function returns one per completion (None where it does not apply)."
        )
    checked = []
    for row, value in enumerate(values):
        if value is None:
            checked.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not (math.isfinite(number) and abs(number) <= _FLOAT32_MAX):
            state = arguments.get("trainer_state")
            step = f" at step {state.global_step + 1}" if state is not None else ""
            raise RunStopped(
                f"The reward function {setting} returned {value!r} for row {row}{step} (prompt "
                f"{_shown(arguments['prompts'][row])}, completion {_shown(arguments['completions'][row])}): a reward "
                f"must be a finite number (within +-{_FLOAT32_MAX:.2e}, float32's range), or None where the "
                "function does not apply. Fix the function (scale or clip what it returns); nothing trained on "
                "this reward is saved."
            )
        checked.append(number)
    return checked


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _shown(value, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
