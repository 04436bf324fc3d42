"""The tool-use task (recipes/tasks/calculator.py) and its policy (scripts/build_tiny_models.py --task calculator):
disjoint train and eval problems, pretraining dialogs in trl's tool-calling form with the shares the policy is built
on, the exact-answer reward on the final message, and the built policy's template and tokens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from _tiny_models import load_build_script, run_build_script

from recipes.tasks import calculator

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


@pytest.fixture(scope="module")
def shipped_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir / "calculator_policy")


def _dialogs_to_render() -> list[list[dict]]:
    """The pretraining dialogs, and what they lack: a system message, text beside a call, two calls in one turn."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}}}
    other = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 5, "b": 6}}}
    user = {"role": "user", "content": "What is 12 * 34?"}
    return [
        *calculator.make_sft_conversations(20, seed=3),
        [{"role": "system", "content": "Be brief."}, user, {"role": "assistant", "content": "408"}],
        [user, {"role": "assistant", "content": "Let me check.", "tool_calls": [call]}],
        [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call, other]},
            {"role": "tool", "name": "multiply", "content": "408"},
            {"role": "tool", "name": "multiply", "content": "30"},
            {"role": "assistant", "content": "The answer is 408."},
        ],
    ]


def test_the_calculator_template_renders_dialogs_as_qwen2_5_after_a_one_line_tool_list(repo_root, shipped_tokenizer):
    build = load_build_script(repo_root)
    assert shipped_tokenizer.chat_template == build.CALCULATOR_CHAT_TEMPLATE
    qwen = TRL_QWEN2_5_TEMPLATE.read_text(encoding="utf-8")
    tools = list(calculator.TOOLS)
    for dialog in _dialogs_to_render():
        ours = shipped_tokenizer.apply_chat_template(dialog, tools=tools, tokenize=False)
        theirs = shipped_tokenizer.apply_chat_template(dialog, tools=tools, tokenize=False, chat_template=qwen)
        system = "Be brief.\n" if dialog[0]["role"] == "system" else ""
        head = f"<|im_start|>system\n{system}Tools: multiply(a: integer, b: integer)<|im_end|>\n"
        assert ours.startswith(head)
        # Everything after the system turn is Qwen2.5's render: its tool-call and tool-response blocks.
        assert ours[len(head) :] == theirs[theirs.index("<|im_end|>\n") + len("<|im_end|>\n") :]
        # Prefix-preserving: each message's render stays as it was when more messages follow, except inside a run of
        # tool results, which Qwen2.5 closes with one <|im_end|> (DialogSampler appends a turn's results together).
        for cut in range(1, len(dialog)):
            if dialog[cut - 1]["role"] == dialog[cut]["role"] == "tool":
                continue
            assert ours.startswith(shipped_tokenizer.apply_chat_template(dialog[:cut], tools=tools, tokenize=False))
    # Without tools, no tool line.
    plain = shipped_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_the_shipped_calculator_policy_copies_numbers_token_by_token(tiny_dir, shipped_tokenizer):
    from transformers import AutoConfig

    tokenizer = shipped_tokenizer
    assert tokenizer.pad_token != tokenizer.eos_token == "<|im_end|>"
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    # Every digit is a token, wherever it stands: in the question, the call's JSON and the tool's result.
    for text in (" 9591", '{"a": 23, "b": 417}', "\n9591\n"):
        digits = [token for token in tokenizer.tokenize(text) if any(char.isdigit() for char in token)]
        assert digits == [char for char in text if char.isdigit()]
    longest = max(
        len(tokenizer.apply_chat_template(dialog, tools=list(calculator.TOOLS), return_dict=False))
        for dialog in calculator.make_sft_conversations(200, seed=4)
    )
    config = AutoConfig.from_pretrained(tiny_dir / "calculator_policy")
    assert longest < 128 < config.max_position_embeddings


def test_build_script_writes_the_calculator_policy(tmp_path, repo_root):
    arguments = [f"--out={tmp_path}", "--task=calculator", "--num-conversations=200", "--copy-conversations=200"]
    run_build_script(repo_root, *arguments, "--pretrain-steps=5")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(path.name for path in tmp_path.iterdir()) == ["calculator_policy"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "calculator_policy")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "calculator_policy")
    assert policy.config.vocab_size == len(tokenizer) and policy.generation_config.max_new_tokens == 48
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("<tool_call></tool_call> 417"))
    assert Counter(tokens)["<tool_call>"] == 1 and tokens[-3:] == ["4", "1", "7"]
