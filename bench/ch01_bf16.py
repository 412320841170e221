"""Chapter 01 on a GPU: the fastest ways to move and to read bytes that this GPU offers (the
book's copy, also at several grid shapes, a read-only reduction, the driver's device-to-device
copy, torch's copy where torch is installed), whose best is the bandwidth ceiling every
memory-bound kernel is measured against (measure.bandwidth_ceiling), not the book's copy; and the
widening kernel against that ceiling. Records to book/data/ch01_bf16.json.

    python bench/ch01_bf16.py
"""

import time

import numpy as np
from numba import cuda, uint64

from tinyvllm_lib.kernels.bf16 import copy_u64_kernel, widen_bf16
from tinyvllm_lib.measure import CEILING_RECORDS, Recorder, time_launches
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
    assert np.array_equal(dst.copy_to_host()[:1000], src.copy_to_host()[:1000])
    rec.add("copy", [n], "GB/s", 2 * n * 8 / sec / 1e9, note="uint64 grid-stride copy, read + write bytes")

    # Widen: 2**28 bf16 values (512 MiB in, 1 GiB out).
    n = 2**28
    bits = cuda.to_device(rng.integers(0, 2**16, size=n, dtype=np.uint32).astype(np.uint16))
    out = cuda.device_array(n, np.float32)
    sec = time_launches(lambda i, s: widen_bf16(bits, out, 256, s), num_launches=10)

    ceilings(rec, rng, sm_count)
    # the ceiling: the best of this run's copy and read rates (what bandwidth_ceiling returns)
    best = max((r for r in rec.records if r["name"] in CEILING_RECORDS), key=lambda r: r["value"])
    rec.add("widen_bf16", [n], "GB/s", n * 6 / sec / 1e9, ceiling=best["value"], ceiling_name=best["name"],
            us=sec * 1e6)
    path = rec.save()
    for r in rec.records:
        print(f"{r['name']:>14} {r['shape']}: {r['value']:8.1f} {r['metric']}"
              + (f"  {r['ratio']:.0%} of the ceiling ({r['ceiling_name']})" if "ratio" in r else ""))
    print(f"recorded in {path}")


@cuda.jit
def read_u64_kernel(src, out):
    """Each thread sums (xor) its grid-stride share of src: every byte read once, one word
    written per thread."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    acc = uint64(0)
    while i < src.shape[0]:
        acc ^= src[i]
        i += stride
    out[cuda.grid(1)] = acc


@cuda.jit
def read_u64_x4_kernel(src, out):
    """As read_u64_kernel with four independent loads per thread per step: more bytes in
    flight, as chapter 6's GEMV keeps them."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    a, b, c, d = uint64(0), uint64(0), uint64(0), uint64(0)
    while i + 3 * stride < src.shape[0]:
        a ^= src[i]
        b ^= src[i + stride]
        c ^= src[i + 2 * stride]
        d ^= src[i + 3 * stride]
        i += 4 * stride
    while i < src.shape[0]:
        a ^= src[i]
        i += stride
    out[cuda.grid(1)] = a ^ b ^ c ^ d


def event_seconds(run, repeats: int = 10) -> float:
    """Median seconds of run(stream), timed with CUDA events (no graph: the driver's copy
    is not a kernel)."""
    stream, start, end = cuda.stream(), cuda.event(), cuda.event()
    run(stream)
    samples = []
    for _ in range(repeats):
        start.record(stream)
        run(stream)
        end.record(stream)
        end.synchronize()
        samples.append(cuda.event_elapsed_time(start, end) / 1e3)
    return float(np.median(samples))


def ceilings(rec, rng, sm_count: int) -> None:
    """The book's copy at several grids, a read-only reduction, the driver's copy, torch's."""
    n = 2**27  # 1 GiB of uint64
    src = cuda.to_device(rng.integers(0, 2**63, size=n, dtype=np.uint64))
    dst = cuda.device_array_like(src)
    best = {}
    for per_sm, threads in ((4, 256), (8, 256), (16, 512), (32, 256), (32, 1024)):
        blocks = sm_count * per_sm
        sec = time_launches(lambda i, s: copy_u64_kernel[blocks, threads, s](src, dst), num_launches=10)
        best["copy_grid"] = max(best.get("copy_grid", (0,)), (2 * n * 8 / sec / 1e9, blocks, threads))
        out = cuda.device_array(blocks * threads, np.uint64)
        want = np.bitwise_xor.reduce(src.copy_to_host())
        for loads, kernel in ((1, read_u64_kernel), (4, read_u64_x4_kernel)):
            sec = time_launches(lambda i, s: kernel[blocks, threads, s](src, out), num_launches=10)
            assert np.bitwise_xor.reduce(out.copy_to_host()) == want, "the read kernel read something else"
            best["read_only"] = max(best.get("read_only", (0,)), (n * 8 / sec / 1e9, blocks, threads, loads))
    gbs, blocks, threads = best["copy_grid"]
    rec.add("copy_best_grid", [n], "GB/s", gbs, blocks=blocks, threads=threads,
            note="the book's uint64 copy at its best of five grids, read + write bytes")
    gbs, blocks, threads, loads = best["read_only"]
    rec.add("read_only", [n], "GB/s", gbs, blocks=blocks, threads=threads, loads_per_step=loads,
            note="uint64 grid-stride xor-reduction, best of 1 and 4 loads a thread a step and five grids: "
                 "every byte read once, nothing written but one word a thread")
    sec = event_seconds(lambda s: dst.copy_to_device(src, stream=s))
    rec.add("copy_driver", [n], "GB/s", 2 * n * 8 / sec / 1e9, note="cuMemcpyDtoDAsync, read + write bytes")
    try:
        import torch
    except ImportError:
        return
    a = torch.empty(n, dtype=torch.int64, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rec.add("copy_torch", [n], "GB/s", 2 * n * 8 / float(np.median(times)) / 1e9,
            torch=torch.__version__, note="torch Tensor.copy_ on the device, host-timed with synchronize")


if __name__ == "__main__":
    main()
