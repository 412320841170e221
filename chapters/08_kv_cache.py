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
# # 8. The KV cache: generating text
#
# Chapter 7 ended with a model that answers "What is the capital of France?" with "Paris" — by
# running the whole forward pass over the whole conversation again for every new token. This
# chapter turns that model into an **engine**: it keeps every token's keys and values (the
# *KV cache*) so that each new token costs one token's work, picks tokens the way vLLM does
# (temperature, top-k, top-p, a seed per request), knows when to stop, streams text as it is
# generated, and offers vLLM's API: `LLM(...).generate(prompts, SamplingParams(...))`.
#
# In this chapter you will learn:
#
# - why generation has two phases, **prefill** and **decode**, and what each costs in FLOPs and
#   bytes per token, for SmolLM2 and Llama 3.2 1B;
# - the **KV cache**: its layout (per layer, keys and values indexed by a *slot*), its size per
#   token, and the *slot mapping* that tells the runner where each token's keys and values go;
# - **sampling** as vLLM does it: temperature, then top-k, then top-p, then a draw from the
#   request's own random generator — checked as a distribution with a chi-square test;
# - when to **stop** (end-of-sequence ids, stop strings, stop tokens, a length limit) and how to
#   **stream** text when a character spans several tokens;
# - the first version of the public API, `LLM` and `SamplingParams`, and the command line:
#   `python -m tinyvllm_lib generate "..." --chat`.
#
# It builds on the NumPy forward pass of [chapter 7](07_attention.py), the model config of
# [chapter 2](02_safetensors.py), SmolLM2 from [chapter 2b](02b_smollm2.py) and the tokenizer of
# [chapter 3](03_first_kernel.py). Everything here runs on the CPU; the CUDA runner plugs into the
# same engine in chapter 11.

# %%
#| default_exp engine.llm

# %%
import io
import math
import tempfile
import time
from contextlib import redirect_stdout

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

from tinyvllm_lib.cli import command, main
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.measure import load_records
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy, log_softmax
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama, tiny_llama_config
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import glue, new_figure
from tinyvllm_lib.tokenizer import Tokenizer

rng = np.random.default_rng()
folder = resolve_model("smollm2")  # chapter 2b: built on first use, then found in the cache
smollm2 = ModelConfig.from_folder(folder)
llama_1b = ModelConfig.from_dict(LLAMA_3_2_1B_CONFIG)
tokenizer = Tokenizer.from_folder(folder)

# %% [markdown]
# ## Prefill and decode: count first
#
# Generating an answer has two phases. **Prefill** runs the prompt — all its tokens at once —
# through the model, and the logits of its last position give the first new token. **Decode**
# then produces one token per step: each step's input is the token the step before chose.
#
# Both phases multiply every token's activations by every weight matrix: about $2P$ FLOPs per
# token for a model whose matrices hold $P$ weights (one multiply and one add per weight).
# Attention adds $4 \cdot L \cdot H \cdot D \cdot n$ FLOPs per token at context length $n$ (the
# products $q \cdot k$ and $p \cdot v$, in each of $L$ layers and $H$ heads of size $D$).
# What differs is the **bytes**. A forward pass over $T$ tokens reads each weight once for all
# $T$ of them: prefill shares the $2P$ bytes of bf16 weights among hundreds of prompt tokens,
# decode spends them on one token. The *arithmetic intensity* — FLOPs per byte read — is
#
# $$ I(T) \approx \frac{2 P T}{2 P} = T \ \text{FLOP/byte} \quad (\text{bf16 weights, } T \text{ tokens per pass}). $$
#
# An H200 does about 990 dense bf16 TFLOP/s and reads about 4.8 TB/s: below about 200 FLOPs per
# byte it waits for memory. A decode step at batch 1 has $I \approx 1$; it is **memory-bound**,
# and its speed limit is simply (bytes per step) / (bandwidth). Batching decode steps of many
# sequences (chapter 9) is how an engine raises $T$ for decode.

# %%
def matrix_params(c: ModelConfig) -> int:
    """Weights in the matrices that every token multiplies: q/k/v/o, gate/up/down per layer, and the head."""
    attention = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attention += c.num_attention_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attention + mlp) + c.vocab_size * c.hidden_size


def step_costs(c: ModelConfig, num_tokens: int, context_len: int, weight_bytes: int = 2, kv_bytes: int = 2) -> dict:
    """FLOPs and bytes of one forward pass over `num_tokens` new tokens at `context_len` (batch of one sequence)."""
    params = matrix_params(c)
    flops = num_tokens * (2 * params + 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context_len)
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_bytes
    nbytes = params * weight_bytes + context_len * kv_per_token  # the weights once; the cache read once
    return {"flops": flops, "bytes": nbytes, "flops_per_token": flops / num_tokens, "bytes_per_token": nbytes / num_tokens}


for name, c in (("SmolLM2-135M", smollm2), ("Llama 3.2 1B", llama_1b)):
    prefill, decode = step_costs(c, 512, 512), step_costs(c, 1, 512)
    print(f"{name:>13}: {matrix_params(c) / 1e6:6.0f} M matrix weights | per token: prefill of 512 "
          f"{prefill['flops_per_token'] / 1e9:.2f} GFLOP, {prefill['bytes_per_token'] / 1e6:6.2f} MB | "
          f"decode at 512 {decode['flops_per_token'] / 1e9:.2f} GFLOP, {decode['bytes_per_token'] / 1e6:7.1f} MB")

decode_1b = step_costs(llama_1b, 1, 512)
copy = [r for r in load_records("ch01_bf16") if r["name"] == "copy"]  # chapter 1's measured copy bandwidth
bandwidth = copy[0]["value"] * 1e9 if copy else 4.8e12  # bytes/s; the datasheet's figure until one is recorded
glue("ch08_1b_gflop", f"{decode_1b['flops'] / 1e9:.2f} GFLOP")
glue("ch08_1b_gb", f"{decode_1b['bytes'] / 1e9:.2f} GB")
glue("ch08_bandwidth", f"{bandwidth / 1e12:.2f} TB/s" + (f" that chapter 1 measured on the {copy[0]['device']['name']}" if copy else ""))
glue("ch08_1b_limit", f"{bandwidth / decode_1b['bytes']:,.0f} tokens/s")
glue("ch08_smol_mb", f"{step_costs(smollm2, 1, 512, weight_bytes=4, kv_bytes=4)['bytes'] / 1e6:.0f} MB")

# %% [markdown]
# A decode step of Llama 3.2 1B at a context of 512 tokens does {glue:text}`ch08_1b_gflop` and
# reads {glue:text}`ch08_1b_gb`, so at the {glue:text}`ch08_bandwidth` no implementation can decode
# one sequence faster than about {glue:text}`ch08_1b_limit`. Our CPU backend keeps SmolLM2's weights in float32: it
# reads {glue:text}`ch08_smol_mb` per step, and the memory bandwidth of the CPU sets its speed
# the same way. The plot shows the intensity as the number of tokens per pass grows.

# %%
tokens = np.unique(np.geomspace(1, 4096, 40).astype(int))
fig, ax = new_figure(width=6.5, height=3)
for name, c in (("SmolLM2-135M", smollm2), ("Llama 3.2 1B", llama_1b)):
    ax.plot(tokens, [step_costs(c, t, t)["flops"] / step_costs(c, t, t)["bytes"] for t in tokens], label=name)
ax.axhline(990 / 4.8, color="k", ls="--", lw=1, label="H200 ridge (990 TFLOP/s / 4.8 TB/s)")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("tokens per forward pass (decode at batch 1 = 1)")
ax.set_ylabel("FLOPs per byte read")
ax.set_title("decode is memory-bound; prefill is compute-bound")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Without a cache, each step redoes the past
#
# The loop at the end of chapter 7 called `forward(ids)` on the whole sequence for every new
# token, so step $n$ did $n$ tokens' work: generating $N$ tokens after a prompt of $n_0$ costs
# $\sum_{n=n_0}^{n_0+N} n \approx N n_0 + N^2/2$ tokens' worth of FLOPs instead of $N$. Yet
# nothing of the past changes from one step to the next: the causal mask means a token's keys and
# values depend only on the tokens before it. So keep them. A layer's attention for the new
# token at position $n$ needs
#
# $$ o_n = \sum_{j \le n} \operatorname{softmax}_j\!\Big(\frac{q_n \cdot k_j}{\sqrt{D}}\Big)\, v_j, $$
#
# the new query against **all** keys and values so far. With $k_j, v_j$ for $j < n$ stored, a
# decode step computes $q_n, k_n, v_n$ for one token, appends $k_n, v_n$, and attends.
#
# ## The cache layout: slots
#
# Per layer, one array of keys and one of values, each `(num_slots, num_kv_heads, head_dim)`.
# A **slot** is one row: one token's key (or value) heads in one layer. Only the key/value heads
# are stored — with grouped-query attention several query heads read the same one (chapter 7),
# which is exactly why GQA exists: Llama 3.2 1B stores 8 heads, not 32. Per token, in bf16:
#
# $$ 2 \,(\text{K and V}) \times L \times H_{kv} \times D \times 2 \text{ bytes}. $$

# %%
#| export engine.kv_cache
from dataclasses import dataclass

import numpy as np

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig

KV_CACHE_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}  # how each is stored: bf16 as its bits


def kv_cache_bytes_per_token(config: ModelConfig, dtype: str = "bfloat16") -> int:
    """Bytes of one token's keys and values in every layer: 2 x layers x KV heads x head_dim x itemsize."""
    itemsize = np.dtype(KV_CACHE_DTYPES[dtype]).itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


class KVCache:
    """Keys and values of every layer, k[layer] and v[layer] of shape (num_slots, num_kv_heads, head_dim)."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: str = "bfloat16"):
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {dtype!r}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.dtype, self.num_slots = dtype, num_slots
        shape = (num_slots, config.num_key_value_heads, config.head_dim)
        # np.zeros maps zeroed pages lazily: memory is committed only where tokens are written
        self.k = [np.zeros(shape, KV_CACHE_DTYPES[dtype]) for _ in range(config.num_hidden_layers)]
        self.v = [np.zeros(shape, KV_CACHE_DTYPES[dtype]) for _ in range(config.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store float32 k and v (num_tokens, num_kv_heads, head_dim) at their slots (rounded for a bf16 cache)."""
        if self.dtype == "bfloat16":
            k, v = f32_to_bf16_bits(k), f32_to_bf16_bits(v)
        self.k[layer][slot_mapping] = k
        self.v[layer][slot_mapping] = v

    def read(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values (len(slots), num_kv_heads, head_dim) stored at `slots`."""
        k, v = self.k[layer][slots], self.v[layer][slots]
        if self.dtype == "bfloat16":
            k, v = bf16_bits_to_f32(k), bf16_bits_to_f32(v)
        return k, v


# %%
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token

for name, c in (("SmolLM2-135M", smollm2), ("Llama 3.2 1B", llama_1b)):
    per_token = kv_cache_bytes_per_token(c)
    print(f"{name:>13}: 2 x {c.num_hidden_layers} layers x {c.num_key_value_heads} KV heads x {c.head_dim} x 2 bytes "
          f"= {per_token / 1024:.1f} KiB per token; a full context of 8192 tokens: {8192 * per_token / 2**20:.0f} MiB")
assert kv_cache_bytes_per_token(llama_1b) == 2 * 16 * 8 * 64 * 2 == 32 * 1024
glue("ch08_1b_kv", f"{kv_cache_bytes_per_token(llama_1b) // 1024} KiB")
glue("ch08_1b_kv_8k", f"{8192 * kv_cache_bytes_per_token(llama_1b) / 2**20:.0f} MiB")

# %% [markdown]
# Llama 3.2 1B needs {glue:text}`ch08_1b_kv` per token, {glue:text}`ch08_1b_kv_8k` for one
# sequence of 8192 tokens — small next to its 2.5 GB of weights, but a server holds hundreds of
# sequences, and then the cache, not the weights, fills the GPU. How slots are handed out is
# what chapter 10 (paging) is about. This chapter uses the simplest scheme: sequence row $r$ of
# at most `max_num_seqs` owns `max_model_len` consecutive slots,
#
# $$ \text{slot}(r, p) = r \cdot \texttt{max\_model\_len} + p . $$
#
# The runner never computes a slot itself. It receives, with every batch, **attention
# metadata**: the *slot mapping* (the slot each new token's K and V are written to) and, per
# sequence, the slots of its context (positions $0 \dots n-1$) to attend over. Chapter 10 hands
# out slots block by block instead, builds the same two arrays, and the runner does not change.

# %%
#| export engine.kv_cache
@dataclass(frozen=True)
class AttentionMetadata:
    """Where a batch's new tokens' keys and values go, and which cached slots each sequence attends over."""

    query_lens: tuple[int, ...]  # new tokens of each sequence; a sequence's tokens are consecutive in the batch
    slot_mapping: np.ndarray  # (num_tokens,) int64: the slot of each new token's K and V
    context_slots: tuple[np.ndarray, ...]  # per sequence: the slots of its positions 0 .. seq_len - 1

    def __post_init__(self):
        if len(self.context_slots) != len(self.query_lens) or sum(self.query_lens) != len(self.slot_mapping):
            raise ValueError(f"attention metadata disagrees: {len(self.query_lens)} sequences with {sum(self.query_lens)} new "
                             f"tokens, {len(self.context_slots)} context slot lists, {len(self.slot_mapping)} slots")


class ContiguousSlots:
    """Chapter 8's slot assignment: sequence row r owns slots r * max_model_len ... (r + 1) * max_model_len - 1."""

    def __init__(self, max_num_seqs: int, max_model_len: int):
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def num_slots(self) -> int:
        return self.max_num_seqs * self.max_model_len

    def allocate(self) -> int:
        """A free cache row for a new sequence."""
        if not self.free_rows:
            raise RuntimeError(f"all {self.max_num_seqs} cache rows are in use (max_num_seqs)")
        return self.free_rows.pop()

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_num_seqs or row in self.free_rows:
            raise ValueError(f"cache row {row} is not in use")
        self.free_rows.append(row)

    def slots(self, row: int, positions) -> np.ndarray:
        """slot = row * max_model_len + position."""
        positions = np.asarray(positions, np.int64)
        if positions.size and not (0 <= positions.min() and positions.max() < self.max_model_len):
            raise ValueError(f"positions must be in [0, max_model_len = {self.max_model_len}), got {positions.min()}..{positions.max()}")
        return row * self.max_model_len + positions

    def metadata(self, rows: list[int], positions: list[np.ndarray]) -> AttentionMetadata:
        """Attention metadata for sequences (cache rows) whose new tokens sit at `positions` (each ends at its newest)."""
        slot_mapping = np.concatenate([self.slots(r, p) for r, p in zip(rows, positions)])
        context = tuple(self.slots(r, np.arange(int(p[-1]) + 1)) for r, p in zip(rows, positions))
        return AttentionMetadata(tuple(len(p) for p in positions), slot_mapping, context)


# %% [markdown]
# Two sequences in a cache of 3 rows of 16 slots: the prompt of sequence 0 (7 tokens) was
# prefilled, and it has decoded 2 tokens; sequence 1 is being prefilled with 5 tokens. Each
# square is a slot; the numbers are the slot mapping of the current step.

# %%
from tinyvllm_lib.engine.kv_cache import ContiguousSlots

demo = ContiguousSlots(max_num_seqs=3, max_model_len=16)
row0, row1 = demo.allocate(), demo.allocate()
step = demo.metadata([row0, row1], [np.array([8]), np.arange(5)])  # seq 0 decodes position 8; seq 1 prefills 0..4
print("slot_mapping:", step.slot_mapping, "| context of seq 0:", step.context_slots[0])
assert list(step.slot_mapping) == [8, 16, 17, 18, 19, 20] and len(step.context_slots[0]) == 9

fig, ax = new_figure(width=8, height=1.9)
for row in range(3):
    for pos in range(16):
        slot = row * 16 + pos
        is_new, is_cached = slot in step.slot_mapping, row == row0 and pos < 8
        color = "#d62728" if is_new else "#1f77b4" if is_cached else "#eeeeee"
        ax.add_patch(plt.Rectangle((pos, 2 - row), 0.92, 0.85, color=color))
        ax.text(pos + 0.46, 2 - row + 0.42, str(slot), ha="center", va="center", fontsize=7, color="white" if is_new or is_cached else "gray")
    ax.text(-0.3, 2 - row + 0.42, f"row {row}", ha="right", va="center", fontsize=8)
ax.plot([], [], "s", color="#1f77b4", label="cached K/V")
ax.plot([], [], "s", color="#d62728", label="written this step (slot_mapping)")
ax.set_xlim(-2, 16)
ax.set_ylim(0, 3)
ax.axis("off")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False, fontsize=8)
ax.set_title("KV cache slots: row × max_model_len + position", fontsize=9)
plt.show()

# %% [markdown]
# ## The NumPy runner: prefill and decode
#
# The runner turns a batch of new tokens into logits. Its layer is chapter 7's, with one
# change: after the QKV projection and RoPE, it **writes** the new tokens' keys and values into
# the cache at their slots, then each sequence's queries attend over the keys and values
# **read** from its context slots. A query at position $p$ sees the keys at positions $j \le p$:
# for a decode step that is all of them; for a prefill it is the causal mask of chapter 7.
# Prefill and decode are then the same call with different metadata.
#
# It reuses `LlamaNumpy`'s weights — fused and widened to float32 once — and chapter 4–7's
# reference functions; only the attention is new. With grouped-query attention the
# `group = H / H_kv` query heads of one KV head are stacked so that one matrix product serves
# them all:

# %%
#| export engine.runner_numpy
import math

import numpy as np

from tinyvllm_lib.kernels.attention import softmax_ref


def cached_attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One sequence's new queries q (n, H, D) at `positions` over its context k, v (L, KVH, D) of positions 0..L-1 -> (n, H D)."""
    num_new, num_heads, head_dim = q.shape
    context_len, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    q = q.reshape(num_new, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # (KVH, group, n, D)
    scores = (q @ k.transpose(1, 2, 0)[:, None]) * np.float32(1 / math.sqrt(head_dim))  # (KVH, group, n, L)
    is_future = np.arange(context_len)[None, :] > np.asarray(positions)[:, None]  # (n, L): key j after query i
    if is_future.any():
        scores[:, :, is_future] = -np.inf
    out = softmax_ref(scores) @ v.transpose(1, 0, 2)[:, None]  # (KVH, group, n, D)
    return out.transpose(2, 0, 1, 3).reshape(num_new, num_heads * head_dim)  # query head h = kv head * group + g


# %% [markdown]
# The runner itself. Its `execute` takes flat arrays for the whole batch — token ids, positions,
# the metadata — and returns the logits of the rows asked for: the last prompt token after a
# prefill (all of them when the user wants the prompt's log-probabilities), every sequence's new
# token after a decode. The LM head is the largest matrix of a small model (SmolLM2: 28 of its
# 135 M weights), so skipping it for the other prompt rows matters.

# %%
#| export engine.runner_numpy
from tinyvllm_lib.engine.kv_cache import AttentionMetadata, KVCache
from tinyvllm_lib.engine.sampler import Sampler
from tinyvllm_lib.kernels.activation import silu_mul_ref
from tinyvllm_lib.kernels.attention import split_qkv
from tinyvllm_lib.kernels.embedding import check_token_ids, embed_reference
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.kernels.rope import rope_qkv_ref
from tinyvllm_lib.models.llama_numpy import LlamaNumpy, check_positions


class NumpyRunner:
    """The CPU backend: LlamaNumpy's weights and reference functions, with attention over a KV cache."""

    device = "cpu"

    def __init__(self, model: LlamaNumpy, cache: KVCache):
        self.model, self.cache, self.config = model, cache, model.config
        self.sampler = Sampler()  # the device's sampler: logits (batch, vocab) -> token ids

    @classmethod
    def from_folder(cls, folder, num_slots: int, kv_cache_dtype: str = "float32") -> "NumpyRunner":
        model = LlamaNumpy.from_folder(folder)
        return cls(model, KVCache(model.config, num_slots, kv_cache_dtype))

    def execute(self, token_ids, positions, metadata: AttentionMetadata, logits_indices=None) -> np.ndarray:
        """Write the new tokens' K/V to the cache and return the logits (rows logits_indices, default all, vocab)."""
        m, c = self.model, self.config
        ids = check_token_ids(token_ids, c.vocab_size)
        positions = check_positions(positions, len(ids))
        if len(metadata.slot_mapping) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(metadata.slot_mapping)} slots in the slot mapping")
        eps = c.rms_norm_eps
        x = embed_reference(ids, m.embed_tokens)  # (T, hidden): the residual stream
        for layer in range(c.num_hidden_layers):
            p = f"layers.{layer}."
            qkv = m.linear(rmsnorm_ref(x, m.norms[p + "input_layernorm"], eps), p + "qkv_proj")  # (T, (H + 2 KVH) D)
            qkv = rope_qkv_ref(qkv, positions, m.rope, c.num_attention_heads, c.num_key_value_heads)
            x = x + m.linear(self.attention(layer, qkv, positions, metadata), p + "o_proj")
            gate_up = m.linear(rmsnorm_ref(x, m.norms[p + "post_attention_layernorm"], eps), p + "gate_up_proj")
            x = x + m.linear(silu_mul_ref(gate_up), p + "down_proj")
        if logits_indices is not None:
            x = x[np.asarray(logits_indices, np.int64)]  # only the rows whose next token we need
        return m.linear(rmsnorm_ref(x, m.norms["norm"], eps), "lm_head")  # (rows, vocab_size)

    def attention(self, layer: int, qkv: np.ndarray, positions: np.ndarray, metadata: AttentionMetadata) -> np.ndarray:
        """Store the batch's new K/V at their slots, then attend each sequence's queries over its context slots."""
        c = self.config
        q, k, v = split_qkv(qkv, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.cache.write(layer, metadata.slot_mapping, k, v)
        out = np.empty((qkv.shape[0], c.num_attention_heads * c.head_dim), np.float32)  # (T, H D)
        start = 0
        for num_new, slots in zip(metadata.query_lens, metadata.context_slots):
            k_ctx, v_ctx = self.cache.read(layer, slots)  # (L, KVH, D) each
            rows = slice(start, start + num_new)
            out[rows] = cached_attention_ref(q[rows], k_ctx, v_ctx, positions[rows])
            start += num_new
        return out


# %% [markdown]
# ### Test: the cache changes nothing
#
# Prefill SmolLM2 on a chat prompt, then decode a few greedy tokens one at a time through the
# cache, and compare each step's logits with a full forward pass over the whole sequence
# (chapter 7's `LlamaNumpy.forward`, no cache). They must agree to float32 rounding.

# %%
from tinyvllm_lib.engine.kv_cache import KVCache
from tinyvllm_lib.engine.runner_numpy import NumpyRunner

model = LlamaNumpy.from_folder(folder)
question = [{"role": "user", "content": "What is the capital of France?"}]
prompt_ids = tokenizer.apply_chat_template(question, tokenize=True)
slots = ContiguousSlots(max_num_seqs=1, max_model_len=256)
runner = NumpyRunner(model, KVCache(smollm2, slots.num_slots, "float32"))
row = slots.allocate()

n = len(prompt_ids)
logits = runner.execute(prompt_ids, np.arange(n), slots.metadata([row], [np.arange(n)]), logits_indices=[n - 1])
ids, worst = list(prompt_ids), 0.0
for _ in range(6):
    ids.append(int(np.argmax(logits[-1])))
    logits = runner.execute(ids[-1:], [len(ids) - 1], slots.metadata([row], [np.array([len(ids) - 1])]))
    full = model.forward(ids)[-1]  # no cache: the whole sequence again
    worst = max(worst, float(np.abs(logits[-1] - full).max()))
slots.free(row)
print(f"{n} prompt tokens -> {tokenizer.decode(ids[n:])!r}; max |cached - full| logits = {worst:.1e}")
assert worst < 1e-4

# %% [markdown]
# ### A bf16 cache?
#
# On the GPU the cache is bf16, half the bytes of float32. Here the reference runner stores
# float32, and the reason is measurable: rounding every key and value to bf16 (3 significant
# digits) moves SmolLM2's log-probabilities by a few hundredths, far more than the $10^{-3}$ by
# which we check the engine against `transformers` in float32. The layout is the same; only the
# stored type differs.

# %%
def prompt_log_probs(model: LlamaNumpy, kv_dtype: str, token_ids: list[int]) -> np.ndarray:
    """Log-probs at every prompt position, with the keys and values kept in a cache of `kv_dtype`."""
    cache_slots = ContiguousSlots(1, 256)
    r = NumpyRunner(model, KVCache(model.config, cache_slots.num_slots, kv_dtype))
    positions = np.arange(len(token_ids))
    return log_softmax(r.execute(token_ids, positions, cache_slots.metadata([0], [positions])))


bf16_shift = float(np.abs(prompt_log_probs(model, "bfloat16", prompt_ids) - prompt_log_probs(model, "float32", prompt_ids)).max())
print(f"max |log p (bf16 cache) - log p (float32 cache)| over {n} positions: {bf16_shift:.3f}")
glue("ch08_bf16_shift", f"{bf16_shift:.2f}")

# %% [markdown]
# The largest difference is {glue:text}`ch08_bf16_shift` — harmless for generating text, but it
# would hide any real bug below it. The GPU chapters compare their bf16 cache with this float32
# reference at a tolerance that allows for it.
#
# ## Sampling: choosing the next token
#
# The logits $z$ of the last position define a distribution over the vocabulary,
# $p_i = e^{z_i} / \sum_j e^{z_j}$. vLLM reshapes it in a fixed order, and so do we:
#
# 1. **Temperature** $T$: $p_i \propto e^{z_i / T}$. $T < 1$ sharpens, $T > 1$ flattens; $T = 0$
#    means **greedy**, the argmax.
# 2. **Top-k**: keep the $k$ largest logits (and any tied with the $k$-th), drop the rest.
# 3. **Top-p** (nucleus): sort what is left by probability; keep the smallest prefix whose
#    probability reaches $p$ — token $i$ (in descending order) stays if the mass before it is
#    below $p$: $\sum_{j < i} p_{(j)} < p$.
# 4. **Sample** from the renormalised rest.
#
# The parameters live in `SamplingParams`, with vLLM's names and defaults, checked when it is
# made:

# %%
#| export engine.sampling_params
#| public SamplingParams
import math
from dataclasses import dataclass

SAMPLING_EPS = 1e-5  # a temperature below this means greedy (vLLM's _SAMPLING_EPS)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to choose each next token and when to stop; vLLM's field names, defaults and meanings."""

    n: int = 1  # completions per prompt (only 1 here)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # -1 or 0 = off
    seed: int | None = None  # None: the LLM's generator
    stop: str | list[str] | None = None  # stop strings: the text ends before them
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as max_model_len allows
    logprobs: int | None = None  # per step, the sampled token's log-prob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1: this engine returns one completion per prompt, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0 (how many top alternatives), got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


# %%
from tinyvllm_lib.engine.sampling_params import SamplingParams

for bad in ({"temperature": -0.5}, {"top_p": 0.0}, {"top_k": -3}, {"max_tokens": 0}, {"n": 2}, {"stop": [""]}):
    try:
        SamplingParams(**bad)
    except ValueError as err:
        print(f"{bad}: {err}")
    else:
        raise AssertionError(f"{bad} was accepted")

# %% [markdown]
# The sampler works on a **batch**: logits `(batch, vocab)` and, per row, the settings as
# arrays — `SamplingMetadata`. That is the interface a GPU sampling kernel will implement too:
# the same metadata in, token ids out. Randomness stays on the host: each row brings one
# uniform number $u \in [0, 1)$ drawn from its request's own `numpy.random.Generator` — seeded
# from the request's `seed`, or the engine's generator otherwise — so the same seed gives the
# same tokens on any device. The draw is by **inverse CDF**: the sampled token is the first
# whose cumulative probability exceeds $u$.
#
# First the three transformations, each a function of a batch, each formula above its code:
#
# $$ z_i \leftarrow z_i / T \qquad\qquad z_i \leftarrow -\infty \text{ if } z_i < z_{(k)} \qquad\qquad
# z_{(i)} \leftarrow -\infty \text{ if } \textstyle\sum_{j<i} p_{(j)} \ge p $$

# %%
#| export engine.sampler
from dataclasses import dataclass

import numpy as np

from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.llama_numpy import log_softmax


def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """z / T per row (rows with T = 0 are greedy and left alone)."""
    return logits / np.where(temperature > 0, temperature, 1).astype(np.float32)[:, None]


def apply_top_k(logits: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Keep each row's k largest logits (and ties with the k-th), -inf elsewhere; k = 0 keeps all."""
    out = logits.copy()
    vocab = logits.shape[1]
    for row in np.flatnonzero((top_k > 0) & (top_k < vocab)):
        kth = np.partition(logits[row], vocab - top_k[row])[vocab - top_k[row]]  # the k-th largest
        out[row, logits[row] < kth] = -np.inf
    return out


def apply_top_p(logits: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Keep the most likely tokens until their probability reaches p (always the first), -inf elsewhere."""
    out = logits.copy()
    for row in np.flatnonzero(top_p < 1):
        order = np.argsort(-logits[row], kind="stable")  # most likely first
        probs = np.exp(logits[row, order] - logits[row, order[0]], dtype=np.float64)
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        out[row, order[mass_before >= top_p[row]]] = -np.inf
    return out


def sample_inverse_cdf(logits: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row, the first token whose cumulative probability exceeds u (tokens at -inf are never chosen)."""
    probs = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)  # unnormalised
    cdf = np.cumsum(probs, axis=1)
    ids = (cdf <= (uniform * cdf[:, -1])[:, None]).sum(axis=1)  # how many cumulative sums u has passed
    last_possible = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)  # guards u * total rounding up
    return np.minimum(ids, last_possible)


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of each row, most likely first: (ids (rows, k), log-probs (rows, k))."""
    k = min(k, logprobs.shape[1])
    ids = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(logprobs, ids, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)


# %% [markdown]
# Then the sampler: the metadata (one row per sequence), the output, and the NumPy
# implementation. Log-probabilities, when asked for, are those of the model's raw logits —
# before temperature, top-k and top-p — as vLLM returns them by default.

# %%
#| export engine.sampler
@dataclass
class SamplingMetadata:
    """A batch's sampling settings, one row per sequence, as arrays: what a sampler (NumPy or GPU kernel) reads."""

    temperature: np.ndarray  # (batch,) float32; 0 = greedy
    top_k: np.ndarray  # (batch,) int64; 0 = off
    top_p: np.ndarray  # (batch,) float32; 1 = off
    uniform: np.ndarray  # (batch,) float64 in [0, 1): the row's draw, from its request's generator
    num_logprobs: np.ndarray  # (batch,) int64; -1 = none, k >= 0 = the sampled token's and the top k

    @classmethod
    def from_params(cls, params: list[SamplingParams], generators: list[np.random.Generator]) -> "SamplingMetadata":
        """One row per request; each sampled row draws its uniform from its own generator (greedy rows draw none)."""
        return cls(
            temperature=np.array([0.0 if p.is_greedy else p.temperature for p in params], np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], np.int64),
            top_p=np.array([p.top_p for p in params], np.float32),
            uniform=np.array([0.0 if p.is_greedy else g.random() for p, g in zip(params, generators)], np.float64),
            num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], np.int64),
        )


@dataclass
class SamplerOutput:
    """The chosen tokens, and the log-probabilities the requests asked for."""

    token_ids: np.ndarray  # (batch,) int64
    logprobs: np.ndarray | None = None  # (batch,) float32: log p of each chosen token under the raw logits
    top_ids: np.ndarray | None = None  # (batch, k): the most likely tokens, most likely first
    top_logprobs: np.ndarray | None = None  # (batch, k)


class Sampler:
    """The CPU sampler: logits (batch, vocab) and per-row settings -> token ids; temperature, top-k, top-p, draw."""

    def __call__(self, logits: np.ndarray, metadata: SamplingMetadata) -> SamplerOutput:
        logits = np.asarray(logits, np.float32)
        if logits.ndim != 2 or logits.shape[0] != len(metadata.temperature):
            raise ValueError(f"logits must be (batch, vocab) with one row per sequence, got {logits.shape}")
        token_ids = np.argmax(logits, axis=1)  # greedy rows keep this
        rows = np.flatnonzero(metadata.temperature > 0)
        if rows.size:
            z = apply_temperature(logits[rows], metadata.temperature[rows])
            z = apply_top_k(z, metadata.top_k[rows])
            z = apply_top_p(z, metadata.top_p[rows])
            token_ids[rows] = sample_inverse_cdf(z, metadata.uniform[rows])
        out = SamplerOutput(token_ids)
        k = int(metadata.num_logprobs.max(initial=-1))
        if k >= 0:
            logprobs = log_softmax(logits)  # raw: before temperature, top-k and top-p
            out.logprobs = logprobs[np.arange(len(token_ids)), token_ids]
            if k > 0:
                out.top_ids, out.top_logprobs = top_logprobs(logprobs, k)
        return out


# %% [markdown]
# ### Test: the sampler draws from the right distribution
#
# A sampler can return plausible tokens and still be wrong — the wrong top-p boundary, a
# temperature applied twice. So we test it as a distribution. Fix six logits, work out by hand
# the probabilities that each setting should produce, draw many tokens, and compare the counts
# with Pearson's chi-square statistic
#
# $$ \chi^2 = \sum_i \frac{(O_i - E_i)^2}{E_i}, $$
#
# which, if the sampler is right, follows a $\chi^2$ distribution with (categories − 1) degrees
# of freedom; it exceeds its 0.1% critical value once in a thousand runs. Tokens that must never
# appear are checked to have a count of exactly zero. (`tests/test_sampling.py` does this for
# more settings.)

# %%
from tinyvllm_lib.engine.sampler import Sampler, SamplingMetadata

CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}  # P(chi2 > x) = 0.001
small_logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], np.float32)
base = np.exp(small_logits.astype(np.float64)) / np.exp(small_logits.astype(np.float64)).sum()
settings = {  # name: (params, expected probabilities worked out by hand)
    "T = 1": (SamplingParams(), base),
    "T = 0.5": (SamplingParams(temperature=0.5), base**2 / (base**2).sum()),
    "top-k = 3": (SamplingParams(top_k=3), np.r_[base[:3], 0, 0, 0] / base[:3].sum()),
    "top-p = 0.7": (SamplingParams(top_p=0.7), np.r_[base[:3], 0, 0, 0] / base[:3].sum()),  # mass before token 2: 0.61 < 0.7
}
num_samples = 20_000
sampler, counts = Sampler(), {}
for name, (params, expected) in settings.items():
    gen = np.random.default_rng(rng.integers(2**32))
    batch = np.tile(small_logits, (num_samples, 1))
    got = sampler(batch, SamplingMetadata.from_params([params] * num_samples, [gen] * num_samples)).token_ids
    counts[name] = np.bincount(got, minlength=6)
    is_possible = expected > 0
    assert counts[name][~is_possible].sum() == 0, f"{name}: drew a token it must not"
    want = expected[is_possible] * num_samples
    chi2 = float(((counts[name][is_possible] - want) ** 2 / want).sum())
    print(f"{name:>12}: chi2 = {chi2:5.1f} with {is_possible.sum() - 1} degrees of freedom "
          f"(critical value at p = 0.001: {CHI2_CRITICAL_0_001[int(is_possible.sum()) - 1]})")
    assert chi2 < CHI2_CRITICAL_0_001[int(is_possible.sum()) - 1]

fig, axes = new_figure(1, len(settings), width=10, height=2.2, sharey=True)
for ax, (name, (_, expected)) in zip(axes, settings.items()):
    ax.bar(range(6), counts[name] / num_samples, color="#1f77b4", label="drawn")
    ax.plot(range(6), expected, "k_", markersize=14, label="expected")
    ax.set_title(name, fontsize=9)
    ax.set_xticks(range(6))
axes[0].set_ylabel("frequency")
axes[0].legend(fontsize=7)
plt.show()

# %% [markdown]
# ## Stopping, and streaming text
#
# A sequence ends when the model emits an **end-of-sequence** token — Llama 3.2 has three:
# `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`, collected by `ModelConfig` from `config.json`
# and `generation_config.json` — unless `ignore_eos`; when it emits one of the request's
# `stop_token_ids`; when its text contains one of the `stop` strings (the text then ends just
# before it); and at `max_tokens` new tokens. The first three finish with reason `"stop"`, the
# last with `"length"`.
#
# Stop strings and streaming need the text *while* tokens arrive. Decoding each new token alone
# fails: byte-level BPE splits a character of several UTF-8 bytes — an emoji, a CJK character —
# over several tokens, and a token holding half a character decodes to the replacement
# character U+FFFD (�):

# %%
text = "I love 🦙 and 東京!"
pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
print(pieces)
assert "".join(pieces) != text

# %% [markdown]
# vLLM's incremental detokenizer keeps two offsets into the token list. It decodes a short window
# — the tokens from `prefix_offset` on — and compares it with the text of the window's old part
# (`prefix_offset` to `read_offset`). What the new text adds is emitted only if it does not end
# in U+FFFD; then both offsets move forward. A window also gives tokenizers whose pieces depend
# on their neighbours (SentencePiece's leading spaces) the context they need; it starts with the
# last few prompt tokens.

# %%
#| export engine.detokenizer
INITIAL_CONTEXT = 5  # prompt tokens kept as context for the first new tokens (vLLM's initial offset)


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only once it is stable (vLLM's prefix and read offsets)."""

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids = [int(i) for i in prompt_token_ids[-INITIAL_CONTEXT:]]
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ('' while a character is incomplete)."""
        self.token_ids.append(int(token_id))
        return self._advance(is_final=False)

    def flush(self) -> str:
        """The text not emitted yet, complete or not (at the end of generation)."""
        return self._advance(is_final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, is_final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not is_final):
            return ""  # nothing new, or it ends in the middle of a character: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """(stop string, its index) for the earliest stop string that ends within the last num_new_chars characters."""
    found = None
    for s in stop:
        i = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if i != -1 and (found is None or i < found[1]):
            found = (s, i)
    return found


# %%
from tinyvllm_lib.engine.detokenizer import IncrementalDetokenizer

prompt_for_demo = tokenizer.encode("Say it: ")
detok = IncrementalDetokenizer(tokenizer, prompt_for_demo)
streamed = [detok.add(i) for i in tokenizer.encode(text)] + [detok.flush()]
print(streamed)
assert "".join(streamed) == text and "\ufffd" not in "".join(streamed)

# %% [markdown]
# Empty pieces are the steps where a character was still incomplete. Stop strings bring one more
# subtlety to streaming: the text that has arrived may be the *beginning* of a stop string
# ("Par" of "Paris"), so a streaming engine holds back the last `len(longest stop string) − 1`
# characters until it knows. The request object below does that, and it gathers the rest of a
# request's state: its generator, tokens, text, log-probabilities and finish reason. Its output
# has the shape of vLLM's.

# %%
#| export engine.outputs
from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the chosen tokens' log-probs, when logprobs were asked for
    logprobs: list[dict[int, float]] | None  # per step {token id: log-prob}: the chosen token, then the top k
    finish_reason: str | None = None  # "stop" (eos, stop string or stop token) or "length"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and what was generated from it (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None  # None for the first token, then one dict per token
    outputs: list[CompletionOutput]
    finished: bool


# %%
#| export engine.request
import numpy as np

from tinyvllm_lib.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from tinyvllm_lib.engine.outputs import CompletionOutput, RequestOutput
from tinyvllm_lib.engine.sampler import top_logprobs
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.llama_numpy import log_softmax


class Request:
    """One prompt being generated: its settings and generator, its tokens and text, and when it stops."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_ids, tokenizer=None, generator: np.random.Generator | None = None):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = [int(i) for i in prompt_token_ids]
        self.max_tokens = max_tokens
        self.generator = generator if generator is not None else np.random.default_rng(params.seed)
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(tokenizer, self.prompt_token_ids, params.skip_special_tokens)
        self.output_token_ids: list[int] = []
        self.text, self.num_streamed = "", 0
        self.logprobs = None if params.logprobs is None else []
        self.cumulative_logprob = None if params.logprobs is None else 0.0
        self.prompt_logprobs = None
        self.finish_reason, self.stop_reason = None, None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int, logprob=None, top_ids=None, top_values=None) -> None:
        """Add a chosen token: its log-probs, its text; finish on eos, a stop token or string, or max_tokens."""
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None:
            step = {token_id: float(logprob)}  # the chosen token first, then the top k
            if self.params.logprobs > 0:
                k = self.params.logprobs
                step.update((int(i), float(v)) for i, v in zip(top_ids[:k], top_values[:k]) if int(i) not in step)
            self.logprobs.append(step)
            self.cumulative_logprob += float(logprob)
        if token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token_id in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        if self.detokenizer is not None and (not self.is_finished or self.params.include_stop_str_in_output):
            new_text = self.detokenizer.add(token_id)
            self.text += new_text
            found = find_stop_string(self.text, len(new_text), self.params.stop) if not self.is_finished else None
            if found is not None:
                stop, index = found
                self.text = self.text[: index + len(stop) if self.params.include_stop_str_in_output else index]
                self.finish_reason, self.stop_reason = "stop", stop
                return
        if not self.is_finished and len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        if self.is_finished and self.detokenizer is not None:
            self.text += self.detokenizer.flush()  # a character left incomplete at the end: its U+FFFD

    def stream_delta(self) -> str:
        """New text that can no longer change (the possible start of a stop string is held back)."""
        hold = 0
        if not self.is_finished and self.params.stop and not self.params.include_stop_str_in_output:
            hold = max(map(len, self.params.stop)) - 1
        end = max(self.num_streamed, len(self.text) - hold)
        delta, self.num_streamed = self.text[self.num_streamed : end], end
        return delta

    def set_prompt_logprobs(self, logits: np.ndarray) -> None:
        """From the logits of every prompt position: each prompt token's log-prob (and the top k) given the ones before."""
        ids, k = self.prompt_token_ids, self.params.prompt_logprobs
        logprobs = log_softmax(np.asarray(logits[:-1], np.float32))  # row t predicts token t + 1
        top = top_logprobs(logprobs, k) if k > 0 else None
        self.prompt_logprobs = [None]
        for t, token in enumerate(ids[1:]):
            step = {token: float(logprobs[t, token])}
            if top is not None:
                step.update((int(i), float(v)) for i, v in zip(*(a[t] for a in top)) if int(i) not in step)
            self.prompt_logprobs.append(step)

    def output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.text, list(self.output_token_ids), self.cumulative_logprob,
                                      self.logprobs, self.finish_reason, self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), self.prompt_logprobs,
                             [completion], self.is_finished)


# %% [markdown]
# ## The public API
#
# `LLM` puts the pieces together. It resolves the model (a known name such as `"smollm2"`, or a
# folder), reads its config and — if the folder has one — its tokenizer, and asks `runner_for`
# for a runner: the NumPy runner for `device="cpu"`; a CUDA runner for `device="cuda"` once
# chapter 11 registers one with `register_runner("cuda", ...)`; `"auto"` takes CUDA when a GPU
# and a CUDA runner are both there. A runner has one method that matters, `execute`, and a
# `sampler`; the engine does not care which device they run on.

# %%
#| export
import importlib
import os
from typing import Callable

from tinyvllm_lib.runtime import has_gpu, is_simulator

DEVICES = ("auto", "cpu", "cuda")
RUNNERS: dict[str, Callable] = {}  # device -> factory(folder, num_slots, kv_cache_dtype) -> runner
RUNNER_MODULES = {"cuda": "tinyvllm_lib.engine.runner_cuda"}  # imported on demand; it registers its runner


def register_runner(device: str, factory: Callable) -> None:
    """Make `factory(folder, num_slots, kv_cache_dtype, max_num_seqs=..., max_model_len=...)` the runner of `device`."""
    RUNNERS[device] = factory


def cuda_in_simulator() -> bool:
    """The simulator runs device='cuda' only when asked (TINYVLLM_SIM_CUDA=1): it is slow, for tiny models."""
    return is_simulator() and os.environ.get("TINYVLLM_SIM_CUDA") == "1"


def _numpy_runner(folder, num_slots: int, kv_cache_dtype: str, **limits):
    from tinyvllm_lib.engine.runner_numpy import NumpyRunner

    return NumpyRunner.from_folder(folder, num_slots, "float32" if kv_cache_dtype == "auto" else kv_cache_dtype)


register_runner("cpu", _numpy_runner)


def _has_runner(device: str) -> bool:
    if device not in RUNNERS and device in RUNNER_MODULES:
        try:
            importlib.import_module(RUNNER_MODULES[device])
        except ModuleNotFoundError as err:
            if err.name != RUNNER_MODULES[device]:
                raise
    return device in RUNNERS


def runner_for(device: str, folder, num_slots: int, kv_cache_dtype: str = "auto", **limits):
    """The runner for `device`: "cpu" (NumPy), "cuda" (when a CUDA runner exists), "auto" (cuda if possible)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not _has_runner("cuda"):
        raise NotImplementedError("device='cuda': there is no CUDA runner yet (chapter 11 adds it); use device='cpu'")
    if device == "cuda" and not (has_gpu() or cuda_in_simulator()):
        raise RuntimeError("device='cuda' but no CUDA GPU is available; use device='cpu'")
    if device == "auto":
        device = "cuda" if has_gpu() and _has_runner("cuda") else "cpu"
    return RUNNERS[device](folder, num_slots, kv_cache_dtype, **limits)


# %% [markdown]
# `generate` checks every prompt before it runs any — empty, too long for `max_model_len`
# together with `max_tokens`, token ids outside the vocabulary, text without a tokenizer — so a
# bad prompt costs nothing and leaves the engine as it was. Then it runs the prompts one after
# another (chapter 9 batches them): allocate a cache row, prefill, and decode until the request
# finishes, sampling each token with the request's settings and generator. `stream`, if given,
# is called with `(prompt index, new text)` whenever stable text appears.

# %%
#| export
#| public LLM
import itertools
from functools import partial

import numpy as np
from tqdm import tqdm

from tinyvllm_lib.engine.kv_cache import ContiguousSlots
from tinyvllm_lib.engine.outputs import RequestOutput
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampler import SamplingMetadata
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 4096  # when not given: the model's limit, at most this


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


class LLM:
    """An inference engine shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str = "smollm2", device: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 8, seed: int = 0, kv_cache_dtype: str = "auto"):
        self.folder = resolve_model(model)
        self.config = ModelConfig.from_folder(self.folder)
        self.tokenizer = Tokenizer.from_folder(self.folder, missing_ok=True)  # None: prompts are token ids
        limit = self.config.max_position_embeddings
        max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN) if max_model_len is None else max_model_len
        if not isinstance(max_model_len, int) or not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [2, {limit}] (the model's max_position_embeddings), got {max_model_len!r}")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        self.max_model_len = max_model_len
        self.slots = ContiguousSlots(max_num_seqs, max_model_len)
        self.runner = runner_for(device, self.folder, self.slots.num_slots, kv_cache_dtype,
                                 max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self.device = self.runner.device
        self.rng = np.random.default_rng(seed)  # for requests without a seed of their own
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, stream: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt_token_ids": ...}); one RequestOutput per prompt."""
        requests = self._make_requests(self._normalize_prompts(prompts), sampling_params)
        for index, request in enumerate(tqdm(requests, desc="Processed prompts", disable=not use_tqdm)):
            self._run(request, None if stream is None else partial(stream, index))
        return [r.output() for r in requests]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, stream=None) -> list[RequestOutput]:
        """Answer a conversation (a list of {"role", "content"} dicts), or each of a list of them, in the model's chat template."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ValueError(f"{self.folder}: no chat template (it needs tokenizer.json and a template); use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, stream)

    def _normalize_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt."""
        is_one = isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0
                                                       and all(isinstance(t, (int, np.integer)) for t in prompts))
        out = []
        for i, prompt in enumerate([prompts] if is_one else list(prompts)):
            text, ids = (prompt.get("prompt"), prompt.get("prompt_token_ids")) if isinstance(prompt, dict) else (prompt, None)
            if isinstance(text, str) and ids is None:
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is text, but {self.folder} has no tokenizer.json: give token ids")
                ids = self.tokenizer.encode(text) if text else []
            elif not isinstance(text, str):
                ids, text = text if ids is None else ids, None
            if not isinstance(ids, (list, tuple, np.ndarray)) or not all(isinstance(t, (int, np.integer)) for t in ids):
                raise ValueError(f"prompt {i} must be text, a list of token ids or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty: it needs at least one token")
            if bad := [t for t in ids if not 0 <= t < self.config.vocab_size]:
                raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
            out.append((text, [int(t) for t in ids]))
        return out

    def _make_requests(self, prompts, sampling_params) -> list[Request]:
        params = SamplingParams() if sampling_params is None else sampling_params
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        requests = []
        for i, ((text, ids), p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            if p.stop and self.tokenizer is None:
                raise ValueError(f"prompt {i}: stop strings need a tokenizer, and {self.folder} has none")
            room = self.max_model_len - len(ids)
            if room < 1:
                raise ValueError(f"prompt {i} has {_tokens(len(ids))}; max_model_len is {self.max_model_len}, "
                                 "which leaves no room for a new token")
            if p.max_tokens is not None and p.max_tokens > room:
                raise ValueError(f"prompt {i} has {_tokens(len(ids))} and max_tokens is {p.max_tokens}: {len(ids) + p.max_tokens} "
                                 f"is more than max_model_len ({self.max_model_len}); lower max_tokens or raise max_model_len")
            generator = np.random.default_rng(p.seed) if p.seed is not None else self.rng
            requests.append(Request(str(next(self._request_ids)), text, ids, p, p.max_tokens or room,
                                    self.config.eos_token_ids, self.tokenizer, generator))
        return requests

    def _run(self, request: Request, on_text: Callable[[str], None] | None = None) -> None:
        """Prefill the prompt, then decode one token per step until the request finishes."""
        row = self.slots.allocate()
        try:
            num_prompt = len(request.prompt_token_ids)
            positions = np.arange(num_prompt)
            wants_prompt_logprobs = request.params.prompt_logprobs is not None
            logits = self.runner.execute(request.prompt_token_ids, positions, self.slots.metadata([row], [positions]),
                                         logits_indices=None if wants_prompt_logprobs else [num_prompt - 1])
            if wants_prompt_logprobs:  # a GPU runner's logits stay on the GPU: copy them here
                request.set_prompt_logprobs(logits.copy_to_host() if hasattr(logits, "copy_to_host") else logits)
                logits = logits[logits.shape[0] - 1 :]
            while True:
                out = self.runner.sampler(logits, SamplingMetadata.from_params([request.params], [request.generator]))
                token = int(out.token_ids[0])
                request.append_token(token, *(None if a is None else a[0] for a in (out.logprobs, out.top_ids, out.top_logprobs)))
                if on_text is not None and (delta := request.stream_delta()):
                    on_text(delta)
                if request.is_finished:
                    return
                position = np.array([request.num_tokens - 1])
                logits = self.runner.execute([token], position, self.slots.metadata([row], [position]))
        finally:
            self.slots.free(row)


# %% [markdown]
# The model from before has served its purpose; the engine loads its own. The question of
# chapter 7, through the API:

# %%
from tinyvllm_lib import LLM, SamplingParams

del model, runner
llm = LLM("smollm2", device="cpu")
t0 = time.perf_counter()
out = llm.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
seconds = time.perf_counter() - t0
completion = out.outputs[0]
print(f"{len(out.prompt_token_ids)} prompt tokens -> {completion.text!r}")
print(f"{len(completion.token_ids)} tokens in {seconds:.1f} s, finish_reason={completion.finish_reason!r}")
assert "Paris" in completion.text

# %% [markdown]
# Sampling with a seed is reproducible, and log-probabilities come as vLLM gives them: per step,
# a dict from token id to log-probability — the chosen token, then the `logprobs` most likely.
# (A model of 135 M weights at temperature 0.7 wanders; that is what sampling is for.)

# %%
params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=7, logprobs=2)
first, again = (llm.chat(question, params, use_tqdm=False)[0].outputs[0] for _ in range(2))
print(repr(first.text))
assert first.token_ids == again.token_ids
for step, token in zip(first.logprobs[:3], first.token_ids):
    print(f"chose {tokenizer.decode([token])!r:>10}:", {tokenizer.decode([i]): round(v, 2) for i, v in step.items()})
print(f"cumulative log-prob {first.cumulative_logprob:.2f}")

# %% [markdown]
# Stop strings cut the text, streaming hands it over piece by piece, and bad input is refused
# with a message that says what to change — after which the engine works as before:

# %%
stopped = llm.chat(question, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]), use_tqdm=False)[0].outputs[0]
print(f"stop='Paris': {stopped.text!r}, finish_reason={stopped.finish_reason!r}, stop_reason={stopped.stop_reason!r}")
assert stopped.finish_reason == "stop" and "Paris" not in stopped.text

pieces = []
streamed = llm.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False, stream=lambda i, text: pieces.append(text))
print("streamed pieces:", pieces)
assert "".join(pieces) == streamed[0].outputs[0].text == completion.text

for bad_prompt, bad_params in (("", None), ([1] * 5000, None), ("Hello", SamplingParams(max_tokens=5000))):
    try:
        llm.generate(bad_prompt, bad_params, use_tqdm=False)
    except ValueError as err:
        print(f"ValueError: {err}")
    else:
        raise AssertionError("bad input was accepted")
assert llm.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text == completion.text

# %% [markdown]
# ## Checking the engine against transformers
#
# The engine adds a cache, a sampler and a loop to chapter 7's forward pass, so we check it end
# to end: run it on a folder, then give `transformers` (float32, CPU) the prompt followed by the
# engine's greedy tokens, in one forward pass. Two things must hold:
#
# - **teacher-forced log-probabilities**: at every position, the log-probability of the next
#   token — prompt tokens from the prefill, generated tokens from the cached decode steps — agree
#   to $10^{-3}$;
# - **greedy tokens**: at each step, the engine's token is `transformers`' argmax given the same
#   prefix. Float32 sums in a different order can flip a near tie, and after a flip the two
#   continue from different texts. So at the first disagreement we look at `transformers'`
#   margin between its choice and ours: below $10^{-3}$ it is a tie, and the comparison stops
#   there and passes; above, it fails.
#
# `python -m tinyvllm_lib verify FOLDER` runs this on any folder — your own Llama 3.2 1B, say.

# %%
#| export engine.verify
from dataclasses import dataclass

import numpy as np

from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.models.llama_numpy import log_softmax

TIE_MARGIN = 1e-3


def transformers_log_probs(folder, token_ids) -> np.ndarray:
    """transformers' log-softmax at every position of `token_ids` (float32, CPU): (len, vocab)."""
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        raise ImportError("verify needs transformers and torch: pip install -e '.[test]' (or transformers and a CPU torch)") from None
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0]
    return log_softmax(logits.float().numpy())


def greedy_agreement(tokens, ref_log_probs: np.ndarray, tie_margin: float = TIE_MARGIN) -> tuple[int, bool]:
    """(steps that agree, passed): ref_log_probs[t] is the reference's distribution for step t after our tokens before it.

    At the first step where our token is not the reference's argmax, stop: passed if the reference
    ranks ours within tie_margin of its best (a near tie), failed otherwise.
    """
    for step, token in enumerate(tokens):
        best = int(np.argmax(ref_log_probs[step]))
        if best != token:
            return step, bool(ref_log_probs[step, best] - ref_log_probs[step, token] < tie_margin)
    return len(tokens), True


@dataclass
class VerifyResult:
    num_prompt_tokens: int
    num_steps: int
    max_prompt_diff: float  # max |log p - log p_hf| over the prompt's teacher-forced positions
    max_decode_diff: float  # the same for the generated tokens (the cached decode path)
    greedy_steps: int  # steps whose tokens agree before the first tie (or mismatch)
    greedy_ok: bool
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.greedy_ok and max(self.max_prompt_diff, self.max_decode_diff) <= self.tolerance

    def report(self) -> str:
        tie = "" if self.greedy_steps == self.num_steps else (" (then a near tie)" if self.greedy_ok else " (then a real mismatch)")
        return (f"prompt: {self.num_prompt_tokens} tokens, max |log p - log p_hf| = {self.max_prompt_diff:.2e}\n"
                f"decode: {self.num_steps} greedy steps, max |log p - log p_hf| = {self.max_decode_diff:.2e}; "
                f"tokens agree for {self.greedy_steps}/{self.num_steps}{tie}\n"
                f"{'PASS' if self.passed else 'FAIL'} (tolerance {self.tolerance:g})")


def verify_against_transformers(llm, prompt_token_ids, num_steps: int = 32, tolerance: float = 1e-3) -> VerifyResult:
    """Greedy-generate num_steps tokens with the engine, then check log-probs and tokens with transformers."""
    params = SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate([list(prompt_token_ids)], params, use_tqdm=False)[0]
    prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    ref = transformers_log_probs(llm.folder, prompt + tokens)  # row t: the distribution of token t + 1
    ours_prompt = np.array([next(iter(step.values())) for step in out.prompt_logprobs[1:]])
    ref_prompt = ref[np.arange(len(prompt) - 1), prompt[1:]]
    ours_decode = np.array([step[t] for step, t in zip(out.outputs[0].logprobs, tokens)])
    decode_rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    steps, greedy_ok = greedy_agreement(tokens, decode_rows)
    ref_decode = decode_rows[np.arange(len(tokens)), tokens]
    return VerifyResult(len(prompt), len(tokens), float(np.abs(ours_prompt - ref_prompt).max(initial=0)),
                        float(np.abs(ours_decode - ref_decode).max(initial=0)), steps, greedy_ok, tolerance)


def default_prompt(llm) -> list[int]:
    """A fixed prompt: the chat template's question if the folder has one, else text, else fixed token ids."""
    tok = llm.tokenizer
    if tok is not None and tok.chat_template is not None:
        return tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    if tok is not None:
        return tok.encode("The capital of France is")
    return np.random.default_rng(0).integers(0, llm.config.vocab_size, 16).tolist()


# %% [markdown]
# On SmolLM2 (the engine we already have) and on a small random-weight Llama with grouped
# heads, `head_dim` 64 and Llama 3 rope scaling (`tests/test_llm_api.py` covers more shapes):

# %%
from tinyvllm_lib.engine.verify import default_prompt, verify_against_transformers

try:
    import transformers  # noqa: F401
except ImportError:
    print("transformers is not installed: skipping the comparison (pip install -e '.[test]')")
else:
    result = verify_against_transformers(llm, default_prompt(llm), num_steps=16)
    print("SmolLM2:\n" + result.report())
    assert result.passed
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_llama_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                vocab_size=512, rope_scaling=scaling)
        tiny = LLM(make_random_llama(tmp, cfg, seed=3), device="cpu", max_model_len=128)
        result = verify_against_transformers(tiny, default_prompt(tiny), num_steps=32)
    print("random Llama (GQA 8/2, head_dim 64, llama3 scaling):\n" + result.report())
    assert result.passed

# %% [markdown]
# ## The command line
#
# Three commands join `prepare` (chapter 2b). `generate` streams its answer through the
# `stream` hook as it is produced; `chat` keeps a conversation going in the terminal; `verify`
# runs the comparison above on a folder. `./dev.sh run` is
# `python -m tinyvllm_lib generate "What is the capital of France?" --chat`.

# %%
#| export cli
import argparse
import sys
import time


def _engine_arguments(parser: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        parser.add_argument("--model", default="smollm2", help="a known model name (smollm2) or a Hugging Face folder")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when it can, else cpu")
    parser.add_argument("--max-model-len", type=int, help="the longest prompt + answer, in tokens")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed (for requests without --sample-seed)")


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="at most this many new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sample-seed", type=int, help="the request's own seed")
    parser.add_argument("--stop", action="append", help="a stop string (repeat for more)")
    parser.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    from tinyvllm_lib.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
                          seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _load_llm(args: argparse.Namespace, model: str):
    from tinyvllm_lib.engine.llm import LLM

    return LLM(model, device=args.device, max_model_len=args.max_model_len, seed=args.seed)


def _print_piece(index: int, text: str) -> None:
    print(text, end="", flush=True)


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template, as a user message")
    parser.add_argument("--system", help="a system message (with --chat)")
    _engine_arguments(parser)
    _sampling_arguments(parser)


@command("generate", "complete a prompt, streaming the text as it is generated", _generate_arguments)
def generate(args: argparse.Namespace) -> int:
    try:
        llm = _load_llm(args, args.model)
        params = _sampling_params(args)
        t0 = time.perf_counter()
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
            out = llm.chat(messages, params, use_tqdm=False, stream=_print_piece)[0]
        else:
            out = llm.generate([args.prompt], params, use_tqdm=False, stream=_print_piece)[0]
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    seconds = time.perf_counter() - t0
    completion = out.outputs[0]
    print(flush=True)
    print(f"[{len(out.prompt_token_ids)} prompt + {len(completion.token_ids)} new tokens in {seconds:.1f} s on "
          f"{llm.device}; finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


# %%
#| export cli
def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="a system message that starts the conversation")
    _engine_arguments(parser)
    _sampling_arguments(parser)


@command("chat", "talk with the model in the terminal (/reset starts over; /exit or Ctrl-D ends)", _chat_arguments)
def chat(args: argparse.Namespace) -> int:
    try:
        llm = _load_llm(args, args.model)
        params = _sampling_params(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print(f"chatting with {llm.folder.name} on {llm.device}; /reset starts over, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            out = llm.chat(messages, params, use_tqdm=False, stream=_print_piece)[0]
        except ValueError as err:
            messages.pop()
            print(f"error: {err} (/reset starts a new conversation)", file=sys.stderr)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": out.outputs[0].text})


# %%
#| export cli
def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a Hugging Face Llama folder (or smollm2)")
    parser.add_argument("--steps", type=int, default=32, help="greedy steps to compare")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |log p - log p_hf|")
    _engine_arguments(parser, model=False)


@command("verify", "compare the engine with transformers on a folder: log-probs and greedy tokens, PASS or FAIL", _verify_arguments)
def verify(args: argparse.Namespace) -> int:
    from tinyvllm_lib.engine.verify import default_prompt, verify_against_transformers

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("error: verify needs transformers and torch: pip install -e '.[test]'") from None
    try:
        llm = _load_llm(args, args.folder)
        prompt = default_prompt(llm)
        print(f"{llm.folder} on {llm.device}: {len(prompt)} prompt tokens, {args.steps} greedy steps, against transformers (float32, CPU)")
        result = verify_against_transformers(llm, prompt, args.steps, args.tolerance)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(result.report())
    return 0 if result.passed else 1


# %%
buffer = io.StringIO()
with redirect_stdout(buffer):
    status = main(["generate", "What is the capital of France?", "--chat", "--device", "cpu", "--max-tokens", "24"])
print(buffer.getvalue())
assert status == 0 and "Paris" in buffer.getvalue()

# %% [markdown]
# ## How fast is it?
#
# A decode step reads every weight once, so it should take about as long as one token of
# prefill would, whatever the context length — while recomputing grows with the sequence. Here
# is a decode step and a full-recompute step at a few lengths, on this machine:

# %%
runner, cache_slots = llm.runner, llm.slots
lengths = [16, 64, 128]
timings = {"recompute (no cache)": [], "decode with the cache": []}
row = cache_slots.allocate()
try:
    for length in lengths:
        ids = rng.integers(100, 10_000, length)
        positions = np.arange(length)
        runner.execute(ids[:-1], positions[:-1], cache_slots.metadata([row], [positions[:-1]]), logits_indices=[length - 2])
        t0 = time.perf_counter()
        runner.execute(ids[-1:], positions[-1:], cache_slots.metadata([row], [positions[-1:]]))
        timings["decode with the cache"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        runner.execute(ids, positions, cache_slots.metadata([row], [positions]), logits_indices=[length - 1])
        timings["recompute (no cache)"].append(time.perf_counter() - t0)
finally:
    cache_slots.free(row)

fig, ax = new_figure(width=5.5, height=2.8)
for label, seconds in timings.items():
    ax.plot(lengths, np.array(seconds) * 1e3, "o-", label=label)
ax.set_xlabel("tokens in the sequence")
ax.set_ylabel("ms for the next token")
ax.set_title("SmolLM2 on this CPU (NumPy)", fontsize=9)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The benchmark script `bench/ch08_decode_cpu.py` measures decode speed properly — batch 1,
# 32 new tokens after a short chat prompt, the median of several runs — for this engine and for
# `transformers` (float32, `model.generate` with its own KV cache) on the same CPU, in one run,
# and records both in `book/data/ch08_kv_cache.json`. The book plots the recorded numbers:

# %%
records = load_records("ch08_kv_cache")
decode = [r for r in records if r["metric"] == "tok/s" and r["name"].endswith("decode")]
print(f"{len(records)} recorded measurements")
for r in records:
    print(f"{r['device']['name']:>30} {r['name']:>24}: {r['value']:7.1f} {r['metric']}  ({r['date']})")
ours = next((r for r in decode if r["name"].startswith("tinyvllm")), None)
theirs = next((r for r in decode if r["name"].startswith("transformers")), None)
glue("ch08_cpu", ours["device"]["name"] if ours else "(not yet measured)")
glue("ch08_ours", f"{ours['value']:.1f} tokens/s" if ours else "(not yet measured)")
glue("ch08_theirs", f"{theirs['value']:.1f} tokens/s" if theirs else "(not yet measured)")
glue("ch08_ratio", f"{ours['value'] / theirs['value']:.2f}×" if ours and theirs else "(not yet measured)")

if decode:
    fig, ax = new_figure(width=6, height=2.2)
    ax.barh([r["name"] for r in decode], [r["value"] for r in decode], color=["#1f77b4", "#ff7f0e"][: len(decode)])
    ax.set_xlabel("decode tokens/s (batch 1, SmolLM2, float32)")
    ax.set_title(f"measured on {decode[0]['device']['name']}", fontsize=9)
    plt.show()

# %% [markdown]
# On the {glue:text}`ch08_cpu`, the NumPy engine decodes {glue:text}`ch08_ours` and
# `transformers` {glue:text}`ch08_theirs`: a ratio of {glue:text}`ch08_ratio`. Both read the same
# float32 weights per step, so both are bound by the CPU's memory bandwidth; what differs is
# the work around the matrix products — a NumPy step is about fifteen array operations per
# layer. On a GPU the same step is bound by 4.8 TB/s instead, and Python's overhead per
# operation becomes the problem; chapter 11 answers it with CUDA graphs.

# %% [markdown]
# ## Decoding on the GPU
#
# Everything so far ran on the CPU. The GPU backend keeps the engine, the metadata and the
# sampler's interface, and replaces the runner. Three pieces are new: a kernel that stores the
# new tokens' keys and values in a **bf16** cache, a **decode attention** kernel — one new query
# per sequence over its whole past — and a sampler that runs on the GPU, so that only token ids
# cross to the host.
#
# **Decode attention is memory-bound.** For one new query per sequence, a layer reads every
# cached key and value once and does $4 D$ FLOPs per key per query head: with grouped-query
# attention ($G = H / H_{kv}$ query heads per KV head) that is $G$ FLOPs per byte of bf16 cache,
# 4 for Llama 3.2 1B — far below the ridge. So the kernel is designed around bytes:
#
# - a block handles **all $G$ query heads** of one KV head, so each K and V row is read once,
#   not $G$ times; the $G$ queries and their accumulators stay in registers;
# - 8 lanes share one key row (head dim 64: 128 bytes): each loads two **8-byte words** (4 bf16
#   values each), and the 8 lanes read 64 contiguous bytes per load — two whole memory sectors;
#   a warp covers 4 keys at a time, and each lane loads **3 rows before it uses any**, so that
#   enough bytes are in flight to cover the memory's latency;
# - the 8 lanes add their partial dot products with three shuffles, and every key slot of the
#   warp keeps its own **online softmax** (chapter 7): its maximum rarely grows after the first
#   few keys, so the rescaling is a rare branch, not work done per key; at the end the warp's
#   slots, then the block's warps, are merged, each rescaled to the common maximum;
# - **the context is split over several blocks** (flash-decoding): the grid is (KV head,
#   sequence, split), about 512 keys a block, and more splits while the grid is small, so even
#   one sequence spreads over the GPU. Each block writes its partial — unnormalised output,
#   maximum and sum — to a float32 **workspace** the caller made once (`decode_workspace`), and a
#   small second kernel combines the splits into the output — float32, or bf16 bits for `o_proj`
#   (chapter 4's `store_activation`). With one split the first kernel writes the output itself.
#   KV heads are the grid's fastest index, so the blocks that run side by side read whole slots.
#
# **It is also an instruction budget.** At 4 FLOPs per byte the FMAs alone are a quarter of
# the SM's issue slots at full bandwidth, and every bf16 value costs one more instruction to
# widen; what is left over for address arithmetic, shuffles and the softmax is small. The first
# versions of this kernel — a row at a time per lane, 64-bit indexing — reached about a third
# of the copy bandwidth, and Nsight Compute showed why: the schedulers were issuing
# nearly every cycle while DRAM sat mostly idle. What brought it up, in order of effect:
#
# - **registers**: with 16 values a lane, the queries and accumulators of 4 heads took 128
#   registers before anything else, the compiler used about 240, and only 8 warps fitted on an
#   SM; 8 values a lane (one more shuffle) leaves room for 3 rows in flight at 127 registers;
# - **32-bit indices**: Numba widens integer arithmetic to 64 bits, and a 64-bit add or multiply
#   is two or more instructions; signed indices also get a check for negative values. The cache
#   is passed as one flat array of 8-byte words and `cache_word` computes a lane's word in
#   truncated `uint32` steps;
# - **exp2 in one instruction**: the query is pre-scaled by $\log_2 e / \sqrt{D}$, so each
#   exponential is `exp2`, and flush-to-zero (a fastmath *set* that keeps the "no infinities"
#   assumption off, since $-\infty$ marks an empty softmax) makes it a single `MUFU.EX2`;
# - **no branches around loads**: keys past the end reload the last valid row and are masked
#   out of the softmax, instead of skipping the load.
#
# The sweep below moves one of these knobs at a time away from the defaults and records each
# setting's speed (`bench/ch08_decode_tune.py`).
#
# Where position $p$ of sequence $s$ lives is the runner's business: the kernel takes a **block
# table** and a block size, slot $= \text{table}[s, \lfloor p / B \rfloor] \cdot B + p \bmod B$.
# $B$ must be a power of two (vLLM's are 8, 16 or 32), so the division and the remainder are a
# shift and a mask. This chapter's contiguous rows are blocks of $B = 16$ slots laid end to end; chapter 10's
# paging hands out blocks anywhere, and the kernel does not change. The simulator has no warp
# shuffles, so there the shuffles go through shared memory (chapter 4's `shfl_xor`).

# %%
#| export kernels.decode_attention
import math

import numpy as np
from numba import config, cuda, float32, uint32

from tinyvllm_lib.kernels.attention import cdiv, check_out, check_qkv
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, bf16_to_f32, f32_to_bf16, f32_to_bf16_bits
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, shfl_xor
from tinyvllm_lib.kernels.rmsnorm import store_activation

# The defaults below were chosen from bench/ch08_decode_tune.py's sweep on an H200 (plotted below).
LANE_ELEMENTS = 8  # bf16 values of a key row per lane (two 8-byte words): head_dim 64 is 8 lanes a key
KEYS_PER_LANE = 3  # rows each lane loads before it uses any (bytes in flight)
MAX_REGISTERS = None  # a cap on registers per thread (more warps per SM), or None
DECODE_WARPS = 1 if config.ENABLE_CUDASIM else 2  # warps per block: they share the block's part of the context
SPLIT_KEYS = 512  # keys per block when a sequence's context is split over several blocks (flash-decoding)
MIN_SPLIT_KEYS = 8  # never fewer keys per split than this (then rounded up to a block's step)
TARGET_BLOCKS = 1024  # split further while the grid has fewer blocks than this (a few per SM)
MAX_SPLITS = 32  # the most splits a workspace holds


def decode_attention_ref(qkv, k_cache, v_cache, block_tables, block_size, context_lens, num_heads, num_kv_heads, head_dim):
    """Float64 reference: row s of qkv (its query) over positions 0..context_lens[s]-1 of the bf16 cache -> (rows, H D)."""
    H, KVH, D = num_heads, num_kv_heads, head_dim
    q = qkv[:, : H * D].astype(np.float64).reshape(len(qkv), KVH, H // KVH, D)
    out = np.zeros((len(qkv), H * D))
    for s, n in enumerate(np.asarray(context_lens)):
        pos = np.arange(n)
        slots = np.asarray(block_tables)[s, pos // block_size].astype(np.int64) * block_size + pos % block_size
        k = bf16_bits_to_f32(k_cache[slots]).astype(np.float64)  # (n, KVH, D)
        v = bf16_bits_to_f32(v_cache[slots]).astype(np.float64)
        scores = np.einsum("hgd,nhd->hgn", q[s], k) / math.sqrt(D)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[s] = (np.einsum("hgn,nhd->hgd", p, v) / p.sum(-1, keepdims=True)).reshape(-1)
    return out


def write_kv_cache_ref(qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache) -> None:
    """Round the new tokens' k and v (after RoPE) to bf16 and store them at their slots (negative slots: skipped)."""
    num_tokens, KVH = qkv.shape[0], num_kv_heads
    D = qkv.shape[1] // (num_heads + 2 * KVH)
    keep = np.asarray(slot_mapping) >= 0
    k = qkv[:, num_heads * D : (num_heads + KVH) * D].reshape(num_tokens, KVH, D)
    v = qkv[:, (num_heads + KVH) * D :].reshape(num_tokens, KVH, D)
    k_cache[np.asarray(slot_mapping)[keep]] = f32_to_bf16_bits(k[keep])
    v_cache[np.asarray(slot_mapping)[keep]] = f32_to_bf16_bits(v[keep])


# %%
#| export kernels.decode_attention
@cuda.jit
def write_kv_cache_kernel(qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache):
    """One thread per (token, element of the KV heads): round k and v to bf16, store at the token's slot."""
    head_dim = k_cache.shape[2]
    width = num_kv_heads * head_dim
    i = cuda.grid(1)
    token, e = i // width, i % width
    if token < qkv.shape[0]:
        slot = slot_mapping[token]
        if slot >= 0:  # -1: a padding row (a batch padded to a captured size)
            h, d = e // head_dim, e % head_dim
            k_cache[slot, h, d] = f32_to_bf16(qkv[token, num_heads * head_dim + e])
            v_cache[slot, h, d] = f32_to_bf16(qkv[token, (num_heads + num_kv_heads) * head_dim + e])


# %%
#| export kernels.decode_attention
from numba import uint64

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x log2 e): scores are kept in base 2, so each exponential is one exp2


@cuda.jit(device=True)
def bf16_lane(word, e):
    """Element e (0..3) of an 8-byte word holding four bf16 values (the lowest address in the lowest bits)."""
    return bf16_to_f32(uint32(word >> uint64(16 * e)))  # bf16_to_f32 keeps the low 16 bits: one shift or mask


@cuda.jit(device=True)
def cache_word(bt_row, key, block_shift, block_mask, num_kv_heads, kvh, words_per_row, sub):
    """Index of lane `sub`'s first 8-byte word of position `key` in the cache viewed as words: 32-bit arithmetic.

    Numba widens integer arithmetic to 64 bits; truncating every step to uint32 lets the compiler use
    32-bit instructions (a 64-bit add or multiply costs two or more), and unsigned indices skip the
    check for negative indices."""
    slot = uint32(uint32(bt_row[key >> block_shift]) << block_shift) | uint32(key & block_mask)
    return uint32(uint32(uint32(slot * num_kv_heads) + kvh) * uint32(words_per_row)) + sub


def lanes_per_key(head_dim: int, lane_elements: int = LANE_ELEMENTS) -> int:
    """Lanes that share one key row: about lane_elements values each, a power of two that splits its words evenly."""
    lanes = 1
    while 2 * lanes * lane_elements <= head_dim and (head_dim // 4) % (2 * lanes) == 0 and 2 * lanes <= WARP_SIZE:
        lanes *= 2
    return lanes


def make_decode_attention_kernel(head_dim: int, group: int, num_warps: int, keys_per_lane: int = KEYS_PER_LANE,
                                 lane_elements: int = LANE_ELEMENTS, max_registers: int | None = MAX_REGISTERS):
    """A block per (KV head, sequence, split of the context), all `group` query heads of it; L lanes per key."""
    D, G, W, L, C = head_dim, group, num_warps, lanes_per_key(head_dim, lane_elements), keys_per_lane
    # flush-to-zero and fast division: exp2 becomes one MUFU.EX2 instruction. The set keeps LLVM's
    # "no infinities" assumption off (fastmath=True would allow it), since -inf marks "no key yet".
    options = {"fastmath": {"contract", "afn"}}
    if max_registers and not config.ENABLE_CUDASIM:
        options["max_registers"] = max_registers
    WPL = D // 4 // L  # 8-byte words per lane per row: 4 for head_dim 64
    EPL = 4 * WPL  # elements per lane per row: 16
    QN, CW, CG = G * EPL, C * WPL, C * G  # query (and accumulator) values per lane; words of its rows; scores
    KPW = WARP_SIZE // L  # keys per warp at a time: 8 for head_dim 64
    LOG_L, LOG_KPW = L.bit_length() - 1, KPW.bit_length() - 1  # shuffle rounds: L lanes of a key, a warp's KPW keys
    GD = G * D  # outputs of a block
    WPR, STEP = D // 4, W * KPW * C  # 8-byte words per row; keys a block covers per step
    PER_THREAD = cdiv(GD, W * WARP_SIZE)  # outputs each thread adds up at the end

    @cuda.jit(**options)
    def kernel(qkv, k_cache, v_cache, block_tables, block_shift, context_lens, qscale, split_len, workspace, out):
        # indices are unsigned 32-bit: no negative-index wraparound, no 64-bit multiplies in the address arithmetic
        kvh, s, split = uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y), uint32(cuda.blockIdx.z)  # KV heads side by side
        num_kv_heads = uint32(cuda.gridDim.x)
        n = uint32(context_lens[s])
        begin = split * uint32(split_len)
        if split > 0 and begin >= n:  # past this sequence's end: the combine skips this split
            return
        end = min(n, begin + uint32(split_len))
        tid = uint32(cuda.threadIdx.x)
        warp, lane = tid // uint32(WARP_SIZE), tid % uint32(WARP_SIZE)
        key_in_warp, sub = lane // uint32(L), lane % uint32(L)  # which of the warp's KPW keys, which part of its row
        block_mask = (uint32(1) << block_shift) - uint32(1)
        bt_row = block_tables[s]  # this sequence's blocks
        q_row = qkv[s]
        scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)  # the simulator's shuffles
        sm_top = cuda.shared.array((W, G), float32)  # each warp's maximum score per query head
        sm_block_top = cuda.shared.array(G, float32)
        sm_acc = cuda.shared.array((KPW, GD), float32)  # one warp's KPW partial outputs at a time
        sm_l = cuda.shared.array((KPW, G), float32)
        q = cuda.local.array(QN, float32)  # every index below is a constant: registers, not local memory
        acc = cuda.local.array(QN, float32)
        m = cuda.local.array(G, float32)
        ell = cuda.local.array(G, float32)
        kw = cuda.local.array(CW, uint64)
        vw = cuda.local.array(CW, uint64)
        x = cuda.local.array(CG, float32)  # the scores of this step's C keys, for each query head
        for g in range(G):
            m[g] = -math.inf
            ell[g] = float32(0.0)
            for i in range(WPL):
                for e in range(4):
                    q[g * EPL + 4 * i + e] = q_row[(kvh * uint32(G) + uint32(g)) * uint32(D) + uint32(4) * (sub + uint32(L * i)) + uint32(e)] * qscale
                    acc[g * EPL + 4 * i + e] = float32(0.0)
        for base in range(begin, end, uint32(STEP)):  # the same steps in every warp: the simulator's shuffles need the block
            first = uint32(base + warp * uint32(KPW * C) + key_in_warp)  # this lane's keys: first, first + KPW, ...
            for c in range(C):  # issue all C rows' loads before using any; past the end, reload the last row (masked below)
                key = min(uint32(first + uint32(c * KPW)), end - uint32(1))
                word = cache_word(bt_row, key, block_shift, block_mask, num_kv_heads, kvh, WPR, sub)
                for i in range(WPL):
                    kw[c * WPL + i] = k_cache[word + uint32(L * i)]
                    vw[c * WPL + i] = v_cache[word + uint32(L * i)]
            for c in range(C):  # scores: each lane's part of the dot products, then the L lanes of a key add them
                for g in range(G):
                    dot = float32(0.0)
                    for i in range(WPL):
                        for e in range(4):
                            dot += q[g * EPL + 4 * i + e] * bf16_lane(kw[c * WPL + i], e)
                    for r in range(LOG_L):  # lane masks 1, 2, ..., L / 2
                        dot += shfl_xor(dot, 1 << r, scratch)
                    x[c * G + g] = dot if first + uint32(c * KPW) < end else -math.inf
            for g in range(G):  # each key slot of the warp keeps its own online softmax: no warp-wide maximum
                top = m[g]
                for c in range(C):
                    top = max(top, x[c * G + g])
                if top > m[g]:  # the running maximum grew: rescale what was summed so far (rare after a few keys)
                    alpha = math.exp2(m[g] - top)
                    ell[g] *= alpha
                    for j in range(EPL):
                        acc[g * EPL + j] *= alpha
                    m[g] = top
            for c in range(C):  # add each key's value row, weighted by its exponential
                for g in range(G):
                    p = math.exp2(x[c * G + g] - m[g]) if first + uint32(c * KPW) < end else float32(0.0)
                    ell[g] += p
                    for i in range(WPL):
                        for e in range(4):
                            acc[g * EPL + 4 * i + e] += p * bf16_lane(vw[c * WPL + i], e)
        # merge the block's W * KPW partial softmaxes: rescale each to the block's maximum, then add them up
        for g in range(G):
            top = m[g]
            for r in range(LOG_KPW):  # lane masks L, 2 L, ..., 16
                top = max(top, shfl_xor(top, L << r, scratch))
            if lane == 0:
                sm_top[warp, g] = top
        cuda.syncthreads()
        for g in range(G):
            top = sm_top[0, g]
            for w in range(1, W):
                top = max(top, sm_top[w, g])
            if tid == 0:
                sm_block_top[g] = top
            f = math.exp2(m[g] - top) if m[g] > -math.inf else float32(0.0)
            ell[g] *= f
            for j in range(EPL):
                acc[g * EPL + j] *= f
        num = cuda.local.array(PER_THREAD, float32)
        den = cuda.local.array(PER_THREAD, float32)
        for j in range(PER_THREAD):
            num[j], den[j] = float32(0.0), float32(0.0)
        for w in range(W):  # one warp's partials at a time through shared memory
            if warp == w:
                for g in range(G):
                    if sub == 0:
                        sm_l[key_in_warp, g] = ell[g]
                    for i in range(WPL):
                        for e in range(4):
                            sm_acc[key_in_warp, g * D + 4 * (sub + L * i) + e] = acc[g * EPL + 4 * i + e]
            cuda.syncthreads()
            for j in range(PER_THREAD):
                t = tid + j * W * WARP_SIZE
                if t < GD:
                    for r in range(KPW):
                        num[j] += sm_acc[r, t]
                        den[j] += sm_l[r, t // D]
            cuda.syncthreads()
        for j in range(PER_THREAD):
            t = tid + j * W * WARP_SIZE
            if t < GD:
                g, d = t // D, t % D
                h = kvh * G + g
                if cuda.gridDim.z == 1:  # the whole context in one block: the final output
                    store_activation(out, s, h * D + d, num[j] / den[j] if den[j] > 0 else float32(0.0))
                else:  # this split's partial: unnormalised output, then its maximum (base 2) and sum
                    workspace[s, split, h, d] = num[j]
                    if d == 0:
                        workspace[s, split, h, D] = sm_block_top[g]
                        workspace[s, split, h, D + 1] = den[j]

    kernel.head_dim, kernel.group, kernel.num_warps = D, G, W
    kernel.keys_per_step = W * KPW * C  # keys a block covers per step of its loop
    return kernel


@cuda.jit
def decode_combine_kernel(workspace, context_lens, split_len, num_splits, out):
    """A block per (row, query head), a thread per element: add the splits' partials, rescaled to their common maximum."""
    s, h, d = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    D = workspace.shape[3] - 2
    used = min(num_splits, (context_lens[s] + split_len - 1) // split_len)  # splits past the end wrote nothing
    if d < D:
        top = -math.inf
        for j in range(used):
            top = max(top, workspace[s, j, h, D])
        num, den = float32(0.0), float32(0.0)
        for j in range(used):
            mj = workspace[s, j, h, D]
            if mj > -math.inf:
                f = math.exp2(mj - top)  # maxima are in base 2 (scores times log2 e)
                num += f * workspace[s, j, h, d]
                den += f * workspace[s, j, h, D + 1]
        store_activation(out, s, h * D + d, num / den if den > 0 else float32(0.0))


decode_attention_d64_g4_kernel = make_decode_attention_kernel(64, 4, DECODE_WARPS)  # Llama 3.2 1B: 32 / 8 heads
decode_attention_d64_g3_kernel = make_decode_attention_kernel(64, 3, DECODE_WARPS)  # SmolLM2: 9 / 3 heads
_DEFAULTS = (KEYS_PER_LANE, LANE_ELEMENTS, MAX_REGISTERS)
_DECODE_KERNELS = {(64, 4, DECODE_WARPS, *_DEFAULTS): decode_attention_d64_g4_kernel,
                   (64, 3, DECODE_WARPS, *_DEFAULTS): decode_attention_d64_g3_kernel}

_DECODE_ARGS = "float32[:, ::1], uint64[::1], uint64[::1], int32[:, ::1], uint32, int32[::1], float32, int64, float32[:, :, :, ::1]"
PTX_SIGNATURES = {
    "write_kv_cache_kernel": [f"void(float32[:, ::1], int64, int64, {idx}[::1], uint16[:, :, ::1], uint16[:, :, ::1])"
                              for idx in ("int32", "int64")],
    **{name: [f"void({_DECODE_ARGS}, {out}[:, ::1])" for out in ("float32", "uint16")]
       for name in ("decode_attention_d64_g4_kernel", "decode_attention_d64_g3_kernel")},
    "decode_combine_kernel": [f"void(float32[:, :, :, ::1], int32[::1], int64, int64, {out}[:, ::1])" for out in ("float32", "uint16")],
}

# %%
#| export kernels.decode_attention
def decode_attention_kernel_for(head_dim: int, group: int, num_warps: int = DECODE_WARPS, keys_per_lane: int | None = None):
    """The kernel for these compile-time sizes (and the module's LANE_ELEMENTS and MAX_REGISTERS), built on first use."""
    key = (head_dim, group, num_warps, keys_per_lane or KEYS_PER_LANE, LANE_ELEMENTS, MAX_REGISTERS)
    if key not in _DECODE_KERNELS:
        _DECODE_KERNELS[key] = make_decode_attention_kernel(*key)
    return _DECODE_KERNELS[key]


def _check_cache(name: str, cache, num_kv_heads: int, head_dim: int):
    """A layer's K or V cache: uint16 (num_slots, KVH, D), or the same bytes viewed as uint64 (num_slots, KVH, D / 4)."""
    if cache.dtype == np.uint16:
        if tuple(cache.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name}: the cache must be (num_slots, {num_kv_heads}, {head_dim}), got {tuple(cache.shape)}")
        return cache.view(np.uint64)
    if cache.dtype != np.uint64 or tuple(cache.shape[1:]) != (num_kv_heads, head_dim // 4):
        raise TypeError(f"{name}: the cache must hold bf16 bits, uint16 (num_slots, {num_kv_heads}, {head_dim}), "
                        f"got {cache.dtype} {tuple(cache.shape)}")
    return cache


def decode_workspace(max_rows: int, max_context_len: int, num_heads: int, head_dim: int, max_splits: int = MAX_SPLITS):
    """The split path's float32 scratch, made once by the caller: (max_rows, splits, num_heads, head_dim + 2)."""
    splits = max(1, min(max_splits, cdiv(max_context_len, MIN_SPLIT_KEYS)))
    return cuda.device_array((max_rows, splits, num_heads, head_dim + 2), np.float32)


def decode_splits(max_context_len: int, rows: int, num_kv_heads: int, max_splits: int, step: int) -> tuple[int, int]:
    """(number of splits, keys per split): SPLIT_KEYS keys a block, more splits while the grid is small; a multiple of step."""
    want = max(cdiv(max_context_len, SPLIT_KEYS), cdiv(TARGET_BLOCKS, rows * num_kv_heads))
    splits = max(1, min(max_splits, want, cdiv(max_context_len, MIN_SPLIT_KEYS)))
    split_len = cdiv(cdiv(max_context_len, splits), step) * step
    return cdiv(max_context_len, split_len), split_len


def decode_attention(qkv, k_cache, v_cache, block_tables, block_size: int, context_lens, num_heads: int, num_kv_heads: int,
                     head_dim: int, out, stream=0, num_warps: int = DECODE_WARPS, workspace=None, max_context_len=None,
                     keys_per_lane: int | None = None):
    """Row s of qkv (one new query per row, after RoPE) over positions 0..context_lens[s]-1 of a bf16 KV cache.

    Position p of row s is at slot block_tables[s, p // block_size] * block_size + p % block_size;
    block_size is a power of two.
    out: (rows, H D), float32 or bf16 bits. The new token's own K/V must already be in the cache.
    workspace (from decode_workspace): lets several blocks share a sequence's context (flash-decoding);
    without it one block per (row, KV head) walks the whole context. max_context_len: at least every
    context length (default: what the block table can address); it sets the number of splits.
    """
    rows = check_qkv("decode_attention", qkv, num_heads, num_kv_heads, head_dim)
    check_out("decode_attention", out, (rows, num_heads * head_dim))
    if head_dim % 16:
        raise ValueError(f"decode_attention: head_dim must be a multiple of 16, got {head_dim}")
    k64, v64 = (_check_cache("decode_attention", c, num_kv_heads, head_dim) for c in (k_cache, v_cache))
    if k64.size >= 2**32:
        raise ValueError(f"decode_attention: the kernel indexes the cache with 32 bits; {k64.size} words is too many")
    if block_tables.dtype != np.int32 or block_tables.ndim != 2 or block_tables.shape[0] < rows:
        raise TypeError(f"decode_attention: block_tables must be int32 (rows, max_blocks), got {block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.dtype != np.int32 or context_lens.ndim != 1 or context_lens.shape[0] < rows:
        raise TypeError(f"decode_attention: context_lens must be int32 (rows,), got {context_lens.dtype} {tuple(context_lens.shape)}")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"decode_attention: block_size must be a power of two (1, 2, 4, ... 16, ...), got {block_size!r}")
    if workspace is not None and (workspace.dtype != np.float32 or workspace.ndim != 4 or workspace.shape[0] < rows
                                  or tuple(workspace.shape[2:]) != (num_heads, head_dim + 2)):
        raise TypeError(f"decode_attention: workspace must be float32 (>= {rows}, splits, {num_heads}, {head_dim + 2}) "
                        f"from decode_workspace, got {workspace.dtype} {tuple(workspace.shape)}")
    if rows == 0:
        return out
    kernel = decode_attention_kernel_for(head_dim, num_heads // num_kv_heads, num_warps, keys_per_lane)
    max_len = int(max_context_len) if max_context_len is not None else block_tables.shape[1] * int(block_size)
    splits, split_len = 1, 2**30  # one split: the whole context
    if workspace is not None and workspace.shape[1] > 1:
        splits, split_len = decode_splits(max(max_len, 1), rows, num_kv_heads, workspace.shape[1], kernel.keys_per_step)
    scratch = workspace if splits > 1 else qkv.reshape(1, 1, *qkv.shape)  # one split writes no partials: any float32 view
    kernel[(num_kv_heads, rows, splits), num_warps * WARP_SIZE, stream](
        qkv, k64.reshape(-1), v64.reshape(-1), block_tables, np.uint32(int(block_size).bit_length() - 1), context_lens,
        np.float32(LOG2_E / math.sqrt(head_dim)), split_len, scratch, out)
    if splits > 1:
        decode_combine_kernel[(rows, num_heads), cdiv(head_dim, WARP_SIZE) * WARP_SIZE, stream](
            workspace, context_lens, split_len, splits, out)
    return out


def write_kv_cache(qkv, num_heads: int, num_kv_heads: int, slot_mapping, k_cache, v_cache, stream=0, threads: int = 256):
    """Store the new tokens' K and V (qkv float32 after RoPE) as bf16 at slot_mapping[t] (int32/int64; -1 skips)."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    check_qkv("write_kv_cache", qkv, num_heads, num_kv_heads, head_dim)
    for cache in (k_cache, v_cache):
        if cache.dtype != np.uint16 or cache.ndim != 3 or tuple(cache.shape[1:]) != (num_kv_heads, head_dim):
            raise TypeError(f"write_kv_cache: caches must be uint16 (num_slots, {num_kv_heads}, {head_dim}), got {cache.dtype} {tuple(cache.shape)}")
    if slot_mapping.dtype not in (np.int32, np.int64) or slot_mapping.shape != (num_tokens,):
        raise TypeError(f"write_kv_cache: slot_mapping must be int32 or int64 ({num_tokens},), got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if num_tokens:
        total = num_tokens * num_kv_heads * head_dim
        write_kv_cache_kernel[cdiv(total, threads), threads, stream](qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache)

# %% [markdown]
# The NumPy reference works in float64 on the same bf16 cache, so the kernel's only error is
# its float32 arithmetic. A test with several sequences of odd lengths, grouped heads and a
# block table that scatters the blocks (as paging will):

# %%
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyvllm_lib.runtime import can_launch


def random_decode_case(num_seqs, max_len, num_heads, num_kv_heads, head_dim, block_size, gen):
    """qkv, a filled bf16 cache, a shuffled block table and random context lengths."""
    lens = gen.integers(1, max_len + 1, num_seqs).astype(np.int32)
    max_blocks = -(-max_len // block_size)
    blocks = gen.permutation(num_seqs * max_blocks).astype(np.int32).reshape(num_seqs, max_blocks)
    num_slots = num_seqs * max_blocks * block_size
    k = f32_to_bf16_bits(gen.standard_normal((num_slots, num_kv_heads, head_dim)).astype(np.float32))
    v = f32_to_bf16_bits(gen.standard_normal((num_slots, num_kv_heads, head_dim)).astype(np.float32))
    qkv = gen.standard_normal((num_seqs, (num_heads + 2 * num_kv_heads) * head_dim)).astype(np.float32)
    return qkv, k, v, blocks, lens


if can_launch():
    from tinyvllm_lib.kernels.decode_attention import decode_workspace

    qkv_d, k_d, v_d, bt_d, lens_d = random_decode_case(3, 37, 4, 2, 16, 4, rng)
    want = decode_attention_ref(qkv_d, k_d, v_d, bt_d, 4, lens_d, 4, 2, 16)
    args = [cuda.to_device(a) for a in (qkv_d, k_d, v_d, bt_d)] + [4, cuda.to_device(lens_d), 4, 2, 16]
    for label, split in [("one block per sequence", {}),
                         ("context split over blocks", {"workspace": decode_workspace(3, 37, 4, 16), "max_context_len": 37})]:
        got = decode_attention(*args, cuda.device_array((3, 64), np.float32), **split).copy_to_host()
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{label}, context lengths {lens_d.tolist()}: max relative error {rel:.1e}")
        assert rel < 1e-5

# %%
decode_records = {r["shape"][0]: r for r in records if r["name"] == "decode_attention"}
for n in (1, 64):
    r = decode_records.get(n)
    glue(f"ch08_decode_{n}_us", f"{r['us']:.1f} µs" if r else "(not yet measured)")
    glue(f"ch08_decode_{n}_copy", f"{r['ratio']:.0%}" if r and r.get("ratio") else "(not yet measured)")
glue("ch08_decode_device", decode_records[64]["device"]["name"] if 64 in decode_records else "the GPU")
glue("ch08_decode_sms", str(decode_records[64]["device"].get("multiprocessors", "its")) if 64 in decode_records else "its")

# %% [markdown]
# On the {glue:text}`ch08_decode_device`, at Llama 3.2 1B's shapes and 1024 tokens of context,
# 64 sequences take {glue:text}`ch08_decode_64_us` per layer — {glue:text}`ch08_decode_64_copy` of
# the copy bandwidth. One sequence takes {glue:text}`ch08_decode_1_us`: its 2 MiB of K and V per
# layer is too little to fill {glue:text}`ch08_decode_sms` SMs, so latency, not bandwidth, sets its
# time, and splitting the context is what keeps it that short. Here is what each knob does at
# 64 sequences, moved alone away from the defaults (the dark bar):

# %%
tune = [r for r in load_records("ch08_decode_tune") if r["shape"][0] == 64 and r.get("correct")]
KNOBS = {"lane_elements": "values per lane", "keys_per_lane": "rows in flight per lane", "max_registers": "register cap",
         "num_warps": "warps per block", "split_keys": "keys per split", "target_blocks": "grid target"}
if tune and tune[0].get("ratio"):
    base = next(r for r in tune if not r["moved"])
    fig, axes = new_figure(1, len(KNOBS), width=9, height=2.3, sharey=True)
    for ax, (knob, title) in zip(axes, KNOBS.items()):
        points = sorted([base] + [r for r in tune if r["moved"] == [knob]], key=lambda r: (r[knob] is not None, r[knob] or 0))
        labels = [str(r[knob]) if r[knob] is not None else "none" for r in points]
        ax.bar(labels, [100 * r["ratio"] for r in points], color=["#1f4e79" if r is base else "#9ecae1" for r in points])
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("% of copy bandwidth")
    fig.suptitle(f"decode attention, 64 sequences x 1024 tokens, {base['device']['name']}", fontsize=9)
    plt.show()
    for r in sorted(tune, key=lambda r: -r["ratio"])[:3]:
        print(f"{r['ratio']:.0%} of copy: " + ", ".join(f"{k} {r[k]}" for k in KNOBS) + f" ({r['registers']} registers)")
else:
    print("no GPU sweep recorded yet: run bench/ch08_decode_tune.py on a GPU")

# %% [markdown]
# Rows in flight matter most: with one row per lane the memory waits between loads; three and
# four are about equal, four at the 128 registers that still let 16 warps share an SM. Sixteen
# values a lane pushes the registers past that and halves the warps. One warp a block leaves
# half the GPU idle — 64 × 8 × 2 blocks of one warp each are fewer warps than 132 SMs hold —
# and eight warps a block give each warp too short a share of its 512 keys to pay for loading
# the queries and merging at the end; shorter splits (more of them) cost the same way. The kernel
# is not the ceiling of the hardware — FlashInfer-style kernels use 16-byte loads and tensor
# cores, which Numba does not reach — but it is within sight of the copy bandwidth at the batch
# sizes where attention's bytes are a large part of a step.


# %% [markdown]
# ### Sampling on the GPU
#
# The runner's logits stay on the GPU; only token ids come back. The sampler takes the same
# `SamplingMetadata` as the NumPy one, including each row's uniform number drawn on the host
# from the request's own generator — so a seed gives the same draw on both devices. A block
# per row: greedy rows take the argmax (a block reduction that keeps the first of equal
# values, as `np.argmax` does). Sampled rows find their thresholds without sorting: top-k is
# the largest value $t$ with at least $k$ logits $\ge t$, top-p the largest $t$ whose kept
# mass $\sum_{z_i \ge t} e^{(z_i - m)/T}$ still reaches $p$ of the total. Both are found by
# **bisection** over the 32-bit keys that order float32 values like the floats themselves
# (flip the sign bit of positives, every bit of negatives), so 32 passes over the row find
# the exact threshold. The draw is the inverse CDF in token order: each thread sums a
# contiguous segment, a prefix over the threads finds the segment where $u \cdot$ total falls.

# %%
#| export engine.sampler_cuda
import math

import numpy as np
from numba import config, cuda, float32, int64, uint32

from tinyvllm_lib.engine.sampler import SamplerOutput, SamplingMetadata, top_logprobs
from tinyvllm_lib.kernels.bf16 import _f32_bits
from tinyvllm_lib.models.llama_numpy import log_softmax

SAMPLER_THREADS = 32 if config.ENABLE_CUDASIM else 256  # a power of two: the reductions halve it
MAX_THREADS = 1024


@cuda.jit(device=True)
def order_key(x):
    """A uint32 that orders like the float32 x: flip all bits of negatives, the sign bit of the rest."""
    u = _f32_bits(x)
    return u ^ uint32(0xFFFFFFFF) if u >> uint32(31) else u | uint32(0x80000000)


@cuda.jit(device=True)
def block_argmax(value, index, sv, si):
    """(largest value, its smallest index) over the block; every thread gets them."""
    tid = cuda.threadIdx.x
    sv[tid], si[tid] = value, index
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride and (sv[tid + stride] > sv[tid] or (sv[tid + stride] == sv[tid] and si[tid + stride] < si[tid])):
            sv[tid], si[tid] = sv[tid + stride], si[tid + stride]
        cuda.syncthreads()
        stride //= 2
    value, index = sv[0], si[0]
    cuda.syncthreads()
    return value, index


@cuda.jit(device=True)
def block_total(value, sv):
    """Sum over the block; every thread gets it."""
    tid = cuda.threadIdx.x
    sv[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            sv[tid] += sv[tid + stride]
        cuda.syncthreads()
        stride //= 2
    value = sv[0]
    cuda.syncthreads()
    return value


@cuda.jit(device=True)
def row_argmax(z, sv, si):
    best, best_i = -math.inf, int64(z.shape[0])
    for i in range(cuda.threadIdx.x, z.shape[0], cuda.blockDim.x):
        if z[i] > best:  # increasing i: the first of equal values stays
            best, best_i = z[i], i
    return block_argmax(float32(best), best_i, sv, si)


@cuda.jit
def argmax_kernel(logits, out):
    """Greedy: a block per row, out[row] = the index of the row's largest logit (the first, on ties)."""
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    _, i = row_argmax(logits[cuda.blockIdx.x], sv, si)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = i

# %%
#| export engine.sampler_cuda
@cuda.jit(device=True)
def kept_sum(z, m, inv_t, threshold, count_only, sv):
    """Over the row's tokens whose order key is >= threshold: their count, or their mass sum exp((z - m) / T)."""
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, z.shape[0], cuda.blockDim.x):
        if order_key(z[i]) >= threshold:
            acc += float32(1.0) if count_only else math.exp((z[i] - m) * inv_t)
    return block_total(acc, sv)


@cuda.jit
def sample_kernel(logits, temperature, top_k, top_p, uniform, out):
    """A block per row: temperature, top-k and top-p thresholds by bisection over the float order, inverse-CDF draw."""
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    r, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    z = logits[r]
    m, best_i = row_argmax(z, sv, si)
    if temperature[r] <= 0:  # greedy (the whole block takes this branch)
        if tid == 0:
            out[r] = best_i
        return
    inv_t = float32(1.0) / temperature[r]
    threshold = uint32(0)  # keep tokens whose order key is >= threshold: all of them
    if 0 < top_k[r] < z.shape[0]:  # the largest threshold that keeps at least k tokens: the k-th largest logit
        lo, hi = int64(0), int64(1) << 32
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if kept_sum(z, m, inv_t, uint32(mid), True, sv) >= top_k[r]:
                lo = mid
            else:
                hi = mid
        threshold = uint32(lo)
    if top_p[r] < 1:  # the largest threshold whose kept mass still reaches p of the total
        goal = top_p[r] * kept_sum(z, m, inv_t, threshold, False, sv)
        lo, hi = int64(threshold), int64(1) << 32
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if kept_sum(z, m, inv_t, uint32(mid), False, sv) >= goal:
                lo = mid
            else:
                hi = mid
        threshold = uint32(lo)
    # inverse CDF in token order: each thread sums a contiguous segment, a prefix over the threads finds the segment
    seg = (z.shape[0] + nt - 1) // nt
    part = float32(0.0)
    for i in range(tid * seg, min(z.shape[0], (tid + 1) * seg)):
        if order_key(z[i]) >= threshold:
            part += math.exp((z[i] - m) * inv_t)
    total = block_total(part, sv)
    sv[tid] = part
    cuda.syncthreads()
    before = float32(0.0)
    for j in range(tid):
        before += sv[j]
    target = float32(uniform[r]) * total
    found, last = int64(-1), int64(-1)
    if before <= target < before + part:
        run = before
        for i in range(tid * seg, min(z.shape[0], (tid + 1) * seg)):
            if order_key(z[i]) >= threshold:
                run += math.exp((z[i] - m) * inv_t)
                if run > target and found < 0:
                    found = i
    for i in range(tid * seg, min(z.shape[0], (tid + 1) * seg)):
        if order_key(z[i]) >= threshold:
            last = i
    cuda.syncthreads()
    _, pick = block_argmax(float32(1.0) if found >= 0 else float32(0.0), found if found >= 0 else int64(1) << 40, sv, si)
    _, final = block_argmax(float32(last), last, sv, si)  # u * total rounded up past the last kept token
    if tid == 0:
        out[r] = pick if pick < z.shape[0] else final


_ROW_ARGS = "float32[::1], int64[::1], float32[::1], float64[::1], int64[::1]"  # temperature, top_k, top_p, uniform, out
PTX_SIGNATURES = {"argmax_kernel": ["void(float32[:, ::1], int64[::1])"],
                  "sample_kernel": [f"void(float32[:, ::1], {_ROW_ARGS})"]}


class CudaSampler:
    """The GPU sampler: logits (batch, vocab) on the GPU -> token ids on the host; the same SamplingMetadata as Sampler."""

    def __init__(self, vocab_size: int, max_rows: int, stream=0):
        self.vocab_size, self.max_rows, self.stream = vocab_size, max_rows, stream
        self.ids = cuda.device_array(max_rows, np.int64)
        self.rows = {name: cuda.device_array(max_rows, dtype) for name, dtype in
                     (("temperature", np.float32), ("top_k", np.int64), ("top_p", np.float32), ("uniform", np.float64))}
        self.host_ids = cuda.pinned_array(max_rows, np.int64)

    def __call__(self, logits, metadata: SamplingMetadata) -> SamplerOutput:
        n, s = len(metadata.temperature), self.stream
        if not hasattr(logits, "copy_to_host"):  # host logits: copy them over
            logits = cuda.to_device(np.ascontiguousarray(logits, np.float32), stream=s)
        if tuple(logits.shape) != (n, self.vocab_size) or logits.dtype != np.float32 or n > self.max_rows:
            raise ValueError(f"logits must be float32 ({n}, {self.vocab_size}) with n <= {self.max_rows}, got {logits.dtype} {tuple(logits.shape)}")
        threads = SAMPLER_THREADS
        if np.all(metadata.temperature <= 0):
            argmax_kernel[n, threads, s](logits, self.ids[:n])
        else:
            for name in self.rows:
                host = np.ascontiguousarray(getattr(metadata, name), self.rows[name].dtype)
                cuda.to_device(host, to=self.rows[name][:n], stream=s)
            r = self.rows
            sample_kernel[n, threads, s](logits, r["temperature"][:n], r["top_k"][:n], r["top_p"][:n], r["uniform"][:n], self.ids[:n])
        self.ids[:n].copy_to_host(self.host_ids[:n], stream=s)
        s.synchronize() if s else cuda.synchronize()
        out = SamplerOutput(self.host_ids[:n].copy())
        k = int(metadata.num_logprobs.max(initial=-1))
        if k >= 0:  # log-probs of the raw logits: copy the rows back (only when asked for)
            logprobs = log_softmax(logits.copy_to_host(stream=s))
            out.logprobs = logprobs[np.arange(n), out.token_ids]
            if k > 0:
                out.top_ids, out.top_logprobs = top_logprobs(logprobs, k)
        return out


# %% [markdown]
# ### The CUDA runner
#
# The runner reuses chapter 7's `LlamaCuda` for its weights (bf16 on the GPU, q/k/v and gate/up
# fused), its RoPE table and its activation buffers, and writes the layer loop itself, because
# two steps are new: after RoPE, `write_kv_cache` stores the new tokens' keys and values; and
# attention is `flash_attention` for a prompt that starts at position 0 (one sequence at a time,
# causal among its own tokens, as in chapter 7) and `decode_attention` otherwise — every new
# token then is a row with its own context length, which covers decode steps of many
# sequences and also a prompt that continues a cached one. Activations keep chapter 7's rule:
# float32 residual stream, bf16 inputs to the linear layers, float32 outputs.
#
# A decode step of up to `max_num_seqs` sequences uses buffers made once, at construction, and
# allocates nothing on the GPU: it copies the step's token ids, positions, slot mapping, block
# table and context lengths into them on the runner's stream, launches the layers, and
# synchronises only when the sampler hands the token ids back. The block table is built from
# the metadata's context slots — blocks of 16 when the slots form aligned blocks of 16 (this
# chapter's rows do whenever `max_model_len` is a multiple of 16), single slots otherwise.

# %%
#| export engine.runner_cuda
import numpy as np
from numba import cuda

from tinyvllm_lib.engine.kv_cache import AttentionMetadata
from tinyvllm_lib.engine.llm import register_runner
from tinyvllm_lib.engine.sampler_cuda import CudaSampler
from tinyvllm_lib.kernels.activation import silu_mul
from tinyvllm_lib.kernels.attention import flash_attention
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_workspace, write_kv_cache
from tinyvllm_lib.kernels.embedding import check_token_ids, embed
from tinyvllm_lib.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from tinyvllm_lib.kernels.rope import rope_qkv
from tinyvllm_lib.layers.linear import linear
from tinyvllm_lib.models.llama_cuda import LlamaCuda
from tinyvllm_lib.models.llama_numpy import check_positions

CACHE_BLOCK = 16  # the block size of the block table when the slots allow it (else 1: any slot anywhere)


def block_table_row(slots: np.ndarray, block_size: int, out: np.ndarray) -> bool:
    """Write slots // block_size per block into `out`; False when the slots are not whole aligned blocks."""
    n = len(slots)
    firsts = slots[::block_size]
    if block_size > 1 and (np.any(firsts % block_size) or
                           np.any(slots != np.repeat(firsts, block_size)[:n] + np.arange(n) % block_size)):
        return False
    out[: len(firsts)] = firsts // block_size
    return True


class CudaRunner:
    """The GPU backend: LlamaCuda's weights and kernels, a bf16 KV cache, decode attention, a GPU sampler.

    Activations as in chapter 7: the residual stream float32, the inputs of linear layers bf16 bits,
    their outputs float32. A decode step (one new token per sequence, up to max_num_seqs) uses buffers
    made here and allocates nothing; it copies its small int arrays to the GPU on the runner's stream.
    """

    device = "cuda"

    def __init__(self, model: LlamaCuda, num_slots: int, max_num_seqs: int = 8, max_model_len: int | None = None):
        c = self.config = model.config
        self.model, self.num_slots, self.max_num_seqs = model, num_slots, max_num_seqs
        self.max_model_len = max_model_len or min(num_slots, c.max_position_embeddings)
        self.stream = cuda.stream()
        shape = (num_slots, c.num_key_value_heads, c.head_dim)
        self.k_cache = [cuda.device_array(shape, np.uint16) for _ in range(c.num_hidden_layers)]
        self.v_cache = [cuda.device_array(shape, np.uint16) for _ in range(c.num_hidden_layers)]
        self.k64 = [k.view(np.uint64) for k in self.k_cache]  # the same bytes, as the kernel's 8-byte words
        self.v64 = [v.view(np.uint64) for v in self.v_cache]
        self.max_blocks = self.max_model_len  # room for a block size of 1
        self.max_context_len = self.max_model_len  # the step's longest context, set by execute
        self.decode_buffers = self._make_buffers(max_num_seqs)
        self._prefill: dict[int, dict] = {}
        self.host = {"bt": np.zeros((max_num_seqs, self.max_blocks), np.int32), "lens": np.zeros(max_num_seqs, np.int32)}
        self.sampler = CudaSampler(c.vocab_size, max_num_seqs, self.stream)

    @classmethod
    def from_folder(cls, folder, num_slots: int, kv_cache_dtype: str = "auto", max_num_seqs: int = 8,
                    max_model_len: int | None = None) -> "CudaRunner":
        if kv_cache_dtype not in ("auto", "bfloat16"):
            raise ValueError(f"device='cuda' keeps its KV cache in bfloat16, got kv_cache_dtype={kv_cache_dtype!r}")
        return cls(LlamaCuda.from_folder(folder), num_slots, max_num_seqs, max_model_len)

    def _make_buffers(self, rows: int) -> dict:
        b = dict(self.model.buffers(rows))  # chapter 7's activation buffers for `rows` tokens
        self.model._buffers = {}  # they are ours now
        b["slot_mapping"] = cuda.device_array(rows, np.int64)
        b["context_lens"] = cuda.device_array(rows, np.int32)
        b["block_tables"] = cuda.device_array((rows, self.max_blocks), np.int32)
        c = self.config  # decode attention's split partials (flash-decoding) for decode steps; long prompts need none
        b["attn_workspace"] = (decode_workspace(rows, self.max_model_len, c.num_attention_heads, c.head_dim)
                               if rows <= self.max_num_seqs else None)
        return b

    def _buffers_for(self, n: int) -> dict:
        if n <= self.max_num_seqs:
            return {k: v[:n] for k, v in self.decode_buffers.items()}
        if n not in self._prefill:
            self._prefill = {n: self._make_buffers(n)}  # keep one prefill size: the last
        return self._prefill[n]


# %%
#| export engine.runner_cuda
def _execute(self, token_ids, positions, metadata: AttentionMetadata, logits_indices=None):
    """Write the new tokens' K/V to the cache and return the logits (rows logits_indices, default all) on the GPU."""
    c, s = self.config, self.stream
    ids = check_token_ids(token_ids, c.vocab_size)
    positions = check_positions(positions, len(ids))
    n = len(ids)
    if len(metadata.slot_mapping) != n:
        raise ValueError(f"{n} tokens but {len(metadata.slot_mapping)} slots in the slot mapping")
    b = self._buffers_for(n)
    # a prompt from position 0 attends causally among its own tokens: flash attention (chapter 7)
    is_prefill = len(metadata.query_lens) == 1 and n > 1 and int(positions[0]) == 0 and np.all(np.diff(positions) == 1)
    cuda.to_device(np.ascontiguousarray(ids, np.int64), to=b["ids"], stream=s)
    cuda.to_device(positions, to=b["positions"], stream=s)
    cuda.to_device(np.ascontiguousarray(metadata.slot_mapping, np.int64), to=b["slot_mapping"], stream=s)
    block_size = 1
    if not is_prefill:  # every new token is a row of decode attention: its sequence's slots up to its position
        bt = self.host["bt"][:n] if n <= self.max_num_seqs else np.zeros((n, self.max_blocks), np.int32)
        lens = self.host["lens"][:n] if n <= self.max_num_seqs else np.zeros(n, np.int32)
        rows = np.repeat(np.arange(len(metadata.query_lens)), metadata.query_lens)
        block_size = CACHE_BLOCK
        for size in (CACHE_BLOCK, 1):
            block_size = size
            if all(block_table_row(metadata.context_slots[r], size, bt[t]) for t, r in enumerate(rows)):
                break
        lens[:] = positions + 1
        self.max_context_len = int(lens.max())  # sets decode attention's number of splits
        cuda.to_device(bt, to=b["block_tables"], stream=s)
        cuda.to_device(lens, to=b["context_lens"], stream=s)
    self.run(b, is_prefill, block_size)
    if logits_indices is None:
        rows_out = slice(0, n)
    else:
        idx = np.asarray(logits_indices, np.int64)
        if idx.size == 0 or np.any(np.diff(idx) != 1):
            raise ValueError("the CUDA runner returns a contiguous range of rows: give logits_indices in order")
        rows_out = slice(int(idx[0]), int(idx[-1]) + 1)
    linear(b["normed"][rows_out], self.model.weights["lm_head"], b["logits"][rows_out], stream=s)
    return b["logits"][rows_out]


def _run(self, b: dict, is_prefill: bool, block_size: int) -> None:
    """Launch the layers on the runner's stream (LlamaCuda.run, with the cache write and decode attention added)."""
    c, w, eps, s = self.config, self.model.weights, self.config.rms_norm_eps, self.stream
    H, KVH, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    embed(b["ids"], w["embed_tokens"], b["residual"], stream=s)
    rmsnorm(b["residual"], w["layers.0.input_layernorm"], eps, b["normed"], stream=s)
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        linear(b["normed"], w[p + "qkv_proj"], b["qkv"], stream=s)
        rope_qkv(b["qkv"], b["positions"], self.model.rope, H, KVH, stream=s)
        write_kv_cache(b["qkv"], H, KVH, b["slot_mapping"], self.k_cache[i], self.v_cache[i], stream=s)
        if is_prefill:
            flash_attention(b["qkv"], H, KVH, D, b["attn"], stream=s)
        else:
            decode_attention(b["qkv"], self.k64[i], self.v64[i], b["block_tables"], block_size, b["context_lens"],
                             H, KVH, D, b["attn"], stream=s, workspace=b["attn_workspace"],
                             max_context_len=self.max_context_len)
        linear(b["attn"], w[p + "o_proj"], b["delta"], stream=s)
        fused_add_rmsnorm(b["residual"], b["delta"], w[p + "post_attention_layernorm"], eps, b["normed"], stream=s)
        linear(b["normed"], w[p + "gate_up_proj"], b["gate_up"], stream=s)
        silu_mul(b["gate_up"], b["act"], stream=s)
        linear(b["act"], w[p + "down_proj"], b["delta"], stream=s)
        next_norm = w[f"layers.{i + 1}.input_layernorm"] if i + 1 < c.num_hidden_layers else w["norm"]
        fused_add_rmsnorm(b["residual"], b["delta"], next_norm, eps, b["normed"], stream=s)


CudaRunner.execute, CudaRunner.run = _execute, _run



register_runner("cuda", CudaRunner.from_folder)

# %% [markdown]
# ## Summary
#
# - Prefill processes the prompt's tokens together and is compute-bound; decode processes one
#   token per step, reads every weight for it, and is memory-bound.
# - The KV cache keeps every token's keys and values, per layer `(num_slots, num_kv_heads,
#   head_dim)`; Llama 3.2 1B needs 32 KiB per token in bf16. The runner writes new tokens at
#   the slots of the *slot mapping* and reads each sequence's context slots, both passed in
#   explicitly, so chapter 10 can change how slots are assigned without touching it.
# - Cached decoding gives the same logits as recomputing (to $10^{-5}$), and the engine matches
#   `transformers` to $10^{-3}$ in log-probability, with identical greedy tokens up to near ties.
# - The sampler applies temperature, top-k and top-p in vLLM's order and draws with a uniform
#   from the request's own generator; its frequencies pass a chi-square test.
# - The engine stops at every eos id, stop tokens, stop strings and `max_tokens`, and streams
#   text only once it is stable.
#
# Exported to `tinyvllm_lib`: `engine.kv_cache` (`KVCache`, `ContiguousSlots`,
# `AttentionMetadata`, `kv_cache_bytes_per_token`), `engine.runner_numpy` (`NumpyRunner`,
# `cached_attention_ref`), `engine.sampling_params` (`SamplingParams`), `engine.sampler`
# (`Sampler`, `SamplingMetadata`), `engine.detokenizer` (`IncrementalDetokenizer`),
# `engine.outputs`, `engine.request`, `engine.verify` and `engine.llm` (`LLM`, `runner_for`,
# `register_runner`); `from tinyvllm_lib import LLM, SamplingParams`; the commands `generate`,
# `chat` and `verify`.
#
# ## Exercises
#
# 1. How many bytes does one decode step of Llama 3.2 1B read at a context of 8192 tokens, and
#    which share is the cache? At what context length does the cache read equal the weights?
# 2. Generate 64 tokens with `device="cpu"` while timing each step. Does the time per step grow
#    with the context? Predict from the FLOP counts above first.
# 3. `apply_top_p` sorts the whole vocabulary. vLLM first applies top-k when both are set — why
#    does that make top-p cheaper? Rewrite `apply_top_p` to sort only the top-k survivors.
# 4. Replace inverse-CDF sampling with the Gumbel-max trick ($\arg\max_i z_i - \log(-\log u_i)$
#    with one uniform per token). Check it with the chi-square test. Which one is easier to run
#    as one GPU kernel, and which needs fewer random numbers?
# 5. Make the runner store bf16 keys and values (`LLM(..., kv_cache_dtype="bfloat16")`) and run
#    `verify` on SmolLM2. How large is the log-probability difference, and do greedy tokens
#    still agree?
