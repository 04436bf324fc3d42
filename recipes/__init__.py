"""Hydra training recipes that mix TorchRL and trl, one room per recipe and one they share:

- :mod:`recipes.grpo`: what only ``recipes/grpo_torchrl_rm.py`` (GRPO from TorchRL components) uses;
- :mod:`recipes.reward`: what only ``recipes/reward_trainer_from_buffer.py`` (trl's RewardTrainer from a TorchRL
  buffer) uses;
- :mod:`recipes.trl_grpo`: what only ``recipes/trl_grpo_torchrl_rollouts.py`` (trl's GRPOTrainer with TorchRL
  rollouts) uses;
- :mod:`recipes.common`: what two or more of them use.

The pieces a user adopts without a recipe live in the ``interop`` package, which knows nothing of these.
"""
