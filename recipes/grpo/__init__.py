"""What only the GRPO recipe (``recipes/grpo_torchrl_rm.py``) uses, one concept a module.

- ``checks``: every config check that runs before the models load.
- ``batch``: the dense ``[B, T]`` batch a step trains on (its keys, where its responses are).
- ``prompt_env``, ``sampling``, ``rewards``, ``rollout``, ``collectors``: collecting a step (the env of prompt
  batches, the sampling policy, the reward transforms, the collector built from the config, in the learner's process
  or in the background).
- ``log_probs``, ``loss``, ``learner``, ``policy``: training on it (response-only log-prob scorers and their
  factories, GRPO's advantage and loss, the update over mini-batches, the policy and its memory switches).
- ``checkpointing``, ``report``, ``distributed``: checkpoints and resume, what the run logs and summarises, and the
  data-parallel helpers.
"""
