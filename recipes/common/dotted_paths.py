"""Functions named in the config by their dotted path: a trl reward function (``reward.functions.<name>.function``), a
tool (``tools.<name>.function``), or a ``{_target_: ...}`` node whose factory returns one.

- :func:`resolve_function`: the callable a node names, with an error naming the setting and what was tried.
- :func:`function_name`: the dotted path a node names, for messages and records.
- :func:`instantiate_function`: a ``{_target_: ..., _partial_: true}`` node's callable (the data's oracle).
- :func:`import_from_the_working_folder`: the folder a run started from on the import path, where trl users keep
  their own ``my_rewards.py``.

Dependencies: hydra.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable

from hydra.utils import get_object, instantiate

from recipes.common.config import ConfigError

__all__ = ["function_name", "import_from_the_working_folder", "instantiate_function", "resolve_function"]

# trl's accuracy reward parses LaTeX with math-verify, an optional extra here.
_NEEDS_MATH_VERIFY = ("trl.rewards.accuracy_reward", "trl.rewards.accuracy_rewards.accuracy_reward")


def function_name(node) -> str:
    """The dotted path a ``reward.functions.<name>.function`` node names (its ``_target_`` for a factory)."""
    if isinstance(node, str):
        return node
    return str(node.get("_target_", "<no _target_>"))


def instantiate_function(node) -> Callable:
    """The callable a ``{_target_: <dotted path>, _partial_: true}`` node builds with ``hydra.utils.instantiate``
    (which checks the target against Hydra's target policy, refusing e.g. ``os.system``); a partial that binds no
    argument is then its target itself. Hydra's partial object re-checks the policy on every call, about 80
    microseconds: 5 ms a step for an oracle scoring 64 responses, more than the step's advantages and KL together;
    what the recipes call such a function on (response texts) and do with its result (``float``) are not the config's.
    """
    built = instantiate(node)
    if isinstance(built, functools.partial) and not built.args and not built.keywords:
        return built.func
    return built


def import_from_the_working_folder() -> None:
    """The folder the run was started from on the import path (after everything else, so it shadows nothing): trl
    users keep their reward functions next to where they run, ``my_rewards.py``, while ``python
    recipes/<recipe>.py`` puts only ``recipes/`` there."""
    folder = os.getcwd()
    if folder not in sys.path and os.path.abspath(folder) not in map(os.path.abspath, sys.path):
        sys.path.append(folder)


def resolve_function(setting: str, node) -> Callable:
    """The callable ``node`` names: a dotted path (imported; a module in the folder the run started from is found
    too) or a ``_target_`` node (instantiated, e.g. a factory that returns the function; a ``_partial_`` node that
    binds nothing is its target itself, as :func:`instantiate_function` says why).

    Raises:
        ConfigError: naming ``setting``, when it cannot be imported or built, or is not callable.
    """
    path = function_name(node)
    if path in _NEEDS_MATH_VERIFY and importlib.util.find_spec("math_verify") is None:
        raise ConfigError(
            f"{setting}={path} needs the math-verify package (trl's accuracy reward parses LaTeX with it): "
            "pip install -e '.[math]'."
        )
    import_from_the_working_folder()
    try:
        function = get_object(node) if isinstance(node, str) else instantiate_function(node)
    except Exception as error:  # whatever the import or the factory raised, the user needs the setting named
        module = path.rsplit(".", 1)[0] if "." in path else path
        found = importlib.util.find_spec(module.split(".")[0]) is not None
        where = (
            f"the module {module} was found but has no such function, or failed to import"
            if found
            else f"no module {module.split('.')[0]} in {os.getcwd()} (the folder the run started from) or on the "
            "Python path: run from the folder that holds it, or add that folder to PYTHONPATH"
        )
        raise ConfigError(
            f"{setting}={path} cannot be loaded ({type(error).__name__}: {str(error).splitlines()[0][:200]}): "
            f"{where}. The setting takes a function's dotted path (<module>.<function>, e.g. my_rewards.exact_match "
            "for my_rewards.py), or a {_target_: ...} node whose target returns one."
        ) from None
    if not callable(function):
        raise ConfigError(f"{setting}={path} is a {type(function).__name__}, not a function.")
    return function
