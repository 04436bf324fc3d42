"""Multi-turn sampling with tools as a TorchRL policy: :class:`interop.tools.dialogs.DialogSampler` in
:class:`interop.sampling.CausalLMSampler`'s TensorDict layout.

Public names:

- :class:`DialogPolicy`: reads the prompt keys ``CausalLMSampler`` reads and writes the keys it writes, the response
  being the whole completion (every assistant turn's tokens and the tool messages' tokens between them), plus
  :data:`ASSISTANT_MASK` (trl's ``env_mask`` over the whole sequence: True on the tokens the policy sampled) and
  per-row counts (:data:`DIALOG_TURNS`, :data:`DIALOG_TOOL_CALLS`, :data:`DIALOG_TOOL_ERRORS`).
- The keys it adds (TorchRL's LLM layout: ``("masks", "all_assistant_mask")`` is the name TorchRL's wrappers give the
  mask of the assistant's tokens).

A learner that trains on its batches multiplies its loss mask by :data:`ASSISTANT_MASK`: the tool messages' tokens
were written by the tools, not sampled, and their log-probs (recorded as 0) are no policy's.

Dependencies: torch, tensordict; :mod:`interop.tools.dialogs` and :mod:`interop.tools` (the ``transformers`` model and
tokenizer the caller passes, whose chat template renders the tools and tool messages).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from interop.sampling.sampler import (
    ATTENTION_MASK,
    LOG_PROBS,
    POLICY_VERSION,
    PROMPT_MASK,
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    TOKENS,
    TRUNCATED,
    SamplingSettings,
    check_thread_count,
    intra_op_threads,
)
from interop.tools.dialogs import Dialogs, DialogSampler
from interop.tools.runner import ToolCallFormat, ToolRunner

__all__ = ["ASSISTANT_MASK", "DIALOG_TOOL_CALLS", "DIALOG_TOOL_ERRORS", "DIALOG_TURNS", "DialogPolicy"]

ASSISTANT_MASK = ("masks", "all_assistant_mask")  # [B, P + R] bool: the tokens the policy sampled (trl's env_mask)
DIALOG_TURNS = ("dialog", "turns")  # [B] long: assistant turns
DIALOG_TOOL_CALLS = ("dialog", "tool_calls")  # [B] long: tool calls answered (malformed ones included)
DIALOG_TOOL_ERRORS = ("dialog", "tool_errors")  # [B] long: calls answered with an error (raised, timeout, malformed...)


class DialogPolicy(TensorDictModuleBase):
    """A causal LM that may call tools, as a TorchRL policy: one multi-turn dialog per row of a batch of prompts.

    It reads the left-padded ``("tokens", "prompt")`` and ``("masks", "prompt")`` (rendered with the tools' schemas,
    as trl renders a tool-calling run's prompts: :meth:`interop.tools.dialogs.DialogSampler.render_prompts`) and writes
    :class:`interop.sampling.CausalLMSampler`'s keys in its dense layout, every row ``[pads | prompt | completion |
    pads]`` with every completion starting at column ``P``:

    - ``("tokens", "response")`` ``[B, R]``: the completion, right-padded with the pad id; ``("tokens", "full")``,
      ``("masks", "all_attention_mask")`` ``[B, P + R]``;
    - ``("log_probs", "full")`` ``[B, P + R]``: each sampled token's log-prob, 0 on the prompt, the tool messages'
      tokens and padding;
    - :data:`ASSISTANT_MASK` ``[B, P + R]``: True on the sampled tokens only (trl's ``env_mask``, over the whole row);
    - ``"policy_version"``, ``"truncated"`` ``[B]`` (a turn hit its token limit, or a tool result did not fit the
      completion budget), and the counts :data:`DIALOG_TURNS`, :data:`DIALOG_TOOL_CALLS`, :data:`DIALOG_TOOL_ERRORS`.

    Tensors only; the last batch's :class:`interop.tools.dialogs.Dialogs` (messages, stats by error kind) stays in
    :attr:`last_dialogs`.

    Args:
        model: a ``transformers`` causal LM.
        tokenizer: its tokenizer (a pad token distinct from EOS; a chat template that renders tools and tool
            messages, prefix-preserving).
        runner: the :class:`interop.tools.ToolRunner` that answers the calls (the caller closes it).

    Keyword Args:
        settings: the :class:`interop.sampling.SamplingSettings` of each turn (``max_new_tokens`` bounds one turn).
        max_turns: assistant turns per dialog, at most (trl's ``max_tool_calling_iterations + 1``).
        max_completion_tokens: the whole completion's budget, tool messages included (trl's
            ``max_completion_length``); ``None``: the model's positions only.
        call_format: the tool-call markers (Qwen2.5's ``<tool_call>`` by default).
        stop_at_call_end: end a turn at the closing marker; ``None``: when that marker is one token of the tokenizer
            and the chat template writes it in a tool-calling turn (else turns end at EOS only, as trl's do).
        eos_token_ids, log_probs_at_temperature, chat_template_kwargs: as
            :class:`interop.tools.dialogs.DialogSampler`'s.
        num_threads: torch's intra-op threads while it samples, as :class:`interop.sampling.CausalLMSampler`'s.

    Examples:
        With the calculator task's policy and tool (``scripts/build_tiny_models.py --task calculator``)::

            >>> runner = ToolRunner([multiply], max_result_tokens=64, tokenizer=tokenizer)  # doctest: +SKIP
            >>> policy = DialogPolicy(model, tokenizer, runner, settings=SamplingSettings(max_new_tokens=48),
            ...                       max_turns=3, max_completion_tokens=48)  # doctest: +SKIP
            >>> out = policy(env.reset())  # doctest: +SKIP
            >>> out["masks", "all_assistant_mask"].sum() <= out["masks", "all_attention_mask"].sum()  # doctest: +SKIP
            tensor(True)
    """

    OUT_KEYS = (
        RESPONSE_TOKENS,
        TOKENS,
        ATTENTION_MASK,
        LOG_PROBS,
        POLICY_VERSION,
        TRUNCATED,
        ASSISTANT_MASK,
        DIALOG_TURNS,
        DIALOG_TOOL_CALLS,
        DIALOG_TOOL_ERRORS,
    )

    def __init__(
        self,
        model,
        tokenizer,
        runner: ToolRunner,
        *,
        settings: SamplingSettings,
        max_turns: int,
        max_completion_tokens: int | None = None,
        call_format: ToolCallFormat | None = None,
        stop_at_call_end: bool | None = None,
        eos_token_ids: Sequence[int] | None = None,
        log_probs_at_temperature: bool = False,
        chat_template_kwargs: dict | None = None,
        num_threads: int | None = None,
    ) -> None:
        super().__init__()
        check_thread_count(num_threads, owner="DialogPolicy")
        call_format = call_format or ToolCallFormat()
        make_sampler = functools.partial(
            DialogSampler,
            model,
            tokenizer,
            runner,
            settings=settings,
            max_turns=max_turns,
            max_completion_tokens=max_completion_tokens,
            call_format=call_format,
            eos_token_ids=eos_token_ids,
            log_probs_at_temperature=log_probs_at_temperature,
            chat_template_kwargs=chat_template_kwargs,
        )
        if stop_at_call_end is None and call_format.close is None:  # a format without a marker: turns end at EOS
            stop_at_call_end = False
        if stop_at_call_end is None:
            # Stopping at the marker saves sampling past a call, where the tokenizer holds it as one token and the
            # template writes it in a tool-calling turn; anything else a turn ends at EOS (a template that cannot
            # carry tool dialogs at all is refused by the second attempt, with the reason).
            try:
                self.sampler = make_sampler(stop_at_call_end=True)
            except ValueError:
                self.sampler = make_sampler(stop_at_call_end=False)
        else:
            self.sampler = make_sampler(stop_at_call_end=stop_at_call_end)
        self.model = model
        self.tokenizer = tokenizer
        self.last_dialogs: Dialogs | None = None
        self.num_threads = num_threads
        # Bumped by whoever updates the weights; written into every batch, so that the batch says its age.
        self.register_buffer("version", torch.zeros((), dtype=torch.long))
        self.in_keys = [PROMPT_TOKENS, PROMPT_MASK]
        self.out_keys = list(self.OUT_KEYS)

    @property
    def runner(self) -> ToolRunner:
        return self.sampler.runner

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        prompt = tensordict.get(PROMPT_TOKENS)
        prompt_mask = tensordict.get(PROMPT_MASK).bool()
        with intra_op_threads(self.num_threads):
            dialogs = self.sampler.sample(prompt, prompt_mask)
        self.last_dialogs = dialogs
        batch, device = prompt.shape[0], prompt.device
        # At least one column, so that a batch whose dialogs all ended before a turn keeps the dense layout.
        width = max(1, max(len(ids) for ids in dialogs.completion_ids))
        response = torch.full((batch, width), self.tokenizer.pad_token_id, dtype=prompt.dtype)
        mask = torch.zeros(batch, width, dtype=torch.bool)
        mine = torch.zeros(batch, width, dtype=torch.bool)
        log_probs = torch.zeros(batch, width, dtype=torch.float32)
        for row in range(batch):
            length = len(dialogs.completion_ids[row])
            response[row, :length] = torch.tensor(dialogs.completion_ids[row], dtype=prompt.dtype)
            mask[row, :length] = True
            mine[row, :length] = torch.tensor(dialogs.model_mask[row], dtype=torch.bool)
            log_probs[row, :length] = torch.tensor(dialogs.log_probs[row], dtype=torch.float32)
        response, mask, mine, log_probs = (t.to(device) for t in (response, mask, mine, log_probs))
        none = torch.zeros_like(prompt_mask)
        tensordict.set(RESPONSE_TOKENS, response)
        tensordict.set(TOKENS, torch.cat([prompt, response], dim=-1))
        tensordict.set(ATTENTION_MASK, torch.cat([prompt_mask, mask], dim=-1))
        tensordict.set(LOG_PROBS, torch.cat([torch.zeros_like(prompt, dtype=torch.float32), log_probs], dim=-1))
        tensordict.set(ASSISTANT_MASK, torch.cat([none, mine], dim=-1))
        tensordict.set(POLICY_VERSION, self.version.expand(batch).clone())
        tensordict.set(TRUNCATED, torch.tensor(dialogs.truncated, dtype=torch.bool, device=device))
        counts = {
            DIALOG_TURNS: [stats.turns for stats in dialogs.stats],
            DIALOG_TOOL_CALLS: [stats.tools.calls for stats in dialogs.stats],
            DIALOG_TOOL_ERRORS: [stats.tools.failures for stats in dialogs.stats],
        }
        for key, values in counts.items():
            tensordict.set(key, torch.tensor(values, dtype=torch.long, device=device))
        return tensordict
