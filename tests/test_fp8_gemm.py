"""Chapter 15: the FP8 GEMM path (W8A8) — the tokens' quantizer against quantize() bit for bit, the cuBLASLt wiring on
host buffers with a stand-in that does what cuBLASLt's documentation says (column-major, op(A) = T, outer-vector
scales), the NumPy model's mirror of the path, and on a GPU with FP8 tensor cores the real call against NumPy."""

import ctypes
import types

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.cublaslt_fp8 import CublasLtFp8, gemm_fp8, get_cublaslt_fp8
from tinyvllm_lib.kernels.quantize_tokens import quantize_tokens_fp8
from tinyvllm_lib.measure import max_rel_error as rel_error
from tinyvllm_lib.quantization.formats import fp8_e4m3_decode, quantize
from tinyvllm_lib.runtime import can_launch

needs_launch = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
needs_fp8_gemm = pytest.mark.skipif(get_cublaslt_fp8() is None, reason="needs a GPU with FP8 tensor cores and nvmath")
# Hopper's FP8 tensor cores keep fewer than float32's bits in their accumulator between cuBLASLt's promotions to
# float32 (every few k-steps): at K = 8,192 that leaves more than chapter 6's float32 GEMM tolerance (1e-4)
FP8_TOL = 5e-4


def quantized_reference(xq, wq):
    """float64 (M, N): the product of what the codes and scales stand for."""
    return xq.dequantize().astype(np.float64) @ wq.dequantize().astype(np.float64).T


@needs_launch
@pytest.mark.parametrize("M, K", [(1, 8), (3, 72), (7, 1032)])
def test_quantize_tokens_matches_quantize(rng, M, K):
    x = rng.standard_normal((M, K)).astype(np.float32) * np.logspace(-4, 3, M)[:, None]
    bits = f32_to_bf16_bits(x)
    want = quantize(bf16_bits_to_f32(bits), "fp8")
    codes, scales = cuda.device_array((M, K), np.uint8), cuda.device_array(M, np.float32)
    quantize_tokens_fp8(cuda.to_device(bits), codes, scales)
    assert np.array_equal(scales.copy_to_host(), want.scales)
    assert np.array_equal(codes.copy_to_host(), want.codes)


@needs_launch
def test_quantize_tokens_every_code_ties_zero_rows_and_nan():
    """Row 0 holds 448 (its scale 1) and every value e4m3 can hold plus the midpoints between neighbours (ties go
    to the even code): the encoder's rounding everywhere; row 1 is zeros (scale 0, codes 0); row 2 a NaN, coded
    NaN where it is, the rest as without it."""
    values = np.unique(np.abs(fp8_e4m3_decode(np.arange(0x7F, dtype=np.uint8))))
    mids = (values[:-1] + values[1:]) / 2  # exact in float32 and in bf16 (4 mantissa bits)
    row = np.concatenate([values, mids, -values, -mids])
    row = np.concatenate([row, np.zeros(-len(row) % 8)]).astype(np.float32)
    K = len(row)
    x = np.zeros((3, K), np.float32)
    x[0], x[2] = row, row
    x[2, 7] = np.nan
    bits = f32_to_bf16_bits(x)
    assert np.array_equal(bf16_bits_to_f32(bits[0]), row)  # every value survives bf16
    want = quantize(bf16_bits_to_f32(bits[:2]), "fp8")
    codes, scales = cuda.device_array((3, K), np.uint8), cuda.device_array(3, np.float32)
    quantize_tokens_fp8(cuda.to_device(bits), codes, scales)
    got_codes, got_scales = codes.copy_to_host(), scales.copy_to_host()
    assert np.array_equal(got_scales, [1.0, 0.0, 1.0])  # row 2: the NaN left out of its largest value
    assert np.array_equal(got_codes[:2], want.codes)
    assert got_codes[2, 7] == 0x7F and np.array_equal(np.delete(got_codes[2], 7), np.delete(want.codes[0], 7))


def test_quantize_tokens_refuses_bad_operands():
    x = cuda.to_device(np.zeros((2, 6), np.uint16)) if can_launch() else np.zeros((2, 6), np.uint16)
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize_tokens_fp8(x, np.zeros((2, 6), np.uint8), np.zeros(2, np.float32))


@needs_launch
@pytest.mark.parametrize("M, K", [(3, 72), (2, 2048), (1, 4100)])
def test_rmsnorm_quantize_is_the_norm_then_the_quantizer(rng, M, K):
    """One kernel, the bits of chapter 4's rmsnorm (bf16 out) followed by quantize_tokens_fp8; a row past the last
    whole warp's words (4,100: rung 6's threads, some idle) and a row with a NaN too."""
    from tinyvllm_lib.kernels.quantize_tokens import rmsnorm_quantize_fp8
    from tinyvllm_lib.kernels.rmsnorm import rmsnorm

    x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.1, 30, (M, 1)).astype(np.float32)
    x[-1, K // 3] = np.nan if M > 1 else x[-1, K // 3]
    d_x = cuda.to_device(x)
    weight = cuda.to_device(f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32)))
    normed = cuda.device_array((M, K), np.uint16)
    rmsnorm(d_x, weight, 1e-5, normed)
    want = (cuda.device_array((M, K), np.uint8), cuda.device_array(M, np.float32))
    quantize_tokens_fp8(normed, *want)
    got = (cuda.device_array((M, K), np.uint8), cuda.device_array(M, np.float32))
    rmsnorm_quantize_fp8(d_x, weight, 1e-5, *got)
    assert np.array_equal(got[1].copy_to_host(), want[1].copy_to_host(), equal_nan=True)
    assert np.array_equal(got[0].copy_to_host(), want[0].copy_to_host())


# --- the cuBLASLt wiring, on host buffers -------------------------------------------------------------------------


class HostCublasLt:
    """Stands in for nvmath.bindings.cublasLt on host buffers, as its documentation defines the call: column-major
    layouts (rows, cols, ld), D = alpha · (a_scale ⊗ b_scale) ⊙ (op(A) op(B)) + beta · C, where an outer-vector
    scale has one value a row of op(A) and one a column of op(B)."""

    class MatmulDescAttribute:
        TRANSA, TRANSB, A_SCALE_MODE, B_SCALE_MODE, A_SCALE_POINTER, B_SCALE_POINTER = range(6)

    class MatmulPreferenceAttribute:
        MAX_WORKSPACE_BYTES = 0

    class MatmulHeuristicResult:
        def __init__(self, n):
            self.buf = np.zeros(64 * n, np.uint8)
            self.ptr = self.buf.ctypes.data

    def __init__(self):
        self.descs, self.layouts, self.plans_made, self.results = {}, {}, 0, set()

    def create(self):
        return 1

    def matmul_desc_create(self, compute, scale):
        key = len(self.descs) + 100
        self.descs[key] = {}
        return key

    def matmul_desc_set_attribute(self, desc, attr, ptr, size):
        A = self.MatmulDescAttribute  # cuBLASLt's types: int32 for these, pointers 8 bytes
        assert size == (8 if attr in (A.A_SCALE_POINTER, A.B_SCALE_POINTER) else 4), (attr, size)
        raw = ctypes.string_at(ptr, size)
        self.descs[desc][attr] = int.from_bytes(raw, "little")

    def matrix_layout_create(self, dtype, rows, cols, ld):
        key = len(self.layouts) + 1000
        self.layouts[key] = (dtype, rows, cols, ld)
        return key

    def matmul_preference_create(self):
        return 7

    def matmul_preference_set_attribute(self, pref, attr, ptr, size):
        assert size == 8  # uint64

    def matmul_preference_destroy(self, pref):
        pass

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, n, results, found):
        assert [self.layouts[k][0] for k in (a, b, c, d)] == ["e4m3", "e4m3", "f32", "f32"]
        self.plans_made += 1
        self.results.add(results)
        ctypes.c_int32.from_address(found).value = 1

    def matmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, ws, ws_bytes, stream):
        attrs, A = self.descs[desc], self.MatmulDescAttribute
        assert algo in self.results  # the heuristic's result: its first field is the algorithm

        def colmajor(ptr, layout):
            dtype, rows, cols, ld = self.layouts[layout]
            np_dtype = {"e4m3": np.uint8, "f32": np.float32}[dtype]
            item = np.dtype(np_dtype).itemsize
            raw = (ctypes.c_char * (((cols - 1) * ld + rows) * item)).from_address(ptr)
            return np.lib.stride_tricks.as_strided(np.frombuffer(raw, np_dtype), (rows, cols), (item, ld * item))

        def values(m):
            return fp8_e4m3_decode(np.ascontiguousarray(m)).astype(np.float64)

        op_a = values(colmajor(a, adesc)).T if attrs[A.TRANSA] == 1 else values(colmajor(a, adesc))
        op_b = values(colmajor(b, bdesc)).T if attrs[A.TRANSB] == 1 else values(colmajor(b, bdesc))
        assert attrs[A.A_SCALE_MODE] == attrs[A.B_SCALE_MODE] == 3  # outer vectors
        sa = np.ctypeslib.as_array((ctypes.c_float * op_a.shape[0]).from_address(attrs[A.A_SCALE_POINTER]))
        sb = np.ctypeslib.as_array((ctypes.c_float * op_b.shape[1]).from_address(attrs[A.B_SCALE_POINTER]))
        product = (op_a @ op_b) * sa[:, None] * sb[None, :]
        out = colmajor(d, ddesc)
        alpha_v, beta_v = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
        out[...] = alpha_v * product + (beta_v * colmajor(c, cdesc) if beta_v != 0 else 0)


def host_fp8_gemm():
    return CublasLtFp8(HostCublasLt(), {"e4m3": "e4m3", "f32": "f32", "compute": 0, "outer": 3})


@pytest.mark.parametrize("M, N, K", [(1, 16, 32), (37, 48, 64), (5, 16, 160)])
def test_fp8_gemm_wiring_computes_row_major_x_times_w_transposed(rng, M, N, K):
    gemm = host_fp8_gemm()
    xq = quantize(rng.standard_normal((M, K)).astype(np.float32), "fp8")
    wq = quantize(rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.01, 1, (N, 1)), "fp8")
    out = np.full((M, N), np.nan, np.float32)
    gemm_fp8(xq.codes, xq.scales, wq.codes, wq.scales, out, gemm=gemm)
    assert rel_error(out, quantized_reference(xq, wq)) <= 1e-6


def test_fp8_gemm_accumulate_and_plans_are_kept(rng):
    gemm = host_fp8_gemm()
    M, N, K = 6, 32, 48
    xq = quantize(rng.standard_normal((M, K)).astype(np.float32), "fp8")
    wq = quantize(rng.standard_normal((N, K)).astype(np.float32), "fp8")
    before = rng.standard_normal((M, N)).astype(np.float32)
    out = before.copy()
    gemm_fp8(xq.codes, xq.scales, wq.codes, wq.scales, out, accumulate=True, gemm=gemm)
    assert rel_error(out, before + quantized_reference(xq, wq)) <= 1e-6
    gemm_fp8(xq.codes, xq.scales, wq.codes, wq.scales, out, gemm=gemm)  # beta 0 again
    assert rel_error(out, quantized_reference(xq, wq)) <= 1e-6
    gemm_fp8(xq.codes, xq.scales, wq.codes, wq.scales, out, gemm=gemm)
    assert gemm.lt.plans_made == 1  # one plan for the shape: beta is the call's, not the plan's


def test_fp8_gemm_refuses_shapes_cublaslt_cannot_take(rng):
    xq = quantize(rng.standard_normal((3, 24)).astype(np.float32), "fp8")
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm_fp8(xq.codes, xq.scales, xq.codes, xq.scales, np.zeros((3, 3), np.float32), gemm=host_fp8_gemm())


# --- the NumPy model's mirror ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tinyvllm_lib.models.config import ModelConfig
    from tinyvllm_lib.models.loader import load_weights
    from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

    cfg = tiny_llama_config(hidden_size=32, intermediate_size=40, vocab_size=64, head_dim=8, tie_word_embeddings=True)
    folder = make_random_llama(tmp_path_factory.mktemp("fp8"), cfg, seed=3)
    config = ModelConfig.from_folder(folder)
    return config, load_weights(folder, config, progress=False)


def test_numpy_model_quantizes_fp8_inputs_only_past_the_tokens(tiny, rng):
    from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy, takes_fp8_gemm

    config, weights = tiny
    plain = QuantizedLlamaNumpy(config, weights, "fp8", bf16_activations=True)
    w8a8 = QuantizedLlamaNumpy(config, weights, "fp8", bf16_activations=True, fp8_gemm_tokens=4)
    name = "layers.0.gate_up_proj"
    assert takes_fp8_gemm(w8a8.matrices[name].shape) and not takes_fp8_gemm(w8a8.matrices["layers.0.down_proj"].shape)
    few, many = rng.standard_normal((4, 32)).astype(np.float32), rng.standard_normal((5, 32)).astype(np.float32)
    assert np.array_equal(w8a8.linear(few, name), plain.linear(few, name))
    assert not np.array_equal(w8a8.linear(many, name), plain.linear(many, name))  # the activations' rounding shows
    # inputs already on their rows' e4m3 grids (each row's largest 448 steps of a power of two): nothing to round
    grid = fp8_e4m3_decode(rng.integers(0, 0x7F, (5, 32), dtype=np.uint8))
    grid[:, 0] = 448.0
    on_grid = (grid * 2.0 ** rng.integers(-12, -4, (5, 1))).astype(np.float32)
    assert np.array_equal(w8a8.linear(on_grid, name), plain.linear(on_grid, name))
    many_down = rng.standard_normal((5, 40)).astype(np.float32)  # 40 inputs: not the FP8 GEMM's
    assert np.array_equal(w8a8.linear(many_down, "layers.0.down_proj"), plain.linear(many_down, "layers.0.down_proj"))
    int8 = QuantizedLlamaNumpy(config, weights, "int8", fp8_gemm_tokens=4)
    assert int8.fp8_gemm_tokens is None


def test_gemm_path_without_fp8_tensor_cores_is_the_scratch(tiny):
    """int8 always, FP8 where cuBLASLt's FP8 GEMM is unavailable (here: the simulator or a GPU without it)."""
    from tinyvllm_lib.layers import quantized_linear
    from tinyvllm_lib.layers.quantized_linear import (
        QUANTIZED_GEMV_MAX_TOKENS,
        QuantizedLinear,
    )

    config, weights = tiny
    many = types.SimpleNamespace(shape=(QUANTIZED_GEMV_MAX_TOKENS + 1, 32))
    few = types.SimpleNamespace(shape=(QUANTIZED_GEMV_MAX_TOKENS, 32))
    for method in ("int8", "fp8"):
        layer = object.__new__(QuantizedLinear)  # no GPU copy needed to pick a path
        layer.method, layer.shape, layer.scratch = method, (80, 32), np.zeros(80 * 32, np.uint16)
        assert layer.gemm_path(few) == "gemv"
        want = "fp8" if method == "fp8" and quantized_linear.FP8_TENSOR_CORE_GEMM and get_cublaslt_fp8() else "scratch"
        assert layer.gemm_path(many) == want


# --- on a GPU with FP8 tensor cores ------------------------------------------------------------------------------


@needs_fp8_gemm
@pytest.mark.parametrize("M, N, K", [(9, 3072, 2048), (256, 2048, 8192), (300, 16032, 2048)])
def test_fp8_gemm_on_the_gpu_matches_numpy(rng, M, N, K):
    xq = quantize(rng.standard_normal((M, K)).astype(np.float32), "fp8")
    wq = quantize(rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.01, 0.1, (N, 1)), "fp8")
    out = cuda.to_device(rng.standard_normal((M, N)).astype(np.float32))
    before = out.copy_to_host()
    workspace = cuda.device_array(32 << 20, np.uint8)
    args = [cuda.to_device(a) for a in (xq.codes, xq.scales, wq.codes, wq.scales)]
    gemm_fp8(*args, out, workspace=workspace, accumulate=True)
    cuda.synchronize()
    want = quantized_reference(xq, wq)
    assert rel_error(out.copy_to_host(), before + want) <= FP8_TOL
    gemm_fp8(*args, out, workspace=workspace)
    assert rel_error(out.copy_to_host(), want) <= FP8_TOL


@needs_fp8_gemm
def test_apply_fp8_in_chunks_equals_one_pass(rng, monkeypatch):
    """A scratch too small for every token's codes: apply_fp8 quantizes and multiplies a chunk at a time, and gets
    what the NumPy mirror gets."""
    from tinyvllm_lib.layers import quantized_linear
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear

    monkeypatch.setattr(quantized_linear, "FP8_TENSOR_CORE_GEMM", True)  # the switch, off by default
    N, K, M = 64, 256, 100
    wq = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, "fp8")
    small = cuda.device_array((16 * (K + 4) + 256) // 2 + 8, np.uint16)  # room for 16 tokens at a time
    layer = QuantizedLinear(wq, cuda.device_array(N * K, np.uint16))
    layer.scratch = small
    x = f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    out = cuda.device_array((M, N), np.float32)
    layer.apply(cuda.to_device(x), out, workspace=cuda.device_array(32 << 20, np.uint8))
    xq = quantize(bf16_bits_to_f32(x), "fp8")
    assert rel_error(out.copy_to_host(), quantized_reference(xq, wq)) <= FP8_TOL


@needs_fp8_gemm
def test_apply_rmsnorm_fused_on_the_fp8_path_equals_norm_then_apply(rng, monkeypatch):
    """QKV's and gate-up's product past the GEMV: the norm and quantizer as one kernel give the same codes, so the
    same plan's output, bit for bit, as chapter 4's norm into `normed`, then apply; `normed` is left alone."""
    from tinyvllm_lib.kernels.rmsnorm import rmsnorm
    from tinyvllm_lib.layers import quantized_linear
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear

    monkeypatch.setattr(quantized_linear, "FP8_TENSOR_CORE_GEMM", True)  # the switch, off by default
    N, K, M = 3072, 2048, 40
    layer = QuantizedLinear(quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.02, "fp8"),
                            cuda.device_array(N * K, np.uint16))
    residual = cuda.to_device(rng.standard_normal((M, K)).astype(np.float32))
    weight = cuda.to_device(f32_to_bf16_bits(rng.uniform(0.5, 1.5, K).astype(np.float32)))
    workspace = cuda.device_array(32 << 20, np.uint8)
    normed = cuda.to_device(np.full((M, K), 0x7FC1, np.uint16))  # a marker the fused path must not touch
    assert layer.gemm_path(normed) == "fp8"
    fused = cuda.device_array((M, N), np.float32)
    layer.apply_rmsnorm(residual, weight, 1e-5, fused, normed, workspace=workspace)
    assert (normed.copy_to_host() == 0x7FC1).all()
    rmsnorm(residual, weight, 1e-5, normed)
    apart = cuda.device_array((M, N), np.float32)
    layer.apply(normed, apart, workspace=workspace)
    assert np.array_equal(fused.copy_to_host(), apart.copy_to_host())


@needs_fp8_gemm
def test_every_matrix_of_the_gpu_model_matches_the_numpy_mirror(tiny, rng, monkeypatch):
    """At 10 tokens each quantized matrix's product as QuantizedLlamaCuda makes it (FP8's tensor cores where the
    shape suits them, the scratch for down_proj's 40 inputs) against QuantizedLlamaNumpy(fp8_gemm_tokens=8)."""
    from tinyvllm_lib.layers import quantized_linear
    from tinyvllm_lib.layers.quantized_linear import QUANTIZED_GEMV_MAX_TOKENS
    from tinyvllm_lib.models.llama_cuda_quantized import QuantizedLlamaCuda
    from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy

    monkeypatch.setattr(quantized_linear, "FP8_TENSOR_CORE_GEMM", True)  # the switch, off by default
    config, weights = tiny
    gpu = QuantizedLlamaCuda(config, weights, "fp8", quantize_lm_head=True)
    ref = QuantizedLlamaNumpy(config, weights, "fp8", quantize_lm_head=True, bf16_activations=True,
                              fp8_gemm_tokens=QUANTIZED_GEMV_MAX_TOKENS)
    paths = {}
    for name in ("layers.0.qkv_proj", "layers.0.o_proj", "layers.0.gate_up_proj", "layers.0.down_proj", "lm_head"):
        layer = gpu.weights[name]
        N, K = layer.shape
        x = f32_to_bf16_bits(rng.standard_normal((QUANTIZED_GEMV_MAX_TOKENS + 2, K)).astype(np.float32))
        d_x = cuda.to_device(x)
        paths[name] = layer.gemm_path(d_x)
        out = cuda.device_array((len(x), N), np.float32)
        layer.apply(d_x, out, workspace=cuda.device_array(32 << 20, np.uint8))
        want = ref.linear(bf16_bits_to_f32(x), name)
        if paths[name] == "scratch":  # the weight rounded to bf16 there, as the mirror does not
            want = bf16_bits_to_f32(x) @ bf16_bits_to_f32(f32_to_bf16_bits(ref.matrices[name])).T
        assert rel_error(out.copy_to_host(), want) <= 1e-4, name
    assert paths["layers.0.gate_up_proj"] == "fp8" and paths["layers.0.down_proj"] == "scratch"
