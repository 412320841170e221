"""Chapter 08's decode attention and KV-cache write kernels against float64 NumPy on the same bf16 cache."""

import numpy as np
import pytest
from local_memory import local_memory_accesses
from numba import cuda, uint32

from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyvllm_lib.kernels.decode_attention_config import (
    DEFAULT_DECODE_CONFIG,
    DecodeAttentionConfig,
)
from tinyvllm_lib.kernels.decode_splits import (
    decode_splits,
    decode_workspace,
    num_splits_for,
    num_splits_for_on_device,
    split_length,
    split_length_on_device,
    split_rows,
    split_rows_on_device,
    workspace_row,
)
from tinyvllm_lib.kernels.kv_cache_write import (
    rope_and_write_kv_cache,
    write_kv_cache,
    write_kv_cache_ref,
)
from tinyvllm_lib.kernels.rope import rope_qkv_ref, rope_table
from tinyvllm_lib.measure import max_rel_error as rel_error
from tinyvllm_lib.runtime import can_launch, has_gpu

pytestmark = pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")


def case(gen, num_seqs, max_len, H, KVH, D, block_size):
    lens = gen.integers(1, max_len + 1, num_seqs).astype(np.int32)
    max_blocks = -(-max_len // block_size)
    blocks = gen.permutation(num_seqs * max_blocks).astype(np.int32).reshape(num_seqs, max_blocks)
    num_slots = num_seqs * max_blocks * block_size
    k = f32_to_bf16_bits(gen.standard_normal((num_slots, KVH, D)).astype(np.float32))
    v = f32_to_bf16_bits(gen.standard_normal((num_slots, KVH, D)).astype(np.float32))
    qkv = gen.standard_normal((num_seqs, (H + 2 * KVH) * D)).astype(np.float32)
    return qkv, k, v, blocks, lens


def run(qkv, k, v, blocks, block_size, lens, H, KVH, D, out_dtype=np.float32, **kw):
    out = cuda.device_array((len(qkv), H * D), out_dtype)
    decode_attention(cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v), cuda.to_device(blocks), block_size,
                     cuda.to_device(lens), H, KVH, D, out, **kw)
    return out.copy_to_host()


@pytest.mark.parametrize("num_warps", [1, 2])
def test_decode_attention_odd_lengths_gqa(rng, num_warps):
    qkv, k, v, bt, lens = case(rng, 3, 29, 4, 2, 16, 4)
    lens[0] = 1  # a sequence of one token
    got = run(qkv, k, v, bt, 4, lens, 4, 2, 16, config=DecodeAttentionConfig(num_warps=num_warps))
    want = decode_attention_ref(qkv, k, v, bt, 4, lens, 4, 2, 16)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def run_split(qkv, k, v, blocks, block_size, lens, H, KVH, D, max_splits, out_dtype=np.float32, twice=False, **kw):
    """The split path: a workspace of max_splits, the output poisoned with NaN first (every element must be written);
    twice: launch again on the same workspace, which must give the same output."""
    out = cuda.to_device(np.full((len(qkv), H * D), np.nan if out_dtype == np.float32 else 0x7FC0, out_dtype))
    scratch = np.zeros((len(qkv), max_splits, H, workspace_row(D)), np.float32)  # the counters start at zero
    scratch[..., : D + 2] = np.nan  # stale partials must not leak
    ws = cuda.to_device(scratch)
    args = (cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v), cuda.to_device(blocks), block_size,
            cuda.to_device(lens), H, KVH, D, out)
    decode_attention(*args, workspace=ws, **kw)
    got = out.copy_to_host()
    assert not (np.isnan(got).any() if out_dtype == np.float32 else (got == 0x7FC0).any())
    # the last split of each (row, KV head) set its counter back to zero: a second launch combines the same way
    assert (ws.copy_to_host()[:, 0, :, D + 2] == 0).all()
    if twice:
        decode_attention(*args, workspace=ws, **kw)
        assert np.array_equal(out.copy_to_host(), got)
    return got


@pytest.mark.parametrize("num_warps", [1, 2])
def test_decode_attention_split_odd_lengths(rng, num_warps):
    qkv, k, v, bt, lens = case(rng, 4, 45, 4, 2, 16, 4)
    lens[:] = [1, 45, 17, 30]  # one token; the longest; just past a split; several splits
    config = DecodeAttentionConfig(num_warps=num_warps, split_keys=16, keys_per_lane=1)  # short splits: several a sequence
    got = run_split(qkv, k, v, bt, 4, lens, 4, 2, 16, 8, config=config, max_context_len=45, twice=True)
    assert rel_error(got, decode_attention_ref(qkv, k, v, bt, 4, lens, 4, 2, 16)) < 1e-5


@pytest.mark.parametrize("head_dim, keys_per_lane", [(32, 1), (64, 2), (128, 3)])
def test_decode_attention_lanes_per_key(rng, head_dim, keys_per_lane):
    """Several lanes share a key row (2, 4, 8 for head_dim 32, 64, 128), each holding several rows at a time."""
    qkv, k, v, bt, lens = case(rng, 2, 40, 4, 2, head_dim, 8)
    lens[:] = [40, 9]
    want = decode_attention_ref(qkv, k, v, bt, 8, lens, 4, 2, head_dim)
    got = run_split(qkv, k, v, bt, 8, lens, 4, 2, head_dim, 4, config=DecodeAttentionConfig(keys_per_lane=keys_per_lane),
                    max_context_len=40)
    assert rel_error(got, want) < 1e-5


def test_few_rows_knobs_apply_up_to_few_rows():
    cfg = DecodeAttentionConfig()
    one = cfg.for_rows(1)
    assert (one.num_warps, one.split_keys, one.target_blocks) == (cfg.few_rows_warps, cfg.few_rows_split_keys, 1)
    assert one.early_loads and one.keys_per_lane == cfg.few_rows_keys_per_lane
    assert cfg.for_rows(2) is cfg and DecodeAttentionConfig(few_rows=0).for_rows(1).num_warps == cfg.num_warps
    # one row: no split while the context fits few_rows_split_keys, then about that many keys a split
    assert decode_splits(cfg.few_rows_split_keys, 1, 8, one) == 1
    assert decode_splits(1024, 1, 8, one) == -(-1024 // cfg.few_rows_split_keys)
    with pytest.raises(ValueError, match="few_rows"):
        DecodeAttentionConfig(few_rows=-1)


@pytest.mark.parametrize("length", [10, 45])
def test_decode_attention_one_row_whole_or_split(rng, length):
    """One row takes the few-rows knobs: the whole context in one block (10 keys), or splits past 16 (45)."""
    qkv, k, v, bt, lens = case(rng, 1, 45, 4, 2, 16, 4)
    lens[:] = length
    config = DecodeAttentionConfig(few_rows_split_keys=16, few_rows_keys_per_lane=1)
    assert decode_splits(45, 1, 2, config.for_rows(1)) == 3 and config.for_rows(1).keys_per_lane == 1
    got = run_split(qkv, k, v, bt, 4, lens, 4, 2, 16, 8, config=config, max_context_len=45, twice=True)
    assert rel_error(got, decode_attention_ref(qkv, k, v, bt, 4, lens, 4, 2, 16)) < 1e-5


@pytest.mark.parametrize("prefetch, early_loads", [(False, False), (False, True), (True, False), (True, True)])
def test_decode_attention_steps(rng, prefetch, early_loads):
    """Blocks that take several steps: with prefetch each step loads the next step's rows while it uses its own;
    with early_loads the first step's older rows load before the wait. One key, several steps and a partial last
    step, whole contexts and splits."""
    qkv, k, v, bt, lens = case(rng, 3, 45, 4, 2, 16, 4)
    lens[:] = [1, 45, 33]  # a block of one warp steps over 16 keys here (2 lanes a key row of 16 values)
    want = decode_attention_ref(qkv, k, v, bt, 4, lens, 4, 2, 16)
    for split_keys in (4096, 32):
        config = DecodeAttentionConfig(prefetch=prefetch, early_loads=early_loads, keys_per_lane=1, num_warps=1,
                                       split_keys=split_keys, target_blocks=1)
        got = run_split(qkv, k, v, bt, 4, lens, 4, 2, 16, 4, config=config, max_context_len=45)
        assert rel_error(got, want) < 1e-5


def test_decode_attention_block_size_power_of_two(rng):
    qkv, k, v, bt, lens = case(rng, 1, 12, 2, 1, 16, 3)
    with pytest.raises(ValueError, match="power of two"):
        run(qkv, k, v, bt, 3, lens, 2, 1, 16)


def test_decode_attention_split_shorter_than_one_split(rng):
    qkv, k, v, bt, lens = case(rng, 3, 6, 6, 2, 16, 2)  # every context shorter than one step of keys
    lens[:] = [1, 6, 3]
    got = run_split(qkv, k, v, bt, 2, lens, 6, 2, 16, 4, max_context_len=6)
    assert rel_error(got, decode_attention_ref(qkv, k, v, bt, 2, lens, 6, 2, 16)) < 1e-5


def test_decode_attention_many_splits_default_length(rng):
    qkv, k, v, bt, lens = case(rng, 2, 64, 2, 1, 16, 4)
    lens[:] = [64, 33]
    config = DecodeAttentionConfig(split_keys=8, keys_per_lane=1)
    assert decode_splits(64, 2, 1, config) > 4
    got = run_split(qkv, k, v, bt, 4, lens, 2, 1, 16, 32, config=config)  # max_context_len from the block table: 64
    assert rel_error(got, decode_attention_ref(qkv, k, v, bt, 4, lens, 2, 1, 16)) < 1e-5


def test_decode_attention_same_launch_while_contexts_grow(rng):
    """The grid is fixed by rows and the bound (a captured graph's launch): every length up to it is right."""
    qkv, k, v, bt, lens = case(rng, 3, 60, 2, 1, 16, 4)
    config = DecodeAttentionConfig(split_keys=8, keys_per_lane=1)
    scratch = np.zeros((3, 8, 2, workspace_row(16)), np.float32)
    scratch[..., :18] = np.nan  # stale partials must not leak; the counters start at zero
    ws = cuda.to_device(scratch)
    d = [cuda.to_device(a) for a in (qkv, k, v, bt)]
    for step_lens in ([1, 2, 3], [9, 17, 33], [60, 1, 47]):
        out = cuda.to_device(np.full((3, 32), np.nan, np.float32))
        lens[:] = step_lens
        decode_attention(*d, 4, cuda.to_device(lens), 2, 1, 16, out, workspace=ws, max_context_len=60, config=config)
        assert rel_error(out.copy_to_host(), decode_attention_ref(qkv, k, v, bt, 4, lens, 2, 1, 16)) < 1e-5


def test_decode_attention_padded_step_gives_the_same_bits(rng):
    """A step padded to a graph's size (3 rows to 4; the padding row holds one key of block 0, as chapter 11's do)
    splits every context as the step alone does, so its rows come out bit for bit the same. The grid is sized for
    512 keys (a graph's bound) and the row count drives the splits (24 blocks wanted, one KV head): 3 rows would
    want 8 splits of a context of about 100 keys and 4 rows 6, which cut it into 7 and 4 pieces."""
    qkv, k, v, bt, lens = case(rng, 4, 512, 2, 1, 16, 8)
    lens[:3] = rng.integers(100, 113, 3)
    lens[3], bt[3] = 1, 0
    config = DecodeAttentionConfig(num_warps=1, keys_per_lane=1, split_keys=32, target_blocks=24)

    def launch(n):
        return run_split(qkv[:n], k, v, bt[:n], 8, lens[:n], 2, 1, 16, 8, config=config, max_context_len=512)

    alone, with_padding = launch(3), launch(4)
    assert np.array_equal(alone, with_padding[:3])
    assert rel_error(alone, decode_attention_ref(qkv[:3], k, v, bt[:3], 8, lens[:3], 2, 1, 16)) < 1e-5


def test_decode_attention_split_bf16_out(rng):
    qkv, k, v, bt, lens = case(rng, 3, 40, 2, 1, 16, 8)
    got = run_split(qkv, k, v, bt, 8, lens, 2, 1, 16, 8, out_dtype=np.uint16, max_context_len=40)
    want = f32_to_bf16_bits(decode_attention_ref(qkv, k, v, bt, 8, lens, 2, 1, 16).astype(np.float32))
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def test_decode_splits_and_workspace():
    cfg, step = DEFAULT_DECODE_CONFIG, 48
    for max_len, rows in [(1, 1), (17, 3), (1024, 1), (1024, 64), (1024, 256), (100_000, 8)]:
        grid = decode_splits(max_len, rows, 8)
        assert 1 <= grid <= cfg.max_splits
        for n in {1, max_len // 3 + 1, max_len}:  # every length up to the bound fits in the grid's splits
            splits = num_splits_for(n, cfg.max_splits, split_rows(rows) * 8, cfg.split_keys, cfg.target_blocks,
                                    cfg.min_split_keys)
            length = split_length(n, splits, step)
            assert length % step == 0 and -(-n // length) <= splits <= grid
    assert decode_splits(1024, 64, 8) == 1  # 1024 keys a block; 512 blocks wanted, 64 x 8 there
    assert decode_splits(1024, 8, 8) == 8  # 512 blocks wanted: 8 x 8 x 8
    # the rows are rounded up to chapter 11's graph sizes: 25 rows split as 32 do, 3 as 4
    assert [split_rows(r) for r in (1, 2, 3, 4, 5, 8, 9, 25, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 40]
    assert decode_splits(1024, 25, 8) == decode_splits(1024, 32, 8) == 2 != num_splits_for(1024, 32, 25 * 8, 1024, 512, 8)
    assert decode_splits(1024, 3, 8) == decode_splits(1024, 4, 8) == 16
    ws = decode_workspace(8, 1024, 32, 64)
    assert ws.dtype == np.float32 and ws.shape[0] == 8 and ws.shape[2:] == (32, 96) and ws.shape[1] > 1
    assert not ws.copy_to_host().any()  # the splits' counters start at zero
    with pytest.raises(ValueError, match="max_splits must be at most 32"):
        DecodeAttentionConfig(max_splits=33)
    with pytest.raises(ValueError, match="split_keys"):
        DecodeAttentionConfig(split_keys=0)


@cuda.jit
def _split_policy_kernel(cases, out):
    """The split policy's device functions, one case a thread: (split_rows, num_splits_for, split_length)."""
    i = cuda.grid(1)
    if i < cases.shape[0]:
        n, rows = cases[i, 0], cases[i, 1]
        row_blocks = cases[i, 2] * split_rows_on_device(rows)
        splits = num_splits_for_on_device(n, uint32(32), row_blocks, cases[i, 3], cases[i, 4], cases[i, 5])
        out[i, 0] = split_rows_on_device(rows)
        out[i, 1] = splits
        out[i, 2] = split_length_on_device(n, splits, cases[i, 6])


def test_split_policy_host_equals_device(rng):
    """split_policy is written once: its host functions (Python ints) and the kernel's (uint32 steps) agree."""
    cases = np.stack([rng.integers(1, 100_000, 64), rng.integers(1, 300, 64), rng.integers(1, 9, 64),
                      rng.choice([384, 1024], 64), rng.choice([1, 512], 64), rng.integers(1, 17, 64),
                      rng.choice([16, 48, 96], 64)], axis=1).astype(np.uint32)
    cases[:4, 1] = [1, 2, 3, 4]  # every branch of split_rows
    out = cuda.to_device(np.zeros((len(cases), 3), np.uint32))
    _split_policy_kernel[2, 32](cuda.to_device(cases), out)
    want = []
    for n, rows, kvh, split_keys, target_blocks, min_split_keys, step in cases.tolist():
        splits = num_splits_for(n, 32, kvh * split_rows(rows), split_keys, target_blocks, min_split_keys)
        want.append((split_rows(rows), splits, split_length(n, splits, step)))
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_decode_attention_bf16_out_and_block_size_1(rng):
    qkv, k, v, bt, lens = case(rng, 2, 13, 2, 1, 16, 1)
    got = run(qkv, k, v, bt, 1, lens, 2, 1, 16, out_dtype=np.uint16)
    want = f32_to_bf16_bits(decode_attention_ref(qkv, k, v, bt, 1, lens, 2, 1, 16).astype(np.float32))
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1  # at most one bf16 step


def test_write_kv_cache(rng):
    qkv = rng.standard_normal((5, (4 + 2 * 2) * 16)).astype(np.float32)
    slots = np.array([7, 0, -1, 12, 3], np.int32)  # -1: a padding row, skipped
    k, v = np.zeros((16, 2, 16), np.uint16), np.zeros((16, 2, 16), np.uint16)
    k_d, v_d = cuda.to_device(k), cuda.to_device(v)
    write_kv_cache(cuda.to_device(qkv), 4, 2, cuda.to_device(slots), k_d, v_d)
    write_kv_cache_ref(qkv, 4, 2, slots, k, v)
    assert np.array_equal(k_d.copy_to_host(), k) and np.array_equal(v_d.copy_to_host(), v)


@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("threads", [256, 24])  # one block a token; three, the last past the heads
def test_rope_and_write_kv_cache_is_rope_then_the_write(rng, pos_dtype, threads):
    """The fused kernel against rope_qkv_ref then write_kv_cache_ref: Q and K rotated in place, K and V cached."""
    H, KVH, D = 4, 2, 16
    table = rope_table(D, 10000.0, 64)
    qkv = rng.standard_normal((5, (H + 2 * KVH) * D)).astype(np.float32)
    positions = np.array([0, 63, 7, 30, 5], pos_dtype)
    slots = np.array([7, 0, -1, 12, 3], np.int64)  # -1: a padding row, rotated but not cached
    k, v = rng.integers(0, 2**16, (2, 16, KVH, D), dtype=np.uint16)  # stale bits where nothing is written
    k_d, v_d, qkv_d = cuda.to_device(k), cuda.to_device(v), cuda.to_device(qkv)
    rope_and_write_kv_cache(qkv_d, cuda.to_device(positions), table.to_device(), H, KVH, cuda.to_device(slots), k_d, v_d,
                            threads=threads)
    want = rope_qkv_ref(qkv, positions, table, H, KVH)
    write_kv_cache_ref(want, H, KVH, slots, k, v)
    assert rel_error(qkv_d.copy_to_host(), want) < 1e-6
    got_k, got_v = k_d.copy_to_host(), v_d.copy_to_host()
    for got, ref in ((got_k, k), (got_v, v)):  # bf16 of (nearly) the same float32: at most one step apart
        assert np.abs(got.astype(np.int32) - ref.astype(np.int32)).max() <= 1
    assert np.array_equal(got_v, v)  # V is not rotated: its bits are exact
    with pytest.raises(ValueError, match="RoPE table"):
        rope_and_write_kv_cache(qkv_d, cuda.to_device(positions), rope_table(8, 10000.0, 64).to_device(), H, KVH,
                                cuda.to_device(slots), k_d, v_d)


def test_rope_and_write_kv_cache_past_the_grids_height(rng, monkeypatch):
    """More tokens than the grid has rows: each row of blocks takes the tokens a grid apart in turn."""
    from tinyvllm_lib.kernels import kv_cache_write

    monkeypatch.setattr(kv_cache_write, "MAX_GRID_Y", 1)  # one row of blocks: every group in turn
    H, KVH, D = 4, 2, 16
    table = rope_table(D, 10000.0, 64)
    qkv = rng.standard_normal((5, (H + 2 * KVH) * D)).astype(np.float32)
    positions, slots = np.array([0, 63, 7, 30, 5], np.int64), np.array([7, 0, 2, 12, 3], np.int64)
    k, v = rng.integers(0, 2**16, (2, 16, KVH, D), dtype=np.uint16)
    k_d, v_d, qkv_d = cuda.to_device(k), cuda.to_device(v), cuda.to_device(qkv)
    rope_and_write_kv_cache(qkv_d, cuda.to_device(positions), table.to_device(), H, KVH, cuda.to_device(slots), k_d, v_d)
    want = rope_qkv_ref(qkv, positions, table, H, KVH)
    write_kv_cache_ref(want, H, KVH, slots, k, v)
    assert rel_error(qkv_d.copy_to_host(), want) < 1e-6
    assert np.array_equal(v_d.copy_to_host(), v)
    assert np.abs(k_d.copy_to_host().astype(np.int32) - k.astype(np.int32)).max() <= 1


def test_bad_arguments(rng):
    qkv, k, v, bt, lens = case(rng, 1, 4, 4, 2, 16, 4)
    out = cuda.device_array((1, 64), np.float32)
    with pytest.raises(TypeError, match="block_tables"):
        decode_attention(cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v), cuda.to_device(bt.astype(np.int64)), 4,
                         cuda.to_device(lens), 4, 2, 16, out)
    with pytest.raises(TypeError, match="workspace"):
        decode_attention(cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v), cuda.to_device(bt), 4,
                         cuda.to_device(lens), 4, 2, 16, out, workspace=cuda.device_array((1, 4, 4, 16), np.float32))
    with pytest.raises(ValueError, match="cache"):
        decode_attention(cuda.to_device(qkv), cuda.to_device(np.ascontiguousarray(k[:, :1])), cuda.to_device(v), cuda.to_device(bt), 4,
                         cuda.to_device(lens), 4, 2, 16, out)
    # the paged context's checks are chapter 10's too (check_paged_context): host arrays are checked in full
    with pytest.raises(ValueError, match="context_lens"):
        decode_attention(qkv, k, v, bt, 4, np.array([bt.shape[1] * 4 + 1], np.int32), 4, 2, 16, out)
    with pytest.raises(ValueError, match="outside the cache"):
        decode_attention(qkv, k, v, np.full_like(bt, len(k) // 4), 4, lens, 4, 2, 16, out)
    with pytest.raises(ValueError, match="as many slots"):
        decode_attention(qkv, k, v[:-4], bt, 4, lens, 4, 2, 16, out)
    with pytest.raises(TypeError, match="context_lens"):
        decode_attention(qkv, k, v, bt, 4, lens.astype(np.int64), 4, 2, 16, out)


@pytest.mark.gpu
def test_decode_attention_llama_1b_shapes(rng):
    qkv, k, v, bt, lens = case(rng, 64, 1024, 32, 8, 64, 16)
    lens[:] = 1024
    lens[1::2] = rng.integers(1, 1025, 32)
    want = decode_attention_ref(qkv, k, v, bt, 16, lens, 32, 8, 64)
    assert rel_error(run(qkv, k, v, bt, 16, lens, 32, 8, 64), want) < 1e-5
    assert rel_error(run_split(qkv, k, v, bt, 16, lens, 32, 8, 64, 32, max_context_len=1024), want) < 1e-5
    one = run_split(qkv[:1], k, v, bt[:1], 16, lens[:1], 32, 8, 64, 32, max_context_len=1024)  # 1 sequence: 32 splits
    assert rel_error(one, want[:1]) < 1e-5


def test_decode_attention_rows_stay_in_registers():
    """The rows a lane holds (and, with prefetch, the next step's) pass through inlined device functions: they stay
    registers only while every index is a constant and the functions are inlined. Nothing may touch local memory."""
    found = local_memory_accesses("tinyvllm_lib.kernels.decode_attention_kernel")
    assert "decode_attention_d64_g4_one_row_kernel" in found and len(found) >= 3
    assert not any(found.values()), found


def new_slots(bt, block_size, lens):
    """Each row's newest key's slot (position lens[s] - 1), int64."""
    pos = lens.astype(np.int64) - 1
    return bt[np.arange(len(lens)), pos // block_size].astype(np.int64) * block_size + pos % block_size


def fused_against_two_launches(gen, lens, H, KVH, D, block_size, max_len, launcher=decode_attention, max_splits=1,
                               padding_row=None, exact=True, **kw):
    """decode_attention(..., rope=, slot_mapping=) against rope_and_write_kv_cache then the unfused launch, on
    random inputs: the cache's bits (K within one bf16 step of the write's: the rotation may round differently
    inside the kernel; V the same), only the new slots changed, qkv left as it was, and (exact) the output equal
    to the unfused launch over the fused launch's own cache. Returns the fused output, the rotated qkv, the fused
    launch's caches, the block tables and lengths (the tensor cores' test checks the output against float64, as
    its Q rounded to bf16 may round a rotation's last bit either way)."""
    num_seqs = len(lens)
    qkv, k, v, bt, _ = case(gen, num_seqs, max_len, H, KVH, D, block_size)
    lens = np.asarray(lens, np.int32)
    positions = lens.astype(np.int64) - 1
    slots = new_slots(bt, block_size, lens)
    if padding_row is not None:
        slots[padding_row] = -1  # a batch padded to a captured size: nothing stored
    table = rope_table(D, 500000.0, max_len + 3)
    dtable = table.to_device()

    def launch(q, k_cache, v_cache, **extra):
        out = cuda.to_device(np.full((num_seqs, H * D), np.nan, np.float32))
        ws = None
        if max_splits > 1:
            scratch = np.zeros((num_seqs, max_splits, H, workspace_row(D)), np.float32)
            scratch[..., : D + 2] = np.nan
            ws = cuda.to_device(scratch)
        launcher(q, k_cache, v_cache, cuda.to_device(bt), block_size, cuda.to_device(lens), H, KVH, D, out,
                 workspace=ws, max_context_len=max_len, **kw, **extra)
        return out.copy_to_host()

    # two launches: RoPE and the write, then attention over the cache
    q2, k2, v2 = cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v)
    rope_and_write_kv_cache(q2, cuda.to_device(positions), dtable, H, KVH, cuda.to_device(slots), k2, v2)
    two = launch(q2, k2, v2)
    rotated = q2.copy_to_host()
    # one launch
    q1, k1, v1 = cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v)
    one = launch(q1, k1, v1, rope=(dtable, cuda.to_device(positions)), slot_mapping=cuda.to_device(slots))
    assert np.array_equal(q1.copy_to_host(), qkv), "the fused launch must leave qkv as it was"
    k_one, v_one, k_two, v_two = (a.copy_to_host() for a in (k1, v1, k2, v2))
    stored = slots[slots >= 0]
    changed = np.zeros(len(k), bool)
    changed[stored] = True
    assert np.array_equal(k_one[~changed], k[~changed]) and np.array_equal(v_one[~changed], v[~changed])
    assert np.array_equal(v_one, v_two)
    steps = np.abs(k_one[stored].astype(np.int32) - k_two[stored].astype(np.int32))
    assert steps.max(initial=0) <= 1, "K may differ from the write's by one bf16 step (the rotation's rounding)"
    assert (k_one[stored] != k[stored]).any(), "the newest keys were stored"
    assert not np.isnan(one).any()
    if exact:  # the unfused kernel over the fused launch's own cache, with the rotated queries
        want = launch(cuda.to_device(rotated), cuda.to_device(k_one), cuda.to_device(v_one))
        assert rel_error(one, want) < 1e-5
        if (steps == 0).all():
            assert rel_error(one, two) < 1e-5
    return one, rotated, k_one, v_one, bt, lens


@pytest.mark.parametrize("lens, max_splits, config, padding_row", [
    ([1, 29, 16, 9], 1, DecodeAttentionConfig(num_warps=2), None),  # one split, a context of one token
    ([45, 17, 30, 1], 8, DecodeAttentionConfig(split_keys=16, keys_per_lane=1, prefetch=True), 2),  # splits, prefetch
    ([37], 8, DecodeAttentionConfig(split_keys=16, keys_per_lane=1), None),  # one row: early loads, splits
    ([37], 8, DecodeAttentionConfig(split_keys=16, keys_per_lane=1, prefetch=False), None),  # and no prefetch
], ids=["one-split", "splits-prefetch-padding", "one-row-early-loads", "one-row-early-loads-no-prefetch"])
def test_fused_rope_is_the_write_then_attention(rng, lens, max_splits, config, padding_row):
    if len(lens) == 1:
        assert config.for_rows(1).early_loads
    fused_against_two_launches(rng, lens, 4, 2, 16, 4, 45, max_splits=max_splits, padding_row=padding_row,
                               config=config)


def test_fused_rope_with_fewer_threads_than_words(rng):
    """One warp at head_dim 256: 32 threads store a row's 64 words of K and of V, two passes of the strided loop."""
    fused_against_two_launches(rng, [5, 12], 2, 1, 256, 4, 12, config=DecodeAttentionConfig(num_warps=1))


def test_fused_rope_needs_its_metadata(rng):
    qkv, k, v, bt, lens = case(rng, 2, 8, 4, 2, 16, 4)
    args = [cuda.to_device(a) for a in (qkv, k, v, bt)] + [4, cuda.to_device(lens), 4, 2, 16,
                                                          cuda.device_array((2, 64), np.float32)]
    table = rope_table(16, 10000.0, 16).to_device()
    positions = cuda.to_device(np.array([0, 1], np.int64))
    with pytest.raises(ValueError, match="go together"):
        decode_attention(*args, rope=(table, positions))
    with pytest.raises(ValueError, match="head_dim 32"):
        decode_attention(*args, rope=(rope_table(32, 10000.0, 16).to_device(), positions),
                         slot_mapping=positions)
    with pytest.raises(TypeError, match="slot_mapping"):
        decode_attention(*args, rope=(table, positions), slot_mapping=cuda.to_device(np.zeros(3, np.int64)))
    with pytest.raises(TypeError, match="positions"):
        decode_attention(*args, rope=(table, cuda.to_device(np.zeros(2, np.float32))), slot_mapping=positions)


def llama_1b_contexts(gen, rows: int) -> np.ndarray:
    """Context lengths for Llama 3.2 1B's fused GPU tests: one row at the 1,024 bound, the rest drawn below it."""
    lens = gen.integers(1, 1025, rows)
    lens[0] = 1024
    return lens


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="Llama 3.2 1B's shapes: a GPU")
@pytest.mark.parametrize("rows", [1, 64])
def test_fused_rope_llama_1b_shapes(rng, rows):
    lens = llama_1b_contexts(rng, rows)
    fused_against_two_launches(rng, lens, 32, 8, 64, 16, 1024, max_splits=32)
    fused_against_two_launches(rng, lens, 32, 8, 64, 16, 1024)


def test_paged_attention_fuses_a_decode_only_step_and_not_a_mixed_one(monkeypatch):
    """With fuse_rope, a decode-only step hands rope and the slots to a launcher marked fuses_rope and launches no
    write; a step with a prefill writes first; fuse_rope=False, or a launcher not marked, keeps the write; the
    default is chapter 10's FUSE_DECODE_ROPE."""
    from types import SimpleNamespace

    from tinyvllm_lib.layers import attention

    writes, decodes, prefills = [], [], []
    monkeypatch.setattr(attention, "cache_new_kv", lambda *a: writes.append(a[1]))

    def launcher(*args, **kw):
        decodes.append(kw)

    def plain(*args, **kw):
        decodes.append(kw)

    launcher.fuses_rope = True
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cache = SimpleNamespace(k=["k"], v=["v"], k_words=["kw"], v_words=["vw"])

    def step(num_prefills, decode_attention, **kw):
        meta = SimpleNamespace(num_prefills=num_prefills, num_decodes=2, slot_mapping="slots", block_tables="bt",
                               block_size=16, seq_lens="lens", query_start_loc="qsl", max_query_len=3)
        layer = attention.PagedAttention(config, cache, meta, decode_attention=decode_attention,
                                         prefill_attention=lambda *a, **k: prefills.append(1), **kw)
        writes.clear(), decodes.clear(), prefills.clear()
        layer(0, "qkv", "out", rope=("table", "positions"))
        return list(writes), [d.get("rope") for d in decodes], len(prefills)

    assert step(0, launcher, fuse_rope=True) == ([], [("table", "positions")], 0)
    assert decodes[0]["slot_mapping"] == "slots"
    assert step(1, launcher, fuse_rope=True) == ([("table", "positions")], [], 1)
    assert step(0, launcher, fuse_rope=False) == ([("table", "positions")], [None], 0)
    assert step(0, plain, fuse_rope=True) == ([("table", "positions")], [None], 0)
    for default in (False, True):
        monkeypatch.setattr(attention, "FUSE_DECODE_ROPE", default)
        assert step(0, launcher)[0] == ([] if default else [("table", "positions")])
