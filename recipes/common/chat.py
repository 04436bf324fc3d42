"""TorchRL's chat stack as the recipes use it: prompts -> ``ChatEnv`` -> ``TransformersWrapper`` -> rewards.

A single-turn LLM rollout with TorchRL's chat stack (what ``recipes/grpo_torchrl_rm.py`` collects with
``rollout.env=chat``, for TorchRL's multi-turn and tool transforms, and what the reward-model recipe samples candidate
responses with)::

    set_list_to_stack(True).set()                      # TorchRL's LLM stack needs it, once per process
    loader = make_prompt_dataloader(prompts, seed=0)   # endless, reshuffled, resumable {"query": [prompt], ...}
    env = make_chat_env(loader, tokenizer=tok, group_size=G, num_prompts=P, transforms=[reward_transform])
    policy = make_policy(model, tok, generation={"max_new_tokens": 32, "temperature": 1.0, "do_sample": True})
    rollout = policy(env.reset())                      # P prompts x G responses, prompts grouped contiguously
    batch = pad_rollout(rollout, pad_token_id=tok.pad_token_id)   # dense [B, T] tensors, what the loss trains on

The GRPO recipe's default rollout is denser and faster: ``recipes.grpo.prompt_env`` + ``interop.sampling``.

Public functions and classes:

- :func:`make_prompt_dataloader`: a ``DataLoader`` yielding ``{"query": [prompt], "prompt_index": ...}`` forever,
  in the order of ``recipes.common.data.EndlessShuffleSampler`` (reshuffled each pass over the prompts from a seed,
  starting at any position, dealt out between data-parallel processes).
- :func:`make_chat_env`: a single-turn ``ChatEnv`` (history mode) fed by that loader, ``group_size`` copies of each
  prompt, ``num_prompts`` prompts per reset, with extra transforms (rewards) appended.
- :func:`make_policy`: ``TransformersWrapper`` in generate mode; generation settings come from a config mapping.
- :func:`pad_rollout`: a ragged rollout as dense ``[B, T]`` tensors, each response starting at the same column, the
  layout ``recipes.grpo.log_probs.ResponseLogProbs`` and the GRPO loss train on, without TorchRL's per-sample
  unpadding and re-padding. (TorchRL 0.14.1's wrapper in generate mode zeroes the first response log-prob: the
  recipe scores the old log-probs again where a step needs them.)
- :func:`response_texts`: the decoded responses of a rollout, special tokens removed.
- :func:`check_chat_generation_settings`: refuses a generation setting that is no ``GenerationConfig`` field.

Dependencies: torch, tensordict, torchrl, and the ``transformers`` objects the caller passes in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase, list_to_stack
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from torchrl.data.llm import History
from torchrl.envs import StepCounter
from torchrl.envs.llm import ChatEnv
from torchrl.modules.llm import TransformersWrapper

from recipes.common.config import ConfigError
from recipes.common.data import EndlessShuffleSampler
from recipes.common.models import check_pad_token

# transformers is imported where generation settings are checked, not with this module: it takes about half a second,
# which `--help` need not spend.

__all__ = [
    "CHAT_STEP_KEYS",
    "check_chat_generation_settings",
    "make_chat_env",
    "make_policy",
    "make_prompt_dataloader",
    "pad_rollout",
    "response_texts",
    "unknown_generation_settings",
]

# What a step of make_chat_env's env holds when its transforms (the rewards) read it, make_policy having answered:
# TorchRL 0.14.1's layout, which tests/recipes/common/test_chat.py checks against a real rollout. make_policy adds
# ("log_probs", "response") when generation asks for return_log_probs.
CHAT_STEP_KEYS = (
    ("history", "prompt"),
    ("history", "response"),
    ("history", "full"),
    ("text", "prompt"),
    ("text", "response"),
    ("text", "full"),
    ("tokens", "prompt"),
    ("tokens", "response"),
    ("tokens", "full"),
    ("masks", "all_attention_mask"),
    "query",
    "prompt_index",
    "step_count",
    "done",
    "terminated",
    "truncated",
)


def _require_list_to_stack(what: str) -> None:
    if not list_to_stack():
        raise RuntimeError(
            f"{what}: TorchRL's LLM stack needs `tensordict.set_list_to_stack(True).set()` (or LIST_TO_STACK=1); "
            "call it once at the start of the program."
        )


def _to_query(prompt):
    """A dataloader item as ``ChatEnv`` reads it: text stays text, a message list becomes a torchrl ``History``."""
    if isinstance(prompt, str):
        return prompt
    return History.from_chats([list(prompt)])[0]


def _collate_queries(batch: list[tuple[int, object]]) -> dict:
    # ChatEnv reads "query"; "prompt_index" rides along into every step, a group id MCAdvantage can read whatever
    # the prompt's type (it groups by strings or tensors, not by chat histories).
    return {
        "query": [_to_query(prompt) for _, prompt in batch],
        "prompt_index": torch.tensor([index for index, _ in batch]),
    }


def make_prompt_dataloader(
    prompts: Sequence,
    *,
    seed: int,
    start: int = 0,
    shuffle: bool = True,
    num_replicas: int = 1,
    rank: int = 0,
) -> DataLoader:
    """An endless ``DataLoader`` of ``{"query": [prompt], "prompt_index": tensor([i])}`` batches of size 1.

    ``ChatEnv`` reads ``"query"``; ``"prompt_index"`` (the prompt's position in ``prompts``) is carried into every
    step of the env, where ``MCAdvantage(prompt_key="prompt_index")`` groups the responses by it.

    Args:
        prompts: prompt texts, or conversations as lists of ``{"role", "content"}`` messages (as
            ``recipes.common.data.load_prompts`` returns them).

    Keyword Args:
        seed: seed of the shuffling (see :class:`EndlessShuffleSampler`).
        start: how many prompts of the endless stream to skip (a resumed run passes the number already used, by all
            replicas together).
        shuffle: ``False`` walks the prompts in order.
        num_replicas: data-parallel processes sharing the stream; each gets its own prompts.
        rank: this process's rank among them.
    """
    if len(prompts) == 0:
        raise ValueError("make_prompt_dataloader: no prompts; check the data= config (e.g. data.path).")
    sampler = EndlessShuffleSampler(
        len(prompts), seed=seed, start=start, shuffle=shuffle, num_replicas=num_replicas, rank=rank
    )
    # num_workers=0: importing torchrl switches multiprocessing to spawn, and the prompts are tiny to read anyway.
    return DataLoader(
        list(enumerate(prompts)), batch_size=1, sampler=sampler, collate_fn=_collate_queries, num_workers=0
    )


def make_chat_env(
    dataloader: DataLoader,
    *,
    tokenizer,
    group_size: int,
    num_prompts: int = 1,
    system_prompt: str | None = None,
    transforms: Sequence = (),
):
    """A single-turn chat env: each reset draws ``num_prompts`` prompts and repeats each ``group_size`` times.

    The batch is ``(num_prompts * group_size,)`` with each prompt's copies contiguous and sharing the loader's
    ``"prompt_index"``, which is what GRPO groups (``MCAdvantage(prompt_key="prompt_index")``) need; a
    ``StepCounter(max_steps=1)`` ends every dialog after one response, so every step is a finished trajectory.
    ``ChatEnv`` declares no reward: a reward transform (e.g. ``interop.RewardModelTransform``) in ``transforms`` adds
    it.

    Args:
        dataloader: yields ``{"query": [prompt], ...}`` batches of size 1 (see :func:`make_prompt_dataloader`).

    Keyword Args:
        tokenizer: the policy's tokenizer (its chat template renders the prompts).
        group_size: responses per prompt.
        num_prompts: prompts per reset.
        system_prompt: optional system message put before every prompt.
        transforms: env transforms appended in order after the step counter.
    """
    _require_list_to_stack("make_chat_env")
    if group_size < 1 or num_prompts < 1:
        raise ValueError(
            f"make_chat_env: group_size and num_prompts must be >= 1, got group_size={group_size}, "
            f"num_prompts={num_prompts}."
        )
    env = ChatEnv.from_dataloader(
        dataloader=dataloader,
        repeats=group_size,
        batch_size=(group_size * num_prompts,),
        tokenizer=tokenizer,
        input_mode="history",
        system_prompt=system_prompt,
    )
    env = env.append_transform(StepCounter(max_steps=1))
    for transform in transforms:
        env = env.append_transform(transform)
    return env


def unknown_generation_settings(generation: Mapping) -> list[str]:
    """The keys of ``generation`` that are neither ``transformers.GenerationConfig`` fields nor ``return_log_probs``.

    Examples:
        >>> unknown_generation_settings({"max_new_tokens": 8, "min_new_tokens": 8, "max_new_token": 8})
        ['max_new_token']
    """
    from transformers import GenerationConfig

    fields = GenerationConfig()
    return sorted(str(key) for key in generation if key != "return_log_probs" and not hasattr(fields, str(key)))


def check_chat_generation_settings(generation: Mapping, *, key: str = "generation") -> None:
    """Refuses a ``generation`` key that TorchRL's ``TransformersWrapper`` (:func:`make_policy`) does not take: any
    ``transformers.GenerationConfig`` field, and ``return_log_probs``, are accepted. Nothing loads.

    Keyword Args:
        key: where ``generation`` sits in the config, named in the error.

    Raises:
        ConfigError: an unknown key (a typo would otherwise go unnoticed, or fail deep inside generation).

    Examples:
        >>> check_chat_generation_settings({"max_new_tokens": 8, "max_new_token": 8}, key="rollout.generation")
        Traceback (most recent call last):
        ...
        recipes.common.config.ConfigError: rollout.generation: ['max_new_token'] are not generation settings ...
    """
    unknown = unknown_generation_settings(generation)
    if unknown:
        raise ConfigError(
            f"{key}: {unknown} are not generation settings (transformers GenerationConfig fields); check the "
            "spelling (e.g. max_new_tokens, temperature, top_p, top_k, min_new_tokens)."
        )


def make_policy(model, tokenizer, *, generation: Mapping, device=None, generation_key: str = "generation"):
    """The sampling policy: ``TransformersWrapper`` in generate mode over chat histories.

    Outputs ragged (``pad_output=False``) ``("tokens", "prompt"|"response"|"full")``, ``("masks",
    "all_attention_mask")``, ``("text", ...)`` and ``("history", ...)``. Its log-probs are not what a loss needs
    (TorchRL 0.14.1 zeroes the first response token's), so none are returned unless ``generation`` asks with
    ``return_log_probs``.

    Args:
        model: a ``transformers`` causal LM.
        tokenizer: its tokenizer, with left padding and a pad token distinct from EOS (TorchRL masks the response
            with ``tokens != pad``, which would drop a generated EOS equal to the pad).

    Keyword Args:
        generation: keyword arguments of ``model.generate`` (``max_new_tokens``, ``temperature``, ``top_p``,
            ``do_sample``, ``min_new_tokens``, ``min_p``... any ``transformers.GenerationConfig`` field), for instance a
            config node; ``return_log_probs`` (bool) is read apart.
        device: where the wrapper puts the model inputs; ``None`` leaves them where they are.
        generation_key: where ``generation`` sits in the config, named in errors.

    Raises:
        ConfigError: a ``generation`` key that is no ``GenerationConfig`` field
            (:func:`check_chat_generation_settings`), or a tokenizer whose pad token is EOS
            (``recipes.common.models.check_pad_token``).
        ValueError: a tokenizer that pads on the right.
    """
    check_pad_token(tokenizer, owner="make_policy: the tokenizer")
    if tokenizer.padding_side != "left":
        raise ValueError("make_policy: generation needs left padding; set tokenizer.padding_side = 'left'.")
    check_chat_generation_settings(generation, key=generation_key)
    generate_kwargs = {str(k): v for k, v in dict(generation).items()}
    return_log_probs = bool(generate_kwargs.pop("return_log_probs", False))
    policy = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="history",
        generate=True,
        return_log_probs=return_log_probs,
        pad_output=False,
        generate_kwargs=generate_kwargs,
        device=device,
    )
    # TorchRL 0.14.1 passes only its own short list of settings on to generate() and silently drops the others
    # (min_new_tokens, min_p, typical_p...); generate() reads the ones it kept from this dict at every call.
    for key, value in generate_kwargs.items():
        policy.generate_kwargs.setdefault(key, value)
    return policy


def pad_rollout(rollout: TensorDictBase, *, pad_token_id: int) -> TensorDictBase:
    """A ragged single-turn rollout as a dense ``TensorDict`` of ``[B, T]`` token tensors, in ``generate``'s layout.

    Every row is ``[pads | prompt | response | pads]``: the prompts left-padded to the longest prompt ``P``, the
    responses right-padded to the longest response, so that every response starts at column ``P`` (what TorchRL's
    padded ``GRPOLoss`` actor, ``masking_strategy="sft"``, assumes). Writes ``("tokens", "prompt"|"response"|"full")``
    and ``("masks", "all_attention_mask")`` (``True`` on real tokens); the other entries of the rollout are left out.

    Args:
        rollout: a flat batch with ragged ``("tokens", "prompt")`` and ``("tokens", "response")`` (one tensor per
            sample, as ``TransformersWrapper(pad_output=False)`` writes them).

    Keyword Args:
        pad_token_id: the id written in the padding.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> rollout = lazy_stack([
        ...     TensorDict({"tokens": {"prompt": torch.tensor([7, 8]), "response": torch.tensor([9])}}),
        ...     TensorDict({"tokens": {"prompt": torch.tensor([7]), "response": torch.tensor([5, 6])}}),
        ... ])
        >>> padded = pad_rollout(rollout, pad_token_id=0)
        >>> padded["tokens", "full"]
        tensor([[7, 8, 9, 0],
                [0, 7, 5, 6]])
        >>> padded["masks", "all_attention_mask"]
        tensor([[ True,  True,  True, False],
                [False,  True,  True,  True]])
    """
    prompts = rollout.get(("tokens", "prompt"), as_list=True)
    responses = rollout.get(("tokens", "response"), as_list=True)

    def pad(seqs: list[torch.Tensor], side: str, value) -> torch.Tensor:
        return pad_sequence(seqs, batch_first=True, padding_value=value, padding_side=side)

    prompt = pad(prompts, "left", pad_token_id)
    response = pad(responses, "right", pad_token_id)
    mask = torch.cat(
        [
            pad([torch.ones_like(p, dtype=torch.bool) for p in prompts], "left", False),
            pad([torch.ones_like(r, dtype=torch.bool) for r in responses], "right", False),
        ],
        dim=-1,
    )
    tokens = {"prompt": prompt, "response": response, "full": torch.cat([prompt, response], dim=-1)}
    return TensorDict({"tokens": tokens, "masks": {"all_attention_mask": mask}}, batch_size=rollout.batch_size)


def response_texts(rollout: TensorDictBase, tokenizer) -> list[str]:
    """The responses of a rollout as plain text: ``("tokens", "response")`` decoded without special tokens."""
    tokens = rollout.reshape(-1).get(("tokens", "response"), as_list=True)
    return tokenizer.batch_decode(tokens, skip_special_tokens=True)
