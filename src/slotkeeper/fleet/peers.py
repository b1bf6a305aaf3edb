"""Which other slotkeeper replicas this one trusts, and how it knows a request came from one of them.

Replicas of one set share a secret (`--replica-secret`). A replica that forwards a request signs it: an HMAC-SHA256,
keyed by the secret, over the request's method and target, a SHA-256 of its body, the hop count, the time it was
sent and the sender. A captured forward can be sent again within SKEW_SECONDS, but only as it was: the same body to
the same route, which is the client's own request run once more (the forwarding itself only keeps a request from
being forwarded further), never another body under its signature. Only
a request whose signature checks (and was sent within SKEW_SECONDS) counts as forwarded; from anyone else the
forwarding headers are ignored and never passed on, so a client that sends them is served exactly as one that does
not. Numbers in them are read strictly (ASCII digits, bounded), never by `int()` on whatever came.

The replicas a request may be forwarded to, with the client's credentials, are the allow-list (`--replica`, each an
absolute http(s) base URL, `*` matching within it): a replica URL read from the directory (Redis) that is not on it,
or not a base URL at all, is never contacted.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slotkeeper.urls import is_base_url

FORWARDED = "x-slotkeeper-forwarded"  # the sender: its replica URL
HOPS = "x-slotkeeper-hops"  # how many times the request was forwarded, this time included
SENT_AT = "x-slotkeeper-sent-at"  # unix seconds when it was sent
SIGNATURE = "x-slotkeeper-signature"  # hex HMAC-SHA256 of the above with the request line
HEADERS = frozenset({FORWARDED, HOPS, SENT_AT, SIGNATURE})
# A signed request older (or newer, by the clocks) than this is not taken as forwarded.
SKEW_SECONDS = 30

_COUNT = re.compile(r"[0-9]{1,2}")
_SECONDS = re.compile(r"[0-9]{1,12}")
_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Forwarding:
    """A forwarded request's signed headers, as checked: who sent it and how many hops it has made."""

    sender: str
    hops: int


class Peers:
    """This replica's trust in the others: the shared secret and the allow-list of their URLs."""

    def __init__(self, secret: str, own: str, allowed: Sequence[str]) -> None:
        self._key = secret.encode()
        self.own = own
        self._allowed = [p.lower() for p in allowed]

    def allows(self, url: str) -> bool:
        """Whether `url` is a replica this one may forward to (and send a client's credentials to)."""
        if not is_base_url(url):
            return False
        low = url.lower()
        return low == self.own.lower() or any(fnmatch.fnmatchcase(low, p) for p in self._allowed)

    def _sign(self, method: str, target: str, body: bytes, hops: int, sent_at: int, sender: str) -> str:
        message = "\n".join((method.upper(), target, hashlib.sha256(body).hexdigest(), str(hops), str(sent_at),
                             sender)).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def signed(self, method: str, target: str, hops: int, now: float | None = None,
               body: bytes = b"") -> list[tuple[bytes, bytes]]:
        """The headers of a request this replica forwards (`hops`: its count after this forward)."""
        sent_at = int(time.time() if now is None else now)
        return [(FORWARDED.encode(), self.own.encode()), (HOPS.encode(), str(hops).encode()),
                (SENT_AT.encode(), str(sent_at).encode()),
                (SIGNATURE.encode(), self._sign(method, target, body, hops, sent_at, self.own).encode())]

    def forwarding(self, method: str, target: str, headers: Mapping[str, str],
                   now: float | None = None, body: bytes = b"") -> Forwarding | None:
        """The request's forwarding, when another replica of the set sent it (the signature checks, in time, from an
        allowed replica); None for anything else: a client's request, with or without such headers."""
        sender, hops, sent_at, signature = (headers.get(FORWARDED), headers.get(HOPS), headers.get(SENT_AT),
                                            headers.get(SIGNATURE))
        if sender is None or hops is None or sent_at is None or signature is None:
            return None
        if (not _COUNT.fullmatch(hops) or not _SECONDS.fullmatch(sent_at) or not _HEX.fullmatch(signature)
                or not self.allows(sender)):
            return None
        if abs((time.time() if now is None else now) - int(sent_at)) > SKEW_SECONDS:
            return None
        expected = self._sign(method, target, body, int(hops), int(sent_at), sender)
        if not hmac.compare_digest(expected, signature):
            return None
        return Forwarding(sender, int(hops))
