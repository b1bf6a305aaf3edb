"""One model on three backends behind one slotkeeper (three [[backends]] tables of one name, each a real llama.cpp
server on its own loopback port and slot dir, of either kind): each session stays on its owner and reuses its own
history there, the sessions are spread within the load bound, and when a backend is killed (kill -9) its sessions
move to the others with their last committed snapshots, a turn in flight there fails in its client's dialect, and
no later request fails."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import Backend, Slotkeeper, backend_index, backends_config, saved_sessions, wait_until, words

pytestmark = pytest.mark.backend

MODEL = "tiny"
SYSTEM = "You are a patient assistant who answers briefly. " + words(120, 5)
N_SESSIONS = 12


@dataclass
class Cluster:
    keeper: Slotkeeper
    backends: list[Backend]

    def index_of(self, backend: Backend) -> Path:
        return backend_index(self.keeper.cache_dir, MODEL, self.backends.index(backend) + 1)

    def saved(self, backend: Backend) -> dict[str, int]:
        """Session id -> the prompt tokens of its committed snapshot on `backend`."""
        return saved_sessions(self.index_of(backend))

    def by_url(self, url: str) -> Backend:
        return next(b for b in self.backends if b.url == url)


@pytest.fixture
def cluster(tmp_path: Path, backend_kind: str, tiny_model: Path) -> Iterator[Cluster]:
    backends = [Backend(backend_kind, tiny_model, tmp_path / f"slots-{i}", tmp_path / f"backend-{i}.log")
                for i in range(3)]
    for backend in backends:
        backend.start()
    config = backends_config(tmp_path / "slotkeeper.toml", MODEL, backends)
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log",
                        extra_args=("--config", str(config), "--save-idle-seconds", "0.3"))
    try:
        yield Cluster(keeper.start(timeout=120), backends)
    finally:
        keeper.stop()
        for backend in backends:
            backend.stop()


@dataclass
class Chat:
    """One session's conversation through the openai client, and what each of its turns showed."""

    session: str
    messages: list[dict[str, str]] = field(default_factory=list)
    served_by: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # cache_n + prompt_n of each turn
    cache_n: list[int] = field(default_factory=list)
    with_id: bool = True  # False: no session id, as OpenWebUI sends by default (the system prompt places it)
    system: str = SYSTEM

    def turn(self, client: openai.OpenAI) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system})
        seed = len(self.messages) * 7 + sum(map(ord, self.session))
        self.messages.append({"role": "user", "content": words(60, seed)})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=self.messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
            extra_headers={"X-Session-Id": self.session} if self.with_id else {})
        answer = raw.parse()
        timings: dict[str, Any] = raw.http_response.json()["timings"]
        self.served_by.append(raw.headers["x-slotkeeper-backend"])
        self.cache_n.append(int(timings["cache_n"]))
        self.prompt_tokens.append(int(timings["cache_n"]) + int(timings["prompt_n"]))
        self.messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})


def run_turns(chats: list[Chat], client: openai.OpenAI, turns: int, threads: int = 3) -> list[BaseException]:
    """`turns` turns of every chat, the chats shared out over `threads` client threads."""
    errors: list[BaseException] = []

    def worker(mine: list[Chat]) -> None:
        for _ in range(turns):
            for chat in mine:
                try:
                    chat.turn(client)
                except BaseException as exc:  # counted, and the test fails on them
                    errors.append(exc)

    workers = [threading.Thread(target=worker, args=(chats[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


def openai_client(keeper: Slotkeeper) -> openai.OpenAI:
    return openai.OpenAI(base_url=keeper.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_sessions_stay_on_their_backend_reuse_their_history_and_spread_within_the_bound(cluster: Cluster) -> None:
    keeper = cluster.keeper
    listed = openai_client(keeper).models.list()
    assert [m.id for m in listed.data] == [MODEL]  # one model, however many backends
    health = httpx.get(keeper.url + "/health", timeout=30).json()
    assert [b["backend"] for b in health["backends"]] == [b.url for b in cluster.backends]

    chats = [Chat(f"chat-{i}") for i in range(N_SESSIONS)]
    assert run_turns(chats, openai_client(keeper), turns=6) == []
    for chat in chats:
        assert len(set(chat.served_by)) == 1, (chat.session, chat.served_by)
        for turn in range(1, 6):
            assert chat.cache_n[turn] >= chat.prompt_tokens[turn - 1] - 8, (chat.session, turn, chat.cache_n,
                                                                          chat.prompt_tokens)
    loads = Counter(chat.served_by[0] for chat in chats)
    assert set(loads) <= {b.url for b in cluster.backends}
    mean = N_SESSIONS / len(cluster.backends)
    assert max(loads.values()) <= 1.25 * mean, loads
    # Each session's snapshot is on its own backend's disk, and nowhere else.
    wait_until(lambda: sum(len(cluster.saved(b)) for b in cluster.backends) == N_SESSIONS, timeout=30)
    for backend in cluster.backends:
        assert set(cluster.saved(backend)) == {c.session for c in chats if c.served_by[0] == backend.url}


def test_a_killed_backends_sessions_move_with_their_last_committed_state(cluster: Cluster) -> None:
    keeper = cluster.keeper
    client = openai_client(keeper)
    chats = [Chat(f"chat-{i}") for i in range(N_SESSIONS)]
    assert run_turns(chats, client, turns=3) == []
    owner = {chat.session: chat.served_by[-1] for chat in chats}
    victim = cluster.by_url(Counter(owner.values()).most_common(1)[0][0])
    theirs = [c for c in chats if owner[c.session] == victim.url]
    # Every last turn committed (idle saves), so the last committed state of each is its last turn.
    assert wait_until(lambda: all(cluster.saved(cluster.by_url(owner[c.session])).get(c.session)
                                  == c.prompt_tokens[-1] for c in chats), timeout=30)

    # A turn of one of its sessions in flight on the victim when it dies fails in its client's dialect (a stream
    # of the openai client: the error event becomes its APIError).
    doomed = theirs[0]
    with pytest.raises(openai.APIError):
        stream = client.chat.completions.create(
            model=MODEL, messages=[*doomed.messages, {"role": "user", "content": "go on at length"}],  # type: ignore[list-item]
            max_tokens=3000, stream=True, extra_headers={"X-Session-Id": doomed.session},
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        victim.stop(signal.SIGKILL)
        for _ in chunks:
            pass
    committed = cluster.saved(victim)  # read after the kill: what the victim's disk holds

    # Every later request succeeds; the victim's sessions continue elsewhere from their committed snapshots.
    assert run_turns(chats, client, turns=2) == []
    for chat in chats:
        if chat in theirs:
            assert chat.served_by[3] != victim.url
            assert chat.served_by[3] == chat.served_by[4]
            assert chat.cache_n[3] >= committed[chat.session] - 8, (chat.session, chat.cache_n, committed)
        else:
            assert set(chat.served_by) == {owner[chat.session]}  # the others did not move
            assert chat.cache_n[3] >= chat.prompt_tokens[2] - 8
    moved = [line for line in keeper.log_text().splitlines() if "moves to" in line and "owner down" in line]
    assert len(moved) >= len(theirs)
    metrics = httpx.get(keeper.url + "/metrics", timeout=30).text
    moved_in = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("slotkeeper_sessions_moved_in_total{"))
    assert moved_in == len(theirs)
    assert f'slotkeeper_backend_up{{backend="{victim.url}",model="{MODEL}"}} 0.0' in metrics


def test_new_conversations_on_another_backend_start_from_the_system_snapshot_of_the_first(cluster: Cluster) -> None:
    """Conversations without ids on one system prompt go where it is warm until the load bound sends some to the
    next backends on its ring walk; the system part is cut from the first one's slot once it idles, saved once,
    and the others start from it, or from a copy of it on another backend."""
    client = openai_client(cluster.keeper)
    long_system = "You are an agent with a long prompt. " + words(600, 8)  # long enough to be worth a snapshot
    chats = [Chat(f"agent-{i}", with_id=False, system=long_system) for i in range(9)]
    chats[0].turn(client)
    assert wait_until(lambda: "cut back to system prompt" in cluster.keeper.log_text(), timeout=30)
    for chat in chats[1:]:  # one after another: each new one is placed knowing where the others went
        chat.turn(client)
    used = Counter(chat.served_by[0] for chat in chats)
    assert len(used) >= 2 and max(used.values()) <= math.ceil(1.25 * 9 / 3), used  # the bound, rounded up
    log = cluster.keeper.log_text()
    assert log.count("cut back to system prompt") == 1 and "warmed up in slot" not in log, log
    copies = [line for line in log.splitlines() if "for a new conversation" in line]
    assert len(copies) == len(used) - 1  # one per other backend
    system_tokens = int(copies[0].split("snapshot of ")[1].split(" tokens")[0])
    for chat in chats[1:]:
        assert chat.cache_n[0] >= system_tokens - 8, (chat.session, chat.cache_n, system_tokens)


def test_a_drained_backends_sessions_move_at_their_next_turn_with_their_latest_state(cluster: Cluster) -> None:
    keeper = cluster.keeper
    client = openai_client(keeper)
    chats = [Chat(f"drain-{i}") for i in range(6)]
    assert run_turns(chats, client, turns=2, threads=1) == []
    owner = {chat.session: chat.served_by[-1] for chat in chats}
    drained = Counter(owner.values()).most_common(1)[0][0]
    answer = httpx.post(keeper.url + "/api/backend/drain", json={"backend": drained, "draining": True}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert {b["url"]: b["draining"] for b in answer.json()["backends"]}[drained] is True
    # At once: its last session's latest turn may not be saved yet; the move saves it first.
    assert run_turns(chats, client, turns=1, threads=1) == []
    for chat in chats:
        assert chat.served_by[2] != drained
        assert chat.cache_n[2] >= chat.prompt_tokens[1] - 8, (chat.session, chat.cache_n, chat.prompt_tokens)
        if owner[chat.session] != drained:
            assert chat.served_by[2] == owner[chat.session]
    newcomers = [Chat(f"new-{i}") for i in range(6)]
    assert run_turns(newcomers, client, turns=1, threads=1) == []
    assert drained not in {c.served_by[0] for c in newcomers}
    listed = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "backends", "ls", "--url", keeper.url],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "3 backends" in listed.stdout and drained in listed.stdout, listed
    back = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "backends", "undrain", drained, "--url",
                           keeper.url, "--json"], capture_output=True, text=True, timeout=60)
    assert back.returncode == 0, back.stderr
    assert {b["url"]: b["draining"] for b in json.loads(back.stdout)["backends"]}[drained] is False
    missing = httpx.post(keeper.url + "/api/backend/drain", json={"backend": "http://127.0.0.1:1"}, timeout=30)
    assert missing.status_code == 404
    info = httpx.get(keeper.url + "/api/backend", timeout=30).json()
    assert [b["url"] for b in info["backends"]] == [b.url for b in cluster.backends]
