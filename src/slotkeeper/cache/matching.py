"""Which saved states share the beginning of a request: by its messages (the chains' digests) or by its tokens (the
token blocks' hashes, then the token lists compared one by one), and the token lists kept in memory for that.

Every state found is checked (size, checksum, fingerprint) by the store before it is offered (store.py): this module
finds, the store vouches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slotkeeper.cache.blockstore import BlockStore
from slotkeeper.cache.chain import Link, common_messages
from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.tokens import Tokens, block_hashes, common_tokens, read_tokens
from slotkeeper.types import Snapshot

# Token lists of saved states kept in memory for exact comparisons (4 bytes a token): about 32 MiB.
_TOKENS_KEPT = 8 << 20


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A snapshot whose first `messages` messages equal the request's: restoring it reuses about `est_tokens`.
    `whole`: the request has every message the snapshot was saved with."""

    snapshot: Snapshot
    messages: int
    est_tokens: int
    whole: bool = False


@dataclass(frozen=True, slots=True)
class TokenMatch:
    """A saved state and exactly how many leading tokens it shares with a request (its token list was compared)."""

    snapshot: Snapshot
    tokens: int


class Matching:
    """The store's look-ups by shared prefix. `verified` is the store's check of a state found (None: not
    restorable here; a bad file is quarantined). Thread-safe, as the index and the token memo are."""

    def __init__(self, index: SnapshotIndex, slot_dir: Path, ram: RamDir | None, blocks: BlockStore,
                 verified: Callable[[Snapshot, str], Snapshot | None]) -> None:
        self._index = index
        self.slot_dir = slot_dir
        self.ram = ram
        self.blocks = blocks
        self._verified = verified
        self.tokens = TokenMemo(_TOKENS_KEPT)

    def prefix_matches(self, model: str, fingerprint: str, chain: Sequence[Link],
                       min_messages: int = 1, domain: str = "") -> list[PrefixMatch]:
        """The intact states (of every kind, of this model, backend and cache domain) sharing the most leading
        messages with `chain`, at least `min_messages`: the few that hold the deepest shared position (most recently
        used first).

        A digest covers every message up to its position, so a state that holds the request's digest at position i
        shares its first i+1 messages: positions are tried from the deepest one down, one indexed lookup each, and
        the first that an intact state holds wins. (Matching all digests in one join let SQLite scan every state of
        the model, and sort every conversation on a shared system prompt, on each lookup.)
        """
        for position in range(len(chain) - 1, max(min_messages, 1) - 2, -1):
            found = []
            for candidate in self._index.prefix_candidates(chain[position].digest, model, fingerprint, domain):
                snapshot = self._verified(candidate, fingerprint)
                if snapshot is None:
                    continue
                total_chars = self._index.chain_chars(snapshot.filename)
                share = chain[position].chars / total_chars if total_chars else 0.0
                whole = chain[position].chars >= total_chars
                found.append(PrefixMatch(snapshot, position + 1, int(snapshot.owed_tokens * min(share, 1.0)), whole))
            if found:
                return found
        return []

    def best_prefix(self, model: str, fingerprint: str, chain: Sequence[Link],
                    min_messages: int = 1, domain: str = "") -> PrefixMatch | None:
        """The most recently used of `prefix_matches`."""
        found = self.prefix_matches(model, fingerprint, chain, min_messages, domain)
        return found[0] if found else None

    def best_by_tokens(self, model: str, fingerprint: str, tokens: Tokens, domain: str = "") -> list[TokenMatch]:
        """The intact states (of every kind) of this model, backend and cache domain that share the most leading
        tokens with `tokens`, each with exactly how many: the deepest shared token block found in the index
        (index.py), then the states holding it compared token by token. Most shared first; empty when none shares a
        whole block."""
        depth, rows = self._index.deepest_blocks(block_hashes(tokens), model, fingerprint, domain)
        if depth == 0:
            return []
        found = []
        for row in rows:
            snapshot = self._verified(row, fingerprint)
            saved = self.tokens_of(snapshot) if snapshot is not None else None
            if snapshot is not None and saved is not None:
                found.append(TokenMatch(snapshot, common_tokens(saved, tokens)))
        return sorted(found, key=lambda m: -m.tokens)

    def tokens_of(self, snapshot: Snapshot) -> Tokens | None:
        """The tokens a saved state holds, from memory or from its file (None: not a file this code reads)."""
        known = self.tokens.get(snapshot.filename)
        if known is not None:
            return known
        path = self.slot_dir / snapshot.filename
        if self.ram is not None and self.ram.in_ram(snapshot.filename):
            path = self.ram.path / snapshot.filename
        elif snapshot.tail_bytes:
            path = self.blocks.tail_path(snapshot.filename)  # a tail starts as its file did: header, then tokens
        tokens = read_tokens(path)
        if tokens is not None:
            self.tokens.put(snapshot.filename, tokens)
        return tokens

    def fill_blocks(self, limit: int = 256) -> int:
        """Index the token blocks of states saved before blocks were indexed (read from their files); returns how
        many were done. Called at start, in a worker thread, until it returns 0."""
        names = self._index.unblocked(limit)
        for name in names:
            tail = self.blocks.tail_path(name)  # a state kept as blocks: its tail starts as its file did
            tokens = read_tokens(tail if tail.is_file() else self.slot_dir / name)
            self._index.set_blocks(name, None if tokens is None else block_hashes(tokens))
        return len(names)

    def chain_of(self, snapshot: Snapshot) -> list[Link]:
        """The message chain recorded with a snapshot (empty when none was)."""
        return self._index.chain_of(snapshot.filename)

    def shared_prefix(self, snapshot: Snapshot, chain: Sequence[Link]) -> tuple[int, int] | None:
        """How many leading messages of `chain` the snapshot covers, and about how many of its prompt tokens that
        is (generated tokens are never counted: a client may send back another answer); None when no chain was
        recorded for it. All of its prompt when the request extends the snapshot's messages."""
        return shared_with(snapshot, self.chain_of(snapshot), chain)


def shared_with(snapshot: Snapshot, saved: Sequence[Link], chain: Sequence[Link]) -> tuple[int, int] | None:
    """`Matching.shared_prefix` for a snapshot whose recorded chain (`saved`) is already at hand."""
    if not saved:
        return None
    shared = common_messages(saved, chain)
    if shared == len(saved):
        return shared, snapshot.owed_tokens
    if shared == 0:
        return 0, 0
    return shared, int(snapshot.owed_tokens * saved[shared - 1].chars / max(saved[-1].chars, 1))


class TokenMemo:
    """Token lists by file name, the least recently used dropped past a total count. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lists: OrderedDict[str, Tokens] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, name: str) -> Tokens | None:
        with self._lock:
            tokens = self._lists.get(name)
            if tokens is not None:
                self._lists.move_to_end(name)
            return tokens

    def put(self, name: str, tokens: Tokens) -> None:
        with self._lock:
            old = self._lists.pop(name, None)
            self._total -= 0 if old is None else old.size
            self._lists[name] = tokens
            self._total += tokens.size
            while self._total > self._capacity and len(self._lists) > 1:
                _, dropped = self._lists.popitem(last=False)
                self._total -= dropped.size

    def drop(self, name: str) -> None:
        with self._lock:
            old = self._lists.pop(name, None)
            self._total -= 0 if old is None else old.size
