"""How the tests compare two runs' completions (the batching issue's rule), shared by the test files."""

import numpy as np


def agrees(ref_ids, ref_logprobs, ids, tie: float) -> tuple[bool, bool]:
    """(same tokens, stopped at a near tie): equal up to the first step where the reference's two best
    log-probs are within `tie`, and equal to the end (length too) where there is none."""
    for t, step in enumerate(ref_logprobs):
        best = sorted(step.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < tie:
            return list(ref_ids[:t]) == list(ids[:t]), True
    return list(ref_ids) == list(ids), False


def shared_logprob_gaps(a, b) -> np.ndarray:
    """|Δ log p| of the tokens two completions share, up to where they part."""
    gaps = []
    for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            break
        gaps.append(abs(a.logprobs[t][x] - b.logprobs[t][y]))
    return np.array(gaps)


def draw_margin(logits: np.ndarray, params, u: float) -> float:
    """How near a sampled step came to another token: the least distance, in probability, from its draw u to a
    boundary of the CDF it was drawn from, or from top_p to the cut of the nucleus (a token in or out of it shifts
    every boundary after it). Float32 noise in the logits moves both by about 1e-6."""
    from tinyvllm_lib.engine.sampler import apply_temperature, apply_top_k, apply_top_p

    z = apply_temperature(np.asarray(logits, np.float32)[None], np.array([params.temperature], np.float32))
    z = apply_top_k(z, np.array([max(params.top_k, 0)], np.int64))
    kept = apply_top_p(z, np.array([params.top_p], np.float32))[0]
    probs = np.exp(kept - kept.max(), dtype=np.float64)
    cdf = np.cumsum(probs) / probs.sum()
    margin = float(np.min(np.abs(cdf[probs > 0] - u)))
    if params.top_p < 1:  # the nucleus: the mass before each token, most likely first
        z = np.sort(z[0])[::-1]
        sorted_probs = np.exp(z - z[0], dtype=np.float64)
        sorted_probs /= sorted_probs.sum()
        margin = min(margin, float(np.min(np.abs(np.cumsum(sorted_probs) - sorted_probs - np.float32(params.top_p)))))
    return margin
