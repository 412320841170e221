"""Chapter 05 on a GPU: the RoPE ladder on Llama 3.2 1B's fused QKV buffer at a 2,048-token
prefill, and the final kernel at decode sizes (1-256 tokens), against the bandwidth ceiling recorded
by bench/ch01_bf16.py. Records to book/data/ch05_rope.json.

    python bench/ch05_rope.py

With NUMBA_ENABLE_CUDASIM=1 it is a dry run on tiny shapes that records nothing.
"""

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import copy_u64_kernel
from tinyvllm_lib.kernels.rope import ROPE_VARIANTS, rope_qkv, rope_qkv_ref, rope_table
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    device_info,
    num_rotations,
    time_launches,
)
from tinyvllm_lib.runtime import has_gpu, is_simulator

SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
if is_simulator():
    HEADS, KV_HEADS, HEAD_DIM, NUM_POSITIONS = 4, 2, 8, 64
    PREFILL, DECODE, MAX_SETS, REPEATS = 6, [1, 2], 2, 1
else:  # Llama 3.2 1B: 32 query heads, 8 KV heads of 64; rope_theta 500,000; 131,072 positions
    HEADS, KV_HEADS, HEAD_DIM, NUM_POSITIONS = 32, 8, 64, 131072
    PREFILL, DECODE, MAX_SETS, REPEATS = 2048, [1, 8, 64, 256], 64, 10
WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def ceiling_for_this_gpu() -> tuple[float, str]:
    """(GB/s, name): the bandwidth ceiling recorded for this GPU by bench/ch01_bf16.py
    (measure.bandwidth_ceiling); the book's copy measured here if there is none."""
    name = device_info()["name"]
    gbs, ceiling_name = bandwidth_ceiling(name)
    if ceiling_name or is_simulator():
        return gbs, ceiling_name
    n = 2**27  # 1 GiB of uint64 words
    src = cuda.to_device(np.arange(n, dtype=np.uint64))
    dst = cuda.device_array_like(src)
    blocks = cuda.get_current_device().MULTIPROCESSOR_COUNT * 8
    sec = time_launches(lambda i, s: copy_u64_kernel[blocks, 256, s](src, dst), num_launches=10)
    print(f"no ceiling recorded for {name}: measured the copy, {2 * n * 8 / sec / 1e9:.0f} GB/s, here")
    return 2 * n * 8 / sec / 1e9, "copy measured here"


def compulsory_bytes(num_tokens: int, uses_table: bool) -> int:
    """Read + write Q and K in float32, the int32 positions, one cos and one sin row per token (distinct positions)."""
    qk = 2 * num_tokens * (HEADS + KV_HEADS) * HEAD_DIM * 4
    return qk + num_tokens * 4 + (num_tokens * HEAD_DIM * 4 if uses_table else 0)


def bench(rec, rng, table, d_table, variant: str, num_tokens: int, is_prefill: bool, ceiling: tuple[float, str]):
    nbytes = compulsory_bytes(num_tokens, variant != "on_the_fly")
    num_sets = min(num_rotations(nbytes), MAX_SETS)
    qkvs, positions = [], []
    for _ in range(num_sets):
        qkvs.append(cuda.to_device(rng.standard_normal((num_tokens, WIDTH), dtype=np.float32)))
        if is_prefill:  # a prompt continuing at some position
            start = rng.integers(0, NUM_POSITIONS - num_tokens + 1)
            pos = np.arange(start, start + num_tokens)
        else:  # one token per sequence, each sequence at its own position
            pos = rng.integers(0, NUM_POSITIONS, num_tokens)
        positions.append(cuda.to_device(pos.astype(np.int32)))
    before = qkvs[0].copy_to_host()
    rope_qkv(qkvs[0], positions[0], d_table, HEADS, KV_HEADS, variant=variant)
    want = rope_qkv_ref(before, positions[0].copy_to_host(), table, HEADS, KV_HEADS)
    err = np.max(np.abs(qkvs[0].copy_to_host() - want)) / np.max(np.abs(want))
    assert err <= 1e-5, f"rope {variant} {num_tokens} tokens: error {err:.2e} against rope_qkv_ref"
    num_launches = num_sets if is_simulator() else max(2 * num_sets, 20)
    sec = time_launches(lambda i, s: rope_qkv(qkvs[i % num_sets], positions[i % num_sets], d_table, HEADS, KV_HEADS, s, variant),
                        num_launches, REPEATS)
    rec.add(f"rope_{variant}", [num_tokens, HEADS, KV_HEADS, HEAD_DIM], "GB/s", nbytes / sec / 1e9, ceiling=ceiling[0], ceiling_name=ceiling[1],
            us=sec * 1e6, bytes=nbytes, buffer_sets=num_sets, table_bytes_counted=variant != "on_the_fly")


def main():
    if not (has_gpu() or is_simulator()):
        raise SystemExit("bench/ch05_rope.py needs a CUDA GPU (or NUMBA_ENABLE_CUDASIM=1 for a dry run)")
    rng = np.random.default_rng()
    rec = Recorder("ch05_rope")
    ceiling = ceiling_for_this_gpu()  # (GB/s, name)
    table = rope_table(HEAD_DIM, 500000.0, NUM_POSITIONS, SCALING)
    d_table = table.to_device()

    for variant in ROPE_VARIANTS:
        bench(rec, rng, table, d_table, variant, PREFILL, True, ceiling)
    for num_tokens in DECODE:
        bench(rec, rng, table, d_table, "heads_per_thread", num_tokens, False, ceiling)

    print(f"{'kernel':>22} {'tokens':>7} {'GB/s':>8} {'of ceil':>8} {'µs':>9}")
    for r in rec.records:
        print(f"{r['name']:>22} {r['shape'][0]:>7} {r['value']:8.1f} {r['ratio']:8.0%} {r['us']:9.2f}")
    if is_simulator():
        print("simulator dry run: nothing recorded")
    else:
        print(f"recorded in {rec.save()}")


if __name__ == "__main__":
    main()
