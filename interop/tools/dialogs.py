"""Multi-turn sampling with tools: the model writes, its tool calls run, their results join the dialog, it writes on.

Public names:

- :class:`DialogSampler`: samples one dialog per prompt of a batch, up to ``max_turns`` assistant turns. Each turn is
  :func:`interop.sampling.sample_responses` over the rows still talking (a turn ends at EOS, or at the closing
  tool-call marker); the turn's calls run in a :class:`interop.tools.ToolRunner`; each result becomes a ``tool``
  message whose tokens are those the chat template adds between the assistant's turn and the next one, found as
  trl's ``GRPOTrainer._get_tool_suffix_ids`` finds them (by rendering a dialog with and without the tool messages).
  The model's tokens are never decoded and re-encoded, so the sampled tokens plus these suffixes are the template's
  render of the whole dialog wherever the model wrote its calls as the template writes them.
- :class:`Dialogs`: the batch sampled, per row: the completion's token ids (every turn's and every tool message's, in
  order), ``model_mask`` (1 on the model's tokens, 0 on the tool messages': trl's ``env_mask``), the sampled tokens'
  log-probs (0 on tool tokens), the completion as messages (trl's tool-calling form) and :class:`DialogStats`.
  :meth:`Dialogs.as_rollout_output` gives trl's ``rollout_func`` keys.

Each row keeps its KV cache from one turn to the next (:func:`interop.sampling.sample_responses` with
``keep_cache`` and ``past``): a turn runs only the tokens the row gained since the last one, its last sampled token
(never fed to the model) and the tool message, then decodes on. The logits are a forward pass's over the whole dialog
up to float rounding, and the rows draw with the same random numbers either way, so the dialogs are those of a
prefill of the whole dialog per turn (``keep_cache_across_turns=False``, and what runs under FSDP2 or with a cache
that is not a ``DynamicCache`` of full-attention layers). On tiny/calculator_policy the two ways ran at the same speed,
2,722 vs 2,706 generated tokens/s (1.01x; a second run 1.02x), medians of 15 rounds of 64 dialogs
(``scripts/bench_dialog_cache.py``, 2026-12-05, 2 shared cores): what it saves, a forward pass over the dialog so far
at each later turn, is small there (2 layers, dialogs of 60-100 tokens, most ending after one turn).

Dependencies: torch; the ``transformers`` model and tokenizer the caller passes (the tokenizer's chat template renders
the tools and tool messages); :mod:`interop.tools`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from interop.errors import SettingError
from interop.sampling.sampler import KeptCache, SamplingSettings, check_pad_token, end_of_response_ids, sample_responses
from interop.tools.runner import ParsedTurn, ToolCallFormat, ToolRunner, ToolStats

__all__ = ["DialogSampler", "DialogStats", "Dialogs", "ENDINGS"]

# How a dialog ended: the model answered (a turn ended at EOS without a tool call); its last allowed turn called a
# tool (not run); a turn reached its token limit; a tool result would not fit the completion budget or the model's
# positions (the result is left out, as trl leaves it out).
ENDINGS = ("answer", "max_turns", "length", "budget")
_DUMMY_USER = {"role": "user", "content": "dummy"}  # trl's, in _get_tool_suffix_ids


@dataclass
class DialogStats:
    """One dialog's counts: assistant ``turns``, its tool calls (:class:`interop.tools.ToolStats`), and how it
    ``ended`` (one of :data:`ENDINGS`)."""

    turns: int = 0
    tools: ToolStats = field(default_factory=ToolStats)
    ended: str = ""


@dataclass
class Dialogs:
    """A batch of sampled dialogs, each field one entry per row (lists of plain ints and floats, trl's form).

    Fields:
        prompt_ids: the prompt tokens (the chat template's render with the tools and the generation prompt).
        completion_ids: the model's tokens of every turn and the tool messages' tokens, in order.
        model_mask: 1 on the model's tokens, 0 on the tool messages' (what trl's ``env_mask`` holds).
        log_probs: each model token's log-prob when sampled, 0.0 on tool tokens.
        messages: the completion as messages: assistant turns (with ``tool_calls`` where the model wrote them as
            the template does, else the text as it was written) and ``tool`` messages.
        stats: :class:`DialogStats` per row.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    model_mask: list[list[int]]
    log_probs: list[list[float]]
    messages: list[list[dict]]
    stats: list[DialogStats]

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def truncated(self) -> list[bool]:
        """Rows whose dialog was cut: a turn reached its token limit, or a tool result did not fit."""
        return [stats.ended in ("length", "budget") for stats in self.stats]

    @property
    def tool_stats(self) -> ToolStats:
        """The batch's tool counts."""
        return sum((stats.tools for stats in self.stats), ToolStats())

    def metrics(self) -> dict[str, float]:
        """Batch metrics: trl's ``tools/call_frequency`` (calls per dialog) and ``tools/failure_frequency`` (failed
        calls per call), the counts of :meth:`interop.tools.ToolStats.as_metrics`, ``dialogs/turns_mean`` and the
        share of dialogs by ending (``dialogs/ended/<ending>``)."""
        tools, rows = self.tool_stats, max(len(self), 1)
        metrics = {
            "tools/call_frequency": tools.calls / rows,
            "tools/failure_frequency": tools.failures / tools.calls if tools.calls else 0.0,
            **tools.as_metrics("tools/"),
            "dialogs/turns_mean": sum(stats.turns for stats in self.stats) / rows,
        }
        for ending in ENDINGS:
            metrics[f"dialogs/ended/{ending}"] = sum(stats.ended == ending for stats in self.stats) / rows
        return metrics

    def as_rollout_output(self) -> dict[str, list]:
        """What trl's ``GRPOTrainer(rollout_func=...)`` takes: ``prompt_ids``, ``completion_ids``, ``logprobs`` and
        ``env_mask`` (tool tokens out of the loss)."""
        return {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logprobs": self.log_probs,
            "env_mask": self.model_mask,
        }


@dataclass
class _Turn:
    """One row's sampled turn: its tokens and log-probs, and how it ended: ``eos``, ``call_end`` (the closing
    tool-call marker) or ``length``."""

    tokens: list[int]
    log_probs: list[float]
    end: str


class DialogSampler:
    """Samples dialogs in which the model may call tools, one per prompt, up to ``max_turns`` assistant turns.

    A turn ends at EOS or, with ``stop_at_call_end``, at the closing tool-call marker (then the template's end of
    the assistant turn, e.g. Qwen's ``<|im_end|>``, is part of the tool message's tokens: written by the loop, not
    sampled). A turn that calls tools is followed by their results, as ``tool`` messages, and another turn; a turn
    without a call ends the dialog, as does a call in the last allowed turn (not run: trl's
    ``max_tool_calling_iterations`` is ``max_turns - 1``). A malformed call is answered with an error, and the dialog
    goes on.

    Args:
        model: a ``transformers`` causal LM (with a KV cache).
        tokenizer: its tokenizer, whose chat template renders tools, tool calls and ``tool`` messages (Qwen2.5's
            does), with a pad token distinct from EOS.
        runner: the :class:`interop.tools.ToolRunner` that answers the calls (its tools are rendered in the prompts).

    Keyword Args:
        settings: how each turn is sampled; ``max_new_tokens`` bounds one turn.
        max_turns: assistant turns per dialog, at most.
        max_completion_tokens: the completion's budget over all turns and tool messages (trl's
            ``max_completion_length``); ``None``: none beyond the model's ``max_position_embeddings``.
        call_format: how calls are read from a turn: :class:`interop.tools.ToolCallFormat` (Qwen2.5's markers, the
            default) or any object with ``parse(text) -> ParsedTurn`` and ``close`` (the closing marker, or None:
            TorchRL's formats, :mod:`interop.tools.torchrl_tools`).
        stop_at_call_end: end a turn at the closing marker, which must then be one token; ``False``: turns end at
            EOS only, as in trl (several calls in one turn then run in order).
        eos_token_ids: ids that end a turn; ``None``: the tokenizer's EOS and the model's generation config's.
        log_probs_at_temperature: record log-probs under ``logits / temperature``, as trl scores them.
        chat_template_kwargs: extra arguments to ``apply_chat_template`` (trl's ``chat_template_kwargs``).
        keep_cache_across_turns: keep each row's KV cache from one turn to the next, so that a turn runs only the
            tokens its row gained since the last (the turn's last sampled token and the tool messages' tokens);
            ``False``: every turn runs the whole dialog so far. Either way a row draws from the same distribution
            with the same random numbers (the logits agree up to float rounding). Where the cache cannot be kept
            (a model sharded with FSDP2, a cache that is not a ``DynamicCache`` of full-attention layers: see
            :func:`interop.sampling.sample_responses`) every turn runs the whole dialog.

    Examples:
        Sampling a batch of prompts with the calculator task's policy and tool (``scripts/build_tiny_models.py
        --task calculator``)::

            >>> runner = ToolRunner([multiply], max_result_tokens=64, tokenizer=tokenizer)  # doctest: +SKIP
            >>> settings = SamplingSettings(max_new_tokens=48)  # doctest: +SKIP
            >>> sampler = DialogSampler(model, tokenizer, runner, settings=settings, max_turns=3)  # doctest: +SKIP
            >>> dialogs = sampler.sample_prompts(["What is 23 * 417?"])  # doctest: +SKIP
            >>> [message["role"] for message in dialogs.messages[0]]  # doctest: +SKIP
            ['assistant', 'tool', 'assistant']
    """

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
        stop_at_call_end: bool = True,
        eos_token_ids: Sequence[int] | None = None,
        log_probs_at_temperature: bool = False,
        chat_template_kwargs: dict | None = None,
        keep_cache_across_turns: bool = True,
    ) -> None:
        check_pad_token(tokenizer, owner="DialogSampler: the tokenizer")
        if not isinstance(settings, SamplingSettings):
            raise TypeError(f"DialogSampler: settings must be a SamplingSettings, got {type(settings).__name__}.")
        if max_turns < 1:
            raise SettingError(
                "DialogSampler",
                f"max_turns={max_turns} must be >= 1 (1: no tool result is ever read).",
                field="max_turns",
            )
        if max_completion_tokens is not None and max_completion_tokens < 1:
            raise SettingError(
                "DialogSampler",
                f"max_completion_tokens={max_completion_tokens} must be >= 1, or None.",
                field="max_completion_tokens",
            )
        self.model, self.tokenizer, self.runner = model, tokenizer, runner
        self.settings, self.max_turns, self.max_completion_tokens = settings, max_turns, max_completion_tokens
        self.call_format = call_format or ToolCallFormat()
        self.log_probs_at_temperature = log_probs_at_temperature
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eos_token_ids = (
            sorted(set(eos_token_ids)) if eos_token_ids is not None else end_of_response_ids(model, tokenizer)
        )
        self.max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.call_end_id = self._call_end_id() if stop_at_call_end else None
        self._stop_ids = self.eos_token_ids + ([self.call_end_id] if self.call_end_id is not None else [])
        self._render_cache: dict = {}
        self.keep_cache_across_turns = keep_cache_across_turns
        # During sample_ids: the rows of the last turn and their kept KV caches (None: not kept). Per call, so one
        # sampler samples one batch at a time (as its model does).
        self._last_turn: tuple[list[int], KeptCache | None] | None = None
        # Fails here, not mid-run, when the template cannot render a tool turn the way the loop needs.
        self.tool_suffix_ids([{"role": "tool", "name": runner.tools.names[0], "content": "0"}], after_call_end=True)

    def _call_end_id(self) -> int:
        if self.call_format.close is None:
            raise SettingError(
                "DialogSampler",
                f"stop_at_call_end needs a closing marker; {self.call_format!r} has none. Pass "
                "stop_at_call_end=False to end turns at EOS only.",
                field="stop_at_call_end",
            )
        ids = self.tokenizer.encode(self.call_format.close, add_special_tokens=False)
        if len(ids) != 1:
            raise SettingError(
                "DialogSampler",
                f"stop_at_call_end needs the closing marker {self.call_format.close!r} to be one token "
                f"of the tokenizer; it is {len(ids)} ({ids}). Add it as a token "
                f"(tokenizer.add_tokens([{self.call_format.close!r}]) and resize the model's embeddings), or pass "
                "stop_at_call_end=False to end turns at EOS only.",
                field="stop_at_call_end",
            )
        return ids[0]

    # --- rendering -----------------------------------------------------------------------------------------------

    def _render(self, messages: list[dict], *, add_generation_prompt: bool, tokenize: bool, tools=None):
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
            **self.chat_template_kwargs,
        )

    def render_prompts(self, prompts: Sequence) -> list[list[int]]:
        """Each prompt (a text, taken as one user message, or a message list) rendered with the runner's tools and
        the generation prompt, as trl renders prompts for a tool-calling run."""
        rendered = []
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            rendered.append(
                list(self._render(messages, add_generation_prompt=True, tokenize=True, tools=self.runner.tools.schemas))
            )
        return rendered

    def tool_suffix_ids(self, tool_messages: list[dict], *, after_call_end: bool) -> list[int]:
        """The tokens the chat template puts between an assistant turn that called tools and the next assistant
        turn: the ``tool_messages`` and the generation prompt, found as trl's ``_get_tool_suffix_ids`` does (a dummy
        dialog rendered with and without them, the shorter cut after its last EOS). ``after_call_end``: the turn
        stopped at the closing marker, so the template's end of the assistant turn (the tokens after the marker, up
        to that EOS) comes first.

        Raises:
            ValueError: the template renders earlier messages differently once tool messages follow (not
                prefix-preserving), or renders no closing marker token in a tool-calling turn.
        """
        name = tool_messages[0]["name"]
        calls = [{"type": "function", "function": {"name": name, "arguments": {}}}]
        dummy: list[dict] = [_DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": calls}]
        key = ("tool_turn", name)
        if key not in self._render_cache:
            self._render_cache[key] = list(self._render(dummy, add_generation_prompt=False, tokenize=True))
        prefix = self._render_cache[key]
        full = list(self._render(dummy + list(tool_messages), add_generation_prompt=True, tokenize=True))
        ends = [i for i, token in enumerate(prefix) if token == self.tokenizer.eos_token_id]
        cut = ends[-1] + 1 if ends else len(prefix)
        if full[:cut] != prefix[:cut]:
            raise SettingError(
                "DialogSampler",
                "the chat template renders an assistant turn differently once tool messages follow "
                "it (it is not prefix-preserving), so tool results cannot be appended token by token. Use a "
                "prefix-preserving template (trl.chat_template_utils.get_training_chat_template gives one for "
                "common models).",
            )
        suffix = full[cut:]
        if after_call_end and self.call_end_id is not None:
            marks = [i for i, token in enumerate(prefix[:cut]) if token == self.call_end_id]
            if not marks:
                raise SettingError(
                    "DialogSampler",
                    f"the chat template renders a tool-calling turn without the token of "
                    f"{self.call_format.close!r}; check call_format against the template, or pass "
                    "stop_at_call_end=False.",
                )
            suffix = prefix[marks[-1] + 1 : cut] + suffix
        return suffix

    def _assistant_message(self, text: str, written: str, parsed: ParsedTurn) -> dict:
        """The turn as a message: with ``tool_calls`` when the template renders that message as ``written`` (the
        turn's text as decoded, its EOS included), else the text as the model wrote it."""
        if parsed.calls and not any(call.malformed for call in parsed.calls):
            message = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [call.as_message_call() for call in parsed.calls],
            }
            key = ("head",)
            if key not in self._render_cache:
                self._render_cache[key] = self._render([_DUMMY_USER], add_generation_prompt=True, tokenize=False)
            head = self._render_cache[key]
            rendered = self._render([_DUMMY_USER, message], add_generation_prompt=False, tokenize=False)
            if rendered.startswith(head) and rendered[len(head) :].startswith(written):
                return message
        return {"role": "assistant", "content": text}

    # --- sampling ------------------------------------------------------------------------------------------------

    def sample_prompts(self, prompts: Sequence) -> Dialogs:
        """Dialogs for prompts given as texts or message lists (:meth:`render_prompts`)."""
        return self.sample_ids(self.render_prompts(prompts))

    def sample(self, prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor) -> Dialogs:
        """Dialogs for a left-padded ``[B, P]`` batch of rendered prompts (``prompt_mask`` 1 or True on tokens)."""
        mask = prompt_mask.bool()
        return self.sample_ids([row[keep].tolist() for row, keep in zip(prompt_tokens, mask)])

    def sample_ids(self, prompt_ids: Sequence[Sequence[int]]) -> Dialogs:
        """Dialogs for rendered prompts given as lists of token ids."""
        rows = len(prompt_ids)
        prompts = [list(ids) for ids in prompt_ids]
        dialogs = Dialogs(
            prompt_ids=prompts,
            completion_ids=[[] for _ in range(rows)],
            model_mask=[[] for _ in range(rows)],
            log_probs=[[] for _ in range(rows)],
            messages=[[] for _ in range(rows)],
            stats=[DialogStats() for _ in range(rows)],
        )
        active = []
        for row in range(rows):
            if self._room(row, dialogs) < 1:
                dialogs.stats[row].ended = "budget"
            else:
                active.append(row)
        try:
            for turn_index in range(self.max_turns):
                if not active:
                    break
                contexts = [prompts[row] + dialogs.completion_ids[row] for row in active]
                turns = self._sample_turn(contexts, dialogs, active)
                calling = []  # (row, message, calls, turn)
                for row, turn in zip(active, turns):
                    message, calls = self._record_turn(row, turn, dialogs)
                    if calls and turn_index == self.max_turns - 1:
                        dialogs.stats[row].ended = "max_turns"
                    elif calls:
                        calling.append((row, message, calls, turn))
                active = self._answer_calls(calling, dialogs)
        finally:
            self._last_turn = None  # the kept caches are the batch's: free them
        return dialogs

    def _room(self, row: int, dialogs: Dialogs, extra: int = 0) -> float:
        """How many more tokens row ``row``'s completion may take (``extra`` more already counted)."""
        used = len(dialogs.completion_ids[row]) + extra
        room = float("inf")
        if self.max_completion_tokens is not None:
            room = self.max_completion_tokens - used
        if self.max_positions is not None:
            room = min(room, self.max_positions - len(dialogs.prompt_ids[row]) - used)
        return room

    def _sample_turn(self, contexts: list[list[int]], dialogs: Dialogs, rows: list[int]) -> list[_Turn]:
        """One turn for each context (a row's prompt and completion so far), each cut to its row's room."""
        limits = [self._room(row, dialogs) for row in rows]
        width = max(len(context) for context in contexts)
        device = next(self.model.parameters()).device
        tokens = torch.full((len(contexts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.bool)
        for index, context in enumerate(contexts):
            tokens[index, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[index, width - len(context) :] = True
        longest = int(min(self.settings.max_new_tokens, max(limits)))
        settings = dataclasses.replace(
            self.settings, max_new_tokens=longest, min_new_tokens=min(self.settings.min_new_tokens, longest)
        )
        sampled = sample_responses(
            self.model,
            tokens.to(device),
            mask.to(device),
            settings=settings,
            eos_token_ids=self._stop_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            log_probs_at_temperature=self.log_probs_at_temperature,
            # The last allowed turn's caches would never be read: not kept (every active row has had as many turns).
            keep_cache=self.keep_cache_across_turns and dialogs.stats[rows[0]].turns < self.max_turns - 1,
            past=self._past_of(rows),
        )
        self._last_turn = (list(rows), getattr(sampled, "kept", None))
        lengths = sampled.mask.sum(-1).tolist()
        turns = []
        for index, (length, limit) in enumerate(zip(lengths, limits)):
            kept = int(min(length, limit))
            ids = sampled.tokens[index, :kept].tolist()
            log_probs = sampled.log_probs[index, :kept].float().tolist()
            if kept < length or ids[-1] not in self._stop_ids:
                end = "length"
            else:
                end = "call_end" if ids[-1] == self.call_end_id else "eos"
            turns.append(_Turn(ids, log_probs, end))
        return turns

    def _past_of(self, rows: list[int]) -> KeptCache | None:
        """The KV caches the last turn kept for ``rows`` (each a row of that turn: dialogs only ever drop out), or
        ``None`` when there was no last turn or it kept none."""
        if not self.keep_cache_across_turns or self._last_turn is None:
            return None
        last_rows, kept = self._last_turn
        if kept is None:
            return None
        index = {row: position for position, row in enumerate(last_rows)}
        return kept.select([index[row] for row in rows])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _record_turn(self, row: int, turn: _Turn, dialogs: Dialogs):
        """Appends the turn's tokens to the row; returns its message and its calls (empty when the dialog ends)."""
        dialogs.completion_ids[row] += turn.tokens
        dialogs.model_mask[row] += [1] * len(turn.tokens)
        dialogs.log_probs[row] += turn.log_probs
        stats = dialogs.stats[row]
        stats.turns += 1
        text = self._decode(turn.tokens[:-1] if turn.end == "eos" else turn.tokens)
        if turn.end == "length":
            dialogs.messages[row].append({"role": "assistant", "content": text})
            stats.ended = "length"
            return None, []
        parsed = self.call_format.parse(text)
        message = self._assistant_message(text, self._decode(turn.tokens), parsed)
        dialogs.messages[row].append(message)
        if not parsed.calls:
            stats.ended = "answer"
        return message, parsed.calls

    def _answer_calls(self, calling: list, dialogs: Dialogs) -> list[int]:
        """Runs the calls of every calling row, appends their tool messages; returns the rows that go on."""
        results = self.runner.run([call for _, _, calls, _ in calling for call in calls])
        going_on, start = [], 0
        for row, _message, calls, turn in calling:
            answers, start = results[start : start + len(calls)], start + len(calls)
            for result in answers:
                dialogs.stats[row].tools.record(result)
            tool_messages = [result.message for result in answers]
            suffix = self.tool_suffix_ids(tool_messages, after_call_end=turn.end == "call_end")
            if self._room(row, dialogs, extra=len(suffix)) < 1:
                dialogs.stats[row].ended = "budget"  # as trl: the results that do not fit are left out
                continue
            dialogs.messages[row] += tool_messages
            dialogs.completion_ids[row] += suffix
            dialogs.model_mask[row] += [0] * len(suffix)
            dialogs.log_probs[row] += [0.0] * len(suffix)
            going_on.append(row)
        return going_on
