"""What Claude Code sends that a local model's cache must see through: its attribution line, its session id, and its
side requests. Pure functions over a parsed /v1/messages request.

- The attribution line (`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;`) is the first
  system block of every request. Some of its fields change from one request to the next, so left in it changes the
  system prompt's hash, the system snapshot's key and the first tokens of every prompt: nothing is ever reused, not
  even by llama-server itself. It carries nothing for a local model, so it is taken out before anything else
  (`keep_attribution_block` keeps it).
- Its session id is in `metadata.user_id`: a JSON string with `session_id` (from v2.1.78), or before that
  `user_<hash>_account_<uuid>_session_<uuid>`. The `X-Claude-Code-Session-Id` header (identity.py) wins over it.
- Its side requests (a session's title, a command's prefix, a subagent's warm-up, a quota probe) go out under the
  session's id: they must never become the session's state. With `CLAUDE_CODE_GATEWAY_HINT_HEADERS=1` it says so
  itself (`x-claude-code-request-class: auxiliary`); without, they are told by their shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from slotkeeper.dialects.anthropic.requests import MessagesRequest, TextBlock

ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"
REQUEST_CLASS_HEADER = "x-claude-code-request-class"
# Request classes that are a conversation's own turns (a compaction reads the whole history: it belongs in the
# session's slot, where that history already is).
_MAIN_CLASSES = frozenset({"main", "subagent", "workflow", "compaction"})
# How its side requests begin (system prompt or the one user message), from its source and from proxies' captures.
_SIDE_MARKERS = (
    "Generate a concise, sentence-case title",
    "Analyze if this message indicates a new conversation topic",
    "<policy_spec>",
    "Please write a 5-10 word title for the following conversation",
    "[SUGGESTION MODE:",
)
_SIDE_USER_TEXTS = frozenset({"Warmup", "quota"})
# Claude Code's `metadata.user_id` before v2.1.78: user_<64 hex>_account_<uuid or nothing>_session_<uuid>.
_LEGACY_USER_ID = re.compile(r"^user_[0-9a-f]{64}_account_[0-9a-f-]*_session_([0-9a-f]{8}-[0-9a-f-]{27})$")


def without_attribution(request: MessagesRequest) -> tuple[MessagesRequest, int]:
    """The request without Claude Code's attribution lines in its system prompt (a block that held only that line
    goes; a line of a merged block goes, the rest stays), and how many lines were taken out."""
    system = request.system
    if system is None:
        return request, 0
    if isinstance(system, str):
        kept, removed = _strip_lines(system)
        return (request.model_copy(update={"system": kept or None}), removed) if removed else (request, 0)
    blocks: list[TextBlock] = []
    removed = 0
    for block in system:
        kept, n = _strip_lines(block.text)
        removed += n
        if not n:
            blocks.append(block)
        elif kept:
            blocks.append(block.model_copy(update={"text": kept}))
    if not removed:
        return request, 0
    return request.model_copy(update={"system": blocks or None}), removed


def _strip_lines(text: str) -> tuple[str, int]:
    if ATTRIBUTION_PREFIX not in text:
        return text, 0
    lines = text.split("\n")
    kept = [line for line in lines if not line.lstrip().startswith(ATTRIBUTION_PREFIX)]
    removed = len(lines) - len(kept)
    return "\n".join(kept).strip("\n") if removed else text, removed


def session_from_user_id(user_id: str | None) -> str | None:
    """The session id in Claude Code's `metadata.user_id`, or the value as it is when it holds none (another
    client's user id, a weaker hint than an explicit session id)."""
    if user_id is None or not user_id.strip():
        return None
    value = user_id.strip()
    if value.startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session.strip() if isinstance(session, str) and session.strip() else value
    legacy = _LEGACY_USER_ID.match(value)
    return legacy.group(1) if legacy else value


def is_side_request(headers: Mapping[str, str], request: MessagesRequest) -> bool:
    """A Claude Code request that is not one of the conversation's turns (see the module's docstring)."""
    declared = (headers.get(REQUEST_CLASS_HEADER) or "").strip().lower()
    if declared:
        return declared not in _MAIN_CLASSES
    if request.stream or request.tools or len(request.messages) != 1 or request.messages[0].role != "user":
        return False
    user = _text_of(request.messages[0].content)
    if user.strip() in _SIDE_USER_TEXTS:
        return True
    system = request.system if isinstance(request.system, str) else "\n".join(b.text for b in request.system or [])
    return any(marker in system or user.lstrip().startswith(marker) for marker in _SIDE_MARKERS)


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(getattr(block, "text", "") for block in content if getattr(block, "type", "") == "text")
    return ""
