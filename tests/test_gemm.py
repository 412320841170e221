"""Chapter 06: the GEMM ladder, the GEMV, cuBLAS's row-major wiring and the linear layer against float64 NumPy."""

import ctypes

import numpy as np
import pytest
from local_memory import local_memory_accesses
from numba import cuda

from tinyvllm_lib.kernels.activation import gemv_silu_mul, silu_mul_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.cublas import CublasGemm, cublas_available, gemm_cublas
from tinyvllm_lib.kernels.gemm import gemm_blocked, gemm_naive, gemm_shared
from tinyvllm_lib.kernels.gemv import (
    GEMV_BUCKETS,
    GEMV_EPILOGUES,
    GEMV_MAX_ACC,
    GEMV_VARIANTS,
    gemv,
    gemv_rmsnorm,
)
from tinyvllm_lib.kernels.rmsnorm import rmsnorm_ref
from tinyvllm_lib.layers import linear as linear_module
from tinyvllm_lib.layers.linear import (
    LINEAR_GEMV_MAX_TOKENS,
    NORM_IN_GEMV_MAX_ROWS,
    gemv_wins_up_to,
    linear,
    linear_path,
    norm_in_gemv,
    rmsnorm_linear,
    rmsnorm_linear_silu_mul,
    silu_in_gemv,
)
from tinyvllm_lib.measure import load_records
from tinyvllm_lib.measure import max_rel_error as rel_error
from tinyvllm_lib.runtime import can_launch, is_simulator

TOL = 1e-4  # max|got - want| / max|want|, float32 accumulation against float64
needs_launch = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
needs_cublas = pytest.mark.skipif(not cublas_available(), reason="needs a GPU and nvmath-python")
LLAMA_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]  # (N, K): qkv, o, gate_up, down, lm_head


def random_bf16(rng, shape, scale=1.0):
    return f32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def reference(x, w):
    return bf16_bits_to_f32(x).astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T


def run(launch, rng, M, N, K, **kw):
    """Launch on fresh random inputs into a NaN-poisoned output; return (result, reference)."""
    x, w = random_bf16(rng, (M, K)), random_bf16(rng, (N, K), scale=0.05)
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    launch(cuda.to_device(x), cuda.to_device(w), out, **kw)
    return out.copy_to_host(), reference(x, w)


def test_tolerance_catches_a_dropped_tail(rng):
    """Dropping the last 16 terms of K fails the tolerance by orders of magnitude; float32 sums pass it."""
    for K in (64 + 16, 1024 + 16, 8192 + 16):
        x, w = random_bf16(rng, (4, K)), random_bf16(rng, (9, K))
        want = reference(x, w)
        assert rel_error(reference(x[:, :-16], w[:, :-16]), want) > 100 * TOL
        f32 = bf16_bits_to_f32(x) @ bf16_bits_to_f32(w).T  # float32 matmul
        assert rel_error(f32, want) < TOL / 10


# --- the ladder, in the simulator: tiny odd shapes -------------------------------------------------------


@needs_launch
@pytest.mark.parametrize("launch", [gemm_naive, gemm_shared, gemm_blocked])
def test_rung_matches_reference(rng, launch):
    got, want = run(launch, rng, 19, 37, 45)  # no dimension a multiple of any tile
    assert rel_error(got, want) <= TOL


@needs_launch
def test_nan_in_x_poisons_exactly_its_row(rng):
    x, w = random_bf16(rng, (5, 24)), random_bf16(rng, (6, 24))
    x[2, 7] = 0x7FC0
    for launch in (gemm_blocked, lambda *a: gemv(*a, variant="block")):
        out = cuda.to_device(np.zeros((5, 6), np.float32))
        launch(cuda.to_device(x), cuda.to_device(w), out)
        y = out.copy_to_host()
        assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


# --- GEMV -------------------------------------------------------------------------------------------------


@needs_launch
@pytest.mark.parametrize("variant", list(GEMV_VARIANTS))
@pytest.mark.parametrize("M, N, K", [(1, 13, 100), (3, 9, 1024 + 16)])  # 25 words < one warp; a 16-value tail
def test_gemv_matches_reference(rng, variant, M, N, K):
    got, want = run(gemv, rng, M, N, K, variant=variant)
    assert rel_error(got, want) <= TOL


@needs_launch
@pytest.mark.parametrize("variant", list(GEMV_VARIANTS))
@pytest.mark.parametrize("M", [11, 16])  # more than one pass of 8 tokens: a partial and a full second pass
def test_gemv_more_tokens_than_one_pass(rng, variant, M):
    got, want = run(gemv, rng, M, 5, 136, variant=variant)
    assert rel_error(got, want) <= TOL


def rmsnorm_reference(residual, norm_weight, w, eps=1e-5):
    """RMSNorm(residual) · wᵀ: chapter 4's reference, its normed rows kept in float32 (as the fused GEMV keeps
    them, not rounded to bf16), times w in float64."""
    return rmsnorm_ref(residual, norm_weight, eps).astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T


@needs_launch
@pytest.mark.parametrize("variant", list(GEMV_VARIANTS))
@pytest.mark.parametrize("M, N, K", [(1, 13, 100), (3, 9, 1024 + 16), (11, 5, 136)])  # a tail; two passes of 8
def test_gemv_rmsnorm_matches_reference(rng, variant, M, N, K):
    residual = rng.standard_normal((M, K), dtype=np.float32) * np.float32(4)
    residual[0] *= 50  # rows of different size: each is normed by its own mean square
    norm_weight, w = random_bf16(rng, K), random_bf16(rng, (N, K), scale=0.05)
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    gemv_rmsnorm(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, cuda.to_device(w), out, variant=variant)
    assert rel_error(out.copy_to_host(), rmsnorm_reference(residual, norm_weight, w)) <= TOL


@needs_launch
@pytest.mark.parametrize("launch", [lambda *a, **k: gemv(*a, variant="warp", **k),
                                    lambda *a, **k: gemv(*a, variant="block", **k), gemm_blocked, linear])
@pytest.mark.parametrize("M, N, K", [(1, 13, 100), (11, 5, 136), (19, 37, 44)])
def test_accumulate_adds_the_product_to_out(rng, launch, M, N, K):
    if M > 16 and launch not in (gemm_blocked, linear):
        pytest.skip("the GEMV takes at most 16 token vectors")
    x, w = random_bf16(rng, (M, K)), random_bf16(rng, (N, K), scale=0.05)
    before = rng.standard_normal((M, N)).astype(np.float32)
    out = cuda.to_device(before)
    launch(cuda.to_device(x), cuda.to_device(w), out, accumulate=True)
    assert rel_error(out.copy_to_host(), before + reference(x, w)) <= TOL


@needs_launch
@pytest.mark.parametrize("variant", ["warp", "block"])
def test_gemv_rmsnorm_eps_and_zero_rows(rng, variant):
    """Rows whose mean square is near eps (where dropping or misplacing eps shows) and a row of zeros (0, not
    NaN)."""
    M, N, K = 3, 9, 100
    residual = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3e-3)  # mean square ~ 1e-5
    residual[2] = 0
    norm_weight, w = random_bf16(rng, K), random_bf16(rng, (N, K), scale=0.05)
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    gemv_rmsnorm(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, cuda.to_device(w), out, variant=variant)
    got = out.copy_to_host()
    assert rel_error(got, rmsnorm_reference(residual, norm_weight, w)) <= TOL
    assert not got[2].any()


@needs_launch
@pytest.mark.parametrize("M", [1, 3, 21])  # the GEMV (fused), and the norm kernel then the linear layer
@pytest.mark.parametrize("max_rows", [NORM_IN_GEMV_MAX_ROWS, 8])  # 8: w's 10 rows are too many to fuse
def test_rmsnorm_linear_on_every_path(rng, monkeypatch, M, max_rows):
    monkeypatch.setattr(linear_module, "NORM_IN_GEMV_MAX_ROWS", max_rows)
    K, N = 64, 10
    residual = rng.standard_normal((M, K), dtype=np.float32)
    norm_weight, w = random_bf16(rng, K), random_bf16(rng, (N, K), scale=0.3)
    normed = cuda.to_device(np.zeros((M, K), np.uint16))
    out = cuda.to_device(np.full((M, N), np.nan, np.float32))
    rmsnorm_linear(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, cuda.to_device(w), out, normed)
    fused = linear_path(normed, cuda.to_device(w)) == "gemv" and N < max_rows
    assert fused == norm_in_gemv(normed, cuda.to_device(w))
    got, want = out.copy_to_host(), rmsnorm_reference(residual, norm_weight, w)
    if fused:  # one kernel, normed untouched; float32 normed rows
        assert not normed.copy_to_host().any()
        assert rel_error(got, want) <= TOL
    else:  # the normed rows were rounded to bf16 on their way through `normed`
        assert normed.copy_to_host().any()
        assert rel_error(got, want) <= 2**-7


@needs_launch
@pytest.mark.parametrize("M", [1, 3])  # one token: the gated GEMV where silu_in_gemv; three: GEMV or GEMM + silu_mul
@pytest.mark.parametrize("max_rows", [NORM_IN_GEMV_MAX_ROWS, 8])  # 8: the norm stays out of w's 10 rows' GEMV
def test_rmsnorm_linear_silu_mul_on_every_path(rng, monkeypatch, M, max_rows):
    """The MLP's first half as the model calls it: where silu_in_gemv (one token, the norm not inside the GEMV) the
    norm kernel then the gated GEMV, gate_up left alone; elsewhere the product into gate_up, then silu_mul. Each
    within bf16 roundings of the reference (normed rows, act)."""
    monkeypatch.setattr(linear_module, "NORM_IN_GEMV_MAX_ROWS", max_rows)
    K, inter = 64, 5
    residual = rng.standard_normal((M, K), dtype=np.float32)
    norm_weight, w = random_bf16(rng, K), random_bf16(rng, (2 * inter, K), scale=0.3)
    d_w, normed = cuda.to_device(w), cuda.to_device(np.zeros((M, K), np.uint16))
    gate_up = cuda.to_device(np.full((M, 2 * inter), np.nan, np.float32))
    act = cuda.to_device(np.zeros((M, inter), np.uint16))
    gated = silu_in_gemv(normed, d_w)
    assert gated == (M == 1 and linear_path(normed, d_w) == "gemv" and not norm_in_gemv(normed, d_w))
    rmsnorm_linear_silu_mul(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, d_w, act, gate_up, normed)
    assert np.isnan(gate_up.copy_to_host()).all() == gated  # the gated GEMV writes act alone
    # the reference rounds the normed rows to bf16 where the path does (the norm kernel writes them to `normed`): an
    # unrounded reference drifts from it by more than act's rounding where a sum cancels (seed 1386823946: 1.8%)
    normed_ref = rmsnorm_ref(residual, norm_weight, 1e-5)
    if not norm_in_gemv(normed, d_w):
        normed_ref = bf16_bits_to_f32(f32_to_bf16_bits(normed_ref))
    want = silu_mul_ref((normed_ref.astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T).astype(np.float32))
    assert rel_error(bf16_bits_to_f32(act.copy_to_host()), want) <= 2**-6


def test_gemv_rmsnorm_rejects_bad_input():
    res, nw, w, out = (np.zeros((2, 8), np.float32), np.zeros(8, np.uint16), np.zeros((3, 8), np.uint16),
                       np.zeros((2, 3), np.float32))
    for bad in ((res.astype(np.uint16), nw, w, out), (res, nw[:4], w, out), (res, nw, w[:, :4], out),
                (res, nw, w, out[:, :2]), (res, nw, w, out.astype(np.float64)), (res[:, ::2], nw[:4], w[:, :4], out)):
        with pytest.raises(ValueError, match="gemv_rmsnorm: need"):
            gemv_rmsnorm(bad[0], bad[1], 1e-5, bad[2], bad[3])
    with pytest.raises(ValueError, match="multiple of 4"):
        gemv_rmsnorm(np.zeros((2, 6), np.float32), np.zeros(6, np.uint16), 1e-5, np.zeros((3, 6), np.uint16), out)
    with pytest.raises(ValueError, match="at most 16"):
        gemv_rmsnorm(np.zeros((17, 8), np.float32), nw, 1e-5, w, np.zeros((17, 3), np.float32))
    for eps in (0.0, -1e-5, float("nan"), "1e-5"):
        with pytest.raises(ValueError, match="eps must be a positive number"):
            gemv_rmsnorm(res, nw, eps, w, out)


def test_gemv_accumulators_fit_the_cap():
    for variant, config in GEMV_VARIANTS.items():
        for tokens in GEMV_BUCKETS:
            warps_per_row, rows, unroll = config(tokens)
            assert rows * tokens <= GEMV_MAX_ACC, (variant, tokens)


def test_gemv_accumulators_stay_in_registers():
    """No GEMV kernel may touch local memory: a run-time index into acc (a loop the compiler did not unroll)
    moves the array there, and the kernel still gives right answers, many times more slowly."""
    found = local_memory_accesses("tinyvllm_lib.kernels.gemv")
    assert len(found) == len(GEMV_VARIANTS) * len(GEMV_BUCKETS) * len(GEMV_EPILOGUES)
    assert not any(found.values()), f"ld.local / st.local in the PTX: {found}"


# --- the row-major trick, checked on host memory with a stand-in for cuBLAS --------------------------------


class HostCublas:
    """Stands in for nvmath.bindings.cublas on host buffers: gemm_ex reads and writes them column-major."""

    def __init__(self):
        self.calls = []

    def set_stream(self, handle, stream):
        self.calls.append(("set_stream", stream))

    def set_workspace(self, handle, ptr, nbytes):
        self.calls.append(("set_workspace", nbytes))

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c, ctype, ldc, compute, algo):
        def colmajor(ptr, dtype, rows, cols, ld):  # element (i, j) at offset i + j * ld
            itemsize = np.dtype(dtype).itemsize
            raw = (ctypes.c_char * (((cols - 1) * ld + rows) * itemsize)).from_address(ptr)
            return np.lib.stride_tricks.as_strided(np.frombuffer(raw, dtype), (rows, cols), (itemsize, ld * itemsize))

        assert (atype, btype, ctype) == ("bf16", "bf16", "f32")
        op_a = colmajor(a, np.uint16, k, m, lda).T if transa == "T" else colmajor(a, np.uint16, m, k, lda)
        op_b = colmajor(b, np.uint16, n, k, ldb).T if transb == "T" else colmajor(b, np.uint16, k, n, ldb)
        product = bf16_bits_to_f32(np.ascontiguousarray(op_a)).astype(np.float64) @ bf16_bits_to_f32(np.ascontiguousarray(op_b))
        c_mat = colmajor(c, np.float32, m, n, ldc)
        alpha, beta = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
        c_mat[...] = alpha * product + (beta * c_mat if beta != 0 else 0)  # BLAS: beta = 0 does not read C


def host_cublas_gemm():
    gemm = object.__new__(CublasGemm)  # skip __init__: no nvmath, no GPU
    gemm.cublas, gemm.handle, gemm._bound = HostCublas(), 0, None
    gemm.alpha, gemm.beta, gemm.beta_add = np.ones(1, np.float32), np.zeros(1, np.float32), np.ones(1, np.float32)
    gemm.bf16, gemm.f32, gemm.compute, gemm.algo, gemm.op_t, gemm.op_n = "bf16", "f32", 0, 0, "T", "N"
    return gemm


@pytest.mark.parametrize("M, N, K", [(3, 5, 7), (37, 13, 29), (1, 300, 64), (64, 1, 9)])
def test_cublas_arguments_compute_row_major_x_times_w_transposed(rng, M, N, K):
    gemm = host_cublas_gemm()
    x, w = random_bf16(rng, (M, K)), random_bf16(rng, (N, K))
    out = np.full((M, N), np.nan, np.float32)
    gemm.gemm(x, w, out, M, N, K)
    assert rel_error(out, reference(x, w)) <= TOL


def test_cublas_accumulate_adds_to_out(rng):
    """beta = 1: out += x · wᵀ (the residual add), in the same row-major wiring."""
    gemm = host_cublas_gemm()
    M, N, K = 5, 7, 12
    x, w = random_bf16(rng, (M, K)), random_bf16(rng, (N, K))
    before = rng.standard_normal((M, N)).astype(np.float32)
    out = before.copy()
    gemm.gemm(x, w, out, M, N, K, accumulate=True)
    assert rel_error(out, before + reference(x, w)) <= TOL
    gemm.gemm(x, w, out, M, N, K)  # and beta is 0 again after it
    assert rel_error(out, reference(x, w)) <= TOL


def test_cublas_bind_sets_stream_and_workspace_only_when_they_change():
    gemm = host_cublas_gemm()
    workspace = np.zeros(1024, np.uint8)
    gemm.bind(0)
    gemm.bind(0)
    gemm.bind(0, workspace)
    gemm.bind(0, workspace)
    gemm.bind(0)
    assert gemm.cublas.calls == [("set_stream", 0), ("set_stream", 0), ("set_workspace", 1024), ("set_stream", 0)]


# --- the linear layer and bad input -----------------------------------------------------------------------


@needs_launch
def test_linear_chooses_by_shape(rng):
    w = cuda.to_device(random_bf16(rng, (10, 64)))
    one = cuda.to_device(random_bf16(rng, (1, 64)))
    assert linear_path(one, w) == "gemv"
    few = cuda.to_device(random_bf16(rng, (LINEAR_GEMV_MAX_TOKENS + 1, 64)))  # cuBLAS won there on the H200
    assert linear_path(few, w) == ("cublas" if cublas_available() else "gemv")
    sixteen = cuda.to_device(random_bf16(rng, (16, 64)))
    assert linear_path(sixteen, w) == ("cublas" if cublas_available() else "gemv")
    big = cuda.to_device(random_bf16(rng, (21, 64)))
    assert linear_path(big, w) == ("cublas" if cublas_available() else "blocked")
    odd_k = cuda.to_device(random_bf16(rng, (1, 30)))
    assert linear_path(odd_k, cuda.to_device(random_bf16(rng, (10, 30)))) != "gemv"  # K % 4: no 8-byte rows


def test_linear_switches_where_the_recorded_data_does():
    """LINEAR_GEMV_MAX_TOKENS is the token count up to which the recorded GEMV decoding step beat cuBLAS's."""
    records = load_records("ch06_gemm")
    if records:
        records = [r for r in records if r["device"]["name"] == records[0]["device"]["name"]]
    wins = gemv_wins_up_to(records)
    if wins is None:
        pytest.skip("no decoding steps recorded (run bench/ch06_gemm.py on a GPU)")
    assert wins == LINEAR_GEMV_MAX_TOKENS, (
        f"recorded on {records[0]['device']['name']}: the GEMV beats cuBLAS up to {wins} token vectors, "
        f"but LINEAR_GEMV_MAX_TOKENS = {LINEAR_GEMV_MAX_TOKENS}: update it in chapters/06_gemm.py")


def test_gemv_wins_up_to_reads_consecutive_token_counts():
    def step(M, gemv_us, cublas_us):
        return [{"name": "decode_step_gemv", "shape": [M], "us": gemv_us},
                {"name": "decode_step_cublas", "shape": [M], "us": cublas_us}]

    assert gemv_wins_up_to([]) is None
    assert gemv_wins_up_to(step(1, 900, 850)) == 0
    assert gemv_wins_up_to(step(1, 800, 850) + step(2, 840, 850) + step(3, 900, 850) + step(4, 800, 850)) == 2
    assert gemv_wins_up_to(step(1, 800, 850) + step(3, 800, 850)) == 1  # 2 unmeasured: no claim past it


@needs_launch
@pytest.mark.parametrize("M, K", [(1, 64), (3, 64), (21, 20), (2, 30)])
def test_linear_matches_reference(rng, M, K):
    got, want = run(linear, rng, M, 10, K)
    assert rel_error(got, want) <= TOL


def test_bad_input_is_rejected_before_launch():
    x, w, out = np.zeros((2, 8), np.uint16), np.zeros((3, 8), np.uint16), np.zeros((2, 3), np.float32)
    for launch in (gemm_naive, gemm_shared, gemm_blocked, gemv, linear, gemm_cublas):
        with pytest.raises(TypeError, match="uint16"):
            launch(x.astype(np.float32), w, out)
        with pytest.raises(TypeError, match="float32"):
            launch(x, w, out.astype(np.float64))
        with pytest.raises(ValueError, match="in_features"):
            launch(x, np.zeros((3, 9), np.uint16), out)
        with pytest.raises(ValueError, match="shape"):
            launch(x, w, np.zeros((3, 2), np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            launch(np.zeros((8, 2), np.uint16).T, w, out)
        with pytest.raises(ValueError, match="2-D"):
            launch(x.ravel(), w, out)
    with pytest.raises(TypeError, match="device arrays"):
        linear(x, w, out)  # host arrays: linear copies nothing
    with pytest.raises(ValueError, match="at most 16"):
        gemv(np.zeros((17, 8), np.uint16), w, np.zeros((17, 3), np.float32))
    with pytest.raises(ValueError, match="multiple of 4"):
        gemv(np.zeros((2, 6), np.uint16), np.zeros((3, 6), np.uint16), out)
    with pytest.raises(ValueError, match="8-byte"):
        gemv(np.zeros(17, np.uint16)[1:].reshape(2, 8), w, out)  # rows start off an 8-byte boundary
    with pytest.raises(ValueError, match="variant"):
        gemv(x, w, out, variant="fast")


@pytest.mark.skipif(not is_simulator(), reason="simulator only")
def test_cublas_is_reported_unavailable_in_the_simulator():
    assert not cublas_available()
    with pytest.raises(RuntimeError, match="unavailable"):
        gemm_cublas(cuda.to_device(np.zeros((2, 8), np.uint16)), cuda.to_device(np.zeros((3, 8), np.uint16)),
                    cuda.device_array((2, 3), np.float32))


# --- on a GPU: real shapes, cuBLAS, CUDA graphs -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", LLAMA_1B + [(2048, 2048 + 16)])  # and a 16-value tail past a block's 2048
def test_gemv_llama_shapes(rng, N, K):
    w = random_bf16(rng, (N, K), scale=0.05)
    d_w, w64 = cuda.to_device(w), bf16_bits_to_f32(w).astype(np.float64)
    for M in (1, 2, 5, 9, 16):
        x = random_bf16(rng, (M, K))
        want = bf16_bits_to_f32(x).astype(np.float64) @ w64.T
        for variant in ("auto", *GEMV_VARIANTS):
            out = cuda.to_device(np.full((M, N), np.nan, np.float32))
            gemv(cuda.to_device(x), d_w, out, variant=variant)
            assert rel_error(out.copy_to_host(), want) <= TOL, (M, N, K, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", LLAMA_1B)
def test_gemv_epilogues_llama_shapes(rng, N, K):
    """The residual add and the norm in the GEMV, at the decode shapes the model runs them on."""
    w = random_bf16(rng, (N, K), scale=0.05)
    d_w = cuda.to_device(w)
    for M in (1, 2, 9):
        x, residual = random_bf16(rng, (M, K)), rng.standard_normal((M, K), dtype=np.float32)
        norm_weight, before = random_bf16(rng, K), rng.standard_normal((M, N)).astype(np.float32)
        for variant in ("auto", *GEMV_VARIANTS):
            out = cuda.to_device(before)
            gemv(cuda.to_device(x), d_w, out, variant=variant, accumulate=True)
            assert rel_error(out.copy_to_host(), before + reference(x, w)) <= TOL, (M, N, K, variant)
            out = cuda.to_device(np.full((M, N), np.nan, np.float32))
            gemv_rmsnorm(cuda.to_device(residual), cuda.to_device(norm_weight), 1e-5, d_w, out, variant=variant)
            want = rmsnorm_reference(residual, norm_weight, w)
            assert rel_error(out.copy_to_host(), want) <= TOL, (M, N, K, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [gemm_naive, gemm_shared, gemm_blocked])
def test_rung_real_sizes(rng, launch):
    for M, N, K in [(300, 3072, 2048), (129, 257, 8192 + 13), (1, 1, 7)]:  # partial tiles of k
        got, want = run(launch, rng, M, N, K)
        assert rel_error(got, want) <= TOL, (M, N, K)


@pytest.mark.gpu
@needs_cublas
@pytest.mark.parametrize("M, N, K", [(2048, 3072, 2048), (37, 16384, 2048), (1000, 2048, 8192), (3, 5, 7), (513, 129, 1000)])
def test_cublas_non_square(rng, M, N, K):
    got, want = run(gemm_cublas, rng, M, N, K)
    assert rel_error(got, want) <= TOL


@pytest.mark.gpu
def test_linear_in_a_cuda_graph(rng):
    """Decode-sized (GEMV) and prefill-sized (cuBLAS or rung 3) calls captured together replay on new inputs."""
    from tinyvllm_lib.cuda_graph import CudaGraph

    N, K = 3072, 2048
    w = cuda.to_device(random_bf16(rng, (N, K), 0.05))
    x1, x2 = cuda.device_array((1, K), np.uint16), cuda.device_array((300, K), np.uint16)
    y1, y2 = cuda.device_array((1, N), np.float32), cuda.device_array((300, N), np.float32)
    workspace = cuda.device_array(32 * 2**20, np.uint8)
    graph = CudaGraph(lambda s: (linear(x1, w, y1, stream=s), linear(x2, w, y2, stream=s, workspace=workspace)))
    for _ in range(2):
        a, b = random_bf16(rng, (1, K)), random_bf16(rng, (300, K))
        x1.copy_to_device(a, stream=graph.stream)
        x2.copy_to_device(b, stream=graph.stream)
        graph.replay()
        graph.stream.synchronize()
        w_host = w.copy_to_host()
        assert rel_error(y1.copy_to_host(), reference(a, w_host)) <= TOL
        assert rel_error(y2.copy_to_host(), reference(b, w_host)) <= TOL


# --- the gated GEMV: chapter 7's SiLU(gate) * up fused into the product --------------------------------------


def gated_reference(x, w):
    product = reference(x, w).astype(np.float32)
    return silu_mul_ref(product)


@needs_launch
@pytest.mark.parametrize("M, I, K", [(1, 9, 100), (3, 5, 36), (11, 4, 64)])  # a partial tail; two passes of 8 tokens
def test_gemv_silu_mul_matches_reference(rng, M, I, K):
    x, w = random_bf16(rng, (M, K)), random_bf16(rng, (2 * I, K), scale=0.3)
    want = gated_reference(x, w)
    out = cuda.to_device(np.full((M, I), np.nan, np.float32))
    gemv_silu_mul(cuda.to_device(x), cuda.to_device(w), out)
    assert rel_error(out.copy_to_host(), want) <= TOL
    bits = cuda.to_device(np.full((M, I), 0x7FC0, np.uint16))  # bf16 out, as the model's down_proj reads it
    gemv_silu_mul(cuda.to_device(x), cuda.to_device(w), bits)
    assert rel_error(bf16_bits_to_f32(bits.copy_to_host()), want) <= 2**-7


def test_gemv_silu_mul_rejects_bad_shapes():
    x, w = np.zeros((1, 8), np.uint16), np.zeros((5, 8), np.uint16)
    with pytest.raises(ValueError, match="w \\(2 I, K\\)"):
        gemv_silu_mul(x, w, np.zeros((1, 2), np.float32))  # an odd number of rows
    with pytest.raises(TypeError, match="bf16 bits"):
        gemv_silu_mul(x.astype(np.float32), np.zeros((4, 8), np.uint16), np.zeros((1, 2), np.float32))


@pytest.mark.gpu
def test_gemv_silu_mul_llama_shape(rng):
    x, w = random_bf16(rng, (1, 2048)), random_bf16(rng, (2 * 8192, 2048), scale=0.05)
    out = cuda.to_device(np.full((1, 8192), np.nan, np.float32))
    gemv_silu_mul(cuda.to_device(x), cuda.to_device(w), out)
    assert rel_error(out.copy_to_host(), gated_reference(x, w)) <= TOL
