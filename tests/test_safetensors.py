"""The safetensors reader against the safetensors library: malformed files, random mutations, real
files; and the model-folder loader (chapters/02_safetensors.py)."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyvllm_lib.models.loader as loader
from tinyvllm_lib import SafetensorsError, load_safetensors
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import (
    llama_weight_shapes,
    load_weights,
    weights_to_device,
)
from tinyvllm_lib.models.safetensors_io import DTYPES, SafetensorsFile
from tinyvllm_lib.runtime import can_launch


def pack(header, data: bytes = b"", pad_to: int = 8) -> bytes:
    """A safetensors file: u64 length, the header (a dict, or raw JSON text/bytes) padded with spaces, data."""
    text = (
        header
        if isinstance(header, bytes)
        else header.encode()
        if isinstance(header, str)
        else json.dumps(header).encode()
    )
    text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype="F32", shape=(2,), start=0, end=8) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}


T = '"dtype":"F32","shape":[2],"data_offsets":[0,8]'  # a valid entry as JSON text, for raw headers
Z8 = bytes(8)

# name: (file, words the message must contain, the tensor it must name or None)
MALFORMED = {
    "empty file": (b"", "too short", None),
    "shorter than the length field": (b"\x02\x00\x00", "too short", None),
    "header length past the end": (struct.pack("<Q", 64) + b"{}", "past the end", None),
    "header length over the limit": (struct.pack("<Q", 100_000_001) + b"{}", "limit", None),
    "header length 2**64 - 1": ((2**64 - 1).to_bytes(8, "little") + b"{}", "limit", None),
    "empty header": (struct.pack("<Q", 0), "JSON", None),
    "invalid UTF-8": (pack(b'{"t\xff":{}}'), "UTF-8", None),
    "truncated JSON": (pack('{"t":'), "JSON", None),
    "NUL padding": (pack(b"{}\0\0\0\0\0\0"), "JSON", None),
    "byte order mark": (pack("\ufeff{}"), "JSON", None),
    "NaN in an ignored field": (pack('{"t":{%s,"x":NaN}}' % T, Z8), "JSON", None),
    "number out of range": (pack('{"t":{%s,"x":1e400}}' % T, Z8), "out of range", None),
    "400-digit integer": (pack('{"t":{%s,"x":%s}}' % (T, "9" * 400), Z8), "out of range", None),
    "lone surrogate": (pack('{"__metadata__":{"a":"\\ud800"},"t":{%s}}' % T, Z8), "surrogate", None),
    "nesting 128 deep": (pack('{"t":{%s,"x":%s%s}}' % (T, "[" * 126, "]" * 126), Z8), "nesting", None),
    "header is an array": (pack("[]"), "object", None),
    "unknown dtype": (pack({"t": entry("F33")}, Z8), "unknown dtype", "t"),
    "lower-case dtype": (pack({"t": entry("f32")}, Z8), "unknown dtype", "t"),
    "dtype null": (pack({"t": {**entry(), "dtype": None}}, Z8), "unknown dtype", "t"),
    "dtype map with a value": (pack({"t": {**entry(), "dtype": {"F32": 1}}}, Z8), "unknown dtype", "t"),
    "missing data_offsets": (pack({"t": {"dtype": "F32", "shape": [2]}}, Z8), "missing field 'data_offsets'", "t"),
    "repeated dtype field": (pack('{"t":{%s,"dtype":"F32"}}' % T, Z8), "twice", "t"),
    "repeated __metadata__": (pack('{"__metadata__":{},"__metadata__":{},"t":{%s}}' % T, Z8), "twice", None),
    "shape a string": (pack({"t": {**entry(), "shape": "2"}}, Z8), "shape", "t"),
    "negative dimension": (pack({"t": entry(shape=(-2,))}, Z8), "shape", "t"),
    "float dimension": (pack({"t": entry(shape=(2.0,))}, Z8), "shape", "t"),
    "bool dimension": (pack({"t": entry(shape=(True,), end=4)}, bytes(4)), "shape", "t"),
    "dimension 2**64": (pack({"t": entry(shape=(2**64, 0), end=0)}), "shape", "t"),
    "offset -0": (pack('{"t":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', Z8), "data_offsets", "t"),
    "offset 8.0": (pack('{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}', Z8), "data_offsets", "t"),
    "three offsets": (pack({"t": {**entry(), "data_offsets": [0, 8, 8]}}, Z8), "data_offsets", "t"),
    "entry as a 2-element array": (pack({"t": ["F32", [2]]}, Z8), "entry must be", "t"),
    "entry null": (pack({"t": None}), "entry must be", "t"),
    "shape x dtype more than the span": (pack({"t": entry(shape=(3,))}, Z8), "needs 12 bytes", "t"),
    "shape x dtype less than the span": (pack({"t": entry("F64")}, Z8), "needs 16 bytes", "t"),
    "F4 odd element count": (pack({"t": entry("F4", (3,), 0, 2)}, bytes(2)), "whole number of bytes", "t"),
    "shape overflows 64 bits": (pack({"t": entry(shape=(2**63, 4, 0), end=0)}), "overflows", "t"),
    "span past the end of the file": (pack({"t": entry(shape=(4,), end=16)}, Z8), "past the 8-byte", "t"),
    "offsets end before start": (
        pack({"t": entry(shape=(0,), start=0, end=0), "u": entry(shape=(0,), start=8, end=0)}, Z8),
        "gap",
        "u",
    ),
    "span ends before it starts": (
        pack({"t": entry(shape=(2,)), "u": entry(shape=(0,), start=8, end=4)}, Z8),
        "ends before it starts",
        "u",
    ),
    "overlapping spans": (pack({"a": entry(), "b": entry(start=4, end=12)}, bytes(12)), "overlaps", "b"),
    "gap between spans": (pack({"a": entry(), "b": entry(start=12, end=20)}, bytes(20)), "gap", "b"),
    "first span not at 0": (pack({"a": entry(start=4, end=12)}, bytes(12)), "gap", "a"),
    "same span twice": (pack({"a": entry(), "b": entry()}, Z8), "overlaps", "b"),
    "bytes after the last span": (pack({"t": entry()}, bytes(9)), "1 byte after", None),
    "data but no tensors": (pack({}, Z8), "8 bytes after", None),
    "metadata value not a string": (pack({"__metadata__": {"n": 1}}), "strings to strings", None),
    "metadata value null": (pack({"__metadata__": {"n": None}}), "strings to strings", None),
    "metadata a list": (pack({"__metadata__": [["a", "b"]]}), "strings to strings", None),
    "metadata key without its tensor fields": (
        pack('{"__metadata__x":{"a":"b"},"t":{%s}}' % T, Z8),
        "missing field",
        "__metadata__x",
    ),
    "repeated tensor, the first invalid": (
        pack('{"t":{"dtype":"XX","shape":[2],"data_offsets":[0,8]},"t":{%s}}' % T, Z8),
        "unknown dtype",
        "t",
    ),
}

EVERY_DTYPE = {f"t_{name}": (name, (8,) if bits >= 8 else (4,)) for name, (bits, _) in DTYPES.items()}


def _every_dtype_file() -> bytes:
    header, offset = {}, 0
    for name, (dtype, shape) in EVERY_DTYPE.items():
        size = DTYPES[dtype][0] * int(np.prod(shape)) // 8
        header[name] = entry(dtype, shape, offset, offset + size)
        offset += size
    return pack(header, bytes((7 * i) % 256 for i in range(offset)))


ACCEPTED = {
    "plain": pack({"t": entry()}, np.arange(2, dtype="<f4").tobytes()),
    "entries out of order": pack({"b": entry(start=8, end=16), "a": entry()}, np.arange(4, dtype="<f4").tobytes()),
    "header padded with many spaces": pack({"t": entry()}, Z8, pad_to=4096),
    "unpadded header": pack({"t": entry()}, Z8, pad_to=1),
    "whitespace around the JSON": pack(' \n\t{"t":{%s}}\r\n ' % T, Z8),
    "zero-sized tensor": pack({"e": entry(shape=(0, 3), start=0, end=0), "t": entry()}, Z8),
    "two zero-sized tensors at one offset": pack(
        {"a": entry(shape=(0,), start=8, end=8), "b": entry(shape=(5, 0), start=8, end=8), "t": entry()}, Z8
    ),
    "scalar": pack({"s": entry(shape=(), end=4)}, struct.pack("<f", 1.5)),
    "no tensors": pack({}),
    "only metadata": pack({"__metadata__": {"format": "pt"}}),
    "metadata null": pack({"__metadata__": None, "t": entry()}, Z8),
    "repeated metadata key, last wins": pack('{"__metadata__":{"a":"1","a":"2"}}'),
    "repeated tensor name, last wins": pack('{"t":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},"t":{%s}}' % T, Z8),
    "extra fields ignored": pack('{"t":{%s,"x":[1,{"y":null}],"z":-1e300,"w":-99999999999999999999999}}' % T, Z8),
    "repeated ignored field": pack('{"t":{%s,"x":1,"x":{"y":1,"y":2}}}' % T, Z8),
    "nesting 127 deep": pack('{"t":{%s,"x":%s%s}}' % (T, "[" * 125, "]" * 125), Z8),
    "entry as a 3-element array": pack({"t": ["F32", [2], [0, 8]]}, Z8),
    "dtype written as {F32: null}": pack({"t": {**entry(), "dtype": {"F32": None}}}, Z8),
    "escaped key names __metadata__": pack('{"\\u005f_metadata__":{"a":"b"},"t":{%s}}' % T, Z8),
    "surrogate pair in a name": pack('{"\\ud83d\\ude00":{%s}}' % T, Z8),
    "empty tensor name": pack({"": entry()}, Z8),
    "huge dimensions after a zero": pack({"t": entry(shape=(0, 2**64 - 1, 2**64 - 1), end=0)}),
    "F4 with an even element count": pack({"t": entry("F4", (2, 3), 0, 3)}, b"\x12\x34\x56"),
    "F6 four elements in three bytes": pack({"t": entry("F6_E3M2", (4,), 0, 3)}, b"\x12\x34\x56"),
    "every dtype": _every_dtype_file(),
}


def library_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
        return True
    except Exception:
        return False


def read_all(data: bytes, name: str = "<fuzz>") -> tuple[list[str], dict[str, np.ndarray]] | None:
    """Our verdict: (names, arrays), or None for SafetensorsError (any other exception fails the test)."""
    try:
        f = SafetensorsFile.from_bytes(data, name)
    except SafetensorsError:
        return None
    arrays = get_all(f)
    assert_inside_data_section(arrays, data, f.data_offset)
    return f.names(), arrays


def assert_inside_data_section(arrays: dict[str, np.ndarray], data, data_offset: int) -> None:
    """Every array's memory lies within the data section of `data`, and none can be written."""
    base = np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
    for name, a in arrays.items():
        assert not a.flags.writeable, name
        if a.nbytes:
            start = a.__array_interface__["data"][0]
            assert base + data_offset <= start and start + a.nbytes <= base + len(data), name


def numpy_can_hold(shape) -> bool:
    """False for the valid empty shapes no NumPy array can have, like (0, 2**64 - 1)."""
    if 0 not in shape:
        return True  # the file holds all its bytes, so it is small
    try:
        np.empty(shape, np.uint8)
        return True
    except (ValueError, OverflowError):
        return False


def assert_same_as_library(arrays: dict[str, np.ndarray], data: bytes, names=None) -> None:
    """Same names as the library finds (`names`, else the arrays'), and the same bytes and shapes."""
    theirs = dict(safetensors.deserialize(data))
    assert set(arrays if names is None else names) == theirs.keys()
    for name, a in arrays.items():
        assert a.tobytes() == bytes(theirs[name]["data"]), name
        if DTYPES[theirs[name]["dtype"]][0] % 8 == 0:
            assert list(a.shape) == theirs[name]["shape"], name


def get_all(f: SafetensorsFile) -> dict[str, np.ndarray]:
    """Every tensor of an accepted file but those NumPy cannot hold, which must (and may only) fail."""
    arrays = {}
    for name in f.names():
        if numpy_can_hold(f.header[name].shape):
            arrays[name] = f.get(name)
        else:
            with pytest.raises(SafetensorsError, match="too large for a NumPy array"):
                f.get(name)
    return arrays


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_file_is_rejected_with_a_clear_message(case):
    data, words, tensor = MALFORMED[case]
    with pytest.raises(SafetensorsError) as info:
        SafetensorsFile.from_bytes(data, name=case)
    message = str(info.value)
    assert message.startswith(case + ":") and words in message, message
    assert info.value.tensor == tensor, message
    if tensor is not None:
        assert repr(tensor) in message


def test_error_names_the_file_and_is_a_value_error(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(MALFORMED["overlapping spans"][0])
    with pytest.raises(ValueError, match=r"broken\.safetensors: tensor 'b': .*overlaps"):
        load_safetensors(path)


@pytest.mark.parametrize("case", list(MALFORMED) + list(ACCEPTED))
def test_verdict_matches_the_library(case, tmp_path):
    data = MALFORMED[case][0] if case in MALFORMED else ACCEPTED[case]
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    try:
        safetensors.safe_open(path, "np").keys()
        library_file_verdict = True
    except Exception:
        library_file_verdict = False
    assert library_accepts(data) == library_file_verdict == (case in ACCEPTED)
    try:
        f = SafetensorsFile(path)
    except SafetensorsError:
        assert case in MALFORMED
    else:
        assert case in ACCEPTED
        assert_same_as_library(get_all(f), data, f.names())


def test_an_empty_tensor_numpy_cannot_hold():
    data = ACCEPTED["huge dimensions after a zero"]
    f = SafetensorsFile.from_bytes(data, "huge.safetensors")  # the file is valid ...
    assert f.header["t"].shape == (0, 2**64 - 1, 2**64 - 1)
    with pytest.raises(SafetensorsError, match=r"huge.safetensors: tensor 't': shape .* too large for a NumPy array"):
        f.get("t")  # ... but no NumPy array has that shape
    with pytest.raises(ValueError):
        safetensors.numpy.load(data)  # nor can the library make one


def test_every_dtype_the_library_knows_is_read():
    f = SafetensorsFile.from_bytes(ACCEPTED["every dtype"])
    assert set(f.names()) == set(EVERY_DTYPE) and len(DTYPES) == 22
    assert f.get("t_BF16").dtype == np.uint16 and f.get("t_F8_E4M3").dtype == np.uint8
    assert f.get("t_F4").shape == (2,) and f.get("t_F6_E2M3").shape == (3,)  # packed bytes
    assert f.get("t_C64").dtype == np.complex64 and f.get("t_BOOL").dtype == np.bool_


def test_reader_agrees_with_the_library_on_a_real_file(tmp_path, rng):
    tensors = {
        "embed.weight": rng.standard_normal((33, 17)).astype(ml_dtypes.bfloat16),  # (vocab, hidden)
        "proj.weight": rng.standard_normal((17, 5)).astype(np.float16),
        "norm.weight": rng.standard_normal(17).astype(np.float32),
        "f64": rng.standard_normal((3, 2, 2)),
        "i8": rng.integers(-128, 128, 7).astype(np.int8),
        "u8": rng.integers(0, 256, 9).astype(np.uint8),
        "i16": rng.integers(-999, 999, 3).astype(np.int16),
        "u16": rng.integers(0, 9999, 3).astype(np.uint16),
        "i32": rng.integers(-(2**31), 2**31, 5).astype(np.int32),
        "u32": rng.integers(0, 2**32, 5).astype(np.uint32),
        "i64": rng.integers(-(2**62), 2**62, 4),
        "u64": rng.integers(0, 2**63, 4).astype(np.uint64),
        "c64": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
        "mask": rng.random(11) < 0.5,
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float16),
        "e4m3": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
        "e5m2": rng.standard_normal(6).astype(ml_dtypes.float8_e5m2),
    }
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata={"format": "np", "note": "ü"})
    ours = SafetensorsFile(path)
    assert ours.metadata == {"format": "np", "note": "ü"} and set(ours.names()) == set(tensors)
    with safetensors.safe_open(path, "np") as theirs:
        for name, array in tensors.items():
            got = ours.get(name)
            assert got.shape == array.shape and got.tobytes() == array.tobytes(), name
            if array.dtype.type.__module__ == "numpy":  # types the library's NumPy loader can return
                want = theirs.get_tensor(name)
                assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert np.array_equal(ours.get("embed.weight").view(ml_dtypes.bfloat16), tensors["embed.weight"])
    assert_same_as_library(load_safetensors(path), path.read_bytes())
    # zero-copy: every array is a window on the one mapping of the file
    assert_inside_data_section({n: ours.get(n) for n in ours.names()}, ours.buffer, ours.data_offset)


# --- random mutations of a valid file --------------------------------------------------------

BASE = pack(
    {
        "__metadata__": {"format": "pt"},
        "embed": entry("BF16", (2, 3), 0, 12),
        "norm": entry("F32", (2,), 12, 20),
        "scale": entry("F16", (), 20, 22),
        "empty": entry("I64", (0,), 22, 22),
        "ids": entry("U8", (2,), 22, 24),
    },
    bytes(range(1, 25)),
)
HEADER = json.loads(BASE[8 : 8 + struct.unpack("<Q", BASE[:8])[0]])
FUZZ = settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def check(data: bytes) -> None:
    result = read_all(data)
    assert (result is not None) == library_accepts(data), data[:400]
    if result is not None:
        assert_same_as_library(result[1], data, result[0])


@st.composite
def byte_mutations(draw) -> bytes:
    data = bytearray(BASE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "length"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[i] = draw(st.sampled_from(b' "{}[],:-.0123456789eE\\u\x00\xff'))
        elif kind == "truncate":
            del data[i:]
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del data[i : i + draw(st.integers(1, 4))]
        elif kind == "length" and len(data) >= 8:
            n = int.from_bytes(data[:8], "little") + draw(st.integers(-16, 16))
            data[:8] = (n % 2**64).to_bytes(8, "little")
    return bytes(data)


SAME_WIDTH = {bits: sorted(n for n, (b, _) in DTYPES.items() if b == bits) for bits in (8, 16, 32)}


@st.composite
def header_edits(draw) -> bytes:
    """Edits of the parsed header, some that keep the file valid (reshape, same-width dtype, reorder)."""
    header = json.loads(json.dumps(HEADER))
    names = [n for n in header if n != "__metadata__"]
    values = st.one_of(
        st.integers(-3, 40),
        st.sampled_from([None, 2.0, -0.0, True, "F32", "BF16", "F8_E5M2", "F4", "x", 2**64, 2**64 - 1]),
        st.lists(st.integers(0, 30), max_size=3),
    )
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names + ["__metadata__", "new"]))
        kind = draw(st.sampled_from(["offset", "reshape", "shape", "same_width", "dtype", "drop", "field", "replace"]))
        target = header.setdefault(name, {}) if name != "__metadata__" or kind == "replace" else header["__metadata__"]
        if kind == "replace":
            header[name] = draw(values)
        elif not isinstance(target, dict):
            continue
        elif kind == "offset" and isinstance(target.get("data_offsets"), list) and len(target["data_offsets"]) == 2:
            i = draw(st.integers(0, 1))
            old = target["data_offsets"][i]
            target["data_offsets"][i] = draw(st.integers(-8, 8)) + (old if type(old) is int else 0)
        elif (
            kind == "reshape" and isinstance(target.get("shape"), list) and all(type(d) is int for d in target["shape"])
        ):
            size = int(np.prod(target["shape"]))  # same number of elements, another shape
            target["shape"] = draw(
                st.sampled_from([[size], [1, size], [size, 1], [], [0]] + ([[size // 2, 2]] if size % 2 == 0 else []))
            )
        elif kind == "shape":
            target["shape"] = draw(st.lists(st.integers(0, 7), max_size=3))
        elif (
            kind == "same_width"
            and isinstance(target.get("dtype"), str)
            and target["dtype"] in DTYPES
            and DTYPES[target["dtype"]][0] in SAME_WIDTH
        ):
            target["dtype"] = draw(st.sampled_from(SAME_WIDTH[DTYPES[target["dtype"]][0]]))
        elif kind == "dtype":
            target["dtype"] = draw(st.sampled_from(sorted(DTYPES) + ["F33", "bf16"]))
        elif kind == "drop" and target:
            del target[draw(st.sampled_from(sorted(target)))]
        elif kind == "field":
            target[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "format"]))] = draw(values)
    if not header.get("new"):
        header.pop("new", None)
    items = draw(st.permutations(list(header.items())))  # entry order never matters
    data_len = draw(st.one_of(st.just(24), st.integers(0, 40)))
    return pack(json.dumps(dict(items)), bytes(range(data_len)), pad_to=draw(st.sampled_from([1, 8, 64])))


@st.composite
def text_edits(draw) -> bytes:
    text = json.dumps(HEADER, separators=(",", ":"))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 6)))
        new = draw(st.text(alphabet='{}[]":,. -+0123456789eEnulltrueNaN\\ud800F32', max_size=6))
        text = text[:i] + new + text[j:]
    return pack(text.encode("utf-8", "surrogatepass"), bytes(range(1, 25)), pad_to=1)


@FUZZ
@given(byte_mutations())
def test_fuzz_byte_mutations(data):
    check(data)


@FUZZ
@given(header_edits())
def test_fuzz_header_edits(data):
    check(data)


@FUZZ
@given(text_edits())
def test_fuzz_header_text_edits(data):
    check(data)


# --- the model-folder loader -----------------------------------------------------------------

TINY = ModelConfig(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def write_folder(folder, tensors: dict, shards: int = 1):
    """A Hugging Face-style folder: model.safetensors, or shards and model.safetensors.index.json."""
    folder.mkdir(exist_ok=True)
    if shards == 1:
        safetensors.numpy.save_file(tensors, folder / "model.safetensors")
        return folder
    names, weight_map = list(tensors), {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        members = names[k::shards]
        safetensors.numpy.save_file({n: tensors[n] for n in members}, folder / shard)
        weight_map |= dict.fromkeys(members, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def random_weights(rng, dtype=ml_dtypes.bfloat16) -> dict:
    return {n: rng.standard_normal(s).astype(dtype) for n, s in llama_weight_shapes(TINY).items()}


@pytest.mark.parametrize("shards", [1, 3])
def test_load_weights_single_file_and_shards(tmp_path, rng, shards):
    tensors = random_weights(rng)
    folder = write_folder(tmp_path / "m", tensors, shards)
    bits = load_weights(folder, TINY, dtype="bf16", progress=True)
    f32 = load_weights(folder, TINY, dtype="f32", progress=False)
    assert bits.keys() == f32.keys() == tensors.keys()
    for n, t in tensors.items():
        assert bits[n].dtype == np.uint16 and np.array_equal(bits[n], t.view(np.uint16)), n
        assert f32[n].dtype == np.float32 and np.array_equal(f32[n], t.astype(np.float32)), n
    assert load_weights(folder, progress=False).keys() == tensors.keys()  # no config: every tensor


@pytest.mark.parametrize("stored", [np.float16, np.float32])
def test_f16_and_f32_weights_are_rounded_to_bf16(tmp_path, rng, stored):
    tensors = random_weights(rng, stored)
    tensors["model.norm.weight"][:3] = [np.nan, np.inf, 1 + 2**-8]  # NaN, inf and a tie
    bits = load_weights(write_folder(tmp_path / "m", tensors), TINY, progress=False)
    for n, t in tensors.items():
        assert np.array_equal(bits[n], f32_to_bf16_bits(t.astype(np.float32))), n
        assert np.array_equal(bits[n], t.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)), n


def test_missing_tensor_is_named(tmp_path, rng):
    tensors = random_weights(rng)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        load_weights(write_folder(tmp_path / "m", tensors), TINY, progress=False)


def test_unsupported_dtype_is_named(tmp_path, rng):
    tensors = random_weights(rng)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(
        ValueError, match=r"tensor 'model.norm.weight' has dtype F8_E4M3; weights must be BF16, F16 or F32"
    ):
        load_weights(write_folder(tmp_path / "m", tensors), TINY, progress=False)


def test_wrong_shape_is_named(tmp_path, rng):
    tensors = random_weights(rng)
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 16\], the config implies \[8, 16\]"
    ):
        load_weights(write_folder(tmp_path / "m", tensors), TINY, progress=False)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path, rng):
    folder = write_folder(tmp_path / "m", random_weights(rng), shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"tensor 'ghost.weight' is listed in model.safetensors.index.json but missing"
    ):
        load_weights(folder, TINY, progress=False)
    (folder / "model.safetensors.index.json").write_text('{"weights": {}}')
    with pytest.raises(ValueError, match="weight_map"):
        load_weights(folder, TINY, progress=False)


def test_folder_without_weights_and_malformed_shard(tmp_path, rng):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_weights(tmp_path / "empty", TINY)
    folder = write_folder(tmp_path / "m", random_weights(rng))
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-1])
    with pytest.raises(SafetensorsError, match=r"model\.safetensors: tensor .*past the"):
        load_weights(folder, TINY)
    with pytest.raises(ValueError, match="dtype must be"):
        load_weights(folder, TINY, dtype="fp8")


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
def test_weights_to_device_keeps_bf16_bits(tmp_path, rng):
    host = load_weights(write_folder(tmp_path / "m", random_weights(rng)), TINY, progress=False)
    small = {n: host[n] for n in ["model.norm.weight", "model.layers.0.self_attn.k_proj.weight"]}
    small["as_f32"] = rng.standard_normal(5).astype(np.float32)
    device = weights_to_device(small, progress=False)
    for n, a in small.items():
        want = a if a.dtype == np.uint16 else f32_to_bf16_bits(a)
        got = device[n].copy_to_host()
        assert got.dtype == np.uint16 and np.array_equal(got, want), n
    with pytest.raises(ValueError, match="'ids' has dtype int64"):
        weights_to_device({"ids": np.arange(3)}, progress=False)


def test_weights_to_device_refuses_without_gpu_or_simulator(monkeypatch):
    monkeypatch.setattr(loader, "can_launch", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        weights_to_device({"w": np.zeros(2, np.uint16)})
