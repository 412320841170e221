"""Chapter 1's programmatic graph edges: a library kernel may start before the kernel it depends on has
finished, and must then wait (wait_for_previous_kernel) before it reads that kernel's output. On a GPU
before Hopper, or in the simulator, CudaGraph changes no edge and these check plain replays."""

import numpy as np
import pytest
from numba import cuda

from tinyvllm_lib.cuda_graph import CudaGraph
from tinyvllm_lib.kernels.bf16 import copy_u64_kernel
from tinyvllm_lib.runtime import can_launch


def _hopper() -> bool:
    return cuda.get_current_device().compute_capability >= (9, 0)


@pytest.mark.gpu
def test_gpu_a_chain_of_copies_reads_each_copy_finished(rng):
    """Eight copies, each reading what the one before wrote, over 64 MB buffers: one wave of blocks each, so
    every copy is launched while the one before it still runs. (Each reads in the order its predecessor
    writes, a little behind it, so a missing wait might go unseen here: the next test makes the writer slow.)"""
    words, links = 8 * 2**20, 8
    bufs = [cuda.device_array(words, np.uint64) for _ in range(links + 1)]
    stream = cuda.stream()
    blocks = cuda.get_current_device().MULTIPROCESSOR_COUNT * 4

    def launch(s):
        for a, b in zip(bufs[:-1], bufs[1:]):
            copy_u64_kernel[blocks, 256, s](a, b)

    graph = CudaGraph(launch, stream)
    assert graph.programmatic_edges == (links - 1 if _hopper() else 0)
    for _ in range(3):  # fresh words each replay; the last buffer poisoned first
        src = rng.integers(0, 2**63, words, dtype=np.uint64)
        bufs[0].copy_to_device(src, stream=stream)
        bufs[-1].copy_to_device(np.full(words, 0xDEAD, np.uint64), stream=stream)
        graph.replay()
        stream.synchronize()
        np.testing.assert_array_equal(bufs[-1].copy_to_host(), src)


@pytest.mark.gpu
def test_gpu_a_fast_copy_waits_for_a_slow_one(rng):
    """One block copies 32 MB (milliseconds), then a full grid copies its output on: the second copy is
    launched while the first has hardly begun, and would finish long before it if it did not wait. Both
    buffers are poisoned before each replay, so words read too early cannot match."""
    words = 4 * 2**20
    a, b, c = (cuda.device_array(words, np.uint64) for _ in range(3))
    stream = cuda.stream()
    blocks = cuda.get_current_device().MULTIPROCESSOR_COUNT * 4

    def launch(s):
        copy_u64_kernel[1, 256, s](a, b)  # slow: one block
        copy_u64_kernel[blocks, 256, s](b, c)  # fast

    graph = CudaGraph(launch, stream)
    assert graph.programmatic_edges == (1 if _hopper() else 0)
    poison = np.full(words, 0xDEAD, np.uint64)
    for _ in range(2):
        src = rng.integers(0, 2**63, words, dtype=np.uint64)
        a.copy_to_device(src, stream=stream)
        b.copy_to_device(poison, stream=stream)
        c.copy_to_device(poison, stream=stream)
        graph.replay()
        stream.synchronize()
        np.testing.assert_array_equal(c.copy_to_host(), src)


@cuda.jit
def add_one_kernel(src, dst):  # not the library's: it does not wait first
    i = cuda.grid(1)
    if i < src.shape[0]:
        dst[i] = src[i] + 1


@pytest.mark.gpu
def test_gpu_only_edges_between_library_kernels_become_programmatic(rng):
    """copy -> copy -> add_one -> copy: only the first edge joins two kernels that wait first."""
    n = 4096
    a, b, c, d, e = (cuda.device_array(n, np.uint64) for _ in range(5))

    def launch(s):
        copy_u64_kernel[16, 256, s](a, b)
        copy_u64_kernel[16, 256, s](b, c)
        add_one_kernel[16, 256, s](c, d)
        copy_u64_kernel[16, 256, s](d, e)

    graph = CudaGraph(launch)
    assert graph.programmatic_edges == (1 if _hopper() else 0)
    assert CudaGraph(launch, programmatic=False).programmatic_edges == 0
    src = rng.integers(0, 2**62, n, dtype=np.uint64)
    a.copy_to_device(src)
    graph.replay()
    graph.stream.synchronize()
    np.testing.assert_array_equal(e.copy_to_host(), src + 1)


@pytest.mark.skipif(not can_launch(), reason="needs a GPU or the simulator")
def test_kernels_that_wait_first_still_compute_in_the_simulator_or_eagerly(rng):
    """Launched the usual way (no graph), the wait returns at once."""
    src = rng.integers(0, 2**62, 1000, dtype=np.uint64)
    out = cuda.device_array(1000, np.uint64)
    copy_u64_kernel[4, 64](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src)
