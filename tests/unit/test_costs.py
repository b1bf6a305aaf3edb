"""When a restore pays: its measured cost against a prefill's (cache/costs.py), and the planner's use of it."""

from __future__ import annotations

import dataclasses

import pytest

from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.costs import (
    MIN_PREFILL_TOKENS,
    MIN_RESTORES_TO_SKIP,
    PRIOR_TOKENS,
    WINDOW,
    CostMeter,
    Costs,
    RestoreCost,
    Tier,
    fit,
    floor_tokens,
    pays,
)
from slotkeeper.cache.planner import Candidate, InSlot, Request, Rules, Why, plan
from slotkeeper.types import Snapshot

MIB = 2**20
# A backend where a restore costs 5 ms plus 1 ms per MiB from RAM (4 ms per MiB from disk), a prefill 0.2 ms a
# token, and a token's KV 2 KiB.
MEASURED = Costs(0.2, ((Tier.RAM, RestoreCost(5.0, 1.0 / MIB)), (Tier.DISK, RestoreCost(8.0, 4.0 / MIB))), 2048.0)
# The same, each tier measured often enough for a large restore to be skipped when it clearly loses.
TRUSTED = dataclasses.replace(MEASURED, trusted=(Tier.RAM, Tier.DISK))


@pytest.mark.parametrize(("shared", "n_bytes", "tier", "costs", "fixed", "expected"), [
    # nothing shared never pays
    (0, 1000, Tier.RAM, MEASURED, None, False),
    (0, 1000, Tier.RAM, MEASURED, 0, False),
    # the operator's fixed floor replaces the measured rule, whatever the bytes
    (100, 100 * MIB, Tier.DISK, MEASURED, 100, True),
    (99, 1000, Tier.RAM, MEASURED, 100, False),
    (1, 1000, Tier.RAM, MEASURED, 0, True),  # 0: every restore
    # nothing measured yet: the prior floor
    (PRIOR_TOKENS, 100 * MIB, Tier.RAM, Costs(), None, True),
    (PRIOR_TOKENS - 1, 1000, Tier.RAM, Costs(), None, False),
    (PRIOR_TOKENS - 1, 1000, Tier.RAM, Costs(prefill_ms_per_token=0.2), None, False),  # no restore measured
    # measured: 1 MiB from RAM costs 6 ms; 100 tokens of prefill 20 ms, 20 tokens 4 ms
    (100, MIB, Tier.RAM, MEASURED, None, True),
    (20, MIB, Tier.RAM, MEASURED, None, False),
    (29, MIB, Tier.RAM, MEASURED, None, False),  # 6 ms against 5.8 ms
    (31, MIB, Tier.RAM, MEASURED, None, True),
    # the same share from a large state does not pay: 40 MiB cost 45 ms, more than 100 tokens' 20 ms
    (100, 40 * MIB, Tier.RAM, MEASURED, None, False),
    (100, 10 * MIB, Tier.RAM, MEASURED, None, True),
    # at PRIOR_TOKENS and more a restore is made, whatever it costs, until its tier was measured often enough
    (PRIOR_TOKENS, 400 * MIB, Tier.DISK, MEASURED, None, True),
    # then it is skipped only when it costs more than SKIP_FACTOR x the prefill: 400 MiB from disk 1,608 ms against
    # 128 tokens' 25.6 ms (x3: 76.8 ms); 10 MiB from disk 48 ms, less than 76.8 ms: still made, though it loses
    (PRIOR_TOKENS, 400 * MIB, Tier.DISK, TRUSTED, None, False),
    (PRIOR_TOKENS, 10 * MIB, Tier.DISK, TRUSTED, None, True),
    (PRIOR_TOKENS, 17 * MIB, Tier.DISK, TRUSTED, None, True),  # 76 ms: at most 3 x 25.6 ms
    (PRIOR_TOKENS, 18 * MIB, Tier.DISK, TRUSTED, None, False),  # 80 ms: more
    (1000, 400 * MIB, Tier.DISK, TRUSTED, None, False),  # 1,608 ms against 200 ms x 3
    (3000, 400 * MIB, Tier.DISK, TRUSTED, None, True),  # 1,608 ms against 600 ms x 3
    # a trusted tier decides for itself only: RAM trusted says nothing of a disk restore, and no prefill measured
    # yet, or an operator's floor, keeps it
    (PRIOR_TOKENS, 400 * MIB, Tier.DISK, dataclasses.replace(MEASURED, trusted=(Tier.RAM,)), None, True),
    (PRIOR_TOKENS, 400 * MIB, Tier.DISK, dataclasses.replace(TRUSTED, prefill_ms_per_token=None), None, True),
    (PRIOR_TOKENS, 400 * MIB, Tier.DISK, TRUSTED, 100, True),
    # from disk it costs more: 1 MiB 12 ms
    (50, MIB, Tier.DISK, MEASURED, None, False),
    (61, MIB, Tier.DISK, MEASURED, None, True),
    # a tier not measured borrows the slowest measured one
    (50, MIB, Tier.RAM, Costs(0.2, ((Tier.DISK, RestoreCost(8.0, 4.0 / MIB)),)), None, False),
    # no restore measured yet: the saves' fit stands in (1 MiB written in 6 ms: 100 tokens' 20 ms pays, 20 tokens'
    # 4 ms does not); a measured restore, on any tier, replaces it
    (100, MIB, Tier.RAM, Costs(0.2, stand_in=RestoreCost(5.0, 1.0 / MIB)), None, True),
    (20, MIB, Tier.DISK, Costs(0.2, stand_in=RestoreCost(5.0, 1.0 / MIB)), None, False),
    (100, MIB, Tier.RAM, Costs(stand_in=RestoreCost(5.0, 1.0 / MIB)), None, False),  # no prefill measured
    (100, MIB, Tier.RAM, Costs(0.2, ((Tier.DISK, RestoreCost(30.0, 0.0)),), stand_in=RestoreCost(5.0, 0.0)), None,
     False),
])
def test_a_restore_pays_when_it_costs_less_than_the_prefill_it_saves(
        shared: int, n_bytes: int, tier: Tier, costs: Costs, fixed: int | None, expected: bool) -> None:
    assert pays(shared, n_bytes, tier, costs, fixed) is expected


@pytest.mark.parametrize(("costs", "fixed", "expected"), [
    (MEASURED, 256, 256),
    (MEASURED, 0, 1),
    (Costs(), None, PRIOR_TOKENS),
    (Costs(0.2, ((Tier.RAM, RestoreCost(5.0, 1.0 / MIB)),)), None, PRIOR_TOKENS),  # no size per token yet
    # 5 ms fixed, a token 0.2 ms to prefill and 2 KiB x 1 ms/MiB (about 0.002 ms) to restore: 26 tokens and up
    (MEASURED, None, 26),
    # a restore costs more per token than a prefill, or more than PRIOR_TOKENS are needed: the prior floor
    (Costs(0.001, ((Tier.RAM, RestoreCost(5.0, 1.0 / MIB)),), 2048.0), None, PRIOR_TOKENS),
    (Costs(0.02, ((Tier.RAM, RestoreCost(5.0, 1.0 / MIB)),), 2048.0), None, PRIOR_TOKENS),
    # no fixed cost: any state pays
    (Costs(0.2, ((Tier.RAM, RestoreCost(0.0, 1.0 / MIB)),), 2048.0), None, 1),
])
def test_the_floor_is_where_a_state_that_holds_what_it_shares_starts_to_pay(
        costs: Costs, fixed: int | None, expected: int) -> None:
    assert floor_tokens(costs, fixed) == expected


def test_the_floor_agrees_with_the_rule() -> None:
    floor = floor_tokens(MEASURED, None)
    assert pays(floor, int(floor * 2048), Tier.RAM, MEASURED, None)
    assert not pays(floor - 1, int((floor - 1) * 2048), Tier.RAM, MEASURED, None)


@pytest.mark.parametrize(("samples", "expected"), [
    ([], None),
    ([(1000, 2.0)], RestoreCost(0.0, 0.002)),  # one: all of it per byte
    ([(1000, 2.0), (2000, 3.0)], RestoreCost(1.0, 0.001)),  # two: a line
    ([(1000, 2.0), (2000, 3.0), (3000, 4.0)], RestoreCost(1.0, 0.001)),  # a line
    ([(1000, 2.0), (1000, 4.0), (1000, 3.0)], RestoreCost(0.0, 0.003)),  # one size: its mean per byte
    ([(1000, 4.0), (2000, 3.0), (3000, 2.0)], RestoreCost(3.0, 0.0)),  # larger is faster: all of it fixed
    ([(1000, 0.5), (2000, 3.0), (3000, 5.5)], RestoreCost(0.0, 0.0015)),  # would start below zero: through 0
])
def test_restore_cost_fits(samples: list[tuple[int, float]], expected: RestoreCost | None) -> None:
    got = fit(samples)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert got.fixed_ms == pytest.approx(expected.fixed_ms)
        assert got.ms_per_byte == pytest.approx(expected.ms_per_byte)


def test_the_meter_learns_from_restores_and_prefills() -> None:
    meter = CostMeter()
    assert meter.now() == Costs()
    for n in (1, 2, 3):
        meter.restored(Tier.RAM, n * MIB, n * 512, 5.0 + n)
        meter.prefilled(100 * n, 20.0 * n)
    meter.prefilled(MIN_PREFILL_TOKENS - 1, 1000.0)  # too short to say what a token costs
    meter.prefilled(100, None)  # no timings
    costs = meter.now()
    assert costs.prefill_ms_per_token == pytest.approx(0.2)
    assert costs.bytes_per_token == pytest.approx(2048.0)
    ram = costs.restore_cost(Tier.RAM)
    assert ram is not None
    assert ram.fixed_ms == pytest.approx(5.0)
    assert ram.ms_per_byte == pytest.approx(1.0 / MIB)
    assert costs.restore_cost(Tier.DISK) == ram  # borrowed
    assert floor_tokens(costs, None) == 26


def test_the_backends_saves_stand_in_for_restores_until_one_is_measured() -> None:
    """A day's first side tasks come before its first restore: what the backend's writes cost says whether a small
    state pays (a save moves the same bytes, through the same server), and says nothing more once a restore says."""
    meter = CostMeter()
    for n in (1, 2, 3):
        meter.saved(n * MIB, n * 512, 5.0 + n)
        meter.prefilled(100 * n, 20.0 * n)
    meter.saved(0, 0, 1.0)  # a write that moved nothing says nothing
    costs = meter.now()
    assert costs.restore == () and costs.trusted == ()
    assert costs.stand_in == RestoreCost(pytest.approx(5.0), pytest.approx(1.0 / MIB))  # type: ignore[arg-type]
    assert costs.restore_cost(Tier.RAM) == costs.restore_cost(Tier.DISK) == costs.stand_in
    assert costs.bytes_per_token == pytest.approx(2048.0)
    assert floor_tokens(costs, None) == 26 < PRIOR_TOKENS
    assert pays(100, MIB, Tier.RAM, costs, None) and not pays(20, MIB, Tier.RAM, costs, None)
    meter.restored(Tier.RAM, 4 * MIB, 2048, 120.0)  # the first restore: far slower than the writes said
    costs = meter.now()
    assert costs.stand_in is None and costs.restore_cost(Tier.DISK) == RestoreCost(0.0, 30.0 / MIB)
    assert not pays(100, MIB, Tier.RAM, costs, None)  # 1 MiB now costs 30 ms, more than 100 tokens' 20 ms


def test_a_tier_is_trusted_to_skip_a_large_restore_after_enough_restores() -> None:
    meter = CostMeter()
    for n in range(MIN_RESTORES_TO_SKIP - 1):
        meter.restored(Tier.DISK, (n + 1) * MIB, 512, 8.0 + 4.0 * (n + 1))
    assert meter.now().trusted == ()
    meter.restored(Tier.RAM, MIB, 512, 6.0)
    assert meter.now().trusted == ()  # counted per tier
    meter.restored(Tier.DISK, MIB, 512, 12.0)
    assert meter.now().trusted == (Tier.DISK,)


def test_the_meter_follows_the_recent_past() -> None:
    meter = CostMeter()
    for _ in range(WINDOW):
        meter.prefilled(100, 100.0)  # 1 ms a token
    for _ in range(WINDOW):
        meter.prefilled(100, 10.0)  # the backend got faster
    assert meter.now().prefill_ms_per_token == pytest.approx(0.1)


def snapshot(session: str, n_tokens: int, n_bytes: int) -> Snapshot:
    return Snapshot("m", session, f"{session}.bin", "fp", n_tokens, n_bytes, "c", 0.0, 0.0, 0)


def candidate(session: str, shared: int, n_tokens: int, n_bytes: int, tier: Tier = Tier.RAM) -> Candidate:
    return Candidate(snapshot(session, n_tokens, n_bytes), 1, shared, False, exact=True, tier=tier)


def test_the_planner_restores_only_what_pays() -> None:
    rules = Rules(Strategy.RESTORE, None, costs=MEASURED)
    small = candidate("small", 84, 100, 100 * 2048)
    # a short chat's second turn: 84 shared tokens of a 100-token state pay (5.2 ms against 16.8 ms)
    chosen = plan(Request(3), rules, InSlot(), [small])
    assert chosen.restore is not None and chosen.restore.snapshot.session_id == "small"
    # the same share from a state 40 MiB large does not (45 ms against 16.8 ms): a prefill, and why
    big = candidate("big", 84, 20000, 40 * MIB)
    chosen = plan(Request(3), rules, InSlot(), [big])
    assert chosen.restore is None and chosen.why is Why.TOO_SHORT
    # sharing PRIOR_TOKENS, it is restored as it always was, until its tier's cost is trusted: 45 ms against 3 x
    # 25.6 ms is made; 400 MiB (405 ms) is not
    assert plan(Request(3), rules, InSlot(), [candidate("big", PRIOR_TOKENS, 20000, 40 * MIB)]).restore is not None
    trusted = Rules(Strategy.RESTORE, None, costs=TRUSTED)
    assert plan(Request(3), trusted, InSlot(), [candidate("big", PRIOR_TOKENS, 20000, 40 * MIB)]).restore is not None
    huge = plan(Request(3), trusted, InSlot(), [candidate("huge", PRIOR_TOKENS, 200000, 400 * MIB)])
    assert huge.restore is None and huge.why is Why.TOO_SHORT
    # under the old fixed floor of 128 tokens neither was restored
    assert plan(Request(3), Rules(Strategy.RESTORE, 128), InSlot(), [small]).restore is None


def test_what_the_slot_already_gives_is_not_paid_for_again() -> None:
    rules = Rules(Strategy.RESTORE, None, costs=MEASURED)
    # 50 tokens in the slot, a 2 MiB state sharing 100: 50 tokens more (10 ms) for a 7 ms restore: it pays
    assert plan(Request(3), rules, InSlot(50, 2), [candidate("a", 100, 100, 2 * MIB)]).restore is not None
    # 70 in the slot: 30 tokens more (6 ms) for 7 ms: the slot's content is kept
    chosen = plan(Request(3), rules, InSlot(70, 2), [candidate("a", 100, 100, 2 * MIB)])
    assert chosen.restore is None and chosen.why is Why.IN_SLOT
    # a state sharing PRIOR_TOKENS or more is weighed as it always was: by the tokens beyond a near-tie
    assert plan(Request(3), rules, InSlot(1000, 2), [candidate("a", 1010, 1010, 2 * MIB)]).restore is not None
