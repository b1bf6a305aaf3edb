"""The chat templates a tiny model can carry (ChatML and a Qwen3-style one), the marker tokens they use, and
THINKING_GRAMMAR, which makes a random model's reply look like reasoning and then an answer (see the package doc)."""

from __future__ import annotations

from typing import Literal

Template = Literal["chatml", "qwen3"]
TEMPLATES: tuple[Template, ...] = ("chatml", "qwen3")

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Every tag trims the whitespace around it, so only the quoted strings reach the output.
QWEN3_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set leading_system = messages | length > 0 and messages[0]['role'] == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if leading_system -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}
  {{- '# Tools\\n\\nYou can call the functions described below, one JSON signature per line:\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nTo call one, reply with a JSON object holding its name and arguments between ' -}}
  {{- '<tool_call> and </tool_call>, one block per call:\\n<tool_call>\\n' -}}
  {{- '{"name": <function-name>, "arguments": <arguments-as-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif leading_system -%}
  {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- set body = m['content'] if m['content'] is string else '' -%}
  {%- if m['role'] == 'system' -%}
    {%- if not loop.first -%}{{- '<|im_start|>system\\n' + body + '<|im_end|>\\n' -}}{%- endif -%}
  {%- elif m['role'] == 'user' -%}
    {{- '<|im_start|>user\\n' + body + '<|im_end|>\\n' -}}
  {%- elif m['role'] == 'assistant' -%}
    {%- set thought = m['reasoning_content'] if m['reasoning_content'] is string else '' -%}
    {%- if '</think>' in body -%}
      {%- if not thought -%}{%- set thought = body.split('</think>')[0].split('<think>')[-1] -%}{%- endif -%}
      {%- set body = body.split('</think>')[-1] -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if loop.index0 > ns.last_user and thought.strip() -%}
      {{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- body.lstrip('\\n') -}}
    {%- if m['tool_calls'] -%}
      {%- for call in m['tool_calls'] -%}
        {%- set fn = call['function'] if call['function'] is defined else call -%}
        {%- if not loop.first or body.strip() -%}{{- '\\n' -}}{%- endif -%}
        {{- '<tool_call>\\n' -}}
        {{- '{"name": "' + fn['name'] + '", "arguments": ' -}}
        {%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}
        {%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
        {{- '}\\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif m['role'] == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + body + '\\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# Thinking, then an answer: each a letter and up to 15 more letters or spaces. A generation is at most 47 tokens
# (the markers come as one token each or spelled out) plus the end-of-generation token.
THINKING_GRAMMAR = """\
root ::= "<think>" words "</think>" words
words ::= [a-zA-Z] [a-zA-Z ]{0,15}
"""
