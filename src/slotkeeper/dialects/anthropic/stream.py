"""Anthropic's stream encoding: the backend's chat stream as Anthropic's SSE event sequence.

A state machine over already-parsed upstream events (dialects/framing.py); no I/O, no clock (ids are handed in).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from slotkeeper.dialects.anthropic.answers import (
    Usage,
    as_mapping,
    error_body,
    first_choice,
    stop_reason,
    stopping_word_of,
    usage_from,
)
from slotkeeper.dialects.framing import KeepAlive, UpstreamEvent
from slotkeeper.errors import SlotkeeperError, UpstreamError


def sse(event: Mapping[str, Any]) -> bytes:
    """One Anthropic SSE event: an `event:` line naming data.type (the SDK skips events without one)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def error_event(error: SlotkeeperError) -> bytes:
    return sse(error_body(error))


def upstream_error(event: Mapping[str, Any]) -> SlotkeeperError:
    """The backend's mid-stream `{"error": {...}}` event as an error with its status."""
    inner = event.get("error")
    code = inner.get("code") if isinstance(inner, Mapping) else None
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return UpstreamError(status, json.dumps(event).encode())


class MessageStreamEncoder:
    """Turns the backend's chat stream into Anthropic's event sequence.

    message_start goes out with the first upstream event (with return_progress on, that is the first progress chunk,
    sent as soon as the prompt starts processing, so its counts are known); every progress chunk and backend
    keep-alive becomes a `ping`; text, thinking and each tool call become blocks with contiguous indices; finish()
    closes the open block and sends message_delta (stop reason, final usage) and message_stop.
    """

    def __init__(self, message_id: str, model: str, stop_sequences: Sequence[str] = ()) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = tuple(stop_sequences)
        self._started = False
        self._ended = False
        self._index = -1  # index of the open block, or of the last closed one
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._tool_index: object = None  # the backend's index of the open tool call
        self._tool_id: object = None
        self._finish_reason: object = None
        self._stopping_word: object = None
        self._usage: Usage | None = None

    def feed(self, event: UpstreamEvent) -> bytes:
        if self._ended:
            return b""
        if isinstance(event, KeepAlive):
            return self._start() + sse({"type": "ping"})
        if "error" in event:
            return self.fail(upstream_error(event))
        out = [self._start(event)]
        if (word := stopping_word_of(event)) is not None:
            self._stopping_word = word
        self._usage = usage_from(event) or self._usage
        if "prompt_progress" in event:
            out.append(sse({"type": "ping"}))
        choice = first_choice(event)
        delta = as_mapping(choice.get("delta"))
        if isinstance(reasoning := delta.get("reasoning_content"), str) and reasoning:
            out.append(self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if isinstance(text := delta.get("content"), str) and text:
            out.append(self._open_block("text", {"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            out.append(self._tool_call(call))
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
        return b"".join(out)

    def finish(self) -> bytes:
        """The end of the backend's stream: close the message, or report an answer that never finished."""
        if self._ended:
            return b""
        if self._finish_reason is None:
            return self.fail(SlotkeeperError("the backend ended the stream before the answer was complete"))
        self._ended = True
        reason, sequence = stop_reason(self._finish_reason, self._stopping_word, self.stop_sequences)
        usage = (self._usage or Usage()).as_dict()
        return b"".join([self._start(), self._close_block(),
                         sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                              "usage": usage}),
                         sse({"type": "message_stop"})])

    def fail(self, error: SlotkeeperError) -> bytes:
        """An error after the response started: one `event: error`, and nothing after it."""
        if self._ended:
            return b""
        self._ended = True
        return error_event(error)

    def _start(self, first: Mapping[str, Any] | None = None) -> bytes:
        if self._started:
            return b""
        self._started = True
        usage = Usage()
        progress = first.get("prompt_progress") if first is not None else None
        if isinstance(progress, Mapping):
            cached = int(progress.get("cache", 0))
            usage = Usage(int(progress.get("total", 0)) - cached, 0, cached)
        return sse({"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage.as_dict()}})

    def _open_block(self, kind: str, block: dict[str, Any]) -> bytes:
        if self._open == kind and kind != "tool_use":
            return b""
        closed = self._close_block()
        self._index += 1
        self._open = kind
        return closed + sse({"type": "content_block_start", "index": self._index, "content_block": block})

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        self._tool_index = self._tool_id = None
        return sse({"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _tool_call(self, call: object) -> bytes:
        if not isinstance(call, Mapping):
            return b""
        function = as_mapping(call.get("function"))
        out = b""
        # The backend streams tool calls one after another, each starting with its id and name; a new index (or a
        # new id) starts the next tool_use block. Blocks cannot be reopened, and the backend never goes back.
        index, call_id = call.get("index", 0), call.get("id")
        if self._open != "tool_use" or index != self._tool_index or (call_id and call_id != self._tool_id):
            block_id = call_id or f"toolu_{self.message_id}_{self._index + 1}"
            out += self._open_block("tool_use", {"type": "tool_use", "id": block_id,
                                                 "name": function.get("name") or "", "input": {}})
            self._tool_index, self._tool_id = index, block_id
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out
