"""The scheduler on blocks (chapter 10) against a stand-in for the model: whatever
the pool, the token budget and the preemptions, every request ends with the tokens it
would get alone, no step exceeds its budgets, and no block leaks."""

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.paged_scheduler import PagedScheduler, is_decode
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampler import SamplerOutput
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.engine.scheduler import Scheduler
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput
from tinyvllm_lib.kernels.checks import cdiv


def next_token(request_id: str, position: int) -> int:
    """The stand-in model: the token after `position` tokens depends only on who and where."""
    return hash((request_id, position)) % 50


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(request_id, None, prompt, params, max_tokens, eos_token_ids=[])


def stand_in(step) -> ModelRunnerOutput:
    """The stand-in model's step: a token for each request whose next token is due."""
    due = [
        (r, n)
        for r, n in zip(step.requests, step.num_new_tokens)
        if r.num_computed_tokens + n >= r.num_tokens
    ]
    sampled = np.array(
        [next_token(r.request_id, r.num_computed_tokens + n) for r, n in due], np.int64
    )
    return ModelRunnerOutput(SamplerOutput(sampled), [None] * len(step.requests))


class ShadowCache:
    """Where each token's K/V would be: the step's new tokens written through its block tables (as the model
    writes K/V before attention), then every scheduled request's whole context read back through its table —
    it must be exactly its own tokens. Catches a wrong block shared, a shared block written into, a cache hit
    on a block not computed yet or evicted and reused."""

    def __init__(self, bm: BlockManager):
        self.bm, self.tokens = bm, np.full(bm.num_blocks * bm.block_size, -1, np.int64)

    def slots(self, table, positions):
        return table[positions // self.bm.block_size].astype(np.int64) * self.bm.block_size + positions % self.bm.block_size

    def step(self, step):
        for row, (r, n) in enumerate(zip(step.requests, step.num_new_tokens)):
            c = r.num_computed_tokens
            self.tokens[self.slots(step.block_tables[row], np.arange(c, c + n))] = r.token_ids(c, c + n)
        for row, (r, n) in enumerate(zip(step.requests, step.num_new_tokens)):
            length = r.num_computed_tokens + n
            got = self.tokens[self.slots(step.block_tables[row], np.arange(length))]
            assert got.tolist() == r.token_ids(0, length), f"{r.request_id}: its blocks do not hold its context"


def run(scheduler: PagedScheduler, requests: list[Request], max_steps: int = 5000):
    for r in requests:
        scheduler.add_request(r)
    bm = scheduler.block_manager
    shadow = ShadowCache(bm)
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
        shadow.step(step)
        scheduler.postprocess(step, stand_in(step))
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
        scheduler.postprocess(step, stand_in(step))
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
    assert b.num_cached_tokens == 16 and b.output().num_cached_tokens == 16


def test_on_the_numpy_model_paging_changes_no_token(tmp_path):
    """A tiny random Llama on the CPU: a pool a quarter of what the requests need at once,
    and a token budget below the longest prompt, give the greedy tokens of chapter 09's
    scheduler on contiguous rows."""
    from tinyvllm_lib.engine.engine_config import EngineConfig
    from tinyvllm_lib.engine.llm import LLM
    from tinyvllm_lib.engine.model_runner import ModelRunner
    from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

    folder = make_random_llama(tmp_path, tiny_llama_config(vocab_size=256), seed=5)
    rng = np.random.default_rng(7)
    base = list(rng.integers(0, 256, 40))
    prompts = [
        base[: int(rng.integers(0, 40))]
        + list(rng.integers(0, 256, int(rng.integers(1, 20))))
        for _ in range(16)
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=16)
    ref.llm_engine.scheduler = Scheduler(16, ref.llm_engine.max_num_batched_tokens, ContiguousAllocator(16, 128))
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]

    block_size = 4
    need = sum(cdiv(len(p) + 12, block_size) for p in prompts)
    bm = BlockManager(need // 4, block_size)
    config = EngineConfig(device="cpu", block_size=block_size, max_num_seqs=16, max_num_batched_tokens=24,
                          max_model_len=128)
    runner = ModelRunner(folder, config, bm.num_blocks * block_size)
    scheduler = PagedScheduler(16, 24, 128, bm)
    requests = [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add_request(r)
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        scheduler.postprocess(step, runner.execute(step))
    assert (
        scheduler.num_preemptions > 0 and sum(r.num_cached_tokens for r in requests) > 0
    )
    assert [r.output_token_ids for r in requests] == [list(w) for w in want]


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps, aborts; after every rule the pool's books must balance:
    no block leaked or held twice, every reference count equal to its holders, the hash
    table naming exactly the cached blocks. At the end every request has finished, with
    its own tokens unless it was aborted."""

    def __init__(self):
        super().__init__()
        self.requests: list[Request] = []
        self.bases = [list(np.random.default_rng(s).integers(0, 50, 40)) for s in range(2)]

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(6, 24),
        budget=st.integers(1, 32),
        max_num_seqs=st.integers(1, 6),
        caching=st.booleans(),
    )
    def make(self, block_size, num_blocks, budget, max_num_seqs, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.scheduler = PagedScheduler(max_num_seqs, budget, 48, self.bm)
        self.shadow = ShadowCache(self.bm)

    @rule(base=st.integers(0, 1), k=st.integers(0, 40), tail=st.lists(st.integers(0, 49), max_size=6), m=st.integers(1, 30))
    def arrive(self, base, k, tail, m):
        prompt = self.bases[base][:k] + tail or [7]
        request = make_request(f"r{len(self.requests)}", prompt, min(m, 48 - len(prompt)) or 1)
        try:
            self.scheduler.add_request(request)
        except ValueError as e:  # larger than the whole pool: refused, nothing changed
            assert "more than the whole pool" in str(e)
            return
        self.requests.append(request)

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self.step()

    def step(self):
        step = self.scheduler.schedule()
        if step is None:
            assert not self.scheduler.has_unfinished_requests(), "work left but nothing scheduled"
            return
        assert step.num_tokens <= self.scheduler.max_num_batched_tokens
        self.shadow.step(step)
        for r, n in zip(step.requests, step.num_new_tokens):
            event("chunk" if r.num_computed_tokens + n < r.num_prompt_tokens else "whole or decode")
        self.scheduler.postprocess(step, stand_in(step))
        if self.scheduler.num_preemptions:
            event("preempted")

    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.requests if not r.is_finished]
        if live:
            victim = data.draw(st.sampled_from(live))
            assert self.scheduler.abort_request(victim.request_id) is victim

    @invariant()
    def books_balance(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        holders = [0] * bm.num_blocks
        for table in bm.block_tables.values():
            for b in table:
                holders[b] += 1
        assert [b.ref_count for b in bm.blocks] == holders
        free = set(bm.free_queue)
        assert len(free) == len(bm.free_queue) and free == {i for i, h in enumerate(holders) if h == 0}
        assert {h: i for i, b in enumerate(bm.blocks) if (h := b.block_hash) is not None} == bm.cached
        assert set(bm.block_tables) == {r.request_id for r in self.scheduler.running}
        assert set(bm.chains) <= {r.request_id for r in self.requests if not r.is_finished}
        if bm.enable_prefix_caching:  # every block a step filled was named that step
            for r in self.scheduler.running:
                assert bm.num_named[r.request_id] == r.num_computed_tokens // bm.block_size

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for _ in range(5000):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        assert not self.scheduler.has_unfinished_requests(), "not finished after 5000 steps"
        for r in self.requests:
            assert r.is_finished
            if r.finish_reason != "abort":
                assert r.output_token_ids == [next_token(r.request_id, r.num_prompt_tokens + k) for k in range(r.max_tokens)]
        assert self.bm.num_free_blocks == self.bm.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
