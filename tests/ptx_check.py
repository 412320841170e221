"""Compile every kernel of tinyvllm_lib to PTX for sm_90, with no GPU and no simulator.

Run by tests/test_ptx.py in a fresh interpreter (NUMBA_ENABLE_CUDASIM must be unset, since the
simulator checks no types). Each kernel module lists its kernels' signatures in PTX_SIGNATURES.
"""

import importlib
import json
import os
import pkgutil
import re
import sys
import types

assert not os.environ.get("NUMBA_ENABLE_CUDASIM"), "run without the simulator"

import numba.cuda.dispatcher as cuda_dispatcher
from numba import cuda
from numba.cuda.dispatcher import CUDADispatcher

# Device functions called from a kernel are compiled for "the current device"; with no GPU
# there is none, so pretend one of compute capability 9.0 (H100/H200) is current.
cuda_dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))

import tinyvllm_lib

results = {"compiled": [], "missing_signature": [], "failed": [], "no_wait_first": []}
GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red)\.global", re.M)
GLOBAL_WRITE = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:st|atom|red)\.global", re.M)


def waits_first(ptx: str, reads_before_wait: bool) -> bool:
    """griddepcontrol.wait comes before the first load, store or atomic on global memory
    (CudaGraph lets a library kernel start before the one before it has finished); a kernel
    marked reads_before_wait (the GEMV's first weights, which no kernel writes) may load first,
    but not write."""
    wait = ptx.find("griddepcontrol.wait")
    first = (GLOBAL_WRITE if reads_before_wait else GLOBAL_ACCESS).search(ptx)
    return wait >= 0 and (first is None or wait < first.start())

for info in pkgutil.walk_packages(tinyvllm_lib.__path__, "tinyvllm_lib."):
    if info.name.endswith("__main__"):
        continue
    module = importlib.import_module(info.name)
    signatures = getattr(module, "PTX_SIGNATURES", {})
    for name, obj in vars(module).items():
        if not isinstance(obj, CUDADispatcher) or obj.targetoptions.get("device"):
            continue
        home = sys.modules.get(getattr(obj.py_func, "__module__", None))
        if home is not module and getattr(home, name, None) is obj:
            continue  # imported from another module: checked there (a factory's kernels are checked where listed)
        if name not in signatures:
            results["missing_signature"].append(f"{info.name}.{name}")
            continue
        for sig in signatures[name]:
            try:
                ptx, _ = cuda.compile_ptx(obj.py_func, sig, cc=(9, 0))
                results["compiled"].append(f"{info.name}.{name}{sig[4:]}")
                if not waits_first(ptx, getattr(obj, "reads_before_wait", False)):
                    results["no_wait_first"].append(f"{info.name}.{name}")
            except Exception as err:  # report every failure, not just the first
                results["failed"].append(f"{info.name}.{name} {sig}: {type(err).__name__}: {err}")

# griddepcontrol.wait goes into the PTX of the target compiled for, not of the GPU that happens
# to be current: each pretend device against each target
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel  # noqa: E402


def waits_then_stores(x):
    wait_for_previous_kernel()
    x[0] = 1.0


results["wait_by_target"] = []
for device_cc in ((8, 0), (9, 0)):
    cuda_dispatcher.get_current_device = lambda cc=device_cc: types.SimpleNamespace(compute_capability=cc)
    for target_cc in ((8, 0), (9, 0)):
        ptx, _ = cuda.compile_ptx(waits_then_stores, "void(float32[::1])", cc=target_cc)
        results["wait_by_target"].append([list(device_cc), list(target_cc), "griddepcontrol.wait" in ptx])
json.dump(results, sys.stdout)
