"""Chapter 01 on a GPU: copy bandwidth (the ceiling of every memory-bound kernel) and the
widening kernel against it. Records to book/data/ch01_bf16.json.

    python bench/ch01_bf16.py
"""

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import copy_u64_kernel, widen_bf16
from tinyvllm_lib.measure import Recorder, time_launches
from tinyvllm_lib.runtime import has_gpu


def main():
    if not has_gpu():
        raise SystemExit("bench/ch01_bf16.py needs a CUDA GPU")
    rng = np.random.default_rng()
    rec = Recorder("ch01_bf16")
    sm_count = cuda.get_current_device().MULTIPROCESSOR_COUNT

    # Copy: 1 GiB of uint64 words, far larger than L2; bytes = read + write.
    n = 2**27
    src = cuda.to_device(rng.integers(0, 2**63, size=n, dtype=np.uint64))
    dst = cuda.device_array_like(src)
    blocks, threads = sm_count * 8, 256
    sec = time_launches(lambda i, s: copy_u64_kernel[blocks, threads, s](src, dst), num_launches=10)
    copy_gbs = 2 * n * 8 / sec / 1e9
    assert np.array_equal(dst.copy_to_host()[:1000], src.copy_to_host()[:1000])
    rec.add("copy", [n], "GB/s", copy_gbs, note="uint64 grid-stride copy, read + write bytes")

    # Widen: 2**28 bf16 values (512 MiB in, 1 GiB out).
    n = 2**28
    bits = cuda.to_device(rng.integers(0, 2**16, size=n, dtype=np.uint32).astype(np.uint16))
    out = cuda.device_array(n, np.float32)
    sec = time_launches(lambda i, s: widen_bf16(bits, out, 256, s), num_launches=10)
    rec.add("widen_bf16", [n], "GB/s", n * 6 / sec / 1e9, ceiling=copy_gbs, us=sec * 1e6)

    path = rec.save()
    for r in rec.records:
        print(f"{r['name']:>12} {r['shape']}: {r['value']:8.1f} {r['metric']}" + (f"  {r['ratio']:.0%} of copy" if "ratio" in r else ""))
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
