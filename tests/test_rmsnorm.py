"""Chapter 04: RMSNorm reference against Hugging Face, every rung of the kernel ladder against the
reference, the fused residual add, the wide rung and its fallback, the block reduction, and bad input."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from numba import cuda, float32

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.reduce import SHUFFLE_SCRATCH, WARP_SIZE, block_sum
from tinyvllm_lib.kernels.rmsnorm import (
    FUSED_VARIANTS,
    RMSNORM_VARIANTS,
    block_threads,
    can_go_wide,
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
    wide_block_threads,
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
    mean_square = np.mean(x[2:].astype(np.float64) ** 2, axis=1)
    want = np.sqrt(mean_square / (mean_square + EPS))  # RMS of the output: 1 only when eps << mean square
    np.testing.assert_allclose(np.sqrt(np.mean(y[2:].astype(np.float64) ** 2, axis=1)), want, rtol=1e-5)


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


@pytest.mark.parametrize("hidden, threads", [(2048, 128), (576, 64), (4096, 256), (600, 64), (2, 32), (16384, 1024)])
def test_wide_block_threads(hidden, threads):
    assert wide_block_threads(hidden) == threads  # one warp per 256 words (512 elements)


def test_wide_block_threads_rejects_too_wide_rows_and_bad_blocks():
    with pytest.raises(ValueError, match="16384"):
        wide_block_threads(16386)
    with pytest.raises(ValueError, match="multiple of 32"):
        wide_block_threads(2048, 96)  # too few warps to cover the row
    with pytest.raises(ValueError, match="multiple of 32"):
        wide_block_threads(300, 48)
    assert wide_block_threads(2048, 160) == 160  # an extra warp only idles


def test_can_go_wide():
    rows, weight = np.zeros((3, 8), np.float32), np.zeros(8, np.uint16)
    assert can_go_wide(rows, rows, weight, np.zeros((3, 8), np.uint16))
    assert not can_go_wide(np.zeros((3, 7), np.float32))  # odd hidden: rows are not whole words
    assert not can_go_wide(np.zeros((3, 0), np.float32))
    assert not can_go_wide(rows, _misaligned(np.zeros((3, 8), np.float32)))
    assert not can_go_wide(rows, np.zeros(9, np.uint16)[1:])  # a weight that starts 2 bytes in


def _misaligned(host, to_device=False):
    """A copy of host whose data starts 4 (float32) or 2 (uint16) bytes past an 8-byte boundary."""
    flat = np.zeros(host.size + 8, host.dtype)
    skip = next(i for i in range(1, 8) if (flat.ctypes.data + i * host.itemsize) % 8)
    if to_device:
        d_flat = cuda.to_device(flat)
        view = d_flat[skip:skip + host.size].reshape(host.shape)
        view.copy_to_device(host)
        return view
    view = flat[skip:skip + host.size].reshape(host.shape)
    view[...] = host
    return view


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


def _poisoned(num_rows, hidden, out_dtype):
    """An output full of values no kernel writes: an element it forgets cannot pass by luck."""
    return np.full((num_rows, hidden), 0xBEEF if out_dtype == np.uint16 else -7.0, out_dtype)


def _check_fused(rng, num_rows, hidden, out_dtype, threads=None, variant="wide", misaligned=False):
    residual, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
    delta = random_rows(rng, num_rows, hidden)[::-1].copy()  # its NaN lands in another row
    d_residual = _misaligned(residual, to_device=True) if misaligned else cuda.to_device(residual)
    out = cuda.to_device(_poisoned(num_rows, hidden, out_dtype))
    fused_add_rmsnorm(d_residual, cuda.to_device(delta), cuda.to_device(w), EPS, out, threads_per_block=threads, variant=variant)
    want_residual, want = fused_add_rmsnorm_ref(residual, delta, w, EPS)
    assert np.array_equal(d_residual.copy_to_host(), want_residual, equal_nan=True), "residual add is not exact"
    assert_out_matches(out.copy_to_host(), want)


@needs_launch
@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_fused_add_rmsnorm(rng, out_dtype, variant):
    _check_fused(rng, 5, 200, out_dtype, variant=variant)


# hidden 600: 300 words, two warps, the second mostly past the row; 300 with 64 threads: an idle
# warp; 2: a single word
WIDE_SHAPES = [(5, 600, None), (4, 300, 64), (4, 2, None)]


@needs_launch
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("num_rows, hidden, threads", WIDE_SHAPES)
def test_wide_rmsnorm_matches_reference(rng, num_rows, hidden, threads, out_dtype):
    x, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
    d_x, d_w, out = cuda.to_device(x), cuda.to_device(w), cuda.to_device(_poisoned(num_rows, hidden, out_dtype))
    assert can_go_wide(d_x, d_w, out)
    rmsnorm(d_x, d_w, EPS, out, variant="wide", threads_per_block=threads)
    assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))


@needs_launch
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("num_rows, hidden, threads", WIDE_SHAPES)
def test_wide_fused_matches_reference(rng, num_rows, hidden, threads, out_dtype):
    assert can_go_wide(cuda.device_array((num_rows, hidden), np.float32), cuda.device_array(hidden, np.uint16))
    _check_fused(rng, num_rows, hidden, out_dtype, threads)


@needs_launch
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_wide_falls_back_on_odd_or_misaligned_rows(rng, out_dtype):
    for hidden, misaligned in [(77, False), (40, True)]:  # odd: not whole words; whole words, 4 bytes off
        x, w = random_rows(rng, 4, hidden), random_weight(rng, hidden)
        d_x = _misaligned(x, to_device=True) if misaligned else cuda.to_device(x)
        out = cuda.to_device(_poisoned(4, hidden, out_dtype))
        assert not can_go_wide(d_x, w, out)
        rmsnorm(d_x, cuda.to_device(w), EPS, out)  # the default variant, "wide"
        assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))
        _check_fused(rng, 4, hidden, out_dtype, misaligned=misaligned)


def test_wide_kernels_compile_to_wide_loads_and_registers_only():
    """PTX for sm_90: 8-byte loads of the rows, whole-word stores, nothing in local memory."""
    script = textwrap.dedent("""
        import json, sys, types
        import numba.cuda.dispatcher as dispatcher
        from numba import cuda
        dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
        from tinyvllm_lib.kernels import rmsnorm_kernels as m
        ptx = {f"{name} {sig}": cuda.compile_ptx(getattr(m, name).py_func, sig, cc=(9, 0))[0]
               for name in ("rmsnorm_wide_kernel", "fused_add_rmsnorm_wide_kernel") for sig in m.PTX_SIGNATURES[name]}
        json.dump(ptx, sys.stdout)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parent.parent, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    for kernel, ptx in json.loads(res.stdout).items():
        is_bf16_out = kernel.endswith("uint32[:, ::1])")
        assert ".local" not in ptx, f"{kernel}: values spilled to local memory"
        assert "ld.global.u64" in ptx and "ld.global.f32" not in ptx, f"{kernel}: rows not loaded 8 bytes at a time"
        assert "st.global.u16" not in ptx and "st.global.f32" not in ptx, f"{kernel}: narrow stores"
        assert ("st.global.u32" in ptx) == is_bf16_out, f"{kernel}: bf16 pairs are stored as uint32 words"


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 7, 256, 2048])
def test_real_shapes_on_gpu(rng, num_rows):
    hidden = 2048  # Llama 3.2 1B
    for variant in RMSNORM_VARIANTS:
        x, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
        out = cuda.to_device(_poisoned(num_rows, hidden, np.float32))
        rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, out, variant=variant)
        assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))
    for variant in ("registers", "wide"):
        x, w = random_rows(rng, num_rows, hidden), random_weight(rng, hidden)
        out = cuda.to_device(_poisoned(num_rows, hidden, np.uint16))
        rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, out, variant=variant)
        assert_out_matches(out.copy_to_host(), rmsnorm_ref(x, w, EPS))
    for variant in FUSED_VARIANTS:
        for out_dtype in (np.float32, np.uint16):
            _check_fused(rng, num_rows, hidden, out_dtype, variant=variant)
        _check_fused(rng, num_rows, 576, np.uint16, variant=variant)  # SmolLM2
        _check_fused(rng, num_rows, 4096, np.uint16, threads=1024, variant=variant)
    _check_fused(rng, num_rows, 16384, np.uint16)  # the widest row rung 6 takes: 32 warps
    _check_fused(rng, num_rows, hidden, np.uint16, misaligned=True)  # the fallback at full size


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
    with pytest.raises(ValueError, match="variant"):
        fused_add_rmsnorm(x, x, w, EPS, out, variant="shared_tree")
    with pytest.raises(ValueError, match="multiple of 32"):
        rmsnorm(x, w, EPS, out, threads_per_block=48)  # rung 6's blocks are whole warps
