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
# *Draft: this chapter is being written. So far it has the block manager; the paged
# prefill kernel, the scheduler on blocks, preemption, chunked prefill and the
# measurements come next.*
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
# - the **block manager**: a pool of blocks, a free list, per-request block tables grown
#   as tokens are appended, and reference counts;
# - **prefix caching**: a full block is named by a hash of its tokens and of every token
#   before it, so requests that begin alike share blocks, and freed blocks stay cached
#   until the pool needs them, least recently used first.

# %%
#| default_exp engine.block_manager

# %%
import numpy as np

rng = np.random.default_rng()

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
# computing them again. Python's `hash` of a tuple of integers is 64 bits and the same
# in every process; two different prefixes can still collide, so each cached block keeps
# the key it was hashed from, and a hit counts only when the keys are equal.

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
    key = (parent_hash, tuple(int(t) for t in token_ids))
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
        self.hashes: dict[str, list[int]] = {}  # request -> hashes of its cached blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def _cached_prefix(self, token_ids) -> list[int]:
        """Block ids of the longest cached run of full blocks that token_ids starts
        with, leaving at least its last token uncovered.
        """
        if not self.enable_prefix_caching:
            return []
        found, parent, b = [], None, self.block_size
        for i in range((len(token_ids) - 1) // b):
            block_hash, key = hash_block(parent, token_ids[i * b : (i + 1) * b])
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].hash_key != key:
                break
            found.append(block_id)
            parent = block_hash
        return found

    def num_cached_tokens(self, token_ids) -> int:
        """How many leading tokens of token_ids the cache holds (changes nothing)."""
        return len(self._cached_prefix(token_ids)) * self.block_size

    def allocate(self, request_id: str, token_ids, num_tokens: int) -> int | None:
        """Give a new request blocks for its first num_tokens tokens, its cached prefix
        shared: the number of tokens served by the cache, or None (nothing changed)
        when the pool is short.
        """
        if request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits = self._cached_prefix(token_ids)
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
            self.blocks[block_id].ref_count += 1
        self.block_tables[request_id] = hits + [self._take() for _ in range(num_fresh)]
        self.hashes[request_id] = [self.blocks[i].block_hash for i in hits]
        return len(hits) * self.block_size

    def _take(self) -> int:
        """A fresh block for one holder: the least recently freed, evicted from the
        cache if it was cached.
        """
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
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
        if num_more > len(self.free_queue):
            return False
        table.extend(self._take() for _ in range(num_more))
        return True

    def cache_blocks(self, request_id: str, token_ids, num_computed: int) -> None:
        """Name the request's blocks that are now full and computed (its first
        num_computed tokens of token_ids), so that later requests can find them.
        """
        if not self.enable_prefix_caching:
            return
        table, hashes, b = (
            self.block_tables[request_id],
            self.hashes[request_id],
            self.block_size,
        )
        for i in range(len(hashes), num_computed // b):
            parent = hashes[-1] if hashes else None
            block_hash, key = hash_block(parent, token_ids[i * b : (i + 1) * b])
            hashes.append(block_hash)
            block = self.blocks[table[i]]
            # a block computed twice (two requests in one step) is cached once
            if block_hash not in self.cached:
                self.cached[block_hash] = table[i]
                block.block_hash, block.hash_key = block_hash, key

    def free(self, request_id: str) -> None:
        """Drop the request's blocks; those no one else holds join the free list, last
        block first, keeping their hashes.
        """
        for block_id in reversed(self.block_tables.pop(request_id)):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        del self.hashes[request_id]

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
# ## The scheduler on blocks
#
# *Draft: the scheduling logic, tested against a stand-in for the model; the model
# runner does not use it yet.*
#
# With blocks, each step is planned under two budgets: tokens (`max_num_batched_tokens`)
# and blocks. Running requests go first, oldest first: a decode needs one slot, a prompt
# being computed in chunks needs its next chunk — as much of the rest as the token
# budget allows (**chunked prefill**: a long prompt no longer holds up every decode
# behind it). When a running request needs a block and none is free, the scheduler
# **preempts** the
# most recently admitted running request, vLLM's policy: it gives back every block and
# goes to the front of the waiting queue, keeping its generated tokens; readmitted, it
# computes prompt and tokens again (**recomputation**, cheaper than copying its cache to
# the host and back when it is short). Then, if nothing was preempted this step, waiting
# requests are admitted first come first served, each starting after its cached prefix.
# A prompt chunk that does not reach the end of the prompt yields no token.

# %%
#| export engine.paged_scheduler
from collections import deque

import numpy as np

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.model_runner import ModelRunnerOutput, SchedulerOutput
from tinyvllm_lib.engine.request import Request, RequestStatus
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
        self.num_cached_tokens: dict[str, int] = {}  # at first admission

    def add_request(self, request: Request) -> None:
        bm = self.block_manager
        most = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
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
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput | None:
        bm, budget = self.block_manager, self.max_num_batched_tokens
        planned: list[tuple[Request, int]] = []
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not bm.append_slots(
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
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            tokens = RequestTokens(request)
            cached = bm.num_cached_tokens(tokens)
            n = min(request.num_tokens - cached, budget)
            if bm.allocate(request.request_id, tokens, cached + n) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = cached
            request.status = RequestStatus.RUNNING
            self.num_cached_tokens.setdefault(request.request_id, cached)
            self.running.append(request)
            planned.append((request, n))
            budget -= n
        if not planned:
            return None
        # prompt chunks first, then one-token decodes, as the runner takes them
        planned.sort(key=lambda p: is_decode(*p))  # stable: admission order within each
        num_prefills = sum(not is_decode(r, n) for r, n in planned)
        tables = np.zeros((len(planned), self.max_blocks), np.int32)
        for row, (request, _) in enumerate(planned):
            table = bm.block_tables[request.request_id]
            tables[row, : len(table)] = table
        return SchedulerOutput(
            [r for r, _ in planned], [n for _, n in planned], num_prefills, tables
        )

    def postprocess(
        self, step: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[Request]:
        """Count the computed tokens, name the blocks they filled; append a token where
        a request's tokens are all computed; free the finished. The requests that got
        a token.
        """
        s, progressed, j = result.sampled, [], 0  # j: the sampled row
        for request, n in zip(step.requests, step.num_new_tokens):
            request.num_computed_tokens += n
            self.block_manager.cache_blocks(
                request.request_id, RequestTokens(request), request.num_computed_tokens
            )
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk of its prompt: no token yet
            request.append_token(
                s.token_ids[j],
                *(
                    None if a is None else a[j]
                    for a in (s.logprobs, s.top_ids, s.top_logprobs)
                ),
            )
            j += 1
            progressed.append(request)
            if request.is_finished:
                self.running.remove(request)
                self.block_manager.free(request.request_id)
        return progressed
