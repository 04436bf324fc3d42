"""Round trip: ChatEnv + RewardModelTransform -> ragged TorchRL rollouts -> MCAdvantage -> GRPOLoss backward.

A tiny policy (its own tokenizer) answers prompts from a dataloader in a ``ChatEnv``; a reward model with another
tokenizer scores each answer through :class:`interop.RewardModelTransform`; an ``LLMCollector`` writes the rollouts
(per-sample tensors of different lengths, ``pad_output=False``) into a ``ReplayBuffer(LazyStackStorage)`` through
TorchRL's ``MCAdvantage``; TorchRL's ``GRPOLoss`` takes a backward step. Nothing in TorchRL is patched or reshaped.
"""

from __future__ import annotations

import pytest
import torch

from interop import HFRewardModelWrapper, RewardModelTransform

transformers = pytest.importorskip("transformers")
from _tiny_models import build_tokenizer, qwen2_config  # noqa: E402

GROUP = 4  # GRPO group size: completions per prompt


class PromptLoader:
    """What ``ChatEnv.from_dataloader`` expects: an endless iterator of ``{"query": [str]}`` with ``batch_size=1``."""

    batch_size = 1

    def __init__(self):
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return {"query": [f"what is {self.count} plus two?"]}


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    policy_tok = build_tokenizer(
        tmp_path_factory.mktemp("policy_tok"),
        ["Hello world, what is two plus two? It is four. 0123456789 plus minus."] * 20,
        vocab_size=320,
    )
    policy_tok.padding_side = "left"  # TorchRL's TransformersWrapper generates with left padding
    reward_tok = build_tokenizer(
        tmp_path_factory.mktemp("reward_tok"), ["what is the answer? good great fine bad awful."] * 20, vocab_size=270
    )
    torch.manual_seed(0)
    policy = transformers.Qwen2ForCausalLM(qwen2_config(policy_tok))
    with torch.no_grad():  # make EOS likely so that answers stop at different lengths (ragged rollouts)
        policy.lm_head.weight[policy_tok.eos_token_id] = torch.randn(32)
    reward_model = transformers.Qwen2ForSequenceClassification(qwen2_config(reward_tok, num_labels=1)).eval()
    return policy_tok, reward_tok, policy, reward_model


def make_env(kit, *transforms):
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    policy_tok = kit[0]
    env = ChatEnv.from_dataloader(
        dataloader=PromptLoader(), repeats=GROUP, batch_size=(GROUP,), tokenizer=policy_tok, input_mode="history"
    )
    env = env.append_transform(StepCounter(max_steps=1))  # single-turn
    for transform in transforms:
        env = env.append_transform(transform)
    return env


def make_generator(kit):
    from torchrl.modules.llm import TransformersWrapper

    policy_tok, _, policy, _ = kit
    return TransformersWrapper(
        policy,
        tokenizer=policy_tok,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 12, "do_sample": True},
    )


def manual_scores(kit, conversations):
    """What the reward model gives each conversation tokenized as trl.RewardTrainer does (its own template)."""
    _, reward_tok, _, reward_model = kit
    scores = []
    with torch.no_grad():
        for messages in conversations:
            ids = reward_tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            scores.append(reward_model(input_ids=torch.tensor([ids])).logits.view(()))
    return torch.stack(scores)


def test_transform_declares_spec_and_scores_each_step(kit):
    _, reward_tok, _, reward_model = kit
    from_root = RewardModelTransform(
        HFRewardModelWrapper(reward_model, tokenizer=reward_tok, history_key=("history", "full"))
    )
    # the same conversation read from the env's step output, where ChatEnv puts it as the next turn's prompt
    from_next = RewardModelTransform(
        HFRewardModelWrapper(reward_model, tokenizer=reward_tok, history_key=("history", "prompt")),
        reward_key="reward_from_next",
        read_from="next",
    )
    env = make_env(kit, from_root, from_next)
    assert env.full_reward_spec["reward"].shape == (GROUP, 1, 1)
    assert env.full_reward_spec["reward"].dtype == torch.float32
    assert "reward" in env.reward_keys

    torch.manual_seed(0)
    rollout = env.rollout(1, make_generator(kit)).squeeze(1)  # one step: drop the time dim
    reward = rollout.get(("next", "reward"))
    assert reward.shape == (GROUP, 1, 1) and reward.dtype == torch.float32
    lengths = [len(t) for t in rollout.get(("tokens", "full"), as_list=True)]
    assert len(set(lengths)) > 1, "precondition: ragged rollout"

    conversations = [
        [{"role": m["role"], "content": m["content"]} for m in h.tolist(tolist_first=True)]
        for h in rollout.get(("history", "full")).unbind(0)
    ]
    assert all([m["role"] for m in c] == ["user", "assistant"] for c in conversations)
    torch.testing.assert_close(reward.view(-1), manual_scores(kit, conversations), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rollout.get(("next", "reward_from_next")), reward)
    assert "reward" not in rollout.keys()  # the module's own output key does not leak into the rollout


# torchrl 0.14 warns that ChatEnv lacks an InitTracker the policy does not need here
@pytest.mark.filterwarnings("ignore:The env passed to LLMCollector:FutureWarning")
def test_grpo_loss_backward_on_scored_ragged_rollouts(kit):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss, MCAdvantage

    policy_tok, reward_tok, policy, reward_model = kit
    env = make_env(
        kit,
        RewardModelTransform(HFRewardModelWrapper(reward_model, tokenizer=reward_tok, history_key=("history", "full"))),
    )
    # the learner re-reads the generated tokens: input_mode="tokens" so it sees exactly what was sampled
    learner = TransformersWrapper(
        policy, tokenizer=policy_tok, input_mode="tokens", generate=False, return_log_probs=True, pad_output=False
    )

    def recompute_old_log_probs(data):
        # generation leaves ("log_probs", "full") empty; GRPOLoss needs the old log-probs of the full sequence
        with torch.no_grad():
            for sample in data.unbind(0):
                out = learner(sample.select(("tokens", "full"), ("masks", "all_attention_mask")).copy())
                sample.set(("log_probs", "full"), out.get(("log_probs", "full")))
        return data

    rb = ReplayBuffer(storage=LazyStackStorage(4 * GROUP), batch_size=GROUP)
    rb.append_transform(MCAdvantage(grpo_size=GROUP))
    collector = LLMCollector(
        env,
        policy=make_generator(kit),
        dialog_turns_per_batch=GROUP,
        total_dialog_turns=2 * GROUP,
        replay_buffer=rb,
        postproc=recompute_old_log_probs,
    )
    torch.manual_seed(0)
    for _ in collector:
        pass
    assert len(rb) == 2 * GROUP

    stored = rb[:]
    reward = stored.get(("next", "reward"))
    advantage = stored.get("advantage")
    assert reward.shape == advantage.shape == (2 * GROUP, 1, 1)
    for group in range(2):  # MCAdvantage normalised each prompt's group of rewards
        r = reward[group * GROUP : (group + 1) * GROUP].view(-1)
        assert len(set(stored[group * GROUP : (group + 1) * GROUP].get("query").tolist())) == 1
        expected = (r - r.mean()) / r.std().clamp_min(1e-6)
        torch.testing.assert_close(advantage[group * GROUP : (group + 1) * GROUP].view(-1), expected)
    assert advantage.abs().sum() > 0  # the reward model tells the completions apart

    assert len({len(t) for t in stored.get(("tokens", "full"), as_list=True)}) > 1, "precondition: ragged rollouts"

    batch = rb.sample(GROUP)

    loss_fn = GRPOLoss(learner, clip_epsilon=0.2, masking_strategy="sft")
    policy.zero_grad()
    losses = loss_fn(batch)
    total = sum(value for key, value in losses.items() if key.startswith("loss_"))
    assert torch.isfinite(total)
    total.backward()
    grad_norm = sum(p.grad.abs().sum() for p in policy.parameters() if p.grad is not None)
    assert grad_norm > 0
