"""Chapter 10's acceptance on the CPU: the engine on a pool of blocks (a tiny random
Llama, NumPy) — a pool a quarter of what 64 requests need still gives their greedy tokens,
a request larger than the pool is refused while the others are served, a 3,000-token
prompt computed in chunks of 512 gives the logits of one prefill while decodes go on,
and a shared 1,000-token prefix is read from the cache with the outputs unchanged."""

import numpy as np
import pytest
from compare import agrees, shared_logprob_gaps

from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.engine.scheduler import Scheduler
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = tiny_llama_config(vocab_size=256, max_position_embeddings=4096)
    return make_random_llama(tmp_path_factory.mktemp("paging"), config, seed=11)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_quarter_of_the_pool_gives_the_same_tokens(folder, rng):
    prompts = [rng.integers(0, 256, int(rng.integers(1, 120))).tolist() for _ in range(64)]
    params = [greedy(int(rng.integers(1, 40))) for _ in prompts]
    ref = LLM(folder, device="cpu", max_model_len=256, max_num_seqs=64)  # chapter 9's scheduler on rows
    ref.llm_engine.scheduler = Scheduler(64, ref.llm_engine.max_num_batched_tokens, ContiguousAllocator(64, 256))
    want = tokens(ref.generate(prompts, params, use_tqdm=False))
    need = sum(cdiv(len(p) + sp.max_tokens, 16) for p, sp in zip(prompts, params))
    small = LLM(folder, device="cpu", max_model_len=256, max_num_seqs=64, num_kv_blocks=need // 4)
    got = small.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == want  # every request, none lost, the same greedy tokens
    stats = small.llm_engine.stats
    print(f"pool {need // 4} of {need} blocks: {stats}")
    assert stats.num_preemptions > 0 and stats.max_kv_blocks_used <= need // 4
    assert stats.num_generated_tokens == sum(sp.max_tokens for sp in params)
    assert stats.kv_blocks_used == 0 and not small.llm_engine.requests


def test_a_request_larger_than_the_pool_is_refused_and_the_rest_served(folder):
    engine = LLMEngine(folder, device="cpu", max_model_len=512, max_num_seqs=4, num_kv_blocks=8)
    engine.add_request("ok", [1, 2, 3], greedy(5))
    with pytest.raises(ValueError, match=r"may need 299 tokens of cache, 19 blocks of 16, more than the whole pool of 8"):
        engine.add_request("big", list(range(200)), greedy(100))
    engine.add_request("ok2", [4, 5], greedy(5))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(done) == {"ok", "ok2"} and all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    llm = LLM(folder, device="cpu", max_model_len=512, max_num_seqs=4, num_kv_blocks=8)
    with pytest.raises(ValueError, match="more than the whole pool"):  # generate: nothing is left behind
        llm.generate([[1, 2], list(range(200))], greedy(100), use_tqdm=False)
    assert not llm.llm_engine.scheduler.has_unfinished_requests() and llm.llm_engine.block_manager.num_used_blocks == 0
    assert tokens(llm.generate([[1, 2]], greedy(3), use_tqdm=False))[0] == tokens(
        LLM(folder, device="cpu", max_model_len=512, max_num_seqs=4).generate([[1, 2]], greedy(3), use_tqdm=False))[0]


def test_a_chunked_prompt_gives_the_logits_of_one_prefill_while_decodes_go_on(folder, rng):
    long_prompt = rng.integers(0, 256, 3000).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    whole = LLM(folder, device="cpu", max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=4096)
    want = whole.generate([long_prompt], params, use_tqdm=False)[0]
    engine = LLMEngine(folder, device="cpu", max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=512)
    for i in range(3):
        engine.add_request(f"short{i}", rng.integers(0, 256, 5).tolist(), greedy(30))
    engine.step()  # the short prompts; they decode from now on
    engine.add_request("long", long_prompt, params)
    chunks, decodes_alongside = 0, 0
    got = None
    while engine.has_unfinished_requests():
        long = engine.requests.get("long")
        chunking = long is not None and long.num_computed_tokens < long.num_prompt_tokens
        outs = {o.request_id: o for o in engine.step()}
        if chunking:
            chunks += 1
            decodes_alongside += sum(rid.startswith("short") for rid in outs)
        got = outs.get("long", got)
    assert chunks == cdiv(3000, 512 - 3)  # every chunk shares its step with the 3 decodes
    assert decodes_alongside == 3 * chunks
    a = np.array([lp[t] for lp, t in zip(want.prompt_logprobs[1:], long_prompt[1:])])
    b = np.array([lp[t] for lp, t in zip(got.prompt_logprobs[1:], long_prompt[1:])])
    print(f"chunked vs whole prompt log-probs: max |Δ| {np.abs(a - b).max():.2e}")
    assert np.abs(a - b).max() < 1e-4
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("block_size", [16, 8])
def test_a_shared_prefix_comes_from_the_cache(folder, rng, block_size):
    prefix = rng.integers(0, 256, 1000).tolist()
    prompts = [prefix + rng.integers(0, 256, int(rng.integers(1, 30))).tolist() for _ in range(63)]
    params = [greedy(int(rng.integers(1, 8))) for _ in prompts]
    outs, stats = {}, {}
    for caching in (True, False):
        llm = LLM(folder, device="cpu", max_model_len=1100, max_num_seqs=64, block_size=block_size,
                  enable_prefix_caching=caching)
        first = llm.generate([prefix + [3]], greedy(2), use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        outs[caching] = llm.generate(prompts, params, use_tqdm=False)
        stats[caching] = llm.llm_engine.stats
    shared = 1000 // block_size * block_size  # the prefix's full blocks
    cached = [o.num_cached_tokens for o in outs[True]]
    print(f"block {block_size}: cached tokens per request {min(cached)}..{max(cached)} of {shared} shared")
    assert min(cached) >= 0.9 * shared and all(o.num_cached_tokens == 0 for o in outs[False])
    assert tokens(outs[True]) == tokens(outs[False])
    num_prompt = len(prefix) + 1 + sum(map(len, prompts))
    assert stats[False].num_cached_prompt_tokens == 0 and stats[False].num_prompt_tokens == num_prompt
    assert stats[True].num_prompt_tokens == num_prompt and stats[True].num_cached_prompt_tokens == sum(cached)


@pytest.mark.gpu
def test_gpu_chunked_prefill_and_prefix_cache_match_one_prefill(rng):
    """SmolLM2 on the GPU. A prompt computed in chunks or after a cached prefix attends over the same bf16 cache
    as one prefill (every prefill reads its keys from the cache since prefill graphs), but in other steps, with
    GEMMs of other sizes: log-probs differ by float32 rounding, within the batching issue's tolerance (mean |Δ| <=
    0.05)."""
    whole = LLM("smollm2", device="cuda", max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096)
    chunked = LLM("smollm2", device="cuda", max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=512)
    prompt = rng.integers(0, whole.config.vocab_size, 3000).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=2)
    a, b = (llm.generate([prompt], params, use_tqdm=False)[0] for llm in (whole, chunked))
    pa = np.array([lp[t] for lp, t in zip(a.prompt_logprobs[1:], prompt[1:])])
    pb = np.array([lp[t] for lp, t in zip(b.prompt_logprobs[1:], prompt[1:])])
    print(f"chunked vs whole prompt log-probs: mean |Δ| {np.abs(pa - pb).mean():.4f}, max {np.abs(pa - pb).max():.4f}")
    assert np.abs(pa - pb).mean() <= 0.05
    # a shared prefix: the same outputs (up to near ties) with the cache on and off
    prefix = rng.integers(0, whole.config.vocab_size, 1000).tolist()
    prompts = [prefix + rng.integers(0, whole.config.vocab_size, int(rng.integers(5, 40))).tolist() for _ in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    runs = {}
    for caching in (True, False):
        llm = LLM("smollm2", device="cuda", max_model_len=2048, max_num_seqs=16, enable_prefix_caching=caching)
        llm.generate([prefix + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        runs[caching] = llm.generate(prompts, sp, use_tqdm=False)
        del llm
    assert min(o.num_cached_tokens for o in runs[True]) >= 0.9 * (1000 // 16 * 16)
    gaps = np.concatenate([shared_logprob_gaps(x.outputs[0], y.outputs[0]) for x, y in zip(runs[True], runs[False])])
    same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(runs[True], runs[False]))
    print(f"prefix cache on vs off: {same}/16 identical; |Δ log p| mean {gaps.mean():.4f}, max {gaps.max():.4f}")
    assert gaps.mean() <= 0.05
    assert all(agrees(y.outputs[0].token_ids, y.outputs[0].logprobs, x.outputs[0].token_ids, tie=0.1)[0]
               for x, y in zip(runs[True], runs[False]))


def test_the_pool_is_sized_from_a_byte_budget(folder):
    """On the CPU the pool is kv_cache_memory_bytes over a block's bytes, at most what max_num_seqs sequences of
    max_model_len can use; too small a budget for one sequence is an error that says why."""
    from tinyvllm_lib.models.config import ModelConfig

    per_block = 16 * kv_cache_bytes_per_token(ModelConfig.from_folder(folder), "float32")
    engine = LLMEngine(folder, device="cpu", max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=50 * per_block + 7)
    assert engine.block_manager.num_blocks == 50 and engine.model_runner.kv_cache.num_slots == 50 * 16
    big = LLMEngine(folder, device="cpu", max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=10**12)
    assert big.block_manager.num_blocks == 8 * 32  # the cap: chapter 9's reservation
    with pytest.raises(ValueError, match=r"leaves room for 31 KV blocks .* fewer than one sequence of max_model_len = 512"):
        LLMEngine(folder, device="cpu", max_model_len=512, kv_cache_memory_bytes=31 * per_block)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            LLMEngine(folder, device="cpu", gpu_memory_utilization=bad)


def test_a_preempted_prompt_logprobs_request_keeps_its_first_and_counts_its_cache_once(folder, rng):
    """Preempted mid-way, a request asking for prompt_logprobs is recomputed; its prompt log-probs are those of the
    first computation (the same values), and num_cached_tokens is what its first admission found."""
    prompts = [rng.integers(0, 256, 60).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    want = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=6).generate(prompts, params, use_tqdm=False)
    small = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=6, num_kv_blocks=12, max_num_batched_tokens=32)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.stats.num_preemptions > 0
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.prompt_logprobs) == 60 and b.num_cached_tokens == 0
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-4
