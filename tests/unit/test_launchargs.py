"""Table-driven tests for reading a llama-server command line (launch mode): every spelling of the options slotkeeper
reads, options without a value, what slotkeeper adds, what it refuses, and what it warns about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slotkeeper.upstream.launchargs import (
    LlamaServerArgs,
    check_command,
    launch_slot_dir,
    launch_warnings,
    parse_command,
    plan_launch,
)

BIN = "/opt/llama/llama-server"
REPO = Path(__file__).resolve().parents[2]


def parse(*words: str) -> LlamaServerArgs:
    return parse_command([BIN, *words])


# ---------------------------------------------------------------------------------------------------------------------
# Reading values: long, short and --x=value forms


@pytest.mark.parametrize(
    ("words", "field", "expected"),
    [
        (["--port", "8080"], "port", 8080),
        (["--port=8080"], "port", 8080),
        (["--host", "0.0.0.0"], "host", "0.0.0.0"),
        (["--host=::1"], "host", "::1"),
        (["--alias", "qwen"], "alias", "qwen"),
        (["-a", "qwen"], "alias", "qwen"),
        (["--alias=qwen:agent"], "alias", "qwen:agent"),
        (["--slot-save-path", "/srv/slots"], "slot_save_path", "/srv/slots"),
        (["--slot-save-path=/srv/a=b"], "slot_save_path", "/srv/a=b"),
        (["-np", "4"], "parallel", 4),
        (["--parallel", "2"], "parallel", 2),
        (["--parallel=3"], "parallel", 3),
        (["-np", "-1"], "parallel", -1),
        (["-c", "65536"], "ctx_size", 65536),
        (["--ctx-size", "4096"], "ctx_size", 4096),
        (["--ctx-size=0"], "ctx_size", 0),
        (["-m", "/models/q.gguf"], "model", "/models/q.gguf"),
        (["--model", "rel/q.gguf"], "model", "rel/q.gguf"),
        (["--model=/m/with space.gguf"], "model", "/m/with space.gguf"),
        (["-sps", "0"], "slot_prompt_similarity", 0.0),
        (["--slot-prompt-similarity", "0.5"], "slot_prompt_similarity", 0.5),
        (["--slot-prompt-similarity=0.25"], "slot_prompt_similarity", 0.25),
        (["-cram", "0"], "cache_ram", 0),
        (["--cache-ram", "4096"], "cache_ram", 4096),
        (["--cache-ram=-1"], "cache_ram", -1),
        (["--cache-ram", "-1"], "cache_ram", -1),
        (["--port", "1", "--port", "2"], "port", 2),
        (["-np", "1", "--parallel=4"], "parallel", 4),
        ([], "port", None),
        ([], "parallel", None),
        ([], "slot_save_path", None),
        ([], "model", None),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_values_in_every_form(words: list[str], field: str, expected: Any) -> None:
    assert getattr(parse(*words), field) == expected


@pytest.mark.parametrize(
    ("words", "flags"),
    [
        (["--kv-unified"], {"kv_unified"}),
        (["-kvu"], {"kv_unified"}),
        (["--no-kv-unified"], {"no_kv_unified"}),
        (["-no-kvu"], {"no_kv_unified"}),
        (["--kv-unified", "--no-kv-unified"], {"no_kv_unified"}),
        (["--no-kv-unified", "-kvu"], {"kv_unified"}),
        (["--swa-full"], {"swa_full"}),
        (["--no-cache-idle-slots"], {"no_cache_idle_slots"}),
        (["--cache-idle-slots"], {"cache_idle_slots"}),
        ([], set()),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_flags(words: list[str], flags: set[str]) -> None:
    assert parse(*words).flags == flags


@pytest.mark.parametrize(
    ("words", "port", "parallel", "model"),
    [
        # A flag without a value never swallows the option after it.
        (["--kv-unified", "--port", "9000", "-m", "a.gguf"], 9000, None, "a.gguf"),
        (["--swa-full", "-np", "2"], None, 2, None),
        (["--no-kv-unified", "--port=9001", "--swa-full", "-m", "b.gguf"], 9001, None, "b.gguf"),
        (["--flash-attn", "on", "--port", "9002"], 9002, None, None),
        # Options slotkeeper does not read keep their values, negative numbers included.
        (["--seed", "-1", "-np", "3"], None, 3, None),
        (["--temp", "0.7", "-m", "c.gguf", "--jinja", "--port", "9003"], 9003, None, "c.gguf"),
        (["-ngl", "99", "--tensor-split", "1,1", "-np", "2"], None, 2, None),
        (["--no-webui", "-m", "d.gguf"], None, None, "d.gguf"),
        (["--chat-template-kwargs", '{"enable_thinking":false}', "--port", "9004"], 9004, None, None),
        (["--override-kv=tokenizer.ggml.add_bos_token=bool:false", "-np", "1"], None, 1, None),
        (["-ctk", "q8_0", "-ctv", "q8_0", "--port", "9005"], 9005, None, None),
    ],
    ids=["flag-then-port", "swa-full-then-np", "mixed-flags", "unknown-with-value", "negative-value",
         "sampling-options", "gpu-options", "no-value-flag", "json-value", "override-kv", "cache-types"],
)
def test_neighbours_are_not_mistaken_for_values(words: list[str], port: int | None, parallel: int | None,
                                               model: str | None) -> None:
    args = parse(*words)
    assert (args.port, args.parallel, args.model) == (port, parallel, model)
    assert " ".join(args.args) == " ".join(words).replace("--port=", "--port ")


@pytest.mark.parametrize(
    ("words", "passed_on"),
    [
        (["--port=8080", "-m", "a.gguf"], ["--port", "8080", "-m", "a.gguf"]),
        (["--slot-save-path=/s/a=b"], ["--slot-save-path", "/s/a=b"]),
        (["--model=x.gguf", "--alias=a,b"], ["--model", "x.gguf", "--alias", "a,b"]),
        (["--override-kv=k=int:1", "--temp", "0.5"], ["--override-kv=k=int:1", "--temp", "0.5"]),
        (["-c", "4096"], ["-c", "4096"]),
    ],
    ids=["port", "value-with-equals", "model-and-alias", "unknown-option-kept", "short-form"],
)
def test_known_equals_forms_are_passed_on_as_two_words(words: list[str], passed_on: list[str]) -> None:
    """llama-server (build 11434) answers `error: invalid argument: --slot-save-path=DIR`."""
    assert list(parse(*words).args) == passed_on


@pytest.mark.parametrize(
    ("words", "expected"),
    [(["--alias", "foo,bar"], "foo"), (["-a", " first , second"], "first"), (["-a", "solo"], "solo"),
     (["-a", ","], None), ([], None)],
    ids=["two", "spaces", "one", "only-commas", "none"],
)
def test_first_alias_is_the_model_name(words: list[str], expected: str | None) -> None:
    assert parse(*words).first_alias == expected


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    ("command", "fragments"),
    [
        ([], ["empty", "after --"]),
        (["-m", "model.gguf"], ["must start with the llama-server program", "'-m'"]),
        ([BIN, "--port"], ["--port needs a value"]),
        ([BIN, "-m"], ["-m needs a value"]),
        ([BIN, "--alias", "--port", "8080"], ["--alias needs a value", "not the option '--port'"]),
        ([BIN, "-np", "--kv-unified"], ["-np needs a value", "'--kv-unified'"]),
        ([BIN, "--port", "http"], ["--port needs a whole number", "'http'"]),
        ([BIN, "-np", "two"], ["-np needs a whole number", "'two'"]),
        ([BIN, "--parallel=2.5"], ["--parallel needs a whole number", "'2.5'"]),
        ([BIN, "-c", "64k"], ["-c needs a whole number", "'64k'"]),
        ([BIN, "-sps", "high"], ["-sps needs a number", "'high'"]),
        ([BIN, "--cache-ram", "lots"], ["--cache-ram needs a whole number"]),
    ],
    ids=["empty", "no-program", "port-at-end", "model-at-end", "alias-then-option", "np-then-flag", "port-word",
         "np-word", "np-float", "ctx-suffix", "sps-word", "cache-ram-word"],
)
def test_parse_errors(command: list[str], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_command(command)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("words", "slot_dir", "fragments"),
    [
        (["--port", "0"], None, ["--port 0 is out of range", "leave it out"]),
        (["--port", "70000"], None, ["--port 70000"]),
        (["--no-slots"], None, ["--no-slots", "/slots"]),
        (["--api-key", "k"], None, ["--api-key", "slotkeeper --api-key"]),
        (["--api-key-file", "/k"], None, ["--api-key-file"]),
        (["--host", "/run/llama.sock"], None, ["UNIX socket", "leave --host out"]),
        (["--slot-save-path", "/b"], Path("/a"), ["--slot-dir /a", "--slot-save-path /b", "differ"]),
    ],
    ids=["port-zero", "port-huge", "no-slots", "api-key", "api-key-file", "unix-socket", "slot-dir-conflict"],
)
def test_check_refuses(words: list[str], slot_dir: Path | None, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        check_command([BIN, *words], slot_dir)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("words", "slot_dir"),
    [([], None), (["--slots"], None), (["--no-slots", "--slots"], None), (["--slot-save-path", "/a/"], Path("/a")),
     (["--slot-save-path", "/a"], Path("/a")), ([], Path("/a"))],
    ids=["plain", "slots-on", "slots-back-on", "same-dir-trailing-slash", "same-dir", "slot-dir-only"],
)
def test_check_accepts(words: list[str], slot_dir: Path | None) -> None:
    check_command([BIN, *words], slot_dir)


# ---------------------------------------------------------------------------------------------------------------------
# The launch plan: what slotkeeper adds, where it connects


def plan(*words: str, port: int = 41000) -> Any:
    return plan_launch([BIN, *words], Path("/cache/slots/launch"), lambda: port)


def test_adds_host_port_and_slot_dir_after_the_users_words() -> None:
    p = plan("-m", "m.gguf", "-np", "2", port=45678)
    assert p.argv == (BIN, "-m", "m.gguf", "-np", "2", "--host", "127.0.0.1", "--port", "45678", "--slot-save-path",
                      "/cache/slots/launch")
    assert p.added == ("--host", "127.0.0.1", "--port", "45678", "--slot-save-path", "/cache/slots/launch")
    assert (p.url, p.port, p.slot_dir, p.model, p.alias) == ("http://127.0.0.1:45678", 45678,
                                                            Path("/cache/slots/launch"), "m.gguf", None)


def test_keeps_what_the_user_gave() -> None:
    p = plan("--port=8089", "--host", "127.0.0.1", "--slot-save-path", "/srv/slots", "-a", "qwen,q")
    assert p.argv == (BIN, "--port", "8089", "--host", "127.0.0.1", "--slot-save-path", "/srv/slots", "-a", "qwen,q")
    assert p.added == ()
    assert (p.url, p.slot_dir, p.alias) == ("http://127.0.0.1:8089", Path("/srv/slots"), "qwen")


def test_pick_port_is_called_only_when_needed() -> None:
    def never() -> int:
        raise AssertionError("picked a port although --port was given")

    assert plan_launch([BIN, "--port", "8000"], Path("/s"), never).port == 8000


@pytest.mark.parametrize(
    ("host", "url"),
    [("0.0.0.0", "http://127.0.0.1:8000"), ("::", "http://[::1]:8000"), ("::1", "http://[::1]:8000"),
     ("localhost", "http://localhost:8000"), ("10.0.0.5", "http://10.0.0.5:8000"),
     ("127.0.0.1,10.0.0.5", "http://127.0.0.1:8000")],
    ids=["wildcard", "wildcard-v6", "loopback-v6", "localhost", "lan", "comma-list"],
)
def test_where_slotkeeper_connects(host: str, url: str) -> None:
    assert plan("--host", host, "--port", "8000").url == url


def test_slot_dir_of_a_command() -> None:
    assert launch_slot_dir([BIN, "-m", "x"], Path("/d")) == Path("/d")
    assert launch_slot_dir([BIN, "--slot-save-path=/own"], Path("/d")) == Path("/own")


# ---------------------------------------------------------------------------------------------------------------------
# Warnings


QUIET = ["-np", "2", "--cache-ram", "0"]  # a command slotkeeper has nothing to say about


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (QUIET, []),
        (["-np", "1", "-cram", "0"], []),
        (["-np", "2", "--cache-ram", "0", "-sps", "0"], []),
        (["-np", "2", "--cache-ram", "0", "--host", "127.0.0.1"], []),
        (["-np", "2", "--cache-ram", "0", "--host", "localhost"], []),
        (["--cache-ram", "0"], []),  # auto slots, but no RAM cache: idle slots are not emptied
        (["--cache-ram", "0", "-np", "-1"], []),
        (["-np", "2"], ["prompt cache in RAM"]),
        (["-np", "2", "--cache-ram", "4096"], ["4096 MiB"]),
        (["-np", "2", "--cache-ram", "-1"], ["(--cache-ram, no limit)"]),
        (["--no-cache-idle-slots"], ["prompt cache in RAM"]),
        (["--no-kv-unified"], ["prompt cache in RAM"]),
        ([], ["no -np", "prompt cache in RAM"]),
        (["-np", "-1"], ["no -np", "prompt cache in RAM"]),
        (["-np", "4", "--kv-unified"], ["--kv-unified with several slots", "prompt cache in RAM"]),
        (["-np", "4", "-kvu", "--no-cache-idle-slots"], ["prompt cache in RAM"]),
        (["-np", "1", "-kvu", "--cache-ram", "0"], []),
        (["-np", "1", "-kvu"], ["prompt cache in RAM"]),
        (["-np", "2", "--cache-ram", "0", "-sps", "0.1"], ["--slot-prompt-similarity 0.1: llama-server would pick"]),
        (["-np", "1", "--cache-ram", "0", "-sps", "0.5"], []),
        (["--cache-ram", "0", "--slot-prompt-similarity=0.3"], ["--slot-prompt-similarity 0.3"]),
        (["-np", "2", "--cache-ram", "0", "--host", "0.0.0.0"], ["listens on 0.0.0.0, not on loopback"]),
    ],
    ids=["quiet", "one-slot", "sps-zero", "loopback-host", "localhost", "auto-without-ram-cache",
         "auto-explicit-no-ram", "ram-cache-default", "ram-cache-size", "ram-cache-unlimited", "auto-no-idle-clearing",
         "auto-not-unified",
         "auto", "auto-explicit", "unified-several", "unified-no-idle-clearing", "unified-one-slot-no-ram",
         "unified-one-slot", "sps", "sps-one-slot", "sps-auto", "wildcard-host"],
)
def test_warnings(words: list[str], expected: list[str]) -> None:
    warnings = launch_warnings(parse(*words))
    assert len(warnings) == len(expected), warnings
    for warning, fragment in zip(warnings, expected, strict=True):
        assert fragment in warning


def test_auto_slots_warning_says_what_to_do() -> None:
    (auto, _ram) = launch_warnings(parse())
    for fragment in ("4 slots", "unified KV", "--cache-idle-slots", "hold nothing", "-np N", "--no-cache-idle-slots",
                     "--no-kv-unified"):
        assert fragment in auto


def test_the_plan_carries_the_warnings() -> None:
    assert plan("-np", "2").warnings == tuple(launch_warnings(parse("-np", "2")))
    assert plan(*QUIET).warnings == ()


@pytest.mark.parametrize(
    "words",
    [[], ["-np", "4", "-kvu"], ["-np", "2", "--cache-ram", "0", "-sps", "0.1", "--host", "0.0.0.0"]],
    ids=["auto", "unified", "sps-and-host"],
)
def test_every_warning_is_in_the_troubleshooting_page(words: list[str]) -> None:
    """The warnings are logged with a placeholder (log.warning("%s", ...)), so the source scan of
    test_troubleshooting_doc cannot see them: check their fixed text here."""
    page = " ".join((REPO / "docs" / "troubleshooting.md").read_text().split())
    for warning in launch_warnings(parse(*words)):
        pieces = [p for p in warning.replace("0.1", "{}").replace("0.0.0.0", "{}").split("{}") if p.strip()]
        for piece in pieces:
            assert " ".join(piece.split()).strip() in page, piece
