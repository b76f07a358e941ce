"""Chat prompts: render a GGUF's `tokenizer.chat_template` the way HF transformers does.

transformers compiles templates in a jinja2 ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, a `{% generation %}` block tag, a `tojson` filter that
keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`; the render gets
`messages`, `add_generation_prompt`, `tools`, `documents` and the special token strings. Same here.

A GGUF without a template (the Gemma 3 270M one) gets Gemma's documented turn format:
    <bos><start_of_turn>user\n{system}\n\n{content}<end_of_turn>\n<start_of_turn>model\n
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CupyllmError, ModelFileError

# Gemma's turn format (system text joins the first user turn, assistant is "model", content trimmed).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system_text = messages[0]['content'] if messages[0]['content'] is string
                          else messages[0]['content'][0]['text'] -%}
    {%- set prefix = system_text + '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Gemma turns must alternate user/assistant/user/..., starting with user') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif part['type'] == 'text' -%}
                {{ part['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFileError(f"the chat template does not parse (line {e.lineno}: {e.message}); "
                             "pass a corrected template string instead") from None


def template_from_metadata(metadata: Mapping[str, Any]) -> str:
    """The GGUF's chat template, or the built-in Gemma 3 one for a Gemma 1-3 GGUF that has none."""
    template = metadata.get("tokenizer.chat_template")
    if template:
        return str(template)
    arch = str(metadata.get("general.architecture", ""))
    if arch in ("gemma", "gemma2", "gemma3"):  # Gemma 4 marks turns differently: its GGUFs carry the template
        return GEMMA3_TEMPLATE
    raise ModelFileError(f"the GGUF (architecture {arch or 'unknown'}) has no tokenizer.chat_template; "
                         "pass a template string to render_chat")


# How a GGUF names an instruction-tuned model where it carries no chat template (general.finetune, general.name:
# "Instruct", "it", "chat"); llama.cpp's converter writes those from the model card.
_TUNED_WORDS = re.compile(r"\b(instruct|it|chat)\b", re.IGNORECASE)


def base_model_note(metadata: Mapping[str, Any], model_name: str) -> str | None:
    """A one-line warning for chat with a model that is probably not instruction-tuned, or None. The sign: the
    GGUF carries no chat template of its own (every instruction-tuned GGUF llama.cpp converts does) and its
    names say nothing of instruction tuning. Such a model (the default Gemma 3 270M) continues the rendered
    turns as text instead of answering them."""
    if metadata.get("tokenizer.chat_template"):
        return None
    names = " ".join(str(metadata.get(key, "")) for key in ("general.finetune", "general.name", "general.basename"))
    if _TUNED_WORDS.search(names.replace("-", " ").replace("_", " ")):
        return None
    return (f"{model_name} has no chat template of its own, so it is probably a base model, which continues a "
            "conversation instead of answering it; for chat pass an instruction-tuned GGUF with -m/--model "
            "(model=...), e.g. Qwen2.5-Coder-0.5B-Instruct (the README says where to get it)")


def _token_text(metadata: Mapping[str, Any], key: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    tid = metadata.get(f"tokenizer.ggml.{key}")
    if tokens is None or tid is None or not 0 <= int(tid) < len(tokens):
        return ""
    return tokens[int(tid)]


def render_chat(metadata_or_template: Mapping[str, Any] | str, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, bos_token: str | None = None,
                eos_token: str | None = None, **template_vars: Any) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) into prompt text.

    `metadata_or_template` is GGUF metadata (template and BOS/EOS text taken from it) or a template
    string. Extra keyword arguments (e.g. tools=[...]) become template variables."""
    if isinstance(metadata_or_template, str):
        template = metadata_or_template
        metadata: Mapping[str, Any] = {}
    else:
        metadata = metadata_or_template
        template = template_from_metadata(metadata)
    if bos_token is None:
        bos_token = _token_text(metadata, "bos_token_id")
    if eos_token is None:
        eos_token = _token_text(metadata, "eos_token_id")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise CupyllmError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r}")
    variables = {"unk_token": _token_text(metadata, "unknown_token_id"),
                 "pad_token": _token_text(metadata, "padding_token_id"),
                 "tools": None, "documents": None, **template_vars}
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, **variables)
    except jinja2.TemplateError as e:
        raise CupyllmError(f"the chat template rejected the conversation: {e}") from None


def needs_bos(tokenizer, rendered: str) -> bool:
    """Whether to let encode() add BOS: not when the rendered prompt already starts with BOS text
    (most templates write `bos_token` themselves), else the GGUF's add_bos flag."""
    if not tokenizer.add_bos or tokenizer.bos_id is None:
        return False
    bos_text = tokenizer.tokens[tokenizer.bos_id]
    return not rendered.startswith(bos_text)


def encode_chat(tokenizer, metadata_or_template: Mapping[str, Any] | str,
                messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                **template_vars: Any) -> list[int]:
    """Render and tokenize a conversation, special tokens parsed, BOS exactly once."""
    bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
    eos = tokenizer.tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else ""
    text = render_chat(metadata_or_template, messages, add_generation_prompt,
                       bos_token=bos, eos_token=eos, **template_vars)
    return tokenizer.encode(text, add_bos=needs_bos(tokenizer, text), parse_special=True)
