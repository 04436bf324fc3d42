"""What only the reward recipe (``recipes/reward_trainer_from_buffer.py``) uses, one concept a module.

- ``checks``: every config check that runs before anything loads.
- ``pairs``: the labelled preference pairs a run trains and evaluates on (generated and labelled, or read from a
  dataset), cleaned and tokenized as ``trl.RewardTrainer`` tokenizes.
- ``pair_store``: those pairs kept in a folder (text and the buffer's TorchRL storage) for a later run's
  ``buffer.load_from``.
- ``buffer``: the TorchRL replay buffer of pairs and the stream trl reads from it.
- ``evaluation``: the saved model scored on the held-out pairs.
"""
