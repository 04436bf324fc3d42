"""interop.tools.dialogs: multi-turn sampling with tools. The token layout is the chat template's render of the dialog,
every model token's log-prob is a forward pass's over the whole dialog, tool tokens are masked out, every bad tool
call is answered and counted, and max_turns and the token budget bound every dialog.

Scripted tests write the model's turns by hand (a DialogSampler whose turns are given), to reach every failure;
sampled tests run tiny/calculator_policy with the real multiply tool."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from _tool_functions import boom, long_text, multiply, sleepy
from transformers import AutoModelForCausalLM, AutoTokenizer

from interop.sampling import SamplingSettings
from interop.tools import ToolRunner
from interop.tools.dialogs import Dialogs, DialogSampler, _Turn
from recipes.tasks import calculator


@pytest.fixture(scope="module")
def calculator_policy(tiny_dir):
    """``(model, tokenizer)``: tiny/calculator_policy, Qwen2.5's chat template, ``</tool_call>`` one token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "calculator_policy")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "calculator_policy").eval()
    return model, tokenizer


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class ScriptedDialogSampler(DialogSampler):
    """Writes turn ``k`` of row ``i`` as ``scripts[i][k]`` (the last one repeated) instead of sampling it: no model
    runs (nor bounds the dialog's positions)."""

    def __init__(self, tokenizer, runner, *, scripts: list[list[str]], **kwargs):
        no_model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=None), generation_config=None)
        super().__init__(no_model, tokenizer, runner, **kwargs)
        self.scripts = scripts

    def _sample_turn(self, contexts, dialogs, rows):
        turns = []
        for row in rows:
            script = self.scripts[row]
            text = script[min(dialogs.stats[row].turns, len(script) - 1)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            end = "call_end" if ids[-1] == self.call_end_id else "eos" if ids[-1] in self.eos_token_ids else "length"
            turns.append(_Turn(ids, [-0.5] * len(ids), end))
        return turns


def _render(tokenizer, sampler: DialogSampler, prompt: str, messages: list[dict], *, tokenize: bool):
    dialog = [{"role": "user", "content": prompt}, *messages]
    return tokenizer.apply_chat_template(
        dialog, tools=sampler.runner.tools.schemas, tokenize=tokenize, return_dict=False
    )


def _model_segments(dialogs: Dialogs, row: int) -> list[list[int]]:
    segments, current = [], []
    for token, mine in zip(dialogs.completion_ids[row], dialogs.model_mask[row]):
        if mine:
            current.append(token)
        elif current:
            segments, current = segments + [current], []
    return segments + ([current] if current else [])


def _assert_layout_is_the_templates(tokenizer, sampler, prompt, dialogs: Dialogs, row: int) -> bool:
    """The prompt and completion are the template's render of the dialog, up to what the template writes after the
    last token sampled (the line break after a final EOS, or the end of a turn that called a tool): as text always,
    and token for token when the model wrote each of its turns in the tokens the tokenizer would have chosen (a
    sampled model need not: the loop keeps its tokens as sampled). Returns whether tokens were compared."""
    ids = dialogs.prompt_ids[row] + dialogs.completion_ids[row]
    text = tokenizer.decode(ids)
    rendered_text = _render(tokenizer, sampler, prompt, dialogs.messages[row], tokenize=False)
    assert rendered_text.startswith(text) and rendered_text[len(text) :] in ("", "\n", "<|im_end|>\n")
    segments = _model_segments(dialogs, row)
    if any(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids for ids in segments):
        return False
    rendered = list(_render(tokenizer, sampler, prompt, dialogs.messages[row], tokenize=True))
    assert rendered[: len(ids)] == ids
    assert tokenizer.decode(rendered[len(ids) :]) in ("", "\n", "<|im_end|>\n")
    return True


@pytest.mark.parametrize("stop_at_call_end", [True, False])
def test_every_bad_call_is_answered_counted_and_laid_out_as_the_template_renders_it(
    calculator_policy, stop_at_call_end
):
    model, tokenizer = calculator_policy
    eos = tokenizer.eos_token
    end = "" if stop_at_call_end else eos  # without the stop, the model ends a calling turn with EOS
    cases = [  # (first turn, error kind, what the tool message says)
        (_call("multiply", '{"a": 12, "b": 34}'), None, "408"),
        (_call("boom", '{"reason": "no such thing"}'), "raised", "{'error': 'no such thing'}"),
        (_call("sleepy", '{"seconds": 30.0}'), "timeout", "{'error': 'sleepy timed out after 1 s.'}"),
        (_call("long_text", '{"words": 3000}'), None, "word word word"),
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 12,}}\n</tool_call>', "malformed", "not valid JSON"),
        (_call("divide", '{"a": 12, "b": 34}'), "unknown_tool", "{'error': 'Tool divide not found.'}"),
        (_call("multiply", '{"a": "12", "b": 34}'), "bad_arguments", "argument 'a' must be integer, got str"),
    ]
    scripts = [[first + end, f"The answer is 408.{eos}"] for first, _, _ in cases]
    prompts = [f"What is 12 * 34? ({index})" for index in range(len(cases))]
    runner = ToolRunner([multiply, boom, sleepy, long_text], timeout_s=1.0, max_result_tokens=200, tokenizer=tokenizer)
    with runner:
        sampler = ScriptedDialogSampler(
            tokenizer,
            runner,
            settings=SamplingSettings(max_new_tokens=64),
            max_turns=3,
            stop_at_call_end=stop_at_call_end,
            scripts=scripts,
        )
        dialogs = sampler.sample_prompts(prompts)
    for row, (first, kind, says) in enumerate(cases):
        stats, messages = dialogs.stats[row], dialogs.messages[row]
        assert (stats.turns, stats.ended, stats.tools.calls) == (2, "answer", 1)
        assert dict(stats.tools.errors) == ({kind: 1} if kind else {})
        assert [message["role"] for message in messages] == ["assistant", "tool", "assistant"]
        assert says in messages[1]["content"]
        # Well-formed calls become tool_calls; a malformed one stays the text the model wrote.
        assert ("tool_calls" in messages[0]) == (kind != "malformed")
        first_ids = tokenizer.encode(first + end, add_special_tokens=False)
        last_ids = tokenizer.encode(f"The answer is 408.{eos}", add_special_tokens=False)
        completion, mask = dialogs.completion_ids[row], dialogs.model_mask[row]
        tool_tokens = len(completion) - len(first_ids) - len(last_ids)
        assert completion[: len(first_ids)] == first_ids and completion[-len(last_ids) :] == last_ids
        assert mask == [1] * len(first_ids) + [0] * tool_tokens + [1] * len(last_ids)
        assert dialogs.log_probs[row] == [-0.5] * len(first_ids) + [0.0] * tool_tokens + [-0.5] * len(last_ids)
        assert _assert_layout_is_the_templates(tokenizer, sampler, prompts[row], dialogs, row)
    assert dialogs.stats[3].tools.cut_results == 1
    tools = dialogs.tool_stats
    assert (tools.calls, tools.failures, tools.timeouts, tools.cut_results) == (7, 5, 1, 1)
    assert dialogs.metrics()["tools/failure_frequency"] == 5 / 7


def test_max_turns_bounds_a_dialog_that_always_calls(calculator_policy):
    model, tokenizer = calculator_policy
    with ToolRunner([multiply], timeout_s=5.0, max_result_tokens=None) as runner:
        for max_turns in (1, 3):
            sampler = ScriptedDialogSampler(
                tokenizer,
                runner,
                settings=SamplingSettings(max_new_tokens=64),
                max_turns=max_turns,
                scripts=[[_call("multiply", '{"a": 2, "b": 3}')]] * 2,
            )
            dialogs = sampler.sample_prompts(["What is 2 * 3?", "What is 2 * 3? Really."])
            for stats, messages in zip(dialogs.stats, dialogs.messages):
                assert (stats.turns, stats.ended, stats.tools.calls) == (max_turns, "max_turns", max_turns - 1)
                assert [m["role"] for m in messages] == ["assistant", "tool"] * (max_turns - 1) + ["assistant"]
            # The last turn's call is not run, so the completion ends on the model's tokens.
            assert all(mask[-1] == 1 for mask in dialogs.model_mask)


def test_the_closing_marker_must_be_one_token_to_stop_at(calculator_policy):
    from interop.tools import ToolCallFormat

    model, tokenizer = calculator_policy
    runner = ToolRunner([multiply], max_result_tokens=None)
    settings = SamplingSettings(max_new_tokens=8)
    with pytest.raises(ValueError, match="stop_at_call_end needs the closing marker '</call>' to be one token"):
        DialogSampler(
            model, tokenizer, runner, settings=settings, max_turns=2, call_format=ToolCallFormat("<call>", "</call>")
        )
    with pytest.raises(ValueError, match="max_turns=0"):
        DialogSampler(model, tokenizer, runner, settings=settings, max_turns=0)


# --- sampled with tiny/calculator_policy ---------------------------------------------------------------------------


def _log_probs_of_a_forward_pass(model, dialogs: Dialogs, row: int, *, temperature: float) -> torch.Tensor:
    """Each completion token's log-prob under one forward pass over the whole dialog, logits divided by
    ``temperature``, as trl scores them."""
    ids = torch.tensor([dialogs.prompt_ids[row] + dialogs.completion_ids[row]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    chosen = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return chosen[len(dialogs.prompt_ids[row]) - 1 :]


# Temperature 1 (what GRPO samples at) and 0.7 with the log-probs recorded at that temperature, as trl scores them.
@pytest.mark.parametrize(("stop_at_call_end", "temperature"), [(True, 1.0), (False, 1.0), (True, 0.7)])
def test_sampled_dialogs_score_as_a_forward_pass_and_render_as_the_template(
    calculator_policy, stop_at_call_end, temperature
):
    model, tokenizer = calculator_policy
    prompts, _ = calculator.make_eval_task(12, seed=5)
    torch.manual_seed(0)
    start = time.perf_counter()
    with ToolRunner(calculator.TOOLS, timeout_s=10.0, max_result_tokens=32, tokenizer=tokenizer) as runner:
        sampler = DialogSampler(
            model,
            tokenizer,
            runner,
            settings=SamplingSettings(max_new_tokens=40, temperature=temperature),
            max_turns=3,
            stop_at_call_end=stop_at_call_end,
            log_probs_at_temperature=temperature != 1.0,
        )
        dialogs = sampler.sample_prompts(prompts)
    print(f"12 dialogs in {time.perf_counter() - start:.1f}s: {dialogs.metrics()}")
    assert dialogs.tool_stats.calls > 0  # some rows called the tool: the checks below cover tool tokens
    token_checked = 0
    for row in range(len(dialogs)):
        mask = torch.tensor(dialogs.model_mask[row], dtype=torch.bool)
        sampled = torch.tensor(dialogs.log_probs[row])
        assert len(dialogs.completion_ids[row]) == len(mask) == len(sampled)
        assert (sampled[~mask] == 0).all()
        scored = _log_probs_of_a_forward_pass(model, dialogs, row, temperature=temperature)
        torch.testing.assert_close(sampled[mask], scored[mask], atol=2e-5, rtol=1e-5)
        assert dialogs.stats[row].turns <= 3
        roles = [message["role"] for message in dialogs.messages[row]]
        assert roles.count("tool") == dialogs.stats[row].tools.calls
        assert (~mask).sum() > 0 if dialogs.stats[row].tools.calls else mask.all()
        token_checked += _assert_layout_is_the_templates(tokenizer, sampler, prompts[row], dialogs, row)
    assert token_checked >= len(dialogs) // 2


def test_the_token_budget_bounds_every_completion(calculator_policy):
    model, tokenizer = calculator_policy
    prompts, _ = calculator.make_eval_task(12, seed=6)
    torch.manual_seed(1)
    with ToolRunner(calculator.TOOLS, timeout_s=10.0, max_result_tokens=32, tokenizer=tokenizer) as runner:
        settings = SamplingSettings(max_new_tokens=40)
        sampler = DialogSampler(model, tokenizer, runner, settings=settings, max_turns=4, max_completion_tokens=30)
        dialogs = sampler.sample_prompts(prompts)
    assert all(len(ids) <= 30 for ids in dialogs.completion_ids)
    assert any(stats.ended in ("budget", "length") for stats in dialogs.stats)
    assert dialogs.truncated == [stats.ended in ("budget", "length") for stats in dialogs.stats]
    output = dialogs.as_rollout_output()
    assert sorted(output) == ["completion_ids", "env_mask", "logprobs", "prompt_ids"]
    assert [len(mask) for mask in output["env_mask"]] == [len(ids) for ids in output["completion_ids"]]


# --- the KV cache kept across turns ----------------------------------------------------------------------------------


def _sample_dialogs(calculator_policy, prompts, *, keep: bool, seed: int, **options) -> Dialogs:
    model, tokenizer = calculator_policy
    torch.manual_seed(seed)
    with ToolRunner(calculator.TOOLS, timeout_s=10.0, max_result_tokens=32, tokenizer=tokenizer) as runner:
        sampler = DialogSampler(model, tokenizer, runner, keep_cache_across_turns=keep, **options)
        return sampler.sample_prompts(prompts)


def _spy_on_turns(monkeypatch) -> list[tuple[int, int | None]]:
    """Each turn's ``(rows, rows of its past cache or None)``, as ``DialogSampler`` calls ``sample_responses``."""
    import interop.tools.dialogs

    calls, real = [], interop.tools.dialogs.sample_responses

    def spy(model, tokens, mask, **options):
        calls.append((tokens.shape[0], None if options.get("past") is None else len(options["past"])))
        return real(model, tokens, mask, **options)

    monkeypatch.setattr(interop.tools.dialogs, "sample_responses", spy)
    return calls


# Turns ending at the closing marker (the template's end of turn written by the loop, in the tool suffix) and at EOS
# (trl's layout), at temperature 1 and at 0.7 with the log-probs scored there. The untrained policy calls the tool in
# one dialog in five or so: seeds whose dialogs call it several times, with results of different lengths.
@pytest.mark.parametrize(("stop_at_call_end", "temperature", "seed"), [(True, 1.0, 3), (False, 0.7, 4)])
def test_dialogs_sampled_on_the_kept_cache_are_those_of_a_prefill_per_turn(
    calculator_policy, monkeypatch, stop_at_call_end, temperature, seed
):
    model, tokenizer = calculator_policy
    prompts, _ = calculator.make_eval_task(12, seed=7)
    # Four more rows: products of few and of many digits.
    prompts += ["What is the product of 7 and 8?", "What is the product of 3 and 5?"]
    prompts += ["What is the product of 98765 and 4321?", "What is the product of 9 and 123456789?"]
    options = {
        "settings": SamplingSettings(max_new_tokens=40, temperature=temperature),
        "max_turns": 3,
        "stop_at_call_end": stop_at_call_end,
        "log_probs_at_temperature": temperature != 1.0,
    }
    calls = _spy_on_turns(monkeypatch)
    cached = _sample_dialogs(calculator_policy, prompts, keep=True, seed=seed, **options)
    assert calls[0] == (16, None) and len(calls) >= 2
    assert all(past == rows for rows, past in calls[1:])  # every later turn ran on the kept caches
    calls.clear()
    prefilled = _sample_dialogs(calculator_policy, prompts, keep=False, seed=seed, **options)
    assert all(past is None for _, past in calls)
    # (b) the same random numbers draw the same dialogs both ways.
    assert cached.completion_ids == prefilled.completion_ids and cached.model_mask == prefilled.model_mask
    assert cached.messages == prefilled.messages
    # (c) rows dropped out at different turns, and tool messages of different lengths were appended.
    turns = {stats.turns for stats in cached.stats}
    assert len(turns) > 1, [stats.ended for stats in cached.stats]
    suffixes = set()
    for row in range(len(cached)):
        torch.testing.assert_close(
            torch.tensor(cached.log_probs[row]), torch.tensor(prefilled.log_probs[row]), atol=2e-5, rtol=1e-5
        )
        # (a) each model token's recorded log-prob is a forward pass's over the whole dialog.
        mask = torch.tensor(cached.model_mask[row], dtype=torch.bool)
        scored = _log_probs_of_a_forward_pass(model, cached, row, temperature=temperature)
        torch.testing.assert_close(torch.tensor(cached.log_probs[row])[mask], scored[mask], atol=2e-5, rtol=1e-5)
        suffixes |= {len(segment) for segment in _tool_segments(cached, row)}
    assert len(suffixes) > 1, suffixes


def _tool_segments(dialogs: Dialogs, row: int) -> list[list[int]]:
    segments, current = [], []
    for token, mine in zip(dialogs.completion_ids[row], dialogs.model_mask[row]):
        if not mine:
            current.append(token)
        elif current:
            segments, current = segments + [current], []
    return segments + ([current] if current else [])


def test_a_model_whose_cache_cannot_be_kept_runs_every_turn_over_the_whole_dialog(calculator_policy, monkeypatch):
    import interop.sampling.sampler

    prompts, _ = calculator.make_eval_task(8, seed=8)
    options = {"settings": SamplingSettings(max_new_tokens=40), "max_turns": 3}
    expected = _sample_dialogs(calculator_policy, prompts, keep=True, seed=4, **options)
    monkeypatch.setattr(interop.sampling.sampler, "_rows_can_be_kept", lambda cache: False)
    calls = _spy_on_turns(monkeypatch)
    fallback = _sample_dialogs(calculator_policy, prompts, keep=True, seed=4, **options)
    assert len(calls) >= 2 and all(past is None for _, past in calls)
    assert fallback.completion_ids == expected.completion_ids
