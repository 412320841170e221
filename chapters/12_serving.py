# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12. Serving: an OpenAI-compatible server around the engine loop
#
# [Chapter 9](09_batching.py) built an engine that runs many requests at once, and
# [chapter 10](10_paging.py) gave it a pool of blocks and counters. Yet every request
# still came from one Python call: `LLM.generate` took all its prompts at the start and
# returned when the last one was done. A server lives differently. Requests arrive one
# at a time, at moments nobody chose; each client wants its tokens as they are made,
# not at the end; and a client can leave in the middle of an answer, whose blocks
# should then go to someone else. vLLM meets this with `vllm serve`, an HTTP server
# that speaks OpenAI's API, so that every client written for OpenAI — the official
# `openai` package, LangChain, curl — works with it unchanged. This chapter builds the
# same server around chapter 10's `LLMEngine`, and a benchmark that loads it the way
# vLLM's `benchmark_serving` does.
#
# In this chapter you will learn:
#
# - what an OpenAI request **becomes inside the engine**: a JSON body, checked fields, a
#   prompt in the model's chat template, `SamplingParams`, a `Request`;
# - the **asynchronous loop**: one thread steps the engine, the event loop serves HTTP,
#   and the only things they share are an inbox and one mailbox per request;
# - **streaming** with server-sent events, **backpressure** (a slow reader gets fewer,
#   longer pieces; nothing piles up) and **abort** when a client leaves;
# - errors in OpenAI's shape, **refusing abuse early** (text that is not Unicode, bodies
#   too big, prompts that cannot fit, more waiting than it can serve) with the
#   tokenizer off the event loop, and the engine's counters as **Prometheus metrics**;
# - a **serving benchmark**: Poisson arrivals, and time to first token, inter-token
#   latency and end-to-end latency against the request rate.

# %%
#| default_exp entrypoints.openai.api_server

# %%
import asyncio
import json
import math
import pprint
import textwrap
import time
import timeit

import httpx
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from tinyvllm_lib.cli import command
from tinyvllm_lib.engine.llm import LLM
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.measure import load_records
from tinyvllm_lib.plots import Prose, new_figure, plain_log_ticks, verdict
from tinyvllm_lib.runtime import has_gpu

# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
DEVICE = "cuda" if has_gpu() else "cpu"
print(f"the engine runs on {DEVICE}")

# %% [markdown]
# ## A request on the wire
#
# A client of OpenAI's chat API sends one HTTP `POST` to `/v1/chat/completions` whose
# body is JSON:
#
# ```json
# {"model": "smollm2",
#  "messages": [{"role": "user", "content": "What is the capital of France?"}],
#  "max_tokens": 16, "temperature": 0, "stream": true}
# ```
#
# and `/v1/completions` takes a `prompt` instead of `messages`. Most fields are those
# of `SamplingParams` ([chapter 8b](08b_generation.py)) under the same names, because
# vLLM chose its names from OpenAI's:
#
# | OpenAI field | `SamplingParams` | note |
# | --- | --- | --- |
# | `max_tokens` | `max_tokens` | default 16 (completions), or all that fits (chat) |
# | `max_completion_tokens` (chat) | `max_tokens` | OpenAI's newer name |
# | `temperature`, `top_p`, `seed`, `stop` | the same | `temperature` defaults to 1 |
# | `top_k`, `min_p`, `stop_token_ids`, `ignore_eos` | the same | vLLM's extensions |
# | `presence_penalty`, `frequency_penalty` | the same | in [-2, 2], default 0 |
# | `repetition_penalty` | the same | vLLM's extension, > 0, default 1 |
# | `logprobs: k` (completions) | `logprobs=k` | at most 20 |
# | `logprobs`, `top_logprobs: k` (chat) | `logprobs=k` | at most 20 |
# | `n` | `n` | only 1: one completion per request |
# | `stream`, `stream_options` | — | how the answer is sent |
#
# A server must also refuse what it cannot do, rather than quietly do something else:
# `logit_bias`, `echo`, tools, or several prompts in one request
# get a 400 naming the field. Everything else a client may send (`user`, `metadata`)
# is ignored, as vLLM ignores it.
#
# The bodies are parsed by [pydantic](https://docs.pydantic.dev/) models, which check
# the types (`"max_tokens": "many"` is refused before anything else happens), and the
# values are checked by the code that already checks them: `SamplingParams`. Its
# messages begin with the field's name ("top_p must be in (0, 1], got 0"), so a
# `ValueError` from it becomes a 400 whose `param` is that name. The error's shape is
# OpenAI's, which clients know how to read:
#
# ```json
# {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
#            "code": null}}
# ```
#
# **Text that is not text.** JSON can carry a string that is not Unicode: `"\ud800"` is
# a valid JSON escape, one half of a UTF-16 surrogate pair, alone — and no encoding can
# write it. The tokenizer refuses such a string with a `TypeError`, which a server must
# not let become a 500. So every string of a body has the type `Text` below, which
# checks it as the body is parsed, and a message's parts must be objects whose `text`
# is a string: what fails is a 400 naming the field (`messages.0.content.0.text`),
# before any tokenizer sees it.
#
# The request models follow, folded (open the cell to read them): `Text`, the fields
# both endpoints share with their `sampling_params()`, `CompletionRequest`,
# `ChatCompletionRequest`, and `OpenAIError`, whose `body()` is the error object above.

# %% tags=["hide-input"]
#| export entrypoints.openai.protocol
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tinyvllm_lib.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's)


def printable(text: str | None) -> str | None:
    """text with any lone surrogate written as an escape, so that it can be sent."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode()


class OpenAIError(Exception):
    """An error for the client: OpenAI's {"error": {...}}, with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.status = printable(message), status
        self.param, self.type, self.code = printable(param), type, code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def unicode_text(text: str) -> str:
    """text, if it is Unicode: JSON can escape a lone surrogate (\\ud800), which no
    encoding can write, and the tokenizer refuses.
    """
    if text.isascii():  # most text, and Python knows it without a look
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = f"{err.start}: {text[err.start]!r}"
        raise ValueError(f"not valid Unicode (a lone surrogate at {where})") from None
    return text


Text = Annotated[str, AfterValidator(unicode_text)]  # every string of a body


class OpenAIModel(BaseModel):
    # fields this server does not know are ignored, as OpenAI's and vLLM's servers do
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class GenerationFields(OpenAIModel):
    """The fields both endpoints share; None means OpenAI's default."""

    model: Text | None = None  # None: the served model (as vLLM allows)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # this and the next four: vLLM's extensions
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:123"
    n: int | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict | None = None
    # field -> the values this server accepts for it (the defaults)
    ACCEPTED: ClassVar[dict] = {
        "logit_bias": (None, {}),
    }

    def check_supported(self) -> None:
        """A 400 for a field this server cannot honour, or stream_options without
        stream.
        """
        for name, accepted in self.ACCEPTED.items():
            if getattr(self, name) not in accepted:
                raise OpenAIError(f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(
                "stream_options is only allowed when stream is true",
                param="stream_options",
            )

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, logprobs_param: str
    ) -> SamplingParams:
        """The request's SamplingParams; a value they refuse is a 400 naming its
        field.
        """
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise OpenAIError(
                f"{logprobs_param} must be at most {MAX_LOGPROBS}, got {logprobs}",
                param=logprobs_param,
            )
        fields = {
            "n": 1 if self.n is None else self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": (
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "logprobs": logprobs,
        }
        try:
            return SamplingParams(**fields)
        except ValueError as err:  # its messages start with the field's name
            name = str(err).split()[0]
            param = logprobs_param if name == "logprobs" else name
            raise OpenAIError(
                str(err), param=param if name in fields else None
            ) from None


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None
    ACCEPTED: ClassVar[dict] = GenerationFields.ACCEPTED | {
        "echo": (False,),
        "suffix": (None,),
        "best_of": (None, 1),
    }


class ContentPart(OpenAIModel):
    type: Text
    text: Text | None = None


class ChatMessage(OpenAIModel):
    role: Text
    content: Text | list[ContentPart] | None = None

    def for_template(self, index: int) -> dict:
        """{"role", "content"} with the content as text (parts of type text
        joined).
        """
        content, where = self.content, f"messages.{index}.content"
        if isinstance(content, list):
            if bad := [p.type for p in content if p.type != "text"]:
                raise OpenAIError(
                    f"{where}: only text parts are supported, got type {bad[0]!r}",
                    param=where,
                )
            if any(p.text is None for p in content):
                raise OpenAIError(f"{where}: a text part needs its text", param=where)
            content = "\n".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    ACCEPTED: ClassVar[dict] = GenerationFields.ACCEPTED | {
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "response_format": (None, {"type": "text"}),
    }


# %% [markdown]
# Here is what a body becomes, and what a bad one gets:

# %%
from tinyvllm_lib.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
)

body = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
    "user": "someone",  # not ours to use: ignored
}
request = ChatCompletionRequest.model_validate(body)
params = request.sampling_params(request.max_tokens, None, "top_logprobs")
pprint.pp({k: v for k, v in vars(params).items() if k != "output_kind"}, width=88)
try:
    bad = ChatCompletionRequest.model_validate(body | {"top_p": 0})
    bad.sampling_params(bad.max_tokens, None, "top_logprobs")
except OpenAIError as err:
    print(err.status, json.dumps(err.body(), indent=1))
    assert err.param == "top_p"

# %% [markdown]
# ## From messages to a `Request`
#
# A chat request's `messages` become one prompt through the model's **chat template**,
# exactly as `LLM.chat` does it in [chapter 9](09_batching.py): the template renders
# the conversation as text, with the markers the model was trained on, and the text
# is encoded without adding special tokens (the template wrote them). A completion's
# `prompt` is already text, or token ids. What the engine gets is then what
# `LLM.generate` gives it — a prompt and `SamplingParams` — so that a greedy answer
# over HTTP is the answer `LLM.generate` gives offline; the tests check that token by
# token. The `model` field must name the model being served: another name is a 404, as
# OpenAI answers for a model it does not have.
#
# Each endpoint is a small class in the manner of vLLM's `OpenAIServingChat` and
# `OpenAIServingCompletion`: a method that turns a body into the engine's inputs, and
# one that turns the engine's outputs into OpenAI's JSON — a `choice`. A whole answer
# is a list of choices with a `usage` count; a streamed one is a sequence of **chunks**,
# each carrying a choice with the new piece of text. What the two endpoints share —
# handing a request to the engine, waiting for its outputs, streaming them — is their
# base class, after the loop that feeds it is built.

# %%
llm = LLM("smollm2", device=DEVICE, max_model_len=512, max_num_seqs=32)
question = [{"role": "user", "content": "What is the capital of France?"}]
text = llm.tokenizer.apply_chat_template(question, add_generation_prompt=True)
ids = llm.tokenizer.encode(text, add_special_tokens=False)
print(text)
print(f"{len(ids)} prompt tokens")

# %% [markdown]
# ## One thread steps, the event loop serves
#
# An HTTP server in Python is an **event loop**: one thread runs every handler as a
# coroutine, and a handler gives the thread up at each `await` (a read from the
# network, a wait for data). That is how one thread keeps thousands of connections
# open: a handler that waits costs nothing. It also means that a handler must never
# compute for long — while it does, no other connection is served. An engine step is
# exactly such a computation: milliseconds on a GPU, more on a CPU. So the engine
# cannot be stepped from a handler.
#
# It gets a thread of its own, which does nothing but run the loop of chapter 9:
# take new requests, `step()`, hand out what the step produced, again. The engine is
# **not thread-safe** — its scheduler's queues, the block manager's free list and
# every request's token lists change inside `step()` — and the simple way to keep it
# safe is that **no other thread ever touches it**. There is no lock, because nothing
# is shared but two kinds of mailbox:
#
# - the **inbox**, a `queue.SimpleQueue` (safe between threads): handlers post
#   `add` and `abort` commands to it; the engine thread takes them between steps, and
#   calls the engine's `add_request` (through `make_request`, which checks the prompt,
#   and `enqueue`) and `abort_request` itself. Its answer to an `add` — accepted, or
#   the `ValueError` that becomes a 400 — goes back through an `asyncio.Future`.
# - one **collector** per request, on the event loop. After each step the engine thread
#   makes, for every request that progressed, a *delta*: the new token ids, their
#   log-probs, and the text that can no longer change (`Request.stream_delta`, from
#   chapter 8b, holds back what could still become a stop string). It reads them from
#   the requests themselves, so its requests ask the engine for `FINAL_ONLY` outputs
#   (chapter 11): no whole `RequestOutput` per request per step. It cannot put them
#   into asyncio objects itself — those belong to the loop's thread — so it schedules
#   one callback on the loop with `loop.call_soon_threadsafe`, which puts each delta
#   into its request's collector and wakes the handler waiting there.
#
# When nothing is running, the engine thread sleeps inside `inbox.get()`, and the first
# command wakes it. The tokenizer and the model's config never change, so handlers may
# read them (to render a chat template) without asking the engine thread.


# %% tags=["hide-input"]
ROUND = "round,pad=0.02,rounding_size=0.08"


def box(ax, xy, w, h, text, color="#ffffff", size=7.5, style=ROUND, ec="#555555"):
    """A rounded box at xy (its lower left corner) with its text centred."""
    ax.add_patch(FancyBboxPatch(xy, w, h, boxstyle=style, fc=color, ec=ec, lw=0.8))
    ax.text(xy[0] + w / 2, xy[1] + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, start, end, text="", color="#333333", rad=0.0, offset=(0, 0), head=True):
    style = "-|>" if head else "-"
    bend = f"arc3,rad={rad}"
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=9, color=color, lw=1,
            connectionstyle=bend,
        )
    )  # fmt: skip
    if text:
        x, y = (start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1]
        label = dict(fc="white", ec="none", pad=0.5)
        ax.text(
            x, y, text, ha="center", va="center", fontsize=7, color=color, bbox=label
        )


LOOP_STEPS = [  # the engine thread's loop, top to bottom: (y, text)
    (
        4.85,
        "1. take commands (sleep while idle)\nmake_request · enqueue · abort_request",
    ),
    (3.6, "2. engine.step()\nschedule → execute → postprocess"),
    (2.35, "3. a delta per request that progressed\nnew tokens, stream_delta() text"),
    (1.1, "4. stat loggers (/metrics)\nrunning, waiting, KV blocks, latencies"),
]


def draw_serving_loop():
    """The server's two threads, and the inbox and collectors between them."""
    fig, ax = new_figure(width=10, height=4.6)
    ax.set_xlim(0, 10.4)
    ax.set_ylim(0, 6.3)
    ax.axis("off")
    lane = "round,pad=0.05"
    box(ax, (1.05, 0.25), 3.75, 5.2, "", "#eef4fb", style=lane, ec="#9ecae1")
    box(ax, (6.25, 0.25), 3.6, 5.2, "", "#fdf1e6", style=lane, ec="#fdae6b")
    bold = dict(ha="center", fontsize=8.5, weight="bold")
    ax.text(2.92, 0.0, "event loop thread (uvicorn, asyncio)", **bold)
    ax.text(8.05, 0.0, "engine thread: the only one to touch LLMEngine", **bold)
    for i, y in enumerate((4.05, 2.45, 0.85)):
        box(ax, (0.05, y + 0.15), 0.75, 0.6, f"client {i + 1}", "#f0f0f0")
        box(ax, (1.25, y), 1.7, 0.9, f"handler {i + 1}\nawait collector.get()")
        box(ax, (3.3, y + 0.1), 1.3, 0.7, f"collector {i + 1}\n(one delta)", "#dbe9f6")
        arrow(ax, (0.8, y + 0.6), (1.25, y + 0.6))  # the request
        arrow(ax, (1.25, y + 0.3), (0.8, y + 0.3))  # chunks
        arrow(ax, (3.3, y + 0.45), (2.95, y + 0.45))
        arrow(ax, (2.95, y + 0.75), (3.12, y + 0.75), head=False)  # onto the bus
    ax.text(0.45, 5.25, "POST →\n← SSE chunks", ha="center", fontsize=6.5)
    # every handler posts add / abort along one line to the inbox
    arrow(ax, (3.12, 1.6), (3.12, 5.75), head=False)
    arrow(ax, (3.12, 5.75), (4.95, 5.75), "post add / abort", offset=(0, 0.17))
    box(ax, (4.95, 5.4), 1.2, 0.7, "inbox\n(SimpleQueue)", "#fff7bc")
    arrow(ax, (6.15, 5.75), (7.0, 5.25))
    for y, text in LOOP_STEPS:
        box(ax, (6.45, y - 0.35), 3.2, 0.8, text, size=7)
    for (y0, _), (y1, _) in zip(LOOP_STEPS, LOOP_STEPS[1:]):
        arrow(ax, (8.05, y0 - 0.35), (8.05, y1 + 0.45))
    arrow(ax, (9.65, 0.95), (9.65, 4.8), rad=0.35)  # and again
    red = "#d62728"
    for y in (4.5, 2.9, 1.3):
        arrow(ax, (6.45, 2.35), (4.6, y), color=red)
    label = "loop.call_soon_threadsafe\n(one callback a step)"
    ax.text(5.52, 0.55, label, ha="center", fontsize=7, color=red)
    return fig


# %%
fig = draw_serving_loop()
plt.show()

# %% [markdown]
# ### The collector: backpressure without a queue
#
# What if a client reads slowly — a phone on a bad network, a script that sleeps
# between chunks? The engine must not wait for it: a step serves every running
# request, and one slow reader would slow them all. Nor should the server pile up
# chunks for it without limit. vLLM's answer is its `RequestOutputCollector`: the
# mailbox holds **one delta, not a queue**. A delta that arrives before the handler took
# the last one is merged into it — texts joined, token lists joined — so a slow reader
# gets fewer, longer pieces of the same text, and the server holds at most one pending
# piece per request. The network's own flow control does the rest: when a client's
# socket buffer is full, the handler's `send` waits, it takes from the collector less
# often, and the deltas merge.
#
# The metrics the engine thread computes go to **stat loggers** (vLLM's word): after
# each step it calls `record(stats, iteration)` on each, with chapter 10's
# `EngineStats` and an `IterationStats` of that step — the times to first token of
# requests that got their first token, the gaps of those that got another, the
# requests that finished. The folded cell below holds `IterationStats` and
# `PrometheusStatLogger`, which turns both into the gauges, counters and histograms of
# `/metrics`.

# %% tags=["hide-input"]
#| export engine.metrics
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tinyvllm_lib.engine.stats import EngineStats


@dataclass
class IterationStats:
    """What one engine step did, for stat loggers (vLLM's IterationStats); seconds."""

    num_waiting: int = 0  # requests the engine holds but does not run, after the step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[tuple[str, float]] = field(default_factory=list)  # (reason, e2e)


# vLLM's buckets (seconds)
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
# counter -> the EngineStats field it follows
COUNTED = {
    "prompt_tokens": "num_prompt_tokens",
    "generation_tokens": "num_generated_tokens",
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "num_prompt_tokens",
    "prefix_cache_hits": "num_cached_prompt_tokens",
}


class PrometheusStatLogger:
    """The engine's state and latencies as Prometheus metrics with vLLM's names, prefix
    tinyvllm: (vLLM's PrometheusStatLogger). record() runs on the engine thread.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        labels = {"model_name": model_name}

        def make(kind, name, doc, **kw):
            metric = kind(
                f"tinyvllm:{name}", doc, ["model_name"], registry=registry, **kw
            )
            return metric.labels(**labels)

        self.running = make(Gauge, "num_requests_running", "Requests running.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = make(
            Gauge, "kv_cache_usage_perc", "KV-cache usage: 1 is every block held."
        )
        self.counters = {
            name: make(Counter, name, f"EngineStats.{stat} (tokens or events).")
            for name, stat in COUNTED.items()
        }
        self.success = Counter(
            "tinyvllm:request_success",
            "Requests finished, by finish_reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.ttft = make(
            Histogram, "time_to_first_token_seconds", "Time to first token.",
            buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = make(
            Histogram, "inter_token_latency_seconds", "Time between tokens.",
            buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = make(
            Histogram, "e2e_request_latency_seconds", "Arrival to last token.",
            buckets=E2E_BUCKETS,
        )  # fmt: skip
        self.last = EngineStats()

    def count_from(self, stats: EngineStats) -> None:
        """Count from these stats on (the engine may have run before the server)."""
        self.last = stats

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(iteration.num_waiting)
        self.kv_usage.set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
        for name, stat in COUNTED.items():
            self.counters[name].inc(getattr(stats, stat) - getattr(self.last, stat))
        self.last = stats
        for seconds in iteration.time_to_first_tokens:
            self.ttft.observe(seconds)
        for seconds in iteration.inter_token_latencies:
            self.itl.observe(seconds)
        for reason, seconds in iteration.finished:
            self.success.labels(self.model_name, reason).inc()
            self.e2e.observe(seconds)


# %% [markdown]
# The engine thread and its two mailboxes, then. `AsyncLLMEngine` is vLLM's name for
# this object: `add_request` posts a command and awaits the engine's answer;
# `generate` is the same as an async iterator of deltas, which aborts its request when
# the caller stops iterating early; `abort` may be called from anywhere, for a request
# in any state. Everything below the line `# --- the engine thread ---` runs on the
# engine's thread only. If a step raises (a bug), the requests in flight get the
# error and the loop goes on serving new ones. The cell is folded: its heart is
# `_step`, which steps the engine and hands every request's delta to the loop in one
# `call_soon_threadsafe`.

# %% tags=["hide-input"]
#| export engine.async_llm_engine
import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace

from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.metrics import IterationStats
from tinyvllm_lib.engine.outputs import CompletionOutput, RequestOutput
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampling_params import RequestOutputKind, SamplingParams


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    a, b = first.outputs[0], then.outputs[0]
    merged = replace(
        b,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=None if b.logprobs is None else a.logprobs + b.logprobs,
    )
    return replace(then, outputs=[merged])


class RequestOutputCollector:
    """One request's mailbox on the event loop: a delta put before the last was taken
    is merged into it (vLLM's RequestOutputCollector).
    """

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        self.output: RequestOutput | BaseException | None = None
        self.num_merged = 0  # deltas merged into another because the reader was behind

    def put(self, output: RequestOutput | BaseException) -> None:
        """On the loop's thread (the engine thread calls it through the loop)."""
        if isinstance(self.output, BaseException):
            return  # an error stays until it is read
        if isinstance(self.output, RequestOutput) and isinstance(output, RequestOutput):
            output = merge_deltas(self.output, output)
            self.num_merged += 1
        self.output = output
        self.ready.set()

    async def get(self, timeout: float | None = None) -> RequestOutput | None:
        """All that came since the last get, as one delta; None if nothing came in
        timeout seconds.
        """
        if self.output is None:
            try:  # asyncio.timeout, not wait_for: no task made per token
                async with asyncio.timeout(timeout):
                    await self.ready.wait()
            except TimeoutError:
                return None
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


@dataclass
class _Tracked:
    """What the engine thread keeps of a request it serves."""

    request: Request
    collector: RequestOutputCollector
    arrival: float  # time.perf_counter() when the handler posted it
    num_sent: int = 0  # output tokens delivered so far
    last_token_time: float = 0.0


def _deliver(items: list) -> None:
    for collector, output in items:
        collector.put(output)


class EngineOverloaded(RuntimeError):
    """A request refused because max_waiting requests wait already (a 503)."""


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # a handler cancelled meanwhile: nobody to tell
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class AsyncLLMEngine:
    """An LLMEngine for asyncio callers, stepped by one background thread, the only
    thread that touches it (vLLM's AsyncLLMEngine). Callers post add and abort to its
    inbox; each request's deltas come back through its RequestOutputCollector.
    """

    def __init__(self, engine: LLMEngine, stat_loggers=(), max_waiting=None):
        self.engine, self.stat_loggers = engine, list(stat_loggers)
        self.max_waiting = max_waiting  # None: as many as come
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tracked: dict[str, _Tracked] = {}  # the engine thread's own
        # set once by shutdown: no add is posted after it (under the lock)
        self._stopped, self._lock = False, threading.Lock()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    @property
    def is_running(self) -> bool:
        return self.thread.is_alive()

    async def add_request(
        self, request_id: str, prompt, params, name: str = "prompt"
    ) -> RequestOutputCollector:
        """Hand a request to the engine: its collector once the engine took it, or the
        engine's ValueError (a prompt too long, say).
        """
        accepted = asyncio.get_running_loop().create_future()
        collector = RequestOutputCollector()
        args = (prompt, params, name, collector, accepted, time.perf_counter())
        with self._lock:  # never after shutdown's stop: nobody would answer it
            if self._stopped or not self.is_running:
                raise RuntimeError("the engine loop has stopped")
            self.inbox.put(("add", request_id, args))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return collector

    def abort(self, request_id: str) -> None:
        """End a request (its client left); any thread, any state, even finished."""
        self.inbox.put(("abort", request_id, ()))

    async def generate(self, prompt, params, request_id: str, name: str = "prompt"):
        """vLLM's generate: the request's deltas as they come; stopping early aborts
        it.
        """
        collector = await self.add_request(request_id, prompt, params, name)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its step; requests in flight get a RuntimeError."""
        with self._lock:
            self._stopped = True
            self.inbox.put(("stop", None, ()))
        self.thread.join(timeout)
        self.engine.shutdown()  # chapter 13's other ranks, if any

    # --- the engine thread ---

    def _run(self) -> None:
        while True:
            # idle: sleep until a command comes; busy: take what came, then step
            idle = not self.engine.has_unfinished_requests()
            commands = [self.inbox.get()] if idle else []
            while not self.inbox.empty():
                commands.append(self.inbox.get())
            for kind, request_id, args in commands:
                if kind == "stop":
                    self._fail_all(RuntimeError("the engine was shut down"))
                    return
                if kind == "add":
                    self._add(request_id, *args)
                else:
                    try:
                        self._abort(request_id)
                    except Exception:  # a bug must not end the loop
                        logging.getLogger("tinyvllm.engine").exception("abort failed")
            if self.engine.has_unfinished_requests():
                self._step()

    def _num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)  # admitted, not yet running

    def _add(self, request_id, prompt, params, name, collector, accepted, arrival):
        if self.max_waiting is not None and self._num_waiting() >= self.max_waiting:
            message = f"{self._num_waiting()} requests are waiting: try again later"
            self._call(collector.loop, _resolve, accepted, EngineOverloaded(message))
            return
        if isinstance(params, SamplingParams):  # the thread builds its own deltas
            params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            # this thread reads the text as it grows (stream_delta), though the engine
            # is told FINAL_ONLY
            request = self.engine.make_request(
                request_id, prompt, params, name=name, streams_text=True
            )
            self.engine.enqueue(request)
        except Exception as err:  # ValueError: the client's fault (a 400)
            self._call(collector.loop, _resolve, accepted, err)
            return
        self.tracked[request_id] = _Tracked(request, collector, arrival)
        self._call(collector.loop, _resolve, accepted, None)

    def _abort(self, request_id: str) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is not None and not tracked.request.is_finished:
            self.engine.abort_request(request_id)  # its blocks are free at once

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # a bug: fail the requests in flight, keep serving
            self._fail_all(err)
            return
        now, iteration = time.perf_counter(), IterationStats()
        deliveries = defaultdict(list)  # event loop -> [(collector, delta)]
        # FINAL_ONLY: the engine reports a request once, when it ends (or is aborted);
        # the deltas come from the requests themselves, not from per-step outputs
        ended = {o.request_id for o in outputs if o.finished}
        for request_id, tracked in list(self.tracked.items()):
            finished = request_id in ended
            if (
                not finished
                and len(tracked.request.output_token_ids) == tracked.num_sent
            ):
                continue  # nothing new: waiting, or a chunk of its prompt
            try:
                delta = self._delta(tracked, now, iteration)
            except Exception as err:  # a bug in one request's delta: fail that one
                del self.tracked[request_id]
                if not finished:
                    self.engine.abort_request(request_id)
                deliveries[tracked.collector.loop].append((tracked.collector, err))
                continue
            deliveries[tracked.collector.loop].append((tracked.collector, delta))
            if finished:
                del self.tracked[request_id]
                reason = tracked.request.finish_reason
                iteration.finished.append((reason, now - tracked.arrival))
        for loop, items in deliveries.items():
            self._call(loop, _deliver, items)
        stats, iteration.num_waiting = self.engine.stats, self._num_waiting()
        for logger in self.stat_loggers:
            try:
                logger.record(stats, iteration)
            except Exception:  # a logger's bug must not stop the loop
                logging.getLogger("tinyvllm.engine").exception("stat logger failed")

    def _delta(self, tracked: _Tracked, now: float, iteration) -> RequestOutput:
        """The request's new tokens and stable text since its last delta."""
        request, start = tracked.request, tracked.num_sent
        new_ids = request.output_token_ids[start:]
        if new_ids:
            if start == 0:
                iteration.time_to_first_tokens.append(now - tracked.arrival)
            else:
                iteration.inter_token_latencies.append(now - tracked.last_token_time)
            tracked.num_sent, tracked.last_token_time = start + len(new_ids), now
        logprobs = None if request.logprobs is None else request.logprobs[start:]
        completion = CompletionOutput(
            0,
            request.stream_delta(),
            new_ids,
            request.cumulative_logprob,
            logprobs,
            request.finish_reason,
            request.stop_reason,
        )
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            request.prompt_logprobs,
            [completion],
            request.is_finished,
            request.num_cached_tokens,
        )

    @staticmethod
    def _call(loop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that loop has closed: nobody waits there any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        for request_id, tracked in self.tracked.items():
            self._call(tracked.collector.loop, _deliver, [(tracked.collector, error)])
            try:
                if not tracked.request.is_finished:
                    self.engine.abort_request(request_id)
            except Exception:  # after a failed step the engine may be in any state
                logging.getLogger("tinyvllm.engine").exception("abort failed")
        self.tracked.clear()
        while not self.inbox.empty():  # adds that came too late
            kind, _, args = self.inbox.get()
            if kind == "add":
                self._call(args[3].loop, _resolve, args[4], error)


# %% [markdown]
# Synchronous code runs a coroutine to its end with a small helper: a fresh event loop
# on a helper thread, which works in a script and in a notebook alike (a notebook's own
# event loop is already running, and `asyncio.run` will not start a second one on its
# thread). The server itself runs the same way, in the background:
# `ServerThread` starts [uvicorn](https://www.uvicorn.org/), the HTTP server vLLM uses,
# on `127.0.0.1` and a port the system picks, and stops it again; `serve_http` is the
# blocking version the `serve` command uses. All three are in the folded cell below.

# %% tags=["hide-input"]
#| export entrypoints.launcher
import asyncio
import concurrent.futures
import socket
import threading
import time

import uvicorn


def run_coroutine(coroutine):
    """Run a coroutine to its end from synchronous code, in a fresh event loop on a
    helper thread (which works in a notebook too, whose loop is already running).
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def serve_http(app, host: str = "127.0.0.1", port: int = 8000, log_level="info"):
    """Serve app until Ctrl-C."""
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
    )


class ServerThread:
    """app served by uvicorn from a background thread, on host and a free port; a
    context manager. url is where it listens.
    """

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, log_level="warning"
    ):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))  # port 0: the system picks a free one
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# %% [markdown]
# Three requests go to the engine thread at once, from one event loop: a reader that
# takes each delta as it comes, a **slow reader** that after each read is busy
# elsewhere until two more deltas have come in, and one that leaves after three deltas.
# A stat logger of our own writes down, after every step, how many KV blocks are held.

# %%
from tinyvllm_lib.engine.async_llm_engine import AsyncLLMEngine
from tinyvllm_lib.entrypoints.launcher import run_coroutine


class BlocksLog:
    """A stat logger that keeps the KV blocks held after each step."""

    def __init__(self):
        self.blocks = []

    def record(self, stats, iteration):
        self.blocks.append(stats.kv_blocks_used)


def chat_prompt(content: str) -> dict:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return {"prompt": text, "prompt_token_ids": llm.tokenizer.encode(text, False)}


QUESTIONS = {
    "fast": "What is the capital of France?",
    "slow": "Write a short poem about the sea.",
    "leaves": "Tell me about photosynthesis.",
}
demo_params = SamplingParams(temperature=0, max_tokens=48)


async def read(engine, name, slow=False, leave_after=None):
    """Read one request's deltas; a slow reader is away after each until two more have
    come in (or the last); leave early if asked.
    """
    collector = await engine.add_request(
        name, chat_prompt(QUESTIONS[name]), demo_params
    )
    pieces, ids = [], []
    while True:
        out = await collector.get()
        pieces.append(out.outputs[0].text)
        ids += out.outputs[0].token_ids
        if out.finished or len(pieces) == leave_after:
            break
        merged = collector.num_merged  # the second delta to come merges into the first
        while slow and collector.num_merged == merged:
            waiting = collector.output  # the last delta, or an error, ends the merging
            if isinstance(waiting, BaseException) or getattr(waiting, "finished", 0):
                break  # get() returns it, or raises it
            await asyncio.sleep(0.005)
    if not out.finished:
        engine.abort(name)
    return {"pieces": pieces, "ids": ids, "merged": collector.num_merged}


async def three_readers(engine):
    fast, slow, leaves = await asyncio.gather(
        read(engine, "fast"), read(engine, "slow", slow=True),
        read(engine, "leaves", leave_after=3),
    )  # fmt: skip
    return {"fast": fast, "slow": slow, "leaves": leaves}


blocks_log = BlocksLog()
async_engine = AsyncLLMEngine(llm.llm_engine, [blocks_log])
readers = run_coroutine(three_readers(async_engine))
async_engine.shutdown()
for name, r in readers.items():
    print(
        f"{name:>7}: {len(r['ids']):>2} tokens in {len(r['pieces']):>2} deltas "
        f"({r['merged']} merged): {''.join(r['pieces'])[:36]!r}"
    )
print(textwrap.fill(f"KV blocks held after each step: {blocks_log.blocks}", 88))

# %% [markdown]
# The slow reader received its tokens in fewer deltas than it has tokens — the rest
# were merged while it was away — and the one that left held its blocks only until its
# abort reached the engine thread; when all three were done the pool was empty again.
# Merged or not, the pieces are the same text as offline generation, which runs now
# that the engine thread has stopped (the engine is again anyone's to use, one thread
# at a time):

# %%
offline = {
    name: out
    for name, out in zip(
        QUESTIONS,
        llm.generate([chat_prompt(q) for q in QUESTIONS.values()], demo_params,
                     use_tqdm=False),
    )
}  # fmt: skip
for name in ("fast", "slow"):
    assert "".join(readers[name]["pieces"]) == offline[name].outputs[0].text
    assert readers[name]["ids"] == offline[name].outputs[0].token_ids
assert readers["slow"]["merged"] > 0, "the slow reader should have had deltas merged"
leaves = readers["leaves"]["ids"]
assert leaves == offline["leaves"].outputs[0].token_ids[: len(leaves)]
assert len(leaves) < len(offline["leaves"].outputs[0].token_ids)
assert blocks_log.blocks[-1] == 0
prose.glue("ch12_slow_tokens", len(readers["slow"]["ids"]))
prose.glue("ch12_slow_deltas", len(readers["slow"]["pieces"]))
prose.glue("ch12_left_tokens", len(leaves))
prose.glue("ch12_peak_blocks", max(blocks_log.blocks))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The slow reader got its {{ch12_slow_tokens}} tokens in {{ch12_slow_deltas}} deltas; the
one that left had {{ch12_left_tokens}} tokens when it went. The three held at most
{{ch12_peak_blocks}} blocks, and none after the last step.
""")

# %% [markdown]
# ## The server
#
# What is left is HTTP, and it is thin. [FastAPI](https://fastapi.tiangolo.com/) (the
# framework vLLM's server uses) parses each body into the pydantic models above and
# calls a handler. The handler checks the model's name and the unsupported fields,
# builds the engine's inputs, and `await`s the engine's acceptance; a `ValueError` from
# the engine thread — a prompt longer than `max_model_len`, `max_tokens` that does not
# fit after it, a token id outside the vocabulary — becomes a 400 there, before any
# answer has begun. Then:
#
# - **without `stream`**, it merges the deltas until the request is finished and
#   returns one JSON answer;
# - **with `stream`**, it returns a `StreamingResponse` of **server-sent events**: the
#   body stays open, and each chunk is a line `data: {json}` followed by a blank line.
#   A chat stream opens with a chunk whose `delta` is `{"role": "assistant"}`, then one
#   chunk per delta with `{"content": "..."}`, the last with its `finish_reason`; if the
#   request asked `stream_options: {"include_usage": true}`, a last chunk with no
#   choices carries the `usage`; and the stream ends with `data: [DONE]`.
#
# **Abort.** A client that closes its connection must free its blocks. The handler
# asks `await request.is_disconnected()` when it starts and then at most every half
# second (a delta wakes it far more often than that, and asking is not free, where a
# token may take a millisecond); while it waits for a delta it wakes every half second
# to ask, because a request still waiting for admission produces nothing to send.
# Starlette also listens for the client's disconnect while
# it streams, and when it comes first it cancels the generator: Python raises
# `asyncio.CancelledError` at the generator's `await`. Either way the generator's
# `finally` clause posts an `abort` — it only puts a command into the inbox, which is
# safe to do while being cancelled — and the engine thread frees the blocks before its
# next step.
#
# **Errors.** FastAPI answers a body it cannot parse with its own 422 and a list of
# problems; an OpenAI client expects a 400 with one `error` object, so the server
# replaces that handler, and the ones for unknown routes (404) and wrong methods
# (405). Anything else that goes wrong inside a handler is a bug; it gets a 500 in the
# same shape, and the server keeps serving.

# %% [markdown]
# **Tokenizing off the loop.** A prompt becomes token ids before the engine sees it,
# and that work is not small: the chat template is rendered by Jinja, and a long text
# takes the tokenizer a long time. On the event loop it would stall every connection;
# on the engine's thread, every running stream. vLLM keeps the two apart — its API
# server tokenizes, its engine core only steps — and so does this server: templates
# and the tokenizer run on a small pool of worker threads of their own. Threads help
# only if the work lets go of Python's GIL, and the tokenizers library's `encode` does
# not (a profile of the server during a long refusal, every thread's stack dumped by
# `faulthandler`, found the engine thread inside `encode` and the event loop unable to
# run for seconds); its batch call does, and chapter 3's `Tokenizer.encode` uses it.
#
# A prompt that cannot fit is refused before it is tokenized, where its length
# already proves it. A byte-level tokenizer (GPT-2's, SmolLM2's, Llama 3's) puts every
# byte of a text into some token, and no token stands for more bytes than its
# vocabulary entry is written with, $L$ at most; so a text of $B$ UTF-8 bytes has at
# least $\lceil B / L \rceil$ tokens, and if that is already `max_model_len` the
# answer is a 400 with no tokenizer call. Whatever the template or the tokenizer
# raises on a request's text is the request's fault: a 400 too.
#
# `PromptProcessor`, folded below, does both: it checks the byte bound, then renders
# and encodes on its pool, and gives the handler token ids or a 400.

# %% tags=["hide-input"]
#| export entrypoints.openai.prompts
import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

from tinyvllm_lib.entrypoints.openai.protocol import OpenAIError


def longest_token_bytes(tokenizer) -> int | None:
    """L, the most UTF-8 bytes a vocabulary entry is written with, for a byte-level
    tokenizer that normalizes nothing (a text of B bytes has at least B / L tokens);
    None for any other, which may drop or merge characters.
    """
    backend = tokenizer.backend
    pre_tokenizer = repr(backend.pre_tokenizer).lower()
    if backend.normalizer is not None or "bytelevel" not in pre_tokenizer:
        return None
    if "removed" in pre_tokenizer:  # a split that drops what it splits on
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(len(token.encode()) for token in vocab)


class PromptProcessor:
    """Prompts into token ids on worker threads of their own, off the event loop and
    the engine's thread; a prompt that cannot fit is a 400, early where it can be.
    """

    def __init__(self, tokenizer, max_model_len: int, num_threads: int = 2):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_token_bytes = tokenizer and longest_token_bytes(tokenizer)  # or None
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer")

    def check_length(self, num_tokens: int, name: str, at_least="") -> None:
        """A 400 for a prompt of num_tokens that leaves no room for a new one."""
        if num_tokens >= self.max_model_len:
            raise OpenAIError(
                f"{name} has {at_least}{num_tokens} tokens; max_model_len is "
                f"{self.max_model_len}, which leaves no room for a new token",
                param=name,
            )

    async def from_text(self, text: str, name: str = "prompt") -> dict:
        return await self._run(self._encode, text, True, name)

    async def from_messages(self, messages: list[dict], add_generation_prompt) -> dict:
        return await self._run(self._render, messages, add_generation_prompt)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _encode(self, text: str, add_special_tokens: bool, name: str) -> dict:
        if self.tokenizer is None:
            message = f"{name} is text, but the model has no tokenizer.json: give ids"
            raise OpenAIError(message, param=name)
        if self.max_token_bytes:  # B bytes are at least B / L tokens
            is_ascii = text.isascii()  # then a byte a character
            num_bytes = len(text if is_ascii else text.encode("utf-8", "surrogatepass"))
            at_least = math.ceil(num_bytes / self.max_token_bytes)
            self.check_length(at_least, name, "at least ")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as err:  # what it cannot read is the request's fault
            raise OpenAIError(f"{name}: {err}", param=name) from None
        self.check_length(len(ids), name)
        return {"prompt": text, "prompt_token_ids": ids}

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> dict:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # the template refused them (raise_exception)
            raise OpenAIError(f"messages: {err}", param="messages") from None
        return self._encode(text, False, "messages")

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# %% [markdown]
# The two endpoints share the rest, in the folded base class `OpenAIServing` below:
# `submit` hands a request to the engine and turns a refusal into a 400, `respond`
# merges the deltas into one JSON answer, and `stream` writes them as server-sent
# events (`sse` makes one), asking every half second whether the client is still there.

# %% tags=["hide-input"]
#| export entrypoints.openai.serving
import asyncio
import json
import math
import time
import uuid

from tinyvllm_lib.engine.async_llm_engine import (
    AsyncLLMEngine,
    EngineOverloaded,
    RequestOutputCollector,
    merge_deltas,
)
from tinyvllm_lib.engine.outputs import CompletionOutput, RequestOutput
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.entrypoints.openai.prompts import PromptProcessor
from tinyvllm_lib.entrypoints.openai.protocol import OpenAIError

POLL_SECONDS = 0.5  # how often a handler checks on its client


def sse(data: dict | str) -> str:
    """One server-sent event: a line `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


def finite(logprob: float) -> float:
    """JSON has no -inf: a token that could not be chosen gets vLLM's -9999."""
    return logprob if math.isfinite(logprob) else -9999.0


class OpenAIServing:
    """One endpoint: a body into the engine's inputs, the engine's deltas into
    OpenAI's JSON (vLLM's OpenAIServing). Subclasses make the inputs and choices.
    """

    object = chunk_object = id_prefix = ""

    def __init__(
        self,
        served_model_name: str,
        prompts: PromptProcessor,
        request_timeout: float | None = None,
    ):
        self.served_model_name, self.prompts = served_model_name, prompts
        self.tokenizer, self.request_timeout = prompts.tokenizer, request_timeout
        self.engine: AsyncLLMEngine | None = None  # set when the server starts

    async def engine_inputs(self, request) -> tuple[object, SamplingParams, str]:
        """(prompt, SamplingParams, the prompt's field name) of a request body."""
        raise NotImplementedError

    def choice(self, request, out: CompletionOutput, stream: bool, state: dict):
        raise NotImplementedError

    def opening_choices(self, request) -> list[dict]:
        return []

    def token(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def envelope(self, request_id, created, object, choices, **extra) -> dict:
        return {
            "id": request_id,
            "object": object,
            "created": created,
            "model": self.served_model_name,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def usage(final: RequestOutput, num_generated: int) -> dict:
        num_prompt = len(final.prompt_token_ids)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens},
        }

    def timed_out(self) -> OpenAIError:
        message = f"the request took longer than {self.request_timeout} s"
        return OpenAIError(message, 504, type="timeout_error")

    @staticmethod
    async def client_left(raw_request, checked: list[float]) -> bool:
        """Whether the client has gone, asked at most every POLL_SECONDS (checked[0]:
        when it was last asked): asking is not free, and a token can take a
        millisecond.
        """
        if (now := time.monotonic()) - checked[0] < POLL_SECONDS:
            return False
        checked[0] = now
        return await raw_request.is_disconnected()

    def next_wait(self, deadline: float | None) -> float:
        """How long to wait for the next delta; 504 past the deadline."""
        if deadline is None:
            return POLL_SECONDS
        if (left := deadline - time.monotonic()) <= 0:
            raise self.timed_out()
        return min(POLL_SECONDS, left)

    async def submit(
        self, request
    ) -> tuple[str, SamplingParams, RequestOutputCollector, float | None]:
        """Check a body and hand it to the engine: OpenAIError on bad input. The last
        item is the request's deadline (time.monotonic()), or None.
        """
        timeout = self.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if request.model is not None and request.model != self.served_model_name:
            raise OpenAIError(
                f"The model `{request.model}` does not exist; this server serves "
                f"`{self.served_model_name}`.",
                status=404,
                param="model",
                code="model_not_found",
            )
        request.check_supported()
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        try:
            async with asyncio.timeout(timeout):  # None: no limit
                prompt, params, name = await self.engine_inputs(request)
                collector = await self.add(request_id, prompt, params, name)
        except TimeoutError:
            raise self.timed_out() from None
        return request_id, params, collector, deadline

    async def add(self, request_id, prompt, params, name) -> RequestOutputCollector:
        """Hand a request to the engine; its refusals become OpenAIErrors."""
        try:
            return await self.engine.add_request(request_id, prompt, params, name)
        except EngineOverloaded as err:  # shed load: come back later
            raise OpenAIError(
                str(err), 503, type="overloaded_error", headers={"retry-after": "1"}
            ) from None
        except ValueError as err:  # the engine's checks: lengths, vocabulary, pool
            param = "max_tokens" if "max_tokens is" in str(err) else name
            raise OpenAIError(str(err), param=param) from None

    async def respond(
        self, request, raw_request, request_id, params, collector, deadline
    ):
        """The whole answer (no stream), or None if the client left first."""
        created, final, checked = int(time.time()), None, [-math.inf]
        try:
            while final is None or not final.finished:
                if await self.client_left(raw_request, checked):
                    return None
                delta = await collector.get(timeout=self.next_wait(deadline))
                if delta is not None:
                    final = delta if final is None else merge_deltas(final, delta)
        finally:
            if final is None or not final.finished:  # gone, or cancelled
                self.engine.abort(request_id)
        out = final.outputs[0]
        choice = self.choice(request, out, False, {})
        usage = self.usage(final, len(out.token_ids))
        return self.envelope(request_id, created, self.object, [choice], usage=usage)

    async def stream(
        self, request, raw_request, request_id, params, collector, deadline
    ):
        """The answer as server-sent events: chunks, the usage if asked, [DONE]."""
        created, num_generated, finished, state = int(time.time()), 0, False, {}
        checked = [-math.inf]  # when the client was last asked whether it is there
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        extra = {"usage": None} if include_usage else {}
        chunk_object = self.chunk_object
        try:
            if opening := self.opening_choices(request):
                yield sse(
                    self.envelope(request_id, created, chunk_object, opening, **extra)
                )
            while not finished:
                if await self.client_left(raw_request, checked):
                    return
                delta = await collector.get(timeout=self.next_wait(deadline))
                if delta is None:
                    continue
                out, finished = delta.outputs[0], delta.finished
                num_generated += len(out.token_ids)
                if (
                    out.text
                    or finished
                    or (params.logprobs is not None and out.token_ids)
                ):
                    choice = self.choice(request, out, True, state)
                    yield sse(
                        self.envelope(
                            request_id, created, chunk_object, [choice], **extra
                        )
                    )
            if include_usage:
                usage = self.usage(delta, num_generated)
                yield sse(
                    self.envelope(request_id, created, chunk_object, [], usage=usage)
                )
            yield sse("[DONE]")
        except OpenAIError as err:  # past its deadline
            yield sse(err.body())
            yield sse("[DONE]")
        except Exception as err:  # the engine failed this request: say so, end
            error = OpenAIError(
                f"the engine failed: {err!r}", 500, type="internal_server_error"
            )
            yield sse(error.body())
            yield sse("[DONE]")
        finally:
            # the client left (is_disconnected, or CancelledError while sending)
            if not finished:
                self.engine.abort(request_id)


# %% [markdown]
# The two endpoints. A chat choice carries a `message` (or, streamed, a `delta`), and
# its log-probs are a list of `{"token", "logprob", "bytes", "top_logprobs"}`; a
# completion's choice carries `text`, and OpenAI's older log-prob shape of parallel
# lists. A log-prob's token is its text (`" Paris"`), or with vLLM's
# `return_tokens_as_token_ids` its id (`"token_id:7042"`), which is what the tests use
# to compare the server's tokens with `LLM.generate`'s. The chat endpoint first,
# folded: it renders the messages, then builds each choice.

# %% tags=["hide-input"]
#| export entrypoints.openai.serving_chat
from tinyvllm_lib.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from tinyvllm_lib.entrypoints.openai.serving import OpenAIServing, finite


class OpenAIServingChat(OpenAIServing):
    """POST /v1/chat/completions (vLLM's OpenAIServingChat)."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    async def engine_inputs(self, request: ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise OpenAIError(
                f"`{self.served_model_name}` has no chat template: use /v1/completions",
                param="messages",
            )
        k = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens
        max_tokens = request.max_tokens if max_tokens is None else max_tokens
        params = request.sampling_params(max_tokens, k, "top_logprobs")
        messages = [m.for_template(i) for i, m in enumerate(request.messages)]
        # the template and the tokenizer run on the worker threads
        prompt = await self.prompts.from_messages(
            messages, request.add_generation_prompt
        )
        return prompt, params, "messages"

    def opening_choices(self, request) -> list[dict]:
        delta = {"role": "assistant", "content": ""}
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]

    def choice(self, request, out, stream: bool, state: dict) -> dict:
        if stream:
            key, message = "delta", ({"content": out.text} if out.text else {})
        else:
            key, message = "message", {"role": "assistant", "content": out.text}
        logprobs = None
        if request.logprobs:
            steps = zip(out.token_ids, out.logprobs)
            logprobs = {"content": [self.logprob(i, s, request) for i, s in steps]}
        return {
            "index": 0,
            key: message,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }

    def logprob(self, token_id: int, step: dict, request) -> dict:
        """One token's entry: its log-prob and the top_logprobs best."""
        as_ids, k = request.return_tokens_as_token_ids, request.top_logprobs or 0

        def entry(i, logprob):
            token = self.token(i, as_ids)
            return {
                "token": token,
                "logprob": finite(logprob),
                "bytes": list(token.encode()),
            }

        best = sorted(step.items(), key=lambda item: -item[1])[:k]
        top = [entry(i, lp) for i, lp in best]
        return entry(token_id, step[token_id]) | {"top_logprobs": top}


# %% [markdown]
# Then the completion endpoint, folded too: its prompt is text or token ids, and its
# choice carries `text` and the older log-prob lists.

# %% tags=["hide-input"]
#| export entrypoints.openai.serving_completion
from tinyvllm_lib.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from tinyvllm_lib.entrypoints.openai.serving import OpenAIServing, finite

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a completion


class OpenAIServingCompletion(OpenAIServing):
    """POST /v1/completions (vLLM's OpenAIServingCompletion), one prompt a request."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    async def engine_inputs(self, request: CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise OpenAIError(
                    f"this server takes one prompt per request, got {len(prompt)}",
                    param="prompt",
                )
            prompt = prompt[0]
        max_tokens = request.max_tokens
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        params = request.sampling_params(max_tokens, request.logprobs, "logprobs")
        if isinstance(prompt, str):  # tokenized on the worker threads
            return await self.prompts.from_text(prompt, "prompt"), params, "prompt"
        self.prompts.check_length(len(prompt), "prompt")  # token ids
        return prompt, params, "prompt"

    def choice(self, request, out, stream: bool, state: dict) -> dict:
        logprobs = None
        if request.logprobs is not None:
            as_ids = request.return_tokens_as_token_ids
            tokens = [self.token(i, as_ids) for i in out.token_ids]
            offsets = []
            for token in tokens:  # where each token starts in the generated text
                offsets.append(state.get("offset", 0))
                state["offset"] = offsets[-1] + len(token)
            steps = list(zip(out.token_ids, out.logprobs))
            logprobs = {
                "tokens": tokens,
                "token_logprobs": [finite(s[i]) for i, s in steps],
                "top_logprobs": [
                    {self.token(j, as_ids): finite(lp) for j, lp in s.items()}
                    for _, s in steps
                ],
                "text_offset": offsets,
            }
        return {
            "index": 0,
            "text": out.text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }


# %% [markdown]
# **Limits.** A server open to many clients protects them from one another with
# three limits, each a flag of `serve`:
#
# - the **body size** (`--max-body-bytes`, 8 MiB unless told): a larger body gets 413
#   before it is read — at once when its `Content-Length` says so, else as soon as the
#   pieces of a chunked body pass the limit; what the client still sends, uvicorn
#   throws away. A small ASGI middleware in front of the application does it, since
#   FastAPI reads a whole body before a handler runs (FastAPI's own `max_body_size`
#   answers a long `Content-Length` in plain text, not in OpenAI's JSON);
# - the **waiting requests** (`--max-waiting`): past it a new request gets 503 with a
#   `Retry-After` header, as servers shed load — a quick "not now" rather than a wait
#   that nobody can bound. The engine thread counts its waiting queue when the request
#   reaches it;
# - the **time per request** (`--request-timeout`, seconds): past it the request is
#   aborted, and its client gets 504 (a stream gets the error as an event, then
#   `[DONE]`).

# %% tags=["hide-input"]
#| export entrypoints.openai.body_limit
import json

from tinyvllm_lib.entrypoints.openai.protocol import OpenAIError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """ASGI middleware: a request body over max_bytes gets 413 and OpenAI's error JSON
    without being read (by its Content-Length, or as its pieces come).
    """

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.refuse(send)
        state = {"received": 0, "over": False, "started": False}

        async def counting_receive():
            message = await receive()
            state["received"] += len(message.get("body", b""))
            if state["received"] > self.max_bytes:
                state["over"] = True
                raise BodyTooLarge()  # the application gives up on the body
            return message

        async def send_unless_over(message):
            if not state["over"]:  # what the application answers after it: dropped
                state["started"] = True
                await send(message)

        try:
            await self.app(scope, counting_receive, send_unless_over)
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await self.refuse(send)

    async def refuse(self, send) -> None:
        message = f"the request body is over the server's {self.max_bytes} bytes"
        body = json.dumps(OpenAIError(message, 413).body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# %% [markdown]
# And the application: the routes, the error handlers, and a *lifespan* that starts the
# engine thread when the server starts and stops it when the server stops. The
# Prometheus registry is the server's own (not `prometheus_client`'s global one), so
# that two servers in one process — the tests start several — count apart. The last
# folded cell of the server: `build_app` and its `answer` handler.

# %% tags=["hide-input"]
#| export
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from tinyvllm_lib.engine.async_llm_engine import AsyncLLMEngine
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.metrics import PrometheusStatLogger
from tinyvllm_lib.entrypoints.openai.body_limit import (
    DEFAULT_MAX_BODY_BYTES,
    BodySizeLimit,
)
from tinyvllm_lib.entrypoints.openai.prompts import PromptProcessor
from tinyvllm_lib.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from tinyvllm_lib.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm_lib.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("tinyvllm.server")


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict"}


def is_field(part) -> bool:
    """A part of an error's location that is a field or an index, not the label of
    a union's member (str, list[int], function-after[...], ContentPart).
    """
    if isinstance(part, int):
        return True
    return part.isidentifier() and part.islower() and part not in TYPE_LABELS


def bad_body(err: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 for a body it could not parse, as OpenAI's 400: its deepest
    error (in a union, the member that came closest).
    """
    errors = err.errors()
    if bad_json := [e for e in errors if e.get("type") == "json_invalid"]:
        return OpenAIError(f"the body is not valid JSON: {bad_json[0].get('msg')}")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = first.get("loc", ())[1:]  # after "body"
    where = ".".join(str(part) for part in loc if is_field(part))
    return OpenAIError(f"{where or 'body'}: {first.get('msg')}", param=where or None)


async def answer(serving, request, raw_request: Request):
    try:
        submitted = await serving.submit(request)
        if request.stream:
            events = serving.stream(request, raw_request, *submitted)
            # a client gone before the first chunk never starts the generator, whose
            # finally would abort: the response aborts after it ends, whatever the way
            # (a no-op for a finished request)
            done = BackgroundTask(serving.engine.abort, submitted[0])
            return StreamingResponse(
                events, media_type="text/event-stream", background=done
            )
        body = await serving.respond(request, raw_request, *submitted)
    except OpenAIError:
        raise
    except Exception as err:  # the engine failed this request, or a bug: a 500
        logger.exception("request failed")
        message = f"internal error: {err!r}"
        raise OpenAIError(message, 500, type="internal_server_error") from err
    # no one is there to read a late answer: 499, nginx's "client closed request"
    return Response(status_code=499) if body is None else JSONResponse(body)


def build_app(
    engine: LLMEngine,
    served_model_name: str = "smollm2",
    max_body_bytes: int | None = None,
    max_waiting: int | None = None,
    request_timeout: float | None = None,
) -> FastAPI:
    """An OpenAI-compatible server for engine; its engine thread runs while the app
    is served. The limits are serve's flags (None: the default, or no limit).
    """
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger(registry, served_model_name)
    prompts = PromptProcessor(engine.get_tokenizer(), engine.max_model_len)
    chat = OpenAIServingChat(served_model_name, prompts, request_timeout)
    completion = OpenAIServingCompletion(served_model_name, prompts, request_timeout)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stat_logger.count_from(engine.stats)  # no engine thread yet: ours to read
        app.state.engine = AsyncLLMEngine(engine, [stat_logger], max_waiting)
        chat.engine = completion.engine = app.state.engine
        yield
        app.state.engine.shutdown()
        prompts.shutdown()

    app = FastAPI(title="Tiny vLLM", lifespan=lifespan)
    max_body_bytes = max_body_bytes or DEFAULT_MAX_BODY_BYTES
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_, err: OpenAIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError):
        return error_response(bad_body(err))

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(str(err.detail), err.status_code, type=kind))

    @app.exception_handler(Exception)
    async def server_error(_, err: Exception):  # a bug outside a request's handler
        message = f"internal error: {err!r}"
        return error_response(OpenAIError(message, 500, type="internal_server_error"))

    @app.get("/health")
    async def health():
        if not app.state.engine.is_running:
            raise OpenAIError("the engine loop has stopped", 503, type="unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "tinyvllm",
            "root": str(engine.folder),
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request):
        return await answer(chat, request, raw)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request):
        return await answer(completion, request, raw)

    return app


# %% [markdown]
# ### The server at work
#
# The server starts in the background on a free port of `127.0.0.1`, around the same
# engine. A client needs nothing but HTTP; `httpx` shows the bytes. A whole chat
# answer first:

# %%
from tinyvllm_lib.entrypoints.launcher import ServerThread
from tinyvllm_lib.entrypoints.openai.api_server import build_app

server = ServerThread(build_app(llm.llm_engine, "smollm2")).start()
client = httpx.Client(base_url=server.url, timeout=120)
print("serving at", server.url)
reply = client.post(
    "/v1/chat/completions",
    json={"model": "smollm2", "messages": question, "max_tokens": 16, "temperature": 0},
)
answer_json = reply.json()
print(json.dumps(answer_json, indent=1))
assert reply.status_code == 200
assert "Paris" in answer_json["choices"][0]["message"]["content"]

# %% [markdown]
# The same question streamed, as the bytes arrive:

# %%
events = []
body = {
    "model": "smollm2",
    "messages": question,
    "max_tokens": 16,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}
with client.stream("POST", "/v1/chat/completions", json=body) as response:
    for line in response.iter_lines():
        if line:
            events.append(line)
for line in events[:3] + ["..."] + events[-3:]:
    print(line if len(line) <= 88 else line[:85] + "...")
chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
streamed = "".join(
    c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]
)
assert events[-1] == "data: [DONE]"
assert streamed == answer_json["choices"][0]["message"]["content"]
assert chunks[-1]["usage"] == answer_json["usage"]
prose.glue("ch12_num_chunks", len(chunks))
prose.glue("ch12_chunk_bytes", f"{np.median([len(e) for e in events[1:-2]]):.0f} bytes")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The answer came as {{ch12_num_chunks}} chunks (the opening one with the role, one per
piece of text, the usage), a median of {{ch12_chunk_bytes}} each on the wire.
""")

# %% [markdown]
# Every bad request gets its status and one `error` object, and the server goes on —
# the string that is not Unicode, the prompt whose bytes prove it too long, and the
# body over the limit among them:

# %%
good = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4}
bad_requests = {
    "malformed JSON": ("/v1/completions", b'{"model": "smollm2", "prompt": '),
    "a list, not an object": ("/v1/completions", [1, 2, 3]),
    "no messages": ("/v1/chat/completions", {"model": "smollm2"}),
    "another model": ("/v1/completions", good | {"model": "gpt-4o"}),
    "n = 2": ("/v1/completions", good | {"n": 2}),
    "max_tokens = 0": ("/v1/completions", good | {"max_tokens": 0}),
    "temperature < 0": ("/v1/completions", good | {"temperature": -0.5}),
    "top_p = 1.5": ("/v1/completions", good | {"top_p": 1.5}),
    "prompt too long": ("/v1/completions", good | {"prompt": [42] * 600}),
    "presence_penalty = 3": ("/v1/completions", good | {"presence_penalty": 3.0}),
    "no such route": ("/v1/embeddings", good),
    "a lone surrogate": ("/v1/completions", b'{"prompt": "x \\ud800 y"}'),
    "a 5 MB prompt": ("/v1/completions", good | {"prompt": "hello " * 800_000}),
    "a 9 MB body": ("/v1/completions", b" " * 9_000_000),
}
rows = []
for label, (path, payload) in bad_requests.items():
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code in (400, 404, 413)
    assert set(error) == {"message", "type", "param", "code"}
    rows.append((label, r.status_code, error["param"], error["message"]))
for label, status, param, message in rows:
    print(f"{label:<22} {status}  {str(param):<16} {message[:43]}")
assert client.post("/v1/completions", json=good).status_code == 200

# %% [markdown]
# `/v1/models` names the model; `/metrics` is what a Prometheus server scrapes. The
# counters start when the server starts (the engine's own `EngineStats` count from its
# birth, the demo above included), and the bad requests were refused before the engine
# computed anything. With every answer done, the gauges are back at zero:

# %%
pprint.pp(client.get("/v1/models").json()["data"][0], width=88)
metrics_text = client.get("/metrics").text
for line in metrics_text.splitlines():
    if line.startswith("tinyvllm:") and not any(
        s in line for s in ("_bucket", "_created")
    ):
        print(line.replace('{model_name="smollm2"}', ""))
assert 'tinyvllm:kv_cache_usage_perc{model_name="smollm2"} 0.0' in metrics_text

# %% [markdown]
# ## The `serve` command
#
# `python -m tinyvllm_lib serve` is `vllm serve`: the model (`smollm2` by default, or a
# folder), then where to listen and how big the engine is. It listens on
# `127.0.0.1:8000` unless told otherwise (`--host 0.0.0.0` opens it to the network),
# and `--served-model-name` sets the name clients send as `model`. Then, from another
# terminal:
#
# ```text
# curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#   -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}]}'
# ```
#
# or any OpenAI client, pointed at `http://127.0.0.1:8000/v1` with any API key.

# %% tags=["hide-input"]
#| export cli
import argparse

from tinyvllm_lib.cli_args import add_quantization_argument, engine_kwargs


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2",
        help="a known model name (smollm2, llama-3.2-1b-standin) or a folder",
    )
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0: every interface")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", help="the name clients send as `model` (default: MODEL)"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument(
        "--num-kv-blocks", type=int, help="the KV pool in blocks (default: from memory)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="graphs, no overlap"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="processes the model is split over (chapter 13)")
    add_quantization_argument(parser)  # chapter 15
    parser.add_argument("--log-level", default="info", help="uvicorn's log level")
    parser.add_argument(
        "--max-body-bytes", type=int, help="a larger body gets 413 (default: 8 MiB)"
    )
    parser.add_argument(
        "--max-waiting", type=int, help="past this many waiting requests: 503"
    )
    parser.add_argument(
        "--request-timeout", type=float, help="seconds; past them a request gets 504"
    )


@command(
    "serve",
    "an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, "
    "/v1/models, /health, /metrics",
    _serve_arguments,
)
def serve(args: argparse.Namespace) -> int:
    from tinyvllm_lib.engine.llm_engine import LLMEngine
    from tinyvllm_lib.entrypoints.launcher import serve_http
    from tinyvllm_lib.entrypoints.openai.api_server import build_app

    try:
        engine = LLMEngine(
            args.model,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_kv_blocks,
            **engine_kwargs(args),  # the flags every engine command shares
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    name = args.served_model_name or args.model
    print(
        f"serving {name} ({engine.folder}) on {engine.device}: "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    app = build_app(
        engine,
        name,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        request_timeout=args.request_timeout,
    )
    serve_http(app, args.host, args.port, args.log_level)
    return 0


# %% [markdown]
# ### Under abuse and load
#
# Three programs try the server as an unfriendly world would, on the CPU. A fuzzer
# (`tests/test_serving_fuzz.py`, with [hypothesis](https://hypothesis.readthedocs.io/))
# sends random bodies to both endpoints — any JSON shape, any type in any field, any
# Unicode, sizes up to megabytes — and checks that no answer is a 5xx, none hangs, and
# a good request is answered after each. `bench/ch12_stall_cpu.py` streams one answer
# and meanwhile sends a 5 MB prompt, asking `/health` every 20 ms. And
# `bench/ch12_soak_cpu.py` keeps the server under a mixed load — good requests streamed
# or not, clients that leave mid-answer, bad requests, a few huge ones — then checks
# that nothing was left behind. What the two scripts recorded on this book's CPU:

# %% tags=["hide-input"]
stall, soak = load_records("ch12_stall"), load_records("ch12_soak")


def stall_runs(kind, threads="default"):
    """The stall records of refusals or controls, with OpenBLAS on `threads`."""
    wanted = (kind, threads)
    return [r for r in stall if (r.get("kind"), r.get("blas_threads")) == wanted]


def slowest(records, name):
    return max(r["value"] for r in records if r["name"] == name)


def median_gap(records):
    return np.median([r["median_gap_ms"] for r in records if "median_gap_ms" in r])


figures = {}
if stall_runs("refusal") and stall_runs("refusal", "1"):
    refusals, single = stall_runs("refusal"), stall_runs("refusal", "1")
    controls = stall_runs("control")
    figures["stall_health"] = f"{slowest(refusals, 'health_slowest'):.0f} ms"
    figures["stall_gap"] = f"{slowest(refusals, 'stream_gap_ratio'):.1f}×"
    figures["stall_control"] = f"{slowest(controls, 'stream_gap_ratio'):.1f}×"
    figures["stall_gap_1"] = f"{slowest(single, 'stream_gap_ratio'):.1f}×"
    figures["stall_step"] = f"{median_gap(refusals):.0f} ms"
    figures["stall_step_1"] = f"{median_gap(single):.0f} ms"
    figures["stall_cpu"] = refusals[0]["device"]["name"]
    # the largest gap during a refusal against the control's, and BLAS on one thread
    figures["stall_gap_verdict"] = verdict(
        slowest(controls, "stream_gap_ratio"), slowest(refusals, "stream_gap_ratio"),
        words=("smaller", "larger"),
    )
    # each run's median gap, so that their spread is the noise
    figures["stall_step_verdict"] = verdict(
        [r["median_gap_ms"] for r in refusals if "median_gap_ms" in r],
        [r["median_gap_ms"] for r in single if "median_gap_ms" in r],
        words=("shorter", "longer"),
    )
    figures["stall_gap_1_verdict"] = verdict(
        slowest(refusals, "stream_gap_ratio"), slowest(single, "stream_gap_ratio"),
        words=("smaller", "larger"),
    )
    figures["stall_cpus_sentence"] = (
        "That cost is the CPU's more than the server's: "
        if figures["stall_gap_1_verdict"].startswith("smaller") else ""
    )
if soak:
    figures["soak_requests"] = f"{soak[-1]['value']:,.0f}"
    figures["soak_minutes"] = f"{soak[-1]['seconds'] / 60:.0f} minutes"
    figures["soak_rss"] = f"{soak[-1]['rss_growth_mb']:+.1f} MB"
names = ["stall_health", "stall_gap", "stall_control", "stall_gap_1", "stall_step"]
names += ["stall_step_1", "stall_cpu", "soak_requests", "soak_minutes", "soak_rss"]
names += ["stall_gap_verdict", "stall_step_verdict", "stall_gap_1_verdict"]
names += ["stall_cpus_sentence"]
for name in names:
    prose.glue(f"ch12_{name}", figures.get(name, "(not measured)"))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if not (refusals and soak):
    prose.show("""
The stall and the soak have not been recorded yet: `bench/ch12_stall_cpu.py` and
`bench/ch12_soak_cpu.py` write `book/data/ch12_stall.json` and `ch12_soak.json`.
""")
else:
    prose.show("""
On the {{ch12_stall_cpu}}, `/health` answered within {{ch12_stall_health}} while a 5 MB
prompt was refused (before the tokenizer moved off the engine's thread and let go of
the GIL, it waited seconds). The running stream's largest gap meanwhile was
{{ch12_stall_gap}} its median, where the same stream with nothing refused reached
{{ch12_stall_control}}: {{ch12_stall_gap_verdict}}. {{ch12_stall_cpus_sentence}}with
NumPy's BLAS on one thread instead of two, a step's median gap was {{ch12_stall_step_1}}
against {{ch12_stall_step}} ({{ch12_stall_step_verdict}} over the runs' spread), and the
largest gap during a refusal was {{ch12_stall_gap_1}} its median,
{{ch12_stall_gap_1_verdict}}. On two cores, a step split over two BLAS threads is what
any third busy thread upsets — the server reading a body, or the client sending it.
The soak sent {{ch12_soak_requests}} requests in {{ch12_soak_minutes}}: every good
answer was the same request's alone, none got a 5xx, the gauges came back to zero with
no KV block held, and the resident memory changed by {{ch12_soak_rss}} after the first
minute.
""")



# %% [markdown]
# ## A serving benchmark
#
# Chapter 11's `bench throughput` hands the engine all its requests at once and
# measures how fast they finish: the engine's capacity. A server is judged by its
# clients instead: how long each waits for its first token, how smoothly the rest
# come, how long the whole answer takes — and how those grow as more clients arrive.
# vLLM's `benchmark_serving` measures exactly this, and this section follows it.
#
# **Arrivals.** Clients do not arrive on a schedule. The usual model is a **Poisson
# process** of rate $\lambda$ requests per second: arrivals independent of one another,
# $\lambda$ per second on average. Its gaps are exponentially distributed,
#
# $$P(\text{gap} > t) = e^{-\lambda t}, \qquad \mathbb{E}[\text{gap}] = 1/\lambda,$$
#
# so the benchmark draws gaps with `rng.exponential(1 / rate)` and sends each request
# at its time, without waiting for earlier ones. A rate of infinity sends them all at
# once.
#
# **What each client measures**, streaming its answer:
#
# - **TTFT**, time to first token: from sending the request to the first chunk with
#   text. It includes waiting for admission and computing the prompt.
# - **ITL**, inter-token latency: the gaps between consecutive chunks. A decode step
#   of the whole batch is one gap; a step that also computes a newcomer's prompt is a
#   longer one.
# - **TPOT**, time per output token: (end-to-end latency − TTFT) / (tokens − 1), the
#   average of one request's gaps.
# - **E2E latency**: from sending to the last chunk.
#
# Each is reported as a mean, a median and tail percentiles (p90, p99): a server whose
# median is good but whose p99 is poor serves one client in a hundred badly. The
# workload is vLLM's *random* dataset: prompts of random token ids of one length, and
# `max_tokens` with `ignore_eos`, so that every request does the same work.
#
# The client is folded below: `poisson_arrival_times`, `random_prompts`,
# `send_completion` (one streamed request, timed by the chunks that carry text),
# `run_at_rate` (every prompt sent at its time) and `summarize` (vLLM's report).

# %% tags=["hide-input"]
#| export benchmark_serving
"""A serving benchmark in the manner of vLLM's benchmark_serving: Poisson arrivals,
streamed completions, TTFT / TPOT / ITL / end-to-end latency percentiles.
"""
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from tinyvllm_lib.entrypoints.launcher import run_coroutine


def poisson_arrival_times(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Send times in seconds: the first at 0, then exponential gaps of mean 1/rate (a
    Poisson process); all at 0 for rate = inf.
    """
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1 / rate, num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def random_prompts(
    num_requests: int, input_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """vLLM's random dataset: prompts of input_len random token ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, (num_requests, input_len)).tolist()


@dataclass
class RequestResult:
    """What one client saw (seconds)."""

    ok: bool = False
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


async def send_completion(client, base_url, model, prompt, max_tokens) -> RequestResult:
    """One streamed completion of exactly max_tokens tokens, timed by the chunks that
    carry text (a model without a tokenizer sends none: TTFT reads 0, no ITL gaps).
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result, start, last = RequestResult(), time.perf_counter(), None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = (await r.aread()).decode()[:300]
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[len("data: ") :]), time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as err:
        result.error = repr(err)
        return result
    result.latency, result.ok = time.perf_counter() - start, True
    return result


async def run_at_rate(base_url, model, prompts, max_tokens, rate, seed=0):
    """Every prompt sent at its Poisson time: the results and the seconds it took."""
    arrivals = poisson_arrival_times(len(prompts), rate, seed)
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        start = time.perf_counter()

        async def one(prompt, at):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send_completion(client, base_url, model, prompt, max_tokens)

        results = await asyncio.gather(*map(one, prompts, arrivals))
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], seconds: float) -> dict:
    """vLLM's report: counts, throughputs, and mean / median / p90 / p99 in ms."""
    ok = [r for r in results if r.ok]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [
            (r.latency - r.ttft) / (r.output_tokens - 1)
            for r in ok
            if r.output_tokens > 1
        ],
        "itl": [gap for r in ok for gap in r.itls],
        "e2el": [r.latency for r in ok],
    }
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": seconds,
        "request_throughput": len(ok) / seconds,
        "output_throughput": sum(r.output_tokens for r in ok) / seconds,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
    }
    for name, values in series.items():
        ms = 1e3 * np.asarray(values if values else [np.nan])
        out[f"mean_{name}_ms"] = float(np.mean(ms))
        out[f"median_{name}_ms"] = float(np.median(ms))
        for p in (90, 99):
            out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def benchmark_serving(
    base_url: str, model: str, prompts, max_tokens: int, rates, seed: int = 0
) -> list[dict]:
    """The workload at each request rate, after one warm-up request: one summary
    each.
    """
    run_coroutine(run_at_rate(base_url, model, prompts[:1], 2, math.inf))
    summaries = []
    for rate in rates:
        results, seconds = run_coroutine(
            run_at_rate(base_url, model, prompts, max_tokens, rate, seed)
        )
        summary = summarize(results, seconds)
        summaries.append(
            {
                "request_rate": rate,
                "num_prompts": len(prompts),
                "max_tokens": max_tokens,
            }
            | summary
        )
    return summaries


# %% [markdown]
# A small run here, against the server above — in the same process as it, so the
# client's threads and the server's take turns with the engine's at one interpreter
# lock. Its numbers say what this machine did, not what a server can do:

# %%
from tinyvllm_lib.benchmark_serving import benchmark_serving, random_prompts

live_prompts = random_prompts(8, 32, llm.config.vocab_size, seed=1)
live = benchmark_serving(server.url, "smollm2", live_prompts, 16, rates=[2.0, math.inf])
print(f"{'rate':>5} {'ok':>3} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
      f"{'E2E p50':>8} {'tok/s':>6}")  # fmt: skip
for s in live:
    print(
        f"{s['request_rate']:>5} {s['completed']:>3} {s['median_ttft_ms']:>7.0f}ms "
        f"{s['p99_ttft_ms']:>5.0f}ms {s['median_itl_ms']:>6.0f}ms "
        f"{s['p99_itl_ms']:>5.0f}ms {s['median_e2el_ms']:>6.0f}ms "
        f"{s['output_throughput']:>6.1f}"
    )
assert all(s["completed"] == len(live_prompts) and s["failed"] == 0 for s in live)
client.close()
server.stop()

# %% [markdown]
# ### Recorded runs
#
# `bench/ch12_serving.py` runs the benchmark properly: the server in a process of its
# own (`python -m tinyvllm_lib serve`), the client in another, a sweep of request rates,
# and a record per rate and measure in `book/data/ch12_serving.json`, each naming the
# engine's commit and mode. Before the first rate it warms the server up with a few
# requests of the workload's own shape, run to their end, and each rate gets fresh
# prompts, so that no rate finds another's in the prefix cache. On a machine with no
# GPU it serves SmolLM2 with the NumPy backend; on a GPU, the Llama 3.2 1B stand-in.
# The figure has one row per device recorded so far, its workload in the row's title;
# the throughput panel draws the load the clients offered (request rate × output
# tokens a request) beside what the server made.

# %% tags=["hide-input"]
records = load_records("ch12_serving")
by_device = {}
for r in records:
    by_device.setdefault(r["device"]["name"], []).append(r)
MEASURES = ["ttft", "itl", "e2el", "output_throughput"]
YLABELS = ["time to first token (ms)", "inter-token latency (ms)",
           "end-to-end latency (ms)", "output tokens/s"]  # fmt: skip
MODEL_NAMES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "llama-3.2-1b-standin": "Llama 3.2 1B stand-in (random weights)",
}
# what the paragraph below quotes of each device's sweep
SWEEP_KEYS = ("name", "date", "load", "model", "work", "engine", "rates", "rate_low",
              "asked_low", "ttft_low", "ttft_high", "ttft99_high", "itl_low",
              "itl_high", "itl99_high", "tput_low", "tput_high", "itl_growth",
              "itl_change", "tput_change", "prompts_note")  # fmt: skip


def sweep(rs, name, key="value"):
    """(rates, values) of one measure over a device's recorded rates, in order."""
    rows = sorted((r for r in rs if r["name"] == name),
                  key=lambda r: float(r["request_rate"]))  # fmt: skip
    return [float(r["request_rate"]) for r in rows], [r[key] for r in rows]


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def engine_of(r: dict) -> str:
    """The engine's commit and mode as a record names them (older records do not)."""
    if r.get("engine_commit") is None and r.get("mode") is None:
        return "engine commit and mode not recorded"
    return f"engine `{r.get('engine_commit') or 'unknown'}`, {r.get('mode', '')}"


def glue_device(prefix: str, rs: list) -> None:
    """The numbers the paragraph below quotes for one device's sweep."""
    first = next(r for r in rs if r["name"] == "ttft")
    rates, ttft = sweep(rs, "ttft")
    _, ttft99 = sweep(rs, "ttft", "p99")
    _, itl = sweep(rs, "itl")
    _, itl99 = sweep(rs, "itl", "p99")
    _, tput = sweep(rs, "output_throughput")
    values = {
        "name": first["device"]["name"],
        "date": first["date"],
        # other work on the machine when the sweep began (its cores are few)
        "load": f"{first.get('load_average', float('nan')):.1f}",
        "model": MODEL_NAMES.get(first["model"], first["model"]),
        "work": f"{first['num_prompts']} requests of {first['input_len']} prompt "
        f"tokens and {first['max_tokens']} output tokens",
        "engine": engine_of(first),
        "rates": ", ".join(map(rate_label, rates)),
        "rate_low": rate_label(rates[0]),
        "asked_low": f"{rates[0] * first['max_tokens']:,.0f}",
        "ttft_low": f"{ttft[0]:,.0f} ms",
        "ttft_high": f"{ttft[-1]:,.0f} ms",
        "ttft99_high": f"{ttft99[-1]:,.0f} ms",
        "itl_low": f"{itl[0]:,.1f} ms",
        "itl_high": f"{itl[-1]:,.1f} ms",
        "itl99_high": f"{itl99[-1]:,.0f} ms",
        "tput_low": f"{tput[0]:,.0f} output tokens/s",
        "tput_high": f"{tput[-1]:,.0f}",
        # the median gap all at once over the median gap at the lowest rate
        "itl_growth": f"{itl[-1] / itl[0]:.1f}",
        "itl_change": verdict(itl[0], itl[-1], words=("shorter", "longer")),
        "tput_change": verdict(
            tput[0], tput[-1], higher_is_better=True, words=("higher", "lower")
        ),
        # records without `prompts` come from a benchmark that reused one prompt set
        "prompts_note": "" if "prompts" in first else "This sweep's rates shared one "
        "set of prompts, so from the second rate on a prompt could be found in the "
        "prefix cache, which shortens its first token; the benchmark now draws fresh "
        "prompts for every rate.",
    }
    for key, value in values.items():
        prose.glue(f"{prefix}_{key}", value)


cpu = {d: rs for d, rs in by_device.items() if rs[0]["device"].get("kind") == "cpu"}
gpu = {d: rs for d, rs in by_device.items() if d not in cpu}
missing = "(not yet measured)"
for prefix, found in (("ch12_cpu", cpu), ("ch12_gpu", gpu)):
    if found:
        glue_device(prefix, next(iter(found.values())))
    else:
        for key in SWEEP_KEYS:
            prose.glue(f"{prefix}_{key}", missing)
if cpu:
    # the trade, where the CPU's sweep shows it: more tokens a step, each step longer
    more = prose.values["ch12_cpu_tput_change"].startswith("higher")
    longer = prose.values["ch12_cpu_itl_change"].startswith("longer")
    prose.glue("ch12_trade_sentence", "That is the trade every server makes: more "
               "clients at once fill the batch, so each step makes more tokens, and "
               "each step, computing more rows and newcomers' prompts, takes longer "
               "for everyone in it." if more and longer else "")  # fmt: skip
else:
    prose.glue("ch12_trade_sentence", "")
if gpu and cpu:
    cpu_rs, gpu_rs = next(iter(cpu.values())), next(iter(gpu.values()))
    cpu_growth = sweep(cpu_rs, "itl")[1][-1] / sweep(cpu_rs, "itl")[1][0]
    gpu_growth = sweep(gpu_rs, "itl")[1][-1] / sweep(gpu_rs, "itl")[1][0]
    growth = verdict(cpu_growth, gpu_growth, words=("smaller", "larger"))
    prose.glue("ch12_growth_verdict", growth)
    prose.glue("ch12_cpu_clients", f"{cpu_rs[0]['num_prompts']}")
    prose.glue("ch12_gpu_clients", f"{gpu_rs[0]['num_prompts']}")
    prose.glue("ch12_cpu_prompt", f"{cpu_rs[0]['input_len']}")
    prose.glue("ch12_gpu_prompt", f"{gpu_rs[0]['input_len']}")

    def most_rows(r):  # rows a step can hold with every request sent at once
        return min(r["num_prompts"], r["max_num_seqs"])

    rows_times = most_rows(gpu_rs[0]) / most_rows(cpu_rs[0])
    prose.glue("ch12_rows_times", f"{rows_times:g}")
    prompt_times = gpu_rs[0]["input_len"] / cpu_rs[0]["input_len"]
    prose.glue("ch12_prompt_times", f"{prompt_times:g}")
    prose.glue("ch12_growth_sentence", prose.fill("""From the lowest rate to all at
once the median gap went from {{ch12_cpu_itl_low}} to {{ch12_cpu_itl_high}} on the CPU
({{ch12_cpu_itl_growth}}×) and from {{ch12_gpu_itl_low}} to {{ch12_gpu_itl_high}} on the
GPU ({{ch12_gpu_itl_growth}}×): the GPU's growth is {{ch12_growth_verdict}} than the
CPU's. The two sweeps are not alike: the GPU's sends {{ch12_gpu_clients}} requests of
{{ch12_gpu_prompt}} prompt tokens, the CPU's {{ch12_cpu_clients}} of
{{ch12_cpu_prompt}}, so all at once the GPU's steps carry {{ch12_rows_times}} times the
rows and prompts {{ch12_prompt_times}} times as long to prefill between decode steps.
The records do not separate those causes."""))
else:
    prose.glue("ch12_growth_sentence", "")
# the sweep's worst tail of first tokens, p99 against the median, and what the record
# can say of it: it keeps the mean, median, p90 and p99, not each request's time
spike = None
for rs in by_device.values():
    for r in (r for r in rs if r["name"] == "ttft"):
        if spike is None or r["p99"] / r["value"] > spike["p99"] / spike["value"]:
            spike = r
if spike is not None and spike["p99"] > 10 * spike["value"]:
    n = spike["num_prompts"]
    rates_in_order = sweep(by_device[spike["device"]["name"]], "ttft")[0]
    # np.percentile interpolates at 0.99 (n - 1): every request past that index waited
    # at least the p99
    prose.glue("ch12_spike_at_least", f"{n - 1 - math.floor(0.99 * (n - 1))}")
    prose.glue("ch12_spike_device", spike["device"]["name"])
    prose.glue("ch12_spike_rate", rate_label(float(spike["request_rate"])))
    prose.glue("ch12_spike_p99", f"{spike['p99']:,.0f} ms")
    prose.glue("ch12_spike_median", f"{spike['value']:,.0f} ms")
    prose.glue("ch12_spike_p90", f"{spike['p90']:,.0f} ms")
    prose.glue("ch12_spike_mean", f"{spike['mean']:,.0f} ms")
    prose.glue("ch12_spike_n", f"{n}")
    prose.glue("ch12_spike_times", f"{spike['p99'] / spike['value']:.0f}")
    is_first = float(spike["request_rate"]) == rates_in_order[0]
    if "warmup_requests" not in spike:
        # recorded before bench/ch12_serving.py warmed the server with the workload
        prose.glue("ch12_spike_order", "This rate was the sweep's first, so its tail "
                   "may hold first-use costs that such a warm-up would have paid (the "
                   "first prompts of this length, the first batches of these sizes)."
                   if is_first else "This rate was not the sweep's first, so "
                   "first-use costs alone would not explain it.")  # fmt: skip
        prose.glue("ch12_spike_why", prose.fill("""This sweep was measured before the
benchmark warmed the server up with requests of the workload's own shape (its records
carry no `warmup_requests`): besides the engine's start-up warm-up, the server had
answered one request of two tokens before the first rate. {{ch12_spike_order}} The
record keeps no request's own time, so it cannot tell; a run of today's
`bench/ch12_serving.py`, which warms the server up first, can."""))
    else:
        prose.glue("ch12_spike_warm_n", f"{spike['warmup_requests']}")
        prose.glue("ch12_spike_warm_p99", f"{spike['warmup_p99_ttft_ms']:,.0f} ms")
        prose.glue("ch12_spike_why", prose.fill(f"""The sweep began after a warm-up of
{{{{ch12_spike_warm_n}}}} requests of the workload's own shape, finished before the
first rate (their own p99 first token: {{{{ch12_spike_warm_p99}}}}), and this rate is
{"" if is_first else "not "}the sweep's first; so the tail is not the server's first
use, and the record, which keeps no request's own time, cannot say more of it."""))
    prose.glue("ch12_spike_sentence", prose.fill("""On the {{ch12_spike_device}} at
{{ch12_spike_rate}} requests/s, the p99 first token ({{ch12_spike_p99}}) is
{{ch12_spike_times}} times the median ({{ch12_spike_median}}); the p90 is
{{ch12_spike_p90}} and the mean {{ch12_spike_mean}}. At least {{ch12_spike_at_least}}
of the {{ch12_spike_n}} requests waited {{ch12_spike_p99}} or more.
{{ch12_spike_why}}"""))
else:
    prose.glue("ch12_spike_sentence", "")
if gpu:
    prose.glue("ch12_gpu_sentence", prose.fill("""
On the {{ch12_gpu_name}} ({{ch12_gpu_date}}, {{ch12_gpu_engine}}), {{ch12_gpu_model}}
served {{ch12_gpu_work}} at {{ch12_gpu_rates}} requests per second: at
{{ch12_gpu_rate_low}} per second a median first token after {{ch12_gpu_ttft_low}} and a
median gap of {{ch12_gpu_itl_low}}; all at once, {{ch12_gpu_ttft_high}} and
{{ch12_gpu_itl_high}}, and {{ch12_gpu_tput_high}} output tokens/s.
{{ch12_gpu_prompts_note}}
"""))  # fmt: skip
    # the engine's own decode step (chapter 11) against the gaps seen: the smallest
    # recorded replay with at least the run's rows bounds the GPU's part of a step
    replay = [r for r in load_records("ch11_llama") if r["name"] == "graph_replay"]
    _, gpu_itl = sweep(next(iter(gpu.values())), "itl")
    first = next(iter(gpu.values()))[0]
    rows = min(first["num_prompts"], first["max_num_seqs"])  # all sent at once
    above = [r for r in replay if r["shape"][0] >= rows]
    if above:
        hi = min(above, key=lambda r: r["shape"][0])
        prose.glue("ch12_run_rows", f"{rows}")
        prose.glue("ch12_replay_hi", f"{hi['value']:.1f} ms")
        prose.glue("ch12_replay_hi_rows", f"{hi['shape'][0]}")
        prose.glue("ch12_replay_ctx", f"{hi.get('context', 'unrecorded')}")
        prose.glue("ch12_itl_over_hi", f"{gpu_itl[-1] / hi['value']:.0f}")
        prose.glue("ch12_replay_bound", "" if hi["shape"][0] == rows else
                   f" (more rows than the run's {rows}: a bound on its step)")
        prose.glue("ch12_gpu_sentence", prose.fill("""{{ch12_gpu_sentence}} With every
request sent at once a decode step holds up to {{ch12_run_rows}} rows; on the same GPU
(chapter 11) a replayed decode step at {{ch12_replay_ctx}} tokens of context takes
{{ch12_replay_hi}} at {{ch12_replay_hi_rows}} rows{{ch12_replay_bound}}, so the median
gap between a client's tokens is at least {{ch12_itl_over_hi}} times the GPU's part of
a decode step (the gap also spans the steps that prefill newcomers' prompts). The rest
is the engine's host work per step (chapter 11 times it) and the server's; the next
section weighs the server's part against the engine alone, in the same run.
"""))  # fmt: skip
else:
    prose.glue("ch12_gpu_sentence", "No GPU record has been made yet: no GPU has run "
               "`bench/ch12_serving.py` for this copy of the book.")  # fmt: skip

if by_device:
    # one row of panels per device, its workload in the row's title
    fig = plt.figure(figsize=(12, 3.1 * len(by_device) + 0.3), layout="constrained")
    rows = np.atleast_1d(fig.subfigures(len(by_device), 1))
    axes = np.array([sf.subplots(1, 4) for sf in rows])
    for subfig, row, (device, rs) in zip(rows, axes, by_device.items()):
        head = next(r for r in rs if r["name"] == "ttft")
        rates = sweep(rs, "ttft")[0]
        finite_rates = [r for r in rates if not math.isinf(r)]
        inf_at = 2 * max(finite_rates, default=1)  # where "all at once" is drawn

        def xs(rr):
            return [inf_at if math.isinf(r) else r for r in rr]

        for ax, name, ylabel in zip(row, MEASURES, YLABELS):
            rr, median = sweep(rs, name)
            ax.plot(xs(rr), median, "o-", color="#1f77b4", label="median")
            if name != "output_throughput":
                ax.plot(xs(rr), sweep(rs, name, "p99")[1], "s--", color="#ff7f0e",
                        alpha=0.8, label="p99")  # fmt: skip
            else:  # the load offered: requests/s × output tokens a request
                ax.plot(finite_rates, [r * head["max_tokens"] for r in finite_rates],
                        ":", color="#7f7f7f",
                        label="offered load (rate × output tokens)")  # fmt: skip
                offline = [r for r in rs if r["name"] == "offline_throughput"]
                if offline:
                    ax.axhline(offline[-1]["value"], color="#2ca02c", ls="-.", lw=1,
                               label="engine alone, same run")  # fmt: skip
            ax.set_xscale("log")
            ax.set_xticks(xs(rates), [rate_label(r) for r in rates])
            ax.minorticks_off()
            values = median + (sweep(rs, name, "p99")[1] if name != "output_throughput"
                               else [])  # fmt: skip
            if max(values) > 5 * min(values):  # a log scale where the range is wide
                ax.set_yscale("log")
                plain_log_ticks(ax)
            ax.set_xlabel("request rate (requests/s)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(which="both", labelsize=7)
            ax.spines[["top", "right"]].set_visible(False)
        when = "" if "warmup_requests" in head else "; before the workload's warm-up"
        subfig.suptitle(
            f"{device}: {MODEL_NAMES.get(head['model'], head['model'])}, "
            f"{head['num_prompts']} prompts of {head['input_len']} tokens in, "
            f"{head['max_tokens']} out ({head['date']}{when})",
            fontsize=9,
        )
    # one legend for every panel, outside them, so no line hides behind it
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=4,
               fontsize=8, frameon=False)  # fmt: skip
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
The CPU's record ({{ch12_cpu_name}}, {{ch12_cpu_date}}, load average {{ch12_cpu_load}}
when it began; {{ch12_cpu_engine}}): {{ch12_cpu_model}} served {{ch12_cpu_work}} at
request rates of {{ch12_cpu_rates}} per second. At a rate of {{ch12_cpu_rate_low}} per
second the median first token came after {{ch12_cpu_ttft_low}} and the median gap
between tokens was {{ch12_cpu_itl_low}}, and the server made {{ch12_cpu_tput_low}},
against the {{ch12_cpu_asked_low}} output tokens/s the clients asked for (the last
answers end after the last arrival). With every request sent at once, the median first
token waited {{ch12_cpu_ttft_high}} (p99 {{ch12_cpu_ttft99_high}}): the scheduler
computes the prompts first, in as few steps as its token budget allows, before
anyone's second token. The median gap was then {{ch12_cpu_itl_high}} (p99
{{ch12_cpu_itl99_high}}), {{ch12_cpu_itl_change}}, and the server made
{{ch12_cpu_tput_high}} output tokens/s, {{ch12_cpu_tput_change}}.
{{ch12_cpu_prompts_note}}
{{ch12_trade_sentence}} {{ch12_growth_sentence}}

{{ch12_gpu_sentence}}

{{ch12_spike_sentence}}
""")


# %% [markdown]
# ### What the server costs
#
# Count before measuring. Per token, the engine thread makes one delta per request, and
# the event loop turns it into one chunk: a `json.dumps` of the envelope, a few hundred
# bytes, written to a socket. How long does making one chunk take here, and what share
# of one core would it be at the rate the engine alone makes tokens?
# `bench/ch12_serving.py` measures that rate in the same run as the sweep, on the same
# machine: after the
# server stops, it builds an `LLM` with the server's engine settings and times
# `LLM.generate` on the all-at-once rate's prompts (the median of a few runs, each on an
# empty prefix cache). The server's rate all at once against it is what the server
# costs.

# %% tags=["hide-input"]
from tinyvllm_lib.entrypoints.openai.serving import sse

sample = chunks[2]
seconds_per_chunk = (
    min(timeit.repeat(lambda: sse(sample), number=2000, repeat=5)) / 2000
)
prose.glue("ch12_chunk_us", f"{seconds_per_chunk * 1e6:.1f} µs")
print(f"one chunk: {seconds_per_chunk * 1e6:.1f} us to serialise")


def same_run_pair(rs: list):
    """(offline record, served record at the offline prompts' rate) of one run, or
    None where the run measured no offline throughput.
    """
    offline = [r for r in rs if r["name"] == "offline_throughput"]
    if not offline:
        return None
    off = offline[-1]
    served = [
        r
        for r in rs
        if r["name"] == "output_throughput"
        and float(r["request_rate"]) == float(off["prompts_of_rate"])
        and (r["command"], r["date"]) == (off["command"], off["date"])
    ]
    return (off, served[-1]) if served else None


cost_sentences = []
for prefix, found in (("ch12_gcost", gpu), ("ch12_ccost", cpu)):
    if not found:
        continue
    rs = next(iter(found.values()))
    pair = same_run_pair(rs)
    prose.glue(f"{prefix}_name", rs[0]["device"]["name"])
    if pair is None:
        cost_sentences.append(prose.fill(f"""On the {{{{{prefix}_name}}}} the figure is
not recorded yet: its sweep predates the offline run that `bench/ch12_serving.py` now
makes beside it, so there is no same-run rate of the engine alone to weigh the server
against."""))
        continue
    off, served = pair
    off_us = [1e6 / x for x in off.get("runs", [off["value"]])]  # per token, each run
    served_us = 1e6 / served["value"]
    prose.glue(f"{prefix}_engine", engine_of(off))
    prose.glue(f"{prefix}_rate", rate_label(float(off["prompts_of_rate"])))
    prose.glue(f"{prefix}_offline", f"{off['value']:,.0f} tokens/s")
    prose.glue(f"{prefix}_served", f"{served['value']:,.0f} tokens/s")
    prose.glue(f"{prefix}_share", f"{served['value'] / off['value']:.0%}")
    prose.glue(f"{prefix}_off_us", f"{float(np.median(off_us)):,.1f} µs")
    prose.glue(f"{prefix}_served_us", f"{served_us:,.1f} µs")
    more = verdict(off_us, served_us, words=("less", "more"))
    prose.glue(f"{prefix}_verdict", more)
    prose.glue(f"{prefix}_diff", f"{served_us - float(np.median(off_us)):,.1f} µs")
    prose.glue(f"{prefix}_cost", prose.fill(f"""the server's cost here is
{{{{{prefix}_diff}}}} of wall time a token""") if more.startswith("more") else
               "the server cost nothing the noise can show")  # fmt: skip
    prose.glue(f"{prefix}_core", f"{off['value'] * seconds_per_chunk:.0%}")
    cost_sentences.append(prose.fill(f"""On the {{{{{prefix}_name}}}}
({{{{{prefix}_engine}}}}), the engine alone made {{{{{prefix}_offline}}}} through
`LLM.generate`, and the server, with the same prompts sent all at once, made
{{{{{prefix}_served}}}}: {{{{{prefix}_share}}}} of the engine's rate. In wall time per
output token, {{{{{prefix}_served_us}}}} against {{{{{prefix}_off_us}}}}, that is
{{{{{prefix}_verdict}}}}: {{{{{prefix}_cost}}}}. At the engine's rate, one chunk a
token would take {{{{{prefix}_core}}}} of one core of this machine for `json.dumps`
alone."""))
if not cost_sentences:
    cost_sentences.append("No serving record yet: run `bench/ch12_serving.py`.")
prose.glue("ch12_cost_sentences", "\n\n".join(cost_sentences))

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
Serialising one chunk takes {{ch12_chunk_us}} on this machine.

{{ch12_cost_sentences}}

The chunk is not all of it: there are the HTTP framing, the socket writes and the
pydantic parsing of the requests too. This is why vLLM moved its server to a process of
its own, apart from the engine's: in one Python process the event loop and the engine
thread take turns at one interpreter lock, and the server's work grows with the token
rate.
""")


# %% [markdown]
# ### One client, and the engine alone
#
# The plainest load of all is one client streaming one long answer. The engine then
# runs a batch of one, and the client should see the engine's own speed: whatever the
# server adds between two tokens is all that separates them. On a GPU that margin is
# thin: chapter 11's batch-1 decode step of the 1B model is short, and a server that
# spends as long again per token of its own halves what the client gets.
#
# `bench/ch12_lone_client.py` measures this case alone. The same prompt of 128 random
# token ids and 256 new tokens (end-of-sequence ignored), greedy and with temperature
# 0.6 and top-p 0.9, first **offline** — the engine stepped in a loop, as chapter 11's
# `bench latency` does — and then from **one client** streaming `/v1/completions` from
# `serve` in a process of its own; both engines have the same settings, serve's
# defaults (`max_num_seqs` 256, `max_model_len` 4096). It records the decode rate of
# each (the tokens after the first over the time after the first), the gaps between
# chunks, and the CPU time per token of the server's two threads, each record under
# the engine's git commit.
#
# The first runs were far apart (the CPU's, with a tiny model whose NumPy step takes
# about as long as the GPU's, are recorded below; the H200's first run was not kept).
# Where did the time go? A profile of the engine thread (`cProfile` around its loop, on
# the CPU) answered at once: not in the step, not in the event loop's hand-off, but in
# **`engine.stats`**, which the thread reads after every step for the metrics. Its
# `kv_blocks_cached` was a count of the free blocks that still hold a cached prefix — a
# Python loop over the whole free list. With one client almost every block is free,
# and serve's pool for the 1B model is as large as its `max_num_seqs` sequences of
# `max_model_len` tokens need:

# %%
from tinyvllm_lib.engine.block_manager import BlockManager

# serve's pool for the 1B model on an H200: 256 sequences of 4096 tokens, 16 a block
pool = BlockManager(256 * 4096 // 16)
pass_s = min(timeit.repeat(  # the count as it was: one look at every free block
    lambda: sum(pool.blocks[i].block_hash is not None for i in pool.free_queue),
    number=3, repeat=3,
)) / 3  # fmt: skip
count_s = min(
    timeit.repeat(lambda: pool.num_cached_free_blocks, number=10_000, repeat=3)
) / 10_000
prose.glue("ch12_pool_blocks", f"{pool.num_blocks:,}")
prose.glue("ch12_pass_ms", f"{pass_s * 1e3:.1f} ms")
prose.glue("ch12_count_us", f"{count_s * 1e6:.2f} µs")
bs1_step = [r for r in load_records("ch11_llama") if r["name"] == "bs1_graph_replay"]
prose.glue(
    "ch12_bs1_step",
    f"{bs1_step[-1]['value']:.2f} ms" if bs1_step else "(not yet measured)",
)
print(f"a pass over {pool.num_blocks:,} free blocks: {pass_s * 1e3:.2f} ms; "
      f"the count kept: {count_s * 1e6:.2f} us")  # fmt: skip

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show("""
With {{ch12_pool_blocks}} free blocks the pass takes {{ch12_pass_ms}} on this machine,
every step — against a GPU step of {{ch12_bs1_step}} at batch 1 (chapter 11's batch-1
graph replayed back to back). And `/metrics` does not even export that count. The fix
belongs to the block manager, not to the server: it now keeps the count as blocks come
and go — one more or one fewer when a freed block still holds a cached prefix, when a
cached free block is taken back by a prefix hit or evicted for a fresh one, and zero
when the cache is reset — and reading it takes {{ch12_count_us}}. The block manager's
state-machine test checks the kept count against the pass after every operation.

Two smaller costs were in the handler. It asked `is_disconnected()` before every
chunk, a round through Starlette and anyio's cancel scopes each time; it now asks when
it starts and then at most every half second (Starlette's own listener, or the failed
write, still notices a client that leaves while tokens flow). And the collector waited
with `asyncio.wait_for`, which wraps the wait in a new task every token; an
`asyncio.timeout` block waits without one.
""")

# %% tags=["hide-input"]
LONE_SETTINGS = {"greedy": "greedy", "t0.6_p0.9": "temperature 0.6, top-p 0.9"}
LONE_LABELS = {"before": "before", "counted free blocks": "count kept",
               "after": "after"}  # fmt: skip
lone = load_records("ch12_lone_client")
lone_by_device = {}
for r in lone:
    lone_by_device.setdefault(r["device"]["name"], []).append(r)


def lone_runs(rs: list) -> dict:
    """{label: {record name: {setting: record}}}, each label's latest run."""
    out = {}
    for r in sorted(rs, key=lambda r: r["date"]):
        out.setdefault(r["label"], {}).setdefault(r["name"], {})[r["setting"]] = r
    return out


def glue_lone(prefix: str, rs: list) -> None:
    """The numbers the paragraph below quotes for one device's runs."""
    runs, first = lone_runs(rs), rs[0]
    prose.glue(f"{prefix}_name", first["device"]["name"])
    prose.glue(f"{prefix}_model", first["model"])
    for label, key in (("before", "before"), ("after", "after")):
        run = runs.get(label)
        date = max(r["date"] for r in rs if r["label"] == label) if run else "-"
        prose.glue(f"{prefix}_{key}_date", date)
        commit = run["http_decode"]["greedy"]["engine_commit"][:7] if run else "-"
        prose.glue(f"{prefix}_{key}_commit", f"`{commit}`")
        for setting in LONE_SETTINGS:
            tag = f"{prefix}_{key}_{setting.replace('.', '')}"
            if run is None:
                for what in ("offline", "http", "ratio", "gap", "gap99", "loop", "eng"):
                    prose.glue(f"{tag}_{what}", "(not yet measured)")
                continue
            http, gap = run["http_decode"][setting], run["http_gap"][setting]
            cpu = run["server_cpu_per_token"][setting]
            prose.glue(f"{tag}_offline", f"{http['ceiling']:,.0f} tokens/s")
            prose.glue(f"{tag}_http", f"{http['value']:,.0f} tokens/s")
            prose.glue(f"{tag}_ratio", f"{http['ratio']:.0%}")
            prose.glue(f"{tag}_gap", f"{gap['value']:.2f} ms")
            prose.glue(f"{tag}_gap99", f"{gap['p99']:.2f} ms")
            prose.glue(f"{tag}_loop", f"{cpu['loop_thread_ms']:.2f} ms")
            prose.glue(f"{tag}_eng", f"{cpu['engine_thread_ms']:.2f} ms")
    count = runs.get("counted free blocks")
    prose.glue(f"{prefix}_count_greedy_ratio", "(not measured)" if count is None
               else f"{count['http_decode']['greedy']['ratio']:.0%}")  # fmt: skip


def draw_lone(by_device: dict):
    """A lone client's decode rate over HTTP as a share of the engine alone in the same
    run, per engine, device and setting.
    """
    panels = [(d, s) for d in by_device for s in LONE_SETTINGS]
    fig, axes = new_figure(1, len(panels), width=3 * len(panels), height=2.4)
    axes = np.atleast_1d(axes)
    colors = {"before": "#d62728", "counted free blocks": "#ff7f0e", "after": "#2ca02c"}
    for ax, (device, setting) in zip(axes, panels):
        runs = lone_runs(by_device[device])
        labels = [label for label in LONE_LABELS if label in runs]
        shares = [runs[k]["http_decode"][setting]["ratio"] for k in labels]
        ax.barh(range(len(labels)), shares, color=[colors[k] for k in labels])
        for i, share in enumerate(shares):
            ax.text(share + 0.02, i, f"{share:.0%}", va="center", fontsize=7)
        ax.set_yticks(range(len(labels)), [LONE_LABELS[k] for k in labels], fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="#7f7f7f", lw=0.8, ls="--")
        ax.set_xlim(0, 1.25)
        ax.set_xlabel("share of the engine alone (decode tokens/s)", fontsize=7)
        ax.set_title(f"{device}\n{LONE_SETTINGS[setting]}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    return fig


lone_cpu = {
    d: rs for d, rs in lone_by_device.items() if rs[0]["device"].get("kind") == "cpu"
}
lone_gpu = {d: rs for d, rs in lone_by_device.items() if d not in lone_cpu}
for prefix, found in (("ch12_lc", lone_cpu), ("ch12_lg", lone_gpu)):
    if found:
        glue_lone(prefix, next(iter(found.values())))
if lone_by_device:
    fig = draw_lone(lone_by_device)
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if lone_cpu:
    prose.show("""
On this book's CPU record ({{ch12_lc_name}}), with a {{ch12_lc_model}} (a greedy NumPy
step about as long as the GPU's): before the fix (engine {{ch12_lc_before_commit}},
{{ch12_lc_before_date}}) a lone client over HTTP got {{ch12_lc_before_greedy_http}}
greedy, {{ch12_lc_before_greedy_ratio}} of the engine alone in the same run
({{ch12_lc_before_greedy_offline}}), with a median gap between chunks of
{{ch12_lc_before_greedy_gap}}; the engine's thread spent {{ch12_lc_before_greedy_eng}}
of CPU per token, the event loop's {{ch12_lc_before_greedy_loop}}. After it (engine
{{ch12_lc_after_commit}}, {{ch12_lc_after_date}}): {{ch12_lc_after_greedy_http}}
against {{ch12_lc_after_greedy_offline}}, {{ch12_lc_after_greedy_ratio}}, a median gap
of {{ch12_lc_after_greedy_gap}} (p99 {{ch12_lc_after_greedy_gap99}}), and
{{ch12_lc_after_greedy_eng}} and {{ch12_lc_after_greedy_loop}} of CPU per token.
Sampled with temperature 0.6 and top-p 0.9, where sorting the probabilities on the
host makes the step longer, the client got {{ch12_lc_before_t06_p09_ratio}} of the
engine before and {{ch12_lc_after_t06_p09_ratio}} after.

The figure shows the middle step too: the kept count alone took the greedy share to
{{ch12_lc_count_greedy_ratio}}. What is left
on the CPU is the interpreter lock. The server's two threads take turns at it, and a
NumPy step of so small a model holds it from start to end, so the event loop's work for
each token — waking, the chunk's JSON, the write to the socket — is added to the step
instead of hidden beside it (in the profile, the engine thread's largest cost after the
step became the write that wakes the loop: the lock is handed over there). On two cores
the client's own process competes with the server's two threads as well.
""")
else:
    prose.show("No CPU record of a lone client yet: run "
               "`python bench/ch12_lone_client.py --device cpu`.")  # fmt: skip

# %% tags=["remove-input"] jupyter={"source_hidden": true}
if lone_gpu:
    runs = lone_runs(next(iter(lone_gpu.values())))
    prose.glue("ch12_lg_before_sentence", prose.fill("""
Before it (engine {{ch12_lg_before_commit}}, {{ch12_lg_before_date}}) a lone client over
HTTP got {{ch12_lg_before_greedy_http}} greedy ({{ch12_lg_before_greedy_ratio}} of the
engine alone in that run, a median gap of {{ch12_lg_before_greedy_gap}}) and
{{ch12_lg_before_t06_p09_http}} sampled ({{ch12_lg_before_t06_p09_ratio}}).
""") if "before" in runs else "")  # fmt: skip
    prose.show("""
On the {{ch12_lg_name}} ({{ch12_lg_model}}), the engine alone made
{{ch12_lg_after_greedy_offline}} greedy and {{ch12_lg_after_t06_p09_offline}} sampled.
{{ch12_lg_before_sentence}} After the fix (engine {{ch12_lg_after_commit}},
{{ch12_lg_after_date}}) a lone client over HTTP got {{ch12_lg_after_greedy_http}}
greedy ({{ch12_lg_after_greedy_ratio}}, a median gap of {{ch12_lg_after_greedy_gap}},
p99 {{ch12_lg_after_greedy_gap99}}) and {{ch12_lg_after_t06_p09_http}} sampled
({{ch12_lg_after_t06_p09_ratio}}). Here the engine's thread waits for the GPU with the
interpreter lock released (every CUDA call through `cuda-bindings` releases it), so the
event loop's part of each token can run inside that wait.
""")
else:
    prose.show("No GPU record of a lone client yet: on a GPU, run "
               "`python bench/ch12_lone_client.py`.")  # fmt: skip


# %% [markdown]
# ## Summary
#
# - An OpenAI request is a JSON body whose fields are, mostly, `SamplingParams`' own;
#   pydantic checks the types, `SamplingParams` the values, and both kinds of refusal
#   are a 400 in OpenAI's error shape, as are malformed bodies, other models' names
#   (404), unsupported fields and prompts that do not fit.
# - The engine is stepped by one thread, the only one that touches it. Handlers on the
#   event loop post `add` and `abort` to its inbox; after each step it sends every
#   request's delta through `loop.call_soon_threadsafe` to a collector that holds one
#   delta and merges the next into it — backpressure without a queue.
# - Streams are server-sent events in OpenAI's chunk format, ending with `[DONE]`; a
#   client that leaves is noticed by `is_disconnected()` (asked every half second) or
#   by the cancellation of its stream, and its request is aborted and its blocks freed.
# - Abuse is refused early and cheaply: every string is checked to be Unicode as the
#   body is parsed; templates and the tokenizer run on a small worker pool, off the
#   event loop and the engine's thread; a prompt whose bytes prove it too long is
#   refused untokenized; a body over `--max-body-bytes` gets 413 unread, a request past
#   `--max-waiting` 503, one past `--request-timeout` 504.
# - `/metrics` exports the engine's gauges, counters and latency histograms under
#   vLLM's names with the prefix `tinyvllm:`.
# - A serving benchmark sends requests at Poisson times and measures what clients
#   feel — TTFT, ITL, TPOT, end-to-end latency, in percentiles — against the request
#   rate.
# - A lone client at batch 1 shows what the server adds per token, against the engine
#   alone: find it with a profile of the engine thread, not by guessing. Here it was a
#   count of cached free blocks made by a pass over the whole free list every step
#   (now kept as blocks come and go), and per-token handler work that needs to happen
#   only every half second.

# %% tags=["remove-input"] jupyter={"source_hidden": true}
summary = []
if cpu:
    summary.append("""On the {{ch12_cpu_name}}, {{ch12_cpu_model}} served
{{ch12_cpu_work}}: from {{ch12_cpu_rate_low}} requests/s to all at once the median first
token went from {{ch12_cpu_ttft_low}} to {{ch12_cpu_ttft_high}}, the median gap between
tokens from {{ch12_cpu_itl_low}} to {{ch12_cpu_itl_high}}, and all at once the server
made {{ch12_cpu_tput_high}} output tokens/s.""")
if gpu:
    summary.append("""On the {{ch12_gpu_name}}, {{ch12_gpu_model}} served
{{ch12_gpu_work}}: from {{ch12_gpu_rate_low}} requests/s to all at once the median first
token went from {{ch12_gpu_ttft_low}} to {{ch12_gpu_ttft_high}}, the median gap from
{{ch12_gpu_itl_low}} to {{ch12_gpu_itl_high}}, and all at once the server made
{{ch12_gpu_tput_high}} output tokens/s.""")
if lone_gpu:
    summary.append("""A lone client over HTTP got {{ch12_lg_after_greedy_ratio}} of the
engine alone greedy and {{ch12_lg_after_t06_p09_ratio}} sampled on the {{ch12_lg_name}}
(engine {{ch12_lg_after_commit}}).""")
if lone_cpu:
    summary.append("""On the CPU record it got {{ch12_lc_after_greedy_ratio}} greedy and
{{ch12_lc_after_t06_p09_ratio}} sampled.""")
for prefix, found in (("ch12_gcost", gpu), ("ch12_ccost", cpu)):
    if found and f"{prefix}_share" in prose.values:
        summary.append(f"""With every request sent at once, the server made
{{{{{prefix}_share}}}} of the {{{{{prefix}_offline}}}} that the engine alone made on the
same prompts in the same run on the {{{{{prefix}_name}}}}.""")
    elif found:
        summary.append(f"""What the server costs against the engine alone in the same
run is not recorded yet on the {{{{{prefix}_name}}}}.""")
if summary:
    prose.show("**Measured:** " + " ".join(summary))
else:
    print("no serving records in this copy of the book: run bench/ch12_serving.py")

# %% [markdown]
# Exported to `tinyvllm_lib`: `entrypoints.openai.protocol` (the request models,
# `OpenAIError`), `entrypoints.openai.prompts` (`PromptProcessor`, the worker pool),
# `entrypoints.openai.body_limit` (`BodySizeLimit`), `entrypoints.openai.serving`,
# `serving_chat` and `serving_completion` (the endpoints),
# `entrypoints.openai.api_server` (`build_app`),
# `entrypoints.launcher` (`ServerThread`, `serve_http`, `run_coroutine`),
# `engine.async_llm_engine` (`AsyncLLMEngine`, `RequestOutputCollector`),
# `engine.metrics` (`IterationStats`, `PrometheusStatLogger`), `benchmark_serving`, and
# the `serve` command.
#
# ## Exercises
#
# 1. Make the collector a plain `asyncio.Queue` and rerun the slow-reader demo with a
#    reader that sleeps a whole second. How many deltas wait in its queue at the end,
#    and how much memory would 256 such readers of 2,000 tokens hold?
# 2. The engine thread wakes handlers with one `call_soon_threadsafe` per step, not one
#    per request. Change it to one per request and measure the event loop's share of a
#    step with 256 running requests. What does the loop do with each call?
# 3. Add `n=2`: two completions of one prompt. What must the engine, the block manager
#    (chapter 10's exercise on copy-on-write) and the chunk format (`index`) each do?
# 4. Predict from the recorded CPU sweep the request rate at which the median TTFT
#    passes one second, then run `bench/ch12_serving.py --rates` around it.
# 5. The server refuses a prompt untokenized when $\lceil B / L \rceil$ reaches
#    `max_model_len`, with $L$ the UTF-8 bytes of SmolLM2's longest vocabulary entry.
#    A byte-level token stands for one byte per character of its entry, fewer than its
#    UTF-8 bytes: how much smaller is that $L$, and what is then the largest prompt
#    that must still be tokenized at `max_model_len` 4096? How long does encoding it
#    take?
# 6. Serve with `--max-waiting 8` and run the benchmark at a rate past what the CPU
#    sustains. What happens to the p99 TTFT of the requests that were let in, and what
#    share is turned away?
# 7. Set `OPENBLAS_NUM_THREADS=1` and rerun `bench/ch12_stall_cpu.py`. Predict first:
#    does the stream's median gap grow or shrink on two cores, and its largest gap
#    while a 5 MB prompt is refused?
# 8. Before this chapter's fix, `engine.stats` looked at every free block. Predict
#    its cost per step for `serve --max-num-seqs 1024 --max-model-len 8192` on an
#    idle server, then time the old pass on a `BlockManager` of that size. How many GPU
#    steps at batch 1 is that?
