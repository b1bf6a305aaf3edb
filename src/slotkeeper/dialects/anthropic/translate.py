"""A /v1/messages request as the backend's /v1/chat/completions body: system, blocks, tools, thinking.

Pure functions: parsed requests in (dialects/anthropic/requests.py), the dict for llama-server out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from slotkeeper.dialects.anthropic.requests import (
    ContentBlock,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    UrlSource,
)

# llama-server's own sampling and template fields a client may add (SDKs pass them with extra_body); forwarded as
# they are. Anthropic-only fields (service_tier, container, ...) are not: the backend has no use for them.
PASSTHROUGH_FIELDS: frozenset[str] = frozenset({
    "chat_template_kwargs", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos", "n_probs", "samplers", "thinking_budget_tokens",
    "reasoning_budget_tokens", "reasoning_effort", "reasoning_format", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau",
    "mirostat_eta", "sse_ping_interval",
})


def system_texts(request: CountTokensRequest) -> list[str]:
    """The system prompt's texts in order, for the session rules (a changed system prompt is another session)."""
    if request.system is None:
        return []
    if isinstance(request.system, str):
        return [request.system]
    return [block.text for block in request.system]


def metadata_user_id(request: MessagesRequest) -> str | None:
    return request.metadata.user_id if request.metadata is not None else None


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system and messages as OpenAI chat messages, in the order the model will read them."""
    out: list[dict[str, Any]] = []
    system = system_texts(request)
    if any(system):
        out.append({"role": "system", "content": _text_content([t for t in system if t])})
    for message in request.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "system":
            out.append({"role": "system", "content": _text_content(
                [b.text for b in message.content if isinstance(b, TextBlock)])})
        elif message.role == "assistant":
            out.append(_assistant_message(message.content))
        else:
            out.extend(_user_messages(message.content))
    return out


def _text_content(texts: list[str]) -> str | list[dict[str, Any]]:
    # One text stays a plain string (what every template can render); several become parts, joined by the backend.
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _image_part(block: ImageBlock) -> dict[str, Any]:
    source = block.source
    url = source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(p["type"] == "text" for p in parts):
        return _text_content([p["text"] for p in parts])
    return parts


def _user_messages(blocks: Sequence[ContentBlock]) -> list[dict[str, Any]]:
    # OpenAI wants tool results right after the assistant's tool calls, so they come before the user's other parts.
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            tool_messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                  "content": _tool_result_content(block)})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, DocumentBlock):
            parts.append({"type": "text", "text": block.source.data})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block))
        # thinking blocks in a user turn carry nothing the model should read
    if parts or not tool_messages:
        tool_messages.append({"role": "user", "content": _parts_content(parts) if parts else ""})
    return tool_messages


def _tool_result_content(block: ToolResultBlock) -> str | list[dict[str, Any]]:
    if isinstance(block.content, str):
        return block.content
    parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else _image_part(b) for b in block.content]
    return _parts_content(parts) if parts else ""


def _assistant_message(blocks: Sequence[ContentBlock]) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            tool_calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        # redacted thinking is encrypted for Anthropic's own models: nothing a local model can read
    message: dict[str, Any] = {"role": "assistant", "content": _text_content(texts) if texts else ""}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in tools]


def _tool_choice_fields(choice: ToolChoice) -> dict[str, Any]:
    # llama-server takes only "auto" | "required" | "none": a named tool becomes "required" over the same tool list
    # (narrowing the list would change the prompt, and with it the cached prefix of every later turn).
    mapped = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}[choice.type]
    fields: dict[str, Any] = {"tool_choice": mapped}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def count_tokens_body(request: CountTokensRequest) -> dict[str, Any]:
    """The chat body whose prompt the backend counts for /v1/messages/count_tokens."""
    body: dict[str, Any] = {"messages": chat_messages(request)}
    if request.tools:
        body["tools"] = chat_tools(request.tools)
    return body


def chat_body(request: MessagesRequest, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The backend's /v1/chat/completions body for a /v1/messages request (our slot fields are added later).

    Besides the translation it asks for two read-only extras: `return_progress` on streams (prompt progress chunks,
    turned into `ping` events during a long prefill) and `verbose` when there are stop sequences (the backend names
    the stop word it hit only there, and Anthropic reports it).
    """
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request),
                            "max_tokens": request.max_tokens, "stream": request.stream}
    if request.stop_sequences:
        body["stop"] = list(request.stop_sequences)
        body["verbose"] = True
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = chat_tools(request.tools)
        if request.tool_choice is not None:
            body.update(_tool_choice_fields(request.tool_choice))
    if request.thinking is not None:
        if request.thinking.type == "enabled" and request.thinking.budget_tokens is not None:
            body["thinking_budget_tokens"] = request.thinking.budget_tokens
        elif request.thinking.type == "disabled":
            body["reasoning_effort"] = "none"
    body.update({k: v for k, v in raw.items() if k in PASSTHROUGH_FIELDS})
    if request.stream:
        body["return_progress"] = True
    return body
