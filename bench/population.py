"""A synthetic snapshot population for the `scale` scenario: sessions on a few widely shared system prompts, with
message chains of 10-40 links, some forked from others, plus one system snapshot per prompt; and the request
chains a planner sees against it (a session's next turn, a new chat on a known prompt, a fork, a miss).

Chains are built link by link the way `cache/chain.py` builds them (one 32-hex digest per message position, each
covering everything before it, with the running character count), without rendering actual messages."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import time
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from slotkeeper.cache.chain import Link
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.types import IdSource, SessionKey, SnapshotKind

MODEL = "bench-model"
# Bytes of one synthetic slot file: real ones hold the KV cache (megabytes to gigabytes); small ones keep the fill
# fast and leave only the index's own costs, plus a checksum of a few KiB, in the timings.
FILE_BYTES = (2048, 8192)
# Tokens per message of the slot files `fill(slot_files=True)` writes: 10-40 messages make 160-640 tokens.
TOKENS_PER_LINK = 16


def _digest(parent: str, salt: str) -> str:
    return hashlib.sha256(f"{parent}\0{salt}".encode()).hexdigest()[:32]


def extend(chain: list[Link], n: int, rng: random.Random, salt: str) -> list[Link]:
    """`chain` plus n new message links of 100-4000 characters each."""
    out = list(chain)
    for i in range(n):
        parent = out[-1] if out else Link("root", 0)
        out.append(Link(_digest(parent.digest, f"{salt}/{i}"), parent.chars + int(100 * 40 ** rng.random())))
    return out


@dataclass(frozen=True, slots=True)
class SystemPromptSpec:
    digest: str  # the system snapshot's session id (sha256 hex, as systemprompt.py makes it)
    link: Link  # the first chain link every conversation on this prompt shares


@dataclass(frozen=True, slots=True)
class SessionSpec:
    session_id: str
    system: int  # index into Population.systems
    chain: list[Link]


@dataclass(frozen=True, slots=True)
class Population:
    systems: list[SystemPromptSpec]
    sessions: list[SessionSpec]
    weights: list[float]  # popularity of each system prompt (Zipf)

    def n_snapshots(self) -> int:
        return len(self.systems) + len(self.sessions)


def make_population(n_snapshots: int, seed: int = 7) -> Population:
    """About one system prompt per 250 snapshots (at least 5), picked with Zipf popularity (the first one by about a
    quarter of the sessions); 10% of the sessions are forks that share 3-10 leading messages with an older one."""
    rng = random.Random(seed)
    n_systems = max(5, n_snapshots // 250)
    systems = []
    for s in range(n_systems):
        digest = hashlib.sha256(f"system-{seed}-{s}".encode()).hexdigest()
        systems.append(SystemPromptSpec(digest, Link(_digest("root", digest), rng.randrange(4_000, 60_000))))
    weights = [1 / (rank + 1) for rank in range(n_systems)]
    sessions: list[SessionSpec] = []
    for i in range(n_snapshots - n_systems):
        session_id = f"chat-{seed}-{i:06d}"
        length = rng.randrange(10, 41)
        if sessions and rng.random() < 0.10:
            parent = rng.choice(sessions)
            keep = min(rng.randrange(3, 11), len(parent.chain) - 1)
            chain = extend(parent.chain[:keep], length - keep, rng, session_id)
            sessions.append(SessionSpec(session_id, parent.system, chain))
            continue
        system = rng.choices(range(n_systems), weights)[0]
        sessions.append(SessionSpec(session_id, system, extend([systems[system].link], length - 1, rng, session_id)))
    return Population(systems, sessions, weights)


def write_snapshot(store: SnapshotStore, key: SessionKey, fingerprint: str, chain: list[Link], kind: SnapshotKind,
                   rng: random.Random) -> float:
    """Save one snapshot as the backend and the pool would: the backend writes a temporary file, then `commit`
    (fsyncs, checksum, rename, index rows). Returns the milliseconds `commit` took."""
    temp = store.temp_name(key, fingerprint, kind)
    data = os.urandom(rng.randrange(*FILE_BYTES))
    (store.slot_dir / temp).write_bytes(data)
    started = time.perf_counter()
    store.commit(key, temp, fingerprint, max(1, chain[-1].chars // 3), chain, len(data), kind)
    return (time.perf_counter() - started) * 1000


def fill(store: SnapshotStore, population: Population, fingerprint: str, seed: int = 11,
         slot_files: bool = False) -> list[float]:
    """Save the population's system snapshots, then its sessions; returns each commit's milliseconds. With
    `slot_files`, each file is a dense slot file in llama-server's format whose tokens follow its chain (states
    sharing messages share tokens), so a store with the block store on keeps it as blocks and a tail."""
    rng = random.Random(seed)
    write = write_slot_file if slot_files else write_snapshot
    times = []
    for system in population.systems:
        instructions = Link(_digest(system.link.digest, "instructions"), system.link.chars + 600)
        times.append(write(store, SessionKey(MODEL, system.digest, IdSource.SYSTEM_PROMPT), fingerprint,
                           [system.link, instructions], SnapshotKind.SYSTEM, rng))
    for session in population.sessions:
        times.append(write(store, SessionKey(MODEL, session.session_id, IdSource.HEADER), fingerprint,
                           session.chain, SnapshotKind.SESSION, rng))
    return times


def chain_tokens(chain: list[Link]) -> list[int]:
    """Tokens for a chain: TOKENS_PER_LINK per message, drawn from its digest (equal messages, equal tokens)."""
    out: list[int] = []
    for link in chain:
        drawn = hashlib.shake_128(link.digest.encode()).digest(2 * TOKENS_PER_LINK)
        out += [int.from_bytes(drawn[i:i + 2], "little") % 30000 for i in range(0, len(drawn), 2)]
    return out


def slot_file(tokens: list[int], row: int = 16, n_layer: int = 2) -> bytes:
    """A dense model's slot file (llama-server b11434's format): the packed token list, one stream of cells at
    positions 0..n-1, then per layer K and V rows (their bytes drawn from the token and layer, so equal prefixes
    hold equal KV)."""
    n = len(tokens)
    words = [-1, 1, n, *tokens, 0]
    out = [struct.pack("<III", 0x67677371, 4, len(words)), struct.pack(f"<{len(words)}i", *words),
           struct.pack("<II", 1, n), b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(n)),
           struct.pack("<IIII", 0, n_layer, 0, 0)]
    cells = np.asarray(tokens, dtype=np.uint32)
    for tensor in range(2 * n_layer):
        out.append(struct.pack("<iQ", 1, row))
        out.append(np.repeat(((cells * 31 + tensor) % 251).astype(np.uint8), row).tobytes())
    return b"".join(out)


def write_slot_file(store: SnapshotStore, key: SessionKey, fingerprint: str, chain: list[Link], kind: SnapshotKind,
                    rng: random.Random) -> float:
    """`write_snapshot` with a slot file whose tokens follow the chain."""
    temp = store.temp_name(key, fingerprint, kind)
    tokens = chain_tokens(chain)
    data = slot_file(tokens)
    (store.slot_dir / temp).write_bytes(data)
    started = time.perf_counter()
    store.commit(key, temp, fingerprint, len(tokens), chain, len(data), kind)
    return (time.perf_counter() - started) * 1000


class Lookup(StrEnum):
    """What a request's chain is, relative to the stored population."""

    NEXT_TURN = "next turn of a stored session"
    NEW_CHAT = "new chat on a known system prompt"
    FORK = "fork of a stored session"
    MISS = "new system prompt (miss)"
    LONG_MISS = "40 messages, none stored (miss)"


def request_chain(population: Population, lookup: Lookup, rng: random.Random, salt: str) -> list[Link]:
    """A request chain of the given kind; system prompts are drawn with the population's popularity."""
    if lookup is Lookup.MISS:
        return extend([], 2, rng, f"miss/{salt}")
    if lookup is Lookup.LONG_MISS:
        return extend([], 40, rng, f"long-miss/{salt}")
    if lookup is Lookup.NEW_CHAT:
        system = rng.choices(population.systems, population.weights)[0]
        return extend([system.link], 1, rng, f"new/{salt}")
    session = rng.choice(population.sessions)
    if lookup is Lookup.NEXT_TURN:
        return extend(session.chain, 2, rng, f"next/{salt}")
    keep = rng.randrange(2, len(session.chain))
    return extend(session.chain[:keep], 1, rng, f"fork/{salt}")
