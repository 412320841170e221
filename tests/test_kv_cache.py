"""Chapter 08's KV cache: its size, layout and slots, and the NumPy runner — cached prefill and
decode give the logits of a full forward pass without a cache (chapter 7) to 1e-4."""

import numpy as np
import pytest

from tinyvllm_lib.engine.kv_cache import AttentionMetadata, ContiguousSlots, KVCache, kv_cache_bytes_per_token
from tinyvllm_lib.engine.runner_numpy import NumpyRunner, cached_attention_ref
from tinyvllm_lib.kernels.attention import attention_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.llama_numpy import LlamaNumpy
from tinyvllm_lib.models.random_llama import (
    LLAMA3_ROPE_SCALING,
    LLAMA_3_2_1B_CONFIG,
    make_random_llama,
    tiny_llama_config,
)
from tinyvllm_lib.models.smollm2 import resolve_model

CONFIGS = {
    "gqa-4-2-hd16": tiny_llama_config(),
    "gqa-8-2-hd64-llama3": tiny_llama_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                             rope_scaling=LLAMA3_ROPE_SCALING | {"original_max_position_embeddings": 64}),
    "mha-2-2-hd128-tied": tiny_llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                            tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory) -> LlamaNumpy:
    folder = make_random_llama(tmp_path_factory.mktemp(request.param), CONFIGS[request.param], seed=1)
    return LlamaNumpy.from_folder(folder)


def new_runner(model: LlamaNumpy, max_num_seqs: int = 2, max_model_len: int = 64, dtype: str = "float32"):
    slots = ContiguousSlots(max_num_seqs, max_model_len)
    return NumpyRunner(model, KVCache(model.config, slots.num_slots, dtype)), slots


def prefill(runner, slots, row, ids, start: int = 0):
    positions = np.arange(start, start + len(ids))
    return runner.execute(ids, positions, slots.metadata([row], [positions]))


def decode(runner, slots, row, token, position):
    return runner.execute([token], [position], slots.metadata([row], [np.array([position])]))[0]


# --- size and layout ---


def test_bytes_per_token():
    llama = ModelConfig.from_dict(LLAMA_3_2_1B_CONFIG)
    assert kv_cache_bytes_per_token(llama) == 2 * 16 * 8 * 64 * 2 == 32 * 1024
    assert kv_cache_bytes_per_token(llama, "float32") == 64 * 1024
    smollm2 = ModelConfig.from_dict(tiny_llama_config(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                                      head_dim=64, hidden_size=576))
    assert kv_cache_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 2 == 23040


def test_cache_shapes_and_bytes():
    config = ModelConfig.from_dict(tiny_llama_config())
    cache = KVCache(config, 100)
    assert len(cache.k) == len(cache.v) == config.num_hidden_layers
    assert cache.k[0].shape == (100, config.num_key_value_heads, config.head_dim) and cache.k[0].dtype == np.uint16
    assert cache.nbytes == 100 * kv_cache_bytes_per_token(config)
    with pytest.raises(ValueError, match="dtype"):
        KVCache(config, 100, "float16")
    with pytest.raises(ValueError, match="num_slots"):
        KVCache(config, 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_write_then_read(rng, dtype):
    config = ModelConfig.from_dict(tiny_llama_config())
    cache = KVCache(config, 50, dtype)
    k = rng.standard_normal((7, config.num_key_value_heads, config.head_dim)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    slots = rng.choice(50, 7, replace=False)
    cache.write(1, slots, k, v)
    got_k, got_v = cache.read(1, slots)
    want = (lambda x: bf16_bits_to_f32(f32_to_bf16_bits(x))) if dtype == "bfloat16" else (lambda x: x)
    np.testing.assert_array_equal(got_k, want(k))
    np.testing.assert_array_equal(got_v, want(v))
    assert not cache.k[0].any()  # other layers untouched


def test_contiguous_slots():
    slots = ContiguousSlots(max_num_seqs=3, max_model_len=10)
    assert slots.num_slots == 30
    rows = [slots.allocate() for _ in range(3)]
    assert rows == [0, 1, 2]
    with pytest.raises(RuntimeError, match="in use"):
        slots.allocate()
    np.testing.assert_array_equal(slots.slots(2, [0, 3, 9]), [20, 23, 29])
    with pytest.raises(ValueError, match="max_model_len"):
        slots.slots(1, [10])
    meta = slots.metadata([1, 2], [np.array([4]), np.arange(3)])
    assert meta.query_lens == (1, 3)
    np.testing.assert_array_equal(meta.slot_mapping, [14, 20, 21, 22])
    np.testing.assert_array_equal(meta.context_slots[0], np.arange(10, 15))
    np.testing.assert_array_equal(meta.context_slots[1], [20, 21, 22])
    slots.free(1)
    assert slots.allocate() == 1
    with pytest.raises(ValueError, match="not in use"):
        slots.free(7)


def test_metadata_must_agree():
    with pytest.raises(ValueError, match="disagrees"):
        AttentionMetadata((2,), np.arange(3), (np.arange(3),))


# --- attention over the cache ---


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (6, 6, 8), (8, 1, 64)])
def test_cached_attention_matches_chapter_7(rng, num_heads, num_kv_heads, head_dim):
    num_tokens = 11
    qkv = rng.standard_normal((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).astype(np.float32)
    q = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].reshape(num_tokens, num_kv_heads, head_dim)
    want = attention_ref(qkv, num_heads, num_kv_heads, head_dim)
    np.testing.assert_allclose(cached_attention_ref(q, k, v, np.arange(num_tokens)), want, atol=1e-5)  # prefill
    last = cached_attention_ref(q[-1:], k, v, np.array([num_tokens - 1]))  # decode: the newest query sees everything
    np.testing.assert_allclose(last, want[-1:], atol=1e-5)
    tail = cached_attention_ref(q[6:], k, v, np.arange(6, num_tokens))  # a chunk after a cached prefix
    np.testing.assert_allclose(tail, want[6:], atol=1e-5)


# --- the runner: cached = recomputed ---


def test_prefill_then_decode_equals_full_forward(model, rng):
    runner, slots = new_runner(model)
    row = slots.allocate()
    ids = list(rng.integers(0, model.config.vocab_size, 9))
    logits = prefill(runner, slots, row, ids)
    np.testing.assert_allclose(logits, model.forward(ids), atol=1e-4)  # every prompt position
    for _ in range(8):
        ids.append(int(np.argmax(logits[-1])))
        logits = decode(runner, slots, row, ids[-1], len(ids) - 1)[None]
        worst = np.abs(logits[0] - model.forward(ids)[-1]).max()
        assert worst < 1e-4, f"step {len(ids)}: cached decode differs from the full forward by {worst:.2e}"


def test_batched_decode_and_rows_are_independent(model, rng):
    runner, slots = new_runner(model, max_num_seqs=3)
    vocab = model.config.vocab_size
    a, b = list(rng.integers(0, vocab, 5)), list(rng.integers(0, vocab, 12))
    row_a, row_b = slots.allocate(), slots.allocate()
    prefill(runner, slots, row_a, a[:-1])
    prefill(runner, slots, row_b, b[:-1])
    positions = [np.array([len(a) - 1]), np.array([len(b) - 1])]
    both = runner.execute([a[-1], b[-1]], np.concatenate(positions), slots.metadata([row_a, row_b], positions))
    np.testing.assert_allclose(both[0], model.forward(a)[-1], atol=1e-4)
    np.testing.assert_allclose(both[1], model.forward(b)[-1], atol=1e-4)


def test_chunked_prefill_and_logits_indices(model, rng):
    runner, slots = new_runner(model)
    ids = rng.integers(0, model.config.vocab_size, 14)
    row = slots.allocate()
    prefill(runner, slots, row, ids[:6])
    positions = np.arange(6, 14)
    tail = runner.execute(ids[6:], positions, slots.metadata([row], [positions]), logits_indices=[7])
    assert tail.shape == (1, model.config.vocab_size)
    np.testing.assert_allclose(tail[0], model.forward(ids)[-1], atol=1e-4)


def test_bf16_cache_is_close_but_rounded(model, rng):
    ids = rng.integers(0, model.config.vocab_size, 10)
    exact = prefill(*new_runner(model, dtype="float32"), 0, ids)
    runner, slots = new_runner(model, dtype="bfloat16")
    rounded = prefill(runner, slots, 0, ids)
    assert runner.cache.k[0].dtype == np.uint16
    assert 0 < np.abs(rounded - exact).max() < 0.25


def test_runner_rejects_bad_input(model):
    runner, slots = new_runner(model)
    meta = slots.metadata([0], [np.arange(3)])
    with pytest.raises(ValueError, match="vocabulary"):
        runner.execute([0, 1, model.config.vocab_size], np.arange(3), meta)
    with pytest.raises(ValueError, match="slot"):
        runner.execute([0, 1], np.arange(2), meta)


def test_smollm2_cached_decode_equals_full_forward():
    folder = resolve_model("smollm2")
    model = LlamaNumpy.from_folder(folder)
    runner, slots = new_runner(model, max_num_seqs=1, max_model_len=32)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646]  # a short prompt
    logits = prefill(runner, slots, 0, ids)[-1]
    for _ in range(3):
        ids.append(int(np.argmax(logits)))
        logits = decode(runner, slots, 0, ids[-1], len(ids) - 1)
        worst = np.abs(logits - model.forward(ids)[-1]).max()
        assert worst < 1e-4, f"SmolLM2, {len(ids)} tokens: cached decode differs by {worst:.2e}"
