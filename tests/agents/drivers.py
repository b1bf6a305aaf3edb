"""One driver per coding agent: its own configuration written into a temporary HOME, and one non-interactive turn
per call, the first turn of a conversation creating it and every later one resuming it.

Every agent gets:
- its API's base URL pointing at the recording proxy, the model `tiny`, a dummy API key;
- its switches for telemetry, error reports, update checks and other non-essential traffic off;
- HTTP_PROXY / HTTPS_PROXY pointing at the refusing proxy (loopback exempt through NO_PROXY), so that whatever it
  still tries to fetch from the internet fails at once and is on record;
- a working directory of its own holding a small project (a git repository, which Codex wants);
- a bounded turn: the agent is stopped (its process group: SIGTERM, then SIGKILL) after `timeout` seconds or once it
  has sent `max_requests` requests in the turn and its last one has ended. A random-weight model answers gibberish
  and an agent may retry or try tools: that is all right, the turn only has to end.

The command lines run are kept on each `Turn`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tests.agents.proxy import Proxies

MODEL = "tiny"
DUMMY_KEY = "sk-local-dummy"
TURN_TIMEOUT = 240.0
MAX_REQUESTS_PER_TURN = 16
# After the agent's last request ended, how long it may take to write its session and exit by itself.
EXIT_GRACE = 20.0


@dataclass
class Turn:
    """One turn of one agent: what was run, how it ended, and the requests it sent (indices into the records)."""

    agent: str
    label: str  # A1, B1, A2, ...
    conversation: str  # A or B
    number: int
    argv: list[str]
    session: str = ""  # the agent's own conversation id, once known
    returncode: int | None = None
    stopped: str = ""  # "" when the agent exited by itself, else why it was stopped
    seconds: float = 0.0
    requests: list[int] = field(default_factory=list)
    stdout_tail: str = ""
    stderr_tail: str = ""

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


# The fixed prompts: conversation A and B are two different tasks in one repository.
PROMPTS = {
    "A": ["Read calc.py and explain in two sentences what the add function does.",
          "Now suggest one unit test for add, as a short code block.",
          "Summarize this conversation in one sentence."],
    "B": ["List the files in this project and say which one is the entry point.",
          "What would you rename in notes.md to make it clearer? One line."],
}

PROJECT_FILES = {
    "calc.py": "def add(a, b):\n    return a + b\n\n\nif __name__ == '__main__':\n    print(add(2, 3))\n",
    "notes.md": "# Notes\n\nA tiny project for driving coding agents in tests.\n",
}


def make_project(path: Path) -> Path:
    """A small git repository to run the agents in (its contents are fixed, so every run sees the same files)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in PROJECT_FILES.items():
        (path / name).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    if not (path / ".git").exists():
        for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "."], ["git", "commit", "-q", "-m", "init"]):
            subprocess.run(argv, cwd=path, env=env, check=True, capture_output=True)
    return path


class Driver:
    """The part all agents share: the environment, running one bounded turn, and the session id bookkeeping."""

    name: ClassVar[str] = ""
    command: ClassVar[str] = ""

    def __init__(self, bin_dir: Path, home: Path, project: Path, proxies: Proxies) -> None:
        self.bin_dir = bin_dir
        self.home = home
        self.project = project
        self.proxies = proxies
        self.sessions: dict[str, str] = {}  # conversation -> the agent's id
        self.home.mkdir(parents=True, exist_ok=True)

    @property
    def executable(self) -> str:
        return str(self.bin_dir / self.command)

    def configure(self) -> None:
        """Write the agent's own settings into HOME."""

    def agent_env(self) -> dict[str, str]:
        return {}

    def env(self) -> dict[str, str]:
        keep = ("PATH", "LANG", "LC_ALL", "TERM", "TZ", "USER", "LOGNAME", "SHELL", "TMPDIR")
        env = {k: v for k, v in os.environ.items() if k in keep}
        outbound = self.proxies.outbound.url
        env.update({
            "HOME": str(self.home), "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_DATA_HOME": str(self.home / ".local" / "share"), "XDG_CACHE_HOME": str(self.home / ".cache"),
            "XDG_STATE_HOME": str(self.home / ".local" / "state"),
            "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HTTP_PROXY": outbound, "HTTPS_PROXY": outbound, "ALL_PROXY": outbound,
            "http_proxy": outbound, "https_proxy": outbound, "all_proxy": outbound,
            "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1",
            "NO_COLOR": "1", "CI": "1", "TERM": "dumb",
            # npm, which some agents call to check for updates or install plugins
            "npm_config_update_notifier": "false", "NO_UPDATE_NOTIFIER": "1",
        })
        env.update(self.agent_env())
        return env

    def argv(self, conversation: str, prompt: str, first: bool) -> list[str]:
        raise NotImplementedError

    def learn_session(self, conversation: str, stdout: str) -> None:
        """Take the agent's own conversation id from a first turn's output, where it is not chosen up front."""

    def run_turn(self, conversation: str, number: int, prompt: str, timeout: float = TURN_TIMEOUT,
                 max_requests: int = MAX_REQUESTS_PER_TURN) -> Turn:
        first = conversation not in self.sessions
        argv = self.argv(conversation, prompt, first)
        label = f"{conversation}{number}"
        turn = Turn(self.name, label, conversation, number, argv)
        self.proxies.set_turn(label)
        already = len(self.proxies.snapshot())
        log_dir = self.home / "turn-logs"
        log_dir.mkdir(exist_ok=True)
        out_path, err_path = log_dir / f"{label}.out", log_dir / f"{label}.err"
        started = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            process = subprocess.Popen(argv, cwd=self.project, env=self.env(), stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=err, start_new_session=True)
            turn.stopped = self._wait(process, started, timeout, max_requests, already)
        turn.seconds = time.monotonic() - started
        turn.returncode = process.returncode
        self.proxies.wait_idle(30)
        self.proxies.set_turn("")
        stdout = out_path.read_text(errors="replace")
        turn.stdout_tail = stdout[-3000:]
        turn.stderr_tail = err_path.read_text(errors="replace")[-3000:]
        if first:
            self.learn_session(conversation, stdout)
        turn.session = self.sessions.get(conversation, "")
        turn.requests = [r.index for r in self.proxies.snapshot()[already:] if r.turn == label]
        return turn

    def _wait(self, process: subprocess.Popen[bytes], started: float, timeout: float, max_requests: int,
              already: int) -> str:
        """Wait for the agent to exit; stop it on the deadline, or once it has used up its requests."""
        budget_spent_at: float | None = None
        while process.poll() is None:
            now = time.monotonic()
            if now - started > timeout:
                _stop_group(process)
                return f"timeout after {timeout:.0f} s"
            records = self.proxies.snapshot()[already:]
            if len(records) >= max_requests and all(r.ended for r in records):
                budget_spent_at = budget_spent_at or now
                if now - budget_spent_at > EXIT_GRACE:
                    _stop_group(process)
                    return f"stopped after {len(records)} requests"
            time.sleep(0.1)
        return ""


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the agent's process group (it was started in a session of its own), SIGKILL if it stays."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class ClaudeCode(Driver):
    """Claude Code: `claude -p PROMPT --session-id UUID` first, then `claude -p PROMPT --resume UUID`, on the
    Anthropic API (ANTHROPIC_BASE_URL)."""

    name = "claude-code"
    command = "claude"

    def configure(self) -> None:
        # Onboarding done and the project trusted, so nothing waits for an answer.
        state = {"hasCompletedOnboarding": True, "numStartups": 1, "autoUpdates": False,
                 "projects": {str(self.project): {"hasTrustDialogAccepted": True, "allowedTools": []}}}
        (self.home / ".claude.json").write_text(json.dumps(state))
        settings = {"autoUpdates": False, "includeCoAuthoredBy": False, "env": {}}
        (self.home / ".claude").mkdir(exist_ok=True)
        (self.home / ".claude" / "settings.json").write_text(json.dumps(settings))

    def agent_env(self) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": self.proxies.url, "ANTHROPIC_API_KEY": DUMMY_KEY,
            "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_UPDATES": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "DISABLE_FEEDBACK_COMMAND": "1",
            "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1", "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
        }

    def argv(self, conversation: str, prompt: str, first: bool) -> list[str]:
        if first:
            self.sessions[conversation] = str(uuid.uuid4())
            return [self.executable, "-p", prompt, "--session-id", self.sessions[conversation], "--model", MODEL,
                    "--output-format", "json"]
        return [self.executable, "-p", prompt, "--resume", self.sessions[conversation], "--model", MODEL,
                "--output-format", "json"]


class Codex(Driver):
    """Codex: `codex exec --json PROMPT` (its thread id read from the `thread.started` event), then
    `codex exec resume --json THREAD PROMPT`, on the Responses API of a provider of its config file."""

    name = "codex"
    command = "codex"

    def configure(self) -> None:
        codex_home = self.home / ".codex"
        codex_home.mkdir(exist_ok=True)
        config = f"""\
model = "{MODEL}"
model_provider = "local"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
model_context_window = 65536
hide_agent_reasoning = true

[model_providers.local]
name = "local"
base_url = "{self.proxies.url}/v1"
wire_api = "responses"
env_key = "LOCAL_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 600000

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
log_user_prompt = false

[projects."{self.project}"]
trust_level = "trusted"
"""
        (codex_home / "config.toml").write_text(config)

    def agent_env(self) -> dict[str, str]:
        return {"CODEX_HOME": str(self.home / ".codex"), "LOCAL_API_KEY": DUMMY_KEY, "RUST_LOG": "warn"}

    def argv(self, conversation: str, prompt: str, first: bool) -> list[str]:
        if first:
            return [self.executable, "exec", "--json", "--skip-git-repo-check", prompt]
        return [self.executable, "exec", "resume", "--json", "--skip-git-repo-check", self.sessions[conversation],
                prompt]

    def learn_session(self, conversation: str, stdout: str) -> None:
        for line in stdout.splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("type") == "thread.started":
                self.sessions[conversation] = str(event["thread_id"])
                return


class OpenCode(Driver):
    """OpenCode: `opencode run --format json -m local/tiny PROMPT` (its session id read from the events), then
    `opencode run --format json -m local/tiny --session ID PROMPT`, through @ai-sdk/openai-compatible (chat
    completions)."""

    name = "opencode"
    command = "opencode"

    def configure(self) -> None:
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"local": {
                "npm": "@ai-sdk/openai-compatible", "name": "local",
                "options": {"baseURL": f"{self.proxies.url}/v1", "apiKey": DUMMY_KEY},
                "models": {MODEL: {"name": MODEL, "limit": {"context": 65536, "output": 4096}}},
            }},
            "model": f"local/{MODEL}", "small_model": f"local/{MODEL}",
            "autoupdate": False, "share": "disabled", "lsp": False, "formatter": False,
        }
        directory = self.home / ".config" / "opencode"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "opencode.json").write_text(json.dumps(config, indent=2))

    def agent_env(self) -> dict[str, str]:
        return {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
                "OPENCODE_DISABLE_EMBEDDED_WEB_UI": "1", "OPENCODE_DISABLE_TERMINAL_TITLE": "1"}

    def argv(self, conversation: str, prompt: str, first: bool) -> list[str]:
        base = [self.executable, "run", "--format", "json", "-m", f"local/{MODEL}"]
        if first:
            return [*base, prompt]
        return [*base, "--session", self.sessions[conversation], prompt]

    def learn_session(self, conversation: str, stdout: str) -> None:
        found = re.search(r'"sessionID"\s*:\s*"(ses_[A-Za-z0-9]+)"', stdout)
        if found:
            self.sessions[conversation] = found.group(1)


class QwenCode(Driver):
    """Qwen Code: `qwen -p PROMPT --session-id UUID` first, then `qwen -p PROMPT --resume UUID`, on the OpenAI
    chat completions API (OPENAI_BASE_URL)."""

    name = "qwen-code"
    command = "qwen"

    def configure(self) -> None:
        settings: dict[str, Any] = {
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": MODEL},
            "general": {"enableAutoUpdate": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
        }
        (self.home / ".qwen").mkdir(exist_ok=True)
        (self.home / ".qwen" / "settings.json").write_text(json.dumps(settings, indent=2))

    def agent_env(self) -> dict[str, str]:
        return {"OPENAI_BASE_URL": f"{self.proxies.url}/v1", "OPENAI_API_KEY": DUMMY_KEY, "OPENAI_MODEL": MODEL,
                "QWEN_TELEMETRY_ENABLED": "false", "QWEN_CODE_DISABLE_PRECONNECT": "1"}

    def argv(self, conversation: str, prompt: str, first: bool) -> list[str]:
        if first:
            self.sessions[conversation] = str(uuid.uuid4())
            return [self.executable, "-p", prompt, "--session-id", self.sessions[conversation]]
        return [self.executable, "-p", prompt, "--resume", self.sessions[conversation]]


DRIVERS: dict[str, type[Driver]] = {d.name: d for d in (ClaudeCode, Codex, OpenCode, QwenCode)}
AGENTS = tuple(DRIVERS)
