"""Chapter 11's warm-up: the engine compiles, at start-up, every kernel a request can reach.

On the CPU: the warm-up's steps fit every limit of the runner. In the simulator: a warmed runner gives the
tokens and log-probs of a fresh one (the throwaway requests leave nothing behind). On a GPU: after start-up,
one request of every kind compiles nothing (no numba dispatcher gains an overload)."""

import gc
from types import SimpleNamespace

import numpy as np
import pytest

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.engine.warm_up import warm_up_model, warm_up_steps
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.runtime import has_gpu

SMALL = tiny_llama_config(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("warm_up"), SMALL, seed=7)


class Limits:
    """What warm_up_steps reads of a runner."""

    def __init__(self, max_model_len, max_num_batched_tokens, max_num_seqs, block_size=16):
        self.config, self.block_size = SimpleNamespace(vocab_size=SMALL["vocab_size"]), block_size
        self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs = (
            max_model_len, max_num_batched_tokens, max_num_seqs)


@pytest.mark.parametrize("limits", [(256, 512, 8), (8, 512, 8), (256, 6, 4), (64, 64, 1), (6, 2, 1), (3, 3, 2)])
def test_warm_up_steps_fit_the_runners_limits(limits):
    runner = Limits(*limits)
    steps = warm_up_steps(runner)
    if runner.max_model_len < 8:  # too short for the requests it makes: no warm-up
        assert steps == []
        return
    kinds = [what for what, _, _ in steps]
    assert kinds[0] == "prefill" and "decode" in kinds
    computed = {}
    for what, requests, num_new in steps:
        assert len(requests) == len(num_new) <= runner.max_num_seqs, what
        assert 0 < sum(num_new) <= runner.max_num_batched_tokens, what
        in_prompt = [computed.get(r.request_id, 0) < r.num_prompt_tokens for r in requests]
        assert in_prompt == sorted(in_prompt, reverse=True), f"{what}: prefills come first"
        for r, n in zip(requests, num_new):
            done = computed.get(r.request_id, 0) + n
            assert done <= r.num_prompt_tokens + r.max_tokens <= runner.max_model_len, what
            assert n == 1 or done <= r.num_prompt_tokens, f"{what}: a decode row takes one token"
            computed[r.request_id] = done
    if runner.max_model_len - 4 >= 2 and runner.max_num_batched_tokens >= 3:
        assert "continued chunk" in kinds  # the paged prefill of a prompt after its first chunk
    if runner.max_num_seqs >= 2:
        assert "mixed" in kinds


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_warmed_runner_gives_a_fresh_runners_tokens(small_folder, device):
    """The warm-up writes only throwaway blocks and leaves no state: the same request afterwards gets the
    tokens and log-probs of a runner that never warmed up. On the CPU's runner in CI (the simulator takes
    minutes over the warm-up's steps), on the GPU's there."""
    if device == "cuda" and not has_gpu():
        pytest.skip("needs a GPU")

    def run(warm: bool):
        runner = ModelRunner(small_folder, EngineConfig(device=device, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32), 8 * 16)
        if warm:
            warm_up_model(runner, progress=False)
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, logprobs=2, ignore_eos=True)
        request = Request("r", None, [5, 9, 77, 3, 18, 100, 2], params, 3, (), generator=np.random.default_rng(3))
        tables = ContiguousAllocator(2, 32, 16).block_tables([0])
        for num_new in (7, 1, 1):
            out = runner.execute(SchedulerOutput([request], [num_new], int(num_new > 1), tables)).sampled
            request.num_computed_tokens += num_new
            request.append_token(out.token_ids[0], out.logprobs[0], out.top_ids[0], out.top_logprobs[0])
        return request.output_token_ids, request.logprobs

    cold, warm = run(False), run(True)
    assert cold[0] == warm[0]
    for a, b in zip(cold[1], warm[1]):
        assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), atol=1e-6)


def overloads() -> dict[int, tuple[str, int]]:
    """Every live numba CUDA dispatcher: id -> (name, number of compiled overloads)."""
    from numba.cuda.dispatcher import CUDADispatcher

    return {id(d): (d.py_func.__name__, len(d.overloads)) for d in gc.get_objects() if isinstance(d, CUDADispatcher)}


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_nothing_compiles_after_start(small_folder, eager, rng):
    """After LLM(...) returns, one request of every kind compiles nothing: a shared-prefix hit, a prompt
    longer than one step's budget, log-probs 5 and 20, prompt log-probs, temperature, top-k, top-p, seeded,
    penalties, and a mixed step (a prompt arriving while another decodes)."""
    llm = LLM(small_folder, device="cuda", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              enforce_eager=eager)
    before = overloads()
    shared = rng.integers(0, 128, 40).tolist()
    kinds = {
        "greedy": ([1, 2, 3], SamplingParams(max_tokens=6)),
        "prefix": (shared + [4, 5], SamplingParams(max_tokens=4)),
        "prefix hit": (shared + [6, 7, 8], SamplingParams(max_tokens=4)),
        "long prompt": (rng.integers(0, 128, 150).tolist(), SamplingParams(max_tokens=4)),
        "logprobs 5": ([9, 10], SamplingParams(max_tokens=4, logprobs=5)),
        "logprobs 20": ([11, 12, 13], SamplingParams(max_tokens=4, logprobs=20)),
        "prompt logprobs": ([14, 15, 16, 17], SamplingParams(max_tokens=2, prompt_logprobs=3)),
        "temperature": ([18], SamplingParams(max_tokens=4, temperature=0.7)),
        "top-k": ([19, 20], SamplingParams(max_tokens=4, temperature=1.0, top_k=5)),
        "top-p": ([21, 22], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8)),
        "seeded": ([23], SamplingParams(max_tokens=4, temperature=1.0, seed=11)),
        "penalties": ([24, 25], SamplingParams(max_tokens=4, temperature=0, frequency_penalty=0.5,
                                               repetition_penalty=1.2)),
    }
    for name, (prompt, params) in kinds.items():  # one at a time: each kind on its own
        llm.generate([prompt], params, use_tqdm=False)
    # and together: prompts join while others decode (mixed steps)
    llm.generate([p for p, _ in kinds.values()], [p for _, p in kinds.values()], use_tqdm=False)
    assert llm.llm_engine.stats.num_cached_prompt_tokens > 0  # the prefix hit was one
    after = overloads()
    grew = {after[k][0]: (before.get(k, (None, 0))[1], after[k][1]) for k in after
            if after[k][1] > before.get(k, (None, 0))[1]}
    print(f"{len(after)} dispatchers, {sum(n for _, n in after.values())} overloads; grew: {grew}")
    assert not grew, f"compiled after start-up (before, after): {grew}"
