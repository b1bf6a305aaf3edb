"""Every warning and error slotkeeper logs or raises with a message appears in docs/troubleshooting.md.

The source is read with `ast`: for each message, its longest literal piece (between placeholders) must be on the page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "src" / "slotkeeper"
PAGE = REPO / "docs" / "troubleshooting.md"
LOG_LEVELS = {"warning", "error", "exception", "critical"}
# Errors of the test-model writer (`slotkeeper tiny-model`, the package tinymodel/): a developer tool, documented by
# its --help.
EXEMPT_PACKAGES = {"tinymodel"}


def _pieces(node: ast.expr) -> list[str]:
    """The literal text of a message, split at its placeholders (%-style and f-string fields)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.split(r"%[-#0-9.]*[sdrfi]", node.value)
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pieces(node.left) + _pieces(node.right)
    return []


def messages() -> list[tuple[str, str]]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.relative_to(SOURCE).parts[0] in EXEMPT_PACKAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            call: ast.Call | None = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log"):
                call = node
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call = node.exc
            if call is None or not call.args:
                continue
            pieces = [" ".join(p.split()) for p in _pieces(call.args[0])]
            longest = max(pieces, key=len, default="")
            if len(longest.strip()) >= 8:
                found.append((f"{path.relative_to(SOURCE)}:{call.lineno}", longest.strip()))
    return found


def test_messages_are_found() -> None:
    assert len(messages()) > 40


@pytest.mark.parametrize(("where", "text"), messages(), ids=[w for w, _ in messages()])
def test_message_is_documented(where: str, text: str) -> None:
    page = " ".join(PAGE.read_text().split())
    assert text in page, f"{where}: add {text!r} to docs/troubleshooting.md with its meaning and fix"
