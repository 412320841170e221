"""Chapter 05: RoPE frequencies and rotation against transformers, every kernel rung against the
reference at random positions, in-place safety of V, NaN handling and bad input."""

import types

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.rope import (
    ROPE_VARIANTS,
    apply_rope_ref,
    llama3_scale_inv_freq,
    rope_inv_freq,
    rope_qkv,
    rope_qkv_ref,
    rope_table,
    rope_table_from_config,
)
from tinyvllm_lib.runtime import can_launch

needs_launch = pytest.mark.skipif(not can_launch(), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA31_8B = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def max_norm_error(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _hf(head_dim, theta, scaling, num_heads=4, num_kv_heads=2):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "llama3", "rope_theta": theta, **scaling} if scaling else {"rope_type": "default", "rope_theta": theta}
    config = transformers.LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                      head_dim=head_dim, max_position_embeddings=131072, rope_parameters=params)
    return LlamaRotaryEmbedding(config)


CONFIGS = [(64, 500000.0, LLAMA3), (64, 500000.0, None), (64, 100000.0, None), (128, 500000.0, LLAMA31_8B), (64, 10000.0, None)]


@pytest.mark.parametrize("head_dim, theta, scaling", CONFIGS)
def test_frequencies_match_transformers(head_dim, theta, scaling):
    hf = _hf(head_dim, theta, scaling).inv_freq.numpy()
    ours = rope_inv_freq(head_dim, theta)
    if scaling:
        ours = llama3_scale_inv_freq(ours, scaling)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, hf, rtol=1e-6, atol=0)  # in practice: bit for bit


@pytest.mark.parametrize("head_dim, theta, scaling", CONFIGS)
def test_rotation_matches_transformers_up_to_8192(rng, head_dim, theta, scaling):
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_tokens, num_heads, num_kv_heads = 50, 4, 2
    emb = _hf(head_dim, theta, scaling, num_heads, num_kv_heads)
    positions = np.concatenate([[0, 1, 8191, 8192], rng.integers(0, 8193, num_tokens - 4)])
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    cos, sin = emb(torch.zeros(1), torch.from_numpy(positions)[None])
    hf_q, hf_k = apply_rotary_pos_emb(torch.from_numpy(q.transpose(1, 0, 2))[None], torch.from_numpy(k.transpose(1, 0, 2))[None], cos, sin)
    table = rope_table(head_dim, theta, 8193, scaling)
    assert max_norm_error(apply_rope_ref(q, positions, table.cos, table.sin), hf_q[0].numpy().transpose(1, 0, 2)) <= 1e-5
    assert max_norm_error(apply_rope_ref(k, positions, table.cos, table.sin), hf_k[0].numpy().transpose(1, 0, 2)) <= 1e-5


def test_llama3_scaling_keeps_fast_pairs_and_slows_slow_ones():
    inv_freq = rope_inv_freq(64, 500000.0)
    scaled = llama3_scale_inv_freq(inv_freq, types.SimpleNamespace(**LLAMA3))  # a config object works as well as a dict
    wavelen = 2 * np.pi / inv_freq
    fast, slow = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert fast.any() and slow.any()
    assert np.array_equal(scaled[fast], inv_freq[fast])
    assert np.array_equal(scaled[slow], inv_freq[slow] / np.float32(32))
    medium = ~fast & ~slow
    assert np.all((scaled[medium] < inv_freq[medium]) & (scaled[medium] > inv_freq[medium] / 32))
    with pytest.raises(ValueError, match="factor"):
        llama3_scale_inv_freq(inv_freq, {"factor": 8.0})


def test_rope_table_from_config():
    config = types.SimpleNamespace(head_dim=64, rope_theta=500000.0, rope_scaling=LLAMA3, max_position_embeddings=300)
    table = rope_table_from_config(config)
    want = rope_table(64, 500000.0, 300, LLAMA3)
    assert table.num_positions == 300 and table.head_dim == 64
    assert np.array_equal(table.cos, want.cos) and np.array_equal(table.sin, want.sin)
    assert rope_table_from_config(config, 17).num_positions == 17


def test_rope_table_from_model_config():
    model_config = pytest.importorskip("tinyvllm_lib.models.config")
    config = model_config.ModelConfig.from_dict({
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", **LLAMA3}, "max_position_embeddings": 131072,
    })
    table = rope_table_from_config(config, 64)
    assert np.array_equal(table.inv_freq, rope_table(64, 500000.0, 1, LLAMA3).inv_freq)


def test_reference_rejects_out_of_range_positions():
    table = rope_table(8, 10000.0, 10)
    with pytest.raises(ValueError, match="positions"):
        apply_rope_ref(np.zeros((2, 1, 8), np.float32), np.array([0, -1]), table.cos, table.sin)
    with pytest.raises(ValueError, match="positions"):
        apply_rope_ref(np.zeros((2, 1, 8), np.float32), np.array([0, 10]), table.cos, table.sin)


def _check_kernel(rng, num_tokens, num_heads, num_kv_heads, table, d_table, variant, pos_dtype):
    width = (num_heads + 2 * num_kv_heads) * table.head_dim
    qkv = rng.standard_normal((num_tokens, width)).astype(np.float32)
    qkv[num_tokens // 2, 1] = np.nan  # only its pair may turn NaN
    positions = rng.integers(0, table.num_positions, num_tokens).astype(pos_dtype)  # unsorted, repeats
    want = rope_qkv_ref(qkv, positions, table, num_heads, num_kv_heads)
    d_qkv = cuda.to_device(qkv)
    rope_qkv(d_qkv, cuda.to_device(positions), d_table, num_heads, num_kv_heads, variant=variant)
    got = d_qkv.copy_to_host()
    v_start = (num_heads + num_kv_heads) * table.head_dim
    assert np.array_equal(got[:, v_start:], qkv[:, v_start:]), "V was modified"
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaNs in different places"
    assert np.isnan(want).sum() == 2
    ok = ~np.isnan(want)
    assert max_norm_error(got[ok], want[ok]) <= 1e-5


@needs_launch
@pytest.mark.parametrize("variant", ROPE_VARIANTS)
@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64])
def test_kernels_match_reference(rng, variant, pos_dtype):
    # 4 + 1 rotated heads: the second group of four is partial; 7*5*6 = 210 threads: not a whole block
    table = rope_table(12, 10000.0, 40, {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
    _check_kernel(rng, 7, 4, 1, table, table.to_device(), variant, pos_dtype)


@needs_launch
@pytest.mark.parametrize("variant", ["table", "heads_per_thread"])
def test_out_of_range_device_positions_poison_their_token(rng, variant):
    table = rope_table(8, 10000.0, 16)
    qkv = rng.standard_normal((3, (2 + 2) * 8)).astype(np.float32)
    for bad in (16, -3):
        d_qkv = cuda.to_device(qkv)
        rope_qkv(d_qkv, cuda.to_device(np.array([1, bad, 2], np.int64)), table.to_device(), 2, 1, variant=variant)
        got = d_qkv.copy_to_host()
        assert np.all(np.isnan(got[1, :24])) and np.array_equal(got[1, 24:], qkv[1, 24:])
        assert not np.isnan(got[[0, 2]]).any()


@needs_launch
def test_no_tokens_is_a_no_op():
    table = rope_table(8, 10000.0, 4)
    qkv = np.zeros((0, 32), np.float32)
    assert rope_qkv(qkv, np.zeros(0, np.int32), table, 2, 1) is qkv


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ROPE_VARIANTS)
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
def test_llama_1b_shapes_on_gpu(rng, variant, num_tokens):
    table = rope_table(64, 500000.0, 131072, LLAMA3)  # Llama 3.2 1B: positions up to 131,072
    d_table = table.to_device()
    for pos_dtype in (np.int32, np.int64):
        _check_kernel(rng, num_tokens, 32, 8, table, d_table, variant, pos_dtype)
    _check_kernel(rng, num_tokens, 9, 3, rope_table(64, 100000.0, 8192), rope_table(64, 100000.0, 8192).to_device(), variant, np.int64)  # SmolLM2


def test_launcher_rejects_bad_input():
    table = rope_table(8, 10000.0, 16)
    qkv, pos = np.zeros((3, 32), np.float32), np.arange(3)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        rope_qkv(qkv, np.array([0, 16, 1]), table, 2, 1)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        rope_qkv(qkv, np.array([0, -1, 1]), table, 2, 1)
    with pytest.raises(TypeError, match="int32 or int64"):
        rope_qkv(qkv, pos.astype(np.float32), table, 2, 1)
    with pytest.raises(TypeError, match="int32 or int64"):
        rope_qkv(qkv, pos.astype(np.uint32), table, 2, 1)
    with pytest.raises(ValueError, match="one entry per token"):
        rope_qkv(qkv, pos[:2], table, 2, 1)
    with pytest.raises(TypeError, match="qkv must be float32"):
        rope_qkv(qkv.astype(np.float64), pos, table, 2, 1)
    with pytest.raises(ValueError, match=r"\(num_tokens, 40\)"):
        rope_qkv(qkv, pos, table, 3, 1)  # (3 + 2) * 8 = 40 columns expected
    with pytest.raises(ValueError, match="C-contiguous"):
        rope_qkv(np.zeros((64, 3), np.float32).T[:, :32], pos, table, 2, 1)
    with pytest.raises(ValueError, match="multiple"):
        rope_qkv(np.zeros((3, 56), np.float32), pos, table, 3, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        rope_qkv(qkv, pos, table, 2, 0)
    with pytest.raises(TypeError, match="table.cos"):
        rope_qkv(qkv, pos, table.__class__(table.inv_freq, table.cos.astype(np.float64), table.sin), 2, 1)
    with pytest.raises(ValueError, match="variant"):
        rope_qkv(qkv, pos, table, 2, 1, variant="fast")
