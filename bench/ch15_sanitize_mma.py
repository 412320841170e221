"""Chapter 15 on the GPU: the tensor-core 8-bit kernel (mma_8bit) under compute-sanitizer, at the 1B's shapes.

    compute-sanitizer --tool memcheck python3 bench/ch15_sanitize_mma.py
    compute-sanitizer --tool racecheck python3 bench/ch15_sanitize_mma.py

Each format, epilogue and tiling once (2 and 16 token vectors) on QKV's, gate-up's and down's shapes, fresh random
inputs; prints what it launched (the sanitizer prints what it found).
"""

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.mma_8bit import mma_8bit
from tinyvllm_lib.quantization.formats import quantize

rng = np.random.default_rng()
for method in ("int8", "fp8"):
    for name, N, K, kind in (("qkv", 3072, 2048, ""), ("gate_up", 16384, 2048, "gated"), ("down", 2048, 8192, "add")):
        q = quantize(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02), method)
        codes, scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
        for M in (2, 16):
            x = cuda.to_device(f32_to_bf16_bits(rng.standard_normal((M, K), dtype=np.float32)))
            out = cuda.device_array((M, N // 2), np.uint16) if kind == "gated" else cuda.to_device(
                rng.standard_normal((M, N)).astype(np.float32))
            mma_8bit(x, codes, scales, out, method, accumulate=kind == "add", gated=kind == "gated")
            cuda.synchronize()
            print(f"{method} {name} M={M} {kind or 'plain'}: launched", flush=True)
