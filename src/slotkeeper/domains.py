"""Cache domains: whose saved states a request may start from (docs/domains.md).

A domain is made of what the operator chose to trust: the name of the API key the request presented (`api_keys`),
the user a trusted front end forwarded in a header (`user_header`, only behind a key), and a `cache_salt` the client
put in its body. Requests of one domain never reuse, list or time another's states. Without any of them every
request is of the one domain "" (a single user on loopback: nothing is kept apart).

A domain is a path of parts: `team`, `team/user=42`, `team/user=42/salt=<16 hex>`. A caller of the session API sees
its own domain and those below it (its users', its salts'). Pure functions over values already read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from slotkeeper.errors import BadRequest

# What a key's name may be (it names a domain in logs, listings and bundles).
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A forwarded user id or a cache_salt: printable ASCII without spaces, bounded (a salt taken unchecked crashed an
# engine once: CVE-2026-105756).
_VALUE = re.compile(r"[\x21-\x7e]{1,128}")
MAX_VALUE_CHARS = 128
SALT_FIELD = "cache_salt"
# The parts below a key's domain.
_USER, _SALT = "user=", "salt="


@dataclass(frozen=True, slots=True)
class Caller:
    """Who presented which key: the domain of that key (and of the user its front end forwarded), and whether it
    is the admin key, which sees and manages every domain."""

    domain: str = ""
    admin: bool = False


def key_domain(key_name: str | None, user: str | None) -> str:
    """The domain of a request before its body is read: the key's name, then the forwarded user (already checked
    by `checked_user`)."""
    parts = [key_name] if key_name else []
    if user is not None:
        parts.append(_USER + user)
    return "/".join(parts)


def checked_user(value: str, header: str) -> str:
    """A forwarded user id as it may name a domain; BadRequest when it cannot be one."""
    value = value.strip()
    if not _VALUE.fullmatch(value) or "/" in value:
        raise BadRequest(f"the {header} header must be 1-{MAX_VALUE_CHARS} printable ASCII characters without spaces "
                         "or '/'")
    return value


def salted(domain: str, body: Mapping[str, object]) -> str:
    """The domain narrowed by the body's `cache_salt`, if it has one: its hash is the last part (the salt itself,
    a secret of the client's, is never logged or stored). BadRequest for a salt that cannot be one: not a string,
    empty, too long, or with characters other than printable ASCII."""
    if SALT_FIELD not in body:
        return domain
    salt = body[SALT_FIELD]
    if not isinstance(salt, str) or not _VALUE.fullmatch(salt):
        raise BadRequest(f"{SALT_FIELD} must be a string of 1-{MAX_VALUE_CHARS} printable ASCII characters without "
                         "spaces")
    part = _SALT + hashlib.sha256(b"slotkeeper-salt\0" + salt.encode()).hexdigest()[:16]
    return f"{domain}/{part}" if domain else part


def checked_domain(value: str) -> str:
    """A domain an admin names (a pre-warm into it, an import into it): the parts `key_domain` and `salted` make;
    BadRequest otherwise."""
    parts = value.split("/") if value else []
    for i, part in enumerate(parts):
        label, sep, rest = part.partition("=")
        ok = (KEY_NAME.fullmatch(part) is not None and i == 0) or (
            sep == "=" and label in ("user", "salt") and _VALUE.fullmatch(rest) is not None)
        if not ok:
            raise BadRequest(f"{value!r} is not a cache domain: a key's name, then user=ID and salt=HASH parts, "
                             "separated by '/' (\"\" is the one domain of requests nothing keeps apart)")
    return value


def sees(caller: Caller, domain: str) -> bool:
    """Whether `caller` may see and manage the states of `domain`: the admin all; anyone else its own domain and
    the domains below it. Below the unnamed domain "" are only its users' and salts', never a named key's."""
    if caller.admin:
        return True
    if domain == caller.domain:
        return True
    if caller.domain:
        return domain.startswith(caller.domain + "/")
    return domain.startswith((_USER, _SALT))
