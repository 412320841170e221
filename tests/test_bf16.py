"""Chapter 01: bf16 conversions against ml_dtypes, and the widening kernel."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.bf16 import (
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    narrow_f32,
    widen_bf16,
)
from tinyvllm_lib.runtime import can_launch

ALL_BF16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def ref_narrow(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_widen_every_bf16_pattern():
    want = ALL_BF16.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    assert np.array_equal(bf16_bits_to_f32(ALL_BF16).view(np.uint32), want)


def test_every_bf16_value_round_trips():
    assert np.array_equal(f32_to_bf16_bits(bf16_bits_to_f32(ALL_BF16)), ref_narrow(bf16_bits_to_f32(ALL_BF16)))


def test_narrow_random_words_ties_and_subnormals(rng):
    n = 2_000_000
    words = rng.integers(0, 2**32, size=n, dtype=np.uint32)
    ties = (rng.integers(0, 2**16, size=n, dtype=np.uint32) << 16) | 0x8000
    near_ties = ties ^ rng.integers(1, 3, size=n, dtype=np.uint32)  # just below / above the halfway point
    subnormals = rng.integers(0, 2**23, size=n, dtype=np.uint32) | ((words & 1) << 31)
    x = np.concatenate([words, ties, near_ties, subnormals]).view(np.float32)
    got, want = f32_to_bf16_bits(x), ref_narrow(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {x.view(np.uint32)[bad[:5]]}"


@pytest.mark.parametrize(
    "f32_bits, bf16_bits",
    [
        (0x3F808000, 0x3F80),  # 1 + 2^-8: a tie, stays even
        (0x3F818000, 0x3F82),  # 1 + 3*2^-8: a tie, rounds up to even
        (0x3F808001, 0x3F81),  # just above the tie: up
        (0x7F7FFFFF, 0x7F80),  # largest float32 rounds to infinity
        (0xFF800000, 0xFF80),  # -inf stays -inf
        (0x7F800001, 0x7FC0),  # signalling NaN with only low payload: quiet NaN, not inf
        (0xFFA00000, 0xFFC0),  # negative NaN keeps its sign
        (0x00000001, 0x0000),  # smallest subnormal rounds to zero
        (0x80008000, 0x8000),  # -tiny tie rounds to -0
    ],
)
def test_known_roundings(f32_bits, bf16_bits):
    x = np.array([f32_bits], np.uint32).view(np.float32)
    assert int(f32_to_bf16_bits(x)[0]) == bf16_bits


def test_wrong_dtype_is_rejected():
    with pytest.raises(TypeError):
        bf16_bits_to_f32(np.zeros(3, np.int16))


def _check_kernel(rng, n, threads):
    src = rng.integers(0, 2**16, size=n, dtype=np.uint32).astype(np.uint16)
    d_out = cuda.to_device(np.full(n, np.float32(-7.25)))  # poison
    widen_bf16(cuda.to_device(src), d_out, threads_per_block=threads)
    want = src.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    assert np.array_equal(d_out.copy_to_host().view(np.uint32), want)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
@pytest.mark.parametrize("n, threads", [(1, 32), (97, 32), (1000, 128)])
def test_widen_kernel(rng, n, threads):
    _check_kernel(rng, n, threads)


@pytest.mark.gpu
def test_widen_kernel_large(rng):
    _check_kernel(rng, 65536 * 37 + 5, 256)


def test_widen_launcher_rejects_bad_input():
    with pytest.raises(TypeError, match="uint16"):
        widen_bf16(np.zeros(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="float32"):
        widen_bf16(np.zeros(4, np.uint16), np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="same length"):
        widen_bf16(np.zeros(4, np.uint16), np.zeros(5, np.float32))


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
def test_time_launches_and_records(rng, tmp_path):
    from tinyvllm_lib.measure import Recorder, load_records, time_launches

    src = cuda.to_device(rng.integers(0, 2**16, size=100, dtype=np.uint32).astype(np.uint16))
    out = cuda.device_array(100, np.float32)
    sec = time_launches(lambda i, s: widen_bf16(src, out, 64, s), num_launches=2, repeats=2)
    assert sec > 0
    want = src.copy_to_host().view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    assert np.array_equal(out.copy_to_host().view(np.uint32), want)  # the replayed launches ran (bits: NaN != NaN)
    rec = Recorder("test_chapter", command="pytest")
    rec.add("widen", [100], "GB/s", 12.5, ceiling=50.0)
    rec.save(tmp_path)
    (got,) = load_records("test_chapter", tmp_path)
    assert got["ratio"] == 0.25 and got["command"] == "pytest" and got["device"]["name"] and got["date"]


def test_save_replaces_this_devices_records_or_only_their_kinds(tmp_path):
    """save(): every record of this device is replaced, another device's kept; save(kind=...): only this device's
    records of the kinds this run made."""
    from tinyvllm_lib.measure import Recorder, load_records

    other = {"chapter": "test_chapter", "name": "a", "value": 1.0, "device": {"name": "another GPU"}}
    (tmp_path / "test_chapter.json").write_text(__import__("json").dumps([other]))
    first = Recorder("test_chapter")
    first.add("a", [1], "us", 2.0)
    first.add("b", [1], "us", 3.0)
    first.save(tmp_path)
    second = Recorder("test_chapter")
    second.add("b", [1], "us", 4.0)
    second.save(tmp_path, kind=lambda r: r["name"])
    got = {(r["device"]["name"] == "another GPU", r["name"]): r["value"] for r in load_records("test_chapter", tmp_path)}
    assert got == {(True, "a"): 1.0, (False, "a"): 2.0, (False, "b"): 4.0}
    second.save(tmp_path)  # no kind: this device's records are this run's alone
    got = {(r["device"]["name"] == "another GPU", r["name"]): r["value"] for r in load_records("test_chapter", tmp_path)}
    assert got == {(True, "a"): 1.0, (False, "b"): 4.0}


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
@pytest.mark.parametrize("n", [1, 333])
def test_narrow_kernel_matches_host(rng, n):
    src = rng.integers(0, 2**32, size=n, dtype=np.uint32)
    src[::3] = (src[::3] & 0xFFFF0000) | 0x8000  # ties
    src = src.view(np.float32)
    d_out = cuda.to_device(np.full(n, 0xDEAD, np.uint16))
    narrow_f32(cuda.to_device(src), d_out, 64)
    assert np.array_equal(d_out.copy_to_host(), ref_narrow(src))
