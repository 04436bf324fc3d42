"""Hugging Face reward models inside TorchRL: a TensorDict module and an env transform.

Public classes:

- :class:`HFRewardModelWrapper`: scores the sequences of a tensordict with a Hugging Face sequence-classification
  reward model (for instance one trained by ``trl.RewardTrainer``) and writes one float32 reward per sample. It takes
  the same calls as ``torchrl.modules.llm.trl_interop.HFRewardModelWrapper`` and adds what real LLM rollouts need:
  ragged (unpadded) batches, the reward model's own tokenizer (plain text or chat ``History``), micro-batching,
  truncation, device and dtype handling.
- :class:`RewardModelTransform`: a TorchRL env ``Transform`` that scores every step with such a module, or with several
  named and weighted reward modules (trl's ``reward_funcs`` and ``reward_weights``: NaN-skipping weighted sum, each
  source's own values optionally kept), and writes the reward at ``("next", "reward")`` with the env's reward-spec
  shape (``batch + (1, 1)`` for LLM chat envs), which is what ``MCAdvantage`` and ``GRPOLoss`` read.

Dependencies: ``torch``, ``tensordict`` and ``torchrl``. ``transformers`` is imported only to share prefixes
(``share_prefixes=True``, :mod:`interop.prefix_scoring`); otherwise the wrapper only calls the model and tokenizer
objects it is given.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import NestedKey, NonTensorData, NonTensorStack, TensorDictBase, is_tensor_collection
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import unravel_key
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from interop.prefix_scoring import (
    SharedPrefixInputs,
    can_share_prefixes,
    plan_shared_prefixes,
    run_shared_prefixes,
    shared_prefix_inputs,
)

__all__ = ["HFRewardModelWrapper", "RewardModelTransform"]


def _flatten(values: Any) -> list:
    """Flattens the nested lists that multi-dimensional lazy stacks return into one flat list."""
    if not isinstance(values, (list, tuple)):
        return [values]
    if values and not isinstance(values[0], (list, tuple)):  # already flat: lazy stacks nest uniformly
        return list(values)
    out = []
    for value in values:
        if isinstance(value, (list, tuple)):
            out.extend(_flatten(value))
        else:
            out.append(value)
    return out


def _strings(value: Any, numel: int, key: NestedKey) -> list[str]:
    """Reads one string per sample from what ``td.get`` returned for a text key."""
    if isinstance(value, str):
        texts = [value] * numel
    elif hasattr(value, "tolist"):
        texts = _flatten(value.tolist())
    elif isinstance(value, (list, tuple)):
        texts = _flatten(list(value))
    else:
        texts = [value]
    if len(texts) == 1 and numel != 1:
        texts = texts * numel
    if len(texts) != numel or not all(isinstance(text, str) for text in texts):
        raise TypeError(
            f"HFRewardModelWrapper: expected one string per sample at text_key {key!r} ({numel} samples), "
            f"found {type(value).__name__} with {len(texts)} entries. Point text_key at the text to score "
            f"(e.g. ('text', 'full') written by TorchRL's LLM wrappers)."
        )
    return texts


def _unbind_leading(value: Any, ndims: int) -> list:
    """Splits the first ``ndims`` dims of a (possibly lazily stacked) tensordict-like into a flat list of items."""
    if ndims == 0:
        return [value]
    items = list(value.unbind(0))
    if ndims == 1:
        return items
    return [leaf for item in items for leaf in _unbind_leading(item, ndims - 1)]


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(message, dict) for message in value)


def _flatten_conversations(values: Any) -> list[list[dict]]:
    """The conversations (lists of message dicts) of a possibly nested list, one per sample, in order."""
    if _is_conversation(values):
        return [list(values)]
    out: list[list[dict]] = []
    for value in values:
        out.extend([list(value)] if _is_conversation(value) else _flatten_conversations(value))
    return out


def _messages(history: Any) -> list[dict]:
    """Turns one conversation (a 1-D torchrl ``History``) into the list of message dicts trl's datasets hold."""
    messages = []
    for message in history.tolist(tolist_first=True):
        if message.get("role") == "<none>":  # torchrl's placeholder for ragged stacks, not a message
            continue
        out = {"role": message["role"], "content": message["content"]}
        for optional in ("tool_calls", "tool_responses"):
            if message.get(optional) is not None:
                out[optional] = message[optional]
        messages.append(out)
    return messages


def _check_wrapper_arguments(model, tokenizer, history_key, micro_batch_size, max_length, padding_side) -> None:
    """:class:`HFRewardModelWrapper`'s argument checks, each error naming the argument and the fix."""
    if not callable(model):
        raise TypeError(f"HFRewardModelWrapper: model must be a callable nn.Module, got {type(model).__name__}.")
    if history_key is not None and tokenizer is None:
        raise ValueError(
            "HFRewardModelWrapper: history_key needs the reward model's tokenizer to render the conversation "
            "with its chat template; pass tokenizer=<the reward model's tokenizer>."
        )
    if tokenizer is not None and getattr(tokenizer, "eos_token", None) is None and history_key is None:
        raise ValueError(
            "HFRewardModelWrapper: the tokenizer has no eos_token, but text is scored as trl.RewardTrainer "
            "trained on it (EOS appended). Set tokenizer.eos_token to the one used in training."
        )
    if history_key is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "HFRewardModelWrapper: history_key is set but the tokenizer has no chat_template; set "
            "tokenizer.chat_template to the template the reward model was trained with."
        )
    for name, value in (("micro_batch_size", micro_batch_size), ("max_length", max_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"HFRewardModelWrapper: {name} must be a positive integer or None, got {value!r}.")
    if padding_side not in ("right", "left"):
        raise ValueError(f"HFRewardModelWrapper: padding_side must be 'right' or 'left', got {padding_side!r}.")
    model_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    tokenizer_pad = getattr(tokenizer, "pad_token_id", None)
    if model_pad is not None and tokenizer_pad is not None and model_pad != tokenizer_pad:
        raise ValueError(
            f"HFRewardModelWrapper: model.config.pad_token_id ({model_pad}) differs from tokenizer.pad_token_id "
            f"({tokenizer_pad}); sequence-classification heads score the last token that is not the model's pad "
            "id, so both must agree (trl.RewardTrainer sets model.config.pad_token_id = tokenizer.pad_token_id)."
        )


class HFRewardModelWrapper(TensorDictModuleBase):
    """A Hugging Face reward model as a TensorDict module: sequences in, one float32 reward per sample out.

    A drop-in replacement for ``torchrl.modules.llm.trl_interop.HFRewardModelWrapper`` (same positional and keyword
    arguments, same defaults, same output), correct on real LLM rollouts:

    - **Ragged batches.** TorchRL's LLM wrappers with ``pad_output=False`` store one tensor per sample, of its own
      length (a lazy stack). The wrapper reads them as a list and pads each (micro-)batch itself, on the side given by
      ``padding_side`` with the reward model's pad id (``model.config.pad_token_id``, else ``tokenizer.pad_token_id``,
      else 0) and a matching attention mask. An already padded ``[B, T]`` tensor is passed to the model unchanged.
    - **The reward model's own tokenizer.** With ``tokenizer`` the wrapper scores text rather than the policy's token
      ids: the string at ``text_key``, or, with ``history_key``, the torchrl ``History`` conversation rendered with the
      tokenizer's own chat template. It tokenizes exactly as ``trl.RewardTrainer`` (trl 1.16) did when it trained the
      model, so a prompt + response gets the score the model learned for it: plain text gets the EOS string appended
      when it does not already end with it and is tokenized with special tokens; a conversation is tokenized with
      ``tokenizer.apply_chat_template(messages, tokenize=True)`` (no generation prompt).
    - **Memory.** ``micro_batch_size`` scores the batch in chunks, each padded to its own longest sequence;
      ``max_length`` truncates each sequence (keeping its start, or its end when the tokenizer's
      ``truncation_side`` is ``"left"``).
    - **Device and dtype.** Inputs go to the model's device; rewards come back float32 on the tensordict's device
      (or the input tensors' device when the tensordict has none), whatever the model's dtype.

    The model's output may be an object or mapping with ``logits`` (HF ``SequenceClassifierOutput``) or ``rewards``,
    or a bare tensor, of shape ``[N]`` or ``[N, 1]`` for ``N`` sequences. A tensordict with several batch dimensions
    is scored as a flat batch and the reward takes the tensordict's batch shape.

    Args:
        model (nn.Module): the reward model, e.g. ``AutoModelForSequenceClassification(..., num_labels=1)``; its
            ``forward`` takes ``input_ids`` and (unless ``attention_mask_key=None`` in token mode)
            ``attention_mask``.

    Keyword Args:
        token_key (NestedKey): token ids to score when no ``tokenizer`` is given. Defaults to ``("tokens", "full")``,
            the layout of TorchRL's ``TransformersWrapper``.
        attention_mask_key (NestedKey or None): attention mask read with the token ids; ``None`` reads none and
            calls the model without one. Defaults to ``("masks", "all_attention_mask")``.
        reward_key (NestedKey): where the reward (shape: the tensordict's batch shape) is written. Defaults to
            ``"reward"``.
        inference_mode (bool): if ``True`` the model runs under ``torch.no_grad()``: no autograd graph is built and
            the reward is an ordinary tensor that later autograd code may use (unlike ``torch.inference_mode``
            tensors). Defaults to ``False`` (gradients flow into the model).
        tokenizer: the reward model's tokenizer (a ``transformers`` tokenizer). When given, text or a conversation is
            scored instead of ``token_key``. Defaults to ``None``.
        text_key (NestedKey): the text scored when ``tokenizer`` is given and ``history_key`` is ``None``. Defaults
            to ``("text", "full")`` (prompt + response as the policy saw it).
        history_key (NestedKey or None): the conversations to render with the tokenizer's chat template, one per
            sample: a torchrl ``History``, or a ``NonTensorStack`` of message lists (``[{"role": ..., "content":
            ...}, ...]``, as trl's conversational datasets hold them); requires ``tokenizer``. In a ``ChatEnv`` step the
            conversation including the new response is at ``("history", "full")``. Defaults to ``None``.
        micro_batch_size (int or None): largest number of sequences sent through the model at once. Defaults to
            ``None`` (the whole batch).
        max_length (int or None): truncate each sequence to this many of its real tokens (its padding apart,
            whichever side it is on). ``trl.RewardTrainer`` drops longer pairs at training time instead, so scores
            of truncated sequences are outside what the model was trained on. Defaults to ``None``.
        padding_side (str): ``"right"`` or ``"left"``, where ragged sequences are padded. Defaults to ``"right"``.
        check_finite (bool): raise, naming the model and the rows, when a reward is NaN or infinite (a broken
            reward model would otherwise train a policy on garbage). Defaults to ``False``.
        share_prefixes (bool): run a prefix that consecutive rows share (a GRPO group's prompt) through the model
            once, its keys and values read from a cache by the pass over each row's remaining tokens
            (:mod:`interop.prefix_scoring`): the same rewards up to float rounding, fewer positions computed. Applies
            to ragged or tokenized inputs with ``padding_side="right"`` and to ``transformers`` decoders whose layers
            all attend to the whole sequence and whose config has a pad id; other models and batches where it saves
            under 15% of the positions take the padded pass. Defaults to ``False``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from interop import HFRewardModelWrapper
        >>> class SumRewardModel(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return (input_ids * attention_mask).sum(-1, keepdim=True).float()
        >>> wrapper = HFRewardModelWrapper(SumRewardModel(), inference_mode=True)
        >>> td = TensorDict(
        ...     {
        ...         "tokens": {"full": torch.tensor([[1, 2, 3], [4, 5, 0]])},
        ...         "masks": {"all_attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])},
        ...     },
        ...     batch_size=[2],
        ... )
        >>> wrapper(td)["reward"]
        tensor([6., 9.])
        >>> # ragged rollouts (``TransformersWrapper(pad_output=False)``) are lazy stacks of different lengths
        >>> from tensordict import lazy_stack
        >>> ragged = lazy_stack(
        ...     [
        ...         TensorDict({"tokens": {"full": torch.tensor([1, 2, 3])},
        ...                     "masks": {"all_attention_mask": torch.ones(3, dtype=torch.bool)}}),
        ...         TensorDict({"tokens": {"full": torch.tensor([4, 5])},
        ...                     "masks": {"all_attention_mask": torch.ones(2, dtype=torch.bool)}}),
        ...     ]
        ... )
        >>> wrapper(ragged)["reward"]
        tensor([6., 9.])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        token_key: NestedKey = ("tokens", "full"),
        attention_mask_key: NestedKey | None = ("masks", "all_attention_mask"),
        reward_key: NestedKey = "reward",
        inference_mode: bool = False,
        tokenizer: Any = None,
        text_key: NestedKey = ("text", "full"),
        history_key: NestedKey | None = None,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
        padding_side: Literal["right", "left"] = "right",
        check_finite: bool = False,
        share_prefixes: bool = False,
    ) -> None:
        _check_wrapper_arguments(model, tokenizer, history_key, micro_batch_size, max_length, padding_side)
        config = getattr(model, "config", None)
        model_pad = getattr(config, "pad_token_id", None)
        tokenizer_pad = getattr(tokenizer, "pad_token_id", None)

        super().__init__()
        if tokenizer is None:
            mode = "tokens"
            in_keys = [token_key] if attention_mask_key is None else [token_key, attention_mask_key]
        elif history_key is None:
            mode = "text"
            in_keys = [text_key]
        else:
            mode = "history"
            in_keys = [history_key]
        self.in_keys = in_keys
        self.out_keys = [reward_key]

        self.model = model
        self.tokenizer = tokenizer
        self.token_key = token_key
        self.attention_mask_key = attention_mask_key
        self.reward_key = reward_key
        self.text_key = text_key
        self.history_key = history_key
        self.inference_mode = inference_mode
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.padding_side = padding_side
        self.check_finite = check_finite
        self._mode = mode
        self._pad_token_id = model_pad if model_pad is not None else tokenizer_pad
        # Positions follow the mask in the shared passes; a left-padded pass puts its pads at the first positions.
        self.share_prefixes = share_prefixes and padding_side == "right" and can_share_prefixes(model)
        # The id a sequence classifier's pooling skips (its text config's): the shared passes keep its last other token.
        self._classifier_pad_token_id = (
            config.get_text_config().pad_token_id if self.share_prefixes and config is not None else None
        )

    # ------------------------------------------------------------------ reading the inputs

    def _get(self, tensordict: TensorDictBase, key: NestedKey, what: str, **kwargs) -> Any:
        value = tensordict.get(key, None, **kwargs)
        if value is None:
            raise KeyError(
                f"HFRewardModelWrapper: {what} {key!r} not found in the input TensorDict (keys: "
                f"{sorted(map(str, tensordict.keys(True, True)))}). Pass {what}=<the key holding it>."
            )
        return value

    def _read_tokens(self, tensordict: TensorDictBase):
        """Token ids (and mask) as one padded ``[N, T]`` tensor when the input is dense, else as per-sample lists."""
        ids = self._get(tensordict, self.token_key, "token_key", as_list=True)
        mask = None
        if self.attention_mask_key is not None:
            mask = self._get(tensordict, self.attention_mask_key, "attention_mask_key", as_list=True)
        if isinstance(ids, torch.Tensor) and (mask is None or isinstance(mask, torch.Tensor)):
            if ids.ndim == 1:  # a single unbatched sequence
                ids = ids.unsqueeze(0)
                mask = mask.unsqueeze(0) if mask is not None else None
            ids = ids.reshape(-1, ids.shape[-1])
            if mask is not None:
                mask = mask.reshape(-1, mask.shape[-1])
            return ids, mask
        ids = list(ids.reshape(-1, ids.shape[-1]).unbind(0)) if isinstance(ids, torch.Tensor) else _flatten(ids)
        if mask is not None:
            if isinstance(mask, torch.Tensor):
                mask = list(mask.reshape(-1, mask.shape[-1]).unbind(0))
            else:
                mask = _flatten(mask)
            for i, (seq, seq_mask) in enumerate(zip(ids, mask, strict=True)):
                if seq.shape != seq_mask.shape:
                    raise ValueError(
                        f"HFRewardModelWrapper: sample {i} has {tuple(seq.shape)} token ids at {self.token_key!r} "
                        f"but an attention mask of shape {tuple(seq_mask.shape)} at {self.attention_mask_key!r}."
                    )
        return ids, mask

    def _tokenize(self, tensordict: TensorDictBase, numel: int) -> list[list[int]]:
        """Token ids of the text or conversations, tokenized as ``trl.RewardTrainer`` tokenized its training data."""
        tokenizer = self.tokenizer
        if self._mode == "text":
            texts = _strings(self._get(tensordict, self.text_key, "text_key"), numel, self.text_key)
            eos = tokenizer.eos_token
            texts = [text if text.endswith(eos) else text + eos for text in texts]
            return list(tokenizer(texts)["input_ids"])
        history = self._get(tensordict, self.history_key, "history_key")
        if isinstance(history, (NonTensorData, NonTensorStack)):
            # Plain message lists, one conversation per sample (no History tensorclass to build or unpack).
            messages = _flatten_conversations(history.tolist())
        elif is_tensor_collection(history):
            messages = [_messages(conversation) for conversation in _unbind_leading(history, tensordict.batch_dims)]
        else:
            raise TypeError(
                f"HFRewardModelWrapper: history_key {self.history_key!r} holds {type(history).__name__}, expected a "
                "torchrl.data.llm.History, or a NonTensorStack of message lists, with one conversation per sample."
            )
        if len(messages) != numel:
            raise ValueError(
                f"HFRewardModelWrapper: history_key {self.history_key!r} holds {len(messages)} conversations "
                f"for {numel} samples; expected a History of shape [*batch, n_messages] or one message list per "
                "sample."
            )
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        return [list(ids) for ids in encoded["input_ids"]]

    # ------------------------------------------------------------------ scoring

    def _truncation_window(self, max_length: int) -> slice:
        """The ``max_length`` tokens kept: the first ones, or the last with a tokenizer that truncates on the left."""
        keep_end = getattr(self.tokenizer, "truncation_side", "right") == "left"
        return slice(-max_length, None) if keep_end else slice(0, max_length)

    def _truncate(self, seq, seq_mask):
        if self.max_length is None or len(seq) <= self.max_length:
            return seq, seq_mask
        window = self._truncation_window(self.max_length)
        return seq[window], (seq_mask[window] if seq_mask is not None else None)

    def _pad(self, seqs: list, masks: list | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        pad_id = self._pad_token_id if self._pad_token_id is not None else 0
        right = self.padding_side == "right"
        lengths = [len(seq) for seq in seqs]
        longest = max(lengths)
        if isinstance(seqs[0], list):  # tokenizer output: pad in Python, then a single tensor copy
            rows = [
                seq + [pad_id] * (longest - len(seq)) if right else [pad_id] * (longest - len(seq)) + seq
                for seq in seqs
            ]
            ids = torch.tensor(rows)
        else:
            ids = pad_sequence(seqs, batch_first=True, padding_value=pad_id, padding_side=self.padding_side)
        if masks is not None and bool(torch.cat(masks).all()):  # the usual case (pad_output=False): no padding yet
            masks = None
        if masks is None:  # real tokens only: the mask follows from the lengths
            positions = torch.arange(longest)
            length_column = torch.tensor(lengths).unsqueeze(-1)
            mask = positions < length_column if right else positions >= longest - length_column
        else:
            mask = pad_sequence(masks, batch_first=True, padding_value=0, padding_side=self.padding_side)
        return ids.to(device, non_blocking=True), mask.to(device=device, dtype=torch.long, non_blocking=True)

    def _call_model(
        self, ids: torch.Tensor | None, mask: torch.Tensor | None, shared: SharedPrefixInputs | None = None
    ) -> torch.Tensor:
        if shared is not None:
            out = run_shared_prefixes(self.model, shared, self._model_device())
            n = shared.suffix_ids.shape[0]
        else:
            assert ids is not None
            out = self.model(input_ids=ids) if mask is None else self.model(input_ids=ids, attention_mask=mask)
            n = ids.shape[0]
        if isinstance(out, torch.Tensor):
            rewards = out
        elif hasattr(out, "logits"):
            rewards = out.logits
        elif hasattr(out, "rewards"):
            rewards = out.rewards
        elif isinstance(out, dict) and ("logits" in out or "rewards" in out):
            rewards = out["logits"] if "logits" in out else out["rewards"]
        else:
            raise RuntimeError(
                "HFRewardModelWrapper: could not extract reward from the model output of type "
                f"{type(out).__name__}; the model must return a tensor or an output with 'logits' or 'rewards' "
                "(e.g. AutoModelForSequenceClassification with num_labels=1)."
            )
        if rewards.shape == (n, 1):
            rewards = rewards.squeeze(-1)
        elif rewards.shape != (n,):
            raise RuntimeError(
                f"HFRewardModelWrapper: expected one scalar reward per input sequence, of shape ({n},) or ({n}, 1), "
                f"got {tuple(rewards.shape)}. A classification head with several labels needs num_labels=1."
            )
        return rewards.float()

    def _model_device(self) -> torch.device | None:
        param = next(iter(self.model.parameters()), None) if isinstance(self.model, nn.Module) else None
        return param.device if param is not None else None

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Scores the sequences of ``tensordict`` and writes the reward at ``reward_key``.

        Args:
            tensordict (TensorDictBase): holds the keys listed in :attr:`in_keys`.

        Returns:
            the same tensordict, with a float32 reward of shape ``tensordict.batch_size`` at ``reward_key``.
        """
        batch_size = tensordict.batch_size
        numel = batch_size.numel()
        if numel == 0:
            raise ValueError(
                f"HFRewardModelWrapper: nothing to score, the TensorDict has batch size {tuple(batch_size)}."
            )
        model_device = self._model_device()
        out_device = tensordict.device

        if self._mode == "tokens":
            ids, mask = self._read_tokens(tensordict)
            if out_device is None:
                out_device = ids.device if isinstance(ids, torch.Tensor) else ids[0].device
            if self.share_prefixes and isinstance(ids, torch.Tensor) and mask is not None:
                keep = mask.bool()  # each row's real tokens, as the ragged layout holds them
                ids, mask = list(ids[keep].split(keep.sum(-1).tolist())), None
            if isinstance(ids, torch.Tensor) and self.max_length is not None and ids.shape[-1] > self.max_length:
                if mask is None or bool(mask.all()):
                    # Every row is all real tokens: truncating each one is truncating the columns.
                    window = self._truncation_window(self.max_length)
                    ids = ids[..., window]
                    mask = mask[..., window] if mask is not None else None
                else:
                    # Padded rows: each keeps max_length of its own real tokens, wherever its padding is, and is
                    # padded again on padding_side (cutting columns would cut the real tokens of left-padded rows).
                    keep = mask.bool()
                    ids, mask = list(ids[keep].split(keep.sum(-1).tolist())), None
            if isinstance(ids, torch.Tensor):
                chunks = self._dense_chunks(ids, mask, model_device)
            else:
                chunks = self._ragged_chunks(ids, mask, model_device, pass_mask=self.attention_mask_key is not None)
        else:
            seqs = self._tokenize(tensordict, numel)
            chunks = self._ragged_chunks(seqs, None, model_device, pass_mask=True)

        grad_context = torch.no_grad() if self.inference_mode else contextlib.nullcontext()
        with grad_context:
            rewards = [self._call_model(*chunk) for chunk in chunks]
        reward = rewards[0] if len(rewards) == 1 else torch.cat(rewards)
        if reward.shape[0] != numel:
            raise RuntimeError(
                f"HFRewardModelWrapper: scored {reward.shape[0]} sequences for a TensorDict of batch size "
                f"{tuple(batch_size)}; {self.in_keys[0]!r} must hold one sequence per sample."
            )
        if out_device is None:
            out_device = torch.device("cpu")
        if self.check_finite:
            self._check_finite(reward)
        tensordict.set(self.reward_key, reward.to(out_device).reshape(batch_size))
        return tensordict

    def _check_finite(self, reward: torch.Tensor) -> None:
        bad = (~torch.isfinite(reward)).nonzero().flatten().tolist()
        if bad:
            name = getattr(getattr(self.model, "config", None), "_name_or_path", "") or type(self.model).__name__
            raise ValueError(
                f"HFRewardModelWrapper: the reward model {name!r} gave {len(bad)} non-finite reward(s) (rows "
                f"{bad[:10]}{'...' if len(bad) > 10 else ''}: {reward[bad[:3]].tolist()}); its weights or inputs are "
                "broken (a model saved with NaN weights, a dtype that overflows). Check the model."
            )

    def _dense_chunks(self, ids, mask, device):
        size = self.micro_batch_size or ids.shape[0]
        for start in range(0, ids.shape[0], size):
            chunk_ids = ids[start : start + size]
            chunk_mask = mask[start : start + size] if mask is not None else None
            if device is not None:
                chunk_ids = chunk_ids.to(device, non_blocking=True)
                chunk_mask = chunk_mask.to(device, non_blocking=True) if chunk_mask is not None else None
            yield chunk_ids, chunk_mask

    def _ragged_chunks(self, seqs, masks, device, *, pass_mask: bool):
        size = self.micro_batch_size or len(seqs)
        for start in range(0, len(seqs), size):
            chunk = seqs[start : start + size]
            chunk_masks = masks[start : start + size] if masks is not None else [None] * len(chunk)
            pairs = [self._truncate(seq, seq_mask) for seq, seq_mask in zip(chunk, chunk_masks, strict=True)]
            chunk = [seq for seq, _ in pairs]
            chunk_masks = [seq_mask for _, seq_mask in pairs] if masks is not None else None
            if device is None:
                device = chunk[0].device if isinstance(chunk[0], torch.Tensor) else torch.device("cpu")
            shared = self._shared_inputs(chunk, chunk_masks) if pass_mask else None
            if shared is not None:
                yield None, None, shared
                continue
            chunk_ids, chunk_mask = self._pad(chunk, chunk_masks, device)
            yield chunk_ids, (chunk_mask if pass_mask else None)

    def _shared_inputs(self, seqs: list, masks: list | None) -> SharedPrefixInputs | None:
        """The shared-prefix passes' inputs for one chunk, or ``None`` where the padded pass is the one to run."""
        if not self.share_prefixes or (masks is not None and not bool(torch.cat(masks).all())):
            return None
        pad_token_id = self._classifier_pad_token_id
        assert pad_token_id is not None  # can_share_prefixes checked it
        rows = [seq.tolist() if isinstance(seq, torch.Tensor) else seq for seq in seqs]
        plan = plan_shared_prefixes(rows, pad_token_id=pad_token_id)
        return shared_prefix_inputs(rows, plan, pad_token_id=pad_token_id) if plan is not None else None

    def __repr__(self) -> str:
        if self._mode == "tokens":
            source = f"token_key={self.token_key!r}, attention_mask_key={self.attention_mask_key!r}"
        elif self._mode == "text":
            source = f"tokenizer={type(self.tokenizer).__name__}, text_key={self.text_key!r}"
        else:
            source = f"tokenizer={type(self.tokenizer).__name__}, history_key={self.history_key!r}"
        return (
            f"{type(self).__name__}(model={type(self.model).__name__}, {source}, reward_key={self.reward_key!r}, "
            f"inference_mode={self.inference_mode}, micro_batch_size={self.micro_batch_size}, "
            f"max_length={self.max_length}, padding_side={self.padding_side!r})"
        )


def _named_sources(reward_module: Any, name: str | None) -> dict[str, Any]:
    """``{name: module}`` for one reward module or a mapping of them, each checked to be a module with one out key."""
    if isinstance(reward_module, Mapping):
        if name is not None:
            raise ValueError(
                "RewardModelTransform: name names a single reward_module; the keys of a mapping of reward sources "
                "name them. Drop name=, or pass one module."
            )
        if not reward_module:
            raise ValueError("RewardModelTransform: the mapping of reward sources is empty; give at least one module.")
        sources = dict(reward_module)
        labels = {key: f"reward_module[{key!r}]" for key in sources}
    else:
        sources = {name or type(reward_module).__name__: reward_module}
        labels = dict.fromkeys(sources, "reward_module")
    for key, module in sources.items():
        if not isinstance(key, str):
            raise TypeError(f"RewardModelTransform: reward sources are named by strings, got {key!r}.")
        if not callable(module):
            raise TypeError(
                f"RewardModelTransform: {labels[key]} must be a TensorDict module, got {type(module).__name__}."
            )
        out_keys = list(getattr(module, "out_keys", None) or [])
        if len(out_keys) != 1:
            raise ValueError(
                f"RewardModelTransform: {labels[key]} must declare exactly one out_key (the reward), got "
                f"{out_keys!r}. Wrap it so it writes a single reward entry."
            )
    return sources


def _check_source_names(what: str, names: Any, sources: Mapping) -> None:
    unknown = [key for key in names if key not in sources]
    if unknown:
        raise ValueError(
            f"RewardModelTransform: {what} names {unknown}, which are not reward sources; the sources are "
            f"{list(sources)}."
        )


def _as_tuple(key: NestedKey) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _rows(mask: torch.Tensor) -> str:
    rows = mask.nonzero().flatten().tolist()
    return f"{len(rows)} row(s) (rows {rows[:10]}{'...' if len(rows) > 10 else ''})"


class RewardModelTransform(Transform):
    """Scores each env step with a reward module, or several named and weighted ones, and writes the reward with the
    env's reward-spec shape.

    ``ChatEnv`` declares no reward; appending this transform declares one (``Unbounded``, float32, shape
    ``env.batch_size + reward_shape``, ``(1, 1)`` by default as TorchRL's LLM reward transforms do) and fills it at
    every step. The result is what ``MCAdvantage(grpo_size=G)`` (reads ``("next", "reward")``) and ``GRPOLoss``
    (needs ``advantage.ndim == 3``) expect, with no reshaping in between.

    At each step the reward module reads the tensordict of time ``t`` (``read_from="root"``), which holds the policy's
    output: ``("tokens", "full")``, ``("masks", "all_attention_mask")``, ``("text", "full")`` and ``("history",
    "full")`` (prompt + new response) with TorchRL's LLM wrappers. With ``read_from="next"`` it reads the env's step
    output instead; in ``ChatEnv`` history mode the whole conversation is then at ``("history", "prompt")`` (the
    prompt of the next turn). The module runs under ``torch.no_grad()``: an env reward is data, not a graph.

    The module scores a selection of the keys it declares in ``in_keys``, so its own output key (``"reward"`` for
    :class:`HFRewardModelWrapper`) never leaks into the rollout; the transform then writes the reward at
    ``("next", reward_key)``.

    **Several sources.** Given a mapping ``{name: module}`` instead of one module, the transform scores the step with
    every module in turn, each on its own selection, and writes their weighted sum, as ``trl.GRPOTrainer`` sums its
    ``reward_funcs`` with ``reward_weights``: ``reward = sum_k weights[name_k] * value_k``. A source named in
    ``allow_nan`` may return NaN for a row it does not apply to (what a trl reward function's ``None`` becomes): that
    value is left out of the sum. A row that every source leaves out has no reward and stops the step, naming the
    sources. With ``source_rewards_key`` each source's own value (before weighting, NaN where it does not apply) is
    written too, at ``("next", source_rewards_key)`` with shape ``batch + (number of sources,)``, in the mapping's
    order, and declared in the observation spec (a reset writes NaN there: nothing scored yet). A single module is
    the one-source case (weight 1).

    Args:
        reward_module (TensorDictModuleBase or Mapping[str, TensorDictModuleBase]): a module with ``in_keys`` and
            exactly one ``out_keys`` entry holding one reward per sample, typically :class:`HFRewardModelWrapper`;
            or several such modules by name (the names are what the error messages call them).

    Keyword Args:
        reward_key (NestedKey): the reward entry of the env, written under ``"next"``. Defaults to ``"reward"``.
        read_from (str): ``"root"`` (the step's input tensordict, with the policy's output) or ``"next"`` (the env's
            step output). Defaults to ``"root"``.
        reward_shape (tuple of int): trailing shape of the reward after the env's batch dims. Defaults to ``(1, 1)``
            (TorchRL's LLM convention, required by ``GRPOLoss``); use ``(1,)`` for classic envs.
        accumulate (bool): add the score to a reward already present at ``("next", reward_key)`` (for instance a
            rule-based reward from an earlier transform) instead of overwriting it. Defaults to ``False``.
        check_finite (bool): raise, naming the source, when one returns an infinite value or a NaN that it is not
            allowed (``allow_nan``). Without it such a NaN makes the row's reward NaN. Defaults to ``False``.
        name (str, optional): what the messages call a single reward module (e.g. the config key it came from).
            With a mapping the keys name the sources.
        weights (Mapping[str, float], optional): each source's weight in the sum, by name; a source not listed
            weighs 1. Defaults to ``None`` (all 1).
        allow_nan (Collection[str]): the sources whose NaN means "does not apply to this row": left out of the sum
            and never an error (an infinite value still is, under ``check_finite``). Defaults to ``()``.
        source_rewards_key (NestedKey, optional): where, under ``"next"``, each source's own value is written.
            Defaults to ``None`` (not written).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from interop import HFRewardModelWrapper, RewardModelTransform
        >>> class LengthRewardModel(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask):
        ...         return attention_mask.sum(-1).float()
        >>> transform = RewardModelTransform(HFRewardModelWrapper(LengthRewardModel()))
        >>> transform
        RewardModelTransform(reward_module=HFRewardModelWrapper, reward_key='reward', read_from='root', ...)
        >>> # outside an env (e.g. on stored transitions) forward() writes ("next", reward_key)
        >>> td = TensorDict(
        ...     {"tokens": {"full": torch.ones(2, 4, dtype=torch.long)},
        ...      "masks": {"all_attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}},
        ...     batch_size=[2],
        ... )
        >>> transform(td)["next", "reward"].view(-1)
        tensor([4., 2.])
        >>> transform(td)["next", "reward"].shape
        torch.Size([2, 1, 1])

        Several weighted sources, one of which applies to long sequences only (NaN elsewhere):

        >>> from tensordict.nn import TensorDictModule
        >>> mask = ("masks", "all_attention_mask")
        >>> bonus = TensorDictModule(
        ...     lambda m: torch.where(m.sum(-1) > 3, 1.0, torch.nan), in_keys=[mask], out_keys=["bonus"]
        ... )
        >>> transform = RewardModelTransform(
        ...     {"length": HFRewardModelWrapper(LengthRewardModel()), "bonus": bonus},
        ...     weights={"bonus": 10.0},
        ...     allow_nan=["bonus"],
        ...     source_rewards_key="source_rewards",
        ...     check_finite=True,
        ... )
        >>> out = transform(td)
        >>> out["next", "source_rewards"]
        tensor([[4., 1.],
                [2., nan]])
        >>> out["next", "reward"].view(-1)
        tensor([14.,  2.])

        In an LLM chat env (``ChatEnv``) with TorchRL's ``TransformersWrapper`` policy::

            env = ChatEnv.from_dataloader(dataloader=..., repeats=G, batch_size=(G,), tokenizer=policy_tokenizer)
            env = env.append_transform(StepCounter(max_steps=1))
            env = env.append_transform(
                RewardModelTransform(
                    HFRewardModelWrapper(rm, tokenizer=rm_tokenizer, history_key=("history", "full"))
                )
            )
            env.full_reward_spec["reward"].shape  # torch.Size([G, 1, 1])
    """

    def __init__(
        self,
        reward_module: TensorDictModuleBase | Mapping[str, TensorDictModuleBase],
        *,
        reward_key: NestedKey = "reward",
        read_from: Literal["root", "next"] = "root",
        reward_shape: Sequence[int] = (1, 1),
        accumulate: bool = False,
        check_finite: bool = False,
        name: str | None = None,
        weights: Mapping[str, float] | None = None,
        allow_nan: Collection[str] = (),
        source_rewards_key: NestedKey | None = None,
    ) -> None:
        sources = _named_sources(reward_module, name)
        if read_from not in ("root", "next"):
            raise ValueError(f"RewardModelTransform: read_from must be 'root' or 'next', got {read_from!r}.")
        reward_shape = tuple(int(s) for s in reward_shape)
        if any(s <= 0 for s in reward_shape) or int(torch.Size(reward_shape).numel()) != 1:
            raise ValueError(
                f"RewardModelTransform: reward_shape must hold one element per sample (e.g. (1, 1) or (1,)), got "
                f"{reward_shape!r}."
            )
        weights = dict(weights or {})
        _check_source_names("weights", weights, sources)
        for key, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"RewardModelTransform: weights[{key!r}] must be a finite number, got {weight!r}.")
        allow_nan = [allow_nan] if isinstance(allow_nan, str) else list(allow_nan)
        _check_source_names("allow_nan", allow_nan, sources)
        reward_key = unravel_key(reward_key)
        if source_rewards_key is not None:
            source_rewards_key = unravel_key(source_rewards_key)
            if source_rewards_key == reward_key:
                raise ValueError(
                    f"RewardModelTransform: source_rewards_key and reward_key are both {reward_key!r}; the sum and the "
                    "per-source values need entries of their own."
                )
        out_keys = [reward_key] if source_rewards_key is None else [reward_key, source_rewards_key]
        super().__init__(in_keys=[], out_keys=out_keys)
        if isinstance(reward_module, Mapping):
            self.reward_module = None
            for index, module in enumerate(sources.values()):  # registered, so that .to() and repr see them
                if isinstance(module, nn.Module):
                    self.add_module(f"source_{index}", module)
        else:
            self.reward_module = reward_module
        self.reward_modules = sources
        self.reward_key = reward_key
        self.source_rewards_key = source_rewards_key
        self.read_from = read_from
        self.reward_shape = reward_shape
        self.accumulate = accumulate
        self.check_finite = check_finite
        self.name = None if isinstance(reward_module, Mapping) else next(iter(sources))
        self.weights = torch.tensor([float(weights.get(key, 1.0)) for key in sources], dtype=torch.float32)
        self.allow_nan = frozenset(allow_nan)
        self._allow_nan_mask = torch.tensor([key in self.allow_nan for key in sources])
        self._module_reward_keys = [unravel_key(module.out_keys[0]) for module in sources.values()]
        self._reward_tuple = _as_tuple(reward_key)
        self._source_rewards_tuple = _as_tuple(source_rewards_key) if source_rewards_key is not None else None

    def _score_one(self, name: str, module: Any, out_key: NestedKey, source: TensorDictBase) -> torch.Tensor:
        """One source's float32 values for the rows of ``source``, flat, checked."""
        in_keys = list(getattr(module, "in_keys", None) or [])
        scratch = source.select(*in_keys, strict=False) if in_keys else source.copy()
        with torch.no_grad():
            scored = module(scratch)
        if scored is None:
            scored = scratch
        reward = scored.get(out_key, None)
        if reward is None:
            raise KeyError(
                f"RewardModelTransform: the reward source {name!r} wrote no {out_key!r} entry; check its out_keys."
            )
        if reward.numel() != source.batch_size.numel():
            raise RuntimeError(
                f"RewardModelTransform: the reward source {name!r} returned {reward.numel()} rewards for a batch of "
                f"{tuple(source.batch_size)}; it must return one reward per sample."
            )
        reward = reward.reshape(-1).to(torch.float32)
        if self.check_finite:
            allowed = name in self.allow_nan
            bad = torch.isinf(reward) if allowed else ~torch.isfinite(reward)
            if bool(bad.any()):
                raise ValueError(
                    f"RewardModelTransform: the reward source {name!r} returned non-finite rewards for {_rows(bad)}"
                    f"{' (NaN, not applicable, is allowed; inf is not)' if allowed else ''}; a policy trained on them "
                    "would learn garbage. Fix the source."
                )
        return reward

    def score(self, source: TensorDictBase, device: torch.device | None = None) -> torch.Tensor:
        """Every source's values for the rows of ``source`` (flattened), unweighted.

        Args:
            source (TensorDictBase): what the sources read (the step's input or output, see ``read_from``).
            device (torch.device, optional): where the values go. Defaults to the first source's output device.

        Returns:
            a float32 tensor ``[N, number of sources]``, NaN where an ``allow_nan`` source does not apply.
        """
        names = list(self.reward_modules)
        columns = [
            self._score_one(name, module, out_key, source)
            for name, module, out_key in zip(names, self.reward_modules.values(), self._module_reward_keys, strict=True)
        ]
        device = device if device is not None else columns[0].device
        values = torch.stack([column.to(device) for column in columns], dim=-1)
        if bool(self._allow_nan_mask.all()):  # a source that must always score gives every row a reward
            unscored = torch.isnan(values).all(dim=-1)
            if bool(unscored.any()):
                raise RuntimeError(
                    f"RewardModelTransform: {_rows(unscored)} are scored by no source. Every reward source "
                    f"({', '.join(names)}) returned NaN (not applicable) for them. Make at least one source apply to "
                    "every row, or add one that always does."
                )
        return values

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each row of :meth:`score`'s values, an ``allow_nan`` source's NaN left out: ``[N]``."""
        total = (values * self.weights.to(values.device)).nansum(dim=-1)
        strict = ~self._allow_nan_mask.to(values.device)
        if bool(strict.any()):  # a NaN from a source that must score is not "not applicable": it stays NaN
            total = torch.where(torch.isnan(values[..., strict]).any(dim=-1), torch.nan, total)
        return total

    def _write(self, tensordict: TensorDictBase, prefix: tuple, source: TensorDictBase) -> None:
        shape = torch.Size(tensordict.batch_size)
        values = self.score(source, tensordict.device)
        reward = self.total(values).reshape(shape + self.reward_shape)
        key = (*prefix, *self._reward_tuple)
        if self.accumulate:
            previous = tensordict.get(key, None)
            if previous is not None:
                reward = previous.reshape(reward.shape).to(reward) + reward
        tensordict.set(key, reward)
        if self._source_rewards_tuple is not None:
            tensordict.set((*prefix, *self._source_rewards_tuple), values.reshape(*shape, len(self.reward_modules)))

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        self._write(next_tensordict, (), tensordict if self.read_from == "root" else next_tensordict)
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        # source_rewards_key is an observation: a reset writes it too, NaN (nothing scored yet), as its spec says.
        if self._source_rewards_tuple is not None:
            shape = (*tensordict_reset.batch_size, len(self.reward_modules))
            tensordict_reset.set(
                self._source_rewards_tuple, torch.full(shape, torch.nan, device=tensordict_reset.device)
            )
        return tensordict_reset

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Scores stored transitions outside an env: reads as in a step and writes ``("next", reward_key)`` (and
        ``("next", source_rewards_key)``).

        Args:
            tensordict (TensorDictBase): transitions holding the reward modules' inputs at the root (or under
                ``"next"`` with ``read_from="next"``).

        Returns:
            the same tensordict with the reward at ``("next", reward_key)``, shape ``batch + reward_shape``.
        """
        if self.read_from == "root":
            source = tensordict
        else:
            source = tensordict.get("next", None)
            if source is None:
                raise KeyError("RewardModelTransform: read_from='next' but the tensordict has no 'next' entry.")
        self._write(tensordict, ("next",), source)
        return tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        """Declares the reward entry: ``Unbounded`` float32 of shape ``batch + reward_shape``."""
        if self.reward_key in reward_spec.keys(True, True):
            return reward_spec
        reward_spec[self.reward_key] = Unbounded(
            shape=reward_spec.shape + self.reward_shape, dtype=torch.float32, device=reward_spec.device
        )
        return reward_spec

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        """Declares ``source_rewards_key`` when set: ``Unbounded`` float32 of shape ``batch + (number of sources,)``."""
        if self.source_rewards_key is not None:
            observation_spec[self.source_rewards_key] = Unbounded(
                shape=(*observation_spec.shape, len(self.reward_modules)),
                dtype=torch.float32,
                device=observation_spec.device,
            )
        return observation_spec

    def __repr__(self) -> str:
        if self.reward_module is not None:
            modules = f"reward_module={type(self.reward_module).__name__}"
        else:
            sources = ", ".join(f"{key!r}: {type(module).__name__}" for key, module in self.reward_modules.items())
            weights = dict(zip(self.reward_modules, self.weights.tolist(), strict=True))
            modules = f"reward_module={{{sources}}}, weights={weights}, allow_nan={sorted(self.allow_nan)}"
        extra = "" if self.source_rewards_key is None else f", source_rewards_key={self.source_rewards_key!r}"
        return (
            f"{type(self).__name__}({modules}, reward_key={self.reward_key!r}{extra}, read_from={self.read_from!r}, "
            f"reward_shape={self.reward_shape}, accumulate={self.accumulate})"
        )
