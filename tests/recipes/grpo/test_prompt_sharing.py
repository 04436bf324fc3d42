"""recipes/grpo/log_probs.py's prompt sharing (``train.share_prompt``): each distinct prompt of a batch runs through the
model once, its keys and values read by the pass over its responses. The log-probs, entropies, losses and gradients
equal the padded path's (every row its own prompt) within float32 tolerance: for every loss type, under LoRA, with
gradient checkpointing, on multi-turn tool dialogs (the shared prompt is the first user turn only), and on mini-batches
whose groups are shuffled apart. Token-budget micro-batches (``train.max_tokens_per_micro_batch``) give the same update
as the whole mini-batch in one pass."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from _grpo_helpers import MAX_COMPLETION_LENGTH, loss_settings
from tensordict import TensorDict

from recipes.grpo.batch import ADVANTAGE, ASSISTANT_MASK, LOG_PROBS, LOSS_MASK, REF_LOG_PROBS, policy_token_mask
from recipes.grpo.log_probs import (
    AdapterDisabledLogProbs,
    ResponseLogProbs,
    ScoreLogProbs,
    distinct_prompts,
    response_buckets,
)
from recipes.grpo.loss import LOSS_TYPES, GRPOObjective, Scale

GROUP = 3
ONE_STEP = Scale(accumulation=1, step_tokens=40.0)


@pytest.fixture(scope="module")
def batch(tiny_policy):
    """Two prompts of different lengths x 3 sampled responses, some ending early (two after 3 tokens), the rows then
    shuffled (groups apart, as a replay buffer's mini-batch holds them), with old and reference log-probs of another
    policy."""
    from interop.sampling import CausalLMSampler, SamplingSettings
    from recipes.grpo.prompt_env import PromptEnv

    model, tokenizer = tiny_policy
    prompts = ["Review the mug.", "What do you think of the bike and of its color?"]
    env = PromptEnv(prompts, tokenizer=tokenizer, group_size=GROUP, num_prompts=2, shuffle=False)
    policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=24, top_k=50))
    torch.manual_seed(5)
    batch = policy(env.reset()).select(
        ("tokens", "prompt"), ("tokens", "response"), ("tokens", "full"), ("masks", "all_attention_mask")
    )
    assert batch["masks", "all_attention_mask"][:, -1].sum() < 2 * GROUP  # some responses end early: really padded
    # Two responses cut to their first 3 tokens, as responses that end at once: the responses then run in passes by
    # length (response_buckets), which every test of this file compares with the padded path.
    start, pad = batch["tokens", "prompt"].shape[-1], tokenizer.pad_token_id
    for row in (1, 3):
        batch["masks", "all_attention_mask"][row, start + 3 :] = False
        batch["tokens", "full"][row, start + 3 :] = pad
        batch["tokens", "response"][row, 3:] = pad
    batch = batch[torch.tensor([4, 0, 2, 5, 1, 3])]
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    ScoreLogProbs(ResponseLogProbs(other, share_prompt=False), out_key=LOG_PROBS)(batch)
    ScoreLogProbs(ResponseLogProbs(other, share_prompt=False), out_key=REF_LOG_PROBS)(batch)
    batch.set(ADVANTAGE, torch.tensor([0.9, -1.2, 0.3, 1.1, -0.4, -0.7]).reshape(6, 1, 1))
    batch.set(LOSS_MASK, policy_token_mask(batch))
    return batch


def _tokens_and_mask(batch):
    return batch["tokens", "full"], batch["masks", "all_attention_mask"], batch["tokens", "prompt"].shape[-1]


def _log_probs_and_gradients(model, scorer, batch):
    tokens, mask, start = _tokens_and_mask(batch)
    weights = torch.linspace(-1.0, 1.0, tokens.numel(), dtype=model.dtype).reshape(
        tokens.shape
    )  # an arbitrary loss of both outputs
    model.zero_grad()
    log_probs, entropy = scorer(tokens, mask, response_start=start, with_entropy=True)
    ((log_probs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return log_probs.detach(), entropy.detach(), gradients


def _assert_close(got: torch.Tensor, expected: torch.Tensor, msg: str = "", tolerance: float = 1e-5) -> None:
    """Equal within ``tolerance`` relative, as a whole tensor (its norm): the two paths sum in other orders, so an entry
    near zero (a gradient that cancels) can differ by more than 1e-5 of itself."""
    error = float((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))
    assert error <= tolerance, f"{msg}: relative error {error:.2e} > {tolerance:.0e}"


def _assert_equal(got, expected, tolerance: float = 1e-5):
    _assert_close(got[0], expected[0], "log-probs", tolerance)
    _assert_close(got[1], expected[1], "entropies", tolerance)
    assert got[2].keys() == expected[2].keys() and got[2]
    for name, gradient in expected[2].items():
        _assert_close(got[2][name], gradient, name, tolerance)


class _EmbeddedShapes:
    """The shapes of the token batches that reach the model's embeddings: what each forward pass computed."""

    def __init__(self, model):
        self.shapes = []
        self.handle = model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: self.shapes.append(tuple(args[0].shape))
        )

    def __enter__(self):
        return self.shapes

    def __exit__(self, *exc):
        self.handle.remove()


def test_distinct_prompts_ignore_padding_and_find_every_row_its_prompt(batch):
    tokens, mask, start = _tokens_and_mask(batch)
    rows, inverse = distinct_prompts(tokens, mask, start)
    assert len(rows) == 2 and inverse.tolist() == [1, 0, 0, 1, 0, 1]
    assert (tokens[rows[inverse], :start] == tokens[:, :start]).all()


@pytest.mark.parametrize(
    ("chunk_elements", "dtype"),
    # The chunked head's own backward sums in float32 across chunks (1e-5 from the unchunked one on the padded path
    # alone): in float64 (the head's chunks still in float32) the two paths must agree far closer.
    [(2**23, torch.float32), (463 * 5, torch.float64)],
)
def test_each_prompt_runs_once_with_the_padded_paths_values_and_gradients(tiny_policy, batch, chunk_elements, dtype):
    model = copy.deepcopy(tiny_policy[0]).to(dtype)
    tokens, mask, start = _tokens_and_mask(batch)
    with _EmbeddedShapes(model) as shapes:
        got = _log_probs_and_gradients(
            model, ResponseLogProbs(model, chunk_elements=chunk_elements, share_prompt=True), batch
        )
    # Two distinct prompts once, then the six responses alone, in passes by length (two of them are 3 tokens long);
    # the padded path runs six whole rows.
    assert shapes[0] == (2, start) and len(shapes) == 3
    assert sorted(shapes[1:]) == [(2, 3), (4, tokens.shape[-1] - start)]
    expected = _log_probs_and_gradients(
        model, ResponseLogProbs(model, chunk_elements=chunk_elements, share_prompt=False), batch
    )
    _assert_equal(got, expected, 1e-5 if dtype == torch.float32 else 1e-6)
    assert (got[0][~mask] == 0).all() and (got[0][:, :start] == 0).all()


def test_a_model_scored_through_its_own_forward_shares_its_prompts_too(tiny_policy, batch):
    """A config with a logit transform takes the model's forward (logits_to_keep) rather than the chunked head."""
    model, _ = tiny_policy
    scaled = copy.deepcopy(model)
    scaled.config.final_logit_softcapping = 30.0  # Qwen2 ignores it: the same numbers, through the other path
    shared = ResponseLogProbs(scaled, share_prompt=True)
    assert not shared._chunked
    _assert_equal(
        _log_probs_and_gradients(scaled, shared, batch),
        _log_probs_and_gradients(scaled, ResponseLogProbs(scaled, share_prompt=False), batch),
    )


def test_with_gradient_checkpointing_the_layers_recompute_and_the_gradients_match(tiny_dir, batch):
    from transformers import AutoModelForCausalLM

    from recipes.grpo.policy import enable_activation_checkpointing, update_forward

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").eval()
    expected = _log_probs_and_gradients(model, ResponseLogProbs(model, share_prompt=False), batch)
    enable_activation_checkpointing(model)
    calls = []
    for layer in model.model.layers:
        # A pre-hook: the recomputation stops once it has every saved tensor back, before an MLP's forward ends.
        layer.mlp.register_forward_pre_hook(lambda *args: calls.append(1))
    scorer = ResponseLogProbs(model, share_prompt=True)
    with update_forward(model, mixed_precision="no", device="cpu"), _EmbeddedShapes(model) as shapes:
        got = _log_probs_and_gradients(model, scorer, batch)
    # Three passes (prompts, then the responses in two buckets of length) over every layer, each recomputed once in
    # the backward.
    assert len(shapes) == 3 and len(calls) == 2 * 3 * len(model.model.layers)
    _assert_equal(got, expected)


def test_lora_adapters_and_the_adapters_off_reference_match(tiny_dir, batch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_dir / "policy"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    got = _log_probs_and_gradients(model, ResponseLogProbs(model, share_prompt=True), batch)
    expected = _log_probs_and_gradients(model, ResponseLogProbs(model, share_prompt=False), batch)
    assert all("lora_" in name for name in expected[2])
    _assert_equal(got, expected)
    tokens, mask, start = _tokens_and_mask(batch)
    with torch.no_grad():
        reference = [
            AdapterDisabledLogProbs(model, scorer=ResponseLogProbs(model, share_prompt=share))(
                tokens, mask, response_start=start
            )[0]
            for share in (True, False)
        ]
    _assert_close(reference[0], reference[1])
    assert not torch.allclose(reference[0], got[0], atol=1e-3)  # the adapters really were off


def _loss_and_gradients(model, batch, settings, *, share_prompt):
    model.zero_grad()
    objective = GRPOObjective(
        ResponseLogProbs(model, share_prompt=share_prompt), settings, max_completion_length=MAX_COMPLETION_LENGTH
    )
    out = objective(batch, scale=ONE_STEP)
    out["loss"].backward()
    gradients = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out, gradients


def _assert_same_loss(model, batch, settings):
    shared, shared_gradients = _loss_and_gradients(model, batch, settings, share_prompt=True)
    padded, padded_gradients = _loss_and_gradients(model, batch, settings, share_prompt=False)
    assert shared.keys() == padded.keys()
    for key, value in padded.items():
        _assert_close(shared[key].detach(), value.detach(), msg=key)
    for got, expected in zip(shared_gradients, padded_gradients, strict=True):
        _assert_close(got, expected)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_with_a_kl_term_gives_the_padded_paths_loss_and_gradients(tiny_policy, batch, loss_type):
    model, _ = tiny_policy
    settings = loss_settings(type=loss_type, kl_to_ref_coeff=0.1, clip_epsilon_high=1.28, entropy_coeff=0.01)
    _assert_same_loss(model, batch, settings)
    if loss_type == "dapo":  # and the sequence-level ratio (GSPO) with the high-entropy mask
        _assert_same_loss(model, batch, dataclasses.replace(settings, importance_sampling_level="sequence"))
        _assert_same_loss(model, batch, dataclasses.replace(settings, top_entropy_quantile=0.5))


def test_tool_dialogs_share_their_first_user_turn_only(tiny_policy):
    """A dialog's response is every turn after the first user message, tool messages included (out of the loss by
    the assistant mask): the prompt columns a group shares are that first turn; turns after it differ per dialog."""
    model, tokenizer = tiny_policy
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Review the mug."}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    rows, assistant = [], []
    for answer, result, final in [("a call", "4", "good mug"), ("call again", "12", "fine"), ("no call", "", "bad")]:
        turns = [(f"{answer}<|im_end|>\n", True)]
        if result:
            turns += [(f"<|im_start|>user\n{result}<|im_end|>\n<|im_start|>assistant\n", False)]
            turns += [(f"{final}<|im_end|>", True)]
        ids, mine = [], []
        for text, own in turns:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, mine = ids + piece, mine + [own] * len(piece)
        rows.append(ids)
        assistant.append(mine)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    response = torch.tensor([ids + [pad] * (width - len(ids)) for ids in rows])
    full = torch.cat([torch.tensor([prompt] * 3), response], dim=1)
    mask = torch.cat([torch.ones(3, len(prompt), dtype=torch.bool), response != pad], dim=1)
    own = torch.tensor([mine + [False] * (width - len(mine)) for mine in assistant])
    batch = TensorDict(
        {
            "tokens": {"prompt": torch.tensor([prompt] * 3), "response": response, "full": full},
            "masks": {"all_attention_mask": mask},
        },
        batch_size=[3],
    )
    batch.set(
        ASSISTANT_MASK, torch.cat([torch.zeros(3, len(prompt), dtype=torch.bool), own & mask[:, len(prompt) :]], 1)
    )
    with torch.no_grad():
        old = ResponseLogProbs(model, share_prompt=False)(full, mask, response_start=len(prompt))[0]
    batch.set(LOG_PROBS, torch.where(batch.get(ASSISTANT_MASK), old - 0.05, 0.0))  # tool tokens: no sampling log-prob
    batch.set(REF_LOG_PROBS, old + 0.03)
    batch.set(ADVANTAGE, torch.tensor([1.0, -0.3, 0.6]).reshape(3, 1, 1))  # not summing to 0: no cancellation
    batch.set(LOSS_MASK, policy_token_mask(batch))
    assert (~batch.get(LOSS_MASK) & mask[:, len(prompt) :]).any()  # tool tokens are in the responses, out of the loss
    with _EmbeddedShapes(model) as shapes:
        ResponseLogProbs(model, share_prompt=True)(full, mask, response_start=len(prompt))
    # The prompt once, then the three dialogs' responses, in passes by length (the no-call dialog's is short).
    assert shapes[0] == (1, len(prompt))
    assert sum(rows for rows, _ in shapes[1:]) == 3 and max(columns for _, columns in shapes[1:]) == width
    for loss_type in ("dapo", "grpo"):
        _assert_same_loss(model, batch, loss_settings(type=loss_type, kl_to_ref_coeff=0.1))


def test_responses_run_in_passes_by_length_over_fewer_positions(tiny_policy, batch):
    """Right-padded responses of different lengths: the responses run in buckets of similar length, each pass as wide
    as its longest response (the values, losses and gradients are the padded path's: every test of this file runs on
    this batch)."""
    model, _ = tiny_policy
    tokens, mask, start = _tokens_and_mask(batch)
    lengths = mask[:, start:].sum(-1)
    with _EmbeddedShapes(model) as shapes:
        ResponseLogProbs(model, share_prompt=True)(tokens, mask, response_start=start)
    responses = shapes[1:]  # after the distinct prompts' pass
    assert len(responses) >= 2 and sum(rows for rows, _ in responses) == len(lengths)
    assert sum(rows * columns for rows, columns in responses) < len(lengths) * int(lengths.max())
    assert max(columns for _, columns in responses) == int(lengths.max())


def test_responses_of_one_length_run_in_one_pass_with_the_padded_paths_values_and_gradients(tiny_policy, batch):
    """Every response as long as the batch's columns (the bench's batch): no split pays, the rows run in one pass,
    in their own order, and give the padded path's values and gradients."""
    model, _ = tiny_policy
    tokens, mask, start = _tokens_and_mask(batch)
    full = batch.clone()
    full["masks", "all_attention_mask"][:, start:] = True  # every response column real: one length
    with _EmbeddedShapes(model) as shapes:
        got = _log_probs_and_gradients(model, ResponseLogProbs(model, share_prompt=True), full)
    assert shapes == [(2, start), (len(tokens), tokens.shape[-1] - start)]
    _assert_equal(got, _log_probs_and_gradients(model, ResponseLogProbs(model, share_prompt=False), full))


def test_a_response_whose_mask_has_a_hole_keeps_its_tokens_after_it(tiny_policy, batch):
    """A bucket is as wide as its rows' last real column, not their count of real tokens: a column masked inside a
    response (a hole) does not cut off the tokens after it."""
    model, _ = tiny_policy
    tokens, mask, start = _tokens_and_mask(batch)
    mask = mask.clone()
    last = mask[:, start:].long().cumsum(-1).argmax(-1)  # each response's last real column
    mask[:, start + 1 : start + 3] = False  # a hole of two columns early in every response
    expected = ResponseLogProbs(model, share_prompt=False)(tokens, mask, response_start=start)[0]
    got = ResponseLogProbs(model, share_prompt=True)(tokens, mask, response_start=start)[0]
    _assert_close(got.detach(), expected.detach(), "log-probs")
    long_enough = last > 2  # the 3-token responses' last tokens fall in the hole
    assert bool((got[torch.arange(len(last)), start + last] != 0)[long_enough].all())  # their last tokens scored


def test_response_buckets_split_where_padding_is_saved():
    lengths = torch.tensor([5, 30, 6, 31, 5, 30, 12, 29])
    buckets = response_buckets(lengths)
    assert sorted(torch.cat(buckets).tolist()) == list(range(8))  # every row once
    widths = [int(lengths[rows].max()) for rows in buckets]
    assert widths == sorted(widths) and len(buckets) >= 2
    assert sum(len(rows) * w for rows, w in zip(buckets, widths)) < 8 * 31
    assert [len(b) for b in response_buckets(torch.tensor([30, 31, 30, 29]))] == [4]  # nothing to save: one pass
    assert len(response_buckets(torch.arange(1, 65))) == 2  # a third pass would save 6% of one pass: not done
    assert len(response_buckets(torch.arange(1, 65), max_buckets=3, min_saving=0.0)) == 3


def test_rows_of_distinct_prompts_take_the_padded_path(tiny_policy, batch):
    model, _ = tiny_policy
    tokens, mask, start = _tokens_and_mask(batch)
    one_each = torch.tensor([0, 1])  # a prompt of each group: nothing to share
    with _EmbeddedShapes(model) as shapes, torch.no_grad():
        ResponseLogProbs(model, share_prompt=True)(tokens[one_each], mask[one_each], response_start=start)
    assert shapes == [(2, tokens.shape[-1])]


class _OneBatch:
    """A replay buffer that hands out one mini-batch (a copy: the learner reorders what it samples)."""

    def __init__(self, batch):
        self.batch = batch

    def sample(self):
        return self.batch.clone()


def _accumulated(model, batch, settings, max_tokens):
    from omegaconf import OmegaConf

    from recipes.grpo.learner import Learner, _accumulate

    cfg = OmegaConf.create({"loss": {"type": settings.type}, "train": {"max_tokens_per_micro_batch": max_tokens}})
    objective = GRPOObjective(ResponseLogProbs(model), settings, max_completion_length=MAX_COMPLETION_LENGTH)
    learner = Learner(
        prepare=None, buffer=_OneBatch(batch), loss=objective, optimizer=None, scheduler=None, parameters=[]
    )
    model.zero_grad()
    values = _accumulate(  # two mini-batches, one optimizer step
        cfg, learner, Scale(accumulation=2, step_tokens=80.0), fresh=True, mismatch=None
    )
    gradients = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return values, gradients


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_budget_micro_batches_make_the_whole_mini_batchs_update(tiny_policy, batch, loss_type):
    from recipes.grpo.learner import token_micro_batches

    model, _ = tiny_policy
    budget = 100
    parts = token_micro_batches(batch, budget)
    assert len(parts) >= 3 and all(part["masks", "all_attention_mask"].sum() <= budget for part in parts)
    assert sorted(len(part) for part in parts) != [2, 2, 2]  # uneven parts: the shares matter
    settings = loss_settings(type=loss_type, kl_to_ref_coeff=0.1, clip_epsilon_high=1.28)
    whole, whole_gradients = _accumulated(model, batch, settings, None)
    micro, micro_gradients = _accumulated(model, batch, settings, budget)
    assert micro.keys() == whole.keys()
    for key, value in whole.items():
        assert micro[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for got, expected in zip(micro_gradients, whole_gradients, strict=True):
        _assert_close(got, expected)
