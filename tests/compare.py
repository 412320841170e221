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
