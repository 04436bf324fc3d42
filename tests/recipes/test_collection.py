"""recipes/common/collection.py: the rewards of the dense prompt env, and the batches its collector hands over."""

from __future__ import annotations

import pytest
import torch

from interop import HFRewardModelWrapper
from recipes.common.collection import BATCH_KEYS, build_prompt_collector, make_reward_transforms
from recipes.common.prompt_env import PromptEnv, PromptTable
from recipes.common.sampling import SamplingPolicy, SamplingSettings

PROMPTS = ["Review the mug.", "What do you think of the bike and of its color?"]
SMALL = ["rollout.group_size=2", "rollout.responses_per_step=4", "rollout.generation.max_new_tokens=8"]


@pytest.fixture(scope="module")
def other_rm(other_rm_dir):
    """A reward model with a tokenizer of its own, loaded."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return AutoModelForSequenceClassification.from_pretrained(other_rm_dir).eval(), AutoTokenizer.from_pretrained(
        other_rm_dir
    )


def _rollout_step(compose_config, tiny_policy, reward_model, reward_tokenizer, reward_input, overrides=()):
    """One step of PromptEnv + make_reward_transforms + SamplingPolicy: the responses and their rewards."""
    cfg = compose_config("grpo_torchrl_rm", [*SMALL, f"reward.input={reward_input}", *overrides])
    model, tokenizer = tiny_policy
    table = PromptTable(PROMPTS, tokenizer=tokenizer)
    env = PromptEnv(table, tokenizer=tokenizer, group_size=2, num_prompts=2, shuffle=False)
    for transform in make_reward_transforms(cfg, reward_model, reward_tokenizer, tokenizer, prompts=table):
        env = env.append_transform(transform)
    policy = SamplingPolicy(model, tokenizer, settings=SamplingSettings(max_new_tokens=16, top_k=50))
    torch.manual_seed(0)
    step = env.step(policy(env.reset()))
    return step, table


def _alone(wrapper, key, value):
    """``wrapper`` scoring one sequence, conversation or text on its own (a batch of one)."""
    from tensordict import TensorDict

    from recipes.common.prompt_env import non_tensor_rows

    td = TensorDict(batch_size=[1])
    td.set(key, non_tensor_rows([value]))
    return wrapper(td)["reward"].item()


@pytest.mark.parametrize("reward_input", ["history", "text"])
def test_text_rewards_equal_each_conversation_scored_alone(compose_config, tiny_policy, other_rm, reward_input):
    """Batched in the env, a reward model with its own tokenizer scores each response as it would score the
    conversation (``history``: its chat template) or the text (``text``: EOS appended) on its own."""
    reward_model, reward_tokenizer = other_rm
    step, table = _rollout_step(compose_config, tiny_policy, reward_model, reward_tokenizer, reward_input)
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


def test_token_rewards_equal_each_sequence_scored_alone(compose_config, tiny_policy):
    """A reward model sharing the policy's tokenizer reads its token ids directly, as each sequence alone."""
    from tensordict import TensorDict
    from transformers import AutoModelForSequenceClassification

    from recipes.common.config import PROJECT_ROOT

    model, tokenizer = tiny_policy
    reward_model = AutoModelForSequenceClassification.from_pretrained(PROJECT_ROOT / "tiny" / "reward_model").eval()
    step, _ = _rollout_step(compose_config, tiny_policy, reward_model, tokenizer, "tokens")
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


def test_reward_terms_read_the_decoded_responses(compose_config, tiny_policy):
    """``reward.terms`` that read text (TextScoreReward) get it decoded; LengthPenalty counts the dense rows."""
    from recipes.common.synthetic import oracle_score

    class ConstantRewardModel(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.full((input_ids.shape[0], 1), -1.0)

    terms = [
        "+reward.terms.length={_target_:recipes.common.rollout.LengthPenalty,coefficient:0.25,free_tokens:2}",
        "+reward.terms.oracle={_target_:recipes.common.rollout.TextScoreReward,score:${data.oracle},weight:3.0,"
        "strip:['<|im_end|>']}",
    ]
    _, tokenizer = tiny_policy
    step, _ = _rollout_step(compose_config, tiny_policy, ConstantRewardModel(), tokenizer, "tokens", terms)
    width = step["tokens", "prompt"].shape[-1]
    lengths = step["masks", "all_attention_mask"][:, width:].sum(-1)
    assert len(set(lengths.tolist())) > 1  # responses of different lengths, padded
    texts = [
        tokenizer.decode(row[:n], skip_special_tokens=True)
        for row, n in zip(step["tokens", "response"], lengths, strict=True)
    ]
    expected = [-1.0 - 0.25 * max(0, int(n) - 2) + 3.0 * oracle_score(t) for n, t in zip(lengths, texts, strict=True)]
    torch.testing.assert_close(step["next", "reward"].reshape(-1), torch.tensor(expected))
    # The decoded text never enters the rollout: the transforms scored a scratch copy.
    assert ("text", "response") not in step.keys(True)


def test_the_collector_hands_over_dense_batches_of_whole_groups(compose_config, tmp_path):
    """``build_prompt_collector`` (what the background process runs): batches of BATCH_KEYS, flat, whole groups,
    from a prompt stream that continues where a resumed run stopped."""
    from omegaconf import OmegaConf

    from recipes.common.config import run_config

    cfg = compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", "reward_model=tiny_base"])
    config = OmegaConf.to_container(run_config(cfg), resolve=True)
    collector, _ = build_prompt_collector(config, start_step=0, num_replicas=1, rank=0)
    batches = iter(collector)
    first, second = next(batches), next(batches)
    assert set(first.keys(True, True)) == {key if isinstance(key, str) else tuple(key) for key in BATCH_KEYS}
    assert first.batch_size == (4,) and first["next", "reward"].shape == (4, 1, 1)
    for batch in (first, second):
        assert (batch["prompt_index"].reshape(2, 2) == batch["prompt_index"][::2, None]).all()  # groups of 2
    collector.shutdown()
    resumed, _ = build_prompt_collector(config, start_step=1, num_replicas=1, rank=0)
    assert torch.equal(next(iter(resumed))["prompt_index"], second["prompt_index"])
    resumed.shutdown()
