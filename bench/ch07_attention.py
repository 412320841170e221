"""Chapter 07 on a GPU: prefill attention at Llama 3.2 1B's shapes (32 query heads, 8 KV heads of 64)
from 512 to 8,192 tokens — the fused kernel (flash_attention, float32 and bf16 output) against the
materialised one (scores (H, T, T) in memory, up to 4,096 tokens) — in TFLOP/s of causal FLOPs
(2 H D T (T + 1)) against the float32 CUDA-core peak. Every variant is checked against the NumPy
reference before it is timed (beyond 2,048 tokens, on the first KV head's group of query heads).
Records to book/data/ch07_attention.json.

    python bench/ch07_attention.py

With NUMBA_ENABLE_CUDASIM=1 it is a dry run on tiny shapes that records nothing.
"""

import time

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.attention import attention_flops, flash_attention
from tinyvllm_lib.kernels.attention_materialized import attention_materialized
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.measure import Recorder, max_rel_error, num_rotations, time_launches
from tinyvllm_lib.runtime import has_gpu, is_simulator

FP32_PEAK = 67.0  # TFLOP/s, H200 SXM datasheet: float32 FMA on CUDA cores (these kernels use no tensor cores)
if is_simulator():
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, LENGTHS, MATERIALIZED_MAX, CHECK_MAX, MAX_SETS = 4, 2, 16, [9, 12], 9, 9, 2
else:
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 64  # Llama 3.2 1B
    LENGTHS = [512, 1024, 2048, 4096, 8192]
    MATERIALIZED_MAX = 4096  # its scores are H T^2 float32: 2 GiB at 4,096 tokens, 8 GiB at 8,192
    CHECK_MAX = 2048  # the NumPy reference holds the scores too
    MAX_SETS = 8


def attention_f64(qkv: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """attention_ref's math in float64, so the check measures the kernel's float32 error, not the reference's."""
    T, group, D = qkv.shape[0], num_heads // num_kv_heads, head_dim
    qkv = qkv.astype(np.float64)
    q = qkv[:, : num_heads * D].reshape(T, num_heads, D).transpose(1, 0, 2)  # (H, T, D)
    k = qkv[:, num_heads * D : (num_heads + num_kv_heads) * D].reshape(T, num_kv_heads, D).transpose(1, 0, 2)
    v = qkv[:, (num_heads + num_kv_heads) * D :].reshape(T, num_kv_heads, D).transpose(1, 0, 2)
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # (H, T, D)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(D)  # (H, T, T)
    scores[:, np.triu(np.ones((T, T), bool), k=1)] = -np.inf
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(T, num_heads * D)


def reference(qkv: np.ndarray) -> tuple[np.ndarray, slice]:
    """Float64 attention of every head up to CHECK_MAX tokens; beyond, of the first KV head's group only (fewer scores to hold)."""
    H, KVH, D = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    if qkv.shape[0] <= CHECK_MAX:
        return attention_f64(qkv, H, KVH, D), slice(None)
    group = H // KVH
    sub = np.concatenate([qkv[:, : group * D], qkv[:, H * D : (H + 1) * D], qkv[:, (H + KVH) * D : (H + KVH + 1) * D]], axis=1)
    return attention_f64(sub, group, 1, D), slice(0, group * D)


def bench_length(rec: Recorder, rng, num_tokens: int) -> None:
    H, KVH, D = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    width = (H + 2 * KVH) * D
    num_sets = min(num_rotations(num_tokens * (width + H * D) * 4), MAX_SETS)  # qkv in, out: past the L2 cache
    qkvs = []
    for _ in range(num_sets):
        qkv = rng.standard_normal((num_tokens, width), dtype=np.float32)
        qkv[:, : H * D] *= 3  # peaked attention, as in a trained model
        qkvs.append(cuda.to_device(qkv))
    outs = [cuda.device_array((num_tokens, H * D), np.float32) for _ in range(num_sets)]
    outs_bf16 = [cuda.device_array((num_tokens, H * D), np.uint16) for _ in range(num_sets)]
    scores = cuda.device_array((H, num_tokens, num_tokens), np.float32) if num_tokens <= MATERIALIZED_MAX else None

    starts = cuda.to_device(np.array([0, num_tokens], np.int32))  # query_start_loc: one sequence
    variants = {
        "attention_flash": lambda i, s: flash_attention(qkvs[i % num_sets], starts, num_tokens, H, KVH, D,
                                                        outs[i % num_sets], stream=s),
        "attention_flash_bf16": lambda i, s: flash_attention(qkvs[i % num_sets], starts, num_tokens, H, KVH, D,
                                                             outs_bf16[i % num_sets], stream=s),
    }
    if scores is not None:
        variants["attention_materialized"] = lambda i, s: attention_materialized(
            qkvs[i % num_sets], H, KVH, D, scores, outs[i % num_sets], stream=s)

    want, cols = reference(qkvs[0].copy_to_host())
    for name, launch in variants.items():
        launch(0, 0)
        cuda.synchronize()
        if name == "attention_flash_bf16":  # against the float32 kernel's output (checked first): one bf16 step
            got, ref, tol = bf16_bits_to_f32(outs_bf16[0].copy_to_host()), bf16_bits_to_f32(f32_to_bf16_bits(outs[0].copy_to_host())), 2**-7
        else:
            # float32 sums over up to T keys: their rounding error grows with T, so the bound does too
            got, ref, tol = outs[0].copy_to_host()[:, cols], want, 1e-5 * max(1.0, num_tokens / 2048)
        err = max_rel_error(got, ref)
        assert err <= tol, f"{name} at {num_tokens} tokens: relative error {err:.2e}"
        sec = time_launches(launch, max(num_sets, 4), repeats=2 if is_simulator() else 10)
        flops = attention_flops(num_tokens, H, D)
        rec.add(name, [num_tokens, H, KVH, D], "TFLOP/s", flops / sec / 1e12, ceiling=FP32_PEAK, ms=sec * 1e3,
                gflop=flops / 1e9, buffer_sets=num_sets, max_rel_error=err)


def main():
    if not (has_gpu() or is_simulator()):
        raise SystemExit("bench/ch07_attention.py needs a CUDA GPU (or NUMBA_ENABLE_CUDASIM=1 for a dry run)")
    t0 = time.perf_counter()
    rng = np.random.default_rng()
    rec = Recorder("ch07_attention")
    for num_tokens in LENGTHS:
        bench_length(rec, rng, num_tokens)

    print(f"{'kernel':>24} {'T':>6} {'TFLOP/s':>8} {'of fp32':>8} {'ms':>9}")
    for r in rec.records:
        print(f"{r['name']:>24} {r['shape'][0]:6d} {r['value']:8.2f} {r['ratio']:8.1%} {r['ms']:9.3f}")
    flash = {r["shape"][0]: r for r in rec.records if r["name"] == "attention_flash"}
    for r in rec.records:
        if r["name"] == "attention_materialized":
            print(f"fused / materialised at {r['shape'][0]} tokens: {r['ms'] / flash[r['shape'][0]]['ms']:.1f}x")
    if is_simulator():
        print("simulator dry run: nothing recorded")
    else:
        print(f"recorded in {rec.save()} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
