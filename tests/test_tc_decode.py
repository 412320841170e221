"""Chapter 14's decode attention on the tensor cores against float64 NumPy, and against
chapter 8's kernel on the same cache."""

import functools

import numpy as np
import pytest
from numba import cuda
from test_decode_attention import case, fused_against_two_launches, llama_1b_contexts

from tinyvllm_lib.kernels import tc_decode
from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyvllm_lib.kernels.decode_attention_config import DecodeAttentionConfig
from tinyvllm_lib.kernels.decode_splits import decode_splits, workspace_row
from tinyvllm_lib.kernels.tc_decode import (
    TC_DECODE_MIN_ROWS,
    auto_decode_attention,
    decode_attention_for,
    make_tc_decode_kernel,
    tc_decode_attention,
    tc_decode_kernel_for,
    tc_decode_shape,
)
from tinyvllm_lib.runtime import can_launch, has_gpu, is_simulator

pytestmark = pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")

NAN_BF16 = 0x7FC0


def poisoned(k, v, bt, bs, lens):
    """k and v with every slot outside the contexts a NaN: a read past a context (the
    clamp to its last key undone) turns the output into NaN, even where its weight is
    zero (0 x NaN on the tensor cores)."""
    used = np.zeros(len(k), bool)
    for s, n in enumerate(lens):
        pos = np.arange(n)
        used[bt[s, pos // bs].astype(np.int64) * bs + pos % bs] = True
    k, v = k.copy(), v.copy()
    k[~used], v[~used] = NAN_BF16, NAN_BF16
    return k, v


def rounded_ref(qkv, k, v, bt, bs, lens, H, KVH, D):
    """The reference with Q rounded to bf16 where the kernel rounds it (P's rounding,
    relative to a running maximum, is left to the tolerance)."""
    q = bf16_bits_to_f32(f32_to_bf16_bits(qkv[:, : H * D]))
    return decode_attention_ref(np.concatenate([q, qkv[:, H * D:]], 1), k, v, bt, bs,
                                lens, H, KVH, D)


def launch(fn, qkv, k, v, bt, bs, lens, H, KVH, D, out_dtype=np.float32, splits=1,
           **kw):
    fill = NAN_BF16 if out_dtype == np.uint16 else np.nan
    out = cuda.to_device(np.full((len(qkv), H * D), fill, out_dtype))
    k, v = poisoned(k, v, bt, bs, lens)
    ws = None
    if splits > 1:
        scratch = np.zeros((len(qkv), splits, H, workspace_row(D)), np.float32)
        scratch[..., : D + 2] = np.nan  # stale partials must not leak
        ws = cuda.to_device(scratch)
    fn(cuda.to_device(qkv), cuda.to_device(k), cuda.to_device(v), cuda.to_device(bt),
       bs, cuda.to_device(lens), H, KVH, D, out, workspace=ws, **kw)
    got = out.copy_to_host()
    if ws is not None:  # the last split of each (row, KV head) reset its counter
        assert (ws.copy_to_host()[:, 0, :, D + 2] == 0).all()
    return bf16_bits_to_f32(got) if out_dtype == np.uint16 else got


def check(got, qkv, k, v, bt, bs, lens, H, KVH, D, out_dtype=np.float32):
    """Element by element: the kernel's error against float64 is the rounded reference's
    (Q in bf16, the same rounding) plus what P's rounding to bf16 can add — each weight
    off by at most 2^-9 of itself in the sum with V, not in the softmax's denominator,
    so at most 2^-9 of the largest |V| of that KV head and dimension over the row's
    context — plus float32's sums; bf16 output adds half an ulp."""
    assert not np.isnan(got).any()
    exact = decode_attention_ref(qkv, k, v, bt, bs, lens, H, KVH, D)
    ref_err = np.abs(rounded_ref(qkv, k, v, bt, bs, lens, H, KVH, D) - exact)
    values = bf16_bits_to_f32(v)
    slack = np.zeros_like(exact)
    for s, n in enumerate(lens):
        pos = np.arange(n)
        slots = bt[s, pos // bs].astype(np.int64) * bs + pos % bs
        v_max = np.abs(values[slots]).max(0)  # (KVH, D)
        slack[s] = 2.0**-9 * np.repeat(v_max, H // KVH, axis=0).reshape(-1)
    slack += 1e-5 * np.abs(exact).max()
    if out_dtype == np.uint16:
        slack += 2.0**-9 * np.abs(exact)
    err = np.abs(got - exact)
    worst = np.unravel_index(np.argmax(err - 1.5 * ref_err - slack), err.shape)
    assert (err <= 1.5 * ref_err + slack).all(), (worst, err[worst], ref_err[worst],
                                                 slack[worst])


@pytest.mark.skipif(not is_simulator(), reason="tiny shapes for the simulator")
@pytest.mark.parametrize("split_keys,shape,heads,D", [
    (1024, None, (4, 2), 16), (64, None, (4, 2), 16),  # a GPU's block, 2 query heads
    (64, (2, 2), (2, 2), 16),  # one query head a KV head
    (1024, (3, 3), (8, 1), 16),  # eight (a fragment's top half); three stages
    (1024, None, (4, 2), 128),  # the block a GPU runs above head size 64
])
def test_tc_decode_in_the_simulator(rng, split_keys, shape, heads, D):
    """The blocks a GPU runs (tc_decode_shape) and others: one key, a partial tile,
    several tiles through every stage; one split each, or splits of 64 keys with
    their combine."""
    (H, KVH), bs = heads, 4
    qkv, k, v, bt, lens = case(rng, 4, 150, H, KVH, D, bs)
    lens[:] = [1, 29, 150, 70]
    cfg = DecodeAttentionConfig(split_keys=split_keys, target_blocks=1, few_rows=0)
    splits = decode_splits(150, len(lens), KVH, cfg)
    assert (splits > 1) == (split_keys == 64)
    fn = tc_decode_attention
    if shape:
        kernel_for = functools.partial(tc_decode_kernel_for, num_warps=shape[0],
                                       stages=shape[1])
        fn = functools.partial(decode_attention, kernel_for=kernel_for)
    got = launch(fn, qkv, k, v, bt, bs, lens, H, KVH, D,
                 splits=splits, max_context_len=150, config=cfg)
    check(got, qkv, k, v, bt, bs, lens, H, KVH, D)


def test_tc_decode_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        make_tc_decode_kernel(72, 4)
    with pytest.raises(ValueError, match="two stages"):
        make_tc_decode_kernel(64, 4, stages=1)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        make_tc_decode_kernel(64, 4, num_warps=4, stages=3)
    with pytest.raises(ValueError, match="tensor_cores"):
        decode_attention_for("tensor_cores", 192, 4)
    with pytest.raises(ValueError, match="query heads a KV head"):
        make_tc_decode_kernel(64, 16)
    with pytest.raises(ValueError, match="tensor_cores"):
        decode_attention_for("tensor_cores", 64, 16)
    assert decode_attention_for("tensor_cores", 64, 4) is tc_decode_attention
    assert decode_attention_for("simt", 64, 4) is decode_attention


def test_auto_takes_the_tensor_cores_from_its_row_count(monkeypatch):
    """"auto" on a GPU: chapter 8's kernel below TC_DECODE_MIN_ROWS rows (rounded up
    to a multiple of 8, a graph's size), this chapter's from there on, with every
    argument passed through; in the simulator chapter 8's for every step (the twins
    are slow)."""
    calls = []
    for name in ("decode_attention", "tc_decode_attention"):
        monkeypatch.setattr(tc_decode, name,
                            lambda qkv, *a, _n=name, **kw: calls.append((_n, len(qkv), a, kw)))
    low, high = TC_DECODE_MIN_ROWS - 8, TC_DECODE_MIN_ROWS - 7  # 120: 120; 121: 128
    for rows in (1, low, high, TC_DECODE_MIN_ROWS, 2 * TC_DECODE_MIN_ROWS):
        auto_decode_attention(np.zeros((rows, 8), np.float32), "k", "v", stream=3)
    assert [c[:2] for c in calls] == [
        ("decode_attention", 1), ("decode_attention", low),
        ("tc_decode_attention", high), ("tc_decode_attention", TC_DECODE_MIN_ROWS),
        ("tc_decode_attention", 2 * TC_DECODE_MIN_ROWS)]
    assert all(c[2] == ("k", "v") and c[3] == {"stream": 3} for c in calls)
    monkeypatch.undo()
    want = decode_attention if is_simulator() else auto_decode_attention
    assert decode_attention_for("auto", 64, 4) is want
    assert decode_attention_for("auto", 72, 4) is decode_attention  # no tensor-core fit


def test_linked_decode_ptx_keeps_fragments_in_registers():
    """No GPU needed: 8 mma for S and 8 for O a warp's 16 keys, K and V copies by
    cp.async, no local memory, every C function inlined."""
    from tinyvllm_lib.kernels.tensor_core import linked_ptx_counts

    counts = linked_ptx_counts("tinyvllm_lib.kernels.tc_decode", "tc_decode_d64_g4_kernel")
    warps, stages = tc_decode_shape(64)
    assert counts["mma.sync"] == 2 * (64 // 16) + 2 * (64 // 16)
    assert counts["cp.async"] == 2 * 16 * warps * (64 // 8) // (32 * warps)  # K and V
    assert counts["cp.async wait"] == 1  # the wait for the tile stages - 1 back
    assert counts["ldmatrix"] == 64 // 16 + 64 // 16  # K for S, V (transposed) for O
    assert counts["shared align 16"] == 2  # K and V stages: ldmatrix and cp.async
    assert counts["local memory"] == 0 and counts["call"] == 0


@pytest.mark.parametrize("max_num_seqs", [100, 130, 136, 256])
def test_auto_picks_for_a_step_what_its_padded_graph_holds(max_num_seqs, monkeypatch):
    """For every row count a decode step may have, "auto" picks the kernel for the
    step run eagerly that it picks for the step padded to its CUDA graph's size."""
    from tinyvllm_lib.engine.cuda_graphs import cuda_graph_sizes, graph_size_for

    for name in ("decode_attention", "tc_decode_attention"):
        monkeypatch.setattr(tc_decode, name, lambda qkv, _n=name: _n)
    sizes = cuda_graph_sizes(max_num_seqs)
    picked = {}
    for rows in range(1, max_num_seqs + 1):
        padded = graph_size_for(rows, sizes)
        eager, graph = (auto_decode_attention(np.zeros((n, 1), np.float32))
                        for n in (rows, padded))
        assert padded >= rows and eager == graph, (rows, padded, eager, graph)
        picked[eager] = picked.get(eager, 0) + 1
    print(f"max_num_seqs {max_num_seqs}: row counts by kernel {picked}")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_auto_decode_on_the_gpu_is_the_chosen_kernel(rng):
    """At TC_DECODE_MIN_ROWS - 8 and - 7 rows of Llama 3.2 1B's heads (the second
    rounds up to TC_DECODE_MIN_ROWS), "auto"'s launcher gives the bits of the kernel
    its row count picks."""
    H, KVH, D, bs = 32, 8, 64, 16
    for rows, picked in ((TC_DECODE_MIN_ROWS - 8, decode_attention),
                         (TC_DECODE_MIN_ROWS - 7, tc_decode_attention)):
        qkv, k, v, bt, lens = case(rng, rows, 700, H, KVH, D, bs)
        kw = dict(splits=32, max_context_len=700, config=DecodeAttentionConfig())
        got = launch(decode_attention_for("auto", D, H // KVH), qkv, k, v, bt, bs, lens,
                     H, KVH, D, **kw)
        assert np.array_equal(got, launch(picked, qkv, k, v, bt, bs, lens, H, KVH, D,
                                          **kw))
        check(got, qkv, k, v, bt, bs, lens, H, KVH, D)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("rows", [1, 37])
def test_tc_decode_on_the_gpu(rng, out_dtype, rows):
    """Llama 3.2 1B's heads, contexts of 1 to 3,000 keys over a shuffled block table,
    with and without splits; against float64 and chapter 8's kernel."""
    H, KVH, D, bs = 32, 8, 64, 16
    qkv, k, v, bt, lens = case(rng, rows, 3000, H, KVH, D, bs)
    lens[0] = 1 if rows > 1 else 2999
    for splits in (1, 32):
        cfg = DecodeAttentionConfig()
        kw = dict(out_dtype=out_dtype, splits=splits, max_context_len=3000, config=cfg)
        got = launch(tc_decode_attention, qkv, k, v, bt, bs, lens, H, KVH, D, **kw)
        check(got, qkv, k, v, bt, bs, lens, H, KVH, D, out_dtype)
        simt = launch(decode_attention, qkv, k, v, bt, bs, lens, H, KVH, D, **kw)
        assert np.abs(got - simt).max() <= 2.0**-6 * np.abs(simt).max()


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_auto_engine_at_many_rows_gives_the_eager_tokens(tmp_path, rng, monkeypatch):
    """An engine on 1B-shaped heads (two random layers) with "auto": the runner holds
    auto_decode_attention, and TC_DECODE_MIN_ROWS + 8 greedy requests decoding together
    (tensor-core steps, then chapter 8's as they finish) give through captured steps
    the eager path's tokens, or part from them first where the eager path's top two
    log-probs tie within 0.01: a captured step pads its rows to the graph's size, so
    its products run at another row count than the eager step's. (On the H100, 1
    request of 816 with "auto" parted from the eager path, none of 680 with chapter 8's
    decode at every size; which product's bits moved was not found.)"""
    from tinyvllm_lib.engine.llm import LLM
    from tinyvllm_lib.engine.sampling_params import SamplingParams
    from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama

    folder = make_random_llama(tmp_path, LLAMA_3_2_1B_CONFIG | {"num_hidden_layers": 2},
                               seed=3)
    n = TC_DECODE_MIN_ROWS + 8
    prompts = [rng.integers(0, 10_000, int(rng.integers(20, 120))).tolist()
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(16, 40)),
                             ignore_eos=True, logprobs=2) for _ in range(n)]
    launched = []  # the eager steps' tensor-core launches, counted through auto's lookup
    counted = tc_decode.tc_decode_attention

    def counting(qkv, *args, **kwargs):
        launched.append(qkv.shape[0])
        return counted(qkv, *args, **kwargs)

    outs = {}
    for eager in (True, False):
        if eager:
            monkeypatch.setattr(tc_decode, "tc_decode_attention", counting)
        else:
            monkeypatch.undo()
        llm = LLM(folder, device="cuda", max_model_len=512, max_num_seqs=n,
                  enforce_eager=eager)
        assert llm.llm_engine.model_runner.decode_attention is auto_decode_attention
        outs[eager] = [o.outputs[0] for o in llm.generate(prompts, params,
                                                          use_tqdm=False)]
        del llm
    gaps = []  # where a request parts from the eager path: the eager top-two gap
    for a, b in zip(outs[True], outs[False]):
        if a.token_ids != b.token_ids:
            t = next(j for j, pair in enumerate(zip(a.token_ids, b.token_ids))
                     if pair[0] != pair[1])
            top = sorted(a.logprobs[t].values(), reverse=True)
            gaps.append(top[0] - top[1])
    print(f"{n - len(gaps)}/{n} requests with the eager path's tokens; the others part "
          f"at top-two gaps {gaps}; the eager path's tensor-core launches: "
          f"{len(launched)}, at {sorted(set(launched))} rows")
    assert launched and min(launched) > TC_DECODE_MIN_ROWS - 8
    assert all(g < 0.01 for g in gaps)


def fused_tc_check(gen, lens, H, KVH, D, bs, max_len, **kw):
    """The tensor cores' fused launch: cache bits and qkv as chapter 8's (the shared helper), the output within
    check()'s bound of float64 over the rotated queries and the launch's own cache."""
    got, rotated, k, v, bt, lens = fused_against_two_launches(gen, lens, H, KVH, D, bs, max_len,
                                                              launcher=tc_decode_attention, exact=False, **kw)
    check(got, rotated, k, v, bt, bs, lens, H, KVH, D)


@pytest.mark.skipif(not is_simulator(), reason="tiny shapes for the simulator")
def test_tc_decode_fused_rope_in_the_simulator(rng):
    """One key, a partial tile and several tiles, with splits and a padding row."""
    cfg = DecodeAttentionConfig(split_keys=64, target_blocks=1, few_rows=0)
    fused_tc_check(rng, [1, 29, 150, 70], 4, 2, 16, 4, 150, max_splits=4, padding_row=3, config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="Llama 3.2 1B's shapes: a GPU")
@pytest.mark.parametrize("rows", [37, 256])
def test_tc_decode_fused_rope_on_the_gpu(rng, rows):
    lens = llama_1b_contexts(rng, rows)
    for splits in (1, 32):
        fused_tc_check(rng, lens, 32, 8, 64, 16, 1024, max_splits=splits)
