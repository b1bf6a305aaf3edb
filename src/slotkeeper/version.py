"""The version of a saved state, and the one rule that says which of two copies is newer.

Every committed state has a version: the fencing token of the session's lease when it was saved (the session
directory of several replicas; 0 without one) and a stamp, the save's time in microseconds, made to grow past every
version of the state this host knew before. A copy is newer than another when its fencing token is larger, or, under
the same token, when its stamp is. So:
- a save made under a newer lease wins over every save made under an older one, whatever the clocks say;
- under one lease (one replica, its backends; or no directory) saves are ordered by the clock of the host that made
  them, and a save on a host never gets a version below one that host already had for the state.

A copy brought in (from the shared tier, another backend, a bundle) keeps its version; the index refuses to let it
replace a newer one (index.py), the shared tier refuses to let an upload replace a newer manifest (shared.py), and a
moving session takes its newest copy (group.py): all through `newer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True, slots=True)
class Version:
    fence: int = 0  # the lease's fencing token (0: saved without a directory, or before versions existed)
    stamp: int = 0  # microseconds since the epoch, growing per state on the host that saved it

    def to_json(self) -> list[int]:
        return [self.fence, self.stamp]

    @classmethod
    def from_json(cls, data: Any) -> Version:
        """A version as written by `to_json`; anything else (absent, from before versions, malformed) is the
        oldest version."""
        if (isinstance(data, list) and len(data) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in data)):
            return cls(data[0], data[1])
        return UNVERSIONED

    def __str__(self) -> str:
        return f"{self.fence}.{self.stamp}"


# States saved before versions existed: older than every versioned one.
UNVERSIONED = Version(0, 0)


def newer(a: Version, b: Version | None) -> bool:
    """Whether a copy at version `a` is newer than one at `b` (None: there is no other copy)."""
    return b is None or a > b


def next_version(previous: Version | None, fence: int | None, now: float | None = None) -> Version:
    """The version of a new save of a state whose newest known version is `previous`, made under fencing token
    `fence` (None: no lease known now, e.g. the directory is down): newer than `previous` in every case."""
    stamp = int((time.time() if now is None else now) * 1_000_000)
    if previous is None:
        return Version(max(fence or 0, 0), stamp)
    token = max(fence or 0, previous.fence)
    return Version(token, stamp if token > previous.fence else max(stamp, previous.stamp + 1))
