"""The GPU type check: every kernel compiles to PTX for sm_90 (the simulator checks no types), and\nwaits for the kernel before it (griddepcontrol.wait) before it touches global memory."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_every_kernel_compiles_to_ptx_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    script = Path(__file__).with_name("ptx_check.py")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads(res.stdout)
    print("\n".join(results["compiled"]))
    assert not results["missing_signature"], f"kernels with no PTX_SIGNATURES entry: {results['missing_signature']}"
    assert not results["failed"], "\n".join(results["failed"])
    assert results["compiled"], "no kernel was compiled"
    # CudaGraph lets a library kernel start early (chapter 1): each must wait before it
    # touches global memory
    assert not results["no_wait_first"], f"kernels that do not wait first: {results['no_wait_first']}"


PREFETCH_PTX = """
import types
import numba.cuda.dispatcher as dispatcher
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))  # no GPU: sm_90
from numba import cuda
from tinyvllm_lib.kernels.gemv_8bit_kernel import make_gemv_8bit_kernel
kernel = make_gemv_8bit_kernel("int8", 1, 8, 8, 2, accumulate=True, l2_prefetch=2)
ptx, _ = cuda.compile_ptx(kernel.py_func, "void(uint64[:, ::1], uint64[:, ::1], float32[::1], float32[:, ::1])",
                          cc=(9, 0))
print(ptx)
"""


def test_the_l2_prefetch_compiles_before_the_wait():
    """Chapter 15's l2_prefetch experiment: an 8-bit GEMV with l2_prefetch=2 compiles for sm_90 with its three
    cp.async.bulk.prefetch.L2 (two before griddepcontrol.wait, one in the loop over groups)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, "-c", PREFETCH_PTX], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ptx, wait = res.stdout, res.stdout.find("griddepcontrol.wait")
    prefetches = [i for i in range(len(ptx)) if ptx.startswith("cp.async.bulk.prefetch.L2.global", i)]
    assert len(prefetches) == 3 and wait > 0
    assert sum(i < wait for i in prefetches) == 2
