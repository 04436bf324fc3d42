"""Library refusals carry what they are about (``interop.errors.SettingError``: ``field``, ``detail``), and the recipes
put the config key in front of the library's text instead of rewriting it: the message a user reads is the key, then
the library's words unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from interop.errors import SettingError
from interop.sampling import SamplingSettings
from interop.tools import ToolSet
from recipes.common.config import ConfigError
from recipes.common.sampling import sampler_settings
from recipes.common.tools import resolve_tools

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def test_a_setting_error_names_its_field_at_the_start_of_its_detail():
    error = SettingError("SamplingSettings", "top_p=2 must be in (0, 1].", field="top_p")
    assert str(error) == "SamplingSettings: top_p=2 must be in (0, 1]."
    assert (error.owner, error.field, error.detail) == ("SamplingSettings", "top_p", "top_p=2 must be in (0, 1].")
    assert isinstance(error, ValueError)  # callers that catch ValueError keep working
    with pytest.raises(ValueError, match="must start with field='top_k'"):
        SettingError("SamplingSettings", "top_p=2 must be in (0, 1].", field="top_k")


@pytest.mark.parametrize(
    "settings",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": 8, "top_p": 2.0},
        {"max_new_tokens": 8, "min_p": 1.5},
        {"max_new_tokens": 8, "repetition_penalty": float("inf")},
        {"max_new_tokens": 8, "typical_p": 0.9},
    ],
)
def test_the_recipes_name_the_key_in_front_of_the_samplers_own_words(settings):
    with pytest.raises(SettingError) as library:
        SamplingSettings.from_mapping(settings)
    with pytest.raises(ConfigError) as recipe:
        sampler_settings(settings, key="rollout.generation")
    assert library.value.field in settings
    assert str(recipe.value) == f"rollout.generation.{library.value.detail}"


def test_a_tool_the_library_refuses_is_named_by_its_key_with_the_librarys_words():
    with pytest.raises(SettingError) as library:
        ToolSet([_undocumented])
    node = {"timeout_s": 10, "max_result_tokens": 256, "undocumented": {"function": f"{__name__}._undocumented"}}
    with pytest.raises(ConfigError) as recipe:
        resolve_tools(node)
    assert str(recipe.value) == (f"tools.undocumented.function={__name__}._undocumented: {library.value.detail}")


def _undocumented(a: int) -> int:
    return a


_undocumented.__name__ = "undocumented"


def test_no_recipe_edits_a_library_message_to_drop_its_owner():
    """``str(error).removeprefix("ToolSet: ")`` and regexes over a library's text are what ``SettingError`` replaces."""
    owners = ("SamplingSettings", "ToolSet", "torchrl_tools", "MCPStdioServer", "DialogSampler", "GRPOConfig")
    pattern = re.compile(r"removeprefix\(\s*[\"'](" + "|".join(owners) + r"): ")
    edits = [str(path) for path in RECIPES.rglob("*.py") if pattern.search(path.read_text())]
    assert edits == []
