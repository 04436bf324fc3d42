"""What only ``recipes/trl_grpo_torchrl_rollouts.py`` (trl's ``GRPOTrainer`` with TorchRL rollouts) uses.

- ``schema``: the keys its config may hold and what each may be.
- ``checks``: every check before a model loads (the schema, trl's ``train:`` fields, rules across keys).
- ``rollout_store``: the TorchRL memmap storage of every completion trained on, and how to read it back.
"""
