"""The OpenAI dialect: the backend speaks it natively, so translation is a pass-through with our fields swapped.

Pure functions: they read a parsed request body and return new values; they never do I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from slotkeeper.errors import BadRequest, SlotkeeperError
from slotkeeper.types import OWN_BODY_FIELDS

# Fields a client may not set because they are ours to decide (slot pinning and prompt caching).
_CONTROLLED_FIELDS = frozenset({"id_slot", "cache_prompt"})


# JSON schemas in `tools` and `format` nest a few dozen levels; much deeper is a mistake or an attack, and keeping
# bodies well below Python's recursion limit is what lets every later json.dumps of them succeed.
MAX_NESTING = 256
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object that can be sent on as JSON, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        # Decoded strictly here: json.loads(bytes) would let UTF-8-encoded surrogates through.
        text = raw.decode(json.detect_encoding(raw))
        body = json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("the request body is nested too deeply to be a request") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}")
    _check_sendable(body, strings=_SURROGATE_ESCAPE.search(text) is not None)
    return body


def _check_sendable(body: dict[str, Any], strings: bool) -> None:
    """Refuse what Python's json.loads accepts but cannot be encoded again for the backend: NaN, Infinity and
    numbers beyond a double's range, nesting deeper than MAX_NESTING, and (when `strings`: the text has a surrogate
    escape) a lone UTF-16 surrogate such as "\\ud800", which is not a character and has no UTF-8 form."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(body, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"the request body is nested too deeply to be a request (over {MAX_NESTING} levels)")
        items = container.values() if isinstance(container, dict) else container
        if strings and isinstance(container, dict):
            for key in container:
                _check_text(key)
        for item in items:
            if isinstance(item, dict | list):
                stack.append((item, depth + 1))
            elif isinstance(item, float) and not math.isfinite(item):
                raise BadRequest("the request body holds NaN, Infinity or a number too large for a 64-bit float; "
                                 "JSON numbers must be finite")
            elif strings and isinstance(item, str):
                _check_text(item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"the request body holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}), which is "
                         "not a character; send text as UTF-8") from exc


def system_texts(messages: object) -> list[str]:
    """Texts of the system (and developer) messages, in order; content may be a string or a list of text parts."""
    if not isinstance(messages, list):
        return []
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ("system", "developer"):
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(
                str(part.get("text", ""))
                for part in content
                if isinstance(part, Mapping) and part.get("type") == "text"
            )
    return texts


def opening(messages: object) -> object:
    """The conversation's first message after its system (and developer) messages, as sent; None without one."""
    if not isinstance(messages, list):
        return None
    return next((m for m in messages if not (isinstance(m, Mapping) and m.get("role") in ("system", "developer"))),
                None)


def first_reply(messages: object) -> object:
    """The first answer in the conversation: the first assistant message after its opening (`opening`); None
    before there is one."""
    if not isinstance(messages, list):
        return None
    first = opening(messages)
    if first is None:
        return None
    after = messages[messages.index(first) + 1:]
    return next((m for m in after if isinstance(m, Mapping) and m.get("role") == "assistant"), None)


def check_chat_request(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of chat messages")


def check_completion_request(body: Mapping[str, Any]) -> None:
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")


def check_responses_request(body: Mapping[str, Any]) -> None:
    if not isinstance(body.get("input"), str | list) or not body["input"]:
        raise BadRequest("'input' must be a non-empty string or array of input items")


def check_embeddings_request(body: Mapping[str, Any]) -> None:
    if "input" not in body:
        raise BadRequest("'input' is required")


def responses_system_texts(body: Mapping[str, Any]) -> list[str]:
    """The Responses API's system prompt: `instructions`, then system/developer items of `input` (whose parts are
    `input_text` rather than chat's `text`)."""
    texts = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            if not isinstance(item, Mapping) or item.get("role") not in ("system", "developer"):
                continue
            content = item.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(str(p.get("text", "")) for p in content
                             if isinstance(p, Mapping) and p.get("type") in ("input_text", "text"))
    return texts


def responses_chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body a Responses request stands for, used only to hash its message chain and find its system part
    (the backend still gets the Responses body: it speaks /v1/responses itself).

    Where the rendered prompt depends on the shape (the system part, which a warm-up evaluates as a chat request, and
    the tools), it is llama-server's own conversion (server_chat_convert_responses_to_chatcmpl): `instructions` as a
    system message, message items by role with their parts as chat `text` parts, function tools wrapped as chat
    tools and other tools dropped. So a system snapshot warmed up from this view is the prefix the backend renders
    for the Responses request, and a chat with the same system prompt and tools shares it.
    """
    view: dict[str, Any] = {"messages": responses_messages(body)}
    tools = responses_tools(body.get("tools"))
    if tools:
        view["tools"] = tools
    return view


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`instructions` first, then one entry per input item, in order: every item is its own chain position, so the
    chain of a resent history extends the last turn's item by item and an edit changes it from the edited item on."""
    messages: list[dict[str, Any]] = []
    if "instructions" in body:  # llama-server renders a null `instructions` as an empty system message
        instructions = body["instructions"]
        messages.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(_responses_entry(item) for item in items)
    return messages


# Item fields that never reach the prompt: ids the API hands out and a status a client may or may not send back.
_ITEM_BOOKKEEPING = frozenset({"id", "status"})


def _responses_entry(item: object) -> dict[str, Any]:
    """One input item in canonical chat form: messages by role with chat parts, a function call as an assistant
    tool call, its output as a tool message, anything else (reasoning, other tools' calls) as the item itself less
    its bookkeeping fields."""
    if not isinstance(item, Mapping):
        return {"item": item}
    kind, role = item.get("type"), item.get("role")
    if isinstance(role, str) and kind in ("message", None):
        return {"role": role, "content": _chat_parts(item.get("content"))}
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": item.get("arguments")}
        return {"role": "assistant", "tool_calls": [{"id": item.get("call_id"), "type": "function", "function": call}]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": _tool_output(item.get("output"))}
    return {k: v for k, v in item.items() if k not in _ITEM_BOOKKEEPING}


def _chat_parts(content: object) -> object:
    """A message item's content as chat parts: a string is one text part (as llama-server reads it), input_text and
    output_text parts are text parts, an input image is an image_url part; anything else is kept as it is."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return content
    return [_chat_part(part) for part in content]


def _chat_part(part: object) -> object:
    if not isinstance(part, Mapping):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url")}}
    return dict(part)


def _tool_output(output: object) -> object:
    return output if isinstance(output, str) or not isinstance(output, list) else [_chat_part(p) for p in output]


def responses_tools(tools: object) -> list[dict[str, Any]] | None:
    """The Responses tools as chat tools: each function tool as `{"type": "function", "function": {...}}` with its
    fields as given (so a chat request with the same tools has the same system part); built-in tools (web search,
    shell) have no chat form and are left out, as the backend leaves them out."""
    if not isinstance(tools, list):
        return None
    return [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            for tool in tools if isinstance(tool, Mapping) and tool.get("type") == "function"]


def without_own_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body minus our session fields, for routes that take no slot (embeddings)."""
    return {k: v for k, v in body.items() if k not in OWN_BODY_FIELDS}


def upstream_body(body: Mapping[str, Any], slot_id: int) -> dict[str, Any]:
    """The client's body minus our own fields, plus the slot we chose and prompt caching switched on."""
    forwarded = {k: v for k, v in without_own_fields(body).items() if k not in _CONTROLLED_FIELDS}
    forwarded["id_slot"] = slot_id
    forwarded["cache_prompt"] = True
    return forwarded


def error_event(error: SlotkeeperError) -> bytes:
    """An error after the stream has started: one `data:` event in the shape the backend itself uses."""
    return b"data: " + json.dumps(error.openai_body()).encode("utf-8") + b"\n\n"
