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

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix block."""
        return sum(self.blocks[i].block_hash is not None for i in self.free_queue)

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

    def allocate(
        self, request_id: str, token_ids, num_tokens: int, use_cache: bool = True
    ) -> int | None:
        """Give a new request blocks for its first num_tokens tokens, its cached prefix
        shared (unless use_cache is False): the number of tokens served by the cache,
        or None (nothing changed) when the pool is short.
        """
        if request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits = self._cached_prefix(token_ids) if use_cache else []
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
        # request id -> the logits of its prompt chunks so far (prompt_logprobs)
        self.prompt_logits: dict[str, list[np.ndarray]] = {}

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
        self.prompt_logits.pop(request.request_id, None)
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
            use_cache = request.params.prompt_logprobs is None
            cached = bm.num_cached_tokens(tokens) if use_cache else 0
            n = min(request.num_tokens - cached, budget)
            if bm.allocate(request.request_id, tokens, cached + n, use_cache) is None:
                break
            self.waiting.popleft()
            if request.num_tokens == request.num_prompt_tokens:  # nothing generated
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
        tables = np.zeros((len(planned), self.max_blocks), np.int32)
        for row, (request, _) in enumerate(planned):
            table = self.block_manager.block_tables[request.request_id]
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
        for i, (request, n) in enumerate(zip(step.requests, step.num_new_tokens)):
            request.num_computed_tokens += n
            self.block_manager.cache_blocks(
                request.request_id, RequestTokens(request), request.num_computed_tokens
            )
            self._collect_prompt_logits(request, result.prompt_logits[i])
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
                self._release(request)
        return progressed

    def _collect_prompt_logits(self, request: Request, logits) -> None:
        """Gather a prompt's logits chunk by chunk, and set its prompt_logprobs once the
        whole prompt is computed (the first time: a recomputation repeats them).
        """
        if logits is None or request.prompt_logprobs is not None:
            return
        chunks = self.prompt_logits.setdefault(request.request_id, [])
        chunks.append(logits)
        if request.num_computed_tokens >= request.num_prompt_tokens:
            del self.prompt_logits[request.request_id]
            request.set_prompt_logprobs(
                np.concatenate(chunks)[: request.num_prompt_tokens]
            )

    def abort_request(self, request_id: str) -> Request | None:
        """Take a request out, waiting or running, and end it with finish_reason
        'abort'; None if it is not here.
        """
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
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
        self.block_manager.free(request.request_id)
        self.prompt_logits.pop(request.request_id, None)

# %% [markdown]
# ## The engine on blocks
#
# The engine changes in its constructor only; `step()` is chapter 9's schedule →
# execute → postprocess. What changes is where the memory goes. Chapter 9 reserved
# `max_num_seqs × max_model_len` slots up front. Now the engine first loads the weights
# and makes every buffer a step needs, then measures what is left, and gives the share
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
# the helpers chapter 9 defined beside its engine
from tinyvllm_lib.engine.llm_engine import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    _positive_int,
    resolve_device,
)

# %%
#| export engine.llm_engine
#| replaces LLMEngine
import itertools
from dataclasses import replace

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.engine.inputs import make_request
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.outputs import RequestOutput
from tinyvllm_lib.engine.paged_scheduler import PagedScheduler
from tinyvllm_lib.engine.request import Request
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
    """

    def __init__(
        self,
        model: str = "smollm2",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
    ):
        self.folder = resolve_model(model)
        self.config = ModelConfig.from_folder(self.folder)
        # None: prompts are token ids
        self.tokenizer = Tokenizer.from_folder(self.folder, missing_ok=True)
        limit = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        if not isinstance(max_model_len, int) or not 1 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be an integer in [2, {limit}] (the model's "
                f"max_position_embeddings), got {max_model_len!r}"
            )
        _positive_int("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        if _positive_int("max_num_batched_tokens", max_num_batched_tokens) < (
            max_num_seqs
        ):
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({max_num_seqs}): a decode step computes a token for "
                "every running request"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                "gpu_memory_utilization is the share of the GPU's memory the engine "
                f"may use, in (0, 1]; got {gpu_memory_utilization!r}"
            )
        self.device = resolve_device(device)
        self.max_model_len, self.max_num_seqs, self.max_num_batched_tokens = (
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
        )
        # the weights and every step buffer first; the KV cache takes what is left
        self.model_runner = ModelRunner(
            self.folder,
            self.device,
            None,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            kv_cache_dtype,
        )
        num_blocks = self._num_kv_blocks(
            num_kv_blocks, gpu_memory_utilization, kv_cache_memory_bytes, block_size
        )
        self.model_runner.init_kv_cache(num_blocks * block_size)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = PagedScheduler(
            max_num_seqs, max_num_batched_tokens, max_model_len, self.block_manager
        )
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        # for requests without a seed of their own
        self.rng = np.random.default_rng(seed)
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
            return _positive_int("num_kv_blocks", num_kv_blocks)
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
        self, request_id: str, prompt, params=None, name: str = "prompt"
    ) -> Request:
        """A checked Request for a prompt (text, token ids or a dict), not added yet;
        ValueError on bad input.
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

    def abort_request(self, request_id: str) -> None:
        """End a request now, waiting or running (finish_reason 'abort'); its blocks
        are freed at once.
        """
        request = self.requests.get(request_id)
        if request is None or request in self._aborted:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        self.scheduler.abort_request(request_id)
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, postprocess: the RequestOutput of every request that
        progressed or was aborted.
        """
        done, self._aborted = self._aborted, []
        # aborted since the last step: finish_reason "abort"
        outputs = [r.output() for r in done]
        step = self.scheduler.schedule()
        if step is not None:
            self._count_schedule()
            result = self.model_runner.execute(step)
            for request in self.scheduler.postprocess(step, result):
                self._count_token(request)
                outputs.append(request.output())
                if request.is_finished:
                    done.append(request)
        for request in done:
            del self.requests[request.request_id]
        return outputs

    def _count_schedule(self) -> None:
        s = self._stats
        s.num_steps += 1
        s.max_num_running = max(s.max_num_running, len(self.scheduler.running))
        s.max_kv_blocks_used = max(
            s.max_kv_blocks_used, self.block_manager.num_used_blocks
        )

    def _count_token(self, request: Request) -> None:
        s = self._stats
        s.num_generated_tokens += 1
        if len(request.output_token_ids) == 1:  # its first: its prompt is done
            s.num_prompt_tokens += request.num_prompt_tokens
            s.num_cached_prompt_tokens += request.num_cached_tokens
