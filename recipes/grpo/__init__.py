"""What only the GRPO recipe (``recipes/grpo_torchrl_rm.py``) uses, one concept a module.

- ``schema``, ``checks``: the keys the config may hold, and every check that runs before the models load.
- ``batch``: the dense ``[B, T]`` batch a step trains on (its keys, where its responses are).
- ``prompt_env``, ``rewards``, ``collector``, ``collector_modes``, ``collector_child``: collecting a step (the env of
  prompt batches, the reward transforms, the collector built from the config around ``interop.CausalLMSampler``, in
  the learner's process or in a background one).
- ``evaluation``: the held-out evaluation.
- ``log_probs``, ``loss``, ``learner``, ``policy``: training on it (response-only log-prob scorers and their
  factories, GRPO's advantage and loss, the update over mini-batches, the policy and its memory switches).
- ``checkpointing``, ``report``, ``distributed``: checkpoints and resume, what the run logs and summarises, and the
  data-parallel helpers.
"""
