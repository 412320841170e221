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
# # 8b. Generating text: sampling, stopping, streaming
#
# Chapter 8 gave the model a KV cache: each step now computes only its new tokens and
# returns their logits. Turning logits into an answer takes three more ideas, and this
# chapter builds them: **choosing** each next token the way vLLM does (temperature,
# top-k, top-p, a seed per request), knowing when to **stop**, and **streaming** text
# while it is generated. Then it puts the step itself behind one object, the **model
# runner**, which the engine of chapter 9 will call — and generates answers with it, on
# the CPU and on the GPU.
#
# In this chapter you will learn:
#
# - **sampling** as vLLM does it: the penalties, temperature, then top-k, then top-p,
#   then a draw from the request's own random generator — checked as a distribution
#   with a chi-square test — and the same on the GPU, as a radix select whose launches
#   never depend on the settings, with each request's token counts kept on the GPU;
# - when to **stop** (end-of-sequence ids, stop strings, stop tokens, a length limit)
#   and how to **stream** text when a character spans several tokens;
# - the **model runner**: one object for both devices that turns "these requests, these
#   many new tokens each" into sampled tokens — the step's arrays, the layer loop, the
#   LM head on the rows that need it, the sampler;
# - how fast one request at a time goes, on the CPU against `transformers` and on the
#   GPU, where launching kernels from Python costs far more than running them.
#
# It uses the cache, block tables and attention objects of [chapter 8](08_kv_cache.py),
# the forward pass of [chapter 7](07_attention.py) and the tokenizer of
# [chapter 3](03_first_kernel.py).

# %%
#| default_exp engine.model_runner

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda

from tinyvllm_lib.engine.contiguous_allocator import ContiguousAllocator
from tinyvllm_lib.kernels.softmax import log_softmax
from tinyvllm_lib.measure import bandwidth_ceiling, ceiling_phrase, load_records
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, has_gpu, where_kernels_run
from tinyvllm_lib.tokenizer import Tokenizer

rng = np.random.default_rng()
# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()
# chapter 2b: built on first use, then found in the cache
folder = resolve_model("smollm2")
smollm2 = ModelConfig.from_folder(folder)
tokenizer = Tokenizer.from_folder(folder)
question = [{"role": "user", "content": "What is the capital of France?"}]
print(where_kernels_run())

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## Sampling: choosing the next token
#
# The logits $z$ of the last position define a distribution over the vocabulary,
# $p_i = e^{z_i} / \sum_j e^{z_j}$. vLLM reshapes it in a fixed order, and so do we:
#
# 1. **Temperature** $T$: $p_i \propto e^{z_i / T}$. $T < 1$ sharpens, $T > 1$ flattens;
#    $T = 0$ means **greedy**, the argmax.
# 2. **Min-p**: keep the tokens at least `min_p` ($p_{\min}$) times as likely as the
#    most likely one, $p_i \ge p_{\min} \cdot \max_j p_j$ ($0$ = off).
# 3. **Top-k**: keep the $k$ largest logits (and any tied with the $k$-th), drop the
#    rest.
# 4. **Top-p** (nucleus): keep the smallest set of most likely tokens whose probability
#    reaches $p$ — token $i$ stays if the tokens *more likely than it* hold less than
#    $p$: $\sum_{j:\, z_j > z_i} p_j < p$. A tie at the boundary stays whole, as top-k
#    keeps ties with the $k$-th: which of two equal logits survives must not depend on
#    their positions in the vocabulary.
# 5. **Sample** from the renormalised rest.
#
# This is the order of vLLM's (v1) sampler, which applies min-p with the logits
# processors that keep the argmax, before top-k and top-p. Before all of them come the
# **penalties** against repeating the prompt or the answer so far; they need each
# request's tokens, and wait for the section on the GPU below, where those tokens are
# not on the host.
#
# The parameters live in `SamplingParams`, with vLLM's names and defaults, checked when
# it is made:

# %%
#| export engine.sampling_params
#| public SamplingParams
import enum
import math
from dataclasses import dataclass

SAMPLING_EPS = 1e-5  # a temperature below this means greedy (vLLM's _SAMPLING_EPS)
FLOAT32_TINY = 1.1754944e-38  # the smallest normal float32


class RequestOutputKind(enum.Enum):
    """Which steps give a request's RequestOutput (vLLM's names; its DELTA is not
    here): CUMULATIVE every step it progresses, FINAL_ONLY when it finishes.
    """

    CUMULATIVE = 0
    FINAL_ONLY = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


@dataclass
class SamplingParams:
    """How to choose each next token and when to stop; vLLM's field names, defaults and
    meanings.
    """

    n: int = 1  # completions per prompt (only 1 here)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # 0 = off; else keep p_i >= min_p * max p
    presence_penalty: float = 0.0  # 0 = off; minus this if in the output so far
    frequency_penalty: float = 0.0  # 0 = off; minus this times its output count
    repetition_penalty: float = 1.0  # 1 = off; in the prompt or output: z / r, z * r
    seed: int | None = None  # None: the LLM's generator
    stop: str | list[str] | None = None  # stop strings: the text ends before them
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as max_model_len allows
    logprobs: int | None = None  # per step, the sampled token's log-prob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # LLM.generate asks for FINAL_ONLY when nothing streams (an output per step costs)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(
                "n must be 1: this engine returns one completion per prompt, got "
                f"{self.n!r}"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(
                "temperature must be a finite number >= 0 (0 = greedy), got "
                f"{self.temperature!r}"
            )
        # as float32 (what the sampler reads) too: 1e-46 would be 0
        if not _is_number(self.top_p) or not FLOAT32_TINY <= self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        # an int64 on the GPU: 2**31 - 1 is more than any vocabulary
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise ValueError(
                f"top_k must be -1 or 0 (off) or a positive integer below 2**31, got "
                f"{self.top_k!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        # float32 on the GPU: 1e-46 would be 0
        r = self.repetition_penalty
        if not _is_number(r) or not FLOAT32_TINY <= r < 3.4e38:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}"
            )
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or self.max_tokens < 1
        ):
            raise ValueError(
                f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(
                    f"{name} must be None or an integer >= 0 (how many top "
                    f"alternatives), got {value!r}"
                )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stop = (
            []
            if self.stop is None
            else [self.stop]
            if isinstance(self.stop, str)
            else self.stop
        )
        if not isinstance(stop, (list, tuple)) or not all(
            isinstance(s, str) and s for s in stop
        ):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
            _is_int(i) and i >= 0 for i in ids
        ):
            raise ValueError(
                "stop_token_ids must be a list of token ids (integers >= 0), got "
                f"{self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (they need the row's counts)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


# %%
from tinyvllm_lib.engine.sampling_params import SamplingParams

for bad in (
    {"temperature": -0.5},
    {"top_p": 0.0},
    {"top_k": -3},
    {"min_p": 1.5},
    {"max_tokens": 0},
    {"n": 2},
    {"stop": [""]},
):
    try:
        SamplingParams(**bad)
    except ValueError as err:
        print(f"{bad}: {err}")
    else:
        raise AssertionError(f"{bad} was accepted")

# %% [markdown]
# The sampler works on a **batch**: logits `(batch, vocab)` and, per row, the settings
# as arrays — `SamplingMetadata`. That is the interface a GPU sampling kernel will
# implement too: the same metadata in, token ids out. Randomness stays on the host: each
# row brings one uniform number $u \in [0, 1)$ drawn from its request's own
# `numpy.random.Generator` — seeded from the request's `seed`, or the engine's generator
# otherwise — so the same seed gives the same tokens on any device. The draw is by
# **inverse CDF**: the sampled token is the first whose cumulative probability exceeds
# $u$.
#
# First the four transformations, each a function of a batch, each formula above its
# code ($m$ is the row's largest logit after temperature; min-p is a threshold on
# $z_i - m$, since $p_i / p_{\max} = e^{z_i - m}$):
#
# $$ z_i \leftarrow z_i / T \qquad z_i \leftarrow -\infty \text{ if }
#    z_i - m < \log p_{\min} \qquad z_i \leftarrow -\infty \text{ if }
#    z_i < z_{(k)} \qquad z_i \leftarrow -\infty \text{ if }
#    \textstyle\sum_{j:\, z_j > z_i} p_j \ge p $$

# %%
#| export engine.sampler
from dataclasses import dataclass

import numpy as np

from tinyvllm_lib.engine.sampling_params import SamplingParams
from tinyvllm_lib.kernels.softmax import log_softmax


def apply_penalties(
    logits: np.ndarray,
    tokens: list,
    repetition: np.ndarray,
    frequency: np.ndarray,
    presence: np.ndarray,
) -> np.ndarray:
    """vLLM's penalties, in its order, on each row whose tokens[row] is (prompt ids,
    output ids) (None: left alone): a token in either is divided by r where its logit
    is positive, multiplied by r elsewhere; then minus f times its output count, minus
    p if it is in the output.
    """
    out = logits.copy()
    vocab = logits.shape[1]
    for row, pair in enumerate(tokens):
        if pair is None:
            continue
        prompt, output = (np.asarray(ids, np.int64) for ids in pair)
        counts = np.bincount(output, minlength=vocab).astype(np.float32)
        in_output = (counts > 0).astype(np.float32)
        is_seen = counts > 0
        is_seen[prompt] = True
        z, r = out[row], repetition[row]
        z = np.where(is_seen, np.where(z > 0, z / r, z * r), z)
        out[row] = z - frequency[row] * counts - presence[row] * in_output
    return out


def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """z / T per row (rows with T = 0 are greedy and left alone)."""
    return (
        logits / np.where(temperature > 0, temperature, 1).astype(np.float32)[:, None]
    )


def apply_min_p(logits: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Keep tokens with z - max z >= log(min_p) (float32, as the GPU compares them),
    -inf elsewhere; min_p = 0 keeps all.
    """
    out = logits.copy()
    for row in np.flatnonzero(min_p > 0):
        floor = np.float32(np.log(np.float64(min_p[row])))
        out[row, logits[row] - logits[row].max() < floor] = -np.inf
    return out


def apply_top_k(logits: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Keep each row's k largest logits (and ties with the k-th), -inf elsewhere; k = 0
    keeps all.
    """
    out = logits.copy()
    vocab = logits.shape[1]
    for row in np.flatnonzero((top_k > 0) & (top_k < vocab)):
        # the k-th largest
        kth = np.partition(logits[row], vocab - top_k[row])[vocab - top_k[row]]
        out[row, logits[row] < kth] = -np.inf
    return out


def apply_top_p(logits: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Keep each token whose more likely tokens hold less than p of the probability
    (the first always; a tie at the boundary whole), -inf elsewhere.
    """
    out = logits.copy()
    for row in np.flatnonzero(top_p < 1):
        order = np.argsort(-logits[row], kind="stable")  # most likely first
        z = logits[row, order]
        probs = np.exp(z - z[0], dtype=np.float64)
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        # the mass strictly above a token: the mass before the first of its value
        first_of_value = np.searchsorted(-z, -z, side="left")
        out[row, order[mass_before[first_of_value] >= top_p[row]]] = -np.inf
    return out


def sample_inverse_cdf(logits: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row, the first token whose cumulative probability exceeds u (tokens at -inf
    are never chosen).
    """
    # unnormalised
    probs = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)
    cdf = np.cumsum(probs, axis=1)
    # how many cumulative sums u has passed
    ids = (cdf <= (uniform * cdf[:, -1])[:, None]).sum(axis=1)
    # guards u * total rounding up
    last_possible = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)
    return np.minimum(ids, last_possible)


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of each row, most likely first: (ids (rows, k),
    log-probs (rows, k)).
    """
    k = min(k, logprobs.shape[1])
    ids = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(logprobs, ids, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(
        values, order, axis=1
    )


def logprobs_of(logits: np.ndarray, token_ids, k: int) -> tuple:
    """Each row's log-prob of token_ids[row] and (k > 0) its k most likely tokens:
    (chosen (rows,), top ids (rows, k) or None, top log-probs (rows, k) or None). What a
    sampled row's `logprobs` and a prompt's `prompt_logprobs` both ask for.
    """
    logprobs = log_softmax(np.asarray(logits, np.float32))
    chosen = logprobs[np.arange(len(logprobs)), np.asarray(token_ids)]
    return (chosen, *top_logprobs(logprobs, k)) if k > 0 else (chosen, None, None)


# %% [markdown]
# Then the sampler: the metadata (one row per sequence), the output, and the NumPy
# implementation. Log-probabilities, when asked for, are those of the model's raw logits
# — before temperature, top-k and top-p — as vLLM returns them by default. A request's
# settings do not change while it runs, so each request makes its row once
# (`settings_row`: the bytes of one row of a structured array); a step joins its rows'
# bytes into one buffer and reads each field as a column (`from_settings`), instead of
# a Python list per field and row every step (chapter 11 measures what that saved).


# %%
#| export engine.sampler
@dataclass
class SamplingMetadata:
    """A batch's sampling settings, one row per sequence, as arrays: what a sampler
    (NumPy or GPU kernel) reads.
    """

    temperature: np.ndarray  # (batch,) float32; 0 = greedy
    top_k: np.ndarray  # (batch,) int64; 0 = off
    top_p: np.ndarray  # (batch,) float32; 1 = off
    # (batch,) float64 in [0, 1): the row's draw, from its request's generator
    uniform: np.ndarray
    # (batch,) int64; -1 = none, k >= 0 = the sampled token's and the top k
    num_logprobs: np.ndarray
    min_p: np.ndarray | None = None  # (batch,) float32; 0 = off (None: all 0)
    # (batch,) float32 each (None: all off): 1 = off, then 0 = off, 0 = off
    repetition_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    # the NumPy sampler's counts: per row, (prompt ids, output ids) where it has
    # penalties, else None (the request's own lists, not copies); None: no row has
    penalty_tokens: list | None = None
    # (batch,) int32: the GPU's count slot of each row (-1: none), set by the runner
    penalty_slot: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.temperature)
        for name, off in (("min_p", 0), ("repetition_penalty", 1),
                          ("frequency_penalty", 0), ("presence_penalty", 0)):
            if getattr(self, name) is None:
                setattr(self, name, np.full(n, off, np.float32))
        if self.penalty_slot is None:
            self.penalty_slot = np.full(n, -1, np.int32)

    @property
    def has_penalties(self) -> bool:
        """Whether some row has a penalty on."""
        return bool(
            (self.repetition_penalty != 1).any()
            or self.frequency_penalty.any()
            or self.presence_penalty.any()
        )

    @property
    def argmax_only(self) -> bool:
        """Whether every row's token is its argmax and nothing else is asked: all
        greedy (vLLM's all_greedy), no penalties, no log-probs.
        """
        return bool(
            not (self.temperature > 0).any()
            and not self.has_penalties
            and self.num_logprobs.max(initial=-1) < 0
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[np.random.Generator],
        tokens: list | None = None,
    ) -> "SamplingMetadata":
        """One row per request; each sampled row draws its uniform from its own
        generator (greedy rows draw none). tokens: per row (prompt ids, output ids),
        kept for the rows with penalties.
        """
        rows = b"".join(settings_row(p) for p in params)
        return cls.from_settings(rows, generators, tokens)

    @classmethod
    def from_settings(
        cls,
        rows: bytes,
        generators: list[np.random.Generator],
        tokens: list | None = None,
    ) -> "SamplingMetadata":
        """from_params from the rows' settings_row bytes, one after another (a request
        makes its row once, not once a step): one array for the batch, then a column
        per field.
        """
        table = np.frombuffer(rows, SETTINGS_DTYPE)
        temperature = table["temperature"]
        uniform = np.zeros(len(table))
        drawing = np.flatnonzero(temperature > 0).tolist()  # greedy rows draw none
        pick = [generators[i] for i in drawing]
        if pick and all(g is pick[0] for g in pick):
            # one generator (the engine's, for requests without a seed): one call,
            # the numbers the rows would draw one by one
            uniform[drawing] = pick[0].random(len(pick))
        else:
            uniform[drawing] = [g.random() for g in pick]
        penalized = (
            (table["repetition_penalty"] != 1)
            | (table["frequency_penalty"] != 0)
            | (table["presence_penalty"] != 0)
        )
        floats = {
            name: table[name].astype(np.float32)
            for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                         "frequency_penalty", "presence_penalty")
        }
        return cls(
            **floats,
            top_k=np.ascontiguousarray(table["top_k"]),
            uniform=uniform,
            num_logprobs=np.ascontiguousarray(table["num_logprobs"]),
            penalty_tokens=(
                [t if is_on else None for t, is_on in zip(tokens, penalized.tolist())]
                if tokens is not None and penalized.any()
                else None
            ),
        )


# a request's sampling settings as SamplingMetadata's row holds them
SETTINGS_DTYPE = np.dtype([
    ("temperature", np.float64), ("top_k", np.int64), ("top_p", np.float64),
    ("min_p", np.float64), ("num_logprobs", np.int64),
    ("repetition_penalty", np.float64), ("frequency_penalty", np.float64),
    ("presence_penalty", np.float64),
])


def settings_row(p: SamplingParams) -> bytes:
    """p as the bytes of a row of SETTINGS_DTYPE: temperature 0 when greedy, top_k 0
    when off, num_logprobs -1 when none. A step joins its rows' bytes: one buffer, not
    a conversion per row and field.
    """
    row = (
        0.0 if p.is_greedy else p.temperature, max(p.top_k, 0), p.top_p, p.min_p,
        -1 if p.logprobs is None else p.logprobs, p.repetition_penalty,
        p.frequency_penalty, p.presence_penalty,
    )
    return np.array(row, SETTINGS_DTYPE).tobytes()


@dataclass
class SamplerOutput:
    """The chosen tokens, and the log-probabilities the requests asked for."""

    token_ids: np.ndarray  # (batch,) int64
    # (batch,) float32: log p of each chosen token under the raw logits
    logprobs: np.ndarray | None = None
    # (batch, k): the most likely tokens, most likely first
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None  # (batch, k)


class Sampler:
    """The CPU sampler: logits (batch, vocab) and per-row settings -> token ids;
    penalties, temperature, min-p, top-k, top-p, draw.
    """

    def __call__(self, logits: np.ndarray, metadata: SamplingMetadata) -> SamplerOutput:
        logits = np.asarray(logits, np.float32)
        if logits.ndim != 2 or logits.shape[0] != len(metadata.temperature):
            raise ValueError(
                "logits must be (batch, vocab) with one row per sequence, got "
                f"{logits.shape}"
            )
        if metadata.penalty_tokens is not None:  # greedy rows too
            m = metadata
            logits = apply_penalties(
                logits, m.penalty_tokens, m.repetition_penalty, m.frequency_penalty,
                m.presence_penalty,
            )
        token_ids = np.argmax(logits, axis=1)  # greedy rows keep this
        rows = np.flatnonzero(metadata.temperature > 0)
        if rows.size:
            z = apply_temperature(logits[rows], metadata.temperature[rows])
            z = apply_min_p(z, metadata.min_p[rows])
            z = apply_top_k(z, metadata.top_k[rows])
            z = apply_top_p(z, metadata.top_p[rows])
            token_ids[rows] = sample_inverse_cdf(z, metadata.uniform[rows])
        out = SamplerOutput(token_ids)
        k = int(metadata.num_logprobs.max(initial=-1))
        if k >= 0:  # before temperature, top-k and top-p (after the penalties)
            out.logprobs, out.top_ids, out.top_logprobs = logprobs_of(
                logits, token_ids, k
            )
        return out

    def prompt_logprobs(self, logits, targets, k: int) -> tuple:
        """A prompt chunk's log-probs: row t's of targets[t] (the prompt's next token)
        and its top k, as logprobs_of gives them.
        """
        return logprobs_of(logits, targets, k)


# %% [markdown]
# ### Test: the sampler draws from the right distribution
#
# A sampler can return plausible tokens and still be wrong — the wrong top-p boundary, a
# temperature applied twice. So we test it as a distribution. Fix six logits, work out
# by hand the probabilities that each setting should produce, draw many tokens, and
# compare the counts with Pearson's chi-square statistic
#
# $$ \chi^2 = \sum_i \frac{(O_i - E_i)^2}{E_i}, $$
#
# which, if the sampler is right, follows a $\chi^2$ distribution with (categories − 1)
# degrees of freedom; it exceeds its 0.1% critical value once in a thousand runs (so the
# draws below are seeded: a build of the book should not fail by chance). Tokens
# that must never appear are checked to have a count of exactly zero.
# (`tests/test_sampling.py` does this for more settings.)

# %%
from tinyvllm_lib.engine.sampler import Sampler, SamplingMetadata

# P(chi2 > x) = 0.001
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}
small_logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], np.float32)
base = (
    np.exp(small_logits.astype(np.float64))
    / np.exp(small_logits.astype(np.float64)).sum()
)
settings = {  # name: (params, expected probabilities worked out by hand)
    "T = 1": (SamplingParams(), base),
    "T = 0.5": (SamplingParams(temperature=0.5), base**2 / (base**2).sum()),
    "top-k = 3": (SamplingParams(top_k=3), np.r_[base[:3], 0, 0, 0] / base[:3].sum()),
    # mass before token 2: 0.61 < 0.7
    "top-p = 0.7": (
        SamplingParams(top_p=0.7),
        np.r_[base[:3], 0, 0, 0] / base[:3].sum(),
    ),
    # p_i / p_0 = e^(z_i - 2): 0.22 for token 3, 0.14 for token 4
    "min-p = 0.2": (SamplingParams(min_p=0.2), np.r_[base[:4], 0, 0] / base[:4].sum()),
}
num_samples = 20_000
sampler, counts = Sampler(), {}
# seeded: five tests at 0.1% each would fail one build in 200 by chance (60 fresh
# draws of each setting gave chi-square p-values consistent with uniform)
for seed, (name, (params, expected)) in enumerate(settings.items()):
    gen = np.random.default_rng(seed)
    batch = np.tile(small_logits, (num_samples, 1))
    got = sampler(
        batch, SamplingMetadata.from_params([params] * num_samples, [gen] * num_samples)
    ).token_ids
    counts[name] = np.bincount(got, minlength=6)
    is_possible = expected > 0
    assert counts[name][~is_possible].sum() == 0, f"{name}: drew a token it must not"
    want = expected[is_possible] * num_samples
    chi2 = float(((counts[name][is_possible] - want) ** 2 / want).sum())
    print(
        f"{name:>12}: chi2 = {chi2:5.1f} with {is_possible.sum() - 1} degrees of "
        "freedom "
        "(critical value at p = 0.001: "
        f"{CHI2_CRITICAL_0_001[int(is_possible.sum()) - 1]})"
    )
    assert chi2 < CHI2_CRITICAL_0_001[int(is_possible.sum()) - 1]

fig, axes = new_figure(1, len(settings), width=10, height=2.2, sharey=True)
for ax, (name, (_, expected)) in zip(axes, settings.items()):
    ax.bar(range(6), counts[name] / num_samples, color="#1f77b4", label="drawn")
    ax.plot(range(6), expected, "k_", markersize=14, label="expected")
    ax.set_title(name, fontsize=9)
    ax.set_xticks(range(6))
axes[0].set_ylabel("frequency")
axes[0].legend(fontsize=7)
plt.show()

# %% [markdown]
# ### Sampling on the GPU
#
# On the GPU the logits stay on the GPU; only token ids come back. The sampler takes the
# same `SamplingMetadata` as the NumPy one, including each row's uniform number drawn on
# the host from the request's own generator — so a seed gives the same draw on both
# devices. The first rung of the ladder is a block per row: greedy rows take the argmax
# (a block reduction that keeps the first of equal values, as `np.argmax` does). Sampled
# rows find their thresholds without sorting: top-k is the largest value $t$ with at
# least $k$ logits $\ge t$,
# top-p the largest $t$ whose kept mass $\sum_{z_i \ge t} e^{(z_i - m)/T}$ still reaches
# $p$ of the total. Both are found by **bisection** over the 32-bit keys that order
# float32 values like the floats themselves (flip the sign bit of positives, every bit
# of negatives), so 32 passes over the row find the exact threshold. The draw is the
# inverse CDF in token order: each thread sums a contiguous segment, a prefix over the
# threads finds the segment where $u \cdot$ total falls.
#
# A greedy row alone is a poor fit for one block: the row is 128,256 logits, and one
# block of one SM cannot have enough loads in flight to read them at anything like the
# GPU's bandwidth. So a greedy row is cut into **shares**, a block each (the grid is
# rows x shares). Each block finds the largest logit of its share and writes it, with
# its index, to a small workspace; then it makes that visible (`threadfence`) and takes
# a ticket from a per-row counter (`atomic.add`). The block that draws the last ticket
# knows every share is written: it picks the largest of them (the smallest index on
# ties, as before) and sets the counter back to zero for the next launch. No second
# kernel, no host decision. How many shares depends on the batch (`greedy_shares`):
# about 256 blocks in all, so a single row gets 64 and a batch of 256 rows one each. In
# this first rung a sampled row keeps the one-block path (its bisection reads the row up
# to 64 times; the shares past the first return at once) — the next rung fixes that.
#
# One kernel serves every row, greedy or sampled: the row's own temperature decides on
# the GPU, so the launch is the same whatever the batch asks for. That matters in
# chapter 11, where a whole decode step is captured once as a CUDA graph and replayed:
# anything decided on the host — *this batch is all greedy, launch the cheaper argmax* —
# would be frozen into the graph. The kernels know nothing of requests; they go to
# `kernels.sampling`, and the sampler that feeds them to `engine.sampler_cuda`.

# %%
#| export kernels.sampling
import math

from numba import config, cuda, float32, int32, int64, uint32

from tinyvllm_lib.kernels.bf16 import _f32_bits
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

# a power of two: the reductions halve it (512: a sampled row is one block's work, so
# that block wants many loads in flight)
SAMPLER_THREADS = 32 if config.ENABLE_CUDASIM else 512
MAX_THREADS = 1024
# a greedy row's shares: up to this many blocks (the simulator runs each block's threads
# in Python: two shares there still take the combining path)
MAX_SHARES = 2 if config.ENABLE_CUDASIM else 64
# shares for a batch: about this many blocks in all, so that they run in one wave (this
# kernel's 512-thread blocks are few to an SM); more rows, fewer shares, down to one. On
# an H200 (bench/ch11_kernels.py), 64 shares at one row took less than half the time of
# one block; a first rule with 8 shares at 256 rows (2,048 blocks) took longer than one
# block a row there (a run whose record was replaced by this rule's).
SHARE_BLOCKS = 256


def greedy_shares(rows: int) -> int:
    """Blocks a greedy row is split over when the batch has `rows` rows."""
    return max(1, min(MAX_SHARES, SHARE_BLOCKS // max(rows, 1)))


@cuda.jit(device=True)
def order_key(x):
    """A uint32 that orders like the float32 x: flip all bits of negatives, the sign bit
    of the rest.
    """
    u = _f32_bits(x)
    return u ^ uint32(0xFFFFFFFF) if u >> uint32(31) else u | uint32(0x80000000)


@cuda.jit(device=True)
def block_argmax(value, index, sv, si):
    """(largest value, its smallest index) over the block; every thread gets them."""
    tid = cuda.threadIdx.x
    sv[tid], si[tid] = value, index
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride and (
            sv[tid + stride] > sv[tid]
            or (sv[tid + stride] == sv[tid] and si[tid + stride] < si[tid])
        ):
            sv[tid], si[tid] = sv[tid + stride], si[tid + stride]
        cuda.syncthreads()
        stride //= 2
    value, index = sv[0], si[0]
    cuda.syncthreads()
    return value, index


@cuda.jit(device=True)
def block_total(value, sv):
    """Sum over the block; every thread gets it."""
    tid = cuda.threadIdx.x
    sv[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            sv[tid] += sv[tid + stride]
        cuda.syncthreads()
        stride //= 2
    value = sv[0]
    cuda.syncthreads()
    return value


@cuda.jit(device=True)
def row_argmax(z, sv, si):
    """(largest value, its first index) of row z. Each thread reads i, i + nt, ... in
    increasing order, four independent loads at a time so that they are in flight
    together.
    """
    n, nt = z.shape[0], cuda.blockDim.x
    best, best_i = -math.inf, int64(n)
    i = cuda.threadIdx.x
    while i + 3 * nt < n:
        a, b, c, d = z[i], z[i + nt], z[i + 2 * nt], z[i + 3 * nt]
        if a > best:  # increasing i: the first of equal values stays
            best, best_i = a, i
        if b > best:
            best, best_i = b, i + nt
        if c > best:
            best, best_i = c, i + 2 * nt
        if d > best:
            best, best_i = d, i + 3 * nt
        i += 4 * nt
    while i < n:
        if z[i] > best:
            best, best_i = z[i], i
        i += nt
    return block_argmax(float32(best), best_i, sv, si)


@cuda.jit
def argmax_kernel(logits, out):
    """Greedy: a block per row, out[row] = the index of the row's largest logit (the
    first, on ties).
    """
    wait_for_previous_kernel()
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    _, i = row_argmax(logits[cuda.blockIdx.x], sv, si)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = i


# %%
#| export kernels.sampling
@cuda.jit(device=True)
def kept_sum(z, m, inv_t, threshold, count_only, sv):
    """Over the row's tokens whose order key is >= threshold: their count, or their mass
    sum exp((z - m) / T).
    """
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, z.shape[0], cuda.blockDim.x):
        if order_key(z[i]) >= threshold:
            acc += float32(1.0) if count_only else math.exp((z[i] - m) * inv_t)
    return block_total(acc, sv)


@cuda.jit(device=True)
def greedy_share(z, r, part_v, part_i, tickets, out, sv, si, flag):
    """Block (r, share) of a greedy row: the argmax of its share of z; the row's last
    block to finish picks among the shares (first index on ties) and resets its ticket.
    """
    n, share, num_shares = z.shape[0], cuda.blockIdx.y, cuda.gridDim.y
    size = (n + num_shares - 1) // num_shares
    lo, hi = min(n, share * size), min(n, (share + 1) * size)
    best, i = row_argmax(z[lo:hi], sv, si)
    i = i + lo if i < hi - lo else int64(n)  # nothing above -inf: n, as for a whole row
    tid = cuda.threadIdx.x
    if num_shares == 1:
        if tid == 0:
            out[r] = i
        return
    if tid == 0:
        part_v[r, share], part_i[r, share] = best, i
        cuda.threadfence()  # the share's result is visible before its ticket is taken
        flag[0] = 1 if cuda.atomic.add(tickets, r, 1) == num_shares - 1 else 0
    cuda.syncthreads()
    if flag[0] == 0:
        return
    cuda.threadfence()
    v, k = float32(-math.inf), int64(n)
    if tid < num_shares:  # read through L2 (atomics): other blocks wrote these
        v = cuda.atomic.add(part_v, (r, tid), float32(0.0))
        k = cuda.atomic.add(part_i, (r, tid), int64(0))
    _, k = block_argmax(v, k, sv, si)
    if tid == 0:
        out[r] = k
        tickets[r] = 0


@cuda.jit
def bisection_sample_kernel(
    logits, temperature, top_k, top_p, uniform, part_v, part_i, tickets, out
):
    """Block (row, share): a greedy row's argmax split over the shares (greedy_share); a
    sampled row is share 0's alone: temperature, top-k and top-p thresholds by bisection
    over the float order, inverse-CDF draw.
    """
    wait_for_previous_kernel()
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    flag = cuda.shared.array(1, int32)
    r, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    z = logits[r]
    if temperature[r] <= 0:  # greedy (the whole block takes this branch)
        greedy_share(z, r, part_v, part_i, tickets, out, sv, si, flag)
        return
    if cuda.blockIdx.y > 0:  # a sampled row is one block's work
        return
    m, _ = row_argmax(z, sv, si)
    inv_t = float32(1.0) / temperature[r]
    threshold = uint32(0)  # keep tokens whose order key is >= threshold: all of them
    # the largest threshold that keeps at least k tokens: the k-th largest logit
    if 0 < top_k[r] < z.shape[0]:
        lo, hi = int64(0), int64(1) << 32
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if kept_sum(z, m, inv_t, uint32(mid), True, sv) >= top_k[r]:
                lo = mid
            else:
                hi = mid
        threshold = uint32(lo)
    # the largest threshold whose kept mass still reaches p of the total
    if top_p[r] < 1:
        goal = top_p[r] * kept_sum(z, m, inv_t, threshold, False, sv)
        lo, hi = int64(threshold), int64(1) << 32
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if kept_sum(z, m, inv_t, uint32(mid), False, sv) >= goal:
                lo = mid
            else:
                hi = mid
        threshold = uint32(lo)
    # inverse CDF in token order: each thread sums a contiguous segment, a prefix over
    # the threads finds the segment
    seg = (z.shape[0] + nt - 1) // nt
    part = float32(0.0)
    for i in range(tid * seg, min(z.shape[0], (tid + 1) * seg)):
        if order_key(z[i]) >= threshold:
            part += math.exp((z[i] - m) * inv_t)
    total = block_total(part, sv)
    sv[tid] = part
    cuda.syncthreads()
    before = float32(0.0)
    for j in range(tid):
        before += sv[j]
    target = float32(uniform[r]) * total
    found, last = int64(-1), int64(-1)
    if before <= target < before + part:
        run = before
        for i in range(tid * seg, min(z.shape[0], (tid + 1) * seg)):
            if order_key(z[i]) >= threshold:
                run += math.exp((z[i] - m) * inv_t)
                if run > target and found < 0:
                    found = i
    for i in range(tid * seg, min(z.shape[0], (tid + 1) * seg)):
        if order_key(z[i]) >= threshold:
            last = i
    cuda.syncthreads()
    _, pick = block_argmax(
        float32(1.0) if found >= 0 else float32(0.0),
        found if found >= 0 else int64(1) << 40,
        sv,
        si,
    )
    # u * total rounded up past the last kept token
    _, final = block_argmax(float32(last), last, sv, si)
    if tid == 0:
        out[r] = pick if pick < z.shape[0] else final


# temperature, top_k, top_p, uniform; part_v, part_i, tickets; out
_ROW_ARGS = (
    "float32[::1], int64[::1], float32[::1], float64[::1], float32[:, ::1], "
    "int64[:, ::1], int32[::1], int64[::1]"
)
PTX_SIGNATURES = {
    "argmax_kernel": ["void(float32[:, ::1], int64[::1])"],
    "bisection_sample_kernel": [f"void(float32[:, ::1], {_ROW_ARGS})"],
}


# %% [markdown]
# ### The second rung: a radix select, spread over the shares
#
# The bisection costs what its passes cost: one block reads the row's 128,256 logits
# (half a megabyte) up to 64 times, top-k and top-p each bisecting 32 bits. On an H200
# that made a top-p step about 1.2 ms, longer than the whole decode step of Llama 3.2
# 1B. Two changes make sampling cost about what its bytes cost:
#
# 1. **Spread every row over shares**, as the greedy rows already were: the blocks of a
#    row each take a slice, and the row's last block (the ticket) combines.
# 2. **Find each threshold in three passes, not 32**: a **radix select** over the same
#    order keys. Cut the 32-bit key into digits of 11, 11 and 10 bits. One pass counts
#    the row's keys by their first digit (2,048 bins); summing the bins from the top
#    finds the bin that holds the $k$-th largest, and the count above it. The next pass
#    counts only the keys of that bin, by their second digit; the third by their last.
#    Three passes give the exact 32-bit key of the $k$-th largest — and most rows stop
#    earlier, when the bin holds exactly the tokens still wanted. Top-p is the same with
#    each bin's *mass* $\sum e^{z_i/T - m}$ in place of its count: the bin where the
#    mass from the top first reaches $p$ of the total.
#
# A worked example, in NumPy, of what the kernel's passes compute: the top-50 threshold
# of a row of Llama's size, digit by digit.

# %%
def order_keys(x: np.ndarray) -> np.ndarray:
    """uint32 keys that order like the float32 x (as the kernel's order_key)."""
    u = x.astype(np.float32).view(np.uint32)
    return np.where(u >> 31, ~u, u | np.uint32(0x80000000))


def radix_select(keys: np.ndarray, k: int) -> int:
    """The k-th largest key, by 11-, 11- and 10-bit digits, printing each pass."""
    prefix, left = 0, k
    for shift, bits in ((21, 11), (10, 11), (0, 10)):
        same = keys >> (shift + bits) == prefix >> (shift + bits)  # in the bin so far
        digits = (keys[same] >> shift) & ((1 << bits) - 1)
        counts = np.bincount(digits, minlength=1 << bits)
        from_top = np.cumsum(counts[::-1])[::-1]  # keys in bins >= b
        b = int(np.flatnonzero(from_top >= left).max())
        above = int(from_top[b] - counts[b])
        print(f"digit of {bits} bits: {same.sum():>6} keys, bin {b:>4} holds "
              f"{counts[b]:>4}, {above:>2} above it, {left - above:>2} still wanted")
        prefix, left = prefix | b << shift, left - above
        if counts[b] == left:  # the whole bin is kept: its lowest key will do
            break
    return prefix


example = (rng.standard_normal(128256) * 2).astype(np.float32)
threshold = radix_select(order_keys(example).astype(np.int64), 50)
kept = order_keys(example) >= threshold
print(f"{kept.sum()} tokens kept; np.partition's 50th largest is "
      f"{np.partition(example, -50)[-50]:.4f}, the smallest kept "
      f"{example[kept].min():.4f}")
assert kept.sum() == 50 and example[kept].min() == np.partition(example, -50)[-50]

# %% [markdown]
# The first digit is the sign, the exponent and two bits of mantissa, so its bins are
# coarse — a few hundred logits in the top one here; the second narrows to one or a
# few, and then the bin is the threshold. A tie needs no special case: equal logits have
# equal keys, so top-k keeps every token tied with the $k$-th, and top-p every token
# tied at its boundary, as the NumPy reference does.
#
# On the GPU each pass is one launch of `sample_step_kernel` over the grid rows x
# shares: every block counts its slice into a 2,048-bin histogram in shared memory,
# adds the non-empty bins to the row's histogram in global memory (atomics), and takes
# a ticket; the row's last block reads the row's histogram (and sets it back to zero),
# picks the bin, and writes the row's state — the prefix so far, what is still wanted —
# for the next launch. Seven launches make a sample, always the same seven, so that a
# CUDA graph can capture them (chapter 11 adds graphs for greedy batches that launch
# the first alone):
#
# | step | every block of the row | the row's last block |
# | --- | --- | --- |
# | 0 | largest logit; top-k's first digits | greedy: its token; else $m$, a bin |
# | 1, 2 | top-k's counts by the next digits | the next bin; at last the threshold |
# | 3, 4, 5 | top-p's masses by digit (what top-k, min-p keep) | the same |
# | 6 | the kept mass of its slice | the share where $u \cdot$ total falls; the token |
#
# A row with nothing to do at a step — greedy after step 0, no top-k, a threshold found
# early — returns at once; the eager sampler, which knows the batch's settings on the
# host, launches only the steps some row needs. Min-p needs no pass of its own: it is a
# test on $z_i/T - m$, made wherever a token's fate is decided. The draw keeps chapter
# 8b's inverse CDF in token order: each share's kept mass, a scan over the shares to
# find the one where $u$ times the total falls, then a scan over that share's threads.

# %%
#| export kernels.sampling_radix
import math

import numpy as np
from numba import cuda, float32, float64, int32, int64

from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel
from tinyvllm_lib.kernels.sampling import (
    MAX_SHARES,
    MAX_THREADS,
    SAMPLER_THREADS,
    block_argmax,
    block_total,
    greedy_shares,
    order_key,
)

# a key's three digits, most significant first: 11, 11 and 10 bits
NUM_BINS = 2048
NUM_STEPS = 7  # launches: max (+ top-k digit 0), top-k digits 1-2, top-p 0-2, draw
# a row's state between steps (int64 columns of `state`; float32 of `fstate`)
KEY_K, K_PREFIX, K_DONE, K_LEFT, KEY_P, P_PREFIX, P_DONE = range(7)
MAX_X, GOAL_LEFT = 0, 1
COUNT, MASS, DRAW = 0, 1, 2  # what a pass over a slice adds up


@cuda.jit(device=True)
def sample_key(x):
    """order_key(x) as an int64, 0 for NaN: below every number, so never kept."""
    return int64(0) if x != x else int64(order_key(x))


@cuda.jit(device=True)
def digit(d):
    """(shift, bins) of digit d of a key: (21, 2048), (10, 2048), (0, 1024)."""
    return (21, 2048) if d == 0 else (10, 2048) if d == 1 else (0, 1024)


@cuda.jit(device=True)
def block_scan(value, lane, sv):
    """(sum over the lanes before `lane`, through it, over all), one lane a thread."""
    nt = cuda.blockDim.x
    sv[lane] = value
    cuda.syncthreads()
    off = 1
    while off < nt:
        v = sv[lane - off] if lane >= off else float32(0.0)
        cuda.syncthreads()
        sv[lane] += v
        cuda.syncthreads()
        off *= 2
    before = sv[lane - 1] if lane > 0 else float32(0.0)
    through, total = sv[lane], sv[nt - 1]
    cuda.syncthreads()
    return before, through, total


@cuda.jit(device=True)
def visit(v, t, m, floor, lo_key, prefix, d, mode, counts, masses):
    """One logit v of a pass: if kept (key >= lo_key, z / T - m >= floor) and its key
    starts with prefix's digits before d, count it (and its mass) in digit d's bin;
    returns its mass e^(z / T - m) (0 if dropped, or counting only).
    """
    x = v / t
    key = sample_key(x)
    shift, bins = digit(d)
    high = shift + (11 if d < 2 else 10)  # the bits above digit d
    if key < lo_key or (key >> high) != (prefix >> high):
        return float32(0.0)
    if mode != COUNT and x - m < floor:  # min-p
        return float32(0.0)
    e = float32(0.0) if mode == COUNT else math.exp(x - m)
    if mode != DRAW:
        b = (key >> shift) & (bins - 1)
        cuda.atomic.add(counts, b, 1)
        if mode == MASS:
            cuda.atomic.add(masses, b, e)
    return e


@cuda.jit(device=True)
def slice_pass(z, lo, hi, t, m, floor, lo_key, prefix, d, mode, counts, masses):
    """visit() over z[lo:hi], four loads in flight a thread; the block's mass."""
    nt = cuda.blockDim.x
    acc = float32(0.0)
    i = lo + cuda.threadIdx.x
    while i + 3 * nt < hi:
        a, b, c, e = z[i], z[i + nt], z[i + 2 * nt], z[i + 3 * nt]
        acc += visit(a, t, m, floor, lo_key, prefix, d, mode, counts, masses)
        acc += visit(b, t, m, floor, lo_key, prefix, d, mode, counts, masses)
        acc += visit(c, t, m, floor, lo_key, prefix, d, mode, counts, masses)
        acc += visit(e, t, m, floor, lo_key, prefix, d, mode, counts, masses)
        i += 4 * nt
    while i < hi:
        acc += visit(z[i], t, m, floor, lo_key, prefix, d, mode, counts, masses)
        i += nt
    return acc


@cuda.jit(device=True)
def last_of_row(tickets, r, flag):
    """Every block of row r takes a ticket after its writes: True in the last one."""
    cuda.threadfence()  # this thread's writes are visible before the ticket is taken
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        flag[0] = 1 if cuda.atomic.add(tickets, r, 1) == cuda.gridDim.y - 1 else 0
    cuda.syncthreads()
    if flag[0] == 0:
        return False
    cuda.threadfence()
    return True


@cuda.jit(device=True)
def add_histogram(hist_count, hist_mass, r, bins, counts, masses):
    """The block's histogram into row r's global one (its non-empty bins)."""
    for b in range(cuda.threadIdx.x, bins, cuda.blockDim.x):
        if counts[b]:
            cuda.atomic.add(hist_count, (r, b), counts[b])
            cuda.atomic.add(hist_mass, (r, b), masses[b])


@cuda.jit(device=True)
def pick_bin(hist_count, hist_mass, r, bins, by_mass, goal, counts, masses, sv, si):
    """Last block: read row r's histogram (and zero it for the next step); the largest
    bin b whose bins >= b weigh at least goal (count or mass; goal < 0: -goal times the
    total). (b, goal less the weight of the bins above b, count in b, whether no bin
    reached goal: then b is the lowest non-empty bin).
    """
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    per = bins // nt  # each thread its own run of bins: the bins >= b are a suffix
    own = float32(0.0)
    for b in range(tid * per, (tid + 1) * per):
        counts[b] = cuda.atomic.exch(hist_count, (r, b), 0)  # read through L2
        masses[b] = cuda.atomic.add(hist_mass, (r, b), float32(0.0))
        hist_mass[r, b] = 0
        own += masses[b] if by_mass else float32(counts[b])
    # weight of the bins above this thread's: a scan over the threads, highest first
    above, _, total = block_scan(own, nt - 1 - tid, sv)
    if goal < 0:
        goal = -goal * total
    goal = max(goal, float32(1e-38))  # rounding left nothing to find: the top bin
    found, found_above = int64(-1), float32(0.0)
    if above < goal:
        for b in range((tid + 1) * per - 1, tid * per - 1, -1):
            w = masses[b] if by_mass else float32(counts[b])
            if found < 0 and above + w >= goal:
                found, found_above = b, above
            above += w
    _, b = block_argmax(float32(found), found, sv, si)
    if found >= 0 and found == b:
        sv[0] = found_above
    cuda.syncthreads()
    found_above = sv[0]
    cuda.syncthreads()
    is_short = b < 0
    if is_short:  # the histogram weighs less than goal (rounding): its lowest bin
        low = int64(bins)
        for j in range((tid + 1) * per - 1, tid * per - 1, -1):
            if counts[j]:
                low = j
        _, b = block_argmax(float32(-low), low, sv, si)
        b = min(b, int64(bins - 1))  # (an empty histogram: never, a row keeps its max)
    return b, goal - found_above, counts[b], is_short


@cuda.jit(device=True)
def max_step(z, lo, hi, t, r, is_k, k, hist_count, hist_mass, part_v, part_i,
             tickets, state, fstate, out, counts, masses, sv, si, flag):
    """Step 0, block (r, share): the largest logit of the share (first index on
    ties) and, for top-k, the histogram of its keys' first digit. The row's last block:
    a greedy row's token; a sampled row's max and top-k's first bin.
    """
    tid, n, share = cuda.threadIdx.x, z.shape[0], cuda.blockIdx.y
    is_sampled = t > 0
    for b in range(tid, NUM_BINS, cuda.blockDim.x):
        counts[b], masses[b] = 0, 0
    cuda.syncthreads()
    best, best_i = float32(-math.inf), int64(n)
    for i in range(lo + tid, hi, cuda.blockDim.x):  # increasing i: the first of ties
        v = z[i]
        if v > best:
            best, best_i = v, i
        if is_k:
            visit(v, t, float32(0.0), float32(0.0), 1, 0, 0, COUNT, counts, masses)
    best, best_i = block_argmax(best, best_i, sv, si)
    if tid == 0:
        part_v[r, share], part_i[r, share] = best, best_i
    if is_k:
        add_histogram(hist_count, hist_mass, r, NUM_BINS, counts, masses)
    if not last_of_row(tickets, r, flag):
        return
    v, j = float32(-math.inf), int64(n)
    if tid < cuda.gridDim.y:  # read through L2 (atomics): other blocks wrote these
        v = cuda.atomic.add(part_v, (r, tid), float32(0.0))
        j = cuda.atomic.add(part_i, (r, tid), int64(0))
    m, j = block_argmax(v, j, sv, si)
    if is_k:
        b, left, count, is_short = pick_bin(
            hist_count, hist_mass, r, NUM_BINS, False, float32(k), counts, masses,
            sv, si,
        )
    if tid == 0:
        tickets[r] = 0
        if not is_sampled:
            out[r] = j
            return
        fstate[r, MAX_X] = m / t
        state[r, KEY_K], state[r, K_DONE], state[r, P_DONE] = 1, 1, 0
        if is_k:
            k_left = int64(left)
            state[r, K_PREFIX], state[r, K_LEFT] = b << 21, k_left
            if count == k_left or is_short:
                state[r, KEY_K] = b << 21
            else:
                state[r, K_DONE] = 0


@cuda.jit(device=True)
def select_step(z, lo, hi, t, r, d, by_mass, top_p, min_p, hist_count, hist_mass,
                tickets, state, fstate, counts, masses, sv, si, flag):
    """Steps 1-5, block (r, share): digit d of top-k's threshold (count) or top-p's
    (mass), the share's histogram of the keys in the bin so far; the row's last block
    picks the next bin.
    """
    tid = cuda.threadIdx.x
    shift, bins = digit(d)
    for b in range(tid, bins, cuda.blockDim.x):
        counts[b], masses[b] = 0, 0
    cuda.syncthreads()
    if by_mass:
        prefix = state[r, P_PREFIX] if d > 0 else int64(0)
        m, floor = fstate[r, MAX_X], min_p_floor(min_p)
        slice_pass(z, lo, hi, t, m, floor, state[r, KEY_K], prefix, d, MASS, counts,
                   masses)
        goal = fstate[r, GOAL_LEFT] if d > 0 else -top_p  # < 0: a share of the total
    else:
        prefix = state[r, K_PREFIX]
        zero = float32(0.0)
        slice_pass(z, lo, hi, t, zero, zero, 1, prefix, d, COUNT, counts, masses)
        goal = float32(state[r, K_LEFT])
    cuda.syncthreads()
    add_histogram(hist_count, hist_mass, r, bins, counts, masses)
    if not last_of_row(tickets, r, flag):
        return
    b, left, count, is_short = pick_bin(
        hist_count, hist_mass, r, bins, by_mass, goal, counts, masses, sv, si
    )
    if tid == 0:
        tickets[r] = 0
        prefix |= b << shift
        if by_mass:
            state[r, P_PREFIX] = prefix
            fstate[r, GOAL_LEFT] = left
            if d == 2 or count == 1 or is_short:
                state[r, KEY_P], state[r, P_DONE] = prefix, 1
        else:
            k_left = int64(left)
            state[r, K_PREFIX], state[r, K_LEFT] = prefix, k_left
            if d == 2 or count == k_left or is_short:
                state[r, KEY_K], state[r, K_DONE] = prefix, 1


@cuda.jit(device=True)
def min_p_floor(min_p):
    """log(min_p) as float32 (min-p keeps z / T - m >= it); -inf when min_p is 0."""
    return float32(math.log(float64(min_p))) if min_p > 0 else float32(-math.inf)


@cuda.jit(device=True)
def draw_step(z, lo, hi, t, r, min_p, u, is_p, part_v, tickets, state, fstate, out,
              counts, masses, sv, si, flag):
    """Step 6, block (r, share): the kept mass of the share. The row's last block finds
    the share where u times the total falls, then the token within it (inverse CDF in
    token order).
    """
    tid, nt, n = cuda.threadIdx.x, cuda.blockDim.x, z.shape[0]
    lo_key = max(state[r, KEY_K], state[r, KEY_P]) if is_p else state[r, KEY_K]
    m, floor = fstate[r, MAX_X], min_p_floor(min_p)
    part = slice_pass(z, lo, hi, t, m, floor, lo_key, 0, 0, DRAW, counts, masses)
    part = block_total(part, sv)
    if tid == 0:
        part_v[r, cuda.blockIdx.y] = part
    if not last_of_row(tickets, r, flag):
        return
    # the shares in order: which one holds u * total (or the last with any mass)
    w = float32(0.0)
    if tid < cuda.gridDim.y:
        w = cuda.atomic.add(part_v, (r, tid), float32(0.0))
    before, through, total = block_scan(w, tid, sv)
    target = float32(u) * total
    hit = tid if w > 0 and before <= target < through else -1
    _, share = block_argmax(float32(hit), int64(hit), sv, si)
    if share < 0:
        _, share = block_argmax(float32(tid if w > 0 else -1), int64(tid), sv, si)
    if tid == share:
        sv[0] = target - before
    cuda.syncthreads()
    target = sv[0]
    cuda.syncthreads()
    # within the share: each thread a contiguous segment, a scan over the threads
    size = (n + cuda.gridDim.y - 1) // cuda.gridDim.y
    lo, hi = share * size, min(n, (share + 1) * size)
    seg = (hi - lo + nt - 1) // nt
    start, end = min(hi, lo + tid * seg), min(hi, lo + (tid + 1) * seg)
    part, last = float32(0.0), int64(-1)
    for i in range(start, end):
        e = visit(z[i], t, m, floor, lo_key, 0, 0, DRAW, counts, masses)
        if e > 0:
            part, last = part + e, i
    before, through, _ = block_scan(part, tid, sv)
    found = int64(-1)
    if before <= target < through:
        run = before
        for i in range(start, end):
            run += visit(z[i], t, m, floor, lo_key, 0, 0, DRAW, counts, masses)
            if run > target and found < 0:
                found = i
    is_found, pick = block_argmax(float32(found >= 0), found, sv, si)
    _, last = block_argmax(float32(last), last, sv, si)  # u * total rounded up
    if tid == 0:
        out[r] = pick if is_found > 0 else last
        tickets[r] = 0


@cuda.jit
def sample_step_kernel(step, logits, temperature, top_k, top_p, min_p, uniform,
                       hist_count, hist_mass, part_v, part_i, tickets, state, fstate,
                       out):
    """Step `step` of sampling (0-6), block (row, share): 0 the max (a greedy row's
    token); 1-2 top-k's threshold, 3-5 top-p's, a digit of the key each; 6 the draw.
    A row with nothing to do at a step returns at once.
    """
    wait_for_previous_kernel()
    sv = cuda.shared.array(MAX_THREADS, float32)
    si = cuda.shared.array(MAX_THREADS, int64)
    counts = cuda.shared.array(NUM_BINS, int32)
    masses = cuda.shared.array(NUM_BINS, float32)
    flag = cuda.shared.array(1, int32)
    r, share = cuda.blockIdx.x, cuda.blockIdx.y
    z, t = logits[r], temperature[r]
    n = z.shape[0]
    size = (n + cuda.gridDim.y - 1) // cuda.gridDim.y
    lo, hi = min(n, share * size), min(n, (share + 1) * size)
    is_k, is_p = t > 0 and 0 < top_k[r] < n, t > 0 and top_p[r] < 1
    if step == 0:
        max_step(z, lo, hi, t, r, is_k, top_k[r], hist_count, hist_mass, part_v,
                 part_i, tickets, state, fstate, out, counts, masses, sv, si, flag)
    elif step < 3:
        if is_k and state[r, K_DONE] == 0:
            select_step(z, lo, hi, t, r, step, False, top_p[r], min_p[r], hist_count,
                        hist_mass, tickets, state, fstate, counts, masses, sv, si, flag)
    elif step < 6:
        if is_p and (step == 3 or state[r, P_DONE] == 0):
            select_step(z, lo, hi, t, r, step - 3, True, top_p[r], min_p[r],
                        hist_count, hist_mass, tickets, state, fstate, counts, masses,
                        sv, si, flag)
    elif t > 0:
        draw_step(z, lo, hi, t, r, min_p[r], uniform[r], is_p, part_v, tickets, state,
                  fstate, out, counts, masses, sv, si, flag)


def sampler_workspace(max_rows: int) -> dict:
    """The device arrays sample() works in, for up to max_rows rows (histograms and
    tickets at zero: every step leaves them so).
    """
    return {
        "hist_count": cuda.to_device(np.zeros((max_rows, NUM_BINS), np.int32)),
        "hist_mass": cuda.to_device(np.zeros((max_rows, NUM_BINS), np.float32)),
        "part_v": cuda.device_array((max_rows, MAX_SHARES), np.float32),
        "part_i": cuda.device_array((max_rows, MAX_SHARES), np.int64),
        "tickets": cuda.to_device(np.zeros(max_rows, np.int32)),
        "state": cuda.device_array((max_rows, 8), np.int64),
        "fstate": cuda.device_array((max_rows, 2), np.float32),
    }


def needed_steps(temperature, top_k, top_p, vocab_size: int) -> list[int]:
    """The steps a batch needs, from its settings on the host (a graph takes all)."""
    is_sampled = np.asarray(temperature) > 0
    is_k = is_sampled & (np.asarray(top_k) > 0) & (np.asarray(top_k) < vocab_size)
    is_p = is_sampled & (np.asarray(top_p) < 1)
    steps = [0] + [1, 2] * bool(is_k.any()) + [3, 4, 5] * bool(is_p.any())
    return steps + [6] * bool(is_sampled.any())


def sample(logits, temperature, top_k, top_p, min_p, uniform, workspace, out,
           stream=0, steps=range(NUM_STEPS)) -> None:
    """Sample one token per row of logits (rows, vocab) into out, all on the GPU: the
    fixed launches a CUDA graph captures (steps: a subset, when the host knows no row
    needs the others).
    """
    rows = logits.shape[0]
    w = workspace
    grid = (rows, greedy_shares(rows))
    for step in steps:
        sample_step_kernel[grid, SAMPLER_THREADS, stream](
            step, logits, temperature, top_k, top_p, min_p, uniform,
            w["hist_count"], w["hist_mass"], w["part_v"], w["part_i"], w["tickets"],
            w["state"], w["fstate"], out,
        )


# the types the engine launches it with (tests/ptx_check.py compiles them for sm_90)
PTX_SIGNATURES = {
    "sample_step_kernel": [
        "void(int64, float32[:, ::1], float32[::1], int64[::1], float32[::1], "
        "float32[::1], float64[::1], int32[:, ::1], float32[:, ::1], float32[:, ::1], "
        "int64[:, ::1], int32[::1], int64[:, ::1], float32[:, ::1], int64[::1])"
    ],
}


# %% [markdown]
# ### Penalties: counts that live on the GPU
#
# Three more settings push the model away from (or towards) what it has already said.
# vLLM applies them to the raw logits, before temperature and everything after it, in
# this order, to every row that asks — greedy rows too:
#
# 1. **Repetition** $r$ (vLLM's extension; $1$ = off, $r > 0$): a token that appears in
#    the prompt *or* the output so far has its logit divided by $r$ if it is positive,
#    multiplied by $r$ if not — so $r > 1$ always makes it less likely.
# 2. **Frequency** $f$ (OpenAI's; $0$ = off, in $[-2, 2]$): minus $f$ times how many
#    times the token is in the output.
# 3. **Presence** $p$ (OpenAI's; $0$ = off, in $[-2, 2]$): minus $p$ once if the token
#    is in the output at all.
#
# $$ z_i \leftarrow \begin{cases} z_i / r & z_i > 0 \\ z_i \cdot r & z_i \le 0
#    \end{cases} \text{ if } i \in \text{prompt} \cup \text{output}, \qquad
#    z_i \leftarrow z_i - f \cdot c_i - p \cdot [c_i > 0] $$
#
# with $c_i$ the count of token $i$ in the output. `apply_penalties` above is the NumPy
# reference, and `SamplingMetadata.from_params` keeps, for the rows that ask, the
# request's own prompt and output lists (not copies) for it. A tiny worked example:
# logits $2, 1.5, 1, -1$, the prompt holds token 3, the output so far is $0, 0, 1$:

# %%
from tinyvllm_lib.engine.sampler import apply_penalties

tiny = np.array([[2.0, 1.5, 1.0, -1.0]], np.float32)
one = np.ones(1, np.float32)
for r, f, p in ((2.0, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.5), (2.0, 0.5, 0.5)):
    z = apply_penalties(tiny, [([3], [0, 0, 1])], r * one, f * one, p * one)
    print(f"r = {r}, f = {f}, p = {p}: {z[0].tolist()}")
# by hand: r = 2 halves 2 and 1.5 (in the output) and doubles -1 (in the prompt)
by_hand = apply_penalties(tiny, [([3], [0, 0, 1])], 2 * one, 0 * one, 0 * one)
assert by_hand[0].tolist() == [1.0, 0.75, 1.0, -2.0]

# %% [markdown]
# On the GPU the host cannot hand the sampler those lists: with chapter 11's overlap the
# next step is launched before the host has seen the last token. So the counts live on
# the GPU and are updated there. The sampler owns a **slot table**: `counts`, an int32
# `(slots, vocab)` array of each request's output counts, and `in_prompt`, a byte per
# token that marks its prompt. There are `max_num_seqs` slots — no more requests can
# run at once — so the memory is bounded: 5 bytes per vocabulary entry per slot (the
# cell below counts it for Llama 3). Each row of a step carries one more packed field,
# `penalty_slot` (−1: no penalties), next to its three settings. Two small kernels run
# inside the step, so a CUDA graph captures them:
#
# - `apply_penalties_kernel`, before sampling: a block per (row, share) walks the row's
#   slot and changes, in place, the logits of the tokens seen — a row without a slot
#   returns at once, so rows without penalties cost one read of their slot number;
# - `count_sampled_kernel`, after sampling: one thread a row adds the sampled id to its
#   slot's counts — on the device, so a step launched ahead counts the token its host
#   has not seen yet.
#
# The host only hands slots out (`PenaltySlots`, the runner's sampler holds it). A
# request with penalties that runs without a slot gets a free one, rebuilt from the
# tokens the host holds: its prompt marks and its output counts, one copy each (a step
# planned ahead never needs a new slot: its requests ran the step before). A slot is
# freed, by the next step that hands slots out, once its request is no longer running
# — finished, aborted or **preempted**. A
# preempted request recomputes its prompt and output when it is admitted again, in a
# step the host planned with every token known, so its counts are rebuilt then from
# its tokens rather than kept while it waits. The ahead step launched for a request
# that has just finished may count one more token into its slot; the next owner
# rewrites the whole slot, on the same stream, after that write.
#
# One difference from vLLM: the log-probabilities a request asks for are those of the
# logits after its penalties (vLLM returns the raw logits' by default), since the
# kernel changes the logits in place rather than keep a second copy of every row.

# %%
llama3_vocab, max_num_seqs = 128_256, 256
slot_bytes = llama3_vocab * (np.dtype(np.int32).itemsize + np.dtype(np.uint8).itemsize)
print(
    f"one slot: {slot_bytes / 2**20:.2f} MiB; {max_num_seqs} slots (max_num_seqs): "
    f"{max_num_seqs * slot_bytes / 2**20:.0f} MiB"
)

# %%
#| export kernels.penalties
from numba import config, cuda, float32

from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel

PENALTY_THREADS = 32 if config.ENABLE_CUDASIM else 256
PENALTY_SHARES = 2 if config.ENABLE_CUDASIM else 16  # blocks a row
COUNT_THREADS = 128


@cuda.jit
def apply_penalties_kernel(logits, slot, repetition, frequency, presence, counts,
                           in_prompt):
    """Block (row, share): vLLM's penalties on the row's logits, in place, from its
    slot's output counts and prompt marks; a row whose slot is -1 returns at once.
    """
    wait_for_previous_kernel()
    r = cuda.blockIdx.x
    s = slot[r]
    if s < 0:
        return
    r_pen, f, p = repetition[r], frequency[r], presence[r]
    n = logits.shape[1]
    stride = cuda.blockDim.x * cuda.gridDim.y
    for i in range(cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x, n, stride):
        c = counts[s, i]
        if c == 0 and in_prompt[s, i] == 0:  # never seen: untouched
            continue
        z = logits[r, i]
        z = z / r_pen if z > 0 else z * r_pen  # repetition: prompt or output
        if c > 0:  # frequency, then presence: output only
            z = z - f * float32(c)
            z = z - p
        logits[r, i] = z


@cuda.jit
def count_sampled_kernel(ids, slot, counts):
    """counts[slot[r], ids[r]] += 1 for each row r with a slot (no two rows share
    one): the step's sampled token, counted on the GPU.
    """
    wait_for_previous_kernel()
    r = cuda.grid(1)
    if r < ids.shape[0] and slot[r] >= 0 and 0 <= ids[r] < counts.shape[1]:
        counts[slot[r], ids[r]] += 1


def apply_penalties_gpu(logits, slot, repetition, frequency, presence, counts,
                        in_prompt, stream=0) -> None:
    """The penalties on logits (rows, vocab) in place; slot (rows,) int32, -1 = none."""
    rows = logits.shape[0]
    apply_penalties_kernel[(rows, PENALTY_SHARES), PENALTY_THREADS, stream](
        logits, slot, repetition, frequency, presence, counts, in_prompt
    )


def count_sampled(ids, slot, counts, stream=0) -> None:
    """Add each row's sampled id to its slot's counts (rows with slot -1: nothing)."""
    rows = ids.shape[0]
    count_sampled_kernel[cdiv(rows, COUNT_THREADS), COUNT_THREADS, stream](
        ids, slot, counts
    )


PTX_SIGNATURES = {
    "apply_penalties_kernel": [
        "void(float32[:, ::1], int32[::1], float32[::1], float32[::1], float32[::1], "
        "int32[:, ::1], uint8[:, ::1])"
    ],
    "count_sampled_kernel": ["void(int64[::1], int32[::1], int32[:, ::1])"],
}


# %%
#| export engine.penalty_slots
import numpy as np
from numba import cuda

from tinyvllm_lib.engine.request import RequestStatus


class PenaltySlots:
    """The GPU's state for the penalties: per slot, a request's output counts
    (`counts`, int32) and its prompt marks (`in_prompt`, uint8), (num_slots, vocab)
    each; the host only decides which request holds which slot.
    """

    def __init__(self, vocab_size: int, num_slots: int):
        self.vocab_size = vocab_size
        self.counts = cuda.to_device(np.zeros((num_slots, vocab_size), np.int32))
        self.in_prompt = cuda.to_device(np.zeros((num_slots, vocab_size), np.uint8))
        self.owners: list = [None] * num_slots  # slot -> the request holding it
        self.slot_of: dict = {}  # request -> its slot

    def release_stale(self) -> None:
        """Free the slots of requests no longer running: finished, aborted or
        preempted (a preempted one gets a slot rebuilt when it runs again).
        """
        for request, slot in list(self.slot_of.items()):
            if request.status is not RequestStatus.RUNNING:
                del self.slot_of[request]
                self.owners[slot] = None

    def fill(self, slot: int, prompt_ids, output_ids, stream=0) -> None:
        """Rewrite a slot from tokens the host holds (the whole row: whatever the last
        owner left is gone).
        """
        v = self.vocab_size
        output = np.asarray(output_ids, np.int64)
        counts = np.bincount(output, minlength=v).astype(np.int32)
        marks = np.zeros(v, np.uint8)
        marks[np.asarray(prompt_ids, np.int64)] = 1
        self.counts[slot].copy_to_device(counts, stream=stream)
        self.in_prompt[slot].copy_to_device(marks, stream=stream)

    def slots_for(self, requests: list, is_ahead: bool, stream=0) -> np.ndarray:
        """Each row's slot, int32 (-1: its request has no penalties); a request
        without one gets a free slot, filled from its tokens.
        """
        self.release_stale()
        out = np.full(len(requests), -1, np.int32)
        for i, request in enumerate(requests):
            if not request.params.has_penalties:
                continue
            slot = self.slot_of.get(request)
            if slot is None:
                if is_ahead:  # its last token is not on the host yet
                    raise RuntimeError(
                        f"request {request.request_id!r} has no penalty slot in a "
                        "step planned ahead"
                    )
                slot = self.owners.index(None)  # as many slots as rows: one is free
                self.owners[slot], self.slot_of[request] = request, slot
                self.fill(slot, request.prompt_token_ids, request.output_token_ids,
                          stream)
            out[i] = slot
        return out


# %%
#| export engine.sampler_cuda
import numpy as np
from numba import cuda

from tinyvllm_lib.engine.penalty_slots import PenaltySlots
from tinyvllm_lib.engine.sampler import SamplerOutput, SamplingMetadata, logprobs_of
from tinyvllm_lib.kernels.penalties import apply_penalties_gpu, count_sampled
from tinyvllm_lib.kernels.sampling_radix import (
    NUM_STEPS,
    needed_steps,
    sample,
    sampler_workspace,
)

# each row's settings, as the kernel reads them
SETTING_DTYPES = {
    "temperature": np.float32,
    "top_k": np.int64,
    "top_p": np.float32,
    "min_p": np.float32,
    "uniform": np.float64,
    "repetition_penalty": np.float32,
    "frequency_penalty": np.float32,
    "presence_penalty": np.float32,
    "penalty_slot": np.int32,
    "num_logprobs": np.int64,  # -1: none (chapter 11 computes them on the GPU)
}


class CudaSampler:
    """The GPU sampler: logits (batch, vocab) on the GPU -> token ids on the host; the
    same SamplingMetadata as Sampler. In a step, launch() reads the settings from the
    step's packed batch and enqueue()/finish() bring the ids back; called, it does all
    three for logits and settings of its own.
    """

    def __init__(self, vocab_size: int, max_rows: int, stream=0):
        self.vocab_size, self.max_rows, self.stream = vocab_size, max_rows, stream
        self.ids = cuda.device_array(max_rows, np.int64)
        # the sampled ids cross into one of two pinned buffers, used in turn
        self.host_ids = [cuda.pinned_array(max_rows, np.int64) for _ in range(2)]
        # the shares' partial results, the rows' histograms and state, a ticket counter
        # a row (back at zero after every step)
        self.workspace = sampler_workspace(max_rows)
        self.tickets = self.workspace["tickets"]
        # the penalties' counts: a slot per row, on the GPU
        self.penalties = PenaltySlots(vocab_size, max_rows)

    def __call__(self, logits, metadata: SamplingMetadata) -> SamplerOutput:
        n, s = len(metadata.temperature), self.stream
        if not hasattr(logits, "copy_to_host"):  # host logits: copy them over
            logits = cuda.to_device(np.ascontiguousarray(logits, np.float32), stream=s)
        if (
            tuple(logits.shape) != (n, self.vocab_size)
            or logits.dtype != np.float32
            or n > self.max_rows
        ):
            raise ValueError(
                f"logits must be float32 ({n}, {self.vocab_size}) with n <= "
                f"{self.max_rows}, got {logits.dtype} {tuple(logits.shape)}"
            )
        settings = {name: getattr(metadata, name) for name in SETTING_DTYPES}
        tokens = metadata.penalty_tokens
        if tokens is not None:  # slot i for row i, filled from the host's lists
            settings["penalty_slot"] = np.array(
                [-1 if t is None else i for i, t in enumerate(tokens)], np.int32
            )
            for i, t in enumerate(tokens):
                if t is not None:
                    self.penalties.fill(i, *t, stream=s)
        rows = {  # every row's settings, greedy or not: the same launches for all
            name: cuda.to_device(np.ascontiguousarray(settings[name], dtype), stream=s)
            for name, dtype in SETTING_DTYPES.items()
        }
        self.launch(logits, s, rows, self.steps_for(metadata), tokens is not None,
                    bool(metadata.num_logprobs.max(initial=-1) >= 0))
        queued = self.enqueue(logits, metadata, 0)
        s.synchronize() if s else cuda.synchronize()
        return self.finish(queued)

    def steps_for(self, metadata: SamplingMetadata) -> list[int]:
        """The steps some row of metadata needs (where the host knows the settings:
        a graph launches them all whatever its rows ask, but chapter 11's argmax_only
        graphs, step 0 alone).
        """
        return needed_steps(
            metadata.temperature, metadata.top_k, metadata.top_p, self.vocab_size
        )

    def launch(self, logits, stream, rows: dict, steps=range(NUM_STEPS),
               penalize: bool = True, logprobs: bool = True) -> None:
        """The sampling kernels over logits' rows, on `stream` (what a CUDA graph can
        capture: every step, whatever the rows ask, or step 0 alone for chapter 11's
        argmax_only graphs): ids on the GPU. rows: the
        settings' device arrays (SETTING_DTYPES). penalize: the penalties first (in
        place) and the sampled ids counted after (False: the host knows no row has a
        slot). logprobs: whether a row may ask for log-probs; this sampler takes them
        on the host in enqueue, chapter 11's launches their kernel here.
        """
        n, slot = logits.shape[0], rows["penalty_slot"][: logits.shape[0]]
        if penalize:
            apply_penalties_gpu(
                logits, slot,
                *(rows[name][:n] for name in ("repetition_penalty",
                                              "frequency_penalty", "presence_penalty")),
                self.penalties.counts, self.penalties.in_prompt, stream,
            )
        sample(
            logits,
            *(rows[name][:n] for name in ("temperature", "top_k", "top_p", "min_p")),
            rows["uniform"][:n],
            self.workspace,
            self.ids[:n],
            stream,
            steps,
        )
        if penalize:
            count_sampled(self.ids[:n], slot, self.penalties.counts, stream)

    def enqueue(self, logits, metadata: SamplingMetadata, turn: int) -> tuple:
        """Queue the copy of metadata's rows' ids (the first rows of logits) to pinned
        buffer `turn`; nothing waits unless log-probs are asked for, which this sampler
        computes on the host from a copy of the rows. What finish needs: (turn, rows,
        the host's log-probs or None, the GPU's k: -1 here, chapter 11 fills it).
        """
        n, s = len(metadata.temperature), self.stream
        if n:
            self.ids[:n].copy_to_host(self.host_ids[turn][:n], stream=s)
        k, host = int(metadata.num_logprobs.max(initial=-1)), None
        if n and k >= 0:  # log-probs of the raw logits: the rows cross, then NumPy
            s.synchronize() if s else cuda.synchronize()
            host = logprobs_of(
                logits[:n].copy_to_host(stream=s), self.host_ids[turn][:n], k
            )
        return turn, n, host, -1

    def finish(self, queued: tuple) -> SamplerOutput:
        """The samples of an enqueue whose copies are done (the caller waited)."""
        turn, n, host, _ = queued
        out = SamplerOutput(self.host_ids[turn][:n].copy())
        if host is not None:
            out.logprobs, out.top_ids, out.top_logprobs = host
        return out

    def prompt_logprobs(self, logits, targets, k: int) -> tuple:
        """A prompt chunk's log-probs (Sampler.prompt_logprobs's) from its rows of
        logits on the GPU: the rows cross to the host, then NumPy.
        """
        return logprobs_of(logits.copy_to_host(stream=self.stream), targets, k)


# %% [markdown]
# A quick check of the GPU sampler against the NumPy one: greedy rows must pick exactly
# the argmax, and a seeded row must draw the same token from the same uniform on both
# devices (a different float32 sum order could move a draw that lands right on a
# boundary, which a random uniform practically never does). `tests/test_sampling.py`
# runs the chi-square test on the GPU sampler too.

# %%
from tinyvllm_lib.engine.sampler_cuda import CudaSampler

if can_launch():
    check_logits = (rng.standard_normal((4, 200)) * 2).astype(np.float32)
    mixed = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20, seed=5),
        SamplingParams(top_p=0.6, seed=6),
        SamplingParams(temperature=0),
    ]

    def draw(sampler) -> list[int]:
        gens = [np.random.default_rng(p.seed) for p in mixed]
        return sampler(
            check_logits, SamplingMetadata.from_params(mixed, gens)
        ).token_ids.tolist()

    on_cpu, on_gpu = draw(Sampler()), draw(CudaSampler(200, 4))
    print(f"NumPy sampler: {on_cpu}, GPU sampler: {on_gpu}")
    assert on_cpu == on_gpu and on_cpu[0] == check_logits[0].argmax()

# %% [markdown]
# The penalties on both devices: the same rows, the prompt and output lists on the host
# for NumPy, slots filled from them for the GPU. A greedy row whose favourite token is
# a repeat changes its mind on both, and after the step the slot counts the token just
# drawn.

# %%
if can_launch():
    repeats = [(list(range(5)), [7, 7, 3]), (list(range(5)), [7, 7, 3]), None]
    penalty_params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.8, presence_penalty=1.0, seed=4),
        SamplingParams(temperature=0),
    ]
    seen_logits = (rng.standard_normal((3, 200)) * 2).astype(np.float32)
    seen_logits[:, 7] = seen_logits.max() + 0.5  # every row's favourite: token 7

    def draw_penalized(sampler) -> list[int]:
        gens = [np.random.default_rng(p.seed) for p in penalty_params]
        meta = SamplingMetadata.from_params(penalty_params, gens, repeats)
        return sampler(seen_logits, meta).token_ids.tolist()

    penalty_sampler = CudaSampler(200, 3)
    on_cpu, on_gpu = draw_penalized(Sampler()), draw_penalized(penalty_sampler)
    print(f"NumPy sampler: {on_cpu}, GPU sampler: {on_gpu} (7 is the repeat)")
    assert on_cpu == on_gpu and on_cpu[0] != 7 and on_cpu[2] == 7
    slot_counts = penalty_sampler.penalties.counts.copy_to_host()[0]
    assert slot_counts[7] == 2 + (on_gpu[0] == 7) and slot_counts[on_gpu[0]] >= 1

# %% [markdown]
# Greedy rows are split into shares, so the combine must keep `np.argmax`'s rule: the
# same largest value in the first and the last share goes to the first. And every
# row's ticket counter must be back at zero, or the next launch would combine too early.

# %%
if can_launch():
    tied = rng.standard_normal((3, 200)).astype(np.float32)
    tied[:, [30, 170]] = tied.max() + 1  # one value in the first share, one in the last
    greedy_sampler = CudaSampler(200, 3)
    greedy_rows = SamplingMetadata.from_params(
        [SamplingParams(temperature=0)] * 3, [rng] * 3
    )
    picked = greedy_sampler(tied, greedy_rows).token_ids.tolist()
    print(
        f"{greedy_shares(3)} shares a row; picked {picked}; "
        f"np.argmax {tied.argmax(1).tolist()}"
    )
    assert picked == tied.argmax(1).tolist() == [30, 30, 30]
    assert not greedy_sampler.tickets.copy_to_host().any()

# %% [markdown]
# ### How fast is sampling?
#
# `bench/ch08b_sampler.py` times the sampling launches alone on the GPU, replayed from a
# CUDA graph over logits rotated past L2, for both rungs, at 1 and 256 rows of Llama 3's
# 128,256 logits; it records to `book/data/ch08b_sampler.json`. The floor is what the
# row's bytes take at chapter 1's bandwidth ceiling: 0.5 MB a row, about a tenth of a
# microsecond for one row. At one row no kernel comes near it — each of the seven
# launches costs a few microseconds however little it reads — so what to compare there
# is the rungs; at 256 rows (131 MB) the passes over the rows are what count.

# %% tags=["hide-input"]
sampler_records = [r for r in load_records("ch08b_sampler") if r["name"] == "sample"]
timed = {(r["shape"][0], r["setting"], r["kernel"]): r for r in sampler_records}
not_yet = "(not recorded yet)"
ceiling_gbs, ceiling_name = bandwidth_ceiling(
    sampler_records[0]["device"]["name"] if sampler_records else None
)
prose.glue("ch08b_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))


def bytes_us(r: dict) -> float:
    """Microseconds the record's bytes take at the ceiling, computed now."""
    return r["bytes"] / ceiling_gbs / 1e3

prose.glue(
    "ch08b_sampler_gpu",
    sampler_records[0]["device"]["name"] if sampler_records else "GPU " + not_yet,
)
for rows in (1, 256):
    for setting, key in (("top_p_0.9", "topp"), ("greedy", "greedy")):
        new, old = timed.get((rows, setting, "radix")), timed.get(
            (rows, setting, "bisection")
        )
        for label, r in (("new", new), ("old", old)):
            prose.glue(
                f"ch08b_{key}_{label}_{rows}",
                f"{r['value']:.1f} µs" if r else not_yet,
            )
        prose.glue(
            f"ch08b_{key}_gain_{rows}",
            f"{old['value'] / new['value']:.0f}×" if new and old else not_yet,
        )
        prose.glue(
            f"ch08b_{key}_times_{rows}",
            f"{new['value'] / bytes_us(new):.1f}×" if new and ceiling_name else not_yet,
        )
if sampler_records:
    settings = list(dict.fromkeys(r["setting"] for r in sampler_records))
    fig, axes = new_figure(1, 2, width=10, height=3)
    for ax, rows in zip(axes, (1, 256)):
        x = np.arange(len(settings))
        for dx, kernel in ((-0.2, "bisection"), (0.2, "radix")):
            us = [timed.get((rows, s, kernel), {}).get("value", np.nan) for s in
                  settings]
            ax.bar(x + dx, us, 0.4, label=kernel)
        some = next(r for r in sampler_records if r["shape"][0] == rows)
        ax.axhline(bytes_us(some), color="k", lw=0.8, label="bytes at the ceiling")
        ax.set_yscale("log")
        ax.set_xticks(x, settings, rotation=30, fontsize=7)
        ax.set_title(f"{rows} row(s) x {some['shape'][1]:,} logits", fontsize=9)
    axes[0].set_ylabel("µs per sample")
    axes[0].legend(fontsize=7)
    plt.show()
else:
    print("not recorded yet: run bench/ch08b_sampler.py on a GPU")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch08b_sampler_gpu}}, a top-p 0.9 sample of one row took
{{ch08b_topp_old_1}} with the bisection and {{ch08b_topp_new_1}} with the radix select
({{ch08b_topp_gain_1}}); at 256 rows {{ch08b_topp_old_256}} against
{{ch08b_topp_new_256}} ({{ch08b_topp_gain_256}}), which is {{ch08b_topp_times_256}} the
time the rows' bytes take at {{ch08b_ceiling}}: the passes that top-p needs (the max,
two or three digits, the draw) each read the rows once more. Greedy rows pay for the
launches they skip: {{ch08b_greedy_new_1}} at one row against {{ch08b_greedy_old_1}}
for the first rung's single launch.
""")

# %% [markdown]
# ## Stopping, and streaming text
#
# A sequence ends when the model emits an **end-of-sequence** token — Llama 3.2 has
# three: `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`, collected by `ModelConfig` from
# `config.json` and `generation_config.json` — unless `ignore_eos`; when it emits one of
# the request's `stop_token_ids`; when its text contains one of the `stop` strings (the
# text then ends just before it); and at `max_tokens` new tokens. The first three finish
# with reason `"stop"`, the last with `"length"`.
#
# Stop strings and streaming need the text *while* tokens arrive. Decoding each new
# token alone fails: byte-level BPE splits a character of several UTF-8 bytes — an
# emoji, a CJK character — over several tokens, and a token holding half a character
# decodes to the replacement character U+FFFD (�):

# %%
text = "I love 🦙 and 東京!"
pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
print(pieces)
assert "".join(pieces) != text

# %% [markdown]
# vLLM's incremental detokenizer keeps two offsets into the token list. It decodes a
# short window — the tokens from `prefix_offset` on — and compares it with the text of
# the window's old part (`prefix_offset` to `read_offset`). What the new text adds is
# emitted only if it does not end in U+FFFD; then both offsets move forward. A window
# also gives tokenizers whose pieces depend on their neighbours (SentencePiece's leading
# spaces) the context they need; it starts with the last few prompt tokens.

# %%
#| export engine.detokenizer
# prompt tokens kept as context for the first new tokens (vLLM's initial offset)
INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only once it is stable (vLLM's prefix and
    read offsets).
    """

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids = [int(i) for i in prompt_token_ids[-INITIAL_CONTEXT:]]
        tokenizer.decode(self.token_ids)  # checks them once: ValueError if out of range
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        # the book's Tokenizer wraps the tokenizers library: decode with it directly
        self.backend = getattr(tokenizer, "backend", tokenizer)
        self.vocab_size = getattr(tokenizer, "vocab_size", None)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ('' while a character is
        incomplete).
        """
        self.push(token_id)
        return self._advance(is_final=False)

    def push(self, token_id: int) -> None:
        """Append a token without decoding: its text comes with the next add or
        flush.
        """
        token_id = int(token_id)
        if self.vocab_size is not None and not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        self.token_ids.append(token_id)

    def flush(self) -> str:
        """The text not emitted yet, complete or not (at the end of generation)."""
        return self._advance(is_final=True)

    def _decode(self, ids: list[int]) -> str:
        # ids checked as they came in: the tokenizers library directly, without
        # Tokenizer.decode's conversion and check of every id each time (two calls per
        # token, hundreds of rows a step: a tenth of the host's step at 256 rows)
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, is_final: bool) -> str:
        prefix_text = self._decode(
            self.token_ids[self.prefix_offset : self.read_offset]
        )
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith("\ufffd") and not is_final
        ):
            # nothing new, or it ends in the middle of a character: wait for more tokens
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str]
) -> tuple[str, int] | None:
    """(stop string, its index) for the earliest stop string that ends within the last
    num_new_chars characters.
    """
    found = None
    for s in stop:
        i = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if i != -1 and (found is None or i < found[1]):
            found = (s, i)
    return found


# %%
from tinyvllm_lib.engine.detokenizer import IncrementalDetokenizer

prompt_for_demo = tokenizer.encode("Say it: ")
detok = IncrementalDetokenizer(tokenizer, prompt_for_demo)
streamed = [detok.add(i) for i in tokenizer.encode(text)] + [detok.flush()]
print(streamed)
assert "".join(streamed) == text and "\ufffd" not in "".join(streamed)

# %% [markdown]
# Empty pieces are the steps where a character was still incomplete. Stop strings bring
# one more subtlety to streaming: the text that has arrived may be the *beginning* of a
# stop string ("Par" of "Paris"), so a streaming engine holds back the last
# `len(longest stop string) − 1` characters until it knows. The request object below
# does that, and it gathers the rest of a request's state: its generator, tokens, text,
# log-probabilities and finish reason. Two fields are for whoever schedules it: its
# **status** — waiting, running, finished — and `num_computed_tokens`, how many of its
# tokens already have their keys and values in the cache. A step computes the tokens
# after those; chapter 9's scheduler reads both. Its output has the shape of vLLM's; a
# request ended from outside (a client that went away) finishes with reason `"abort"`.

# %%
#| export engine.outputs
from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    # the sum of the chosen tokens' log-probs, when logprobs were asked for
    cumulative_logprob: float | None
    # per step {token id: log-prob}: the chosen token, then the top k
    logprobs: list[dict[int, float]] | None
    # "stop" (eos, stop string or stop token), "length" or "abort"; None while running
    finish_reason: str | None = None
    # the stop string or stop token id that ended it
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and what was generated from it (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # None for the first token, then one dict per token
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    # prompt tokens whose K/V came from the prefix cache (chapter 10) instead of being
    # computed
    num_cached_tokens: int = 0


# %%
#| export engine.request
import enum

import numpy as np

from tinyvllm_lib.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from tinyvllm_lib.engine.outputs import CompletionOutput, RequestOutput
from tinyvllm_lib.engine.sampler import settings_row
from tinyvllm_lib.engine.sampling_params import RequestOutputKind, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet: no cache, nothing computed
    RUNNING = "running"  # admitted: it owns cache blocks and is computed step by step
    FINISHED = "finished"


class Request:
    """One prompt being generated: its settings and generator, its tokens and text, and
    when it stops.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids,
        tokenizer=None,
        generator: np.random.Generator | None = None,
        streams_text: bool = False,
    ):
        """streams_text: its caller reads the text as it grows (stream_delta), whatever
        the output kind it asks the engine for.
        """
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = [int(i) for i in prompt_token_ids]
        self.max_tokens = max_tokens
        self.generator = (
            generator if generator is not None else np.random.default_rng(params.seed)
        )
        self.eos_token_ids = (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        # its row of a step's SamplingMetadata, made once
        self.sampling_settings = settings_row(params)
        self.detokenizer = (
            None
            if tokenizer is None
            else IncrementalDetokenizer(
                tokenizer, self.prompt_token_ids, params.skip_special_tokens
            )
        )
        # no one reads its text before it finishes (no stream, no stop string): decode
        # it once then, not token by token (two decodes a token)
        self.defer_text = (
            not streams_text
            and params.output_kind is RequestOutputKind.FINAL_ONLY
            and not params.stop
        )
        self.output_token_ids: list[int] = []
        self.text, self.num_streamed = "", 0
        self.logprobs = None if params.logprobs is None else []
        self.cumulative_logprob = None if params.logprobs is None else 0.0
        self.prompt_logprobs = None
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache
        self.finish_reason, self.stop_reason = None, None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose keys and values are in the cache

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Its tokens start .. end - 1 (prompt, then output), without joining the whole
        lists.
        """
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return (
            self.prompt_token_ids[start:end]
            + self.output_token_ids[: max(0, end - num_prompt)]
        )

    def abort(self) -> None:
        """End it from outside (finish_reason 'abort'), keeping what it has
        generated.
        """
        if not self.is_finished:
            self.finish_reason = "abort"
            if self.defer_text and self.detokenizer is not None:
                # what it has, decoded now: its stable text, as a streamed request keeps
                # (a last character still incomplete is left out)
                self.text += self.detokenizer.flush().rstrip("\ufffd")
        self.status = RequestStatus.FINISHED

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(
        self, token_id: int, logprob=None, top_ids=None, top_values=None
    ) -> None:
        """Add a chosen token: its log-probs, its text; finish on eos, a stop token or
        string, or max_tokens.
        """
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None:
            step = {token_id: float(logprob)}  # the chosen token first, then the top k
            k, keep_first = self.params.logprobs, step.setdefault
            for i, v in zip(top_ids[:k], top_values[:k]) if k > 0 else ():
                keep_first(int(i), float(v))
            self.logprobs.append(step)
            self.cumulative_logprob += float(logprob)
        if token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token_id in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        is_finished = self.finish_reason is not None
        if self.detokenizer is not None and (
            not is_finished or self.params.include_stop_str_in_output
        ):
            if self.defer_text:  # no stop strings either: the text waits for the end
                self.detokenizer.push(token_id)
            else:
                new_text = self.detokenizer.add(token_id)
                self.text += new_text
                found = (
                    find_stop_string(self.text, len(new_text), self.params.stop)
                    if not is_finished and self.params.stop
                    else None
                )
                if found is not None:
                    stop, index = found
                    self.text = self.text[
                        : index + len(stop)
                        if self.params.include_stop_str_in_output
                        else index
                    ]
                    self.finish_reason, self.stop_reason = "stop", stop
                    self.status = RequestStatus.FINISHED
                    return
        if not is_finished and len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason, is_finished = "length", True
        if is_finished:
            if self.detokenizer is not None:
                # a character left incomplete at the end: its U+FFFD
                self.text += self.detokenizer.flush()
            self.status = RequestStatus.FINISHED

    def stream_delta(self) -> str:
        """New text that can no longer change (the possible start of a stop string is
        held back).
        """
        hold = 0
        if (
            not self.is_finished
            and self.params.stop
            and not self.params.include_stop_str_in_output
        ):
            hold = max(map(len, self.params.stop)) - 1
        end = max(self.num_streamed, len(self.text) - hold)
        delta, self.num_streamed = self.text[self.num_streamed : end], end
        return delta

    def set_prompt_logprobs(self, chosen, top_ids=None, top_values=None) -> None:
        """From the prompt's positions in order (row t predicts token t + 1; rows past
        the prompt's last token but one are ignored): each prompt token's log-prob
        given the ones before, and the top k (the sampler's logprobs_of, or the GPU's).
        """
        ids, k = self.prompt_token_ids, self.params.prompt_logprobs
        self.prompt_logprobs = [None]
        for t, token in enumerate(ids[1:]):
            step = {token: float(chosen[t])}
            if k > 0:
                step.update(
                    (int(i), float(v))
                    for i, v in zip(top_ids[t][:k], top_values[t][:k])
                    if int(i) not in step
                )
            self.prompt_logprobs.append(step)

    def output(self) -> RequestOutput:
        """Its state as a RequestOutput: the output tokens copied (they grow), the
        prompt's ids and the log-prob lists shared (read them, do not change them).
        """
        completion = CompletionOutput(
            0,
            self.text,
            list(self.output_token_ids),
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,  # a copy per step would cost O(prompt) per token
            self.prompt_logprobs,
            [completion],
            self.is_finished,
            self.num_cached_tokens,
        )


# %% [markdown]
# ## The model runner
#
# Everything a step needs is now there: the cache and its attention (chapter 8), the
# model's layer loop (chapter 7), the sampler. The **model runner** puts them behind one
# call. Its input is what a scheduler decides — *these requests, this many new tokens
# each, these blocks* — and its output is one sampled token per request. In between,
# four stages, the same on both devices:
#
# 1. **prepare**: the step's `InputBatch` — token ids, positions, the attention
#    metadata, the rows that need logits, the sampling settings — in one vectorised
#    NumPy pass over the batch;
# 2. **the layer loop**, handed the device's attention over the device's cache;
# 3. **the LM head** on the rows that need logits only: each request's last new token,
#    plus the whole prompt of a request that asked for its prompt's log-probabilities.
#    The head is the largest matrix of a small model (SmolLM2: 28 of its 135 M weights)
#    and a prompt can have thousands of rows, so they are gathered first (on the GPU by
#    a small kernel, since a batch's last rows are not next to each other);
# 4. **the sampler**: a token for each request that is due one, and for a prompt's rows
#    the log-prob of each next prompt token and its top k (`prompt_logprobs`, the same
#    `logprobs_of` a sampled row's `logprobs` use).
#
# The device picks the classes — `LlamaNumpy`, `KVCache`, `CachedAttention` and
# `Sampler` on the CPU; `LlamaCuda`, `CudaKVCache`, `PagedAttention` and `CudaSampler`
# on the GPU — and on the GPU the runner makes, once, every buffer a step reads or
# writes: the activations of the largest step, the step's packed inputs, decode
# attention's workspace, the logits. A decode step of up to `max_num_seqs` sequences
# then copies its inputs in with one copy and allocates nothing, and no value that
# changes from step
# to step reaches a kernel's grid: the first condition for capturing it as a CUDA graph
# (chapter 11).

# %%
#| export kernels.gather
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.checks import is_c_contiguous
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


@cuda.jit
def gather_rows_kernel(src, indices, out):
    """out[r] = src[indices[r]]: a block per output row, its threads along the row."""
    wait_for_previous_kernel()
    r = cuda.blockIdx.x
    row = indices[r]
    for c in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[r, c] = src[row, c]


PTX_SIGNATURES = {
    "gather_rows_kernel": ["void(uint16[:, ::1], int64[::1], uint16[:, ::1])"]
}


def gather_rows(src, indices, out, stream=0, threads: int = 128):
    """out[r] = src[indices[r]] for 2-D arrays of the same dtype and width; indices
    int64 (rows of out,).

    Host indices are range-checked here; device indices come from the engine, never from
    a user.
    """
    if (
        src.ndim != 2
        or out.ndim != 2
        or src.dtype != out.dtype
        or src.shape[1] != out.shape[1]
    ):
        raise ValueError(
            "gather_rows: src and out must be 2-D of one dtype and width, got "
            f"{src.dtype} {tuple(src.shape)} "
            f"and {out.dtype} {tuple(out.shape)}"
        )
    if indices.dtype != np.int64 or indices.shape != (out.shape[0],):
        raise TypeError(
            f"gather_rows: indices must be int64 ({out.shape[0]},), got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    if not (is_c_contiguous(src) and is_c_contiguous(out)):
        raise ValueError("gather_rows: src and out must be C-contiguous")
    if (
        isinstance(indices, np.ndarray)
        and indices.size
        and not 0 <= indices.min() <= indices.max() < src.shape[0]
    ):
        raise ValueError(
            f"gather_rows: indices must be rows of src, in [0, {src.shape[0]})"
        )
    if out.shape[0]:
        gather_rows_kernel[out.shape[0], threads, stream](src, indices, out)
    return out


# %% [markdown]
# The runner's settings, and every later part's, travel as one object: `EngineConfig`,
# with vLLM's field names. `LLM(...)` makes it from its keyword arguments, the engine
# fills in what depends on the model (the longest sequence it may serve, the step's
# token budget) and hands the same object to the runner. Fields a later chapter uses
# are here already — the pool's size and the prefix cache (chapter 10), graphs and
# overlap (chapter 11) — so that no part takes a list of positional settings and no
# chapter's class grows another. Each field is checked once, when it is made.

# %%
#| export engine.engine_config
import os
from dataclasses import dataclass

DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "simt", "tensor_cores")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is started with (vLLM's names); LLM(**kwargs) makes it,
    LLMEngine completes it for its model, the runner reads it.
    """

    model: str | os.PathLike = "smollm2"
    device: str = "auto"  # "auto": cuda where there is a GPU, else cpu
    max_model_len: int | None = None  # None: the model's limit, at most 4,096
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # a step's token budget; None: 8,192
    seed: int = 0  # the generator of requests that bring no seed
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # chapter 10: the pool of KV blocks and the prefix cache
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # chapter 11: CUDA graphs, and a step launched before the last is post-processed
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: wherever the runner can
    # chapter 13: one process per rank, each with a shard of the model; a rank that
    # does not answer a collective within distributed_timeout seconds ends the engine
    tensor_parallel_size: int = 1
    distributed_timeout: float = 60.0
    # chapter 14: prefill attention on the SIMT cores (chapter 10's kernel) or the
    # tensor cores; "auto": the tensor cores on a GPU where the head size allows
    attention_backend: str = "auto"
    # chapter 15: "int8" or "fp8" weights, quantized from the bf16 folder as they are
    # loaded; None: bf16, or the format of a folder quantized offline (its own codes);
    # quantize_lm_head: the LM head in that format too (rounded to nearest as it loads;
    # this engine's name: vLLM reads a quantized head from a checkpoint's config)
    quantization: str | None = None
    quantize_lm_head: bool = False

    def __post_init__(self):
        if self.device not in ("auto", *DEVICES):
            raise ValueError(
                f"device must be one of auto, {', '.join(DEVICES)}, got "
                f"{self.device!r}"
            )
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens",
                     "num_kv_blocks", "kv_cache_memory_bytes", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (
            not _is_int(self.max_model_len) or self.max_model_len < 2
        ):
            raise ValueError(
                f"max_model_len must be an integer of at least 2, got "
                f"{self.max_model_len!r}"
            )
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a power of two, got {self.block_size!r}"
            )
        if (self.max_num_batched_tokens or self.max_num_seqs) < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_num_seqs ({self.max_num_seqs}): a decode step computes a "
                "token for every running request"
            )
        if not (isinstance(self.gpu_memory_utilization, (int, float))
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(
                "gpu_memory_utilization is the share of the GPU's memory the engine "
                f"may use, in (0, 1]; got {self.gpu_memory_utilization!r}"
            )
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        timeout = self.distributed_timeout
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(
                f"distributed_timeout must be a positive number of seconds, got "
                f"{timeout!r}"
            )
        if self.quantization is not None:  # chapter 15's formats
            from tinyvllm_lib.quantization.formats import check_quantization

            check_quantization(self.quantization)
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head must be True or False, got "
                             f"{self.quantize_lm_head!r}")

    def check_quantize_lm_head(self) -> None:
        """ValueError where quantize_lm_head asks for an 8-bit head of bf16 weights: a
        check once quantization is known (chapter 10's engine reads it from a folder
        quantized offline)."""
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=True stores the LM head in 8 bits: it "
                             "needs quantization='int8' or 'fp8' (--quantization), "
                             "or a folder quantized offline")


# %% [markdown]
# A step is a contract between two parts: the scheduler says what to run
# (`SchedulerOutput`), the runner says what came of it (`ModelRunnerOutput`). The two
# types live in a module of their own, `engine.step_outputs`, that neither side owns,
# as vLLM keeps its `SchedulerOutput` apart from both: a scheduler imports them without
# importing the runner, its kernels or numba.

# %%
#| export engine.step_outputs
from dataclasses import dataclass

import numpy as np

from tinyvllm_lib.engine.request import Request
from tinyvllm_lib.engine.sampler import SamplerOutput


@dataclass
class SchedulerOutput:
    """One step's work, as a scheduler decides it: which requests run, how many new
    tokens each, and their blocks.
    """

    # the batch: its num_prefills prompts first, then one-token decodes
    requests: list[Request]
    # per request: the tokens computed this step, after its num_computed_tokens
    num_new_tokens: list[int]
    num_prefills: int
    # (len(requests), max_blocks) int32: each request's row of the block table
    block_tables: np.ndarray
    # chapter 11: a step planned before the last one's tokens reach the host; row i's
    # token is the one the last step sampled in its row prev_rows[i]
    prev_rows: np.ndarray | None = None
    # (len(requests),) int: how many blocks each row of block_tables holds (chapter
    # 11's step planned ahead copies the rows and rewrites only those that grew);
    # None: not known
    num_blocks: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(sum(self.num_new_tokens))


@dataclass
class ModelRunnerOutput:
    """What a step produced: one sampled token per request, and the prompt log-probs
    some asked for.
    """

    # one row per request whose next token was due, in the batch's order
    sampled: SamplerOutput
    # per request: its prompt rows' log-probs (chosen, top ids, top log-probs; the
    # sampler's prompt_logprobs), else None
    prompt_logprobs: list


# %% [markdown]
# The runner turns a `SchedulerOutput` into one typed batch, `InputBatch` (vLLM's
# name; SGLang calls it `ForwardBatch`): the token ids and positions, the attention
# metadata, the rows that need logits, and the sampling settings of the rows due a
# token — the *prepare* stage above, in one vectorised pass, for both devices. The CPU
# reads its arrays as they are.
#
# On the GPU every one of those arrays must cross to the device each step, and each
# copy is a call from Python into the driver, as a launch is. So they cross as one:
# `PackedInputs` lays every field of a step of T tokens and R requests at a fixed offset
# of one pinned host buffer, the 8-byte fields first so that each is aligned, and one
# copy moves the lot into a device buffer of the same layout; the batch then carries
# the device views (`device`) that the kernels read. There are two host buffers, used
# in turn: a copy from pinned memory is queued, not done, when it returns, and chapter
# 11 fills the next step while the last one's copy may still wait on the stream. Two
# fields are chapter 11's and sit unused until then: `prev_rows` (a step launched
# before the host knows its tokens) and the padding a CUDA graph's fixed size needs.

# %%
#| export engine.input_batch
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.sampler import SamplingMetadata
from tinyvllm_lib.engine.step_outputs import SchedulerOutput
from tinyvllm_lib.kernels.attention import FLASH_BLOCK_Q
from tinyvllm_lib.kernels.paged_attention import prefill_tiles, tile_capacity
from tinyvllm_lib.layers.attention_metadata import (
    AttentionMetadata,
    build_attention_metadata,
)


class StepShape(NamedTuple):
    """The shape a step is padded to when it replays a CUDA graph (chapter 11):
    `tokens` token rows of `rows` requests, the head and the sampler on `sampled` rows;
    `prefill`: its attention is the prefill kernel's (a step with prompt tokens), else
    decode attention's. `argmax_only`: the sampler launches its argmax and nothing else
    (every row greedy, no penalties, no log-probs), where a graph otherwise launches
    every sampling kernel whatever its rows ask.
    """

    tokens: int
    rows: int
    sampled: int
    prefill: bool = False
    argmax_only: bool = False


@dataclass
class InputBatch:
    """One step's inputs, as the runner reads them (vLLM's input batch, SGLang's
    ForwardBatch): host arrays made by from_step; on the GPU, PackedInputs.pack adds
    `device`, the same fields as views of one device buffer.
    """

    num_reqs: int
    token_ids: np.ndarray  # (num_tokens,) int64; a row fed by prev_rows holds 0
    positions: np.ndarray  # (num_tokens,) int64
    metadata: AttentionMetadata  # host arrays
    # (num_logits,) int64: the rows the head runs on: the last new token of each
    # request whose next token is due, then the prompt rows some asked for
    logits_indices: np.ndarray
    prompt_rows: dict[int, slice]  # request index -> its rows of the logits
    # request index -> (the prompt token each of its prompt rows predicts, 0 past the
    # prompt where rows are dropped; the top k it asked for)
    prompt_targets: dict[int, tuple[np.ndarray, int]]
    sampling: SamplingMetadata  # one row per request whose next token is due
    # (num_reqs,) int64 or None: chapter 11's overlap: row i's token is the one the
    # step before sampled in its row prev_rows[i] (on the GPU, never on the host)
    prev_rows: np.ndarray | None = None
    device: dict | None = None  # field name -> device view, once packed
    cudagraph_shape: StepShape | None = None  # the graph it replays (chapter 11)
    turn: int = 0  # which of the two host buffers holds it
    sampled_requests: list | None = None  # the requests of sampling's rows, in order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cudagraph_size(self) -> int | None:
        """The rows of the decode graph it replays (chapter 11), else None."""
        shape = self.cudagraph_shape
        return None if shape is None or shape.prefill else shape.rows

    @property
    def num_sampled(self) -> int:
        return len(self.sampling.temperature)

    @property
    def num_logits(self) -> int:
        return len(self.logits_indices)

    @property
    def is_uniform_decode(self) -> bool:
        """One new token a request, each due its next token, no prompt rows: the steps
        a decode graph can run (chapter 11).
        """
        n = self.num_reqs
        return self.num_tokens == n == self.num_logits == self.num_sampled

    @classmethod
    def from_step(cls, step: SchedulerOutput, block_size: int) -> "InputBatch":
        """The step's arrays in one pass over the batch (nothing whose size grows with
        a request's context).
        """
        requests, ahead = step.requests, step.prev_rows is not None
        num_new = np.asarray(step.num_new_tokens, np.int32)
        num_computed = np.array([r.num_computed_tokens for r in requests], np.int32)
        if ahead:  # a step planned ahead (chapter 11) starts one past the host's
            num_computed += 1
        positions, metadata = build_attention_metadata(
            num_new, num_computed + num_new, step.block_tables, block_size,
            step.num_prefills,
        )
        if ahead:  # their tokens are the last step's samples, still on the GPU
            token_ids = np.zeros(step.num_tokens, np.int64)
        else:
            token_ids = np.fromiter(
                (
                    t
                    for r, c, n in zip(requests, num_computed, num_new)
                    for t in r.token_ids(c, c + n)
                ),
                np.int64,
                step.num_tokens,
            )
        starts = metadata.query_start_loc
        # a request whose tokens are all computed after this step is due its next
        # token: its last new token's logits (a chunk inside a prompt has none)
        if ahead:  # every row planned ahead is a decode row due its next token
            due = np.ones(len(requests), bool)
        else:
            due = num_computed + num_new >= np.fromiter(
                (r.num_tokens for r in requests), np.int64, len(requests)
            )
        logits_indices = [starts[1:][due].astype(np.int64) - 1]
        prompt_rows, prompt_targets, row = {}, {}, int(due.sum())
        for i, r in enumerate([] if ahead else requests):  # ahead: no prompt rows
            # its prefill, or a chunk of it (chapter 10): every prompt row
            if (
                r.params.prompt_logprobs is not None
                and r.prompt_logprobs is None  # not collected yet (else recomputed)
                and num_computed[i] < r.num_prompt_tokens
            ):
                rows = np.arange(starts[i], starts[i + 1], dtype=np.int64)
                logits_indices.append(rows)
                c, n = int(num_computed[i]), int(num_new[i])
                prompt_rows[i] = slice(row, row + n)
                targets = np.zeros(n, np.int64)
                following = r.prompt_token_ids[c + 1 : c + n + 1]
                targets[: len(following)] = following
                prompt_targets[i] = targets, r.params.prompt_logprobs
                row += n
        sampled = (
            list(requests) if due.all()
            else [r for r, d in zip(requests, due) if d]
        )
        # each request's settings row was made once, with the request
        sampling = SamplingMetadata.from_settings(
            b"".join([r.sampling_settings for r in sampled]),
            [r.generator for r in sampled],
            [(r.prompt_token_ids, r.output_token_ids) for r in sampled],
        )
        return cls(len(requests), token_ids, positions, metadata,
                   np.concatenate(logits_indices), prompt_rows, prompt_targets,
                   sampling, step.prev_rows, sampled_requests=sampled)

    def device_metadata(self) -> AttentionMetadata:
        """The attention metadata over the packed device views."""
        v = self.device  # the layout holds exactly the (padded) step's rows
        return replace(
            self.metadata,
            query_start_loc=v["query_start_loc"],
            seq_lens=v["seq_lens"],
            slot_mapping=v["slot_mapping"],
            block_tables=v["block_tables"],
        )


# the packed fields in their order: (name, dtype, count) with count per step of T
# tokens and R requests: "tokens" T, "rows" R, "starts" R + 1, "table" R x max_blocks,
# "logits" T + R (a prompt's rows for its log-probs, and its last row again to sample),
# "tiles" the prefill kernel's tile schedule (chapter 10: ceil(T / 64) + R entries).
# The 8-byte fields first, so that every field is aligned.
PACKED_FIELDS = (
    ("token_ids", np.int64, "tokens"),
    ("positions", np.int64, "tokens"),
    ("slot_mapping", np.int64, "tokens"),
    ("logits_indices", np.int64, "logits"),
    ("uniform", np.float64, "rows"),
    ("top_k", np.int64, "rows"),
    ("prev_rows", np.int64, "rows"),
    ("num_logprobs", np.int64, "rows"),
    ("query_start_loc", np.int32, "starts"),
    ("seq_lens", np.int32, "rows"),
    ("temperature", np.float32, "rows"),
    ("top_p", np.float32, "rows"),
    ("min_p", np.float32, "rows"),
    ("repetition_penalty", np.float32, "rows"),
    ("frequency_penalty", np.float32, "rows"),
    ("presence_penalty", np.float32, "rows"),
    ("penalty_slot", np.int32, "rows"),
    ("tiles", np.int32, "tiles"),
    ("block_tables", np.int32, "table"),
)
# the sampler's settings among them (what CudaSampler.launch reads)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "uniform",
                   "repetition_penalty", "frequency_penalty", "presence_penalty",
                   "penalty_slot", "num_logprobs")
# what a padding row holds (chapter 11 pads a step up to a graph's size): token 0 at
# position 0, no slot, one token of context in block 0, greedy, no penalties, no
# log-probs
PADDING = {
    "token_ids": 0, "positions": 0, "slot_mapping": -1, "logits_indices": 0,
    "uniform": 0.0, "top_k": 0, "prev_rows": -1, "seq_lens": 1, "temperature": 0.0,
    "top_p": 1.0, "min_p": 0.0, "block_tables": 0, "repetition_penalty": 1.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "penalty_slot": -1,
    "num_logprobs": -1,
}
TOKEN_FIELDS = {name for name, _, count in PACKED_FIELDS if count == "tokens"}
# padded from the step's last sampled row, not its last request
SAMPLED_FIELDS = {"logits_indices", *SAMPLING_FIELDS}
MAX_CACHED_LAYOUTS = 512  # views kept for this many step shapes


class PackedInputs:
    """The runner's one set of step buffers: every field of an InputBatch at a fixed
    offset of a pinned host buffer, and a device buffer of the same layout, so that a
    step is one copy. Two host buffers, used in turn: one is filled while the other's
    copy may still be queued. The layout depends on the step's T tokens and R rows; its
    views are made once per shape.
    """

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int,
                 tile_rows: int = FLASH_BLOCK_Q):
        self.max_tokens, self.max_rows = max_tokens, max_rows
        # max_blocks: a block table's entries; tile_rows: the prefill kernel's block_q
        self.max_blocks, self.tile_rows = max_blocks, tile_rows
        nbytes = self._nbytes(max_tokens, max_rows)
        self.hosts = [cuda.pinned_array(nbytes, np.uint8) for _ in range(2)]
        self.device = cuda.device_array(nbytes, np.uint8)
        self._layouts: dict = {}  # (T, R, turn) -> (host views, device views, copy)

    def _fields(self, tokens: int, rows: int):
        counts = {"tokens": tokens, "rows": rows, "starts": rows + 1,
                  "table": rows * self.max_blocks, "logits": tokens + rows,
                  "tiles": tile_capacity(tokens, rows, self.tile_rows)}
        at = 0
        for name, dtype, count in PACKED_FIELDS:
            yield name, dtype, at, counts[count]
            at += counts[count] * np.dtype(dtype).itemsize

    def _nbytes(self, tokens: int, rows: int) -> int:
        fields = self._fields(tokens, rows)
        return sum(n * np.dtype(d).itemsize for _, d, _, n in fields)

    def layout(self, tokens: int, rows: int, turn: int) -> tuple:
        """(host views, device views, (device bytes, host bytes)) of a step of T tokens
        and R rows in host buffer `turn`.
        """
        key = (tokens, rows, turn)
        if key not in self._layouts:
            if not (0 < tokens <= self.max_tokens and 0 < rows <= self.max_rows):
                raise ValueError(
                    f"a packed step holds 1 to {self.max_tokens} tokens of 1 to "
                    f"{self.max_rows} rows, got {tokens} of {rows}"
                )
            if len(self._layouts) >= MAX_CACHED_LAYOUTS:
                self._layouts.clear()
            views = []
            for buffer in (self.hosts[turn], self.device):
                out = {}
                for name, dtype, at, count in self._fields(tokens, rows):
                    end = at + count * np.dtype(dtype).itemsize
                    view = buffer[at:end].view(dtype)
                    out[name] = (view.reshape(rows, self.max_blocks)
                                 if name == "block_tables" else view)
                views.append(out)
            n = self._nbytes(tokens, rows)
            self._layouts[key] = (*views, (self.device[:n], self.hosts[turn][:n]))
        return self._layouts[key]

    def pack(self, batch: InputBatch, turn: int,
             pad_to: StepShape | int | None = None) -> None:
        """Write batch into host buffer `turn` and give it its device views (`device`);
        pad_to: the shape of the graph it replays (chapter 11), an int a decode step
        padded to that many rows.
        """
        n, r, s = batch.num_tokens, batch.num_reqs, batch.num_sampled
        shape = StepShape(pad_to, pad_to, pad_to) if isinstance(pad_to, int) else pad_to
        tokens, rows = (n, r) if shape is None else shape[:2]
        host, device, _ = self.layout(tokens, rows, turn)
        m = batch.metadata
        host["token_ids"][:n], host["positions"][:n] = batch.token_ids, batch.positions
        host["slot_mapping"][:n] = m.slot_mapping
        host["logits_indices"][: batch.num_logits] = batch.logits_indices
        host["query_start_loc"][: r + 1] = m.query_start_loc
        host["seq_lens"][:r] = m.seq_lens
        host["block_tables"][:r, : m.block_tables.shape[1]] = m.block_tables
        for name in SAMPLING_FIELDS:
            host[name][:s] = getattr(batch.sampling, name)
        host["prev_rows"][:r] = -1 if batch.prev_rows is None else batch.prev_rows
        if m.num_prefills:  # chapter 10's tile schedule, over every sequence
            prefill_tiles(m.query_start_loc, m.seq_lens, self.tile_rows, host["tiles"])
        if shape is not None:  # padding rows, one token each, greedy
            for name, value in PADDING.items():
                first = s if name in SAMPLED_FIELDS else r
                host[name][n if name in TOKEN_FIELDS else first :] = value
            host["query_start_loc"][r + 1 :] = np.minimum(
                np.arange(n + 1, n + 1 + rows - r), tokens
            )
        batch.device, batch.cudagraph_shape, batch.turn = device, shape, turn

    def copy(self, batch: InputBatch, stream) -> None:
        """Queue the copy of a packed batch's bytes to the device, on `stream`."""
        shape = batch.cudagraph_shape
        tokens, rows = shape[:2] if shape else (batch.num_tokens, batch.num_reqs)
        to, source = self.layout(tokens, rows, batch.turn)[2]
        to.copy_to_device(source, stream=stream)


# %% [markdown]
# The runner itself. On the GPU `execute_async` packs the batch, queues its one copy,
# runs the step's kernels (`run`, which reads nothing but the batch's device views and
# the runner's buffers), and queues the copy of the sampled ids back; it returns an
# `AsyncModelRunnerOutput` (vLLM's name) whose `get_output()` waits. `execute` is the
# two back to back, and the CPU's `execute` the same stages in NumPy.

# %%
#| export
from dataclasses import dataclass

import numpy as np
from numba import cuda

from tinyvllm_lib.engine.engine_config import DEVICES, EngineConfig
from tinyvllm_lib.engine.input_batch import (
    SAMPLING_FIELDS,
    InputBatch,
    PackedInputs,
    StepShape,
)
from tinyvllm_lib.engine.kv_cache import CudaKVCache, KVCache
from tinyvllm_lib.engine.sampler import Sampler, SamplerOutput
from tinyvllm_lib.engine.sampler_cuda import CudaSampler
from tinyvllm_lib.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tinyvllm_lib.kernels.checks import cdiv
from tinyvllm_lib.kernels.decode_splits import decode_workspace
from tinyvllm_lib.kernels.gather import gather_rows
from tinyvllm_lib.kernels.sampling_radix import NUM_STEPS
from tinyvllm_lib.kernels.tc_attention import prefill_attention_for, prefill_block_q
from tinyvllm_lib.kernels.tc_decode import decode_attention_for
from tinyvllm_lib.layers.attention import CachedAttention, PagedAttention
from tinyvllm_lib.models.llama_cuda import LlamaCuda
from tinyvllm_lib.models.llama_numpy import LlamaNumpy

CUBLAS_WORKSPACE_BYTES = 32 * 2**20  # what cuBLAS recommends on Hopper


@dataclass
class AsyncModelRunnerOutput:
    """A step launched on the GPU (vLLM's name): get_output() waits for its samples."""

    sampler: CudaSampler
    queued: tuple  # what sampler.finish needs
    event: object  # recorded after the copies to the host
    prompt_logprobs: list  # per request: its prompt rows' log-probs (host), else None
    cudagraph_shape: StepShape | None  # the graph it replayed (chapter 11), else None

    @property
    def cudagraph_size(self) -> int | None:
        """The rows of the decode graph it replayed, else None."""
        shape = self.cudagraph_shape
        return None if shape is None or shape.prefill else shape.rows

    def get_output(self) -> ModelRunnerOutput:
        self.event.synchronize()
        return ModelRunnerOutput(
            self.sampler.finish(self.queued), self.prompt_logprobs
        )


class ModelRunner:
    """A step of the model for a batch of requests, on "cpu" (NumPy) or "cuda" (the
    book's kernels): the step's InputBatch -> the layer loop with the device's attention
    over its cache -> the LM head on the rows that need logits -> the sampler. On the
    GPU every buffer a step reads or writes is made here, once: a decode step of up to
    max_num_seqs requests is one copy in and allocates nothing.
    """

    def __init__(
        self, folder, config: EngineConfig, num_kv_slots: int | None = None,
        sampler=None, model=None,
    ):
        """config: its device resolved ("cpu" or "cuda") and its max_model_len and
        max_num_batched_tokens set (the engine completes them). sampler: on "cuda",
        the class of sampler (CudaSampler's signature; default CudaSampler). model:
        the device's model, made already (chapter 13's shard of one); None: the
        folder's.
        """
        device, kv_cache_dtype = config.device, config.kv_cache_dtype
        if device not in DEVICES:
            raise ValueError(
                f"device must be one of {', '.join(DEVICES)}, got {device!r}"
            )
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError(
                "the runner needs max_model_len and max_num_batched_tokens set"
            )
        self.engine_config, self.device = config, device
        self.block_size, self.max_num_seqs = config.block_size, config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.graphs = None  # chapter 11's CudaGraphs, once the KV cache exists
        config.check_quantize_lm_head()
        if model is None and config.quantization is not None:
            # chapter 15: 8-bit weights, quantized as the folder's are loaded, or a
            # checkpoint's codes and scales, loaded as they are
            from tinyvllm_lib.quantization.checkpoint import load_quantized_model

            model = load_quantized_model(folder, device, config.quantization,
                                         lm_head=config.quantize_lm_head)
        # the device picks the model, the cache, the attention and the sampler
        if device == "cpu":
            self.model = model or LlamaNumpy.from_folder(folder)
            self.kv_cache_dtype = (
                "float32" if kv_cache_dtype == "auto" else kv_cache_dtype
            )
            self.sampler = Sampler()
        else:
            if kv_cache_dtype not in ("auto", "bfloat16"):
                raise ValueError(
                    "device='cuda' keeps its KV cache in bfloat16, got "
                    f"kv_cache_dtype={kv_cache_dtype!r}"
                )
            self.model = model or LlamaCuda.from_folder(folder)
            # chapter 14: the kernel every step with a prefill runs its attention with
            self.prefill_attention = prefill_attention_for(
                config.attention_backend, self.model.config.head_dim
            )
            mc = self.model.config  # and every decode-only step
            self.decode_attention = decode_attention_for(
                config.attention_backend, mc.head_dim,
                mc.num_attention_heads // mc.num_key_value_heads,
            )
            self.stream = cuda.stream()
            self.kv_cache_dtype = "bfloat16"
            self.sampler = (sampler or CudaSampler)(
                self.model.config.vocab_size, self.max_num_seqs, self.stream
            )
            self._make_device_buffers()
        self.config, self.kv_cache = self.model.config, None
        # None: the engine sizes the cache once the weights and buffers are in place
        if num_kv_slots is not None:
            self.init_kv_cache(num_kv_slots)

    def init_kv_cache(self, num_slots: int) -> None:
        """Make the KV cache: num_slots token slots of every layer's keys and values."""
        self.kv_cache = (
            KVCache(self.config, num_slots, self.kv_cache_dtype)
            if self.device == "cpu"
            else CudaKVCache(self.config, num_slots)
        )

    def _make_device_buffers(self) -> None:
        c, rows, tokens = (
            self.model.config,
            self.max_num_seqs,
            self.max_num_batched_tokens,
        )
        self.activations = self.model.make_buffers(tokens)  # the largest step's
        # the step's inputs: one pinned host buffer (two, used in turn), one copy
        self.packed = PackedInputs(
            tokens, rows, cdiv(self.max_model_len, self.block_size),
            prefill_block_q(self.prefill_attention, self.model.config.head_dim),
        )
        self.turn, self.events = 0, [cuda.event(), cuda.event()]
        self.workspace = decode_workspace(
            rows, self.max_model_len, c.num_attention_heads, c.head_dim
        )
        # gathered rows for the head
        self.head_rows = cuda.device_array((rows, c.hidden_size), np.uint16)
        self.logits = cuda.device_array((rows, c.vocab_size), np.float32)
        # cuBLAS's scratch, ours and fixed (CUDA graphs capture its address)
        self.cublas_workspace = cuda.device_array(CUBLAS_WORKSPACE_BYTES, np.uint8)

    def _check(self, step: SchedulerOutput) -> None:
        if (
            not 0 < step.num_tokens <= self.max_num_batched_tokens
            or len(step.requests) > self.max_num_seqs
        ):
            raise ValueError(
                f"a step takes 1 to {self.max_num_batched_tokens} tokens of at most "
                f"{self.max_num_seqs} "
                f"requests, got {step.num_tokens} tokens of {len(step.requests)}"
            )

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the requests' new tokens through the model, a token sampled for
        each whose next token is due.
        """
        if self.device == "cuda":
            return self.execute_async(step).get_output()
        self._check(step)
        return self.execute_batch(InputBatch.from_step(step, self.block_size))

    def shutdown(self) -> None:
        """Nothing to stop: one process (chapter 13's executor stops its ranks)."""

    def execute_batch(self, batch: InputBatch) -> ModelRunnerOutput:
        """Run one step's InputBatch (what chapter 13's ranks are sent)."""
        if self.device == "cuda":
            return self.execute_batch_async(batch).get_output()
        attention = CachedAttention(self.config, self.kv_cache, batch.metadata)
        hidden = self.model.hidden_states(batch.token_ids, batch.positions, attention)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = (
            self.sampler(logits[: batch.num_sampled], batch.sampling)
            if batch.num_sampled
            else SamplerOutput(np.empty(0, np.int64))
        )
        return ModelRunnerOutput(sampled, self._prompt_logprobs(batch, logits))

    def execute_async(self, step: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step on the GPU and return without waiting for it: pack its
        batch, queue the one copy, run it (or replay its graph, chapter 11), queue the
        samples' copies back.
        """
        self._check(step)
        return self.execute_batch_async(InputBatch.from_step(step, self.block_size))

    def execute_batch_async(self, batch: InputBatch) -> AsyncModelRunnerOutput:
        """Launch one step's InputBatch on the GPU (what chapter 13's ranks are
        sent).
        """
        if batch.sampling.has_penalties:  # the rows' count slots on the GPU
            batch.sampling.penalty_slot = self.sampler.penalties.slots_for(
                batch.sampled_requests, batch.prev_rows is not None, self.stream
            )
        # the one place that decides whether a step replays a graph
        shape = None if self.graphs is None else self.graphs.shape_for(batch)
        if shape is None and batch.prev_rows is not None:
            raise RuntimeError("a step planned ahead of its tokens must replay a graph")
        turn, self.turn = self.turn, 1 - self.turn
        self.packed.pack(batch, turn, pad_to=shape)
        self.packed.copy(batch, self.stream)
        if shape is None:
            logits = self.run(batch, self.stream)
        else:
            self.graphs.replay(shape)
            logits = self.logits[: shape.sampled]
        queued = self.sampler.enqueue(logits, batch.sampling, turn)
        prompt = self._prompt_logprobs(batch, logits)  # only where asked for
        self.events[turn].record(self.stream)
        return AsyncModelRunnerOutput(
            self.sampler, queued, self.events[turn], prompt, shape
        )

    def _prompt_logprobs(self, batch: InputBatch, logits) -> list:
        """Per request, the log-probs of its prompt rows where it asked for them (the
        sampler's prompt_logprobs, on the logits' device), else None.
        """
        out = [None] * batch.num_reqs
        for i, rows in batch.prompt_rows.items():
            targets, k = batch.prompt_targets[i]
            out[i] = self.sampler.prompt_logprobs(logits[rows], targets, k)
        return out

    def run(self, batch: InputBatch, stream):
        """The step's kernels only, on `stream`, reading the batch's device views (what
        a CUDA graph can capture): layers, head rows, head, sampler; the logits.
        """
        v, c, shape = batch.device, self.config, batch.cudagraph_shape
        n = v["token_ids"].shape[0]  # a padded step's rows too
        num_logits = batch.num_logits if shape is None else shape.sampled
        num_sampled = batch.num_sampled if shape is None else shape.sampled
        b = {name: buf[:n] for name, buf in self.activations.items()}
        b["ids"], b["positions"] = v["token_ids"], v["positions"]
        attention = PagedAttention(
            c, self.kv_cache, batch.device_metadata(), self.workspace,
            self.max_model_len, tiles=v["tiles"],
            prefill_attention=self.prefill_attention,
            decode_attention=self.decode_attention,
        )
        self.model.run(b, attention, stream, self.cublas_workspace)
        if num_logits == 0:  # a chunk that ends inside its prompt: no logits needed
            return self.logits[:0]
        fits = num_logits <= self.max_num_seqs
        hidden = b["normed"]  # a decode step: every row, in order
        if batch.metadata.num_prefills or num_logits != n:  # gather the head's rows
            hidden = (
                self.head_rows[:num_logits]
                if fits  # a large prompt_logprobs request gets buffers of its own
                else cuda.device_array((num_logits, c.hidden_size), np.uint16)
            )
            gather_rows(b["normed"], v["logits_indices"][:num_logits], hidden, stream)
        logits = (
            self.logits[:num_logits]
            if fits
            else cuda.device_array((num_logits, c.vocab_size), np.float32)
        )
        self.model.compute_logits(hidden, logits, stream, self.cublas_workspace)
        if num_sampled:
            rows = {name: v[name][:num_sampled] for name in SAMPLING_FIELDS}
            # eagerly, the steps the rows need; captured, every step (a graph serves
            # every row's settings) — but chapter 11's argmax_only graphs, whose rows
            # need the argmax alone, launch what their rows need too
            graph = shape is not None and not shape.argmax_only
            steps = (range(NUM_STEPS) if graph
                     else self.sampler.steps_for(batch.sampling))
            penalize = graph or batch.sampling.has_penalties
            logprobs = graph or bool(batch.sampling.num_logprobs.max(initial=-1) >= 0)
            self.sampler.launch(logits[:num_sampled], stream, rows, steps, penalize,
                                logprobs)
        return logits


# %% [markdown]
# ## Generating, one request at a time
#
# A loop around the runner generates an answer: the first step computes the whole prompt
# (its keys and values go to the cache, its last row's logits give the first token), and
# every step after computes the one token the step before chose. The request keeps the
# score: its status, how many tokens are computed, its output, when it finishes. This
# loop serves one request at a time — a scheduler that does better is chapter 9.

# %%
from tinyvllm_lib.engine.engine_config import EngineConfig
from tinyvllm_lib.engine.model_runner import ModelRunner
from tinyvllm_lib.engine.request import Request, RequestStatus
from tinyvllm_lib.engine.step_outputs import SchedulerOutput


def generate_one(
    runner: ModelRunner, allocator: ContiguousAllocator, request: Request, on_text=None
) -> Request:
    """Prefill the prompt, then decode one token per step until the request finishes;
    on_text(new text) as it streams.
    """
    row = allocator.allocate()
    request.status = RequestStatus.RUNNING
    try:
        while not request.is_finished:
            # the whole prompt first, then one token a step
            num_new = request.num_tokens - request.num_computed_tokens
            step = SchedulerOutput(
                [request],
                [num_new],
                num_prefills=int(request.num_computed_tokens == 0),
                block_tables=allocator.block_tables([row]),
            )
            out = runner.execute(step)
            request.num_computed_tokens += num_new
            if out.prompt_logprobs[0] is not None:
                request.set_prompt_logprobs(*out.prompt_logprobs[0])
            s = out.sampled
            request.append_token(
                s.token_ids[0],
                *(
                    None if a is None else a[0]
                    for a in (s.logprobs, s.top_ids, s.top_logprobs)
                ),
            )
            if on_text is not None and (delta := request.stream_delta()):
                on_text(delta)
    finally:
        allocator.free(row)
    return request


allocator = ContiguousAllocator(max_num_seqs=1, max_model_len=512)
cpu_runner = ModelRunner(
    folder,
    EngineConfig(device="cpu", block_size=allocator.block_size, max_num_seqs=1,
                 max_num_batched_tokens=512, max_model_len=512),
    allocator.num_slots,
)
prompt_ids = tokenizer.apply_chat_template(question, tokenize=True)


def ask(runner, params: SamplingParams, on_text=None, prompt=prompt_ids) -> Request:
    """A fresh request for the prompt, generated to the end."""
    request = Request(
        "0",
        None,
        prompt,
        params,
        params.max_tokens,
        smollm2.eos_token_ids,
        tokenizer,
        np.random.default_rng(params.seed),
    )
    return generate_one(runner, allocator, request, on_text)


t0 = time.perf_counter()
answer = ask(cpu_runner, SamplingParams(temperature=0, max_tokens=24))
seconds = time.perf_counter() - t0
print(f"{len(prompt_ids)} prompt tokens -> {answer.text!r}")
print(
    f"{len(answer.output_token_ids)} tokens in {seconds:.1f} s on the CPU, "
    f"finish_reason={answer.finish_reason!r}"
)
assert "Paris" in answer.text and answer.status == RequestStatus.FINISHED

# %% [markdown]
# Sampling with a seed is reproducible, and log-probabilities come as vLLM gives them:
# per step, a dict from token id to log-probability — the chosen token, then the
# `logprobs` most likely. (A model of 135 M weights at temperature 0.7 wanders; that is
# what sampling is for.)

# %%
params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=7, logprobs=2)
first, again = ask(cpu_runner, params), ask(cpu_runner, params)
print(repr(first.text))
assert first.output_token_ids == again.output_token_ids
for step_logprobs, token in zip(first.logprobs[:3], first.output_token_ids):
    print(
        f"chose {tokenizer.decode([token])!r:>10}:",
        {tokenizer.decode([i]): round(v, 2) for i, v in step_logprobs.items()},
    )
print(f"cumulative log-prob {first.cumulative_logprob:.2f}")

# %% [markdown]
# Stop strings cut the text, and streaming hands it over piece by piece — never a piece
# of a stop string that may still be completing, never half a character:

# %%
stopped = ask(cpu_runner, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))
print(
    f"stop='Paris': {stopped.text!r}, finish_reason={stopped.finish_reason!r}, "
    f"stop_reason={stopped.stop_reason!r}"
)
assert stopped.finish_reason == "stop" and "Paris" not in stopped.text

pieces = []
streamed = ask(
    cpu_runner, SamplingParams(temperature=0, max_tokens=24), on_text=pieces.append
)
print("streamed pieces:", pieces)
assert "".join(pieces) == streamed.text == answer.text

# %% [markdown]
# The same runner on the GPU — `LlamaCuda`, the bf16 cache, `PagedAttention`, the GPU
# sampler — answers the same question. (In the simulator every GPU thread is a Python
# thread, far too slow for a 30-layer model; `tests/test_model_runner.py` runs a tiny
# one through it there.)

# %%
if has_gpu():
    gpu_runner = ModelRunner(
        folder,
        EngineConfig(device="cuda", block_size=allocator.block_size, max_num_seqs=1,
                     max_num_batched_tokens=512, max_model_len=512),
        allocator.num_slots,
    )
    on_gpu = ask(gpu_runner, SamplingParams(temperature=0, max_tokens=24))
    print(f"on the GPU: {on_gpu.text!r}")
    assert "Paris" in on_gpu.text
    del gpu_runner
else:
    print("no GPU here: the GPU runner is not run")

# %% [markdown]
# ## How fast is one request at a time?
#
# Two benchmark scripts measure it and record to `book/data/ch08_kv_cache.json`; the
# book plots what they recorded. `bench/ch08_decode_cpu.py` decodes 32 greedy tokens
# after a short chat prompt with this engine and with `transformers` (float32,
# `model.generate` with its own KV cache) on the same CPU in one run, and takes the
# median of several runs. `bench/ch08_decode_gpu.py` runs the GPU engine at batch 1 — on
# SmolLM2 and on a random-weight folder of Llama 3.2 1B's exact shapes — and, for one
# decode step, compares its wall time from Python with the time of the same step's
# kernels replayed from a captured CUDA graph, which is what the kernels alone cost.

# %% tags=["hide-input"]
kv_records = load_records("ch08_kv_cache")
by_name = {(r["name"], r["device"]["name"]): r for r in kv_records}
cpu_decode = [
    r for r in kv_records if r["metric"] == "tok/s" and r["name"].endswith("_decode")
]
ours = next((r for r in cpu_decode if r["name"].startswith("tinyvllm")), None)
theirs = next((r for r in cpu_decode if r["name"].startswith("transformers")), None)
gpu_engines = [r for r in kv_records if r["name"].startswith("gpu_engine_")]
prose.glue("ch08b_cpu", ours["device"]["name"] if ours else "(not yet measured)")
prose.glue(
    "ch08b_ours", f"{ours['value']:.1f} tokens/s" if ours else "(not yet measured)"
)
prose.glue(
    "ch08b_theirs",
    f"{theirs['value']:.1f} tokens/s" if theirs else "(not yet measured)",
)
prose.glue(
    "ch08b_ratio",
    f"{ours['value'] / theirs['value']:.2f}×"
    if ours and theirs
    else "(not yet measured)",
)
steps = {}
for r in kv_records:
    for kind in ("wall", "kernels"):
        if r["name"].startswith(f"gpu_step_{kind}_"):
            steps.setdefault(r["name"][len(f"gpu_step_{kind}_") :], {})[kind] = r
for label, pretty in (("smollm2", "smol"), ("llama_1b_random", "1b")):
    engine = next((r for r in gpu_engines if r["name"] == f"gpu_engine_{label}"), None)
    step_pair = steps.get(label, {})
    prose.glue(
        f"ch08b_gpu_{pretty}",
        f"{engine['value']:.1f} tokens/s" if engine else "(not yet measured)",
    )
    if len(step_pair) == 2:
        wall, kern = step_pair["wall"]["value"], step_pair["kernels"]["value"]
        prose.glue(f"ch08b_wall_{pretty}", f"{wall / 1e3:.1f} ms")
        prose.glue(f"ch08b_kern_{pretty}", f"{kern / 1e3:.2f} ms")
        prose.glue(f"ch08b_lost_{pretty}", f"{1 - kern / wall:.0%}")
    else:
        for key in ("wall", "kern", "lost"):
            prose.glue(f"ch08b_{key}_{pretty}", "(not yet measured)")
prose.glue(
    "ch08b_gpu",
    gpu_engines[0]["device"]["name"] if gpu_engines else "GPU (not yet measured)",
)

if cpu_decode or gpu_engines:
    fig, (ax1, ax2) = new_figure(1, 2, width=10, height=2.8)
    bars = [
        (f"{r['name'].split('_')[0]}, CPU (SmolLM2, f32)", r["value"])
        for r in cpu_decode
    ]
    bars += [
        (f"tinyvllm, GPU ({r['name'][len('gpu_engine_') :]})", r["value"])
        for r in gpu_engines
    ]
    ax1.barh(
        [b[0] for b in bars],
        [b[1] for b in bars],
        color=["#ff7f0e" if "transformers" in b[0] else "#1f77b4" for b in bars],
    )
    ax1.set_xscale("log")
    ax1.set_xlabel("tokens/s, one request (batch 1)")
    ax1.tick_params(labelsize=7)
    labels = sorted(steps)
    if labels:
        x = np.arange(len(labels))
        ax2.bar(
            x - 0.2,
            [steps[k]["wall"]["value"] / 1e3 for k in labels],
            0.4,
            label="step from Python (wall)",
        )
        ax2.bar(
            x + 0.2,
            [steps[k]["kernels"]["value"] / 1e3 for k in labels],
            0.4,
            label="its kernels (graph replay)",
        )
        ax2.set_xticks(x, labels, fontsize=8)
        ax2.set_ylabel("ms per decode step")
        ax2.legend(fontsize=7)
        ax2.set_title(
            "one decode step on the "
            f"{gpu_engines[0]['device']['name'] if gpu_engines else 'GPU'}",
            fontsize=9,
        )
    plt.show()
else:
    print(
        "nothing recorded yet: run bench/ch08_decode_cpu.py, and "
        "bench/ch08_decode_gpu.py on a GPU"
    )

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch08b_cpu}}, the NumPy engine decodes {{ch08b_ours}} and `transformers`
{{ch08b_theirs}}: a ratio of {{ch08b_ratio}}. Both read the same float32 weights per
step, so both are bound by the CPU's memory bandwidth; what differs is the work around
the matrix products.

On the {{ch08b_gpu}} the picture is another. The GPU engine makes {{ch08b_gpu_smol}} on
SmolLM2 and {{ch08b_gpu_1b}} on the 1B-shaped folder — but a decode step of the 1B
shapes takes {{ch08b_wall_1b}} from Python while its kernels take {{ch08b_kern_1b}}:
{{ch08b_lost_1b}} of the step goes to launching about 180 kernels one by one from Python
and to the host work around them (SmolLM2, with 30 layers of small kernels:
{{ch08b_lost_smol}}). The GPU waits for Python. Two remedies follow: give every launch
more work — many requests in each step, chapter 9 — and stop launching from Python at
all — CUDA graphs, chapter 11.
""")

# %% [markdown]
# ## Summary
#
# - The sampler applies temperature, top-k and top-p in vLLM's order and draws with a
#   uniform from the request's own generator; its frequencies pass a chi-square test.
#   The GPU sampler takes the same metadata and finds top-k and top-p thresholds by a
#   radix select over the float order — three passes of 2,048-bin histograms, each row
#   spread over several blocks — in the same seven launches for greedy and sampled rows
#   alike (chapter 11 gives all-greedy batches graphs with the first alone); min-p is a
#   test on $z/T - m$, and ties at a threshold are kept whole.
# - The repetition, frequency and presence penalties come first, on the raw logits.
#   On the GPU each request with penalties holds a slot of token counts and prompt
#   marks (`max_num_seqs` slots, 5 bytes a vocabulary entry each): a kernel applies
#   them before sampling and another counts the sampled token after, inside the step,
#   so a step launched ahead of the host counts right; the host hands slots out,
#   rebuilds one from a request's tokens when it runs without one, and frees it when
#   the request finishes, is aborted or is preempted.
# - A request stops at every eos id, at stop tokens, stop strings and `max_tokens`, and
#   streams text only once it is stable: no half characters, no piece of a stop string.
# - The model runner turns "these requests, these many new tokens each" into sampled
#   tokens on either device: the step's `InputBatch` in one vectorised pass, the layer
#   loop with the device's attention, the head on the rows that need it, the sampler.
#   On the GPU it owns every buffer a step reads or writes: the batch crosses in one
#   copy, and a decode step allocates nothing.
# - One request at a time, the GPU spends most of each step waiting for Python's
#   launches.
#
# Exported to `tinyvllm_lib`: `engine.sampling_params` (`SamplingParams`),
# `engine.sampler` (`Sampler`, `SamplingMetadata`, `SamplerOutput`), `kernels.sampling`
# (the argmax and the bisection rung), `kernels.sampling_radix` (the radix select),
# `kernels.penalties` (the penalties' two kernels), `engine.penalty_slots`
# (`PenaltySlots`), `engine.sampler_cuda` (`CudaSampler`),
# `engine.detokenizer` (`IncrementalDetokenizer`), `engine.outputs` (`RequestOutput`,
# `CompletionOutput`), `engine.request` (`Request`, `RequestStatus`), `kernels.gather`
# (`gather_rows`), `engine.step_outputs` (`SchedulerOutput`, `ModelRunnerOutput`),
# `engine.input_batch` (`InputBatch`, `PackedInputs`) and `engine.model_runner`
# (`ModelRunner`, `AsyncModelRunnerOutput`).
#
# ## Exercises
#
# 1. `apply_top_p` sorts the whole vocabulary. vLLM first applies top-k when both are
#    set — why does that make top-p cheaper? Rewrite `apply_top_p` to sort only the
#    top-k survivors.
# 2. Replace inverse-CDF sampling with the Gumbel-max trick
#    ($\arg\max_i z_i - \log(-\log u_i)$ with one uniform per token). Check it with the
#    chi-square test. Which one is easier to run as one GPU kernel, and which needs
#    fewer random numbers?
# 3. Stream an answer with `generate_one` while timing each step. How long is the first
#    step (the prefill) against the others, and how does that change with the prompt's
#    length?
# 4. The runner gathers the head's rows. For a batch of 64 prompts of 500 tokens on
#    Llama 3.2 1B, how many FLOPs and bytes does gathering save against running the head
#    on every row?
# 5. The penalty slots keep an int32 count per vocabulary entry. How many bytes would a
#    uint16 count, or a sparse list of the tokens a request has seen, take for a
#    request of 2,000 tokens on Llama 3's vocabulary? What would the kernel that
#    applies them then read?
# 6. Run the CPU's `ModelRunner` with `kv_cache_dtype="bfloat16"` in its `EngineConfig`
#    and compare the answer's log-probabilities with the float32 cache's. How large is
#    the difference, and do greedy tokens still agree?
