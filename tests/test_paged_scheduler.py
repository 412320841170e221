"""The scheduler on blocks (chapter 10, draft) against a stand-in for the model: whatever
the pool, the token budget and the preemptions, every request ends with the tokens it
would get alone, no step exceeds its budgets, and no block leaks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.model_runner import ModelRunnerOutput
from tinyvllm_lib.engine.paged_scheduler import PagedScheduler, is_decode
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampler import SamplerOutput
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.kernels.checks import cdiv


def next_token(request_id: str, position: int) -> int:
    """The stand-in model: the token after `position` tokens depends only on who and where."""
    return hash((request_id, position)) % 50


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(request_id, None, prompt, params, max_tokens, eos_token_ids=[])


def run(scheduler: PagedScheduler, requests: list[Request], max_steps: int = 5000):
    for r in requests:
        scheduler.add_request(r)
    bm = scheduler.block_manager
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step = scheduler.schedule()
        assert step is not None, "unfinished requests but nothing scheduled: a deadlock"
        assert step.num_tokens <= scheduler.max_num_batched_tokens
        assert len(step.requests) <= scheduler.max_num_seqs
        assert len({r.request_id for r in step.requests}) == len(step.requests)
        decodes = [is_decode(r, n) for r, n in zip(step.requests, step.num_new_tokens)]
        assert decodes == sorted(decodes) and step.num_prefills == decodes.count(False)
        for row, (r, n) in enumerate(zip(step.requests, step.num_new_tokens)):
            assert 1 <= n <= r.num_tokens - r.num_computed_tokens
            table = bm.block_tables[r.request_id]
            assert len(table) >= cdiv(r.num_computed_tokens + n, bm.block_size)
            assert list(step.block_tables[row, : len(table)]) == table
        # the stand-in computes each row's next token
        sampled = np.array(
            [
                next_token(r.request_id, r.num_computed_tokens + n)
                for r, n in zip(step.requests, step.num_new_tokens)
            ]
        )
        scheduler.postprocess(
            step, ModelRunnerOutput(SamplerOutput(sampled), [None] * len(sampled))
        )
        holders = [0] * bm.num_blocks
        for table in bm.block_tables.values():
            for b in table:
                holders[b] += 1
        assert [b.ref_count for b in bm.blocks] == holders
        assert set(bm.block_tables) == {r.request_id for r in scheduler.running}
    raise AssertionError(f"not finished after {max_steps} steps")


workloads = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.integers(0, 30),
        st.lists(st.integers(0, 49), max_size=10),
        st.integers(1, 8),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(
    work=workloads,
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare=st.integers(0, 40),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
)
def test_any_pool_gives_every_request_its_own_tokens(
    work, block_size, spare, budget, max_num_seqs, caching
):
    bases = [list(np.random.default_rng(s).integers(0, 50, 30)) for s in range(3)]
    specs = [
        (f"r{i}", bases[b][:k] + tail, m)
        for i, (b, k, tail, m) in enumerate(work)
        if bases[b][:k] + tail
    ]
    if not specs:
        return
    max_model_len = 64
    # the pool: at least what the largest request may need, plus some
    need = max(cdiv(len(p) + m, block_size) for _, p, m in specs)
    bm = BlockManager(need + spare, block_size, enable_prefix_caching=caching)
    scheduler = PagedScheduler(max_num_seqs, budget, max_model_len, bm)
    requests = [make_request(i, p, m) for i, p, m in specs]
    run(scheduler, requests)
    for r in requests:
        want = [
            next_token(r.request_id, r.num_prompt_tokens + k)
            for k in range(r.max_tokens)
        ]
        assert r.output_token_ids == want, r.request_id
    assert bm.num_free_blocks == bm.num_blocks


def test_a_small_pool_preempts_and_still_finishes():
    bm = BlockManager(8, block_size=4)
    scheduler = PagedScheduler(8, 64, 64, bm)
    requests = [
        make_request(f"r{i}", list(range(10 * i, 10 * i + 6)), 8) for i in range(4)
    ]
    run(scheduler, requests)
    assert scheduler.num_preemptions > 0
    for r in requests:
        assert r.output_token_ids == [next_token(r.request_id, 6 + k) for k in range(8)]


def test_a_long_prompt_is_chunked_while_decodes_go_on():
    bm = BlockManager(64, block_size=4)
    scheduler = PagedScheduler(4, 8, 64, bm)
    short = make_request("short", [1, 2, 3], 20)
    scheduler.add_request(short)
    step = scheduler.schedule()
    scheduler.postprocess(step, ModelRunnerOutput(SamplerOutput(np.array([5])), [None]))
    long = make_request("long", list(range(40)), 2)
    scheduler.add_request(long)
    chunks = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        step = scheduler.schedule()
        assert short in step.requests and long in step.requests  # the decode goes on
        assert step.num_tokens <= 8
        sampled = np.array(
            [
                next_token(r.request_id, r.num_computed_tokens + n)
                for r, n in zip(step.requests, step.num_new_tokens)
            ]
        )
        scheduler.postprocess(
            step, ModelRunnerOutput(SamplerOutput(sampled), [None] * len(sampled))
        )
        chunks += 1
    assert (
        chunks >= 40 // 7 and long.output_token_ids
    )  # its last chunk produced a token


def test_a_request_larger_than_the_pool_is_refused():
    scheduler = PagedScheduler(4, 64, 64, BlockManager(4, block_size=4))
    with pytest.raises(ValueError, match="more than the whole pool of 4 blocks"):
        scheduler.add_request(make_request("big", list(range(10)), 10))


def test_a_cached_prefix_is_not_computed_again():
    bm = BlockManager(64, block_size=4)
    scheduler = PagedScheduler(4, 64, 64, bm)
    run(scheduler, [make_request("a", list(range(20)), 1)])
    b = make_request("b", list(range(18)) + [99, 98], 1)
    scheduler.add_request(b)
    step = scheduler.schedule()
    # a's first four blocks (16 tokens) are b's too; its fifth differs at token 18
    assert step.num_new_tokens == [4] and b.num_computed_tokens == 16
    assert scheduler.num_cached_tokens["b"] == 16
