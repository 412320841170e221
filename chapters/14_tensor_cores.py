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
# # 14. Tensor cores from numba
#
# Every kernel this book has written runs on the GPU's SIMT cores: each thread does its
# own multiply-adds, one or two a cycle. Only cuBLAS, called for the big GEMMs since
# [chapter 6](06_gemm.py), uses the other hardware on the chip: the **tensor cores**,
# which multiply small matrices a whole warp at a time, many times faster. Prefill
# attention is a pair of matrix products per tile (S = Q Kᵀ, then O += P V), and
# [chapter 7](07_attention.py) measured what it reaches on SIMT cores. This chapter
# moves it onto the tensor cores.
#
# numba has no API for them. It can, though, link a function written in CUDA C into a
# kernel written in Python: `cuda.declare_device(name, signature, link=CUSource(src))`
# compiles the C with NVRTC (which ships with `numba-cuda[cu13]`) and the link step
# inlines it. A few lines of C with one PTX instruction in them are the whole bridge.
#
# In this chapter you will learn:
#
# - what a tensor core computes — `mma.sync.m16n8k16`: a 16×16 by 16×8 product, its
#   inputs and its accumulators spread over a warp's 32 lanes in **fragments** — drawn
#   lane by lane;
# - how to call a linked CUDA C function from numba (`declare_device`, `CUSource`,
#   cffi's `from_buffer`), and how to run the same kernel in numba's simulator, where C
#   cannot run, through a Python **twin** of each function;
# - `ldmatrix`, which loads those fragments from shared memory in one instruction, and
#   `cp.async`, which copies the next tile while the warps multiply this one — in a GEMM
#   on the tensor cores;
# - flash attention on the tensor cores (FlashAttention-2's loop: Q in registers, K and
#   V tiles through shared memory, the online softmax on the accumulators), as a drop-in
#   for chapter 10's paged prefill kernel;
# - how to check, with no GPU, that the linked kernel keeps its fragments in registers.
#
# It exports `tinyvllm_lib.kernels.tensor_core` (fragments, the linked functions and
# their twins), `kernels.tc_gemm` (the GEMM), `kernels.tc_attention_tiles` and
# `kernels.tc_attention` (the attention kernel and the engine's choice of it).

# %%
#| default_exp kernels.tensor_core

# %%
import matplotlib.pyplot as plt
import numpy as np
from numba import cuda, float32, uint32

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.measure import DATA_DIR, load_records
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, is_simulator, where_kernels_run

prose = Prose()  # the numbers this chapter's prose quotes, filled in as they are made
rng = np.random.default_rng(14)
print(where_kernels_run())

# %% [markdown]
# ## Why SIMT attention stops where it does
#
# Count first. Chapter 7's flash kernel, the best attention this book has on SIMT cores,
# was measured on the H200 at growing prompt lengths (32 query heads, 8 KV heads, head
# dimension 64, causal):

# %%
PEAK_BF16_TFLOPS = 989  # H100/H200 SXM, dense bf16 on the tensor cores (NVIDIA's sheet)
PEAK_FP32_TFLOPS = 67  # the same chips' SIMT cores, float32 fused multiply-adds
ch07 = [r for r in load_records("ch07_attention") if r["name"] == "attention_flash"]
for r in ch07:
    print(f"{r['shape'][0]:>6} tokens: {r['value']:5.1f} TFLOP/s")
best_simt = max((r["value"] for r in ch07), default=float("nan"))
prose.glue("ch14_simt_best", f"{best_simt:.0f} TFLOP/s")
prose.glue("ch14_peak", f"{PEAK_BF16_TFLOPS} TFLOP/s")
prose.glue("ch14_simt_share", f"{best_simt / PEAK_BF16_TFLOPS:.1%}")
prose.glue("ch14_fp32_peak", f"{PEAK_FP32_TFLOPS} TFLOP/s")
prose.glue("ch14_tc_share", f"{1 - PEAK_FP32_TFLOPS / PEAK_BF16_TFLOPS:.0%}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
At best {{ch14_simt_best}}: {{ch14_simt_share}} of the {{ch14_peak}} that the H200's
tensor cores can do in bf16. A SIMT core does one fused multiply-add per thread per
cycle, and the whole chip's SIMT cores together top out at {{ch14_fp32_peak}} in
float32 (NVIDIA's figure); attention also spends instructions on loads, exponentials and
bookkeeping. Measured against the tensor cores' peak, the SIMT cores are a small part
of the chip's arithmetic ({{ch14_tc_share}} of it is elsewhere), and nothing but cuBLAS
has used the rest so far.
""")

# %% [markdown]
# ## What a tensor core computes
#
# One instruction, issued by all 32 lanes of a warp together:
#
# ```
# mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
#     {d0, d1, d2, d3}, {a0, a1, a2, a3}, {b0, b1}, {c0, c1, c2, c3};
# ```
#
# computes D = A B + C for A 16×16 (bf16), B 16×8 (bf16), C and D 16×8 (float32): 2,048
# multiply-adds. No lane holds a whole matrix: each holds a **fragment**, a few 32-bit
# registers in a layout PTX fixes. Lane l is in *group* g = l / 4 and has *thread in
# group* t = l mod 4; then
#
# - A: four registers, each two bf16 values side by side: a0 = A[g, 2t : 2t+2],
#   a1 = A[g+8, 2t : 2t+2], a2 = A[g, 2t+8 : 2t+10], a3 = A[g+8, 2t+8 : 2t+10];
# - B: two registers, each two values down a column: b0 = B[2t : 2t+2, g],
#   b1 = B[2t+8 : 2t+10, g];
# - C and D: four floats, c0, c1 = C[g, 2t], C[g, 2t+1] and c2, c3 = the same columns of
#   row g+8.
#
# In NumPy, with bf16 values kept as their 16 bits (chapter 1), packing and unpacking
# fragments is a pair of index arrays:

# %%
#| export
import numpy as np
from numba import config, cuda, float32, types, uint32

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits

_LANE = np.arange(32)
_G, _T = _LANE >> 2, _LANE & 3  # a lane's group and its thread in the group
# (lane, register) -> the row and the first column of the two values it holds
A_ROWS = np.stack([_G, _G + 8, _G, _G + 8], axis=1)
A_COLS = np.stack([2 * _T, 2 * _T, 2 * _T + 8, 2 * _T + 8], axis=1)
B_ROWS = np.stack([2 * _T, 2 * _T + 8], axis=1)  # first of two rows; the column is g
B_COLS = np.stack([_G, _G], axis=1)
C_ROWS = np.stack([_G, _G, _G + 8, _G + 8], axis=1)  # (lane, accumulator) -> row
C_COLS = np.stack([2 * _T, 2 * _T + 1, 2 * _T, 2 * _T + 1], axis=1)


def pack_pairs(lo, hi) -> np.ndarray:
    """Two arrays of bf16 bits -> uint32 words, lo in the low half (the lower
    address)."""
    return np.asarray(lo, np.uint32) | (np.asarray(hi, np.uint32) << np.uint32(16))


def a_fragments(a_bits) -> np.ndarray:
    """A (16, 16) bf16 bits -> (32 lanes, 4 registers) uint32, as mma.sync reads it."""
    a = np.asarray(a_bits, np.uint16)
    return pack_pairs(a[A_ROWS, A_COLS], a[A_ROWS, A_COLS + 1])


def b_fragments(b_bits) -> np.ndarray:
    """B (16, 8) bf16 bits, (k, n) -> (32 lanes, 2 registers) uint32."""
    b = np.asarray(b_bits, np.uint16)
    return pack_pairs(b[B_ROWS, B_COLS], b[B_ROWS + 1, B_COLS])


def c_matrix(c_fragments) -> np.ndarray:
    """(32 lanes, 4) float32 accumulators -> the (16, 8) matrix they hold."""
    c = np.zeros((16, 8), np.float32)
    c[C_ROWS, C_COLS] = c_fragments
    return c


def unpack_pairs(words) -> np.ndarray:
    """uint32 words -> (..., 2) bf16 bits, the low half first."""
    words = np.asarray(words, np.uint32)
    return np.stack([words & np.uint32(0xFFFF), words >> np.uint32(16)], -1).astype(
        np.uint16
    )


def bf16_values(bits) -> np.ndarray:
    """bf16 bits -> float64 values."""
    return (np.asarray(bits, np.uint32) << np.uint32(16)).view(np.float32).astype(
        np.float64
    )


def a_matrix(a_words) -> np.ndarray:
    """(32, 4) A fragments -> the (16, 16) bf16 bits they hold (a_fragments undone)."""
    a, h = np.zeros((16, 16), np.uint16), unpack_pairs(a_words)
    a[A_ROWS, A_COLS], a[A_ROWS, A_COLS + 1] = h[..., 0], h[..., 1]
    return a


def b_matrix(b_words) -> np.ndarray:
    """(32, 2) B fragments -> the (16, 8) bf16 bits they hold."""
    b, h = np.zeros((16, 8), np.uint16), unpack_pairs(b_words)
    b[B_ROWS, B_COLS], b[B_ROWS + 1, B_COLS] = h[..., 0], h[..., 1]
    return b


# %% [markdown]
# Every element has exactly one owner, and unpacking undoes packing:

# %%
a_bits = f32_to_bf16_bits(rng.standard_normal((16, 16)).astype(np.float32))
b_bits = f32_to_bf16_bits(rng.standard_normal((16, 8)).astype(np.float32))
assert (a_matrix(a_fragments(a_bits)) == a_bits).all()
assert (b_matrix(b_fragments(b_bits)) == b_bits).all()
for rows, cols, shape in ((A_ROWS, A_COLS, (16, 16)), (B_ROWS, B_COLS, (16, 8))):
    owners = np.zeros(shape, int)
    np.add.at(owners, (rows, cols), 1)
    np.add.at(owners, (rows, cols + 1) if shape == (16, 16) else (rows + 1, cols), 1)
    assert (owners == 1).all()
print("every element of A and B is in exactly one lane's register")

# %% tags=["hide-input"]
fig, axes = new_figure(1, 3, width=10.5, height=4.4,
                       gridspec_kw={"width_ratios": [16, 8, 8]})
for ax, (title, shape, rows, cols, pair) in zip(axes, (
    ("A (16×16): the lane holding each value", (16, 16), A_ROWS, A_COLS, "right"),
    ("B (16×8)", (16, 8), B_ROWS, B_COLS, "down"),
    ("C, D (16×8)", (16, 8), C_ROWS, C_COLS, None),
)):
    lane_of = np.zeros(shape, int)
    for lane in range(32):
        for reg in range(rows.shape[1]):
            r, c = rows[lane, reg], cols[lane, reg]
            cells = [(r, c)] if pair is None else (
                [(r, c), (r, c + 1)] if pair == "right" else [(r, c), (r + 1, c)])
            for rr, cc in cells:
                lane_of[rr, cc] = lane
    ax.imshow(lane_of // 4, cmap="tab10", vmin=0, vmax=9, alpha=0.55)
    for (rr, cc), lane in np.ndenumerate(lane_of):
        ax.text(cc, rr, f"{lane}", ha="center", va="center", fontsize=6)
    ax.set_title(title, fontsize=8)
    ax.set_xticks(range(shape[1])), ax.set_yticks(range(shape[0]))
    ax.tick_params(labelsize=6, length=0)
fig.suptitle("m16n8k16 fragments: the colour is the lane's group g = lane / 4",
             fontsize=9)
plt.show()

# %% [markdown]
# Read the A panel by colour: group g owns rows g and g+8, and its four lanes split the
# columns in pairs. That is why a row of the result lives in four neighbouring lanes,
# and why the softmax later needs a reduction over exactly four lanes.

# %% [markdown]
# ## One tile through a linked C function
#
# The instruction goes in a CUDA C function of three lines. `extern "C"` keeps its name
# unmangled so numba can find it; `asm(...)` places one PTX instruction with its
# operands bound to C variables (`"+f"`: a float read and written, `"r"`: a 32-bit
# register read). The fragments arrive as pointers to the lane's registers:

# %%
#| export
MMA_SOURCE = r"""
// c (16 x 8, float32) += a (16 x 16, bf16) b (16 x 8, bf16): all 32 lanes of a warp
// at once, each passing its own fragments
extern "C" __device__ void mma_bf16_m16n8k16(float* c, const unsigned* a,
                                             const unsigned* b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""

# two float32 -> two bf16 in one register (cvt.rn: nearest, ties to even), and 2^x on
# the special-function unit: the attention kernel's two small helpers
HELPER_SOURCE = r"""
extern "C" __device__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}
extern "C" __device__ float exp2_approx(float x) {  // x = -inf gives 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""

# %% [markdown]
# On the numba side, `declare_device` gives the function a numba signature; `abi="c"`
# says it is called as C calls it. A kernel passes its local arrays through cffi's
# `ffi.from_buffer`, which numba compiles to the array's address. After the link step
# inlines the function, the arrays are registers again: nothing goes through memory.
#
# The simulator cannot run C. For it, each linked function has a **twin**: a Python
# function with the same signature and the same fragment layout. A tensor-core
# instruction is *warp-collective* — lane 0's result depends on the other 31 lanes'
# registers — so a twin cannot work lane by lane as chapter 1's `device_function`
# helpers do. Each lane writes its fragments to a buffer its warp shares, waits until
# all 32 have written, then computes its own part from everyone's. (The simulator's own
# `syncthreads` would do, but it costs tens of milliseconds a call there; the twins'
# warps meet at a barrier of their own that spins with the interpreter's lock released,
# and `twin_launch` shortens the interpreter's thread switch while a kernel runs.)
#
# Two more things the GPU needs and the simulator does not check. `ldmatrix` and
# `cp.async` take 16-byte-aligned shared addresses, and numba aligns a shared array
# only to its element (8 bytes for uint64), so the kernels ask for 16 (`SHARED_ALIGN`).
# And the C is inlined only when numba links with LTO, which it does by default
# wherever nvJitLink is installed — but not with `debug=True`; `require_lto` makes a
# kernel built without it an error rather than a slow surprise.

# %%
#| export
_P = types.CPointer
# alignment of shared tiles that ldmatrix and cp.async read and write (the simulator
# takes no alignment argument)
SHARED_ALIGN = None if config.ENABLE_CUDASIM else 16


def require_lto(kernel):
    """`kernel`, once it is sure to link its C with link-time optimisation (inlined:
    its fragments stay in registers); a RuntimeError if not. Nothing to check in the
    simulator."""
    if not config.ENABLE_CUDASIM and not kernel.targetoptions.get("lto"):
        raise RuntimeError(
            "this kernel calls linked CUDA C that must be inlined: numba links with "
            "LTO only when nvJitLink is installed (numba-cuda[cu13]) and debug is off"
        )
    return kernel

if config.ENABLE_CUDASIM:
    import contextlib
    import sys
    import threading
    import time
    import traceback

    from numba.cuda import types as simulator_types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    class _SimFFI:
        """The simulator's stand-in for cffi: a 'pointer' is the array view itself."""

        @staticmethod
        def from_buffer(a):
            return a

    ffi = _SimFFI()
    _twin_lock = threading.Lock()

    def warp_exchange(words):
        """(32, 64) uint32: every lane's `words` (up to 64 each) once all 32 lanes of
        this thread's warp have given theirs, and this lane's index. Two buffers in
        turn: a lane writes one again only after every lane has arrived at the call
        after the one that read it."""
        thread = threading.current_thread()
        warp, lane = divmod(thread.thread_id, 32)
        key = (tuple(thread.blockIdx), warp)  # blocks run one after another
        with _twin_lock:
            warps = thread._manager.__dict__.setdefault("tensor_core_twins", {})
            if key not in warps:
                warps[key] = ([0], np.zeros((2, 32, 64), np.uint32))
            arrived, buffers = warps[key]
        calls = thread.__dict__.get("tensor_core_calls", 0)
        thread.tensor_core_calls = calls + 1
        buffer = buffers[calls % 2]
        buffer[lane, : len(words)] = words
        with _twin_lock:
            arrived[0] += 1
        while arrived[0] < 32 * (calls + 1):
            time.sleep(0)  # let the other lanes run
        return buffer, lane

    def mma_bf16_m16n8k16(c, a, b):
        """Twin: the warp's lanes swap fragments; each adds its four products to c."""
        words = np.empty(6, np.uint32)
        words[:4], words[4:] = a[:4], b[:2]
        buffer, lane = warp_exchange(words)
        A = bf16_values(a_matrix(buffer[:, :4]))
        B = bf16_values(b_matrix(buffer[:, 4:6]))
        rows, cols = C_ROWS[lane], C_COLS[lane]
        for i in range(4):
            c[i] = np.float32(np.float64(c[i]) + A[rows[i]] @ B[:, cols[i]])

    def pack_bf16x2(lo, hi):
        """Twin of the C helper."""
        bits = f32_to_bf16_bits(np.array([lo, hi], np.float32))
        return np.uint32(pack_pairs(bits[0], bits[1]))

    def exp2_approx(x):
        """Twin of the C helper (exact here: the hardware's is within 2 ulp)."""
        return np.float32(np.exp2(np.float32(x)))

    def simulated_lane() -> int:
        """The lane of the simulated thread running this twin."""
        return threading.current_thread().thread_id % 32

    _simulator_shared_array = FakeCUDAShared.array

    def _shared_array_once(self, shape, dtype, alignment=None):
        """The simulator's cuda.shared.array with its look-up and its insertion made
        one step. numba-cuda's (0.30) looks up a block's array by the calling line,
        then stores a new one if it found none: two threads switched between the two
        steps each get an array of their own, and one thread's writes land where no
        other thread reads (a guess at one CI failure, at twin_launch's short switch
        interval; other simulated kernels keep the simulator's own, at the default
        interval)."""
        # dynamic memory, or an alignment (the simulator's error): no look-up
        if shape == 0 or alignment is not None:
            return _simulator_shared_array(self, shape, dtype, alignment)
        if isinstance(dtype, simulator_types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[0][0:2]
        found = self._allocations.get(caller)
        if found is None:
            with _twin_lock:
                found = self._allocations.setdefault(caller, np.empty(shape, dtype))
        return found

    @contextlib.contextmanager
    def twin_launch():
        """Around a simulated launch of a kernel with twins: switch threads often,
        and let no two threads of a block make the same shared array."""
        before = sys.getswitchinterval()
        sys.setswitchinterval(2e-4)
        FakeCUDAShared.array = _shared_array_once
        try:
            yield
        finally:
            FakeCUDAShared.array = _simulator_shared_array
            sys.setswitchinterval(before)

else:
    import contextlib

    from cffi import FFI
    from numba.cuda import CUSource

    ffi = FFI()
    mma_bf16_m16n8k16 = cuda.declare_device(
        "mma_bf16_m16n8k16",
        types.void(_P(types.float32), _P(types.uint32), _P(types.uint32)),
        link=CUSource(MMA_SOURCE),
        abi="c",
    )
    _HELPERS = CUSource(HELPER_SOURCE)
    pack_bf16x2 = cuda.declare_device(
        "pack_bf16x2",
        types.uint32(types.float32, types.float32),
        link=_HELPERS,
        abi="c",
    )
    exp2_approx = cuda.declare_device(
        "exp2_approx", types.float32(types.float32), link=_HELPERS, abi="c"
    )

    def twin_launch():
        """Nothing to do on a GPU."""
        return contextlib.nullcontext()


# %% [markdown]
# The kernel of the first rung: one warp, one tile. Each lane copies its fragments into
# local arrays, calls the C function, and writes its four accumulators back.

# %%
#| export
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


@cuda.jit
def mma_tile_kernel(a_words, b_words, c):
    wait_for_previous_kernel()  # as every kernel of the book (chapter 1)
    lane = cuda.threadIdx.x
    a = cuda.local.array(4, uint32)
    b = cuda.local.array(2, uint32)
    acc = cuda.local.array(4, float32)
    for i in range(4):
        a[i] = a_words[lane, i]
        acc[i] = c[lane, i]
    for i in range(2):
        b[i] = b_words[lane, i]
    mma_bf16_m16n8k16(ffi.from_buffer(acc), ffi.from_buffer(a), ffi.from_buffer(b))
    for i in range(4):
        c[lane, i] = acc[i]


def mma_tile(a_bits, b_bits, c):
    """C (16, 8) float32 + A (16, 16) B (16, 8), both bf16 bits, on one warp's tensor
    cores (or their twin): a NumPy (16, 8) result."""
    c_words = np.ascontiguousarray(np.asarray(c, np.float32)[C_ROWS, C_COLS])
    out = cuda.to_device(c_words)
    with twin_launch():
        a, b = cuda.to_device(a_fragments(a_bits)), cuda.to_device(b_fragments(b_bits))
        mma_tile_kernel[1, 32](a, b, out)
    return c_matrix(out.copy_to_host())


require_lto(mma_tile_kernel)
PTX_SIGNATURES = {
    "mma_tile_kernel": ["void(uint32[:, ::1], uint32[:, ::1], float32[:, ::1])"]
}

# %% [markdown]
# Against NumPy, with C non-zero so the accumulate is tested too:

# %%
c0 = rng.standard_normal((16, 8)).astype(np.float32)
want = (bf16_bits_to_f32(a_bits).astype(np.float64) @ bf16_bits_to_f32(b_bits)) + c0
if can_launch():
    got = mma_tile(a_bits, b_bits, c0)
    tile_err = float(np.abs(got - want).max())
    print(f"one m16n8k16 tile: max error {tile_err:.1e} against float64")
    assert tile_err < 1e-4 * np.abs(want).max()

# %% [markdown]
# ## Fragments from shared memory: `ldmatrix`
#
# Attention's B operands — K for S = Q Kᵀ, V for O += P V — come from tiles in shared
# memory that the whole block loaded. Gathering a fragment element by element takes a
# load per register per lane. `ldmatrix.sync.aligned.m8n8.x4` loads four 8×8 bf16
# matrices in one instruction: lane l gives the address of row l mod 8 of matrix l / 8
# (16 bytes), and each lane receives, per matrix, the two values a fragment wants — row
# g, columns 2t and 2t+1. With `.trans` it receives them from the transpose, which is
# how V, stored key by key, becomes a B operand that runs down the keys.
#
# Two 8×8 matrices of K side by side along the head dimension are exactly b0 and b1 of
# one 8-key tile, so one `ldmatrix.x4` feeds two `mma`s. Shared memory has 32 banks of 4
# bytes; rows of 64 bf16 (128 bytes) would put the 8 rows an `ldmatrix` phase reads in
# the same banks. Padding each row by 16 bytes (144 bytes a row) spreads them over all
# 32.

# %% [markdown]
# ## The second rung: a GEMM on the tensor cores
#
# Before attention, the plainest use: C = A Bᵀ, the product every linear layer of the
# model computes (A the activations, (M, K); B the weights, (N, K), as the model stores
# them; both bf16). Chapter 6 tiled it for SIMT cores; on tensor cores the tiling is the
# same, one level deeper:
#
# - a block computes a 128×128 tile of C with 8 warps, each a 64×32 piece: 4×4
#   accumulator fragments, 64 floats a lane;
# - the K dimension goes by in tiles of 32: the block copies its A and B tiles (128×32
#   each) into shared memory with **`cp.async`**, which moves 16 bytes from global to
#   shared memory without passing through registers, and lets the copy of the next tile
#   run while the warps multiply this one (**double buffering**: two stages in turn);
# - each warp loads its fragments from shared memory with `ldmatrix` — an x4 load is
#   one whole A fragment (16×16), or the B fragments of two 8-column tiles — and issues
#   16 `mma.sync` per 16-wide step of K.
#
# Rows are padded by 16 bytes (80-byte rows), which spreads the 8 rows an `ldmatrix`
# phase reads over all 32 banks. The C side is again short: the copy, and a warp's
# tile of products.

# %%
#| export kernels.tc_gemm
import numpy as np
from numba import config, cuda, float32, types, uint64

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.tensor_core import (
    C_COLS,
    C_ROWS,
    SHARED_ALIGN,
    bf16_values,
    ffi,
    require_lto,
    twin_launch,
)

CP_ASYNC_SOURCE = r"""
// 16 bytes from global to shared memory, asynchronously (cp.async: no registers)
extern "C" __device__ void cp_async16(unsigned long long* shared_dst,
                                      const unsigned long long* global_src) {
  unsigned dst = (unsigned)__cvta_generic_to_shared(shared_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"(dst), "l"(__cvta_generic_to_global(global_src)) : "memory");
}
// close the group of copies issued so far
extern "C" __device__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// wait until at most one group (the newest) is still in flight
extern "C" __device__ void cp_async_wait_one() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}
"""


def gemm_tile_source(row_words: int) -> str:
    """CUDA C for one warp's 64 x 32 piece of C over a 32-wide tile of K: a (64 rows)
    and b (32 rows) of the tiles in shared memory, row_words 8-byte words apart."""
    ROW = row_words
    return rf"""
#define MMA16816(c, a, b0, b1) \
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " \
      "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};" \
      : "+f"((c)[0]), "+f"((c)[1]), "+f"((c)[2]), "+f"((c)[3]) \
      : "r"((a)[0]), "r"((a)[1]), "r"((a)[2]), "r"((a)[3]), "r"(b0), "r"(b1))

static __device__ __forceinline__ void ldsm_x4_r{ROW}(unsigned* r,
                                                     const unsigned long long* p) {{
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0, %1, %2, %3}}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}}

// acc (4 x 4 accumulator fragments: m-tile i, n-tile j at 16 (4 i + j)) += a b^T
extern "C" __device__ void gemm_warp_tile_r{ROW}(float* acc,
                                               const unsigned long long* a,
                                               const unsigned long long* b) {{
  int lane = threadIdx.x % 32, row = lane % 8, mat = lane / 8;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {{  // two 16-wide steps of K
    unsigned af[4][4], bf[2][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)  // an A fragment: lane l gives row l % 16, half l / 16
      ldsm_x4_r{ROW}(af[i], a + (16 * i + lane % 16) * {ROW} + 4 * ks
                             + 2 * (lane / 16));
#pragma unroll
    for (int q = 0; q < 2; ++q)  // B fragments of n-tiles 2q and 2q + 1
      ldsm_x4_r{ROW}(bf[q], b + (16 * q + 8 * (mat / 2) + row) * {ROW} + 4 * ks
                             + 2 * (mat % 2));
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        MMA16816(acc + 4 * (4 * i + j), af[i], bf[j / 2][2 * (j % 2)],
                 bf[j / 2][2 * (j % 2) + 1]);
  }}
}}
"""


# %% [markdown]
# The twins are simple this time: a warp's products read only shared memory, which every
# simulated thread can see, so each lane computes its own 64 accumulators from the tiles
# with no exchange; a copy is done at once, and the waits have nothing to wait for.

# %%
#| export kernels.tc_gemm
_P = types.CPointer

if config.ENABLE_CUDASIM:
    from tinyvllm_lib.kernels.tensor_core import simulated_lane

    def cp_async16(shared_dst, global_src):
        """Twin: the 16 bytes, at once."""
        shared_dst[0:2] = global_src[0:2]

    def cp_async_commit():
        """Twin: nothing is in flight."""

    def cp_async_wait_one():
        """Twin: nothing is in flight."""

    def gemm_warp_tile_function(row_words: int):
        """Twin of gemm_warp_tile: this lane's 64 accumulators += a b^T."""

        def gemm_warp_tile(acc, a, b):
            lane = simulated_lane()
            a_words = np.asarray(a)[: 64 * row_words].reshape(64, row_words)
            b_words = np.asarray(b)[: 32 * row_words].reshape(32, row_words)
            A = bf16_values(a_words[:, :8].view(np.uint16))  # (64, 32) values
            B = bf16_values(b_words[:, :8].view(np.uint16))
            C = A @ B.T  # (64, 32)
            for i in range(4):
                for j in range(4):
                    base = 4 * (4 * i + j)
                    for e in range(4):
                        r, c = 16 * i + C_ROWS[lane, e], 8 * j + C_COLS[lane, e]
                        acc[base + e] = np.float32(np.float64(acc[base + e]) + C[r, c])

        return gemm_warp_tile

else:
    from numba.cuda import CUSource

    _CP_ASYNC = CUSource(CP_ASYNC_SOURCE)
    _WORDS = _P(types.uint64)
    cp_async16 = cuda.declare_device(
        "cp_async16", types.void(_WORDS, _WORDS), link=_CP_ASYNC, abi="c"
    )
    cp_async_commit = cuda.declare_device(
        "cp_async_commit", types.void(), link=_CP_ASYNC, abi="c"
    )
    cp_async_wait_one = cuda.declare_device(
        "cp_async_wait_one", types.void(), link=_CP_ASYNC, abi="c"
    )

    def gemm_warp_tile_function(row_words: int):
        """gemm_warp_tile for rows row_words words apart, from gemm_tile_source."""
        return cuda.declare_device(
            f"gemm_warp_tile_r{row_words}",
            types.void(_P(types.float32), _WORDS, _WORDS),
            link=CUSource(gemm_tile_source(row_words)),
            abi="c",
        )


# %% [markdown]
# The kernel: numba owns the grid, the addresses, the pipeline's order and the store.
# Rows of A or B past the matrix's end are loaded from its last row (valid memory) and
# never stored.

# %%
#| export kernels.tc_gemm
GEMM_BK = 32  # K a tile: 4 chunks of 16 bytes a row
GEMM_ROW = GEMM_BK // 4 + 2  # 8-byte words a row in shared memory, with 16 of padding


def make_tc_gemm_kernel(block_m: int = 128, block_n: int = 128):
    """C (M, N) = A (M, K) B (N, K)^T, bf16 in, float32 accumulate: a block per
    block_m x block_n tile of C, a warp per 64 x 32 piece, K tiles through shared memory
    by cp.async in two stages."""
    BM, BN, ROW = block_m, block_n, GEMM_ROW
    WARPS_N = BN // 32
    THREADS = 32 * (BM // 64) * WARPS_N
    if not (BM > 0 and BN > 0 and BM % 64 == 0 and BN % 32 == 0 and THREADS <= 1024
            and (BM * 4) % THREADS == 0 and (BN * 4) % THREADS == 0):
        raise ValueError(f"block_m must be a multiple of 64 and block_n of 32, with "
                         f"whole loads per thread, got {BM}, {BN}")
    A_LOADS, B_LOADS = BM * 4 // THREADS, BN * 4 // THREADS  # 16-byte chunks a thread
    warp_tile = gemm_warp_tile_function(ROW)
    A_WORDS, B_WORDS = BM * ROW, BN * ROW  # a stage of each tile in shared memory

    @cuda.jit
    def kernel(a, b, c):  # a (M, K / 4) and b (N, K / 4): bf16 as 8-byte words
        wait_for_previous_kernel()
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
        M, N, num_k = a.shape[0], b.shape[0], a.shape[1] // (GEMM_BK // 4)
        a_tile = cuda.shared.array((2, A_WORDS), uint64, alignment=SHARED_ALIGN)
        b_tile = cuda.shared.array((2, B_WORDS), uint64, alignment=SHARED_ALIGN)
        acc = cuda.local.array(64, float32)
        for i in range(64):
            acc[i] = float32(0.0)

        for kt in range(num_k + 1):
            if kt < num_k:  # start copying tile kt into stage kt % 2
                stage, k_word = kt % 2, kt * (GEMM_BK // 4)
                for u in range(A_LOADS):
                    chunk = tid + u * THREADS  # row chunk // 4, 16 bytes chunk % 4
                    row = min(m0 + chunk // 4, M - 1)
                    cp_async16(ffi.from_buffer(a_tile[stage, (chunk // 4) * ROW
                                                      + 2 * (chunk % 4):]),
                               ffi.from_buffer(a[row, k_word + 2 * (chunk % 4):]))
                for u in range(B_LOADS):
                    chunk = tid + u * THREADS
                    row = min(n0 + chunk // 4, N - 1)
                    cp_async16(ffi.from_buffer(b_tile[stage, (chunk // 4) * ROW
                                                      + 2 * (chunk % 4):]),
                               ffi.from_buffer(b[row, k_word + 2 * (chunk % 4):]))
            cp_async_commit()  # (an empty group on the last pass)
            if kt > 0:  # multiply tile kt - 1 while tile kt is on its way
                cp_async_wait_one()
                cuda.syncthreads()  # every thread's copies of tile kt - 1 have landed
                stage = (kt - 1) % 2
                wm, wn = warp // WARPS_N, warp % WARPS_N
                warp_tile(ffi.from_buffer(acc),
                          ffi.from_buffer(a_tile[stage, 64 * wm * ROW:]),
                          ffi.from_buffer(b_tile[stage, 32 * wn * ROW:]))
                cuda.syncthreads()  # done reading the stage the next copy overwrites

        wm, wn = warp // WARPS_N, warp % WARPS_N
        for i in range(4):
            for j in range(4):
                for e in range(4):
                    row = m0 + 64 * wm + 16 * i + C_ROWS[lane, e]
                    col = n0 + 32 * wn + 8 * j + C_COLS[lane, e]
                    if row < M and col < N:
                        store_activation(c, row, col, acc[4 * (4 * i + j) + e])

    kernel.block_m, kernel.block_n = BM, BN
    return require_lto(kernel)


_gemm_kernels = {}


def tc_gemm(a, b, c, block_m: int = 128, block_n: int = 128, stream=0):
    """c = a b^T on the tensor cores: a (M, K), b (N, K) bf16 bits (uint16) on the
    device, K a multiple of 32; c (M, N) float32, or bf16 bits (uint16)."""
    M, K = a.shape
    N = b.shape[0]
    if a.dtype != np.uint16 or b.dtype != np.uint16 or b.shape[1] != K:
        raise ValueError(f"tc_gemm: a (M, K) and b (N, K) must hold bf16 bits with the "
                         f"same K, got {a.dtype} {a.shape} and {b.dtype} {b.shape}")
    if K % GEMM_BK or tuple(c.shape) != (M, N):
        raise ValueError(f"tc_gemm: K must be a multiple of {GEMM_BK} and c ({M}, "
                         f"{N}); got K={K}, c {tuple(c.shape)}")
    key = (block_m, block_n)
    if key not in _gemm_kernels:
        _gemm_kernels[key] = make_tc_gemm_kernel(*key)
    kernel = _gemm_kernels[key]
    threads = 32 * (block_m // 64) * (block_n // 32)
    with twin_launch():
        a_words = a.view(np.uint64).reshape(M, K // 4)  # 8-byte words: 4 values each
        b_words = b.view(np.uint64).reshape(N, K // 4)
        grid = (cdiv(N, block_n), cdiv(M, block_m))
        kernel[grid, threads, stream](a_words, b_words, c)
    return c


tc_gemm_kernel = make_tc_gemm_kernel()
_gemm_kernels[(128, 128)] = tc_gemm_kernel
PTX_SIGNATURES = {
    "tc_gemm_kernel": [f"void(uint64[:, ::1], uint64[:, ::1], {c}[:, ::1])"
                       for c in ("float32", "uint16")]
}

# %% [markdown]
# Against NumPy. The tensor cores multiply bf16 values exactly and add in float32 (not
# always rounding as IEEE float32 does: measurements of their accumulators find
# truncation), so the result may differ from a float64 product by the rounding of K
# float32 additions:
# at most K · 2⁻²⁴ times the sum of |a||b| along each dot product (a textbook bound on
# summation error). The check uses twice that.

# %%
from tinyvllm_lib.kernels.tc_gemm import tc_gemm


def check_tc_gemm(rng, M, N, K, **kw) -> float:
    """tc_gemm against float64; the largest error as a share of its bound."""
    a = f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    b = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32))
    c = cuda.to_device(np.full((M, N), np.nan, np.float32))
    tc_gemm(cuda.to_device(a), cuda.to_device(b), c, **kw)
    A = bf16_bits_to_f32(a).astype(np.float64)
    B = bf16_bits_to_f32(b).astype(np.float64)
    bound = 2 * K * 2.0**-24 * (np.abs(A) @ np.abs(B).T)
    return float((np.abs(c.copy_to_host() - A @ B.T) / bound).max())


if can_launch():
    M, N, K, kw = ((70, 96, 64, {"block_m": 64, "block_n": 32}) if is_simulator()
                   else (2051, 3072, 2048, {}))
    share = check_tc_gemm(rng, M, N, K, **kw)
    print(f"tensor-core GEMM {M}x{N}x{K}: largest error {share:.2f} of its bound")
    assert share <= 1

# %% [markdown]
# ## Attention, a tile at a time, on the tensor cores
#
# The loop is FlashAttention-2's and chapter 7's, with the arithmetic moved:
#
# - a block of 4 warps takes 64 queries of one head (an entry of chapter 10's tile
#   schedule; the section on tiles below makes it 128 at head size 64); each warp
#   keeps its 16 queries as A fragments in registers;
# - the block copies each tile of 64 keys and values through the block table into
#   shared memory, as chapter 10's kernel does, but with the GEMM's `cp.async` in two
#   stages: the next tile is on its way while the warps work on this one;
# - each warp computes its S tile (16×64: eight accumulator fragments) with
#   `qk_tile`, applies the causal mask and the online softmax **on the accumulators**,
#   and adds P V into its O accumulators with `pv_tile`, which rounds P to bf16 into A
#   fragments without leaving registers (an accumulator's layout is an A fragment's,
#   two columns at a time);
# - a row's maximum and sum are over the four lanes of a group: two shuffles.
#
# The two products are short C functions, generated for the head dimension and tile
# size so the compiler can unroll every loop:

# %%
#| export kernels.tc_attention_tiles
import numpy as np
from numba import config, cuda, types

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.tensor_core import C_COLS, C_ROWS, a_matrix, bf16_values


def tile_name(head_dim: int, block_k: int, m_tiles: int = 1) -> str:
    """The C functions' suffix at these sizes."""
    return f"d{head_dim}_k{block_k}_m{m_tiles}"


def attention_tile_source(head_dim: int, block_k: int, row_words: int,
                          m_tiles: int = 1) -> str:
    """CUDA C for a warp's two products in a tile of flash attention, 16 m_tiles
    queries (m_tiles row tiles of 16, one after another in s, q, p and o) against
    block_k keys whose K and V rows are row_words 8-byte words apart in shared memory:
    qk_tile_{name} (S = Q K^T) and pv_tile_{name} (O += P V), name tile_name(...).
    Each fragment of K or V loaded from shared memory serves all m_tiles row tiles."""
    D, BK, ROW, M = head_dim, block_k, row_words, m_tiles
    name = tile_name(head_dim, block_k, m_tiles)
    return rf"""
#define MMA16816(c, a0, a1, a2, a3, b0, b1) \
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " \
      "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};" \
      : "+f"((c)[0]), "+f"((c)[1]), "+f"((c)[2]), "+f"((c)[3]) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))

// four 8 x 8 bf16 matrices: lane l points at row l % 8 of matrix l / 8
static __device__ __forceinline__ void ldsm_{name}(unsigned* r,
                                                   const unsigned long long* p,
                                                   bool trans) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(p);
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 "
                 "{{%0, %1, %2, %3}}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0, %1, %2, %3}}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}}

// s = this warp's {16 * M} x {BK} scores = q K^T: per row tile m, {BK // 8}
// accumulators from s + {BK // 2} m, and {D // 16} A fragments from q + {D // 4} m
extern "C" __device__ void qk_tile_{name}(float* s, const unsigned* q,
                                          const unsigned long long* k) {{
  int lane = threadIdx.x % 32, row = lane % 8, mat = lane / 8;
#pragma unroll
  for (int i = 0; i < {M * BK // 2}; ++i) s[i] = 0.0f;
#pragma unroll
  for (int p = 0; p < {BK // 16}; ++p) {{     // 16 keys: two accumulator fragments
#pragma unroll
    for (int kc = 0; kc < {D // 16}; ++kc) {{  // 16 dimensions: one A fragment of q
      unsigned b[4];  // keys 16p.., dims 16kc..: b0, b1; then keys 8 on: b0, b1 again
      int key = 16 * p + 8 * (mat / 2) + row;
      ldsm_{name}(b, k + key * {ROW} + 4 * kc + 2 * (mat % 2), false);
#pragma unroll
      for (int m = 0; m < {M}; ++m) {{  // the same B fragments for every row tile
        const unsigned* a = q + {D // 4} * m + 4 * kc;
        float* c = s + {BK // 2} * m + 8 * p;
        MMA16816(c, a[0], a[1], a[2], a[3], b[0], b[1]);
        MMA16816(c + 4, a[0], a[1], a[2], a[3], b[2], b[3]);
      }}
    }}
  }}
}}

static __device__ __forceinline__ unsigned pack_{name}(float lo, float hi) {{
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}}

// o (this warp's {16 * M} x {D} outputs, {D // 2} floats a row tile) += p ({16 * M} x
// {BK} probabilities, laid out as s) V
extern "C" __device__ void pv_tile_{name}(float* o, const float* p,
                                          const unsigned long long* v) {{
  int lane = threadIdx.x % 32, row = lane % 8, mat = lane / 8;
#pragma unroll
  for (int kc = 0; kc < {BK // 16}; ++kc) {{  // 16 keys: two accumulators make A
    unsigned a[{M}][4];
#pragma unroll
    for (int m = 0; m < {M}; ++m) {{
      const float* x = p + {BK // 2} * m + 8 * kc;
      a[m][0] = pack_{name}(x[0], x[1]);
      a[m][1] = pack_{name}(x[2], x[3]);
      a[m][2] = pack_{name}(x[4], x[5]);
      a[m][3] = pack_{name}(x[6], x[7]);
    }}
#pragma unroll
    for (int dp = 0; dp < {D // 16}; ++dp) {{  // 16 dimensions: two accumulators
      unsigned b[4];  // V transposed: keys 16kc.., dims 16dp.. (b0, b1), then dims 8 on
      int key = 16 * kc + 8 * (mat % 2) + row;
      ldsm_{name}(b, v + key * {ROW} + 4 * dp + 2 * (mat / 2), true);
#pragma unroll
      for (int m = 0; m < {M}; ++m) {{
        float* c = o + {D // 2} * m + 8 * dp;
        MMA16816(c, a[m][0], a[m][1], a[m][2], a[m][3], b[0], b[1]);
        MMA16816(c + 4, a[m][0], a[m][1], a[m][2], a[m][3], b[2], b[3]);
      }}
    }}
  }}
}}
"""


# %% [markdown]
# Their twins do the same products in NumPy from the lanes' exchanged fragments and the
# shared tile (which every simulated thread can read), and hand each lane its
# accumulators. `quad_max2` and `quad_sum2` reduce two values over the four lanes of a
# group: two `shfl_xor`s each on the GPU (numba has them), an exchange in the simulator,
# which has no shuffles.

# %%
#| export kernels.tc_attention_tiles
_P = types.CPointer


def accumulator_index(lane, width: int):
    """(rows, columns) of a lane's accumulators over a 16 x width product held as
    width / 8 fragments, 4 floats each."""
    n = np.arange(width // 8).repeat(4)
    e = np.tile(np.arange(4), width // 8)
    return C_ROWS[lane][e], 8 * n + C_COLS[lane][e]


if config.ENABLE_CUDASIM:
    from tinyvllm_lib.kernels.tensor_core import warp_exchange

    def _tile_values(tile, block_k, row_words, head_dim):
        """A tile in shared memory, block_k rows of row_words 8-byte words from where
        `tile` starts -> (block_k, head_dim) values."""
        rows = np.asarray(tile)[: block_k * row_words].reshape(block_k, row_words)
        return bf16_values(rows[:, : head_dim // 4].view(np.uint16))

    def attention_tile_functions(head_dim: int, block_k: int, row_words: int,
                                 m_tiles: int = 1):
        """Twins of qk_tile and pv_tile at these sizes."""
        D, BK, M = head_dim, block_k, m_tiles
        QW, SW, OW = D // 4, BK // 2, D // 2  # a row tile's words of q, s and o

        def qk_tile(s, q, k):
            buffer, lane = warp_exchange(q[: M * QW])
            K = _tile_values(k, BK, row_words, D)
            for m in range(M):
                Q = np.zeros((16, D))
                for kc in range(D // 16):
                    at = m * QW + 4 * kc
                    Q[:, 16 * kc : 16 * kc + 16] = bf16_values(
                        a_matrix(buffer[:, at : at + 4])
                    )
                S = Q @ K.T  # (16, BK)
                s[m * SW : (m + 1) * SW] = S[accumulator_index(lane, BK)].astype(
                    np.float32
                )

        def pv_tile(o, p, v):
            words = np.asarray(p[: M * SW], np.float32).view(np.uint32)
            buffer, lane = warp_exchange(words)
            V = _tile_values(v, BK, row_words, D)
            rows, cols = accumulator_index(lane, D)
            for m in range(M):
                P = np.zeros((16, BK))
                for other in range(32):  # P rounded to bf16, as the packing does
                    probs = buffer[other, m * SW : (m + 1) * SW].view(np.float32)
                    P[accumulator_index(other, BK)] = bf16_values(
                        f32_to_bf16_bits(probs)
                    )
                O = P @ V  # (16, D)
                mine = o[m * OW : (m + 1) * OW].astype(np.float64) + O[rows, cols]
                o[m * OW : (m + 1) * OW] = mine.astype(np.float32)

        return qk_tile, pv_tile

    def quad_max2(x, y):
        """Twin: the largest x and the largest y over the lane's group of four."""
        pair = np.array([x, y], np.float32).view(np.uint32)
        buffer, lane = warp_exchange(pair)
        q = buffer[lane & ~3 : (lane & ~3) + 4, :2].view(np.float32)
        return q[:, 0].max(), q[:, 1].max()

    def quad_sum2(x, y):
        """Twin: x and y summed over the lane's group of four, in the shuffles'
        order."""
        pair = np.array([x, y], np.float32).view(np.uint32)
        buffer, lane = warp_exchange(pair)
        q = buffer[lane & ~3 : (lane & ~3) + 4, :2].view(np.float32)
        pairs = (np.float32(q[0] + q[1]), np.float32(q[2] + q[3]))  # xor 1, then 2
        total = pairs[0] + pairs[1]
        return np.float32(total[0]), np.float32(total[1])

else:
    from numba.cuda import CUSource

    def attention_tile_functions(head_dim: int, block_k: int, row_words: int,
                                 m_tiles: int = 1):
        """qk_tile and pv_tile at these sizes, linked from attention_tile_source."""
        src = CUSource(attention_tile_source(head_dim, block_k, row_words, m_tiles))
        name = tile_name(head_dim, block_k, m_tiles)
        words, floats = _P(types.uint32), _P(types.float32)
        qk = cuda.declare_device(f"qk_tile_{name}",
                                 types.void(floats, words, _P(types.uint64)),
                                 link=src, abi="c")
        pv = cuda.declare_device(f"pv_tile_{name}",
                                 types.void(floats, floats, _P(types.uint64)),
                                 link=src, abi="c")
        return qk, pv

    @cuda.jit(device=True)
    def quad_max2(x, y):
        """The largest x and the largest y over the lane's group of four."""
        x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 1))
        y = max(y, cuda.shfl_xor_sync(0xFFFFFFFF, y, 1))
        x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 2))
        return x, max(y, cuda.shfl_xor_sync(0xFFFFFFFF, y, 2))

    @cuda.jit(device=True)
    def quad_sum2(x, y):
        """x and y summed over the lane's group of four."""
        x = x + cuda.shfl_xor_sync(0xFFFFFFFF, x, 1)
        y = y + cuda.shfl_xor_sync(0xFFFFFFFF, y, 1)
        x = x + cuda.shfl_xor_sync(0xFFFFFFFF, x, 2)
        return x, y + cuda.shfl_xor_sync(0xFFFFFFFF, y, 2)

# %% [markdown]
# The kernel itself is chapter 10's paged prefill with the inner loop replaced; its
# arguments and its tile schedule are that kernel's, so the engine can take either. Q
# arrives as float32 activations and is rounded to bf16 once, into A fragments; the
# softmax runs in base 2 (the scale is multiplied by log₂ e, and `ex2` is one
# instruction). Every warp of a block runs the same number of key tiles — the
# tensor-core instructions need all 32 lanes, and the barriers all the block's
# threads — so a warp whose rows are past the sequence's end computes rows nobody
# stores.
#
# Three details come from measuring the first version (the section on speed below
# shows both):
#
# - **`warp_tiles`**: a warp may hold more than one 16-row tile of queries. Each
#   `ldmatrix` of K or V then feeds `warp_tiles` times as many `mma` — the C functions
#   loop over the row tiles inside the loop over fragments — at the cost of twice the
#   accumulator registers at `warp_tiles = 2`. A block is `block_q / (16 warp_tiles)`
#   warps.
# - **The mask only where it can bite.** A tile of keys that ends at or before the
#   warp's first row's last visible key is wholly visible to every row of the warp; only
#   the tiles on the causal diagonal (and the sequence's last) compare key against row.
#   The test is the same for the whole warp, so no lane takes another path.
# - **The scale in the exponent's multiply-add.** The row maximum is kept unscaled, and
#   each probability is `ex2(s·c − m·c)` with c = log₂e/√d: one fused multiply-add and
#   one `ex2` an element, where the first version multiplied every score first.

# %%
#| export kernels.tc_attention
import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.attention import (
    FLASH_BLOCK_Q,
    check_out,
    check_qkv,
    check_query_start_loc,
)
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.paged_attention import (
    TILE_MASK,
    TILE_SHIFT,
    host_array,
    prefill_tiles,
)
from tinyvllm_lib.kernels.paged_cache import cache_word, check_paged_context
from tinyvllm_lib.kernels.tc_attention_tiles import (
    attention_tile_functions,
    quad_max2,
    quad_sum2,
)
from tinyvllm_lib.kernels.tc_gemm import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_one,
)
from tinyvllm_lib.kernels.tensor_core import (
    SHARED_ALIGN,
    exp2_approx,
    ffi,
    pack_bf16x2,
    require_lto,
    twin_launch,
)

LOG2E = 1.4426950408889634
# the kernel's version, which its benchmark records carry: 1, a warp per 16 queries and
# every key tile masked (measured at 65234ef); 2, row tiles a warp (warp_tiles), the
# mask only where a tile reaches past a row's last key, the scale in one FFMA
TC_ATTENTION_VERSION = 2


def tc_block_q(head_dim: int) -> int:
    """Queries a block: at head_dim 64 (Llama 3.2 1B's), 128 — 4 warps of 2 row tiles,
    the fastest tile of the H200's sweep at every length it timed ("Which tile"
    below); at any other, chapter 7's 64. The engine packs its tile schedule at the
    block_q of the kernel it runs (prefill_block_q)."""
    return 128 if head_dim == 64 else FLASH_BLOCK_Q


def tc_warp_tiles(head_dim: int, block_q: int | None = None) -> int:
    """Row tiles of 16 queries a warp: two at head_dim 64 (the sweep's choice) where
    block_q is a multiple of 32, else one (at 128, O alone is 64 registers a row
    tile)."""
    fits = (block_q or tc_block_q(head_dim)) % 32 == 0
    return 2 if head_dim == 64 and fits else 1


def tc_block_k(head_dim: int) -> int:
    """Keys a tile: two stages of K and V tiles fit the 48 KiB of static shared
    memory (64 keys of 64 dimensions: 36 KiB; 32 of 128)."""
    return 64 if head_dim <= 64 else 32


def make_tc_prefill_kernel(head_dim: int, block_q: int | None = None,
                           block_k: int | None = None, warp_tiles: int | None = None):
    """Causal GQA attention of new tokens over a paged bf16 KV cache on the tensor
    cores: a block per (query head, entry of the tile schedule), a warp per 16
    warp_tiles queries, K and V tiles copied through the block table into shared
    memory by cp.async, the next tile on its way while the warps work on this one."""
    D, BQ = head_dim, block_q or tc_block_q(head_dim)
    BK = block_k or tc_block_k(head_dim)
    MT = warp_tiles or tc_warp_tiles(head_dim, BQ)
    WQ = 16 * MT  # queries a warp
    THREADS = 32 * (BQ // WQ) if BQ % WQ == 0 else 0
    WPR = D // 4  # 8-byte words in one key's row of one KV head
    ROW = WPR + 2  # a row in shared memory: 16 bytes of padding against bank conflicts
    STAGE = BK * ROW  # words of one stage of a tile
    CPR = D // 8  # 16-byte chunks in a key's row
    QW, SW, OW = D // 4, BK // 2, D // 2  # registers a lane and row tile: Q, S, O
    QN, SN, ON, RN = MT * QW, MT * SW, MT * OW, 2 * MT  # and a warp's; its rows a lane
    NT, DT = BK // 8, D // 8  # accumulator fragments of S and of O a row tile
    if D % 16 or BK % 16 or THREADS == 0 or (BK * CPR) % THREADS:
        raise ValueError(f"tensor-core attention needs head_dim and block_k multiples "
                         f"of 16, block_q a multiple of 16 warp_tiles, and a whole "
                         f"number of copies a thread; got head_dim {D}, block_q {BQ}, "
                         f"block_k {BK}, warp_tiles {MT}")
    CHUNKS = BK * CPR // THREADS  # chunks of K (and of V) each thread copies a tile
    qk_tile, pv_tile = attention_tile_functions(D, BK, ROW, MT)

    @cuda.jit
    def kernel(qkv, k_cache, v_cache, block_tables, block_shift, seq_lens,
               query_start_loc, tiles, num_heads, num_kv_heads, scale_log2, out):
        h, tid, tile = cuda.blockIdx.x, cuda.threadIdx.x, tiles[cuda.blockIdx.y]
        if tile < 0:  # an idle entry of a padded schedule: leave before waiting
            return
        wait_for_previous_kernel()
        warp, lane = tid // 32, tid % 32
        t = lane & 3  # the lane's column pair in a fragment
        seq, q_tile = tile >> TILE_SHIFT, tile & TILE_MASK
        start = query_start_loc[seq]
        num_new = query_start_loc[seq + 1] - start
        num_cached = seq_lens[seq] - num_new
        first_row = q_tile * BQ + warp * WQ  # the warp's first query
        num_keys = num_cached + min(num_new, (q_tile + 1) * BQ)  # causal: the block's
        # keys up to warp_last are visible to every row of the warp: no mask there
        warp_last = min(num_cached + first_row, num_keys - 1)
        kvh = uint32(h // (num_heads // num_kv_heads))
        bt_row = block_tables[seq]
        block_mask = (uint32(1) << block_shift) - uint32(1)
        k_tile = cuda.shared.array((2, STAGE), uint64, alignment=SHARED_ALIGN)
        v_tile = cuda.shared.array((2, STAGE), uint64, alignment=SHARED_ALIGN)
        qf = cuda.local.array(QN, uint32)  # Q: D / 16 A fragments a row tile
        s = cuda.local.array(SN, float32)  # S, then P: BK / 8 accumulators
        o = cuda.local.array(ON, float32)  # O: D / 8 accumulator fragments
        # a lane holds two rows of each row tile m: 2m (row r) and 2m + 1 (r + 8)
        last = cuda.local.array(RN, int32)  # the last key each row sees
        m_run = cuda.local.array(RN, float32)  # running maximum, unscaled
        l_run = cuda.local.array(RN, float32)  # this lane's part of the row's sum
        mx = cuda.local.array(RN, float32)
        corr = cuda.local.array(RN, float32)
        for r in range(RN):
            row = first_row + 16 * (r // 2) + 8 * (r % 2) + (lane >> 2)
            last[r] = min(num_cached + row, num_keys - 1)
            m_run[r], l_run[r] = float32(-math.inf), float32(0.0)
        for m in range(MT):  # Q rounded to bf16 in the A fragments' layout
            for kc in range(D // 16):
                for r in range(4):
                    row = first_row + 16 * m + 8 * (r % 2) + (lane >> 2)
                    col = h * D + 16 * kc + 8 * (r // 2) + 2 * t
                    lo, hi = float32(0.0), float32(0.0)
                    if row < num_new:
                        lo, hi = qkv[start + row, col], qkv[start + row, col + 1]
                    qf[m * QW + 4 * kc + r] = pack_bf16x2(lo, hi)
        for i in range(ON):
            o[i] = float32(0.0)
        num_tiles = (num_keys + BK - 1) // BK
        for it in range(num_tiles + 1):
            if it < num_tiles:  # start copying tile it into stage it % 2
                for u in range(CHUNKS):
                    c = tid + u * THREADS  # key c // CPR, 16 bytes c % CPR of its row
                    key = min(it * BK + c // CPR, num_keys - 1)  # past the end: last
                    word = cache_word(bt_row, uint32(key), block_shift, block_mask,
                                      uint32(num_kv_heads), kvh, WPR,
                                      uint32(2 * (c % CPR)))
                    at = (c // CPR) * ROW + 2 * (c % CPR)
                    cp_async16(ffi.from_buffer(k_tile[it % 2, at:]),
                               ffi.from_buffer(k_cache[word:]))
                    cp_async16(ffi.from_buffer(v_tile[it % 2, at:]),
                               ffi.from_buffer(v_cache[word:]))
            cp_async_commit()  # (an empty group on the last pass)
            if it == 0:
                continue
            cp_async_wait_one()  # this thread's copies of tile it - 1 have landed
            cuda.syncthreads()  # and every thread's
            stage, k_start = (it - 1) % 2, (it - 1) * BK
            qk_tile(ffi.from_buffer(s), ffi.from_buffer(qf),
                    ffi.from_buffer(k_tile[stage, 0:]))
            # the causal mask, only on the tiles that reach past some row's last key
            # (the same for the whole warp, so no lane diverges); each row's maximum
            if k_start + BK - 1 > warp_last:
                for m in range(MT):
                    for n in range(NT):
                        key = k_start + 8 * n + 2 * t
                        for e in range(4):
                            if key + e % 2 > last[2 * m + e // 2]:
                                s[m * SW + 4 * n + e] = float32(-math.inf)
            for m in range(MT):
                mx_a, mx_b = float32(-math.inf), float32(-math.inf)
                for n in range(NT):
                    i = m * SW + 4 * n
                    mx_a = max(mx_a, max(s[i], s[i + 1]))
                    mx_b = max(mx_b, max(s[i + 2], s[i + 3]))
                mx[2 * m], mx[2 * m + 1] = quad_max2(mx_a, mx_b)
            # the online softmax in base 2, the scale folded into one multiply-add an
            # element (every row sees key 0 in the first tile: the maxima are finite)
            for r in range(RN):
                new = max(m_run[r], mx[r])
                corr[r] = exp2_approx((m_run[r] - new) * scale_log2)
                m_run[r] = new
                l_run[r] *= corr[r]
                mx[r] = new * scale_log2  # the row's maximum, scaled
            for m in range(MT):
                for n in range(NT):
                    for e in range(4):
                        r, i = 2 * m + e // 2, m * SW + 4 * n + e
                        x = exp2_approx(s[i] * scale_log2 - mx[r])
                        l_run[r] += x
                        s[i] = x
                for n in range(DT):
                    for e in range(4):
                        o[m * OW + 4 * n + e] *= corr[2 * m + e // 2]
            pv_tile(ffi.from_buffer(o), ffi.from_buffer(s),
                    ffi.from_buffer(v_tile[stage, 0:]))
            cuda.syncthreads()  # done with the stage the next copy overwrites
        for m in range(MT):
            l_run[2 * m], l_run[2 * m + 1] = quad_sum2(l_run[2 * m], l_run[2 * m + 1])
        for r in range(RN):
            l_run[r] = float32(1.0) / l_run[r]
        for m in range(MT):
            for n in range(DT):
                for e in range(4):
                    row = first_row + 16 * m + 8 * (e // 2) + (lane >> 2)
                    col = h * D + 8 * n + 2 * t + e % 2
                    if row < num_new:
                        store_activation(out, start + row, col,
                                         o[m * OW + 4 * n + e] * l_run[2 * m + e // 2])

    kernel.block_q, kernel.block_k, kernel.head_dim = BQ, BK, D
    kernel.warp_tiles, kernel.threads = MT, THREADS
    kernel.reads_before_wait = True  # its schedule entry; it writes only after
    return require_lto(kernel)


_kernels = {}


def tc_prefill_kernel_for(head_dim: int, block_q: int | None = None,
                          block_k: int | None = None, warp_tiles: int | None = None):
    """The kernel for these sizes, built on first use and kept."""
    block_q = block_q or tc_block_q(head_dim)
    key = (head_dim, block_q, block_k or tc_block_k(head_dim),
           warp_tiles or tc_warp_tiles(head_dim, block_q))
    if key not in _kernels:
        _kernels[key] = make_tc_prefill_kernel(*key)
    return _kernels[key]


def tc_prefill_attention(qkv, k_cache, v_cache, block_tables, seq_lens,
                         query_start_loc, max_query_len: int, block_size: int,
                         num_heads: int, num_kv_heads: int, head_dim: int, out,
                         stream=0, block_q: int | None = None,
                         block_k: int | None = None, tiles=None,
                         warp_tiles: int | None = None):
    """paged_prefill_attention (chapter 10), same arguments and result, on the tensor
    cores; head_dim a multiple of 16. tiles: prefill_tiles(...) at this block_q;
    warp_tiles: row tiles of 16 queries a warp (block_q / 16 / warp_tiles warps)."""
    name = "tc_prefill_attention"
    num_tokens = check_qkv(name, qkv, num_heads, num_kv_heads, head_dim)
    check_out(name, out, (num_tokens, num_heads * head_dim))
    num_seqs = check_query_start_loc(name, query_start_loc, max_query_len, num_tokens)
    k64, v64 = check_paged_context(name, k_cache, v_cache, block_tables, seq_lens,
                                   block_size, num_seqs, num_kv_heads, head_dim,
                                   query_start_loc)
    block_q = block_q or tc_block_q(head_dim)
    kernel = tc_prefill_kernel_for(head_dim, block_q, block_k, warp_tiles)
    if num_tokens == 0 or max_query_len == 0:
        return out
    if tiles is None:
        tiles = cuda.to_device(
            prefill_tiles(host_array(query_start_loc), host_array(seq_lens), block_q),
            stream=stream)
    with twin_launch():
        kernel[(num_heads, tiles.shape[0]), kernel.threads, stream](
            qkv, k64, v64, block_tables, np.uint32(int(block_size).bit_length() - 1),
            seq_lens, query_start_loc, tiles, num_heads, num_kv_heads,
            np.float32(LOG2E / math.sqrt(head_dim)), out)
    return out


def prefill_attention_for(backend: str, head_dim: int):
    """The launcher of prefill attention an engine with EngineConfig.attention_backend
    = backend uses: "simt" chapter 10's kernel, "tensor_cores" this chapter's (a
    ValueError where head_dim is not a multiple of 16), "auto" this chapter's on a GPU
    where head_dim allows (the simulator takes chapter 10's: its twins are slow)."""
    from numba import config

    from tinyvllm_lib.kernels.paged_attention import paged_prefill_attention

    fits = head_dim % 16 == 0
    if backend == "tensor_cores" and not fits:
        raise ValueError(f"attention_backend='tensor_cores' needs a head size that is "
                         f"a multiple of 16, got {head_dim}")
    if backend == "tensor_cores" or (backend == "auto" and fits
                                     and not config.ENABLE_CUDASIM):
        return tc_prefill_attention
    return paged_prefill_attention


def prefill_block_q(prefill_attention, head_dim: int) -> int:
    """Queries a tile of the schedule that launcher takes (what the engine packs its
    tile schedule at): this chapter's tc_block_q, chapter 10's FLASH_BLOCK_Q."""
    return tc_block_q(head_dim) if prefill_attention is tc_prefill_attention \
        else FLASH_BLOCK_Q


tc_prefill_d64_kernel = tc_prefill_kernel_for(64)
tc_prefill_d128_kernel = tc_prefill_kernel_for(128)
# the other choice of row tiles a warp at head_dim 64, compiled in CI's PTX check too
tc_prefill_d64_other_kernel = tc_prefill_kernel_for(
    64, warp_tiles=3 - tc_warp_tiles(64))
_ARGS = ("float32[:, ::1], uint64[::1], uint64[::1], int32[:, ::1], uint32, "
         "int32[::1], int32[::1], int32[::1], int64, int64, float32")
PTX_SIGNATURES = {
    name: [f"void({_ARGS}, {out}[:, ::1])" for out in ("float32", "uint16")]
    for name in ("tc_prefill_d64_kernel", "tc_prefill_d128_kernel",
                 "tc_prefill_d64_other_kernel")
}

# %% [markdown]
# ## Is it right?
#
# The kernel rounds Q and P to bf16, which chapter 10's float32 reference does not, so
# it cannot match that reference to float32's precision. How close should it be?
# FlashAttention's own tests answer with a second reference: the same attention in
# PyTorch (here NumPy), rounded where the kernel rounds. The kernel passes if its error
# against float32 is at most twice that reference's error (plus a hair for the order of
# additions).

# %%
#| export kernels.tc_attention
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits


def _round_bf16(x) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, np.float32)))


def paged_prefill_attention_bf16_ref(q, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, block_size, num_heads,
                                     num_kv_heads, head_dim):
    """chapter 10's reference rounded where the tensor cores round: Q, and the
    probabilities exp(s - max) before they multiply V (their sum stays float32)."""
    q = _round_bf16(np.asarray(q, np.float32).reshape(-1, num_heads, head_dim))
    out = np.zeros((q.shape[0], num_heads * head_dim), np.float32)
    starts = np.asarray(query_start_loc)
    group = num_heads // num_kv_heads
    for s, seq_len in enumerate(np.asarray(seq_lens)[: len(starts) - 1]):
        start, end = starts[s], starts[s + 1]
        pos = np.arange(seq_len)
        slots = (np.asarray(block_tables)[s, pos // block_size].astype(np.int64)
                 * block_size + pos % block_size)
        k = bf16_bits_to_f32(k_cache[slots]).astype(np.float64)  # (seq_len, KVH, D)
        v = bf16_bits_to_f32(v_cache[slots]).astype(np.float64)
        query_pos = seq_len - (end - start) + np.arange(end - start)
        visible = pos[None, :] <= query_pos[:, None]
        for h in range(num_heads):
            scores = q[start:end, h].astype(np.float64) @ k[:, h // group].T
            scores = np.where(visible, scores / math.sqrt(head_dim), -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            o = _round_bf16(p).astype(np.float64) @ v[:, h // group]
            cols = slice(h * head_dim, (h + 1) * head_dim)
            out[start:end, cols] = o / p.sum(axis=1, keepdims=True)
    return out


# %% [markdown]
# A ragged batch that exercises everything at once: grouped heads (4 query heads over 2
# KV heads), a sequence with nothing cached, one after cached tokens, lengths that are
# not multiples of any tile, shuffled block tables, and cache slots outside every
# context filled with NaN, so a key read from the wrong place cannot go unnoticed.

# %%
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.kv_cache_write import write_kv_cache_ref
from tinyvllm_lib.kernels.paged_attention import paged_prefill_attention_ref
from tinyvllm_lib.kernels.tc_attention import (
    paged_prefill_attention_bf16_ref,
    tc_prefill_attention,
)


def ragged_case(rng, seqs, H, KVH, D, block_size):
    """qkv of the new tokens and paged bf16 caches for seqs = [(cached, new), ...]."""
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    max_blocks = max(cdiv(int(n), block_size) for n in seq_lens)
    tables = rng.permutation(len(seqs) * max_blocks + 2)[: len(seqs) * max_blocks]
    tables = tables.reshape(len(seqs), max_blocks).astype(np.int32)
    shape = ((len(seqs) * max_blocks + 2) * block_size, KVH, D)
    k_cache = np.full(shape, 0x7FC0, np.uint16)  # NaN: what no context may read
    v_cache = np.full(shape, 0x7FC0, np.uint16)
    qkv = rng.standard_normal((starts[-1], (H + 2 * KVH) * D)).astype(np.float32)
    qkv[:, : H * D] *= 3  # peaked attention
    new_slots = []
    for s, (cached, new) in enumerate(seqs):
        pos = np.arange(cached + new)
        slots = tables[s, pos // block_size] * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            cache[slots[:cached]] = f32_to_bf16_bits(
                rng.standard_normal((cached, KVH, D)).astype(np.float32))
        new_slots.append(slots[cached:])
    write_kv_cache_ref(qkv, H, KVH, np.concatenate(new_slots), k_cache, v_cache)
    return qkv, k_cache, v_cache, tables, seq_lens, starts


def check_tc_attention(rng, seqs, H, KVH, D, block_size, block_q=16, block_k=32):
    """The kernel against float32 and against the bf16-rounded reference; returns the
    kernel's and the rounded reference's largest errors."""
    case = ragged_case(rng, seqs, H, KVH, D, block_size)
    out = cuda.to_device(np.full((len(case[0]), H * D), np.nan, np.float32))
    max_query_len = int(np.diff(case[5]).max())
    tc_prefill_attention(*map(cuda.to_device, case), max_query_len, block_size, H, KVH,
                         D, out, block_q=block_q, block_k=block_k)
    got = out.copy_to_host()
    exact = paged_prefill_attention_ref(case[0][:, : H * D], *case[1:], block_size, H,
                                        KVH, D)
    rounded = paged_prefill_attention_bf16_ref(case[0][:, : H * D], *case[1:],
                                               block_size, H, KVH, D)
    return float(np.abs(got - exact).max()), float(np.abs(rounded - exact).max())


if can_launch():
    shapes = ((4, 2, 32, 8, 16, 32) if is_simulator() else (32, 8, 64, 16, 64, 64))
    H, KVH, D, block_size, bq, bk = shapes
    seqs = [(0, 21), (37, 9)] if is_simulator() else [(0, 1000), (4096, 333), (5, 77)]
    err, ref_err = check_tc_attention(rng, seqs, H, KVH, D, block_size, bq, bk)
    print(f"tensor-core attention: max error {err:.2e} against float32; the "
          f"bf16-rounded reference's {ref_err:.2e}")
    assert err <= 2 * ref_err + 1e-5, (err, ref_err)
    prose.glue("ch14_err", f"{err:.1e}")
    prose.glue("ch14_ref_err", f"{ref_err:.1e}")
    prose.glue("ch14_err_verdict", (
        "the same as the rounded reference's: the two roundings explain all of it"
        if err <= 1.05 * ref_err else
        "within twice the rounded reference's: the roundings explain most of it, the "
        "order of the additions the rest"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The kernel's largest error against float32 is {{ch14_err}}, {{ch14_err_verdict}}
({{ch14_ref_err}}). On a GPU the same check runs at the engine's shapes (the tests'
`test_tc_attention_on_the_gpu`); until one has run it, the kernel's fragment addresses
in C have been checked only by compiling them and by emulating the PTX instructions.
""")

# %% [markdown]
# ## What the compiler made of it
#
# Two things decide whether this is fast, and both can be checked with no GPU. The
# link step must inline the C functions, or every call passes its fragments through
# memory; and every loop over fragments must be unrolled, because a register cannot be
# indexed at run time — a local array indexed by a loop variable lives in *local
# memory*, which is as slow as global memory. numba-cuda can link with link-time
# optimisation (LTO): NVVM compiles the kernel and NVRTC the C to LTO-IR, and nvJitLink
# optimises them as one program. Asking nvJitLink for PTX instead of machine code shows
# the result. (It takes numba-cuda's internals — `_compile_pyfunc_with_fixup`, and the
# flag a launch sets on the code library — which a later numba-cuda may change; the
# kernels' `PTX_SIGNATURES`, as in every chapter, say which types to compile for.)
# `linked_ptx_counts` does that in a fresh interpreter (this page may be running in the
# simulator) and counts instructions:

# %%
#| export
_LINKED_PTX_SCRIPT = """
import json, re, sys, types
import importlib
import numba.cuda.dispatcher as cuda_dispatcher
cc90 = types.SimpleNamespace(compute_capability=(9, 0))
cuda_dispatcher.get_current_device = lambda: cc90  # no GPU: compile for sm_90
from numba.cuda.compiler import _compile_pyfunc_with_fixup
module, name, signature = sys.argv[1:4]
kernel = getattr(importlib.import_module(module), name)
library, _ = _compile_pyfunc_with_fixup(
    kernel.py_func, signature, device=False, cc=(9, 0), lto=True, debug=False,
    lineinfo=False, fastmath=False, opt=True, abi="numba", abi_info=None,
    forceinline=False, launch_bounds=None)
library._lto = True  # as a launch links it: numba-cuda uses LTO wherever nvJitLink is
ptx = library.get_lto_ptx(cc=(9, 0))
patterns = {"mma.sync": r"\\bmma\\.sync", "ldmatrix": r"\\bldmatrix",
            "cp.async": r"\\bcp\\.async\\.cg", "shfl": r"\\bshfl",
            "ex2": r"\\bex2", "local memory": r"\\b(?:ld|st)\\.local",
            "call": r"\\bcall\\b", "shared align 16": r"\\.shared\\s+\\.align\\s+16",
            "cp.async wait": r"\\bcp\\.async\\.wait_group"}
print(json.dumps({k: len(re.findall(p, ptx)) for k, p in patterns.items()}))
"""


def linked_ptx_counts(module: str, kernel: str) -> dict[str, int]:
    """Instruction counts in the PTX for sm_90 of `module`.`kernel` (its first
    PTX_SIGNATURES entry) after link-time optimisation with its C functions, compiled in
    a fresh interpreter without the simulator: needs NVRTC and nvJitLink, no GPU."""
    import importlib
    import json
    import os
    import subprocess
    import sys

    signature = importlib.import_module(module).PTX_SIGNATURES[kernel][0]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run(
        [sys.executable, "-c", _LINKED_PTX_SCRIPT, module, kernel, signature],
        capture_output=True, text=True, env=env, timeout=600,
    )
    if res.returncode:
        raise RuntimeError(f"linking {kernel} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# %%
from tinyvllm_lib.kernels.tensor_core import linked_ptx_counts

counts = linked_ptx_counts("tinyvllm_lib.kernels.tc_attention", "tc_prefill_d64_kernel")
print("attention:", counts)
from tinyvllm_lib.kernels.tc_attention import tc_warp_tiles

# S and O: (D / 16) x (BK / 8) mma each, for each row tile of the warp
per_tile = 2 * tc_warp_tiles(64) * (64 // 16) * (64 // 8)
assert counts["mma.sync"] == per_tile and counts["local memory"] == 0
assert counts["call"] == 0
prose.glue("ch14_mma", counts["mma.sync"])
prose.glue("ch14_ldsm", counts["ldmatrix"])
prose.glue("ch14_rows", f"{16 * tc_warp_tiles(64)}")
gemm_counts = linked_ptx_counts("tinyvllm_lib.kernels.tc_gemm", "tc_gemm_kernel")
print("GEMM:", gemm_counts)
assert gemm_counts["mma.sync"] == 32 and gemm_counts["local memory"] == 0
prose.glue("ch14_gemm_mma", gemm_counts["mma.sync"])
prose.glue("ch14_gemm_cp", gemm_counts["cp.async"])

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The loop over key tiles holds {{ch14_mma}} `mma.sync` and {{ch14_ldsm}} `ldmatrix`
(one warp's {{ch14_rows}} queries × 64 keys × 64 dimensions, twice, in 16×8×16
pieces), no call,
and no load or store of local memory: the C functions were inlined and every fragment
is a register. The GEMM's loop over K tiles holds {{ch14_gemm_mma}} `mma.sync` (a
warp's 64×32 piece over 32 of K) and {{ch14_gemm_cp}} `cp.async`, and no local memory
either. What the hardware then makes of them — registers per thread, and whether
`ptxas` spills any — shows in the SASS on a GPU (`kernel.inspect_sass()`), which the
benchmark script checks.
""")

# %% [markdown]
# ## In the engine
#
# The kernel takes chapter 10's arguments and reads chapter 10's tile schedule, packed
# at its own `block_q` (`tc_block_q`: 128 queries an entry at head size 64, 64 at 128;
# the engine asks `prefill_block_q` which, for the launcher it picked, and packs its
# tiles at that), so the engine swaps it in without changing anything else: the CUDA
# graphs of chapter 11 capture prefill steps with it as they captured the SIMT kernel.
# The choice is one field of the engine's configuration (vLLM calls its own field
# `attention_backend` too, with values named after its kernels):
#
# ```python
# LLM(model, attention_backend="tensor_cores")   # or "simt"; "auto" is the default
# ```
#
# `"auto"` takes the tensor cores on a GPU whenever the head size is a multiple of 16
# (every Llama is), and chapter 10's kernel in the simulator, where the twins are slow.
# The measurements below are what keep it: they set the two kernels side by side at
# every length the benchmark script times, and the engine's tests run with it.
# Decode-only steps are another matter: one query row per sequence leaves a 16-row
# fragment mostly empty, and a decode step waits on reading the cache, not on
# arithmetic. The next section tries the tensor cores there anyway, and measures from
# how many rows they win: `"auto"` keeps chapter 8's split decode kernel below
# `TC_DECODE_MIN_ROWS` rows and takes the tensor-core one from there on. A mixed
# step's decode rows ride in the prefill kernel as one-token sequences, each a whole
# tile of `block_q` rows — correct, and wasteful in a way the measurement below can
# price.

# %% [markdown]
# ## Decode on the tensor cores
#
# A decode step has one query a sequence, and chapter 8 gave it a kernel of its own that
# waits on reading the cache. At batch 256 every step reads every sequence's whole
# context through it, and chapter 8 measured it below the bandwidth ceiling
# (`bench/ch11_throughput_profile.py` prices it, kernel by kernel, on nano-vllm's
# workload). Its SIMT loop spends tens of warp instructions a key of a KV head —
# unpacking bf16, four dot products a lane, shuffles to add a key's lanes, exponentials,
# the weighted add of V. If those instructions, not the bytes, are what hold it back,
# the tensor cores should help.
#
# The tensor cores take the arithmetic off the warp. Llama 3.2 1B has four query heads a
# KV head; put them as rows 0–3 of an A fragment (rows 4–15 zero) and one `m16n8k16`
# multiplies all four against eight keys. Three quarters of the tensor core's work is
# wasted on zero rows, and it does not matter: a warp does sixteen keys with 8 `mma`
# for S = QKᵀ and 8 for O += PV (at head size 64), against the SIMT loop's tens of
# instructions a key. The kernel below reuses this chapter's tile functions at 16 keys
# a warp: a block per (KV head, sequence, split) exactly as chapter 8's, so its grid,
# its flash-decoding splits and the end of its work (`split_finish`, shared with
# chapter 8) are the same; a tile of 64 keys (16 a warp) is copied by `cp.async`
# through the block table while the warps work on the one before (`stages` sets how
# many tiles are on their way). Each warp keeps its own online softmax; at the end the
# warps' (maximum, sum, output) are merged through shared memory.

# %% [markdown]
# First its sizes: the block's shape (warps, and stages of tiles in flight), the shared
# memory that shape declares, checked against the 48 KiB a kernel may declare
# statically, and a `cp.async` wait whose count — part of the instruction — follows
# the number of stages. They go to `tc_decode_shapes`.

# %%
#| export kernels.tc_decode_shapes
from numba import config, cuda, types

from tinyvllm_lib.kernels.reduce import WARP_SIZE

TC_DECODE_KEYS = 16  # keys a warp takes from each tile: one k-step of P V
TC_DECODE_MAX_GROUP = 8  # query heads a KV head: the rows of a fragment's top half
STATIC_SHARED_BYTES = 48 * 1024  # what a kernel may declare without opting in to more


def tc_decode_shape(head_dim: int) -> tuple[int, int]:
    """(warps a block, stages of K and V tiles): at head size 64, 4 warps (64-key
    tiles) in 2 stages, the shape measured below; above, 2 warps in 2 stages. Deeper
    pipelines (3 warps in 3 stages, 2 in 4, 1 in 6) fit the same 48 KiB of static
    shared memory: bench/ch14_tc_decode.py times them beside this one."""
    return (4, 2) if head_dim <= 64 else (2, 2)


def tc_decode_shared_bytes(head_dim: int, group: int, num_warps: int,
                           stages: int) -> int:
    """Shared memory the kernel declares: its stages of K and V tiles (rows padded by
    16 bytes), each warp's maxima, sums and outputs, the block's maxima, and
    split_finish's weights and flag."""
    rows = num_warps * TC_DECODE_KEYS * (head_dim // 4 + 2)
    per_warp = (2 * group + group * head_dim) * 4
    return (2 * stages * rows * 8 + num_warps * per_warp + group * 4
            + WARP_SIZE * group * 4 + 4)


def cp_async_wait_function(pending: int):
    """A device function that waits until at most `pending` groups of copies (the
    newest) are still in flight: the wait's count is part of the instruction."""
    if config.ENABLE_CUDASIM:
        return lambda: None  # twin: nothing is in flight
    from numba.cuda import CUSource

    src = CUSource(rf"""
extern "C" __device__ void cp_async_wait_{pending}() {{
  asm volatile("cp.async.wait_group {pending};" ::: "memory");
}}""")
    return cuda.declare_device(f"cp_async_wait_{pending}", types.void(), link=src,
                               abi="c")


# %%
#| export kernels.tc_decode
import math

from numba import config, cuda, float32, uint32, uint64

from tinyvllm_lib.kernels.decode_attention import decode_attention
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.decode_attention_kernel import decode_args_signature
from tinyvllm_lib.kernels.decode_combine import INLINE, split_finish
from tinyvllm_lib.kernels.decode_rope import make_newest_kv_writer, rope_angle, rotated
from tinyvllm_lib.kernels.decode_splits import (
    num_splits_for_on_device,
    split_length_on_device,
    split_rows,
    split_rows_on_device,
)
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.paged_cache import cache_word
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE
from tinyvllm_lib.kernels.tc_attention_tiles import (
    attention_tile_functions,
    quad_max2,
    quad_sum2,
)
from tinyvllm_lib.kernels.tc_decode_shapes import (
    STATIC_SHARED_BYTES,
    TC_DECODE_KEYS,
    TC_DECODE_MAX_GROUP,
    cp_async_wait_function,
    tc_decode_shape,
    tc_decode_shared_bytes,
)
from tinyvllm_lib.kernels.tc_gemm import cp_async16, cp_async_commit
from tinyvllm_lib.kernels.tensor_core import (
    SHARED_ALIGN,
    exp2_approx,
    ffi,
    pack_bf16x2,
    require_lto,
)


def make_tc_decode_kernel(head_dim: int, group: int, num_warps: int | None = None,
                          stages: int | None = None, fuse_rope: bool = False):
    """Decode attention on the tensor cores: a block per (KV head, row, split), as
    chapter 8's kernel; the block's K and V tiles (16 keys a warp) copied through the
    block table by cp.async, stages - 1 of them on their way while the warps work on
    another. A warp's A fragments hold the group's query heads as rows (the rest
    zero), so one m16n8k16 tile serves every query head of the KV head; each warp
    keeps its own online softmax, merged through shared memory at the end.
    fuse_rope: chapter 8's, q rotated as it is packed and the newest K/V stored by the
    block that reads it, before its first copy."""
    W, NS = tc_decode_shape(head_dim)
    D, G = head_dim, group
    W, NS = W if num_warps is None else num_warps, NS if stages is None else stages
    if D % 16 or not 1 <= G <= TC_DECODE_MAX_GROUP or W < 1 or NS < 2:
        raise ValueError(f"tensor-core decode needs head_dim a multiple of 16, 1 to "
                         f"{TC_DECODE_MAX_GROUP} query heads a KV head, a warp and two "
                         f"stages; got head_dim {D}, group {G}, {W} warps, {NS} "
                         f"stages")
    BKW, THREADS = TC_DECODE_KEYS, W * WARP_SIZE
    BK = W * BKW  # keys a tile of the block
    WPR, ROW, CPR = D // 4, D // 4 + 2, D // 8  # words of a row; in shared; chunks
    STAGE, CHUNKS = BK * ROW, BK * (D // 8) // THREADS
    shared = tc_decode_shared_bytes(D, G, W, NS)
    if shared > STATIC_SHARED_BYTES:
        raise ValueError(f"tensor-core decode at head_dim {D}, group {G}, {W} warps "
                         f"and {NS} stages needs {shared:,} bytes of shared memory, "
                         f"more than a kernel's {STATIC_SHARED_BYTES:,} of static "
                         f"shared memory")
    QW, SW, OW = D // 4, BKW // 2, D // 2  # a lane's registers: Q, S (then P), O
    NT, DT, GD = BKW // 8, D // 8, G * D
    PER_THREAD = (GD + THREADS - 1) // THREADS  # outputs a thread merges at the end
    qk_tile, pv_tile = attention_tile_functions(D, BKW, ROW)
    finish = split_finish(D, G, W)
    cp_async_wait = cp_async_wait_function(NS - 1)
    write_newest = make_newest_kv_writer(D, THREADS)  # fuse_rope's store
    HALF = D // 2

    @cuda.jit(device=True, **INLINE)
    def q_value(qkv, s, head, col, c, sn):
        # q[s, head, col], rotated by RoPE at angle (c, sn) (fuse_rope) as it is loaded
        x = qkv[s, head + col]
        if fuse_rope:
            upper = col >= uint32(HALF)
            other = col - uint32(HALF) if upper else col + uint32(HALF)
            x = rotated(x, qkv[s, head + other], c, sn, upper)
        return x

    @cuda.jit
    def kernel(qkv, k_cache, v_cache, block_tables, block_shift, context_lens,
               positions, rope_cos, rope_sin, slot_mapping, scale_log2, split_keys,
               min_split_keys, target_blocks, workspace, out):
        # fuse_rope: the row's position, slot and this lane's angles before the wait
        # (the step's inputs and the table: no kernel of the step writes them)
        # column 16 kc + 8 h + 2 t + j's angle at 4 kc + 2 h + j
        cq = cuda.local.array(QW, float32)
        sq = cuda.local.array(QW, float32)
        row = uint32(cuda.blockIdx.y)
        pos = positions[row] if fuse_rope else 0
        slot = slot_mapping[row] if fuse_rope else -1
        if fuse_rope:
            pair0 = uint32(2) * (uint32(cuda.threadIdx.x) & uint32(3))
            for kc in range(D // 16):
                for h in range(2):
                    for j in range(2):
                        col = uint32(16 * kc + 8 * h + j) + pair0
                        cq[4 * kc + 2 * h + j], sq[4 * kc + 2 * h + j] = rope_angle(
                            pos, rope_cos, rope_sin, col % uint32(HALF))
        wait_for_previous_kernel()
        kvh, s, split = (uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y),
                         uint32(cuda.blockIdx.z))
        n = uint32(context_lens[s])
        num_splits = num_splits_for_on_device(
            n, uint32(cuda.gridDim.z),
            uint32(cuda.gridDim.x) * split_rows_on_device(uint32(cuda.gridDim.y)),
            uint32(split_keys), uint32(target_blocks), uint32(min_split_keys))
        split_len = split_length_on_device(n, num_splits, uint32(BK))
        begin = uint32(split * split_len)
        if split > 0 and begin >= n:  # past this sequence's last split
            return
        end = min(n, uint32(begin + split_len))
        tid = uint32(cuda.threadIdx.x)
        warp, lane = tid // uint32(WARP_SIZE), tid % uint32(WARP_SIZE)
        t, g_row = lane & uint32(3), lane >> uint32(2)  # column pair; query head (row)
        bt_row = block_tables[s]
        block_mask = (uint32(1) << block_shift) - uint32(1)
        num_kv_heads = uint32(cuda.gridDim.x)
        k_tile = cuda.shared.array((NS, STAGE), uint64, alignment=SHARED_ALIGN)
        v_tile = cuda.shared.array((NS, STAGE), uint64, alignment=SHARED_ALIGN)
        sm_m = cuda.shared.array((W, G), float32)  # each warp's maximum and sum a row
        sm_l = cuda.shared.array((W, G), float32)
        sm_o = cuda.shared.array((W, GD), float32)  # and its unnormalised output
        sm_block_top = cuda.shared.array(G, float32)
        scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)  # simulator's shuffles
        qf = cuda.local.array(QW, uint32)
        sc = cuda.local.array(SW, float32)
        o = cuda.local.array(OW, float32)
        m_run = cuda.local.array(2, float32)  # rows g_row and g_row + 8 (unused)
        l_run = cuda.local.array(2, float32)
        mx = cuda.local.array(2, float32)
        corr = cuda.local.array(2, float32)
        for kc in range(D // 16):  # Q in A fragments: row g the group's query head g
            for r in range(4):
                col = 16 * kc + 8 * (r // 2) + 2 * t
                lo, hi = float32(0.0), float32(0.0)
                if r % 2 == 0 and g_row < G:
                    head = (kvh * uint32(G) + g_row) * uint32(D)
                    a = 4 * kc + r  # r is 0 or 2: h = r // 2, so 4 kc + 2 h
                    lo = q_value(qkv, s, head, uint32(col), cq[a], sq[a])
                    hi = q_value(qkv, s, head, uint32(col + 1), cq[a + 1], sq[a + 1])
                qf[4 * kc + r] = pack_bf16x2(lo, hi)
        # the newest key is this block's: store it, after Q's loads are issued
        if fuse_rope and end == n and n > 0:
            write_newest(qkv, pos, rope_cos, rope_sin, slot, s, kvh,
                         num_kv_heads * uint32(G), num_kv_heads, k_cache, v_cache, tid)
            cuda.syncthreads()  # the stores, before any thread copies a tile
        for i in range(OW):
            o[i] = float32(0.0)
        for r in range(2):
            m_run[r], l_run[r] = float32(-math.inf), float32(0.0)
        num_tiles = (end - begin + uint32(BK - 1)) // uint32(BK)
        for it in range(num_tiles + uint32(NS - 1)):
            if it < num_tiles:  # start copying tile it into stage it % NS
                for u in range(CHUNKS):
                    c = tid + uint32(u * THREADS)  # key c // CPR, 16 bytes c % CPR
                    key = min(begin + uint32(it * BK) + c // uint32(CPR),
                              end - uint32(1))  # past the end: the last key, masked
                    word = cache_word(bt_row, key, block_shift, block_mask,
                                      num_kv_heads, kvh, WPR,
                                      uint32(2 * (c % uint32(CPR))))
                    at = (c // uint32(CPR)) * uint32(ROW) + uint32(2) * (
                        c % uint32(CPR))
                    cp_async16(ffi.from_buffer(k_tile[it % NS, at:]),
                               ffi.from_buffer(k_cache[word:]))
                    cp_async16(ffi.from_buffer(v_tile[it % NS, at:]),
                               ffi.from_buffer(v_cache[word:]))
            cp_async_commit()  # (an empty group past the last tile)
            if it < NS - 1:
                continue
            cp_async_wait()  # this thread's copies of tile j = it - (NS - 1) landed
            cuda.syncthreads()  # and every thread's
            j = it - uint32(NS - 1)
            stage = j % NS
            k0 = begin + uint32(j * BK) + warp * uint32(BKW)  # the warp's keys
            mine = warp * uint32(BKW * ROW)
            qk_tile(ffi.from_buffer(sc), ffi.from_buffer(qf),
                    ffi.from_buffer(k_tile[stage, mine:]))
            if k0 + uint32(BKW) > end:  # keys past the context (the last tile only)
                for nt in range(NT):
                    for e in range(4):
                        if k0 + uint32(8 * nt + e % 2) + uint32(2) * t >= end:
                            sc[4 * nt + e] = float32(-math.inf)
            mx_a, mx_b = float32(-math.inf), float32(-math.inf)
            for nt in range(NT):
                mx_a = max(mx_a, max(sc[4 * nt], sc[4 * nt + 1]))
                mx_b = max(mx_b, max(sc[4 * nt + 2], sc[4 * nt + 3]))
            mx[0], mx[1] = quad_max2(mx_a, mx_b)
            for r in range(2):  # the online softmax in base 2, as the prefill kernel's
                new = max(m_run[r], mx[r])
                if new == -math.inf:  # no key of this warp yet: nothing to rescale
                    corr[r], mx[r] = float32(1.0), float32(0.0)
                else:
                    corr[r] = exp2_approx((m_run[r] - new) * scale_log2)
                    mx[r] = new * scale_log2
                m_run[r] = new
                l_run[r] *= corr[r]
            for nt in range(NT):
                for e in range(4):
                    x = exp2_approx(sc[4 * nt + e] * scale_log2 - mx[e // 2])
                    l_run[e // 2] += x
                    sc[4 * nt + e] = x
            for nt in range(DT):
                for e in range(4):
                    o[4 * nt + e] *= corr[e // 2]
            pv_tile(ffi.from_buffer(o), ffi.from_buffer(sc),
                    ffi.from_buffer(v_tile[stage, mine:]))
            cuda.syncthreads()  # done with the stage the next copy overwrites
        l_run[0], l_run[1] = quad_sum2(l_run[0], l_run[1])
        if g_row < G:  # the warp's partial for query head g_row, through shared memory
            sm_m[warp, g_row], sm_l[warp, g_row] = m_run[0], l_run[0]
            for nt in range(DT):
                for e in range(2):
                    col = uint32(8 * nt + e) + uint32(2) * t
                    sm_o[warp, g_row * uint32(D) + col] = o[4 * nt + e]
        cuda.syncthreads()
        num = cuda.local.array(PER_THREAD, float32)
        den = cuda.local.array(PER_THREAD, float32)
        for j in range(PER_THREAD):
            num[j], den[j] = float32(0.0), float32(0.0)
            i = tid + uint32(j * THREADS)
            if i < GD:
                g = i // uint32(D)
                top = sm_m[0, g]
                for w in range(1, W):
                    top = max(top, sm_m[w, g])
                for w in range(W):
                    if sm_m[w, g] > -math.inf:
                        f = exp2_approx((sm_m[w, g] - top) * scale_log2)
                        num[j] += f * sm_o[w, i]
                        den[j] += f * sm_l[w, g]
                if i % uint32(D) == 0:
                    sm_block_top[g] = top * scale_log2  # base 2, as chapter 8's
        cuda.syncthreads()
        finish(num, den, sm_block_top, workspace, out, s, split, kvh, n, split_len,
               end >= n and split == 0, scratch)

    kernel.head_dim, kernel.group, kernel.num_warps = D, G, W
    kernel.keys_per_step, kernel.stages, kernel.fuse_rope = BK, NS, fuse_rope
    kernel.reads_before_wait = fuse_rope  # its positions and angles (tests/test_ptx.py)
    return require_lto(kernel)


_TC_DECODE_KERNELS = {}


def tc_decode_kernel_for(head_dim: int, group: int,
                         cfg: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
                         num_warps: int | None = None, stages: int | None = None,
                         fuse_rope: bool = False):
    """The tensor-core decode kernel for these sizes (chapter 8's kernel_for
    signature: the config's compile-time knobs do not apply; num_warps and stages
    default to tc_decode_shape's), built on first use."""
    warps, depth = tc_decode_shape(head_dim)
    key = (head_dim, group, warps if num_warps is None else num_warps,
           depth if stages is None else stages, fuse_rope)
    if key not in _TC_DECODE_KERNELS:
        _TC_DECODE_KERNELS[key] = make_tc_decode_kernel(*key)
    return _TC_DECODE_KERNELS[key]


# Llama 3.2 1B's, for CI's PTX: RoPE outside, and inside
tc_decode_d64_g4_kernel = tc_decode_kernel_for(64, 4)
tc_decode_d64_g4_rope_kernel = tc_decode_kernel_for(64, 4, fuse_rope=True)
PTX_SIGNATURES = {
    name: [f"void({decode_args_signature(fuse)}, {out}[:, ::1])"
           for out in ("float32", "uint16")]
    for name, fuse in (("tc_decode_d64_g4_kernel", False),
                       ("tc_decode_d64_g4_rope_kernel", True))
}


def tc_decode_attention(qkv, k_cache, v_cache, block_tables, block_size: int,
                        context_lens, num_heads: int, num_kv_heads: int,
                        head_dim: int, out, stream=0, workspace=None,
                        max_context_len=None,
                        config: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
                        rope=None, slot_mapping=None):
    """Chapter 8's decode_attention, same arguments, grid and splits (RoPE and the
    newest K/V inside with rope= and slot_mapping=), with this kernel."""
    return decode_attention(qkv, k_cache, v_cache, block_tables, block_size,
                            context_lens, num_heads, num_kv_heads, head_dim, out,
                            stream=stream, workspace=workspace,
                            max_context_len=max_context_len, config=config,
                            kernel_for=tc_decode_kernel_for, rope=rope,
                            slot_mapping=slot_mapping)


tc_decode_attention.fuses_rope = True


# Decode steps of at least this many rows (rounded as split_rows rounds them) take
# this kernel under "auto": chosen from the H200's runs at 64 and 256 rows; the
# records' section below says where each GPU's rows sweep puts the crossing
TC_DECODE_MIN_ROWS = 128


def auto_decode_attention(qkv, *args, **kwargs):
    """decode_attention's arguments: chapter 8's kernel for fewer than
    TC_DECODE_MIN_ROWS rows, this chapter's from there on. The rows are rounded up as
    split_rows rounds them, to a CUDA graph's size: a step run eagerly takes the kernel
    that its padded, captured twin holds, so the two give the same bits."""
    launcher = (tc_decode_attention
                if split_rows(qkv.shape[0]) >= TC_DECODE_MIN_ROWS
                else decode_attention)
    return launcher(qkv, *args, **kwargs)


auto_decode_attention.fuses_rope = True  # both launchers take rope= and slot_mapping=


def decode_attention_for(backend: str, head_dim: int, group: int):
    """The decode launcher of an engine with attention_backend = backend:
    "tensor_cores" this kernel (a ValueError where the sizes do not fit), "simt"
    chapter 8's, "auto" auto_decode_attention on a GPU where the sizes fit (else, and
    in the simulator, chapter 8's)."""
    fits = (head_dim % 16 == 0 and 1 <= group <= TC_DECODE_MAX_GROUP
            and tc_decode_shared_bytes(head_dim, group, *tc_decode_shape(head_dim))
            <= STATIC_SHARED_BYTES)
    if backend == "tensor_cores" and not fits:
        raise ValueError(f"attention_backend='tensor_cores' decodes with head sizes "
                         f"that are multiples of 16, at most {TC_DECODE_MAX_GROUP} "
                         f"query heads a KV head, and tiles within "
                         f"{STATIC_SHARED_BYTES:,} bytes of shared memory; got "
                         f"head_dim {head_dim} and {group} query heads a KV head")
    if backend == "tensor_cores":
        return tc_decode_attention
    if backend == "auto" and fits and not config.ENABLE_CUDASIM:
        return auto_decode_attention
    return decode_attention


# %% [markdown]
# Against chapter 8's float64 reference at tiny sizes (four warps, as a GPU runs it; the
# twins in the simulator): a context of one key, one that ends inside the first tile,
# and one of two tiles and a bit. Q and P are rounded to bf16 before their products,
# as in the prefill kernel, so the error is the rounded reference's, not float32's.

# %%
from tinyvllm_lib.kernels.decode_attention import decode_attention_ref

rng = np.random.default_rng(14)
H_, KVH_, D_, BS_ = 4, 2, 16, 4
lens_ = np.array([1, 29, 150], np.int32)
tables_ = rng.permutation(3 * 38).reshape(3, 38).astype(np.int32)
kv_ = [f32_to_bf16_bits(rng.standard_normal((3 * 38 * BS_, KVH_, D_), np.float32))
       for _ in range(2)]
qkv_ = rng.standard_normal((3, (H_ + 2 * KVH_) * D_)).astype(np.float32)
exact_ = decode_attention_ref(qkv_, *kv_, tables_, BS_, lens_, H_, KVH_, D_)
q_rounded = bf16_bits_to_f32(f32_to_bf16_bits(qkv_[:, : H_ * D_]))
rounded_ = decode_attention_ref(np.concatenate([q_rounded, qkv_[:, H_ * D_:]], 1),
                                *kv_, tables_, BS_, lens_, H_, KVH_, D_)
if can_launch():
    out_ = cuda.device_array((3, H_ * D_), np.float32)
    with twin_launch():
        tc_decode_attention(*map(cuda.to_device, (qkv_, *kv_, tables_)), BS_,
                            cuda.to_device(lens_), H_, KVH_, D_, out_)
    err_, ref_err_ = (np.abs(x - exact_).max() for x in (out_.copy_to_host(), rounded_))
    print(f"tensor-core decode: max error {err_:.1e} (Q rounded to bf16: "
          f"{ref_err_:.1e})")
    # P's rounding to bf16 moves the output by at most 2^-9 of the largest |V|
    assert err_ <= 2 * ref_err_ + 2.0**-9 * np.abs(bf16_bits_to_f32(kv_[1])).max()

# %% [markdown]
# ### Does it pay?
#
# A prediction, written before it ran: if the SIMT kernel's instructions were what held
# it below the bandwidth ceiling, the tensor cores should lift decode attention toward
# the ceiling at every size, and nano-vllm's workload by that gain times decode
# attention's share of the workload's time. `bench/ch14_tc_decode.py` times both
# kernels on the same caches (chapter 8's cases: full 1,024-token contexts at 1 and 64
# sequences, nano-vllm's 100 to 2,048-token contexts at 256; at one sequence both split
# the context by chapter 11's few-rows policy, tuned for the SIMT kernel), then the
# engine with each on nano-vllm's workload.

# %% tags=["remove-input"] jupyter={"source_hidden": true}
dec = load_records("ch14_tc_decode")
if dec:
    dev = dec[-1]["device"]["name"]
    dec = [r for r in dec if r["device"]["name"] == dev]
    cases = [(1, False), (64, False), (256, True)]
    labels = ["1 × 1,024", "64 × 1,024", "256 mixed"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.4),
                                  gridspec_kw={"width_ratios": [3, 2]})
    gbs = {}
    for j, kern in enumerate(("simt", "tensor_cores")):
        for i, (n, mixed) in enumerate(cases):
            rs = [r for r in dec if r["name"] == "decode_attention"
                  and r["kernel"] == kern and r["shape"][0] == n
                  and r["mixed"] == mixed]
            gbs[kern, i] = rs[-1]["value"] if rs else float("nan")
        ax.bar(np.arange(3) + 0.38 * j, [gbs[kern, i] for i in range(3)], 0.38,
               label={"simt": "chapter 8 (SIMT)", "tensor_cores": "tensor cores"}[kern])
    ax.set_xticks(np.arange(3) + 0.19, labels)
    ax.set_ylabel("GB/s of K and V read")
    ax.set_title("decode attention, one launch")
    ax.legend()
    thr, runs = {}, 0
    backends = {"auto-simt": "chapter 8's decode", "auto": "\"auto\"",
                "tensor_cores": "tensor-core decode"}
    for j, backend in enumerate(backends):
        for i, t in enumerate((0.0, 0.6)):
            rs = [r for r in dec if r["name"] == "throughput"
                  and r["backend"] == backend and r["temperature"] == t]
            thr[backend, t] = rs[-1]["value"] if rs else float("nan")
            runs = len(rs[-1]["runs"]) if rs else runs
        ax2.bar(np.arange(2) + 0.27 * j, [thr[backend, t] / 1e3 for t in (0.0, 0.6)],
                0.27, label=backends[backend])
    ax2.set_xticks(np.arange(2) + 0.27, ["greedy", "temperature 0.6"])
    ax2.set_ylabel("thousand output tok/s")
    ax2.set_title("nano-vllm's workload")
    ax2.legend(loc="lower right")
    fig.suptitle(f"{dev}, {dec[-1]['date']}")
    fig.tight_layout()
    plt.show()
    change = {i: gbs["tensor_cores", i] / gbs["simt", i] - 1 for i in range(3)}
    wins = [f"{labels[i]} ({change[i]:+.0%})" for i in range(3) if change[i] > 0]
    losses = [f"{labels[i]} ({change[i]:+.0%})" for i in range(3) if change[i] <= 0]

    def against_simt(backend, thr=thr):
        return ", ".join(f"{thr[backend, t] / thr['auto-simt', t] - 1:+.1%} "
                         f"{'greedy' if t == 0 else f'at temperature {t}'}"
                         for t in (0.0, 0.6)
                         if thr["auto-simt", t] == thr["auto-simt", t]
                         and thr[backend, t] == thr[backend, t])
    engine = against_simt("tensor_cores")
    of_runs = f"medians of {runs}" if runs > 1 else "one run each"
    prose.glue("ch14_dec_verdict", " ".join([
        f"On the {dev}, against chapter 8's kernel, the tensor-core kernel is",
        f"faster at {' and '.join(wins)}" if wins else "faster nowhere",
        f"and slower at {' and '.join(losses)}." if losses else "and slower nowhere.",
        f"In the engine, decoding every step with it: {engine} ({of_runs})."
        if engine else "The engine with it is not measured yet."]))
    prose.glue("ch14_dec_missed", (
        "So the prediction missed: taking the arithmetic off the warp did not take the "
        "kernel to the ceiling." if losses or max(change.values()) < 0.1 else
        "The prediction held."))
    # from how many rows it wins (the rows sweep, nano-vllm's mixed contexts) and
    # "auto" against "auto-simt" in the engine: each this GPU's records, else (each on
    # its own) the H100's in book/data/h100/
    h100_dec = load_records("ch14_tc_decode", DATA_DIR / "h100")
    h100_dev = h100_dec[-1]["device"]["name"] if h100_dec else None
    h100_dec = [r for r in h100_dec if r["device"]["name"] == h100_dev]

    def this_gpu_else_h100(keep, complete):
        """(records, device): this GPU's records that keep() takes if complete()
        holds for them, else the H100's."""
        mine = [r for r in dec if keep(r)]
        return (mine, dev) if complete(mine) else ([r for r in h100_dec if keep(r)],
                                                  h100_dev)

    rows_recs, rows_dev = this_gpu_else_h100(
        lambda r: r["name"] == "decode_attention_rows", bool)
    auto_runs, auto_dev = this_gpu_else_h100(
        lambda r: r["name"] == "throughput" and r["backend"] in ("auto", "auto-simt"),
        lambda rs: {r["backend"] for r in rs} == {"auto", "auto-simt"})
    auto_thr = {(b, t): next((r["value"] for r in reversed(auto_runs)
                              if r["backend"] == b and r["temperature"] == t),
                             float("nan"))
                for b in ("auto", "auto-simt") for t in (0.0, 0.6)}
    auto = against_simt("auto", auto_thr)
    engine_auto = (
        f" In the engine on the {auto_dev}: {auto} against chapter 8's kernel at every "
        f"size (medians of {len(auto_runs[-1]['runs'])})." if auto else "")
    by_rows = {}
    for r in rows_recs:
        by_rows.setdefault(r["shape"][0], {})[r["kernel"]] = r["value"]
    sizes = sorted(n for n in by_rows if len(by_rows[n]) == 2)
    if sizes:
        gain = {n: by_rows[n]["tensor_cores"] / by_rows[n]["simt"] - 1 for n in sizes}
        # the smallest size from which it wins at every size measured
        start = next((n for n in sizes if all(gain[m] > 0 for m in sizes if m >= n)),
                     None)
        fig, ax = new_figure(1, 1, width=7.0, height=2.8)
        for kern, label in (("simt", "chapter 8 (SIMT)"),
                            ("tensor_cores", "tensor cores")):
            ax.plot(sizes, [by_rows[n][kern] for n in sizes], "o-", label=label)
        ax.axvline(TC_DECODE_MIN_ROWS, color="grey", ls=":",
                   label=f'"auto": tensor cores from {TC_DECODE_MIN_ROWS} rows')
        ax.set_xlabel("rows of the decode step (contexts of 100 to 2,048 keys)")
        ax.set_ylabel("GB/s of K and V read")
        ax.set_title(f"decode attention by rows, {rows_dev}")
        ax.legend(fontsize=8)
        plt.show()
        where = (f"from {start} rows on it wins at every size measured "
                 f"({gain[start]:+.0%} there, {gain[sizes[-1]]:+.0%} at {sizes[-1]})"
                 if start is not None else
                 "it wins at no size from which it keeps winning")
        # the constant agrees when the kernel loses below it and wins from it on
        agrees = all((gain[n] > 0) == (n >= TC_DECODE_MIN_ROWS) for n in sizes)
        elsewhere = "" if rows_dev == dev else f" on an {rows_dev} (`book/data/h100/`)"
        # why the constant stays where an H100's sweep disagrees: this GPU's 64 full
        # contexts, where they are recorded
        full64 = change[1] if math.isfinite(change[1]) else None
        stays = ("." if rows_dev == dev or full64 is None else
                 f"; it stays while the {dev} has no rows sweep and its 64 full "
                 f"contexts run {abs(full64):.0%} "
                 f"{'slower' if full64 < 0 else 'faster'} on the tensor cores.")
        prose.glue("ch14_dec_auto", (
            f"Across the number of rows (nano-vllm's mixed contexts, the figure"
            f"{elsewhere}): {where}. "
            f"`\"auto\"` takes chapter 8's kernel for decode steps of fewer than "
            f"`TC_DECODE_MIN_ROWS` = {TC_DECODE_MIN_ROWS} rows and the tensor-core one "
            f"from there on"
            + (", where the measurement puts the crossing." if agrees else
               ", which this measurement does not put there" + stays)
            + engine_auto
            + " Batch 1 keeps chapter 8's kernel and chapter 11's few-rows policy."))
    else:
        prose.glue("ch14_dec_auto", (
            f'`"auto"` takes the tensor-core kernel for decode steps of '
            f"`TC_DECODE_MIN_ROWS` = {TC_DECODE_MIN_ROWS} rows or more, chapter 8's "
            "below; no sweep over the number of rows is recorded on this GPU yet "
            "(`bench/ch14_tc_decode.py --only rows`)." + engine_auto))
    default = DEFAULT_DECODE_CONFIG
    sweep = [r for r in dec if r["name"] == "decode_attention_sweep"]
    notes = []
    for n in sorted({r["shape"][0] for r in sweep}):
        mine = [r for r in sweep if r["shape"][0] == n]
        best = max(mine, key=lambda r: r["value"])
        base = [r for r in mine if r["split_keys"] == default.split_keys
                and r["target_blocks"] == default.target_blocks]
        if base:
            gap = 1 - base[0]["value"] / best["value"]
            notes.append(f"at {n} sequences the default ({default.split_keys:,} keys a "
                         f"split, a grid of {default.target_blocks:,} blocks aimed at) "
                         + ("was the fastest" if base[0] is best else
                            f"was within {gap:.1%} of the fastest "
                            f"({best['split_keys']:,} keys, "
                            f"{best['target_blocks']:,} blocks)"))
    prose.glue("ch14_dec_sweep", (
        "Other splits of the context (bench/ch14_tc_decode.py --only sweep): "
        + "; ".join(notes) + "." if notes else "No sweep of split sizes is recorded."))
    variants = [r for r in dec if r["name"] == "decode_attention_variant"
                and r["shape"][0] == 256]
    if variants:
        top = max(variants, key=lambda r: r["value"])
        prose.glue("ch14_dec_variants", (
            f"Of the other block shapes the script timed, the best at 256 mixed "
            f"contexts was {top['warps']} warps in {top['stages']} stages: "
            f"{top['value'] / gbs['tensor_cores', 2] - 1:+.0%} against the default"
            + (": more tiles in flight a block did not help, which the guess above "
               "does not explain." if top["value"] < gbs["tensor_cores", 2] else ".")))
    else:
        prose.glue("ch14_dec_variants", (
            "Deeper pipelines — 3 warps in 3 stages, 2 in 4, 1 in 6, each within the "
            "same 48 KiB — are one argument of `make_tc_decode_kernel` away, and "
            "`bench/ch14_tc_decode.py` times them beside the default; no run of it has "
            "recorded them yet."))
    prose.show("""
{{ch14_dec_verdict}} {{ch14_dec_missed}} A guess at why, for the next measurement to
test: what holds a decode kernel back at these sizes is how many bytes each SM keeps in
flight — in the default shape a block has one 64-key tile on its way, behind a barrier
a tile, where chapter 8's lanes each keep their own rows loading while they work.
{{ch14_dec_sweep}} {{ch14_dec_variants}} {{ch14_dec_auto}}
""")
else:
    print("no ch14_tc_decode records yet: bench/ch14_tc_decode.py on a GPU makes them")

# %% [markdown]
# ## How fast
#
# A prediction first, written before the kernel ran on a GPU. Its ceiling is not the
# 989 TFLOP/s of the first section: on Hopper that rate needs `wgmma`, an instruction
# issued by four warps together that reads its operands straight from shared memory
# (CUTLASS 3 and FlashAttention-3 use it). `mma.sync`, Ampere's instruction, still runs
# on Hopper's tensor cores but at a fraction of their rate. A probe of `mma.sync` alone
# on the H200 — a linked C function, four independent accumulators a warp, no loads —
# measured the rate below, and that is this kernel's ceiling. Between its tensor-core
# instructions the kernel also spends, a warp per tile of keys, the exponentials and
# the rest of the softmax counted in the PTX above, and an `ldmatrix` for every two
# `mma` (in the first version: `warp_tiles` row tiles a warp make it every
# 2 `warp_tiles`); some of that hides behind the tensor cores and some does not.
# FlashAttention-2, the same loop carefully tuned, reaches about half of `mma.sync`'s
# rate. This kernel should land between a quarter and a half of it.

# %%
# the mma.sync probe: the benchmark script records it (part "ceiling"); until then
# the rate an earlier run of the project's probe reported on the H200
probe = [r for r in load_records("ch14_tensor_cores") if r["name"] == "mma_sync_rate"]
MMA_SYNC_TFLOPS = probe[-1]["value"] if probe else 575
predicted = (MMA_SYNC_TFLOPS / 4, MMA_SYNC_TFLOPS / 2)
layers, heads, d, n = 16, 32, 64, 8000  # Llama 3.2 1B, an 8,000-token prompt
flops = 4 * heads * d * n * (n + 1) / 2 * layers
ms = [flops / (t * 1e12) * 1e3 for t in predicted]
print(f"predicted {predicted[0]:.0f} to {predicted[1]:.0f} TFLOP/s: attention of an "
      f"8,000-token prompt in {ms[1]:.0f} to {ms[0]:.0f} ms over the 16 layers")
prose.glue("ch14_probe", f"{MMA_SYNC_TFLOPS:.0f} TFLOP/s")
prose.glue("ch14_predicted", f"{predicted[0]:.0f} to {predicted[1]:.0f} TFLOP/s")
prose.glue("ch14_predicted_ms", f"{ms[1]:.0f} to {ms[0]:.0f} ms")
prose.glue("ch14_simt_ms", f"{flops / (best_simt * 1e12) * 1e3:.0f} ms")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The probe's ceiling is {{ch14_probe}}; the prediction {{ch14_predicted}}, which would
put the attention of an 8,000-token prompt at {{ch14_predicted_ms}} for the whole
model, against {{ch14_simt_ms}} at chapter 7's best SIMT rate.
""")

# %% [markdown]
#
# The benchmark script times the kernel on the H200 against chapter 10's paged kernel
# (SIMT) and torch's `scaled_dot_product_attention` (its flash backend), causal, 32
# query and 8 KV heads of 64 dimensions, from 512 to 16,384 new tokens, and after 4,096
# cached ones; FLOPs are counted as 4·q·k·d per head over the query-key pairs actually
# computed. It records them under `book/data/ch14_tensor_cores.json`:
#
# ```bash
# python bench/ch14_tensor_cores.py
# ```

# %%
def version(r: dict) -> int:
    """The attention kernel's version a record was measured with (untagged: 1)."""
    return r.get("attention_version", 1)


every_version = load_records("ch14_tensor_cores")
newest = max((version(r) for r in every_version), default=1)
records = [r for r in every_version if version(r) == newest]
KERNELS = (("tc_prefill", "tensor cores (this chapter)"),
           ("paged_prefill", "SIMT (chapter 10)"),
           ("sdpa_flash", "torch sdpa (flash)"))


def series(name: str, cached: int, among=None) -> list[dict]:
    """The attention records of one kernel at one number of cached tokens, by length."""
    return sorted((r for r in (records if among is None else among)
                   if r["name"] == name and r["shape"][1] == cached),
                  key=lambda r: r["shape"][0])


first_version = [r for r in every_version if version(r) == 1]
fig, axes = new_figure(1, 2, width=9.0, height=3.2)
if records:
    for ax, cached in zip(axes, (0, 4096)):
        for name, label in KERNELS:
            rs = series(name, cached)
            if rs:
                ax.plot([r["shape"][0] for r in rs], [r["value"] for r in rs], "o-",
                        label=label)
        rs = series("tc_prefill", cached, first_version) if newest > 1 else []
        if rs:
            ax.plot([r["shape"][0] for r in rs], [r["value"] for r in rs], "o--",
                    color="0.6", label="tensor cores, first version")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens" + (f", after {cached:,} cached" if cached else
                                      " (causal, nothing cached)"))
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    tc = {tuple(r["shape"]): r for r in records if r["name"] == "tc_prefill"}
    simt, sdpa = ({tuple(r["shape"]): r["value"] for r in records if r["name"] == name}
                  for name in ("paged_prefill", "sdpa_flash"))
    top = max(tc.values(), key=lambda r: r["value"])
    best, where = top["value"], tuple(top["shape"])
    verdict = ("inside" if predicted[0] <= best <= predicted[1] else
               "below" if best < predicted[0] else "above")
    long, short = max(k for k in tc if k[1] == 0), min(tc)  # nothing cached
    ours = tc[long]["value"]
    where_run = f"the {records[-1]['device']['name']}, version {newest} of the kernel"
    prose.glue("ch14_measured", (
        f"Measured on {where_run}: its best is {best:.0f} TFLOP/s ({where[0]:,} new "
        f"tokens"
        + (f" after {where[1]:,} cached" if where[1] else "") + f"), "
        f"{best / MMA_SYNC_TFLOPS:.0%} of `mma.sync`'s measured rate: {verdict} the "
        f"prediction. At {long[0]:,} tokens it runs at {ours:.0f} TFLOP/s, "
        f"{ours / simt[long]:.1f} times chapter 10's SIMT kernel ({simt[long]:.0f}) "
        f"and {ours / sdpa[long]:.0%} of torch's flash kernel ({sdpa[long]:.0f}); at "
        f"{short[0]:,} tokens, "
        f"{tc[short]['value'] / sdpa[short]:.0%} of it. The tensor-core and SIMT "
        "outputs differ by at most "
        f"{max(r['max_abs_gap_tc_simt'] for r in tc.values()):.1e} on these inputs."))
    old = {tuple(r["shape"]): r["value"] for r in first_version
           if r["name"] == "tc_prefill"} if newest > 1 else {}
    both = sorted(k for k in old if k in tc and k[1] == 0)
    prose.glue("ch14_versions", (
        f"The first version of the kernel (a warp per 16 queries, every tile masked) "
        f"ran at {old[both[-1]]:.0f} TFLOP/s at {both[-1][0]:,} tokens and "
        f"{old[both[0]]:.0f} at {both[0][0]:,}; this one at "
        f"{tc[both[-1]]['value']:.0f} and {tc[both[0]]['value']:.0f} (the dashed "
        "line)." if both else ""))
    gemms = [(r["value"], next(x["value"] for x in records if x["name"] == "cublas_gemm"
                               and x["shape"] == r["shape"]))
             for r in records if r["name"] == "tc_gemm"]
    shares = [ours / blas for ours, blas in gemms]
    prose.glue("ch14_gemm_measured", (
        f"The GEMM rung reaches {min(g[0] for g in gemms):.0f} to "
        f"{max(g[0] for g in gemms):.0f} TFLOP/s at the 1B's prefill shapes, "
        f"{min(shares):.0%} to {max(shares):.0%} of cuBLAS, which is why the engine's "
        "GEMMs stay on cuBLAS and only attention moves to this chapter's kernel."
        if gemms else ""))  # a run of some parts only (--only attention ttft)
    ttft = {(r.get("attention_backend", "transformers"), r["shape"][1]): r["value"]
            for r in records if r["name"] in ("ttft", "transformers_ttft")}
    n_long = max(n for _, n in ttft)
    ours_ms, theirs_ms = ttft["tensor_cores", n_long], ttft["transformers", n_long]
    prose.glue("ch14_ttft_measured", (
        f"Through the engine ({where_run}), an {n_long:,}-token prompt's first token "
        f"takes {ours_ms:.0f} ms, against {ttft['simt', n_long]:.0f} ms with chapter "
        f"10's attention and {theirs_ms:.0f} ms for transformers (bf16, sdpa) in the "
        "same run: "
        + (f"still {ours_ms / theirs_ms - 1:.0%} slower than transformers; the "
           "breakdown below shows where a long prompt's time goes."
           if ours_ms > theirs_ms else
           f"{1 - ours_ms / theirs_ms:.0%} faster than transformers.")))
else:
    for ax in axes:
        ax.text(0.5, 0.5, "not yet recorded on a GPU", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
    prose.glue("ch14_measured", "It has not been measured on a GPU yet: this page was "
               "written on a machine without one, and the plots fill in once the "
               "script has run.")
    prose.glue("ch14_gemm_measured", "")
    prose.glue("ch14_ttft_measured", "")
    prose.glue("ch14_versions", "")
plt.show()
# the GEMM rung against cuBLAS, and the first token of long prompts, once recorded
for r in records:
    if r["name"] == "tc_gemm":
        blas = next(x for x in records if x["name"] == "cublas_gemm"
                    and x["shape"] == r["shape"])
        M, N, K = r["shape"]
        print(f"GEMM {M}x{N}x{K}: tensor cores {r['value']:5.0f} TFLOP/s, "
              f"cuBLAS {blas['value']:5.0f}")
for r in records:
    if r["name"] in ("ttft", "transformers_ttft"):
        who = r.get("attention_backend", "transformers (sdpa)")
        print(f"time to first token, {r['shape'][1]:,} tokens, {who}: "
              f"{r['value']:.1f} ms")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
{{ch14_measured}} {{ch14_versions}}

{{ch14_gemm_measured}}

{{ch14_ttft_measured}}
""")

# %% [markdown]
# ### Which tile
#
# Three numbers shape a block: the queries it takes (`block_q`), the keys a tile
# (`block_k`), and the row tiles a warp holds (`warp_tiles`). More queries a block read
# each K and V tile from L2 once for more rows; more row tiles a warp share each
# fragment `ldmatrix` loads among more `mma`, but need more registers, so fewer warps
# fit on an SM to hide each other's waits. Shared memory caps `block_k` (two stages of
# K and V: 64 keys of 64 dimensions take 36 KiB of the 48 a block may have without
# asking for more). Rather than argue it, the benchmark script times each (`--only
# sweep`), checking every tile's output against the default's first:

# %%
every_sweep = load_records("ch14_tile_sweep")  # the sweep's own newest version
sweep_version = max((version(r) for r in every_sweep), default=1)
sweep = [r for r in every_sweep if version(r) == sweep_version]
SHAPE_NAMES = {(2048, 0): "2,048 tokens", (8192, 0): "8,192 tokens",
               (2048, 4096): "2,048 after 4,096 cached"}
fig, ax = new_figure(1, 1, width=8.0, height=3.0)
if sweep:
    tiles = sorted({(r["block_q"], r["block_k"], r.get("warp_tiles", 1))
                    for r in sweep}, key=lambda t: (t[2], t[0], t[1]))
    shapes = [k for k in SHAPE_NAMES if any(tuple(r["shape"]) == k for r in sweep)]
    width = 0.8 / len(shapes)
    value = {(tuple(r["shape"]), (r["block_q"], r["block_k"], r.get("warp_tiles", 1))):
             r for r in sweep}
    for j, shape in enumerate(shapes):
        ax.bar([i + j * width for i in range(len(tiles))],
               [value[shape, t]["value"] if (shape, t) in value else 0 for t in tiles],
               width, label=SHAPE_NAMES[shape])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tiles))])
    ax.set_xticklabels([f"{q}×{k}\n{w} a warp" for q, k, w in tiles], fontsize=7)
    ax.set_xlabel("block_q × block_k, row tiles of 16 queries a warp")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7)
    at = (8192, 0)
    rows = {t: value[at, t] for t in tiles if (at, t) in value}
    best = max(rows, key=lambda t: rows[t]["value"])
    default = (tc_block_q(64), tc_block_k(64), tc_warp_tiles(64))
    prose.glue("ch14_sweep", (
        f"On the {sweep[-1]['device']['name']}, with version {sweep_version} of the "
        f"kernel: at 8,192 tokens the fastest tile is {best[0]}×{best[1]} with "
        f"{best[2]} row "
        f"tile{'s' if best[2] > 1 else ''} a warp, {rows[best]['value']:.0f} TFLOP/s "
        f"({rows[best]['registers']} registers a thread); the engine's, "
        f"{default[0]}×{default[1]} with {default[2]}, runs at "
        f"{rows[default]['value']:.0f}." if default in rows else
        f"On the {sweep[-1]['device']['name']}, with version {sweep_version}: at "
        f"8,192 tokens the fastest tile is {best[0]}×{best[1]} with {best[2]} "
        f"a warp ({rows[best]['value']:.0f} TFLOP/s)."))
else:
    ax.text(0.5, 0.5, "not yet recorded on a GPU", ha="center", va="center",
            transform=ax.transAxes)
    ax.set_axis_off()
    prose.glue("ch14_sweep", "The sweep has not run on a GPU yet.")
plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
{{ch14_sweep}}
""")

# %% [markdown]
# ### Where a long prompt's first token goes
#
# The first token of a long prompt is one prefill step. The benchmark script runs one
# under torch's profiler (`--only breakdown`), which sees every kernel on the GPU —
# numba's and cuBLAS' alike — and sums their time by the module that defines them:

# %%
breakdown = load_records("ch14_ttft_breakdown")
if breakdown:  # the newest run only (its device and engine commit), whatever its kernel
    run = (breakdown[-1]["device"]["name"], breakdown[-1].get("engine_commit"))
    breakdown = [r for r in breakdown
                 if (r["device"]["name"], r.get("engine_commit")) == run]
fig, ax = new_figure(1, 1, width=8.0, height=2.6)
lengths = sorted({r["shape"][1] for r in breakdown})
if lengths:
    groups = {}
    for r in breakdown:
        if r["name"] == "kernel_group":
            groups.setdefault(r["group"], {})[r["shape"][1]] = r["value"]
    big = sorted(groups, key=lambda g: -max(groups[g].values()))[:5]
    left = np.zeros(len(lengths))
    for g in big + ["the rest"]:
        ms = np.array([groups[g].get(n, 0.0) if g in groups else
                       sum(v.get(n, 0.0) for h, v in groups.items() if h not in big)
                       for n in lengths])
        ax.barh(range(len(lengths)), ms, left=left, label=g)
        left += ms
    wall = {r["shape"][1]: r["value"] for r in breakdown if r["name"] == "wall"}
    ax.scatter([wall[n] for n in lengths], range(len(lengths)), marker="|", s=300,
               color="k", label="wall, add_request to the token (under the profiler)")
    ax.set_title(f"{run[0]}, attention version {version(breakdown[-1])}", fontsize=8)
    ax.set_yticks(range(len(lengths)))
    ax.set_yticklabels([f"{n:,} tokens" for n in lengths])
    ax.set_xlabel("ms")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3),
              markerscale=0.3)
    n = lengths[-1]
    busy = sum(v.get(n, 0.0) for v in groups.values())
    attn = groups.get("kernels.tc_attention", {}).get(n, 0.0)
    gemm = groups.get("cublas", {}).get(n, 0.0)
    prose.glue("ch14_breakdown", (
        f"On the {run[0]} (attention version {version(breakdown[-1])}), at {n:,} "
        f"tokens the GPU is busy {busy:.1f} ms of the "
        f"{wall[n]:.1f} ms the prompt took under the profiler: "
        f"attention {attn:.1f} ms ({attn / busy:.0%}), cuBLAS' GEMMs {gemm:.1f} ms "
        f"({gemm / busy:.0%}), and every other kernel {busy - attn - gemm:.1f} ms. "
        "The profiler slows the host's launches, so this wall is longer than the "
        "same prompt's first token without it; what is left of it beyond the GPU's "
        "busy time is the host's work (the "
        "request's checks, the schedule, the step's arrays) and the launches the "
        "GPU waits for. This is the newest run recorded, whatever its GPU."))
else:
    ax.text(0.5, 0.5, "not yet recorded on a GPU", ha="center", va="center",
            transform=ax.transAxes)
    ax.set_axis_off()
    prose.glue("ch14_breakdown", "The breakdown has not run on a GPU yet.")
plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
{{ch14_breakdown}}
""")

# %% [markdown]
# ## Summary
#
# - A tensor core multiplies a 16×16 by a 16×8 bf16 matrix per warp-wide instruction;
#   each lane holds a fragment — fixed rows and columns — of every operand.
# - numba reaches the instruction through a linked CUDA C function of a few lines
#   (`declare_device`, `CUSource`, cffi's `from_buffer`); link-time optimisation inlines
#   it, and the fragments stay in registers, which can be checked from PTX with no GPU.
# - In the simulator each linked function has a Python twin with the same fragments;
#   because the instruction is warp-collective, the twin's lanes exchange their
#   registers before each computes its part.
# - A GEMM on the tensor cores tiles as chapter 6's did, one level deeper: `cp.async`
#   copies the next tile of K while the warps multiply this one, and `ldmatrix` loads
#   whole fragments from shared memory.
# - Flash attention on the tensor cores keeps chapter 7's loop and chapter 10's paging:
#   S and O accumulate in fragments, the softmax runs on them with two shuffles a row,
#   and P turns into an A fragment without leaving registers.
# - On the H200 the attention kernel lands inside the prediction; the plain GEMM does
#   not come near cuBLAS, so only attention changes backend in the engine.
#
# ## Exercises
#
# 1. The kernel rounds Q to bf16 once. What does rounding the scale into Q, instead of
#    multiplying the scores by it, change in the error check above?
# 2. Each block loads every K and V tile again for each of the 4 query heads that share
#    a KV head. Put the group's heads in one block (64 rows = 4 heads × 16 queries): how
#    many bytes of K and V does a 4,096-token prefill then read?
# 3. The GEMM keeps each warp's B fragments for one 16-wide step of K only. Load them
#    once per 32-wide tile instead: how many `ldmatrix` does a warp then issue per tile,
#    and how many registers does it take?
# 4. On a tile of keys across the causal diagonal, a warp still multiplies its rows by
#    every key of the tile and masks the products it did not need. Skip the 16-key
#    pieces of S (and of P V) that lie wholly past the warp's last row: how many `mma`
#    does that save at 8,192 tokens, as a share of the whole, at each `warp_tiles`?
