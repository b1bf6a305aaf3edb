"""System states in the pool and the turn service, against a fake backend client and a real SnapshotStore: a new
system prompt is never warmed up on a request's path; the first conversation on it runs in one pass, and its state is
cut back to the system part once saved and idle, saved once; a failed cut saves nothing; new conversations start
from it. An operator's pre-warm still evaluates a system part ahead of time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.cache.systemprompt import system_prompt_of
from slotkeeper.errors import UpstreamError
from slotkeeper.serving.service import TurnService
from slotkeeper.types import CacheOutcome, SnapshotKind
from tests.unit.test_pool import FP, FakeClient, key

SYSTEM = {"role": "system", "content": "Agent rules. " + "rule " * 400}


class ChatClient(FakeClient):
    """Also answers chat requests, renders a system part (`/apply-template`), and evaluates a prompt without
    generating (a pre-warm, or a cut: `n_predict` 0), reporting `warm_tokens` prompt tokens, or failing."""

    base_url = "http://fake"

    def __init__(self, slot_dir: Path) -> None:
        super().__init__(slot_dir)
        self.posts: list[dict[str, Any]] = []
        self.warm_tokens = 900
        self.save_tokens = 900
        self.warm_error: Exception | None = None

    async def post_json(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        self.posts.append(body)
        if path == "/apply-template":
            return {"prompt": "<system>rules</system><user>" + str(body["messages"][-1]["content"])}
        if body.get("n_predict") == 0 or body.get("max_tokens") == 0:
            if self.warm_error is not None:
                raise self.warm_error
            return {"timings": {"cache_n": 0, "prompt_n": self.warm_tokens}}
        if path == "/tokenize":
            return {"tokens": []}
        return {"choices": [], "timings": {"cache_n": 10, "prompt_n": 5, "predicted_n": 1}}

    def warm_ups(self) -> list[dict[str, Any]]:
        return [b for b in self.posts if b.get("max_tokens") == 0 or b.get("n_predict") == 0]


@pytest.fixture
def client(slot_dir: Path) -> ChatClient:
    return ChatClient(slot_dir)


def service(client: ChatClient, store: SnapshotStore, min_restore_tokens: int = 128,
            save_idle_seconds: float = 0.01) -> TurnService:
    pool = SlotPool(1, client, Snapshots(store), FP, 8192,  # type: ignore[arg-type]
                    save_idle_seconds=save_idle_seconds, min_restore_tokens=min_restore_tokens)
    return TurnService(client, pool)  # type: ignore[arg-type]


def builder(user: str, system: dict[str, Any] = SYSTEM) -> Any:
    messages = [system, {"role": "user", "content": user}]
    return lambda slot_id: {"messages": messages, "id_slot": slot_id, "cache_prompt": True}


def system_rows(store: SnapshotStore) -> list[Any]:
    return store.list(kind=SnapshotKind.SYSTEM)


async def idle(turns: TurnService) -> None:
    """Let the slot idle long enough for its save and cut, and every commit land."""
    await asyncio.sleep(0.2)
    await turns.pool.snapshots.settle()


async def test_a_new_system_prompt_is_cut_from_the_first_turn_and_saved_once(client: ChatClient,
                                                                            store: SnapshotStore) -> None:
    turns = service(client, store)
    _, first = await turns.unary("t", key("a"), "/v1/chat/completions", builder("first chat"))
    assert first.lease.cache.outcome is CacheOutcome.COLD and first.lease.cut_system
    assert client.warm_ups() == []  # nothing ran on the request's path before it
    await idle(turns)
    assert len(client.warm_ups()) == 1 and client.warm_ups()[0]["prompt"] == "<system>rules</system><user>"
    rows = system_rows(store)
    part = system_prompt_of(builder("x")(0))
    assert part is not None and [r.session_id for r in rows] == [part.digest]
    assert store.get(key("a")) is not None  # the conversation was saved before its slot was cut
    # Another conversation takes the only slot; a third, new one on the same system prompt: in the slot after the
    # unrelated one, nothing of it is shared, so the system state is restored.
    await turns.unary("t", key("b"), "/v1/chat/completions", builder("unrelated", {"role": "system", "content": "x"}))
    _, third = await turns.unary("t", key("c"), "/v1/chat/completions", builder("third chat"))
    assert third.lease.cache.outcome is CacheOutcome.RESTORED
    assert third.lease.cache.restored_from == f"system:{part.digest[:12]}"
    assert client.actions("restore")[-1][2] == rows[0].filename
    await idle(turns)
    assert len(client.warm_ups()) == 1 and len(system_rows(store)) == 1  # never cut again
    assert turns.pool.warmups.cuts == 1 and turns.pool.warmups.failed_warm_ups == 0


async def test_a_failed_cut_saves_no_system_state_and_the_turn_ran_as_it_would(client: ChatClient,
                                                                              store: SnapshotStore) -> None:
    client.warm_error = UpstreamError(500, b'{"error": {"message": "boom"}}')
    turns = service(client, store)
    data, record = await turns.unary("t", key("a"), "/v1/chat/completions", builder("first chat"))
    assert record.status == 200 and data["timings"]["prompt_n"] == 5
    await idle(turns)
    assert system_rows(store) == []
    assert store.get(key("a")) is not None  # the conversation's own state was saved all the same
    assert (turns.pool.warmups.cuts, turns.pool.warmups.failed_warm_ups) == (0, 1)
    assert turns.pool.slots[0].occupant is None and turns.pool.slots[0].chain == []  # its content is not known


async def test_a_system_part_too_short_for_a_state_is_not_cut_again(client: ChatClient,
                                                                   store: SnapshotStore) -> None:
    client.warm_tokens = 100  # fewer than min_restore_tokens
    turns = service(client, store)
    await turns.unary("t", key("a"), "/v1/chat/completions", builder("one"))
    await idle(turns)
    await turns.unary("t", key("b"), "/v1/chat/completions", builder("two"))
    await idle(turns)
    assert len(client.warm_ups()) == 1
    assert system_rows(store) == []


async def test_side_requests_and_short_prompts_are_not_cut(client: ChatClient, store: SnapshotStore) -> None:
    turns = service(client, store)
    await turns.unary("t", key("a"), "/v1/chat/completions", builder("title please"), side=True)
    await turns.unary("t", key("b"), "/v1/chat/completions", builder("hi", {"role": "system", "content": "Be brief."}))
    await idle(turns)
    assert client.warm_ups() == []


async def test_prewarm_saves_once_then_finds_the_snapshot(client: ChatClient, store: SnapshotStore) -> None:
    turns = service(client, store)
    part = system_prompt_of(builder("x")(0))
    assert part is not None
    first = await turns.prewarm("m", part)
    second = await turns.prewarm("m", part)
    assert (first.status, first.n_tokens) == ("saved", 900)
    assert second.status == "exists"
    assert len(client.warm_ups()) == 1 and len(system_rows(store)) == 1
    assert turns.pool.warmups.warm_ups == 1  # finding the snapshot is not a warm-up
    # The slot still holds the warmed-up prompt: the next conversation on it needs no restore.
    _, record = await turns.unary("t", key("new"), "/v1/chat/completions", builder("hello"))
    assert record.lease.cache.outcome is CacheOutcome.COLD and client.actions("restore") == []


async def test_a_failed_prewarm_raises_and_saves_nothing(client: ChatClient, store: SnapshotStore) -> None:
    client.warm_error = UpstreamError(400, b'{"error": {"message": "context exceeded"}}')
    turns = service(client, store)
    part = system_prompt_of(builder("x")(0))
    assert part is not None
    with pytest.raises(UpstreamError):
        await turns.prewarm("m", part)
    assert system_rows(store) == [] and client.actions("save") == []
    assert not turns.pool.slots[0].busy
