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
# Llama 3.2 1B stores its 1.24 billion weights in **bfloat16** (bf16), two bytes each.
# Before we read a model file (chapter 02) we need to know exactly what those two bytes
# mean, how to turn a float32 into them and back, and how a GPU kernel reads them.
#
# In this chapter you will learn:
#
# - how fp32, fp16 and bf16 split their bits into sign, exponent and mantissa, and what
#   that buys in range and precision;
# - how to round a float32 to bf16 by hand with integer operations (round to nearest,
#   ties to even), keeping infinities and NaNs;
# - why widening bf16 to float32 is a 16-bit shift, and exact;
# - how to write, launch and test your first numba.cuda kernel — the same code on a GPU
#   and in numba's CUDA simulator.
#
# It exports the host conversions and the device helper that every later kernel uses to
# read bf16 weights. The [preface](00_preface.py) says how to run it.

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


def where_kernels_run() -> str:
    """A sentence for the top of a chapter: where its kernels run, and what that means
    for the numbers on the page."""
    if is_simulator():
        return (
            "Kernels run in numba's CUDA simulator here: every GPU thread is a Python\n"
            "thread, so shapes are tiny and times say nothing about a GPU. Figures of\n"
            "speed are GPU records from book/data/ (the preface says which and when)."
        )
    if has_gpu():
        return (
            "Kernels run on the GPU here, at real shapes; the benchmark scripts\n"
            "record what they measure under book/data/."
        )
    return (
        "No GPU and no simulator: kernel cells are skipped (NUMBA_ENABLE_CUDASIM=1\n"
        "runs them in the simulator); NumPy references and recorded figures still run."
    )


# %%
import time

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

print(where_kernels_run())

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## Three formats, one idea
#
# A binary floating-point number is a sign $s$, an exponent $e$ stored with a bias $b$,
# and a fraction $f$ of $m$ bits (the *mantissa*). For a normal number (exponent field
# neither all zeros nor all ones) its value is
#
# $$ x = (-1)^s \cdot 2^{e - b} \cdot \left(1 + \frac{f}{2^m}\right). $$
#
# An exponent field of all zeros means a *subnormal* number, $(-1)^s 2^{1-b} f / 2^m$,
# which fills the gap between zero and the smallest normal; all ones means infinity
# ($f = 0$) or NaN ($f \neq 0$). The three formats we meet differ only in how many bits
# go where:

# %%
#| export plots
import re

import matplotlib.pyplot as plt
import numpy as np

FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


def new_figure(
    nrows: int = 1, ncols: int = 1, width: float = 8.0, height: float = 3.0, **kw
):
    """A figure in the book's style: one size per panel, tight layout."""
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(width, height), constrained_layout=True, **kw
    )
    return fig, axes


def bit_layout(ax, rows: list[tuple[str, int, int, int]]):
    """Draw the bit fields of floating-point formats: rows of (name, sign, exponent,
    mantissa) bits.
    """
    total = max(s + e + m for _, s, e, m in rows)
    for y, (name, s, e, m) in enumerate(reversed(rows)):
        x = total - (s + e + m)
        for field, nbits in (("sign", s), ("exponent", e), ("mantissa", m)):
            for _ in range(nbits):
                ax.add_patch(
                    plt.Rectangle(
                        (x, y + 0.1), 1, 0.8, color=FIELD_COLORS[field], ec="white"
                    )
                )
                x += 1
        ax.text(total - (s + e + m) - 0.5, y + 0.5, name, ha="right", va="center")
    for field, color in FIELD_COLORS.items():
        ax.plot([], [], "s", color=color, label=field)
    ax.set_xlim(-6, total)
    ax.set_ylim(0, len(rows))
    ax.axis("off")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, frameon=False)
    return ax


def plain_log_ticks(ax, axis: str = "y") -> None:
    """Label a log axis with plain numbers (5, 20, 0.3), not 5×10⁰: each power of ten
    and its 2, 3 and 5 multiples, so the labels do not crowd.
    """

    def label(v, _):
        lead = round(v / 10 ** np.floor(np.log10(v))) if v > 0 else 0
        return f"{v:g}" if lead in (1, 2, 3, 5) else ""

    plain = plt.FuncFormatter(label)
    scale = ax.yaxis if axis == "y" else ax.xaxis
    scale.set_major_formatter(plain)
    scale.set_minor_formatter(plain)


class Prose:
    """The numbers a chapter's prose quotes, and the paragraphs that quote them.

    glue(name, text) keeps a value where it is measured; show(markdown) puts a
    paragraph on the page with each {{name}} replaced by its value: Markdown in the
    book and in JupyterLab, where it is a cell's output (so it shows wherever the
    chapter runs), plain text when the chapter runs as a script.
    """

    PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

    def __init__(self):
        self.values: dict[str, str] = {}

    def glue(self, name: str, text) -> None:
        self.values[name] = str(text)

    def fill(self, markdown: str) -> str:
        """The paragraph with every {{name}} replaced; a name never glued is an error,
        not a blank.
        """

        def value(match: re.Match) -> str:
            if match.group(1) not in self.values:
                raise KeyError(
                    f"prose quotes {{{{{match.group(1)}}}}}, but no value was glued "
                    "under that name"
                )
            return self.values[match.group(1)]

        return self.PLACEHOLDER.sub(value, markdown.strip())

    def show(self, markdown: str) -> None:
        text = self.fill(markdown)
        if in_notebook():
            from IPython.display import Markdown, display

            display(Markdown(text))
        else:
            print(text + "\n")


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, CI's run of every chapter), False in a
    plain script.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    # a kernel's shell, or a subclass of it (hosted notebooks such as Colab subclass it)
    return shell is not None and any(
        cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__
    )


DEFAULT_NOISE = 0.05  # relative noise assumed for a measurement kept without repeats


def verdict(
    before,
    after,
    higher_is_better: bool = False,
    noise: float | None = None,
    words: tuple[str, str] = ("faster", "slower"),
) -> str:
    """'faster by N%', 'slower by N%' or 'within noise (±N%)' for a before/after pair.

    before and after are each one number or the repeats of a measurement (a list; a
    record's (min, value, max) works too): the median is compared. N is the change as
    a share of before. The noise is `noise` when given; else the largest relative
    spread, (max - min) / median, of the sides that have repeats; else DEFAULT_NOISE
    (5%), since a single number carries no spread of its own. Times by default (lower
    is better); higher_is_better for rates such as tokens/s.
    """
    b, a = np.atleast_1d(before).astype(float), np.atleast_1d(after).astype(float)
    if np.median(b) == 0:
        raise ValueError("a before of zero has no relative change")
    if noise is None:
        spreads = [np.ptp(x) / np.median(x) for x in (b, a) if x.size > 1]
        noise = max(spreads) if spreads else DEFAULT_NOISE
    change = (np.median(a) - np.median(b)) / np.median(b)
    if abs(change) <= noise:
        return f"within noise (±{noise:.0%})"
    better = change > 0 if higher_is_better else change < 0
    return f"{words[0] if better else words[1]} by {abs(change):.0%}"


# %%
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()

# %%
FORMATS = [("fp32", 1, 8, 23), ("fp16", 1, 5, 10), ("bf16", 1, 8, 7)]
fig, ax = new_figure(width=9, height=2.2)
bit_layout(ax, FORMATS)
ax.set_title("bit layouts: bf16 is the top half of fp32")
plt.show()

# %% [markdown]
# bf16 keeps float32's 8 exponent bits and drops 16 mantissa bits: **the same range as
# float32, with 3 significant decimal digits** instead of 7. fp16 spends its bits the
# other way: more precision, but a largest value of 65504, which activations of large
# models exceed. That is why models are trained and shipped in bf16.
#
# The plot shows both properties at once: the relative gap between neighbouring numbers
# (the *unit in the last place* over the value) across the range each format covers.


# %%
def relative_spacing(log2_x: np.ndarray, exp_bits: int, mant_bits: int) -> np.ndarray:
    """ulp(x)/x for positive x = 2**log2_x; NaN outside the format's finite range."""
    bias = 2 ** (exp_bits - 1) - 1
    e = np.floor(log2_x)
    e_min, e_max = 1 - bias, bias
    # subnormals share the smallest normal's ulp
    ulp = 2.0 ** (np.maximum(e, e_min) - mant_bits)
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
for name, dtype, (_, _, e, m) in zip(
    ["fp32", "fp16", "bf16"], [np.float32, np.float16, ml_dtypes.bfloat16], FORMATS
):
    info = ml_dtypes.finfo(dtype)
    assert info.nmant == m and float(info.eps) == 2.0**-m, name
    print(
        f"{name}: max {float(info.max):.4g}, smallest normal "
        f"{float(info.smallest_normal):.4g}, eps {float(info.eps):.3g}"
    )

# %% [markdown]
# ## bf16 → float32 is a shift
#
# Because bf16 *is* the top 16 bits of a float32, widening it moves the 16 bits up and
# fills the low half with zeros. Every bf16 value — subnormals, infinities and NaN
# payloads included — becomes the float32 with exactly the same value. There is nothing
# to round.
#
# $$ \text{float32 bits} = \text{bf16 bits} \ll 16 $$

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
# Going down, 16 bits must go. Chopping them (*truncation*) always rounds towards zero
# and biases every sum. The IEEE default is **round to nearest, ties to even**: take the
# nearer of the two bf16 neighbours; on an exact tie, the one whose last bit is 0.
#
# With integers, on the 32 bits $u$ of the float: let $\ell = (u \gg 16) \,\&\, 1$ be
# the last bit that survives. Then
#
# $$ \text{bf16} = (u + \texttt{0x7FFF} + \ell) \gg 16. $$
#
# Below the halfway point (low half $< \texttt{0x8000}$) adding $\texttt{0x7FFF}$ never
# carries, so the result is chopped; above it, it always carries into the kept bits,
# rounding up. At exactly $\texttt{0x8000}$ it carries only when $\ell = 1$: ties go to
# even. The carry can ripple into the exponent — that is correct: 1.99999 rounds up to
# 2.0, and the largest finite float32 rounds to infinity, as IEEE says it must.
#
# NaN is the exception: its low mantissa bits may be its only non-zero ones, and
# chopping them would turn NaN into infinity. We return the canonical quiet NaN, keeping
# the sign (the same choice as `ml_dtypes`, which drops the payload).


# %%
#| export
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bit patterns (uint16): nearest, ties to even; NaN -> quiet
    NaN with its sign.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    last_kept = (u >> 16) & 1
    # wraps only for NaNs, replaced below
    rounded = (u + np.uint32(0x7FFF) + last_kept) >> 16
    sign = (u >> 16) & 0x8000
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, sign | 0x7FC0, rounded).astype(np.uint16)


# %% [markdown]
# A few values by hand, then the real test.

# %%
examples = np.array(
    [1.0, 1.00390625, 1.01171875, 3.14159265, -2.5e-40, 3.4e38, np.inf, -np.nan],
    np.float32,
)
for v, b in zip(examples, f32_to_bf16_bits(examples)):
    print(
        f"{v!s:>14}  f32 {v.view(np.uint32):08x} -> bf16 {b:04x} = "
        f"{bf16_bits_to_f32(np.array(b, np.uint16))!s}"
    )

# %% [markdown]
# `1.00390625` is $1 + 2^{-8}$: exactly halfway between the bf16 neighbours $1$ and
# $1 + 2^{-7}$; the tie goes to the even one, $1$. `1.01171875` $= 1 + 3 \cdot 2^{-8}$
# is halfway between $1 + 2^{-7}$ (odd last bit) and $1 + 2^{-6}$, and goes up. `3.4e38`
# rounds to infinity.
#
# ## Checking against ml_dtypes, bit for bit
#
# `ml_dtypes` (the bf16 type that JAX and TensorFlow use) is our reference. We test:
#
# 1. **every one of the 65,536 bf16 patterns**, widened to float32;
# 2. the same patterns narrowed back (each is exactly representable, so it must
#    round-trip, NaNs becoming the canonical quiet NaN);
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
assert np.array_equal(back, ref_back), (
    "narrowing all bf16 values disagrees with ml_dtypes"
)

rng = np.random.default_rng()
num_random = 4_000_000
words = rng.integers(0, 2**32, size=num_random, dtype=np.uint32)
ties = (rng.integers(0, 2**16, size=num_random // 4, dtype=np.uint32) << 16) | 0x8000
subnormals = rng.integers(0, 2**23, size=num_random // 4, dtype=np.uint32) | (
    rng.integers(0, 2, size=num_random // 4, dtype=np.uint32) << 31
)
f32 = np.concatenate([words, ties, subnormals]).view(np.float32)
t0 = time.perf_counter()
ours = f32_to_bf16_bits(f32)
seconds = time.perf_counter() - t0
with np.errstate(invalid="ignore"):
    ref = f32.astype(ml_dtypes.bfloat16).view(np.uint16)
num_mismatch = int((ours != ref).sum())
print(
    f"{f32.size:,} float32 values: {num_mismatch} mismatches; ours took "
    f"{seconds * 1e3:.0f} ms"
)
assert num_mismatch == 0

# %% [markdown]
# ## Your first kernel: widen a bf16 buffer on the GPU
#
# Every weight-reading kernel in this book does what the function above does, one
# element per thread: load 16 bits, shift them into the top half of a 32-bit word, and
# use that word as a float32. Two details need care in numba:
#
# - **The width of the shift.** numba types `uint32(b) << 16` as a 64-bit integer,
#   because the literal `16` is an `int64` and the two are promoted to a common type.
#   Make both sides 32-bit: `uint32(b) << uint32(16)`.
# - **Reinterpreting bits.** On the GPU, the `libdevice` function `int_as_float` turns a
#   32-bit integer into the float with the same bits (it compiles to no instruction at
#   all). The simulator has no `libdevice` — its functions return `None` — so there we
#   let NumPy reinterpret the bits. The choice is made once, when the module is
#   imported.
#
# A device function (`device=True`) is called from kernels, not launched. The
# simulator's stand-ins are plain Python functions, not device functions: the simulator
# runs every thread of a block as a Python thread and takes one lock per module around
# each device-function call, and 256 threads queueing on that lock once made a single
# test of chapter 06 take twenty minutes on two cores. A function that uses nothing from
# `cuda` runs the same as plain Python inside a simulated kernel.

# %%
#| export
from numba import config, cuda, int32, uint32

if config.ENABLE_CUDASIM:

    def bf16_to_f32(bits):
        """Widen one bf16 value (16 bits) to float32 (simulator: NumPy reinterprets the
        bits).
        """
        return np.uint32(uint32(bits) << uint32(16)).view(np.float32)

else:

    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        """Widen one bf16 value (16 bits) to float32: a 32-bit shift, then
        reinterpret.
        """
        return cuda.libdevice.int_as_float(int32(uint32(bits) << uint32(16)))


# %% [markdown]
# Kernels also write bf16: a normalised activation that feeds a matrix product is
# rounded to bf16 on the way out. The device version of the rounding is the same integer
# recipe as the host one above, on one value (`float_as_int` is `int_as_float`'s mirror
# image).

# %% [markdown]
# The rule above, for device functions written once for both: `device_function` compiles
# one with `cuda.jit(device=True)` on a GPU and leaves it a plain Python function in the
# simulator. It is for helpers that use nothing from `cuda` — arithmetic on their
# arguments — such as the rounding below.

# %%
#| export
from numba import uint16


def device_function(fn=None, **options):
    """cuda.jit(device=True, **options) on a GPU; in the simulator the plain function,
    which runs the same there without the simulator's lock around each call. Only for
    helpers that use nothing from cuda.
    """
    if fn is None:
        return lambda f: device_function(f, **options)
    return fn if config.ENABLE_CUDASIM else cuda.jit(device=True, **options)(fn)


if config.ENABLE_CUDASIM:

    def _f32_bits(x):
        return np.float32(x).view(np.uint32)

else:

    @cuda.jit(device=True)
    def _f32_bits(x):
        return uint32(cuda.libdevice.float_as_int(x))


@device_function
def f32_to_bf16(x):
    """Round one float32 to bf16 bits (uint16): nearest, ties to even; NaN -> quiet NaN
    with its sign.
    """
    u = _f32_bits(x)
    if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(((u >> uint32(16)) & uint32(0x8000)) | uint32(0x7FC0))
    return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))


# %% [markdown]
# The kernel gives each thread one index $i$ and stops threads past the end (the grid is
# rounded up to whole blocks). The *launcher* beside it is plain Python: it checks the
# dtypes and shapes — a kernel that reads past a buffer does not raise, it corrupts
# memory or faults later — and picks the grid. It writes into `out`, a buffer the caller
# owns; chapter 03 explains grids, blocks and threads properly.


# %% [markdown]
# One more line comes before the kernel. Every kernel in this book starts with
# `wait_for_previous_kernel()`. Launched the usual way it does nothing; the section on
# CUDA graphs below says what it is for (letting a GPU start a kernel before the one it
# depends on has finished), and chapter 11 measures what that buys. It is one PTX
# instruction, written with numba's `intrinsic`, the way numba itself reaches
# instructions it has no Python name for.

# %%
#| export kernels.dependent_launch
from numba import config, types

if config.ENABLE_CUDASIM:

    def wait_for_previous_kernel():
        """The simulator runs kernels one after another: nothing to wait for."""

else:
    from llvmlite import ir
    from numba.cuda import dispatcher as _dispatcher
    from numba.cuda.core import targetconfig as _targetconfig
    from numba.cuda.extending import intrinsic

    def dependent_launch_supported() -> bool:
        """Whether the GPU being compiled for has `griddepcontrol` (sm_90 on): the
        compilation's own target (`cuda.compile_ptx(..., cc=...)` names one), as
        numba-cuda's lowering reads it, else the current GPU."""
        flags = _targetconfig.ConfigStack.top_or_none()
        cc = getattr(flags, "compute_capability", None)
        if not cc:
            cc = _dispatcher.get_current_device().compute_capability
        return tuple(cc) >= (9, 0)

    @intrinsic
    def wait_for_previous_kernel(typingctx):
        """`griddepcontrol.wait`: block until the kernels this one depends on have
        finished and their writes are visible. A kernel's first statement.

        It returns at once unless a CUDA graph (CudaGraph below) let the kernel start
        early; it compiles to nothing on GPUs before Hopper, which cannot.
        """

        def codegen(context, builder, signature, args):
            if dependent_launch_supported():
                wait = ir.InlineAsm(
                    ir.FunctionType(ir.VoidType(), []),
                    "griddepcontrol.wait;",
                    "~{memory}",  # no load or store moves across it
                    side_effect=True,
                )
                builder.call(wait, [])
            return context.get_dummy_value()

        return types.void(), codegen


# %%
#| export
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


@cuda.jit
def widen_bf16_kernel(src, dst):
    wait_for_previous_kernel()  # see the cell above
    # this thread's global index: blockIdx.x * blockDim.x + threadIdx.x
    i = cuda.grid(1)
    if i < src.shape[0]:
        dst[i] = bf16_to_f32(src[i])


@cuda.jit
def narrow_f32_kernel(src, dst):
    wait_for_previous_kernel()
    i = cuda.grid(1)
    if i < src.shape[0]:
        dst[i] = f32_to_bf16(src[i])


PTX_SIGNATURES = {
    "widen_bf16_kernel": ["void(uint16[::1], float32[::1])"],
    "narrow_f32_kernel": ["void(float32[::1], uint16[::1])"],
}


def widen_bf16(src, out, threads_per_block: int = 256, stream=0):
    """Launch: out[i] = float32 value of the bf16 bits src[i]. Both are 1-D device (or
    host) arrays.
    """
    if src.dtype != np.uint16:
        raise TypeError(
            f"widen_bf16: src must hold bf16 bits as uint16, got {src.dtype}"
        )
    if out.dtype != np.float32:
        raise TypeError(f"widen_bf16: out must be float32, got {out.dtype}")
    if src.ndim != 1 or out.shape != src.shape:
        raise ValueError(
            f"widen_bf16: src {src.shape} and out {out.shape} must be 1-D and the "
            "same length"
        )
    num_blocks = max(1, (src.shape[0] + threads_per_block - 1) // threads_per_block)
    widen_bf16_kernel[num_blocks, threads_per_block, stream](src, out)
    return out


def narrow_f32(src, out, threads_per_block: int = 256, stream=0):
    """Launch: out[i] = bf16 bits of float32 src[i], rounded to nearest even."""
    if src.dtype != np.float32 or out.dtype != np.uint16:
        raise TypeError(
            f"narrow_f32: src must be float32 and out uint16, got {src.dtype} and "
            f"{out.dtype}"
        )
    if src.ndim != 1 or out.shape != src.shape:
        raise ValueError(
            f"narrow_f32: src {src.shape} and out {out.shape} must be 1-D and the "
            "same length"
        )
    num_blocks = max(1, (src.shape[0] + threads_per_block - 1) // threads_per_block)
    narrow_f32_kernel[num_blocks, threads_per_block, stream](src, out)
    return out


# %% [markdown]
# ### Test it against the reference
#
# Fresh random bits every time (every exponent, NaNs and infinities included), a length
# that is not a multiple of the block size, and an output poisoned beforehand so an
# element the kernel forgot to write cannot pass by luck. In the simulator each GPU
# thread is a Python thread, so we keep it small there; on a GPU we widen all 65,536
# patterns and a large buffer.


# %%
def check_widen(num_elements: int, threads_per_block: int = 128) -> None:
    src = rng.integers(0, 2**16, size=num_elements, dtype=np.uint32).astype(np.uint16)
    out = np.full(num_elements, np.float32(1234.5))  # poison
    d_src, d_out = cuda.to_device(src), cuda.to_device(out)
    widen_bf16(d_src, d_out, threads_per_block)
    got = d_out.copy_to_host().view(np.uint32)
    want = src.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    assert np.array_equal(got, want), (
        f"kernel disagrees on {(got != want).sum()} of {num_elements}"
    )


def check_narrow(num_elements: int, threads_per_block: int = 128) -> None:
    src = rng.integers(0, 2**32, size=num_elements, dtype=np.uint32).view(np.float32)
    # ties
    src[: num_elements // 4] = (
        rng.integers(0, 2**16, size=num_elements // 4, dtype=np.uint32) << 16 | 0x8000
    ).view(np.float32)
    d_out = cuda.to_device(np.full(num_elements, 0xDEAD, np.uint16))  # poison
    narrow_f32(cuda.to_device(src), d_out, threads_per_block)
    assert np.array_equal(d_out.copy_to_host(), f32_to_bf16_bits(src)), (
        "narrowing kernel disagrees"
    )


if can_launch():
    sizes = [1, 200, 1000] if is_simulator() else [1, 65_536 + 17, 50_000_003]
    for n in sizes:
        check_widen(n)
        check_narrow(n)
    print(
        f"widen_bf16 and narrow_f32 agree bit for bit with the references on {sizes} "
        "random elements"
    )
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernel")

# %% [markdown]
# And the launcher refuses bad input before anything runs:

# %%
for bad_src, bad_out in [
    (np.zeros(4, np.float32), np.zeros(4, np.float32)),
    (np.zeros(4, np.uint16), np.zeros(5, np.float32)),
]:
    try:
        widen_bf16(bad_src, bad_out)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad input was accepted")

# %% [markdown]
# ## How fast is it? Measuring a kernel honestly
#
# **Count first.** Widening reads 2 bytes and writes 4 per element and does no
# arithmetic to speak of, so it is *memory-bound*: its floor is the bytes it must move
# over the memory bandwidth. The ceiling to compare with is not the datasheet's 4.8 TB/s
# but the fastest rate at which this GPU measurably moves or reads bytes, so we measure
# that too: a copy, and a kernel that only reads. A kernel at 80% of that ceiling has
# little left to gain; one at 20% is doing something wrong.
#
# **Then time the kernel itself.** Three traps:
#
# 1. *Launch overhead.* A numba launch from Python costs 25–70 µs of CPU time, longer
#    than most kernels in this book run. CUDA events around a Python launch measure
#    Python. Instead we **capture** many launches into a **CUDA graph** once and replay
#    the graph: the GPU then runs them back to back (about 0.5–0.8 µs apart), and events
#    around the replay measure the kernels. The same mechanism later makes a whole
#    decoding step one launch (chapter 11).
# 2. *The L2 cache.* An H200 has about 60 MB of L2. A kernel timed over and over on one
#    small buffer reads it from L2, not memory, and looks faster than it will be in a
#    model. We rotate through enough distinct buffers to exceed the cache.
# 3. *Noise.* Warm up first (compilation, first-touch), repeat, and take the median.
#
# A graph also lets the GPU overlap what a stream cannot. Between two kernels of a
# stream, the second is launched only once the first has finished: its blocks are
# scheduled, its arguments fetched, its first loads issued, while the SMs idle. Since
# Hopper (sm_90), an edge of a graph can be *programmatic*: the second kernel launches
# as soon as every block of the first has started, and each of its blocks runs until
# `griddepcontrol.wait` (`wait_for_previous_kernel`, the first line of every kernel
# here), which returns once the first kernel has finished and its writes are visible.
# Kernels further back may still be running too, since each waited only for its own
# predecessor. Whatever comes before the wait — nothing, or loads of data no kernel of
# the graph writes, as chapter 6's GEMV loads its first weights — overlaps the kernels
# before. So do the launches `time_launches` times back to back: each start overlaps
# the previous end, as in a model's step. `CudaGraph` makes every edge between two
# of the library's kernels programmatic; it knows them by name, since every one of them
# waits first (tests/test_ptx.py checks the compiled code of each). Chapter 11 measures
# it.
#
# In the simulator the graph is just the Python function, replayed by calling it: the
# code runs, the times mean nothing.

# %% tags=["hide-input"]
#| export cuda_graph
from typing import Callable

from numba import config, cuda

if not config.ENABLE_CUDASIM:
    from cuda.bindings import driver as _drv


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return result[1] if len(result) == 2 else result[1:]


# this library's kernels, by the start of their compiled (mangled) names
LIBRARY_KERNEL_MARK = b"tinyvllm_lib"


def _graph_edges(graph) -> list:
    """(from node, to node, edge data) for every edge of a graph."""
    get_edges = getattr(_drv, "cuGraphGetEdges_v2", _drv.cuGraphGetEdges)
    count = _check(get_edges(graph, 0))[-1]
    if count == 0:
        return []
    froms, tos, data, _ = _check(get_edges(graph, count))
    return list(zip(froms, tos, data))


def _library_kernel(node) -> bool:
    """Whether a graph node launches one of this library's kernels (each of which waits
    first: wait_for_previous_kernel).
    """
    kind = _check(_drv.cuGraphNodeGetType(node))
    if kind != _drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
        return False
    params = _check(_drv.cuGraphKernelNodeGetParams(node))
    if int(params.func):
        name = _check(_drv.cuFuncGetName(params.func))
    elif int(params.kern):
        name = _check(_drv.cuKernelGetName(params.kern))
    else:
        return False
    return LIBRARY_KERNEL_MARK in name


def make_edges_programmatic(graph) -> int:
    """Let each of the library's kernels in `graph` launch as soon as every block of the
    library kernel before it has started, instead of once it has finished; return how
    many edges changed.

    The later kernel's blocks then wait in wait_for_previous_kernel
    (griddepcontrol.wait) until the earlier kernel has finished and its writes are
    visible, with their launch already done. Edges to or from anything else (cuBLAS,
    copies) are left as they are.
    """
    # CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER, a #define of cuda.h (2): "all blocks have
    # begun execution"
    port = 2
    kind = _drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    add = getattr(_drv, "cuGraphAddDependencies_v2", _drv.cuGraphAddDependencies)
    remove = getattr(
        _drv, "cuGraphRemoveDependencies_v2", _drv.cuGraphRemoveDependencies
    )
    is_library: dict[int, bool] = {}

    def library(node) -> bool:
        key = int(node)
        if key not in is_library:
            is_library[key] = _library_kernel(node)
        return is_library[key]

    changed = 0
    for src, dst, data in _graph_edges(graph):
        if int(data.type) != 0 or not (library(src) and library(dst)):
            continue
        edge = _drv.CUgraphEdgeData()
        edge.from_port, edge.type = port, kind
        _check(remove(graph, [src], [dst], [data], 1))
        _check(add(graph, [src], [dst], [edge], 1))
        changed += 1
    return changed


class CudaGraph:
    """Capture the kernel launches that `launch(stream)` makes, once; replay them with
    one call.

    `launch` must only launch kernels on the stream it is given (no allocation, no
    copies to or from the host, no synchronisation). In the simulator, replay simply
    calls `launch` again. programmatic: on a Hopper GPU (or later), let each of the
    library's kernels start while the one before it finishes
    (make_edges_programmatic); `programmatic_edges` counts the edges changed.
    """

    def __init__(self, launch: Callable, stream=None, programmatic: bool = True):
        self.launch = launch
        self.stream = stream if stream is not None else cuda.stream()
        self._exec = None
        self.programmatic_edges = 0
        if config.ENABLE_CUDASIM:
            return
        launch(self.stream)  # warm-up: compile and load every kernel before capturing
        self.stream.synchronize()
        handle = _drv.CUstream(int(self.stream.handle))
        mode = _drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(_drv.cuStreamBeginCapture(handle, mode))
        try:
            launch(self.stream)
        finally:
            graph = _check(_drv.cuStreamEndCapture(handle))
        if programmatic and cuda.get_current_device().compute_capability >= (9, 0):
            self.programmatic_edges = make_edges_programmatic(graph)
        self._graph = graph
        self._exec = _check(_drv.cuGraphInstantiate(graph, 0))

    def replay(self):
        """Run every captured launch again, on the graph's stream (asynchronously)."""
        if self._exec is None:
            self.launch(self.stream)
        else:
            _check(
                _drv.cuGraphLaunch(self._exec, _drv.CUstream(int(self.stream.handle)))
            )


# %% tags=["hide-input"]
#| export measure
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
from numba import config, cuda

import tinyvllm_lib
from tinyvllm_lib.cuda_graph import CudaGraph

# Recorded GPU results live in the repository's book/data/ (or $TINYVLLM_DATA).
DATA_DIR = Path(
    os.environ.get(
        "TINYVLLM_DATA",
        Path(tinyvllm_lib.__file__).resolve().parent.parent / "book" / "data",
    )
)


def time_launches(launch_one: Callable, num_launches: int, repeats: int = 10) -> float:
    """Median seconds per launch of `launch_one(i, stream)`, i = 0..num_launches-1,
    replayed from a CUDA graph.
    """
    graph = CudaGraph(
        lambda stream: [launch_one(i, stream) for i in range(num_launches)]
    )
    start, end = cuda.event(), cuda.event()
    graph.replay()  # warm-up
    samples = []
    for _ in range(repeats):
        # the simulator's events record no time: fall back to the host clock
        t0 = time.perf_counter()
        start.record(graph.stream)
        graph.replay()
        end.record(graph.stream)
        end.synchronize()
        seconds = (
            time.perf_counter() - t0
            if config.ENABLE_CUDASIM
            else cuda.event_elapsed_time(start, end) / 1e3
        )
        samples.append(seconds / num_launches)
    return statistics.median(samples)


def num_rotations(
    bytes_per_call: int, cache_bytes: int = 60 * 2**20, at_least: int = 4
) -> int:
    """How many distinct buffer sets to rotate through so the working set is ~4x the L2
    cache.
    """
    return max(at_least, int(np.ceil(4 * cache_bytes / max(bytes_per_call, 1))))


def device_info() -> dict:
    """Name and properties of the GPU the measurement ran on."""
    if config.ENABLE_CUDASIM:
        return {"name": "CUDA simulator"}
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return {
        "name": name,
        "compute_capability": list(dev.compute_capability),
        "multiprocessors": dev.MULTIPROCESSOR_COUNT,
    }


def versions() -> dict:
    """Versions that a measurement depends on."""
    import numba

    out = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    try:
        from importlib.metadata import version

        out["numba-cuda"] = version("numba-cuda")
    except Exception:
        pass
    if not config.ENABLE_CUDASIM:
        try:
            out["cuda_driver"] = ".".join(
                map(str, cuda.cudadrv.driver.driver.get_version())
            )
        except Exception:
            pass
    return out


class Recorder:
    """Collects measurement records and writes them to book/data/<chapter>.json (one
    list per chapter).
    """

    def __init__(self, chapter: str, command: str | None = None):
        self.chapter = chapter
        self.command = command or " ".join([Path(sys.executable).name] + sys.argv)
        self.device = device_info()
        self.records: list[dict] = []

    def add(
        self,
        name: str,
        shape,
        metric: str,
        value: float,
        ceiling: float | None = None,
        **extra,
    ) -> dict:
        rec = {
            "chapter": self.chapter,
            "name": name,
            "shape": list(shape),
            "metric": metric,
            "value": float(value),
        }
        if ceiling is not None:
            rec["ceiling"] = float(ceiling)
            rec["ratio"] = float(value) / float(ceiling)
        rec.update(extra)
        rec.update(
            device=self.device,
            date=datetime.date.today().isoformat(),
            versions=versions(),
            command=self.command,
        )
        self.records.append(rec)
        return rec

    def save(self, data_dir: Path = DATA_DIR, kind=None) -> Path:
        """Replace this chapter's records for the same device; keep other devices'
        records. kind(record) -> a hashable: replace only this device's records of the
        kinds this run made (a script that runs one part at a time keeps the rest).
        """
        path = Path(data_dir) / f"{self.chapter}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.exists() else []
        made = None if kind is None else {kind(r) for r in self.records}
        kept = [
            r for r in old
            if r.get("device", {}).get("name") != self.device.get("name")
            or (made is not None and kind(r) not in made)
        ]
        path.write_text(json.dumps(kept + self.records, indent=1) + "\n")
        return path


def load_records(chapter: str, data_dir: Path = DATA_DIR) -> list[dict]:
    """The recorded measurements of a chapter (empty when none were recorded yet)."""
    path = Path(data_dir) / f"{chapter}.json"
    return json.loads(path.read_text()) if path.exists() else []


# Chapter 1's records of the rates at which a GPU moves or reads bytes, and what each is
CEILING_RECORDS = {
    "read_only": "chapter 1's read-only rate",
    "copy_torch": "torch's device-to-device copy",
    "copy_best_grid": "the book's copy at its best grid",
    "copy": "the book's copy kernel",
    "copy_driver": "the driver's device-to-device copy",
}


def bandwidth_ceiling(
    device_name: str | None = None, data_dir: Path = DATA_DIR
) -> tuple[float, str]:
    """The memory-bandwidth ceiling of a GPU in GB/s, and the chapter 1 record it
    comes from: the best of the read and copy rates recorded on `device_name` (by
    default the GPU of chapter 1's latest record); (nan, "") when none is recorded.

    The best measured rate, not the book's copy kernel: a ceiling is the fastest way
    this GPU moves or reads bytes, and a kernel that only reads (a GEMV) can beat a
    copy, which also writes. A "limit" that a kernel exceeds is no limit.
    """
    records = [
        r
        for r in load_records("ch01_bf16", data_dir)
        if r["name"] in CEILING_RECORDS and r["metric"] == "GB/s"
    ]
    if device_name is None and records:
        device_name = records[-1]["device"]["name"]
    rates = [r for r in records if r["device"]["name"] == device_name]
    if not rates:
        return float("nan"), ""
    best = max(rates, key=lambda r: r["value"])
    return best["value"], best["name"]


def ceiling_phrase(gb_s: float, name: str) -> str:
    """How prose names a ceiling: "the 4,163 GB/s ceiling (chapter 1's read-only
    rate)"."""
    if not name:
        return "the bandwidth ceiling (not yet measured)"
    return f"the {gb_s:,.0f} GB/s ceiling ({CEILING_RECORDS[name]})"


def records_table(
    records: list[dict], time_key: str | None = None, ceiling: float | None = None
) -> str:
    """Recorded measurements as a compact table of at most 88 columns: for each record
    its name, shape, value, share of the ceiling and (time_key) a time; a header line
    for each device and date. With `ceiling` (GB/s), a GB/s record's share is of it,
    not of the ceiling stored with the record."""
    lines, last = [], None
    for r in records:
        where = (r["device"]["name"], r["date"])
        if where != last:
            lines.append(f"{where[0]}, recorded {where[1]}:")
            last = where
        shape = "x".join(str(s) for s in r["shape"])
        share = r.get("ratio")
        is_rate = r["metric"] == "GB/s" and share is not None
        if ceiling is not None and np.isfinite(ceiling) and is_rate:
            share = r["value"] / ceiling
        ratio = f"{share:6.1%}" if share is not None else ""
        time = f"{r[time_key]:9.2f} {time_key}" if time_key and time_key in r else ""
        value = f"{r['value']:10.2f} {r['metric']:<6}"
        name = r["name"][:28]
        row = f"  {name:<28} {shape[:16]:<16} {value} {ratio:>6} {time}"
        lines.append(row.rstrip())
    return "\n".join(lines) if lines else "(no records yet)"


# %% [markdown]
# A first candidate for the ceiling: a copy kernel that moves 8 bytes per thread per
# step (wide loads matter: the same copy with 4-byte words is about a quarter slower on
# an H200), over a buffer far larger than L2. Bytes moved count both the read and the
# write. The script below also times this copy at other grid shapes, the copies of the
# CUDA driver and of PyTorch, and a kernel that only reads (an xor of every word), since
# a kernel that reads weights and writes little (chapter 6's GEMV) is held back by the
# reads alone. The **ceiling** is the best of these rates: `bandwidth_ceiling` returns
# it, with the name of its record, and every later chapter divides by it and says which
# it was. The book's copy is not the ceiling if something else moves bytes faster; a
# "limit" that a kernel beats is no limit.


# %%
#| export
@cuda.jit
def copy_u64_kernel(src, dst):
    wait_for_previous_kernel()
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < src.shape[0]:  # grid-stride loop: any grid size covers any length
        dst[i] = src[i]
        i += stride


PTX_SIGNATURES["copy_u64_kernel"] = ["void(uint64[::1], uint64[::1])"]


# %% [markdown]
# The measurement itself lives in a script, `bench/ch01_bf16.py`, which runs on a GPU
# and records each result — value, ceiling, device, date, versions and the command — in
# `book/data/ch01_bf16.json`. The book plots that file, so every machine shows the same
# numbers, and none is typed by hand. On a GPU you can run it from here:

# %% tags=["hide-input"]
from tinyvllm_lib.measure import (
    CEILING_RECORDS,
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
    records_table,
)

if has_gpu():
    import runpy
    from pathlib import Path

    bench = (
        Path("../bench/ch01_bf16.py")
        if Path("../bench").exists()
        else Path("bench/ch01_bf16.py")
    )
    runpy.run_path(str(bench), run_name="__main__")

records = load_records("ch01_bf16")
print(f"{len(records)} recorded measurements")
print(records_table(records, ceiling=bandwidth_ceiling()[0]))

# %% tags=["hide-input"]
device = records[-1]["device"]["name"] if records else None
ceiling_gbs, ceiling_name = bandwidth_ceiling(device)
rates = {
    r["name"]: r["value"]
    for r in records
    if r["name"] in CEILING_RECORDS and r["device"]["name"] == device
}
widen = next((r for r in records if r["name"] == "widen_bf16"), None)
not_yet = "(not yet measured)"


def gb_s(name: str) -> str:
    return f"{rates[name]:,.0f} GB/s" if name in rates else not_yet


for name in CEILING_RECORDS:
    prose.glue(f"ch01_{name}", gb_s(name))
prose.glue("ch01_device", device or "no GPU yet")
prose.glue("ch01_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))
prose.glue(
    "ch01_widen",
    f"{widen['value'] / ceiling_gbs:.0%}" if widen and ceiling_name else not_yet,
)

if rates:
    fig, ax = new_figure(width=7.5, height=2.5)
    bars = sorted(rates.items(), key=lambda item: item[1])
    bars += [("widen_bf16", widen["value"])] if widen else []
    shown, values = zip(*bars)
    colors = ["#ff7f0e" if n == "widen_bf16" else "#1f77b4" for n in shown]
    ax.barh(shown, values, color=colors)
    ax.axvline(ceiling_gbs, color="k", ls="--", lw=1, label=f"ceiling: {ceiling_name}")
    ax.set_xlabel("GB/s (bytes read + written; read_only: bytes read)")
    ax.set_title(f"measured on {device}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch01_device}}, the book's copy kernel moves {{ch01_copy}} (bytes read plus
written; {{ch01_copy_best_grid}} at its best of five grid shapes), the driver's
device-to-device copy {{ch01_copy_driver}} and PyTorch's {{ch01_copy_torch}}; a kernel
that only reads gets through {{ch01_read_only}}. The best of them is the ceiling:
from here on "% of the ceiling" means a share of {{ch01_ceiling}}.
""")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
The widening kernel reaches {{ch01_widen}} of {{ch01_ceiling}}. Why not all of it?
Each thread makes one 2-byte load and one 4-byte store: the memory system moves data
in 32-byte sectors, and keeping it busy takes many bytes in flight per thread, not
many tiny requests. The copy kernel moves 8 bytes per request. Later kernels read
weights 8 or 16 bytes at a time (chapter 06's GEMV) for exactly this reason —
exercise 5 asks you to try it here.
""")

# %% [markdown]
# ## Summary
#
# - bf16 is float32 with the low 16 mantissa bits gone: float32's range, about 3 decimal
#   digits of precision.
# - Widening bf16 to float32 is exact: a 16-bit shift. Narrowing rounds to nearest, ties
#   to even, with one integer add: $(u + \texttt{0x7FFF} + \ell) \gg 16$; NaN stays a
#   (quiet) NaN.
# - Both agree bit for bit with `ml_dtypes` on all 65,536 bf16 patterns and millions of
#   random float32 values.
# - Our first kernel widens a buffer, one element per thread; the same code runs on a
#   GPU and in the simulator.
#
# - To time a kernel: count its compulsory bytes, capture many launches in a CUDA graph,
#   rotate buffers past the L2 cache, and compare with a measured ceiling: the best
#   of the rates at which the GPU copies or reads bytes (`bandwidth_ceiling`).
# - Every kernel starts with `wait_for_previous_kernel()`, so that a graph may launch it
#   before the kernel it depends on has finished (Hopper's programmatic edges).
#
# Exported to `tinyvllm_lib`: `kernels.bf16` (`f32_to_bf16_bits`, `bf16_bits_to_f32`,
# the device helpers `bf16_to_f32` and `f32_to_bf16`, `widen_bf16`, `narrow_f32`,
# `copy_u64_kernel`), `kernels.dependent_launch` (`wait_for_previous_kernel`),
# `runtime` (`is_simulator`, `has_gpu`, `can_launch`), `cuda_graph` (`CudaGraph`, with
# programmatic edges between the library's kernels), `measure` (`time_launches`,
# `Recorder`, `load_records`, `bandwidth_ceiling`, `ceiling_phrase`) and `plots` (the
# book's plotting helpers).
#
# ## Exercises
#
# 1. Replace round-to-nearest-even with truncation and sum 10,000 random bf16-rounded
#    values in [0, 1). How far does the sum drift from the float64 sum in each case?
#    Predict the sign of the truncation error first.
# 2. How many bytes does Llama 3.2 1B (1.24 billion parameters) take in fp32, bf16 and
#    fp16? Which of the three could hold its activations without overflow, and why?
# 3. Remove `uint32(...)` around the shift's right operand in `bf16_to_f32`, compile the
#    kernel with `cuda.compile_ptx` and find the 64-bit shift (`shl.b64`) in the PTX.
# 4. The widening kernel reads 2 bytes and writes 4 per element. At the ceiling
#    measured above, how long should widening Llama 3.2 1B's weights take? Time it on a
#    GPU.
# 5. Write a kernel in which each thread loads one `uint64` (four bf16 values) and
#    writes four float32s. Predict its fraction of the ceiling, then add it to
#    `bench/ch01_bf16.py` and measure.
