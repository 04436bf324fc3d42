"""recipes/grpo/rewards.py and rollout.py: the rewards of the dense prompt env (reward model and reward terms), the keys
they may read, and the batches the collector hands over."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModuleBase

from interop import HFRewardModelWrapper
from interop.sampling import CausalLMSampler, SamplingSettings
from recipes.common.chat import make_chat_env, make_policy, make_prompt_dataloader
from recipes.common.config import ConfigError
from recipes.common.prompts import PromptTable
from recipes.grpo.batch import BATCH_KEYS
from recipes.grpo.collector import build_prompt_collector
from recipes.grpo.prompt_env import PromptEnv
from recipes.grpo.rewards import (
    LengthPenalty,
    ResponseText,
    TextScoreReward,
    check_reward_keys,
    make_reward_transform,
    rollout_step_keys,
)
from recipes.tasks.synthetic import oracle_score, well_formed_score

PROMPTS = ["Review the mug.", "What do you think of the bike and of its color?"]
SMALL = ["rollout.group_size=2", "rollout.responses_per_step=4", "rollout.generation.max_new_tokens=8"]


@pytest.fixture(scope="module")
def other_rm(other_rm_dir):
    """A reward model with a tokenizer of its own, loaded."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return AutoModelForSequenceClassification.from_pretrained(other_rm_dir).eval(), AutoTokenizer.from_pretrained(
        other_rm_dir
    )


def _rollout_step(
    compose_settings, tiny_policy, reward_model, reward_tokenizer, reward_input, overrides=(), edit=lambda cfg: None
):
    """One step of PromptEnv + make_reward_transform + CausalLMSampler: the responses and their rewards (``edit``
    changes the typed settings first: what a config cannot hold, such as an infinite coefficient the schema refuses)."""
    cfg = compose_settings("grpo_torchrl_rm", [*SMALL, f"reward.input={reward_input}", *overrides])
    edit(cfg)
    model, tokenizer = tiny_policy
    table = PromptTable(PROMPTS, tokenizer=tokenizer)
    env = PromptEnv(table, tokenizer=tokenizer, group_size=2, num_prompts=2, shuffle=False)
    env = env.append_transform(make_reward_transform(cfg, reward_model, reward_tokenizer, tokenizer, prompts=table))
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=16, top_k=50))
    torch.manual_seed(0)
    step = env.step(policy(env.reset()))
    return step, table


def _alone(wrapper, key, value):
    """``wrapper`` scoring one sequence, conversation or text on its own (a batch of one)."""
    from tensordict import TensorDict

    from recipes.common.prompts import non_tensor_rows

    td = TensorDict(batch_size=[1])
    td.set(key, non_tensor_rows([value]))
    return wrapper(td)["reward"].item()


@pytest.mark.parametrize("reward_input", ["history", "text"])
def test_text_rewards_equal_each_conversation_scored_alone(compose_settings, tiny_policy, other_rm, reward_input):
    """Batched in the env, a reward model with its own tokenizer scores each response as it would score the
    conversation (``history``: its chat template) or the text (``text``: EOS appended) on its own."""
    reward_model, reward_tokenizer = other_rm
    step, table = _rollout_step(compose_settings, tiny_policy, reward_model, reward_tokenizer, reward_input)
    _, tokenizer = tiny_policy
    rewards = step["next", "reward"]
    assert rewards.shape == (4, 1, 1)
    width = step["tokens", "prompt"].shape[-1]
    for row in range(4):
        keep = step["masks", "all_attention_mask"][row, width:]
        response = step["tokens", "response"][row][keep].tolist()
        index = int(step["prompt_index"][row])
        if reward_input == "history":
            value = [
                {"role": "user", "content": PROMPTS[index]},
                {"role": "assistant", "content": tokenizer.decode(response, skip_special_tokens=True)},
            ]
            wrapper = HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, history_key="conversation")
            alone = _alone(wrapper, "conversation", value)
        else:
            value = table.rendered(index)[0] + tokenizer.decode(response)
            wrapper = HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, text_key="text")
            alone = _alone(wrapper, "text", value)
        torch.testing.assert_close(rewards[row].item(), alone, atol=1e-5, rtol=1e-5)
    assert rewards.std() > 0


def test_token_rewards_equal_each_sequence_scored_alone(compose_settings, tiny_policy):
    """A reward model sharing the policy's tokenizer reads its token ids directly, as each sequence alone."""
    from tensordict import TensorDict
    from transformers import AutoModelForSequenceClassification

    from recipes.common.config import PROJECT_ROOT

    model, tokenizer = tiny_policy
    reward_model = AutoModelForSequenceClassification.from_pretrained(PROJECT_ROOT / "tiny" / "reward_model").eval()
    step, _ = _rollout_step(compose_settings, tiny_policy, reward_model, tokenizer, "tokens")
    wrapper = HFRewardModelWrapper(reward_model)
    mask = step["masks", "all_attention_mask"]
    for row in range(4):
        sequence = step["tokens", "full"][row][mask[row]]
        alone = TensorDict(
            {"tokens": {"full": sequence[None]}, "masks": {"all_attention_mask": torch.ones_like(sequence)[None]}},
            batch_size=[1],
        )
        torch.testing.assert_close(
            step["next", "reward"][row].item(), wrapper(alone)["reward"].item(), atol=1e-5, rtol=1e-5
        )


def test_reward_terms_read_the_decoded_responses(compose_settings, tiny_policy):
    """``reward.terms`` that read text (TextScoreReward) get it decoded; LengthPenalty counts the dense rows."""

    class ConstantRewardModel(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.full((input_ids.shape[0], 1), -1.0)

    terms = [
        "+reward.terms.length={_target_:recipes.grpo.rewards.LengthPenalty,coefficient:0.25,free_tokens:2}",
        "+reward.terms.oracle={_target_:recipes.grpo.rewards.TextScoreReward,score:${data.oracle},weight:3.0,"
        "strip:['<|im_end|>']}",
    ]
    _, tokenizer = tiny_policy
    step, _ = _rollout_step(compose_settings, tiny_policy, ConstantRewardModel(), tokenizer, "tokens", terms)
    width = step["tokens", "prompt"].shape[-1]
    lengths = step["masks", "all_attention_mask"][:, width:].sum(-1)
    assert len(set(lengths.tolist())) > 1  # responses of different lengths, padded
    texts = [
        tokenizer.decode(row[:n], skip_special_tokens=True)
        for row, n in zip(step["tokens", "response"], lengths, strict=True)
    ]
    expected = [
        -1.0 - 0.25 * max(0, int(n) - 2) + 3.0 * well_formed_score(t) for n, t in zip(lengths, texts, strict=True)
    ]
    torch.testing.assert_close(step["next", "reward"].reshape(-1), torch.tensor(expected))
    # The decoded text never enters the rollout: the transforms scored a scratch copy.
    assert ("text", "response") not in step.keys(True)


class _ConstantRewardModel(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return torch.full((input_ids.shape[0], 1), 0.5)


def test_the_reward_transform_declares_the_reward_and_each_sources_values(compose_settings, tiny_policy):
    """One interop.RewardModelTransform over every source: the env declares ("next", "reward") ``batch + (1, 1)`` and
    ("next", "source_rewards") ``batch + (K,)``, in reward_sources order, and fills both."""
    length = "+reward.terms.length={_target_:recipes.grpo.rewards.LengthPenalty,coefficient:0.5,weight:2.0}"
    cfg = compose_settings("grpo_torchrl_rm", [*SMALL, "reward.input=tokens", length])
    model, tokenizer = tiny_policy
    table = PromptTable(PROMPTS, tokenizer=tokenizer)
    env = PromptEnv(table, tokenizer=tokenizer, group_size=2, num_prompts=2, shuffle=False)
    env = env.append_transform(make_reward_transform(cfg, _ConstantRewardModel(), tokenizer, tokenizer, prompts=table))
    assert env.full_reward_spec["reward"].shape == (4, 1, 1)
    assert env.full_observation_spec["source_rewards"].shape == (4, 2)
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=8, top_k=50))
    torch.manual_seed(0)
    step = env.step(policy(env.reset()))["next"]
    values = step["source_rewards"]
    assert (values[:, 0] == 0.5).all() and (values[:, 1] < 0).all()  # the reward model's score, then the term's
    torch.testing.assert_close(step["reward"].reshape(-1), values[:, 0] + 2.0 * values[:, 1])


def test_a_non_finite_term_stops_the_step_naming_its_setting(compose_settings, tiny_policy):
    _, tokenizer = tiny_policy
    length = ["+reward.terms.length={_target_:recipes.grpo.rewards.LengthPenalty,coefficient:1.0}"]

    def infinite(cfg):  # the schema refuses inf in a config: the term's own values must be caught as they are made
        cfg.reward.terms["length"]["coefficient"] = math.inf

    with pytest.raises(ValueError, match=r"the reward source 'reward.terms.length' returned non-finite rewards for"):
        _rollout_step(compose_settings, tiny_policy, _ConstantRewardModel(), tokenizer, "tokens", length, infinite)


def test_the_collector_hands_over_dense_batches_of_whole_groups(compose_settings, tmp_path):
    """``build_prompt_collector`` (what the background process runs): batches of BATCH_KEYS, flat, whole groups,
    from a prompt stream that continues where a resumed run stopped."""
    cfg = compose_settings("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", "reward_model=tiny_base"])
    collector, _ = build_prompt_collector(cfg, start_step=0, num_replicas=1, rank=0)
    batches = iter(collector)
    first, second = next(batches), next(batches)
    assert set(first.keys(True, True)) == {key if isinstance(key, str) else tuple(key) for key in BATCH_KEYS}
    assert first.batch_size == (4,) and first["next", "reward"].shape == (4, 1, 1)
    for batch in (first, second):
        assert (batch["prompt_index"].reshape(2, 2) == batch["prompt_index"][::2, None]).all()  # groups of 2
    collector.shutdown()
    resumed, _ = build_prompt_collector(cfg, start_step=1, num_replicas=1, rank=0)
    assert torch.equal(next(iter(resumed))["prompt_index"], second["prompt_index"])
    resumed.shutdown()


class _SeenKeys(TensorDictModuleBase):
    """A reward term that records the entries of the step it reads (everything: it declares no in_keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys, self.seen = [], ["seen"], None

    def forward(self, tensordict):
        self.seen = _entries(tensordict)
        tensordict.set("seen", torch.zeros(tensordict.batch_size))
        return tensordict


def _entries(tensordict) -> set[tuple]:
    """The entries of a step as a reward could point at them: leaves and whole chat histories, not their fields or
    TorchRL's padding metadata."""
    keys = {(key,) if isinstance(key, str) else key for key in tensordict.keys(True)}
    histories = {key for key in keys if type(tensordict.get(key)).__name__ == "History"}
    leaves = {key for key in keys if not any(other[: len(key)] == key and other != key for other in keys)}
    return {
        key
        for key in leaves | histories
        if not any(key[:n] in histories for n in range(1, len(key)))
        and type(tensordict.get(key)).__name__ != "MetaData"
    }


@pytest.mark.parametrize(
    ("env", "overrides"),
    [("prompt", []), ("chat", []), ("chat", ["+rollout.generation.return_log_probs=true"])],
)
def test_rollout_step_keys_are_what_a_step_holds(compose_settings, tiny_policy, env, overrides):
    """What check_reward_keys lists is what a reward transform finds: guards against TorchRL changing its layout."""
    from tensordict import set_list_to_stack

    from interop import RewardModelTransform

    set_list_to_stack(True).set()
    cfg = compose_settings("grpo_torchrl_rm", [*SMALL, f"rollout.env={env}", *overrides])
    model, tokenizer = tiny_policy
    spy = _SeenKeys()
    if env == "prompt":
        rollout_env = PromptEnv(PROMPTS, tokenizer=tokenizer, group_size=2).append_transform(RewardModelTransform(spy))
        policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings.from_mapping(cfg.rollout.generation))
        decoded = set(ResponseText.KEYS)  # written inside the transform, for the rewards that read them
    else:
        loader = make_prompt_dataloader(PROMPTS, seed=0)
        rollout_env = make_chat_env(loader, tokenizer=tokenizer, group_size=2, transforms=[RewardModelTransform(spy)])
        policy = make_policy(model, tokenizer, generation=cfg.rollout.generation)
        decoded = set()
    rollout_env.rollout(1, policy)
    assert spy.seen | decoded == set(rollout_step_keys(cfg))


@pytest.mark.parametrize("env", ["prompt", "chat"])
@pytest.mark.parametrize("reward_input", ["history", "text", "tokens"])
def test_the_default_reward_keys_are_held_by_both_rollouts(compose_settings, env, reward_input):
    check_reward_keys(compose_settings("grpo_torchrl_rm", [f"rollout.env={env}", f"reward.input={reward_input}"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # The prompt env decodes the full conversation only; TorchRL's chat env holds the prompt's too.
        (["reward.read_keys.history=[history,prompt]"], "reward.read_keys.history=[history, prompt]: a step of "),
        (["reward.input=text", "reward.read_keys.text=[text,ful]"], "reward.read_keys.text=[text, ful]"),
        (["reward.input=tokens", "reward.read_keys.tokens=full"], "reward.read_keys.tokens=[full]"),
        (
            ["reward.input=tokens", "rollout.env=chat", "reward.read_keys.attention_mask=[masks,prompt]"],
            "reward.read_keys.attention_mask=[masks, prompt]: a step of rollout.env=chat holds no such entry",
        ),
        (
            ["+reward.terms.length={_target_:recipes.grpo.rewards.LengthPenalty,coefficient:0.1,tokens_key:[reply]}"],
            "reward.terms.length.tokens_key=[reply]",
        ),
    ],
)
def test_a_key_the_rollout_does_not_hold_is_refused_listing_those_it_holds(compose_settings, overrides, message):
    cfg = compose_settings("grpo_torchrl_rm", overrides)
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        check_reward_keys(cfg)
    assert "[tokens, full], [masks, all_attention_mask]" in str(error.value)


def test_a_read_key_the_config_lacks_is_refused_by_the_schema(compose_settings):
    """Every read key is a setting the schema requires: a config without one is refused naming it, before the rewards'
    own checks (which read the typed settings, where every read key is set)."""
    with pytest.raises(ConfigError, match=re.escape("reward.read_keys.history is missing: grpo_torchrl_rm reads it")):
        compose_settings("grpo_torchrl_rm", ["~reward.read_keys.history"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.env=chat", "reward.read_keys.history=[history,prompt]"],  # the chat env holds it
        ["rollout.env=chat", "reward.input=text", "reward.read_keys.text=query"],  # a top-level key, as a name
        ["reward.input=history", "reward.read_keys.text=[nowhere]"],  # a key the chosen input does not read
        ["+reward.terms.length={_target_:recipes.grpo.rewards.LengthPenalty,coefficient:0.1,mask_key:null}"],
    ],
)
def test_keys_the_rollout_holds_pass(compose_settings, overrides):
    check_reward_keys(compose_settings("grpo_torchrl_rm", overrides))


def test_a_top_level_key_given_as_a_name_is_read_as_one(compose_settings, tiny_policy):
    """``reward.read_keys.text=query``: the key ``"query"``, not the nested key ``("q", "u", "e", "r", "y")``."""
    cfg = compose_settings("grpo_torchrl_rm", ["reward.input=text", "reward.read_keys.text=query"])
    _, tokenizer = tiny_policy
    transform = make_reward_transform(cfg, torch.nn.Identity(), tokenizer, tokenizer)
    assert transform[0].reward_modules["reward_model"].in_keys == ["query"]


GENERATION = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "do_sample": True}


class TestRewardTerms:
    def test_length_penalty_counts_tokens_beyond_the_free_ones(self):
        td = lazy_stack([TensorDict({"tokens": {"response": torch.tensor([5, 6, 0, 0])}}) for _ in range(2)])
        out = LengthPenalty(coefficient=0.5, free_tokens=1, pad_token_id=0)(td)
        assert out["length_penalty"].tolist() == [-0.5, -0.5]

    def test_terms_add_to_the_reward_model_score_in_the_env(self, tiny_policy):
        from interop import HFRewardModelWrapper, RewardModelTransform

        model, tokenizer = tiny_policy

        class ConstantRewardModel(torch.nn.Module):
            def forward(self, input_ids, attention_mask=None):
                return torch.full((input_ids.shape[0], 1), 2.0)

        transforms = [
            RewardModelTransform(HFRewardModelWrapper(ConstantRewardModel(), inference_mode=True)),
            RewardModelTransform(TextScoreReward(lambda text: 10.0 * oracle_score(text)), accumulate=True),
            RewardModelTransform(LengthPenalty(coefficient=0.1), accumulate=True),
        ]
        loader = make_prompt_dataloader(["Review the mug."], seed=0)
        env = make_chat_env(loader, tokenizer=tokenizer, group_size=4, transforms=transforms)
        assert env.full_reward_spec["reward"].shape == torch.Size([4, 1, 1])
        policy = make_policy(model, tokenizer, generation=GENERATION)
        torch.manual_seed(1)
        step = env.step(policy(env.reset()))
        texts = step.get(("text", "response")).tolist()
        lengths = [t.numel() for t in step.get(("tokens", "response"), as_list=True)]
        expected = [2.0 + 10.0 * oracle_score(t) - 0.1 * n for t, n in zip(texts, lengths, strict=True)]
        torch.testing.assert_close(step["next", "reward"].reshape(-1), torch.tensor(expected))
