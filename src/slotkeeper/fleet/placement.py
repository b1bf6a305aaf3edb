"""Which backend a session goes to when one model has several: consistent hashing with bounded load, and sticky
owners.

A session keeps its owner while the owner is up and not overloaded: that is where its state is. A session without
an owner (new, or its owner is down or overloaded) walks the hash ring from its ring key and takes the first backend
that is up and under the load bound. The ring key of a conversation without an id of its own is its system prompt's
group (`sys-<hash>`), so conversations on one system prompt land where that prompt is warm until the bound sends
some elsewhere.

The load of a backend is the number of active sessions it owns: sessions that sent a request within
`ACTIVE_SECONDS`. The bound is `load_factor` times the mean over the backends that are up, rounded up, counting the
session being placed: with the default 1.25, no backend owns more than 1.25 times the mean (plus one, rounding).

Pure bookkeeping: no I/O, the clock is passed in. The ring is uhashring's (ketama, as in vLLM's production stack's
session router), so every replica that knows the same backends computes the same order.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from uhashring import HashRing

# A session that sent nothing for this long no longer counts toward its owner's load (it keeps its owner).
ACTIVE_SECONDS = 600.0
# An owner unused for this long is forgotten (memory stays bounded); the session's next turn is placed again, and
# its snapshot comes along from the backend that has it (group.py).
FORGET_SECONDS = 86400.0
_SWEEP_EVERY = 1024


class Placed(StrEnum):
    """Why a session went where it did."""

    OWNER = "owner"  # it stays where its state is
    NEW = "new"  # it had no owner: the first backend on its ring walk under the bound
    OWNER_DOWN = "owner down"  # its owner is down: moved
    OVERLOADED = "owner overloaded"  # its owner holds more than the bound: moved
    DRAINING = "owner draining"  # an operator is taking its owner out of service: moved
    DIRECTORY = "placed by the session directory"  # the replicas' shared directory chose another backend


@dataclass(frozen=True)
class Choice:
    member: str
    why: Placed
    previous: str | None  # the owner before this choice (None for a new session)

    @property
    def moved(self) -> bool:
        return self.previous is not None and self.previous != self.member


@dataclass
class _Owned:
    member: str
    last_used: float


class Placement:
    """The owners of one model's sessions among its backends (`members`: stable names, the backends' URLs)."""

    def __init__(self, members: Sequence[str], load_factor: float = 1.25) -> None:
        assert members and load_factor >= 1.0  # the settings are checked before (Settings.validate)
        self.members = tuple(members)
        self.load_factor = load_factor
        self._ring = HashRing(nodes=list(self.members))
        self._owners: dict[str, _Owned] = {}
        self._records = 0
        # Backends an operator is taking out of service: no new sessions, and theirs move at their next turn.
        self.draining: set[str] = set()

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, session: str) -> str | None:
        owned = self._owners.get(session)
        return None if owned is None else owned.member

    def learn(self, session: str, member: str, last_used: float) -> None:
        """A session whose state `member` holds (found on its disk at start-up); the newest holder wins."""
        if member not in self.members:
            return
        owned = self._owners.get(session)
        if owned is None or last_used > owned.last_used:
            self._owners[session] = _Owned(member, last_used)

    def loads(self, now: float) -> dict[str, int]:
        """Active sessions per backend."""
        counts = dict.fromkeys(self.members, 0)
        for owned in self._owners.values():
            if now - owned.last_used < ACTIVE_SECONDS:
                counts[owned.member] += 1
        return counts

    def bound(self, loads: dict[str, int], up: Collection[str], extra: int) -> int:
        """The most active sessions a backend that is up may own, `extra` sessions being added to the total."""
        total = sum(loads[m] for m in up) + extra
        return max(1, math.ceil(self.load_factor * total / max(1, len(up))))

    def walk(self, ring_key: str) -> list[str]:
        """Every backend, in the order the ring gives for `ring_key`."""
        return [str(node) for node in self._ring.iterate_nodes(ring_key)]

    def place(self, session: str, ring_key: str, up: Iterable[str], now: float,
              exclude: Collection[str] = ()) -> Choice:
        """The backend for a request of `session` now, recorded as its owner. `up`: the backends that serve now
        (when none does, the choice ignores health: the request then waits for its backend); `exclude`: backends
        not to take this time (one that just refused the request)."""
        owned = self._owners.get(session)
        previous = None if owned is None else owned.member
        active = owned is not None and now - owned.last_used < ACTIVE_SECONDS
        return self._record(session, self.choose(ring_key, previous, active, self.loads(now), up, exclude), now)

    def choose(self, ring_key: str, previous: str | None, active: bool, loads: dict[str, int], up: Iterable[str],
               exclude: Collection[str] = (), sticky: bool = False) -> Choice:
        """The backend for a session whose owner is `previous` (`active`: it counts in `loads`, the active sessions
        per backend), recording nothing: its owner while that serves and is within the bound (`sticky`: while it
        serves), else the first backend on its ring walk under the bound."""
        alive = [m for m in self.members if m in set(up) and m not in exclude]
        serving = [m for m in alive if m not in self.draining]
        candidates = serving or alive or [m for m in self.members if m not in exclude] or list(self.members)
        loads = {m: loads.get(m, 0) for m in self.members}
        if previous is not None and previous in candidates:
            # Its own active session is in the load already; an idle one comes back to it.
            if sticky or loads[previous] + (0 if active else 1) <= self.bound(loads, candidates, 0 if active else 1):
                return Choice(previous, Placed.OWNER, previous)
            why = Placed.OVERLOADED
        elif previous is not None:
            why = Placed.DRAINING if previous in self.draining else Placed.OWNER_DOWN
        else:
            why = Placed.NEW
        if previous is not None and active and previous in loads:
            loads[previous] -= 1  # it leaves its owner
        limit = self.bound(loads, candidates, 1)
        order = [m for m in self.walk(ring_key) if m in candidates]
        chosen = next((m for m in order if m != previous and loads[m] + 1 <= limit), None)
        if chosen is None:  # only the previous owner is under the bound, or every backend is at it
            chosen = min(order, key=lambda m: loads[m])
        if chosen == previous:
            return Choice(chosen, Placed.OWNER, previous)
        return Choice(chosen, why, previous)

    def assign(self, session: str, member: str, now: float) -> Choice:
        """Record `member` as the owner of `session`, chosen elsewhere (by the session directory that several
        replicas share)."""
        previous = self.owner(session)
        why = Placed.OWNER if previous == member else Placed.NEW if previous is None else Placed.DIRECTORY
        return self._record(session, Choice(member, why, previous), now)

    def peek(self, session: str, ring_key: str, up: Iterable[str]) -> str:
        """Where a request of `session` that is not a turn of it goes (a side task: a title or tags request), without
        recording anything: its owner when that is up, else the first backend up on its ring walk."""
        alive = set(up)
        owner = self.owner(session)
        if owner is not None and owner in alive:
            return owner
        return next((m for m in self.walk(ring_key) if m in alive), owner or self.walk(ring_key)[0])

    def _record(self, session: str, choice: Choice, now: float) -> Choice:
        self._owners[session] = _Owned(choice.member, now)
        self._records += 1
        if self._records % _SWEEP_EVERY == 0:
            for old in [s for s, o in self._owners.items() if now - o.last_used > FORGET_SECONDS]:
                del self._owners[old]
        return choice

    def forget(self, session: str) -> None:
        self._owners.pop(session, None)
