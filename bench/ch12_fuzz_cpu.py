"""Chapter 12's fuzzer, long: tests/test_serving_fuzz.py with many examples (CI runs 100). Every example is a random
OpenAI request body against the server (loopback only, a tiny random Llama with SmolLM2's tokenizer); none may get a
5xx or hang, and a good request is answered after each. Bounded: --examples, and --max-seconds for the whole run.

    python bench/ch12_fuzz_cpu.py [--examples 5000] [--max-seconds 7200]
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--max-seconds", type=float, default=7200)
    args = ap.parse_args()
    env = os.environ | {"TINYVLLM_FUZZ_EXAMPLES": str(args.examples), "NUMBA_ENABLE_CUDASIM": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_serving_fuzz.py"]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.max_seconds)
    except subprocess.TimeoutExpired:
        print(f"stopped after {args.max_seconds:.0f} s")
        return 1
    lines = done.stdout.splitlines()
    print("\n".join(line for line in lines if "fuzzer:" in line) or done.stdout[-3000:])
    print(f"{lines[-1] if lines else ''} ({time.perf_counter() - t0:.0f} s)")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
