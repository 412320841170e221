"""Chapter 08's KV cache: its size, layout, blocks and attention metadata, and attention over the cache in
the NumPy model — cached prefill and decode give the logits of a full forward pass without a cache (chapter 7) to 1e-4."""

import numpy as np
import pytest

from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.kv_cache import KVCache, kv_cache_bytes_per_token
from tinyvllm_lib.kernels.attention import attention_ref, cached_attention_ref
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.layers.attention import CachedAttention, context_slots
from tinyvllm_lib.layers.attention_metadata import (
    AttentionMetadata,
    build_attention_metadata,
)
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


class Cached:
    """A model, a cache and an allocator of `max_num_seqs` rows: runs steps as an engine's runner would."""

    def __init__(self, model: LlamaNumpy, max_num_seqs: int = 2, max_model_len: int = 64, dtype: str = "float32",
                 block_size: int = 16):
        self.model, self.alloc = model, ContiguousAllocator(max_num_seqs, max_model_len, block_size)
        self.cache = KVCache(model.config, self.alloc.num_slots, dtype)

    def step(self, rows: list[int], new_ids: list, seq_lens: list[int], num_prefills: int) -> np.ndarray:
        """Each sequence's new tokens (ending at its seq_len), packed: logits of every new row."""
        positions, meta = build_attention_metadata([len(n) for n in new_ids], seq_lens, self.alloc.block_tables(rows),
                                                   self.alloc.block_size, num_prefills)
        return self.model.forward(np.concatenate(new_ids), positions, CachedAttention(self.model.config, self.cache, meta))


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


def test_contiguous_allocator():
    alloc = ContiguousAllocator(max_num_seqs=3, max_model_len=10, block_size=4)
    assert alloc.max_blocks == 3 and alloc.num_blocks == 9 and alloc.num_slots == 36
    rows = [alloc.allocate() for _ in range(3)]
    assert rows == [0, 1, 2] and alloc.num_free_rows == 0
    with pytest.raises(RuntimeError, match="in use"):
        alloc.allocate()
    np.testing.assert_array_equal(alloc.block_tables([2, 0]), [[6, 7, 8], [0, 1, 2]])
    alloc.free(1)
    assert alloc.allocate() == 1
    with pytest.raises(ValueError, match="not in use"):
        alloc.free(7)
    with pytest.raises(ValueError, match="power of two"):
        ContiguousAllocator(2, 10, block_size=6)


def test_attention_metadata_of_a_mixed_batch():
    tables = np.array([[4, 5, 6], [0, 1, 2], [7, 3, 8]], np.int32)  # blocks of 4, in any order
    positions, meta = build_attention_metadata([3, 1, 1], [3, 9, 5], tables, 4, num_prefills=1)
    np.testing.assert_array_equal(positions, [0, 1, 2, 8, 4])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 3, 4, 5])
    np.testing.assert_array_equal(meta.slot_mapping, [16, 17, 18, 2 * 4 + 0, 3 * 4 + 0])
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decodes, meta.max_query_len) == (1, 3, 2, 3)
    np.testing.assert_array_equal(context_slots(tables[2], 5, 4), [28, 29, 30, 31, 12])


def test_metadata_decode_fast_path_equals_general_path(rng):
    tables = rng.permutation(40).astype(np.int32).reshape(5, 8)
    lens = rng.integers(1, 32, 5)  # sequence 4 grows by one below: at most 32 = 8 blocks of 4
    pos_fast, fast = build_attention_metadata([1] * 5, lens, tables, 4, num_prefills=0)
    order = [4, 0, 1, 2, 3]  # sequence 4 first, as a prefill of two tokens ending one later
    pos_slow, slow = build_attention_metadata([2, 1, 1, 1, 1], np.r_[lens[4] + 1, lens[:4]], tables[order], 4, num_prefills=1)
    np.testing.assert_array_equal(pos_fast, lens - 1)
    np.testing.assert_array_equal(fast.slot_mapping, tables[np.arange(5), (lens - 1) // 4] * 4 + (lens - 1) % 4)
    np.testing.assert_array_equal(slow.slot_mapping[[0, 2, 3, 4, 5]], fast.slot_mapping[order])
    with pytest.raises(ValueError, match="decode one token each"):
        build_attention_metadata([1, 2], [3, 4], tables[:2], 4, num_prefills=0)


def test_metadata_must_agree():
    tables = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="new tokens"):
        build_attention_metadata([3], [2], tables, 4, num_prefills=1)  # more new tokens than the sequence has
    with pytest.raises(ValueError, match="block_tables"):
        build_attention_metadata([1], [9], tables, 4, num_prefills=0)  # position 8 needs a third block
    with pytest.raises(ValueError, match="disagrees"):
        AttentionMetadata(1, 2, 2, np.array([0, 2], np.int32), np.array([2], np.int32), np.arange(3), tables, 4)


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


# --- attention over the cache in the model: cached = recomputed ---


def test_prefill_then_decode_equals_full_forward(model, rng):
    c = Cached(model)
    row = c.alloc.allocate()
    ids = list(rng.integers(0, model.config.vocab_size, 9))
    logits = c.step([row], [ids], [len(ids)], num_prefills=1)
    np.testing.assert_allclose(logits, model.forward(ids), atol=1e-4)  # every prompt position
    for _ in range(8):
        ids.append(int(np.argmax(logits[-1])))
        logits = c.step([row], [ids[-1:]], [len(ids)], num_prefills=0)
        worst = np.abs(logits[0] - model.forward(ids)[-1]).max()
        assert worst < 1e-4, f"step {len(ids)}: cached decode differs from the full forward by {worst:.2e}"


def test_mixed_batch_rows_are_independent(model, rng):
    """One step: a new prompt (prefill) and two decodes of sequences in other rows, block size 4."""
    c = Cached(model, max_num_seqs=3, block_size=4)
    vocab = model.config.vocab_size
    a, b, p = list(rng.integers(0, vocab, 5)), list(rng.integers(0, vocab, 12)), list(rng.integers(0, vocab, 7))
    row_a, row_b, row_p = c.alloc.allocate(), c.alloc.allocate(), c.alloc.allocate()
    c.step([row_a, row_b], [a[:-1], b[:-1]], [4, 11], num_prefills=2)  # two prompts packed in one prefill
    both = c.step([row_p, row_a, row_b], [p, a[-1:], b[-1:]], [7, 5, 12], num_prefills=1)
    np.testing.assert_allclose(both[:7], model.forward(p), atol=1e-4)
    np.testing.assert_allclose(both[7], model.forward(a)[-1], atol=1e-4)
    np.testing.assert_allclose(both[8], model.forward(b)[-1], atol=1e-4)


def test_chunk_after_a_cached_prefix(model, rng):
    c = Cached(model)
    ids = rng.integers(0, model.config.vocab_size, 14)
    row = c.alloc.allocate()
    c.step([row], [ids[:6]], [6], num_prefills=1)
    tail = c.step([row], [ids[6:]], [14], num_prefills=1)  # queries at 6..13 over the cached 0..5 and themselves
    np.testing.assert_allclose(tail, model.forward(ids)[6:], atol=1e-4)


def test_bf16_cache_is_close_but_rounded(model, rng):
    ids = rng.integers(0, model.config.vocab_size, 10)
    exact = Cached(model, dtype="float32")
    rounded = Cached(model, dtype="bfloat16")
    a = exact.step([exact.alloc.allocate()], [ids], [10], 1)
    b = rounded.step([rounded.alloc.allocate()], [ids], [10], 1)
    assert rounded.cache.k[0].dtype == np.uint16
    assert 0 < np.abs(b - a).max() < 0.25


def test_bad_input_is_refused(model):
    c = Cached(model)
    with pytest.raises(ValueError, match="vocabulary"):
        c.step([0], [[0, 1, model.config.vocab_size]], [3], 1)
    with pytest.raises(ValueError, match="hold every position"):
        c.step([0], [[1]], [65], 0)  # past max_model_len: no block for it


def test_smollm2_cached_decode_equals_full_forward():
    model = LlamaNumpy.from_folder(resolve_model("smollm2"))
    c = Cached(model, max_num_seqs=1, max_model_len=32)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646]  # a short prompt
    logits = c.step([0], [ids], [len(ids)], 1)[-1]
    for _ in range(3):
        ids.append(int(np.argmax(logits)))
        logits = c.step([0], [ids[-1:]], [len(ids)], 0)[0]
        worst = np.abs(logits - model.forward(ids)[-1]).max()
        assert worst < 1e-4, f"SmolLM2, {len(ids)} tokens: cached decode differs by {worst:.2e}"
