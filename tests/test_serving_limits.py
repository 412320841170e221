"""The server's limits, structurally (nothing here is timed): prompts are rendered and tokenized only on the
worker threads, never on the event loop or the engine's thread, and a prompt whose byte length proves it cannot fit
never reaches the tokenizer; a body over --max-body-bytes gets 413 before it is read, by its Content-Length or as a
chunked body passes the limit; past --max-waiting a request gets 503; past --request-timeout, 504 and an abort; what
the tokenizer or the chat template raises on a request's text is a 400. A tiny random Llama with SmolLM2's tokenizer
and chat template serves (real text handling, quick steps)."""

import json

import httpx
import jinja2
import pytest
from serving_tools import TokenizerCalls, error_of, raw_http, tiny_chat_model, wait_idle

from tinyvllm_lib import LLM
from tinyvllm_lib.entrypoints.launcher import ServerThread
from tinyvllm_lib.entrypoints.openai.api_server import build_app

MAX_BODY = 6_000_000  # bytes: a 5 MB prompt passes it, and is refused for its length
BIG_PROMPT = "hello world " * (5_000_000 // 12)
GOOD = {"prompt": "The capital of France is", "max_tokens": 2}
HEAD = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def served(folder):
    """The server (default limits but the body size) and a log of the threads that call the tokenizer."""
    engine = LLM(folder, device="cpu", max_model_len=256, max_num_seqs=4).llm_engine
    calls = TokenizerCalls(engine.get_tokenizer())
    with ServerThread(build_app(engine, "tiny", max_body_bytes=MAX_BODY)) as server:
        yield server, calls


@pytest.fixture
def llm(folder):
    """An engine that runs one request at a time, for a server of the test's own."""
    return LLM(folder, device="cpu", max_model_len=2048, max_num_seqs=1)


def assert_serves(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_prompts_are_tokenized_on_the_worker_threads_only(served):
    server, calls = served
    calls.calls.clear()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    assert_serves(server.url)
    assert {name for name, _ in calls.calls} == {"encode", "apply_chat_template"}
    threads = {thread for _, thread in calls.calls}
    assert all(t.startswith("tokenizer") for t in threads), threads  # not the loop's, not "engine"


def test_a_prompt_whose_bytes_prove_it_too_long_never_reaches_the_tokenizer(served):
    server, calls = served
    calls.calls.clear()
    r = httpx.post(f"{server.url}/v1/completions", json=GOOD | {"prompt": BIG_PROMPT}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt" and "at least" in error_of(r)["message"]
    assert calls.calls == []
    # a chat's text is the template's: rendered on a worker thread, then refused before encode
    chat = {"messages": [{"role": "user", "content": BIG_PROMPT}], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    assert [name for name, _ in calls.calls] == ["apply_chat_template"]
    assert calls.calls[0][1].startswith("tokenizer")
    assert_serves(server.url)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413_before_it_is_read(served, chunked):
    server, calls = served
    calls.calls.clear()
    if chunked:  # pieces past the limit, and never the closing piece: only a refusal can answer
        piece = b"x" * 2**20
        parts = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (MAX_BODY // len(piece) + 1)
        status, headers, body = raw_http(server.url, (HEAD + "Transfer-Encoding: chunked\r\n\r\n").encode(), parts)
    else:  # the head alone: not one byte of the body is sent
        status, headers, body = raw_http(server.url, (HEAD + f"Content-Length: {MAX_BODY + 1}\r\n\r\n").encode())
    assert status == 413 and headers["content-type"] == "application/json"
    assert str(MAX_BODY) in error_of(body)["message"] and calls.calls == []
    # a client that sends its whole body first (httpx does) reads the same answer
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (MAX_BODY + 1), timeout=60)
    assert r.status_code == 413 and error_of(r)["type"] == "invalid_request_error"
    assert_serves(server.url)


def test_what_the_tokenizer_or_the_template_raises_is_a_400(served, monkeypatch):
    server, _ = served
    tokenizer = server.server.config.app.state.engine.engine.get_tokenizer()
    encode, render = tokenizer.encode, tokenizer.apply_chat_template

    def refusing_encode(text, *args, **kwargs):
        if "REFUSE" in text:
            raise RuntimeError("the tokenizer cannot read this")
        return encode(text, *args, **kwargs)

    def refusing_template(messages, *args, **kwargs):
        if messages[0]["content"] == "REFUSE":
            raise jinja2.UndefinedError("'tools' is undefined")
        return render(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", refusing_encode)
    monkeypatch.setattr(tokenizer, "apply_chat_template", refusing_template)
    r = httpx.post(f"{server.url}/v1/completions", json=GOOD | {"prompt": "REFUSE"}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt" and "cannot read" in error_of(r)["message"]
    chat = {"messages": [{"role": "user", "content": "REFUSE"}], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "messages" and "undefined" in error_of(r)["message"]
    assert_serves(server.url)


LONG = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def test_past_max_waiting_a_request_gets_503(llm):
    # one request runs (max_num_seqs=1), one waits; the next is one too many
    with ServerThread(build_app(llm.llm_engine, "tiny", max_waiting=1)) as server, httpx.Client(timeout=60) as http:
        url = f"{server.url}/v1/completions"
        with http.stream("POST", url, json=LONG | {"stream": True}) as running:
            lines = running.iter_lines()  # kept: the connection closes with it
            next(line for line in lines if line.startswith("data: {"))  # it has a token: it runs
            with http.stream("POST", url, json=LONG | {"stream": True}) as waiting:
                assert waiting.status_code == 200  # accepted by the engine thread: it waits
                r = http.post(url, json=GOOD)
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert error_of(r)["type"] == "overloaded_error" and "waiting" in error_of(r)["message"]
        after = wait_idle(server.url)  # both streams closed: aborted
        assert after["tinyvllm:kv_cache_usage_perc"] == 0
        assert after['tinyvllm:request_success_total{finished_reason="abort"}'] == 2
        assert_serves(server.url)


def test_past_its_timeout_a_request_gets_504_and_is_aborted(llm):
    with ServerThread(build_app(llm.llm_engine, "tiny", request_timeout=0.5)) as server, httpx.Client(timeout=60) as http:
        url = f"{server.url}/v1/completions"
        r = http.post(url, json=LONG)
        assert r.status_code == 504 and error_of(r)["type"] == "timeout_error"
        with http.stream("POST", url, json=LONG | {"stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["type"] == "timeout_error"
        after = wait_idle(server.url)
        assert after['tinyvllm:request_success_total{finished_reason="abort"}'] == 2
        assert after["tinyvllm:kv_cache_usage_perc"] == 0
        assert_serves(server.url)
