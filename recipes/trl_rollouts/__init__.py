"""The building blocks of ``recipes/trl_grpo_torchrl_rollouts.py``: trl's ``GRPOTrainer`` with TorchRL rollouts.

- ``checks``: the config's schema and every check before a model loads; the TorchRL sampler's settings from trl's.
- ``recording``: ``RecordingGRPOTrainer``, trl's trainer keeping each scored generation batch.
- ``rollout_store``: the TorchRL memmap storage of every completion trained on, and how to read it back.
"""
