"""Value types shared across slotkeeper's layers.

Plain frozen dataclasses and enums: they carry no behaviour that touches I/O, so every layer may import them.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slotkeeper.version import UNVERSIONED, Version

# Between a derived name and a branch's tag: `chat-<16 hex>~<8 hex>`, a state its conversation left (cache/index.py).
BRANCH_MARK = "~"


class IdSource(enum.StrEnum):
    """Where a session id came from (see identity.py for the precedence)."""

    HEADER = "header"
    BODY = "body"
    SYSTEM_PROMPT = "system-prompt"
    ROUTE = "route"  # a route's own session for requests without an id (llama-server's /infill: "infill")
    MESSAGES = "messages"  # no id and no system prompt: named by the conversation's first message
    DEFAULT = "default"


class SnapshotKind(enum.StrEnum):
    """What a saved state holds: a conversation's, a system part's (cut from a conversation's, or pre-warmed), or a
    side task's (titles, tags: kept for the next task that starts the same way). The kind is data: every kind is a
    candidate for every request, and the tokens decide; it says how a state is named and evicted."""

    SESSION = "session"
    SYSTEM = "system"
    SIDE = "side"


class CacheOutcome(enum.StrEnum):
    """How a request's slot got its state: already there, restored from disk, or whatever the slot held."""

    HOT = "hot"
    RESTORED = "restored"  # the session's own snapshot
    PREFIX = "prefix"  # another snapshot sharing the first messages (a fork, or a new chat on a known prompt)
    COLD = "cold"


@dataclass(frozen=True, slots=True)
class SessionKey:
    """A conversation's identity inside a model namespace and a cache domain: the user, tenant or application its
    states belong to (domains.py; "" is the one domain when the operator keeps none apart). States of one
    domain are never found, listed or restored for another."""

    model: str
    session_id: str
    source: IdSource = field(default=IdSource.DEFAULT, compare=False)
    domain: str = ""

    @property
    def is_default(self) -> bool:
        """The catch-all session of requests with no id and no system prompt: never saved or restored."""
        return self.source is IdSource.DEFAULT

    @property
    def is_derived(self) -> bool:
        """Named by slotkeeper from the request's messages (no id was sent): two conversations whose messages begin
        alike can share such a name, so a save under it keeps the other's state (index.py, branches)."""
        return self.source in (IdSource.SYSTEM_PROMPT, IdSource.MESSAGES)

    def file_stem(self, fingerprint: str, kind: SnapshotKind = SnapshotKind.SESSION) -> str:
        """Our own hex file name for this key's snapshot: never derived textually from client strings."""
        name = f"{fingerprint}\0{self.model}\0{self.session_id}"
        if kind is not SnapshotKind.SESSION:
            name += f"\0{kind}"
        if self.domain:
            name += f"\0domain\0{self.domain}"
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        return digest[:40]

    @property
    def scoped_id(self) -> str:
        """The session's id among every domain's (two users' chats that open alike share an id): the id, and its
        domain when it has one."""
        return f"{self.session_id}\0{self.domain}" if self.domain else self.session_id

    def within(self, session_id: str, source: IdSource = IdSource.DEFAULT) -> SessionKey:
        """Another session of the same model and domain (a system part's, a side task's, a branch's)."""
        return SessionKey(self.model, session_id, source, self.domain)

    def __str__(self) -> str:
        return f"{self.model}/{self.session_id}" + (f" [{self.domain}]" if self.domain else "")


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What slotkeeper read from a backend at start (GET /props and /slots)."""

    url: str
    model_id: str
    model_path: str
    n_slots: int
    n_ctx_slot: int
    build_info: str
    fingerprint: str
    # What the server reported, for routes that describe the model (Ollama's /api/show, /api/tags).
    props: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    # The fingerprint but for the KV setting the backend's probe shows (serving/backend.py): what a restart of the
    # backend is probed against again.
    kv_base: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One saved slot state: an index row whose file was completely written."""

    model: str
    session_id: str
    filename: str
    fingerprint: str
    n_tokens: int
    n_bytes: int
    checksum: str
    created: float
    last_used: float
    hits: int
    kind: SnapshotKind = SnapshotKind.SESSION
    pinned: bool = False  # never evicted by the disk budget
    # Tokens of the prompt of the turn saved (0: not known); the rest of n_tokens were generated.
    n_prompt: int = 0
    # The saved state's version (version.py): which of two copies of it is newer.
    version: Version = UNVERSIONED
    # Bytes of the state's tail when it is kept as KV blocks and a tail (cache/blockstore.py); 0: kept whole.
    tail_bytes: int = 0
    # The cache domain the state belongs to (SessionKey.domain).
    domain: str = ""

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.model, self.session_id, domain=self.domain)

    @property
    def owed_tokens(self) -> int:
        """The tokens a request that sends this snapshot's messages back shares with it, at the most: its prompt.
        Generated tokens do not count (a reasoning model's client sends back the answer without the thinking)."""
        return min(self.n_prompt, self.n_tokens) if self.n_prompt > 0 else self.n_tokens

    @property
    def at_prompt_end(self) -> bool:
        """The snapshot holds its prompt and nothing generated: any request that extends the prompt extends it."""
        return 0 < self.n_tokens <= self.n_prompt


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What the backend reported about a finished turn (from the final `timings`)."""

    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None
    completed: bool = False


# The body fields: ids of our own, OpenRouter's `session_id`, and OpenAI's `prompt_cache_key` (Codex sends its
# thread id there), in this order.
SESSION_BODY_FIELDS: tuple[str, ...] = ("session_id", "conversation_id", "chat_id", "id", "prompt_cache_key")
# Body fields that are ours: removed before the request goes to the backend (`cache_salt` narrows the request's
# cache domain: domains.py).
OWN_BODY_FIELDS: frozenset[str] = frozenset((*SESSION_BODY_FIELDS, "cache_salt"))
