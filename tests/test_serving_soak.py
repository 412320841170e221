"""CI's soak: bench/ch12_soak_cpu.py for one minute (the script runs ten by default). `serve smollm2 --device cpu`
in a process of its own, its KV pool (128 blocks) written once first, then a mixed load from four clients (good
requests streamed and not, streams left mid-way, answers given up on, bad requests, a 5 MB prompt and a 9 MB body);
then every good answer equalled the same request alone, no request got a 5xx or hung, the /metrics gauges are at
zero (no KV block held), and the server's resident memory grew by at most 50 MB after the load's first 20 s."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_minute_of_mixed_load_leaves_nothing_behind(tmp_path):
    summary_file = tmp_path / "soak.json"
    command = [sys.executable, "bench/ch12_soak_cpu.py", "--seconds", "60", "--clients", "4",
               "--num-kv-blocks", "128", "--no-save", "--json", str(summary_file)]
    env = os.environ | {"PYTHONPATH": str(ROOT)}  # this checkout's library, in the script and in its server
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(summary_file.read_text())
    assert summary["failures"] == 0 and summary["problems"] == []
    assert all(summary["by_kind"].get(kind, 0) > 0 for kind in ("good", "good_stream", "leaves", "bad", "large"))
    assert not any(summary["gauges_after"].values()) and summary["kv_blocks_held_after"] == 0
    assert summary["rss_growth_mb"] <= 50
