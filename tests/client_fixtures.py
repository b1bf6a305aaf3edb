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


def prompt_tokens(client: Any, body: dict[str, Any]) -> list[int]:
    """The backend's own tokens of a chat body's prompt (its template, its tokenizer), through slotkeeper's
    pass-through /apply-template and /tokenize: an httpx client on slotkeeper."""
    rendered = client.post("/apply-template", json={"messages": body["messages"], "tools": body.get("tools")})
    assert rendered.status_code == 200, rendered.text
    tokens = client.post("/tokenize", json={"content": rendered.json()["prompt"], "add_special": True,
                                            "parse_special": True})
    assert tokens.status_code == 200, tokens.text
    result: list[int] = tokens.json()["tokens"]
    return result


def shared(a: list[int], b: list[int]) -> int:
    """How many leading tokens two prompts share: all a backend can reuse of one for the other."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
