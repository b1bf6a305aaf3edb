"""Snapshots that move between hosts through an S3-compatible object store (moto's server on loopback): two
slotkeepers, each beside its own llama.cpp server (two "hosts" of one model and build), share one bucket.

- A session saved on host A is restored by host B, and the next token's probabilities there equal a fresh
  prefill's, on every architecture of the tiny models and with a client whose history differs from what was
  generated.
- A system prompt's snapshot is stored once, and a new conversation on it on host B starts from it.
- A damaged copy on B's disk is refused and fetched again from the store; an object damaged in the store is
  refused (fetched twice), removed, and uploaded again by its owner's next save.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_model_restores import (  # noqa: F401 (the models fixture)
    Session,
    assert_same_distribution,
    models,
    top_logprobs,
)
from tests.support import Backend, ObjectStoreServer, Slotkeeper, chat, timings, wait_until, words

pytestmark = pytest.mark.backend

PREFIX = "team-a"


@dataclass
class Host:
    backend: Backend
    keeper: Slotkeeper

    @property
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.keeper.url, timeout=120)


@dataclass
class TwoHosts:
    store: ObjectStoreServer
    a: Host
    b: Host

    def manifests(self, kind: str) -> dict[str, dict[str, Any]]:
        """Session id -> manifest, of one kind."""
        s3 = self.store.client()
        found = {}
        for key in self.store.keys(f"{PREFIX}/manifests/"):
            if f"/{kind}/" in key:
                data = json.loads(s3.get_object(Bucket=self.store.bucket, Key=key)["Body"].read())
                found[data["session"]] = data
        return found

    def blob(self, checksum: str) -> str:
        return f"{PREFIX}/blobs/{checksum}"


def start_host(tmp_path: Path, name: str, kind: str, model: Path, store: ObjectStoreServer) -> Host:
    # Snapshots kept as whole files (`blobs/`): this file's checks name their objects. The block store's shared tier
    # (`kv/`, `tails/`) has its own tests in test_block_store.py.
    backend = Backend(kind, model, tmp_path / f"{name}-slots", tmp_path / f"{name}-backend.log").start()
    keeper = Slotkeeper(tmp_path / f"{name}-cache", tmp_path / f"{name}.log", upstream=backend,
                        extra_args=("--shared-store", f"s3://{store.bucket}/{PREFIX}", "--shared-endpoint", store.url,
                                    "--save-idle-seconds", "0.3", "--block-tokens", "0"))
    return Host(backend, keeper.start(timeout=120))


@pytest.fixture
def hosts(tmp_path: Path, backend_kind: str, monkeypatch: pytest.MonkeyPatch,
          request: pytest.FixtureRequest) -> Iterator[TwoHosts]:
    model: Path = request.getfixturevalue("model_file")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    store = ObjectStoreServer(tmp_path / "s3.log").start()
    started: list[Host] = []
    try:
        started.append(start_host(tmp_path, "a", backend_kind, model, store))
        started.append(start_host(tmp_path, "b", backend_kind, model, store))
        yield TwoHosts(store, started[0], started[1])
    finally:
        for host in started:
            host.keeper.stop()
            host.backend.stop()
        store.stop()


@pytest.fixture
def model_file(request: pytest.FixtureRequest, tiny_model: Path) -> Path:
    """The model both hosts serve: the test's architecture's, else the tiny dense model."""
    if "arch" in request.fixturenames:
        arch: str = request.getfixturevalue("arch")
        chosen: Path = request.getfixturevalue("models")[arch]
        return chosen
    return tiny_model


def uploaded(hosts: TwoHosts, session: str, prompt_tokens: int) -> bool:
    manifest = hosts.manifests("session").get(session)
    return manifest is not None and manifest["prompt_tokens"] == prompt_tokens


@pytest.mark.parametrize("arch", ["llama", "mamba", "jamba", "lfm2", "gemma3"])
def test_a_session_saved_on_one_host_is_restored_on_another_without_changing_the_answer(
        arch: str, hosts: TwoHosts) -> None:
    on_a, on_b = hosts.a.client, hosts.b.client
    session = Session(on_a, "travelling", "You are a travelling assistant. " + words(300, 7), 21)
    session.turn()
    session.answer()  # the client sends back a short answer, not what was generated
    session.turn()
    session.answer()
    saved_prompt = session.last_prompt
    assert wait_until(lambda: uploaded(hosts, "travelling", saved_prompt), timeout=30)

    # The same conversation's next turn on host B: restored from the object store, the same next-token
    # probabilities as a fresh prefill of the same prompt (on host A's server, its cache off).
    session.client = on_b
    body = {"logprobs": True, "top_logprobs": 5, "grammar": "root ::= [a-z]+"}
    response = chat(on_b, session.messages, "travelling", max_tokens=1, **body)
    assert response.status_code == 200, response.text
    fresh = httpx.post(hosts.a.backend.url + "/v1/chat/completions", timeout=120, json={
        "messages": session.messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False, **body})
    assert_same_distribution(top_logprobs(response), top_logprobs(fresh), f"{arch} across hosts")
    restored = timings(response)
    if arch == "llama" or hosts.a.backend.kind == "embedded":  # where the build and architecture allow a restore
        assert response.headers["x-slotkeeper-cache"] == "restored"
        assert restored["cache_n"] >= saved_prompt - 8, (restored, saved_prompt)
    assert "brought the session snapshot of" in hosts.b.keeper.log_text()


def test_a_system_prompt_is_stored_once_and_starts_new_conversations_on_other_hosts(hosts: TwoHosts) -> None:
    system = "You are a shared agent prompt. " + words(400, 9)
    with hosts.a.client as on_a:
        for i in range(3):  # three conversations on one system prompt on host A
            response = chat(on_a, [{"role": "system", "content": system},
                                   {"role": "user", "content": words(40, 100 + i)}], f"agent-{i}", max_tokens=2)
            assert response.status_code == 200
    # The system part's state is cut from the first conversation's slot once it is idle, then uploaded like any save.
    assert wait_until(lambda: len(hosts.manifests("session")) == 3 and len(hosts.manifests("system")) >= 1,
                      timeout=30)
    systems = hosts.manifests("system")
    assert len(systems) == 1
    [system_manifest] = systems.values()
    checksums = {m["checksum"] for m in [*hosts.manifests("session").values(), system_manifest]}
    blobs = hosts.store.keys(f"{PREFIX}/blobs/")
    assert sorted(blobs) == sorted(hosts.blob(c) for c in checksums)  # each file once

    with hosts.b.client as on_b:  # a new conversation on host B starts from it: no warm-up there
        response = chat(on_b, [{"role": "system", "content": system},
                               {"role": "user", "content": words(40, 200)}], "agent-b", max_tokens=2)
    assert response.status_code == 200
    assert timings(response)["cache_n"] >= system_manifest["tokens"] - 8
    log = hosts.b.keeper.log_text()
    assert "brought the system snapshot of" in log and "warmed up" not in log


def slots_saved(client: httpx.Client) -> bool:
    return not any(s["dirty"] or s["busy"] for s in client.get("/api/sessions/current").json()["slots"])


def test_damaged_copies_are_refused_and_fetched_again(hosts: TwoHosts) -> None:
    a_client, b_client = hosts.a.client, hosts.b.client
    first = Session(a_client, "first", "You are careful. " + words(300, 3), 31)
    second = Session(a_client, "second", "You are thorough. " + words(300, 4), 41)
    other = Session(b_client, "other", "You are another one. " + words(300, 5), 51)
    for s in (first, second):
        s.turn()
        s.answer()
    assert wait_until(lambda: uploaded(hosts, "first", first.last_prompt)
                      and uploaded(hosts, "second", second.last_prompt), timeout=30)

    # 1. B fetches "first" and saves its turn (uploaded too); then B's copy on its disk is damaged (same size,
    # other bytes): the next restore of it on B refuses that copy and fetches the store's again.
    first.client = b_client
    outcome, _ = first.turn()
    assert outcome == "restored"
    first.answer()
    other.turn()  # takes B's only slot; B saves "first"
    assert wait_until(lambda: slots_saved(b_client) and uploaded(hosts, "first", first.last_prompt), timeout=30)
    row = hosts.b.keeper.row("first")
    assert row is not None
    local = Path(hosts.b.backend.slot_dir) / row["filename"]
    data = bytearray(local.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(x ^ 0xFF for x in data[len(data) // 2: len(data) // 2 + 64])
    local.write_bytes(bytes(data))
    before = first.last_prompt
    outcome, t = first.turn()
    assert outcome == "restored" and t["cache_n"] >= before - 8, (outcome, t, before)
    log = hosts.b.keeper.log_text()
    assert "quarantined" in log
    assert log.count("brought the session snapshot of tiny/first from the shared store") == 2

    # 2. "second"'s object is damaged in the store: B refuses it twice, removes it and does not restore it; A's next
    # save of "second" uploads it again, and B then restores that.
    manifest = hosts.manifests("session")["second"]
    s3 = hosts.store.client()
    blob = hosts.blob(manifest["checksum"])
    damaged = bytearray(s3.get_object(Bucket=hosts.store.bucket, Key=blob)["Body"].read())
    damaged[100:164] = bytes(x ^ 0xFF for x in damaged[100:164])
    s3.put_object(Bucket=hosts.store.bucket, Key=blob, Body=bytes(damaged))
    second.client = b_client
    before = second.last_prompt
    outcome, t = second.turn()
    assert outcome != "restored" or t["cache_n"] < before - 8, (outcome, t)  # at most its system part is reused
    log = hosts.b.keeper.log_text()
    assert log.count("shared store's snapshot of tiny/second is damaged") == 2
    assert "withdrew the damaged snapshot of tiny/second" in log
    assert blob not in hosts.store.keys(f"{PREFIX}/blobs/")
    second.answer()
    assert wait_until(lambda: uploaded(hosts, "second", second.last_prompt), timeout=30)  # B's own save of it
    second.client = a_client
    second.turn()  # A saves it again: its file is uploaded again, the manifest is A's
    second.answer()
    assert wait_until(lambda: uploaded(hosts, "second", second.last_prompt), timeout=30)
    assert hosts.a.backend.url in hosts.manifests("session")["second"]["origin"]
    other.answer()
    other.turn()  # B's slot goes to another session: the next turn of "second" on B restores
    assert wait_until(lambda: slots_saved(b_client), timeout=30)
    second.client = b_client
    before = second.last_prompt
    outcome, t = second.turn()
    assert outcome == "restored" and t["cache_n"] >= before - 8, (outcome, t, before)
