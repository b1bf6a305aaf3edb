"""Log output: the usual text lines, or (with --log-json) one JSON object per line.

A request's line carries its RequestEntry; in JSON its fields become keys beside time, level, logger and message.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from slotkeeper.journal import RequestEntry

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601 UTC), level, logger, message, the request's fields if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry = getattr(record, "request", None)
        if isinstance(entry, RequestEntry):
            out.update({k: v for k, v in entry.to_json().items() if k != "time"})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str, as_json: bool) -> None:
    """Set up the root logger once for `slotkeeper serve`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
