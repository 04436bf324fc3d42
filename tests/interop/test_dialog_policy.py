"""interop.tools.dialog_policy.DialogPolicy: multi-turn dialogs with tools in CausalLMSampler's dense TensorDict layout.

One turn without a call is exactly CausalLMSampler's output on the same seed; over several turns every sampled
token's recorded log-prob is a forward pass's over the whole dialog, the tool messages' tokens sit in the response
with a log-prob of 0 and out of the assistant mask, and the counts match the dialogs.

The multi-turn tests give the shipped tiny policy (which knows no tools) a call format it writes all the time: a
"call" opens at "the" and closes at " and", so nearly every turn holds a malformed call, answered with an error
message, and the dialog goes on: real sampled turns around real tool messages."""

from __future__ import annotations

import pytest
import torch
from _tool_functions import multiply
from tensordict import TensorDict

from interop.sampling import (
    ATTENTION_MASK,
    LOG_PROBS,
    PROMPT_MASK,
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    TOKENS,
    TRUNCATED,
    CausalLMSampler,
    SamplingSettings,
)
from interop.tools import ToolCallFormat, ToolRunner
from interop.tools.dialog_policy import (
    ASSISTANT_MASK,
    DIALOG_TOOL_CALLS,
    DIALOG_TOOL_ERRORS,
    DIALOG_TURNS,
    DialogPolicy,
)

PROMPTS = ["Review the mug.", "What do you think of the lamp?", "Write a review of the bag."]


def _prompt_batch(tokenizer, prompts=PROMPTS, group: int = 2) -> TensorDict:
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in prompts
        for _ in range(group)
    ]
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = True
    return TensorDict({PROMPT_TOKENS: tokens, PROMPT_MASK: mask}, batch_size=[len(rows)])


@pytest.fixture
def runner(tiny_policy):
    _, tokenizer = tiny_policy
    with ToolRunner([multiply], timeout_s=5.0, max_result_tokens=32, tokenizer=tokenizer) as runner:
        yield runner


def test_one_turn_without_calls_is_causal_lm_sampler(tiny_policy, runner):
    """max_turns=1 and no call: the same tokens, masks, log-probs and truncation as CausalLMSampler on one seed."""
    model, tokenizer = tiny_policy
    settings = SamplingSettings(max_new_tokens=12, top_k=50)
    prompts = _prompt_batch(tokenizer)
    dialog = DialogPolicy(model, tokenizer, runner, settings=settings, max_turns=1, max_completion_tokens=12)
    torch.manual_seed(3)
    ours = dialog(prompts.clone())
    torch.manual_seed(3)
    theirs = CausalLMSampler(model, tokenizer, settings=settings)(prompts.clone())
    for key in (RESPONSE_TOKENS, TOKENS, ATTENTION_MASK, LOG_PROBS, TRUNCATED):
        assert torch.equal(ours.get(key), theirs.get(key)), key
    start = prompts.get(PROMPT_TOKENS).shape[-1]
    assert torch.equal(ours.get(ASSISTANT_MASK)[:, start:], ours.get(ATTENTION_MASK)[:, start:])
    assert not ours.get(ASSISTANT_MASK)[:, :start].any()
    assert ours.get(DIALOG_TURNS).tolist() == [1] * len(prompts)
    assert ours.get(DIALOG_TOOL_CALLS).sum() == 0


def test_num_threads_holds_while_the_dialogs_are_sampled(tiny_policy, runner):
    """``num_threads=1`` in a 2-thread process: the model runs on 1 thread, and the process is back at 2 after."""
    from _thread_counts import threads_seen_by

    model, tokenizer = tiny_policy
    settings = SamplingSettings(max_new_tokens=4, top_k=50)
    policy = DialogPolicy(model, tokenizer, runner, settings=settings, max_turns=1, num_threads=1)
    with threads_seen_by(model, process_threads=2) as seen:
        policy(_prompt_batch(tokenizer))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2


@pytest.fixture
def dialogs(tiny_policy, runner):
    """A batch of sampled multi-turn dialogs (the tiny policy's malformed "calls", answered with errors)."""
    model, tokenizer = tiny_policy
    policy = DialogPolicy(
        model,
        tokenizer,
        runner,
        settings=SamplingSettings(max_new_tokens=16, top_k=50),
        max_turns=3,
        max_completion_tokens=64,
        call_format=ToolCallFormat(open="the", close=" and"),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        out = policy(_prompt_batch(tokenizer))
    return policy, out


def test_multi_turn_layout_and_counts(dialogs, tiny_policy):
    _, tokenizer = tiny_policy
    policy, out = dialogs
    start = out.get(PROMPT_TOKENS).shape[-1]
    response, attention = out.get(RESPONSE_TOKENS), out.get(ATTENTION_MASK)[:, start:]
    mine, log_probs = out.get(ASSISTANT_MASK)[:, start:], out.get(LOG_PROBS)[:, start:]
    assert torch.equal(out.get(TOKENS), torch.cat([out.get(PROMPT_TOKENS), response], -1))
    # Right-padded: each row's completion is one run of True, then pads.
    lengths = attention.sum(-1)
    assert torch.equal(attention, torch.arange(response.shape[-1]) < lengths[:, None])
    assert (response[~attention] == tokenizer.pad_token_id).all()
    turns, calls, errors = (out.get(key) for key in (DIALOG_TURNS, DIALOG_TOOL_CALLS, DIALOG_TOOL_ERRORS))
    assert (turns > 1).any(), "no dialog went past its first turn: the test exercises nothing"
    assert torch.equal(errors, calls)  # every "call" of the tiny policy is malformed
    assert (turns <= 3).all() and (calls >= turns - 1).all()
    # The tool messages: inside the completion, out of the assistant mask, log-prob 0; the policy's tokens in it.
    tool_tokens = attention & ~mine
    assert tool_tokens.any()
    assert (log_probs[tool_tokens] == 0).all() and (log_probs[mine] < 0).all()
    assert not (mine & ~attention).any()
    # What the tool message says: the parse error, as the policy read it.
    row = int(tool_tokens.any(-1).nonzero()[0])
    tool_text = tokenizer.decode(response[row][tool_tokens[row]])
    assert "tool" in tool_text and "error" in tool_text
    stats = policy.last_dialogs.stats
    assert turns.tolist() == [s.turns for s in stats] and calls.tolist() == [s.tools.calls for s in stats]


def test_recorded_log_probs_are_a_forward_pass_over_the_whole_dialog(dialogs, tiny_policy):
    """Every sampled token's log-prob, in every turn, equals the model's log-softmax at that position when the whole
    dialog (prompt, turns, tool messages) runs through it once."""
    model, _ = tiny_policy
    _, out = dialogs
    tokens, mask = out.get(TOKENS), out.get(ATTENTION_MASK).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits.float()
    scored = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    mine = out.get(ASSISTANT_MASK)[:, 1:]
    recorded = out.get(LOG_PROBS)[:, 1:]
    torch.testing.assert_close(recorded[mine], scored[mine], atol=2e-4, rtol=1e-4)
    # Policy tokens of a later turn are among them (the check is not only the first turn's).
    start = out.get(PROMPT_TOKENS).shape[-1]
    own = out.get(ASSISTANT_MASK)[:, start:].long()
    later_turn = (own[:, 1:] > own[:, :-1]).any(-1)  # a run of the policy's tokens starts after a tool message
    assert later_turn.any()
