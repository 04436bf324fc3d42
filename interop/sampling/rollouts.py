"""The sync rollout core: one completion (or one tool dialog) per prompt from a TorchRL LLM policy, laid out in the
columns of trl's ``rollout_func``.

Public names:

- :class:`RolloutSampler`: wraps a TensorDict policy that reads left-padded prompt tokens and writes response tokens
  and their log-probs in TorchRL's layout (:class:`~interop.sampling.CausalLMSampler`, TorchRL's
  ``TransformersWrapper`` in generate mode, or any module with the same keys), or a
  :class:`~interop.tools.dialogs.DialogSampler` (``dialogs=True``); :meth:`RolloutSampler.sample` turns prompt token
  ids into a ``[B]`` TensorDict: ``prompt_ids``, ``completion_ids``, ``logprobs``, their lengths, ``truncated`` (and
  ``env_mask`` with the tool counts for dialogs).
- :data:`TOOL_COUNTS`: a dialog's per-row counts kept with its tokens (tool calls, failed calls, assistant turns).

Who builds one: :class:`interop.TorchRLRolloutFunc` in the trainer's process (sync mode), and every sampler apart from
it, each around its own copy of the model (the child process of :class:`~interop.sampling.background.BackgroundSampler`
and each Ray worker of :mod:`interop.sampling.workers`, through
:func:`~interop.sampling.background.build_rollout_sampler`). Its errors name ``TorchRLRolloutFunc``, the class users
build it through.

Dependencies: ``torch``, ``tensordict``; tokenizers are duck-typed (``pad_token_id``, ``eos_token_id``).
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from torch.nn.utils.rnn import pad_sequence

from interop.sampling.sampler import (
    ATTENTION_MASK,
    PROMPT_MASK,
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    SamplingSettings,
)
from interop.sampling.sampler import LOG_PROBS as FULL_LOG_PROBS

__all__ = ["RESPONSE_LOG_PROBS", "TOOL_COUNTS", "RolloutSampler"]

RESPONSE_LOG_PROBS = ("log_probs", "response")  # TorchRL's TransformersWrapper writes the response's alone
# A dialog's per-row counts kept with its tokens (tools=...): tool calls, failed calls, assistant turns.
TOOL_COUNTS = ("tool_calls", "tool_errors", "turns")


class RolloutSampler:
    """Samples one completion per prompt, given as token ids, with a TorchRL LLM policy.

    Args:
        policy: a TensorDict module that reads ``("tokens", "prompt")`` (left-padded ``[B, P]``; it may also read
            ``("masks", "prompt")``) and writes ``("tokens", "response")`` and the sampled tokens' log-probs,
            ``("log_probs", "response")`` (``[B, R]``) or ``("log_probs", "full")`` (``[B, P + R]``); with
            ``dialogs=True``, a :class:`~interop.tools.dialogs.DialogSampler` (its ``sample_ids``).
        tokenizer: the policy's tokenizer (its ``pad_token_id`` pads; its ``eos_token_id`` ends a completion).

    Keyword Args:
        model: the ``nn.Module`` that samples (its device, its ``max_position_embeddings``, its generation config's
            EOS ids; the first log-prob TorchRL's ``TransformersWrapper`` leaves at 0 is computed again with it).
        dialogs: whether ``policy`` samples whole tool dialogs (a ``DialogSampler``) rather than single completions.

    Attributes:
        last_dialogs: with ``dialogs=True``, the last call's :class:`~interop.tools.dialogs.Dialogs` (their messages
            show what the model saw); else ``None``.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModuleBase
        >>> class Echo(TensorDictModuleBase):  # "samples" the prompt's last token twice, log-prob -1 each
        ...     in_keys, out_keys = [("tokens", "prompt")], [("tokens", "response"), ("log_probs", "response")]
        ...     def forward(self, td):
        ...         td["tokens", "response"] = td["tokens", "prompt"][:, -1:].repeat(1, 2)
        ...         td["log_probs", "response"] = -torch.ones(td.shape[0], 2)
        ...         return td
        >>> class Tokenizer:
        ...     pad_token_id, eos_token_id = 0, 1
        >>> rollout = RolloutSampler(Echo(), Tokenizer(), model=torch.nn.Linear(1, 1)).sample([[5, 6], [7]])
        >>> rollout["prompt_ids"].tolist(), rollout["completion_ids"].tolist(), rollout["truncated"].tolist()
        ([[5, 6], [0, 7]], [[6, 6], [7, 7]], [True, True])
    """

    def __init__(self, policy, tokenizer, *, model: torch.nn.Module, dialogs: bool = False) -> None:
        self.policy, self.tokenizer, self.model, self.dialogs = policy, tokenizer, model, dialogs
        # TorchRL 0.14.1's TransformersWrapper writes 0 for the first response token's log-prob when generating.
        self.first_log_prob_missing = type(policy).__name__ == "TransformersWrapper" and bool(
            getattr(policy, "generate", False)
        )
        self.last_dialogs = None

    def _max_new_tokens(self) -> int | None:
        """The most tokens the policy writes after a prompt (``None``: it does not say)."""
        if hasattr(self.policy, "max_completion_tokens"):  # a DialogSampler: the whole dialog's budget
            return self.policy.max_completion_tokens
        settings = getattr(self.policy, "settings", None)
        if isinstance(settings, SamplingSettings):
            return settings.max_new_tokens
        return (getattr(self.policy, "generate_kwargs", None) or {}).get("max_new_tokens")

    def _check_context(self, prompt_ids: list[list[int]]) -> None:
        """Refuses prompts the model cannot read whole with the completion after them (past its
        ``max_position_embeddings``, a model reads positions it has no embedding for), as the recipes refuse them."""
        positions = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if not isinstance(positions, int):
            return
        new_tokens = self._max_new_tokens()
        if new_tokens is not None and new_tokens >= positions:
            raise ValueError(
                f"TorchRLRolloutFunc: completions of up to {new_tokens} tokens (GRPOConfig.max_completion_length, or "
                f"the policy's max_new_tokens) leave no room for a prompt in the model's {positions} positions "
                f"(max_position_embeddings). Lower max_completion_length below {positions} minus the longest prompt."
            )
        lengths = torch.tensor([len(row) for row in prompt_ids])
        rows = (lengths + (new_tokens or 0) > positions).nonzero().flatten().tolist()
        if rows:
            raise ValueError(
                f"TorchRLRolloutFunc: {len(rows)} of {len(prompt_ids)} prompts (rows {rows[:10]}) take up to "
                f"{int(lengths.max())} tokens; with completions of up to {new_tokens or 0} tokens "
                "(GRPOConfig.max_completion_length) they pass the model's "
                f"{positions} positions (max_position_embeddings). Shorten or drop those prompts, or lower "
                "max_completion_length."
            )

    @torch.inference_mode()  # nothing sampled here is differentiated; cheaper than no_grad per decoding step
    def sample(self, prompt_ids: list[list[int]]) -> TensorDict:
        """One completion per prompt (token ids, unpadded); returns a ``[B]`` TensorDict, one row per completion:

        - ``prompt_ids`` ``[B, P]`` (left-padded with the pad id) and ``prompt_length`` ``[B]``;
        - ``completion_ids`` ``[B, R]`` (right-padded) and ``completion_length`` ``[B]`` (EOS included);
        - ``logprobs`` ``[B, R]``: each sampled token's log-prob under the sampling weights, 0 on padding;
        - ``truncated`` ``[B]``: the completion has no EOS;
        - dialogs only: ``env_mask`` ``[B, R]`` and the :data:`TOOL_COUNTS` ``[B]`` (:meth:`_dialog_rollout`).
        """
        self._check_context(prompt_ids)
        if self.dialogs:
            return self._dialog_rollout(prompt_ids)
        device = self._device()
        rows = [torch.tensor(row, dtype=torch.long) for row in prompt_ids]
        pad = self.tokenizer.pad_token_id
        tokens = pad_sequence(rows, batch_first=True, padding_value=pad, padding_side="left").to(device)
        mask = pad_sequence(
            [torch.ones_like(row, dtype=torch.bool) for row in rows],
            batch_first=True,
            padding_value=False,
            padding_side="left",
        ).to(device)
        inputs = TensorDict({PROMPT_TOKENS: tokens, PROMPT_MASK: mask}, batch_size=[len(rows)], device=device)
        output = self.policy(inputs)
        response, response_mask, log_probs = self._read_response(output, tokens, mask)
        lengths = response_mask.sum(-1)
        log_probs = torch.where(response_mask, log_probs.float(), 0.0)
        response = torch.where(response_mask, response, pad)
        bad = ~torch.isfinite(log_probs).all(-1)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(
                f"TorchRLRolloutFunc: the policy returned non-finite log-probs for {len(rows)} completion(s) (rows "
                f"{rows[:10]}); trl would train on NaN ratios. Check the model's weights and dtype (float16 overflows "
                "on CPU), and the policy's sampling settings."
            )
        eos = set(self._eos_ids())
        last = response.gather(-1, (lengths - 1).clamp_min(0)[:, None]).squeeze(-1)
        truncated = torch.tensor([int(token) not in eos for token in last.tolist()], device=device) | (lengths == 0)
        return TensorDict(
            {
                "prompt_ids": tokens,
                "prompt_length": mask.sum(-1),
                "completion_ids": response,
                "completion_length": lengths,
                "logprobs": log_probs,
                "truncated": truncated,
            },
            batch_size=[len(rows)],
        ).cpu()

    def _dialog_rollout(self, prompt_ids: list[list[int]]) -> TensorDict:
        """:meth:`sample` for tools: one dialog per prompt (:class:`interop.tools.dialogs.DialogSampler`), laid out as
        :meth:`sample` lays out completions, plus ``env_mask`` ``[B, R]`` (1 on the model's tokens, 0 on the tool
        messages' and on padding) and the :data:`TOOL_COUNTS` ``[B]``."""
        dialogs = self.policy.sample_ids(prompt_ids)
        self.last_dialogs = dialogs
        pad = self.tokenizer.pad_token_id

        def padded(rows, value, side, dtype):
            tensors = [torch.tensor(row, dtype=dtype) for row in rows]
            return pad_sequence(tensors, batch_first=True, padding_value=value, padding_side=side)

        stats = dialogs.stats
        return TensorDict(
            {
                "prompt_ids": padded(dialogs.prompt_ids, pad, "left", torch.long),
                "prompt_length": torch.tensor([len(row) for row in dialogs.prompt_ids]),
                "completion_ids": padded(dialogs.completion_ids, pad, "right", torch.long),
                "completion_length": torch.tensor([len(row) for row in dialogs.completion_ids]),
                "logprobs": padded(dialogs.log_probs, 0.0, "right", torch.float32),
                "env_mask": padded(dialogs.model_mask, 0, "right", torch.long),
                "truncated": torch.tensor(dialogs.truncated),
                "tool_calls": torch.tensor([row.tools.calls for row in stats]),
                "tool_errors": torch.tensor([row.tools.failures for row in stats]),
                "turns": torch.tensor([row.turns for row in stats]),
            },
            batch_size=[len(dialogs)],
        )

    def _device(self) -> torch.device:
        parameter = next(self.model.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def _eos_ids(self) -> list[int]:
        ids = [getattr(self.tokenizer, "eos_token_id", None)]
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids += configured if isinstance(configured, (list, tuple)) else [configured]
        return [int(i) for i in ids if i is not None]

    def _get_padded(self, output: TensorDictBase, key: tuple, value) -> torch.Tensor:
        # Ragged outputs (TransformersWrapper(pad_output=False), a lazy stack at the top or under a key) are padded
        # on read; a dense tensor is returned as it is.
        return output.get(key, as_padded_tensor=True, padding_side="right", padding_value=value)

    def _read_response(self, output: TensorDictBase, prompt: torch.Tensor, prompt_mask: torch.Tensor):
        keys = set(output.keys(include_nested=True, leaves_only=True))
        if RESPONSE_TOKENS not in keys:
            raise ValueError(
                f"TorchRLRolloutFunc: the policy's output has no {RESPONSE_TOKENS} (it wrote {sorted(map(str, keys))})."
            )
        pad = self.tokenizer.pad_token_id
        response = self._get_padded(output, RESPONSE_TOKENS, pad)
        width, response_width = prompt.shape[-1], response.shape[-1]
        response_log_probs = self._get_padded(output, RESPONSE_LOG_PROBS, 0.0) if RESPONSE_LOG_PROBS in keys else None
        full_log_probs = self._get_padded(output, FULL_LOG_PROBS, 0.0) if FULL_LOG_PROBS in keys else None
        if response_log_probs is not None:
            log_probs = response_log_probs
        elif full_log_probs is not None:
            log_probs = full_log_probs[:, width : width + response_width]
        else:
            raise ValueError(
                f"TorchRLRolloutFunc: the policy's output has neither {RESPONSE_LOG_PROBS} nor {FULL_LOG_PROBS} (it "
                f"wrote {sorted(map(str, keys))}); trl needs the sampling log-probs (TransformersWrapper: "
                "return_log_probs=True)."
            )
        if ATTENTION_MASK in keys and not _is_ragged(output, ATTENTION_MASK):
            attention = output.get(ATTENTION_MASK)
            response_mask = attention[:, width : width + response_width].bool()
        else:
            response_mask = self._response_mask(response, pad)
        if self.first_log_prob_missing and response_width:
            log_probs = log_probs.clone()
            log_probs[:, 0] = self._first_token_log_probs(prompt, prompt_mask, response[:, 0])
        return response, response_mask, log_probs

    def _response_mask(self, response: torch.Tensor, pad: int) -> torch.Tensor:
        """True up to and including each row's first EOS (without one: its last token that is not the pad id). A
        pad id the policy sampled inside a response is one of its tokens: ``response != pad`` would cut the response
        there and lose its EOS."""
        columns = torch.arange(response.shape[-1], device=response.device)
        eos = torch.isin(response, torch.tensor(self._eos_ids(), device=response.device, dtype=response.dtype))
        first_eos = torch.where(eos, columns, response.shape[-1]).min(-1).values
        last_real = torch.where(response != pad, columns, -1).max(-1).values
        ends = torch.where(eos.any(-1), first_eos, last_real)
        return columns <= ends[:, None]

    def _first_token_log_probs(self, prompt, prompt_mask, first) -> torch.Tensor:
        """The first response token's log-prob under the model: one forward pass over the prompts."""
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = self.model(input_ids=prompt, attention_mask=prompt_mask.long(), position_ids=positions).logits
        last = logits[:, -1].float().log_softmax(-1)
        return last.gather(-1, first[:, None]).squeeze(-1)


def _is_ragged(output: TensorDictBase, key: tuple) -> bool:
    """Whether ``output``'s ``key`` holds rows of different lengths (a lazy stack: no dense ``[B, T]`` tensor of it)."""
    if isinstance(output, LazyStackedTensorDict):
        return True
    try:
        output.get(key)
    except RuntimeError:  # tensordict cannot stack rows of different lengths
        return True
    return False
