"""A saved state is used only under the KV settings it was made with (issue 37): slotkeeper in front of a real
llama-server it attaches to (so nothing but the server itself tells the settings), a conversation saved, the server
restarted under another K/V type or rope base with the same slot dir, and then under the first settings again.

Confirmed at 99614b5: the fingerprint left the KV's types and rope out, so a state saved under f16 was handed to a
bf16 server (f16 and bf16 rows are of one size; blocks assembled from the f16 save gave the bf16 server f16 bits).
Counts only: the cache header, cache_n and prompt_n of each turn."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import Backend, Slotkeeper, chat, timings, wait_until, words

pytestmark = pytest.mark.backend

F16 = ("-ctk", "f16", "-ctv", "f16")
OTHER = {
    "bf16": ("-ctk", "bf16", "-ctv", "bf16"),
    "rope-base": (*F16, "--rope-freq-base", "5000"),
    "v-transposed": (*F16, "-fa", "off"),
}


@pytest.mark.parametrize("other", sorted(OTHER))
def test_a_state_saved_under_one_kv_setting_is_used_only_under_that_setting(tmp_path: Path, tiny_model: Path,
                                                                            other: str) -> None:
    slot_dir, cache_dir = tmp_path / "slots", tmp_path / "cache"
    messages = [{"role": "system", "content": "You are a helpful assistant. " + words(300, 3)},
                {"role": "user", "content": words(60, 4)}]

    def run(options: tuple[str, ...], session: str, history: list[dict[str, str]]) -> httpx.Response:
        backend = Backend("binary", tiny_model, slot_dir, tmp_path / f"backend-{other}.log", extra_args=options)
        keeper = Slotkeeper(cache_dir, tmp_path / "slotkeeper.log", backend, ("--block-tokens", "16"))
        backend.start()
        try:
            keeper.start()
            with httpx.Client(base_url=keeper.url, timeout=120) as client:
                response = chat(client, history, session)
                assert response.status_code == 200, response.text
        finally:
            keeper.stop()  # saves the slot on the way out
            backend.stop()
        return response

    first = run(F16, "s", messages)
    history = [*messages, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
               {"role": "user", "content": words(30, 5)}]
    # Another conversation with s's history, under other settings: s's state shares its every token, and must not
    # be used (nor any of its blocks).
    moved = run(OTHER[other], "t", history)
    assert moved.headers["x-slotkeeper-cache"] != "restored", moved.headers
    assert timings(moved)["cache_n"] == 0, timings(moved)
    # Back under the settings s was saved with: its state is used.
    back = run(F16, "s", history)
    assert back.headers["x-slotkeeper-cache"] == "restored", back.headers
    assert timings(back)["cache_n"] >= timings(first)["prompt_n"], (timings(first), timings(back))
    log = (tmp_path / "slotkeeper.log").read_text()
    settings = [line.split("setting ")[1].split(" ")[0] for line in log.splitlines() if "the backend's KV:" in line]
    assert len(settings) == 3 and settings[0] == settings[2] != settings[1], settings


def test_an_attached_server_restarted_under_other_settings_is_probed_again(tmp_path: Path, tiny_model: Path) -> None:
    """slotkeeper keeps running while the server it attaches to is restarted: under another rope base its states are
    not restored; under the first settings again, they are."""
    slot_dir = tmp_path / "slots"
    backend = Backend("binary", tiny_model, slot_dir, tmp_path / "backend.log", extra_args=F16).start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", backend,
                        ("--block-tokens", "16", "--save-idle-seconds", "0.2")).start()
    messages = [{"role": "system", "content": "You are a helpful assistant. " + words(300, 6)},
                {"role": "user", "content": words(60, 7)}]
    try:
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            first = chat(client, messages, "s")
            assert first.status_code == 200, first.text
            history = [*messages, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": words(30, 8)}]

            def restart(options: tuple[str, ...]) -> None:
                count = keeper.log_text().count("the backend restarted with")
                backend.stop()
                backend.extra_args = options
                backend.start()
                # The watch sees another process, and the probe after it runs (a line in the log each time).
                assert wait_until(lambda: keeper.log_text().count("the backend restarted with") > count, timeout=30)

            assert wait_until(lambda: keeper.row("s") is not None, timeout=30)  # saved while idle
            restart(OTHER["rope-base"])
            moved = chat(client, history, "t")
            assert moved.status_code == 200, moved.text
            assert timings(moved)["cache_n"] == 0 and moved.headers["x-slotkeeper-cache"] != "restored"
            assert "restarted with other KV settings" in keeper.log_text()
            restart(F16)
            back = chat(client, history, "s")
            assert back.status_code == 200, back.text
            assert back.headers["x-slotkeeper-cache"] == "restored", back.headers
            assert timings(back)["cache_n"] >= timings(first)["prompt_n"]
    finally:
        keeper.stop()
        backend.stop()
