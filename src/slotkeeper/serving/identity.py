"""Session identity: which conversation a request belongs to, from its headers, body fields, or its messages (the
system prompt, the conversation's first message and the first answer to it).

Functions over already-parsed input (pure but for the fresh tag of a first turn's name); the precedence is the one
users were promised (README "Session rules").
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from slotkeeper.cache.chain import canonical_json
from slotkeeper.cache.sidestates import RESERVED_PREFIX
from slotkeeper.errors import BadRequest
from slotkeeper.types import BRANCH_MARK, SESSION_BODY_FIELDS, IdSource, SessionKey

# Checked in this order; the first one present with a usable value wins. Who sends which (docs/clients.md):
SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",  # OpenCode (X-Session-Id), OpenWebUI renamed with FORWARD_SESSION_INFO_HEADER_CHAT_ID, scripts
    "x-conversation-id",
    "session-id",  # Codex
    "conversation-id",
    "x-openwebui-chat-id",  # OpenWebUI with ENABLE_FORWARD_USER_INFO_HEADERS
    "x-claude-code-session-id",  # Claude Code
    "x-session-affinity",  # OpenCode
    "x-opencode-session",  # OpenCode, to its own providers
    "thread-id",  # Codex
    "session_id",  # older Codex builds
    "conversation_id",
)
# A subagent's requests carry its parent's session id and an agent id of its own: they are a conversation of their
# own (Claude Code's x-claude-code-agent-id), kept apart as `<session>.agent-<id>`.
AGENT_HEADERS: tuple[str, ...] = ("x-claude-code-agent-id",)
# A body `id` that looks like an id the API itself hands out (a completion or message echoed back) is not a chat id.
_RESPONSE_ID_PREFIXES: tuple[str, ...] = ("chatcmpl-", "cmpl-", "msg_", "resp_")

DEFAULT_SESSION = "default"
# Between a conversation id's system prompt group and its own part: `sys-<16 hex>.c<12 hex>`.
CONVERSATION_MARK = ".c"
# A conversation without an id and without a system prompt: `chat-<16 hex>` of its first message and the first answer.
CHAT_PREFIX = "chat-"
# Before a first turn's own tag: `chat-<16 hex>.t<8 hex>`, `sys-<16 hex>.c<12 hex>.t<8 hex>`.
FIRST_TURN_MARK = ".t"
MAX_ID_LENGTH = 256
# Instruction blocks agents put into a user message and move or rewrite between runs (Claude Code's and Qwen Code's
# reminders): left out of a conversation's name, so that it survives a resume. Only the name: what is reused is
# decided by the tokens.
_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL)


def resolve_session(
    model: str,
    headers: Mapping[str, str],
    body: Mapping[str, object],
    system_texts: Sequence[str],
    extra_headers: Iterable[str] = (),
    hint: str | None = None,
    opening: object = None,
    reply: object = None,
    first_turn_tag: str | None = None,
    domain: str = "",
) -> SessionKey:
    """Return the session a request belongs to, in cache domain `domain` (domains.py: the same id or the same
    messages name another session in another domain).

    `headers` must be case-insensitive or lower-cased. `system_texts` are the texts of the request's system prompt
    in order, `opening` is the conversation's first message after it and `reply` the first answer to that (the
    dialect extracts them; None when there is none). `hint` is a dialect's weaker id (Anthropic's
    metadata.user_id), used after the explicit ids and before the messages. Raises BadRequest for an explicit id
    that cannot be an id.

    Without an id, a request belongs to the conversation its messages continue: the one on the same system prompt
    that opened with the same message and got the same first answer, `sys-<system hash>.c<opening hash>`, or
    `chat-<opening hash>` without a system prompt (see `conversation_id`). Two chats that open alike ("hi") differ
    by their first answers. A first turn, which has no answer yet, is a conversation of its own: its name ends in
    `.t<tag>` (`first_turn_tag`, fresh when None), so that no two first turns share a saved state. Only a request
    without any message is the catch-all `default`. A name is a hint: which saved state a request starts from is
    decided by the tokens it shares with it (cache/planner.py).
    """
    explicit = _explicit_id(headers, body, extra_headers, hint)
    if explicit is not None:
        value, source, where = explicit
        agent = next((v.strip() for name in AGENT_HEADERS if (v := headers.get(name)) and v.strip()), None)
        if agent is not None:
            value = f"{value}.agent-{agent}"
        if _ECHOED_SHAPE.fullmatch(value):
            key = _echoed(value, where, model, system_texts, opening, reply, first_turn_tag)
        else:
            key = SessionKey(model, _checked(value, where), source)
    else:
        key = _derived(model, system_texts, opening, reply, first_turn_tag)
    return dataclasses.replace(key, domain=domain) if domain else key


# The names `_derived` makes: `sys-<16 hex>`, `sys-<16 hex>.c<12 hex>`, `chat-<16 hex>`.
_DERIVED_SHAPE = re.compile(r"sys-[0-9a-f]{16}(?:\.c[0-9a-f]{12})?|chat-[0-9a-f]{16}")
# What a client may send back of them: a derived name, or a first turn's (`<derived>.t<8 hex>`).
_ECHOED_SHAPE = re.compile(f"(?:{_DERIVED_SHAPE.pattern})(?:{re.escape(FIRST_TURN_MARK)}[0-9a-f]{{8}})?")
# A branch of a derived name: a state its conversation left, kept by the store (cache/index.py).
_BRANCH_SHAPE = re.compile(f"(?:{_ECHOED_SHAPE.pattern}){re.escape(BRANCH_MARK)}[0-9a-f]{{8}}")


def _derived(model: str, system_texts: Sequence[str], opening: object, reply: object = None,
             first_turn_tag: str | None = None) -> SessionKey:
    """The session of a request without an explicit id: the conversation its messages continue (a first turn's
    own, when they have no answer yet)."""
    if any(text for text in system_texts):
        name = conversation_id(system_texts, opening, reply)
        source = IdSource.SYSTEM_PROMPT
    elif opening is not None:
        name, source = CHAT_PREFIX + _conversation_digest(opening, reply)[:16], IdSource.MESSAGES
    else:
        return SessionKey(model, DEFAULT_SESSION, IdSource.DEFAULT)
    if opening is not None and reply is None:
        name += FIRST_TURN_MARK + (first_turn_tag or secrets.token_hex(4))
    return SessionKey(model, name, source)


def _echoed(value: str, where: str, model: str, system_texts: Sequence[str], opening: object, reply: object,
            first_turn_tag: str | None) -> SessionKey:
    """An explicit id of a derived name's shape (the X-Slotkeeper-Session of an earlier answer, sent back): the
    conversation it names when this request's messages are of that conversation, never another's. A first turn's
    name stands for that first turn (a retry keeps it) and for the conversation it began, once it has an answer."""
    _, mark, tag = value.partition(FIRST_TURN_MARK)
    if mark:
        if _derived(model, system_texts, opening, None, tag).session_id == value:
            return _derived(model, system_texts, opening, reply, tag)
    else:
        derived = _derived(model, system_texts, opening, reply, first_turn_tag)
        if derived.session_id == value:
            return derived
    raise BadRequest(f"session id from {where} has the shape of the names slotkeeper derives from a conversation's "
                     "messages, and this request's messages are of another conversation; send no id, the "
                     "X-Slotkeeper-Session of this conversation's answers, or an id of your own")


def _explicit_id(headers: Mapping[str, str], body: Mapping[str, object], extra_headers: Iterable[str],
                 hint: str | None) -> tuple[str, IdSource, str] | None:
    """The first explicit id (headers, then body fields, then the dialect's hint), where it came from, and a name
    for it in an error message."""
    for name in (*SESSION_HEADERS, *(h.lower() for h in extra_headers)):
        value = headers.get(name)
        if value is not None and value.strip():
            return value.strip(), IdSource.HEADER, f"header {name}"
    for field in SESSION_BODY_FIELDS:
        found = _body_id(body, field)
        if found is not None:
            return found, IdSource.BODY, f"body field {field!r}"
    if hint is not None and hint.strip():
        return hint.strip(), IdSource.BODY, "the request's metadata"
    return None


def system_session_id(system_texts: Sequence[str]) -> str:
    """`sys-<sha256[:16]>` of the system prompt: the group of the conversations on it (they share its system
    snapshot, never each other's state)."""
    joined = "\n\n".join(system_texts)
    # JSON allows lone surrogate escapes; hash them as they came rather than fail on them.
    return "sys-" + hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def conversation_id(system_texts: Sequence[str], opening: object = None, reply: object = None) -> str:
    """The id of a conversation without an explicit one: its system prompt's group id (`system_session_id`), then
    `.c` and 12 hex digits of sha256 over its first message and the first answer to it (`_conversation_digest`).
    Without a first message (a system prompt alone), the group id itself."""
    group = system_session_id(system_texts)
    if opening is None:
        return group
    return f"{group}{CONVERSATION_MARK}{_conversation_digest(opening, reply)[:12]}"


def _conversation_digest(opening: object, reply: object) -> str:
    """The digest a conversation is named by: its first message's (`_opening_digest`), and once it has one, the
    first answer's too, so that two conversations that open alike are two."""
    if reply is None:
        return _opening_digest(opening)
    return hashlib.sha256(f"{_opening_digest(opening)}\0{_opening_digest(reply)}".encode()).hexdigest()


def _opening_digest(opening: object) -> str:
    """sha256 of a conversation's first message (or first answer) as its name sees it: its text (a string, or its
    text parts joined) without reminder blocks and the functions it calls, or its canonical JSON when it holds more
    than text. A call's id is left out: clients may make them anew on resume."""
    content = opening.get("content") if isinstance(opening, Mapping) else None
    text = _text(content)
    named: Any = opening
    if text is not None and isinstance(opening, Mapping):
        calls = opening.get("tool_calls")
        named = {"role": opening.get("role"), "text": " ".join(_REMINDER.sub(" ", text).split())}
        if isinstance(calls, list) and calls:
            named["calls"] = [c.get("function") if isinstance(c, Mapping) else c for c in calls]
    return hashlib.sha256(canonical_json(named).encode("utf-8", "surrogatepass")).hexdigest()


def _text(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") in ("text", "input_text")
                                         for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return None


def session_group(session_id: str) -> str | None:
    """The system prompt group a conversation id of `conversation_id` belongs to (`sys-<hash>`), else None."""
    if not session_id.startswith("sys-"):
        return None
    return session_id.split(CONVERSATION_MARK, 1)[0]


def _body_id(body: Mapping[str, object], field: str) -> str | None:
    value = body.get(field)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    value = value.strip()
    if field == "id" and value.startswith(_RESPONSE_ID_PREFIXES):
        return None
    return value


def checked_session_id(value: str, where: str) -> str:
    """A session id as given (from an operator's import, say), or BadRequest saying why it cannot be one."""
    return _checked(value.strip(), where)


def _checked(value: str, where: str) -> str:
    if value == DEFAULT_SESSION:
        # The catch-all of requests without any message, never saved: a conversation named so would have its slot
        # taken, run over and marked clean by every such request.
        raise BadRequest(f"session id from {where} is {DEFAULT_SESSION!r}, which slotkeeper keeps for requests "
                         "without an id or any message; choose another id")
    if _BRANCH_SHAPE.fullmatch(value):
        raise BadRequest(f"session id from {where} is the name of a state a conversation left ({value!r}), which "
                         "slotkeeper gives itself; choose another id")
    if value.startswith(RESERVED_PREFIX):
        raise BadRequest(f"session id from {where} starts with {RESERVED_PREFIX!r}, which slotkeeper keeps for the "
                         "names it makes itself; choose another id")
    if len(value) > MAX_ID_LENGTH:
        raise BadRequest(f"session id from {where} is {len(value)} characters long; the limit is {MAX_ID_LENGTH}")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise BadRequest(f"session id from {where} contains control characters")
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        raise BadRequest(f"session id from {where} is not valid Unicode (a lone surrogate)")
    return value


TASK_HEADER = "x-openwebui-task"
TASK_PREFIX = "### Task:"
# How the system prompts of other clients' side requests begin: OpenCode's title request, sent under the
# conversation's id just before a new conversation's first request.
SIDE_SYSTEM_PREFIXES: tuple[str, ...] = ("You are a title generator",)


def is_side_task(headers: Mapping[str, str], messages: object, stream: bool) -> bool:
    """Side requests that share a conversation's id: OpenWebUI's background tasks (titles, tags, follow-ups, queries,
    autocomplete) and OpenCode's title request.

    They are recognised by OpenWebUI's task header (a connection header `X-OpenWebUI-Task: {{TASK}}`), or by their
    shape: not streamed, one user message starting with `### Task:`; or a system prompt that starts like one of
    SIDE_SYSTEM_PREFIXES. (A one-off request no rule knows is told by its tokens: cache/bringing.py.)
    """
    if (headers.get(TASK_HEADER) or "").strip():
        return True
    if isinstance(messages, list) and messages and _side_system(messages[0]):
        return True
    if stream or not isinstance(messages, list) or len(messages) != 1:
        return False
    message = messages[0]
    if not isinstance(message, Mapping) or message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, list):
        content = next((p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"), None)
    return isinstance(content, str) and content.lstrip().startswith(TASK_PREFIX)


def _side_system(message: object) -> bool:
    if not isinstance(message, Mapping) or message.get("role") not in ("system", "developer"):
        return False
    content = message.get("content")
    if isinstance(content, list):
        content = next((p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"), None)
    return isinstance(content, str) and content.lstrip().startswith(SIDE_SYSTEM_PREFIXES)
