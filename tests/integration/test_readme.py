"""The README's commands: the set-up stays two commands, the run command serves the tiny model on the embedded
server, and the example command lines of the other modes are read as the README says (checked with
--print-config, since they need real models)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import REPO, free_port, wait_healthy

pytestmark = pytest.mark.backend

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```bash\n(.*?)^```", README, re.M | re.S)
VENV = Path(sys.executable).parent.parent


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    return {**clean, "SLOTKEEPER_VENV": str(VENV)}


def test_set_up_is_two_commands() -> None:
    assert commands(BLOCKS[0]) == ["./scripts/serve.sh"]
    assert commands(BLOCKS[1]) == ["./scripts/test.sh"]


def test_the_run_command_serves_the_tiny_model(tmp_path: Path) -> None:
    port = free_port()
    argv = ["bash", "scripts/serve.sh", "--port", str(port), "--cache-dir", str(tmp_path / "cache")]
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, 180)
        response = httpx.post(f"http://127.0.0.1:{port}/api/chat", timeout=120, json={
            "model": "tiny-random-llama-1234", "stream": False, "messages": [{"role": "user", "content": "hello"}],
            "options": {"num_predict": 3}})
        assert response.status_code == 200 and response.json()["done"] is True
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown


def test_the_other_example_commands_read_as_documented(tmp_path: Path) -> None:
    examples = commands(BLOCKS[2])
    serve_lines = [line for line in examples if line.startswith("./scripts/serve.sh ")]
    assert len(serve_lines) == 4
    expected_modes = ["launch", "attach", "router", "embedded"]
    for line, mode in zip(serve_lines, expected_modes, strict=True):
        words = shlex.split(line)[1:]
        # --print-config before the command (anything after -- belongs to llama-server)
        split = words.index("--") if "--" in words else len(words)
        argv = ["bash", "scripts/serve.sh", *words[:split], "--print-config", "--cache-dir", str(tmp_path),
                *words[split:]]
        done = subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
        printed = done.stdout
        if mode == "launch":
            assert 'launch_command = ["/path/to/llama-server", "-m",' in printed
        elif mode == "attach":
            assert 'upstream = "http://127.0.0.1:8080"' in printed and "slot_dir = " in printed
        elif mode == "router":
            assert 'launch_command = ["/path/to/llama-server", "--models-dir",' in printed
        else:
            assert "ctx_size = 16384" in printed and "model = " in printed
    [tiny] = [line for line in examples if "tiny-model" in line]
    out = tmp_path / "tiny.gguf"
    made = subprocess.run([str(VENV / "bin" / "slotkeeper"), *shlex.split(tiny)[1:-1], str(out)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and out.stat().st_size > 1_000_000
