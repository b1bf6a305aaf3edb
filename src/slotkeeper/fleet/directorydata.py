"""What the session directory (directory.py) keeps in Redis, and the reading of what Redis returns: the keys, the
Lua scripts that take, refresh and give up a lease in one step, a lease's holder and fencing token, a session's owner,
a backend's name in the directory, and the Redis URL as it is shown (without its password). The times named below
(REPLICA_TTL_MS, ACTIVE_SECONDS, LEASE_MS, FENCE_SECONDS) are directory.py's.

Keys, all under `sk:`:
- `replica:<url>`: a replica's heartbeat, JSON of its models' backends (up, draining), expiring after REPLICA_TTL_MS;
  `replicas` is the set of replicas seen (one whose heartbeat expired is removed from it).
- `owner:<model>:<session>`: JSON `{"backend": name, "used": unix time}` of the session's owner, kept a day. A
  backend's name is `<replica url>|<backend url>`: the backend URL alone is the one its replica reaches, often on
  loopback, the same on every host.
- `active:<model>:<backend name>`: a sorted set of the backend's sessions by their last turn's time (its load:
  those of the last ACTIVE_SECONDS).
- `lease:<model>:<session>`: `<replica url>|<token>`, expiring after LEASE_MS unless its holder refreshes it.
- `fence:<model>:<session>`: the session's fencing counter, kept FENCE_SECONDS after its last lease.
- `placing:<model>`: held for the moment a replica chooses and records a session's new owner.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

_PREFIX = "sk:"
_TOKEN = re.compile(r"[0-9]{1,18}")  # a fencing token as Redis holds it: ASCII digits only

# Take the lease KEYS[1] for ARGV[1] when no one holds it, with the next token of the counter KEYS[2]. Returns the
# holder afterwards: "<replica>|<token>" (ours when taken).
_TAKE = """
local held = redis.call('get', KEYS[1])
if held then return held end
local token = redis.call('incr', KEYS[2])
redis.call('expire', KEYS[2], ARGV[3])
local value = ARGV[1] .. '|' .. token
redis.call('set', KEYS[1], value, 'PX', ARGV[2])
return value
"""
# Extend the lease KEYS[1] by ARGV[2] ms if ARGV[1] still holds it: 1, else 0.
_REFRESH = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
# Give the lease KEYS[1] up if ARGV[1] still holds it.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class _Seen:
    """What the directory holds for one session at one read."""

    holder: tuple[str, int] | None  # the lease's replica and token
    owner: str | None
    used: float  # the owner's last turn
    loads: dict[str, int]  # active sessions per backend


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_holder(value: Any) -> tuple[str, int] | None:
    """`<replica>|<token>` of a lease key; None when absent or unreadable."""
    text = _text(value)
    if text is None or "|" not in text:
        return None
    replica, _, token = text.rpartition("|")
    return (replica, int(token)) if _TOKEN.fullmatch(token) else None


def member(replica: str, backend: str) -> str:
    """A backend's name in the directory: its replica's URL and its own, as the replica reaches it (two hosts may
    both run a llama-server at http://127.0.0.1:8080)."""
    return f"{replica}|{backend}"


def backend_of(name: str) -> str:
    """The backend URL of a directory name (see `member`)."""
    return name.split("|", 1)[1] if "|" in name else name


def _owner(raw: Any) -> tuple[str | None, float]:
    text = _text(raw)
    if text is None:
        return None, 0.0
    try:
        data = json.loads(text)
        backend, used = data["backend"], data["used"]
    except (ValueError, KeyError, TypeError):
        return None, 0.0
    if not isinstance(backend, str) or isinstance(used, bool) or not isinstance(used, (int, float)) \
            or not math.isfinite(used):
        return None, 0.0
    return backend, float(used)


def _without_password(url: str) -> str:
    """`url` with any user and password in it replaced by `***`."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
