"""Local-memory accesses in a kernel module's PTX for sm_90, compiled in a fresh interpreter with no GPU and no
simulator: a local array indexed at run time (a loop the compiler did not unroll, or a device function not inlined)
lands in local memory, and the kernel still gives right answers, many times more slowly."""

import json
import os
import subprocess
import sys

_SCRIPT = """
import importlib, json, re, sys, types
import numba.cuda.dispatcher as cuda_dispatcher
from numba import cuda
cuda_dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
module = importlib.import_module(sys.argv[1])
found = {}
for name, sigs in module.PTX_SIGNATURES.items():
    ptx, _ = cuda.compile_ptx(getattr(module, name).py_func, sigs[0], cc=(9, 0))
    found[name] = len(re.findall(r"\\b(?:ld|st)\\.local\\b", ptx))
print(json.dumps(found))
"""


def local_memory_accesses(module: str) -> dict[str, int]:
    """{kernel name: ld.local and st.local instructions} for every kernel in `module`'s PTX_SIGNATURES (its first
    signature)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT, module], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
