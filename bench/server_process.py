"""`python -m tinyvllm_lib serve ...` in a process of its own on 127.0.0.1 and a free port, for chapter 12's CPU
scripts (ch12_stall_cpu.py, ch12_soak_cpu.py): started, waited for (/health), stopped (SIGINT, then kill); its
resident memory read from /proc."""

import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A context manager: the server of `serve_args` (after `serve`), listening at .url."""

    def __init__(self, *serve_args: str, startup_timeout: float = 900.0, quiet: bool = True, env=None, cwd=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "tinyvllm_lib", "serve", *serve_args, "--host", "127.0.0.1",
                        "--port", str(self.port), "--log-level", "warning"]
        # cwd: `python -m` imports tinyvllm_lib from there first (another copy of the engine, say)
        self.startup_timeout, self.quiet, self.env, self.cwd = startup_timeout, quiet, env, cwd
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        print("server:", " ".join(self.command[1:]), flush=True)
        out = subprocess.DEVNULL if self.quiet else None
        self.process = subprocess.Popen(self.command, stdout=out, env=self.env, cwd=self.cwd)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("the server did not start")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGINT (uvicorn's graceful stop), then kill after 60 s: the exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def rss_bytes(self) -> int:
        """The server's resident memory now (Linux: /proc/PID/status, VmRSS)."""
        with open(f"/proc/{self.process.pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
