"""Tokens: the ground truth of what two prompts share.

A slot file starts with the token list of the state it holds (llama-server's format v4: magic, version, a word
count, then the words), so every saved state's tokens can be read without asking the backend. To find the states
that share the longest beginning with a request's tokens without reading every file, each state's tokens are cut
into blocks of `BLOCK` tokens and each block boundary gets a chained hash: the hash of the previous boundary and the
block's tokens. Equal hashes at boundary k mean (but for a 64-bit collision, which the exact comparison afterwards
rules out) the first k*BLOCK tokens are equal, so the states sharing the deepest boundary with a request are found
by one indexed look-up per step of a binary search (index.py), then compared token by token.

Pure functions over bytes and integer arrays; no I/O but `read_tokens`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

# Tokens per indexed block. Small enough that a side task sharing a few hundred tokens with an earlier one is found,
# large enough that 10,000 states of a few thousand tokens each stay well under a million index rows.
BLOCK = 64
# llama-server's slot file: u32 magic ("ggsq" little-endian), u32 version, u32 word count, then int32 words.
_MAGIC = 0x67677371
_VERSION = 4
_HEADER = struct.Struct("<III")
# Words of the packed token list (#26640): a null-token marker, the packing's version, then the token count.
_PACKED_MARKER = -1
_PACKED_VERSION = 1
_SEED = 0x736C6F746B656570  # "slotkeep"

Tokens = np.ndarray  # a 1-D int32 array of token ids


def as_tokens(values: Sequence[int] | np.ndarray) -> Tokens:
    return np.asarray(values, dtype=np.int32)


def parse_tokens(head: bytes) -> Tokens | None:
    """The token list at the start of a slot file, from its first bytes (at least the header and the words), or
    None when the bytes are not a slot file this code knows (a state kept whole, never guessed at)."""
    if len(head) < _HEADER.size:
        return None
    magic, version, n_words = _HEADER.unpack_from(head, 0)
    if magic != _MAGIC or version != _VERSION or n_words == 0 or len(head) < _HEADER.size + 4 * n_words:
        return None
    words = np.frombuffer(head, dtype="<i4", count=n_words, offset=_HEADER.size)
    if words[0] == _PACKED_MARKER:
        if n_words < 3 or words[1] != _PACKED_VERSION or not 0 <= words[2] <= n_words - 3:
            return None
        tokens = words[3:3 + int(words[2])]
    else:
        tokens = words  # the plain list of older builds
    if tokens.size and int(tokens.min()) < 0:
        return None  # media chunks or a layout this code does not know
    return tokens.astype(np.int32)


def read_tokens(path: Path) -> Tokens | None:
    """The tokens a slot file holds (None: not a slot file this code knows, or unreadable)."""
    try:
        with path.open("rb") as fh:
            header = fh.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return None
            magic, version, n_words = _HEADER.unpack(header)
            if magic != _MAGIC or version != _VERSION or n_words > (1 << 28):
                return None
            return parse_tokens(header + fh.read(4 * n_words))
    except OSError:
        return None


def block_hashes(tokens: Tokens) -> list[int]:
    """The chained hash at each full block's end: element k covers tokens[0:(k+1)*BLOCK]. Signed 64-bit values, as
    SQLite stores integers."""
    out: list[int] = []
    running = _SEED.to_bytes(8, "little")
    data = np.ascontiguousarray(tokens, dtype="<i4")
    for end in range(BLOCK, data.size + 1, BLOCK):
        digest = xxhash.xxh3_64_intdigest(running + data[end - BLOCK:end].tobytes())
        running = digest.to_bytes(8, "little")
        out.append(digest - (1 << 64) if digest >= 1 << 63 else digest)
    return out


def common_tokens(a: Tokens, b: Tokens) -> int:
    """How many leading tokens two token lists share."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
