"""A tool-calling tiny policy built in-test, and turns injected into interop.tools.dialogs' sampling: for tests that
need dialogs with tool calls before (or without) a pretrained tool-using policy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from _tiny_models import build_tokenizer, qwen2_config

import interop.tools.dialogs
from interop.sampling import SampledResponses
from recipes.tasks import calculator

# Qwen2.5's tool-calling format (what tiny/calculator_policy's template renders) with a one-line tool preamble:
# prefix-preserving, and parsed by trl's qwen3 response template.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}{{- ' ' + f.name }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content or not message.tool_calls %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set c = tool_call.function if tool_call.function is defined else tool_call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + c.name + \'", "arguments": \' + (c.arguments | tojson)'
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tool_policy(folder, extra_corpus=()):
    """``(model, tokenizer)``: an untrained tiny Qwen2 whose tokenizer renders Qwen2.5's tool calls with
    :data:`TOOL_TEMPLATE` (``<tool_call>`` and ``</tool_call>`` one token each), both saved to ``folder``."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    corpus = [str(m["content"]) for c in calculator.make_sft_conversations(200, seed=0) for m in c]
    corpus += ["<tool_response>\n408\n</tool_response>", '{"error": "Tool"}', *extra_corpus]
    tokenizer = build_tokenizer(folder, corpus, 600, chat_template=TOOL_TEMPLATE)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(tokenizer, max_position_embeddings=512))
    model.save_pretrained(folder)
    return model, tokenizer


def inject_turns(monkeypatch, tokenizer, turn: Callable[[list[int]], str]) -> None:
    """interop.tools.dialogs' sampler writes ``turn(context ids)`` (its text; EOS appended) for each row instead of
    sampling, cut at the turn's token limit as sampling would be; each token's log-prob is -0.5."""

    def scripted(model, prompt_tokens, prompt_mask, *, settings, pad_token_id, **_):
        rows = [
            tokenizer.encode(turn(row[mask.bool()].tolist()) + tokenizer.eos_token, add_special_tokens=False)
            for row, mask in zip(prompt_tokens, prompt_mask, strict=True)
        ]
        rows = [row[: settings.max_new_tokens] for row in rows]
        width = max(len(row) for row in rows)
        tokens = torch.full((len(rows), width), pad_token_id)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for index, row in enumerate(rows):
            tokens[index, : len(row)], mask[index, : len(row)] = torch.tensor(row), True
        return SampledResponses(tokens, mask, torch.where(mask, -0.5, 0.0), torch.zeros(len(rows), dtype=torch.bool))

    monkeypatch.setattr(interop.tools.dialogs, "sample_responses", scripted)


def tool_call(name: str, arguments: str) -> str:
    """A tool call as Qwen2.5's template writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
