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
# # 11. Llama 3.2 1B: CUDA graphs and the benchmark
#
# Chapters 9 and 10 made the engine serve many requests at once, and left one cost
# untouched. A decode step of Llama 3.2 1B, as chapter 9 recorded it, was 180 kernels:
# for each of 16 layers the QKV projection, RoPE, the KV write, attention (two kernels:
# the splits of the context and their combination), the output projection, a residual
# add with RMSNorm, the gate-up projection, SiLU, the down projection and another add
# with norm; before them the embedding and a norm, after them the head and the sampler.
# (The later fusions of chapters 6 and 8, measured below, took two to four kernels a
# layer away.) Chapter 9
# timed that step on an H200 both ways (the numbers are below): the kernels alone take a
# small share of the step launched from Python, because each launch costs host time
# before it reaches the GPU, which waits most of the step.
#
# A **CUDA graph** removes the launches: the kernels of a step are recorded once, with
# their arguments, and the whole recording is replayed with one call. This chapter
# captures the decode step once per batch size, the way vLLM does, and measures what
# that buys against transformers on the same GPU.
#
# In this chapter you will learn:
#
# - what a graph **freezes** at capture: every pointer and every host scalar. The step's
#   inputs must therefore live in buffers that never move, and the kernels must read
#   anything that changes from the GPU's memory, not from their arguments;
# - **batch-size buckets**: a step of 5 requests replays the graph of 8, and its 3
#   padding rows write to no cache slot;
# - **one copy per step**: a decode step's inputs packed into a pinned buffer;
# - sampling inside the graph, with each request's seed and settings, and
#   log-probabilities computed on the GPU;
# - **async scheduling**: the next step launched before the host has post-processed the
#   last, its token ids fed forward on the GPU;
# - the **Llama 3.2 1B stand-in** (built in Appendix A): the real tokenizer and random
#   weights of the exact shapes, for machines without the weights;
# - `python -m tinyvllm_lib bench latency` and `bench throughput`, and how the engine
#   compares with transformers, eager and compiled.

# %%
#| default_exp engine.cuda_graphs

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from tinyvllm_lib import benchmark
from tinyvllm_lib.cli import command, main
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.measure import (
    DATA_DIR,
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
)
from tinyvllm_lib.plots import Prose, new_figure, plain_log_ticks, verdict
from tinyvllm_lib.runtime import can_launch, has_gpu, where_kernels_run

rng = np.random.default_rng()
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
# the bandwidth ceiling every "% of" in this chapter is of: chapter 1's best measured
# rate on its GPU (bandwidth_ceiling)
CEILING_GB_S, CEILING_NAME = bandwidth_ceiling()
prose.glue("ch11_ceiling", ceiling_phrase(CEILING_GB_S, CEILING_NAME))
print(where_kernels_run())

# %% tags=["remove-input"]
ch09 = {(r["name"], r["shape"][0]): r for r in load_records("ch09_batching")}
wall, kernels = ch09[("decode_step_wall", 1)], ch09[("decode_step_kernels", 1)]
prose.glue("ch11_gpu", wall["device"]["name"])
prose.glue("ch11_wall_1", f"{wall['value']:.1f} ms")
prose.glue("ch11_kernels_1", f"{kernels['value']:.2f} ms")
prose.glue("ch11_launch_share", f"{1 - kernels['value'] / wall['value']:.0%}")
# the step's 180 kernels: host time per launch, on average
per_launch = (wall["value"] - kernels["value"]) / 180 * 1e3
prose.glue("ch11_per_launch", f"{per_launch:.0f} µs")
prose.glue("ch11_step_date", wall["date"])
prose.show("""
On the {{ch11_gpu}} ({{ch11_step_date}}), a batch-1 decode step of Llama 3.2 1B's shapes
took {{ch11_wall_1}} launched from Python and {{ch11_kernels_1}} when the same kernels
were replayed from a captured graph: {{ch11_launch_share}} of the eager step is the host
launching, about {{ch11_per_launch}} per kernel.
""")

# %% [markdown]
# Drawn to scale from those two records, with every launch and every kernel given the
# same length (the records say only their totals), a step looks like this from both
# sides of the PCIe bus:


# %% tags=["hide-input"]
def draw_step_timelines(wall_ms, kernels_ms, num_kernels=180):
    """Eager: the host launches one kernel after another and the GPU runs each as it
    arrives; replayed: one launch, the kernels back to back."""
    fig, (eager, graph) = new_figure(2, 1, height=3.2, sharex=True)
    per_launch, per_kernel = wall_ms / num_kernels, kernels_ms / num_kernels
    for i in range(num_kernels):
        eager.broken_barh([(i * per_launch, per_launch * 0.9)], (1.1, 0.8), color="C0")
        eager.broken_barh([((i + 1) * per_launch, per_kernel)], (0.1, 0.8), color="C1")
    graph.broken_barh([(0, per_launch)], (1.1, 0.8), color="C0")
    graph.broken_barh([(per_launch, kernels_ms)], (0.1, 0.8), color="C1")
    for ax, title in (
        (eager, "launched from Python"),
        (graph, "replayed from a graph"),
    ):
        ax.set_yticks([0.5, 1.5], ["GPU", "host"])
        ax.set_ylim(0, 2)
        ax.set_title(title, fontsize=9, loc="left")
    graph.set_xlabel("ms")
    eager.set_xlim(0, wall_ms * 1.02)
    return fig


draw_step_timelines(wall["value"], kernels["value"])
plt.show()

# %% [markdown]
# Eagerly, the GPU is busy for the thin orange slivers only: each kernel finishes long
# before the host has launched the next. Replayed, the GPU runs the step's kernels back
# to back, and the host is free after one call — to prepare the next step, which is
# where the time goes next (the last section measures it).

# %% [markdown]
# ## What a graph freezes
#
# Chapter 1 built `CudaGraph`: it calls a function that launches kernels on a stream
# while the stream is being **captured**, so that nothing runs; the driver records each
# launch, with its grid and its arguments, into a graph; replaying the graph runs them
# all, in order, at the cost of about one launch. Chapter 6 captured cuBLAS calls in the
# same graph as numba's kernels.
#
# What is recorded is the argument *values*. A device array is passed as its pointer, so
# a graph reads whatever those addresses hold when it is replayed: to give a replay new
# inputs, copy them into the same buffers. A Python number is passed as itself, and
# stays what it was at capture. Go through a decode step with that in mind:
#
# - **token ids and positions**: arrays, copied in each step. Chapter 8b's runner
#   already made them once, as views of buffers sized for the largest step.
# - **the attention metadata**: `seq_lens`, `slot_mapping` and the block tables are
#   arrays too. The one host scalar decode attention takes is the number of splits of a
#   context (flash-decoding, chapter 8), and chapter 8 chose it from `max_context_len`,
#   a bound fixed for the engine's life, so that each sequence works out its own split
#   on the GPU from its length. The grid is fixed per batch size.
# - **the GEMMs**: cuBLAS picks an algorithm from the shapes, and the shapes are fixed
#   per batch size. Its scratch memory must be ours and stay put: a buffer made once,
#   and `cublasSetWorkspace` after every `cublasSetStream` (setting a stream resets it).
# - **sampling**: the sampler kernel reads each row's temperature, top-k, top-p and
#   random draw from arrays, so greedy and sampled rows share one captured launch.
#
# And the batch size itself is frozen: a graph of 8 rows runs 8 rows. vLLM captures a
# graph for each of a list of sizes — 1, 2, 4, then every multiple of 8 up to
# `max_num_seqs` — and pads a step up to the next size. A padding row decodes token 0 at
# position 0 with a context of one token, through block 0, and its slot is −1, which the
# KV write skips: it reads memory that exists and writes none that matters. Its logits
# and its sample are computed and ignored.
#
# Prefills are captured too, in buckets of token counts: chapter 10's prefill kernel
# reads which tiles to run from a schedule in the step's inputs, so a prefill's grid
# depends only on how many tokens and requests the step has room for. A prefill or mixed
# step is padded to the next bucket of tokens — powers of two from 16, up to 4,096 or
# the step budget — with room for min(bucket, max_num_seqs) requests, and the head and
# the sampler run on 1, 4, 16, 64, … of its rows — the next bucket up from the rows due
# a token. Padding tokens have slot −1 and no tile in the schedule, so they write
# nothing and attend to nothing. A step larger than the largest bucket, or one that asks
# for its prompt's log-probabilities (its rows of logits are many), runs eagerly: its
# kernels are large enough that launching them from Python costs little in proportion.


# %%
#| export
import numpy as np

from tinyvllm_lib.engine.input_batch import StepShape


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a decode graph is captured for, as vLLM's: 1, 2, 4, then every
    multiple of 8, up to max_num_seqs (always one of them). A step padded to its size
    must round to the same split_rows (chapter 8) as the step itself, or decode
    attention splits its contexts differently: change the two together.
    """
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return sizes if sizes and sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def graph_size_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None if none does."""
    i = int(np.searchsorted(sizes, num_seqs))
    return sizes[i] if i < len(sizes) else None


PREFILL_GRAPH_MAX_TOKENS = 4096  # a longer prefill step runs eagerly


def prefill_graph_shapes(
    max_num_batched_tokens: int, max_num_seqs: int,
    max_tokens: int = PREFILL_GRAPH_MAX_TOKENS,
) -> list[StepShape]:
    """The prefill and mixed steps a graph is captured for: 16, 32, 64, ... tokens up to
    min(max_tokens, max_num_batched_tokens), each with room for min(tokens,
    max_num_seqs) requests, the head and the sampler on 1, 4, 16, ... of them (and
    all); sorted, so the first that holds a step is the smallest.
    """
    top = min(max_num_batched_tokens, max_tokens)
    shapes = []
    for tokens in sorted({*(t for t in (2**k for k in range(4, 31)) if t < top), top}):
        rows = min(tokens, max_num_seqs)
        for sampled in sorted({*(4**k for k in range(16) if 4**k < rows), rows}):
            shapes.append(StepShape(tokens, rows, sampled, prefill=True))
    return shapes


def prefill_shape_for(tokens: int, rows: int, sampled: int,
                      shapes: list[StepShape]) -> StepShape | None:
    """The smallest prefill shape that holds a step; None if none does."""
    for shape in shapes:
        if tokens <= shape.tokens and rows <= shape.rows and sampled <= shape.sampled:
            return shape
    return None


# %%
sizes = cuda_graph_sizes(256)
print(f"{len(sizes)} graphs for max_num_seqs=256:", sizes[:6], "...", sizes[-2:])
print("5 requests replay the graph of", graph_size_for(5, sizes))
assert graph_size_for(5, sizes) == 8 and graph_size_for(256, sizes) == 256
assert graph_size_for(257, sizes) is None and cuda_graph_sizes(6) == [1, 2, 4, 6]
shapes = prefill_graph_shapes(8192, 256)
print(f"{len(shapes)} prefill graphs for max_num_batched_tokens=8192: token buckets",
      sorted({s.tokens for s in shapes}))
# a 100-token prompt alone: 128 tokens, the head on 1 row; three prompts and 40 decodes
# in 700 tokens, 43 rows due a token: 1,024 tokens, the head on 64 rows
assert prefill_shape_for(100, 1, 1, shapes) == StepShape(128, 128, 1, True)
assert prefill_shape_for(700, 43, 43, shapes) == StepShape(1024, 256, 64, True)
assert prefill_shape_for(5000, 1, 1, shapes) is None

# %% [markdown]
# Why a tile schedule and whole-step graphs, rather than vLLM's piecewise graphs (every
# kernel but attention captured, attention launched between the pieces)? With a
# schedule, attention's launch no longer depends on the batch, so nothing is left to
# launch from Python: a step is one replay, where piecewise graphs would still launch
# attention from Python once a layer, every step. What it costs is start-up time and a
# little memory, one graph per shape; `bench/ch11_capture.py` measures both:

# %% tags=["remove-input"]
capture = {r["what"]: r for r in load_records("ch11_capture") if r["name"] == "capture"}
if len(capture) == 2:
    alone, both = capture["decode graphs"], capture["decode and prefill graphs"]
    prose.glue("ch11_capture_decode", f"{alone['graphs']} decode graphs took "
               f"{alone['value']:.1f} s and {alone['memory_mib']:.0f} MiB")
    prose.glue("ch11_capture_both", f"{both['graphs']} graphs took "
               f"{both['value']:.1f} s and {both['memory_mib']:.0f} MiB")
    prose.glue("ch11_capture_added", f"{both['value'] - alone['value']:.1f} s and "
               f"{both['memory_mib'] - alone['memory_mib']:.0f} MiB")
    prose.show("""
On the {{ch11_gpu}}, with every kernel already compiled, the {{ch11_capture_decode}} of
device memory to capture; with the prefill graphs, {{ch11_capture_both}}. The prefill
graphs add {{ch11_capture_added}}, once, at start-up.
""")
else:
    print("Not recorded yet: bench/ch11_capture.py has not run on a GPU.")

# %% [markdown]
# ## One copy per step, padded
#
# Chapter 8b's runner already moves a step's inputs in one copy: `PackedInputs` lays
# every field of the step's `InputBatch` — ids, positions, slots, lengths, block tables,
# sampling settings — at a fixed offset of one pinned host buffer, and one copy moves
# them into a device buffer of the same layout. A graph adds one demand: the layout is
# the one the graph was captured reading. So a decode step of 5 rows that replays the
# graph of 8 is packed as a step of 8 (`pack(..., pad_to=8)`): its 5 rows, then 3
# padding rows, and the device views are the very ones the graph of 8 recorded. The
# layout of a shape is made once, so every replay of a size reads the same addresses.
#
# Nothing here is a second batch type: the fields a graph needs — the padding and
# `prev_rows`, the overlap section's — are fields of the one batch, unused before this
# chapter.

# %%
from tinyvllm_lib.engine.input_batch import InputBatch, PackedInputs  # noqa: E402
from tinyvllm_lib.engine.request import Request  # noqa: E402
from tinyvllm_lib.engine.sampling_params import SamplingParams  # noqa: E402
from tinyvllm_lib.engine.step_outputs import SchedulerOutput  # noqa: E402

if can_launch():  # pinned and device buffers: a GPU or the simulator
    five = [
        Request(str(i), None, rng.integers(0, 100, 3 + i).tolist(),
                SamplingParams(temperature=0.5 * (i % 2)), 8, (),
                generator=np.random.default_rng(i))
        for i in range(5)
    ]
    for r in five:  # each has computed its prompt but its last token
        r.num_computed_tokens = r.num_prompt_tokens - 1
    tables = rng.integers(0, 50, (5, 4)).astype(np.int32)
    decode = SchedulerOutput(five, [1] * 5, 0, tables)
    batch = InputBatch.from_step(decode, block_size=16)
    packed = PackedInputs(max_tokens=8, max_rows=8, max_blocks=4)
    packed.pack(batch, turn=0, pad_to=8)
    packed.copy(batch, stream=0)
    device = {name: view.copy_to_host() for name, view in batch.device.items()}
    assert np.array_equal(device["token_ids"][:5], batch.token_ids)
    assert np.array_equal(device["block_tables"][:5], decode.block_tables)
    assert (device["slot_mapping"][5:] == -1).all()
    assert (device["seq_lens"][5:] == 1).all()
    assert np.array_equal(device["query_start_loc"], np.arange(9))
    print(f"5 rows padded to 8: ids {device['token_ids'].tolist()}, "
          f"slots {device['slot_mapping'].tolist()}")


# %% [markdown]
# ## Log-probabilities on the GPU
#
# A request that asks for `logprobs=k` wants, for each token it is given, that token's
# log-probability and the k most likely tokens with theirs. Chapter 8b's sampler got
# them by copying the step's whole rows of logits to the host and running NumPy's
# `log_softmax` and `argpartition` there: 128,256 floats per row for Llama 3, half a
# megabyte, through PCIe and then through NumPy, every step. On the GPU the same
# numbers take one more kernel, and only k + 1 numbers per row cross:
#
# 1. the row's maximum and the sum of `exp(z − max)`: its log-sum-exp `L`, so that
#    `log p(i) = z[i] − L`;
# 2. the chosen token's `z − L`;
# 3. the k largest logits, in the order "larger value first, smaller index on ties" —
#    the order chapter 8b's greedy argmax uses.
#
# The first rung, `one_block_logprobs_kernel`, gives each row one block and makes
# k + 2 passes over it: the max, the sum, then k passes each finding the largest logit
# strictly after the last one found — for the top 20 of 128,256, 2.8 million reads per
# row by one multiprocessor. The second, `logprobs_kernel`, reads the row once, spread
# over the same shares as chapter 8b's sampler. In its single pass over its slice each
# thread keeps a running maximum with its sum of `exp(z − max)` (rescaled when the
# maximum grows, as chapter 7's online softmax) and its own k largest in a short sorted
# list (a new logit goes in only when it beats the list's last, which after the first
# few is rare). Then k rounds of a block argmax over the threads' list heads give the
# slice's k largest; the row's last block (the ticket again) combines the shares' maxima
# and sums into `L` and picks the row's k largest among the shares' k each. vLLM caps k
# at 20 by default (`max_logprobs`); a request asking for more here goes the host's way.
#
# Both kernels open, as every kernel of the library does, with chapter 1's
# `wait_for_previous_kernel()`: launched on its own it returns at once, and inside a
# graph whose edges are *programmatic* it is where a kernel started early waits for the
# one before it to finish. The graphs of this chapter use those edges; what they buy is
# measured near its end.

# %%
#| export kernels.logprobs
import math

import numpy as np
from numba import cuda, float32, int32, int64

from tinyvllm_lib.kernels.checks import is_device_array
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.sampling import (
    MAX_SHARES,
    MAX_THREADS,
    SAMPLER_THREADS,
    block_argmax,
    block_total,
    greedy_shares,
    row_argmax,
)

MAX_LOGPROBS = 20  # the most top tokens a row gets on the GPU (vLLM's max_logprobs)
MAX_CANDIDATES = MAX_SHARES * MAX_LOGPROBS  # a row's shares' top tokens, merged


@cuda.jit
def one_block_logprobs_kernel(logits, token_ids, k, chosen, top_ids, top_values):
    """A block per row: the log-softmax of token_ids[row] and of the row's k most
    likely tokens (larger first, smaller index on ties), in k + 2 passes.
    """
    wait_for_previous_kernel()
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    r, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    z = logits[r]
    m, _ = row_argmax(z, sv, si)
    acc = float32(0.0)
    for i in range(tid, z.shape[0], nt):
        acc += math.exp(z[i] - m)
    lse = m + math.log(block_total(acc, sv))
    if tid == 0:
        chosen[r] = z[token_ids[r]] - lse
    last, last_i = float32(math.inf), int64(-1)
    for j in range(k):
        best, best_i = float32(-math.inf), int64(z.shape[0])
        for i in range(tid, z.shape[0], nt):
            v = z[i]
            after = v < last or (v == last and i > last_i)
            if after and (v > best or best_i == z.shape[0]):
                best, best_i = v, i
        last, last_i = block_argmax(best, best_i, sv, si)
        if tid == 0:
            top_ids[r, j], top_values[r, j] = last_i, last - lse


@cuda.jit(device=True)
def insert_top(v, i, k, top_v, top_i, count):
    """(v, i) into a thread's list of its count (<= k) largest, larger first (i is past
    every index in it, so it goes after equal values); the new count.
    """
    if v != v or (count == k and not v > top_v[k - 1]):
        return count
    j = count if count < k else k - 1
    while j > 0 and top_v[j - 1] < v:
        top_v[j], top_i[j] = top_v[j - 1], top_i[j - 1]
        j -= 1
    top_v[j], top_i[j] = v, i
    return min(count + 1, k)


@cuda.jit
def logprobs_kernel(logits, token_ids, num_logprobs, chosen, top_ids, top_values,
                    part_m, part_s, cand_v, cand_i, tickets):
    """Block (row, share), one pass over the share: its max, sum of exp(z - max) and k
    largest (each thread keeps its own k, then k rounds pick the block's). The row's
    last block merges the shares: log-sum-exp, the chosen token's and the top k's
    log-probs (larger first, smaller index on ties). k = num_logprobs[row], at most
    MAX_LOGPROBS; a row with k < 0 asked for none, and its blocks leave at once.
    """
    wait_for_previous_kernel()
    r = cuda.blockIdx.x
    k = min(num_logprobs[r], MAX_LOGPROBS, logits.shape[1])
    if k < 0:
        return
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    mv = cuda.shared.array(MAX_CANDIDATES, float32)
    mi = cuda.shared.array(MAX_CANDIDATES, int64)
    flag = cuda.shared.array(1, int32)
    top_v = cuda.local.array(MAX_LOGPROBS, float32)
    top_i = cuda.local.array(MAX_LOGPROBS, int64)
    share, num_shares = cuda.blockIdx.y, cuda.gridDim.y
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    z = logits[r]
    n = z.shape[0]
    size = (n + num_shares - 1) // num_shares
    lo, hi = min(n, share * size), min(n, (share + 1) * size)
    # the share, once: an online max and sum of exp, the thread's k largest
    m, s, count = float32(-math.inf), float32(0.0), 0
    for i in range(lo + tid, hi, nt):
        v = z[i]
        if v > m:
            s, m = s * math.exp(m - v) + float32(1.0), v
        elif v > -math.inf:
            s += math.exp(v - m)
        if k > 0:
            count = insert_top(v, i, k, top_v, top_i, count)
    block_m, _ = block_argmax(m, int64(0), sv, si)
    s = block_total(s * math.exp(m - block_m) if m > -math.inf else float32(0), sv)
    # the block's k largest: k rounds over the threads' lists, the winner moves on
    head = 0
    for j in range(k):
        v, i = float32(-math.inf), int64(n)
        if head < count:
            v, i = top_v[head], top_i[head]
        v, i = block_argmax(v, i, sv, si)
        if head < count and top_i[head] == i:
            head += 1
        if tid == 0:
            cand_v[r, share * k + j], cand_i[r, share * k + j] = v, i
    if tid == 0:
        part_m[r, share], part_s[r, share] = block_m, s
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        flag[0] = 1 if cuda.atomic.add(tickets, r, 1) == num_shares - 1 else 0
    cuda.syncthreads()
    if flag[0] == 0:
        return
    cuda.threadfence()
    # the row's last block: merge the shares (read through L2: others wrote them)
    pm, ps = float32(-math.inf), float32(0.0)
    if tid < num_shares:
        pm = cuda.atomic.add(part_m, (r, tid), float32(0.0))
        ps = cuda.atomic.add(part_s, (r, tid), float32(0.0))
    row_m, _ = block_argmax(pm, int64(0), sv, si)
    total = block_total(
        ps * math.exp(pm - row_m) if pm > -math.inf else float32(0), sv
    )
    lse = row_m + math.log(total)
    for c in range(tid, num_shares * k, nt):
        mv[c] = cuda.atomic.add(cand_v, (r, c), float32(0.0))
        mi[c] = cuda.atomic.add(cand_i, (r, c), int64(0))
    cuda.syncthreads()
    last, last_i = float32(math.inf), int64(-1)
    for j in range(k):
        best, best_i = float32(-math.inf), int64(n)
        for c in range(tid, num_shares * k, nt):
            v, i = mv[c], mi[c]
            after = v < last or (v == last and i > last_i)
            if i < n and after and (v > best or (v == best and i < best_i)):
                best, best_i = v, i
        last, last_i = block_argmax(best, best_i, sv, si)
        if tid == 0:
            top_ids[r, j], top_values[r, j] = last_i, last - lse
    if tid == 0:
        chosen[r] = z[token_ids[r]] - lse
        tickets[r] = 0


# the types the engine launches them with (tests/ptx_check.py compiles them for sm_90)
_OUT_ARGS = "float32[::1], int64[:, ::1], float32[:, ::1]"
PTX_SIGNATURES = {
    "one_block_logprobs_kernel": [
        f"void(float32[:, ::1], int64[::1], int64, {_OUT_ARGS})"
    ],
    "logprobs_kernel": [
        f"void(float32[:, ::1], int64[::1], int64[::1], {_OUT_ARGS}, float32[:, ::1], "
        "float32[:, ::1], float32[:, ::1], int64[:, ::1], int32[::1])"
    ],
}


def logprobs_workspace(max_rows: int) -> dict:
    """The device arrays gpu_logprobs works in, for up to max_rows rows."""
    return {
        "part_m": cuda.device_array((max_rows, MAX_SHARES), np.float32),
        "part_s": cuda.device_array((max_rows, MAX_SHARES), np.float32),
        "cand_v": cuda.device_array((max_rows, MAX_CANDIDATES), np.float32),
        "cand_i": cuda.device_array((max_rows, MAX_CANDIDATES), np.int64),
        "tickets": cuda.to_device(np.zeros(max_rows, np.int32)),  # back at 0 after
    }


def gpu_logprobs(
    logits, token_ids, num_logprobs, chosen, top_ids, top_values, workspace, stream=0
):
    """chosen[r] = log p(token_ids[r]) and the top k of each row of logits (rows,
    vocab) float32, all on the GPU. num_logprobs: k for every row (an int), or each
    row's own (an int64 device array: -1 none, at most MAX_LOGPROBS taken, what a
    captured step reads); top_ids, top_values (>= rows, >= k); workspace:
    logprobs_workspace(>= rows).
    """
    rows, vocab = logits.shape
    if not all(is_device_array(a) for a in (logits, token_ids, chosen)):
        raise TypeError("gpu_logprobs: every array must be on the GPU")
    if is_device_array(num_logprobs):
        if num_logprobs.shape[0] < rows or top_ids.shape[1] < min(MAX_LOGPROBS, vocab):
            raise ValueError(
                f"gpu_logprobs: per-row k needs {rows} rows of k and top_ids of "
                f"{min(MAX_LOGPROBS, vocab)} columns, got {num_logprobs.shape[0]} "
                f"and {tuple(top_ids.shape)}"
            )
    else:
        k = num_logprobs
        if not 0 <= k <= min(MAX_LOGPROBS, vocab) or top_ids.shape[1] < k:
            raise ValueError(
                f"gpu_logprobs: k must be in [0, {min(MAX_LOGPROBS, vocab)}] and fit "
                f"top_ids {tuple(top_ids.shape)}, got {k}"
            )
        num_logprobs = cuda.to_device(np.full(rows, k, np.int64), stream=stream)
    if rows:
        w = workspace
        logprobs_kernel[(rows, greedy_shares(rows)), SAMPLER_THREADS, stream](
            logits, token_ids, num_logprobs, chosen, top_ids, top_values, w["part_m"],
            w["part_s"], w["cand_v"], w["cand_i"], w["tickets"],
        )


# %% [markdown]
# Checked against chapter 8b's NumPy path on fresh random logits, with repeated values
# planted in one row so that ties are exercised:

# %%
from numba import cuda  # noqa: E402

from tinyvllm_lib.engine.sampler import top_logprobs  # noqa: E402
from tinyvllm_lib.kernels.logprobs import (  # noqa: E402
    gpu_logprobs,
    logprobs_workspace,
)
from tinyvllm_lib.kernels.softmax import log_softmax  # noqa: E402

if can_launch():  # a GPU or the simulator
    rows, vocab, k = 3, 300, 5
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[1, [7, 70, 170]] = logits[1].max() + 1  # a three-way tie at the top
    picked = rng.integers(0, vocab, rows)
    chosen = cuda.device_array(rows, np.float32)
    top_i = cuda.device_array((rows, k), np.int64)
    top_v = cuda.device_array((rows, k), np.float32)
    d_logits, d_picked = cuda.to_device(logits), cuda.to_device(picked)
    gpu_logprobs(
        d_logits, d_picked, k, chosen, top_i, top_v, logprobs_workspace(rows)
    )
    want = log_softmax(logits)
    want_i, want_v = top_logprobs(want, k)
    assert np.allclose(chosen.copy_to_host(), want[np.arange(rows), picked], atol=1e-5)
    assert np.allclose(top_v.copy_to_host(), want_v, atol=1e-5)
    # ties: the smaller index first
    assert top_i.copy_to_host()[1, :3].tolist() == [7, 70, 170]
    assert (top_i.copy_to_host()[[0, 2]] == want_i[[0, 2]]).all()
    print("GPU log-probs match NumPy's; row 1's top 3:", top_i.copy_to_host()[1, :3])

# %% tags=["hide-input"]
# the two rungs on the GPU: bench/ch08b_sampler.py (both rungs in one run)


def bytes_us(r: dict) -> float:
    """The µs a record's bytes take at the bandwidth ceiling."""
    return r["bytes"] / (CEILING_GB_S * 1e9) * 1e6


lp = {
    (r["shape"][0], r["setting"], r["kernel"]): r
    for r in load_records("ch08b_sampler")
    if r["name"] == "logprobs"
}
for rows in (1, 256):
    for k in (5, 20):
        new, old = (lp.get((rows, f"logprobs_{k}", kind)) for kind in
                    ("shares", "one_block"))
        prose.glue(f"ch11_lp{k}_new_{rows}",
                   f"{new['value']:.1f} µs" if new else "(not recorded yet)")
        prose.glue(f"ch11_lp{k}_old_{rows}",
                   f"{old['value']:.1f} µs" if old else "(not recorded yet)")
        prose.glue(f"ch11_lp{k}_times_{rows}",
                   f"{new['value'] / bytes_us(new):.1f}×" if new
                   else "(not recorded yet)")
for (rows, setting, kind), r in lp.items():
    print(f"{rows:>3} rows  {setting:<12} {kind:<10} {r['value']:9.1f} µs  "
          f"({r['value'] / bytes_us(r):.1f}x the bytes at the ceiling)")
if not lp:
    print("not recorded yet: run bench/ch08b_sampler.py on a GPU")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
The top 20 log-probs of one row took {{ch11_lp20_old_1}} with a block per row and
{{ch11_lp20_new_1}} spread over the shares; at 256 rows {{ch11_lp20_old_256}} against
{{ch11_lp20_new_256}}, {{ch11_lp20_times_256}} the time the rows' bytes take at
{{ch11_ceiling}}. For the top 5: {{ch11_lp5_old_1}} against {{ch11_lp5_new_1}} at one
row, {{ch11_lp5_old_256}} against {{ch11_lp5_new_256}} at 256.
""")

# %% [markdown]
# The runner samples with it on the GPU (the engine gives every runner on "cuda" this
# sampler). Its `launch` runs `gpu_logprobs` after the sampling kernels, on the sampled
# ids, with each row's k read from the step's batch (`num_logprobs`, −1 for a row that
# asked for none, whose blocks leave at once): so a captured step computes log-probs
# too, and a request that asks for them replays the same graph as a sampled one that
# does not (only a batch of greedy rows asking nothing more replays a leaner graph: see
# `shape_for` below).
# The host receives ids and the asked-for numbers only: `enqueue` queues the copies
# into one of two pinned host buffers and returns at once; `finish` reads the buffer
# once the stream has passed the copies. More than `MAX_LOGPROBS` goes chapter 8b's
# way, through the host. A prompt's log-probs (`prompt_logprobs`) take the same kernel
# in an eager step, `max_rows` rows a launch, each row's token the prompt's next one:
# a 1,000-token prompt sends back k + 1 numbers a row, not its half-gigabyte of logits.

# %%
#| export engine.cuda_graphs
import numpy as np
from numba import cuda

from tinyvllm_lib.engine.sampler import SamplerOutput, SamplingMetadata
from tinyvllm_lib.engine.sampler_cuda import CudaSampler
from tinyvllm_lib.kernels.logprobs import (
    MAX_LOGPROBS,
    gpu_logprobs,
    logprobs_workspace,
)
from tinyvllm_lib.kernels.sampling_radix import NUM_STEPS


class GpuLogprobsSampler(CudaSampler):
    """CudaSampler with log-probabilities computed on the GPU (up to MAX_LOGPROBS top
    tokens): only the ids and the asked-for numbers cross to the host, into one of two
    pinned buffers (`turn`); nothing waits. More than MAX_LOGPROBS: the host's way.
    """

    def __init__(self, vocab_size: int, max_rows: int, stream=0):
        super().__init__(vocab_size, max_rows, stream)
        self.chosen = cuda.device_array(max_rows, np.float32)
        self.top_ids = cuda.device_array((max_rows, MAX_LOGPROBS), np.int64)
        self.top_values = cuda.device_array((max_rows, MAX_LOGPROBS), np.float32)
        self.logprobs_workspace = logprobs_workspace(max_rows)
        self.pinned = [
            {
                "chosen": cuda.pinned_array(max_rows, np.float32),
                "top_ids": cuda.pinned_array((max_rows, MAX_LOGPROBS), np.int64),
                "top_values": cuda.pinned_array((max_rows, MAX_LOGPROBS), np.float32),
            }
            for _ in range(2)
        ]

    def launch(self, logits, stream, rows: dict, steps=range(NUM_STEPS),
               penalize: bool = True, logprobs: bool = True) -> None:
        """CudaSampler's kernels, then (logprobs: some row may ask) the log-probs of
        the sampled ids and of each row's top rows["num_logprobs"], on `stream`: what a
        captured step runs too, so log-probs cost no launch from Python.
        """
        super().launch(logits, stream, rows, steps, penalize)
        if logprobs:
            n = logits.shape[0]
            gpu_logprobs(
                logits, self.ids[:n], rows["num_logprobs"][:n], self.chosen,
                self.top_ids, self.top_values, self.logprobs_workspace, stream,
            )

    def enqueue(self, logits, metadata: SamplingMetadata, turn: int) -> tuple:
        n, s, host = len(metadata.temperature), self.stream, self.pinned[turn]
        k = int(metadata.num_logprobs.max(initial=-1))
        if n == 0 or not 0 <= k <= MAX_LOGPROBS:
            return super().enqueue(logits, metadata, turn)
        # launch() has queued the log-probs: only the asked-for numbers cross
        self.ids[:n].copy_to_host(self.host_ids[turn][:n], stream=s)
        self.chosen[:n].copy_to_host(host["chosen"][:n], stream=s)
        if k > 0:  # whole rows: a copy of contiguous memory
            self.top_ids[:n].copy_to_host(host["top_ids"][:n], stream=s)
            self.top_values[:n].copy_to_host(host["top_values"][:n], stream=s)
        return turn, n, None, k

    def prompt_logprobs(self, logits, targets, k: int) -> tuple:
        """A prompt chunk's log-probs on the GPU (k up to MAX_LOGPROBS, else the host's
        way), max_rows rows a launch over the sampled rows' workspace (the same stream
        runs them one after the other): only the asked-for numbers cross.
        """
        if not 0 <= k <= MAX_LOGPROBS:
            return super().prompt_logprobs(logits, targets, k)
        n, s = logits.shape[0], self.stream
        chosen = cuda.device_array(n, np.float32, stream=s)
        ids = cuda.device_array((n, MAX_LOGPROBS), np.int64, stream=s)
        values = cuda.device_array((n, MAX_LOGPROBS), np.float32, stream=s)
        targets = cuda.to_device(np.ascontiguousarray(targets, np.int64), stream=s)
        ks = cuda.to_device(np.full(self.max_rows, k, np.int64), stream=s)
        for a in range(0, n, self.max_rows):
            b = min(n, a + self.max_rows)
            gpu_logprobs(logits[a:b], targets[a:b], ks, chosen[a:b], ids[a:b],
                         values[a:b], self.logprobs_workspace, s)
        if k == 0:
            return chosen.copy_to_host(stream=s), None, None
        return (chosen.copy_to_host(stream=s), ids.copy_to_host(stream=s)[:, :k],
                values.copy_to_host(stream=s)[:, :k])

    def finish(self, queued: tuple) -> SamplerOutput:
        turn, n, _, k = queued
        if k < 0:  # the host's log-probs, or none
            return super().finish(queued)
        out, host = SamplerOutput(self.host_ids[turn][:n].copy()), self.pinned[turn]
        out.logprobs = host["chosen"][:n].copy()
        if k > 0:
            out.top_ids = host["top_ids"][:n, :k].copy()
            out.top_logprobs = host["top_values"][:n, :k].copy()
        return out


# %% [markdown]
# ## The graphs, a part of the runner
#
# `CudaGraphs` is a part the runner holds, made by the engine once the KV cache exists
# (the graphs record the cache's address). For each size it packs a batch of padding
# rows (token 0 at position 0, slot −1, a context of one token in block 0) and captures
# a function of that batch: the runner's own `run` — the layer loop, the head and the
# sampler's kernel, written in chapter 8b to read nothing but the batch's device views
# and the runner's buffers. Capturing first runs the function once, which compiles and
# loads every kernel it launches.
#
# `shape_for` is the one place that decides whether a step replays: a batch whose every
# request has one new token and is due its next one (`is_uniform_decode`) and a size
# that holds it, or a step with prompt tokens, no prompt rows to keep, and a prefill
# shape that holds it. Up to `ARGMAX_GRAPH_MAX_ROWS` rows a decode size has two graphs:
# the one that launches every sampling, penalty and log-prob kernel whatever its rows
# ask, and an `argmax_only` one whose sampler is the argmax alone, which `shape_for`
# picks when every row is greedy with no penalty and no log-probs. The runner's
# `execute_async` asks it, packs the batch padded to
# that shape, queues the one copy, and replays instead of running; the sampler's
# log-probabilities and the copies back are queued after, as for any step. Nothing else
# changes: the scheduler and the cache do not know whether a step was replayed.
# `LLM(..., enforce_eager=True)` (vLLM's name) makes no graphs.
#
# In numba's simulator, where this book's CI runs, a "replay" calls the function again:
# the padding and the packed inputs are tested there, the capture only on a GPU.
#
# Each graph starts with one more kernel, for the overlap section below: a row whose
# `prev_rows` field is r ≥ 0 takes as its token id the id that the step before sampled
# in its row r, read on the GPU from the sampler's buffer; −1, in every row of a step
# the host knows whole, leaves the copied id.

# %% [markdown]
# One step, end to end, as the library now runs it — each box is a type or a call a
# reader can find by name, the arrows what passes between them. The scheduler's side
# (left) knows requests and blocks; the runner's (right) knows buffers and kernels; the
# two meet in `SchedulerOutput` and `ModelRunnerOutput`, in a module neither owns.


# %% tags=["hide-input"]
def draw_step_flow():
    """One engine step: schedule() to RequestOutput, through the one batch."""
    boxes = [  # (x, y, text, side): side 0 the scheduler's, 1 the runner's, 2 shared
        (0.0, 5, "Scheduler.schedule()\n(or schedule_ahead: prev_rows)", 0),
        (0.0, 4, "SchedulerOutput\nrequests, new tokens, block tables", 2),
        (1.0, 4, "InputBatch.from_step\nids, positions, metadata,\n"
         "logits rows, sampling", 1),
        (1.0, 3, "PackedInputs.pack + copy\none pinned buffer -> one copy\n"
         "(padded to a graph's size)", 1),
        (1.0, 2, "CudaGraphs.shape_for(batch)?\nreplay its graph : run(batch)\n"
         "next_ids, layers, head, sampler", 1),
        (1.0, 1, "sampler.enqueue\nids (+ log-probs) -> pinned host", 1),
        (1.0, 0, "AsyncModelRunnerOutput\n.get_output() waits", 1),
        (0.0, 1, "ModelRunnerOutput\nsampled ids, prompt log-probs", 2),
        (0.0, 0, "Scheduler.postprocess\n-> RequestOutput", 0),
    ]
    fig, ax = new_figure(height=5.2, width=8.5)
    colors = ("#dbe9f6", "#fde2c8", "#e4e4e4")
    for x, y, text, side in boxes:
        ax.text(x, y, text, ha="center", va="center", fontsize=8.5,
                bbox={"boxstyle": "round,pad=0.4", "fc": colors[side], "ec": "0.4"})
    arrows = [((0, 5), (0, 4)), ((0, 4), (1, 4)), ((1, 4), (1, 3)), ((1, 3), (1, 2)),
              ((1, 2), (1, 1)), ((1, 1), (1, 0)), ((1, 0), (0, 1)), ((0, 1), (0, 0))]
    for (x0, y0), (x1, y1) in arrows:
        ax.annotate("", (x1 + (0.3 if x1 < x0 else -0.3 if x1 > x0 else 0),
                         y1 + (0.32 if y1 < y0 else 0)),
                    (x0 + (-0.3 if x1 < x0 else 0.3 if x1 > x0 else 0),
                     y0 - (0.32 if y1 < y0 else 0)),
                    arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.text(0.0, 5.75, "the scheduler's side", ha="center", fontsize=9, color="#2b5d8a")
    ax.text(1.0, 5.75, "the runner's side (GPU)", ha="center", fontsize=9,
            color="#a0522d")
    ax.set_xlim(-0.55, 1.55)
    ax.set_ylim(-0.6, 6.1)
    ax.axis("off")
    return fig


draw_step_flow()
plt.show()

# %%
#| export kernels.next_ids
from numba import cuda

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

NEXT_IDS_THREADS = 128


@cuda.jit
def next_ids_kernel(prev_rows, sampled, ids):
    """ids[i] = sampled[prev_rows[i]] where prev_rows[i] >= 0; the rest stay."""
    wait_for_previous_kernel()
    i = cuda.grid(1)
    if i < ids.shape[0] and prev_rows[i] >= 0:
        ids[i] = sampled[prev_rows[i]]


def next_ids(prev_rows, sampled, ids, stream=0) -> None:
    """A step's token ids from the last step's samples, on the GPU (rows with a
    prev_rows of -1 keep theirs).
    """
    n = ids.shape[0]
    next_ids_kernel[cdiv(n, NEXT_IDS_THREADS), NEXT_IDS_THREADS, stream](
        prev_rows, sampled, ids
    )


PTX_SIGNATURES = {"next_ids_kernel": ["void(int64[::1], int64[::1], int64[::1])"]}

# %%
if can_launch():  # a GPU or the simulator
    prev_rows = np.array([2, -1, 0, 1], np.int64)
    sampled, ids = np.array([50, 60, 70], np.int64), np.array([1, 2, 3, 4], np.int64)
    d_ids = cuda.to_device(ids)
    next_ids(cuda.to_device(prev_rows), cuda.to_device(sampled), d_ids)
    want = np.where(prev_rows >= 0, sampled[np.maximum(prev_rows, 0)], ids)
    assert np.array_equal(d_ids.copy_to_host(), want), d_ids.copy_to_host()
    print("ids fed forward:", d_ids.copy_to_host())

# %%
#| export
from dataclasses import replace

from tqdm.auto import tqdm

from tinyvllm_lib.cuda_graph import CudaGraph
from tinyvllm_lib.engine.input_batch import InputBatch, StepShape
from tinyvllm_lib.kernels.next_ids import next_ids
from tinyvllm_lib.layers.attention_metadata import build_attention_metadata


def padding_batch(rows: int, block_size: int, num_prefills: int = 0) -> InputBatch:
    """A decode batch of `rows` padding rows: token 0 at position 0 of a one-token
    context in block 0, slot -1 (the KV write skips it), greedy; the first
    num_prefills of them one-token prefills (a prefill graph's attention).
    """
    ones = np.ones(rows, np.int32)
    positions, metadata = build_attention_metadata(
        ones, ones, np.zeros((rows, 1), np.int32), block_size, num_prefills
    )
    metadata = replace(metadata, slot_mapping=np.full(rows, -1, np.int64))
    sampling = SamplingMetadata(
        np.zeros(rows, np.float32), np.zeros(rows, np.int64),
        np.ones(rows, np.float32), np.zeros(rows, np.float64),
        np.full(rows, -1, np.int64),
    )
    return InputBatch(rows, np.zeros(rows, np.int64), positions, metadata,
                      np.arange(rows, dtype=np.int64), {}, {}, sampling)


# Up to this many rows a decode size also gets an argmax_only graph (`argmax_graphs`):
# a greedy batch's sampler is then its argmax alone, not the seven sampling launches,
# the penalties' two and the log-probs' one that return at once for greedy rows; each
# still costs a launch, which shows where the whole step is short (batch 1: the two
# graphs' times are recorded by bench/ch11_llama.py)
ARGMAX_GRAPH_MAX_ROWS = 16


class CudaGraphs:
    """A runner's steps as CUDA graphs, captured over its buffers and KV cache: a decode
    graph per size of cuda_graph_sizes(max_num_seqs) (`graphs`, by rows), and for
    sizes up to ARGMAX_GRAPH_MAX_ROWS an argmax_only one (`argmax_graphs`, by rows); a
    prefill graph per shape of prefill_graph_shapes (`prefill_graphs`, by shape;
    prefill=False: none); shape_for decides which steps replay one.
    """

    def __init__(self, runner, progress: bool = True, prefill: bool = True):
        if runner.device != "cuda" or runner.kv_cache is None:
            raise ValueError("CUDA graphs need a runner on 'cuda' with its KV cache")
        self.runner, self.sizes = runner, cuda_graph_sizes(runner.max_num_seqs)
        self.prefill_shapes = (
            prefill_graph_shapes(runner.max_num_batched_tokens, runner.max_num_seqs)
            if prefill else []
        )
        self.graphs: dict[int, CudaGraph] = {}
        self.argmax_graphs: dict[int, CudaGraph] = {}
        self.prefill_graphs: dict[StepShape, CudaGraph] = {}
        shapes = (
            [StepShape(n, n, n) for n in self.sizes]
            + [StepShape(n, n, n, argmax_only=True)
               for n in self.sizes if n <= ARGMAX_GRAPH_MAX_ROWS]
            + self.prefill_shapes
        )
        bar = tqdm(shapes, desc="Capturing CUDA graphs", unit="graph",
                   disable=not progress)
        # no memory may be freed while a stream is being captured
        with cuda.defer_cleanup():
            for shape in bar:  # each shape's layout, filled with harmless rows
                batch = (padding_batch(1, runner.block_size, num_prefills=1)
                         if shape.prefill else padding_batch(shape.rows,
                                                             runner.block_size))
                runner.packed.pack(batch, turn=0, pad_to=shape)
                runner.packed.copy(batch, runner.stream)
                graph = CudaGraph(self.step_function(batch), runner.stream)
                if shape.prefill:
                    self.prefill_graphs[shape] = graph
                elif shape.argmax_only:
                    self.argmax_graphs[shape.rows] = graph
                else:
                    self.graphs[shape.rows] = graph
            runner.stream.synchronize()

    def step_function(self, batch: InputBatch):
        """What a graph captures: a padded step on the batch's device views."""
        runner, v = self.runner, batch.device
        ahead = not batch.cudagraph_shape.prefill  # only decode steps plan ahead

        def launch(stream):
            if ahead:  # rows planned ahead take the last step's samples
                next_ids(v["prev_rows"], runner.sampler.ids, v["token_ids"], stream)
            runner.run(batch, stream)

        return launch

    def shape_for(self, batch: InputBatch) -> StepShape | None:
        """The graph a batch replays: a uniform decode step that a size holds, or a
        prefill or mixed step that a prefill shape holds (with no prompt rows to keep);
        else None (it runs eagerly).
        """
        if batch.is_uniform_decode:
            size = graph_size_for(batch.num_reqs, self.sizes)
            if size is None:
                return None
            argmax = size in self.argmax_graphs and batch.sampling.argmax_only
            return StepShape(size, size, size, argmax_only=argmax)
        if not batch.metadata.num_prefills or batch.num_logits != batch.num_sampled:
            return None
        return prefill_shape_for(batch.num_tokens, batch.num_reqs, batch.num_sampled,
                                 self.prefill_shapes)

    def replay(self, shape: StepShape) -> None:
        graph = (self.prefill_graphs[shape] if shape.prefill
                 else self.argmax_graphs[shape.rows] if shape.argmax_only
                 else self.graphs[shape.rows])
        graph.replay()


# %% [markdown]
# On a GPU, the same requests through both paths: the graphs must give the eager path's
# tokens, and a batch-1 decode should be many times faster. Padding could have a price
# in numbers, not only in work: a step of 25 rows replayed as 32 would run decode
# attention with the split count chosen for 32 rows, and the split count sets the order
# of float32 sums, so their last bits: measured before chapter 8 rounded the rows
# (`split_rows`), padded steps moved SmolLM2's log-probabilities by a few hundredths
# and drew other tokens for some seeded rows, while one split everywhere gave the eager
# numbers (the GEMMs at 32 rows gave those of 25). Now the eager path, too, splits as
# for the rows rounded up to a graph's size, so `tests/test_cuda_graphs.py` holds both a
# graph for every batch size (no step padded) and vLLM's sizes to the eager path's
# tokens, greedy and seeded, with log-probabilities within 10⁻⁴. In the simulator
# a replay is a relaunch and proves nothing about speed, so the cell runs only on a GPU.

# %%
if has_gpu():
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    for eager in (True, False):
        llm = LLM("smollm2", max_model_len=1024, max_num_seqs=2, enforce_eager=eager)
        outputs = llm.generate(prompts, benchmark.greedy(32), use_tqdm=False)
        timing = benchmark.latency(llm, prompt_len=128, new_tokens=64, repeats=1)
        print(
            f"{'eager' if eager else 'graphs'}: {timing['decode_tok_s']:.0f} decode"
            f" tok/s; {outputs[0].outputs[0].text!r}"
        )
        del llm
else:
    print("no GPU here: the graph path is checked in the simulator by the tests")

# %% [markdown]
# ## Overlapping the host with the GPU
#
# A replayed step still leaves the GPU idle while the host works. The engine waits for
# the step's samples, then post-processes them (appends the tokens, detokenizes, checks
# stops, frees the finished), schedules the next step, packs its inputs, and only then
# replays again. The section on the host's cost below measures that work alone: a
# fraction of a millisecond per step at batch 1 and milliseconds at 256 rows, of the
# order of the GPU's own step, during which the GPU waits.
#
# vLLM's answer is *async scheduling*: schedule and launch step n + 1 before step n's
# tokens are on the host. Three things make that possible.
#
# - The scheduler does not need the tokens to plan a decode step, only their number:
#   every running request gets one more. `AsyncScheduler.schedule_ahead` plans it from
#   the step in flight, with a slot for the position one past: a plain
#   `SchedulerOutput` whose `prev_rows` say, for each row, its row in step n. Chapter
#   8b's `InputBatch.from_step` reads that field and starts each row one position
#   further, its id left at 0: the same builder, the same batch.
# - The GPU has the tokens: `next_ids`, the first kernel of each graph, copies each
#   row's id from the sampler's buffer of the step before (`prev_rows`), so the ids
#   never make the round trip through the host.
# - A request may finish at step n (an end-of-sequence token, a stop string) after step
#   n + 1 was launched with it. Its row of step n + 1 computes a token nobody reads:
#   chapter 10's `PagedScheduler.postprocess` skips the rows of finished requests. A
#   request whose last token by length is step n's is not scheduled ahead at all, and
#   a waiting request is admitted at the next full schedule, one step later than it
#   would otherwise be.
#
# The engine (chapter 10's `LLMEngine`, with `async_scheduling`, on by default with
# graphs) then keeps one step in flight: launch step n + 1, then wait for step n and
# post-process it while the GPU runs n + 1. Anything that is not a replayable decode
# step (a prefill, a preemption, a waiting request while a seat is free, whether or not
# the pool could take it yet) empties the pipeline first and runs as before. The KV
# blocks of a request freed at step n may still be read and written by step n + 1 on the
# GPU; whoever gets them next writes them in a later step, after n + 1 on the same
# stream.

# %%
#| export engine.async_scheduler
import numpy as np

from tinyvllm_lib.engine.paged_scheduler import PagedScheduler
from tinyvllm_lib.engine.step_outputs import SchedulerOutput


class AsyncScheduler(PagedScheduler):
    """PagedScheduler that can plan the next decode step before the step in flight is
    post-processed (vLLM's async scheduling). PagedScheduler.postprocess already drops
    the token of a request that finished meanwhile.
    """

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after prev, prev's tokens not yet known (its prev_rows say
        where they are); None where only a full schedule will do (prev not all decodes,
        someone to admit, a short pool).
        """
        if prev.num_prefills or prev.num_tokens != len(prev.requests):
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None  # admit it first
        if len(self.running) != len(prev.requests):
            return None  # a running request that prev left out: schedule in full
        generated = np.array([len(r.output_token_ids) for r in prev.requests])
        # prev's token is the last of a request that reaches max_tokens with it
        rows = np.flatnonzero(
            generated + 1 < np.array([r.max_tokens for r in prev.requests])
        )
        if not rows.size:
            return None
        requests = (
            list(prev.requests) if rows.size == len(prev.requests)
            else [prev.requests[i] for i in rows.tolist()]
        )
        computed = np.array([r.num_computed_tokens for r in requests], np.int64)
        if prev.num_blocks is None:  # not known: every row from the block manager
            tables = np.zeros((len(rows), self.max_blocks), np.int32)
            num_blocks = np.zeros(len(rows), np.int64)
        else:  # prev's rows, copied: no table has changed since prev was planned
            # (only a full schedule admits, preempts or frees)
            tables, num_blocks = prev.block_tables[rows], prev.num_blocks[rows]
        # a slot for the position one past prev's: only a row whose blocks are all
        # taken needs more (one row in block_size), and its row is written again
        need = -(-(computed + 2) // self.block_manager.block_size)
        for row in np.flatnonzero(need > num_blocks).tolist():
            r = requests[row]
            if not self.block_manager.append_slots(
                r.request_id, r.num_computed_tokens + 2
            ):
                return None
            table = self.block_manager.block_tables[r.request_id]
            tables[row, : len(table)], num_blocks[row] = table, len(table)
        return SchedulerOutput(
            requests, [1] * len(requests), 0, tables, prev_rows=rows.astype(np.int64),
            num_blocks=num_blocks,
        )


# %% [markdown]
# `bench/ch11_timeline.py` draws the overlap from a real run: the engine decodes at
# batch 1 and at batch 64 on the H200, each host phase stamped with the host's clock and
# each replayed graph timed between two CUDA events on the runner's stream, put on the
# host's clock by an event recorded on an idle stream. Six steps from the middle of
# each run (a white line separates two steps on the GPU, which runs them back to back
# when the host keeps ahead):

# %% tags=["hide-input"]
spans = load_records("ch11_timeline")
if not spans:
    print("Not recorded yet: bench/ch11_timeline.py has not run on a GPU.")
else:
    colors = {"schedule": "C2", "launch": "C0", "wait": "0.8", "postprocess": "C1",
              "graph": "C3"}
    sizes = sorted({r["rows"] for r in spans})
    fig, axes = new_figure(len(sizes), 1, width=9, height=1.6 * len(sizes))
    for ax, rows in zip(np.atleast_1d(axes), sizes):
        for r in (r for r in spans if r["rows"] == rows):
            y = 1 if r["lane"] == "host" else 0
            ax.broken_barh([(r["start_ms"], r["end_ms"] - r["start_ms"])],
                           (y - 0.35, 0.7), facecolor=colors[r["what"]],
                           edgecolor="white", linewidth=1.5)
        ax.set_yticks([0, 1], ["GPU", "host"])
        ax.set_title(f"{rows} request{'s' * (rows > 1)} decoding", fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
    np.atleast_1d(axes)[-1].set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["plan the next step", "launch it", "wait for the last",
                         "post-process the last", "a replayed step"],
               loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    plt.show()

# %% tags=["remove-input"]
if spans:
    longer = {}
    for rows in sorted({r["rows"] for r in spans}):
        mine = [r for r in spans if r["rows"] == rows]
        gpu = np.median([r["value"] for r in mine if r["lane"] == "GPU"])
        host = sum(np.median([r["value"] for r in mine if r["what"] == w] or [0])
                   for w in ("schedule", "launch", "postprocess"))
        wait = np.median([r["value"] for r in mine if r["what"] == "wait"])
        prose.glue(f"ch11_tl_gpu_{rows}", f"{gpu:.2f} ms")
        prose.glue(f"ch11_tl_host_{rows}", f"{host:.2f} ms")
        prose.glue(f"ch11_tl_wait_{rows}", f"{wait:.2f} ms")
        launch = np.median([r["value"] for r in mine if r["what"] == "launch"])
        assert launch > host / 2, (rows, launch, host)  # "most of the host's part"
        longer[rows] = "the GPU's" if gpu > host else "the host's"
    prose.glue("ch11_tl_pace", f"{longer[1]} at both sizes" if longer[1] == longer[64]
               else f"{longer[1]} at batch 1 and {longer[64]} at 64")
    prose.show("""
A step's host work (planning, launching and post-processing, medians) took
{{ch11_tl_host_1}} at batch 1 against the GPU's {{ch11_tl_gpu_1}}, and
{{ch11_tl_host_64}} against {{ch11_tl_gpu_64}} at 64. The longer part sets the pace —
{{ch11_tl_pace}} — and the host waited {{ch11_tl_wait_1}} and {{ch11_tl_wait_64}} a
step (medians) for the step before to end. Most of the host's part is the launch
(packing the batch, the copy, the replay, the copies back), not the scheduler.
""")

# %% [markdown]
# ## Nothing compiles under a request
#
# numba compiles a kernel the first time it is launched with a new set of argument
# types, and some kernels are built by a factory the first time a shape asks for them.
# Capturing the decode graphs compiles everything a decode step launches, but not what
# only other kinds of step reach: the prefill attention of a prompt, the paged prefill
# of a prompt that continues (a chunk after a chunk, or a prompt after a cached prefix),
# a mixed step's gathered head rows, the log-probs kernel. Each of those cost the
# first request that reached it a compile, measured below.
#
# So the engine pays at start-up, as vLLM's `compile_or_warm_up_model` does:
# `warm_up_model` runs one step of every kind a request can reach through the runner's
# own `execute`, on throwaway requests whose block tables point at the first blocks of
# the (still empty) pool, with a progress bar. Whatever those steps compile is compiled
# before the first user arrives; what they write into the cache is overwritten by the
# requests that get those blocks. The GPU test `test_gpu_nothing_compiles_after_start`
# sends one request of every kind after start-up and checks that no numba dispatcher
# gained an overload.

# %%
#| export engine.warm_up
import numpy as np
from tqdm.auto import tqdm

from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.kernels.checks import cdiv

# the kinds of request a step can hold, as SamplingParams
WARM_UP_PARAMS = {
    "greedy": {},
    # with penalties: their kernels too
    "sampled": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 1,
                "presence_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 5, "prompt_logprobs": 1},
    "top logprobs": {"logprobs": 20},
}


def warm_up_steps(runner) -> list[tuple[str, list, list[int]]]:
    """The steps warm_up_model runs: (what, requests, new tokens each), in order; a
    request's later entries continue it. Sizes fit the runner's limits (none below 8
    tokens of max_model_len: a request there gets the compile).
    """
    c, bs = runner.config, runner.block_size
    if runner.max_model_len < 8:
        return []
    budget, pair = runner.max_num_batched_tokens, runner.max_num_seqs >= 2
    longest = max(1, min(runner.max_model_len - 4, budget - 1, 3 * bs + 5))
    rng = np.random.default_rng(0)

    def request(name: str, length: int, kind: str) -> Request:
        ids = rng.integers(0, c.vocab_size, length).tolist()
        params = SamplingParams(max_tokens=4, ignore_eos=True, **WARM_UP_PARAMS[kind])
        return Request(f"warm-up {name}", None, ids, params, 4, ())

    a = request("prompt", longest, "greedy")
    b = request("one token", 1, "logprobs")
    steps = [  # a prompt of several tokens and one of one token; then a decode step
        *([("prefill", [a, b], [longest, 1])] if pair else
          [("prefill", [a], [longest]), ("prefill", [b], [1])]),
        *([("decode", [a, b], [1, 1])] if pair else
          [("decode", [a], [1]), ("decode", [b], [1])]),
    ]
    if longest >= 2:  # a chunk that ends inside its prompt, then the rest of it
        chunked, first = request("chunked", longest, "sampled"), longest // 2
        steps += [("chunk", [chunked], [first])]
        steps += [("continued chunk", [chunked], [longest - first])]
    if pair:  # a prompt beside a decode row, with 20 log-probs
        mixed = request("mixed", min(5, longest), "top logprobs")
        steps += [("mixed", [mixed, a], [mixed.num_prompt_tokens, 1])]
        steps += [("decode", [mixed, a], [1, 1])]
    return steps


def warm_up_model(runner, progress: bool = True) -> None:
    """Run one step of every kind (prefill, decode, a chunk, a continued chunk, a mixed
    step; greedy, sampled, log-probs) through runner.execute, so that every kernel they
    reach is compiled now. The requests are throwaway; they write only into the first
    blocks of the pool, which no request holds yet.
    """
    bs, steps = runner.block_size, warm_up_steps(runner)
    num_blocks = runner.kv_cache.num_slots // bs
    max_blocks = cdiv(runner.max_model_len, bs)
    tables, next_block = {}, 0
    for _, requests, _ in steps:  # each request its own blocks while the pool lasts
        for r in requests:
            if r.request_id not in tables:
                need = cdiv(r.num_prompt_tokens + r.max_tokens, bs)
                blocks = np.arange(next_block, next_block + need) % num_blocks
                tables[r.request_id], next_block = blocks, next_block + need
    bar = tqdm(steps, desc="Compiling kernels", unit="step", disable=not progress)
    for _, requests, num_new in bar:
        block_tables = np.zeros((len(requests), max_blocks), np.int32)
        for row, r in enumerate(requests):
            block_tables[row, : len(tables[r.request_id])] = tables[r.request_id]
        prefills = sum(r.num_computed_tokens < r.num_prompt_tokens for r in requests)
        step = SchedulerOutput(list(requests), list(num_new), prefills, block_tables)
        result = runner.execute(step)
        tokens = iter(result.sampled.token_ids)
        for r, n in zip(requests, num_new):
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens:  # its next token was due
                r.output_token_ids.append(int(next(tokens)))
            if r.params.prompt_logprobs is not None and r.num_computed_tokens >= (
                r.num_prompt_tokens
            ):
                r.prompt_logprobs = []  # collected (the scheduler would keep them)


# %% [markdown]
# `bench/ch11_first_request.py` measures what that buys a user. In fresh processes (the
# compiled kernels live in the process), the Llama 3.2 1B stand-in at batch 1 serves
# each kind of request twice, first and again: greedy on a fresh prompt, a prompt after
# a cached 200-token system prompt (the process's first paged prefill), and greedy with
# five log-probs; then one more process does the same with the warm-up turned off.

# %% tags=["hide-input"]
first = {r["name"]: r for r in load_records("ch11_first_request")}
kinds = [("greedy", "greedy"), ("prefix_hit", "prefix-cache hit"),
         ("logprobs_5", "logprobs=5")]
if f"{kinds[0][0]}_first" not in first:
    print("Not recorded yet: bench/ch11_first_request.py has not run on a GPU.")
else:
    fig, ax = new_figure(height=2.6)
    y = np.arange(len(kinds))
    series = [("first, no warm-up", "_first_no_warm_up"), ("first", "_first"),
              ("again", "_again")]
    for i, (label, suffix) in enumerate(series):
        values = [first[f"{k}{suffix}"]["value"] for k, _ in kinds]
        ax.barh(y + (i - 1) * 0.27, values, height=0.27, label=label)
        for j, v in enumerate(values):
            ax.text(v, y[j] + (i - 1) * 0.27, f" {v:,.0f}", va="center", fontsize=7)
    ax.set_yticks(y, [label for _, label in kinds])
    ax.set_xlabel("tok/s of the whole request (256 new tokens), batch 1")
    ax.invert_yaxis()
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    plt.show()

# %% tags=["remove-input"]
if "prefix_hit_first" in first:
    for k, _ in kinds:
        f, again = first[f"{k}_first"], first[f"{k}_again"]
        cold = first[f"{k}_first_no_warm_up"]
        prose.glue(f"ch11_{k}_first", f"{f['value']:,.0f} tok/s")
        prose.glue(f"ch11_{k}_again", f"{again['value']:,.0f}")
        prose.glue(f"ch11_{k}_share", f"{f['value'] / again['value']:.0%}")
        prose.glue(f"ch11_{k}_cold", f"{cold['value']:,.0f} tok/s")
        prose.glue(f"ch11_{k}_cold_share", f"{cold['value'] / cold['ceiling']:.0%}")
    prose.glue("ch11_start_s", f"{first['start_s']['value']:.1f} s")
    prose.glue("ch11_warm_up_s", f"{first['warm_up_s']['value']:.1f} s")
    trials = first["start_s"]["trials"]
    prose.glue("ch11_first_trials",
               "one process" if trials == 1 else f"medians of {trials} processes")
    prose.glue("ch11_first_date", first["start_s"]["date"])
    prose.show("""
Without the warm-up, the first prefix-cache hit of a process ran at
{{ch11_prefix_hit_cold}} ({{ch11_prefix_hit_cold_share}} of the same request warm)
and the first request with log-probs at {{ch11_logprobs_5_cold}}
({{ch11_logprobs_5_cold_share}}): each waited for a compile. With it
({{ch11_first_trials}}, {{ch11_first_date}}), the first prefix hit runs at
{{ch11_prefix_hit_first}}, {{ch11_prefix_hit_share}} of the same request again
({{ch11_prefix_hit_again}}), and the first log-probs request at
{{ch11_logprobs_5_first}}, {{ch11_logprobs_5_share}} of again
({{ch11_logprobs_5_again}}). The engine takes {{ch11_start_s}} to start, weights,
graphs and all, of which the warm-up's steps and compiles are {{ch11_warm_up_s}}.
""")


# %% [markdown]
# ## The Llama 3.2 1B stand-in
#
# The engine's target is Llama 3.2 1B Instruct, whose weights come under Meta's licence
# from a hub this book does not download from. Speed depends on the weights' shapes,
# not their values, so every benchmark of this chapter and the next runs on a
# **stand-in**: Llama 3.2 1B Instruct's configuration, random bf16 weights of the exact
# shapes (chapter 7's random Llama) and the real Llama 3 tokenizer. Appendix A builds
# it — where the tokenizer comes from, what differs from Meta's, the chat template;
# `prepare_llama_standin` makes the folder once and reuses it. On this machine the
# chapter's examples use a small one of the same kind, with the real tokenizer:

# %%
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.tokenizer import Tokenizer

small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
standin = prepare_llama_standin(config_overrides=small)
print(Tokenizer.from_folder(standin).encode("Hello, world"))

# %% [markdown]
# ## The benchmark
#
# Two numbers say how fast an engine is, and vLLM's `vllm bench` measures both:
#
# - **latency**: one request alone — 128 prompt tokens, 256 new, greedy, the
#   end-of-sequence token ignored so that every run computes the same number of steps.
#   Its **time to first token** is the prefill; its **decode** rate, the 255 steps
#   after the first token, is what a chat user watches and what the memory bandwidth
#   bounds: each step reads every weight once.
# - **throughput**: many requests at once, here nano-vllm's workload — 256 requests
#   whose prompt and output lengths are drawn uniformly from 100 to 1,024 tokens
#   (seed 0) — timed from the first `add_request` to the last token, counting output
#   tokens. Before it, a warm-up on other prompts of the same kind, past one step's
#   token budget, so that chunked prompts and mixed steps have run once; each timed run
#   starts on an empty prefix cache (`reset_prefix_cache`, vLLM's name), and the
#   benchmark scripts take the median of three runs (one for the slow eager mode).
#
# `python -m tinyvllm_lib bench latency` and `bench throughput` run them on any model
# (the stand-in by default) and print a line per run. The same functions serve the
# benchmark scripts, which also run transformers on the same folder for comparison.

# %%
#| export benchmark
import time
from dataclasses import replace

import numpy as np

from tinyvllm_lib.engine.sampling_params import SamplingParams


def nano_vllm_workload(
    num_requests: int = 256,
    min_len: int = 100,
    max_len: int = 1024,
    seed: int = 0,
    vocab_size: int = 128256,
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmark: prompts of random token ids and output lengths, both
    lengths uniform in [min_len, max_len], all drawn from default_rng(seed).
    """
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_len, max_len + 1, num_requests)
    output_lens = rng.integers(min_len, max_len + 1, num_requests)
    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def greedy(max_tokens: int) -> SamplingParams:
    """A benchmark's sampling: greedy, exactly max_tokens (end-of-sequence ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def latency(
    llm, prompt_len: int = 128, new_tokens: int = 256, repeats: int = 3, seed: int = 0,
    params: SamplingParams | None = None, prefix: list[int] | None = None,
) -> dict:
    """One request at a time through llm's engine, after one warm-up run: medians of
    the time to first token (ms), decode tok/s (the steps after the first token) and
    end-to-end tok/s. params: the requests' sampling (greedy by default); exactly
    new_tokens are generated whatever it says. prefix: token ids every prompt starts
    with (a shared system prompt: the warm-up run caches it, the timed runs hit it).
    """
    engine, rng = llm.llm_engine, np.random.default_rng(seed)
    params = greedy(new_tokens) if params is None else replace(
        params, max_tokens=new_tokens, ignore_eos=True
    )
    runs = []
    for i in range(repeats + 1):
        prompt = rng.integers(0, llm.config.vocab_size, prompt_len).tolist()
        prompt = (prefix or []) + prompt
        start, first = time.perf_counter(), None
        engine.add_request(f"latency-{i}", prompt, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            # a step returns once its sampled ids are on the host
            if first is None and any(o.outputs[0].token_ids for o in outputs):
                first = time.perf_counter()
        end = time.perf_counter()
        runs.append((first - start, end - start))
    ttft, total = np.median(np.array(runs[1:]), axis=0)  # the first warmed up
    return {
        "ttft_ms": float(1e3 * ttft),
        "decode_tok_s": float((new_tokens - 1) / (total - ttft)),
        "e2e_tok_s": float(new_tokens / total),
        "seconds": float(total),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }


def throughput(
    llm,
    num_requests: int = 256,
    min_len: int = 100,
    max_len: int = 1024,
    seed: int = 0,
    use_tqdm: bool = False,
    repeats: int = 1,
    before_run=None,
    temperature: float = 0.0,
    max_token_id: int | None = None,
) -> dict:
    """nano-vllm's workload through llm.generate: output tok/s from the first request
    added to the last token, the median of `repeats` runs, each on an empty prefix
    cache. First a warm-up on other prompts of the same kind, past one step's token
    budget (chunked prompts, mixed steps), so every path the run takes has run once.
    before_run(): called before each timed run. temperature: 0 greedy, else sampled
    (nano-vllm's bench.py: 0.6); max_token_id: prompt ids below it (its bench.py:
    10,000), else the whole vocabulary.
    """
    ids = max_token_id or llm.config.vocab_size
    prompts, output_lens = nano_vllm_workload(num_requests, min_len, max_len, seed, ids)
    engine = llm.llm_engine
    warm, _ = nano_vllm_workload(num_requests, min_len, max_len, seed + 1, ids)
    past_budget = int(np.searchsorted(np.cumsum([len(p) for p in warm]),
                                      engine.max_num_batched_tokens)) + 2
    llm.generate(warm[:past_budget],
                 SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    runs = []
    for _ in range(repeats):
        engine.reset_prefix_cache()
        if before_run is not None:
            before_run()
        steps = engine.stats.num_steps
        start = time.perf_counter()
        params = [
            SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
            for n in output_lens
        ]
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        seconds = time.perf_counter() - start
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        if num_output != sum(output_lens):
            raise RuntimeError(
                f"{num_output} output tokens, {sum(output_lens)} asked for"
            )
        runs.append((seconds, engine.stats.num_steps - steps))
    seconds, num_steps = sorted(runs)[len(runs) // 2]  # the median run
    num_prompt = sum(len(p) for p in prompts)
    return {
        "output_tok_s": num_output / seconds,
        "total_tok_s": (num_output + num_prompt) / seconds,
        "seconds": seconds,
        "num_steps": num_steps,
        "runs_output_tok_s": [num_output / s for s, _ in runs],
        "warm_up_requests": past_budget,
        "temperature": temperature,
        "max_token_id": ids,
        "num_requests": num_requests,
        "output_tokens": num_output,
        "prompt_tokens": num_prompt,
    }


# %% tags=["hide-input"]
#| export cli
import argparse
import json
from pathlib import Path

from tinyvllm_lib.cli_args import add_quantization_argument, quantization_kwargs


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=("latency", "throughput"))
    parser.add_argument(
        "--model",
        default="llama-3.2-1b-standin",
        help="a known model name or a Hugging Face folder",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="graphs, no overlap"
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--max-num-seqs", type=int, help="default: 1 for latency, 256 for throughput"
    )
    parser.add_argument("--input-len", type=int, default=128, help="latency's prompt")
    parser.add_argument("--output-len", type=int, default=256, help="latency's output")
    parser.add_argument("--num-prompts", type=int, default=256, help="throughput's")
    parser.add_argument("--repeats", type=int, default=3, help="latency's runs")
    parser.add_argument("--json", type=Path, help="also write the result here")
    add_quantization_argument(parser)  # chapter 15


@command(
    "bench",
    "time the engine: latency (one request) or throughput (nano-vllm's workload)",
    _bench_arguments,
)
def bench(args: argparse.Namespace) -> int:
    from tinyvllm_lib import benchmark
    from tinyvllm_lib.engine.llm import LLM

    seqs = args.max_num_seqs or (1 if args.kind == "latency" else 256)
    try:
        llm = LLM(
            args.model,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=seqs,
            enforce_eager=args.enforce_eager,
            async_scheduling=False if args.no_async_scheduling else None,
            **quantization_kwargs(args),
        )
        if args.kind == "latency":
            result = benchmark.latency(
                llm, args.input_len, args.output_len, args.repeats
            )
            line = (
                f"time to first token {result['ttft_ms']:.1f} ms, decode "
                f"{result['decode_tok_s']:.0f} tok/s, end to end "
                f"{result['e2e_tok_s']:.0f} tok/s"
            )
        else:
            result = benchmark.throughput(llm, args.num_prompts, use_tqdm=True)
            line = (
                f"{result['num_requests']} requests in {result['seconds']:.1f} s: "
                f"{result['output_tok_s']:.0f} output tok/s, "
                f"{result['total_tok_s']:.0f} total tok/s"
            )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    where = {"cpu": "NumPy", "cuda": "eager" if args.enforce_eager else "CUDA graphs"}
    print(f"{args.kind} on {llm.device} ({where[llm.device]}): {line}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


# %% [markdown]
# On this machine, the benchmark functions on the small stand-in (NumPy on the CPU:
# the point is the procedure, not the numbers):

# %%
main(
    ["bench", "latency", "--model", str(standin), "--device", "cpu"]
    + ["--max-model-len", "256", "--input-len", "16", "--output-len", "8"]
    + ["--repeats", "1"]
)
llm = LLM(standin, device="cpu", max_model_len=256, max_num_seqs=8)
load = benchmark.throughput(llm, num_requests=8, min_len=4, max_len=24)
print(
    f"throughput: {load['num_requests']} requests, {load['output_tokens']} tokens, "
    f"{load['output_tok_s']:.0f} output tok/s"
)
assert load["output_tokens"] == sum(benchmark.nano_vllm_workload(8, 4, 24)[1])

# %% [markdown]
# ## On the H200
#
# `bench/ch11_llama.py` runs both benchmarks on the full stand-in in three modes — CUDA
# graphs with the overlap (the default), graphs with the host and the GPU taking turns
# (`async_scheduling=False`), and eagerly — and transformers on the same folder and GPU
# kind: eager, and with a static KV cache and `torch.compile(mode="reduce-overhead")`,
# which captures CUDA graphs of its own. The parts run in separate device calls (each
# record gives its date and command). Batch 1's limit is the bandwidth ceiling — chapter
# 1's best measured rate of moving or reading bytes on this GPU — over the weights'
# bytes: a decode step cannot be faster than reading every weight once (the equation,
# with its numbers, is under the figure). The records are in
# `book/data/ch11_llama.json`.

# %% tags=["hide-input"]
records = load_records("ch11_llama")
by_name = {r["name"]: r for r in records}


def batch1_limit(r: dict) -> float:
    """tok/s: the bandwidth ceiling over the bytes a decode step reads (the record's
    weight_bytes: every weight once, the tied head once)."""
    return CEILING_GB_S * 1e9 / r["weight_bytes"]


bars = [
    ("this engine, eager", "bs1_decode_eager"),
    ("this engine, graphs, no overlap", "bs1_decode_sync"),
    ("this engine, graphs + overlap", "bs1_decode"),
    ("transformers, eager", "transformers_eager_bs1"),
    ("transformers, torch.compile", "transformers_compile_bs1"),
]
if not records:
    print(
        "Not recorded yet: bench/ch11_llama.py has not run on a GPU since this chapter"
        " was written."
    )
else:
    present = [(label, by_name[name]) for label, name in bars if name in by_name]
    fig, ax = new_figure(height=2.8)
    ax.barh([label for label, _ in present], [r["value"] for _, r in present])
    for i, (_, r) in enumerate(present):
        ax.text(r["value"], i, f" {r['value']:,.0f}", va="center", fontsize=8)
    ceiling = batch1_limit(present[0][1]) if "weight_bytes" in present[0][1] else None
    if ceiling:
        ax.axvline(ceiling, color="k", ls="--", lw=1)
        ax.text(ceiling, -0.6, " bandwidth limit", va="bottom", ha="right", fontsize=8)
    ax.set_xlabel("batch-1 decode, tok/s (128 prompt + 256 new tokens)")
    ax.invert_yaxis()
    plt.show()

# %% tags=["remove-input"]
needed = (
    "bs1_decode",
    "bs1_decode_sync",
    "bs1_decode_eager",
    "bs1_graph_replay",
    "throughput",
    "throughput_sync",
    "throughput_eager",
    "graph_replay",
)
if all(name in by_name for name in needed):
    bs1, tp = by_name["bs1_decode"], by_name["throughput"]
    prose.glue("ch11_h200", bs1["device"]["name"])
    prose.glue("ch11_date", bs1["date"])
    prose.glue("ch11_bs1", f"{bs1['value']:,.0f} tok/s")
    limit = batch1_limit(bs1)
    prose.glue("ch11_limit", f"{limit:,.0f} tok/s")
    prose.glue("ch11_limit_eq", f"{CEILING_GB_S:,.0f} GB/s ÷ "
               f"{bs1['weight_bytes'] / 1e9:.2f} GB = {limit:,.0f} tok/s")
    prose.glue("ch11_bs1_ratio", f"{bs1['value'] / limit:.0%}")
    prose.glue("ch11_bs1_sync", f"{by_name['bs1_decode_sync']['value']:,.0f}")
    prose.glue("ch11_bs1_eager", f"{by_name['bs1_decode_eager']['value']:,.0f}")
    replay = by_name["bs1_graph_replay"]
    prose.glue("ch11_replay", f"{replay['value']:.2f} ms")
    prose.glue("ch11_replay_cap", f"{1e3 / replay['value']:,.0f} tok/s")
    prose.glue("ch11_nodes", f"{replay['graph_nodes']}")
    sampling_replay = by_name.get("bs1_graph_replay_sampling")
    if replay.get("argmax_only") and sampling_replay:
        prose.glue("ch11_replay_sampling", f"{sampling_replay['value']:.3f} ms")
        prose.glue("ch11_replay_argmax", f"{replay['value']:.3f} ms")
        prose.glue("ch11_nodes_sampling", f"{sampling_replay['graph_nodes']}")
        saved = 1e3 * (sampling_replay["value"] - replay["value"])
        prose.glue("ch11_argmax_saved", f"{saved:.0f} µs")
    prose.glue("ch11_tp", f"{tp['value']:,.0f}")
    prose.glue("ch11_tp_sync", f"{by_name['throughput_sync']['value']:,.0f}")
    prose.glue("ch11_tp_eager", f"{by_name['throughput_eager']['value']:,.0f}")
    sampled_tp = by_name.get("throughput_sampled")
    prose.glue("ch11_tp_sampled", "(not recorded)" if sampled_tp is None
               else f"{sampled_tp['value']:,.0f}")
    prose.glue("ch11_tp_step", f"{1e3 * tp['seconds'] / tp['num_steps']:.1f} ms")
    prose.glue("ch11_tp_steps", f"{tp['num_steps']:,}")
    prose.glue("ch11_tp_wait", f"{tp.get('gpu_wait_s', float('nan')):.2f} s")
    prose.glue(
        "ch11_tp_wait_step", f"{tp.get('gpu_wait_ms_median', float('nan')):.2f} ms"
    )
    prose.glue("ch11_tp_replayed", f"{tp.get('replayed_steps', 0):,}")
    prose.glue("ch11_tp_seconds", f"{tp['seconds']:.1f} s")
    g256 = [r for r in records if r["name"] == "graph_replay" and r["shape"] == [256]]
    prose.glue("ch11_g256", f"{g256[-1]['value']:.1f} ms")
    compare = []
    if "transformers_compile_bs1" in by_name:
        tc = by_name["transformers_compile_bs1"]["value"]
        prose.glue("ch11_tc", f"{tc:,.0f} tok/s")
        prose.glue("ch11_vs_tc", f"{bs1['value'] / tc:.1f} times")
        prose.glue("ch11_tc_date", by_name["transformers_compile_bs1"]["date"])
        other = by_name["transformers_compile_bs1"]["date"] != bs1["date"]
        compare.append(
            "{{ch11_vs_tc}} transformers with `torch.compile` ({{ch11_tc}}"
            + (", recorded {{ch11_tc_date}} on another lease" if other else "")
            + ")"
        )
    if "transformers_throughput" in by_name:
        tt = by_name["transformers_throughput"]
        prose.glue("ch11_tt", f"{tt['value']:,.0f}")
        prose.glue("ch11_tt_batch", f"{tt['best_batch_size']}")
        prose.glue("ch11_tt_date", tt["date"])
        tt_sizes = tt.get("batch_sizes_tried", [])
    num_eager = tp["num_steps"] - tp.get("replayed_steps", 0)
    prose.glue("ch11_tp_eager_steps", f"{num_eager:,}")
    sync = by_name["throughput_sync"]
    prose.glue("ch11_tp_wait_sync", f"{sync.get('gpu_wait_s', float('nan')):.2f} s")
    # the runs' spread is the noise (verdict's default where a record kept one run)
    tp_verdict = verdict(
        sync.get("runs_output_tok_s", sync["value"]),
        tp.get("runs_output_tok_s", tp["value"]),
        higher_is_better=True,
    )
    prose.glue("ch11_overlap_verdict", tp_verdict)
    if tp_verdict.startswith("slower"):
        overlap_verdict = """ In this run the overlap made the rate
{{ch11_overlap_verdict}}: it cut the host's waits for the GPU from
{{ch11_tp_wait_sync}} to {{ch11_tp_wait}}, yet the run was no faster. With the GPU's
part of a step the longer, there was little to hide; the records do not say where the
difference went."""
    elif tp_verdict.startswith("within"):
        overlap_verdict = """ With the overlap the rate is {{ch11_overlap_verdict}}
of the run without it: with the GPU's part of a step the longer, there was little to
hide (without it the host waited {{ch11_tp_wait_sync}})."""
    else:
        overlap_verdict = """ The overlap made the rate {{ch11_overlap_verdict}}."""
    prose.show(
        """
On the {{ch11_h200}} ({{ch11_date}}), batch-1 decode runs at {{ch11_bs1}} with graphs
and the overlap: {{ch11_bs1_ratio}} of the limit ({{ch11_limit_eq}}: the ceiling over
the bytes of the weights), """
        + (compare[0] if compare else "")
        + """. Without the overlap the same graphs give {{ch11_bs1_sync}} tok/s, and
launched from Python {{ch11_bs1_eager}}. The batch-1 graph ({{ch11_nodes}} nodes)
replayed back to back takes {{ch11_replay}} of GPU time, which caps this engine at
{{ch11_replay_cap}} however little the host does: at batch 1 the overlap has taken the
host out of the step, and what is left is in the kernels."""
        + (
            """ That graph is the one a greedy step replays, whose sampler is its argmax
alone (`argmax_only`); the graph that launches every sampling, penalty and log-prob
kernel for whatever its rows ask ({{ch11_nodes_sampling}} nodes) takes
{{ch11_replay_sampling}} against {{ch11_replay_argmax}}, {{ch11_argmax_saved}} a step
spent on launches that return at once for greedy rows."""
            if "ch11_replay_sampling" in prose.values
            else ""
        )
        + """

On nano-vllm's workload the engine makes {{ch11_tp}} output tok/s greedy, and
{{ch11_tp_sampled}} as nano-vllm's own `bench.py` runs it (prompt ids below 10,000,
temperature 0.6); greedy made {{ch11_tp_sync}} without the overlap and
{{ch11_tp_eager}} eagerly"""
        + (
            (
                "; transformers at batch {{ch11_tt_batch}}, the one size tried, makes"
                " {{ch11_tt}}"
                if len(tt_sizes) == 1
                else "; transformers' best, at batch {{ch11_tt_batch}}, is {{ch11_tt}}"
            )
            + (
                ", recorded {{ch11_tt_date}} on another lease of the same GPU kind"
                if by_name["transformers_throughput"]["date"] != tp["date"]
                else ""
            )
            if "transformers_throughput" in by_name
            else ""
        )
        + """). Its {{ch11_tp_steps}} steps average {{ch11_tp_step}}:
{{ch11_tp_eager_steps}} of them ran eagerly, prefills of thousands of tokens, and the
replayed decode steps shrink as requests finish — the decode graph of 256 rows at 512
tokens of context takes {{ch11_g256}} on the GPU. The overlap hides only the shorter of
the host's and the GPU's part of a step; how long the host waited for the GPU says which
was the longer: {{ch11_tp_wait}} in all over the {{ch11_tp_replayed}} replayed steps
(median {{ch11_tp_wait_step}} a step), of the run's {{ch11_tp_seconds}}. Where the host
waits, the GPU is the longer part; where it does not, the host is."""
        + overlap_verdict
        + """
"""
    )
else:
    print("chapter 11's engine records are not all there yet: run bench/ch11_llama.py")

# %% tags=["remove-input"]
TARGET_BS1, TARGET_THROUGHPUT = 1100, 20000  # tok/s: this chapter's targets
if all(name in by_name for name in ("bs1_decode", "throughput")):
    for key, name, target in (
        ("ch11_bs1_verdict", "bs1_decode", TARGET_BS1),
        ("ch11_tp_verdict", "throughput", TARGET_THROUGHPUT),
    ):
        value = by_name[name]["value"]
        prose.glue(key, f"{value / target:.0%}")
    prose.glue("ch11_target_bs1", f"{TARGET_BS1:,}")
    prose.glue("ch11_target_tp", f"{TARGET_THROUGHPUT:,}")
    limit = batch1_limit(by_name["bs1_decode"])
    prose.glue("ch11_target_bs1_share", f"{TARGET_BS1 / limit:.0%}")
    prose.show("""
Our targets for this chapter were {{ch11_target_bs1}} tok/s at batch 1
({{ch11_target_bs1_share}} of the limit) and {{ch11_target_tp}} output tok/s on
nano-vllm's workload. Batch 1 reached {{ch11_bs1_verdict}} of its target, the workload
{{ch11_tp_verdict}} of its. At batch 1
the rest of the way to the limit is in the kernels, which the next section measures
one by one.
""")

# %% tags=["remove-input"]
reuse = {r["name"]: r for r in load_records("ch11_prefix_reuse")}
if "cache_kept" in reuse:
    empty, kept = reuse["empty_cache"], reuse["cache_kept"]
    prose.glue("ch11_reuse_empty", f"{empty['value']:,.0f}")
    prose.glue("ch11_reuse_kept", f"{kept['value']:,.0f}")
    prose.glue("ch11_reuse_share",
               f"{kept['cached_prompt_tokens'] / kept['prompt_tokens']:.1%}")
    # one run each: verdict's default noise
    prose.glue(
        "ch11_reuse_gain", verdict(empty["value"], kept["value"], higher_is_better=True)
    )
    prose.show("""
Why each timed run starts on an empty prefix cache: run the same 256 prompts a second
time with the cache as the first run left it ({{ch11_reuse_kept}} output tok/s against
{{ch11_reuse_empty}} on an empty cache, in one process of `bench/ch11_prefix_reuse.py`)
and {{ch11_reuse_share}} of the prompt tokens are read from the cache rather than
computed: the run is {{ch11_reuse_gain}}, and measures the cache as much as the
engine.
""")

# %% [markdown]
# ### A decode step, kernel by kernel
#
# `bench/ch11_kernels.py` times each kernel of a decode step, at 1, 64 and 256 rows with
# 1,024 tokens of context each, replayed from a captured graph with the 16 layers'
# weights and caches rotated so that none is served from L2; it counts the bytes each
# must move (weights, cache, activations) and divides. The bars are each kernel's share
# of the step (summed over its 16 layers); the label is its own share of the bandwidth
# ceiling (chapter 1's best measured rate).
# The kernels are the model's as it launches them after the next section's changes:
# RoPE and the KV write are one kernel, attention combines its splits itself, the
# residual adds are inside the output and down projections, and at one row the first
# norm is inside QKV's GEMV and SiLU·up inside gate-up's (the gated GEMV, so `silu_mul`
# is not launched) and the sampler is the argmax alone (a greedy step's argmax_only
# graph); `rmsnorm` counts the norms that are still kernels of their own.

# %% tags=["hide-input"]
kernel_records = [
    r for r in load_records("ch11_kernels") if r["name"] == "decode_kernel"
]


def share_label(x: float) -> str:
    """A share as a label: whole percent from 10%, one decimal below, never 0%."""
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}" if x >= 0.001 else "<0.1%"


if not kernel_records:
    print("Not recorded yet: bench/ch11_kernels.py has not run on a GPU.")
else:
    shapes = sorted({tuple(r["shape"]) for r in kernel_records})
    fig, axes = new_figure(1, len(shapes), height=3.6, sharey=True)
    for ax, shape in zip(np.atleast_1d(axes), shapes):
        rows = [r for r in kernel_records if tuple(r["shape"]) == shape]
        ax.barh([r["kernel"] for r in rows], [100 * r["share_of_step"] for r in rows])
        for i, r in enumerate(rows):
            ax.text(
                100 * r["share_of_step"],
                i,
                f" {share_label(r['gb_s'] / CEILING_GB_S)}",
                va="center",
                fontsize=7,
            )
        total = sum(r["value"] * r["per_step"] for r in rows)
        rows_label = f"{shape[0]} row" + ("s" if shape[0] > 1 else "")
        ax.set_title(f"{rows_label}: {total / 1e3:.2f} ms", fontsize=9)
        ax.set_xlabel("% of the step")
    np.atleast_1d(axes)[0].invert_yaxis()
    plt.show()

# %% tags=["remove-input"]
if kernel_records:
    k1 = {r["kernel"]: r for r in kernel_records if r["shape"][0] == 1}
    k64 = {r["kernel"]: r for r in kernel_records if r["shape"][0] == 64}
    small = ("rope_kv_write", "rmsnorm", "silu_mul")
    prose.glue(
        "ch11_small_1",
        f"{sum(k1[k]['share_of_step'] for k in small if k in k1):.0%}",
    )
    prose.glue("ch11_attn_1", f"{k1['attention']['share_of_step']:.0%}")
    prose.glue("ch11_attn_1_bw", f"{k1['attention']['gb_s'] / CEILING_GB_S:.0%}")
    prose.glue("ch11_attn_64_bw", f"{k64['attention']['gb_s'] / CEILING_GB_S:.1%}")
    book_copy = [r["value"] for r in load_records("ch01_bf16") if r["name"] == "copy"]
    attn_64_copy = k64["attention"]["gb_s"] / book_copy[-1]
    # the prose below and the summary say attention at 64 rows passed this target
    assert attn_64_copy >= 0.75, attn_64_copy
    prose.glue("ch11_attn_64_copy", f"{attn_64_copy:.0%}")
    prose.glue("ch11_qkv_bw", f"{k1['qkv_proj']['gb_s'] / CEILING_GB_S:.0%}")
    prose.glue("ch11_o_bw", f"{k1['o_proj']['gb_s'] / CEILING_GB_S:.0%}")
    prose.glue("ch11_gate_bw", f"{k1['gate_up_proj']['gb_s'] / CEILING_GB_S:.0%}")
    prose.show("""
At one row the big projections are near {{ch11_ceiling}} (gate-up at
{{ch11_gate_bw}} of it) and the small ones are not (QKV at {{ch11_qkv_bw}}, the output
projection at {{ch11_o_bw}}: 8 to 12 MB each is too little to fill the GPU). Attention
over 1,024 tokens is {{ch11_attn_1}} of the step at {{ch11_attn_1_bw}} of it — one
sequence's keys and values are 2 MB a layer, too little to keep the memory busy for the
few microseconds the kernel's chain of dependent loads takes — and the small kernels
(RoPE with the KV write, the norms, SiLU) are {{ch11_small_1}} together. At 64
rows attention reads at {{ch11_attn_64_bw}} of the ceiling. Our target, set before
chapter 1 measured its faster readers, was 75% of the book's copy kernel's rate: it
reads at {{ch11_attn_64_copy}} of that.
""")

# %% [markdown]
# ### Fewer kernels: what each change bought
#
# Chapters 6, 7 and 8 introduced changes that the table above called for; here is what
# each bought, timed against what it replaced at the same shapes (one was not
# adopted):
#
# - **attention combines its own splits** (chapter 8): the last block of a sequence's
#   splits to finish, found with an atomic count, adds the partials up, instead of a
#   second kernel launched after the first. The "before" is chapter 8's record of the
#   two kernels, made in an earlier session on the same kind of GPU;
# - **RoPE with the KV-cache write** (chapter 8's `rope_and_write_kv_cache`): the model
#   hands its RoPE table and positions to the attention layer, which rotates q and k in
#   the kernel that stores k and v. `bench/ch11_kernels.py` times the pair and the fused
#   kernel on the same buffers, in the same run;
# - **SiLU·up inside the gate-up GEMV** (chapter 7's `gemv_silu_mul`), timed the same
#   way at one row, where the GEMV runs;
# - **the residual add inside the projection** (chapter 6's `accumulate`): the output
#   and down projections add to the residual stream where they make their sums. Before,
#   each wrote its own output and chapter 4's fused add + norm kernel added it; after,
#   a plain norm remains — the same two kernels, one fewer activation written and read;
# - **the norm inside the next projection** (chapter 6's `gemv_rmsnorm`): the GEMV reads
#   the float32 residual and the norm's weight and scales its sums at the end, against
#   the norm kernel and the plain GEMV. Timed for QKV (blocks of 8 warps share each
#   row) and for gate-up, both as the launcher runs it (a warp a row) and with blocks.

# %% tags=["hide-input"]
fusion_records = sorted(
    (r for r in load_records("ch11_kernels") if r["name"] == "fusion"),
    key=lambda r: (r["kernel"], r["shape"][0]),
)
before = {
    r["shape"][0]: r
    for r in load_records("ch08_kv_cache")
    if r["name"] == "decode_attention"
}
after = {r["shape"][0]: r for r in kernel_records if r["kernel"] == "attention"}
pairs = [
    (f"attention, {n} row" + ("s" if n > 1 else ""), before[n]["us"], after[n]["value"])
    for n in sorted(set(before) & set(after))
] + [
    (
        f"{r['kernel']}, {r['shape'][0]} row" + ("s" if r["shape"][0] > 1 else ""),
        r["separate_us"],
        r["value"],
    )
    for r in fusion_records
]
if not pairs:
    print("Not recorded yet: bench/ch11_kernels.py has not run on a GPU.")
else:
    fig, ax = new_figure(height=0.32 * len(pairs) + 1.0)
    y = np.arange(len(pairs))
    ax.barh(y - 0.2, [p[1] for p in pairs], 0.4, label="before: separate kernels")
    ax.barh(y + 0.2, [p[2] for p in pairs], 0.4, label="after: fused")
    for i, (_, b, a) in enumerate(pairs):
        ax.text(max(a, b), i, f" {a - b:+.1f} µs", va="center", fontsize=7)
    ax.set_yticks(y, [p[0] for p in pairs], fontsize=8)
    ax.set_xscale("log")
    plain_log_ticks(ax, "x")
    ax.set_xlabel("µs per layer (log scale)")
    ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    plt.show()

# %% tags=["remove-input"]
fused = {(r["kernel"], r["shape"][0]): r for r in fusion_records}
if fused and 1 in before and 1 in after and ("gate_up_silu", 1) in fused:
    layers = after[1]["per_step"]  # one launch a layer
    k1 = {r["kernel"]: r for r in kernel_records if r["shape"][0] == 1}
    prose.glue("ch11_silu_1", f"{k1['silu_mul']['value']:.1f}-µs")
    prose.glue("ch11_attn_before_1", f"{before[1]['us']:.1f} µs")
    prose.glue("ch11_attn_after_1", f"{after[1]['value']:.1f} µs")
    prose.glue(
        "ch11_attn_saved_1", f"{layers * (before[1]['us'] - after[1]['value']):.0f} µs"
    )
    prose.glue("ch11_attn_before_64", f"{before[64]['us']:.1f} µs")
    prose.glue("ch11_attn_after_64", f"{after[64]['value']:.1f} µs")
    # single timings, the before from another session: verdict's default noise
    gain = {n: 1 - after[n]["value"] / before[n]["us"] for n in (1, 64)}
    prose.glue("ch11_attn_verdict_1", verdict(before[1]["us"], after[1]["value"]))
    prose.glue("ch11_attn_verdict_64", verdict(before[64]["us"], after[64]["value"]))
    prose.glue("ch11_attn_gain_64_vs_1", "less" if gain[64] < gain[1] else "more")
    rk1, rk64 = fused[("rope_kv_write", 1)], fused[("rope_kv_write", 64)]
    rk256 = fused.get(("rope_kv_write", 256), rk64)
    prose.glue("ch11_rkv_sep", f"{rk1['separate_us']:.1f} µs")
    prose.glue("ch11_rkv_fused", f"{rk1['value']:.1f} µs")
    prose.glue("ch11_rkv_saved_1", f"{rk1['saved_per_step_us']:.0f} µs")
    prose.glue("ch11_rkv_saved_64", f"{rk64['saved_per_step_us']:.0f} µs")
    prose.glue("ch11_rkv_saved_256", f"{rk256['saved_per_step_us']:.0f} µs")
    prose.glue("ch11_rkv_rows_256", f"{rk256['shape'][0]}")
    for n, rk in ((1, rk1), (64, rk64), (256, rk256)):
        prose.glue(f"ch11_rkv_verdict_{n}", verdict(rk["separate_us"], rk["value"]))
    largest = max((rk1, rk64, rk256), key=lambda r: r["saved_per_step_us"])
    prose.glue(
        "ch11_rkv_largest",
        "the largest saving" if largest is rk256 else "not the largest saving",
    )
    gs = fused[("gate_up_silu", 1)]
    prose.glue("ch11_gs_sep", f"{gs['separate_us']:.1f} µs")
    prose.glue("ch11_gs_fused", f"{gs['value']:.1f} µs")
    prose.glue("ch11_gs_verdict", verdict(gs["separate_us"], gs["value"]))
    prose.glue("ch11_gs_saved", f"{gs['saved_per_step_us']:.0f} µs")
    gs_paid = prose.values["ch11_gs_verdict"].startswith("faster")
    # records made before the gated kernel kept one step in flight have no "unroll"
    gs_current = gs.get("unroll") == 1
    sweep = {(r["shape"][0], r["unroll"]): r for r in load_records("ch11_kernels")
             if r["name"] == "gated_sweep"}
    swept = all((n, u) in sweep for n in (1, 2, 4) for u in (1, 4))
    if swept:
        for n in (1, 2, 4):
            best = min((r for (rows, _), r in sweep.items() if rows == n),
                       key=lambda r: r["value"])
            prose.glue(f"ch11_gated_best_{n}", f"{best['value']:.1f} µs")
            prose.glue(f"ch11_gated_best_{n}_unroll", f"{best['unroll']}")
            prose.glue(f"ch11_gated_sep_{n}", f"{best['separate_us']:.1f} µs")
        for u in (1, 4):
            prose.glue(f"ch11_gated_u{u}", f"{sweep[(1, u)]['value']:.1f} µs")
        # the paragraph says the gated GEMV stops at one row: at 2 and 4 no setting won
        assert all(r["value"] >= r["separate_us"] for (rows, _), r in sweep.items()
                   if rows > 1)
    # the sweep on an H100 (book/data/h100/): cited until this GPU has one
    h100_u1 = [r for r in load_records("ch11_kernels", DATA_DIR / "h100")
               if r["name"] == "gated_sweep" and r["shape"][0] == 1
               and r["unroll"] == 1]
    if h100_u1:
        prose.glue("ch11_h100_u1", f"{h100_u1[-1]['value']:.1f} µs")
        prose.glue("ch11_h100_sep", f"{h100_u1[-1]['separate_us']:.1f} µs")
        prose.glue("ch11_h100_verdict",
                   verdict(h100_u1[-1]["separate_us"], h100_u1[-1]["value"]))
    # the model uses the gated GEMV at one token: the records must not say it lost
    assert not (gs_current and prose.values["ch11_gs_verdict"].startswith("slower"))
    epilogues = (
        "add_in_o_proj",
        "add_in_down_proj",
        "norm_in_qkv_proj",
        "norm_in_gate_up_proj",
        "norm_in_gate_up_proj_block",
    )
    epilogues_recorded = all((k, 1) in fused for k in epilogues)
    if epilogues_recorded:
        for k in epilogues:
            r = fused[(k, 1)]
            prose.glue(f"ch11_{k}_sep", f"{r['separate_us']:.1f} µs")
            prose.glue(f"ch11_{k}_fused", f"{r['value']:.1f} µs")
            prose.glue(f"ch11_{k}_saved", f"{r['saved_per_step_us']:.0f} µs")
            prose.glue(f"ch11_{k}_verdict", verdict(r["separate_us"], r["value"]))
    prose.show("""
At one row the combine folded into attention took a layer's attention from
{{ch11_attn_before_1}} to {{ch11_attn_after_1}} ({{ch11_attn_verdict_1}}),
{{ch11_attn_saved_1}} a step: the second kernel had read the splits' partials one after
another, each load waiting for the last, and a launch of its own. At 64 rows, with two
splits a sequence, it is {{ch11_attn_verdict_64}} ({{ch11_attn_before_64}} before,
{{ch11_attn_after_64}} after), {{ch11_attn_gain_64_vs_1}} than at one row: the combine
is a smaller part of the work there, and every block now pays a memory fence and an
atomic add. (Each "before" is a single timing from an earlier session, so the verdicts
allow for the default noise, not a measured spread.) RoPE with the KV write takes
{{ch11_rkv_fused}} where the two kernels took {{ch11_rkv_sep}} at one row
({{ch11_rkv_verdict_1}}), {{ch11_rkv_saved_1}} a step; at 64 rows it is
{{ch11_rkv_verdict_64}}, {{ch11_rkv_saved_64}} a step; at {{ch11_rkv_rows_256}} it is
{{ch11_rkv_verdict_256}}, {{ch11_rkv_saved_256}} a step, {{ch11_rkv_largest}} in µs:
a launch is saved at every size, and the fused kernel reads k once where the pair
wrote it and read it back, which counts for more as the rows grow. """ + ("""The gated
GEMV pays at one row: {{ch11_gs_fused}} against {{ch11_gs_sep}} for the GEMV and the
{{ch11_silu_1}} SiLU kernel, {{ch11_gs_verdict}}, {{ch11_gs_saved}} a step. It lost
while each warp kept four steps of its (gate, up) pair of rows in flight; a sweep of
that one knob found one step the fastest, and the model uses the gated GEMV at one
token.""" + ("""
At one row one step in flight took {{ch11_gated_u1}} and four {{ch11_gated_u4}}; at two
and four rows the best setting ({{ch11_gated_best_2_unroll}} and
{{ch11_gated_best_4_unroll}} steps) took {{ch11_gated_best_2}} and
{{ch11_gated_best_4}} against {{ch11_gated_sep_2}} and {{ch11_gated_sep_4}} for the two
kernels, so it stops at one row.""" if swept else "") + """
""" if gs_paid and gs_current else """The gated GEMV, each warp keeping one step of its
(gate, up) pair of rows in flight (the sweep of that knob in `bench/ch11_kernels.py`),
takes {{ch11_gs_fused}} against {{ch11_gs_sep}} for the GEMV and the {{ch11_silu_1}}
SiLU kernel, {{ch11_gs_verdict}}, and the model uses it at one token.""" + ("""
At one row the sweep timed one step in flight at {{ch11_gated_u1}} and four at
{{ch11_gated_u4}}.""" if swept else "") + """
""" if gs_current else """The gated GEMV was last timed on this GPU as it was before,
each warp keeping four steps of its (gate, up) pair of rows in flight:
{{ch11_gs_fused}} against {{ch11_gs_sep}} for the GEMV and the {{ch11_silu_1}} SiLU
kernel, {{ch11_gs_verdict}}. Chapter 7's kernel now keeps one step in flight""" + ((""",
which the sweep in `bench/ch11_kernels.py` timed on an H100 at {{ch11_h100_u1}}
against {{ch11_h100_sep}} for the two kernels ({{ch11_h100_verdict}}; its records are in
`book/data/h100/`)""") if h100_u1 else "") + """, and the model uses it at one token;
neither the sweep nor the new kernel is recorded on this GPU yet.
"""))
    if epilogues_recorded:
        # the paragraph below says the norm inside gate-up's GEMV lost, both ways
        for k in ("norm_in_gate_up_proj", "norm_in_gate_up_proj_block"):
            assert prose.values[f"ch11_{k}_verdict"].startswith("slower")
        prose.show("""
The residual add inside the projection saved {{ch11_add_in_o_proj_saved}} a step at the
output projection ({{ch11_add_in_o_proj_fused}} for the projection and the norm, against
{{ch11_add_in_o_proj_sep}}) and {{ch11_add_in_down_proj_saved}} at the down projection
({{ch11_add_in_down_proj_fused}} against {{ch11_add_in_down_proj_sep}}). The norm inside
QKV's GEMV saved {{ch11_norm_in_qkv_proj_saved}} ({{ch11_norm_in_qkv_proj_fused}}
against {{ch11_norm_in_qkv_proj_sep}} for the norm and the plain GEMV,
{{ch11_norm_in_qkv_proj_verdict}}). Inside gate-up's it lost:
{{ch11_norm_in_gate_up_proj_fused}} against {{ch11_norm_in_gate_up_proj_sep}} with a
warp a row ({{ch11_norm_in_gate_up_proj_verdict}}), and
{{ch11_norm_in_gate_up_proj_block_fused}} against
{{ch11_norm_in_gate_up_proj_block_sep}} with blocks sharing rows
({{ch11_norm_in_gate_up_proj_block_verdict}}). Each reader of $x$ now
reads 6 bytes a value where it read 2 (a float32 value and the norm's bf16 weight for a
bf16 value), through the same caches that bring $W$ in. QKV's GEMV, which runs at
{{ch11_qkv_bw}} of the bandwidth ceiling — mostly its own start and end — has room for
that, and a launch fewer is worth more; gate-up's streams $W$ at {{ch11_gate_bw}}, and
the extra traffic slows it, whether a warp reads $x$ for each row or a block for every
four. The model puts the norm only inside the shorter projections (chapter 6's
`NORM_IN_GEMV_MAX_ROWS`).
""")
else:
    print("the fusion records are not all there yet: run bench/ch11_kernels.py")

# %% [markdown]
# And the book's progression on the same workload shape — nano-vllm's 256 requests on
# Llama 3.2 1B's shapes — chapter by chapter: chapter 8b's engine ran one request at a
# time (chapter 9 timed it so), chapter 9 batched them on rows, chapter 10 on blocks.
# The records come from different sessions, whose hosts differ in speed, so the bars
# show the order of magnitude each chapter bought, not small differences.


# %% tags=["hide-input"]
def progression():
    """(label, output tok/s, record) per chapter, from the records that exist."""
    ch09 = load_records("ch09_batching")
    ch10 = load_records("ch10_paging")
    pick = lambda recs, f: next((r for r in recs if f(r)), None)  # noqa: E731
    steps = [
        ("8b: one at a time", pick(ch09, lambda r: r["name"] == "one_at_a_time")),
        (
            "9: batched rows",
            pick(
                ch09, lambda r: r["name"] == "output_throughput" and r["shape"] == [256]
            ),
        ),
        (
            "10: paged",
            pick(
                ch10,
                lambda r: (
                    r["name"] == "output_throughput"
                    and r.get("scheme") == "paged"
                    and r["shape"] == [256, 256]
                ),
            ),
        ),
        ("11: graphs + overlap", by_name.get("throughput")),
    ]
    return [(label, r) for label, r in steps if r is not None]


steps = progression()
fig, ax = new_figure(height=2.4)
ax.barh([label for label, _ in steps], [r["value"] for _, r in steps], color="C2")
for i, (_, r) in enumerate(steps):
    ax.text(r["value"], i, f" {r['value']:,.0f}", va="center", fontsize=8)
ax.set_xscale("log")
plain_log_ticks(ax, "x")
ax.set_xlabel("output tok/s, nano-vllm's workload (log scale)")
ax.invert_yaxis()
plt.show()
if "throughput" not in by_name:
    print("chapter 11's bar is missing: not recorded on a GPU yet")

# %% [markdown]
# ## What a user waits for
#
# The records above are greedy decoding on fresh prompts: the benchmark's path. Users
# send temperature and top-p (Llama 3's own defaults are 0.6 and 0.9), ask for
# log-probabilities, share a system prompt, and first of all wait for the first token.
# `bench/ch11_user_path.py` measures each at batch 1 through the engine as `LLM` runs
# it, every kind after the start-up warm-up, each against greedy in the same run; and
# the time to first token (from `add_request` to the step that returns the token)
# against the prompt's length. The floor drawn under it is the least a prefill can
# cost: every weight read once at the best read rate chapter 1 measured, plus the
# projections' FLOPs at cuBLAS's best rate at prefill shapes (chapter 6).

# %% tags=["hide-input"]
from tinyvllm_lib.models.config import ModelConfig  # noqa: E402
from tinyvllm_lib.models.loader import llama_weight_shapes  # noqa: E402
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG  # noqa: E402

user = load_records("ch11_user_path")
settings = [r for r in user if r["name"] == "bs1_decode_setting"]
ttft = sorted((r for r in user if r["name"] == "ttft"), key=lambda r: r["prompt_len"])
hf_ttft = sorted((r for r in user if r["name"] == "transformers_ttft"),
                 key=lambda r: r["prompt_len"])


def prefill_floor_ms(lengths) -> list[float] | None:
    """Weights read once at the best read rate + 2 FLOPs a weight a token at
    cuBLAS's best prefill rate."""
    gemm = [r["value"] for r in load_records("ch06_gemm")
            if r["name"] == "prefill_cublas"]
    if not gemm or not CEILING_GB_S > 0:
        return None
    shapes = llama_weight_shapes(ModelConfig.from_dict(LLAMA_3_2_1B_CONFIG))
    weights = sum(int(np.prod(s)) for s in shapes.values())
    c = LLAMA_3_2_1B_CONFIG
    flops_per_token = 2 * (weights - c["vocab_size"] * c["hidden_size"])  # projections
    read_s, flop_rate = 2 * weights / (CEILING_GB_S * 1e9), max(gemm) * 1e12
    return [1e3 * (read_s + n * flops_per_token / flop_rate) for n in lengths]


if not settings:
    print("Not recorded yet: bench/ch11_user_path.py has not run on a GPU.")
else:
    fig, (bars, line) = new_figure(1, 2, width=10, height=3.4)
    names = [r["setting"] for r in settings]
    # this chapter's targets: 90% of greedy for every setting, 85% with log-probs
    target = [0.85 if "logprobs" in r["setting"] else 0.9 for r in settings]
    bars.barh(names, [r["value"] for r in settings],
              color=["C0" if r["of_greedy"] >= t else "C3"
                     for r, t in zip(settings, target)])
    for i, r in enumerate(settings):
        label = f" {r['value']:,.0f} ({r['of_greedy']:.0%})"
        bars.text(r["value"], i, label, va="center", fontsize=7)
    bars.set_xlabel("batch-1 decode tok/s (share of greedy; red: below its target,\n"
                    "90% of greedy, 85% with log-probs)")
    bars.set_xlim(0, 1.3 * max(r["value"] for r in settings))
    bars.invert_yaxis()
    lengths = [r["prompt_len"] for r in ttft]
    line.plot(lengths, [r["value"] for r in ttft], "o-", label="this engine")
    if hf_ttft:
        line.plot([r["prompt_len"] for r in hf_ttft], [r["value"] for r in hf_ttft],
                  "s-", color="C2", label="transformers (bf16, sdpa)")
    floor = prefill_floor_ms(lengths)
    if floor:
        line.plot(lengths, floor, "k--", lw=1, label="floor: weights + FLOPs")
    line.set_xscale("log", base=2)
    line.set_xticks(lengths, [f"{n:,}" for n in lengths], fontsize=7)
    line.set_yscale("log")
    plain_log_ticks(line)
    line.set_xlabel("prompt tokens")
    line.set_ylabel("time to first token, ms")
    line.legend(fontsize=8)
    plt.show()

# %% tags=["remove-input"]
if settings and ttft:
    by_setting = {r["setting"]: r for r in settings}
    by_len = {r["prompt_len"]: r for r in ttft}
    floor128 = prefill_floor_ms([128])
    prose.glue("ch11_user_greedy", f"{by_setting['greedy']['value']:,.0f} tok/s")
    llama_defaults = by_setting["Llama defaults (t 0.6, top_p 0.9)"]
    prose.glue("ch11_user_llama", f"{llama_defaults['of_greedy']:.0%}")
    sampled = [r["of_greedy"] for r in settings if "logprobs" not in r["setting"]
               and r["setting"] not in ("greedy", "prefix-cache hit")]
    prose.glue("ch11_user_worst_sampled", f"{min(sampled):.0%}")
    lp5, lp20 = (by_setting[f"logprobs {k}"]["value"] for k in (5, 20))
    # the prose says twenty cost more than five: the data must agree
    assert lp20 < lp5, (lp5, lp20)
    prose.glue("ch11_user_lp5", f"{by_setting['logprobs 5']['of_greedy']:.0%}")
    prose.glue("ch11_user_lp20", f"{by_setting['logprobs 20']['of_greedy']:.0%}")
    prose.glue("ch11_user_prefix", f"{by_setting['prefix-cache hit']['of_greedy']:.0%}")
    prose.glue("ch11_ttft_16", f"{by_len[16]['value']:.1f} ms")
    prose.glue("ch11_ttft_1024", f"{by_len[1024]['value']:.1f} ms")
    prose.glue("ch11_ttft_4096", f"{by_len[4096]['value']:.0f} ms")
    floor1024 = prefill_floor_ms([1024])
    prose.glue("ch11_ttft_floor1024",
               f"{floor1024[0]:.1f} ms" if floor1024 else "(none)")
    floor_text = f"{floor128[0]:.1f} ms" if floor128 else "(no floor)"
    prose.glue("ch11_ttft_floor128", floor_text)
    prose.glue("ch11_ttft_128", f"{by_len[128]['value']:.1f} ms")
    prose.glue("ch11_user_date", settings[0]["date"])
    prose.glue("ch11_user_commit", str(settings[0].get("engine_commit")))
    # which prefill attention the runs used: chapter 10's SIMT kernel, or (records
    # made once chapter 14 existed) the tensor-core kernel the engine picks on a GPU
    on_tensor_cores = by_len[4096].get("prefill_attention") == "tc_prefill_attention"
    prose.glue("ch11_ttft_attention", (
        "which these runs already take through chapter 14's tensor-core kernel (the "
        "engine's choice on a GPU)" if on_tensor_cores else
        "which chapter 10 runs on SIMT cores far below the tensor cores' rate"))
    hf_len = {r["prompt_len"]: r for r in hf_ttft}
    hf_text = ""
    if 128 in hf_len and 4096 in hf_len:
        prose.glue("ch11_hf_ttft_128", f"{hf_len[128]['value']:.1f} ms")
        prose.glue("ch11_hf_ttft_4096", f"{hf_len[4096]['value']:.0f} ms")
        # per length, this engine against transformers' runs, beyond their noise
        common = sorted(set(by_len) & set(hf_len))
        said = {n: verdict(hf_len[n].get("runs", hf_len[n]["value"]),
                           by_len[n]["value"]).split()[0] for n in common}
        sooner = [n for n in common if said[n] == "faster"]
        later = [n for n in common if said[n] == "slower"]
        hf_text = """ Transformers (eager, bf16, sdpa), timed
in the same run on the same prompts, takes {{ch11_hf_ttft_128}} at 128 tokens and
{{ch11_hf_ttft_4096}} at 4,096."""
        # "sooner up to A, later from B on" only where the records split that way
        if (sooner and later and sooner == common[: len(sooner)]
                and later == common[len(common) - len(later):]):
            prose.glue("ch11_ttft_sooner", f"{max(sooner):,}")
            prose.glue("ch11_ttft_later", f"{min(later):,}")
            hf_text += """ This engine's first token comes sooner
up to {{ch11_ttft_sooner}} prompt tokens and later from {{ch11_ttft_later}} on, as
attention's work, quadratic in the prompt, grows."""
    prose.show("""
On {{ch11_user_date}} (engine {{ch11_user_commit}}), greedy made {{ch11_user_greedy}}
at batch 1, and every sampling setting kept at least {{ch11_user_worst_sampled}} of
it — Llama's defaults {{ch11_user_llama}}, the penalties included — since chapter 8b's
sampler finds its thresholds in a few passes spread over the row's blocks and keeps the
penalties' counts on the GPU. Log-probabilities run inside the captured step as well
(the kernel reads each row's k from the batch; a row that asked for none leaves at
once): {{ch11_user_lp5}} of greedy with five and {{ch11_user_lp20}} with twenty, each
of the k rounds that pick a row's top tokens being a reduction across the block. A
prompt after a cached system prompt ran at {{ch11_user_prefix}}.

The first token replays a prefill graph, so it costs what its work costs: it took
{{ch11_ttft_16}} for 16 prompt tokens, {{ch11_ttft_128}} for 128 (the floor is
{{ch11_ttft_floor128}}), {{ch11_ttft_1024}} for 1,024 (floor {{ch11_ttft_floor1024}})
and {{ch11_ttft_4096}} for 4,096; launched kernel by kernel from Python, a step would
first pay about {{ch11_per_launch}} for each of its kernels. At short prompts what
separates it from the floor is the step's fixed costs (the host's side, the head and
the sampler, kernels too small to fill the GPU); as the prompt grows, attention, whose
work is quadratic in the prompt and {{ch11_ttft_attention}}.""" + hf_text + "\n")

# %% [markdown]
# ## What the host still costs
#
# A graph removes the launches, not the host's other work: every step the scheduler
# picks its requests, `InputBatch.from_step` builds the arrays and `PackedInputs`
# packs them, and after the step each request takes its token, detokenizes it and
# checks its stop conditions. The overlap hides that work behind the GPU's only while
# it is the shorter. `bench/ch11_host_cpu.py` measures it alone, with the runner
# replaced by one that packs the step and returns random tokens at once, on this
# project's CPU machine.
#
# One part of it is the text: each new token is decoded twice (the incremental
# detokenizer's prefix and full text). A request whose output kind is `FINAL_ONLY` and
# which has no stop strings shows its text to no one before it finishes, so it now
# collects its ids (checking each once) and decodes them once at the end — the same
# text, which a test checks token for token against the incremental decode on random
# ids. The post-processing also turns the step's sampled ids into Python integers once,
# not one NumPy scalar per row.

# %% tags=["remove-input"]
host = {r["shape"][0]: r for r in load_records("ch11_host_cpu")}
for rows, r in sorted(host.items()):
    prose.glue(f"ch11_host_{rows}", f"{r['value']:.2f} ms")
    prose.glue(f"ch11_host_cap_{rows}", f"{rows / r['value'] * 1e3:,.0f} tok/s")
cpu = host[256]["device"]
cpu_name = cpu.get("cpu", cpu["name"])
prose.glue("ch11_host_cpu", f"{cpu.get('cores', '?')}-core {cpu_name}")
replays_256 = [
    r for r in records if r["name"] == "graph_replay" and r["shape"] == [256]
]
if "bs1_decode" in by_name and "bs1_decode_sync" in by_name and replays_256:
    prose.glue("ch11_g256", f"{replays_256[-1]['value']:.1f} ms")
    step_sync_ms = 1e3 / by_name["bs1_decode_sync"]["value"]
    saved_ms = step_sync_ms - 1e3 / by_name["bs1_decode"]["value"]
    prose.glue("ch11_overlap_saved_1", f"{saved_ms:.2f} ms")
    prose.show(
        """
On this project's {{ch11_host_cpu}} CPU, a decode step's host work takes {{ch11_host_1}}
with one request running, {{ch11_host_64}} with 64 and {{ch11_host_256}} with 256: were
the GPU infinitely fast, the engine could not pass {{ch11_host_cap_256}} at 256 rows on
this CPU. The H200's host is another machine: these numbers show how the host's work
grows with the batch, not how long it takes there. At batch 1 the overlap saved
{{ch11_overlap_saved_1}} a step, more than the host work measured here; no record splits
the rest."""
        + (
            """ At 256 rows, even on this CPU, the host's part is shorter than the GPU's
{{ch11_g256}} decode step, and the throughput run above agrees: there the host waited
for the GPU, so the kernels, attention first, set the pace."""
            if host[256]["value"] < replays_256[-1]["value"]
            else """ At 256 rows, on this CPU, the host's part is longer than the GPU's
{{ch11_g256}} decode step; on the H200's host, the throughput run above says which was
longer."""
        )
        + """
"""
    )

# %% [markdown]
# ### Where the GPU's time goes on nano-vllm's workload
#
# `bench/ch11_throughput_profile.py` runs the same workload once more under torch's
# profiler, after the same warm-up, and sums every kernel's time by the module that
# defines it (cuBLAS's GEMMs as one group): the GPU's busy time, split by what kept it
# busy. A kernel is charged only for the time after every kernel before it has ended,
# so the groups add up to the busy time.

# %% tags=["remove-input"]
profile = [r for r in load_records("ch11_throughput_profile")
           if r.get("temperature", 0.0) == 0.0]
groups = [r for r in profile if r["name"] == "kernel_group"]
busy = [r for r in profile if r["name"] == "gpu_busy"]
if groups and busy:
    busy = busy[-1]
    run = (busy["device"]["name"], busy.get("engine_commit"))
    groups = [r for r in groups if (r["device"]["name"], r.get("engine_commit")) == run]
    groups.sort(key=lambda r: -r["value"])
    big, rest = groups[:6], sum(r["value"] for r in groups[6:])
    names = [r["group"].removeprefix("kernels.") for r in big] + ["the rest"]
    ms = [r["value"] for r in big] + [rest]
    fig, ax = new_figure(1, 1, width=7.5, height=2.8)
    ax.barh(range(len(ms))[::-1], ms)
    ax.set_yticks(range(len(ms))[::-1], names)
    ax.set_xlabel("ms of the timed run")
    ax.set_title(f"nano-vllm's workload, greedy: GPU time by kernel group, {run[0]}")
    plt.show()
    top = big[0]
    busy_share = busy["value"] / busy["wall_ms"]
    prose.glue("ch11_prof_busy", f"{busy_share:.0%}")
    prose.glue("ch11_prof_wall", f"{busy['wall_ms'] / 1e3:.2f} s")
    prose.glue("ch11_prof_top", f"`{names[0]}` ({top['share']:.0%})")
    prose.glue("ch11_prof_second", f"`{names[1]}` ({big[1]['share']:.0%})")
    prose.glue("ch11_prof_kernels", f"{busy['kernels']:,}")
    prose.glue("ch11_prof_pace", (
        "the host keeps up, and the kernels set the pace" if busy_share >= 0.9 else
        "the rest of the time the GPU waited on the host"))
    prose.show("""
In a run of {{ch11_prof_wall}} the GPU was busy {{ch11_prof_busy}} of the time, through
{{ch11_prof_kernels}} kernels: {{ch11_prof_pace}}. The largest share is
{{ch11_prof_top}}, then {{ch11_prof_second}}. Decode attention reads every sequence's
cache each step; cuBLAS runs the linear layers' GEMMs of prefill and decode. Chapter 14
measures decode attention on the tensor cores against this chapter's kernel.
""")
else:
    print("no ch11_throughput_profile records yet: bench/ch11_throughput_profile.py "
          "on a GPU makes them")

# %% [markdown]
# ### The host's side of a 256-row step, phase by phase
#
# With the overlap, a decode step costs the longer of the GPU's replay and the host's
# work for the next step. `bench/host_step.py` splits the host's side of a steady
# 256-row decode step into its phases: the engine with async scheduling, as on the
# GPU, its runner replaced by a stand-in that does `execute_async`'s host work
# (`InputBatch.from_step`, `PackedInputs.pack` into the pinned buffer) and returns
# random tokens at once; 256 prompts of 128 to 512 random ids, SmolLM2's tokenizer,
# CPU time of the engine's thread. Run on the engine before and after four changes
# that leave every output as it was, it says where the time went:
#
# - **Blocks named only when one fills.** Postprocessing asked the block manager,
#   every row of every step, which blocks the step had filled, through a new
#   `RequestTokens` view; a decode row fills one every `block_size` tokens.
#   `cache_blocks` now returns at once when nothing filled, and `postprocess` asks
#   only for a row whose new tokens completed a block.
# - **The step in flight's block table, copied.** `schedule_ahead` rebuilt the whole
#   table from the block manager's lists. Nothing changes a table between a step and
#   the step planned ahead of it (only a full schedule admits, preempts or frees), so
#   it copies the rows (`SchedulerOutput.num_blocks` says how many blocks each holds)
#   and rewrites only those that took a block.
# - **A request's sampling row, made once.** `SamplingMetadata` was rebuilt from the
#   params every step, a list per field. Each request now keeps its row as the 64
#   bytes of a structured array's row (`settings_row`); a step joins its rows' bytes
#   and reads the columns from the one buffer. Sampled rows still draw from their own
#   generators, one call each.
# - **Python numbers once a step.** The log-probs (a dict per row) and the engine's
#   counters are read once for the step, not a NumPy scalar or a method call per row.

# %% tags=["remove-input"]
host_phases = {
    (r["label"], r["setting"]): r["phases_us"]
    for r in load_records("host_step") if r["name"] == "host_decode_step"
}
if ("before", "greedy") in host_phases and ("now", "greedy") in host_phases:
    was, is_now = host_phases[("before", "greedy")], host_phases[("now", "greedy")]
    prose.glue("host_phase_table", "\n".join(
        ["| phase (greedy, 256 rows) | µs before | µs now |", "| --- | ---: | ---: |"]
        + [f"| {p} | {was[p]:,.0f} | {is_now[p]:,.0f} |" for p in (
            "schedule", "from_step", "sampling", "pack", "postprocess",
            "engine_output", "step")]
    ))
    prose.glue("host_step_others", "; ".join(
        f"{s}: {host_phases[('before', s)]['step']:,.0f} → "
        f"{host_phases[('now', s)]['step']:,.0f} µs"
        for label, s in host_phases
        if label == "now" and s != "greedy" and ("before", s) in host_phases
    ))
    prose.glue("host_step_ratio", f"{was['step'] / is_now['step']:.1f}")
    host_cpu = load_records("host_step")[0]["device"]
    prose.glue("host_step_cpu", f"{host_cpu.get('cores', '?')}-core "
               f"{host_cpu.get('cpu', host_cpu['name'])}")
    prose.show(
        """
{{host_phase_table}}

On this project's {{host_step_cpu}} CPU the host's side of a greedy 256-row step is
{{host_step_ratio}} times shorter than before ("step" is the whole of `LLMEngine.step`).
The other settings, the whole step before and now: {{host_step_others}}. What is left
is mostly a Python loop over the rows in each phase: a request appends its token, a
step reads each row's counts. A stream still decodes each token twice and copies each
request's output every step.
"""
    )

# %% [markdown]
# ## Two more changes, and what they bought
#
# The kernel table and the user's path pointed at changes that needed measurement more
# than design; each subsection says what it bought.
#
# ### Two changes made from these measurements
#
# The table pointed at two things that needed no new design, only measurement
# (`bench/ch11_fusion_proto.py` swept them on the H200; its records are plotted here).
#
# **The GEMV's knobs at one token.** Chapter 6 chose its variants at 1 to 16 tokens.
# At one token every microsecond of a projection is paid 16 times a step, so the sweep
# tried every (warps sharing a row, rows per warp group, steps in flight) at each
# decode shape. Chapter 6's variants now take, at one token, what was fastest (or
# within a hair of it) on the small projections — a block of 8 warps on 4 rows, one
# step at a time — and on the tall ones — a warp a row with 8 steps in flight. `down`,
# whose rows are four times as long, would rather have two steps in flight and loses a
# little; one setting per variant keeps the kernels few.
#
# **The greedy sampler.** One block read the whole row of 128,256 logits. Chapter 8b now
# splits a greedy row into shares, a block each, and the last block to finish picks
# among them (attention's combine, again).

# %% tags=["hide-input"]
from tinyvllm_lib.kernels.gemv import GEMV_VARIANTS  # noqa: E402

proto = load_records("ch11_fusion_proto")
knob_records = [r for r in proto if r["name"] == "gemv_knobs"]
argmax_records = [r for r in proto if r["name"] == "greedy_argmax"]
if not knob_records or not argmax_records:
    print("Not recorded yet: bench/ch11_fusion_proto.py has not run on a GPU.")
else:
    fig, (ax0, ax1) = new_figure(1, 2, height=3.4)
    projections = ["qkv", "o", "gate_up", "down"]
    # (warps sharing a row, rows per warp group, steps in flight): chapter 6's one-token
    # settings before this chapter, and its variants' now ("auto" picks the warp a row
    # only for the tall gate-up here)
    old_knobs = dict(qkv=(8, 2, 2), o=(8, 2, 2), gate_up=(1, 1, 4), down=(8, 2, 2))
    new_knobs = {
        p: GEMV_VARIANTS["warp" if p == "gate_up" else "block"](1) for p in projections
    }
    knob_us = {
        (r["projection"], (r["warps_per_row"], r["rows"], r["unroll"])): r["value"]
        for r in knob_records
    }
    for i, name in enumerate(projections):
        times = [v for (p, _), v in knob_us.items() if p == name]
        ax0.scatter([i] * len(times), times, s=8, color="0.7", zorder=2)
        for knobs, marker, color, label in (
            (old_knobs[name], "o", "C0", "chapter 6's variant before"),
            (new_knobs[name], "*", "C1", "its variant now"),
        ):
            ax0.scatter(
                i, knob_us[name, knobs], marker=marker, s=60, zorder=3, color=color,
                label=label if i == 0 else None,
            )
    ax0.set_xticks(range(len(projections)), projections)
    ax0.set_yscale("log")
    ax0.set_ylabel("µs per launch, one token")
    ax0.set_title("GEMV: every knob setting (grey)", fontsize=9)
    plain_log_ticks(ax0)
    ax0.legend(fontsize=7)
    for rows in sorted({r["shape"][0] for r in argmax_records}):
        pts = sorted(
            (r["num_splits"], r["value"])
            for r in argmax_records
            if r["shape"][0] == rows
        )
        label = f"{rows} row" + ("s" if rows > 1 else "")
        ax1.plot(*zip(*pts), marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("blocks a row (1: one block reads the row)")
    ax1.set_ylabel("µs")
    ax1.set_title("greedy argmax over 128,256 logits", fontsize=9)
    plain_log_ticks(ax1)
    ax1.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))  # 8, not 2³
    ax1.legend(fontsize=7)
    plt.show()

# %% tags=["remove-input"]
if kernel_records and knob_records and argmax_records:
    sample_1 = k1["sample"]
    prose.glue("ch11_sample_1", f"{sample_1['value']:.1f} µs")
    prose.glue("ch11_sample_share", f"{sample_1['share_of_step']:.0%}")
    floor_us = bytes_us(sample_1)
    prose.glue("ch11_sample_floor", f"{floor_us:.2f} µs")
    one_row = {
        r["num_splits"]: r["value"] for r in argmax_records if r["shape"][0] == 1
    }
    prose.glue("ch11_argmax_one_block", f"{one_row[1]:.1f} µs")
    best_splits = min(one_row, key=one_row.get)
    prose.glue("ch11_argmax_split", f"{one_row[best_splits]:.1f} µs")
    prose.glue("ch11_argmax_splits", f"{best_splits}")
    saved = sum(
        16 * (knob_us[p, old_knobs[p]] - knob_us[p, new_knobs[p]]) for p in projections
    )
    prose.glue("ch11_knobs_saved", f"{saved:.0f} µs")
    prose.glue("ch11_qkv_old", f"{knob_us['qkv', old_knobs['qkv']]:.1f} µs")
    prose.glue("ch11_qkv_new", f"{knob_us['qkv', new_knobs['qkv']]:.1f} µs")
    prose.show("""
In the sweep, the new settings take QKV from {{ch11_qkv_old}} to {{ch11_qkv_new}} a
launch, and the four projections together {{ch11_knobs_saved}} a step (16 layers). One
block alone took {{ch11_argmax_one_block}} to find a row's largest logit (the sweep
reads the logits from memory, not from L2); split {{ch11_argmax_splits}} ways,
{{ch11_argmax_split}}. With many rows the blocks multiply, rows times shares, and the
sampler's own blocks (512 threads) are few to an SM:
it keeps to about 256 blocks in all, fewer shares as rows grow, one from 256 rows. In
the decode step the sampler kernel is now {{ch11_sample_1}} at one row
({{ch11_sample_share}} of the step), against {{ch11_sample_floor}} for its half
megabyte at the ceiling: the rest is the chain of a load, a fence, an atomic and the
last block's combine.
""")

# %% [markdown]
# ### Letting each kernel start before the last one ends
#
# With the step one graph, what remains between two kernels is the graph's own edge:
# the next kernel is launched once the last has finished, so every kernel of the step
# begins with its blocks being scheduled and its first loads in flight while the SMs
# wait. Chapter 1's `CudaGraph` now makes each edge between two of the
# library's kernels *programmatic* (Hopper's dependent launch): the next kernel is
# launched as soon as every block of the last one has started, and waits in its first
# line, `wait_for_previous_kernel`, for the last one to finish. Two kernels use the wait
# to do some of their work early:
#
# - **the GEMV** loads its first step of weights before it waits (chapter 6): no kernel
#   writes weights, so those loads overlap the kernel before, often a short norm or
#   attention, and may start while kernels further back still run. (Asking L2 to
#   prefetch every line of the block's rows instead, which we tried first, made every
#   GEMV slower on the H200, even with plain edges; that run is not kept.)
# - **decode attention** over one row no longer splits its context to fill the GPU:
#   one row has only 8 (row, KV head) blocks to split, and each split adds a fence, an
#   atomic and a combine to the chain. `DecodeAttentionConfig.for_rows` gives launches
#   of up to `few_rows` rows (one) 8 warps a block and a split only every 384 keys: one
#   setting for every context, not the best at any one of them, as the sweep below
#   shows (`bench/ch11_attention_one_row.py` times each grid setting alone, without the
#   early loads that follow). The blocks also load the context length, the block table
#   and their first keys and values — all but the newest token's, which the KV write
#   just before them stores — before they wait. Those come from the step's input copy
#   and earlier steps, never from a kernel of this graph; the rule would break if the
#   GPU ever advanced them itself, as it does the ids. Only for few rows: with a full
#   grid the same early loads made attention at 64 rows far slower on the H200 (that
#   run is not kept), since the blocks that started early held SMs the kernel before
#   still needed. Few rows also keep 3 rows a lane where batches use 2: with chapter
#   8's prefetch (the next step's rows loaded while a step's are used) each lane has the
#   next step's 3 rows in flight while it works on this step's.
#
# `bench/ch11_llama.py` runs batch 1 twice on one engine: once as captured, once with
# the decode graph captured again with every edge plain.

# %% tags=["hide-input"]
pdl = by_name.get("bs1_graph_replay")
plain = by_name.get("bs1_graph_replay_plain_edges")
one_row = [
    r for r in load_records("ch11_attention_one_row") if r["name"] == "bs1_attention"
]
# settings timed with chapter 8's prefetch, where the records have them (the kernel
# batch 1 runs); records made before the prefetch existed have no such field
one_row_prefetch = [r for r in one_row if r.get("prefetch")]
one_row = one_row_prefetch or one_row
if not (pdl and plain and one_row):
    print("Not recorded yet: bench/ch11_llama.py / ch11_attention_one_row.py on a GPU.")
else:
    fig, (ax0, ax1) = new_figure(1, 2, height=3.0)
    steps = [
        ("plain edges", plain["value"], by_name["bs1_decode_plain_edges"]["value"]),
        ("programmatic", pdl["value"], by_name["bs1_decode"]["value"]),
    ]
    ax0.barh([label for label, _, _ in steps], [ms * 1e3 for _, ms, _ in steps])
    for i, (_, ms, tok_s) in enumerate(steps):
        ax0.text(ms * 1e3, i, f" {ms * 1e3:,.0f} µs ({tok_s:,.0f} tok/s)", va="center",
                 fontsize=8)
    ax0.set_xlabel("batch-1 decode graph, µs a step (256 tokens)")
    ax0.set_xlim(0, 1.45e3 * max(ms for _, ms, _ in steps))
    contexts = sorted({r["shape"][1] for r in one_row})
    for warps in sorted({r["num_warps"] for r in one_row}):
        best = [
            min(r["value"] for r in one_row
                if r["num_warps"] == warps and r["shape"][1] == n)
            for n in contexts
        ]
        ax1.plot(contexts, best, marker=".", lw=1, label=f"{warps} warps, best grid")
    chosen = sorted((r["shape"][1], r["value"]) for r in one_row if r["is_default"])
    ax1.plot(*zip(*chosen), "k*", ms=9, label="for_rows(1)'s grid")
    ax1.set_xlabel("context, tokens")
    ax1.set_ylabel("µs a layer")
    ax1.set_title("decode attention, one row", fontsize=9)
    ax1.legend(fontsize=7)
    plt.show()

# %% tags=["remove-input"]
if pdl and plain and one_row:
    prose.glue("ch11_pdl_edges", f"{pdl.get('programmatic_edges', 0)}")
    prose.glue("ch11_pdl_nodes", f"{pdl.get('graph_nodes', 0)}")
    prose.glue("ch11_replay_plain", f"{plain['value'] * 1e3:,.0f} µs")
    prose.glue("ch11_replay_pdl", f"{pdl['value'] * 1e3:,.0f} µs")
    edges = max(1, pdl.get("programmatic_edges", 0))
    per_kernel = (plain["value"] - pdl["value"]) * 1e3 / edges
    prose.glue("ch11_pdl_per_edge", f"{per_kernel:.2f} µs")
    bs1_plain = by_name["bs1_decode_plain_edges"]["value"]
    prose.glue("ch11_bs1_plain", f"{bs1_plain:,.0f}")
    prose.glue("ch11_bs1_pdl", f"{by_name['bs1_decode']['value']:,.0f}")
    at = {
        (r["shape"][1], r["num_warps"], r["split_keys"], r["target_blocks"]): r["value"]
        for r in one_row
    }
    two_warps = min(v for (n, w, _, _), v in at.items() if n == 256 and w == 2)
    chosen_256 = next(
        r["value"] for r in one_row if r["is_default"] and r["shape"][1] == 256
    )
    prose.glue("ch11_attn1_two_warps", f"{two_warps:.1f} µs")
    prose.glue("ch11_attn1_chosen", f"{chosen_256:.1f} µs")
    prose.glue(
        "ch11_attn1_when",
        "with the prefetch" if one_row_prefetch else "before the prefetch",
    )
    # the chosen grid against the best setting at each context
    slower = {
        n: next(r["value"] for r in one_row if r["is_default"] and r["shape"][1] == n)
        / min(v for (c, _, _, _), v in at.items() if c == n)
        - 1
        for n in sorted({r["shape"][1] for r in one_row})
    }
    short = [v for n, v in slower.items() if n <= 384]
    prose.glue("ch11_attn1_short_gap", f"{min(short):.0%} to {max(short):.0%}")
    prose.glue("ch11_attn1_long_gap", f"{slower[max(slower)]:.0%}")
    prose.glue("ch11_attn1_long", f"{max(slower):,}")
    prose.show("""
The batch-1 graph has {{ch11_pdl_nodes}} kernels and {{ch11_pdl_edges}} programmatic
edges. Replayed back to back at 256 tokens, a step takes {{ch11_replay_pdl}} against
{{ch11_replay_plain}} with every edge plain, about {{ch11_pdl_per_edge}} an edge, and
the benchmark's decode goes from {{ch11_bs1_plain}} to {{ch11_bs1_pdl}} tok/s. At 256
tokens, one row's attention takes {{ch11_attn1_chosen}} a layer with the few-rows grid
(timed alone, without the early loads and {{ch11_attn1_when}}), against
{{ch11_attn1_two_warps}} at best with 2 warps a block. That grid is
{{ch11_attn1_short_gap}} slower than the best setting at each of the benchmark's
contexts (128 to 384 tokens), and {{ch11_attn1_long_gap}} at {{ch11_attn1_long}}:
one setting for all of them leaves that much on the table.
""")


# %% [markdown]
# Decode attention at 64 rows passed our target, 75% of the book's copy kernel's rate
# (the table above), once chapter 8's knobs were swept again after the combine moved
# into the kernel, with one knob more: each step loads the next step's keys and values
# while it works on its own. With loads always in flight, 2 rows a lane are enough and
# leave the registers for 4 warps a block, and a 1,024-token context fits in one block:
# 64 × 8 blocks are one wave, and no split needs combining.

# %% [markdown]
# ## What is left
#
# The graphs take away the launches, the overlap takes the host out of the step, and the
# fused kernels above took a few launches and one slow combine out of it. At batch 1 the
# step is now its kernels; what stands between this engine and the limit that the
# weights' bytes set is:
#
# - **the small projections**: QKV and the output projection move 8 to 12 MB a layer
#   at a far smaller share of the bandwidth ceiling than gate-up, because a kernel that
#   short is mostly its own start and end (the knob sweep above moved them, but not
#   far); the residual adds and QKV's norm are inside them now, and what remains is one
#   persistent kernel for a whole layer, as the hand-written megakernels do;
# - **attention over one sequence**: a chain of dependent loads (the block table, then
#   the keys, step after step) a few microseconds long for 2 MB; chapter 8's prefetch
#   now overlaps each step's loads with the step before, but the chain's start remains;
# - **the norm before gate-up**: a kernel of its own, because the norm needs the whole
#   row before the projection may start, and inside gate-up's GEMV it cost more than
#   the launch it saved (measured above);
# - **the first token**: a prefill step replays a graph now, but its attention runs on
#   SIMT cores (below).

# %% tags=["remove-input"]
paged = [r for r in load_records("ch10_paging") if r["name"] == "paged_prefill"]
cublas = [
    r["value"] for r in load_records("ch06_gemm") if r["name"] == "prefill_cublas"
]
if paged and cublas:
    best = max(r["value"] for r in paged)
    prose.glue("ch11_prefill_attn", f"{best:.0f} TFLOP/s")
    prose.glue("ch11_prefill_cublas", f"{min(cublas):.0f} to {max(cublas):.0f} TFLOP/s")
    prose.glue("ch11_prefill_share", f"{best / max(cublas):.0%}")
    prose.show("""
Chapter 10's paged prefill attention reaches {{ch11_prefill_attn}} on the H200, where
cuBLAS runs the same step's projections at {{ch11_prefill_cublas}} on the tensor cores:
attention gets {{ch11_prefill_share}} of their rate, and at thousands of tokens it is
most of a prefill's time. Attention on tensor cores (chapter 14) is what is left for a
user who waits for a first token.
""")

# %% [markdown]
# ## Summary
#
# - A CUDA graph freezes pointers and host scalars. The decode step qualifies because
#   chapter 8b made every buffer once and chapter 8 made attention's grid depend only on
#   the batch size and a fixed bound; cuBLAS gets a fixed workspace.
# - A graph per batch size, vLLM's buckets (and up to 16 rows a second, argmax_only one
#   for greedy batches that ask nothing more); a step pads up to the next size with rows
#   that read real memory and write no slot; prefill and mixed steps pad to buckets of
#   tokens, their attention one tile schedule.
# - The graphs are a part the runner holds (`CudaGraphs`), captured over chapter 8b's
#   `run` and its one packed `InputBatch`; `shape_for` is the one place that decides
#   whether a step replays, and the same batch, padded, is what a replay reads;
#   sampling runs inside the graph from per-row settings, and log-probabilities are
#   computed on the GPU: only ids and the asked-for numbers reach the host.
# - Async scheduling keeps one decode step in flight: the scheduler plans step n + 1
#   from step n's shape, the GPU feeds each row its token (`next_ids`), and tokens of
#   requests that finished meanwhile are dropped.
# - The Llama 3.2 1B stand-in (Appendix A) has the real tokenizer and random weights of
#   the exact shapes: speed depends only on shapes.
# - `python -m tinyvllm_lib bench latency | throughput` measures what vLLM's benchmark
#   measures.
# - With graphs and the overlap, batch 1 is bounded by its kernels, not the host: the
#   small projections, attention over one sequence, the norms and the sampler take far
#   longer than their bytes need, and fewer, fuller kernels are what is left.
# - Sweep the knobs where the step spends its time: the one-token GEMV settings and a
#   greedy sampler split over blocks came from measurements, not from design.
# - Measure each fusion against the kernels it replaces: the combine inside attention,
#   RoPE with the KV write, the residual adds inside the projections, the norm inside
#   QKV's GEMV and (with one step of its two rows in flight) the gated GEMV at one
#   token were kept; the norm inside gate-up's GEMV lost and was not adopted.
# - Programmatic graph edges let each kernel launch while the one before it finishes,
#   and wait for it in its first line; the GEMV loads its first weights before that
#   wait. Batch 1's attention takes a whole short context in one block of 8 warps.
# - Keep loads in flight while the arithmetic runs: decode attention loads its next
#   step's keys while it works on this one's, which (with a grid of one wave) took it
#   past 75% of the book's copy kernel's rate at 64 rows.
# - On a full batch the GPU sets the pace; the graphs took the throughput far past the
#   eager engine's, and the overlap keeps the GPU fed between steps.

# %% tags=["remove-input"] jupyter={"source_hidden": true}
measured = ("ch11_bs1", "ch11_bs1_verdict", "ch11_tp_verdict", "ch11_overlap_verdict")
if all(k in prose.values for k in measured):
    prose.show("""
**Measured** on the {{ch11_h200}} ({{ch11_date}}): batch-1 decode at {{ch11_bs1}},
{{ch11_bs1_ratio}} of the {{ch11_limit}} limit and {{ch11_bs1_verdict}} of the
chapter's target; nano-vllm's workload at {{ch11_tp}} output tok/s, {{ch11_tp_verdict}}
of its target, and with the overlap against without it the rate is
{{ch11_overlap_verdict}}. Attention at 64 rows reads at {{ch11_attn_64_bw}} of
{{ch11_ceiling}}."""
               + ("""
What a user sends, at batch 1: every sampling setting at least
{{ch11_user_worst_sampled}} of greedy, log-probs {{ch11_user_lp5}} (five) and
{{ch11_user_lp20}} (twenty), the first token after {{ch11_ttft_128}} for a 128-token
prompt against a floor of {{ch11_ttft_floor128}}."""
                  if "ch11_user_lp5" in prose.values else "") + "\n")
else:
    print("chapter 11's engine records are not all there yet: run bench/ch11_llama.py")

# %% [markdown]
# ## Exercises
#
# 1. A step of 9 requests replays the graph of 16. Count the rows of wasted work over
#    nano-vllm's workload for vLLM's sizes, and for powers of two only. When is a finer
#    list worth its extra graphs?
# 2. Capture the graph of 8 with `max_context_len` set to 512 instead of the engine's
#    bound. Which requests would it serve wrongly, and would a test in the simulator
#    notice? Why not?
# 3. `PackedInputs` copies every row of the block table each step, though a row
#    changes by at most one entry a step. How could the graph read a table kept on the
#    GPU instead, and what would a 256-row step save?
# 4. `logprobs_kernel` merges the threads' lists in k rounds of a block argmax, each
#    nine steps of `syncthreads`. Do the first rounds within a warp with shuffles (and a
#    shared-memory stand-in for the simulator); predict, then measure, the gain at one
#    row and at 256.
# 5. The host's share: profile `bench/ch11_host_cpu.py` at 256 rows and remove the
#    largest cost you find without changing any output.
# 6. `AsyncScheduler.schedule_ahead` gives up whenever a waiting request could be
#    admitted. Let it plan the decodes ahead and admit the newcomer in the step after.
#    What must the runner do differently, and what does a request arriving every step
#    cost in each design?
# 7. The greedy sampler keeps to about 256 blocks (chapter 8b's `greedy_shares`), a
#    rule drawn from two measurements, not a sweep of its own kernel: sweep it at 1 to
#    256 rows. The argmax_only graphs stop at 16 rows: measure what they save per step
#    at 32, 64 and 256 rows, and what each size costs in capture time and memory.
