"""Stream framing helpers: find the backend's final `timings` in a stream of SSE bytes without buffering it."""

from __future__ import annotations

import json
from typing import Any


class TimingsScanner:
    """Fed the raw stream chunk by chunk; keeps the last `timings` object seen in a `data:` event.

    Only lines that mention timings are parsed, so a long stream costs one substring test per line.
    """

    def __init__(self) -> None:
        self._pending = b""
        self.timings: dict[str, Any] | None = None
        self.saw_done = False

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._line(line)

    def finish(self) -> None:
        if self._pending:
            self._line(self._pending)
            self._pending = b""

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.saw_done = True
            return
        if b'"timings"' not in payload:
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict) and isinstance(event.get("timings"), dict):
            self.timings = event["timings"]


class KeepAlive:
    """An SSE comment from the backend (`:` line): it is alive but has nothing to say yet (long prefill)."""

    def __repr__(self) -> str:
        return "KEEPALIVE"


KEEPALIVE = KeepAlive()
UpstreamEvent = dict[str, Any] | KeepAlive


class SseDecoder:
    """Turns the backend's SSE bytes into parsed `data:` objects (and KEEPALIVE for comments), chunk by chunk.

    `[DONE]` ends the stream and yields nothing; undecodable data lines are skipped.
    """

    def __init__(self) -> None:
        self._pending = b""
        self.done = False

    def feed(self, chunk: bytes) -> list[UpstreamEvent]:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        return [event for line in lines if (event := self._line(line)) is not None]

    def finish(self) -> list[UpstreamEvent]:
        line, self._pending = self._pending, b""
        event = self._line(line) if line else None
        return [] if event is None else [event]

    def _line(self, line: bytes) -> UpstreamEvent | None:
        line = line.rstrip(b"\r")
        if line.startswith(b":"):
            return KEEPALIVE
        if not line.startswith(b"data:"):
            return None
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            event = json.loads(payload)
        except ValueError:
            return None
        return event if isinstance(event, dict) else None
