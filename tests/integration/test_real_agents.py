"""Four real coding agents, installed from npm at pinned versions (scripts/install-agents.sh), each driven
non-interactively through slotkeeper in attach mode over the llama-server binary (`--parallel 1 -c 65536
--cache-ram 0 --metrics`, a 1-layer, 64-wide tiny model with the Qwen3-style template).

Each agent runs two conversations, turn by turn, in the order A1 B1 A2 B2 A3: every turn is the agent's own
non-interactive run (`claude -p`, `codex exec`, `opencode run`, `qwen -p`), the later ones resuming the conversation
by its id. A recording proxy between the agent and slotkeeper caps every answer at 48 tokens and records every
request (tests/agents/). Checked, per agent:

- no error response that llama-server itself would not give (each is replayed straight to llama-server, except
  llama-server's own errors about the random model's malformed output);
- reuse efficiency >= 0.98: (sum of the prompts' tokens - what llama-server prefilled, its own counter) / (sum of
  the tokens each prompt shares with the best earlier prompt), with the backend's template and tokenizer;
- Qwen Code: no system-prompt warm-up on A2, B2 and A3 (slotkeeper's journal and its warm-up counter), its system
  prompt having been seen on A1 and B1.

The tests skip only when the agents are not installed and the npm registry cannot be reached.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from slotkeeper.tinymodel import write_tiny_model
from tests.agents.drivers import AGENTS
from tests.agents.proxy import Record
from tests.agents.runner import (
    AGENT_MODEL,
    CONTEXT,
    RegistryUnreachable,
    SequenceResult,
    install_agents,
    not_from_backend,
    run_sequence,
)
from tests.support import Backend, Slotkeeper

pytestmark = [pytest.mark.backend, pytest.mark.timeout(600)]

RESUMED = ("A2", "B2", "A3")
EFFICIENCY = 0.98


class Run:
    """One agent's sequence through slotkeeper, and its error responses that llama-server itself would not give."""

    def __init__(self, result: SequenceResult, ours: list[Record]) -> None:
        self.result = result
        self.ours = ours


@pytest.fixture(scope="module")
def agents_bin() -> Path:
    try:
        return install_agents()
    except RegistryUnreachable as exc:
        pytest.skip(f"the coding agents are not installed and the npm registry is unreachable: {exc}")


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-64x1-qwen3.gguf"
    write_tiny_model(path, AGENT_MODEL)
    return path


@pytest.fixture(scope="module")
def runs(agents_bin: Path, agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each agent's sequence, run once (on first use) and shared by the checks."""

    class Lazy(dict[str, Run]):
        def __missing__(self, agent: str) -> Run:
            self[agent] = run_agent(agent, agents_bin, agent_model, tmp_path_factory.mktemp(agent))
            return self[agent]

    return Lazy()


def run_agent(agent: str, agents_bin: Path, model: Path, root: Path) -> Run:
    backend = Backend("binary", model, root / "slots", root / "llama-server.log", parallel=1, ctx_per_slot=CONTEXT,
                      cache_ram=0, extra_args=("--metrics",))
    keeper = Slotkeeper(root / "cache", root / "slotkeeper.log", backend)
    try:
        backend.start()
        keeper.start()
        result = run_sequence(agent, keeper.url, agents_bin, root / "work", backend_url=backend.url,
                              keeper_url=keeper.url, target="slotkeeper")
        keeper.stop()  # the replays of error responses go to llama-server alone
        recordings = os.environ.get("SLOTKEEPER_AGENT_RECORDINGS")
        result.save(Path(recordings) / agent if recordings else root / "recordings")
        with httpx.Client(timeout=300) as client:
            return Run(result, not_from_backend(result, client, backend.url))
    finally:
        keeper.stop()
        backend.stop()


def _story(result: SequenceResult) -> str:
    rows = [f"{label}: {r['cache']} {r['why']} ({r['why_detail']}) cache_n={r['cache_n']} prompt_n={r['prompt_n']}"
            for label, found in result.journal.items() for r in found]
    turns = [f"{t.label}: {t.command} -> rc={t.returncode} {t.stopped} requests={t.requests}" for t in result.turns]
    return "\n".join([*turns, *rows])


@pytest.mark.parametrize("agent", AGENTS)
def test_no_error_llama_server_would_not_give(runs: dict[str, Run], agent: str) -> None:
    ours = runs[agent].ours
    assert not ours, "\n".join(f"#{r.index} {r.turn} {r.method} {r.path} {r.status}: {r.error[:400]}" for r in ours)


@pytest.mark.parametrize("agent", AGENTS)
def test_reuse_efficiency(runs: dict[str, Run], agent: str) -> None:
    result = runs[agent].result
    assert result.measured, _story(result)
    assert not result.rendering_mismatches(), result.rendering_mismatches()  # the exact count depends on it
    summary = {k: result.summary()[k] for k in ("prefilled", "prompt_tokens", "shared_tokens", "efficiency",
                                                 "cache_n_efficiency", "warm_ups")}
    assert result.efficiency is not None and result.efficiency >= EFFICIENCY, f"{summary}\n{_story(result)}"


def test_qwen_code_no_warm_up_on_resumed_turns(runs: dict[str, Run]) -> None:
    result = runs["qwen-code"].result
    warmed = {label: [r for r in result.journal[label] if r["why"] == "warm-up"
                      or "system prompt was evaluated" in r["why_detail"]] for label in RESUMED}
    counted = {label: result.warm_ups[label] for label in RESUMED}
    assert not any(warmed.values()) and not any(counted.values()), f"{counted}\n{_story(result)}"
