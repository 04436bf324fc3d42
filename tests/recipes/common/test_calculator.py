"""The tool-use task (recipes/common/calculator.py) and its policy (scripts/build_tiny_models.py --task calculator):
disjoint train and eval problems, pretraining dialogs in trl's tool-calling form with the shares the policy is built
on, the exact-answer reward on the final message, and the built policy's template and tokens."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from recipes.common import calculator

TRL_QWEN2_5_TEMPLATE = Path(__import__("trl").__file__).parent / "chat_templates" / "qwen2_5.jinja"


def _pairs(prompts: list[str]) -> set[tuple[int, int]]:
    pairs = set()
    for prompt in prompts:
        a, b = (int(n) for n in calculator._NUMBER.findall(prompt))
        pairs.add((min(a, b), max(a, b)))
    return pairs


def test_train_and_eval_prompts_share_no_problem():
    train, train_columns = calculator.make_task(3000, seed=1234)
    held_out, eval_columns = calculator.make_eval_task(600, seed=1235)
    assert _pairs(train).isdisjoint(_pairs(held_out))
    assert all(calculator.is_held_out(a, b) for a, b in _pairs(held_out))
    for prompts, columns in ((train, train_columns), (held_out, eval_columns)):
        for prompt, solution in zip(prompts, columns["solution"]):
            a, b = (int(n) for n in calculator._NUMBER.findall(prompt))
            assert 10 <= a <= 999 and 10 <= b <= 999 and solution == str(a * b)


def test_pretraining_dialogs_call_the_tool_as_often_as_the_task_says():
    conversations = calculator.make_sft_conversations(4000, seed=0)
    with_tool = [c for c in conversations if len(c) == 4]
    assert abs(len(with_tool) / len(conversations) - calculator.TOOL_SHARE) < 0.03
    typos = 0
    for user, call_turn, tool, answer in with_tool:
        (call,) = call_turn["tool_calls"]
        x, y = call["function"]["arguments"]["a"], call["function"]["arguments"]["b"]
        assert tool == {"role": "tool", "name": "multiply", "content": str(x * y)}
        assert answer["content"] == f"The answer is {x * y}."
        typos += calculator._NUMBER.findall(user["content"]) != [str(x), str(y)]
    assert abs(typos / len(with_tool) - calculator.TYPO_SHARE) < 0.04
    guesses = [c for c in conversations if len(c) == 2]
    right = sum(calculator.exact_answer_reward([c[1]["content"]], [str(_product(c[0]))])[0] for c in guesses)
    assert right / len(guesses) < 0.02  # a guess is nearly always wrong


def _product(user: dict) -> int:
    a, b = (int(n) for n in calculator._NUMBER.findall(user["content"]))
    return a * b


DECODED_CALL = "<tool_call>{...}</tool_call>\nuser\n<tool_response>\n408\n</tool_response>"
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}}}


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ([{"role": "assistant", "content": "The answer is 408."}], 1.0),
        (
            [
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "name": "multiply", "content": "408"},
                {"role": "assistant", "content": "The answer is 408."},
            ],
            1.0,
        ),
        # The dialog ends on the tool's result, or on a call: no answer, whatever numbers came before.
        ([{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "408"}], 0.0),
        ([{"role": "assistant", "content": "", "tool_calls": [CALL]}], 0.0),
        ([{"role": "assistant", "content": "408 or maybe 409"}], 0.0),
        # A whole dialog decoded to one text: only what follows the last tool result counts, calls left out.
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>', 0.0),
        (f"{DECODED_CALL}\nassistant\nThe answer is 408.", 1.0),
        (f"{DECODED_CALL}\nassistant\nDone.", 0.0),
        # ... and as trl hands a rollout_func's completion to a reward function: one assistant message holding it all.
        ([{"role": "assistant", "content": f"{DECODED_CALL}\nassistant\nThe answer is 408."}], 1.0),
        ([{"role": "assistant", "content": f"{DECODED_CALL}\nassistant\nDone."}], 0.0),
    ],
)
def test_the_reward_reads_the_final_messages_last_number(completion, reward):
    assert calculator.exact_answer_reward([completion], solution=["408"]) == [reward]


def test_the_task_tool_is_a_tool_trl_takes():
    from interop.tools import ToolSet

    (schema,) = ToolSet(calculator.TOOLS).schemas
    assert schema["function"]["name"] == "multiply"
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert calculator.multiply(23, 417) == 9591


def _load_build_script(repo_root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny_models", repo_root / "scripts" / "build_tiny_models.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def test_the_calculator_template_is_qwen2_5s_as_trl_ships_it(repo_root):
    assert _load_build_script(repo_root).QWEN2_5_CHAT_TEMPLATE == TRL_QWEN2_5_TEMPLATE.read_text(encoding="utf-8")


def test_the_shipped_calculator_policy_renders_tools_as_qwen2_5(tiny_dir):
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "calculator_policy")
    assert tokenizer.chat_template == TRL_QWEN2_5_TEMPLATE.read_text(encoding="utf-8")
    assert tokenizer.pad_token != tokenizer.eos_token == "<|im_end|>"
    for marker in ("<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    conversation = calculator.make_sft_conversations(1, seed=1)[0]
    text = tokenizer.apply_chat_template(conversation, tools=list(calculator.TOOLS), tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "multiply"' in text
    assert "<|im_start|>user\n<tool_response>\n" in text
    config = AutoConfig.from_pretrained(tiny_dir / "calculator_policy")
    assert len(tokenizer(text)["input_ids"]) < config.max_position_embeddings == 512


def test_build_script_writes_the_calculator_policy(tmp_path, repo_root):
    command = [
        sys.executable,
        str(repo_root / "scripts" / "build_tiny_models.py"),
        f"--out={tmp_path}",
        "--task=calculator",
        "--num-conversations=200",
        "--pretrain-steps=5",
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(path.name for path in tmp_path.iterdir()) == ["calculator_policy"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "calculator_policy")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "calculator_policy")
    assert policy.config.vocab_size == len(tokenizer) and policy.generation_config.max_new_tokens == 48
    assert Counter(tokenizer.convert_ids_to_tokens(tokenizer.encode("<tool_call></tool_call>")))["<tool_call>"] == 1
