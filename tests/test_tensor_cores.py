"""Chapter 14's tensor-core kernels: fragments in NumPy, one mma tile and the paged
prefill attention against NumPy (through the Python twins in the simulator, the linked
C on a GPU), and the linked kernel's PTX (no GPU needed)."""

import re

import numpy as np
import pytest
from numba import cuda
from sass_loops import key_tile_loop
from test_paged_prefill import (
    make_case,  # a ragged batch over shuffled blocks, NaN elsewhere
)

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from tinyvllm_lib.kernels.paged_attention import (
    paged_prefill_attention_ref,
    prefill_tiles,
    tile_capacity,
)
from tinyvllm_lib.kernels.tensor_core import (
    C_COLS,
    C_ROWS,
    a_fragments,
    a_matrix,
    b_fragments,
    b_matrix,
    c_matrix,
    mma_tile,
)
from tinyvllm_lib.runtime import can_launch, has_gpu, is_simulator

NAN_BF16 = 0x7FC0
needs_kernels = pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")


def random_bits(rng, shape, scale=1.0):
    return f32_to_bf16_bits((scale * rng.standard_normal(shape)).astype(np.float32))


def test_fragments_round_trip_and_cover_each_element_once():
    rng = np.random.default_rng(0)
    a, b = random_bits(rng, (16, 16)), random_bits(rng, (16, 8))
    assert (a_matrix(a_fragments(a)) == a).all()
    assert (b_matrix(b_fragments(b)) == b).all()
    c = rng.standard_normal((32, 4)).astype(np.float32)
    assert sorted(c_matrix(c).ravel().tolist()) == sorted(c.ravel().tolist())
    # PTX's layout, spelled out for lane 13 (group 3, thread 1)
    words = a_fragments(a)[13]
    assert words[0] == a[3, 2] | (np.uint32(a[3, 3]) << 16)
    assert words[3] == a[11, 10] | (np.uint32(a[11, 11]) << 16)
    assert b_fragments(b)[13, 1] == b[10, 3] | (np.uint32(b[11, 3]) << 16)
    assert list(C_ROWS[13]) == [3, 3, 11, 11] and list(C_COLS[13]) == [2, 3, 2, 3]


@needs_kernels
def test_one_mma_tile_equals_numpy():
    rng = np.random.default_rng(1)
    a, b = random_bits(rng, (16, 16)), random_bits(rng, (16, 8))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    want = bf16_bits_to_f32(a).astype(np.float64) @ bf16_bits_to_f32(b) + c
    got = mma_tile(a, b, c)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def run_tc(case, block_size, H, KVH, D, out_dtype=np.float32, padded=False, **kw):
    from tinyvllm_lib.kernels.tc_attention import tc_prefill_attention

    qkv, k_cache, v_cache, tables, seq_lens, starts = case
    fill = NAN_BF16 if out_dtype == np.uint16 else np.nan
    out = cuda.to_device(np.full((len(qkv), H * D), fill, out_dtype))
    from tinyvllm_lib.kernels.tc_attention import tc_block_q

    block_q = kw.get("block_q") or tc_block_q(D)
    tiles = None
    if padded:  # a schedule padded to its capacity, as a captured step holds it
        capacity = tile_capacity(len(qkv), len(starts) - 1, block_q)
        tiles = cuda.to_device(prefill_tiles(starts, seq_lens, block_q,
                                             out=np.empty(capacity, np.int32)))
    tc_prefill_attention(*map(cuda.to_device, case), int(np.diff(starts).max()),
                         block_size, H, KVH, D, out, tiles=tiles, **kw)
    got = out.copy_to_host()
    return bf16_bits_to_f32(got) if out_dtype == np.uint16 else got


def errors(got, case, block_size, H, KVH, D):
    from tinyvllm_lib.kernels.tc_attention import paged_prefill_attention_bf16_ref

    q = case[0][:, : H * D]
    exact = paged_prefill_attention_ref(q, *case[1:], block_size, H, KVH, D)
    rounded = paged_prefill_attention_bf16_ref(q, *case[1:], block_size, H, KVH, D)
    return np.abs(got - exact).max(), np.abs(rounded - exact).max()


SIM_CASES = [  # (seqs, H, KVH, D, block_size, block_q, block_k, warp_tiles)
    ([(0, 21), (37, 9)], 4, 2, 32, 8, 16, 32, 1),  # grouped heads, cached tokens
    ([(5, 40)], 2, 1, 16, 4, 32, 32, 1),  # two warps; 45 keys: two tiles, both stages
    ([(40, 50)], 2, 1, 32, 8, 64, 64, 1),  # the engine's block: 4 warps, 64 keys a tile, 2 tiles
    # two row tiles a warp: one warp of 32 queries over 16-key tiles (masked and not),
    # then two warps of 32 after cached tokens
    ([(3, 37)], 2, 1, 16, 4, 32, 16, 2),
    ([(20, 50)], 2, 1, 16, 8, 64, 32, 2),
]


@pytest.mark.skipif(not is_simulator(), reason="tiny shapes for the simulator")
@pytest.mark.parametrize("case_args", SIM_CASES)
def test_tc_attention_in_the_simulator(case_args):
    seqs, H, KVH, D, bs, bq, bk, wt = case_args
    rng = np.random.default_rng(len(seqs) * 100 + D)
    case = make_case(rng, seqs, H, KVH, D, bs)
    got = run_tc(case, bs, H, KVH, D, block_q=bq, block_k=bk, warp_tiles=wt, padded=True)
    assert not np.isnan(got).any()
    err, ref_err = errors(got, case, bs, H, KVH, D)
    assert err <= 2 * ref_err + 1e-5, (err, ref_err)


@pytest.mark.skipif(not is_simulator(), reason="tiny shapes for the simulator")
def test_tc_attention_bf16_output_in_the_simulator():
    rng = np.random.default_rng(7)
    H, KVH, D, bs = 2, 2, 16, 8
    case = make_case(rng, [(3, 17)], H, KVH, D, bs)
    got = run_tc(case, bs, H, KVH, D, out_dtype=np.uint16, block_q=16, block_k=16)
    err, ref_err = errors(got, case, bs, H, KVH, D)
    # the output's own bf16 rounding: half an ulp of the largest output
    assert err <= 2 * ref_err + 2.0**-8 * np.abs(got).max(), (err, ref_err)


def test_tc_attention_refuses_sizes_it_cannot_take():
    from tinyvllm_lib.kernels.tc_attention import make_tc_prefill_kernel

    with pytest.raises(ValueError, match="multiples of 16"):
        make_tc_prefill_kernel(40, 64, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        make_tc_prefill_kernel(64, 24, 64)
    with pytest.raises(ValueError, match="a multiple of 16 warp_tiles"):
        make_tc_prefill_kernel(64, 48, 64, warp_tiles=2)


GPU_CASES = [  # real shapes: odd lengths, ragged batches, paged after cached tokens
    ([(0, 1000)], 32, 8, 64, 16),
    ([(4096, 333), (0, 77), (5, 1), (130, 64)], 32, 8, 64, 16),
    ([(0, 517), (1000, 900)], 32, 8, 128, 32),
    ([(0, 2048)], 16, 16, 64, 16),  # no grouping
]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("case_args", GPU_CASES)
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("tile", [{}, {"block_q": 64, "warp_tiles": 1}, {"block_q": 64, "warp_tiles": 2}])
def test_tc_attention_on_the_gpu(case_args, out_dtype, tile):
    seqs, H, KVH, D, bs = case_args
    if D > 64 and tile:
        pytest.skip("the other tiles: head_dim 64 (at 128, two row tiles a warp: O alone is 128 registers)")
    rng = np.random.default_rng(sum(n for _, n in seqs))
    case = make_case(rng, seqs, H, KVH, D, bs)
    got = run_tc(case, bs, H, KVH, D, out_dtype=out_dtype, padded=True, **tile)
    assert not np.isnan(got).any()
    err, ref_err = errors(got, case, bs, H, KVH, D)
    slack = 2.0**-8 * np.abs(got).max() if out_dtype == np.uint16 else 1e-5
    assert err <= 2 * ref_err + slack, (err, ref_err)


@pytest.mark.parametrize("style", ["address", "label"])
def test_key_tile_loop_finds_the_loop_around_the_mma(style):
    sass = """
        /*0000*/  STL [R1], RZ ;
.L_x_1:
        /*0010*/  HMMA.16816.F32.BF16 R4, R8, R10, R4 ;
        /*0020*/  @P0 BRA 0x10 ;
        /*0030*/  BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/  HMMA.16816.F32.BF16 R4, R8, R10, R4 ;
        /*0050*/  LDL R2, [R1] ;
        /*0060*/  @P1 BRA 0x10 ;
        /*0070*/  STL [R1], R4 ;
        /*0080*/  @P2 BRA 0x0 ;
    """
    if style == "label":
        sass = sass.replace("BRA 0x10", "BRA `(.L_x_1)").replace("BRA 0x0", "BRA `(.L_x_0)")
        sass = sass.replace("        /*0000*/", ".L_x_0:\n        /*0000*/")
    loop = key_tile_loop(sass)
    assert [i.split()[0] for i in loop] == ["HMMA.16816.F32.BF16", "@P0", "BAR.SYNC.DEFER_BLOCKING",
                                            "HMMA.16816.F32.BF16", "LDL", "@P1"]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tc_attention_sass_has_no_local_memory(head_dim):
    """Each compiled variant (float32 and bf16 output, whichever earlier tests built):
    no local memory in the loop over key tiles. Outside it, the bf16 variant may keep
    O on the stack for the final stores (ptxas 13.0: 17 STL.128 and ~70 LDL once a
    thread, against thousands of HMMA in the loop)."""
    from tinyvllm_lib.kernels.tc_attention import tc_block_k, tc_prefill_kernel_for

    kernel = tc_prefill_kernel_for(head_dim)
    rng = np.random.default_rng(3)
    case = make_case(rng, [(0, 70)], 8, 2, head_dim, 16)
    run_tc(case, 16, 8, 2, head_dim)  # compiles it for the launch's types
    run_tc(case, 16, 8, 2, head_dim, out_dtype=np.uint16)  # and the engine's
    assert len(kernel.signatures) >= 2
    for sig in kernel.signatures:
        sass = kernel.inspect_sass(sig)
        loop = "\n".join(key_tile_loop(sass))
        hmma = len(re.findall(r"\bHMMA\b", loop))
        local = len(re.findall(r"\b(?:LDL|STL)\b", loop))
        print(f"head_dim {head_dim}, {sig}: {hmma} HMMA, {local} LDL/STL in the key-tile "
              f"loop; {len(re.findall(r'LDL|STL', sass))} LDL/STL in the kernel")
        # S = Q K^T and O += P V, a key tile
        assert hmma >= 2 * (head_dim // 16) * (tc_block_k(head_dim) // 8)
        assert local == 0, "fragments spilled to local memory in the loop over key tiles"


@pytest.mark.parametrize("name", ["tc_prefill_d64_kernel", "tc_prefill_d128_kernel",
                                  "tc_prefill_d64_other_kernel"])
def test_linked_ptx_keeps_fragments_in_registers(name):
    """No GPU needed: NVRTC compiles the C, nvJitLink links it with the kernel by LTO
    and gives PTX; the loop over key tiles has its mma, its copies, and no local memory;
    each ldmatrix feeds two mma a row tile of the warp."""
    from tinyvllm_lib.kernels import tc_attention
    from tinyvllm_lib.kernels.tensor_core import linked_ptx_counts

    kernel = getattr(tc_attention, name)
    head_dim, block_k, wt = kernel.head_dim, kernel.block_k, kernel.warp_tiles
    counts = linked_ptx_counts("tinyvllm_lib.kernels.tc_attention", name)
    assert counts["mma.sync"] == 2 * wt * (head_dim // 16) * (block_k // 8)
    assert counts["ldmatrix"] == counts["mma.sync"] // (2 * wt)
    assert counts["cp.async"] == 2 * block_k * (head_dim // 8) // kernel.threads  # K and V
    assert counts["local memory"] == 0 and counts["call"] == 0
    assert counts["ex2"] == wt * (block_k // 2 + 2)  # P's exponentials a lane and row tile, two corrections
    assert counts["shared align 16"] == 2  # K and V tiles: ldmatrix and cp.async need it


def gemm_error_share(rng, M, N, K, out_dtype=np.float32, **kw) -> float:
    """tc_gemm against float64, as a share of twice the float32 summation bound."""
    from tinyvllm_lib.kernels.tc_gemm import tc_gemm

    a, b = random_bits(rng, (M, K)), random_bits(rng, (N, K))
    fill = NAN_BF16 if out_dtype == np.uint16 else np.nan
    c = cuda.to_device(np.full((M, N), fill, out_dtype))
    tc_gemm(cuda.to_device(a), cuda.to_device(b), c, **kw)
    got = c.copy_to_host()
    got = bf16_bits_to_f32(got) if out_dtype == np.uint16 else got
    A, B = bf16_bits_to_f32(a).astype(np.float64), bf16_bits_to_f32(b).astype(np.float64)
    want = A @ B.T
    bound = 2 * K * 2.0**-24 * (np.abs(A) @ np.abs(B).T)
    if out_dtype == np.uint16:  # and the output's rounding: half an ulp of bf16
        bound = bound + 2.0**-8 * np.abs(want)
    return float((np.abs(got - want) / bound).max())


@pytest.mark.skipif(not is_simulator(), reason="tiny shapes for the simulator")
def test_tc_gemm_in_the_simulator():
    rng = np.random.default_rng(11)
    # tails in M and N, three K tiles (both pipeline stages, twice)
    assert gemm_error_share(rng, 70, 40, 96, block_m=64, block_n=32) <= 1
    assert gemm_error_share(rng, 5, 32, 32, np.uint16, block_m=64, block_n=32) <= 1
    # the default block (8 warps, 128 x 128) and its two stages, as a GPU runs it
    assert gemm_error_share(rng, 130, 136, 64) <= 1


def test_tc_gemm_refuses_what_it_cannot_take():
    from tinyvllm_lib.kernels.tc_gemm import make_tc_gemm_kernel, tc_gemm

    with pytest.raises(ValueError, match="multiple of 64"):
        make_tc_gemm_kernel(48, 128)
    a = np.zeros((4, 40), np.uint16)
    with pytest.raises(ValueError, match="multiple of 32"):
        tc_gemm(a, np.zeros((8, 40), np.uint16), np.zeros((4, 8), np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("shape", [(2051, 3072, 2048), (1, 2048, 2048), (300, 8192, 2048), (2048, 2048, 8192)])
def test_tc_gemm_on_the_gpu(shape):
    rng = np.random.default_rng(shape[0])
    assert gemm_error_share(rng, *shape) <= 1
    assert gemm_error_share(rng, *shape, out_dtype=np.uint16) <= 1


def test_linked_gemm_ptx_keeps_fragments_in_registers():
    from tinyvllm_lib.kernels.tensor_core import linked_ptx_counts

    counts = linked_ptx_counts("tinyvllm_lib.kernels.tc_gemm", "tc_gemm_kernel")
    assert counts["mma.sync"] == 2 * 16 and counts["ldmatrix"] == 2 * (4 + 2)
    assert counts["cp.async"] == 4 and counts["local memory"] == 0 and counts["call"] == 0
    assert counts["shared align 16"] == 2
