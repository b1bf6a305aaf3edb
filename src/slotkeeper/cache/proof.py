"""Proof of reuse: after each restore, did the backend reuse what the restore owed it?

A restore owes the tokens the request's prompt shares with the restored state, never generated tokens the client
did not send back (clients of reasoning models drop the thinking). Restores that keep failing that test move the
backend to the next strategy (restore anything -> save at prompt end -> keep sessions hot), said once in the log;
after a while one restore is tried again, and a good one moves the backend back. Saving is never switched off.
Pure values and arithmetic: the pool feeds it, tests drive it directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from slotkeeper.cache.capability import Capability, Strategy

log = logging.getLogger("slotkeeper.pool")

# A restore helped when the backend reused at least this share of what it owed (owed counts are estimates where
# a history was edited: message-level chains, shares of characters).
HELPED_SHARE = 0.5
# ... or at least all of it but this many tokens (a re-rendered last message may differ in its first tokens).
HELPED_SLACK = 8
# Restores that did not help, in a row, before the backend moves to the next strategy.
FALLBACK_AFTER = 3
# Restores the planner would have made under a fallback before it tries one again.
RECHECK_AFTER = 20

_ORDER = (Strategy.RESTORE, Strategy.PROMPT_END, Strategy.KEEP_HOT)


def helped(owed: int, cache_n: int) -> bool:
    """Whether a restore that owed `owed` tokens helped a turn that reused `cache_n`: reusing half of it, or all of
    it but a few tokens, will do, and at least one token."""
    return cache_n >= max(1.0, min(owed * HELPED_SHARE, owed - HELPED_SLACK))


@dataclass
class RestorePolicy:
    """The strategy in force on one backend: the one its capability calls for, or a later one the proof of reuse
    fell back to. Counters are exported as metrics."""

    capability: Capability
    fallback: Strategy | None = None  # set when restores under the capability's own strategy did not help
    effective: int = 0
    ineffective: int = 0
    ineffective_in_a_row: int = 0
    fallbacks: int = 0
    _skipped: int = 0  # restores not made under the fallback since it began or since the last trial
    _trial: bool = False  # the next restore is a trial of the strategy before the fallback

    @property
    def strategy(self) -> Strategy:
        """The strategy the planner uses now (a trial restore uses the one before the fallback)."""
        if self.fallback is None:
            return self.capability.strategy
        return self._previous(self.fallback) if self._trial else self.fallback

    def _previous(self, strategy: Strategy) -> Strategy:
        base = self.capability.strategy
        earlier = _ORDER[max(_ORDER.index(strategy) - 1, 0)]
        return base if _ORDER.index(earlier) <= _ORDER.index(base) else earlier

    @property
    def restores_allowed(self) -> bool:
        return self.strategy is not Strategy.KEEP_HOT

    @property
    def prompt_end_saves(self) -> bool:
        """Bring a slot back to the end of its last prompt before saving it."""
        return self.capability.strategy is Strategy.PROMPT_END or self.fallback in (Strategy.PROMPT_END,
                                                                                     Strategy.KEEP_HOT)

    @property
    def effective_now(self) -> bool:
        """False while the proof of reuse keeps the backend on a fallback."""
        return self.fallback is None

    def reason(self) -> str:
        if self.fallback is None:
            return self.capability.reason()
        return (f"{self.ineffective} restore(s) were not reused by the backend, so slotkeeper uses the "
                f"{self.fallback} strategy for now and tries a restore again after {RECHECK_AFTER} chances; "
                f"{self.capability.reason()}")

    def learned(self, capability: Capability) -> None:
        """A saved file told more about the build (checkpoints seen in it)."""
        if capability != self.capability:
            self.capability = capability
            log.info("restores: %s", capability.reason())

    def skipped(self) -> None:
        """The planner would have restored a state but the fallback held it back."""
        if self.fallback is None or self._trial:
            return
        self._skipped += 1
        if self._skipped >= RECHECK_AFTER:
            self._skipped = 0
            self._trial = True

    def judged(self, owed: int, cache_n: int) -> bool:
        """Record how a restore did; returns whether it helped."""
        trial, self._trial = self._trial, False
        if helped(owed, cache_n):
            self.effective += 1
            self.ineffective_in_a_row = 0
            if trial and self.fallback is not None:
                earlier = self._previous(self.fallback)
                self.fallback = None if earlier is self.capability.strategy else earlier
                log.warning("a trial restore was reused (%d of %d tokens owed): back to the %s strategy", cache_n,
                            owed, self.strategy)
            return True
        self.ineffective += 1
        self.ineffective_in_a_row += 1
        if not trial and self.ineffective_in_a_row >= FALLBACK_AFTER:
            self._fall_back()
        return False

    def _fall_back(self) -> None:
        self.ineffective_in_a_row = 0
        self._skipped = 0
        current = self.strategy
        if current is Strategy.KEEP_HOT:
            return
        self.fallback = _ORDER[_ORDER.index(current) + 1]
        self.fallbacks += 1
        log.error("restores do not help on this backend (%d restore(s) reused less than they shared with the "
                  "request): slotkeeper now uses the %s strategy (%s), saves every session as before, and tries a "
                  "restore again after %d chances", self.ineffective, self.fallback,
                  "save each slot at the end of its last prompt, restore only what a request extends"
                  if self.fallback is Strategy.PROMPT_END else "keep sessions hot in their slots", RECHECK_AFTER)
