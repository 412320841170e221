"""Chapter 15: the 8-bit GEMVs (int8, FP8 e4m3; plain, residual add, RMSNorm) and the dequantizing kernel against
NumPy (chapter 15's quantize/dequantize, float64 sums), in the simulator at tiny odd shapes."""

import types

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.activation import silu_mul_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.dequantize_8bit import dequantize_to_bf16
from tinyvllm_lib.kernels.gemv import GEMV_THREADS
from tinyvllm_lib.kernels.gemv_8bit import (
    ONE_TOKEN_BLOCK_KNOBS,
    compiled_blocks_per_sm,
    gemv_8bit,
    gemv_8bit_rmsnorm,
    make_gemv_8bit_kernel,
    pick_gemv_8bit_kernel,
)
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.measure import max_rel_error as rel_error
from tinyvllm_lib.quantization.formats import quantize
from tinyvllm_lib.runtime import can_launch

TOL = 1e-4  # max|got - want| / max|want|: float32 accumulation against float64, as chapter 6's GEMV tests
needs_launch = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
METHODS = ["int8", "fp8"]


def random_bf16(rng, shape, scale=1.0):
    return f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def random_weight(rng, method, N, K):
    """An 8-bit weight of rows of different sizes (each its own scale)."""
    w = rng.standard_normal((N, K), dtype=np.float32) * rng.uniform(0.01, 0.2, (N, 1)).astype(np.float32)
    return quantize(w, method)


def reference(x_f32, q):
    return x_f32.astype(np.float64) @ q.dequantize().astype(np.float64).T


def launch_gemv(x, q, out, **kw):
    gemv_8bit(cuda.to_device(x), cuda.to_device(q.codes), cuda.to_device(q.scales), out, q.method, **kw)


@needs_launch
@pytest.mark.parametrize("method", METHODS)
# 9 words; staged in two pieces, the second of 1 word; two passes; two passes of two pieces
@pytest.mark.parametrize("M, N, K", [(1, 11, 72), (3, 9, 2056), (11, 5, 136), (11, 5, 1032)])
def test_gemv_8bit_matches_reference(rng, method, M, N, K):
    x, q = random_bf16(rng, (M, K)), random_weight(rng, method, N, K)
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    launch_gemv(x, q, out)
    assert rel_error(out.copy_to_host(), reference(bf16_bits_to_f32(x), q)) <= TOL


@needs_launch
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("M", [1, 5])
def test_gemv_8bit_accumulate_adds_to_out(rng, method, M):
    N, K = 9, 136
    x, q = random_bf16(rng, (M, K)), random_weight(rng, method, N, K)
    before = rng.standard_normal((M, N)).astype(np.float32)
    out = cuda.to_device(before)
    launch_gemv(x, q, out, accumulate=True)
    assert rel_error(out.copy_to_host(), before + reference(bf16_bits_to_f32(x), q)) <= TOL


@needs_launch
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("M, N, K", [(1, 13, 104), (3, 9, 1032), (11, 5, 1032)])  # the last: squares of 2 pieces
def test_gemv_8bit_rmsnorm_matches_reference(rng, method, M, N, K):
    residual = rng.standard_normal((M, K), dtype=np.float32) * np.float32(4)
    residual[0] *= 50  # rows of different size: each is normed by its own mean square
    norm_weight, q = random_bf16(rng, K), random_weight(rng, method, N, K)
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    gemv_8bit_rmsnorm(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, cuda.to_device(q.codes),
                      cuda.to_device(q.scales), out, method)
    want = reference(rmsnorm_ref(residual, norm_weight, 1e-5), q)  # the normed rows kept in float32
    assert rel_error(out.copy_to_host(), want) <= TOL


@needs_launch
@pytest.mark.parametrize("method", METHODS)
def test_nan_in_x_poisons_exactly_its_row(rng, method):
    x, q = random_bf16(rng, (3, 64)), random_weight(rng, method, 6, 64)
    x[1, 9] = 0x7FC0
    out = cuda.to_device(np.zeros((3, 6), np.float32))
    launch_gemv(x, q, out)
    y = out.copy_to_host()
    assert np.isnan(y[1]).all() and np.isfinite(np.delete(y, 1, axis=0)).all()


@needs_launch
def test_fp8_nan_code_poisons_exactly_its_output():
    """S.1111.111 is NaN, not 480: the widening must say so."""
    rng = np.random.default_rng()
    x, q = random_bf16(rng, (2, 64)), random_weight(rng, "fp8", 5, 64)
    q.codes[3, 17] = 0xFF
    out = cuda.to_device(np.zeros((2, 5), np.float32))
    launch_gemv(x, q, out)
    y = out.copy_to_host()
    assert np.isnan(y[:, 3]).all() and np.isfinite(np.delete(y, 3, axis=1)).all()


@needs_launch
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_8bit_block_variant(rng, method, M):
    """The variant a GPU runs for fewer than 16,384 rows (the simulator's "auto" takes a warp a row): plain,
    residual add and RMSNorm, with two rows more than a block's group, so the second group is short. int8 with
    K = 4,104 (513 words): a whole pass of every thread's words ahead, then a short one (FP8 widens a code at a time
    in the simulator's Python: a short row)."""
    kernel, _ = pick_gemv_8bit_kernel("test", method, M, 10, "", variant="block")
    if M == 1:  # one token's knobs: 8 rows a group
        assert kernel.rows_per_block == ONE_TOKEN_BLOCK_KNOBS[""][1] == 8
    N, K = kernel.rows_per_block + 2, 4104 if method == "int8" else 72
    x, q = random_bf16(rng, (M, K)), random_weight(rng, method, N, K)
    codes, scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
    plain = cuda.to_device(np.full((M, N), np.nan, np.float32))
    gemv_8bit(cuda.to_device(x), codes, scales, plain, method, variant="block")
    assert rel_error(plain.copy_to_host(), reference(bf16_bits_to_f32(x), q)) <= TOL
    before = rng.standard_normal((M, N)).astype(np.float32)
    added = cuda.to_device(before)
    gemv_8bit(cuda.to_device(x), codes, scales, added, method, accumulate=True, variant="block")
    assert rel_error(added.copy_to_host(), before + reference(bf16_bits_to_f32(x), q)) <= TOL
    residual, norm_weight = rng.standard_normal((M, K), dtype=np.float32), random_bf16(rng, K)
    normed = cuda.to_device(np.full((M, N), np.nan, np.float32))
    gemv_8bit_rmsnorm(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, codes, scales, normed, method,
                      variant="block")
    assert rel_error(normed.copy_to_host(), reference(rmsnorm_ref(residual, norm_weight, 1e-5), q)) <= TOL


@needs_launch
@pytest.mark.parametrize("method", METHODS)
def test_gemv_8bit_widens_every_code_exactly(rng, method):
    """Every code of the format (int8: -128 too; fp8: all but NaN) times one-hot inputs: each output is one weight,
    scale times value, bit for bit (int8 by a byte permute and a subtraction; fp8 through float16, subnormals
    included)."""
    codes = np.arange(256, dtype=np.uint16).astype(np.uint8).reshape(8, 32)
    if method == "int8":
        codes = codes.view(np.int8).copy()
    else:
        codes[(codes & 0x7F) == 0x7F] = 0x7E
    scales = rng.uniform(1e-3, 2, 8).astype(np.float32)
    q = type(random_weight(rng, method, 1, 8))(method, codes, scales)
    want = q.dequantize()  # (8, 32) float32: scale * value
    for first in (0, 16):  # 16 token vectors a launch: x = the identity's rows first .. first + 15
        x = f32_to_bf16_bits(np.eye(32, dtype=np.float32)[first:first + 16])
        out = cuda.to_device(np.full((16, 8), np.nan, np.float32))
        gemv_8bit(cuda.to_device(x), cuda.to_device(codes), cuda.to_device(scales), out, method)
        assert np.array_equal(out.copy_to_host(), want[:, first:first + 16].T)


@needs_launch
@pytest.mark.parametrize("method", METHODS)
def test_gemv_8bit_rows_of_large_and_small_scale(rng, method):
    """A row whose largest weight is 2e5 (its FP8 scale past 2^8) beside rows of 1e-3: finite and equal to NumPy,
    each row against its own size."""
    M, N, K = 2, 3, 64
    w = rng.standard_normal((N, K), dtype=np.float32)
    w[0] *= np.float32(2e5) / np.abs(w[0]).max()
    w[1:] *= np.float32(1e-3)
    q, x = quantize(w, method), random_bf16(rng, (M, K))
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    launch_gemv(x, q, out)
    got, want = out.copy_to_host(), reference(bf16_bits_to_f32(x), q)
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - want) / np.abs(want).max(axis=0)) <= TOL  # each row against its own size


@needs_launch
@pytest.mark.parametrize("method", METHODS)
def test_dequantize_to_bf16_every_code(rng, method):
    """Every code of the format in one weight (and random scales): bf16 of scale times value, bit for bit."""
    codes = np.arange(256, dtype=np.uint16).astype(np.uint8).reshape(8, 32)
    if method == "int8":
        codes = codes.view(np.int8).copy()
        codes[codes == -128] = -127  # never made by quantize
    else:
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN in a weight
    scales = rng.uniform(1e-3, 2, 8).astype(np.float32)
    q = type(random_weight(rng, method, 1, 8))(method, codes, scales)
    out = cuda.to_device(np.zeros((8, 32), np.uint16))
    dequantize_to_bf16(cuda.to_device(codes), cuda.to_device(scales), out, method)
    assert np.array_equal(out.copy_to_host(), f32_to_bf16_bits(q.dequantize()))


def silu_mul_bits(gate_up):
    """Chapter 7's silu_mul kernel on float32 [gate | up] rows: its bf16 bits."""
    from tinyvllm_lib.kernels.activation import silu_mul

    act = cuda.device_array((gate_up.shape[0], gate_up.shape[1] // 2), np.uint16)
    silu_mul(cuda.to_device(gate_up), act)
    return act.copy_to_host()


@needs_launch
@pytest.mark.parametrize("variant", ["warp", "block"])
@pytest.mark.parametrize("norm", [False, True])
# I = 7 gate rows: no group of rows is full; 3 tokens and K = 2056 (257 words; 256 staged at a time at bucket 4):
# the input staged in two pieces (int8 only: the simulator widens FP8 a code at a time in Python, minutes at that
# size); 11 tokens: two passes
@pytest.mark.parametrize("method, M, K", [("int8", 1, 72), ("fp8", 1, 72), ("int8", 3, 2056), ("int8", 11, 72),
                                          ("fp8", 11, 72)])
def test_gated_gemv_8bit_is_the_gemv_then_silu_mul(rng, method, variant, norm, M, K):
    """gated=True writes what the same GEMV into float32 [gate | up], then silu_mul, write: bit for bit (the sums
    are made in the same order, the SiLU is the same expression); and that is SiLU·up of the float64 products,
    rounded to bf16."""
    I = 7
    q = random_weight(rng, method, 2 * I, K)
    codes, scales = cuda.to_device(q.codes), cuda.to_device(q.scales)
    gate_up = cuda.to_device(np.full((M, 2 * I), np.nan, np.float32))
    act = cuda.to_device(np.full((M, I), 0xFFFF, np.uint16))
    if norm:
        residual = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3)
        norm_weight = random_bf16(rng, K)
        args = (cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, codes, scales)
        gemv_8bit_rmsnorm(*args, gate_up, method, variant=variant)
        gemv_8bit_rmsnorm(*args, act, method, variant=variant, gated=True)
        x_f32 = rmsnorm_ref(residual, norm_weight, 1e-5)
    else:
        x = random_bf16(rng, (M, K))
        gemv_8bit(cuda.to_device(x), codes, scales, gate_up, method, variant=variant)
        gemv_8bit(cuda.to_device(x), codes, scales, act, method, variant=variant, gated=True)
        x_f32 = bf16_bits_to_f32(x)
    got = act.copy_to_host()
    assert np.array_equal(got, silu_mul_bits(gate_up.copy_to_host()))
    want = silu_mul_ref(reference(x_f32, q))
    assert np.max(np.abs(bf16_bits_to_f32(got) - want)) <= 2.0**-8 * np.max(np.abs(want))


@needs_launch
def test_bad_operands_are_value_errors(rng):
    q = random_weight(rng, "int8", 4, 20)  # K = 20: not a multiple of 8
    out = cuda.to_device(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="K=20 must be a multiple of 8"):
        launch_gemv(random_bf16(rng, (1, 20)), q, out)
    q = random_weight(rng, "fp8", 4, 16)
    with pytest.raises(ValueError, match="need int8 codes"):
        gemv_8bit(cuda.to_device(random_bf16(rng, (1, 16))), cuda.to_device(q.codes), cuda.to_device(q.scales), out,
                  "int8")
    with pytest.raises(ValueError, match="1 to 16 token vectors"):
        launch_gemv(random_bf16(rng, (17, 16)), q, cuda.to_device(np.zeros((17, 4), np.float32)))
    q, x = random_weight(rng, "int8", 4, 16), random_bf16(rng, (1, 16))
    with pytest.raises(ValueError, match=r"need out \(1, 2\) uint16"):  # gated: (M, N / 2) bf16 bits
        launch_gemv(x, q, cuda.to_device(np.zeros((1, 2), np.float32)), gated=True)
    with pytest.raises(ValueError, match="adds to nothing"):
        launch_gemv(x, q, cuda.to_device(np.zeros((1, 2), np.uint16)), gated=True, accumulate=True)
    with pytest.raises(ValueError, match="N even"):
        launch_gemv(x, random_weight(rng, "int8", 5, 16), cuda.to_device(np.zeros((1, 2), np.uint16)), gated=True)


# --- the 8-bit model on the GPU (simulator): chapter 7's tiny Llama ---


def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@needs_launch
@pytest.mark.parametrize("method, head, num_tokens", [("int8", False, 2), ("fp8", True, 10)])
def test_quantized_kernel_model_matches_numpy(tmp_path, rng, method, head, num_tokens):
    """2 tokens: the 8-bit GEMVs (the norm fused into qkv's; into gate-up's with SiLU·up, GATED_GEMV_8BIT); 10: past QUANTIZED_GEMV_MAX_TOKENS, the
    GEMM path (the dequantized scratch and chapter 6's GEMM; FP8 on FP8 tensor cores where the GPU has them). Against QuantizedLlamaNumpy with bf16 linear inputs, as chapter 7's
    kernel model is against LlamaNumpy (same measure, same tolerance)."""
    from test_llama_forward import assert_kernel_model_matches

    from tinyvllm_lib.layers.quantized_linear import (
        QUANTIZED_GEMV_MAX_TOKENS,
        QuantizedLinear,
    )
    from tinyvllm_lib.models.config import ModelConfig
    from tinyvllm_lib.models.llama_cuda_quantized import QuantizedLlamaCuda
    from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy
    from tinyvllm_lib.models.loader import load_weights
    from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

    assert (num_tokens <= QUANTIZED_GEMV_MAX_TOKENS) == (num_tokens == 2)
    cfg = tiny_llama_config(hidden_size=32, intermediate_size=40, vocab_size=64, head_dim=8, tie_word_embeddings=True)
    folder = make_random_llama(tmp_path, cfg, seed=int(rng.integers(1000)))
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    gpu = QuantizedLlamaCuda(config, weights, method, quantize_lm_head=head)
    assert isinstance(gpu.weights["layers.1.down_proj"], QuantizedLinear)
    assert isinstance(gpu.weights["lm_head"], QuantizedLinear) == head
    assert not isinstance(gpu.weights["embed_tokens"], QuantizedLinear)
    ids, positions = rng.integers(0, 64, num_tokens), np.arange(5, 5 + num_tokens)
    ours = log_softmax(gpu.forward(ids, positions))
    # past the GEMV's tokens FP8 matrices take the FP8 GEMM where the GPU has it: the mirror rounds their inputs too
    from tinyvllm_lib.kernels.cublaslt_fp8 import get_cublaslt_fp8
    from tinyvllm_lib.layers import quantized_linear

    fp8_gemm = method == "fp8" and quantized_linear.FP8_TENSOR_CORE_GEMM and get_cublaslt_fp8() is not None
    ref = QuantizedLlamaNumpy(config, weights, method, quantize_lm_head=head, bf16_activations=True,
                              fp8_gemm_tokens=QUANTIZED_GEMV_MAX_TOKENS if fp8_gemm else None)
    assert_kernel_model_matches(ours, log_softmax(ref.forward(ids, positions)))


@needs_launch
@pytest.mark.parametrize("method", ["int8", pytest.param("fp8", marks=pytest.mark.gpu)])  # the simulator: one
def test_quantized_model_on_the_tensor_cores_matches_numpy(tmp_path, rng, monkeypatch, method):
    """6 tokens past the GEMV's limit with every K a multiple of 64: every matrix, the LM head too, takes mma_8bit (the norm first,
    gate-up's SiLU·up inside; in the simulator only where QUANTIZED_MMA_MAX_TOKENS is set, as here), against
    QuantizedLlamaNumpy as the test above."""
    from test_llama_forward import assert_kernel_model_matches

    from tinyvllm_lib.layers import quantized_linear
    from tinyvllm_lib.models.config import ModelConfig
    from tinyvllm_lib.models.llama_cuda_quantized import QuantizedLlamaCuda
    from tinyvllm_lib.models.llama_quantized import QuantizedLlamaNumpy
    from tinyvllm_lib.models.loader import load_weights
    from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

    monkeypatch.setattr(quantized_linear, "QUANTIZED_MMA_MAX_TOKENS", 16)
    cfg = tiny_llama_config(hidden_size=64, intermediate_size=128, vocab_size=64, head_dim=16,
                            tie_word_embeddings=True)
    folder = make_random_llama(tmp_path, cfg, seed=int(rng.integers(1000)))
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config, progress=False)
    gpu = QuantizedLlamaCuda(config, weights, method, quantize_lm_head=True)  # the head's float32 logits too
    ids, positions = rng.integers(0, 64, 6), np.arange(3, 9)
    paths = {name: w.gemm_path(types.SimpleNamespace(shape=(6, w.shape[1])))
             for name, w in gpu.weights.items() if isinstance(w, quantized_linear.QuantizedLinear)}
    assert set(paths.values()) == {"mma"}, paths
    ours = log_softmax(gpu.forward(ids, positions))
    ref = QuantizedLlamaNumpy(config, weights, method, quantize_lm_head=True, bf16_activations=True)
    assert_kernel_model_matches(ours, log_softmax(ref.forward(ids, positions)))


def test_shapes_the_kernels_cannot_take_are_a_value_error():
    from tinyvllm_lib.models.config import ModelConfig
    from tinyvllm_lib.models.llama_cuda_quantized import check_quantizable
    from tinyvllm_lib.models.random_llama import tiny_llama_config

    config = ModelConfig.from_dict(tiny_llama_config(intermediate_size=132))  # down_proj: 132 inputs
    with pytest.raises(ValueError, match="down_proj has 132 inputs"):
        check_quantizable(config)
    check_quantizable(ModelConfig.from_dict(tiny_llama_config()))  # 64 and 128: fine


@needs_launch
@pytest.mark.parametrize("method, M, bucket, K, knobs, kind", [
    # 1,025 words at one token: a first piece of 1,024 (4 words a thread, every one staged ahead), a second of 1
    ("int8", 1, 1, 8200, (8, 4, 1), "add"),
    ("fp8", 1, 1, 136, (1, 2, 2), ""),  # a warp 2 rows
    ("int8", 11, 8, 72, (8, 4, 1), "add"),  # 11 tokens in buckets of 8: two passes, each reading its residual
])
def test_staging_ahead_gives_the_same_bits(rng, method, M, bucket, K, knobs, kind):
    """stage_ahead=4 issues the input's loads four words of codes' worth at a time before staging any: the same
    staged floats as one at a time, so the same bits, and the reference's values (the add epilogue reading out
    before the sums are made)."""
    N = 11
    q = random_weight(rng, method, N, K)
    add = kind == "add"
    x, prior = random_bf16(rng, (M, K)), rng.standard_normal((M, N), dtype=np.float32)
    outs = []
    for ahead in (1, 4):
        kernel = make_gemv_8bit_kernel(method, bucket, *knobs, accumulate=add, stage_ahead=ahead)
        out = cuda.to_device(prior.copy())
        kernel[1, GEMV_THREADS](cuda.to_device(x).view(np.uint64), cuda.to_device(q.codes).view(np.uint64),
                                cuda.to_device(q.scales), out)  # one block: it takes every group in turn
        outs.append(out.copy_to_host())
    assert np.array_equal(outs[0], outs[1])
    product = reference(bf16_bits_to_f32(x), q)
    assert rel_error(outs[1], product + prior if add else product) <= TOL


@pytest.mark.parametrize("tokens, registers, shared_kib, want", [
    (1, 80, 228, 3), (1, 96, 228, 2), (1, 56, 228, 4), (1, 128, 228, 2), (1, 168, 228, 1),  # Hopper: registers
    (1, 56, 100, 3),  # 100 KiB of shared memory an SM: 33 KiB blocks (the stage, the sums, 1 KiB kept), three
    (8, 56, 100, 2),  # ... but 4 rows x 8 tokens of sums make them 34 KiB: two
    (1, 24, 228, 6),  # few registers: shared memory decides
])
def test_compiled_blocks_per_sm_counts_what_an_sm_holds(tokens, registers, shared_kib, want):
    device = types.SimpleNamespace(MAX_REGISTERS_PER_MULTIPROCESSOR=65536,
                                   MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=shared_kib * 1024,
                                   MAX_THREADS_PER_MULTIPROCESSOR=2048)
    kernel = make_gemv_8bit_kernel("int8", tokens, 8, 4, 1)
    assert compiled_blocks_per_sm(device, registers, kernel.shared_bytes) == want


def test_resident_blocks_counts_a_compiled_kernel_once(monkeypatch):
    """Off the simulator: the estimate before the first launch, then the count from the compiled registers, made
    once (the launcher's path on a GPU, with a made-up kernel and device)."""
    from tinyvllm_lib.kernels import gemv_8bit

    device = types.SimpleNamespace(MAX_REGISTERS_PER_MULTIPROCESSOR=65536,
                                   MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=228 * 1024,
                                   MAX_THREADS_PER_MULTIPROCESSOR=2048)
    asked = []

    class Kernel:
        blocks_per_sm, shared_bytes, overloads = 4, 33028, {}

        def get_regs_per_thread(self):
            asked.append(1)
            return {"sig": 96}

    monkeypatch.setattr(gemv_8bit, "config", types.SimpleNamespace(ENABLE_CUDASIM=False))
    monkeypatch.setattr(gemv_8bit.cuda, "get_current_device", lambda: device)
    monkeypatch.setattr(gemv_8bit, "multiprocessors", lambda: 132)
    kernel = Kernel()
    assert gemv_8bit.resident_blocks(kernel) == 4 * 132  # not compiled yet: the estimate
    kernel.overloads = {"sig": object()}
    assert gemv_8bit.resident_blocks(kernel) == 2 * 132  # 96 registers: two blocks of 8 warps
    assert gemv_8bit.resident_blocks(kernel) == 2 * 132 and len(asked) == 1


def test_a_weight_takes_its_own_gemv_limit_and_variant(monkeypatch):
    """QuantizedLinear's path and GEMV variant: the module's QUANTIZED_GEMV_MAX_TOKENS and QUANTIZED_GEMV_VARIANT
    unless the weight sets its own (as the benchmark does to time each); one token always takes the launcher's own
    knobs ("auto"); and apply passes the variant on to the GEMV it launches."""
    from tinyvllm_lib.layers import quantized_linear
    from tinyvllm_lib.layers.quantized_linear import QuantizedLinear

    layer = object.__new__(QuantizedLinear)  # no GPU copy needed to pick a path
    layer.method, layer.shape, layer.scratch = "int8", (80, 32), np.zeros(80 * 32, np.uint16)
    layer.codes = layer.scales = None  # the fake GEMV below reads neither

    def tokens(m):
        return types.SimpleNamespace(shape=(m, 32))

    limit = quantized_linear.QUANTIZED_GEMV_MAX_TOKENS
    assert layer.gemm_path(tokens(limit)) == "gemv" and layer.gemm_path(tokens(limit + 1)) == "scratch"
    monkeypatch.setattr(quantized_linear, "QUANTIZED_GEMV_MAX_TOKENS", 2)
    assert layer.gemm_path(tokens(3)) == "scratch"
    layer.gemv_max_tokens = 16
    assert layer.gemm_path(tokens(16)) == "gemv"
    layer.gemv_max_tokens = 0
    assert layer.gemm_path(tokens(1)) == "scratch"
    monkeypatch.setattr(quantized_linear, "QUANTIZED_GEMV_VARIANT", "block")
    assert layer.variant_for(tokens(3)) == "block" and layer.variant_for(tokens(1)) == "auto"
    layer.gemv_variant = "warp"
    assert layer.variant_for(tokens(3)) == "warp" and layer.variant_for(tokens(1)) == "auto"
    seen = []
    monkeypatch.setattr(quantized_linear, "gemv_8bit", lambda *args: seen.append(args[-1]))
    layer.gemv_max_tokens = 16
    for m in (1, 3):
        layer.apply(cuda.to_device(np.zeros((m, 32), np.uint16)), cuda.to_device(np.zeros((m, 80), np.float32)))
    assert seen == ["auto", "warp"]
