"""`/metrics` over a scripted conversation against real llama.cpp servers: each metric moves as the cache did.

Values are compared with what the responses' timings, the index rows and the files say, never with generated text.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Stack
from tests.support import Conversation, Slotkeeper, chat, timings, words

pytestmark = pytest.mark.backend

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: httpx.Client) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_follow_a_scripted_conversation(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0, ctx_per_slot=4096))
    client = client_for(keeper)
    start = scrape(client)
    assert value(start, "slotkeeper_backend_up") == 1
    assert value(start, "slotkeeper_slots") == 1
    assert value(start, "slotkeeper_slots_occupied") == 0
    assert value(start, "slotkeeper_snapshots") == 0
    assert value(start, "slotkeeper_saves_total") == 0
    assert value(start, "slotkeeper_restores_total") == 0
    assert value(start, "slotkeeper_queue_length") == 0
    assert value(start, "slotkeeper_restore_effective") == 1
    assert value(start, "slotkeeper_requests_total", api="openai.chat", cache="cold") == 0
    info = [k for k in start if k[0] == "slotkeeper_info"]
    assert len(info) == 1 and dict(info[0][1])["model"] == "tiny"

    # Turn 1 of A: cold, everything prefilled.
    a = Conversation(client, "metrics-a", size=700, seed=1)
    first = timings(a.turn())
    s1 = scrape(client)
    assert delta(s1, start, "slotkeeper_requests_total", api="openai.chat", cache="cold") == 1
    assert delta(s1, start, "slotkeeper_tokens_prefilled_total") == first["prompt_n"]
    assert delta(s1, start, "slotkeeper_tokens_reused_total") == first["cache_n"]
    assert delta(s1, start, "slotkeeper_tokens_generated_total") == first["predicted_n"]
    assert delta(s1, start, "slotkeeper_request_duration_seconds_count", api="openai.chat") == 1
    assert value(s1, "slotkeeper_slots_occupied") == 1
    assert value(s1, "slotkeeper_slots_dirty") == 1
    assert value(s1, "slotkeeper_slots_busy") == 0
    assert value(s1, "slotkeeper_slot_tokens", slot="0") > first["prompt_n"]

    # Turn 2 of A: hot, the first turn's prompt is reused and an estimate of its prefill time is counted as saved.
    second = timings(a.turn())
    s2 = scrape(client)
    assert delta(s2, s1, "slotkeeper_requests_total", api="openai.chat", cache="hot") == 1
    assert delta(s2, s1, "slotkeeper_tokens_reused_total") == second["cache_n"] >= first["prompt_n"]
    assert delta(s2, s1, "slotkeeper_tokens_prefilled_total") == second["prompt_n"]
    assert delta(s2, s1, "slotkeeper_prefill_seconds_saved_total", cache="hot") > 0
    assert delta(s2, s1, "slotkeeper_saves_total") == 0

    # B takes the only slot: A is saved first (one save, its bytes are A's file), B runs cold.
    b = Conversation(client, "metrics-b", size=400, seed=7)
    b.turn()
    s3 = scrape(client)
    row_a = keeper.row("metrics-a")
    assert row_a is not None
    assert delta(s3, s2, "slotkeeper_saves_total") == 1
    assert delta(s3, s2, "slotkeeper_save_duration_seconds_count") == 1
    assert delta(s3, s2, "slotkeeper_save_bytes_count") == 1
    assert delta(s3, s2, "slotkeeper_save_bytes_sum") == row_a["n_bytes"]
    assert value(s3, "slotkeeper_snapshots") == 1
    assert value(s3, "slotkeeper_snapshot_bytes") == row_a["n_bytes"]
    assert delta(s3, s2, "slotkeeper_requests_total", api="openai.chat", cache="cold") == 1

    # Back to A: B is saved, A's snapshot restored, and the response proves the restore was reused.
    third = timings(a.turn())
    s4 = scrape(client)
    row_b = keeper.row("metrics-b")
    assert row_b is not None
    assert delta(s4, s3, "slotkeeper_requests_total", api="openai.chat", cache="restored") == 1
    assert delta(s4, s3, "slotkeeper_saves_total") == 1
    assert delta(s4, s3, "slotkeeper_save_bytes_sum") == row_b["n_bytes"]
    assert delta(s4, s3, "slotkeeper_restores_total") == 1
    assert delta(s4, s3, "slotkeeper_restore_duration_seconds_count") == 1
    assert delta(s4, s3, "slotkeeper_restore_bytes_sum") == row_a["n_bytes"]
    assert delta(s4, s3, "slotkeeper_restores_effective_total") == 1
    assert delta(s4, s3, "slotkeeper_restores_ineffective_total") == 0
    assert delta(s4, s3, "slotkeeper_tokens_reused_total") == third["cache_n"] > 0
    assert delta(s4, s3, "slotkeeper_prefill_seconds_saved_total", cache="restored") > 0
    assert value(s4, "slotkeeper_snapshots") == 2
    assert value(s4, "slotkeeper_snapshot_bytes") == row_a["n_bytes"] + row_b["n_bytes"]

    # Deleting B's snapshot through the API shrinks the disk gauges.
    assert client.delete("/api/sessions/metrics-b").status_code == 200
    s5 = scrape(client)
    assert value(s5, "slotkeeper_snapshots") == 1
    assert value(s5, "slotkeeper_snapshot_bytes") == keeper.row("metrics-a")["n_bytes"]  # type: ignore[index]

    # A request the backend refuses is counted with its status.
    too_long = chat(client, [{"role": "user", "content": "x " * 5000}], "metrics-big", max_tokens=2)
    assert too_long.status_code == 400
    s6 = scrape(client)
    assert delta(s6, s5, "slotkeeper_request_errors_total", api="openai.chat", status="400") == 1
    total_requests = sum(v for (name, _), v in s6.items() if name == "slotkeeper_requests_total")
    assert total_requests == 5  # four turns and the refused one
    assert value(s6, "slotkeeper_failed_saves_total") == 0
    assert value(s6, "slotkeeper_queue_length") == 0


def test_recent_requests_record_each_cache_path(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    a = Conversation(client, "recent-a", size=500, seed=3)
    a.turn()
    a.turn()
    Conversation(client, "recent-b", size=300, seed=4).turn()
    a.turn()
    data = client.get("/api/requests/recent").json()
    newest_first = [(r["session"], r["cache"], r["status"]) for r in data["requests"]]
    assert newest_first == [("recent-a", "restored", 200), ("recent-b", "cold", 200), ("recent-a", "hot", 200),
                            ("recent-a", "cold", 200)]
    restored = data["requests"][0]
    assert restored["restored"] > 0 and restored["restore_ms"] > 0 and restored["save_ms"] > 0
    assert restored["api"] == "openai.chat" and restored["slot"] == 0
    totals = {t["session"]: t for t in data["session_totals"]}
    assert totals["recent-a"]["requests"] == 3 and totals["recent-a"]["hits"] == 2
    assert totals["recent-b"]["requests"] == 1 and totals["recent-b"]["hits"] == 0
    assert totals["recent-a"]["seconds_saved"] > 0
    assert len(client.get("/api/requests/recent", params={"limit": 2}).json()["requests"]) == 2


def prewarm(client: httpx.Client, system: str, **extra: Any) -> httpx.Response:
    return client.post("/api/sessions/prewarm", json={"system": system, **extra})


def system_rows(keeper: Slotkeeper) -> dict[str, dict[str, Any]]:
    return {r["session_id"]: r for r in keeper.index_rows() if r["kind"] == "system"}


@pytest.mark.parametrize("backend_kind", ["binary"])  # the metrics read slotkeeper's own state: one kind will do
def test_disk_budget_and_system_snapshot_metrics(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0, ctx_per_slot=4096), "--disk-budget", "1G",
                              "--max-system-snapshots", "1")
    client = client_for(keeper)
    start = scrape(client)
    assert value(start, "slotkeeper_disk_budget_bytes") == 2**30
    for name in ("slotkeeper_evictions_total", "slotkeeper_warm_ups_total", "slotkeeper_failed_warm_ups_total",
                 "slotkeeper_pinned_snapshots", "slotkeeper_system_snapshots", "slotkeeper_system_snapshot_bytes"):
        assert (name, frozenset()) in start, name
        assert value(start, name) == 0, name

    # A pre-warm is a warm-up and makes a system snapshot; the session gauges do not move.
    first = prewarm(client, "You are the first assistant. " + words(400, 1)).json()
    assert first["status"] == "saved"
    s1 = scrape(client)
    assert delta(s1, start, "slotkeeper_warm_ups_total") == 1
    assert value(s1, "slotkeeper_system_snapshots") == 1
    assert value(s1, "slotkeeper_system_snapshot_bytes") == system_rows(keeper)[first["system"]]["n_bytes"]
    assert value(s1, "slotkeeper_snapshots") == 0 and value(s1, "slotkeeper_snapshot_bytes") == 0
    assert delta(s1, start, "slotkeeper_saves_total") == 1

    # Pinned, it survives a second system snapshot (max 1 per model): nothing is evicted.
    assert client.post(f"/api/sessions/{first['system']}/pin", params={"kind": "system"}).status_code == 200
    assert value(scrape(client), "slotkeeper_pinned_snapshots") == 1
    second = prewarm(client, "You are the second assistant. " + words(400, 2)).json()
    s2 = scrape(client)
    assert delta(s2, s1, "slotkeeper_warm_ups_total") == 1
    assert value(s2, "slotkeeper_system_snapshots") == 2
    assert value(s2, "slotkeeper_evictions_total") == 0

    # Unpinned, the next save evicts both older ones; a pre-warm of a prompt already kept runs no warm-up.
    assert client.post(f"/api/sessions/{first['system']}/unpin", params={"kind": "system"}).status_code == 200
    assert value(scrape(client), "slotkeeper_pinned_snapshots") == 0
    third = prewarm(client, "You are the third assistant. " + words(400, 3)).json()
    assert prewarm(client, "You are the third assistant. " + words(400, 3)).json()["status"] == "exists"
    s3 = scrape(client)
    assert set(system_rows(keeper)) == {third["system"]} and second["system"] != third["system"]
    assert delta(s3, s2, "slotkeeper_warm_ups_total") == 1
    assert delta(s3, s2, "slotkeeper_evictions_total") == 2
    assert value(s3, "slotkeeper_system_snapshots") == 1
    assert value(s3, "slotkeeper_system_snapshot_bytes") == third["bytes"]

    # A warm-up the backend refuses (longer than a slot) is counted as failed, and saves nothing.
    refused = prewarm(client, words(6000, 4))
    assert refused.status_code == 400, refused.text
    s4 = scrape(client)
    assert delta(s4, s3, "slotkeeper_failed_warm_ups_total") == 1
    assert delta(s4, s3, "slotkeeper_warm_ups_total") == 0
    assert delta(s4, s3, "slotkeeper_saves_total") == 0
    assert value(s4, "slotkeeper_system_snapshots") == 1


def index_rows(cache: Path, name: str) -> list[dict[str, Any]]:
    [path] = (cache / "backends").glob(f"{name}-*/index.sqlite3")
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM snapshots")]
    finally:
        db.close()


def ask(client: httpx.Client, model: str, session: str, seed: int) -> None:
    messages = [{"role": "user", "content": words(400, seed)}]
    response = client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                           json={"model": model, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def test_several_backends_are_told_apart_by_a_model_label(two_backends: Slotkeeper, client_for) -> None:
    keeper = two_backends
    client = client_for(keeper)
    ask(client, "alpha", "a1", 1)
    ask(client, "beta", "b1", 2)
    ask(client, "alpha", "a2", 3)  # alpha's only slot goes to a2: a1 is saved, on alpha only
    samples = scrape(client)
    alpha, beta = {"model": "alpha"}, {"model": "beta"}
    assert value(samples, "slotkeeper_requests_total", api="openai.chat", cache="cold", **alpha) == 2
    assert value(samples, "slotkeeper_requests_total", api="openai.chat", cache="cold", **beta) == 1
    assert value(samples, "slotkeeper_saves_total", **alpha) == 1
    assert value(samples, "slotkeeper_saves_total", **beta) == 0
    assert value(samples, "slotkeeper_save_bytes_count", **alpha) == 1
    [a1] = index_rows(keeper.cache_dir, "alpha")
    assert a1["session_id"] == "a1"
    assert value(samples, "slotkeeper_snapshot_bytes", **alpha) == a1["n_bytes"]
    assert value(samples, "slotkeeper_snapshots", **beta) == 0
    assert value(samples, "slotkeeper_tokens_prefilled_total", **beta) > 0
    for model in (alpha, beta):
        assert value(samples, "slotkeeper_backend_up", **model) == 1
        assert value(samples, "slotkeeper_slots", **model) == 1
        assert value(samples, "slotkeeper_slots_occupied", **model) == 1
        assert value(samples, "slotkeeper_slot_tokens", slot="0", **model) > 0
    # No series of a per-backend metric lacks the label (it would read as a third backend).
    unlabelled = {name for name, labels in samples if name.startswith("slotkeeper_") and "model" not in dict(labels)}
    assert unlabelled == set()
    assert sorted(dict(k[1])["model"] for k in samples if k[0] == "slotkeeper_info") == ["alpha", "beta"]

    # The activity routes cover every backend, or the one `?model=` names.
    recent = client.get("/api/requests/recent").json()
    assert [(r["model"], r["session"]) for r in recent["requests"]] == [("alpha", "a2"), ("beta", "b1"),
                                                                        ("alpha", "a1")]
    assert {t["session"] for t in recent["session_totals"]} == {"a1", "a2", "b1"}
    only_beta = client.get("/api/requests/recent", params={"model": "beta"}).json()
    assert [r["session"] for r in only_beta["requests"]] == ["b1"]
    backend = client.get("/api/backend", params={"model": "beta"}).json()
    assert (backend["model"], backend["models"]) == ("beta", ["alpha", "beta"])
    assert client.get("/api/backend").json()["model"] == "alpha"
    current = client.get("/api/sessions/current", params={"model": "beta"}).json()
    assert [s["session"] for s in current["slots"]] == ["b1"]
