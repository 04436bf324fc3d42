"""trl reward functions in the recipe (recipes/common/reward_functions.py, rewards.score_sources): called as
``trl.GRPOTrainer`` calls them (compared with trl's own call), columns row-aligned, ``None`` / raising / wrong count /
NaN handled as the issue says, several weighted sources aggregated as trl aggregates them (trl's code, called)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.envs import Compose
from transformers import TrainerState

from interop import RewardModelTransform
from recipes.common.config import ConfigError
from recipes.common.data import PromptRows
from recipes.common.prompts import PromptTable
from recipes.common.reward_functions import check_reward_functions
from recipes.common.schema import RewardFunctionNode, RewardFunctions, typed_config
from recipes.grpo.batch import ATTENTION_MASK, PROMPT_INDEX, RESPONSE_TOKENS
from recipes.grpo.loss import normalized_sum_advantages
from recipes.grpo.rewards import RewardFunction, RewardSource, TrainerStepCounter, score_sources

GROUP = 4
PROMPTS = ["What is 1 + 2?", "Add 3 and 4."]
CONVERSATIONS = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
SOLUTIONS = ["3", "7"]


def _completion_ids(tokenizer) -> list[list[int]]:
    """Two groups of ragged completions, EOS-terminated as a sampler writes them."""
    texts = ["3", "The answer is 3.", "4", "three", "7", "1 + 6 = 7", "8", "the answer is 7"]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]


def _dense_step(completion_ids: list[list[int]], pad_token_id: int) -> TensorDict:
    """The keys a ``PromptEnv`` step holds for a reward function: responses right-padded, their mask, the rows'
    prompt indices (each prompt's group contiguous)."""
    width = max(len(ids) for ids in completion_ids)
    tokens = torch.full((len(completion_ids), width), pad_token_id)
    mask = torch.zeros(len(completion_ids), 3 + width, dtype=torch.bool)  # 3 prompt columns, unread here
    for row, ids in enumerate(completion_ids):
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, 3 : 3 + len(ids)] = True
    step = TensorDict(batch_size=[len(completion_ids)])
    step.set(RESPONSE_TOKENS, tokens)
    step.set(ATTENTION_MASK, mask)
    step.set(PROMPT_INDEX, torch.arange(len(PROMPTS)).repeat_interleave(GROUP))
    return step


class Recorder:
    """A trl reward function that keeps what it was called with."""

    __name__ = "recorder"

    def __init__(self, values=None) -> None:
        self.calls = []
        self.values = values

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
        return self.values if self.values is not None else [float(len(c)) for c in completion_ids]


def _trl_trainer(tiny_policy, tmp_path, reward_funcs, **config):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = tiny_policy
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=len(PROMPTS) * GROUP,
        num_generations=GROUP,
        max_completion_length=16,
        disable_tqdm=True,
        **config,
    )
    # Conversational, as the recipes hand their prompts to trl (rendered with the policy's chat template).
    dataset = datasets.Dataset.from_dict({"prompt": CONVERSATIONS, "solution": SOLUTIONS})
    return GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def _trl_scores(trainer, tokenizer, completion_ids: list[list[int]]) -> dict:
    """trl's own ``_generate_and_score_completions`` on these completions (injected through its ``rollout_func``)."""

    def rollout(prompts, trainer):
        return {
            "prompt_ids": [
                tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
                for prompt in prompts
            ],
            "completion_ids": completion_ids,
            "logprobs": [[-1.0] * len(ids) for ids in completion_ids],
        }

    trainer.rollout_func = rollout
    inputs = [{"prompt": p, "solution": s} for p, s in zip(CONVERSATIONS, SOLUTIONS, strict=True) for _ in range(GROUP)]
    return trainer._generate_and_score_completions(inputs)


def _adapter(function, tokenizer, *, prompts=PROMPTS, columns=None, step: int = 0) -> RewardFunction:
    table = PromptTable(
        PromptRows(list(prompts), {"solution": list(SOLUTIONS)} if columns is None else columns),
        tokenizer=tokenizer,
    )
    state = TrainerState(global_step=step, max_steps=30)
    return RewardFunction(function, name="recorder", prompts=table, tokenizer=tokenizer, trainer_state=state)


def test_the_function_gets_the_arguments_trl_gives_it(tiny_policy, tmp_path):
    """The same reward function, once inside trl.GRPOTrainer and once inside the recipe, for the same prompts and
    completions: the same argument names, and the same values for every one of them."""
    _, tokenizer = tiny_policy
    completion_ids = _completion_ids(tokenizer)
    in_trl, in_recipe = Recorder(), Recorder()
    _trl_scores(_trl_trainer(tiny_policy, tmp_path, [in_trl]), tokenizer, completion_ids)
    _adapter(in_recipe, tokenizer)(_dense_step(completion_ids, tokenizer.pad_token_id))

    trl_call, recipe_call = in_trl.calls[0], in_recipe.calls[0]
    assert set(recipe_call) == set(trl_call)
    for key in ("prompts", "completions", "completion_ids", "solution"):
        assert recipe_call[key] == trl_call[key], key
    assert isinstance(recipe_call["trainer_state"], TrainerState) and recipe_call["trainer_state"].global_step == 0
    assert callable(recipe_call["log_extra"]) and callable(recipe_call["log_metric"])
    # Decoded without EOS, as trl decodes; a message list, as trl passes a conversational prompt's completion.
    assert recipe_call["completions"][1] == [{"role": "assistant", "content": "The answer is 3."}]


def test_conversational_prompts_get_message_lists_as_trl_passes_them(tiny_policy):
    _, tokenizer = tiny_policy
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    recorder = Recorder()
    _adapter(recorder, tokenizer, prompts=conversations)(_dense_step(_completion_ids(tokenizer), 0))
    call = recorder.calls[0]
    assert call["prompts"][0] == conversations[0] and call["prompts"][GROUP] == conversations[1]
    assert call["completions"][1] == [{"role": "assistant", "content": "The answer is 3."}]


def test_columns_reach_the_function_row_aligned(tiny_policy):
    """A function that checks its solution against its own prompt: every row must match."""
    _, tokenizer = tiny_policy

    def checks_alignment(prompts, completions, solution, **kwargs):
        for prompt, answer in zip(prompts, solution, strict=True):
            text = prompt[-1]["content"]  # a conversation, as trl passes the recipes' prompts
            numbers = [int(token) for token in text.replace("?", " ").replace(".", " ").split() if token.isdigit()]
            assert sum(numbers) == int(answer), (prompt, answer)
        return [1.0] * len(completions)

    # Prompts in another order than the rows: each row's columns must follow its prompt index.
    step = _dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id)
    step.set(PROMPT_INDEX, torch.tensor([1, 1, 1, 1, 0, 0, 0, 0]))
    scores = _adapter(checks_alignment, tokenizer)(step)["score"]
    assert scores.tolist() == [1.0] * 8


def _transform(tokenizer, *functions, weights=None) -> RewardModelTransform:
    weights = weights or [1.0] * len(functions)
    sources = [
        (RewardSource(f"f{index}", f"reward.functions.f{index}", weight, "function"), _adapter(function, tokenizer))
        for index, (function, weight) in enumerate(zip(functions, weights, strict=True))
    ]
    return score_sources(sources)


def _scored(tokenizer, *functions):
    return _transform(tokenizer, *functions).score(_dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id))


def test_none_is_left_out_of_its_source_and_of_the_sum(tiny_policy):
    _, tokenizer = tiny_policy
    sometimes = Recorder([None, 1.0, None, 2.0, None, 3.0, None, 4.0])
    always = Recorder([10.0] * 8)
    transform = _transform(tokenizer, sometimes, always, weights=[1.0, 0.5])
    step = _dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id)
    transform(step)
    values = step.get(("next", "source_rewards"))
    assert torch.isnan(values[0::2, 0]).all() and values[1::2, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert step.get(("next", "reward")).reshape(-1).tolist() == [5.0, 6.0, 5.0, 7.0, 5.0, 8.0, 5.0, 9.0]
    assert step.get(("next", "reward")).shape == (8, 1, 1)


def test_a_response_no_source_scores_stops_the_step_naming_the_functions(tiny_policy):
    _, tokenizer = tiny_policy
    with pytest.raises(RuntimeError, match=r"Every reward source \(reward.functions.f0, reward.functions.f1\)"):
        _scored(tokenizer, Recorder([None, 1.0] * 4), Recorder([None] * 8))


def test_a_raising_function_is_named_with_the_first_row_it_fails_on(tiny_policy):
    _, tokenizer = tiny_policy

    def fails_on_three(completions, **kwargs):
        return [1.0 / (completion[0]["content"] != "three") for completion in completions]

    with pytest.raises(RuntimeError, match=r"reward.functions.recorder raised ZeroDivisionError.*row 3 .*'three'"):
        _adapter(fails_on_three, tokenizer)(_dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id))


@pytest.mark.parametrize(
    ("values", "match"),
    [([1.0] * 7, "returned 7 rewards for 8 completions"), ([1.0] * 7 + [math.nan], "returned nan for row 7")],
)
def test_a_wrong_count_or_a_nan_stops_the_step_naming_the_function(tiny_policy, values, match):
    _, tokenizer = tiny_policy
    with pytest.raises(RuntimeError, match=f"reward.functions.recorder {match}"):
        _adapter(Recorder(values), tokenizer)(_dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id))


def test_the_trainer_state_moves_one_step_per_batch(tiny_policy):
    _, tokenizer = tiny_policy
    recorder = Recorder()
    function = _adapter(recorder, tokenizer, step=5)
    transform = Compose(
        score_sources([(RewardSource("f", "reward.functions.f", 1.0, "function"), function)]),
        TrainerStepCounter(function.trainer_state),
    )
    step = _dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id)
    for _ in range(2):
        transform._step(step, step.empty())
    assert [call["trainer_state"].global_step for call in recorder.calls] == [7, 7]  # the one shared state, moved
    assert function.trainer_state.global_step == 7


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_several_weighted_sources_give_trls_advantages(tiny_policy, tmp_path, aggregation):
    """Two functions, weights 1.0 and 0.5, one returning None for some completions: trl's own aggregation of the
    same values against the recipe's."""
    from recipes.grpo.loss import group_advantages

    _, tokenizer = tiny_policy
    first = [1.0, 0.0, 2.0, 0.5, 3.0, 3.0, 1.0, 0.0]
    second = [None, 1.0, 0.0, 1.0, 2.0, None, 1.0, 1.0]
    trainer = _trl_trainer(
        tiny_policy,
        tmp_path,
        [Recorder(first), Recorder(second)],
        reward_weights=[1.0, 0.5],
        multi_objective_aggregation=aggregation,
    )
    expected = _trl_scores(trainer, tokenizer, _completion_ids(tokenizer))["advantages"].float()
    values = _scored(tokenizer, Recorder(first), Recorder(second))
    weights = torch.tensor([1.0, 0.5])
    if aggregation == "normalize_then_sum":
        got = normalized_sum_advantages(values, weights, GROUP)
    else:
        got = group_advantages((values * weights).nansum(-1), GROUP, scale="group")
    torch.testing.assert_close(got, expected)


def _functions(functions: dict) -> dict:
    """``reward.functions`` as the recipes read it: checked and built by the schema (each entry a
    ``RewardFunctionNode``), as ``validate`` builds it."""
    return typed_config(functions, RewardFunctions, key="reward.functions")


def test_a_function_needing_a_column_the_data_lacks_is_refused_before_loading():
    node = {"acc": {"function": "recipes.tasks.arithmetic.exact_answer_reward"}}
    check_reward_functions(_functions(node), columns=["solution"])
    with pytest.raises(ConfigError, match=r"requires \['solution'\].*columns \['product'\]"):
        check_reward_functions(_functions(node), columns=["product"])


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"f": {"function": "no.such.module.fn"}}, r"reward.functions.f.function=no.such.module.fn cannot be loaded"),
        ({"f": {"function": "math.pi"}}, "is a float, not a function"),
        (
            {"f": {"function": "builtins.len", "wieght": 2}},
            r"reward.functions.f.wieght: .* Did you mean reward.functions.f.weight\? .* are \['function', 'weight'\]",
        ),
        ({"f": "trl.rewards.think_format_reward"}, r"reward.functions.f: expected \{function: "),
        (
            {"f": {"weight": 2}},
            r"reward.functions.f: expected \{function: .*got \{'weight': 2\}.* e.g. reward.functions.f.function=",
        ),
        ({"f": {"function": "trl.rewards.think_format_reward", "weight": "high"}}, "weight='high': expected a finite"),
        ({"f": {"function": "trl.rewards.think_format_reward", "weight": True}}, "weight=True: expected a finite"),
        ({"f": {"function": "trl.rewards.think_format_reward", "weight": math.inf}}, "weight=inf: not a finite"),
        ({"f": {"function": 3}}, r"reward.functions.f.function=3: expected a function's dotted path"),
        ({"f": {"function": "recipes.tasks.synthetic.oracle_score"}}, "requires"),
    ],
)
def test_bad_function_nodes_are_refused_naming_the_key(node, match):
    with pytest.raises(ConfigError, match=match):
        check_reward_functions(_functions(node), columns=[])


def test_trls_reward_helpers_work_unchanged(tiny_policy):
    """trl.rewards.think_format_reward (conversational completions) and get_soft_overlong_punishment (a factory,
    given as a _target_ node) as reward functions."""
    from hydra.utils import instantiate

    _, tokenizer = tiny_policy
    think = "<think>\nadding\n</think>\n7"
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (think, "7") * 4]
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    from trl.rewards import think_format_reward

    scores = _adapter(think_format_reward, tokenizer, prompts=conversations)(_dense_step(ids, tokenizer.pad_token_id))
    assert scores["score"].tolist() == [1.0, 0.0] * 4
    factory = {"_target_": "trl.rewards.get_soft_overlong_punishment", "max_completion_len": 4, "soft_punish_cache": 2}
    check_reward_functions(_functions({"overlong": {"function": factory}}), columns=[])
    overlong = instantiate(OmegaConf.create(factory))
    scores = _adapter(overlong, tokenizer)(_dense_step(ids, tokenizer.pad_token_id))["score"]
    expected = [overlong(completion_ids=[row])[0] for row in ids]
    assert scores.tolist() == pytest.approx(expected) and min(expected) < 0.0


def test_accuracy_reward_without_math_verify_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the math-verify package.*pip install -e '.\[math\]'"):
        check_reward_functions(_functions({"acc": {"function": "trl.rewards.accuracy_reward"}}), columns=["solution"])


def test_trls_message_list_helpers_run_in_the_grpo_recipe(compose_config, tmp_path):
    """trl.rewards.think_format_reward reads completion[0]["content"]: the recipe passes completions as trl does for
    its (chat-templated) prompts, as the trl recipe does, so trl's helpers run in both (it crashed at step 1)."""
    from _small_runs import GRPO_SMALL

    import recipes.grpo_torchrl_rm as recipe

    overrides = [
        *GRPO_SMALL,
        "train.steps=1",
        "+reward.functions.format={function:trl.rewards.think_format_reward,weight:0.5}",
        f"output_dir={tmp_path}",
    ]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    assert summary["rollout/rewards/format/mean_first"] == 0.0, "no <think> block in the tiny policy's reviews"


def test_a_reward_module_in_the_folder_the_run_starts_from_is_found(tmp_path, repo_root):
    """As trl users keep them: my_rewards.py beside where they run, no PYTHONPATH (a process started there). A
    misspelt module is refused naming the folder (the same command line in this process)."""
    import os
    import subprocess
    import sys

    from _in_process import run_script
    from _small_runs import GRPO_SMALL

    (tmp_path / "my_rewards.py").write_text(
        "def exact_match(completions, **kwargs):\n    return [float('great' in c[0]['content']) for c in completions]\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [sys.executable, str(repo_root / "recipes" / "grpo_torchrl_rm.py"), *GRPO_SMALL, "train.steps=1"]
    found = subprocess.run(
        [*command, "+reward.functions.mine.function=my_rewards.exact_match", f"hydra.run.dir={tmp_path / 'a'}"],
        cwd=tmp_path,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    missing = run_script(
        *command[1:],
        "+reward.functions.mine.function=my_reward.exact_match",
        f"hydra.run.dir={tmp_path / 'b'}",
        env={"HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
    )
    log = (tmp_path / "b" / "grpo_torchrl_rm.log").read_text()
    assert missing == 1 and f"no module my_reward in {tmp_path}" in log and "PYTHONPATH" in log


def test_log_metric_and_log_extra_are_kept_for_the_batch_and_a_short_column_is_refused(tiny_policy):
    """What a function hands trl's callbacks is kept (RewardLogs) until whoever reports the batch takes it; a column
    without one value per completion names the function (trl would misalign its completions table)."""
    _, tokenizer = tiny_policy

    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("calls", 1.0)
        log_extra("length", [len(c[0]["content"]) for c in completions])
        return [0.0] * len(completions)

    def short(completions, log_extra, **kwargs):
        log_extra("length", [1])
        return [0.0] * len(completions)

    step = _dense_step(_completion_ids(tokenizer), tokenizer.pad_token_id)
    adapter = _adapter(logs, tokenizer)
    adapter(step)
    metrics, columns = adapter.logs.pop()
    assert metrics == {"calls": [1.0]} and len(columns["length"]) == 2 * GROUP
    assert adapter.logs.pop() == ({}, {})
    with pytest.raises(RuntimeError, match=r"reward.functions.recorder logged 1 values of the column 'length'"):
        _adapter(short, tokenizer)(step)


def test_entries_are_built_into_typed_nodes_with_their_weights_as_written():
    """What the recipes read: a RewardFunctionNode per entry, its weight as written (0 stays 0, for the messages that
    quote it), trl's 1.0 where none is written, a _target_ node kept as a mapping for the resolver."""
    factory = {"_target_": "trl.rewards.get_soft_overlong_punishment", "max_completion_len": 4, "soft_punish_cache": 2}
    built = _functions(
        {"plain": {"function": "trl.rewards.think_format_reward"}, "off": {"function": factory, "weight": 0}}
    )
    assert built == {
        "plain": RewardFunctionNode("trl.rewards.think_format_reward", 1.0),
        "off": RewardFunctionNode(factory, 0),
    }
    assert type(built["off"].weight) is int and type(built["off"].function) is dict
