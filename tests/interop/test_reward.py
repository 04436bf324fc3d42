"""Tests of :class:`interop.HFRewardModelWrapper` and :class:`interop.RewardModelTransform` (one reward module, or
several named and weighted sources, in a toy env and on stored transitions).

Everything runs offline on tiny models built here: tokenizers are trained in memory and saved to a temporary folder,
reward models are random or trained for a few steps by ``trl.RewardTrainer``.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.utils import check_env_specs

from interop.reward import HFRewardModelWrapper, RewardModelTransform

transformers = pytest.importorskip("transformers")
from _tiny_models import ToyRewardModel, build_tokenizer, qwen2_config  # noqa: E402

WORDS = "what is the answer question good great fine bad awful poor two plus four hello world".split()


def reward_model(tok, seed=0):
    torch.manual_seed(seed)
    return transformers.Qwen2ForSequenceClassification(qwen2_config(tok, num_labels=1)).eval()


def score_alone(model, ids):
    """The model's score of one sequence, no padding at all."""
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids).view(1, -1)).logits.view(()).float()


def ragged_tokens(seqs):
    """The layout of ``TransformersWrapper(pad_output=False)``: a lazy stack of per-sample tensors of their length."""
    return lazy_stack(
        [
            TensorDict(
                {
                    "tokens": {"full": torch.as_tensor(s)},
                    "masks": {"all_attention_mask": torch.ones(len(s), dtype=bool)},
                }
            )
            for s in seqs
        ]
    )


@pytest.fixture(scope="module")
def rm_tok(tmp_path_factory):
    corpus = [" ".join(WORDS)] * 20 + ["The quick brown fox jumps over the lazy dog, twice."] * 5
    return build_tokenizer(tmp_path_factory.mktemp("rm_tok"), corpus, vocab_size=280)


@pytest.fixture(scope="module")
def policy_tok(tmp_path_factory):
    # another vocabulary (other merges, more ids): the policy's ids mean nothing to the reward model
    corpus = ["Hello world, what is two plus two? It is four. Lorem ipsum dolor sit amet 0123456789."] * 20
    return build_tokenizer(tmp_path_factory.mktemp("policy_tok"), corpus, vocab_size=400)


@pytest.fixture(scope="module")
def rm(rm_tok):
    return reward_model(rm_tok)


# ---------------------------------------------------------------- tutorial parity


def _tutorial_batch(b, seq_len, nested=True):
    if nested:
        return TensorDict(
            {
                "tokens": TensorDict({"full": torch.randint(0, 1000, (b, seq_len))}, batch_size=[b]),
                "masks": TensorDict({"all_attention_mask": torch.ones(b, seq_len, dtype=torch.long)}, batch_size=[b]),
            },
            batch_size=[b],
        )
    return TensorDict(
        {
            "input_ids": torch.randint(0, 1000, (b, seq_len)),
            "attention_mask": torch.ones(b, seq_len, dtype=torch.long),
        },
        batch_size=[b],
    )


def test_tutorial_part2_default_and_custom_keys():
    """TorchRL tutorial, part 2 (steps 2-4), with only the import changed; values equal the reference's."""
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as ReferenceWrapper

    seq_len, b = 16, 4
    toy = ToyRewardModel(seq_len)
    reward_fn = HFRewardModelWrapper(
        toy,
        token_key=("tokens", "full"),
        attention_mask_key=("masks", "all_attention_mask"),
        reward_key="reward",
        inference_mode=True,
    )
    assert ("tokens", "full") in reward_fn.in_keys
    assert "reward" in reward_fn.out_keys

    td = _tutorial_batch(b, seq_len)
    result = reward_fn(td)
    assert result is td
    assert result["reward"].shape == torch.Size([b])
    assert result["reward"].dtype == torch.float32
    reference = ReferenceWrapper(toy, inference_mode=True)(td.clone().exclude("reward"))["reward"]
    torch.testing.assert_close(result["reward"], reference)

    reward_fn_custom = HFRewardModelWrapper(
        toy,
        token_key="input_ids",
        attention_mask_key="attention_mask",
        reward_key=("reward", "value"),
        inference_mode=True,
    )
    td2 = _tutorial_batch(b, seq_len, nested=False)
    result2 = reward_fn_custom(td2)
    assert result2.get(("reward", "value")).shape == torch.Size([b])
    torch.testing.assert_close(
        result2.get(("reward", "value")),
        toy(td2["input_ids"], td2["attention_mask"]).logits.squeeze(-1).detach(),
    )

    # part 4, step 3: the canonical TorchRL layout, scored with the defaults
    reward_fn_e2e = HFRewardModelWrapper(toy, reward_key="reward", inference_mode=True)
    scored = reward_fn_e2e(_tutorial_batch(4, seq_len))
    assert scored["reward"].shape == torch.Size([4]) and scored["reward"].dtype == torch.float32


def test_tutorial_part3_composition_with_dataset():
    """TorchRL tutorial, part 3: buffer -> dataset -> re-batched TensorDict -> reward wrapper."""
    from torchrl.data import ListStorage, ReplayBuffer

    from interop import TorchRLBufferDataset

    seq_len = 16
    rb_rt = ReplayBuffer(storage=ListStorage(max_size=200), batch_size=8)
    for _ in range(20):
        rb_rt.add(
            TensorDict(
                {
                    "tokens": TensorDict({"full": torch.randint(0, 1000, (seq_len,))}, batch_size=[]),
                    "masks": TensorDict({"all_attention_mask": torch.ones(seq_len, dtype=torch.long)}, batch_size=[]),
                },
                batch_size=[],
            )
        )
    ds_rt = TorchRLBufferDataset(rb_rt, batch_size=8, keys=[("tokens", "full"), ("masks", "all_attention_mask")])
    samples_rt = list(ds_rt)
    batch_ids = torch.stack([s["tokens.full"] for s in samples_rt])
    batch_mask = torch.stack([s["masks.all_attention_mask"] for s in samples_rt])
    td_rt = TensorDict(
        {
            "tokens": TensorDict({"full": batch_ids}, batch_size=[8]),
            "masks": TensorDict({"all_attention_mask": batch_mask}, batch_size=[8]),
        },
        batch_size=[8],
    )
    toy = ToyRewardModel(seq_len)
    result_rt = HFRewardModelWrapper(toy, inference_mode=True)(td_rt)
    assert result_rt["reward"].shape == torch.Size([8])
    torch.testing.assert_close(result_rt["reward"], toy(batch_ids, batch_mask).logits.squeeze(-1).detach())


# ---------------------------------------------------------------- ragged batches


def test_ragged_rollout_from_transformers_wrapper(rm_tok):
    """A real ``TransformersWrapper(pad_output=False)`` rollout: the reference crashes, ours scores each sample as if
    it were alone."""
    from torchrl.data.llm import History
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies import ChatHistory
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as ReferenceWrapper

    torch.manual_seed(1)
    policy = transformers.Qwen2ForCausalLM(qwen2_config(rm_tok)).eval()
    with torch.no_grad():  # make EOS likely so that generations stop at different lengths
        policy.lm_head.weight[rm_tok.eos_token_id] = torch.randn(32) * 2
    left_tok = copy.deepcopy(rm_tok)  # generation needs left padding (the module's tokenizer stays as it is)
    left_tok.padding_side = "left"
    generator = TransformersWrapper(
        policy,
        tokenizer=left_tok,
        input_mode="history",
        generate=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 10, "do_sample": True},
    )
    prompts = History.from_chats([[{"role": "user", "content": f"what is {i} plus two?"}] for i in range(6)])
    rollout = generator(TensorDict(history=ChatHistory(prompt=prompts), batch_size=(6,)))
    seqs = rollout.get(("tokens", "full"), as_list=True)
    assert len({len(s) for s in seqs}) > 1, "precondition: the rollout must be ragged"

    with pytest.raises(RuntimeError, match="Failed to stack"):
        ReferenceWrapper(reward_model(rm_tok), inference_mode=True)(rollout)

    model = reward_model(rm_tok)
    reward = HFRewardModelWrapper(model, inference_mode=True)(rollout)["reward"]
    assert reward.shape == (6,) and reward.dtype == torch.float32
    torch.testing.assert_close(reward, torch.stack([score_alone(model, s) for s in seqs]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_ragged_padding_side_invariance_rope(rm, padding_side):
    """Qwen2 (RoPE) scores do not depend on the padding side: both equal the unpadded per-sample score."""
    seqs = [[5, 17, 30, 2], [8, 9, 2], [40, 41, 42, 43, 44, 45, 2], [7, 2]]
    td = ragged_tokens(seqs)
    reward = HFRewardModelWrapper(rm, inference_mode=True, padding_side=padding_side)(td)["reward"]
    torch.testing.assert_close(reward, torch.stack([score_alone(rm, s) for s in seqs]), atol=1e-5, rtol=1e-5)


def test_ragged_padding_uses_model_pad_id_and_mask(rm_tok):
    """The padded batch the model receives: the model's pad id on the chosen side, a mask of the real tokens."""
    seen = {}

    class Recorder(torch.nn.Module):
        config = transformers.PretrainedConfig(pad_token_id=rm_tok.pad_token_id)

        def forward(self, input_ids, attention_mask):
            seen["ids"], seen["mask"] = input_ids, attention_mask
            return attention_mask.sum(-1, keepdim=True).float()

    td = ragged_tokens([[5, 6, 7], [8]])
    reward = HFRewardModelWrapper(Recorder())(td)["reward"]
    pad = rm_tok.pad_token_id
    assert seen["ids"].tolist() == [[5, 6, 7], [8, pad, pad]]
    assert seen["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert reward.tolist() == [3.0, 1.0]
    HFRewardModelWrapper(Recorder(), padding_side="left")(td)
    assert seen["ids"].tolist() == [[5, 6, 7], [pad, pad, 8]]
    assert seen["mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_multi_dim_batch(rm):
    """A ``[2, 3]`` tensordict is scored as 6 sequences and the reward takes the ``[2, 3]`` shape."""
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (2, 3, 7))
    td = TensorDict({"tokens": {"full": ids}, "masks": {"all_attention_mask": torch.ones(2, 3, 7)}}, batch_size=[2, 3])
    reward = HFRewardModelWrapper(rm, inference_mode=True)(td)["reward"]
    assert reward.shape == (2, 3)
    torch.testing.assert_close(reward[1, 2], score_alone(rm, ids[1, 2]), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- tokenizer mismatch


def test_tokenizer_mismatch_scores_text_with_reward_tokenizer(rm, rm_tok, policy_tok):
    texts = ["what is two plus two? four", "hello world, the answer is good"]
    policy_ids = [torch.tensor(policy_tok(t)["input_ids"] + [len(policy_tok) - 1]) for t in texts]
    td = lazy_stack(
        [
            TensorDict(
                {
                    "text": {"full": t},
                    "tokens": {"full": ids},
                    "masks": {"all_attention_mask": torch.ones(len(ids), dtype=bool)},
                }
            )
            for t, ids in zip(texts, policy_ids, strict=True)
        ]
    )
    # the policy's ids index past the reward model's embedding table: feeding them is an error, not a score
    assert max(int(ids.max()) for ids in policy_ids) >= rm.config.vocab_size
    with pytest.raises(IndexError):
        HFRewardModelWrapper(rm, inference_mode=True)(td.copy())

    wrapper = HFRewardModelWrapper(rm, tokenizer=rm_tok, inference_mode=True)
    assert wrapper.in_keys == [("text", "full")]
    reward = wrapper(td)["reward"]
    # the manual score: RewardTrainer's plain-text convention, EOS string appended, tokenized with special tokens
    manual = torch.stack([score_alone(rm, rm_tok(t + rm_tok.eos_token)["input_ids"]) for t in texts])
    torch.testing.assert_close(reward, manual, atol=1e-5, rtol=1e-5)

    # a text already ending with EOS is not given a second one
    td_eos = TensorDict({"text": {"full": [t + rm_tok.eos_token for t in texts]}}, batch_size=[2])
    torch.testing.assert_close(wrapper(td_eos)["reward"], manual, atol=1e-5, rtol=1e-5)


def test_history_rendering_with_reward_chat_template(rm, rm_tok):
    """``history_key`` renders each conversation with the reward tokenizer's own template; ragged stacks and
    torchrl's ``"<none>"`` placeholder messages are handled."""
    from torchrl.data.llm import History

    chats = [
        [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four"}],
        [
            {"role": "system", "content": "be good"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hello world"},
        ],
    ]
    history = History.from_chats(chats)
    td = TensorDict({"history": {"full": history}}, batch_size=[2])
    wrapper = HFRewardModelWrapper(rm, tokenizer=rm_tok, history_key=("history", "full"), inference_mode=True)
    reward = wrapper(td)["reward"]
    manual = torch.stack(
        [score_alone(rm, rm_tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in chats]
    )
    torch.testing.assert_close(reward, manual, atol=1e-5, rtol=1e-5)

    padded = History(
        role=["user", "assistant", "<none>"], content=["what is two plus two?", "four", ""], batch_size=(3,)
    )
    td_none = TensorDict({"history": {"full": lazy_stack([padded, history[1]])}}, batch_size=[2])
    torch.testing.assert_close(wrapper(td_none)["reward"], manual, atol=1e-5, rtol=1e-5)

    # The same conversations as plain message lists, one per sample (no History built), of different lengths.
    td_lists = TensorDict(batch_size=[2])
    td_lists.set(("history", "full"), NonTensorStack(*[NonTensorData(chat) for chat in chats]))
    torch.testing.assert_close(wrapper(td_lists)["reward"], manual, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- RewardTrainer


def _train_with_reward_trainer(tok, rows, tmp_path):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    model = reward_model(tok, seed=0)
    args = RewardConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    trained = trainer.model.eval()
    _assert_learned(trained, trainer.train_dataset)
    return trained, trainer.train_dataset


def _assert_learned(model, processed) -> None:
    """Every one of the 24 training pairs ranked right, by a mean margin of at least 1.0. An untrained head ranks all
    of them right on some seeds (every chosen answer shares its words: 1.0 on seeds 1 and 2, 0.96 on 3, 0.29 on 0),
    so ranking alone says nothing; its mean margin is below 0.015 on seeds 0-3, the trained one's 1.86-2.20 (text and
    conversational data, 12 steps, measured 2026-12-06)."""
    chosen = torch.stack([score_alone(model, ids) for ids in processed["chosen_ids"]])
    rejected = torch.stack([score_alone(model, ids) for ids in processed["rejected_ids"]])
    assert bool((chosen > rejected).all()), f"RewardTrainer did not learn the ranking: {chosen - rejected}"
    assert float((chosen - rejected).mean()) >= 1.0, f"RewardTrainer barely learned: {chosen - rejected}"


def _preference_rows(conversational):
    rng = random.Random(0)
    rows = []
    for i in range(24):
        prompt, good, bad = f"what is the answer {i}?", rng.choice(["good", "great"]), rng.choice(["bad", "awful"])
        if conversational:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": f"the answer is {good}"}],
                    "rejected": [{"role": "assistant", "content": f"the answer is {bad}"}],
                }
            )
        else:
            rows.append({"prompt": prompt, "chosen": f" the answer is {good}", "rejected": f" the answer is {bad}"})
    return rows


def _trained_on_preferences(tok, tmp_path, *, conversational: bool, n: int):
    """A reward model trained by RewardTrainer, ``n`` chosen then ``n`` rejected sequences (text or messages) of its
    training data, and the token ids RewardTrainer trained on for each."""
    rows = _preference_rows(conversational=conversational)
    model, processed = _train_with_reward_trainer(tok, rows, tmp_path)
    sequences = [r["prompt"] + r["chosen"] for r in rows[:n]] + [r["prompt"] + r["rejected"] for r in rows[:n]]
    trained_ids = list(processed["chosen_ids"][:n]) + list(processed["rejected_ids"][:n])
    return model, sequences, trained_ids


def test_reward_trainer_equality_plain_text(rm_tok, tmp_path):
    """Text scored by the wrapper gets exactly the score of the ids RewardTrainer trained on."""
    n = 8
    model, texts, trained_ids = _trained_on_preferences(rm_tok, tmp_path, conversational=False, n=n)
    td = TensorDict({"text": {"full": texts}}, batch_size=[2 * n])
    reward = HFRewardModelWrapper(model, tokenizer=rm_tok, inference_mode=True)(td)["reward"]
    expected = torch.stack([score_alone(model, ids) for ids in trained_ids])
    torch.testing.assert_close(reward, expected, atol=1e-5, rtol=1e-5)
    assert float((reward[:n] - reward[n:]).min()) > 0 and float((reward[:n] - reward[n:]).mean()) >= 1.0  # learned


def test_reward_trainer_equality_conversational(rm_tok, tmp_path):
    """A torchrl History scored through ``history_key`` gets the score of RewardTrainer's chat-template ids."""
    from torchrl.data.llm import History

    n = 8
    model, chats, trained_ids = _trained_on_preferences(rm_tok, tmp_path, conversational=True, n=n)
    td = TensorDict({"history": {"full": History.from_chats(chats)}}, batch_size=[2 * n])
    wrapper = HFRewardModelWrapper(model, tokenizer=rm_tok, history_key=("history", "full"), inference_mode=True)
    reward = wrapper(td)["reward"]
    expected = torch.stack([score_alone(model, ids) for ids in trained_ids])
    torch.testing.assert_close(reward, expected, atol=1e-5, rtol=1e-5)
    assert (reward[:n] > reward[n:]).float().mean() > 0.5


# ---------------------------------------------------------------- memory, dtype


@pytest.fixture
def _batch_recorder():
    """``shapes = _batch_recorder(model)``: the input_ids shape of every forward call of ``model`` during the test."""
    handles = []

    def record(model):
        shapes = []
        hook = lambda module, args, kwargs: shapes.append(kwargs["input_ids"].shape)
        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        return shapes

    yield record
    for handle in handles:  # the module-scoped model must not keep recording into later tests
        handle.remove()


def test_micro_batching_equals_one_shot(rm_tok, _batch_recorder):
    model = reward_model(rm_tok)
    shapes = _batch_recorder(model)
    seqs = [list(range(3, 3 + n)) + [rm_tok.eos_token_id] for n in (4, 9, 2, 7, 5)]
    one_shot = HFRewardModelWrapper(model, inference_mode=True)(ragged_tokens(seqs))["reward"]
    assert [s[0] for s in shapes] == [5]
    shapes.clear()
    chunked = HFRewardModelWrapper(model, inference_mode=True, micro_batch_size=2)(ragged_tokens(seqs))["reward"]
    # chunks of at most 2, each padded to its own longest sequence
    assert [tuple(s) for s in shapes] == [(2, 10), (2, 8), (1, 6)]
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    # dense input too
    dense = TensorDict({"tokens": {"full": torch.randint(3, 200, (5, 6))}}, batch_size=[5])
    full = HFRewardModelWrapper(model, attention_mask_key=None, inference_mode=True)(dense.clone())["reward"]
    part = HFRewardModelWrapper(model, attention_mask_key=None, inference_mode=True, micro_batch_size=3)(dense)
    torch.testing.assert_close(part["reward"], full, atol=1e-5, rtol=1e-5)


def test_max_length_truncation(rm, rm_tok, _batch_recorder):
    shapes = _batch_recorder(rm)
    seqs = [list(range(3, 15)), list(range(20, 25))]
    reward = HFRewardModelWrapper(rm, inference_mode=True, max_length=8)(ragged_tokens(seqs))["reward"]
    assert shapes[-1][-1] == 8
    torch.testing.assert_close(reward, torch.stack([score_alone(rm, s[:8]) for s in seqs]), atol=1e-5, rtol=1e-5)
    # dense input longer than max_length is truncated too
    dense = TensorDict({"tokens": {"full": torch.tensor([list(range(3, 15))])}}, batch_size=[1])
    out = HFRewardModelWrapper(rm, attention_mask_key=None, inference_mode=True, max_length=8)(dense)["reward"]
    torch.testing.assert_close(out, score_alone(rm, list(range(3, 11))).view(1), atol=1e-5, rtol=1e-5)
    # with a tokenizer, its truncation_side decides which end is kept
    text = "what is the answer question good great fine bad awful poor two plus four"
    ids = rm_tok(text + rm_tok.eos_token)["input_ids"]
    assert len(ids) > 6
    rm_tok.truncation_side = "left"
    try:
        wrapper = HFRewardModelWrapper(rm, tokenizer=rm_tok, inference_mode=True, max_length=6)
        out = wrapper(TensorDict({"text": {"full": [text]}}, batch_size=[1]))["reward"]
    finally:
        rm_tok.truncation_side = "right"
    torch.testing.assert_close(out, score_alone(rm, ids[-6:]).view(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_max_length_keeps_each_padded_rows_own_real_tokens(rm, side):
    """A dense row of 22 real tokens among padding: max_length keeps the first 12 of its real tokens, wherever its
    padding is (cutting columns would keep pads and lose real tokens on a left-padded row)."""
    rows = [list(range(3, 25)), list(range(30, 36))]
    width = 26
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for i, row in enumerate(rows):
        place = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, place], mask[i, place] = torch.tensor(row), True
    dense = TensorDict({"tokens": {"full": ids}, "masks": {"all_attention_mask": mask}}, batch_size=[2])
    out = HFRewardModelWrapper(rm, inference_mode=True, max_length=12)(dense)["reward"]
    expected = torch.stack([score_alone(rm, row[:12]) for row in rows])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_check_finite_names_the_model_and_the_rows():
    class HalfBroken(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.tensor([[1.0], [float("nan")], [float("inf")]])

    dense = TensorDict({"tokens": {"full": torch.ones(3, 4, dtype=torch.long)}}, batch_size=[3])
    reward = HFRewardModelWrapper(HalfBroken(), attention_mask_key=None, inference_mode=True)(dense.clone())["reward"]
    assert torch.isnan(reward[1])  # off by default: the library call of TorchRL's wrapper
    checked = HFRewardModelWrapper(HalfBroken(), attention_mask_key=None, inference_mode=True, check_finite=True)
    with pytest.raises(
        ValueError, match=r"the reward model 'HalfBroken' gave 2 non-finite reward\(s\) \(rows \[1, 2\]"
    ):
        checked(dense)


def test_bf16_model_gives_float32_reward(rm_tok):
    """The bf16 model's rewards, in float32, are the float32 model's within bf16's precision. The tiny head scores
    about 0.0075 and -0.0046, where an absolute tolerance of 0.05 would pass 0 or the wrong sign: the head is scaled
    so that every reward is at least 1 in size, and compared relatively: within 10% (bf16 rounds each activation to
    ~0.4%, and the head's output is a sum of terms that partly cancel: 5.7% off measured here)."""
    model32 = reward_model(rm_tok)
    seqs = [[5, 6, 7, 2], [8, 9, 2]]
    r32 = HFRewardModelWrapper(model32, inference_mode=True)(ragged_tokens(seqs))["reward"]
    with torch.no_grad():
        model32.score.weight.mul_(2.0 / float(r32.abs().min()))
    r32 = HFRewardModelWrapper(model32, inference_mode=True)(ragged_tokens(seqs))["reward"]
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    r16 = HFRewardModelWrapper(model16, inference_mode=True)(ragged_tokens(seqs))["reward"]
    assert r16.dtype == torch.float32 and float(r32.abs().min()) >= 1.0
    assert torch.equal(r16.sign(), r32.sign())
    torch.testing.assert_close(r16, r32, atol=0.0, rtol=0.1)


def test_inference_mode_and_gradients(rm_tok):
    model = reward_model(rm_tok)
    seqs = [[5, 6, 7, 2], [8, 9, 2]]
    reward = HFRewardModelWrapper(model, inference_mode=True)(ragged_tokens(seqs))["reward"]
    assert reward.grad_fn is None and not reward.requires_grad
    # an ordinary tensor (torch.no_grad, not torch.inference_mode): later autograd code may use it
    weight = torch.ones(2, requires_grad=True)
    (weight * reward).sum().backward()
    torch.testing.assert_close(weight.grad, reward)

    reward = HFRewardModelWrapper(model)(ragged_tokens(seqs))["reward"]
    assert reward.grad_fn is not None
    reward.sum().backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inputs_follow_model_device_rewards_follow_tensordict(rm_tok):
    model = reward_model(rm_tok).to("cuda")
    seqs = [[5, 6, 7, 2], [8, 9, 2]]
    reward = HFRewardModelWrapper(model, inference_mode=True)(ragged_tokens(seqs))["reward"]
    assert reward.device.type == "cpu"
    expected = torch.stack([score_alone(model, torch.tensor(s, device="cuda")).cpu() for s in seqs])
    torch.testing.assert_close(reward, expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- errors, repr


def test_errors(rm, rm_tok):
    wrapper = HFRewardModelWrapper(rm)
    with pytest.raises(KeyError, match="HFRewardModelWrapper: token_key"):
        wrapper(TensorDict({"masks": {"all_attention_mask": torch.ones(2, 3)}}, batch_size=[2]))
    with pytest.raises(KeyError, match="HFRewardModelWrapper: attention_mask_key"):
        wrapper(TensorDict({"tokens": {"full": torch.ones(2, 3, dtype=torch.long)}}, batch_size=[2]))
    with pytest.raises(KeyError, match="HFRewardModelWrapper: text_key"):
        HFRewardModelWrapper(rm, tokenizer=rm_tok)(TensorDict({}, batch_size=[2]))

    with pytest.raises(ValueError, match="HFRewardModelWrapper: nothing to score"):
        wrapper(TensorDict({"tokens": {"full": torch.ones(0, 3, dtype=torch.long)}}, batch_size=[0]))
    mismatched = lazy_stack(
        [
            TensorDict(
                {"tokens": {"full": torch.ones(3, dtype=torch.long)}, "masks": {"all_attention_mask": torch.ones(2)}}
            ),
            TensorDict(
                {"tokens": {"full": torch.ones(2, dtype=torch.long)}, "masks": {"all_attention_mask": torch.ones(2)}}
            ),
        ]
    )
    with pytest.raises(ValueError, match=r"HFRewardModelWrapper: sample 0 has \(3,\) token ids"):
        wrapper(mismatched)

    class TwoLabels(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.zeros(input_ids.shape[0], 2)

    # The phrases TorchRL's own trl_interop tests match ("one scalar reward per input", "could not extract reward")
    # are kept, so that code catching torchrl's errors by message catches ours.
    with pytest.raises(RuntimeError, match=r"HFRewardModelWrapper: expected one scalar reward per input.*num_labels=1"):
        HFRewardModelWrapper(TwoLabels(), attention_mask_key=None)(
            TensorDict({"tokens": {"full": torch.ones(2, 3, dtype=torch.long)}}, batch_size=[2])
        )

    class NoReward(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return {"hidden": input_ids}

    with pytest.raises(RuntimeError, match="HFRewardModelWrapper: could not extract reward"):
        HFRewardModelWrapper(NoReward(), attention_mask_key=None)(
            TensorDict({"tokens": {"full": torch.ones(2, 3, dtype=torch.long)}}, batch_size=[2])
        )
    with pytest.raises(ValueError, match="HFRewardModelWrapper: history_key needs the reward model's tokenizer"):
        HFRewardModelWrapper(rm, history_key=("history", "full"))
    other_pad = reward_model(rm_tok)
    other_pad.config.pad_token_id = rm_tok.eos_token_id
    with pytest.raises(ValueError, match=r"HFRewardModelWrapper: model.config.pad_token_id .* differs"):
        HFRewardModelWrapper(other_pad, tokenizer=rm_tok)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="HFRewardModelWrapper: micro_batch_size"):
            HFRewardModelWrapper(rm, micro_batch_size=bad)
    with pytest.raises(ValueError, match="HFRewardModelWrapper: padding_side"):
        HFRewardModelWrapper(rm, padding_side="middle")
    with pytest.raises(TypeError, match="HFRewardModelWrapper: history_key"):
        HFRewardModelWrapper(rm, tokenizer=rm_tok, history_key="history")(
            TensorDict({"history": torch.zeros(2, 3)}, batch_size=[2])
        )


def test_repr_and_module_api(rm, rm_tok):
    wrapper = HFRewardModelWrapper(rm, tokenizer=rm_tok, micro_batch_size=4)
    assert isinstance(wrapper, TensorDictModuleBase)
    text = repr(wrapper)
    assert text.startswith("HFRewardModelWrapper(model=Qwen2ForSequenceClassification")
    assert "text_key=('text', 'full')" in text and "micro_batch_size=4" in text
    # the reward model is a registered submodule: .parameters() / .to() reach it
    assert sum(p.numel() for p in wrapper.parameters()) == sum(p.numel() for p in rm.parameters())


# ---------------------------------------------------------------- transform, no env


def test_transform_forward_on_stored_transitions(rm):
    seqs = [[5, 6, 7, 2], [8, 9, 2], [10, 2]]
    td = ragged_tokens(seqs)
    transform = RewardModelTransform(HFRewardModelWrapper(rm))
    out = transform(td)
    reward = out.get(("next", "reward"))
    assert reward.shape == (3, 1, 1) and reward.dtype == torch.float32
    torch.testing.assert_close(reward.view(-1), torch.stack([score_alone(rm, s) for s in seqs]), atol=1e-5, rtol=1e-5)
    assert "reward" not in out.keys()  # the module's own output stays out of the transitions
    # accumulate adds to an existing reward
    acc = RewardModelTransform(HFRewardModelWrapper(rm), accumulate=True, reward_shape=(1,))
    td2 = ragged_tokens(seqs)
    td2.set(("next", "reward"), torch.ones(3, 1))
    torch.testing.assert_close(acc(td2).get(("next", "reward")).view(-1), reward.view(-1) + 1, atol=1e-5, rtol=1e-5)


def test_transform_errors(rm):
    class TwoOut(TensorDictModuleBase):
        in_keys, out_keys = ["a"], ["r1", "r2"]

        def forward(self, td):
            return td

    with pytest.raises(ValueError, match="RewardModelTransform: reward_module must declare exactly one out_key"):
        RewardModelTransform(TwoOut())
    with pytest.raises(ValueError, match="RewardModelTransform: read_from"):
        RewardModelTransform(HFRewardModelWrapper(rm), read_from="elsewhere")
    with pytest.raises(ValueError, match="RewardModelTransform: reward_shape"):
        RewardModelTransform(HFRewardModelWrapper(rm), reward_shape=(2,))


# ---------------------------------------------------------------- several named, weighted sources

NAN, INF = float("nan"), float("inf")


def _source(function, out_key, in_key="action"):
    """A reward source: ``function`` of one entry, one value per row."""
    return TensorDictModule(function, in_keys=[in_key], out_keys=[out_key])


def _values(*values):
    """A source returning these values whatever it reads."""
    return lambda action: torch.tensor(values, dtype=torch.float32)


def _actions(*actions):
    return TensorDict({"action": torch.tensor(actions, dtype=torch.float32)}, batch_size=[len(actions)])


class OneStepEnv(EnvBase):
    """A 3-row env that declares no reward (as ``ChatEnv``): the action is what the reward sources read."""

    def __init__(self):
        super().__init__(batch_size=[3])
        self.full_observation_spec = Composite(observation=Unbounded((3,)), shape=(3,))
        self.full_action_spec = Composite(action=Unbounded((3,)), shape=(3,))
        self.full_reward_spec = Composite(shape=(3,))
        flag = Categorical(2, (3, 1), dtype=torch.bool)
        self.full_done_spec = Composite(done=flag, terminated=flag.clone(), shape=(3,))

    def _reset(self, tensordict):
        done = torch.zeros(3, 1, dtype=torch.bool)
        return TensorDict({"observation": torch.zeros(3), "done": done, "terminated": done.clone()}, batch_size=[3])

    def _step(self, tensordict):
        done = torch.ones(3, 1, dtype=torch.bool)
        return TensorDict(
            {"observation": tensordict["action"], "done": done, "terminated": done.clone()}, batch_size=[3]
        )

    def _set_seed(self, seed):
        return seed


def _three_sources(**kwargs):
    """``length`` (the action), ``bonus`` (1 where the action exceeds 1, NaN: not applicable, elsewhere) and ``flat``
    (-0.5), weighted 1, 2 and 4."""
    sources = {
        "length": _source(lambda action: action, "length"),
        "bonus": _source(lambda action: torch.where(action > 1, 1.0, torch.nan), "bonus"),
        "flat": _source(lambda action: torch.full_like(action, -0.5), "flat"),
    }
    options = {"weights": {"bonus": 2.0, "flat": 4.0}, "allow_nan": ["bonus"], "check_finite": True, **kwargs}
    return RewardModelTransform(sources, **options)


def test_sources_give_their_weighted_sum_and_their_own_values_in_an_env():
    env = TransformedEnv(OneStepEnv(), _three_sources(source_rewards_key="source_rewards"))
    assert env.full_reward_spec["reward"].shape == (3, 1, 1)
    assert env.full_observation_spec["source_rewards"].shape == (3, 3)
    check_env_specs(env)  # the reset writes every entry the specs declare
    reset = env.reset()
    assert torch.isnan(reset["source_rewards"]).all()  # nothing scored yet
    reset["action"] = torch.tensor([0.0, 1.0, 3.0])
    step = env.step(reset)["next"]
    expected = torch.tensor([[0.0, NAN, -0.5], [1.0, NAN, -0.5], [3.0, 1.0, -0.5]])
    torch.testing.assert_close(step["source_rewards"], expected, equal_nan=True)
    # 1 * length + 2 * bonus (left out where NaN) + 4 * flat, as trl sums reward_funcs with reward_weights
    assert step["reward"].view(-1).tolist() == [-2.0, -1.0, 3.0]
    assert step["reward"].dtype == torch.float32
    assert not {"length", "bonus", "flat"} & set(step.keys())  # the sources' own outputs stay out of the rollout


def test_forward_scores_stored_transitions_as_a_step_does():
    transform = _three_sources(source_rewards_key=("rewards", "per_source"))
    td = transform(_actions(0.0, 1.0, 3.0))
    assert td["next", "reward"].shape == (3, 1, 1) and td["next", "reward"].view(-1).tolist() == [-2.0, -1.0, 3.0]
    assert td["next", "rewards", "per_source"].shape == (3, 3)
    assert set(td.keys()) == {"action", "next"}
    # accumulate adds the sum to a reward already there; the per-source values are the step's own
    accumulating = _three_sources(accumulate=True, reward_shape=(1,))
    td = _actions(0.0, 1.0, 3.0)
    td.set(("next", "reward"), torch.ones(3, 1))
    assert accumulating(td)["next", "reward"].view(-1).tolist() == [-1.0, 0.0, 4.0]


def test_score_and_total_match_a_nan_skipping_weighted_sum():
    transform = _three_sources()
    values = transform.score(_actions(0.0, 2.0, 5.0, 1.5))
    assert values.shape == (4, 3)
    torch.testing.assert_close(transform.total(values), (values * torch.tensor([1.0, 2.0, 4.0])).nansum(-1))


def test_a_source_allowed_nan_may_return_it_for_every_row_another_source_scores():
    transform = _three_sources()
    assert transform(_actions(0.0, 0.5))["next", "reward"].view(-1).tolist() == [-2.0, -1.5]


def test_a_row_no_source_scores_stops_the_step_naming_the_sources():
    transform = RewardModelTransform(
        {"f": _source(_values(1.0, NAN, NAN), "f"), "g": _source(_values(NAN, NAN, 2.0), "g")},
        allow_nan=["f", "g"],
    )
    with pytest.raises(RuntimeError, match=r"1 row\(s\) \(rows \[1\]\) are scored by no source. Every reward source "):
        transform(_actions(0.0, 0.0, 0.0))
    with pytest.raises(RuntimeError, match=r"Every reward source \(f, g\) returned NaN \(not applicable\)"):
        transform.score(_actions(0.0, 0.0, 0.0))


@pytest.mark.parametrize(
    ("values", "allow_nan", "match"),
    [
        ((1.0, NAN, NAN), (), r"'reward\.terms\.b' returned non-finite rewards for 2 row\(s\) \(rows \[1, 2\]\)"),
        ((1.0, -INF, 2.0), (), r"'reward\.terms\.b' returned non-finite rewards for 1 row\(s\) \(rows \[1\]\)"),
        (
            (1.0, INF, NAN),
            ("reward.terms.b",),
            r"'reward\.terms\.b' returned non-finite rewards for 1 row\(s\) \(rows \[1\]\) \(NaN, not applicable, is "
            r"allowed; inf is not\)",
        ),
    ],
)
def test_a_non_finite_value_stops_the_step_naming_the_source(values, allow_nan, match):
    transform = RewardModelTransform(
        {"reward_model": _source(_values(0.0, 1.0, 2.0), "r"), "reward.terms.b": _source(_values(*values), "b")},
        allow_nan=allow_nan,
        check_finite=True,
    )
    with pytest.raises(ValueError, match=r"RewardModelTransform: the reward source " + match):
        transform(_actions(0.0, 0.0, 0.0))


def test_without_check_finite_a_nan_not_allowed_stays_in_the_reward():
    transform = RewardModelTransform({"a": _source(_values(1.0, NAN), "a"), "b": _source(_values(NAN, 2.0), "b")})
    reward = transform(_actions(0.0, 0.0))["next", "reward"].view(-1)
    assert torch.isnan(reward).all()  # not "not applicable": nobody said b may skip a row
    single = RewardModelTransform(_source(_values(NAN, 2.0), "a"))  # one module, as before: its NaN is the reward
    assert torch.isnan(single(_actions(0.0, 0.0))["next", "reward"].view(-1)[0])


def test_a_source_returning_a_wrong_count_or_no_entry_is_named():
    class TwoValues(TensorDictModuleBase):
        in_keys, out_keys = ["action"], ["x"]

        def forward(self, td):
            return TensorDict({"x": torch.ones(2)}, batch_size=[2])

    wrong_count = RewardModelTransform({"x": TwoValues()})
    with pytest.raises(RuntimeError, match=r"the reward source 'x' returned 2 rewards for a batch of \(3,\)"):
        wrong_count(_actions(0.0, 1.0, 2.0))

    class WritesNothing(TensorDictModuleBase):
        in_keys, out_keys = ["action"], ["r"]

        def forward(self, td):
            return td

    with pytest.raises(KeyError, match=r"the reward source 'y' wrote no 'r' entry"):
        RewardModelTransform({"x": _source(_values(1.0), "x"), "y": WritesNothing()})(_actions(0.0))


def test_each_source_scores_a_selection_of_its_keys_without_gradients():
    seen = {}

    class Scaled(TensorDictModuleBase):
        """Records the keys it is given; a parameter, so that a graph would be built without no_grad."""

        def __init__(self, in_keys):
            super().__init__()
            self.in_keys, self.out_keys = in_keys, ["scaled"]
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, td):
            seen[tuple(self.in_keys)] = set(td.keys())
            td.set("scaled", td["action"] * self.scale)
            return td

    declared, undeclared = Scaled(["action"]), Scaled([])
    transform = RewardModelTransform({"declared": declared, "undeclared": undeclared}, source_rewards_key="values")
    td = _actions(1.0, 2.0)
    td.set("other", torch.zeros(2))
    out = transform(td)
    assert seen[("action",)] == {"action"} and seen[()] == {"action", "other"}  # no in_keys: a copy of everything
    assert out["next", "reward"].requires_grad is False and out["next", "reward"].view(-1).tolist() == [4.0, 8.0]
    assert set(out.keys()) == {"action", "other", "next"}
    # the sources are registered: .parameters() and .to() reach them
    assert [p.data_ptr() for p in transform.parameters()] == [declared.scale.data_ptr(), undeclared.scale.data_ptr()]
    text = repr(transform)
    assert text.startswith("RewardModelTransform(reward_module={'declared': Scaled, 'undeclared': Scaled}, weights=")
    assert "source_rewards_key='values'" in text


def test_one_module_may_write_its_values_as_one_source():
    transform = RewardModelTransform(_source(_values(1.5, 2.5), "r"), name="rm", source_rewards_key="per_source")
    out = transform(_actions(0.0, 0.0))
    assert out["next", "per_source"].tolist() == [[1.5], [2.5]]
    assert out["next", "reward"].view(-1).tolist() == [1.5, 2.5]
    assert transform.reward_modules == {"rm": transform.reward_module}


def test_source_argument_errors():
    one = _source(_values(1.0), "a")
    with pytest.raises(
        ValueError, match=r"RewardModelTransform: weights names \['c'\], which are not reward sources; "
    ):
        RewardModelTransform({"a": one}, weights={"c": 1.0})
    with pytest.raises(ValueError, match=r"RewardModelTransform: allow_nan names \['b'\], .* sources are \['a'\]"):
        RewardModelTransform({"a": one}, allow_nan=["b"])
    with pytest.raises(ValueError, match=r"RewardModelTransform: weights\['a'\] must be a finite number, got nan"):
        RewardModelTransform({"a": one}, weights={"a": NAN})
    with pytest.raises(ValueError, match=r"RewardModelTransform: name names a single reward_module"):
        RewardModelTransform({"a": one}, name="a")
    with pytest.raises(ValueError, match=r"RewardModelTransform: the mapping of reward sources is empty"):
        RewardModelTransform({})
    with pytest.raises(ValueError, match=r"RewardModelTransform: source_rewards_key and reward_key are both"):
        RewardModelTransform({"a": one}, source_rewards_key="reward")

    class TwoOut(TensorDictModuleBase):
        in_keys, out_keys = ["a"], ["r1", "r2"]

        def forward(self, td):
            return td

    with pytest.raises(
        ValueError, match=r"RewardModelTransform: reward_module\['b'\] must declare exactly one out_key"
    ):
        RewardModelTransform({"a": one, "b": TwoOut()})
    with pytest.raises(TypeError, match=r"RewardModelTransform: reward_module\['b'\] must be a TensorDict module"):
        RewardModelTransform({"a": one, "b": 3})
