"""Helpers for the server's tests: a tiny random Llama that reads and writes text through SmolLM2's tokenizer and
chat template (the real text handling at a fraction of the cost), raw HTTP over a socket, the /metrics gauges."""

import json
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx

from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config
from tinyvllm_lib.models.smollm2 import resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tiny_chat_model(folder: Path, max_position_embeddings: int = 2048) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary (49,152), tokenizer and chat template (bench/ch12_lone_client.py
    serves it too)."""
    smol = resolve_model("smollm2")
    config = tiny_llama_config(vocab_size=49152, max_position_embeddings=max_position_embeddings, bos_token_id=1,
                               eos_token_id=2)
    make_random_llama(folder, config, seed=3)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy(smol / name, Path(folder) / name)
    return Path(folder)


def raw_http(url: str, head: bytes, parts=(), timeout: float = 30) -> tuple[int, dict, bytes]:
    """Send a request's head and the given body parts on a fresh socket, no more; read the answer (status, headers,
    body by its Content-Length) without ending the body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head)
        for part in parts:
            s.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_text, _, body = data.partition(b"\r\n\r\n")
        lines = head_text.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(body) < int(headers.get("content-length", 0)):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), headers, body


def metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name with labels, model_name dropped: value}."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("tinyvllm:"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "").replace("{,", "{")
            out[name] = float(value)
    return out


def wait_idle(url: str, seconds: float = 60) -> dict[str, float]:
    """The metrics once nothing runs, waits or holds a KV block (polled, bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(url)
        idle = m["tinyvllm:num_requests_running"] == m["tinyvllm:num_requests_waiting"] == 0
        if (idle and m["tinyvllm:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


class TokenizerCalls:
    """Records which thread calls the tokenizer's encode and apply_chat_template (wrapped on the instance)."""

    def __init__(self, tokenizer):
        self.calls: list[tuple[str, str]] = []
        for name in ("encode", "apply_chat_template"):
            setattr(tokenizer, name, self._logged(name, getattr(tokenizer, name)))

    def _logged(self, name, real):
        def logged(*args, **kwargs):
            self.calls.append((name, threading.current_thread().name))
            return real(*args, **kwargs)

        return logged


def error_of(response) -> dict:
    """The error object of an OpenAI error answer, checked for its four keys."""
    error = json.loads(response.content if hasattr(response, "content") else response)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error
