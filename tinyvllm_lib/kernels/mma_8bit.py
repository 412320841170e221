import math

import numpy as np
from numba import config, cuda, float32, types, uint64

from tinyvllm_lib.kernels.activation_store import store_activation
from tinyvllm_lib.kernels.bf16 import f32_to_bf16_bits
from tinyvllm_lib.kernels.checks import cdiv, device_pointer, is_c_contiguous
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.gemv import INLINE
from tinyvllm_lib.kernels.gemv_8bit import check_8bit_operands, check_8bit_out
from tinyvllm_lib.kernels.tensor_core import ffi, require_lto, twin_launch

MMA_K = 64  # k a chunk: 16 codes (two words) a lane, 4 lanes a row
MMA_8BIT_MAX_TOKENS = 16  # two n-tiles of 8 token vectors
MMA_8BIT_VERSION = 1  # the bench's records say which kernel they timed


def mma_8bit_source(method: str, m_tiles: int, n_tiles: int) -> str:
    """CUDA C for one warp's chunk of 64 k: m_tiles tiles of 16 weight rows times
    n_tiles tiles of 8 token vectors, the codes widened to bf16 in registers.

    A lane (group g = lane / 4, thread t = lane % 4) holds codes 16t .. 16t + 15 of the
    chunk of rows g and g + 8 of each m-tile (w: 4 words an m-tile) and the bf16 inputs
    16t .. 16t + 15 of token g of each n-tile (x: 4 words an n-tile). A dot product
    may add its terms in any order, so the chunk's k are dealt to the mma's k-steps in
    the order that lets each lane take its fragments from what it loaded: k-step s
    reads codes and inputs 4s .. 4s + 3 of each lane's sixteen."""
    if method == "int8":  # 2^23 + (q + 128) as a float, less 2^23 + 128: q, exactly
        widen = r"""
  unsigned b = codes ^ 0x80808080u;
  float f0 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7650)) - 8388736.0f;
  float f1 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7651)) - 8388736.0f;
  float f2 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7652)) - 8388736.0f;
  float f3 = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7653)) - 8388736.0f;
  // integers from -128 to 127 are bf16 values: their floats' high halves, paired
  *p01 = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
  *p23 = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);"""
    elif method == "fp8":  # the hardware's e4m3 -> float16, then float16 -> bf16
        widen = r"""
  unsigned h[2];
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[0]) : "h"((unsigned short)codes));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[1]) : "h"((unsigned short)(codes >> 16)));
  unsigned pair[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // every e4m3 value is a bf16 value: exact
    float lo, hi;
    asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n"
        " cvt.f32.f16 %1, u;}" : "=f"(lo), "=f"(hi) : "r"(h[i]));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair[i]) : "f"(hi), "f"(lo));
  }
  *p01 = pair[0];
  *p23 = pair[1];"""
    else:
        raise ValueError(f"method must be 'int8' or 'fp8', got {method!r}")
    MT, NT = m_tiles, n_tiles
    return rf"""
// four codes -> two bf16 pairs (codes 0, 1 and 2, 3; the first of each in the low half)
static __device__ __forceinline__ void widen4_{method}(unsigned codes, unsigned* p01,
                                                      unsigned* p23) {{{widen}
}}

extern "C" __device__ void mma_{method}_m{MT}n{NT}(
    float* acc, const unsigned long long* w, const unsigned long long* x) {{
#pragma unroll
  for (int s = 0; s < 4; ++s) {{  // k-step s: codes and inputs 4s .. 4s + 3 a lane
    unsigned a[{MT}][4];
#pragma unroll
    for (int i = 0; i < {MT}; ++i) {{
      unsigned g0 = (unsigned)(w[4 * i + s / 2] >> (32 * (s % 2)));      // row g
      unsigned g8 = (unsigned)(w[4 * i + 2 + s / 2] >> (32 * (s % 2)));  // row g + 8
      widen4_{method}(g0, &a[i][0], &a[i][2]);
      widen4_{method}(g8, &a[i][1], &a[i][3]);
    }}
#pragma unroll
    for (int j = 0; j < {NT}; ++j) {{
      unsigned long long word = x[4 * j + s];
      unsigned b0 = (unsigned)word, b1 = (unsigned)(word >> 32);
#pragma unroll
      for (int i = 0; i < {MT}; ++i) {{
        float* c = acc + 4 * ({NT} * i + j);
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b0),
              "r"(b1));
      }}
    }}
  }}
}}
"""


_P = types.CPointer

if config.ENABLE_CUDASIM:
    from tinyvllm_lib.kernels.tensor_core import mma_bf16_m16n8k16, pack_pairs
    from tinyvllm_lib.kernels.widen_8bit import _E4M3_TO_F16

    def _code_bits(method: str, codes32: int) -> np.ndarray:
        """The four codes of a word (lowest byte first) as bf16 bits."""
        b = np.array([codes32], np.uint32).view(np.uint8)
        if method == "int8":
            values = b.view(np.int8).astype(np.float32)
        else:
            values = _E4M3_TO_F16[b].view(np.float16).astype(np.float32)
        return f32_to_bf16_bits(values)

    def mma_8bit_function(method: str, m_tiles: int, n_tiles: int):
        """Twin of the C function: the same fragments, the mma's twin."""

        def chunk(acc, w, x):
            for s in range(4):
                a = np.zeros((m_tiles, 4), np.uint32)
                for i in range(m_tiles):
                    for h in range(2):  # row g, row g + 8
                        word = int(w[4 * i + 2 * h + s // 2]) >> (32 * (s % 2))
                        bits = _code_bits(method, word & 0xFFFFFFFF)
                        a[i, h] = pack_pairs(bits[0], bits[1])
                        a[i, h + 2] = pack_pairs(bits[2], bits[3])
                for j in range(n_tiles):
                    word = int(x[4 * j + s])
                    b = np.array([word & 0xFFFFFFFF, word >> 32], np.uint32)
                    for i in range(m_tiles):
                        at = 4 * (n_tiles * i + j)
                        mma_bf16_m16n8k16(acc[at : at + 4], a[i], b)

        return chunk

else:
    from numba.cuda import CUSource

    def mma_8bit_function(method: str, m_tiles: int, n_tiles: int):
        """The C function of mma_8bit_source, declared for numba kernels."""
        return cuda.declare_device(
            f"mma_{method}_m{m_tiles}n{n_tiles}",
            types.void(_P(types.float32), _P(types.uint64), _P(types.uint64)),
            link=CUSource(mma_8bit_source(method, m_tiles, n_tiles)),
            abi="c",
        )


def make_mma_8bit_kernel(method: str, n_tiles: int, m_tiles: int = 1, warps: int = 8,
                         ahead: int = 2, accumulate: bool = False,
                         gated: bool = False):
    """out (M, N) = x (M, K) · (s ⊙ codes)ᵀ for up to 8 n_tiles token vectors on
    the tensor cores: a block per 16 m_tiles rows, its `warps` warps splitting K in
    chunks of 64 (`ahead` chunks' loads issued before any is multiplied), their sums
    met in shared memory. x bf16 viewed as uint64 (M, K / 4); codes as uint64
    (N, K / 8). accumulate: out += (float32 out). gated: codes stack [gate | up]
    (N = 2 I), the block's two m-tiles a gate tile and its up tile, out (M, I) bf16
    bits = SiLU(gate) · up."""
    assert not (gated and (accumulate or m_tiles != 2)), "gated: 2 m-tiles, no add"
    chunk_mma = mma_8bit_function(method, m_tiles, n_tiles)
    ACC, WW, XW = 4 * m_tiles * n_tiles, 4 * m_tiles, 4 * n_tiles
    units = 16 if gated else 16 * m_tiles  # columns of out a block writes
    tokens = 8 * n_tiles
    threads = 32 * warps
    outputs = units * tokens
    WBUF, XBUF = ahead * WW, ahead * XW  # local arrays' sizes: constants

    @cuda.jit(device=True, **INLINE)
    def load_weights(w64, wbuf, c0, chunks, n0, half, g, t):
        for u in range(ahead):
            c = c0 + u
            for i in range(m_tiles):
                for h in range(2):  # row g, row g + 8 of m-tile i
                    r = n0 + g + 8 * h
                    row = r + i * half if gated else r + 16 * i
                    ok = c < chunks and (r < half if gated else row < w64.shape[0])
                    for q in range(2):
                        wbuf[u * WW + 4 * i + 2 * h + q] = (
                            w64[row, 8 * c + 2 * t + q] if ok else uint64(0))

    @cuda.jit
    def kernel(x64, w64, scales, out):
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        M, chunks = x64.shape[0], w64.shape[1] // 8
        half = w64.shape[0] // 2  # gated: where the up rows begin
        n0 = cuda.blockIdx.x * units
        wbuf = cuda.local.array(WBUF, uint64)
        xbuf = cuda.local.array(XBUF, uint64)
        acc = cuda.local.array(ACC, float32)
        for e in range(ACC):
            acc[e] = float32(0)
        partial = cuda.shared.array((warps, ACC, 32), float32)
        c0 = warp * ahead
        # no kernel writes the weights: the first are loaded before the wait
        load_weights(w64, wbuf, c0, chunks, n0, half, g, t)
        wait_for_previous_kernel()
        while c0 < chunks:
            for u in range(ahead):
                for j in range(n_tiles):
                    m = g + 8 * j
                    ok = c0 + u < chunks and m < M
                    for q in range(4):
                        xbuf[u * XW + 4 * j + q] = (
                            x64[m, 16 * (c0 + u) + 4 * t + q] if ok else uint64(0))
            for u in range(ahead):
                if c0 + u < chunks:
                    chunk_mma(ffi.from_buffer(acc), ffi.from_buffer(wbuf[u * WW:]),
                              ffi.from_buffer(xbuf[u * XW:]))
            c0 += warps * ahead
            if c0 < chunks:
                load_weights(w64, wbuf, c0, chunks, n0, half, g, t)
        for e in range(ACC):
            partial[warp, e, lane] = acc[e]
        cuda.syncthreads()
        o = tid
        while o < outputs:  # an output a thread: the warps' sums meet
            col, r = o // units, o % units  # token col; row r of the block's
            i, rr = r // 16, r % 16  # (gated: the gate tile's; the up tile is 1)
            j, cc = col // 8, col % 8
            at_lane = 4 * (rr % 8) + cc // 2
            e = 4 * (n_tiles * i + j) + 2 * (rr // 8) + cc % 2
            total, up = float32(0), float32(0)
            for v in range(warps):
                total += partial[v, e, at_lane]
                if gated:
                    up += partial[v, e + 4 * n_tiles, at_lane]
            n = n0 + r
            if col < M and n < (half if gated else w64.shape[0]):
                if gated:
                    gate = total * scales[n]
                    up = up * scales[n + half]
                    store_activation(out, col, n,
                                     gate / (float32(1.0) + math.exp(-gate)) * up)
                elif accumulate:
                    out[col, n] += total * scales[n]
                else:
                    store_activation(out, col, n, total * scales[n])
            o += threads

    kernel.units, kernel.threads, kernel.tokens = units, threads, tokens
    kernel.reads_before_wait = True  # the first weights (tests/test_ptx.py)
    return require_lto(kernel)


# the launcher's kernels: (format, n-tiles, epilogue) -> kernel, each a module-level
# name so that tests/test_ptx.py compiles it
MMA_8BIT_KERNELS, PTX_SIGNATURES = {}, {}
_KINDS = {"": {}, "add": {"accumulate": True}, "gated": {"gated": True, "m_tiles": 2}}
for _method in ("int8", "fp8"):
    for _n_tiles in (1, 2):
        for _kind, _flags in _KINDS.items():
            _name = f"mma_{_method}_n{_n_tiles}{'_' * bool(_kind)}{_kind}_kernel"
            MMA_8BIT_KERNELS[_method, _n_tiles, _kind] = globals()[_name] = \
                make_mma_8bit_kernel(_method, _n_tiles, **_flags)
            _out = "uint16" if _kind == "gated" else "float32"
            PTX_SIGNATURES[_name] = [
                f"void(uint64[:, ::1], uint64[:, ::1], float32[::1], {_out}[:, ::1])"]


def mma_8bit(x, codes, scales, out, method: str, stream=0, accumulate=False,
             gated: bool = False):
    """Launch: out (M, N) = x (M, K) · (scales ⊙ codes)ᵀ for M <= 16 bf16 token
    vectors on the tensor cores, K a multiple of 64; accumulate: out += instead;
    gated: codes stack [gate | up] and out (M, N / 2) bf16 bits = SiLU(gate) · up."""
    M, K = x.shape if x.ndim == 2 else (0, 0)
    check_8bit_operands("mma_8bit", method, codes, scales, K)
    N = codes.shape[0]
    if not 0 < M <= MMA_8BIT_MAX_TOKENS or K % MMA_K:
        raise ValueError(f"mma_8bit: 1 to {MMA_8BIT_MAX_TOKENS} token vectors and K a "
                         f"multiple of {MMA_K}, got M={M}, K={K}")
    if x.dtype != np.uint16 or not is_c_contiguous(x) or device_pointer(x) % 8:
        raise ValueError(f"mma_8bit: need x (M, {K}) bf16 bits, 8-byte aligned, "
                         f"C-contiguous; got {x.dtype} {tuple(x.shape)}")
    check_8bit_out("mma_8bit", out, M, N, gated)
    if accumulate and (gated or out.dtype != np.float32):
        raise ValueError("mma_8bit: accumulate adds into float32 out, not gated")
    kernel = MMA_8BIT_KERNELS[method, 1 if M <= 8 else 2,
                              "gated" if gated else "add" * accumulate]
    blocks = cdiv(N // 2 if gated else N, kernel.units)
    with twin_launch():
        kernel[blocks, kernel.threads, stream](x.view(np.uint64), codes.view(np.uint64),
                                               scales, out)
    return out
