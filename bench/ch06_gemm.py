"""Chapter 06 on a GPU: the GEMVs of a whole decoding step of Llama 3.2 1B (1 to 16 token vectors)
against cuBLAS, prefill through cuBLAS (`linear` against the same call made directly), and the
GEMM ladder. Records to book/data/ch06_gemm.json. Without nvmath-python the cuBLAS rows are skipped.

    python bench/ch06_gemm.py            # pip install nvmath-python[cu13] for the cuBLAS rows

Where two implementations are compared, each is captured in its own CUDA graph, every graph is
warmed up, and then their replays alternate (A B, B A, A B, ...) for ROUNDS rounds; each gets the
median of its samples. Timing one after the other lets the GPU's clock, which follows its power
draw and temperature, favour whichever ran first.
"""

import statistics
import time

import numpy as np
from numba import cuda

from tinyvllm_lib.cuda_graph import CudaGraph
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.kernels.checks import device_pointer
from tinyvllm_lib.kernels.cublas import (
    cublas_unavailable_reason,
    gemm_cublas,
    get_cublas,
)
from tinyvllm_lib.kernels.gemm import (
    gemm_blocked,
    gemm_bytes,
    gemm_flops,
    gemm_naive,
    gemm_shared,
)
from tinyvllm_lib.kernels.gemv import GEMV_VARIANTS, gemv
from tinyvllm_lib.layers.linear import LINEAR_GEMV_MAX_TOKENS, gemv_wins_up_to, linear
from tinyvllm_lib.measure import (
    Recorder,
    bandwidth_ceiling,
    num_rotations,
    time_launches,
)
from tinyvllm_lib.runtime import has_gpu

NUM_LAYERS = 16
PROJECTIONS = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # (N, K)
LM_HEAD = (128256, 2048)
PREFILL_TOKENS = 2048
TOKEN_COUNTS = range(1, 17)  # token vectors per decoding step
FP32_PEAK, BF16_PEAK = 67.0, 989.0  # TFLOP/s, H200 SXM datasheet (CUDA-core FMA; dense bf16 tensor cores)
WORKSPACE_BYTES = 32 * 2**20  # cuBLAS workspace handed over by the caller
ROUNDS = 15  # alternating replays per compared path
DECODE_ROUNDS = 10  # the same for whole decoding steps (65 launches per replay)
WARM_SECONDS = 0.05  # replays of each graph before sampling: clocks up, caches and cuBLAS's heuristics settled


def random_bits(rng, n: int) -> np.ndarray:
    """n random bf16 bit patterns with |value| in [2^-5, 2^-1): random sign and mantissa, four exponents."""
    r = rng.integers(0, 2**16, size=n, dtype=np.uint16)
    return (r & 0x807F) | ((0x7A + ((r >> 7) & 3)) << 7)


def check(x_dev, w_dev, out_dev, what: str, num_tokens: int = 64, num_rows: int = 256) -> float:
    """out against the float64 reference on the first tokens and the first and last rows of w."""
    M, N = out_dev.shape
    m = min(M, num_tokens)
    x = bf16_bits_to_f32(x_dev[:m].copy_to_host()).astype(np.float64)
    out = out_dev[:m].copy_to_host()
    if N <= 2 * num_rows:
        idx, w = np.arange(N), w_dev.copy_to_host()
    else:
        idx = np.r_[0:num_rows, N - num_rows : N]
        w = np.concatenate([w_dev[:num_rows].copy_to_host(), w_dev[N - num_rows :].copy_to_host()])
    w = bf16_bits_to_f32(w).astype(np.float64)
    want = x @ w.T
    err = float(np.max(np.abs(out[:, idx] - want)) / np.max(np.abs(want)))
    if not err <= 1e-4:
        raise AssertionError(f"{what}: relative error {err:.2e} against the float64 reference")
    return err


def time_interleaved(paths: dict, num_launches: int, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Seconds per launch of each path `launch(i, stream)`, i = 0..num_launches-1: every sample of each.

    Each path is captured once as a CUDA graph of num_launches launches; every graph is replayed for
    WARM_SECONDS; then the graphs are replayed in turn, the order reversed every round, so that a drift
    of the GPU's clock over the measurement falls on all of them alike.
    """
    graphs = {name: CudaGraph(lambda s, f=launch: [f(i, s) for i in range(num_launches)]) for name, launch in paths.items()}
    start, end = cuda.event(), cuda.event()

    def replay(graph) -> float:
        start.record(graph.stream)
        graph.replay()
        end.record(graph.stream)
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / 1e3

    for graph in graphs.values():
        once = replay(graph)
        for _ in range(int(WARM_SECONDS / once)):
            graph.replay()
        graph.stream.synchronize()
    samples = {name: [] for name in graphs}
    order = list(graphs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            samples[name].append(replay(graphs[name]) / num_launches)
    return samples


def summary(samples: list[float]) -> dict:
    """The median of the samples, in seconds, and their range in µs (how much the GPU drifted)."""
    return dict(sec=statistics.median(samples), us_min=min(samples) * 1e6, us_max=max(samples) * 1e6,
                rounds=len(samples))


def main():
    if not has_gpu():
        raise SystemExit("bench/ch06_gemm.py needs a CUDA GPU")
    rec = Recorder("ch06_gemm")
    # chapter 1's bandwidth ceiling on this GPU: the best of its copy and read rates
    ceiling_gbs, ceiling_name = bandwidth_ceiling(rec.device["name"])
    if not ceiling_name:
        raise SystemExit(f"no bandwidth ceiling recorded for {rec.device['name']}: run bench/ch01_bf16.py first")
    rng = np.random.default_rng()
    t_start = time.perf_counter()

    # Weights: distinct buffers for every layer (2.5 GB in all), so nothing is served from L2.
    pool = random_bits(rng, LM_HEAD[0] * LM_HEAD[1] + 4096)
    weights = {}
    for name, (N, K) in PROJECTIONS.items():
        offsets = rng.integers(0, pool.size - N * K, size=NUM_LAYERS)
        weights[name] = [cuda.to_device(pool[o : o + N * K].reshape(N, K)) for o in offsets]
    weights["lm_head"] = [cuda.to_device(pool[: LM_HEAD[0] * LM_HEAD[1]].reshape(LM_HEAD))]
    shapes = {**PROJECTIONS, "lm_head": LM_HEAD}
    xs = {K: cuda.to_device(random_bits(rng, PREFILL_TOKENS * K).reshape(PREFILL_TOKENS, K)) for K in {K for _, K in shapes.values()}}
    outs = {name: cuda.device_array((PREFILL_TOKENS if name != "lm_head" else max(TOKEN_COUNTS), N), np.float32)
            for name, (N, K) in shapes.items()}
    workspace = cuda.device_array(WORKSPACE_BYTES, np.uint8)
    cublas_ok = get_cublas() is not None
    if not cublas_ok:
        print(f"cuBLAS rows skipped: {cublas_unavailable_reason()}")

    def extras(M, N, K, sec):
        flops, nbytes = gemm_flops(M, N, K), gemm_bytes(M, N, K)
        return dict(us=sec * 1e6, flops=flops, bytes=nbytes, tflops=flops / sec / 1e12)

    # 1. Each decoding shape alone, one token vector, both GEMV variants alternated: bytes over time
    #    against the ceiling. A single LM head (525 MB) is already far past L2.
    for name, (N, K) in shapes.items():
        ws, x, out = weights[name], xs[K][:1], outs[name][:1]
        for variant in GEMV_VARIANTS:
            gemv(x, ws[0], out, variant=variant)
            check(x, ws[0], out, f"gemv[{variant}] {name}")
        paths = {variant: (lambda i, s, v=variant: gemv(x, ws[i % len(ws)], out, stream=s, variant=v))
                 for variant in GEMV_VARIANTS}
        for variant, samples in time_interleaved(paths, len(ws)).items():
            t = summary(samples)
            rec.add(f"gemv_{variant}", [1, N, K], "GB/s", gemm_bytes(1, N, K) / t["sec"] / 1e9, ceiling=ceiling_gbs,
                    ceiling_name=ceiling_name, layer=name, **extras(1, N, K, t["sec"]), us_min=t["us_min"], us_max=t["us_max"], rounds=t["rounds"])

    # 2. One whole decoding step: 16 layers x 4 projections + the LM head, 1 to 16 token vectors;
    #    the GEMV ("auto", as linear uses it, and each variant) and cuBLAS, alternated.
    step = [(name, weights[name][layer]) for layer in range(NUM_LAYERS) for name in PROJECTIONS]
    step.append(("lm_head", weights["lm_head"][0]))
    weight_bytes = sum(2 * w.shape[0] * w.shape[1] for _, w in step)
    for M in TOKEN_COUNTS:
        launches = [(xs[w.shape[1]][:M], w, outs[name][:M]) for name, w in step]
        flops = sum(gemm_flops(M, w.shape[0], w.shape[1]) for _, w in step)
        nbytes = sum(gemm_bytes(M, w.shape[0], w.shape[1]) for _, w in step)
        paths = {"gemv": lambda i, s: gemv(*launches[i], stream=s)}
        for variant in GEMV_VARIANTS:
            paths[f"gemv_{variant}"] = lambda i, s, v=variant: gemv(*launches[i], stream=s, variant=v)
        if cublas_ok:
            paths["cublas"] = lambda i, s: gemm_cublas(*launches[i], stream=s, workspace=workspace)
        for path, launch in paths.items():
            for i in (0, 1, 2, 3, len(launches) - 1):  # one layer's four projections and the LM head
                launch(i, 0)
                check(*launches[i], f"decode step {path}, M={M}, {step[i][0]}")
        for path, samples in time_interleaved(paths, len(launches), rounds=DECODE_ROUNDS).items():
            t = summary(samples)
            total = t["sec"] * len(launches)
            rec.add(f"decode_step_{path}", [M], "GB/s", weight_bytes / total / 1e9, ceiling=ceiling_gbs,
                    ceiling_name=ceiling_name, us=total * 1e6, flops=flops, bytes=nbytes, tflops=flops / total / 1e12,
                    us_min=t["us_min"] * len(launches), us_max=t["us_max"] * len(launches), rounds=t["rounds"],
                    note="weight bytes of 16 layers + LM head over the summed kernel time")

    # 3. Prefill: 2048 tokens through each projection. linear (its cuBLAS path) against the same
    #    cuBLAS call made directly, alternated; rung 3 against the fp32 peak and against cuBLAS.
    M = PREFILL_TOKENS
    cublas_sec = {}
    for name, (N, K) in PROJECTIONS.items():
        ws, x, out = weights[name], xs[K], outs[name]
        need = num_rotations(2 * N * K)  # enough matrices that each is evicted from L2 before its turn
        if len(ws) < need:
            ws = ws + [cuda.to_device(pool[o : o + N * K].reshape(N, K)) for o in rng.integers(0, pool.size - N * K, size=need - len(ws))]
        rotations = len(ws)  # rotated alike in both paths
        if cublas_ok:
            g = get_cublas()
            cb = g.cublas
            x_ptr, out_ptr, ws_ptr = device_pointer(x), device_pointer(out), device_pointer(workspace)
            w_ptrs = [device_pointer(w) for w in ws]

            def direct(i, s):  # the bare nvmath calls that linear makes, arguments precomputed
                cb.set_stream(g.handle, int(s))
                cb.set_workspace(g.handle, ws_ptr, WORKSPACE_BYTES)
                g._bound = None  # the handle's stream changed behind CublasGemm's back: linear must bind again
                cb.gemm_ex(g.handle, g.op_t, g.op_n, N, M, K, g.alpha.ctypes.data, w_ptrs[i % rotations], g.bf16, K,
                           x_ptr, g.bf16, K, g.beta.ctypes.data, out_ptr, g.f32, N, g.compute, g.algo)

            def via_linear(i, s):
                linear(x, ws[i % rotations], out, stream=s, workspace=workspace)

            via_linear(0, 0)
            check(x, ws[0], out, f"linear (cuBLAS) prefill {name}")
            direct(0, 0)
            check(x, ws[0], out, f"direct cuBLAS prefill {name}")
            cuda.synchronize()
            times = {path: summary(samples) for path, samples in
                     time_interleaved({"direct": direct, "linear": via_linear}, rotations).items()}
            t_direct, t_linear = times["direct"]["sec"], times["linear"]["sec"]
            cublas_sec[name] = t_direct
            for path, t in times.items():
                more = {"vs_direct": t_direct / t_linear} if path == "linear" else {}
                rec.add(f"prefill_{'cublas' if path == 'direct' else 'linear'}", [M, N, K], "TFLOP/s",
                        gemm_flops(M, N, K) / t["sec"] / 1e12, ceiling=BF16_PEAK, layer=name, **more,
                        **extras(M, N, K, t["sec"]), us_min=t["us_min"], us_max=t["us_max"], rounds=t["rounds"],
                        note="direct and linear graphs replayed alternately, median of each")
        gemm_blocked(x, ws[0], out)
        check(x, ws[0], out, f"gemm_blocked prefill {name}")
        sec = time_launches(lambda i, s: gemm_blocked(x, ws[i % len(ws)], out, stream=s), 4, repeats=3)
        more = {"vs_cublas": cublas_sec[name] / sec} if name in cublas_sec else {}
        rec.add("prefill_blocked", [M, N, K], "TFLOP/s", gemm_flops(M, N, K) / sec / 1e12, ceiling=FP32_PEAK,
                layer=name, **more, **extras(M, N, K, sec))

    # 4. The ladder on the o projection's 2048-cube.
    N, K = PROJECTIONS["o"]
    ws, x, out = weights["o"], xs[K], outs["o"]
    for rung, launch, num in [("naive", gemm_naive, 2), ("shared", gemm_shared, 2), ("blocked", gemm_blocked, 4)]:
        launch(x, ws[0], out)
        check(x, ws[0], out, f"ladder {rung}")
        sec = time_launches(lambda i, s: launch(x, ws[i % len(ws)], out, stream=s), num, repeats=3)
        more = {"vs_cublas": cublas_sec["o"] / sec} if "o" in cublas_sec else {}
        rec.add(f"ladder_{rung}", [M, N, K], "TFLOP/s", gemm_flops(M, N, K) / sec / 1e12, ceiling=FP32_PEAK,
                **more, **extras(M, N, K, sec))

    # 5. What one call of linear costs the host (Python): why decoding steps are captured as graphs.
    x, w, out = xs[K][:1], weights["o"][0], outs["o"][:1]
    linear(x, w, out)
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500):
        linear(x, w, out)
    host_us = (time.perf_counter() - t0) / 500 * 1e6
    cuda.synchronize()
    rec.add("linear_host_call", [1, N, K], "us", host_us, note="Python time per linear() call, GEMV path, no graph")

    path = rec.save()
    print(f"\n{'name':>22} {'shape':>20} {'value':>10}          {'of ceiling':>10}  other")
    for r in rec.records:
        if r["name"].startswith("decode_step") and r["shape"][0] not in (1, 2, 3, 4, 8, 16):
            continue  # the table shows a few token counts; the file has them all
        other = "  ".join(f"{k} {r[k]:.1%}" for k in ("vs_direct", "vs_cublas") if k in r)
        if "us" in r and r["metric"] != "us":
            other += f"  {r['us']:.1f} us"
        if "us_min" in r:
            other += f" [{r['us_min']:.1f}..{r['us_max']:.1f}]"
        ratio = f"{r['ratio']:.1%}" if "ratio" in r else ""
        print(f"{r['name']:>22} {str(r['shape']):>20} {r['value']:10.1f} {r['metric']:<8} {ratio:>10}  {other}")
    wins = gemv_wins_up_to(rec.records)
    print(f"\nthe GEMV decoding step beats cuBLAS's up to {wins} token vectors; "
          f"layers.linear.LINEAR_GEMV_MAX_TOKENS = {LINEAR_GEMV_MAX_TOKENS}"
          + ("" if wins in (None, LINEAR_GEMV_MAX_TOKENS) else "  <-- update it in chapters/06_gemm.py"))
    print(f"recorded {len(rec.records)} measurements in {path} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
