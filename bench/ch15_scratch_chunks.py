"""Chapter 15 on the GPU: the 8-bit weights' GEMM path (prefill, large batches) against bf16's, one matrix at a time.

Today's scratch path dequantizes a whole matrix into a bf16 scratch, then cuBLAS reads it: the scratch's bytes are
written to and read back from DRAM, three times bf16's traffic. Dequantizing a chunk of rows at a time into a scratch
that fits in L2, the GEMM of each chunk could read it from L2. For each decode shape of the Llama 3.2 1B stand-in and
M token rows, the median time of: bf16 cuBLAS (weights rotated past L2), the whole scratch, the chunks one after
another, and the dequantizing alone (whole, and in chunks into one buffer). (A first version also overlapped the
chunks on a second stream: no faster than the whole scratch, and CudaGraph's programmatic edges refused that graph's fork and join.)
Each replayed from a CUDA graph, the codes rotated past L2 too. Records to book/data/ch15_scratch_chunks.json.

    python bench/ch15_scratch_chunks.py [--rows 64 256] [--chunk-mib 8 16]
"""

import argparse

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import device_pointer
from tinyvllm_lib.kernels.cublas import gemm_cublas, get_cublas
from tinyvllm_lib.kernels.dequantize_8bit import dequantize_to_bf16
from tinyvllm_lib.measure import Recorder, max_rel_error, num_rotations, time_launches
from tinyvllm_lib.quantization.formats import quantize

SHAPES = {"qkv_proj": (3072, 2048), "o_proj": (2048, 2048), "gate_up_proj": (16384, 2048),
          "down_proj": (2048, 8192)}


def gemm_rows(x, w_rows, out, n0: int, stream) -> None:
    """out[:, n0 : n0 + len(w_rows)] = x · w_rowsᵀ: CublasGemm.gemm's call with out's full row as its leading dimension
    (gemm_cublas takes only a whole, contiguous out)."""
    g = get_cublas()
    g.bind(stream)
    (M, K), Nc, N = x.shape, w_rows.shape[0], out.shape[1]
    g.cublas.gemm_ex(g.handle, g.op_t, g.op_n, Nc, M, K, g.alpha.ctypes.data, device_pointer(w_rows), g.bf16, K,
                     device_pointer(x), g.bf16, K, g.beta.ctypes.data, device_pointer(out) + 4 * n0, g.f32, N,
                     g.compute, g.algo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--method", default="int8", choices=("int8", "fp8"))
    args = ap.parse_args()
    rec = Recorder("ch15_scratch_chunks")
    rng = np.random.default_rng(0)
    for layer, (N, K) in SHAPES.items():
        w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        q = quantize(w, args.method)
        copies = num_rotations(N * K)
        codes = [cuda.to_device(q.codes) for _ in range(copies)]
        scales = cuda.to_device(q.scales)
        w_bf16 = cuda.device_array((N, K), np.uint16)
        dequantize_to_bf16(codes[0], scales, w_bf16, args.method)
        bf16_copies = [w_bf16] + [cuda.to_device(w_bf16.copy_to_host()) for _ in range(num_rotations(2 * N * K) - 1)]
        whole = cuda.device_array((N, K), np.uint16)
        for M in args.rows:
            x = cuda.to_device(f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32)))
            out = cuda.device_array((M, N), np.float32)
            want = None
            times = {}

            def bf16(i, s):
                gemm_cublas(x, bf16_copies[i % len(bf16_copies)], out, s)

            def scratch(i, s):  # what QuantizedLinear's scratch path launches
                dequantize_to_bf16(codes[i % copies], scales, whole, args.method, s)
                gemm_cublas(x, whole, out, s)

            def dequant_whole(i, s):
                dequantize_to_bf16(codes[i % copies], scales, whole, args.method, s)

            variants = {"bf16": (bf16, len(bf16_copies)), "scratch": (scratch, copies),
                        "dequant_whole": (dequant_whole, copies)}
            for mib in args.chunk_mib:
                R = max(64, min(N, (mib << 20) // (2 * K) // 64 * 64))
                bufs = [cuda.device_array((R, K), np.uint16)]

                def serial(i, s, R=R, bufs=bufs):
                    c = codes[i % copies]
                    for n0 in range(0, N, R):
                        n1 = min(N, n0 + R)
                        dequantize_to_bf16(c[n0:n1], scales[n0:n1], bufs[0][: n1 - n0], args.method, s)
                        gemm_rows(x, bufs[0][: n1 - n0], out, n0, s)

                def dequant_only(i, s, R=R, bufs=bufs):
                    c = codes[i % copies]
                    for n0 in range(0, N, R):
                        n1 = min(N, n0 + R)
                        dequantize_to_bf16(c[n0:n1], scales[n0:n1], bufs[0][: n1 - n0], args.method, s)

                variants[f"serial_{mib}mib"] = (serial, copies)
                variants[f"dequant_{mib}mib"] = (dequant_only, copies)
            for name, (fn, n) in variants.items():
                out.copy_to_device(np.full((M, N), np.nan, np.float32))
                fn(0, 0)
                cuda.synchronize()
                got = out.copy_to_host()
                if want is None:
                    want = got
                err = 0.0 if name.startswith("dequant") else max_rel_error(got, want)
                assert err <= 1e-4, f"{layer} M={M} {name}: max relative error {err:.1e} against bf16"
                us = time_launches(fn, n) * 1e6
                times[name] = us
                rec.add("scratch_gemm", [M, N, K], "us", us, layer=layer, variant=name, method=args.method,
                        rel_error_vs_bf16=float(err))
                print(f"{layer:13s} M={M:4d} {name:14s} {us:8.1f} us  err {err:.1e}", flush=True)
    print("saved", rec.save())


if __name__ == "__main__":
    main()
