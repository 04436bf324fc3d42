"""recipes/grpo/log_probs.py: response-only log-probs equal a full forward's, values and gradients, every path."""

from __future__ import annotations

import copy

import pytest
import torch

from recipes.grpo.log_probs import ResponseLogProbs, ScoreLogProbs

START = 10  # the response columns start here


@pytest.fixture(scope="module")
def batch():
    """Dense rows ``[pads | prompt | response | pads]``: left-padded prompts, one response ending early."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 400, (5, 20), generator=generator)
    mask = torch.ones(5, 20, dtype=torch.bool)
    mask[0, :3] = False  # a shorter prompt
    mask[1, 16:] = False  # a shorter response
    mask[2, :1] = False
    mask[2, 18:] = False
    tokens[~mask] = 0
    return tokens, mask


def _full_forward(model, tokens, mask):
    """The log-prob and entropy of every response token from the model's whole ``[B, T, V]`` logits."""
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    log_softmax = model(input_ids=tokens, attention_mask=mask.long(), position_ids=positions).logits.log_softmax(-1)
    taken = log_softmax[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)[:, :-1]
    response = mask.clone()
    response[:, :START] = False
    log_probs, entropies = torch.zeros(tokens.shape), torch.zeros(tokens.shape)
    log_probs[:, 1:] = torch.where(response[:, 1:], taken, 0.0)
    entropies[:, 1:] = torch.where(response[:, 1:], entropy, 0.0)
    return log_probs, entropies


def _values_and_gradients(model, compute):
    weights = torch.linspace(-1.0, 1.0, 100).reshape(5, 20)  # an arbitrary loss of both outputs
    model.zero_grad()
    log_probs, entropy = compute()
    ((log_probs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    gradients = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return log_probs.detach(), entropy.detach(), gradients


@pytest.mark.parametrize(
    ("chunk_elements", "keep_elements", "path"),
    [
        (2**23, 0, "one chunk"),
        (463 * 3, 2**27, "rows x vocabulary above the budget: vocabulary chunks, kept for the backward"),
        (463 * 3, 0, "vocabulary chunks, recomputed in the backward"),
        (1, 0, "a column a chunk"),
    ],
)
def test_equal_to_the_full_forward_values_and_gradients(tiny_policy, batch, chunk_elements, keep_elements, path):
    model, _ = tiny_policy
    tokens, mask = batch
    scorer = ResponseLogProbs(model, chunk_elements=chunk_elements, keep_elements=keep_elements)
    got = _values_and_gradients(model, lambda: scorer(tokens, mask, response_start=START, with_entropy=True))
    expected = _values_and_gradients(model, lambda: _full_forward(model, tokens, mask))
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5, msg=path)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5, msg=path)
    assert (got[0][:, :START] == 0).all() and (got[0][~mask] == 0).all()
    for got_grad, expected_grad in zip(got[2], expected[2], strict=True):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-4, rtol=1e-4, msg=path)


def test_models_that_rescale_their_logits_are_scored_through_their_own_forward(tiny_policy, batch):
    """A config with a logit transform (Gemma's softcapping, Cohere's logit_scale...) takes the model's forward."""
    model, _ = tiny_policy
    scaled = copy.deepcopy(model)
    scaled.config.final_logit_softcapping = 30.0  # Qwen2 ignores it: the same numbers, through the other path
    scorer = ResponseLogProbs(scaled)
    assert not scorer._chunked
    tokens, mask = batch
    got = _values_and_gradients(scaled, lambda: scorer(tokens, mask, response_start=START, with_entropy=True))
    expected = _values_and_gradients(scaled, lambda: _full_forward(scaled, tokens, mask))
    for got_value, expected_value in zip(got[:2], expected[:2], strict=True):
        torch.testing.assert_close(got_value, expected_value, atol=1e-5, rtol=1e-5)


def test_a_later_chunks_logits_far_above_the_earlier_ones_give_the_full_forwards_values_and_gradients(
    tiny_policy, batch
):
    """Later chunks are shifted by the max of the chunks before them (no max pass of their own): a chunk whose logits
    exceed that shift by more than float32's exp range (here tokens 300-462 scaled 20x: logits up to 22-178 above the
    first chunk's max, row by row) is caught and taken with its own max, finite and exact."""
    model = copy.deepcopy(tiny_policy[0])
    with torch.no_grad():
        model.get_output_embeddings().weight[300:] *= 20.0
    tokens, mask = batch
    scorer = ResponseLogProbs(model, chunk_elements=463 * 3)
    got = _values_and_gradients(model, lambda: scorer(tokens, mask, response_start=START, with_entropy=True))
    expected = _values_and_gradients(model, lambda: _full_forward(model, tokens, mask))
    assert all(bool(value.isfinite().all()) for value in got[:2])
    # Logits in the hundreds: float32's rounding of them alone is ~1e-5.
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-4, rtol=1e-5)
    for got_grad, expected_grad in zip(got[2], expected[2], strict=True):
        # The full forward itself rounds gradients this large (scaled 20x) to ~1e-5 of the largest.
        scale = float(expected_grad.abs().max())
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-5 * scale, rtol=1e-4)


def test_without_entropy_none_is_returned(tiny_policy, batch):
    model, _ = tiny_policy
    tokens, mask = batch
    with torch.no_grad():
        log_probs, entropy = ResponseLogProbs(model)(tokens, mask, response_start=START)
    assert entropy is None and log_probs.shape == tokens.shape


@pytest.mark.parametrize("start", [0, 20])
def test_a_start_column_without_prompt_or_response_is_refused(tiny_policy, batch, start):
    model, _ = tiny_policy
    tokens, mask = batch
    with pytest.raises(ValueError, match=f"response_start={start} must leave a prompt and a response"):
        ResponseLogProbs(model)(tokens, mask, response_start=start)


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_score_log_probs_writes_them_in_place_in_micro_batches(tiny_policy, batch, micro_batch_size):
    from tensordict import TensorDict

    model, _ = tiny_policy
    tokens, mask = batch
    td = TensorDict(
        {"tokens": {"full": tokens, "prompt": tokens[:, :START]}, "masks": {"all_attention_mask": mask}},
        batch_size=[5],
    )
    ScoreLogProbs(
        ResponseLogProbs(model), out_key=("next", "ref_log_probs", "full"), micro_batch_size=micro_batch_size
    )(td)
    scored = td["next", "ref_log_probs", "full"]
    assert not scored.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(scored, _full_forward(model, tokens, mask)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keep_elements", [0, 2**27])
@pytest.mark.parametrize("used", ["log_probs", "entropy"])
def test_the_chunked_backward_of_one_output_alone_equals_the_full_forwards(tiny_policy, batch, used, keep_elements):
    """A loss of the log-probs alone (the entropy logged, no entropy bonus: autograd hands its gradient as None) or of
    the entropy alone: the chunked backward skips the unused term and keeps the other exact."""
    model, _ = tiny_policy
    tokens, mask = batch
    weights = torch.linspace(-1.0, 1.0, 100).reshape(5, 20)
    gradients = []
    for compute in (
        lambda: ResponseLogProbs(model, chunk_elements=463 * 3, keep_elements=keep_elements)(
            tokens, mask, response_start=START, with_entropy=True
        ),
        lambda: _full_forward(model, tokens, mask),
    ):
        model.zero_grad()
        log_probs, entropy = compute()
        ((log_probs if used == "log_probs" else entropy) * weights).sum().backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    for got, expected in zip(*gradients, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("keep_elements", [0, 2**27])
def test_a_scorers_buffers_and_head_gradient_reused_step_after_step_give_a_fresh_scorers_numbers(
    tiny_policy, batch, keep_elements
):
    """The chunked head keeps its buffers from one call to the next, and the head's gradient, taken back after each
    step (recycle_head_gradient), is the next backward's: over steps of different batch sizes (buffers larger than
    the step needs, holding the last step's numbers), the values and gradients are a new scorer's, and the head's
    gradient lives in one buffer throughout."""
    model, _ = tiny_policy
    tokens, mask = batch
    weights = torch.linspace(-1.0, 1.0, 100).reshape(5, 20)
    head = model.get_output_embeddings().weight

    def step(scorer, rows):
        log_probs, entropy = scorer(tokens[rows], mask[rows], response_start=START, with_entropy=True)
        ((log_probs * weights[rows]).sum() + (entropy * weights.flip(0)[rows]).sum()).backward()
        return [log_probs.detach(), entropy.detach(), *(p.grad.clone() for p in model.parameters())]

    reused = ResponseLogProbs(model, chunk_elements=463 * 3, keep_elements=keep_elements)
    model.zero_grad()
    head_gradients = []
    for rows in (slice(0, 5), slice(1, 5), slice(0, 5)):
        got = step(reused, rows)
        head_gradients.append(head.grad.data_ptr())  # autograd adopts the tensor's memory (a detached alias)
        reused.recycle_head_gradient()
        assert head.grad is None and reused._workspace._pool["weight_grad"].data_ptr() == head_gradients[-1]
        model.zero_grad()
        expected = step(ResponseLogProbs(model, chunk_elements=463 * 3, keep_elements=keep_elements), rows)
        model.zero_grad()
        for got_value, expected_value in zip(got, expected, strict=True):
            torch.testing.assert_close(got_value, expected_value, atol=1e-6, rtol=1e-6)
    assert head_gradients[0] == head_gradients[1] == head_gradients[2]


def test_a_head_scored_whole_has_its_gradient_left_to_the_optimizer(tiny_policy, batch):
    """Within chunk_elements the head is scored whole by autograd's own log-softmax: its gradient is autograd's, and
    recycle_head_gradient leaves it (no [V, H] kept for a backward that would never take it)."""
    model, _ = tiny_policy
    tokens, mask = batch
    scorer = ResponseLogProbs(model)  # the default budget: the tiny head whole
    model.zero_grad()
    scorer(tokens, mask, response_start=START)[0].sum().backward()
    head = model.get_output_embeddings().weight
    gradient = head.grad
    scorer.recycle_head_gradient()
    assert head.grad is gradient and "weight_grad" not in scorer._workspace._pool
    model.zero_grad()


def test_two_graphs_of_one_scorer_alive_at_once_and_accumulated_backwards_get_their_own_gradients(tiny_policy, batch):
    """Two forwards before one backward (each holds its kept logits: the second cannot take the first's buffers), then
    a second backward accumulated into the existing gradients (micro-batches): the sums of separate passes."""
    model, _ = tiny_policy
    tokens, mask = batch
    weights = torch.linspace(-1.0, 1.0, 100).reshape(5, 20)
    scorer = ResponseLogProbs(model, chunk_elements=463 * 3)

    def loss(rows, scale):
        log_probs, _ = scorer(tokens[rows], mask[rows], response_start=START)
        return (log_probs * weights[rows]).sum() * scale

    separate = []
    for rows, scale in ((slice(0, 3), 1.0), (slice(2, 5), -0.5), (slice(0, 5), 2.0)):
        model.zero_grad()
        loss(rows, scale).backward()
        separate.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    (loss(slice(0, 3), 1.0) + loss(slice(2, 5), -0.5)).backward()  # two graphs alive at once
    loss(slice(0, 5), 2.0).backward()  # accumulated into the existing gradients
    together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for got, *parts in zip(together, *separate, strict=True):
        torch.testing.assert_close(got, sum(parts), atol=1e-5, rtol=1e-5)


def test_kept_logits_serve_one_backward_and_a_retained_graphs_second_recomputes(tiny_policy, batch):
    model, _ = tiny_policy
    tokens, mask = batch
    log_probs, _ = ResponseLogProbs(model, chunk_elements=463 * 3)(tokens, mask, response_start=START)
    gradients = []
    for _ in range(2):
        model.zero_grad()
        log_probs.sum().backward(retain_graph=True)
        gradients.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    for first, second in zip(*gradients, strict=True):
        torch.testing.assert_close(first, second, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("keep_elements", [0, 2**27])
def test_above_the_budget_the_chunk_width_is_its_own_with_the_full_forwards_values_and_gradients(
    tiny_policy, batch, monkeypatch, keep_elements
):
    """The budget (chunk_elements) decides whether the head is chunked; the chunk's width is CACHE_CHUNK_ELEMENTS
    over the rows (here 2 columns), not the budget's: values and gradients as the full forward's."""
    from recipes.grpo import log_probs

    model, _ = tiny_policy
    tokens, mask = batch
    rows = int(mask[:, START:].sum())
    monkeypatch.setattr(log_probs, "CACHE_CHUNK_ELEMENTS", 2 * rows + 1)
    chunks = []
    apply = log_probs._ChunkedHeadLogProbs.apply
    monkeypatch.setattr(
        log_probs._ChunkedHeadLogProbs, "apply", lambda *args: chunks.append(args[4]) or apply(*args), raising=True
    )
    scorer = ResponseLogProbs(model, chunk_elements=rows * 463 - 1, keep_elements=keep_elements)
    got = _values_and_gradients(model, lambda: scorer(tokens, mask, response_start=START, with_entropy=True))
    expected = _values_and_gradients(model, lambda: _full_forward(model, tokens, mask))
    assert chunks == [2]
    for got_value, expected_value in zip(got[:2], expected[:2], strict=True):
        torch.testing.assert_close(got_value, expected_value, atol=1e-5, rtol=1e-5)
    for got_grad, expected_grad in zip(got[2], expected[2], strict=True):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-4, rtol=1e-4)


def test_a_tied_embeddings_rows_gradient_equals_the_dense_one_over_accumulated_backwards(tiny_policy, batch):
    """The tiny policy's head shares its input embedding's weight: the embedding's gradient is added row by row into
    the head's (no dense [V, H] gradient), over micro-batches accumulated as the update does, equal to autograd's own
    dense sum to float rounding: repeated tokens summed, the padding row given none of the lookup's gradient."""
    model, _ = tiny_policy
    tokens, mask = batch
    tokens = tokens.clone()
    tokens[:, START : START + 4] = 7  # a token used many times
    tokens[~mask] = model.config.pad_token_id
    weight = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is weight
    rows = ResponseLogProbs(model, chunk_elements=463 * 3)
    dense = ResponseLogProbs(model, chunk_elements=463 * 3)
    dense._tied_rows = None  # autograd's own embedding backward
    assert rows._tied_rows is not None

    def accumulated(scorer):
        model.zero_grad()
        for part in (slice(0, 3), slice(3, 5)):  # two backwards into one gradient
            log_probs, entropy = scorer(tokens[part], mask[part], response_start=START, with_entropy=True)
            (log_probs.sum() + 0.5 * entropy.sum()).backward()
        gradient = weight.grad.clone()
        model.zero_grad()
        return gradient

    got, expected = accumulated(rows), accumulated(dense)
    assert not rows._tied_rows.pending  # every backward's rows were added
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
