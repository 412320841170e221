"""Chapter 11's overlap on the CPU: the engine with async scheduling (the next decode step launched before the
last is post-processed) against the same engine stepping synchronously, with a stand-in runner whose token
at each position is a fixed function of the request and the position. So a step run ahead must compute the
tokens the synchronous engine computes later, whatever the order: the tests check the scheduling (positions
one past, requests that finish by length not scheduled ahead, stops found while a step is in flight, aborts,
admission while others decode, the pool freed), not the kernels (tests/test_cuda_graphs.py does those on a GPU)."""

import numpy as np
import pytest

from tinyvllm_lib.engine.async_scheduler import AsyncScheduler
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.sampler import SamplerOutput
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

VOCAB = 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = tiny_llama_config(vocab_size=VOCAB, max_position_embeddings=1024)
    return make_random_llama(tmp_path_factory.mktemp("async"), config, seed=12)


def token_at(request, index: int) -> int:
    """The stand-in model: token `index` of a request (0-based over prompt + output)."""
    return (sum(request.prompt_token_ids) * 31 + index * 17 + len(request.prompt_token_ids)) % VOCAB


class Pending:
    def __init__(self, result: ModelRunnerOutput, cudagraph_size):
        self.result, self.cudagraph_size, self.collected = result, cudagraph_size, False

    def get_output(self) -> ModelRunnerOutput:
        assert not self.collected, "collected twice"
        self.collected = True
        return self.result


class StandInRunner:
    """execute_async for every step, as the GPU runner's: a decode step "replays a graph" (cudagraph_size set),
    ahead ones too (prev_rows); any other step runs at once."""

    def __init__(self):
        self.ahead_steps, self.in_flight, self.last_step = 0, [], None

    def execute(self, step) -> ModelRunnerOutput:
        ids = [token_at(r, r.num_computed_tokens + n) for r, n in zip(step.requests, step.num_new_tokens)
               if r.num_computed_tokens + n >= r.num_tokens]
        return ModelRunnerOutput(SamplerOutput(np.array(ids, np.int64)), [None] * len(step.requests))

    def execute_async(self, step):
        prev_rows = step.prev_rows
        # every step's block tables as a fresh read of the block manager's gives them, ahead ones too (which copy
        # the last step's rows and rewrite only those that grew)
        for row, r in enumerate(step.requests):
            table = self.block_manager.block_tables[r.request_id]
            assert step.block_tables[row, : len(table)].tolist() == table, r.request_id
            assert not step.block_tables[row, len(table) :].any() and step.num_blocks[row] == len(table)
        # in flight: at most the step before, which an ahead step follows
        assert len([p for p in self.in_flight if not p.collected]) <= (0 if prev_rows is None else 1)
        if step.num_prefills or step.num_tokens != len(step.requests):
            assert prev_rows is None
            self.in_flight.append(Pending(self.execute(step), None))
            return self.in_flight[-1]
        assert not any(r.is_finished for r in step.requests)
        ahead = prev_rows is not None
        if ahead:
            assert len(prev_rows) == len(step.requests)
            # each row's token is the one the step in flight samples in row prev_rows[i]: the same request's
            assert [self.last_step.requests[j] for j in prev_rows] == step.requests
            # a request whose in-flight token is its last by length is not planned ahead
            assert all(len(r.output_token_ids) + 1 < r.max_tokens for r in step.requests)
            self.ahead_steps += 1
        self.last_step = step
        # a row's new token is one past its last computed position; ahead, that position is one further
        ids = [token_at(r, r.num_computed_tokens + 1 + ahead) for r in step.requests]
        result = ModelRunnerOutput(SamplerOutput(np.array(ids, np.int64)), [None] * len(ids))
        self.in_flight.append(Pending(result, len(ids)))
        return self.in_flight[-1]


def engine(folder, async_scheduling: bool, max_num_seqs: int = 4) -> tuple[LLMEngine, StandInRunner]:
    e = LLMEngine(folder, "cpu", max_model_len=256, max_num_seqs=max_num_seqs, num_kv_blocks=64)
    runner = StandInRunner()
    runner.block_manager = e.block_manager
    e.model_runner = runner
    if async_scheduling:  # what LLMEngine does with the graph runner
        e.async_scheduling = True
        e.scheduler = AsyncScheduler(e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len, e.block_manager)
    return e, runner


def run(e: LLMEngine, requests, abort_after: dict | None = None) -> dict:
    for rid, prompt, params in requests:
        e.add_request(rid, prompt, params)
    final, steps = {}, 0
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at and rid in e.requests:
                e.abort_request(rid)
        assert steps < 1000
    return final


def workload(rng, n: int = 9):
    requests = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 40))).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 25)), ignore_eos=True)
        if i % 3 == 1:  # a stop token that comes a few tokens in: found while the next step is in flight
            probe = type("R", (), {"prompt_token_ids": prompt})
            stop_at = len(prompt) + int(rng.integers(0, 6))
            params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[token_at(probe, stop_at)])
        requests.append((f"r{i}", prompt, params))
    return requests


def test_ahead_steps_give_the_synchronous_engines_tokens(folder, rng):
    requests = workload(rng)
    want = run(engine(folder, False)[0], requests)
    e, runner = engine(folder, True)
    got = run(e, requests)
    assert got == want
    assert runner.ahead_steps > 0 and all(p.collected for p in runner.in_flight)
    assert e.block_manager.num_used_blocks == 0 and not e.requests
    stops = [rid for rid, (_, reason) in want.items() if reason == "stop"]
    assert stops, "the workload has requests that stop on a token"


def test_more_requests_than_max_num_seqs_are_admitted_as_others_finish(folder, rng):
    requests = workload(rng, 12)
    want = run(engine(folder, False, max_num_seqs=3)[0], requests)
    e, runner = engine(folder, True, max_num_seqs=3)
    assert run(e, requests) == want and runner.ahead_steps > 0


def test_an_abort_while_a_step_is_in_flight_drops_its_token_and_frees_its_blocks(folder, rng):
    prompts = [rng.integers(0, VOCAB, 20).tolist() for _ in range(3)]
    requests = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
                for i, p in enumerate(prompts)]
    want = run(engine(folder, False)[0], requests)
    e, runner = engine(folder, True)
    got = run(e, requests, abort_after={"r1": 6})
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"]
    tokens, reason = got["r1"]
    assert reason == "abort" and tokens == want["r1"][0][: len(tokens)] and 0 < len(tokens) < 30
    assert e.block_manager.num_used_blocks == 0 and runner.ahead_steps > 0


def test_a_request_added_while_a_seat_is_free_is_admitted_at_the_next_full_schedule(folder, rng):
    """As chapter 12's server adds requests between steps: with a step in flight and a free seat, the engine
    plans nothing ahead; the newcomer's prompt runs in the step after, and its tokens are the synchronous
    engine's."""
    long = [(f"r{i}", rng.integers(0, VOCAB, 10).tolist(), SamplingParams(temperature=0.0, max_tokens=20,
                                                                      ignore_eos=True)) for i in range(2)]
    late = ("late", rng.integers(0, VOCAB, 7).tolist(), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    want = run(engine(folder, False)[0], long + [late])
    e, runner = engine(folder, True)
    for rid, prompt, params in long:
        e.add_request(rid, prompt, params)
    while runner.ahead_steps < 3:  # decoding, one step in flight
        e.step()
    assert e._in_flight is not None
    e.add_request(*late)
    before = runner.ahead_steps
    e.step()  # collects the step in flight; plans nothing ahead: someone waits and a seat is free
    assert runner.ahead_steps == before and e._in_flight is None and not e.requests["late"].output_token_ids
    e.step()  # a full schedule: the newcomer's prompt, its first token
    assert len(e.requests["late"].output_token_ids) == 1
    final = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    assert final == want and runner.ahead_steps > before


def test_async_scheduling_needs_the_graph_runner(folder):
    with pytest.raises(ValueError, match="async_scheduling needs CUDA graphs"):
        LLMEngine(folder, "cpu", max_model_len=64, async_scheduling=True)
    assert LLMEngine(folder, "cpu", max_model_len=64).async_scheduling is False
