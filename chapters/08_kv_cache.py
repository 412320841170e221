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
# # 8. The KV cache
#
# Chapter 7 ended with a model that answers "What is the capital of France?" with
# "Paris" — by running the whole forward pass over the whole conversation again for
# every new token. This chapter keeps every token's keys and values, the **KV cache**,
# so that each new token costs one token's work; it lays the cache out in **blocks**
# addressed through a **block table**, the layout every later chapter keeps; and it
# writes the kernel that makes decoding fast on a GPU, **decode attention**, one new
# query per sequence over its whole past.
#
# In this chapter you will learn:
#
# - why generation has two phases, **prefill** and **decode**, and what each costs in
#   FLOPs and bytes per token, for SmolLM2 and Llama 3.2 1B;
# - the **KV cache**: its layout (per layer, keys and values indexed by a *slot*), its
#   size per token, blocks of slots and the *block table* that maps a sequence's
#   positions to them;
# - **attention metadata**: the few arrays — `query_start_loc`, `seq_lens`,
#   `slot_mapping`, `block_tables` — that tell attention where a batch's new keys and
#   values go and what each sequence attends over, built in one vectorised NumPy pass;
# - attention over the cache as an object the model's layer loop is handed, in NumPy and
#   on the GPU, checked against recomputing everything;
# - a **decode attention** kernel designed around bytes — and around instructions — that
#   reads the cache at well over half of the GPU's bandwidth ceiling.
#
# It builds on the forward pass of [chapter 7](07_attention.py) (the layer loop takes
# its attention as an argument), the model config of [chapter 2](02_safetensors.py),
# SmolLM2 from [chapter 2b](02b_smollm2.py) and the tokenizer of
# [chapter 3](03_first_kernel.py). Choosing tokens, stopping and streaming them come in
# [chapter 8b](08b_generation.py).

# %%
#| default_exp engine.kv_cache

# %%
import math
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.softmax import log_softmax, softmax_ref
from tinyvllm_lib.measure import (
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
    max_rel_error,
)
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.random_llama import (
    LLAMA_3_2_1B_CONFIG,
    make_random_llama,
    tiny_llama_config,
)
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, has_gpu, is_simulator, where_kernels_run
from tinyvllm_lib.tokenizer import Tokenizer

rng = np.random.default_rng()
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
# chapter 2b: built on first use, then found in the cache
folder = resolve_model("smollm2")
smollm2 = ModelConfig.from_folder(folder)
llama_1b = ModelConfig.from_dict(LLAMA_3_2_1B_CONFIG)
tokenizer = Tokenizer.from_folder(folder)
print(where_kernels_run())

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## Prefill and decode: count first
#
# Generating an answer has two phases. **Prefill** runs the prompt — all its tokens at
# once — through the model, and the logits of its last position give the first new
# token. **Decode** then produces one token per step: each step's input is the token the
# step before chose.
#
# Both phases multiply every token's activations by every weight matrix: about $2P$
# FLOPs per token for a model whose matrices hold $P$ weights (one multiply and one add
# per weight). Attention adds $4 \cdot L \cdot H \cdot D \cdot n$ FLOPs per token at
# context length $n$ (the products $q \cdot k$ and $p \cdot v$, in each of $L$ layers
# and $H$ heads of size $D$). What differs is the **bytes**. A forward pass over $T$
# tokens reads each weight once for all $T$ of them: prefill shares the $2P$ bytes of
# bf16 weights among hundreds of prompt tokens, decode spends them on one token. The
# *arithmetic intensity* — FLOPs per byte read — is
#
# $$ I(T) \approx \frac{2 P T}{2 P} = T \ \text{FLOP/byte} \quad (\text{bf16 weights
#    , } T \text{ tokens per pass}). $$
#
# An H200 does about 990 dense bf16 TFLOP/s and reads about 4.8 TB/s: below about 200
# FLOPs per byte it waits for memory. A decode step at batch 1 has $I \approx 1$; it is
# **memory-bound**, and its speed limit is simply (bytes per step) / (bandwidth).
# Batching decode steps of many sequences (chapter 9) is how an engine raises $T$ for
# decode.


# %% tags=["hide-input"]
def matrix_params(c: ModelConfig) -> int:
    """Weights in the matrices that every token multiplies: q/k/v/o, gate/up/down per
    layer, and the head.
    """
    attention = (
        c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    )
    attention += c.num_attention_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attention + mlp) + c.vocab_size * c.hidden_size


def step_costs(
    c: ModelConfig,
    num_tokens: int,
    context_len: int,
    weight_bytes: int = 2,
    kv_bytes: int = 2,
) -> dict:
    """FLOPs and bytes of one forward pass over `num_tokens` new tokens at `context_len`
    (batch of one sequence).
    """
    params = matrix_params(c)
    flops = num_tokens * (
        2 * params
        + 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context_len
    )
    kv_per_token = (
        2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_bytes
    )
    # the weights once; the cache read once
    nbytes = params * weight_bytes + context_len * kv_per_token
    return {
        "flops": flops,
        "bytes": nbytes,
        "flops_per_token": flops / num_tokens,
        "bytes_per_token": nbytes / num_tokens,
    }


for name, c in (("SmolLM2-135M", smollm2), ("Llama 3.2 1B", llama_1b)):
    prefill, decode = step_costs(c, 512, 512), step_costs(c, 1, 512)
    print(
        f"{name:>13}: {matrix_params(c) / 1e6:6.0f} M matrix weights | per token: "
        "prefill of 512 "
        f"{prefill['flops_per_token'] / 1e9:.2f} GFLOP, "
        f"{prefill['bytes_per_token'] / 1e6:6.2f} MB | "
        f"decode at 512 {decode['flops_per_token'] / 1e9:.2f} GFLOP, "
        f"{decode['bytes_per_token'] / 1e6:7.1f} MB"
    )

decode_1b = step_costs(llama_1b, 1, 512)
# chapter 1's bandwidth ceiling: its best measured rate
ceiling_gbs, ceiling_name = bandwidth_ceiling()
# bytes/s; the datasheet's figure until one is recorded
bandwidth = ceiling_gbs * 1e9 if ceiling_name else 4.8e12
prose.glue("ch08_1b_gflop", f"{decode_1b['flops'] / 1e9:.2f} GFLOP")
prose.glue("ch08_1b_gb", f"{decode_1b['bytes'] / 1e9:.2f} GB")
prose.glue(
    "ch08_bandwidth",
    ceiling_phrase(ceiling_gbs, ceiling_name)
    if ceiling_name
    else "the datasheet's 4.8 TB/s (no ceiling measured yet)",
)


def latex_number(x: float, fmt: str) -> str:
    return format(x, fmt).replace(",", "{,}")


# the batch-1 limit: tokens/s <= B / W
prose.glue(
    "ch08_1b_limit",
    r"$$ \frac{B}{W} = \frac{" + latex_number(bandwidth / 1e9, ",.0f")
    + r"\ \text{GB/s}}{" + latex_number(decode_1b["bytes"] / 1e9, ".2f")
    + r"\ \text{GB}} \approx " + latex_number(bandwidth / decode_1b["bytes"], ",.0f")
    + r"\ \text{tokens/s}. $$",
)
prose.glue(
    "ch08_smol_mb",
    f"{step_costs(smollm2, 1, 512, weight_bytes=4, kv_bytes=4)['bytes'] / 1e6:.0f} MB",
)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
A decode step of Llama 3.2 1B at a context of 512 tokens does {{ch08_1b_gflop}} and
reads $W$ = {{ch08_1b_gb}}, weights and cache. A step must read them all, so with $B$
= {{ch08_bandwidth}}, no implementation can decode one sequence faster than

{{ch08_1b_limit}}

Our CPU backend keeps SmolLM2's weights in float32: it reads {{ch08_smol_mb}} per step,
and the memory bandwidth of the CPU sets its speed the same way. The plot shows the
intensity as the number of tokens per pass grows.
""")

# %%
tokens = np.unique(np.geomspace(1, 4096, 40).astype(int))
fig, ax = new_figure(width=6.5, height=3)
for name, c in (("SmolLM2-135M", smollm2), ("Llama 3.2 1B", llama_1b)):
    ax.plot(
        tokens,
        [step_costs(c, t, t)["flops"] / step_costs(c, t, t)["bytes"] for t in tokens],
        label=name,
    )
ax.axhline(
    990 / 4.8, color="k", ls="--", lw=1, label="H200 ridge (990 TFLOP/s / 4.8 TB/s)"
)
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
# The loop at the end of chapter 7 called `forward(ids)` on the whole sequence for every
# new token, so step $n$ did $n$ tokens' work: generating $N$ tokens after a prompt of
# $n_0$ costs $\sum_{n=n_0}^{n_0+N} n \approx N n_0 + N^2/2$ tokens' worth of FLOPs
# instead of $N$. Yet nothing of the past changes from one step to the next: the causal
# mask means a token's keys and values depend only on the tokens before it. So keep
# them. A layer's attention for the new token at position $n$ needs
#
# $$ o_n = \sum_{j \le n} \operatorname{softmax}_j\!\Big(\frac{q_n
#    \cdot k_j}{\sqrt{D}}\Big)\, v_j, $$
#
# the new query against **all** keys and values so far. With $k_j, v_j$ for $j < n$
# stored, a decode step computes $q_n, k_n, v_n$ for one token, appends $k_n, v_n$, and
# attends.
#
# ## The cache layout: slots
#
# Per layer, one array of keys and one of values, each
# `(num_slots, num_kv_heads, head_dim)`. A **slot** is one row: one token's key (or
# value) heads in one layer. Only the key/value heads are stored — with grouped-query
# attention several query heads read the same one (chapter 7), which is exactly why GQA
# exists: Llama 3.2 1B stores 8 heads, not 32. Per token, in bf16:
#
# $$ 2 \,(\text{K and V}) \times L \times H_{kv} \times D \times 2 \text{ bytes}. $$

# %%
#| export
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig

# how each is stored: bf16 as its bits
KV_CACHE_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}


def kv_cache_bytes_per_token(config: ModelConfig, dtype: str = "bfloat16") -> int:
    """Bytes of one token's keys and values in every layer: 2 x layers x KV heads x
    head_dim x itemsize.
    """
    itemsize = np.dtype(KV_CACHE_DTYPES[dtype]).itemsize
    return (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * config.head_dim
        * itemsize
    )


class KVCache:
    """The CPU's cache: keys and values of every layer, k[layer] and v[layer] of shape
    (num_slots, num_kv_heads, head_dim).
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: str = "bfloat16"):
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{dtype!r}"
            )
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.dtype, self.num_slots = dtype, num_slots
        shape = (num_slots, config.num_key_value_heads, config.head_dim)
        # np.zeros maps zeroed pages lazily: memory is committed only where tokens are
        # written
        self.k = [
            np.zeros(shape, KV_CACHE_DTYPES[dtype])
            for _ in range(config.num_hidden_layers)
        ]
        self.v = [
            np.zeros(shape, KV_CACHE_DTYPES[dtype])
            for _ in range(config.num_hidden_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def write(
        self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> None:
        """Store float32 k and v (num_tokens, num_kv_heads, head_dim) at their slots
        (rounded for a bf16 cache).
        """
        if self.dtype == "bfloat16":
            k, v = f32_to_bf16_bits(k), f32_to_bf16_bits(v)
        self.k[layer][slot_mapping] = k
        self.v[layer][slot_mapping] = v

    def read(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values (len(slots), num_kv_heads, head_dim) stored at
        `slots`.
        """
        k, v = self.k[layer][slots], self.v[layer][slots]
        if self.dtype == "bfloat16":
            k, v = bf16_bits_to_f32(k), bf16_bits_to_f32(v)
        return k, v


# %% tags=["hide-input"]
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token

for name, c in (("SmolLM2-135M", smollm2), ("Llama 3.2 1B", llama_1b)):
    per_token = kv_cache_bytes_per_token(c)
    print(
        f"{name:>13}: 2 x {c.num_hidden_layers} layers x {c.num_key_value_heads} KV "
        f"heads x {c.head_dim} x 2 bytes "
        f"= {per_token / 1024:.1f} KiB per token; a full context of 8192 tokens: "
        f"{8192 * per_token / 2**20:.0f} MiB"
    )
assert kv_cache_bytes_per_token(llama_1b) == 2 * 16 * 8 * 64 * 2 == 32 * 1024
prose.glue("ch08_1b_kv", f"{kv_cache_bytes_per_token(llama_1b) // 1024} KiB")
prose.glue(
    "ch08_1b_kv_8k", f"{8192 * kv_cache_bytes_per_token(llama_1b) / 2**20:.0f} MiB"
)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
Llama 3.2 1B needs {{ch08_1b_kv}} per token, {{ch08_1b_kv_8k}} for one sequence of 8192
tokens — small next to its 2.5 GB of weights, but a server holds hundreds of sequences,
and then the cache, not the weights, fills the GPU.
""")

# %% [markdown]
# ## Blocks and the block table
#
# Which slots does a sequence get? The engines of the field answer in **blocks**: the
# slots are grouped into blocks of `block_size` consecutive slots (16 in vLLM), a
# sequence owns a list of blocks — its row of the **block table** — and its position $p$
# lives at
#
# $$ \text{slot}(p) = \text{table}[\lfloor p / B \rfloor] \cdot B + (p \bmod B). $$
#
# How blocks are handed out is an allocator's business, and chapter 10 (paging) writes a
# real one that hands them out one at a time, anywhere in the pool. This chapter uses
# the simplest: row $r$ of at most `max_num_seqs` sequences owns the `max_blocks`
# $= \lceil$`max_model_len`$/B\rceil$ blocks
# $r \cdot \mathtt{max\_blocks}, \dots, (r+1) \cdot \mathtt{max\_blocks} - 1$, laid end
# to end, so that slot$(r, p) = r \cdot \mathtt{max\_blocks} \cdot B + p$. It reserves
# room for the longest sequence in every row — the waste chapter 10 measures — but
# everything downstream already speaks block tables, and will not change when the
# allocator does. Its table is made once; a step reads rows of it and builds nothing
# that grows with the context. It lives in a module of its own, beside the cache rather
# than in it: a scheduler hands out blocks and never touches the GPU, so what it imports
# imports no numba.


# %%
#| export engine.contiguous_allocator
import numpy as np

from tinyvllm_lib.kernels.checks import cdiv


class ContiguousAllocator:
    """Chapter 8's blocks: sequence row r owns blocks r * max_blocks ... (r + 1) *
    max_blocks - 1, laid end to end.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int = 16):
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if block_size & (block_size - 1):
            raise ValueError(
                f"block_size must be a power of two (8, 16, 32, ...), got {block_size}"
            )
        self.max_num_seqs, self.max_model_len, self.block_size = (
            max_num_seqs,
            max_model_len,
            block_size,
        )
        # blocks per row: room for max_model_len tokens
        self.max_blocks = cdiv(max_model_len, block_size)
        self.num_blocks = max_num_seqs * self.max_blocks
        # made once
        self.table = np.arange(self.num_blocks, dtype=np.int32).reshape(
            max_num_seqs, self.max_blocks
        )
        # pop() hands out row 0 first
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_rows(self) -> int:
        return len(self.free_rows)

    def allocate(self) -> int:
        """A free row (its blocks) for a new sequence."""
        if not self.free_rows:
            raise RuntimeError(
                f"all {self.max_num_seqs} cache rows are in use (max_num_seqs)"
            )
        return self.free_rows.pop()

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_num_seqs or row in self.free_rows:
            raise ValueError(f"cache row {row} is not in use")
        self.free_rows.append(row)

    def block_tables(self, rows) -> np.ndarray:
        """The block-table rows (len(rows), max_blocks) int32 of these sequence rows."""
        return self.table[np.asarray(rows, np.int64)]


# %% [markdown]
# With the table, a batch's new tokens need only a few arrays more, and every attention
# implementation from here on — NumPy or kernels, this chapter's or chapter 10's — reads
# the same ones. They are vLLM's **attention metadata**. For a batch of sequences, each
# with some new tokens (a whole prompt, or one token of a decode step) packed back to
# back:
#
# - `query_start_loc`: where each sequence's new tokens begin in the batch,
#   $[0, n_0, n_0+n_1, \dots]$ — chapter 7's flash kernel already takes it;
# - `seq_lens`: each sequence's length *after* this step, cached tokens plus new ones;
#   its new tokens sit at positions
#   $\mathit{seq\_len} - n, \dots, \mathit{seq\_len} - 1$;
# - `block_tables`: each sequence's row of the block table;
# - `slot_mapping`: the slot each new token's key and value are written to;
# - `num_prefills`: the batch's first sequences are prompts (here from position 0;
#   chapter 10 adds prompt chunks that start later), the rest decode one token each —
#   two kinds of attention, and two kernels on the GPU.
#
# They are built once per step, in one vectorised pass over the batch: no Python loop
# over tokens, and nothing whose size grows with a sequence's context.

# %%
#| export layers.attention_metadata
from dataclasses import dataclass, replace

import numpy as np
from numba import cuda


@dataclass(frozen=True)
class AttentionMetadata:
    """What attention needs to know about a batch: where its new K/V go, what each
    sequence attends over.

    The batch's sequences are packed back to back: the first num_prefills are prompts
    (or, from chapter 10, prompt chunks) of any number of new tokens, the rest decode
    one new token each. Arrays are NumPy on the host, device arrays after to_device.
    """

    num_prefills: int
    num_prefill_tokens: int  # new tokens of the prefills: the batch's first rows
    max_query_len: int  # the most new tokens of one sequence
    # (num_seqs + 1,) int32: sequence s is rows query_start_loc[s] .. [s + 1] - 1
    query_start_loc: np.ndarray
    # (num_seqs,) int32: each sequence's length after this step (cached + new)
    seq_lens: np.ndarray
    # (num_tokens,) int64: the slot of each new token's K and V
    slot_mapping: np.ndarray
    block_tables: np.ndarray  # (num_seqs, max_blocks) int32: each sequence's blocks
    block_size: int
    # the most tokens a prefill has before its new ones (earlier chunks, cached
    # prefix): 0 when every prefill starts at position 0
    max_prefill_context_len: int = 0

    def __post_init__(self):
        if isinstance(self.seq_lens, np.ndarray):  # host arrays: check that they agree
            num_seqs, num_tokens = len(self.seq_lens), len(self.slot_mapping)
            if (
                self.query_start_loc.shape != (num_seqs + 1,)
                or self.query_start_loc[-1] != num_tokens
                or len(self.block_tables) != num_seqs
                or not 0 <= self.num_prefills <= num_seqs
                or self.query_start_loc[self.num_prefills] != self.num_prefill_tokens
            ):
                raise ValueError(
                    f"attention metadata disagrees: {num_seqs} sequences "
                    f"({self.num_prefills} prefills, "
                    f"{self.num_prefill_tokens} of their tokens), {num_tokens} "
                    "slots, query_start_loc "
                    f"{self.query_start_loc.tolist()}, {len(self.block_tables)} "
                    "block-table rows"
                )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    def to_device(self, buffers: dict | None = None, stream=0) -> "AttentionMetadata":
        """The same metadata on the GPU: copied into the first rows of `buffers`
        (persistent device arrays named like the fields, nothing allocated), or into new
        device arrays.
        """
        moved = {}
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_tables"):
            host = np.ascontiguousarray(getattr(self, name))
            if buffers is None:
                moved[name] = cuda.to_device(host, stream=stream)
            else:
                moved[name] = buffers[name][: host.shape[0]]
                cuda.to_device(host, to=moved[name], stream=stream)
        return replace(self, **moved)


def build_attention_metadata(
    query_lens, seq_lens, block_tables: np.ndarray, block_size: int, num_prefills: int
) -> tuple[np.ndarray, AttentionMetadata]:
    """(positions of the new tokens, the metadata) of a batch: one vectorised pass, no
    loop over tokens.

    query_lens[s] new tokens of sequence s end its seq_lens[s] tokens; block_tables[s]
    is its row.
    """
    query_lens = np.asarray(query_lens, np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    block_tables = np.asarray(block_tables, np.int32)
    if (
        query_lens.shape != seq_lens.shape
        or np.any(query_lens < 1)
        or np.any(query_lens > seq_lens)
    ):
        raise ValueError(
            "each sequence needs 1 <= new tokens <= its length, got "
            f"{query_lens.tolist()} "
            f"new of {seq_lens.tolist()}"
        )
    if not 0 <= num_prefills <= len(query_lens) or np.any(
        query_lens[num_prefills:] != 1
    ):
        raise ValueError(
            f"the batch's first num_prefills = {num_prefills} sequences are prefills "
            "and the rest decode "
            f"one token each, got new tokens {query_lens.tolist()}"
        )
    if (
        block_tables.ndim != 2
        or len(block_tables) != len(seq_lens)
        or seq_lens.max(initial=0) > block_tables.shape[1] * block_size
    ):
        raise ValueError(
            "block_tables must be (num_seqs, max_blocks) and hold every position, "
            f"got {block_tables.shape} "
            f"for lengths up to {seq_lens.max(initial=0)} in blocks of {block_size}"
        )
    query_start_loc = np.zeros(len(query_lens) + 1, np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    # a decode step: one new token per sequence, at its last position
    if len(query_lens) == num_tokens:
        seq_of_token, positions = np.arange(num_tokens), seq_lens.astype(np.int64) - 1
    else:
        # (num_tokens,)
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        # the position of each sequence's first new token
        first = (seq_lens - query_lens)[seq_of_token]
        positions = (
            first + np.arange(num_tokens) - query_start_loc[seq_of_token]
        ).astype(np.int64)
    blocks = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    metadata = AttentionMetadata(
        num_prefills,
        int(query_start_loc[num_prefills]),
        int(query_lens.max(initial=0)),
        query_start_loc,
        seq_lens,
        slot_mapping,
        block_tables,
        block_size,
        int((seq_lens - query_lens)[:num_prefills].max(initial=0)),
    )
    return positions, metadata


# %% [markdown]
# Two sequences in a cache of 3 rows of 2 blocks of 8 slots (so `max_model_len` 16):
# sequence 0, a prompt of 7 tokens, was prefilled before and has decoded one token
# since; now it decodes its next, at position 8, while sequence 1 starts: its 5 prompt
# tokens are prefilled in the same batch. Prefills come first in a batch, so sequence 1
# is the batch's first. Each square is a slot; the red ones are this step's
# `slot_mapping`.

# %%
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.layers.attention_metadata import build_attention_metadata

demo = ContiguousAllocator(max_num_seqs=3, max_model_len=16, block_size=8)
row0, row1 = demo.allocate(), demo.allocate()
positions, step = build_attention_metadata(
    query_lens=[5, 1],
    seq_lens=[5, 9],
    block_tables=demo.block_tables([row1, row0]),
    block_size=8,
    num_prefills=1,
)
print(
    "positions:",
    positions,
    "| query_start_loc:",
    step.query_start_loc,
    "| slot_mapping:",
    step.slot_mapping,
)
print("block tables:", step.block_tables.tolist())
assert list(step.slot_mapping) == [16, 17, 18, 19, 20, 8] and list(positions) == [
    0,
    1,
    2,
    3,
    4,
    8,
]

fig, ax = new_figure(width=8, height=1.9)
for row in range(3):
    for pos in range(16):
        slot = row * 16 + pos
        is_new, is_cached = slot in step.slot_mapping, row == row0 and pos < 8
        color = "#d62728" if is_new else "#1f77b4" if is_cached else "#eeeeee"
        ax.add_patch(
            plt.Rectangle((pos + (pos >= 8) * 0.3, 2 - row), 0.92, 0.85, color=color)
        )
        ax.text(
            pos + (pos >= 8) * 0.3 + 0.46,
            2 - row + 0.42,
            str(slot),
            ha="center",
            va="center",
            fontsize=7,
            color="white" if is_new or is_cached else "gray",
        )
    ax.text(
        -0.3,
        2 - row + 0.42,
        f"row {row}: blocks {2 * row}, {2 * row + 1}",
        ha="right",
        va="center",
        fontsize=8,
    )
ax.plot([], [], "s", color="#1f77b4", label="cached K/V")
ax.plot([], [], "s", color="#d62728", label="written this step (slot_mapping)")
ax.set_xlim(-4.5, 16.5)
ax.set_ylim(0, 3)
ax.axis("off")
ax.legend(
    loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False, fontsize=8
)
ax.set_title(
    "KV cache slots in blocks of 8: slot = table[p // 8] * 8 + p % 8", fontsize=9
)
plt.show()

# %% [markdown]
# ## Attention over the cache, in NumPy
#
# The layer loop of chapter 7 does not change: it is handed a different attention
# object. This one first **writes** the batch's new keys and values into the cache at
# their slots, then each sequence's new queries attend over the keys and values **read**
# back from its context — the slots of its positions $0 \dots \mathit{seq\_len} - 1$,
# found through its block table. A query at position $p$ sees the keys at positions
# $j \le p$: for a decode step that is all of them; for a prompt it is chapter 7's
# causal mask. Prefill and decode are the same code with different metadata. With
# grouped-query attention the `group = H / H_kv` query heads of one KV head are stacked
# so that one matrix product serves them all:


# %%
#| export kernels.attention
def cached_attention_ref(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """One sequence's new queries q (n, H, D) at `positions` over its context k, v (L,
    KVH, D) of positions 0..L-1 -> (n, H D).
    """
    num_new, num_heads, head_dim = q.shape
    context_len, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    # (KVH, group, n, D)
    q = q.reshape(num_new, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    # (KVH, group, n, L)
    scores = (q @ k.transpose(1, 2, 0)[:, None]) * np.float32(1 / math.sqrt(head_dim))
    # (n, L): key j after query i
    is_future = np.arange(context_len)[None, :] > np.asarray(positions)[:, None]
    if is_future.any():
        scores[:, :, is_future] = -np.inf
    out = softmax_ref(scores) @ v.transpose(1, 0, 2)[:, None]  # (KVH, group, n, D)
    # query head h = kv head * group + g
    return out.transpose(2, 0, 1, 3).reshape(num_new, num_heads * head_dim)


# %%
#| export layers.attention
import numpy as np

from tinyvllm_lib.kernels.attention import cached_attention_ref, split_qkv
from tinyvllm_lib.layers.attention_metadata import AttentionMetadata


def context_slots(
    block_table_row: np.ndarray, seq_len: int, block_size: int
) -> np.ndarray:
    """The slots of positions 0 .. seq_len - 1 of one sequence (int64)."""
    positions = np.arange(seq_len)
    return (
        block_table_row[positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )


class CachedAttention:
    """The NumPy model's attention over a KV cache (engine.kv_cache.KVCache), for one
    step's metadata.

    Called by the layer loop as attention(layer, qkv) -> (T, H D): stores the batch's
    new K/V at their slots, then each sequence's new queries attend over its context
    read back from the cache.
    """

    def __init__(self, config, cache, metadata: AttentionMetadata):
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.cache, self.metadata = cache, metadata
        # each sequence's context slots, once per step (every layer reads the same ones)
        m = metadata
        self.slots = [
            context_slots(m.block_tables[s], int(m.seq_lens[s]), m.block_size)
            for s in range(m.num_seqs)
        ]

    def __call__(self, layer: int, qkv: np.ndarray) -> np.ndarray:
        m = self.metadata
        q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        self.cache.write(layer, m.slot_mapping, k, v)
        # (T, H D)
        out = np.empty((qkv.shape[0], self.num_heads * self.head_dim), np.float32)
        for s, slots in enumerate(self.slots):
            begin, end = int(m.query_start_loc[s]), int(m.query_start_loc[s + 1])
            k_ctx, v_ctx = self.cache.read(layer, slots)  # (seq_len, KVH, D) each
            # the new tokens end the sequence
            positions = np.arange(len(slots) - (end - begin), len(slots))
            out[begin:end] = cached_attention_ref(q[begin:end], k_ctx, v_ctx, positions)
        return out


# %% [markdown]
# ### Test: the cache changes nothing
#
# Prefill SmolLM2 on a chat prompt, then decode a few greedy tokens one at a time
# through the cache, and compare each step's logits with a full forward pass over the
# whole sequence (chapter 7's attention, no cache). They must agree to float32 rounding.
# The helper `step` does what an engine's runner will: build the step's metadata, hand
# the model the attention object, and ask for the logits of the rows that need them.

# %%
from tinyvllm_lib.engine.kv_cache import KVCache
from tinyvllm_lib.layers.attention import CachedAttention

model = LlamaNumpy.from_folder(folder)
question = [{"role": "user", "content": "What is the capital of France?"}]
prompt_ids = tokenizer.apply_chat_template(question, tokenize=True)
alloc = ContiguousAllocator(max_num_seqs=1, max_model_len=256)
cache = KVCache(smollm2, alloc.num_slots, "float32")
row = alloc.allocate()


def step(model, cache, new_ids, seq_len: int) -> np.ndarray:
    """Run one sequence's new tokens (ending at seq_len) through the model over the
    cache; logits of every new row.
    """
    positions, meta = build_attention_metadata(
        [len(new_ids)],
        [seq_len],
        alloc.block_tables([row]),
        alloc.block_size,
        num_prefills=int(len(new_ids) > 1),
    )
    return model.forward(new_ids, positions, CachedAttention(model.config, cache, meta))


n = len(prompt_ids)
logits = step(model, cache, prompt_ids, n)
ids, worst = list(prompt_ids), 0.0
for _ in range(6):
    ids.append(int(np.argmax(logits[-1])))
    logits = step(model, cache, ids[-1:], len(ids))
    full = model.forward(ids)[-1]  # no cache: the whole sequence again
    worst = max(worst, float(np.abs(logits[-1] - full).max()))
print(
    f"{n} prompt tokens -> {tokenizer.decode(ids[n:])!r}; max |cached - full| logits "
    f"= {worst:.1e}"
)
assert worst < 1e-4

# %% [markdown]
# ### A bf16 cache?
#
# On the GPU the cache is bf16, half the bytes of float32. Here the reference stores
# float32, and the reason is measurable: rounding every key and value to bf16 (3
# significant digits) moves SmolLM2's log-probabilities by a few hundredths, far more
# than the $10^{-3}$ by which we check the engine against `transformers` in float32. The
# layout is the same; only the stored type differs.


# %% tags=["hide-input"]
def prompt_log_probs(
    model: LlamaNumpy, kv_dtype: str, token_ids: list[int]
) -> np.ndarray:
    """Log-probs at every prompt position, with the keys and values kept in a cache of
    `kv_dtype`.
    """
    return log_softmax(
        step(
            model,
            KVCache(model.config, alloc.num_slots, kv_dtype),
            token_ids,
            len(token_ids),
        )
    )


bf16_shift = float(
    np.abs(
        prompt_log_probs(model, "bfloat16", prompt_ids)
        - prompt_log_probs(model, "float32", prompt_ids)
    ).max()
)
print(
    f"max |log p (bf16 cache) - log p (float32 cache)| over {n} positions: "
    f"{bf16_shift:.3f}"
)
prose.glue("ch08_bf16_shift", f"{bf16_shift:.2f}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
The largest difference is {{ch08_bf16_shift}} — harmless for generating text, but it
would hide any real bug below it. The GPU's checks compare its bf16 cache with this
float32 reference at a tolerance that allows for it.
""")

# %% [markdown]
# ## How much does the cache save?
#
# A decode step reads every weight once, so it should take about as long as one token of
# prefill would, whatever the context length — while recomputing grows with the
# sequence. Here is a decode step and a full-recompute step at a few lengths, on this
# machine (SmolLM2, NumPy):

# %%
lengths = [16, 64, 128]
timings = {"recompute (no cache)": [], "decode with the cache": []}
for length in lengths:
    ids_t = rng.integers(100, 10_000, length)
    step(model, cache, ids_t[:-1], length - 1)  # the context, cached
    t0 = time.perf_counter()
    step(model, cache, ids_t[-1:], length)
    timings["decode with the cache"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    model.forward(ids_t)
    timings["recompute (no cache)"].append(time.perf_counter() - t0)

fig, ax = new_figure(width=5.5, height=2.8)
for label, seconds in timings.items():
    ax.plot(lengths, np.array(seconds) * 1e3, "o-", label=label)
ax.set_xlabel("tokens in the sequence")
ax.set_ylabel("ms for the next token")
ax.set_title("SmolLM2 on this CPU (NumPy)", fontsize=9)
ax.legend(fontsize=8)
plt.show()
del model, cache

# %% [markdown]
# ## Decoding on the GPU
#
# Everything so far ran on the CPU. On the GPU the layer loop, the block tables and the
# metadata stay; the attention object changes, and behind it two kernels are new: one
# that stores the new tokens' keys and values in a **bf16** cache, and **decode
# attention** — one new query per sequence over its whole past. (Prompts that start at
# position 0 still attend among their own tokens with chapter 7's flash kernel, which
# writes no cache of its own.)
#
# **Decode attention is memory-bound.** For one new query per sequence, a layer reads
# every cached key and value once and does $4 D$ FLOPs per key per query head: with
# grouped-query attention ($G = H / H_{kv}$ query heads per KV head) that is $G$ FLOPs
# per byte of bf16 cache, 4 for Llama 3.2 1B — far below the ridge. So the kernel is
# designed around bytes:
#
# - a block handles **all $G$ query heads** of one KV head, so each K and V row is read
#   once, not $G$ times; the $G$ queries and their accumulators stay in registers;
# - 8 lanes share one key row (head dim 64: 128 bytes): each loads two **8-byte words**
#   (4 bf16 values each), and the 8 lanes read 64 contiguous bytes per load — two whole
#   memory sectors; a warp covers 4 keys at a time, and each lane loads **2 rows before
#   it uses any** — and, while it works on them, **the next step's 2 rows**
#   (`prefetch`): a warp has loads in flight all the time, not only between steps, so
#   enough bytes are in flight to cover the memory's latency;
# - the 8 lanes add their partial dot products with three shuffles, and every key slot
#   of the warp keeps its own **online softmax** (chapter 7): its maximum rarely grows
#   after the first few keys, so the rescaling is a rare branch, not work done per key;
#   at the end the warp's slots, then the block's warps, are merged, each rescaled to
#   the common maximum;
# - **the context is split over several blocks** (flash-decoding): the grid is (KV head,
#   sequence, split), up to 1,024 keys a block, and more splits while the grid has fewer
#   than 512 blocks, so even a few sequences spread over the GPU. Each block writes its
#   partial — unnormalised output, maximum and sum — to a float32 **workspace** the
#   caller made once (`decode_workspace`), then counts itself done with an atomic add;
#   **the last of a sequence's splits to finish combines them all** into the output —
#   float32, or bf16 bits for `o_proj` (chapter 4's `store_activation`) — and sets the
#   count back to zero for the next launch. Each lane of its warps holds one split's
#   maximum and sum, shuffles find the common maximum, and every thread adds up its
#   outputs over the splits with four splits' loads in flight at a time. A sequence that
#   needs one split only is written directly. KV heads are the grid's fastest index, so
#   the blocks that run side by side read whole slots;
# - **the split is decided on the GPU, per sequence**: each block reads its sequence's
#   length and works out how many splits that length wants and which keys are its own.
#   The host fixes only the grid — rows, KV heads and the most splits any length up to
#   `max_context_len` can want — and blocks past their sequence's last split return at
#   once. So nothing the kernel's launch depends on changes from one decode step to the
#   next while the contexts grow: chapter 11 can capture the launch in a CUDA graph once
#   and replay it;
# - **the split counts see the rows rounded up** (`split_rows`: 1, 2, 4, then multiples
#   of 8, chapter 11's graph sizes). The split count sets the order in which float32
#   partial sums are added, so it moves the last bits of the output; a step of 25 rows
#   that chapter 11 pads to a 32-row graph must split each context as the same step
#   run eagerly with 25 rows does, or the replay's log-probabilities drift from the
#   eager ones.
#
# **It is also an instruction budget.** At 4 FLOPs per byte the FMAs alone are a quarter
# of the SM's issue slots at full bandwidth, and every bf16 value costs one more
# instruction to widen; what is left over for address arithmetic, shuffles and the
# softmax is small. The first versions of this kernel — a row at a time per lane, 64-bit
# indexing — reached about a third of the bandwidth ceiling, and Nsight Compute showed
# why: the schedulers were issuing nearly every cycle while DRAM sat mostly idle. What
# brought it up, in order of effect:
#
# - **registers**: with 16 values a lane, the queries and accumulators of 4 heads took
#   128 registers before anything else, the compiler used about 240, and only 8 warps
#   fitted on an SM; 8 values a lane (one more shuffle) leaves room for 2 rows in use
#   and 2 in flight at 127 registers (3 and 3 take 165, and fewer warps fit);
# - **32-bit indices**: Numba widens integer arithmetic to 64 bits, and a 64-bit add or
#   multiply is two or more instructions; signed indices also get a check for negative
#   values. The cache is passed as one flat array of 8-byte words and `cache_word`
#   computes a lane's word in truncated `uint32` steps;
# - **exp2 in one instruction**: the query is pre-scaled by $\log_2 e / \sqrt{D}$, so
#   each exponential is `exp2`, and flush-to-zero (a fastmath *set* that keeps the "no
#   infinities" assumption off, since $-\infty$ marks an empty softmax) makes it a
#   single `MUFU.EX2`;
# - **no branches around loads**: keys past the end reload the last valid row and are
#   masked out of the softmax, instead of skipping the load.
#
# The knobs are fields of a frozen `DecodeAttentionConfig`, passed to the launcher (the
# defaults are the tuned ones); the sweep below moves one of them at a time away from
# the defaults and records each setting's speed (`bench/ch08_decode_tune.py`).
#
# Where position $p$ of sequence $s$ lives comes from the metadata: the kernel takes the
# **block tables** and the block size, slot
# $= \text{table}[s, \lfloor p / B \rfloor] \cdot B + p \bmod B$. $B$ must be a power of
# two (vLLM's are 8, 16 or 32), so the division and the remainder are a shift and a
# mask. This chapter's contiguous rows are blocks of $B = 16$ slots laid end to end;
# chapter 10's paging hands out blocks anywhere, and the kernel does not change. The
# simulator has no warp shuffles, so there the shuffles go through shared memory
# (chapter 4's `shfl_xor`).
#
# **Six modules, one concept each.** The code below is exported to six small modules of
# `tinyvllm_lib/kernels/`, so that each reads as one idea and a later chapter imports
# only the idea it needs: `decode_attention_config` holds the knobs;
# `kv_cache_write` stores the new tokens' keys and values (with its NumPy reference);
# `paged_cache` is how a kernel reads a cache of blocks — 8-byte words found through the
# block table — with the checks of a paged context's arguments, which chapter 10's
# paged prefill shares; `decode_splits` is the split policy and the workspace;
# `decode_attention_kernel` builds the kernel; and `decode_attention` holds the NumPy
# reference and the launcher.

# %%
#| export kernels.decode_attention_config
from dataclasses import dataclass, replace

from numba import config

from tinyvllm_lib.kernels.reduce import WARP_SIZE

# the simulator runs each thread in Python: one warp a block there
DECODE_WARPS = 1 if config.ENABLE_CUDASIM else 4
FEW_ROWS_WARPS = 1 if config.ENABLE_CUDASIM else 8


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """The decode attention kernel's knobs. The defaults were chosen from
    bench/ch08_decode_tune.py's sweep on an H200 (plotted below); the first four (and
    early_loads, prefetch) are compiled into the kernel, the rest shape its grid.
    for_rows swaps in the few-rows knobs, which chapter 11 chose for batch 1.
    """

    # bf16 values of a key row per lane (two 8-byte words): head_dim 64 is 8 lanes a key
    lane_elements: int = 8
    keys_per_lane: int = 2  # rows each lane loads before it uses any (bytes in flight)
    # warps per block: they share the block's part of the context
    num_warps: int = DECODE_WARPS
    # a cap on registers per thread (more warps per SM), or None
    max_registers: int | None = None
    # keys per block when a context is split over several blocks (flash-decoding)
    split_keys: int = 1024
    # never fewer keys per split than this (then rounded up to a block's step)
    min_split_keys: int = 8
    # split further while the grid has fewer blocks than this (a few per SM)
    target_blocks: int = 512
    # the most splits a workspace holds: at most 32, a lane each when they are combined
    max_splits: int = 32
    # Up to few_rows rows (batch 1's steps), there is no grid to fill: a block has
    # few_rows_warps warps of few_rows_keys_per_lane rows a lane, and a context is split
    # only past few_rows_split_keys keys (chapter 11 measures them at one row)
    few_rows: int = 1
    few_rows_warps: int = FEW_ROWS_WARPS
    few_rows_keys_per_lane: int = 3
    few_rows_split_keys: int = 384
    # load the context length, the block table and the first step's keys and values
    # (all but the newest token's) before waiting for the kernel before (chapter 1's
    # programmatic edges); on for few rows only: with a full grid the blocks that
    # started early took the SMs from the kernel before (chapter 11 measured both)
    early_loads: bool = False
    # load the next step's keys and values while this step's are used: loads stay in
    # flight through the arithmetic, in registers for twice the rows
    prefetch: bool = True

    def __post_init__(self):
        if not isinstance(self.few_rows, int) or self.few_rows < 0:
            raise ValueError(
                "DecodeAttentionConfig.few_rows must be a non-negative integer, got "
                f"{self.few_rows!r}"
            )
        for name in (
            "lane_elements",
            "keys_per_lane",
            "num_warps",
            "split_keys",
            "min_split_keys",
            "target_blocks",
            "max_splits",
            "few_rows_warps",
            "few_rows_keys_per_lane",
            "few_rows_split_keys",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"DecodeAttentionConfig.{name} must be a positive integer, got "
                    f"{value!r}"
                )
        if self.max_splits > WARP_SIZE:
            raise ValueError(
                f"DecodeAttentionConfig.max_splits must be at most {WARP_SIZE}, got "
                f"{self.max_splits}"
            )
        if self.max_registers is not None and (
            not isinstance(self.max_registers, int) or self.max_registers < 32
        ):
            raise ValueError(
                "DecodeAttentionConfig.max_registers must be None or at least 32, "
                f"got {self.max_registers!r}"
            )

    def for_rows(self, rows: int) -> "DecodeAttentionConfig":
        """The knobs a launch of `rows` rows uses: these, or up to few_rows rows the
        few-rows ones.
        """
        if rows > self.few_rows:
            return self
        return replace(
            self,
            num_warps=self.few_rows_warps,
            keys_per_lane=self.few_rows_keys_per_lane,
            split_keys=self.few_rows_split_keys,
            target_blocks=1,
            few_rows=0,
            early_loads=True,
        )


DEFAULT_DECODE_CONFIG = DecodeAttentionConfig()


# %%
#| export kernels.decode_attention
import math

import numpy as np

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32


def decode_attention_ref(
    qkv,
    k_cache,
    v_cache,
    block_tables,
    block_size,
    context_lens,
    num_heads,
    num_kv_heads,
    head_dim,
):
    """Float64 reference: row s of qkv (its query) over positions 0..context_lens[s]-1
    of the bf16 cache -> (rows, H D).
    """
    H, KVH, D = num_heads, num_kv_heads, head_dim
    q = qkv[:, : H * D].astype(np.float64).reshape(len(qkv), KVH, H // KVH, D)
    out = np.zeros((len(qkv), H * D))
    for s, n in enumerate(np.asarray(context_lens)):
        pos = np.arange(n)
        slots = (
            np.asarray(block_tables)[s, pos // block_size].astype(np.int64) * block_size
            + pos % block_size
        )
        k = bf16_bits_to_f32(k_cache[slots]).astype(np.float64)  # (n, KVH, D)
        v = bf16_bits_to_f32(v_cache[slots]).astype(np.float64)
        scores = np.einsum("hgd,nhd->hgn", q[s], k) / math.sqrt(D)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[s] = (np.einsum("hgn,nhd->hgd", p, v) / p.sum(-1, keepdims=True)).reshape(
            -1
        )
    return out


# %%
#| export kernels.kv_cache_write
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.attention import check_qkv
from tinyvllm_lib.kernels.bf16 import f32_to_bf16, f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


def write_kv_cache_ref(
    qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache
) -> None:
    """Round the new tokens' k and v (after RoPE) to bf16 and store them at their slots
    (negative slots: skipped).
    """
    num_tokens, KVH = qkv.shape[0], num_kv_heads
    D = qkv.shape[1] // (num_heads + 2 * KVH)
    keep = np.asarray(slot_mapping) >= 0
    k = qkv[:, num_heads * D : (num_heads + KVH) * D].reshape(num_tokens, KVH, D)
    v = qkv[:, (num_heads + KVH) * D :].reshape(num_tokens, KVH, D)
    k_cache[np.asarray(slot_mapping)[keep]] = f32_to_bf16_bits(k[keep])
    v_cache[np.asarray(slot_mapping)[keep]] = f32_to_bf16_bits(v[keep])


@cuda.jit
def write_kv_cache_kernel(qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache):
    """One thread per (token, element of the KV heads): round k and v to bf16, store at
    the token's slot.
    """
    wait_for_previous_kernel()
    head_dim = k_cache.shape[2]
    width = num_kv_heads * head_dim
    i = cuda.grid(1)
    token, e = i // width, i % width
    if token < qkv.shape[0]:
        slot = slot_mapping[token]
        if slot >= 0:  # -1: a padding row (a batch padded to a captured size)
            h, d = e // head_dim, e % head_dim
            k_cache[slot, h, d] = f32_to_bf16(qkv[token, num_heads * head_dim + e])
            v_cache[slot, h, d] = f32_to_bf16(
                qkv[token, (num_heads + num_kv_heads) * head_dim + e]
            )


PTX_SIGNATURES = {
    "write_kv_cache_kernel": [
        f"void(float32[:, ::1], int64, int64, {idx}[::1], uint16[:, :, ::1], "
        "uint16[:, :, ::1])"
        for idx in ("int32", "int64")
    ],
}


# %% [markdown]
# The kernel reads the cache as 8-byte words and finds a key's words through the block
# table (`cache_word`, in 32-bit steps); `bf16_lane` widens one of a word's four bf16
# values. Chapter 10's paged prefill reads the cache the same way, so both go to
# `paged_cache`.

# %%
#| export kernels.paged_cache
import numpy as np
from numba import cuda, uint32, uint64

from tinyvllm_lib.kernels.bf16 import bf16_to_f32
from tinyvllm_lib.kernels.checks import cdiv


@cuda.jit(device=True)
def bf16_lane(word, e):
    """Element e (0..3) of an 8-byte word holding four bf16 values (the lowest address
    in the lowest bits).
    """
    # bf16_to_f32 keeps the low 16 bits: one shift or mask
    return bf16_to_f32(uint32(word >> uint64(16 * e)))


@cuda.jit(device=True)
def cache_word(
    bt_row, key, block_shift, block_mask, num_kv_heads, kvh, words_per_row, sub
):
    """Index of lane `sub`'s first 8-byte word of position `key` in the cache viewed as
    words: 32-bit arithmetic.

    Numba widens integer arithmetic to 64 bits; truncating every step to uint32 lets the
    compiler use 32-bit instructions (a 64-bit add or multiply costs two or more), and
    unsigned indices skip the check for negative indices.
    """
    slot = uint32(uint32(bt_row[key >> block_shift]) << block_shift) | uint32(
        key & block_mask
    )
    return (
        uint32(uint32(uint32(slot * num_kv_heads) + kvh) * uint32(words_per_row)) + sub
    )


# %% [markdown]
# **The split policy, written once.** The host needs it to size the grid (the most
# splits any length may want), and every block needs it at its start to find its own
# sequence's split. Numba cannot call a device function from the host, and the host
# cannot run the kernel's version as it is: there every integer step is truncated to
# 32 bits (Numba's 64-bit integer divisions there cost about a tenth of the kernel's
# time, measured), and numba's `uint32` is slow to call in plain Python (about a
# microsecond a cast, tens of microseconds a launch). So `split_policy` writes the
# three functions once, with the integer cast as a parameter: Python's `int` gives the
# host's versions, numba's `uint32` the kernel's, compiled as device functions. The
# tests check the two against each other.

# %%
#| export kernels.decode_splits
from numba import cuda, uint32


def split_policy(u32):
    """The split policy's functions (num_splits_for, split_rows, split_length), every
    integer step cast by u32: int on the host, numba's uint32 on the GPU.
    """

    def num_splits_for(
        n, max_splits, num_row_blocks, split_keys, target_blocks, min_split_keys
    ):
        """How many blocks share a context of n keys: about split_keys keys a block,
        more while the grid's num_row_blocks = rows x KV heads is small; at most
        max_splits, at least min_split_keys keys each. It never falls as n grows, so
        the grid's split axis is this for the longest context.
        """
        one = u32(1)
        want = max(
            u32(u32(n + split_keys - one) // split_keys),
            u32(u32(target_blocks + num_row_blocks - one) // num_row_blocks),
        )
        return max(
            one,
            min(max_splits, want, u32(u32(n + min_split_keys - one) // min_split_keys)),
        )

    def split_rows(rows):
        """The row count a launch's splits are chosen for: rows rounded up to 1, 2, 4
        or a multiple of 8 (chapter 11's CUDA graph sizes). A step padded to a graph's
        size then splits every context as the same step unpadded does, and the split
        count decides the order of the float32 sums, so their last bits.
        """
        if rows <= u32(2):
            return max(rows, u32(1))
        if rows <= u32(4):
            return u32(4)
        return u32(u32(u32(rows + u32(7)) // u32(8)) * u32(8))

    def split_length(n, num_splits, step):
        """Keys per split of a context of n keys in num_splits splits: a multiple of
        step (a block's keys per step).
        """
        one = u32(1)
        per_split = u32(u32(n + num_splits - one) // num_splits)
        return max(step, u32(u32(u32(per_split + step - one) // step) * step))

    return num_splits_for, split_rows, split_length


# on the host: Python's integers
num_splits_for, split_rows, split_length = split_policy(int)
# in the kernel: the same steps in 32 bits, as device functions
num_splits_for_on_device, split_rows_on_device, split_length_on_device = (
    cuda.jit(device=True)(f) for f in split_policy(uint32)
)


# %% [markdown]
# The end of a block's work — write the output, or the split's partial and, in the last
# split to finish, the combine — is a device function of its own (chapter 14's decode
# kernel on the tensor cores ends the same way); it goes to `decode_combine`.

# %%
#| export kernels.decode_combine
import math

from numba import config, cuda, float32, int32, uint32

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.reduce import WARP_SIZE, shfl_xor

# device functions inlined into the kernel (the simulator has no such option)
INLINE = {} if config.ENABLE_CUDASIM else {"forceinline": True}
# splits whose partials each thread loads at once when the last split combines them
COMBINE_LOADS = 4


def split_finish(head_dim: int, group: int, num_warps: int):
    """The end of a decode attention block, as a device function: num[j] and den[j] are
    the unnormalised output and the softmax sum of output tid + j * threads (of the
    block's group x head_dim), relative to sm_block_top (each query head's maximum, in
    base 2). A block with the whole context writes out; a split writes its partial to
    the workspace, and the last split of (row, KV head) to finish combines them all.
    Chapter 14's tensor-core decode kernel ends with the same function."""
    D, G, W = head_dim, group, num_warps
    GD = G * D
    PER_THREAD = cdiv(GD, W * WARP_SIZE)
    COMBINED = PER_THREAD * COMBINE_LOADS  # partials a thread holds while combining

    @cuda.jit(device=True, **INLINE)
    def finish(num, den, sm_block_top, workspace, out, s, split, kvh, n, split_len,
               is_whole, scratch):
        tid = uint32(cuda.threadIdx.x)
        warp, lane = tid // uint32(WARP_SIZE), tid % uint32(WARP_SIZE)
        # the combine's: is this the last split to finish; each split's weight per head
        sm_last = cuda.shared.array(1, int32)
        sm_weight = cuda.shared.array((WARP_SIZE, G), float32)
        for j in range(PER_THREAD):
            t = tid + j * W * WARP_SIZE
            if t < GD:
                g, d = t // D, t % D
                h = kvh * G + g
                if is_whole:  # the whole context in one block: the final output
                    store_activation(
                        out,
                        s,
                        h * D + d,
                        num[j] / den[j] if den[j] > 0 else float32(0.0),
                    )
                # this split's partial: unnormalised output, then its maximum (base 2)
                # and sum
                else:
                    workspace[s, split, h, d] = num[j]
                    if d == 0:
                        workspace[s, split, h, D] = sm_block_top[g]
                        workspace[s, split, h, D + 1] = den[j]
        if is_whole:
            return
        # the last of the sequence's splits to finish combines them all (no second
        # kernel): each block makes its partial visible, then counts itself done
        cuda.threadfence()
        cuda.syncthreads()
        used = uint32(uint32(n + split_len - uint32(1)) // split_len)
        # the count of (s, KV head): the padding after split 0's first head's sum
        counter = (s, uint32(0), kvh * uint32(G), uint32(D + 2))
        if tid == 0:
            done = cuda.atomic.add(workspace, counter, float32(1.0))
            is_last = uint32(done) == used - uint32(1)
            sm_last[0] = 1 if is_last else 0
            if is_last:  # back to zero for the next launch
                workspace[counter] = float32(0.0)
        cuda.syncthreads()
        if sm_last[0] == 0:
            return
        cuda.threadfence()  # the other splits' partials, as they wrote them
        # lane j holds split j's maximum and sum, per query head; every warp works out
        # the weights (the simulator's shuffles need the whole block), warp 0 keeps them
        for g in range(G):
            h = kvh * uint32(G) + uint32(g)
            jl = min(lane, used - uint32(1))  # lanes past the last split reload it
            mj = workspace[s, jl, h, D] if lane < used else -math.inf
            lj = workspace[s, jl, h, D + 1] if lane < used else float32(0.0)
            top = mj
            for r in range(5):  # lane masks 1, 2, 4, 8, 16
                top = max(top, shfl_xor(top, 1 << r, scratch))
            f = math.exp2(mj - top) if mj > -math.inf else float32(0.0)
            total = f * lj
            for r in range(5):
                total += shfl_xor(total, 1 << r, scratch)
            if warp == 0:
                sm_weight[lane, g] = f / total if total > 0 else float32(0.0)
        cuda.syncthreads()
        # out = the splits' partials, each weighted: COMBINE_LOADS splits' loads in
        # flight at a time
        for j in range(PER_THREAD):
            num[j] = float32(0.0)
        vals = cuda.local.array(COMBINED, float32)
        for j0 in range(uint32(0), used, uint32(COMBINE_LOADS)):
            for u in range(COMBINE_LOADS):
                jj = min(j0 + uint32(u), used - uint32(1))
                for j in range(PER_THREAD):
                    t = min(tid + uint32(j * W * WARP_SIZE), uint32(GD - 1))
                    vals[u * PER_THREAD + j] = workspace[
                        s, jj, kvh * uint32(G) + t // uint32(D), t % uint32(D)
                    ]
            for u in range(COMBINE_LOADS):
                jj = j0 + uint32(u)
                for j in range(PER_THREAD):
                    t = tid + uint32(j * W * WARP_SIZE)
                    if jj < used and t < GD:
                        num[j] += (
                            sm_weight[jj, t // uint32(D)] * vals[u * PER_THREAD + j]
                        )
        for j in range(PER_THREAD):
            t = tid + uint32(j * W * WARP_SIZE)
            if t < GD:
                store_activation(out, s, kvh * uint32(GD) + t, num[j])

    return finish


# %% [markdown]
# **RoPE and the newest K/V inside attention.** At decode, a layer launches the RoPE
# and KV write of the next section (`rope_and_write_kv_cache`) and then this kernel:
# two launches, the second waiting for the first to finish, for a few kilobytes of
# work. The attention kernel can do both itself. Every block rotates its query heads
# as it loads them; the one block whose split holds the newest key (key n − 1) also
# rotates that token's key, stores its K and V words at the token's slot, and waits
# at a barrier before any of its warps reads the cache. No other block reads the
# newest key: every other split ends before it, and the loads issued before the wait
# (`load_older`) leave it out. The three device functions below go to
# `decode_rope`: a position's angle, one rotated value, and the store of the newest
# row, each thread a word of it at a time. Chapter 10 hands a step's RoPE to the
# kernel only where its `FUSE_DECODE_ROPE` says so, and it is off: at batch 1 the
# kernel grew by about the launch it saved (chapter 15 has the measurement).

# %%
#| export kernels.decode_rope
from numba import cuda, uint32, uint64

from tinyvllm_lib.kernels.bf16 import f32_to_bf16
from tinyvllm_lib.kernels.decode_combine import INLINE
from tinyvllm_lib.kernels.kv_cache_write import check_slot_mapping
from tinyvllm_lib.kernels.rope import NAN32, check_rope_args

# 1: the position and angles loaded after the kernel's wait (two round trips in a
# row: the position, then its angles); 2: before it, with the block tables, and the
# newest row's store placed after the queries' loads (benches record which version
# they ran)
DECODE_ROPE_VERSION = 2


@cuda.jit(device=True, **INLINE)
def rope_angle(pos, cos, sin, i):
    """cos and sin of position pos at pair i; NaN outside the table (poison, never an
    out-of-bounds read)."""
    if pos >= 0 and pos < cos.shape[0]:
        return cos[pos, i], sin[pos, i]
    return NAN32, NAN32


@cuda.jit(device=True, **INLINE)
def rotated(x, partner, c, s, upper):
    """Element d of a head after RoPE, from x (its value) and partner (the value at
    d + D/2, or d - D/2 for upper, d in the second half): chapter 5's rotation."""
    if upper:
        return x * c + partner * s
    return x * c - partner * s


def make_newest_kv_writer(head_dim: int, threads: int):
    """A device function run by every thread of a block: rotate row s's key head kvh
    by position pos and store it and its value head as bf16 words at `slot` (skipped
    for a negative slot, a padding row). The caches are flat 8-byte words; each
    thread stores words tid, tid + threads, ..., so a block of any size stores all
    D/4. The position and slot come as values, loaded before the kernel's wait: after
    it, the row's values and their angles are loaded together, one round trip.
    """
    D, HALF, WPR = head_dim, head_dim // 2, head_dim // 4

    @cuda.jit(device=True, **INLINE)
    def write_newest(qkv, pos, cos, sin, slot, s, kvh, num_heads, num_kv_heads,
                     k_cache, v_cache, tid):
        if slot < 0:
            return
        k_at = (uint32(num_heads) + kvh) * uint32(D)
        v_at = (uint32(num_heads) + num_kv_heads + kvh) * uint32(D)
        base = (uint64(slot) * uint64(num_kv_heads) + uint64(kvh)) * uint64(WPR)
        for w in range(tid, uint32(WPR), uint32(threads)):
            kword, vword = uint64(0), uint64(0)
            for e in range(4):
                d = uint32(4) * w + uint32(e)
                upper = d >= uint32(HALF)
                i = d - uint32(HALF) if upper else d
                partner = i if upper else d + uint32(HALF)
                c, sn = rope_angle(pos, cos, sin, i)
                k = rotated(qkv[s, k_at + d], qkv[s, k_at + partner], c, sn, upper)
                shift = uint64(16 * e)
                kword |= uint64(f32_to_bf16(k)) << shift
                vword |= uint64(f32_to_bf16(qkv[s, v_at + d])) << shift
            k_cache[base + uint64(w)] = kword
            v_cache[base + uint64(w)] = vword

    return write_newest


def fused_rope_args(name: str, rope, slot_mapping, qkv, context_lens, num_heads: int,
                    num_kv_heads: int, head_dim: int):
    """The four arguments a decode kernel takes for fuse_rope, and whether it fuses:
    rope = (table, positions) with slot_mapping, both for one token a row, checked as
    chapter 5's rotation and this chapter's write check theirs; with neither,
    placeholders the kernel never reads (the context lengths, qkv).
    """
    if rope is None and slot_mapping is None:
        return (context_lens, qkv, qkv, context_lens), False
    if rope is None or slot_mapping is None:
        raise ValueError(f"{name}: rope and slot_mapping go together (RoPE and the "
                         f"newest K/V store inside attention), got one of them")
    table, positions = rope
    if table.head_dim != head_dim:
        raise ValueError(f"{name}: the RoPE table is for head_dim {table.head_dim}, "
                         f"the heads have {head_dim}")
    check_rope_args(qkv, positions, table, num_heads, num_kv_heads, name)
    check_slot_mapping(name, slot_mapping, qkv.shape[0])
    return (positions, table.cos, table.sin, slot_mapping), True


# %% [markdown]
# The kernel factory builds one kernel per head size, group and compile-time knob, and
# keeps the few the models use ready for the PTX check; it goes to
# `decode_attention_kernel`.

# %%
#| export kernels.decode_attention_kernel
import math

from numba import config, cuda, float32, uint32, uint64

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.decode_combine import INLINE, split_finish
from tinyvllm_lib.kernels.decode_rope import make_newest_kv_writer, rope_angle, rotated
from tinyvllm_lib.kernels.decode_splits import (
    num_splits_for_on_device,
    split_length_on_device,
    split_rows_on_device,
)
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.paged_cache import bf16_lane, cache_word
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, shfl_xor

# exp(x) = exp2(x log2 e): scores are kept in base 2, so each exponential is one exp2
LOG2_E = 1.4426950408889634


def lanes_per_key(head_dim: int, lane_elements: int = 8) -> int:
    """Lanes that share one key row: about lane_elements values each, a power of two
    that splits its words evenly.
    """
    lanes = 1
    while (
        2 * lanes * lane_elements <= head_dim
        and (head_dim // 4) % (2 * lanes) == 0
        and 2 * lanes <= WARP_SIZE
    ):
        lanes *= 2
    return lanes


def make_decode_attention_kernel(
    head_dim: int,
    group: int,
    num_warps: int,
    keys_per_lane: int,
    lane_elements: int,
    max_registers: int | None,
    early_loads: bool = False,
    prefetch: bool = False,
    fuse_rope: bool = False,
):
    """A block per (KV head, sequence, split of the context), all `group` query heads of
    it; L lanes per key. early_loads: load the first step's keys and values before
    waiting for the kernel before; prefetch: load the next step's while this step's are
    used (DecodeAttentionConfig). fuse_rope: q and k arrive unrotated; each block
    rotates its query heads as it loads them, and the block holding the newest key
    rotates it and stores its K and V at slot_mapping[s] before reading the cache
    (positions, rope_cos, rope_sin and slot_mapping are read before the wait, with the
    block tables).
    """
    D, G, W, L, C = (
        head_dim,
        group,
        num_warps,
        lanes_per_key(head_dim, lane_elements),
        keys_per_lane,
    )
    # flush-to-zero and fast division: exp2 becomes one MUFU.EX2 instruction. The set
    # keeps LLVM's
    # "no infinities" assumption off (fastmath=True would allow it), since -inf marks
    # "no key yet".
    options = {"fastmath": {"contract", "afn"}}
    if max_registers and not config.ENABLE_CUDASIM:
        options["max_registers"] = max_registers
    WPL = D // 4 // L  # 8-byte words per lane per row: 2 for head_dim 64
    EPL = 4 * WPL  # elements per lane per row: 8
    # query (and accumulator) values per lane; words of its rows; scores
    QN, CW, CG = G * EPL, C * WPL, C * G
    KPW = WARP_SIZE // L  # keys per warp at a time: 4 for head_dim 64
    # shuffle rounds: L lanes of a key, a warp's KPW keys
    LOG_L, LOG_KPW = L.bit_length() - 1, KPW.bit_length() - 1
    GD = G * D  # outputs of a block
    # 8-byte words per row; keys a block covers per step
    WPR, STEP = D // 4, W * KPW * C
    PER_THREAD = cdiv(GD, W * WARP_SIZE)  # outputs each thread adds up at the end
    finish = split_finish(D, G, W)  # the block's output or its split's partial
    write_newest = make_newest_kv_writer(D, W * WARP_SIZE)  # fuse_rope's store
    HALF = D // 2

    def rows_loader(which: str):
        """A device function that loads this lane's C rows of a step, keys first,
        first + KPW, ... (past the end, the last key again: masked when used), into kw
        and vw: every one ("all"), or only those before the newest key ("older") or
        from it on ("newest"), decided when the kernel is compiled.
        """
        check, older = which != "all", which == "older"

        @cuda.jit(device=True, **INLINE)
        def load_rows(
            kw, vw, k_cache, v_cache, bt_row, block_shift, num_kv_heads, kvh, sub,
            first, end, newest,
        ):
            block_mask = (uint32(1) << block_shift) - uint32(1)
            for c in range(C):
                key = min(uint32(first + uint32(c * KPW)), end - uint32(1))
                if not check or (key < newest) == older:
                    word = cache_word(
                        bt_row, key, block_shift, block_mask, num_kv_heads, kvh, WPR,
                        sub,
                    )
                    for i in range(WPL):
                        kw[c * WPL + i] = k_cache[word + uint32(L * i)]
                        vw[c * WPL + i] = v_cache[word + uint32(L * i)]

        return load_rows

    load_all, load_older, load_newest = (
        rows_loader(which) for which in ("all", "older", "newest")
    )

    @cuda.jit(**options)
    def kernel(
        qkv,
        k_cache,
        v_cache,
        block_tables,
        block_shift,
        context_lens,
        positions,
        rope_cos,
        rope_sin,
        slot_mapping,
        qscale,
        split_keys,
        min_split_keys,
        target_blocks,
        workspace,
        out,
    ):
        # fuse_rope reads the step's positions, slots and RoPE table before the wait:
        # the step's inputs, copied before its first kernel, as the block tables are
        if not early_loads and not fuse_rope:
            wait_for_previous_kernel()
        # indices are unsigned 32-bit: no negative-index wraparound, no 64-bit
        # multiplies in the address arithmetic
        # KV heads side by side
        kvh, s, split = (
            uint32(cuda.blockIdx.x),
            uint32(cuda.blockIdx.y),
            uint32(cuda.blockIdx.z),
        )
        num_kv_heads = uint32(cuda.gridDim.x)
        n = uint32(context_lens[s])
        # this sequence's own split, from its length: the grid holds the most splits any
        # length may want
        num_splits = num_splits_for_on_device(
            n,
            uint32(cuda.gridDim.z),
            uint32(cuda.gridDim.x) * split_rows_on_device(uint32(cuda.gridDim.y)),
            uint32(split_keys),
            uint32(target_blocks),
            uint32(min_split_keys),
        )
        split_len = split_length_on_device(n, num_splits, uint32(STEP))
        begin = uint32(split * split_len)
        # past this sequence's last split: nothing to do, and the combine reads nothing
        # here
        if split > 0 and begin >= n:
            return
        end = min(n, uint32(begin + split_len))
        # this block has the whole context: it writes the final output
        is_whole = end >= n and split == 0
        tid = uint32(cuda.threadIdx.x)
        warp, lane = tid // uint32(WARP_SIZE), tid % uint32(WARP_SIZE)
        # which of the warp's KPW keys, which part of its row
        key_in_warp, sub = lane // uint32(L), lane % uint32(L)
        bt_row = block_tables[s]  # this sequence's blocks
        q_row = qkv[s]
        # the simulator's shuffles
        scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
        # each warp's maximum score per query head
        sm_top = cuda.shared.array((W, G), float32)
        sm_block_top = cuda.shared.array(G, float32)
        # one warp's KPW partial outputs at a time
        sm_acc = cuda.shared.array((KPW, GD), float32)
        sm_l = cuda.shared.array((KPW, G), float32)
        # every index below is a constant: registers, not local memory
        q = cuda.local.array(QN, float32)
        acc = cuda.local.array(QN, float32)
        m = cuda.local.array(G, float32)
        ell = cuda.local.array(G, float32)
        kw = cuda.local.array(CW, uint64)
        vw = cuda.local.array(CW, uint64)
        # the scores of this step's C keys, for each query head
        x = cuda.local.array(CG, float32)
        # the next step's rows, loaded while this step's are used (prefetch)
        kn = cuda.local.array(CW, uint64)
        vn = cuda.local.array(CW, uint64)
        # With early_loads, before waiting for the kernel before this one (chapter 1's
        # programmatic graph edges): the loads of what no kernel of the step writes —
        # the context length and block table above, the first step's keys and values
        # but the newest token's, which the KV write just before this kernel stores
        newest = n - uint32(1)
        # this lane's keys in the block's first step: first, first + KPW, ...
        first = uint32(begin + warp * uint32(KPW * C) + key_in_warp)
        if early_loads and begin < end:
            load_older(kw, vw, k_cache, v_cache, bt_row, block_shift, num_kv_heads,
                       kvh, sub, first, end, newest)
        # fuse_rope: this lane's angles (the same for every query head of the
        # group), its row's position and slot, before the wait
        cq = cuda.local.array(EPL, float32)
        sq = cuda.local.array(EPL, float32)
        pos = positions[s] if fuse_rope else 0
        slot = slot_mapping[s] if fuse_rope else -1
        if fuse_rope:
            for i in range(WPL):
                for e in range(4):
                    d = uint32(4) * (sub + uint32(L * i)) + uint32(e)
                    cq[4 * i + e], sq[4 * i + e] = rope_angle(
                        pos, rope_cos, rope_sin, d % uint32(HALF)
                    )
        if early_loads or fuse_rope:
            wait_for_previous_kernel()
        for g in range(G):
            m[g] = -math.inf
            ell[g] = float32(0.0)
            head = (kvh * uint32(G) + uint32(g)) * uint32(D)
            for i in range(WPL):
                for e in range(4):
                    d = uint32(4) * (sub + uint32(L * i)) + uint32(e)
                    qd = q_row[head + d]
                    if fuse_rope:  # chapter 5's rotation, as the value is loaded
                        upper = d >= uint32(HALF)
                        other = d - uint32(HALF) if upper else d + uint32(HALF)
                        qd = rotated(qd, q_row[head + other], cq[4 * i + e],
                                     sq[4 * i + e], upper)
                    q[g * EPL + 4 * i + e] = qd * qscale
                    acc[g * EPL + 4 * i + e] = float32(0.0)
        # the block holding the newest key stores it, after the queries' loads are
        # issued (whether the compiler overlaps the two, no profile has shown)
        if fuse_rope and end == n and n > 0:
            write_newest(qkv, pos, rope_cos, rope_sin, slot, s, kvh,
                         num_kv_heads * uint32(G), num_kv_heads, k_cache, v_cache, tid)
            cuda.syncthreads()  # the stores, before any warp reads the cache
        # the first step's rows (those the wait held back)
        if prefetch and early_loads and begin < end:
            load_newest(kw, vw, k_cache, v_cache, bt_row, block_shift, num_kv_heads,
                        kvh, sub, first, end, newest)
        elif prefetch and begin < end:
            load_all(kw, vw, k_cache, v_cache, bt_row, block_shift, num_kv_heads, kvh,
                     sub, first, end, newest)
        # the same steps in every warp: the simulator's shuffles need the block
        for base in range(begin, end, uint32(STEP)):
            first = uint32(base + warp * uint32(KPW * C) + key_in_warp)
            if prefetch:  # the next step's rows, in flight while this step's are used
                if base + uint32(STEP) < end:
                    load_all(kn, vn, k_cache, v_cache, bt_row, block_shift,
                             num_kv_heads, kvh, sub, first + uint32(STEP), end, newest)
            elif early_loads and base == begin:  # the rest were loaded before the wait
                load_newest(kw, vw, k_cache, v_cache, bt_row, block_shift, num_kv_heads,
                            kvh, sub, first, end, newest)
            else:  # all C rows' loads issued before any is used
                load_all(kw, vw, k_cache, v_cache, bt_row, block_shift, num_kv_heads,
                         kvh, sub, first, end, newest)
            # scores: each lane's part of the dot products, then the L lanes of a key
            # add them
            for c in range(C):
                for g in range(G):
                    dot = float32(0.0)
                    for i in range(WPL):
                        for e in range(4):
                            dot += q[g * EPL + 4 * i + e] * bf16_lane(
                                kw[c * WPL + i], e
                            )
                    for r in range(LOG_L):  # lane masks 1, 2, ..., L / 2
                        dot += shfl_xor(dot, 1 << r, scratch)
                    x[c * G + g] = dot if first + uint32(c * KPW) < end else -math.inf
            # each key slot of the warp keeps its own online softmax: no warp-wide
            # maximum
            for g in range(G):
                top = m[g]
                for c in range(C):
                    top = max(top, x[c * G + g])
                # the running maximum grew: rescale what was summed so far (rare after a
                # few keys)
                if top > m[g]:
                    alpha = math.exp2(m[g] - top)
                    ell[g] *= alpha
                    for j in range(EPL):
                        acc[g * EPL + j] *= alpha
                    m[g] = top
            for c in range(C):  # add each key's value row, weighted by its exponential
                for g in range(G):
                    p = (
                        math.exp2(x[c * G + g] - m[g])
                        if first + uint32(c * KPW) < end
                        else float32(0.0)
                    )
                    ell[g] += p
                    for i in range(WPL):
                        for e in range(4):
                            acc[g * EPL + 4 * i + e] += p * bf16_lane(
                                vw[c * WPL + i], e
                            )
            if prefetch:  # the next step's rows become this step's
                for j in range(CW):
                    kw[j], vw[j] = kn[j], vn[j]
        # merge the block's W * KPW partial softmaxes: rescale each to the block's
        # maximum, then add them up
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
                            sm_acc[key_in_warp, g * D + 4 * (sub + L * i) + e] = acc[
                                g * EPL + 4 * i + e
                            ]
            cuda.syncthreads()
            for j in range(PER_THREAD):
                t = tid + j * W * WARP_SIZE
                if t < GD:
                    for r in range(KPW):
                        num[j] += sm_acc[r, t]
                        den[j] += sm_l[r, t // D]
            cuda.syncthreads()
        finish(num, den, sm_block_top, workspace, out, s, split, kvh, n, split_len,
               is_whole, scratch)

    kernel.head_dim, kernel.group, kernel.num_warps = D, G, W
    kernel.fuse_rope = fuse_rope
    # the first step's cache, or fuse_rope's positions and angles (tests/test_ptx.py)
    kernel.reads_before_wait = early_loads or fuse_rope
    kernel.keys_per_step = W * KPW * C  # keys a block covers per step of its loop
    return kernel


def _kernel_key(
    head_dim: int, group: int, cfg: DecodeAttentionConfig, fuse_rope: bool = False
) -> tuple:
    return (
        head_dim,
        group,
        cfg.num_warps,
        cfg.keys_per_lane,
        cfg.lane_elements,
        cfg.max_registers,
        cfg.early_loads,
        cfg.prefetch,
        fuse_rope,
    )


# (head_dim, group, warps, keys per lane, lane elements, register cap, early loads,
# prefetch, fuse_rope) -> kernel
_DECODE_KERNELS = {}
# Llama 3.2 1B, SmolLM2; batches and batch 1; Llama's with RoPE inside
_ATTENTION_KERNELS = {
    "decode_attention_d64_g4_kernel": (4, DEFAULT_DECODE_CONFIG, False),
    "decode_attention_d64_g3_kernel": (3, DEFAULT_DECODE_CONFIG, False),
    "decode_attention_d64_g4_one_row_kernel": (
        4, DEFAULT_DECODE_CONFIG.for_rows(1), False
    ),
    "decode_attention_d64_g4_rope_kernel": (4, DEFAULT_DECODE_CONFIG, True),
    "decode_attention_d64_g4_one_row_rope_kernel": (
        4, DEFAULT_DECODE_CONFIG.for_rows(1), True
    ),
}
for _name, (_group, _cfg, _fuse) in _ATTENTION_KERNELS.items():
    _key = _kernel_key(64, _group, _cfg, _fuse)
    _DECODE_KERNELS[_key] = globals()[_name] = make_decode_attention_kernel(*_key)


def decode_args_signature(fuse_rope: bool) -> str:
    """The decode kernels' arguments up to the workspace, as a PTX signature: fused,
    the step's int64 positions and slots and the float32 RoPE table; unfused, the
    placeholders the launcher passes for them (the context lengths, qkv).
    """
    rope = (
        "int64[::1], float32[:, ::1], float32[:, ::1], int64[::1]"
        if fuse_rope
        else "int32[::1], float32[:, ::1], float32[:, ::1], int32[::1]"
    )
    return (
        "float32[:, ::1], uint64[::1], uint64[::1], int32[:, ::1], uint32, int32[::1], "
        f"{rope}, float32, int64, int64, int64, float32[:, :, :, ::1]"
    )


PTX_SIGNATURES = {
    name: [
        f"void({decode_args_signature(fuse)}, {out}[:, ::1])"
        for out in ("float32", "uint16")
    ]
    for name, (_, _, fuse) in _ATTENTION_KERNELS.items()
}


def decode_attention_kernel_for(
    head_dim: int,
    group: int,
    cfg: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
    fuse_rope: bool = False,
):
    """The kernel for these sizes and the config's compile-time knobs, with RoPE and
    the newest K/V store inside or not, built on first use.
    """
    key = _kernel_key(head_dim, group, cfg, fuse_rope)
    if key not in _DECODE_KERNELS:
        _DECODE_KERNELS[key] = make_decode_attention_kernel(*key)
    return _DECODE_KERNELS[key]


# %% [markdown]
# The launcher checks its arguments before any launch. The checks of a paged context —
# the caches as words, the block tables, the context lengths and the block size — are
# the same for every kernel that reads the cache through a block table, so they live
# once in `paged_cache` (`check_paged_context`), below chapter 10's paged prefill,
# which calls them too. The split policy's host side, `decode_splits`, and the
# workspace go with the policy to `decode_splits`; the launcher, with the NumPy
# reference, to `decode_attention`.

# %%
#| export kernels.paged_cache
def cache_words(name: str, cache, num_kv_heads: int, head_dim: int):
    """A layer's K or V cache as the kernel reads it, one flat array of 8-byte words:
    from uint16 (num_slots, KVH, D), or already uint64 — (num_slots, KVH, D / 4) or
    flat.
    """
    if cache.dtype == np.uint16:
        if cache.ndim != 3 or tuple(cache.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name}: the cache must be (num_slots, {num_kv_heads}, {head_dim}), "
                f"got {tuple(cache.shape)}"
            )
        return cache.view(np.uint64).reshape(-1)
    row_words = num_kv_heads * head_dim // 4
    is_words = cache.dtype == np.uint64 and (
        (cache.ndim == 1 and cache.shape[0] % row_words == 0)
        or tuple(cache.shape[1:]) == (num_kv_heads, head_dim // 4)
    )
    if not is_words:
        raise TypeError(
            f"{name}: the cache must hold bf16 bits, uint16 (num_slots, "
            f"{num_kv_heads}, {head_dim}), "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )
    return cache.reshape(-1) if cache.ndim > 1 else cache


def check_paged_context(
    name: str,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    block_size: int,
    num_seqs: int,
    num_kv_heads: int,
    head_dim: int,
    query_start_loc=None,
    lens_name: str = "seq_lens",
):
    """Check the arguments of attention over a paged cache; return the caches as flat
    8-byte words (k64, v64).

    The caches hold bf16 bits (cache_words), as many slots each and fewer than 2**32
    words (the kernels index them in 32 bits); the block size is a power of two; block
    tables are int32 (>= num_seqs rows), the lengths (named lens_name) int32 (>=
    num_seqs). NumPy arrays are checked in full: each length covers its new tokens
    (query_start_loc; None for decode rows, whose lengths may be 0) and fits its table,
    whose blocks lie in the cache. Device arrays only by dtype and shape.
    """
    if (
        not isinstance(block_size, (int, np.integer))
        or isinstance(block_size, bool)
        or block_size < 1
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"{name}: block_size must be a power of two (1, 2, 4, ... 16, ...), got "
            f"{block_size!r}"
        )
    k64, v64 = (
        cache_words(name, c, num_kv_heads, head_dim) for c in (k_cache, v_cache)
    )
    if k64.size != v64.size:
        raise ValueError(
            f"{name}: k_cache and v_cache must have as many slots, got "
            f"{k64.size} and {v64.size} words"
        )
    if k64.size >= 2**32:
        raise ValueError(
            f"{name}: the kernel indexes the cache with 32 bits; {k64.size} words is "
            "too many"
        )
    if (
        block_tables.dtype != np.int32
        or block_tables.ndim != 2
        or block_tables.shape[0] < num_seqs
    ):
        raise TypeError(
            f"{name}: block_tables must be int32 (>= {num_seqs}, max_blocks), got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != np.int32 or seq_lens.ndim != 1 or seq_lens.shape[0] < num_seqs:
        raise TypeError(
            f"{name}: {lens_name} must be int32 (>= {num_seqs},), got "
            f"{seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    is_decode = query_start_loc is None
    if not isinstance(seq_lens, np.ndarray) or not (
        is_decode or isinstance(query_start_loc, np.ndarray)
    ):
        return k64, v64
    lens = seq_lens[:num_seqs].astype(np.int64)
    # decode rows: the new token is in the cache already, and a padding row has none
    num_new = (
        np.zeros(num_seqs, np.int64)
        if is_decode
        else np.diff(query_start_loc.astype(np.int64))
    )
    max_len = block_tables.shape[1] * int(block_size)
    if np.any(lens < num_new) or np.any(lens > max_len):
        raise ValueError(
            f"{name}: each {lens_name}[s] must be at least its new tokens and at most "
            f"max_blocks * block_size = {max_len}; got {lens_name} "
            f"{lens.tolist()} for new tokens {num_new.tolist()}"
        )
    if isinstance(block_tables, np.ndarray):
        num_blocks = k64.size // (num_kv_heads * head_dim // 4) // int(block_size)
        for s, n in enumerate(lens):
            used = block_tables[s, : cdiv(int(n), int(block_size))]
            if used.size and (used.min() < 0 or used.max() >= num_blocks):
                raise ValueError(
                    f"{name}: block_tables[{s}] names blocks outside the cache's "
                    f"{num_blocks}: {used.tolist()}"
                )
    return k64, v64


# %%
#| export kernels.decode_splits
import numpy as np

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.reduce import WARP_SIZE


def decode_splits(
    max_context_len: int,
    rows: int,
    num_kv_heads: int,
    cfg: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
    max_splits: int | None = None,
) -> int:
    """The grid's split axis: the splits the longest context (max_context_len) wants
    with `rows` rows (rounded up by split_rows, as the kernel rounds them).
    """
    return num_splits_for(
        max(1, max_context_len),
        max_splits or cfg.max_splits,
        split_rows(rows) * num_kv_heads,
        cfg.split_keys,
        cfg.target_blocks,
        cfg.min_split_keys,
    )


def decode_workspace(
    max_rows: int,
    max_context_len: int,
    num_heads: int,
    head_dim: int,
    cfg: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
):
    """The split path's float32 scratch, made once by the caller: (max_rows, splits,
    num_heads, workspace_row(head_dim)), zeroed.

    [s, j, h] holds split j's unnormalised output for head h, then its maximum and sum;
    the row is padded to whole 128-byte lines, so no two blocks' partials share a line.
    [s, 0, kvh G, head_dim + 2] counts the splits of (s, KV head kvh) done in a launch;
    the last one sets it back to zero.
    """
    # the most any row count wants
    splits = max(1, min(cfg.max_splits, cdiv(max_context_len, cfg.min_split_keys)))
    shape = (max_rows, splits, num_heads, workspace_row(head_dim))
    return cuda.to_device(np.zeros(shape, np.float32))


def workspace_row(head_dim: int) -> int:
    """Floats per (row, split, head) of the workspace: head_dim values, the maximum, the
    sum and a counter, rounded up to whole 128-byte lines.
    """
    return cdiv(head_dim + 3, WARP_SIZE) * WARP_SIZE


def check_workspace(name: str, workspace, rows: int, num_heads: int, head_dim: int):
    """A workspace from decode_workspace for at least `rows` rows, or None."""
    if workspace is not None and (
        workspace.dtype != np.float32
        or workspace.ndim != 4
        or workspace.shape[0] < rows
        or tuple(workspace.shape[2:]) != (num_heads, workspace_row(head_dim))
        or workspace.shape[1] > WARP_SIZE
    ):
        raise TypeError(
            f"{name}: workspace must be float32 (>= {rows}, splits <= "
            f"{WARP_SIZE}, {num_heads}, {workspace_row(head_dim)}) "
            f"from decode_workspace, got {workspace.dtype} {tuple(workspace.shape)}"
        )


# %%
#| export kernels.decode_attention
from tinyvllm_lib.kernels.attention import check_out, check_qkv
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.decode_attention_kernel import (
    LOG2_E,
    decode_attention_kernel_for,
)
from tinyvllm_lib.kernels.decode_rope import fused_rope_args
from tinyvllm_lib.kernels.decode_splits import check_workspace, decode_splits
from tinyvllm_lib.kernels.paged_cache import check_paged_context
from tinyvllm_lib.kernels.reduce import WARP_SIZE


def decode_attention(
    qkv,
    k_cache,
    v_cache,
    block_tables,
    block_size: int,
    context_lens,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    out,
    stream=0,
    workspace=None,
    max_context_len=None,
    config: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
    kernel_for=decode_attention_kernel_for,
    rope=None,
    slot_mapping=None,
):
    """Row s of qkv (one new query per row, after RoPE) over positions
    0..context_lens[s]-1 of a bf16 KV cache.

    Position p of row s is at slot block_tables[s, p // block_size] * block_size + p %
    block_size; block_size is a power of two. out: (rows, H D), float32 or bf16 bits.
    The new token's own K/V must already be in the cache. workspace (from
    decode_workspace): lets several blocks share a sequence's context (flash-decoding);
    without it one block per (row, KV head) walks the whole context. max_context_len: a
    bound on every context length (default: what the block table can address). With the
    number of rows it fixes the grid; each sequence's split is worked out on the GPU
    from its own length, so the same launch serves every step while the contexts grow up
    to the bound. kernel_for(head_dim, group, config): the kernel to launch (chapter 14
    passes its tensor-core one), with num_warps warps a block.
    rope = (table, positions) with slot_mapping: q and k arrive before RoPE, and the
    kernel rotates them and stores the new token's K/V at slot_mapping[s] itself
    (kernel_for(..., fuse_rope=True)); qkv is left as it was.
    """
    name = "decode_attention"
    rows = check_qkv(name, qkv, num_heads, num_kv_heads, head_dim)
    check_out(name, out, (rows, num_heads * head_dim))
    if head_dim % 16:
        raise ValueError(f"{name}: head_dim must be a multiple of 16, got {head_dim}")
    k64, v64 = check_paged_context(
        name,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        block_size,
        rows,
        num_kv_heads,
        head_dim,
        lens_name="context_lens",
    )
    check_workspace(name, workspace, rows, num_heads, head_dim)
    if rows == 0:
        return out
    rope_args, fuse = fused_rope_args(
        name, rope, slot_mapping, qkv, context_lens, num_heads, num_kv_heads, head_dim
    )
    cfg = config.for_rows(rows)
    group = num_heads // num_kv_heads
    kernel = (
        kernel_for(head_dim, group, cfg, fuse_rope=True)
        if fuse
        else kernel_for(head_dim, group, cfg)
    )
    max_len = (
        int(max_context_len)
        if max_context_len is not None
        else block_tables.shape[1] * int(block_size)
    )
    splits = 1  # one split: the whole context in one block per (row, KV head)
    if workspace is not None and workspace.shape[1] > 1:
        splits = decode_splits(
            max_len, rows, num_kv_heads, cfg, max_splits=workspace.shape[1]
        )
    # one split writes no partials: any float32 view
    scratch = workspace if splits > 1 else qkv.reshape(1, 1, *qkv.shape)
    knobs = (cfg.split_keys, cfg.min_split_keys, cfg.target_blocks)
    kernel[(num_kv_heads, rows, splits), kernel.num_warps * WARP_SIZE, stream](
        qkv,
        k64,
        v64,
        block_tables,
        np.uint32(int(block_size).bit_length() - 1),
        context_lens,
        *rope_args,
        np.float32(LOG2_E / math.sqrt(head_dim)),
        *knobs,
        scratch,
        out,
    )
    return out


decode_attention.fuses_rope = True  # takes rope= and slot_mapping= (PagedAttention)


# %%
#| export kernels.kv_cache_write
def check_kv_write(
    name: str, qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache
) -> int:
    """What a KV-cache write needs of its arguments; returns head_dim."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    check_qkv(name, qkv, num_heads, num_kv_heads, head_dim)
    for cache in (k_cache, v_cache):
        if (
            cache.dtype != np.uint16
            or cache.ndim != 3
            or tuple(cache.shape[1:]) != (num_kv_heads, head_dim)
        ):
            raise TypeError(
                f"{name}: caches must be uint16 (num_slots, {num_kv_heads}, "
                f"{head_dim}), got {cache.dtype} {tuple(cache.shape)}"
            )
    check_slot_mapping(name, slot_mapping, num_tokens)
    return head_dim


def check_slot_mapping(name: str, slot_mapping, num_tokens: int) -> None:
    """A slot for each new token: int32 or int64 (num_tokens,), -1 skipping one."""
    if slot_mapping.dtype not in (np.int32, np.int64) or tuple(
        slot_mapping.shape
    ) != (num_tokens,):
        raise TypeError(
            f"{name}: slot_mapping must be int32 or int64 ({num_tokens},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )


def write_kv_cache(
    qkv,
    num_heads: int,
    num_kv_heads: int,
    slot_mapping,
    k_cache,
    v_cache,
    stream=0,
    threads: int = 256,
):
    """Store the new tokens' K and V (qkv float32 after RoPE) as bf16 at slot_mapping[t]
    (int32/int64; -1 skips).
    """
    num_tokens = qkv.shape[0]
    head_dim = check_kv_write(
        "write_kv_cache", qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache
    )
    if num_tokens:
        total = num_tokens * num_kv_heads * head_dim
        write_kv_cache_kernel[cdiv(total, threads), threads, stream](
            qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache
        )


# %% [markdown]
# **RoPE and the write in one kernel.** The model rotates the query and key heads
# (chapter 5's `rope_qkv`) just before this write reads the keys: two launches per
# layer, the second waiting for the first, for a few kilobytes of work at decode. So the
# model hands its RoPE table and the step's positions to the attention layer
# (`attention(layer, qkv, out, stream, rope=(table, positions))`), and a layer that
# writes a cache does both in `rope_and_write_kv_cache`: a thread per (head, pair of
# dimensions) and four tokens, whose loads it issues before it uses any (a row
# of blocks for every four tokens; past the grid's height a thread takes the next
# four a grid apart), rotates its pair of a Q or K head in place, with the same
# arithmetic as `rope_kernel`, and stores its K or V pair in the cache in bf16.
# Chapter 11 measures what it saves.

# %%
#| export kernels.kv_cache_write
from numba import float32, uint32

from tinyvllm_lib.kernels.rope import NAN32, RopeTable, check_rope_args

MAX_GRID_Y = 65535  # the most blocks a grid's second dimension holds
ROPE_TOKENS = 4  # tokens a thread: their loads in flight at once


@cuda.jit
def rope_write_kv_cache_kernel(
    qkv, positions, cos, sin, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache
):
    """A thread per (head of Q, K or V, pair i of the head) and ROPE_TOKENS tokens:
    rotate Q's and K's pairs (i, i + D/2) in place, then store K's and V's pairs in
    bf16 at each token's slot.
    """
    wait_for_previous_kernel()
    half = uint32(cos.shape[1])
    # the first head of K, of V, and the end of the row: 32-bit, as head is (compared
    # with int64 sums, numba converts both to float64)
    k_at, v_at = uint32(num_heads), uint32(num_heads + num_kv_heads)
    heads = uint32(num_heads + 2 * num_kv_heads)
    # a row of blocks a group of ROPE_TOKENS tokens (groups past the grid's height
    # taken in turn); 32-bit index arithmetic: a 64-bit division costs dozens of
    # instructions
    idx = uint32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
    i, head = idx % half, idx // half
    if head >= heads:
        return
    col = head * uint32(2) * half + i
    n = qkv.shape[0]
    x1 = cuda.local.array(ROPE_TOKENS, float32)
    x2 = cuda.local.array(ROPE_TOKENS, float32)
    c = cuda.local.array(ROPE_TOKENS, float32)
    s = cuda.local.array(ROPE_TOKENS, float32)
    for base in range(cuda.blockIdx.y * ROPE_TOKENS, n, cuda.gridDim.y * ROPE_TOKENS):
        for t in range(ROPE_TOKENS):  # every token's loads first: all in flight at once
            token = base + t
            if token < n:
                x1[t], x2[t] = qkv[token, col], qkv[token, col + half]
                if head < v_at:  # Q or K: its angle
                    pos = positions[token]
                    is_valid = pos >= 0 and pos < cos.shape[0]
                    # outside the table: poison, never read out of bounds
                    c[t] = cos[pos, i] if is_valid else NAN32
                    s[t] = sin[pos, i] if is_valid else NAN32
        for t in range(ROPE_TOKENS):
            token = base + t
            if token >= n:
                continue
            a, b = x1[t], x2[t]
            if head < v_at:  # Q or K: rotate
                a, b = a * c[t] - b * s[t], b * c[t] + a * s[t]
                qkv[token, col], qkv[token, col + half] = a, b
            slot = slot_mapping[token]
            if head >= k_at and slot >= 0:  # K or V, of a token with a slot
                if head < v_at:
                    kvh = head - k_at
                    k_cache[slot, kvh, i] = f32_to_bf16(a)
                    k_cache[slot, kvh, i + half] = f32_to_bf16(b)
                else:
                    kvh = head - v_at
                    v_cache[slot, kvh, i] = f32_to_bf16(a)
                    v_cache[slot, kvh, i + half] = f32_to_bf16(b)


PTX_SIGNATURES["rope_write_kv_cache_kernel"] = [
    f"void(float32[:, ::1], {p}[::1], float32[:, ::1], float32[:, ::1], int64, int64, "
    f"{s}[::1], uint16[:, :, ::1], uint16[:, :, ::1])"
    for p in ("int32", "int64")
    for s in ("int32", "int64")
]


def rope_and_write_kv_cache(
    qkv,
    positions,
    table: RopeTable,
    num_heads: int,
    num_kv_heads: int,
    slot_mapping,
    k_cache,
    v_cache,
    stream=0,
    threads: int = 256,
):
    """rope_qkv(qkv, positions, table, ...) then write_kv_cache(qkv, ...), in one
    launch: Q and K rotated in place, K and V stored as bf16 at slot_mapping[t] (-1
    skips).
    """
    num_tokens = qkv.shape[0]
    head_dim = check_kv_write(
        "rope_and_write_kv_cache",
        qkv,
        num_heads,
        num_kv_heads,
        slot_mapping,
        k_cache,
        v_cache,
    )
    if table.head_dim != head_dim:
        raise ValueError(
            f"rope_and_write_kv_cache: the RoPE table is for head_dim "
            f"{table.head_dim}, the heads have {head_dim}"
        )
    check_rope_args(
        qkv, positions, table, num_heads, num_kv_heads, "rope_and_write_kv_cache"
    )
    if num_tokens:
        per_token = (num_heads + 2 * num_kv_heads) * (head_dim // 2)
        groups = min(cdiv(num_tokens, ROPE_TOKENS), MAX_GRID_Y)
        grid = (cdiv(per_token, threads), groups)
        rope_write_kv_cache_kernel[grid, threads, stream](
            qkv,
            positions,
            table.cos,
            table.sin,
            num_heads,
            num_kv_heads,
            slot_mapping,
            k_cache,
            v_cache,
        )


def cache_new_kv(
    qkv, rope, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache, stream=0
):
    """An attention layer's write of the step's new K and V: rope = (table, positions)
    rotates q and k as it writes (rope_and_write_kv_cache); None means they are rotated
    already (write_kv_cache).
    """
    if rope is None:
        return write_kv_cache(
            qkv, num_heads, num_kv_heads, slot_mapping, k_cache, v_cache, stream=stream
        )
    table, positions = rope
    return rope_and_write_kv_cache(
        qkv,
        positions,
        table,
        num_heads,
        num_kv_heads,
        slot_mapping,
        k_cache,
        v_cache,
        stream,
    )


# %% [markdown]
# The NumPy reference works in float64 on the same bf16 cache, so the kernel's only
# error is its float32 arithmetic. A test with several sequences of odd lengths, grouped
# heads and a block table that scatters the blocks (as paging will), once with one block
# per sequence and once with the context split over blocks — lengths from one token to
# several splits, each sequence choosing its own split on the GPU:

# %%
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyvllm_lib.kernels.decode_attention_config import DecodeAttentionConfig
from tinyvllm_lib.kernels.decode_splits import (
    decode_workspace,
    num_splits_for,
    split_length,
    split_rows,
)


def random_decode_case(
    num_seqs, max_len, num_heads, num_kv_heads, head_dim, block_size, gen
):
    """qkv, a filled bf16 cache, a shuffled block table and random context lengths."""
    lens = gen.integers(1, max_len + 1, num_seqs).astype(np.int32)
    max_blocks = cdiv(max_len, block_size)
    blocks = (
        gen.permutation(num_seqs * max_blocks)
        .astype(np.int32)
        .reshape(num_seqs, max_blocks)
    )
    num_slots = num_seqs * max_blocks * block_size
    k = f32_to_bf16_bits(
        gen.standard_normal((num_slots, num_kv_heads, head_dim)).astype(np.float32)
    )
    v = f32_to_bf16_bits(
        gen.standard_normal((num_slots, num_kv_heads, head_dim)).astype(np.float32)
    )
    qkv = gen.standard_normal(
        (num_seqs, (num_heads + 2 * num_kv_heads) * head_dim)
    ).astype(np.float32)
    return qkv, k, v, blocks, lens


if can_launch():
    # the simulator's tiny shapes: short splits
    small = DecodeAttentionConfig(split_keys=16, keys_per_lane=1)
    qkv_d, k_d, v_d, bt_d, lens_d = random_decode_case(3, 70, 4, 2, 16, 4, rng)
    lens_d[:2] = [1, 70]
    want = decode_attention_ref(qkv_d, k_d, v_d, bt_d, 4, lens_d, 4, 2, 16)
    args = [cuda.to_device(a) for a in (qkv_d, k_d, v_d, bt_d)] + [
        4,
        cuda.to_device(lens_d),
        4,
        2,
        16,
    ]
    # head_dim 16: 2 lanes a key
    step_keys = small.num_warps * 32 // 2 * small.keys_per_lane
    for label, split in [
        ("one block per sequence", {}),
        (
            "context split over blocks",
            {"workspace": decode_workspace(3, 70, 4, 16, small), "max_context_len": 70},
        ),
    ]:
        got = decode_attention(
            *args, cuda.device_array((3, 64), np.float32), config=small, **split
        ).copy_to_host()
        print(
            f"{label}, context lengths {lens_d.tolist()}: max relative error "
            f"{max_rel_error(got, want):.1e}"
        )
        assert max_rel_error(got, want) < 1e-5
    for n in lens_d:
        splits = num_splits_for(
            int(n),
            32,
            split_rows(3) * 2,
            small.split_keys,
            small.target_blocks,
            small.min_split_keys,
        )
        print(
            f"  {n:>3} keys: {cdiv(int(n), split_length(int(n), splits, step_keys))} "
            "split(s) of "
            f"{split_length(int(n), splits, step_keys)} keys"
        )

# %% [markdown]
# How fast is it? `bench/ch08_decode_gpu.py` times the kernel at Llama 3.2 1B's shapes
# (32 query heads, 8 KV heads of 64) with 1,024 tokens of context per sequence, in a
# paged cache of 16-slot blocks in shuffled order, inside a CUDA graph and rotating
# through K/V sets larger than L2, and records bytes per second; the page shows them as
# shares of chapter 1's bandwidth ceiling:

# %% tags=["hide-input"]
kv_records = load_records("ch08_kv_cache")
decode_records = {
    r["shape"][0]: r for r in kv_records if r["name"] == "decode_attention"
}
any_decode = next(iter(decode_records.values()), None)
ceiling_gbs, ceiling_name = bandwidth_ceiling(
    any_decode["device"]["name"] if any_decode else None
)
prose.glue("ch08_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))


def share(r: dict | None) -> float | None:
    """A GB/s record's share of the ceiling, computed now (not its stored ratio)."""
    return r["value"] / ceiling_gbs if r and r.get("ratio") and ceiling_name else None


for n in (1, 64, 256):
    r = decode_records.get(n)
    prose.glue(
        f"ch08_decode_{n}_us", f"{r['us']:.1f} µs" if r else "(not yet measured)"
    )
    prose.glue(
        f"ch08_decode_{n}_share",
        f"{share(r):.0%}" if share(r) else "(not yet measured)",
    )
prose.glue(
    "ch08_decode_date", decode_records[64]["date"] if 64 in decode_records else ""
)
prose.glue(
    "ch08_decode_device",
    decode_records[64]["device"]["name"] if 64 in decode_records else "the GPU",
)
prose.glue(
    "ch08_decode_sms",
    str(decode_records[64]["device"].get("multiprocessors", "its"))
    if 64 in decode_records
    else "its",
)
if decode_records and all(share(r) for r in decode_records.values()):
    seqs = sorted(decode_records)
    fig, ax = new_figure(width=6, height=2.6)
    ax.plot(
        seqs, [100 * share(decode_records[n]) for n in seqs], "o-", color="#1f77b4"
    )
    for n in seqs:
        ax.annotate(
            f"{decode_records[n]['us']:.0f} µs",
            (n, 100 * share(decode_records[n])),
            textcoords="offset points",
            xytext=(4, -10),
            fontsize=7,
        )
    ax.axhline(100, color="k", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 105)
    ax.set_xlabel("sequences decoding at once (1,024 tokens of context each)")
    ax.set_ylabel(f"% of the {ceiling_gbs:,.0f} GB/s ceiling")
    ax.set_title(
        "decode attention, one layer of Llama 3.2 1B, "
        f"{decode_records[seqs[0]]['device']['name']} "
        f"({decode_records[seqs[0]]['date']})",
        fontsize=9,
    )
    plt.show()
else:
    print("no GPU measurement recorded yet: run bench/ch08_decode_gpu.py on a GPU")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch08_decode_device}}, 64 sequences take {{ch08_decode_64_us}} per layer —
{{ch08_decode_64_share}} of {{ch08_ceiling}} — and 256 take
{{ch08_decode_256_us}} ({{ch08_decode_256_share}}). One sequence takes
{{ch08_decode_1_us}}: its 2 MiB of K and V per layer is too little to fill
{{ch08_decode_sms}} SMs, so latency, not bandwidth, sets its time, and splitting the
context is what keeps it that short. (These records, of {{ch08_decode_date}}, were made
when a second small kernel combined the splits and before the prefetch; chapter 11
folds the combine into the last split and measures the kernel again.) Here is what
each knob does at 64 sequences, moved alone away from the defaults (the dark bar):
""")

# %% tags=["hide-input"]
tune = [
    r
    for r in load_records("ch08_decode_tune")
    if r["name"] == "decode_attention_variant" and r["shape"][0] == 64
    and r.get("correct")
]
KNOBS = {
    "lane_elements": "values per lane",
    "keys_per_lane": "rows in flight per lane",
    "max_registers": "register cap",
    "num_warps": "warps per block",
    "split_keys": "keys per split",
    "target_blocks": "grid target",
    "prefetch": "next step's rows early",
}
# the defaults' record (a --grid run of the bench may lack one)
base = next((r for r in tune if not r["moved"]), None)
if base and share(base):
    fig, axes = new_figure(1, len(KNOBS), width=10, height=2.3, sharey=True)
    for ax, (knob, title) in zip(axes, KNOBS.items()):
        points = sorted(
            [base] + [r for r in tune if r["moved"] == [knob]],
            key=lambda r: (r[knob] is not None, r[knob] or 0),
        )
        labels = [
            "none" if r[knob] is None
            else ("on" if r[knob] else "off") if isinstance(r[knob], bool)
            else str(r[knob])
            for r in points
        ]
        ax.bar(
            labels,
            [100 * share(r) for r in points],
            color=["#1f4e79" if r is base else "#9ecae1" for r in points],
        )
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel(f"% of {ceiling_gbs:,.0f} GB/s")
    fig.suptitle(
        f"decode attention, 64 sequences x 1024 tokens, {base['device']['name']}",
        fontsize=9,
    )
    plt.show()
    for r in sorted(tune, key=lambda r: -r["value"])[:3]:
        print(
            f"{share(r):.0%} of the ceiling: "
            + ", ".join(f"{k} {r[k]}" for k in KNOBS)
            + f" ({r['registers']} registers)"
        )
else:
    print("no GPU sweep recorded yet: run bench/ch08_decode_tune.py on a GPU")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
def tuned(knob=None, value=None):
    """The 64-sequence sweep's share of the ceiling: the defaults, or one knob moved."""
    for r in tune:
        if (r["moved"] == [knob] and r[knob] == value) if knob else not r["moved"]:
            return f"{share(r):.0%}"
    return "(not recorded)"


if base and share(base):
    prose.glue("ch08_tune_default", tuned())
    prose.glue("ch08_tune_no_prefetch", tuned("prefetch", False))
    prose.glue("ch08_tune_one_row", tuned("keys_per_lane", 1))
    prose.glue("ch08_tune_three_rows", tuned("keys_per_lane", 3))
    prose.glue("ch08_tune_two_warps", tuned("num_warps", 2))
    prose.glue("ch08_tune_two_splits", tuned("split_keys", 512))
    prose.show("""
The defaults read at {{ch08_tune_default}} of the ceiling. Bytes in flight matter most:
one row a lane reaches {{ch08_tune_one_row}}, and without the prefetch (two rows a lane,
loaded only when the step before is done) {{ch08_tune_no_prefetch}}. More rows do not
help: three with their prefetch take 165 registers, fewer warps fit on an SM, and it
falls to {{ch08_tune_three_rows}}. The register cap moves it by no more than the sweep's
noise (the kernel needs 127 without it). Sixteen values a lane push the registers past
that and halve the warps. Then the grid: 64 sequences × 8 KV heads are 512 blocks, one
wave of 4-warp blocks over the GPU, and each block covers a whole 1,024-token context;
splitting it in two (shorter splits, or a larger grid target) gives 1,024 blocks that no
longer fit in one wave, and it falls to {{ch08_tune_two_splits}}. Two warps a block
leave half the GPU's warp slots empty ({{ch08_tune_two_warps}}). The kernel is not the
ceiling of the hardware — FlashInfer-style kernels use 16-byte loads and tensor cores,
which Numba does not reach — but it is within sight of the bandwidth ceiling at the
batch sizes where attention's bytes are a large part of a step.
""")

# %% [markdown]
# ## The kernel model with a cache
#
# The GPU's cache holds, per layer, bf16 keys and values as `uint16` — and the same
# bytes as one flat array of 8-byte words, the view decode attention reads. Its
# attention object, `PagedAttention` — vLLM's name: it reads keys and values through
# block tables, in pages; chapter 10 hands the pages out one at a time — is the NumPy
# one's twin: it writes the batch's new keys and values at `slot_mapping`, then the
# prompts — the batch's first `num_prefills` sequences, each from position 0 — attend
# among their own tokens with chapter 7's flash kernel, all of them in one launch, and
# the decode rows attend over their contexts with `decode_attention`. Every array it
# reads is on the GPU; the runner copies the step's metadata there
# (`AttentionMetadata.to_device`, into buffers it keeps).


# %%
#| export
class CudaKVCache:
    """The GPU's cache: per layer, bf16 keys and values (num_slots, num_kv_heads,
    head_dim) as uint16 in k[layer] and v[layer], and the same bytes as flat 8-byte
    words in k_words[layer], v_words[layer].
    """

    def __init__(self, config: ModelConfig, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.dtype, self.num_slots = "bfloat16", num_slots
        shape = (num_slots, config.num_key_value_heads, config.head_dim)
        self.k = [
            cuda.device_array(shape, np.uint16) for _ in range(config.num_hidden_layers)
        ]
        self.v = [
            cuda.device_array(shape, np.uint16) for _ in range(config.num_hidden_layers)
        ]
        # what decode attention reads
        self.k_words = [k.view(np.uint64).reshape(-1) for k in self.k]
        self.v_words = [v.view(np.uint64).reshape(-1) for v in self.v]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


# %%
# chapter 10 writes the library's PagedAttention: this one, plus a prefill after cached
# tokens
from tinyvllm_lib.kernels.attention import flash_attention
from tinyvllm_lib.kernels.decode_attention import decode_attention
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.kv_cache_write import cache_new_kv


class PagedAttention:
    """The kernel model's attention over the bf16 KV cache
    (engine.kv_cache.CudaKVCache), for one step.

    Called as attention(layer, qkv, out, stream, rope): rotates q and k by rope =
    (table, positions) as it stores the new tokens' K/V at their slots (rope None: they
    are rotated already); the prefills (the first metadata.num_prefills sequences, each
    from position 0) attend among their own tokens with flash_attention, the decode rows
    over their contexts with decode_attention. metadata's arrays are on the GPU;
    workspace comes from decode_workspace; max_context_len bounds every context, so
    decode attention's grid does not change while they grow.
    """

    def __init__(
        self,
        config,
        cache,
        metadata: AttentionMetadata,
        workspace=None,
        max_context_len: int | None = None,
        decode_config: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.cache, self.metadata, self.workspace = cache, metadata, workspace
        self.max_context_len, self.decode_config = max_context_len, decode_config
        m = metadata
        if m.max_prefill_context_len:
            raise NotImplementedError(
                "this attention computes a prefill from position 0 (flash attention "
                "over its own tokens); one after cached tokens needs chapter 10's "
                "paged prefill"
            )
        # views, once per step
        self.prefill_starts = m.query_start_loc[: m.num_prefills + 1]
        self.decode_tables, self.decode_lens = (
            m.block_tables[m.num_prefills :],
            m.seq_lens[m.num_prefills :],
        )

    def __call__(self, layer: int, qkv, out, stream=0, rope=None) -> None:
        m, H, KVH, D = self.metadata, self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        cache_new_kv(qkv, rope, H, KVH, m.slot_mapping, k_cache, v_cache, stream)
        split = m.num_prefill_tokens
        if m.num_prefills:
            flash_attention(
                qkv[:split],
                self.prefill_starts,
                m.max_query_len,
                H,
                KVH,
                D,
                out[:split],
                stream=stream,
            )
        if m.num_decodes:
            decode_attention(
                qkv[split:],
                self.cache.k_words[layer],
                self.cache.v_words[layer],
                self.decode_tables,
                m.block_size,
                self.decode_lens,
                H,
                KVH,
                D,
                out[split:],
                stream=stream,
                workspace=self.workspace,
                max_context_len=self.max_context_len,
                config=self.decode_config,
            )


# %% [markdown]
# Does the kernel model with its cache give the NumPy model's logits? A prompt is
# prefilled and a few tokens decoded, step by step, on both: the NumPy model with a
# float32 cache (the reference) and the kernel model with its bf16 cache, teacher-forced
# on the reference's greedy tokens. The comparison is chapter 7's: the mean gap over
# each position's five most likely tokens, and the same greedy token wherever the
# reference's choice is clear. In the simulator a tiny random model takes two decode
# steps; on a GPU, SmolLM2 takes eight.

# %%
from tinyvllm_lib.engine.kv_cache import CudaKVCache
from tinyvllm_lib.layers.attention import PagedAttention
from tinyvllm_lib.models.llama_cuda import LlamaCuda


def top_gap(ours: np.ndarray, ref: np.ndarray, k: int = 5) -> float:
    """Mean |Δ log p| over each row's k most likely tokens of the reference."""
    top = np.argsort(-ref, axis=-1)[:, :k]
    return float(
        np.abs(
            np.take_along_axis(ours, top, -1) - np.take_along_axis(ref, top, -1)
        ).mean()
    )


def cached_log_probs(
    model, make_attention, prompt: list[int], num_steps: int, forced=None
) -> tuple[np.ndarray, list[int]]:
    """Prefill then num_steps decode steps through `make_attention(metadata)`; log-probs
    of every row, tokens chosen.
    """
    # one sequence: blocks 0, 1, ...
    tables = np.arange(cdiv(len(prompt) + num_steps, 16), dtype=np.int32)[None]
    ids, rows = list(prompt), []
    for s in range(num_steps + 1):
        new = ids if s == 0 else ids[-1:]
        positions, meta = build_attention_metadata(
            [len(new)], [len(ids)], tables, 16, num_prefills=int(s == 0)
        )
        rows.append(log_softmax(model.forward(new, positions, make_attention(meta))))
        ids.append(int(rows[-1][-1].argmax()) if forced is None else forced[s])
    return np.concatenate(rows), ids[len(prompt) :]


def check_gpu_cache(check_folder, prompt: list[int], num_steps: int) -> float:
    cpu, gpu = LlamaNumpy.from_folder(check_folder), LlamaCuda.from_folder(check_folder)
    num_slots = cdiv(len(prompt) + num_steps + 1, 16) * 16
    cpu_cache, gpu_cache = (
        KVCache(cpu.config, num_slots, "float32"),
        CudaKVCache(gpu.config, num_slots),
    )
    ref, tokens = cached_log_probs(
        cpu, lambda m: CachedAttention(cpu.config, cpu_cache, m), prompt, num_steps
    )
    ours, _ = cached_log_probs(
        gpu,
        lambda m: PagedAttention(gpu.config, gpu_cache, m.to_device()),
        prompt,
        num_steps,
        forced=tokens,
    )
    # rows whose first choice leads by more than 0.1
    clear = np.diff(np.sort(ref, -1)[:, -2:], axis=-1)[:, 0] > 0.1
    assert np.array_equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear]), (
        "greedy tokens differ"
    )
    return top_gap(ours, ref)


if is_simulator():
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_llama_config(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=32,
            head_dim=16,
            vocab_size=64,
        )
        gap = check_gpu_cache(
            make_random_llama(tmp, cfg, seed=2), [5, 17, 33, 3], num_steps=2
        )
    print(
        "tiny random Llama, 4 prompt tokens + 2 decode steps: mean |Δ log p| over "
        f"the top 5 = {gap:.4f}"
    )
    assert gap <= 0.05
elif has_gpu():
    gap = check_gpu_cache(folder, prompt_ids, num_steps=8)
    print(
        f"SmolLM2, {len(prompt_ids)} prompt tokens + 8 decode steps, bf16 cache "
        "against float32: "
        f"mean |Δ log p| over the top 5 = {gap:.4f}"
    )
    assert gap <= 0.05
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernel model")

# %% [markdown]
# The two agree within a few hundredths — the bf16 cache and bf16 activations, not a bug
# — and pick the same tokens. Chapter 8b puts a sampler after the logits and a loop
# around the steps; chapter 9 lets many requests share each step.
#
# ## Summary
#
# - Prefill processes the prompt's tokens together and is compute-bound; decode
#   processes one token per step, reads every weight for it, and is memory-bound.
# - The KV cache keeps every token's keys and values, per layer
#   `(num_slots, num_kv_heads, head_dim)`; Llama 3.2 1B needs 32 KiB per token in bf16.
#   Slots come in blocks; a sequence's block-table row maps its positions to slots. This
#   chapter's allocator gives each sequence row a contiguous run of blocks; chapter 10's
#   pages them.
# - Attention metadata — `query_start_loc`, `seq_lens`, `slot_mapping`, `block_tables`,
#   `num_prefills` — is built once per step in one vectorised pass and handed, inside an
#   attention object, to the model's unchanged layer loop.
# - Cached decoding gives the same logits as recomputing (to $10^{-5}$); a bf16 cache
#   moves SmolLM2's log-probabilities by a few hundredths.
# - Decode attention is memory-bound and, in Numba, instruction-bound too: all query
#   heads of a KV head per block, 8 lanes per key row, 2 rows in use and the next 2 in
#   flight, 32-bit indices, `exp2`, and the context split over blocks, each sequence
#   choosing its split on the GPU so the launch does not change from step to step.
#
# Exported to `tinyvllm_lib`: `engine.kv_cache` (`KVCache`, `CudaKVCache`,
# `kv_cache_bytes_per_token`), `engine.contiguous_allocator` (`ContiguousAllocator`),
# `layers.attention`
# (`AttentionMetadata`, `build_attention_metadata`, `CachedAttention`; chapter 10
# writes the library's `PagedAttention`), `kernels.attention`
# (`cached_attention_ref`), and decode attention in six modules of one concept each:
# `kernels.decode_attention_config` (`DecodeAttentionConfig`), `kernels.kv_cache_write`
# (`write_kv_cache`, `rope_and_write_kv_cache`, `write_kv_cache_ref`),
# `kernels.paged_cache` (`cache_word`, `cache_words`, `check_paged_context`),
# `kernels.decode_splits` (`split_policy`, `decode_splits`, `decode_workspace`),
# `kernels.decode_attention_kernel` (`make_decode_attention_kernel`) and
# `kernels.decode_attention` (`decode_attention`, `decode_attention_ref`).
#
# ## Exercises
#
# 1. How many bytes does one decode step of Llama 3.2 1B read at a context of 8192
#    tokens, and which share is the cache? At what context length does the cache read
#    equal the weights?
# 2. Time the NumPy model's decode step at 16, 256 and 1,024 tokens of context. Does the
#    time per step grow with the context? Predict from the FLOP counts above first.
# 3. `ContiguousAllocator` reserves `max_model_len` slots for every row. With
#    `max_num_seqs=256` and `max_model_len=4096`, how much of an H200 does the cache of
#    Llama 3.2 1B take, and how much of it do 256 requests of 300 tokens use?
# 4. `decode_attention` reads K and V with 8-byte loads. Predict what 16-byte loads (two
#    `uint64` per lane per row, or a `uint4`-like pair) would change in instructions per
#    byte, then try it and measure with `bench/ch08_decode_tune.py`.
# 5. In `build_attention_metadata`, replace the vectorised positions with a Python loop
#    over the batch's tokens and time both for 256 sequences of one token, and for one
#    of 4,096.
