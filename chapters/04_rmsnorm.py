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
# # 4. RMSNorm: many threads, one sum
#
# Every Llama layer normalises its input twice — before attention and before the MLP —
# and the model normalises once more before the output head: 33 times per forward pass
# of Llama 3.2 1B. Each normalisation reads a row of the residual stream (2,048 floats),
# sums its squares, and scales the row. The arithmetic is trivial; the interesting part
# is that *one sum* has to be computed by *many threads*. That is a **reduction**, the
# first cooperative algorithm in this book, and we will build it four times, each time a
# little faster, then make the memory traffic around it as cheap as it can be.
#
# In this chapter you will learn:
#
# - what RMSNorm computes, and why its sum of squares is accumulated in float32;
# - a ladder of reductions: one thread per row → a block per row with a shared-memory
#   tree and `cuda.syncthreads()` → warp shuffles → the row held in registers, read from
#   memory once;
# - how to fuse the residual add that precedes every normalisation into the same kernel,
#   and how many bytes that saves;
# - how numba compiles one kernel for a float32 or a bf16 output;
# - how to move a row in 8-byte words, and why the machine code, not the PTX, decides
#   how many loads a thread has in flight.
#
# It uses the bf16 helpers and the measuring tools of [chapter 1](01_bf16.py); chapter 3
# explains grids, blocks and threads ([chapter 3](03_first_kernel.py)).

# %%
#| default_exp kernels.rmsnorm

# %%
import math
import runpy
from pathlib import Path

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.measure import (
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
# ## The math
#
# RMSNorm (Zhang and Sennrich, 2019) divides a row $x \in \mathbb{R}^n$ by its root mean
# square and multiplies each element by a learned weight $w_i$:
#
# $$ y_i = \frac{x_i}{\sqrt{\frac{1}{n}\sum_{j=1}^{n} x_j^2 + \varepsilon}} \; w_i . $$
#
# Unlike LayerNorm it subtracts no mean and adds no bias. The small $\varepsilon$ keeps
# an all-zero row from dividing by zero; it is part of the model, read from
# `config.json` as `config.rms_norm_eps` (chapter 2's `ModelConfig`): $10^{-5}$ for both
# Llama 3.2 1B and SmolLM2, but other models use $10^{-6}$, so it is a parameter here,
# never a constant. The weight is bf16, stored as `uint16` bits like every weight in
# this book. The reference computes in float32, as Hugging Face's `LlamaRMSNorm` does:

# %%
#| export
import numpy as np

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of x (float32) times the bf16 weight (uint16 bits), in
    float32.
    """
    x = np.asarray(x, dtype=np.float32)
    # (num_rows, 1)
    mean_square = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    scale = np.float32(1.0) / np.sqrt(mean_square + np.float32(eps))
    return x * scale * bf16_bits_to_f32(weight)


def fused_add_rmsnorm_ref(
    residual: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
):
    """(residual + delta, rmsnorm(residual + delta) * weight): the new residual stream
    and its norm.
    """
    new_residual = np.asarray(residual, np.float32) + np.asarray(delta, np.float32)
    return new_residual, rmsnorm_ref(new_residual, weight, eps)


# %% [markdown]
# A quick look: after the norm every row has a root mean square of 1 (with unit
# weights), an all-zero row stays zero thanks to $\varepsilon$, and a NaN anywhere in a
# row makes the whole row NaN — which is what we want: a broken activation must not pass
# silently.

# %%
eps = 1e-5  # in the model: config.rms_norm_eps
ones = f32_to_bf16_bits(np.ones(6, np.float32))
demo = np.array(
    [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0], [1, np.nan, 1, 1, 1, 1]], np.float32
)
y = rmsnorm_ref(demo, ones, eps)
print(y)
assert np.isclose(np.sqrt(np.mean(y[0] ** 2)), 1.0, rtol=1e-4)
assert np.all(y[1] == 0) and np.all(np.isnan(y[2]))

# %% [markdown]
# ## Why the sum is accumulated in float32
#
# A row's sum of squares grows with its length, and each addend stays small. In a narrow
# format the running sum soon has an ulp (chapter 1) as large as the addends, and adding
# them stops changing it. bf16 has 8 significant bits: once the sum reaches 256 times a
# typical square, half of each addend rounds away. fp16 has 11 bits, so it lasts longer,
# but its largest value is 65,504 — a row of 2,048 values with an RMS of 6 already
# overflows it, and residual streams deep in a model are larger than that. Let us
# measure it: a loop in which one thread adds the squares of a row one by one, rounding
# the running sum to the format after every add (`np.cumsum` with a `dtype` does exactly
# that), against the float64 sum.


# %% tags=["hide-input"]
def relative_error_of_sum_of_squares(rows: np.ndarray, dtype) -> np.ndarray:
    """Worst relative error over the rows of a sequential sum of squares kept in
    `dtype`, for every prefix length.
    """
    # the inputs, exactly representable: only the arithmetic is judged
    values = rows.astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        # (num_rows, n)
        running = np.cumsum(values * values, axis=1, dtype=dtype).astype(np.float64)
    exact = np.cumsum(values.astype(np.float64) ** 2, axis=1)
    return np.max(np.abs(running - exact) / exact, axis=0)


row_length = 8192
# residual-stream-sized values
rows = rng.standard_normal((8, row_length)).astype(np.float32) * 4
lengths = np.arange(1, row_length + 1)
fig, ax = new_figure(width=8, height=3.4)
for name, dtype in [
    ("bf16", ml_dtypes.bfloat16),
    ("fp16", np.float16),
    ("float32", np.float32),
]:
    ax.plot(
        lengths,
        relative_error_of_sum_of_squares(rows, dtype),
        label=f"running sum in {name}",
    )
for n, label in [(576, "SmolLM2"), (2048, "Llama 3.2 1B")]:
    ax.axvline(n, color="gray", ls=":", lw=1)
    ax.text(n, 1.5e-8, f" {label}", color="gray", fontsize=8)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_ylim(1e-8, 2)
ax.set_xlabel("row length n")
ax.set_ylabel("relative error of sum of squares")
ax.set_title(
    "accumulating x² one by one (values ~ N(0, 4²); fp16 overflows where its curve "
    "ends)"
)
ax.legend(loc="lower left", bbox_to_anchor=(0.0, 0.2))
plt.show()

err_bf16 = relative_error_of_sum_of_squares(rows[:, :2048], ml_dtypes.bfloat16)[-1]
err_f32 = relative_error_of_sum_of_squares(rows[:, :2048], np.float32)[-1]
prose.glue("ch04_bf16_sum_error", f"{err_bf16:.0%}")
prose.glue("ch04_f32_sum_error", f"{err_f32:.0e}")
assert err_bf16 > 0.1 and err_f32 < 1e-5

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
At Llama's 2,048 the bf16 sum is off by {{ch04_bf16_sum_error}}; float32 is off by
{{ch04_f32_sum_error}}. So kernels read bf16 and write bf16 where they must, but always
accumulate in float32 — the rule that the matrix products of chapter 6 follow too. (A
tree of partial sums, as our kernels use below, is more accurate still than this
one-by-one loop: each value passes through about $\log_2 n$ additions instead of up to
$n$.)
""")

# %% [markdown]
# ## Rung 1: one thread per row
#
# The most direct kernel gives each row to one thread, which loops over the row twice:
# once to sum the squares, once to write the scaled values. Two things are wrong with
# it, and the rest of the chapter fixes them:
#
# - **Too few threads.** A prefill of 2,048 tokens is 2,048 threads: 64 warps on a GPU
#   with 132 multiprocessors, each of which can run 64 warps at a time. Fewer than 1% of
#   the GPU's warp slots are busy, and each thread walks 2,048 elements one after
#   another.
# - **Uncoalesced loads.** The 32 threads of a warp load together. Here thread $r$ reads
#   `x[r, i]`: 32 addresses 8 KB apart, 32 separate memory transactions for 128 useful
#   bytes. Coalesced loads — consecutive threads reading consecutive addresses — turn
#   the same 32 loads into one 128-byte transaction.
#
# Note the explicit `float32(...)`: a bare `0.0` is a float64 to numba, and the sum
# would silently be accumulated in double precision. The launcher hands `eps` to the
# kernel as a `float32` for the same reason.

# %% [markdown]
# The kernels of the ladder go to their own module, `kernels.rmsnorm_kernels`; the
# NumPy references above and the launchers at the end of the chapter, the functions a
# model calls, to `kernels.rmsnorm`.

# %%
#| export kernels.rmsnorm_kernels
import math

from numba import cuda, float32

from tinyvllm_lib.kernels.bf16 import bf16_to_f32
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


@cuda.jit
def rmsnorm_thread_per_row_kernel(x, weight, eps, out):
    wait_for_previous_kernel()
    row = cuda.grid(1)
    if row >= x.shape[0]:
        return
    num_cols = x.shape[1]
    sum_squares = float32(0.0)
    for i in range(num_cols):
        sum_squares += x[row, i] * x[row, i]
    scale = float32(1.0) / math.sqrt(sum_squares / float32(num_cols) + eps)
    for i in range(num_cols):
        out[row, i] = x[row, i] * scale * bf16_to_f32(weight[i])


# %% [markdown]
# ## Rung 2: a block per row, a tree in shared memory
#
# Now a whole block of threads works on one row. Thread $t$ of the block takes elements
# $t, t + B, t + 2B, \dots$ ($B$ threads per block), so a warp's loads are coalesced,
# and it sums their squares in a register. That leaves $B$ partial sums, one per thread,
# to be added up.
#
# Threads of a block share a small, fast on-chip memory: **shared memory**. Each thread
# writes its partial sum there; then, in $\log_2 B$ rounds, the first half of the active
# threads adds the second half's values to its own:
#
# $$ s_t \leftarrow s_t + s_{t + \text{stride}},
#    \qquad \text{stride} = B/2, B/4, \dots, 1, $$
#
# and $s_0$ holds the total. Between rounds every thread must wait until all others have
# written: `cuda.syncthreads()` is that barrier. Without it a thread may read a partial
# sum before its neighbour has stored it — a race that gives a wrong answer only
# sometimes. Every thread of the block must reach the barrier, so it is never placed
# inside a branch that some threads skip. The size of a shared array must be known at
# compile time: we reserve `MAX_THREADS` slots and the launcher uses a power of two up
# to that.
#
# After the sum, every thread walks its elements again to write $y$, reading the row a
# second time (from the L2 cache, with luck).

# %% [markdown]
# Here is the tree for a block of 16 threads: each row is a round, each arrow one thread
# adding a partner's partial sum to its own; the threads to the right of the arrows sit
# out the round, but still wait at its barrier.


# %%
def draw_tree(ax, num_threads: int = 16) -> None:
    """The shared-memory tree: each round, thread t < stride adds partial[t+stride]."""
    rounds = int(math.log2(num_threads))
    for r in range(rounds + 1):
        active = num_threads >> r  # partial sums still to be added after r rounds
        for t in range(num_threads):
            filled = t < active
            ax.add_patch(
                plt.Rectangle(
                    (t, -r), 0.8, 0.55, color="#1f77b4" if filled else "#eeeeee"
                )
            )
        if r < rounds:
            stride = active // 2
            for t in range(stride):
                ax.annotate(
                    "",
                    xy=(t + 0.4, -r - 0.45),
                    xytext=(t + stride + 0.4, -r),
                    arrowprops=dict(arrowstyle="->", color="#d62728", lw=0.8),
                )
        label = "partials" if r == 0 else f"stride {num_threads >> r}: barrier"
        ax.text(-0.4, -r + 0.27, label, ha="right", va="center", fontsize=7)
    ax.text(0.4, -rounds - 0.4, "s₀ = total", ha="left", va="top", fontsize=7)
    ax.set_xlim(-5, num_threads)
    ax.set_ylim(-rounds - 1, 1)
    ax.axis("off")


fig, ax = new_figure(width=7, height=2.4)
draw_tree(ax)
ax.set_title(
    "a block's tree in shared memory: log2(B) rounds, one barrier each", fontsize=9
)
plt.show()

# %%
#| export kernels.rmsnorm_kernels
MAX_THREADS = 1024  # the most threads a block can have


@cuda.jit
def rmsnorm_shared_tree_kernel(x, weight, eps, out):
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x  # a power of two
    num_cols = x.shape[1]
    partial = cuda.shared.array(MAX_THREADS, float32)
    sum_squares = float32(0.0)
    for i in range(tid, num_cols, num_threads):  # coalesced: neighbours read neighbours
        sum_squares += x[row, i] * x[row, i]
    partial[tid] = sum_squares
    cuda.syncthreads()
    stride = num_threads // 2
    while stride > 0:  # the tree: log2(num_threads) rounds
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()  # outside the `if`: every thread reaches every barrier
        stride //= 2
    scale = float32(1.0) / math.sqrt(partial[0] / float32(num_cols) + eps)
    for i in range(tid, num_cols, num_threads):
        out[row, i] = x[row, i] * scale * bf16_to_f32(weight[i])


# %% [markdown]
# ## Rung 3: warp shuffles
#
# The tree spends most of its rounds inside single warps: with 256 threads, 8 rounds and
# 8 barriers, of which the last 5 involve 32 threads or fewer. The 32 threads of a warp
# execute in lock step and can read each other's **registers** directly, with no shared
# memory and no barrier: `cuda.shfl_xor_sync(mask, value, m)` returns `value` as held by
# the lane whose index is this lane's XOR $m$. Five exchanges with $m = 16, 8, 4, 2, 1$
# — a *butterfly* — leave the warp's total in every lane.
#
# A block then needs only two levels: each warp reduces its own values, lane 0 of each
# warp writes the warp's sum to shared memory, **one** barrier, and every warp reduces
# those (at most 32) partial sums with another butterfly. Every thread ends up with the
# total; nobody waits for a broadcast.
#
# The simulator has no shuffles. So, chosen once at import like chapter 1's
# `bf16_to_f32`, its `shfl_xor` is the same exchange done through shared memory with two
# barriers — slower, but it computes the same thing, so CI tests the same reduction code
# the GPU runs. The device functions take a shared `scratch` array for that; on the GPU
# it is one unused slot. These helpers go to their own module, `kernels.reduce`:
# attention's softmax (chapter 7) reduces rows too.

# %% [markdown]
# The butterfly for 8 lanes (a warp has 32; the pattern is the same with two more
# rounds): in each round every lane swaps its value with the lane whose index differs
# in one bit, and adds. After $\log_2 8 = 3$ rounds every lane holds the total — no
# shared memory, no barrier, no lane idle.


# %%
def draw_butterfly(ax, num_lanes: int = 8) -> None:
    """Warp shuffles: in round r, lane i adds the value of lane i ^ (N >> (r+1))."""
    rounds = int(math.log2(num_lanes))
    for r in range(rounds + 1):
        for lane in range(num_lanes):
            ax.plot(lane, -r, "o", color="#1f77b4", markersize=7)
        if r < rounds:
            mask = num_lanes >> (r + 1)
            for lane in range(num_lanes):
                ax.plot(
                    [lane, lane ^ mask],
                    [-r, -r - 1],
                    color="#d62728",
                    lw=0.8,
                    alpha=0.7,
                )
            ax.text(-0.6, -r - 0.5, f"xor {mask}", ha="right", va="center", fontsize=7)
    ax.text(
        num_lanes - 0.5,
        -rounds,
        "every lane: the total",
        ha="left",
        va="center",
        fontsize=7,
    )
    ax.set_xlim(-2.5, num_lanes + 3.5)
    ax.set_ylim(-rounds - 0.5, 0.5)
    ax.axis("off")


fig, ax = new_figure(width=6, height=2.2)
draw_butterfly(ax)
ax.set_title("a warp's butterfly: shfl_xor_sync with masks 4, 2, 1", fontsize=9)
plt.show()

# %%
#| export kernels.reduce
from numba import config, cuda, float32

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF  # all 32 lanes take part

if config.ENABLE_CUDASIM:
    # the simulator exchanges values through shared memory: one slot per thread
    SHUFFLE_SCRATCH = 1024

    @cuda.jit(device=True)
    def shfl_xor(value, lane_mask, scratch):
        """Simulator: the value of the thread whose index is this one's XOR lane_mask,
        via shared memory.
        """
        tid = cuda.threadIdx.x
        cuda.syncthreads()  # everyone has read the previous exchange
        scratch[tid] = value
        cuda.syncthreads()
        return scratch[tid ^ lane_mask]

else:
    SHUFFLE_SCRATCH = 1  # unused on a GPU

    @cuda.jit(device=True)
    def shfl_xor(value, lane_mask, scratch):
        """The value of lane (this lane XOR lane_mask) of the same warp, register to
        register.
        """
        return cuda.shfl_xor_sync(FULL_MASK, value, lane_mask)


@cuda.jit(device=True)
def warp_sum(value, scratch):
    """Sum over the 32 lanes of a warp; every lane gets the total. Every thread of the
    block must call it.
    """
    lane_mask = WARP_SIZE // 2
    while lane_mask > 0:  # 16, 8, 4, 2, 1: the butterfly
        value += shfl_xor(value, lane_mask, scratch)
        lane_mask //= 2
    return value


@cuda.jit(device=True)
def block_sum(value, warp_sums, scratch):
    """Sum over a block (1-D, a multiple of 32 threads); every thread gets the total.
    warp_sums: shared float32[32].
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    value = warp_sum(value, scratch)
    if lane == 0:
        warp_sums[warp] = value
    cuda.syncthreads()
    num_warps = cuda.blockDim.x // WARP_SIZE
    value = warp_sums[lane] if lane < num_warps else float32(0.0)
    # every warp adds up the warp sums: no second barrier
    return warp_sum(value, scratch)


# %% [markdown]
# The kernel is rung 2 with the tree replaced by `block_sum`:

# %%
#| export kernels.rmsnorm_kernels
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, block_sum


@cuda.jit
def rmsnorm_warp_shuffle_kernel(x, weight, eps, out):
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    num_cols = x.shape[1]
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    sum_squares = float32(0.0)
    for i in range(tid, num_cols, num_threads):
        sum_squares += x[row, i] * x[row, i]
    total = block_sum(sum_squares, warp_sums, scratch)
    scale = float32(1.0) / math.sqrt(total / float32(num_cols) + eps)
    for i in range(tid, num_cols, num_threads):
        out[row, i] = x[row, i] * scale * bf16_to_f32(weight[i])


# %% [markdown]
# ## Rung 4: read the row once, keep it in registers
#
# Rungs 2 and 3 read every element twice: once for the sum, once for the output. The
# second read usually hits the L2 cache, but not always (a prefill of 2,048 rows is 16
# MB of activations) and it is still a second trip. Each thread handles only a few
# elements — with 2,048 columns and 256 threads, 8 — so it can simply **keep them**: a
# small `cuda.local.array` of `ITEMS_PER_THREAD` values. Because the loops over it have
# a constant trip count, the compiler unrolls them, every index becomes a constant, and
# the array lives in registers (the PTX has no `.local` memory — exercise 3 checks). The
# launcher picks the number of threads so that each thread has at most
# `ITEMS_PER_THREAD` elements: hidden sizes up to 8,192 fit in a 1,024-thread block.
#
# The unrolled loop is also meant to issue all eight loads before it needs any of them.
# That matters more than it seems: a load takes several hundred nanoseconds to return,
# and a memory system that moves 4 TB/s must have about
# $4\,\text{TB/s} \times 0.7\,\mu\text{s} \approx 3\,\text{MB}$ in flight at any moment
# (*Little's law*). Chapter 1's copy kept bytes in flight with 8-byte loads; here each
# thread is to keep eight 4-byte loads (and eight of the weight) in flight at once. For
# that the loads must come *before any store*: a store waits until its value has
# arrived, the instructions behind it wait for the store, and the compiler may not move
# a load above a store into an array that could, for all it knows, be the same memory.
# So the weights are loaded into registers in the first loop too, and the stores come
# last — the PTX then shows sixteen loads in a row, then the shuffles, then eight
# stores. (Whether the machine code that actually runs keeps the loads together is
# another question, which rung 6 asks.)
#
# This is also the rung that writes **bf16**: the normalised row is the input of a
# matrix product (the QKV or the gate/up projection), and those read bf16 activations.
# numba compiles a kernel once per combination of argument types, so one kernel serves
# both outputs if the *store* adapts to the type of `out`. On the GPU,
# `store_activation` is declared with numba's `overload`, which runs at compile time
# with the argument *types* and returns the implementation to compile: a plain store for
# float32, rounding through chapter 1's `f32_to_bf16` for `uint16`. The simulator runs
# Python, so there it is an ordinary `if`. Every later kernel that writes an
# activation stores it this way, so `store_activation` goes to a module of its own,
# `kernels.activation_store`, which rung 6's word helpers join below.

# %%
#| export kernels.activation_store
import numpy as np
from numba import config, cuda

from tinyvllm_lib.kernels.bf16 import f32_to_bf16

if config.ENABLE_CUDASIM:

    @cuda.jit(device=True)
    def store_activation(out, row, col, value):
        """Simulator: out[row, col] = value; rounded to bf16 bits when out holds
        uint16.
        """
        out[row, col] = f32_to_bf16(value) if out.dtype == np.uint16 else value

else:
    from numba import types
    from numba.cuda.extending import overload

    def store_activation(out, row, col, value):
        """out[row, col] = value (float32 out) or its bf16 bits (uint16 out); compiled
        per out type.
        """
        raise NotImplementedError("store_activation is called from kernels only")

    @overload(store_activation, target="cuda")
    def _store_activation(out, row, col, value):
        if out.dtype == types.uint16:

            def store_bf16(out, row, col, value):
                out[row, col] = f32_to_bf16(value)

            return store_bf16
        if out.dtype == types.float32:

            def store_f32(out, row, col, value):
                out[row, col] = value

            return store_f32


# %%
#| export kernels.rmsnorm_kernels
from tinyvllm_lib.kernels.activation_store import store_activation

ITEMS_PER_THREAD = 8  # elements of a row that each thread keeps in registers


@cuda.jit
def rmsnorm_kernel(x, weight, eps, out):
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    num_cols = x.shape[1]
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    # in registers: every index below is a constant
    values = cuda.local.array(ITEMS_PER_THREAD, float32)
    weights = cuda.local.array(ITEMS_PER_THREAD, float32)
    sum_squares = float32(0.0)
    for k in range(ITEMS_PER_THREAD):  # every load is issued before any store
        i = tid + k * num_threads
        v = float32(0.0)
        if i < num_cols:
            v = x[row, i]
            weights[k] = bf16_to_f32(weight[i])
        values[k] = v
        sum_squares += v * v
    total = block_sum(sum_squares, warp_sums, scratch)
    scale = float32(1.0) / math.sqrt(total / float32(num_cols) + eps)
    for k in range(ITEMS_PER_THREAD):
        i = tid + k * num_threads
        if i < num_cols:
            store_activation(out, row, i, values[k] * scale * weights[k])


# %% [markdown]
# ## Rung 5: fuse the residual add
#
# In a Llama layer a norm never comes alone. The output of attention (and of the MLP) is
# added to the residual stream, and the sum is normalised for the next block:
#
# $$ r \leftarrow r + \delta, \qquad y = \mathrm{RMSNorm}(r)\, w . $$
#
# As two kernels, the add reads $r$ and $\delta$ and writes $r$ (12 bytes per element in
# float32), then the norm reads $r$ again and writes $y$ (4 + 2 bytes for a bf16 $y$):
# 18 bytes. Fused, one kernel reads $r$ and $\delta$, writes the new $r$ and $y$: 14
# bytes, 22% less — and one launch instead of two. It is rung 4 with a different first
# loop; the new residual is written in place (each element by the thread that read it,
# so no other thread can see a half-updated row) and kept in registers for the norm. Its
# stores wait for a loop of their own, after all the loads, for the reason above.


# %%
#| export kernels.rmsnorm_kernels
@cuda.jit
def fused_add_rmsnorm_kernel(residual, delta, weight, eps, out):
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    num_cols = residual.shape[1]
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    values = cuda.local.array(ITEMS_PER_THREAD, float32)
    weights = cuda.local.array(ITEMS_PER_THREAD, float32)
    sum_squares = float32(0.0)
    for k in range(ITEMS_PER_THREAD):
        i = tid + k * num_threads
        v = float32(0.0)
        if i < num_cols:
            v = residual[row, i] + delta[row, i]
            weights[k] = bf16_to_f32(weight[i])
        values[k] = v
        sum_squares += v * v
    for k in range(ITEMS_PER_THREAD):  # only after every load has been issued
        i = tid + k * num_threads
        if i < num_cols:
            residual[row, i] = values[k]  # the new residual stream, in place
    total = block_sum(sum_squares, warp_sums, scratch)
    scale = float32(1.0) / math.sqrt(total / float32(num_cols) + eps)
    for k in range(ITEMS_PER_THREAD):
        i = tid + k * num_threads
        if i < num_cols:
            store_activation(out, row, i, values[k] * scale * weights[k])


_NORM_2D = "float32[:, ::1], uint16[::1], float32, {}[:, ::1]"
PTX_SIGNATURES = {
    "rmsnorm_thread_per_row_kernel": [f"void({_NORM_2D.format('float32')})"],
    "rmsnorm_shared_tree_kernel": [f"void({_NORM_2D.format('float32')})"],
    "rmsnorm_warp_shuffle_kernel": [f"void({_NORM_2D.format('float32')})"],
    "rmsnorm_kernel": [
        f"void({_NORM_2D.format('float32')})",
        f"void({_NORM_2D.format('uint16')})",
    ],
    "fused_add_rmsnorm_kernel": [
        "void(float32[:, ::1], float32[:, ::1], uint16[::1], float32, float32[:, ::1])",
        "void(float32[:, ::1], float32[:, ::1], uint16[::1], float32, uint16[:, ::1])",
    ],
}

# %% [markdown]
# ## Rung 6: wide loads and stores
#
# Rung 5 moves every byte in the smallest piece it can: a thread loads one 4-byte float
# at a time and, with a bf16 output, stores one 2-byte value at a time. Chapter 1 saw
# what that costs: its copy kernel is slower with 4-byte words than with 8-byte ones,
# and its widening kernel, with 2-byte loads, falls far short of the ceiling. Keeping
# memory busy takes many bytes in flight, not many tiny requests. So rung 6 moves the
# row in 8-byte **words**, each holding a *pair* of neighbouring elements:
#
# - the float32 rows are viewed as `uint64` (`residual.view(np.uint64)`, shape
#   `(num_rows, hidden / 2)`): word $j$ holds element $2j$ in its low half (the lower
#   address) and element $2j + 1$ in its high half;
# - the bf16 weight is viewed as `uint32`: word $j$ holds the two weights of the same
#   pair;
# - the new residual is stored as `uint64` words, and so is a float32 output; a bf16
#   output packs its pair into one `uint32`, $b_{2j} + 2^{16} b_{2j+1}$.
#
# No arithmetic turns a word into floats: the two halves of a `uint64` *are* the two
# float32 bit patterns, and `cuda.libdevice.int_as_float` reinterprets each half (a
# register move, not a conversion); `float_as_int` goes back. The simulator has no
# libdevice, so there NumPy reinterprets the word with `.view`, chosen at import as in
# chapter 1. Masks and shifts use typed constants, `uint64(32)` rather than `32`: numba
# types a bare integer literal as a signed 64-bit integer, and mixing it with an
# unsigned word changes the type of the result. Which store a kernel compiles is
# decided, as in rung 4, by the type of `out`: `uint64` words mean float32 pairs,
# `uint32` words bf16 pairs.
#
# **Loads without an `if`.** Rung 4 promised that its unrolled loop issues every load
# before it needs any, and its PTX shows them in a row. But PTX is not what the GPU
# runs: `ptxas` compiles it to machine code (SASS), and there each load of rung 5 still
# sits inside its `if i < num_cols` block, followed in that block by the add that needs
# its value. A warp issues its instructions in order, so it stops at the add until the
# load has returned, and only then reaches the next block's loads: a thread of rung 5
# makes its eight trips to memory one after another. Rung 6 takes the loads out of the
# `if`s. A slot past the end of the row loads the row's last word instead (the index is
# clamped with `min`) and replaces the value with zero by a select, which is not a
# branch; the loads are then straight-line code, which `ptxas` is free to issue many at
# a time (exercise 6 reads the SASS). Only the stores stay behind `if`s, and a store
# does not wait for memory.
#
# **Which words a thread owns.** Each warp takes a stretch of `32 * WIDE_WORDS`
# consecutive words, and lane $l$ of it takes words $l, l + 32, l + 64, \dots$ of the
# stretch. Every load instruction of a warp then reads 32 consecutive words, 256 bytes,
# and the distance between one thread's words is a constant 256 bytes, which the
# compiler writes into the store instructions (`st.global.u64 [%rd4+256]`) instead of
# computing and keeping one address per word. For the same reason the kernel takes each
# row as a 1-D view (`residual64[row]`) and counts with unsigned `uint64` indices: numba
# then skips its test for negative indices (Python's `a[-1]`), which costs instructions
# and registers at every access.
#
# **How many threads.** What limits how many rows a multiprocessor works on at once is
# its 65,536 registers, shared by all the threads resident on it. Every thread needs
# some for itself — addresses, indices, its partial sum — however few elements it holds,
# so fewer threads holding more elements each fit more rows into the same registers.
# Rung 6 gives each thread `WIDE_WORDS = 8` words, 16 elements: a row of 2,048 takes a
# block of **128** threads, four warps, where rung 5 took 256 threads of 8 elements.
# `wide_block_threads` takes the fewest whole warps that cover the row (64 threads for
# SmolLM2's 576, 256 for 4,096). More words per thread is not free: the registers per
# thread grow with them and `ptxas` spreads the loads over more batches; exercise 7
# measures 4 and 16. The benchmark below records each kernel's registers per thread and
# how many of its blocks fit on a multiprocessor.
#
# The views exist when a row is a whole number of words — `hidden` even — and every
# buffer starts on an 8-byte boundary (`cuda.device_array` returns 256-byte aligned
# memory, so only a buffer cut out of a larger one at an odd offset misses it); every
# row then starts on a word boundary too, in the float32 arrays and in a bf16 output.
# Otherwise the launchers fall back to rung 4 or 5.
#
# The helpers that pack and unpack the words, and `store_pair`, which writes a pair as
# float32 or bf16 as `store_activation` writes one value, join `store_activation` in
# `kernels.activation_store` (chapter 6's GEMV reads float32 pairs with
# `unpack_f32_pair` too); the kernels go to `kernels.rmsnorm_kernels`.

# %%
#| export kernels.activation_store
from numba import int32, uint32, uint64

if config.ENABLE_CUDASIM:

    @cuda.jit(device=True)
    def unpack_f32_pair(word):
        """Simulator: the two float32 values in a uint64 word, the lower address first
        (NumPy reinterprets).
        """
        pair = np.array([word], np.uint64).view(np.float32)
        return pair[0], pair[1]

    @cuda.jit(device=True)
    def pack_f32_pair(first, second):
        """Simulator: two float32 values as one uint64 word, `first` at the lower
        address.
        """
        return np.array([first, second], np.float32).view(np.uint64)[0]

else:

    @cuda.jit(device=True)
    def unpack_f32_pair(word):
        """The two float32 values in a uint64 word, its low half (the lower address)
        first: reinterpreted, not converted.
        """
        first = cuda.libdevice.int_as_float(int32(uint32(word & uint64(0xFFFFFFFF))))
        second = cuda.libdevice.int_as_float(int32(uint32(word >> uint64(32))))
        return first, second

    @cuda.jit(device=True)
    def pack_f32_pair(first, second):
        """Two float32 values as one uint64 word, `first` in the low half (the lower
        address).
        """
        low = uint64(uint32(cuda.libdevice.float_as_int(first)))
        return low | (uint64(uint32(cuda.libdevice.float_as_int(second))) << uint64(32))


@cuda.jit(device=True)
def pack_bf16_pair(first, second):
    """Two float32 values rounded to bf16 and packed in one uint32 word, `first` in the
    low half.
    """
    return uint32(f32_to_bf16(first)) | (uint32(f32_to_bf16(second)) << uint32(16))


if config.ENABLE_CUDASIM:

    @cuda.jit(device=True)
    def store_pair(out_row, j, first, second):
        """Simulator: out_row[j] = the pair as a uint64 word (float32 out) or a uint32
        word (bf16 out).
        """
        out_row[j] = (
            pack_f32_pair(first, second)
            if out_row.dtype == np.uint64
            else pack_bf16_pair(first, second)
        )

else:
    from numba import types
    from numba.cuda.extending import overload

    def store_pair(out_row, j, first, second):
        """out_row[j] = the pair as one word: two float32 (uint64 out) or two bf16
        (uint32 out); compiled per out type.
        """
        raise NotImplementedError("store_pair is called from kernels only")

    @overload(store_pair, target="cuda")
    def _store_pair(out_row, j, first, second):
        if out_row.dtype == types.uint64:

            def store_f32_pair(out_row, j, first, second):
                out_row[j] = pack_f32_pair(first, second)

            return store_f32_pair
        if out_row.dtype == types.uint32:

            def store_bf16_pair(out_row, j, first, second):
                out_row[j] = pack_bf16_pair(first, second)

            return store_bf16_pair


# %%
#| export kernels.rmsnorm_kernels
from numba import uint32, uint64

from tinyvllm_lib.kernels.activation_store import (
    pack_f32_pair,
    store_pair,
    unpack_f32_pair,
)

WIDE_WORDS = 8  # 8-byte words (float32 pairs) of a row that each thread of rung 6 keeps
WIDE_ITEMS = 2 * WIDE_WORDS  # the same, in elements: 16
WARP_WORDS = WARP_SIZE * WIDE_WORDS  # the consecutive words one warp takes: 256


@cuda.jit(device=True)
def first_word():
    """The first word of a row this thread takes: its warp's stretch of WARP_WORDS, plus
    its lane.
    """
    tid = uint64(cuda.threadIdx.x)
    return (tid // uint64(WARP_SIZE)) * uint64(WARP_WORDS) + tid % uint64(WARP_SIZE)


@cuda.jit
def rmsnorm_wide_kernel(x64, weight32, eps, out):
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    x_row, out_row = x64[row], out[row]  # 1-D views of this row, in words
    num_words = uint64(x64.shape[1])  # hidden / 2: word j holds elements 2j and 2j + 1
    start = first_word()
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    # in registers: every index below is a constant
    values = cuda.local.array(WIDE_ITEMS, float32)
    weights = cuda.local.array(WIDE_WORDS, uint32)  # bf16 pairs, widened when used
    sum_squares = float32(0.0)
    # every load is issued before any store, and none behind an `if`
    for k in range(WIDE_WORDS):
        # a warp loads 32 consecutive words: 256 bytes
        j = start + uint64(k * WARP_SIZE)
        is_in_row = j < num_words
        # past the end: load the last word again, ignore it
        j = min(j, num_words - uint64(1))
        first, second = unpack_f32_pair(x_row[j])
        weights[k] = weight32[j]
        first = first if is_in_row else float32(0.0)
        second = second if is_in_row else float32(0.0)
        values[2 * k] = first
        values[2 * k + 1] = second
        sum_squares += first * first + second * second
    total = block_sum(sum_squares, warp_sums, scratch)
    scale = float32(1.0) / math.sqrt(total / float32(2 * x64.shape[1]) + eps)
    for k in range(WIDE_WORDS):
        j = start + uint64(k * WARP_SIZE)
        if j < num_words:
            w = weights[k]
            store_pair(
                out_row,
                j,
                values[2 * k] * scale * bf16_to_f32(w & uint32(0xFFFF)),
                values[2 * k + 1] * scale * bf16_to_f32(w >> uint32(16)),
            )


@cuda.jit
def fused_add_rmsnorm_wide_kernel(residual64, delta64, weight32, eps, out):
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    residual_row, delta_row, out_row = residual64[row], delta64[row], out[row]
    num_words = uint64(residual64.shape[1])
    start = first_word()
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    values = cuda.local.array(WIDE_ITEMS, float32)
    weights = cuda.local.array(WIDE_WORDS, uint32)
    sum_squares = float32(0.0)
    for k in range(WIDE_WORDS):
        j = start + uint64(k * WARP_SIZE)
        is_in_row = j < num_words
        j = min(j, num_words - uint64(1))
        r_first, r_second = unpack_f32_pair(residual_row[j])
        d_first, d_second = unpack_f32_pair(delta_row[j])
        weights[k] = weight32[j]
        first = r_first + d_first if is_in_row else float32(0.0)
        second = r_second + d_second if is_in_row else float32(0.0)
        values[2 * k] = first
        values[2 * k + 1] = second
        sum_squares += first * first + second * second
    for k in range(WIDE_WORDS):  # only after every load has been issued
        j = start + uint64(k * WARP_SIZE)
        if j < num_words:
            # the new residual, in place
            residual_row[j] = pack_f32_pair(values[2 * k], values[2 * k + 1])
    total = block_sum(sum_squares, warp_sums, scratch)
    scale = float32(1.0) / math.sqrt(total / float32(2 * residual64.shape[1]) + eps)
    for k in range(WIDE_WORDS):
        j = start + uint64(k * WARP_SIZE)
        if j < num_words:
            w = weights[k]
            store_pair(
                out_row,
                j,
                values[2 * k] * scale * bf16_to_f32(w & uint32(0xFFFF)),
                values[2 * k + 1] * scale * bf16_to_f32(w >> uint32(16)),
            )


_WIDE_OUT = ("uint64", "uint32")  # float32 pairs, bf16 pairs
PTX_SIGNATURES["rmsnorm_wide_kernel"] = [
    f"void(uint64[:, ::1], uint32[::1], float32, {o}[:, ::1])" for o in _WIDE_OUT
]
PTX_SIGNATURES["fused_add_rmsnorm_wide_kernel"] = [
    f"void(uint64[:, ::1], uint64[:, ::1], uint32[::1], float32, {o}[:, ::1])"
    for o in _WIDE_OUT
]


# %% [markdown]
# ## The launchers
#
# One launcher per job, with the ladder's rungs selectable by name so that the tests and
# the benchmark can run each. They check everything a kernel cannot — dtypes, shapes,
# contiguity, $\varepsilon$ — and raise before launching, pick the block size, and write
# into the caller's `out`. `eps` comes in as a Python float (from `config.rms_norm_eps`)
# and goes to the kernel as a float32. By default both launchers take rung 6 and fall
# back to rung 4 (`rmsnorm`) or rung 5 (`fused_add_rmsnorm`) when the rows cannot be
# viewed as 8-byte words; `variant=` picks a rung by name.

# %%
#| export
import math

from tinyvllm_lib.kernels.checks import device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.reduce import WARP_SIZE
from tinyvllm_lib.kernels.rmsnorm_kernels import (
    ITEMS_PER_THREAD,
    MAX_THREADS,
    WARP_WORDS,
    WIDE_ITEMS,
    fused_add_rmsnorm_kernel,
    fused_add_rmsnorm_wide_kernel,
    rmsnorm_kernel,
    rmsnorm_shared_tree_kernel,
    rmsnorm_thread_per_row_kernel,
    rmsnorm_warp_shuffle_kernel,
    rmsnorm_wide_kernel,
)

RMSNORM_VARIANTS = {
    "thread_per_row": rmsnorm_thread_per_row_kernel,
    "shared_tree": rmsnorm_shared_tree_kernel,
    "warp_shuffle": rmsnorm_warp_shuffle_kernel,
    "registers": rmsnorm_kernel,
    "wide": rmsnorm_wide_kernel,
}
FUSED_VARIANTS = ("registers", "wide")  # rung 5, rung 6


def _check_rows(name: str, what: str, a, shape=None, dtypes=(np.float32,)):
    if a.dtype not in dtypes:
        raise TypeError(
            f"{name}: {what} must be "
            f"{' or '.join(np.dtype(d).name for d in dtypes)}, got {a.dtype}"
        )
    if a.ndim != 2 or (shape is not None and tuple(a.shape) != tuple(shape)):
        raise ValueError(
            f"{name}: {what} must be 2-D (num_rows, "
            f"hidden){'' if shape is None else f' = {tuple(shape)}'}, got "
            f"{tuple(a.shape)}"
        )
    if not is_c_contiguous(a):
        raise ValueError(f"{name}: {what} must be C-contiguous")


def check_weight_eps(name: str, weight, hidden: int, eps) -> np.float32:
    """The norm's weight (bf16 bits, hidden long) and eps (positive, finite), as
    float32: the checks of every norm launcher, chapter 6's fused GEMV's too.
    """
    if weight.dtype != np.uint16:
        raise TypeError(
            f"{name}: weight must hold bf16 bits as uint16, got {weight.dtype}"
        )
    if weight.ndim != 1 or weight.shape[0] != hidden or not is_c_contiguous(weight):
        raise ValueError(
            f"{name}: weight must be contiguous 1-D of length hidden = {hidden}, got "
            f"{tuple(weight.shape)}"
        )
    if not (
        isinstance(eps, (float, int, np.floating)) and math.isfinite(eps) and eps > 0
    ):
        raise ValueError(
            f"{name}: eps must be a positive number (config.rms_norm_eps), got {eps!r}"
        )
    return np.float32(eps)


def block_threads(hidden: int, threads_per_block: int | None = None) -> int:
    """Threads per block for a row of `hidden` elements: a power of two, 32..1024, at
    most ITEMS_PER_THREAD each.
    """
    if hidden > MAX_THREADS * ITEMS_PER_THREAD:
        raise ValueError(
            f"hidden size {hidden} is over {MAX_THREADS * ITEMS_PER_THREAD} = "
            "MAX_THREADS * ITEMS_PER_THREAD"
        )
    need = max(WARP_SIZE, -(-hidden // ITEMS_PER_THREAD))
    auto = 1 << (need - 1).bit_length()  # the next power of two
    if threads_per_block is None:
        return auto
    if (
        threads_per_block & (threads_per_block - 1)
        or not auto <= threads_per_block <= MAX_THREADS
    ):
        raise ValueError(
            f"threads_per_block must be a power of two from {auto} to {MAX_THREADS} "
            f"for hidden {hidden}, got {threads_per_block}"
        )
    return threads_per_block


def wide_block_threads(hidden: int, threads_per_block: int | None = None) -> int:
    """Threads per block for rung 6: the fewest whole warps that cover hidden / 2 words,
    WIDE_WORDS per thread (128 for 2,048).
    """
    if hidden > MAX_THREADS * WIDE_ITEMS:
        raise ValueError(
            f"hidden size {hidden} is over {MAX_THREADS * WIDE_ITEMS} = MAX_THREADS "
            "* WIDE_ITEMS"
        )
    # one warp per WARP_WORDS words
    auto = max(1, -(-(hidden // 2) // WARP_WORDS)) * WARP_SIZE
    if threads_per_block is None:
        return auto
    if threads_per_block % WARP_SIZE or not auto <= threads_per_block <= MAX_THREADS:
        raise ValueError(
            f"threads_per_block must be a multiple of {WARP_SIZE} from {auto} to "
            f"{MAX_THREADS} for hidden {hidden}, got {threads_per_block}"
        )
    return threads_per_block


def can_go_wide(rows, *others) -> bool:
    """Rung 6 applies: rows (num_rows, hidden) of whole 8-byte words (hidden even,
    2..MAX_THREADS * WIDE_ITEMS), every buffer 8-byte aligned.
    """
    hidden = rows.shape[1]
    return (
        hidden % 2 == 0
        and 2 <= hidden <= MAX_THREADS * WIDE_ITEMS
        and all(device_pointer(a) % 8 == 0 for a in (rows, *others))
    )


def _words(out):
    """out as rung 6 writes it: float32 rows as uint64 words (pairs), bf16 rows as
    uint32 words (pairs).
    """
    return out.view(np.uint64 if out.dtype == np.float32 else np.uint32)


def rmsnorm(
    x,
    weight,
    eps: float,
    out,
    stream=0,
    variant: str = "wide",
    threads_per_block: int | None = None,
):
    """out = RMSNorm(x) * weight, row by row. x: float32 (num_rows, hidden); out:
    float32, or uint16 (bf16) for 'registers' and 'wide'.

    'wide' (rung 6) falls back to 'registers' (rung 4) when the rows are not whole
    8-byte words (see can_go_wide).
    """
    if variant not in RMSNORM_VARIANTS:
        raise ValueError(
            f"rmsnorm: variant must be one of {list(RMSNORM_VARIANTS)}, got {variant!r}"
        )
    _check_rows("rmsnorm", "x", x)
    out_dtypes = (
        (np.float32, np.uint16) if variant in ("registers", "wide") else (np.float32,)
    )
    _check_rows("rmsnorm", "out", out, x.shape, out_dtypes)
    eps32 = check_weight_eps("rmsnorm", weight, x.shape[1], eps)
    num_rows = x.shape[0]
    if variant == "wide" and can_go_wide(x, weight, out):
        threads = wide_block_threads(x.shape[1], threads_per_block)
        if num_rows > 0:
            rmsnorm_wide_kernel[num_rows, threads, stream](
                x.view(np.uint64), weight.view(np.uint32), eps32, _words(out)
            )
        return out
    if variant == "wide":
        variant = "registers"  # the fallback
    threads = block_threads(x.shape[1], threads_per_block)
    if num_rows == 0:
        return out
    if variant == "thread_per_row":
        rmsnorm_thread_per_row_kernel[(num_rows + 127) // 128, 128, stream](
            x, weight, eps32, out
        )
    else:
        RMSNORM_VARIANTS[variant][num_rows, threads, stream](x, weight, eps32, out)
    return out


def fused_add_rmsnorm(
    residual,
    delta,
    weight,
    eps: float,
    out,
    stream=0,
    threads_per_block: int | None = None,
    variant: str = "wide",
):
    """residual += delta (in place); out = RMSNorm(residual) * weight. float32 rows; out
    float32 or uint16 (bf16).

    variant 'wide' (rung 6) falls back to 'registers' (rung 5) when the rows are not
    whole 8-byte words (see can_go_wide).
    """
    if variant not in FUSED_VARIANTS:
        raise ValueError(
            f"fused_add_rmsnorm: variant must be one of {list(FUSED_VARIANTS)}, got "
            f"{variant!r}"
        )
    _check_rows("fused_add_rmsnorm", "residual", residual)
    _check_rows("fused_add_rmsnorm", "delta", delta, residual.shape)
    _check_rows(
        "fused_add_rmsnorm", "out", out, residual.shape, (np.float32, np.uint16)
    )
    eps32 = check_weight_eps("fused_add_rmsnorm", weight, residual.shape[1], eps)
    num_rows = residual.shape[0]
    if variant == "wide" and can_go_wide(residual, delta, weight, out):
        threads = wide_block_threads(residual.shape[1], threads_per_block)
        if num_rows > 0:
            fused_add_rmsnorm_wide_kernel[num_rows, threads, stream](
                residual.view(np.uint64),
                delta.view(np.uint64),
                weight.view(np.uint32),
                eps32,
                _words(out),
            )
        return out
    threads = block_threads(residual.shape[1], threads_per_block)
    if num_rows > 0:
        fused_add_rmsnorm_kernel[num_rows, threads, stream](
            residual, delta, weight, eps32, out
        )
    return out


# %% [markdown]
# ## Test every rung against the reference
#
# Fresh random rows, a width that is not a multiple of the block size, an odd width that
# rung 6 cannot view as words (the launchers fall back to rungs 4 and 5), a poisoned
# output, and three special rows: all zeros (ε at work), one NaN (the whole row must be
# NaN, and only that row), and huge values (their squares overflow fp16 but not
# float32). The tolerance: float32 results that differ only in the order of additions
# agree to a few ulps, so we ask for a relative error below $10^{-5}$; bf16 outputs may
# differ by one bf16 ulp where the float32 value lies near a rounding boundary. In the
# simulator the shapes are tiny; on a GPU we check Llama 3.2 1B's: 2,048 tokens of
# 2,048.


# %%
def random_rows(num_rows: int, hidden: int) -> np.ndarray:
    x = rng.standard_normal((num_rows, hidden)).astype(np.float32) * np.float32(
        rng.uniform(0.1, 10)
    )
    if num_rows >= 4:  # special rows, and at least one ordinary one
        x[0] = 0.0  # all zeros: eps keeps it finite
        x[1, hidden // 3] = np.nan  # one NaN poisons its row only
        x[2] *= np.float32(1e4)  # squares overflow fp16, not float32
    return x


def random_weight(hidden: int) -> np.ndarray:
    return f32_to_bf16_bits(rng.uniform(0.5, 1.5, hidden).astype(np.float32))


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaNs in different places"
    ok = ~np.isnan(want)
    err = np.max(
        np.abs(got[ok] - want[ok]) / np.maximum(np.abs(want[ok]), 1e-30), initial=0.0
    )
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


def check_rmsnorm(
    num_rows: int, hidden: int, variant: str, out_dtype=np.float32, threads=None
) -> None:
    x, w = random_rows(num_rows, hidden), random_weight(hidden)
    out = cuda.to_device(
        np.full((num_rows, hidden), 0xBEEF, np.uint16)
        if out_dtype == np.uint16
        else np.full((num_rows, hidden), -7.0, np.float32)
    )
    rmsnorm(
        cuda.to_device(x),
        cuda.to_device(w),
        eps,
        out,
        variant=variant,
        threads_per_block=threads,
    )
    want = rmsnorm_ref(x, w, eps)
    if out_dtype == np.uint16:
        assert_close(
            bf16_bits_to_f32(out.copy_to_host()),
            bf16_bits_to_f32(f32_to_bf16_bits(want)),
            rtol=2**-7,
        )
    else:
        assert_close(out.copy_to_host(), want)


def check_fused(
    num_rows: int,
    hidden: int,
    out_dtype=np.float32,
    threads=None,
    variant: str = "wide",
) -> None:
    residual, delta, w = (
        random_rows(num_rows, hidden),
        random_rows(num_rows, hidden)[::-1].copy(),
        random_weight(hidden),
    )
    d_residual = cuda.to_device(residual)
    out = cuda.to_device(
        np.full((num_rows, hidden), 0xBEEF, np.uint16)
        if out_dtype == np.uint16
        else np.full((num_rows, hidden), -7.0, np.float32)
    )
    fused_add_rmsnorm(
        d_residual,
        cuda.to_device(delta),
        cuda.to_device(w),
        eps,
        out,
        threads_per_block=threads,
        variant=variant,
    )
    want_residual, want = fused_add_rmsnorm_ref(residual, delta, w, eps)
    assert np.array_equal(d_residual.copy_to_host(), want_residual, equal_nan=True), (
        "residual add is not exact"
    )
    got = out.copy_to_host()
    if out_dtype == np.uint16:
        assert_close(
            bf16_bits_to_f32(got), bf16_bits_to_f32(f32_to_bf16_bits(want)), rtol=2**-7
        )
    else:
        assert_close(got, want)


if can_launch():
    shapes = (
        [(5, 300, 64), (4, 77, None)]
        if is_simulator()
        else [(2048, 2048, None), (37, 1000, None), (37, 1001, None), (4, 4096, 1024)]
    )
    for num_rows, hidden, threads in shapes:
        for variant in RMSNORM_VARIANTS:
            check_rmsnorm(num_rows, hidden, variant, threads=threads)
        for variant in ("registers", "wide"):  # the rungs that can write bf16
            check_rmsnorm(num_rows, hidden, variant, np.uint16, threads)
        for variant in FUSED_VARIANTS:
            check_fused(num_rows, hidden, np.float32, threads, variant)
            check_fused(num_rows, hidden, np.uint16, threads, variant)
    print(f"every rung agrees with rmsnorm_ref on {shapes} (rows, hidden, threads)")
    assert any(not can_go_wide(np.zeros((1, h), np.float32)) for _, h, _ in shapes), (
        "no shape tests the fallback"
    )
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernels")

# %% [markdown]
# And bad input is refused before anything runs:

# %%
x4, w4 = np.zeros((2, 4), np.float32), np.zeros(4, np.uint16)
for args in [
    (x4.astype(np.float64), w4, eps, np.zeros((2, 4), np.float32)),  # wrong dtype
    (x4, w4[:3], eps, np.zeros((2, 4), np.float32)),  # weight of the wrong length
    (x4, w4, eps, np.zeros((2, 5), np.float32)),  # out of the wrong shape
    (x4, w4, 0.0, np.zeros((2, 4), np.float32)),  # eps must be positive
]:
    try:
        rmsnorm(*args)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad input was accepted")

# %% [markdown]
# ## How fast? Count the bytes first
#
# RMSNorm does about 4 floating-point operations per element and moves 8 to 16 bytes, so
# it is memory-bound by a factor of a hundred: its floor is the compulsory bytes over
# the bandwidth ceiling measured in chapter 1. For the fused kernel per element: read
# the residual and $\delta$ (4 + 4 bytes), write the residual (4) and $y$ (4 in float32,
# 2 in bf16); the bf16 weight row (4 KB) is read by every block but comes from the
# cache, so it counts once.

# %% tags=["hide-input"]
hidden, prefill_tokens = 2048, 2048  # Llama 3.2 1B: hidden_size; a long prompt
ceiling_gbs, ceiling_name = bandwidth_ceiling()  # chapter 1's best rate


def fused_bytes(num_rows: int, hidden: int, out_itemsize: int) -> int:
    """Compulsory bytes of the fused add + norm: read residual, delta; write residual,
    out; the weight once.
    """
    return num_rows * hidden * (4 + 4 + 4 + out_itemsize) + hidden * 2


for out_name, itemsize in [("float32", 4), ("bf16", 2)]:
    nbytes = fused_bytes(prefill_tokens, hidden, itemsize)
    print(
        f"fused add + norm, {prefill_tokens}x{hidden}, {out_name} out: "
        f"{nbytes / 2**20:.1f} MiB"
        + (
            f" -> at least {nbytes / ceiling_gbs / 1e3:.1f} µs at the ceiling"
            if ceiling_name
            else ""
        )
    )
predicted_us = fused_bytes(prefill_tokens, hidden, 2) / ceiling_gbs / 1e3
prose.glue(
    "ch04_predicted_us",
    f"{predicted_us:.1f} µs" if ceiling_name else "(not yet measured)",
)
prose.glue("ch04_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))
# a decode step: one row per sequence, 1 to 256 sequences
decode_bytes = [fused_bytes(rows, hidden, 2) for rows in (1, 256)]
prose.glue("ch04_decode_bytes", f"{decode_bytes[0] / 1e3:.0f} KB to "
           f"{decode_bytes[1] / 1e6:.1f} MB")
prose.glue(
    "ch04_decode_ceiling_time",
    f"{decode_bytes[0] / ceiling_gbs:.0f} ns to "
    f"{decode_bytes[1] / ceiling_gbs / 1e3:.1f} µs"
    if ceiling_name
    else "(not yet measured)",
)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
At {{ch04_ceiling}}, the fused kernel with a bf16 output cannot take less than
{{ch04_predicted_us}} for a 2,048-token prefill. A decode step normalises one row per
sequence: 1 to 256 rows, {{ch04_decode_bytes}}, which would move at the ceiling in
{{ch04_decode_ceiling_time}}: no more than a few round trips to
memory, each several hundred nanoseconds. Those kernels are bounded by latency instead —
launching a block, the round trips of a load, the barriers of a reduction — so for them
we report microseconds, not a fraction of bandwidth.
""")

# %% [markdown]
# The measurement is `bench/ch04_rmsnorm.py`: every rung at 2,048 rows, the fused
# kernels of rungs 5 and 6 with both outputs, and decode sizes, each timed inside a CUDA
# graph over enough buffers to miss the L2 cache (chapter 1), each verified against
# `rmsnorm_ref` first. Each record also notes the kernel's block size, its registers per
# thread, and how many of its blocks — rows — the driver fits on one multiprocessor at a
# time. On a GPU it runs here and rewrites `book/data/ch04_rmsnorm.json`; elsewhere we
# plot that file.

# %% tags=["hide-input"]
if has_gpu():
    bench = (
        Path("../bench/ch04_rmsnorm.py")
        if Path("../bench").exists()
        else Path("bench/ch04_rmsnorm.py")
    )
    runpy.run_path(str(bench), run_name="__main__")

records = load_records("ch04_rmsnorm")
print(f"{len(records)} recorded measurements")
device_name = records[0]["device"]["name"] if records else None
ceiling_gbs, ceiling_name = bandwidth_ceiling(device_name)
print(records_table(records, time_key="us", ceiling=ceiling_gbs))


# %% tags=["hide-input"]
def find(name: str, num_rows: int) -> dict | None:
    return next(
        (r for r in records if r["name"] == name and r["shape"][0] == num_rows), None
    )


def glue_ratio(key: str, record: dict | None) -> None:
    """A record's rate as a share of the ceiling, computed now (not its stored
    ratio)."""
    share = record and ceiling_name and f"{record['value'] / ceiling_gbs:.0%}"
    prose.glue(key, share or "(not yet measured)")


def glue_us(key: str, record: dict | None) -> None:
    prose.glue(key, f"{record['us']:.1f} µs" if record else "(not yet measured)")


def glue_fact(key: str, record: dict | None, fact: str) -> None:
    prose.glue(
        key, str(record[fact]) if record and fact in record else "(not yet measured)"
    )


fused_bf16, fused_f32 = (
    find("fused_add_rmsnorm_bf16", prefill_tokens),
    find("fused_add_rmsnorm_f32", prefill_tokens),
)
wide_bf16, wide_f32 = (
    find("fused_add_rmsnorm_wide_bf16", prefill_tokens),
    find("fused_add_rmsnorm_wide_f32", prefill_tokens),
)
naive = find("rmsnorm_thread_per_row", prefill_tokens)
decode_1 = find("fused_add_rmsnorm_wide_bf16", 1) or find("fused_add_rmsnorm_bf16", 1)
prose.glue(
    "ch04_device", records[0]["device"]["name"] if records else "GPU (not yet measured)"
)
prose.glue("ch04_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))
glue_ratio("ch04_naive", naive)
glue_ratio("ch04_fused_bf16", fused_bf16)
glue_ratio("ch04_fused_f32", fused_f32)
glue_us("ch04_fused_us", fused_bf16)
glue_ratio("ch04_wide_bf16", wide_bf16)
glue_ratio("ch04_wide_f32", wide_f32)
glue_us("ch04_wide_us", wide_bf16)
glue_us("ch04_decode_us", decode_1)
# rung 5 and rung 6, bf16 out
for key, record in [("fused", fused_bf16), ("wide", wide_bf16)]:
    glue_fact(f"ch04_{key}_threads", record, "threads")
    glue_fact(f"ch04_{key}_registers", record, "registers")
    glue_fact(f"ch04_{key}_rows_per_sm", record, "blocks_per_sm")

if records:
    fig, (ax_bw, ax_us) = new_figure(1, 2, width=11, height=3.8)
    ladder = [r for r in records if r["shape"][0] == prefill_tokens]
    ax_bw.barh(
        [r["name"].replace("rmsnorm_", "") for r in ladder],
        [r["value"] for r in ladder],
        color="#1f77b4",
    )
    ax_bw.axvline(
        ceiling_gbs, color="k", ls="--", lw=1, label=f"ceiling: {ceiling_name}"
    )
    ax_bw.set_xlabel("GB/s (compulsory bytes)")
    ax_bw.set_title(f"{prefill_tokens} rows of {hidden}")
    ax_bw.legend()
    for name in (
        "fused_add_rmsnorm_bf16",
        "fused_add_rmsnorm_wide_bf16",
        "rmsnorm_registers_bf16",
        "rmsnorm_wide_bf16",
    ):
        pts = sorted((r["shape"][0], r["us"]) for r in records if r["name"] == name)
        if pts:
            ax_us.plot(*zip(*pts), "o-", label=name)
    ax_us.set_xscale("log", base=2)
    ax_us.set_xlabel("rows (tokens)")
    ax_us.set_ylabel("µs per call")
    ax_us.set_title(f"from decode to prefill, {records[0]['device']['name']}")
    ax_us.legend()
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch04_device}}, one thread per row reaches {{ch04_naive}} of {{ch04_ceiling}}:
too few threads, each reading memory 4 bytes at a time from addresses that no neighbour
shares. A block per row with coalesced loads is the big step; the shuffles remove
barriers, and holding the row in registers removes the second read. Rung 5, the fused
kernel, moves its compulsory bytes at {{ch04_fused_bf16}} of the ceiling with a
bf16 output ({{ch04_fused_f32}} with float32), {{ch04_fused_us}} for 2,048 tokens.

Rung 6 moves the same bytes at {{ch04_wide_bf16}} of the ceiling
({{ch04_wide_f32}} with float32), {{ch04_wide_us}}. Its threads no longer wait for one
element before they ask for the next: their loads go out in a few large batches, each
load carrying 8 bytes; and with {{ch04_wide_registers}} registers per thread in blocks
of {{ch04_wide_threads}}, a multiprocessor works on {{ch04_wide_rows_per_sm}} rows at
once, where rung 5's {{ch04_fused_registers}} registers in blocks of
{{ch04_fused_threads}} allowed {{ch04_fused_rows_per_sm}}. The suspects for what is
left: the reduction's barrier, at which a block has no loads in flight, and the last,
partial wave of rows (exercise 4 measures the first). A single decode row takes
{{ch04_decode_us}}: at that size a kernel costs its latency, whatever it reads — one
more reason why chapter 11 captures a whole decode step in a CUDA graph, where launches
cost no Python time.
""")

# %% [markdown]
# ## Summary
#
# - RMSNorm scales a row by the inverse of its root mean square, plus $\varepsilon$ from
#   `config.rms_norm_eps`, and multiplies by a bf16 weight. Sums of squares are
#   accumulated in float32: in bf16 a 2,048-long sum loses a large fraction of itself,
#   and fp16 overflows.
# - A reduction ladder: one thread per row (few threads, uncoalesced) → a block per row
#   with a shared-memory tree and `cuda.syncthreads()` → a warp-shuffle butterfly with
#   one barrier → each thread holding its elements in registers, so the row is read
#   once.
# - The simulator has no shuffles; a shared-memory `shfl_xor`, chosen at import, lets CI
#   test the same reduction code.
# - Fusing `residual += delta` with the norm saves 22% of the bytes and a launch; numba
#   compiles the kernel once per output type (float32 or bf16 bits), chosen with an
#   `overload`.
# - Rung 6 moves the row as 8-byte words (`uint64` views of the float32 rows, `uint32`
#   pairs of bf16), loads them without an `if` in front so the machine code can issue
#   them together, and gives each thread 16 elements, so a row of 2,048 takes 128
#   threads and more rows fit in a multiprocessor's registers. The PTX is what numba
#   writes; the SASS is what runs.
#
# Exported to `tinyvllm_lib`, one concept a module: `kernels.rmsnorm` (`rmsnorm_ref`,
# `fused_add_rmsnorm_ref`, the launchers `rmsnorm` and `fused_add_rmsnorm`,
# `block_threads`, `wide_block_threads`, `can_go_wide`, `check_weight_eps`),
# `kernels.rmsnorm_kernels` (the kernels of the ladder, `ITEMS_PER_THREAD`,
# `WIDE_WORDS`), `kernels.activation_store` (`store_activation`, `store_pair`,
# `unpack_f32_pair`, `pack_f32_pair`, `pack_bf16_pair`) and `kernels.reduce`
# (`shfl_xor`, `warp_sum`, `block_sum`).
#
# ## Exercises
#
# 1. Remove the `cuda.syncthreads()` inside the loop of `rmsnorm_shared_tree_kernel` and
#    run the test in the simulator and on a GPU. Does it fail every time? Why not?
# 2. How many bytes do the 33 RMSNorms of one Llama 3.2 1B forward pass move for a
#    2,048-token prompt, fused and unfused? What fraction of the 2.5 GB of bf16 weights
#    that the same pass reads is that?
# 3. Compile `rmsnorm_kernel` with `cuda.compile_ptx` and search the PTX for `.local`.
#    Then make the loop bound `num_cols // num_threads + 1` instead of
#    `ITEMS_PER_THREAD`, and look again. Predict the effect on the benchmark before
#    measuring it.
# 4. Replace `block_sum` with the shared-memory tree in `rmsnorm_kernel`. How many
#    barriers does a block wait at with 256 threads, before and after? Measure the
#    difference at 2,048 rows and at 1 row.
# 5. Decode normalises one row per sequence, so at batch 1 only one of 132
#    multiprocessors works. Sketch a kernel that splits one row over several blocks.
#    What does it have to do that a single block does not, and would it be faster for
#    hidden = 2,048?
# 6. Read the machine code of rungs 5 and 6: on a GPU, after a launch,
#    `fused_add_rmsnorm_kernel.inspect_sass()` (it needs `nvdisasm`, from the
#    `nvidia-cuda-nvdisasm` wheel). Find the global loads (`LDG`) and the first `FADD`
#    that uses each. How many times does a thread of each rung wait for memory before
#    its reduction? Then put rung 6's loads back inside `if j < num_words:` and count
#    again.
# 7. Set `WIDE_WORDS` to 4 and to 16, re-export, and run the benchmark. How do the
#    registers per thread, the rows per multiprocessor and the bandwidth change? Why is
#    more data per thread not always better?
