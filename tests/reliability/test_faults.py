"""The randomized fault test (faultrun.py), short: 40 s of faults on each kind of backend, and the checker
(faultcheck.py) finds no violation. The 30-minute runs by hand, their seeds and numbers are in docs/reliability.md.
The checker itself is tested on histories made by hand: each rule finds what it is for, and lets be what the
documented faults may lose."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.faultcheck import (
    SLACK,
    Fault,
    LeaseTaken,
    ManifestSample,
    Turn,
    failures,
    lost_turns,
    manifest_regressions,
    overlapping_leases,
    token_order,
)
from tests.reliability.faultrun import FAULT_KINDS, run, schedule
from tests.support import Backend

# Printed by every run; a failing seed replays its schedule: python -m tests.reliability.faultrun --seed N. Each seed
# here once failed: 1323334352 (a fresh seed in CI, embedded) lost a turn to Redis being away, when a replica brought
# an older version of a session, newer by its lease, over the copy it had made since; 2812 (CI, embedded) had a block
# damaged 9 ms after a turn began, which cost that turn its restore, and the check excused only turns begun after;
# 920808289 (CI, embedded) lost a session's turn twice to one damaged block: a move off the backend met the block
# while copying the state out and left it in place, and a state of the same bytes later named it again. Each runs on
# the kind of backend it failed on (the fresh seed below covers both kinds on every run).
SEEDS = [(2812, "embedded"), (1323334352, "embedded"), (920808289, "embedded")]


@pytest.mark.backend
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("seed", "backend_kind"), SEEDS)
def test_a_short_run_of_faults_breaks_no_promise(tmp_path: Path, backend_kind: str, tiny_model: Path,
                                                 seed: int) -> None:
    result = run(tmp_path, tiny_model, backend_kind, seed, seconds=40)
    assert result.violations == []
    assert result.n_faults >= 4 and result.acknowledged >= 40, result


@pytest.mark.backend
@pytest.mark.timeout(420)
def test_a_short_run_with_a_fresh_seed_breaks_no_promise(tmp_path: Path, backend_kind: str,
                                                         tiny_model: Path) -> None:
    """The same with a seed drawn now (SLOTKEEPER_FAULT_SEED replays one). A seed that fails becomes a fixed case
    here; its run's logs stay in `tmp_path` (pytest keeps the last three sessions' directories)."""
    seed = int(os.environ.get("SLOTKEEPER_FAULT_SEED") or random.SystemRandom().randrange(1, 2**31))
    print(f"fault run seed {seed}: its logs are in {tmp_path}")
    result = run(tmp_path, tiny_model, backend_kind, seed, seconds=40)
    assert result.violations == [], f"seed {seed} (logs in {tmp_path}): {result.violations}"
    assert result.n_faults >= 4 and result.acknowledged >= 40, result


@pytest.mark.backend
def test_a_backend_the_run_restarts_from_a_thread_outlives_that_thread(tmp_path: Path, tiny_model: Path) -> None:
    """The nemesis restarts a killed backend from its own thread. The embedded server asks to be killed when its
    parent dies (PR_SET_PDEATHSIG), which the kernel applies to the thread that started it: a 30-minute run (seed
    319622092, embedded) saw every backend the nemesis had restarted die when its thread ended, and each request
    after that waited 60 s and failed. Backends are started from one thread that lives as long as the tests."""
    backend = Backend("embedded", tiny_model, tmp_path / "slots", tmp_path / "backend.log")
    try:
        starter = threading.Thread(target=backend.start)
        starter.start()
        starter.join()
        time.sleep(1.0)
        assert backend.alive()
        assert httpx.get(backend.url + "/health", timeout=10).status_code == 200
    finally:
        backend.stop()


def test_a_seed_gives_the_same_schedule_and_every_kind_of_fault() -> None:
    assert schedule(7, 50) == schedule(7, 50) != schedule(8, 50)
    assert {p.kind for p in schedule(SEEDS[0][0], 200)} == set(FAULT_KINDS)


A, B = "http://gpu-a:8080", "http://gpu-b:8080"


def turn(at: float, prompt: int, cache_n: int, backend: str = A, status: int = 200) -> Turn:
    return Turn("s", at, at + 0.5, "r1", status, cache_n, prompt, backend)


def test_a_lost_turn_is_found_unless_a_fault_may_lose_it() -> None:
    kept = [turn(0, 300, 0), turn(10, 400, 300 - SLACK)]
    assert lost_turns(kept, []) == []
    lost = [turn(0, 300, 0), turn(10, 400, 200)]
    assert len(lost_turns(lost, [])) == 1
    assert lost_turns(lost, [Fault("kill-backend", A, 5, 7)]) == []  # killed: the turns since its last save
    assert len(lost_turns(lost, [Fault("kill-backend", A, 20, 22)])) == 1  # after the next turn: no excuse
    assert len(lost_turns(lost, [Fault("drain", A, 5, 7)])) == 1  # a drain moves the state with its session
    assert len(lost_turns(lost, [Fault("redis-down", "redis", 5, 7)])) == 1  # it stayed on its backend
    moved = [turn(0, 300, 0), turn(10, 400, 200, backend=B)]
    assert lost_turns(moved, [Fault("redis-down", "redis", 5, 7)]) == []  # ran elsewhere while Redis was away
    assert lost_turns([turn(0, 100, 0), turn(10, 200, 0)], []) == []  # under --min-restore-tokens: never restored
    assert lost_turns([turn(0, 300, 0), turn(5, 0, 0, status=503), turn(10, 400, 300)], []) == []


def test_a_manifest_that_goes_back_and_a_token_taken_twice_are_found() -> None:
    growing = [ManifestSample(0, "s", (1, 5)), ManifestSample(1, "s", (1, 5)), ManifestSample(2, "s", (2, 1))]
    assert manifest_regressions(growing) == []
    assert len(manifest_regressions([*growing, ManifestSample(3, "s", (1, 9))])) == 1
    taken = [LeaseTaken(0, "s", "r1", 1), LeaseTaken(5, "s", "r2", 2)]
    assert token_order(taken) == []
    assert len(token_order([*taken, LeaseTaken(9, "s", "r1", 2)])) >= 1
    assert len(token_order(taken, [ManifestSample(0, "s", (2, 0)), ManifestSample(1, "s", (1, 0))])) == 1


def test_a_failure_must_be_in_dialect_and_while_something_was_down() -> None:
    failed = Turn("s", 10, 11, "r1", 502, dialect_error=True)
    assert len(failures([failed], [])) == 1
    assert failures([failed], [Fault("kill-backend", A, 9, 10.5)]) == []
    assert len(failures([failed], [Fault("redis-down", "redis", 9, 12)])) == 1  # Redis away fails no request
    undialected = Turn("s", 10, 11, "r1", 500, dialect_error=False)
    assert len(failures([undialected], [Fault("kill-backend", A, 9, 10.5)])) == 1


def test_a_lease_given_up_after_another_replica_took_a_newer_one_is_found() -> None:
    taken = [LeaseTaken(0, "s", "r1", 1), LeaseTaken(5, "s", "r2", 2)]
    in_order = [LeaseTaken(4, "s", "r1", 1)]  # r1 gave it up, then r2 took the next token
    assert overlapping_leases(taken, in_order, []) == []
    late = [LeaseTaken(6, "s", "r1", 1)]  # r1 still believed it held token 1 after r2 took token 2
    assert len(overlapping_leases(taken, late, [])) == 1
    # r1 was killed in between: its new process never held token 1.
    assert overlapping_leases(taken, late, [Fault("kill-replica", "r1", 5.5, 5.8)]) == []


def test_a_damaged_block_excuses_one_lost_turn_of_each_session_after_it() -> None:
    damaged = [Fault("damage-block", A, 5, 5)]
    lost = [turn(0, 300, 0), turn(10, 400, 200), turn(20, 500, 400), turn(30, 600, 100)]
    assert len(lost_turns(lost, damaged)) == 1  # the first loss after it is excused, the second is not
    assert len(lost_turns(lost[:2], [Fault("damage-block", B, 5, 5)])) == 1  # another backend's block
    assert len(lost_turns(lost[:2], [Fault("damage-block", A, 15, 15)])) == 1  # after the loss: no excuse
    # Damaged while the turn that lost it ran (it reads its blocks after it starts): the CI run of seed 2812 saw the
    # nemesis damage a block 9 ms after such a turn began.
    assert lost_turns(lost[:2], [Fault("damage-block", A, 10.1, 12)]) == []
    moved = [turn(0, 300, 0), turn(10, 400, 200, backend=B)]
    assert lost_turns(moved, [Fault("damage-object", "store", 5, 5)]) == []  # brought from the store, damaged
    assert len(lost_turns(lost[:2], [Fault("damage-object", "store", 5, 5)])) == 1  # it stayed: the store is moot
