"""Chapter 03: the tokenizer and the chat template, against Hugging Face transformers.

The SmolLM2 folder is the one chapter 2b prepares (in $TINYVLLM_CACHE or ~/.cache/tinyvllm).
"""

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from tinyvllm_lib.models.smollm2 import resolve_model
from tinyvllm_lib.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = [{"role": "system", "content": "Answer in one word. Grüße, 東京 🙂"}]
CONVERSATIONS = {
    "user": QUESTION,
    "system+user": SYSTEM + QUESTION,
    "multi-turn": SYSTEM + QUESTION + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And  of Japan?\n"}],
}

# Modelled on Llama 3.2 Instruct's template: it writes the BOS itself, today's date via
# strftime_now, tools as indented JSON, and rejects what it cannot format with raise_exception.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_temperature",
        "description": "Température actuelle à un endroit, en °C",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def tokenizer(folder) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def llama3_folder(folder, tmp_path_factory) -> Path:
    """SmolLM2's BPE with Llama 3's special tokens, a post-processor that adds BOS, and the template above."""
    out = tmp_path_factory.mktemp("llama3-style")
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
              "clean_up_tokenization_spaces": False, "chat_template": LLAMA3_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_encode_decode_smollm2(tokenizer):
    assert tokenizer.encode("Hello, world") == [19556, 28, 905]
    assert tokenizer.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]  # one token per digit
    text = "Grüße, 東京! 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == len(tokenizer) == 49152


def test_special_tokens_smollm2(tokenizer):
    assert tokenizer.eos_token_id == 2 == tokenizer.token_id("<|im_end|>")
    assert tokenizer.bos_token_id == 1 and not tokenizer.adds_bos  # named, but never added
    assert tokenizer.encode("<|im_start|>user") == [1, 4093]  # special tokens in text are single ids
    assert set(range(17)) <= tokenizer.special_token_ids
    ids = tokenizer.encode("<|im_start|>Hi<|im_end|>")
    assert tokenizer.decode(ids) == "Hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>Hi<|im_end|>"


def test_bad_input(tokenizer):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([5, 49152])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([-1])
    with pytest.raises(TypeError, match="str"):
        tokenizer.encode([1, 2])
    with pytest.raises(ValueError, match="non-empty"):
        tokenizer.apply_chat_template([])
    with pytest.raises(TypeError, match="dict"):
        tokenizer.apply_chat_template(["hello"])


def test_folder_without_tokenizer(tmp_path, folder):
    assert Tokenizer.from_folder(tmp_path, missing_ok=True) is None
    with pytest.raises(FileNotFoundError, match="token ids"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path, missing_ok=True)  # another format is an error, not "no tokenizer"


def test_special_tokens_from_config_and_no_template(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.chat_template) == (1, 2, None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(QUESTION)


def test_chat_template_file_and_named_templates(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>", "special": True}, "chat_template": named}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.eos_token_id == 2 and tok.apply_chat_template(QUESTION) == QUESTION[0]["content"] + "!"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")  # transformers 5 saves it here; it wins
    assert Tokenizer.from_folder(tmp_path).apply_chat_template(QUESTION) == "[1]"


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(folder, tokenizer, name, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS[name]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == tokenizer.encode(ours) == hf(theirs, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.token_id("<|im_start|>")  # no BOS for SmolLM2: the template starts the prompt


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_llama3_template_matches_transformers(llama3_folder, name, tools):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(llama3_folder)
    tok = Tokenizer.from_folder(llama3_folder)
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
    assert ours == theirs
    assert "Today Date: " in ours and (tools is None or "°C" in ours)  # strftime_now, tojson without ASCII escapes
    bos = tok.bos_token_id
    assert tok.adds_bos and tok.encode("Hi")[0] == bos  # plain text gets its BOS ...
    ids = tok.encode(ours)
    assert ids[0] == bos and ids[1] != bos  # ... a rendered prompt, which brings its own, does not get a second
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools, tokenize=True)
    assert ids == hf(theirs, add_special_tokens=False)["input_ids"]
    assert hf(theirs)["input_ids"][:2] == [bos, bos]  # what the naive encode would have done


def test_llama3_template_kwargs_and_raise_exception(llama3_folder):
    tok = Tokenizer.from_folder(llama3_folder)
    text = tok.apply_chat_template(QUESTION, date_string="01 Jan 2000")
    assert "Today Date: 01 Jan 2000\n" in text
    calls = [{"function": {"name": "f", "arguments": {}}}] * 2
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        tok.apply_chat_template(QUESTION + [{"role": "assistant", "tool_calls": calls, "content": None}])


def test_template_environment_is_sandboxed(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())

    def render(template, **kwargs):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        return Tokenizer.from_folder(tmp_path).apply_chat_template(QUESTION, **kwargs)

    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set _ = messages.append({}) %}")  # inputs are immutable
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_hidden=1) %}")
    assert render("{% for m in messages %}{% if loop.first %}{% break %}{% endif %}x{% endfor %}ok") == "ok"  # loopcontrols
    assert render("{% generation %}{{ messages[0].role }}{% endgeneration %}") == "user"
    assert render("{{ {'a': '<é>'} | tojson }}") == '{"a": "<é>"}'
    assert render("{{ dict.fromkeys(['a'], 1) | tojson }}|{{ dict(b=2) | tojson }}") == '{"a": 1}|{"b": 2}'
    assert render("{% if x %}\n  a\n{% endif %}\nb", x=True) == "  a\nb"  # trim_blocks, lstrip_blocks
