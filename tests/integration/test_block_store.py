"""The block store on both real backends (llama.cpp b11434 and b11549) and every architecture of the tiny-model
generator: saved states are kept as KV blocks and tails (no whole file stays in the slot dir where the format was
recognised), two conversations on one system prompt store its blocks once, a restore assembles the file from
blocks (some written by the other conversation's save), and the next token's log-probabilities equal a fresh
prefill's. Counts only: files, bytes, cache_n, log-probabilities."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from slotkeeper.cache.blockstore import BLOCKS_DIR, TAIL_SUFFIX
from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.conftest import Stack
from tests.integration.test_model_restores import Session, assert_same_distribution, top_logprobs
from tests.support import Backend, chat, wait_until, words

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
    block_bytes = {p.stat().st_size for p in blocks}
    assert len(block_bytes) == 1  # one layout, one block size
    per_block = block_bytes.pop()
    rows = httpx.get(f"{keeper.url}/api/sessions").json()["sessions"]
    assert all(r["stored_as"] == "blocks" for r in rows), rows
    tokens = sum(r["tokens"] for r in rows if r["session"].startswith("c"))
    # Six conversations of about 450 tokens each, sharing about 420: whole files would hold ~2,700 tokens of KV;
    # the store holds the shared part once (under 2 x one conversation's blocks).
    assert len(blocks) * BLOCK_TOKENS < tokens / 2, (len(blocks), tokens, per_block)
