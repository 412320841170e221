"""Chapter 12's server end to end on the CPU: uvicorn on 127.0.0.1 (a free port) in a background thread, around
the embedded SmolLM2, queried with the official `openai` client and with raw httpx. Greedy answers equal
LLM.generate's for the same prompts (token ids and log-probs, up to near ties), streamed or not; 32 concurrent
streaming clients all finish with offline generation's tokens; a client that disconnects mid-stream is aborted and
its blocks freed (the /metrics gauges go back to 0) while the others finish; every bad request gets its status and
OpenAI's error JSON, and the next good request is answered."""

import asyncio
import json
import math
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from compare import agrees
from serving_tools import metrics, wait_idle

from tinyvllm_lib import LLM, SamplingParams
from tinyvllm_lib.benchmark_serving import (
    RequestResult,
    benchmark_serving,
    poisson_arrival_times,
    random_prompts,
    summarize,
)
from tinyvllm_lib.engine.async_llm_engine import AsyncLLMEngine
from tinyvllm_lib.entrypoints.launcher import ServerThread, run_coroutine
from tinyvllm_lib.entrypoints.openai.api_server import build_app
from tinyvllm_lib.models.random_llama import make_random_llama, tiny_llama_config

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
TOPICS = ["the moon", "rain", "copper", "jazz", "bread", "volcanoes", "turtles", "bicycles"]
ASKS = ["Tell me about {}.", "What is {}?", "Write one sentence about {}.", "Why does {} matter?"]
LOAD_QUESTIONS = [a.format(t) for a in ASKS for t in TOPICS]  # 32 distinct chat requests
TIE = 0.05  # where the reference's two best tokens are closer than this, the runs may part (batch composition)
MAX_MODEL_LEN = 512


def greedy(max_tokens: int, logprobs: int | None = 2, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, **kw)


def token_ids(tokens) -> list[int]:
    """Ids from log-prob tokens written as "token_id:123" (vLLM's return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def assert_agrees(ref, ids, what):
    same, tie = agrees(ref.token_ids, ref.logprobs, ids, tie=TIE)
    assert same, f"{what}: server {ids} vs offline {ref.token_ids} (stopped at a near tie: {tie})"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=32)


@pytest.fixture(scope="module")
def offline(llm):
    """LLM.generate's greedy answers (with log-probs) for every prompt the tests send, made before the server
    starts: while it runs, only its engine thread may touch the engine."""
    conversations = [[{"role": "user", "content": q}] for q in LOAD_QUESTIONS]
    return {
        "question": llm.chat(QUESTION, greedy(16), use_tqdm=False)[0],
        "completions": llm.generate(COMPLETION_PROMPTS, greedy(12), use_tqdm=False),
        "load": llm.chat(conversations, greedy(16), use_tqdm=False),
    }


@pytest.fixture(scope="module")
def server(llm, offline):
    with ServerThread(build_app(llm.llm_engine, "smollm2")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)




# --- answers ---


def test_the_chat_answer_names_paris_and_is_offline_generation(client, offline):
    ref = offline["question"]
    assert "Paris" in ref.outputs[0].text  # the embedded model does know it, greedily
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
    assert reply.object == "chat.completion" and reply.model == "smollm2"
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.message.content == ref.outputs[0].text and choice.finish_reason == ref.outputs[0].finish_reason
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.outputs[0].token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_streamed_chat_answer_joins_to_the_same_text(client, offline):
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline["question"].outputs[0].text and "Paris" in text
    # the text streams as it is made, not all in the last chunk
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 3
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(offline["question"].outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_the_raw_stream_is_openai_server_sent_events(server):
    body = {"model": "smollm2", "prompt": COMPLETION_PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_equal_offline_generation_with_logprobs(client, offline):
    for prompt, ref in zip(COMPLETION_PROMPTS, offline["completions"]):
        reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
        choice = reply.choices[0]
        assert reply.object == "text_completion"
        ids = token_ids(choice.logprobs.tokens)
        assert_agrees(ref.outputs[0], ids, prompt)
        if ids == ref.outputs[0].token_ids:
            assert choice.text == ref.outputs[0].text
            # the same log-probs: the chosen tokens', and each step's top 2 with their values
            want = [step[i] for i, step in zip(ids, ref.outputs[0].logprobs)]
            np.testing.assert_allclose(choice.logprobs.token_logprobs, want, atol=2e-3)
            for top, step in zip(choice.logprobs.top_logprobs, ref.outputs[0].logprobs):
                assert set(token_ids(top)) == set(step)
        # streamed: the same text, piece by piece
        stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_chat_logprobs_are_openai_shaped(client, offline):
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    ref = offline["question"].outputs[0]
    assert len(content) == len(ref.token_ids)
    assert "".join(e.token for e in content).strip().startswith("The capital of France is")
    for entry, step, i in zip(content, ref.logprobs, ref.token_ids):
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode()) and abs(entry.logprob - step[i]) < 2e-3


def test_models_health_and_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"] and models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    before = wait_idle(server.url)
    reply = client.completions.create(model="smollm2", prompt=COMPLETION_PROMPTS[1], max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = wait_idle(server.url)
    assert after["tinyvllm:generation_tokens_total"] - before["tinyvllm:generation_tokens_total"] == 7
    assert after["tinyvllm:prompt_tokens_total"] - before["tinyvllm:prompt_tokens_total"] == reply.usage.prompt_tokens
    assert after['tinyvllm:request_success_total{finished_reason="length"}'] - before.get(
        'tinyvllm:request_success_total{finished_reason="length"}', 0) == 1
    for histogram, n in (("time_to_first_token", 1), ("inter_token_latency", 6), ("e2e_request_latency", 1)):
        name = f"tinyvllm:{histogram}_seconds_count"
        assert after[name] - before[name] == n, name
    assert after["tinyvllm:kv_cache_usage_perc"] == 0 and "tinyvllm:num_preemptions_total" in after
    assert after["tinyvllm:prefix_cache_hits_total"] <= after["tinyvllm:prefix_cache_queries_total"]


# --- load, disconnects ---


def test_32_concurrent_streaming_clients_get_offline_generations(server, offline):
    async def one(client, question):
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0,
            stream=True, logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        text, ids = "", []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                ids += token_ids(e.token for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []))
        return text, ids

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=240) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, q) for q in LOAD_QUESTIONS)), 300)

    t0 = time.perf_counter()
    results = asyncio.run(all_of_them())
    print(f"32 streams of 16 tokens in {time.perf_counter() - t0:.1f} s")
    exact = 0
    for question, (text, ids), ref in zip(LOAD_QUESTIONS, results, offline["load"]):
        assert_agrees(ref.outputs[0], ids, question)
        if ids == ref.outputs[0].token_ids:
            assert text == ref.outputs[0].text
            exact += 1
    print(f"{exact} of 32 identical to offline generation (the rest parted at a near tie)")
    assert exact >= 28
    assert wait_idle(server.url)["tinyvllm:kv_cache_usage_perc"] == 0


def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(server):
    before = wait_idle(server.url)
    long = {"model": "smollm2", "prompt": "Count to one thousand:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    short = long | {"max_tokens": 24}

    async def leaves(client):
        async with client.stream("POST", f"{server.url}/v1/completions", json=long) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
                if n == 3:
                    break  # closing the stream now closes the connection mid-answer
        return n

    async def stays(client):
        text = ""
        async with client.stream("POST", f"{server.url}/v1/completions", json=short) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(leaves(client), stays(client), stays(client), stays(client)), 300)

    left, *texts = asyncio.run(run())
    assert left == 3 and len(set(texts)) == 1 and texts[0]  # the same prompt: the same greedy text for all three
    after = wait_idle(server.url)
    assert after["tinyvllm:kv_cache_usage_perc"] == 0 and after["tinyvllm:num_requests_running"] == 0
    aborted = 'tinyvllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 1
    generated = after["tinyvllm:generation_tokens_total"] - before["tinyvllm:generation_tokens_total"]
    assert generated < 3 * 24 + 200, f"the request that left went on generating ({generated} tokens)"

    # a client that gives up on a whole (not streamed) answer is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=long | {"stream": False}, timeout=1.5)
    deadline = time.monotonic() + 60  # on a busy machine it may reach the engine only after the client left
    while metrics(server.url).get(aborted, 0) == after[aborted] and time.monotonic() < deadline:
        time.sleep(0.05)
    again = wait_idle(server.url)
    assert again[aborted] - after[aborted] == 1 and again["tinyvllm:kv_cache_usage_perc"] == 0
    generated = again["tinyvllm:generation_tokens_total"] - after["tinyvllm:generation_tokens_total"]
    assert generated < 200, f"the request that left went on generating ({generated} tokens)"


# --- bad requests ---

GOOD = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "smollm2", "messages": QUESTION, "max_tokens": 2}
BAD = {  # name: (path, body (bytes: sent as it is), status, param)
    "malformed JSON": ("/v1/completions", b'{"model": "smollm2", "prompt": ', 400, None),
    "not JSON at all": ("/v1/completions", b"prompt=Hello", 400, None),
    "a list body": ("/v1/chat/completions", b"[1, 2]", 400, None),
    "a string body": ("/v1/completions", b'"Hello"', 400, None),
    "no prompt": ("/v1/completions", {"model": "smollm2"}, 400, "prompt"),
    "no messages": ("/v1/chat/completions", {"model": "smollm2"}, 400, "messages"),
    "messages not a list": ("/v1/chat/completions", CHAT | {"messages": "hi"}, 400, "messages"),
    "a message without role": ("/v1/chat/completions", CHAT | {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    "no message at all": ("/v1/chat/completions", CHAT | {"messages": []}, 400, "messages"),
    "an image part": ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      400, "messages.0.content"),
    "max_tokens a string": ("/v1/completions", GOOD | {"max_tokens": "many"}, 400, "max_tokens"),
    "unknown model": ("/v1/completions", GOOD | {"model": "gpt-4o"}, 404, "model"),
    "unknown model (chat)": ("/v1/chat/completions", CHAT | {"model": "llama"}, 404, "model"),
    "n = 2": ("/v1/completions", GOOD | {"n": 2}, 400, "n"),
    "n = 2 (chat)": ("/v1/chat/completions", CHAT | {"n": 2}, 400, "n"),
    "max_tokens = 0": ("/v1/completions", GOOD | {"max_tokens": 0}, 400, "max_tokens"),
    "max_tokens = -3 (chat)": ("/v1/chat/completions", CHAT | {"max_tokens": -3}, 400, "max_tokens"),
    "temperature < 0": ("/v1/completions", GOOD | {"temperature": -0.1}, 400, "temperature"),
    "top_p = 0": ("/v1/completions", GOOD | {"top_p": 0}, 400, "top_p"),
    "top_p = 1.5": ("/v1/chat/completions", CHAT | {"top_p": 1.5}, 400, "top_p"),
    "top_k = -2": ("/v1/completions", GOOD | {"top_k": -2}, 400, "top_k"),
    "negative seed": ("/v1/completions", GOOD | {"seed": -1}, 400, "seed"),
    "an empty stop string": ("/v1/completions", GOOD | {"stop": [""]}, 400, "stop"),
    "logprobs = 21": ("/v1/completions", GOOD | {"logprobs": 21}, 400, "logprobs"),
    "top_logprobs = 30": ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    "prompt over max_model_len": ("/v1/completions", GOOD | {"prompt": [42] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    "prompt + max_tokens over it": ("/v1/completions", GOOD | {"prompt": [42] * 500, "max_tokens": 20}, 400, "max_tokens"),
    "chat over max_model_len": ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "hi " * 600}]},
                                400, "messages"),
    "an empty prompt": ("/v1/completions", GOOD | {"prompt": ""}, 400, "prompt"),
    "a token id outside the vocabulary": ("/v1/completions", GOOD | {"prompt": [10**6]}, 400, "prompt"),
    "two prompts": ("/v1/completions", GOOD | {"prompt": ["a", "b"]}, 400, "prompt"),
    "stream_options without stream": ("/v1/completions", GOOD | {"stream_options": {"include_usage": True}}, 400,
                                      "stream_options"),
    "presence_penalty over 2": ("/v1/completions", GOOD | {"presence_penalty": 2.5}, 400, "presence_penalty"),
    "frequency_penalty under -2": ("/v1/completions", GOOD | {"frequency_penalty": -3}, 400, "frequency_penalty"),
    "repetition_penalty 0": ("/v1/completions", GOOD | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    "echo": ("/v1/completions", GOOD | {"echo": True}, 400, "echo"),
    "tools": ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    "a bad stream request": ("/v1/completions", GOOD | {"stream": True, "top_p": 2}, 400, "top_p"),
    # valid JSON, not valid Unicode: a lone surrogate (the tokenizer's TypeError was a 500)
    "a surrogate in the prompt": ("/v1/completions", b'{"model": "smollm2", "prompt": "x \\ud800 y", "max_tokens": 4}',
                                  400, "prompt"),
    "a surrogate in a message": ("/v1/chat/completions", json.dumps(CHAT | {"messages": [
        {"role": "user", "content": "x \ud800 y"}]}).encode(), 400, "messages.0.content"),
    "a surrogate in a role": ("/v1/chat/completions", json.dumps(CHAT | {"messages": [
        {"role": "\udfff", "content": "hi"}]}).encode(), 400, "messages.0.role"),
    "a surrogate in a text part": ("/v1/chat/completions", json.dumps(CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}).encode(), 400, "messages.0.content.0.text"),
    "a surrogate in a stop string": ("/v1/completions", json.dumps(GOOD | {"stop": ["\ud800"]}).encode(), 400, "stop.0"),
    "a text part's text not a string": ("/v1/chat/completions", CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages.0.content.0.text"),
    "a text part without text": ("/v1/chat/completions", CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content"),
    "no such route": ("/v1/embeddings", GOOD, 404, None),
    "the wrong method": ("/v1/models", GOOD, 405, None),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_request_gets_its_status_and_error_json_and_the_next_is_served(server, name):
    path, body, status, param = BAD[name]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] == param, error
        assert error["type"] == ("not_found_error" if name == "no such route" else "invalid_request_error"), error
        good = http.post("/v1/completions", json=GOOD)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_a_missing_model_field_means_the_served_model(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smollm2"


# --- the engine loop on its own, failures, the command, the benchmark (a tiny random Llama: prompts are token ids) ---


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("serving"), tiny_llama_config(), seed=5)


def test_the_engine_loop_streams_merges_for_a_slow_reader_and_aborts_on_leaving(tiny_folder):
    llm = LLM(tiny_folder, device="cpu", max_model_len=128, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    want = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)

    class Blocks:
        held = []

        def record(self, stats, iteration):
            self.held.append(stats.kv_blocks_used)

    async def run(engine):
        async def slow():
            collector = await engine.add_request("slow", [1, 2, 3], params)
            ids, logprobs, deltas = [], [], 0
            while True:
                out = await collector.get()
                ids += out.outputs[0].token_ids
                logprobs += out.outputs[0].logprobs
                deltas += 1
                if out.finished:
                    return ids, logprobs, deltas, collector.num_merged
                await asyncio.sleep(0.05)

        async def leaves():
            n = 0
            async for out in engine.generate([4, 5], params, "leaves"):
                n += len(out.outputs[0].token_ids)
                if n >= 3:
                    break  # closing the iterator aborts the request
            return n

        return await asyncio.wait_for(asyncio.gather(slow(), leaves()), 120)

    before = llm.llm_engine.stats.num_generated_tokens
    engine = AsyncLLMEngine(llm.llm_engine, [Blocks()])
    (ids, logprobs, deltas, merged), left = run_coroutine(run(engine))
    engine.shutdown()
    assert not engine.is_running
    assert ids == want[0].outputs[0].token_ids  # a random model has no near ties here
    got_lp = [step[i] for i, step in zip(ids, logprobs)]
    np.testing.assert_allclose(got_lp, [step[i] for i, step in zip(ids, want[0].outputs[0].logprobs)], atol=1e-4)
    assert merged > 0 and deltas < len(ids)  # the slow reader got longer deltas, not more of them
    assert 3 <= left < 40 and Blocks.held[-1] == 0
    # the one that left was aborted before its 40 tokens were all made (how many it made past its third depends on
    # how busy the machine is: the engine's loop runs on while the reader's task waits for its turn)
    assert llm.llm_engine.stats.num_generated_tokens - before < 40 + 40 and not llm.llm_engine.requests


def test_a_refused_request_raises_value_error_and_a_stopped_loop_refuses(tiny_folder):
    llm = LLM(tiny_folder, device="cpu", max_model_len=64, max_num_seqs=2)
    engine = AsyncLLMEngine(llm.llm_engine)

    async def refused():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("big", list(range(100)), SamplingParams(max_tokens=1))
        collector = await engine.add_request("ok", [1, 2], SamplingParams(temperature=0, max_tokens=2))
        while not (await collector.get(timeout=30)).finished:
            pass

    run_coroutine(refused())
    engine.shutdown()
    with pytest.raises(RuntimeError, match="stopped"):
        run_coroutine(engine.add_request("late", [1], SamplingParams(max_tokens=1)))


def test_a_failing_step_fails_its_requests_with_500_and_the_server_goes_on(tiny_folder):
    llm = LLM(tiny_folder, device="cpu", max_model_len=64, max_num_seqs=4)
    engine, real_step, failures = llm.llm_engine, llm.llm_engine.step, []

    def step_that_fails_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("a planted bug")
        return real_step()

    llm.generate([[7, 8]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)  # before the server
    engine.step = step_that_fails_once
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    with ServerThread(build_app(engine, "tiny")) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 500 and "a planted bug" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "internal_server_error"
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the counters count what the server did, not what the engine did before it
        assert wait_idle(server.url, 30)["tinyvllm:generation_tokens_total"] == 4
        failures.clear()  # a streamed request gets the error as an event, then [DONE]
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
        assert "a planted bug" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
        # no tokenizer: no chat template, and prompts must be token ids
        r = http.post("/v1/chat/completions", json={"messages": QUESTION})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = http.post("/v1/completions", json={"prompt": "text"})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 200


def test_the_serve_command_serves_until_interrupted(tiny_folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tinyvllm_lib", "serve", str(tiny_folder), "--device", "cpu", "--port", str(port),
               "--max-model-len", "64", "--served-model-name", "tiny", "--log-level", "warning",
               "--max-body-bytes", "1000", "--max-waiting", "8", "--request-timeout", "60"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5] * 500}, timeout=60)
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]  # --max-body-bytes
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert f"serving tiny ({tiny_folder}) on cpu: http://127.0.0.1:{port}/v1" in output


def test_poisson_arrivals_have_the_rate_asked():
    times = poisson_arrival_times(20_000, 4.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.25) < 0.01 and abs(np.median(gaps) - 0.25 * np.log(2)) < 0.01  # exponential, mean 1/rate
    assert not poisson_arrival_times(5, math.inf).any()


def test_the_benchmark_measures_every_request(server, llm):
    prompts = random_prompts(6, 8, llm.config.vocab_size, seed=2)
    summaries = benchmark_serving(server.url, "smollm2", prompts, 5, rates=[20.0, math.inf])
    for s in summaries:
        assert s["completed"] == 6 and s["failed"] == 0 and s["total_output_tokens"] == 30
        assert s["total_input_tokens"] == 48
        assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] <= s["p99_e2el_ms"]
        assert s["median_itl_ms"] > 0 and s["output_throughput"] > 0
    summary = summarize([RequestResult(ok=False, error="boom")], 1.0)
    assert summary["failed"] == 1 and summary["errors"] == ["boom"]
