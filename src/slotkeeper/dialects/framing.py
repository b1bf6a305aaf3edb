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
