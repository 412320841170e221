"""Chapter 15: the 8-bit weights' product on the tensor cores (mma_8bit: int8 and FP8 codes widened to bf16 in
registers, plain, adding into out, and with SiLU·up) against NumPy, in the simulator (the mma's twin) at tiny odd
shapes and on a GPU at the 1B's; the layer's path to it."""

import numpy as np
import pytest
from numba import cuda
from test_gemv_8bit import random_bf16, random_weight  # the 8-bit GEMV's tests' inputs

from tinyvllm_lib.kernels.activation import silu_mul_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.mma_8bit import (
    MMA_8BIT_KERNELS,
    make_mma_8bit_kernel,
    mma_8bit,
)
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.measure import max_rel_error as rel_error
from tinyvllm_lib.runtime import can_launch

TOL = 1e-4  # float32 sums of exact bf16 products against float64, as the GEMV's tests
BF16_OUT = 4e-3  # out in bf16: its rounding (2^-9 relative) on top
needs_launch = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
METHODS = ["int8", "fp8"]


def random_x(rng, M, K):
    return random_bf16(rng, (M, K))


def reference(x_bits, q):
    return bf16_bits_to_f32(x_bits).astype(np.float64) @ q.dequantize().astype(np.float64).T


def launch(x, q, out, **kw):
    mma_8bit(cuda.to_device(x), cuda.to_device(q.codes), cuda.to_device(q.scales), out, q.method, **kw)
    return out.copy_to_host()


@needs_launch
@pytest.mark.parametrize("method", METHODS)
# one n-tile (1, 3, 8 tokens) and two (11, 16); rows short of a tile; K of 1 and 3 chunks (a warp with none)
@pytest.mark.parametrize("M, N, K", [(1, 20, 64), (3, 37, 192), (8, 16, 128), (11, 21, 192), (16, 9, 64)])
def test_mma_8bit_matches_reference(rng, method, M, N, K):
    x, q = random_x(rng, M, K), random_weight(rng, method, N, K)
    got = launch(x, q, cuda.to_device(np.full((M, N), np.nan, np.float32)))
    assert rel_error(got, reference(x, q)) <= TOL


@needs_launch
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("M", [2, 13])
def test_mma_8bit_accumulate_adds_to_out(rng, method, M):
    N, K = 19, 128
    x, q = random_x(rng, M, K), random_weight(rng, method, N, K)
    before = rng.standard_normal((M, N)).astype(np.float32)
    got = launch(x, q, cuda.to_device(before), accumulate=True)
    assert rel_error(got, before + reference(x, q)) <= TOL


@needs_launch
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("M", [5, 12])
def test_mma_8bit_gated_is_silu_gate_times_up(rng, method, M):
    I, K = 18, 128  # two blocks of 16 columns, the second short
    x, q = random_x(rng, M, K), random_weight(rng, method, 2 * I, K)
    got = launch(x, q, cuda.to_device(np.full((M, I), 0x7FC0, np.uint16)), gated=True)
    want = silu_mul_ref(reference(x, q).astype(np.float32))
    assert rel_error(bf16_bits_to_f32(got), want) <= BF16_OUT


@needs_launch
@pytest.mark.parametrize("knobs", [dict(m_tiles=2, warps=4, ahead=1), dict(m_tiles=1, warps=2, ahead=3)])
def test_mma_8bit_knobs_give_the_same_sums(rng, knobs):
    """Other tiles a block, warps and chunks loaded ahead (the bench's sweep) change no sum beyond rounding."""
    M, N, K = 6, 40, 320
    x, q = random_x(rng, M, K), random_weight(rng, "int8", N, K)
    kernel = make_mma_8bit_kernel("int8", 1, **knobs)
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    from tinyvllm_lib.kernels.tensor_core import twin_launch

    with twin_launch():
        kernel[-(-N // kernel.units), kernel.threads](cuda.to_device(x).view(np.uint64),
                                                      cuda.to_device(q.codes).view(np.uint64),
                                                      cuda.to_device(q.scales), out)
    assert rel_error(out.copy_to_host(), reference(x, q)) <= TOL


@needs_launch
def test_mma_8bit_rejects_what_it_cannot_take(rng):
    q = random_weight(rng, "int8", 16, 96)  # K not a multiple of 64
    x = cuda.to_device(random_x(rng, 2, 96))
    with pytest.raises(ValueError, match="multiple of 64"):
        mma_8bit(x, cuda.to_device(q.codes), cuda.to_device(q.scales), cuda.device_array((2, 16), np.float32), "int8")
    q = random_weight(rng, "int8", 16, 64)
    args = cuda.to_device(q.codes), cuda.to_device(q.scales)
    with pytest.raises(ValueError, match="1 to 16 token vectors"):
        mma_8bit(cuda.to_device(random_x(rng, 17, 64)), *args, cuda.device_array((17, 16), np.float32), "int8")
    with pytest.raises(ValueError, match="float32"):
        mma_8bit(cuda.to_device(random_x(rng, 2, 64)), *args, cuda.device_array((2, 16), np.uint16), "int8")


def test_the_launcher_has_a_kernel_for_each_format_tiling_and_epilogue():
    assert set(MMA_8BIT_KERNELS) == {(m, t, k) for m in METHODS for t in (1, 2) for k in ("", "add", "gated")}


@needs_launch
@pytest.mark.parametrize("method", METHODS)
def test_a_layer_past_the_gemv_takes_the_tensor_cores(rng, method):
    """QuantizedLinear: 6 tokens past a GEMV limit of 4 take "mma" where the weight allows it, and give the
    scratch's product (bf16 cuBLAS, or its stand-in in the simulator) to rounding; gate-up's norm and SiLU·up too."""
    from tinyvllm_lib.layers.linear import rmsnorm_linear_silu_mul
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear

    M, I, K, eps = 6, 16, 128, 1e-5
    q = random_weight(rng, method, 2 * I, K)
    layer = QuantizedLinear(q, cuda.device_array(2 * I * K, np.uint16))
    layer.gemv_max_tokens, layer.mma_max_tokens = 4, 16
    x = cuda.to_device(random_x(rng, M, K))
    assert layer.gemm_path(x) == "mma"
    out = cuda.to_device(np.full((M, 2 * I), np.nan, np.float32))
    layer.apply(x, out)
    assert rel_error(out.copy_to_host(), reference(x.copy_to_host(), q)) <= TOL

    residual = rng.standard_normal((M, K)).astype(np.float32) * np.float32(3)
    norm_weight = f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32))
    act = cuda.to_device(np.full((M, I), 0x7FC0, np.uint16))
    normed = cuda.device_array((M, K), np.uint16)
    rmsnorm_linear_silu_mul(cuda.to_device(residual), cuda.to_device(norm_weight), eps, layer, act,
                            cuda.device_array((M, 2 * I), np.float32), normed)
    normed_ref = f32_to_bf16_bits(rmsnorm_ref(residual, norm_weight, eps))
    want = silu_mul_ref(reference(normed_ref, q).astype(np.float32))
    assert rel_error(bf16_bits_to_f32(act.copy_to_host()), want) <= BF16_OUT

    layer.mma_max_tokens = 0  # off: the scratch
    assert layer.gemm_path(x) == "scratch"


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name, N, K", [("qkv", 3072, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)])
def test_mma_8bit_at_the_1b_shapes(rng, method, name, N, K):
    for M in (2, 8, 16):
        x, q = random_x(rng, M, K), random_weight(rng, method, N, K)
        if name == "gate_up":
            got = launch(x, q, cuda.to_device(np.full((M, N // 2), 0x7FC0, np.uint16)), gated=True)
            want = silu_mul_ref(reference(x, q).astype(np.float32))
            assert rel_error(bf16_bits_to_f32(got), want) <= BF16_OUT, (name, M)
        else:
            got = launch(x, q, cuda.to_device(np.full((M, N), np.nan, np.float32)))
            assert rel_error(got, reference(x, q)) <= TOL, (name, M)
