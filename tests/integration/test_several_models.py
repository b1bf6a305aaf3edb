"""Two models behind one slotkeeper (one attached, one launched, both the llama-server binary): requests are routed
by their model name, sessions and files stay in their model's namespace, and a file of one model is never restored
into the other even though the two have identical shapes (the fingerprint check)."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support import Backend, Slotkeeper, llama_server_binary, saved_state_names, wait_until, words

pytestmark = pytest.mark.backend

SYSTEM = {"role": "system", "content": "You are a careful assistant. " + words(300, 3)}


def index_of(cache: Path, name: str) -> Path:
    [path] = (cache / "backends").glob(f"{name}-*/index.sqlite3")
    return path


def rows(index: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(index)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM snapshots")]
    finally:
        db.close()


def ask(client: httpx.Client, model: str, session: str, messages: list[dict[str, str]]) -> httpx.Response:
    response = client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                           json={"model": model, "messages": messages, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    return response


@pytest.fixture
def two_models(tmp_path: Path, tiny_model: Path, foreign_model: Path) -> Any:
    alpha = Backend("binary", tiny_model, tmp_path / "alpha-slots", tmp_path / "alpha.log").start()
    config = tmp_path / "slotkeeper.toml"
    config.write_text(f"""
[[backends]]
name = "alpha"
upstream = "{alpha.url}"
slot_dir = "{alpha.slot_dir}"

[[backends]]
name = "beta"
launch_command = ["{llama_server_binary()}", "-m", "{foreign_model}", "-c", "8192", "-np", "1", "--cache-ram", "0",
                  "-t", "2"]
""")
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", extra_args=("--config", str(config)))
    try:
        yield keeper.start(timeout=120), alpha
    finally:
        keeper.stop()
        alpha.stop()


def test_requests_go_to_the_model_they_name_and_sessions_stay_apart(two_models: Any) -> None:
    keeper, _ = two_models
    cache = keeper.cache_dir
    listed = openai.OpenAI(base_url=keeper.url + "/v1", api_key="unused").models.list()
    assert [m.id for m in listed.data] == ["alpha", "beta"]
    with httpx.Client(base_url=keeper.url, timeout=120) as client:
        tags = client.get("/api/tags").json()["models"]
        assert [t["name"] for t in tags] == ["alpha:latest", "beta:latest"]
        health = client.get("/health").json()
        assert [b["model"] for b in health["backends"]] == ["alpha", "beta"]
        assert all(b["up"] for b in health["backends"])

        # One session id on both models: two conversations, one per model, each in its own namespace.
        history = {m: [SYSTEM, {"role": "user", "content": f"{m} first " + words(200, i)}]
                   for i, m in enumerate(("alpha", "beta"))}
        for model in ("alpha", "beta"):
            ask(client, model, "shared", history[model])
        for model in ("alpha", "beta"):  # displace each from its only slot, so the next turn must restore
            ask(client, model, "other", [{"role": "user", "content": words(100, 9)}])
        for model in ("alpha", "beta"):
            history[model] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
            again = ask(client, model, "shared", history[model])
            assert again.headers["x-slotkeeper-cache"] == "restored"
            assert again.json()["timings"]["cache_n"] > 200

        # Other dialects route by model name too; an unknown name is a 404 in each client's own shape.
        ollama_chat = client.post("/api/chat", json={"model": "beta", "stream": False,
                                                     "messages": [{"role": "user", "content": "hi"}],
                                                     "options": {"num_predict": 2}})
        assert ollama_chat.status_code == 200 and ollama_chat.json()["model"] == "beta"
        missing = client.post("/v1/chat/completions", json={"model": "gamma", "messages": [
            {"role": "user", "content": "hi"}]})
        assert missing.status_code == 404 and "'gamma' not found" in missing.json()["error"]["message"]
        assert client.post("/api/chat", json={"model": "gamma", "messages": []}).json()["error"].startswith(
            "model 'gamma' not found")
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=keeper.url, api_key="unused", max_retries=0).messages.create(
            model="gamma", max_tokens=2, messages=[{"role": "user", "content": "hi"}])

    def sessions(name: str) -> set[tuple[str, str]]:
        return {(r["model"], r["session_id"]) for r in rows(index_of(cache, name)) if r["kind"] == "session"}

    # The last displaced sessions' saves commit in the background.
    assert wait_until(lambda: all((m, "other") in sessions(m) for m in ("alpha", "beta")), timeout=30)
    alpha_rows, beta_rows = rows(index_of(cache, "alpha")), rows(index_of(cache, "beta"))
    assert sessions("alpha") == {("alpha", "shared"), ("alpha", "other")}
    assert sessions("beta") == {("beta", "shared"), ("beta", "other")}
    assert {r["fingerprint"] for r in alpha_rows}.isdisjoint({r["fingerprint"] for r in beta_rows})
    beta_slots = next((cache / "backends").glob("beta-*")) / "slots" / "launch"
    assert {r["filename"] for r in beta_rows} <= saved_state_names(beta_slots)
    assert not {r["filename"] for r in alpha_rows} & saved_state_names(beta_slots)


def test_a_file_of_one_model_is_never_restored_into_the_other(two_models: Any) -> None:
    keeper, alpha = two_models
    cache = keeper.cache_dir
    messages = [{"role": "user", "content": "crossed " + words(300, 5)}]
    with httpx.Client(base_url=keeper.url, timeout=120) as client:
        ask(client, "alpha", "crossed", messages)
        ask(client, "alpha", "other", [{"role": "user", "content": words(100, 9)}])  # saves "crossed"

        def crossed() -> list[dict[str, Any]]:
            return [r for r in rows(index_of(cache, "alpha")) if r["session_id"] == "crossed"]

        assert wait_until(crossed, timeout=30), keeper.log_text()[-3000:]  # the save commits in the background
        [row] = crossed()
        # Someone copies alpha's snapshot, file and row, into beta's slot dir and index under beta's name. The two
        # models have the same shapes, so llama-server itself would restore it without a word.
        beta_slots = next((cache / "backends").glob("beta-*")) / "slots" / "launch"
        stored = row["filename"] + (".tail" if row["tail_bytes"] else "")  # a whole file, or a state's tail
        shutil.copy(alpha.slot_dir / stored, beta_slots / stored)
        db = sqlite3.connect(index_of(cache, "beta"))
        columns = ", ".join(row)
        db.execute(f"INSERT INTO snapshots ({columns}) VALUES ({', '.join('?' * len(row))})",
                   [{**row, "model": "beta"}[c] for c in row])
        db.commit()
        db.close()

        response = ask(client, "beta", "crossed", messages)
    assert response.headers["x-slotkeeper-cache"] != "restored"
    assert response.json()["timings"]["cache_n"] < 50  # prefilled, not taken from alpha's state
    assert "snapshot beta/crossed was made by another model or slot layout" in keeper.log_text()
