"""Ollama's stream encoding: the backend's stream events re-framed as NDJSON lines, one `feed` per event.

Pure state machine over already-parsed events (dialects/framing.py); the lines' shapes come from answers.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from slotkeeper.dialects.framing import UpstreamEvent
from slotkeeper.dialects.ollama.answers import (
    AnswerShape,
    Metrics,
    Piece,
    done_reason,
    error_body,
    logprobs_out,
    tool_calls_out,
)
from slotkeeper.errors import SlotkeeperError


def error_line(error: SlotkeeperError) -> bytes:
    """An error after the stream has started: one final NDJSON line (the status is already 200)."""
    return ndjson(error_body(error))


def ndjson(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


class StreamEncoder:
    """Re-frames the backend's stream events as Ollama NDJSON objects, one `feed` per event.

    Content and thinking go out as they come; tool-call fragments are gathered and sent as one line when the
    answer ends (Ollama clients want whole argument objects); `finish` gives the single `done: true` line.
    """

    def __init__(self, shape: AnswerShape) -> None:
        self.shape = shape
        self.reason: str | None = None
        self.timings: dict[str, Any] | None = None
        self.failed = False
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, event: UpstreamEvent, created_at: str) -> list[dict[str, Any]]:
        if not isinstance(event, dict) or self.failed:
            return []  # keep-alive comments have no NDJSON form
        if "error" in event:
            self.failed = True
            return [{"error": _error_text(event["error"])}]
        if isinstance(event.get("timings"), dict):
            self.timings = event["timings"]
        choices = event.get("choices")
        if isinstance(choices, list):
            return self._chat_event(choices, created_at)
        if "content" in event or "stop" in event:
            return self._completion_event(event, created_at)
        return []

    def _chat_event(self, choices: list[Any], created_at: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                self._gather(call)
            piece = Piece(str(delta.get("content") or ""), str(delta.get("reasoning_content") or ""),
                          logprobs=logprobs_out(choice.get("logprobs")))
            if piece.content or piece.thinking or piece.logprobs:
                out.append(self.shape.line(piece, created_at))
            if choice.get("finish_reason"):
                self.reason = done_reason(choice["finish_reason"])
                if self._calls:
                    calls = [self._calls[i] for i in sorted(self._calls)]
                    out.append(self.shape.line(Piece(tool_calls=tool_calls_out(calls)), created_at))
                    self._calls = {}
        return out

    def _gather(self, call: Mapping[str, Any]) -> None:
        index = int(call.get("index") or 0)
        slot = self._calls.setdefault(index, {"id": None, "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def _completion_event(self, event: Mapping[str, Any], created_at: str) -> list[dict[str, Any]]:
        content = str(event.get("content") or "")
        out = [self.shape.line(Piece(content), created_at)] if content else []
        if event.get("stop"):
            self.reason = done_reason(stop_type=event.get("stop_type"))
        return out

    def finish(self, created_at: str, total_ns: int, load_ns: int) -> list[dict[str, Any]]:
        """The `done: true` line, unless the stream already ended with an error line."""
        if self.failed:
            return []
        metrics = Metrics.of(self.timings, total_ns, load_ns)
        return [self.shape.final(Piece(), created_at, self.reason or "stop", metrics)]


def _error_text(error: object) -> str:
    if isinstance(error, Mapping):
        return str(error.get("message") or error)
    return str(error)
