"""interop.TorchRLRolloutFunc(tools=...) against trl's own tool loop (GRPOTrainer(tools=...)): for the same dialogs
(the model's turns injected, the tools run for real), trl gets the same prompt and completion ids, the same tool mask
(our env_mask is trl's tool_mask), the same rewards and advantages, and its _compute_loss gives the same loss; the
tool messages' tokens get no gradient; a trainer trains with tools and its buffer rows keep the env_mask and the tool
counts; a tool that raises or overruns is answered, counted and the run goes on."""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from _tool_functions import boom, sleepy
from _tool_policy import build_tool_policy, inject_turns, tool_call
from torchrl.data import LazyStackStorage, ReplayBuffer

from interop import TorchRLRolloutFunc
from recipes.tasks import calculator

# Each prompt's turns, in order (its last repeated): a call then the answer; an answer at once; an unknown tool, then
# an answer; a call in every turn (the turn limit ends it); a tool that raises; a tool that overruns tools' timeout.
SCRIPTS = {
    "What is 12 * 34?": [tool_call("multiply", '{"a": 12, "b": 34}'), "The answer is 408."],
    "What is 5 * 1?": ["The answer is 5."],
    "What is 7 * 8?": [tool_call("divide", '{"a": 7, "b": 8}'), "The answer is 56."],
    "What is 2 * 3?": [tool_call("multiply", '{"a": 2, "b": 3}'), tool_call("multiply", '{"a": 3, "b": 2}')],
}
FAILING = {
    "Break it.": [tool_call("boom", '{"reason": "no"}'), "The answer is 0."],
    "Wait for it.": [tool_call("sleepy", '{"seconds": 30}'), "The answer is 1."],
}


@pytest.fixture(scope="module")
def tool_policy(tmp_path_factory):
    """``(model, tokenizer)``: an untrained tiny Qwen2 whose tokenizer renders Qwen2.5's tool calls (the model's turns
    are injected: what matters is the layout and trl's loss over it)."""
    extra = [text for turns in {**SCRIPTS, **FAILING}.values() for text in turns] + list(SCRIPTS) + list(FAILING)
    extra += ["Tools: multiply boom sleepy"]
    return build_tool_policy(tmp_path_factory.mktemp("tool_policy"), extra)


def _script(tokenizer, context: list[int], seen: Counter) -> str:
    """The injected turn for a dialog so far: its prompt's script, at the turn its tool results say it is at; every
    second answer of a prompt's turn is wrong (``seen`` counts them), so that a group's rewards differ. Both tool loops
    sample a turn for the rows in the same order, so the same rows get the wrong answers."""
    text = tokenizer.decode(context)
    scripts = {**SCRIPTS, **FAILING}
    prompt = next(question for question in scripts if question in text)
    turns = scripts[prompt]
    index = min(text.count("<tool_response>"), len(turns) - 1)
    turn = turns[index]
    seen[prompt, index] += 1
    if seen[prompt, index] % 2 == 0 and not turn.startswith("<tool_call>"):
        turn = "The answer is 1."
    return turn


def _inject_into_dialogs(monkeypatch, tokenizer):
    seen = Counter()
    inject_turns(monkeypatch, tokenizer, lambda context: _script(tokenizer, context, seen))


def _args(tmp_path, **overrides):
    from trl import GRPOConfig

    fields = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=160,
        max_tool_calling_iterations=1,
        beta=0.0,
        disable_tqdm=True,
        activation_checkpointing=False,
        logging_steps=1,
        max_steps=2,
        learning_rate=1e-3,
    )
    return GRPOConfig(**{**fields, **overrides})


def _dataset(questions):
    import datasets

    return datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q in questions], "solution": [_solution(q) for q in questions]}
    )


def _solution(question: str) -> str:
    numbers = [int(n) for n in question.replace("?", "").split() if n.isdigit()]
    return str(numbers[0] * numbers[1]) if len(numbers) == 2 else "0"


def _inputs(questions, group=2):
    return [
        {"prompt": [{"role": "user", "content": q}], "solution": _solution(q)} for q in questions for _ in range(group)
    ]


def _trl_tools_trainer(tool_policy, tmp_path, questions):
    """trl's own tool loop, with the model's turns injected where trl generates (``_generate_single_turn``)."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    model, tokenizer = tool_policy
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.response_template = qwen3_template  # the assistant turns are Qwen's; trl knows the template by name only
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calculator.exact_answer_reward,
        args=_args(tmp_path / "trl"),
        train_dataset=_dataset(questions),
        processing_class=tokenizer,
        tools=[calculator.multiply],
    )

    seen = Counter()

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids = [
            tokenizer.encode(_script(tokenizer, row, seen) + tokenizer.eos_token, add_special_tokens=False)
            for row in prompt_ids
        ]
        ids = [row[: trainer.max_completion_length] for row in ids]
        return ids, [[-0.5] * len(row) for row in ids]

    trainer._generate_single_turn = generate
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets before a step
    return trainer


def _rollout_func_trainer(tool_policy, tmp_path, questions, *, trainer_class=None, tools=(calculator.multiply,), **kw):
    from trl import GRPOTrainer

    model, tokenizer = tool_policy
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = (trainer_class or GRPOTrainer)(
        model=model,
        reward_funcs=calculator.exact_answer_reward,
        args=_args(tmp_path / "ours"),
        train_dataset=_dataset(questions),
        processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(tools=list(tools), tool_timeout_s=2.0, **kw),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def test_trl_gets_from_the_rollout_func_the_batch_and_loss_its_own_tool_loop_makes(tool_policy, tmp_path, monkeypatch):
    questions = list(SCRIPTS)
    _inject_into_dialogs(monkeypatch, tool_policy[1])
    theirs = _trl_tools_trainer(tool_policy, tmp_path, questions)
    ours = _rollout_func_trainer(tool_policy, tmp_path, questions)
    tool_policy[0].train()
    expected = theirs._generate_and_score_completions(_inputs(questions))
    got = ours._generate_and_score_completions(_inputs(questions))
    ours.rollout_func.close()
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages"):
        assert torch.equal(got[key], expected[key]), key
    torch.testing.assert_close(got["sampling_per_token_logps"], expected["sampling_per_token_logps"])
    tool_mask = expected["tool_mask"] * expected["completion_mask"]
    # Not vacuous: the dialogs hold tool messages (masked) and the model's turns after them (in the loss), and the
    # rewards tell the answers apart.
    assert (tool_mask == 0).logical_and(expected["completion_mask"] == 1).any()
    assert expected["advantages"].abs().sum() > 0
    torch.testing.assert_close(ours._compute_loss(tool_policy[0], got), theirs._compute_loss(tool_policy[0], expected))


def test_the_tool_messages_tokens_get_no_gradient_in_trls_loss(tool_policy, tmp_path, monkeypatch):
    questions = list(SCRIPTS)
    _inject_into_dialogs(monkeypatch, tool_policy[1])
    ours = _rollout_func_trainer(tool_policy, tmp_path, questions)
    model = tool_policy[0].train()
    batch = ours._generate_and_score_completions(_inputs(questions))
    ours.rollout_func.close()

    def position_grads(batch):
        """|d loss / d hidden| at the position predicting each completion token."""
        captured = []

        def keep_hidden(module, inputs, output):
            output.retain_grad()
            captured.append(output)

        # trl computes the log-probs from the last hidden states and lm_head.weight: the final norm's output is where
        # each position's prediction starts.
        handle = model.model.norm.register_forward_hook(keep_hidden)
        try:
            model.zero_grad()
            ours._compute_loss(model, batch).backward()
        finally:
            handle.remove()
            model.zero_grad()
        width = batch["completion_ids"].shape[1]  # the last width + 1 positions: position j predicts token j
        return torch.cat([hidden.grad[:, -width - 1 : -1] for hidden in captured]).abs().sum(-1)

    mask = batch["completion_mask"]
    tools = (batch["tool_mask"] == 0) & (mask == 1)
    learning = (batch["tool_mask"] == 1) & (mask == 1) & (batch["advantages"][:, None] != 0)
    assert tools.any() and learning.any()
    grad = position_grads(batch)
    assert grad[tools].max() == 0
    assert (grad[learning] > 0).all()
    # The mask is what keeps them out: without it the same tokens are trained on.
    unmasked = position_grads({key: value for key, value in batch.items() if key != "tool_mask"})
    assert (unmasked[tools & (batch["advantages"][:, None] != 0)] > 0).all()


def test_a_trainer_trains_with_tools_and_its_rows_keep_the_env_mask_and_counts(tool_policy, tmp_path, monkeypatch):
    from interop.trl.trainer import TorchRLGRPOTrainer

    questions = ["What is 12 * 34?", "What is 5 * 1?", *FAILING]
    _inject_into_dialogs(monkeypatch, tool_policy[1])
    rows = ReplayBuffer(storage=LazyStackStorage(1000))
    model = copy.deepcopy(tool_policy[0])
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = _rollout_func_trainer(
        (model, tool_policy[1]),
        tmp_path,
        questions,
        trainer_class=TorchRLGRPOTrainer,
        tools=(calculator.multiply, boom, sleepy),
    )
    trainer.rollout_func.replay_buffer = rows
    trainer.train()  # two steps: the raising and the overrunning tools are answered and the run goes on
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert len(rows) == 16
    for index in range(len(rows)):
        row = rows[index]
        prompt = row["prompt"][-1]["content"]
        calls = {"What is 5 * 1?": 0}.get(prompt, 1)
        assert int(row["tool_calls"]) == calls
        assert int(row["tool_errors"]) == (prompt in FAILING)
        assert int(row["turns"]) == 1 + calls
        assert row["env_mask"].shape == row["completion_ids"].shape
        assert bool((row["env_mask"] == 0).any()) == bool(calls)
    logged = [entry for entry in trainer.state.log_history if "rollout/tool_calls_per_dialog" in entry]
    assert [entry["rollout/tool_calls_per_dialog"] for entry in logged] == [0.75, 0.75]
    assert [entry["rollout/tool_errors"] for entry in logged] == [4.0, 4.0]  # 2 failing prompts x 2 answers each
    assert not any(key.startswith("tools/") for entry in trainer.state.log_history for key in entry)  # not trl's


def test_two_tool_loops_and_disagreeing_turn_limits_are_refused(tool_policy, tmp_path):
    from trl import GRPOTrainer

    model, tokenizer = tool_policy
    func = TorchRLRolloutFunc(tools=[calculator.multiply], max_turns=4)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calculator.exact_answer_reward,
        args=_args(tmp_path),
        train_dataset=_dataset(list(SCRIPTS)),
        processing_class=tokenizer,
        rollout_func=func,
    )
    with pytest.raises(ValueError, match=r"max_turns=4 disagrees with .*max_tool_calling_iterations=1 .*max_turns = 2"):
        func([_inputs(["What is 5 * 1?"])[0]["prompt"]], trainer)
    func.close()
    trainer.tools = [calculator.multiply]
    func = TorchRLRolloutFunc(tools=[calculator.multiply])
    with pytest.raises(ValueError, match=r"the trainer was given tools too .*calling each tool twice"):
        func([_inputs(["What is 5 * 1?"])[0]["prompt"]], trainer)
    func.close()
    with pytest.raises(ValueError, match="tools= samples whole dialogs .* Pass no policy"):
        TorchRLRolloutFunc(object(), tools=[calculator.multiply])
    with pytest.raises(ValueError, match="tool '<lambda>' has no docstring"):
        TorchRLRolloutFunc(tools=[lambda a: a])


def test_async_mode_samples_the_dialogs_in_its_process_with_a_tool_worker_of_its_own(tiny_dir, tmp_path):
    """tiny/calculator_policy calls its tool in about a third of its answers (24 dialogs without a call: about 6e-5):
    the child process samples the dialogs (its own tool worker answers the calls), and trl trains one update behind
    on them with their env_mask."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from torchrl.data import LazyTensorStorage
    from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interop import TorchRLBufferDataset
    from interop.trl.trainer import TorchRLGRPOTrainer

    prompts, columns = calculator.make_task(16, seed=0)
    rows = TensorDict(
        {
            "prompt": NonTensorStack(*[NonTensorData([{"role": "user", "content": p}]) for p in prompts]),
            "solution": NonTensorStack(*[NonTensorData(s) for s in columns["solution"]]),
        },
        batch_size=[16],
    )
    source = ReplayBuffer(
        storage=LazyTensorStorage(16), sampler=SamplerWithoutReplacement(), generator=torch.Generator().manual_seed(0)
    )
    source.extend(rows)
    stream = TorchRLBufferDataset(source, batch_size=4, keys=["prompt", "solution"], num_batches=None).as_hf_dataset()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "calculator_policy", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "calculator_policy")
    stored = ReplayBuffer(storage=LazyStackStorage(1000))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = TorchRLGRPOTrainer(
        model=model,
        reward_funcs=calculator.exact_answer_reward,
        args=_args(tmp_path, max_steps=3, per_device_train_batch_size=8, num_generations=4, shuffle_dataset=False),
        train_dataset=stream,
        processing_class=tokenizer,
        rollout_func=TorchRLRolloutFunc(tools=[calculator.multiply], mode="async"),
        replay_buffer=stored,
    )
    trainer.train()
    assert trainer.state.global_step == 3
    logged = [entry for entry in trainer.state.log_history if "policy_lag" in entry]
    assert [entry["policy_lag"] for entry in logged][1:] == [1.0, 1.0], "steps 2 and 3 trained on pre-sampled dialogs"
    assert len(stored) == 24
    calls = [int(stored[index]["tool_calls"]) for index in range(24)]
    assert sum(calls) > 0, "the policy called its tool"
    for index in range(24):
        row = stored[index]
        assert row["env_mask"].shape == row["completion_ids"].shape
        assert bool((row["env_mask"] == 0).any()) <= bool(calls[index])  # tool tokens only where a tool answered
    assert any(bool((stored[index]["env_mask"] == 0).any()) for index in range(24))
