"""Hydra training recipes that mix TorchRL and trl: what only GRPO uses lives in :mod:`recipes.grpo`, what only the
reward recipe uses in :mod:`recipes.reward`, what both use in :mod:`recipes.common`."""
