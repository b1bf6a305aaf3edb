"""Side states: what side tasks (OpenWebUI's titles, tags and follow-ups; an agent's one-off requests) leave in a
slot, kept as saved states of their own kind so that the next task that starts the same way starts from them. They
are found like every other state, by the tokens they share with a request; their names are ours, under a prefix no
client may use (identity.py), and the disk budget keeps the last few per model (budget.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from slotkeeper.cache.chain import Link
from slotkeeper.types import IdSource, SessionKey

# Side states kept per model; the least recently used go first (the disk budget's rule for the side kind). A chat
# turn in OpenWebUI leaves up to three (title, tags, follow-ups), and what its next tasks start from is its latest
# follow-up's state: 32 keeps that for the last ten or more chats. 8 lost them within one busy minute (bench `day`:
# the follow-ups after the restart prefilled their chats' history again).
KEPT = 32
# The session ids of side states: a prefix slotkeeper reserves for the names it makes itself (no client's id may
# start with it, identity.py).
RESERVED_PREFIX = _PREFIX = "~side-"
_ID = re.compile(r"~side-[0-9a-f]{16}")


def is_side_key(session_id: str) -> bool:
    return _ID.fullmatch(session_id) is not None


def side_key(owner: SessionKey, chain: Sequence[Link]) -> SessionKey:
    """The name of the side state a task of this message chain leaves (in the model and cache domain of `owner`,
    the request's session): a hash of the chain's last position (which covers the tools and every message)."""
    digest = hashlib.sha256(chain[-1].digest.encode() if chain else b"").hexdigest()[:16]
    return owner.within(_PREFIX + digest, IdSource.ROUTE)
