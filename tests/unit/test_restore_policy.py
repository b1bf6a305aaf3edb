"""What a backend can restore (capability.py), the proof of reuse (proof.py) and the prompt-end step's request
(promptend.py): table tests of plain values, no backend."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from slotkeeper.cache.capability import (
    ArchKind,
    Capability,
    Strategy,
    arch_kind,
    build_number,
    checkpoints_by_build,
    has_checkpoint_appendix,
)
from slotkeeper.cache.promptend import replay_body
from slotkeeper.cache.proof import FALLBACK_AFTER, RECHECK_AFTER, RestorePolicy, helped


@pytest.mark.parametrize(("metadata", "arch", "kind"), [
    ({"general.architecture": "llama", "llama.attention.head_count_kv": 4}, "llama", ArchKind.DENSE),
    ({"general.architecture": "qwen3", "qwen3.attention.head_count_kv": 8}, "qwen3", ArchKind.DENSE),
    ({"general.architecture": "mamba", "mamba.ssm.state_size": 16}, "mamba", ArchKind.RECURRENT),
    ({"general.architecture": "rwkv7"}, "rwkv7", ArchKind.RECURRENT),
    ({"general.architecture": "jamba", "jamba.attention.head_count_kv": [0, 4, 0, 4], "jamba.ssm.state_size": 16},
     "jamba", ArchKind.HYBRID),
    ({"general.architecture": "lfm2", "lfm2.attention.head_count_kv": [0, 0, 4, 0], "lfm2.shortconv.l_cache": 3},
     "lfm2", ArchKind.HYBRID),
    ({"general.architecture": "qwen35"}, "qwen35", ArchKind.HYBRID),
    ({"general.architecture": "newhybrid", "newhybrid.attention.head_count_kv": [0, 8]}, "newhybrid",
     ArchKind.HYBRID),
    ({"general.architecture": "gemma3", "gemma3.attention.sliding_window": 64}, "gemma3", ArchKind.SWA),
    ({"general.architecture": "gpt-oss"}, "gpt-oss", ArchKind.SWA),
    ({"general.architecture": "newswa", "newswa.attention.sliding_window": 4096}, "newswa", ArchKind.SWA),
    ({}, "", ArchKind.UNKNOWN),
], ids=lambda v: v if isinstance(v, str) else None)
def test_arch_kind(metadata: dict[str, object], arch: str, kind: ArchKind) -> None:
    assert arch_kind(metadata) == (arch, kind)


@pytest.mark.parametrize(("build_info", "number", "checkpoints"), [
    ("b11434-3f0c2a1", 11434, False),
    ("b11549-abcdef0", 11549, True),
    ("b12000-x", 12000, True),
    ("b11500-x", 11500, None),  # between the last build known without and the first known with
    ("b5000-x", 5000, False),
    ("b0-unknown", None, None),  # built from source without git: nothing known
    ("", None, None),
])
def test_checkpoints_by_build(build_info: str, number: int | None, checkpoints: bool | None) -> None:
    assert build_number(build_info) == number
    assert checkpoints_by_build(build_info) is checkpoints


@pytest.mark.parametrize(("kind", "checkpoints", "strategy"), [
    (ArchKind.DENSE, False, Strategy.RESTORE),
    (ArchKind.DENSE, None, Strategy.RESTORE),
    (ArchKind.UNKNOWN, None, Strategy.RESTORE),
    (ArchKind.RECURRENT, True, Strategy.RESTORE),
    (ArchKind.RECURRENT, False, Strategy.PROMPT_END),
    (ArchKind.HYBRID, None, Strategy.PROMPT_END),
    (ArchKind.HYBRID, True, Strategy.RESTORE),
    (ArchKind.SWA, False, Strategy.KEEP_HOT),
    (ArchKind.SWA, None, Strategy.KEEP_HOT),
    (ArchKind.SWA, True, Strategy.RESTORE),
])
def test_strategy_per_architecture_and_build(kind: ArchKind, checkpoints: bool | None, strategy: Strategy) -> None:
    capability = Capability("x", kind, checkpoints)
    assert capability.strategy is strategy
    assert capability.reason()
    if strategy is Strategy.KEEP_HOT:
        assert "b11549" in capability.reason() and "--swa-full" not in capability.reason()


@pytest.mark.parametrize(("owed", "cache_n", "ok"), [
    (100, 100, True), (100, 92, True), (100, 50, True), (100, 49, False), (100, 0, False),
    (8, 0, False), (8, 1, True), (7, 0, False), (1000, 500, True), (0, 0, False),
])
def test_helped(owed: int, cache_n: int, ok: bool) -> None:
    assert helped(owed, cache_n) is ok


def test_misses_in_a_row_fall_back_one_strategy_at_a_time() -> None:
    policy = RestorePolicy(Capability("llama", ArchKind.DENSE, None))
    assert policy.strategy is Strategy.RESTORE and not policy.prompt_end_saves
    for _ in range(FALLBACK_AFTER):
        policy.judged(100, 0)
    assert policy.strategy is Strategy.PROMPT_END and policy.prompt_end_saves and not policy.effective_now
    for _ in range(FALLBACK_AFTER):
        policy.judged(100, 0)
    assert policy.strategy is Strategy.KEEP_HOT and not policy.restores_allowed and policy.prompt_end_saves
    for _ in range(FALLBACK_AFTER):
        policy.judged(100, 0)  # nothing further to fall back to
    assert policy.strategy is Strategy.KEEP_HOT and policy.fallbacks == 2


def test_a_hit_breaks_the_run() -> None:
    policy = RestorePolicy(Capability("llama", ArchKind.DENSE, None))
    for cache_n in (0, 0, 90, 0, 0):
        policy.judged(100, cache_n)
    assert policy.fallback is None and policy.effective == 1 and policy.ineffective == 4


def test_a_fallback_is_tried_again_later_and_undone_by_a_good_restore() -> None:
    policy = RestorePolicy(Capability("llama", ArchKind.DENSE, None))
    for _ in range(2 * FALLBACK_AFTER):
        policy.judged(100, 0)
    assert policy.strategy is Strategy.KEEP_HOT
    for _ in range(RECHECK_AFTER - 1):
        policy.skipped()
    assert policy.strategy is Strategy.KEEP_HOT
    policy.skipped()
    assert policy.strategy is Strategy.PROMPT_END  # one trial of the strategy before
    policy.judged(100, 0)  # the trial failed: back to keeping sessions hot, tried again after as many chances
    assert policy.strategy is Strategy.KEEP_HOT
    for _ in range(RECHECK_AFTER):
        policy.skipped()
    assert policy.strategy is Strategy.PROMPT_END
    policy.judged(100, 100)
    assert policy.strategy is Strategy.PROMPT_END and policy.fallback is Strategy.PROMPT_END
    # Under prompt-end, the trial is made on the first restore that strategy allows after its chances.
    for _ in range(FALLBACK_AFTER - 1):
        policy.judged(100, 0)
    policy.judged(100, 100)
    assert policy.fallback is Strategy.PROMPT_END


def test_a_trial_from_prompt_end_back_to_restore() -> None:
    policy = RestorePolicy(Capability("llama", ArchKind.DENSE, None))
    for _ in range(FALLBACK_AFTER):
        policy.judged(100, 0)
    assert policy.fallback is Strategy.PROMPT_END
    for _ in range(RECHECK_AFTER):
        policy.skipped()
    assert policy.strategy is Strategy.RESTORE
    policy.judged(100, 95)
    assert policy.fallback is None and policy.effective_now and policy.strategy is Strategy.RESTORE


def test_a_capability_of_keep_hot_never_restores_and_never_falls_back() -> None:
    policy = RestorePolicy(Capability("gemma3", ArchKind.SWA, False))
    assert not policy.restores_allowed and policy.effective_now and not policy.prompt_end_saves
    for _ in range(100):
        policy.skipped()
    assert not policy.restores_allowed  # no trial: the build cannot restore it at all
    policy.learned(Capability("gemma3", ArchKind.SWA, True))
    assert policy.strategy is Strategy.RESTORE


def test_prompt_end_capability_falls_back_to_keep_hot_and_trials_prompt_end() -> None:
    policy = RestorePolicy(Capability("mamba", ArchKind.RECURRENT, False))
    assert policy.strategy is Strategy.PROMPT_END and policy.prompt_end_saves
    for _ in range(FALLBACK_AFTER):
        policy.judged(100, 0)
    assert policy.strategy is Strategy.KEEP_HOT and policy.prompt_end_saves
    for _ in range(RECHECK_AFTER):
        policy.skipped()
    assert policy.strategy is Strategy.PROMPT_END
    policy.judged(100, 100)
    assert policy.fallback is None and policy.strategy is Strategy.PROMPT_END


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": {"include_usage": True}, "max_tokens": 400, "tools": [{"t": 1}],
                              "logprobs": True, "top_logprobs": 3, "id_slot": 0, "cache_prompt": True},
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"t": 1}], "id_slot": 2, "cache_prompt": True,
      "stream": False, "max_tokens": 0}),
    ("/completion", {"prompt": "abc", "n_predict": 50, "stream": True, "n_probs": 5, "id_slot": 0},
     {"prompt": "abc", "id_slot": 2, "cache_prompt": True, "stream": False, "n_predict": 0}),
    ("/v1/chat/completions", {"messages": [], "max_completion_tokens": 9, "grammar": "root ::= \"a\""},
     {"messages": [], "grammar": "root ::= \"a\"", "id_slot": 2, "cache_prompt": True, "stream": False,
      "max_tokens": 0}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 128, "response_fields": ["content"],
                 "id_slot": 0},
     {"input_prefix": "a", "input_suffix": "b", "id_slot": 2, "cache_prompt": True, "stream": False, "n_predict": 0}),
], ids=["chat", "completion", "chat-grammar", "infill"])
def test_replay_body_evaluates_the_prompt_and_generates_nothing(path: str, body: dict[str, object],
                                                                expected: dict[str, object]) -> None:
    assert replay_body(path, body, 2) == expected


def _appendix(blobs: list[tuple[bytes, bytes, bytes]]) -> bytes:
    out = struct.pack("<III", 0x504B4353, 1, len(blobs))
    for i, parts in enumerate(blobs):
        out += struct.pack("<Qii", 10 * (i + 1), 0, 10 * (i + 1) - 1)
        for part in parts:
            out += struct.pack("<Q", len(part)) + part
    return out


@pytest.mark.parametrize(("content", "found"), [
    (b"state" * 100 + _appendix([(b"t" * 50, b"", b"")]), True),
    (b"state" * 100 + _appendix([(b"a" * 7, b"b", b""), (b"c" * 30, b"", b"dd")]), True),
    (b"state" * 100 + _appendix([]), True),
    (b"state" * 100, False),
    (b"state" * 100 + _appendix([(b"t" * 50, b"", b"")])[:-1], False),  # cut short
    (b"state" * 100 + _appendix([(b"t" * 50, b"", b"")]) + b"x", False),  # something after it
    (b"SCKP\x01\x00\x00\x00" + b"\xff" * 40, False),  # the magic by chance, not a valid appendix
    (b"", False),
], ids=["one", "two", "none-in-it", "no-appendix", "truncated", "trailing", "magic-by-chance", "empty"])
def test_checkpoint_appendix_is_found_only_when_it_ends_the_file(tmp_path: Path, content: bytes,
                                                                  found: bool) -> None:
    path = tmp_path / "slot.bin"
    path.write_bytes(content)
    assert has_checkpoint_appendix(path) is found


def test_the_embedded_servers_build_comes_from_its_package_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    from slotkeeper.serving.backend import capability_of

    props = {"build_info": "b0-unknown", "model_path": str(tmp_path / "absent.gguf")}
    assert capability_of(props).checkpoints_in_file is None  # an attached server that names no build
    expected = int(version("xllamacpp").rsplit(".", 1)[-1]) >= 11549
    assert capability_of(props, embedded=True).checkpoints_in_file is expected
