"""Chapter 14's tensor-core attention under compute-sanitizer: one ragged paged batch at Llama 3.2 1B's
attention shapes (32 query heads, 8 KV heads of 64, and one of head_dim 128), a sequence with nothing cached
and one after cached tokens, lengths that are not multiples of a tile, a schedule padded with idle entries;
each output checked against the bf16-rounded NumPy reference, so a clean run is also a right one.

    compute-sanitizer --tool memcheck python3 bench/ch14_sanitize.py
    compute-sanitizer --tool racecheck python3 bench/ch14_sanitize.py
"""

import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.paged_attention import (
    paged_prefill_attention_ref,
    prefill_tiles,
    tile_capacity,
)
from tinyvllm_lib.kernels.tc_attention import (
    paged_prefill_attention_bf16_ref,
    tc_block_q,
    tc_prefill_attention,
    tc_warp_tiles,
)


def case(rng, seqs, H, KVH, D, block_size):
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    max_blocks = max(cdiv(int(n), block_size) for n in seq_lens)
    tables = rng.permutation(len(seqs) * max_blocks).reshape(len(seqs), max_blocks).astype(np.int32)
    shape = (len(seqs) * max_blocks * block_size, KVH, D)
    k = f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
    v = f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
    qkv = rng.standard_normal((starts[-1], (H + 2 * KVH) * D), dtype=np.float32)
    return qkv, k, v, tables, seq_lens, starts


TILES = {64: ((tc_block_q(64), tc_warp_tiles(64)), (64, 1), (64, 2)), 128: ((tc_block_q(128), 1),)}  # (block_q, warp_tiles)


def main() -> None:
    rng = np.random.default_rng(0)
    for H, KVH, D, seqs in ((32, 8, 64, [(0, 200), (300, 70), (3, 1)]), (8, 2, 128, [(17, 130)])):
        host = case(rng, seqs, H, KVH, D, 16)
        q = host[0][:, : H * D]
        exact = paged_prefill_attention_ref(q, *host[1:], 16, H, KVH, D)
        rounded = paged_prefill_attention_bf16_ref(q, *host[1:], 16, H, KVH, D)
        for block_q, warp_tiles in TILES[D]:
            capacity = tile_capacity(len(host[0]), len(seqs), block_q) + 3  # idle entries too
            tiles = prefill_tiles(host[5], host[4], block_q, out=np.empty(capacity, np.int32))
            out = cuda.device_array((len(host[0]), H * D), np.float32)
            tc_prefill_attention(*map(cuda.to_device, host), int(np.diff(host[5]).max()), 16, H, KVH, D, out,
                                 tiles=cuda.to_device(tiles), block_q=block_q, warp_tiles=warp_tiles)
            got = out.copy_to_host()
            err, ref_err = np.abs(got - exact).max(), np.abs(rounded - exact).max()
            print(f"head_dim {D}, block_q {block_q}, warp_tiles {warp_tiles}, {seqs}: max error {err:.2e} "
                  f"(bf16-rounded reference {ref_err:.2e})")
            assert err <= 2 * ref_err + 1e-5


if __name__ == "__main__":
    main()
