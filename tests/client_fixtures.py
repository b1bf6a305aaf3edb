"""Recorded request shapes of real clients (tests/fixtures/clients/*.json: shapes from the clients' sources, contents
made up), expanded into requests: `{{WORDS n seed}}` is n made-up words, `{{CCH}}` a new 5-hex value on every
request (Claude Code's attribution hash), other `{{NAME}}`s come from the test."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from tests.support import words

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "clients"
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)(?: (\d+) (\d+))?\}\}")


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def expand(value: Any, names: dict[str, str]) -> Any:
    """`value` with its placeholders filled in; a fresh `{{CCH}}` each time it is met."""
    if isinstance(value, str):
        def fill(match: re.Match[str]) -> str:
            name, n, seed = match.groups()
            if name == "WORDS":
                return words(int(n), int(seed))
            if name == "CCH":
                return secrets.token_hex(3)[:5]
            return names[name]
        return _PLACEHOLDER.sub(fill, value)
    if isinstance(value, list):
        return [expand(v, names) for v in value]
    if isinstance(value, dict):
        return {k: expand(v, names) for k, v in value.items()}
    return value
