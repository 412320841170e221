"""Chapter 14's tensor-core decode attention under compute-sanitizer: Llama 3.2 1B's heads (32 query, 8 KV of
64), five rows with contexts of 1, 70, 64, 1,500 and 3,000 keys over a shuffled block table, without splits and
with up to 32 (so the last split's combine runs), both output types; each output checked against chapter 8's
kernel on the same cache, so a clean run is also a right one.

    compute-sanitizer --tool memcheck python3 bench/ch14_sanitize_decode.py
    compute-sanitizer --tool racecheck python3 bench/ch14_sanitize_decode.py
"""

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.decode_attention import decode_attention
from tinyvllm_lib.kernels.decode_splits import decode_workspace
from tinyvllm_lib.kernels.tc_decode import tc_decode_attention

H, KVH, D, BS, MAX_LEN = 32, 8, 64, 16, 3000


def main() -> None:
    rng = np.random.default_rng(0)
    lens = np.array([1, 70, 64, 1500, 3000], np.int32)
    max_blocks = -(-MAX_LEN // BS)
    tables = rng.permutation(len(lens) * max_blocks).reshape(len(lens), max_blocks).astype(np.int32)
    shape = (len(lens) * max_blocks * BS, KVH, D)
    k, v = (f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32)) for _ in range(2))
    qkv = rng.standard_normal((len(lens), (H + 2 * KVH) * D), dtype=np.float32)
    args = [cuda.to_device(a) for a in (qkv, k, v, tables)]
    d_lens = cuda.to_device(lens)
    for splits in (False, True):
        for out_dtype in (np.float32, np.uint16):
            outs = []
            for launcher in (tc_decode_attention, decode_attention):
                out = cuda.device_array((len(lens), H * D), out_dtype)
                ws = decode_workspace(len(lens), MAX_LEN, H, D) if splits else None
                launcher(*args, BS, d_lens, H, KVH, D, out, workspace=ws, max_context_len=MAX_LEN)
                got = out.copy_to_host()
                outs.append(bf16_bits_to_f32(got) if out_dtype == np.uint16 else got)
            err = float(np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max())
            print(f"splits {splits}, {np.dtype(out_dtype).name}: tensor cores against chapter 8's kernel, "
                  f"largest difference {err:.2e} of the largest output")
            assert err < 2.0**-6


if __name__ == "__main__":
    main()
