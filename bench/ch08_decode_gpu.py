"""Chapter 8 on the GPU: decode attention against the bandwidth ceiling of chapter 1, and the CUDA engine's decode speed.

Records to book/data/ch08_kv_cache.json (GPU device name; the CPU bench's records are kept).
Run: .venv/bin/python bench/ch08_decode_gpu.py   (an H200: under two minutes)
"""

import tempfile
import time

import numpy as np
from numba import cuda

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.engine.input_batch import InputBatch
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyvllm_lib.kernels.decode_splits import decode_workspace
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    num_rotations,
    time_launches,
)
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama

H, KVH, D, CONTEXT, BLOCK = 32, 8, 64, 1024, 16
rec = Recorder("ch08_kv_cache")
# chapter 1's bandwidth ceiling on this GPU (the best of its copy and read rates), if recorded
ceiling_gbs, ceiling_name = bandwidth_ceiling(rec.device["name"])
ceiling = {"ceiling": ceiling_gbs, "ceiling_name": ceiling_name} if ceiling_name else {}
gen = np.random.default_rng(0)


def bench_decode_attention(num_seqs: int, bound: int = CONTEXT) -> None:
    """Decode attention over CONTEXT tokens per sequence; `bound` (max_context_len) sizes the grid's splits."""
    blocks_per_seq = CONTEXT // BLOCK
    num_slots = num_seqs * CONTEXT
    kv_bytes = 2 * num_slots * KVH * D * 2  # compulsory: every cached K and V once
    sets = []
    for _ in range(num_rotations(kv_bytes)):
        k = cuda.to_device(f32_to_bf16_bits(gen.standard_normal((num_slots, KVH, D), np.float32)))
        v = cuda.to_device(f32_to_bf16_bits(gen.standard_normal((num_slots, KVH, D), np.float32)))
        sets.append((k.view(np.uint64), v.view(np.uint64), k, v))
    bt = cuda.to_device(gen.permutation(num_seqs * blocks_per_seq).astype(np.int32).reshape(num_seqs, blocks_per_seq))
    lens = cuda.to_device(np.full(num_seqs, CONTEXT, np.int32))
    qkv_h = gen.standard_normal((num_seqs, (H + 2 * KVH) * D)).astype(np.float32)
    qkv, out = cuda.to_device(qkv_h), cuda.device_array((num_seqs, H * D), np.float32)
    ws = decode_workspace(num_seqs, bound, H, D)  # split partials (flash-decoding), made once
    split = {"workspace": ws, "max_context_len": bound}
    decode_attention(qkv, *sets[0][:2], bt, BLOCK, lens, H, KVH, D, out, **split)  # check before timing
    want = decode_attention_ref(qkv_h, sets[0][2].copy_to_host(), sets[0][3].copy_to_host(), bt.copy_to_host(), BLOCK,
                                lens.copy_to_host(), H, KVH, D)
    assert np.abs(out.copy_to_host() - want).max() / np.abs(want).max() < 1e-5
    seconds = time_launches(lambda i, s: decode_attention(qkv, *sets[i % len(sets)][:2], bt, BLOCK, lens, H, KVH, D, out,
                                                           stream=s, **split), 2 * len(sets))
    gbs = kv_bytes / seconds / 1e9
    name = "decode_attention" if bound == CONTEXT else f"decode_attention_bound{bound}"
    r = rec.add(name, [num_seqs, CONTEXT, H, KVH, D], "GB/s", gbs, us=seconds * 1e6, max_context_len=bound,
                **ceiling)
    print(f"decode attention {num_seqs:>3} seqs x {CONTEXT} (grid for {bound}): {seconds * 1e6:7.1f} us, {gbs:6.0f} GB/s"
          + (f" = {r['ratio']:.0%} of the ceiling ({ceiling_name})" if ceiling else ""))


def bench_engine(label: str, model: str, max_model_len: int = 512) -> None:
    """Batch 1 on the GPU: tokens/s end to end, and one decode step from Python against its kernels in a graph."""
    llm = LLM(model, device="cuda", max_model_len=max_model_len, max_num_seqs=1, enforce_eager=True)  # chapter 8b: launched from Python
    prompt = list(range(100, 116))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # compile
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    total = time.perf_counter() - t0
    # one decode step from Python (wall) vs its kernels alone: the same step replayed from a captured graph
    engine = llm.llm_engine
    runner, alloc = engine.model_runner, engine.allocator
    request = engine.make_request("bench", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    row = alloc.allocate()
    try:
        tables = alloc.block_tables([row])
        runner.execute(SchedulerOutput([request], [len(prompt)], 1, tables))  # the prompt, cached
        request.num_computed_tokens = len(prompt)
        request.output_token_ids.append(7)
        step = SchedulerOutput([request], [1], 0, tables)  # the same decode step, again and again
        runner.execute(step)
        runner.stream.synchronize()
        steps = 20
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.execute(step)
        wall = (time.perf_counter() - t0) / steps
        batch = InputBatch.from_step(step, runner.block_size)  # the step's kernels, sampler included
        runner.packed.pack(batch, turn=0)
        runner.packed.copy(batch, runner.stream)
        runner.stream.synchronize()
        kernels = time_launches(lambda i, s: runner.run(batch, s), 1, repeats=20)
    finally:
        alloc.free(row)
    tok_s = 64 / total
    rec.add(f"gpu_engine_{label}", [1, 64], "tok/s", tok_s, None, seconds=total)
    rec.add(f"gpu_step_wall_{label}", [1], "us", wall * 1e6, None)
    rec.add(f"gpu_step_kernels_{label}", [1], "us", kernels * 1e6, None, launch_share=1 - kernels / wall)
    print(f"{label}: {tok_s:6.1f} tok/s (batch 1, 64 new tokens incl. prefill); decode step {wall * 1e6:.0f} us from Python, "
          f"{kernels * 1e6:.0f} us of kernels in a graph: {1 - kernels / wall:.0%} lost to launches and the host")


if __name__ == "__main__":
    for n in (1, 8, 64, 256):
        bench_decode_attention(n)
    for n in (1, 64, 256):  # the engine sizes the grid for max_model_len: what do the empty splits cost?
        bench_decode_attention(n, bound=4096)
    bench_engine("smollm2", "smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        bench_engine("llama_1b_random", str(make_random_llama(tmp, LLAMA_3_2_1B_CONFIG, seed=0)))
    print("saved", rec.save())
