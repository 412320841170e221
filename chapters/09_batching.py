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
# # 9. Batching: many requests, one engine loop
#
# Chapter 8b generated one answer at a time, and measured what that costs: each decode
# step reads every weight of the model — 2.5 GB for Llama 3.2 1B — to produce **one**
# token, and on the GPU most of the step is Python launching kernels. Both costs are per
# step, not per token. A step that computes a token for each of 64 requests reads the
# weights once and launches the same kernels once, for 64 tokens. That is **batching**,
# and it is what turns a model into an inference server. This chapter builds it the way
# vLLM and nano-vllm do: requests arrive and leave the batch at any step (**continuous
# batching**), a **scheduler** decides what each step computes, and one **engine loop**
# — schedule, execute, postprocess — drives it all.
#
# In this chapter you will learn:
#
# - what **static batching** wastes — padding, rows left idle by short answers, requests
#   waiting for a whole batch to finish — measured on a real mix of requests;
# - **continuous batching**: a request's status and computed tokens, the waiting and
#   running queues, admission under `max_num_seqs` and `max_num_batched_tokens`, and why
#   each step here is either a prefill or a decode;
# - vLLM's engine API — `LLMEngine.add_request`, `step`, `abort_request` — and the
#   offline `LLM` API on top of it, with its progress bar and streaming;
# - **ragged** batches on the GPU: prompts of any lengths packed into one launch, and a
#   decode step that writes only into buffers made beforehand, ready to be captured as a
#   graph;
# - how much batching buys, measured on the CPU and on an H200 — and what it does not
#   fix yet.
#
# It builds on the model runner, requests and sampler of [chapter 8b](08b_generation.py)
# and the block tables and attention metadata of [chapter 8](08_kv_cache.py).

# %%
#| default_exp engine.scheduler

# %%
import io
import tempfile
import time
from contextlib import redirect_stdout

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

from tinyvllm_lib.cli import command, main
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token
from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.measure import load_records
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.random_llama import (
    LLAMA_3_2_1B_CONFIG,
    make_random_llama,
    tiny_llama_config,
)
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import Prose, new_figure, plain_log_ticks, verdict
from tinyvllm_lib.runtime import has_gpu, is_simulator, where_kernels_run
from tinyvllm_lib.tokenizer import Tokenizer

rng = np.random.default_rng()
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
folder = resolve_model("smollm2")
smollm2 = ModelConfig.from_folder(folder)
tokenizer = Tokenizer.from_folder(folder)
print(where_kernels_run())

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## A mix of requests
#
# Real traffic is ragged: short questions and long documents, one-word answers and
# essays. The examples below use twelve chat requests to SmolLM2: questions, some with a
# paragraph of background in front, so that the prompts' lengths vary several-fold
# (printed below), and answers capped at between 4 and 40 tokens — some end earlier, at
# the model's end-of-turn token. The caps stand in for what a client asks for; the model
# decides the rest.

# %%
topics = [
    "the capital of France",
    "photosynthesis",
    "a haiku about rain",
    "the number pi",
    "why the sky is blue",
    "three uses of copper",
    "the French Revolution in one sentence",
    "how a bicycle stays upright",
    "what a compiler does",
    "the boiling point of water",
    "a name for a pet turtle",
    "Newton's first law",
]
notes = (
    "Paris is the capital and largest city of France. It lies on the Seine, in the "
    "north of the country, and has "
    "been a centre of finance, diplomacy, commerce, fashion, science and the arts "
    "for centuries. "
).split()
# words of background some requests bring along
context = [0, 0, 60, 0, 15, 0, 120, 0, 30, 0, 0, 90]
prompts = [
    tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": " ".join((notes * 4)[:n]) + f" Tell me about {t}.",
            }
        ],
        tokenize=True,
    )
    for t, n in zip(topics, context)
]
caps = [int(c) for c in np.random.default_rng(0).integers(4, 41, len(prompts))]
mix = [SamplingParams(temperature=0, max_tokens=c, logprobs=2) for c in caps]
print("prompt tokens:", [len(p) for p in prompts])
print("max_tokens:   ", caps)

# %% [markdown]
# ## Why batch: the cost is per step
#
# A decode step reads every weight once, whatever the number of tokens it computes, and
# (on the GPU) launches the same ~180 kernels. With $B$ requests in the batch, the same
# step makes $B$ tokens. The attention of each request still reads its own cache, so the
# step's bytes are
#
# $$ \text{bytes}(B) = \underbrace{2P}_{\text{weights}} + \sum_{b=1}^{B} n_b
#    \cdot \text{KV bytes per token}. $$
#
# For Llama 3.2 1B at 512 tokens of context each, one request against a batch of 64:

# %% tags=["hide-input"]
llama_1b = ModelConfig.from_dict(LLAMA_3_2_1B_CONFIG)
c = llama_1b
# q, k, v, o
attention_weights = (
    c.hidden_size * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
)
weight_bytes = 2 * (
    c.num_hidden_layers * (attention_weights + 3 * c.hidden_size * c.intermediate_size)
    # bf16: the layers' matrices and the head
    + c.vocab_size * c.hidden_size
)
kv_bytes = 512 * kv_cache_bytes_per_token(c)  # one request's cache at 512 tokens
one, batch = weight_bytes + kv_bytes, weight_bytes + 64 * kv_bytes
print(
    f"bytes per token: {one / 1e9:.2f} GB alone, {batch / 64 / 1e9:.3f} GB in a "
    "batch of 64"
)
prose.glue("ch09_bytes_1", f"{one / 1e9:.1f} GB")
prose.glue("ch09_bytes_64", f"{batch / 1e9:.1f} GB")
prose.glue("ch09_bytes_ratio", f"{one / (batch / 64):.0f} times")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
As long as the weights dominate, $B$ tokens cost about what one did. For Llama 3.2 1B at
512 tokens of context each, one request reads {{ch09_bytes_1}}
for one token; 64 requests read {{ch09_bytes_64}} for 64 tokens — {{ch09_bytes_ratio}}
fewer bytes per token. The prefill batches too: prompts of different requests can share
one step (the kernels of chapters 7 and 8 take packed, ragged batches). The question is
only *which* requests share a step.
""")

# %% [markdown]
# ## Static batching, and what it wastes
#
# The first answer, and what a plain `model.generate(batch)` does: take $B$ requests,
# pad their prompts to the longest so that they form a rectangle, and decode until the
# **longest** answer is done; then take the next $B$. Three things go to waste:
#
# - **padding**: a prompt of 12 tokens padded to 40 computes 28 tokens of nothing;
# - **idle rows**: a request that finishes after 4 tokens keeps its row for as long as
#   its batch's longest answer — 40 steps, say — computing nothing useful (a padded
#   implementation keeps computing it; ours at least skips it);
# - **waiting**: a request that arrives while a batch runs waits for the whole batch,
#   however short its own answer (head-of-line blocking).
#
# The fix is to make the batch a *set that changes every step*: a finished request
# leaves at once and a waiting one takes its place. That needs a scheduler.

# %% [markdown]
# ## Continuous batching: the scheduler
#
# The scheduler keeps two queues. **Waiting** requests have arrived but hold nothing;
# **running** ones own a row of the KV cache and are computed step by step. Each
# `schedule()` decides one step, and its output is exactly what chapter 8b's model
# runner takes — `SchedulerOutput`: the requests, how many new tokens each computes (its
# `num_computed_tokens` says where to start), how many of them are prefills, and their
# block-table rows.
#
# - **Admission**: waiting prompts are admitted in arrival order while three things
#   allow it: a place among `max_num_seqs` running requests, a free cache row, and the
#   step's budget of `max_num_batched_tokens` tokens. The first prompt that does not fit
#   stops admission — first come, first served. In this chapter a prompt is computed in
#   one step, so the budget is at least `max_model_len` (splitting a prompt into chunks
#   needs chapter 10's paged prefill).
# - **A step is a prefill or a decode.** If any prompt was admitted, the step prefills
#   the new prompts, packed into one ragged batch; otherwise it decodes one token for
#   every running request. Mixing both in one step is possible — the runner and the
#   attention objects already take prefills and decodes in one batch — and vLLM does it
#   with chunked prefill. We keep them apart on purpose: a pure decode step has the same
#   shape every time (one token per running request), which is what chapter 11 captures
#   as a CUDA graph, per batch size (chapter 11 later captures prefills too, in buckets
#   of tokens). The price is that running
#   requests wait while a prefill step runs — the stall chapter 10's chunked prefill
#   removes.
# - **Postprocessing**: after the runner, each request gets its sampled token (chapter
#   8b's `append_token` checks the stops and extends the text), and a finished request
#   leaves the running set and frees its row at once — the next step can admit someone
#   into it.
#
# The scheduler owns the cache rows (through chapter 8's allocator); the runner only
# reads the block tables it is handed.

# %%
#| export engine.scheduler
from collections import deque

from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.request import Request, RequestStatus
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput, SchedulerOutput


class Scheduler:
    """Continuous batching: a waiting queue and the running requests, under max_num_seqs
    and max_num_batched_tokens.

    Each step is a prefill of the waiting prompts that fit, in arrival order, packed
    into one batch; or, when none is admitted, a decode step of every running request.
    It owns the cache rows.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        allocator: ContiguousAllocator,
    ):
        self.max_num_seqs, self.max_num_batched_tokens, self.allocator = (
            max_num_seqs,
            max_num_batched_tokens,
            allocator,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rows: dict[str, int] = {}  # request id -> its cache row, while it runs

    def add_request(self, request: Request) -> None:
        # it could never be admitted
        if (
            request.num_tokens - request.num_computed_tokens
            > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"request {request.request_id!r} needs {request.num_tokens} tokens "
                "in one step, more than "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> list[Request]:
        """Waiting prompts that fit this step, first come first served: a sequence slot,
        a cache row, the token budget.
        """
        admitted, budget = [], self.max_num_batched_tokens
        while (
            self.waiting
            and len(self.running) + len(admitted) < self.max_num_seqs
            and self.allocator.num_free_rows
        ):
            num_new = self.waiting[0].num_tokens - self.waiting[0].num_computed_tokens
            # it waits for the next step, and so does everyone behind it
            if num_new > budget:
                break
            request = self.waiting.popleft()
            self.rows[request.request_id] = self.allocator.allocate()
            request.status = RequestStatus.RUNNING
            admitted.append(request)
            budget -= num_new
        return admitted

    def schedule(self) -> SchedulerOutput | None:
        """The next step: new prompts if any can be admitted, else one token for every
        running request.
        """
        admitted = self._admit()
        if admitted:
            self.running.extend(admitted)
            batch, num_new = (
                admitted,
                [r.num_tokens - r.num_computed_tokens for r in admitted],
            )
        elif self.running:
            batch, num_new = list(self.running), [1] * len(self.running)
        else:
            return None
        block_tables = self.allocator.block_tables(
            [self.rows[r.request_id] for r in batch]
        )
        return SchedulerOutput(
            batch, num_new, len(batch) if admitted else 0, block_tables
        )

    def postprocess(
        self, step: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[Request]:
        """Append each request's sampled token (stop checks, text) and free the
        finished: the requests that progressed.
        """
        s = result.sampled
        for i, (request, num_new) in enumerate(zip(step.requests, step.num_new_tokens)):
            request.num_computed_tokens += num_new
            if result.prompt_logprobs[i] is not None:
                request.set_prompt_logprobs(*result.prompt_logprobs[i])
            request.append_token(
                s.token_ids[i],
                *(
                    None if a is None else a[i]
                    for a in (s.logprobs, s.top_ids, s.top_logprobs)
                ),
            )
            if request.is_finished:
                self._release(request)
        return step.requests

    def abort_request(self, request_id: str) -> Request | None:
        """Take a request out, waiting or running, and end it with finish_reason
        'abort'; None if it is not here.
        """
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                request.abort()
                return request
        for request in self.running:
            if request.request_id == request_id:
                request.abort()
                self._release(request)
                return request
        return None

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(self.rows.pop(request.request_id))


# %% [markdown]
# ## The engine loop
#
# `LLMEngine` holds the model runner and the scheduler, and its `step()` is the whole
# engine:
#
# $$ \texttt{step()}
#    = \texttt{schedule()} \rightarrow \texttt{execute()}
#    \rightarrow \texttt{postprocess()}, $$
#
# returning a `RequestOutput` for every request that progressed — its text so far and
# whether it has finished. Requests come in through
# `add_request(request_id, prompt, params)` at any time, between any two steps; they are
# checked first (an empty prompt, one too long for `max_model_len` with its
# `max_tokens`, unknown token ids, a request id already in use: each a `ValueError` that
# leaves the engine as it was). `abort_request(request_id)` ends a request wherever it
# is — waiting or running — frees its place at once, and its last output, with
# `finish_reason="abort"`, comes out of the next step. A server is this loop running
# forever (a later chapter, on serving); offline generation runs it until
# `has_unfinished_requests()` is false.
#
# Two pieces come first: the checks on a prompt and its parameters, in one place for
# every entry point (the engine's `add_request` and `LLM.generate` below both use them),
# and the choice of device.

# %%
#| export engine.inputs
import numpy as np

from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampling_params import SamplingParams


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def checked_token_ids(ids, vocab_size: int) -> list[int] | None:
    """ids as a list of ints where they are a 1-D list, tuple or array of integers, all
    in [0, vocab_size); else None. In NumPy: a Python loop over a long prompt's ids
    would cost a visible part of its time to first token. (A list that mixes NumPy's
    bools with integers passes as integers, as one with Python's bools does.)
    """
    if not isinstance(ids, (list, tuple, np.ndarray)) or len(ids) == 0:
        return None
    try:
        arr = np.asarray(ids)
    except (ValueError, OverflowError, TypeError):  # ragged, or past 64 bits
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":  # an array of bools is no ids
        return None
    if arr.min() < 0 or arr.max() >= vocab_size:
        return None
    return arr.astype(np.int64).tolist()


def normalize_prompt(
    prompt, tokenizer, vocab_size: int, name: str = "prompt"
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, token ids, or {"prompt":
    ..., "prompt_token_ids": ...}.
    """
    text, ids = (
        (prompt.get("prompt"), prompt.get("prompt_token_ids"))
        if isinstance(prompt, dict)
        else (prompt, None)
    )
    if isinstance(text, str) and ids is None:
        if tokenizer is None:
            raise ValueError(
                f"{name} is text, but the model has no tokenizer.json: give token ids"
            )
        ids = tokenizer.encode(text) if text else []
    elif not isinstance(text, str):
        ids, text = text if ids is None else ids, None
    if (checked := checked_token_ids(ids, vocab_size)) is not None:
        return text, checked
    # the checks one token at a time, which name what is wrong
    if not isinstance(ids, (list, tuple, np.ndarray)) or not all(
        isinstance(t, (int, np.integer)) for t in ids
    ):
        raise ValueError(
            f"{name} must be text, a list of token ids or a dict with "
            f"'prompt_token_ids', got {type(prompt).__name__}"
        )
    if len(ids) == 0:
        raise ValueError(f"{name} is empty: it needs at least one token")
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise ValueError(
            f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    return text, [int(t) for t in ids]


def make_request(
    request_id: str,
    prompt,
    params: SamplingParams | None,
    *,
    tokenizer,
    vocab_size: int,
    eos_token_ids,
    max_model_len: int,
    default_generator: np.random.Generator,
    name: str = "prompt",
    streams_text: bool = False,
) -> Request:
    """A checked Request: the prompt fits in max_model_len with room for its max_tokens;
    stop strings have a tokenizer. streams_text: the caller reads its text as it grows.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"sampling_params must be SamplingParams, got {type(params).__name__}"
        )
    text, ids = normalize_prompt(prompt, tokenizer, vocab_size, name)
    if params.stop and tokenizer is None:
        raise ValueError(
            f"{name}: stop strings need a tokenizer, and the model has none"
        )
    room = max_model_len - len(ids)
    if room < 1:
        raise ValueError(
            f"{name} has {_tokens(len(ids))}; max_model_len is {max_model_len}, "
            "which leaves no room for a new token"
        )
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(
            f"{name} has {_tokens(len(ids))} and max_tokens is {params.max_tokens}: "
            f"{len(ids) + params.max_tokens} "
            f"is more than max_model_len ({max_model_len}); lower max_tokens or "
            "raise max_model_len"
        )
    # a request without a seed gets a generator of its own, seeded from the engine's:
    # its draws do not depend on which other requests draw, or how often (chapter 11's
    # overlap draws for rows whose tokens it then drops)
    generator = np.random.default_rng(
        params.seed if params.seed is not None else default_generator.integers(2**63)
    )
    return Request(
        request_id,
        text,
        ids,
        params,
        params.max_tokens or room,
        eos_token_ids,
        tokenizer,
        generator,
        streams_text,
    )


# %%
#| export engine.config
import os

from tinyvllm_lib.engine.engine_config import DEVICES
from tinyvllm_lib.runtime import has_gpu, is_simulator

DEFAULT_MAX_MODEL_LEN = 4096  # when not given: the model's limit, at most this
# vLLM's default step budget (this chapter's engine: at least max_model_len, since it
# computes a prompt in one step)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def cuda_in_simulator() -> bool:
    """The simulator runs device='cuda' only when asked (TINYVLLM_SIM_CUDA=1): it is
    slow, for tiny models.
    """
    return is_simulator() and os.environ.get("TINYVLLM_SIM_CUDA") == "1"


def resolve_device(device: str) -> str:
    """'cpu', 'cuda' (a GPU must be there), or 'auto': cuda when there is a GPU, else
    cpu.
    """
    if device not in ("auto", *DEVICES):
        raise ValueError(
            f"device must be one of auto, {', '.join(DEVICES)}, got {device!r}"
        )
    if device == "cuda" and not (has_gpu() or cuda_in_simulator()):
        raise RuntimeError(
            "device='cuda' but no CUDA GPU is available; use device='cpu'"
        )
    return ("cuda" if has_gpu() else "cpu") if device == "auto" else device


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# %%
# chapter 10 writes the library's LLMEngine: this one on a pool of blocks
import itertools
from dataclasses import replace

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.config import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    resolve_device,
)
from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.inputs import make_request
from tinyvllm_lib.engine.kv_cache import kv_cache_bytes_per_token
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.outputs import RequestOutput
from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.scheduler import Scheduler
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.tokenizer import Tokenizer


class LLMEngine:
    """vLLM's engine loop: add_request(...) any time, then step() while
    has_unfinished_requests().

        step() = scheduler.schedule() -> model_runner.execute()
                 -> scheduler.postprocess()

    returns the requests that progressed, each as a RequestOutput with its text so far
    and `finished`.
    """

    def __init__(self, model: str = "smollm2", device: str = "auto", **engine_args):
        """engine_args: EngineConfig's fields (this chapter's engine reads the first
        eight).
        """
        c = EngineConfig(model, device, **engine_args)
        self.folder = resolve_model(c.model)
        self.config = ModelConfig.from_folder(self.folder)
        # None: prompts are token ids
        self.tokenizer = Tokenizer.from_folder(self.folder, missing_ok=True)
        limit = self.config.max_position_embeddings
        max_model_len = c.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len must be an integer in [2, {limit}] (the model's "
                f"max_position_embeddings), got {max_model_len!r}"
            )
        max_num_batched_tokens = c.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len
        )
        if max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_model_len ({max_model_len}), "
                "since this engine computes a prompt in one step (chapter 10's "
                "computes long ones in chunks)"
            )
        # the config completed for this model: what the runner reads
        self.engine_config = c = replace(
            c,
            device=resolve_device(c.device),
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.device, self.max_model_len = c.device, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = (
            c.max_num_seqs,
            max_num_batched_tokens,
        )
        self.allocator = ContiguousAllocator(
            c.max_num_seqs, max_model_len, c.block_size
        )
        if self.device == "cuda" and has_gpu():
            self._check_gpu_memory()
        self.model_runner = ModelRunner(self.folder, c, self.allocator.num_slots)
        self.scheduler = Scheduler(
            c.max_num_seqs, max_num_batched_tokens, self.allocator
        )
        # for requests without a seed of their own
        self.rng = np.random.default_rng(c.seed)
        # unfinished (and aborted but not yet reported) requests by id
        self.requests: dict[str, Request] = {}
        # their last RequestOutput goes out with the next step
        self._aborted: list[Request] = []
        self._ids = itertools.count()

    def _check_gpu_memory(self) -> None:
        need = self.allocator.num_slots * kv_cache_bytes_per_token(self.config)
        free = cuda.current_context().get_memory_info().free
        if need > 0.9 * free:
            raise ValueError(
                f"the KV cache of max_num_seqs x max_model_len = {self.max_num_seqs} "
                f"x {self.max_model_len} "
                f"tokens needs {need / 2**30:.1f} GiB and the GPU has "
                f"{free / 2**30:.1f} GiB free: lower "
                "max_num_seqs or max_model_len (chapter 10's engine sizes its "
                "cache from memory)"
            )

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def make_request(
        self,
        request_id: str,
        prompt,
        params=None,
        name: str = "prompt",
        streams_text: bool = False,
    ) -> Request:
        """A checked Request for a prompt (text, token ids or a dict), not added yet;
        ValueError on bad input. streams_text: the caller reads its text as it grows.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(
                f"request_id must be a non-empty string, got {request_id!r}"
            )
        if request_id in self.requests:
            raise ValueError(
                f"request_id {request_id!r} is already in use by an unfinished request"
            )
        return make_request(
            request_id,
            prompt,
            params,
            tokenizer=self.tokenizer,
            vocab_size=self.config.vocab_size,
            eos_token_ids=self.config.eos_token_ids,
            max_model_len=self.max_model_len,
            default_generator=self.rng,
            name=name,
            streams_text=streams_text,
        )

    def enqueue(self, request: Request) -> None:
        """Add a request made by make_request: it waits for a place, then runs step by
        step.
        """
        if request.request_id in self.requests:
            raise ValueError(
                f"request_id {request.request_id!r} is already in use by an "
                "unfinished request"
            )
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def add_request(self, request_id: str, prompt, params=None) -> None:
        """vLLM's add_request: check the prompt and its SamplingParams, then queue
        it.
        """
        self.enqueue(self.make_request(request_id, prompt, params))

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def abort_request(self, request_id: str) -> None:
        """End a request now, waiting or running (finish_reason 'abort'); its place and
        cache row are freed at once.
        """
        request = self.requests.get(request_id)
        if request is None or request in self._aborted:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        self.scheduler.abort_request(request_id)
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, postprocess: the RequestOutput of every request that
        progressed or was aborted.
        """
        done, self._aborted = self._aborted, []
        # aborted since the last step: finish_reason "abort"
        outputs = [r.output() for r in done]
        step = self.scheduler.schedule()
        if step is not None:
            result = self.model_runner.execute(step)
            for request in self.scheduler.postprocess(step, result):
                outputs.append(request.output())
                if request.is_finished:
                    done.append(request)
        for request in done:
            del self.requests[request.request_id]
        return outputs


# %% [markdown]
# The engine on SmolLM2, driven by hand: two requests start, a third arrives while they
# run, one is aborted, and a bad request is refused while the others carry on.

# %%
engine = LLMEngine("smollm2", device="cpu", max_model_len=512, max_num_seqs=4)
engine.add_request("a", prompts[0], SamplingParams(temperature=0, max_tokens=12))
engine.add_request("b", prompts[1], SamplingParams(temperature=0, max_tokens=30))
log, texts = [], {}
for step_number in range(40):
    if step_number == 3:
        # arrives mid-flight
        engine.add_request("c", prompts[2], SamplingParams(temperature=0, max_tokens=8))
    if step_number == 6:
        engine.abort_request("b")
    if step_number == 7:
        try:
            engine.add_request("a", prompts[3])  # "a" is still running: its id is taken
        except ValueError as err:
            print("refused:", err)
        else:
            raise AssertionError("a request id in use was accepted")
    outputs = engine.step()
    log.append(sorted(o.request_id for o in outputs))
    for o in outputs:
        texts[o.request_id] = (o.outputs[0].text, o.outputs[0].finish_reason)
    if not engine.has_unfinished_requests():
        break
print("requests in each step's outputs:", log)
for rid, (text, reason) in sorted(texts.items()):
    print(f"{rid}: finish_reason={reason!r:10} {text!r}")
assert (
    texts["b"][1] == "abort"
    and texts["a"][1] in ("stop", "length")
    and texts["c"][1] in ("stop", "length")
)
assert engine.scheduler.allocator.num_free_rows == 4  # every row back

# %% [markdown]
# ## Static against continuous, measured
#
# A scheduler that admits new requests only when none is running *is* static batching: a
# batch starts together and the next waits until its last request is done. As a subclass
# it is two lines, so both policies run on the same engine, the same model and the same
# mix. The loop below is `step()` unrolled, so that we can record which request sits in
# which cache row at every step. (Our static batches do not pad: the ragged prefill
# computes each prompt's own tokens, and a finished request's row is left empty rather
# than computed. So the waste is *counted* here — what a padded implementation would
# compute — and the time measured below flatters static batching.)

# %%
from tinyvllm_lib.engine.scheduler import Scheduler


def agrees(
    ref_ids: list[int], ref_logprobs: list[dict], ids: list[int], tie: float
) -> tuple[bool, bool]:
    """(same tokens, stopped at a near tie): equal up to the first step where the
    reference's two most likely tokens are within `tie` in log-probability, and equal to
    the end (length too) if there is none.
    """
    for t, step in enumerate(ref_logprobs):
        best = sorted(step.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < tie:
            return ref_ids[:t] == ids[:t], True
    return ref_ids == ids, False


class StaticScheduler(Scheduler):
    """Static batching: a new batch is admitted only when every request of the last one
    has finished.
    """

    def _admit(self):
        return super()._admit() if not self.running else []


def run_recorded(engine: LLMEngine, scheduler_cls, batch_size: int):
    """The mix through `engine` with a scheduler_cls of batch_size rows: requests,
    per-step (is prefill, {row: request}), seconds.
    """
    # batch_size rows of max_model_len slots, laid in the engine's KV cache
    rows = ContiguousAllocator(batch_size, engine.max_model_len)
    assert rows.num_slots <= engine.model_runner.kv_cache.num_slots
    engine.scheduler = scheduler_cls(batch_size, engine.max_num_batched_tokens, rows)
    requests = [
        engine.make_request(f"mix{i}", p, sp)
        for i, (p, sp) in enumerate(zip(prompts, mix))
    ]
    for request in requests:
        engine.enqueue(request)
    timeline, t0 = [], time.perf_counter()
    while engine.scheduler.has_unfinished_requests():  # engine.step(), unrolled:
        step = engine.scheduler.schedule()
        timeline.append(
            (
                step.num_prefills > 0,
                {
                    engine.scheduler.rows[r.request_id]: int(r.request_id[3:])
                    for r in step.requests
                },
            )
        )
        engine.scheduler.postprocess(step, engine.model_runner.execute(step))
    for request in requests:
        del engine.requests[request.request_id]
    return requests, timeline, time.perf_counter() - t0


BATCH = 4
runs = {
    name: run_recorded(engine, cls, BATCH)
    for name, cls in (("static", StaticScheduler), ("continuous", Scheduler))
}
for name, (requests, timeline, seconds) in runs.items():
    decode_steps = [rows for is_prefill, rows in timeline if not is_prefill]
    used = sum(len(rows) for rows in decode_steps)
    print(
        f"{name:>10}: {len(timeline)} steps ({len(timeline) - len(decode_steps)} "
        "prefill), decode rows busy "
        f"{used}/{BATCH * len(decode_steps)} = "
        f"{used / (BATCH * len(decode_steps)):.0%}, {seconds:.1f} s on this CPU"
    )
for ref, got in zip(*(runs[name][0] for name in ("static", "continuous"))):
    assert agrees(ref.output_token_ids, ref.logprobs, got.output_token_ids, tie=1e-4)[0]

# %% [markdown]
# Both produce the same tokens — the policy changes *when* a request runs, never what it
# computes. (Almost never: BLAS may round a row differently inside a bigger matrix, and
# that can flip a near tie; `agrees` compares up to the first step where the reference's
# two best tokens are within $10^{-4}$. The next sections count how often that happens.)
# The waste, counted from the run: static batching pads each batch's prompts to its
# longest and keeps rows idle until each batch's longest answer is done.

# %% tags=["hide-input"]
static_requests, static_timeline, static_s = runs["static"]
batches = [sorted(rows.values()) for is_prefill, rows in static_timeline if is_prefill]
padded = sum(
    len(b) * max(len(prompts[i]) for i in b) - sum(len(prompts[i]) for i in b)
    for b in batches
)
prompt_total = sum(len(p) for p in prompts)
idle = {
    name: sum(BATCH - len(rows) for is_prefill, rows in tl if not is_prefill)
    for name, (_, tl, _) in runs.items()
}
generated = sum(len(r.output_token_ids) for r in static_requests)
prose.glue(
    "ch09_padded",
    f"{padded} padded prompt tokens ({padded / prompt_total:.0%} on top of the "
    f"{prompt_total} real ones)",
)
prose.glue("ch09_idle_static", f"{idle['static']}")
prose.glue("ch09_idle_cont", f"{idle['continuous']}")
prose.glue("ch09_steps_static", f"{len(static_timeline)}")
prose.glue("ch09_steps_cont", f"{len(runs['continuous'][1])}")
prose.glue("ch09_time_ratio", f"{static_s / runs['continuous'][2]:.1f}×")
prose.glue("ch09_generated", f"{generated}")

fig, axes = new_figure(2, 1, width=9, height=4.6, sharex=True)
colors = plt.cm.tab20(np.linspace(0, 1, len(prompts)))
for ax, (name, (requests, timeline, seconds)) in zip(axes, runs.items()):
    for step_index, (is_prefill, rows) in enumerate(timeline):
        for row, request_index in rows.items():
            ax.add_patch(
                plt.Rectangle(
                    (step_index, row + 0.08), 1, 0.84, color=colors[request_index], lw=0
                )
            )
            if is_prefill:
                ax.text(
                    step_index + 0.5,
                    row + 0.5,
                    "P",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
    if name == "static":
        start = 0
        for step_index, (is_prefill, rows) in enumerate(timeline + [(True, {})]):
            # each batch: its rows, from its prefill to its last step
            if is_prefill and step_index > start:
                ax.add_patch(
                    plt.Rectangle(
                        (start, 0),
                        step_index - start,
                        len(timeline[start][1]),
                        color="#dddddd",
                        zorder=0,
                    )
                )
            if is_prefill:
                start = step_index
    ax.set_ylim(0, BATCH)
    ax.set_xlim(0, max(len(tl) for _, tl, _ in runs.values()))
    ax.set_yticks(
        np.arange(BATCH) + 0.5, [f"row {r}" for r in range(BATCH)], fontsize=7
    )
    ax.set_title(
        f"{name} batching: {len(timeline)} steps, {seconds:.1f} s (grey: rows a "
        "batch holds idle; P: prefill)",
        fontsize=9,
    )
axes[1].set_xlabel("engine step")
plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
Each colour is one request. Static batching ran {{ch09_steps_static}} steps against
continuous batching's {{ch09_steps_cont}} for the same {{ch09_generated}} tokens, and
left {{ch09_idle_static}} row-steps idle (continuous: {{ch09_idle_cont}}, all at the
very end, when nothing is left to admit); a padded implementation would also have
computed {{ch09_padded}}. In the continuous run a request takes a free row in the step
right after one is freed, and every step but the last few is full.

On this CPU the static run took {{ch09_time_ratio}} as long as the continuous one: a
NumPy step costs in proportion to the rows it computes, so rows left idle cost little
here. On a GPU a decode step costs about the same for one row as for sixty-four (the
measurements at the end of the chapter), and there every idle row-step is a token that
could have been made in the same time.
""")

# %% [markdown]
# ## The `LLM` API
#
# vLLM's offline API is a thin layer on the engine: `LLM(model, ...)` makes an
# `LLMEngine` (`llm.llm_engine`), and `generate(prompts, params)` checks **every**
# prompt before it adds any — so one bad prompt costs nothing and leaves the engine as
# it was — adds them all, and steps the engine until none is left, returning one
# `RequestOutput` per prompt, in order. Its progress bar counts finished requests and
# shows the input and output tokens per second so far; `stream=`, if given, is called
# with `(prompt index, new text)` whenever a request's stable text grows. `chat` applies
# the model's chat template first. The defaults follow vLLM: `max_num_seqs=256`, and a
# step budget of 8,192 tokens (at least `max_model_len` here).

# %%
#| export engine.llm
#| public LLM
import time
from dataclasses import replace
from typing import Callable

import numpy as np
from tqdm import tqdm

from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.llm_engine import LLMEngine
from tinyvllm_lib.engine.outputs import RequestOutput
from tinyvllm_lib.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm_lib.tokenizer import Tokenizer


def _is_token_ids(x) -> bool:
    return (
        isinstance(x, (list, tuple, np.ndarray))
        and len(x) > 0
        and all(isinstance(t, (int, np.integer)) for t in x)
    )


class LLM:
    """An inference engine shaped like vLLM's: LLM(model).generate(prompts,
    SamplingParams(...)).

    All prompts are added to one LLMEngine (self.llm_engine), which batches them
    continuously.
    """

    def __init__(self, model: str = "smollm2", device: str = "auto", **engine_args):
        """engine_args: the rest of EngineConfig's fields (max_model_len, max_num_seqs,
        max_num_batched_tokens, seed, block_size, num_kv_blocks, enforce_eager, ...).
        """
        self.llm_engine = LLMEngine(EngineConfig(model, device, **engine_args))
        e = self.llm_engine
        self.folder, self.config, self.tokenizer, self.device, self.max_model_len = (
            e.folder,
            e.config,
            e.tokenizer,
            e.device,
            e.max_model_len,
        )

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        stream: Callable[[int, str], None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt_token_ids": ...}): one
        RequestOutput per prompt, in order.

        Every prompt is checked before any runs; stream(index, new text) gets each
        prompt's stable text as it appears.
        """
        engine = self.llm_engine
        prompts = (
            [prompts]
            if isinstance(prompts, (str, dict)) or _is_token_ids(prompts)
            else list(prompts)
        )
        params = SamplingParams() if sampling_params is None else sampling_params
        params = (
            list(params)
            if isinstance(params, (list, tuple))
            else [params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"{len(params)} sampling params for {len(prompts)} prompts: give "
                "one, or one per prompt"
            )
        if stream is None:  # only finished outputs are read: none for the steps before
            final = RequestOutputKind.FINAL_ONLY
            params = [
                replace(sp, output_kind=final) if isinstance(sp, SamplingParams) else sp
                for sp in params
            ]
        requests = [
            engine.make_request(engine.next_request_id(), p, sp, name=f"prompt {i}")
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        index = {r.request_id: i for i, r in enumerate(requests)}
        outputs: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(
            total=len(requests),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        t0, num_in, num_out = time.perf_counter(), 0, 0
        try:
            for request in requests:  # (chapter 10's engine can refuse one here)
                engine.enqueue(request)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:  # a request someone else added to the engine
                        continue
                    if stream is not None and (delta := requests[i].stream_delta()):
                        stream(i, delta)
                    if out.finished:
                        outputs[i] = out
                        num_in += len(out.prompt_token_ids)
                        num_out += len(out.outputs[0].token_ids)
                        elapsed = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(
                            f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                            f"output: {num_out / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        # an error (or Ctrl-C) mid-way: end this call's requests, so the engine serves
        # the next call
        finally:
            for request in requests:
                if request.request_id in engine.requests and not request.is_finished:
                    engine.abort_request(request.request_id)
            bar.close()
        return outputs

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        stream=None,
    ) -> list[RequestOutput]:
        """Answer a conversation (a list of {"role", "content"} dicts), or each of a
        list of them, in the model's chat template.
        """
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ValueError(
                f"{self.folder}: no chat template (it needs tokenizer.json and a "
                "template); use generate()"
            )
        conversations = (
            [messages] if messages and isinstance(messages[0], dict) else messages
        )
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            prompts.append(
                {
                    "prompt": text,
                    "prompt_token_ids": self.tokenizer.encode(
                        text, add_special_tokens=False
                    ),
                }
            )
        return self.generate(prompts, sampling_params, use_tqdm, stream)


# %%
from tinyvllm_lib import LLM

del engine
llm = LLM("smollm2", device="cpu", max_model_len=512, max_num_seqs=len(prompts))
t0 = time.perf_counter()
outs = llm.generate(prompts, mix, use_tqdm=False)
batched_seconds = time.perf_counter() - t0
for out in outs[:3]:
    print(
        f"{len(out.prompt_token_ids):>3} prompt tokens -> {out.outputs[0].text!r} "
        f"({out.outputs[0].finish_reason})"
    )
paris = llm.chat(
    [{"role": "user", "content": "What is the capital of France?"}],
    SamplingParams(temperature=0, max_tokens=24),
    use_tqdm=False,
)[0].outputs[0]
print(repr(paris.text))
assert "Paris" in paris.text

# %% [markdown]
# Streaming several requests at once interleaves their pieces; each request's pieces
# join to its final text. Seeds still make sampling reproducible — a request draws from
# its own generator, whatever else shares its steps — and bad input is refused with a
# message that says what to change:

# %%
pieces: dict[int, list[str]] = {}
streamed = llm.generate(
    prompts[:3],
    SamplingParams(temperature=0, max_tokens=16),
    use_tqdm=False,
    stream=lambda i, text: pieces.setdefault(i, []).append(text),
)
print("first pieces as they came:", [(i, p[:3]) for i, p in sorted(pieces.items())])
assert all("".join(pieces[i]) == streamed[i].outputs[0].text for i in range(3))

seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=42)
alone = llm.generate(prompts[5], seeded, use_tqdm=False)[0].outputs[0].token_ids
crowded = (
    llm.generate(
        prompts[:8],
        [
            seeded if i == 5 else SamplingParams(temperature=1.0, max_tokens=16)
            for i in range(8)
        ],
        use_tqdm=False,
    )[5]
    .outputs[0]
    .token_ids
)
print(
    "seed 42 alone and in a batch of 8: "
    f"{'the same tokens' if alone == crowded else 'different tokens'}"
)
assert alone == crowded

for bad_prompt, bad_params in (
    ("", None),
    ([1] * 600, None),
    ("Hello", SamplingParams(max_tokens=600)),
):
    try:
        llm.generate(["A fine prompt.", bad_prompt], bad_params, use_tqdm=False)
    except ValueError as err:
        print(f"ValueError: {err}")
    else:
        raise AssertionError("bad input was accepted")
assert not llm.llm_engine.has_unfinished_requests()  # nothing was added

# %% [markdown]
# ## The same answers, batched or not
#
# Batching must not change what a request gets. Run the mix again one request at a time
# — the same engine with a scheduler of one row — and compare with the batched run
# above. On the CPU the logits are the same to the last bits except where BLAS sums a
# row in another order inside a bigger matrix; that can only flip a near tie, so
# `agrees` stops comparing at the first step whose two best tokens are within $10^{-4}$,
# and we count how often it had to.

# %% tags=["hide-input"]
engine = llm.llm_engine
engine.scheduler.max_num_seqs = 1  # one request at a time
t0 = time.perf_counter()
single = llm.generate(prompts, mix, use_tqdm=False)
single_seconds = time.perf_counter() - t0
engine.scheduler.max_num_seqs = engine.max_num_seqs
checks = [
    agrees(
        a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].token_ids, tie=1e-4
    )
    for a, b in zip(single, outs)
]
num_ties = sum(tie for _, tie in checks)
print(
    f"{sum(ok for ok, _ in checks)}/{len(checks)} requests agree batched and alone; "
    f"{num_ties} comparison(s) stopped at a near tie"
)
print(
    f"one at a time {single_seconds:.1f} s, all {len(prompts)} batched "
    f"{batched_seconds:.1f} s on this CPU"
)
assert all(ok for ok, _ in checks)
prose.glue("ch09_cpu_speedup", f"{single_seconds / batched_seconds:.1f}×")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
Batched, the {{ch09_cpu_speedup}} speed-up comes from reading SmolLM2's float32 weights
once per step for all the rows instead of once per row; the requests' attention still
loops over them one by one in NumPy. `tests/test_batching.py` runs the same comparison
on 64 requests of prompts from 1 to 300 tokens, answers of 1 to 64, eos, stop strings
and seeds.
""")

# %% [markdown]
# ## On the GPU: ragged prefills and a decode step ready for graphs
#
# Nothing in the runner changes for batches — it was written for them. Two things are
# worth seeing on the GPU.
#
# **Ragged prefill.** A prefill step packs prompts of different lengths back to back,
# with no padding: `query_start_loc` marks where each begins, and chapter 7's flash
# kernel runs every one of them in a single launch, each causal within itself (its grid
# has a slice per sequence, as tall as the longest one's tiles; a slice past a shorter
# sequence's end returns at once). The linear layers see one matrix of all the prompts'
# tokens — the large, efficient GEMMs cuBLAS is made for — and the head runs only on
# each prompt's last row, gathered.
#
# **A decode step that could be a graph.** Chapter 11 will capture a decode step as a
# CUDA graph, once per batch size, and replay it. A graph freezes every launch — its
# kernel, its grid and its arguments — so a capturable step must (1) write only into
# buffers made beforehand and (2) let no host value that changes from step to step reach
# a grid or an argument. The runner already does (1): it copies the step's token ids,
# positions and metadata into buffers it made once, and a decode step allocates nothing.
# And (2): the batch's size picks the kernels (GEMV for one row, cuBLAS above) and the
# grids, and is fixed per graph; decode attention's splits are worked out on the GPU
# from `seq_lens` (chapter 8); the sampler runs one kernel for greedy and sampled rows
# alike (chapter 8b). The contexts may grow; the launches stay the same.
#
# On a GPU, this cell runs the mix on SmolLM2, batched and one at a time, and measures
# the device memory that decode steps take (the context's free memory before and after;
# the test `tests/test_model_runner.py` also counts numba's allocations one by one).
#
# **Batched is not bit for bit alone on a GPU.** A one-request decode step multiplies by
# the weights with chapter 6's GEMV, a batched one with cuBLAS; decode attention splits
# a context over more blocks when the batch is small. Each sums in its own order, and
# every bf16 rounding of an activation that lands on the other side of a boundary moves
# the next layer a little: the log-probabilities of the two runs differ by about a
# hundredth on average and by up to a few hundredths. So two tokens whose
# log-probabilities are within about 0.1 can swap. The check compares up to the first
# step where the one-at-a-time run's two best tokens are that close, and asks the shared
# tokens' log-probabilities to agree to 0.05 on average. (Engines that must give
# identical answers in any batch use *batch-invariant* kernels, which fix one summation
# order for every batch size, at some cost in speed.)


# %%
def shared_logprob_gaps(a, b) -> np.ndarray:
    """|Δ log p| of the chosen tokens of two completions, over the steps where they
    chose the same so far.
    """
    gaps = []
    for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            break
        gaps.append(abs(a.logprobs[t][x] - b.logprobs[t][y]))
    return np.array(gaps)


if has_gpu():
    gpu = LLM("smollm2", device="cuda", max_model_len=512, max_num_seqs=len(prompts))
    gpu_batched = gpu.generate(prompts, mix, use_tqdm=False)
    gpu.llm_engine.scheduler.max_num_seqs = 1
    gpu_single = gpu.generate(prompts, mix, use_tqdm=False)
    checks = [
        agrees(
            a.outputs[0].token_ids,
            a.outputs[0].logprobs,
            b.outputs[0].token_ids,
            tie=0.1,
        )
        for a, b in zip(gpu_single, gpu_batched)
    ]
    gaps = np.concatenate(
        [
            shared_logprob_gaps(a.outputs[0], b.outputs[0])
            for a, b in zip(gpu_single, gpu_batched)
        ]
    )
    print(
        f"GPU: {sum(ok for ok, _ in checks)}/{len(checks)} agree batched and alone "
        "up to a near tie (0.1; "
        f"{sum(t for _, t in checks)} stopped at one); |Δ log p| of shared tokens: "
        f"mean {gaps.mean():.4f}, "
        f"max {gaps.max():.4f}"
    )
    assert all(ok for ok, _ in checks) and gaps.mean() <= 0.05
    engine = gpu.llm_engine
    engine.scheduler.max_num_seqs = engine.max_num_seqs
    for i, p in enumerate(prompts):
        engine.add_request(
            f"g{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        )
    engine.step()  # the prefill
    engine.step()  # a first decode step: compiles and loads what decode steps launch
    free_before = cuda.current_context().get_memory_info().free
    for _ in range(10):
        engine.step()  # decode steps
    cuda.synchronize()
    used = free_before - cuda.current_context().get_memory_info().free
    print(
        f"10 decode steps of {len(prompts)} requests: {used} bytes of device memory "
        "taken"
    )
    assert used == 0
    while engine.has_unfinished_requests():
        engine.step()
    del gpu, engine
else:
    print(
        "no GPU here: the GPU half runs on a GPU (tests/test_batching.py checks it "
        "there)"
    )

# %% [markdown]
# ## Checking the engine against transformers
#
# The engine adds a cache, a sampler, a scheduler and a loop to chapter 7's forward
# pass, so we check it end to end: run it on a folder, then give `transformers`
# (float32, CPU) the prompt followed by the engine's greedy tokens, in one forward pass.
# Two things must hold:
#
# - **teacher-forced log-probabilities**: at every position, the log-probability of the
#   next token — prompt tokens from the prefill, generated tokens from the cached decode
#   steps — agree to $10^{-3}$;
# - **greedy tokens**: at each step, the engine's token is `transformers`' argmax given
#   the same prefix. Float32 sums in a different order can flip a near tie, and after a
#   flip the two continue from different texts. So at the first disagreement we look at
#   `transformers'` margin between its choice and ours: below $10^{-3}$ it is a tie, and
#   the comparison stops there and passes; above, it fails.
#
# `python -m tinyvllm_lib verify FOLDER` runs this on any folder — your own Llama 3.2
# 1B, say.

# %%
#| export engine.verify
from dataclasses import dataclass

import numpy as np

from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.kernels.softmax import log_softmax

TIE_MARGIN = 1e-3


def transformers_log_probs(folder, token_ids) -> np.ndarray:
    """transformers' log-softmax at every position of `token_ids` (float32, CPU): (len,
    vocab).
    """
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        raise ImportError(
            "verify needs transformers and torch: pip install -e '.[test]' (or "
            "transformers and a CPU torch)"
        ) from None
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0]
    return log_softmax(logits.float().numpy())


def greedy_agreement(
    tokens, ref_log_probs: np.ndarray, tie_margin: float = TIE_MARGIN
) -> tuple[int, bool]:
    """(steps that agree, passed): ref_log_probs[t] is the reference's distribution for
    step t after our tokens before it.

    At the first step where our token is not the reference's argmax, stop: passed if the
    reference ranks ours within tie_margin of its best (a near tie), failed otherwise.
    """
    for step, token in enumerate(tokens):
        best = int(np.argmax(ref_log_probs[step]))
        if best != token:
            return step, bool(
                ref_log_probs[step, best] - ref_log_probs[step, token] < tie_margin
            )
    return len(tokens), True


@dataclass
class VerifyResult:
    num_prompt_tokens: int
    num_steps: int
    # max |log p - log p_hf| over the prompt's teacher-forced positions
    max_prompt_diff: float
    max_decode_diff: float  # the same for the generated tokens (the cached decode path)
    greedy_steps: int  # steps whose tokens agree before the first tie (or mismatch)
    greedy_ok: bool
    tolerance: float

    @property
    def passed(self) -> bool:
        return (
            self.greedy_ok
            and max(self.max_prompt_diff, self.max_decode_diff) <= self.tolerance
        )

    def report(self) -> str:
        tie = (
            ""
            if self.greedy_steps == self.num_steps
            else (" (then a near tie)" if self.greedy_ok else " (then a real mismatch)")
        )
        return (
            f"prompt: {self.num_prompt_tokens} tokens, max |log p - log p_hf| = "
            f"{self.max_prompt_diff:.2e}\n"
            f"decode: {self.num_steps} greedy steps, max |log p - log p_hf| = "
            f"{self.max_decode_diff:.2e}; "
            f"tokens agree for {self.greedy_steps}/{self.num_steps}{tie}\n"
            f"{'PASS' if self.passed else 'FAIL'} (tolerance {self.tolerance:g})"
        )


def verify_against_transformers(
    llm, prompt_token_ids, num_steps: int = 32, tolerance: float = 1e-3
) -> VerifyResult:
    """Greedy-generate num_steps tokens with the engine, then check log-probs and tokens
    with transformers.
    """
    params = SamplingParams(
        temperature=0,
        max_tokens=num_steps,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
    )
    out = llm.generate([list(prompt_token_ids)], params, use_tqdm=False)[0]
    prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    # row t: the distribution of token t + 1
    ref = transformers_log_probs(llm.folder, prompt + tokens)
    ours_prompt = np.array(
        [next(iter(step.values())) for step in out.prompt_logprobs[1:]]
    )
    ref_prompt = ref[np.arange(len(prompt) - 1), prompt[1:]]
    ours_decode = np.array(
        [step[t] for step, t in zip(out.outputs[0].logprobs, tokens)]
    )
    decode_rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    steps, greedy_ok = greedy_agreement(tokens, decode_rows)
    ref_decode = decode_rows[np.arange(len(tokens)), tokens]
    return VerifyResult(
        len(prompt),
        len(tokens),
        float(np.abs(ours_prompt - ref_prompt).max(initial=0)),
        float(np.abs(ours_decode - ref_decode).max(initial=0)),
        steps,
        greedy_ok,
        tolerance,
    )


def default_prompt(llm) -> list[int]:
    """A fixed prompt: the chat template's question if the folder has one, else text,
    else fixed token ids.
    """
    tok = llm.tokenizer
    if tok is not None and tok.chat_template is not None:
        return tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=True,
        )
    if tok is not None:
        return tok.encode("The capital of France is")
    return np.random.default_rng(0).integers(0, llm.config.vocab_size, 16).tolist()


# %% [markdown]
# On SmolLM2 (the engine we already have) and on a small random-weight Llama with
# grouped heads, `head_dim` 64 and Llama 3 rope scaling (`tests/test_llm_api.py` covers
# more shapes):

# %%
from tinyvllm_lib.engine.verify import default_prompt, verify_against_transformers

try:
    import transformers  # noqa: F401
except ImportError:
    print(
        "transformers is not installed: skipping the comparison (pip install -e "
        "'.[test]')"
    )
else:
    result = verify_against_transformers(llm, default_prompt(llm), num_steps=16)
    print("SmolLM2:\n" + result.report())
    assert result.passed
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_llama_config(
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=512,
            rope_scaling=scaling,
        )
        tiny = LLM(make_random_llama(tmp, cfg, seed=3), device="cpu", max_model_len=128)
        result = verify_against_transformers(tiny, default_prompt(tiny), num_steps=32)
    print("random Llama (GQA 8/2, head_dim 64, llama3 scaling):\n" + result.report())
    assert result.passed

# %% [markdown]
# ## The command line
#
# Three commands join `prepare` (chapter 2b). `generate` streams its answer through the
# `stream` hook as it is produced; `chat` keeps a conversation going in the terminal;
# `verify` runs the comparison above on a folder. They serve one conversation, so their
# engine has one row (`--max-num-seqs 1`: a cache for one sequence, not 256).
# `./dev.sh run` is
# `python -m tinyvllm_lib generate "What is the capital of France?" --chat`.

# %% tags=["hide-input"]
#| export cli_args
"""The engine's and the sampler's command-line flags, shared by the commands that
make an engine (generate, chat, verify; serve and bench have their own lists).
"""
import argparse


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """--quantization and --quantize-lm-head: chapter 15's 8-bit weights (default:
    bf16)."""
    from tinyvllm_lib.quantization.formats import QUANTIZATIONS

    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS,
        help="store the weights in 8 bits, quantized as they load (chapter 15); "
        "default: bf16",
    )
    parser.add_argument(
        "--quantize-lm-head", action="store_true",
        help="the LM head in 8 bits too (default: bf16; needs --quantization)",
    )


def quantization_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields add_quantization_argument's flags set."""
    return dict(quantization=args.quantization,
                quantize_lm_head=args.quantize_lm_head)


def add_engine_arguments(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The flags that make the engine: the model, its device and its limits."""
    if model:
        parser.add_argument(
            "--model",
            default="smollm2",
            help="a known model name (smollm2) or a Hugging Face folder",
        )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda when it can, else cpu",
    )
    parser.add_argument(
        "--max-model-len", type=int, help="the longest prompt + answer, in tokens"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the engine's seed (for requests without --sample-seed)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=1,
        help="requests the engine runs at once (1: one conversation)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="launch every kernel from Python (no CUDA graphs, chapter 11)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="graphs, but the host and the GPU take turns (chapter 11's overlap off)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="processes the model is split over (chapter 13)")
    add_quantization_argument(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="at most this many new tokens"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default here) = greedy"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sample-seed", type=int, help="the request's own seed")
    parser.add_argument(
        "--stop", action="append", help="a stop string (repeat for more)"
    )
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(args: argparse.Namespace):
    """The SamplingParams the sampling flags ask for."""
    from tinyvllm_lib.engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields that add_engine_arguments' flags set (every engine
    command's: generate, chat, bench, serve)."""
    return dict(
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=False if args.no_async_scheduling else None,
        tensor_parallel_size=args.tensor_parallel_size,
        **quantization_kwargs(args),
    )


def load_llm(args: argparse.Namespace, model: str):
    """The LLM the engine flags ask for, on `model` (a name or a folder)."""
    from tinyvllm_lib.engine.llm import LLM

    return LLM(model, **engine_kwargs(args))


# %% tags=["hide-input"]
#| export cli
import argparse
import sys
import time

from tinyvllm_lib.cli_args import (
    add_engine_arguments,
    add_sampling_arguments,
    load_llm,
    sampling_params_from,
)


def _print_piece(index: int, text: str) -> None:
    print(text, end="", flush=True)


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template, as a user message",
    )
    parser.add_argument("--system", help="a system message (with --chat)")
    add_engine_arguments(parser)
    add_sampling_arguments(parser)


@command(
    "generate",
    "complete a prompt, streaming the text as it is generated",
    _generate_arguments,
)
def generate(args: argparse.Namespace) -> int:
    try:
        llm = load_llm(args, args.model)
        params = sampling_params_from(args)
        t0 = time.perf_counter()
        if args.chat:
            messages = (
                [{"role": "system", "content": args.system}] if args.system else []
            ) + [{"role": "user", "content": args.prompt}]
            out = llm.chat(messages, params, use_tqdm=False, stream=_print_piece)[0]
        else:
            out = llm.generate(
                [args.prompt], params, use_tqdm=False, stream=_print_piece
            )[0]
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    seconds = time.perf_counter() - t0
    completion = out.outputs[0]
    print(flush=True)
    print(
        f"[{len(out.prompt_token_ids)} prompt + {len(completion.token_ids)} new "
        f"tokens in {seconds:.1f} s on "
        f"{llm.device}; finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


# %% tags=["hide-input"]
#| export cli
def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--system", help="a system message that starts the conversation"
    )
    add_engine_arguments(parser)
    add_sampling_arguments(parser)


@command(
    "chat",
    "talk with the model in the terminal (/reset starts over; /exit or Ctrl-D ends)",
    _chat_arguments,
)
def chat(args: argparse.Namespace) -> int:
    try:
        llm = load_llm(args, args.model)
        params = sampling_params_from(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print(
        f"chatting with {llm.folder.name} on {llm.device}; /reset starts over, /exit "
        "or Ctrl-D ends",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            out = llm.chat(messages, params, use_tqdm=False, stream=_print_piece)[0]
        except ValueError as err:
            messages.pop()
            print(f"error: {err} (/reset starts a new conversation)", file=sys.stderr)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": out.outputs[0].text})


# %% tags=["hide-input"]
#| export cli
def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a Hugging Face Llama folder (or smollm2)")
    parser.add_argument("--steps", type=int, default=32, help="greedy steps to compare")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest allowed |log p - log p_hf|",
    )
    add_engine_arguments(parser, model=False)


@command(
    "verify",
    "compare the engine with transformers on a folder: log-probs and greedy tokens, "
    "PASS or FAIL",
    _verify_arguments,
)
def verify(args: argparse.Namespace) -> int:
    from tinyvllm_lib.engine.verify import default_prompt, verify_against_transformers

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit(
            "error: verify needs transformers and torch: pip install -e '.[test]'"
        ) from None
    try:
        llm = load_llm(args, args.folder)
        prompt = default_prompt(llm)
        print(
            f"{llm.folder} on {llm.device}: {len(prompt)} prompt tokens, "
            f"{args.steps} greedy steps, against transformers (float32, CPU)"
        )
        result = verify_against_transformers(llm, prompt, args.steps, args.tolerance)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(result.report())
    return 0 if result.passed else 1


# %%
buffer = io.StringIO()
with redirect_stdout(buffer):
    status = main(
        [
            "generate",
            "What is the capital of France?",
            "--chat",
            "--device",
            "cpu",
            "--max-tokens",
            "24",
        ]
    )
print(buffer.getvalue())
assert status == 0 and "Paris" in buffer.getvalue()

# %% [markdown]
# ## How much does batching buy?
#
# Two benchmark scripts record to `book/data/ch09_batching.json`.
# `bench/ch09_batching.py` runs, on the GPU, a random-weight folder of Llama 3.2 1B's
# exact shapes with 64 and with 256 requests whose prompt and output lengths are drawn
# uniformly from [100, 1024] (seed 0, eos ignored, greedy) — the workload nano-vllm
# benchmarks with — and, in the same run, a few of the same requests one at a time. It
# also times one decode step at several batch sizes two ways: from Python as the engine
# runs it, and its kernels alone, replayed from a captured CUDA graph.
# `bench/ch09_batching_cpu.py` runs 16 chat requests on SmolLM2 with the NumPy backend,
# batched and one at a time.

# %% tags=["hide-input"]
records = load_records("ch09_batching")
gpu_runs = sorted(
    (r for r in records if r["name"] == "output_throughput"),
    key=lambda r: r["shape"][0],
)
alone = next((r for r in records if r["name"] == "one_at_a_time"), None)
walls = {r["shape"][0]: r for r in records if r["name"] == "decode_step_wall"}
kernels = {r["shape"][0]: r for r in records if r["name"] == "decode_step_kernels"}
cpu = {
    r["name"]: r for r in records if r["name"] in ("cpu_batched", "cpu_one_at_a_time")
}
for r in gpu_runs:
    n = r["shape"][0]
    prose.glue(f"ch09_tok_{n}", f"{r['value']:,.0f} output tokens/s")
    prose.glue(f"ch09_total_{n}", f"{r['total_tok_s']:,.0f}")
    prose.glue(
        f"ch09_ratio_{n}",
        f"{r['value'] / alone['value']:.0f}×" if alone else "(not yet measured)",
    )
for n in (64, 256):
    if n not in {r["shape"][0] for r in gpu_runs}:
        for key in ("tok", "total", "ratio"):
            prose.glue(f"ch09_{key}_{n}", "(not yet measured)")
prose.glue(
    "ch09_alone", f"{alone['value']:.0f} tokens/s" if alone else "(not yet measured)"
)
prose.glue(
    "ch09_gpu", gpu_runs[0]["device"]["name"] if gpu_runs else "GPU (not yet measured)"
)
sizes = sorted(set(walls) & set(kernels))
for n in sizes:
    prose.glue(f"ch09_wall_{n}", f"{walls[n]['value']:.1f} ms")
    prose.glue(f"ch09_kern_{n}", f"{kernels[n]['value']:.2f} ms")
    prose.glue(f"ch09_lost_{n}", f"{1 - kernels[n]['value'] / walls[n]['value']:.0%}")
for n in (64, 256):
    if n not in sizes:
        for key in ("wall", "kern", "lost"):
            prose.glue(f"ch09_{key}_{n}", "(not yet measured)")
if {64, 256} <= set(sizes):
    # one timing each, so verdict's default noise
    wall_verdict = verdict(
        walls[64]["value"], walls[256]["value"], words=("shorter", "longer")
    )
    lost = 1 - kernels[256]["value"] / walls[256]["value"]
    prose.glue(
        "ch09_wall_sentence",
        "The step from Python at 256 requests is "
        + wall_verdict
        + (
            " of the one at 64: Python's launches cost the same whatever the batch"
            if wall_verdict.startswith("within")
            else " than at 64, far less than the batch grew"
        ),
    )
    prose.glue("ch09_waiting", "most" if lost > 0.5 else "part")
else:
    prose.glue("ch09_wall_sentence", "Python's launches do not depend on the batch")
    prose.glue("ch09_waiting", "part")
if len(cpu) == 2:
    prose.glue(
        "ch09_cpu_bench",
        f"{cpu['cpu_batched']['value'] / cpu['cpu_one_at_a_time']['value']:.1f}×",
    )
    prose.glue("ch09_cpu_name", cpu["cpu_batched"]["device"]["name"])
else:
    prose.glue("ch09_cpu_bench", "(not yet measured)")
    prose.glue("ch09_cpu_name", "(not yet measured)")

if gpu_runs or cpu:
    fig, (ax1, ax2) = new_figure(1, 2, width=10, height=3)
    bars = ([("GPU, one at a time", alone["value"])] if alone else []) + [
        (f"GPU, {r['shape'][0]} requests", r["value"]) for r in gpu_runs
    ]
    bars += [
        (f"CPU, {'batched' if k == 'cpu_batched' else 'one at a time'}", r["value"])
        for k, r in sorted(cpu.items())
    ]
    ax1.barh(
        [b[0] for b in bars],
        [b[1] for b in bars],
        color=["#9ecae1" if "one" in b[0] else "#1f77b4" for b in bars],
    )
    ax1.set_xscale("log")
    plain_log_ticks(ax1, "x")
    ax1.set_xlabel("output tokens/s")
    ax1.tick_params(labelsize=8)
    ax1.set_title("Llama 3.2 1B shapes on the GPU; SmolLM2 on the CPU", fontsize=9)
    if sizes:
        x = np.arange(len(sizes))
        ax2.bar(
            x - 0.2,
            [walls[n]["value"] for n in sizes],
            0.4,
            label="step from Python (wall)",
        )
        ax2.bar(
            x + 0.2,
            [kernels[n]["value"] for n in sizes],
            0.4,
            label="its kernels (graph replay)",
        )
        ax2.set_xticks(x, [str(n) for n in sizes])
        ax2.set_xlabel("requests in the decode step")
        ax2.set_ylabel("ms")
        # below the axes, so no bar hides behind it
        ax2.legend(
            fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2,
            frameon=False,
        )  # fmt: skip
        ax2.set_title(
            f"a decode step on the {walls[sizes[0]]['device']['name']}", fontsize=9
        )
    plt.show()
else:
    print(
        "nothing recorded yet: run bench/ch09_batching.py on a GPU and "
        "bench/ch09_batching_cpu.py"
    )

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch09_gpu}}, one request at a time makes {{ch09_alone}}. Batched, 64 ragged
requests make {{ch09_tok_64}} ({{ch09_total_64}} counting the prompts' tokens too),
{{ch09_ratio_64}} more, and 256 make {{ch09_tok_256}} ({{ch09_total_256}} in all,
{{ch09_ratio_256}}). On the CPU ({{ch09_cpu_name}}), batching 16 requests is
{{ch09_cpu_bench}} faster than one at a time.

The right panel shows what is left. A decode step of 64 requests takes {{ch09_wall_64}}
from Python and {{ch09_kern_64}} of kernels; at 256 requests, {{ch09_wall_256}} against
{{ch09_kern_256}}. {{ch09_wall_sentence}}, so the more requests share a step, the
smaller their share — {{ch09_lost_64}} of the step at 64 requests, {{ch09_lost_256}} at
256 — but the GPU still spends {{ch09_waiting}} of each step waiting.
Two chapters fix the rest: chapter 10 makes room for many more requests (a contiguous
row for every possible token is a poor use of memory), and chapter 11 replays each
decode step from a CUDA graph instead of launching it.
""")

# %% [markdown]
# ## Summary
#
# - Batching shares a step's fixed costs — reading the weights, launching the kernels —
#   among all the requests in it. Static batching wastes padding, idle rows and waiting;
#   continuous batching admits and retires requests at every step.
# - The scheduler keeps waiting and running requests, admits prompts in arrival order
#   under `max_num_seqs`, the cache's rows and `max_num_batched_tokens`, and makes each
#   step a prefill of the newly admitted or a decode of everyone running; a finished
#   request frees its row at once.
# - `LLMEngine.step()` = schedule → execute → postprocess; `add_request` and
#   `abort_request` work between any two steps; `LLM.generate` adds every prompt and
#   steps until all are done.
# - Prefills are ragged batches in one launch; a decode step writes only into buffers
#   made beforehand and keeps its launches fixed while contexts grow, ready for CUDA
#   graphs.
# - Batched and one at a time, the answers are the same up to near ties.
#
# Exported to `tinyvllm_lib`: `engine.scheduler` (`Scheduler`), `engine.config`
# (`resolve_device`, the defaults), `engine.inputs` (`make_request`,
# `normalize_prompt`), `engine.llm` (`LLM`), `engine.verify`
# (`verify_against_transformers`) and the commands `generate`, `chat` and `verify`.
# This chapter's `LLMEngine` is the one you read here; the library's is chapter 10's,
# the same loop on a pool of blocks. `from tinyvllm_lib import LLM, LLMEngine,
# SamplingParams`.
#
# ## Exercises
#
# 1. With `max_num_batched_tokens=512` and prompts of 300 tokens, how many prompts does
#    one prefill step admit? What happens to running requests while it runs? Sketch how
#    splitting a prompt into chunks would change the timeline above.
# 2. Make the scheduler admit the *shortest* waiting prompt first. Run the mix: what
#    happens to the average time to the first token, and to the longest wait?
# 3. Predict the output tokens per second of 256 requests from the recorded kernel time
#    of a decode step at 256 rows if Python's launches cost nothing. How far is that
#    from the limit one request could reach at the bandwidth ceiling (chapter 8's
#    $B / W$)?
# 4. Change the scheduler to put prefills and decodes in the same step. Which chapter-11
#    graphs would that break, and what would it buy in time to first token?
# 5. In `LLM.generate`, the progress bar counts prompt tokens only once a request
#    finishes. What does vLLM's show, and which one tells you more while a long batch
#    runs?
