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
# # 2. Safetensors: a model on disk
#
# A Hugging Face model is a folder: a `config.json` that says how big every matrix is,
# and one or more `.safetensors` files that hold the matrices. Before any kernel runs,
# those bytes have to get from the disk into memory — and a file from the internet is
# input you should not trust.
#
# In this chapter you will learn:
#
# - how a safetensors file is laid out: an 8-byte length, a JSON header, one flat block
#   of bytes;
# - how to read it by hand with `mmap` and `np.frombuffer`, copying nothing;
# - which files are malformed, and how to reject exactly the ones the `safetensors`
#   library rejects, with one exception type and a message that names the file, the
#   tensor and the fault;
# - how `config.json` becomes a validated `ModelConfig`, RoPE settings included, and how
#   a model folder (one file or shards) becomes a dict of bf16 weights on the host or
#   the GPU;
# - how many bytes SmolLM2-135M and Llama 3.2 1B weigh, tensor by tensor — the bytes
#   every decoding step has to read.
#
# The weights are bf16, stored as `uint16` bit patterns; [chapter 1](01_bf16.py)
# explained those bits and exported the conversions we use here.

# %%
#| default_exp models.safetensors_io

# %%
import json
import struct
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch

# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
# every file this chapter writes goes here
WORK = Path(tempfile.mkdtemp(prefix="ch02_"))
print("safetensors", safetensors.__version__, "| files in", WORK)

# %% [markdown]
# ## Why a format of its own
#
# `torch.save` stores weights with `pickle`, and unpickling runs whatever code the file
# asks for: loading a downloaded model could run malware. Safetensors stores only data,
# and it puts a small header first, so a reader can list every tensor — name, dtype,
# shape, where its bytes are — without touching the gigabytes behind it. The bytes are
# raw, little-endian, in C order, so the operating system can map the file into memory
# and an array can point straight at it.
#
# ## The layout
#
# ```text
# ┌────────────┬───────────────────────────────┬────────────────────────────────┐
# │ N: u64, LE │ header: N bytes of UTF-8 JSON │ data: the tensors' bytes, back │
# │ (8 bytes)  │ (padded with spaces)          │ to back, no gaps, none after   │
# └────────────┴───────────────────────────────┴────────────────────────────────┘
#  byte 0       byte 8                          byte 8 + N              end of file
# ```
#
# The header is one JSON object. Each key is a tensor name, each value says
# `{"dtype": "BF16", "shape": [1536, 576], "data_offsets": [begin, end]}`, with the
# offsets counted from the start of the data section, `end` exclusive. One optional key,
# `__metadata__`, maps strings to strings (`{"format": "pt"}`). Let us write a file byte
# by byte, with nothing but `struct` and `json`, and let the library read it.


# %%
def pack_safetensors(header: dict, data: bytes, pad_to: int = 8) -> bytes:
    """Assemble a safetensors file: u64 header length, JSON header padded with spaces,
    data.
    """
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + data


weight = np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]], dtype=np.float32)  # (2, 3)
token_ids = np.array([7, 11, 13], dtype=np.int64)  # (3,)
by_hand = pack_safetensors(
    {
        "__metadata__": {"written_by": "chapter 2"},
        "token_ids": {"dtype": "I64", "shape": [3], "data_offsets": [0, 24]},
        "weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 48]},
    },
    token_ids.tobytes() + weight.tobytes(),
)
(WORK / "by_hand.safetensors").write_bytes(by_hand)
header_len = struct.unpack("<Q", by_hand[:8])[0]
print(
    f"{len(by_hand)} bytes: 8 + {header_len} of header + "
    f"{len(by_hand) - 8 - header_len} of data"
)
print(by_hand[8 : 8 + header_len].decode())

theirs = safetensors.numpy.load_file(WORK / "by_hand.safetensors")
assert np.array_equal(theirs["weight"], weight) and np.array_equal(
    theirs["token_ids"], token_ids
)

# %% [markdown]
# ## Dtypes
#
# The library (version 0.8) knows 22 dtype names. Each has a width in bits; the data of
# a tensor with shape $(d_1, \dots, d_k)$ takes exactly
# $\frac{\text{bits}}{8}\prod_i d_i$ bytes (a scalar has shape `[]` and one element; a
# zero in the shape means no bytes). NumPy holds most of them natively. For the rest our
# reader returns the raw bits as unsigned integers of the same width: **BF16 comes back
# as `uint16`**, which is exactly how the rest of the book stores bf16 (view it as
# `ml_dtypes.bfloat16`, or widen it with `bf16_bits_to_f32`, when you want numbers); the
# 8-bit floats come back as `uint8`; the sub-byte formats F4 (two values per byte) and
# F6 (four values in three bytes) come back as a flat `uint8` array of packed bytes.
#
# The reader lives in `tinyvllm_lib.models.safetensors_io`. First its vocabulary: the
# dtypes, the one exception it raises, and what it records per tensor.

# %%
#| export
import json
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_HEADER_SIZE = 100_000_000  # bytes: the library refuses longer headers
# nested objects/arrays the library's JSON parser (serde_json) accepts
MAX_JSON_DEPTH = 127

# safetensors dtype -> (bits per element, the NumPy dtype our arrays have)
# fmt: off
DTYPES = {name: (bits, np.dtype(dtype)) for name, bits, dtype in [
    ("BOOL", 8, "?"), ("U8", 8, "u1"), ("I8", 8, "i1"), ("I16", 16, "<i2"),
    ("U16", 16, "<u2"), ("F16", 16, "<f2"), ("I32", 32, "<i4"), ("U32", 32, "<u4"),
    ("F32", 32, "<f4"), ("C64", 64, "<c8"), ("F64", 64, "<f8"), ("I64", 64, "<i8"),
    ("U64", 64, "<u8"),
    ("BF16", 16, "<u2"),  # raw bf16 bits, as the book stores bf16 everywhere
    ("F8_E4M3", 8, "u1"), ("F8_E5M2", 8, "u1"), ("F8_E8M0", 8, "u1"),
    ("F8_E4M3FNUZ", 8, "u1"),
    ("F8_E5M2FNUZ", 8, "u1"),  # raw fp8 bits
    # packed: a flat array of bytes
    ("F4", 4, "u1"), ("F6_E2M3", 6, "u1"), ("F6_E3M2", 6, "u1"),
]}
# fmt: on


class SafetensorsError(ValueError):
    """A malformed safetensors file; the message names the file, the tensor (if one) and
    the fault.
    """

    def __init__(self, where: str, problem: str, tensor: str | None = None):
        self.where, self.tensor, self.problem = str(where), tensor, problem
        at = f" tensor {tensor!r}:" if tensor is not None else ""
        super().__init__(f"{where}:{at} {problem}")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype, shape and byte span [start, end) inside the data
    section.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


# %%
for name, (bits, dtype) in DTYPES.items():
    print(
        f"{name:12s} {bits:2d} bits -> "
        f"{dtype.name if bits % 8 == 0 else 'packed uint8 bytes'}"
    )


# %% [markdown]
# ## The header is JSON — held to the library's rules
#
# The rule for our reader is the library's: accept exactly the files it accepts. The
# library is written in Rust and parses the header with `serde_json`, which is stricter
# than Python's `json` module in a few places, each of which we found by building a file
# and asking the library (the tests do this for every case):
#
# - `NaN` and `Infinity` are not JSON; numbers too large for a float64 (`1e400`) are
#   errors;
# - integers must fit in 64 bits to be sizes, `-0` counts as a float, and `2.0` is not
#   an integer;
# - a `\ud800` escape that is not half of a surrogate pair is an error;
# - objects and arrays nest at most 127 deep;
# - a repeated field inside a tensor entry (`"dtype"` twice) or a repeated
#   `__metadata__` is an error, but a repeated tensor name is not: the last one wins, as
#   in a Python dict.
#
# `json.loads` has hooks for numbers and objects; we keep objects as lists of pairs, so
# that repeated keys stay visible, and check the rest on the parsed tree.


# %%
#| export
class _Pairs(list):
    """A JSON object kept as its (key, value) pairs, so that repeated keys stay
    visible.
    """


_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:30]}")
    return value


def _json_int(text: str) -> int | float:
    # serde_json reads an integer as u64 or i64 and anything wider as a float; "-0" is a
    # float
    if text == "-0":
        return -0.0
    if len(text) <= 20 and -(2**63) <= (value := int(text)) < 2**64:
        return value
    return _json_float(text)


def _json_constant(text: str):
    raise ValueError(f"{text} is not JSON")


def parse_json(text: str):
    """Parse JSON the way the safetensors library (serde_json) does; objects become
    _Pairs.
    """
    try:
        root = json.loads(
            text,
            object_pairs_hook=_Pairs,
            parse_int=_json_int,
            parse_float=_json_float,
            parse_constant=_json_constant,
        )
    except RecursionError:
        raise ValueError("nesting too deep") from None
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str) and _SURROGATE.search(node):
            raise ValueError("lone surrogate in a \\u escape")
        if isinstance(node, list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nesting deeper than {MAX_JSON_DEPTH}")
            children = (
                [x for pair in node for x in pair] if isinstance(node, _Pairs) else node
            )
            stack += [(child, depth + 1) for child in children]
    return root


# %% [markdown]
# ## Validation
#
# A header that parses is not yet a valid file. Every tensor entry must have the three
# fields with the right types (the library also takes the entry as a 3-element array
# `["F32", [2], [0, 8]]`, and a dtype written as `{"F32": null}` — serde's two ways to
# spell a struct and an enum — so we do too), a dtype from the table, a shape of
# non-negative 64-bit integers. Then the data section: sort the entries by
# `data_offsets` and walk them. Each span must start where the previous one ended (no
# gap, no overlap, the first at 0), must not end before it starts, and must hold exactly
# $\frac{\text{bits}}{8}\prod_i d_i$ bytes (computed without overflowing 64 bits, and a
# whole number of bytes). Finally the last span must end at the last byte of the file:
# nothing missing, nothing after. Entries may come in any order in the JSON, zero-sized
# tensors sit at the same offset as their neighbour, and the padding after the JSON is
# whitespace, which JSON ignores.

# %%
#| export
_FIELDS = ("dtype", "shape", "data_offsets")


def _is_u64(value) -> bool:
    return type(value) is int and 0 <= value < 2**64


def _tensor_info(name: str, raw, where: str) -> TensorInfo:
    """Check one header entry's fields and types (not yet its offsets)."""
    if isinstance(raw, _Pairs):
        found = {}
        for key, value in raw:
            if key in _FIELDS:
                if key in found:
                    raise SafetensorsError(where, f"field {key!r} appears twice", name)
                found[key] = value
        if missing := [f for f in _FIELDS if f not in found]:
            raise SafetensorsError(where, f"missing field {missing[0]!r}", name)
        dtype, shape, offsets = (found[f] for f in _FIELDS)
    elif type(raw) is list and len(raw) == 3:  # serde also reads a struct from an array
        dtype, shape, offsets = raw
    else:
        raise SafetensorsError(
            where, "entry must be an object with dtype, shape and data_offsets", name
        )
    # serde's {"F32": null}
    if isinstance(dtype, _Pairs) and len(dtype) == 1 and dtype[0][1] is None:
        dtype = dtype[0][0]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(where, f"unknown dtype {dtype!r}", name)
    if type(shape) is not list or not all(_is_u64(d) for d in shape):
        raise SafetensorsError(
            where, f"shape must be a list of non-negative integers, got {shape!r}", name
        )
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or not all(_is_u64(o) for o in offsets)
    ):
        raise SafetensorsError(
            where,
            f"data_offsets must be two non-negative integers, got {offsets!r}",
            name,
        )
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_spans(tensors: list[TensorInfo], data_len: int, where: str) -> None:
    """The data section: contiguous spans from 0, each the size its shape and dtype
    need.
    """
    position = 0
    for t in sorted(tensors, key=lambda t: (t.start, t.end)):
        if t.start != position or t.end < t.start:
            if t.start < position:
                fault = (
                    f"overlaps the bytes before {position}, which belong to "
                    "another tensor"
                )
            elif t.start > position:
                fault = f"leaves a gap: no tensor holds bytes {position} to {t.start}"
            else:
                fault = "ends before it starts"
            raise SafetensorsError(
                where, f"data_offsets [{t.start}, {t.end}] {fault}", t.name
            )
        position = t.end
        num_elements = 1
        for d in t.shape:
            num_elements *= d
            if num_elements >= 2**64:
                raise SafetensorsError(
                    where, f"shape {list(t.shape)} overflows 64 bits", t.name
                )
        num_bits = num_elements * DTYPES[t.dtype][0]
        if num_bits >= 2**64:
            raise SafetensorsError(
                where, f"shape {list(t.shape)} overflows 64 bits", t.name
            )
        if num_bits % 8:
            raise SafetensorsError(
                where,
                f"{num_elements} x {t.dtype} is not a whole number of bytes",
                t.name,
            )
        if num_bits // 8 != t.nbytes:
            raise SafetensorsError(
                where,
                f"{t.dtype} {list(t.shape)} needs {num_bits // 8} bytes but "
                f"data_offsets span {t.nbytes}",
                t.name,
            )
    if position < data_len:
        extra = data_len - position
        raise SafetensorsError(
            where,
            f"{extra} byte{'s' * (extra > 1)} after the last tensor's span, held by "
            "no tensor",
        )
    if position > data_len:
        last = max(tensors, key=lambda t: (t.start, t.end)).name
        raise SafetensorsError(
            where,
            f"data_offsets end at {position}, past the {data_len}-byte data section",
            last,
        )


def parse_header(
    buffer, where: str = "<bytes>"
) -> tuple[int, dict[str, TensorInfo], dict[str, str] | None]:
    """Validate a whole safetensors file in `buffer`; return (header length, tensors by
    offset, metadata).
    """
    size = len(buffer)
    if size < 8:
        raise SafetensorsError(
            where, f"file is {size} bytes, too short for the 8-byte header length"
        )
    header_len = int.from_bytes(buffer[:8], "little")
    if header_len > MAX_HEADER_SIZE:
        raise SafetensorsError(
            where,
            f"header length {header_len} is over the {MAX_HEADER_SIZE:,}-byte limit",
        )
    if 8 + header_len > size:
        raise SafetensorsError(
            where,
            f"header length {header_len} runs past the end of the {size}-byte file",
        )
    try:
        text = bytes(buffer[8 : 8 + header_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(
            where, f"header is not UTF-8 ({e.reason} at byte {8 + e.start})"
        ) from None
    try:
        root = parse_json(text)
    except ValueError as e:
        raise SafetensorsError(where, f"header is not valid JSON ({e})") from None
    if not isinstance(root, _Pairs):
        raise SafetensorsError(
            where, f"header must be a JSON object, got {type(root).__name__}"
        )
    tensors, metadata, seen_metadata = {}, None, False
    for key, value in root:
        if key != "__metadata__":
            # a repeated name: the last one wins
            tensors[key] = _tensor_info(key, value, where)
            continue
        if seen_metadata:
            raise SafetensorsError(where, "__metadata__ appears twice")
        seen_metadata = True
        if value is not None and not (
            isinstance(value, _Pairs) and all(isinstance(v, str) for _, v in value)
        ):
            shown = dict(value) if isinstance(value, _Pairs) else value
            raise SafetensorsError(
                where, f"__metadata__ must map strings to strings, got {shown!r:.80}"
            )
        metadata = None if value is None else dict(value)
    _check_spans(list(tensors.values()), size - 8 - header_len, where)
    ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)))
    return header_len, ordered, metadata


# %% [markdown]
# ## Zero-copy reads
#
# With the header validated, a tensor is a window on the file. `mmap` maps the file into
# our address space without reading it; `np.frombuffer(mapping, dtype, count, offset)`
# makes an array that points into that mapping. Nothing is copied and nothing is read
# until someone touches the values — then the operating system pages in just those
# bytes. The arrays are read-only (the mapping is) and keep the mapping alive for as
# long as they live. One corner: an empty tensor may have a shape like `[0, 2**64 - 1]`,
# which the format allows but no NumPy array can have (the library's own NumPy loader
# fails on it too); asking for that tensor raises `SafetensorsError`.
#
# `SafetensorsFile` is the lower-level reader (the folder loader below uses it); the
# package exports the one-call version,
# `load_safetensors(path) -> dict[str, np.ndarray]`.


# %%
#| export
#| public load_safetensors SafetensorsError
class SafetensorsFile:
    """A validated safetensors file mapped into memory; `get(name)` returns zero-copy
    arrays.
    """

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            is_empty = os.fstat(f.fileno()).st_size == 0  # mmap refuses empty files
            buffer = (
                b"" if is_empty else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            )
        self._open(buffer, str(self.path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> "SafetensorsFile":
        """Read a file held in memory (`bytes`, `bytearray`, `memoryview`) without
        copying it.
        """
        self = cls.__new__(cls)
        self.path = None
        self._open(data, name)
        return self

    def _open(self, buffer, where: str) -> None:
        self.buffer, self.where = buffer, where
        header_len, self.header, self.metadata = parse_header(buffer, where)
        self.data_offset = 8 + header_len  # the data section starts here, in file bytes

    def names(self) -> list[str]:
        """Tensor names, in the order of their bytes in the file."""
        return list(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def __len__(self) -> int:
        return len(self.header)

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a read-only array on the file's bytes (BF16 as uint16
        bits).
        """
        if name not in self.header:
            raise KeyError(f"{self.where}: no tensor named {name!r}")
        info = self.header[name]
        bits, dtype = DTYPES[info.dtype]
        offset = self.data_offset + info.start
        array = np.frombuffer(
            self.buffer, dtype, count=info.nbytes // dtype.itemsize, offset=offset
        )
        if bits % 8:
            return array  # sub-byte dtypes stay packed bytes
        try:
            return array.reshape(info.shape)
        # e.g. [0, 2**64 - 1]: valid, empty, too big for NumPy
        except (ValueError, OverflowError):
            raise SafetensorsError(
                self.where,
                f"shape {list(info.shape)} is too large for a NumPy array",
                name,
            ) from None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.buffer = None  # the mapping closes when the last array on it is gone


def load_safetensors(path) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file as zero-copy arrays; raise
    SafetensorsError if malformed.
    """
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.names()}


# %% [markdown]
# Our hand-made file reads back, and the arrays point into the mapping: the first byte
# of `weight` sits exactly `data_offset + 24` bytes after the first byte of the mapping.

# %%
f = SafetensorsFile(WORK / "by_hand.safetensors")
print("header:", f.header)
print("metadata:", f.metadata, "| data starts at byte", f.data_offset)
w = f.get("weight")
base = np.frombuffer(f.buffer, np.uint8).ctypes.data  # address of byte 0 of the mapping
assert w.ctypes.data - base == f.data_offset + 24 and not w.flags.writeable
assert np.array_equal(w, weight) and np.array_equal(f.get("token_ids"), token_ids)
ours = load_safetensors(WORK / "by_hand.safetensors")
assert ours.keys() == theirs.keys() and all(
    np.array_equal(ours[k], theirs[k]) for k in ours
)

# %% [markdown]
# ## Checking against the library
#
# Now a real multi-tensor file written by the library, with the dtypes a checkpoint
# uses: bf16 (through `ml_dtypes.bfloat16`), fp16, fp32, an int64 table, a bool mask, a
# scalar, an empty tensor and an fp8 tensor. The library's NumPy loader cannot return
# bf16 or fp8 arrays, so for those we compare against the raw bytes its `deserialize`
# hands back.

# %%
rng = np.random.default_rng(0)
demo = {
    # (vocab, hidden)
    "embed_tokens.weight": rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16),
    # (hidden, hidden)
    "q_proj.weight": rng.standard_normal((32, 32)).astype(ml_dtypes.bfloat16),
    # (hidden, intermediate)
    "down_proj.weight": rng.standard_normal((32, 48)).astype(np.float16),
    "norm.weight": np.ones(32, np.float32),  # (hidden,)
    "position_ids": np.arange(16, dtype=np.int64),  # (16,)
    "mask": rng.random(24) < 0.5,  # (24,)
    "scale": np.array(0.125, np.float32),  # a scalar: shape []
    "empty": np.zeros((0, 4), np.float32),  # zero elements, zero bytes
    "fp8": rng.standard_normal(8).astype(ml_dtypes.float8_e4m3fn),  # (8,)
}
demo_path = WORK / "demo.safetensors"
safetensors.numpy.save_file(demo, demo_path, metadata={"format": "np"})
mine = SafetensorsFile(demo_path)
raw = dict(safetensors.deserialize(demo_path.read_bytes()))
for name, array in demo.items():
    got = mine.get(name)
    assert (
        raw[name]["dtype"] == mine.header[name].dtype
        and list(got.shape) == raw[name]["shape"]
    )
    assert got.tobytes() == bytes(raw[name]["data"]) == array.tobytes(), name
assert np.array_equal(
    bf16_bits_to_f32(mine.get("q_proj.weight")),
    demo["q_proj.weight"].astype(np.float32),
)
print(f"{len(mine)} tensors agree; the library wrote them in this order:", mine.names())

# %% [markdown]
# The library writes tensors sorted by dtype, widest first, then by name: since the
# header is padded to a multiple of 8 bytes, every tensor then starts at a multiple of
# its own element size, and a reader that maps the file gets aligned arrays.
#
# Malformed files next. Each of these is one small edit of a valid file; the reader must
# say what is wrong, and its verdict must match the library's. (The tests try dozens of
# such files and thousands of random mutations.)


# %%
def library_accepts(data: bytes) -> bool:
    """The safetensors library's verdict on a whole file."""
    try:
        safetensors.deserialize(data)
        return True
    except Exception:
        return False


malformed = {
    "header length past the end": struct.pack("<Q", 1000) + b"{}",
    "header not JSON": pack_safetensors({}, b"")[:8] + b"{,}     ",
    "unknown dtype": pack_safetensors(
        {"t": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)
    ),
    "shape disagrees with span": pack_safetensors(
        {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)
    ),
    "span past the end": pack_safetensors(
        {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)
    ),
    "bytes after the last span": pack_safetensors(
        {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(9)
    ),
    "metadata not strings": pack_safetensors({"__metadata__": {"n": 1}}, b""),
}
for what, data in malformed.items():
    try:
        SafetensorsFile.from_bytes(data, name=what)
        raise AssertionError(f"accepted: {what}")
    except SafetensorsError as e:
        assert not library_accepts(data)
        print(e)

# %% [markdown]
# ## A picture of a file
#
# Here is the demo file drawn to scale: the 8 length bytes, the header, then each
# tensor's span. Even in this toy the header is a visible slice; in a real checkpoint it
# is some kilobytes (about 100 bytes per tensor) in front of gigabytes.


# %%
def draw_layout(ax, sf: SafetensorsFile) -> None:
    """One horizontal bar: the length field, the header, and every tensor's byte
    span.
    """
    spans = [("N", 0, 8, "#444444"), ("header", 8, sf.data_offset, "#bbbbbb")]
    colors = {
        "BF16": "#1f77b4",
        "F16": "#ff7f0e",
        "F32": "#2ca02c",
        "I64": "#9467bd",
        "BOOL": "#8c564b",
    }
    for name, info in sf.header.items():
        start = sf.data_offset + info.start
        label = f"{name}\n{info.dtype} {list(info.shape)}"
        spans.append(
            (label, start, start + info.nbytes, colors.get(info.dtype, "#e377c2"))
        )
    size = len(sf.buffer)
    # labelled above the bar
    small = [span for span in spans if span[2] - span[1] < 0.06 * size]
    text_x = np.linspace(0.04, 0.96, len(small)) * size
    for label, start, end, color in spans:
        ax.barh(0, end - start, left=start, height=0.5, color=color, edgecolor="white")
        if (label, start, end, color) not in small:
            ax.text(
                (start + end) / 2,
                0,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    for x, (label, start, end, _) in zip(text_x, small):
        ax.annotate(
            label,
            ((start + end) / 2, 0.25),
            xytext=(x, 0.75),
            ha="center",
            va="bottom",
            fontsize=7,
            # fmt: skip
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.4"},
        )
    ax.set_xlim(0, size)
    ax.set_ylim(-0.4, 1.3)
    ax.set_yticks([])
    ax.set_xlabel("byte offset in the file")


fig, ax = new_figure(width=10, height=2.6)
draw_layout(ax, mine)
ax.set_title(f"{demo_path.name}: {len(mine.buffer):,} bytes")
plt.show()

# %% [markdown]
# ## config.json
#
# The weights do not say what they mean; `config.json` does. For a Llama model it gives
# the sizes (vocabulary, hidden width, MLP width, layers, query heads and key/value
# heads, head dimension), the RMSNorm epsilon, the longest context, whether the output
# projection reuses the embedding (*tied* embeddings), the special token ids, and the
# RoPE settings. RoPE (chapter 5) comes in every form found in the wild:
#
# - **transformers ≤ 4** writes `"rope_theta": 500000.0` beside
#   `"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
#   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}`;
# - **older files** write the same with `"type": "llama3"`, or
#   `"rope_scaling": null` for plain RoPE;
# - **transformers 5** writes `"rope_parameters": {"rope_type": "llama3",
#   "rope_theta": 500000.0, "factor": 32.0, ...}`, or
#   `{"rope_type": "default", "rope_theta": 10000.0}`.
#
# Only plain (`default`) RoPE and Llama 3's frequency scaling exist in this book; any
# other type (`linear`, `dynamic`, `yarn`, ...) is an error rather than a silently wrong
# model. The end-of-sequence id may be an int or a list, and `generation_config.json`,
# when present, may add more; we keep them all. `ModelConfig` validates itself in
# `__post_init__`, so a config that exists is one the kernels can trust.

# %%
#| export models.config
import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ROPE_TYPES = ("default", "llama3")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _positive(name: str, value, kind=int):
    ok = (
        type(value) is int
        if kind is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not ok or not value > 0:
        raise ValueError(
            f"{name} must be a positive {'integer' if kind is int else 'number'}, "
            f"got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's RoPE frequency scaling (chapter 5): long wavelengths slowed down by
    `factor`.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive(f"rope llama3 {name}", getattr(self, name), float)
        _positive(
            "rope llama3 original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "rope llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


def _token_ids(name: str, value) -> tuple[int, ...]:
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def parse_rope(config: dict) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, Llama 3 scaling or None) from any of the config forms:
    rope_parameters, rope_scaling.
    """
    params = config.get("rope_parameters")
    if params is not None:  # transformers 5
        if not isinstance(params, dict):
            raise ValueError(
                f"rope_parameters must be a dict of RoPE settings, got {params!r:.120}"
            )
        is_per_layer_type = "rope_type" not in params and any(
            isinstance(v, dict) for v in params.values()
        )
        if is_per_layer_type:
            raise ValueError(
                f"per-layer-type RoPE parameters ({', '.join(params)}) are not "
                "supported: Llama has one set"
            )
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    else:  # transformers 4 and older: rope_theta next to rope_scaling
        params = config.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ValueError(
                f"rope_scaling must be null or a dict, got {params!r:.120}"
            )
        theta = config.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE type {rope_type!r}: this book implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    keys = (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    )
    if missing := [k for k in keys if k not in params]:
        raise ValueError(f"rope type llama3 needs {', '.join(missing)}")
    return theta, Llama3RopeScaling(**{k: params[k] for k in keys})


# %%
#| export models.config
@dataclass(frozen=True)
class ModelConfig:
    """A Llama model's shape and constants, validated; from config.json (+
    generation_config.json).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: one KV head per query head
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None  # None: plain RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in _REQUIRED + ("max_position_embeddings",):
            _positive(name, getattr(self, name))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        _positive("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not a multiple of "
                    f"num_attention_heads ({self.num_attention_heads}); give head_dim"
                )
            object.__setattr__(
                self, "head_dim", self.hidden_size // self.num_attention_heads
            )
        _positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim must be even for RoPE's pairs, got {self.head_dim}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            object.__setattr__(
                self, name, float(_positive(name, getattr(self, name), float))
            )
        if type(self.tie_word_embeddings) is not bool:
            raise ValueError(
                "tie_word_embeddings must be true or false, got "
                f"{self.tie_word_embeddings!r}"
            )
        object.__setattr__(
            self, "eos_token_ids", _token_ids("eos_token_id", list(self.eos_token_ids))
        )
        ids = self.eos_token_ids + _token_ids("bos_token_id", self.bos_token_id)
        if any(i >= self.vocab_size for i in ids):
            raise ValueError(
                f"token ids {ids} must be below vocab_size ({self.vocab_size})"
            )
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}"
            )

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else "llama3"

    @classmethod
    def from_dict(
        cls, config: dict, generation_config: dict | None = None
    ) -> "ModelConfig":
        """Build from the dicts in config.json and (optionally)
        generation_config.json.
        """
        if config.get("model_type", "llama") != "llama":
            raise ValueError(
                f"model_type {config['model_type']!r} is not supported: this book "
                "runs Llama models"
            )
        if (
            config.get("hidden_act", "silu") != "silu"
            or config.get("attention_bias")
            or config.get("mlp_bias")
        ):
            raise ValueError("only Llama's SiLU MLP without biases is supported")
        if missing := [k for k in _REQUIRED if k not in config]:
            raise ValueError(f"config is missing {', '.join(missing)}")
        theta, scaling = parse_rope(config)
        eos = _token_ids("eos_token_id", config.get("eos_token_id"))
        extra = _token_ids(
            "generation_config eos_token_id",
            (generation_config or {}).get("eos_token_id"),
        )
        optional = (
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
            "bos_token_id",
        )
        return cls(
            **{k: config[k] for k in _REQUIRED},
            **{k: config[k] for k in optional if config.get(k) is not None},
            rope_theta=theta,
            rope_scaling=scaling,
            # both, in order, once each
            eos_token_ids=tuple(dict.fromkeys(eos + extra)),
            dtype=config.get("dtype") or config.get("torch_dtype") or "bfloat16",
        )

    @classmethod
    def from_folder(cls, path) -> "ModelConfig":
        """Read config.json, and generation_config.json when present, from a model
        folder.
        """
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no config.json")
        dicts = []
        for name in ("config.json", "generation_config.json"):
            file = folder / name
            try:
                dicts.append(
                    json.loads(file.read_text(encoding="utf-8"))
                    if file.is_file()
                    else None
                )
            except ValueError as e:
                raise ValueError(f"{file}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(*dicts)
        except ValueError as e:
            raise ValueError(f"{folder / 'config.json'}: {e}") from None


# %% [markdown]
# The two models of this book, from the values in their `config.json` files (SmolLM2 in
# the transformers-4 form with `rope_scaling: null`, Llama 3.2 1B with Llama 3 scaling):

# %%
# fmt: off
SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    "rope_theta": 100000, "rope_scaling": None, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
LLAMA_32_1B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}
# fmt: on
smollm2 = ModelConfig.from_dict(SMOLLM2_135M)
llama1b = ModelConfig.from_dict(LLAMA_32_1B, {"eos_token_id": [128001, 128008, 128009]})
print(smollm2)
print(llama1b)
assert (
    smollm2.head_dim == 64
    and smollm2.rope_type == "default"
    and llama1b.rope_scaling.factor == 32.0
)
for bad in (
    {**SMOLLM2_135M, "num_key_value_heads": 2},
    {**LLAMA_32_1B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
):
    try:
        ModelConfig.from_dict(bad)
        raise AssertionError("accepted a bad config")
    except ValueError as e:
        print("rejected:", e)

# %% [markdown]
# ## Count before loading
#
# A config is enough to know every tensor of the checkpoint and its shape. With $H$ the
# hidden size, $I$ the MLP width, $V$ the vocabulary, $L$ layers, $n_q$ query heads and
# $n_{kv}$ key/value heads of dimension $d$, a Llama layer holds
#
# $$ \underbrace{H \cdot n_q d}_{q} + \underbrace{2 \cdot H \cdot n_{kv} d}_{k,\,v}
#    + \underbrace{n_q d \cdot H}_{o} + \underbrace{3 \cdot H I}_{\text{gate, up, down}}
#    + \underbrace{2H}_{\text{norms}} $$
#
# parameters, and the model adds the $V \times H$ embedding, a final norm, and a second
# $V \times H$ output matrix unless the embeddings are tied. The function below lists
# the tensors under their Hugging Face names; the loader uses it to check a folder.

# %%
#| export models.loader
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm  # the text bar: tqdm.auto would want ipywidgets in a notebook

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.safetensors_io import SafetensorsFile
from tinyvllm_lib.runtime import can_launch


def llama_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama checkpoint, with the shape the config
    implies.
    """
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            # (out, in), as nn.Linear stores it
            p + "self_attn.q_proj.weight": (q_dim, H),
            p + "self_attn.k_proj.weight": (kv_dim, H),
            p + "self_attn.v_proj.weight": (kv_dim, H),
            p + "self_attn.o_proj.weight": (H, q_dim),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
    shapes["model.norm.weight"] = (H,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


# %% tags=["hide-input"]
def count_table(configs: dict[str, ModelConfig]) -> dict[str, dict[str, int]]:
    """Parameters per kind of tensor, for each model."""
    kinds = {
        "embedding": "embed_tokens",
        "attention q, o": ("q_proj", "o_proj"),
        "attention k, v": ("k_proj", "v_proj"),
        "MLP gate, up, down": "mlp.",
        "RMSNorm weights": "norm",
        "lm_head": "lm_head",
    }
    table = {}
    for model, cfg in configs.items():
        counts = dict.fromkeys(kinds, 0)
        for name, shape in llama_weight_shapes(cfg).items():
            kind = next(
                k
                for k, keys in kinds.items()
                if any(key in name for key in np.atleast_1d(keys))
            )
            counts[kind] += int(np.prod(shape))
        table[model] = counts
    return table


models = {"SmolLM2-135M": smollm2, "Llama 3.2 1B": llama1b}
table = count_table(models)
HBM_BYTES_PER_S = 4.8e12  # an H200's HBM3e bandwidth, the data sheet's number
print(f"{'parameters':22s}" + "".join(f"{m:>16s}" for m in models))
for kind in table["SmolLM2-135M"]:
    print(f"{kind:22s}" + "".join(f"{table[m][kind]:>16,}" for m in models))
totals = {m: sum(table[m].values()) for m in models}
rows = {
    "total parameters": {m: f"{totals[m]:,}" for m in models},
    "bf16 bytes (2/param)": {m: f"{2 * totals[m] / 2**20:,.1f} MiB" for m in models},
    "fp32 bytes (4/param)": {m: f"{4 * totals[m] / 2**20:,.1f} MiB" for m in models},
    "read once at 4.8 TB/s": {
        m: f"{2 * totals[m] / HBM_BYTES_PER_S * 1e3:.3f} ms" for m in models
    },
}
for row, values in rows.items():
    print(f"{row:22s}" + "".join(f"{values[m]:>16s}" for m in models))
assert table["SmolLM2-135M"]["lm_head"] == 0 and 134e6 < totals["SmolLM2-135M"] < 135e6
assert 1.23e9 < totals["Llama 3.2 1B"] < 1.24e9
prose.glue("ch02_smol_mib", f"{2 * totals['SmolLM2-135M'] / 2**20:,.0f} MiB")
prose.glue("ch02_llama_gb", f"{2 * totals['Llama 3.2 1B'] / 1e9:.2f} GB")
prose.glue(
    "ch02_llama_ms", f"{2 * totals['Llama 3.2 1B'] / HBM_BYTES_PER_S * 1e3:.2f} ms"
)
prose.glue(
    "ch02_embed_share",
    f"{table['Llama 3.2 1B']['embedding'] / totals['Llama 3.2 1B']:.0%}",
)

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
In bf16, SmolLM2-135M is {{ch02_smol_mib}} and Llama 3.2 1B is {{ch02_llama_gb}}.
Producing one token reads every weight once (the embedding is the exception: one row per
token — but a tied embedding is read in full as the output projection), so even at the
full 4.8 TB/s of an H200's memory a single sequence cannot decode faster than one token
per {{ch02_llama_ms}} with Llama 3.2 1B. That floor is why batching (chapter 9) matters:
a batch of sequences shares one read of the weights. Note also how big the vocabulary
is: in Llama 3.2 1B the embedding alone is {{ch02_embed_share}} of the parameters, and
tying saves that much again.
""")

# %% [markdown]
# ## Loading a model folder
#
# A folder holds either one `model.safetensors`, or shards
# (`model-00001-of-00002.safetensors`, ...) and a `model.safetensors.index.json` whose
# `weight_map` says which shard holds each tensor. The loader maps every file, checks
# that each tensor the config implies is there with the right shape and a weight dtype
# (BF16, F16 or F32), and returns host arrays in the form asked for: `"bf16"` keeps bf16
# as `uint16` bits (a BF16 tensor stays a zero-copy view of the file; F16 and F32 are
# rounded with chapter 1's `f32_to_bf16_bits`), `"f32"` widens everything to float32
# (the CPU reference path). `weights_to_device` copies bf16 bits to the GPU with
# `numba.cuda.to_device`; it refuses to run where no kernel can.

# %%
#| export models.loader
WEIGHT_DTYPES = ("BF16", "F16", "F32")


def open_checkpoint(folder) -> dict[str, SafetensorsFile]:
    """Map each tensor name to the open file that holds it (model.safetensors or the
    index's shards).
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            assert isinstance(weight_map, dict) and all(
                isinstance(v, str) for v in weight_map.values()
            )
        except (ValueError, KeyError, TypeError, AssertionError):
            raise ValueError(
                f"{index}: needs a 'weight_map' of tensor name -> shard file"
            ) from None
        shards = {
            shard: SafetensorsFile(folder / shard)
            for shard in sorted(set(weight_map.values()))
        }
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise ValueError(
                    f"{folder / shard}: tensor {name!r} is listed in {index.name} "
                    "but missing from the shard"
                )
        return {name: shards[shard] for name, shard in weight_map.items()}
    if (folder / "model.safetensors").is_file():
        single = SafetensorsFile(folder / "model.safetensors")
        return {name: single for name in single.names()}
    raise FileNotFoundError(
        f"{folder}: no model.safetensors or model.safetensors.index.json"
    )


def convert_weight(array: np.ndarray, dtype: str, to: str) -> np.ndarray:
    """A BF16/F16/F32 tensor as bf16 bits (`to="bf16"`, uint16) or float32
    (`to="f32"`).
    """
    if to == "bf16":
        return array if dtype == "BF16" else f32_to_bf16_bits(array.astype(np.float32))
    return (
        bf16_bits_to_f32(array)
        if dtype == "BF16"
        else array.astype(np.float32, copy=False)
    )


def load_weights(
    folder,
    config: ModelConfig | None = None,
    dtype: str = "bf16",
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Read a model folder's weights to host arrays (bf16 bits or float32), checked
    against `config`.
    """
    if dtype not in ("bf16", "f32"):
        raise ValueError(f"dtype must be 'bf16' (uint16 bits) or 'f32', got {dtype!r}")
    files = open_checkpoint(folder)
    expected = (
        llama_weight_shapes(config) if config is not None else {n: None for n in files}
    )
    if missing := [name for name in expected if name not in files]:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{folder}: tensor {missing[0]!r} is missing{more}")
    weights = {}
    total = sum(files[name].header[name].nbytes for name in expected)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading weights",
        disable=not progress,
    ) as bar:
        for name, shape in expected.items():
            info = files[name].header[name]
            if info.dtype not in WEIGHT_DTYPES:
                raise ValueError(
                    f"{files[name].where}: tensor {name!r} has dtype {info.dtype}; "
                    "weights must be BF16, F16 or F32"
                )
            if shape is not None and info.shape != shape:
                raise ValueError(
                    f"{files[name].where}: tensor {name!r} has shape "
                    f"{list(info.shape)}, the config implies {list(shape)}"
                )
            weights[name] = convert_weight(files[name].get(name), info.dtype, dtype)
            bar.update(info.nbytes)
    return weights


def weights_to_device(weights: dict[str, np.ndarray], progress: bool = True) -> dict:
    """Copy host weights to GPU buffers kept as bf16 bits (uint16); needs a GPU or the
    simulator.
    """
    if not can_launch():
        raise RuntimeError(
            "no CUDA GPU and NUMBA_ENABLE_CUDASIM is not set: keep the weights on "
            "the host"
        )
    from numba import cuda

    device = {}
    for name, array in tqdm(
        weights.items(), desc="copying to the GPU", unit="tensor", disable=not progress
    ):
        if array.dtype not in (np.uint16, np.float16, np.float32):
            raise ValueError(
                f"tensor {name!r} has dtype {array.dtype}; expected bf16 bits "
                "(uint16), float16 or float32"
            )
        bits = (
            array
            if array.dtype == np.uint16
            else f32_to_bf16_bits(array.astype(np.float32))
        )
        device[name] = cuda.to_device(np.ascontiguousarray(bits))
    return device


# %% [markdown]
# To try it, a tiny random Llama written the way Hugging Face writes big ones: two
# shards and an index. (The real SmolLM2 folder arrives in chapter 2b.)

# %%
tiny = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
folder = WORK / "tiny-llama"
folder.mkdir()
(folder / "config.json").write_text(
    json.dumps(
        {
            **{
                k: getattr(tiny, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "tie_word_embeddings",
                )
            },
            "model_type": "llama",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    )
)
tensors = {
    name: rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    for name, shape in llama_weight_shapes(tiny).items()
}
names = list(tensors)
shards = {
    "model-00001-of-00002.safetensors": names[: len(names) // 2],
    "model-00002-of-00002.safetensors": names[len(names) // 2 :],
}
for shard, members in shards.items():
    safetensors.numpy.save_file({n: tensors[n] for n in members}, folder / shard)
index = {
    "metadata": {},
    "weight_map": {n: shard for shard, members in shards.items() for n in members},
}
(folder / "model.safetensors.index.json").write_text(json.dumps(index))

config = ModelConfig.from_folder(folder)
assert config == tiny
start = time.perf_counter()
host = load_weights(folder, config, dtype="bf16", progress=False)
print(f"loaded {len(host)} tensors in {1e3 * (time.perf_counter() - start):.1f} ms")
assert all(np.array_equal(host[n], tensors[n].view(np.uint16)) for n in tensors)
as_f32 = load_weights(folder, config, dtype="f32", progress=False)
assert all(np.array_equal(as_f32[n], tensors[n].astype(np.float32)) for n in tensors)
if can_launch():
    on_device = weights_to_device(
        {"model.norm.weight": host["model.norm.weight"]}, progress=False
    )
    assert np.array_equal(
        on_device["model.norm.weight"].copy_to_host(), host["model.norm.weight"]
    )
    print(
        "copied to",
        "the simulator"
        if "Fake" in type(on_device["model.norm.weight"]).__name__
        else "the GPU",
    )

# %% [markdown]
# ## Summary
#
# - A safetensors file is an 8-byte little-endian length $N$, $N$ bytes of JSON (name →
#   dtype, shape, byte span; plus string metadata), and the tensors' bytes back to back.
# - Our reader validates everything the library validates — header length, UTF-8, strict
#   JSON, dtypes, shapes against spans, contiguous spans from 0 to the last byte,
#   metadata types — and reports any fault as one `SafetensorsError` naming file, tensor
#   and fault.
# - `mmap` + `np.frombuffer` give arrays on the file's bytes: nothing is copied until
#   touched. BF16 stays `uint16` bits.
# - `config.json` becomes a validated `ModelConfig`; RoPE comes in three spellings, of
#   which two types (plain and Llama 3) are supported, the rest rejected loudly.
# - The config alone tells us every tensor and its size: counting them says what one
#   decoded token costs in memory traffic before we write a kernel.
#
# Exported to `tinyvllm_lib`: `models.safetensors_io` (`SafetensorsFile`,
# `parse_header`, `load_safetensors`, `SafetensorsError`, the `DTYPES` table),
# `models.config` (`ModelConfig`, `Llama3RopeScaling`, `parse_rope`) and `models.loader`
# (`llama_weight_shapes`, `open_checkpoint`, `load_weights`, `weights_to_device`);
# `load_safetensors` and `SafetensorsError` also from the package's top level.
#
# ## Exercises
#
# 1. Llama 3.2 1B ties its embeddings. Predict how many bytes an untied copy would add,
#    then check with `llama_weight_shapes`. What fraction of the decode-step floor is
#    that?
# 2. Store Llama 3.2 1B's weights in fp8 (`F8_E4M3`, one byte each) instead of bf16:
#    what is the new floor per decoded token on a 4.8 TB/s GPU? What else would a kernel
#    have to read?
# 3. Write a 200 MB file with `safetensors.numpy.save_file`, then time
#    `load_safetensors` and `np.fromfile` on it, and the sum of one tensor after each.
#    Explain the first pair of numbers with what `mmap` does, and the second pair with
#    page faults.
# 4. Flip one byte at every position of `by_hand.safetensors` in turn. Which positions
#    does the library still accept, and why can the format not notice? Estimate what a
#    CRC32 of the data section would cost to check for Llama 3.2 1B at 10 GB/s.
# 5. Pad the header of a file with 10,000 spaces instead of at most 7. Does it still
#    load? Where does the 100,000,000-byte header limit come from, and how many tensor
#    entries of about 100 bytes does it allow?
