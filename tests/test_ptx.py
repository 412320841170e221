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
    # the wait is compiled for the target's compute capability, whatever GPU is current
    for device_cc, target_cc, has_wait in results["wait_by_target"]:
        assert has_wait == (tuple(target_cc) >= (9, 0)), (device_cc, target_cc, has_wait)
    assert len(results["wait_by_target"]) == 4
