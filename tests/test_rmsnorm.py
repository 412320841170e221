"""Chapter 04: RMSNorm reference against Hugging Face, every rung of the kernel ladder against the
reference, the fused residual add, the block reduction, and bad input."""

import numpy as np
import pytest
from numba import cuda, float32

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, block_sum
from tinyvllm_lib.kernels.rmsnorm import (
    RMSNORM_VARIANTS,
    block_threads,
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from tinyvllm_lib.runtime import can_launch

needs_launch = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
EPS = 1e-5


def random_rows(rng, num_rows, hidden):
    """Random rows; from 4 rows on, row 0 is zero, row 1 has a NaN and row 2's squares overflow fp16."""
    x = (rng.standard_normal((num_rows, hidden)) * rng.uniform(0.1, 10)).astype(np.float32)
    if num_rows >= 4:
        x[0] = 0.0
        x[1, rng.integers(hidden)] = np.nan
        x[2] *= np.float32(1e4)
    return x


def random_weight(rng, hidden):
    return f32_to_bf16_bits(rng.uniform(0.5, 1.5, hidden).astype(np.float32))


def assert_close(got, want, rtol):
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaNs in different places"
    ok = ~np.isnan(want)
    err = np.max(np.abs(got[ok] - want[ok]) / np.maximum(np.abs(want[ok]), 1e-30), initial=0.0)
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


def assert_out_matches(got, want):
    """float32 out: 1e-5 relative; bf16 out: one bf16 ulp (the float32 values differ in summation order)."""
    if got.dtype == np.uint16:
        assert_close(bf16_bits_to_f32(got), bf16_bits_to_f32(f32_to_bf16_bits(want)), 2**-7)
    else:
        assert_close(got, want, 1e-5)


def test_reference_matches_hugging_face(rng):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    hidden, eps = 300, 1e-6
    x, w = random_rows(rng, 6, hidden), random_weight(rng, hidden)
    norm = modeling.LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(bf16_bits_to_f32(w)))
        want = norm(torch.from_numpy(x)).numpy()
    assert_close(rmsnorm_ref(x, w, eps), want, 1e-6)


def test_reference_special_rows(rng):
    x = random_rows(rng, 4, 50)
    y = rmsnorm_ref(x, f32_to_bf16_bits(np.ones(50, np.float32)), EPS)
    assert np.all(y[0] == 0) and np.all(np.isnan(y[1])) and np.all(np.isfinite(y[[2, 3]]))
    np.testing.assert_allclose(np.sqrt(np.mean(y[2:] ** 2, axis=1)), 1.0, rtol=1e-4)


@pytest.mark.parametrize("hidden, threads", [(2048, 256), (576, 128), (1000, 128), (1, 32), (8192, 1024)])
def test_block_threads(hidden, threads):
    assert block_threads(hidden) == threads


def test_block_threads_rejects_too_wide_rows_and_bad_blocks():
    with pytest.raises(ValueError, match="8192"):
        block_threads(8193)
    with pytest.raises(ValueError, match="power of two"):
        block_threads(300, 48)
    with pytest.raises(ValueError, match="power of two"):
        block_threads(2048, 128)  # 16 per thread: too many for the registers


@cuda.jit
def _block_sum_kernel(values, out):
    warp_sums = cuda.shared.array(WARP_SIZE, float32)
    scratch = cuda.shared.array(SHUFFLE_SCRATCH, float32)
    out[cuda.threadIdx.x] = block_sum(values[cuda.threadIdx.x], warp_sums, scratch)


@needs_launch
def test_block_sum_gives_every_thread_the_total(rng):
    values = rng.integers(-1000, 1000, size=96).astype(np.float32)  # integers: the sum is exact in any order
    out = cuda.to_device(np.zeros(96, np.float32))
    _block_sum_kernel[1, 96](cuda.to_device(values), out)
    assert np.all(out.copy_to_host() == values.sum())


@needs_launch
@pytest.mark.parametrize("variant", list(RMSNORM_VARIANTS))
def test_every_rung_matches_reference(rng, variant):
    num_rows, hidden = 4, 300  # 300: not a multiple of 32 or 64; 64 threads = two warps
    x, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
    out = cuda.to_device(np.full((num_rows, hidden), -7.0, np.float32))  # poison
    rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, out, variant=variant, threads_per_block=64)
    assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))


@needs_launch
def test_rmsnorm_bf16_out(rng):
    num_rows, hidden = 5, 77
    x, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
    out = cuda.to_device(np.full((num_rows, hidden), 0xBEEF, np.uint16))
    rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, out)
    assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))


def _check_fused(rng, num_rows, hidden, out_dtype, threads=None):
    residual, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
    delta = random_rows(rng, num_rows, hidden)[::-1].copy()  # its NaN lands in another row
    d_residual = cuda.to_device(residual)
    out = cuda.to_device(np.zeros((num_rows, hidden), out_dtype))
    fused_add_rmsnorm(d_residual, cuda.to_device(delta), cuda.to_device(w), EPS, out, threads_per_block=threads)
    want_residual, want = fused_add_rmsnorm_ref(residual, delta, w, EPS)
    assert np.array_equal(d_residual.copy_to_host(), want_residual, equal_nan=True)
    assert_out_matches(out.copy_to_host(), want)


@needs_launch
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_fused_add_rmsnorm(rng, out_dtype):
    _check_fused(rng, 5, 200, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 7, 256, 2048])
def test_real_shapes_on_gpu(rng, num_rows):
    hidden = 2048  # Llama 3.2 1B
    for variant in RMSNORM_VARIANTS:
        x, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
        out = cuda.device_array((num_rows, hidden), np.float32)
        rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, out, variant=variant)
        assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))
    for out_dtype in (np.float32, np.uint16):
        _check_fused(rng, num_rows, hidden, out_dtype)
    _check_fused(rng, num_rows, 576, np.uint16)  # SmolLM2
    _check_fused(rng, num_rows, 4096, np.uint16, threads=1024)


def test_launchers_reject_bad_input():
    x, w, out = np.zeros((2, 4), np.float32), np.zeros(4, np.uint16), np.zeros((2, 4), np.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        rmsnorm(x.astype(np.float64), w, EPS, out)
    with pytest.raises(TypeError, match="uint16"):
        rmsnorm(x, w.astype(np.float32), EPS, out)
    with pytest.raises(TypeError, match="out must be float32"):
        rmsnorm(x, w, EPS, out.astype(np.uint16), variant="shared_tree")  # bf16 out: the last rungs only
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, w[:3], EPS, out)
    with pytest.raises(ValueError, match="out must be 2-D"):
        rmsnorm(x, w, EPS, out[:, :3])
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm(np.zeros((4, 2), np.float32).T, w, EPS, out)
    with pytest.raises(ValueError, match="eps"):
        rmsnorm(x, w, -1.0, out)
    with pytest.raises(ValueError, match="variant"):
        rmsnorm(x, w, EPS, out, variant="fastest")
    with pytest.raises(ValueError, match="delta"):
        fused_add_rmsnorm(x, x[:1], w, EPS, out)
    with pytest.raises(TypeError, match="out must be float32 or uint16"):
        fused_add_rmsnorm(x, x, w, EPS, out.astype(np.float16))
