"""What only ``recipes/trl_grpo_torchrl_rollouts.py`` (trl's ``GRPOTrainer`` with TorchRL rollouts) uses.

- ``schema``: the keys its config may hold and what each may be.
- ``checks``: every check before a model loads (the schema, trl's ``train:`` fields, rules across keys, a resume).
- ``resume``: how a run continues from trl's checkpoints, as the run it continues.
- ``rewards``: the reward sources' values checked as trl computes them.
- ``report``: trl's logs under the recipes' names, the summary and its keys, the closing line.
- ``rollout_store``: the TorchRL memmap storage of every completion trained on, and how to read it back.
"""
