"""Chapter 15's L2 prefetch before the wait (off in the engine, on through the bench's --prefetch-l2-mib): it compiles
for sm_90 to one bulk prefetch a range, issued before griddepcontrol.wait, and to nothing when off. PTX without a GPU,
as tests/test_ptx.py compiles it (the simulator runs no PTX)."""

import json
import os
import subprocess
import sys

SCRIPT = r'''
import json, types
import numba.cuda.dispatcher as dispatcher
from numba import cuda
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from tinyvllm_lib.kernels.gemv_8bit import gemv_8bit_kernel_for
from tinyvllm_lib.kernels.mma_8bit import mma_8bit_kernel_for
from tinyvllm_lib.kernels.prefetch import PREFETCH_L2_BYTES

def where(ptx):
    return ptx.count("cp.async.bulk.prefetch.L2.global"), ptx.find("cp.async.bulk.prefetch"), ptx.find("griddepcontrol.wait")

out = {"library": PREFETCH_L2_BYTES}
sig = "void(uint64[:, ::1], uint64[:, ::1], float32[::1], {}[:, ::1]{})"
for kind, dtype, extra in (("add", "float32", ""), ("rmsnorm_gated", "uint16", ", uint64[::1], float32")):
    for nbytes in (0, 24 << 20):
        k = gemv_8bit_kernel_for("int8", "block", 1, kind, prefetch_bytes=nbytes)
        out[f"gemv_{kind}_{nbytes}"] = where(cuda.compile_ptx(k.py_func, sig.format(dtype, extra), cc=(9, 0))[0])
for nbytes in (0, 24 << 20):
    k = mma_8bit_kernel_for("int8", 1, "gated", prefetch_bytes=nbytes)
    out[f"mma_gated_{nbytes}"] = where(cuda.compile_ptx(k.py_func, sig.format("uint16", ""), cc=(9, 0))[0])
print(json.dumps(out))
'''


def test_the_prefetch_compiles_before_the_wait_and_to_nothing_when_off():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got.pop("library") == 0  # the engine's kernels: none (slower on an H100, chapter 15)
    for name, (count, at, wait) in got.items():
        assert wait >= 0, name
        if name.endswith("_0"):
            assert count == 0, name
        else:  # one range a group (gated: two), all before the wait
            assert count >= 1 and at < wait, (name, count, at, wait)
