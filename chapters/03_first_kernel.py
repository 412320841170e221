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
# # 3. First kernel: from text to vectors
#
# Every forward pass of a language model begins the same way: the text is cut into
# **tokens**, each token is a row number of the **embedding table**, and the model's
# first activations are those rows. This chapter builds both steps — the tokenizer on
# the host, the lookup on the GPU — and uses the lookup, the simplest kernel a model
# has, to explain how a GPU runs code.
#
# In this chapter you will learn:
#
# - how text becomes token ids with the Hugging Face `tokenizers` library and a model
#   folder's `tokenizer.json`, and how a chat becomes one prompt through the model's
#   Jinja chat template — byte for byte as `transformers` renders it;
# - how a GPU runs a kernel: a *grid* of *blocks* of *threads*, executed 32 at a time in
#   *warps*, and how to map those threads onto a token × hidden matrix;
# - the embedding lookup in NumPy and as two kernels, one bf16 value per thread per step
#   and then four (*wide loads*), and why the second is faster;
# - what an out-of-range token id does to a kernel, and where to check for it;
# - why a decode step's lookup costs microseconds however well it is written.
#
# It uses the bf16 helpers and the measuring kit of [chapter 01](01_bf16.py), the
# safetensors reader of [chapter 02](02_safetensors.py), and the SmolLM2 folder of
# [chapter 2b](02b_smollm2.py). It exports `tinyvllm_lib.tokenizer` (`Tokenizer`),
# `tinyvllm_lib.kernels.embedding` (`embed`) and `tinyvllm_lib.kernels.checks`
# (`is_c_contiguous`, the launchers' contiguity check).

# %%
#| default_exp kernels.embedding

# %%
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np
from numba import cuda

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32
from tinyvllm_lib.measure import (
    bandwidth_ceiling,
    ceiling_phrase,
    load_records,
    records_table,
)
from tinyvllm_lib.models.safetensors_io import SafetensorsFile
from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.plots import Prose, new_figure
from tinyvllm_lib.runtime import can_launch, has_gpu, is_simulator, where_kernels_run

# the numbers this chapter's prose quotes, filled in as they are measured
prose = Prose()

print(where_kernels_run())
# chapter 2b: built on first use, then found in the cache
folder = resolve_model("smollm2")
print(folder)

# %% [markdown]
# The line above says where this copy's kernels ran. In the rendered book, built by CI
# with no GPU, that is the simulator at tiny shapes: its outputs check correctness, and
# any time it prints says nothing about a GPU. Speed figures and numbers of speed in the
# prose are dated H200 records from `book/data/`:
# [what the numbers on a page are](00_preface.py#what-the-numbers-on-a-page-are).

# %% [markdown]
# ## From text to token ids
#
# A model never sees characters. Its vocabulary is a list of strings — whole words,
# pieces of words, single bytes — and the **tokenizer** cuts text into pieces of that
# list. The folder of every Hugging Face model carries its tokenizer as one file,
# `tokenizer.json`: the vocabulary, the BPE merge rules ([chapter 2b](02b_smollm2.py)
# built SmolLM2's from GGUF metadata), the pre-tokenizer that first splits text into
# words, and the *special tokens* that mark turns in a chat. The Rust library
# `tokenizers` (the one inside `transformers`) runs it:

# %%
from tokenizers import Tokenizer as BackendTokenizer

backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
encoding = backend.encode("Hello, world")
print(encoding.ids, encoding.tokens)
assert encoding.ids == [19556, 28, 905]
added = sorted(backend.get_added_tokens_decoder().items())
specials = [t.content for _, t in added if t.special]
print(f"vocabulary: {backend.get_vocab_size():,} tokens, special: {specials[:6]} ...")

# %% [markdown]
# `Ġworld` is ` world`: byte-level BPE shows the space byte as `Ġ`. Three tokens, three
# rows of the embedding table.
#
# Two more files of the folder say how the tokens are used. `tokenizer_config.json`
# names the special tokens (`bos_token`, `eos_token`, ...) and holds the **chat
# template**; `config.json` gives the beginning- and end-of-sequence token *ids* the
# model was trained with, which we fall back on when the tokenizer's config does not
# name them. The end-of-sequence token is how a model says it is done (chapter 08 stops
# generating there). A *beginning-of-sequence* (BOS) token, where a model has one, is
# added in front of every prompt by the tokenizer's *post-processor*: Llama 3's adds
# `<|begin_of_text|>` (id 128000); SmolLM2's adds nothing.
#
# ### The chat template
#
# An instruction-tuned model was trained on conversations written in one exact format,
# and it answers well only when prompted in that format. The format ships with the model
# as a [Jinja](https://jinja.palletsprojects.com) template. `transformers` renders it in
# a **sandboxed** Jinja environment (a template downloaded with a model is code we did
# not write: the sandbox forbids touching Python internals or changing its inputs) with
# `trim_blocks` and `lstrip_blocks` on, so that `{% ... %}` tags do not leave their own
# newlines and indentation in the prompt. Templates rely on a few extras that
# `transformers` adds, and so must we, or the same template renders a different prompt:
#
# - `raise_exception(message)`, with which templates reject conversations they cannot
#   format;
# - a `tojson` filter that keeps non-ASCII text as it is (`ensure_ascii=False`) and
#   takes an `indent`, unlike Jinja's own, which escapes `<`, `>` and `&` for HTML;
# - `strftime_now(format)`: Llama 3's template writes today's date into the system
#   prompt;
# - the `loopcontrols` extension (`{% break %}`, `{% continue %}`), a `namespace` that
#   refuses names starting with `_`, and a `{% generation %}` tag, which marks the
#   assistant's text for training and renders as its content;
# - the variables `messages`, `add_generation_prompt` (end with the header of the
#   assistant's turn, so that the model writes the answer), `tools`, `documents`, and
#   each special token by name (`bos_token`, `eos_token`, ...).
#
# The template writes the special tokens as text — Llama 3's begins with
# `{{ bos_token }}` — and the text is then encoded *without* the post-processor, since
# it would add a second BOS. Encoding a rendered prompt with the defaults of
# `transformers` (`tok(prompt)`) gives exactly that double `<|begin_of_text|>`, a
# classic silent bug; our `encode` drops a BOS it would add in front of text that
# already starts with one.
#
# Here is the module, a thin wrapper around `tokenizers` and `jinja2`:

# %%
#| export tokenizer
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as _BackendTokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` filter: plain json.dumps, non-ASCII kept, no HTML
    escaping.
    """
    return json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing attributes that start with an underscore (as
    transformers does).
    """

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "chat templates cannot set underscore attributes on a namespace: "
                f"{name!r}"
            )


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without handing them the dict
    type itself.
    """

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training;
    rendering keeps its body.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(
            self.call_method("_body"), [], [], body
        ).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def chat_template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in: sandboxed, trimmed,
    with its helpers.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=_Namespace,
        dict=_TemplateDict(),
    )
    return env


# %% [markdown]
# The `Tokenizer` class reads a model folder. A folder without `tokenizer.json` is
# allowed later in the book (its prompts are token ids), so `from_folder` can return
# `None` for it (`missing_ok=True`) instead of raising — but a folder with *some other*
# tokenizer file (a SentencePiece `tokenizer.model`, say) is an error either way, since
# quietly ignoring it would leave the user wondering why their text prompts are refused.


# %%
#| export tokenizer
def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken
    dict with 'content'.
    """
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config's (a
    string or a list of named ones).
    """
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    if isinstance(template, list):
        named = {
            t.get("name"): t.get("template") for t in template if isinstance(t, dict)
        }
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"{folder / 'tokenizer_config.json'}: chat_template must be a string"
        )
    return template


class Tokenizer:
    """Text <-> token ids with a folder's tokenizer.json, and its chat template rendered
    as transformers does.
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        special_tokens: dict[str, str | None],
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.special_tokens = {
            name: text for name, text in special_tokens.items() if text is not None
        }
        for name, text in self.special_tokens.items():
            if backend.token_to_id(text) is None:
                raise ValueError(
                    f"{name} {text!r} is not in the tokenizer's vocabulary"
                )
        self.chat_template = chat_template
        self.bos_token_id = self.token_id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self.token_id(self.special_tokens.get("eos_token"))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        # Does the post-processor put a BOS in front of every text? Llama 3's does,
        # SmolLM2's does not.
        self.adds_bos = self.bos_token_id is not None and backend.encode("").ids[
            :1
        ] == [self.bos_token_id]
        self._template = None

    @classmethod
    def from_folder(cls, path, missing_ok: bool = False) -> "Tokenizer | None":
        """Read tokenizer.json (+ tokenizer_config.json, config.json); None if absent
        and `missing_ok`.
        """
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            others = [
                n
                for n in (
                    "tokenizer.model",
                    "vocab.json",
                    "merges.txt",
                    "tokenizer_config.json",
                )
                if (folder / n).is_file()
            ]
            if others:
                raise FileNotFoundError(
                    f"{folder}: has {', '.join(others)} but no tokenizer.json; only "
                    "the Hugging Face "
                    "tokenizers format is supported (transformers can save one: "
                    "tokenizer.save_pretrained)"
                )
            if missing_ok:
                return None
            raise FileNotFoundError(
                f"{folder}: no tokenizer.json; without a tokenizer, give prompts as "
                "token ids"
            )
        try:
            backend = _BackendTokenizer.from_file(str(file))
        except Exception as e:
            raise ValueError(
                f"{file}: the tokenizers library cannot read it ({e})"
            ) from None
        config = _read_json(folder / "tokenizer_config.json")
        legacy = _read_json(folder / "special_tokens_map.json")
        special = {
            name: _token_text(config.get(name, legacy.get(name)))
            for name in SPECIAL_TOKEN_NAMES
        }
        model_config = {
            **_read_json(folder / "generation_config.json"),
            **_read_json(folder / "config.json"),
        }
        # not named by the tokenizer: take the model's id
        for name in ("bos_token", "eos_token"):
            token_id = model_config.get(f"{name}_id")
            token_id = (
                token_id[0] if isinstance(token_id, list) and token_id else token_id
            )
            if special[name] is None and isinstance(token_id, int):
                special[name] = backend.id_to_token(token_id)
        return cls(backend, special, _chat_template(folder, config))

    def token_id(self, text: str | None) -> int | None:
        """The id of a token given as text (a special token, say), None if `text` is
        None.
        """
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the post-processor's (a BOS,
        once, or nothing).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        # the batch call lets go of Python's GIL while it works (encode holds it: a
        # long text would stall every other thread of a server)
        batch = self.backend.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        ids = batch[0].ids
        if (
            add_special_tokens
            and self.adds_bos
            and ids[:2] == [self.bos_token_id] * 2
            and text.startswith(self.special_tokens["bos_token"])
        ):
            # the text brought its own BOS (a rendered chat template): do not double it
            ids = ids[1:]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of token ids; special tokens are left out unless
        `skip_special_tokens=False`.
        """
        ids = [int(i) for i in ids]
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str | list[int]:
        """Render a conversation with the chat template (as transformers does); the
        text, or its ids if `tokenize`.
        """
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template: give the prompt as text or "
                "token ids"
            )
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} "
                "dicts"
            )
        if not all(isinstance(m, dict) for m in messages):
            raise TypeError("each message must be a dict with 'role' and 'content'")
        if self._template is None:
            self._template = chat_template_environment().from_string(self.chat_template)
        # transformers drops None values
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_id}, "
            f"chat_template={self.chat_template is not None})"
        )


# %%
tokenizer = Tokenizer.from_folder(folder)
print(tokenizer)
print(tokenizer.special_tokens)
hello_ids = tokenizer.encode("Hello, world")
assert hello_ids == [19556, 28, 905] and tokenizer.decode(hello_ids) == "Hello, world"

messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
prompt_ids = tokenizer.encode(prompt)
print(prompt)
print(prompt_ids)
print(
    repr(tokenizer.decode(prompt_ids[:8], skip_special_tokens=False)),
    "->",
    repr(tokenizer.decode(prompt_ids[:8])),
)
assert prompt_ids[0] == tokenizer.token_id(
    "<|im_start|>"
) and tokenizer.eos_token_id == tokenizer.token_id("<|im_end|>")
assert not tokenizer.adds_bos  # SmolLM2's post-processor adds nothing

with tempfile.TemporaryDirectory() as empty:
    assert Tokenizer.from_folder(empty, missing_ok=True) is None
    try:
        Tokenizer.from_folder(empty)
    except FileNotFoundError as e:
        print("FileNotFoundError:", e)

# %% [markdown]
# The prompt is the system prompt SmolLM2's template adds when we give none, the
# question, and the header of the assistant's turn. Its special tokens came out as
# single ids (1 is `<|im_start|>`, 2 is `<|im_end|>`, which is also SmolLM2's
# end-of-sequence token).
#
# Is it *exactly* the prompt `transformers` gives? A single different space or newline
# changes the tokens, and the model's answers with them. When `transformers` is
# installed we compare, byte for byte (`tests/test_tokenizer.py` does the same for a
# Llama 3-style template with a date, tools and a BOS):

# %%
try:
    from transformers import AutoTokenizer
except ImportError:
    print("transformers is not installed: skipping the comparison")
else:
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    system = [{"role": "system", "content": "Answer in one word."}]
    for conversation in (
        messages,
        system + messages,
        messages + [{"role": "assistant", "content": "Paris."}] + messages,
    ):
        for add in (True, False):
            ours = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add
            )
            theirs = hf_tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add
            )
            assert ours == theirs, (ours, theirs)
            assert (
                tokenizer.encode(ours)
                == hf_tokenizer(theirs, add_special_tokens=False)["input_ids"]
            )
    print("chat templates rendered and encoded identically to transformers")

# %% [markdown]
# ## How a GPU runs a kernel
#
# Token ids go to the GPU; now the kernel. Chapter 01 launched one without explaining
# the machinery. Here it is, in the words numba uses (CUDA's own).
#
# - A **kernel** is a function that runs once per **thread**, tens of thousands of
#   threads at a time. Each thread knows its own coordinates and picks its share of the
#   data with them.
# - Threads come in **blocks** of up to 1024 (`cuda.blockDim.x` threads; this one is
#   number `cuda.threadIdx.x`). A block runs on one **streaming multiprocessor** (SM) —
#   an H200 has 132 — and its threads can share fast on-chip memory and wait for each
#   other (`cuda.syncthreads()`, chapter 04).
# - The blocks form the **grid** (`cuda.gridDim.x` blocks; this one is
#   `cuda.blockIdx.x`). The launch `kernel[num_blocks, threads_per_block, stream](args)`
#   fixes both sizes. Blocks run in any order, as many at once as fit on the SMs; they
#   cannot wait for one another.
# - An SM executes its threads 32 at a time, as a **warp**: one instruction, issued
#   once, for 32 threads (SIMT, *single instruction, multiple threads*). When the 32
#   threads of a warp load 32 neighbouring addresses, the hardware merges them into a
#   few 32-byte *sectors* of memory traffic (**coalescing**); when they load scattered
#   addresses, every one costs a sector of its own.
#
# An SM keeps many warps resident (up to 64 on an H200) and switches between them every
# cycle: while one warp waits the several hundred nanoseconds a load from memory takes,
# others issue theirs. That is how a GPU hides memory latency — by having many loads in
# flight — and it is why the bytes a kernel has in flight per thread matter as much as
# the number of threads.
#
# The embedding lookup maps naturally onto this: **one block per token, its threads
# across the token's row**. A block of $B$ threads walks a row of $H$ values in steps of
# $B$ (thread $j$ takes columns $j, j+B, j+2B, \dots$: a *block-stride loop*), so any
# hidden size works with any block size, and in each step a warp reads 32 neighbouring
# values — coalesced. The picture shows it with 8 threads per block to fit (a real block
# has 128 to 1024):


# %%
def draw_lookup(ax, ids, vocab=24, hidden=12):
    """The lookup: token ids pick rows of the table, which become the rows of the
    output.
    """
    colors = plt.cm.Set2(np.arange(len(ids)))
    ax.add_patch(plt.Rectangle((0, 0), hidden, vocab, fc="#eeeeee", ec="k"))
    out_x, out_top = hidden + 10, vocab / 2 + len(ids) / 2
    for t, (token, color) in enumerate(zip(ids, colors)):
        y_row, y_out = vocab - token - 1, out_top - t - 1
        ax.add_patch(plt.Rectangle((0, y_row), hidden, 1, fc=color, ec="k", lw=0.5))
        ax.add_patch(plt.Rectangle((out_x, y_out), hidden, 1, fc=color, ec="k", lw=0.5))
        ax.annotate(
            "",
            xy=(out_x - 0.2, y_out + 0.5),
            xytext=(hidden + 0.2, y_row + 0.5),
            arrowprops=dict(arrowstyle="->", color="k", lw=0.8),
        )
        ax.text(-0.5, y_row + 0.5, f"id {token}", ha="right", va="center", fontsize=8)
        ax.text(
            out_x + hidden + 0.5,
            y_out + 0.5,
            f"token {t}",
            ha="left",
            va="center",
            fontsize=8,
        )
    ax.text(
        hidden / 2,
        vocab + 0.6,
        "table E (vocab × hidden), bf16",
        ha="center",
        fontsize=9,
    )
    ax.text(
        out_x + hidden / 2,
        out_top + 0.6,
        "x = E[ids] (tokens × hidden), float32",
        ha="center",
        fontsize=9,
    )
    ax.set_xlim(-6, out_x + hidden + 6)
    ax.set_ylim(-0.5, vocab + 2)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_threads(ax, num_tokens, hidden, threads, per_load, title):
    """Which thread of which block writes each output element; a wide load gives a
    thread `per_load` neighbours.
    """
    colors = plt.cm.Set3(np.arange(threads))
    for t in range(num_tokens):
        y = num_tokens - t - 1
        for word in range(hidden // per_load):
            # the block-stride loop: word j goes to thread j % blockDim
            thread = word % threads
            ax.add_patch(
                plt.Rectangle(
                    (word * per_load, y),
                    per_load,
                    1,
                    fc=colors[thread],
                    ec="white",
                    lw=1,
                )
            )
            ax.text(
                (word + 0.5) * per_load,
                y + 0.5,
                str(thread),
                ha="center",
                va="center",
                fontsize=7,
            )
        ax.text(
            -0.5, y + 0.5, f"block {t} = token {t}", ha="right", va="center", fontsize=8
        )
    ax.vlines(
        np.arange(0, hidden + 1, threads * per_load),
        -0.15,
        num_tokens + 0.15,
        color="k",
        lw=1.5,
    )
    ax.set_title(title, fontsize=9)
    ax.set_xlim(-9, hidden + 0.5)
    ax.set_ylim(-0.3, num_tokens + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")


fig, axes = new_figure(
    3, 1, width=8, height=7.5, gridspec_kw={"height_ratios": [2.2, 1, 1]}
)
draw_lookup(axes[0], ids=[17, 3, 9, 20])
draw_threads(
    axes[1],
    4,
    24,
    threads=8,
    per_load=1,
    title="rung 1: 8 threads per block; thread j writes columns j, j+8, j+16 (black "
    "bars: one step of the block)",
)
draw_threads(
    axes[2],
    4,
    24,
    threads=4,
    per_load=4,
    title="rung 2: 4 threads per block; each load brings a thread 4 neighbouring "
    "values",
)
plt.show()

# %% [markdown]
# ## The embedding lookup
#
# The embedding table $E$ has one row of $H$ numbers (the hidden size) per vocabulary
# entry. For token ids $\text{id}_0, \dots, \text{id}_{T-1}$ the model's first
# activations, the **residual stream**, are
#
# $$ x_{t,:} = E_{\text{id}_t,\,:}, \qquad t = 0, \dots, T-1, $$
#
# widened from the table's bf16 to float32, the dtype the residual stream keeps through
# all the layers, so that the small update each layer adds to it is not rounded away.
# There is no arithmetic at all: the lookup is pure data movement, and widening is
# exact, so a kernel must agree with NumPy **bit for bit**.
#
# A token id outside $[0, V)$ must never reach a kernel: NumPy raises `IndexError` for
# it, but a kernel would read whatever memory lies before or after the table — garbage
# at best, a crash of the whole process at worst, reported later by an unrelated call.
# The first exported function validates ids on the host; the reference uses it.

# %%
#| export
import math

import numpy as np
from numba import cuda, uint64

from tinyvllm_lib.kernels.bf16 import bf16_bits_to_f32, bf16_to_f32


def check_token_ids(ids, vocab_size: int) -> np.ndarray:
    """Token ids as a validated 1-D integer array; ValueError naming the first id
    outside [0, vocab_size).
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):
        raise TypeError(
            f"token ids must be a 1-D sequence of integers, got dtype {ids.dtype} "
            f"and shape {ids.shape}"
        )
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ValueError(
            f"token id {ids[bad[0]]} at position {bad[0]} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return ids.astype(np.int64, copy=False)


def embed_reference(ids, table: np.ndarray) -> np.ndarray:
    """NumPy: x[t] = E[ids[t]] widened from bf16 bits (uint16) to float32. (num_tokens,
    hidden)
    """
    ids = check_token_ids(ids, table.shape[0])
    return bf16_bits_to_f32(table[ids])


# %% [markdown]
# On SmolLM2's real table (49,152 × 576, tied to the output layer, so the same rows also
# score the next token in chapter 07):

# %%
weights = SafetensorsFile(folder / "model.safetensors")
# (vocab, hidden) bf16 bits, memory-mapped
table_host = weights.get("model.embed_tokens.weight")
print(table_host.dtype, table_host.shape)
hello = embed_reference(hello_ids, table_host)  # "Hello, world"
print(hello.shape, hello.dtype, hello[:, :4])
assert np.array_equal(
    hello, table_host[hello_ids].view(ml_dtypes.bfloat16).astype(np.float32)
)
try:
    embed_reference([19556, 49152], table_host)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ### Rung 1: one block per token
#
# Block `t` handles token `t`; its threads walk the row. Three details make it safe:
#
# - the grid is exactly one block per token, but the kernel still checks
#   `t < num_tokens`, so that it stays correct under any launch;
# - the row loop runs to `hidden` whatever the block size;
# - a token id outside the table does not read the table at all: the row is filled with
#   NaN. That is the kernel's last line of defence, not its error handling (below).
#
# The device helper `bf16_to_f32` of chapter 01 widens each value.


# %%
#| export
from tinyvllm_lib.kernels.dependent_launch import wait_for_previous_kernel


@cuda.jit
def embed_rows_kernel(ids, table, out):
    wait_for_previous_kernel()
    t = cuda.blockIdx.x  # one block per token
    if t >= ids.shape[0]:
        return
    token = ids[t]
    is_valid = token >= 0 and token < table.shape[0]
    j = cuda.threadIdx.x
    # the block's threads walk the row, blockDim.x values per step
    while j < table.shape[1]:
        if is_valid:
            out[t, j] = bf16_to_f32(table[token, j])
        else:
            out[t, j] = math.nan  # never read outside the table
        j += cuda.blockDim.x


PTX_SIGNATURES = {
    "embed_rows_kernel": [
        "void(int32[::1], uint16[:, ::1], float32[:, ::1])",
        "void(int64[::1], uint16[:, ::1], float32[:, ::1])",
    ],
}

# %% [markdown]
# ### Rung 2: wide loads
#
# Rung 1 makes each thread load 2 bytes and store 4 at a time. Memory moves in 32-byte
# sectors, and the SM can track only so many outstanding requests; with tiny requests it
# runs out of them before the memory runs out of bandwidth. Chapter 01 found the same
# for its widening kernel. The cure is fewer, wider requests: view the table's row as
# `uint64` words, so one load brings **four** bf16 values, and write the four float32
# results as two `uint64` words.
#
# No float is needed for that: widening is a shift (chapter 01), so the float32 bits of
# the two values in the low half of a word
# $w = b_0 + 2^{16} b_1 + 2^{32} b_2 + 2^{48} b_3$ (little-endian: $b_0$ at the lowest
# address) are $b_0 \ll 16$ and $b_1 \ll 16$, and as one 64-bit word (the first float in
# the low half)
#
# $$ \text{lo} = \big((w \,\&\, \texttt{0xFFFF}) \ll 16\big)
#    \;|\; \big((w \,\&\, \texttt{0xFFFF0000}) \ll 32\big), \qquad
#    \text{hi} = \big((w \gg 16) \,\&\, \texttt{0xFFFF0000}\big)
#    \;|\; \big(w \,\&\, \texttt{0xFFFF000000000000}\big). $$
#
# Four masks and three shifts per four values, all on integers, exact by construction.
# The launcher hands the kernel `uint64` views of the table and of the float32 output;
# they exist when a row is a whole number of words ($H$ a multiple of 4: 576 and 2048
# are) and the buffers start on an 8-byte boundary, and otherwise the launcher falls
# back to rung 1.

# %%
#| export
NAN_PAIR = 0x7FC000007FC00000  # two float32 quiet NaNs, as one 64-bit word


@cuda.jit
def embed_wide_kernel(ids, table64, out64):
    wait_for_previous_kernel()
    t = cuda.blockIdx.x  # one block per token
    if t >= ids.shape[0]:
        return
    token = ids[t]
    is_valid = token >= 0 and token < table64.shape[0]
    j = cuda.threadIdx.x
    # word j of the row: 4 bf16 values -> out words 2j, 2j+1 (4 float32s)
    while j < table64.shape[1]:
        if is_valid:
            w = table64[token, j]
            out64[t, 2 * j] = ((w & uint64(0xFFFF)) << uint64(16)) | (
                (w & uint64(0xFFFF0000)) << uint64(32)
            )
            out64[t, 2 * j + 1] = ((w >> uint64(16)) & uint64(0xFFFF0000)) | (
                w & uint64(0xFFFF000000000000)
            )
        else:
            out64[t, 2 * j] = uint64(NAN_PAIR)
            out64[t, 2 * j + 1] = uint64(NAN_PAIR)
        j += cuda.blockDim.x


PTX_SIGNATURES["embed_wide_kernel"] = [
    "void(int32[::1], uint64[:, ::1], uint64[:, ::1])",
    "void(int64[::1], uint64[:, ::1], uint64[:, ::1])",
]

# %% [markdown]
# ### The launcher, and where token ids get checked
#
# The launcher checks what it can check for free — dtypes, shapes, contiguity — and
# raises before any launch. Token ids are harder. Given **host** ids (a NumPy array) it
# checks them: they are right there. Given **device** ids it does not, because looking
# at them would mean copying them back to the host and waiting for the GPU — a
# synchronisation in the middle of a forward pass, which also makes the pass impossible
# to capture in a CUDA graph (chapter 11). So the engine validates ids where they enter,
# on the host — from the tokenizer, or from a user who passes token ids — with
# `check_token_ids`, and sends only validated ids to the device. The kernels' NaN rows
# are the safety net behind that: a bad id that slips through can never read outside the
# table, and its NaNs spread through every later layer into the logits, where they
# cannot be missed.


# %%
#| export kernels.checks
def is_c_contiguous(a) -> bool:
    """Whether a NumPy array or a device array (numba's, or the simulator's stand-in) is
    C-contiguous.
    """
    return (
        a.is_c_contiguous()
        if hasattr(a, "is_c_contiguous")
        else bool(a.flags["C_CONTIGUOUS"])
    )


def is_device_array(a) -> bool:
    """A GPU array (numba, CuPy, torch...) or, in the simulator, numba's stand-in for
    one.
    """
    return hasattr(a, "__cuda_array_interface__") or hasattr(a, "copy_to_host")


def device_pointer(a) -> int:
    """Address of an array's first element (in the simulator: of the host buffer behind
    it).
    """
    if hasattr(a, "__cuda_array_interface__"):
        return a.__cuda_array_interface__["data"][0]
    return a.__array_interface__["data"][0]


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: blocks to cover a items, b per block."""
    return (a + b - 1) // b


# %% [markdown]
# Every later launcher needs these small checks — contiguity, whether an array lives on
# the GPU, its address (wide loads need 8-byte alignment), and the ceiling division that
# sizes a grid — so they sit in a module of their own, `kernels.checks`; the launchers
# import them from there.

# %%
#| export
from tinyvllm_lib.kernels.checks import device_pointer, is_c_contiguous


def _check_embed_args(ids, table, out) -> None:
    for name, arr in (("ids", ids), ("table", table), ("out", out)):
        if not hasattr(arr, "dtype") or not hasattr(arr, "shape"):
            raise TypeError(
                f"embed: {name} must be a NumPy or device array, got "
                f"{type(arr).__name__}"
            )
    if ids.dtype not in (np.int32, np.int64):
        raise TypeError(f"embed: ids must be int32 or int64, got {ids.dtype}")
    if table.dtype != np.uint16:
        raise TypeError(
            f"embed: table must hold bf16 bits as uint16, got {table.dtype}"
        )
    if out.dtype != np.float32:
        raise TypeError(
            f"embed: out must be float32 (the residual stream), got {out.dtype}"
        )
    if (
        ids.ndim != 1
        or table.ndim != 2
        or tuple(out.shape) != (ids.shape[0], table.shape[1])
    ):
        raise ValueError(
            "embed: need ids (num_tokens,), table (vocab, hidden), out (num_tokens, "
            "hidden); "
            f"got ids {tuple(ids.shape)}, table {tuple(table.shape)}, out "
            f"{tuple(out.shape)}"
        )
    for name, arr in (("ids", ids), ("table", table), ("out", out)):
        if not is_c_contiguous(arr):
            raise ValueError(f"embed: {name} must be C-contiguous")
    # host ids: cheap to check here; device ids were checked where they entered
    if isinstance(ids, np.ndarray):
        check_token_ids(ids, table.shape[0])


def _threads(num_items: int, threads_per_block: int) -> int:
    """Enough whole warps to cover a row once, at most threads_per_block."""
    return max(32, min(threads_per_block, -(-num_items // 32) * 32))


def embed_rows(ids, table, out, threads_per_block: int = 256, stream=0):
    """Rung 1: out[t] = float32(table[ids[t]]), one block per token, one bf16 value per
    thread per step.
    """
    _check_embed_args(ids, table, out)
    if ids.shape[0]:
        embed_rows_kernel[
            ids.shape[0], _threads(table.shape[1], threads_per_block), stream
        ](ids, table, out)
    return out


def can_embed_wide(table, out) -> bool:
    """Rows are whole uint64 words (hidden % 4 == 0) and both buffers start 8-byte
    aligned.
    """
    return (
        table.shape[1] % 4 == 0
        and device_pointer(table) % 8 == 0
        and device_pointer(out) % 8 == 0
    )


def embed(ids, table, out, threads_per_block: int = 256, stream=0):
    """out[t] = float32(table[ids[t]]): bf16 table rows (uint16) into the float32
    residual stream.

    ids: int32/int64 (num_tokens,), checked here when on the host; table: uint16 (vocab,
    hidden); out: float32 (num_tokens, hidden). Wide loads (4 values per load) when the
    rows allow it. A device id outside the table gives a NaN row, never an out-of-bounds
    read.
    """
    _check_embed_args(ids, table, out)
    if not ids.shape[0]:
        return out
    if not can_embed_wide(table, out):
        embed_rows_kernel[
            ids.shape[0], _threads(table.shape[1], threads_per_block), stream
        ](ids, table, out)
        return out
    # (vocab, hidden/4), (num_tokens, hidden/2)
    table64, out64 = table.view(np.uint64), out.view(np.uint64)
    embed_wide_kernel[
        ids.shape[0], _threads(table64.shape[1], threads_per_block), stream
    ](ids, table64, out64)
    return out


# %% [markdown]
# ### Test it against the reference
#
# Fresh random tables and ids, hidden sizes that are not multiples of the block size
# (100, 576, and 99, which is not a whole number of words and takes the fallback), both
# id dtypes, and a poisoned output so that an element the kernel forgot to write cannot
# pass by luck. We compare bits, not values: NaN patterns in the table must survive too.
# The simulator runs each GPU thread as a Python thread, so the shapes are tiny there.

# %%
rng = np.random.default_rng()


def check_embed(
    launcher,
    table: np.ndarray,
    d_table,
    num_tokens: int,
    id_dtype=np.int32,
    threads_per_block: int = 64,
) -> None:
    ids = rng.integers(0, table.shape[0], size=num_tokens).astype(id_dtype)
    # poison
    d_out = cuda.to_device(np.full((num_tokens, table.shape[1]), np.float32(-1234.5)))
    launcher(cuda.to_device(ids), d_table, d_out, threads_per_block=threads_per_block)
    got, want = (
        d_out.copy_to_host().view(np.uint32),
        embed_reference(ids, table).view(np.uint32),
    )
    assert np.array_equal(got, want), (
        f"{launcher.__name__}: {(got != want).sum()} of {got.size} elements differ"
    )


if can_launch():
    shapes = (
        [(50, 100, 3), (50, 576, 2), (40, 99, 3)]
        if is_simulator()
        else [(128256, 2048, 2048), (49152, 576, 333), (1000, 99, 17)]
    )
    for vocab, hidden, num_tokens in shapes:
        table = rng.integers(0, 2**16, size=(vocab, hidden), dtype=np.uint16)
        d_table = cuda.to_device(table)
        for launcher in (embed_rows, embed):
            for id_dtype in (np.int32, np.int64):
                check_embed(
                    launcher,
                    table,
                    d_table,
                    num_tokens,
                    id_dtype,
                    threads_per_block=64 if is_simulator() else 256,
                )
    print(
        "embed_rows and embed agree bit for bit with the reference on (vocab, "
        f"hidden, tokens) = {shapes}"
    )
else:
    print("no GPU and no simulator: set NUMBA_ENABLE_CUDASIM=1 to run the kernels")

# %% [markdown]
# Now the real thing: "Hello, world" through SmolLM2's table on the device.

# %%
if can_launch():
    d_table = cuda.to_device(np.ascontiguousarray(table_host))
    d_out = cuda.device_array((len(hello_ids), table_host.shape[1]), np.float32)
    embed(cuda.to_device(np.array(hello_ids, np.int32)), d_table, d_out)
    assert np.array_equal(d_out.copy_to_host(), hello)
    print("the device lookup of", hello_ids, "matches the reference")

# %% [markdown]
# And the defences: host ids outside the table are refused before anything runs, bad
# dtypes and shapes too, and a bad id that reaches the device as device memory comes out
# as a NaN row, the others untouched.

# %%
small = rng.integers(0, 2**16, size=(10, 8), dtype=np.uint16)
for bad_ids, bad_table, bad_out in [
    # id 10 of a 10-row table
    (np.array([3, 10], np.int32), small, np.zeros((2, 8), np.float32)),
    # table not bf16 bits
    (
        np.array([3, 4], np.int32),
        small.astype(np.float32),
        np.zeros((2, 8), np.float32),
    ),
    (np.array([3, 4], np.int32), small, np.zeros((2, 9), np.float32)),  # out's shape
    ([3, 4], small, np.zeros((2, 8), np.float32)),  # a list, not an array
]:
    try:
        embed(bad_ids, bad_table, bad_out)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad input was accepted")

if can_launch():
    # unchecked: they are on the device
    device_ids = cuda.to_device(np.array([3, -1, 9, 10], np.int32))
    for launcher in (embed_rows, embed):
        got = launcher(
            device_ids, cuda.to_device(small), cuda.device_array((4, 8), np.float32)
        ).copy_to_host()
        assert np.isnan(got[[1, 3]]).all() and np.array_equal(
            got[[0, 2]].view(np.uint32), embed_reference([3, 9], small).view(np.uint32)
        )
    print("ids -1 and 10 gave NaN rows; ids 3 and 9 their rows")

# %% [markdown]
# ## How fast is it?
#
# **Count first.** The lookup reads each token's row (2 bytes per value) and its id (4
# bytes), and writes the row in float32 (4 bytes per value): per token $6H + 4$ bytes,
# nothing to compute. At Llama 3.2 1B's hidden size $H = 2048$:

# %% tags=["hide-input"]
from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import llama_weight_shapes

HIDDEN = 2048
ceiling_gbs, ceiling_name = bandwidth_ceiling()  # chapter 1's best rate
llama_1b = ModelConfig(
    vocab_size=128256,
    hidden_size=HIDDEN,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=True,
)
# bf16
weight_bytes = 2 * sum(
    int(np.prod(shape)) for shape in llama_weight_shapes(llama_1b).values()
)
prose.glue("ch03_weights_gb", f"{weight_bytes / 1e9:.1f} GB")
prose.glue(
    "ch03_weights_ms",
    f"{weight_bytes / (ceiling_gbs * 1e9) * 1e3:.2f} ms"
    if ceiling_name
    else "(not yet measured)",
)
prose.glue("ch03_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))
for num_tokens in (1, 256, 2048):
    nbytes = num_tokens * (6 * HIDDEN + 4)
    at_ceiling = (
        f"{nbytes / (ceiling_gbs * 1e9) * 1e6:7.3f} µs at chapter 01's {ceiling_name}"
        if ceiling_name
        else "(no bandwidth ceiling recorded yet)"
    )
    print(f"{num_tokens:5} tokens: {nbytes / 1e6:8.3f} MB -> {at_ceiling}")

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
A 2048-token prompt (*prefill*) moves 25 MB: a few microseconds at full bandwidth, if
the kernel can reach it. A decode step moves 12 KB per sequence, which the memory system
delivers in nanoseconds — there the time is all *latency*: the launch itself, one round
trip to memory for the ids and another for the rows. No kernel written for bandwidth can
change that, so the measurement also times an **empty kernel** in the same CUDA graph,
the floor every launch pays. (For scale: the rest of a decode step reads all
{{ch03_weights_gb}} of Llama 3.2 1B's weights — chapter 02 — which takes
{{ch03_weights_ms}} at {{ch03_ceiling}}; the lookup is a rounding error of a
step.)
""")

# %% [markdown]
# The script `bench/ch03_embedding.py` times both rungs on a random table of Llama 3.2
# 1B's shape (128,256 × 2048) with random ids — as in a real prompt, the rows come from
# all over the 525 MB table — rotating through enough id and output buffers that L2
# holds none of them, and records the results in `book/data/ch03_embedding.json`. On a
# GPU the cell runs it:

# %% tags=["hide-input"]
if has_gpu():
    import runpy

    bench = (
        Path("../bench/ch03_embedding.py")
        if Path("../bench").exists()
        else Path("bench/ch03_embedding.py")
    )
    runpy.run_path(str(bench), run_name="__main__")

records = load_records("ch03_embedding")
print(f"{len(records)} recorded measurements")
device_name = records[0]["device"]["name"] if records else None
ceiling_gbs, ceiling_name = bandwidth_ceiling(device_name)
print(records_table(records, time_key="us", ceiling=ceiling_gbs))

# %% tags=["hide-input"]
# one GPU's numbers in one plot
records = [r for r in records if r["device"]["name"] == device_name]
rungs = {
    name: sorted((r for r in records if r["name"] == name), key=lambda r: r["shape"][0])
    for name in ("embed_rows", "embed_wide")
}
floor = next((r["value"] for r in records if r["name"] == "empty_kernel"), None)


def at(name: str, num_tokens: int):
    return next((r for r in rungs[name] if r["shape"][0] == num_tokens), None)


prefill_rows, prefill_wide, decode_wide = (
    at("embed_rows", 2048),
    at("embed_wide", 2048),
    at("embed_wide", 1),
)
not_yet = "(not yet measured)"


def share(r: dict | None) -> str:
    """A record's rate as a share of the ceiling, computed now, not the stored ratio."""
    return f"{r['value'] / ceiling_gbs:.0%}" if r and ceiling_name else not_yet


prose.glue("ch03_device", device_name or "no GPU yet")
prose.glue("ch03_ceiling", ceiling_phrase(ceiling_gbs, ceiling_name))
prose.glue("ch03_prefill_rows", share(prefill_rows))
prose.glue("ch03_prefill_wide", share(prefill_wide))
prose.glue(
    "ch03_prefill_wide_us", f"{prefill_wide['us']:.1f} µs" if prefill_wide else not_yet
)
prose.glue(
    "ch03_speedup",
    f"{prefill_rows['us'] / prefill_wide['us']:.1f}×"
    if prefill_rows and prefill_wide
    else not_yet,
)
prose.glue("ch03_decode_us", f"{decode_wide['us']:.1f} µs" if decode_wide else not_yet)
prose.glue("ch03_floor_us", f"{floor:.1f} µs" if floor is not None else not_yet)

if records:
    fig, (ax_us, ax_bw) = new_figure(1, 2, width=10, height=3.4)
    for name, rows in rungs.items():
        tokens = [r["shape"][0] for r in rows]
        ax_us.plot(tokens, [r["us"] for r in rows], "o-", label=name)
        shares = [r["value"] / ceiling_gbs for r in rows]
        ax_bw.plot(tokens, shares, "o-", label=name)
    if floor is not None:
        ax_us.axhline(floor, color="k", ls="--", lw=1, label="empty kernel")
    for ax in (ax_us, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (hidden 2048)")
        ax.legend()
    ax_us.set_yscale("log")
    ax_us.set_ylabel("µs per launch")
    ax_bw.set_ylabel(f"fraction of the {ceiling_gbs:,.0f} GB/s ceiling")
    ax_bw.set_ylim(0, 1)
    fig.suptitle(f"embedding lookup, measured on {device_name}")
    plt.show()

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
On the {{ch03_device}}, a 2048-token prefill runs at {{ch03_prefill_rows}} of
{{ch03_ceiling}} with rung 1 and {{ch03_prefill_wide}} with wide loads
({{ch03_prefill_wide_us}}, {{ch03_speedup}} faster). The wide kernel issues a quarter of
the loads and half the stores for the same bytes, so each warp keeps four times as many
bytes in flight per request and the SM's limited slots for outstanding requests stop
being the bottleneck — the memory system, not the instruction stream, sets the pace.
Even prefill's 25 MB is a short job for an H200, so the launch floor (the empty kernel)
is a visible part of its time, and the fraction of the ceiling grows with the number of
tokens.

At decode sizes the picture turns over: one token takes {{ch03_decode_us}}, against
{{ch03_floor_us}} for a kernel that does nothing, and the time barely grows up to
hundreds of tokens. Fractions of bandwidth there are tiny and meaningless: the kernel
waits on latency, not bytes. The lesson carries through the book: at decode, *which*
kernels run and *how many* launches a step takes matter more than any one kernel's
bandwidth, and chapter 11 removes the launch cost from the CPU side with CUDA graphs.
""")

# %% [markdown]
# ## Summary

# %% tags=["remove-input"] jupyter={"source_hidden": true}
prose.show(r"""
- A model folder's `tokenizer.json` turns text into ids (the `tokenizers` library);
  `tokenizer_config.json` names the special tokens and holds the chat template, which
  must be rendered exactly as `transformers` does: sandboxed Jinja with `trim_blocks`,
  `lstrip_blocks` and its helpers (`raise_exception`, `tojson`, `strftime_now`). A
  rendered prompt is encoded without a second BOS.
- A kernel runs as a grid of blocks of threads; an SM runs threads in warps of 32 and
  hides memory latency with many warps and many bytes in flight.
- The embedding lookup is pure data movement, $6H + 4$ bytes per token; its kernels
  agree with NumPy bit for bit. Wide loads (a `uint64` of four bf16 values per load, the
  widening done with integer shifts) issue a quarter of the loads and half the stores,
  and make prefill {{ch03_speedup}} faster; decode is latency-bound.
- Token ids are checked on the host where they enter; a device kernel never reads out of
  bounds, writing NaN rows for ids it cannot look up.
""")

# %% [markdown]
# Exported to `tinyvllm_lib`: `tokenizer` (`Tokenizer`, `chat_template_environment`) and
# `kernels.embedding` (`check_token_ids`, `embed_reference`, `embed_rows`, `embed`, and
# the kernels `embed_rows_kernel`, `embed_wide_kernel`).
#
# ## Exercises
#
# 1. How many tokens do "Hello, world", "hello, world" and "Hello,world" take with
#    SmolLM2's tokenizer? And the number 1234567? Predict first — remember SmolLM2's
#    digit split.
# 2. Encode a Llama 3-style prompt with `backend.encode(prompt)` (the post-processor on)
#    and compare with `Tokenizer.encode`. What does the model see differently, and why
#    would the answers change only slightly — which makes the bug hard to spot?
# 3. Write the middle rung: wide *loads* (one `uint64` per thread) but four separate
#    float32 stores through `bf16_to_f32`. Predict where it lands between the two rungs,
#    add it to `bench/ch03_embedding.py`, and measure.
# 4. At one decode token, a single block on one of the 132 SMs does all the work. Split
#    each row over several blocks (a 2-D grid: `blockIdx.y` picks a chunk of the row).
#    Does decode get faster? Compare with the empty kernel's time before you measure.
# 5. SmolLM2's embedding table is tied to its output layer. How many bytes does the
#    lookup read per decode token, and how many does the output layer read? What
#    fraction of a decode step's bytes is the lookup, for SmolLM2 and for Llama 3.2 1B?
