"""The snapshot index: SQLite rows, and nothing else.

One row per snapshot (its file's name, size, checksum and fingerprint, its use and pin), the message chain recorded
with it (`chains`, indexed by digest for prefix lookups) and the model files' identities (so a 20 GB GGUF is not
re-read at every start). It never looks at the files its rows name: whether one exists, is intact, or goes is the
store's (store.py), which writes a row only for a file that is already durable.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotkeeper.cache.blocks import StoredBlock
from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.chain import Link, common_messages
from slotkeeper.cache.kvprobe import KvProbe
from slotkeeper.errors import OlderVersion
from slotkeeper.types import BRANCH_MARK, SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import Version, newer, next_version

log = logging.getLogger("slotkeeper.store")
# KV settings remembered per model and layout (the least recently seen forgotten: its states then prefill once).
_PROBES_KEPT = 64


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One block a state names: its digest and size, and, when another save of this host may name it, its key and
    the key of the position it starts at, and its cell count (None: a block brought from elsewhere, named by this
    state only by its bytes). blocks.py says what the keys hash."""

    digest: str
    prefix: str | None
    n_bytes: int
    opens: str | None = None
    n_cells: int = 0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    model       TEXT NOT NULL,
    session_id  TEXT NOT NULL,
    kind        TEXT NOT NULL DEFAULT 'session',
    filename    TEXT NOT NULL UNIQUE,
    fingerprint TEXT NOT NULL,
    n_tokens    INTEGER NOT NULL,
    n_bytes     INTEGER NOT NULL,
    checksum    TEXT NOT NULL,
    created     REAL NOT NULL,
    last_used   REAL NOT NULL,
    hits        INTEGER NOT NULL DEFAULT 0,
    pinned      INTEGER NOT NULL DEFAULT 0,
    n_prompt    INTEGER NOT NULL DEFAULT 0,
    n_blocks    INTEGER NOT NULL DEFAULT -1,
    fence       INTEGER NOT NULL DEFAULT 0,
    stamp       INTEGER NOT NULL DEFAULT 0,
    tail_bytes  INTEGER NOT NULL DEFAULT 0,
    domain      TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (model, session_id, kind, domain)
);
CREATE TABLE IF NOT EXISTS chains (
    filename    TEXT NOT NULL,
    position    INTEGER NOT NULL,
    digest      TEXT NOT NULL,
    chars       INTEGER NOT NULL,
    PRIMARY KEY (filename, position)
);
CREATE INDEX IF NOT EXISTS chains_by_digest ON chains (digest);
CREATE INDEX IF NOT EXISTS snapshots_by_kind ON snapshots (kind, model);
CREATE TABLE IF NOT EXISTS blocks (
    filename    TEXT NOT NULL,
    position    INTEGER NOT NULL,
    digest      INTEGER NOT NULL,
    PRIMARY KEY (filename, position)
);
CREATE INDEX IF NOT EXISTS blocks_by_digest ON blocks (digest);
CREATE TABLE IF NOT EXISTS block_refs (
    filename    TEXT NOT NULL,
    position    INTEGER NOT NULL,
    digest      TEXT NOT NULL,
    prefix      TEXT,
    opens       TEXT,
    n_cells     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (filename, position)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS block_refs_by_digest ON block_refs (digest);
CREATE TABLE IF NOT EXISTS block_sizes (
    digest      TEXT PRIMARY KEY,
    n_bytes     INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kv_probes (
    base        TEXT NOT NULL,
    setting     TEXT NOT NULL,
    layout      TEXT NOT NULL,
    exact       TEXT NOT NULL,
    vals        BLOB NOT NULL,
    seen        REAL NOT NULL,
    PRIMARY KEY (base, setting)
);
CREATE TABLE IF NOT EXISTS file_identities (
    path        TEXT NOT NULL,
    size        INTEGER NOT NULL,
    mtime_ns    INTEGER NOT NULL,
    identity    TEXT NOT NULL,
    PRIMARY KEY (path, size, mtime_ns)
);
"""
_COLUMNS = (
    "model, session_id, filename, fingerprint, n_tokens, n_bytes, checksum, created, last_used, hits, kind, pinned,"
    " n_prompt, fence, stamp, tail_bytes, domain"
)
_S_COLUMNS = ", ".join("s." + c.strip() for c in _COLUMNS.split(","))
# Candidates are the states of every kind (conversations, system parts, side tasks): the tokens decide, not the kind.
_PREFIX_CANDIDATES = (
    f"SELECT {_S_COLUMNS} FROM chains c CROSS JOIN snapshots s ON s.filename = c.filename"  # CROSS: chains drive
    " WHERE c.digest = ? AND s.model = ? AND s.fingerprint = ? AND s.domain = ?"
    " ORDER BY s.last_used DESC LIMIT 8"
)
_BLOCK_CANDIDATES = (
    f"SELECT {_S_COLUMNS} FROM blocks b CROSS JOIN snapshots s ON s.filename = b.filename"
    " WHERE b.digest = ? AND b.position = ? AND s.model = ? AND s.fingerprint = ? AND s.domain = ?"
    " ORDER BY s.last_used DESC LIMIT 8"
)
# What the states take on disk but for their blocks: a whole file, or a tail.
_STORED_BYTES = "SELECT COALESCE(SUM(CASE WHEN tail_bytes > 0 THEN tail_bytes ELSE n_bytes END), 0) FROM snapshots"
# States indexed before token blocks existed (n_blocks -1), to be filled in from their files.
_UNBLOCKED = "SELECT filename FROM snapshots WHERE n_blocks < 0 LIMIT ?"


class SnapshotIndex:
    """The rows of the snapshots and their chains. Thread-safe: one lock around the connection, which every
    method takes for its statements (callers run it off the event loop)."""

    def __init__(self, index_path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(index_path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        legacy_blocks = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='kv_refs'").fetchone() is not None
        self._db.executescript(_SCHEMA)
        if legacy_blocks:
            self._forget_legacy_blocks()
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(snapshots)")}
        if "pinned" not in columns:  # an index from before pinning
            self._db.execute("ALTER TABLE snapshots ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
        if "n_prompt" not in columns:  # an index from before prompt token counts (0: not known)
            self._db.execute("ALTER TABLE snapshots ADD COLUMN n_prompt INTEGER NOT NULL DEFAULT 0")
        if "n_blocks" not in columns:  # an index from before token blocks (-1: not indexed yet)
            self._db.execute("ALTER TABLE snapshots ADD COLUMN n_blocks INTEGER NOT NULL DEFAULT -1")
        if "fence" not in columns:  # an index from before versions (0, 0: older than every versioned state)
            self._db.execute("ALTER TABLE snapshots ADD COLUMN fence INTEGER NOT NULL DEFAULT 0")
            self._db.execute("ALTER TABLE snapshots ADD COLUMN stamp INTEGER NOT NULL DEFAULT 0")
        if "tail_bytes" not in columns:  # an index from before the block store (0: every state kept whole)
            self._db.execute("ALTER TABLE snapshots ADD COLUMN tail_bytes INTEGER NOT NULL DEFAULT 0")
        if "domain" not in columns:  # an index from before cache domains: every state in the one domain ("")
            self._add_domains()
        if "opens" not in {row[1] for row in self._db.execute("PRAGMA table_info(block_refs)")}:
            # An index from before cuts followed stored blocks: its blocks are named by prefixes of another hash, so
            # no later save finds them by key (their bytes still dedupe by digest).
            self._db.execute("ALTER TABLE block_refs ADD COLUMN opens TEXT")
            self._db.execute("ALTER TABLE block_refs ADD COLUMN n_cells INTEGER NOT NULL DEFAULT 0")
        self._db.execute("CREATE INDEX IF NOT EXISTS block_refs_by_opens ON block_refs (opens) WHERE opens IS NOT NULL")
        # Saves found the blocks stored before them by their key alone until they asked by position (`stored_from`):
        # that index is written on every save and read by nothing now.
        self._db.execute("DROP INDEX IF EXISTS block_refs_by_prefix")
        # Side tasks' states were conversations' rows under reserved ids before they became a kind of their own.
        self._db.execute("UPDATE snapshots SET kind = 'side' WHERE kind = 'session' AND session_id GLOB"
                         " '~side-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]*'")

    def _add_domains(self) -> None:
        """The domain is part of a row's key (two users' chats that open alike share a derived name): SQLite
        cannot change a primary key, so the table is made again with it, every row kept in the one domain."""
        columns = ", ".join(c.strip() for c in _COLUMNS.split(",") if c.strip() != "domain")
        table = _SCHEMA.split("CREATE TABLE IF NOT EXISTS snapshots", 1)[1].split(";", 1)[0]
        with self._transaction():
            self._db.execute(f"CREATE TABLE snapshots_domains {table}")
            self._db.execute(f"INSERT INTO snapshots_domains ({columns}) SELECT {columns} FROM snapshots")
            self._db.execute("DROP TABLE snapshots")
            self._db.execute("ALTER TABLE snapshots_domains RENAME TO snapshots")
            self._db.execute("CREATE INDEX IF NOT EXISTS snapshots_by_kind ON snapshots (kind, model)")

    def _forget_legacy_blocks(self) -> None:
        """An index from before blocks were named by their bytes: its states kept as blocks named them by prefix,
        under a fingerprint that left out the KV's types and settings, so none of them can be trusted. Their rows go
        (the start's clean-up then removes their tails, and the sweep their blocks); states kept whole stay (their
        old fingerprint keeps them from being restored until they age out)."""
        with self._transaction():
            gone = [f for (f,) in self._db.execute("SELECT filename FROM snapshots WHERE tail_bytes > 0")]
            for filename in gone:
                self._db.execute("DELETE FROM snapshots WHERE filename=?", (filename,))
                self._forget_file(filename)
            self._db.execute("DROP TABLE kv_refs")
            self._db.execute("DROP TABLE IF EXISTS kv_blocks")
        if gone:
            log.warning("forgot %d saved state(s) kept as blocks by an older slotkeeper: their blocks were named by "
                        "a key that did not cover every setting of the KV, and are not trusted", len(gone))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """The connection itself, for tests that measure the statements run; everything else goes through the
        methods, under the lock."""
        return self._db

    # -- writing ----------------------------------------------------------------------------------------------

    def replace(self, key: SessionKey, kind: SnapshotKind, filename: str, fingerprint: str, n_tokens: int,
                n_bytes: int, checksum: str, chain: Sequence[Link] = (),
                n_prompt: int = 0, blocks: Sequence[int] | None = None, version: Version | None = None,
                fence: int | None = None, tail_bytes: int = 0, block_refs: Sequence[BlockRef] = (),
                keep_branches: bool = False) -> tuple[list[Snapshot], Snapshot]:
        """Index `filename` as the key's snapshot, with its chain and its token blocks (tokens.py; None: its tokens
        could not be read), in one transaction; returns the rows it replaced (their files are now the caller's to
        remove) and the new one. The replaced row's `created` and `hits` carry over.

        A save made here (`version` None) gets the next version after the row's, under `fence` (version.py). A copy
        brought in keeps its `version`, and replaces the row only when it is newer: else OlderVersion is raised and
        nothing changes.

        `keep_branches` (a name slotkeeper derived from messages, which two conversations can share): a row whose
        messages the new state does not begin with is another conversation's, or a branch the client left (an
        edited message, a regenerated answer), and stays as a branch, `<name>~<8 hex>`, found by its tokens like
        any state; a branch whose messages the new state begins with is an older state of this one and goes."""
        now = time.time()
        with self._lock, self._transaction():
            previous = self._row(key, kind)
            if version is None:
                version = next_version(previous.version if previous is not None else None, fence, now)
            elif previous is not None and not newer(version, previous.version):
                raise OlderVersion(f"the copy of {key} at version {version} is not newer than the one here "
                                   f"({previous.version}): it is not taken")
            replaced = [] if previous is None else [previous]
            if keep_branches and kind is SnapshotKind.SESSION and chain:
                replaced = self._sort_branches(key, previous, chain)
            self._db.execute(
                "INSERT INTO snapshots (model, session_id, kind, filename, fingerprint, n_tokens, n_bytes, checksum,"
                " created, last_used, hits, n_prompt, n_blocks, fence, stamp, tail_bytes, domain)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(model, session_id, kind, domain) DO UPDATE SET filename=excluded.filename,"
                " fingerprint=excluded.fingerprint, n_tokens=excluded.n_tokens, n_bytes=excluded.n_bytes,"
                " checksum=excluded.checksum, last_used=excluded.last_used, n_prompt=excluded.n_prompt,"
                " n_blocks=excluded.n_blocks, fence=excluded.fence, stamp=excluded.stamp,"
                " tail_bytes=excluded.tail_bytes",
                (key.model, key.session_id, str(kind), filename, fingerprint, n_tokens, n_bytes, checksum, now, now,
                 max(n_prompt, 0), 0 if blocks is None else len(blocks), version.fence, version.stamp, tail_bytes,
                 key.domain),
            )
            self._db.executemany(
                "INSERT INTO block_refs (filename, position, digest, prefix, opens, n_cells) VALUES (?, ?, ?, ?, ?, ?)",
                [(filename, i, ref.digest, ref.prefix, ref.opens, ref.n_cells) for i, ref in enumerate(block_refs)])
            self._db.executemany("INSERT OR IGNORE INTO block_sizes (digest, n_bytes) VALUES (?, ?)",
                                 [(ref.digest, ref.n_bytes) for ref in block_refs])
            self._db.executemany(
                "INSERT INTO chains (filename, position, digest, chars) VALUES (?, ?, ?, ?)",
                [(filename, i, link.digest, link.chars) for i, link in enumerate(chain)],
            )
            self._insert_blocks(filename, blocks or ())
            for row in replaced:
                self._forget_file(row.filename)
            snapshot = self._row(key, kind)
        assert snapshot is not None
        return replaced, snapshot

    def _sort_branches(self, key: SessionKey, previous: Snapshot | None, chain: Sequence[Link]) -> list[Snapshot]:
        """In replace's transaction: the rows a new state of `key` with `chain` replaces, the key's own row and its
        branches whose messages it begins with; the key's own row that it does not begin with becomes a branch."""
        replaced = []
        mark = key.session_id + BRANCH_MARK
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM snapshots WHERE model=? AND domain=? AND kind=? AND substr(session_id, 1, ?)=?",
            (key.model, key.domain, str(SnapshotKind.SESSION), len(mark), mark)).fetchall()
        for branch in (_snapshot(row) for row in rows):
            if self._begins(chain, branch.filename):
                self._db.execute("DELETE FROM snapshots WHERE filename=?", (branch.filename,))
                replaced.append(branch)
        if previous is None:
            return replaced
        if self._begins(chain, previous.filename):
            return [previous, *replaced]
        name = mark + previous.filename.rsplit("-", 1)[-1].split(".", 1)[0][:8]
        taken = self._row(key.within(name), SnapshotKind.SESSION)
        if taken is not None:  # a branch whose file had the same tag (1 in 2^32): the older goes
            self._db.execute("DELETE FROM snapshots WHERE filename=?", (taken.filename,))
            replaced.append(taken)
        self._db.execute("UPDATE snapshots SET session_id=? WHERE filename=?", (name, previous.filename))
        return replaced

    def _begins(self, chain: Sequence[Link], filename: str) -> bool:
        """Whether `chain` begins with every message of the state saved as `filename` (one without a chain: yes)."""
        saved = self._chain_of(filename)
        return common_messages(saved, chain) == len(saved)

    def drop(self, filename: str) -> bool:
        """Remove the row naming `filename` and its chain, together; False when there was no such row."""
        with self._lock, self._transaction():
            removed = self._db.execute("DELETE FROM snapshots WHERE filename=?", (filename,)).rowcount > 0
            self._forget_file(filename)
        return removed

    def delete(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """Remove the key's row and its chain; returns the row removed, or None when there was none."""
        with self._lock, self._transaction():
            snapshot = self._row(key, kind)
            if snapshot is None:
                return None
            self._db.execute("DELETE FROM snapshots WHERE filename=?", (snapshot.filename,))
            self._forget_file(snapshot.filename)
        return snapshot

    def drop_orphan_chains(self) -> None:
        """Remove chain and block rows whose snapshot row is gone."""
        with self._lock:
            self._db.execute("DELETE FROM chains WHERE filename NOT IN (SELECT filename FROM snapshots)")
            self._db.execute("DELETE FROM blocks WHERE filename NOT IN (SELECT filename FROM snapshots)")

    # -- KV blocks (blockstore.py): which states name which blocks, and which prefix this host stored as which ----

    def unref(self, filename: str) -> list[str]:
        """Forget which blocks a removed state named; returns their digests (the store collects those no state
        names)."""
        with self._lock, self._transaction():
            digests = [d for (d,) in self._db.execute("SELECT DISTINCT digest FROM block_refs WHERE filename=?",
                                                      (filename,))]
            self._db.execute("DELETE FROM block_refs WHERE filename=?", (filename,))
        return digests

    def referenced(self, digests: Sequence[str]) -> set[str]:
        """The digests among `digests` that some state names; the others' sizes are forgotten (they are being
        removed)."""
        found: set[str] = set()
        with self._lock, self._transaction():
            for d in digests:
                if self._db.execute("SELECT 1 FROM block_refs WHERE digest=? LIMIT 1", (d,)).fetchone() is not None:
                    found.add(d)
                else:
                    self._db.execute("DELETE FROM block_sizes WHERE digest=?", (d,))
        return found

    def stored_from(self, opens: Sequence[str]) -> dict[str, list[StoredBlock]]:
        """For each position key in `opens`, the blocks this host's own saves stored starting there: each block key
        once, with its cell count and a digest it was stored as (blockstore.py `Stored`)."""
        found: dict[str, list[StoredBlock]] = {}
        with self._lock:
            for key in dict.fromkeys(opens):
                rows = self._db.execute(
                    "SELECT n_cells, prefix, MIN(digest) FROM block_refs WHERE opens=? AND prefix IS NOT NULL"
                    " GROUP BY prefix LIMIT 64", (key,)).fetchall()
                if rows:
                    found[key] = [StoredBlock(int(n), str(prefix), str(digest)) for n, prefix, digest in rows]
        return found

    def block_usage(self) -> tuple[int, int]:
        """(blocks, bytes) of the KV blocks the states name, each once."""
        with self._lock:
            count, total = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_bytes), 0) FROM block_sizes").fetchone()
        return int(count), int(total)

    def own_block_bytes(self, filename: str) -> int:
        """The bytes of the blocks only this state names: what its eviction frees besides its tail."""
        with self._lock:
            return int(self._db.execute(
                "SELECT COALESCE(SUM(b.n_bytes), 0) FROM (SELECT DISTINCT digest FROM block_refs WHERE filename = ?)"
                " r JOIN block_sizes b ON b.digest = r.digest WHERE NOT EXISTS (SELECT 1 FROM block_refs o"
                " WHERE o.digest = r.digest AND o.filename <> ?)", (filename, filename)).fetchone()[0])

    def orphan_refs(self) -> list[str]:
        """Drop the block references of states whose row is gone (a crash between the two); returns their digests."""
        with self._lock, self._transaction():
            digests = [d for (d,) in self._db.execute(
                "SELECT DISTINCT digest FROM block_refs WHERE filename NOT IN (SELECT filename FROM snapshots)")]
            self._db.execute("DELETE FROM block_refs WHERE filename NOT IN (SELECT filename FROM snapshots)")
        return digests

    def all_referenced(self) -> set[str]:
        with self._lock:
            return {d for (d,) in self._db.execute("SELECT DISTINCT digest FROM block_refs")}

    def set_blocks(self, filename: str, blocks: Sequence[int] | None) -> None:
        """The token blocks of a state indexed before blocks existed (None: its tokens could not be read)."""
        with self._lock, self._transaction():
            updated = self._db.execute("UPDATE snapshots SET n_blocks=? WHERE filename=? AND n_blocks < 0",
                                       (0 if blocks is None else len(blocks), filename)).rowcount
            if updated:
                self._insert_blocks(filename, blocks or ())

    def unblocked(self, limit: int = 256) -> list[str]:
        """File names of states whose token blocks are not indexed yet."""
        with self._lock:
            return [str(row[0]) for row in self._db.execute(_UNBLOCKED, (limit,)).fetchall()]

    def _insert_blocks(self, filename: str, blocks: Sequence[int]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO blocks (filename, position, digest) VALUES (?, ?, ?)",
                             [(filename, i, digest) for i, digest in enumerate(blocks)])

    def _forget_file(self, filename: str) -> None:
        self._db.execute("DELETE FROM chains WHERE filename=?", (filename,))
        self._db.execute("DELETE FROM blocks WHERE filename=?", (filename,))

    def set_pinned(self, key: SessionKey, pinned: bool, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        with self._lock:
            self._db.execute("UPDATE snapshots SET pinned=? WHERE model=? AND session_id=? AND kind=? AND domain=?",
                             (int(pinned), key.model, key.session_id, str(kind), key.domain))
            return self._row(key, kind)

    def mark_used(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE snapshots SET last_used=?, hits=hits+1 WHERE model=? AND session_id=? AND kind=? AND domain=?",
                (time.time(), key.model, key.session_id, str(kind), key.domain),
            )

    # -- reading ----------------------------------------------------------------------------------------------

    def get(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        with self._lock:
            return self._row(key, kind)

    def snapshots(self, model: str | None = None, kind: SnapshotKind | None = SnapshotKind.SESSION) -> list[Snapshot]:
        """Rows, most recently used first: of one kind (sessions by default) or, with kind None, all."""
        query = f"SELECT {_COLUMNS} FROM snapshots WHERE 1=1"
        params: tuple[str, ...] = ()
        if kind is not None:
            query += " AND kind=?"
            params += (str(kind),)
        if model is not None:
            query += " AND model=?"
            params += (model,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY last_used DESC", params).fetchall()
        return [_snapshot(row) for row in rows]

    def filenames(self) -> set[str]:
        """Every file name a row names."""
        with self._lock:
            return {str(row[0]) for row in self._db.execute("SELECT filename FROM snapshots")}

    def filenames_by_use(self) -> list[str]:
        """Every file name a row names, the least recently used first."""
        with self._lock:
            rows = self._db.execute("SELECT filename FROM snapshots ORDER BY last_used").fetchall()
        return [str(row[0]) for row in rows]

    def prefix_candidates(self, digest: str, model: str, fingerprint: str, domain: str = "") -> list[Snapshot]:
        """The rows (of every kind) of this model, backend and cache domain whose chain holds `digest` (at most 8,
        most recently used first): one indexed lookup, the chains by digest driving the join."""
        with self._lock:
            rows = self._db.execute(_PREFIX_CANDIDATES, (digest, model, fingerprint, domain)).fetchall()
        return [_snapshot(row) for row in rows]

    def deepest_blocks(self, blocks: Sequence[int], model: str, fingerprint: str,
                       domain: str = "") -> tuple[int, list[Snapshot]]:
        """The states of this model, backend and cache domain sharing the most leading token blocks with `blocks`
        (a request's block hashes, tokens.py): how many blocks, and the rows (at most 8, most recently used first).
        A state that holds block k of a request holds every block before it, so a binary search finds the deepest
        in about log2(len(blocks)) indexed look-ups."""
        low, high, found = 0, len(blocks), []
        with self._lock:
            while low < high:
                mid = (low + high + 1) // 2  # is block mid-1 held by any state?
                rows = self._db.execute(_BLOCK_CANDIDATES,
                                        (blocks[mid - 1], mid - 1, model, fingerprint, domain)).fetchall()
                if rows:
                    low, found = mid, rows
                else:
                    high = mid - 1
        return low, [_snapshot(row) for row in found]

    def chain_chars(self, filename: str) -> int:
        """The prompt characters of the whole chain recorded with `filename` (0 when none was)."""
        with self._lock:
            return int(self._db.execute("SELECT MAX(chars) FROM chains WHERE filename=?",
                                        (filename,)).fetchone()[0] or 0)

    def chain_of(self, filename: str) -> list[Link]:
        """The message chain recorded with `filename` (empty when none was)."""
        with self._lock:
            return self._chain_of(filename)

    def _chain_of(self, filename: str) -> list[Link]:
        rows = self._db.execute("SELECT digest, chars FROM chains WHERE filename=? ORDER BY position",
                                (filename,)).fetchall()
        return [Link(str(digest), int(chars)) for digest, chars in rows]

    def total_bytes(self) -> int:
        """Bytes the saved states take on disk: whole files, tails, and every block once."""
        with self._lock:
            return self._total_bytes()

    def _total_bytes(self) -> int:
        return int(self._db.execute(_STORED_BYTES).fetchone()[0]) + int(
            self._db.execute("SELECT COALESCE(SUM(n_bytes), 0) FROM block_sizes").fetchone()[0])

    def over_budget(self, budget: DiskBudget, now: float) -> bool:
        """Whether any limit is broken at all, by one aggregate query per limit. Every save enforces the budget and
        most saves leave it whole; listing every snapshot to find that out took 40-100 ms at 10,000 snapshots.
        Errs towards True (pinned and in-use snapshots are not counted out): the full check decides then."""
        with self._lock:
            if budget.max_bytes > 0 and self._total_bytes() > budget.max_bytes:
                return True
            if budget.max_age_seconds > 0 and self._db.execute(
                "SELECT 1 FROM snapshots WHERE last_used < ? LIMIT 1", (now - budget.max_age_seconds,)
            ).fetchone() is not None:
                return True
            for kind, most in (("system", budget.max_system_snapshots), ("side", budget.max_side_states)):
                if most > 0 and self._db.execute(
                    "SELECT 1 FROM snapshots WHERE kind = ? GROUP BY model HAVING COUNT(*) > ? LIMIT 1", (kind, most),
                ).fetchone() is not None:
                    return True
            return False

    def usage(self) -> dict[str, dict[str, int]]:
        """Bytes and snapshot counts per kind: {"session": {"count", "bytes", "pinned"}, "system": {...}}."""
        with self._lock:
            rows = self._db.execute(
                "SELECT kind, COUNT(*), COALESCE(SUM(n_bytes), 0), COALESCE(SUM(pinned), 0) FROM snapshots"
                " GROUP BY kind"
            ).fetchall()
        out = {str(kind): {"count": 0, "bytes": 0, "pinned": 0} for kind in SnapshotKind}
        for kind, count, n_bytes, pinned in rows:
            out[str(kind)] = {"count": int(count), "bytes": int(n_bytes), "pinned": int(pinned)}
        return out

    # -- model file identities (cached, so a 20 GB GGUF is not re-read at every start) ------------------------

    def kv_setting(self, base: str, probe: KvProbe) -> str:
        """The name of the KV setting `probe` shows under `base` (a model and layout): the one seen before that it
        agrees with within float noise, else its own (kvprobe.py: a digest of its bytes, so that hosts and backends
        whose probes are byte for byte alike name the setting alike)."""
        with self._lock, self._transaction():
            rows = self._db.execute("SELECT setting, layout, vals, exact FROM kv_probes WHERE base=?"
                                    " ORDER BY seen DESC", (base,)).fetchall()
            for setting, layout, vals, exact in rows:
                if probe.same_setting(KvProbe.stored(layout, vals, exact)):
                    self._db.execute("UPDATE kv_probes SET seen=? WHERE base=? AND setting=?",
                                     (time.time(), base, setting))
                    return str(setting)
            setting = probe.name
            self._db.execute("INSERT OR REPLACE INTO kv_probes (base, setting, layout, exact, vals, seen)"
                             " VALUES (?, ?, ?, ?, ?, ?)",
                             (base, setting, probe.layout, probe.exact, probe.values_bytes(), time.time()))
            self._db.execute("DELETE FROM kv_probes WHERE base=? AND setting NOT IN (SELECT setting FROM kv_probes"
                             " WHERE base=? ORDER BY seen DESC LIMIT ?)", (base, base, _PROBES_KEPT))
        return setting

    def cached_identity(self, path: str, size: int, mtime_ns: int) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT identity FROM file_identities WHERE path=? AND size=? AND mtime_ns=?", (path, size, mtime_ns)
            ).fetchone()
        return None if row is None else str(row[0])

    def remember_identity(self, path: str, size: int, mtime_ns: int, identity: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO file_identities (path, size, mtime_ns, identity) VALUES (?, ?, ?, ?)",
                (path, size, mtime_ns, identity),
            )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """The statements inside land together, with one fsync of the log; call it with the lock held. (The
        connection autocommits: each statement outside a transaction, each row of an executemany included, would
        be a transaction of its own, fsynced on its own.)"""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _row(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM snapshots WHERE model=? AND session_id=? AND kind=? AND domain=?",
            (key.model, key.session_id, str(kind), key.domain),
        ).fetchone()
        return None if row is None else _snapshot(row)


def _snapshot(row: Sequence[Any]) -> Snapshot:
    """An index row (the columns of _COLUMNS, in order) as a Snapshot."""
    (model, session_id, filename, fingerprint, n_tokens, n_bytes, checksum, created, last_used, hits, kind, pinned,
     n_prompt, fence, stamp, tail_bytes, domain) = row
    return Snapshot(model, session_id, filename, fingerprint, n_tokens, n_bytes, checksum, created, last_used, hits,
                    SnapshotKind(kind), bool(pinned), int(n_prompt), Version(int(fence), int(stamp)), int(tail_bytes),
                    str(domain))
