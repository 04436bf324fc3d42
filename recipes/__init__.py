"""Hydra training recipes that mix TorchRL and trl; shared building blocks live in :mod:`recipes.common`."""
