"""Chapter 07: softmax and attention references, both attention kernels and silu_mul against them."""

import math

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.activation import silu_mul, silu_mul_ref
from tinyvllm_lib.kernels.attention import (
    attention_flops,
    attention_ref,
    flash_attention,
    softmax_ref,
    split_qkv,
)
from tinyvllm_lib.kernels.attention_materialized import attention_materialized
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.measure import max_rel_error
from tinyvllm_lib.runtime import can_launch

needs_kernels = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")


def random_qkv(rng, num_tokens, num_heads, num_kv_heads, head_dim) -> np.ndarray:
    qkv = rng.standard_normal((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).astype(np.float32)
    qkv[:, : num_heads * head_dim] *= 3  # peaked attention
    return qkv


def attention_loops(qkv, num_heads, num_kv_heads, head_dim) -> np.ndarray:
    """Attention by the definition, one query and one head at a time, in float64."""
    q, k, v = (a.astype(np.float64) for a in split_qkv(qkv, num_heads, num_kv_heads, head_dim))
    out = np.zeros((qkv.shape[0], num_heads * head_dim))
    for i in range(qkv.shape[0]):
        for h in range(num_heads):
            g = h // (num_heads // num_kv_heads)
            s = np.array([q[i, h] @ k[j, g] for j in range(i + 1)]) / math.sqrt(head_dim)
            p = np.exp(s - s.max())
            out[i, h * head_dim : (h + 1) * head_dim] = (p / p.sum()) @ v[: i + 1, g]
    return out


# --- the NumPy references ---


def test_softmax_ref_is_safe():
    s = np.array([[3.0, 1.0, 0.2], [1000.0, 999.0, -np.inf]], np.float32)
    p = softmax_ref(s)
    assert np.all(np.isfinite(p)) and np.allclose(p.sum(-1), 1)
    assert np.allclose(p[0], np.exp([3, 1, 0.2]) / np.exp([3, 1, 0.2]).sum(), rtol=1e-6)
    assert p[1, 2] == 0


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (9, 4, 2, 16), (13, 6, 3, 8), (5, 2, 2, 4)])
def test_attention_ref_is_the_definition(rng, shape):
    qkv = random_qkv(rng, *shape)
    want = attention_loops(qkv, *shape[1:])
    out, probs = attention_ref(qkv, *shape[1:], return_probs=True)
    assert out.dtype == np.float32 and out.shape == (shape[0], shape[1] * shape[3])
    assert max_rel_error(out, want) < 1e-5
    assert np.allclose(probs.sum(-1), 1, rtol=1e-5)
    assert not np.any(np.triu(probs, k=1)), "a query attends to a later key"


def test_attention_ref_is_causal(rng):
    """Changing the last token changes no earlier row."""
    qkv = random_qkv(rng, 10, 4, 2, 8)
    changed = qkv.copy()
    changed[-1] = rng.standard_normal(qkv.shape[1])
    a, b = attention_ref(qkv, 4, 2, 8), attention_ref(changed, 4, 2, 8)
    assert np.array_equal(a[:-1], b[:-1]) and not np.array_equal(a[-1], b[-1])


def test_attention_flops():
    assert attention_flops(1, 1, 1) == 4  # one q·k and one p·v multiply-add
    assert attention_flops(2048, 32, 64) == 2 * 32 * 64 * 2048 * 2049


# --- the kernels, in the simulator (tiny) and on a GPU ---


def run_rung(rung, qkv, num_heads, num_kv_heads, head_dim, out_dtype=np.float32, block_q=64, block_k=None):
    num_tokens = qkv.shape[0]
    out = cuda.to_device(np.full((num_tokens, num_heads * head_dim), 0xBEEF if out_dtype == np.uint16 else -7.0, out_dtype))
    d_qkv = cuda.to_device(qkv)
    if rung == "materialized":
        scores = cuda.device_array((num_heads, num_tokens, num_tokens), np.float32)
        attention_materialized(d_qkv, num_heads, num_kv_heads, head_dim, scores, out)
    else:
        starts = cuda.to_device(np.array([0, num_tokens], np.int32))
        flash_attention(d_qkv, starts, num_tokens, num_heads, num_kv_heads, head_dim, out, block_q=block_q, block_k=block_k)
    return out.copy_to_host()


SIM_CASES = [  # (tokens, heads, KV heads, head_dim, block_q, block_k): tiles that do not divide T
    (11, 4, 2, 16, 4, 4),
    (7, 3, 1, 8, 8, 3),
    (1, 2, 2, 8, 4, 4),
]


@needs_kernels
@pytest.mark.parametrize("rung", ["materialized", "flash"])
@pytest.mark.parametrize("case", SIM_CASES, ids=lambda c: "x".join(map(str, c)))
def test_rungs_match_reference(rng, rung, case):
    num_tokens, num_heads, num_kv_heads, head_dim, block_q, block_k = case
    qkv = random_qkv(rng, num_tokens, num_heads, num_kv_heads, head_dim)
    got = run_rung(rung, qkv, num_heads, num_kv_heads, head_dim, block_q=block_q, block_k=block_k)
    assert max_rel_error(got, attention_ref(qkv, num_heads, num_kv_heads, head_dim)) <= 1e-5


@needs_kernels
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator computes with NumPy scalars: NaN - NaN warns
@pytest.mark.parametrize("rung", ["materialized", "flash"])
def test_nan_query_and_late_nan_value(rng, rung):
    """A NaN query poisons its own head's row only; a NaN value of the last token reaches no earlier row."""
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 8
    qkv = random_qkv(rng, num_tokens, num_heads, num_kv_heads, head_dim)
    want = attention_ref(qkv, num_heads, num_kv_heads, head_dim)
    qkv[3, 1 * head_dim + 5] = np.nan  # query of token 3, head 1
    want[3, head_dim : 2 * head_dim] = np.nan
    v_col = (num_heads + num_kv_heads + 1) * head_dim + 2  # value of KV head 1, dimension 2
    qkv[-1, v_col] = np.nan
    for h in (2, 3):  # the query heads of KV head 1
        want[-1, h * head_dim + 2] = np.nan
    got = run_rung(rung, qkv, num_heads, num_kv_heads, head_dim, block_q=4, block_k=4)
    assert max_rel_error(got, want) <= 1e-5


@needs_kernels
def test_flash_bf16_output(rng):
    qkv = random_qkv(rng, 10, 4, 1, 16)
    want = attention_ref(qkv, 4, 1, 16)
    got = bf16_bits_to_f32(run_rung("flash", qkv, 4, 1, 16, np.uint16, block_q=8, block_k=4))
    assert max_rel_error(got, bf16_bits_to_f32(f32_to_bf16_bits(want))) <= 2**-7  # at most one bf16 step


def run_packed(qkv, lengths, num_heads, num_kv_heads, head_dim, block_q=64, block_k=None):
    """flash_attention over sequences of `lengths` packed back to back in qkv, in one launch."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    out = cuda.to_device(np.full((qkv.shape[0], num_heads * head_dim), -7.0, np.float32))
    flash_attention(cuda.to_device(qkv), cuda.to_device(starts), max(lengths), num_heads, num_kv_heads, head_dim, out,
                    block_q=block_q, block_k=block_k)
    want = np.concatenate([attention_ref(qkv[a:b], num_heads, num_kv_heads, head_dim) for a, b in zip(starts, starts[1:])])
    return out.copy_to_host(), want


@needs_kernels
@pytest.mark.parametrize("lengths", [[5, 1, 9], [1, 1], [4, 4, 3]])
def test_flash_packed_sequences_are_independent(rng, lengths):
    """Each sequence attends only within itself, whatever its neighbours; a length-1 sequence sees only itself."""
    qkv = random_qkv(rng, sum(lengths), 4, 2, 8)
    got, want = run_packed(qkv, lengths, 4, 2, 8, block_q=4, block_k=4)
    assert max_rel_error(got, want) <= 1e-5
    changed = qkv.copy()
    changed[lengths[0] :] = rng.standard_normal(changed[lengths[0] :].shape)  # every later sequence changes
    again, _ = run_packed(changed, lengths, 4, 2, 8, block_q=4, block_k=4)
    assert np.array_equal(again[: lengths[0]], got[: lengths[0]])  # the first sequence's rows do not move


@pytest.mark.gpu
def test_flash_packed_at_real_shapes(rng):
    lengths = [700, 1, 2048, 93, 64]
    got, want = run_packed(random_qkv(rng, sum(lengths), 32, 8, 64), lengths, 32, 8, 64)
    assert max_rel_error(got, want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2048, 32, 8, 64), (1000, 9, 3, 64), (77, 32, 8, 128), (1, 4, 1, 64)])
def test_rungs_at_real_shapes(rng, case):
    qkv = random_qkv(rng, *case)
    want = attention_ref(qkv, *case[1:])
    for rung in ("materialized", "flash"):
        err = max_rel_error(run_rung(rung, qkv, *case[1:]), want)
        assert err <= 1e-5, f"{rung}: {err:.2e}"
    got = bf16_bits_to_f32(run_rung("flash", qkv, *case[1:], np.uint16))
    assert max_rel_error(got, bf16_bits_to_f32(f32_to_bf16_bits(want))) <= 2**-7


@pytest.mark.gpu
@pytest.mark.parametrize("block_q, block_k", [(32, 64), (128, 32), (64, 16)])
def test_flash_tile_sizes(rng, block_q, block_k):
    qkv = random_qkv(rng, 333, 8, 2, 64)
    got = run_rung("flash", qkv, 8, 2, 64, block_q=block_q, block_k=block_k)
    assert max_rel_error(got, attention_ref(qkv, 8, 2, 64)) <= 1e-5


def test_bad_input_is_refused():
    qkv, out = np.zeros((3, (4 + 2 * 2) * 8), np.float32), np.zeros((3, 32), np.float32)
    scores = np.zeros((4, 3, 3), np.float32)
    one = np.array([0, 3], np.int32)  # query_start_loc: one sequence of 3 tokens
    cases = [
        ((qkv.astype(np.float64), one, 3, 4, 2, 8, out), TypeError),
        ((qkv, one, 3, 4, 3, 8, out), ValueError),  # 4 heads cannot share 3 KV heads
        ((qkv, one, 3, 4, 2, 16, out), ValueError),  # too narrow for head_dim 16
        ((qkv, one, 3, 4, 0, 8, out), ValueError),
        ((qkv, one, 3, 4, 2, 8, np.zeros((3, 31), np.float32)), ValueError),
        ((qkv, one, 3, 4, 2, 8, np.zeros((3, 32), np.int32)), TypeError),
        ((np.asfortranarray(np.zeros((3, 64), np.float32)), one, 3, 4, 2, 8, out), ValueError),
        ((qkv, one.astype(np.int64), 3, 4, 2, 8, out), TypeError),  # query_start_loc must be int32
        ((qkv, np.array([0, 2], np.int32), 3, 4, 2, 8, out), ValueError),  # the sequences end before the rows do
        ((qkv, np.array([0, 2, 1, 3], np.int32), 3, 4, 2, 8, out), ValueError),  # a negative length
        ((qkv, one, 2, 4, 2, 8, out), ValueError),  # a sequence longer than max_query_len
    ]
    for args, error in cases:
        with pytest.raises(error):
            flash_attention(*args)
    with pytest.raises(ValueError):
        flash_attention(qkv, one, 3, 4, 2, 8, out, block_q=0)
    with pytest.raises(ValueError):
        attention_materialized(qkv, 4, 2, 8, np.zeros((4, 3, 2), np.float32), out)
    with pytest.raises(TypeError):
        attention_materialized(qkv, 4, 2, 8, scores.astype(np.float64), out)
    with pytest.raises(ValueError):
        attention_ref(qkv, 3, 2, 8)


# --- SiLU(gate) * up ---


def test_silu_mul_ref(rng):
    gate_up = rng.standard_normal((3, 10)).astype(np.float32)
    g, u = gate_up[:, :5].astype(np.float64), gate_up[:, 5:].astype(np.float64)
    assert np.allclose(silu_mul_ref(gate_up), g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)
    assert silu_mul_ref(np.array([[-200.0, 1.0]], np.float32))[0, 0] == 0  # exp overflow: -0, not NaN


@needs_kernels
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # exp(200) overflows on purpose
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("width", [45, 300])  # a thread's columns past the end; several blocks a row
def test_silu_mul_kernel(rng, out_dtype, width):
    gate_up = (rng.standard_normal((4, 2 * width)) * 4).astype(np.float32)
    gate_up[0, 0], gate_up[1, 1], gate_up[2, 50] = -200.0, np.nan, np.inf
    want = silu_mul_ref(gate_up)
    out = cuda.to_device(np.full(want.shape, 7, out_dtype))
    silu_mul(cuda.to_device(gate_up), out, threads_per_block=32)
    got = out.copy_to_host()
    if out_dtype == np.uint16:
        assert max_rel_error(np.where(np.isinf(want), 0, bf16_bits_to_f32(got)),
                             np.where(np.isinf(want), 0, bf16_bits_to_f32(f32_to_bf16_bits(want)))) <= 2**-7
    else:
        assert max_rel_error(np.where(np.isinf(want), 0, got), np.where(np.isinf(want), 0, want)) <= 1e-6
    assert np.array_equal(np.isinf(bf16_bits_to_f32(got) if out_dtype == np.uint16 else got), np.isinf(want))


def test_silu_mul_bad_input():
    for gate_up, out, error in [
        (np.zeros((2, 8), np.float64), np.zeros((2, 4), np.float32), TypeError),
        (np.zeros((2, 8), np.float32), np.zeros((2, 4), np.int16), TypeError),
        (np.zeros((2, 7), np.float32), np.zeros((2, 3), np.float32), ValueError),
        (np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32), ValueError),
    ]:
        with pytest.raises(error):
            silu_mul(gate_up, out)


@pytest.mark.gpu
def test_silu_mul_large(rng):
    gate_up = (rng.standard_normal((2048, 2 * 8192)) * 3).astype(np.float32)
    out = cuda.device_array((2048, 8192), np.uint16)
    silu_mul(cuda.to_device(gate_up), out)
    want = silu_mul_ref(gate_up)
    assert max_rel_error(bf16_bits_to_f32(out.copy_to_host()), bf16_bits_to_f32(f32_to_bf16_bits(want))) <= 2**-7
