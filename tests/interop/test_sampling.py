"""interop/sampling/sampler.py on the shipped tiny policy: the decoding loop, its recorded log-probs, the policy."""

from __future__ import annotations

import pytest
import torch

from interop.sampling import CausalLMSampler, SamplingSettings, sample_responses
from interop.sampling.sampler import _packing_available


def _prompts(tokenizer, texts):
    """Left-padded, chat-templated prompts of different lengths, as ``PromptEnv`` lays them out."""
    batch = tokenizer.apply_chat_template(
        [[{"role": "user", "content": text}] for text in texts],
        add_generation_prompt=True,
        tokenize=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )
    return batch["input_ids"], batch["attention_mask"].bool()


PROMPTS = ["Review the mug.", "What do you think of the bike and of its color?", "Review the lamp."]


def _sample(tiny_policy, settings, *, seed=0, prompts=PROMPTS, **options):
    """``sample_responses`` on ``prompts`` from RNG seed ``seed``; ``options`` override its keyword arguments."""
    model, tokenizer = tiny_policy
    tokens, mask = _prompts(tokenizer, prompts)
    torch.manual_seed(seed)
    options = {"eos_token_ids": [tokenizer.eos_token_id], "pad_token_id": tokenizer.pad_token_id, **options}
    sampled = sample_responses(model, tokens, mask, settings=settings, **options)
    return tokens, mask, sampled


def _assert_log_probs_equal_a_forward_pass(model, tokens, mask, sampled):
    """The behaviour log-probs, first response token included, are the model's log-softmax at each token."""
    assert sampled.log_probs.dtype == torch.float32
    for row in range(tokens.shape[0]):
        prompt = tokens[row][mask[row]]
        response = sampled.tokens[row][sampled.mask[row]]
        full = torch.cat([prompt, response])[None]
        with torch.no_grad():
            log_softmax = model(input_ids=full).logits[0].log_softmax(-1)
        expected = log_softmax[prompt.numel() - 1 : -1].gather(-1, response[:, None]).squeeze(-1)
        torch.testing.assert_close(sampled.log_probs[row][sampled.mask[row]], expected, atol=1e-5, rtol=1e-5)
        assert sampled.log_probs[row][0] < 0  # the first response token is scored too
        assert (sampled.log_probs[row][~sampled.mask[row]] == 0).all()


class TestSettings:
    def test_unknown_keys_are_refused_naming_the_supported_ones(self):
        with pytest.raises(ValueError, match=r"\['typical_p'\] not supported; the settings are \['max_new_tokens'"):
            SamplingSettings.from_mapping({"max_new_tokens": 8, "typical_p": 0.9})

    @pytest.mark.parametrize(
        ("settings", "message"),
        [
            ({"max_new_tokens": 0}, "max_new_tokens=0 must be >= 1"),
            ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens=5 must be in"),
            ({"max_new_tokens": 4, "temperature": 0.0}, "temperature=0.0 must be > 0"),
            ({"max_new_tokens": 4, "top_p": 0.0}, "top_p=0.0 must be in"),
            ({"max_new_tokens": 4, "top_k": -1}, "top_k=-1 must be >= 0"),
            ({"max_new_tokens": 4, "repetition_penalty": 0.0}, "repetition_penalty=0.0 must be > 0"),
        ],
    )
    def test_bad_values_are_refused(self, settings, message):
        with pytest.raises(ValueError, match=message):
            SamplingSettings.from_mapping(settings)


class TestSampleResponses:
    @pytest.mark.parametrize(
        "settings",
        [
            SamplingSettings(max_new_tokens=12, top_k=50),
            # EOS held back at every step (set to -inf in place) and a temperature: the log-probs stay the raw model's.
            SamplingSettings(max_new_tokens=12, min_new_tokens=12, top_k=50, temperature=0.7),
        ],
        ids=["top_k", "min_new_tokens+temperature"],
    )
    def test_recorded_log_probs_equal_a_forward_pass_of_each_sequence(self, tiny_policy, settings):
        """The behaviour log-probs, first response token included, are the model's log-softmax at each token."""
        model, _ = tiny_policy
        tokens, mask, sampled = _sample(tiny_policy, settings)
        _assert_log_probs_equal_a_forward_pass(model, tokens, mask, sampled)

    def test_a_response_ends_at_its_eos_and_is_padded_after(self, tiny_policy):
        _, tokenizer = tiny_policy
        _, _, sampled = _sample(tiny_policy, SamplingSettings(max_new_tokens=40, top_k=50), prompts=PROMPTS * 3)
        lengths = sampled.mask.sum(-1)
        assert lengths.min() < 40  # some responses end before max_new_tokens (the tiny policy writes short reviews)
        for row, length in zip(sampled.tokens, lengths, strict=True):
            if length < sampled.tokens.shape[1] or row[length - 1] == tokenizer.eos_token_id:
                assert row[length - 1] == tokenizer.eos_token_id
                assert (row[: length - 1] != tokenizer.eos_token_id).all()
            assert (row[length:] == tokenizer.pad_token_id).all()
        # the mask is a prefix: True up to and including EOS, then False
        assert torch.equal(sampled.mask, torch.arange(sampled.mask.shape[1]) < lengths[:, None])

    def test_min_new_tokens_holds_back_eos(self, tiny_policy):
        _, _, sampled = _sample(tiny_policy, SamplingSettings(max_new_tokens=24, min_new_tokens=24, top_k=50))
        assert sampled.tokens.shape == (3, 24) and bool(sampled.mask.all())

    def test_greedy_takes_the_most_likely_token_and_top_k_1_is_greedy(self, tiny_policy):
        model, _ = tiny_policy
        tokens, mask, greedy = _sample(tiny_policy, SamplingSettings(max_new_tokens=6, do_sample=False))
        _, _, top_1 = _sample(tiny_policy, SamplingSettings(max_new_tokens=6, top_k=1), seed=3)
        assert torch.equal(greedy.tokens, top_1.tokens)
        row_prompt = tokens[1][mask[1]]
        with torch.no_grad():
            first = model(input_ids=row_prompt[None]).logits[0, -1].argmax()
        assert greedy.tokens[1, 0] == first

    def test_the_same_seed_samples_the_same_responses(self, tiny_policy):
        settings = SamplingSettings(max_new_tokens=10, top_k=50, top_p=0.9, min_p=0.01)
        first, second, other = (_sample(tiny_policy, settings, seed=s)[2] for s in (5, 5, 6))
        assert torch.equal(first.tokens, second.tokens)
        assert not torch.equal(first.tokens, other.tokens)

    def test_top_k_samples_only_among_the_k_most_likely(self, tiny_policy):
        """With top_k=2 every sampled token is one of the 2 most likely after its prefix."""
        model, _ = tiny_policy
        tokens, mask, sampled = _sample(tiny_policy, SamplingSettings(max_new_tokens=8, top_k=2), prompts=PROMPTS * 2)
        for row in range(tokens.shape[0]):
            full = torch.cat([tokens[row][mask[row]], sampled.tokens[row][sampled.mask[row]]])[None]
            with torch.no_grad():
                logits = model(input_ids=full).logits[0]
            start = int(mask[row].sum())
            top2 = logits[start - 1 : -1].topk(2, dim=-1).indices
            response = sampled.tokens[row][sampled.mask[row]]
            assert (top2 == response[:, None]).any(-1).all()

    def test_repetition_penalty_lowers_repeats(self, tiny_policy):
        """A strong penalty makes every response token new (none repeats a prompt or earlier response token) far
        more often than without it."""
        _, tokenizer = tiny_policy

        def repeats(penalty):
            tokens, mask, sampled = _sample(
                tiny_policy,
                SamplingSettings(max_new_tokens=16, min_new_tokens=16, top_k=50, repetition_penalty=penalty),
                prompts=PROMPTS * 4,
            )
            count = 0
            for row in range(tokens.shape[0]):
                seen = set(tokens[row][mask[row]].tolist())
                for token in sampled.tokens[row].tolist():
                    count += token in seen
                    seen.add(token)
            return count

        assert repeats(50.0) < repeats(1.0) / 2


def _generate_distribution(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The distribution ``model.generate`` samples from: transformers' own warpers, in generate's order."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList()
    if settings.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k:
        warpers.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(settings.top_p))
    if settings.min_p:
        warpers.append(MinPLogitsWarper(settings.min_p))
    return warpers(None, logits.clone()).softmax(-1)


class TestDrawnDistribution:
    """The sampler draws each token with the probability ``generate`` gives it, and never one it rules out."""

    @pytest.mark.parametrize(
        "settings",
        [
            SamplingSettings(max_new_tokens=1),
            SamplingSettings(max_new_tokens=1, temperature=0.7),
            SamplingSettings(max_new_tokens=1, top_k=5),
            SamplingSettings(max_new_tokens=1, top_k=6, temperature=1.5),
            SamplingSettings(max_new_tokens=1, top_p=0.8),
            SamplingSettings(max_new_tokens=1, min_p=0.15),
            SamplingSettings(max_new_tokens=1, top_k=8, top_p=0.9, min_p=0.05, temperature=0.8),
        ],
        ids=["plain", "temperature", "top_k", "top_k+temperature", "top_p", "min_p", "all"],
    )
    def test_frequencies_match_generates_warpers(self, settings):
        from interop.sampling.sampler import _choose

        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(1, 24, generator=generator) * 2
        expected = _generate_distribution(logits, settings)[0]
        draws = 40_000
        torch.manual_seed(1)
        tokens = _choose(logits.expand(draws, -1).clone(), settings)
        frequencies = torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws
        assert (frequencies[expected == 0] == 0).all()  # a token generate rules out is never drawn
        # Within 5 standard errors of a binomial frequency (plus float slack): a wrong cut-off moves a token's
        # frequency by its whole probability, far more than this.
        tolerance = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-3
        assert ((frequencies - expected.double()).abs() <= tolerance).all(), (frequencies, expected)

    @pytest.mark.parametrize(
        ("settings", "scaled"),
        [
            (SamplingSettings(max_new_tokens=2, min_new_tokens=1), False),
            (SamplingSettings(max_new_tokens=2, min_new_tokens=1, temperature=0.7), True),
        ],
        ids=["plain", "temperature"],
    )
    def test_a_step_over_the_whole_vocabulary_draws_as_generate_with_eos_held_back(self, settings, scaled):
        """Sampling with no top-k, top-p, min-p or penalty reuses the log-prob normaliser's exponentials as the draw's
        weights; a held-back EOS (token 3 here) gets weight 0."""
        from interop.sampling.sampler import _next_tokens

        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(1, 24, generator=generator) * 2
        eos = 3
        held_back = logits.clone()
        held_back[:, eos] = float("-inf")
        expected = _generate_distribution(held_back, settings)[0]
        draws = 40_000
        torch.manual_seed(1)
        tokens, log_probs = _next_tokens(
            logits.expand(draws, -1).clone(),
            step=0,
            settings=settings,
            eos=torch.tensor([eos]),
            seen=None,
            scaled=scaled,
            uniform=None,
            workspace=torch.empty(draws, logits.shape[-1]),
        )
        frequencies = torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws
        assert frequencies[eos] == 0
        tolerance = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-3
        assert ((frequencies - expected.double()).abs() <= tolerance).all(), (frequencies, expected)
        scored = (logits / settings.temperature if scaled else logits).log_softmax(-1)[0]
        torch.testing.assert_close(log_probs, scored[tokens])


class TestDraw:
    """The draw behind every sampled token: one uniform number per row, inverse CDF over the row's weights."""

    @pytest.mark.parametrize("ordered", [True, False], ids=["ordered_cumsum", "parallel_scan_guard"])
    def test_frequencies_are_the_weights_and_a_zero_weight_is_never_drawn(self, ordered):
        from interop.sampling.sampler import _draw

        weights = torch.tensor([0.0, 3.0, 0.0, 0.0, 1.0, 0.5, 0.0, 4.0, 0.0])  # not normalised; zeros at both ends
        draws = 40_000
        torch.manual_seed(0)
        columns = _draw(weights.expand(draws, -1).clone(), ordered=ordered)
        frequencies = torch.bincount(columns, minlength=weights.numel()).double() / draws
        expected = (weights / weights.sum()).double()
        assert (frequencies[weights == 0] == 0).all()
        tolerance = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-3
        assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)

    @pytest.mark.parametrize("ordered", [True, False], ids=["ordered_cumsum", "parallel_scan_guard"])
    def test_the_ends_of_the_unit_interval_draw_the_first_and_last_columns_of_nonzero_weight(self, ordered):
        from interop.sampling.sampler import _draw

        weights = torch.tensor([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0]]).repeat(3, 1)
        # 1.0 is what rand() * total can round up to (rand() itself stays below it): it must not pass the last
        # interval into the zero columns after it.
        columns = _draw(weights, torch.tensor([[0.0], [0.999], [1.0]]), ordered=ordered)
        assert columns.tolist() == [2, 4, 4]

    def test_a_zero_weight_column_rounded_above_its_neighbour_gets_an_empty_interval(self):
        """A parallel scan may give a zero-weight column a sum one ulp above the column before it: the guard evens it
        out, so that a point in that ulp goes to the next column of nonzero weight."""
        from interop.sampling.sampler import _flat_across_zeros

        one_ulp_up = torch.tensor(1.0).nextafter(torch.tensor(2.0)).item()
        cdf = torch.tensor([[0.0, 1.0, one_ulp_up, 2.0]])  # weights 0, 1, 0, 1, as such a scan may sum them
        points = torch.tensor([[0.0, 1.0]])
        assert torch.searchsorted(cdf, points, right=True).tolist() == [[1, 2]]  # unguarded: column 2 drawn at 1.0
        bounds = _flat_across_zeros(cdf, torch.tensor([[True, False, True, False]]))
        assert bounds.tolist() == [[float("-inf"), 1.0, 1.0, 2.0]]
        assert torch.searchsorted(bounds, points, right=True).tolist() == [[1, 3]]


class _AtenCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each aten op called inside it with its inputs' shapes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


class TestVocabularyPasses:
    """A decoding step's work over the ``[B, V]`` logits: the log-prob normaliser takes its peak from the top-k
    candidates where they are the raw logits' (no pass for the maximum), with the log-probs of the full pass bit for
    bit."""

    VOCAB = 4096

    def _step(self, settings, logits, *, step=2, seen=None, scaled=False):
        from interop.sampling.sampler import _next_tokens

        return _next_tokens(
            logits.clone(),
            step=step,
            settings=settings,
            eos=torch.tensor([3]),
            seen=seen,
            scaled=scaled,
            uniform=torch.rand(logits.shape[0], 1, generator=torch.Generator().manual_seed(1)),
            workspace=torch.empty_like(logits),
        )

    @staticmethod
    def _full_pass_log_probs(logits, tokens, temperature):
        """``logits[token] - logsumexp`` with the normaliser's peak from a maximum over the whole vocabulary."""
        from interop.sampling.sampler import _log_normaliser

        normaliser = _log_normaliser(logits, temperature, torch.empty_like(logits))
        chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
        return (chosen / temperature if temperature else chosen) - normaliser

    def _logits(self):
        logits = torch.randn(6, self.VOCAB, generator=torch.Generator().manual_seed(0)) * 3
        logits[:, 3] = 200.0  # EOS far above every other logit: a peak missing it overflows exp
        logits[1, 7] = float("-inf")
        return logits

    @pytest.mark.parametrize(
        ("settings", "scaled", "step"),
        [
            (SamplingSettings(max_new_tokens=4, top_k=50), False, 2),
            (SamplingSettings(max_new_tokens=4, top_k=50, top_p=0.9, temperature=0.7), True, 2),
            (SamplingSettings(max_new_tokens=4, top_k=50, min_new_tokens=3), False, 2),
            (SamplingSettings(max_new_tokens=4, top_k=50, min_new_tokens=3, temperature=0.7), True, 2),
            (SamplingSettings(max_new_tokens=4, top_k=50, min_new_tokens=3), False, 3),
            (SamplingSettings(max_new_tokens=4, top_k=1), False, 2),
        ],
        ids=["top_k", "top_k+top_p+temperature", "eos_held_back", "eos_held_back+temperature", "eos_released", "k1"],
    )
    def test_log_probs_equal_the_full_pass_bit_for_bit(self, settings, scaled, step):
        logits = self._logits()
        tokens, log_probs = self._step(settings, logits, step=step, scaled=scaled)
        temperature = settings.temperature if scaled and settings.temperature != 1.0 else None
        assert torch.isfinite(log_probs).all()
        assert torch.equal(log_probs, self._full_pass_log_probs(logits, tokens, temperature))
        if step < settings.min_new_tokens:
            assert not (tokens == 3).any()

    def test_a_repetition_penalty_draws_from_the_penalised_top_k_and_scores_the_raw_logits(self):
        from interop.sampling.sampler import _choose, _penalise_repetitions

        logits = self._logits()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[:, 3] = True  # EOS's 200 divided by 1000: out of the penalised scores' top-k, the raw logits' top
        settings = SamplingSettings(max_new_tokens=4, top_k=50, repetition_penalty=1000.0)
        tokens, log_probs = self._step(settings, logits, seen=seen)
        uniform = torch.rand(logits.shape[0], 1, generator=torch.Generator().manual_seed(1))
        expected = _choose(_penalise_repetitions(logits, seen, 1000.0), settings, uniform=uniform)
        assert torch.equal(tokens, expected) and not (tokens == 3).any()
        assert torch.isfinite(log_probs).all()
        assert torch.equal(log_probs, self._full_pass_log_probs(logits, tokens, None))

    @pytest.mark.parametrize(
        "settings",
        [
            SamplingSettings(max_new_tokens=4, top_k=50, min_new_tokens=3),
            SamplingSettings(max_new_tokens=4, top_k=50),
            SamplingSettings(max_new_tokens=4),
        ],
        ids=["top_k+eos_held_back", "top_k", "whole_vocabulary"],
    )
    def test_log_probs_at_a_real_vocabulary_are_float64s_to_2e_6(self, settings):
        """151,936 logits, most of them equal (as a vocabulary resized past a checkpoint's trained rows gives): the
        sum of their probabilities is where a float32 kernel can lose digits. torch's CPU ``log_softmax`` is 7.6e-5
        off here (1.7e-4 on the real-vocabulary speed policy of docs/benchmarks.md), the max-shifted ``exp``-``sum``
        form 8e-7: the log-probs the sampler hands the loss must stay as close."""
        generator = torch.Generator().manual_seed(0)
        logits = torch.cat([torch.randn(4, 1_000, generator=generator) * 0.5, torch.zeros(4, 150_936)], dim=1)
        logits[:, 3] = 6.0  # a held-back EOS that is each row's largest logit
        tokens, log_probs = self._step(settings, logits)
        expected = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(log_probs.double(), expected, atol=2e-6, rtol=0)

    @pytest.mark.parametrize("min_new_tokens", [0, 3], ids=["eos_allowed", "eos_held_back"])
    def test_top_k_takes_no_maximum_over_the_vocabulary(self, min_new_tokens):
        logits = self._logits()
        with _AtenCalls() as recorded:
            self._step(SamplingSettings(max_new_tokens=4, top_k=50, min_new_tokens=min_new_tokens), logits)
        whole = [name for name, shapes in recorded.calls if shapes and shapes[0] == tuple(logits.shape)]
        assert "amax" not in whole and "max" not in whole, whole
        assert whole.count("topk") == 1, whole


class TestTopKOverALargeVocabulary:
    """Over a large vocabulary, top-k reads only the candidate blocks' columns and takes the same values as ``topk``
    over the whole row (the sampler's default top_k=50 at a 152k vocabulary: every decoding step)."""

    VOCAB = 20_003  # 312 blocks of 64 columns and a partial block of 35

    def _logits(self):
        generator = torch.Generator().manual_seed(0)
        logits = torch.randint(-40, 8, (6, self.VOCAB), generator=generator).float()  # many ties at the k-th value
        logits[0, -3:] = 50.0  # the best scores in the partial last block
        logits[1, :64] = 9.0  # a whole block of equal, best scores
        logits[2, ::2] = float("-inf")
        return logits

    @pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["unordered", "ordered_for_top_p"])
    def test_the_same_values_as_topk_over_the_whole_row(self, top_p):
        from interop.sampling.sampler import _top_k

        logits = self._logits()
        values, token_ids = _top_k(logits, SamplingSettings(max_new_tokens=4, top_k=50, top_p=top_p))
        expected = logits.topk(50, dim=-1).values  # descending
        assert torch.equal(values.sort(-1, descending=True).values, expected)
        assert torch.equal(logits.gather(-1, token_ids), values)
        assert (token_ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct tokens per row
        assert {self.VOCAB - 3, self.VOCAB - 2, self.VOCAB - 1} <= set(token_ids[0].tolist())  # the partial block's
        assert (token_ids[1] < 64).all()  # 50 of the block of 64 equal best scores
        if top_p < 1.0:  # top-p reads the candidates in order
            assert torch.equal(values, expected)

    def test_only_the_candidate_blocks_columns_are_ranked(self):
        from interop.sampling.sampler import _top_k

        logits = self._logits()
        with _AtenCalls() as recorded:
            _top_k(logits, SamplingSettings(max_new_tokens=4, top_k=50))
        ranked = [shapes[0] for name, shapes in recorded.calls if name == "topk"]
        assert ranked == [(6, 312), (6, 50 * 64 + 35)], ranked

    def test_a_small_vocabulary_takes_topk_over_the_whole_row(self):
        from interop.sampling.sampler import _top_k

        logits = torch.randn(3, 4096)  # 64 blocks, fewer than 4 x 50: pruning would rank a whole row anyway
        with _AtenCalls() as recorded:
            _top_k(logits, SamplingSettings(max_new_tokens=4, top_k=50))
        assert [shapes[0] for name, shapes in recorded.calls if name == "topk"] == [(3, 4096)]

    def test_draws_as_generates_top_k_warper(self):
        from interop.sampling.sampler import _choose

        settings = SamplingSettings(max_new_tokens=1, top_k=4, temperature=0.8)
        logits = torch.randn(1, 1024, generator=torch.Generator().manual_seed(0)) * 0.5
        logits[0, [5, 300, 301, 1000]] = torch.tensor([3.0, 2.5, 2.8, 3.2])  # the top 4, in three blocks
        expected = _generate_distribution(logits, settings)[0]
        assert expected.nonzero().flatten().tolist() == [5, 300, 301, 1000]
        draws = 20_000
        torch.manual_seed(1)
        tokens = _choose(logits.expand(draws, -1).clone(), settings)
        frequencies = torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws
        assert (frequencies[expected == 0] == 0).all()
        tolerance = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-3
        assert ((frequencies - expected.double()).abs() <= tolerance).all()


def _forward_rows(model):
    """A list that fills with the ``input_ids`` shape of every forward pass of ``model``, and the hook's handle."""
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes, handle


# GRPO's layout (each prompt in a group of consecutive rows), and the same prompts repeated in no order.
GROUPED = [prompt for prompt in PROMPTS for _ in range(4)]
UNORDERED = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0]]


class TestSharedPrefill:
    """Each distinct prompt goes through the model once; its KV cache and last logits are repeated to its rows."""

    @pytest.mark.parametrize("prompts", [GROUPED, UNORDERED], ids=["grouped", "unordered"])
    def test_the_prefill_runs_the_distinct_prompts_only(self, tiny_policy, prompts):
        model, _ = tiny_policy
        shapes, handle = _forward_rows(model)
        try:
            tokens, _, _ = _sample(
                tiny_policy, SamplingSettings(max_new_tokens=6, min_new_tokens=6, top_k=50), prompts=prompts
            )
        finally:
            handle.remove()
        assert shapes[0] == (3, tokens.shape[1])  # 3 distinct prompts
        assert shapes[1:] == [(len(prompts), 1)] * 5  # then every row decodes (none can end before 6 tokens)

    @pytest.mark.parametrize("prompts", [GROUPED, UNORDERED], ids=["grouped", "unordered"])
    @pytest.mark.parametrize(
        "settings",
        [
            SamplingSettings(max_new_tokens=12, top_k=50),
            SamplingSettings(max_new_tokens=12, min_new_tokens=3, top_p=0.9, temperature=0.7, repetition_penalty=1.3),
            SamplingSettings(max_new_tokens=12, min_new_tokens=2),
            SamplingSettings(max_new_tokens=12, do_sample=False),
        ],
        ids=["top_k", "top_p+temperature+penalty", "whole_vocabulary+min_new_tokens", "greedy"],
    )
    def test_rows_sample_what_they_sample_without_sharing(self, tiny_policy, monkeypatch, prompts, settings):
        import interop.sampling.sampler as sampling

        model, _ = tiny_policy
        tokens, mask, shared = _sample(tiny_policy, settings, prompts=prompts)
        _assert_log_probs_equal_a_forward_pass(model, tokens, mask, shared)
        monkeypatch.setattr(sampling, "_distinct_prompts", lambda tokens, mask: None)
        _, _, every_row = _sample(tiny_policy, settings, prompts=prompts)
        assert torch.equal(shared.tokens, every_row.tokens) and torch.equal(shared.mask, every_row.mask)
        torch.testing.assert_close(shared.log_probs, every_row.log_probs, atol=1e-5, rtol=0)

    def test_a_cache_that_is_not_a_dynamic_cache_of_attention_layers_runs_every_row(self, tiny_policy):
        from transformers.cache_utils import DynamicCache

        class OtherCache(DynamicCache):
            """Stands for a recurrent, static or quantized cache, whose rows hold more than keys and values."""

        class OtherCacheModel(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, use_cache, cache=None, logits_to_keep=0):
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=use_cache,
                    cache=cache,
                    logits_to_keep=logits_to_keep,
                )
                (out["cache"] if "cache" in out else out["past_key_values"]).__class__ = OtherCache
                return out

        model, tokenizer = tiny_policy
        settings = SamplingSettings(max_new_tokens=8, top_k=50)
        wrapped = OtherCacheModel(model)
        shapes, handle = _forward_rows(wrapped)
        try:
            tokens, _, fallback = _sample((wrapped, tokenizer), settings, prompts=UNORDERED)
        finally:
            handle.remove()
        rows, width = tokens.shape
        assert shapes[:2] == [(3, width), (rows, width)]  # the distinct prompts, then, the cache found out, every row
        assert all(shape == (rows, 1) for shape in shapes[2:])  # and no row leaves the batch
        _, _, shared = _sample(tiny_policy, settings, prompts=UNORDERED)
        assert torch.equal(fallback.tokens, shared.tokens)


class TestFinishedRowsLeave:
    """A row that has sampled EOS leaves the decoding batch; what every row samples, and the layout, are unchanged."""

    def test_forward_passes_after_a_row_ends_compute_the_rows_still_decoding(self, tiny_policy, monkeypatch):
        import interop.sampling.sampler as sampling

        model, tokenizer = tiny_policy
        settings = SamplingSettings(max_new_tokens=8, top_k=50)
        prompts = PROMPTS * 2
        _, _, first = _sample(tiny_policy, settings, prompts=prompts)
        # End ids taken from the responses, so that rows end at different steps.
        eos = sorted({tokenizer.eos_token_id, int(first.tokens[0, 1]), int(first.tokens[2, 4])})
        monkeypatch.setattr(sampling, "_DROP_FINISHED_AT", 1.0)  # no row leaves
        _, _, kept = _sample(tiny_policy, settings, prompts=prompts, eos_token_ids=eos)
        monkeypatch.setattr(sampling, "_DROP_FINISHED_AT", 0.0)  # rows leave as soon as they end: exact counts
        shapes, handle = _forward_rows(model)
        try:
            _, _, dropped = _sample(tiny_policy, settings, prompts=prompts, eos_token_ids=eos)
        finally:
            handle.remove()
        lengths = kept.mask.sum(-1)
        decoding_after = [int(((lengths > step + 1) | kept.truncated).sum()) for step in range(len(shapes) - 1)]
        assert [rows for rows, _ in shapes[1:]] == decoding_after  # the forward pass after each step
        assert 0 < decoding_after[-1] < len(prompts) - 1  # rows left at different steps, and some decoded on
        assert torch.equal(dropped.tokens, kept.tokens) and torch.equal(dropped.mask, kept.mask)
        torch.testing.assert_close(dropped.log_probs, kept.log_probs, atol=1e-5, rtol=0)

    @pytest.mark.parametrize(
        "settings",
        [
            SamplingSettings(max_new_tokens=24, do_sample=False),
            SamplingSettings(max_new_tokens=24, top_k=1),
            SamplingSettings(max_new_tokens=24, top_k=50),
            SamplingSettings(max_new_tokens=24, min_new_tokens=4, temperature=0.7, repetition_penalty=1.3),
            SamplingSettings(max_new_tokens=24, min_new_tokens=2, temperature=0.7),
        ],
        ids=["greedy", "top_1", "top_k", "min_new_tokens+temperature+penalty", "whole_vocabulary+temperature"],
    )
    def test_responses_equal_those_of_a_batch_that_keeps_every_row(self, tiny_policy, monkeypatch, settings):
        import interop.sampling.sampler as sampling

        _, tokenizer = tiny_policy
        prompts = [*GROUPED, *UNORDERED, "Hello"]
        # The greedy responses differ little: end ids that end "Hello"'s at its 2nd token ("color"), one of
        # PROMPTS[1]'s near the end ("excellent"), and most others at max_new_tokens.
        options = {"eos_token_ids": [tokenizer.eos_token_id, 325, 363], "log_probs_at_temperature": True}
        _, _, dropped = _sample(tiny_policy, settings, prompts=prompts, seed=2, **options)
        lengths = dropped.mask.sum(-1)
        assert lengths.min() < lengths.max()  # rows ended at different steps
        # Today's path: every row prefilled and decoded to the end (what a cache that cannot be copied gets).
        monkeypatch.setattr(sampling, "_rows_can_be_copied", lambda cache: False)
        _, _, kept = _sample(tiny_policy, settings, prompts=prompts, seed=2, **options)
        assert torch.equal(dropped.tokens, kept.tokens)
        assert torch.equal(dropped.mask, kept.mask) and torch.equal(dropped.truncated, kept.truncated)
        torch.testing.assert_close(dropped.log_probs, kept.log_probs, atol=1e-5, rtol=0)


class TestPreparedDecodingMasks:
    """Decoding steps hand the model the 4D mask its SDPA attention reads (no per-step rebuild from the 2D mask):
    the same tokens and log-probs, bit for bit, as the model's own masks."""

    def _masks_seen(self, model):
        ranks = []
        handle = model.register_forward_pre_hook(
            lambda _, args, kwargs: ranks.append(kwargs["attention_mask"].dim()), with_kwargs=True
        )
        return ranks, handle

    @pytest.mark.parametrize(
        ("prompts", "drop_finished_at"),
        [(GROUPED, 0.0), ([*UNORDERED, "Hello"], 0.0), ([*UNORDERED, "Hello"], 1.0)],
        ids=["grouped", "rows_leave", "rows_stay"],
    )
    def test_padded_prompts_sample_as_with_the_models_own_masks(
        self, tiny_policy, monkeypatch, prompts, drop_finished_at
    ):
        import interop.sampling.sampler as sampling

        model, tokenizer = tiny_policy
        monkeypatch.setattr(sampling, "_DROP_FINISHED_AT", drop_finished_at)
        settings = SamplingSettings(max_new_tokens=16, top_k=50, temperature=0.7)
        # End ids that end some rows early, so that rows leave (and the padded rows may all be gone).
        options = {"eos_token_ids": [tokenizer.eos_token_id, 325, 363], "log_probs_at_temperature": True}
        ranks, handle = self._masks_seen(model)
        try:
            _, mask, prepared = _sample(tiny_policy, settings, prompts=prompts, seed=3, **options)
        finally:
            handle.remove()
        assert not bool(mask.all())  # the prompts are padded
        assert ranks[0] == 2 and 4 in ranks[1:]  # the prefill builds its own mask; decoding steps get theirs
        monkeypatch.setattr(sampling, "_takes_prepared_decoding_masks", lambda model: False)
        _, _, built = _sample(tiny_policy, settings, prompts=prompts, seed=3, **options)
        assert torch.equal(prepared.tokens, built.tokens) and torch.equal(prepared.mask, built.mask)
        assert torch.equal(prepared.log_probs, built.log_probs)

    def test_prompts_without_padding_leave_the_mask_to_the_model(self, tiny_policy):
        model, _ = tiny_policy
        ranks, handle = self._masks_seen(model)
        try:
            _sample(tiny_policy, SamplingSettings(max_new_tokens=4, top_k=50), prompts=[PROMPTS[0]] * 3)
        finally:
            handle.remove()
        assert ranks == [2, 2, 2, 2]

    def test_only_full_attention_sdpa_models_of_the_listed_types_take_them(self, tiny_policy):
        from types import SimpleNamespace

        import interop.sampling.sampler as sampling

        model, _ = tiny_policy
        assert sampling._takes_prepared_decoding_masks(model)
        config = model.config

        def variant(**changes):
            fields = {
                "model_type": config.model_type,
                "_attn_implementation": "sdpa",
                "layer_types": ["full_attention"] * 2,
                **changes,
            }
            return SimpleNamespace(config=SimpleNamespace(**fields))

        assert sampling._takes_prepared_decoding_masks(variant())
        assert not sampling._takes_prepared_decoding_masks(variant(layer_types=["full_attention", "sliding_attention"]))
        assert not sampling._takes_prepared_decoding_masks(variant(_attn_implementation="eager"))
        assert not sampling._takes_prepared_decoding_masks(variant(model_type="gemma2"))


class TestInferenceMode:
    """Sampling runs under torch.inference_mode (no autograd bookkeeping per op); what it returns are ordinary tensors,
    which a loss reads as the old log-probs and a caller may change in place."""

    def test_forward_passes_run_in_inference_mode(self, tiny_policy):
        model, _ = tiny_policy
        modes = []
        handle = model.register_forward_pre_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
        try:
            _sample(tiny_policy, SamplingSettings(max_new_tokens=3, top_k=50))
        finally:
            handle.remove()
        assert modes and all(modes)

    def test_the_results_are_ordinary_tensors_a_loss_can_use(self, tiny_policy):
        _, _, sampled = _sample(tiny_policy, SamplingSettings(max_new_tokens=4, top_k=50))
        results = (sampled.tokens, sampled.mask, sampled.log_probs, sampled.truncated)
        assert not any(value.is_inference() for value in results)
        current = sampled.log_probs.clone().requires_grad_()
        ratio = (current - sampled.log_probs).exp() * sampled.log_probs  # saves the old log-probs for backward
        ratio.sum().backward()
        sampled.log_probs.masked_fill_(~sampled.mask, 0.0)  # in place, outside inference mode
        assert current.grad is not None


def _left_padded(rows: list[torch.Tensor], pad: int):
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        tokens[index, width - len(row) :], mask[index, width - len(row) :] = row, True
    return tokens, mask


class TestKeptCache:
    """keep_cache=True returns every row's KV cache; a later call given it as past (some rows dropped, the others
    reordered, each context grown by a different number of tokens) runs only the new tokens and samples what a call
    over the whole contexts samples, from the same random numbers."""

    def _grown(self, tokens, mask, sampled, order, extra):
        """Rows ``order`` of the batch, each its prompt, its whole response and ``extra[i]`` more tokens."""
        rows = []
        for row, more in zip(order, extra):
            rows.append(torch.cat([tokens[row][mask[row]], sampled.tokens[row][sampled.mask[row]], more]))
        return rows

    # Finished rows leave the loop as they end (each kept as it leaves), or stay to the end (their caches then hold
    # the pads fed after their EOS, which the kept mask leaves out).
    @pytest.mark.parametrize(
        ("settings", "drop_finished_at"),
        [
            (SamplingSettings(max_new_tokens=10, top_k=50), 0.0),
            (SamplingSettings(max_new_tokens=10, min_new_tokens=2, temperature=0.7, repetition_penalty=1.3), 0.0),
            (SamplingSettings(max_new_tokens=10, top_k=50), 1.0),
        ],
        ids=["top_k", "temperature+penalty", "top_k+rows_stay"],
    )
    def test_new_tokens_on_a_kept_cache_sample_as_the_whole_contexts(
        self, tiny_policy, monkeypatch, settings, drop_finished_at
    ):
        import interop.sampling.sampler as sampling

        monkeypatch.setattr(sampling, "_DROP_FINISHED_AT", drop_finished_at)
        model, tokenizer = tiny_policy
        pad = tokenizer.pad_token_id
        prompts = [*PROMPTS, "Hello"]
        # End ids taken from the responses, so that rows end at different steps (rows leave the loop, and their
        # caches are kept, at each).
        _, _, plain = _sample(tiny_policy, settings, prompts=prompts)
        eos = sorted({tokenizer.eos_token_id, int(plain.tokens[0, 2]), int(plain.tokens[2, 5])})
        options = {"eos_token_ids": eos, "pad_token_id": pad}
        tokens, mask, first = _sample(tiny_policy, settings, prompts=prompts, keep_cache=True, **options)
        assert first.kept is not None and len(first.kept) == len(prompts)
        assert first.mask.sum(-1).unique().numel() > 1  # rows ended at different steps
        for row in range(len(prompts)):
            response = first.tokens[row][first.mask[row]]
            expected = torch.cat([tokens[row][mask[row]], response[:-1]]).tolist()
            assert first.kept.held_ids(row) == expected  # the last sampled token was never fed
        extra = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([], dtype=torch.long), torch.tensor([11, 12])]
        order = [3, 0, 2]  # row 1 dropped, the others reordered
        grown, grown_mask = _left_padded(self._grown(tokens, mask, first, order, extra), pad)
        shapes, handle = _forward_rows(model)
        try:
            torch.manual_seed(7)
            cached = sample_responses(
                model, grown, grown_mask, settings=settings, keep_cache=True, past=first.kept.select(order), **options
            )
        finally:
            handle.remove()
        assert shapes[0] == (3, 6)  # the new tokens only: each row's last sampled token and its extra tokens
        torch.manual_seed(7)
        whole = sample_responses(model, grown, grown_mask, settings=settings, **options)
        assert torch.equal(cached.tokens, whole.tokens) and torch.equal(cached.mask, whole.mask)
        torch.testing.assert_close(cached.log_probs, whole.log_probs, atol=1e-5, rtol=0)
        _assert_log_probs_equal_a_forward_pass(model, grown, grown_mask, cached)
        # A third call on the second's kept cache (built on the first's, with its padding holes).
        order, extra = [2, 0], [torch.tensor([13]), torch.tensor([14, 15, 16])]
        third, third_mask = _left_padded(self._grown(grown, grown_mask, cached, order, extra), pad)
        torch.manual_seed(8)
        again = sample_responses(
            model, third, third_mask, settings=settings, keep_cache=True, past=cached.kept.select(order), **options
        )
        _assert_log_probs_equal_a_forward_pass(model, third, third_mask, again)
        torch.manual_seed(8)
        whole = sample_responses(model, third, third_mask, settings=settings, **options)
        assert torch.equal(again.tokens, whole.tokens)
        # A cache that cannot be kept (a sliding-window layer, a recurrent cache...) returns none.
        monkeypatch.setattr(sampling, "_rows_can_be_kept", lambda cache: False)
        assert _sample(tiny_policy, settings, prompts=prompts, keep_cache=True, **options)[2].kept is None

    def test_a_context_that_does_not_extend_the_kept_tokens_is_refused(self, tiny_policy):
        model, tokenizer = tiny_policy
        settings = SamplingSettings(max_new_tokens=4, min_new_tokens=4, top_k=50)
        tokens, mask, first = _sample(tiny_policy, settings, keep_cache=True)
        assert _sample(tiny_policy, settings)[2].kept is None  # kept only when asked for
        options = {"settings": settings, "eos_token_ids": [tokenizer.eos_token_id], "pad_token_id": 0}
        with pytest.raises(ValueError, match="does not extend the .* tokens its kept cache holds"):
            sample_responses(model, tokens, mask, past=first.kept, **options)  # nothing new: the prompts again
        with pytest.raises(ValueError, match="past holds 3 rows, the batch has 2"):
            sample_responses(model, tokens[:2], mask[:2], past=first.kept, **options)


def _wide_head_policy(vocab_size: int, *, dtype=torch.float32):
    """A 1-layer Llama whose output head holds ``vocab_size x 64`` weights: at 32,768 tokens, the smallest head the
    sampler computes weight-first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


class TestOutputHeadWeightFirst:
    """On CPU a float32 head of at least 2M weights computes its product as ``W @ x.T`` while the loop samples (the
    decoding step's few rows make ``F.linear`` several times slower there; docs/benchmarks.md has the figures)."""

    PROMPTS = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11], [5, 6, 7, 8], [0, 0, 12, 13]])

    def _sample_watching_the_head(self, model, **settings):
        """Samples, recording at each of the head's calls which ``forward`` ran."""
        head = model.get_output_embeddings()
        calls = []
        handle = head.register_forward_hook(lambda module, args, out: calls.append(vars(module).get("forward")))
        mask = self.PROMPTS != 0
        torch.manual_seed(0)
        try:
            sampled = sample_responses(
                model,
                self.PROMPTS,
                mask,
                settings=SamplingSettings(max_new_tokens=6, **settings),
                eos_token_ids=[1],
                pad_token_id=0,
            )
        finally:
            handle.remove()
        return mask, sampled, calls

    def test_a_wide_head_samples_weight_first_and_scores_as_a_forward_pass(self):
        model = _wide_head_policy(32_768)
        mask, sampled, calls = self._sample_watching_the_head(model)
        assert len(calls) >= 2
        assert all(getattr(call, "__func__", None).__name__ == "_head_for_few_rows" for call in calls)
        assert "forward" not in vars(model.lm_head)  # nn.Linear's own forward again after the loop
        _assert_log_probs_equal_a_forward_pass(model, self.PROMPTS, mask, sampled)

    def test_the_same_seed_draws_the_same_tokens_either_way(self, monkeypatch):
        model = _wide_head_policy(32_768)
        _, weight_first, _ = self._sample_watching_the_head(model, top_k=50)
        monkeypatch.setattr("interop.sampling.sampler._ROWS_FIRST_MIN_WEIGHTS", 1 << 40)
        _, linear, calls = self._sample_watching_the_head(model, top_k=50)
        assert calls and all(call is None for call in calls)
        assert torch.equal(weight_first.tokens, linear.tokens)
        torch.testing.assert_close(weight_first.log_probs, linear.log_probs, atol=1e-5, rtol=1e-5)

    @staticmethod
    def _padded_product(head, flat, padded):
        """The real rows' logits of ``W @ [flat; zeros].T``, the product the weight-first head computes."""
        zeros = flat.new_zeros(padded - flat.shape[0], flat.shape[1])
        product = torch.mm(head.weight, torch.cat([flat, zeros]).t())[:, : flat.shape[0]].t()
        return product + head.bias if head.bias is not None else product

    @pytest.mark.parametrize("rows", [1, 5, 12])  # padded to 2, as it is, padded to 16
    @pytest.mark.parametrize("bias", [False, True])
    def test_the_weight_first_product_is_the_heads_product_in_row_layout(self, rows, bias):
        from interop.sampling.sampler import _HEAD_PADDED_ROWS, _head_for_few_rows

        head = torch.nn.Linear(64, 32_771, bias=bias)  # a vocabulary no small block size divides
        hidden = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(0))
        with _AtenCalls() as recorded:
            logits = _head_for_few_rows(head, hidden)
        padded = _HEAD_PADDED_ROWS.get(rows, rows)
        assert logits.shape == (rows, 1, 32_771) and logits.is_contiguous()
        assert torch.equal(logits[:, 0], self._padded_product(head, hidden[:, 0], padded))
        assert [shapes for name, shapes in recorded.calls if name == "mm"] == [[(32_771, 64), (64, padded)]]
        torch.testing.assert_close(logits, head(hidden), atol=1e-5, rtol=1e-5)
        # Not the 2D transposed copy, which torch runs on one thread: the [V, rows] product is read in 3D.
        assert not [shapes for name, shapes in recorded.calls if name in ("clone", "copy_") and len(shapes[-1]) == 2]

    @pytest.mark.parametrize("top_k", [None, 50])
    def test_padding_the_rows_draws_the_same_tokens(self, monkeypatch, top_k):
        """12 rows (padded to 16) and 1 row (padded to 2): the logits differ from the unpadded product's by float
        rounding only, which moves no draw of this seed; the log-probs agree up to that rounding. (At counts that
        are not padded the product is the one computed before padding existed, bit for bit.) The weight-first product
        only: no packed weight."""
        monkeypatch.setattr("interop.sampling.sampler._packing_available", lambda: False)
        model = _wide_head_policy(32_768)
        prompts = torch.randint(2, 32_768, (12, 5), generator=torch.Generator().manual_seed(0))
        runs = []
        for table in (None, {}):
            if table is not None:
                monkeypatch.setattr("interop.sampling.sampler._HEAD_PADDED_ROWS", table)
            for batch in (prompts, prompts[:1]):
                torch.manual_seed(0)
                runs.append(
                    sample_responses(
                        model,
                        batch,
                        torch.ones_like(batch, dtype=torch.bool),
                        settings=SamplingSettings(max_new_tokens=6, min_new_tokens=6, top_k=top_k),
                        eos_token_ids=[1],
                        pad_token_id=0,
                    )
                )
        for padded, unpadded in zip(runs[:2], runs[2:]):
            assert torch.equal(padded.tokens, unpadded.tokens)
            torch.testing.assert_close(padded.log_probs, unpadded.log_probs, atol=1e-5, rtol=1e-5)

    def test_padded_row_counts_give_the_real_rows_logits_step_after_step(self, monkeypatch):
        """As in a sampling loop without a packed weight: the buffers reused while the rows stay, reallocated as they
        shrink, the padding rows zero throughout; each step's logits those of its own rows (bit for bit the padded
        product's), and the previous step's left intact."""
        from interop.sampling.sampler import _FEW_ROWS_HEAD, _HEAD_PADDED_ROWS, _FewRowsHead, _head_for_few_rows

        monkeypatch.setattr("interop.sampling.sampler._packing_available", lambda: False)
        assert _HEAD_PADDED_ROWS[12] == 16 and _HEAD_PADDED_ROWS[1] == 2 and 16 not in _HEAD_PADDED_ROWS
        head = torch.nn.Linear(64, 32_771, bias=True).requires_grad_(False)
        setattr(head, _FEW_ROWS_HEAD, _FewRowsHead())
        generator = torch.Generator().manual_seed(0)
        previous = None
        for rows in (16, 12, 12, 12, 1, 1):
            hidden = torch.randn(rows, 1, 64, generator=generator) * 4
            with _AtenCalls() as recorded:
                logits = _head_for_few_rows(head, hidden)
            padded = _HEAD_PADDED_ROWS.get(rows, rows)
            assert [shapes for name, shapes in recorded.calls if name == "mm"] == [[(32_771, 64), (64, padded)]]
            assert logits.shape == (rows, 1, 32_771)
            assert torch.equal(logits[:, 0], self._padded_product(head, hidden[:, 0], padded))
            torch.testing.assert_close(logits, head(hidden), atol=1e-5, rtol=1e-5)
            if previous is not None:
                assert torch.equal(previous[0], previous[1])  # the step before's logits, not written over
            previous = (logits, logits.clone())

    @pytest.mark.skipif(not _packing_available(), reason="this torch has no oneDNN weight packing")
    @pytest.mark.parametrize("packing", [True, False], ids=["onednn", "without_onednn"])
    def test_a_loop_packs_the_weight_once_and_keeps_few_rows_on_the_weight_first_product(self, monkeypatch, packing):
        """Rows 12 (packs), 12, 5 (packed), 3 and 1 (weight-first), as a loop whose rows finish: each step's logits
        are the head's own up to float rounding, the step before's left intact; without oneDNN, weight-first
        throughout."""
        from interop.sampling.sampler import _FEW_ROWS_HEAD, _FewRowsHead, _head_for_few_rows

        monkeypatch.setattr("interop.sampling.sampler._packing_available", lambda: packing)
        head = torch.nn.Linear(64, 32_771, bias=True).requires_grad_(False)
        setattr(head, _FEW_ROWS_HEAD, _FewRowsHead())
        generator = torch.Generator().manual_seed(0)
        watched = {"_reorder_linear_weight", "_linear_pointwise", "mm"}
        ops, previous = [], None
        for rows in (12, 12, 5, 3, 1):
            hidden = torch.randn(rows, 1, 64, generator=generator) * 4
            with _AtenCalls() as recorded:
                logits = _head_for_few_rows(head, hidden)
            ops.append(sorted({name for name, _ in recorded.calls} & watched))
            assert logits.shape == (rows, 1, 32_771)
            torch.testing.assert_close(logits, head(hidden), atol=1e-5, rtol=1e-5)
            if previous is not None:
                assert torch.equal(previous[0], previous[1])
            previous = (logits, logits.clone())
        packed = [["_linear_pointwise", "_reorder_linear_weight"], ["_linear_pointwise"], ["_linear_pointwise"]]
        assert ops == (packed if packing else [["mm"]] * 3) + [["mm"], ["mm"]]

    @pytest.mark.skipif(not _packing_available(), reason="this torch has no oneDNN weight packing")
    @pytest.mark.parametrize(("rows", "max_new_tokens", "packs"), [(12, 8, True), (12, 7, False), (8, 32, False)])
    def test_only_a_loop_that_can_win_the_packing_back_packs(self, rows, max_new_tokens, packs):
        """9 rows or more and up to 8 head calls or more: packed; a shorter loop (a short dialog turn) or fewer rows
        keep the weight-first product."""
        model = _wide_head_policy(32_768)
        prompts = torch.randint(2, 32_768, (rows, 5), generator=torch.Generator().manual_seed(0))
        settings = SamplingSettings(max_new_tokens=max_new_tokens, top_k=50)
        with _AtenCalls() as recorded:
            sample_responses(model, prompts, prompts > 0, settings=settings, eos_token_ids=[1], pad_token_id=0)
        assert ("_reorder_linear_weight" in {name for name, _ in recorded.calls}) == packs

    @pytest.mark.skipif(not _packing_available(), reason="this torch has no oneDNN weight packing")
    def test_under_autocast_the_head_keeps_the_weight_first_product_that_autocast_casts(self):
        """oneDNN's packed op has no autocast rule: under CPU autocast a loop's head stays on ``torch.mm``, which
        autocast runs in bfloat16 as it runs ``F.linear``: the same values."""
        from interop.sampling.sampler import _FEW_ROWS_HEAD, _FewRowsHead, _head_for_few_rows

        head = torch.nn.Linear(64, 32_771, bias=False).requires_grad_(False)
        setattr(head, _FEW_ROWS_HEAD, _FewRowsHead())
        hidden = torch.randn(12, 1, 64, generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16), _AtenCalls() as recorded:
            logits = _head_for_few_rows(head, hidden)
            expected = head(hidden)
        names = {name for name, _ in recorded.calls}
        assert "mm" in names and not names & {"_reorder_linear_weight", "_linear_pointwise"}
        assert expected.dtype == torch.bfloat16
        torch.testing.assert_close(logits.float(), expected.float(), atol=2e-2, rtol=2e-2)

    @pytest.mark.skipif(not _packing_available(), reason="this torch has no oneDNN weight packing")
    def test_a_loop_of_many_rows_samples_with_the_packed_weight_as_without(self, monkeypatch):
        """12 rows: the loop packs the head's weight once, draws the tokens the weight-first product draws with this
        seed, with log-probs equal to a forward pass; the next loop packs the weights as they are then (a copy
        packed once is never reused across loops, where the weights may have changed)."""
        model = _wide_head_policy(32_768)
        prompts = torch.randint(2, 32_768, (12, 5), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(prompts, dtype=torch.bool)
        settings = SamplingSettings(max_new_tokens=8, min_new_tokens=8, top_k=50)

        def sample():
            torch.manual_seed(0)
            with _AtenCalls() as recorded:
                sampled = sample_responses(model, prompts, mask, settings=settings, eos_token_ids=[1], pad_token_id=0)
            return sampled, [name for name, _ in recorded.calls if name == "_reorder_linear_weight"]

        packed, packings = sample()
        assert packings == ["_reorder_linear_weight"]
        _assert_log_probs_equal_a_forward_pass(model, prompts, mask, packed)
        monkeypatch.setattr("interop.sampling.sampler._packing_available", lambda: False)
        weight_first, packings = sample()
        assert packings == []
        assert torch.equal(packed.tokens, weight_first.tokens)
        torch.testing.assert_close(packed.log_probs, weight_first.log_probs, atol=1e-5, rtol=1e-5)
        monkeypatch.undo()
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
        changed, _ = sample()
        _assert_log_probs_equal_a_forward_pass(model, prompts, mask, changed)
        assert not torch.allclose(changed.log_probs, packed.log_probs, atol=1e-3)

    def test_the_heads_forward_is_restored_when_sampling_fails(self):
        model = _wide_head_policy(32_768)
        failing = model.model.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            self._sample_watching_the_head(model)
        failing.remove()
        assert "forward" not in vars(model.lm_head)

    @pytest.mark.parametrize(
        "case",
        ["small head", "bfloat16 head", "forward replaced by someone else"],
    )
    def test_other_heads_are_left_alone(self, tiny_policy, case):
        model = {
            "small head": lambda: tiny_policy[0],
            "bfloat16 head": lambda: _wide_head_policy(32_768, dtype=torch.bfloat16),
            "forward replaced by someone else": lambda: _wide_head_policy(32_768),
        }[case]()
        if case == "forward replaced by someone else":  # as accelerate's hooks do
            model.lm_head.forward = lambda hidden: torch.nn.functional.linear(hidden, model.lm_head.weight)
        theirs = vars(model.get_output_embeddings()).get("forward")
        _, _, calls = self._sample_watching_the_head(model)
        assert calls and all(call is theirs for call in calls)
        assert vars(model.get_output_embeddings()).get("forward") is theirs


class TestCausalLMSampler:
    def test_writes_the_dense_layout_the_loss_reads(self, tiny_policy):
        from tensordict import TensorDict

        model, tokenizer = tiny_policy
        tokens, mask = _prompts(tokenizer, PROMPTS)
        policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=8, top_k=50))
        policy.version.fill_(3)
        td = TensorDict({"tokens": {"prompt": tokens}, "masks": {"prompt": mask}}, batch_size=[3])
        torch.manual_seed(0)
        out = policy(td)
        width = tokens.shape[1]
        response = out["tokens", "response"]
        assert torch.equal(out["tokens", "full"], torch.cat([tokens, response], -1))
        full_mask = out["masks", "all_attention_mask"]
        assert full_mask.dtype == torch.bool and torch.equal(full_mask[:, :width], mask)
        log_probs = out["log_probs", "full"]
        assert log_probs.shape == full_mask.shape and (log_probs[:, :width] == 0).all()
        assert (log_probs[:, width:][full_mask[:, width:]] < 0).all()
        assert out["policy_version"].tolist() == [3, 3, 3]

    def test_a_tokenizer_whose_pad_is_eos_is_refused(self, tiny_policy):
        import copy

        model, tokenizer = tiny_policy
        broken = copy.deepcopy(tokenizer)
        broken.pad_token = broken.eos_token
        with pytest.raises(ValueError, match="pad token distinct from EOS"):
            CausalLMSampler(model, broken, settings=SamplingSettings(max_new_tokens=4))

    def test_eos_ids_include_the_generation_configs(self, tiny_policy):
        import copy

        model, tokenizer = tiny_policy
        model = copy.deepcopy(model)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
        policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4))
        assert policy.eos_token_ids == sorted({tokenizer.eos_token_id, 7})

    def test_num_threads_holds_while_it_samples_and_the_process_count_comes_back(self, tiny_policy):
        """``num_threads=1`` in a 2-thread process: every forward pass of the loop runs on 1 thread, and the process is
        back at 2 after the call, and after a call that fails."""
        from _thread_counts import threads_seen_by
        from tensordict import TensorDict

        model, tokenizer = tiny_policy
        tokens, mask = _prompts(tokenizer, PROMPTS)
        td = TensorDict({"tokens": {"prompt": tokens}, "masks": {"prompt": mask}}, batch_size=[3])
        policy = CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4), num_threads=1)
        with threads_seen_by(model, process_threads=2) as seen:
            policy(td.clone())
            assert len(seen) >= 2 and set(seen) == {1}  # the prefill and every decoding step
            assert torch.get_num_threads() == 2

            def fail(module, args):
                raise RuntimeError("a forward pass failed")

            failing = model.get_input_embeddings().register_forward_pre_hook(fail)
            try:
                with pytest.raises(RuntimeError, match="a forward pass failed"):
                    policy(td.clone())
            finally:
                failing.remove()
            assert torch.get_num_threads() == 2

    @pytest.mark.parametrize("num_threads", [0, -1, 1.5, True])
    def test_a_thread_count_that_is_not_a_positive_int_is_refused(self, tiny_policy, num_threads):
        model, tokenizer = tiny_policy
        with pytest.raises(ValueError, match=r"CausalLMSampler: num_threads must be a positive int, or None"):
            CausalLMSampler(model, tokenizer, settings=SamplingSettings(max_new_tokens=4), num_threads=num_threads)


def _sharded_sampling_rank(rank: int, folder: str) -> None:
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.common.config import PROJECT_ROOT
    from recipes.common.sharding import shard_policy

    torch.set_num_threads(1)
    model = shard_policy(AutoModelForCausalLM.from_pretrained(PROJECT_ROOT / "tiny" / "policy").eval())
    tokenizer = AutoTokenizer.from_pretrained(PROJECT_ROOT / "tiny" / "policy", padding_side="left")
    tokens, mask = _prompts(tokenizer, PROMPTS)
    torch.manual_seed(rank)
    sampled = sample_responses(model, tokens, mask, **_early_stop_options(rank, tokenizer))
    result = {"tokens": sampled.tokens.tolist(), "log_probs": sampled.log_probs.tolist(), "next": torch.rand(1)}
    with open(f"{folder}/rank{rank}.json", "w") as handle:
        json.dump({**result, "next": result["next"].item()}, handle)


def _early_stop_options(rank: int, tokenizer) -> dict:
    # Rank 0 ends every response at its first token (every id is an EOS id); rank 1 decodes up to 6 tokens.
    eos = list(range(len(tokenizer))) if rank == 0 else [tokenizer.eos_token_id]
    settings = SamplingSettings(max_new_tokens=6, top_k=50)
    return {"settings": settings, "eos_token_ids": eos, "pad_token_id": tokenizer.pad_token_id}


def test_sharded_ranks_decode_in_step_and_sample_as_alone(tmp_path, tiny_policy):
    """Under FSDP2 every forward pass is a collective: a rank done first keeps running them (without drawing tokens)
    until the other is done too; each rank samples what it would have sampled unsharded and alone."""
    import json

    from _processes import run_gloo_ranks

    # A rank that stopped its forwards early would hang the other.
    assert run_gloo_ranks(_sharded_sampling_rank, str(tmp_path)) == [0, 0]

    model, tokenizer = tiny_policy
    tokens, mask = _prompts(tokenizer, PROMPTS)
    for rank in range(2):
        torch.manual_seed(rank)
        alone = sample_responses(model, tokens, mask, **_early_stop_options(rank, tokenizer))
        sharded = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sharded["tokens"] == alone.tokens.tolist()
        torch.testing.assert_close(torch.tensor(sharded["log_probs"]), alone.log_probs)
        assert sharded["next"] == torch.rand(1).item()  # the RNG was left where decoding alone leaves it
    assert len(json.loads((tmp_path / "rank0.json").read_text())["tokens"][0]) == 1
