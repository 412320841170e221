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
# # 10. Paging: blocks of cache, shared and reclaimed
#
# Chapter 9 batched requests, and in doing so found the next limit: memory. Each
# running sequence owned one contiguous row of the KV cache, `max_model_len` slots long,
# whether it used them or not. A 40-token answer to a 30-token question held as much
# cache as a 4,096-token document could. **PagedAttention**, the idea vLLM was built on,
# cuts the cache into small fixed-size **blocks** and gives a sequence blocks only as
# its tokens arrive, the way an operating system gives a process pages of memory. A
# sequence's blocks need not be adjacent: a **block table** says where each one is, and
# the attention kernels read keys and values through it. Chapter 8's kernels already do:
# its contiguous rows were the simplest block table.
#
# In this chapter you will learn:
#
# - how much of chapter 9's cache a real request mix leaves empty, and how much blocks
#   leave;
# - the **block manager**: a pool of blocks, a free list, per-request block tables grown
#   as tokens are appended, and reference counts;
# - the **scheduler on blocks**: admission when blocks are free, **preemption** by
#   recomputation when they run out, and **chunked prefill**, which computes a long
#   prompt over several steps while the running requests keep decoding;
# - **paged prefill attention**: a kernel for a prompt's new tokens attending over what
#   the cache already holds of it;
# - **prefix caching**: a full block is named by a hash of its tokens and of every token
#   before it, so requests that begin alike share blocks, and freed blocks stay cached
#   until the pool needs them, least recently used first;
# - the engine's **statistics**, the counters a server exports.

# %%
#| default_exp engine.block_manager

# %%
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.measure import load_records
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, has_gpu, where_kernels_run

rng = np.random.default_rng()
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
print(where_kernels_run())

# %% [markdown]
# ## Where chapter 9's memory went
#
# Take the workload chapter 9 measured on the GPU: 256 requests whose prompt and output
# lengths are drawn uniformly from 100 to 1,024 tokens, with `max_model_len` 2,048. Even
# at the moment each request is longest — its prompt and all its output in the cache —
# contiguous rows leave a large share of their slots empty, because a row is sized for
# the longest request there could be, not for this one. Blocks of 16 waste only the
# unfilled end of each request's last block.


# %%
def fragmentation(prompt_lens, output_lens, max_model_len: int, block_size: int):
    """Cache slots reserved and used by requests at their longest, per scheme."""
    tokens = np.asarray(prompt_lens) + np.asarray(output_lens)
    used = int(tokens.sum())
    reserved = {
        "contiguous": len(tokens) * max_model_len,
        "blocks": sum(cdiv(int(n), block_size) for n in tokens) * block_size,
    }
    return {
        scheme: {"reserved": r, "used": used, "waste": 1 - used / r}
        for scheme, r in reserved.items()
    }


# %% tags=["hide-input"]
EMPTY, CACHED, SHARED = "#eeeeee", "#cccccc", "#444444"  # slot and block colours
CENTER = dict(ha="center", va="center", fontsize=7)
BELOW = dict(loc="upper center", fontsize=7, frameon=False)  # a legend under the axes


def plot_fragmentation(prompt_lens, output_lens, max_model_len: int, block_size: int):
    """The slots each scheme reserves: the part that holds tokens, and the waste."""
    numbers = fragmentation(prompt_lens, output_lens, max_model_len, block_size)
    labels = [
        f"contiguous rows\n({max_model_len} slots each)",
        f"blocks of {block_size}\n(as tokens arrive)",
    ]
    fig, ax = new_figure(width=8, height=2.2)
    for y, n in enumerate(numbers.values()):
        empty = n["reserved"] - n["used"]
        ax.barh(y, n["used"], color="#1f77b4")
        ax.barh(y, empty, left=n["used"], color=EMPTY, ec="#999999", hatch="//")
        ax.text(n["used"] / 2, y, f"{n['used']:,} tokens", color="white", **CENTER)
        label = f"  {empty:,} empty ({n['waste']:.1%})"
        ax.text(n["reserved"], y, label, va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, numbers["contiguous"]["reserved"] * 1.3)
    ax.set_xlabel(
        f"KV cache slots reserved for {len(prompt_lens)} running requests", fontsize=8
    )
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=8)
    return fig


# %%
# chapter 9's GPU workload (bench/ch09_batching.py): the same seed, the same lengths
lengths = np.random.default_rng(0)
prompt_lens, output_lens = (
    lengths.integers(100, 1025, 256),
    lengths.integers(100, 1025, 256),
)
frag = fragmentation(prompt_lens, output_lens, 2048, 16)
fig = plot_fragmentation(prompt_lens, output_lens, 2048, 16)
plt.show()
prose.glue("ch10_waste_rows", f"{frag['contiguous']['waste']:.0%}")
prose.glue("ch10_waste_blocks", f"{frag['blocks']['waste']:.1%}")
prose.glue(
    "ch10_rows_fit",
    f"{frag['contiguous']['reserved'] / frag['blocks']['reserved']:.1f} times",
)
prose.glue(
    "ch10_waste_per_request",
    f"{(frag['blocks']['reserved'] - frag['blocks']['used']) / 256:.1f} slots",
)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
Contiguous rows leave {{ch10_waste_rows}} of their slots empty; blocks leave
{{ch10_waste_blocks}} ({{ch10_waste_per_request}} per request). In the memory chapter 9
reserved, blocks hold {{ch10_rows_fit}} as many of these requests — and that is at their
longest: while a request is still early in its answer, its row is emptier still, and
its blocks are fewer.
""")

# %% [markdown]
# There is a second waste that blocks can remove: requests that begin alike. A chat
# server sends the same system prompt before every user's message, and a few-shot
# prompt repeats the same examples; with rows, every request computes and stores its own
# copy. Blocks can be shared.

# %% [markdown]
# ## Blocks, and the name of a block
#
# A block holds `block_size` consecutive tokens of one sequence: their keys and values,
# in every layer. Token $i$ of a sequence lives in block `table[i // block_size]` at
# offset `i % block_size`, so its slot in the cache is
#
# $$\text{slot}(i) = \text{table}[\lfloor i / b \rfloor] \cdot b + (i \bmod b).$$
#
# A full block's contents depend only on the tokens it holds **and on every token before
# them** — attention at a position sees the whole prefix. So a block is named by a hash
# chained through the sequence: the hash of (the previous block's hash, this block's
# token ids). Two requests whose first 1,000 tokens agree produce the same chain for
# their first 62 full blocks of 16, and the second can use the first's blocks instead of
# computing them again. Python's `hash` of a tuple is 64 bits, and it need only agree
# within the one process that holds the cache. Two different blocks can still collide,
# so each cached block keeps the key it was hashed from — its parent's hash and its own
# tokens — and a hit counts only when the keys are equal. (That checks the block's own
# tokens; a collision of two whole prefixes would have to hit the same 64-bit parent
# hash as well, which this book accepts. vLLM can hash with SHA-256 instead.)

# %%
#| export
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class KVBlock:
    """One block of the pool: block_size slots of every layer's keys and values."""

    block_id: int
    ref_count: int = 0  # how many requests' block tables hold it
    block_hash: int | None = None  # set once the block is full and cached
    hash_key: tuple | None = None  # (previous block's hash, token ids): checked on hits


def hash_block(parent_hash: int | None, token_ids) -> tuple[int, tuple]:
    """The chained hash of a full block, and the key it was computed from."""
    key = (parent_hash, tuple(map(int, token_ids)))
    return hash(key), key


# %% [markdown]
# ## The block manager
#
# The pool is a list of blocks and a free list. The free list is ordered by when each
# block was freed, so that it also serves as the prefix cache's eviction order: a freed
# block keeps its hash and stays findable until it is handed out again, and blocks are
# handed out from the front — least recently freed first. A request frees its blocks
# last one first, so of one request, its tail (the part least likely to be shared) goes
# first.
#
# Admission is two calls. `num_cached_tokens(token_ids)` looks up the longest run of
# cached full blocks at the start of a prompt, changing nothing, so that the scheduler
# can decide how many of the remaining tokens fit in the step. `allocate` then takes
# the cached blocks (a block with no other holder leaves the free list) and fresh ones
# for the rest, or refuses, changing nothing, when the pool is short. The prefix never
# covers a whole prompt: the last prompt token is always computed, because its logits
# give the first output token. `append_slots` grows a running request's table, and
# `cache_blocks` names the blocks a step has just filled.

# %%
#| export
from tinyvllm_lib.kernels.checks import cdiv


class BlockManager:
    """A pool of num_blocks KV blocks of block_size tokens, per-request block tables,
    reference counts, and a prefix cache of full blocks evicted least recently used
    first.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(
                f"num_blocks must be a positive integer, got {num_blocks!r}"
            )
        if (
            not isinstance(block_size, int)
            or block_size < 1
            or block_size & (block_size - 1)
        ):
            raise ValueError(f"block_size must be a power of two, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block id -> None, oldest first: the free list and the eviction order
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_tables: dict[str, list[int]] = {}
        # request -> how many of its leading blocks are named (found or cached)
        self.num_named: dict[str, int] = {}
        # request -> (hash, key) of its full blocks so far: each hashed once per request
        self.chains: dict[str, list[tuple[int, tuple]]] = {}
        # free blocks that hold a cached prefix block, counted as they come and go
        # (a server reads it every step: a pass over the free list costs milliseconds)
        self._num_cached_free = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix block."""
        return self._num_cached_free

    def _link(self, request_id: str | None, token_ids, i: int) -> tuple[int, tuple]:
        """(hash, key) of full block i of a request's tokens, hashed once and kept
        (token ids only ever grow) until forget(request_id).
        """
        chain = [] if request_id is None else self.chains.setdefault(request_id, [])
        b = self.block_size
        for j in range(len(chain), i + 1):
            parent = chain[-1][0] if chain else None
            chain.append(hash_block(parent, token_ids[j * b : (j + 1) * b]))
        return chain[i]

    def forget(self, request_id: str) -> None:
        """Drop what is kept of a request that has ended (its block hashes)."""
        self.chains.pop(request_id, None)

    def _cached_prefix(self, token_ids, request_id: str | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks that token_ids starts
        with, leaving at least its last token uncovered.
        """
        if not self.enable_prefix_caching:
            return []
        found = []
        for i in range((len(token_ids) - 1) // self.block_size):
            block_hash, key = self._link(request_id, token_ids, i)
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].hash_key != key:
                break
            found.append(block_id)
        return found

    def num_cached_tokens(self, token_ids, request_id: str | None = None) -> int:
        """How many leading tokens of token_ids the cache holds (changes nothing)."""
        return len(self._cached_prefix(token_ids, request_id)) * self.block_size

    def allocate(
        self, request_id: str, token_ids, num_tokens: int, use_cache: bool = True
    ) -> int | None:
        """Give a new request blocks for its first num_tokens tokens, its cached prefix
        shared (unless use_cache is False): the number of tokens served by the cache,
        or None (nothing changed) when the pool is short.
        """
        if request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits = self._cached_prefix(token_ids, request_id) if use_cache else []
        if num_tokens < len(hits) * self.block_size:
            raise ValueError(
                f"allocate {request_id!r}: {num_tokens} tokens is fewer than its "
                f"{len(hits) * self.block_size} cached ones"
            )
        num_fresh = cdiv(num_tokens, self.block_size) - len(hits)
        # a cached block nobody holds sits in the free list: taking it uses one
        if num_fresh + sum(self.blocks[i].ref_count == 0 for i in hits) > len(
            self.free_queue
        ):
            return None
        for block_id in hits:
            if self.blocks[block_id].ref_count == 0:
                del self.free_queue[block_id]
                self._num_cached_free -= 1
            self.blocks[block_id].ref_count += 1
        self.block_tables[request_id] = hits + [self._take() for _ in range(num_fresh)]
        self.num_named[request_id] = len(hits)
        return len(hits) * self.block_size

    def _take(self) -> int:
        """A fresh block for one holder: the least recently freed, evicted from the
        cache if it was cached.
        """
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._num_cached_free -= 1
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.hash_key = None
        block.ref_count = 1
        return block_id

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold num_tokens tokens; False (nothing changed)
        when the pool is short.
        """
        table = self.block_tables[request_id]
        num_more = cdiv(num_tokens, self.block_size) - len(table)
        if num_more <= 0:  # most calls: a decode step inside its last block
            return True
        if num_more > len(self.free_queue):
            return False
        table.extend(self._take() for _ in range(num_more))
        return True

    def cache_blocks(self, request_id: str, token_ids, num_computed: int) -> None:
        """Name the request's blocks that are now full and computed (its first
        num_computed tokens of token_ids), so that later requests can find them.
        """
        num_full = num_computed // self.block_size
        # O(1) when no block has filled since the last call: a decode step fills one
        # only every block_size-th token
        if not self.enable_prefix_caching or num_full <= self.num_named[request_id]:
            return
        table = self.block_tables[request_id]
        for i in range(self.num_named[request_id], num_full):
            block_hash, key = self._link(request_id, token_ids, i)
            block = self.blocks[table[i]]
            # a block computed twice (two requests in one step) is cached once
            if block_hash not in self.cached:
                self.cached[block_hash] = table[i]
                block.block_hash, block.hash_key = block_hash, key
        self.num_named[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Drop the request's blocks; those no one else holds join the free list, last
        block first, keeping their hashes.
        """
        for block_id in reversed(self.block_tables.pop(request_id)):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                self._num_cached_free += block.block_hash is not None
        del self.num_named[request_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache), only while no request
        holds a block; False, changing nothing, otherwise.
        """
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.hash_key = None
        self.cached.clear()
        self._num_cached_free = 0
        return True

    def slot_mapping(self, request_id: str, start: int, stop: int) -> np.ndarray:
        """Cache slots of the request's tokens start..stop-1, through its table."""
        positions = np.arange(start, stop)
        table = np.asarray(self.block_tables[request_id])
        return table[positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )


# %% [markdown]
# A first look: three requests, a pool of 12 blocks of 4 tokens. The second request
# starts with the same 9 tokens as the first, so once the first's blocks are computed
# and cached, the second finds its first two full blocks in the cache.

# %%
manager = BlockManager(num_blocks=12, block_size=4)
prompt_a = list(range(100, 110))  # 10 tokens: blocks of 4, 4 and 2
prompt_b = prompt_a[:9] + [7, 8, 9]  # shares the first 9 tokens
print("a: cached tokens at admission", manager.allocate("a", prompt_a, len(prompt_a)))
manager.cache_blocks("a", prompt_a, len(prompt_a))  # after a's prefill step
print("b finds", manager.num_cached_tokens(prompt_b), "tokens in the cache")
print("b: cached tokens at admission", manager.allocate("b", prompt_b, len(prompt_b)))
print("tables:", manager.block_tables)
print("reference counts:", [blk.ref_count for blk in manager.blocks])
print("free blocks:", manager.num_free_blocks)
assert manager.block_tables["a"][:2] == manager.block_tables["b"][:2]
manager.free("a")
assert manager.num_cached_tokens(prompt_a) == 8  # a's full blocks stay cached

# %% [markdown]
# The drawing below is a pool of 20 blocks of 4 a moment later. Requests a, b and c
# start with the same two-block system prompt, and a and b share one more block; d
# shares nothing. A request that finished earlier left two full blocks behind: nobody
# holds them, but they keep their hashes until the pool hands them out again. Each
# table entry points at a physical block, shared blocks show how many tables hold them,
# and a last block is only as full as its tokens.


# %% tags=["hide-input"]
def request_colors(names) -> dict:
    """One colour per request, in the order given (the book's tab10 cycle)."""
    return {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}


def draw_block(ax, x, y, fill, color, text="", text_color="k", **kw):
    """One block at (x, y): an outlined box, its first `fill` fraction in `color`."""
    ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, ec="k", lw=0.5, **{"fc": EMPTY, **kw}))
    ax.add_patch(plt.Rectangle((x, y), 0.9 * fill, 0.8, fc=color, lw=0))
    ax.text(x + 0.45, y + 0.4, text, color=text_color, **CENTER)


def draw_block_tables(block_manager, request_ids, token_counts):
    """The pool (top) and each request's block table (below it), an arrow from each
    table entry to its physical block; token_counts[i]: tokens request_ids[i] holds.
    """
    bm, b, colors = block_manager, block_manager.block_size, request_colors(request_ids)
    fill, holder = np.zeros(bm.num_blocks), {}
    fig, ax = new_figure(width=9, height=3.0)
    x = (bm.num_blocks - sum(len(bm.block_tables[r]) + 1 for r in request_ids)) / 2
    for r, n in zip(request_ids, token_counts):
        table = bm.block_tables[r]
        ax.text(x + 0.45 * len(table), -0.25, f"{r}'s table", **CENTER)
        for i, block_id in enumerate(table):
            fill[block_id], holder[block_id] = np.clip(n / b - i, 0, 1), r
            draw_block(ax, x + i, 0, fill[block_id], colors[r], text=block_id)
            arrow = dict(arrowstyle="->", color=colors[r], lw=0.8, alpha=0.7)
            ax.annotate("", (block_id + 0.45, 2), (x + i + 0.45, 0.8), arrowprops=arrow)
        x += len(table) + 1
    for i, block in enumerate(bm.blocks):
        is_cached = block.ref_count == 0 and block.block_hash is not None
        color = SHARED if block.ref_count > 1 else colors.get(holder.get(i), SHARED)
        ref = f"×{block.ref_count}" if block.ref_count > 1 else ""
        style = dict(fc=CACHED, hatch="///") if is_cached else {}
        draw_block(ax, i, 2, fill[i], color, ref, text_color="white", **style)
        ax.text(i + 0.45, 2.95, i, **CENTER)
    ax.text(-0.3, 2.4, "physical\nblocks", ha="right", va="center", fontsize=8)
    legend = [
        Patch(fc=SHARED, label="shared (×ref_count)"),
        Patch(fc=CACHED, ec="k", lw=0.5, hatch="///", label="cached, no holder"),
        Patch(fc=EMPTY, ec="k", lw=0.5, label="free / empty slots"),
    ]
    ax.legend(handles=legend, ncol=3, bbox_to_anchor=(0.5, 0.02), **BELOW)
    ax.set_xlim(-2.5, max(bm.num_blocks, x))
    ax.set_ylim(-0.5, 3.2)
    ax.axis("off")
    return fig


# %%
pool = BlockManager(num_blocks=20, block_size=4)
system = list(range(100, 108))  # a system prompt: two full blocks
live = {
    "a": system + [1, 2, 3, 4, 5, 6, 7],
    "b": system + [1, 2, 3, 4, 9, 9],
    "c": system + [5, 6, 7, 8, 9, 10, 11, 12, 13],
    "d": [50, 51, 52, 53, 54, 55],
}
old = list(range(70, 79))  # a finished request: its full blocks stay cached
pool.allocate("old", old, len(old))
pool.cache_blocks("old", old, len(old))
pool.free("old")
for name, tokens in live.items():
    pool.allocate(name, tokens, len(tokens))
    pool.cache_blocks(name, tokens, len(tokens))  # as their prefill step would
fig = draw_block_tables(pool, list(live), [len(t) for t in live.values()])
plt.show()

# %% [markdown]
# Shared blocks are only ever read. A block is shared only once it is full, and the
# tokens a request appends go into a block of its own: the first block where two
# requests differ is never shared, so nobody writes into a block another request reads.
# vLLM needs **copy-on-write** for a case this book does not have: several samples of
# one prompt (`n > 1`, beam search), which share even a partly filled last block and
# must copy it when the first of them appends a different token. With one sample per
# request, reference counts are enough.
#
# Slot mapping is the block table read forwards: where each new token's keys and values
# go. `slot_mapping("c", 8, 12)` gives the slots of c's tokens 8 to 11, in its third
# block:

# %%
print("c's table:", pool.block_tables["c"])
print("slots of c's tokens 8..11:", pool.slot_mapping("c", 8, 12))

# %% [markdown]
# ## The scheduler on blocks
#
# With blocks, each step is planned under two budgets: tokens (`max_num_batched_tokens`)
# and blocks. Running requests go first, oldest first: a decode needs one slot, a prompt
# being computed in chunks needs its next chunk — as much of the rest as the token
# budget allows (**chunked prefill**: a long prompt no longer holds up every decode
# behind it). When a running request needs a block and none is free, the scheduler
# **preempts** the
# most recently admitted running request, vLLM's policy: it gives back every block and
# goes to the front of the waiting queue, keeping its generated tokens; readmitted, it
# computes prompt and tokens again (**recomputation**, instead of copying its cache to
# the host and back; see below). Then, if nothing was preempted this step, waiting
# requests are admitted first come first served, each starting after its cached prefix.
# A prompt chunk that does not reach the end of the prompt yields no token.

# %%
#| export engine.paged_scheduler
from collections import deque

import numpy as np

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.request import Request, RequestStatus
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tinyvllm_lib.kernels.checks import cdiv


class RequestTokens:
    """A request's tokens as a sliceable sequence, without joining its lists."""

    def __init__(self, request: Request):
        self.request = request

    def __len__(self) -> int:
        return self.request.num_tokens

    def __getitem__(self, s: slice) -> list[int]:
        start, stop, _ = s.indices(self.request.num_tokens)
        return self.request.token_ids(start, stop)


def is_decode(request: Request, num_new: int) -> bool:
    """One new token after a computed prompt: a decode row (else a prompt chunk)."""
    return num_new == 1 and request.num_computed_tokens >= request.num_prompt_tokens


class PagedScheduler:
    """Continuous batching over a BlockManager: chunked prefill, preemption by
    recomputation, prefix caching.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: BlockManager,
    ):
        self.max_num_seqs, self.max_num_batched_tokens = (
            max_num_seqs,
            max_num_batched_tokens,
        )
        self.max_model_len, self.block_manager = max_model_len, block_manager
        self.max_blocks = cdiv(max_model_len, block_manager.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they were admitted
        self.num_preemptions = 0
        self.admitted: set[str] = set()  # unfinished requests admitted at least once
        # request id -> the log-probs of its prompt chunks so far (prompt_logprobs)
        self.prompt_chunks: dict[str, list[tuple]] = {}

    def add_request(self, request: Request) -> None:
        bm = self.block_manager
        # the last token sampled is never fed back: it needs no slot
        most = min(
            request.num_prompt_tokens + request.max_tokens - 1, self.max_model_len
        )
        if cdiv(most, bm.block_size) > bm.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} may need {most} tokens of cache, "
                f"{cdiv(most, bm.block_size)} blocks of {bm.block_size}, more than the "
                f"whole pool of {bm.num_blocks} blocks"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        self.prompt_chunks.pop(request.request_id, None)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _schedule_running(self, budget: int) -> tuple[list, int, bool]:
        """Running requests first, oldest first: their next token or prompt chunk, a
        block taken where one is crossed, the newest preempted while none is free.
        """
        planned, preempted, i = [], False, 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.append_slots(
                request.request_id, request.num_computed_tokens + n
            ):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                planned.append((request, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was the last one, and gave its blocks back
        return planned, budget, preempted

    def _admit(self, budget: int) -> list:
        """Waiting requests in arrival order, each after its cached prefix, while the
        token budget, max_num_seqs and the blocks of their first chunk allow.
        """
        bm, planned = self.block_manager, []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = RequestTokens(request)
            # prompt logprobs need the logits of every prompt position: no cache hits
            # until they are collected
            use_cache = (
                request.params.prompt_logprobs is None
                or request.prompt_logprobs is not None
            )
            cached = (
                bm.num_cached_tokens(tokens, request.request_id) if use_cache else 0
            )
            n = min(request.num_tokens - cached, budget)
            if bm.allocate(request.request_id, tokens, cached + n, use_cache) is None:
                break
            self.waiting.popleft()
            if request.request_id not in self.admitted:  # its first admission
                self.admitted.add(request.request_id)
                request.num_cached_tokens = cached
            request.num_computed_tokens = cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            planned.append((request, n))
            budget -= n
        return planned

    def schedule(self) -> SchedulerOutput | None:
        """The next step: which requests run and how many new tokens each, with their
        block tables; None when there is nothing to run.
        """
        planned, budget, preempted = self._schedule_running(self.max_num_batched_tokens)
        if not preempted:  # a pool that has just run short admits no one
            planned += self._admit(budget)
        if not planned:
            return None
        # prompt chunks first, then one-token decodes, as the runner takes them
        planned.sort(key=lambda p: is_decode(*p))  # stable: admission order within each
        num_prefills = sum(not is_decode(r, n) for r, n in planned)
        requests = [r for r, _ in planned]
        tables, num_blocks = self.block_tables(requests)
        return SchedulerOutput(
            requests, [n for _, n in planned], num_prefills, tables,
            num_blocks=num_blocks,
        )

    def block_tables(self, requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """(len(requests), max_blocks) int32: each request's row of the block table,
        zeros past its blocks; and how many blocks each row holds.
        """
        tables = np.zeros((len(requests), self.max_blocks), np.int32)
        num_blocks = np.zeros(len(requests), np.int64)
        for row, request in enumerate(requests):
            table = self.block_manager.block_tables[request.request_id]
            tables[row, : len(table)], num_blocks[row] = table, len(table)
        return tables, num_blocks

    def postprocess(
        self, step: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[Request]:
        """Count the computed tokens, name the blocks they filled; append a token where
        a request's tokens are all computed; free the finished. The requests that got
        a token.
        """
        s, progressed, j = result.sampled, [], 0  # j: the sampled row
        # Python numbers once for the whole step, not NumPy scalars per row
        token_ids = np.asarray(s.token_ids).tolist()
        logprobs, top_ids, top_logprobs = (
            None if a is None else np.asarray(a).tolist()
            for a in (s.logprobs, s.top_ids, s.top_logprobs)
        )
        block_size, prompt_logprobs = (
            self.block_manager.block_size, result.prompt_logprobs
        )
        for i, (request, n) in enumerate(zip(step.requests, step.num_new_tokens)):
            if request.finish_reason is not None:
                # finished or aborted while the step ran (chapter 11's overlap): its
                # row's token, if it had one, is dropped
                j += request.num_computed_tokens + n >= request.num_tokens
                continue
            computed = request.num_computed_tokens = request.num_computed_tokens + n
            if computed % block_size < n:  # it filled a block
                self.block_manager.cache_blocks(
                    request.request_id, RequestTokens(request), computed
                )
            if prompt_logprobs[i] is not None:
                self._collect_prompt_logprobs(request, prompt_logprobs[i])
            if computed < request.num_tokens:
                continue  # a chunk of its prompt: no token yet
            if logprobs is None:
                request.append_token(token_ids[j])
            else:
                request.append_token(
                    token_ids[j], logprobs[j], *(
                        None if a is None else a[j] for a in (top_ids, top_logprobs)
                    ),
                )
            j += 1
            progressed.append(request)
            if request.finish_reason is not None:
                self._release(request)
        return progressed

    def _collect_prompt_logprobs(self, request: Request, chunk) -> None:
        """Gather a prompt's log-probs chunk by chunk, and set its prompt_logprobs once
        the whole prompt is computed (the first time: a recomputation repeats them).
        """
        if chunk is None or request.prompt_logprobs is not None:
            return
        chunks = self.prompt_chunks.setdefault(request.request_id, [])
        chunks.append(chunk)
        if request.num_computed_tokens >= request.num_prompt_tokens:
            del self.prompt_chunks[request.request_id]
            # (chosen, top ids, top log-probs), each over the chunks in order
            request.set_prompt_logprobs(
                *(None if parts[0] is None else np.concatenate(parts)
                  for parts in zip(*chunks))
            )

    def abort_request(self, request_id: str) -> Request | None:
        """Take a request out, waiting or running, and end it with finish_reason
        'abort'; None if it is not here.
        """
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.admitted.discard(request_id)
                self.block_manager.forget(request_id)
                request.abort()
                return request
        for request in self.running:
            if request.request_id == request_id:
                request.abort()
                self._release(request)
                return request
        return None

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.admitted.discard(request.request_id)
        self.block_manager.free(request.request_id)
        self.block_manager.forget(request.request_id)
        self.prompt_chunks.pop(request.request_id, None)


# %% [markdown]
# **Why recompute, not swap.** vLLM's other policy copies a preempted request's blocks
# to host memory and back. Copying costs a PCIe round trip per block; recomputing costs
# one prefill of the request's tokens, which a GPU computes at hundreds of TFLOP/s and,
# with the prefix cache, often finds partly cached already (a preempted request's full
# blocks keep their hashes when freed). Which costs less depends on the request's
# length and the link; recomputing needs no host buffers and no copies to schedule, and
# vLLM's V1 engine recomputes only.
#
# The scheduler can be watched without a model. A stand-in that answers every due
# request with token 7 is enough to see the plan of each step: below, three short
# requests are decoding when a prompt of 45 tokens arrives, with a budget of 16 tokens a
# step. The long prompt goes in chunks of 13 — the budget less the three decodes — and
# the decodes never stop.

# %%
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampler import SamplerOutput
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput

# %% tags=["hide-input"]
KIND_STYLE = {
    "prefill-chunk": dict(hatch="///"),
    "prefill": {},
    "decode": dict(alpha=0.45),
}


def plot_chunked_timeline(steps, budget: int | None = None):
    """Tokens computed per engine step, stacked by request: hatched, a prompt chunk
    (no token yet); solid, a prompt's last part; light, a one-token decode.
    """
    names = list(dict.fromkeys(name for step in steps for name, _, _ in step))
    colors = request_colors(names)
    fig, ax = new_figure(width=8, height=3.0)
    for s, step in enumerate(steps):
        bottom = 0
        for name, n, kind in step:
            style = dict(color=colors[name], ec="white", lw=0.5, **KIND_STYLE[kind])
            ax.bar(s, n, 0.8, bottom, **style)
            if kind != "decode":
                box = dict(fc=colors[name], ec="none", pad=1)
                ax.text(s, bottom + n / 2, f"{name}: {n}", bbox=box, **CENTER)
            bottom += n
    if budget is not None:
        ax.axhline(budget, color="k", ls="--", lw=1)
        ax.text(-0.4, budget, "token budget", va="bottom", fontsize=7)
        ax.set_ylim(0, budget * 1.15)
    legend = [Patch(fc=colors[r], label=r) for r in names] + [
        Patch(fc="white", ec="#777777", hatch="///", label="prompt chunk"),
        Patch(fc="#777777", alpha=0.45, label="decode"),
    ]
    ax.legend(handles=legend, ncol=len(legend), bbox_to_anchor=(0.5, -0.2), **BELOW)
    ax.set_xticks(range(len(steps)))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("engine step", fontsize=8)
    ax.set_ylabel("tokens computed", fontsize=8)
    ax.tick_params(labelsize=8)
    return fig


# %%
def stand_in_request(name: str, num_prompt: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(num_prompt))
    return Request(name, None, prompt, params, max_tokens, eos_token_ids=[])


def plan_of(step) -> list[tuple[str, int, str]]:
    """(request, new tokens, kind) of each request in a SchedulerOutput."""
    kinds = []
    for r, n in zip(step.requests, step.num_new_tokens):
        done = r.num_computed_tokens + n >= r.num_prompt_tokens
        kinds.append(
            "decode" if is_decode(r, n) else "prefill" if done else "prefill-chunk"
        )
    return [
        (r.request_id, n, k)
        for r, n, k in zip(step.requests, step.num_new_tokens, kinds)
    ]


scheduler = PagedScheduler(8, 16, 128, BlockManager(64, block_size=4))
for name, n in (("a", 6), ("b", 5), ("c", 4)):
    scheduler.add_request(stand_in_request(name, n, 8))
steps = []
while scheduler.has_unfinished_requests():
    if len(steps) == 1:
        scheduler.add_request(stand_in_request("d", 45, 3))  # the long prompt arrives
    step = scheduler.schedule()
    steps.append(plan_of(step))
    due = sum(
        r.num_computed_tokens + n >= r.num_tokens
        for r, n in zip(step.requests, step.num_new_tokens)
    )
    sampled = SamplerOutput(np.full(due, 7, np.int64))
    scheduler.postprocess(step, ModelRunnerOutput(sampled, [None] * len(step.requests)))
fig = plot_chunked_timeline(steps, budget=16)
plt.show()
assert all(sum(n for _, n, _ in s) <= 16 for s in steps)
# the budget less the three decodes
assert [n for s in steps for name, n, _ in s if name == "d"][:3] == [13, 13, 13]

# %% [markdown]
# ## Paged prefill attention
#
# A prompt chunk, or a prompt after a cached prefix, has `n` new tokens after `c` that
# the cache already holds. Its query $i$ sits at position $c + i$ and attends over keys
# $0 \dots c + i$: the cached ones and, causally, its own. Since the step writes its new
# keys and values into the cache before attention runs (chapter 8's `write_kv_cache`),
# all of them can be read from the cache through the block table — the same path decode
# attention takes. The NumPy reference reads the context back and reuses chapter 8's
# `cached_attention_ref`:

# %%
#| export kernels.paged_attention
import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.attention import (
    FLASH_BLOCK_Q,
    cached_attention_ref,
    check_out,
    check_qkv,
    check_query_start_loc,
    check_tiles,
    kernels_by_size,
    make_online_softmax_tile,
)
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.kernels.checks import cdiv, is_device_array
from tinyvllm_lib.kernels.paged_cache import bf16_lane, cache_word, check_paged_context


def paged_prefill_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
):
    """Float32 reference: each sequence's new queries q (T, H, D) over positions
    0..seq_lens[s]-1 of the bf16 cache -> (T, H D).

    Sequence s has n = query_start_loc[s + 1] - query_start_loc[s] new tokens, after c =
    seq_lens[s] - n cached ones: its query i sits at position c + i.
    """
    # (T, H, D)
    q = np.asarray(q, np.float32).reshape(-1, num_heads, head_dim)
    out = np.zeros((q.shape[0], num_heads * head_dim), np.float32)
    starts = np.asarray(query_start_loc)
    for s, seq_len in enumerate(np.asarray(seq_lens)[: len(starts) - 1]):
        start, end = starts[s], starts[s + 1]
        num_cached = seq_len - (end - start)
        pos = np.arange(seq_len)
        slots = (
            np.asarray(block_tables)[s, pos // block_size].astype(np.int64) * block_size
            + pos % block_size
        )
        k = bf16_bits_to_f32(k_cache[slots])  # (seq_len, KVH, D)
        v = bf16_bits_to_f32(v_cache[slots])
        out[start:end] = cached_attention_ref(
            q[start:end], k, v, num_cached + np.arange(end - start)
        )
    return out


# %% [markdown]
# The kernel is chapter 7's flash kernel with two changes. Its key loop starts at
# position 0 of the context, not at the chunk's first token, and stops at the tile's
# last query's position. And it stages K and V tiles from the cache: a key's row of one
# KV head is 64 bf16 values, 16 eight-byte words, so consecutive threads read
# consecutive words (chapter 8's `cache_word` finds a word through the block table) and
# convert them to float32 on the way into shared memory. Element $e$ of word $w$ goes to
# column $e \cdot 16 + w$ rather than $4w + e$: the 16 threads that store one key's
# row then hit 16 different banks, and a warp's two rows (64 floats apart) share them —
# a two-way conflict where the plain layout has four. (Padding each row by 16 floats
# would remove it; not measured here.) The queries and accumulators use the same
# permutation, and a
# dot product does not care about the order of its terms. A row past the context's last
# key reloads that key instead of reading a slot nobody wrote, and no query reads it.

# %% [markdown]
# Which block runs which query tile is not the grid's to say. Chapter 7's grid was a
# block per (query head, query tile, sequence) sized by the longest sequence, so every
# shorter sequence left blocks with nothing to do, and it had to be sized from host
# integers (the longest sequence, how many there are) at every launch. Here the host
# writes a *tile schedule* instead: one entry per (sequence, query tile) of the batch,
# its sequence in the high bits and its tile in the low ones, ordered with the tiles
# that visit the most keys first (a long context's last tile starts before anything
# short, across the whole batch, not only within a sequence), and padded with -1 to a
# capacity that depends only on the step's token and sequence counts: a sequence of $n$
# new tokens has $\lceil n / 64 \rceil$ tiles, so $T$ tokens of $R$ sequences never need
# more than $\lceil T / 64 \rceil + R$. The grid is (query heads, capacity); a block
# whose entry is -1 returns at once. That is what lets chapter 11 capture a prefill step
# in a CUDA graph: the grid no longer changes with the batch, only the schedule's bytes
# do.

# %%
#| export kernels.paged_attention
TILE_SHIFT = 16  # a schedule entry: sequence << TILE_SHIFT | query tile
TILE_MASK = (1 << TILE_SHIFT) - 1


def tile_capacity(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The most schedule entries T tokens of R sequences can need."""
    return cdiv(num_tokens, block_q) + num_seqs


def prefill_tiles(query_start_loc, seq_lens, block_q: int, out=None) -> np.ndarray:
    """The paged prefill kernel's tile schedule (int32): an entry per (sequence, query
    tile), sequence << TILE_SHIFT | tile, those with the most keys to visit first; -1
    fills the rest of `out` (default: exactly the entries).
    """
    starts = np.asarray(query_start_loc, np.int64)
    num_new = np.diff(starts)
    cached = np.asarray(seq_lens, np.int64)[: len(num_new)] - num_new
    counts = -(-num_new // block_q)  # tiles per sequence
    seq = np.repeat(np.arange(len(num_new)), counts)
    tile = np.arange(len(seq)) - np.repeat(np.cumsum(counts) - counts, counts)
    keys = cached[seq] + np.minimum(num_new[seq], (tile + 1) * block_q)
    order = np.argsort(-keys, kind="stable")
    max_seqs = 2 ** (31 - TILE_SHIFT) - 1  # seq << TILE_SHIFT stays a positive int32
    if len(num_new) > max_seqs or counts.max(initial=0) > TILE_MASK + 1:
        raise ValueError(f"a tile schedule holds up to {max_seqs} sequences "
                         f"of up to {TILE_MASK + 1} tiles")
    out = np.empty(len(seq), np.int32) if out is None else out
    if len(out) < len(seq):
        raise ValueError(f"the schedule needs {len(seq)} entries, out holds {len(out)}")
    out[: len(seq)] = (seq[order] << TILE_SHIFT) | tile[order]
    out[len(seq) :] = -1
    return out


def host_array(a) -> np.ndarray:
    """A NumPy copy of a device array (it waits for the copy), or `a` itself."""
    return a.copy_to_host() if is_device_array(a) else np.asarray(a)


# %% [markdown]
# Three sequences — 3 new tokens, 97 new after 20 cached, one decode row after 39 —
# give four entries, the second sequence's last tile (117 keys) first:

# %%
schedule = prefill_tiles([0, 3, 100, 101], [3, 117, 40], block_q=64)
print([(int(e) >> TILE_SHIFT, int(e) & TILE_MASK) for e in schedule])
assert schedule.tolist() == [1 << TILE_SHIFT | 1, 1 << TILE_SHIFT, 2 << TILE_SHIFT, 0]

# %%
#| export kernels.paged_attention
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

# 8-byte words (4 bf16 values) of K and of V per thread loaded before any is stored:
# the same registers and bytes in flight as the flash kernel's FLASH_STAGE floats
PAGED_STAGE = 4


def make_paged_prefill_kernel(head_dim: int, block_q: int, block_k: int):
    """Causal GQA attention of new tokens over a paged bf16 KV cache: a block per
    (query head, entry of the tile schedule), K/V tiles staged through the block table.
    """
    D, BQ, BK, STAGE = head_dim, block_q, block_k, PAGED_STAGE
    tile_step = make_online_softmax_tile(D, BK)
    WPR = D // 4  # 8-byte words in one key's row of one KV head
    TILE_WORDS = BK * WPR

    @cuda.jit
    def kernel(
        qkv,
        k_cache,
        v_cache,
        block_tables,
        block_shift,
        seq_lens,
        query_start_loc,
        tiles,
        num_heads,
        num_kv_heads,
        scale,
        out,
    ):
        # query head, row of the tile; the schedule says which sequence and tile
        h, t, tile = cuda.blockIdx.x, cuda.threadIdx.x, tiles[cuda.blockIdx.y]
        if tile < 0:  # an idle entry of a schedule padded to its capacity: it leaves
            return  # before waiting (the schedule comes from the host, not a kernel)
        wait_for_previous_kernel()
        seq, q_tile = tile >> TILE_SHIFT, tile & TILE_MASK
        start = query_start_loc[seq]  # the sequence's first new row in qkv
        num_new = query_start_loc[seq + 1] - start
        num_cached = seq_lens[seq] - num_new
        i = q_tile * BQ + t  # this thread's query, counted from the first new token
        is_query = i < num_new
        pos = num_cached + i  # its position: it sees keys 0..pos
        kvh = uint32(h // (num_heads // num_kv_heads))
        bt_row = block_tables[seq]  # this sequence's blocks
        block_mask = (uint32(1) << block_shift) - uint32(1)
        # column c of a tile holds dimension 4 (c % WPR) + c // WPR: element e of word w
        # goes to column e WPR + w, so a warp's stores hit different banks
        k_tile = cuda.shared.array((BK, D), float32)
        v_tile = cuda.shared.array((BK, D), float32)
        q = cuda.local.array(D, float32)  # registers: D is a constant
        acc = cuda.local.array(D, float32)
        s = cuda.local.array(BK, float32)
        kw = cuda.local.array(STAGE, uint64)  # K and V words on their way
        vw = cuda.local.array(STAGE, uint64)
        for w in range(WPR):
            for e in range(4):
                # column e WPR + w of a tile holds dimension 4 w + e
                q[e * WPR + w] = (
                    qkv[start + i, h * D + 4 * w + e] * scale
                    if is_query
                    else float32(0.0)
                )
                acc[e * WPR + w] = float32(0.0)
        m, ell = float32(-math.inf), float32(0.0)
        # causal: no key after the tile's last query
        num_keys = num_cached + min(num_new, (q_tile + 1) * BQ)
        for k_start in range(0, num_keys, BK):
            cuda.syncthreads()  # everyone is done with the previous tile
            # stage K and V: consecutive threads, consecutive words of a key's row; each
            # thread issues STAGE loads of each before it stores any. Rows past the
            # last key reload it: no query reads them
            for w0 in range(t, TILE_WORDS, STAGE * BQ):
                for u in range(STAGE):
                    w = w0 + u * BQ
                    key = min(k_start + w // WPR, num_keys - 1)
                    word = cache_word(
                        bt_row,
                        uint32(key),
                        block_shift,
                        block_mask,
                        uint32(num_kv_heads),
                        kvh,
                        WPR,
                        uint32(w % WPR),
                    )
                    kw[u] = k_cache[word]
                    vw[u] = v_cache[word]
                for u in range(STAGE):
                    w = w0 + u * BQ
                    if w < TILE_WORDS:
                        row, col = w // WPR, w % WPR
                        for e in range(4):
                            k_tile[row, e * WPR + col] = bf16_lane(kw[u], e)
                            v_tile[row, e * WPR + col] = bf16_lane(vw[u], e)
            cuda.syncthreads()
            if is_query and k_start <= pos:
                # causal: keys k_start .. pos; later rows are never read
                num_visible = min(BK, pos - k_start + 1)
                # chapter 7's step (the columns' order is the tiles' own)
                m, ell = tile_step(q, k_tile, v_tile, num_visible, s, acc, m, ell)
        if is_query:
            inv_ell = float32(1.0) / ell
            for w in range(WPR):
                for e in range(4):
                    store_activation(
                        out, start + i, h * D + 4 * w + e, acc[e * WPR + w] * inv_ell
                    )

    kernel.block_q, kernel.block_k, kernel.head_dim = BQ, BK, D
    kernel.reads_before_wait = True  # its schedule entry; it writes only after
    return kernel


# built on first use for other sizes, as chapter 7's flash kernels
paged_prefill_kernel_for = kernels_by_size(make_paged_prefill_kernel)
paged_prefill_d64_kernel = paged_prefill_kernel_for(64)
paged_prefill_d128_kernel = paged_prefill_kernel_for(128)


# %% [markdown]
# The launch checks its arguments as the other kernels do — the paged context's (the
# caches, block tables, lengths and block size) with chapter 8's `check_paged_context`,
# the one check decode attention makes too — and builds the tile schedule from the
# lengths when it is not given one (a copy to the host, so it waits: an engine packs
# the schedule with the step's other inputs instead).


# %%
#| export kernels.paged_attention
def paged_prefill_attention(
    qkv,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    max_query_len: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    out,
    stream=0,
    block_q: int = FLASH_BLOCK_Q,
    block_k: int | None = None,
    tiles=None,
):
    """Causal GQA attention of each sequence's new tokens over its whole context in a
    paged bf16 KV cache.

    qkv float32 (T, (H + 2 KVH) D) holds the new tokens back to back (only Q is read);
    sequence s is rows query_start_loc[s] .. query_start_loc[s + 1] - 1, none longer
    than max_query_len, after seq_lens[s] - (its new tokens) cached ones. Position p of
    sequence s is at slot block_tables[s, p // block_size] * block_size + p %
    block_size, block_size a power of two. Every key and value is read from the cache:
    write_kv_cache must have stored the new tokens' first. out (T, H D): float32, or
    bf16 bits (uint16). tiles: prefill_tiles(...) of these sequences at this block_q,
    on the GPU (an engine packs it with the step's inputs); None: built here from the
    lengths copied to the host, which waits for the stream.
    """
    name = "paged_prefill_attention"
    num_tokens = check_qkv(name, qkv, num_heads, num_kv_heads, head_dim)
    check_out(name, out, (num_tokens, num_heads * head_dim))
    num_seqs = check_query_start_loc(name, query_start_loc, max_query_len, num_tokens)
    # head_dim a multiple of 4: 8-byte words of bf16
    block_k = check_tiles(name, head_dim, block_q, block_k, multiple=4)
    k64, v64 = check_paged_context(
        name,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        block_size,
        num_seqs,
        num_kv_heads,
        head_dim,
        query_start_loc,
    )
    if num_tokens == 0 or max_query_len == 0:
        return out
    if tiles is None:  # the schedule from the host's copy of the lengths (it waits)
        tiles = cuda.to_device(
            prefill_tiles(host_array(query_start_loc), host_array(seq_lens), block_q),
            stream=stream,
        )
    kernel = paged_prefill_kernel_for(head_dim, block_q, block_k)
    # x fastest: every head's entries in the schedule's order
    grid = (num_heads, tiles.shape[0])
    kernel[grid, block_q, stream](
        qkv,
        k64,
        v64,
        block_tables,
        np.uint32(int(block_size).bit_length() - 1),
        seq_lens,
        query_start_loc,
        tiles,
        num_heads,
        num_kv_heads,
        np.float32(1 / math.sqrt(head_dim)),
        out,
    )
    return out


# qkv, k and v caches as 8-byte words, block_tables, block_shift, seq_lens,
# query_start_loc, tiles, num_heads, num_kv_heads, scale
_PAGED_ARGS = (
    "float32[:, ::1], uint64[::1], uint64[::1], int32[:, ::1], uint32, int32[::1], "
    "int32[::1], int32[::1], int64, int64, float32"
)
PTX_SIGNATURES = {
    name: [f"void({_PAGED_ARGS}, {out}[:, ::1])" for out in ("float32", "uint16")]
    for name in ("paged_prefill_d64_kernel", "paged_prefill_d128_kernel")
}


# %% [markdown]
# Against the reference, on a batch with a prompt from position 0, one after 13 cached
# tokens (not a whole number of blocks), one single new token after 20, and one longer
# than a query tile; block tables are a shuffled pool, and every slot outside a context
# holds NaN, so a read outside one would show:

# %%
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.kv_cache_write import write_kv_cache_ref

H_, KVH_, D_, B_ = 4, 2, 16, 4
seqs = [(0, 9), (13, 6), (20, 1), (5, 70)]  # (cached, new) per sequence
seq_lens = np.array([c + n for c, n in seqs], np.int32)
starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
max_blocks = max(cdiv(int(n), B_) for n in seq_lens)
tables = rng.permutation(len(seqs) * max_blocks + 3)[: len(seqs) * max_blocks]
tables = tables.reshape(len(seqs), max_blocks).astype(np.int32)
shape = ((len(seqs) * max_blocks + 3) * B_, KVH_, D_)
k_cache = np.full(shape, 0x7FC0, np.uint16)  # NaN in bf16
v_cache = np.full(shape, 0x7FC0, np.uint16)
for s, (c, n) in enumerate(
    seqs
):  # the cached part, then the new tokens as a step writes them
    pos = np.arange(c)
    slots = tables[s, pos // B_] * B_ + pos % B_
    k_cache[slots] = f32_to_bf16_bits(
        rng.standard_normal((c, KVH_, D_), dtype=np.float32)
    )
    v_cache[slots] = f32_to_bf16_bits(
        rng.standard_normal((c, KVH_, D_), dtype=np.float32)
    )
qkv = rng.standard_normal((int(starts[-1]), (H_ + 2 * KVH_) * D_), dtype=np.float32)
new_positions = np.concatenate([c + np.arange(n) for c, n in seqs])
new_seq = np.repeat(np.arange(len(seqs)), [n for _, n in seqs])
slot_mapping = (
    tables[new_seq, new_positions // B_].astype(np.int64) * B_ + new_positions % B_
)
write_kv_cache_ref(qkv, H_, KVH_, slot_mapping, k_cache, v_cache)
want = paged_prefill_attention_ref(
    qkv[:, : H_ * D_], k_cache, v_cache, tables, seq_lens, starts, B_, H_, KVH_, D_
)
if can_launch():  # the kernel against the reference (NaN outside every context)
    got = np.zeros((int(starts[-1]), H_ * D_), np.float32)
    d = {
        name: cuda.to_device(a)
        for name, a in (
            ("qkv", qkv),
            ("k", k_cache),
            ("v", v_cache),
            ("t", tables),
            ("l", seq_lens),
            ("s", starts),
        )
    }
    out_d = cuda.to_device(got)
    paged_prefill_attention(
        d["qkv"], d["k"], d["v"], d["t"], d["l"], d["s"], 70, B_, H_, KVH_, D_, out_d
    )
    got = out_d.copy_to_host()
    print(f"max |kernel - reference| = {np.abs(got - want).max():.2e}")
    assert np.isfinite(got).all() and np.abs(got - want).max() < 1e-5

# %% [markdown]
# ## Paged attention, both halves
#
# Chapter 8's `PagedAttention` already read decode contexts through block tables; its
# prefills attended only among their own new tokens, with chapter 7's flash kernel, so a
# prompt had to start at position 0. A prompt chunk, or a prompt after a cached prefix,
# starts later: its queries must see the keys of every token before them. Since the
# step's new keys and values are written into the cache first, everything such a prefill
# attends over is in the cache, and `paged_prefill_attention` reads it all through the
# block table. It does so for every prefill, even one from position 0: it reads bf16
# keys where the flash kernel reads float32 ones from `qkv`, half the bytes (the
# measurements at the end of this chapter put the two side by side). A step with a
# prefill also runs its one-token decodes through the same kernel, one tile each, so
# that the step is one launch over one schedule — what chapter 11 captures; a step of
# decodes only keeps decode attention, which splits long contexts across blocks.
#
# With `FUSE_DECODE_ROPE` on, a decode-only step also leaves out the separate
# RoPE-and-write launch: chapter 8's decode kernel rotates the queries as it loads
# them and stores each row's newest K and V itself, in the one block that reads them
# (`fuse_rope`). A step with a prefill keeps the write, since every tile of its
# schedule reads the new keys from the cache. It is off: chapter 15 measures why.

# %%
#| export layers.attention
from tinyvllm_lib.kernels.decode_attention import decode_attention
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.kv_cache_write import cache_new_kv
from tinyvllm_lib.kernels.paged_attention import paged_prefill_attention
from tinyvllm_lib.layers.attention_metadata import AttentionMetadata

# a decode-only step's RoPE and K/V store inside decode attention, where its launcher
# takes them (fuses_rope). Off: chapter 15's batch-1 measurement, where attention grew
# by about the launch saved; a batch of hundreds of rows has not been measured
FUSE_DECODE_ROPE = False


class PagedAttention:
    """The kernel model's attention over the bf16 KV cache
    (engine.kv_cache.CudaKVCache), for one step.

    Called as attention(layer, qkv, out, stream, rope): rotates q and k by rope =
    (table, positions) as it stores the new tokens' K/V at their slots (rope None: they
    are rotated already). A step with a prefill (metadata.num_prefills > 0) runs every
    sequence, its one-token decodes too, through paged_prefill_attention over `tiles`
    (its tile schedule on the GPU; None: built from the lengths); a decode-only step
    runs decode_attention. prefill_attention: the prefill kernel's launcher, with
    paged_prefill_attention's signature (chapter 14's tensor-core kernel has it);
    decode_attention: the decode kernel's launcher, with chapter 8's signature (chapter
    14's tensor-core one has it). fuse_rope (default FUSE_DECODE_ROPE): a decode-only
    step hands rope and the slots to a launcher marked fuses_rope, which rotates and
    stores the new K/V itself, instead of launching the write first.
    metadata's arrays are on the GPU; workspace comes from decode_workspace;
    max_context_len bounds every context, so decode attention's grid does not change
    while they grow.
    """

    def __init__(
        self,
        config,
        cache,
        metadata: AttentionMetadata,
        workspace=None,
        max_context_len: int | None = None,
        decode_config: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
        tiles=None,
        prefill_attention=paged_prefill_attention,
        decode_attention=decode_attention,
        fuse_rope: bool | None = None,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.cache, self.metadata, self.workspace = cache, metadata, workspace
        self.max_context_len, self.decode_config = max_context_len, decode_config
        self.tiles, self.prefill_attention = tiles, prefill_attention
        self.decode_attention = decode_attention
        fuse_rope = FUSE_DECODE_ROPE if fuse_rope is None else fuse_rope
        self.fuse_rope = fuse_rope and getattr(decode_attention, "fuses_rope", False)

    def __call__(self, layer: int, qkv, out, stream=0, rope=None) -> None:
        m, H, KVH, D = self.metadata, self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        # a decode-only step's write goes inside decode attention (fuse_rope)
        fused = self.fuse_rope and rope is not None and not m.num_prefills
        inside = {"rope": rope, "slot_mapping": m.slot_mapping} if fused else {}
        if not fused:
            cache_new_kv(qkv, rope, H, KVH, m.slot_mapping, k_cache, v_cache, stream)
        if m.num_prefills:  # one tile schedule over every sequence of the step
            self.prefill_attention(
                qkv, k_cache, v_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                m.max_query_len, m.block_size, H, KVH, D, out, stream=stream,
                tiles=self.tiles,
            )
        elif m.num_decodes:
            self.decode_attention(
                qkv,
                self.cache.k_words[layer],
                self.cache.v_words[layer],
                m.block_tables,
                m.block_size,
                m.seq_lens,
                H,
                KVH,
                D,
                out,
                stream=stream,
                workspace=self.workspace,
                max_context_len=self.max_context_len,
                config=self.decode_config,
                **inside,
            )


# %% [markdown]
# ## The engine on blocks
#
# The engine's `step()` is still chapter 9's schedule → execute → postprocess, with two
# counters added; what changes is its constructor, where the memory goes. Chapter 9
# reserved `max_num_seqs × max_model_len` slots up front. Now the engine first loads the
# weights and makes every buffer a step needs (the runner makes them all at once, for
# the largest step), then measures what is left, and gives the share
# `gpu_memory_utilization` allows (vLLM's name and default, 0.9) to KV blocks. On the
# CPU a byte budget does the same (`kv_cache_memory_bytes`, 4 GiB by default, as vLLM's
# CPU backend). `num_kv_blocks=N` sets the pool outright; the tests use it. The pool is
# never larger than chapter 9's reservation: more blocks than `max_num_seqs` sequences
# of `max_model_len` tokens can fill would only hold cached prefixes.
#
# The engine also counts what a server will export (chapter 12): steps, preemptions,
# prompt tokens and how many of them came from the cache, generated tokens, the requests
# running at once, and the blocks in use, now and at their peak.

# %%
#| export engine.stats
from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine started, and its KV pool (llm.llm_engine.stats)."""

    num_steps: int = 0
    num_preemptions: int = 0
    # of the requests that have had their first token
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of those, read from the prefix cache
    num_generated_tokens: int = 0
    num_running: int = 0  # requests running after the last step's schedule
    max_num_running: int = 0  # the most at once
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # blocks some request holds, now
    max_kv_blocks_used: int = 0
    # free blocks that still hold a cached prefix (evicted when the pool needs them)
    kv_blocks_cached: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """The share of prompt tokens read from the cache instead of computed."""
        return self.num_cached_prompt_tokens / max(self.num_prompt_tokens, 1)


# %% [markdown]
# The constructor, then: the same checks as chapter 9's, except that the step budget
# may now be smaller than `max_model_len` (a long prompt is computed in chunks), and
# the pool sized as above.

# %%
#| export engine.llm_engine
#| public LLMEngine
import itertools
from dataclasses import replace

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.config import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    positive_int,
    resolve_device,
)
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.inputs import make_request
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.outputs import RequestOutput
from tinyvllm_lib.engine.paged_scheduler import PagedScheduler
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampling_params import RequestOutputKind
from tinyvllm_lib.engine.stats import EngineStats
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.runtime import has_gpu
from tinyvllm_lib.tokenizer import Tokenizer

CPU_KV_CACHE_BYTES = 4 * 2**30  # the CPU's default pool, as vLLM's CPU backend


class LLMEngine:
    """vLLM's engine loop: add_request(...) any time, then step() while
    has_unfinished_requests().

        step() = scheduler.schedule() -> model_runner.execute()
                 -> scheduler.postprocess()

    returns the requests that progressed, each as a RequestOutput with its text so far
    and `finished`. The KV cache is a pool of blocks (num_kv_blocks, or sized from
    gpu_memory_utilization / kv_cache_memory_bytes) that the scheduler's BlockManager
    hands out; enable_prefix_caching shares the blocks of common prompt prefixes.
    On the GPU decode steps replay CUDA graphs (chapter 11) unless enforce_eager, and
    with async_scheduling (on with graphs) the next decode step is launched before the
    last one is post-processed. On a GPU, start-up compiles every kernel a request can
    reach (chapter 11's warm_up_model).
    """

    def __init__(
        self, model: "str | EngineConfig" = "smollm2", device: str = "auto",
        **engine_args,
    ):
        """An EngineConfig, or its fields: LLMEngine(folder, "cpu", max_num_seqs=4)."""
        if isinstance(model, EngineConfig):
            if engine_args or device != "auto":
                raise TypeError("give an EngineConfig or its fields, not both")
            c = model
        else:
            c = EngineConfig(model, device, **engine_args)
        self.folder = resolve_model(c.model)
        self.config = ModelConfig.from_folder(self.folder)
        # chapter 15: a folder of 8-bit weights names its format, which quantization=
        # may repeat but not contradict
        from tinyvllm_lib.quantization.checkpoint import resolve_quantization

        c = replace(c, quantization=resolve_quantization(self.folder, c.quantization))
        c.check_quantize_lm_head()
        # None: prompts are token ids
        self.tokenizer = Tokenizer.from_folder(self.folder, missing_ok=True)
        limit = self.config.max_position_embeddings
        max_model_len = c.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len must be an integer in [2, {limit}] (the model's "
                f"max_position_embeddings), got {max_model_len!r}"
            )
        # the config completed for this model: what every part reads
        self.engine_config = c = replace(
            c,
            device=resolve_device(c.device),
            max_model_len=max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens
            or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, c.max_num_seqs),
        )
        self.device, self.max_model_len = c.device, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = (
            c.max_num_seqs,
            c.max_num_batched_tokens,
        )
        block_size = c.block_size
        # (chapter 13's ranks run eagerly: graphs across ranks are left to the two-GPU
        # run)
        is_parallel = c.tensor_parallel_size > 1
        graphs = self.device == "cuda" and not c.enforce_eager and not is_parallel
        sampler = None
        if self.device == "cuda":
            # chapter 11: log-probs computed on the GPU
            from tinyvllm_lib.engine.cuda_graphs import GpuLogprobsSampler as sampler
        # the weights and every step buffer first; the KV cache takes what is left
        if is_parallel:  # chapter 13: rank 0's runner, and a process per other rank
            from tinyvllm_lib.distributed.executor import MultiprocExecutor

            self.model_runner = MultiprocExecutor(self.folder, c, sampler=sampler)
        else:
            self.model_runner = ModelRunner(self.folder, c, sampler=sampler)
        num_blocks = self._num_kv_blocks(
            c.num_kv_blocks,
            c.gpu_memory_utilization,
            c.kv_cache_memory_bytes,
            block_size,
        )
        self.model_runner.init_kv_cache(num_blocks * block_size)
        if graphs:
            # chapter 11: decode steps captured once per batch size over the cache,
            # then replayed; a part the runner holds
            from tinyvllm_lib.engine.cuda_graphs import CudaGraphs

            self.model_runner.graphs = CudaGraphs(self.model_runner)
        if self.device == "cuda" and has_gpu() and not is_parallel:
            # chapter 11: every kernel a request can reach is compiled now, not under
            # the first request that reaches it
            from tinyvllm_lib.engine.warm_up import warm_up_model

            warm_up_model(self.model_runner)
        self.block_manager = BlockManager(
            num_blocks, block_size, c.enable_prefix_caching
        )
        # chapter 11: one decode step in flight while the host post-processes the last
        self.async_scheduling = self._async_scheduling(c.async_scheduling)
        scheduler = PagedScheduler
        if self.async_scheduling:
            from tinyvllm_lib.engine.async_scheduler import AsyncScheduler as scheduler
        self.scheduler = scheduler(
            c.max_num_seqs, c.max_num_batched_tokens, max_model_len, self.block_manager
        )
        self._in_flight = None  # (the step, its AsyncModelRunnerOutput)
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        # for requests without a seed of their own
        self.rng = np.random.default_rng(c.seed)
        # unfinished (and aborted but not yet reported) requests by id
        self.requests: dict[str, Request] = {}
        # their last RequestOutput goes out with the next step
        self._aborted: list[Request] = []
        self._ids = itertools.count()

    def _num_kv_blocks(self, num_kv_blocks, utilization, budget, block_size) -> int:
        """The pool's size in blocks: as given, or what the memory budget holds, at
        most what max_num_seqs sequences of max_model_len tokens can use.
        """
        per_block = block_size * kv_cache_bytes_per_token(
            self.config, self.model_runner.kv_cache_dtype
        )
        most = self.max_num_seqs * cdiv(self.max_model_len, block_size)
        if num_kv_blocks is not None:
            return positive_int("num_kv_blocks", num_kv_blocks)
        if budget is None and self.device == "cuda" and has_gpu():
            free, total = cuda.current_context().get_memory_info()
            # what is in use now (weights, step buffers, other processes) is not ours
            # to give
            budget = int(utilization * total) - (total - free)
            where = (
                f"gpu_memory_utilization={utilization} of {total / 2**30:.1f} GiB "
                f"with {(total - free) / 2**30:.1f} GiB in use"
            )
        else:
            budget = CPU_KV_CACHE_BYTES if budget is None else budget
            where = f"kv_cache_memory_bytes={budget}"
        num_blocks = min(budget // per_block, most)
        # the longest request must fit
        if num_blocks < cdiv(self.max_model_len, block_size):
            raise ValueError(
                f"{where} leaves room for {max(num_blocks, 0)} KV blocks of "
                f"{block_size} tokens ({per_block} bytes each), fewer than one "
                f"sequence of max_model_len = {self.max_model_len} needs: lower "
                "max_model_len or max_num_batched_tokens, or give the cache more "
                "memory"
            )
        return int(num_blocks)

    @property
    def stats(self) -> EngineStats:
        """The counters, with the pool as it is now."""
        bm = self.block_manager
        return replace(
            self._stats,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks,
        )

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def make_request(
        self,
        request_id: str,
        prompt,
        params=None,
        name: str = "prompt",
        streams_text: bool = False,
    ) -> Request:
        """A checked Request for a prompt (text, token ids or a dict), not added yet;
        ValueError on bad input. streams_text: the caller reads its text as it grows.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(
                f"request_id must be a non-empty string, got {request_id!r}"
            )
        if request_id in self.requests:
            raise ValueError(
                f"request_id {request_id!r} is already in use by an unfinished request"
            )
        return make_request(
            request_id,
            prompt,
            params,
            tokenizer=self.tokenizer,
            vocab_size=self.config.vocab_size,
            eos_token_ids=self.config.eos_token_ids,
            max_model_len=self.max_model_len,
            default_generator=self.rng,
            name=name,
            streams_text=streams_text,
        )

    def enqueue(self, request: Request) -> None:
        """Add a request made by make_request: it waits for blocks, then runs step by
        step. ValueError if it could never fit in the pool.
        """
        if request.request_id in self.requests:
            raise ValueError(
                f"request_id {request.request_id!r} is already in use by an "
                "unfinished request"
            )
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request

    def add_request(self, request_id: str, prompt, params=None) -> None:
        """vLLM's add_request: check the prompt and its SamplingParams, then queue
        it.
        """
        self.enqueue(self.make_request(request_id, prompt, params))

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (a benchmark's runs then start alike); only between
        requests: False while any is unfinished.
        """
        if self.has_unfinished_requests():
            return False
        return self.block_manager.reset_prefix_cache()

    def abort_request(self, request_id: str) -> None:
        """End a request now, waiting or running (finish_reason 'abort'); its blocks
        are freed at once.
        """
        request = self.requests.get(request_id)
        if request is None or request in self._aborted:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        self.scheduler.abort_request(request_id)
        self._aborted.append(request)

    def _async_scheduling(self, wanted: bool | None) -> bool:
        """Whether steps overlap: only where decode steps replay CUDA graphs, which a
        step planned ahead of its tokens needs (None: wherever it can).
        """
        can = self.model_runner.graphs is not None
        if wanted and not can:
            raise ValueError(
                "async_scheduling needs CUDA graphs (device='cuda' without "
                "enforce_eager)"
            )
        return can if wanted is None else bool(wanted)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._aborted)
            or self._in_flight is not None
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def shutdown(self) -> None:
        """Stop the processes of chapter 13's other ranks (nothing on one rank)."""
        self.model_runner.shutdown()

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, postprocess: the RequestOutput of every request that
        progressed or was aborted.
        """
        done, self._aborted = self._aborted, []
        # aborted since the last step: finish_reason "abort"
        outputs = [r.output() for r in done]
        if self._in_flight is None:
            step = self.scheduler.schedule()
            if step is not None:
                self._count_schedule()
                if self.async_scheduling:  # chapter 11: launched, not waited for
                    self._in_flight = (step, self.model_runner.execute_async(step))
                else:
                    result = self.model_runner.execute(step)
                    self._postprocess(step, result, outputs, done)
        if self._in_flight is not None:
            self._step_in_flight(outputs, done)
        for request in done:
            del self.requests[request.request_id]
        return outputs

    def _step_in_flight(self, outputs: list, done: list) -> None:
        """Chapter 11's overlap: launch the decode step after the one in flight, then
        wait for that one and post-process it while the GPU runs the next.
        """
        step, pending = self._in_flight
        self._in_flight = None
        # only after a replayed decode step: the step ahead replays a graph too
        ahead = (
            self.scheduler.schedule_ahead(step)
            if pending.cudagraph_size is not None
            else None
        )
        if ahead is not None:
            self._count_schedule()
            self._in_flight = (ahead, self.model_runner.execute_async(ahead))
        self._postprocess(step, pending.get_output(), outputs, done)

    def _postprocess(self, step, result, outputs: list, done: list) -> None:
        progressed = self.scheduler.postprocess(step, result)
        self._stats.num_generated_tokens += len(progressed)  # a token each
        final_only = RequestOutputKind.FINAL_ONLY
        for request in progressed:
            if len(request.output_token_ids) == 1:  # its first: its prompt is done
                self._count_prompt(request)
            if request.finish_reason is not None:
                outputs.append(request.output())
                done.append(request)
            elif request.params.output_kind is not final_only:
                outputs.append(request.output())

    def _count_schedule(self) -> None:
        s = self._stats
        s.num_steps += 1
        s.max_num_running = max(s.max_num_running, len(self.scheduler.running))
        s.max_kv_blocks_used = max(
            s.max_kv_blocks_used, self.block_manager.num_used_blocks
        )

    def _count_prompt(self, request: Request) -> None:
        s = self._stats
        s.num_prompt_tokens += request.num_prompt_tokens
        s.num_cached_prompt_tokens += request.num_cached_tokens


# %% [markdown]
# ## The engine under pressure
#
# A tiny random Llama on the CPU makes the engine's behaviour quick to see. 64 requests
# of random lengths run twice: on a pool as large as they could ever need, and on a
# quarter of what they need at once. On the small pool the scheduler must preempt;
# every request still finishes, with the same greedy tokens.

# %%
tiny_folder = make_random_llama(
    tempfile.mkdtemp(prefix="tinyvllm_ch10_"),
    tiny_llama_config(vocab_size=256, max_position_embeddings=4096),
    seed=11,
)
prompts = [rng.integers(0, 256, int(rng.integers(1, 120))).tolist() for _ in range(64)]
params = [
    SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 40)), ignore_eos=True)
    for _ in prompts
]
need = sum(cdiv(len(p) + sp.max_tokens, 16) for p, sp in zip(prompts, params))
roomy = LLM(tiny_folder, device="cpu", max_model_len=256, max_num_seqs=64)
small = LLM(
    tiny_folder,
    device="cpu",
    max_model_len=256,
    max_num_seqs=64,
    num_kv_blocks=need // 4,
)
want = roomy.generate(prompts, params, use_tqdm=False)
got = small.generate(prompts, params, use_tqdm=False)
assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
for name, llm in (("roomy pool", roomy), ("quarter pool", small)):
    s = llm.llm_engine.stats
    print(
        f"{name:>12}: {s.kv_blocks_total:5} blocks, at most {s.max_kv_blocks_used} "
        f"used and {s.max_num_running} running at once, {s.num_preemptions} "
        f"preemptions, {s.num_steps} steps"
    )
stats = small.llm_engine.stats
prose.glue("ch10_need", f"{need}")
prose.glue("ch10_small", f"{need // 4}")
prose.glue("ch10_preemptions", f"{stats.num_preemptions}")
prose.glue("ch10_small_running", f"{stats.max_num_running}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The 64 requests need {{ch10_need}} blocks at once; with {{ch10_small}} the scheduler
preempted {{ch10_preemptions}} times and never ran more than {{ch10_small_running}}
requests together, and the tokens are the same as with room for all.
""")

# %% [markdown]
# Too large is refused up front: a request that could never fit in the whole pool, even
# alone, would wait forever, so `add_request` says so, and the engine goes on serving
# the others. Here the pool is 8 blocks, 128 tokens, and a request may need 299.

# %%
tight = LLM(tiny_folder, device="cpu", max_model_len=512, num_kv_blocks=8)
engine = tight.llm_engine
try:
    engine.add_request("huge", list(range(200)), SamplingParams(max_tokens=100))
except ValueError as e:
    print("ValueError:", e)
outs = tight.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5), use_tqdm=False)
print("the others:", [o.outputs[0].token_ids for o in outs])
print(engine.stats)

# %% [markdown]
# ## Prefix caching at work
#
# A chat server is the case prefix caching was made for: every conversation starts with
# the same system prompt. Below, SmolLM2 answers four questions after a long shared
# system prompt, on the CPU, with the cache on and off. With the cache on, the first
# request computes the shared blocks and the others find them; `num_cached_tokens` on
# each output says how many of its prompt tokens it did not compute. The answers are the
# same.

# %%
system_prompt = (
    "You are a patient teacher who answers in one short sentence. "
    + "Explain plainly, avoid jargon, and give one concrete example. " * 12
)
questions = ["What is rain?", "Why is the sky blue?", "What is copper?", "What is pi?"]
chat = LLM("smollm2", device="cpu", max_model_len=1024, max_num_seqs=4)
tokenizer = chat.get_tokenizer()
chats = [
    tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": q}],
        tokenize=True,
    )
    for q in questions
]
answer = SamplingParams(temperature=0, max_tokens=16)
timings, answers = {}, {}
for caching in (True, False):
    llm = LLM(
        "smollm2",
        device="cpu",
        max_model_len=1024,
        max_num_seqs=4,
        enable_prefix_caching=caching,
    )
    llm.generate(chats[:1], answer, use_tqdm=False)  # the first conversation
    t0 = time.perf_counter()
    answers[caching] = llm.generate(chats[1:], answer, use_tqdm=False)
    timings[caching] = time.perf_counter() - t0
for o in answers[True]:
    print(
        f"{o.num_cached_tokens:4} of {len(o.prompt_token_ids)} prompt tokens cached:"
        f" {o.outputs[0].text!r}"
    )
same = [
    a.outputs[0].token_ids == b.outputs[0].token_ids
    for a, b in zip(answers[True], answers[False])
]
print(
    f"the same answers without the cache: {all(same)}; "
    f"{timings[False]:.2f} s without the cache, {timings[True]:.2f} s with it "
    "(this CPU)"
)
assert all(same)

# %% [markdown]
# The shared blocks form a tree: the system prompt's blocks at the root, held by every
# conversation, then one branch per question where the tokens part. Below, the blocks
# of three requests that share a system prompt — the pool from the drawing above.


# %% tags=["hide-input"]
def draw_prefix_tree(block_manager, request_ids):
    """The block tables as a tree: a node per physical block (its id and ref_count),
    an edge from each block to the next one in some request's table.
    """
    bm, colors = block_manager, request_colors(request_ids)
    children, depth, owner = {}, {}, {}
    for r in request_ids:
        for i, block_id in enumerate(bm.block_tables[r]):
            depth[block_id], owner[block_id] = i, owner.get(block_id, r)
            children.setdefault(block_id, [])
            parent = bm.block_tables[r][i - 1] if i else None
            if parent is not None and block_id not in children[parent]:
                children[parent].append(block_id)
    y, leaves = {}, iter(range(len(depth)))

    def place(block_id):  # leaves one per row, a parent level with its children
        kids = children[block_id]
        y[block_id] = np.mean([place(c) for c in kids]) if kids else next(leaves)
        return y[block_id]

    for root in dict.fromkeys(bm.block_tables[r][0] for r in request_ids):
        place(root)
    fig, ax = new_figure(width=8, height=0.5 * max(y.values()) + 1.0)
    for parent, kids in children.items():
        for c in kids:
            ax.plot([depth[parent], depth[c]], [y[parent], y[c]], c="#999999", zorder=0)
    for block_id, d in depth.items():
        ref = bm.blocks[block_id].ref_count
        fc = SHARED if ref > 1 else colors[owner[block_id]]
        box = dict(boxstyle="round", fc=fc, ec="none")
        ax.text(
            d,
            y[block_id],
            f"block {block_id}\nref {ref}",
            color="white",
            bbox=box,
            **CENTER,
        )
        if not children[block_id]:
            name, at = owner[block_id], (d, y[block_id])
            ax.annotate(
                name, at, (24, 0), textcoords="offset points", va="center", fontsize=8
            )
    ax.set_xlim(-0.5, max(depth.values()) + 0.8)
    ax.set_ylim(max(y.values()) + 0.6, -0.6)
    ax.set_xticks(range(max(depth.values()) + 1))
    ax.set_xlabel("logical block (index in the block table)", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_yticks([])
    ax.spines[["top", "right", "left"]].set_visible(False)
    return fig


# %%
fig = draw_prefix_tree(pool, ["a", "b", "c"])
plt.show()

# %% [markdown]
# **Who computes a shared prefix?** Requests admitted in the same step as the one that
# computes a prefix cannot find it: a block is cached only after the step that filled
# it. Each computes its own copy, and the first copy to be finished is the one cached
# (the others are freed as ordinary blocks). Requests that arrive a
# step later find the blocks; that is why the demo above runs the first conversation
# before the others.

# %% [markdown]
# ## Measured on the GPU
#
# `bench/ch10_paging.py` records to `book/data/ch10_paging.json`. It times paged
# prefill attention at Llama 3.2 1B's attention shapes against chapter 7's flash kernel;
# runs chapter 9's ragged workload of 256 requests on Llama 3.2 1B's shapes (random bf16
# weights) with chapter 9's contiguous rows and with blocks, first in the memory of 256
# rows of 2,048 slots, then in the memory of 64; and times the first token of 63
# requests that share a 1,000-token prefix, with the prefix cache on and off.

# %% tags=["hide-input"]
records = load_records("ch10_paging")
by_name = {}
for r in records:
    by_name.setdefault(r["name"], []).append(r)
flash = next(iter(by_name.get("flash_prefill", [])), None)
paged_runs = {r["shape"][1]: r for r in by_name.get("paged_prefill", [])}
runs = {
    (r["scheme"], r["memory_rows"]): r for r in by_name.get("output_throughput", [])
}
ttft = {r["prefix_caching"]: r for r in by_name.get("ttft_mean", [])}
missing = "(not yet measured)"
prose.glue("ch10_gpu", records[0]["device"]["name"] if records else "GPU " + missing)
prose.glue("ch10_flash", f"{flash['value']:.1f} TFLOP/s" if flash else missing)
for cached in (0, 1024):
    r = paged_runs.get(cached)
    prose.glue(f"ch10_paged_{cached}", f"{r['value']:.1f} TFLOP/s" if r else missing)
for (scheme, rows), r in runs.items():
    prose.glue(f"ch10_{scheme}_{rows}", f"{r['value']:,.0f} output tokens/s")
    prose.glue(f"ch10_{scheme}_{rows}_running", f"{r['max_running']}")
    prose.glue(f"ch10_{scheme}_{rows}_preempt", f"{r['num_preemptions']}")
    prose.glue(f"ch10_{scheme}_{rows}_step", f"{r['mean_decode_step_ms']:.1f} ms")
for scheme in ("contiguous", "paged"):
    for rows in (256, 64):
        if (scheme, rows) not in runs:
            for suffix in ("", "_running", "_preempt", "_step"):
                prose.glue(f"ch10_{scheme}_{rows}{suffix}", missing)
for caching, name in ((True, "on"), (False, "off")):
    r = ttft.get(caching)
    prose.glue(f"ch10_ttft_{name}", f"{r['value']:.0f} ms" if r else missing)
agree = next(iter(by_name.get("prefix_caching_agreement", [])), None)
# counts of requests, out of the record's shape: integers, shown as integers
of_all = f" of {agree['shape'][0]}" if agree else ""
prose.glue("ch10_agree", f"{agree['value']:.0f}{of_all}" if agree else missing)
near = agree.get("agree_up_to_near_tie") if agree else None
prose.glue("ch10_agree_near", f"{near:.0f}{of_all}" if near is not None else missing)
prose.glue("ch10_agree_dlogp", f"{agree['mean_abs_dlogp']:.3f}" if agree else missing)
prose.glue("ch10_tie", f"{agree['tie']:g}" if agree else missing)
shared = next(iter(ttft.values()), None)
prose.glue("ch10_prefix_n", f"{shared['shape'][0]}" if shared else missing)
prose.glue("ch10_prefix_len", f"{shared['shape'][1]:,}" if shared else missing)
prose.glue(
    "ch10_prefix_budget", f"{shared['max_num_batched_tokens']:,}" if shared else missing
)
# chapter 9's record of the same workload, made in another session
ch09 = [
    r
    for r in load_records("ch09_batching")
    if r["name"] == "output_throughput" and r["shape"] == [256]
]
prose.glue("ch10_ch09_record", f"{ch09[0]['value']:,.0f}" if ch09 else missing)
prose.glue("ch10_ch09_date", ch09[0]["date"] if ch09 else missing)

if runs:
    fig, (ax1, ax2) = new_figure(1, 2, width=10, height=3)
    labels = [f"{s}\n{m} rows of memory" for s, m in runs]
    colors = ["#999999" if s == "contiguous" else "#1f77b4" for s, _ in runs]
    ax1.bar(labels, [r["value"] for r in runs.values()], color=colors)
    ax1.set_ylabel("output tokens/s", fontsize=8)
    ax1.set_title("256 ragged requests, Llama 3.2 1B shapes", fontsize=9)
    ax2.bar(labels, [r["max_running"] for r in runs.values()], color=colors)
    ax2.set_ylabel("requests running at once (most)", fontsize=8)
    for ax in (ax1, ax2):
        ax.tick_params(labelsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
On the {{ch10_gpu}}, paged prefill attention over 2,048 new tokens runs at
{{ch10_paged_0}} with nothing cached and {{ch10_paged_1024}} after 1,024 cached tokens,
against {{ch10_flash}} for chapter 7's flash kernel on the same 2,048 tokens, which
reads its keys in float32 from the step's own `qkv`.

In the memory of 256 full rows, the ragged workload makes {{ch10_contiguous_256}} with
chapter 9's rows and {{ch10_paged_256}} with blocks, in the same run: memory is not the
limit there, and they run up to {{ch10_contiguous_256_running}} and
{{ch10_paged_256_running}} requests at once; their decode steps took
{{ch10_contiguous_256_step}} and {{ch10_paged_256_step}} on average (a difference this
chapter has not traced). (Chapter 9
recorded {{ch10_ch09_record}} output tokens/s for its rows on {{ch10_ch09_date}}, in
another session: most of a decode step is still Python on the host, and the host's speed
differs between sessions, so only numbers from one run are compared here.) In the memory
of 64 rows, rows run at most {{ch10_contiguous_64_running}} requests at once and make
{{ch10_contiguous_64}}; blocks run {{ch10_paged_64_running}} at once
({{ch10_paged_64_preempt}} preemptions) and make {{ch10_paged_64}}.

The first token of {{ch10_prefix_n}} requests sharing a {{ch10_prefix_len}}-token
prefix comes after {{ch10_ttft_off}} on average without the prefix cache and
{{ch10_ttft_on}} with it. The outputs of the two runs are identical for {{ch10_agree}}
requests and the same up to a near tie — where they first differ, the two best tokens
were within {{ch10_tie}} — for {{ch10_agree_near}}; the mean |Δ log p| of shared tokens
is {{ch10_agree_dlogp}}. The two runs cut the work into different steps: with it on,
every request reads the shared prefix from the cache; with it off, {{ch10_prefix_n}}
prompts of more than {{ch10_prefix_len}} tokens take several steps of
{{ch10_prefix_budget}}, and steps of other shapes sum their float32 products in another
order (and, when these records were made, a prompt's own keys came in float32 from the
step's `qkv`, where every prefill now reads them in bf16 from the cache).
""")

# %% [markdown]
# ## Summary
#
# - Contiguous rows reserve `max_model_len` slots a sequence; blocks reserve what its
#   tokens fill, to the end of its last block. On chapter 9's request mix the waste
#   goes from a large share of the cache to under a percent.
# - The `BlockManager` keeps a pool of blocks, a free list in least-recently-freed
#   order, per-request block tables and reference counts. Full blocks are named by a
#   chained hash of their tokens, checked against collisions, and stay cached after
#   they are freed until the pool needs them.
# - The `PagedScheduler` plans each step under a token budget and the pool: running
#   requests first, oldest first; the newest preempted by recomputation when a block
#   runs out; waiting requests admitted after their cached prefix; long prompts in
#   chunks alongside running decodes.
# - `paged_prefill_attention` lets a prompt's new tokens attend over what the cache
#   holds of it, so a prefill can start anywhere; decode attention already read block
#   tables.
# - `LLMEngine` sizes its pool from memory and counts what a server exports
#   (`llm.llm_engine.stats`).
#
# Exported to `tinyvllm_lib`: `engine.block_manager` (`BlockManager`, `KVBlock`,
# `hash_block`), `engine.paged_scheduler` (`PagedScheduler`), `engine.stats`
# (`EngineStats`), `kernels.paged_attention` (`paged_prefill_attention`),
# `layers.attention.PagedAttention` and `engine.llm_engine.LLMEngine` (the library's
# versions of chapter 8's and chapter 9's classes).
#
# ## Exercises
#
# 1. Change `block_size` to 8, 32 and 128 in the fragmentation figure. What does each
#    cost in waste, and what would a larger block buy the attention kernels?
# 2. Preempt the *longest* running request instead of the newest. Run the quarter pool:
#    how many preemptions, and how much recomputation?
# 3. The prefix cache evicts the least recently freed block first. Build a workload
#    where that is the wrong choice, and say what vLLM's eviction order does with it.
# 4. With `max_num_batched_tokens=512`, how many steps does a 3,000-token prompt take,
#    and what is the longest gap between two tokens of a running request while it is
#    computed? And with 8,192?
# 5. Copy-on-write: sketch what `n=2` samples of one prompt would need from the block
#    manager, and where the copy happens.
