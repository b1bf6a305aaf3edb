"""The checker of the randomized fault test (faultrun.py): pure functions over what a run recorded, each returning
the violations it finds, in words. What they hold a run to is what docs/scale-out.md promises:

- state: a session's turn that was acknowledged (status 200) is not lost. The next acknowledged turn of the session
  reuses (`cache_n`) at least the previous turn's prompt, within SLACK tokens (a prompt under --min-restore-tokens
  is not restored, by design), unless a fault that docs/scale-out.md
  lets lose it overlapped the time between them: a backend or a replica killed (the turns since the last save or
  upload), and, when the session changed backends meanwhile, a backend or replica stopped, Redis away or the object
  store failing (the session ran elsewhere without the newest state);
- versions and leases: no manifest is ever replaced by an older version; a session's fencing tokens only grow, each
  taken once; the lease holders Redis shows only ever grow in token; no replica gives up a lease after another took
  a newer one (both held it);
  A block damaged on a backend's disk costs each session whose state names it one prefill (the restore that meets it
  quarantines it), and a block damaged in the object store one prefill of each session that moves: the first such
  loss of a session from the damage on (a turn that ran while it was made included) is excused, no other;
- failures: every request that failed, failed in its client's dialect, and only while a backend or a replica was
  down (killed or stopped, and the seconds it takes to notice and recover after).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SLACK = 8  # tokens a restore may give back (the template's last message boundary)
# A state sharing fewer tokens than this is not restored, by design (the --min-restore-tokens the run gives).
MIN_RESTORE_TOKENS = 128
# A save lands this long after its turn at most (the idle save, 0.3 s in the runs, and its commit and upload); a
# fault that began after this is not the reason a turn's state is missing.
SAVE_WINDOW_SECONDS = 5.0
# After a backend or replica is back, requests may still fail for this long (the health watch, a lease to run out,
# heartbeats to see it again).
RECOVERY_SECONDS = 20.0

KILLS = frozenset({"kill-backend", "kill-replica"})
DOWN = frozenset({"kill-backend", "kill-replica", "stop-backend", "stop-replica"})
# Faults that make a session that changed backends start from an older state: it ran where the newest was not.
MOVES = frozenset({"stop-backend", "stop-replica", "redis-down", "store-fail", "store-stall"})
DAMAGE = frozenset({"damage-block", "damage-object"})


@dataclass(frozen=True)
class Turn:
    """One request of one session, as its client saw it."""

    session: str
    started: float
    ended: float
    entered: str  # the replica the client sent it to
    status: int  # 0: no answer at all (the connection was refused or broken)
    cache_n: int = 0
    prompt: int = 0  # cache_n + prompt_n
    backend: str = ""  # the backend that ran it (X-Slotkeeper-Backend)
    dialect_error: bool = True  # a failure's body is an error in the client's dialect

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(frozen=True)
class Fault:
    kind: str  # faultrun.FAULT_KINDS
    target: str
    started: float
    ended: float  # when it was healed (the process back, the store answering again)


@dataclass(frozen=True)
class ManifestSample:
    at: float
    session: str
    version: tuple[int, int]


@dataclass(frozen=True)
class LeaseTaken:
    at: float
    session: str
    replica: str
    token: int


def _overlapping(faults: Iterable[Fault], start: float, end: float, kinds: frozenset[str]) -> list[Fault]:
    return [f for f in faults if f.kind in kinds and f.started <= end and f.ended >= start]


def _damage_excuse(faults: Sequence[Fault], before: Turn, after: Turn, used: set[tuple[str, int]]) -> bool:
    """Whether a damaged block (not yet excused for this session) may be why `after` lost what `before` had."""
    for n, fault in enumerate(faults):
        if fault.kind not in DAMAGE or fault.started >= after.ended or (after.session, n) in used:
            continue
        on_disk = fault.kind == "damage-block" and fault.target in (before.backend, after.backend)
        in_store = fault.kind == "damage-object" and after.backend != before.backend
        if on_disk or in_store:
            used.add((after.session, n))
            return True
    return False


def lost_turns(turns: Sequence[Turn], faults: Sequence[Fault]) -> list[str]:
    found = []
    used: set[tuple[str, int]] = set()  # (session, damage fault) already excused once
    by_session: dict[str, list[Turn]] = defaultdict(list)
    for turn in sorted(turns, key=lambda t: t.started):
        if turn.ok:
            by_session[turn.session].append(turn)
    for session, acked in by_session.items():
        for before, after in itertools.pairwise(acked):
            if after.cache_n >= before.prompt - SLACK or before.prompt < MIN_RESTORE_TOKENS:
                continue
            # Up to the end of the turn that lost it: a replica killed or stopped while it forwarded that very turn
            # makes it run elsewhere, without the newest state.
            window = (before.ended - SAVE_WINDOW_SECONDS, after.ended)
            excuses = _overlapping(faults, *window, KILLS)
            if after.backend != before.backend:
                excuses += _overlapping(faults, *window, MOVES)
            if not excuses and not _damage_excuse(faults, before, after, used):
                found.append(f"session {session}: the turn at {after.started:.1f} reused {after.cache_n} tokens on "
                             f"{after.backend}, the turn before it (acknowledged at {before.ended:.1f}, on "
                             f"{before.backend}) had {before.prompt}, and no fault between them may lose it")
    return found


def manifest_regressions(samples: Sequence[ManifestSample]) -> list[str]:
    found = []
    newest: dict[str, ManifestSample] = {}
    for sample in sorted(samples, key=lambda s: s.at):
        seen = newest.get(sample.session)
        if seen is not None and sample.version < seen.version:
            found.append(f"session {sample.session}: its manifest went back from version {seen.version} (read at "
                         f"{seen.at:.1f}) to {sample.version} (read at {sample.at:.1f})")
        if seen is None or sample.version > seen.version:
            newest[sample.session] = sample
    return found


def token_order(taken: Sequence[LeaseTaken], held: Sequence[ManifestSample] = ()) -> list[str]:
    """Fencing tokens only grow per session and none is taken twice; `held` are the lease holders' tokens read from
    Redis over time (as samples whose version is (token, 0)): they only grow too."""
    found = []
    by_session: dict[str, list[LeaseTaken]] = defaultdict(list)
    for lease in sorted(taken, key=lambda t: (t.at, t.token)):
        by_session[lease.session].append(lease)
    for session, leases in by_session.items():
        tokens = [lease.token for lease in leases]
        if len(set(tokens)) != len(tokens):
            found.append(f"session {session}: a fencing token was taken twice: {tokens}")
        for before, after in itertools.pairwise(leases):
            if after.token <= before.token and after.at - before.at > 0.05:  # log lines within 50 ms: same moment
                found.append(f"session {session}: token {after.token} ({after.replica}, at {after.at:.2f}) was "
                             f"taken after token {before.token} ({before.replica}, at {before.at:.2f})")
    found += [f"lease holders in Redis: {v}" for v in manifest_regressions(held)]
    return found


def overlapping_leases(taken: Sequence[LeaseTaken], given_up: Sequence[LeaseTaken],
                       faults: Sequence[Fault]) -> list[str]:
    """No two replicas hold one session's lease at once: a replica that gives a lease up (it believed it held it
    until then) after another replica took a newer token for the session held it at the same time, unless it was
    killed in between (its new process does not know the old lease; it never logs giving it up)."""
    found = []
    for up in given_up:
        for other in taken:
            if (other.session != up.session or other.replica == up.replica or other.token <= up.token
                    or other.at >= up.at - 0.05):
                continue
            killed = [f for f in faults if f.kind == "kill-replica" and f.target == up.replica
                      and other.at - 1 <= f.started <= up.at]
            if not killed:
                found.append(f"session {up.session}: replica {up.replica} gave up token {up.token} at {up.at:.2f}, "
                             f"after replica {other.replica} took token {other.token} at {other.at:.2f}: both held "
                             f"the lease")
    return found


def failures(turns: Sequence[Turn], faults: Sequence[Fault]) -> list[str]:
    found = []
    for turn in turns:
        if turn.ok:
            continue
        if not turn.dialect_error and turn.status != 0:
            found.append(f"session {turn.session}: a request at {turn.started:.1f} failed with {turn.status} and a "
                         f"body that is not an error in its client's dialect")
        down = [f for f in faults if f.kind in DOWN and f.started - 1 <= turn.ended
                and f.ended + RECOVERY_SECONDS >= turn.started]
        if not down:
            found.append(f"session {turn.session}: a request at {turn.started:.1f}-{turn.ended:.1f} failed "
                         f"(status {turn.status}) while no backend or replica was down")
    return found


def check(turns: Sequence[Turn], faults: Sequence[Fault], manifests: Sequence[ManifestSample],
          leases: Sequence[LeaseTaken], holders: Sequence[ManifestSample],
          given_up: Sequence[LeaseTaken] = ()) -> list[str]:
    """Every violation of the run, in words; empty when it kept every promise."""
    return (lost_turns(turns, faults) + manifest_regressions(manifests) + token_order(leases, holders)
            + overlapping_leases(leases, given_up, faults) + failures(turns, faults))
