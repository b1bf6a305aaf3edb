"""Scenario `domains`: what keeping users apart costs. Several users behind one OpenWebUI (one API key, each user's
id forwarded in X-OpenWebUI-User-Id) chat on one model preset: one shared system prompt, a first question of their
own, then short follow-ups, their turns interleaved on one slot. The same traffic goes to four targets, each on its
own llama-server (`--cache-ram 0`):

- `llama-server`: alone;
- `one domain`: slotkeeper as a single user runs it (no keys): every user's states serve every other's;
- `per user`: slotkeeper with the front end's key named and the user header trusted: one cache domain per user;
- `per user, pre-warmed`: the same, with the shared system prompt pre-warmed into each user's domain by the
  operator first (`slotkeeper prewarm --domain openwebui/user=ID`): a prompt shared on purpose.

At the end, the side channel: a user who has sent nothing yet sends the first user's first request word for word.
Under one domain it is answered from the first user's state (the time to first token tells that the prompt was sent
before); kept apart it is a cold prefill. (llama-server alone reuses what its slot holds: the last user's turn on
the shared system prompt.) For reference the same request is then sent straight to each target's own llama-server
with `cache_prompt: false`: what a cold prefill of it takes there.

Reported per target: prompt tokens, reused (cache_n) and prefilled, the time to first token (every turn, and first
turns), the side-channel probe, and what slotkeeper keeps (states, bytes on disk)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, machine, make_model, percentile, processes, ratio, stream_chat
from tests.support import words

TARGETS = ("llama-server", "one domain", "per user", "per user, pre-warmed")
KEY = "bench-openwebui-key-0123456789"
ADMIN = "bench-admin-key-0123456789"
USER_HEADER = "X-OpenWebUI-User-Id"
CHAT_HEADER = "X-OpenWebUI-Chat-Id"
QUESTION_TOKENS = 200
FOLLOW_UP_TOKENS = 60


def system_prompt(tokens: int) -> str:
    return "You are the team's assistant. Answer briefly. " + words(tokens, 7)


def chats(users: int, per_user: int, turns: int, system: str) -> list[tuple[int, str, list[dict[str, str]], int]]:
    """The traffic in the order it is sent: (user, chat id, messages, turn), each user's chats taking turns with the
    others'."""
    out = []
    for turn in range(turns):
        for chat in range(per_user):
            for user in range(users):
                seed = 1000 * user + 100 * chat
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": words(QUESTION_TOKENS, seed + 1)}]
                for k in range(turn):
                    messages += [{"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": words(FOLLOW_UP_TOKENS, seed + 10 + k)}]
                out.append((user, f"chat-{user}-{chat}", messages, turn))
    return out


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    users = 2 if config.small else 4
    per_user = 1 if config.small else 2
    turns = 2 if config.small else 3
    system = system_prompt(config.system_tokens)
    traffic = chats(users, per_user, turns, system)
    ctx = config.system_tokens + QUESTION_TOKENS + turns * (FOLLOW_UP_TOKENS + 16) + 1024
    domains_config = root / "domains.toml"
    root.mkdir(parents=True, exist_ok=True)
    domains_config.write_text(f'admin_key = "{ADMIN}"\nuser_header = "{USER_HEADER}"\n'
                              f'[api_keys]\nopenwebui = "{KEY}"\n')
    samples: list[dict[str, Any]] = []
    kept: dict[str, dict[str, Any]] = {}
    with processes(root, model) as procs:
        for target in TARGETS:
            name = target.replace(" ", "-").replace(",", "")
            backend = procs.backend(f"{name}-backend", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
            url, headers = backend.url, {}
            if target != "llama-server":
                extra = ("--save-idle-seconds", "1")
                if target.startswith("per user"):
                    extra += ("--config", str(domains_config))
                    headers = {"Authorization": f"Bearer {KEY}"}
                url = procs.slotkeeper(name, backend, *extra).url
            admin = httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {ADMIN}"})
            if target == "per user, pre-warmed":
                for user in range(users):
                    admin.post("/api/sessions/prewarm", json={
                        "system": system, "domain": f"openwebui/user={user}"}).raise_for_status()
            steps = [*traffic, (users, "probe", traffic[0][2], -1)]  # the side-channel probe last, by a new user
            for user, chat, messages, turn in steps:
                with httpx.Client(timeout=600, headers={**headers, USER_HEADER: str(user)}) as client:
                    result = stream_chat(client, url, messages, chat, config.answer_tokens, header=CHAT_HEADER)
                samples.append({"target": target, "user": user, "chat": chat, "turn": turn,
                                "ttft_ms": result.ttft_ms, "prompt_n": result.prompt_n, "cache_n": result.cache_n,
                                "cache": result.cache_header})
            # The probe's request prefilled from nothing, straight to the target's own llama-server: what a cold
            # prefill of it takes on that server.
            with httpx.Client(timeout=600) as client:
                cold = stream_chat(client, backend.url, traffic[0][2], "cold", config.answer_tokens,
                                   extra={"cache_prompt": False, "id_slot": 0})
            samples.append({"target": target, "user": -1, "chat": "cold", "turn": -1, "ttft_ms": cold.ttft_ms,
                            "prompt_n": cold.prompt_n, "cache_n": cold.cache_n, "cache": None})
            if target != "llama-server":
                time.sleep(1.5)  # the last turn's idle save
                disk = admin.get("/api/sessions/disk").json()
                listed = admin.get("/api/sessions", params={"kind": "all"}).json()["sessions"]
                kept[target] = {"stored_bytes": disk["stored_bytes"], "states": len(listed),
                                "system_states": sum(1 for s in listed if s["kind"] == "system"),
                                "domains": len({s["domain"] for s in listed})}
            admin.close()
    return {"scenario": "domains", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "users": users, "chats_per_user": per_user, "turns": turns, "samples": samples,
            "summary": summarize(samples, kept)}


def summarize(samples: list[dict[str, Any]], kept: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in TARGETS:
        mine = [s for s in samples if s["target"] == target and s["chat"] not in ("probe", "cold")]
        probe = next(s for s in samples if s["target"] == target and s["chat"] == "probe")
        cold = next(s for s in samples if s["target"] == target and s["chat"] == "cold")
        prompt = sum(s["prompt_n"] + s["cache_n"] for s in mine)
        reused = sum(s["cache_n"] for s in mine)
        out[target] = {
            "prompt_tokens": prompt, "reused_tokens": reused, "prefilled_tokens": prompt - reused,
            "reuse": round(ratio(reused, prompt), 3),
            "ttft_ms_p50": percentile([s["ttft_ms"] for s in mine], 50),
            "first_turn_ttft_ms_p50": statistics.median(s["ttft_ms"] for s in mine if s["turn"] == 0),
            "probe": {"ttft_ms": probe["ttft_ms"], "cache_n": probe["cache_n"], "prompt_n": probe["prompt_n"],
                      "cold_ttft_ms": cold["ttft_ms"], "over_cold": round(ratio(probe["ttft_ms"], cold["ttft_ms"]), 2)},
            **({"kept": kept[target]} if target in kept else {}),
        }
    one, apart = out["one domain"], out["per user"]
    return {"targets": out, "per_user_over_one_domain": {
        "prefilled": round(ratio(apart["prefilled_tokens"], one["prefilled_tokens"]), 2),
        "stored_bytes": round(ratio(apart["kept"]["stored_bytes"], one["kept"]["stored_bytes"]), 2),
        "first_turn_ttft": round(ratio(apart["first_turn_ttft_ms_p50"], one["first_turn_ttft_ms_p50"]), 2),
        "probe_ttft": round(ratio(apart["probe"]["ttft_ms"], one["probe"]["ttft_ms"]), 2),
    }}
