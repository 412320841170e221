"""A hypothesis fuzzer over OpenAI request bodies, against both endpoints of the server: random JSON shapes and types
in every field, any Unicode (lone surrogates too, sent as JSON escapes), NaN and infinities, huge integers, bodies that
are not objects or not JSON at all, and sizes from empty to megabytes. Every answer must be a 200 (a whole answer, or a
stream that ends with [DONE] and no error event) or a 4xx with OpenAI's error JSON; never a 5xx, never a hang (a client
timeout fails); and after each example a good request is answered. A tiny random Llama with SmolLM2's tokenizer and
chat template serves, with max_model_len 128 so that any answer is short. TINYVLLM_FUZZ_EXAMPLES sets how many
examples (CI: 100); bench/ch12_fuzz_cpu.py runs thousands."""

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_tools import tiny_chat_model

from tinyvllm_lib import LLM
from tinyvllm_lib.entrypoints.launcher import ServerThread
from tinyvllm_lib.entrypoints.openai.api_server import build_app

NUM_EXAMPLES = int(os.environ.get("TINYVLLM_FUZZ_EXAMPLES", "100"))
ANSWERS = {200, 400, 404, 413}  # what a request may get; 503 and 504 cannot happen here (no --max-waiting; 60 s)
GOOD = {"prompt": "Hello", "max_tokens": 1}

# any code point, lone surrogates included and made likely (hypothesis leaves them out unless told), and the
# characters a tokenizer or a template may trip on: NUL, a BOM, line separators, special-token text
odd = st.sampled_from(["\x00", "\ufeff", "\u2028", "\r\n", "<|im_start|>", "<|im_end|>", "{{", "{%", "\\"])
character = st.characters(exclude_categories=()) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | odd
text = st.lists(character, max_size=16).map("".join)
big_text = st.sampled_from(["a", "ab ", "é", "\U0001f600", "\ud800", "\n"]).flatmap(
    lambda piece: st.integers(0, 2_000_000 // len(piece.encode("utf-8", "surrogatepass"))).map(lambda n: piece * n))
number = st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
json_value = st.recursive(
    st.none() | st.booleans() | number | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=10,
)


def field(plausible):
    """A field's value: mostly a plausible one, sometimes any JSON at all."""
    return st.one_of(plausible, plausible, json_value)


token_ids = st.lists(st.integers(-3, 50_000), max_size=12)
part = st.fixed_dictionaries({"type": field(st.sampled_from(["text", "image_url"]))}, optional={"text": field(text)})
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "assistant", "system", "tool"]))},
    optional={"content": field(st.none() | text | big_text | st.lists(part, max_size=3)), "name": field(text)},
)
SHARED = {
    "model": field(st.sampled_from(["tiny"]) | st.none() | text),
    "max_tokens": field(st.integers(-2, 40) | st.none()),
    "temperature": field(st.floats(-1, 3) | st.sampled_from([0, 1])),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-3, 60_000)),
    "seed": field(st.integers(-5, 2**70)),
    "stop": field(text | st.lists(text, max_size=3)),
    "stop_token_ids": field(token_ids),
    "ignore_eos": field(st.booleans()),
    "return_tokens_as_token_ids": field(st.booleans()),
    "n": field(st.integers(0, 3)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "presence_penalty": field(st.sampled_from([0, 0.5, -2, 2.5])),
    "frequency_penalty": field(st.sampled_from([0, 1.0, -3])),
    "repetition_penalty": field(st.sampled_from([1, 1.3, 0, -1])),
    "logit_bias": field(st.dictionaries(text, st.integers(-100, 100), max_size=2)),
    "user": field(text),
}
COMPLETION = SHARED | {
    "prompt": field(text | big_text | token_ids | st.lists(text, max_size=2) | st.lists(token_ids, max_size=2)),
    "logprobs": field(st.integers(-1, 25)),
    "echo": field(st.booleans()),
    "suffix": field(text),
    "best_of": field(st.integers(0, 2)),
}
CHAT = SHARED | {
    "messages": field(st.lists(message, max_size=4)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(-1, 25)),
    "max_completion_tokens": field(st.integers(-2, 40)),
    "add_generation_prompt": field(st.booleans()),
    "tools": field(st.sampled_from([[], [{"type": "function"}]])),
    "tool_choice": field(st.sampled_from(["none", "auto"])),
    "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
}


valid_text = st.text(min_size=1, max_size=40)  # no surrogates
valid_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=20)
valid_part = st.fixed_dictionaries({"type": st.just("text"), "text": valid_text})
valid_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system"]),
    "content": valid_text | st.lists(valid_part, min_size=1, max_size=2),
})
BASE = {  # endpoint -> a good body, to which a few fields are then given other values
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just("tiny"), "prompt": valid_text | valid_ids, "max_tokens": st.integers(1, 16),
         "stream": st.booleans()},
        optional={"temperature": st.floats(0, 2)}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(valid_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 16),
         "stream": st.booleans()},
        optional={"temperature": st.floats(0, 2)}),
}
FIELDS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


def as_json(value) -> bytes:
    return json.dumps(value).encode()  # \ud800 as an escape; NaN and Infinity as Python writes them


def body_of(path: str):
    """A body for path: mostly a good one with its text and up to two other fields changed, else an object of random fields, any
    JSON value, or bytes that may not be JSON."""
    fields = FIELDS[path]
    text_field = "prompt" if path == "/v1/completions" else "messages"
    new_text = st.just({}) | st.fixed_dictionaries({text_field: fields[text_field]})
    others = st.lists(st.sampled_from(sorted(set(fields) - {text_field})), max_size=2, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))
    near_good = st.tuples(BASE[path], new_text, others).map(lambda t: as_json(t[0] | t[1] | t[2]))
    random_fields = st.fixed_dictionaries({}, optional=fields).map(as_json)
    broken = st.binary(max_size=64) | near_good.flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n]))
    return st.one_of(near_good, near_good, near_good, random_fields, json_value.map(as_json), broken)


requests = st.sampled_from(sorted(FIELDS)).flatmap(lambda path: st.tuples(st.just(path), body_of(path)))


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    folder = tiny_chat_model(tmp_path_factory.mktemp("fuzz"))
    engine = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=8).llm_engine
    with ServerThread(build_app(engine, "tiny", request_timeout=60)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield client


def check_answer(r: httpx.Response, events: list[str] | None) -> None:
    assert r.status_code in ANSWERS, f"{r.status_code}: {r.text[:300] if events is None else events[-3:]}"
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif events is not None:  # a stream: chunks, no error event, [DONE]
        assert events and events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-2:]
    else:
        reply = r.json()
        assert len(reply["choices"]) == 1 and reply["usage"]["total_tokens"] > 0, reply


EXAMPLES = []


@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=requests)
def test_no_body_gets_a_5xx_or_hangs_and_the_next_is_answered(http, request):
    path, body = request
    headers = {"content-type": "application/json"}
    with http.stream("POST", path, content=body, headers=headers) as r:
        is_stream = r.headers.get("content-type", "").startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line] if is_stream else None
        if not is_stream:
            r.read()
    check_answer(r, events)
    good = http.post("/v1/completions", json=GOOD)
    assert good.status_code == 200, good.text
    EXAMPLES.append((path, r.status_code, is_stream))


def test_the_fuzzer_ran_its_examples():
    """How many examples ran, and what they got (printed; -s shows it)."""
    if not EXAMPLES:
        pytest.skip("the fuzzer did not run in this process")
    statuses = {}
    for path, status, is_stream in EXAMPLES:
        key = f"{path.removeprefix('/v1/')} {status}{' stream' if is_stream else ''}"
        statuses[key] = statuses.get(key, 0) + 1
    print(f"fuzzer: {len(EXAMPLES)} examples: {dict(sorted(statuses.items()))}")
    assert len(EXAMPLES) >= min(NUM_EXAMPLES, 10)
