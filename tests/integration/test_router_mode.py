"""slotkeeper in front of llama-server's router mode (the real binary, `--models-dir` with two dense models and a
hybrid one, `--models-max 1`): launched by slotkeeper (one router shared by the module's tests) and attached to.
A swap saves the unloaded model's slots first and its conversations restore after it comes back; an answer is never
cut off by a request for another model; nothing slotkeeper does on its own loads a model; the model lists show every
model the router offers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.integration.test_model_restores import assert_same_distribution, top_logprobs
from tests.support import Slotkeeper, free_port, llama_server_binary, timings, wait_healthy, wait_until, words

pytestmark = [pytest.mark.backend, pytest.mark.timeout(300)]

MODELS = {"alpha": TinyModelSpec(seed=11, name="alpha"), "beta": TinyModelSpec(seed=12, name="beta"),
          "gamma": TinyModelSpec(arch="jamba", seed=13, name="gamma"),
          "recurrent": TinyModelSpec(arch="mamba", seed=14, name="recurrent"),
          "sliding": TinyModelSpec(arch="gemma3", seed=15, name="sliding")}


def router_args(models_dir: Path) -> list[str]:
    return [str(llama_server_binary()), "--models-dir", str(models_dir), "--models-max", "1", "-c", "4096", "-np", "1",
            "--cache-ram", "0", "-t", "2"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("router-models")
    for name, spec in MODELS.items():
        write_tiny_model(path / f"{name}.gguf", spec)
    (path / "broken.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)  # listed by the router; its load fails
    return path


@pytest.fixture(scope="module")
def keeper(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slotkeeper]:
    """slotkeeper launching the router itself."""
    root = tmp_path_factory.mktemp("router-launch")
    started = Slotkeeper(root / "cache", root / "slotkeeper.log",
                         extra_args=("--swap-wait-seconds", "60", "--", *router_args(models_dir))).start(timeout=120)
    try:
        yield started
    finally:
        started.stop()


def conversation(tag: str, n_words: int = 600) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are {tag}. " + words(n_words, hash(tag) % 1000)},
            {"role": "user", "content": f"a first question for {tag}"}]


def ask(client: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int = 3) -> httpx.Response:
    response = client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                         "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response


def loaded(client: httpx.Client) -> dict[str, str]:
    return {m["model"]: m["status"] for m in client.get("/health").json()["models"]}


@pytest.mark.parametrize("model", ["alpha", "gamma", "recurrent", "sliding"])
def test_a_model_back_after_a_swap_restores_its_conversation(keeper: Slotkeeper, model: str) -> None:
    """A, then B (which unloads A: --models-max 1), then A again: A's return turn (its history as the client keeps
    it, not the tokens generated) gets the next token's log-probabilities a fresh prefill of the same prompt gets on
    the router itself, on a dense, a hybrid, a recurrent and a sliding-window model; but for the last, it reuses all
    it had (>= 90 % of its prompt) from the state saved before the unload."""
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        messages = conversation(f"{model}-swap")
        first = ask(client, model, messages)
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and a second one"}]
        other = "beta"
        ask(client, other, conversation(f"{other}-for-{model}"))
        assert loaded(client)[model] != "loaded"
        probe = {"logprobs": True, "top_logprobs": 5, "grammar": "root ::= [a-z]+"}
        back = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1,
                                                          "temperature": 0, **probe})
        router = client.get("/api/backend", params={"model": model}).json()["url"]
        fresh = httpx.post(f"{router}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False, **probe})
        assert_same_distribution(top_logprobs(back), top_logprobs(fresh), f"{model} after a swap")
        # The sliding-window model is prefilled: this build keeps no context checkpoints in its slot files, and
        # slotkeeper restores such a state only where that is known to keep the answer (docs/architectures.md), as
        # in front of a single server.
        if model != "sliding":
            reused = timings(back)
            assert reused["cache_n"] >= 0.9 * (reused["cache_n"] + reused["prompt_n"]), reused
        log = keeper.log_text()
        assert re.search(rf"model '{model}' unloaded \(to make room for '{other}'\) in \d+ ms \(saving \d+ ms\); "
                         r"1 changed slot\(s\) were saved first", log)


def test_a_request_for_another_model_never_cuts_a_running_answer_off(keeper: Slotkeeper) -> None:
    """A long streamed answer of alpha runs while beta is asked for: alpha's answer ends by its length, whole, and
    alpha is unloaded for beta only after it."""
    start = len(keeper.log_text().splitlines())
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        ask(client, "alpha", conversation("alpha-warm", 50))  # alpha loaded, so the stream starts at once
    chunks: list[str] = []
    finish: list[str | None] = []
    generated: list[int] = []

    def stream_alpha() -> None:
        sdk = openai.OpenAI(base_url=f"{keeper.url}/v1", api_key="unused", timeout=300)
        stream = sdk.chat.completions.create(model="alpha", messages=conversation("alpha-long", 50),  # type: ignore[arg-type]
                                             max_tokens=1000, temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.usage is not None:
                generated.append(chunk.usage.completion_tokens)
            if chunk.choices:
                chunks.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason is not None:
                    finish.append(chunk.choices[0].finish_reason)

    runner = threading.Thread(target=stream_alpha)
    runner.start()
    assert wait_until(lambda: len(chunks) >= 5, 60)
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        ask(client, "beta", conversation("beta-waits", 50))
    runner.join(120)
    assert finish == ["length"] and generated == [1000]
    # Alpha was unloaded (and beta loaded) only after its two turns had ended: each turn's line is written once its
    # answer was sent whole. (Whether the client's thread had seen the end before beta's answer came is the client's
    # timing: on a loaded machine it once had not, 140 ms after the server's line.)
    log = keeper.log_text().splitlines()[start:]
    turns = [i for i, line in enumerate(log) if "openai.chat session=alpha/" in line and "end=completed" in line]
    [unloaded] = [i for i, line in enumerate(log) if "model 'alpha' unloaded (to make room for 'beta')" in line]
    assert len(turns) == 2 and max(turns) < unloaded


def test_model_lists_show_every_model_and_loading_is_a_clients_ask(keeper: Slotkeeper) -> None:
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        before = loaded(client)
        tags = {m["name"] for m in client.get("/api/tags").json()["models"]}
        assert tags == {f"{name}:latest" for name in [*MODELS, "broken"]}
        assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {*MODELS, "broken"}
        shown = client.post("/api/show", json={"model": "gamma"})
        assert shown.status_code == 200
        assert loaded(client) == before  # listing and describing load nothing
        ps = {m["name"] for m in client.get("/api/ps").json()["models"]}
        assert ps == {f"{n}:latest" for n, s in before.items() if s == "loaded"}
        # An Ollama chat with no messages loads the model (Ollama's way to load one).
        assert client.post("/api/chat", json={"model": "beta", "messages": []}).status_code == 200
        assert loaded(client)["beta"] == "loaded"
        assert {m["name"] for m in client.get("/api/ps").json()["models"]} == {"beta:latest"}
        # keep_alive: a duration shows in /api/ps; 0 unloads at once (nothing loads it meanwhile).
        assert client.post("/api/generate", json={"model": "beta", "keep_alive": "10m"}).status_code == 200
        [running] = client.get("/api/ps").json()["models"]
        assert running["expires_at"] < "2100"  # ten minutes from now, not Ollama's "for ever"
        unload = client.post("/api/generate", json={"model": "beta", "keep_alive": 0})
        assert unload.status_code == 200 and unload.json()["done_reason"] == "unload"
        assert loaded(client)["beta"] == "unloaded" and client.get("/api/ps").json()["models"] == []
        unknown = client.post("/api/chat", json={"model": "delta", "messages": [{"role": "user", "content": "x"}]})
        assert unknown.status_code == 404 and "delta" in unknown.json()["error"]
        missing = client.post("/v1/chat/completions", json={"model": "delta", "messages": [{"role": "user",
                                                                                             "content": "x"}]})
        assert missing.status_code == 404
        # A model the router cannot load: the client's own error, and the other models go on.
        ask(client, "alpha", conversation("alpha-before-broken", 50))
        refused = client.post("/api/chat", json={"model": "broken", "messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 502 and "did not start" in refused.json()["error"]
        sdk = openai.OpenAI(base_url=f"{keeper.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as raised:
            sdk.chat.completions.create(model="broken", messages=[{"role": "user", "content": "x"}])
        assert raised.value.status_code == 502
        assert loaded(client)["broken"] == "unloaded"
        ask(client, "alpha", conversation("alpha-after-broken", 50))


def test_a_killed_child_costs_a_restore_and_nothing_saved(keeper: Slotkeeper, models_dir: Path) -> None:
    """kill -9 of the model's own server (a child of the router): its next turn restores the last saved state."""
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        messages = conversation("alpha-kill")
        first = ask(client, "alpha", messages)
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "after the kill"}]
        # The state is saved when it leaves its slot: another conversation of alpha takes the one slot.
        ask(client, "alpha", conversation("alpha-other", 100))
        child = _child_pid(models_dir / "alpha.gguf")
        os.kill(child, signal.SIGKILL)
        assert wait_until(lambda: loaded(client)["alpha"] != "loaded", 30)
        back = timings(ask(client, "alpha", messages))
        assert back["cache_n"] >= 0.9 * (back["cache_n"] + back["prompt_n"]), back


def test_a_killed_router_is_started_again_and_costs_a_restore(keeper: Slotkeeper, models_dir: Path) -> None:
    """kill -9 of the router slotkeeper launched: it is started again, and the conversation's next turn restores."""
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        messages = conversation("gamma-router-kill")
        first = ask(client, "gamma", messages)
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "after the router's kill"}]
        ask(client, "gamma", conversation("gamma-other", 100))  # the first conversation's state leaves its slot
        router = _pid_with(str(models_dir).encode(), b"--models-dir")
        os.kill(router, signal.SIGKILL)
        assert wait_until(lambda: _pid_with(str(models_dir).encode(), b"--models-dir", missing_ok=True)
                          not in (None, router), 60)
        assert wait_until(lambda: client.get("/health").status_code == 200, 60)
        back = timings(ask(client, "gamma", messages))
        assert back["cache_n"] >= 0.9 * (back["cache_n"] + back["prompt_n"]), back


def _pid_with(*words: bytes, missing_ok: bool = False) -> int | None:
    """The pid of the llama-server whose command line has each of `words` (whole)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0] == str(llama_server_binary()).encode() and all(w in argv for w in words):
            return int(entry.name)
    if missing_ok:
        return None
    raise AssertionError(f"no process with {words}")


def _child_pid(model: Path) -> int:
    """The pid of the router's child serving the model file `model` (its command line names it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(model).encode() in argv and b"--alias" in argv:
            return int(entry.name)
    raise AssertionError(f"no child server of {model}")


def test_attach_to_a_running_router_loads_nothing_at_start(models_dir: Path, tmp_path: Path) -> None:
    """slotkeeper attached to a router someone else runs: it starts without loading any model, and a turn then
    loads the one it names; its slot saves land in the router's --slot-save-path."""
    slots = tmp_path / "slots"
    slots.mkdir()
    port = free_port()
    argv = [*router_args(models_dir), "--host", "127.0.0.1", "--port", str(port), "--slot-save-path", f"{slots}/"]
    with (tmp_path / "router.log").open("ab") as log:
        router = subprocess_popen(argv, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", router, 60)
        keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log",
                            extra_args=("--upstream", f"http://127.0.0.1:{port}", "--slot-dir", str(slots)))
        keeper.start(timeout=60)
        try:
            with httpx.Client(base_url=keeper.url, timeout=300) as client:
                assert set(loaded(client).values()) == {"unloaded"}
                ask(client, "beta", conversation("beta-attach", 100))
                assert loaded(client)["beta"] == "loaded"
                ask(client, "beta", conversation("beta-attach-2", 100))  # the first one's state is saved
            rows = keeper.index_rows()
        finally:
            keeper.stop()
        assert {r["model"] for r in rows} == {"beta"} and any(r["n_tokens"] > 100 for r in rows)
        assert any(slots.iterdir())
    finally:
        router.terminate()
        router.wait(10)


def test_a_router_started_again_with_other_kv_types_restores_nothing_saved_under_the_old(
        models_dir: Path, tmp_path: Path) -> None:
    """The router slotkeeper is attached to is started again with bf16 K/V (the same port, slot dir and model files):
    a state saved under f16 is not restored under bf16; with f16 again, the states saved under it are."""
    slots = tmp_path / "slots"
    slots.mkdir()
    port = free_port()

    def start(*extra: str) -> Any:
        argv = [*router_args(models_dir), "--host", "127.0.0.1", "--port", str(port), "--slot-save-path", f"{slots}/",
                *extra]
        with (tmp_path / "router.log").open("ab") as log:
            process = subprocess_popen(argv, log)
        wait_healthy(f"http://127.0.0.1:{port}", process, 60)
        return process

    router = start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log",
                        extra_args=("--upstream", f"http://127.0.0.1:{port}", "--slot-dir", str(slots)))
    keeper.start(timeout=60)
    try:
        with httpx.Client(base_url=keeper.url, timeout=300) as client:
            talks = {tag: conversation(tag, 300) for tag in ("alpha-x", "alpha-y")}
            for messages in talks.values():  # each saved when the next one takes the slot
                first = ask(client, "alpha", messages)
                messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "and then"}]
            ask(client, "alpha", conversation("alpha-z", 50))
            for kv, tag, reused in ((("-ctk", "bf16", "-ctv", "bf16"), "alpha-x", False), ((), "alpha-y", True)):
                router.terminate()
                router.wait(30)
                router = start(*kv)
                assert wait_until(lambda: loaded(client).get("alpha") == "unloaded", 30)
                back = timings(ask(client, "alpha", talks[tag]))
                prompt = back["cache_n"] + back["prompt_n"]
                if reused:
                    assert back["cache_n"] >= 0.9 * prompt, back
                else:
                    assert back["cache_n"] < 0.1 * prompt, back
                ask(client, "alpha", conversation(f"alpha-after-{tag}", 50))
    finally:
        keeper.stop()
        router.terminate()
        router.wait(30)
    log = keeper.log_text()
    assert "the KV check" in log


def subprocess_popen(argv: list[str], log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def test_slotkeeper_models_shows_each_model_and_what_its_unload_saved(keeper: Slotkeeper) -> None:
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        ask(client, "beta", conversation("beta-shown", 100))
        ask(client, "alpha", conversation("alpha-shown", 100))
        listed = {m["model"]: m for m in client.get("/api/models").json()["models"]}
    assert listed["alpha"]["status"] == "loaded" and listed["beta"]["status"] == "unloaded"
    assert listed["beta"]["unloads"] >= 1 and len(listed["beta"]["saved_at_last_unload"]) == 1
    run = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "models", "--url", keeper.url],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[:3] == ["MODEL", "STATE", "TURNS"]
    beta = next(line for line in lines if line.startswith("beta "))
    assert "unloaded" in beta and listed["beta"]["saved_at_last_unload"][0] in beta
    sessions = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "sessions", "ls", "--url", keeper.url],
                              capture_output=True, text=True, timeout=60)
    assert sessions.returncode == 0, sessions.stderr
    assert "alpha loaded" in sessions.stdout.splitlines()[-1] and "beta unloaded" in sessions.stdout


def test_nothing_of_its_own_loads_a_model(keeper: Slotkeeper) -> None:
    """A minute of slotkeeper's own work (watch, idle saves, metrics, the dashboard's reads) while one model is
    loaded: the others stay unloaded."""
    with httpx.Client(base_url=keeper.url, timeout=300) as client:
        ask(client, "gamma", conversation("gamma-alone", 100))
        for path in ("/metrics", "/api/sessions", "/api/tags", "/v1/models", "/api/ps", "/health", "/props?model=gamma",
                     "/slots?model=gamma"):
            assert client.get(path).status_code == 200, path
        time.sleep(3)
        assert loaded(client) == {**dict.fromkeys([*MODELS, "broken"], "unloaded"), "gamma": "loaded"}


def test_own_backends_take_turns_within_max_loaded(models_dir: Path, tmp_path: Path) -> None:
    """slotkeeper's own two `[[backends]]` (the binary and the embedded server) with `max_loaded = 1`: only one runs at
    a time; the one stopped saved its changed slots first, and its conversation restores when it runs again."""
    config = tmp_path / "slotkeeper.toml"
    config.write_text(f"""
max_loaded = 1

[[backends]]
name = "alpha"
launch_command = ["{llama_server_binary()}", "-m", "{models_dir / 'alpha.gguf'}", "-c", "4096", "-np", "1",
                  "--cache-ram", "0", "-t", "2"]

[[backends]]
name = "beta"
model = "{models_dir / 'beta.gguf'}"
ctx_size = 4096
""")
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", extra_args=("--config", str(config)))
    keeper.start(timeout=120)
    try:
        with httpx.Client(base_url=keeper.url, timeout=300) as client:
            assert loaded(client) == {"alpha": "loaded", "beta": "unloaded"}  # the first max_loaded start with it
            messages = conversation("own-alpha")
            first = ask(client, "alpha", messages)
            messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "and again"}]
            ask(client, "beta", conversation("own-beta", 100))
            assert loaded(client) == {"alpha": "unloaded", "beta": "loaded"}
            assert _pid_with(str(models_dir / "alpha.gguf").encode(), missing_ok=True) is None  # its server stopped
            back = timings(ask(client, "alpha", messages))
            assert back["cache_n"] >= 0.9 * (back["cache_n"] + back["prompt_n"]), back
            models = {m["model"]: m for m in client.get("/api/models").json()["models"]}
            assert models["beta"]["unloads"] == 1 and len(models["beta"]["saved_at_last_unload"]) == 1
            assert {m["name"] for m in client.get("/api/tags").json()["models"]} == {"alpha:latest", "beta:latest"}
    finally:
        keeper.stop()
