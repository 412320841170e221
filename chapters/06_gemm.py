# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 6. GEMM: where the time goes
#
# Almost every FLOP of a transformer, and almost every byte it reads, goes through one
# operation: a **linear layer**, $y = x \cdot W^\top$. Llama 3.2 1B has seven of them
# per layer (q, k, v, o, gate, up, down) and one more at the end, the LM head. This
# chapter makes that operation fast, twice: once for **prefill**, where thousands of
# tokens share each weight and the arithmetic is what costs, and once for **decoding**,
# where one token at a time reads every weight and the memory is what costs.
#
# In this chapter you will learn:
#
# - how to count FLOPs and bytes of a matrix product and read a **roofline**: which of
#   the two limits a kernel, and how fast it can possibly be;
# - a ladder of GEMM kernels — naive, shared-memory tiles, register blocking — each rung
#   one change, with the reason it is faster and the measurement that says by how much;
# - the **GEMV** that decoding lives on: wide coalesced loads, warp shuffles, and
#   splitting the reduction over a block so that small matrices still fill the GPU;
# - how to call **cuBLAS** from Python (nvmath-python) on row-major data — the transpose
#   trick — inside a CUDA graph;
# - the library's `linear` layer, which picks the right one by shape.
#
# It reads weights with the bf16 helpers of [chapter 01](01_bf16.py) and measures with
# its `time_launches` and `Recorder`.

# %%
#| default_exp kernels.gemm

# %%
import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.measure import (
    CEILING_RECORDS,
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
    records_table,
)
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, has_gpu, is_simulator, where_kernels_run

rng = np.random.default_rng()
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
print(where_kernels_run())

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## Count first
#
# A linear layer with $K$ inputs (`in_features`) and $N$ outputs (`out_features`)
# applied to $M$ tokens does one multiply and one add per weight per token:
#
# $$ \text{FLOPs} = 2MNK, \qquad \text{bytes} \ge \underbrace{2NK}_{W,\ \text{bf16}}
#    + \underbrace{2MK}_{x,\ \text{bf16}} + \underbrace{4MN}_{y,\ \text{f32}}. $$
#
# The bytes are the *compulsory* traffic: each input read once, each output written
# once. Their ratio, the **arithmetic intensity** $I$ in FLOPs per byte, says which
# resource runs out first. A GPU streams $B$ bytes per second and computes $P$ FLOPs per
# second, so a kernel can at best reach $\min(P,\ I \cdot B)$: the **roofline**. For one
# token ($M = 1$), $I \approx 1$ FLOP/byte; for 2048 tokens, $I$ is in the hundreds.
#
# In code, the two counts every measurement in this chapter divides by:


# %%
#| export
def gemm_flops(M: int, N: int, K: int) -> int:
    """FLOPs of y (M, N) = x (M, K) · Wᵀ, W (N, K): a multiply and an add per weight per
    token.
    """
    return 2 * M * N * K


def gemm_bytes(M: int, N: int, K: int) -> int:
    """Compulsory bytes: W and x read once as bf16, y written once as float32."""
    return 2 * N * K + 2 * M * K + 4 * M * N


# %% [markdown]
# Here are the shapes of Llama 3.2 1B (q, k and v fused into one matrix, gate and up
# into another — a fused layer reads its input once and launches once), and what one
# step of the whole model costs against the ceilings of an H200: the bandwidth ceiling
# that chapter 01 measured (the best of its copy and read rates), the datasheet's 67
# TFLOP/s of float32 FMA on CUDA cores, and 989 TFLOP/s of dense bf16 on tensor cores.

# %% tags=["hide-input"]
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 16,
    "vocab_size": 128256,
}


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear layer of one Llama block; q/k/v and
    gate/up fused.
    """
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * cfg["intermediate_size"], hidden),
        "down": (hidden, cfg["intermediate_size"]),
    }


# H200 SXM datasheet: CUDA-core FMA; dense bf16 tensor cores
FP32_PEAK_TFLOPS, BF16_PEAK_TFLOPS = 67.0, 989.0
# chapter 1's best measured rate; else the datasheet's 4.8 TB/s
CEILING_GBS, CEILING_NAME = bandwidth_ceiling()
CEILING_SOURCE = CEILING_RECORDS.get(CEILING_NAME, "datasheet")
if not CEILING_NAME:
    CEILING_GBS = 4800.0

shapes = projection_shapes(LLAMA_1B)
lm_head = (LLAMA_1B["vocab_size"], LLAMA_1B["hidden_size"])
num_layers = LLAMA_1B["num_hidden_layers"]
print(
    f"{'layer':>8} {'N x K':>14} {'MB (bf16)':>10} {'I at M=1':>9} {'I at M=2048':>12}"
)
for name, (N, K) in [*shapes.items(), ("lm_head", lm_head)]:
    print(
        f"{name:>8} {f'{N} x {K}':>14} {2 * N * K / 1e6:10.1f} "
        f"{gemm_flops(1, N, K) / gemm_bytes(1, N, K):9.2f}"
        f" {gemm_flops(2048, N, K) / gemm_bytes(2048, N, K):12.0f}"
    )

decode_bytes = (
    num_layers * sum(2 * N * K for N, K in shapes.values())
    + 2 * lm_head[0] * lm_head[1]
)
decode_seconds = decode_bytes / (CEILING_GBS * 1e9)
prefill_flops = num_layers * sum(gemm_flops(2048, N, K) for N, K in shapes.values())
ridge_fp32 = FP32_PEAK_TFLOPS * 1e12 / (CEILING_GBS * 1e9)
print(
    f"one decode step reads {decode_bytes / 1e9:.2f} GB of weights: at "
    f"{CEILING_GBS / 1e3:.2f} TB/s ({CEILING_SOURCE}) "
    f"that is {decode_seconds * 1e6:.0f} us, at most {1 / decode_seconds:.0f} "
    "tokens/s for one sequence"
)
print(
    f"a 2048-token prefill does {prefill_flops / 1e12:.2f} TFLOP in its projections: "
    f"{prefill_flops / (BF16_PEAK_TFLOPS * 1e12) * 1e3:.2f} ms at the bf16 peak, "
    f"{prefill_flops / (FP32_PEAK_TFLOPS * 1e12) * 1e3:.1f} ms at the fp32 CUDA-core "
    "peak"
)
prose.glue("ch06_decode_gb", f"{decode_bytes / 1e9:.2f} GB")
prose.glue("ch06_ceiling", ceiling_phrase(CEILING_GBS, CEILING_NAME))
prose.glue("ch06_ceiling_tbs", f"{CEILING_GBS / 1e3:.2f} TB/s")
prose.glue("ch06_decode_pred_us", f"{decode_seconds * 1e6:.0f} µs")
prose.glue("ch06_decode_pred_tok", f"{1 / decode_seconds:,.0f}")
prose.glue("ch06_ridge_fp32", f"{ridge_fp32:.0f}")
prose.glue(
    "ch06_prefill_pred_ms", f"{prefill_flops / (BF16_PEAK_TFLOPS * 1e12) * 1e3:.2f} ms"
)
prose.glue("ch06_fp32_peak", f"{FP32_PEAK_TFLOPS:.0f} TFLOP/s")
prose.glue("ch06_bf16_peak", f"{BF16_PEAK_TFLOPS:.0f} TFLOP/s")
prose.glue("ch06_peak_ratio", f"{BF16_PEAK_TFLOPS / FP32_PEAK_TFLOPS:.0f}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
Two regimes, two different kernels. **Decoding** one token reads {{ch06_decode_gb}} of
weights and does one FLOP per byte. At {{ch06_ceiling}} the weights alone take
{{ch06_decode_gb}} ÷ {{ch06_ceiling_tbs}} = {{ch06_decode_pred_us}} per token, so a
single sequence decodes no more than {{ch06_decode_pred_tok}} tokens per second,
whatever the arithmetic does. The arithmetic is far from
any limit: the CUDA cores run out only at an intensity of about {{ch06_ridge_fp32}}
FLOPs per byte (the *ridge point*), that is, about as many tokens decoded together.
**Prefill** is the opposite: hundreds of FLOPs per byte, so it is the compute peak that
counts, and the bf16 tensor cores' peak is {{ch06_peak_ratio}} times the CUDA cores'
({{ch06_prefill_pred_ms}} for the projections of a 2048-token prompt at that peak).
""")

# %% [markdown]
# ## The reference
#
# $$ y_{mn} = \sum_{k=0}^{K-1} x_{mk}\, W_{nk} $$
#
# Weights are stored the way Hugging Face stores them, $W$ of shape
# `(out_features, in_features)`, so both $x$ and $W$ are read along $k$, their
# contiguous axis. The reference widens the bf16 bits and multiplies in float64; kernels
# accumulate in float32 and must agree to
# $\max|y - y_\text{ref}| / \max|y_\text{ref}| \le 10^{-4}$.


# %%
def linear_ref(x_bits: np.ndarray, w_bits: np.ndarray) -> np.ndarray:
    """y = x · Wᵀ in float64 from bf16 bits: x (M, K), W (N, K) -> y (M, N)."""
    return (
        bf16_bits_to_f32(x_bits).astype(np.float64)
        @ bf16_bits_to_f32(w_bits).astype(np.float64).T
    )


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: the error relative to the output's scale."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def random_bf16(shape, scale: float = 1.0) -> np.ndarray:
    """Normal random values rounded to bf16 bits."""
    return f32_to_bf16_bits((scale * rng.standard_normal(shape)).astype(np.float32))


x_bits, w_bits = random_bf16((5, 300)), random_bf16((7, 300))
want = linear_ref(x_bits, w_bits)
f32_sum = (
    bf16_bits_to_f32(x_bits)[:, None, :] * bf16_bits_to_f32(w_bits)[None, :, :]
).sum(-1, dtype=np.float32)
print(
    f"float32 accumulation: {rel_error(f32_sum, want):.1e};  dropping the last 16 of "
    "K = 300: "
    f"{rel_error(linear_ref(x_bits[:, :-16], w_bits[:, :-16]), want):.1e}"
)
assert (
    rel_error(f32_sum, want) < 1e-6
    and rel_error(linear_ref(x_bits[:, :-16], w_bits[:, :-16]), want) > 1e-2
)

# %% [markdown]
# The tolerance is loose enough for any order of float32 additions (their error grows
# like $\sqrt{K}$ units of $2^{-24}$) and tight enough to catch a kernel that forgets
# the tail of $K$ when $K$ is not a multiple of its tile: dropping even 16 terms shifts
# the result by percents.
#
# Every launcher checks its arguments the same way before anything runs — a kernel that
# reads past a buffer does not raise, it corrupts memory:

# %%
#| export
import numpy as np
from numba import cuda, float32, uint64

from tinyvllm_lib.kernels.bf16 import bf16_to_f32
from tinyvllm_lib.kernels.checks import is_c_contiguous


def check_linear_args(name: str, x, w, out) -> tuple[int, int, int]:
    """Check y = x · Wᵀ operands: x (M, K) bf16 bits, w (N, K) bf16 bits, out (M, N)
    float32; return M, N, K.
    """
    for label, a, dtype in (
        ("x", x, np.uint16),
        ("w", w, np.uint16),
        ("out", out, np.float32),
    ):
        if a.dtype != dtype:
            what = "bf16 bits as uint16" if dtype == np.uint16 else "float32"
            raise TypeError(f"{name}: {label} must hold {what}, got {a.dtype}")
        if a.ndim != 2 or not is_c_contiguous(a):
            raise ValueError(
                f"{name}: {label} must be a 2-D C-contiguous array, got shape "
                f"{tuple(a.shape)}"
            )
    (M, K), (N, K_w) = x.shape, w.shape
    if K_w != K:
        raise ValueError(
            f"{name}: x {tuple(x.shape)} and w {tuple(w.shape)} must share in_features "
            "(w is (out_features, in_features))"
        )
    if tuple(out.shape) != (M, N):
        raise ValueError(
            f"{name}: out must have shape {(M, N)} for x {tuple(x.shape)} and w "
            f"{tuple(w.shape)}, "
            f"got {tuple(out.shape)}"
        )
    if M == 0 or N == 0 or K == 0:
        raise ValueError(f"{name}: empty operand: M={M}, N={N}, K={K}")
    return M, N, K


# %% [markdown]
# ## Rung 1: one thread per output
#
# The obvious kernel: thread $(m, n)$ walks along $k$ and accumulates. Threads next to
# each other in a warp take neighbouring $n$, so their writes to $y$ are contiguous —
# but their reads of $W$ are not: at each step the 32 threads of a warp read one bf16
# from 32 different rows of $W$, 32 separate 32-byte sectors for 64 useful bytes. The L1
# cache rescues part of it (the next steps hit the same sectors), and every $x$ value is
# loaded by 32 threads at once (a broadcast). Count the traffic anyway: every output
# reads $2K$ values, so the kernel asks the memory system for $2 \cdot 2MNK$ bytes — for
# a 2048-cube, 34 GB to compute 17 GFLOP. That is an intensity of ½, below even a GEMV.

# %%
#| export
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

NAIVE_BLOCK = (32, 8)  # threads along n, along m


@cuda.jit
def gemm_naive_kernel(x, w, out):
    wait_for_previous_kernel()
    n, m = cuda.grid(2)  # x index -> column n, y index -> row m
    if m < out.shape[0] and n < out.shape[1]:
        acc = float32(0)
        for k in range(x.shape[1]):
            acc += bf16_to_f32(x[m, k]) * bf16_to_f32(w[n, k])
        out[m, n] = acc


def _grid(total: int, per_block: int) -> int:
    return (total + per_block - 1) // per_block


def gemm_naive(x, w, out, stream=0):
    """Launch: out = x · wᵀ (bf16 bits in, float32 out), one thread per output."""
    M, N, K = check_linear_args("gemm_naive", x, w, out)
    grid = (_grid(N, NAIVE_BLOCK[0]), _grid(M, NAIVE_BLOCK[1]))
    gemm_naive_kernel[grid, NAIVE_BLOCK, stream](x, w, out)
    return out


# %% [markdown]
# Odd shapes — none a multiple of the block — and an output poisoned with NaN, so that
# an element the kernel forgot cannot pass:


# %%
def check_gemm(launch, M: int, N: int, K: int, tol: float = 1e-4) -> float:
    """Run launch(x, w, out) on fresh random bf16 inputs; return its error against the
    float64 reference.
    """
    x, w = random_bf16((M, K)), random_bf16((N, K), scale=0.05)
    d_out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    launch(cuda.to_device(x), cuda.to_device(w), d_out)
    err = rel_error(d_out.copy_to_host(), linear_ref(x, w))
    assert err <= tol, f"{launch.__name__} {M}x{N}x{K}: relative error {err:.2e}"
    return err


SMALL = (19, 37, 45) if is_simulator() else (333, 1001, 2047)  # M, N, K
if can_launch():
    print(f"gemm_naive on {SMALL}: relative error {check_gemm(gemm_naive, *SMALL):.1e}")

# %% [markdown]
# ## Rung 2: tiles in shared memory
#
# One change: a block of $T \times T$ threads computes a $T \times T$ tile of $y$, and
# walks along $k$ in steps of $T$. At each step the block loads a $T \times T$ tile of
# $x$ and one of $W$ into **shared memory** — each thread loads one element of each,
# reading along $k$, so the loads are coalesced — then waits for the whole block
# (`syncthreads`), and every thread accumulates $T$ products out of shared memory. Each
# value brought from global memory is now used $T$ times instead of once: global traffic
# drops by a factor of $T$ (16 here).
#
# One detail: thread $(t_y, t_x)$ reads row $t_x$ of the $W$ tile. Shared memory is
# split into 32 banks of 4 bytes, and a warp's reads from one bank queue up one after
# the other. With 16 floats per row, the 16 rows a warp reads would start in just two
# banks, eight rows each; padding each row to 17 floats puts every row in its own bank.

# %%
#| export
TILE = 16
# shapes of shared arrays must be constants: numba does not fold TILE + 1
TILE_PADDED = TILE + 1


@cuda.jit
def gemm_shared_kernel(x, w, out):
    wait_for_previous_kernel()
    xs = cuda.shared.array((TILE, TILE), float32)  # xs[i, k] = x[m0 + i, k0 + k]
    # ws[j, k] = w[n0 + j, k0 + k]; padded against bank conflicts
    ws = cuda.shared.array((TILE, TILE_PADDED), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    m = cuda.blockIdx.y * TILE + ty
    n = cuda.blockIdx.x * TILE + tx
    n_load = cuda.blockIdx.x * TILE + ty  # the row of w this thread loads
    M, K, N = x.shape[0], x.shape[1], w.shape[0]
    acc = float32(0)
    for k0 in range(0, K, TILE):
        k = k0 + tx
        xs[ty, tx] = bf16_to_f32(x[m, k]) if m < M and k < K else float32(0)
        ws[ty, tx] = bf16_to_f32(w[n_load, k]) if n_load < N and k < K else float32(0)
        cuda.syncthreads()  # the tiles are complete
        for kk in range(TILE):
            acc += xs[ty, kk] * ws[tx, kk]
        cuda.syncthreads()  # everyone is done with them before the next load
    if m < M and n < N:
        out[m, n] = acc


def gemm_shared(x, w, out, stream=0):
    """Launch: out = x · wᵀ with TILE x TILE shared-memory tiles, one output per
    thread.
    """
    M, N, K = check_linear_args("gemm_shared", x, w, out)
    gemm_shared_kernel[(_grid(N, TILE), _grid(M, TILE)), (TILE, TILE), stream](
        x, w, out
    )
    return out


# %%
if can_launch():
    print(
        f"gemm_shared on {SMALL}: relative error {check_gemm(gemm_shared, *SMALL):.1e}"
    )

# %% [markdown]
# ## Rung 3: register blocking
#
# Rung 2 is no longer limited by global memory but by shared memory: every FMA needs two
# shared-memory loads, and an SM can serve far fewer loads per clock than it can do
# FMAs. The cure is the same idea one level down: reuse out of **registers**. Each
# thread now computes a $T_M \times T_N = 8 \times 8$ micro-tile of outputs. At each $k$
# it loads 8 values of $x$ and 8 of $W$ from shared memory and does $8 \times 8 = 64$
# FMAs with them: 4 FMAs per load instead of ½. A block of 256 threads covers a
# $128 \times 128$ tile of $y$ and steps through $k$ 8 at a time; a block-tile of $x$ is
# reused by 128 columns, so global traffic drops again.
#
# Three details make it work:
#
# - **Which outputs a thread owns.** Thread $(t_y, t_x)$ of the $16 \times 16$ grid
#   takes rows $t_y + 16i$ and columns $t_x + 16j$ — interleaved, not a contiguous
#   $8 \times 8$ patch — so that at any instant the 16 threads of a half-warp read 16
#   consecutive floats of the $W$ tile (no bank conflicts) and write 16 consecutive
#   floats of $y$.
# - **Tiles stored $k$-major** (`xs[k, m]`): the 8 values a thread needs at step $k$ sit
#   in one row.
# - **Unsigned indices.** numba follows Python: a negative index counts from the end, so
#   every access with a signed index costs a compare and a select. In the inner loop
#   that made almost as many integer instructions as FMAs (compile to PTX, or
#   disassemble with `nvdisasm`, to see it). Indices built from `uint64` values skip the
#   check. The loops over the micro-tile have constant trip counts, so the compiler
#   unrolls them and keeps the 64 accumulators in registers.
#
# The kernel is built by a function of the tile sizes (they must be compile-time
# constants: numba freezes a closure's variables into the kernel).

# %%
#| export
BLOCK_M, BLOCK_N, BLOCK_K, THREAD_M, THREAD_N = 128, 128, 8, 8, 8


def make_gemm_blocked_kernel(
    bm: int, bn: int, bk: int, tm: int, tn: int, accumulate: bool = False
):
    """A register-blocked GEMM kernel: a block computes a bm x bn tile of y, each thread
    a tm x tn micro-tile; accumulate: out += x · wᵀ.
    """
    # the thread grid: cols threads along n, rows along m
    cols, rows = bn // tn, bm // tm
    threads = rows * cols
    rows_per_pass = threads // bk  # tile rows loaded per pass, bk consecutive k per row
    # padded rows: fewer bank conflicts on the transposing stores
    xs_stride, ws_stride = bm + 1, bn + 1
    xs_size, ws_size, acc_size = bk * xs_stride, bk * ws_stride, tm * tn
    assert threads % bk == 0 and bm % rows_per_pass == 0 and bn % rows_per_pass == 0

    @cuda.jit
    def kernel(x, w, out):
        wait_for_previous_kernel()
        # xs[k * xs_stride + i] = x[m0 + i, k0 + k]
        xs = cuda.shared.array(xs_size, float32)
        # ws[k * ws_stride + j] = w[n0 + j, k0 + k]
        ws = cuda.shared.array(ws_size, float32)
        tid = cuda.threadIdx.x
        # this thread's place in the thread grid
        tx, ty = uint64(tid % cols), uint64(tid // cols)
        load_row, load_k = uint64(tid // bk), uint64(tid % bk)  # what it loads
        m0, n0 = uint64(cuda.blockIdx.y * bm), uint64(cuda.blockIdx.x * bn)
        M, K, N = uint64(x.shape[0]), uint64(x.shape[1]), uint64(w.shape[0])
        # acc[i * tn + j] = y[m0 + ty + rows*i, n0 + tx + cols*j]
        acc = cuda.local.array(acc_size, float32)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        for i in range(acc_size):
            acc[i] = float32(0)
        k0 = uint64(0)
        while k0 < K:
            k = k0 + load_k
            # global -> shared, widened to f32, transposed to k-major
            for p in range(bm // rows_per_pass):
                i = load_row + uint64(p * rows_per_pass)
                xs[load_k * uint64(xs_stride) + i] = (
                    bf16_to_f32(x[m0 + i, k]) if m0 + i < M and k < K else float32(0)
                )
            for p in range(bn // rows_per_pass):
                j = load_row + uint64(p * rows_per_pass)
                ws[load_k * uint64(ws_stride) + j] = (
                    bf16_to_f32(w[n0 + j, k]) if n0 + j < N and k < K else float32(0)
                )
            cuda.syncthreads()
            ia, ib = ty, tx
            for kk in range(bk):  # tm + tn shared loads, tm * tn FMAs
                for i in range(tm):
                    a[i] = xs[ia + uint64(rows * i)]
                for j in range(tn):
                    b[j] = ws[ib + uint64(cols * j)]
                for i in range(tm):
                    for j in range(tn):
                        acc[i * tn + j] += a[i] * b[j]
                ia += uint64(xs_stride)
                ib += uint64(ws_stride)
            cuda.syncthreads()
            k0 += uint64(bk)
        for i in range(tm):
            m = m0 + ty + uint64(rows * i)
            for j in range(tn):
                n = n0 + tx + uint64(cols * j)
                if m < M and n < N and accumulate:
                    out[m, n] += acc[i * tn + j]
                elif m < M and n < N:
                    out[m, n] = acc[i * tn + j]

    return kernel


gemm_blocked_kernel = make_gemm_blocked_kernel(
    BLOCK_M, BLOCK_N, BLOCK_K, THREAD_M, THREAD_N
)
gemm_blocked_add_kernel = make_gemm_blocked_kernel(
    BLOCK_M, BLOCK_N, BLOCK_K, THREAD_M, THREAD_N, accumulate=True
)
BLOCKED_THREADS = (BLOCK_M // THREAD_M) * (BLOCK_N // THREAD_N)


def gemm_blocked(x, w, out, stream=0, accumulate: bool = False):
    """Launch: out = x · wᵀ (accumulate: out += x · wᵀ), register-blocked (128 x 128
    tiles, 8 x 8 outputs per thread).
    """
    M, N, K = check_linear_args("gemm_blocked", x, w, out)
    kernel = gemm_blocked_add_kernel if accumulate else gemm_blocked_kernel
    kernel[(_grid(N, BLOCK_N), _grid(M, BLOCK_M)), BLOCKED_THREADS, stream](x, w, out)
    return out


_GEMM_SIG = "void(uint16[:, ::1], uint16[:, ::1], float32[:, ::1])"
PTX_SIGNATURES = {
    "gemm_naive_kernel": [_GEMM_SIG],
    "gemm_shared_kernel": [_GEMM_SIG],
    "gemm_blocked_kernel": [_GEMM_SIG],
    "gemm_blocked_add_kernel": [_GEMM_SIG],
}


# %%
if can_launch():
    print(
        f"gemm_blocked on {SMALL}: relative error "
        f"{check_gemm(gemm_blocked, *SMALL):.1e}"
    )
    if has_gpu():  # several blocks in both directions, and edges in all three
        for shape in [(1000, 3000, 2048), (2048, 2048, 8192 + 13), (129, 257, 31)]:
            for launch in (gemm_naive, gemm_shared, gemm_blocked):
                check_gemm(launch, *shape)
        print("all three rungs agree with the reference at real sizes")

# %% [markdown]
# A NaN anywhere in a row of $x$ must poison exactly that row of $y$ — a kernel that
# zero-fills its tiles must not hide it:

# %%
if can_launch():
    x_nan, w_small = random_bf16((5, 20)), random_bf16((6, 20))
    x_nan[2, 7] = 0x7FC0  # a quiet NaN
    for launch in (gemm_naive, gemm_shared, gemm_blocked):
        d_out = cuda.to_device(np.zeros((5, 6), np.float32))
        y = launch(cuda.to_device(x_nan), cuda.to_device(w_small), d_out).copy_to_host()
        assert np.isnan(y[2]).all() and not np.isnan(np.delete(y, 2, axis=0)).any(), (
            launch.__name__
        )
    print("a NaN in row 2 of x gives NaN in row 2 of y, and nowhere else")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
How far does this ladder get? The measurements are at the end of the chapter; the short
answer is that even the best rung stays far below cuBLAS, for a reason no amount of
tuning in this style removes: it runs on the CUDA cores, and the tensor cores' peak is
{{ch06_peak_ratio}} times theirs. We will call cuBLAS for prefill. But first, decoding —
where, for one token at a time, the CUDA cores are plenty.
""")

# %% [markdown]
# ## GEMV: decoding one token at a time
#
# With $M$ between 1 and 16 the product is a matrix–vector product (**GEMV**), or a few
# of them sharing $W$. Its intensity is about $M$ FLOPs per byte, below the ridge point,
# so for one token what matters is reading $W$ at full memory bandwidth — every byte of
# it once, and nothing else from memory. Four decisions get us there. (With more tokens
# the arithmetic starts to count too; the measurements will say how soon.)
#
# **1. Wide, coalesced loads.** View the `uint16` weight matrix as `uint64` (the
# conventions of chapter 01): one load brings four bf16 values. The lanes of a warp read
# consecutive words — lane $l$ reads words $l, l + 32, l + 64, \dots$ of a row — so each
# warp-wide load is 256 contiguous bytes, eight full sectors. Splitting a word is two
# shifts and two masks:

# %%
#| export kernels.gemv
import math

import numpy as np
from numba import config, cuda, float32, uint32, uint64

from tinyvllm_lib.kernels.activation_store import store_activation, unpack_f32_pair
from tinyvllm_lib.kernels.bf16 import bf16_to_f32, device_function
from tinyvllm_lib.kernels.checks import device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.gemm import check_linear_args
from tinyvllm_lib.kernels.rmsnorm import check_weight_eps


@device_function
def bf16x4_to_f32(word):
    """The four bf16 values packed in a uint64 (lowest address first), as float32."""
    lo, hi = uint32(word & uint64(0xFFFFFFFF)), uint32(word >> uint64(32))
    return (
        bf16_to_f32(lo & uint32(0xFFFF)),
        bf16_to_f32(lo >> uint32(16)),
        bf16_to_f32(hi & uint32(0xFFFF)),
        bf16_to_f32(hi >> uint32(16)),
    )


# %% [markdown]
# **2. Several loads in flight.** Memory answers after several hundred nanoseconds; to
# stream 4 TB/s, the 132 SMs must keep a few megabytes requested and not yet returned —
# some twenty kilobytes each (Little's law: bytes in flight = bandwidth × latency). So
# each thread first issues all its loads for a few steps of $k$ and for a few rows —
# `unroll × rows` words — and only then uses them.
#
# **3. Who adds up a row.** Each thread ends up with partial sums over its share of $k$;
# the 32 lanes of a warp combine theirs with **shuffles**, register to register: in five
# butterfly steps (`shfl_xor` with 16, 8, 4, 2, 1) every lane gets the sum — the warp
# reduction of chapter 04, applied to all of a thread's accumulators at once. The
# simulator has no shuffles, so on import we pick a stand-in that meets in shared
# memory; the kernel around it is the same code, so CI tests its logic.

# %%
#| export kernels.gemv
FULL_MASK = 0xFFFFFFFF

if config.ENABLE_CUDASIM:

    @cuda.jit(device=True)
    def warp_sum_all(values):
        """Simulator stand-in for the shuffles: lanes meet in shared memory. Every
        thread of the block must call it.
        """
        scratch = cuda.shared.array((1024, 64), float32)  # (thread, value)
        tid = cuda.threadIdx.x
        first_lane = tid - tid % 32
        cuda.syncthreads()  # the previous call's readers are done
        scratch[tid, : values.shape[0]] = values
        cuda.syncthreads()
        values[:] = scratch[first_lane : first_lane + 32, : values.shape[0]].sum(axis=0)

else:

    @cuda.jit(device=True, forceinline=True)
    def warp_sum_all(values):
        """Replace each values[i] by its sum over the 32 lanes of the warp (butterfly
        shuffles); every lane gets it.
        """
        for i in range(values.shape[0]):
            v = values[i]
            for lane_mask in (16, 8, 4, 2, 1):
                v += cuda.shfl_xor_sync(FULL_MASK, v, lane_mask)
            values[i] = v


# %% [markdown]
# **4. Enough warps.** The plain design gives each row of $W$ to one warp. For the 2048
# × 2048 `o` projection that is 2048 warps; an H200 holds 132 × 64 = 8448, so three
# quarters of the GPU's capacity to keep loads in flight sits idle, and each warp's 4 KB
# row is over in a few steps. The fix is to **split $k$ across more threads**: let a
# whole block of 8 warps share a few rows (each thread takes every 256th word), reduce
# within each warp by shuffles, then across the 8 warps through shared memory. Now the
# same matrix keeps 8192 warps busy. For the tall LM head (128,256 rows) both designs
# have warps to spare, and a warp that owns its row needs no barrier and no second
# reduction, so the launcher's `"auto"` choice gives each row its own warp there (for
# one or two tokens; with more, the block's loads of $x$, shared by its rows, should
# matter more). The measurements below compare the two on every shape, and on whole
# decoding steps at every token count. (In the simulator, where every thread is a Python
# thread, `"auto"` always takes the warp per row: 8 times fewer threads for the same
# result.)
#
# The same kernel serves 1 to 16 token vectors. The tokens share each weight word, so
# the weights are read from memory once whatever $M$ is, and each thread keeps
# `rows × tokens` accumulators. Those must live in **registers**, and registers have no
# addresses: `acc[i]` is a register only if every `i` is known when the kernel is
# compiled — if every loop that indexes `acc` is unrolled completely. So the number of
# tokens one pass handles is a compile-time constant, a *bucket* of 1, 2, 4 or 8 (3
# tokens use the 4-bucket kernel and skip the missing one), and more than 8 tokens go
# through the same kernel in passes of 8: each block walks its rows once per pass, and
# the second walk finds them in L1 or L2, so the weights still come from DRAM once.
#
# Why not a 16-token bucket? With 16 tokens and 4 rows a thread holds 64 accumulators,
# and the loop of `warp_sum_all` over them — 64 iterations of 5 shuffles — is more than
# LLVM is willing to unroll. What remains is a loop with a run-time index into `acc`,
# and the PTX puts the array in **local memory** (`.local`, per-thread memory in DRAM
# behind the caches: `ld.local`, `st.local`). `ptxas` either leaves it there or — as it
# does for this kernel — keeps it in registers after all by turning every `acc[i]` into
# a chain of compares and selects, one per element of the array, so that the reduction
# alone executes many times the instructions of the whole 8-token kernel. The kernel
# still gives the right answer, only slowly; nothing in Python or in the results says
# so, only the PTX (or the SASS, `nvdisasm`) does. `tests/test_gemm.py` compiles every
# GEMV kernel to PTX and fails on any `.local` access, and `GEMV_MAX_ACC` caps the
# accumulators at 32, which the unroller does take.
#
# **The tail.** The loop runs over words with the guard `j < num_words`, so $K$ need not
# be a multiple of a warp's 128 values or of anything else, as long as a row starts on
# an 8-byte boundary: $K$ a multiple of 4 (every Llama shape is a multiple of 64). The
# launcher checks.
#
# **Starting before the kernel before ends.** Chapter 11 replays a decode step from a
# CUDA graph whose edges let each kernel start while the one before it is still
# finishing (chapter 1's programmatic edges); every kernel of the library calls
# `wait_for_previous_kernel()` before it touches anything another kernel writes, and
# outside such a graph the wait returns at once. No kernel writes the weights, so the
# GEMV loads its first step of weight words *before* the wait: those loads are in
# flight while the norm or attention before it ends, and the loop starts with them in
# registers (`loaded`). Its input vector is read only after the wait.

# %%
#| export kernels.gemv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

GEMV_THREADS = 256  # 8 warps per block
GEMV_WARPS = GEMV_THREADS // 32
GEMV_MAX_TOKENS = 16  # token vectors per call
# token vectors per pass (compile-time); more than 8 are done in passes of 8
GEMV_BUCKETS = (1, 2, 4, 8)
# accumulators per thread (rows x tokens per pass): at 64, acc left the registers
GEMV_MAX_ACC = 32
# variant -> (warps sharing a row, rows per warp group, steps of k loaded before use);
# one token's knobs come from a sweep of all of them at each decode shape on an H200
# (bench/ch11_fusion_proto.py, chapter 11: batch 1 is where every microsecond shows)
GEMV_VARIANTS = {
    "warp": lambda tokens: (1, 1, 8 if tokens == 1 else 4),
    "block": lambda tokens: (
        (GEMV_WARPS, 4, 1) if tokens == 1 else (GEMV_WARPS, 2 if tokens <= 2 else 4, 2)
    ),
}
# "auto": a warp per row from this many rows on (for 1 or 2 tokens)
GEMV_WARP_MIN_ROWS = 16384
# the kernel's body is a device function, inlined into each of its kernels
INLINE = {} if config.ENABLE_CUDASIM else {"forceinline": True}


def make_gemv_kernel(
    num_tokens: int,
    warps_per_row: int,
    rows: int,
    unroll: int,
    gated: bool = False,
    accumulate: bool = False,
    rms_norm: bool = False,
):
    """A GEMV kernel, num_tokens token vectors per pass: out (M, N) = x (M, K) · wᵀ, x
    and w viewed as uint64.

    gated: w is [gate | up] (2 N, K) and out (M, N) = SiLU(x · gateᵀ) * (x · upᵀ),
    float32 or bf16 bits — chapter 7's MLP with its activation done where the two
    products are made, not in a kernel of its own. A warp group's rows are then gate
    row n and up row n (rows = 2).
    accumulate: out += x · wᵀ (out float32): the residual add done where the product is
    made.
    rms_norm: x is the float32 residual stream (viewed as uint64: float32 pairs) and
    the kernel takes (x64, w64, out, norm64, eps): out = RMSNorm(x) · wᵀ, with norm64
    the norm's bf16 weight viewed as uint64. The sum of squares is made in the loop
    that makes the dot products, and each dot product is scaled at the end.
    """
    assert not gated or (rows == 2 and warps_per_row == 1), (
        "a gated GEMV is a warp per (gate, up) pair of rows"
    )
    assert not (gated and (accumulate or rms_norm)), "a gated GEMV only stores"
    # the warps' sums meet as one group: a warp a row, or the whole block
    assert warps_per_row in (1, GEMV_WARPS), (
        f"a row is read by one warp or all {GEMV_WARPS}, not {warps_per_row}"
    )
    threads_per_row = 32 * warps_per_row
    # output columns a block writes
    rows_per_block = GEMV_WARPS // warps_per_row * (1 if gated else rows)
    # constants for the kernel
    acc_size, words_size, wf_size = rows * num_tokens, rows * unroll, 4 * rows
    assert acc_size <= GEMV_MAX_ACC, (
        f"{acc_size} accumulators per thread would not stay in registers"
    )
    # the sums to add up across lanes: the dot products, then (rms_norm) each token's
    # sum of squares
    sums_size = acc_size + (num_tokens if rms_norm else 0)
    step = threads_per_row * unroll
    partial_shape = (GEMV_WARPS, sums_size)

    @cuda.jit(device=True, **INLINE)
    def store_sum(out, m, n, total, squares, k, eps, prior):
        """out[m, n] = one dot product: scaled by the RMSNorm of its token (rms_norm),
        added to prior, what out held (accumulate).
        """
        if rms_norm:  # the mean of the k squares
            total *= float32(1.0) / math.sqrt(squares / k + eps)
        if accumulate:
            out[m, n] = prior + total
        else:
            out[m, n] = total

    @cuda.jit(device=True, **INLINE)
    def load_prior(out, prior, n0, m0, N, M, lane, tid):
        """accumulate: what out holds where this thread will write. A warp a row:
        lane 0 writes all of its warp's sums, into prior; the block's: thread i writes
        sum i, returned.
        """
        if warps_per_row == 1:
            for i in range(acc_size):
                n, m = n0 + uint64(i // num_tokens), m0 + uint64(i % num_tokens)
                ok = lane == 0 and n < N and m < M
                prior[i] = out[m, n] if ok else float32(0)
            return float32(0)
        n, m = n0 + uint64(tid // num_tokens), m0 + uint64(tid % num_tokens)
        return out[m, n] if tid < acc_size and n < N and m < M else float32(0)

    @cuda.jit(device=True, **INLINE)
    def gemv_body(x64, w64, out, norm64, eps):
        # (warp, row * num_tokens + token), then the sums of squares
        partial = cuda.shared.array(partial_shape, float32)
        tid = cuda.threadIdx.x
        # which rows, which share of them
        group, t = tid // threads_per_row, uint64(tid % threads_per_row)
        M, N, num_words = (
            uint64(x64.shape[0]),
            uint64(w64.shape[0]),
            uint64(w64.shape[1]),
        )
        if gated:  # row r of the group is w's row n0 + r * (N / 2): gate, then up
            n0, row_step, num_rows = (
                uint64(cuda.blockIdx.x * rows_per_block + group),
                N // uint64(2),
                N // uint64(2),
            )
        else:
            n0, row_step, num_rows = (
                uint64(cuda.blockIdx.x * rows_per_block + group * rows),
                uint64(1),
                N,
            )
        lane, warp = tid % 32, tid // 32
        k = float32(4) * float32(num_words)  # values a row: 4 a word of w
        # acc[r * num_tokens + m] = partial y[m0 + m, n0 + r]; acc[acc_size + m] =
        # partial sum of token m's squares
        acc = cuda.local.array(sums_size, float32)
        words = cuda.local.array(words_size, uint64)
        wf = cuda.local.array(wf_size, float32)  # the words of w, widened
        prior = cuda.local.array(acc_size, float32)  # accumulate: what out held
        # No earlier kernel writes w: load the first step's words before waiting for
        # the kernel before this one, which may still be running (chapter 1's
        # programmatic graph edges; chapter 11 measures them)
        j = t
        for u in range(unroll):
            jj = j + uint64(u * threads_per_row)
            for r in range(rows):
                n = n0 + uint64(r) * row_step
                words[u * rows + r] = (
                    w64[n, jj] if jj < num_words and n < N else uint64(0)
                )
        loaded = True  # words holds the step at j = t
        wait_for_previous_kernel()
        m0 = uint64(0)
        # one pass per num_tokens token vectors; after the first, w comes from the cache
        while m0 < M:
            for i in range(sums_size):
                acc[i] = float32(0)
            # accumulate, one token: what out holds, loaded as the pass starts, under
            # way while w streams in (more tokens: after the loop, see below)
            mine = float32(0)  # the block's writers: thread i writes sum i
            if accumulate and num_tokens == 1:
                mine = load_prior(out, prior, n0, m0, N, M, lane, tid)
            j = t
            while j < num_words:
                # issue every load first: unroll * rows words in flight
                if not loaded:
                    for u in range(unroll):
                        jj = j + uint64(u * threads_per_row)
                        for r in range(rows):
                            n = n0 + uint64(r) * row_step
                            words[u * rows + r] = (
                                w64[n, jj] if jj < num_words and n < N else uint64(0)
                            )
                loaded = False
                for u in range(unroll):
                    jj = j + uint64(u * threads_per_row)
                    if jj < num_words:  # the tail: the last step may be partial
                        for r in range(rows):
                            wf[4 * r], wf[4 * r + 1], wf[4 * r + 2], wf[4 * r + 3] = (
                                bf16x4_to_f32(words[u * rows + r])
                            )
                        if rms_norm:  # the norm's weights for these four values
                            g0, g1, g2, g3 = bf16x4_to_f32(norm64[jj])
                        for m in range(num_tokens):
                            if m0 + uint64(m) < M:
                                if rms_norm:  # x: float32, weighted, squares summed
                                    x0, x1 = unpack_f32_pair(
                                        x64[m0 + uint64(m), uint64(2) * jj]
                                    )
                                    x2, x3 = unpack_f32_pair(
                                        x64[m0 + uint64(m), uint64(2) * jj + uint64(1)]
                                    )
                                    acc[acc_size + m] += (
                                        x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
                                    )
                                    x0, x1, x2, x3 = x0 * g0, x1 * g1, x2 * g2, x3 * g3
                                else:
                                    x0, x1, x2, x3 = bf16x4_to_f32(
                                        x64[m0 + uint64(m), jj]
                                    )
                                for r in range(rows):
                                    acc[r * num_tokens + m] += (
                                        x0 * wf[4 * r]
                                        + x1 * wf[4 * r + 1]
                                        + x2 * wf[4 * r + 2]
                                        + x3 * wf[4 * r + 3]
                                    )
                j += uint64(step)
            # more tokens: held through the loop, the loads would cost registers (a
            # warp a row: every lane's, for lane 0's values)
            if accumulate and num_tokens > 1:
                mine = load_prior(out, prior, n0, m0, N, M, lane, tid)
            warp_sum_all(acc)  # every lane now holds its warp's sums
            if gated and warps_per_row == 1:  # lane 0: SiLU(gate) * up
                for m in range(num_tokens):
                    if lane == 0 and n0 < num_rows and m0 + uint64(m) < M:
                        gate, up = acc[m], acc[num_tokens + m]
                        store_activation(
                            out,
                            m0 + uint64(m),
                            n0,
                            gate / (float32(1.0) + math.exp(-gate)) * up,
                        )
            elif warps_per_row == 1:  # a warp owns its rows: lane 0 writes them
                for i in range(acc_size):
                    n, m = n0 + uint64(i // num_tokens), m0 + uint64(i % num_tokens)
                    if lane == 0 and n < N and m < M:
                        squares = (
                            acc[acc_size + i % num_tokens] if rms_norm else float32(0)
                        )
                        store_sum(out, m, n, acc[i], squares, k, eps, prior[i])
            # the block shares its rows: add up the warps' sums through shared memory
            else:
                if lane == 0:
                    for i in range(sums_size):
                        partial[warp, i] = acc[i]
                cuda.syncthreads()
                if tid < acc_size:
                    total, squares = float32(0), float32(0)
                    for i in range(GEMV_WARPS):
                        total += partial[i, tid]
                        if rms_norm:
                            squares += partial[i, acc_size + tid % num_tokens]
                    n, m = n0 + uint64(tid // num_tokens), m0 + uint64(tid % num_tokens)
                    if n < N and m < M:
                        store_sum(out, m, n, total, squares, k, eps, mine)
                cuda.syncthreads()  # partial is read before the next pass writes it
            m0 += uint64(num_tokens)

    if rms_norm:

        @cuda.jit
        def kernel(x64, w64, out, norm64, eps):
            gemv_body(x64, w64, out, norm64, eps)

    else:

        @cuda.jit
        def kernel(x64, w64, out):
            # no norm: w's first row stands in for its weight (never read)
            gemv_body(x64, w64, out, w64[0], float32(0))

    kernel.rows_per_block = rows_per_block
    kernel.unroll = unroll  # steps of k in flight (chapter 11 sweeps the gated kernel)
    kernel.reads_before_wait = True  # w's first step (tests/test_ptx.py)
    return kernel


# Module-level names, so that tests/test_ptx.py compiles every one of them: the plain
# GEMV, the one that adds to its output ("add") and the one that norms its input
# ("rmsnorm"), a kernel a (variant, bucket)
GEMV_KERNELS = {}
PTX_SIGNATURES = {}
GEMV_EPILOGUES = {"": {}, "add": {"accumulate": True}, "rmsnorm": {"rms_norm": True}}
_SIG = "uint64[:, ::1], uint64[:, ::1], float32[:, ::1]"
for _variant, _config in GEMV_VARIANTS.items():
    for _tokens in GEMV_BUCKETS:
        for _kind, _flags in GEMV_EPILOGUES.items():
            _name = f"gemv_{_variant}_t{_tokens}{'_' * bool(_kind)}{_kind}_kernel"
            GEMV_KERNELS[_variant, _tokens, _kind] = globals()[_name] = (
                make_gemv_kernel(_tokens, *_config(_tokens), **_flags)
            )
            PTX_SIGNATURES[_name] = [
                f"void({_SIG}, uint64[::1], float32)"
                if _kind == "rmsnorm"
                else f"void({_SIG})"
            ]


# %% [markdown]
# **Two jobs for the GEMV's ends.** A decoding step of Llama (chapter 7) runs, twice a
# layer, *projection → residual add → RMSNorm → projection*. At one token the add and
# the norm are a few kilobytes of work in a kernel of their own, and chapter 11 measures
# what such a kernel costs at batch 1: its launch and its wait, not its bytes. Both fit
# in the GEMV we have, as compile-time flags of `make_gemv_kernel`:
#
# - `accumulate`: the projection *adds* its result to `out` instead of writing it. The
#   residual stream is the `out` of the output and down projections, and each of its
#   elements has one writer, so the add needs nothing but a load of what `out` held.
#   At one token the writers issue it as the loop starts, so that it arrives while
#   $W$ streams in; at more tokens, where a warp's writer holds many values, after the
#   loop (held through it, they would cost every lane registers). cuBLAS does the same
#   with `beta = 1`.
# - `rms_norm`: the GEMV reads the float32 residual stream and the norm's weight $g$,
#   and computes $\mathrm{RMSNorm}(x) \cdot W^\top$ itself. The norm's scale
#   $1/\sqrt{\overline{x^2} + \epsilon}$ is one number per token, so it factors out of
#   every dot product: $\sum_k \frac{x_k g_k}{s} W_{nk} = \frac{1}{s}\sum_k x_k g_k
#   W_{nk}$. The kernel adds up $x_k^2$ in the same loop that adds up $x_k g_k W_{nk}$
#   — each thread sees each $x_k$ of its share once — and the squares travel through
#   the same warp and block reductions as the dot products; the scale is applied at the
#   end. No block waits for the whole row before it starts, and no second kernel runs.
#   The normed values stay in float32 (the separate norm rounds them to bf16 for the
#   next kernel), so the result is closer to float32, not bit-equal to the two kernels'.
#
# The kernel's body is one device function, inlined into each kernel (`forceinline`),
# so the flags cost nothing where they are off. The norm inside the GEMV is not free:
# every reader of $x$ now reads a float32 value and the norm's bf16 weight where it read
# one bf16 value, three times the bytes, through the same caches that bring $W$ in. A
# short GEMV, which spends most of its time starting and ending, has room for that; one
# that already streams $W$ at the memory's pace does not. Chapter 11 measures both on
# Llama's projections, and `rmsnorm_linear` below fuses the norm only into GEMVs of
# fewer rows than the one that lost (`NORM_IN_GEMV_MAX_ROWS`).
#
# The launcher picks the bucket and the variant, views both operands as `uint64` (a
# view, not a copy) and checks what the views need.


# %%
#| export kernels.gemv
def can_gemv(x, w) -> bool:
    """True when gemv handles these operands: at most 16 tokens, rows that start on
    8-byte boundaries.
    """
    return (
        x.shape[0] <= GEMV_MAX_TOKENS
        and x.shape[1] % 4 == 0
        and device_pointer(x) % 8 == 0
        and device_pointer(w) % 8 == 0
    )


def gemv_variant(M: int, N: int) -> str:
    """The variant "auto" runs on a GPU for M token vectors and N rows."""
    return "warp" if N >= GEMV_WARP_MIN_ROWS and M <= 2 else "block"


def pick_gemv_kernel(name: str, M: int, N: int, variant: str, kind: str = ""):
    """(kernel, blocks) for M token vectors and N rows: the variant ("auto": the
    launcher's choice), its bucket, the epilogue `kind` (see GEMV_EPILOGUES).
    """
    if M > GEMV_MAX_TOKENS:
        raise ValueError(
            f"{name}: at most {GEMV_MAX_TOKENS} token vectors, got {M}: use a GEMM"
        )
    if variant == "auto" and config.ENABLE_CUDASIM:
        # the simulator runs every thread in Python: the variant with 8x fewer threads
        # per row
        variant = "warp"
    if variant == "auto":
        variant = gemv_variant(M, N)
    if variant not in GEMV_VARIANTS:
        raise ValueError(
            f"{name}: variant must be 'auto' or one of {list(GEMV_VARIANTS)}, got "
            f"{variant!r}"
        )
    bucket = next((b for b in GEMV_BUCKETS if b >= M), GEMV_BUCKETS[-1])
    kernel = GEMV_KERNELS[variant, bucket, kind]
    return kernel, (N + kernel.rows_per_block - 1) // kernel.rows_per_block


def gemv(x, w, out, stream=0, variant: str = "auto", accumulate: bool = False):
    """Launch: out (M, N) = x (M, K) · wᵀ for M <= 16 token vectors, reading w 8 bytes
    at a time; accumulate: out += x · wᵀ instead.
    """
    M, N, K = check_linear_args("gemv", x, w, out)
    if K % 4 or device_pointer(x) % 8 or device_pointer(w) % 8:
        raise ValueError(
            f"gemv: reads 4 bf16 at a time, so rows must start on 8-byte boundaries: "
            f"K={K} must be a multiple of 4 and x, w 8-byte aligned"
        )
    kernel, blocks = pick_gemv_kernel("gemv", M, N, variant, "add" * accumulate)
    kernel[blocks, GEMV_THREADS, stream](x.view(np.uint64), w.view(np.uint64), out)
    return out


def gemv_rmsnorm(residual, norm_weight, eps: float, w, out, stream=0, variant="auto"):
    """Launch: out (M, N) = RMSNorm(residual) · wᵀ for M <= 16 rows of the float32
    residual stream (M, K), with the norm's bf16 weight (K,): chapter 4's norm and this
    GEMV in one kernel.
    """
    M, K = residual.shape if residual.ndim == 2 else (0, 0)
    N = w.shape[0] if w.ndim == 2 else 0
    if (
        (residual.dtype, norm_weight.dtype, w.dtype, out.dtype)
        != (np.float32, np.uint16, np.uint16, np.float32)
        or (tuple(norm_weight.shape), tuple(w.shape), tuple(out.shape))
        != ((K,), (N, K), (M, N))
        or not all(is_c_contiguous(a) for a in (residual, norm_weight, w, out))
        or 0 in (M, N, K)
    ):
        raise ValueError(
            "gemv_rmsnorm: need residual (M, K) float32, norm_weight (K,) and w (N, K) "
            "bf16 bits, out (M, N) float32, all C-contiguous; got "
            + ", ".join(
                f"{a.dtype} {tuple(a.shape)}" for a in (residual, norm_weight, w, out)
            )
        )
    pointers = (device_pointer(a) for a in (residual, norm_weight, w))
    if K % 4 or any(p % 8 for p in pointers):
        raise ValueError(
            f"gemv_rmsnorm: reads 4 values at a time: K={K} must be a multiple of 4 "
            "and residual, norm_weight, w 8-byte aligned"
        )
    eps = check_weight_eps("gemv_rmsnorm", norm_weight, K, eps)  # chapter 4's check
    kernel, blocks = pick_gemv_kernel("gemv_rmsnorm", M, N, variant, "rmsnorm")
    kernel[blocks, GEMV_THREADS, stream](
        residual.view(np.uint64),
        w.view(np.uint64),
        out,
        norm_weight.view(np.uint64),
        eps,
    )
    return out


# %% [markdown]
# Test both variants with shapes that leave a partial last step ($K$ = 100 is 25 words,
# fewer than a warp's 32 lanes), odd numbers of rows, a token count between buckets, and
# $K = 1040$: a warp-per-row step covers 32 lanes × 4 words × 4 values = 512 values, so
# two full steps leave 16 values over — the tail the reference showed we cannot drop:


# %%
def check_gemv(M: int, N: int, K: int, variant: str) -> float:
    def launch(x, w, out):
        return gemv(x, w, out, variant=variant)

    launch.__name__ = f"gemv[{variant}]"
    return check_gemm(launch, M, N, K)


if can_launch():
    cases = (
        [(1, 13, 100), (3, 9, 100), (16, 5, 1040)]
        if is_simulator()
        else [
            (1, 3072, 2048),
            (3, 2048, 2048 + 16),
            (7, 16384, 2048),
            (16, 2048, 8192),
            (11, 1001, 1028),
        ]
    )
    for M, N, K in cases:
        for variant in GEMV_VARIANTS:
            err = check_gemv(M, N, K, variant)
        print(f"gemv M={M:2d} N={N:6d} K={K:5d}: relative error {err:.1e}")

# %% [markdown]
# And the two epilogues, against NumPy in float64: the GEMV that adds to what `out`
# holds, and the GEMV that norms its input (its reference keeps the normed values in
# float64, as the kernel keeps them in float32):


# %%
def check_gemv_epilogues(M: int, N: int, K: int, variant: str) -> tuple[float, float]:
    """(relative error of out += x · wᵀ, of out = RMSNorm(residual) · wᵀ)."""
    x, w = random_bf16((M, K)), random_bf16((N, K), scale=0.05)
    before = rng.standard_normal((M, N)).astype(np.float32)
    out = cuda.to_device(before)
    gemv(cuda.to_device(x), cuda.to_device(w), out, variant=variant, accumulate=True)
    add_err = rel_error(out.copy_to_host(), before + linear_ref(x, w))
    residual = (4 * rng.standard_normal((M, K))).astype(np.float32)
    g = random_bf16(K)
    out = cuda.device_array((M, N), np.float32)
    gemv_rmsnorm(
        cuda.to_device(residual), cuda.to_device(g), 1e-5, cuda.to_device(w), out,
        variant=variant,
    )
    # chapter 4's reference, its normed rows kept in float32 as the kernel keeps them
    normed = rmsnorm_ref(residual, g, 1e-5).astype(np.float64)
    want = normed @ bf16_bits_to_f32(w).astype(np.float64).T
    return add_err, rel_error(out.copy_to_host(), want)


if can_launch():
    for M, N, K in cases[:2]:
        for variant in GEMV_VARIANTS:
            add_err, norm_err = check_gemv_epilogues(M, N, K, variant)
            print(
                f"M={M:2d} N={N:5d} K={K:5d} {variant:>5}: out += x·wᵀ {add_err:.1e}, "
                f"RMSNorm(x)·wᵀ {norm_err:.1e}"
            )
            assert max(add_err, norm_err) < 1e-4

# %% [markdown]
# ## cuBLAS, from row-major Python
#
# For prefill we call NVIDIA's cuBLAS: its `cublasGemmEx` takes bf16 inputs, accumulates
# in float32 on the tensor cores (`CUBLAS_COMPUTE_32F`) and writes float32. We reach it
# through **nvmath-python**'s thin bindings, `nvmath.bindings.cublas`, which take raw
# device pointers — so they work on numba's arrays — and which, unlike CuPy's wrapper,
# can be recorded into a CUDA graph together with our own kernels. It is an optional GPU
# extra (`pip install nvmath-python[cu13]`); without it the library falls back to rung
# 3.
#
# **The transpose trick.** cuBLAS is column-major (Fortran): a matrix with leading
# dimension $\ell$ stores element $(i, j)$ at offset $i + j\ell$. Our arrays are
# row-major: element $(i, j)$ of an $R \times C$ array sits at offset $iC + j$. The same
# offset read column-major with $\ell = C$ is element $(j, i)$ of a $C \times R$ matrix.
# So **a row-major buffer is, to cuBLAS, the transpose of the matrix we mean**:
#
# | buffer (row-major) | what cuBLAS sees (column-major) | leading dimension |
# | --- | --- | --- |
# | $x$, $M \times K$ | $x^\top$, $K \times M$ | $K$ |
# | $W$, $N \times K$ | $W^\top$, $K \times N$ | $K$ |
# | $y$, $M \times N$ | $y^\top$, $N \times M$ | $N$ |
#
# cuBLAS must therefore write $y^\top = (x W^\top)^\top = W x^\top$, an $N \times M$
# product: $C = \mathrm{op}(A)\,\mathrm{op}(B)$ with $m = N$, $n = M$, $k = K$. For
# $\mathrm{op}(A) = W$ we pass $W$'s buffer — which cuBLAS sees as $W^\top$ — with
# `transa = T` and `lda` $= K$; for $\mathrm{op}(B) = x^\top$ we pass $x$'s buffer as it
# is, `transb = N`, `ldb` $= K$; and $C$ is $y$'s buffer with `ldc` $= N$. No data
# moves: the whole trick is in the arguments. (This "TN" layout is also the one cuBLAS
# runs fastest: both operands are read along $k$.)
#
# Before trusting a GPU with it, check the argument list on the CPU. Here is what
# `gemmEx` computes, written in NumPy on flat buffers read column-major, with exactly
# the arguments above:


# %%
def gemm_ex_numpy(
    transa: str,
    transb: str,
    m: int,
    n: int,
    k: int,
    A,
    lda: int,
    B,
    ldb: int,
    C,
    ldc: int,
):
    """cuBLAS's C = op(A) · op(B) (alpha = 1, beta = 0) on flat buffers read
    column-major.
    """

    def colmajor(buf, rows, cols, ld):  # element (i, j) at offset i + j * ld
        return np.lib.stride_tricks.as_strided(
            buf, (rows, cols), (buf.itemsize, ld * buf.itemsize)
        )

    op_a = colmajor(A, k, m, lda).T if transa == "T" else colmajor(A, m, k, lda)
    op_b = colmajor(B, n, k, ldb).T if transb == "T" else colmajor(B, k, n, ldb)
    colmajor(C, m, n, ldc)[...] = op_a @ op_b


M, N, K = 3, 5, 7  # all different: a mix-up of any two cannot pass
x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K))
y = np.zeros((M, N))
# ravel: views of the same memory
gemm_ex_numpy("T", "N", N, M, K, w.ravel(), K, x.ravel(), K, y.ravel(), N)
assert np.allclose(y, x @ w.T)
print(
    "transa=T on W's buffer, transb=N on x's, m=N, n=M, lda=ldb=K, ldc=N: row-major "
    "y = x · Wᵀ"
)

# %% [markdown]
# The host scalars $\alpha = 1$, $\beta = 0$ are passed by pointer; we keep them in
# arrays that live as long as the handle, so a captured graph never points at freed
# memory.

# %%
#| export kernels.cublas
import numpy as np
from numba import config, cuda

from tinyvllm_lib.kernels.checks import device_pointer, is_device_array
from tinyvllm_lib.kernels.gemm import check_linear_args

_STATE = {"gemm": None, "error": None}


def _stream_pointer(stream) -> int:
    return (
        0 if stream is None or isinstance(stream, int) and stream == 0 else int(stream)
    )


class CublasGemm:
    """One cuBLAS handle (created once), with the host scalars alpha = 1 and beta = 0
    or 1 (out = x · wᵀ, or out += x · wᵀ) that each call points to.
    """

    def __init__(self):
        import nvmath
        from nvmath.bindings import cublas

        # cuBLAS binds to the current context: make numba's the current one
        cuda.current_context()
        self.cublas = cublas
        self.handle = cublas.create()
        self.alpha, self.beta = np.ones(1, np.float32), np.zeros(1, np.float32)
        self.beta_add = np.ones(1, np.float32)
        self.bf16, self.f32 = (
            int(nvmath.CudaDataType.CUDA_R_16BF),
            int(nvmath.CudaDataType.CUDA_R_32F),
        )
        self.compute, self.algo = (
            int(cublas.ComputeType.COMPUTE_32F),
            int(cublas.GemmAlgo.DEFAULT),
        )
        self.op_t, self.op_n = int(cublas.Operation.T), int(cublas.Operation.N)
        self._bound = None  # (stream, workspace) last given to cuBLAS

    def bind(self, stream=0, workspace=None):
        """Issue the next calls on `stream`, using `workspace` (a device buffer) if
        given.
        """
        key = (
            _stream_pointer(stream),
            None
            if workspace is None
            else (device_pointer(workspace), workspace.nbytes),
        )
        if key != self._bound:
            # this also resets cuBLAS to its default workspace
            self.cublas.set_stream(self.handle, key[0])
            if key[1] is not None:
                self.cublas.set_workspace(self.handle, *key[1])
            self._bound = key

    def gemm(self, x, w, out, M: int, N: int, K: int, accumulate: bool = False):
        """Row-major out (M, N) = x (M, K) · wᵀ (accumulate: out +=): column-major outᵀ
        (N, M) = op(A) B + beta outᵀ with A = w's buffer, op = T.
        """
        self.cublas.gemm_ex(
            self.handle,
            self.op_t,
            self.op_n,
            N,
            M,
            K,
            self.alpha.ctypes.data,
            device_pointer(w),
            self.bf16,
            K,
            device_pointer(x),
            self.bf16,
            K,
            (self.beta_add if accumulate else self.beta).ctypes.data,
            device_pointer(out),
            self.f32,
            N,
            self.compute,
            self.algo,
        )


def get_cublas() -> CublasGemm | None:
    """The process's cuBLAS handle, created on first use; None in the simulator or
    without nvmath-python.
    """
    if _STATE["gemm"] is None and _STATE["error"] is None:
        if config.ENABLE_CUDASIM or not cuda.is_available():
            _STATE["error"] = "no GPU (cuBLAS does not run in the simulator)"
        else:
            try:
                _STATE["gemm"] = CublasGemm()
            # not installed, or no libcublas: fall back to our kernels
            except Exception as err:
                _STATE["error"] = (
                    f"{type(err).__name__}: {err} (pip install nvmath-python[cu13])"
                )
    return _STATE["gemm"]


def cublas_available() -> bool:
    """True when cuBLAS can be called (a GPU and nvmath-python with its cuBLAS
    library).
    """
    return get_cublas() is not None


def cublas_unavailable_reason() -> str | None:
    get_cublas()
    return _STATE["error"]


def gemm_cublas(x, w, out, stream=0, workspace=None, accumulate: bool = False):
    """out (M, N) = x (M, K) · wᵀ (accumulate: out +=) by cuBLAS gemmEx (bf16 in, f32
    accumulate and out), on `stream`.
    """
    M, N, K = check_linear_args("gemm_cublas", x, w, out)
    if not all(is_device_array(a) for a in (x, w, out)):
        raise TypeError("gemm_cublas: x, w and out must be device arrays")
    gemm = get_cublas()
    if gemm is None:
        raise RuntimeError(f"gemm_cublas: cuBLAS is unavailable: {_STATE['error']}")
    gemm.bind(stream, workspace)
    gemm.gemm(x, w, out, M, N, K, accumulate)
    return out


# %% [markdown]
# Test it where the trick could go wrong: every dimension different, none a multiple of
# anything.

# %%
if cublas_available():
    for shape in [(37, 3072, 2048), (2048, 2048, 8192), (3, 5, 7), (1000, 129, 513)]:
        err = check_gemm(gemm_cublas, *shape)
        print(f"cuBLAS {shape}: relative error {err:.1e}")
else:
    print(f"cuBLAS not used here: {cublas_unavailable_reason()}")

# %% [markdown]
# ## The linear layer
#
# The library's `linear` chooses by shape. With cuBLAS there, it uses the GEMV only for
# as many token vectors as the GEMV was *measured* to beat cuBLAS on a whole decoding
# step — the number is `LINEAR_GEMV_MAX_TOKENS`, and the measurements at the end of the
# chapter say where it comes from — and cuBLAS above. Without cuBLAS (the simulator, or
# a GPU without nvmath-python) it uses the GEMV up to 16 token vectors and rung 3 above:
# rung 3 computes 128 token rows per tile, so with a handful of tokens nearly all its
# work would be wasted.
#
# Like every launcher in the library it checks its arguments before anything runs,
# writes into a buffer the caller owns, and allocates nothing: the cuBLAS handle is
# created once per process, and everything is issued on the caller's `stream` — so a
# whole decoding step can be captured into one CUDA graph. The handle is created on
# first use, which must not happen during a capture; `CudaGraph` calls the function once
# before capturing it, so that is taken care of. An optional `workspace` (a device
# buffer; 32 MiB suits Hopper) is handed to cuBLAS so that it never needs to allocate
# its own.

# %%
#| export layers.linear
from tinyvllm_lib.kernels.checks import device_pointer, is_device_array
from tinyvllm_lib.kernels.cublas import cublas_available, gemm_cublas
from tinyvllm_lib.kernels.gemm import check_linear_args, gemm_blocked
from tinyvllm_lib.kernels.gemv import can_gemv, gemv, gemv_rmsnorm
from tinyvllm_lib.kernels.rmsnorm import rmsnorm

# Up to how many token vectors `linear` prefers the GEMV to cuBLAS, from the H200's
# records (book/data/ch06_gemm.json, decode_step_gemv against decode_step_cublas: the 64
# projections and the LM head of Llama 3.2 1B, each path in its own CUDA graph). At one
# token the GEMV wins, from two on cuBLAS: its time hardly grows with the tokens, the
# GEMV's does. tests/test_gemm.py checks this number against the recorded data
# (gemv_wins_up_to): after re-measuring, update it.
LINEAR_GEMV_MAX_TOKENS = 1
# Up to how many rows of w (exclusive) rmsnorm_linear puts the norm inside the GEMV.
# Measured on the H200 at one token (chapter 11, bench/ch11_kernels.py): inside QKV's
# GEMV (3,072 rows, a short kernel that runs at half the bandwidth ceiling) it saved a
# microsecond and more a layer; inside gate-up's (16,384 rows, near the ceiling) it
# lost, a warp a row and with blocks sharing rows alike.
NORM_IN_GEMV_MAX_ROWS = 16384


def linear_path(x, w) -> str:
    """Which implementation `linear` uses for these operands: 'gemv', 'cublas' or
    'blocked'.
    """
    if cublas_available():
        return (
            "gemv"
            if x.shape[0] <= LINEAR_GEMV_MAX_TOKENS and can_gemv(x, w)
            else "cublas"
        )
    return "gemv" if can_gemv(x, w) else "blocked"


def linear(x, w, out, *, stream=0, workspace=None, accumulate: bool = False):
    """out (num_tokens, out_features) = x · wᵀ: x bf16 bits (num_tokens, in_features), w
    bf16 bits (out, in); accumulate: out += x · wᵀ (a residual add).
    """
    if hasattr(w, "apply"):  # chapter 15: an 8-bit weight makes its own product
        return w.apply(x, out, stream=stream, workspace=workspace,
                       accumulate=accumulate)
    check_linear_args("linear", x, w, out)
    if not all(is_device_array(a) for a in (x, w, out)):
        raise TypeError(
            "linear: x, w and out must be device arrays (linear allocates and copies "
            "nothing)"
        )
    path = linear_path(x, w)
    if path == "gemv":
        return gemv(x, w, out, stream=stream, accumulate=accumulate)
    if path == "cublas":
        return gemm_cublas(
            x, w, out, stream=stream, workspace=workspace, accumulate=accumulate
        )
    return gemm_blocked(x, w, out, stream=stream, accumulate=accumulate)


def norm_in_gemv(normed, w) -> bool:
    """Whether rmsnorm_linear runs the norm inside the GEMV for these operands."""
    return linear_path(normed, w) == "gemv" and w.shape[0] < NORM_IN_GEMV_MAX_ROWS


def rmsnorm_linear(
    residual, norm_weight, eps, w, out, normed, *, stream=0, workspace=None
):
    """out = RMSNorm(residual) · wᵀ: residual float32 (num_tokens, in_features),
    norm_weight its bf16 weight. Where `linear` takes the GEMV and w has fewer than
    NORM_IN_GEMV_MAX_ROWS rows (norm_in_gemv), one kernel (gemv_rmsnorm) and `normed`
    is left alone; elsewhere chapter 4's rmsnorm writes the bf16 rows into `normed`
    (num_tokens, in_features) and `linear` reads them.
    """
    if hasattr(w, "apply_rmsnorm"):  # chapter 15: an 8-bit weight, its own norm too
        return w.apply_rmsnorm(residual, norm_weight, eps, out, normed, stream=stream,
                               workspace=workspace)
    if not all(is_device_array(a) for a in (residual, norm_weight, normed)):
        raise TypeError("rmsnorm_linear: residual, norm_weight, normed: device arrays")
    if (
        norm_in_gemv(normed, w)
        and device_pointer(residual) % 8 == device_pointer(norm_weight) % 8 == 0
    ):
        return gemv_rmsnorm(residual, norm_weight, eps, w, out, stream=stream)
    rmsnorm(residual, norm_weight, eps, normed, stream=stream)
    return linear(normed, w, out, stream=stream, workspace=workspace)


def gemv_wins_up_to(records: list[dict]) -> int | None:
    """From one device's records: the largest M such that the GEMV decoding step
    (decode_step_gemv) was faster than cuBLAS's (decode_step_cublas) for every token
    count 1..M; 0 if not even at 1, None if unmeasured.
    """
    steps: dict[int, dict[str, float]] = {}
    for r in records:
        if r["name"] in ("decode_step_gemv", "decode_step_cublas"):
            steps.setdefault(r["shape"][0], {})[r["name"]] = r["us"]
    if not any(len(t) == 2 for t in steps.values()):
        return None
    wins = 0
    for m in range(1, max(steps) + 1):
        t = steps.get(m, {})
        if len(t) < 2 or t["decode_step_gemv"] >= t["decode_step_cublas"]:
            break
        wins = m
    return wins


# %% tags=["hide-input"]
from tinyvllm_lib.layers.linear import LINEAR_GEMV_MAX_TOKENS, linear, linear_path

prose.glue(
    "ch06_linear_gemv_max",
    f"{LINEAR_GEMV_MAX_TOKENS} token vector"
    + ("s" if LINEAR_GEMV_MAX_TOKENS != 1 else ""),
)
if can_launch():
    for M in (1, 3, 21):  # one token, a few, prefill-sized
        x, w = random_bf16((M, 64)), random_bf16((10, 64))
        d_x, d_w, d_out = (
            cuda.to_device(x),
            cuda.to_device(w),
            cuda.device_array((M, 10), np.float32),
        )
        linear(d_x, d_w, d_out)
        print(
            f"linear, {M} tokens -> {linear_path(d_x, d_w)}: relative error "
            f"{rel_error(d_out.copy_to_host(), linear_ref(x, w)):.1e}"
        )
    for bad in [
        dict(x=np.zeros((2, 64), np.float32)),
        dict(out=cuda.device_array((3, 10), np.float32)),
        dict(w=cuda.to_device(np.zeros((10, 63), np.uint16))),
    ]:
        args = dict(x=d_x, w=d_w, out=d_out) | bad
        try:
            linear(args["x"], args["w"], args["out"])
        except (TypeError, ValueError) as err:
            print(f"{type(err).__name__}: {err}")
        else:
            raise AssertionError("bad input was accepted")

# %% [markdown]
# ## Measurements
#
# `bench/ch06_gemm.py` measures, on a GPU, every kernel above inside captured CUDA
# graphs on weights that do not fit in L2:
#
# - **one whole decoding step**: the GEMVs of all 16 layers — each with its own weights,
#   as in the model — and the LM head, for 1 to 16 token vectors, as bytes of weights
#   over summed time against the bandwidth ceiling: the GEMV (`"auto"`, and each
#   variant) against cuBLAS; and each shape alone, one token, for both GEMV variants;
# - **prefill**, 2048 tokens through each projection: `linear` (its cuBLAS path) against
#   the same cuBLAS call made directly, and against the 989 TFLOP/s bf16 peak;
# - **the ladder** on the 2048 × 2048 × 2048 `o` projection, and rung 3 on every
#   projection, against the 67 TFLOP/s fp32 peak and against cuBLAS.
#
# Where two implementations are compared, each gets its own graph, both are warmed up,
# and their replays alternate — A, B, B, A, A, B… — many times; the medians are
# compared. A GPU's clock follows its temperature and power draw, so two measurements
# taken one after the other can differ by more than two kernels do.
#
# On a GPU you can run it from here (it takes a minute or two); elsewhere the book shows
# the recorded results.

# %%
#| export plots
import numpy as np


def roofline(ax, bandwidth_gbs: float, peaks_tflops: dict, intensity=(0.25, 2048.0)):
    """Draw a roofline: TFLOP/s against FLOPs per byte, one memory roof and one flat
    roof per compute peak.
    """
    ai = np.geomspace(*intensity, 256)
    for i, (label, peak) in enumerate(peaks_tflops.items()):
        ax.plot(
            ai,
            np.minimum(ai * bandwidth_gbs / 1e3, peak),
            color="k",
            lw=1,
            ls="-" if i == 0 else "--",
        )
        ax.annotate(
            label,
            (intensity[1], peak),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte)")
    ax.set_ylabel("TFLOP/s")
    return ax


# %% tags=["hide-input"]
if has_gpu():
    import runpy
    from pathlib import Path

    bench = (
        Path("../bench/ch06_gemm.py")
        if Path("../bench").exists()
        else Path("bench/ch06_gemm.py")
    )
    runpy.run_path(str(bench), run_name="__main__")

records = load_records("ch06_gemm")
if records:  # one device's records: the first one's
    records = [
        r for r in records if r["device"]["name"] == records[0]["device"]["name"]
    ]
print(
    f"{len(records)} recorded measurements; decoding steps shown for 1, 2, 4, 8 and "
    "16 tokens"
)
shown = [
    r
    for r in records
    if not r["name"].startswith("decode_step") or r["shape"][0] in (1, 2, 4, 8, 16)
]
# shares of GB/s records against the ceiling of this device, computed now
CEILING_GBS, CEILING_NAME = bandwidth_ceiling(
    records[0]["device"]["name"] if records else None
)
print(records_table(shown, time_key="us", ceiling=CEILING_GBS))

# %% tags=["hide-input"]
from tinyvllm_lib.plots import roofline

by_name: dict[str, list[dict]] = {}
for r in records:
    by_name.setdefault(r["name"], []).append(r)


def first(name: str, **match) -> dict | None:
    """The first record called `name` whose fields equal `match`."""
    return next(
        (
            r
            for r in by_name.get(name, [])
            if all(r.get(k) == v for k, v in match.items())
        ),
        None,
    )


NOT_YET = "(not yet measured)"


def share(r: dict) -> float:
    """A record's share of its ceiling: a GB/s rate's of the bandwidth ceiling,
    computed now (not the ratio stored with it); a FLOP rate's of its stored peak."""
    return r["value"] / CEILING_GBS if r["metric"] == "GB/s" else r["ratio"]


def pct(r: dict | None, key: str = "ratio") -> str:
    if not r or key not in r:
        return NOT_YET
    return f"{share(r) if key == 'ratio' else r[key]:.0%}"


def tflops(r: dict | None) -> str:
    return (
        f"{r['value']:.0f} TFLOP/s"
        if r and r["value"] >= 10
        else f"{r['value']:.1f} TFLOP/s"
        if r
        else NOT_YET
    )


def micros(r: dict | None, key: str = "us") -> str:
    if not r:
        return NOT_YET
    us = r[key]
    return (
        f"{us / 1e3:.1f} ms"
        if us >= 1000
        else f"{us:.0f} µs"
        if us >= 20
        else f"{us:.1f} µs"
    )


def span(values, fmt: str, unit: str = "") -> str:
    """'low–high unit' of some values, or the one value when they round alike."""
    if not values:
        return NOT_YET
    low, high = format(min(values), fmt), format(max(values), fmt)
    return (low if low == high else f"{low}–{high}") + unit


prose.glue("ch06_device", records[0]["device"]["name"] if records else "(no GPU yet)")

if records:
    fig, ax = new_figure(width=8, height=4.5)
    roofline(
        ax,
        CEILING_GBS,
        {"bf16 tensor cores": BF16_PEAK_TFLOPS, "fp32 CUDA cores": FP32_PEAK_TFLOPS},
    )
    styles = {
        "decode_step_gemv": ("o", "#1f77b4", "GEMV, decode step (1-16 tokens)"),
        "decode_step_cublas": ("x", "#9467bd", "cuBLAS, decode step"),
        "prefill_linear": ("s", "#2ca02c", "linear → cuBLAS, prefill"),
        "ladder_naive": ("v", "#d62728", "rung 1: naive"),
        "ladder_shared": ("^", "#ff7f0e", "rung 2: shared tiles"),
        "ladder_blocked": ("D", "#8c564b", "rung 3: register blocking"),
        "prefill_blocked": ("d", "#e377c2", "rung 3, prefill shapes"),
    }
    for name, (marker, color, label) in styles.items():
        pts = [(r["flops"] / r["bytes"], r["tflops"]) for r in by_name.get(name, [])]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, label=label, zorder=3)
    ax.set_title(
        f"measured on {records[0]['device']['name']}; memory roof = {CEILING_NAME}"
    )
    ax.legend(fontsize=8, loc="upper left")
    plt.show()

# %% [markdown]
# ### The GEMV, one token, shape by shape
#
# Each projection alone, with both variants. The bytes are the weights (and the tiny $x$
# and $y$); the ceiling is chapter 01's best measured rate.

# %% tags=["hide-input"]
gemv_rows = []
print(f"{'layer':>8} {'N x K':>14} {'MB':>6} {'warp':>7} {'block':>7}  faster  auto")
for layer, (N, K) in [*shapes.items(), ("lm_head", lm_head)]:
    warp, block = (
        first("gemv_warp", shape=[1, N, K]),
        first("gemv_block", shape=[1, N, K]),
    )
    if warp and block:
        faster = "warp" if warp["us"] < block["us"] else "block"
        # what gemv(variant="auto") runs for one token
        auto = gemv_variant(1, N)
        gemv_rows.append((layer, N, K, warp, block, faster, auto))
        print(
            f"{layer:>8} {f'{N} x {K}':>14} {2 * N * K / 1e6:6.1f} "
            f"{share(warp):7.1%} {share(block):7.1%}  {faster:>6}  {auto}"
        )
agree = sum(faster == auto for *_, faster, auto in gemv_rows)
prose.glue(
    "ch06_auto_agrees",
    ("all " if agree == len(gemv_rows) else f"{agree} of ") + f"{len(gemv_rows)}"
    if gemv_rows
    else NOT_YET,
)
for layer in ("o", "down", "lm_head"):
    row = next((r for r in gemv_rows if r[0] == layer), None)
    prose.glue(f"ch06_{layer}_warp", pct(row[3]) if row else NOT_YET)
    prose.glue(f"ch06_{layer}_block", pct(row[4]) if row else NOT_YET)
lm_row = next((r for r in gemv_rows if r[0] == "lm_head"), None)
prose.glue(
    "ch06_lm_head_note",
    " (past 100%: chapter 1's read-only kernel is no perfect reader either, and the "
    "ceiling is only the best rate measured so far)"
    if lm_row and share(lm_row[3]) > 1
    else "",
)
o_row = next((r for r in gemv_rows if r[0] == "o"), None)
prose.glue("ch06_o_block_us", micros(o_row[4]) if o_row else NOT_YET)
prose.glue(
    "ch06_o_ideal_us",
    f"{2 * o_row[1] * o_row[2] / (CEILING_GBS * 1e3):.1f} µs" if o_row else NOT_YET,
)

# time = fixed cost + bytes / bandwidth, fitted to the block variant over five shapes
if len(gemv_rows) >= 3:
    mb = np.array([r[4]["bytes"] / 1e6 for r in gemv_rows])
    us = np.array([r[4]["us"] for r in gemv_rows])
    us_per_mb, fixed_us = np.polyfit(mb, us, 1)
    print(
        f"block variant: time ≈ {fixed_us:.1f} µs + bytes at {1 / us_per_mb:.2f} TB/s "
        f"(worst fit {np.max(np.abs(fixed_us + us_per_mb * mb - us) / us):.0%})"
    )
    prose.glue("ch06_gemv_fixed_us", f"{fixed_us:.0f} µs")
    prose.glue("ch06_gemv_fit_tbs", f"{1 / us_per_mb:.1f} TB/s")
else:
    prose.glue("ch06_gemv_fixed_us", NOT_YET)
    prose.glue("ch06_gemv_fit_tbs", NOT_YET)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
The block-split variant earns its keep on the short matrices: on the 2048 × 2048 `o`
projection it reads at {{ch06_o_block}} of {{ch06_ceiling}} where a warp per row gets
{{ch06_o_warp}}, and on the 2048 × 8192 `down` projection, whose 2048 rows are long and
few, {{ch06_down_block}} against {{ch06_down_warp}}: a warp per row makes 2048 warps,
some 16 per SM, too few loads in flight to cover the memory's latency; split over
blocks, the same rows keep every SM busy. On the tall matrices it is the other way round
— the LM head reaches {{ch06_lm_head_warp}} with a warp per row against
{{ch06_lm_head_block}}{{ch06_lm_head_note}} — and the `"auto"` rule, a warp per row from
16,384 rows on, picks the faster variant on {{ch06_auto_agrees}} shapes.

Why does even the block variant read `o` so much more slowly than the LM head? Not for
its loads: a straight line through the five shapes, time = fixed cost + bytes ÷
bandwidth, fits them with a bandwidth of {{ch06_gemv_fit_tbs}} and a fixed cost of about
{{ch06_gemv_fixed_us}} per kernel — the time to fill the GPU with blocks, wait for the
first bytes, and drain the last ones. The 8 MB of `o` would take {{ch06_o_ideal_us}} at
the ceiling; the kernel takes {{ch06_o_block_us}}. A small matrix cannot hide
that cost; fusing small projections (q, k and v are already one matrix) or running more
work per launch can.
""")

# %% [markdown]
# ### One decoding step, 1 to 16 token vectors
#
# All 64 projections and the LM head, each path in its own CUDA graph, the GEMV against
# cuBLAS:

# %% tags=["hide-input"]
from tinyvllm_lib.layers.linear import gemv_wins_up_to

step_paths = {
    "decode_step_gemv": "GEMV (auto)",
    "decode_step_gemv_block": "GEMV block",
    "decode_step_gemv_warp": "GEMV warp",
    "decode_step_cublas": "cuBLAS",
}
step_us = {
    name: {r["shape"][0]: r["us"] for r in by_name.get(name, [])} for name in step_paths
}
counts = sorted(step_us["decode_step_gemv"])
if counts:
    print(
        f"{'tokens':>6} "
        + " ".join(f"{label:>12}" for label in step_paths.values())
        + "   (µs per step)"
    )
    for M in counts:
        print(
            f"{M:6d} "
            + " ".join(
                f"{step_us[name][M]:12.0f}" if M in step_us[name] else f"{'':>12}"
                for name in step_paths
            )
        )

wins = gemv_wins_up_to(records)
print(
    f"recorded: the GEMV beats cuBLAS for up to {wins} token vector(s); linear uses "
    f"it for up to {LINEAR_GEMV_MAX_TOKENS}"
)
if wins is not None and wins != LINEAR_GEMV_MAX_TOKENS:
    print(
        f"NOTE: the recorded data says {wins}: set LINEAR_GEMV_MAX_TOKENS in "
        "layers.linear to match"
    )
prose.glue(
    "ch06_gemv_wins_upto",
    NOT_YET
    if wins is None
    else "no token count"
    if wins == 0
    else f"{wins} token vector" + ("s" if wins != 1 else ""),
)

step = {M: first("decode_step_gemv", shape=[M]) for M in (1, 2, 8, 16)}
cublas_step = {M: first("decode_step_cublas", shape=[M]) for M in (1, 2)}
prose.glue("ch06_step_ratio", pct(step[1]))
for M in (1, 2, 8, 16):
    prose.glue(f"ch06_step{M}_us", micros(step[M]))
for M in (1, 2):
    prose.glue(f"ch06_step{M}_cublas_us", micros(cublas_step[M]))
prose.glue("ch06_step16_ratio", pct(step[16]))
prose.glue(
    "ch06_cublas_step_range",
    span([r["us"] for r in by_name.get("decode_step_cublas", [])], ".0f", " µs"),
)
prose.glue(
    "ch06_cublas_step_pct",
    span([100 * share(r) for r in by_name.get("decode_step_cublas", [])], ".0f", "%"),
)

# the FLOP rate a 16-token step would need to run at the bandwidth ceiling
step_weight_bytes = (
    num_layers * sum(2 * N * K for N, K in shapes.values())
    + 2 * lm_head[0] * lm_head[1]
)
step16_flops = num_layers * sum(
    gemm_flops(16, N, K) for N, K in shapes.values()
) + gemm_flops(16, *lm_head)
need_tflops = step16_flops / (step_weight_bytes / (CEILING_GBS * 1e9)) / 1e12
prose.glue("ch06_step16_need_tflops", f"{need_tflops:.0f} TFLOP/s")
prose.glue("ch06_step16_need_pct", f"{need_tflops / FP32_PEAK_TFLOPS:.0%}")

if counts:
    fig, ax = new_figure(width=8, height=3.5)
    for (name, label), style in zip(step_paths.items(), ["o-", ".:", ".--", "x-"]):
        ms = sorted(step_us[name])
        ax.plot(ms, [step_us[name][m] for m in ms], style, label=label)
    ax.axhline(
        step_weight_bytes / (CEILING_GBS * 1e3),
        color="k",
        lw=1,
        ls="--",
        label=f"weights at the ceiling ({CEILING_NAME})",
    )
    ax.axvline(
        LINEAR_GEMV_MAX_TOKENS + 0.5, color="grey", lw=1, label="linear: GEMV | cuBLAS"
    )
    ax.set_yscale("log")
    ax.set_xlabel("token vectors per step")
    ax.set_ylabel("µs per decoding step")
    ax.legend(fontsize=8)
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
For one token vector, one whole decoding step of GEMVs — 64 projections and the LM head
— takes {{ch06_step1_us}} on the {{ch06_device}}, reading its weights at
{{ch06_step_ratio}} of {{ch06_ceiling}}; the same step through cuBLAS takes
{{ch06_step1_cublas_us}}. With two token vectors the GEMV takes {{ch06_step2_us}} and
cuBLAS {{ch06_step2_cublas_us}}; at 8 and 16 the GEMV takes {{ch06_step8_us}} and
{{ch06_step16_us}} ({{ch06_step16_ratio}} of the ceiling), while cuBLAS stays within
{{ch06_cublas_step_range}} ({{ch06_cublas_step_pct}} of the ceiling) for
every count from 1 to 16. In this data the GEMV wins for {{ch06_gemv_wins_upto}}, and
that is where `linear` switches: the GEMV for up to {{ch06_linear_gemv_max}}, cuBLAS
above.

Why does the GEMV lose ground with every token while cuBLAS does not? It is no longer
only reading. Every weight is multiplied by every token vector on the CUDA cores: a
16-token step at the ceiling needs {{ch06_step16_need_tflops}} of float32 FMAs,
{{ch06_step16_need_pct}} of their peak, before counting the instructions that unpack
bf16, load $x$ and add up the partial sums. And the block variant, which wins for one
token by splitting each row over 256 threads, leaves each thread only a few products per
row: with 8 tokens and the 2048-wide rows of most projections, its loop has almost as
many shuffles as FMAs. cuBLAS multiplies on the tensor cores, which have
{{ch06_peak_ratio}} times the FMA units' throughput, so a few more token vectors cost it
nothing it would notice: its time is the time to read the weights.
""")

# %% [markdown]
# ### Prefill and the ladder

# %% tags=["hide-input"]
prefill_linear = [
    first("prefill_linear", shape=[2048, N, K]) for N, K in shapes.values()
]
prefill_cublas = [
    first("prefill_cublas", shape=[2048, N, K]) for N, K in shapes.values()
]
prefill = first("prefill_linear", shape=[2048, *shapes["gate_up"]])
prose.glue("ch06_prefill_tflops", tflops(prefill))
prose.glue("ch06_prefill_ratio", pct(prefill))
prose.glue(
    "ch06_linear_vs_direct",
    span([100 * r["vs_direct"] for r in prefill_linear if r], ".0f", "%"),
)
prose.glue(
    "ch06_cublas_tflops",
    span([r["value"] for r in prefill_cublas if r], ".0f", " TFLOP/s"),
)
prose.glue(
    "ch06_cublas_pct", span([100 * r["ratio"] for r in prefill_cublas if r], ".0f", "%")
)
host = first("linear_host_call")
prose.glue("ch06_host_us", micros(host, "value"))

ladder = {name: first(f"ladder_{name}") for name in ("naive", "shared", "blocked")}
for name, r in ladder.items():
    prose.glue(f"ch06_ladder_{name}", tflops(r))
prose.glue("ch06_blocked_fp32", pct(ladder["blocked"]))
prose.glue("ch06_blocked_vs_cublas", pct(ladder["blocked"], "vs_cublas"))
cublas_o = first("prefill_cublas", shape=[2048, *shapes["o"]])
prose.glue("ch06_cublas_o", tflops(cublas_o))
prose.glue(
    "ch06_fma_peak_vs_cublas",
    f"{FP32_PEAK_TFLOPS / cublas_o['value']:.0%}" if cublas_o else NOT_YET,
)
blocked_all = [r["value"] for r in by_name.get("prefill_blocked", [])]
prose.glue("ch06_blocked_range", span(blocked_all, ".0f", " TFLOP/s"))
for r in prefill_linear:
    if r:
        print(
            f"prefill {r['layer']:>8} {str(r['shape']):>20}: linear "
            f"{r['value']:5.0f} TFLOP/s, "
            f"{r['vs_direct']:.1%} of the direct cuBLAS call"
        )

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
For prefill, `linear` runs the fused gate/up projection of 2048 tokens at
{{ch06_prefill_tflops}}, {{ch06_prefill_ratio}} of the bf16 datasheet peak; cuBLAS's
direct calls on the four projections run at {{ch06_cublas_tflops}} ({{ch06_cublas_pct}}
of that peak). Against the same cuBLAS call made directly, `linear` runs at
{{ch06_linear_vs_direct}} of its speed over the four shapes. There is nothing for it to
lose: a CUDA graph replays the kernels it captured and none of the Python around them,
and both graphs hold the same cuBLAS call on the same handle, with the same arguments
and workspace. A gap between the two is the GPU's, not the library's — its clock follows
its power draw and temperature, and the second of two long measurements can run slower
than the first — which is why the bench alternates them. Outside a graph the Python does
cost: a call of `linear` costs the host {{ch06_host_us}}, longer than the GPU takes for
most of the GEMVs above. That is why chapter 11 captures a whole decoding step as a
graph.

The ladder, on the 2048-cube: naive {{ch06_ladder_naive}}, shared tiles
{{ch06_ladder_shared}}, register blocking {{ch06_ladder_blocked}} —
{{ch06_blocked_fp32}} of the CUDA cores' FMA peak and {{ch06_blocked_vs_cublas}} of
cuBLAS ({{ch06_cublas_o}}); on every prefill shape rung 3 runs at
{{ch06_blocked_range}}. The gap to cuBLAS has one big reason and several small ones. The
big one: cuBLAS multiplies on the **tensor cores**. On Hopper a warpgroup of four warps
issues `wgmma` instructions, each a whole $64 \times n \times 16$ bf16 matrix product
(the older one-warp `mma.sync`, `HMMA` in the SASS, still runs, more slowly). numba's
CUDA target compiles SIMT code, one thread at a time, and exposes no tensor-core
instruction, so every multiply in our kernels is a scalar float32 `FFMA`. The FMA units'
datasheet peak is {{ch06_fp32_peak}} against {{ch06_bf16_peak}} for the tensor cores — a
factor of {{ch06_peak_ratio}} — so even a perfect rung 3 would reach only
{{ch06_fma_peak_vs_cublas}} of what cuBLAS measured here. The small reasons, which keep
rung 3 below its own peak: we widen every bf16 to float32 with scalar 2-byte loads; the
tiles are single-buffered, so the SMs wait for each tile's loads instead of fetching the
next one while computing (cuBLAS uses the TMA copy engine and several stages); and
shared memory is read 4 bytes at a time rather than 16.
""")

# %% [markdown]
# ## Summary
#
# - A linear layer does $2MNK$ FLOPs and must move at least $2NK + 2MK + 4MN$ bytes;
#   with one token that is one FLOP per byte — memory-bound — and with thousands,
#   hundreds — compute-bound.
# - The GEMM ladder: one thread per output → shared-memory tiles (each global load
#   reused $T$ times) → register blocking (each shared load reused 8 times). Each rung
#   removes the bottleneck of the last; none reaches the tensor cores.
# - The GEMV reads bf16 weights 8 bytes per lane, coalesced along the row, several loads
#   in flight, with float32 accumulation and shuffle reductions — split over a block
#   when the matrix is small, so that the whole GPU keeps loads in flight. One token's
#   decoding step is then a read of all the weights close to the bandwidth ceiling. Its
#   accumulators must stay in registers: every index into them known at compile time (at
#   most 8 tokens per pass, 32 accumulators), or the PTX shows `.local` and the kernel
#   crawls.
# - cuBLAS, through nvmath-python, is called on row-major buffers by asking for
#   $y^\top = W x^\top$: `transa = T` on $W$'s buffer. It runs in captured CUDA graphs.
# - `linear(x, w, out, stream=...)` chooses GEMV, cuBLAS or rung 3 by shape — the GEMV
#   only up to `LINEAR_GEMV_MAX_TOKENS`, the token count up to which it measured faster
#   than cuBLAS — checks everything first, and allocates nothing.
# - Compare two implementations by alternating them, each warmed up, and comparing
#   medians: a GPU's clock drifts, and the drift can be as large as the differences we
#   care about.
#
# Exported to `tinyvllm_lib`: `kernels.gemm` (the three rungs, `check_linear_args`,
# `gemm_flops`, `gemm_bytes`), `kernels.gemv` (`gemv`, `make_gemv_kernel`,
# `warp_sum_all`, `bf16x4_to_f32`), `kernels.cublas` (`gemm_cublas`,
# `cublas_available`), `layers.linear` (`linear`, `linear_path`,
# `LINEAR_GEMV_MAX_TOKENS`, `gemv_wins_up_to`) and `plots.roofline`.
#
# ## Exercises
#
# 1. Change `TILE` to 32 in rung 2 (1024 threads per block). Predict the change in
#    global traffic and in shared-memory traffic, then measure it with the bench script.
# 2. Remove the padding of the `ws` tile in rung 2 (`TILE + 1` → `TILE`). How many ways
#    does each shared-memory read of a warp now conflict? Measure.
# 3. In rung 3, replace `uint64(...)` in the inner loop's indices by plain integers,
#    compile to PTX and count the `selp` (select) instructions. What do they compute?
# 4. How many bytes does one GEMV of the LM head read, and how long must it take at the
#    bandwidth ceiling? Compare with the per-shape record in `book/data/ch06_gemm.json`.
# 5. With 16 token vectors, how many FLOPs per byte does a decoding step do? Where is
#    that on the roofline, and what limits the GEMV there? Find the token count at which
#    cuBLAS overtakes it in the recorded data (`gemv_wins_up_to`); then make the GEMV
#    faster at 2 to 4 tokens — a warp per group of 4 rows, say — and see how far the
#    switch moves.
# 6. Write `linear` for a `(num_tokens, in_features)` input in float32 (the residual
#    stream) by fusing the bf16 rounding into the GEMV's loads of $x$. What does it save
#    per step?
# 7. Add `16` to `GEMV_BUCKETS` and raise `GEMV_MAX_ACC` to 64. Compile the 16-token
#    block kernel to PTX (`cuda.compile_ptx`) and find the `.local` array; on a GPU,
#    time it against two passes of the 8-token kernel.
