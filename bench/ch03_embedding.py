"""Chapter 03 on a GPU: the embedding lookup at Llama 3.2 1B's shape (vocab 128256, hidden 2048),
both rungs, at decode sizes (1..256 tokens) and a 2048-token prefill, against the bandwidth ceiling
of chapter 01 (measure.bandwidth_ceiling: its best copy or read rate); plus an empty kernel, the floor of any launch. Records to book/data/ch03_embedding.json.

    python bench/ch03_embedding.py
"""

import time

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import copy_u64_kernel
from tinyvllm_lib.kernels.embedding import embed, embed_reference, embed_rows
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    num_rotations,
    time_launches,
)
from tinyvllm_lib.runtime import has_gpu

VOCAB, HIDDEN = 128256, 2048  # Llama 3.2 1B
DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_TOKENS = [2048]
MAX_ROTATIONS = 4096  # a graph of this many launches captures in well under a second
RUNGS = {"embed_rows": embed_rows, "embed_wide": embed}


@cuda.jit
def empty_kernel():
    pass


def ceiling_for(device_name: str, rng) -> tuple[float, str]:
    """(GB/s, name): chapter 01's bandwidth ceiling for this GPU, else the book's copy measured here."""
    gbs, name = bandwidth_ceiling(device_name)
    if name:
        return gbs, name
    n = 2**27  # 1 GiB of uint64 words, far larger than L2
    src = cuda.to_device(rng.integers(0, 2**63, size=n, dtype=np.uint64))
    dst = cuda.device_array_like(src)
    blocks = cuda.get_current_device().MULTIPROCESSOR_COUNT * 8
    sec = time_launches(lambda i, s: copy_u64_kernel[blocks, 256, s](src, dst), num_launches=10)
    return 2 * n * 8 / sec / 1e9, "copy measured by bench/ch03_embedding.py"


def main():
    if not has_gpu():
        raise SystemExit("bench/ch03_embedding.py needs a CUDA GPU")
    start = time.perf_counter()
    rng = np.random.default_rng()
    rec = Recorder("ch03_embedding")
    ceiling_gbs, ceiling_name = ceiling_for(rec.device["name"], rng)

    table_host = rng.integers(0, 2**16, size=(VOCAB, HIDDEN), dtype=np.uint16)  # 525 MB: rows come from DRAM
    table = cuda.to_device(table_host)

    sec = time_launches(lambda i, s: empty_kernel[1, 32, s](), num_launches=1000)
    rec.add("empty_kernel", [], "us", sec * 1e6, note="an empty kernel replayed from a CUDA graph: the floor of any launch")

    for num_tokens in DECODE_TOKENS + PREFILL_TOKENS:
        nbytes = num_tokens * (HIDDEN * (2 + 4) + 4)  # bf16 row read + float32 row written + the id
        rotations = min(num_rotations(nbytes), MAX_ROTATIONS)
        ids_host = rng.integers(0, VOCAB, size=(rotations, num_tokens)).astype(np.int32)
        ids_all = cuda.to_device(ids_host)
        out_all = cuda.device_array((rotations, num_tokens, HIDDEN), np.float32)
        ids, outs = [ids_all[r] for r in range(rotations)], [out_all[r] for r in range(rotations)]
        for name, launcher in RUNGS.items():
            sec = time_launches(lambda i, s: launcher(ids[i], table, outs[i], stream=s), num_launches=rotations)
            for r in (0, rotations - 1):
                got = outs[r].copy_to_host().view(np.uint32)
                assert np.array_equal(got, embed_reference(ids_host[r], table_host).view(np.uint32)), name
            rec.add(name, [num_tokens, HIDDEN], "GB/s", nbytes / sec / 1e9, ceiling=ceiling_gbs, us=sec * 1e6, bytes=nbytes,
                    phase="decode" if num_tokens in DECODE_TOKENS else "prefill", rotations=rotations,
                    ceiling_name=ceiling_name)

    path = rec.save()
    for r in rec.records:
        extra = f"  {r['ratio']:5.1%} of the ceiling, {r['us']:7.2f} µs" if "ratio" in r else ""
        print(f"{r['name']:>13} {str(r['shape']):>12}: {r['value']:8.2f} {r['metric']}{extra}")
    print(f"ceiling {ceiling_gbs:.0f} GB/s ({ceiling_name}); recorded in {path} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
