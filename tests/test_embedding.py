"""Chapter 03: the embedding lookup kernels against the NumPy reference, bit for bit."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.embedding import (
    can_embed_wide,
    check_token_ids,
    embed,
    embed_reference,
    embed_rows,
)
from tinyvllm_lib.runtime import can_launch

needs_kernels = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
LAUNCHERS = [embed_rows, embed]


def random_table(rng, vocab, hidden):
    return rng.integers(0, 2**16, size=(vocab, hidden), dtype=np.uint16)  # every bf16 pattern, NaNs included


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def run(launcher, ids, table, threads_per_block=64, poison=-1234.5):
    d_out = cuda.to_device(np.full((len(ids), table.shape[1]), np.float32(poison)))
    launcher(cuda.to_device(ids), cuda.to_device(table), d_out, threads_per_block=threads_per_block)
    return d_out.copy_to_host()


def test_reference_is_the_widened_rows(rng):
    table = random_table(rng, 30, 7)
    ids = rng.integers(0, 30, size=11)
    want = table[ids].view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(bits(embed_reference(ids, table)), bits(want))
    assert embed_reference(np.zeros(0, np.int32), table).shape == (0, 7)


def test_check_token_ids():
    assert check_token_ids([0, 9], 10).tolist() == [0, 9]
    for bad, position in (([3, 10], 1), ([-1, 2], 0)):
        with pytest.raises(ValueError, match=f"token id {bad[position]} at position {position}"):
            check_token_ids(bad, 10)
    with pytest.raises(TypeError):
        check_token_ids([1.0, 2.0], 10)
    with pytest.raises(TypeError):
        check_token_ids([[1, 2]], 10)


@needs_kernels
@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("vocab, hidden, num_tokens", [(37, 100, 3), (20, 576, 2), (23, 99, 3), (5, 4, 1)])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_kernel_matches_reference(rng, launcher, vocab, hidden, num_tokens, id_dtype):
    table = random_table(rng, vocab, hidden)
    ids = rng.integers(0, vocab, size=num_tokens).astype(id_dtype)
    ids[0] = vocab - 1  # the last row
    got = run(launcher, ids, table)
    assert np.array_equal(bits(got), bits(embed_reference(ids, table)))


@needs_kernels
def test_wide_path_is_taken_only_when_rows_are_whole_words():
    table, out = np.zeros((4, 100), np.uint16), np.zeros((2, 100), np.float32)
    assert can_embed_wide(table, out) and can_embed_wide(cuda.to_device(table), cuda.to_device(out))
    assert not can_embed_wide(np.zeros((4, 99), np.uint16), np.zeros((2, 99), np.float32))
    assert not can_embed_wide(np.zeros(4 * 100 + 1, np.uint16)[1:].reshape(4, 100), out)  # misaligned start


@needs_kernels
def test_host_ids_are_checked_before_launch(rng):
    table = random_table(rng, 10, 8)
    out = np.full((2, 8), np.float32(7.0))
    for launcher in LAUNCHERS:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            launcher(np.array([1, 10], np.int32), table, out)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            launcher(np.array([-1, 1], np.int64), table, out)
    assert (out == 7.0).all()  # nothing ran


@needs_kernels
@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
def test_bad_device_ids_give_nan_rows(rng, launcher):
    table = random_table(rng, 10, 12)
    ids = np.array([3, -1, 9, 10, 2**31 - 1], np.int32)
    got = run(launcher, ids, table)  # device ids: the kernel guards itself
    assert np.isnan(got[[1, 3, 4]]).all()
    assert np.array_equal(bits(got[[0, 2]]), bits(embed_reference(ids[[0, 2]], table)))


def test_launcher_rejects_bad_input():
    ids, table, out = np.array([1, 2], np.int32), np.zeros((10, 8), np.uint16), np.zeros((2, 8), np.float32)
    for launcher in LAUNCHERS:
        with pytest.raises(TypeError, match="int32 or int64"):
            launcher(ids.astype(np.float32), table, out)
        with pytest.raises(TypeError, match="NumPy or device array"):
            launcher([1, 2], table, out)
        with pytest.raises(TypeError, match="uint16"):
            launcher(ids, table.astype(np.float32), out)
        with pytest.raises(TypeError, match="float32"):
            launcher(ids, table, out.astype(np.float64))
        with pytest.raises(ValueError, match="num_tokens"):
            launcher(ids, table, np.zeros((3, 8), np.float32))
        with pytest.raises(ValueError, match="num_tokens"):
            launcher(ids, table.reshape(-1), out)
        with pytest.raises(ValueError, match="contiguous"):
            launcher(ids, np.zeros((10, 16), np.uint16)[:, ::2], out)


def test_zero_tokens_launch_nothing():
    out = np.zeros((0, 8), np.float32)
    for launcher in LAUNCHERS:
        assert launcher(np.zeros(0, np.int32), np.zeros((10, 8), np.uint16), out) is out


@pytest.mark.gpu
@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
def test_kernel_at_llama_1b_shape(rng, launcher):
    vocab, hidden, num_tokens = 128256, 2048, 2048
    table = random_table(rng, vocab, hidden)
    ids = rng.integers(0, vocab, size=num_tokens).astype(np.int32)
    ids[:2] = [0, vocab - 1]
    got = run(launcher, ids, table, threads_per_block=256)
    assert np.array_equal(bits(got), bits(embed_reference(ids, table)))
    ids[[5, 7]] = [-5, vocab]
    got = run(launcher, ids, table, threads_per_block=256)
    assert np.isnan(got[[5, 7]]).all()
    keep = np.setdiff1d(np.arange(num_tokens), [5, 7])
    assert np.array_equal(bits(got[keep]), bits(embed_reference(ids[keep], table)))


@pytest.mark.gpu
def test_smollm2_table_on_gpu(rng):
    from tinyvllm_lib.models.safetensors_io import SafetensorsFile
    from tinyvllm_lib.models.smollm2 import resolve_model

    table = np.ascontiguousarray(SafetensorsFile(resolve_model("smollm2") / "model.safetensors").get("model.embed_tokens.weight"))
    ids = rng.integers(0, table.shape[0], size=333).astype(np.int64)
    got = run(embed, ids, table, threads_per_block=256)
    assert np.array_equal(bits(got), bits(embed_reference(ids, table)))
