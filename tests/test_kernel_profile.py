"""bench/kernel_profile.py's bookkeeping, on made-up kernel names and spans (no GPU, no profiler)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
from kernel_profile import exclusive_times, is_numba_kernel, kernel_group, positions  # noqa: E402


@pytest.mark.parametrize("name, group, numba", [
    ("tinyvllm_lib::kernels::kv_cache_write::rope_write_kv_kernel[abi:v1]", "kernels.kv_cache_write", True),
    ("_ZN6cudapy12tinyvllm_lib6engine12sampler_cuda8k_kernelB2v1", "engine.sampler_cuda", True),
    ("nvjet_sm90_tss_256x128_64x4_1x2_h_badd_coopA_TNT", "cublas", False),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "cublas", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)",
     "at::native::vectorized_elementwise_kerne", False),
    ("Memcpy DtoH (Device -> Pinned)", "Memcpy", False),
])
def test_kernel_group(name, group, numba):
    assert kernel_group(name) == group
    assert is_numba_kernel(name) == numba


def test_exclusive_times_count_an_overlap_once():
    # b starts before a ends (a programmatic dependent launch waiting for a); d runs inside c
    spans = [(0.0, 10.0, "a"), (5.0, 20.0, "b"), (25.0, 30.0, "c"), (26.0, 28.0, "d"), (29.0, 40.0, "d")]
    groups, summed = exclusive_times(spans)
    assert groups == pytest.approx({"a": 0.010, "b": 0.010, "c": 0.005, "d": 0.010})
    assert summed == pytest.approx(0.043)
    busy = 0.020 + 0.015  # [0, 20] and [25, 40]
    assert sum(groups.values()) == pytest.approx(busy)


def test_positions_fold_a_repeated_sequence():
    # two repeats of (a, b): b starts 1 us before a ends the first time, 1 us after the second
    spans = [(0.0, 4.0, "a"), (3.0, 5.0, "b"), (10.0, 12.0, "a"), (13.0, 16.0, "b"), (20.0, 21.0, "a")]
    a, b = positions(spans, 2)
    assert a["own_us"] == pytest.approx((4 + 2) / 2) and b["own_us"] == pytest.approx((1 + 3) / 2)
    assert b["span_us"] == pytest.approx((2 + 3) / 2) and b["gap_us"] == pytest.approx((-1 + 1) / 2)
    assert a["gap_us"] == pytest.approx(5.0)  # the first launch has no launch before it: one gap
