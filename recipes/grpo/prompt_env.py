"""A single-turn TorchRL env over dense batches of prompts: what the GRPO recipe's default rollout steps.

:class:`PromptEnv` is a TorchRL ``EnvBase`` whose state is tensors: each reset draws ``num_prompts`` prompts from an
endless, seeded, resumable stream (``recipes.common.data.EndlessShuffleSampler``), renders each with the policy
tokenizer's chat template (once per prompt for the whole run, not once per sample and step), left-pads them into one
``[B, P]`` tensor and repeats every prompt ``group_size`` times by indexing. The policy (e.g.
``interop.sampling.CausalLMSampler``) answers every row; the step ends every dialog (single turn) and the
env's transforms (``interop.RewardModelTransform``...) write ``("next", "reward")``.

It is what TorchRL's ``ChatEnv`` + ``StepCounter(max_steps=1)`` does for single-turn prompts, without a
``History`` per sample: conversations stay plain message lists (``("history", "prompt")``) and reward models that
read them get them batched.

Dependencies: torch, tensordict, torchrl, and the ``transformers`` tokenizer the caller passes in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch.nn.utils.rnn import pad_sequence
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase

from recipes.common.data import EndlessShuffleSampler
from recipes.common.prompts import PromptTable
from recipes.grpo.batch import PROMPT_INDEX, PROMPT_MASK, PROMPT_TOKENS

__all__ = ["PromptEnv"]

# What a step carries over from its input: the prompt, unchanged (one turn: nothing else happens to the state).
_PROMPT_KEYS = (PROMPT_TOKENS, PROMPT_MASK, PROMPT_INDEX)


class PromptEnv(EnvBase):
    """Single-turn prompts as dense token batches: ``num_prompts`` prompts per reset, each ``group_size`` times.

    A reset writes, for a batch of ``B = num_prompts * group_size`` rows with each prompt's copies contiguous:

    - ``("tokens", "prompt")`` ``[B, P]``: the rendered prompts (chat template, generation prompt added), left-padded
      with the tokenizer's pad id to the batch's longest; ``("masks", "prompt")`` ``[B, P]`` (bool, True on tokens);
    - ``"prompt_index"`` ``[B]``: each prompt's position in the prompt table (the group id GRPO normalises over).

    Only tensors: text and conversations, which cost a Python object per row at every copy a collector makes, are
    derived where a reward needs them (``recipes.grpo.rewards.ResponseText``). A step marks every row done (one
    response per dialog); the reward comes from the env's transforms, which read the policy's output (the step's
    input tensordict).

    Args:
        prompts: a :class:`PromptTable`, or prompt texts / conversations (lists of ``{"role", "content"}`` messages).

    Keyword Args:
        tokenizer: the policy's tokenizer (chat template, pad id).
        group_size: responses per prompt.
        num_prompts: prompts per reset.
        system_prompt: optional system message put before every prompt that has none (with a list of prompts).
        seed: seed of the prompt stream's shuffling.
        start: how many prompts of the stream to skip (a resumed run passes how many were drawn, by all replicas).
        shuffle: ``False`` walks the prompts in order.
        num_replicas: data-parallel processes sharing the stream; each draws its own prompts.
        rank: this process's rank among them.
        device: where the tensors go.

    Attributes:
        RESET_KEYS: the entries a reset writes and a step carries over (with the policy's output, what the env's
            transforms read).

    Examples:
        >>> from tensordict import set_list_to_stack
        >>> from transformers import AutoTokenizer
        >>> from recipes.common.config import PROJECT_ROOT
        >>> set_list_to_stack(True).set()
        >>> tokenizer = AutoTokenizer.from_pretrained(PROJECT_ROOT / "tiny" / "policy")
        >>> env = PromptEnv(["Review the mug.", "Review the lamp."], tokenizer=tokenizer, group_size=2,
        ...                 num_prompts=2, shuffle=False)
        >>> reset = env.reset()
        >>> reset["prompt_index"]
        tensor([0, 0, 1, 1])
        >>> tokens, mask = reset["tokens", "prompt"], reset["masks", "prompt"]
        >>> tokenizer.decode(tokens[0][mask[0]])
        '<|im_start|>user\\nReview the mug.<|im_end|>\\n<|im_start|>assistant\\n'
    """

    RESET_KEYS = (*_PROMPT_KEYS, "done", "terminated")

    def __init__(
        self,
        prompts: PromptTable | Sequence,
        *,
        tokenizer,
        group_size: int,
        num_prompts: int = 1,
        system_prompt: str | None = None,
        seed: int = 0,
        start: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        if group_size < 1 or num_prompts < 1:
            raise ValueError(
                f"PromptEnv: group_size and num_prompts must be >= 1, got group_size={group_size}, "
                f"num_prompts={num_prompts}."
            )
        if tokenizer.pad_token_id is None:
            raise ValueError("PromptEnv: the tokenizer has no pad token; the prompts are left-padded with it.")
        if not isinstance(prompts, PromptTable):
            prompts = PromptTable(prompts, tokenizer=tokenizer, system_prompt=system_prompt)
        super().__init__(batch_size=torch.Size([group_size * num_prompts]), device=device)
        self.prompts = prompts
        self.pad_token_id = tokenizer.pad_token_id
        self.group_size = group_size
        self.num_prompts = num_prompts
        self._stream = iter(
            EndlessShuffleSampler(
                len(prompts), seed=seed, start=start, shuffle=shuffle, num_replicas=num_replicas, rank=rank
            )
        )
        self._make_specs()

    def _make_specs(self) -> None:
        shape = self.batch_size
        rows = (*shape, -1)  # prompts and responses change length from batch to batch
        self.full_observation_spec = Composite(
            tokens=Composite(prompt=Unbounded(shape=rows, dtype=torch.long), shape=shape),
            masks=Composite(prompt=Unbounded(shape=rows, dtype=torch.bool), shape=shape),
            prompt_index=Unbounded(shape=shape, dtype=torch.long),
            shape=shape,
        )
        self.full_action_spec = Composite(
            tokens=Composite(response=Unbounded(shape=rows, dtype=torch.long), shape=shape), shape=shape
        )
        # No reward of its own: a reward transform declares and writes it.
        self.full_reward_spec = Composite(shape=shape)

    def _reset(self, tensordict: TensorDictBase | None, **kwargs) -> TensorDictBase:
        indices = [next(self._stream) for _ in range(self.num_prompts)]
        ids = [self.prompts.rendered(index)[1] for index in indices]
        tokens = pad_sequence(ids, batch_first=True, padding_value=self.pad_token_id, padding_side="left")
        lengths = torch.tensor([len(row) for row in ids])
        mask = torch.arange(tokens.shape[1]) >= tokens.shape[1] - lengths[:, None]
        rows = torch.arange(self.num_prompts).repeat_interleave(self.group_size)
        done = torch.zeros(*self.batch_size, 1, dtype=torch.bool)
        reset = TensorDict({"done": done, "terminated": done.clone()}, batch_size=self.batch_size)
        reset.set(PROMPT_TOKENS, tokens[rows])
        reset.set(PROMPT_MASK, mask[rows])
        reset.set(PROMPT_INDEX, torch.tensor(indices)[rows])
        return reset.to(self.device) if self.device is not None else reset

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        done = torch.ones(*self.batch_size, 1, dtype=torch.bool, device=self.device)
        next_state = tensordict.select(*_PROMPT_KEYS, strict=False)
        next_state.update({"done": done, "terminated": done.clone()})
        return next_state

    def _set_seed(self, seed: int | None) -> None:
        # The prompt stream has its own seed (the constructor's), so that a resumed run continues it exactly.
        return None
