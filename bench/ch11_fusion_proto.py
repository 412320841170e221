"""Chapter 11, next step: prototypes of the fusions that batch 1 still needs, to measure before they enter the book.

Run on the H200 on 2026-12-02 (book/data/ch11_fusion_proto.json). What the records said, against the predictions
written below before the run:
  1. The GEMVs whose prologue makes their own input LOST, by far: QKV 14.2 us fused against 9.4 for GEMV + add-norm,
     down 25.2 against 12.5 (gate-up 25.2 against 23.3). Each block's prologue (a block-wide norm of the row, or 64 KB
     of [gate | up] for down) is a serial chain before its first multiply, and a 5-10 us kernel cannot hide it. Not
     adopted. A cheaper prologue would have the producer (o_proj / down) leave the row's sum of squares behind, so the
     consumer only scales x as it loads it.
  2. The split argmax WON as predicted: 38.7 us for one block a row (logits from memory) against 7.2 with 64 splits;
     at 256 rows 8 splits still beat one block (47.6 against 51.7), more lose (this kernel has 256 threads a block;
     the engine's sampler, 512, was slower with 8 shares at 256 rows than with one, so it keeps to ~256 blocks). Adopted in chapter 8b's sampler.
  3. The GEMV knob sweep: QKV 6.6 -> 5.4 us, o 4.7 -> 4.3, gate-up 18.8 -> 18.3; down 10.6 -> 10.9 (its best, 10.4,
     has two steps in flight: the block variant's one-token setting is QKV's and o's). Adopted in chapter 6's
     variants at one token (decode-step GEMVs 770 -> 736 us in bench/ch06_gemm.py).
  4. Decode attention at one row barely moves with its grid knobs (keys a split, the grid target, the fewest keys
     a split: within 0.5 us at 2 warps and 0.05 us at 4 or 8); the warps a block matter more: 4 warps save 0.3-0.8 us
     at 128-384 tokens, 8 warps 2 us at 1,024. Its time is its chain of dependent loads. Not adopted.

What batch 1 spends (book/data/ch11_kernels.json, 1 row, 1,024 tokens of context, 2026-12-02): a replayed step is
1.14 ms, of which the projections' GEMVs ~0.82 ms and the LM head 0.13 ms; the rest is small kernels, each a
launch, a ramp-up and a tail: add + RMSNorm 2.87 us x 32, SiLU * up 1.85 us x 16, the greedy sampler 25.7 us once
(one block of 512 threads reads the row's 128,256 logits alone), RoPE + KV write 2.6 us x 16. 1,100 tok/s needs
0.91 ms a step.

1. A GEMV whose prologue makes its own input (one token). Each block first issues its first step's weight loads,
   then, while they are in flight, builds the bf16 input row in shared memory from what the separate kernel
   would have read:
     "add_rmsnorm": residual + delta -> RMSNorm -> bf16 (block 0 also writes the new residual, to a second
     buffer: other blocks still read the old one), for QKV and gate-up;
     "rmsnorm": the same without delta (the first layer);
     "silu_mul": SiLU(gate) * up -> bf16, for down.
   Every block recomputes the norm of a 2,048-value row; its 20 KB come from L1 after the SM's first block.
   The risk is down's prologue: each of its 1,024 blocks reads [gate | up], 64 KB of float32, through the L1 that
   the weights also stream through. Prediction: each fused GEMV at most ~0.5 us slower than its plain GEMV, so add + norm saves ~2.3 us x 32 and
   SiLU ~1.3 us x 16: ~95 us a step (8%).
2. A greedy argmax over (rows, splits) blocks, the last block of a row combining the splits (the decode attention
   combine's pattern: partials, a fence, an atomic ticket). Prediction: ~4 us instead of 25.7 at one row (~22 us a
   step, 2%); unchanged from ~64 rows up, where one block a row already fills the GPU.
3. The plain GEMV's knobs at one token (warps sharing a row, rows per warp group, steps in flight) at each decode
   shape: QKV (3,072 x 2,048) and o_proj (2,048 x 2,048) run at 50% and 44% of copy bandwidth, gate-up 90%, down
   80%. A config that takes QKV and o_proj to ~65% saves ~40 us a step.

4. Decode attention at batch 1's contexts (the latency benchmark's 128 to 384 tokens, in a 2,048-token bound):
   its knobs (warps a block, keys a split, the grid target, the fewest keys a split) were chosen at 1,024 tokens;
   at 256 the defaults give 32 splits of 8 keys, each a block of 2 warps, then a 32-way combine. No prediction:
   the sweep says.

Together ~160 us of 1,140: ~1.0 ms a step, ~1,000 tok/s. Short of 1,100 still: the rest is attention at short
contexts, RoPE + KV write and the GEMVs' own tails.

Each kernel is checked against NumPy before it is timed. Records to book/data/ch11_fusion_proto.json.

    python bench/ch11_fusion_proto.py                          (about 3 minutes on an H200)
    NUMBA_ENABLE_CUDASIM=1 python bench/ch11_fusion_proto.py --tiny   (the checks, in the simulator; the
    simulator makes shared arrays without a lock, so a run can now and then give garbage: run it again)
"""

import argparse
import math

import numpy as np
from numba import config, cuda, float32, int32, int64, uint32, uint64

from tinyvllm_lib.kernels.activation import silu_mul, silu_mul_ref
from tinyvllm_lib.kernels.bf16 import (
    bf16_bits_to_f32,
    bf16_to_f32,
    f32_to_bf16,
    f32_to_bf16_bits,
)
from tinyvllm_lib.kernels.gemv import (
    GEMV_THREADS,
    GEMV_WARPS,
    bf16x4_to_f32,
    gemv,
    make_gemv_kernel,
    warp_sum_all,
)
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, block_sum
from tinyvllm_lib.kernels.rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm_ref,
)
from tinyvllm_lib.kernels.sampling import SAMPLER_THREADS, argmax_kernel, greedy_share
from tinyvllm_lib.measure import Recorder, load_records, num_rotations, time_launches

MAX_WORDS = 2048  # the input row in shared memory, 4 bf16 a word: K <= 8,192
PROLOGUES = ("rmsnorm", "add_rmsnorm", "silu_mul")


@cuda.jit(device=True)
def pack_bf16x4(a, b, c, d):
    """Four float32, rounded to bf16, packed in a uint64 (the first at the lowest address)."""
    lo = uint32(f32_to_bf16(a)) | (uint32(f32_to_bf16(b)) << uint32(16))
    hi = uint32(f32_to_bf16(c)) | (uint32(f32_to_bf16(d)) << uint32(16))
    return uint64(lo) | (uint64(hi) << uint64(32))


def make_prologue_gemv_kernel(prologue: str, warps_per_row: int, rows: int, unroll: int):
    """out (1, N) = x · wᵀ for one token whose bf16 input x the kernel makes itself (see the module's docstring).

    kernel(a, b, norm_w, eps, w64, out, residual_out): add_rmsnorm reads a = residual and b = delta (1, K) and
    norm_w (K,) bf16 bits, writes residual_out = a + b; rmsnorm ignores b and residual_out; silu_mul reads
    a = [gate | up] (1, 2 K) and ignores the rest.
    """
    assert prologue in PROLOGUES
    assert GEMV_WARPS % warps_per_row == 0, "a block's warps split evenly among its row groups"
    threads_per_row = 32 * warps_per_row
    rows_per_block = GEMV_WARPS // warps_per_row * rows
    step = threads_per_row * unroll
    words_size, wf_size, partial_shape = rows * unroll, 4 * rows, (GEMV_WARPS, rows)
    has_delta, is_silu = prologue == "add_rmsnorm", prologue == "silu_mul"

    @cuda.jit
    def kernel(a, b, norm_w, eps, w64, out, residual_out):
        xs = cuda.shared.array(MAX_WORDS, uint64)  # the input row, bf16, 4 a word
        partial = cuda.shared.array(partial_shape, float32)
        warp_sums = cuda.shared.array(WARP_SIZE, float32)
        scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
        tid = cuda.threadIdx.x
        group, t = tid // threads_per_row, uint64(tid % threads_per_row)
        lane, warp = tid % 32, tid // 32
        N, num_words = uint64(w64.shape[0]), uint64(w64.shape[1])
        K = int64(w64.shape[1]) * 4  # the input's length
        v4 = cuda.local.array(4, float32)
        n0 = uint64(cuda.blockIdx.x * rows_per_block + group * rows)
        acc = cuda.local.array(rows, float32)
        words = cuda.local.array(words_size, uint64)
        for r in range(rows):
            acc[r] = float32(0)
        # 1. the first step's weights: in flight while the input is made
        j = t
        for u in range(unroll):
            jj = j + uint64(u * threads_per_row)
            for r in range(rows):
                n = n0 + uint64(r)
                words[u * rows + r] = w64[n, jj] if jj < num_words and n < N else uint64(0)
        # 2. the input row, in shared memory
        if is_silu:
            for q in range(tid, K // 4, GEMV_THREADS):
                for e in range(4):
                    g = a[0, 4 * q + e]
                    v4[e] = g / (float32(1.0) + math.exp(-g)) * a[0, K + 4 * q + e]
                xs[q] = pack_bf16x4(v4[0], v4[1], v4[2], v4[3])
        else:
            sum_squares = float32(0)
            for q in range(tid, K // 4, GEMV_THREADS):
                for e in range(4):
                    v = a[0, 4 * q + e] + b[0, 4 * q + e] if has_delta else a[0, 4 * q + e]
                    sum_squares += v * v
            total = block_sum(sum_squares, warp_sums, scratch)
            scale = float32(1.0) / math.sqrt(total / float32(K) + eps)
            for q in range(tid, K // 4, GEMV_THREADS):
                for e in range(4):
                    v = a[0, 4 * q + e] + b[0, 4 * q + e] if has_delta else a[0, 4 * q + e]
                    if has_delta and cuda.blockIdx.x == 0:
                        residual_out[0, 4 * q + e] = v
                    v4[e] = v * scale * bf16_to_f32(norm_w[4 * q + e])
                xs[q] = pack_bf16x4(v4[0], v4[1], v4[2], v4[3])
        cuda.syncthreads()
        # 3. the GEMV, its input from shared memory
        wf = cuda.local.array(wf_size, float32)
        is_first = True
        while j < num_words:
            if not is_first:
                for u in range(unroll):
                    jj = j + uint64(u * threads_per_row)
                    for r in range(rows):
                        n = n0 + uint64(r)
                        words[u * rows + r] = w64[n, jj] if jj < num_words and n < N else uint64(0)
            is_first = False
            for u in range(unroll):
                jj = j + uint64(u * threads_per_row)
                if jj < num_words:
                    x0, x1, x2, x3 = bf16x4_to_f32(xs[jj])
                    for r in range(rows):
                        wf[4 * r], wf[4 * r + 1], wf[4 * r + 2], wf[4 * r + 3] = bf16x4_to_f32(words[u * rows + r])
                        acc[r] += x0 * wf[4 * r] + x1 * wf[4 * r + 1] + x2 * wf[4 * r + 2] + x3 * wf[4 * r + 3]
            j += uint64(step)
        warp_sum_all(acc)
        if warps_per_row == 1:
            for r in range(rows):
                if lane == 0 and n0 + uint64(r) < N:
                    out[0, n0 + uint64(r)] = acc[r]
        else:
            if lane == 0:
                for r in range(rows):
                    partial[warp, r] = acc[r]
            cuda.syncthreads()
            if tid < rows_per_block:  # tid = (group, r) of this block's rows
                g, r = tid // rows, tid % rows
                s = float32(0)
                for i in range(warps_per_row):
                    s += partial[g * warps_per_row + i, r]
                n = uint64(cuda.blockIdx.x * rows_per_block) + uint64(tid)
                if n < N:
                    out[0, n] = s

    kernel.rows_per_block = rows_per_block
    return kernel


PROLOGUE_KERNELS = {}


def prologue_gemv(prologue, a, b, norm_w, eps, w, out, residual_out, variant, stream=0):
    """Launch the prologue GEMV (variant "block": 8 warps a row, 2 rows; "warp": a warp a row, 1 row, 4 steps)."""
    key = prologue, variant
    if key not in PROLOGUE_KERNELS:
        knobs = {"block": (GEMV_WARPS, 2, 2), "warp": (1, 1, 4)}[variant]
        PROLOGUE_KERNELS[key] = make_prologue_gemv_kernel(prologue, *knobs)
    kernel = PROLOGUE_KERNELS[key]
    k = w.shape[1]
    assert k % 4 == 0 and k // 4 <= MAX_WORDS, f"K={k}: a multiple of 4, at most {4 * MAX_WORDS}"
    assert a.shape[1] == (2 * k if prologue == "silu_mul" else k), (prologue, a.shape, w.shape)
    blocks = (w.shape[0] + kernel.rows_per_block - 1) // kernel.rows_per_block
    kernel[blocks, GEMV_THREADS, stream](a, b, norm_w, np.float32(eps), w.view(np.uint64), out, residual_out)


# --- 2. the greedy argmax over (rows, splits) blocks ---

ARGMAX_THREADS = 32 if config.ENABLE_CUDASIM else 256


@cuda.jit
def split_argmax_kernel(logits, part_v, part_i, tickets, out):
    """Block (row, s): chapter 8b's greedy_share alone in a kernel: the argmax of share s of the row, the row's last
    block picking among the shares. (The records were made with this script's own copy of the same algorithm,
    before it moved into the sampler.)"""
    sv = cuda.shared.array(1024, float32)
    si = cuda.shared.array(1024, int64)
    flag = cuda.shared.array(1, int32)
    r = cuda.blockIdx.x
    greedy_share(logits[r], r, part_v, part_i, tickets, out, sv, si, flag)


def split_argmax(logits, part_v, part_i, tickets, out, num_splits: int, stream=0):
    assert num_splits <= ARGMAX_THREADS, "the last block reads one split a thread"
    split_argmax_kernel[(logits.shape[0], num_splits), ARGMAX_THREADS, stream](logits, part_v, part_i, tickets, out)


# --- checks against NumPy, then timings ---

def bits(rng, shape, scale=1.0):
    return f32_to_bf16_bits((scale * rng.standard_normal(shape)).astype(np.float32))


def check_prologue_gemvs(rng, hidden: int, inter: int, n_out: int, variants) -> None:
    """Each prologue GEMV against NumPy: the same bf16 input the separate kernels make, then x · wᵀ in float64."""
    eps = 1e-5
    res, delta = (rng.standard_normal((1, hidden)).astype(np.float32) for _ in range(2))
    norm_w = bits(rng, hidden)
    gate_up = rng.standard_normal((1, 2 * inter)).astype(np.float32)
    for prologue in PROLOGUES:
        k = inter if prologue == "silu_mul" else hidden
        w = bits(rng, (n_out, k), 0.05)
        if prologue == "silu_mul":
            x = silu_mul_ref(gate_up)
        elif prologue == "rmsnorm":
            x = rmsnorm_ref(res, norm_w, eps)
        else:
            want_res, x = fused_add_rmsnorm_ref(res, delta, norm_w, eps)
        x = bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)
        want = x @ bf16_bits_to_f32(w).astype(np.float64).T
        for variant in variants:
            out = cuda.to_device(np.full((1, n_out), np.nan, np.float32))  # a row never written stays NaN
            res_out = cuda.to_device(np.full((1, hidden), np.nan, np.float32))
            a = gate_up if prologue == "silu_mul" else res
            prologue_gemv(prologue, cuda.to_device(a), cuda.to_device(delta), cuda.to_device(norm_w), eps,
                          cuda.to_device(w), out, res_out, variant)
            got = out.copy_to_host()
            # the input may differ from NumPy's by one bf16 step where the two sums of squares round apart
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 2e-3, (prologue, variant, err)
            if prologue == "add_rmsnorm":
                np.testing.assert_array_equal(res_out.copy_to_host(), want_res)
            print(f"  {prologue:>11} GEMV ({variant}) {n_out} x {k}: max error {err:.1e} of the largest output")


def check_split_argmax(rng, rows: int, vocab: int, num_splits: int) -> None:
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[0, [vocab // 3, vocab - 1]] = 10.0  # a tie across shares: the first index wins
    part_v, part_i = cuda.device_array((rows, num_splits), np.float32), cuda.device_array((rows, num_splits), np.int64)
    tickets, out = cuda.to_device(np.zeros(rows, np.int32)), cuda.device_array(rows, np.int64)
    for _ in range(2):  # the tickets are back at 0 after a launch
        split_argmax(cuda.to_device(logits), part_v, part_i, tickets, out, num_splits)
        np.testing.assert_array_equal(out.copy_to_host(), logits.argmax(1))
        assert not tickets.copy_to_host().any()
    print(f"  split argmax {rows} x {vocab}, {num_splits} splits: equal to NumPy's")


def time_prologue_gemvs(rec, copy, rng, hidden, inter, shapes) -> None:
    """Each fused GEMV against the plain GEMV plus the kernel it absorbs, on rotated weights (none from L2)."""
    eps = 1e-5
    res, delta, res2 = (cuda.to_device(rng.standard_normal((1, hidden)).astype(np.float32)) for _ in range(3))
    norm_w = cuda.to_device(bits(rng, hidden))
    gate_up = cuda.to_device(rng.standard_normal((1, 2 * inter)).astype(np.float32))
    normed, act = cuda.to_device(bits(rng, (1, hidden))), cuda.to_device(bits(rng, (1, inter)))
    for name, n_out, k, prologue, variant in shapes:
        nbytes = n_out * k * 2
        ws = [cuda.to_device(bits(rng, (n_out, k), 0.05)) for _ in range(num_rotations(nbytes))]
        out = cuda.device_array((1, n_out), np.float32)
        x = act if prologue == "silu_mul" else normed
        a = gate_up if prologue == "silu_mul" else res
        n = len(ws)
        plain = time_launches(lambda i, s: gemv(x, ws[i % n], out, stream=s), max(n, 16))
        if prologue == "silu_mul":
            separate = time_launches(lambda i, s: (silu_mul(gate_up, act, stream=s),
                                                   gemv(act, ws[i % n], out, stream=s)), max(n, 16))
        else:
            separate = time_launches(lambda i, s: (fused_add_rmsnorm(res2, delta, norm_w, eps, normed, stream=s),
                                                   gemv(normed, ws[i % n], out, stream=s)), max(n, 16))
        fused = time_launches(lambda i, s: prologue_gemv(prologue, a, delta, norm_w, eps, ws[i % n], out, res2,
                                                         variant, stream=s), max(n, 16))
        for label, seconds in (("gemv", plain), ("separate", separate), ("fused", fused)):
            gb_s = nbytes / seconds / 1e9
            rec.add("prologue_gemv", [1, n_out, k], "us", seconds * 1e6, projection=name, prologue=prologue,
                    kernels=label, variant=variant, gb_s=gb_s, ratio_of_copy=gb_s / copy)
        print(f"  {name:>8} {prologue:>11}: gemv {plain * 1e6:6.2f} us, separate {separate * 1e6:6.2f}, "
              f"fused {fused * 1e6:6.2f} ({nbytes / fused / 1e9 / copy:.0%} of copy)", flush=True)


def time_argmax(rec, rng, vocab, rows_list, split_list) -> None:
    for rows in rows_list:
        logits = [cuda.to_device(rng.standard_normal((rows, vocab)).astype(np.float32))
                  for _ in range(num_rotations(rows * vocab * 4))]
        out, n = cuda.device_array(rows, np.int64), len(logits)
        one = time_launches(lambda i, s: argmax_kernel[rows, SAMPLER_THREADS, s](logits[i % n], out), max(n, 16))
        rec.add("greedy_argmax", [rows, vocab], "us", one * 1e6, kernel="argmax_kernel", num_splits=1)
        line = f"  argmax {rows:>3} x {vocab}: one block a row {one * 1e6:6.2f} us"
        for splits in split_list:
            pv, pi = cuda.device_array((rows, splits), np.float32), cuda.device_array((rows, splits), np.int64)
            tickets = cuda.to_device(np.zeros(rows, np.int32))
            t = time_launches(lambda i, s: split_argmax(logits[i % n], pv, pi, tickets, out, splits, stream=s),
                              max(n, 16))
            rec.add("greedy_argmax", [rows, vocab], "us", t * 1e6, kernel="split_argmax", num_splits=splits)
            line += f", {splits} splits {t * 1e6:6.2f}"
        print(line, flush=True)


def sweep_gemv_knobs(rec, copy, rng, shapes) -> None:
    """The plain GEMV at one token, each decode shape, over (warps sharing a row, rows per group, steps in flight)."""
    # make_gemv_kernel's warps meet as one group: a warp a row, or all eight
    knobs = [(w, r, u) for w in (1, GEMV_WARPS) for r in (1, 2, 4, 8) for u in (1, 2, 4, 8) if r * u <= 16]
    kernels = {kn: make_gemv_kernel(1, *kn) for kn in knobs}
    for name, n_out, k, _, _ in shapes:
        nbytes = n_out * k * 2
        ws = [cuda.to_device(bits(rng, (n_out, k), 0.05)) for _ in range(num_rotations(nbytes))]
        x, out, n = cuda.to_device(bits(rng, (1, k))), cuda.device_array((1, n_out), np.float32), len(ws)
        want = (bf16_bits_to_f32(x.copy_to_host()).astype(np.float64)
                @ bf16_bits_to_f32(ws[0].copy_to_host()).astype(np.float64).T)
        best = None
        for kn, kernel in kernels.items():
            blocks = (n_out + kernel.rows_per_block - 1) // kernel.rows_per_block
            launch = lambda i, s: kernel[blocks, GEMV_THREADS, s](x.view(np.uint64), ws[i % n].view(np.uint64), out)
            out.copy_to_device(np.full((1, n_out), np.nan, np.float32))
            launch(0, 0)
            if not np.abs(out.copy_to_host() - want).max() <= 1e-3 * np.abs(want).max():
                print(f"  {name} {kn}: wrong output, not timed")
                continue
            seconds = time_launches(launch, max(n, 16))
            gb_s = nbytes / seconds / 1e9
            rec.add("gemv_knobs", [1, n_out, k], "us", seconds * 1e6, projection=name, warps_per_row=kn[0],
                    rows=kn[1], unroll=kn[2], gb_s=gb_s, ratio_of_copy=gb_s / copy)
            if best is None or seconds < best[1]:
                best = (kn, seconds)
        print(f"  {name:>8} {n_out} x {k}: best (warps, rows, unroll) {best[0]} {best[1] * 1e6:.2f} us "
              f"({nbytes / best[1] / 1e9 / copy:.0%} of copy)", flush=True)
        rec.save()


BS1_ATTENTION_GRID = {"num_warps": (1, 2, 4, 8), "split_keys": (64, 128, 256, 512), "target_blocks": (256, 512, 1024),
                      "min_split_keys": (8, 32)}


def sweep_bs1_attention(rec, rng, contexts, max_context_len: int = 2048, grid=BS1_ATTENTION_GRID,
                        save: bool = True, min_sets: int = 16, repeats: int = 10, rotate: bool = True) -> None:
    """Decode attention, one row of Llama 3.2 1B's heads, each context over its knobs, checked against float64."""
    import itertools

    from tinyvllm_lib.kernels.decode_attention import (
        decode_attention,
        decode_attention_ref,
    )
    from tinyvllm_lib.kernels.decode_attention_config import (
        DEFAULT_DECODE_CONFIG,
        DecodeAttentionConfig,
    )
    from tinyvllm_lib.kernels.decode_splits import decode_workspace

    H, KVH, D, BLOCK = 32, 8, 64, 16
    for context in contexts:
        blocks = (context + BLOCK - 1) // BLOCK  # the context's blocks; the table is as wide as the bound
        # in a step the weights stream between two reads of a layer's cache: rotate K/V sets past L2
        num_sets = max(num_rotations(2 * context * KVH * D * 2), min_sets) if rotate else min_sets
        sets = []
        for _ in range(num_sets):
            k, v = (bits(rng, (blocks * BLOCK, KVH, D)) for _ in range(2))
            sets.append((cuda.to_device(k), cuda.to_device(v), k, v))
        bt = np.zeros((1, max_context_len // BLOCK), np.int32)
        bt[0, :blocks] = rng.permutation(blocks)
        lens, qkv = np.array([context], np.int32), rng.standard_normal((1, (H + 2 * KVH) * D)).astype(np.float32)
        want = decode_attention_ref(qkv, sets[0][2], sets[0][3], bt, BLOCK, lens, H, KVH, D)
        d_bt, d_lens, d_qkv = cuda.to_device(bt), cuda.to_device(lens), cuda.to_device(qkv)
        out, ws = cuda.device_array((1, H * D), np.float32), decode_workspace(1, max_context_len, H, D)
        best = None
        for knobs in (dict(zip(grid, v)) for v in itertools.product(*grid.values())):
            # these knobs, not the few-rows ones, with the rows a lane that batch 1 uses
            few = {"keys_per_lane": DEFAULT_DECODE_CONFIG.few_rows_keys_per_lane}
            cfg = DecodeAttentionConfig(**{**few, **knobs}, few_rows=0)

            def call(i, stream):
                k, v = sets[i % len(sets)][:2]
                decode_attention(d_qkv, k, v, d_bt, BLOCK, d_lens, H, KVH, D, out, stream=stream, workspace=ws,
                                 max_context_len=max_context_len, config=cfg)

            try:
                call(0, 0)
            except Exception as e:  # e.g. too many registers for a block of 16 warps
                print(f"  attention {context} tokens {knobs}: does not launch ({type(e).__name__}), not timed")
                continue
            err = float(np.abs(out.copy_to_host() - want).max() / np.abs(want).max())
            if not err < 1e-5:
                print(f"  attention {context} tokens {knobs}: wrong (rel error {err:.1e}), not timed")
                continue
            seconds = time_launches(call, len(sets), repeats=repeats)
            is_default = all(getattr(DEFAULT_DECODE_CONFIG.for_rows(1), k) == v for k, v in knobs.items())
            rec.add("bs1_attention", [1, context, max_context_len], "us", seconds * 1e6, **knobs,
                    is_default=is_default)
            if best is None or seconds < best[0]:
                best = (seconds, knobs)
        default = [r["value"] for r in rec.records if r["name"] == "bs1_attention" and r["shape"][1] == context
                   and r["is_default"]]
        print(f"  attention 1 row x {context} tokens: defaults {default[0] if default else float('nan'):.2f} us, "
              f"best {best[0] * 1e6:.2f} us with {best[1]}", flush=True)
        if save:
            rec.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes, checks only (the simulator)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.tiny or config.ENABLE_CUDASIM:
        print("checks (tiny shapes):")
        check_prologue_gemvs(rng, hidden=1040, inter=1100, n_out=19, variants=("block", "warp"))
        check_split_argmax(rng, rows=3, vocab=1000, num_splits=5)
        sweep_bs1_attention(Recorder("ch11_fusion_proto"), rng, contexts=(40,), max_context_len=64, save=False,
                            grid={"num_warps": (1,), "split_keys": (16,), "target_blocks": (8,), "min_split_keys": (8,)},
                            min_sets=1, repeats=1, rotate=False)
        return
    hidden, inter, vocab = 2048, 8192, 128256  # Llama 3.2 1B
    print("checks (Llama 3.2 1B shapes):")
    check_prologue_gemvs(rng, hidden, inter, n_out=3072, variants=("block", "warp"))
    check_split_argmax(rng, rows=1, vocab=vocab, num_splits=64)
    check_split_argmax(rng, rows=7, vocab=vocab, num_splits=16)
    copy = [r for r in load_records("ch01_bf16") if r["name"] == "copy"][-1]["value"]
    rec = Recorder("ch11_fusion_proto")
    # (projection, out rows, in, prologue, the variant `gemv` picks there)
    shapes = [("qkv", 3072, hidden, "add_rmsnorm", "block"), ("gate_up", 2 * inter, hidden, "add_rmsnorm", "warp"),
              ("down", hidden, inter, "silu_mul", "block"), ("o", hidden, hidden, None, None)]
    print("fused GEMVs against GEMV + the kernel they absorb:")
    time_prologue_gemvs(rec, copy, rng, hidden, inter, [s for s in shapes if s[3]])
    rec.save()
    print("greedy argmax:")
    time_argmax(rec, rng, vocab, rows_list=(1, 8, 64, 256), split_list=(8, 16, 32, 64, 128))
    rec.save()
    print("plain GEMV knobs at one token:")
    sweep_gemv_knobs(rec, copy, rng, shapes)
    print("decode attention at batch 1's contexts:")
    sweep_bs1_attention(rec, rng, contexts=(128, 256, 384, 1024))
    print(f"records: {rec.save()}")


if __name__ == "__main__":
    main()
