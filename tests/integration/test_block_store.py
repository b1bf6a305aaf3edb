"""The block store on both real backends (llama.cpp b11434 and b11549) and every architecture of the tiny-model
generator: saved states are kept as KV blocks and tails (no whole file stays in the slot dir where the format was
recognised), two conversations on one system prompt store its blocks once, a restore assembles the file from
blocks (some written by the other conversation's save), and the next token's log-probabilities equal a fresh
prefill's. Counts only: files, bytes, cache_n, log-probabilities."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotkeeper.cache.blockstore import BLOCK_HEADER_BYTES, BLOCKS_DIR, TAIL_SUFFIX
from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.conftest import Stack
from tests.integration.test_model_restores import Session, assert_same_distribution, top_logprobs
from tests.support import Backend, ObjectStoreServer, Slotkeeper, chat, timings, wait_until, words

pytestmark = pytest.mark.backend

BLOCK_TOKENS = 16
# Architectures whose slot files hold attention KV of positions 0..n-1 (mamba holds none: kept whole).
SPLIT = {"llama", "jamba", "lfm2", "gemma3"}


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("block-models")
    out = {}
    for arch in ("llama", "mamba", "jamba", "lfm2", "gemma3"):
        out[arch] = directory / f"{arch}.gguf"
        write_tiny_model(out[arch], TinyModelSpec(arch=arch))  # type: ignore[arg-type]
    return out


def _blocks(slot_dir: Path) -> list[Path]:
    return sorted((slot_dir / BLOCKS_DIR).rglob("*.blk"))


@pytest.mark.parametrize("arch", ["llama", "mamba", "jamba", "lfm2", "gemma3"])
def test_states_kept_as_blocks_restore_to_the_same_answers(stack: Stack, client_for, arch_models: dict[str, Path],
                                                           arch: str, tmp_path: Path) -> None:
    backend = stack.backend(model=arch_models[arch], cache_ram=0)
    keeper = stack.slotkeeper(backend, "--block-tokens", str(BLOCK_TOKENS), "--save-idle-seconds", "-1")
    client = client_for(keeper)
    system = "You are a helpful assistant. " + words(250, 5)
    a = Session(client, "a", system, 21)
    b = Session(client, "b", system, 22)
    a.turn()
    a.answer()
    b.turn()  # a's state is saved on the switch: the system prompt's blocks, and a's own
    b.answer()
    a.turn()  # b's state is saved: the system prompt's blocks exist already
    a.answer()
    client.get("/api/sessions/current")  # answers once the saves' commits are done
    slot_dir = backend.slot_dir
    tails = sorted(slot_dir.glob("*" + TAIL_SUFFIX))
    wholes = [p for p in slot_dir.glob("*.bin") if p.is_file()]
    if arch in SPLIT:
        assert tails and not wholes, (tails, wholes)
        stored = sum(p.stat().st_size for p in _blocks(slot_dir))
        assert stored > 0
    else:
        assert not tails and wholes

    reference = Backend(stack.kind, arch_models[arch], tmp_path / "reference-slots", tmp_path / "reference.log")
    reference.start()
    try:
        fresh_client = httpx.Client(base_url=reference.url, timeout=120)
        body = {"logprobs": True, "top_logprobs": 5, "grammar": "root ::= [a-z]+"}
        # b's state comes back from blocks, the system prompt's among them written by a's save.
        response = chat(client, b.messages, b.name, max_tokens=1, **body)
        fresh = fresh_client.post("/v1/chat/completions", json={
            "messages": b.messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False, **body})
        assert_same_distribution(top_logprobs(response), top_logprobs(fresh), f"{arch} from blocks")
        if arch == "llama" or stack.kind == "embedded":
            assert response.headers["x-slotkeeper-cache"] == "restored", response.headers
        fresh_client.close()
    finally:
        reference.stop()
    assert wait_until(lambda: not [p for p in slot_dir.glob("*.bin") if p.is_file()] or arch not in SPLIT,
                      timeout=10, interval=0.1), "an assembled file stayed in the slot dir after the restore"


@pytest.mark.parametrize("options", [("-fa", "off"), ("-fa", "on", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0")],
                         ids=["v-transposed", "q8_0"])
def test_other_kv_layouts_restore_from_blocks_to_the_same_answers(stack: Stack, client_for, tmp_path: Path,
                                                                  options: tuple[str, ...]) -> None:
    """The binary with flash attention off (V stored transposed: a run per element) and with quantized KV."""
    if stack.kind != "binary":
        pytest.skip("llama-server options: the binary only")
    backend = stack.backend(cache_ram=0, extra_args=options)
    keeper = stack.slotkeeper(backend, "--block-tokens", str(BLOCK_TOKENS), "--save-idle-seconds", "-1")
    client = client_for(keeper)
    system = "You are a helpful assistant. " + words(250, 5)
    a, b = Session(client, "a", system, 21), Session(client, "b", system, 22)
    a.turn()
    a.answer()
    b.turn()
    b.answer()
    a.turn()  # b's state is saved as blocks
    client.get("/api/sessions/current")
    assert list(backend.slot_dir.glob("*" + TAIL_SUFFIX)) and _blocks(backend.slot_dir)
    reference = Backend("binary", stack.model, tmp_path / "reference-slots", tmp_path / "reference.log",
                        extra_args=options).start()
    try:
        body = {"logprobs": True, "top_logprobs": 5, "grammar": "root ::= [a-z]+"}
        response = chat(client, b.messages, b.name, max_tokens=1, **body)
        fresh = httpx.post(f"{reference.url}/v1/chat/completions", timeout=120, json={
            "messages": b.messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False, **body})
        assert response.headers["x-slotkeeper-cache"] == "restored", response.headers
        assert_same_distribution(top_logprobs(response), top_logprobs(fresh), f"{options} from blocks")
    finally:
        reference.stop()


def test_twenty_conversations_on_one_system_prompt_store_it_once(stack: Stack, client_for) -> None:
    """The dense model: the system prompt's KV is in the store once, not once per conversation."""
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend, "--block-tokens", str(BLOCK_TOKENS), "--save-idle-seconds", "-1")
    client = client_for(keeper)
    system = "You are a helpful assistant. " + words(400, 9)
    sessions = [Session(client, f"c{i}", system, 100 + i, size=20) for i in range(6)]
    for session in sessions:
        session.turn(max_tokens=4)
    last = Session(client, "last", "Another system prompt. " + words(50, 1), 1, size=20)
    last.turn(max_tokens=4)  # the sixth conversation's state is saved too
    slot_dir = backend.slot_dir
    assert wait_until(lambda: len(list(slot_dir.glob("*" + TAIL_SUFFIX))) >= 6, timeout=30, interval=0.2)
    blocks = _blocks(slot_dir)
    sizes = [p.stat().st_size for p in blocks]
    # Blocks end on the grid, or where a state's cells end: a full grid step is the largest, one layout's.
    per_token = (max(sizes) - BLOCK_HEADER_BYTES) / BLOCK_TOKENS
    cells = sum(size - BLOCK_HEADER_BYTES for size in sizes) / per_token
    rows = httpx.get(f"{keeper.url}/api/sessions").json()["sessions"]
    assert all(r["stored_as"] == "blocks" for r in rows), rows
    tokens = sum(r["tokens"] for r in rows if r["session"].startswith("c"))
    # Six conversations of about 450 tokens each, sharing about 420: whole files would hold ~2,700 tokens of KV;
    # the store holds the shared part once (under 2 x one conversation's cells).
    assert cells < tokens / 2, (len(blocks), cells, tokens)
    # What the API and the metrics say: each block once, and less on disk than the states' whole sizes.
    disk = httpx.get(f"{keeper.url}/api/sessions/disk").json()
    assert disk["blocks"] == {"count": len(blocks), "bytes": sum(sizes)}
    assert disk["stored_bytes"] < disk["bytes"] / 2
    metrics = httpx.get(f"{keeper.url}/metrics").text
    gauges = {m[0]: float(m[1]) for m in re.findall(r"^(slotkeeper_\w+) (\S+)$", metrics, re.MULTILINE)}
    assert gauges["slotkeeper_kv_blocks"] == len(blocks)
    assert gauges["slotkeeper_stored_bytes"] == disk["stored_bytes"]


# -- the shared tier: blocks move between hosts ---------------------------------------------------------------------

PREFIX = "team-blocks"


def _kv_objects(store: ObjectStoreServer) -> dict[str, int]:
    s3 = store.client()
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=f"{PREFIX}/kv/"):
        for item in page.get("Contents", []):
            found[str(item["Key"])] = int(item["Size"])
    return found


def _object(store: ObjectStoreServer, key: str) -> bytes | None:
    s3 = store.client()
    try:
        return s3.get_object(Bucket=store.bucket, Key=key)["Body"].read()  # type: ignore[no-any-return]
    except s3.exceptions.NoSuchKey:
        return None


def _manifest(store: ObjectStoreServer, session: str) -> dict[str, Any] | None:
    s3 = store.client()
    for key in store.keys(f"{PREFIX}/manifests/"):
        data = json.loads(s3.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        if data["session"] == session and "/session/" in key:
            return data  # type: ignore[no-any-return]
    return None


@contextmanager
def _two_hosts(tmp_path: Path, kind: str, model: Path) -> Iterator[tuple[ObjectStoreServer, list[tuple[Backend,
                                                                                                  Slotkeeper]]]]:
    """Hosts a and b (a backend and a slotkeeper each, blocks of BLOCK_TOKENS) sharing one object store."""
    store = ObjectStoreServer(tmp_path / "s3.log").start()
    started: list[tuple[Backend, Slotkeeper]] = []
    try:
        for name in ("a", "b"):
            backend = Backend(kind, model, tmp_path / f"{name}-slots", tmp_path / f"{name}-backend.log").start()
            keeper = Slotkeeper(tmp_path / f"{name}-cache", tmp_path / f"{name}.log", upstream=backend, extra_args=(
                "--shared-store", f"s3://{store.bucket}/{PREFIX}", "--shared-endpoint", store.url,
                "--save-idle-seconds", "0.3", "--block-tokens", str(BLOCK_TOKENS)))
            started.append((backend, keeper.start(timeout=120)))
        yield store, started
    finally:
        for backend, keeper in started:
            keeper.stop()
            backend.stop()
        store.stop()


def test_blocks_move_between_hosts_and_a_block_missing_from_the_store_costs_a_prefill(
        tmp_path: Path, backend_kind: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with _two_hosts(tmp_path, backend_kind, tiny_model) as (store, started):
        (_, keeper_a), (backend_b, keeper_b) = started
        on_a = httpx.Client(base_url=keeper_a.url, timeout=120)
        on_b = httpx.Client(base_url=keeper_b.url, timeout=120)

        def uploaded(session: Session) -> dict[str, Any] | None:
            manifest = _manifest(store, session.name)
            return manifest if manifest is not None and manifest["prompt_tokens"] == session.last_prompt else None

        session = Session(on_a, "travelling", "You are a travelling assistant. " + words(300, 7), 21)
        session.turn()
        assert wait_until(lambda: uploaded(session) is not None, timeout=30)
        first = _kv_objects(store)
        first_manifest = uploaded(session)
        assert first and first_manifest is not None and first_manifest["kv"]
        assert set(first_manifest["kv"]) <= {k.rsplit("/", 1)[1] for k in first}
        session.answer()
        session.turn()
        assert wait_until(lambda: uploaded(session) is not None, timeout=30)
        second = _kv_objects(store)
        # The second save uploads only the blocks of its new cells: every block of the first is still there, and the
        # second names the first's blocks up to the first turn's prompt's end (its generated answer is not what the
        # client sent back); the blocks it adds hold the tokens added after that and the second answer (up to 24).
        # (The bucket may also hold the system prompt's own state meanwhile, whose blocks no manifest here names.)
        second_manifest = uploaded(session)
        assert second_manifest is not None
        added = set(second_manifest["kv"]) - set(first_manifest["kv"])
        assert set(first) <= set(second)
        new_tokens = session.last_prompt - first_manifest["prompt_tokens"]
        size = {k.rsplit("/", 1)[1]: n for k, n in second.items()}
        per_token = (max(first.values()) - BLOCK_HEADER_BYTES) / BLOCK_TOKENS  # a full grid step is the largest
        added_cells = sum(size[name] - BLOCK_HEADER_BYTES for name in added) / per_token
        assert new_tokens <= added_cells <= new_tokens + 24, (added_cells, new_tokens)

        # Host B brings the session's blocks it lacks, assembles the file and restores it.
        session.client = on_b
        response = chat(on_b, session.messages, "travelling", max_tokens=1)
        assert response.status_code == 200, response.text
        assert response.headers["x-slotkeeper-cache"] == "restored", response.headers
        assert timings(response)["cache_n"] >= session.last_prompt - 8
        assert list((backend_b.slot_dir / BLOCKS_DIR).rglob("*.blk"))

        # A block missing from the store: host B cannot assemble that state, prefills, and takes nothing damaged.
        other = Session(on_a, "other", "You are another assistant. " + words(200, 8), 31)
        other.turn()
        assert wait_until(lambda: uploaded(other) is not None, timeout=30)
        manifest = uploaded(other)
        assert manifest is not None
        # A block of the prompt past the system part (which the system prompt's own state holds), so that the
        # session's next state names it again.
        lost = manifest["kv"][manifest["prompt_tokens"] // BLOCK_TOKENS - 2]
        store.client().delete_object(Bucket=store.bucket, Key=f"{PREFIX}/kv/{lost}")
        other.client = on_b
        response = chat(on_b, other.messages, "other", max_tokens=1)
        assert response.status_code == 200, response.text
        # It starts from what B has (the system prompt's state, which needs no lost block), not from the session.
        assert "downloading the snapshot of tiny/other from the shared store failed" in keeper_b.log_text()
        assert timings(response)["cache_n"] < other.last_prompt - 8
        assert backend_b.alive()
        # The owner's next save puts the missing block again (every block is looked up before the manifest).
        other.client = on_a
        other.answer()
        other.turn()
        assert wait_until(lambda: uploaded(other) is not None, timeout=30)
        assert f"{PREFIX}/kv/{lost}" in _kv_objects(store)

        # A block damaged in the store: refused, and removed from the store.
        third = Session(on_a, "third", "You are a third assistant. " + words(200, 11), 41)
        third.turn()
        assert wait_until(lambda: uploaded(third) is not None, timeout=30)
        manifest = uploaded(third)
        assert manifest is not None
        damaged = f"{PREFIX}/kv/" + manifest["kv"][manifest["prompt_tokens"] // BLOCK_TOKENS - 2]
        s3 = store.client()
        good = s3.get_object(Bucket=store.bucket, Key=damaged)["Body"].read()
        bad = good[:-1] + bytes([good[-1] ^ 1])
        s3.put_object(Bucket=store.bucket, Key=damaged, Body=bad)
        third.client = on_b
        response = chat(on_b, third.messages, "third", max_tokens=1)
        assert response.status_code == 200, response.text
        assert timings(response)["cache_n"] < third.last_prompt - 8
        assert "a piece of the shared store's snapshot of tiny/third is damaged" in keeper_b.log_text()
        # Removed at once. B's idle save of the turn may already have put the block again, from its own prefill: an
        # upload puts only blocks the store lacks, so the damaged bytes are gone either way.
        assert _object(store, damaged) != bad
        assert backend_b.alive()
        on_a.close()
        on_b.close()


def test_a_state_saved_whole_before_the_block_store_restores_and_its_next_save_is_kept_as_blocks(
        stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    before = stack.slotkeeper(backend, "--block-tokens", "0", "--save-idle-seconds", "-1")
    client = client_for(before)
    a, b = Session(client, "a", "You are the first. " + words(300, 3), 1), Session(client, "b", "Second. ", 2)
    a.turn()
    a.answer()
    b.turn()  # a's state is saved whole
    old = before.row("a")
    assert old is not None and old["tail_bytes"] == 0 and (backend.slot_dir / old["filename"]).is_file()
    before.stop()
    after = stack.slotkeeper(backend, "--save-idle-seconds", "-1")  # the block store, on by default
    a.client = b.client = client_for(after)
    outcome, t = a.turn()  # restored from the whole file (its prompt: the client sent back another answer)
    assert outcome == "restored" and t["cache_n"] >= old["n_prompt"] - 8, t
    a.answer()
    b.turn()  # a's next state is saved as blocks; the whole file it replaced goes
    new = after.row("a")
    assert new is not None and new["tail_bytes"] > 0
    assert not (backend.slot_dir / old["filename"]).exists() and _blocks(backend.slot_dir)


def test_two_hosts_whose_saves_of_one_prefix_differ_by_float_noise_both_move_through_the_store(
        tmp_path: Path, backend_kind: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Confirmed at 99614b5: a block was named by its tokens, and an upload put it only when that name was missing,
    whatever bytes were stored under it; the manifest named it with this host's checksum. A's state holds the KV of
    its generated tokens as decoding wrote it (one token at a time); B prefilled the same tokens in one batch, which
    rounds otherwise. B's manifest then named A's bytes with B's checksum: the first host to bring B's state found a
    mismatch, took it for damage and deleted the block, and neither state could be brought anywhere. Now each host's
    bytes are their own objects, named by their digests, and each state comes back intact on the other host."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with _two_hosts(tmp_path, backend_kind, tiny_model) as (store, started):
        (backend_a, keeper_a), (_, keeper_b) = started
        on_a = httpx.Client(base_url=keeper_a.url, timeout=120)
        on_b = httpx.Client(base_url=keeper_b.url, timeout=120)

        def complete(client: httpx.Client, session: str, prompt: list[int], n_predict: int) -> dict[str, Any]:
            response = client.post("/completion", headers={"X-Session-Id": session}, json={
                "prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
                "return_tokens": True})
            assert response.status_code == 200, response.text
            return response.json()  # type: ignore[no-any-return]

        def uploaded(session: str, n_tokens: int) -> dict[str, Any] | None:
            manifest = _manifest(store, session)
            return manifest if manifest is not None and manifest["tokens"] >= n_tokens else None

        prompt = [1 + (i * 31) % 500 for i in range(100)]
        generated = complete(on_a, "decoded", prompt, 40)["tokens"]
        history = [*prompt, *generated]  # the slot holds all but the last token generated
        assert wait_until(lambda: uploaded("decoded", len(history) - 1) is not None, timeout=30)
        # B prefills A's tokens (and a few more) in one batch, as a client that sends A's history would have it.
        asked = [*history, *[7 + i for i in range(20)]]
        first_b = complete(on_b, "prefilled", asked, 1)
        assert first_b["timings"]["cache_n"] == 0
        assert wait_until(lambda: uploaded("prefilled", len(asked)) is not None, timeout=30)
        decoded, prefilled = uploaded("decoded", len(history) - 1), uploaded("prefilled", len(asked))
        assert decoded is not None and prefilled is not None
        # Each host brings the other's state and restores it whole.
        on_a_again = complete(on_a, "prefilled", [*asked, 9, 10, 11], 1)
        assert on_a_again["timings"]["cache_n"] >= len(asked) - 1, on_a_again["timings"]
        on_b_again = complete(on_b, "decoded", [*history, 12, 13, 14], 1)
        assert on_b_again["timings"]["cache_n"] >= len(history) - 2, on_b_again["timings"]
        # The two saves named the prompt's blocks alike (one copy) and the decoded tokens' blocks by other bytes.
        full = (len(history) - 1) // BLOCK_TOKENS
        ours, theirs = [n[:32] for n in decoded["kv"][:full]], [n[:32] for n in prefilled["kv"][:full]]
        assert ours[:len(prompt) // BLOCK_TOKENS] == theirs[:len(prompt) // BLOCK_TOKENS]
        assert ours != theirs, "the decoded tokens' KV should differ from a batch prefill's in its last bits"
        kept = set(_kv_objects(store))
        assert {f"{PREFIX}/kv/{n}" for n in (*decoded["kv"], *prefilled["kv"])} <= kept  # nothing deleted
        assert "is damaged" not in keeper_a.log_text() + keeper_b.log_text()
        assert backend_a.alive()
        on_a.close()
        on_b.close()
