"""Table-driven tests for TimingsScanner: the final `timings` found in an SSE byte stream however it is chunked."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from slotkeeper.dialects import framing
from slotkeeper.dialects.framing import TimingsScanner

TIMINGS = {"cache_n": 12, "prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 8, "predicted_ms": 20.25}


def chunk_event(content: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"delta": {"content": content}}]}).encode() + b"\n\n"


def final_event(timings: dict[str, Any]) -> bytes:
    body = {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 8},
            "timings": timings}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

STREAMS: dict[str, bytes] = {
    "lf": chunk_event("Hello") + chunk_event(" world") + final_event(TIMINGS) + DONE,
    "crlf": (chunk_event("Hi") + final_event(TIMINGS) + DONE).replace(b"\n", b"\r\n"),
    "no-space-after-colon": chunk_event("x") + final_event(TIMINGS).replace(b"data: ", b"data:") + DONE,
    "with-comments-and-event-lines": b": keep-alive\n\nevent: message\n" + chunk_event("x") + b": ping\n\n"
    + final_event(TIMINGS) + DONE,
    "timings-only-event": chunk_event("x") + b'data: {"timings": ' + json.dumps(TIMINGS).encode() + b"}\n\n" + DONE,
    "unicode-content": chunk_event("caf\u00e9 \u2615 \U0001f999") + final_event(TIMINGS) + DONE,
}


def scan(*chunks: bytes, finish: bool = True) -> TimingsScanner:
    scanner = TimingsScanner()
    for chunk in chunks:
        scanner.feed(chunk)
    if finish:
        scanner.finish()
    return scanner


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_whole_stream(stream: bytes) -> None:
    scanner = scan(stream)
    assert scanner.timings == TIMINGS
    assert scanner.saw_done


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_split_in_two_at_every_offset(stream: bytes) -> None:
    for cut in range(len(stream) + 1):
        scanner = scan(stream[:cut], stream[cut:])
        assert scanner.timings == TIMINGS, f"split at byte {cut}"
        assert scanner.saw_done, f"split at byte {cut}"


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_split_in_three_around_the_final_event(stream: bytes) -> None:
    start = stream.index(b'"timings"') - 20
    end = len(stream)
    for first in range(start, end):
        for second in range(first, end, 7):
            scanner = scan(stream[:first], stream[first:second], stream[second:])
            assert scanner.timings == TIMINGS, f"split at bytes {first}, {second}"
            assert scanner.saw_done


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_one_byte_at_a_time(stream: bytes) -> None:
    scanner = scan(*(stream[i:i + 1] for i in range(len(stream))))
    assert scanner.timings == TIMINGS
    assert scanner.saw_done


def test_empty_chunks_are_harmless() -> None:
    stream = STREAMS["lf"]
    scanner = scan(b"", stream[:10], b"", stream[10:], b"")
    assert scanner.timings == TIMINGS


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([final_event({"n": 1}), final_event({"n": 2})], {"n": 2}),
        ([final_event({"n": 1}), chunk_event("x"), final_event({"n": 2}), chunk_event("y")], {"n": 2}),
        ([final_event({"n": 1}), final_event({"n": 2}), final_event({"n": 3})], {"n": 3}),
        ([final_event({"n": 1}), b'data: {"timings": null}\n\n'], {"n": 1}),
        ([final_event({"n": 1}), b'data: {"timings": [1, 2]}\n\n'], {"n": 1}),
        ([final_event({"n": 1}), b'data: {"timings": {"n": \n\n'], {"n": 1}),
    ],
    ids=["two", "interleaved", "three", "later-null-ignored", "later-list-ignored", "later-garbage-ignored"],
)
def test_last_timings_wins(events: list[bytes], expected: dict[str, Any]) -> None:
    assert scan(*events).timings == expected


@pytest.mark.parametrize(
    "line",
    [
        b'data: {"timings": {"n": 1}',
        b"data: {timings}",
        b'data: "timings"',
        b'data: ["timings"]',
        b'data: {"timings": "soon"}',
        b'data: {"timings": 5}',
        b"data: not json but mentions \"timings\"",
        b'data: {"timings": {"n": 1}} trailing',
        b'data: {"timings": {"n": NaN',
        b'data: \xff\xfe"timings"',
    ],
    ids=["truncated", "unquoted", "json-string", "json-list", "string-value", "int-value", "text", "trailing-text",
         "truncated-nan", "invalid-utf8"],
)
def test_garbage_is_ignored(line: bytes) -> None:
    scanner = scan(line + b"\n\n" + DONE)
    assert scanner.timings is None
    assert scanner.saw_done


@pytest.mark.parametrize(
    "line",
    [
        b'{"timings": {"n": 1}}',
        b' data: {"timings": {"n": 1}}',
        b'event: {"timings": {"n": 1}}',
        b': {"timings": {"n": 1}}',
        b'id: {"timings": {"n": 1}}',
        b'DATA: {"timings": {"n": 1}}',
    ],
    ids=["no-field", "leading-space", "event-field", "comment", "id-field", "upper-case-field"],
)
def test_only_data_lines_count(line: bytes) -> None:
    assert scan(line + b"\n").timings is None


@pytest.fixture
def parsed_payloads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every payload the scanner hands to json.loads."""
    seen: list[bytes] = []
    real_loads: Callable[..., Any] = json.loads

    def spy(payload: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(payload)
        return real_loads(payload, *args, **kwargs)

    monkeypatch.setattr(framing.json, "loads", spy)
    return seen


@pytest.mark.parametrize(
    "stream",
    [
        chunk_event("Hello") * 50 + DONE,
        b'data: {"timing": 1}\n\n',
        b'data: {"Timings": {"n": 1}}\n\n',
        b'data: {"choices": [{"delta": {"content": "the word timings unquoted"}}]}\n\n',
        b"data: {not json at all}\n\n",
        b": comment\n\nevent: x\n\n",
    ],
    ids=["many-content-chunks", "singular-timing", "capitalised", "unquoted-mention", "invalid-json", "no-data"],
)
def test_lines_without_timings_are_not_parsed(stream: bytes, parsed_payloads: list[bytes]) -> None:
    scanner = scan(stream)
    assert parsed_payloads == []
    assert scanner.timings is None


def test_only_the_timings_line_is_parsed(parsed_payloads: list[bytes]) -> None:
    scanner = scan(STREAMS["lf"])
    assert len(parsed_payloads) == 1
    assert b'"timings"' in parsed_payloads[0]
    assert scanner.timings == TIMINGS


@pytest.mark.parametrize(
    ("stream", "saw_done"),
    [
        (DONE, True),
        (b"data:[DONE]\n", True),
        (b"data: [DONE]\r\n\r\n", True),
        (b"data:   [DONE]   \n", True),
        (b"data: [DONE]", True),
        (chunk_event("x"), False),
        (b"", False),
        (b"[DONE]\n", False),
        (b"data: [done]\n", False),
        (b'data: "[DONE]"\n', False),
        (b": [DONE]\n", False),
    ],
    ids=["standard", "no-space", "crlf", "padded", "no-newline", "no-done", "empty", "no-field", "lower-case",
         "quoted", "comment"],
)
def test_done(stream: bytes, saw_done: bool) -> None:
    assert scan(stream).saw_done is saw_done


def test_done_split_across_chunks() -> None:
    for cut in range(len(DONE) + 1):
        assert scan(DONE[:cut], DONE[cut:]).saw_done, f"split at byte {cut}"


def test_done_does_not_clear_timings() -> None:
    scanner = scan(final_event(TIMINGS) + DONE + DONE)
    assert scanner.timings == TIMINGS
    assert scanner.saw_done


@pytest.mark.parametrize(
    "tail",
    [
        b"data: " + json.dumps({"timings": TIMINGS}).encode(),
        b"data: " + json.dumps({"timings": TIMINGS}).encode() + b"\r",
        b"data:" + json.dumps({"timings": TIMINGS}, separators=(",", ":")).encode(),
    ],
    ids=["plain", "cr", "compact"],
)
def test_final_line_without_newline_needs_finish(tail: bytes) -> None:
    scanner = scan(chunk_event("x"), tail, finish=False)
    assert scanner.timings is None, "an unterminated line may still be growing"
    scanner.finish()
    assert scanner.timings == TIMINGS
    scanner.finish()
    assert scanner.timings == TIMINGS


def test_finish_with_nothing_pending_changes_nothing() -> None:
    scanner = scan(STREAMS["lf"], finish=False)
    assert scanner.timings == TIMINGS
    scanner.finish()
    assert scanner.timings == TIMINGS
    assert scanner.saw_done


def test_fresh_scanner() -> None:
    scanner = TimingsScanner()
    scanner.finish()
    assert scanner.timings is None
    assert not scanner.saw_done


def _chunkings(stream: bytes) -> Iterator[list[bytes]]:
    for size in (1, 2, 3, 5, 8, 13, 64, 4096):
        yield [stream[i:i + size] for i in range(0, len(stream), size)]


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_fixed_size_chunkings(stream: bytes) -> None:
    for chunks in _chunkings(stream):
        assert scan(*chunks).timings == TIMINGS
