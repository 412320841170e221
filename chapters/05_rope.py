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
# # 5. RoPE: positions as rotations
#
# Attention (chapter 7) scores a query against a key with a dot product, and a dot
# product knows nothing about where the two tokens are. Llama tells it by **rotating**
# queries and keys: each pair of coordinates is turned by an angle proportional to the
# token's position. A rotated query at position $m$ against a rotated key at position
# $n$ then depends on $m - n$ only — the model sees relative positions, at no cost in
# parameters. That is *rotary position embedding*, RoPE (Su et al., 2021).
#
# In this chapter you will learn:
#
# - how RoPE rotates pairs of coordinates, and which coordinates Hugging Face's Llama
#   pairs (the "rotate-half" layout);
# - where the frequencies come from — `rope_theta` — and how Llama 3 rescales the slow
#   ones to reach 128K tokens;
# - why the angles must be computed in float32 exactly as transformers does, and how
#   their error grows with position;
# - whether to look cos and sin up in a table or compute them on the fly;
# - a kernel that rotates Q and K of every head and token in place, inside the fused QKV
#   buffer that attention will read, at arbitrary positions.
#
# The constants come from the model's `config.json` through chapter 2's `ModelConfig`
# ([chapter 2](02_safetensors.py)): `rope_theta`, `head_dim` and `rope_scaling`. The
# measuring tools are [chapter 1](01_bf16.py)'s, and the kernel checks its arguments
# like [chapter 4](04_rmsnorm.py)'s.

# %%
#| default_exp kernels.rope

# %%
import math
import runpy
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

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

# Llama 3.2 1B's attention and RoPE settings, as in its config.json
LLAMA_1B = dict(num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0)
LLAMA_1B_SCALING = dict(
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
LLAMA_1B_MAX_POSITIONS = 131072  # max_position_embeddings

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## The math: rotate pairs
#
# A head vector $x \in \mathbb{R}^d$ ($d$ = `head_dim`, 64 for Llama 3.2 1B) is split
# into $d/2$ pairs. Pair $i$ turns at its own frequency $\omega_i$; at position $p$ it
# is rotated by the angle $\varphi = p\,\omega_i$:
#
# $$ \begin{pmatrix} y_i \\ y_{i+d/2} \end{pmatrix} =
#    \begin{pmatrix} \cos p\omega_i & -\sin p\omega_i \\
#                    \sin p\omega_i & \cos p\omega_i \end{pmatrix}
#    \begin{pmatrix} x_i \\ x_{i+d/2} \end{pmatrix},
#    \qquad \omega_i = \theta^{-2i/d}, \quad i = 0, \dots, d/2 - 1. $$
#
# Which coordinates form a pair is a convention. The paper pairs neighbours
# $(x_{2i}, x_{2i+1})$; Hugging Face's Llama pairs $x_i$ with $x_{i + d/2}$ — the first
# half of the head with the second — and writes the rotation as
# `x * cos + rotate_half(x) * sin`, with `rotate_half(x) = concat(-x[d/2:], x[:d/2])`.
# The two are the same model with the rows of the Q and K weights permuted; that is why
# chapter 2b un-permutes llama.cpp's weights, which use the interleaved layout. This
# book uses Hugging Face's.
#
# Rotations compose by adding angles and preserve dot products, so for a query $q$ at
# position $m$ and a key $k$ at $n$,
# $\langle R_m q, R_n k\rangle = \langle q, R_{n-m} k\rangle$: only the distance $n - m$
# is left.
#
# $\theta$ is `config.rope_theta`: $10^4$ in the original Llama, $10^5$ in SmolLM2,
# $5 \cdot 10^5$ in Llama 3. The frequencies fall geometrically from 1 radian per token
# (pair 0) to almost $1/\theta$ (the last pair): some pairs spin fast and resolve
# neighbouring tokens, others turn so slowly that they tell only the coarse region of a
# long text. The function computes them in float32 *exactly* as transformers does — the
# reason follows below.

# %%
#| export
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numba import cuda


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's frequencies w_i = theta**(-2i/d), i < d/2, in float32 as transformers
    computes them.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if not theta > 1:
        raise ValueError(f"rope_theta must be larger than 1, got {theta}")
    # 2i/d, rounded to float32
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    # theta**(2i/d), rounded once
    power = (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power


# %% [markdown]
# Now the rotation itself, on a `(num_tokens, num_heads, head_dim)` array, with cos and
# sin looked up in tables indexed by position (we build them in a moment). Positions are
# an array: in a batch of several sequences, or a prompt continuing a conversation, row
# $t$ is rarely at position $t$. Every caller that takes positions from a user checks
# them the same way, with `check_positions`.


# %%
#| export
def check_positions(positions, num_tokens: int) -> np.ndarray:
    """Positions as a validated 1-D int64 array of length num_tokens (default 0, 1, ...,
    num_tokens - 1).
    """
    if positions is None:
        return np.arange(num_tokens, dtype=np.int64)
    positions = np.asarray(positions)
    if positions.shape != (num_tokens,) or not (
        positions.dtype.kind in "iu" or positions.size == 0
    ):
        raise ValueError(
            f"positions must be {num_tokens} integers, one per token, got shape "
            f"{positions.shape} of {positions.dtype}"
        )
    if positions.size and positions.min() < 0:
        raise ValueError(f"positions must be >= 0, got {positions.min()}")
    return positions.astype(np.int64)


def apply_rope_ref(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray
) -> np.ndarray:
    """Rotate pairs (x_i, x_{i+d/2}) of x (num_tokens, num_heads, head_dim) by
    positions[t] * w_i; cos, sin: (num_positions, d/2).
    """
    half = x.shape[-1] // 2
    positions = np.asarray(positions)
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(
            f"positions must lie in [0, {cos.shape[0]}), got [{positions.min()}, "
            f"{positions.max()}]"
        )
    # (num_tokens, 1, half): one angle per token and pair, shared by the heads
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_cos_sin(
    inv_freq: np.ndarray, num_positions: int
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (num_positions, d/2) of the angles p * w_i, computed in
    float32 like transformers.
    """
    if not 0 < num_positions <= 2**24:
        raise ValueError(
            "num_positions must be in [1, 2**24] (positions are exact in float32), "
            f"got {num_positions}"
        )
    angles = np.multiply.outer(
        np.arange(num_positions, dtype=np.float32), np.asarray(inv_freq, np.float32)
    )
    return np.cos(angles), np.sin(angles)


# %% [markdown]
# A check of the relative-position property: shift both positions by the same amount and
# the score stays the same.

# %%
head_dim = LLAMA_1B["head_dim"]
cos, sin = rope_cos_sin(rope_inv_freq(head_dim, LLAMA_1B["rope_theta"]), 4096)
q, k = rng.standard_normal((2, 1, 1, head_dim)).astype(np.float32)
scores = []
for shift in [0, 100, 3000]:
    q_rot = apply_rope_ref(q, np.array([7 + shift]), cos, sin)
    k_rot = apply_rope_ref(k, np.array([2 + shift]), cos, sin)
    scores.append(float(np.sum(q_rot * k_rot)))
print("score of query at 7+s against key at 2+s, s = 0, 100, 3000:", scores)
# Equal up to float32 rounding of the angles (about 1e-4 rad at position 3000), measured
# against |q||k|: a relative tolerance on the score alone would fail whenever the score
# happens to be near zero.
assert np.allclose(
    scores, scores[0], rtol=0, atol=1e-4 * float(np.linalg.norm(q) * np.linalg.norm(k))
)

# %% [markdown]
# ## Llama 3's frequency scaling
#
# A pair whose wavelength $\lambda_i = 2\pi/\omega_i$ is longer than any text seen in
# training never completes a turn there, and at longer contexts it reaches angles the
# model has never seen. Llama 3.1 and 3.2 were trained at 8,192 tokens and then extended
# to 131,072 by **slowing the slow pairs down** (a scheme in the spirit of NTK-aware
# interpolation). With $L$ = `original_max_position_embeddings`, $\alpha$ =
# `low_freq_factor`, $\beta$ = `high_freq_factor` and $s$ = `factor`:
#
# $$ \omega_i' = \begin{cases}
#   \omega_i & \lambda_i < L/\beta \quad\text{(fast pairs: unchanged)} \\
#   \omega_i / s & \lambda_i > L/\alpha
#     \quad\text{(slow pairs: } s \text{ times slower)} \\
#   (1 - \gamma_i)\,\omega_i/s + \gamma_i\,\omega_i, \quad \gamma_i
#    = \dfrac{L/\lambda_i - \alpha}{\beta - \alpha} & \text{otherwise (a smooth blend)}
# \end{cases} $$
#
# The values live in `config.json` under `rope_scaling` (or `rope_parameters` in
# transformers 5); chapter 2's `ModelConfig` parses them into `config.rope_scaling`,
# which this function accepts as is (or as a plain dict). The code follows transformers'
# `_compute_llama3_parameters` operation by operation, in float32 — including its habit
# of computing `a / x` as `(1/x) * a` for a tensor `x` — so the result is the same
# float32 numbers, bit for bit.

# %%
#| export
_LLAMA3_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def _scaling_values(scaling) -> list[float]:
    """factor, low_freq_factor, high_freq_factor, original_max_position_embeddings from
    a config object or dict.
    """
    get = (
        scaling.get
        if isinstance(scaling, Mapping)
        else lambda key: getattr(scaling, key, None)
    )
    values = [get(key) for key in _LLAMA3_KEYS]
    if any(v is None for v in values):
        raise ValueError(
            f"llama3 rope scaling needs {', '.join(_LLAMA3_KEYS)}, got {scaling!r}"
        )
    return [float(v) for v in values]


def llama3_scale_inv_freq(inv_freq: np.ndarray, scaling) -> np.ndarray:
    """Llama 3's RoPE frequency scaling, in float32 as transformers'
    _compute_llama3_parameters.
    """
    factor, low, high, original = _scaling_values(scaling)
    f32 = np.float32
    inv_freq = np.asarray(inv_freq, np.float32)
    # torch evaluates 2*pi / x as (1/x) * 2*pi
    wavelen = (f32(1.0) / inv_freq) * f32(2 * math.pi)
    low_freq_wavelen, high_freq_wavelen = f32(original / low), f32(original / high)
    slowed = np.where(wavelen > low_freq_wavelen, inv_freq / f32(factor), inv_freq)
    # gamma
    smooth = ((f32(1.0) / wavelen) * f32(original) - f32(low)) / f32(high - low)
    blended = (f32(1.0) - smooth) * slowed / f32(factor) + smooth * slowed
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, blended, slowed).astype(np.float32)


# %% tags=["hide-input"]
inv_freq = rope_inv_freq(head_dim, LLAMA_1B["rope_theta"])
inv_freq_scaled = llama3_scale_inv_freq(inv_freq, LLAMA_1B_SCALING)
L = LLAMA_1B_SCALING["original_max_position_embeddings"]
fig, ax = new_figure(width=8, height=3.4)
pairs = np.arange(head_dim // 2)
ax.plot(pairs, 2 * np.pi / inv_freq, "o-", ms=3, label="θ = 500,000, unscaled")
ax.plot(
    pairs, 2 * np.pi / inv_freq_scaled, "s-", ms=3, label="Llama 3 scaling (factor 32)"
)
for wl, text in [
    (L / LLAMA_1B_SCALING["high_freq_factor"], "L / high_freq_factor"),
    (L / LLAMA_1B_SCALING["low_freq_factor"], "L / low_freq_factor = trained context"),
]:
    ax.axhline(wl, color="gray", ls=":", lw=1)
    ax.text(0, wl * 1.2, text, color="gray", fontsize=8)
ax.axhline(LLAMA_1B_MAX_POSITIONS, color="k", ls="--", lw=1)
ax.text(0, LLAMA_1B_MAX_POSITIONS * 1.2, "extended context 131,072", fontsize=8)
ax.set_yscale("log")
ax.set_xlabel("pair i")
ax.set_ylabel("wavelength 2π/ω (tokens)")
ax.set_title(
    "Llama 3.2 1B: fast pairs keep their frequency, slow pairs turn 32x slower"
)
ax.legend(loc="lower right")
plt.show()

num_changed = int(np.sum(inv_freq_scaled != inv_freq))
prose.glue("ch05_num_scaled", f"{num_changed} of {head_dim // 2}")
print(f"{num_changed} of {head_dim // 2} frequencies changed")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
{{ch05_num_scaled}} pairs change. The fast ones, whose wavelength is under 2,048 tokens,
keep resolving nearby tokens exactly as in training; pairs that never completed a turn
within 8,192 tokens now turn 32 times slower, so 131,072 tokens span the angles that
4,096 used to; and the pairs in between are blended.
""")

# %% [markdown]
# ## Float32 angles, and why we copy transformers' rounding
#
# The angle $p\,\omega_i$ is computed in float32: the frequency is rounded to 24
# significant bits, and so is the product. Each rounding makes a relative error of up to
# $2^{-24}$, so the absolute error of the angle grows in proportion to the angle itself,
# that is, to the position. The plot compares the float32 angle with the exact one
# (float64 throughout) for the fastest pairs.

# %% tags=["hide-input"]
positions = np.unique(np.geomspace(1, LLAMA_1B_MAX_POSITIONS, 400).astype(np.int64))
exact_freq = np.float64(LLAMA_1B["rope_theta"]) ** (
    -np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
)
angle64 = np.multiply.outer(positions.astype(np.float64), exact_freq)
angle32 = np.multiply.outer(positions.astype(np.float32), inv_freq).astype(np.float64)
angle_error = np.max(np.abs(angle32 - angle64), axis=1)

fig, ax = new_figure(width=8, height=3.2)
ax.loglog(
    positions, angle_error, label="max over pairs of |float32 angle − exact angle|"
)
ax.loglog(positions, positions * 2.0**-24, "--", color="gray", label="position × 2⁻²⁴")
ax.axvline(L, color="gray", ls=":", lw=1)
ax.set_xlabel("position p")
ax.set_ylabel("radians")
ax.set_title("the error of a float32 angle grows with position")
ax.legend()
plt.show()

at_8k = angle_error[np.searchsorted(positions, 8192)]
at_128k = angle_error[-1]
prose.glue("ch05_angle_err_8k", f"{at_8k:.1e} rad")
prose.glue("ch05_angle_err_128k", f"{at_128k:.1e} rad ({np.degrees(at_128k):.2f}°)")
print(
    f"float32 angle error: {at_8k:.2e} rad at 8,192, {at_128k:.2e} rad at "
    f"{LLAMA_1B_MAX_POSITIONS:,}"
)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
The error is {{ch05_angle_err_8k}} at position 8,192 and {{ch05_angle_err_128k}} at
131,072. The model does not care much — it was trained with exactly these float32
angles. But *we* care when we test: compute the table in float64 and round only at the
end, and our cos and sin differ from transformers' by about that much, a hundred times
more than the $10^{-5}$ we want to hold ourselves to. Even NumPy's float32 `**`
disagrees with PyTorch's in the last bit of a few frequencies, which is why
`rope_inv_freq` computes the power in float64 and rounds it once (that matches PyTorch's
correctly rounded float32 power) before the float32 division. So the reference
reproduces transformers' arithmetic — float32 frequencies, float32 positions, a float32
product, then cos and sin — and the tests check it against `LlamaRotaryEmbedding` at
positions up to 8,192, within $10^{-5}$. If transformers is installed, here is the same
check:
""")


# %%
def max_norm_error(a, b) -> float:
    """max|a - b| / max|b|: the error measure of this chapter's tests."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


try:
    # importing transformers in a notebook warns about progress bars
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaRotaryEmbedding,
            apply_rotary_pos_emb,
        )
except ImportError:
    print("transformers is not installed: skipping the comparison (the tests make it)")
else:
    num_tokens, num_heads, num_kv_heads = 64, 4, 2
    test_positions = np.concatenate(
        [[0, 8191, 8192], rng.integers(0, 8193, num_tokens - 3)]
    )
    cos_t8k, sin_t8k = rope_cos_sin(inv_freq_scaled, 8193)
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    hf_config = LlamaConfig(
        hidden_size=num_heads * head_dim,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=LLAMA_1B_MAX_POSITIONS,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": LLAMA_1B["rope_theta"],
            **LLAMA_1B_SCALING,
        },
    )
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(
        torch.zeros(1), torch.from_numpy(test_positions)[None]
    )
    # transformers wants (batch, heads, tokens, head_dim)
    hf_q, hf_k = apply_rotary_pos_emb(
        torch.from_numpy(q.transpose(1, 0, 2))[None],
        torch.from_numpy(k.transpose(1, 0, 2))[None],
        hf_cos,
        hf_sin,
    )
    err_q = max_norm_error(
        apply_rope_ref(q, test_positions, cos_t8k, sin_t8k),
        hf_q[0].numpy().transpose(1, 0, 2),
    )
    err_k = max_norm_error(
        apply_rope_ref(k, test_positions, cos_t8k, sin_t8k),
        hf_k[0].numpy().transpose(1, 0, 2),
    )
    print(
        "against transformers at positions up to 8,192 (llama3 scaling): Q "
        f"{err_q:.1e}, K {err_k:.1e}"
    )
    assert err_q <= 1e-5 and err_k <= 1e-5

# %% [markdown]
# ## A table, or compute on the fly?
#
# A kernel needs $\cos p\,\omega_i$ and $\sin p\,\omega_i$ for every token and pair. Two
# ways:
#
# - **A table**, computed once on the host by the reference above and copied to the GPU:
#   `(num_positions, d/2)` float32 for cos and for sin. For Llama 3.2 1B's full 131,072
#   positions that is 32 MiB; an engine only needs `max_model_len` rows. A token reads
#   one row of each, 256 bytes — against 20 KB of its Q and K (40 heads of 64 floats,
#   read and written). Accuracy is the reference's, by construction.
# - **On the fly**: the kernel multiplies the float32 position by $\omega_i$ — an IEEE
#   product, bit-identical to the host's — and calls `math.cos` and `math.sin`, which
#   compile to CUDA's accurate `cosf`/`sinf`: within 2 ulp, about $10^{-7}$. They cost
#   some 20–40 instructions each, and for angles over about $10^5$ radians (positions
#   past 100,000 for the fastest pair) they switch to a slow exact range reduction (look
#   for `.local` and `.f64` in rung 1's PTX: that path's scratch space and its
#   double-precision arithmetic). Do not be tempted by `fastmath=True`: its `__sinf`
#   reduces the angle crudely, and its error grows with the angle — that is, with the
#   position.
#
# RoPE moves 8 bytes per pair and does about 6 multiply-adds, so it is memory-bound
# either way, and the table is cheap to read because every head of a token shares its
# row. We build both and let the measurement decide. The table and its frequencies
# travel together as a `RopeTable`:


# %%
#| export
@dataclass(frozen=True)
class RopeTable:
    """RoPE's frequencies and cos/sin tables for positions 0..num_positions-1 (NumPy or
    device arrays).
    """

    inv_freq: object  # (head_dim // 2,) float32
    cos: object  # (num_positions, head_dim // 2) float32
    sin: object  # (num_positions, head_dim // 2) float32

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def to_device(self, stream=0) -> "RopeTable":
        """The same table in GPU memory (done once, when the model loads)."""
        return RopeTable(
            *(
                cuda.to_device(np.ascontiguousarray(a), stream=stream)
                for a in (self.inv_freq, self.cos, self.sin)
            )
        )


def rope_table(
    head_dim: int, theta: float, num_positions: int, scaling=None
) -> RopeTable:
    """Frequencies (Llama 3 scaled if `scaling` is given) and their cos/sin table, as
    NumPy arrays.
    """
    inv_freq = rope_inv_freq(head_dim, theta)
    if scaling is not None:
        inv_freq = llama3_scale_inv_freq(inv_freq, scaling)
    return RopeTable(inv_freq, *rope_cos_sin(inv_freq, num_positions))


def rope_table_from_config(config, num_positions: int | None = None) -> RopeTable:
    """The table for a ModelConfig: head_dim, rope_theta, rope_scaling;
    max_position_embeddings rows by default.
    """
    return rope_table(
        config.head_dim,
        config.rope_theta,
        num_positions or config.max_position_embeddings,
        config.rope_scaling,
    )


# %% [markdown]
# ## Where Q and K live: the fused QKV buffer
#
# The attention chapter multiplies the normalised activations by one concatenated weight
# and gets Q, K and V side by side in one float32 buffer, one row per token:
#
# ```text
# row t:  | Q: num_heads * head_dim | K: num_kv_heads * head_dim | V: ... likewise |
# ```
#
# For Llama 3.2 1B: 32 query heads and 8 KV heads (grouped-query attention) of 64, so
# $(32 + 2 \cdot 8) \cdot 64 = 3072$ columns. Q and K are rotated in place; V is not
# touched. Since the K heads directly follow the Q heads, the first $(32 + 8) \cdot 64$
# columns of a row are simply 40 heads to rotate, all at that row's position. The
# reference on this layout:


# %%
#| export
def rope_qkv_ref(
    qkv: np.ndarray,
    positions: np.ndarray,
    table: RopeTable,
    num_heads: int,
    num_kv_heads: int,
) -> np.ndarray:
    """A copy of the fused QKV buffer (num_tokens, (num_heads +
    2*num_kv_heads)*head_dim) with Q and K rotated.
    """
    head_dim = table.head_dim
    num_rotated = num_heads + num_kv_heads  # the K heads directly follow the Q heads
    if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv must be (num_tokens, {(num_heads + 2 * num_kv_heads) * head_dim}), "
            f"got {qkv.shape}"
        )
    out = np.array(qkv, dtype=np.float32)
    # (num_tokens, heads, head_dim)
    qk = out[:, : num_rotated * head_dim].reshape(qkv.shape[0], num_rotated, head_dim)
    out[:, : num_rotated * head_dim] = apply_rope_ref(
        qk, positions, table.cos, table.sin
    ).reshape(qkv.shape[0], -1)
    return out


# %% [markdown]
# ## Rung 1: one thread per pair, angles on the fly
#
# The simplest kernel gives each thread one pair of one head of one token: thread index
# $\to$ (token, head, pair $i$), with $i$ varying fastest, so that the 32 threads of a
# warp touch 32 consecutive floats of the first half of a head, then 32 of its second
# half: coalesced. Each pair is read and written by the same thread, so rotating in
# place is safe.

# %%
#| export
from numba import float32

from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

NAN32 = np.float32("nan")


@cuda.jit
def rope_on_the_fly_kernel(qkv, positions, inv_freq, num_rotated_heads):
    wait_for_previous_kernel()
    idx = cuda.grid(1)
    half = inv_freq.shape[0]
    if idx >= qkv.shape[0] * num_rotated_heads * half:
        return
    i = idx % half  # the pair; fastest, so a warp's loads are coalesced
    head = (idx // half) % num_rotated_heads
    token = idx // (half * num_rotated_heads)
    # the same float32 product as the host's
    angle = float32(positions[token]) * inv_freq[i]
    c = math.cos(angle)
    s = math.sin(angle)
    col = head * 2 * half + i
    x1 = qkv[token, col]
    x2 = qkv[token, col + half]
    qkv[token, col] = x1 * c - x2 * s
    qkv[token, col + half] = x2 * c + x1 * s


# %% [markdown]
# ## Rung 2: look the angle up
#
# The same thread layout, with `cos` and `sin` read from the table's row
# `positions[token]`. The 40 heads of a token read the same table row, so after the
# first it comes from the L1 cache.
#
# A kernel cannot raise an exception. What if a position is outside the table — a bug
# upstream, or a negative number? Reading `cos[pos]` would read some other memory and
# silently produce garbage. Instead the kernel checks and writes NaN into that token's Q
# and K: the failure becomes loud downstream, and nothing outside the table is read.
# (The launcher, below, raises a proper error when it can see the positions.)


# %%
#| export
@cuda.jit
def rope_table_kernel(qkv, positions, cos, sin, num_rotated_heads):
    wait_for_previous_kernel()
    idx = cuda.grid(1)
    half = cos.shape[1]
    if idx >= qkv.shape[0] * num_rotated_heads * half:
        return
    i = idx % half
    head = (idx // half) % num_rotated_heads
    token = idx // (half * num_rotated_heads)
    col = head * 2 * half + i
    pos = positions[token]
    # outside the table: poison, never read out of bounds
    if pos < 0 or pos >= cos.shape[0]:
        qkv[token, col] = NAN32
        qkv[token, col + half] = NAN32
        return
    c = cos[pos, i]
    s = sin[pos, i]
    x1 = qkv[token, col]
    x2 = qkv[token, col + half]
    qkv[token, col] = x1 * c - x2 * s
    qkv[token, col + half] = x2 * c + x1 * s


# %% [markdown]
# ## Rung 3: several heads per thread, loads before stores
#
# In rung 2 every pair pays for its own index arithmetic (three integer divisions), its
# own position load and two table loads, to move 16 bytes. Now each thread takes one
# pair $i$ of `HEADS_PER_THREAD` = 4 consecutive heads of a token: it reads the position
# and the table row once and reuses them for all four. And, as in chapter 4, it issues
# all eight loads of its four pairs before it stores anything — a store into `qkv` would
# otherwise hold back the loads from `qkv` behind it — so eight loads are in flight per
# thread instead of two. The local arrays live in registers because every index is a
# constant after unrolling.

# %%
#| export
HEADS_PER_THREAD = 4


@cuda.jit
def rope_kernel(qkv, positions, cos, sin, num_rotated_heads):
    wait_for_previous_kernel()
    idx = cuda.grid(1)
    half = cos.shape[1]
    num_groups = (num_rotated_heads + HEADS_PER_THREAD - 1) // HEADS_PER_THREAD
    if idx >= qkv.shape[0] * num_groups * half:
        return
    i = idx % half
    first_head = (idx // half) % num_groups * HEADS_PER_THREAD
    token = idx // (half * num_groups)
    pos = positions[token]
    is_valid = pos >= 0 and pos < cos.shape[0]
    # outside the table: poison, never read out of bounds
    c = cos[pos, i] if is_valid else NAN32
    s = sin[pos, i] if is_valid else NAN32
    x1 = cuda.local.array(HEADS_PER_THREAD, float32)
    x2 = cuda.local.array(HEADS_PER_THREAD, float32)
    for j in range(HEADS_PER_THREAD):  # every load first ...
        col = (first_head + j) * 2 * half + i
        if first_head + j < num_rotated_heads:
            x1[j] = qkv[token, col]
            x2[j] = qkv[token, col + half]
    for j in range(HEADS_PER_THREAD):  # ... then every store
        col = (first_head + j) * 2 * half + i
        if first_head + j < num_rotated_heads:
            qkv[token, col] = x1[j] * c - x2[j] * s
            qkv[token, col + half] = x2[j] * c + x1[j] * s


_TABLE_ARGS = "float32[:, ::1], {}[::1], float32[:, ::1], float32[:, ::1], int64"
PTX_SIGNATURES = {
    "rope_on_the_fly_kernel": [
        f"void(float32[:, ::1], {p}[::1], float32[::1], int64)"
        for p in ("int32", "int64")
    ],
    "rope_table_kernel": [f"void({_TABLE_ARGS.format(p)})" for p in ("int32", "int64")],
    "rope_kernel": [f"void({_TABLE_ARGS.format(p)})" for p in ("int32", "int64")],
}

# %% [markdown]
# ## The launcher
#
# It checks the buffer's layout against the head counts and the table, the positions'
# dtype and length, and — when the positions are a NumPy array it can read without a
# copy — their range, raising before anything runs. Positions already on the GPU are not
# copied back just to be checked (that would be a synchronisation in the middle of a
# decode step); for those the kernel's NaN poisoning is the guard. All writes are to
# `qkv`, in place: the launcher allocates nothing.

# %%
#| export
from tinyvllm_lib.kernels.checks import cdiv

ROPE_VARIANTS = ("on_the_fly", "table", "heads_per_thread")
ROPE_THREADS = 256


def check_rope_args(
    qkv,
    positions,
    table: RopeTable,
    num_heads: int,
    num_kv_heads: int,
    caller: str = "rope_qkv",
) -> None:
    """What rotating qkv at these positions by the table needs of them; errors name
    the caller.
    """
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(count, (int, np.integer)) or count <= 0:
            raise ValueError(
                f"{caller}: {name} must be a positive integer, got {count!r}"
            )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{caller}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    half = table.inv_freq.shape[0]
    for name, a, shape in (
        ("inv_freq", table.inv_freq, (half,)),
        ("cos", table.cos, (table.num_positions, half)),
        ("sin", table.sin, table.cos.shape),
    ):
        if (
            a.dtype != np.float32
            or tuple(a.shape) != tuple(shape)
            or not a.flags["C_CONTIGUOUS"]
        ):
            raise TypeError(
                f"{caller}: table.{name} must be contiguous float32 of shape "
                f"{tuple(shape)}, got {a.dtype} {tuple(a.shape)}"
            )
    if qkv.dtype != np.float32:
        raise TypeError(f"{caller}: qkv must be float32, got {qkv.dtype}")
    width = (num_heads + 2 * num_kv_heads) * table.head_dim
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"{caller}: qkv must be (num_tokens, (num_heads + 2*num_kv_heads) * "
            f"head_dim) = (num_tokens, {width}), got {tuple(qkv.shape)}"
        )
    if not qkv.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{caller}: qkv must be C-contiguous")
    if positions.dtype not in (np.int32, np.int64):
        raise TypeError(
            f"{caller}: positions must be int32 or int64, got {positions.dtype}"
        )
    if (
        positions.ndim != 1
        or positions.shape[0] != qkv.shape[0]
        or not positions.flags["C_CONTIGUOUS"]
    ):
        raise ValueError(
            f"{caller}: positions must be contiguous 1-D with one entry per token "
            f"({qkv.shape[0]}), got {tuple(positions.shape)}"
        )
    if isinstance(positions, np.ndarray) and positions.size:
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= table.num_positions:
            raise ValueError(
                f"{caller}: positions must lie in [0, {table.num_positions}) (the "
                f"table's rows), got [{low}, {high}]"
            )


def rope_qkv(
    qkv,
    positions,
    table: RopeTable,
    num_heads: int,
    num_kv_heads: int,
    stream=0,
    variant: str = "heads_per_thread",
):
    """Rotate Q and K of the fused QKV buffer in place, row t at position positions[t];
    V is untouched.
    """
    if variant not in ROPE_VARIANTS:
        raise ValueError(
            f"rope_qkv: variant must be one of {ROPE_VARIANTS}, got {variant!r}"
        )
    check_rope_args(qkv, positions, table, num_heads, num_kv_heads)
    num_tokens, half = qkv.shape[0], table.head_dim // 2
    num_rotated = int(num_heads + num_kv_heads)
    if num_tokens == 0:
        return qkv
    if variant == "heads_per_thread":
        num_threads = num_tokens * cdiv(num_rotated, HEADS_PER_THREAD) * half
        rope_kernel[cdiv(num_threads, ROPE_THREADS), ROPE_THREADS, stream](
            qkv, positions, table.cos, table.sin, num_rotated
        )
    elif variant == "table":
        num_threads = num_tokens * num_rotated * half
        rope_table_kernel[cdiv(num_threads, ROPE_THREADS), ROPE_THREADS, stream](
            qkv, positions, table.cos, table.sin, num_rotated
        )
    else:
        num_threads = num_tokens * num_rotated * half
        rope_on_the_fly_kernel[cdiv(num_threads, ROPE_THREADS), ROPE_THREADS, stream](
            qkv, positions, table.inv_freq, num_rotated
        )
    return qkv


# %% [markdown]
# ## Test every rung against the reference
#
# Random Q, K and V; positions drawn at random, unsorted, with repeats, in int32 and
# int64 (never $0, 1, \dots, n-1$); a head count that does not fill the last group of
# four; one NaN in a query (it must stay confined to its pair); and V compared bit for
# bit, since the kernel must not touch it. The error measure is $\max|a - b| / \max|b|$,
# required to be at most $10^{-5}$. In the simulator the shapes are tiny; on a GPU they
# are Llama 3.2 1B's, with a 2,048-token prefill at random positions up to 131,072
# (where, remember, the angles are large and the table and on-the-fly results differ by
# the float32 cos and sin alone).


# %%
def check_rope(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    table: RopeTable,
    d_table: RopeTable,
    variant: str,
    pos_dtype,
) -> float:
    width = (num_heads + 2 * num_kv_heads) * table.head_dim
    qkv = rng.standard_normal((num_tokens, width)).astype(np.float32)
    qkv[num_tokens // 2, 1] = np.nan  # one NaN in a query: only its pair may turn NaN
    positions = rng.integers(0, table.num_positions, num_tokens).astype(pos_dtype)
    want = rope_qkv_ref(qkv, positions, table, num_heads, num_kv_heads)
    d_qkv = cuda.to_device(qkv)
    rope_qkv(
        d_qkv,
        cuda.to_device(positions),
        d_table,
        num_heads,
        num_kv_heads,
        variant=variant,
    )
    got = d_qkv.copy_to_host()
    v_start = (num_heads + num_kv_heads) * table.head_dim
    assert np.array_equal(got[:, v_start:], qkv[:, v_start:], equal_nan=True), (
        "V was modified"
    )
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaNs in different places"
    ok = ~np.isnan(want)
    err = float(np.max(np.abs(got[ok] - want[ok])) / np.max(np.abs(want[ok])))
    assert err <= 1e-5, f"{variant}: max-norm relative error {err:.2e}"
    return err


if can_launch():
    if is_simulator():
        cases = [(5, 3, 1, rope_table(8, 10000.0, 50))]  # 3 + 1 heads of 8: tiny
    else:
        cases = [
            (
                2048,
                32,
                8,
                rope_table(64, 500000.0, LLAMA_1B_MAX_POSITIONS, LLAMA_1B_SCALING),
            ),
            # SmolLM2's heads and theta
            (37, 9, 3, rope_table(64, 100000.0, 8192)),
        ]
    for num_tokens, num_heads, num_kv_heads, table in cases:
        d_table = table.to_device()
        for variant in ROPE_VARIANTS:
            for pos_dtype in (np.int32, np.int64):
                err = check_rope(
                    num_tokens,
                    num_heads,
                    num_kv_heads,
                    table,
                    d_table,
                    variant,
                    pos_dtype,
                )
            print(
                f"{variant:>16}, {num_tokens} tokens, {num_heads}+{num_kv_heads} "
                f"heads: error {err:.1e}"
            )
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernels")

# %% [markdown]
# Bad input is refused before any launch; a position beyond the table on the GPU turns
# that token's Q and K into NaN instead of reading past the table:

# %%
small = rope_table(8, 10000.0, 16)
qkv_small = np.zeros((3, (2 + 2 * 1) * 8), np.float32)
for bad in [
    dict(positions=np.array([0, 5, 16])),  # 16 is beyond the table's 16 rows
    dict(positions=np.array([0, -1, 2])),  # negative
    dict(positions=np.array([0.0, 1.0, 2.0])),  # float positions
    dict(positions=np.array([0, 1])),  # one per token
    dict(qkv=np.zeros((3, 40), np.float32)),  # not (2 + 2*1) * 8 columns
    dict(qkv=qkv_small.astype(np.float64)),
]:
    args = (
        dict(
            qkv=qkv_small,
            positions=np.arange(3),
            table=small,
            num_heads=2,
            num_kv_heads=1,
        )
        | bad
    )
    try:
        rope_qkv(**args)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad input was accepted")

if can_launch():
    d_qkv = cuda.to_device(rng.standard_normal((3, 32)).astype(np.float32))
    rope_qkv(
        d_qkv, cuda.to_device(np.array([1, 99, 2], np.int32)), small.to_device(), 2, 1
    )
    got = d_qkv.copy_to_host()
    assert (
        np.all(np.isnan(got[1, :24]))
        and not np.any(np.isnan(got[[0, 2]]))
        and not np.any(np.isnan(got[1, 24:]))
    )
    print(
        "position 99 of a 16-row table: that token's Q and K are NaN, V and the "
        "other tokens are intact"
    )

# %% [markdown]
# ## How fast? Count the bytes first
#
# RoPE reads and writes every element of Q and K once, 4 bytes each way, plus the
# positions and the table rows it uses. For a prefill the positions are distinct, so the
# table rows count once per token (rung 1 reads no table); V is not touched and costs
# nothing.


# %% tags=["hide-input"]
def rope_bytes(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pos_itemsize: int = 4,
    uses_table: bool = True,
) -> int:
    """Compulsory bytes: read + write Q and K (float32), the positions, and one cos and
    sin row per token.
    """
    qk = 2 * num_tokens * (num_heads + num_kv_heads) * head_dim * 4
    return (
        qk
        + num_tokens * pos_itemsize
        + (num_tokens * head_dim * 4 if uses_table else 0)
    )


ceiling_gbs, ceiling_name = bandwidth_ceiling()  # chapter 1's best rate
prefill_tokens = 2048
nbytes = rope_bytes(prefill_tokens, 32, 8, 64)
table_share = prefill_tokens * 64 * 4 / nbytes
print(
    f"RoPE on {prefill_tokens} tokens of Llama 3.2 1B: {nbytes / 2**20:.1f} MiB, of "
    f"which the table {table_share:.1%}"
)
prose.glue("ch05_mib", f"{nbytes / 2**20:.1f} MiB")
prose.glue("ch05_table_share", f"{table_share:.1%}")
prose.glue(
    "ch05_predicted_us",
    f"{nbytes / ceiling_gbs / 1e3:.1f} µs" if ceiling_name else "(not yet measured)",
)
prose.glue("ch05_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
A 2,048-token prefill of Llama 3.2 1B moves {{ch05_mib}} ({{ch05_table_share}} of it
table rows), which at {{ch05_ceiling}} takes at least
{{ch05_predicted_us}}. `bench/ch05_rope.py` measures the three rungs there and the last
at decode sizes (1 to 256 tokens), each verified against `rope_qkv_ref` before it is
timed, in CUDA graphs over buffers that do not fit in L2, and records to
`book/data/ch05_rope.json`.
""")

# %% tags=["hide-input"]
if has_gpu():
    bench = (
        Path("../bench/ch05_rope.py")
        if Path("../bench").exists()
        else Path("bench/ch05_rope.py")
    )
    runpy.run_path(str(bench), run_name="__main__")

records = load_records("ch05_rope")
print(f"{len(records)} recorded measurements")
device_name = records[0]["device"]["name"] if records else None
ceiling_gbs, ceiling_name = bandwidth_ceiling(device_name)
print(records_table(records, time_key="us", ceiling=ceiling_gbs))


# %% tags=["hide-input"]
def find(name: str, num_tokens: int) -> dict | None:
    return next(
        (r for r in records if r["name"] == name and r["shape"][0] == num_tokens), None
    )


best, by_table, on_the_fly = (
    find(f"rope_{v}", prefill_tokens)
    for v in ("heads_per_thread", "table", "on_the_fly")
)
decode_1 = find("rope_heads_per_thread", 1)
prose.glue(
    "ch05_device", records[0]["device"]["name"] if records else "GPU (not yet measured)"
)
for key, rec in [
    ("ch05_best", best),
    ("ch05_table", by_table),
    ("ch05_fly", on_the_fly),
]:
    # the share of the ceiling, computed now rather than the ratio stored with rec
    share = rec and ceiling_name and f"{rec['value'] / ceiling_gbs:.0%}"
    prose.glue(key, share or "(not yet measured)")
prose.glue("ch05_best_us", f"{best['us']:.1f} µs" if best else "(not yet measured)")
prose.glue(
    "ch05_decode_us", f"{decode_1['us']:.1f} µs" if decode_1 else "(not yet measured)"
)

if records:
    fig, (ax_bw, ax_us) = new_figure(1, 2, width=11, height=3.2)
    ladder = [r for r in records if r["shape"][0] == prefill_tokens]
    ax_bw.barh(
        [r["name"] for r in ladder], [r["value"] for r in ladder], color="#1f77b4"
    )
    ax_bw.axvline(
        ceiling_gbs, color="k", ls="--", lw=1, label=f"ceiling: {ceiling_name}"
    )
    ax_bw.set_xlabel("GB/s (compulsory bytes)")
    ax_bw.set_title(f"{prefill_tokens} tokens, 32 + 8 heads of 64")
    ax_bw.legend()
    pts = sorted(
        (r["shape"][0], r["us"])
        for r in records
        if r["name"] == "rope_heads_per_thread"
    )
    ax_us.plot(*zip(*pts), "o-")
    ax_us.set_xscale("log", base=2)
    ax_us.set_xlabel("tokens")
    ax_us.set_ylabel("µs per call")
    ax_us.set_title(f"rope_kernel, {records[0]['device']['name']}")
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch05_device}}, computing the angles on the fly reaches {{ch05_fly}} of
{{ch05_ceiling}}, the table {{ch05_table}}, and several heads per thread {{ch05_best}}
({{ch05_best_us}} for 2,048 tokens). Every rung reads Q and K in full 128-byte lines, so
the differences are in what each thread does per byte: the sine and cosine, the index
arithmetic, and how many loads it keeps in flight. A decode step with one token rotates
40 heads in {{ch05_decode_us}} — launch and latency, not bandwidth, which is why engines
often fuse RoPE into a neighbouring kernel (the one that writes the KV cache, say)
instead of launching it alone.
""")

# %% [markdown]
# ## Summary
#
# - RoPE rotates pair $(x_i, x_{i+d/2})$ of every query and key head by $p\,\omega_i$
#   with $\omega_i = \theta^{-2i/d}$; the dot product of a rotated query and key depends
#   on their distance only. Hugging Face's Llama pairs the two halves of a head ("rotate
#   half").
# - Llama 3 slows the pairs whose wavelength exceeds the training context by `factor`,
#   keeps the fast ones and blends in between; $\theta$ and the scaling come from the
#   config.
# - Angles are float32, as transformers computes them; their error grows in proportion
#   to the position, so the reference reproduces transformers' rounding and agrees with
#   it within $10^{-5}$ up to position 8,192.
# - A cos/sin table costs 256 bytes per token against 20 KB of Q and K; angles on the
#   fly cost instructions. One kernel rotates Q and K in place in the fused QKV buffer
#   at arbitrary int32 or int64 positions, and poisons out-of-range tokens with NaN
#   rather than read past the table.
#
# Exported to `tinyvllm_lib.kernels.rope`: `rope_inv_freq`, `llama3_scale_inv_freq`,
# `rope_cos_sin`, `RopeTable`, `rope_table`, `rope_table_from_config`, `apply_rope_ref`,
# `rope_qkv_ref`, the kernels of the ladder and the launcher `rope_qkv`.
#
# ## Exercises
#
# 1. Write `apply_rope_ref` for the interleaved layout $(x_{2i}, x_{2i+1})$. Find the
#    permutation of Q's weight rows that makes it give the same attention scores as the
#    rotate-half layout, and compare it with the one chapter 2b applies to llama.cpp's
#    weights.
# 2. With `rope_theta` = 500,000 and `head_dim` = 64, which pairs complete fewer than
#    one turn in 8,192 tokens, before and after Llama 3's scaling?
# 3. Compute the cos/sin table in float64 and round it to float32 at the end. How far is
#    it from transformers' at positions 1,000, 8,192 and 131,072? Is it more or less
#    *correct*?
# 4. Add `fastmath=True` to `rope_on_the_fly_kernel`, run it on a GPU at positions up to
#    131,072 and plot its error against the table's by position. Then measure its speed.
# 5. How many bytes does RoPE move per decode step of Llama 3.2 1B (16 layers) with 64
#    sequences? How long should that take at the ceiling, and how long does the
#    benchmark say 64 tokens take per layer?
# 6. Change `HEADS_PER_THREAD` to 1, 2, 8 and 40. Predict the trend, then measure it
#    with the benchmark script.
