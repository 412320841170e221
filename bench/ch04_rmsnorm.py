"""Chapter 04 on a GPU: the RMSNorm ladder at a 2,048-token prefill, the fused residual add + norm
(rung 5 and the wide rung 6) with float32 and bf16 outputs, and decode sizes (1-256 rows), against
the bandwidth ceiling recorded by bench/ch01_bf16.py. Each record also notes the kernel's registers per
thread, its block size and how many of its blocks fit on a multiprocessor. Records to
book/data/ch04_rmsnorm.json.

    python bench/ch04_rmsnorm.py

With NUMBA_ENABLE_CUDASIM=1 it is a dry run on tiny shapes that records nothing.
"""

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import (
    bf16_bits_to_f32,
    copy_u64_kernel,
    f32_to_bf16_bits,
)
from tinyvllm_lib.kernels.rmsnorm import (
    RMSNORM_VARIANTS,
    block_threads,
    can_go_wide,
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
    wide_block_threads,
)
from tinyvllm_lib.kernels.rmsnorm_kernels import (
    fused_add_rmsnorm_kernel,
    fused_add_rmsnorm_wide_kernel,
)
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    device_info,
    num_rotations,
    time_launches,
)
from tinyvllm_lib.runtime import has_gpu, is_simulator

EPS = 1e-5  # Llama 3.2 1B's rms_norm_eps
if is_simulator():
    HIDDEN, PREFILL, DECODE, MAX_SETS, REPEATS = 96, 5, [1, 2], 2, 1
else:
    HIDDEN, PREFILL, DECODE, MAX_SETS, REPEATS = 2048, 2048, [1, 8, 64, 256], 64, 10  # Llama 3.2 1B's hidden_size


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


def num_launches(num_sets: int) -> int:
    """Launches per graph replay: every buffer set at least twice, and at least 20 (2 in the simulator)."""
    return num_sets if is_simulator() else max(2 * num_sets, 20)


def assert_matches(got, want, is_bf16: bool, what: str) -> None:
    if is_bf16:
        got, want, rtol = bf16_bits_to_f32(got), bf16_bits_to_f32(f32_to_bf16_bits(want)), 2**-7
    else:
        rtol = 1e-5
    err = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30))
    assert err <= rtol, f"{what}: relative error {err:.2e} against the NumPy reference"


def kernel_facts(kernel, out_dtype, is_wide: bool, threads: int) -> dict:
    """Threads per block, and on a GPU the registers per thread of the kernel compiled for this output
    and how many of its blocks (rows) the driver's occupancy calculator fits on one multiprocessor."""
    if is_simulator():
        return {"threads": threads}
    out_name = ({np.float32: "uint64", np.uint16: "uint32"} if is_wide else {np.float32: "float32", np.uint16: "uint16"})[out_dtype]
    try:
        compiled = next(k for args, k in kernel.overloads.items() if str(args[-1].dtype) == out_name)
        blocks_per_sm = compiled.max_cooperative_grid_blocks(threads) // cuda.get_current_device().MULTIPROCESSOR_COUNT
        return {"threads": threads, "registers": int(compiled.regs_per_thread), "blocks_per_sm": int(blocks_per_sm)}
    except Exception as err:  # a fact to print, not worth losing the measurements over
        print(f"no register count for {out_name} out: {type(err).__name__}: {err}")
        return {"threads": threads}


def bench_rmsnorm(rec, rng, variant: str, num_rows: int, out_dtype, ceiling: tuple[float, str], name: str):
    """Time rmsnorm(variant) on fresh rows; bytes = read x, write out, the weight once."""
    out_itemsize = np.dtype(out_dtype).itemsize
    nbytes = num_rows * HIDDEN * (4 + out_itemsize) + HIDDEN * 2
    num_sets = min(num_rotations(nbytes), MAX_SETS)
    weight = cuda.to_device(f32_to_bf16_bits(rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)))
    xs = [cuda.to_device(rng.standard_normal((num_rows, HIDDEN), dtype=np.float32)) for _ in range(num_sets)]
    outs = [cuda.device_array((num_rows, HIDDEN), out_dtype) for _ in range(num_sets)]
    is_wide = variant == "wide"
    assert not is_wide or all(can_go_wide(x, weight, out) for x, out in zip(xs, outs)), f"{name}: would fall back"
    rmsnorm(xs[0], weight, EPS, outs[0], variant=variant)
    want = rmsnorm_ref(xs[0].copy_to_host(), weight.copy_to_host(), EPS)
    assert_matches(outs[0].copy_to_host(), want, out_dtype == np.uint16, name)
    sec = time_launches(lambda i, s: rmsnorm(xs[i % num_sets], weight, EPS, outs[i % num_sets], s, variant), num_launches(num_sets), REPEATS)
    threads = wide_block_threads(HIDDEN) if is_wide else 128 if variant == "thread_per_row" else block_threads(HIDDEN)
    facts = kernel_facts(RMSNORM_VARIANTS[variant], out_dtype, is_wide, threads)
    rec.add(name, [num_rows, HIDDEN], "GB/s", nbytes / sec / 1e9, ceiling=ceiling[0], ceiling_name=ceiling[1], us=sec * 1e6, bytes=nbytes, buffer_sets=num_sets, **facts)


def bench_fused(rec, rng, variant: str, num_rows: int, out_dtype, ceiling: tuple[float, str], name: str):
    """Time fused_add_rmsnorm(variant); bytes = read residual and delta, write residual and out, the weight once."""
    out_itemsize = np.dtype(out_dtype).itemsize
    nbytes = num_rows * HIDDEN * (4 + 4 + 4 + out_itemsize) + HIDDEN * 2
    num_sets = min(num_rotations(nbytes), MAX_SETS)
    weight = cuda.to_device(f32_to_bf16_bits(rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)))
    residuals = [cuda.to_device(rng.standard_normal((num_rows, HIDDEN), dtype=np.float32)) for _ in range(num_sets)]
    deltas = [cuda.to_device(rng.standard_normal((num_rows, HIDDEN), dtype=np.float32)) for _ in range(num_sets)]
    outs = [cuda.device_array((num_rows, HIDDEN), out_dtype) for _ in range(num_sets)]
    is_wide = variant == "wide"
    assert not is_wide or all(can_go_wide(r, d, weight, o) for r, d, o in zip(residuals, deltas, outs)), f"{name}: would fall back"
    before = residuals[0].copy_to_host()
    fused_add_rmsnorm(residuals[0], deltas[0], weight, EPS, outs[0], variant=variant)
    want_residual, want = fused_add_rmsnorm_ref(before, deltas[0].copy_to_host(), weight.copy_to_host(), EPS)
    assert np.array_equal(residuals[0].copy_to_host(), want_residual), f"{name}: residual add is wrong"
    assert_matches(outs[0].copy_to_host(), want, out_dtype == np.uint16, name)

    def launch(i, stream):
        j = i % num_sets
        fused_add_rmsnorm(residuals[j], deltas[j], weight, EPS, outs[j], stream, variant=variant)

    sec = time_launches(launch, num_launches(num_sets), REPEATS)  # the residuals grow by delta per call: harmless
    kernel = fused_add_rmsnorm_wide_kernel if is_wide else fused_add_rmsnorm_kernel
    facts = kernel_facts(kernel, out_dtype, is_wide, wide_block_threads(HIDDEN) if is_wide else block_threads(HIDDEN))
    rec.add(name, [num_rows, HIDDEN], "GB/s", nbytes / sec / 1e9, ceiling=ceiling[0], ceiling_name=ceiling[1], us=sec * 1e6, bytes=nbytes, buffer_sets=num_sets, **facts)


def main():
    if not (has_gpu() or is_simulator()):
        raise SystemExit("bench/ch04_rmsnorm.py needs a CUDA GPU (or NUMBA_ENABLE_CUDASIM=1 for a dry run)")
    rng = np.random.default_rng()
    rec = Recorder("ch04_rmsnorm")
    ceiling = ceiling_for_this_gpu()  # (GB/s, name)

    for variant in RMSNORM_VARIANTS:  # the ladder, float32 out
        bench_rmsnorm(rec, rng, variant, PREFILL, np.float32, ceiling, f"rmsnorm_{variant}")
    for num_rows in [PREFILL] + DECODE:
        bench_rmsnorm(rec, rng, "registers", num_rows, np.uint16, ceiling, "rmsnorm_registers_bf16")
        bench_rmsnorm(rec, rng, "wide", num_rows, np.uint16, ceiling, "rmsnorm_wide_bf16")
        bench_fused(rec, rng, "registers", num_rows, np.uint16, ceiling, "fused_add_rmsnorm_bf16")  # rung 5
        bench_fused(rec, rng, "wide", num_rows, np.uint16, ceiling, "fused_add_rmsnorm_wide_bf16")  # rung 6
        bench_fused(rec, rng, "wide", num_rows, np.float32, ceiling, "fused_add_rmsnorm_wide_f32")
    bench_fused(rec, rng, "registers", PREFILL, np.float32, ceiling, "fused_add_rmsnorm_f32")

    print(f"{'kernel':>28} {'rows x hidden':>14} {'GB/s':>8} {'of ceil':>8} {'µs':>9} {'threads':>8} {'regs':>5} {'rows/SM':>8}")
    for r in rec.records:
        print(f"{r['name']:>28} {'x'.join(map(str, r['shape'])):>14} {r['value']:8.1f} {r['ratio']:8.0%} {r['us']:9.2f}"
              f" {r['threads']:>8} {r.get('registers', '-'):>5} {r.get('blocks_per_sm', '-'):>8}")
    if is_simulator():
        print("simulator dry run: nothing recorded")
    else:
        print(f"recorded in {rec.save()}")


if __name__ == "__main__":
    main()
