"""Chapter 08's sampler and SamplingParams: validation, greedy, and temperature / top-k / top-p
tested as distributions (chi-square against probabilities worked out independently), seeds,
and log-probabilities. No model needed."""

import numpy as np
import pytest

from tinyvllm_lib import SamplingParams
from tinyvllm_lib.engine.sampler import Sampler, SamplingMetadata, top_logprobs
from tinyvllm_lib.kernels.softmax import log_softmax

# Upper 0.1% points of the chi-square distribution, P(X > x) = 0.001, by degrees of freedom.
# Pearson's chi-square critical values by degrees of freedom, at 0.001 for the family of this file's 32 frequency
# tests (Bonferroni: 0.001 / 32 = 3.1e-5 each; scipy.stats.chi2.isf(0.001 / 32, dof)). At 0.001 each, about one
# run in 30 failed by chance: the NumPy reference sampler once drew chi2 = 23.9 on 6 degrees of freedom
# (p = 5.4e-4, rng seed 3529161102). A real fault moves chi2 by hundreds at 20,000 draws (one token of 1.5%
# wrongly kept or dropped: about 300).
CHI2_CRITICAL = {1: 17.340, 2: 20.747, 3: 23.534, 4: 26.027, 5: 28.339, 6: 30.523, 7: 32.613, 8: 34.628, 9: 36.582}
NUM_SAMPLES = 20_000
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


def expected_probs(logits, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """The distribution vLLM samples from, computed one token at a time in float64: T, then min-p, then top-k
    (ties with the k-th kept), then top-p (a token stays if the tokens strictly more likely hold less than p)."""
    z = np.asarray(logits, np.float64) / temperature
    weights = np.exp(z - z.max())
    keep = weights >= min_p  # p_i >= min_p * p_max
    if top_k > 0:
        kth = np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= z >= kth
    probs = np.where(keep, weights, 0.0) / weights[keep].sum()
    if top_p < 1:
        keep &= np.array([probs[z > zi].sum() < top_p for zi in z])
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def draw(params: SamplingParams, logits=LOGITS, num: int = NUM_SAMPLES, seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    batch = np.tile(np.asarray(logits, np.float32), (num, 1))
    return Sampler()(batch, SamplingMetadata.from_params([params] * num, [gen] * num)).token_ids


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; categories expected fewer than 5 times are pooled."""
    expected = probs * counts.sum()
    is_big = expected >= 5
    observed_bins, expected_bins = list(counts[is_big]), list(expected[is_big])
    rare = (probs > 0) & ~is_big
    if rare.any():
        if expected[rare].sum() >= 5:
            observed_bins.append(counts[rare].sum())
            expected_bins.append(expected[rare].sum())
        else:  # too rare even pooled: fold into the smallest category
            i = int(np.argmin(expected_bins))
            observed_bins[i] += counts[rare].sum()
            expected_bins[i] += expected[rare].sum()
    o, e = np.array(observed_bins, np.float64), np.array(expected_bins)
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


# --- SamplingParams ---


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.ignore_eos) == (1, 1.0, 1.0, -1, 16, None, False)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.prompt_logprobs is None
    assert p.min_p == 0.0
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0) and not p.has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties and SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams(temperature=0.1).is_greedy


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": "hot"},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": -2}, {"top_k": 2.5},
    {"min_p": -0.1}, {"min_p": 1.5}, {"min_p": float("nan")}, {"min_p": "0.1"},
    {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 1.5}, {"n": 2}, {"n": 0},
    {"logprobs": -1}, {"prompt_logprobs": -2}, {"seed": 1.5}, {"seed": "x"},
    {"stop": [""]}, {"stop": ["ok", 3]}, {"stop": 5}, {"stop_token_ids": [-1]}, {"stop_token_ids": ["a"]},
    {"ignore_eos": "yes"},
    {"presence_penalty": 2.5}, {"presence_penalty": float("nan")}, {"frequency_penalty": -2.1},
    {"frequency_penalty": "1"}, {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
    {"repetition_penalty": float("inf")}, {"repetition_penalty": 1e-46},
])
def test_bad_sampling_params_raise(bad):
    with pytest.raises(ValueError) as err:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(err.value)  # the message names the field


# --- greedy and the sampler's interface ---


def test_greedy_is_argmax(rng):
    logits = rng.standard_normal((7, 1000)).astype(np.float32)
    out = Sampler()(logits, SamplingMetadata.from_params([SamplingParams(temperature=0)] * 7, [rng] * 7))
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=1))
    assert out.logprobs is None and out.top_ids is None


def test_greedy_ignores_top_k_top_p_and_draws_nothing():
    gen = np.random.default_rng(5)
    state = gen.bit_generator.state
    params = SamplingParams(temperature=0, top_k=2, top_p=0.1)
    out = Sampler()(LOGITS[None], SamplingMetadata.from_params([params], [gen]))
    assert out.token_ids[0] == 0 and gen.bit_generator.state == state


def test_bad_logits_shape_raises():
    meta = SamplingMetadata.from_params([SamplingParams()], [np.random.default_rng()])
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler()(np.zeros((2, 5), np.float32), meta)


# --- distributions ---


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0), (0.5, -1, 1.0, 0), (2.0, 0, 1.0, 0),  # temperature alone
    (1.0, 3, 1.0, 0), (1.0, 1, 1.0, 0), (0.7, 5, 1.0, 0),  # top-k
    (1.0, -1, 0.7, 0), (1.0, -1, 0.9, 0), (1.0, -1, 0.05, 0),  # top-p (0.05: only the first token)
    (0.7, 5, 0.8, 0), (1.5, 4, 0.6, 0), (0.8, 2, 0.9, 0),  # T, top-k and top-p, in vLLM's order
    (1.0, -1, 1.0, 0.1), (2.0, -1, 1.0, 0.3), (0.5, -1, 1.0, 0.01),  # min-p (after T: 0.5 sharpens)
    (1.0, 2, 1.0, 0.3), (1.5, -1, 0.8, 0.2), (1.2, 6, 0.95, 0.05),  # min-p with top-k and top-p
])
def test_sampling_frequencies_match_the_distribution(rng, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = expected_probs(LOGITS, temperature, top_k, top_p, min_p)
    counts = np.bincount(draw(params, seed=int(rng.integers(2**32))), minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0, f"drew tokens {np.flatnonzero((probs == 0) & (counts > 0))} that must not appear"
    if (probs > 0).sum() == 1:
        return
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_CRITICAL[dof], f"chi2 = {stat:.1f} with {dof} degrees of freedom; counts {counts}, expected {probs}"


def test_top_p_boundary_is_the_mass_before_the_token():
    # probabilities 0.665, 0.245, 0.090: the mass before token 1 is 0.665; p = 0.66 drops it, p = 0.67 keeps it
    logits = np.array([1.0, 0.0, -1.0], np.float32)
    assert set(draw(SamplingParams(top_p=0.66), logits, 4000)) == {0}
    assert set(draw(SamplingParams(top_p=0.67), logits, 4000)) == {0, 1}


def test_top_p_keeps_a_tie_at_its_boundary_whole():
    # probabilities 0.534, 0.197, 0.197, 0.072: at p = 0.6 the tie (tokens 1 and 2) has 0.534 above it: both stay,
    # whatever their positions (a sort-and-cut would keep the first and drop the second); at p = 0.5 neither
    for logits in ([1.0, 0.0, 0.0, -1.0], [0.0, -1.0, 1.0, 0.0]):
        z = np.array(logits, np.float32)
        tie = set(np.flatnonzero(z == 0.0))
        assert set(draw(SamplingParams(top_p=0.6), z, 4000)) == {int(np.argmax(z))} | tie
        assert set(draw(SamplingParams(top_p=0.5), z, 4000)) == {int(np.argmax(z))}


def test_min_p_is_relative_to_the_most_likely_token():
    # p_i / p_max = e^(z_i - 2): 1, 0.61, 0.37, 0.22, 0.14, ...; min_p = 0.3 keeps tokens 0-2, and at T = 2
    # (ratios e^((z_i - 2) / 2)) tokens 0-4 (0.37 at token 4); min_p = 1 keeps the max alone
    assert set(draw(SamplingParams(min_p=0.3), num=4000)) == {0, 1, 2}
    assert set(draw(SamplingParams(min_p=0.3, temperature=2.0), num=4000)) == {0, 1, 2, 3, 4}
    assert set(draw(SamplingParams(min_p=1.0), num=1000)) == {0}


def test_top_k_keeps_ties_with_the_kth():
    logits = np.array([3.0, 1.0, 1.0, 0.0], np.float32)
    assert set(draw(SamplingParams(top_k=2, temperature=2.0), logits, 4000)) == {0, 1, 2}


def test_order_temperature_then_top_k_then_top_p():
    # top-p acts on the top-k survivors' renormalised probabilities. Alone, p = 0.6 keeps tokens 0 and 1
    # (the mass before token 1 is 0.40); after top-k = 2 token 0 holds 0.62 of the mass, so only it is kept
    assert set(draw(SamplingParams(top_p=0.6), num=4000)) == {0, 1}
    assert set(draw(SamplingParams(top_k=2, top_p=0.6), num=4000)) == {0}
    assert (expected_probs(LOGITS, 1.0, 2, 0.6) > 0).sum() == 1
    # temperature comes first: at T = 3 the distribution is flatter, and top-p = 0.6 keeps more tokens
    assert (expected_probs(LOGITS, 3.0, -1, 0.6) > 0).sum() > (expected_probs(LOGITS, 1.0, -1, 0.6) > 0).sum()
    assert set(draw(SamplingParams(temperature=3.0, top_p=0.6), num=4000)) == set(np.flatnonzero(expected_probs(LOGITS, 3.0, -1, 0.6)))


def test_masked_tokens_never_drawn_even_at_u_close_to_one():
    logits = np.array([[1.0, 0.5, -np.inf, -np.inf]], np.float32)
    meta = SamplingMetadata(np.ones(1, np.float32), np.zeros(1, np.int64), np.ones(1, np.float32),
                            np.array([np.nextafter(1.0, 0.0)]), np.full(1, -1, np.int64))
    assert Sampler()(logits, meta).token_ids[0] == 1


# --- penalties: vLLM's presence, frequency and repetition penalties, before temperature ---

PROMPT_IDS, OUTPUT_IDS = [3, 6], [0, 0, 1, 6, 7]  # token 0 twice in the output; 6 in both; 3 only in the prompt


def penalized(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0) -> np.ndarray:
    """vLLM's definitions, one token at a time in float64: a token in the prompt or the output has its logit divided
    by r if positive, multiplied by r if not; then minus f times its count in the output, minus p if it is there."""
    z = np.array(logits, np.float64)
    for t in range(len(z)):
        count = output.count(t)
        if count or t in prompt:
            z[t] = z[t] / repetition if z[t] > 0 else z[t] * repetition
        z[t] -= frequency * count + presence * (count > 0)
    return z


def draw_penalized(params: SamplingParams, logits=LOGITS, num: int = NUM_SAMPLES, seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    batch = np.tile(np.asarray(logits, np.float32), (num, 1))
    meta = SamplingMetadata.from_params([params] * num, [gen] * num, [(PROMPT_IDS, OUTPUT_IDS)] * num)
    return Sampler()(batch, meta).token_ids


@pytest.mark.parametrize("temperature, top_k, top_p, repetition, frequency, presence", [
    (1.0, -1, 1.0, 1.0, 0.8, 0.0), (1.0, -1, 1.0, 1.0, 0.0, 1.5), (1.0, -1, 1.0, 1.8, 0.0, 0.0),  # each alone
    (1.0, -1, 1.0, 1.0, -0.7, -1.2),  # negative: encourages repeats
    (1.0, -1, 1.0, 0.6, 0.0, 0.0),  # r < 1: encourages repeats too
    (0.7, -1, 1.0, 1.3, 0.5, 0.4), (1.5, 4, 0.9, 2.0, 1.0, 0.3),  # all three, with T, top-k, top-p
])
def test_penalized_frequencies_match_vllms_distribution(rng, temperature, top_k, top_p, repetition, frequency,
                                                         presence):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition,
                            frequency_penalty=frequency, presence_penalty=presence)
    z = penalized(LOGITS, PROMPT_IDS, OUTPUT_IDS, repetition, frequency, presence)
    probs = expected_probs(z, temperature, top_k, top_p)
    assert not np.allclose(probs, expected_probs(LOGITS, temperature, top_k, top_p), atol=0.01)  # it moves
    counts = np.bincount(draw_penalized(params, seed=int(rng.integers(2**32))), minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_CRITICAL[dof], f"chi2 = {stat:.1f} with {dof} degrees of freedom; counts {counts}, expected {probs}"


def test_a_penalty_changes_the_distribution_as_vllm_defines_it():
    """Worked by hand on LOGITS = 2, 1.5, 1, 0.5, 0, -0.5, -1, -3 with prompt {3, 6} and output 0, 0, 1, 6, 7.
    Frequency 0.5: token 0 (twice) 2 -> 1, token 1 1.5 -> 1, 6 and 7 down 0.5, 3 (prompt only) untouched.
    Presence 0.5: 0 and 1 both down 0.5 (a count, not how many times). Repetition 2: 2 -> 1, 1.5 -> 0.75,
    0.5 -> 0.25 (prompt), -1 -> -2 and -3 -> -6 (negative: multiplied, so still pushed down). All three: 0 ends
    at -0.5 and greedy picks token 2, never in the output."""
    out = OUTPUT_IDS
    want = {
        (1.0, 0.5, 0.0): [1.0, 1.0, 1.0, 0.5, 0.0, -0.5, -1.5, -3.5],
        (1.0, 0.0, 0.5): [1.5, 1.0, 1.0, 0.5, 0.0, -0.5, -1.5, -3.5],
        (2.0, 0.0, 0.0): [1.0, 0.75, 1.0, 0.25, 0.0, -0.5, -2.0, -6.0],
        (2.0, 0.5, 0.5): [-0.5, -0.25, 1.0, 0.25, 0.0, -0.5, -3.0, -7.0],
    }
    for (r, f, p), logits in want.items():
        np.testing.assert_array_equal(penalized(LOGITS, PROMPT_IDS, out, r, f, p), logits)
        meta = SamplingMetadata.from_params([SamplingParams(temperature=0, repetition_penalty=r, frequency_penalty=f,
                                                            presence_penalty=p, logprobs=7)],
                                            [np.random.default_rng(0)], [(PROMPT_IDS, out)])
        got = Sampler()(LOGITS[None], meta)
        # greedy rows are penalized too: the argmax of the penalized logits (the first of ties)
        assert got.token_ids[0] == int(np.argmax(logits))
        # and the log-probs are those of the penalized logits
        np.testing.assert_allclose(got.top_logprobs[0], np.sort(log_softmax(np.float32(logits)[None])[0])[::-1][:7],
                                   atol=1e-6)


def test_penalties_touch_only_their_rows_and_cost_nothing_when_off():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=2.0),
              SamplingParams(temperature=0, repetition_penalty=1.0)]
    tokens = [([0], [0, 0]), ([0], [0, 0]), ([0], [0, 0])]
    meta = SamplingMetadata.from_params(params, [np.random.default_rng(0)] * 3, tokens)
    assert meta.penalty_tokens[0] is None and meta.penalty_tokens[2] is None and meta.has_penalties
    assert Sampler()(np.tile(LOGITS, (3, 1)), meta).token_ids.tolist() == [0, 1, 0]
    plain = SamplingMetadata.from_params(params[:1], [np.random.default_rng(0)], tokens[:1])
    assert plain.penalty_tokens is None and not plain.has_penalties  # no row asks: nothing kept


def test_the_server_maps_the_penalties_onto_sampling_params():
    from tinyvllm_lib.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        OpenAIError,
    )

    body = {"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2}
    request = CompletionRequest(**body)
    request.check_supported()
    p = request.sampling_params(16, None, "logprobs")
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(16, None, "top_logprobs")
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        with pytest.raises(OpenAIError) as err:
            CompletionRequest(prompt="x", **{name: value}).sampling_params(16, None, "logprobs")
        assert err.value.param == name


# --- seeds ---


def test_same_seed_same_tokens_different_seed_different_tokens():
    params = SamplingParams(temperature=1.0)
    a, b, c = draw(params, num=200, seed=42), draw(params, num=200, seed=42), draw(params, num=200, seed=43)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_each_row_uses_its_own_generator():
    logits = np.tile(LOGITS, (3, 1))
    params = [SamplingParams(seed=1), SamplingParams(temperature=0), SamplingParams(seed=2)]
    gens = [np.random.default_rng(1), np.random.default_rng(99), np.random.default_rng(2)]
    batch = Sampler()(logits, SamplingMetadata.from_params(params, gens)).token_ids
    alone = [Sampler()(LOGITS[None], SamplingMetadata.from_params([p], [np.random.default_rng(s)])).token_ids[0]
             for p, s in zip(params, (1, 99, 2))]
    np.testing.assert_array_equal(batch, alone)
    assert batch[1] == 0  # the greedy row


# --- log-probabilities ---


def metadata_one_field_at_a_time(params, generators, tokens):
    """SamplingMetadata as it was built before each request kept its settings row: a list per field over the
    params, each sampled row drawing from its own generator in row order."""
    penalized = [p.has_penalties for p in params]
    return SamplingMetadata(
        temperature=np.array([0.0 if p.is_greedy else p.temperature for p in params], np.float32),
        top_k=np.array([max(p.top_k, 0) for p in params], np.int64),
        top_p=np.array([p.top_p for p in params], np.float32),
        min_p=np.array([p.min_p for p in params], np.float32),
        uniform=np.array([0.0 if p.is_greedy else g.random() for p, g in zip(params, generators)], np.float64),
        num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], np.int64),
        repetition_penalty=np.array([p.repetition_penalty for p in params], np.float32),
        frequency_penalty=np.array([p.frequency_penalty for p in params], np.float32),
        presence_penalty=np.array([p.presence_penalty for p in params], np.float32),
        penalty_tokens=[t if on else None for t, on in zip(tokens, penalized)] if any(penalized) else None,
    )


@pytest.mark.parametrize("shared", [True, False])
def test_metadata_from_each_requests_settings_row_is_a_fresh_build(rng, shared):
    """The step's SamplingMetadata is made from the settings row each Request made once (settings_row's bytes,
    joined): field for field, draw for draw, it is what a build from the params gives, whether the rows share
    one generator (drawn in one call) or have their own."""
    from tinyvllm_lib.engine.request import Request

    for _ in range(20):
        rows = int(rng.integers(0, 40))
        params = [SamplingParams(temperature=float(rng.choice([0.0, 1e-6, 1e-5, 0.6, 1.0, 1.7])),
                                 top_k=int(rng.choice([-1, 0, 1, 50, 2**31 - 1])), top_p=float(rng.choice([1.0, 0.9, 0.1])),
                                 min_p=float(rng.choice([0.0, 0.05])), logprobs=rng.choice([None, 0, 5, 20]),
                                 repetition_penalty=float(rng.choice([1.0, 1.1])),
                                 frequency_penalty=float(rng.choice([0.0, 0.0, -0.5])),
                                 presence_penalty=float(rng.choice([0.0, 0.0, 2.0])), max_tokens=4)
                  for _ in range(rows)]
        seed = int(rng.integers(2**32))

        def generators():  # the engine's one generator for every row, or one per row
            one = np.random.default_rng(seed)
            return [one if shared else np.random.default_rng(seed + i) for i in range(rows)]

        gens, ref_gens = generators(), generators()
        requests = [Request(str(i), None, [1, 2], p, 4, [], generator=g) for i, (p, g) in enumerate(zip(params, gens))]
        tokens = [(r.prompt_token_ids, r.output_token_ids) for r in requests]
        got = SamplingMetadata.from_settings(b"".join(r.sampling_settings for r in requests), gens, tokens)
        want = metadata_one_field_at_a_time(params, ref_gens, tokens)
        again = SamplingMetadata.from_params(params, generators(), tokens)
        for name in ("temperature", "top_k", "top_p", "min_p", "num_logprobs", "repetition_penalty",
                     "frequency_penalty", "presence_penalty", "penalty_slot"):
            for built in (got, again):
                assert getattr(built, name).dtype == getattr(want, name).dtype, name
                np.testing.assert_array_equal(getattr(built, name), getattr(want, name), err_msg=name)
        np.testing.assert_array_equal(got.uniform, want.uniform)
        assert got.penalty_tokens == want.penalty_tokens
        # the generators are where the one-by-one draws left them
        assert [g.random() for g in gens[:3]] == [g.random() for g in ref_gens[:3]]


def test_logprobs_are_the_raw_distributions(rng):
    logits = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0.5, top_k=10, logprobs=5), SamplingParams(temperature=0, logprobs=0),
              SamplingParams(top_p=0.5, logprobs=3), SamplingParams()]
    out = Sampler()(logits, SamplingMetadata.from_params(params, [rng] * 4))
    want = log_softmax(logits)  # before temperature, top-k and top-p
    np.testing.assert_allclose(out.logprobs, want[np.arange(4), out.token_ids], atol=1e-6)
    assert out.top_ids.shape == (4, 5)
    for row in range(4):
        np.testing.assert_array_equal(out.top_ids[row], np.argsort(-want[row], kind="stable")[:5])
        np.testing.assert_allclose(out.top_logprobs[row], np.sort(want[row])[::-1][:5], atol=1e-6)


def test_top_logprobs_clamps_k_to_the_vocabulary():
    ids, values = top_logprobs(log_softmax(LOGITS[None]), 100)
    assert ids.shape == (1, len(LOGITS)) and list(ids[0]) == list(range(len(LOGITS)))
    assert np.all(np.diff(values[0]) <= 0)


# --- the GPU sampler's greedy rows, split into shares (simulator in CI, real shapes on a GPU) ---


def greedy_ids(logits: np.ndarray, sampler=None) -> list[int]:
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    rows, vocab = logits.shape
    sampler = sampler or CudaSampler(vocab, rows)
    meta = SamplingMetadata.from_params([SamplingParams(temperature=0)] * rows, [np.random.default_rng(0)] * rows)
    return sampler(logits, meta).token_ids.tolist()


def test_gpu_greedy_shares_keep_the_first_of_ties_and_reset_their_tickets(rng):
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler
    from tinyvllm_lib.kernels.sampling import greedy_shares

    rows, vocab = 4, 203  # not a multiple of the shares: the last share is short
    z = rng.standard_normal((rows, vocab)).astype(np.float32)
    top = z.max() + 1
    z[0, [5, vocab - 1]] = top  # a tie across the first and the last share
    z[1, [150, 151]] = top  # a tie inside one share
    z[2, vocab - 1] = top  # the row's very last logit
    z[3, :] = -np.inf  # nothing above -inf: index vocab, as a one-block argmax gives
    z[3, 0] = np.nan  # and a NaN is never the largest
    assert greedy_shares(rows) > 1
    sampler = CudaSampler(vocab, rows)
    want = [5, 150, vocab - 1, vocab]
    for _ in range(2):  # the tickets are back at zero after a launch
        assert greedy_ids(z, sampler) == want
        assert not sampler.tickets.copy_to_host().any()


def test_gpu_sampler_mixes_split_greedy_rows_with_whole_sampled_rows(rng):
    """Sampled rows next to split greedy rows: the same draws as the NumPy sampler."""
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    z = (rng.standard_normal((5, 300)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, seed=5), SamplingParams(temperature=0),
              SamplingParams(top_p=0.6, seed=6), SamplingParams(temperature=1.2, seed=7)]

    def draw_all(sampler):
        return sampler(z, SamplingMetadata.from_params(params, [np.random.default_rng(p.seed) for p in params])).token_ids.tolist()

    on_gpu = draw_all(CudaSampler(300, 5))
    assert on_gpu == draw_all(Sampler())
    assert on_gpu[0] == z[0].argmax() and on_gpu[2] == z[2].argmax()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 128, 256])
def test_gpu_greedy_shares_at_llama_vocab(rng, rows):
    """Share counts the engine uses (64 at 1 row, 32 at 8, 4 at 64, 2 at 128, 1 at 256): argmax of 128,256 logits."""
    vocab = 128256
    z = rng.standard_normal((rows, vocab)).astype(np.float32)
    hits = rng.integers(0, vocab, (rows, 2))
    z[np.arange(rows), hits[:, 0]] = z[np.arange(rows), hits[:, 1]] = 6.0  # a tie, mostly across shares
    assert greedy_ids(z) == z.argmax(1).tolist()


# --- the GPU sampler's sampled rows: radix select over float keys (simulator in CI, real shapes on a GPU) ---


def gpu_and_numpy(z: np.ndarray, params: list, uniforms=None, every_step: bool = False):
    """The GPU sampler's and the NumPy sampler's tokens for the same rows and the same uniforms. every_step: launch
    all the steps, as a captured graph does, instead of those the batch needs."""
    from numba import cuda

    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    rows, vocab = z.shape
    meta = SamplingMetadata.from_params(params, [np.random.default_rng(i) for i in range(rows)])
    if uniforms is not None:
        meta.uniform = np.asarray(uniforms, np.float64)
    sampler = CudaSampler(vocab, rows)
    if every_step:
        from tinyvllm_lib.engine.sampler_cuda import SETTING_DTYPES

        settings = {name: cuda.to_device(np.ascontiguousarray(getattr(meta, name), dtype))
                    for name, dtype in SETTING_DTYPES.items()}
        sampler.launch(cuda.to_device(z), 0, settings)  # every step, as a graph launches them
        got = sampler.ids.copy_to_host()[:rows]
    else:
        got = sampler(z, meta).token_ids
    ws = sampler.workspace
    assert not ws["tickets"].copy_to_host().any() and not ws["hist_count"].copy_to_host().any()
    assert not ws["hist_mass"].copy_to_host().any()  # every step leaves its histograms at zero
    return got.tolist(), Sampler()(z, meta).token_ids.tolist()


MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(top_k=5),
         SamplingParams(top_p=0.6), SamplingParams(min_p=0.1), SamplingParams(temperature=0.6, top_p=0.9),
         SamplingParams(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05), SamplingParams(top_k=1),
         SamplingParams(top_k=500, top_p=0.05), SamplingParams(temperature=2.0, min_p=0.5, top_k=3)]


@pytest.mark.parametrize("every_step", [False, True])
def test_gpu_sampler_is_the_numpy_samplers_token_for_token(rng, every_step):
    """Every setting in one batch (greedy rows among them): the same token as NumPy's for the same uniform."""
    z = (rng.standard_normal((len(MIXED), 77)) * 2).astype(np.float32)
    got, want = gpu_and_numpy(z, MIXED, every_step=every_step)
    assert got == want


def test_gpu_sampler_breaks_ties_as_numpy_does(rng):
    """Thresholds inside ties: top-k's k-th value repeated (every tie kept), top-p's boundary in a tie (kept whole),
    min-p's floor equal to tokens, equal maxima split over the shares, the draw near u = 0 and u = 1."""
    vocab = 90
    z = np.round(rng.standard_normal((8, vocab)), 1).astype(np.float32)  # many equal values
    z[3, [2, 60]] = z[3].max() + 1.0  # the max twice, in different shares
    z[4] = 0.0
    z[4, [10, 70]] = 1.0  # top-p 0.1: the two maxima hold 0.06; the 88 zeros are one tie, kept whole
    z[5, :] = -np.inf
    z[5, [7, 50, 89]] = [0.0, np.log(0.5), np.log(0.5)]  # min-p 0.5: the two halves are on its floor
    params = [SamplingParams(top_k=7), SamplingParams(top_k=30, temperature=0.7), SamplingParams(top_p=0.5),
              SamplingParams(top_k=2, temperature=0.5), SamplingParams(top_p=0.1), SamplingParams(min_p=0.5),
              SamplingParams(top_p=0.3, temperature=0.9), SamplingParams(top_k=4, top_p=0.9, min_p=0.2)]
    for uniforms in (rng.random(8), np.full(8, np.nextafter(1.0, 0.0))):  # (u = 0: below)
        got, want = gpu_and_numpy(z, params, uniforms)
        assert got == want, f"uniforms {uniforms}"
    # the kept sets themselves: the tokens drawn by u on a grid over [0, 1)
    rows = [3, 4, 5]
    grid = np.array([0.0, 0.2, 0.4, 0.6, 0.8, 0.999])
    z_rep, params_rep = np.repeat(z[rows], len(grid), axis=0), [params[r] for r in rows for _ in grid]
    got, want = gpu_and_numpy(z_rep, params_rep, np.tile(grid, len(rows)))
    assert got == want
    kept = {r: set(got[i * len(grid):(i + 1) * len(grid)]) for i, r in enumerate(rows)}
    assert kept[3] <= {2, 60} and kept[5] == {7, 50, 89}
    assert len(kept[4] - {10, 70}) > 1 and (z[4, sorted(kept[4])] >= 0).all()  # the tie of zeros is in


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_sampler_at_llama_vocab(rng, rows):
    """128,256 logits a row, every setting, the shares the engine uses. Float32 sums against NumPy's float64 can move
    a threshold or a draw that lands within rounding of a boundary: at most 1% of rows may differ."""
    z = (rng.standard_normal((rows, 128256)) * 3).astype(np.float32)
    params = [MIXED[i % len(MIXED)] for i in range(rows)]
    got, want = gpu_and_numpy(z, params, rng.random(rows))
    assert sum(g != w for g, w in zip(got, want)) <= rows // 100


@pytest.mark.gpu
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, -1, 1.0, 0.3), (1.5, -1, 0.8, 0.2),
                                                              (0.7, 5, 0.9, 0.0), (1.2, 6, 0.95, 0.05)])
def test_gpu_sampler_frequencies_match_the_distribution(rng, temperature, top_k, top_p, min_p):
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    gen = np.random.default_rng(int(rng.integers(2**32)))
    meta = SamplingMetadata.from_params([params] * NUM_SAMPLES, [gen] * NUM_SAMPLES)
    got = CudaSampler(len(LOGITS), NUM_SAMPLES)(np.tile(LOGITS, (NUM_SAMPLES, 1)), meta).token_ids
    probs = expected_probs(LOGITS, temperature, top_k, top_p, min_p)
    counts = np.bincount(got, minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_CRITICAL[dof], f"chi2 = {stat:.1f} with {dof} degrees of freedom; counts {counts}"


# --- the GPU's penalties: counts in device slots (simulator in CI, real shapes on a GPU) ---

PENALIZED = [SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(frequency_penalty=1.0),
             SamplingParams(presence_penalty=-0.8, temperature=0.7), SamplingParams(temperature=0),
             SamplingParams(repetition_penalty=0.7, frequency_penalty=0.3, presence_penalty=0.5, top_k=5),
             SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0)]


def penalized_batch(rng, vocab: int):
    z = (rng.standard_normal((len(PENALIZED), vocab)) * 2).astype(np.float32)
    tokens = [(rng.integers(0, vocab, 6).tolist(), rng.integers(0, vocab, 9).tolist()) for _ in PENALIZED]
    for row, (_, output) in enumerate(tokens):
        z[row, output[0]] = z[row].max() + 0.3  # the favourite is a repeat: greedy rows change their minds
    meta = SamplingMetadata.from_params(PENALIZED, [np.random.default_rng(i) for i in range(len(PENALIZED))], tokens)
    return z, meta, tokens


def test_gpu_penalties_are_the_numpy_references(rng):
    """apply_penalties_gpu against apply_penalties on the same slots (float32 either way: equal to 1e-6), and the
    whole GPU sampler's tokens against the NumPy sampler's, greedy rows among them; then each penalized row's slot
    holds its output counts plus the token just sampled, and the rows without penalties touched no slot."""
    from numba import cuda

    from tinyvllm_lib.engine.sampler import apply_penalties
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler
    from tinyvllm_lib.kernels.penalties import apply_penalties_gpu

    vocab = 77
    z, meta, tokens = penalized_batch(rng, vocab)
    sampler = CudaSampler(vocab, len(PENALIZED) + 1)
    slot = np.array([-1 if t is None else i for i, t in enumerate(meta.penalty_tokens)], np.int32)
    assert slot.tolist() == [0, 1, 2, -1, 4, 5]
    for i in np.flatnonzero(slot >= 0):
        sampler.penalties.fill(int(i), *tokens[i])
    d = cuda.to_device(z)
    apply_penalties_gpu(d, cuda.to_device(slot), *(cuda.to_device(getattr(meta, n)) for n in
                        ("repetition_penalty", "frequency_penalty", "presence_penalty")),
                        sampler.penalties.counts, sampler.penalties.in_prompt)
    want = apply_penalties(z, meta.penalty_tokens, meta.repetition_penalty, meta.frequency_penalty,
                           meta.presence_penalty)
    np.testing.assert_allclose(d.copy_to_host(), want, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(want, z)

    got, ref = sampler(z, meta).token_ids, Sampler()(z, meta).token_ids
    assert got.tolist() == ref.tolist()
    plain = SamplingMetadata.from_params(PENALIZED, [np.random.default_rng(i) for i in range(len(PENALIZED))])
    unpenalized = Sampler()(z, plain).token_ids
    assert got[5] != unpenalized[5]  # the repeat lost its place
    counts = sampler.penalties.counts.copy_to_host()
    for i in np.flatnonzero(slot >= 0):
        np.testing.assert_array_equal(counts[i], np.bincount(tokens[i][1] + [int(got[i])], minlength=vocab))
    assert not counts[3].any() and not counts[6].any()


@pytest.mark.gpu
@pytest.mark.parametrize("temperature, top_k, top_p, repetition, frequency, presence", [
    (1.0, -1, 1.0, 1.8, 0.0, 0.0), (1.0, -1, 1.0, 1.0, -0.7, -1.2), (1.5, 4, 0.9, 2.0, 1.0, 0.3)])
def test_gpu_penalized_frequencies_match_vllms_distribution(rng, temperature, top_k, top_p, repetition, frequency,
                                                             presence):
    from tinyvllm_lib.engine.sampler_cuda import CudaSampler

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition,
                            frequency_penalty=frequency, presence_penalty=presence)
    gen = np.random.default_rng(int(rng.integers(2**32)))
    meta = SamplingMetadata.from_params([params] * NUM_SAMPLES, [gen] * NUM_SAMPLES,
                                        [(PROMPT_IDS, OUTPUT_IDS)] * NUM_SAMPLES)
    got = CudaSampler(len(LOGITS), NUM_SAMPLES)(np.tile(LOGITS, (NUM_SAMPLES, 1)), meta).token_ids
    probs = expected_probs(penalized(LOGITS, PROMPT_IDS, OUTPUT_IDS, repetition, frequency, presence), temperature,
                           top_k, top_p)
    counts = np.bincount(got, minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_CRITICAL[dof], f"chi2 = {stat:.1f} with {dof} degrees of freedom; counts {counts}"


def test_penalty_slots_are_freed_when_a_request_stops_running_and_rebuilt_from_its_tokens():
    """A slot a request with penalties, none for one without; a finished or preempted request's slot is freed at the
    next step, and a preempted one that runs again gets a slot rebuilt from the tokens the host holds (what the device
    counted for it meanwhile is gone); a step planned ahead never hands out a slot (the host lacks a token)."""
    from tinyvllm_lib.engine.penalty_slots import PenaltySlots
    from tinyvllm_lib.engine.request import Request, RequestStatus

    def request(name, prompt, params):
        r = Request(name, None, prompt, params, max_tokens=10, eos_token_ids=[])
        r.status = RequestStatus.RUNNING
        return r

    vocab = 12
    slots = PenaltySlots(vocab, 2)
    a = request("a", [1, 2, 2], SamplingParams(frequency_penalty=1.0))
    b = request("b", [3], SamplingParams())
    c = request("c", [4], SamplingParams(repetition_penalty=1.2))
    a.output_token_ids = [5, 5, 7]
    assert slots.slots_for([a, b], False).tolist() == [0, -1]
    counts, marks = slots.counts.copy_to_host(), slots.in_prompt.copy_to_host()
    np.testing.assert_array_equal(counts[0], np.bincount([5, 5, 7], minlength=vocab))
    assert np.flatnonzero(marks[0]).tolist() == [1, 2]
    with pytest.raises(RuntimeError, match="ahead"):
        slots.slots_for([a, c], True)
    assert slots.slots_for([a, c], False).tolist() == [0, 1]  # both slots in use
    slots.counts[0].copy_to_device(np.full(vocab, 9, np.int32))  # what the device counted since
    a.status = RequestStatus.WAITING  # preempted: its slot goes at the next step
    c.status = RequestStatus.FINISHED
    d = request("d", [6], SamplingParams(presence_penalty=0.5))
    assert slots.slots_for([d], False).tolist() == [0] and slots.slot_of == {d: 0}
    np.testing.assert_array_equal(slots.counts.copy_to_host()[0], 0)  # d's own: nothing yet
    a.status = RequestStatus.RUNNING  # admitted again: rebuilt from its tokens, not the 9s
    a.output_token_ids.append(3)
    assert slots.slots_for([d, a], False).tolist() == [0, 1]
    np.testing.assert_array_equal(slots.counts.copy_to_host()[1], np.bincount([5, 5, 7, 3], minlength=vocab))
    assert np.flatnonzero(slots.in_prompt.copy_to_host()[1]).tolist() == [1, 2]
