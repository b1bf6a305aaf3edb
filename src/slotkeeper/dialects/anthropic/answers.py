"""Anthropic's non-streamed answers: a backend chat completion as a message, its usage and stop reason, errors.

The usage, stop-reason and chunk readers here are shared with the stream encoder (dialects/anthropic/stream.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotkeeper.errors import SlotkeeperError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    # Anthropic uses invalid_request_error "for other 4XX status codes not listed" as well.
    fallback = "invalid_request_error" if 400 <= error.status_code < 500 else "api_error"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status_code, fallback),
                                       "message": error.message}}


@dataclass(frozen=True, slots=True)
class Usage:
    """Anthropic's token counts: input_tokens excludes what was read from the cache (cache_read_input_tokens)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cache_read_input_tokens": self.cache_read_input_tokens, "cache_creation_input_tokens": 0}


def usage_from(data: Mapping[str, Any]) -> Usage | None:
    """Token counts from a backend answer or chunk: its `timings` (always on the last one), else its `usage`."""
    timings = data.get("timings")
    if isinstance(timings, Mapping) and "prompt_n" in timings:
        return Usage(int(timings.get("prompt_n", 0)), int(timings.get("predicted_n", 0)),
                     int(timings.get("cache_n", 0)))
    usage = data.get("usage")
    if isinstance(usage, Mapping) and "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = int(details.get("cached_tokens", 0)) if isinstance(details, Mapping) else 0
        return Usage(int(usage["prompt_tokens"]) - cached, int(usage.get("completion_tokens", 0)), cached)
    return None


def stop_reason(finish_reason: object, stopping_word: object, stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the backend's finish_reason and the stop word it reported."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    # The template's own end markers are stop words too; only the client's count as a stop sequence.
    if isinstance(stopping_word, str) and stopping_word and stopping_word in stop_sequences:
        return "stop_sequence", stopping_word
    return "end_turn", None


def as_mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def first_choice(data: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = data.get("choices")
    return as_mapping(choices[0]) if isinstance(choices, list) and choices else {}


def stopping_word_of(data: Mapping[str, Any]) -> object:
    verbose = data.get("__verbose")
    return verbose.get("stopping_word") if isinstance(verbose, Mapping) else None


def tool_input(arguments: object) -> dict[str, Any]:
    """A tool call's arguments string as Anthropic's input object; text that is not a JSON object is kept whole."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": arguments}


def to_message(data: Mapping[str, Any], *, message_id: str, model: str,
               stop_sequences: Sequence[str] = ()) -> dict[str, Any]:
    """A backend chat completion as an Anthropic message."""
    choice = first_choice(data)
    message = as_mapping(choice.get("message"))
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for i, call in enumerate(message.get("tool_calls") or []):
        function = as_mapping(as_mapping(call).get("function"))
        content.append({"type": "tool_use", "id": as_mapping(call).get("id") or f"toolu_{message_id}_{i}",
                        "name": function.get("name", ""), "input": tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), stopping_word_of(data), stop_sequences)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": (usage_from(data) or Usage()).as_dict()}
