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
# # 1. bf16: the bits of every weight
#
# Llama 3.2 1B stores its 1.24 billion weights in **bfloat16** (bf16), two bytes each. Before
# we read a model file (chapter 02) we need to know exactly what those two bytes mean, how to
# turn a float32 into them and back, and how a GPU kernel reads them.
#
# In this chapter you will learn:
#
# - how fp32, fp16 and bf16 split their bits into sign, exponent and mantissa, and what that
#   buys in range and precision;
# - how to round a float32 to bf16 by hand with integer operations (round to nearest, ties to
#   even), keeping infinities and NaNs;
# - why widening bf16 to float32 is a 16-bit shift, and exact;
# - how to write, launch and test your first numba.cuda kernel — the same code on a GPU and in
#   numba's CUDA simulator.
#
# It exports the host conversions and the device helper that every later kernel uses to read
# bf16 weights. The [preface](00_preface.py) says how to run it.

# %%
#| default_exp kernels.bf16

# %%
#| export runtime
from numba import config, cuda


def is_simulator() -> bool:
    """True when numba runs kernels in its CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return bool(config.ENABLE_CUDASIM)


def has_gpu() -> bool:
    """True when a real CUDA GPU is there to launch kernels on."""
    return not is_simulator() and cuda.is_available()


def can_launch() -> bool:
    """True when kernels can run: on a GPU or in the simulator."""
    return is_simulator() or has_gpu()


# %%
import time

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

print("simulator" if is_simulator() else "GPU" if has_gpu() else "no GPU, no simulator")

# %% [markdown]
# ## Three formats, one idea
#
# A binary floating-point number is a sign $s$, an exponent $e$ stored with a bias $b$, and a
# fraction $f$ of $m$ bits (the *mantissa*). For a normal number (exponent field neither all
# zeros nor all ones) its value is
#
# $$ x = (-1)^s \cdot 2^{e - b} \cdot \left(1 + \frac{f}{2^m}\right). $$
#
# An exponent field of all zeros means a *subnormal* number, $(-1)^s 2^{1-b} f / 2^m$, which
# fills the gap between zero and the smallest normal; all ones means infinity ($f = 0$) or NaN
# ($f \neq 0$). The three formats we meet differ only in how many bits go where:

# %%
#| export plots
import matplotlib.pyplot as plt

FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


def new_figure(nrows: int = 1, ncols: int = 1, width: float = 8.0, height: float = 3.0, **kw):
    """A figure in the book's style: one size per panel, tight layout."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), constrained_layout=True, **kw)
    return fig, axes


def bit_layout(ax, rows: list[tuple[str, int, int, int]]):
    """Draw the bit fields of floating-point formats: rows of (name, sign, exponent, mantissa) bits."""
    total = max(s + e + m for _, s, e, m in rows)
    for y, (name, s, e, m) in enumerate(reversed(rows)):
        x = total - (s + e + m)
        for field, nbits in (("sign", s), ("exponent", e), ("mantissa", m)):
            for _ in range(nbits):
                ax.add_patch(plt.Rectangle((x, y + 0.1), 1, 0.8, color=FIELD_COLORS[field], ec="white"))
                x += 1
        ax.text(total - (s + e + m) - 0.5, y + 0.5, name, ha="right", va="center")
    for field, color in FIELD_COLORS.items():
        ax.plot([], [], "s", color=color, label=field)
    ax.set_xlim(-6, total)
    ax.set_ylim(0, len(rows))
    ax.axis("off")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, frameon=False)
    return ax


# %%
FORMATS = [("fp32", 1, 8, 23), ("fp16", 1, 5, 10), ("bf16", 1, 8, 7)]
fig, ax = new_figure(width=9, height=2.2)
bit_layout(ax, FORMATS)
ax.set_title("bit layouts: bf16 is the top half of fp32")
plt.show()

# %% [markdown]
# bf16 keeps float32's 8 exponent bits and drops 16 mantissa bits: **the same range as
# float32, with 3 significant decimal digits** instead of 7. fp16 spends its bits the other
# way: more precision, but a largest value of 65504, which activations of large models exceed.
# That is why models are trained and shipped in bf16.
#
# The plot shows both properties at once: the relative gap between neighbouring numbers
# (the *unit in the last place* over the value) across the range each format covers.

# %%
def relative_spacing(log2_x: np.ndarray, exp_bits: int, mant_bits: int) -> np.ndarray:
    """ulp(x)/x for positive x = 2**log2_x; NaN outside the format's finite range."""
    bias = 2 ** (exp_bits - 1) - 1
    e = np.floor(log2_x)
    e_min, e_max = 1 - bias, bias
    ulp = 2.0 ** (np.maximum(e, e_min) - mant_bits)  # subnormals share the smallest normal's ulp
    out = ulp / 2.0**log2_x
    smallest = e_min - mant_bits
    out[(log2_x < smallest) | (log2_x >= e_max + 1)] = np.nan
    return out


log2_x = np.linspace(-150, 130, 4000)
fig, ax = new_figure(width=8, height=3.2)
for name, _, e, m in FORMATS:
    ax.plot(log2_x, relative_spacing(log2_x, e, m), label=name)
ax.set_yscale("log")
ax.set_xlabel("log2 |x|")
ax.set_ylabel("ulp(x) / x")
ax.set_title("range (width of each curve) and precision (its height)")
ax.legend()
plt.show()

# Check the plot's numbers against the formats' own limits.
for name, dtype, (_, _, e, m) in zip(["fp32", "fp16", "bf16"], [np.float32, np.float16, ml_dtypes.bfloat16], FORMATS):
    info = ml_dtypes.finfo(dtype)
    assert info.nmant == m and float(info.eps) == 2.0**-m, name
    print(f"{name}: max {float(info.max):.4g}, smallest normal {float(info.smallest_normal):.4g}, eps {float(info.eps):.3g}")

# %% [markdown]
# ## bf16 → float32 is a shift
#
# Because bf16 *is* the top 16 bits of a float32, widening it moves the 16 bits up and fills
# the low half with zeros. Every bf16 value — subnormals, infinities and NaN payloads included —
# becomes the float32 with exactly the same value. There is nothing to round.
#
# $$ \text{f32\_bits} = \text{bf16\_bits} \ll 16 $$

# %%
#| export
import numpy as np


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32: the bits move to the top half."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


# %% [markdown]
# ## float32 → bf16: rounding by hand
#
# Going down, 16 bits must go. Chopping them (*truncation*) always rounds towards zero and
# biases every sum. The IEEE default is **round to nearest, ties to even**: take the nearer of
# the two bf16 neighbours; on an exact tie, the one whose last bit is 0.
#
# With integers, on the 32 bits $u$ of the float: let $\ell = (u \gg 16) \,\&\, 1$ be the last
# bit that survives. Then
#
# $$ \text{bf16} = (u + \texttt{0x7FFF} + \ell) \gg 16. $$
#
# Below the halfway point (low half $< \texttt{0x8000}$) adding $\texttt{0x7FFF}$ never carries,
# so the result is chopped; above it, it always carries into the kept bits, rounding up. At
# exactly $\texttt{0x8000}$ it carries only when $\ell = 1$: ties go to even. The carry can
# ripple into the exponent — that is correct: 1.99999 rounds up to 2.0, and the largest finite
# float32 rounds to infinity, as IEEE says it must.
#
# NaN is the exception: its low mantissa bits may be its only non-zero ones, and chopping
# them would turn NaN into infinity. We return the canonical quiet NaN, keeping the sign
# (the same choice as `ml_dtypes`, which drops the payload).

# %%
#| export
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bit patterns (uint16): nearest, ties to even; NaN -> quiet NaN with its sign."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    last_kept = (u >> 16) & 1
    rounded = (u + np.uint32(0x7FFF) + last_kept) >> 16  # wraps only for NaNs, replaced below
    sign = (u >> 16) & 0x8000
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, sign | 0x7FC0, rounded).astype(np.uint16)


# %% [markdown]
# A few values by hand, then the real test.

# %%
examples = np.array([1.0, 1.00390625, 1.01171875, 3.14159265, -2.5e-40, 3.4e38, np.inf, -np.nan], np.float32)
for v, b in zip(examples, f32_to_bf16_bits(examples)):
    print(f"{v!s:>14}  f32 {v.view(np.uint32):08x} -> bf16 {b:04x} = {bf16_bits_to_f32(np.array(b, np.uint16))!s}")

# %% [markdown]
# `1.00390625` is $1 + 2^{-8}$: exactly halfway between the bf16 neighbours $1$ and
# $1 + 2^{-7}$; the tie goes to the even one, $1$. `1.01171875` $= 1 + 3 \cdot 2^{-8}$ is
# halfway between $1 + 2^{-7}$ (odd last bit) and $1 + 2^{-6}$, and goes up. `3.4e38` rounds
# to infinity.
#
# ## Checking against ml_dtypes, bit for bit
#
# `ml_dtypes` (the bf16 type that JAX and TensorFlow use) is our reference. We test:
#
# 1. **every one of the 65,536 bf16 patterns**, widened to float32;
# 2. the same patterns narrowed back (each is exactly representable, so it must round-trip,
#    NaNs becoming the canonical quiet NaN);
# 3. **millions of random float32 bit patterns** — uniform over all 32-bit words, so all
#    exponents, subnormals, infinities and NaNs appear — plus every *tie* we can build.

# %%
all_bf16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
ours = bf16_bits_to_f32(all_bf16).view(np.uint32)
ref = all_bf16.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
assert np.array_equal(ours, ref), "widening disagrees with ml_dtypes"

with np.errstate(invalid="ignore"):
    back = f32_to_bf16_bits(bf16_bits_to_f32(all_bf16))
    ref_back = bf16_bits_to_f32(all_bf16).astype(ml_dtypes.bfloat16).view(np.uint16)
assert np.array_equal(back, ref_back), "narrowing all bf16 values disagrees with ml_dtypes"

rng = np.random.default_rng()
num_random = 4_000_000
words = rng.integers(0, 2**32, size=num_random, dtype=np.uint32)
ties = (rng.integers(0, 2**16, size=num_random // 4, dtype=np.uint32) << 16) | 0x8000
subnormals = rng.integers(0, 2**23, size=num_random // 4, dtype=np.uint32) | (rng.integers(0, 2, size=num_random // 4, dtype=np.uint32) << 31)
f32 = np.concatenate([words, ties, subnormals]).view(np.float32)
t0 = time.perf_counter()
ours = f32_to_bf16_bits(f32)
seconds = time.perf_counter() - t0
with np.errstate(invalid="ignore"):
    ref = f32.astype(ml_dtypes.bfloat16).view(np.uint16)
num_mismatch = int((ours != ref).sum())
print(f"{f32.size:,} float32 values: {num_mismatch} mismatches; ours took {seconds * 1e3:.0f} ms")
assert num_mismatch == 0

# %% [markdown]
# ## Your first kernel: widen a bf16 buffer on the GPU
#
# Every weight-reading kernel in this book does what the function above does, one element
# per thread: load 16 bits, shift them into the top half of a 32-bit word, and use that word
# as a float32. Two details need care in numba:
#
# - **The width of the shift.** numba types `uint32(b) << 16` as a 64-bit integer, because
#   the literal `16` is an `int64` and the two are promoted to a common type. Make both sides
#   32-bit: `uint32(b) << uint32(16)`.
# - **Reinterpreting bits.** On the GPU, the `libdevice` function `int_as_float` turns a
#   32-bit integer into the float with the same bits (it compiles to no instruction at all).
#   The simulator has no `libdevice` — its functions return `None` — so there we let NumPy
#   reinterpret the bits. The choice is made once, when the module is imported.
#
# A device function (`device=True`) is called from kernels, not launched.

# %%
#| export
from numba import config, cuda, int32, uint32

if config.ENABLE_CUDASIM:

    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        """Widen one bf16 value (16 bits) to float32 (simulator: NumPy reinterprets the bits)."""
        return np.uint32(uint32(bits) << uint32(16)).view(np.float32)

else:

    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        """Widen one bf16 value (16 bits) to float32: a 32-bit shift, then reinterpret."""
        return cuda.libdevice.int_as_float(int32(uint32(bits) << uint32(16)))


# %% [markdown]
# The kernel gives each thread one index $i$ and stops threads past the end (the grid is
# rounded up to whole blocks). The *launcher* beside it is plain Python: it checks the dtypes
# and shapes — a kernel that reads past a buffer does not raise, it corrupts memory or faults
# later — and picks the grid. It writes into `out`, a buffer the caller owns; chapter 03
# explains grids, blocks and threads properly.

# %%
#| export
@cuda.jit
def widen_bf16_kernel(src, dst):
    i = cuda.grid(1)  # this thread's global index: blockIdx.x * blockDim.x + threadIdx.x
    if i < src.shape[0]:
        dst[i] = bf16_to_f32(src[i])


PTX_SIGNATURES = {"widen_bf16_kernel": ["void(uint16[::1], float32[::1])"]}


def widen_bf16(src, out, threads_per_block: int = 256, stream=0):
    """Launch: out[i] = float32 value of the bf16 bits src[i]. Both are 1-D device (or host) arrays."""
    if src.dtype != np.uint16:
        raise TypeError(f"widen_bf16: src must hold bf16 bits as uint16, got {src.dtype}")
    if out.dtype != np.float32:
        raise TypeError(f"widen_bf16: out must be float32, got {out.dtype}")
    if src.ndim != 1 or out.shape != src.shape:
        raise ValueError(f"widen_bf16: src {src.shape} and out {out.shape} must be 1-D and the same length")
    num_blocks = max(1, (src.shape[0] + threads_per_block - 1) // threads_per_block)
    widen_bf16_kernel[num_blocks, threads_per_block, stream](src, out)
    return out


# %% [markdown]
# ### Test it against the reference
#
# Fresh random bits every time (every exponent, NaNs and infinities included), a length that
# is not a multiple of the block size, and an output poisoned beforehand so an element the
# kernel forgot to write cannot pass by luck. In the simulator each GPU thread is a Python
# thread, so we keep it small there; on a GPU we widen all 65,536 patterns and a large buffer.

# %%
def check_widen(num_elements: int, threads_per_block: int = 128) -> None:
    src = rng.integers(0, 2**16, size=num_elements, dtype=np.uint32).astype(np.uint16)
    out = np.full(num_elements, np.float32(1234.5))  # poison
    d_src, d_out = cuda.to_device(src), cuda.to_device(out)
    widen_bf16(d_src, d_out, threads_per_block)
    got = d_out.copy_to_host().view(np.uint32)
    want = src.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    assert np.array_equal(got, want), f"kernel disagrees on {(got != want).sum()} of {num_elements}"


if can_launch():
    sizes = [1, 200, 1000] if is_simulator() else [1, 65_536 + 17, 50_000_003]
    for n in sizes:
        check_widen(n)
    print(f"widen_bf16 agrees bit for bit with ml_dtypes on {sizes} random elements")
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernel")

# %% [markdown]
# And the launcher refuses bad input before anything runs:

# %%
for bad_src, bad_out in [(np.zeros(4, np.float32), np.zeros(4, np.float32)), (np.zeros(4, np.uint16), np.zeros(5, np.float32))]:
    try:
        widen_bf16(bad_src, bad_out)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad input was accepted")

# %% [markdown]
# ## Summary
#
# - bf16 is float32 with the low 16 mantissa bits gone: float32's range, about 3 decimal
#   digits of precision.
# - Widening bf16 to float32 is exact: a 16-bit shift. Narrowing rounds to nearest, ties to
#   even, with one integer add: $(u + \texttt{0x7FFF} + \ell) \gg 16$; NaN stays a (quiet) NaN.
# - Both agree bit for bit with `ml_dtypes` on all 65,536 bf16 patterns and millions of random
#   float32 values.
# - Our first kernel widens a buffer, one element per thread; the same code runs on a GPU and
#   in the simulator.
#
# Exported to `tinyvllm_lib`: `kernels.bf16` (`f32_to_bf16_bits`, `bf16_bits_to_f32`, the
# device helper `bf16_to_f32`, `widen_bf16`), `runtime` (`is_simulator`, `has_gpu`,
# `can_launch`) and `plots` (the book's plotting helpers).
#
# ## Exercises
#
# 1. Replace round-to-nearest-even with truncation and sum 10,000 random bf16-rounded values
#    in [0, 1). How far does the sum drift from the float64 sum in each case? Predict the sign
#    of the truncation error first.
# 2. How many bytes does Llama 3.2 1B (1.24 billion parameters) take in fp32, bf16 and fp16?
#    Which of the three could hold its activations without overflow, and why?
# 3. Remove `uint32(...)` around the shift's right operand in `bf16_to_f32`, compile the kernel
#    with `cuda.compile_ptx` and find the 64-bit shift (`shl.b64`) in the PTX.
# 4. The widening kernel reads 2 bytes and writes 4 per element. At 3.9 TB/s of copy
#    bandwidth, how long should widening Llama 3.2 1B's weights take? Time it on a GPU.
