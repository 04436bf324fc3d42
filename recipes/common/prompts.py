"""A run's prompts, as both GRPO recipes read them.

- :class:`PromptTable`: the prompts as conversations (a system prompt added where set), each rendered with the
  policy's chat template on first use, with their data rows' other columns (what trl reward functions receive).
- :func:`make_prompt_stream`: the prompts and their columns in a TorchRL ``ReplayBuffer``, drawn without replacement,
  as the Hugging Face ``IterableDataset`` trl's trainers read (``interop.TorchRLBufferDataset``).
- :func:`non_tensor_rows`: one Python object per row (a string, a conversation) as a ``NonTensorStack``.
- :func:`check_prompts_fit_policy`: refuses prompts that, with the tokens to generate, pass the policy's positions
  (read from its config, before any weights load).

Dependencies: torch, tensordict, torchrl, the project's ``interop`` package, and the ``transformers`` tokenizer the
caller passes in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement

from interop import TorchRLBufferDataset
from recipes.common.config import ConfigError, first_items
from recipes.common.data import PromptRows

__all__ = ["PromptTable", "check_prompts_fit_policy", "make_prompt_stream", "non_tensor_rows"]


def non_tensor_rows(values: Sequence) -> NonTensorStack:
    """One Python object per row (a string, a conversation as a list of message dicts...), as a ``NonTensorStack``
    of shape ``[len(values)]``.

    Setting a list directly depends on tensordict's list-to-stack mode, and stacks lists of messages into a
    ``[B, n_messages]`` structure, which breaks as soon as two conversations differ in length.
    """
    return NonTensorStack(*[NonTensorData(value) for value in values])


class PromptTable:
    """The prompts of a run as conversations, each rendered with the policy's chat template on first use, and their
    rows' other columns.

    Args:
        prompts: prompt texts, or conversations as lists of ``{"role", "content"}`` messages; or a
            ``recipes.common.data.PromptRows``, which brings its columns.

    Keyword Args:
        tokenizer: the policy's tokenizer.
        system_prompt: optional system message put before every prompt that has none.
        tools: the JSON schemas of the run's tools (``interop.tools.ToolSet.schemas``), rendered by the chat template
            as trl renders a tool-calling run's prompts (``apply_chat_template(..., tools=...)``); ``None``: none.

    Attributes:
        prompts: the prompts as the data holds them (what trl hands a reward function: no system prompt added).
        conversations: the prompts as message lists, the system prompt added.
        columns: column name -> one value per prompt.
    """

    def __init__(
        self,
        prompts: Sequence | PromptRows,
        *,
        tokenizer,
        system_prompt: str | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        columns = prompts.columns if isinstance(prompts, PromptRows) else {}
        prompts = prompts.prompts if isinstance(prompts, PromptRows) else list(prompts)
        if len(prompts) == 0:
            raise ValueError("PromptTable: no prompts; check the data= config (e.g. data.path).")
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.prompts = prompts
        self.columns = dict(columns)
        self.conversations = [self._as_messages(prompt, system) for prompt in prompts]
        self._rendered: dict[int, tuple[str, torch.Tensor]] = {}

    @staticmethod
    def _as_messages(prompt, system: list[dict]) -> list[dict]:
        if isinstance(prompt, str):
            return [*system, {"role": "user", "content": prompt}]
        messages = [dict(message) for message in prompt]
        has_system = bool(messages) and messages[0].get("role") == "system"
        return messages if has_system else [*system, *messages]

    def __len__(self) -> int:
        return len(self.conversations)

    def rendered(self, index: int) -> tuple[str, torch.Tensor]:
        """The prompt's text with the chat template and generation prompt applied, and its token ids."""
        rendered = self._rendered.get(index)
        if rendered is None:
            text = self.tokenizer.apply_chat_template(
                self.conversations[index], tools=self.tools, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            rendered = self._rendered[index] = (text, torch.tensor(ids, dtype=torch.long))
        return rendered

    def rendered_lengths(self) -> list[int]:
        """Every prompt's length in tokens once rendered, in one batched tokenizer call (the renders are kept)."""
        missing = [index for index in range(len(self)) if index not in self._rendered]
        if missing:
            texts = self.tokenizer.apply_chat_template(
                [self.conversations[index] for index in missing],
                tools=self.tools,
                add_generation_prompt=True,
                tokenize=False,
            )
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            for index, text, row in zip(missing, texts, ids, strict=True):
                self._rendered[index] = (text, torch.tensor(row, dtype=torch.long))
        return [len(self._rendered[index][1]) for index in range(len(self))]


def make_prompt_stream(table: PromptTable, *, batch_size: int, seed: int):
    """The prompts and their columns in a TorchRL buffer, drawn without replacement (a new order every pass), as the
    Hugging Face ``IterableDataset`` trl reads."""
    columns = {"prompt": table.conversations, **table.columns}
    rows = TensorDict(
        {name: NonTensorStack(*[NonTensorData(value) for value in values]) for name, values in columns.items()},
        batch_size=[len(table)],
    )
    generator = torch.Generator().manual_seed(seed)
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(len(table)), sampler=SamplerWithoutReplacement(), generator=generator
    )
    buffer.extend(rows)
    return TorchRLBufferDataset(buffer, batch_size=batch_size, keys=list(columns), num_batches=None).as_hf_dataset()


def check_prompts_fit_policy(lengths, model_node, *, max_new_tokens: int, max_new_tokens_key: str) -> None:
    """Refuses prompts the policy cannot read whole with the tokens it will generate after them: a rendered prompt
    (``lengths``: each prompt's tokens, :meth:`PromptTable.rendered_lengths`) plus ``max_new_tokens`` past the
    model's ``max_position_embeddings``. Reads the model's config only (no weights); a model without that setting
    passes.

    Args:
        lengths: every prompt's length in tokens, rendered with the policy's chat template.
        model_node: the policy's ``model`` node (``name_or_path``, ``trust_remote_code``).

    Keyword Args:
        max_new_tokens: the most tokens a completion may take.
        max_new_tokens_key: the setting that says so, for the message.

    Raises:
        ConfigError: naming the rows, the longest prompt, the positions and the fixes.
    """
    from transformers import AutoConfig

    lengths = torch.as_tensor(lengths)
    config = AutoConfig.from_pretrained(str(model_node.name_or_path), trust_remote_code=model_node.trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        return
    rows = (lengths + max_new_tokens > positions).nonzero().flatten().tolist()
    if rows:
        raise ConfigError(
            f"{len(rows)} of {len(lengths)} prompts (rows {first_items(rows)}) are too long for the policy: "
            f"rendered with its chat template they take up to {int(lengths.max())} tokens, and with "
            f"{max_new_tokens_key}={max_new_tokens} the sequence passes the "
            f"{positions} positions of model.name_or_path={str(model_node.name_or_path)!r} "
            f"(max_position_embeddings). Shorten or drop those prompts, or lower {max_new_tokens_key}."
        )
