"""trl's private API that ``interop.trl.trainer`` relies on (its ``TRL_PRIVATE_METHODS`` / ``TRL_PRIVATE_ATTRIBUTES``)
is still what the installed trl has: a trl release that renames a method, reorders its parameters or stops setting
an attribute fails here, naming it, instead of failing deep inside a training step."""

import inspect
import re

import pytest
import trl

from interop.trl import trainer as trl_grpo


@pytest.mark.parametrize("name", sorted(trl_grpo.TRL_PRIVATE_METHODS))
def test_each_private_trl_method_still_takes_the_parameters_we_use(name):
    method = getattr(trl.GRPOTrainer, name, None)
    assert method is not None, (
        f"trl {trl.__version__}: GRPOTrainer.{name} is gone (checked against trl "
        f"{trl_grpo.TRL_CHECKED_VERSION}); interop/trl/trainer.py overrides or calls it"
    )
    parameters = tuple(inspect.signature(method).parameters)[1:]  # without self
    expected = trl_grpo.TRL_PRIVATE_METHODS[name]
    assert parameters[: len(expected)] == expected, (
        f"trl {trl.__version__}: GRPOTrainer.{name} takes {parameters}, interop/trl/trainer.py uses {expected} "
        f"(checked against trl {trl_grpo.TRL_CHECKED_VERSION})"
    )


@pytest.mark.parametrize("name", trl_grpo.TRL_PRIVATE_ATTRIBUTES)
def test_each_private_trl_attribute_is_still_set_by_the_trainer(name):
    source = inspect.getsource(trl.GRPOTrainer.__init__)
    assert re.search(rf"\bself\.{name}\s*(:[^=]*)?=", source), (
        f"trl {trl.__version__}: GRPOTrainer.__init__ no longer sets self.{name}, which interop/trl/trainer.py reads "
        f"(checked against trl {trl_grpo.TRL_CHECKED_VERSION})"
    )


def test_the_table_covers_every_private_trl_name_the_module_uses():
    """Every ``super()._x(`` and ``self._x(`` of trl's (not the module's own) in interop/trl/trainer.py is declared."""
    source = inspect.getsource(trl_grpo)
    own = set(re.findall(r"def (_\w+)\(", source))
    used = set(re.findall(r"super\(\)\.(_\w+)\(", source)) | set(re.findall(r"self\.(_\w+)\(", source))
    trls = {name for name in used - own if hasattr(trl.GRPOTrainer, name)}
    assert trls <= set(trl_grpo.TRL_PRIVATE_METHODS), sorted(trls - set(trl_grpo.TRL_PRIVATE_METHODS))
    attributes = set(re.findall(r"self\.(_\w+)\b(?!\()", source)) - own
    set_here = set(re.findall(r"self\.(_\w+)\s*=", source))
    assert attributes - set_here <= set(trl_grpo.TRL_PRIVATE_ATTRIBUTES), sorted(
        attributes - set_here - set(trl_grpo.TRL_PRIVATE_ATTRIBUTES)
    )
