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
# # 7. Attention: the whole forward pass
#
# Chapters 3 to 6 built every piece of a Llama layer that works on one token at a time:
# the embedding lookup, RMSNorm, RoPE and the linear layers. One piece is missing, and
# it is the only one in which tokens talk to each other: **attention**. Each token asks
# a question (its *query*), compares it with what every earlier token offers (their
# *keys*), and takes a weighted average of what they carry (their *values*). This
# chapter builds it, adds the MLP's gated activation, and assembles the complete forward
# pass — twice: in NumPy, checked against Hugging Face `transformers`, and with our
# kernels, checked against NumPy.
#
# In this chapter you will learn:
#
# - how a layer makes queries, keys and values with **one** matrix product, and how
#   **grouped-query attention** lets several query heads share one key/value head;
# - the **causal mask**, and three softmaxes: naive (it overflows), safe (subtract the
#   maximum) and **online** (one pass, with a running maximum and sum);
# - two attention kernels: one that writes the whole `(heads, T, T)` score matrix to
#   memory, and a FlashAttention-style kernel that streams tiles of K and V through
#   shared memory and never writes a score;
# - the SiLU-gated MLP, with gate and up in one matrix product;
# - the Llama forward pass in NumPy (our reference, and the engine's CPU backend),
#   matched to `transformers` to $10^{-3}$, and with the kernels, matched to NumPy.
#
# It uses the model config and weight loader of [chapter 2](02_safetensors.py), SmolLM2
# from [chapter 2b](02b_smollm2.py), the tokenizer and embedding of
# [chapter 3](03_first_kernel.py), RMSNorm from [chapter 4](04_rmsnorm.py), RoPE from
# [chapter 5](05_rope.py) and the linear layer of [chapter 6](06_gemm.py).

# %%
#| default_exp kernels.attention

# %%
import math
import runpy
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.measure import (
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
    records_table,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, has_gpu, is_simulator, where_kernels_run
from tinyvllm_lib.tokenizer import Tokenizer

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
# ## A Llama layer, top to bottom
#
# The residual stream $x$ holds one row of `hidden_size` numbers per token. Each of the
# `num_hidden_layers` layers adds two things to it — what attention found in other
# tokens, then what the MLP makes of it:
#
# $$
# \begin{aligned}
# h &= x + W_o \,\operatorname{Attn}\!\big(\operatorname{RoPE}(W_{qkv}\
#    , \operatorname{RMSNorm}(x))\big) \\
# x' &= h + W_\text{down}\big(\operatorname{SiLU}(W_\text{gate}\, \hat h)
#    \odot W_\text{up}\, \hat h\big),
# \qquad \hat h = \operatorname{RMSNorm}(h)
# \end{aligned}
# $$
#
# After the last layer comes one more RMSNorm and the **LM head**, a linear layer from
# `hidden_size` to `vocab_size` whose outputs are the logits of the next token. Many
# models, SmolLM2 and Llama 3.2 1B among them, *tie* the head to the embedding table:
# the same matrix turns token ids into vectors on the way in and vectors into scores on
# the way out.
#
# **Activation dtypes.** The kernels keep the same rule as chapters 4 and 6, now for the
# whole pass:
#
# | what | dtype | shape |
# | --- | --- | --- |
# | residual stream $x$, $h$ | float32 | `(num_tokens, hidden)` |
# | linear layers' inputs (norm outputs, attention, SiLU·up) | bf16 | `(tokens, in)` |
# | linear layers' outputs (qkv, o, gate_up, down, logits) | float32 | `(tokens, out)` |
#
# RMSNorm (chapter 4) and the attention and SiLU kernels of this chapter write bf16
# straight away where a linear layer reads their output, so no separate conversion
# kernel runs. The NumPy reference does every step in float32, as `transformers` does in
# float32; it can also round the inputs of its linear layers to bf16, to show how much
# that rounding moves the result.
#
# We work on SmolLM2 (30 layers, 9 query heads, 3 key/value heads of 64) and keep Llama
# 3.2 1B's shapes in mind (16 layers, 32 query heads, 8 key/value heads of 64).

# %%
# chapter 2b: built on first use, then found in the cache
folder = resolve_model("smollm2")
config = ModelConfig.from_folder(folder)
# bf16 bits (uint16), Hugging Face names
weights = load_weights(folder, config, progress=False)
tokenizer = Tokenizer.from_folder(folder)
H, KVH, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
print(config)

# %% [markdown]
# ## Q, K and V in one matrix product
#
# Each layer projects the normalised stream three times: $q = W_q x$ with `num_heads`
# heads of `head_dim`, and $k = W_k x$, $v = W_v x$ with `num_kv_heads` heads each.
# Three matrices that read the same input are one matrix: stack their rows,
#
# $$ \begin{bmatrix} q \\ k \\ v \end{bmatrix}
#    = \begin{bmatrix} W_q \\ W_k \\ W_v \end{bmatrix} x,
# \qquad W_{qkv} \in \mathbb{R}^{(H + 2 H_{kv}) D \times \text{hidden}}. $$
#
# One launch instead of three, the input read once instead of three times, and one
# larger matrix product, which keeps more of the GPU busy than three small ones. The
# same holds for the MLP's gate and up projections. We concatenate the bf16 weights
# once, at load time; the output of the fused product is a row per token laid out as
# `[q heads | k heads | v heads]`, and every kernel below reads that layout. The LM head
# is resolved here too: the embedding table when the head is tied.

# %%
#| export models.llama_numpy
import numpy as np

from tinyvllm_lib.models.config import ModelConfig


def fuse_llama_weights(
    weights: dict[str, np.ndarray], config: ModelConfig
) -> dict[str, np.ndarray]:
    """A checkpoint's tensors (Hugging Face names) in the model's layout: q/k/v and
    gate/up stacked, the head resolved.
    """
    fused = {
        "embed_tokens": weights["model.embed_tokens.weight"],
        "norm": weights["model.norm.weight"],
    }
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        fused[dst + "input_layernorm"] = weights[src + "input_layernorm.weight"]
        qkv = [
            weights[src + f"self_attn.{name}_proj.weight"] for name in ("q", "k", "v")
        ]
        fused[dst + "qkv_proj"] = np.concatenate(qkv)  # ((H + 2 KVH) * D, hidden)
        fused[dst + "o_proj"] = weights[src + "self_attn.o_proj.weight"]
        fused[dst + "post_attention_layernorm"] = weights[
            src + "post_attention_layernorm.weight"
        ]
        gate_up = [weights[src + f"mlp.{name}_proj.weight"] for name in ("gate", "up")]
        # (2 * intermediate, hidden)
        fused[dst + "gate_up_proj"] = np.concatenate(gate_up)
        fused[dst + "down_proj"] = weights[src + "mlp.down_proj.weight"]
    fused["lm_head"] = (
        fused["embed_tokens"]
        if config.tie_word_embeddings
        else weights["lm_head.weight"]
    )
    return fused


# %%
fused = fuse_llama_weights(weights, config)
# float64: the fused and separate products round alike to far below the tolerance
# (in float32, BLAS may sum them in different orders)
x = rng.standard_normal((5, config.hidden_size))
qkv = x @ bf16_bits_to_f32(fused["layers.0.qkv_proj"]).T  # (5, (H + 2 KVH) * D)
separate = [
    x @ bf16_bits_to_f32(weights[f"model.layers.0.self_attn.{n}_proj.weight"]).T
    for n in "qkv"
]
assert np.allclose(qkv, np.concatenate(separate, axis=1), rtol=1e-5, atol=1e-5)
print(
    f"qkv_proj {fused['layers.0.qkv_proj'].shape} = q {H}x{D} + k {KVH}x{D} + v "
    f"{KVH}x{D} rows; "
    f"gate_up_proj {fused['layers.0.gate_up_proj'].shape}"
)

# %% [markdown]
# ## Grouped-query attention
#
# In the original transformer every query head has its own key and value head. Llama 2
# 70B and every Llama 3 model use **grouped-query attention** (GQA, Ainslie et al.,
# 2023): the `num_heads` query heads are split into `num_kv_heads` groups, and each
# group shares one key and one value head. Query head $h$ reads key/value head
#
# $$ g(h) = \left\lfloor \frac{h}{H / H_{kv}} \right\rfloor. $$
#
# Attention itself costs the same, but the keys and values — which chapter 8 keeps for
# every past token in the *KV cache* — shrink by $H / H_{kv}$: by 3 for SmolLM2, by 4
# for Llama 3.2 1B.


# %%
def draw_gqa(ax, num_heads: int, num_kv_heads: int, title: str) -> None:
    """Query heads (top) joined to the key/value head they read (bottom), one colour per
    group.
    """
    group = num_heads // num_kv_heads
    colors = plt.cm.tab10(np.arange(num_kv_heads) % 10)
    kv_x = [(g + 0.5) * num_heads / num_kv_heads - 0.5 for g in range(num_kv_heads)]
    for h in range(num_heads):
        ax.plot([h, kv_x[h // group]], [1, 0], color=colors[h // group], lw=1)
        ax.add_patch(plt.Rectangle((h - 0.4, 0.95), 0.8, 0.3, color=colors[h // group]))
    for g in range(num_kv_heads):
        ax.add_patch(
            plt.Rectangle((kv_x[g] - 0.6, -0.25), 1.2, 0.3, color=colors[g], ec="k")
        )
    ax.text(-1.2, 1.1, "query heads", ha="right", va="center")
    ax.text(-1.2, -0.1, "KV heads", ha="right", va="center")
    ax.set_xlim(-7, num_heads)
    ax.set_ylim(-0.4, 1.4)
    ax.set_title(title)
    ax.axis("off")


fig, axes = new_figure(2, 1, width=9, height=3.6)
draw_gqa(axes[0], H, KVH, f"SmolLM2: {H} query heads share {KVH} key/value heads")
draw_gqa(axes[1], 32, 8, "Llama 3.2 1B: 32 query heads share 8 key/value heads")
plt.show()

# %% [markdown]
# ## The causal mask
#
# A language model predicts token $t + 1$ from tokens $0 \ldots t$, so during training
# the row of token $t$ must not see later tokens — and at inference time later tokens do
# not exist yet. Query $i$ attends to key $j$ only when $j \le i$: the score matrix is
# lower-triangular. Set the scores above the diagonal to $-\infty$ and the softmax gives
# them weight exactly 0:
#
# $$ s_{ij} = \begin{cases} \dfrac{q_i
#    \cdot k_j}{\sqrt{D}} & j \le i \\ -\infty & j > i \end{cases}
# \qquad p_{ij} = \operatorname{softmax}_j(s_{ij}), \qquad o_i
#    = \sum_{j \le i} p_{ij}\, v_j. $$
#
# The $1/\sqrt{D}$ keeps the scores' spread independent of `head_dim`: a dot product of
# $D$ terms of unit variance has variance $D$.
#
# ## Softmax, three ways
#
# The textbook softmax, $p_j = e^{s_j} / \sum_k e^{s_k}$, overflows: `float32` holds
# $e^{s}$ only up to $s \approx 88.7$. Scores that large are rare in trained models, but
# they happen, and one `inf` makes `inf / inf = nan` of the whole row:


# %%
def softmax_naive(s: np.ndarray) -> np.ndarray:
    """exp(s) / sum(exp(s)) along the last axis: overflows for scores above ~88.7 in
    float32.
    """
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


scores = np.array([3.0, 1.0, 0.25], np.float32)
with np.errstate(over="ignore", invalid="ignore"):
    print("naive, small scores:", softmax_naive(scores))
    # the same distribution, in principle
    print("naive, scores + 90 :", softmax_naive(scores + 90))
    assert np.isnan(softmax_naive(scores + 90)).all()

# %% [markdown]
# Softmax does not change when a constant is subtracted from every score
# ($e^{s_j - m} / \sum_k e^{s_k - m}$, the $e^{-m}$ cancels). With $m = \max_k s_k$
# every exponent is at most 0, so nothing overflows and the largest term is exactly 1,
# so the sum cannot underflow to 0 either. This **safe softmax** is the library's
# reference:
#
# $$ m = \max_k s_k, \qquad p_j = \frac{e^{s_j - m}}{\sum_k e^{s_k - m}}. $$
#
# Its logarithm, $\log p_j = s_j - m - \log \sum_k e^{s_k - m}$, is how we will compare
# models (log-probabilities) and what the sampler reports: `log_softmax`, beside it.
# Both go to a module of their own, `kernels.softmax`, which imports no numba: the
# engine's host side (the sampler, a request's log-probs) uses them without pulling in
# the GPU's modules.

# %%
#| export kernels.softmax
import numpy as np


def softmax_ref(scores: np.ndarray) -> np.ndarray:
    """Safe softmax along the last axis, in float32: exp(s - max s) / sum. Rows of -inf
    only are not allowed.
    """
    m = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p = logits - max - log(sum(exp(logits - max))) along the last axis (float32
    in, float32 out).
    """
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


# %%
print("safe, scores + 90  :", softmax_ref(scores + 90))
assert np.allclose(softmax_ref(scores + 90), softmax_naive(scores), rtol=1e-6)

# %% [markdown]
# The safe softmax reads the scores three times: for the maximum, for the sum, and to
# divide. A kernel that never stores the scores cannot do that. The **online softmax**
# (Milakov and Gimelshein, 2018) keeps a running maximum $m$ and a running sum $\ell$
# *relative to that maximum*, and rescales the sum whenever the maximum grows:
#
# $$ m_j = \max(m_{j-1}, s_j), \qquad \ell_j = \ell_{j-1}\, e^{m_{j-1} - m_j}
#    + e^{s_j - m_j},
# \qquad m_0 = -\infty,\ \ell_0 = 0. $$
#
# For attention we do not even need the probabilities, only $o = \sum_j p_j v_j$. So
# keep an unnormalised output accumulator $a$ rescaled the same way, and divide once at
# the end (FlashAttention, Dao et al., 2022):
#
# $$ a_j = a_{j-1}\, e^{m_{j-1} - m_j} + e^{s_j - m_j}\, v_j, \qquad o
#    = a_T / \ell_T. $$
#
# Nothing changes if the keys come in **blocks**: take the block's maximum, rescale once
# per block, then add the block's terms. That is what the fused kernel will do with a
# tile of keys at a time. In NumPy, for one query:


# %%
def online_attention_row(s: np.ndarray, v: np.ndarray, block: int) -> np.ndarray:
    """o = softmax(s) @ v for one query, reading the keys `block` at a time: one pass,
    running max and sum.
    """
    m, ell, acc = np.float32(-np.inf), np.float32(0), np.zeros(v.shape[1], np.float32)
    for j0 in range(0, len(s), block):
        s_blk, v_blk = s[j0 : j0 + block], v[j0 : j0 + block]
        m_new = max(m, s_blk.max())
        alpha = np.exp(m - m_new)  # how much the old terms shrink; 0 on the first block
        p = np.exp(s_blk - m_new)
        ell = ell * alpha + p.sum()
        acc = acc * alpha + p @ v_blk
        m = m_new
    return acc / ell


# large scores: the naive softmax would overflow
s = (rng.standard_normal(37) * 5 + 80).astype(np.float32)
v = rng.standard_normal((37, 8)).astype(np.float32)
want = softmax_ref(s) @ v
for block in (1, 4, 16, 37):
    assert np.allclose(online_attention_row(s, v, block), want, rtol=1e-5, atol=1e-6)
print("online softmax with blocks of 1, 4, 16 and 37 keys = safe softmax, then @ v")

# %% [markdown]
# ## Attention in NumPy: the reference
#
# The reference takes the fused buffer that the QKV projection wrote and chapter 5
# rotated — `qkv`, float32 `(num_tokens, (H + 2 H_kv) D)` — and returns float32
# `(num_tokens, H D)`, the heads side by side, which is the layout `o_proj` reads. GQA
# is a `repeat` of each key/value head over its group of query heads. It can also return
# the probabilities, for pictures.


# %%
#| export
import math

import numpy as np

from tinyvllm_lib.kernels.softmax import softmax_ref


def split_qkv(qkv: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views q (T, H, D), k (T, KVH, D), v (T, KVH, D) of a fused qkv buffer (T, (H + 2
    KVH) * D).
    """
    num_tokens = qkv.shape[0]
    k_start, v_start = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :k_start].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, k_start:v_start].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, v_start:].reshape(num_tokens, num_kv_heads, head_dim)
    return q, k, v


def attention_ref(
    qkv: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    return_probs: bool = False,
):
    """Causal grouped-query attention of one sequence, float32: qkv (T, (H + 2 KVH) D)
    after RoPE -> (T, H D).
    """
    check_qkv("attention_ref", qkv, num_heads, num_kv_heads, head_dim)
    num_tokens, group = qkv.shape[0], num_heads // num_kv_heads
    q, k, v = split_qkv(np.asarray(qkv, np.float32), num_heads, num_kv_heads, head_dim)
    q = q.transpose(1, 0, 2)  # (H, T, D)
    # (H, T, D): query head h reads KV head h // group
    k = np.repeat(k.transpose(1, 0, 2), group, axis=0)
    v = np.repeat(v.transpose(1, 0, 2), group, axis=0)
    # (H, T, T)
    scores = (q @ k.transpose(0, 2, 1)) * np.float32(1 / math.sqrt(head_dim))
    # key j after query i
    is_future = np.triu(np.ones((num_tokens, num_tokens), bool), k=1)
    scores[:, is_future] = -np.inf
    probs = softmax_ref(scores)  # (H, T, T), zero above the diagonal
    # (T, H * D)
    out = (probs @ v).transpose(1, 0, 2).reshape(num_tokens, num_heads * head_dim)
    return (out, probs) if return_probs else out


# %% [markdown]
# Every function that takes a fused buffer checks it the same way, before any work:

# %%
#| export
from tinyvllm_lib.kernels.checks import is_c_contiguous


def check_qkv(name: str, qkv, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Check a fused qkv buffer and its head counts; return num_tokens."""
    for label, value in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if (
            not isinstance(value, (int, np.integer))
            or isinstance(value, bool)
            or value <= 0
        ):
            raise ValueError(
                f"{name}: {label} must be a positive integer, got {value!r}"
            )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{name}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    if qkv.dtype != np.float32:
        raise TypeError(
            f"{name}: qkv must be float32 (a linear layer's output), got {qkv.dtype}"
        )
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"{name}: qkv must be (num_tokens, (num_heads + 2 * num_kv_heads) * "
            f"head_dim) = (T, {width}), "
            f"got {tuple(qkv.shape)}"
        )
    if not is_c_contiguous(qkv):
        raise ValueError(f"{name}: qkv must be C-contiguous")
    return qkv.shape[0]


def check_out(name: str, out, shape: tuple, dtypes=(np.float32, np.uint16)) -> None:
    """Check an output buffer: dtype among `dtypes` (uint16 = bf16 bits), shape,
    C-contiguous.
    """
    if out.dtype not in dtypes:
        raise TypeError(
            f"{name}: out must be {' or '.join(np.dtype(d).name for d in dtypes)} "
            f"(uint16 = bf16 bits), got {out.dtype}"
        )
    if tuple(out.shape) != tuple(shape) or not is_c_contiguous(out):
        raise ValueError(
            f"{name}: out must be C-contiguous of shape {tuple(shape)}, got "
            f"{tuple(out.shape)}"
        )


# %%
T_demo = 6
qkv_demo = rng.standard_normal((T_demo, (H + 2 * KVH) * D)).astype(np.float32)
out_demo, probs_demo = attention_ref(qkv_demo, H, KVH, D, return_probs=True)
assert (
    np.allclose(probs_demo.sum(-1), 1, rtol=1e-6)
    and not probs_demo[
        :, np.triu_indices(T_demo, 1)[0], np.triu_indices(T_demo, 1)[1]
    ].any()
)
q_demo, k_demo, v_demo = split_qkv(qkv_demo, H, KVH, D)
i, h = 4, 5  # one query, one head, by hand
s_row = np.array(
    [q_demo[i, h] @ k_demo[j, h // (H // KVH)] for j in range(i + 1)]
) / np.sqrt(D)
assert np.allclose(
    out_demo[i, h * D : (h + 1) * D],
    softmax_ref(s_row) @ v_demo[: i + 1, h // (H // KVH)],
    rtol=1e-4,
    atol=1e-5,
)

fig, ax = new_figure(width=3.2, height=3)
ax.imshow(probs_demo[h], cmap="viridis")
ax.set_xlabel("key j")
ax.set_ylabel("query i")
ax.set_title(f"p_ij of head {h}: causal")
plt.show()

# %% [markdown]
# ## Rung 1: materialise the scores
#
# The direct translation into kernels is three launches, one per line of the math:
#
# 1. `attention_scores_kernel`: a thread per score $(h, i, j)$ computes
#    $q_i \cdot k_{g(h),j} / \sqrt D$, or writes $-\infty$ above the diagonal — the
#    causal mask, materialised;
# 2. `softmax_rows_kernel`: a block per row $(h, i)$, the safe softmax in place, with
#    two shared-memory tree reductions (chapter 4's rung 2), one for the maximum, one
#    for the sum;
# 3. `attention_pv_kernel`: a thread per output element $(i, h D + d)$ sums
#    $p_{ij} v_{j,d}$ over $j \le i$ (the probabilities past the diagonal are exactly
#    zero, so the loop stops there).
#
# The third kernel writes through chapter 4's `store_activation`, so it can write
# float32 or, for `o_proj`, bf16. The cost is the score matrix: `num_heads` × T × T
# float32 values, written once, read three times by the softmax, written twice and read
# once more. At T = 2048 with 32 heads that is 512 MiB — more than the weights of
# SmolLM2 — and at T = 8192 it is 8 GiB.

# %%
#| export kernels.attention_materialized
import math

import numpy as np
from numba import cuda, float32

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.attention import check_out, check_qkv
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

SCORES_BLOCK = (32, 8)  # threads along keys, along queries
SOFTMAX_THREADS = 128  # the most threads of a softmax block (a power of two)


@cuda.jit
def attention_scores_kernel(qkv, num_heads, num_kv_heads, scale, scores):
    wait_for_previous_kernel()
    j, i = cuda.grid(2)  # key, query
    h = cuda.blockIdx.z  # query head
    num_tokens = qkv.shape[0]
    if i >= num_tokens or j >= num_tokens:
        return
    if j > i:
        scores[h, i, j] = -math.inf  # the causal mask: a query never sees a later key
        return
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q0 = h * head_dim
    # the KV head of h's group
    k0 = (num_heads + h // (num_heads // num_kv_heads)) * head_dim
    s = float32(0.0)
    for d in range(head_dim):
        s += qkv[i, q0 + d] * qkv[j, k0 + d]
    scores[h, i, j] = s * scale


@cuda.jit(device=True)
def _block_reduce(partial, value, is_max):
    """Max (is_max) or sum of `value` over a block (a power-of-two of threads), via a
    shared-memory tree.
    """
    tid = cuda.threadIdx.x
    partial[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            other = partial[tid + stride]
            partial[tid] = max(partial[tid], other) if is_max else partial[tid] + other
        cuda.syncthreads()
        stride //= 2
    total = partial[0]
    # everyone has read partial[0] before the next reduction overwrites it
    cuda.syncthreads()
    return total


@cuda.jit
def softmax_rows_kernel(scores):
    wait_for_previous_kernel()
    # one block per row
    h, i = cuda.blockIdx.x // scores.shape[1], cuda.blockIdx.x % scores.shape[1]
    tid, num_threads, num_keys = cuda.threadIdx.x, cuda.blockDim.x, scores.shape[2]
    partial = cuda.shared.array(SOFTMAX_THREADS, float32)
    m = float32(-math.inf)
    for j in range(tid, num_keys, num_threads):
        m = max(m, scores[h, i, j])
    m = _block_reduce(partial, m, True)
    total = float32(0.0)
    for j in range(tid, num_keys, num_threads):
        e = math.exp(scores[h, i, j] - m)  # exp(-inf) = 0: the mask
        scores[h, i, j] = e
        total += e
    inv_total = float32(1.0) / _block_reduce(partial, total, False)
    for j in range(tid, num_keys, num_threads):
        scores[h, i, j] *= inv_total


@cuda.jit
def attention_pv_kernel(probs, qkv, num_heads, num_kv_heads, out):
    wait_for_previous_kernel()
    c, i = cuda.grid(2)  # output column (h * head_dim + d), query
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if i >= qkv.shape[0] or c >= num_heads * head_dim:
        return
    h, d = c // head_dim, c % head_dim
    v_col = (num_heads + num_kv_heads + h // (num_heads // num_kv_heads)) * head_dim + d
    acc = float32(0.0)
    for j in range(i + 1):  # p_ij = 0 past the diagonal
        acc += probs[h, i, j] * qkv[j, v_col]
    store_activation(out, i, c, acc)


def _pow2_threads(n: int, most: int) -> int:
    """The smallest power of two >= n, at most `most`."""
    return min(most, 1 << (max(n, 1) - 1).bit_length())


def attention_materialized(
    qkv, num_heads: int, num_kv_heads: int, head_dim: int, scores, out, stream=0
):
    """Rung 1: scores (H, T, T) = masked q kᵀ / √D, softmax in place, out (T, H D) = P v
    (float32 or bf16 bits).
    """
    num_tokens = check_qkv(
        "attention_materialized", qkv, num_heads, num_kv_heads, head_dim
    )
    check_out(
        "attention_materialized",
        scores,
        (num_heads, num_tokens, num_tokens),
        (np.float32,),
    )
    check_out("attention_materialized", out, (num_tokens, num_heads * head_dim))
    if num_tokens == 0:
        return out
    scale = np.float32(1 / math.sqrt(head_dim))
    bx, by = SCORES_BLOCK
    grid = (cdiv(num_tokens, bx), cdiv(num_tokens, by), num_heads)
    attention_scores_kernel[grid, SCORES_BLOCK, stream](
        qkv, num_heads, num_kv_heads, scale, scores
    )
    softmax_rows_kernel[
        num_heads * num_tokens,
        _pow2_threads(cdiv(num_tokens, 8), SOFTMAX_THREADS),
        stream,
    ](scores)
    threads = _pow2_threads(num_heads * head_dim, 128)
    attention_pv_kernel[
        (cdiv(num_heads * head_dim, threads), num_tokens), (threads, 1), stream
    ](scores, qkv, num_heads, num_kv_heads, out)
    return out


_ARGS = "float32[:, ::1], int64, int64"  # qkv, num_heads, num_kv_heads
PTX_SIGNATURES = {
    "attention_scores_kernel": [f"void({_ARGS}, float32, float32[:, :, ::1])"],
    "softmax_rows_kernel": ["void(float32[:, :, ::1])"],
    "attention_pv_kernel": [
        f"void(float32[:, :, ::1], {_ARGS}, {out}[:, ::1])"
        for out in ("float32", "uint16")
    ],
}


# %% [markdown]
# ## Rung 2: fused tiles and the online softmax
#
# The fused kernel computes the same output without ever writing a score. Its plan, for
# a block that owns a **query tile** of `block_q` consecutive tokens of one head:
#
# - **a thread per query row.** Thread `t` owns query $i$ = tile start + `t`. It keeps
#   its query (pre-multiplied by $1/\sqrt D$) and its output accumulator $a$ —
#   `head_dim` floats each — in **registers**, with its running maximum $m$ and sum
#   $\ell$;
# - **K/V tiles in shared memory.** The block walks the keys `block_k` at a time. All
#   its threads copy the tile's keys and values (coalesced: consecutive threads,
#   consecutive floats) into shared memory, wait at a barrier, and then every thread
#   reads every key of the tile. They all read the same address at the same moment,
#   which shared memory serves as one broadcast. Each key and value is read from global
#   memory once per query tile, not once per query;
# - **the online softmax per tile**: scores of the tile into a small local array, the
#   tile's maximum, one rescale of $a$ and $\ell$, then
#   $a \mathrel{+}= e^{s_j - m} v_j$;
# - **causality for free**: a query tile needs only the keys up to its last query, so
#   the block stops there — half the work of the full matrix — and inside the diagonal
#   tile each thread stops at its own query. It must *skip* those keys, not weight them
#   by $e^{-\infty} = 0$: the rows of the last tile past the sequence's end hold
#   whatever an earlier block left in shared memory, perhaps a NaN, and
#   $0 \cdot \text{NaN} = \text{NaN}$;
# - **longest tiles first**: the last query tile does the most work, so the first blocks
#   the GPU schedules — the grid's x axis, the heads, runs fastest — take every head's
#   last tile. Blocks that start late then have little to do, and the GPU's last wave is
#   short.
#
# Drawn for one head of a sequence of six query tiles: each square is a (query tile, key
# tile) pair; the block of query tile 3 (outlined) holds its queries in registers and
# streams key tiles 0 to 3 through shared memory; the squares above the diagonal are
# never loaded, and the diagonal ones are half computed.


# %%
def draw_flash_tiles(ax, num_tiles: int = 6, block: int = 3) -> None:
    """Flash attention's work for one head: query tiles (rows) by key tiles (cols)."""
    for qt in range(num_tiles):
        for kt in range(num_tiles):
            x, y = kt, num_tiles - 1 - qt
            if kt < qt:  # every key before the tile's first query: a full tile
                ax.add_patch(plt.Rectangle((x, y), 0.92, 0.92, color="#1f77b4"))
            elif kt == qt:  # the diagonal: each thread stops at its own query
                corners = [(x, y + 0.92), (x, y), (x + 0.92, y)]
                ax.add_patch(plt.Polygon(corners, color="#1f77b4"))
                ax.add_patch(
                    plt.Rectangle((x, y), 0.92, 0.92, fill=False, ec="#bbbbbb")
                )
            else:  # after the tile's last query: never loaded
                ax.add_patch(plt.Rectangle((x, y), 0.92, 0.92, color="#eeeeee"))
        order = num_tiles - qt  # longest tiles first
        label = f"launched {order}" + (": the outlined block" if qt == block else "")
        ax.text(
            num_tiles + 0.2,
            num_tiles - 1 - qt + 0.46,
            label,
            color="#d62728" if qt == block else "black",
            va="center",
            fontsize=7,
        )
    y = num_tiles - 1 - block
    ax.add_patch(
        plt.Rectangle(
            (-0.06, y - 0.06), block + 1.04, 1.04, fill=False, ec="#d62728", lw=2
        )
    )
    ax.annotate(  # inside the outlined row: the block's walk over the key tiles
        "",
        xy=(block + 0.4, y + 0.46),
        xytext=(0.1, y + 0.46),
        arrowprops=dict(arrowstyle="->", color="white", lw=1.5),
    )
    ax.set_xlim(-0.2, num_tiles + 3.2)
    ax.set_ylim(-0.1, num_tiles + 0.1)
    ax.set_xlabel("key tiles (block_k keys each)", fontsize=8)
    ax.set_ylabel("query tiles (block_q threads)", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)


fig, ax = new_figure(width=5.5, height=3.6)
draw_flash_tiles(ax)
ax.set_title("causal flash attention: half the tiles, longest first", fontsize=9)
plt.show()

# %% [markdown]
# For the query and accumulator to stay in registers, every index into them must be
# known when the kernel is compiled: `head_dim` and the tile sizes are compile-time
# constants, so the kernel is built by a function of them (as chapter 6 built its GEMM),
# and the library keeps one per `(head_dim, block_q, block_k)`. For `head_dim` 64 a
# thread holds 128 floats in registers (and 16 more on their way to shared memory, see
# below); for 128 it holds 256, more than a thread's 255 registers, and some spill to
# local memory (exercise 3).
#
# **Staging a tile.** The block's threads copy each K and V tile into shared memory
# together, consecutive threads taking consecutive floats, so that a warp's loads are
# contiguous. A load from memory answers after several hundred nanoseconds; a loop that
# stores each value before it loads the next keeps a thread's loads waiting one or two
# at a time, and every thread of the block waits at the barrier for the slowest. So each
# thread first issues `FLASH_STAGE` loads of K and as many of V into registers, then
# stores them all — chapter 6's rule for the GEMV, many loads in flight. (A version that
# left this to the compiler, which unrolled the loop only twice, was slower at every
# length; `bench/ch07_attention.py` measures the kernel below.)
#
# The kernel writes its output through `store_activation`: bf16 bits when `out` is
# `uint16` (what the model passes, since `o_proj` reads bf16), float32 when `out` is
# float32 (what the tests compare).
#
# One more argument prepares for serving many requests at once (chapter 9): the buffer
# may hold **several sequences back to back**, each causal within itself and blind to
# the others. Where each begins is `query_start_loc`, the running sum of their lengths —
# for lengths 5, 11 and 1 it is `[0, 5, 16, 17]`; one sequence of $T$ tokens is
# `[0, T]`. The grid gets a third axis, one slice per sequence, as tall as the longest
# one's tiles (`max_query_len`); a block whose tile lies past its own sequence's end
# returns at once. Nothing is padded: the rows of a short sequence are not computed for
# the length of the longest.

# %%
#| export
from numba import cuda, float32

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.gemv import INLINE

FLASH_BLOCK_Q = 64  # queries per block: one thread each
# K/V elements per thread loaded before any is stored to shared memory (x2: K and V)
FLASH_STAGE = 8


def flash_block_k(head_dim: int) -> int:
    """Keys per tile: K and V tiles (2 * block_k * head_dim float32) fit in 32 KiB of
    shared memory.
    """
    return max(8, min(64, 4096 // head_dim))


def make_online_softmax_tile(head_dim: int, block_k: int):
    """The online softmax's step over one staged tile, as a device function for
    `head_dim` and `block_k` (inlined, so q, s and acc stay in registers): a query's
    scores against the tile's first num_visible keys into s, acc and ell rescaled to
    the new running max, the tile's values added in; returns (m, ell). Chapter 10's
    paged prefill kernel runs the same step.
    """
    D, BK = head_dim, block_k

    @cuda.jit(device=True, **INLINE)
    def online_softmax_tile(q, k_tile, v_tile, num_visible, s, acc, m, ell):
        tile_max = float32(-math.inf)
        for r in range(num_visible):
            # two chains of FMAs: more in flight
            x0, x1 = float32(0.0), float32(0.0)
            for d in range(0, D, 2):
                x0 += q[d] * k_tile[r, d]
                x1 += q[d + 1] * k_tile[r, d + 1]
            s[r] = x0 + x1
            tile_max = max(tile_max, s[r])
        m_new = max(m, tile_max)
        # rescales what was summed so far; 0 on the first tile
        alpha = math.exp(m - m_new)
        ell *= alpha
        for d in range(D):
            acc[d] *= alpha
        for r in range(num_visible):
            p = math.exp(s[r] - m_new)
            ell += p
            for d in range(D):
                acc[d] += p * v_tile[r, d]
        return m_new, ell

    online_softmax_tile.block_k = BK
    return online_softmax_tile


def make_flash_attention_kernel(head_dim: int, block_q: int, block_k: int):
    """Causal GQA attention, a block per (query tile, head), K/V tiles in shared memory,
    online softmax.
    """
    D, BQ, BK, STAGE = head_dim, block_q, block_k, FLASH_STAGE
    KV = 2 * STAGE  # compile-time constants, as array sizes must be
    tile_step = make_online_softmax_tile(D, BK)

    @cuda.jit
    def kernel(qkv, query_start_loc, num_heads, num_kv_heads, scale, out):
        wait_for_previous_kernel()
        # query head, row of the tile, sequence
        h, t, seq = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockIdx.z
        start = query_start_loc[seq]  # the sequence's first row in qkv
        num_tokens = query_start_loc[seq + 1] - start
        # the longest (last) tiles first
        q_tile = (num_tokens + BQ - 1) // BQ - 1 - cuda.blockIdx.y
        # this sequence has fewer tiles than the longest: the whole block leaves
        if q_tile < 0:
            return
        i = q_tile * BQ + t  # this thread's query, counted from the sequence's start
        is_query = i < num_tokens
        # this head's KV head
        k_col = (num_heads + h // (num_heads // num_kv_heads)) * D
        v_col = k_col + num_kv_heads * D
        k_tile = cuda.shared.array((BK, D), float32)
        v_tile = cuda.shared.array((BK, D), float32)
        q = cuda.local.array(D, float32)  # registers: D is a constant
        acc = cuda.local.array(D, float32)
        s = cuda.local.array(BK, float32)
        kv = cuda.local.array(KV, float32)  # K and V values on their way
        for d in range(D):
            q[d] = qkv[start + i, h * D + d] * scale if is_query else float32(0.0)
            acc[d] = float32(0.0)
        m, ell = float32(-math.inf), float32(0.0)
        # causal: no key after the tile's last query
        num_keys = min(num_tokens, (q_tile + 1) * BQ)
        for k_start in range(0, num_keys, BK):
            cuda.syncthreads()  # everyone is done with the previous tile
            # stage K and V: consecutive threads, consecutive floats; each thread
            # issues STAGE loads of each before it stores any
            for e0 in range(t, BK * D, STAGE * BQ):
                for u in range(STAGE):
                    e = e0 + u * BQ
                    row, col = start + k_start + e // D, e % D
                    ok = e < BK * D and k_start + e // D < num_keys
                    kv[2 * u] = qkv[row, k_col + col] if ok else float32(0)
                    kv[2 * u + 1] = qkv[row, v_col + col] if ok else float32(0)
                for u in range(STAGE):
                    e = e0 + u * BQ
                    if e < BK * D:
                        k_tile[e // D, e % D] = kv[2 * u]
                        v_tile[e // D, e % D] = kv[2 * u + 1]
            cuda.syncthreads()
            if is_query and k_start <= i:
                # causal: keys k_start .. i; later rows are never read
                num_visible = min(BK, i - k_start + 1)
                m, ell = tile_step(q, k_tile, v_tile, num_visible, s, acc, m, ell)
        if is_query:
            inv_ell = float32(1.0) / ell
            for d in range(D):
                store_activation(out, start + i, h * D + d, acc[d] * inv_ell)

    kernel.block_q, kernel.block_k, kernel.head_dim = BQ, BK, D
    return kernel


def kernels_by_size(make):
    """kernel_for(head_dim, block_q=FLASH_BLOCK_Q, block_k=None): the kernel `make`
    builds for these compile-time sizes, built on first use and kept (chapter 10's
    paged prefill kernels are kept the same way).
    """
    kernels = {}

    def kernel_for(
        head_dim: int, block_q: int = FLASH_BLOCK_Q, block_k: int | None = None
    ):
        key = (head_dim, block_q, block_k or flash_block_k(head_dim))
        if key not in kernels:
            kernels[key] = make(*key)
        return kernels[key]

    return kernel_for


def check_tiles(name: str, head_dim: int, block_q: int, block_k: int | None,
                multiple: int = 2) -> int:
    """block_k (flash_block_k's where None) once head_dim is a multiple of `multiple`,
    1 <= block_q <= 1024 and the K/V tiles fit 48 KiB of shared memory; else a
    ValueError naming `name`.
    """
    block_k = block_k or flash_block_k(head_dim)
    if (
        head_dim % multiple
        or not 1 <= block_q <= 1024
        or block_k < 1
        or 2 * block_k * head_dim * 4 > 48 * 1024
    ):
        raise ValueError(
            f"{name}: need head_dim a multiple of {multiple}, 1 <= block_q <= 1024 "
            "and K/V tiles within 48 KiB; "
            f"got head_dim {head_dim}, block_q {block_q}, block_k {block_k}"
        )
    return block_k


flash_attention_kernel_for = kernels_by_size(make_flash_attention_kernel)
flash_attention_d64_kernel = flash_attention_kernel_for(64)
flash_attention_d128_kernel = flash_attention_kernel_for(128)


def check_query_start_loc(
    name: str, query_start_loc, max_query_len: int, num_tokens: int
) -> int:
    """Check the sequences' start rows (int32, num_seqs + 1) and the longest length;
    return num_seqs.

    A NumPy array is checked in full (starts at 0, never decreases, ends at num_tokens,
    no length above max_query_len); a device array only by dtype and shape (reading it
    would be a copy).
    """
    if (
        query_start_loc.dtype != np.int32
        or query_start_loc.ndim != 1
        or query_start_loc.shape[0] < 2
    ):
        raise TypeError(
            f"{name}: query_start_loc must be int32 (num_seqs + 1,), got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if not isinstance(max_query_len, (int, np.integer)) or max_query_len < 0:
        raise ValueError(
            f"{name}: max_query_len must be an integer >= 0, got {max_query_len!r}"
        )
    if isinstance(query_start_loc, np.ndarray):
        lens = np.diff(query_start_loc)
        if (
            query_start_loc[0] != 0
            or query_start_loc[-1] != num_tokens
            or lens.min() < 0
            or lens.max() > max_query_len
        ):
            raise ValueError(
                f"{name}: query_start_loc must rise from 0 to num_tokens = "
                f"{num_tokens} in steps of at most "
                f"max_query_len = {max_query_len}, got {query_start_loc.tolist()}"
            )
    return query_start_loc.shape[0] - 1


def flash_attention(
    qkv,
    query_start_loc,
    max_query_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    out,
    stream=0,
    block_q: int = FLASH_BLOCK_Q,
    block_k: int | None = None,
):
    """Rung 2: causal GQA attention in one kernel, each sequence of the batch within
    itself.

    qkv float32 (T, (H + 2 KVH) D) holds the sequences back to back; sequence s is rows
    query_start_loc[s] .. query_start_loc[s + 1] - 1, none longer than max_query_len.
    out (T, H D): float32, or bf16 bits (uint16).
    """
    num_tokens = check_qkv("flash_attention", qkv, num_heads, num_kv_heads, head_dim)
    check_out("flash_attention", out, (num_tokens, num_heads * head_dim))
    num_seqs = check_query_start_loc(
        "flash_attention", query_start_loc, max_query_len, num_tokens
    )
    block_k = check_tiles("flash_attention", head_dim, block_q, block_k)
    if num_tokens == 0 or max_query_len == 0:
        return out
    kernel = flash_attention_kernel_for(head_dim, block_q, block_k)
    # x fastest: every head's longest tile first
    grid = (num_heads, cdiv(max_query_len, block_q), num_seqs)
    kernel[grid, block_q, stream](
        qkv,
        query_start_loc,
        num_heads,
        num_kv_heads,
        np.float32(1 / math.sqrt(head_dim)),
        out,
    )
    return out


# qkv, query_start_loc, num_heads, num_kv_heads, scale
_ARGS = "float32[:, ::1], int32[::1], int64, int64, float32"
PTX_SIGNATURES = {
    name: [f"void({_ARGS}, {out}[:, ::1])" for out in ("float32", "uint16")]
    for name in ("flash_attention_d64_kernel", "flash_attention_d128_kernel")
}


# %% [markdown]
# ## Test both rungs against the reference
#
# Fresh random queries, keys and values for every run (the queries scaled up, so that
# the softmax is peaked rather than flat), sequence lengths that are not multiples of
# the tiles, a poisoned output, and a NaN: one query of one head. It must make exactly
# that head's output row NaN — its whole softmax row is NaN — and nothing else, since no
# other row reads that query. The tolerance: float32 sums in a different order, so we
# ask $\max |o - o_\text{ref}| / \max |o_\text{ref}| \le 10^{-5}$; the bf16 output must
# be the reference rounded to bf16, or one bf16 step away where the float32 value sits
# near a rounding boundary. In the simulator the shapes are tiny and the tiles smaller
# still; on a GPU we check Llama 3.2 1B's: 32 heads, 8 KV heads of 64, 2,048 tokens.


# %% tags=["hide-input"]
#| export measure
def max_rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| over the finite entries (NaNs must agree)."""
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaNs in different places"
    ok = ~np.isnan(want)
    return float(np.max(np.abs(got[ok] - want[ok])) / np.max(np.abs(want[ok])))


# %% [markdown]
# That measure of error goes to `tinyvllm_lib.measure`, beside the timing kit: the tests
# and the benchmark script check the kernels with it too.


# %%
def assert_bf16_close(got_bits: np.ndarray, want: np.ndarray) -> None:
    """bf16 output = the float32 reference rounded to bf16, up to one bf16 step (2^-7 of
    the largest value).
    """
    err = max_rel_error(
        bf16_bits_to_f32(got_bits), bf16_bits_to_f32(f32_to_bf16_bits(want))
    )
    assert err <= 2**-7, f"bf16 output off by {err:.1e} of the largest value"


def random_qkv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    with_nan: bool = False,
) -> np.ndarray:
    qkv = rng.standard_normal(
        (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    ).astype(np.float32)
    qkv[:, : num_heads * head_dim] *= 3  # peaked attention
    if with_nan:
        # one query of the last head
        qkv[num_tokens // 2, (num_heads - 1) * head_dim] = np.nan
    return qkv


def check_attention_rungs(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_q: int = FLASH_BLOCK_Q,
    block_k: int | None = None,
    rungs=("materialized", "flash"),
) -> float:
    qkv = random_qkv(num_tokens, num_heads, num_kv_heads, head_dim, with_nan=True)
    with np.errstate(invalid="ignore"):
        want = attention_ref(qkv, num_heads, num_kv_heads, head_dim)
    d_qkv, worst = cuda.to_device(qkv), 0.0
    # query_start_loc
    one_sequence = cuda.to_device(np.array([0, num_tokens], np.int32))
    for rung in rungs:
        out = cuda.to_device(np.full(want.shape, -7.0, np.float32))  # poison
        if rung == "materialized":
            scores = cuda.device_array((num_heads, num_tokens, num_tokens), np.float32)
            attention_materialized(
                d_qkv, num_heads, num_kv_heads, head_dim, scores, out
            )
        else:
            flash_attention(
                d_qkv,
                one_sequence,
                num_tokens,
                num_heads,
                num_kv_heads,
                head_dim,
                out,
                block_q=block_q,
                block_k=block_k,
            )
        err = max_rel_error(out.copy_to_host(), want)
        assert err <= 1e-5, (
            f"{rung}: relative error {err:.1e} at "
            f"{(num_tokens, num_heads, num_kv_heads, head_dim)}"
        )
        worst = max(worst, err)
    out_bf16 = cuda.device_array(want.shape, np.uint16)
    flash_attention(
        d_qkv,
        one_sequence,
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        out_bf16,
        block_q=block_q,
        block_k=block_k,
    )
    assert_bf16_close(out_bf16.copy_to_host(), want)
    return worst


def check_packed_sequences(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_q: int = FLASH_BLOCK_Q,
    block_k: int | None = None,
) -> float:
    """Several sequences back to back in one launch: each must equal attention_ref of
    that sequence alone.
    """
    qkv = random_qkv(sum(lengths), num_heads, num_kv_heads, head_dim)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    want = np.concatenate(
        [
            attention_ref(qkv[a:b], num_heads, num_kv_heads, head_dim)
            for a, b in zip(starts, starts[1:])
        ]
    )
    out = cuda.to_device(np.full(want.shape, -7.0, np.float32))
    flash_attention(
        cuda.to_device(qkv),
        cuda.to_device(starts),
        max(lengths),
        num_heads,
        num_kv_heads,
        head_dim,
        out,
        block_q=block_q,
        block_k=block_k,
    )
    err = max_rel_error(out.copy_to_host(), want)
    assert err <= 1e-5, f"packed sequences {lengths}: relative error {err:.1e}"
    return err


if can_launch():
    cases = (
        [(11, 4, 2, 16, 4, 4)]
        if is_simulator()
        else [
            (2048, 32, 8, 64, 64, None),
            (1000, 9, 3, 64, 64, None),
            (77, 32, 8, 128, 64, None),
            (1, 4, 1, 64, 64, None),
        ]
    )
    for num_tokens, num_heads, num_kv_heads, head_dim, block_q, block_k in cases:
        err = check_attention_rungs(
            num_tokens, num_heads, num_kv_heads, head_dim, block_q, block_k
        )
        print(
            f"T={num_tokens}, {num_heads}/{num_kv_heads} heads of {head_dim}: both "
            f"rungs within {err:.1e} of attention_ref"
        )
    packed = [5, 11, 1] if is_simulator() else [700, 1, 2048, 93]
    err = check_packed_sequences(
        packed, *((4, 2, 16, 4, 4) if is_simulator() else (32, 8, 64))
    )
    print(
        f"sequences of {packed} tokens packed in one launch: within {err:.1e} of "
        "attention_ref on each"
    )
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernels")

# %% [markdown]
# And bad input is refused before anything runs:

# %%
good, starts = np.zeros((3, (4 + 2 * 2) * 8), np.float32), np.array([0, 3], np.int32)
for args in [
    # qkv of the wrong dtype
    (good.astype(np.float64), starts, 3, 4, 2, 8, np.zeros((3, 32), np.float32)),
    # 4 heads cannot share 3 KV heads
    (good, starts, 3, 4, 3, 8, np.zeros((3, 32), np.float32)),
    # qkv too narrow for head_dim 16
    (good, starts, 3, 4, 2, 16, np.zeros((3, 64), np.float32)),
    (good, starts, 3, 4, 2, 8, np.zeros((3, 31), np.float32)),  # out of the wrong shape
    (good, starts, 3, 4, 2, 8, np.zeros((3, 32), np.int32)),  # out of the wrong dtype
    # sequences end before the rows
    (good, np.array([0, 2], np.int32), 3, 4, 2, 8, np.zeros((3, 32), np.float32)),
    # query_start_loc not int32
    (good, starts.astype(np.int64), 3, 4, 2, 8, np.zeros((3, 32), np.float32)),
]:
    try:
        flash_attention(*args)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad input was accepted")

# %% [markdown]
# ## The MLP: SiLU-gated
#
# Llama's MLP widens each token's vector to `intermediate_size` twice, gates one copy
# with the other, and narrows it back (Shazeer, 2020):
#
# $$ \operatorname{MLP}(x) = W_\text{down}\big(\operatorname{SiLU}(W_\text{gate}\, x)
#    \odot W_\text{up}\, x\big),
# \qquad \operatorname{SiLU}(z) = z \cdot \sigma(z) = \frac{z}{1 + e^{-z}}. $$
#
# Gate and up read the same input, so, as with Q, K and V, they are one matrix product
# with the rows stacked: its output row is `[gate | up]`, `2 * intermediate_size`
# floats. A small element-wise kernel then computes
# $\operatorname{SiLU}(\text{gate}) \cdot \text{up}$ and writes it in bf16, the input of
# `down_proj`. It reads 8 bytes and writes 2 per element, so it is memory-bound: a row
# of blocks per token, each thread four columns a block's width apart (so a warp's
# loads of each are consecutive), all eight loads issued before any is used: with one
# element a thread, too few bytes were in flight to reach the GPU's bandwidth on long
# prompts (chapter 1).

# %%
#| export kernels.activation
import math

import numpy as np
from numba import cuda, float32

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.checks import is_c_contiguous
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


def silu_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up in float32, for gate_up = [gate | up] of shape (T, 2 * I) -> (T,
    I).
    """
    gate, up = np.split(np.asarray(gate_up, np.float32), 2, axis=-1)
    # exp(-gate) = inf for very negative gates: silu -> -0
    with np.errstate(over="ignore"):
        return gate / (np.float32(1) + np.exp(-gate)) * up


SILU_COLUMNS = 4  # columns a thread: its loads all in flight at once


@cuda.jit
def silu_mul_kernel(gate_up, out):
    wait_for_previous_kernel()
    t = cuda.blockIdx.y  # token
    width, step = out.shape[1], cuda.blockDim.x
    first = cuda.blockIdx.x * step * SILU_COLUMNS + cuda.threadIdx.x
    gate = cuda.local.array(SILU_COLUMNS, float32)
    up = cuda.local.array(SILU_COLUMNS, float32)
    for j in range(SILU_COLUMNS):  # every load first
        c = first + j * step
        if c < width:
            gate[j], up[j] = gate_up[t, c], gate_up[t, width + c]
    for j in range(SILU_COLUMNS):
        c = first + j * step
        if c < width:
            g = gate[j]
            store_activation(out, t, c, g / (float32(1.0) + math.exp(-g)) * up[j])


PTX_SIGNATURES = {
    "silu_mul_kernel": [
        "void(float32[:, ::1], float32[:, ::1])",
        "void(float32[:, ::1], uint16[:, ::1])",
    ]
}


def silu_mul(gate_up, out, stream=0, threads_per_block: int = 256):
    """out (T, I) = SiLU(gate) * up for gate_up = [gate | up], float32 (T, 2 I); out
    float32 or bf16 bits (uint16).
    """
    if gate_up.dtype != np.float32:
        raise TypeError(
            "silu_mul: gate_up must be float32 (a linear layer's output), got "
            f"{gate_up.dtype}"
        )
    if out.dtype not in (np.float32, np.uint16):
        raise TypeError(
            f"silu_mul: out must be float32 or uint16 (bf16 bits), got {out.dtype}"
        )
    if (
        gate_up.ndim != 2
        or gate_up.shape[1] % 2
        or tuple(out.shape) != (gate_up.shape[0], gate_up.shape[1] // 2)
    ):
        raise ValueError(
            "silu_mul: need gate_up (T, 2 I) and out (T, I), got "
            f"{tuple(gate_up.shape)} and {tuple(out.shape)}"
        )
    for name, a in (("gate_up", gate_up), ("out", out)):
        if not is_c_contiguous(a):
            raise ValueError(f"silu_mul: {name} must be C-contiguous")
    num_tokens, width = out.shape
    if num_tokens > 65535:
        raise ValueError(f"silu_mul: at most 65535 tokens per launch, got {num_tokens}")
    # no more whole warps than a row needs, SILU_COLUMNS columns a thread
    threads = min(threads_per_block, -(-width // (32 * SILU_COLUMNS)) * 32)
    if num_tokens and width:
        per_block = threads * SILU_COLUMNS
        silu_mul_kernel[
            ((width + per_block - 1) // per_block, num_tokens), threads, stream
        ](gate_up, out)
    return out


# %%
from tinyvllm_lib.kernels.activation import silu_mul, silu_mul_ref

gate_up = (rng.standard_normal((5, 2 * 137)) * 4).astype(np.float32)
gate_up[0, 0], gate_up[1, 1] = -200.0, np.nan  # exp overflows; NaN stays NaN
want = silu_mul_ref(gate_up)
if can_launch():
    d_gate_up = cuda.to_device(gate_up)
    out = cuda.device_array(want.shape, np.float32)
    silu_mul(d_gate_up, out, threads_per_block=32)
    got = out.copy_to_host()
    assert max_rel_error(got, want) <= 1e-6
    out_bf16 = cuda.device_array(want.shape, np.uint16)
    silu_mul(d_gate_up, out_bf16, threads_per_block=32)
    assert_bf16_close(out_bf16.copy_to_host(), want)
    print("silu_mul agrees with silu_mul_ref, in float32 and in bf16")

# %% [markdown]
# **Fusing it into the GEMV.** At one token the MLP's `gate_up_proj` is chapter 6's
# GEMV, and a kernel of its own for SiLU·up costs a launch and a round trip of the
# `[gate | up]` row through memory for work a thread could do where the two products
# are made. `make_gemv_kernel(..., gated=True)` gives each warp a *pair* of rows, gate
# row $n$ and up row $n$ ($n + I$ in the stacked matrix), and its lane 0 writes
# $\operatorname{SiLU}(g_n) \cdot u_n$ in bf16 instead of the two products. The weights
# are read as before; what goes is the float32 row (8 bytes an element written and read
# back) and one launch per layer. Whether that pays is a measurement: chapter 11 times
# it against the GEMV and `silu_mul` it would replace. With four steps of each row in
# flight a warp it lost; chapter 11's sweep of that one knob (`bench/ch11_kernels.py`)
# found one step in flight the fastest at one token, and faster than the two kernels.
# So one token's gated kernel keeps one step in flight, and the model uses it at one
# token, where the norm is not already inside gate-up's GEMV (chapter 6's
# `norm_in_gemv`: there the two kernels are the norm-and-GEMV and `silu_mul`, and the
# gated GEMV would save no launch); at two tokens and more cuBLAS makes the product,
# and the sweep times the gated GEMV against it too.

# %%
#| export kernels.activation
from tinyvllm_lib.kernels.gemv import (
    GEMV_BUCKETS,
    GEMV_MAX_TOKENS,
    GEMV_THREADS,
    can_gemv,
    make_gemv_kernel,
)

# tokens -> a gated kernel: a warp per (gate, up) pair, one step in flight at one
# token (chapter 11's sweep), four at more
GEMV_GATED_KERNELS = {}
for _tokens in GEMV_BUCKETS:
    _name = f"gemv_gated_t{_tokens}_kernel"
    GEMV_GATED_KERNELS[_tokens] = globals()[_name] = make_gemv_kernel(
        _tokens, 1, 2, 1 if _tokens == 1 else 4, gated=True
    )
    PTX_SIGNATURES[_name] = [
        f"void(uint64[:, ::1], uint64[:, ::1], {out}[:, ::1])"
        for out in ("float32", "uint16")
    ]


def gemv_silu_mul(x, w, out, stream=0):
    """Launch: out (M, I) = SiLU(x · gateᵀ) * (x · upᵀ) for w = [gate | up] (2 I, K),
    M <= 16 token vectors; out float32 or bf16 bits.
    """
    for name, a in (("x", x), ("w", w)):
        if a.dtype != np.uint16 or a.ndim != 2:
            raise TypeError(f"gemv_silu_mul: {name} must be 2-D bf16 bits (uint16)")
    M, N, K = x.shape[0], w.shape[0], x.shape[1]
    if (
        N % 2
        or w.shape[1] != K
        or tuple(out.shape) != (M, N // 2)
        or out.dtype not in (np.float32, np.uint16)
    ):
        raise ValueError(
            "gemv_silu_mul: need x (M, K), w (2 I, K), out (M, I) float32 or uint16, "
            f"got {tuple(x.shape)}, {tuple(w.shape)} and {out.dtype} {tuple(out.shape)}"
        )
    if not can_gemv(x, w):
        raise ValueError(
            f"gemv_silu_mul: at most {GEMV_MAX_TOKENS} token vectors, 8-byte aligned "
            f"rows, got x {tuple(x.shape)}"
        )
    kernel = GEMV_GATED_KERNELS[
        next((b for b in GEMV_BUCKETS if b >= M), GEMV_BUCKETS[-1])
    ]
    num_blocks = (N // 2 + kernel.rows_per_block - 1) // kernel.rows_per_block
    kernel[num_blocks, GEMV_THREADS, stream](x.view(np.uint64), w.view(np.uint64), out)
    return out


# %%
from tinyvllm_lib.kernels.activation import gemv_silu_mul

if can_launch():
    for M, K, inter in (
        [(1, 64, 40), (3, 100, 17)]
        if is_simulator()
        else [
            (1, 2048, 8192),
            (5, 2048, 8192),
        ]
    ):
        x_bits = f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
        w_bits = f32_to_bf16_bits(
            (rng.standard_normal((2 * inter, K)) / np.sqrt(K)).astype(np.float32)
        )
        product = (
            bf16_bits_to_f32(x_bits).astype(np.float64)
            @ bf16_bits_to_f32(w_bits).astype(np.float64).T
        )
        want = silu_mul_ref(product.astype(np.float32))
        fused = cuda.device_array((M, inter), np.uint16)
        gemv_silu_mul(cuda.to_device(x_bits), cuda.to_device(w_bits), fused)
        assert_bf16_close(fused.copy_to_host(), want)
    print("gemv_silu_mul agrees with silu_mul_ref of the product, in bf16")

# %% [markdown]
# ## The forward pass in NumPy
#
# Now every piece exists, and the forward pass reads top to bottom like the equations at
# the start of the chapter. Weights are widened from bf16 to float32 once, when the
# model is built (4 bytes a weight: 0.5 GB for SmolLM2), and every step is float32.
# Positions are an explicit argument: chapter 8 will run the same layers on one new
# token at position $T$, not 0.
#
# RoPE rotates the query and key heads of the fused buffer, as chapter 5 does it:
# `rope_table_from_config` computes the frequencies (Llama 3's scaling included) and
# their cosine and sine for every position once, and `rope_qkv_ref` rotates the pairs
# $(x_d, x_{d + D/2})$ of each query and key head by the angle of the token's position.
#
# The model class holds the widened weights. `bf16_activations=True` rounds the input of
# every linear layer to bf16, exactly where the kernels do, so the NumPy model can also
# predict what the kernel model's dtype choices cost.
#
# **Attention is an argument.** Everything in a layer works on each token alone except
# attention, and attention is also what changes from here on: chapter 8 makes it read
# and write a cache of keys and values, chapter 9 runs many requests in one batch,
# chapter 10 pages the cache. So the layer loop does not decide how tokens attend: it
# calls an *attention object* it is handed, `attention(layer, qkv) -> (T, H D)`, which
# carries whatever that step needs to know — here, where each sequence of the batch
# begins. The loop is written once and never changes. This chapter's attention is causal
# within each sequence and has no cache; it can also keep every layer's probabilities,
# for pictures.

# %%
#| export layers.attention
import numpy as np

from tinyvllm_lib.kernels.attention import attention_ref, flash_attention
from tinyvllm_lib.kernels.rope import rope_qkv


class CausalAttention:
    """The NumPy model's attention without a cache: causal within each sequence of the
    batch.

    Called by the layer loop as attention(layer, qkv) -> (T, H D). query_start_loc
    (default: one sequence) marks where each sequence begins; keep_probs=True keeps each
    layer's (H, T, T) probabilities in self.probs (one sequence only).
    """

    def __init__(self, config, query_start_loc=None, keep_probs: bool = False):
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.query_start_loc = (
            None if query_start_loc is None else np.asarray(query_start_loc, np.int64)
        )
        if (
            keep_probs
            and self.query_start_loc is not None
            and len(self.query_start_loc) != 2
        ):
            raise ValueError(
                "keep_probs keeps the probabilities of one sequence; got several"
            )
        self.probs: dict[int, np.ndarray] | None = {} if keep_probs else None

    def __call__(self, layer: int, qkv: np.ndarray) -> np.ndarray:
        starts = [0, len(qkv)] if self.query_start_loc is None else self.query_start_loc
        outs = []
        for begin, end in zip(starts[:-1], starts[1:]):  # each sequence alone
            out = attention_ref(
                qkv[begin:end],
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                return_probs=self.probs is not None,
            )
            if self.probs is not None:
                out, self.probs[layer] = out
            outs.append(out)
        return np.concatenate(outs)  # (T, H D)


class FlashAttention:
    """The kernel model's attention without a cache: flash_attention over the batch's
    sequences.

    Called by the layer loop as attention(layer, qkv, out, stream, rope): rotates q
    and k by rope = (RoPE table, positions) unless it is None, then attends;
    query_start_loc (int32, on the GPU) and max_query_len describe the batch, as
    flash_attention takes them.
    """

    def __init__(self, config, query_start_loc, max_query_len: int):
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.query_start_loc, self.max_query_len = query_start_loc, int(max_query_len)

    def __call__(self, layer: int, qkv, out, stream=0, rope=None) -> None:
        if rope is not None:  # rope = (table, positions): rotate q and k first
            rope_qkv(
                qkv, rope[1], rope[0], self.num_heads, self.num_kv_heads, stream=stream
            )
        flash_attention(
            qkv,
            self.query_start_loc,
            self.max_query_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            out,
            stream=stream,
        )


# %% [markdown]
# One more part is handed to the model: a **communicator**. Chapter 13 splits the model
# over several GPUs, each running this same layer loop on its share of the heads, and
# there the ranks sum their partial results (`all_reduce`) and put their slices of the
# logits side by side (`all_gather`). On one GPU there is one rank, and the
# communicator below does nothing: its collectives hand their input back. The model
# calls them all the same, so there is one layer loop, whatever the number of GPUs.

# %%
#| export distributed.communicator
class Communicator:
    """The collectives the model's ranks share (vLLM's names); this one is a single
    rank's, where each gives its input back. Chapter 13 has the real ones.
    """

    rank, world_size = 0, 1

    def all_reduce(self, x, stream=0):
        """x summed over the ranks, in place; returns x."""
        return x

    def all_gather(self, x, out=None, stream=0):
        """The ranks' x (rows, cols) side by side: (rows, world_size * cols), cut to
        out's width where out is given (a device array) and written there.
        """
        if out is None:
            return x
        out.copy_to_device(x[:, : out.shape[1]], stream=stream)
        return out

    def broadcast(self, obj=None):
        """Rank 0's obj, on every rank."""
        return obj


# %%
#| export models.llama_numpy
from tinyvllm_lib.distributed.communicator import Communicator
from tinyvllm_lib.kernels.activation import silu_mul_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.embedding import check_token_ids, embed_reference
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.kernels.rope import (
    check_positions,
    rope_qkv_ref,
    rope_table_from_config,
)
from tinyvllm_lib.layers.attention import CausalAttention
from tinyvllm_lib.models.loader import load_weights


class LlamaNumpy:
    """The Llama forward pass in NumPy: float32 math on the bf16 weights widened to
    float32 (reference, CPU backend).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, np.ndarray],
        bf16_activations: bool = False,
        comm: Communicator | None = None,
    ):
        """comm: the ranks this model's shard of weights is one of (chapter 13); None:
        one rank, all the weights.
        """
        self.config, self.comm = config, comm or Communicator()
        # round the inputs of linear layers to bf16, as the kernels do
        self.bf16_activations = bf16_activations
        fused = fuse_llama_weights(weights, config)
        # bf16 bits: a row is widened when it is looked up; this rank's rows of the
        # vocabulary (all of them on one rank)
        self.embed_tokens = fused.pop("embed_tokens")
        if self.comm.world_size > 1 and len(self.embed_tokens) >= config.vocab_size:
            raise ValueError(
                "with several ranks LlamaNumpy takes this rank's rows of the embedding "
                "(chapter 13's shard_llama_weights), got the whole table"
            )
        self.vocab_start = self.comm.rank * len(self.embed_tokens)
        # bf16 bits
        self.norms = {
            n: fused.pop(n)
            for n in list(fused)
            if n == "norm" or n.endswith("layernorm")
        }
        # float32, widened once
        self.matrices = {name: self.load_matrix(name, w) for name, w in fused.items()}
        # cos and sin for positions 0 .. max_position_embeddings - 1
        self.rope = rope_table_from_config(config)

    def load_matrix(self, name: str, bits: np.ndarray) -> np.ndarray:
        """One fused matrix as linear multiplies it: its bf16 bits widened to float32
        (chapter 15's 8-bit model keeps its matrices otherwise).
        """
        return bf16_bits_to_f32(bits)

    @classmethod
    def from_folder(cls, folder, **kwargs) -> "LlamaNumpy":
        """Read config.json and the weights of a Hugging Face Llama folder."""
        config = ModelConfig.from_folder(folder)
        return cls(config, load_weights(folder, config, progress=False), **kwargs)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x · Wᵀ in float32 (x rounded to bf16 first when bf16_activations)."""
        if self.bf16_activations:
            x = bf16_bits_to_f32(f32_to_bf16_bits(x))
        return x @ self.matrices[name].T

    def hidden_states(self, token_ids, positions=None, attention=None) -> np.ndarray:
        """The layer loop: the final-normed hidden states (T, hidden), float32.

        attention(layer, qkv) -> (T, H D) is how tokens attend (default:
        CausalAttention, one sequence)."""
        c = self.config
        ids = check_token_ids(token_ids, c.vocab_size)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        positions = check_positions(positions, len(ids))
        attention = CausalAttention(c) if attention is None else attention
        eps = c.rms_norm_eps
        x = self.embed(ids)  # (T, hidden): the residual stream
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            # (T, (H + 2 KVH) D)
            qkv = self.linear(
                rmsnorm_ref(x, self.norms[p + "input_layernorm"], eps), p + "qkv_proj"
            )
            qkv = rope_qkv_ref(
                qkv, positions, self.rope, c.num_attention_heads, c.num_key_value_heads
            )
            # (T, H D) -> (T, hidden), summed over the ranks' heads
            x = x + self.comm.all_reduce(self.linear(attention(i, qkv), p + "o_proj"))
            gate_up = self.linear(
                rmsnorm_ref(x, self.norms[p + "post_attention_layernorm"], eps),
                p + "gate_up_proj",
            )
            # (T, 2 I) -> (T, I) -> (T, hidden)
            down = self.linear(silu_mul_ref(gate_up), p + "down_proj")
            x = x + self.comm.all_reduce(down)
        return rmsnorm_ref(x, self.norms["norm"], eps)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The embedding rows of ids (T, hidden), float32: each rank looks up the ids
        in its rows of the vocabulary, zero elsewhere, and the ranks sum.
        """
        if self.comm.world_size == 1:  # the whole table: no split to undo
            return embed_reference(ids, self.embed_tokens)
        local = ids - self.vocab_start
        is_mine = (local >= 0) & (local < len(self.embed_tokens))
        x = embed_reference(np.where(is_mine, local, 0), self.embed_tokens)
        return self.comm.all_reduce(x * is_mine[:, None])

    def compute_logits(self, hidden: np.ndarray) -> np.ndarray:
        """The LM head: (rows, hidden) -> logits (rows, vocab_size), float32 (the
        ranks' columns side by side, the vocabulary's padding cut).
        """
        logits = self.comm.all_gather(self.linear(hidden, "lm_head"))
        return logits[:, : self.config.vocab_size]

    def forward(self, token_ids, positions=None, attention=None) -> np.ndarray:
        """Logits (T, vocab_size), float32: the layer loop, then the head on every
        row.
        """
        return self.compute_logits(self.hidden_states(token_ids, positions, attention))


# %% [markdown]
# Does it work? Ask SmolLM2 a question, in its chat template (chapter 3), and pick the
# most likely next token again and again (*greedy* decoding):

# %%
from tinyvllm_lib.kernels.softmax import log_softmax
from tinyvllm_lib.layers.attention import CausalAttention
from tinyvllm_lib.models.llama_numpy import LlamaNumpy

model = LlamaNumpy(config, weights)
messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt_ids = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, tokenize=True
)
ids = list(prompt_ids)
t0 = time.perf_counter()
for _ in range(8):
    logits = model.forward(ids)
    ids.append(int(np.argmax(logits[-1])))
seconds = time.perf_counter() - t0
answer = tokenizer.decode(ids[len(prompt_ids) :])
print(f"{len(prompt_ids)} prompt tokens -> {answer!r} ({seconds:.1f} s for 8 tokens)")
assert "Paris" in answer

# %% [markdown]
# Paris. Notice what that loop does: for each new token it runs the whole forward pass
# over the whole sequence again, although the keys and values of every earlier token are
# the same as in the step before. Chapter 8 keeps them — the **KV cache** — and each
# step then processes one token.
#
# ## Random weights with real shapes
#
# To test the forward pass against `transformers` on many shapes — grouped or not,
# `head_dim` 64 or 128, Llama 3 scaling on or off, tied or untied head — and on Llama
# 3.2 1B's exact shapes without its 2.5 GB of weights, we write model folders of
# **random** bf16 weights. They are scaled so that every activation stays near 1 and the
# logits spread over a few units (a flat softmax would hide errors): matrices with
# standard deviation $1/\sqrt{n}$ for $n$ inputs (`in_features`), norm weights around 1,
# the embedding and head at $4/\sqrt{\text{hidden}}$.

# %%
#| export models.random_llama
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import llama_weight_shapes

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_3_2_1B_CONFIG = {  # the shapes of Llama 3.2 1B (Instruct)
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA3_ROPE_SCALING,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
_LLAMA_FIELDS = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def tiny_llama_config(**overrides) -> dict:
    """A small Llama config: 2 layers, hidden 64, 4 query and 2 KV heads of 16, 256
    tokens. Override any key.
    """
    config = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return config | overrides


def random_weight(
    rng: np.random.Generator, name: str, shape: tuple, hidden_size: int
) -> np.ndarray:
    """One random tensor as bf16: norms near 1, matrices with std 1/sqrt(in), embedding
    and head 4/sqrt(hidden).
    """
    if len(shape) == 1:
        return rng.uniform(0.5, 1.5, shape).astype(ml_dtypes.bfloat16)
    std = (
        4 / math.sqrt(hidden_size)
        if "embed_tokens" in name or "lm_head" in name
        else 1 / math.sqrt(shape[1])
    )
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)
    return values.astype(ml_dtypes.bfloat16)


def make_random_llama(folder, config: dict, seed: int = 0) -> Path:
    """Write a Llama folder of random bf16 weights (config.json, model.safetensors) for
    `config`; same seed, same weights.
    """
    config = _LLAMA_FIELDS | config
    model_config = ModelConfig.from_dict(config)  # validates the shapes before any work
    rng = np.random.default_rng(seed)
    tensors = {
        name: random_weight(rng, name, shape, model_config.hidden_size)
        for name, shape in llama_weight_shapes(model_config).items()
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        tensors,
        str(folder / "model.safetensors"),
        metadata={"format": "pt", "source": f"random, seed {seed}"},
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


# %% [markdown]
# ## Checking against transformers
#
# `transformers`' `LlamaForCausalLM`, in float32 on the CPU, reads the same folder (its
# bf16 weights widen exactly, as ours do). We compare **log-probabilities** — the logits
# up to the constant that the softmax ignores — at every position and for every token of
# the vocabulary. Both sides compute in float32 with different orders of summation, so
# they agree to about $10^{-5}$; we ask for $10^{-3}$. `tests/test_llama_forward.py`
# runs this on a grid of random configs; here, one with grouped heads, Llama 3 scaling
# and positions that start at 5, and SmolLM2 itself. (`transformers` comes with the test
# dependencies; without it this is skipped.)

# %%
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

try:
    import torch
    from transformers import LlamaForCausalLM
except ImportError:
    LlamaForCausalLM = None


def hf_log_probs(folder, token_ids, positions) -> np.ndarray:
    """transformers' log-softmax of the logits, float32 on the CPU."""
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(
            torch.tensor([list(token_ids)]),
            position_ids=torch.tensor([list(positions)]),
        )
    return torch.log_softmax(out.logits[0].float(), dim=-1).numpy()


if LlamaForCausalLM is not None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_llama_config(
            num_hidden_layers=3,
            hidden_size=192,
            intermediate_size=200,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=500,
            rope_scaling=scaling,
        )
        random_folder = make_random_llama(tmp, cfg, seed=1)
        token_ids, positions = rng.integers(0, 500, 12), np.arange(5, 17)
        ours = log_softmax(
            LlamaNumpy.from_folder(random_folder).forward(token_ids, positions)
        )
        theirs = hf_log_probs(random_folder, token_ids, positions)
    diff = np.abs(ours - theirs).max()
    print(
        f"random Llama (GQA 6/2, llama3 scaling): max |log p - log p_hf| = {diff:.1e}"
    )
    assert diff < 1e-3
    theirs = hf_log_probs(folder, prompt_ids, range(len(prompt_ids)))
    diff = np.abs(log_softmax(model.forward(prompt_ids)) - theirs).max()
    print(f"SmolLM2, {len(prompt_ids)} tokens: max |log p - log p_hf| = {diff:.1e}")
    assert diff < 1e-3
else:
    print(
        "transformers is not installed: skipping the comparison (pip install -e "
        "'.[test]')"
    )

# %% [markdown]
# ## What attention looks at
#
# With the forward pass in hand we can look inside. Handed an attention object that
# keeps what it computes, the NumPy model gives back every layer's probabilities
# $p_{ij}$ for SmolLM2's chat prompt, 30 layers × 9 heads. Most heads put most of their
# weight on the very first token, `<|im_start|>` — an *attention sink*, a place to park
# probability when nothing else is relevant. Two kinds of heads stand out; we let the
# numbers pick them: the head that most often looks at the **previous token** (the
# diagonal just below the main one), and the head whose **last query** — the token from
# which the answer will be predicted — looks hardest at a word of the question.

# %% tags=["hide-input"]
# the same attention, keeping what it computed
looking = CausalAttention(config, keep_probs=True)
model.forward(prompt_ids, attention=looking)
# (layers, H, T, T)
P = np.stack([looking.probs[layer] for layer in range(config.num_hidden_layers)])
labels = [
    tokenizer.decode([i], skip_special_tokens=False).replace("\n", "\\n")
    for i in prompt_ids
]
T_prompt = len(prompt_ids)
# (layers, H): mean p_{i, i-1}
previous = P[:, :, np.arange(1, T_prompt), np.arange(T_prompt - 1)].mean(-1)
prev_layer, prev_head = np.unravel_index(previous.argmax(), previous.shape)
question = [
    j for j, text in enumerate(labels) if text.strip() in ("What", "capital", "France")
]
last_row = P[:, :, -1, question]  # (layers, H, words of the question)
look_layer, look_head, look_word = np.unravel_index(last_row.argmax(), last_row.shape)
look_token = question[look_word]
prose.glue("ch07_prev_head", f"layer {prev_layer}, head {prev_head}")
prose.glue("ch07_prev_mass", f"{previous.max():.0%}")
prose.glue("ch07_look_head", f"layer {look_layer}, head {look_head}")
prose.glue("ch07_look_word", f"“{labels[look_token].strip()}”")
prose.glue("ch07_look_mass", f"{last_row.max():.0%}")
prose.glue("ch07_sink_mass", f"{P[:, :, 1:, 0].mean():.0%}")

fig, axes = new_figure(1, 2, width=13, height=6.4)
for ax, (layer, head, title) in zip(
    axes,
    [
        (prev_layer, prev_head, "previous token"),
        (look_layer, look_head, "looks up the question"),
    ],
):
    ax.imshow(P[layer, head], cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(T_prompt), labels, rotation=90, fontsize=6)
    ax.set_yticks(range(T_prompt), labels, fontsize=6)
    ax.set_title(f"SmolLM2 layer {layer}, head {head}: {title}")
    ax.set_xlabel("key (attended to)")
axes[0].set_ylabel("query")
plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
Across all heads, queries after the first put {{ch07_sink_mass}} of their weight on the
first token. The previous-token head ({{ch07_prev_head}}) puts {{ch07_prev_mass}} of
each row's weight on the token just before — a building block of copying and of
in-context learning. In {{ch07_look_head}}, the last token of the prompt, the one whose
logits predict the first word of the answer, gives {{ch07_look_mass}} of its attention
to {{ch07_look_word}}: the head has found what the question is about.
""")

# %% [markdown]
# ## The forward pass with kernels
#
# The kernel model runs the same steps with the kernels of chapters 3 to 7. Weights go
# to the GPU once, as bf16, already fused; a tied head uploads the embedding table once
# and uses it twice. Its `run` method only launches kernels, on one stream, into buffers
# allocated beforehand: no allocation and no copy between the host and the GPU, so
# chapter 11 can capture it in a CUDA graph. Like the NumPy model it takes its attention
# as an argument — an object called as `attention(layer, qkv, out, stream, rope)` — and
# stops at the final norm; the head is a separate call, `compute_logits`, because an
# engine needs logits for only a few rows. RoPE goes to the attention layer with the
# positions, `rope=(table, positions)`: this chapter's `FlashAttention` rotates q and
# k with `rope_qkv` before it attends, and chapter 8's cached attention rotates them in
# the kernel that writes the cache. The dtypes follow the table at the start of the
# chapter; three fusions save launches and bytes:
#
# - the **residual add inside the projection**: the output and down projections add
#   their result to the float32 residual stream (chapter 6's `accumulate`), where it is
#   made, instead of writing it for an add kernel to read back;
# - the **norm inside the next projection** where chapter 6's `rmsnorm_linear` says so
#   (`norm_in_gemv`: the GEMV runs, and the projection is short enough, which on the
#   H200 means QKV at one token): the GEMV reads the residual stream and the norm's
#   weight itself. Elsewhere chapter 4's `rmsnorm` writes bf16 normed rows and the
#   projection reads them;
# - the attention kernel and `silu_mul` write **bf16** straight away, the inputs of
#   `o_proj` and `down_proj`; at one token on the GEMV's path, where the norm is not
#   inside gate-up's GEMV, the gated GEMV above writes SiLU·up itself, where gate and
#   up are made (`silu_in_gemv`; `GATED_GEMV_MAX_TOKENS` from chapter 11's sweep), after
#   chapter 4's norm.
#
# (Chapter 11 times each fusion against the kernels it replaces, the norm inside the
# gate-up GEMV too. The loop asks for the MLP's first half in one call,
# `rmsnorm_linear_silu_mul`, so that a weight with a faster way can take it: chapter
# 15's 8-bit one can do all three in one kernel.)
#
# Per layer that is seven to nine launches: norm (where it is not inside the QKV
# projection), QKV projection, RoPE, attention, o projection (+ add), norm (likewise),
# gate/up projection, SiLU·up (inside the gated GEMV at one token), down projection
# (+ add) — seven at one token on the H200 — and around them the embedding and the
# final norm; the head is `compute_logits`.

# %%
# chapter 6's choices of path, which the function below asks too
from tinyvllm_lib.layers.linear import linear_path, norm_in_gemv  # noqa: I001

# %%
#| export layers.linear
from tinyvllm_lib.kernels.activation import gemv_silu_mul, silu_mul

# Up to how many tokens the MLP's first half is the gated GEMV (SiLU·up made where gate
# and up are), where the GEMV runs: one, from chapter 11's sweep
GATED_GEMV_MAX_TOKENS = 1


def silu_in_gemv(normed, w) -> bool:
    """Whether rmsnorm_linear_silu_mul makes SiLU·up inside gate-up's GEMV (the gated
    GEMV) for these operands: up to GATED_GEMV_MAX_TOKENS tokens on the GEMV's path,
    where the norm is not already inside that GEMV (norm_in_gemv: there the gated GEMV
    would save no launch).
    """
    return (
        normed.shape[0] <= GATED_GEMV_MAX_TOKENS
        and linear_path(normed, w) == "gemv"
        and not norm_in_gemv(normed, w)
    )


def rmsnorm_linear_silu_mul(residual, norm_weight, eps, w, act, gate_up, normed, *,
                            stream=0, workspace=None):
    """act (num_tokens, I) bf16 bits = SiLU(gate) * up for [gate | up] =
    RMSNorm(residual) · wᵀ. Where silu_in_gemv: chapter 4's norm into normed, then the
    gated GEMV into act (gate_up untouched); else rmsnorm_linear into gate_up (float32,
    (num_tokens, 2 I)), then silu_mul. A weight that makes act itself (chapter 15's
    8-bit one) is asked to, and may leave gate_up and normed alone.
    """
    if hasattr(w, "apply_rmsnorm_silu_mul"):
        return w.apply_rmsnorm_silu_mul(residual, norm_weight, eps, act, gate_up,
                                        normed, stream=stream, workspace=workspace)
    if silu_in_gemv(normed, w):
        rmsnorm(residual, norm_weight, eps, normed, stream=stream)
        return gemv_silu_mul(normed, w, act, stream=stream)
    rmsnorm_linear(residual, norm_weight, eps, w, gate_up, normed, stream=stream,
                   workspace=workspace)
    return silu_mul(gate_up, act, stream=stream)


# %%
#| export models.llama_cuda
import numpy as np
from numba import cuda

from tinyvllm_lib.distributed.communicator import Communicator
from tinyvllm_lib.kernels.embedding import check_token_ids, embed
from tinyvllm_lib.kernels.rmsnorm import rmsnorm
from tinyvllm_lib.kernels.rope import check_positions, rope_table_from_config
from tinyvllm_lib.layers.attention import FlashAttention
from tinyvllm_lib.layers.linear import (
    linear,
    rmsnorm_linear,
    rmsnorm_linear_silu_mul,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import fuse_llama_weights
from tinyvllm_lib.models.loader import load_weights


class LlamaCuda:
    """The Llama forward pass with the book's kernels: bf16 weights on the GPU, float32
    stream, bf16 linear inputs.
    """

    def __init__(
        self, config: ModelConfig, weights: dict[str, np.ndarray],
        comm: Communicator | None = None,
    ):
        """comm: the ranks this model's shard of weights is one of (chapter 13); None:
        one rank, all the weights.
        """
        self.config, self.comm = config, comm or Communicator()
        self._logits_part = None  # chapter 13: this rank's columns of the logits
        fused = fuse_llama_weights(weights, config)
        self.weights = {
            name: self.to_device(name, bits)
            for name, bits in fused.items()
            if name != "lm_head"
        }
        is_tied = fused["lm_head"] is fused["embed_tokens"]
        self.weights["lm_head"] = (
            self.weights["embed_tokens"]
            if is_tied
            else self.to_device("lm_head", fused["lm_head"])
        )
        # cos and sin tables (chapter 5)
        self.rope = rope_table_from_config(config).to_device()

    def to_device(self, name: str, bits: np.ndarray):
        """One fused weight (bf16 bits) on the GPU (chapter 15's 8-bit model stores its
        matrices otherwise).
        """
        return cuda.to_device(np.ascontiguousarray(bits))

    @classmethod
    def from_folder(cls, folder) -> "LlamaCuda":
        """Read config.json and the weights of a Hugging Face Llama folder; copy the
        weights to the GPU.
        """
        config = ModelConfig.from_folder(folder)
        return cls(config, load_weights(folder, config, progress=False))

    def make_buffers(self, num_tokens: int) -> dict:
        """Device buffers for a forward pass of up to num_tokens tokens (the caller owns
        and keeps them).
        """
        c = self.config
        q_width, kv_width, hidden = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.hidden_size,
        )
        shapes = {
            "ids": ((num_tokens,), np.int64),
            "positions": ((num_tokens,), np.int64),
            "residual": ((num_tokens, hidden), np.float32),  # the residual stream
            # RMSNorm output, bf16: a linear layer's input
            "normed": ((num_tokens, hidden), np.uint16),
            "qkv": ((num_tokens, q_width + 2 * kv_width), np.float32),
            # attention output, bf16: o_proj's input
            "attn": ((num_tokens, q_width), np.uint16),
            "gate_up": ((num_tokens, 2 * c.intermediate_size), np.float32),
            # SiLU(gate) * up, bf16: down_proj's input
            "act": ((num_tokens, c.intermediate_size), np.uint16),
        }
        return {
            name: cuda.device_array(shape, dtype)
            for name, (shape, dtype) in shapes.items()
        }

    def run(self, b: dict, attention, stream=0, workspace=None) -> None:
        """The layer loop, launched on `stream`: b["ids"], b["positions"] in, the
        final-normed b["normed"] out.

        b: make_buffers' arrays, each cut to this pass's tokens; attention(layer, qkv,
        out, stream, rope) rotates q and k by rope = (table, positions) and writes the
        attention output. Allocates and copies nothing.
        workspace: a device buffer cuBLAS may use (chapter 11's CUDA graphs need one
        that stays put).
        """
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        on = {"stream": stream, "workspace": workspace}  # every linear layer's
        is_first = self.comm.rank == 0
        embed(b["ids"], w["embed_tokens"], b["residual"], stream=stream)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            # x = residual: qkv = norm(x) · Wqkvᵀ, one kernel where chapter 6 says so
            norm_qkv = (w[p + "input_layernorm"], eps, w[p + "qkv_proj"], b["qkv"])
            rmsnorm_linear(b["residual"], *norm_qkv, b["normed"], **on)
            # the attention layer rotates q and k (with its cache write, if it has one)
            attention(i, b["qkv"], b["attn"], stream, rope=(self.rope, b["positions"]))
            # x += attn · Woᵀ: the residual add is the projection's epilogue; with
            # several ranks (chapter 13) rank 0 adds, the others write their part, and
            # the sum over ranks adds the residual once
            linear(b["attn"], w[p + "o_proj"], b["residual"], accumulate=is_first, **on)
            self.comm.all_reduce(b["residual"], stream)
            norm_up = (w[p + "post_attention_layernorm"], eps, w[p + "gate_up_proj"])
            # act = SiLU(gate) · up of norm(x) · Wgate_upᵀ
            rmsnorm_linear_silu_mul(b["residual"], *norm_up, b["act"], b["gate_up"],
                                    b["normed"], **on)
            linear(b["act"], w[p + "down_proj"], b["residual"], accumulate=is_first,
                   **on)
            self.comm.all_reduce(b["residual"], stream)
        rmsnorm(b["residual"], w["norm"], eps, b["normed"], stream=stream)

    def compute_logits(self, hidden, out, stream=0, workspace=None) -> None:
        """The LM head: hidden (rows, hidden) bf16 bits on the GPU -> out (rows,
        vocab_size) float32. With several ranks (chapter 13) each computes its columns,
        and the ranks gather them.
        """
        head, on = self.weights["lm_head"], {"stream": stream, "workspace": workspace}
        if self.comm.world_size == 1:
            linear(hidden, head, out, **on)
            return
        rows = hidden.shape[0]
        if self._logits_part is None or len(self._logits_part) < rows:
            self._logits_part = cuda.device_array((rows, len(head)), np.float32)
        linear(hidden, head, self._logits_part[:rows], **on)
        self.comm.all_gather(self._logits_part[:rows], out, stream)

    def forward(self, token_ids, positions=None, attention=None) -> np.ndarray:
        """Logits (T, vocab_size), float32 on the host; one sequence by default,
        positions 0, 1, ..., T - 1.

        Allocates its buffers on every call: for checks and demos, not for an engine's
        steps.
        """
        ids = check_token_ids(token_ids, self.config.vocab_size)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        b = self.make_buffers(ids.size)
        b["ids"].copy_to_device(np.ascontiguousarray(ids, np.int64))
        b["positions"].copy_to_device(check_positions(positions, ids.size))
        if attention is None:
            attention = FlashAttention(
                self.config, cuda.to_device(np.array([0, ids.size], np.int32)), ids.size
            )
        self.run(b, attention)
        logits = cuda.device_array((ids.size, self.config.vocab_size), np.float32)
        self.compute_logits(b["normed"], logits)
        return logits.copy_to_host()


# %% [markdown]
# How close must the two models be? Not bit for bit: the kernels sum in other orders
# than NumPy's BLAS, and a bf16 rounding near a boundary can then go the other way,
# which later layers amplify. The NumPy model with `bf16_activations=True` rounds in
# exactly the same places, so the difference left is the summation order. We compare
# log-probabilities where they matter — at every position, the five tokens the reference
# finds most likely — and ask for a mean difference below 0.05 and the same greedy token
# wherever the reference's first choice leads its second by more than 0.1. Against the
# pure float32 reference the numbers show what the bf16 activations themselves cost. In
# the simulator we run a tiny random model (chapter 6's kernels run as Python threads
# there: slow); on a GPU, SmolLM2 on the chat prompt.

# %% tags=["hide-input"]
from tinyvllm_lib.models.llama_cuda import LlamaCuda


def top_log_prob_gap(
    ours: np.ndarray, ref: np.ndarray, k: int = 5
) -> tuple[float, float]:
    """(mean |Δ log p| over each position's k most likely tokens of ref, max |Δ log p|
    at its most likely token).
    """
    top = np.argsort(-ref, axis=-1)[:, :k]
    rows = np.arange(ref.shape[0])[:, None]
    gap = np.abs(ours[rows, top] - ref[rows, top])
    return float(gap.mean()), float(gap[:, 0].max())


def greedy_agrees(ours: np.ndarray, ref: np.ndarray, margin: float = 0.1) -> bool:
    """Same most likely token at every position where ref's first choice leads its
    second by more than `margin`.
    """
    top2 = np.sort(ref, axis=-1)[:, -2:]
    is_clear = top2[:, 1] - top2[:, 0] > margin
    return bool(np.all(ours.argmax(-1)[is_clear] == ref.argmax(-1)[is_clear]))


def compare_models(check_folder, token_ids, label: str) -> None:
    ours = log_softmax(LlamaCuda.from_folder(check_folder).forward(token_ids))
    for name, bf16 in (("bf16 activations", True), ("float32", False)):
        ref = log_softmax(
            LlamaNumpy.from_folder(check_folder, bf16_activations=bf16).forward(
                token_ids
            )
        )
        mean_gap, top_gap = top_log_prob_gap(ours, ref)
        print(
            f"{label}, kernels vs NumPy ({name}): mean |Δ log p| over the top 5 = "
            f"{mean_gap:.4f}, "
            f"at the top token <= {top_gap:.4f}, greedy tokens agree: "
            f"{greedy_agrees(ours, ref)}"
        )
        prose.glue(f"ch07_model_gap_{'bf16' if bf16 else 'f32'}", f"{mean_gap:.3f}")
        prose.glue("ch07_model_case", label)
        if bf16:
            assert mean_gap <= 0.05 and greedy_agrees(ours, ref)


if is_simulator():
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_llama_config(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=32,
            head_dim=8,
            vocab_size=64,
        )
        compare_models(
            make_random_llama(tmp, cfg, seed=2),
            rng.integers(0, 64, 3),
            "tiny random Llama, 3 tokens",
        )
elif has_gpu():
    compare_models(folder, prompt_ids, f"SmolLM2, {len(prompt_ids)} tokens")
    gpu_model = LlamaCuda(config, weights)
    ids = list(prompt_ids)
    for _ in range(8):
        ids.append(int(np.argmax(gpu_model.forward(ids)[-1])))
    print("greedy with the kernels:", repr(tokenizer.decode(ids[len(prompt_ids) :])))
    assert "Paris" in tokenizer.decode(ids[len(prompt_ids) :])
else:
    prose.glue("ch07_model_gap_bf16", "(needs a GPU or the simulator)")
    prose.glue("ch07_model_gap_f32", "(needs a GPU or the simulator)")
    prose.glue("ch07_model_case", "nothing: no GPU and no simulator")
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernel model")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
In this run — {{ch07_model_case}} — the mean gap over the top five tokens is
{{ch07_model_gap_bf16}} against the NumPy model with the same roundings (the kernels'
own summation order, amplified wherever a bf16 rounding flips) and
{{ch07_model_gap_f32}} against the float32 one, which adds what the bf16 inputs of the
linear layers themselves cost. A tiny random model in the simulator says only that the
kernels compute the right thing; what the gap is for a real model at its real size is
what a GPU run measures (SmolLM2 on the chat prompt).
""")

# %% [markdown]
# ## How fast is attention? Count first
#
# For one head and a query at position $i$, the scores take $i + 1$ dot products of
# length $D$ and the weighted sum of values as many again, 2 FLOPs per multiply-add.
# Summed over the causal triangle and the heads:
#
# $$ \text{FLOPs} = 2 \cdot 2 \cdot H \cdot D \cdot \sum_{i=0}^{T-1} (i + 1) = 2\,H D\
#    , T (T + 1). $$
#
# (The exponentials and the softmax's divisions are a $1/D$ fraction of that; we do not
# count them.) For Llama 3.2 1B at T = 2,048 that is 17 GFLOP per layer. The compulsory
# bytes are small: `qkv` in, the output out, 41 MB. So the fused kernel is
# compute-bound, and its ceiling is the GPU's float32 rate on CUDA cores — these kernels
# do not use tensor cores (the same 67 TFLOP/s that chapter 6's GEMM ladder is measured
# against).
#
# The materialised rung does the same useful FLOPs but moves the score matrix: written
# once, read three times and written twice by the softmax, and half of it read by $P V$
# — about six times $H T^2 \cdot 4$ bytes. At chapter 1's bandwidth ceiling that alone
# sets its floor:


# %%
#| export
def attention_flops(num_tokens: int, num_heads: int, head_dim: int) -> int:
    """Useful FLOPs of causal attention for one sequence: q·k and p·v over j <= i, 2 per
    multiply-add.
    """
    return 2 * num_heads * head_dim * num_tokens * (num_tokens + 1)


# %% tags=["hide-input"]
FP32_PEAK_TFLOPS = 67.0  # H200 SXM datasheet: float32 FMA on CUDA cores
# Llama 3.2 1B, a 2,048-token prompt
T_bench, H_bench, KVH_bench, D_bench = 2048, 32, 8, 64
flops = attention_flops(T_bench, H_bench, D_bench)
score_bytes = 6 * H_bench * T_bench**2 * 4
ceiling_gbs, ceiling_name = bandwidth_ceiling()  # chapter 1's best rate
print(
    f"{flops / 1e9:.1f} GFLOP: {flops / (FP32_PEAK_TFLOPS * 1e12) * 1e3:.2f} ms at "
    "the float32 peak; "
    f"the materialised rung moves {score_bytes / 2**30:.1f} GiB of scores"
    + (
        f": {score_bytes / (ceiling_gbs * 1e9) * 1e3:.2f} ms at the ceiling"
        if ceiling_name
        else ""
    )
)
prose.glue("ch07_gflop", f"{flops / 1e9:.1f} GFLOP")
prose.glue("ch07_peak_ms", f"{flops / (FP32_PEAK_TFLOPS * 1e12) * 1e3:.2f} ms")
prose.glue("ch07_score_gib", f"{score_bytes / 2**30:.1f} GiB")
prose.glue(
    "ch07_score_ms",
    f"{score_bytes / (ceiling_gbs * 1e9) * 1e3:.2f} ms"
    if ceiling_name
    else "(not yet measured)",
)
prose.glue("ch07_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
{{ch07_gflop}} take at least {{ch07_peak_ms}} at the float32 peak; the materialised
rung's {{ch07_score_gib}} of score traffic take {{ch07_score_ms}} at {{ch07_ceiling}},
before it computes anything.
""")

# %% [markdown]
# `bench/ch07_attention.py` times both rungs at Llama 3.2 1B's shapes from 512 to 8,192
# tokens (the materialised one up to 4,096: at 8,192 its scores need 8 GiB), each inside
# a CUDA graph, each checked against `attention_ref` first, and records TFLOP/s against
# the float32 peak in `book/data/ch07_attention.json`. On a GPU it runs here; elsewhere
# we plot the recorded file.

# %% tags=["hide-input"]
if has_gpu():
    bench = (
        Path("../bench/ch07_attention.py")
        if Path("../bench").exists()
        else Path("bench/ch07_attention.py")
    )
    runpy.run_path(str(bench), run_name="__main__")

records = load_records("ch07_attention")
print(f"{len(records)} recorded measurements")
print(records_table(records, time_key="ms"))


# %% tags=["hide-input"]
def find(name: str, num_tokens: int) -> dict | None:
    return next(
        (r for r in records if r["name"] == name and r["shape"][0] == num_tokens), None
    )


flash_r, mat_r = (
    find("attention_flash", T_bench),
    find("attention_materialized", T_bench),
)
prose.glue(
    "ch07_device", records[0]["device"]["name"] if records else "GPU (not yet measured)"
)
prose.glue(
    "ch07_flash_tflops",
    f"{flash_r['value']:.1f} TFLOP/s" if flash_r else "(not yet measured)",
)
prose.glue(
    "ch07_flash_ratio", f"{flash_r['ratio']:.0%}" if flash_r else "(not yet measured)"
)
prose.glue(
    "ch07_flash_ms", f"{flash_r['ms']:.2f} ms" if flash_r else "(not yet measured)"
)
prose.glue(
    "ch07_mat_tflops",
    f"{mat_r['value']:.2f} TFLOP/s" if mat_r else "(not yet measured)",
)
prose.glue("ch07_mat_ms", f"{mat_r['ms']:.2f} ms" if mat_r else "(not yet measured)")
prose.glue(
    "ch07_speedup",
    f"{mat_r['ms'] / flash_r['ms']:.1f}×"
    if flash_r and mat_r
    else "(not yet measured)",
)

if records:
    fig, ax = new_figure(width=7, height=3.4)
    for name, label in (
        ("attention_flash", "fused tiles, online softmax"),
        ("attention_materialized", "materialised scores"),
    ):
        pts = sorted((r["shape"][0], r["value"]) for r in records if r["name"] == name)
        if pts:
            ax.plot(*zip(*pts), "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T (32 heads, 8 KV heads of 64)")
    ax.set_ylabel("TFLOP/s (causal FLOPs)")
    ax.set_title(f"prefill attention on {records[0]['device']['name']}")
    ax.legend()
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch07_device}}, at 2,048 tokens, the fused kernel reaches {{ch07_flash_tflops}}
({{ch07_flash_ratio}} of the float32 peak, {{ch07_flash_ms}} per layer), and the
materialised rung {{ch07_mat_tflops}} ({{ch07_mat_ms}}): the fused kernel is
{{ch07_speedup}} faster. The materialised rung pays for its score traffic and for its
uncoalesced reads of keys (a warp's threads read 32 different key rows); its cost grows
with $T^2$ in bytes as well as FLOPs. The fused kernel reads each K/V tile once per
query tile, and spends its time in the multiply-adds of its inner loops, each of which
also reads shared memory — one load per FMA, which is why it stays well below the peak.
The real FlashAttention computes each tile product on tensor cores in bf16, with every
thread holding a block of several queries and keys, and reaches hundreds of TFLOP/s; at
2,048 tokens attention is then a small part of a layer's time next to its linear layers.
""")

# %% [markdown]
# ## Summary
#
# - A Llama layer: RMSNorm → one fused QKV projection → RoPE → causal grouped-query
#   attention → $W_o$ → residual add; RMSNorm → one fused gate/up projection →
#   SiLU(gate)·up → $W_\text{down}$ → residual add. Then a final norm and the LM head,
#   tied to the embedding or not.
# - Activations: the residual stream is float32, the inputs of linear layers bf16, their
#   outputs float32; the norm, attention and SiLU kernels write bf16 where a linear
#   layer reads.
# - Softmax: the naive one overflows at scores near 89 in float32; subtracting the
#   maximum fixes it; the online softmax does it in one pass with a running maximum and
#   sum, and carries an output accumulator along — the heart of FlashAttention.
# - Two attention kernels: materialised scores (three launches, $O(H T^2)$ bytes of
#   traffic), and a fused kernel with a block per (query tile, head, sequence), K/V
#   tiles in shared memory and the query, accumulator, maximum and sum in registers; it
#   runs several sequences packed back to back (`query_start_loc`) in one launch.
# - The layer loop is written once per backend and takes attention as an argument, so
#   later chapters change how tokens attend (a cache, a batch, pages) without touching
#   it.
# - The NumPy forward pass matches `transformers` to $10^{-3}$ in log-probability (in
#   practice $10^{-5}$–$10^{-4}$); the kernel model matches the NumPy model run with the
#   same bf16 roundings.
#
# Exported to `tinyvllm_lib`: `kernels.attention` (`attention_ref`, `softmax_ref`,
# `log_softmax`, `split_qkv`, `flash_attention` over sequences packed by
# `query_start_loc`, `make_flash_attention_kernel`, `attention_flops`),
# `kernels.attention_materialized` (rung 1: `attention_materialized` and its three
# kernels), `kernels.activation` (`silu_mul_ref`, `silu_mul`), `layers.attention`
# (`CausalAttention`, `FlashAttention`: attention as an object the layer loop is
# handed), `models.llama_numpy` (`fuse_llama_weights`, `LlamaNumpy`),
# `models.llama_cuda` (`LlamaCuda`), `models.random_llama` (`make_random_llama`,
# `tiny_llama_config`, `LLAMA_3_2_1B_CONFIG`) and, into `measure`, `max_rel_error`.
#
# ## Exercises
#
# 1. How large is the score matrix of Llama 3.2 1B for a 32,768-token prompt? Which rung
#    could run it on an H200, and what would the other need?
# 2. In `attention_ref`, replace `softmax_ref` with `softmax_naive` and run SmolLM2 on
#    the chat prompt. Does anything overflow? Multiply every query by 10 and try again.
# 3. On a GPU, launch `flash_attention` once with `head_dim` 64 and once with 128, then
#    compare `get_regs_per_thread()` and `get_local_mem_per_thread()` of
#    `flash_attention_d64_kernel` and `flash_attention_d128_kernel`. Predict the effect
#    of the spills on TFLOP/s, then measure.
# 4. Change `FLASH_BLOCK_Q` to 32 and to 128. Predict how the number of blocks, the
#    reuse of each K/V tile and the occupancy change, then measure.
# 5. The fused kernel's block loads K and V for one head; GQA means `H / H_kv` heads of
#    the same group load the same tiles. Make a block handle a whole group of query
#    heads, and measure.
# 6. How many FLOPs do a layer's linear layers do for a 2,048-token prompt of Llama 3.2
#    1B, compared with its attention? At which prompt length are they equal?
