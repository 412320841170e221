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
# # 13. Outgrowing one GPU: tensor parallelism
#
# [Chapter 11](11_llama.py) made a decode step of Llama 3.2 1B cost about what reading
# its weights once costs, and [chapter 12](12_serving.py) put a server around it. A
# model whose weights do not fit in one GPU's memory, or whose step is too slow because
# one GPU can read only so many bytes a second, needs more than one GPU. vLLM's answer
# for GPUs in one machine is `tensor_parallel_size=N`: every layer is cut into N
# pieces, each GPU holds one and reads only that, and the GPUs add up their partial
# results after the layers that need it. This chapter gives the book's engine the same
# switch. It is written and tested on CPU processes first — one process per rank, the
# NumPy backend of [chapter 7](07_attention.py) — because the splits, the collectives
# and the failure handling are the same whatever does the arithmetic; the two-GPU run
# is one command at the end.
#
# In this chapter you will learn:
#
# - **Megatron's splits**: which weights are cut by output features (each rank owns
#   whole query and KV heads, and a slice of the MLP), which by input features, and
#   why a pair of the two needs one all-reduce;
# - the **collectives** the model needs — `all_reduce`, `all_gather`, `broadcast` —
#   behind one small communicator, on gloo (CPUs) and NCCL (GPUs);
# - **one process per rank**: rank 0 schedules, every rank runs the step it is sent on
#   its shard, and a rank that dies ends the engine with an error instead of a hang;
# - **what it costs**: the bytes each all-reduce moves, why at batch 1 they cost latency
#   rather than bandwidth, and a prediction of two GPUs against one for the two-GPU run
#   to check.

# %%
#| default_exp distributed.sharding

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.measure import bandwidth_ceiling, load_records
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import fuse_llama_weights
from tinyvllm_lib.models.llama_standin import standin_config
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import where_kernels_run

prose = Prose()  # the numbers this chapter's prose quotes, filled in as they are made
print(where_kernels_run())

# %% [markdown]
# ## Why split a layer
#
# Count first, as every chapter does. A decode step at batch 1 reads every weight once,
# so its time is at least the weights' bytes over the memory bandwidth. Chapter 11
# measured both on the H200 for the Llama 3.2 1B stand-in:

# %%
llama_1b = ModelConfig.from_dict(standin_config())
ch11 = {r["name"]: r for r in load_records("ch11_llama")}
gb_s, ceiling_name = bandwidth_ceiling()
weight_bytes = ch11["bs1_decode"]["weight_bytes"] if ch11 else float("nan")
floor_ms = weight_bytes / (gb_s * 1e9) * 1e3
step_ms = 1e3 / ch11["bs1_decode"]["value"] if ch11 else float("nan")
print(f"weights {weight_bytes / 1e9:.2f} GB, read at {gb_s:.0f} GB/s ({ceiling_name}): "
      f"{floor_ms:.3f} ms a step at least; measured {step_ms:.3f} ms")
prose.glue("ch13_weight_gb", f"{weight_bytes / 1e9:.2f} GB")
prose.glue("ch13_ceiling", f"{gb_s:,.0f} GB/s")
prose.glue("ch13_floor_ms", f"{floor_ms:.2f} ms")
prose.glue("ch13_step_ms", f"{step_ms:.2f} ms")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The weights are {{ch13_weight_gb}}; at the best rate chapter 1 measured,
{{ch13_ceiling}}, reading them takes {{ch13_floor_ms}}, and chapter 11's decode step
took {{ch13_step_ms}}. Two GPUs that each held half the weights would each read half the
bytes: the floor halves. What they pay for it is talk — after some layers every GPU
needs the sum of all GPUs' results — and this chapter is about making that talk as
little as possible, and counting what is left.
""")
# %% [markdown]
# ## Megatron's two splits
#
# A linear layer computes $Y = X W^\top$ with $W$ of shape (out, in). There are two ways
# to cut $W$ over $N$ ranks (Shoeybi et al., *Megatron-LM*, 2019).
#
# **By output features** (Megatron calls it column-parallel, after $W^\top$'s columns):
# rank $r$ holds the rows $W_r$ of $W$ and computes its own slice of the output,
#
# $$Y = \big[\, X W_0^\top \;\big|\; X W_1^\top \;\big|\; \dots \;\big|\;
#   X W_{N-1}^\top \,\big],$$
#
# with no talk at all: every rank has the whole input $X$.
#
# **By input features** (row-parallel): rank $r$ holds the columns $W_{:,r}$ and the
# matching slice $X_r$ of the input, and its product is a *partial sum* of the whole:
#
# $$Y = \sum_{r=0}^{N-1} X_r\, W_{:,r}^\top .$$
#
# The sum over ranks is an **all-reduce**: every rank sends its partial sum and receives
# the total. The trick is to pair the two. The QKV projection is cut by output features
# so that each rank owns whole heads — its query heads and its KV heads, which is why N
# must divide both counts — and attention runs per head, so each rank attends with its
# own heads and nothing else. Its attention output is exactly the input slice $X_r$ that
# the output projection, cut by input features, needs. The MLP is the same pair: gate
# and up by output features (a rank's slice of the intermediate width; SiLU·up works
# element by element), down by input features. So a layer needs two all-reduces, one
# after `o_proj` and one after `down_proj`, and everything between them stays on its
# rank. The norms are small and every rank keeps them whole.
#
# The vocabulary is cut too. The LM head is cut by output features — each rank computes
# the logits of its slice of the vocabulary, and an **all-gather** puts the slices side
# by side. The embedding table is cut by rows: a rank looks up the ids in its slice,
# writes zero rows for the others, and an all-reduce adds them up. A vocabulary that N
# does not divide is padded with zero rows to a multiple of N, and the padded logits are
# cut off after the gather, so no padding token can ever be sampled.
#
# Two lines of NumPy check both identities before any process is started:

# %%
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 8))  # (tokens, in)
w = rng.standard_normal((6, 8))  # (out, in)
by_output = np.concatenate([x @ w[r * 3 : (r + 1) * 3].T for r in range(2)], axis=1)
by_input = sum(x[:, r * 4 : (r + 1) * 4] @ w[:, r * 4 : (r + 1) * 4].T
               for r in range(2))
print("by output features, side by side:", np.allclose(by_output, x @ w.T))
print("by input features, summed:       ", np.allclose(by_input, x @ w.T))

# %% [markdown]
# Here is SmolLM2 (9 query heads, 3 KV heads, an MLP 1,536 wide) cut over three ranks,
# one tensor of one layer a bar, each stretch coloured by the rank that holds it. The
# fused QKV projection of [chapter 7](07_attention.py) stacks q, k and v rows; each
# rank's shard is its own q heads, then its own k heads, then its own v heads, so a
# rank's fused tensor has the layout of a smaller model's.

# %% tags=["hide-input"]
def draw_splits(config: ModelConfig, n: int):
    """Which rank holds which heads and rows of one layer (and of the vocabulary)."""
    c, colors = config, plt.cm.tab10.colors
    H, KVH, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    bars = [  # (tensor, [(label, size, rank), ...], how it is cut)
        ("qkv_proj rows", [(f"q{h}", 1, h // (H // n)) for h in range(H)]
         + [(f"k{h}", 1, h // (KVH // n)) for h in range(KVH)]
         + [(f"v{h}", 1, h // (KVH // n)) for h in range(KVH)], "output: whole heads"),
        ("o_proj columns", [(f"h{h}", 1, h // (H // n)) for h in range(H)],
         "input, then all-reduce"),
        ("gate_up rows", [("gate", 1, r) for r in range(n)]
         + [("up", 1, r) for r in range(n)], f"output: {inter // n} each of gate, up"),
        ("down_proj columns", [("", 1, r) for r in range(n)],
         f"input ({inter // n} each), then all-reduce"),
        ("lm_head rows", [("", 1, r) for r in range(n)],
         f"vocabulary, {-(-c.vocab_size // n):,} each; all-gather"),
        ("embed rows (NumPy)", [("", 1, r) for r in range(n)],
         "the same rows; zero elsewhere, all-reduce"),
    ]
    fig, ax = new_figure(width=8.8, height=3.4)
    for y, (name, parts, how) in enumerate(reversed(bars)):
        total, at = sum(size for _, size, _ in parts), 0.0
        for label, size, rank in parts:
            ax.barh(y, size / total, left=at, color=colors[rank], edgecolor="white")
            ax.text(at + size / total / 2, y, label, ha="center", va="center",
                    fontsize=7, color="white")
            at += size / total
        ax.text(-0.02, y, name, ha="right", va="center", fontsize=9)
        ax.text(1.02, y, how, ha="left", va="center", fontsize=8)
    handles = [Patch(color=colors[r], label=f"rank {r}") for r in range(n)]
    ax.set_xlim(0, 1)
    ax.axis("off")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1.16), ncol=n,
              frameon=False)
    return fig


smollm2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3,
)
draw_splits(smollm2, 3)
plt.show()

# %% [markdown]
# The function below cuts a checkpoint this way, in its Hugging Face names, before
# chapter 7's `fuse_llama_weights` stacks q, k and v: stacking rank r's q, k and v
# shards gives rank r's fused tensor. `shard_config` is the config a rank's model, KV
# cache and attention read — its share of the heads and of the MLP — so the model's
# one layer loop runs a shard unchanged. A size that does not divide is refused first,
# naming what it does not divide.

# %%
#| export
from dataclasses import replace

import numpy as np

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.models.config import ModelConfig

# the Hugging Face tensors each split takes: by rows (output features) or by columns
# (input features)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """ValueError unless world_size divides the query heads, the KV heads and the MLP's
    width (every rank owns whole heads).
    """
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"tensor_parallel_size must be a positive integer, got {world_size!r}"
        )
    bad = [f"{name} = {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size = {world_size} must divide num_attention_heads, "
            f"num_key_value_heads and intermediate_size; it does not divide "
            f"{', '.join(bad)}"
        )


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's config: its share of the heads and of the MLP's width (what its
    layer loop, KV cache and attention read); the rest as the model's.
    """
    check_tensor_parallel(config, world_size)
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        tie_word_embeddings=False,  # a shard's head is always its own tensor
    )


def vocab_shard(table: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank's rows of a (vocab, hidden) table: the vocabulary padded with zero rows to
    a multiple of world_size, then cut in equal parts.
    """
    rows = cdiv(len(table), world_size)
    part = table[rank * rows : (rank + 1) * rows]
    if len(part) == rows:
        return np.ascontiguousarray(part)
    padded = np.zeros((rows, table.shape[1]), table.dtype)
    padded[: len(part)] = part
    return padded


def shard_llama_weights(
    weights: dict[str, np.ndarray], config: ModelConfig, rank: int, world_size: int,
    split_embedding: bool = True,
) -> dict[str, np.ndarray]:
    """Rank's tensors of a Llama checkpoint (Hugging Face names), Megatron's way: q, k,
    v, gate and up by rows (whole heads), o and down by columns, the head by the
    vocabulary; the embedding too where split_embedding, else whole. An 8-bit
    matrix's row scales (chapter 15's checkpoints) go with its rows.
    """
    check_tensor_parallel(config, world_size)

    def part(w: np.ndarray, axis: int) -> np.ndarray:
        size = w.shape[axis] // world_size
        cut = slice(rank * size, (rank + 1) * size)
        return np.ascontiguousarray(w[cut] if axis == 0 else w[:, cut])

    shard = {}
    for name, w in weights.items():
        kind = name.split(".")[-2]  # "model.layers.0.self_attn.q_proj.weight"
        if kind in COLUMN_PARALLEL:  # (out, in): a rank's output features
            shard[name] = part(w, 0)
        elif kind in ROW_PARALLEL:  # a rank's input features (row scales: whole)
            shard[name] = part(w, 1) if w.ndim == 2 else w
        elif kind not in ("embed_tokens", "lm_head"):
            shard[name] = w  # the norms: every rank has them whole
    embed = weights["model.embed_tokens.weight"]
    head = weights["lm_head.weight"] if "lm_head.weight" in weights else embed
    shard["lm_head.weight"] = vocab_shard(head, rank, world_size)
    if split_embedding:  # tied: the same rows, one array
        shard["model.embed_tokens.weight"] = (
            shard["lm_head.weight"] if head is embed
            else vocab_shard(embed, rank, world_size)
        )
    else:
        shard["model.embed_tokens.weight"] = embed
    return shard

# %% [markdown]
# On a small random Llama cut over two ranks, each rank's fused QKV tensor is its own q
# heads, then k heads, then v heads, and the vocabulary's padding is zero:

# %%
tiny_folder = make_random_llama(
    "/tmp/tinyvllm_ch13_llama",
    tiny_llama_config(num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                      vocab_size=250),
)
tiny = ModelConfig.from_folder(tiny_folder)
tiny_weights = load_weights(tiny_folder, tiny, progress=False)
whole = fuse_llama_weights(tiny_weights, tiny)
shards = [fuse_llama_weights(shard_llama_weights(tiny_weights, tiny, r, 2),
                             shard_config(tiny, 2)) for r in range(2)]
q, k, v = np.split(whole["layers.0.qkv_proj"], [8 * 8, 12 * 8])  # rows: 8 q, 4 k, 4 v
rank1 = np.concatenate([q[32:], k[16:], v[16:]])  # heads 4-7 of q, 2-3 of k and v
print("rank 1's fused qkv is its heads:", np.array_equal(shards[1]["layers.0.qkv_proj"],
                                                         rank1))
o_back = np.concatenate([s["layers.0.o_proj"] for s in shards], axis=1)
print("o_proj's columns put back:      ",
      np.array_equal(o_back, whole["layers.0.o_proj"]))
print("lm_head rows per rank:          ", [len(s["lm_head"]) for s in shards])
try:
    shard_config(tiny, 3)
except ValueError as error:
    print("three ranks:", error)

# %% [markdown]
# ## One communicator
#
# The model needs three collectives and nothing else: `all_reduce` (after `o_proj`,
# `down_proj` and the embedding), `all_gather` (the logits' slices) and `broadcast`
# (rank 0 sends each step's inputs). Chapter 7 gave both models a `comm` part, whose
# single-rank `Communicator` hands every input back, so one layer loop serves one rank
# and many. Here are the real ones, each on an existing library, never a hand-made
# exchange of bytes.
#
# **On CPUs: gloo**, through `torch.distributed` (the CPU build of PyTorch is already
# there for the model tests). A NumPy array becomes a tensor without a copy
# (`torch.from_numpy`), is all-reduced in place, and is the same memory afterwards. For
# the CUDA simulator's ranks the device arrays are copied to the host, reduced, and
# copied back: slow, but it lets CI run the GPU model's sharded layer loop. Every
# collective has a timeout, the group's, so a rank that stops answering is an error
# within seconds rather than a hang. The steps travel in a group of their own, which
# may wait as long as rank 0 has nothing to do.

# %%
#| export distributed.gloo_communicator
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tinyvllm_lib.distributed.communicator import Communicator

IDLE_TIMEOUT = timedelta(days=365)  # how long a rank waits for the next step


def _on_host(x, stream) -> np.ndarray:
    """x as a C-contiguous host array (a device array is copied, and waited for)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    host = x.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return host


class GlooCommunicator(Communicator):
    """The collectives of torch.distributed's gloo backend, over host memory: NumPy
    arrays in place, device arrays through a copy to the host and back (the CUDA
    simulator's ranks). Every collective gives up after the group's timeout.
    """

    def __init__(self, rank: int, world_size: int, step_group):
        self.rank, self.world_size = rank, world_size
        # the steps travel in a group of their own, which may wait while rank 0 idles
        self.step_group = step_group

    def all_reduce(self, x, stream=0):
        host = _on_host(x, stream)
        dist.all_reduce(torch.from_numpy(host))
        if isinstance(x, np.ndarray):
            return host  # x itself where it was contiguous
        x.copy_to_device(host, stream=stream)
        return x

    def all_gather(self, x, out=None, stream=0):
        host = _on_host(x, stream)
        parts = [torch.empty(host.shape, dtype=torch.float32)
                 for _ in range(self.world_size)]
        dist.all_gather(parts, torch.from_numpy(host))
        full = np.concatenate([p.numpy() for p in parts], axis=-1)
        if out is None:
            return full
        out.copy_to_device(np.ascontiguousarray(full[:, : out.shape[1]]), stream=stream)
        return out

    def broadcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.step_group)
        return box[0]


def init_distributed(
    rank: int, world_size: int, init_method: str, timeout: float
) -> GlooCommunicator:
    """Join the ranks' process group (torch.distributed's rendezvous at init_method;
    "env://" reads MASTER_ADDR and MASTER_PORT, as under torchrun).
    """
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    step_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return GlooCommunicator(rank, world_size, step_group)


def launched_by_torchrun() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) where a launcher such as torchrun set them, else
    None.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))

# %% [markdown]
# **On GPUs: NCCL**, through CuPy's bindings, `cupy.cuda.nccl`. Three reasons for that
# choice. It adds no package to the book's GPU machines, which have CuPy (elsewhere:
# `cupy-cuda13x`; numba's own device arrays are what the kernels use, and CuPy is
# imported only here, lazily). It takes raw device pointers and a raw stream handle, so
# it works on numba's device arrays as they are, with no conversion, and on the
# **kernels' own stream**: the all-reduce is queued behind the `o_proj` GEMM that feeds
# it and ahead of the norm that reads it, with no synchronisation on the host. And NCCL
# calls on a stream can be captured in a CUDA graph, which is what [chapter
# 11](11_llama.py)'s decode steps are: a captured step would hold its collectives like
# any other kernel. (`torch.distributed`'s NCCL backend would need the CUDA build of
# PyTorch, a large dependency the GPU path does not otherwise have, and torch tensors.)
# The class below is kept small because it cannot be run here: it has no GPU to run on.
# **The two-GPU issue (37) runs it**; this chapter's tests run the gloo one.

# %%
#| export distributed.nccl_communicator
import numpy as np

from tinyvllm_lib.distributed.communicator import Communicator
from tinyvllm_lib.kernels.checks import device_pointer


def _stream_handle(stream) -> int:
    """The CUDA stream a numba stream wraps, as an integer (0: the default stream)."""
    return 0 if isinstance(stream, int) else int(stream)


class NcclCommunicator(Communicator):
    """NCCL's all-reduce and all-gather through CuPy's bindings (cupy.cuda.nccl),
    called with numba device arrays' pointers on the kernels' own stream, so a CUDA
    graph can capture them. Steps still travel through `host` (a GlooCommunicator),
    which also hands NCCL's unique id from rank 0 to the others. float32 only.
    """

    def __init__(self, host: Communicator):
        import cupy
        from cupy.cuda import nccl
        from numba import cuda

        cupy.cuda.Device(cuda.get_current_device().id).use()  # numba's GPU, CuPy's too
        self.nccl, self.cupy, self.host = nccl, cupy, host
        self.rank, self.world_size = host.rank, host.world_size
        unique_id = host.broadcast(nccl.get_unique_id() if host.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)
        self._gathered = None  # (world_size, rows, cols) float32: all_gather's scratch

    def _check(self, x) -> None:
        if x.dtype != np.float32 or not x.is_c_contiguous():
            raise TypeError("NCCL collectives here take C-contiguous float32 arrays")

    def all_reduce(self, x, stream=0):
        self._check(x)
        p = device_pointer(x)
        self.comm.allReduce(p, p, x.size, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM,
                            _stream_handle(stream))
        return x

    def all_gather(self, x, out=None, stream=0):
        """x (rows, cols) of every rank -> out (rows, <= world_size * cols)."""
        from numba import cuda

        self._check(x)
        rows, cols = x.shape
        need = self.world_size * x.size
        if self._gathered is None or self._gathered.size < need:
            self._gathered = cuda.device_array(need, np.float32)
        gathered = self._gathered[:need]
        self.comm.allGather(device_pointer(x), device_pointer(gathered), x.size,
                            self.nccl.NCCL_FLOAT32, _stream_handle(stream))
        # (world_size, rows, cols) -> (rows, world_size * cols), cut to out's width,
        # by CuPy on the same stream
        cp = self.cupy
        with cp.cuda.ExternalStream(_stream_handle(stream)):
            parts = cp.asarray(gathered).reshape(self.world_size, rows, cols)
            side_by_side = parts.transpose(1, 0, 2).reshape(rows, -1)
            cp.asarray(out)[...] = side_by_side[:, : out.shape[1]]
        return out

    def broadcast(self, obj=None):
        return self.host.broadcast(obj)

# %% [markdown]
# ## The residual, added once
#
# The NumPy model adds the all-reduced projection to the residual stream:
# `x = x + all_reduce(x_r W_r^T)`. The GPU model of chapter 7 does better on one GPU:
# the projection *is* the residual add (`linear(..., accumulate=True)`: the GEMM's
# epilogue adds into the float32 residual buffer, no separate add kernel). With N ranks
# that buffer holds the residual on every rank, and summing N such buffers would add the
# residual N times. So under tensor parallelism rank 0 accumulates (`residual +=
# partial`) and every other rank overwrites (`residual = partial`); the in-place
# all-reduce then leaves `residual + Σ partials` on every rank, the residual counted
# once:
#
# ```python
# linear(b["attn"], w[p + "o_proj"], b["residual"], accumulate=is_first, **on)
# self.comm.all_reduce(b["residual"], stream)
# ```
#
# (On one rank `is_first` is true and the all-reduce does nothing: the chapter 7 loop,
# unchanged.) The GPU model looks the embedding up in the whole table on every rank
# instead of splitting it: the book's embedding kernel marks an id outside its table
# with NaN rather than zero, and a lookup reads only a step's rows, so splitting it
# saves memory (the table's bytes, once per extra rank) but no time, and would cost one
# more all-reduce a step. The LM head, which is read whole every step, is split on both
# backends.
#
# ## One process per rank
#
# vLLM runs each GPU's share in a process of its own (its `MultiprocExecutor` and
# workers), and so does this engine, for the same reasons: each process owns one
# device, and one process's Python does not wait on another's. Rank 0 is the process
# that made the `LLM`. It runs the scheduler and the block manager as before; the block
# tables it hands out are the same for every rank, because every rank's KV cache has
# the same slots, each holding only that rank's KV heads. Each step it builds chapter
# 8b's `InputBatch` once — token ids, positions, attention metadata, the sampling rows —
# and **broadcasts** it; then every rank runs it on its shard, and the ranks meet in the
# model's all-reduces. Every rank then runs the sampler on the same gathered logits —
# one code path for all ranks — but only rank 0's tokens go back to the scheduler; the
# others are thrown away (so they are sent the batch without the penalties' counts).
#
# The other ranks are started the way PyTorch programs start them: on one machine with
# `torch.multiprocessing` and the `spawn` start method (a fresh interpreter, no forked
# CUDA context), meeting at a TCP address through `init_process_group`. Under
# `torchrun`, which starts every process itself and sets `RANK`, `WORLD_SIZE` and
# `LOCAL_RANK`, the same code reads them and starts nothing; ranks other than 0 then
# serve rank 0's steps and end. What a rank runs is `run_worker` below, importable from
# the package (spawn imports it in the new process). On CPUs each rank does its math on
# one thread, set in its environment before it imports NumPy (rank 0, the process that
# was already running, keeps its own threads). Spawn starts a fresh interpreter that
# imports the script that made the engine: a script must make it under
# `if __name__ == "__main__":`, or the new process fails while it starts.
#
# Failure is part of the design. A collective that waits longer than
# `distributed_timeout` (60 s by default) raises — gloo's do; NCCL's have no timeout
# of their own, and the two-GPU issue must add one (poll the step's event against the
# deadline, then abort the communicator); a rank whose process has died is
# noticed before the next step is sent; either way rank 0 kills every other rank (a
# rank that does not answer may not answer a `terminate` either), leaves the process
# group, and `generate` raises an error that says so. At a normal end the ranks are
# told to stop and given time to. The processes are daemons, and a finalizer stops
# them when the engine is dropped or Python exits.

# %%
#| export distributed.executor
import contextlib
import os
import socket
import weakref
from dataclasses import replace

import torch.distributed as dist
import torch.multiprocessing as mp

from tinyvllm_lib.distributed.gloo_communicator import (
    init_distributed,
    launched_by_torchrun,
)
from tinyvllm_lib.distributed.sharding import (
    check_tensor_parallel,
    shard_config,
    shard_llama_weights,
)
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.input_batch import InputBatch
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import load_weights
from tinyvllm_lib.runtime import has_gpu

# a rank's process does its math on one CPU thread (set before it imports NumPy)
ONE_THREAD = {name: "1" for name in
              ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
JOIN_SECONDS = 5.0  # how long a stopping rank gets before it is terminated


def make_rank_runner(folder, config: EngineConfig, comm, sampler=None) -> ModelRunner:
    """This rank's ModelRunner: the device's model on its shard of the weights (and so
    a KV cache of its own heads), talking to the other ranks through comm.
    """
    from tinyvllm_lib.models.llama_cuda import LlamaCuda
    from tinyvllm_lib.models.llama_numpy import LlamaNumpy

    full = ModelConfig.from_folder(folder)
    if config.quantization is None:
        tensors = load_weights(folder, full, progress=False)
    else:  # chapter 15: a checkpoint's 8-bit codes and row scales, or bf16 weights
        from tinyvllm_lib.quantization.checkpoint import load_quantized_weights

        tensors = load_quantized_weights(folder, full)
    weights = shard_llama_weights(
        tensors, full, comm.rank, comm.world_size,
        split_embedding=config.device == "cpu",  # the GPU looks rows up whole
    )
    if config.quantization is not None:  # chapter 15: each rank quantizes its shard
        # (or takes its shard of a checkpoint's codes)
        from tinyvllm_lib.models.llama_quantized import quantized_model

        model = quantized_model(config.device, shard_config(full, comm.world_size),
                                weights, config.quantization, comm=comm,
                                lm_head=config.quantize_lm_head)
    else:
        model = (LlamaNumpy if config.device == "cpu" else LlamaCuda)(
            shard_config(full, comm.world_size), weights, comm=comm
        )
    return ModelRunner(folder, config, sampler=sampler, model=model)


def make_communicator(rank, world_size, init_method, config: EngineConfig):
    """The ranks' communicator: NCCL between GPUs, gloo between CPU processes (and the
    CUDA simulator's); the steps travel over gloo either way.
    """
    host = init_distributed(rank, world_size, init_method, config.distributed_timeout)
    if config.device == "cuda" and has_gpu():
        from tinyvllm_lib.distributed.nccl_communicator import NcclCommunicator

        return NcclCommunicator(host)
    return host


def run_worker(rank, world_size, folder, config, init_method, sampler=None,
               local_rank=None) -> None:
    """What a rank other than 0 runs: join the group, build its runner, then run
    each step rank 0 broadcasts, until it broadcasts None.
    """
    if config.device == "cuda" and has_gpu():
        from numba import cuda

        cuda.select_device(rank if local_rank is None else local_rank)
    comm = make_communicator(rank, world_size, init_method, config)
    try:
        runner = make_rank_runner(folder, config, comm, sampler)
        while (message := comm.broadcast()) is not None:
            method, argument = message  # ("init_kv_cache", slots) or ("execute_batch",
            getattr(runner, method)(argument)  # batch)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(values: dict):
    """os.environ with `values` set, for processes started inside (restored after)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop_ranks(comm, processes: list, politely: bool) -> None:
    """Stop the other ranks and leave the process group. Politely: a None step, then
    time to finish, then terminate what is left; after a failure: kill at once (a rank
    that does not answer may not answer a terminate either).
    """
    if politely and comm is not None and all(p.is_alive() for p in processes):
        with contextlib.suppress(Exception):
            comm.broadcast(None)
    for p in processes:
        if politely:
            p.join(JOIN_SECONDS)
            if p.is_alive():
                p.terminate()
                p.join(JOIN_SECONDS)
        if p.is_alive():
            p.kill()
        p.join()
    if dist.is_initialized():
        dist.destroy_process_group()

# %%
#| export distributed.executor
class MultiprocExecutor:
    """vLLM's name: rank 0's ModelRunner in this process, one process per other rank
    (started with spawn, or by torchrun), and one broadcast of each step's InputBatch
    before every rank runs it on its shard. Where the engine holds a ModelRunner it
    holds this: init_kv_cache, execute, shutdown; the rest is rank 0's runner's.
    """

    def __init__(self, folder, config: EngineConfig, sampler=None):
        n = config.tensor_parallel_size
        check_tensor_parallel(ModelConfig.from_folder(folder), n)  # before any start
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is running in this process already: "
                "shutdown() it first"
            )
        self.processes, self.comm, self.failed = [], None, False
        launched = launched_by_torchrun()
        if launched is not None:  # every rank is a process torchrun started
            rank, world_size, local_rank = launched
            if world_size != n:
                raise ValueError(
                    f"tensor_parallel_size = {n}, but the launcher started "
                    f"WORLD_SIZE = {world_size} processes"
                )
            if rank != 0:  # this process serves rank 0's steps, then ends
                run_worker(rank, n, folder, config, "env://", sampler, local_rank)
                raise SystemExit(0)
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            spawn = mp.get_context("spawn")
            with environment(ONE_THREAD):
                for rank in range(1, n):
                    p = spawn.Process(
                        target=run_worker, name=f"tinyvllm-rank-{rank}", daemon=True,
                        args=(rank, n, folder, config, init_method, sampler),
                    )
                    p.start()
                    self.processes.append(p)
        # at exit, or when the engine is dropped, the ranks stop with it
        self._stop = weakref.finalize(self, stop_ranks, None, self.processes, False)
        try:
            self.comm = make_communicator(0, n, init_method, config)
            self._stop.detach()
            self._stop = weakref.finalize(
                self, stop_ranks, self.comm, self.processes, True
            )
            self.driver = make_rank_runner(folder, config, self.comm, sampler)
        except BaseException:
            self.failed = True
            self.shutdown()
            raise

    def __getattr__(self, name):
        if name == "driver":  # not made yet
            raise AttributeError(name)
        return getattr(self.driver, name)  # device, config, kv_cache_dtype, graphs, ...

    def _broadcast_and_run(self, method: str, argument, for_others=None):
        """Every rank runs runner.method(argument) (the others get for_others where
        given); rank 0's result.
        """
        for i, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                self.failed = True
                self.shutdown()
                raise RuntimeError(
                    f"tensor parallelism: rank {i} (pid {p.pid}) exited with code "
                    f"{p.exitcode}; the engine stops"
                )
        try:
            others = argument if for_others is None else for_others
            self.comm.broadcast((method, others))
            return getattr(self.driver, method)(argument)
        except BaseException as error:
            # the ranks may be inside this step's collectives: none may run another
            self.failed = True
            self.shutdown()
            if not isinstance(error, Exception):  # KeyboardInterrupt: as itself
                raise
            raise RuntimeError(
                "tensor parallelism: a collective failed, or rank 0's own step raised "
                f"({type(error).__name__}: {error}); a rank that stopped or did not "
                "answer within distributed_timeout fails a collective; the ranks are "
                "stopped"
            ) from error

    def init_kv_cache(self, num_slots: int) -> None:
        self._broadcast_and_run("init_kv_cache", num_slots)

    def execute(self, step):
        """The step's batch, made once here, broadcast, and run by every rank."""
        self.driver._check(step)
        batch = InputBatch.from_step(step, self.driver.block_size)
        # the other ranks' samples are thrown away: they need the arrays, not the
        # requests behind them, nor the penalties' token counts
        no_penalties = replace(
            batch.sampling, repetition_penalty=None, frequency_penalty=None,
            presence_penalty=None, penalty_tokens=None, penalty_slot=None,
        )
        return self._broadcast_and_run(
            "execute_batch", batch,
            replace(batch, sampled_requests=None, sampling=no_penalties),
        )

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (at once after a failure)."""
        if self._stop.detach() is not None:  # not stopped yet
            stop_ranks(self.comm, self.processes, politely=not self.failed)

# %% [markdown]
# ## Two CPU ranks against one
#
# The small random Llama from above, on one rank and then on two processes, the same
# prompts, greedy, with log-probabilities. The all-reduce adds the ranks' partial sums
# in another order than one rank's matrix product does, so the logits may differ in
# their last float32 bits; a token can only change where the two best were that close.

# %%
prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(40, 59))]
greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
runs = {}
for n in (1, 2):
    t0 = time.perf_counter()
    llm = LLM(str(tiny_folder), "cpu", max_num_seqs=4, tensor_parallel_size=n)
    started = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    runs[n] = outs, started, time.perf_counter() - t0
    llm.llm_engine.shutdown()
    print(f"{n} rank(s): up in {started:.1f} s, {len(prompts)} prompts in "
          f"{runs[n][2]:.2f} s")
    for out in outs:
        print("   ", out.outputs[0].token_ids)

# %%
same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs[1][0],
                                                                        runs[2][0])]
gaps = [abs(a.outputs[0].logprobs[t][tok] - b.outputs[0].logprobs[t][tok])
        for a, b in zip(runs[1][0], runs[2][0])
        for t, tok in enumerate(a.outputs[0].token_ids)]
print(f"same tokens: {sum(same)} of {len(same)}; largest |Δ log p| {max(gaps):.1e}")
prose.glue("ch13_same", f"{sum(same)} of {len(same)}")
prose.glue("ch13_gap", f"{max(gaps):.1e}")
prose.glue("ch13_up_2", f"{runs[2][1]:.1f} s")
prose.glue("ch13_gen_1", f"{runs[1][2]:.2f} s")
prose.glue("ch13_gen_2", f"{runs[2][2]:.2f} s")
lost = ("At this size the all-reduces, round trips between processes, cost more "
        "than halving each layer's matrices saves, so splitting them loses; the same "
        "holds for GPUs at batch 1, as the next section counts.")
paid = ("Here the split paid for its all-reduces; the next section counts when it "
        "does on GPUs.")
prose.glue("ch13_cpu_verdict", lost if runs[2][2] > runs[1][2] else paid)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
Two ranks gave one rank's tokens for {{ch13_same}} prompts, and the log-probabilities
of the tokens differ by at most {{ch13_gap}}. The tests hold three ranks on SmolLM2 and
two and four on a random Llama to the same rule, and the GPU model's shards to it in
the CUDA simulator. Starting the second rank took {{ch13_up_2}} (a Python interpreter
importing PyTorch), and the generation took {{ch13_gen_2}} on two ranks against
{{ch13_gen_1}} on one. {{ch13_cpu_verdict}}
""")

# %% [markdown]
# ## What the talk costs
#
# Each all-reduce moves one float32 row of the residual per token: `hidden_size` × 4
# bytes. A step of T tokens makes two all-reduces a layer, and one all-gather of the
# logits, whose rows are `vocab_size` × 4 bytes. For Llama 3.2 1B:

# %%
HIDDEN, VOCAB = llama_1b.hidden_size, llama_1b.vocab_size
num_all_reduces = 2 * llama_1b.num_hidden_layers  # o_proj and down_proj in every layer
row_bytes = HIDDEN * 4  # one token's float32 residual
print(f"per token: {num_all_reduces} all-reduces of {row_bytes / 1024:.0f} KiB, "
      f"and an all-gather of {VOCAB * 4 / 2**20:.2f} MiB of logits")
for batch in (1, 256):
    print(f"batch {batch:>3}: each all-reduce {batch * row_bytes / 1024:8,.0f} KiB, "
          f"{num_all_reduces * batch * row_bytes / 2**20:6.1f} MiB a step")
prose.glue("ch13_num_ar", num_all_reduces)
prose.glue("ch13_row_kib", f"{row_bytes / 1024:.0f} KiB")
prose.glue("ch13_big_mib", f"{256 * row_bytes / 2**20:.0f} MiB")

# %% [markdown]
# A collective between two GPUs costs a fixed latency — the launch, the handshake over
# NVLink, the synchronisation of both GPUs — plus its bytes over the link's bandwidth.
# Neither is measured yet on this book's machines. The prediction below **assumes**
# a small-message NCCL all-reduce latency of 10 to 20 µs between two H200s, and
# NVLink 4's bandwidth of about 450 GB/s each way; the two-GPU issue measures both and
# replaces them. A two-rank ring all-reduce sends each rank's whole buffer once.

# %%
LATENCY_S = (10e-6, 20e-6)  # assumed: a small NCCL all-reduce between two H200s
LINK_GB_S = 450.0  # assumed: NVLink 4, one direction
t_ar = {b: [lat + b * row_bytes / (LINK_GB_S * 1e9) for lat in LATENCY_S]
        for b in (1, 256)}
for b, (lo, hi) in t_ar.items():
    print(f"batch {b:>3}: an all-reduce takes {lo * 1e6:.1f} to {hi * 1e6:.1f} µs, "
          f"bytes {b * row_bytes / (LINK_GB_S * 1e3):.2f} µs of it")
prose.glue("ch13_lat", f"{LATENCY_S[0] * 1e6:.0f} to {LATENCY_S[1] * 1e6:.0f} µs")
prose.glue("ch13_link", f"{LINK_GB_S:.0f} GB/s")
prose.glue("ch13_bytes_us_1", f"{row_bytes / (LINK_GB_S * 1e3):.2f} µs")
prose.glue("ch13_bytes_us_256", f"{256 * row_bytes / (LINK_GB_S * 1e3):.1f} µs")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
At batch 1 an all-reduce's {{ch13_row_kib}} cross the link in {{ch13_bytes_us_1}}: the
collective is all latency, {{ch13_lat}}, whatever the bandwidth. At batch 256 its
{{ch13_big_mib}} take {{ch13_bytes_us_256}} of bandwidth, the same order as the latency:
only there do the bytes start to count.
""")

# %% [markdown]
# Now the prediction. Take chapter 11's measured decode step on one H200. At batch 1,
# split it into the weights' read at the ceiling, which halves on two GPUs, and the rest
# (launches, the sampler, the host), which does not; at batch 256 assume the whole GPU
# part halves except that same fixed rest. Add a step's all-reduces, and the logits'
# all-gather, at the assumed latency and bandwidth. Three more **assumptions**, each of
# which this engine does not meet yet: that every rank replays its steps from CUDA
# graphs, as one GPU does (at tensor_parallel_size > 1 the steps run eagerly today, so
# the two-GPU run will first measure launches); that broadcasting a step's batch from
# rank 0 costs nothing (it is pickled and sent over gloo every step); and that the
# sampler, which every rank runs on the whole gathered logits, halves with the rest.

# %%
def predict_tok_s(step_s: float, split_s: float, batch: int, latency_s: float) -> float:
    """Decode tok/s at two ranks: the split part halves, the rest stays, and every
    collective adds its latency and its bytes over the link.
    """
    gather_bytes = batch * VOCAB * 4 / 2  # each rank sends its half of the logits
    talk = (num_all_reduces * (latency_s + batch * row_bytes / (LINK_GB_S * 1e9))
            + latency_s + gather_bytes / (LINK_GB_S * 1e9))
    return batch / (step_s - split_s / 2 + talk)


one_gpu = {1: float("nan"), 256: float("nan")}  # until chapter 11 is recorded
if ch11:
    one_gpu = {1: ch11["bs1_decode"]["value"], 256: ch11["throughput"]["value"]}
fixed_s = step_ms / 1e3 - floor_ms / 1e3  # batch 1's part that two GPUs do not split
steps = {1: 1 / one_gpu[1], 256: 256 / one_gpu[256]}
split = {1: floor_ms / 1e3, 256: steps[256] - fixed_s}
predicted = {b: [predict_tok_s(steps[b], split[b], b, lat) for lat in LATENCY_S]
             for b in (1, 256)}
fig, axes = new_figure(1, 2, width=8.8, height=3.0)
for ax, b in zip(axes, (1, 256)):
    lo, hi = min(predicted[b]), max(predicted[b])
    ax.bar(["1 GPU\n(measured)"], [one_gpu[b]], color="#7f7f7f")
    ax.bar(["2 GPUs\n(predicted)"], [(lo + hi) / 2], color="#1f77b4",
           yerr=[[(hi - lo) / 2], [(hi - lo) / 2]], capsize=6)
    ax.set_title("decode, batch 1" if b == 1
                 else "256 requests at once (chapter 11's throughput)")
    ax.set_ylabel("tokens / s")
# the two-GPU issue's run, once it is recorded
measured_tp2 = {r["shape"][0]: r["value"]
                for r in load_records("ch13_tensor_parallel")
                if r.get("run") == "tp2_eager"}
for ax, b in zip(axes, (1, 256)):
    if b in measured_tp2:
        ax.bar(["2 GPUs\n(measured)"], [measured_tp2[b]], color="#2ca02c")
fig.suptitle("Llama 3.2 1B on H200s: the latency range is the assumption's", fontsize=9)
plt.show()
for b in (1, 256):
    lo, hi = sorted(predicted[b])
    print(f"batch {b:>3}: one GPU {one_gpu[b]:8,.0f} tok/s; two, predicted "
          f"{lo:8,.0f} to {hi:8,.0f} tok/s ({lo / one_gpu[b]:.2f}x to "
          f"{hi / one_gpu[b]:.2f}x)")
    prose.glue(f"ch13_one_{b}", f"{one_gpu[b]:,.0f} tok/s")
    prose.glue(f"ch13_two_{b}", f"{lo:,.0f} to {hi:,.0f} tok/s")
    prose.glue(f"ch13_x_{b}", f"{lo / one_gpu[b]:.2f}× to {hi / one_gpu[b]:.2f}×")
is_slower_at_1 = max(predicted[1]) < one_gpu[1]
prose.glue("ch13_bs1_verdict", (
    "all-reduces of pure latency take back more than that saves: tensor parallelism "
    "does not make a 1B model's single answer faster" if is_slower_at_1 else
    "all-reduces of pure latency take back much of what that saves"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
At batch 1 one H200 decodes {{ch13_one_1}}; two are predicted at {{ch13_two_1}}, that
is {{ch13_x_1}} one GPU's speed. Half of a small model's weights is read in a fraction
of a millisecond, and {{ch13_num_ar}} {{ch13_bs1_verdict}}. With 256 requests at once
(chapter 11's throughput workload) one GPU makes {{ch13_one_256}}; two are predicted at
{{ch13_two_256}} ({{ch13_x_256}}): there the step is long, the split part dominates,
and the talk is a small tax. Tensor parallelism is for models that do not fit, or
whose steps are long; the larger the model, the more each all-reduce buys. The two-GPU
issue runs the command below and checks these two bars.
""")

# %% [markdown]
# ## On two GPUs: one command
#
# Everything above runs on CPUs and in the simulator; what the GPUs add is NCCL and
# speed. The benchmark script starts the engine at `tensor_parallel_size=2` on
# `device="cuda"`, checks that its greedy tokens are one GPU's, times decode at batch 1
# and the batch-256 throughput workload of chapter 11, and records them under
# `book/data/ch13_tensor_parallel.json` for this page to plot next to the prediction:
#
# ```bash
# python bench/ch13_tensor_parallel.py    # two GPUs; a few minutes
# ```
#
# or, for one answer from the command line,
#
# ```bash
# python -m tinyvllm_lib generate "What is the capital of France?" --chat \
#     --device cuda --tensor-parallel-size 2
# ```
#
# A script that makes its `LLM` with `tensor_parallel_size=2` runs unchanged under
# `torchrun --nproc-per-node 2 script.py` (the tests run it so on CPUs); across
# machines, with torchrun's `--nnodes` and rendezvous flags, it is meant to run the
# same way, but that has not been tried.
#
# It has not been run for this chapter: no machine with two GPUs was at hand. The NCCL
# communicator, the GPU ranks' device selection and the speed are what that run tests.
# Under tensor parallelism the engine runs its steps eagerly for now: capturing a step
# with its collectives in a CUDA graph on every rank is left to the same issue (the
# all-reduce queues on the kernels' stream as a capture needs; the all-gather still
# allocates its staging buffer and a reshaped copy, which a capture cannot hold).
#
# ## Summary
#
# - Megatron's pair — a layer cut by output features, then one cut by input features —
#   needs one all-reduce per pair: two per transformer layer, and a gather of the
#   logits. Every rank owns whole query and KV heads, so N must divide both counts and
#   the MLP's width.
# - The model gets a communicator and a shard; its one layer loop is unchanged. On one
#   rank the communicator does nothing.
# - Rank 0 schedules and broadcasts each step's batch; every rank runs it; gloo's
#   collectives time out, and a lost rank stops the engine with an error and no process
#   left.
# - At batch 1 an all-reduce of a few KiB costs its latency, not its bytes: for a small
#   model two GPUs are predicted slower than one, and faster only where steps are long.
#
# ## Exercises
#
# 1. The residual all-reduced here is float32, four bytes a value. vLLM all-reduces
#    bf16. How many bytes would that save per step at batch 256, and what
#    would it cost in accuracy?
# 2. Split the GPU model's embedding by vocabulary as the NumPy one does: write a lookup
#    kernel that gives zero rows for ids outside its slice. How many bytes of memory
#    does it save on each of two GPUs for Llama 3.2 1B, and what does it add to a step?
# 3. Find the crossover: predict the batch at which two GPUs first beat one for Llama
#    3.2 1B under the assumed latency, then for a model with four times the hidden size.
# 4. Kill a rank (`os.kill(pid, signal.SIGSTOP)`) in the middle of `generate` with
#    `distributed_timeout=5`. How long until the error, and why not at once, as with
#    `SIGKILL`?
