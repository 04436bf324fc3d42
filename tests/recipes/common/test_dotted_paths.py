"""``recipes.common.dotted_paths.instantiate_function``: the callable a ``{_target_, _partial_: true}`` node builds (the
data's oracle), as ``hydra.utils.instantiate`` builds it; ``resolve_function`` (reward functions, tools) builds its
``_target_`` nodes the same way."""

from __future__ import annotations

import functools

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from recipes.common.dotted_paths import instantiate_function, resolve_function
from recipes.tasks.synthetic import oracle_score, well_formed_score


def test_a_partial_node_that_binds_nothing_is_its_target_itself():
    """The oracle of the synthetic task: the function itself, not Hydra's partial object, which re-checks its target
    policy on every call (about 80 microseconds, 5 ms a step for 64 responses); it scores as Hydra's does."""
    node = OmegaConf.create({"_target_": "recipes.tasks.synthetic.well_formed_score", "_partial_": True})
    oracle = instantiate_function(node)
    assert oracle is well_formed_score
    hydra_built = instantiate(node)
    for text in ("the phone is great and it looks nice.", "good great superb.", ""):
        assert oracle(text) == hydra_built(text)


def test_a_node_that_binds_arguments_is_instantiated_by_hydra():
    node = OmegaConf.create({"_target_": "builtins.round", "_partial_": True, "ndigits": 1})
    rounded = instantiate_function(node)
    assert isinstance(rounded, functools.partial) and rounded.keywords == {"ndigits": 1} and rounded(0.26) == 0.3
    plain = OmegaConf.create({"_target_": "recipes.tasks.synthetic.oracle_score", "_partial_": True})
    assert instantiate_function(plain) is oracle_score


def test_a_target_hydra_refuses_is_refused_as_hydra_refuses_it():
    """The node goes through Hydra's instantiate, target policy included (a plain get_object would let os.system
    through, and the oracle would run every response in a shell)."""
    node = OmegaConf.create({"_target_": "os.system", "_partial_": True})
    with pytest.raises(InstantiationException):
        instantiate(node)
    with pytest.raises(InstantiationException):
        instantiate_function(node)


def test_a_reward_function_given_as_a_partial_node_is_its_target_itself():
    """``reward.functions.<name>.function: {_target_: ..., _partial_: true}`` is called once per response like the
    oracle: the function itself, not Hydra's partial object re-checking its policy on every call."""
    node = OmegaConf.create({"_target_": "recipes.tasks.synthetic.well_formed_score", "_partial_": True})
    assert resolve_function("reward.functions.form.function", node) is well_formed_score
    bound = OmegaConf.create({"_target_": "builtins.round", "_partial_": True, "ndigits": 1})
    assert resolve_function("reward.functions.rounded.function", bound)(0.26) == 0.3
