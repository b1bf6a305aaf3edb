"""The `slotkeeper` command run as a subprocess: help, version, tiny-model and argument errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotkeeper import __version__


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd, check=False,
    )


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--help"], ["usage: slotkeeper", "serve", "tiny-model", "--version"]),
        (["-h"], ["usage: slotkeeper", "serve", "tiny-model"]),
        (["serve", "--help"], ["usage: slotkeeper serve", "--upstream", "--slot-dir", "--model", "--port",
                               "--cache-dir", "--session-header", "SLOTKEEPER_"]),
        (["serve", "--help"], ["[-- /path/to/llama-server [llama-server options ...]]", "launch", "attach",
                               "embedded", "slotkeeper serve -- llama-server -m model.gguf", "--shutdown-timeout",
                               "--start-timeout", "SLOTKEEPER_LAUNCH_COMMAND", "llama-server.log"]),
        (["serve", "-h"], ["usage: slotkeeper serve", "--upstream", "--slot-dir", "--model"]),
        (["tiny-model", "--help"], ["usage: slotkeeper tiny-model", "OUT.gguf", "--seed"]),
        (["export", "--help"], ["usage: slotkeeper export", "session [FILE]", "--system", "--model", "--url"]),
        (["import", "--help"], ["usage: slotkeeper import", "FILE", "--as", "--replace", "--model", "--url"]),
        (["sessions", "clear", "--help"], ["usage: slotkeeper sessions clear", "--slot N", "--model"]),
    ],
    ids=["help", "h", "serve-help", "serve-help-launch", "serve-h", "tiny-model-help", "export-help", "import-help",
         "sessions-clear-help"],
)
def test_help(args: list[str], fragments: list[str]) -> None:
    result = run(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for fragment in fragments:
        assert fragment in result.stdout


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"slotkeeper {__version__}"


def test_no_command_prints_help_and_exits_2() -> None:
    result = run()
    assert result.returncode == 2
    assert "usage: slotkeeper" in result.stdout
    assert "serve" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["serve", "--upstream", "http://x"], ["--slot-dir"]),
        (["serve", "--upstream", "http://x", "--slot-dir", "/tmp/s", "--model", "/m.gguf"], ["--upstream", "--model"]),
        (["serve", "--port", "0"], ["port"]),
        (["serve", "--port", "70000"], ["port"]),
        (["serve", "--parallel", "0"], ["--parallel"]),
        (["serve", "--port", "abc"], ["--port", "invalid int"]),
        (["serve", "--log-level", "loud"], ["--log-level", "invalid choice"]),
        (["serve", "--no-such-flag"], ["unrecognized arguments"]),
        (["bogus-command"], ["invalid choice"]),
        (["tiny-model"], ["OUT.gguf"]),
        (["serve", "--"], ["nothing after --", "slotkeeper serve -- llama-server"]),
        (["serve", "--upstream", "http://x", "--slot-dir", "/s", "--", "llama-server"], ["--upstream", "not both"]),
        (["serve", "--model", "/m.gguf", "--", "llama-server", "-np", "2"], ["--model", "-m PATH.gguf"]),
        (["serve", "--", "llama-server", "--port"], ["--port needs a value"]),
        (["serve", "--", "-m", "model.gguf"], ["llama-server program"]),
        (["serve", "--shutdown-timeout", "0", "--", "llama-server"], ["--shutdown-timeout"]),
        (["tiny-model", "/tmp/x.gguf", "--", "llama-server"], ["only `slotkeeper serve`"]),
        (["export"], ["usage: slotkeeper export", "the following arguments are required: session"]),
        (["import"], ["usage: slotkeeper import", "the following arguments are required: FILE"]),
        (["export", "a", "b.tar", "c"], ["unrecognized arguments: c"]),
    ],
    ids=["upstream-without-slot-dir", "upstream-and-model", "port-zero", "port-too-big", "parallel-zero",
         "port-not-int", "bad-log-level", "unknown-flag", "unknown-command", "tiny-model-without-out",
         "launch-empty", "launch-and-upstream", "launch-and-model", "launch-port-without-value",
         "launch-without-program", "shutdown-timeout-zero", "launch-on-another-command", "export-without-session",
         "import-without-file", "export-extra-word"],
)
def test_argument_errors_exit_2(args: list[str], fragments: list[str]) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_upstream_without_slot_dir_message() -> None:
    result = run("serve", "--upstream", "http://x")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("slotkeeper: ")
    assert "--slot-dir" in result.stderr
    assert "--slot-save-path" in result.stderr


def test_launch_command_is_everything_after_the_first_double_dash() -> None:
    import tomllib

    result = run("serve", "--port", "11500", "--print-config", "--", "/opt/llama-server", "-m", "a b.gguf", "--port",
                 "9000", "--", "--not-ours")
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["port"] == 11500
    assert printed["launch_command"] == ["/opt/llama-server", "-m", "a b.gguf", "--port", "9000", "--", "--not-ours"]


def test_tiny_model_writes_a_file(tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    result = run("tiny-model", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file()
    size = out.stat().st_size
    assert size > 0
    assert result.stdout.startswith("wrote")
    assert str(out) in result.stdout
    assert f"({size} bytes)" in result.stdout
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize(
    "options",
    [[], ["--seed", "7"], ["--n-layer", "2", "--n-embd", "128", "--n-ff", "256"]],
    ids=["defaults", "seed", "shape"],
)
def test_tiny_model_is_deterministic(tmp_path: Path, options: list[str]) -> None:
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert run("tiny-model", str(first), *options).returncode == 0
    assert run("tiny-model", str(second), *options).returncode == 0
    assert first.read_bytes() == second.read_bytes()


def test_tiny_model_seed_changes_bytes(tmp_path: Path) -> None:
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert run("tiny-model", str(first), "--seed", "1").returncode == 0
    assert run("tiny-model", str(second), "--seed", "2").returncode == 0
    assert first.read_bytes() != second.read_bytes()


def test_tiny_model_relative_path(tmp_path: Path) -> None:
    result = run("tiny-model", "rel.gguf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rel.gguf").is_file()


def test_a_reader_that_closes_the_pipe_early_is_not_an_error() -> None:
    """`slotkeeper sessions explain ID | grep -q WORD`: grep exits at its first match, and the next write of the
    command meets a closed pipe. That is the reader's choice, not a failure (exit status 0, no traceback)."""
    import subprocess
    import sys

    script = ("import sys\n"
              "from unittest import mock\n"
              "import slotkeeper.cli.manage as manage\n"
              "def run(args):\n"
              "    for i in range(100000):\n"
              "        print('line', i)\n"
              "    return 0\n"
              "with mock.patch.object(manage, 'run', run):\n"
              "    from slotkeeper.cli import main\n"
              "    sys.exit(main(['sessions', 'ls']))\n")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -c \"$0\" | head -n 1", script],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "line 0\n" and "Traceback" not in result.stderr, result.stderr
