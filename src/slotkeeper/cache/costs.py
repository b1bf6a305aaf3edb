"""What a restore and a prefill cost on this backend, learned as it runs, and the rule that weighs them: a saved
state sharing fewer tokens with the request than the fixed floor the rule replaced (PRIOR_TOKENS) is restored when
bringing its bytes in costs less time than prefilling what it gives. A state sharing more is restored unless the
measure says it clearly loses: its restore costs more than SKIP_FACTOR times the prefill of what it gives, on a tier
measured often enough to be trusted (a fast GPU reading a slow disk). Where restores are as cheap as they are from
RAM, what is reused never drops.

Both costs are measured where they happen. A restore's is its wall time on the request's path (assembling the file
from blocks when it is not in the RAM dir, the backend's read, the round trip), fitted per tier as a fixed part plus
a part per byte over the most recent restores. Until the first restore, the backend's saves stand in for it, fitted
the same way: a save moves the same bytes between the slot and a file, through the same server (measured here on
`tiny`: 6.3 ms to write a 6.5 MB state, 8.0 ms to restore a 5.1 MB one), and a day's first side tasks come before
its first restore. A prefill's is what the backend reports for each turn (`timings.prompt_ms` over
`timings.prompt_n`), as milliseconds per token over the most recent turns. Until both are measured, only the prior
floor holds; an operator's `--min-restore-tokens` replaces the rule with that fixed floor.

`pays` and `floor_tokens` are pure functions of plain values (table-tested); `CostMeter` only keeps the samples.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

# The floor of shared tokens the rule replaced: a state sharing this many is always worth its restore; the measured
# costs decide below it.
PRIOR_TOKENS = 128
# Samples kept per measure: the recent past, so that a backend that slows down (a loaded machine, a longer
# context) is followed within a few dozen turns.
WINDOW = 32
# Prefills shorter than this say more about a request's fixed costs than about a token's: not counted.
MIN_PREFILL_TOKENS = 16
# Prefills needed before their cost per token is trusted. One restore is enough to start from (its time per byte,
# all of it taken as a part per byte: a small state then looks cheap, as it mostly is); a fixed part is fitted from
# two restores of different sizes on. A day's first side tasks and short chats come after a handful of turns.
MIN_PREFILLS = 3
# A state sharing PRIOR_TOKENS or more is skipped only when its restore costs more than this many times the prefill
# of what it gives. The prefill's cost per token is measured on the workload's turns, mostly short prefills of new
# messages; a long share costs more per token (attention over a longer context), so the measure errs low for it.
SKIP_FACTOR = 3.0
# Restores of a tier measured before its fit may skip a large restore: a few slow ones (a loaded machine) must not.
MIN_RESTORES_TO_SKIP = 8


class Tier(enum.IntEnum):
    """Where a state is, cheapest first."""

    SLOT = 0  # in the slot already: free
    RAM = 1  # a copy in the RAM dir: a memory copy
    DISK = 2  # a file in the slot dir (or blocks to assemble)


@dataclass(frozen=True, slots=True)
class RestoreCost:
    """A restore's time in ms: `fixed_ms` + `ms_per_byte` x its bytes."""

    fixed_ms: float
    ms_per_byte: float

    def ms(self, n_bytes: int) -> float:
        return self.fixed_ms + self.ms_per_byte * n_bytes


@dataclass(frozen=True, slots=True)
class Costs:
    """The measured costs at one moment (None: not measured yet). `bytes_per_token`: of the states restored."""

    prefill_ms_per_token: float | None = None
    restore: tuple[tuple[Tier, RestoreCost], ...] = ()
    bytes_per_token: float | None = None
    trusted: tuple[Tier, ...] = ()  # the tiers with MIN_RESTORES_TO_SKIP restores measured
    stand_in: RestoreCost | None = None  # the backend's saves' fit, until a restore is measured

    def restore_cost(self, tier: Tier) -> RestoreCost | None:
        """The tier's fit; a tier not measured yet borrows the slowest measured one (a copy in RAM is never slower
        than a file, and a guess that is too slow only keeps a prefill that was going to happen anyway); with no
        restore measured yet, the saves' fit stands in."""
        fits = dict(self.restore)
        if tier in fits:
            return fits[tier]
        if not fits:
            return self.stand_in
        return max(fits.values(), key=lambda fit: (fit.ms_per_byte, fit.fixed_ms))


def pays(shared_tokens: int, n_bytes: int, tier: Tier, costs: Costs, fixed_floor: int | None) -> bool:
    """Whether restoring a state of `n_bytes` from `tier` that gives the request `shared_tokens` is worth it: at
    PRIOR_TOKENS or more unless it costs more than SKIP_FACTOR times their prefill on a trusted tier; below, when it
    is faster than prefilling those tokens (both measured; not before they are). `fixed_floor` (the operator's
    --min-restore-tokens) replaces the rule."""
    if shared_tokens <= 0:
        return False
    if fixed_floor is not None:
        return shared_tokens >= max(fixed_floor, 1)
    if shared_tokens >= PRIOR_TOKENS:
        fitted = dict(costs.restore).get(tier)
        if tier not in costs.trusted or fitted is None or costs.prefill_ms_per_token is None:
            return True
        return fitted.ms(n_bytes) <= SKIP_FACTOR * costs.prefill_ms_per_token * shared_tokens
    restore = costs.restore_cost(tier)
    if costs.prefill_ms_per_token is None or restore is None:
        return False
    return restore.ms(n_bytes) < costs.prefill_ms_per_token * shared_tokens


def floor_tokens(costs: Costs, fixed_floor: int | None, tier: Tier = Tier.RAM) -> int:
    """The fewest tokens a state must share with a request for its restore to pay, when it holds no more than it
    shares (the best case: a state that holds more costs more bytes), and at most PRIOR_TOKENS. What keeping a
    small state (a side task's, a short chat's, a short system part's) is weighed against."""
    if fixed_floor is not None:
        return max(fixed_floor, 1)
    restore = costs.restore_cost(tier)
    if costs.prefill_ms_per_token is None or restore is None or costs.bytes_per_token is None:
        return PRIOR_TOKENS
    # fixed + per_byte * bytes_per_token * n < prefill * n  <=>  n > fixed / (prefill - per_byte * bytes_per_token)
    gain = costs.prefill_ms_per_token - restore.ms_per_byte * costs.bytes_per_token
    if gain <= 0:
        return PRIOR_TOKENS
    return min(int(restore.fixed_ms / gain) + 1, PRIOR_TOKENS)


def fit(samples: list[tuple[int, float]]) -> RestoreCost | None:
    """A fixed part and a part per byte through (bytes, ms) samples by least squares, neither below zero; with
    samples all of one size (or one sample), the time per byte of their mean. None without samples."""
    if not samples:
        return None
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((x - mean_x) ** 2 for x, _ in samples)
    if var <= 0 or mean_x <= 0:
        return RestoreCost(0.0, mean_y / mean_x) if mean_x > 0 else RestoreCost(mean_y, 0.0)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var
    if slope <= 0:
        return RestoreCost(mean_y, 0.0)  # no size effect seen: the mean, all of it fixed
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        return RestoreCost(0.0, mean_y / mean_x)
    return RestoreCost(intercept, slope)


@dataclass
class CostMeter:
    """The recent samples of this backend's restores (per tier), saves and prefills. Fed by the restorer, by the
    snapshots' writes and by the pool at each turn's end; read by the planner's rules through `now()`."""

    _restores: dict[Tier, deque[tuple[int, float]]] = field(default_factory=dict)
    _saves: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _save_sizes: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _prefills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _sizes: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _now: Costs | None = None

    def restored(self, tier: Tier, n_bytes: int, n_tokens: int, ms: float) -> None:
        if n_bytes <= 0 or ms < 0:
            return
        self._restores.setdefault(tier, deque(maxlen=WINDOW)).append((n_bytes, ms))
        if n_tokens > 0:
            self._sizes.append((n_bytes, n_tokens))
        self._now = None

    def saved(self, n_bytes: int, n_tokens: int, ms: float) -> None:
        """The backend wrote a slot's state of `n_bytes` in `ms` (the stand-in for restores until one is measured)."""
        if n_bytes <= 0 or ms < 0:
            return
        self._saves.append((n_bytes, ms))
        if n_tokens > 0:
            self._save_sizes.append((n_bytes, n_tokens))
        self._now = None

    def prefilled(self, n_tokens: int, ms: float | None) -> None:
        if ms is None or ms <= 0 or n_tokens < MIN_PREFILL_TOKENS:
            return
        self._prefills.append((n_tokens, ms))
        self._now = None

    def now(self) -> Costs:
        if self._now is None:
            self._now = self._measure()
        return self._now

    def _measure(self) -> Costs:
        prefill = None
        if len(self._prefills) >= MIN_PREFILLS:
            prefill = sum(ms for _, ms in self._prefills) / sum(n for n, _ in self._prefills)
        fits = tuple((tier, fitted) for tier, samples in sorted(self._restores.items())
                     if (fitted := fit(list(samples))) is not None)
        sizes = self._sizes or self._save_sizes
        per_token = sum(b for b, _ in sizes) / sum(t for _, t in sizes) if sizes else None
        trusted = tuple(tier for tier, samples in sorted(self._restores.items())
                        if len(samples) >= MIN_RESTORES_TO_SKIP)
        return Costs(prefill, fits, per_token, trusted, None if fits else fit(list(self._saves)))
