"""Placement of one model's sessions on its backends: sticky owners, the ring walk, the load bound, moves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.fleet.placement import ACTIVE_SECONDS, FORGET_SECONDS, Placed, Placement

MEMBERS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"]


def test_a_session_keeps_its_owner_while_it_is_up() -> None:
    placement = Placement(MEMBERS)
    first = placement.place("chat-1", "chat-1", MEMBERS, 0.0)
    assert first.why is Placed.NEW and first.previous is None
    for turn in range(1, 6):
        again = placement.place("chat-1", "chat-1", MEMBERS, float(turn))
        assert (again.member, again.why, again.moved) == (first.member, Placed.OWNER, False)


def test_two_placements_with_the_same_backends_agree() -> None:
    """Every replica that knows the same backends computes the same ring (ketama over the URLs)."""
    one, two = Placement(MEMBERS), Placement(list(reversed(MEMBERS)))
    assert all(one.walk(f"s{i}") == two.walk(f"s{i}") for i in range(50))


def test_new_sessions_are_spread_within_the_bound() -> None:
    placement = Placement(MEMBERS, load_factor=1.25)
    for i in range(12):
        placement.place(f"session-{i}", f"session-{i}", MEMBERS, float(i))
    loads = placement.loads(12.0)
    assert sum(loads.values()) == 12
    assert max(loads.values()) <= 1.25 * 12 / 3


def test_conversations_on_one_system_prompt_start_on_one_backend_until_the_bound() -> None:
    placement = Placement(MEMBERS, load_factor=1.25)
    chosen = [placement.place(f"sys-abc.c{i}", "sys-abc", MEMBERS, 0.0).member for i in range(9)]
    warm = placement.walk("sys-abc")[0]
    assert chosen[0] == warm
    assert chosen.count(warm) >= 3  # the first ones all go where the prompt is warm
    assert max(placement.loads(0.0).values()) <= 1.25 * 9 / 3 + 1


def test_the_sessions_of_a_backend_that_goes_down_move_and_the_others_stay() -> None:
    placement = Placement(MEMBERS)
    owners = {f"s{i}": placement.place(f"s{i}", f"s{i}", MEMBERS, 0.0).member for i in range(12)}
    dead = MEMBERS[0]
    up = MEMBERS[1:]
    for session, owner in owners.items():
        choice = placement.place(session, session, up, 1.0)
        if owner == dead:
            assert choice.why is Placed.OWNER_DOWN and choice.moved and choice.previous == dead
            assert choice.member in up
        else:
            assert (choice.member, choice.why) == (owner, Placed.OWNER)
    assert placement.loads(1.0)[dead] == 0


def test_an_overloaded_owner_gives_sessions_up() -> None:
    placement = Placement(MEMBERS[:2], load_factor=1.25)
    # Everything on the first backend while the second was down.
    for i in range(8):
        assert placement.place(f"s{i}", f"s{i}", MEMBERS[:1], 0.0).member == MEMBERS[0]
    moved = [placement.place(f"s{i}", f"s{i}", MEMBERS[:2], 1.0) for i in range(8)]
    assert {c.why for c in moved} <= {Placed.OWNER, Placed.OVERLOADED}
    assert any(c.why is Placed.OVERLOADED and c.member == MEMBERS[1] for c in moved)
    loads = placement.loads(1.0)
    assert max(loads.values()) <= 5  # ceil(1.25 * 8 / 2)


def test_idle_sessions_do_not_count_and_come_back_to_their_owner() -> None:
    placement = Placement(MEMBERS)
    owner = placement.place("old", "old", MEMBERS, 0.0).member
    later = ACTIVE_SECONDS + 1
    assert placement.loads(later)[owner] == 0
    back = placement.place("old", "old", MEMBERS, later)
    assert (back.member, back.why) == (owner, Placed.OWNER)


def test_learnt_owners_are_kept_and_the_newest_copy_wins() -> None:
    placement = Placement(MEMBERS)
    placement.learn("s", MEMBERS[2], 10.0)
    placement.learn("s", MEMBERS[1], 5.0)  # an older copy elsewhere
    placement.learn("s", "http://elsewhere", 50.0)  # not a backend of this model
    assert placement.owner("s") == MEMBERS[2]
    assert placement.place("s", "s", MEMBERS, 11.0).member == MEMBERS[2]


def test_a_refused_backend_is_left_out_and_with_none_up_the_owner_is_kept() -> None:
    placement = Placement(MEMBERS)
    owner = placement.place("s", "s", MEMBERS, 0.0).member
    retry = placement.place("s", "s", MEMBERS, 1.0, exclude={owner})
    assert retry.member != owner and retry.moved
    nobody = Placement(MEMBERS)
    first = nobody.place("t", "t", [], 0.0)
    assert first.member in MEMBERS
    assert nobody.place("t", "t", [], 1.0).member == first.member


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sets(st.sampled_from(MEMBERS), min_size=1)), min_size=1,
                max_size=120))
def test_no_backend_that_is_up_owns_more_than_the_bound(requests: list[tuple[int, set[str]]]) -> None:
    """Whatever the order of requests and the health of the backends, right after each placement the chosen backend
    owns no more than the bound over the backends up (ceil of 1.25 x the mean)."""
    placement = Placement(MEMBERS, load_factor=1.25)
    for now, (session, up) in enumerate(requests):
        choice = placement.place(f"s{session}", f"s{session}", sorted(up), float(now))
        assert choice.member in up
        loads = placement.loads(float(now))
        assert loads[choice.member] <= placement.bound(loads, sorted(up), 0)


def test_a_side_task_goes_where_its_conversation_is_and_owns_nothing() -> None:
    placement = Placement(MEMBERS)
    owner = placement.place("chat", "chat", MEMBERS, 0.0).member
    assert placement.peek("chat", "chat", MEMBERS) == owner
    assert placement.peek("title-of-new-chat", "sys-x", MEMBERS) == placement.walk("sys-x")[0]
    assert placement.owner("title-of-new-chat") is None and len(placement) == 1
    others = [m for m in MEMBERS if m != owner]
    assert placement.peek("chat", "chat", others) in others  # its owner is down


def test_owners_unused_for_a_day_are_forgotten() -> None:
    placement = Placement(MEMBERS)
    placement.place("old", "old", MEMBERS, 0.0)
    for i in range(1024):
        placement.place(f"new-{i}", f"new-{i}", MEMBERS, FORGET_SECONDS + 1.0)
    assert placement.owner("old") is None and placement.owner("new-0") is not None


def test_a_draining_backend_gets_no_new_session_and_its_own_move() -> None:
    placement = Placement(MEMBERS)
    owners = {f"s{i}": placement.place(f"s{i}", f"s{i}", MEMBERS, 0.0).member for i in range(9)}
    drained = MEMBERS[1]
    placement.draining.add(drained)
    for i in range(9, 30):
        assert placement.place(f"s{i}", f"s{i}", MEMBERS, 1.0).member != drained
    for session, owner in owners.items():
        choice = placement.place(session, session, MEMBERS, 2.0)
        if owner == drained:
            assert choice.why is Placed.DRAINING and choice.member != drained
        else:
            assert choice.member == owner
    placement.draining.clear()
    assert any(placement.place(f"n{i}", f"n{i}", MEMBERS, 3.0).member == drained for i in range(20))


def test_a_choice_from_loads_counted_elsewhere_keeps_the_bound_and_records_nothing() -> None:
    """The session directory counts the loads itself (in Redis) and records the owner there: `choose` takes them."""
    placement = Placement(MEMBERS, load_factor=1.25)
    walk = placement.walk("s")
    full = {walk[0]: 3, walk[1]: 1, walk[2]: 1}  # the bound: ceil(1.25 * 5 / 3) = 3, and with one more, 3
    choice = placement.choose("s", None, False, full, MEMBERS)
    assert (choice.member, choice.why) == (walk[1], Placed.NEW) and len(placement) == 0
    kept = placement.choose("s", walk[0], True, full, MEMBERS)
    assert (kept.member, kept.why) == (walk[0], Placed.OWNER)
    moved = placement.choose("s", walk[0], True, full, [walk[1], walk[2]])
    assert moved.why is Placed.OWNER_DOWN and moved.member != walk[0]


def test_an_owner_assigned_by_the_directory_is_recorded() -> None:
    placement = Placement(MEMBERS)
    first = placement.assign("s", MEMBERS[1], 0.0)
    assert (first.why, first.previous) == (Placed.NEW, None)
    again = placement.assign("s", MEMBERS[2], 1.0)
    assert (again.why, again.previous, again.moved) == (Placed.DIRECTORY, MEMBERS[1], True)
    assert placement.owner("s") == MEMBERS[2]
