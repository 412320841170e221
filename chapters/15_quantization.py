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
# # 15. Past the bf16 limit: 8-bit weights
#
# At batch 1 a decode step reads every weight once. [Chapter 11](11_llama.py) made the
# engine's step cost about that, and [chapter 13](13_tensor_parallel.py) counted what
# it would take to split those bytes over two GPUs. There is a cheaper way to read
# fewer bytes: store each weight in **8 bits** instead of bf16's 16, and widen it in
# registers as it arrives, exactly as every kernel since [chapter 1](01_bf16.py) widens
# bf16. This chapter adds vLLM's switch for it, `LLM(model, quantization="int8")` or
# `"fp8"`: the weights are quantized as they are loaded from the bf16 folder, and the
# decode GEMVs of [chapter 6](06_gemm.py) and chapter 11 read half the bytes of each
# matrix.
#
# In this chapter you will learn:
#
# - **two 8-bit formats**: symmetric int8 with one scale per output row, and FP8
#   e4m3 — its bits drawn as chapter 1 drew bf16's: range, precision, one NaN pattern
#   per sign and no infinities — with round to nearest even and saturation, tested
#   against every one of the 256 codes;
# - the **error each makes on real weights**, SmolLM2's, layer by layer, and what
#   SmolLM2's own 4-bit past means for that comparison;
# - what 8 bits do to a **model's predictions**: perplexity on this book's prose and
#   the tokens of 20 chat answers, measured on the CPU;
# - **GPTQ**, rounding that knows the inputs, and a **checkpoint** of 8-bit codes and
#   scales written once, offline (`python -m tinyvllm_lib quantize`), which the engine
#   loads as it is, as vLLM loads one made by llm-compressor;
# - **GEMVs that read 8-bit weights** and their scales, with chapter 11's residual-add
#   and norm fusions kept, and what halving the matrices' bytes predicts for a decode
#   step.

# %%
#| default_exp quantization.formats

# %%
import math
import time

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

from tinyvllm_lib.cli import command, main
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.measure import (
    DATA_DIR,
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
    max_rel_error,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_standin import standin_config
from tinyvllm_lib.models.loader import llama_weight_shapes, load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import Prose, bit_layout, new_figure
from tinyvllm_lib.runtime import can_launch, where_kernels_run

prose = Prose()  # the numbers this chapter's prose quotes, filled in as they are made
rng = np.random.default_rng(15)
print(where_kernels_run())

# %% [markdown]
# ## The bf16 limit
#
# Count first. Llama 3.2 1B has 1.24 billion weights; in bf16 a decode step at batch 1
# reads all of them, and no engine reads faster than the GPU's memory. Chapter 1
# measured that rate on the H200; chapter 11 measured this engine's step.

# %%
llama_1b = ModelConfig.from_dict(standin_config())
shapes = llama_weight_shapes(llama_1b)  # the tied embedding is also the LM head
num_weights = sum(math.prod(s) for s in shapes.values())
bf16_bytes = 2 * num_weights
GB_S, CEILING_NAME = bandwidth_ceiling()  # chapter 1's best measured read rate
bs1 = {r["name"]: r for r in load_records("ch11_llama")}.get("bs1_decode")
measured_tok_s = bs1["value"] if bs1 else float("nan")
bf16_limit = GB_S * 1e9 / bf16_bytes
print(f"{num_weights / 1e9:.3f} G weights, {bf16_bytes / 1e9:.2f} GB in bf16; at "
      f"{GB_S:,.0f} GB/s a step takes at least {bf16_bytes / GB_S / 1e6:.3f} ms:\n"
      f"{bf16_limit:,.0f} tok/s at most; chapter 11 measured {measured_tok_s:,.0f}")
prose.glue("ch15_bf16_gb", f"{bf16_bytes / 1e9:.2f} GB")
prose.glue("ch15_ceiling", ceiling_phrase(GB_S, CEILING_NAME))
prose.glue("ch15_bf16_limit", f"{bf16_limit:,.0f} tok/s")
prose.glue("ch15_ch11_tok_s", f"{measured_tok_s:,.0f} tok/s")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
In bf16 the weights are {{ch15_bf16_gb}}. At {{ch15_ceiling}} a step cannot take less
than those bytes take to read: no bf16 engine on this GPU decodes one request faster
than {{ch15_bf16_limit}}, and chapter 11's engine does {{ch15_ch11_tok_s}}. Launches,
attention and the sampler take the rest of its step, but the weights are most of it,
and no kernel tuning reads them faster. Reading fewer bytes is one way past this line
— making each weight smaller; the other is to get more than one token from each read
of the weights (speculative decoding, which this book does not build).
""")

# %% [markdown]
# ## int8: an integer and a scale
#
# The simplest 8-bit weight is an integer code $q \in [-127, 127]$ and a float scale
# $s$ that the code is multiplied by. One scale per **output row** $n$ of $W$ (shape
# (out, in), as the project stores every weight) is chosen so that the row's largest
# magnitude lands on 127 — *absmax* scaling — and each weight is rounded to the nearest
# code:
#
# $$ s_n = \frac{\max_k |W_{nk}|}{127}, \qquad
#    q_{nk} = \operatorname{clip}\!\left(\operatorname{round}\!\left(
#    \frac{W_{nk}}{s_n}\right), -127, 127\right), \qquad \hat W_{nk} = s_n\, q_{nk}. $$
#
# It is *symmetric* (zero is code 0, no offset) and leaves code −128 unused, so $q$ and
# $-q$ are both codes. Why per row: a GEMV computes each output $y_n = \sum_k x_k
# W_{nk}$ from one row, so the row's scale comes out of the sum, $y_n = s_n \sum_k x_k
# q_{nk}$ — one multiply per output, not per weight. A scale for the whole matrix would
# let one large weight coarsen every row; scales for blocks inside a row (as the Q4_1
# blocks of [chapter 2b](02b_smollm2.py) have, one per 32 weights) are finer still, at
# the price of a scale to load inside the sum.
#
# ## FP8 e4m3: a float in one byte
#
# An int8 code's steps are all the same size, $s_n$; a small weight in a row with one
# large one gets few distinct codes. A float spends bits on an exponent instead, so its
# steps grow with the value and every magnitude gets the same *relative* precision.
# Hopper's FP8 type **e4m3** has 1 sign, 4 exponent and 3 mantissa bits — OCP's E4M3,
# which ml_dtypes and PyTorch call `float8_e4m3fn` ("finite"). It follows chapter 1's
# formula with bias 7, with two changes that buy range: there are **no infinities**,
# and of the patterns with all exponent bits set only one is NaN, S.1111.111; the other
# seven are ordinary numbers. The largest is S.1111.110 $= 2^8 \cdot 1.75 = 448$.

# %%
FP8_FORMATS = [("bf16", 1, 8, 7), ("fp8 e5m2", 1, 5, 2), ("fp8 e4m3", 1, 4, 3),
               ("int8", 1, 0, 7)]
fig, ax = new_figure(width=9, height=2.4)
bit_layout(ax, FP8_FORMATS)
ax.set_title("bf16, the two FP8 formats, and int8 (its sign and 7 bits of two's "
             "complement)")
plt.show()

# %% [markdown]
# Its sibling **e5m2** has 5 exponent bits and 2 mantissa bits — the top byte of an
# fp16, infinities and all (range to 57,344) — and is used for gradients; weights,
# which need precision more than range, use e4m3. Decoding is chapter 1's formula;
# here it is for all 256 patterns at once, checked against `ml_dtypes` (the reference
# chapter 1 used for bf16), whose `float8_e4m3fn` is the same format:

# %%
#| export
import numpy as np

INT8_MAX = 127  # symmetric int8: codes -127..127 (-128 is never made)
FP8_E4M3_MAX = 448.0  # S.1111.110 = 2^8 * 1.75; S.1111.111 is NaN
FP8_E4M3_BIAS = 7
QUANTIZATIONS = ("int8", "fp8")  # the quantization= names this engine takes (vLLM's)


def fp8_e4m3_decode(bits: np.ndarray) -> np.ndarray:
    """FP8 e4m3fn bit patterns (uint8) -> float32: bias 7, subnormals below 2^-6,
    NaN = S.1111.111, no infinities.
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint8:
        raise TypeError(f"fp8 bits must be uint8, got {bits.dtype}")
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = ((bits >> 3) & 0xF).astype(np.int32)
    mantissa = (bits & 0x7).astype(np.float64)
    value = np.where(
        exponent == 0,
        mantissa / 8 * 2.0 ** (1 - FP8_E4M3_BIAS),  # subnormal: no implicit 1
        (1 + mantissa / 8) * 2.0 ** (exponent - FP8_E4M3_BIAS),
    )
    is_nan = (bits & 0x7F) == 0x7F
    return np.where(is_nan, np.nan, sign * value).astype(np.float32)


# %%
all_fp8 = np.arange(256, dtype=np.uint16).astype(np.uint8)
fp8_values = fp8_e4m3_decode(all_fp8)
reference = all_fp8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
assert np.array_equal(fp8_values, reference, equal_nan=True), "decode != ml_dtypes"
finite = fp8_values[np.isfinite(fp8_values)]
positive = finite[finite > 0]
print(f"all 256 codes agree with ml_dtypes; {np.isnan(fp8_values).sum()} NaNs "
      f"(0x7F, 0xFF), {np.unique(finite).size} distinct finite values")
print(f"largest {positive.max():g}, smallest normal 2^-6 = {2.0**-6:g}, smallest "
      f"subnormal 2^-9 = {positive.min():g}")
print("1.0 and its neighbours:", fp8_values[[0x37, 0x38, 0x39]])
prose.glue("ch15_fp8_distinct", int(np.unique(finite).size))
prose.glue("ch15_fp8_step_at_1", f"{fp8_values[0x39] - fp8_values[0x38]:g}")

# %% [markdown]
# ## Range and precision: where each format spends its bits
#
# Chapter 1 drew each format's relative spacing, ulp(x)/x, over the range it covers.
# Here are the 8-bit formats beside bf16. e4m3's curve is short — from $2^{-9}$ to 448,
# about 18 binades — and high: 3 mantissa bits mean a step of $2^{-3}$, 12.5%, of the
# value at the bottom of each binade. int8 with a scale is a different shape: its step
# is the same everywhere, $s_n$, so relative to the value it is fine near the row's
# largest weight and coarse near zero. Drawn for a row whose largest weight is 1 (a
# scale of 1/127, and for FP8 1/448):

# %%
def relative_step(x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The gap between neighbouring representable values around each x, over x."""
    grid = np.unique(values[np.isfinite(values) & (values > 0)])
    i = np.clip(np.searchsorted(grid, x), 1, grid.size - 1)
    return (grid[i] - grid[i - 1]) / x


x = np.geomspace(1e-4, 1.0, 2000)
int8_grid = np.arange(1, 128) / 127  # int8 codes times the row's scale
fp8_grid = fp8_values / FP8_E4M3_MAX  # e4m3 codes times the row's scale
bf16_grid = bf16_bits_to_f32(np.arange(0x3800, 0x3F81, dtype=np.uint16))
fig, ax = new_figure(width=8, height=3.2)
for name, grid in (("bf16", bf16_grid), ("fp8 e4m3, scale 1/448", fp8_grid),
                   ("int8, scale 1/127", int8_grid)):
    ax.plot(x, relative_step(x, grid), label=name)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("|weight| / the row's largest |weight|")
ax.set_ylabel("step / value")
ax.set_title("relative precision inside one row, after scaling")
ax.legend()
plt.show()

# %%
int8_coarser = x[relative_step(x, int8_grid) > relative_step(x, fp8_grid)]
print(f"int8's step is the coarser below {int8_coarser.max():.3f} of the row's largest "
      "weight, the finer above")
prose.glue("ch15_crossover_x", f"{int8_coarser.max():.2f}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
Above about {{ch15_crossover_x}} of the row's largest weight int8 is the finer (its
step is 1/127 of the largest weight; e4m3's is between 1/16 and 1/8 of the value);
below it e4m3 is, and the gap grows as the weights get smaller. Which matters more
depends on how the weights in a row are spread, which is why the sections below measure
both on real weights.
""")

# %% [markdown]
# ## float32 → e4m3: rounding and saturation
#
# Encoding follows chapter 1's rounding of float32 to bf16, with 20 bits to drop
# instead of 16. On the float32 bits $u$ of $|x|$, with $\ell = (u \gg 20) \,\&\, 1$
# the last bit kept,
#
# $$ \text{top} = (u + \texttt{0x7FFFF} + \ell) \gg 20 $$
#
# is $|x|$ rounded to 3 mantissa bits, ties to even, with its float32 exponent (bias
# 127) above them; subtracting $(127 - 7) \ll 3$ moves it to e4m3's bias. Two ranges
# need more:
#
# - **below $2^{-6}$** e4m3's subnormals have a fixed step of $2^{-9}$, so the code is
#   simply $\operatorname{round}(|x| \cdot 2^9)$, ties to even (`np.rint`) — exact in
#   float32, since multiplying by a power of two drops no bits;
# - **above 448** there is no infinity to round to. The encoder **saturates**: any
#   larger value, infinity included, becomes ±448, as the GPU's conversion
#   instruction does (`cvt.rn.satfinite`). A NaN stays NaN, S.1111.111.
#
# `ml_dtypes` and PyTorch round the same way within the range, but turn a value past
# 464 (the halfway point between 448 and the 480 that S.1111.111 would be) into NaN.
# Our quantizer never reaches that range — its scale puts each row's largest weight on
# 448 — but a format's encoder should say what it does everywhere.

# %%
#| export
def fp8_e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> FP8 e4m3fn bits (uint8): round to nearest, ties to even; past ±448
    (infinities too) saturate to ±448; NaN -> S.1111.111 with its sign.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    magnitude = u & np.uint32(0x7FFFFFFF)
    # normal: keep 3 of float32's 23 mantissa bits, rounding as chapter 1 did, then
    # move the exponent from float32's bias (127) to e4m3's (7)
    last_kept = (magnitude >> 20) & 1
    top = ((magnitude + np.uint32(0x7FFFF) + last_kept) >> 20).astype(np.int32)
    normal = np.minimum(top - ((127 - FP8_E4M3_BIAS) << 3), 0x7E)  # 0x7E: 448
    # subnormal (below 2^-6): steps of 2^-9, counted with ties to even
    absx = np.abs(x)
    with np.errstate(invalid="ignore"):
        is_subnormal = absx < np.float32(2.0**-6)
        steps = np.rint(np.where(is_subnormal, absx, 0) * np.float32(2**9))
    code = np.where(is_subnormal, steps.astype(np.int32), normal)
    code = np.where(magnitude > 0x7F800000, 0x7F, code)  # NaN
    return code.astype(np.uint8) | sign


# %% [markdown]
# The tests, as chapter 1's: every code must come back as itself; every *tie* — the
# midpoint of two neighbouring values — must go to the even code; and millions of
# random float32 bit patterns within ±448 must match `ml_dtypes`, and PyTorch's
# `float8_e4m3fn` where PyTorch is installed. Past ±448 ours must saturate (they make
# NaN past 464).

# %%
is_number = ~np.isnan(fp8_values)
assert np.array_equal(fp8_e4m3_encode(fp8_values)[is_number], all_fp8[is_number])
nans = np.array([np.nan, -np.nan], np.float32)
assert fp8_e4m3_encode(nans).tolist() == [0x7F, 0xFF]  # NaN keeps its sign
positive_codes = np.arange(0x00, 0x7F, dtype=np.uint8)  # 0 .. 448, ascending
ups = fp8_e4m3_decode(positive_codes).astype(np.float64)
ties = ((ups[:-1] + ups[1:]) / 2).astype(np.float32)  # exact in float32
ties = np.concatenate([ties, -ties])
with np.errstate(invalid="ignore", over="ignore"):
    words = rng.integers(0, 2**32, size=3_000_000, dtype=np.uint32).view(np.float32)
    in_range = words[np.abs(words) <= FP8_E4M3_MAX]
    x = np.concatenate([ties, in_range])
    t0 = time.perf_counter()
    ours = fp8_e4m3_encode(x)
    seconds = time.perf_counter() - t0
    theirs = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    past = words[np.isfinite(words) & (np.abs(words) > FP8_E4M3_MAX)]
    saturated = fp8_e4m3_decode(fp8_e4m3_encode(past))
num_mismatch = int((ours != theirs).sum())
print(f"{ties.size} ties and {in_range.size:,} random values in range: "
      f"{num_mismatch} mismatches with ml_dtypes ({seconds * 1e3:.0f} ms)")
assert num_mismatch == 0
assert np.array_equal(saturated, np.sign(past) * FP8_E4M3_MAX)
try:
    import torch

    torch_bits = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8)
    torch_mismatch = int((torch_bits.numpy() != ours).sum())
    print(f"PyTorch {torch.__version__}: {torch_mismatch} mismatches")
    assert torch_mismatch == 0
except ImportError:
    print("PyTorch is not installed: checked against ml_dtypes only")

# %% [markdown]
# ## One scale per row, for both formats
#
# FP8 needs a scale too: a weight of 0.01 would use only the bottom of e4m3's range
# and its subnormals. The same absmax rule puts each row's largest magnitude on the
# format's largest value, 448, so a row's weights use the normal binades, where each
# gets e4m3's full 3 bits of relative precision; only weights below $2^{-6}/448 \approx
# 3.5 \cdot 10^{-5}$ of the row's largest fall among the subnormals: $s_n = \max_k
# |W_{nk}| / 448$, codes $= \operatorname{e4m3}(W_{nk} /
# s_n)$, $\hat W_{nk} = s_n \cdot \operatorname{decode}(\text{code})$.
#
# The quantized weight is the codes, still (out, in) and row-major — one byte a weight,
# int8 for "int8" and e4m3's bits as uint8 for "fp8" — and a float32 scale a row: the
# 2,048 rows of one of Llama 3.2 1B's square matrices add 8 KiB of scales to its 4 MiB
# of codes. A weight with a NaN or an infinity has no finite scale; it is refused.

# %%
#| export
from dataclasses import dataclass

# each format's largest code
CODE_MAX = {"int8": float(INT8_MAX), "fp8": FP8_E4M3_MAX}
QUANTIZE_CHUNK = 1 << 22  # weights quantized at a time (bounds the temporaries)


def check_quantization(method) -> str | None:
    """method as given: None (bf16), "int8" or "fp8"; anything else is a ValueError."""
    if method is not None and method not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None (bf16 weights) or one of "
            f"{', '.join(map(repr, QUANTIZATIONS))}, got {method!r}"
        )
    return method


@dataclass(frozen=True)
class QuantizedTensor:
    """An (out, in) weight in 8 bits: codes (int8, or e4m3 bits as uint8), row-major
    as the bf16 weight was, and one float32 scale per output row.
    """

    method: str
    codes: np.ndarray  # (out, in) int8 ("int8") or uint8 ("fp8")
    scales: np.ndarray  # (out,) float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """The weights the codes stand for, (out, in) float32: scale times value."""
        values = (
            self.codes.astype(np.float32)
            if self.method == "int8"
            else fp8_e4m3_decode(self.codes)
        )
        return values * self.scales[:, None]


def quantize(w: np.ndarray, method: str) -> QuantizedTensor:
    """An (out, in) float weight in 8 bits: s_n = max_k |w_nk| / the largest code,
    codes = round(w / s_n) (int8: clipped to ±127; fp8: e4m3, ties to even).
    """
    check_quantization(method)
    if method is None or np.ndim(w) != 2:
        raise ValueError(f"quantize takes an (out, in) weight and 'int8' or 'fp8', "
                         f"got shape {np.shape(w)} and {method!r}")
    w = np.asarray(w, dtype=np.float32)
    absmax = np.max(np.abs(w), axis=1)
    if not np.all(np.isfinite(absmax)):
        row = int(np.flatnonzero(~np.isfinite(absmax))[0])
        raise ValueError(f"row {row} holds NaN or infinity: no scale can represent it")
    scales = (absmax / CODE_MAX[method]).astype(np.float32)
    divide = np.where(scales > 0, scales, 1)[:, None]  # an all-zero row: codes 0
    codes = np.empty(w.shape, np.int8 if method == "int8" else np.uint8)
    rows = max(1, QUANTIZE_CHUNK // max(1, w.shape[1]))
    for start in range(0, len(w), rows):  # a few million weights at a time
        part = w[start : start + rows] / divide[start : start + rows]
        codes[start : start + rows] = (
            np.clip(np.rint(part), -INT8_MAX, INT8_MAX)
            if method == "int8"
            else fp8_e4m3_encode(part)
        )
    return QuantizedTensor(method, codes, scales)


# %% [markdown]
# On random rows the worst error of each format is what its grid predicts: at most
# half an int8 step, $s_n / 2$, anywhere in the row; for FP8 at most half a step of
# the binade the weight falls in, $2^{-4}$ of the weight, and half a subnormal step,
# $2^{-10} s_n$, below $2^{-6} s_n$ — each plus float32's own rounding of the division
# and of the product ($2^{-22}$ of the weight at most).

# %%
w = rng.standard_normal((5, 3000)).astype(np.float32)
for method in ("int8", "fp8"):
    q = quantize(w, method)
    error = np.abs(q.dequantize() - w)
    largest = q.scales[:, None] * CODE_MAX[method]  # each row's largest |weight|
    print(f"{method}: {q.codes.dtype} codes {q.shape}, {q.nbytes:,} bytes (bf16 "
          f"{w.size * 2:,}); worst {np.max(error / largest):.4f} of a row's max")
q8 = quantize(w, "int8")
float32_rounding = 2.0**-22 * np.abs(w)
assert np.all(np.abs(q8.dequantize() - w) <= q8.scales[:, None] / 2 + float32_rounding)
qf = quantize(w, "fp8")
scale = np.broadcast_to(qf.scales[:, None], w.shape)
tiny = np.abs(w) < 2.0**-6 * scale  # e4m3's subnormals: a fixed step
bound = np.where(tiny, 2.0**-10 * scale, 2.0**-4 * np.abs(w)) + float32_rounding
assert np.all(np.abs(qf.dequantize() - w) <= bound)

# %% [markdown]
# ## The error on real weights
#
# Random rows say what the grids do; a model's rows say what matters. Here are
# SmolLM2's — every matrix of its 30 layers, quantized both ways. The measure is the
# relative error of a matrix, $\lVert \hat W - W \rVert_F / \lVert W \rVert_F$: for a
# GEMV with inputs that do not favour any weight, the relative size of the error its
# outputs get.

# %%
folder = resolve_model("smollm2")
smollm2 = ModelConfig.from_folder(folder)
smol_weights = load_weights(folder, smollm2, progress=False)
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def relative_error(w: np.ndarray, method: str) -> float:
    """||dequantize(quantize(w)) - w|| / ||w||, Frobenius norms."""
    return float(np.linalg.norm(quantize(w, method).dequantize() - w)
                 / np.linalg.norm(w))


t0 = time.perf_counter()
errors = {  # method -> (layer, kind) -> relative error
    method: np.array([[relative_error(bf16_bits_to_f32(smol_weights[
        f"model.layers.{i}.{'self_attn' if k[0] in 'qkvo' else 'mlp'}.{k}.weight"]),
        method) for k in KINDS] for i in range(smollm2.num_hidden_layers)])
    for method in ("int8", "fp8")
}
embedding = bf16_bits_to_f32(smol_weights["model.embed_tokens.weight"])
head_errors = {m: relative_error(embedding, m) for m in ("int8", "fp8")}
print(f"{2 * 7 * smollm2.num_hidden_layers + 2} matrices quantized and measured in "
      f"{time.perf_counter() - t0:.1f} s")

fig, axes = new_figure(1, 2, width=9, height=3.4, sharey=True)
for ax, method in zip(axes, ("int8", "fp8")):
    for j, kind in enumerate(KINDS):
        ax.plot(100 * errors[method][:, j], label=kind, lw=1.2)
    ax.axhline(100 * head_errors[method], color="k", ls=":", lw=1,
               label="embedding = LM head")
    ax.set_title(f"{method}: one scale per row")
    ax.set_xlabel("layer")
axes[0].set_ylabel("relative error of the matrix (%)")
axes[1].legend(fontsize=7, ncol=2)
plt.show()
for method in ("int8", "fp8"):
    prose.glue(f"ch15_err_{method}", f"{100 * np.median(errors[method]):.2f}%")
    prose.glue(f"ch15_err_max_{method}", f"{100 * np.max(errors[method]):.2f}%")
    prose.glue(f"ch15_err_head_{method}", f"{100 * head_errors[method]:.2f}%")
ratio = np.median(errors["fp8"] / errors["int8"])
prose.glue("ch15_err_ratio", f"{max(ratio, 1 / ratio):.1f}")
prose.glue("ch15_err_winner", "int8's error is the smaller" if ratio > 1
           else "FP8's error is the smaller")

# %% [markdown]
# Why one format wins depends on the row, and a line of algebra says how. Rounding
# to a grid makes an error spread evenly over half a step either way, whose RMS is the
# step over $\sqrt{12}$. int8's step is $s_n = \max|W_n| / 127$ for every weight, so
# its relative error is $\frac{1}{127\sqrt{12}} \cdot \max|W_n| / \mathrm{rms}(W_n)$:
# it grows with how far a row's largest weight stands above its typical one. FP8's
# step is a fixed share of each weight, so its relative error hardly depends on the
# row at all. The two are equal where $\max / \mathrm{rms}$ reaches FP8's relative
# error times $127\sqrt{12}$:

# %%
peakiness = np.array([np.median(np.max(np.abs(w), axis=1) / np.sqrt(np.mean(w * w, 1)))
                      for w in (bf16_bits_to_f32(smol_weights[name]) for name in
                                smol_weights if name.endswith("proj.weight"))])
crossover = np.median(errors["fp8"]) * 127 * np.sqrt(12)
print(f"a row's largest |weight| over its RMS: median {np.median(peakiness):.1f} "
      f"(matrices: {peakiness.min():.1f} to {peakiness.max():.1f});\n"
      f"FP8 would win above {crossover:.1f}")
prose.glue("ch15_peak", f"{np.median(peakiness):.1f}")
prose.glue("ch15_crossover", f"{crossover:.0f}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
int8 moves a typical matrix by {{ch15_err_int8}} of its size (the median over the
210; at most {{ch15_err_max_int8}}), FP8 by {{ch15_err_fp8}} (at most
{{ch15_err_max_fp8}}): on these weights {{ch15_err_winner}}, by a factor of
{{ch15_err_ratio}}. The embedding, which is also the LM head, would move by
{{ch15_err_head_int8}} in int8 and {{ch15_err_head_fp8}} in FP8. The algebra says
why: SmolLM2's rows have a largest weight about {{ch15_peak}} times their RMS, and FP8
would need rows with outliers near {{ch15_crossover}} times the RMS to win. Models
whose weights have such outliers may exist (finer-grained scales, a block of 128
weights each, are the usual answer to them); these rows have none.
""")

# %% [markdown]
# One fact about these weights colours every number in this chapter. The SmolLM2 this
# book embeds is **not** the model as it was trained: [chapter 2b](02b_smollm2.py)
# dequantized it from a GGUF file of **Q4_1 blocks** — every 32 consecutive weights of
# a row stored as 16 levels $d\,q + m$, each block with its own $d$ and $m$ — and
# stored the result in bf16. So every row is made of a few hundred distinct values at
# most:

# %%
q_rows = bf16_bits_to_f32(smol_weights["model.layers.0.self_attn.q_proj.weight"])
distinct = np.array([np.unique(row).size for row in q_rows])
blocks_per_row = q_rows.shape[1] // 32
print(f"layer 0's q_proj: rows of {q_rows.shape[1]} weights, {blocks_per_row} Q4_1 "
      f"blocks of 16 levels:\nat most {16 * blocks_per_row} distinct values a row; "
      f"the median row has {int(np.median(distinct))}")
prose.glue("ch15_distinct", int(np.median(distinct)))
prose.glue("ch15_distinct_max", 16 * blocks_per_row)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
A median row of {{ch15_distinct}} distinct values (at most {{ch15_distinct_max}}) is
already a coarse grid, and an 8-bit grid of 255 levels per row laid over it cannot
keep all of them: it rounds a 4-bit model once more. Three things follow for the
comparisons below. The reference, "bf16", is this 4-bit-derived model, so they measure
how much 8 bits change *it*, not how far 8 bits would move the original SmolLM2. Its
weights are lumpier than trained weights are, so the error 8 bits add here is a
sample of one kind of row, not a law. And a model that already lost some precision
may be more, or less, sensitive to losing more — which only a measurement of its
predictions settles. For a model stored in bf16 from the start, published results are
the check: FP8 checkpoints of Llama 3.2 1B Instruct published for vLLM report
scores close to bf16's on standard benchmarks (their model cards say by how much; this
book has not reproduced them). The Llama 3.2 1B stand-in this book measures speed
with has random weights, whose predictions mean nothing.
""")

# %% [markdown]
# ## Quantizing as the model loads
#
# vLLM's switch is an argument of the engine, `LLM(model, quantization=...)`, and so is
# this engine's: `quantization="int8"` or `"fp8"` (None, the default, keeps bf16)
# quantizes the bf16 folder's weights as they are loaded, so any model folder the
# engine reads can run in 8 bits, with no converted checkpoint to make or store. A
# value it does not know is a `ValueError` when the engine is made.
#
# Which weights: the four matrices of every layer — chapter 7's fused `qkv_proj`,
# `o_proj`, the fused `gate_up_proj`, `down_proj` — which are most of the bytes. The
# norms' weights are a few KiB and stay bf16. The **tied embedding and LM head** are
# the one real choice. The embedding is a lookup — a step reads one row per token — so
# storing it in 8 bits would save memory but no time. The LM head, the same matrix, is
# read whole every step: for Llama 3.2 1B it is 128,256 rows of 2,048, a fifth of the
# model. Quantizing it saves half those bytes at batch 1, at the price of a second
# copy of the table (8-bit for the head beside the bf16 embedding) and of the error
# that rounding every logit's weights makes. This engine **keeps the head in bf16** by
# default (`quantize_lm_head=False`), as the FP8 checkpoints published for vLLM
# usually do (their recipes leave `lm_head` out); `quantize_lm_head=True` takes the
# other choice, whose accuracy the study below measures and whose speed the last GPU
# section predicts (and shows, once measured).
# Here is what each choice predicts for the batch-1 limit of Llama 3.2 1B:

# %%
#| export models.llama_quantized
import math

import numpy as np

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.quantization.formats import (
    QuantizedTensor,
    check_quantization,
    quantize,
)

# the fused matrices of every layer that are stored in 8 bits (chapter 7's names), and
# the Hugging Face matrices whose rows each stacks, in order
HF_MATRICES = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "o_proj": ("self_attn.o_proj",),
               "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
               "down_proj": ("mlp.down_proj",)}
QUANTIZED_MATRICES = tuple(HF_MATRICES)
# the models' default: the LM head (for SmolLM2 and Llama 3.2 1B, the tied embedding)
# stays bf16, as in most FP8 checkpoints made for vLLM, and so does the engine's
# (EngineConfig.quantize_lm_head); chapter 15 counts and measures the other choice
QUANTIZE_LM_HEAD = False
CODE_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(np.uint8)}  # e4m3's bits


def is_quantized(name: str, lm_head: bool = QUANTIZE_LM_HEAD) -> bool:
    """Whether the fused weight `name` ("layers.3.qkv_proj", "lm_head") is 8-bit."""
    return name.rsplit(".", 1)[-1] in QUANTIZED_MATRICES or (
        lm_head and name == "lm_head"
    )


def quantized_shapes(config: ModelConfig,
                     lm_head: bool = QUANTIZE_LM_HEAD) -> dict[str, tuple[int, int]]:
    """(out, in) of each kind of matrix stored in 8 bits (each layer has one of each
    of the four; the head, where lm_head, once).
    """
    c, H = config, config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"qkv_proj": (q + 2 * kv, H), "o_proj": (H, q),
              "gate_up_proj": (2 * c.intermediate_size, H),
              "down_proj": (H, c.intermediate_size)}
    return shapes | ({"lm_head": (c.vocab_size, H)} if lm_head else {})


def layer_matrix_bytes(config: ModelConfig, quantization: str | None) -> int:
    """The bytes of every layer's four matrices: 8-bit codes and a float32 scale a
    row, or bf16."""
    check_quantization(quantization)
    return config.num_hidden_layers * sum(
        rows * (cols + 4) if quantization is not None else 2 * rows * cols
        for rows, cols in quantized_shapes(config, lm_head=False).values())


def decode_weight_bytes(
    config: ModelConfig, quantization: str | None, lm_head: bool = QUANTIZE_LM_HEAD
) -> int:
    """The bytes of weights a decode step at batch 1 reads: every layer's matrices
    (8-bit codes and a float32 scale a row, or bf16), the norms, the LM head whole, and
    one row of the embedding where the head is not that same bf16 table.
    """
    check_quantization(quantization)
    c, bf16 = config, 2
    in_8_bits = quantization is not None
    H, V = c.hidden_size, c.vocab_size
    norms = c.num_hidden_layers * 2 * bf16 * H + bf16 * H  # 2 a layer, and the last
    head_8_bit = in_8_bits and lm_head
    head = V * (H + 4) if head_8_bit else bf16 * V * H
    embed_row = bf16 * H if head_8_bit or not c.tie_word_embeddings else 0
    return layer_matrix_bytes(config, quantization) + norms + head + embed_row


def stored_scales(weights: dict[str, np.ndarray],
                  config: ModelConfig) -> dict[str, np.ndarray]:
    """The row scales of the matrices that `weights` holds as 8-bit codes already (a
    checkpoint's: "<name>.weight_scale" beside the codes, "<name>.weight"), by fused
    name, stacked as chapter 7 stacks their rows.
    """
    scales = {}
    for i in range(config.num_hidden_layers):
        for fused, parts in HF_MATRICES.items():
            names = [f"model.layers.{i}.{part}.weight_scale" for part in parts]
            missing = [n for n in names if n not in weights]
            if len(missing) == len(names):
                continue  # bf16: quantized as it loads
            if missing:
                raise ValueError(f"{missing[0]} is missing: the rows of layers.{i}."
                                 f"{fused} must all come in 8 bits or none")
            scales[f"layers.{i}.{fused}"] = np.concatenate([weights[n] for n in names])
    return scales


def quantized_tensor(name: str, array: np.ndarray, method: str,
                     scales: dict, tensors: dict) -> QuantizedTensor:
    """The fused matrix `name` in 8 bits: tensors[name] where given (made elsewhere:
    GPTQ's, below); else `array` as codes under scales[name], where the weights
    brought them; else `array`, bf16 bits, rounded to nearest now.
    """
    if name in tensors:
        q = tensors[name]
    elif name in scales:
        q = QuantizedTensor(method, array, scales[name])
    else:
        q = quantize(bf16_bits_to_f32(array), method)
    want = (array.shape, CODE_DTYPES[method], (len(array),))
    if q.method != method or (q.shape, q.codes.dtype, q.scales.shape) != want:
        raise ValueError(f"{name}: need {method} codes ({want[1]}) {want[0]} and "
                         f"scales {want[2]}, got {q.method} codes ({q.codes.dtype}) "
                         f"{q.shape} and scales {q.scales.shape}")
    return q


class QuantizedLlamaNumpy(LlamaNumpy):
    """Chapter 7's NumPy model on 8-bit weights, each matrix kept as the float32
    values its codes stand for, scale times value, for NumPy's float32 matrix
    products. The codes: tensors[name] where given (by fused name), else the
    weights' own codes and row scales where they bring them, else rounded to nearest
    as the matrix loads (a rank's shard: its own rows' scales).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 quantization: str, quantize_lm_head: bool = QUANTIZE_LM_HEAD,
                 tensors: dict | None = None, fp8_gemm_tokens: int | None = None,
                 **kwargs):
        """fp8_gemm_tokens: as the GPU's FP8 GEMM path does (W8A8, later in this
        chapter), past that many token vectors round each FP8 matrix's input to bf16,
        then to e4m3 codes with one scale a token; None (the default): never."""
        if check_quantization(quantization) is None:
            raise ValueError("QuantizedLlamaNumpy needs quantization 'int8' or 'fp8'")
        self.quantization, self.quantize_lm_head = quantization, quantize_lm_head
        self.fp8_gemm_tokens = fp8_gemm_tokens if quantization == "fp8" else None
        self._given = (stored_scales(weights, config), tensors or {})  # while loading
        super().__init__(config, weights, **kwargs)
        del self._given

    def load_matrix(self, name: str, array: np.ndarray) -> np.ndarray:
        if not is_quantized(name, self.quantize_lm_head):
            return super().load_matrix(name, array)
        q = quantized_tensor(name, array, self.quantization, *self._given)
        return q.dequantize()

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if (self.fp8_gemm_tokens is not None and len(x) > self.fp8_gemm_tokens
                and is_quantized(name, self.quantize_lm_head)
                and takes_fp8_gemm(self.matrices[name].shape)):
            x = quantize(bf16_bits_to_f32(f32_to_bf16_bits(x)), "fp8").dequantize()
            return x @ self.matrices[name].T
        return super().linear(x, name)


def takes_fp8_gemm(shape: tuple[int, int]) -> bool:
    """Whether an (out, in) FP8 matrix suits the FP8 GEMM (cuBLASLt's 16-byte rule
    for both sizes)."""
    return shape[0] % 16 == 0 and shape[1] % 16 == 0


def quantized_model(device: str, config: ModelConfig, weights: dict, quantization: str,
                    comm=None, lm_head: bool = QUANTIZE_LM_HEAD):
    """The device's model on 8-bit weights ("cpu": NumPy; "cuda": the kernels), its
    LM head too where lm_head."""
    if device == "cpu":
        return QuantizedLlamaNumpy(config, weights, quantization, comm=comm,
                                   quantize_lm_head=lm_head)
    from tinyvllm_lib.models.llama_cuda_quantized import QuantizedLlamaCuda

    return QuantizedLlamaCuda(config, weights, quantization, comm=comm,
                              quantize_lm_head=lm_head)


# %%
choices = {"bf16": (None, False), "8-bit, head bf16": ("int8", False),
           "8-bit, head 8-bit": ("int8", True)}
limits = {}
for label, (method, head) in choices.items():
    nbytes = decode_weight_bytes(llama_1b, method, head)
    limits[label] = GB_S * 1e9 / nbytes
    print(f"{label:>18}: {nbytes / 1e9:.3f} GB a step, at most {limits[label]:,.0f} "
          f"tok/s at batch 1")
    key = label.replace(",", "").replace(" ", "_").replace("-", "")
    prose.glue(f"ch15_gb_{key}", f"{nbytes / 1e9:.2f} GB")
    prose.glue(f"ch15_limit_{key}", f"{limits[label]:,.0f} tok/s")
assert decode_weight_bytes(llama_1b, None) == bf16_bytes  # chapter 11's count
prose.glue("ch15_share_of_limit", f"{measured_tok_s / bf16_limit:.0%}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
With its matrices in 8 bits and the head in bf16, Llama 3.2 1B's step reads
{{ch15_gb_8bit_head_bf16}} instead of {{ch15_gb_bf16}}: at the same ceiling, at most
{{ch15_limit_8bit_head_bf16}} at batch 1, against bf16's {{ch15_limit_bf16}}. With the
head in 8 bits too, {{ch15_gb_8bit_head_8bit}} and at most
{{ch15_limit_8bit_head_8bit}}. (FP8's bytes are int8's: one a weight, a float32 scale
a row.) These are limits, what reading the bytes alone would take; chapter 11's
engine reached {{ch15_share_of_limit}} of its bf16 limit, and the rest of its step
(attention, launches, the sampler) does not shrink with the weights.
""")

# %% [markdown]
# **The NumPy backend** runs the same quantized model on the CPU. It could multiply
# the int8 codes and apply each row's scale after the sum, as the GPU kernels below do;
# it does not, because NumPy has no matrix product of int8 by float32 that is faster
# than its float32 one (BLAS's), and the two compute the same sums up to float32's
# rounding: $\sum_k x_k (s_n q_{nk})$ against $s_n \sum_k x_k q_{nk}$. So
# `QuantizedLlamaNumpy` — chapter 7's model with the one method that loads each fused
# matrix, `load_matrix`, overridden — quantizes each matrix as it loads and keeps the
# float32 values the codes stand for, $s_n q_{nk}$: the CPU model has exactly the
# 8-bit model's weights, and chapter 7's speed. It is the reference the kernels are
# tested against, and what the accuracy study below runs. (It also takes codes made
# elsewhere, `tensors=`, and weights that come as codes already, with
# `<name>.weight_scale` beside them: the GPTQ section and the checkpoint section below
# use those.)
#
# Here is SmolLM2 answering one question three ways on the CPU:

# %%
question = [{"role": "user", "content": "What is the capital of France?"}]
greedy = SamplingParams(temperature=0.0, max_tokens=24)
answers = {}
for method in (None, "int8", "fp8"):
    t0 = time.perf_counter()
    llm = LLM("smollm2", device="cpu", max_model_len=256, max_num_seqs=1,
              quantization=method)
    up = time.perf_counter() - t0
    answers[method] = llm.chat(question, greedy, use_tqdm=False)[0].outputs[0]
    print(f"{method or 'bf16':>5} (up in {up:.1f} s): {answers[method].text!r}")
try:
    LLM("smollm2", device="cpu", quantization="int4")
except ValueError as error:
    print("int4:", error)

# %% [markdown]
# ## What 8 bits do to the predictions
#
# A matrix's error is a means; the model's predictions are the end. Two measurements,
# both **teacher-forced** — each model is fed the same tokens and asked, at every
# position, how likely each next token is — so that one early difference does not send
# the rest of a comparison down another path:
#
# - **the book's own prose**: the markdown cells of chapter 1 (from its `.py` file),
#   its first 2,048 tokens — 2,047 predictions of the next one — so nothing is
#   downloaded. Perplexity is $\exp$ of the mean $-\log p$ of each actual
#   next token; beside it the mean $|\Delta \log p|$ of those tokens against bf16;
# - **20 chat questions**: bf16's greedy answer to each (32 tokens at most), fed
#   through each 8-bit model. At each position of an answer, does the 8-bit model's top
#   token equal bf16's? Where it does not, how close were bf16's two best — its
#   **top-two margin**, $\log p_1 - \log p_2$? A flip where bf16 itself hesitated
#   (a small margin) is a coin that landed the other way; a flip where bf16 was sure
#   is damage.
#
# The targets this chapter set itself: perplexity within 1% of bf16's for int8 and 2%
# for FP8, and no flip where bf16's margin exceeds 0.5. These take a few minutes of
# NumPy on a CPU, too long for every build of the book, so a script measures them and
# records the result in `book/data/ch15_accuracy.json`, which this page reads:
#
# ```bash
# python bench/ch15_accuracy_cpu.py      # a few minutes on 2 cores
# ```
#
# It runs the NumPy models above: the same `QuantizedLlamaNumpy` the engine loads for
# `quantization=`, each format with the LM head in bf16 (the engine's choice) and in
# 8 bits (the other one).

# %%
accuracy = load_records("ch15_accuracy")
LABELS = ["int8", "fp8", "int8, head 8-bit", "fp8, head 8-bit"]
TARGETS = {"int8": 0.01, "fp8": 0.02}  # perplexity: at most this much above bf16's
text_runs = {r.get("label", "bf16"): r for r in accuracy
             if r["name"] == "text_perplexity"}
chat_runs = {r["label"]: r for r in accuracy if r["name"] == "chat_flips"}
margins = next((r for r in accuracy if r["name"] == "chat_margins"), None)
if not accuracy:
    print("not yet recorded: run python bench/ch15_accuracy_cpu.py")
    prose.glue("ch15_accuracy_where", "not yet recorded")
else:
    where = accuracy[0]
    prose.glue("ch15_accuracy_where", f"recorded on {where['device']['name']}, "
               f"{where['date']}")
    ref = text_runs["bf16"]
    print(f"bf16: perplexity {ref['value']:.3f} over {ref['shape'][0]:,} tokens of "
          f"{ref['source']}")
    prose.glue("ch15_ppl_bf16", f"{ref['value']:.3f}")
    prose.glue("ch15_text_tokens", f"{ref['shape'][0]:,}")
    prose.glue("ch15_num_positions", f"{margins['value']:,.0f}")
    for label in LABELS:
        t, c = text_runs[label], chat_runs[label]
        method = label.split(",")[0]
        change = t["ratio_to_bf16"] - 1
        is_met = change <= TARGETS[method]
        sure_flips = [f for f in c["flips"] if f["bf16_margin"] > 0.5]
        print(f"{label}: perplexity {t['value']:.3f} ({change:+.2%}; target "
              f"{TARGETS[method]:.0%}: {'met' if is_met else 'missed'}), mean "
              f"|Δ log p| {t['mean_abs_dlogp']:.3f}\n    chat: {c['value']:.0f} of "
              f"{c['shape'][1]} top tokens differ, {len(sure_flips)} where bf16's "
              f"margin > 0.5 (largest {c['largest_flip_margin']:.2f})")
        key = label.replace(", head 8-bit", "_head")
        prose.glue(f"ch15_ppl_{key}", f"{t['value']:.3f} ({change:+.2%})")
        prose.glue(f"ch15_ppl_verdict_{key}", "within" if is_met else "outside")
        prose.glue(f"ch15_dlogp_{key}", f"{t['mean_abs_dlogp']:.3f}")
        prose.glue(f"ch15_flips_{key}", f"{c['value']:.0f}")
        prose.glue(f"ch15_sure_flips_{key}", f"{len(sure_flips)} time"
                   + "s" * (len(sure_flips) != 1))
        prose.glue(f"ch15_worst_flip_{key}", f"{c['largest_flip_margin']:.2f}")
    main_flips = [f for label in ("int8", "fp8") for f in chat_runs[label]["flips"]]
    near = sum(f["bf16_margin"] <= 0.5 for f in main_flips)
    prose.glue("ch15_near_flips", f"{near} of the {len(main_flips)}")
    ppl_cost = {label: text_runs[label]["ratio_to_bf16"] - 1 for label in LABELS}
    head_cost = {m: ppl_cost[f"{m}, head 8-bit"] - ppl_cost[m] for m in ("int8", "fp8")}
    prose.glue("ch15_head_cost_int8", f"{100 * head_cost['int8']:+.2f}")
    prose.glue("ch15_head_cost_fp8", f"{100 * head_cost['fp8']:+.2f}")
    all_met = all(ppl_cost[m] <= TARGETS[m] for m in ("int8", "fp8"))
    no_sure_flip = not any(f["bf16_margin"] > 0.5 for f in main_flips)
    prose.glue("ch15_targets_verdict", (
        "Both targets are met." if all_met and no_sure_flip else
        "The perplexity targets are met; the flip target is not: an 8-bit model is a "
        "slightly different model, and a few of its answers take another turn where "
        "bf16 preferred its token, but not by much." if all_met else
        "The perplexity targets are not both met."))

# %% tags=["hide-input"]
if accuracy:
    fig, (ax_ppl, ax_flip) = new_figure(1, 2, width=9.5, height=3.4,
                                        gridspec_kw={"width_ratios": [1, 1.6]})
    changes = [100 * (text_runs[label]["ratio_to_bf16"] - 1) for label in LABELS]
    colors = ["#1f77b4", "#ff7f0e", "#aec7e8", "#ffbb78"]
    ax_ppl.bar(range(4), changes, color=colors)
    for x, label in enumerate(LABELS):
        target = 100 * TARGETS[label.split(",")[0]]
        ax_ppl.plot([x - 0.4, x + 0.4], [target, target], "k--", lw=1)
    ax_ppl.set_xticks(range(4), [label.replace(", ", ",\n") for label in LABELS],
                      fontsize=8)
    ax_ppl.set_ylabel("perplexity increase over bf16 (%)")
    ax_ppl.set_title("the book's prose (dashes: targets)", fontsize=9)
    ax_ppl.axhline(0, color="k", lw=0.5)
    every = np.concatenate([np.array(m) for m in margins["margins"]])
    for y, label in enumerate(LABELS):
        ax_flip.scatter(np.maximum(every, 1e-3), np.full(every.size, y), s=4,
                        color="#d0d0d0", zorder=1)
        flipped = [max(f["bf16_margin"], 1e-3) for f in chat_runs[label]["flips"]]
        ax_flip.scatter(flipped, np.full(len(flipped), y), s=18, color=colors[y],
                        edgecolor="k", lw=0.4, zorder=2)
    ax_flip.axvline(0.5, color="k", ls="--", lw=1)
    ax_flip.set_xscale("log")
    ax_flip.set_yticks(range(4), LABELS, fontsize=8)
    ax_flip.set_xlabel("bf16's top-two log-prob margin at the position "
                       "(below 0.001 drawn at 0.001)")
    ax_flip.set_title("20 answers: every position (grey), where the top token "
                      "differs (colour)", fontsize=9)
    plt.show()

# %% [markdown]
# The flips past the target's margin, each with the answer so far (bf16's greedy
# tokens, teacher-forced), the token bf16 preferred and the one the 8-bit model did:

# %%
if accuracy:
    from tinyvllm_lib.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    for label in ("int8", "fp8"):
        for f in chat_runs[label]["flips"]:
            if f["bf16_margin"] <= 0.5:
                continue
            question = margins["questions"][f["question"]]
            before = margins["answers"][f["question"]][: f["position"]]
            print(f"{label}, margin {f['bf16_margin']:.2f}: {question!r}\n    ..."
                  f"{tokenizer.decode(before)[-36:]!r} -> bf16 "
                  f"{tokenizer.decode([f['bf16_token']])!r}, {label} "
                  f"{tokenizer.decode([f['token']])!r}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if accuracy:
    prose.show("""
On {{ch15_text_tokens}} tokens of chapter 1's prose ({{ch15_accuracy_where}}) bf16's
perplexity is {{ch15_ppl_bf16}}; int8's is {{ch15_ppl_int8}}, {{ch15_ppl_verdict_int8}}
its 1% target, with a mean |Δ log p| of {{ch15_dlogp_int8}}; FP8's is
{{ch15_ppl_fp8}}, {{ch15_ppl_verdict_fp8}} its 2%, with {{ch15_dlogp_fp8}}. Along the
20 answers' {{ch15_num_positions}} positions int8's top token differs from bf16's at
{{ch15_flips_int8}}, FP8's at {{ch15_flips_fp8}}. Where bf16's margin exceeds 0.5 —
the target says never — int8 flips {{ch15_sure_flips_int8}} (the largest
margin it flipped: {{ch15_worst_flip_int8}}) and FP8 {{ch15_sure_flips_fp8}} (largest
{{ch15_worst_flip_fp8}}); {{ch15_near_flips}} flips of the two sit where bf16's two
best were within 0.5 of each other. {{ch15_targets_verdict}} The right-hand panel
shows where each flip sits among all the positions.

With the LM head in 8 bits too, int8 gives {{ch15_ppl_int8_head}} and
{{ch15_flips_int8_head}} flips ({{ch15_sure_flips_int8_head}} past the margin), FP8
{{ch15_ppl_fp8_head}} and {{ch15_flips_fp8_head}} ({{ch15_sure_flips_fp8_head}}): the
head adds {{ch15_head_cost_int8}} percentage points to the perplexity's change in
int8 and {{ch15_head_cost_fp8}} in FP8. The head's rounding reaches every logit
directly, with no later layer to dilute it. That, with what the head costs in bytes,
is the trade the last GPU section predicts; the engine keeps the head in bf16 unless
`quantize_lm_head=True`.
""")

# %% [markdown]
# ## Rounding that knows the inputs: GPTQ
#
# Round-to-nearest makes each weight's own error as small as it can be, and that is
# not what the model feels. A layer's output for an input row $x$ errs by
# $\sum_k x_k (w_{nk} - \hat w_{nk})$: an error in a column that always meets a large
# input matters, one whose input is always near zero does not, and errors in columns
# whose inputs move together can cancel. Summed over inputs $X$ (a row per token), the
# squared output error of row $n$ is $e_n H e_n^\top$ with $e_n = w_n - \hat w_n$ and
# $H = X^\top X$. **GPTQ** (Frantar et al., 2022) lowers it with the same grid and
# the same scales: it rounds one column at a time and moves that column's rounding
# error onto the columns not yet rounded, in the proportions $H^{-1}$ says cancel it
# best (the optimal brain surgeon's update). Columns go in order of their inputs'
# energy, $H_{kk}$, largest first, so the columns that matter most are rounded while
# the most freedom is left to compensate them. The result is codes and one scale per
# row, exactly what the kernels read: only how the codes were chosen changes.
#
# $H$ needs inputs: **calibration** text run through the bf16 model, summing
# $X^\top X$ at each matrix's input. The engine's `quantization=` stays
# round-to-nearest, which needs nothing but the weights; GPTQ here is a study on
# SmolLM2, done before loading, as GPTQ checkpoints are made.

# %%
#| export quantization.gptq
import numpy as np

from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.llama_quantized import is_quantized
from tinyvllm_lib.quantization.formats import (
    CODE_MAX,
    INT8_MAX,
    QuantizedTensor,
    check_quantization,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
)


class HessianProbe(LlamaNumpy):
    """Chapter 7's NumPy model whose linear also sums XᵀX (float64) of the input of
    each matrix that is stored in 8 bits, into `hessians` by fused name.
    """

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if is_quantized(name):
            hessians = self.__dict__.setdefault("hessians", {})
            x64 = x.astype(np.float64)
            hessians[name] = hessians.get(name, 0.0) + x64.T @ x64
        return super().linear(x, name)


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, method: str,
                  damp: float = 0.01, block: int = 128) -> QuantizedTensor:
    """An (out, in) weight in 8 bits, one scale a row (max |w| / the largest code, as
    quantize), its codes chosen by GPTQ against hessian = XᵀX (in, in) of its inputs:
    column by column, largest H_kk first, each column's rounding error moved onto the
    columns after it through H⁻¹'s Cholesky factor; damp · mean(H_kk) added to H's
    diagonal; block columns' updates applied to the rest at once.
    """
    if check_quantization(method) is None or np.ndim(w) != 2:
        raise ValueError(f"gptq_quantize takes an (out, in) weight and 'int8' or "
                         f"'fp8', got shape {np.shape(w)} and {method!r}")
    W = np.array(w, dtype=np.float64)
    N, K = W.shape
    H = np.array(hessian, dtype=np.float64)
    if H.shape != (K, K):
        raise ValueError(f"hessian must be ({K}, {K}) for a weight {W.shape}, "
                         f"got {H.shape}")
    scales = (np.max(np.abs(W), axis=1) / CODE_MAX[method]).astype(np.float32)
    s = np.where(scales > 0, scales, 1).astype(np.float64)
    dead = np.diag(H) == 0  # an input that was always zero: its weights never count
    H[dead, dead], W[:, dead] = 1.0, 0.0
    order = np.argsort(-np.diag(H), kind="stable")
    W, H = W[:, order], H[np.ix_(order, order)]
    H[np.diag_indices(K)] += damp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper triangular: H⁻¹ = Uᵀ U
    codes = np.empty((N, K), np.int8 if method == "int8" else np.uint8)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        moved = np.empty((N, b1 - b0))
        for i in range(b0, b1):
            if method == "int8":
                codes[:, i] = np.clip(np.rint(W[:, i] / s), -INT8_MAX, INT8_MAX)
                value = codes[:, i].astype(np.float64)
            else:
                codes[:, i] = fp8_e4m3_encode((W[:, i] / s).astype(np.float32))
                value = fp8_e4m3_decode(codes[:, i]).astype(np.float64)
            error = (W[:, i] - value * s) / U[i, i]
            W[:, i:b1] -= np.outer(error, U[i, i:b1])
            moved[:, i - b0] = error
        W[:, b1:] -= moved @ U[b0:b1, b1:]
    unsorted = np.empty_like(codes)
    unsorted[:, order] = codes
    return QuantizedTensor(method, unsorted, scales)


# %% [markdown]
# A check on a random layer whose inputs, like a model's, are correlated and of
# unequal sizes: GPTQ's codes lie on the same grid, under the same scales, as
# round-to-nearest's, each weight's own error is larger, and the output error
# $\operatorname{tr}(E H E^\top)$ is smaller.

# %%
from tinyvllm_lib.quantization.gptq import gptq_quantize

K_DEMO = 256
mixing = rng.standard_normal((K_DEMO, K_DEMO)) * np.exp(rng.uniform(-2, 1, K_DEMO))
X_demo = rng.standard_normal((2048, K_DEMO)) @ mixing  # correlated inputs
H_demo = X_demo.T @ X_demo
w_demo = rng.standard_normal((96, K_DEMO)).astype(np.float32)
for method in ("int8", "fp8"):
    plain, gptq = quantize(w_demo, method), gptq_quantize(w_demo, H_demo, method)
    assert np.array_equal(plain.scales, gptq.scales)
    assert gptq.codes.dtype == plain.codes.dtype
    if method == "int8":
        assert np.abs(gptq.codes.astype(int)).max() <= INT8_MAX
    errors = {}
    for label, q in (("round to nearest", plain), ("GPTQ", gptq)):
        E = (w_demo - q.dequantize()).astype(np.float64)
        errors[label] = (np.mean(E**2), np.trace(E @ H_demo @ E.T))
        print(f"{method} {label:>16}: mean squared weight error {errors[label][0]:.3e},"
              f" output error {errors[label][1]:.3e}")
    assert errors["GPTQ"][1] < 0.8 * errors["round to nearest"][1]
    assert errors["GPTQ"][0] > errors["round to nearest"][0]

# %% [markdown]
# On SmolLM2, `bench/ch15_gptq_cpu.py` takes its calibration from chat: 38 questions
# of its own, none of the 20 above, and bf16's greedy answers to them, teacher-forced
# through `HessianProbe`. It then quantizes every layer's matrices both ways and
# measures as the accuracy study does, on the same 20 answers and the same prose
# (a few minutes of NumPy; `book/data/ch15_gptq.json`):

# %%
gptq_runs = load_records("ch15_gptq")
if not gptq_runs:
    print("not yet recorded: run python bench/ch15_gptq_cpu.py")
    for key in ("int8", "fp8"):
        for what in ("sure", "worst", "dlogp", "ppl"):
            for how in ("rtn", "gptq"):
                prose.glue(f"ch15_gptq_{what}_{how}_{key}", "not yet recorded")
    prose.glue("ch15_gptq_calibration", "not yet recorded")
    prose.glue("ch15_gptq_jitter_int8", "not yet recorded")
    prose.glue("ch15_gptq_jitter_fp8", "not yet recorded")
else:
    by = {(r["quantization"], r["rounding"]): r for r in gptq_runs
          if r["name"] == "chat_flips"}
    text_by = {(r["quantization"], r["rounding"]): r for r in gptq_runs
               if r["name"] == "text_perplexity"}
    calibration = gptq_runs[0]["calibration"]
    prose.glue("ch15_gptq_calibration", f"{calibration['tokens']:,} tokens of "
               f"{calibration['sequences']} chats")
    fig, (ax_sure, ax_dlogp) = new_figure(1, 2, width=9, height=2.8)
    for x, key in enumerate(("int8", "fp8")):
        for dx, how in ((-0.18, "rtn"), (0.18, "gptq")):
            c, t = by[key, how], text_by[key, how]
            sure = sum(f["bf16_margin"] > 0.5 for f in c["flips"])
            print(f"{key} {how:>4}: {c['value']:.0f} top tokens differ, {sure} where "
                  f"bf16's margin > 0.5 (largest {c['largest_flip_margin']:.2f}); "
                  f"answers' mean |Δ log p| {c['mean_abs_dlogp']:.4f}; prose "
                  f"perplexity {t['ratio_to_bf16'] - 1:+.2%}")
            prose.glue(f"ch15_gptq_sure_{how}_{key}", f"{sure}")
            worst = c["largest_flip_margin"]
            prose.glue(f"ch15_gptq_worst_{how}_{key}", f"{worst:.2f}")
            prose.glue(f"ch15_gptq_dlogp_{how}_{key}", f"{c['mean_abs_dlogp']:.3f}")
            prose.glue(f"ch15_gptq_ppl_{how}_{key}", f"{t['ratio_to_bf16'] - 1:+.2%}")
            color = "#bbbbbb" if how == "rtn" else "#1f77b4"
            label = {"rtn": "round to nearest", "gptq": "GPTQ"}[how] if x == 0 else None
            ax_sure.bar(x + dx, sure, 0.34, color=color, label=label)
            ax_dlogp.bar(x + dx, c["mean_abs_dlogp"], 0.34, color=color)
    for key in ("int8", "fp8"):  # round to nearest under scales nudged down < 1%
        nudged = sorted(sum(f["bf16_margin"] > 0.5 for f in r["flips"])
                        for (m, how), r in by.items()
                        if m == key and how.startswith("rtn_jitter"))
        prose.glue(f"ch15_gptq_jitter_{key}", f"{nudged[0]} to {nudged[-1]} "
                   f"(in {len(nudged)} roundings)" if nudged else "not recorded")
    for ax, title in ((ax_sure, "flips where bf16's margin > 0.5 (target: 0)"),
                      (ax_dlogp, "mean |Δ log p| along the 20 answers")):
        ax.set_xticks([0, 1], ["int8", "FP8"])
        ax.set_title(title, fontsize=9)
    ax_sure.legend(fontsize=8)
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
Calibrated on {{ch15_gptq_calibration}}, GPTQ's int8 flips {{ch15_gptq_sure_gptq_int8}}
times where bf16's margin exceeds 0.5 (round-to-nearest: {{ch15_gptq_sure_rtn_int8}},
the largest at {{ch15_gptq_worst_rtn_int8}}), and the answers' mean |Δ log p| goes from
{{ch15_gptq_dlogp_rtn_int8}} to {{ch15_gptq_dlogp_gptq_int8}}. FP8 goes from
{{ch15_gptq_sure_rtn_fp8}} such flips (largest {{ch15_gptq_worst_rtn_fp8}}) to
{{ch15_gptq_sure_gptq_fp8}} (largest {{ch15_gptq_worst_gptq_fp8}}), its |Δ log p| from
{{ch15_gptq_dlogp_rtn_fp8}} to {{ch15_gptq_dlogp_gptq_fp8}}. The prose's perplexity
moves {{ch15_gptq_ppl_gptq_int8}} (int8) and {{ch15_gptq_ppl_gptq_fp8}} (FP8) from
bf16's, against {{ch15_gptq_ppl_rtn_int8}} and {{ch15_gptq_ppl_rtn_fp8}} rounded to
nearest: GPTQ aims its error away from the inputs it was shown, chat here, so text
unlike them gains less. Twenty answers are a small test: a single position decides
whether a target of "never" is met. Round-to-nearest under each row's scale nudged
down by less than 1% rounds nearly every weight differently (and clips each row's
largest a little, which costs the prose's perplexity a few tenths of a percent); it
gives int8 {{ch15_gptq_jitter_int8}} such flips and FP8 {{ch15_gptq_jitter_fp8}}: read a
flip more or less as noise, and the |Δ log p| as the steadier measure. The kernels
did not change; what serving these takes is a checkpoint, codes and scales made
once, offline, which the next section builds.
""")

# %% [markdown]
# ### Where GPTQ's FP8 flip past the margin comes from
#
# Is one matrix to blame for a flip where bf16 was sure — an outlier that keeping it in
# bf16 would fix — or is the error spread over the model? `bench/ch15_flip_cpu.py`
# takes each such position of GPTQ's FP8 and measures the lead of bf16's token over
# the model's best other token there (their log-probs' difference; below zero, the
# flip): with every matrix in FP8, with one kind of matrix kept in bf16 in every layer,
# and with one layer's four matrices kept in bf16, one layer at a time; and, as a
# control, with every matrix in bf16, which must give bf16's own margin back
# (`book/data/ch15_flip.json`). One position is a small sample: what follows reads
# that one flip, not FP8 in general.

# %%
flip_runs = load_records("ch15_flip")
if flip_runs:  # the newest run: its date and its total seconds tell it apart
    run_key = (flip_runs[-1]["date"], flip_runs[-1].get("seconds_total"))
    flip_runs = [r for r in flip_runs if (r["date"], r.get("seconds_total")) == run_key]
    prose.glue("ch15_flip_minutes", f"{run_key[1] / 60:.0f} minutes")
leads = [r for r in flip_runs if r["name"] == "flip_lead"]
if leads:
    # the position where bf16 was surest
    spot = max({tuple(r["shape"]): r["bf16_margin"] for r in leads}.items(),
               key=lambda kv: kv[1])[0]
    here = [r for r in leads if tuple(r["shape"]) == spot]
    margin = here[0]["bf16_margin"]
    every_fp8 = next(r["value"] for r in here if r["kept_bf16"] == "none")
    by_kind = {r["which"]: r["value"] for r in here if r["kept_bf16"] == "kind"}
    by_layer = {int(r["which"]): r["value"] for r in here if r["kept_bf16"] == "layer"}
    fig, (ax_k, ax_l) = new_figure(1, 2, width=10, height=3.0, sharey=True,
                                   gridspec_kw={"width_ratios": [1, 3]})
    kinds = ["none", *by_kind]
    ax_k.bar(range(len(kinds)), [every_fp8, *by_kind.values()],
             color=["#7f7f7f"] + ["#1f77b4"] * len(by_kind))
    ax_k.set_xticks(range(len(kinds)), [k.replace("_proj", "") for k in kinds],
                    rotation=30, fontsize=8)
    ax_k.set_title("kept bf16 in every layer", fontsize=9)
    ax_l.bar(list(by_layer), list(by_layer.values()), color="#2ca02c")
    ax_l.set_xlabel("the layer whose four matrices are kept bf16")
    ax_l.set_title("kept bf16: one layer", fontsize=9)
    for ax in (ax_k, ax_l):
        ax.axhline(0, color="black", lw=0.8)
        ax.axhline(margin, color="#d62728", ls=":", label="bf16's own margin")
        ax.axhline(every_fp8, color="#7f7f7f", ls="--", label="every matrix FP8")
    ax_k.set_ylabel("lead of bf16's token (log-prob)")
    ax_l.legend(fontsize=7)
    plt.show()
    control = [r["value"] for r in here if r["kept_bf16"] == "all"]
    assert all(abs(v - margin) < 1e-3 for v in control), "the all-bf16 control"
    if accuracy:  # the answer so far, from the accuracy study's records
        question = margins["questions"][spot[0]]
        before = margins["answers"][spot[0]][: spot[1]]
        assert margins["answers"][spot[0]][spot[1]] == here[0]["bf16_token"]
        prose.glue("ch15_flip_where", (
            f"the answer to {question!r} after {tokenizer.decode(before)[-36:]!r} "
            f"(bf16's next token {tokenizer.decode([here[0]['bf16_token']])!r}, "
            f"FP8's {tokenizer.decode([here[0]['flipped_to']])!r})"))
    else:
        prose.glue("ch15_flip_where", f"question {spot[0]}, answer position {spot[1]}")
    prose.glue("ch15_flip_margin", f"{margin:.2f}")
    prose.glue("ch15_flip_all", f"{'leads' if every_fp8 > 0 else 'trails'} by "
               f"{abs(every_fp8):.2f}")
    saving = {k: v for k, v in by_kind.items() if v > 0}
    others = "; the other kinds do not" if len(saving) < len(by_kind) else ""
    prose.glue("ch15_flip_kinds", (
        "keeping " + " or ".join(f"every `{k}` (lead {v:+.2f})"
                                 for k, v in saving.items())
        + f" in bf16 gives bf16's token back{others}"
        if saving else "no kind of matrix kept in bf16 gives bf16's token back"))
    # what keeping one layer in bf16 moves the lead by, against what FP8 lost
    lost = margin - every_fp8
    moved = {i: v - every_fp8 for i, v in by_layer.items()}
    top = max(moved, key=moved.get)
    rest = [m for i, m in moved.items() if i != top]
    prose.glue("ch15_flip_layers", (
        f"keeping layer {top} in bf16 moves the lead by {moved[top]:+.2f} of the "
        f"{lost:.2f} FP8 lost ("
        + ("enough to give bf16's token back" if by_layer[top] > 0 else "not enough")
        + f"); the other {len(rest)} layers move it by {min(rest):+.2f} to "
        f"{max(rest):+.2f}, {sum(m < 0 for m in rest)} of them the wrong way: their "
        "rounding errors had partly cancelled the others'"))
    prose.glue("ch15_flip_verdict", (
        f"So most of this flip is layer {top}'s rounding, on top of small errors "
        "everywhere. What removes it is more bits where the error gathers — that "
        "layer in bf16, a model of mixed formats as llm-compressor's `ignore` lists "
        "make — and this engine serves one format a model."
        if moved[top] > lost / 2 else
        "So no one layer carries this flip: it is the sum of small errors across the "
        "layers, and no single layer kept in bf16 is a fix."))
elif flip_runs:
    print("the newest run found no flip of GPTQ's FP8 past bf16's 0.5 margin")
else:
    print("not yet recorded: run python bench/ch15_flip_cpu.py")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if leads:
    prose.show("""
At {{ch15_flip_where}}, bf16's margin is {{ch15_flip_margin}}; with every matrix of
GPTQ's FP8, bf16's token {{ch15_flip_all}}. Per kind of matrix, {{ch15_flip_kinds}}.
Per layer, {{ch15_flip_layers}}. {{ch15_flip_verdict}} (The run took
{{ch15_flip_minutes}} on this book's CPU.)
""")

# %% [markdown]
# ## A checkpoint: quantized once, loaded as it is
#
# GPTQ took minutes a format on SmolLM2, and it needs the bf16 model and calibration
# text: nothing an engine should redo each time it starts. vLLM's users quantize once,
# offline — llm-compressor's `oneshot` with a `GPTQModifier` — and save a folder that
# vLLM loads as it is: its `config.json` carries a `quantization_config`, from which
# vLLM picks each layer's method with no `quantization=` argument, and its safetensors
# hold each matrix's 8-bit codes and scales, which vLLM loads without rounding again.
# This section builds the same pair for this engine: `python -m tinyvllm_lib quantize
# SRC DST --quantization int8 --rounding gptq` writes a folder, and `LLM(DST)` loads
# it.
#
# The folder holds:
#
# - `config.json`: the source's, with a `quantization_config`: `quant_method`
#   `"tinyvllm"`, `format` (`"int8"` or `"fp8"`), `rounding` (`"gptq"` or `"rtn"`),
#   `lm_head` (`false`: the head stays bf16) and `calibration_tokens` (0 for
#   round-to-nearest);
# - the tokenizer's files and `generation_config.json`, copied;
# - `model.safetensors`: each 8-bit matrix as `<name>.weight`, its codes `(out, in)`
#   — `I8`, or e4m3's bits as `F8_E4M3` — and `<name>.weight_scale`, one `F32` a row,
#   `(out,)`; every other tensor `BF16`, as in the source.
#
# The tensor names are compressed-tensors' (the format llm-compressor writes and vLLM
# reads), but the folder is not a compressed-tensors checkpoint: its config names the
# book's own `quant_method`, and compressed-tensors keeps a channel's scales as
# `(out, 1)` beside a `config_groups` scheme. vLLM would not load it as it is; this
# engine loads only it (a `quant_method` it does not know is a `ValueError`).
#
# **Fused or not?** The engine multiplies chapter 7's fused matrices, and the quantizer
# runs GPTQ on them: q, k and v (gate and up) read the same input, so they share one
# $X^\top X$. The file stores them apart, under their Hugging Face names. A row's
# scale belongs to that row alone, so cutting the fused codes into their parts by rows
# loses nothing, and chapter 7's stacking puts them back bit for bit. Stored that way,
# the checkpoint is read by everything that reads a Hugging Face folder: chapter 2's
# name and shape checks, chapter 7's fusing, chapter 13's sharding. vLLM's FP8
# checkpoints store them apart too, and vLLM stacks them as it loads; where their
# scale is one per tensor, the stacked matrix has three, so vLLM either re-quantizes
# q, k and v to the largest (`requantize_with_max_scale`) or spreads each part's scale
# over its rows (`convert_to_channelwise`). One scale a row needs neither.
#
# **Tensor parallelism.** Chapter 13 cuts q, k, v, gate and up by rows: a rank takes
# its rows' codes and their scales. It cuts o and down by columns: a rank takes its
# columns' codes and every row's scale, since a row's scale is the whole row's. Each
# rank's values are then exactly the one-rank model's, unlike quantizing as the model
# loads, where each rank's scale of a column-cut row is the largest of its own
# columns (exercise 5). Chapter 13's sharding changes by that one rule: a scale, a
# vector, stays whole where its matrix is cut by columns.
#
# **Calibration** is what `bench/ch15_gptq_cpu.py` used, moved into the library: 38
# chat questions (none of the 20 the accuracy study asks), each in the model's chat
# template with bf16's greedy answer, teacher-forced through `HessianProbe`.

# %%
#| export quantization.calibration
import numpy as np
from tqdm import tqdm

from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.quantization.gptq import HessianProbe

# chat questions GPTQ calibrates on: none of the accuracy study's 20 test questions
# (bench/ch15_accuracy_cpu.py's; bench/ch15_gptq_cpu.py checks they stay apart)
CALIBRATION_QUESTIONS = [
    "How do I make a cup of tea?", "What is the tallest mountain in the world?",
    "Translate 'good morning' into Spanish.", "List four musical instruments.",
    "What does a doctor do?", "Write a short poem about the moon.",
    "How many legs does a spider have?", "What is 15 plus 27?",
    "Explain gravity to a child.", "What is the chemical symbol for gold?",
    "Give me a tip for studying.", "Who painted the Mona Lisa?",
    "What is the difference between weather and climate?", "Describe a rainbow.",
    "Suggest a healthy breakfast.", "What is the main ingredient of bread?",
    "How does a bicycle work?", "Name a famous scientist.",
    "Why is exercise important?", "What is an adjective?", "Tell me a joke.",
    "How do bees make honey?", "What is the currency of Japan?",
    "Write one sentence about friendship.", "What are the three states of matter?",
    "How do I say thank you in French?", "What is a volcano?",
    "Recommend a book for children.", "What is the square root of 81?",
    "How many continents are there?", "What is the internet?",
    "Give an example of a mammal.", "How can I save money?", "What causes thunder?",
    "Explain what a noun is.", "What do plants need to grow?",
    "Describe a typical day at school.", "What is the speed of light?"]
CALIBRATION_ANSWER_TOKENS = 64  # bf16's greedy answer to each question, at most
CALIBRATION_MAX_MODEL_LEN = 512


def greedy_chats(llm: LLM, questions: list[str],
                 max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each question as a user message in the model's chat template and the engine's
    greedy answer to it (max_tokens at most): (prompt ids, answer ids).
    """
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def chat_calibration(
    folder, num_samples: int | None = None,
    answer_tokens: int = CALIBRATION_ANSWER_TOKENS,
) -> list[np.ndarray]:
    """GPTQ's calibration text, as token ids: the first num_samples of
    CALIBRATION_QUESTIONS (all by default), each chat-templated and followed by the
    folder's bf16 greedy answer, from the engine on the CPU.
    """
    questions = CALIBRATION_QUESTIONS[:num_samples]
    if not questions:
        raise ValueError(f"num_samples must be at least 1, got {num_samples!r}")
    llm = LLM(folder, device="cpu", max_model_len=CALIBRATION_MAX_MODEL_LEN,
              max_num_seqs=len(questions))
    if llm.get_tokenizer() is None:
        raise ValueError(f"{folder}: no tokenizer.json, so no chat to calibrate on; "
                         "give the calibration as token ids")
    return [np.array(p + a) for p, a in greedy_chats(llm, questions, answer_tokens)]


def collect_hessians(config: ModelConfig, weights: dict, sequences,
                     progress: bool = False) -> dict[str, np.ndarray]:
    """XᵀX (float64) at the input of every 8-bit matrix, by fused name, summed over
    the sequences, each teacher-forced alone through the bf16 model (HessianProbe).
    """
    probe = HessianProbe(config, weights)
    for ids in tqdm(sequences, desc="calibrating", unit="sequence",
                    disable=not progress):
        probe.forward(np.asarray(ids))
    return probe.hessians

# %% [markdown]
# The writer cuts each fused matrix back into its Hugging Face matrices by rows, each
# row with its own scale, and stores the codes as they are: int8 as `I8`, e4m3's bits
# under safetensors' `F8_E4M3` (written through `ml_dtypes`' type of the same bits,
# as chapter 2 wrote bf16). Chapter 2's reader already knows both: it returns `I8` as
# `int8` and every FP8 type as its `uint8` bits, so chapter 2's code needs no change.

# %%
#| export quantization.checkpoint
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_quantized import HF_MATRICES
from tinyvllm_lib.models.loader import llama_weight_shapes, load_weights
from tinyvllm_lib.quantization.formats import QUANTIZATIONS, QuantizedTensor

QUANT_METHOD = "tinyvllm"  # quantization_config's quant_method: the book's own format
ROUNDINGS = ("gptq", "rtn")  # how the codes were chosen (rtn: round to nearest)
STORED_DTYPES = {"int8": "I8", "fp8": "F8_E4M3"}  # the codes' safetensors dtype
# copied as they are (whichever the source has)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja", "generation_config.json")


def checkpoint_format(folder) -> str | None:
    """The 8-bit format ("int8" or "fp8") that a folder quantized offline names in
    its config.json's quantization_config; None where there is none (bf16 weights).
    """
    path = Path(folder) / "config.json"
    qc = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    if qc is None:
        return None
    where = f"{path}: quantization_config"
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method != QUANT_METHOD:
        raise ValueError(f"{where} has quant_method {method!r}; this engine reads its "
                         f"own, {QUANT_METHOD!r} (python -m tinyvllm_lib quantize)")
    if qc.get("format") not in QUANTIZATIONS or qc.get("lm_head", False) is not False:
        raise ValueError(f"{where} needs a format of {' or '.join(QUANTIZATIONS)} and "
                         f"lm_head false, got {qc.get('format')!r} and "
                         f"{qc.get('lm_head')!r}")
    return qc["format"]


def resolve_quantization(folder, requested: str | None) -> str | None:
    """The engine's quantization for folder: its checkpoint's format (requested may
    repeat it, not contradict it), else requested (None: bf16).
    """
    stored = checkpoint_format(folder)
    if stored is None or requested in (None, stored):
        return stored or requested
    raise ValueError(f"{folder} holds {stored} weights (its config.json's "
                     f"quantization_config), but quantization={requested!r}: leave "
                     f"quantization out, or give {stored!r}")


def split_rows(tensors: dict[str, QuantizedTensor],
               config: ModelConfig) -> dict[str, QuantizedTensor]:
    """Each layer's fused 8-bit matrices (by fused name) cut by rows into the Hugging
    Face matrices they stack, by those names ("model.layers.0.self_attn.q_proj").
    """
    shapes, parts = llama_weight_shapes(config), {}
    for i in range(config.num_hidden_layers):
        for fused, names in HF_MATRICES.items():
            q, start = tensors[f"layers.{i}.{fused}"], 0
            for name in names:
                name = f"model.layers.{i}.{name}"
                rows = slice(start, start + shapes[name + ".weight"][0])
                parts[name] = QuantizedTensor(q.method, q.codes[rows], q.scales[rows])
                start = rows.stop
            if start != len(q.codes):
                raise ValueError(f"layers.{i}.{fused} has {len(q.codes)} rows, the "
                                 f"config implies {start}")
    return parts


def save_checkpoint(src, dst, tensors: dict[str, QuantizedTensor], rounding: str,
                    **details) -> Path:
    """Write dst, a folder of src's model with each layer's matrices in 8 bits
    (tensors, by fused name): codes ("<name>.weight") and row scales
    ("<name>.weight_scale") by Hugging Face name, every other tensor bf16 as in src;
    src's config.json with a quantization_config (details added to it); its
    tokenizer's files.
    """
    src, dst = Path(src), Path(dst)
    config = ModelConfig.from_folder(src)
    methods = {q.method for q in tensors.values()}
    if len(methods) != 1 or rounding not in ROUNDINGS:
        raise ValueError(f"a checkpoint holds one format, rounded one of "
                         f"{', '.join(ROUNDINGS)}; got {methods} and {rounding!r}")
    (method,) = methods
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} is not empty: a checkpoint goes into a new folder")
    # bf16 bits, Hugging Face names
    weights = load_weights(src, config, progress=False)
    out = {name: bits.view(ml_dtypes.bfloat16) for name, bits in weights.items()}
    for name, q in split_rows(tensors, config).items():
        codes = q.codes if method == "int8" else q.codes.view(ml_dtypes.float8_e4m3fn)
        out[name + ".weight"], out[name + ".weight_scale"] = codes, q.scales
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    raw["quantization_config"] = {"quant_method": QUANT_METHOD, "format": method,
                                  "rounding": rounding, "lm_head": False, **details}
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


# %% [markdown]
# The reader takes a checkpoint's tensors as they are stored, checked against the
# config as chapter 2 checks a bf16 folder's: each 8-bit matrix's codes in its
# format's dtype and shape, a finite scale for every row, every other tensor bf16
# (or F16, F32). What it returns is a Hugging Face folder's dictionary with the codes
# where the weights were, and the scales beside them; chapter 7's fusing stacks the
# codes as it stacked bf16, `stored_scales` stacks the scales, and chapter 13's
# sharding cuts both. A folder without a `quantization_config` is read as before, and
# quantized as it loads.

# %%
#| export quantization.checkpoint
from tinyvllm_lib.models.llama_quantized import QUANTIZE_LM_HEAD, quantized_model
from tinyvllm_lib.models.loader import WEIGHT_DTYPES, convert_weight, open_checkpoint
from tinyvllm_lib.quantization.formats import check_quantization


def load_quantized_weights(folder, config: ModelConfig) -> dict[str, np.ndarray]:
    """A folder's tensors by Hugging Face name for an 8-bit model: a checkpoint's
    8-bit matrices as stored (codes under "<name>.weight", row scales under
    "<name>.weight_scale"), checked against config; every other tensor, and every
    tensor of a bf16 folder, as bf16 bits, as chapter 2's load_weights reads them.
    """
    method = checkpoint_format(folder)
    if method is None:
        return load_weights(folder, config, progress=False)
    files = open_checkpoint(folder)

    def read(name: str, dtypes: tuple[str, ...], shape: tuple) -> np.ndarray:
        if name not in files:
            raise ValueError(f"{folder}: tensor {name!r} is missing")
        info = files[name].header[name]
        if info.dtype not in dtypes or info.shape != shape:
            raise ValueError(
                f"{files[name].where}: tensor {name!r} is {info.dtype} "
                f"{list(info.shape)}; a {method} checkpoint needs "
                f"{' or '.join(dtypes)} {list(shape)}")
        return files[name].get(name)

    eight_bit = {f"model.layers.{i}.{name}.weight"
                 for i in range(config.num_hidden_layers)
                 for names in HF_MATRICES.values() for name in names}
    weights = {}
    for name, shape in llama_weight_shapes(config).items():
        if name not in eight_bit:
            bits = read(name, WEIGHT_DTYPES, shape)
            weights[name] = convert_weight(bits, files[name].header[name].dtype, "bf16")
            continue
        weights[name] = read(name, (STORED_DTYPES[method],), shape)
        scales = read(name + "_scale", ("F32",), shape[:1])
        if not np.all(np.isfinite(scales)):
            raise ValueError(f"{folder}: {name}_scale holds NaN or infinity")
        weights[name + "_scale"] = scales
    if extra := [n for n in files if n.endswith("_scale") and n not in weights]:
        raise ValueError(f"{folder}: {extra[0]!r} scales a tensor this engine keeps "
                         "in bf16")
    return weights


def load_quantized_model(folder, device: str, quantization: str,
                         lm_head: bool = QUANTIZE_LM_HEAD):
    """A Llama folder's model in 8 bits on device ("cpu" or "cuda"): a checkpoint's
    codes and scales as they are stored, a bf16 folder's matrices rounded to nearest
    as they load (and the LM head, where lm_head: a checkpoint keeps it bf16).
    """
    quantization = resolve_quantization(folder, check_quantization(quantization))
    config = ModelConfig.from_folder(folder)
    return quantized_model(device, config, load_quantized_weights(folder, config),
                           quantization, lm_head=lm_head)

# %% [markdown]
# The quantizer is the bench's recipe as a function: read the bf16 folder, calibrate
# where GPTQ needs it, quantize each layer's four fused matrices (a progress bar over
# the layers: GPTQ on SmolLM2 takes minutes a format on two CPU cores), and write the
# folder. `calibration` takes token ids instead of the chat, for a model without a
# tokenizer (the tests' tiny random Llama).

# %%
#| export quantization.quantizer
from pathlib import Path

from tqdm import tqdm

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import fuse_llama_weights
from tinyvllm_lib.models.llama_quantized import QUANTIZED_MATRICES
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.quantization.calibration import chat_calibration, collect_hessians
from tinyvllm_lib.quantization.checkpoint import (
    ROUNDINGS,
    checkpoint_format,
    save_checkpoint,
)
from tinyvllm_lib.quantization.formats import check_quantization, quantize
from tinyvllm_lib.quantization.gptq import gptq_quantize


def quantize_folder(src, dst, quantization: str, rounding: str = "gptq",
                    calibration=None, num_calibration_samples: int | None = None,
                    dampening_frac: float = 0.01, progress: bool = True) -> Path:
    """Write dst, an 8-bit checkpoint of the bf16 Llama folder src: every layer's
    matrices rounded to nearest ("rtn") or by GPTQ ("gptq") against XᵀX of the
    calibration (token id sequences; None: chat_calibration's, from
    num_calibration_samples questions, all by default).
    """
    if check_quantization(quantization) is None or rounding not in ROUNDINGS:
        raise ValueError(f"quantize_folder needs quantization 'int8' or 'fp8' and "
                         f"rounding one of {', '.join(ROUNDINGS)}, got "
                         f"{quantization!r} and {rounding!r}")
    if checkpoint_format(src) is not None:
        raise ValueError(f"{src} holds 8-bit weights already: quantize a bf16 folder")
    config = ModelConfig.from_folder(src)
    weights = load_weights(src, config, progress=False)
    fused = fuse_llama_weights(weights, config)
    details = {"calibration_tokens": 0}
    if rounding == "gptq":
        if calibration is None:
            calibration = chat_calibration(src, num_calibration_samples)
        hessians = collect_hessians(config, weights, calibration, progress)
        details = {"calibration_tokens": int(sum(len(ids) for ids in calibration)),
                   "calibration_sequences": len(calibration),
                   "dampening_frac": dampening_frac}
    tensors = {}
    for i in tqdm(range(config.num_hidden_layers), desc=f"{rounding} {quantization}",
                  unit="layer", disable=not progress):
        for matrix in QUANTIZED_MATRICES:
            name = f"layers.{i}.{matrix}"
            w = bf16_bits_to_f32(fused[name])
            tensors[name] = (
                gptq_quantize(w, hessians[name], quantization, dampening_frac)
                if rounding == "gptq" else quantize(w, quantization))
    return save_checkpoint(src, dst, tensors, rounding, **details)


# %% [markdown]
# The command line (vLLM has none for this; llm-compressor is a library, and its
# names are kept where they exist: `--num-calibration-samples`, `--dampening-frac`):

# %%
#| export cli
import argparse


def _quantize_arguments(parser: argparse.ArgumentParser) -> None:
    from tinyvllm_lib.quantization.checkpoint import ROUNDINGS
    from tinyvllm_lib.quantization.formats import QUANTIZATIONS

    parser.add_argument("src", help="a Hugging Face Llama folder of bf16 weights "
                        "(or smollm2)")
    parser.add_argument("dst", help="the checkpoint's folder (new, or empty)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, required=True)
    parser.add_argument("--rounding", choices=ROUNDINGS, default="gptq",
                        help="gptq (calibrated on chat, on the CPU) or rtn (round to "
                        "nearest, what quantization= does as a folder loads)")
    parser.add_argument("--num-calibration-samples", type=int,
                        help="chat questions GPTQ calibrates on (default: all 38)")
    parser.add_argument("--dampening-frac", type=float, default=0.01,
                        help="GPTQ's damping, a share of XᵀX's mean diagonal")


@command(
    "quantize",
    "write an 8-bit checkpoint of a bf16 folder (GPTQ or round to nearest) that "
    "LLM(folder) loads as it is",
    _quantize_arguments,
)
def quantize_command(args: argparse.Namespace) -> int:
    from tinyvllm_lib.models.smollm2 import resolve_model
    from tinyvllm_lib.quantization.quantizer import quantize_folder

    try:
        dst = quantize_folder(resolve_model(args.src), args.dst, args.quantization,
                              args.rounding, num_calibration_samples=(
                                  args.num_calibration_samples),
                              dampening_frac=args.dampening_frac)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(dst, flush=True)
    return 0

# %% [markdown]
# A round trip at the tests' size: chapter 7's tiny random Llama, quantized to nearest
# by the command, then loaded. The checkpoint's tensors outside the layers and those
# of layer 0, as its header lists them:

# %%
import json
import shutil
import tempfile
from pathlib import Path

from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.models.safetensors_io import SafetensorsFile

work = Path(tempfile.mkdtemp(prefix="ch15_checkpoint_"))  # never inside the book
tiny_bf16 = make_random_llama(work / "bf16", tiny_llama_config(), seed=15)
tiny_int8 = work / "int8"
main(["quantize", str(tiny_bf16), str(tiny_int8), "--quantization", "int8",
      "--rounding", "rtn"])
header = SafetensorsFile(tiny_int8 / "model.safetensors").header
for name, info in sorted(header.items()):
    if name.startswith("model.layers.0.") or not name.startswith("model.layers."):
        print(f"{name:44} {info.dtype:>4} {list(info.shape)}")
stored = json.loads((tiny_int8 / "config.json").read_text())["quantization_config"]
print("quantization_config:", stored)
assert header["model.layers.0.self_attn.q_proj.weight"].dtype == "I8"
assert header["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64,)

# %% [markdown]
# `LLM(folder)` reads the format from the folder. Loading the codes as they are gives
# exactly what rounding the bf16 folder to nearest as it loads gives — the same codes,
# the same scales, so the same log-probabilities to the last bit — and a
# `quantization=` that contradicts the folder is refused:

# %%
tiny_prompt = [3, 14, 15, 92, 65, 35]
tiny_params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1,
                             ignore_eos=True)
tiny_runs = {}
for label, tiny_folder, method in (("the checkpoint", tiny_int8, None),
                                   ("quantized as it loads", tiny_bf16, "int8")):
    llm = LLM(str(tiny_folder), device="cpu", max_num_seqs=1, quantization=method)
    tiny_runs[label] = llm.generate([tiny_prompt], tiny_params, use_tqdm=False)[0]
    print(f"{label:>21}: quantization={llm.llm_engine.engine_config.quantization!r}, "
          f"tokens {tiny_runs[label].outputs[0].token_ids}")
from_file, at_load = (run.outputs[0] for run in tiny_runs.values())
assert from_file.token_ids == at_load.token_ids
assert from_file.logprobs == at_load.logprobs  # bit for bit
try:
    LLM(str(tiny_int8), device="cpu", quantization="fp8")
except ValueError as error:
    print("quantization='fp8':", error)

# %% [markdown]
# On the GPU (here the simulator where there is none) the codes go from the file to
# the device as they are: each `QuantizedLinear` holds the file's bytes, stacked.

# %%
if can_launch():
    from tinyvllm_lib.quantization.checkpoint import load_quantized_model

    gpu_model = load_quantized_model(tiny_int8, "cuda", "int8")
    on_device = gpu_model.weights["layers.1.qkv_proj"].codes.copy_to_host()
    f = SafetensorsFile(tiny_int8 / "model.safetensors")
    in_file = np.concatenate([f.get(f"model.layers.1.self_attn.{p}_proj.weight")
                              for p in "qkv"])
    assert np.array_equal(on_device, in_file)
    print(f"layers.1.qkv_proj on the device: {on_device.dtype} {on_device.shape}, "
          "the file's q, k and v codes stacked")
shutil.rmtree(work)  # the tiny folders are done with

# %% [markdown]
# On SmolLM2, `bench/ch15_checkpoint_cpu.py` runs the command's function for both
# formats, GPTQ (calibrating on its own, as the bench above did) and round-to-nearest,
# loads each folder with `LLM(folder, device="cpu")`, and measures the model the engine
# built exactly as the GPTQ study measured the codes it kept in memory: the same 20
# answers, the same prose (`book/data/ch15_checkpoint.json`). It also times the
# engine's start on each folder, the best of three.

# %%
CKPT_GLUES = [f"ch15_ckpt_{what}_{key}" for key in ("int8", "fp8") for what in
              ("sure", "worst", "dlogp", "ppl", "quantize_s", "start_s", "at_load_s")]
CKPT_GLUES += ["ch15_ckpt_where", "ch15_ckpt_calibration", "ch15_ckpt_mb",
               "ch15_ckpt_bf16_mb", "ch15_ckpt_bf16_start_s", "ch15_ckpt_same",
               "ch15_ckpt_embed_share"]
checkpoint_runs = load_records("ch15_checkpoint")


def cpu(device: dict) -> str:
    """A CPU record's device, as the prose names it."""
    return f"{device.get('cpu', device['name'])} ({device.get('cores', '?')} cores)"


if not checkpoint_runs:
    print("not yet recorded: run python bench/ch15_checkpoint_cpu.py")
    for key in CKPT_GLUES:
        prose.glue(key, "not yet recorded")
else:
    ckpt = {(r["name"], r["quantization"], r["rounding"]): r for r in checkpoint_runs}
    in_memory = {(r["name"], r["quantization"], r["rounding"]): r for r in gptq_runs}
    compared = {"text_perplexity": ("value", "mean_abs_dlogp"),
                "chat_flips": ("value", "largest_flip_margin", "mean_abs_dlogp")}
    same = [r[f] == in_memory[key][f] for key, r in ckpt.items()
            if key in in_memory for f in compared.get(key[0], ())]
    same += [[(f["question"], f["position"]) for f in r["flips"]]
             == [(f["question"], f["position"]) for f in in_memory[key]["flips"]]
             for key, r in ckpt.items() if key[0] == "chat_flips" and key in in_memory]
    print(f"{'':>10} {'flips':>5} {'> 0.5':>5} {'largest':>7} {'|Δ log p|':>9} "
          f"{'prose':>7} {'MB':>5} {'made in':>7} {'starts in':>9}")
    for key in ("int8", "fp8"):
        for how in ("gptq", "rtn"):
            c, t = ckpt["chat_flips", key, how], ckpt["text_perplexity", key, how]
            start = ckpt["start_seconds", key, how]
            sure = sum(f["bf16_margin"] > 0.5 for f in c["flips"])
            print(f"{key + ' ' + how:>10} {c['value']:5.0f} {sure:5} "
                  f"{c['largest_flip_margin']:7.2f} {c['mean_abs_dlogp']:9.4f} "
                  f"{t['ratio_to_bf16'] - 1:+7.2%} {start['folder_bytes'] / 1e6:5.0f} "
                  f"{start['seconds_quantize']:6.0f}s {start['value']:8.2f}s")
            if how == "gptq":
                prose.glue(f"ch15_ckpt_sure_{key}", f"{sure}")
                prose.glue(f"ch15_ckpt_worst_{key}", f"{c['largest_flip_margin']:.2f}")
                prose.glue(f"ch15_ckpt_dlogp_{key}", f"{c['mean_abs_dlogp']:.3f}")
                prose.glue(f"ch15_ckpt_ppl_{key}", f"{t['ratio_to_bf16'] - 1:+.2%}")
                prose.glue(f"ch15_ckpt_quantize_s_{key}",
                           f"{start['seconds_quantize']:.0f} s")
                prose.glue(f"ch15_ckpt_start_s_{key}", f"{start['value']:.2f} s")
        at_load = ckpt["start_seconds", key, "rtn_at_load"]["value"]
        prose.glue(f"ch15_ckpt_at_load_s_{key}", f"{at_load:.2f} s")
    bf16_start = ckpt["start_seconds", None, None]
    prose.glue("ch15_ckpt_bf16_start_s", f"{bf16_start['value']:.2f} s")
    prose.glue("ch15_ckpt_bf16_mb", f"{bf16_start['folder_bytes'] / 1e6:.0f} MB")
    ckpt_bytes = ckpt["start_seconds", "int8", "gptq"]["folder_bytes"]
    prose.glue("ch15_ckpt_mb", f"{ckpt_bytes / 1e6:.0f} MB")
    prose.glue("ch15_ckpt_where", cpu(checkpoint_runs[0]["device"]))
    stored = ckpt["start_seconds", "int8", "gptq"]["quantization_config"]
    prose.glue("ch15_ckpt_calibration", f"{stored['calibration_tokens']:,} tokens of "
               f"{stored['calibration_sequences']} chats")
    memory_where = sorted({cpu(r["device"]) for r in gptq_runs})
    where = (f" (the study ran on {', '.join(memory_where)}, this measurement on "
             f"{cpu(checkpoint_runs[0]['device'])})")
    if not same:
        verdict = "not compared: the GPTQ study above is not recorded"
    elif all(same):
        verdict = (f"every figure is the same to the last digit{where}: the command "
                   f"calibrated on the same {stored['calibration_tokens']:,} tokens, "
                   "GPTQ chose the same codes from them, and the folder gave them back "
                   "bit for bit")
    else:
        verdict = f"{len(same) - sum(same)} of {len(same)} figures differ{where}"
    prose.glue("ch15_ckpt_same", verdict)
    embed_bytes = 2 * smollm2.vocab_size * smollm2.hidden_size  # bf16, as the source
    prose.glue("ch15_ckpt_embed_share", f"{embed_bytes / ckpt_bytes:.0%}")
    print(f"{sum(same)} of {len(same)} figures equal the in-memory study's")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
Through the loader, GPTQ's int8 checkpoint flips {{ch15_ckpt_sure_int8}} top tokens
where bf16's margin exceeds 0.5 (the largest margin it flips:
{{ch15_ckpt_worst_int8}}), with a mean |Δ log p| of {{ch15_ckpt_dlogp_int8}} along the
answers and the prose's perplexity {{ch15_ckpt_ppl_int8}} from bf16's; the FP8 one
flips {{ch15_ckpt_sure_fp8}} (largest {{ch15_ckpt_worst_fp8}}), with
{{ch15_ckpt_dlogp_fp8}} and {{ch15_ckpt_ppl_fp8}}. Against the study above, which
kept GPTQ's codes in memory, {{ch15_ckpt_same}}.

Making each checkpoint took {{ch15_ckpt_quantize_s_int8}} (int8) and
{{ch15_ckpt_quantize_s_fp8}} (FP8) on {{ch15_ckpt_where}}, calibration on
{{ch15_ckpt_calibration}} included. The folder holds {{ch15_ckpt_mb}}, against the
bf16 folder's {{ch15_ckpt_bf16_mb}}; the embedding, which stays bf16, is
{{ch15_ckpt_embed_share}} of it. The engine started on it in
{{ch15_ckpt_start_s_int8}} (int8) and {{ch15_ckpt_start_s_fp8}} (FP8), against
{{ch15_ckpt_at_load_s_int8}} and {{ch15_ckpt_at_load_s_fp8}} rounding the bf16 folder
as it loads, and {{ch15_ckpt_bf16_start_s}} in bf16. The NumPy backend widens the
codes to float32 either way (e4m3's through NumPy's arithmetic, which is why FP8
starts slower than int8), so on the CPU a checkpoint saves the rounding, the
difference between the two starts, and GPTQ's minutes, which no start could pay. On
a GPU the codes go to the device as they are stored, half of bf16's bytes to copy;
that start has not been timed here.
""")

# %% [markdown]
# ## GEMVs that read 8 bits
#
# Now the GPU. At batch 1 (and up to a few tokens) every projection is a GEMV, and
# chapter 6's reads its weights 8 bytes at a time: four bf16 values a word, widened in
# registers. The 8-bit GEMV reads the same 8-byte words, now holding **eight** weights,
# widens each to float32, multiplies by the input and accumulates in float32; the row's
# scale is applied once, to the finished sum, $y_n = s_n \sum_k x_k q_{nk}$.
#
# Half the bytes a weight means twice the weights a byte, so for the same bandwidth the
# kernel must widen and multiply twice as many values each nanosecond as the bf16 one
# does. A bf16 value widens with one shift; the obvious 8-bit widenings take more. The
# first version of this kernel, measured on the H200 before the one below (its records
# are drawn at the end of the chapter), widened a code at a time: an int8 code through
# the GPU's integer-to-float conversion (`I2F`: CUDA's programming guide lists 16
# type conversions a clock per SM on Hopper, against 128 float32 adds), an e4m3 code
# by moving its bits, multiplying by $2^{120}$ and testing it for NaN. Its norm-fused
# variant does the same loads and twice the arithmetic per code; how fast it ran
# against the plain one says what bound the kernel:

# %%
first_gemvs = {(r["name"], r["quantization"], r["layer"]): r
               for r in load_records("ch15_quantization")
               if r.get("gemv_8bit_version", 1) == 1 and r.get("part") == "gemv"}
norm_speed = [first_gemvs["gemv", m, layer]["us"] / r["us"]
              for (name, m, layer), r in first_gemvs.items() if name == "gemv_rmsnorm"]
if norm_speed:
    print(f"the first 8-bit GEMV with the norm fused in: {min(norm_speed):.0%} to "
          f"{max(norm_speed):.0%} of the plain one's speed, over "
          f"{len({k[2] for k in first_gemvs})} shapes and both formats")
    prose.glue("ch15_v1_norm_range", f"{min(norm_speed):.0%} to {max(norm_speed):.0%}")
    prose.glue("ch15_v1_bound", (
        "the instructions it issued, not the bytes it read, set its time"
        if max(norm_speed) < 0.8 else
        "the extra arithmetic cost little, so the bytes, not the instructions, set "
        "its time"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if norm_speed:
    prose.show("""
It ran at {{ch15_v1_norm_range}} of the plain one's speed: {{ch15_v1_bound}}. So the
kernel below spends as few instructions a code as it can.
""")

# %% [markdown]
#
# **int8, with no conversion.** A float32 whose exponent field says $2^{23}$ has a
# mantissa step of exactly 1, so the 32 bits `0x4B000000 | b` *are* the float
# $2^{23} + b$ for any byte $b$. Flip the code's sign bit (one XOR for eight codes) and
# its byte is $b = q + 128$; one subtraction of $2^{23} + 128$ leaves $q$, exactly. No
# conversion, only bits and a subtraction.
#
# **e4m3, in units of $2^{-120}$.** Its layout is bf16's with a shorter exponent: move
# its sign to bit 31 and its 4 exponent and 3 mantissa bits to bits 26 to 20, and the
# 32 bits are a float32 — with the wrong bias: float32's exponent counts from 127,
# e4m3's from 7, so the float is the code's value times $2^{-120}$. Rather than
# multiply each code by $2^{120}$, a kernel can leave the factor in the sum and apply
# it with the row's scale: $y_n = (2^{120} s_n) \sum_k x_k (2^{-120} q_{nk})$.
# Every code survives the move: e4m3's values in these units lie between $2^{-129}$
# (its smallest subnormal, now a float32 subnormal, held exactly) and
# $448 \cdot 2^{-120}$. NaN, S.1111.111, is found once a word: adding 1 to each byte's
# low 7 bits carries into bit 7 only where all seven are ones.
#
# Both, on every code, in NumPy:

# %%
all_int8 = np.arange(-128, 128).astype(np.int8)
byte = all_int8.view(np.uint8) ^ np.uint8(0x80)  # q + 128
as_float = (byte.astype(np.uint32) | np.uint32(0x4B000000)).view(np.float32)
assert np.array_equal(as_float - np.float32(2**23 + 128), all_int8.astype(np.float32))
print("int8: 2^23 + (q + 128), less 2^23 + 128, is q for all 256 codes")

codes32 = all_fp8.astype(np.uint32)
in_units = (((codes32 & 0x80) << 24) | ((codes32 & 0x7F) << 20)).view(np.float32)
assert np.array_equal(in_units[is_number].astype(np.float64) * 2.0**120,
                      fp8_values[is_number])
smallest = in_units[1]  # code 0x01: e4m3's smallest subnormal
print(f"e4m3: the bits moved are the value times 2^-120 for all {is_number.sum()} "
      f"non-NaN codes; the smallest, {smallest:.3e} = 2^{np.log2(smallest):.0f}, "
      f"is a float32 subnormal")
low7 = codes32 & 0x7F
assert np.array_equal((low7 + 1) & 0x80 != 0, ~is_number)
print("NaN: (low 7 bits + 1) reaches bit 7 exactly for the", (~is_number).sum(),
      "NaN codes")

# %% [markdown]
# The second version of the GEMV widened that way: a byte extract, an OR and a
# subtraction an int8 code; two shifts, two masks and an OR an e4m3 code. The kernel
# that dequantizes weights for the GEMM path below still widens a code at a time (the
# same bits, with the multiply and the NaN test), since its time is a small part of a
# prefill. Its records (labeled 2 at the end of the chapter) say how far that got:

# %%
second_gemvs = {(r["name"], r["quantization"], r["layer"]): r
                for r in load_records("ch15_quantization")
                if r.get("gemv_8bit_version") == 2 and r.get("part") == "gemv"
                and r["quantization"]}
if second_gemvs:
    plain_ratio = [r["ratio"] for (name, _, _), r in second_gemvs.items()
                   if name == "gemv"]
    layers2 = list(dict.fromkeys(k[2] for k in second_gemvs))
    prose.glue("ch15_v2_shapes", ", ".join(f"`{x}`" for x in layers2[:-1])
               + f" and `{layers2[-1]}`")
    norm_speed2 = [second_gemvs["gemv", m, layer]["us"] / r["us"]
                   for (name, m, layer), r in second_gemvs.items()
                   if name == "gemv_rmsnorm"]
    print(f"second version: the plain 8-bit GEMV at {min(plain_ratio):.0%} to "
          f"{max(plain_ratio):.0%} of the bandwidth ceiling; with the norm fused in, "
          f"{min(norm_speed2):.0%} to {max(norm_speed2):.0%} of the plain one's speed")
    prose.glue("ch15_v2_plain_range",
               f"{min(plain_ratio):.0%} to {max(plain_ratio):.0%}")
    prose.glue("ch15_v2_norm_range",
               f"{min(norm_speed2):.0%} to {max(norm_speed2):.0%}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if second_gemvs:
    prose.show("""
The plain GEMV read its codes at {{ch15_v2_plain_range}} of the bandwidth ceiling over
every decode shape recorded ({{ch15_v2_shapes}}), and
the norm-fused one still ran at {{ch15_v2_norm_range}} of the plain one's speed.
""")

# %% [markdown]
# Two things kept it from the bytes. The first is what it issued. The benchmark script
# `bench/ch15_sass.py` needs no GPU: it compiles a kernel for sm_90 as a launch would,
# has `ptxas` assemble it and `nvdisasm` print the machine code (SASS), finds the
# innermost loop that holds the multiply-adds, and counts its instructions a word of 8
# codes, for the one-token kernels of a warp a row:

# %%
sass_records = load_records("ch15_sass")
sass_versions = sorted({r["gemv_8bit_version"] for r in sass_records})
CLASS_COLORS = {"multiply-add": "#2ca02c", "shift, logic, byte": "#d62728",
                "conversion": "#9467bd", "load": "#8c564b", "other": "#c7c7c7"}
if sass_records:
    shown = [v for v in (2, sass_versions[-1]) if v in sass_versions]
    bars = [(v, m, fused) for v in shown for m in ("int8", "fp8")
            for fused in (False, True)]
    counted = {(r["gemv_8bit_version"], r["method"], r["rms_norm"]): r
               for r in sass_records}
    fig, ax = new_figure(1, 1, width=8.0, height=3.0)
    for cls, color in CLASS_COLORS.items():
        below = [sum(counted[b]["classes"][c] for c in list(CLASS_COLORS)[
            :list(CLASS_COLORS).index(cls)]) for b in bars]
        ax.bar(range(len(bars)), [counted[b]["classes"][cls] for b in bars],
               bottom=below, color=color, label=cls)
    ax.set_xticks(range(len(bars)), [f"v{v} {m}\n{'norm-fused' if f else 'plain'}"
                                     for v, m, f in bars], fontsize=7)
    ax.set_ylabel("instructions a word of 8 codes")
    ax.legend(fontsize=7, ncol=3)
    plt.show()
    v2_int8, v2_fp8 = counted.get((2, "int8", False)), counted.get((2, "fp8", False))
    newest = sass_versions[-1]
    if v2_int8:
        prose.glue("ch15_sass_v2_int8", f"{v2_int8['value']:.0f}")
        prose.glue("ch15_sass_v2_logic",
                   f"{v2_int8['classes']['shift, logic, byte']:.0f}")
        prose.glue("ch15_sass_v2_arith", f"{v2_int8['classes']['multiply-add']:.0f}")
        prose.glue("ch15_sass_v2_fused",
                   f"{counted[2, 'int8', True]['value']:.0f}")
        prose.glue("ch15_sass_v2_fp8", f"{v2_fp8['value']:.0f}")
    prose.glue("ch15_sass_new", f"{counted[newest, 'int8', False]['value']:.0f} "
               f"(int8) and {counted[newest, 'fp8', False]['value']:.0f} (e4m3)")
    for (v, m, fused), r in sorted(counted.items()):
        print(f"version {v} {m:>4} {'norm-fused' if fused else 'plain':>10}: "
              f"{r['value']:5.1f} instructions a word of codes")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if sass_records:
    prose.show("""
The second version's int8 loop issued {{ch15_sass_v2_int8}} instructions for each word
of 8 codes — {{ch15_sass_v2_logic}} of them shifts, logic and integer bookkeeping —
against the {{ch15_sass_v2_arith}} that do the arithmetic (8 multiply-adds, 8
subtractions, one add of the word's sum); e4m3 took {{ch15_sass_v2_fp8}}, and the
norm-fused int8 loop {{ch15_sass_v2_fused}}. The version below issues
{{ch15_sass_new}}, the norm fused in or not.
""")

# %% [markdown]
# The second is the input: with a warp a row, each warp widened the bf16 input from
# scratch for every row it computed — a shift or a mask a value, as many as the codes
# cost — and the norm-fused variant read the float32 residual, squared it and
# multiplied it by the norm's weight, again for every row. So the third version changes
# three things, and the fourth a fourth:
#
# - **int8: one instruction a code.** The GPU builds a word from any four bytes of two
#   words in one instruction, `prmt` (CUDA C's `__byte_perm`, libdevice's
#   `byte_perm`). With the code's word as
#   one operand and `0x4B000000` as the other, the selector `0x765b` puts code byte
#   $b$ under the bits of $2^{23}$: the float $2^{23} + (q + 128)$ in one
#   instruction, then the subtraction.
# - **e4m3: the hardware's conversion.** Hopper, like Ada before it, converts two
#   e4m3 codes to two float16 in one instruction (PTX `cvt.rn.f16x2.e4m3x2`), and a
#   float16 widens to float32 in one more. Both are exact — every e4m3 value is a
#   float16 value — and a NaN code comes out NaN, so neither the $2^{120}$ nor the NaN
#   test is needed.
# - **The input, once a block.** Before the dot products, the block's 256 threads
#   write the input rows into shared memory as float32, once; every warp then reads
#   them there, 8 values in 4 loads, with no widening. The norm-fused variant stages
#   the residual times the norm's weight and sums its squares while staging; the
#   $1/\mathrm{rms}$ is applied to each finished sum, as before. 32 KiB of shared
#   memory holds 8,192 values: one token of every projection's input, or shorter
#   pieces of several tokens' rows, staged a piece at a time.
# - **No more blocks than the GPU holds** (the fourth version). Staging costs a block
#   a read of the input and a wait for all its threads before any dot product; with a
#   block for every 8 rows, the LM head's 16,000 blocks paid it 16,000 times, and the
#   norm-fused one read the float32 residual and the norm's weight each time. Now the
#   launch makes no more blocks than the SMs hold at once (what 32 KiB of shared
#   memory and the kernel's registers let one SM hold: 4 for version 4's knobs), and
#   each takes groups of rows in turn,
#   staging its input once where it fits one piece (and loading the next group's
#   first words while the last group's sums meet).
#
# numba reaches `prmt` through libdevice (`cuda.libdevice.byte_perm`), but not the
# FP8 conversion. That one comes the way chapter 14's `mma.sync` came: tiny CUDA C
# device functions, compiled by NVRTC and inlined at link time. Each helper has a
# NumPy twin that the simulator calls in its place.

# %%
#| export kernels.widen_8bit
import math

import numpy as np
from numba import config, cuda, float32, int32, types, uint32, uint64

from tinyvllm_lib.kernels.bf16 import bf16_to_f32, device_function

FP8_BIAS_FIX = float32(2.0**120)  # bf16's exponent bias (127) less e4m3's (7)
# int8: a byte b (the code's bits, sign bit flipped: code + 128) in a float's low
# mantissa bits; 2^23 + b is that float, exactly
MAGIC_BITS, MAGIC_OFFSET = uint32(0x4B000000), float32(2.0**23 + 128)
HIGH1 = uint64(0x8080808080808080)  # every byte's top bit (the int8 sign flip)
CODE_DTYPES = {"int8": np.int8, "fp8": np.uint8}

WIDEN_SOURCE = r"""
// the low 16 bits: two e4m3 codes -> two float16 (the higher code in the high half)
extern "C" __device__ unsigned e4m3x2_to_f16x2(unsigned pair) {
  unsigned short codes = (unsigned short)pair;
  unsigned halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(codes));
  return halves;
}
extern "C" __device__ float f16x2_low(unsigned halves) {
  float f;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo;}"
      : "=f"(f) : "r"(halves));
  return f;
}
extern "C" __device__ float f16x2_high(unsigned halves) {
  float f;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, hi;}"
      : "=f"(f) : "r"(halves));
  return f;
}
"""

if config.ENABLE_CUDASIM:

    def bits_to_f32(bits):
        """The float32 whose bits these are (simulator: NumPy reinterprets them)."""
        return np.uint32(bits).view(np.float32)

    def byte_perm(a, b, selector):
        """Twin of libdevice's byte_perm: byte i of the result is byte
        (selector >> 4i) & 7 of the eight bytes b:a (a's first); a nibble's bit 3
        copies that byte's sign bit into all eight bits instead."""
        pool = np.array([a, b], np.uint32).view(np.uint8)
        out = np.zeros(4, np.uint8)
        for i in range(4):
            nibble = (int(selector) >> (4 * i)) & 0xF
            chosen = pool[nibble & 7]
            out[i] = (0xFF if chosen & 0x80 else 0) if nibble & 8 else chosen
        return out.view(np.uint32)[0]

    def _e4m3_table() -> np.ndarray:
        """float16 bits of every e4m3 code (its NaNs as float16 NaN)."""
        codes = np.arange(256)
        exponent, mantissa = (codes >> 3) & 0xF, codes & 7
        value = np.where(exponent == 0, mantissa / 8 * 2.0**-6,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
        value = np.where(codes & 0x80, -value, value)
        value[(codes & 0x7F) == 0x7F] = np.nan
        return value.astype(np.float16).view(np.uint16)

    _E4M3_TO_F16 = _e4m3_table()

    def e4m3x2_to_f16x2(pair):
        """Twin of the C function (a table of all 256 codes)."""
        pair = int(pair)
        return np.uint32(int(_E4M3_TO_F16[pair & 0xFF])
                         | (int(_E4M3_TO_F16[(pair >> 8) & 0xFF]) << 16))

    def f16x2_low(halves):
        """Twin: the low float16 of the word, as float32."""
        return np.float32(np.uint16(int(halves) & 0xFFFF).view(np.float16))

    def f16x2_high(halves):
        """Twin: the high float16 of the word, as float32."""
        return np.float32(np.uint16(int(halves) >> 16).view(np.float16))

else:
    from numba.cuda import CUSource

    @cuda.jit(device=True)
    def bits_to_f32(bits):
        """The float32 whose bits these are: a reinterpretation, no instruction."""
        return cuda.libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True)
    def byte_perm(a, b, selector):
        """A word made of four of the eight bytes of b:a, chosen by the selector's
        nibbles: one PRMT (libdevice's __nv_byte_perm)."""
        return uint32(cuda.libdevice.byte_perm(int32(a), int32(b), int32(selector)))

    _WIDEN_C = CUSource(WIDEN_SOURCE)
    e4m3x2_to_f16x2 = cuda.declare_device(
        "e4m3x2_to_f16x2", types.uint32(types.uint32), link=_WIDEN_C, abi="c")
    f16x2_low = cuda.declare_device(
        "f16x2_low", types.float32(types.uint32), link=_WIDEN_C, abi="c")
    f16x2_high = cuda.declare_device(
        "f16x2_high", types.float32(types.uint32), link=_WIDEN_C, abi="c")


@device_function
def int8_to_f32(code):
    """One int8 code (its byte, in a uint32) as float32."""
    return float32(int32(code ^ uint32(0x80)) - int32(128))


@device_function
def fp8_to_f32(code):
    """One e4m3 code (its byte, in a uint32) as float32: its bits moved into bf16's
    places, widened, then the bias fixed; S.1111.111 is NaN.
    """
    magnitude = code & uint32(0x7F)
    if magnitude == uint32(0x7F):
        return float32(math.nan)
    bits = ((code & uint32(0x80)) << uint32(8)) | (magnitude << uint32(4))
    return bf16_to_f32(bits) * FP8_BIAS_FIX


@device_function
def widen_int8_word(word, wf, base):
    """wf[base : base + 8] = the word's 8 int8 codes as float32: each byte (sign bit
    flipped) placed under 2^23's bits by one byte permute, then one subtraction.
    """
    flipped = word ^ HIGH1  # code + 128, each byte
    for half in range(2):
        h = uint32((flipped >> uint64(32 * half)) & uint64(0xFFFFFFFF))
        for b in range(4):  # result bytes: h's byte b, then MAGIC_BITS' bytes 1..3
            bits = byte_perm(h, MAGIC_BITS, uint32(0x7650 + b))
            wf[base + 4 * half + b] = bits_to_f32(bits) - MAGIC_OFFSET


@device_function
def widen_fp8_word(word, wf, base):
    """wf[base : base + 8] = the word's 8 e4m3 codes as float32: two codes to two
    float16 at a time (the hardware's conversion), each widened; NaN stays NaN.
    """
    for pair in range(4):
        halves = e4m3x2_to_f16x2(uint32((word >> uint64(16 * pair)) & uint64(0xFFFF)))
        wf[base + 2 * pair] = f16x2_low(halves)
        wf[base + 2 * pair + 1] = f16x2_high(halves)


WIDEN = {"int8": int8_to_f32, "fp8": fp8_to_f32}  # a code at a time (dequantizing)
WIDEN_WORD = {"int8": widen_int8_word, "fp8": widen_fp8_word}  # 8 at a time (GEMV)

# %% [markdown]
# The rest is chapter 6's GEMV with its two shapes: for many rows (16,384 and more)
# and one or two tokens, a warp a row, its 32 lanes striding along it, each loading
# `unroll` words before widening any; for fewer rows, the block's 8 warps share 4 rows,
# so each thread widens one word of each row, and the warps' sums meet in shared
# memory. The knobs are the ones chapter 11 tuned for bf16 on the H200: a word is 8
# bytes in both, so they keep as many bytes in flight — except at one token on the
# block variant, where a sweep on an H100 (version 6, at the end of the chapter) chose
# 8 rows a block: a row of codes is half as many words as a bf16 row. Like the bf16
# one it loads its first words, which no kernel writes, before it waits for the
# kernel before it — and before it stages the input, which that kernel writes — and it
# keeps the two fusions chapter 11 measured, the **residual add** (`out += `, the
# projection's epilogue) and the **RMSNorm** of its input; a third, SiLU·up in the
# gate-up GEMV, follows the checks below.
#
# The staged rows are laid out so that a warp's 32 lanes, reading 32 neighbouring
# words of codes, read 32 neighbouring 8-byte pairs of floats: for token $m$ and code
# word $w$ of the piece, the pair $h$ (values $8w + 2h$ and $8w + 2h + 1$) sits at
# `(4m + h) * chunk + w`, so no two lanes of a load hit the same shared-memory bank.
#
# Version 7 works on the stretch after the kernel before has finished: the weights'
# first words were loaded before that, but the input and the residual could not be.
#
# - **The input's loads, issued together.** Each thread staged one word of codes'
#   worth of input at a time — load, widen, store, then the next — so down's 8,192
#   inputs at one token (4 words a thread) made four round trips to L2 in a row. Now
#   each thread loads `STAGE_AHEAD` words' worth before it widens any, so the loads
#   are in flight together. (At 2,048 inputs a thread stages one word either way; the
#   norm-fused variant, QKV's and gate-up's, stages as before.)
# - **The residual, read early.** The add epilogue read the `out` it adds to after the
#   sums had met; now the thread that will store a sum issues that read as the block
#   starts its group, before the dot products rather than after them.
# - **Blocks an SM holds, counted.** The launcher gave each kernel as many blocks as
#   an estimate from its knobs said an SM holds; now, once a kernel is compiled, it
#   counts them from the registers the compiler gave it (`compiled_blocks_per_sm`:
#   64K registers an SM, handed out a warp at a time in 256s, 32 KiB of stage a block,
#   and 2,048 threads). The estimate stays for the first launch; which block takes a
#   group of rows changes no sum, so no bit.

# Version 8 tries the stretch *before* it. In a captured step (chapter 11) a kernel
# may start before the one before it has finished, and it waits at
# `griddepcontrol.wait` until that one has. The step profile at the end of the chapter
# measures how long: a GEMV starts several microseconds before the kernel before it
# ends. Until now a thread loaded its first words in that time, and then waited. But
# no kernel writes the weights, so the whole of a block's rows could be on their way
# by then.
#
# Registers cannot hold them; L2 can (tens of MB). Hopper's Tensor Memory Accelerator
# (TMA), the unit behind its bulk copies, takes one instruction,
# `cp.async.bulk.prefetch.L2`, to start fetching a range of bytes into L2, with
# nothing to wait for and no register written. So, before it waits, each block asks
# for the rows of its first groups, one range a group (two in the gated GEMV: its gate
# rows and its up rows), up to `PREFETCH_L2_BYTES` across the grid, so that a kernel
# as large as the LM head does not evict its own first rows.
# After the wait the same loads as before find the rows in L2.
#
# What it should buy is the memory's idle time. Attention and the KV-cache write read
# little, so while they run HBM is nearly idle, and O's codes can arrive before
# attention ends; gate-up starts while O runs, which reads little more. During down,
# which streams its own rows, QKV's prefetch only moves its rows earlier in the same
# stream. The prediction, written before any run from the H200's version-7 profile, is
# a cell at the end of the chapter (`PREFETCH_PREDICTED_US`), beside what the GPU
# measured and what that says. The engine's kernels compile without the prefetch
# (`PREFETCH_L2_BYTES` = 0, from that measurement); the bench's `--prefetch-l2-mib`
# turns it on.

# %%
#| export kernels.prefetch
from numba import config, types

# the bytes a kernel's blocks prefetch before they wait, across its grid. Off: on an
# H100 the step took longer with 24 MiB (half of the L2, so that the LM head's first
# rows are not evicted by its later ones), measured at the end of the chapter
PREFETCH_L2_BYTES = 0

if config.ENABLE_CUDASIM:

    def prefetch_rows_l2(array, row, rows):
        """The simulator has no L2: nothing to fetch."""

else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from tinyvllm_lib.kernels.dependent_launch import dependent_launch_supported

    @intrinsic
    def prefetch_rows_l2(typingctx, array, row, rows):
        """`cp.async.bulk.prefetch.L2.global`: start fetching rows row .. row + rows
        of a C-contiguous 2-D array into L2, and go on. Nothing is waited for and no
        register is written; a range not 16-byte aligned, or an old GPU, fetches
        nothing (the instruction is Hopper's).
        """
        if not (isinstance(array, types.Array) and array.ndim == 2
                and array.layout == "C" and isinstance(row, types.Integer)
                and isinstance(rows, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            if not dependent_launch_supported():
                return context.get_dummy_value()
            aryty, rowty, rowsty = signature.args
            ary = context.make_array(aryty)(context, builder, value=args[0])
            first = context.cast(builder, args[1], rowty, types.intp)
            count = context.cast(builder, args[2], rowsty, types.intp)
            zero = context.get_constant(types.intp, 0)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [first, zero])
            stride = cgutils.unpack_tuple(builder, ary.strides)[0]
            nbytes = builder.mul(count, stride)
            i64 = ir.IntType(64)
            address = builder.ptrtoint(ptr, i64)
            aligned = builder.icmp_unsigned(
                "==", builder.and_(builder.or_(address, nbytes), i64(15)), i64(0))
            positive = builder.icmp_signed(">", nbytes, i64(0))
            with builder.if_then(builder.and_(aligned, positive)):
                fetch = ir.InlineAsm(
                    ir.FunctionType(ir.VoidType(), [i64, ir.IntType(32)]),
                    "cp.async.bulk.prefetch.L2.global [$0], $1;",
                    "l,r",
                    side_effect=True,
                )
                builder.call(fetch, [address, builder.trunc(nbytes, ir.IntType(32))])
            return context.get_dummy_value()

        return types.void(array, row, rows), codegen

# %%
#| export kernels.gemv_8bit_kernel
import math

from numba import cuda, float32, uint64

from tinyvllm_lib.kernels.activation_store import (
    pack_f32_pair,
    store_activation,
    unpack_f32_pair,
)
from tinyvllm_lib.kernels.bf16 import device_function
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.gemv import (
    GEMV_THREADS,
    GEMV_WARPS,
    INLINE,
    bf16x4_to_f32,
    warp_sum_all,
)
from tinyvllm_lib.kernels.prefetch import PREFETCH_L2_BYTES, prefetch_rows_l2
from tinyvllm_lib.kernels.tensor_core import require_lto
from tinyvllm_lib.kernels.widen_8bit import WIDEN_WORD

# the staged input: 4096 uint64 words (8192 float32, 32 KiB) a block
STAGE_WORDS = 4096
# words of codes' worth of bf16 input a thread loads before it stages any (at one
# token a block stages down's 8,192 inputs with its loads issued together, where one
# word at a time made four round trips in a row)
STAGE_AHEAD = 4
# 1: a warp a row, a code at a time (int8 through an integer-to-float conversion,
# e4m3 multiplied by 2^120 and tested for NaN); 2: 8 codes a word by moving bits, the
# input widened by every warp; 3: one byte permute an int8 code, the hardware's
# conversion for e4m3, the input staged in shared memory by each block of a group of
# rows; 4: 3 with no more blocks than the GPU holds, each staging its input
# once for the groups it takes in turn (the bench records which kernel it timed);
# 5: 4 with the gated epilogue (below) in the engine's MLP (GATED_GEMV_8BIT); 6: 5
# with one token's block knobs from a sweep (ONE_TOKEN_BLOCK_KNOBS, with the blocks an
# SM holds of them), and the norm inside the GEMV whatever its rows (gate-up's, with
# GATED_GEMV_8BIT off); 7: 6 with the input's loads issued STAGE_AHEAD words at a time
# before any is staged, the residual the add epilogue adds to read before the sums are
# made, and the blocks an SM holds counted from the compiled kernel's registers; 8: 7
# with each block's first groups of rows prefetched into L2 before it waits
# (prefetch_rows_l2, up to PREFETCH_L2_BYTES a grid: 0 in the engine, which measured
# slower with it; records say prefetch_l2_mib)
GEMV_8BIT_VERSION = 8


def make_gemv_8bit_kernel(method: str, num_tokens: int, warps_per_row: int,
                          rows: int, unroll: int, accumulate: bool = False,
                          rms_norm: bool = False, gated: bool = False,
                          stage_ahead: int = STAGE_AHEAD,
                          prefetch_bytes: int = PREFETCH_L2_BYTES):
    """An 8-bit GEMV, num_tokens token vectors a pass: out (M, N) = x (M, K) ·
    (s ⊙ codes)ᵀ, codes viewed as uint64 (8 a word), x as uint64 (bf16, 4 a word).
    The block stages its tokens' input in shared memory as float32, a piece of K at a
    time; a group of warps_per_row warps (one, or the block's eight) shares `rows`
    rows, each thread loading unroll words of each before widening any.
    stage_ahead: words of codes' worth of bf16 input a thread loads before it stages
    any. prefetch_bytes: how much of w the grid's blocks ask L2 for before they wait
    (their first groups' rows; 0: none).
    accumulate: out += ...; rms_norm: x is the float32 residual (2 a word) and
    out = RMSNorm(x) · (s ⊙ codes)ᵀ, with the norm's bf16 weight `norm64`.
    gated: w stacks [gate | up] (N = 2 I rows) and out (M, I) bf16 bits =
    SiLU(x · gateᵀ) * (x · upᵀ), chapter 7's silu_mul done where the two products are
    made; half of a group's rows are gate rows, the other half the up rows I below.
    """
    assert warps_per_row in (1, GEMV_WARPS), "a row: one warp or the whole block"
    assert not (gated and (rows % 2 or accumulate)), "gated: rows in pairs, no add"
    widen_word = WIDEN_WORD[method]
    threads_per_row = 32 * warps_per_row
    units = rows // 2 if gated else rows  # rows of out a group writes
    rows_per_block = GEMV_WARPS // warps_per_row * units  # of out
    acc_size = rows * num_tokens  # acc[r * num_tokens + m]: row n0 + r, token m0 + m
    partial_size = max(acc_size, num_tokens)  # the warps' sums, or squares
    chunk = STAGE_WORDS // (4 * num_tokens)  # code words of K staged at a time
    step = threads_per_row * unroll
    words_size, wf_size = rows * unroll, 8 * rows  # local arrays' sizes: constants
    split_tail = acc_size <= 8  # 4 rows x 8 tokens: one loop, fewer registers
    stage_loads = 2 * stage_ahead  # words of x a thread loads before staging them

    @device_function(**INLINE)
    def weight_row(n0, r, N):
        # the row of w (N rows) that the group's row r reads, and whether it exists;
        # gated: rows r < units are gate rows n0 + r, the others their up rows N/2 on
        if gated:
            n = n0 + uint64(r % units)
            return n + uint64(r // units) * (N // uint64(2)), n < N // uint64(2)
        return n0 + uint64(r), n0 + uint64(r) < N

    @device_function(**INLINE)
    def load_words(w64, words, n0, j, end, N, whole):
        # whole: all `unroll` words of the pass lie before `end` (one test, not unroll)
        for u in range(unroll):
            jj = j + uint64(u * threads_per_row)
            for r in range(rows):
                n, exists = weight_row(n0, r, N)
                words[u * rows + r] = (w64[n, jj] if (whole or jj < end) and exists
                                       else uint64(0))

    @device_function(**INLINE)
    def dot_word(words, u, column, staged, wf, xf, acc):
        # acc += the rows' word u of codes times the staged inputs of `column`
        for r in range(rows):
            widen_word(words[u * rows + r], wf, 8 * r)
        for m in range(num_tokens):  # rows past M: staged zeros, never stored
            for h in range(4):
                xf[2 * h], xf[2 * h + 1] = unpack_f32_pair(
                    staged[uint64((4 * m + h) * chunk) + column])
            for r in range(rows):  # one x, `rows` rows
                total = float32(0)
                for i in range(8):
                    total += xf[i] * wf[8 * r + i]
                acc[r * num_tokens + m] += total

    @cuda.jit(device=True, **INLINE)
    def stage(x64, norm64, staged, m0, M, c0, width, squares):
        # code words c0 .. c0 + width of each token row: float32 pairs into `staged`
        for m in range(num_tokens):
            row = m0 + uint64(m)
            w = uint64(cuda.threadIdx.x)
            while w < width:
                at, col = uint64(4 * m * chunk) + w, c0 + w
                if row >= M:  # a bucket's rows past M: zeros (their sums not stored)
                    for h in range(4):
                        staged[at + uint64(h * chunk)] = uint64(0)
                elif rms_norm:  # float32 pairs times the norm's weight; squares summed
                    for q in range(2):
                        two, four = uint64(2) * col + uint64(q), uint64(4) * col
                        g0, g1, g2, g3 = bf16x4_to_f32(norm64[two])
                        a, b = unpack_f32_pair(x64[row, four + uint64(2 * q)])
                        c, d = unpack_f32_pair(x64[row, four + uint64(2 * q + 1)])
                        squares[m] += a * a + b * b + c * c + d * d
                        first = at + uint64(2 * q * chunk)
                        staged[first] = pack_f32_pair(a * g0, b * g1)
                        staged[first + uint64(chunk)] = pack_f32_pair(c * g2, d * g3)
                else:  # bf16, 4 a word: two words of x a word of codes, the loads
                    # of STAGE_AHEAD words of codes' worth issued before any is used
                    ahead = cuda.local.array(stage_loads, uint64)
                    for a in range(stage_loads):
                        wa = w + uint64(a // 2 * GEMV_THREADS)
                        ahead[a] = (x64[row, uint64(2) * (c0 + wa) + uint64(a % 2)]
                                    if wa < width else uint64(0))
                    for a in range(stage_loads):
                        v0, v1, v2, v3 = bf16x4_to_f32(ahead[a])
                        first = (at + uint64(a // 2 * GEMV_THREADS)
                                 + uint64(a % 2 * 2 * chunk))
                        if w + uint64(a // 2 * GEMV_THREADS) < width:
                            staged[first] = pack_f32_pair(v0, v1)
                            staged[first + uint64(chunk)] = pack_f32_pair(v2, v3)
                    w += uint64((stage_ahead - 1) * GEMV_THREADS)
                w += uint64(GEMV_THREADS)

    @cuda.jit(device=True, **INLINE)
    def prefetch_groups(w64, g, stride, num_groups, out_rows):
        # thread q asks L2 for the rows of the block's q-th group (gated: threads 2q
        # and 2q + 1, its gate rows and its up rows), while the grid's share of
        # prefetch_bytes lasts
        parts = 2 if gated else 1
        q, part = uint64(cuda.threadIdx.x // parts), uint64(cuda.threadIdx.x % parts)
        pg = g + q * stride
        group_bytes = uint64(parts * rows_per_block * 8) * uint64(w64.shape[1])
        budget = uint64(prefetch_bytes) // stride
        if pg < num_groups and (q + uint64(1)) * group_bytes <= budget:
            first = pg * uint64(rows_per_block)
            count = min(uint64(rows_per_block), out_rows - first)
            prefetch_rows_l2(w64, first + part * out_rows, count)

    @cuda.jit(device=True, **INLINE)
    def store(out, scales, m, n, total, scale, prior):
        # prior: what out[m, n] held (accumulate), read before the sums were made
        y = total * scales[n] * scale  # the row's scale (and 1 / rms), once a sum
        out[m, n] = prior + y if accumulate else y

    @cuda.jit(device=True, **INLINE)
    def store_gated(out, scales, m, n, half, gate_total, up_total, scale):
        # SiLU(gate) · up in bf16, from the two products as chapter 7's silu_mul
        # computes it from them
        g = gate_total * scales[n] * scale
        up = up_total * scales[n + half] * scale
        store_activation(out, m, n, g / (float32(1.0) + math.exp(-g)) * up)

    @cuda.jit(device=True, **INLINE)
    def gemv_body(x64, w64, scales, out, norm64, eps):
        staged = cuda.shared.array(STAGE_WORDS, uint64)
        partial = cuda.shared.array((GEMV_WARPS, partial_size), float32)
        inv_rms = cuda.shared.array(num_tokens, float32)  # rms_norm: each token's
        tid = cuda.threadIdx.x
        group, t = tid // threads_per_row, uint64(tid % threads_per_row)
        lane, warp = tid % 32, tid // 32
        M, N, num_words = (uint64(x64.shape[0]), uint64(w64.shape[0]),
                           uint64(w64.shape[1]))
        out_rows = N // uint64(2) if gated else N
        k = float32(8) * float32(num_words)  # values a row
        acc = cuda.local.array(acc_size, float32)
        squares = cuda.local.array(num_tokens, float32)  # rms_norm: this thread's
        words = cuda.local.array(words_size, uint64)
        wf = cuda.local.array(wf_size, float32)  # a word of each row's codes, widened
        xf = cuda.local.array(8, float32)  # the 8 inputs they multiply
        # the block takes groups of rows_per_block rows in turn; where its input fits
        # in one piece and one pass, it stages it once, for all of them
        first_end = num_words if num_words < uint64(chunk) else uint64(chunk)
        once = num_words <= uint64(chunk) and M <= uint64(num_tokens)
        g, stride = uint64(cuda.blockIdx.x), uint64(cuda.gridDim.x)
        num_groups = (out_rows + uint64(rows_per_block - 1)) // uint64(rows_per_block)
        n0 = g * uint64(rows_per_block) + uint64(group * units)  # its first row
        # no kernel writes the weights: the first words are loaded before waiting
        # for the kernel before this one (chapter 11's programmatic edges), and the
        # first groups' rows are asked of L2
        load_words(w64, words, n0, t, first_end, N, False)
        if prefetch_bytes:
            prefetch_groups(w64, g, stride, num_groups, out_rows)
        loaded, fresh = True, True
        wait_for_previous_kernel()
        while g < num_groups:
            m0 = uint64(0)
            while m0 < M:  # a pass per num_tokens token vectors
                stage_now = fresh or not once
                ups = units * num_tokens  # gated: where the up rows' sums begin
                # the block shares its rows: thread i < ups stores sum i, and reads
                # what it adds to now, not after the sums (accumulate)
                pn, pm = n0 + uint64(tid // num_tokens), m0 + uint64(tid % num_tokens)
                prior = (out[pm, pn] if accumulate and warps_per_row > 1 and tid < ups
                         and pn < out_rows and pm < M else float32(0))
                for i in range(acc_size):
                    acc[i] = float32(0)
                for m in range(num_tokens):
                    squares[m] = float32(0)
                c0 = uint64(0)
                while c0 < num_words:  # a staged piece of K at a time
                    end = min(c0 + uint64(chunk), num_words)
                    if stage_now:
                        cuda.syncthreads()  # the last piece's readers are done
                        stage(x64, norm64, staged, m0, M, c0, end - c0, squares)
                        cuda.syncthreads()
                    j = c0 + t
                    # whole passes, with no test a word (a second copy of the loop:
                    # only where few sums leave the registers for it)
                    while split_tail and j + uint64(step - threads_per_row) < end:
                        if not loaded:
                            load_words(w64, words, n0, j, end, N, True)
                        loaded = False
                        for u in range(unroll):
                            dot_word(words, u, j + uint64(u * threads_per_row) - c0,
                                     staged, wf, xf, acc)
                        j += uint64(step)
                    while j < end:  # the last pass, short of `unroll` words (or all)
                        if not loaded:
                            load_words(w64, words, n0, j, end, N, False)
                        loaded = False
                        for u in range(unroll):
                            jj = j + uint64(u * threads_per_row)
                            if jj < end:
                                dot_word(words, u, jj - c0, staged, wf, xf, acc)
                        j += uint64(step)
                    loaded = False  # the next piece loads its own
                    c0 += uint64(chunk)
                if once:  # the next group's first words, while these sums meet
                    load_words(w64, words, n0 + stride * uint64(rows_per_block), t,
                               first_end, N, False)
                    loaded = True
                if rms_norm and stage_now:  # each warp staged part of each row
                    warp_sum_all(squares)
                    if lane == 0:
                        for m in range(num_tokens):
                            partial[warp, m] = squares[m]
                    cuda.syncthreads()
                    if tid < num_tokens:
                        total = float32(0)
                        for i in range(GEMV_WARPS):
                            total += partial[i, tid]
                        inv_rms[tid] = float32(1.0) / math.sqrt(total / k + eps)
                    cuda.syncthreads()
                warp_sum_all(acc)  # every lane now holds its warp's sums
                if warps_per_row == 1:  # a warp owns its rows: lane 0 writes them
                    for i in range(ups):
                        n, m = n0 + uint64(i // num_tokens), i % num_tokens
                        if lane == 0 and n < out_rows and m0 + uint64(m) < M:
                            scale = inv_rms[m] if rms_norm else float32(1)
                            if gated:
                                store_gated(out, scales, m0 + uint64(m), n, out_rows,
                                            acc[i], acc[ups + i], scale)
                            else:
                                store(out, scales, m0 + uint64(m), n, acc[i], scale,
                                      out[m0 + uint64(m), n] if accumulate
                                      else float32(0))
                else:  # the block shares its rows: the warps' sums meet
                    if lane == 0:
                        for i in range(acc_size):
                            partial[warp, i] = acc[i]
                    cuda.syncthreads()
                    if tid < ups:
                        total, up_total = float32(0), float32(0)
                        for i in range(GEMV_WARPS):
                            total += partial[i, tid]
                            if gated:
                                up_total += partial[i, ups + tid]
                        n, m = n0 + uint64(tid // num_tokens), tid % num_tokens
                        if n < out_rows and m0 + uint64(m) < M:
                            scale = inv_rms[m] if rms_norm else float32(1)
                            if gated:
                                store_gated(out, scales, m0 + uint64(m), n, out_rows,
                                            total, up_total, scale)
                            else:
                                store(out, scales, m0 + uint64(m), n, total, scale,
                                      prior)
                    cuda.syncthreads()  # partial is read before the next pass writes it
                m0 += uint64(num_tokens)
                fresh = False
            g += stride
            n0 += stride * uint64(rows_per_block)

    if rms_norm:

        @cuda.jit
        def kernel(x64, w64, scales, out, norm64, eps):
            gemv_body(x64, w64, scales, out, norm64, eps)

    else:

        @cuda.jit
        def kernel(x64, w64, scales, out):
            # no norm: w's first row stands in for its weight (never read)
            gemv_body(x64, w64, scales, out, w64[0], float32(0))

    kernel.rows_per_block = rows_per_block
    # its static shared memory: the stage, the warps' sums, each token's 1 / rms
    kernel.shared_bytes = (8 * STAGE_WORDS + 4 * GEMV_WARPS * partial_size
                           + 4 * num_tokens)
    # blocks an SM holds at once: 32 KiB of staged input each, and the registers,
    # which grow with the words in flight and the sums (4 rows x 4 or 8 tokens: two
    # blocks); one token's 8-row block knobs compile to 80 registers with one word
    # ahead (three blocks) and 96 with two (two blocks), counted from their SASS
    in_flight = rows * unroll
    kernel.blocks_per_sm = (2 if acc_size > 8 or in_flight >= 16 else
                            3 if rows >= 8 else 4)
    kernel.reads_before_wait = True  # the first words (tests/test_ptx.py)
    return require_lto(kernel)  # the widening's C, inlined

# %% [markdown]
# Each format, token bucket, variant and epilogue gets its kernel once, at import:

# %%
#| export kernels.gemv_8bit
import functools

import numpy as np
from numba import config, cuda

from tinyvllm_lib.kernels.checks import cdiv, device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.gemv import (
    GEMV_BUCKETS,
    GEMV_MAX_TOKENS,
    GEMV_THREADS,
    GEMV_VARIANTS,
    GEMV_WARPS,
    gemv_variant,
)
from tinyvllm_lib.kernels.gemv_8bit_kernel import (  # noqa: F401 (re-exported)
    GEMV_8BIT_VERSION,
    make_gemv_8bit_kernel,
)
from tinyvllm_lib.kernels.rmsnorm import check_weight_eps
from tinyvllm_lib.kernels.widen_8bit import CODE_DTYPES

# a kernel a (format, variant, bucket, epilogue), each a module-level name so that
# tests/test_ptx.py compiles it
GEMV_8BIT_KERNELS, PTX_SIGNATURES = {}, {}
_EPILOGUES = {"": {}, "add": {"accumulate": True}, "rmsnorm": {"rms_norm": True},
              "gated": {"gated": True},
              "rmsnorm_gated": {"rms_norm": True, "gated": True}}


# One token on the block variant (fewer rows than chapter 6's GEMV_WARP_MIN_ROWS):
# chapter 6's block shares 4 rows, and a row of codes is half as many words as a bf16
# row — half the work a block, for the same start and the same sums to meet. The
# knobs bench/ch15_quantization.py's sweep on an H100 found fastest for the shapes
# the engine launches (plotted below): 8 rows a block, two words ahead — but one with
# the norm inside, which on the 1B is QKV, whose 384 groups of 8 rows the GPU holds
# at once only with one word's registers (3 blocks an SM, against 2). The plain
# kernel was not swept: it takes the add's knobs
ONE_TOKEN_BLOCK_KNOBS = {"": (GEMV_WARPS, 8, 2), "add": (GEMV_WARPS, 8, 2),
                         "rmsnorm": (GEMV_WARPS, 8, 1)}


def chapter6_knobs(variant: str, tokens: int, gated: bool) -> tuple:
    """(warps a row, rows a group, words loaded ahead): chapter 6's knobs (every
    kernel's up to version 5); gated, rows come in (gate, up) pairs, so an odd count
    doubles and the words ahead halve (as many bytes in flight)."""
    warps, rows, unroll = GEMV_VARIANTS[variant](tokens)
    if gated and rows % 2:
        rows, unroll = 2 * rows, max(1, unroll // 2)
    return warps, rows, unroll


def gemv_8bit_config(variant: str, tokens: int, kind: str = "") -> tuple:
    """The knobs of the kernel for the epilogue `kind`: chapter 6's, but at one token
    on the block variant ONE_TOKEN_BLOCK_KNOBS."""
    if variant == "block" and tokens == 1 and kind in ONE_TOKEN_BLOCK_KNOBS:
        return ONE_TOKEN_BLOCK_KNOBS[kind]
    return chapter6_knobs(variant, tokens, "gated" in kind)


def gemv_8bit_kernel_for(method: str, variant: str, tokens: int, kind: str = "",
                         **options):
    """The launcher's kernel for (format, variant, bucket, epilogue), at its knobs;
    options go to make_gemv_8bit_kernel (prefetch_bytes, for the bench's runs)."""
    knobs = gemv_8bit_config(variant, tokens, kind)
    return make_gemv_8bit_kernel(method, tokens, *knobs, **_EPILOGUES[kind], **options)


for _method in ("int8", "fp8"):
    # chapter 6's two shapes at the knobs chapter 11 tuned for bf16 (a word is 8 bytes
    # in both, so the same knobs keep as many bytes in flight), one token's block aside
    for _variant in GEMV_VARIANTS:
        for _tokens in GEMV_BUCKETS:
            for _kind in _EPILOGUES:
                _name = (f"gemv_{_method}_{_variant}_t{_tokens}"
                         f"{'_' * bool(_kind)}{_kind}_kernel")
                GEMV_8BIT_KERNELS[_method, _variant, _tokens, _kind] = \
                    globals()[_name] = gemv_8bit_kernel_for(
                        _method, _variant, _tokens, _kind)
                _out = "uint16" if "gated" in _kind else "float32"
                _sig = f"uint64[:, ::1], uint64[:, ::1], float32[::1], {_out}[:, ::1]"
                PTX_SIGNATURES[_name] = [f"void({_sig}, uint64[::1], float32)"
                                         if "rmsnorm" in _kind else f"void({_sig})"]

# %% [markdown]
# The launchers check what the kernels assume — eight codes a word, so a row's length
# $K$ must be a multiple of 8 and every row 8-byte aligned — and pick the kernel of the
# token bucket, as chapter 6's do. A model with another $K$ is refused when it is
# loaded, with a `ValueError` that names the size.

# %%
#| export kernels.gemv_8bit
def check_8bit_operands(name: str, method: str, codes, scales, K: int) -> None:
    """ValueError unless codes (N, K) are the format's dtype, scales (N,) float32, all
    C-contiguous, K a multiple of 8 and the rows 8-byte aligned.
    """
    if method not in CODE_DTYPES:
        raise ValueError(f"{name}: method must be 'int8' or 'fp8', got {method!r}")
    N = codes.shape[0] if codes.ndim == 2 else 0
    if (codes.dtype != CODE_DTYPES[method] or codes.ndim != 2 or codes.shape[1] != K
            or scales.dtype != np.float32 or tuple(scales.shape) != (N,)
            or not (is_c_contiguous(codes) and is_c_contiguous(scales)) or N == 0):
        raise ValueError(
            f"{name}: need {method} codes (N, {K}) {np.dtype(CODE_DTYPES[method])} and "
            f"scales (N,) float32, C-contiguous; got {codes.dtype} "
            f"{tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if K % 8 or device_pointer(codes) % 8:
        raise ValueError(f"{name}: reads 8 codes at a time: K={K} must be a multiple "
                         "of 8 and the codes 8-byte aligned")


def pick_gemv_8bit_kernel(name: str, method: str, M: int, N: int, kind: str = "",
                          variant: str = "auto"):
    """(kernel, blocks) for M token vectors and N rows, with the epilogue `kind`; the
    variant "auto" is chapter 6's rule (a warp a row for many rows and few tokens; in
    the simulator always, whose threads each run in Python).
    """
    if not 0 < M <= GEMV_MAX_TOKENS:
        raise ValueError(f"{name}: 1 to {GEMV_MAX_TOKENS} token vectors, got {M}")
    if variant == "auto":
        variant = "warp" if config.ENABLE_CUDASIM else gemv_variant(M, N)
    if variant not in GEMV_VARIANTS:
        raise ValueError(f"{name}: variant must be 'auto' or one of "
                         f"{list(GEMV_VARIANTS)}, got {variant!r}")
    bucket = next((b for b in GEMV_BUCKETS if b >= M), GEMV_BUCKETS[-1])
    kernel = GEMV_8BIT_KERNELS[method, variant, bucket, kind]
    # no more blocks than the GPU holds at once: each stages its input once and takes
    # groups of rows in turn
    out_rows = N // 2 if "gated" in kind else N
    return kernel, min(cdiv(out_rows, kernel.rows_per_block), resident_blocks(kernel))


def resident_blocks(kernel) -> int:
    """Blocks of `kernel` the GPU holds at once: once it is compiled, as many as an
    SM's registers, shared memory and threads allow (compiled_blocks_per_sm); before
    its first launch, kernel.blocks_per_sm an SM, an estimate (which block takes a
    group of rows changes no sum, so no bit). In the simulator one block, so that the
    tests' blocks take groups in turn too.
    """
    if config.ENABLE_CUDASIM:
        return 1
    if not kernel.overloads:
        return kernel.blocks_per_sm * multiprocessors()
    if not hasattr(kernel, "compiled_per_sm"):  # counted once, after it compiles
        registers = max(kernel.get_regs_per_thread().values())
        kernel.compiled_per_sm = compiled_blocks_per_sm(cuda.get_current_device(),
                                                        registers, kernel.shared_bytes)
    return kernel.compiled_per_sm * multiprocessors()


def compiled_blocks_per_sm(device, registers: int, shared_bytes: int) -> int:
    """Blocks of GEMV_THREADS threads, each `registers` registers, with shared_bytes of
    shared memory a block, one SM of `device` holds: registers are given a warp at a
    time in 256s, and the driver keeps 1 KiB of shared memory a block."""
    per_warp = cdiv(registers * 32, 256) * 256
    by_registers = device.MAX_REGISTERS_PER_MULTIPROCESSOR // (per_warp * GEMV_WARPS)
    by_shared = device.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR // (shared_bytes + 1024)
    by_threads = device.MAX_THREADS_PER_MULTIPROCESSOR // GEMV_THREADS
    return max(1, min(by_registers, by_shared, by_threads))


@functools.cache
def multiprocessors() -> int:
    """The current GPU's streaming multiprocessors."""
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def check_8bit_out(name: str, out, M: int, N: int, gated: bool) -> None:
    """ValueError unless out is (M, N) float32, or gated (M, N / 2) bf16 bits (N even),
    C-contiguous."""
    want = ((M, N // 2), np.uint16) if gated else ((M, N), np.float32)
    if (tuple(out.shape), out.dtype) != want or (gated and N % 2) \
            or not is_c_contiguous(out):
        raise ValueError(f"{name}: need out {want[0]} {np.dtype(want[1])} "
                         f"C-contiguous{' (w stacks gate and up: N even)' * gated}; "
                         f"got {out.dtype} {tuple(out.shape)}")


def gemv_8bit(x, codes, scales, out, method: str, stream=0, accumulate=False,
              variant: str = "auto", gated: bool = False):
    """Launch: out (M, N) = x (M, K) · (scales ⊙ codes)ᵀ for M <= 16 bf16 token
    vectors, reading 8 codes at a time; accumulate: out += instead. gated: codes
    stack [gate | up] and out (M, N / 2) bf16 bits = SiLU(x · gateᵀ) * (x · upᵀ).
    """
    M, K = x.shape if x.ndim == 2 else (0, 0)
    check_8bit_operands("gemv_8bit", method, codes, scales, K)
    N = codes.shape[0]
    if x.dtype != np.uint16 or not is_c_contiguous(x) or device_pointer(x) % 8:
        raise ValueError(f"gemv_8bit: need x (M, {K}) bf16 bits, 8-byte aligned, "
                         f"C-contiguous; got {x.dtype} {tuple(x.shape)}")
    check_8bit_out("gemv_8bit", out, M, N, gated)
    if gated and accumulate:
        raise ValueError("gemv_8bit: gated writes SiLU(gate) * up, it adds to nothing")
    kind = "gated" if gated else "add" * accumulate
    kernel, blocks = pick_gemv_8bit_kernel("gemv_8bit", method, M, N, kind, variant)
    kernel[blocks, GEMV_THREADS, stream](x.view(np.uint64), codes.view(np.uint64),
                                         scales, out)
    return out


def gemv_8bit_rmsnorm(residual, norm_weight, eps: float, codes, scales, out,
                      method: str, stream=0, variant: str = "auto",
                      gated: bool = False):
    """Launch: out (M, N) = RMSNorm(residual) · (scales ⊙ codes)ᵀ for M <= 16 rows of
    the float32 residual stream (M, K), with the norm's bf16 weight (K,); gated: as
    gemv_8bit's.
    """
    M, K = residual.shape if residual.ndim == 2 else (0, 0)
    check_8bit_operands("gemv_8bit_rmsnorm", method, codes, scales, K)
    N = codes.shape[0]
    if residual.dtype != np.float32 or not is_c_contiguous(residual) \
            or device_pointer(residual) % 8 or device_pointer(norm_weight) % 8:
        raise ValueError(
            f"gemv_8bit_rmsnorm: need residual (M, {K}) float32, C-contiguous, it and "
            f"norm_weight 8-byte aligned; got {residual.dtype} {tuple(residual.shape)}")
    check_8bit_out("gemv_8bit_rmsnorm", out, M, N, gated)
    eps = check_weight_eps("gemv_8bit_rmsnorm", norm_weight, K, eps)  # chapter 4's
    kernel, blocks = pick_gemv_8bit_kernel("gemv_8bit_rmsnorm", method, M, N,
                                           "rmsnorm_gated" if gated else "rmsnorm",
                                           variant)
    kernel[blocks, GEMV_THREADS, stream](residual.view(np.uint64),
                                         codes.view(np.uint64), scales, out,
                                         norm_weight.view(np.uint64), eps)
    return out


# %% [markdown]
# Each format's GEMV against the NumPy reference, on fresh random inputs of shapes that
# fill no warp evenly (one block of rows: the simulator runs each of its 256 threads in
# Python): the plain product of three token vectors, the residual added to a random
# output, and the norm fused in. The tolerance is chapter 6's, float32 sums against
# float64 ones: $10^{-4}$ of the largest output.

# %%
def check_gemv_8bit(method: str, M: int = 3, N: int = 7, K: int = 72) -> float:
    """The largest relative error of the three GEMV kinds against NumPy (float64)."""
    from numba import cuda

    x_bits = f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    residual = rng.standard_normal((M, K)).astype(np.float32)
    norm = f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32))
    q = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, method)
    w = q.dequantize().astype(np.float64)
    codes, scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
    before = rng.standard_normal((M, N)).astype(np.float32)
    plain, added = cuda.device_array((M, N), np.float32), cuda.to_device(before)
    normed = cuda.device_array((M, N), np.float32)
    gemv_8bit(cuda.to_device(x_bits), codes, scales, plain, method)
    gemv_8bit(cuda.to_device(x_bits), codes, scales, added, method, accumulate=True)
    gemv_8bit_rmsnorm(cuda.to_device(residual), cuda.to_device(norm), 1e-5, codes,
                      scales, normed, method)
    product = bf16_bits_to_f32(x_bits) @ w.T
    return max(
        max_rel_error(plain.copy_to_host(), product),
        max_rel_error(added.copy_to_host(), before + product),
        max_rel_error(normed.copy_to_host(),
                      rmsnorm_ref(residual, norm, 1e-5).astype(np.float64) @ w.T),
    )


if can_launch():
    for method in ("int8", "fp8"):
        error = check_gemv_8bit(method)
        print(f"{method}: plain, residual add, RMSNorm: largest relative error "
              f"{error:.1e}")
        assert error <= 1e-4

# %% [markdown]
# **The MLP's first half in one kernel.** Chapter 7's `gemv_silu_mul` gave each warp a
# gate row and its up row and wrote $\operatorname{SiLU}(g)\cdot u$ where the two
# products are made; for bf16 it paid only once each warp kept one step of its pair
# of rows in flight (chapter 11's sweep), and the bf16 model uses it at one token.
# This kernel's blocks already take groups of rows in turn, as
# many of them as the GPU holds whatever rows they take, so pairing rows costs no
# warps. With `gated=True` half of a group's rows are gate rows and the other half the
# up rows $I$ below them; each thread keeps as many words in flight (where a warp had
# one row it takes a pair and loads half as many words ahead), and the row's sums end
# as SiLU·up in bf16, the input of `down_proj`.
# With the norm inside as well, the norm, the gate-up GEMV and SiLU·up — two kernels
# in the bf16 model at one token (the norm, which chapter 6 keeps out of a 16,384-row
# GEMV, then the gated GEMV) — become one, and the float32 `[gate | up]` row is never
# written. The layer
# loop asks for that half through chapter 7's `rmsnorm_linear_silu_mul`, which an
# 8-bit weight answers itself (`QuantizedLinear.apply_rmsnorm_silu_mul`, below) — in
# one kernel where the GEMV runs (`GATED_GEMV_8BIT`, on from version 5 of the GEMV:
# the batch-1 records below are that version's; `False` launches two: the norm inside
# gate-up's GEMV into float32, then `silu_mul`). A
# thread meets its words in the same order whether its group holds one row or a pair,
# so the check is exact: the gated kernel's bits equal those of the same GEMV into
# float32 followed by `silu_mul`.

# %%
from tinyvllm_lib.kernels.activation import silu_mul


def check_gated(method: str, M: int = 2, I: int = 5, K: int = 64) -> None:
    """gemv_8bit_rmsnorm with gated=True against the GEMV into [gate | up], then
    silu_mul: the same bf16 bits."""
    from numba import cuda

    residual = cuda.to_device(rng.standard_normal((M, K)).astype(np.float32))
    norm = cuda.to_device(f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32)))
    q = quantize(rng.standard_normal((2 * I, K)).astype(np.float32) * 0.05, method)
    codes, scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
    gate_up = cuda.device_array((M, 2 * I), np.float32)
    fused, separate = (cuda.device_array((M, I), np.uint16) for _ in range(2))
    gemv_8bit_rmsnorm(residual, norm, 1e-5, codes, scales, gate_up, method)
    silu_mul(gate_up, separate)
    gemv_8bit_rmsnorm(residual, norm, 1e-5, codes, scales, fused, method, gated=True)
    assert np.array_equal(fused.copy_to_host(), separate.copy_to_host())


if can_launch():
    for method in ("int8", "fp8"):
        check_gated(method)
    print("gated: the same bits as the GEMV, then silu_mul (int8 and FP8)")

# %% [markdown]
# **Prefill** — many tokens at once — is a GEMM, and chapter 6 gave it to cuBLAS, on
# bf16. The simplest honest choice here: before each GEMM, a kernel **dequantizes the
# weight into a bf16 scratch buffer** (one thread a word of 8 codes: widen, times the
# scale, rounded to bf16), and chapter 6's `linear` runs on that. It costs a write of
# the bf16 weight and a read of the 8-bit one before cuBLAS reads the bf16 one, so an
# 8-bit GEMM moves about 2.5 times the bytes of a bf16 one; the next section counts
# what that predicts. For `fp8` the next subsection builds the alternative, Hopper's
# FP8 tensor cores, which quantize the activations too (behind a switch, off by
# default until its GPU tests all pass); `int8` keeps the scratch for many tokens
# (widening the codes inside the tensor cores' tiles, which would not need it, is
# built below for up to 16 token vectors, `mma_8bit`; prefill keeps the scratch), and
# the measurement at the end of the chapter says what each costs.
# Its second rounding, of $s_n q_{nk}$ to bf16, moves a weight by at most $2^{-8}$ of
# itself, as bf16 weights
# always have.

# %%
#| export kernels.dequantize_8bit
import numpy as np
from numba import cuda, uint32, uint64

from tinyvllm_lib.kernels.bf16 import f32_to_bf16
from tinyvllm_lib.kernels.checks import cdiv, device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.gemv_8bit import check_8bit_operands
from tinyvllm_lib.kernels.widen_8bit import WIDEN

DEQUANTIZE_THREADS = 256


def make_dequantize_kernel(method: str):
    """out (N, K) bf16 = bf16(scales[n] · value(codes[n, k])), a word of 8 codes a
    thread (codes and out viewed as uint64).
    """
    widen = WIDEN[method]

    @cuda.jit
    def kernel(w64, scales, out64):
        wait_for_previous_kernel()
        i = uint64(cuda.grid(1))
        N, num_words = uint64(w64.shape[0]), uint64(w64.shape[1])
        n, j = i // num_words, i % num_words
        if n < N:
            word, scale = w64[n, j], scales[n]
            for half in range(2):  # 4 codes -> 4 bf16 -> one uint64 word of out
                packed = uint64(0)
                for b in range(4):
                    code = uint32((word >> uint64(32 * half + 8 * b)) & uint64(0xFF))
                    bits = uint64(f32_to_bf16(widen(code) * scale))
                    packed |= bits << uint64(16 * b)
                out64[n, uint64(2) * j + uint64(half)] = packed

    return kernel


dequantize_int8_kernel = make_dequantize_kernel("int8")
dequantize_fp8_kernel = make_dequantize_kernel("fp8")
DEQUANTIZE_KERNELS = {"int8": dequantize_int8_kernel, "fp8": dequantize_fp8_kernel}
_SIG = "void(uint64[:, ::1], float32[::1], uint64[:, ::1])"
PTX_SIGNATURES = {"dequantize_int8_kernel": [_SIG], "dequantize_fp8_kernel": [_SIG]}


def dequantize_to_bf16(codes, scales, out, method: str, stream=0):
    """Launch: out (N, K) bf16 bits = the weights codes and scales stand for."""
    K = codes.shape[1] if codes.ndim == 2 else 0
    check_8bit_operands("dequantize_to_bf16", method, codes, scales, K)
    if out.dtype != np.uint16 or tuple(out.shape) != tuple(codes.shape) \
            or not is_c_contiguous(out) or device_pointer(out) % 8:
        raise ValueError(f"dequantize_to_bf16: need out {tuple(codes.shape)} bf16 "
                         f"bits, 8-byte aligned; got {out.dtype} {tuple(out.shape)}")
    num_words = codes.size // 8
    DEQUANTIZE_KERNELS[method][cdiv(num_words, DEQUANTIZE_THREADS), DEQUANTIZE_THREADS,
                               stream](codes.view(np.uint64), scales,
                                       out.view(np.uint64))
    return out

# %% [markdown]
# ### FP8 tensor cores: quantize the activations too
#
# The scratch is the honest first step, not the last one. Hopper's tensor cores
# multiply FP8 operands at twice bf16's rate, and cuBLASLt (the "light" cuBLAS that
# takes descriptors instead of arguments) runs such a GEMM with **a scale for every
# row of each operand**, applied in the GEMM's epilogue — NVIDIA calls them
# outer-vector scales. Both operands must be FP8, so the activations are quantized
# too, as vLLM does for its FP8 models: each token vector gets its own scale
# ($s_m = \max_k |x_{mk}| / 448$), its own e4m3 codes, and
#
# $$\text{out}_{mn} = s_m\, s_n \sum_k \hat x_{mk}\, \hat w_{nk},$$
#
# with the products summed in float32 inside the tensor cores. This is **W8A8**
# where the GEMV was W8A16: the GEMM path rounds each activation to 3 mantissa bits
# as well (the token's largest value sets the scale, the smaller ones lose the
# most). It applies only to `fp8`: Hopper has no int8 × bf16 or int8 × FP8 tensor
# core, so `int8` keeps the scratch. The NumPy model can do the same rounding
# (`QuantizedLlamaNumpy(..., fp8_gemm_tokens=...)`), so the GPU's path has a
# reference on the CPU.
#
# The activations' quantizer is one block a token vector: the block finds the
# absolute maximum of its row (a warp's butterfly, then the warps'), divides each
# value by the scale in float32 — as `quantize` does, so the codes are the same
# bits — and rounds it to e4m3: on the GPU with the hardware's conversion, two
# values an instruction (`cvt.rn.satfinite.e4m3x2.f32`, linked as chapter 15's
# GEMV links its widening), in the simulator with the integer recipe written out
# (keep 3 mantissa bits, ties to even; saturate at 448), which the tests hold to the
# same bits.

# %%
#| export kernels.quantize_tokens
import math

import numpy as np
from numba import config, cuda, float32, uint32, uint64

from tinyvllm_lib.kernels.activation_store import unpack_f32_pair
from tinyvllm_lib.kernels.bf16 import (
    _f32_bits,
    bf16_to_f32,
    device_function,
    f32_to_bf16,
)
from tinyvllm_lib.kernels.checks import device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, block_sum, shfl_xor
from tinyvllm_lib.kernels.rmsnorm import (
    can_go_wide,
    check_weight_eps,
    wide_block_threads,
)
from tinyvllm_lib.kernels.rmsnorm_kernels import WIDE_ITEMS, WIDE_WORDS, first_word
from tinyvllm_lib.kernels.tensor_core import require_lto
from tinyvllm_lib.quantization.formats import FP8_E4M3_MAX

QUANTIZE_TOKENS_THREADS = 256
_E4M3_MAX = float32(FP8_E4M3_MAX)


@device_function
def f32_to_e4m3(x):
    """Round one float32 to e4m3fn bits (as fp8_e4m3_encode does): nearest, ties to
    even; past ±448 saturate; NaN -> S.1111.111."""
    u = _f32_bits(x)
    sign = (u >> uint32(24)) & uint32(0x80)
    magnitude = u & uint32(0x7FFFFFFF)
    if magnitude > uint32(0x7F800000):  # NaN
        return uint32(0x7F) | sign
    if magnitude < uint32(0x3C800000):  # below 2^-6: steps of 2^-9, ties to even
        steps = abs(x) * float32(512.0)
        n = uint32(steps)
        frac = steps - float32(n)
        if frac > float32(0.5) or (frac == float32(0.5) and n & uint32(1)):
            n += uint32(1)
        return n | sign
    top = (magnitude + uint32(0x7FFFF) + ((magnitude >> uint32(20)) & uint32(1))) \
        >> uint32(20)
    return min(top - uint32(120 << 3), uint32(0x7E)) | sign


if config.ENABLE_CUDASIM:

    def f32x2_to_e4m3x2(high, low):
        """Two float32 -> two e4m3 codes in a uint32's low 16 bits, high's above."""
        return (f32_to_e4m3(high) << uint32(8)) | f32_to_e4m3(low)

else:  # the hardware's conversion: one instruction for two (rounded to nearest
    # even, saturated at ±448, as f32_to_e4m3 rounds; a NaN to a NaN code, its sign
    # perhaps not kept; sm_89 and later, as the FP8 GEMV's widening)
    from numba import types
    from numba.cuda import CUSource

    E4M3_SOURCE = r"""
extern "C" __device__ unsigned f32x2_to_e4m3x2(float high, float low) {
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(high), "f"(low));
  return pair;
}
"""
    f32x2_to_e4m3x2 = cuda.declare_device(
        "f32x2_to_e4m3x2", types.uint32(types.float32, types.float32),
        link=CUSource(E4M3_SOURCE), abi="c")


@cuda.jit(device=True)
def block_max(largest, warp_max, scratch):
    """The largest of the block's values (1-D, whole warps), a NaN never taken
    (`other > largest` is false for it); every thread gets it. warp_max: shared
    float32[32]."""
    lane_mask = WARP_SIZE // 2
    while lane_mask > 0:
        other = shfl_xor(largest, lane_mask, scratch)
        if other > largest:
            largest = other
        lane_mask //= 2
    if cuda.threadIdx.x % WARP_SIZE == 0:
        warp_max[cuda.threadIdx.x // WARP_SIZE] = largest
    cuda.syncthreads()
    largest = float32(0.0)
    for w in range(cuda.blockDim.x // WARP_SIZE):
        if warp_max[w] > largest:
            largest = warp_max[w]
    return largest


@cuda.jit
def quantize_tokens_fp8_kernel(x64, codes32, scales):
    """Block m: row m of x (bf16 bits, viewed as uint64 words of 4) -> its scale
    (absmax / 448) and e4m3 codes (viewed as uint32 words of 4)."""
    wait_for_previous_kernel()
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    warp_max = cuda.shared.array(32, float32)
    m, tid = cuda.blockIdx.x, cuda.threadIdx.x
    num_words = x64.shape[1]
    largest = float32(0.0)
    for j in range(tid, num_words, cuda.blockDim.x):
        word = x64[m, j]
        for b in range(4):
            v = abs(bf16_to_f32(uint32((word >> uint64(16 * b)) & uint64(0xFFFF))))
            if v > largest:  # never true for a NaN: skipped here, coded NaN below
                largest = v
    scale = block_max(largest, warp_max, scratch) / _E4M3_MAX
    if tid == 0:
        scales[m] = scale
    divide = scale if scale > float32(0.0) else float32(1.0)  # an all-zero row
    for j in range(tid, num_words, cuda.blockDim.x):
        word = x64[m, j]
        v0 = bf16_to_f32(uint32(word & uint64(0xFFFF))) / divide
        v1 = bf16_to_f32(uint32((word >> uint64(16)) & uint64(0xFFFF))) / divide
        v2 = bf16_to_f32(uint32((word >> uint64(32)) & uint64(0xFFFF))) / divide
        v3 = bf16_to_f32(uint32(word >> uint64(48))) / divide
        low, high = f32x2_to_e4m3x2(v1, v0), f32x2_to_e4m3x2(v3, v2)
        codes32[m, j] = low | (high << uint32(16))


require_lto(quantize_tokens_fp8_kernel)  # the conversion's C, inlined
PTX_SIGNATURES = {"quantize_tokens_fp8_kernel":
                  ["void(uint64[:, ::1], uint32[:, ::1], float32[::1])"]}


def quantize_tokens_fp8(x, codes, scales, stream=0):
    """Launch: each row of x (M, K) bf16 bits -> its float32 scale and e4m3 codes
    (codes (M, K) uint8), as quantize(x, "fp8") makes them. K a multiple of 4."""
    M, K = x.shape if x.ndim == 2 else (0, 0)
    if (x.dtype != np.uint16 or codes.dtype != np.uint8 or tuple(codes.shape) != (M, K)
            or scales.dtype != np.float32 or scales.shape[0] < M or K % 4 or M == 0
            or not (is_c_contiguous(x) and is_c_contiguous(codes))
            or device_pointer(x) % 8 or device_pointer(codes) % 4):
        raise ValueError(
            f"quantize_tokens_fp8: need x (M, K) bf16 bits and codes (M, K) uint8 with "
            f"K a multiple of 4, aligned, scales (M,) float32; got {x.dtype} "
            f"{tuple(x.shape)}, {codes.dtype} {tuple(codes.shape)}, {scales.dtype} "
            f"{tuple(scales.shape)}")
    quantize_tokens_fp8_kernel[M, QUANTIZE_TOKENS_THREADS, stream](
        x.view(np.uint64), codes.view(np.uint32), scales)
    return codes, scales


# the norm and the quantizer as one kernel, for a product that reads a norm's
# output: the bf16 rows are never written
@cuda.jit
def rmsnorm_quantize_fp8_kernel(x64, weight32, eps, codes16, scales):
    """Block m: row m of x (float32 pairs) normed as chapter 4's rung 6 norms it (the
    same words a thread, the same sum), each value rounded to bf16 as rmsnorm would
    store it, then quantized as quantize_tokens_fp8_kernel quantizes a row: its scale
    and e4m3 codes (uint16 words of 2)."""
    wait_for_previous_kernel()
    row = cuda.blockIdx.x
    x_row, code_row = x64[row], codes16[row]
    num_words = uint64(x64.shape[1])
    start = first_word()
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    warp_max = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    values = cuda.local.array(WIDE_ITEMS, float32)  # registers: constant indices
    weights = cuda.local.array(WIDE_WORDS, uint32)
    sum_squares = float32(0.0)
    for k in range(WIDE_WORDS):
        j = start + uint64(k * WARP_SIZE)
        is_in_row = j < num_words
        j = min(j, num_words - uint64(1))
        first, second = unpack_f32_pair(x_row[j])
        weights[k] = weight32[j]
        first = first if is_in_row else float32(0.0)
        second = second if is_in_row else float32(0.0)
        values[2 * k] = first
        values[2 * k + 1] = second
        sum_squares += first * first + second * second
    total = block_sum(sum_squares, warp_sums, scratch)
    norm = float32(1.0) / math.sqrt(total / float32(2 * x64.shape[1]) + eps)
    largest = float32(0.0)
    for k in range(WIDE_WORDS):
        w = weights[k]
        first = bf16_to_f32(f32_to_bf16(
            values[2 * k] * norm * bf16_to_f32(w & uint32(0xFFFF))))
        second = bf16_to_f32(f32_to_bf16(
            values[2 * k + 1] * norm * bf16_to_f32(w >> uint32(16))))
        if start + uint64(k * WARP_SIZE) < num_words:
            values[2 * k], values[2 * k + 1] = first, second
            if abs(first) > largest:  # never for a NaN
                largest = abs(first)
            if abs(second) > largest:
                largest = abs(second)
    scale = block_max(largest, warp_max, scratch) / _E4M3_MAX
    if cuda.threadIdx.x == 0:
        scales[row] = scale
    divide = scale if scale > float32(0.0) else float32(1.0)
    for k in range(WIDE_WORDS):
        j = start + uint64(k * WARP_SIZE)
        if j < num_words:
            code_row[j] = f32x2_to_e4m3x2(values[2 * k + 1] / divide,
                                          values[2 * k] / divide)


require_lto(rmsnorm_quantize_fp8_kernel)

PTX_SIGNATURES["rmsnorm_quantize_fp8_kernel"] = [
    "void(uint64[:, ::1], uint32[::1], float32, uint16[:, ::1], float32[::1])"]


def can_norm_quantize(x, weight, codes) -> bool:
    """rmsnorm_quantize_fp8 takes these: rung 6's rows (see can_go_wide), codes
    4-byte aligned."""
    return can_go_wide(x, weight) and device_pointer(codes) % 4 == 0


def rmsnorm_quantize_fp8(x, weight, eps: float, codes, scales, stream=0):
    """Launch: each row of x (M, K) float32 -> RMSNorm(row) * weight, rounded to bf16,
    quantized per row to e4m3 codes (M, K) uint8 and a float32 scale: the bits
    rmsnorm, then quantize_tokens_fp8, give."""
    M, K = x.shape if x.ndim == 2 else (0, 0)
    if M == 0:
        raise ValueError(f"rmsnorm_quantize_fp8: need x (M, K) float32 with M > 0, "
                         f"got {tuple(x.shape)}")
    eps32 = check_weight_eps("rmsnorm_quantize_fp8", weight, K, eps)
    if (x.dtype != np.float32 or codes.dtype != np.uint8
            or tuple(codes.shape) != (M, K) or scales.dtype != np.float32
            or scales.shape[0] < M or K % 4 or M == 0
            or not (is_c_contiguous(x) and is_c_contiguous(codes))
            or not can_norm_quantize(x, weight, codes)):
        raise ValueError(
            f"rmsnorm_quantize_fp8: need x (M, K) float32 and codes (M, K) uint8 with "
            f"K a multiple of 4 (at most rung 6's), aligned, scales (M,) float32; got "
            f"{x.dtype} {tuple(x.shape)}, {codes.dtype} {tuple(codes.shape)}, "
            f"{scales.dtype} {tuple(scales.shape)}")
    rmsnorm_quantize_fp8_kernel[M, wide_block_threads(K), stream](
        x.view(np.uint64), weight.view(np.uint32), eps32, codes.view(np.uint16), scales)
    return codes, scales


# %% [markdown]
# The check is exact: the kernel's codes and scales are the bits `quantize` gives
# the same bf16 rows — rows of every size of value, a row of zeros, values that
# land on a tie between two codes, and values past 448 times the scale (none can be:
# the largest is 448 exactly).
#
# Two of a layer's four products read a norm's output (QKV and gate-up), so
# `rmsnorm_quantize_fp8` does both in one kernel: chapter 4's widest norm, its values
# rounded to bf16 as that norm stores them, then the quantizer's absmax and codes.
# The bf16 rows are never written and a launch is saved; the check holds it to the
# bits of the two kernels one after the other.

# %%
from tinyvllm_lib.kernels.quantize_tokens import quantize_tokens_fp8


def check_quantize_tokens(M: int = 5, K: int = 72) -> None:
    from numba import cuda

    x = rng.standard_normal((M, K)).astype(np.float32) * np.logspace(-3, 2, M)[:, None]
    x[1] = 0.0  # an all-zero token
    x[2, :8] = [2.0**-8 * 1.5, -(2.0**-9) * 3, 448.0, 1e-30, -0.0, 3.25, 6.5, 13.0]
    bits = f32_to_bf16_bits(x)
    want = quantize(bf16_bits_to_f32(bits), "fp8")
    codes = cuda.device_array((M, K), np.uint8)
    scales = cuda.device_array(M, np.float32)
    quantize_tokens_fp8(cuda.to_device(bits), codes, scales)
    assert np.array_equal(scales.copy_to_host(), want.scales)
    assert np.array_equal(codes.copy_to_host(), want.codes)


from tinyvllm_lib.kernels.quantize_tokens import rmsnorm_quantize_fp8
from tinyvllm_lib.kernels.rmsnorm import rmsnorm


def check_rmsnorm_quantize(M: int = 3, K: int = 72) -> None:
    """The fused kernel's codes and scales against chapter 4's norm, then the
    quantizer: the same bits."""
    from numba import cuda

    x = cuda.to_device(rng.standard_normal((M, K)).astype(np.float32) * 3)
    gains = rng.uniform(0.5, 1.5, K).astype(np.float32)
    weight = cuda.to_device(f32_to_bf16_bits(gains))
    normed = cuda.device_array((M, K), np.uint16)
    rmsnorm(x, weight, 1e-5, normed)
    want = [cuda.device_array((M, K), np.uint8), cuda.device_array(M, np.float32)]
    quantize_tokens_fp8(normed, *want)
    got = [cuda.device_array((M, K), np.uint8), cuda.device_array(M, np.float32)]
    rmsnorm_quantize_fp8(x, weight, 1e-5, *got)
    for a, b in zip(got, want):
        assert np.array_equal(a.copy_to_host(), b.copy_to_host())


if can_launch():
    check_quantize_tokens()
    print("quantize_tokens_fp8: the codes and scales quantize() gives, bit for bit")
    check_rmsnorm_quantize()
    print("rmsnorm_quantize_fp8: the bits of rmsnorm, then quantize_tokens_fp8")

# %% [markdown]
# Rounding the activations costs accuracy that the weights alone did not. The CPU
# study earlier in this chapter measures it once more with the NumPy model mirroring
# this path (`fp8_gemm_tokens=8`). A teacher-forced pass feeds every product more
# than 8 token vectors, so every product there is W8A8: this bounds what a prompt's
# prefill, and a decode step past the engine's GEMV and tensor-core paths, see.

# %%
def w8a8_run(name: str, method: str) -> dict | None:
    """The CPU study's record of `method` with its activations quantized too."""
    return next((r for r in accuracy if r["name"] == name and r.get("w8a8_tokens")
                 and r["quantization"] == method), None)


w8a8_text, w8a8_chat = w8a8_run("text_perplexity", "fp8"), w8a8_run("chat_flips", "fp8")
int8_w8a8 = w8a8_run("text_perplexity", "int8")
if w8a8_text is None or w8a8_chat is None:
    print("W8A8 not yet measured: python bench/ch15_accuracy_cpu.py")
else:
    w8a16 = text_runs["fp8"]["ratio_to_bf16"] - 1
    w8a8 = w8a8_text["ratio_to_bf16"] - 1
    w8a8_sure = [f for f in w8a8_chat["flips"] if f["bf16_margin"] > 0.5]
    print(f"FP8 weights alone (W8A16): perplexity {w8a16:+.2%} over bf16's; with the "
          f"activations too (W8A8): {w8a8:+.2%}, {w8a8_chat['value']:.0f} chat flips, "
          f"{len(w8a8_sure)} past the 0.5 margin (largest "
          f"{w8a8_chat['largest_flip_margin']:.2f})")
    prose.glue("ch15_w8a8_ppl", f"{w8a8:+.2%}")
    prose.glue("ch15_w8a16_ppl", f"{w8a16:+.2%}")
    prose.glue("ch15_w8a8_verdict", "within" if w8a8 <= TARGETS["fp8"] else "outside")
    prose.glue("ch15_w8a8_flips", f"{w8a8_chat['value']:.0f}")
    prose.glue("ch15_w8a8_sure", f"{len(w8a8_sure)}")
    prose.glue("ch15_w8a16_flips", f"{chat_runs['fp8']['value']:.0f}")
if int8_w8a8 is not None:
    print(f"int8 with its activations in int8 too (not built): perplexity "
          f"{int8_w8a8['ratio_to_bf16'] - 1:+.2%} over bf16's, against "
          f"{text_runs['int8']['ratio_to_bf16'] - 1:+.2%} for its weights alone")
    prose.glue("ch15_int8_w8a8_ppl", f"{int8_w8a8['ratio_to_bf16'] - 1:+.2%}")
    prose.glue("ch15_int8_w8a16_ppl", f"{text_runs['int8']['ratio_to_bf16'] - 1:+.2%}")
    prose.glue("ch15_int8_w8a8_dlogp", f"{int8_w8a8['mean_abs_dlogp']:.3f}")
    prose.glue("ch15_int8_w8a16_dlogp", f"{text_runs['int8']['mean_abs_dlogp']:.3f}")
# SmoothQuant's remedy, a what-if too (bench/ch15_smoothing_cpu.py): the best α
smoothed = [r for r in load_records("ch15_smoothing") if r["quantization"] == "int8"]
best_smooth = min(smoothed, key=lambda r: r["mean_abs_dlogp"], default=None)
if best_smooth is not None:
    print(f"int8 W8A8 smoothed with α = {best_smooth['alpha']}: perplexity "
          f"{best_smooth['ratio_to_bf16'] - 1:+.2%}, mean |Δ log p| "
          f"{best_smooth['mean_abs_dlogp']:.3f}")
    prose.glue("ch15_smooth_alpha", f"{best_smooth['alpha']}")
    prose.glue("ch15_smooth_alphas", ", ".join(
        f"{a}" for a in sorted({r["alpha"] for r in smoothed})))
    prose.glue("ch15_smooth_ppl", f"{best_smooth['ratio_to_bf16'] - 1:+.2%}")
    prose.glue("ch15_smooth_dlogp", f"{best_smooth['mean_abs_dlogp']:.3f}")
    prose.glue("ch15_smooth_verdict", (
        "within int8's 1% target" if best_smooth["ratio_to_bf16"] - 1 <= TARGETS["int8"]
        else "still outside int8's 1% target"))
if int8_w8a8 is not None:
    prose.glue("ch15_int8_w8a8_verdict", (
        "outside int8's 1% target, so int8 keeps its scratch"
        if int8_w8a8["ratio_to_bf16"] - 1 > TARGETS["int8"]
        else "within int8's 1% target: an int8 tensor-core path is worth building"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if w8a8_text is not None and w8a8_chat is not None:
    prose.show("""
With the activations rounded too, SmolLM2's perplexity on chapter 1's prose rises
{{ch15_w8a8_ppl}} over bf16's, against {{ch15_w8a16_ppl}} for FP8 weights alone:
{{ch15_w8a8_verdict}} FP8's 2% target. Along the 20 answers its top token differs
from bf16's at {{ch15_w8a8_flips}} positions (weights alone: {{ch15_w8a16_flips}}),
{{ch15_w8a8_sure}} of them where bf16's margin exceeds 0.5. An e4m3 code keeps 3
bits of mantissa: rounding moves each activation in its normal range by up to 1/16
of itself, where bf16's rounding moved it by 1/256. The cost falls on prompts and on
busy decode steps, not on a lone stream's decode, which stays on the GEMV's W8A16.
So the switch is a trade of accuracy for prefill speed, and it is measured rather
than assumed.
""" + ("""
int8 has tensor cores too, twice bf16's rate like FP8's, but only for int8 × int8: its
GEMM path would have to round the activations to int8 per token as well. The same
study, run as a what-if, puts that at {{ch15_int8_w8a8_ppl}} (its weights alone:
{{ch15_int8_w8a16_ppl}}), {{ch15_int8_w8a8_verdict}}.
""" if int8_w8a8 is not None else "") + ("""
The known remedy is SmoothQuant's (Xiao et al., 2022): divide each input channel by
$s_j = \\max|X_j|^\\alpha / \\max|W_j|^{1-\\alpha}$ and multiply the weight's column by
it, so the product is unchanged and the activations' outlier channels hand part of
their range to the weights. Calibrated on chapter 4's prose and measured on chapter
1's (`bench/ch15_smoothing_cpu.py`, another what-if), int8 W8A8 smoothed with
$\\alpha$ = {{ch15_smooth_alpha}} (of {{ch15_smooth_alphas}}, the one with the
smallest mean |Δ log p| on that text, so a choice the text itself made) gives
{{ch15_smooth_ppl}}, {{ch15_smooth_verdict}}, with a mean |Δ log p| of
{{ch15_smooth_dlogp}} against {{ch15_int8_w8a8_dlogp}}
unsmoothed and {{ch15_int8_w8a16_dlogp}} for the weights alone. The norms' weights
and up_proj's rows could carry $1/s$ for free. O's input could carry it only through
v_proj's rows, which grouped-query attention shares among a group's heads, so those
heads would have to share their scales (this what-if gives each channel its own).
That, and an int8 × int8 GEMM on tensor cores, is not built here.
""" if int8_w8a8 is not None and best_smooth is not None else ""))


# %% [markdown]
# The GEMM itself is a cuBLASLt call through nvmath-python's bindings. cuBLAS is
# column-major; as chapter 6 did, the row-major product $\text{out} = x W^\top$ is
# computed as its transpose, $\text{out}^\top = W x^\top$, which reads $W$ (N × K,
# row-major) as a K × N column-major matrix transposed and $x$ (M × K) as a K × M one
# untransposed — the "TN" layout, the only one FP8 GEMMs take. The weight's row
# scales are the A operand's outer vector, the tokens' scales the B operand's. A
# plan (descriptor, layouts, and the algorithm cuBLASLt's heuristic proposes first)
# is made once per shape and kept. Each call sets the two scale pointers and
# launches, so a CUDA graph can capture it (the workspace is the model's, not
# cuBLASLt's own). Timing more of the heuristic's candidates was tried, and the
# measurement section says why plans do not.

# %%
#| export kernels.cublaslt_fp8
import numpy as np
from numba import config, cuda

from tinyvllm_lib.kernels.checks import device_pointer, is_device_array

_STATE = {"gemm": None, "error": None}


class CublasLtFp8:
    """One cuBLASLt handle and a plan per (M, N, K, workspace): out (M, N) float32
    (= or +=) (s_x[m] s_w[n]) · Σ_k x[m, k] w[n, k], x and w e4m3 codes."""

    def __init__(self, lt=None, types=None):
        if lt is None:
            import nvmath
            from nvmath.bindings import cublas
            from nvmath.bindings import cublasLt as lt

            cuda.current_context()  # bind to numba's context
            types = {"e4m3": int(nvmath.CudaDataType.CUDA_R_8F_E4M3),
                     "f32": int(nvmath.CudaDataType.CUDA_R_32F),
                     "compute": int(cublas.ComputeType.COMPUTE_32F),
                     "outer": int(lt.MatmulMatrixScale.OUTER_VEC_32F)}
        self.lt, self.types = lt, types
        self.handle = lt.create()
        self.alpha, self.beta = np.ones(1, np.float32), np.zeros(1, np.float32)
        self.beta_add = np.ones(1, np.float32)
        self.plans = {}

    def _set(self, desc, attr, value, dtype) -> None:
        buf = np.array([value], dtype)
        self.lt.matmul_desc_set_attribute(desc, int(attr), buf.ctypes.data, buf.nbytes)

    def plan(self, M: int, N: int, K: int, workspace_bytes: int, w_scales, x_scales):
        """(desc, a, b, d, the heuristic's first algorithm) for this shape and
        workspace, made on first use (the heuristic wants the scales' pointers set;
        each call sets its own)."""
        key = (M, N, K, workspace_bytes)
        if key not in self.plans:
            lt, t, A = self.lt, self.types, self.lt.MatmulDescAttribute
            desc = lt.matmul_desc_create(t["compute"], t["f32"])
            self._set(desc, A.TRANSA, 1, np.int32)  # op(A) = T: W read as (K, N)ᵀ
            self._set(desc, A.TRANSB, 0, np.int32)
            self._set(desc, A.A_SCALE_MODE, t["outer"], np.int32)
            self._set(desc, A.B_SCALE_MODE, t["outer"], np.int32)
            self._set(desc, A.A_SCALE_POINTER, device_pointer(w_scales), np.uint64)
            self._set(desc, A.B_SCALE_POINTER, device_pointer(x_scales), np.uint64)
            a = lt.matrix_layout_create(t["e4m3"], K, N, K)
            b = lt.matrix_layout_create(t["e4m3"], K, M, K)
            d = lt.matrix_layout_create(t["f32"], N, M, N)
            pref = lt.matmul_preference_create()
            limit = np.array([workspace_bytes], np.uint64)
            lt.matmul_preference_set_attribute(
                pref, int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES),
                limit.ctypes.data, 8)
            result = lt.MatmulHeuristicResult(1)
            found = np.zeros(1, np.int32)
            lt.matmul_algo_get_heuristic(self.handle, desc, a, b, d, d, pref, 1,
                                         result.ptr, found.ctypes.data)
            lt.matmul_preference_destroy(pref)
            if found[0] == 0:
                raise RuntimeError(f"cuBLASLt has no FP8 algorithm for M={M}, N={N}, "
                                   f"K={K} with outer-vector scales on this GPU")
            # the result's first field is its algorithm: keep the struct alive
            self.plans[key] = (desc, a, b, d, result)
        return self.plans[key]

    def gemm(self, x_codes, x_scales, w_codes, w_scales, out, M: int, N: int, K: int,
             accumulate: bool, stream: int, workspace) -> None:
        ws_ptr, ws_bytes = (0, 0) if workspace is None else \
            (device_pointer(workspace), workspace.nbytes)
        desc, a, b, d, result = self.plan(M, N, K, ws_bytes, w_scales, x_scales)
        A = self.lt.MatmulDescAttribute
        self._set(desc, A.A_SCALE_POINTER, device_pointer(w_scales), np.uint64)
        self._set(desc, A.B_SCALE_POINTER, device_pointer(x_scales), np.uint64)
        self.lt.matmul(self.handle, desc, self.alpha.ctypes.data,
                       device_pointer(w_codes), a, device_pointer(x_codes), b,
                       (self.beta_add if accumulate else self.beta).ctypes.data,
                       device_pointer(out), d, device_pointer(out), d, result.ptr,
                       ws_ptr, ws_bytes, stream)


def get_cublaslt_fp8() -> CublasLtFp8 | None:
    """The process's cuBLASLt FP8 GEMM, made on first use; None in the simulator,
    without nvmath-python, or where this GPU and cuBLASLt have no FP8 GEMM with
    outer-vector scales (Hopper has; Ada and Blackwell, as of cuBLAS 13, do not)."""
    if _STATE["gemm"] is None and _STATE["error"] is None:
        if config.ENABLE_CUDASIM or not cuda.is_available():
            _STATE["error"] = "no GPU (cuBLASLt does not run in the simulator)"
        elif cuda.get_current_device().compute_capability < (8, 9):
            _STATE["error"] = "no FP8 tensor cores (compute capability below 8.9)"
        else:
            try:
                gemm = CublasLtFp8()
                ones = cuda.to_device(np.ones(16, np.float32))
                gemm.plan(16, 16, 16, 0, ones, ones)  # raises where refused
                _STATE["gemm"] = gemm
            except Exception as err:  # not installed, no libcublasLt, or refused
                _STATE["error"] = (f"{type(err).__name__}: {err} (FP8 GEMMs with "
                                   "outer-vector scales need a Hopper GPU and "
                                   "nvmath-python[cu13])")
    return _STATE["gemm"]


def fp8_gemm_unavailable_reason() -> str | None:
    get_cublaslt_fp8()
    return _STATE["error"]


def gemm_fp8(x_codes, x_scales, w_codes, w_scales, out, stream=0, workspace=None,
             accumulate: bool = False, gemm: CublasLtFp8 | None = None):
    """out (M, N) float32 (= or +=) x · wᵀ with x = s_x ⊙ x_codes (per token) and
    w = s_w ⊙ w_codes (per row), e4m3 codes (uint8), by cuBLASLt on `stream`."""
    M, K = x_codes.shape
    N = w_codes.shape[0]
    if (x_codes.dtype != np.uint8 or w_codes.dtype != np.uint8 or w_codes.shape[1] != K
            or tuple(out.shape) != (M, N) or out.dtype != np.float32
            or x_scales.shape[0] < M or w_scales.shape[0] != N or K % 16):
        raise ValueError(
            f"gemm_fp8: need x codes (M, K) and w codes (N, K) uint8 with K a multiple "
            f"of 16, out (M, N) float32; got {tuple(x_codes.shape)}, "
            f"{tuple(w_codes.shape)}, {out.dtype} {tuple(out.shape)}")
    if gemm is None:  # (a test passes a stand-in working on host buffers)
        if not all(is_device_array(a) for a in (x_codes, x_scales, w_codes, out)):
            raise TypeError("gemm_fp8: operands must be device arrays")
        gemm = get_cublaslt_fp8()
        if gemm is None:
            raise RuntimeError(f"gemm_fp8: unavailable: {_STATE['error']}")
    stream_ptr = 0 if stream is None or isinstance(stream, int) and stream == 0 \
        else int(stream)
    gemm.gemm(x_codes, x_scales, w_codes, w_scales, out, M, N, K, accumulate,
              stream_ptr, workspace)
    return out

# %% [markdown]
# ### A few tokens on bf16 tensor cores: the codes widened in registers
#
# Between one token and a prefill lies what a lightly loaded server sees: a few
# requests decoding at once, up to `MMA_8BIT_MAX_TOKENS` token vectors a step (defined
# below). The GEMV reads each weight once for
# all of them but multiplies on the SIMT cores, one fused multiply-add a code and a
# token, so its arithmetic grows with the tokens; the scratch pays its extra write and
# read of a bf16 copy whatever the tokens. There is a third way, the one vLLM's
# weight-only kernels (Marlin, machete) and TensorRT-LLM's take: feed the **bf16 tensor
# cores** of chapter 14 from registers, widening each code to bf16 on its way in — a
# *mixed-input* GEMM. Both formats widen exactly: int8's codes are the integers from
# $-128$ to $127$, all of them bf16 values (8 significant bits), and e4m3's values, 3
# bits of mantissa and magnitudes from $2^{-9}$ (its smallest subnormal) to 448, are
# all normal bf16 values. The row's scale
# multiplies the finished sum, as in the GEMV.
#
# With a few tokens the weights are the big operand, so they take the mma's A side,
# 16 rows a tile, and the tokens its B side, 8 a tile (the "swap AB" of some
# small-batch kernels; others, Marlin among them, put the tokens on A and pad them to
# 16): `mma.sync.m16n8k16` makes a 16 × 8 piece of $W X^\top$ from 16 values of k.
# Each warp covers all of its block's rows and tokens; the block's warps split K
# instead, and their sums meet in shared memory at the end. The puzzle is the
# fragments. Chapter 14 loaded
# them with `ldmatrix` from tiles in shared memory; here the codes come straight from
# global memory into registers, and a lane should use the bytes it loaded. Lane
# $(g, t)$ ($g$ = lane / 4, $t$ = lane % 4) holds, of a k-step's 16 columns, columns
# $2t, 2t{+}1, 2t{+}8, 2t{+}9$ of rows $g$ and $g{+}8$ in A, and the same four k of
# token $g$ in B. A dot product adds its terms in any order, so the kernel is free to
# *deal* k to the steps: over a chunk of 64 k, every lane with thread index $t$ loads
# codes $16t \ldots 16t{+}15$ of its two rows (two 8-byte words each) and the same 16
# inputs of its token (four words), and k-step $s$ puts its values $4s, 4s{+}1$ at
# columns $2t, 2t{+}1$ and $4s{+}2, 4s{+}3$ at $2t{+}8, 2t{+}9$. Any assignment works
# if A and B agree and every k is used once; this one needs no shuffle between lanes.
# In NumPy, with chapter 14's fragment tables: the registers each lane packs from the
# values it loaded are exactly the fragments of the dealt tiles, and the four steps'
# products add up to the chunk's:

# %%
from tinyvllm_lib.kernels.tensor_core import a_fragments, b_fragments, pack_pairs


def dealt_k(step: int, col: int) -> int:
    """The chunk's k (0..63) that k-step `step` uses as its column `col` (0..15):
    lane t = (col % 8) // 2 holds it, as its value 4 step + 2 (col // 8) + col % 2."""
    return 16 * ((col % 8) // 2) + 4 * step + 2 * (col // 8) + col % 2


deal = np.array([[dealt_k(s, c) for c in range(16)] for s in range(4)])
assert sorted(deal.ravel()) == list(range(64))  # every k once
# a chunk: 16 rows of int8 codes and 8 tokens' inputs, as bf16 bits
W16 = f32_to_bf16_bits(rng.integers(-128, 128, (16, 64)).astype(np.float32))
X8 = f32_to_bf16_bits(rng.standard_normal((8, 64)).astype(np.float32))
for s in range(4):
    want_a, want_b = a_fragments(W16[:, deal[s]]), b_fragments(X8[:, deal[s]].T)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        rows, x = W16[[g, g + 8], 16 * t : 16 * t + 16], X8[g, 16 * t : 16 * t + 16]
        v = 4 * s  # this step's four values of the sixteen the lane loaded
        packed_a = [pack_pairs(rows[h, v + p], rows[h, v + p + 1])
                    for p in (0, 2) for h in (0, 1)]  # a0..a3: (g, g+8) x (2t, 2t+8)
        packed_b = [pack_pairs(x[v + p], x[v + p + 1]) for p in (0, 2)]
        assert list(want_a[lane]) == packed_a and list(want_b[lane]) == packed_b
w_values, x_values = bf16_bits_to_f32(W16), bf16_bits_to_f32(X8)
dealt = sum(w_values[:, deal[s]].astype(np.float64) @ x_values[:, deal[s]].T
            for s in range(4))
assert np.allclose(dealt, w_values.astype(np.float64) @ x_values.T)
print("4 k-steps of 16 over a chunk of 64: every k once; each lane's registers, "
      "packed from its own 16 loaded values, are the dealt tiles' fragments")

# %% [markdown]
# The widening is the GEMV's, two codes at a time into one register of bf16 pairs:
# int8 through $2^{23}$'s float (one byte permute and one subtraction a code, then one
# permute keeps the high halves of two floats — exact, since the floats are small
# integers); e4m3 through the hardware's conversion to a float16 pair, each half to
# float32, and one instruction (`cvt.rn.bf16x2.f32`) packing the pair as bf16. A
# chunk's work for a lane, widening and mma, is C, linked into the numba kernel as
# chapter 14 linked its warp tile; the numba kernel loads the words, `ahead` chunks'
# worth before it multiplies any, and owns everything else. In the simulator a Python
# twin builds each lane's fragments the same way and calls chapter 14's mma twin, so
# the dealing is tested in CI, where no GPU runs the C.

# %%
#| export kernels.mma_8bit
import math

import numpy as np
from numba import config, cuda, float32, types, uint64

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv, device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.gemv import INLINE
from tinyvllm_lib.kernels.gemv_8bit import check_8bit_operands, check_8bit_out
from tinyvllm_lib.kernels.prefetch import PREFETCH_L2_BYTES, prefetch_rows_l2
from tinyvllm_lib.kernels.tensor_core import ffi, require_lto, twin_launch

MMA_K = 64  # k a chunk: 16 codes (two words) a lane, 4 lanes a row
MMA_8BIT_MAX_TOKENS = 16  # two n-tiles of 8 token vectors
# the bench's records say which kernel they timed; 2: the first blocks' rows
# prefetched into L2 before the wait, where PREFETCH_L2_BYTES (0 in the engine) asks
MMA_8BIT_VERSION = 2


def mma_8bit_source(method: str, m_tiles: int, n_tiles: int) -> str:
    """CUDA C for one warp's chunk of 64 k: m_tiles tiles of 16 weight rows times
    n_tiles tiles of 8 token vectors, the codes widened to bf16 in registers.

    A lane (group g = lane / 4, thread t = lane % 4) holds codes 16t .. 16t + 15 of the
    chunk of rows g and g + 8 of each m-tile (w: 4 words an m-tile) and the bf16 inputs
    16t .. 16t + 15 of token g of each n-tile (x: 4 words an n-tile). A dot product
    may add its terms in any order, so the chunk's k are dealt to the mma's k-steps in
    the order that lets each lane take its fragments from what it loaded: k-step s
    reads codes and inputs 4s .. 4s + 3 of each lane's sixteen."""
    if method == "int8":  # 2^23 + (q + 128) as a float, less 2^23 + 128: q, exactly
        widen = r"""
  unsigned b = codes ^ 0x80808080u;
  float f0 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7650)) - 8388736.0f;
  float f1 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7651)) - 8388736.0f;
  float f2 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7652)) - 8388736.0f;
  float f3 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7653)) - 8388736.0f;
  // integers from -128 to 127 are bf16 values: their floats' high halves, paired
  *p01 = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
  *p23 = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);"""
    elif method == "fp8":  # the hardware's e4m3 -> float16, then float16 -> bf16
        widen = r"""
  unsigned h[2];
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[0]) : "h"((unsigned short)codes));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[1]) : "h"((unsigned short)(codes >> 16)));
  unsigned pair[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // every e4m3 value is a bf16 value: exact
    float lo, hi;
    asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n"
        " cvt.f32.f16 %1, u;}" : "=f"(lo), "=f"(hi) : "r"(h[i]));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair[i]) : "f"(hi), "f"(lo));
  }
  *p01 = pair[0];
  *p23 = pair[1];"""
    else:
        raise ValueError(f"method must be 'int8' or 'fp8', got {method!r}")
    MT, NT = m_tiles, n_tiles
    return rf"""
// four codes -> two bf16 pairs (codes 0, 1 and 2, 3; the first of each in the low half)
static __device__ __forceinline__ void widen4_{method}(unsigned codes, unsigned* p01,
                                                      unsigned* p23) {{{widen}
}}

extern "C" __device__ void mma_{method}_m{MT}n{NT}(
    float* acc, const unsigned long long* w, const unsigned long long* x) {{
#pragma unroll
  for (int s = 0; s < 4; ++s) {{  // k-step s: codes and inputs 4s .. 4s + 3 a lane
    unsigned a[{MT}][4];
#pragma unroll
    for (int i = 0; i < {MT}; ++i) {{
      unsigned g0 = (unsigned)(w[4 * i + s / 2] >> (32 * (s % 2)));      // row g
      unsigned g8 = (unsigned)(w[4 * i + 2 + s / 2] >> (32 * (s % 2)));  // row g + 8
      widen4_{method}(g0, &a[i][0], &a[i][2]);
      widen4_{method}(g8, &a[i][1], &a[i][3]);
    }}
#pragma unroll
    for (int j = 0; j < {NT}; ++j) {{
      unsigned long long word = x[4 * j + s];
      unsigned b0 = (unsigned)word, b1 = (unsigned)(word >> 32);
#pragma unroll
      for (int i = 0; i < {MT}; ++i) {{
        float* c = acc + 4 * ({NT} * i + j);
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b0),
              "r"(b1));
      }}
    }}
  }}
}}
"""


_P = types.CPointer

if config.ENABLE_CUDASIM:
    from tinyvllm_lib.kernels.tensor_core import mma_bf16_m16n8k16, pack_pairs
    from tinyvllm_lib.kernels.widen_8bit import _E4M3_TO_F16

    def _code_bits(method: str, codes32: int) -> np.ndarray:
        """The four codes of a word (lowest byte first) as bf16 bits."""
        b = np.array([codes32], np.uint32).view(np.uint8)
        if method == "int8":
            values = b.view(np.int8).astype(np.float32)
        else:
            values = _E4M3_TO_F16[b].view(np.float16).astype(np.float32)
        return f32_to_bf16_bits(values)

    def mma_8bit_function(method: str, m_tiles: int, n_tiles: int):
        """Twin of the C function: the same fragments, the mma's twin."""

        def chunk(acc, w, x):
            for s in range(4):
                a = np.zeros((m_tiles, 4), np.uint32)
                for i in range(m_tiles):
                    for h in range(2):  # row g, row g + 8
                        word = int(w[4 * i + 2 * h + s // 2]) >> (32 * (s % 2))
                        bits = _code_bits(method, word & 0xFFFFFFFF)
                        a[i, h] = pack_pairs(bits[0], bits[1])
                        a[i, h + 2] = pack_pairs(bits[2], bits[3])
                for j in range(n_tiles):
                    word = int(x[4 * j + s])
                    b = np.array([word & 0xFFFFFFFF, word >> 32], np.uint32)
                    for i in range(m_tiles):
                        at = 4 * (n_tiles * i + j)
                        mma_bf16_m16n8k16(acc[at : at + 4], a[i], b)

        return chunk

else:
    from numba.cuda import CUSource

    def mma_8bit_function(method: str, m_tiles: int, n_tiles: int):
        """The C function of mma_8bit_source, declared for numba kernels."""
        return cuda.declare_device(
            f"mma_{method}_m{m_tiles}n{n_tiles}",
            types.void(_P(types.float32), _P(types.uint64), _P(types.uint64)),
            link=CUSource(mma_8bit_source(method, m_tiles, n_tiles)),
            abi="c",
        )

# %% [markdown]
# The kernel: a block per 16 rows of out (gate-up: a tile of gate rows and its tile of
# up rows, so SiLU·up is made where both sums meet, as the GEMV's gated epilogue
# does), eight warps taking chunks of K in turn, the warps' sums met in shared memory
# and an output a thread stored, times its row's scale. Its first weights are loaded
# before it waits for the kernel before it (chapter 11's programmatic edges), as the
# GEMV's are. The launcher takes one tile of 8 tokens up to 8 token vectors and two
# up to 16; a layer norms its input first (chapter 4's kernel), since the norm's sum
# of squares spans all of K while each warp sees a part of it.

# %%
#| export kernels.mma_8bit
def make_mma_8bit_kernel(method: str, n_tiles: int, m_tiles: int = 1, warps: int = 8,
                         ahead: int = 2, accumulate: bool = False,
                         gated: bool = False,
                         prefetch_bytes: int = PREFETCH_L2_BYTES):
    """out (M, N) = x (M, K) · (s ⊙ codes)ᵀ for up to 8 n_tiles token vectors on
    the tensor cores: a block per 16 m_tiles rows, its `warps` warps splitting K in
    chunks of 64 (`ahead` chunks' loads issued before any is multiplied), their sums
    met in shared memory. x bf16 viewed as uint64 (M, K / 4); codes as uint64
    (N, K / 8). accumulate: out += (float32 out). gated: codes stack [gate | up]
    (N = 2 I), the block's two m-tiles a gate tile and its up tile, out (M, I) bf16
    bits = SiLU(gate) · up. prefetch_bytes: as the GEMV's (the first blocks' rows
    asked of L2 before the wait)."""
    assert not (gated and (accumulate or m_tiles != 2)), "gated: 2 m-tiles, no add"
    chunk_mma = mma_8bit_function(method, m_tiles, n_tiles)
    ACC, WW, XW = 4 * m_tiles * n_tiles, 4 * m_tiles, 4 * n_tiles
    units = 16 if gated else 16 * m_tiles  # columns of out a block writes
    tokens = 8 * n_tiles
    threads = 32 * warps
    outputs = units * tokens
    WBUF, XBUF = ahead * WW, ahead * XW  # local arrays' sizes: constants
    assert threads % units == 0, "a thread stores outputs of one row"

    @cuda.jit(device=True, **INLINE)
    def load_weights(w64, wbuf, c0, chunks, n0, half, g, t):
        for u in range(ahead):
            c = c0 + u
            for i in range(m_tiles):
                for h in range(2):  # row g, row g + 8 of m-tile i
                    r = n0 + g + 8 * h
                    row = r + i * half if gated else r + 16 * i
                    ok = c < chunks and (r < half if gated else row < w64.shape[0])
                    for q in range(2):
                        wbuf[u * WW + 4 * i + 2 * h + q] = (
                            w64[row, 8 * c + 2 * t + q] if ok else uint64(0))

    @cuda.jit
    def kernel(x64, w64, scales, out):
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        M, chunks = x64.shape[0], w64.shape[1] // 8
        half = w64.shape[0] // 2  # gated: where the up rows begin
        n0 = cuda.blockIdx.x * units
        wbuf = cuda.local.array(WBUF, uint64)
        xbuf = cuda.local.array(XBUF, uint64)
        acc = cuda.local.array(ACC, float32)
        for e in range(ACC):
            acc[e] = float32(0)
        partial = cuda.shared.array((warps, ACC, 32), float32)
        c0 = warp * ahead
        # no kernel writes the weights: the first are loaded before the wait, and the
        # scales of the row this thread will store (o % units below is tid % units)
        load_weights(w64, wbuf, c0, chunks, n0, half, g, t)
        parts = 2 if gated else 1  # gated: the gate rows, then the up rows
        if prefetch_bytes and tid < parts and (cuda.blockIdx.x + 1) * parts * units * (
                w64.shape[1] * 8) <= prefetch_bytes:
            end = half if gated else w64.shape[0]
            prefetch_rows_l2(w64, n0 + tid * half, min(units, end - n0))
        mine = n0 + tid % units
        has_row = mine < (half if gated else w64.shape[0])
        scale = scales[mine] if has_row else float32(0)
        up_scale = scales[mine + half] if gated and has_row else float32(0)
        wait_for_previous_kernel()
        while c0 < chunks:
            for u in range(ahead):
                for j in range(n_tiles):
                    m = g + 8 * j
                    ok = c0 + u < chunks and m < M
                    for q in range(4):
                        xbuf[u * XW + 4 * j + q] = (
                            x64[m, 16 * (c0 + u) + 4 * t + q] if ok else uint64(0))
            for u in range(ahead):
                if c0 + u < chunks:
                    chunk_mma(ffi.from_buffer(acc), ffi.from_buffer(wbuf[u * WW:]),
                              ffi.from_buffer(xbuf[u * XW:]))
            c0 += warps * ahead
            if c0 < chunks:
                load_weights(w64, wbuf, c0, chunks, n0, half, g, t)
        for e in range(ACC):
            partial[warp, e, lane] = acc[e]
        cuda.syncthreads()
        o = tid
        while o < outputs:  # an output a thread: the warps' sums meet
            col, r = o // units, o % units  # token col; row r of the block's
            i, rr = r // 16, r % 16  # (gated: the gate tile's; the up tile is 1)
            j, cc = col // 8, col % 8
            at_lane = 4 * (rr % 8) + cc // 2
            e = 4 * (n_tiles * i + j) + 2 * (rr // 8) + cc % 2
            total, up = float32(0), float32(0)
            for v in range(warps):
                total += partial[v, e, at_lane]
                if gated:
                    up += partial[v, e + 4 * n_tiles, at_lane]
            n = n0 + r
            if col < M and n < (half if gated else w64.shape[0]):
                if gated:
                    gate = total * scale
                    up = up * up_scale
                    store_activation(out, col, n,
                                     gate / (float32(1.0) + math.exp(-gate)) * up)
                elif accumulate:
                    out[col, n] += total * scale
                else:
                    store_activation(out, col, n, total * scale)
            o += threads

    kernel.units, kernel.threads, kernel.tokens = units, threads, tokens
    kernel.reads_before_wait = True  # the first weights (tests/test_ptx.py)
    return require_lto(kernel)


# %%
#| export kernels.mma_8bit
# the launcher's kernels: (format, n-tiles, epilogue) -> kernel, each a module-level
# name so that tests/test_ptx.py compiles it
MMA_8BIT_KERNELS, PTX_SIGNATURES = {}, {}
_KINDS = {"": {}, "add": {"accumulate": True}, "gated": {"gated": True}}
# (epilogue, n-tiles) -> (m-tiles, warps, chunks ahead); gated: 2 m-tiles, a gate tile
# and its up tile
MMA_8BIT_KNOBS = {(kind, n_tiles): (2 if kind == "gated" else 1, 8, 2)
                  for kind in _KINDS for n_tiles in (1, 2)}


def mma_8bit_kernel_for(method: str, n_tiles: int, kind: str = "", knobs=None,
                        **options):
    """The launcher's kernel for (format, n-tiles, epilogue) at `knobs` (m-tiles, warps,
    chunks ahead; default MMA_8BIT_KNOBS'); options go to make_mma_8bit_kernel
    (prefetch_bytes, for the bench's runs)."""
    knobs = MMA_8BIT_KNOBS[kind, n_tiles] if knobs is None else knobs
    return make_mma_8bit_kernel(method, n_tiles, *knobs, **_KINDS[kind], **options)


for _method in ("int8", "fp8"):
    for _n_tiles in (1, 2):
        for _kind in _KINDS:
            _name = f"mma_{_method}_n{_n_tiles}{'_' * bool(_kind)}{_kind}_kernel"
            MMA_8BIT_KERNELS[_method, _n_tiles, _kind] = globals()[_name] = \
                mma_8bit_kernel_for(_method, _n_tiles, _kind)
            _out = "uint16" if _kind == "gated" else "float32"
            PTX_SIGNATURES[_name] = [
                f"void(uint64[:, ::1], uint64[:, ::1], float32[::1], {_out}[:, ::1])"]


def mma_8bit(x, codes, scales, out, method: str, stream=0, accumulate=False,
             gated: bool = False):
    """Launch: out (M, N) = x (M, K) · (scales ⊙ codes)ᵀ for M <= 16 bf16 token
    vectors on the tensor cores, K a multiple of 64; accumulate: out += instead;
    gated: codes stack [gate | up] and out (M, N / 2) bf16 bits = SiLU(gate) · up."""
    M, K = x.shape if x.ndim == 2 else (0, 0)
    check_8bit_operands("mma_8bit", method, codes, scales, K)
    N = codes.shape[0]
    if not 0 < M <= MMA_8BIT_MAX_TOKENS or K % MMA_K:
        raise ValueError(f"mma_8bit: 1 to {MMA_8BIT_MAX_TOKENS} token vectors and K a "
                         f"multiple of {MMA_K}, got M={M}, K={K}")
    if x.dtype != np.uint16 or not is_c_contiguous(x) or device_pointer(x) % 8:
        raise ValueError(f"mma_8bit: need x (M, {K}) bf16 bits, 8-byte aligned, "
                         f"C-contiguous; got {x.dtype} {tuple(x.shape)}")
    check_8bit_out("mma_8bit", out, M, N, gated)
    if accumulate and (gated or out.dtype != np.float32):
        raise ValueError("mma_8bit: accumulate adds into float32 out, not gated")
    kernel = MMA_8BIT_KERNELS[method, 1 if M <= 8 else 2,
                              "gated" if gated else "add" * accumulate]
    blocks = cdiv(N // 2 if gated else N, kernel.units)
    with twin_launch():
        kernel[blocks, kernel.threads, stream](x.view(np.uint64), codes.view(np.uint64),
                                               scales, out)
    return out

# %% [markdown]
# Against NumPy, in the simulator here (tiny shapes: rows short of a tile, one and
# two tiles of tokens) and on the GPU in `tests/test_mma_8bit.py` at the 1B's shapes
# too; and in the PTX that links the C into the kernel, the mma instructions with no
# local memory (the fragments stay in registers):

# %%
from tinyvllm_lib.kernels.activation import silu_mul_ref
from tinyvllm_lib.kernels.tensor_core import linked_ptx_counts


def check_mma_8bit(method: str, M: int, N: int = 20, K: int = 128) -> tuple:
    """mma_8bit plain and adding into out, against NumPy: the largest relative error;
    and gated's, whose out is bf16."""
    from numba import cuda

    q = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, method)
    codes, scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
    x_bits = f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    x = cuda.to_device(x_bits)
    before = rng.standard_normal((M, N)).astype(np.float32)
    plain, added = cuda.device_array((M, N), np.float32), cuda.to_device(before)
    act = cuda.device_array((M, N // 2), np.uint16)
    mma_8bit(x, codes, scales, plain, method)
    mma_8bit(x, codes, scales, added, method, accumulate=True)
    mma_8bit(x, codes, scales, act, method, gated=True)
    product = bf16_bits_to_f32(x_bits).astype(np.float64) @ q.dequantize().T
    gated = silu_mul_ref(product.astype(np.float32))
    return (max(max_rel_error(plain.copy_to_host(), product),
                max_rel_error(added.copy_to_host(), before + product)),
            max_rel_error(bf16_bits_to_f32(act.copy_to_host()), gated))


if can_launch():
    for method in ("int8", "fp8"):
        for M in (3, 11):  # one tile of tokens, and two
            error, gated_error = check_mma_8bit(method, M)
            print(f"{method}, {M} tokens: plain and adding, largest relative error "
                  f"{error:.1e}; gated (bf16 out) {gated_error:.1e}")
            assert error <= 1e-4 and gated_error <= 2.0**-8

mma_counts = linked_ptx_counts("tinyvllm_lib.kernels.mma_8bit", "mma_int8_n2_kernel")
print(f"mma_int8_n2_kernel's PTX: {mma_counts['mma.sync']} mma.sync, "
      f"{mma_counts['local memory']} local loads or stores")
assert mma_counts["mma.sync"] > 0 and mma_counts["local memory"] == 0

# %% [markdown]
# What to expect, written before the GPU ran it: the kernel reads half of bf16's
# bytes and multiplies on the same tensor cores, so at 8 tokens, where chapter 6's
# bf16 path is a cuBLAS GEMM reading its weights about once, it should take at most
# bf16's time and, if its loads keep as many bytes in flight as cuBLAS's, about
# half; at one token it widens about as many instructions a code as the GEMV, so no
# gain is expected there. The crossover below times it beside the GEMV and the
# scratch (`QuantizedLinear` takes it past `QUANTIZED_GEMV_MAX_TOKENS`, up to
# `QUANTIZED_MMA_MAX_TOKENS`).

# %% [markdown]
# ## The 8-bit model on the GPU
#
# The model's layer loop does not change. Chapter 6's `linear` and `rmsnorm_linear`
# hand the product to the weight when the weight knows how to make it — vLLM's layers
# do the same through their `quant_method` — and chapter 7's `LlamaCuda` puts each
# fused weight on the GPU through one method, `to_device`, which the 8-bit model
# overrides for the matrices it quantizes. A `QuantizedLinear` holds the codes and the
# scales on the GPU and picks its path by the number of token vectors: the 8-bit GEMV
# (with the norm inside whatever its rows: see `apply_rmsnorm`) up to
# `QUANTIZED_GEMV_MAX_TOKENS`; past it up to `QUANTIZED_MMA_MAX_TOKENS`, the bf16
# tensor cores fed from registers (`mma_8bit`, just above: the norm first, SiLU·up
# inside gate-up's kernel); else the GEMM path — the dequantized scratch and
# chapter 6's `linear`, or for FP8 with `FP8_TENSOR_CORE_GEMM` on the tensor cores
# above (`apply_fp8`, where the GPU has them). That switch is off by default (its
# reasons are in the comment beside it below).
# The GEMV's limit is where it stops beating the better of the tensor cores and a
# dequantize plus cuBLAS over a layer's products, measured on the GPU at the end of
# the chapter ("Where the GEMV stops winning"); for bf16 chapter 6 measured 1, but
# there the other side needed no dequantizing.

# %%
#| export layers.quantized_linear
import numpy as np
from numba import config, cuda

from tinyvllm_lib.kernels.activation import silu_mul
from tinyvllm_lib.kernels.checks import is_device_array
from tinyvllm_lib.kernels.cublaslt_fp8 import gemm_fp8, get_cublaslt_fp8
from tinyvllm_lib.kernels.dequantize_8bit import dequantize_to_bf16
from tinyvllm_lib.kernels.gemv_8bit import gemv_8bit, gemv_8bit_rmsnorm
from tinyvllm_lib.kernels.mma_8bit import MMA_8BIT_MAX_TOKENS, MMA_K, mma_8bit
from tinyvllm_lib.kernels.quantize_tokens import (
    can_norm_quantize,
    quantize_tokens_fp8,
    rmsnorm_quantize_fp8,
)
from tinyvllm_lib.kernels.rmsnorm import rmsnorm
from tinyvllm_lib.layers.linear import linear
from tinyvllm_lib.models.llama_quantized import takes_fp8_gemm
from tinyvllm_lib.quantization.formats import QuantizedTensor

# up to how many token vectors the 8-bit GEMV runs (beyond: the tensor cores, then the
# GEMM path): where it stops beating the better of the other two over a layer's four
# products (bench/ch15_quantization.py's crossover on an H100: against the scratch
# alone it won up to 4 tokens; against the tensor cores it ties at 2 and loses at 4;
# it was a guess, 8, then 4)
QUANTIZED_GEMV_MAX_TOKENS = 2
# the 8-bit GEMV's variant past one token: "auto" (chapter 6's rule: a warp a row
# for 1 or 2 tokens and 16,384 rows or more, else the block's warps share each group
# of rows), "warp" or "block"
QUANTIZED_GEMV_VARIANT = "auto"
# past the GEMV's tokens and up to this many, the 8-bit weights' product on the tensor
# cores (mma_8bit: the codes widened to bf16 in registers, no scratch); 0 in the
# simulator, whose twin runs each mma in Python (the tests set a weight's own limit)
QUANTIZED_MMA_MAX_TOKENS = 0 if config.ENABLE_CUDASIM else MMA_8BIT_MAX_TOKENS
# FP8 weights' GEMM path: True, cuBLASLt on FP8 tensor cores with the activations
# quantized per token (W8A8), where the GPU has them; False, the bf16 scratch, as
# int8's. Off by default: its GPU tests pass (an H100), but rounding the activations
# costs SmolLM2 more than FP8's perplexity target allows, and on the one GPU measured
# it served nano-vllm's workload below bf16 (both measured below, the engine runs with
# it set on)
FP8_TENSOR_CORE_GEMM = False
# the MLP's norm, gate-up GEMV and SiLU·up as one kernel (gemv_8bit_rmsnorm's gated
# epilogue) where the GEMV runs; False launches the normed GEMV, then silu_mul
GATED_GEMV_8BIT = True


class QuantizedLinear:
    """An 8-bit (out, in) weight on the GPU that makes its own products (what `linear`
    and `rmsnorm_linear` call): codes and float32 row scales; `scratch`, a bf16 device
    buffer of at least out * in values that a model's weights share, for the GEMM path.
    """

    def __init__(self, q: QuantizedTensor, scratch):
        self.method, self.shape = q.method, q.shape
        self.codes, self.scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
        if scratch.size < q.codes.size:
            raise ValueError(f"the scratch holds {scratch.size} values, the weight "
                             f"{q.codes.size}")
        self.scratch = scratch

    # up to how many token vectors this weight's products take the GEMV, and its
    # variant past one token; None: the module's QUANTIZED_GEMV_MAX_TOKENS and
    # QUANTIZED_GEMV_VARIANT (the benchmark sets them to time each path and variant)
    gemv_max_tokens: int | None = None
    gemv_variant: str | None = None
    mma_max_tokens: int | None = None  # the same for QUANTIZED_MMA_MAX_TOKENS

    def __len__(self) -> int:  # rows, as a weight's device array has
        return self.shape[0]

    def uses_gemv(self, x) -> bool:
        most = self.gemv_max_tokens
        return x.shape[0] <= (QUANTIZED_GEMV_MAX_TOKENS if most is None else most)

    def uses_mma(self, x) -> bool:
        most = self.mma_max_tokens
        most = QUANTIZED_MMA_MAX_TOKENS if most is None else most
        return (x.shape[0] <= min(most, MMA_8BIT_MAX_TOKENS)
                and self.shape[1] % MMA_K == 0)

    def variant_for(self, x) -> str:
        """The 8-bit GEMV's variant for x's token vectors: the launcher's own ("auto")
        at one token, QUANTIZED_GEMV_VARIANT (or this weight's) past it."""
        if x.shape[0] == 1:
            return "auto"
        mine = self.gemv_variant
        return QUANTIZED_GEMV_VARIANT if mine is None else mine

    def gemm_path(self, x) -> str:
        """How x's product is made: "gemv" (the 8-bit GEMV), "mma" (bf16 tensor cores,
        the codes widened in registers), "fp8" (FP8 tensor cores, the activations
        quantized per token) or "scratch" (dequantize, then bf16)."""
        if self.uses_gemv(x):
            return "gemv"
        if self.uses_mma(x):
            return "mma"
        if (self.method == "fp8" and FP8_TENSOR_CORE_GEMM and takes_fp8_gemm(self.shape)
                and self.fp8_chunk_rows(self.shape[1]) >= 16
                and get_cublaslt_fp8() is not None):
            return "fp8"
        return "scratch"

    def fp8_chunk_rows(self, K: int) -> int:
        """How many token vectors' codes (K each) and scales the scratch holds at
        once, a multiple of 16."""
        return (2 * self.scratch.size - 256) // (K + 4) // 16 * 16

    def fp8_operands(self, rows: int, K: int):
        """Room in the scratch for `rows` token vectors' e4m3 codes (rows, K) and
        their float32 scales (at a 256-byte boundary)."""
        room = self.scratch.view(np.uint8)
        start = (rows * K + 255) // 256 * 256
        return (room[: rows * K].reshape(rows, K),
                room[start : start + 4 * rows].view(np.float32))

    def apply_fp8(self, x, out, stream=0, workspace=None, accumulate=False):
        """out (= or +=) x · Wᵀ on FP8 tensor cores: each token vector's e4m3 codes
        and scale in the scratch (free on this path), as many tokens at a time as it
        holds."""
        M, K = x.shape
        rows = min(M, self.fp8_chunk_rows(K))  # gemm_path saw to at least 16
        codes, scales = self.fp8_operands(rows, K)
        for s in range(0, M, rows):
            e = min(M, s + rows)
            quantize_tokens_fp8(x[s:e], codes[: e - s], scales, stream)
            gemm_fp8(codes[: e - s], scales, self.codes, self.scales, out[s:e],
                     stream, workspace, accumulate)
        return out

    def dequantized(self, stream=0):
        """The weight as bf16 bits in the scratch (valid until the next weight's)."""
        N, K = self.shape
        w = self.scratch[: N * K].reshape(N, K)
        return dequantize_to_bf16(self.codes, self.scales, w, self.method, stream)

    def apply(self, x, out, *, stream=0, workspace=None, accumulate=False):
        """out (= or +=) x · Wᵀ, x bf16 bits (num_tokens, in) on the GPU."""
        if not (is_device_array(x) and is_device_array(out)):
            raise TypeError("QuantizedLinear: x and out must be device arrays")
        path = self.gemm_path(x)
        if path == "gemv":
            return gemv_8bit(x, self.codes, self.scales, out, self.method, stream,
                             accumulate, self.variant_for(x))
        if path == "mma":
            return mma_8bit(x, self.codes, self.scales, out, self.method, stream,
                            accumulate)
        if path == "fp8":
            return self.apply_fp8(x, out, stream, workspace, accumulate)
        return linear(x, self.dequantized(stream), out, stream=stream,
                      workspace=workspace, accumulate=accumulate)

    def apply_rmsnorm(self, residual, norm_weight, eps, out, normed, *, stream=0,
                      workspace=None):
        """out = RMSNorm(residual) · Wᵀ: one kernel where the GEMV runs, whatever
        its rows — gate-up's 16,384 too, where GATED_GEMV_8BIT is off (its blocks, no
        more than the GPU holds, each norm the input once as they stage it, where
        chapter 6's bf16 GEMV norms it in every warp and so keeps 16,384 rows and
        more apart); on FP8's tensor-core path the norm and the tokens' quantizer
        in one kernel (`normed` untouched); else the norm into `normed`, then apply.
        """
        if self.uses_gemv(normed):
            return gemv_8bit_rmsnorm(residual, norm_weight, eps, self.codes,
                                     self.scales, out, self.method, stream,
                                     self.variant_for(normed))
        M, K = normed.shape
        if self.gemm_path(normed) == "fp8" and M <= self.fp8_chunk_rows(K):
            codes, scales = self.fp8_operands(M, K)
            if can_norm_quantize(residual, norm_weight, codes):  # one kernel, no bf16
                rmsnorm_quantize_fp8(residual, norm_weight, eps, codes, scales, stream)
                return gemm_fp8(codes, scales, self.codes, self.scales, out, stream,
                                workspace)
        rmsnorm(residual, norm_weight, eps, normed, stream=stream)
        return self.apply(normed, out, stream=stream, workspace=workspace)

    def apply_rmsnorm_silu_mul(self, residual, norm_weight, eps, act, gate_up, normed,
                               *, stream=0, workspace=None):
        """act = SiLU(gate) * up for W = [gate | up] (chapter 7's
        rmsnorm_linear_silu_mul): one kernel, the norm and SiLU inside the GEMV,
        where the GEMV runs and GATED_GEMV_8BIT says so; on the tensor-core path the
        norm into `normed`, then the product with SiLU·up inside; else apply_rmsnorm
        into gate_up, then silu_mul.
        """
        if self.uses_gemv(normed) and GATED_GEMV_8BIT:
            return gemv_8bit_rmsnorm(residual, norm_weight, eps, self.codes,
                                     self.scales, act, self.method, stream,
                                     self.variant_for(normed), gated=True)
        if self.gemm_path(normed) == "mma":
            rmsnorm(residual, norm_weight, eps, normed, stream=stream)
            return mma_8bit(normed, self.codes, self.scales, act, self.method, stream,
                            gated=True)
        self.apply_rmsnorm(residual, norm_weight, eps, gate_up, normed, stream=stream,
                           workspace=workspace)
        return silu_mul(gate_up, act, stream=stream)

# %% [markdown]
# `QuantizedLlamaCuda` is chapter 7's model with that one method overridden. It checks
# first that every matrix's input size is a multiple of 8 (the GEMV's words), and
# makes the one scratch buffer, as large as the largest quantized matrix (for Llama
# 3.2 1B with the head in bf16, `gate_up_proj`'s 16,384 × 2,048: 64 MiB). With
# `quantize_lm_head` the head becomes an 8-bit copy of the tied table, and the
# embedding's lookups keep reading the bf16 one.

# %%
#| export models.llama_cuda_quantized
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.cublaslt_fp8 import get_cublaslt_fp8
from tinyvllm_lib.layers.quantized_linear import FP8_TENSOR_CORE_GEMM, QuantizedLinear
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_cuda import LlamaCuda
from tinyvllm_lib.models.llama_quantized import (
    QUANTIZE_LM_HEAD,
    is_quantized,
    quantized_shapes,
    quantized_tensor,
    stored_scales,
)
from tinyvllm_lib.quantization.formats import check_quantization


def check_quantizable(config: ModelConfig, lm_head: bool = QUANTIZE_LM_HEAD) -> None:
    """ValueError unless the 8-bit GEMV can take every quantized matrix: an input size
    (in) that is a multiple of 8.
    """
    bad = [f"{name} has {k} inputs" for name, (_, k) in
           quantized_shapes(config, lm_head).items() if k % 8]
    if bad:
        raise ValueError(
            "8-bit weights on the GPU need every quantized matrix's input size to be "
            f"a multiple of 8 (the GEMV reads 8 codes a word): {', '.join(bad)}")


class QuantizedLlamaCuda(LlamaCuda):
    """Chapter 7's GPU model with its layers' matrices (and, with quantize_lm_head,
    its LM head) in 8 bits: codes and row scales on the GPU, each a QuantizedLinear;
    the codes chosen as QuantizedLlamaNumpy's (tensors, the weights' own, or rounded
    to nearest as they load).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 quantization: str, quantize_lm_head: bool = QUANTIZE_LM_HEAD,
                 comm=None, tensors: dict | None = None):
        if check_quantization(quantization) is None:
            raise ValueError("QuantizedLlamaCuda needs quantization 'int8' or 'fp8'")
        check_quantizable(config, quantize_lm_head)
        self.quantization, self.quantize_lm_head = quantization, quantize_lm_head
        shapes = quantized_shapes(config, quantize_lm_head)
        if "lm_head" in shapes:  # a rank's head: its rows of the vocabulary (ch. 13)
            head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
            shapes["lm_head"] = (len(head), shapes["lm_head"][1])
        largest = max(n * k for n, k in shapes.values())
        self.scratch = cuda.device_array(largest, np.uint16)  # the GEMM path's bf16
        if quantization == "fp8" and FP8_TENSOR_CORE_GEMM:
            get_cublaslt_fp8()  # its handle now, not inside a CUDA graph's capture
        self._given = (stored_scales(weights, config), tensors or {})  # while loading
        super().__init__(config, weights, comm=comm)
        head = self.weights["lm_head"]
        if quantize_lm_head and not isinstance(head, QuantizedLinear):  # tied
            q = quantized_tensor("lm_head", head.copy_to_host(), quantization,
                                 *self._given)
            self.weights["lm_head"] = QuantizedLinear(q, self.scratch)
        del self._given

    def to_device(self, name: str, bits: np.ndarray):
        if not is_quantized(name, self.quantize_lm_head):
            return super().to_device(name, bits)
        q = quantized_tensor(name, bits, self.quantization, *self._given)
        return QuantizedLinear(q, self.scratch)

# %% [markdown]
# ## What halving the matrices' bytes predicts
#
# Count before measuring. Chapter 11 measured the bf16 engine's decode step at batch 1
# and the GPU's time for it alone (its graph replayed back to back). Split that step
# into the weights' read at the ceiling, which shrinks with the bytes, and the rest —
# attention, the norms, the sampler, launches, and whatever the GEMVs lose to the
# ceiling — which, as a first guess, does not. At batch 256 (the throughput workload)
# the 8-bit model's projections take the GEMM path, and each first writes its weight
# to the bf16 scratch: three more bytes a weight (one read, two written) before cuBLAS
# reads the same two bytes a bf16 model's GEMM reads.

# %%
ch11 = {(r["name"], r["shape"][0]): r for r in load_records("ch11_llama")}
bytes_8 = decode_weight_bytes(llama_1b, "int8")
if ("bs1_decode", 1) in ch11:
    step_s = 1 / ch11["bs1_decode", 1]["value"]
    rest_s = step_s - bf16_bytes / (GB_S * 1e9)  # what does not shrink with the bytes
    predicted_bs1 = 1 / (rest_s + bytes_8 / (GB_S * 1e9))
    replay_256 = ch11["graph_replay", 256]["value"] / 1e3  # a decode step of 256
    # the scratch: each layer's four matrices, 8-bit read and bf16 written, each step
    matrix_weights = llama_1b.num_hidden_layers * sum(
        n * k for n, k in quantized_shapes(llama_1b, False).values())
    extra_s = 3 * matrix_weights / (GB_S * 1e9)
    tput_256 = ch11["throughput", 256]["value"]
    predicted_256 = tput_256 * replay_256 / (replay_256 + extra_s)
    print(f"batch 1: bf16 step {step_s * 1e3:.3f} ms measured, of which "
          f"{rest_s * 1e3:.3f} ms is not the weights' read;\n    8-bit predicted "
          f"{1e3 / predicted_bs1:.3f} ms: {predicted_bs1:,.0f} tok/s")
    print(f"batch 256: a step {replay_256 * 1e3:.2f} ms; the scratch adds at least "
          f"{extra_s * 1e3:.2f} ms:\n    throughput {tput_256:,.0f} -> "
          f"{predicted_256:,.0f} tok/s")
    prose.glue("ch15_rest_ms", f"{rest_s * 1e3:.2f} ms")
    prose.glue("ch15_step_ms", f"{step_s * 1e3:.2f} ms")
    prose.glue("ch15_pred_bs1", f"{predicted_bs1:,.0f} tok/s")
    prose.glue("ch15_pred_vs_limit", (
        f"past the bf16 limit of {bf16_limit:,.0f} tok/s" if predicted_bs1 > bf16_limit
        else f"faster than chapter 11's {1 / step_s:,.0f} tok/s but short of the "
        f"bf16 limit itself, {bf16_limit:,.0f} tok/s"))
    prose.glue("ch15_pred_share", f"{predicted_bs1 / limits['8-bit, head bf16']:.0%}")
    prose.glue("ch15_rest_share", f"{rest_s * predicted_bs1:.0%}")
    prose.glue("ch15_extra_ms", f"{extra_s * 1e3:.2f} ms")
    prose.glue("ch15_step_256_ms", f"{replay_256 * 1e3:.2f} ms")
    prose.glue("ch15_tp_bf16", f"{ch11['throughput', 256]['value']:,.0f} tok/s")
    prose.glue("ch15_pred_256", f"{predicted_256:,.0f} tok/s")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if ("bs1_decode", 1) in ch11:
    prose.show("""
Chapter 11's bf16 step took {{ch15_step_ms}}, of which {{ch15_rest_ms}} is not the
weights' read at the ceiling. If that part stays, reading 8-bit weights predicts
**{{ch15_pred_bs1}}** at batch 1 — {{ch15_pred_vs_limit}}, and {{ch15_pred_share}} of
the 8-bit limit of {{ch15_limit_8bit_head_bf16}}: once the matrices are half their
bytes, the rest of the step is {{ch15_rest_share}} of it, and it is the next thing to
shrink. Passing the bf16
limit, as this chapter's target asks, needs that part smaller too (the GEMVs closer
to the ceiling, fewer kernels a layer), or the GPU will show that some of it does
shrink with the bytes (the GEMVs' distance from the ceiling may).

At batch 256 a step took {{ch15_step_256_ms}}; int8's scratch adds at least
{{ch15_extra_ms}} to it, which predicts {{ch15_pred_256}} against bf16's
{{ch15_tp_bf16}}: with that GEMM path — prefill, and every step of more than
`QUANTIZED_MMA_MAX_TOKENS` tokens — **int8 weights cost throughput**. Reading the
codes inside the GEMM's tiles, with no scratch, would remove the cost (`mma_8bit`
does it for up to that many tokens; a tiled GEMM for hundreds is not built here);
until then an engine serving many requests at once in int8 pays it.
FP8's GEMM path has no scratch: its products read half of bf16's weight bytes on
tensor cores of twice the rate, so it should cost less than bf16's, not more — the
measurement at the end of the chapter says how much.
""")

# %% [markdown]
# ## On the H200: one command
#
# Everything above ran on a CPU or in the simulator; speed needs the GPU. The benchmark
# script loads the Llama 3.2 1B stand-in three times — bf16, int8, FP8 — and records
# decode at batch 1 (the median of three runs) against each one's limit, the time to
# first token of a 128-token prompt (the 8-bit prefill's scratch is in it), nano-vllm's
# throughput workload, each format's GEMV alone on every decode shape, in GB/s of the
# bytes it reads against the ceiling, and the drift of the 8-bit models' log-probs from
# bf16's on a random prompt, beside bf16's own drift from float32 (and each kernel
# model's from its NumPy reference: the kernels checked at full size). This page plots
# the records once they exist:
#
# ```bash
# python bench/ch15_quantization.py --only gemv    # then drift, then engine
# ```
#
# or, for one answer,
#
# ```bash
# python -m tinyvllm_lib generate "What is the capital of France?" --chat \
#     --model llama-3.2-1b-standin --device cuda --quantization fp8
# ```

# %%
# the engine runs with the LM head in 8 bits (--lm-head) are the head section's, at
# the end; every other reader takes the engine's default, the head in bf16
# the runs made with the library's L2 prefetch (or from before it had one): the
# bench's --prefetch-l2-mib runs at other settings are for the comparison below
LIBRARY_PREFETCH_MIB = PREFETCH_L2_BYTES >> 20
gpu_all = [r for r in load_records("ch15_quantization")
           if r.get("quantization") is None  # bf16 has no 8-bit kernel to prefetch
           or r.get("prefetch_l2_mib", LIBRARY_PREFETCH_MIB) == LIBRARY_PREFETCH_MIB]
gpu = [r for r in gpu_all if not r.get("lm_head_8bit")]
METHODS, COLORS = (None, "int8", "fp8"), {None: "#7f7f7f", "int8": "#1f77b4",
                                          "fp8": "#ff7f0e"}
# a layer's GEMVs as the 8-bit engine launched them up to version 4 (from version 5,
# GATED_GEMV_8BIT puts gate-up's norm and SiLU·up inside its GEMV: gemv_rmsnorm_gated)
ENGINE_GEMVS = {"qkv_proj": "gemv_rmsnorm", "o_proj": "gemv", "gate_up_proj": "gemv",
                "down_proj": "gemv"}


def runs_of(version: int) -> dict:
    """(name, quantization[, layer]) -> record, for one version of the 8-bit GEMV."""
    mine = [r for r in gpu if r.get("gemv_8bit_version", 1) == version]
    return {(r["name"], r["quantization"]) + ((r["layer"],) if "layer" in r else ()): r
            for r in mine}


versions = {v: runs_of(v) for v in range(1, GEMV_8BIT_VERSION + 1)}
versions = {v: runs for v, runs in versions.items()
            if ("bs1_decode", "int8") in runs or ("gemv", "int8", "qkv_proj") in runs}
if not versions:
    print("not yet recorded on a GPU: run python bench/ch15_quantization.py on one")
else:
    fig, (ax_bs1, ax_gemv) = new_figure(1, 2, width=9.5, height=3.4)
    width = 0.8 / len(versions)
    # the newest version with an engine run: its bars solid, earlier ones hatched
    engine_newest = max((v for v, runs in versions.items()
                         if ("bs1_decode", "int8") in runs), default=0)
    for i, (version, runs) in enumerate(versions.items()):
        shown = [m for m in METHODS if ("bs1_decode", m) in runs]
        xs = [METHODS.index(m) + (i - (len(versions) - 1) / 2) * width for m in shown]
        old = version < engine_newest
        ax_bs1.bar(xs, [runs["bs1_decode", m]["value"] for m in shown], width,
                   color=[COLORS[m] for m in shown], alpha=0.45 if old else 1,
                   hatch="//" if old else None, edgecolor="white")
        ax_bs1.scatter(xs, [runs["bs1_decode", m]["ceiling"] for m in shown],
                       marker="_", s=300, color="k",
                       label="its limit" if i == 0 else None)
        for m in METHODS if version == max(versions) else METHODS[1:]:  # bf16: once
            layers = [k[2] for k in runs if k[:2] == ("gemv", m)]
            old = version < max(versions)
            shares = [100 * runs["gemv", m, layer]["ratio"] for layer in layers]
            ax_gemv.plot(layers, shares, "o" + (":" if old else "-"), color=COLORS[m],
                         alpha=min(1.0, 0.2 + 0.8 * version / max(versions)),
                         label=f"{m}, GEMV v{version}" if m else "bf16")
    ax_bs1.set_xticks(range(3), ["bf16", "int8", "fp8"])
    ax_bs1.set_ylabel("decode tok/s, batch 1")
    ax_bs1.set_title("hatched: earlier 8-bit GEMVs, left to right", fontsize=9)
    ax_bs1.legend(loc="upper left")
    ax_gemv.set_ylabel("GEMV: % of the bandwidth ceiling")
    ax_gemv.tick_params(axis="x", labelsize=8)
    ax_gemv.legend(fontsize=7, loc="upper left")
    plt.show()
    for version, runs in versions.items():
        device = next(iter(runs.values()))["device"]["name"]
        for m in METHODS:
            if ("bs1_decode", m) not in runs:
                continue
            bs1_run, t = runs["bs1_decode", m], runs.get(("throughput", m))
            print(f"{device}, GEMV v{version}: {m or 'bf16':>5} bs1 "
                  f"{bs1_run['value']:,.0f} tok/s (limit {bs1_run['ceiling']:,.0f})"
                  + (f"; throughput {t['value']:,.0f} tok/s" if t else ""))
    drift = [r for r in gpu if r["name"] == "drift"]
    for r in drift:
        print(f"{r['pair']:>28}: mean |Δ log p| {r['value']:.4f} over the top 5")
    if not drift:
        print("drift of the 8-bit models' log-probs: not yet recorded on a GPU "
              "(bench/ch15_quantization.py --only drift)")

# %% [markdown]
# The first version's records say where its time went, and what the second one could
# buy. A layer of the 8-bit engine launches four GEMVs at batch 1 (QKV's with its norm
# fused in); the prediction below assumes that each 8-bit GEMV of the second version
# reaches the share of the ceiling that the bf16 GEMV reaches at the same shape — an
# upper bound, since a short kernel's fixed costs do not halve with its bytes — and
# that the rest of the step stays. The two formats' predictions differ only through
# that rest, as each format's first-version run measured it.

# %%
first = versions.get(1, {})
if ("bs1_decode", "int8") in first:
    def layer_us(runs: dict, method: str) -> float:
        return sum(runs[kind, method, layer]["us"]
                   for layer, kind in ENGINE_GEMVS.items())

    predicted = {}
    for m in ("int8", "fp8"):
        bf16_gemv = {layer: first["gemv", None, layer] for layer in ENGINE_GEMVS}
        at_bf16_share = sum(  # µs
            first["gemv", m, layer]["bytes"] / 1e3
            / (bf16_gemv[layer]["ratio"] * bf16_gemv[layer]["ceiling"])
            for layer in ENGINE_GEMVS)
        step_us = 1e6 / first["bs1_decode", m]["value"]
        layers_1b = llama_1b.num_hidden_layers
        saved = layers_1b * (layer_us(first, m) - at_bf16_share)
        predicted[m] = 1e6 / (step_us - saved)
        print(f"{m}: GEMVs {layer_us(first, m):.1f} µs a layer -> "
              f"{at_bf16_share:.1f} at bf16's shares; step {step_us:.0f} -> "
              f"{step_us - saved:.0f} µs: {predicted[m]:,.0f} tok/s")
    plain = [first["gemv", m, layer]["ratio"] for m in ("int8", "fp8")
             for layer in ENGINE_GEMVS]
    prose.glue("ch15_v1_int8", f"{first['bs1_decode', 'int8']['value']:,.0f} tok/s")
    prose.glue("ch15_v1_fp8", f"{first['bs1_decode', 'fp8']['value']:,.0f} tok/s")
    prose.glue("ch15_v1_bf16", f"{first['bs1_decode', None]['value']:,.0f} tok/s")
    bf16_v1 = first["bs1_decode", None]["value"]
    faster_v1 = [m for m in ("int8", "fp8")
                 if first["bs1_decode", m]["value"] > bf16_v1]
    prose.glue("ch15_v1_vs_bf16", "and both slower" if not faster_v1 else
               f"and only {' and '.join(faster_v1)} faster")
    prose.glue("ch15_v1_gemv_range", f"{min(plain):.0%} to {max(plain):.0%}")
    prose.glue("ch15_v2_pred_int8", f"{predicted['int8']:,.0f} tok/s")
    prose.glue("ch15_v2_pred_fp8", f"{predicted['fp8']:,.0f} tok/s")
    prose.glue("ch15_v1_tp", f"{first['throughput', 'int8']['value']:,.0f} and "
               f"{first['throughput', 'fp8']['value']:,.0f} tok/s")
    prose.glue("ch15_v1_tp_bf16", f"{first['throughput', None]['value']:,.0f} tok/s")

second = versions.get(2, {})
if ("bs1_decode", "int8") in second:
    now = [second["gemv", m, layer]["ratio"] for m in ("int8", "fp8")
           for layer in ENGINE_GEMVS]
    best = max(("int8", "fp8"), key=lambda m: second["bs1_decode", m]["value"])
    bf16_now = second["bs1_decode", None]["value"]
    prose.glue("ch15_v2_int8", f"{second['bs1_decode', 'int8']['value']:,.0f} tok/s")
    prose.glue("ch15_v2_fp8", f"{second['bs1_decode', 'fp8']['value']:,.0f} tok/s")
    prose.glue("ch15_v2_bf16", f"{bf16_now:,.0f} tok/s")
    prose.glue("ch15_v2_gemv_range", f"{min(now):.0%} to {max(now):.0%}")
    ratio = second["bs1_decode", best]["value"] / bf16_now
    prose.glue("ch15_v2_verdict", (
        f"{best} is now {ratio - 1:.0%} faster than bf16" if ratio > 1 else
        f"even {best}, the faster, is still {1 - ratio:.0%} slower than bf16"))
    plain_layer = {m: sum(second["gemv", m, layer]["us"] for layer in ENGINE_GEMVS)
                   for m in METHODS}
    prose.glue("ch15_v2_layer_int8", f"{plain_layer['int8']:.1f} µs")
    prose.glue("ch15_v2_layer_bf16", f"{plain_layer[None]:.1f} µs")
    o_int8 = second["gemv", "int8", "o_proj"]
    prose.glue("ch15_v2_o_us", f"{o_int8['us']:.1f} µs")
    o_ideal_us = o_int8["bytes"] / o_int8["ceiling"] / 1e3
    prose.glue("ch15_v2_o_ideal", f"{o_ideal_us:.1f} µs")
    prose.glue("ch15_v2_o_bf16", f"{second['gemv', None, 'o_proj']['us']:.1f} µs")
    bf16_line = second["bs1_decode", None]["ceiling"]  # the limit to pass
    fastest = max(second["bs1_decode", m]["value"] for m in ("int8", "fp8"))
    prose.glue("ch15_v2_target", (
        f"{'passes' if fastest > bf16_line else 'stays short of'} the bf16 limit of "
        f"{bf16_line:,.0f} tok/s that this chapter set out to pass"))
    share = second["bs1_decode", "int8"]["value"] / predicted["int8"]
    prose.glue("ch15_v2_vs_pred", f"Int8 reached {share:.0%} of its prediction" + (
        ", because the premise failed:" if share < 0.9 else ";"))
    bf16_now = [second["gemv", None, layer]["ratio"] for layer in ENGINE_GEMVS]
    prose.glue("ch15_v2_bf16_range", f"{min(bf16_now):.0%} to {max(bf16_now):.0%}")
    layer_bytes = {m: sum(second["gemv", m, layer]["bytes"] for layer in ENGINE_GEMVS)
                   for m in METHODS}
    rate_share = (layer_bytes["int8"] / plain_layer["int8"]) / (
        layer_bytes[None] / plain_layer[None])
    prose.glue("ch15_v2_rate_share", f"{rate_share:.0%}")

last = max(versions, default=0)
newest = versions[last] if last > 2 else {}
# the newest version the engine ran with (the batch-1 bars)
last_run = max((v for v, runs in versions.items() if ("bs1_decode", "int8") in runs),
               default=0)
if ("bs1_decode", "int8") in newest:
    bf16_new = newest["bs1_decode", None]["value"]
    for m in ("int8", "fp8"):
        prose.glue(f"ch15_new_{m}", f"{newest['bs1_decode', m]['value']:,.0f} tok/s")
        speedup = newest["bs1_decode", m]["value"] / bf16_new
        prose.glue(f"ch15_new_{m}_x", f"{speedup:.2f}")
    prose.glue("ch15_new_version", f"{last}")
    prose.glue("ch15_new_which", "the kernel above" if last == GEMV_8BIT_VERSION else
               f"the kernel above as it was before version {GEMV_8BIT_VERSION} "
               "(not yet recorded on this GPU)")
    prose.glue("ch15_new_bf16", f"{bf16_new:,.0f} tok/s")
    prose.glue("ch15_new_limit", f"{newest['bs1_decode', None]['ceiling']:,.0f} tok/s")
    new_ratio = [newest["gemv", m, layer]["ratio"] for m in ("int8", "fp8")
                 for layer in ENGINE_GEMVS if ("gemv", m, layer) in newest]
    prose.glue("ch15_new_gemv_range", f"{min(new_ratio):.0%} to {max(new_ratio):.0%}"
               if new_ratio else "not yet timed at this version")
    head = {m: newest.get(("gemv_rmsnorm", m, "lm_head")) for m in ("int8", "fp8")}
    head_rates = " and ".join(f"{head[m]['ratio']:.0%} ({m})" for m in head if head[m])
    prose.glue("ch15_new_head", "; the norm-fused 8-bit GEMV on the LM head's shape "
               "(a bf16 matrix in the engine unless quantize_lm_head) at " + head_rates
               if all(head.values()) else "")
    fastest_new = max(newest["bs1_decode", m]["value"] for m in ("int8", "fp8"))
    prose.glue("ch15_new_target", (
        "passes" if fastest_new > newest["bs1_decode", None]["ceiling"]
        else "stays short of"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if ("bs1_decode", "int8") in first:
    prose.show("""
**The first 8-bit GEMV** ran int8 at {{ch15_v1_int8}} and FP8 at {{ch15_v1_fp8}} at
batch 1, against bf16's {{ch15_v1_bf16}} in the same run: half the bytes,
{{ch15_v1_vs_bf16}}.
Its GEMVs read at {{ch15_v1_gemv_range}} of the ceiling, and the variant with the norm
fused in — the same bytes, twice the arithmetic a code — ran at {{ch15_v1_norm_range}}
of the plain one's speed: {{ch15_v1_bound}}. Had the
second version reached bf16's share of the ceiling at each shape, batch 1 would have
run at **{{ch15_v2_pred_int8}}** in int8 and **{{ch15_v2_pred_fp8}}** in FP8 (the
prediction, written before the second version ran).
""")
if ("bs1_decode", "int8") in second:
    prose.show("""
**The second** runs int8 at **{{ch15_v2_int8}}** and FP8 at **{{ch15_v2_fp8}}**,
against bf16's {{ch15_v2_bf16}} in the same run: {{ch15_v2_verdict}}; the faster
{{ch15_v2_target}}. {{ch15_v2_vs_pred}} its GEMVs of a layer's four shapes read at
{{ch15_v2_gemv_range}} of the ceiling, bf16's at {{ch15_v2_bf16_range}}. The plain
GEMVs of those four shapes take {{ch15_v2_layer_int8}} in int8 against
{{ch15_v2_layer_bf16}} in bf16 — half the bytes, read at {{ch15_v2_rate_share}} of
bf16's rate. The short ones show why: O's projection takes {{ch15_v2_o_us}} in int8
({{ch15_v2_o_bf16}} in bf16, for twice the bytes), where its bytes at the ceiling
would take {{ch15_v2_o_ideal}}; a kernel that short is mostly its start, its first
loads' latency and its tail, none of which halves with the bytes. The long ones still
issued several integer instructions a code — what the third and fourth versions,
above, took out.
""")
if ("bs1_decode", "int8") in newest:
    prose.show("""
**Version {{ch15_new_version}}**, {{ch15_new_which}}, runs int8 at **{{ch15_new_int8}}**
({{ch15_new_int8_x}}× bf16) and FP8 at **{{ch15_new_fp8}}** ({{ch15_new_fp8_x}}×),
against bf16's {{ch15_new_bf16}} in the same run; the faster {{ch15_new_target}} the
bf16 limit of {{ch15_new_limit}}. Its GEMVs of a layer read at
{{ch15_new_gemv_range}} of the ceiling{{ch15_new_head}}.
""")
elif versions:
    prose.glue("ch15_gemv_only", ", ".join(str(v) for v in versions if v > last_run))
    prose.glue("ch15_code_version", f"{GEMV_8BIT_VERSION}")
    prose.show("""
Version {{ch15_gemv_only}} of the GEMV has GEMV records (the figure's newest lines) but
has not yet run through the engine on a GPU; the code above is version
{{ch15_code_version}}.
""")
if ("throughput", "int8") in first:
    prose.show("""
At batch 256 the projections take the GEMM path with its scratch, which neither
version of the GEMV touches: {{ch15_v1_tp}} for int8 and FP8 against bf16's
{{ch15_v1_tp_bf16}}, the cost the prediction above counted.
""")

# %% [markdown]
# **One token's knobs (version 6).** Chapter 6's knobs came from bf16, whose rows are
# twice as many words: with the block's 8 warps sharing 4 rows, each thread of an
# 8-bit GEMV widens one word of each row at the model's 2,048 inputs (a bf16 thread,
# two), so a block does half a bf16 block's work for the same start, the same staging
# and the same sums to meet. The sweep part of the benchmark script times each setting
# below on a layer's four shapes at one token, each with the epilogue the engine
# launches there (QKV's norm, gate-up's norm and SiLU·up, O's and down's residual add)
# and as many blocks as the launcher gives. The launcher's knobs are the filled
# markers — `ONE_TOKEN_BLOCK_KNOBS` where the block variant runs, chapter 6's warp a
# (gate, up) pair of rows for gate-up's 16,384 — and version 5's the rings. Where this
# GPU has no sweep yet, the page draws an H100's (`book/data/h100/`, with that
# commit's batch-1 figures), the GPU the knobs were chosen on.

# %%
sweep = [r for r in gpu if r["name"] == "gemv_sweep" and r["shape"][0] == 1]
h100_all = [r for r in load_records("ch15_quantization", DATA_DIR / "h100")
            if r.get("quantization") is None
            or r.get("prefetch_l2_mib", LIBRARY_PREFETCH_MIB) == LIBRARY_PREFETCH_MIB]
h100 = [r for r in h100_all if not r.get("lm_head_8bit")]
if not sweep:  # an H100's, until this GPU has one
    sweep = [r for r in h100 if r["name"] == "gemv_sweep" and r["shape"][0] == 1]


def version5_knobs(r: dict) -> tuple:
    """What version 5 launched at one token for a sweep record's shape and epilogue:
    chapter 6's knobs for the variant the launcher picks there."""
    return chapter6_knobs(gemv_variant(1, r["shape"][1]), 1, "gated" in r["kind"])


def knobs_of(r: dict) -> tuple:
    return r["warps_per_row"], r["rows"], r["unroll"]


if not sweep:
    print("the sweep is not yet recorded on a GPU: python bench/ch15_quantization.py "
          "--only sweep")
else:  # the newest version's sweep, of one GPU
    sweep_version = max(r["gemv_8bit_version"] for r in sweep)
    sweep_device = sweep[-1]["device"]["name"]
    sweep = [r for r in sweep if r["gemv_8bit_version"] == sweep_version
             and r["device"]["name"] == sweep_device]
    sweep_layers = list(dict.fromkeys(r["layer"] for r in sweep))
    sweep_methods = [m for m in ("int8", "fp8") if any(r["quantization"] == m
                                                       for r in sweep)]
    layer_us = {m: {"chosen": 0.0, "v5": 0.0, "best": 0.0} for m in sweep_methods}
    margins = []  # (how much slower the runner-up is, the shape, the format)
    table = {}  # (shape, format) -> {knobs: µs}
    fig, ax = new_figure(width=8, height=3.2)
    for j, m in enumerate(sweep_methods):
        for i, layer in enumerate(sweep_layers):
            rs = sorted((r for r in sweep if r["layer"] == layer
                         and r["quantization"] == m), key=lambda r: r["us"])
            table[layer, m] = {knobs_of(r): r["us"] for r in rs}
            chosen = next(r for r in rs if r["chosen"])
            old = next(r for r in rs if knobs_of(r) == version5_knobs(r))
            x = i + (j - 0.5) * 0.3
            ax.scatter([x] * len(rs), [r["us"] for r in rs], s=12, color="#bbbbbb",
                       label="the other settings" if i == j == 0 else None)
            ax.scatter([x], [chosen["us"]], s=45, color=COLORS[m],
                       label=f"{m}: the launcher's" if i == 0 else None)
            ax.scatter([x], [old["us"]], s=90, facecolors="none", edgecolors=COLORS[m],
                       label=f"{m}: version 5's" if i == 0 else None)
            layer_us[m]["chosen"] += chosen["us"]
            layer_us[m]["v5"] += old["us"]
            layer_us[m]["best"] += rs[0]["us"]
            if rs[0] is chosen and len(rs) > 1:
                margins.append((rs[1]["us"] / chosen["us"] - 1, layer, m))
    ax.set_xticks(range(len(sweep_layers)), sweep_layers)
    ax.set_ylabel("µs, one token")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"{sweep_device}: each setting of (warps a row, rows, words ahead)",
                 fontsize=9)
    plt.show()
    settings = sorted({k for row in table.values() for k in row})
    print("µs at one token; columns: (warps a row, rows, words ahead)")
    print(f"{'':>18}" + "".join(f"{str(k):>12}" for k in settings))
    for (layer, m), row in table.items():
        print(f"{layer + ' ' + m:>18}" + "".join(
            f"{row[k]:12.2f}" if k in row else f"{'':>12}" for k in settings))
    prose.glue("ch15_sweep_device", sweep_device)
    # that device's engine run of the same version, if any
    same = [r for r in gpu + h100 if r["name"] == "bs1_decode"
            and r.get("gemv_8bit_version") == sweep_version
            and r["device"]["name"] == sweep_device]
    bs1_v6 = {r["quantization"]: r["value"] for r in same}
    if {None, "int8", "fp8"} <= set(bs1_v6):
        prose.glue("ch15_sweep_bs1", f"{bs1_v6['int8']:,.0f} tok/s in int8 and "
                   f"{bs1_v6['fp8']:,.0f} in FP8 against bf16's {bs1_v6[None]:,.0f}")
    # the kernel above (a later version, the same knobs) on that GPU, if it has run
    now = [r for r in gpu + h100 if r["name"] == "bs1_decode"
           and r.get("gemv_8bit_version") == GEMV_8BIT_VERSION > sweep_version
           and r["device"]["name"] == sweep_device]
    bs1_now = {r["quantization"]: r for r in now}
    has_now = {None, "int8", "fp8"} <= set(bs1_now)
    if has_now:
        v = {k: f"{bs1_now[k]['value']:,.0f}" for k in ("int8", "fp8", None)}
        prose.glue("ch15_sweep_now", f"version {GEMV_8BIT_VERSION}, the kernel above, "
                   f"with the same knobs (commit {bs1_now['int8'].get('engine_commit')}"
                   f"): {v['int8']} tok/s in int8, {v['fp8']} in FP8 and {v[None]} in "
                   "bf16, in a run of its own")
    for m in sweep_methods:
        for what, us in layer_us[m].items():
            prose.glue(f"ch15_sweep_{what}_{m}", f"{us:.1f} µs")
    if len(margins) == len(table):  # the launcher's is the fastest everywhere
        closest = min(margins)
        prose.glue("ch15_sweep_best", "on every shape the launcher's setting is the "
                   f"sweep's fastest, the closest runner-up {closest[0]:.0%} slower "
                   f"({closest[1]}, {closest[2]}; one run of each)")
    else:
        prose.glue("ch15_sweep_best", "the best setting of each shape alone would "
                   "take " + " and ".join(f"{layer_us[m]['best']:.1f} µs ({m})"
                                          for m in sweep_methods))
    rows_8bit = ONE_TOKEN_BLOCK_KNOBS["add"][1]
    rows_bf16 = GEMV_VARIANTS["block"](1)[1]
    prose.glue("ch15_sweep_rows", f"{rows_8bit} rows of codes reads the bytes a bf16 "
               f"block reads with {rows_bf16}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if sweep and sweep_methods == ["int8", "fp8"]:
    prose.show("""
On the {{ch15_sweep_device}}, a layer's four GEMVs take {{ch15_sweep_chosen_int8}} in
int8 with the launcher's knobs against {{ch15_sweep_v5_int8}} with version 5's
({{ch15_sweep_chosen_fp8}} against {{ch15_sweep_v5_fp8}} in FP8); {{ch15_sweep_best}}.
A block of {{ch15_sweep_rows}}.""" + ("""
With these knobs the engine on that GPU, at the same commit, decodes at batch 1 at
{{ch15_sweep_bs1}}.""" if {None, "int8", "fp8"} <= set(bs1_v6) else "") + ("""
Then {{ch15_sweep_now}}.""" if has_now else "") + "\n")

# %% [markdown]
# **The GEMM path on FP8 tensor cores.** The benchmark's gemm part times each
# layer's product past the tensor cores' tokens as the engine makes it: bf16 through
# cuBLAS, int8 through its dequantized scratch, FP8 through the tokens' quantizer and
# cuBLASLt — and cuBLASLt alone on codes made beforehand, to show what the quantizer
# costs. Before the run, the prediction: at 256 tokens a layer's bf16 products are
# about as much reading as multiplying, so FP8, with half the bytes and twice the
# tensor cores' rate, should take a little over half bf16's time, less the
# quantizer's launch; int8's scratch should take bf16's time plus the scratch's
# three bytes a weight. The engine records beside them say what this buys
# nano-vllm's workload and the first token of a 128-token prompt, each with the
# bf16 engine of the same run. Where this GPU has no record yet, an H100's is drawn,
# named as such.
#
# The first run (on an H100, commit 295aa83, its records in `book/data/h100`) missed
# that prediction: FP8 took longer than bf16 for a layer's four products. Two changes
# came of it, each with its own prediction. The norm and the quantizer became one
# kernel for the two products that read a norm (QKV and gate-up), which saves two of
# the quantizer's launches a layer; and a cuBLASLt plan was made to time 8 of the
# heuristic's algorithms on its first run and keep the fastest, which should bring
# O's product, where cuBLASLt's first choice was slower than bf16's cuBLAS, down to
# bf16's time. Together they should bring a layer's four products to at most bf16's
# time. The benchmark now times QKV and gate-up with their norm, in bf16 too, as the
# layer loop runs them.

# %%
def newest_run(records: list[dict], name: str) -> list[dict]:
    """The records called `name` of the newest commit (and device) that made any."""
    mine = [r for r in records if r["name"] == name]
    if not mine:
        return []
    key = (mine[-1].get("engine_commit"), mine[-1]["device"]["name"])
    return [r for r in mine if (r.get("engine_commit"), r["device"]["name"]) == key]


gemm_runs = newest_run(gpu, "gemm") or newest_run(h100, "gemm")
GEMM_STYLES = {"bf16 cuBLAS": ("#7f7f7f", "-"), "scratch": ("#1f77b4", "-"),
               "fp8": ("#ff7f0e", "-"), "fp8 cuBLASLt alone": ("#ff7f0e", ":")}
GEMM_LABELS = {"bf16 cuBLAS": "bf16, cuBLAS", "scratch": "int8, dequantized scratch",
               "fp8": "FP8: quantizer + cuBLASLt",
               "fp8 cuBLASLt alone": "FP8: cuBLASLt alone"}
if not gemm_runs:
    print("the GEMM path is not yet recorded on a GPU: "
          "python bench/ch15_quantization.py --only gemm")
else:
    gemm_device = gemm_runs[0]["device"]["name"]
    gemm_layers = list(dict.fromkeys(r["layer"] for r in gemm_runs))
    fig, axes = new_figure(1, len(gemm_layers), width=10, height=3.0)
    for ax, layer in zip(axes, gemm_layers):
        for path, (color, style) in GEMM_STYLES.items():
            rs = sorted((r for r in gemm_runs
                         if r["layer"] == layer and r["path"] == path
                         and (path != "scratch" or r["quantization"] == "int8")),
                        key=lambda r: r["shape"][0])
            if rs:
                ax.plot([r["shape"][0] for r in rs], [r["us"] for r in rs], "o" + style,
                        color=color, ms=3, label=GEMM_LABELS[path])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        N, K = next(r["shape"][1:] for r in gemm_runs if r["layer"] == layer)
        ax.set_title(f"{layer} ({N} × {K})", fontsize=9)
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("µs")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{gemm_device}: a layer's products past the GEMV", fontsize=9)
    plt.show()
    at = {(r["layer"], r["path"], r["quantization"], r["shape"][0]): r
          for r in gemm_runs}
    M_256 = 256 if any(k[3] == 256 for k in at) else max(k[3] for k in at)
    layer_256 = {}
    for path, m in (("bf16 cuBLAS", None), ("scratch", "int8"), ("fp8", "fp8"),
                    ("fp8 cuBLASLt alone", "fp8")):
        us = [at[layer, path, m, M_256]["us"] for layer in gemm_layers
              if (layer, path, m, M_256) in at]
        if len(us) == len(gemm_layers):
            layer_256[path] = sum(us)
            print(f"{GEMM_LABELS[path]:>28}: a layer's four products at {M_256} tokens "
                  f"{sum(us):.1f} µs")
    prose.glue("ch15_gemm_device", gemm_device)
    prose.glue("ch15_gemm_tokens", f"{M_256}")
    for path, key in (("bf16 cuBLAS", "bf16"), ("scratch", "int8"), ("fp8", "fp8"),
                      ("fp8 cuBLASLt alone", "lt")):
        if path in layer_256:
            prose.glue(f"ch15_gemm_{key}", f"{layer_256[path]:.1f} µs")
    for layer in ("gate_up_proj", "o_proj"):
        for path, m, key in (("bf16 cuBLAS", None, "bf16"), ("fp8", "fp8", "fp8"),
                             ("fp8 cuBLASLt alone", "fp8", "lt")):
            if (layer, path, m, M_256) in at:
                prose.glue(f"ch15_gemm_{layer}_{key}",
                           f"{at[layer, path, m, M_256]['us']:.1f} µs")
    o_lt, o_bf16 = (at.get(("o_proj", p, m, M_256), {}).get("us")
                    for p, m in (("fp8 cuBLASLt alone", "fp8"), ("bf16 cuBLAS", None)))
    if o_lt and o_bf16:
        prose.glue("ch15_gemm_o_verdict", "longer than" if o_lt > o_bf16 else
                   "no longer than")
    gu_fp8, gu_bf16 = (at.get(("gate_up_proj", p, m, M_256), {}).get("us")
                       for p, m in (("fp8", "fp8"), ("bf16 cuBLAS", None)))
    if gu_fp8 and gu_bf16:
        prose.glue("ch15_gemm_gate_up_cmp", "against" if gu_fp8 < gu_bf16
                   else "no less than")
    fp8_us = {lay: at[lay, "fp8", "fp8", M_256]["us"] for lay in gemm_layers
              if (lay, "fp8", "fp8", M_256) in at}
    bf16_us = {lay: at[lay, "bf16 cuBLAS", None, M_256]["us"] for lay in gemm_layers
               if (lay, "bf16 cuBLAS", None, M_256) in at}
    won = [lay for lay in fp8_us if lay in bf16_us and fp8_us[lay] < bf16_us[lay]]
    prose.glue("ch15_gemm_won", (
        "no product beat bf16's" if not won else
        f"only {' and '.join(won)} beat bf16's" if len(won) < len(gemm_layers)
        else "every product beat bf16's"))
    if {"fp8", "bf16 cuBLAS"} <= set(layer_256):
        prose.glue("ch15_gemm_fp8_share",
                   f"{layer_256['fp8'] / layer_256['bf16 cuBLAS']:.0%}")
    gemm_normed = any(r.get("with_norm") for r in gemm_runs)  # the later benchmark
    gemm_tuned = next((r["tune_candidates"] for r in gemm_runs
                       if r.get("tune_candidates", 1) > 1), None)
    if gemm_tuned:
        prose.glue("ch15_gemm_tuned", f"{gemm_tuned}")
    # the run that timed the heuristic's candidates (one, on an H100) against the
    # newest that did not, on the same GPU
    tuned_runs = [r for r in h100 + gpu if r["name"] == "gemm"
                  and r.get("tune_candidates", 1) > 1
                  and r["device"]["name"] == gemm_device]
    untuned = {(r["layer"], r["path"], r["shape"][0]): r["us"] for r in gemm_runs
               if r.get("tune_candidates", 1) == 1}
    o_pair = [(r["us"], untuned[r["layer"], r["path"], r["shape"][0]])
              for r in tuned_runs if r["layer"] == "o_proj"
              and r["path"] == "fp8 cuBLASLt alone" and r["shape"][0] == M_256
              and ("o_proj", "fp8 cuBLASLt alone", M_256) in untuned]
    if o_pair:
        prose.glue("ch15_gemm_tune_o",
                   f"{o_pair[0][0]:.1f} µs with {tuned_runs[0]['tune_candidates']} "
                   f"candidates timed, {o_pair[0][1]:.1f} µs with the first alone")
        prose.glue("ch15_gemm_tune_found", (
            "found a faster algorithm than its first choice"
            if o_pair[0][0] < 0.97 * o_pair[0][1]
            else "found nothing faster than its first choice"))
    if {"fp8", "bf16 cuBLAS"} <= set(layer_256):
        prose.glue("ch15_gemm_second", (
            "held" if layer_256["fp8"] <= layer_256["bf16 cuBLAS"] else "missed too"))

    # the engine: nano-vllm's workload and the first token, FP8 on tensor cores
    # against bf16 of the same run (the same commit and GPU)
    def engine_pair(name: str) -> dict:
        tagged = [r for r in gpu + h100 if r["name"] == name
                  and r.get("gemm_path", "").startswith("fp8 tensor cores")]
        if not tagged:
            return {}
        key = (tagged[-1].get("engine_commit"), tagged[-1]["device"]["name"])
        same = [r for r in gpu + h100 if r["name"] == name
                and (r.get("engine_commit"), r["device"]["name"]) == key]
        return {r["quantization"]: r for r in same}

    tput, ttft = engine_pair("throughput"), engine_pair("bs1_ttft")
    for what, pair, unit in (("tput", tput, "tok/s"), ("ttft", ttft, "ms")):
        if {None, "fp8"} <= set(pair):
            fmt = "{:,.0f} " if unit == "tok/s" else "{:.2f} "
            prose.glue(f"ch15_fp8tc_{what}", fmt.format(pair["fp8"]["value"]) + unit)
            prose.glue(f"ch15_fp8tc_{what}_bf16",
                       fmt.format(pair[None]["value"]) + unit)
            prose.glue(f"ch15_fp8tc_{what}_device", pair["fp8"]["device"]["name"])
            print(f"{what}: FP8 on tensor cores {pair['fp8']['value']:,.2f} {unit}, "
                  f"bf16 {pair[None]['value']:,.2f} ({pair['fp8']['device']['name']}, "
                  f"commit {pair['fp8'].get('engine_commit')})")
    tuned_commit = {r.get("engine_commit") for r in tuned_runs}
    tuned_tput = {r["quantization"]: r["value"] for r in h100 + gpu
                  if r["name"] == "throughput" and r["device"]["name"] == gemm_device
                  and r.get("engine_commit") in tuned_commit}
    if {None, "fp8"} <= set(tuned_tput):
        prose.glue("ch15_tune_tput", f"{tuned_tput['fp8']:,.0f} tok/s against bf16's "
                   f"{tuned_tput[None]:,.0f}")
    if {None, "fp8"} <= set(tuned_tput) and {None, "fp8"} <= set(tput):
        kept = tuned_tput["fp8"] / tuned_tput[None]
        prose.glue("ch15_tune_tput_verdict", (
            "charged nano-vllm's workload for the timing, one per new prefill length"
            if kept < tput["fp8"]["value"] / tput[None]["value"]
            else "did not slow nano-vllm's workload"))
    slower = {None, "fp8"} <= set(tput) and tput["fp8"]["value"] < tput[None]["value"]
    prose.glue("ch15_gemm_switch", "it is now on by default" if FP8_TENSOR_CORE_GEMM
               else "it stays off by default: " + (
                   "on this workload it is still slower than bf16's, and " if slower
                   else "") + "rounding the activations costs the accuracy measured "
               "above")
    if {None, "fp8"} <= set(tput):
        ratio = tput["fp8"]["value"] / tput[None]["value"]
        prose.glue("ch15_fp8tc_tput_verdict", (
            f"{ratio - 1:.0%} more than bf16's" if ratio > 1.005 else
            f"{1 - ratio:.0%} less than bf16's" if ratio < 0.995
            else "bf16's, within 1%"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if gemm_runs and {"fp8", "bf16 cuBLAS", "scratch"} <= set(layer_256):
    prose.show("""
On the {{ch15_gemm_device}}, a layer's four products at {{ch15_gemm_tokens}} tokens
take {{ch15_gemm_bf16}} in bf16, {{ch15_gemm_int8}} through int8's scratch and
{{ch15_gemm_fp8}} on FP8 tensor cores with the quantizer
({{ch15_gemm_fp8_share}} of bf16's; cuBLASLt alone {{ch15_gemm_lt}}).""" + ("""
QKV's and gate-up's times include the norm before them, in every format; FP8's
path folds its quantizer into that norm.""" if gemm_normed else """
That run timed the products alone, before the norm and the quantizer became one
kernel.""") + ("""
On nano-vllm's workload the FP8 engine served {{ch15_fp8tc_tput}}
({{ch15_fp8tc_tput_device}}), {{ch15_fp8tc_tput_verdict}} {{ch15_fp8tc_tput_bf16}}
in the same run.""" if "fp8" in tput and None in tput else "") + ("""
Its first token after a 128-token prompt took {{ch15_fp8tc_ttft}} against bf16's
{{ch15_fp8tc_ttft_bf16}}.""" if "fp8" in ttft and None in ttft else "") + """

Against the prediction ({{ch15_gemm_won}}): gate-up took
{{ch15_gemm_gate_up_proj_fp8}}, {{ch15_gemm_gate_up_cmp}} bf16's
{{ch15_gemm_gate_up_proj_bf16}}.""" + ("""
The second prediction, at most bf16's time for the four, {{ch15_gemm_second}}:
folding the quantizer into the norm took its launch off QKV and gate-up; timing the
heuristic's candidates {{ch15_gemm_tune_found}} (O's product {{ch15_gemm_tune_o}})
and {{ch15_tune_tput_verdict}} ({{ch15_tune_tput}} in that run), so a plan takes the
first choice.""" if
    gemm_normed and o_pair and {None, "fp8"} <= set(tuned_tput) and {None, "fp8"}
    <= set(tput) else "") + ("""
With each plan timing {{ch15_gemm_tuned}} of the heuristic's algorithms, cuBLASLt
alone took {{ch15_gemm_o_proj_lt}} for O's product, which bf16 made in
{{ch15_gemm_o_proj_bf16}}; with the quantizer's launch before it (O's input comes
from attention, not a norm) {{ch15_gemm_o_proj_fp8}}.""" if gemm_tuned else """ On
O's narrow product cuBLASLt's first choice of algorithm took
{{ch15_gemm_o_proj_lt}}, {{ch15_gemm_o_verdict}} bf16's {{ch15_gemm_o_proj_bf16}}
(few tiles for the GPU's SMs is a guess), and the quantizer's launch is a kernel
bf16 does not need ({{ch15_gemm_o_proj_fp8}} with it).""") + """
These runs set `FP8_TENSOR_CORE_GEMM` on; {{ch15_gemm_switch}}.
""")

# %% [markdown]
# ### Where the GEMV stops winning
#
# `QUANTIZED_GEMV_MAX_TOKENS` decides, for every step of more than one token vector,
# which path a product takes. It began as a guess. The GEMV reads each weight once
# for all its token vectors, so it should win while its arithmetic keeps up; the
# scratch pays its three bytes a weight whatever the tokens. The benchmark's
# crossover part times each layer's product on both paths exactly as the layer loop
# makes it (QKV with its norm, O and down adding into the residual, gate-up with its
# norm and SiLU·up), from 1 to 16 tokens, beside bf16's own path (chapter 6's GEMV at
# one token, cuBLAS past it), and the GEMV past one token both in the variant its
# launcher picks and with a warp a row; its small_batch part decodes 2 to 16 requests
# at once through the engine at a few settings of the limit and the variant, bf16
# beside them. The tensor-core kernel of the section before the model's paths runs
# in both, its knobs swept first (`--mma-knobs best` takes the sweep's fastest; the
# records say which knobs they ran with):
#
# ```bash
# python bench/ch15_quantization.py --only mma_sweep --formats int8
# python bench/ch15_quantization.py --only crossover --mma-knobs best
# python bench/ch15_quantization.py --only small_batch --mma-knobs best
# ```

# %%
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter


def gemv_wins_up_to_8bit(records: list[dict], variant: str = "auto") -> int | None:
    """From one run's crossover records: the largest M such that the 8-bit GEMV (in
    `variant` past one token) beat the scratch for every layer and format at every
    measured token count up to M (0 if not even at 1; None if unmeasured)."""
    at = {(r["layer"], r["quantization"], r["path"], r["shape"][0]): r["value"]
          for r in records if r["quantization"] and (
              r["path"] != "gemv" or r["shape"][0] == 1
              or r.get("gemv_variant", "auto") == variant)}
    counts = sorted({k[3] for k in at})
    best = None if not counts else 0
    for M in counts:
        pairs = [(at[k], at.get((k[0], k[1], "scratch", M))) for k in at
                 if k[2] == "gemv" and k[3] == M]
        if not pairs or any(s is None or g >= s for g, s in pairs):
            break
        best = M
    return best


def variant_of(r: dict) -> str | None:
    """A record's GEMV variant past one token ("auto" where a run did not say)."""
    return r.get("gemv_variant", "auto") if r["path"] == "gemv" else None


cross_runs = newest_run(gpu, "crossover") or newest_run(h100, "crossover")
cross_formats = sorted({r["quantization"] for r in cross_runs if r["quantization"]})
# the small batches on the crossover's GPU: every setting's newest run there
batch_runs = [r for r in gpu + h100 if r["name"] == "small_batch_decode"
              and cross_runs and r["device"]["name"] == cross_runs[0]["device"]["name"]]
cross_ready = cross_slow = False
FIRST_GUESS = 8  # QUANTIZED_GEMV_MAX_TOKENS before the crossover was measured
PREVIOUS_GEMV_MAX_TOKENS = 4  # the limit before the tensor-core kernel
if "int8" not in cross_formats:
    print("the crossover is not yet recorded on a GPU for int8: "
          "python bench/ch15_quantization.py --only crossover")
else:
    cross_device = cross_runs[0]["device"]["name"]
    cross = {(r["layer"], r["quantization"], r["path"], r["shape"][0], variant_of(r)):
             r["value"] for r in cross_runs}
    cross_layers = list(dict.fromkeys(r["layer"] for r in cross_runs))
    cross_tokens = sorted({r["shape"][0] for r in cross_runs})
    has_warp = any(k[4] == "warp" for k in cross)
    lines = {(None, "bf16", None): ("#7f7f7f", "-", "bf16"),
             ("int8", "gemv", "auto"): ("#1f77b4", "-", "int8, 8-bit GEMV"),
             ("int8", "gemv", "warp"): ("#2ca02c", "--",
                                        "int8, 8-bit GEMV, a warp a row"),
             ("int8", "scratch", None): ("#1f77b4", ":", "int8, scratch + cuBLAS"),
             ("int8", "mma", None): ("#d62728", "-", "int8, bf16 tensor cores")}
    fig, axes = new_figure(1, len(cross_layers), width=10, height=2.9)
    for ax, layer in zip(axes, cross_layers):
        for (m, path, variant), (color, style, label) in lines.items():
            # one token: the launcher's own knobs, whichever variant is asked for
            ms = [M for M in cross_tokens if (layer, m, path, M, variant) in cross
                  or (variant == "warp" and M == 1 and has_warp)]
            ys = [cross.get((layer, m, path, M, variant),
                            cross.get((layer, m, path, M, "auto"))) for M in ms]
            if ms:
                ax.plot(ms, ys, "o" + style, ms=3, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())  # 10, 20, 50: not 10^1
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(cross_tokens, [str(M) for M in cross_tokens], fontsize=7)
        ax.set_title(layer, fontsize=9)
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("µs, as the layer loop makes it")
    axes[1].legend(fontsize=6, loc="upper left")
    fig.suptitle(f"{cross_device}: the 8-bit GEMV, the dequantized scratch and "
                 "the tensor cores", fontsize=9)
    plt.show()
    wins = {v: gemv_wins_up_to_8bit(cross_runs, v)
            for v in (("auto", "warp") if has_warp else ("auto",))}
    engine_wins = wins.get(QUANTIZED_GEMV_VARIANT)
    print(f"the 8-bit GEMV beats the scratch on every layer up to: {wins} tokens; "
          f"QUANTIZED_GEMV_MAX_TOKENS = {QUANTIZED_GEMV_MAX_TOKENS}, "
          f"QUANTIZED_GEMV_VARIANT = {QUANTIZED_GEMV_VARIANT!r}")
    prose.glue("ch15_cross_device", cross_device)
    prose.glue("ch15_cross_wins", f"{wins['auto']}")
    prose.glue("ch15_cross_formats", "both formats" if len(cross_formats) == 2
               else f"{cross_formats[0]} (the one format that run timed)")
    prose.glue("ch15_cross_limit", f"{QUANTIZED_GEMV_MAX_TOKENS}")
    prose.glue("ch15_cross_variant", "a warp a row" if QUANTIZED_GEMV_VARIANT ==
               "warp" else "the launcher's own choice of variant")
    prose.glue("ch15_cross_agree", (
        "the same" if engine_wins == QUANTIZED_GEMV_MAX_TOKENS else
        "not measured for that variant" if engine_wins is None else
        f"not the same: the records say {engine_wins}"))
    M8 = 8 if 8 in cross_tokens else cross_tokens[-1]
    prose.glue("ch15_cross_m8", f"{M8}")
    gu = {v: cross.get(("gate_up_proj", "int8", "gemv", M8, v)) for v in wins}
    gu1 = cross.get(("gate_up_proj", "int8", "gemv", 1, "auto"))
    if gu1 and gu["auto"]:
        prose.glue("ch15_cross_gu1", f"{gu1:.1f} µs")
        prose.glue("ch15_cross_gu8", f"{gu['auto']:.1f} µs")
        prose.glue("ch15_cross_gu_ratio", f"{gu['auto'] / gu1:.0f}")
    def cross_layer_sum(m, path, variant, M) -> float | None:
        """A layer's four products on one path at M tokens (None: not all timed)."""
        us = [cross.get((layer, m, path, M, variant)) for layer in cross_layers]
        return None if None in us else sum(us)

    for m, path, variant, key in (("int8", "gemv", "auto", "gemv"),
                                  ("int8", "gemv", "warp", "warp"),
                                  ("int8", "scratch", None, "scratch"),
                                  ("int8", "mma", None, "mma"),
                                  (None, "bf16", None, "bf16")):
        if (us := cross_layer_sum(m, path, variant, M8)) is not None:
            prose.glue(f"ch15_cross_layer_{key}", f"{us:.1f} µs")
    # the tensor cores: a layer's four products against bf16's and the best 8-bit
    # path's at each token count (the GEMV at one token, else the faster of it and
    # the scratch)
    mma_at = {M: (cross_layer_sum("int8", "mma", None, M),
                  cross_layer_sum(None, "bf16", None, M),
                  min(u for u in (cross_layer_sum("int8", "gemv", "auto", M),
                                  cross_layer_sum("int8", "scratch", None, M))
                      if u is not None))
              for M in cross_tokens if cross_layer_sum("int8", "mma", None, M)}
    prose.glue("ch15_mma_limit", f"{MMA_8BIT_MAX_TOKENS}")
    if mma_at:
        print("a layer's four products, µs (tensor cores, bf16, the better of the "
              "GEMV and the scratch):",
              {M: tuple(round(u, 1) for u in v) for M, v in mma_at.items()})
        below_bf16 = [M for M, (mma, bf16, _) in mma_at.items() if mma < bf16]
        beats_old = [M for M, (mma, _, old) in mma_at.items() if mma < old]
        # the GEMV against the better of the other two, a layer's four products
        gemv_best = 0
        for M in sorted(mma_at):
            gemv_sum = cross_layer_sum("int8", "gemv", "auto", M)
            others = [u for u in (mma_at[M][0],
                                  cross_layer_sum("int8", "scratch", None, M)) if u]
            if gemv_sum is None or gemv_sum > min(others):
                break
            gemv_best = M
        prose.glue("ch15_gemv_best", f"{gemv_best}")
        if 2 in mma_at and cross_layer_sum("int8", "gemv", "auto", 2):
            prose.glue("ch15_gemv_at2",
                       f"{cross_layer_sum('int8', 'gemv', 'auto', 2):.1f} µs")
            prose.glue("ch15_mma_at2", f"{mma_at[2][0]:.1f} µs")
        prose.glue("ch15_gemv_best_s", "" if gemv_best == 1 else "s")
        prose.glue("ch15_gemv_agree", (
            "as the records say" if gemv_best == QUANTIZED_GEMV_MAX_TOKENS else
            f"the records say {gemv_best}"))
        prose.glue("ch15_mma_below_bf16", (
            "at every token count measured" if len(below_bf16) == len(mma_at) else
            "at none of the token counts measured" if not below_bf16 else
            "at " + ", ".join(map(str, below_bf16)) + " tokens"))
        prose.glue("ch15_mma_beats_old", (
            "at every token count measured" if len(beats_old) == len(mma_at) else
            "at none" if not beats_old else
            "from " + str(min(beats_old)) + " tokens"
            if beats_old == [M for M in mma_at if M >= min(beats_old)] else
            "at " + ", ".join(map(str, beats_old)) + " tokens"))
        # the knob sweep on the same GPU: the launcher's table against the fastest
        sweep_runs = [r for r in newest_run(gpu + h100, "mma_sweep")
                      if r["device"]["name"] == cross_device]
        sweep_cells = {}
        for r in sweep_runs:
            sweep_cells.setdefault((r["layer"], r["tokens"]), []).append(r)
        sweep_gaps = []
        for (layer, T), rs in sweep_cells.items():
            fastest = min(rs, key=lambda r: r["us"])
            table = MMA_8BIT_KNOBS[rs[0]["kind"], 1 if T <= 8 else 2]
            mine = [r for r in rs if (r["m_tiles"], r["warps"], r["ahead"]) == table]
            if mine:
                sweep_gaps.append(mine[0]["us"] / fastest["us"] - 1)
                print(f"  {layer}, {T} tokens: the table's knobs {table} "
                      f"{mine[0]['us']:.1f} µs; the fastest "
                      f"{(fastest['m_tiles'], fastest['warps'], fastest['ahead'])} "
                      f"{fastest['us']:.1f} µs")
        if sweep_gaps:
            prose.glue("ch15_mma_sweep_gap", f"{max(sweep_gaps):.0%}")
            prose.glue("ch15_mma_sweep_n", f"{len(sweep_runs)}")
        if M8 in mma_at:
            for layer, key in (("gate_up_proj", "gu"), ("down_proj", "down")):
                mine = cross.get((layer, "int8", "mma", M8, None))
                theirs = cross.get((layer, None, "bf16", M8, None))
                if mine and theirs:
                    prose.glue(f"ch15_mma_{key}_ratio", f"{mine / theirs:.0%}")
            down = [r for r in cross_runs if r["layer"] == "down_proj"
                    and r["path"] == "mma"][0]
            down_k = down["shape"][2]
            # the knobs the run had (its records say: --mma-knobs), else the table's
            tile = f"add/{1 if M8 <= 8 else 2}"
            _, down_warps, down_ahead = (down.get("mma_knobs", {}).get(tile)
                                         or MMA_8BIT_KNOBS["add", 1 if M8 <= 8 else 2])
            down_chunks = down_k // MMA_K // down_warps
            prose.glue("ch15_mma_down_k", f"{down_k:,}")
            prose.glue("ch15_mma_down_chunks", f"{down_chunks}")
            prose.glue("ch15_mma_down_trips", f"{-(-down_chunks // down_ahead)}")
            ratios = {key: cross.get((layer, "int8", "mma", M8, None))
                      / cross.get((layer, None, "bf16", M8, None))
                      for layer, key in (("gate_up_proj", "gu"), ("down_proj", "down"))
                      if f"ch15_mma_{key}_ratio" in prose.values}
            if len(ratios) == 2:  # down's side of the sentence, from its ratio
                prose.glue("ch15_mma_down_clause", (
                    "but down takes {}, slower than bf16. Reading the kernel, not a "
                    "profile, points at down's {} inputs: they give each warp {} "
                    "chunks, fetched in {} round trips to memory one after another"
                    if ratios["down"] > 1 else
                    "and down {}, though its {} inputs give each warp {} chunks, "
                    "fetched in {} round trips to memory one after another").format(
                        prose.values["ch15_mma_down_ratio"],
                        prose.values["ch15_mma_down_k"],
                        prose.values["ch15_mma_down_chunks"],
                        prose.values["ch15_mma_down_trips"]))
            prose.glue("ch15_mma_half", (
                "about half of bf16's time, as hoped"
                if mma_at[M8][0] <= 0.6 * mma_at[M8][1] else
                "below bf16's time but well short of half of it"
                if mma_at[M8][0] < mma_at[M8][1] else
                "no faster than bf16: the prediction missed"))
    if has_warp and gu.get("warp"):
        prose.glue("ch15_cross_gu8_warp", f"{gu['warp']:.1f} µs")
        prose.glue("ch15_cross_wins_warp", f"{wins['warp']}")
        gu_wins = gemv_wins_up_to_8bit([r for r in cross_runs
                                        if r["layer"] == "gate_up_proj"], "warp")
        prose.glue("ch15_cross_gu_wins_warp", f"{gu_wins}")
    cross_ready = all(f"ch15_cross_{k}" in prose.values for k in
                      ("gu1", "layer_gemv", "layer_scratch", "layer_bf16"))
    # the GEMV slow past a few tokens: gate-up's time grows more than twice over
    # while the scratch's stays above bf16's (what the paragraph below explains)
    cross_slow = cross_ready and gu["auto"] / gu1 > 2 and cross_layer_sum(
        "int8", "scratch", None, M8) > cross_layer_sum(None, "bf16", None, M8)
    prose.glue("ch15_cross_guess", (
        "The first guess was too high" if wins["auto"] < FIRST_GUESS else
        "The first guess held"))
    if has_warp and gu.get("warp") and "ch15_cross_layer_warp" in prose.values:
        prose.glue("ch15_cross_warp_end", (
            "; but a layer's four products take {}, and over every layer the GEMV "
            "still beats the scratch only up to {} tokens: the narrower layers lose "
            "to it past that. So the engine keeps one limit and the launcher's "
            "variant; a limit and a variant per layer (gate-up a warp a row up to its "
            "own crossover) is what the records point to next"
            if wins["warp"] <= wins["auto"] else
            ", and over every layer the GEMV with a warp a row beats the scratch up "
            "to {1} tokens, further than the launcher's variant: the records point to "
            "setting QUANTIZED_GEMV_VARIANT to a warp a row").format(
                prose.values["ch15_cross_layer_warp"], wins["warp"]))

    def setting(r: dict) -> tuple:  # (quantization, GEMV limit, variant, mma limit)
        if r["quantization"] is None:
            return (None, None, None, None)
        # runs before the tensor-core kernel took the scratch past the GEMV
        return (r["quantization"], r.get("gemv_max_tokens"),
                r.get("gemv_variant") or "auto", r.get("mma_max_tokens") or 0)

    batch, batch_commit, batch_order = {}, {}, {}
    for i, r in enumerate(batch_runs):  # in the order recorded: the newest run wins
        batch[setting(r) + (r["shape"][0],)] = r["value"]
        batch_order[setting(r) + (r["shape"][0],)] = i
        batch_commit[setting(r)] = r.get("engine_commit")
    batches = sorted({k[4] for k in batch})
    series = sorted({k[:4] for k in batch},
                    key=lambda k: (k[0] is not None, k[3] or 0, k[2] or "", k[1] or 0))

    def setting_label(k: tuple) -> str:
        if k[0] is None:
            return "bf16"
        return (f"int8, GEMV up to {k[1]} tokens"
                + (", a warp a row" if k[2] == "warp" else "")
                + (f", tensor cores to {k[3]}" if k[3] else ""))

    if batch:
        fig, ax = new_figure(width=7, height=2.8)
        width = 0.8 / len(series)
        # the engine's setting on a GPU solid, the others paler
        engine_now = ("int8", QUANTIZED_GEMV_MAX_TOKENS, QUANTIZED_GEMV_VARIANT,
                      MMA_8BIT_MAX_TOKENS)
        for i, k in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(batches))]
            ax.bar(xs, [batch.get(k + (B,), 0) for B in batches], width,
                   color="#7f7f7f" if k[0] is None else "#d62728" if k[3] else
                   ("#2ca02c" if k[2] == "warp" else "#1f77b4"),
                   alpha=1 if k[0] is None or k == engine_now else
                   0.3 + 0.4 * (k[1] or 0) / 16,
                   label=setting_label(k) + (" (the engine's)" if k == engine_now
                                             else ""))
        ax.set_xticks(range(len(batches)), [f"{B} requests" for B in batches])
        ax.set_ylabel("decode tok/s (all requests)")
        ax.legend(fontsize=7)
        ax.set_title(f"{batch_runs[0]['device']['name']}: a few requests at once",
                     fontsize=9)
        plt.show()
        B8 = 8 if 8 in batches else batches[-1]
        prose.glue("ch15_batch_b", f"{B8}")
        prose.glue("ch15_batch_device", batch_runs[0]["device"]["name"])
        newest = batch_commit[None, None, None, None]  # bf16's: the newest run's
        prose.glue("ch15_batch_settings", "; ".join(
            f"{setting_label(k)}, {batch[k + (B8,)]:,.0f} tok/s"
            + (f" (an earlier run, commit {batch_commit[k]})"
               if batch_commit[k] != newest else "")
            for k in series if k + (B8,) in batch))
        # the engine's settings on a GPU (the simulator's mma limit is 0)
        engine = ("int8", QUANTIZED_GEMV_MAX_TOKENS, QUANTIZED_GEMV_VARIANT,
                  MMA_8BIT_MAX_TOKENS)

        def route(k: tuple, B: int) -> tuple:
            """The path a setting gives B tokens (and the GEMV's variant there)."""
            if B <= k[1]:
                return ("gemv", "auto" if B == 1 else k[2])
            return ("mma",) if B <= k[3] else ("scratch",)

        # each batch's run on today's path: the newest run of a setting that routes
        # it so
        today, today_order = {}, {}
        for k in series:
            for B in batches:
                if (k[0] == "int8" and k + (B,) in batch
                        and route(k, B) == route(engine, B)
                        and batch_order[k + (B,)] > today_order.get(B, -1)):
                    today[B], today_order[B] = batch[k + (B,)], batch_order[k + (B,)]
        # the batches the lower limit moved from the GEMV to the tensor cores:
        # predicted from the crossover (the step of the run that took the GEMV there
        # less each layer's difference), written before a run took them there
        before = ("int8", PREVIOUS_GEMV_MAX_TOKENS, "auto", MMA_8BIT_MAX_TOKENS)
        moved = [B for B in batches if B in mma_at
                 and route(before, B)[0] == "gemv" and route(engine, B) == ("mma",)]
        if moved and before + (moved[-1],) in batch:
            B = moved[-1]
            gain_us = llama_1b.num_hidden_layers * (
                cross_layer_sum("int8", "gemv", "auto", B) - mma_at[B][0])
            step_us = B / batch[before + (B,)] * 1e6
            prose.glue("ch15_batch_old_limit", f"{PREVIOUS_GEMV_MAX_TOKENS}")
            prose.glue("ch15_batch_pred_b", f"{B}")
            prose.glue("ch15_batch_pred_gain", f"{gain_us:.0f} µs")
            prose.glue("ch15_batch_pred_step", f"{step_us:,.0f} µs")
            prose.glue("ch15_batch_pred", f"{B / (step_us - gain_us) * 1e6:,.0f} tok/s")
            if B in today:  # measured since: the run on today's path
                prose.glue("ch15_batch_pred_got", f"{today[B]:,.0f} tok/s")
            if (None, None, None, None, B) in batch:
                prose.glue("ch15_batch_pred_bf16",
                           f"{batch[None, None, None, None, B]:,.0f} tok/s")
        bf16_at = {B: batch[None, None, None, None, B] for B in batches
                   if (None, None, None, None, B) in batch}
        measured = sorted(B for B in today if B in bf16_at)
        above = [B for B in measured if today[B] > bf16_at[B]]
        if measured:
            listed = ", ".join(f"{B} ({today[B]:,.0f} against {bf16_at[B]:,.0f})"
                               for B in measured)
            prose.glue("ch15_batch_verdict", (
                "On today's paths int8 decodes above bf16 at every batch measured "
                "there: " if len(above) == len(measured) else
                "On today's paths int8 decodes below bf16 at every batch measured "
                "there: " if not above else
                f"On today's paths int8 decodes above bf16 at {len(above)} of the "
                f"{len(measured)} batches measured there: ") + listed)

# the scratch in L2-sized chunks (bench/ch15_scratch_chunks.py), on the same GPU
chunk_runs = [r for r in load_records("ch15_scratch_chunks")
              + load_records("ch15_scratch_chunks", DATA_DIR / "h100")
              if cross_runs and r["device"]["name"] == cross_runs[0]["device"]["name"]]
chunk_at = {(r["layer"], r["shape"][0], r["variant"]): r["value"] for r in chunk_runs}
chunk_M = max((k[1] for k in chunk_at), default=None)
chunk_keys = {"bf16": "bf16", "whole": "scratch", "chunks": "serial_16mib",
              "dq": "dequant_whole", "dq_chunks": "dequant_16mib"}
if chunk_M and all(("gate_up_proj", chunk_M, v) in chunk_at
                   for v in chunk_keys.values()):
    for key, v in chunk_keys.items():
        prose.glue(f"ch15_chunk_{key}",
                   f"{chunk_at['gate_up_proj', chunk_M, v]:.1f} µs")
    prose.glue("ch15_chunk_M", f"{chunk_M}")
    prose.glue("ch15_chunk_device", chunk_runs[0]["device"]["name"])
    got = {key: chunk_at["gate_up_proj", chunk_M, v] for key, v in chunk_keys.items()}
    prose.glue("ch15_chunk_verdict", (
        "faster" if got["chunks"] < got["whole"] else
        "no faster: as these times suggest, the dequantizing kernel's own time, not "
        "DRAM's round trip, is the scratch's cost, and the chunks' narrower GEMMs run "
        "slower" if got["dq_chunks"] >= 0.95 * got["dq"] else
        "no faster, though the dequantizing itself gained: the chunks' narrower GEMMs "
        "ran slower"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if cross_ready:
    prose.show("""
On the {{ch15_cross_device}} the 8-bit GEMV, as the launcher picked its variant,
beats the scratch up to {{ch15_cross_wins}} tokens on every layer, in
{{ch15_cross_formats}}, and no further. {{ch15_cross_guess}}: gate-up's GEMV takes
{{ch15_cross_gu1}} at one token and {{ch15_cross_gu8}} at {{ch15_cross_m8}},
{{ch15_cross_gu_ratio}} times as long for {{ch15_cross_m8}} times the arithmetic on
the same bytes, where a GEMV reading its weights once should stay nearly flat.""" + ("""
So the GEMV's kernels for several tokens are slow, not the scratch fast. Reading the
kernel, not a profile, suggests why. Past two tokens the
launcher lets the block's eight warps share each group of four rows (two of gate-up's
outputs), and adds the warps' sums across the block for every group. And the block
stages its tokens' input in shared memory as float32: from five tokens on (five to
eight take the eight-token kernel) a 2,048-wide input no longer fits the stage whole,
and down's 8,192-wide one fails to from two tokens on, so the block stages the input
again for every group of rows it takes.""" if cross_slow else "") + """
At {{ch15_cross_m8}} tokens a layer's four products take {{ch15_cross_layer_gemv}} on
that GEMV, {{ch15_cross_layer_scratch}} on the scratch and {{ch15_cross_layer_bf16}}
in bf16.""" + ("""
With a warp a row instead — each warp owns its rows, so a group holds four times
gate-up's outputs, its sums meet within the warp, and the block stages the input a
quarter as often — gate-up takes {{ch15_cross_gu8_warp}} at {{ch15_cross_m8}} tokens
and beats the scratch up to {{ch15_cross_gu_wins_warp}}
tokens{{ch15_cross_warp_end}}.""" if
    "ch15_cross_gu8_warp" in prose.values
    and "ch15_cross_layer_warp" in prose.values else "") + ("""
The engine takes the GEMV up to `QUANTIZED_GEMV_MAX_TOKENS` = {{ch15_cross_limit}}
tokens with {{ch15_cross_variant}} past one token: {{ch15_cross_agree}} as the
records' crossover.""" if "ch15_gemv_best" not in prose.values else "") + ("""
On the tensor-core kernel built above, a layer's four products take
{{ch15_cross_layer_mma}} at {{ch15_cross_m8}} tokens, {{ch15_mma_half}}: gate-up, the
widest, takes {{ch15_mma_gu_ratio}} of bf16's time, {{ch15_mma_down_clause}}. Over a
layer's four products the tensor cores run below bf16 {{ch15_mma_below_bf16}}, and
beat the better of the GEMV and the scratch {{ch15_mma_beats_old}}; at 2 tokens the
GEMV takes {{ch15_gemv_at2}} against the tensor cores' {{ch15_mma_at2}}. The GEMV is
the fastest of the three up to {{ch15_gemv_best}} token{{ch15_gemv_best_s}}; the
engine takes it up to `QUANTIZED_GEMV_MAX_TOKENS` = {{ch15_cross_limit}}
({{ch15_gemv_agree}}) and
the tensor cores past it up to `QUANTIZED_MMA_MAX_TOKENS` =
{{ch15_mma_limit}}.""" + ("""
Its knobs (`MMA_8BIT_KNOBS`: tiles of 16 rows a block, warps splitting K, chunks
loaded ahead) come from a sweep of {{ch15_mma_sweep_n}} settings over the layers at 2
and 16 tokens (`--only mma_sweep`, printed above): the table's are within
{{ch15_mma_sweep_gap}} of the fastest on every layer there.""" if
    "ch15_mma_sweep_gap" in prose.values else "") if (
    "ch15_mma_half" in prose.values and "ch15_cross_layer_mma" in prose.values
    and "ch15_mma_down_clause" in prose.values)
    else "") + ("""
Through the engine on the {{ch15_batch_device}}, {{ch15_batch_b}} requests at once
decode at:
{{ch15_batch_settings}}.""" if "ch15_batch_settings" in prose.values else "") + ("""
{{ch15_batch_verdict}}.""" if "ch15_batch_verdict" in prose.values else "") + ("""
Lowering the limit from {{ch15_batch_old_limit}} to {{ch15_cross_limit}} moves a batch
of {{ch15_batch_pred_b}} requests from the GEMV to the tensor cores. A prediction,
written before an engine run took it there: over the model's layers the crossover's
times save {{ch15_batch_pred_gain}} of the {{ch15_batch_pred_step}} step that took
the GEMV there, so about {{ch15_batch_pred}} (bf16: {{ch15_batch_pred_bf16}}).""" + (
    """ The run since measured {{ch15_batch_pred_got}}."""
    if "ch15_batch_pred_got" in prose.values
    else " No engine run has taken it there yet.") if
    "ch15_batch_pred_bf16" in prose.values else "") + "\n")
if "ch15_chunk_verdict" in prose.values:
    prose.show("""
Could the scratch itself cost less? Dequantizing a few rows at a time into a buffer
small enough to stay in L2 (`bench/ch15_scratch_chunks.py`) should spare the bf16
values their trip to DRAM and back. On the {{ch15_chunk_device}}, gate-up at
{{ch15_chunk_M}} tokens took {{ch15_chunk_whole}} through the whole scratch and
{{ch15_chunk_chunks}} in 16 MiB chunks (bf16 {{ch15_chunk_bf16}}); the dequantizing
alone took {{ch15_chunk_dq}} whole and {{ch15_chunk_dq_chunks}} in chunks —
{{ch15_chunk_verdict}}.
""")

# %% [markdown]
# ### Where a batch-1 step's time goes
#
# The prediction above split the bf16 step into the weights' read and "the rest", and
# guessed that the rest stays. The GPU can say. `bench/ch15_step_profile.py` runs one
# request at batch 1 in each format (128 prompt tokens, 256 greedy new ones, after a
# warm-up request) and records its decode steps under torch's profiler: every kernel's
# time, summed by the module that defines it, counting only what no earlier kernel
# overlaps (chapter 11's programmatic launches start a kernel early). What the GPU is
# not busy with — the host's work and the gaps between kernels — is the step's wall
# time, measured in a run without the profiler, less the busy time. Until the H200 has
# a profile, the page draws an H100's (`book/data/h100/`); where chapter 1 has no
# bandwidth ceiling for the GPU drawn, the lines of the weights at the ceiling are left
# out.

# %%
from tinyvllm_lib.layers.attention import FUSE_DECODE_ROPE

# this GPU's records; an H100's (book/data/h100/) until this GPU has one
step_records_all = (load_records("ch15_step_profile")
                    or load_records("ch15_step_profile", DATA_DIR / "h100"))
step_dev = step_records_all[-1]["device"]["name"] if step_records_all else None
step_records_all = [r for r in step_records_all if r["device"]["name"] == step_dev]


def at_library_settings(records: list) -> list:
    """The records of each (format, LM head) made at the library's settings: its L2
    prefetch (PREFETCH_L2_BYTES) where a run of that format recorded one, else the
    records from before the prefetch (no prefetch_l2_mib); and among those, its RoPE
    setting (chapter 10's FUSE_DECODE_ROPE) where a run recorded one, else those
    made before the setting existed (RoPE launched apart)."""
    mib = PREFETCH_L2_BYTES >> 20
    kinds = {(r["quantization"], r.get("lm_head_8bit", False)) for r in records}
    kept = []
    for kind in kinds:
        mine = [r for r in records
                if (r["quantization"], r.get("lm_head_8bit", False)) == kind]
        mine = ([r for r in mine if r.get("prefetch_l2_mib") == mib]
                or [r for r in mine if "prefetch_l2_mib" not in r])
        mine = ([r for r in mine if r.get("fuse_decode_rope") == FUSE_DECODE_ROPE]
                or [r for r in mine if "fuse_decode_rope" not in r])
        # the newest run of those (A/B runs leave one at each setting and version)
        kept += [r for r in mine if mine
                 and r.get("engine_commit") == mine[-1].get("engine_commit")]
    return kept


step_records = at_library_settings(step_records_all)
# every matrix, the LM head too: the 8-bit kernels by the module that makes them
# (kernels.gemv_8bit in records made before version 7 moved them)
GEMV_GROUPS = ("kernels.gemv", "kernels.gemv_8bit", "kernels.gemv_8bit_kernel")


def step_parts(method, head: bool = False) -> dict:
    """µs a decode step: the GEMVs, attention, each other module's kernels, and what
    the GPU was not busy with (the newest record of this format, its LM head 8-bit
    where head, on step_dev)."""
    mine = [r for r in step_records if r["quantization"] == method
            and r.get("lm_head_8bit", False) == head]
    busy = [r for r in mine if r["name"] == "step_busy"][-1]
    # one run a format and GPU: the script replaces a format's records as it reruns it
    groups = {r["group"]: r["value"] for r in mine if r["name"] == "step_group"}
    parts = {"GEMVs": sum(us for g, us in groups.items() if g in GEMV_GROUPS),
             "attention": sum(us for g, us in groups.items()
                              if "attention" in g or "decode_combine" in g)}
    parts["everything else"] = busy["value"] - parts["GEMVs"] - parts["attention"]
    parts["GPU idle"] = max(0.0, busy["unprofiled_wall_us"] - busy["value"])
    return parts | {"wall": busy["unprofiled_wall_us"],
                    "kernels": busy["kernels_per_step"], "groups": groups}


profiled = [m for m in METHODS
            if any(r["quantization"] == m and not r.get("lm_head_8bit")
                   for r in step_records)]
if profiled:
    steps_by = {m: step_parts(m) for m in profiled}
    step_gb_s, _ = bandwidth_ceiling(step_dev)  # nan where chapter 1 has no record
    known = math.isfinite(step_gb_s)
    # the bf16 limit this chapter set out to pass: bf16's bytes at the ceiling
    bf16_line = step_gb_s * 1e9 / decode_weight_bytes(llama_1b, None)
    PART_COLORS = {"GEMVs": "#1f77b4", "attention": "#2ca02c",
                   "everything else": "#9467bd", "GPU idle": "#c7c7c7"}
    fig, ax = new_figure(1, 1, width=7.5, height=3.2)
    for x, m in enumerate(profiled):
        bottom = 0.0
        for part, color in PART_COLORS.items():
            us = steps_by[m][part]
            ax.bar(x, us, 0.6, bottom=bottom, color=color,
                   label=part if x == 0 else None,
                   hatch="//" if part == "GPU idle" else None, edgecolor="white")
            bottom += us
        if known:  # the weights' bytes at the ceiling: the GEMVs' best
            at_ceiling = decode_weight_bytes(llama_1b, m) / (step_gb_s * 1e3)
            ax.plot([x - 0.3, x + 0.3], [at_ceiling] * 2, "k--",
                    label="weights at the ceiling" if x == 0 else None)
    if known:
        ax.axhline(1e6 / bf16_line, color="#d62728", ls=":",
                   label=f"the bf16 limit, {bf16_line:,.0f} tok/s")
    ax.set_xticks(range(len(profiled)), [m or "bf16" for m in profiled])
    ax.set_ylabel("µs a decode step, batch 1")
    ax.set_title(f"one decode step by kernel group, {step_dev}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    plt.show()
    for m in profiled:
        s = steps_by[m]
        print(f"{m or 'bf16':>5}: step {s['wall']:.0f} µs "
              f"({s['kernels']:.0f} kernels and copies): "
              + ", ".join(f"{p} {s[p]:.0f}" for p in PART_COLORS))
    bf16_s = steps_by.get(None)
    eight = [m for m in ("int8", "fp8") if m in steps_by]
    if bf16_s and eight:
        m = min(eight, key=lambda k: steps_by[k]["wall"])  # the faster 8-bit format
        s = steps_by[m]
        prose.glue("ch15_step_which", "the faster 8-bit format" if len(eight) > 1 else
                   "the one 8-bit format profiled there")
        # the step's launches that are not GEMVs (from its launches in order)
        order = [r for r in step_records if r["name"] == "step_launches"
                 and r["quantization"] == m and not r.get("lm_head_8bit")]
        prose.glue("ch15_step_rest_launches", (
            f"in the {sum(g not in GEMV_GROUPS for g in order[-1]['groups'])} of its "
            f"{s['kernels']:.0f} kernels and copies that are not GEMVs") if order else
            "in its kernels and copies that are not GEMVs")
        rest = s["wall"] - s["GEMVs"]
        prose.glue("ch15_step_dev", step_dev)
        prose.glue("ch15_step_fmt", m)
        prose.glue("ch15_step_gemv", f"{s['GEMVs']:.0f} µs")
        prose.glue("ch15_step_gemv_bf16", f"{bf16_s['GEMVs']:.0f} µs")
        cut = 1 - s["GEMVs"] / bf16_s["GEMVs"]
        prose.glue("ch15_step_gemv_cut",
                   f"{abs(cut):.0%} {'less' if cut >= 0 else 'more'}")
        bytes_cut = 1 - decode_weight_bytes(llama_1b, m) / decode_weight_bytes(
            llama_1b, None)
        prose.glue("ch15_step_bytes_cut", f"{bytes_cut:.0%}")
        prose.glue("ch15_step_bytes_why", "" if QUANTIZE_LM_HEAD else
                   ", the LM head staying bf16")
        prose.glue("ch15_step_wall", f"{s['wall']:.0f} µs")
        prose.glue("ch15_step_wall_bf16", f"{bf16_s['wall']:.0f} µs")
        prose.glue("ch15_step_rest", f"{rest:.0f} µs")
        prose.glue("ch15_step_rest_bf16", f"{bf16_s['wall'] - bf16_s['GEMVs']:.0f} µs")
        prose.glue("ch15_step_kernels", f"{s['kernels']:.0f}")
        prose.glue("ch15_step_rest_share", f"{rest / s['wall']:.0%}")
        # the layers' GEMVs' read rate in each format: their matrices' bytes over
        # their time, the LM head (bf16 in both: the 8-bit step's kernels.gemv, the
        # one bf16 GEMV it launches) taken out of both
        head = s["groups"].get("kernels.gemv", 0.0)
        layer_us = {None: bf16_s["GEMVs"] - head, m: s["GEMVs"] - head}
        layer_bytes = {k: layer_matrix_bytes(llama_1b, k) for k in (None, m)}
        rate = {k: layer_bytes[k] / (layer_us[k] * 1e3) for k in (None, m)}
        as_bf16 = s["wall"] - layer_us[m] + layer_bytes[m] / (rate[None] * 1e3)
        prose.glue("ch15_step_rate", f"{rate[m]:,.0f} GB/s")
        prose.glue("ch15_step_rate_bf16", f"{rate[None]:,.0f} GB/s")
        prose.glue("ch15_step_head", f"{head:.0f} µs")
        prose.glue("ch15_step_as_bf16",
                   f"{as_bf16:.0f} µs ({1e6 / as_bf16:,.0f} tok/s)")
        if known:
            best_gemvs = decode_weight_bytes(llama_1b, m) / (step_gb_s * 1e3)
            best = 1e6 / (rest + best_gemvs)
            prose.glue("ch15_step_best_gemv", f"{best_gemvs:.0f} µs")
            prose.glue("ch15_step_best", f"{best:,.0f} tok/s")
            prose.glue("ch15_step_limit", f"{bf16_line:,.0f} tok/s")
            prose.glue("ch15_step_verdict", (
                "the GEMVs alone, read at the ceiling, would carry it past that limit"
                if best > bf16_line else
                "short of it even then: the rest of the step has to shrink too"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if profiled and bf16_s and eight:
    prose.show("""
On the {{ch15_step_dev}}, {{ch15_step_fmt}} ({{ch15_step_which}}) spends
{{ch15_step_gemv}} a step in its GEMVs against bf16's {{ch15_step_gemv_bf16}}
({{ch15_step_gemv_cut}}; the step's weights are {{ch15_step_bytes_cut}} fewer
bytes{{ch15_step_bytes_why}}), and its step takes {{ch15_step_wall}} against
{{ch15_step_wall_bf16}}. The rest of the step — attention, norms, rotary embedding and
cache writes, the sampler, and the time the GPU waits — is {{ch15_step_rest}}
({{ch15_step_rest_bf16}} in bf16): {{ch15_step_rest_share}} of an 8-bit step,
{{ch15_step_rest_launches}}. Counted in the bytes of the layers'
matrices, the LM head's {{ch15_step_head}} taken out of both, the 8-bit GEMVs read at
{{ch15_step_rate}} and bf16's at {{ch15_step_rate_bf16}} (the 8-bit ones also make the
norms that bf16 launches apart): read as fast as bf16's, the 8-bit step would take
{{ch15_step_as_bf16}}.""" + ("""
Were the GEMVs to read at the ceiling ({{ch15_step_best_gemv}} for these weights), the
step would run at {{ch15_step_best}} against the bf16 limit of {{ch15_step_limit}}:
{{ch15_step_verdict}}.""" if known else "") + "\n")
else:
    print("no batch-1 step profile recorded yet: python bench/ch15_step_profile.py "
          "on a GPU")

# %% [markdown]
# The profile also keeps each launch of a step in order, folded over the steps (the
# same graph replays every step): what the launches of the second of the 16 layers
# (layer 1) each take, below for the 8-bit format of the paragraph above. A launch's
# "own" time is what no earlier kernel overlaps; the weights' GEMVs are named by
# their place in the layer.

# %%
def launch_part(group: str, gemvs) -> str:
    """What a launch of a layer is, from its kernel's module; gemvs: an iterator over
    the layer's GEMV names in order ("O", "gate-up", "down", then the next layer's
    "QKV"), advanced at each GEMV."""
    return ("rotary + KV write" if group == "kernels.kv_cache_write" else
            "attention" if ("attention" in group or "decode_combine" in group
                            or "tc_decode" in group) else
            f"{next(gemvs, 'another')} GEMV" if group in GEMV_GROUPS else
            "RMSNorm" if "rmsnorm" in group else group)


def attention_launches(groups: list) -> list[int]:
    """Where each layer's attention starts in a step's launches (its first attention
    launch): a layer runs from there to the next, through O, gate-up, down, the next
    layer's QKV and, where RoPE is launched apart, its rotary write."""
    is_attention = [launch_part(g, iter(())) == "attention" for g in groups]
    return [j for j, a in enumerate(is_attention)
            if a and (j == 0 or not is_attention[j - 1])]


def layer_launches(method) -> list[tuple[str, float]] | None:
    """(what, own µs) for each launch of layer 1 of a step, from its attention to
    layer 2's; None without the record."""
    rec = [r for r in step_records if r["name"] == "step_launches"
           and r["quantization"] == method and not r.get("lm_head_8bit")]
    if not rec:
        return None
    groups, own = rec[-1]["groups"], rec[-1]["own_us"]
    starts = attention_launches(groups)
    if len(starts) < 3:
        return None
    gemvs = iter(("O", "gate-up", "down", "QKV"))
    return [(launch_part(groups[j], gemvs), own[j])
            for j in range(starts[1], starts[2])]


if profiled and bf16_s and eight and (layer := layer_launches(m)):
    total = sum(us for _, us in layer)
    for what, us in layer:
        print(f"{m} on the {step_dev}, layer 1: {what:>18} {us:5.1f} µs")
    print(f"{'':>29}{'the layer':>18} {total:5.1f} µs")
    fixed = sum(us for what, us in layer if what in ("rotary + KV write", "attention"))
    gemv_us = sum(us for what, us in layer if what.endswith("GEMV"))
    prose.glue("ch15_layer_total", f"{total:.1f} µs")
    prose.glue("ch15_layer_fixed", f"{fixed:.1f} µs ({fixed / total:.0%})")
    prose.glue("ch15_layer_small", (
        "The rotary embedding with the cache write, and the attention,"
        if any(what == "rotary + KV write" for what, _ in layer) else
        "The attention and the rotary embedding and cache write inside it"))
    prose.glue("ch15_layer_gemvs", f"{gemv_us:.1f} µs")
    at_ceiling = (layer_matrix_bytes(llama_1b, m) / llama_1b.num_hidden_layers
                  / (step_gb_s * 1e3)) if known else math.nan
    prose.glue("ch15_layer_gemvs_best", f"{at_ceiling:.1f} µs")
    # the K and V rows the attention reads at the request's last step, a layer
    kv_row = 2 * llama_1b.num_key_value_heads * llama_1b.head_dim * 2  # bytes a token
    last = max(r["shape"][1] + r["shape"][2] for r in step_records)
    prose.glue("ch15_layer_kv", f"{kv_row * last / 1024:,.0f} KiB")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if profiled and bf16_s and eight and layer:
    prose.show("""
A layer's worth of the {{ch15_step_fmt}} step's launches, from layer 1's attention
to layer 2's, takes {{ch15_layer_total}}; its four GEMVs
{{ch15_layer_gemvs}}""" + (""", where their matrices' bytes at the ceiling would take
{{ch15_layer_gemvs_best}}""" if known else "") + """. {{ch15_layer_small}}
read little (the attention at most {{ch15_layer_kv}}
of keys and values, at the request's last step) yet take {{ch15_layer_fixed}} of it:
their time is latency, not bytes — each waits for the launch before it, and no
weight format shortens that.
""")

# %% [markdown]
# ### The weights into L2 before the wait, measured
#
# Version 8's prefetch (in the GEMV section) asked L2 for each block's first rows
# before `griddepcontrol.wait`. `bench/ch15_step_profile.py --formats int8
# --prefetch-l2-mib 0 24` profiles the int8 step (its LM head bf16) with none and with
# 24 MiB a kernel, one after the other on the same GPU, and `bench/ch15_quantization.py
# --only engine --prefetch-l2-mib ...` times batch-1 decode at each. Below, each
# launch's own time, averaged over the layers the step holds whole, without the
# prefetch and with it, and the change next to the one predicted before the run.

# %%
# the change in each GEMV's own time a layer, µs, predicted before the first run from
# the H200's version-7 step profile: O's 4 MB should arrive while attention runs,
# gate-up's while O runs; down's and QKV's prefetch only moves their rows earlier in a
# stream
PREFETCH_PREDICTED_US = {"O GEMV": -2.3, "gate-up GEMV": -3.2, "down GEMV": -1.0,
                         "QKV GEMV": -1.0}
LAYER_PARTS = ("rotary + KV write", "attention", "O GEMV", "gate-up GEMV",
               "down GEMV", "QKV GEMV")


def mean_layer(record) -> tuple[dict, int]:
    """Each part of a layer's launches, its own µs averaged over the layers the step
    holds whole (from one layer's attention to the next's)."""
    groups, own = record["groups"], record["own_us"]
    starts = attention_launches(groups)
    sums, count = dict.fromkeys(LAYER_PARTS, 0.0), 0
    for a, b in zip(starts, starts[1:]):
        gemvs = iter(("O", "gate-up", "down", "QKV"))
        for j in range(a, b):
            part = launch_part(groups[j], gemvs)
            if part in sums:
                sums[part] += own[j]
        count += 1
    return {p: us / max(count, 1) for p, us in sums.items()}, count


# a GPU whose int8 step was profiled without the prefetch and with it
ab_runs = {}
for r in (load_records("ch15_step_profile")
          + load_records("ch15_step_profile", DATA_DIR / "h100")):
    if (r["quantization"] == "int8" and not r.get("lm_head_8bit")
            and "prefetch_l2_mib" in r and "fuse_decode_rope" not in r):
        ab_runs.setdefault(r["device"]["name"], {}).setdefault(
            r["prefetch_l2_mib"], {})[r["name"]] = r
ab_dev = next((d for d, by in ab_runs.items()
               if 0 in by and any(m > 0 for m in by)), None)
if ab_dev is None:
    print("no run of the prefetch without and with: python bench/ch15_step_profile.py "
          "--formats int8 --prefetch-l2-mib 0 24 on a GPU")
else:
    on_mib = max(ab_runs[ab_dev])
    off, on = (ab_runs[ab_dev][mib] for mib in (0, on_mib))
    layer_off, layers_held = mean_layer(off["step_launches"])
    layer_on, _ = mean_layer(on["step_launches"])
    fig, (ax, ax_d) = new_figure(1, 2, width=9.5, height=3.2)
    xs = np.arange(len(LAYER_PARTS))
    ax.bar(xs - 0.2, [layer_off[p] for p in LAYER_PARTS], 0.4, color="#1f77b4",
           label="no prefetch")
    ax.bar(xs + 0.2, [layer_on[p] for p in LAYER_PARTS], 0.4, color="#ff7f0e",
           label=f"{on_mib} MiB a kernel into L2")
    ax.set_xticks(xs, [p.replace(" GEMV", "") for p in LAYER_PARTS], fontsize=7,
                  rotation=20)
    ax.set_ylabel("µs a layer (own time)")
    ax.set_title(f"int8 batch-1 step, mean layer, {ab_dev}", fontsize=9)
    ax.legend(fontsize=7)
    gemv_parts = list(PREFETCH_PREDICTED_US)
    xg = np.arange(len(gemv_parts))
    ax_d.bar(xg - 0.2, [PREFETCH_PREDICTED_US[p] for p in gemv_parts], 0.4,
             color="#c7c7c7", label="predicted (H200, before the run)")
    ax_d.bar(xg + 0.2, [layer_on[p] - layer_off[p] for p in gemv_parts], 0.4,
             color="#d62728", label="measured")
    ax_d.axhline(0, color="k", lw=0.8)
    ax_d.set_xticks(xg, [p.replace(" GEMV", "") for p in gemv_parts], fontsize=7)
    ax_d.set_ylabel("change, µs a layer")
    ax_d.set_title("what the prefetch changed", fontsize=9)
    ax_d.legend(fontsize=7)
    plt.show()
    wall_off = off["step_busy"]["unprofiled_wall_us"]
    wall_on = on["step_busy"]["unprofiled_wall_us"]
    prose.glue("ch15_pf_dev", ab_dev)
    prose.glue("ch15_pf_mib", f"{on_mib} MiB")
    prose.glue("ch15_pf_wall", f"{wall_on:.0f} µs against {wall_off:.0f} µs")
    prose.glue("ch15_pf_predicted",
               f"{-sum(PREFETCH_PREDICTED_US.values()):.1f} µs a layer")
    total = sum(layer_on[p] - layer_off[p] for p in PREFETCH_PREDICTED_US)
    prose.glue("ch15_pf_total",
               f"{abs(total):.1f} µs a layer {'more' if total > 0 else 'less'}")
    prose.glue("ch15_pf_layers", f"{layers_held}")
    prose.glue("ch15_pf_library", f"`PREFETCH_L2_BYTES = {PREFETCH_L2_BYTES}`")
    for p, key in (("O GEMV", "o"), ("gate-up GEMV", "gu"), ("down GEMV", "down"),
                   ("QKV GEMV", "qkv")):
        d = layer_on[p] - layer_off[p]
        prose.glue(f"ch15_pf_{key}",
                   f"{layer_off[p]:.1f} to {layer_on[p]:.1f} µs ({d:+.1f})")
    o_weights = (llama_1b.num_attention_heads * llama_1b.head_dim
                 * llama_1b.hidden_size)  # O's codes, one byte each
    # the fastest any GEMV of this chapter read on that GPU (chapter 1 may have no
    # ceiling recorded for it)
    fastest = max((r["value"] for r in (load_records("ch15_quantization")
                                        + load_records("ch15_quantization",
                                                       DATA_DIR / "h100"))
                   if r.get("part") == "gemv" and r.get("metric") == "GB/s"
                   and r["device"]["name"] == ab_dev), default=math.nan)
    prose.glue("ch15_pf_o_bytes", f"{o_weights / 2**20:.0f} MiB")
    o_read_us = o_weights / (fastest * 1e3)
    o_pred = -PREFETCH_PREDICTED_US["O GEMV"]
    prose.glue("ch15_pf_o_ceiling", (
        f"{o_read_us:.1f} µs at the fastest rate a GEMV of this chapter read there "
        f"({fastest:,.0f} GB/s)" + (
            f" — less than the {o_pred:.1f} µs predicted, so that part of the "
            "prediction could not have come true" if o_read_us < o_pred else
            f", at least the {o_pred:.1f} µs predicted"))
        if math.isfinite(fastest) else "a part of its time no run has measured")
    o_kept = layer_on["O GEMV"] / layer_off["O GEMV"]
    prose.glue("ch15_pf_o_kept", f"{o_kept:.0%}")
    # which GEMVs the prefetch made faster and which slower
    changed = {p: layer_on[p] - layer_off[p] for p in PREFETCH_PREDICTED_US}
    slower = [p for p, d in changed.items() if d > 0]
    prose.glue("ch15_pf_slower", "no GEMV got slower" if not slower else
               " and ".join(p.replace(" GEMV", "") for p in slower) + " got slower")
    pf_gu_slower = changed["gate-up GEMV"] > 0  # the reading below is about gate-up
    prose.glue("ch15_pf_verdict", (
        "moved the step the wrong way" if wall_on > wall_off else
        "shortened the step"))
    # batch-1 decode through the engine at each setting, the same GPU (its data folder)
    engine_ab = {r["prefetch_l2_mib"]: r["value"]
                 for r in (load_records("ch15_quantization")
                           + load_records("ch15_quantization", DATA_DIR / "h100"))
                 if r.get("name") == "bs1_decode" and r.get("quantization") == "int8"
                 and not r.get("lm_head_8bit") and r["device"]["name"] == ab_dev
                 and r.get("gemv_8bit_version") == GEMV_8BIT_VERSION
                 and "prefetch_l2_mib" in r}
    prose.glue("ch15_pf_engine", (
        f"{engine_ab[on_mib]:,.0f} tok/s with it against {engine_ab[0]:,.0f} without"
        if 0 in engine_ab and on_mib in engine_ab else "not yet timed at both"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if ab_dev is not None:
    prose.show("""
On the {{ch15_pf_dev}}, with {{ch15_pf_mib}} a kernel the int8 step took
{{ch15_pf_wall}} without; through the engine, batch 1 decoded at {{ch15_pf_engine}}.
The prediction, made from the H200's profile, was {{ch15_pf_predicted}} saved in the
four GEMVs; over the {{ch15_pf_layers}} layers held whole they took {{ch15_pf_total}}.
O's GEMV went from {{ch15_pf_o}}: its {{ch15_pf_o_bytes}} of codes take
{{ch15_pf_o_ceiling}}. With its rows asked of L2 before its wait, O kept
{{ch15_pf_o_kept}} of its time: the wait's release, staging the input, the warps'
sums meeting and the store, which no prefetch touches. QKV went from {{ch15_pf_qkv}},
down from {{ch15_pf_down}} and gate-up from {{ch15_pf_gu}}; {{ch15_pf_slower}}.""" + (
    """ For gate-up two readings fit, and this run cannot tell them apart: down starts
while gate-up still streams its own rows, so down's prefetch takes bandwidth from
gate-up; or the rows the two kernels prefetch, tens of MB together, evict each other
from L2 before they are read. A smaller setting, or the prefetch on O and QKV only,
would tell; neither has run.""" if pf_gu_slower else "") + """
A prefetch moves bytes earlier and makes none fewer; where the kernel before already
reads near the full rate there is little idle memory to move them into. At this
setting it {{ch15_pf_verdict}}, and the engine keeps {{ch15_pf_library}}.
""")

# %% [markdown]
# ### One launch fewer a layer: RoPE and the K/V store inside attention, measured
#
# The layer above spends a launch on the rotary embedding and the cache write, a
# few kilobytes of work that waits for QKV's GEMV and makes attention wait for it.
# Chapter 8's decode kernel can do that work itself (`fuse_rope`): every block rotates
# its query heads as it loads them, and the block whose split holds the newest key
# rotates it and stores that token's K and V before it reads the cache. Chapter 10's
# `PagedAttention` hands a decode-only step's RoPE to it when `FUSE_DECODE_ROPE` is
# on. The prediction for the first version, written before any run from the H200's
# version-7 int8 profile (the rotary write's own time there, a sixteenth of its
# group's): the write's launch goes, and attention grows by the owning block's store
# and barrier and the queries' extra loads of their partners and angles, by much
# less (`FUSE_PREDICTED_US` below holds both versions' figures, the figure draws them).
# `bench/ch15_step_profile.py --formats int8-head bf16 --fuse-rope off on` profiles
# each format with the launch apart and inside, one after the other on the same GPU.

# %%
# the change in each part's own time a layer, µs, predicted before each version's
# first run: version 1 from the H200's version-7 int8 profile; version 2 from version
# 1's measurement on an H100 (the write -2.6, attention +3.8), less the two round
# trips in a row (the position, then its angles) that version 2 moves before the wait
FUSE_PREDICTED_US = {
    1: {"rotary + KV write": -2.9, "attention": +0.4},
    2: {"rotary + KV write": -2.6, "attention": +2.0},
}

# (device, format, 8-bit head) -> {(engine commit, 0 apart or the version): records}:
# a version is compared with the run apart made with it, on the same machine
fuse_runs = {}
for r in (load_records("ch15_step_profile")
          + load_records("ch15_step_profile", DATA_DIR / "h100")):
    if "fuse_decode_rope" in r and r.get("prefetch_l2_mib") == PREFETCH_L2_BYTES >> 20:
        key = (r["device"]["name"], r["quantization"], r.get("lm_head_8bit", False))
        setting = r.get("decode_rope_version", 1) if r["fuse_decode_rope"] else 0
        fuse_runs.setdefault(key, {}).setdefault((r["engine_commit"], setting), {})[
            r["name"]] = r
fuse_pairs = {}  # key -> {version: (the run apart, the run inside)}
for key, runs in fuse_runs.items():
    for (commit, v), by in runs.items():
        apart = runs.get((commit, 0), {})
        if v and "step_busy" in by and "step_busy" in apart:
            fuse_pairs.setdefault(key, {})[v] = (apart, by)


def with_launches(key) -> bool:
    """Whether every version's runs of key folded their launches (a layer to draw)."""
    return all("step_launches" in run for pair in fuse_pairs[key].values()
               for run in pair)



# the profiled GPU's pairs first, the 8-bit format with its head 8-bit before bf16
fuse_order = sorted(fuse_pairs, key=lambda k: (k[0] != step_dev, k[1] is None,
                                               not k[2]))
if not fuse_order:
    print("no run with RoPE apart and inside: python bench/ch15_step_profile.py "
          "--formats int8-head bf16 --fuse-rope off on on a GPU")
else:
    fuse_dev = fuse_order[0][0]
    fuse_keys = [k for k in fuse_order if k[0] == fuse_dev]
    main_key = next((k for k in fuse_keys if with_launches(k)), None)
if fuse_order and main_key is None:
    fuse_order = []  # no run folded its launches: nothing to draw a layer from
    print("no run with RoPE apart and inside folded its launches into layers")
if fuse_order:
    main_runs = fuse_pairs[main_key]
    versions = sorted(main_runs)
    # each version's run apart and inside: mean layers
    layers = {v: tuple(mean_layer(run["step_launches"])[0] for run in main_runs[v])
              for v in versions}

    def fmt_name(key) -> str:
        return (key[1] or "bf16") + (" (8-bit head)" if key[2] else "")

    def setting_name(v) -> str:
        return "RoPE and write launched apart" if v == 0 else f"inside, version {v}"

    fig, (ax, ax_d) = new_figure(1, 2, width=9.5, height=3.4)
    xs = np.arange(len(LAYER_PARTS))
    colors = {0: "#1f77b4", 1: "#98df8a", 2: "#2ca02c"}
    # the newest version's run apart, then every version inside
    drawn = [(0, layers[versions[-1]][0])] + [(v, layers[v][1]) for v in versions]
    width = 0.8 / len(drawn)
    for j, (v, layer) in enumerate(drawn):
        ax.bar(xs + (j - (len(drawn) - 1) / 2) * width,
               [layer[p] for p in LAYER_PARTS], width,
               color=colors.get(v, "#17becf"), label=setting_name(v))
    ax.set_xticks(xs, [p.replace(" GEMV", "") for p in LAYER_PARTS], fontsize=7,
                  rotation=20)
    ax.set_ylabel("µs a layer (own time)")
    ax.set_title(f"{fmt_name(main_key)} batch-1 step, mean layer, {fuse_dev}",
                 fontsize=9)
    ax.legend(fontsize=7)
    parts = ["rotary + KV write", "attention", "the layer"]

    def change(v) -> list[float]:
        apart, inside = layers[v]
        d = [inside[p] - apart[p] for p in parts[:2]]
        return d + [sum(inside.values()) - sum(apart.values())]

    xg = np.arange(len(parts))
    bars = [(f"v{v} predicted", [*FUSE_PREDICTED_US[v].values(),
                                 sum(FUSE_PREDICTED_US[v].values())], "#c7c7c7")
            for v in versions if v in FUSE_PREDICTED_US]
    bars += [(f"v{v} measured", change(v), colors.get(v, "#17becf"))
             for v in versions]
    width = 0.8 / len(bars)
    for j, (label, values, color) in enumerate(bars):
        ax_d.bar(xg + (j - (len(bars) - 1) / 2) * width, values, width, color=color,
                 label=label, hatch="//" if "predicted" in label and j else None)
    ax_d.axhline(0, color="k", lw=0.8)
    ax_d.set_xticks(xg, parts, fontsize=7)
    ax_d.set_ylabel("change, µs a layer")
    ax_d.set_title("what moving the launch inside changed", fontsize=9)
    ax_d.legend(fontsize=7)
    plt.show()

    def wall(key, v, inside: bool) -> float:
        return fuse_pairs[key][v][inside]["step_busy"]["unprofiled_wall_us"]

    newest = versions[-1]
    walls = []
    for k in fuse_keys:
        for v in sorted(fuse_pairs[k]):
            print(f"{fuse_dev}, {fmt_name(k)}: a step {wall(k, v, False):.1f} µs "
                  f"apart, {wall(k, v, True):.1f} µs {setting_name(v)}")
        if newest in fuse_pairs[k]:
            off_us, on_us = wall(k, newest, False), wall(k, newest, True)
            walls.append(f"{fmt_name(k)} {off_us:.0f} µs apart, {on_us:.0f} inside "
                         f"({on_us - off_us:+.0f})")
    prose.glue("ch15_fuse_dev", fuse_dev)
    prose.glue("ch15_fuse_fmt", fmt_name(main_key))
    prose.glue("ch15_fuse_walls", "; ".join(walls))
    prose.glue("ch15_fuse_version", f"version {newest}")
    measured = change(newest)

    def signed(us: float) -> str:  # a change, "0.0" where it rounds to nothing
        return f"{us:+.1f} µs" if abs(us) >= 0.05 else "0.0 µs"

    prose.glue("ch15_fuse_layer", signed(measured[2]))
    prose.glue("ch15_fuse_write", signed(measured[0]))
    prose.glue("ch15_fuse_attention", signed(measured[1]))
    predicted = FUSE_PREDICTED_US.get(newest, {})
    prose.glue("ch15_fuse_predicted", f"{sum(predicted.values()):+.1f} µs")
    first = change(versions[0])
    prose.glue("ch15_fuse_v1", (
        f"The first version changed the layer by {first[2]:+.1f} µs against the "
        f"{sum(FUSE_PREDICTED_US[1].values()):+.1f} µs predicted: the write's launch "
        f"{first[0]:+.1f} µs, attention {first[1]:+.1f} µs where "
        f"{FUSE_PREDICTED_US[1]['attention']:+.1f} was predicted. After its wait, "
        "its attention waited for the row's position, then for the angles at that "
        "position: two round trips in a row before a query could be rotated, and "
        "in the block that stores the newest key, before it could store. Version 2 "
        "loads the position and each lane's angles before the wait, with the block "
        "tables, so that after it the queries, the newest row and their angles "
        "arrive together. " if versions[0] == 1 and len(versions) > 1 else ""))
    faster = wall(main_key, newest, True) < wall(main_key, newest, False)
    moved = [(k, wall(k, newest, True) / wall(k, newest, False) - 1)
             for k in fuse_keys if newest in fuse_pairs[k]]
    prose.glue("ch15_fuse_verdict", " and ".join(
        f"{'shortened' if d < 0 else 'lengthened'} the {fmt_name(k)} step"
        for k, d in moved) + f", by at most {max(abs(d) for _, d in moved):.1%}")
    prose.glue("ch15_fuse_library", f"`FUSE_DECODE_ROPE = {FUSE_DECODE_ROPE}`")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if fuse_order:
    prose.show("""
On the {{ch15_fuse_dev}}, the {{ch15_fuse_fmt}} step, its mean layer above.
{{ch15_fuse_v1}}With {{ch15_fuse_version}} the layer changed by
{{ch15_fuse_layer}} against the {{ch15_fuse_predicted}} predicted: the rotary
write's launch {{ch15_fuse_write}}, attention {{ch15_fuse_attention}}. Whole steps,
timed without the profiler: {{ch15_fuse_walls}}. Moving the write inside
{{ch15_fuse_verdict}}; the library has {{ch15_fuse_library}}.
""" + ("" if faster else """ What attention still adds is, by our reading of the
code (no profile separates it), the block that holds the newest key: its row's loads
sit inside the branch that picks that block, likely issued only once the queries'
have been used, then come the store and a barrier, and then the lanes read the row
back from L2. A next version
would load the row with the queries in every block and hand the stored words to the
lanes through shared memory; it is not built. A batch of hundreds of rows, where the
write's launch costs more and each block's extra wait hides among the others, has
not been measured with it either (`bench/ch14_tc_decode.py --backends auto-unfused
auto-fused`).
"""))

# %% [markdown]
# ### The LM head in 8 bits
#
# The profile names the one large bf16 read an 8-bit step still makes: the LM head,
# a fifth of Llama 3.2 1B's bytes, read whole every step by chapter 6's bf16 GEMV.
# `LLM(model, quantization="int8", quantize_lm_head=True)` (`--quantize-lm-head` on
# every command that makes an engine) stores it in the format too: an 8-bit copy of
# the tied table with a scale a row, rounded to nearest as it loads (an offline
# checkpoint keeps its head bf16, so the head is rounded at load there as well),
# while the embedding's lookups keep reading the bf16 table. Under tensor parallelism
# each rank rounds its own rows of the vocabulary, the same codes and scales as the
# whole head's, since a scale belongs to its row.
#
# The prediction, before the engine has run with it: a batch-1 step loses the bf16
# head's GEMV, as the profile timed it, and gains the plain 8-bit GEMV on the head's
# shape (the final norm stays a kernel of its own), as the GEMV measurement above timed
# it on the same GPU. Past `QUANTIZED_GEMV_MAX_TOKENS` tokens a step, where the GEMM
# takes over, the 8-bit head costs more than the bf16 one: int8's head, like every int8
# matrix (and FP8's, by default), is dequantized into the bf16 scratch, so a batch-256
# step writes the head's bf16 values and reads them back besides the codes, where the
# bf16 head read its values once; and the scratch, sized by the largest 8-bit matrix,
# grows from gate-up's 64 MiB to the head's. Whether each format keeps its perplexity
# target with the head rounded is the accuracy study's question; its answer follows.

# %%
# the 8-bit GEMV on the head's shape, on the profiled GPU: the newest version's record
gemv_runs = [r for r in gpu_all + h100_all if r["device"]["name"] == step_dev]


def head_gemv(method) -> dict | None:
    """The newest recorded 8-bit GEMV on the LM head's shape (one token, no norm: the
    engine's final norm is its own kernel), on step_dev."""
    mine = [r for r in gemv_runs if r["name"] == "gemv" and r.get("layer") == "lm_head"
            and r["quantization"] == method]
    if not mine:
        return None
    return max(mine, key=lambda r: r.get("gemv_8bit_version", 1))


V, H = llama_1b.vocab_size, llama_1b.hidden_size
head_predicted = {}
if profiled and bf16_s and eight:
    for m8 in eight:
        head_bf16_us = steps_by[m8]["groups"].get("kernels.gemv", 0.0)
        if (head_8 := head_gemv(m8)) is None:
            continue
        head_8_us = head_8["us"]
        step_us = steps_by[m8]["wall"] - head_bf16_us + head_8_us
        head_predicted[m8] = step_us
        print(f"{m8} on the {step_dev}: step {steps_by[m8]['wall']:.0f} µs, bf16 head "
              f"{head_bf16_us:.0f} µs -> 8-bit head {head_8_us:.0f} µs: predicted step "
              f"{step_us:.0f} µs ({1e6 / step_us:,.0f} tok/s)")
    # batch 256: the head's dequantize writes its bf16 values and cuBLAS reads them
    extra_bytes = 2 * V * H + V * (H + 4)  # bf16 written, codes and scales read
    if known:
        extra_us = extra_bytes / (step_gb_s * 1e3)
        print(f"batch 256, int8: + {extra_bytes / 1e6:,.0f} MB a step through the "
              f"scratch, {extra_us:.0f} µs at the ceiling")
        prose.glue("ch15_head_extra", f"{extra_bytes / 1e6:,.0f} MB a step more "
                   f"than the bf16 head ({extra_us:.0f} µs at the ceiling)")
    prose.glue("ch15_head_scratch", f"{2 * V * H / 2**20:,.0f} MiB")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if "int8" in head_predicted:
    m8, step_us = "int8", head_predicted["int8"]
    prose.glue("ch15_head_gemv_bf16",
               f"{steps_by[m8]['groups'].get('kernels.gemv', 0.0):.0f} µs")
    prose.glue("ch15_head_gemv_8", f"{head_gemv(m8)['us']:.0f} µs")
    head_version = head_gemv(m8).get("gemv_8bit_version", 1)
    step_version = max(r.get("gemv_8bit_version", 1) for r in step_records)
    prose.glue("ch15_head_gemv_version", f"version {head_version}'s" + (
        "" if head_version == step_version else
        f", the newest timed there on the head; the step ran version {step_version}"))
    prose.glue("ch15_head_pred", f"{step_us:.0f} µs ({1e6 / step_us:,.0f} tok/s)")
    prose.glue("ch15_head_now", f"{steps_by[m8]['wall']:.0f} µs "
               f"({1e6 / steps_by[m8]['wall']:,.0f} tok/s)")
    limit_head = (step_gb_s * 1e9 / decode_weight_bytes(llama_1b, m8, lm_head=True)
                  if known else math.nan)
    bf16_head_bytes, head_8_bytes = 2 * V * H, V * (H + 4)
    head_bf16_us = steps_by[m8]["groups"].get("kernels.gemv", 0.0)
    prose.glue("ch15_head_rates", (
        f"{bf16_head_bytes / (head_bf16_us * 1e3):,.0f} GB/s for its "
        f"{bf16_head_bytes / 1e6:,.0f} MB; the 8-bit one "
        f"{head_8_bytes / (head_gemv(m8)['us'] * 1e3):,.0f} GB/s for "
        f"{head_8_bytes / 1e6:,.0f} MB"))
    saved = head_bf16_us - head_gemv(m8)["us"]
    prose.glue("ch15_head_saved", (
        f"{saved:.0f} µs, not the {head_bf16_us / 2:.0f} µs of half the bf16 GEMV's "
        "time" if saved < 0.9 * head_bf16_us / 2 else
        f"{saved:.0f} µs, about half the bf16 GEMV's {head_bf16_us:.0f} µs"))
    prose.glue("ch15_head_codes", f"{head_8_bytes / 1e6:,.0f} MB")
    measured = any(r["name"] == "bs1_decode" and r.get("lm_head_8bit")
                   for r in gemv_runs)
    prose.glue("ch15_head_status", (
        "The cell below prints what the engine measured with it." if measured else
        "No engine has run with the head in 8 bits on this GPU yet: these figures are "
        "a prediction, and the cell below prints the measurement once "
        "`bench/ch15_quantization.py --lm-head both` has recorded it."))
    prose.show("""
On the {{ch15_step_dev}}, int8's step takes {{ch15_head_now}} with the bf16 head,
whose GEMV takes {{ch15_head_gemv_bf16}}; the plain 8-bit GEMV on that shape took
{{ch15_head_gemv_8}} ({{ch15_head_gemv_version}}). The bf16 GEMV reads
{{ch15_head_rates}}: halving the head's bytes saves {{ch15_head_saved}}, and the
step should take {{ch15_head_pred}}.""" + ("""
At batch 256 the 8-bit head moves {{ch15_head_extra}}, and it
takes {{ch15_head_codes}} of memory for its codes besides a scratch grown to
{{ch15_head_scratch}}.""" if known else "") + " {{ch15_head_status}}\n")
if accuracy:  # the head's price in perplexity, from the accuracy study
    head_ok = [m for m in ("int8", "fp8")
               if text_runs[f"{m}, head 8-bit"]["ratio_to_bf16"] - 1 <= TARGETS[m]]
    prose.glue("ch15_head_which", (
        "both formats may take it" if len(head_ok) == 2 else
        f"only {head_ok[0]} stays within its target with it" if head_ok else
        "neither format stays within its target with it"))
    head_measured = any(r["name"] == "bs1_decode" and r.get("lm_head_8bit")
                        for r in gemv_runs)
    prose.glue("ch15_head_default", (
        "the engine's batch-1 and batch-256 runs with each head, printed below, weigh "
        "the two" if head_measured else
        f"no engine run on the {step_dev} has weighed the two yet"))
    for m8 in ("int8", "fp8"):
        prose.glue(f"ch15_head_base_{m8}",
                   f"{100 * (text_runs[m8]['ratio_to_bf16'] - 1):+.2f}%")
    prose.show("""
With the head in 8 bits, SmolLM2's perplexity is {{ch15_ppl_int8_head}} in int8,
{{ch15_ppl_verdict_int8_head}} its 1% target (the head's {{ch15_head_cost_int8}}
percentage points on top of int8's {{ch15_head_base_int8}}), and
{{ch15_ppl_fp8_head}} in FP8, {{ch15_ppl_verdict_fp8_head}} its 2% target (the
head's {{ch15_head_cost_fp8}} percentage points on top of FP8's
{{ch15_head_base_fp8}}):
{{ch15_head_which}}. The engine leaves the switch off by default: what int8 gains at
batch 1 comes with more memory and a cost at batch 256, and
{{ch15_head_default}}.
""")

# %%
# what the engine did with the head in 8 bits (bench/ch15_quantization.py --lm-head):
# the batch-1 and throughput runs of each head on the profiled GPU, the newest version
head_runs = {}
for r in gemv_runs:
    if r["name"] in ("bs1_decode", "throughput") and r["quantization"] is not None:
        key = (r["name"], r["quantization"], r.get("lm_head_8bit", False))
        if r.get("gemv_8bit_version", 1) >= head_runs.get(key, {}).get(
                "gemv_8bit_version", 0):
            head_runs[key] = r
measured_heads = [(n, m8) for (n, m8, head) in head_runs if head]
for name, m8 in measured_heads:
    with_head, without = head_runs[name, m8, True], head_runs.get((name, m8, False))
    print(f"{name}, {m8}: head 8-bit {with_head['value']:,.0f} tok/s (version "
          f"{with_head['gemv_8bit_version']}, {with_head['date']})"
          + (f", head bf16 {without['value']:,.0f} (version "
             f"{without['gemv_8bit_version']}, {without['date']})" if without else ""))
for m8 in head_predicted:  # the step profiled with the head in 8 bits, if it was
    if any(r["quantization"] == m8 and r.get("lm_head_8bit") for r in step_records):
        got = step_parts(m8, head=True)
        print(f"{m8}, head 8-bit, profiled: step {got['wall']:.0f} µs "
              f"({1e6 / got['wall']:,.0f} tok/s; predicted {head_predicted[m8]:.0f} "
              f"µs), GEMVs {got['GEMVs']:.0f} µs")
if not measured_heads:
    print(f"the engine with the head in 8 bits: not yet run on the {step_dev} "
          "(python bench/ch15_quantization.py --lm-head both: the GEMVs first, then "
          "the engine with each head)")

# the same runs on another GPU, where one has made them (an H100's: book/data/h100/)
other_heads = {}
for r in gpu_all + h100_all:
    if (r["device"]["name"] != step_dev and r["name"] in ("bs1_decode", "throughput")
            and r["quantization"] == "int8" and "lm_head_8bit" in r):
        key = (r["device"]["name"], r["name"], r["lm_head_8bit"])
        if r.get("gemv_8bit_version", 1) >= other_heads.get(key, {}).get(
                "gemv_8bit_version", 0):
            other_heads[key] = r
other_devs = [d for d in dict.fromkeys(k[0] for k in other_heads)
              if all((d, n, h) in other_heads for n in ("bs1_decode", "throughput")
                     for h in (False, True))]
if other_devs:
    dev = other_devs[0]
    prose.glue("ch15_head_other_dev", dev)
    change = {}
    for name, key in (("bs1_decode", "bs1"), ("throughput", "tput")):
        bf16_head, head8 = (other_heads[dev, name, h]["value"] for h in (False, True))
        change[key] = head8 / bf16_head - 1
        prose.glue(f"ch15_head_other_{key}", f"{head8:,.0f} tok/s against "
                   f"{bf16_head:,.0f} with the head in bf16 ({change[key]:+.1%})")
        print(f"{dev}, int8, {name}: head 8-bit {head8:,.0f}, head bf16 "
              f"{bf16_head:,.0f} tok/s")
    prose.glue("ch15_head_other_verdict", (
        "Batch 1 gains and batch 256 pays, as predicted above for the H200"
        if change["bs1"] > 0 > change["tput"] else
        "That is not the trade predicted above for the H200 (a gain at batch 1, a "
        "cost at batch 256)"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if other_devs:
    prose.show("""
The {{ch15_head_other_dev}} has run the engine with each head: int8 decodes at batch
1 at {{ch15_head_other_bs1}}, and serves nano-vllm's workload at
{{ch15_head_other_tput}}. {{ch15_head_other_verdict}}; the switch stays off by
default.
""")

# %% [markdown]
# ## Summary
#
# - A decode step at batch 1 reads every weight; in bf16 that caps any engine on one
#   GPU. One byte a weight and one float32 scale a row halve the matrices' bytes.
# - **int8**: $s_n = \max|W_n| / 127$, codes rounded to nearest and clipped; the same
#   step everywhere in a row. **FP8 e4m3**: 1 sign, 4 exponent (bias 7) and 3 mantissa
#   bits, 448 at most, one NaN pattern per sign, no infinities; round to nearest even,
#   saturate; its step a fixed share of each value. On SmolLM2's rows int8's error is
#   the smaller, because no weight there stands far above the rest.
# - The embedded SmolLM2 was itself 4-bit: the comparisons measure how much 8 bits
#   change *that* model.
# - `LLM(model, quantization="int8" | "fp8")` quantizes as the bf16 folder loads; the
#   NumPy backend keeps the dequantized values, the GPU the codes and scales, read by
#   GEMVs that keep chapter 11's fusions. Past `QUANTIZED_GEMV_MAX_TOKENS` token vectors
#   (prefill, batches of a few requests or more) int8 dequantizes into a bf16 scratch
#   for chapter 6's GEMM, and so does FP8 by default. With `FP8_TENSOR_CORE_GEMM` on,
#   FP8 quantizes each token vector too (one scale each, W8A8, as vLLM's FP8 models do;
#   one kernel with the norm where a norm feeds the product) and runs cuBLASLt on
#   Hopper's FP8 tensor cores, both scales applied in its epilogue. Rounding the
#   activations costs SmolLM2 more perplexity than rounding the weights did, in int8 as
#   in FP8: that switch trades accuracy for speed. The tied LM head stays bf16 unless
#   `quantize_lm_head=True`: int8's perplexity barely moves with it, FP8's leaves its
#   target; in int8 it should shorten a batch-1 step (the last GPU section predicts by
#   how much from the records) and costs scratch traffic and memory at batch 256.
# - **GPTQ** keeps the grid and the scales and chooses the codes against the inputs'
#   $X^\top X$, each column's rounding error moved onto the columns not yet rounded.
#   `python -m tinyvllm_lib quantize` does it once, offline, into a **checkpoint**: the
#   Hugging Face matrices' codes (`<name>.weight`) and row scales
#   (`<name>.weight_scale`), a `quantization_config` in `config.json`. `LLM(folder)`
#   loads it as it is, on either backend and on any number of ranks: a row's scale
#   belongs to its row, so cutting and stacking rows is exact.
# - On the H200 the first 8-bit GEMV was bound by the instructions it issued, not by
#   the bytes it read, and made batch 1 slower than bf16. The second widens int8 with
#   no conversion (the byte inside $2^{23}$'s mantissa) and e4m3 in units of
#   $2^{-120}$, and, for matrices of fewer than 16,384 rows, shares each input across
#   four rows. The third and fourth put an int8 code under $2^{23}$ with one byte
#   permute, widen e4m3 two codes at a time with the hardware's conversion, stage the
#   input once in shared memory (normed there for the fused variant), and launch no
#   more blocks than the GPU holds. The fifth puts SiLU·up inside gate-up's GEMV; the
#   sixth shares 8 rows a block at one token, the knobs a sweep of each shape chose on
#   an H100, with as many blocks as the GPU holds of them; the seventh issues the
#   input's loads together before staging them, reads the residual it adds to before
#   the sums, and counts the blocks an SM holds from the compiled registers. The
#   measurement section counts each version's instructions a word of codes in its
#   SASS and says what each bought. At batch 256 int8's bf16 scratch costs
#   throughput; FP8's tensor cores are measured against bf16 in the same run.
# - A profiled batch-1 step splits into its GEMVs and a rest — attention, rotary and
#   cache writes, norms, the sampler — that no weight format shrinks, each of its
#   launches waiting for the one before; the 8-bit GEMVs read the layers' matrices
#   well below bf16's rate, so they, not the bytes, set how far past bf16 8 bits go.
# - Moving the rotary embedding and the newest K/V store inside decode attention
#   saves a launch a layer, and at batch 1 attention grew by about what the launch
#   took: a latency-bound step pays for every round trip in a row, wherever it sits.
#   The library keeps the two launches; the section gives the versions' figures.
# - Past one token the 8-bit GEMV's kernels slow down far faster than their
#   arithmetic grows, and `QUANTIZED_GEMV_MAX_TOKENS` now stops where the crossover
#   section's records say they stop beating the better of the dequantized scratch
#   and the tensor cores; that section gives the figures, and what the paths do to a
#   few requests at once against bf16.
# - Between the GEMV and the scratch, `mma_8bit` feeds bf16 tensor cores from
#   registers: the weights are the mma's 16-row side, the tokens its 8-column side,
#   each code widened to bf16 exactly on its way in, and the chunk's k dealt to the
#   mma's steps in the order each lane loaded them, so no lane needs another's bytes.
#   `QuantizedLinear` takes it past the GEMV's tokens up to
#   `QUANTIZED_MMA_MAX_TOKENS`; the crossover section says what it bought.
# - Asking L2 for a kernel's weights before its wait (version 8) moves bytes
#   earlier but makes none fewer; the section after the step profile sets what it
#   did against the prediction, and the engine compiles it out.
#
# ## Exercises
#
# 1. Give int8 one scale per block of 128 weights within a row instead of one per
#    row. How many bytes does it add for Llama 3.2 1B, and how does the relative error
#    of SmolLM2's matrices change? Where does the scale go in the GEMV's loop?
# 2. e5m2 is the other FP8 format. Write its encoder (which NaN and infinities does it
#    have?) and predict, from the algebra of the error section, its relative error on
#    SmolLM2's rows before you measure it.
# 3. The NumPy backend dequantizes once. Write the integer version — int8 codes, the
#    scale after the sum — and measure both on the CPU. Which is faster, and why?
# 4. With the LM head in 8 bits, how much memory does the second copy of the tied
#    table take for Llama 3.2 1B, and how many tok/s does it predict at batch 1?
# 5. Under tensor parallelism (chapter 13) each rank quantizes its own shard. For a
#    matrix cut by input features, why are a rank's row scales not the whole row's,
#    and does that make the two-rank model's error larger or smaller than one rank's?
#    A checkpoint's ranks keep the whole row's scale instead: which of the two
#    two-rank models has one rank's answers?
# 6. Put the second version's e4m3 widening (the bits moved into place, in units of
#    $2^{-120}$) back into the fourth version's loop in place of the hardware's
#    conversion. Count both loops with `bench/ch15_sass.py`: which instructions does
#    each spend a code, and on which of the SM's pipes (the integer one issues half as
#    many a clock as the float one)? Predict which GEMV is faster on the gate-up shape,
#    then time both.
# 7. Quantize the activations too: one int8 scale per token vector, then `dp4a` (four
#    int8 products summed into an int32 in one instruction) for four codes at a time.
#    What does it cost in accuracy on SmolLM2 (the section on real weights), and how
#    many instructions a code are left?
# 8. Store the checkpoint's q, k and v as one fused `qkv_proj`. What changes in the
#    reader, in chapter 13's sharding, and for a tool that expects Hugging Face names?
#    Then give each matrix one scale instead of one a row, as many FP8 checkpoints do:
#    what must the loader do when it stacks q, k and v, and what does that cost in
#    accuracy on SmolLM2?
