"""Chapter 10 on the GPU: paged prefill attention, the ragged workload on blocks, and prefix caching.

1. Paged prefill attention at Llama 3.2 1B's attention shapes (32 query heads, 8 KV heads of 64), 2,048 new
   tokens after 0 and after 1,024 cached ones, read through a shuffled block table, against chapter 7's flash
   kernel on the same 2,048 tokens; each timed as one kernel replayed from a CUDA graph.
2. Chapter 9's ragged workload (256 requests, prompt and output lengths uniform in [100, 1024], seed 0) on
   Llama 3.2 1B's shapes with random bf16 weights: chapter 9's contiguous rows against blocks, first with the
   memory of 256 rows of max_model_len, then with the memory of 64 rows; throughput, and how many requests
   ran at once.
3. Prefix caching: a request with a 1,000-token prefix, then 63 that share it and differ after it; time to
   first token with caching on and off, and whether the outputs agree.
Records to book/data/ch10_paging.json.

    python bench/ch10_paging.py [--only attention workload prefix]    (an H200: about five minutes)
"""

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.paged_scheduler import PagedScheduler
from tinyvllm_lib.kernels.attention import flash_attention
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.paged_attention import paged_prefill_attention
from tinyvllm_lib.measure import Recorder, load_records, time_launches
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama

_spec = importlib.util.spec_from_file_location("ch09_batching", Path(__file__).with_name("ch09_batching.py"))
_ch09 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch09)  # the workload, the step log and chapter 9's scheduler on rows

H, KVH, D, BLOCK = 32, 8, 64, 16
MAX_MODEL_LEN, MAX_NUM_SEQS = _ch09.MAX_MODEL_LEN, _ch09.MAX_NUM_SEQS


def prefill_flops(num_new: int, num_cached: int) -> int:
    """Useful FLOPs: query i (at position num_cached + i) against keys 0..num_cached + i, q·k and p·v."""
    return 4 * H * D * (num_new * num_cached + num_new * (num_new + 1) // 2)


def time_attention(rec: Recorder, rng) -> None:
    n = 2048
    qkv = cuda.to_device(rng.standard_normal((n, (H + 2 * KVH) * D), dtype=np.float32))
    out = cuda.device_array((n, H * D), np.uint16)
    starts = cuda.to_device(np.array([0, n], np.int32))
    flash = time_launches(lambda i, s: flash_attention(qkv, starts, n, H, KVH, D, out, stream=s), 1, repeats=20)
    tflops = prefill_flops(n, 0) / flash / 1e12
    rec.add("flash_prefill", [n, 0], "TFLOP/s", tflops, seconds=flash, heads=[H, KVH, D])
    print(f"flash attention, {n} tokens:            {flash * 1e6:7.1f} us, {tflops:5.1f} TFLOP/s")
    for cached in (0, 1024):
        total = cached + n
        num_blocks = cdiv(total, BLOCK)
        table = rng.permutation(4 * num_blocks)[:num_blocks].astype(np.int32)[None]  # scattered blocks
        shape = (4 * num_blocks * BLOCK, KVH, D)
        k = cuda.to_device(f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32)))
        v = cuda.to_device(f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32)))
        tables, lens = cuda.to_device(table), cuda.to_device(np.array([total], np.int32))
        seconds = time_launches(
            lambda i, s: paged_prefill_attention(qkv, k, v, tables, lens, starts, n, BLOCK, H, KVH, D, out, stream=s),
            1, repeats=20)
        tflops = prefill_flops(n, cached) / seconds / 1e12
        rec.add("paged_prefill", [n, cached], "TFLOP/s", tflops, seconds=seconds, heads=[H, KVH, D],
                block_size=BLOCK, vs_flash=flash / seconds * prefill_flops(n, cached) / prefill_flops(n, 0))
        print(f"paged prefill, {n} new after {cached:>4} cached: {seconds * 1e6:7.1f} us, {tflops:5.1f} TFLOP/s")


def run_workload(llm: LLM, log, scheduler, prompts, params) -> dict:
    llm.llm_engine.scheduler = scheduler
    r = _ch09.run(llm, log, prompts, params)
    r["max_running"] = max(n for _, n, _, _ in log.steps)
    r["num_preemptions"] = getattr(scheduler, "num_preemptions", 0)
    return r


def paged(engine, num_blocks: int) -> PagedScheduler:
    """A fresh pool of num_blocks blocks (within the engine's cache) and a scheduler on it."""
    if num_blocks * BLOCK > engine.model_runner.kv_cache.num_slots:
        raise ValueError(f"{num_blocks} blocks do not fit in the engine's cache")
    engine.block_manager = BlockManager(num_blocks, BLOCK)
    return PagedScheduler(MAX_NUM_SEQS, engine.max_num_batched_tokens, MAX_MODEL_LEN, engine.block_manager)


def ttft_run(llm: LLM, prefix, suffixes, params) -> tuple[list[float], list]:
    """Time to first token of each request of one batch added at once, and the outputs."""
    engine = llm.llm_engine
    t0, first, outs = time.perf_counter(), {}, {}
    for i, s in enumerate(suffixes):
        engine.add_request(f"p{i}", prefix + s, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                outs[o.request_id] = o
    return [first[f"p{i}"] for i in range(len(suffixes))], [outs[f"p{i}"] for i in range(len(suffixes))]


def agrees_up_to_a_near_tie(ref, got, tie: float = 0.1) -> bool:
    """The same tokens, or where they first differ the reference's two best tokens were within `tie` in
    log-probability (a near tie: rounding may pick either)."""
    for t, (x, y) in enumerate(zip(ref.token_ids, got.token_ids)):
        if x != y:
            best = sorted(ref.logprobs[t].values(), reverse=True)
            return len(best) > 1 and best[0] - best[1] < tie
    return len(ref.token_ids) == len(got.token_ids)


def save(rec: Recorder) -> None:
    """Save, keeping this device's earlier records of what this run did not measure (--only)."""
    names = {r["name"] for r in rec.records}
    same_device = [r for r in load_records(rec.chapter) if r.get("device", {}).get("name") == rec.device.get("name")]
    rec.records = [r for r in same_device if r["name"] not in names] + rec.records
    print("saved", rec.save())


def shared_gaps(a, b) -> list[float]:
    """|Δ log p| of the tokens two completions share, up to where they part."""
    gaps = []
    for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            break
        gaps.append(abs(a.logprobs[t][x] - b.logprobs[t][y]))
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["attention", "workload", "prefix"])
    only = set(ap.parse_args().only)
    rec = Recorder("ch10_paging")
    rng = np.random.default_rng(0)
    if "attention" in only:
        time_attention(rec, rng)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_random_llama(tmp, LLAMA_3_2_1B_CONFIG, seed=0)
        llm = LLM(folder, device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                  enforce_eager=True)  # chapter 10 launches from Python: its numbers stay its own
        engine = llm.llm_engine
        log = _ch09.StepLog(engine.model_runner.execute)
        engine.model_runner.execute = log
        vocab = llm.config.vocab_size
        warm_prompts, _ = _ch09.workload(8, vocab, seed=1)
        llm.generate(warm_prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        prompts, params = _ch09.workload(256, vocab)
        extra = {"model": "Llama 3.2 1B shapes, random bf16 weights", "max_model_len": MAX_MODEL_LEN,
                 "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": engine.max_num_batched_tokens,
                 "workload": "256 requests, prompt and output lengths uniform in [100, 1024], seed 0, greedy"}
        blocks_per_row = cdiv(MAX_MODEL_LEN, BLOCK)
        for rows in (256, 64) if "workload" in only else ():
            for scheme in ("contiguous", "paged"):
                scheduler = (_ch09.contiguous_scheduler(engine, rows) if scheme == "contiguous"
                             else paged(engine, rows * blocks_per_row))
                r = run_workload(llm, log, scheduler, prompts, params)
                tok_s = r["output_tokens"] / r["seconds"]
                rec.add("output_throughput", [256, rows], "tok/s", tok_s, scheme=scheme, memory_rows=rows,
                        kv_blocks=rows * blocks_per_row, **r, **extra)
                print(f"{scheme:>10}, memory of {rows:>3} rows: {tok_s:7.0f} output tok/s, at most {r['max_running']} "
                      f"running, {r['num_preemptions']} preemptions, {r['seconds']:.1f} s")
        if "prefix" not in only:
            return save(rec)
        # prefix caching: time to first token
        prefix = rng.integers(0, vocab, 1000).tolist()
        suffixes = [rng.integers(0, vocab, int(rng.integers(20, 60))).tolist() for _ in range(63)]
        # timed without logprobs (the host-side top-k of 63 rows of 128,256 logits is not the cache's cost);
        # compared with them
        sp_time = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        result = {}
        for caching in (False, True):
            engine.block_manager = BlockManager(MAX_NUM_SEQS * blocks_per_row, BLOCK, enable_prefix_caching=caching)
            engine.scheduler = PagedScheduler(MAX_NUM_SEQS, engine.max_num_batched_tokens, MAX_MODEL_LEN,
                                              engine.block_manager)
            # a rehearsal on another prefix first: every kernel of these shapes compiled and warm
            other = rng.integers(0, vocab, 1000).tolist()
            llm.generate([other + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            ttft_run(llm, other, suffixes, sp_time)
            llm.generate([prefix + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            ttft, outs = ttft_run(llm, prefix, suffixes, sp_time)
            cached = [o.num_cached_tokens for o in outs]
            rec.add("ttft_mean", [63, 1000], "ms", 1e3 * float(np.mean(ttft)), prefix_caching=caching,
                    ttft_max_ms=1e3 * max(ttft), mean_cached_tokens=float(np.mean(cached)), **extra)
            print(f"prefix caching {'on ' if caching else 'off'}: time to first token mean {1e3 * np.mean(ttft):6.1f} ms, "
                  f"max {1e3 * max(ttft):6.1f} ms; cached prompt tokens per request {np.mean(cached):.0f}")
            result[caching] = ttft_run(llm, prefix, suffixes, sp)[1]
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(result[True], result[False]))
        near = sum(agrees_up_to_a_near_tie(b.outputs[0], a.outputs[0]) for a, b in zip(result[True], result[False]))
        gaps = [g for a, b in zip(result[True], result[False]) for g in shared_gaps(a.outputs[0], b.outputs[0])]
        rec.add("prefix_caching_agreement", [63], "requests", same, agree_up_to_near_tie=near, tie=0.1,
                mean_abs_dlogp=float(np.mean(gaps)), max_abs_dlogp=float(max(gaps)))
        print(f"prefix caching on vs off: {same}/63 identical outputs, {near}/63 the same up to a near tie (0.1); "
              f"|Δ log p| mean {np.mean(gaps):.4f}, max {max(gaps):.4f}")
    save(rec)


if __name__ == "__main__":
    main()
