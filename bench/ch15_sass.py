"""Chapter 15: what the 8-bit GEMV's inner loop issues, per word of 8 codes, from the machine code (SASS) for sm_90.

    python bench/ch15_sass.py [--library ROOT] [--tools DIR]
        ROOT: a checkout whose tinyvllm_lib to count (an earlier version: `git worktree add /tmp/old <commit>`);
        DIR: a folder holding ptxas and nvdisasm (CUDA 13: pip's nvidia-cuda-nvcc and nvidia-cuda-nvdisasm hold them,
        under nvidia/cu13/bin), else they are looked up on PATH.

No GPU: numba compiles each kernel for sm_90 (NVVM, its C linked in by nvJitLink, as a launch does), ptxas assembles
it, nvdisasm prints it. The inner loop is the innermost loop (a backward branch) that holds the most FFMA; every instruction in
it is counted by opcode, divided by the words of codes it handles a pass (rows x unroll of the variant). For one format the
one-token kernels of a warp a row, plain and norm-fused, in book/data/ch15_sass.json (tagged with the library's
GEMV_8BIT_VERSION; a version's records replace its earlier ones).
"""

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = [f"gemv_{m}_warp_t1{kind}_kernel" for m in ("int8", "fp8") for kind in ("", "_rmsnorm")]
# how the chapter groups opcodes
CLASSES = {
    "multiply-add": {"FFMA", "FADD", "FMUL", "HADD2", "HFMA2"},
    "shift, logic, byte": {"LOP3", "SHF", "PRMT", "IADD3", "LEA", "SEL", "IMAD", "MOV", "ISETP", "PLOP3",
                           "FSEL", "CS2R", "FSETP", "VIADD", "IABS"},
    "conversion": {"F2FP", "I2F", "F2F", "F2I", "I2FP"},
    "load": {"LDG", "LDS", "LD", "LDC", "ULDC"},
}
CHILD = r"""
import importlib, json, sys, types
import numba.cuda.dispatcher as cuda_dispatcher
cuda_dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from numba.cuda.compiler import _compile_pyfunc_with_fixup
module = importlib.import_module("tinyvllm_lib.kernels.gemv_8bit")
warps_per_row, rows, unroll = module.GEMV_VARIANTS["warp"](1)
out = {"version": module.GEMV_8BIT_VERSION, "words": rows * unroll, "ptx": {}}
for name in json.loads(sys.argv[1]):
    library, _ = _compile_pyfunc_with_fixup(
        getattr(module, name).py_func, module.PTX_SIGNATURES[name][0], device=False, cc=(9, 0), lto=True,
        debug=False, lineinfo=False, fastmath=False, opt=True, abi="numba", abi_info=None, forceinline=False,
        launch_bounds=None)
    library._lto = True  # as a launch links it
    out["ptx"][name] = library.get_lto_ptx(cc=(9, 0)).rstrip("\x00")
print(json.dumps(out))
"""
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*?(?:`\((\.L_x_\d+)\))?\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):", re.M)


def tool(name: str, folder: Path | None) -> str:
    path = folder / name if folder else shutil.which(name)
    if not path or not Path(path).exists():
        sys.exit(f"{name} not found: pass --tools (pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm, CUDA 13)")
    return str(path)


def sass(ptx: str, tools: Path | None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        subprocess.run([tool("ptxas", tools), "-arch=sm_90", str(src), "-o", str(cubin)], check=True)
        return subprocess.run([tool("nvdisasm", tools), str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def inner_loop(text: str) -> collections.Counter:
    """Opcode counts of the innermost loop holding the most FFMA (the shortest of those)."""
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        label = LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
        found = LINE.search(line)
        if found:
            addr = int(found.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            code.append((addr, found.group(2), found.group(3)))
    ranges = [(labels[target], addr) for addr, op, target in code
              if op == "BRA" and target in labels and labels[target] <= addr]
    innermost = [(a, b) for a, b in ranges  # holding no other loop
                 if not any((a, b) != (c, d) and a <= c and d <= b for c, d in ranges)]
    bodies = [[o for addr, o, _ in code if a <= addr <= b] for a, b in innermost]
    if not bodies:
        raise RuntimeError("no loop found in the SASS")
    body = max(bodies, key=lambda ops: (ops.count("FFMA"), -len(ops)))
    return collections.Counter(body)


def count(root: Path | None, tools: Path | None) -> tuple[int, int, dict]:
    """The library's GEMV version, the words of codes a thread handles a pass of its inner loop (rows x unroll),
    and each kernel's SASS."""
    env = dict(os.environ, PYTHONPATH=str(root) if root else os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(KERNELS)], capture_output=True, text=True,
                         env=env, cwd=root or Path.cwd())
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    compiled = json.loads(res.stdout.strip().splitlines()[-1])
    listings = {name: sass(ptx, tools) for name, ptx in compiled["ptx"].items()}
    return compiled["version"], compiled["words"], listings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", type=Path, help="a checkout's root whose tinyvllm_lib to count")
    ap.add_argument("--tools", type=Path, help="a folder holding ptxas and nvdisasm")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tinyvllm_lib.measure import DATA_DIR, versions

    version, words, listings = count(args.library.resolve() if args.library else None, args.tools)
    ptxas = subprocess.run([tool("ptxas", args.tools), "--version"], capture_output=True, text=True).stdout
    device = {"name": "sm_90 machine code (ptxas, no GPU)", "ptxas": ptxas.strip().splitlines()[-1]}
    records = []
    for name, text in listings.items():
        ops = inner_loop(text)
        per_word = {op: n / words for op, n in sorted(ops.items())}
        by_class = {c: sum(v for op, v in per_word.items() if op in members) for c, members in CLASSES.items()}
        by_class["other"] = sum(per_word.values()) - sum(by_class.values())
        records.append({
            "chapter": "ch15_sass", "name": "inner_loop", "shape": [1, 8], "metric": "instructions/word",
            "value": sum(per_word.values()), "kernel": name, "method": "int8" if "_int8_" in name else "fp8",
            "rms_norm": "rmsnorm" in name, "gemv_8bit_version": version, "words_in_loop": words,
            "opcodes": per_word, "classes": by_class, "device": device, "date": datetime.date.today().isoformat(),
            "versions": versions(), "command": " ".join(["python"] + sys.argv)})
        print(f"v{version} {name}: {sum(per_word.values()):.1f} instructions a word of 8 codes ("
              + ", ".join(f"{c} {v:.1f}" for c, v in by_class.items()) + ")")
    path = Path(DATA_DIR) / "ch15_sass.json"
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if r.get("gemv_8bit_version") != version]
    path.write_text(json.dumps(kept + records, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
