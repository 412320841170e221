"""Chapter 10's paged prefill attention against NumPy on the same bf16 cache, and
against chapter 07's flash kernel when nothing is cached.
"""

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.kernels.attention import attention_ref, flash_attention, split_qkv
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.kv_cache_write import write_kv_cache_ref
from tinyvllm_lib.kernels.paged_attention import (
    TILE_MASK,
    TILE_SHIFT,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_tiles,
    tile_capacity,
)
from tinyvllm_lib.measure import max_rel_error
from tinyvllm_lib.runtime import can_launch

pytestmark = pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")

NAN_BF16 = 0x7FC0


def make_case(rng, seqs, H, KVH, D, block_size, spare_blocks=3):
    """A batch of sequences seqs = [(num_cached, num_new), ...]: qkv of the new tokens,
    caches whose slots outside every context hold NaN, shuffled block tables.
    """
    num_seqs = len(seqs)
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    max_blocks = max(cdiv(int(n), block_size) for n in seq_lens)
    num_blocks = num_seqs * max_blocks + spare_blocks
    # a random permutation of the pool: no table is contiguous
    tables = rng.permutation(num_blocks)[: num_seqs * max_blocks]
    tables = tables.reshape(num_seqs, max_blocks).astype(np.int32)
    shape = (num_blocks * block_size, KVH, D)
    k_cache = np.full(shape, NAN_BF16, np.uint16)
    v_cache = np.full(shape, NAN_BF16, np.uint16)
    qkv = rng.standard_normal((starts[-1], (H + 2 * KVH) * D)).astype(np.float32)
    qkv[:, : H * D] *= 3  # peaked attention
    new_slots = []
    for s, (num_cached, num_new) in enumerate(seqs):
        pos = np.arange(num_cached + num_new)
        slots = tables[s, pos // block_size] * block_size + pos % block_size
        for cache in (k_cache, v_cache):  # the cached prefix
            cache[slots[:num_cached]] = f32_to_bf16_bits(
                rng.standard_normal((num_cached, KVH, D)).astype(np.float32)
            )
        new_slots.append(slots[num_cached:])
    # the new tokens' K and V, as write_kv_cache stores them before attention runs
    write_kv_cache_ref(qkv, H, KVH, np.concatenate(new_slots), k_cache, v_cache)
    return qkv, k_cache, v_cache, tables, seq_lens, starts


def run(case, block_size, H, KVH, D, out_dtype=np.float32, **kw):
    """The kernel on device copies; out starts as NaN, so every element must be
    written.
    """
    qkv, k_cache, v_cache, tables, seq_lens, starts = case
    out = cuda.to_device(
        np.full(
            (len(qkv), H * D), NAN_BF16 if out_dtype == np.uint16 else np.nan, out_dtype
        )
    )
    max_query_len = int(np.diff(starts).max())
    args = (qkv, k_cache, v_cache, tables, seq_lens, starts)
    paged_prefill_attention(
        *map(cuda.to_device, args), max_query_len, block_size, H, KVH, D, out, **kw
    )
    return out.copy_to_host()


def ref(case, block_size, H, KVH, D):
    qkv, k_cache, v_cache, tables, seq_lens, starts = case
    q = split_qkv(qkv, H, KVH, D)[0]
    return paged_prefill_attention_ref(
        q, k_cache, v_cache, tables, seq_lens, starts, block_size, H, KVH, D
    )


# --- the NumPy reference ---


def test_ref_without_cache_is_attention_ref_on_bf16_kv(rng):
    H, KVH, D = 4, 2, 8
    case = make_case(rng, [(0, 6), (0, 1), (0, 9)], H, KVH, D, 4)
    qkv, starts = case[0], case[5]
    rounded = qkv.copy()
    rounded[:, H * D :] = bf16_bits_to_f32(f32_to_bf16_bits(qkv[:, H * D :]))
    want = np.concatenate(
        [attention_ref(rounded[a:b], H, KVH, D) for a, b in zip(starts, starts[1:])]
    )
    assert max_rel_error(ref(case, 4, H, KVH, D), want) < 1e-6


def test_ref_of_a_chunk_is_the_tail_of_the_whole_prompt(rng):
    """A prompt's second chunk, after its first 7 tokens are cached, gives the last rows
    of the whole prompt computed at once — to float32 rounding: BLAS may sum a 5-row
    product in another order than a 12-row one (on an AMD EPYC's OpenBLAS every seed
    differs, by at most 6.2e-7 of the largest value over 500 seeds); a query at the
    wrong position would be off by the order of the values themselves.
    """
    H, KVH, D, bs = 2, 1, 8, 4
    qkv, k_cache, v_cache, tables, _, _ = make_case(rng, [(0, 12)], H, KVH, D, bs)
    q = split_qkv(qkv, H, KVH, D)[0]
    whole = paged_prefill_attention_ref(
        q, k_cache, v_cache, tables, [12], [0, 12], bs, H, KVH, D
    )
    tail = paged_prefill_attention_ref(
        q[7:], k_cache, v_cache, tables, [12], [0, 5], bs, H, KVH, D
    )
    assert max_rel_error(tail, whole[7:]) < 2e-6


# --- the kernel ---

# (H, KVH, D, block_size, block_q, block_k, [(num_cached, num_new), ...]): cached
# prefixes of 0 and of lengths that are not multiples of the block size, one new token,
# more new tokens than a tile, tiles that divide nothing
SIM_CASES = [
    (4, 2, 16, 4, 4, 4, [(0, 7), (5, 1), (10, 9), (3, 4)]),
    (6, 2, 32, 8, 8, 8, [(13, 10), (0, 1)]),
    (2, 1, 8, 2, 3, 5, [(1, 5), (6, 2), (7, 0), (0, 4)]),  # (7, 0): no new token
]


@pytest.mark.parametrize("shape", SIM_CASES, ids=lambda c: f"H{c[0]}KVH{c[1]}D{c[2]}")
def test_paged_prefill_matches_ref(rng, shape):
    H, KVH, D, bs, block_q, block_k, seqs = shape
    case = make_case(rng, seqs, H, KVH, D, bs)
    got = run(case, bs, H, KVH, D, block_q=block_q, block_k=block_k)
    assert np.abs(got - ref(case, bs, H, KVH, D)).max() < 1e-5


def test_paged_prefill_default_tiles(rng):
    """The compiled sizes: 64 queries a tile (most threads idle here), flash_block_k
    keys.
    """
    H, KVH, D, bs = 2, 1, 16, 16
    case = make_case(rng, [(70, 3), (0, 2)], H, KVH, D, bs)
    assert np.abs(run(case, bs, H, KVH, D) - ref(case, bs, H, KVH, D)).max() < 1e-5


def test_the_tile_schedule_holds_every_tile_once_most_keys_first(rng):
    """Random batches (zero-token sequences among them): every (sequence, query tile) exactly once, ordered by the
    keys its queries visit, within tile_capacity; -1 past them; too many sequences is an error, not a wrap."""
    for _ in range(200):
        block_q = int(rng.choice([4, 16, 64]))
        num_new = rng.integers(0, 3 * block_q, int(rng.integers(1, 20)))
        cached = rng.integers(0, 200, len(num_new))
        starts = np.concatenate([[0], np.cumsum(num_new)])
        capacity = tile_capacity(int(starts[-1]), len(num_new), block_q)
        out = prefill_tiles(starts, cached + num_new, block_q, np.zeros(capacity, np.int32))
        entries = out[out >= 0]
        assert (out[len(entries):] == -1).all()
        pairs = [(int(e) >> TILE_SHIFT, int(e) & TILE_MASK) for e in entries]
        want = {(s, t) for s, n in enumerate(num_new) for t in range(cdiv(int(n), block_q))}
        assert sorted(pairs) == sorted(want) and len(pairs) == len(want)
        keys = [cached[s] + min(num_new[s], (t + 1) * block_q) for s, t in pairs]
        assert keys == sorted(keys, reverse=True)
    with pytest.raises(ValueError, match="sequences"):
        prefill_tiles(np.arange(2**15 + 1), np.ones(2**15, np.int32), 64)


def test_a_padded_schedule_and_padded_rows_change_nothing(rng):
    """A captured step's view: the schedule padded with -1 to the capacity of more tokens and rows than the batch
    has, the padding rows' lengths and tables left as the packer leaves them, and qkv with extra padding tokens: the
    real rows equal the reference and no padding row's output is written (it stays NaN)."""
    H, KVH, D, bs, block_q = 4, 2, 16, 4, 8
    seqs = [(0, 7), (5, 1), (10, 9), (3, 4)]
    qkv, k_cache, v_cache, tables, seq_lens, starts = make_case(rng, seqs, H, KVH, D, bs)
    want = ref((qkv, k_cache, v_cache, tables, seq_lens, starts), bs, H, KVH, D)
    n, r, tokens, rows = len(qkv), len(seqs), len(qkv) + 11, len(seqs) + 3
    pad_qkv = np.concatenate([qkv, rng.standard_normal((tokens - n, qkv.shape[1])).astype(np.float32)])
    pad_starts = np.concatenate([starts, np.minimum(np.arange(n + 1, n + 1 + rows - r), tokens)]).astype(np.int32)
    pad_lens = np.concatenate([seq_lens, np.ones(rows - r, np.int32)])
    pad_tables = np.concatenate([tables, np.zeros((rows - r, tables.shape[1]), np.int32)])
    tiles = prefill_tiles(starts, seq_lens, block_q, np.zeros(tile_capacity(tokens, rows, block_q), np.int32))
    assert (tiles == -1).sum() > 0
    out = cuda.to_device(np.full((tokens, H * D), np.nan, np.float32))
    args = (pad_qkv, k_cache, v_cache, pad_tables, pad_lens, pad_starts)
    paged_prefill_attention(*map(cuda.to_device, args), 9, bs, H, KVH, D, out, block_q=block_q, block_k=4,
                            tiles=cuda.to_device(tiles))
    got = out.copy_to_host()
    assert np.abs(got[:n] - want).max() < 1e-5
    assert np.isnan(got[n:]).all()


def test_paged_prefill_bf16_out(rng):
    H, KVH, D, bs = 4, 1, 16, 4
    case = make_case(rng, [(6, 5), (0, 3)], H, KVH, D, bs)
    got = bf16_bits_to_f32(run(case, bs, H, KVH, D, np.uint16, block_q=4, block_k=4))
    want = bf16_bits_to_f32(f32_to_bf16_bits(ref(case, bs, H, KVH, D)))
    assert max_rel_error(got, want) <= 2**-7  # at most one bf16 step


def test_paged_prefill_without_cache_is_flash_attention(rng):
    """Nothing cached: the flash kernel's result on K and V rounded to bf16."""
    H, KVH, D, bs = 4, 2, 16, 4
    seqs = [(0, 9), (0, 1), (0, 6)]
    case = make_case(rng, seqs, H, KVH, D, bs)
    qkv, starts = case[0], case[5]
    rounded = qkv.copy()
    rounded[:, H * D :] = bf16_bits_to_f32(f32_to_bf16_bits(qkv[:, H * D :]))
    want = cuda.device_array((len(qkv), H * D), np.float32)
    flash_attention(cuda.to_device(rounded), cuda.to_device(starts), 9, H, KVH, D, want, block_q=4, block_k=4)
    got = run(case, bs, H, KVH, D, block_q=4, block_k=4)
    assert np.abs(got - want.copy_to_host()).max() < 1e-5


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator: NaN - NaN warns
def test_paged_prefill_is_causal_by_position(rng):
    """A NaN in the last new token's value reaches only its own row (the query heads of
    its KV head, that dimension).
    """
    H, KVH, D, bs = 4, 2, 8, 4
    case = make_case(rng, [(5, 4)], H, KVH, D, bs)
    v_cache, tables = case[2], case[3]
    want = ref(case, bs, H, KVH, D)
    slot = tables[0, 8 // bs] * bs + 8 % bs  # position 8: the last new token
    v_cache[slot, 1, 3] = NAN_BF16
    for h in (2, 3):  # the query heads of KV head 1
        want[-1, h * D + 3] = np.nan
    got = run(case, bs, H, KVH, D, block_q=2, block_k=3)
    assert max_rel_error(got, want) < 1e-5


def test_paged_prefill_bad_arguments(rng):
    H, KVH, D, bs = 4, 2, 16, 4
    qkv, k, v, tables, seq_lens, starts = make_case(rng, [(3, 5)], H, KVH, D, bs)
    out = np.zeros((len(qkv), H * D), np.float32)

    def call(**changes):
        args = dict(qkv=qkv, k_cache=k, v_cache=v, block_tables=tables, seq_lens=seq_lens, query_start_loc=starts,
                    max_query_len=5, block_size=bs, num_heads=H, num_kv_heads=KVH, head_dim=D, out=out)
        args.update(changes)
        return paged_prefill_attention(**args)

    with pytest.raises(ValueError, match="power of two"):
        call(block_size=3)
    with pytest.raises(TypeError, match="block_tables"):
        call(block_tables=tables.astype(np.int64))
    with pytest.raises(TypeError, match="seq_lens"):
        call(seq_lens=seq_lens.astype(np.int64))
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=np.array([4], np.int32))  # fewer than its 5 new tokens
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=np.array([tables.shape[1] * bs + 1], np.int32))  # past its table
    with pytest.raises(ValueError, match="outside the cache"):
        call(block_tables=np.full_like(tables, len(k) // bs))
    with pytest.raises(ValueError, match="cache"):
        call(k_cache=np.ascontiguousarray(k[:, :1]))
    with pytest.raises(ValueError, match="as many slots"):
        call(v_cache=v[:-bs])
    with pytest.raises(ValueError, match="head_dim"):
        call(qkv=np.zeros((5, (H + 2 * KVH) * 6), np.float32), head_dim=6, out=np.zeros((5, H * 6), np.float32))
    with pytest.raises(TypeError, match="out must be"):
        call(out=out.astype(np.float64))
    with pytest.raises(ValueError, match="query_start_loc"):
        call(query_start_loc=np.array([0, 4], np.int32))
    with pytest.raises(ValueError, match="block_q"):
        call(block_q=0)
    # no new tokens: nothing to do
    empty = out[:0]
    assert call(qkv=qkv[:0], out=empty, query_start_loc=np.array([0, 0], np.int32), max_query_len=0) is empty


# --- at Llama 3.2 1B's sizes, on a GPU ---


@pytest.mark.gpu
@pytest.mark.parametrize(
    "H, KVH, D, seqs",
    [
        (32, 8, 64, [(1024, 2048)]),
        (32, 8, 64, [(0, 2048)]),
        (32, 8, 64, [(0, 300), (777, 1), (1024, 517), (33, 64), (5, 0)]),  # ragged
        (16, 4, 128, [(200, 77), (0, 130)]),  # the head_dim 128 kernel
    ],
    ids=["2048-after-1024", "2048-after-0", "ragged", "d128"],
)
def test_paged_prefill_real_shapes(rng, H, KVH, D, seqs):
    bs = 16
    case = make_case(rng, seqs, H, KVH, D, bs)
    want = ref(case, bs, H, KVH, D)
    # float32 sums over up to 3,072 keys, one key at a time: on an H200 the kernel was
    # 7e-6 of the largest output from float64, the float32 reference 1.4e-6
    assert max_rel_error(run(case, bs, H, KVH, D), want) <= 2e-5
    got = bf16_bits_to_f32(run(case, bs, H, KVH, D, np.uint16))
    assert max_rel_error(got, bf16_bits_to_f32(f32_to_bf16_bits(want))) <= 2**-7
