"""The sampler's settings as both GRPO recipes write them: ``rollout.generation`` (and the GRPO recipe's
``eval.generation``), the :class:`interop.sampling.SamplingSettings` fields under their
``transformers.GenerationConfig`` names. The GRPO recipe hands them to its ``CausalLMSampler``; the trl recipe to
trl's ``GRPOConfig``, whose sampler (``interop.TorchRLRolloutFunc``) reads them back
(``SamplingSettings.from_grpo_config``).

- :func:`sampler_settings`: a generation node checked and built, or a ``ConfigError`` naming its key in full.

Dependencies: the project's ``interop`` package.
"""

from __future__ import annotations

from collections.abc import Mapping

from interop.errors import SettingError
from interop.sampling import SamplingSettings
from recipes.common.config import ConfigError, setting_message

__all__ = ["sampler_settings"]


def sampler_settings(
    generation: Mapping, *, key: str = "rollout.generation", check_only: bool = False, elsewhere: str | None = None
) -> SamplingSettings | None:
    """The :class:`~interop.sampling.SamplingSettings` of a config's generation node, or a :class:`ConfigError`
    naming the key.

    Keyword Args:
        key: where ``generation`` sits in the config (``rollout.generation``, ``eval.generation``).
        check_only: check the keys alone (the values come later); returns ``None``.
        elsewhere: for a key the sampler does not take, where the recipe takes it instead (appended to the message).

    Examples:
        >>> sampler_settings({"max_new_tokens": 8, "typical_p": 0.9})
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: rollout.generation.typical_p: not a generation setting of CausalLMSampler ...
    """
    try:
        if check_only:
            SamplingSettings.check_keys(generation)
            return None
        return SamplingSettings.from_mapping(generation)
    except SettingError as error:
        raise ConfigError(_settings_message(error, key, elsewhere)) from None


def _settings_message(error: SettingError, key: str, elsewhere: str | None = None) -> str:
    """``SamplingSettings``' refusal under ``key`` (``temperature=0`` under ``eval.generation`` reads
    ``eval.generation.temperature=0``), with the way out.

    Examples:
        >>> error = SettingError("SamplingSettings", "temperature=0 must be > 0 when sampling.", field="temperature")
        >>> _settings_message(error, "eval.generation")
        'eval.generation.temperature=0 must be > 0 when sampling. Set eval.generation.temperature > 0, or \
eval.generation.do_sample=false for greedy decoding.'
    """
    message = setting_message(error, key)
    if error.field not in SamplingSettings.names() and elsewhere:  # a key the sampler does not take
        message = message.rstrip(".") + f", or {elsewhere}."
    if error.field == "temperature" and "when sampling" in error.detail:
        message += f" Set {key}.temperature > 0, or {key}.do_sample=false for greedy decoding."
    return message
