"""`python -m bench --scenario all --small` end to end against real llama-server processes: the result files are
written and well-formed. No timing is asserted (the numbers depend on the machine); only that they exist, are
positive and that the ratios were computed, and that the token and cache counts are what the workload implies."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.openwebui_chats import TASK_KINDS
from tests.openwebui_chats import steps as openwebui_steps
from tests.support import REPO

# The whole --small run is the module fixture's setup, counted in the first test's timeout.
pytestmark = [pytest.mark.backend, pytest.mark.timeout(900)]


SCENARIOS = ("switch", "reading", "overhead", "restart", "system", "agent", "scale", "day", "title", "beyond", "first",
             "client", "backends", "decide")
TARGETS = ["llama-server cram0", "llama-server default", "slotkeeper"]


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0 and math.isfinite(value)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "all", "--small", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=850)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def load(out: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    assert data["scenario"] == name
    assert data["config"]["small"] is True
    assert data["machine"]["cpus"] >= 1
    assert data["samples"]
    return data


def test_files_and_report(results: Path) -> None:
    for name in SCENARIOS:
        assert (results / f"{name}.json").is_file()
        assert positive(load(results, name)["wall_seconds"])
    report = (results / "README.md").read_text()
    for name in SCENARIOS:
        assert f"## {name}" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (results / "results.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("scenario", ["switch", "reading"])
def test_switch(results: Path, scenario: str) -> None:
    data = load(results, scenario)
    assert data["pause_seconds"] == (0 if scenario == "switch" else 1.0)
    config = data["config"]
    targets = data["targets"]
    assert targets == ["llama-server cram0", "llama-server default", "slotkeeper"]
    assert len(data["samples"]) == len(targets) * config["sessions"] * config["rounds"] * len(config["tokens"])
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"]) and sample["total_ms"] >= sample["ttft_ms"]
        assert sample["prompt_n"] >= 1 and sample["cache_n"] >= 0 and positive(sample["prompt_ms"])
        if sample["target"] == "slotkeeper":
            assert sample["cache"] in {"hot", "restored", "prefix", "cold"}
            assert sample["restore_ms"] >= 0 and sample["save_ms"] >= 0
    for tokens in config["tokens"]:
        summary = data["summary"][str(tokens)]
        for target in targets:
            assert positive(summary["targets"][target]["ttft_ms"]["median"])
            assert positive(summary["targets"][target]["prompt_n_median"])
            assert positive(summary["targets"][target]["prompt_ms_median"])
            assert positive(summary["targets"][target]["beyond_prompt_ms_median"])  # the prefill is inside the TTFT
        keeper = summary["targets"]["slotkeeper"]
        assert "restore_ms" in keeper
        switches = sum(keeper["cache_states"].values())
        assert switches == config["sessions"] * config["rounds"]
        # Without idle saves every switch waits for the evicted state's save; with them, those that found it saved
        # while the slot idled do not (how many depends on the machine's speed, so only the range is checked).
        if scenario == "switch":
            assert keeper["switches_with_save"] == switches
        else:
            assert 0 <= keeper["switches_with_save"] <= switches
        for name in ("cram0_over_slotkeeper", "default_over_slotkeeper"):
            assert positive(summary["ratios"][name]["of_medians"])
            assert positive(summary["ratios"][name]["median_per_turn"])


def test_client(results: Path) -> None:
    data = load(results, "client")
    cpus = data["machine"]["cpus"]
    by_threads = data["summary"]["by_threads"]
    assert data["targets"] == ["direct", "slotkeeper", "slotkeeper aiohttp"]
    assert list(by_threads) == ([str(cpus), str(cpus - 1)] if cpus > 1 else ["1"])
    assert len(data["samples"]) == sum(3 * s["rounds"] for s in by_threads.values())
    for sample in data["samples"]:
        assert positive(sample["total_ms"]) and positive(sample["ttft_ms"]) and sample["chunks"] >= 1
    for summary in by_threads.values():
        assert summary["rounds"] == data["config"]["overhead_requests"] // 2
        # Both slotkeepers served their session hot, through their own client each.
        assert summary["cache_states"] == {"slotkeeper": ["hot"], "slotkeeper aiohttp": ["hot"]}
        for target in ("slotkeeper", "slotkeeper aiohttp"):
            added = summary["over_direct"][target]
            assert all(isinstance(added["added_ttft_ms"][q], float) for q in ("p50", "p99", "mean"))
            assert positive(added["chunks_per_s_ratio"])
        assert positive(summary["aiohttp_over_wire"]["chunks_per_s_ratio"])


def test_overhead(results: Path) -> None:
    data = load(results, "overhead")
    by_threads = data["summary"]["by_threads"]
    cpus = data["machine"]["cpus"]
    assert list(by_threads) == ([str(cpus), str(cpus - 1)] if cpus > 1 else ["1"])
    assert len(data["samples"]) == sum(2 * s["pairs"] for s in by_threads.values())
    for sample in data["samples"]:
        assert positive(sample["total_ms"]) and positive(sample["ttft_ms"])
        assert sample["chunks"] >= 1
    for summary in by_threads.values():
        assert summary["pairs"] == data["config"]["overhead_requests"] // 2
        for target in ("direct", "slotkeeper"):
            assert positive(summary["targets"][target]["total_ms"]["median"])
            assert positive(summary["targets"][target]["chunks_per_s"]["median"])
        for key in ("added_total_ms", "added_ttft_ms"):
            assert all(isinstance(summary[key][q], float) for q in ("p50", "p99", "mean"))
        assert positive(summary["chunks_per_s_ratio"]["median_per_pair"])
        assert summary["slotkeeper_cache_states"] == ["hot"]


def test_restart(results: Path) -> None:
    data = load(results, "restart")
    summary = data["summary"]
    assert len(data["samples"]) == 2 * data["config"]["sessions"]
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"])
    assert positive(summary["targets"]["slotkeeper restored"]["ttft_ms"]["median"])
    assert positive(summary["targets"]["llama-server cold"]["ttft_ms"]["median"])
    assert positive(summary["ratios"]["cold_over_restored"]["of_medians"])
    assert positive(summary["ratios"]["cold_over_restored"]["median_per_session"])


def test_system(results: Path) -> None:
    data = load(results, "system")
    config, summary = data["config"], data["summary"]
    assert data["targets"] == TARGETS
    n = config["system_conversations"]
    phases = [s["phase"] for s in data["samples"]]
    assert (phases.count("shared"), phases.count("between"), phases.count("prewarmed")) == (3 * n, 3 * n, 3)
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"]) and sample["total_ms"] >= sample["ttft_ms"]
        assert sample["prompt_n"] >= 1 and sample["cache_n"] >= 0
        if sample["phase"] != "between":
            assert sample["backend_prefilled"] >= sample["prompt_n"] and sample["backend_prompt_ms"] > 0
    first = summary["first_conversation"]
    # The first conversation ran in one pass, as everywhere; its idle slot was cut back to the system part after.
    assert first["targets"]["slotkeeper"]["backend_prefilled"] >= config["system_tokens"] * 0.8
    assert first["slotkeeper_cache"] == "cold" and first["cuts"] == 1
    assert first["cut_tokens"] >= config["system_tokens"] * 0.8
    assert first["system_snapshot_bytes"] > 0
    later = summary["later_conversations"]
    assert set(later["targets"]["slotkeeper"]["cache_states"]) <= {"restored", "prefix"}
    assert sum(later["targets"]["slotkeeper"]["cache_states"].values()) == n - 1
    assert later["targets"]["slotkeeper"]["cache_n_median"] >= first["cut_tokens"] - 16
    assert later["targets"]["llama-server cram0"]["prompt_n_median"] > later["targets"]["slotkeeper"]["prompt_n_median"]
    for target in TARGETS:
        assert positive(later["targets"][target]["ttft_ms"]["median"])
    for name in ("cram0_over_slotkeeper", "default_over_slotkeeper"):
        assert positive(later["ratios"][name]["of_medians"])
        assert positive(later["ratios"][name]["median_per_conversation"])
    assert summary["prewarm"]["first"]["status"] == "saved" and summary["prewarm"]["again"]["status"] == "exists"
    assert positive(summary["prewarm"]["first"]["wall_ms"])
    assert summary["after_prewarm"]["slotkeeper"]["cache"] == "restored"


def test_agent(results: Path) -> None:
    data = load(results, "agent")
    config = data["config"]
    tasks = 3 + (config["chat_turns"] - 1)  # title, tags and follow-ups after the first reply; follow-ups after others
    per_slots = 3 * (config["agent_turns"] + config["chat_turns"] + tasks)
    assert len(data["samples"]) == per_slots * len(config["agent_slots"])
    for sample in data["samples"]:
        assert positive(sample["total_ms"]) and sample["prompt_n"] >= 1
        assert sample["backend_prefilled"] >= 1 and sample["backend_prompt_ms"] >= 0
        if sample["kind"] in ("agent", "chat"):
            assert positive(sample["ttft_ms"])
            assert sample["position"] in ("first", "consecutive", "switched")
        if sample["target"] == "slotkeeper":
            assert sample["side"] is sample["kind"].startswith("task:")
    for slots in config["agent_slots"]:
        summary = data["summary"][str(slots)]
        targets = summary["targets"]
        assert list(targets) == TARGETS
        assert targets["slotkeeper"]["side_requests"] == tasks
        for target in TARGETS:
            assert positive(targets[target]["main_ttft_ms"]["median"])
            assert positive(targets[target]["switched_ttft_ms"]["median"])
            assert {"agent first", "agent switched", "chat first", "chat switched"} <= targets[target]["ttft_ms"].keys()
            assert targets[target]["backend"]["prefilled"] >= targets[target]["main_prompt_n"] > 0
        # The agent's and the chat's states survive each other and the side tasks: less is prefilled than cold.
        assert targets["slotkeeper"]["backend"]["prefilled"] < targets["llama-server cram0"]["backend"]["prefilled"]
        assert "restored" in targets["slotkeeper"]["cache_states"]["agent"]
        for name in ("cram0_over_slotkeeper", "default_over_slotkeeper"):
            for key in ("switched_ttft_of_medians", "switched_ttft_median_per_turn", "main_ttft_of_medians",
                        "prefilled", "prompt_seconds"):
                assert positive(summary["ratios"][name][key])


def test_scale(results: Path) -> None:
    data = load(results, "scale")
    summary = data["summary"]
    n = data["config"]["scale_snapshots"]
    assert summary["snapshots"] == n and summary["commit_ms"]["n"] == n
    assert summary["chain_links"] >= 10 * n
    assert summary["checked_snapshot_ms"]["n"] > 0 and positive(summary["checked_snapshot_ms"]["median"])
    found = {name: (t["found"], t["n"]) for name, t in summary["best_prefix_ms"].items()}
    for name, (hits, lookups) in found.items():
        expected = lookups if name.startswith(("next turn", "fork")) or name.endswith("(min_messages 1)") else 0
        assert hits == expected, name
    for key in ("open_ms", "reconcile_ms", "enforce_budget_1pct_ms"):
        assert positive(summary[key])
    assert 1 <= summary["enforce_budget_1pct_evicted"] <= n // 20
    assert summary["index_bytes"] > 0
    assert len(summary["startup_ms"]) == 3
    assert all(positive(t["median"]) for t in summary["startup_ms"].values())


def test_day(results: Path) -> None:
    data = load(results, "day")
    traffic, summary = data["traffic"], data["summary"]["targets"]
    required = ["llama-server cram0", "llama-server default", "llama-server small-ram", "slotkeeper"]
    assert data["targets"][:4] == required and set(data["targets"]) | set(data["skipped_targets"]) == {
        *required, "hearth-llm"}
    assert all(n > 0 for n in traffic["requests"].values())
    assert 0 < traffic["restart_after_step"] < traffic["steps"]
    assert data["state_probe"]["small_ram_mib"] >= 1 and positive(data["state_probe"]["bytes_per_token"])
    n = sum(traffic["requests"].values())
    assert len(data["samples"]) == n * len(data["targets"])
    openwebui_requests = [ask for step in openwebui_steps() for ask in step]
    assert {"owui-default-A", "owui-default-B"} <= set(traffic["conversations"])
    for target in data["targets"]:
        t = summary[target]
        assert t["requests"] == n and t["errors"] == 0
        assert t["prompt_tokens"] == traffic["prompt_tokens"] > t["shared_prefix_tokens"] > 0
        assert 0 < t["prefilled"] <= t["prompt_tokens"] * 2 and positive(t["wall_seconds"])
        assert t["prompt_check"]["mismatched"] == 0
        for kind, n_kind in traffic["requests"].items():
            assert t["ttft_ms"][kind]["n"] == n_kind and positive(t["ttft_ms"][kind]["p50"])
        # OpenWebUI under its default settings (bench/day_openwebui.py): the side tasks' time, the chats' TTFT and
        # the part's own reuse are reported.
        assert t["side_tasks"]["n"] == sum(traffic["requests"][kind] for kind in TASK_KINDS)
        assert positive(t["side_tasks"]["total_s"]) and positive(t["chat_ttft_ms"]["p50"])
        part = t["openwebui_default"]
        assert part["requests"] == len(openwebui_requests) and part["prompt_tokens"] > part["shared_prefix_tokens"] > 0
        assert part["side_tasks"]["n"] == sum(1 for a in openwebui_requests if a.kind in TASK_KINDS)
        assert positive(part["side_tasks"]["total_s"]) and positive(part["chat_ttft_ms"]["p50"])
        assert part["efficiency"] is not None
    # slotkeeper brings conversations back after the restart and past the small RAM cache: it prefills less than
    # llama-server without a cache.
    assert summary["slotkeeper"]["prefilled"] < summary["llama-server cram0"]["prefilled"]


def test_backends(results: Path) -> None:
    data = load(results, "backends")
    traffic, summary = data["traffic"], data["summary"]
    assert data["targets"] == ["slotkeeper, 1 backend", "slotkeeper, 3 backends",
                               "slotkeeper, 2 replicas over 3 backends", "round-robin, 3 llama-servers"]
    assert len(data["samples"]) == traffic["requests"] * 4
    for target in data["targets"]:
        t = summary[target]
        assert t["requests"] == traffic["requests"] and t["errors"] == 0
        assert positive(t["requests_per_second"]) and positive(t["ttft_ms"]["p50"])
        assert t["prompt_tokens"] == traffic["prompt_tokens"] > t["shared_prefix_tokens"] > 0
        assert len(t["prompt_tokens_per_backend"]) == t["backends"] and sum(t["prompt_tokens_per_backend"]) > 0
    # Several backends and two replicas over them reuse some of what is shared. How much, in this short run of nine
    # conversations of three or four turns on one slot per backend, is timing: which turns wait for a busy backend,
    # and how many first turns land while the replicas' snapshots are still being uploaded. On a 2-core machine three
    # backends prefilled 14,787 to 16,936 tokens here and round-robin 16,628 to 18,200 (round-robin ahead once), and
    # the replicas reused 46% to 70% of the shared prefix. The full run tells them apart (bench/results/backends.json:
    # 25,218 against 44,505 prefilled); the claims are asserted by counts in tests/integration/test_several_backends.py
    # (sessions stay on the backend that holds their state) and test_replicas.py (whichever replica they reach).
    for target in ("slotkeeper, 3 backends", "slotkeeper, 2 replicas over 3 backends"):
        assert summary[target]["reused"] > 0


def test_title(results: Path) -> None:
    data = load(results, "title")
    assert data["targets"] == ["slotkeeper", "slotkeeper hold 0", "llama-server cram0"]
    assert len(data["samples"]) == 2 * data["pairs"] * len(data["targets"])
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"]) and sample["total_ms"] >= sample["ttft_ms"]
        if sample["with_title"]:
            assert sample["title_status"] == 200 and positive(sample["title_ms"])
            # slotkeeper takes the title task for a side task (the shape OpenWebUI's has).
            assert sample["title_kind"] == ("side" if sample["target"].startswith("slotkeeper") else None)
    for name in data["targets"]:
        summary = data["summary"][name]
        assert summary["pairs"] == data["pairs"] and positive(summary["ratio_of_medians"])
    # Whether the title went first is timing, measured and reported, not asserted (tests/unit/test_pool.py checks
    # the order itself).
    assert all(0 <= data["summary"][name]["title_ran_first"] <= data["pairs"] for name in data["targets"])


def test_beyond(results: Path) -> None:
    data = load(results, "beyond")
    shape, summary = data["shape"], data["summary"]
    assert data["targets"] == ["llama-server small-ram", "llama-server default", "slotkeeper"]
    assert shape["small_ram_states"] < shape["conversations"] and shape["small_ram_mib"] >= 1
    assert positive(shape["state_probe"]["bytes_per_token"])
    assert len(data["samples"]) == len(data["targets"]) * shape["conversations"] * data["config"]["rounds"]
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"]) and sample["prompt_n"] >= 1 and sample["cache_n"] >= 0
    # Round-robin past a cache for fewer of them: every resumed turn of slotkeeper's restores its own history.
    states = summary["targets"]["slotkeeper"]["cache_states"]
    assert states == {"restored": shape["conversations"] * data["config"]["rounds"]}, states
    keeper = [s for s in data["samples"] if s["target"] == "slotkeeper"]
    assert all(s["cache_n"] >= shape["context_tokens"] // 2 for s in keeper), keeper
    for name in ("small_ram_over_slotkeeper", "default_over_slotkeeper"):
        assert positive(summary["ratios"][name]["of_medians"])


def test_first(results: Path) -> None:
    data = load(results, "first")
    assert data["targets"] == ["llama-server", "slotkeeper"]
    assert len(data["samples"]) == 2 * data["pairs"]
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"]) and sample["prompt_n"] >= 1
        # A new system prompt, in one pass on both: the template's first tokens at most are reused.
        assert sample["cache_n"] <= 32, sample
    assert len(data["cuts"]) == data["pairs"]  # each pair's new system part, cut once its turn idled
    ratio = data["summary"]["slotkeeper_over_llama_server"]
    assert positive(ratio["of_medians"]) and positive(ratio["median_per_pair"])


def test_decide(results: Path) -> None:
    """Hot turns are decided without a look-up; switches with one; a resumed conversation whose first message
    changed, with the request's tokens (decide_ms counts them)."""
    summary = load(results, "decide")["summary"]["slotkeeper"]
    assert summary["hot"]["n"] == summary["switch"]["n"] + summary["switch-tokens"]["n"] > 0
    assert summary["hot"]["decide_ms_p50"] is None  # no decision was needed
    for kind in ("switch", "switch-tokens"):
        assert positive(summary[kind]["decide_ms_p50"]) and summary[kind]["reused_p50"] > 0, summary[kind]
    # The first message changed at its end: the system part and that message's text are shared, not the rest.
    assert summary["switch-tokens"]["reused_p50"] > 0.4 * summary["switch-tokens"]["tokens_p50"]


@pytest.fixture(scope="module")
def blocks_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`--scenario blocks --small` (opt-in: `all` leaves it out), about a minute."""
    out = tmp_path_factory.mktemp("bench-blocks")
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "blocks", "--small", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def test_blocks(blocks_results: Path) -> None:
    """The block store against whole files: counts and byte ratios, not timings."""
    data = load(blocks_results, "blocks")
    shape, summary = data["shape"], data["summary"]
    assert shape["block_sizes"] == [64]
    modes = ["today", "blocks 64"]
    assert data["modes"] == modes
    assert "## blocks" in (blocks_results / "README.md").read_text()

    shared = summary["shared_prompt"]["modes"]
    assert list(shared) == modes
    today, blocks = shared["today"], shared["blocks 64"]
    assert today["stored_as"] == {"file": today["states"]} and blocks["stored_as"] == {"blocks": blocks["states"]}
    assert today["states"] >= shape["conversations"] and blocks["states"] >= shape["conversations"]
    assert today["disk"]["whole_files"] == today["disk"]["total"] > 0 and today["disk"]["blocks"] == 0
    assert blocks["disk"]["whole_files"] == 0 and blocks["disk"]["blocks"] > 0 and blocks["disk"]["tails"] > 0
    # The shared system prompt is stored once: less on disk than whole files, near the distinct tokens' KV.
    assert blocks["disk"]["total"] < today["disk"]["total"]
    assert today["kv_bytes_per_token"] == blocks["kv_bytes_per_token"] > 0
    for mode in shared.values():
        assert 0 < mode["distinct_tokens"] < mode["state_tokens"]
        assert positive(mode["disk_over_distinct_kv"])
    assert blocks["disk_over_distinct_kv"] < today["disk_over_distinct_kv"]

    long = summary["long_conversation"]
    assert long["turns"] == shape["long_turns"]
    per_mode = {mode: [s for s in data["samples"] if s["part"] == "long" and s["mode"] == mode] for mode in modes}
    for mode, rows in per_mode.items():
        assert [r["turn"] for r in rows] == list(range(1, shape["long_turns"] + 1))
        assert all(r["stored_as"] == ("file" if mode == "today" else "blocks") for r in rows)
        assert all(r["written"]["total"] > 0 and r["uploaded"]["bytes"] > 0 for r in rows), rows
        assert all(0 < r["new_tokens"] <= r["tokens"] for r in rows)
        entry = long["modes"][mode]
        assert len(entry["per_turn"]) == shape["long_turns"]
        for key in ("written_over_new_kv_plus_tail", "uploaded_over_new_kv_plus_tail", "written_over_today"):
            assert positive(entry[key])
    # Today every turn writes its whole state; blocks, what is new.
    assert long["modes"]["blocks 64"]["later_totals"]["written_bytes"] < long["modes"]["today"]["later_totals"][
        "written_bytes"]
    assert long["modes"]["today"]["later_totals"]["written_bytes"] >= long["modes"]["today"]["later_totals"][
        "state_bytes"]
    # Without a RAM dir the backend writes each save's whole file into the slot dir before it is cut: what is
    # written is that file and the same blocks and tail as with a RAM dir.
    attach = summary["long_conversation_no_ram_dir"]["modes"]["blocks 64"]
    attach_rows = [s for s in data["samples"] if s["part"] == "long, no RAM dir"]
    assert [r["turn"] for r in attach_rows] == list(range(1, shape["long_turns"] + 1))
    assert all(r["stored_as"] == "blocks" and r["written"]["backend_file"] == r["state_bytes"]
               and r["written"]["total"] == r["written"]["backend_file"] + r["written"]["blocks"]
               + r["written"]["tails"] for r in attach_rows), attach_rows
    assert attach["later_totals"]["written_bytes"] > long["modes"]["blocks 64"]["later_totals"]["written_bytes"] + \
        long["modes"]["blocks 64"]["later_totals"]["state_bytes"] // 2
    assert "blocks 64, no RAM dir" in (blocks_results / "README.md").read_text()

    for workload, n in (("switch", data["config"]["sessions"] * data["config"]["rounds"]),
                        ("restart", data["config"]["sessions"])):
        part = summary["ttft"][workload]
        assert len(part["targets"]) == 5
        for name, target in part["targets"].items():
            assert target["ttft_ms"]["n"] == n and positive(target["ttft_ms"]["median"])
            if name != "llama-server cram0":
                assert target["cache_states"] == {"restored": n}, (workload, name, target)
        for ratios in part["ratios"].values():
            assert positive(ratios["of_medians"])
    assert set(summary["by_block_tokens"]) == set(modes)


def test_swap(tmp_path: Path) -> None:
    """`--scenario swap` (opt-in, so run on its own): two models behind a router with --models-max 1, through
    slotkeeper and to the router alone. The counts are what the workload implies: the router alone prefills A's
    return turn whole, slotkeeper restores all but the new message."""
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "swap", "--small", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    data = load(tmp_path, "swap")
    summary = data["summary"]
    assert {s["target"] for s in data["samples"]} == {"router alone", "slotkeeper"}
    assert len(data["samples"]) == 2 * data["config"]["rounds"]
    alone, keeper = summary["targets"]["router alone"], summary["targets"]["slotkeeper"]
    assert alone["return_cache_n_median"] == 0 and alone["return_prompt_n_median"] > 500
    assert keeper["return_cache_n_median"] >= 500 and keeper["return_prompt_n_median"] < 100
    assert all(s["cache"] == "restored" for s in data["samples"] if s["target"] == "slotkeeper")
    assert positive(summary["router_load_ms"]) and positive(summary["slotkeeper_restore_ms"])
    assert all(positive(v) for v in summary["ratios"].values())


def test_domains(tmp_path: Path) -> None:
    """`--scenario domains` (opt-in, so run on its own): the same users' chats to llama-server alone, slotkeeper with
    one domain, one per user, and one per user with the shared prompt pre-warmed. The counts are what the workload
    implies: kept apart, the probe (a new user sending another's first request) is a cold prefill, where one domain
    restores it; pre-warming the shared prompt into each domain prefills less than keeping them apart without."""
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "domains", "--small", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    data = load(tmp_path, "domains")
    targets = data["summary"]["targets"]
    assert set(targets) == {"llama-server", "one domain", "per user", "per user, pre-warmed"}
    one, apart, warmed = targets["one domain"], targets["per user"], targets["per user, pre-warmed"]
    assert one["probe"]["cache_n"] > 500 and one["probe"]["prompt_n"] < 16
    assert apart["probe"]["cache_n"] == 0 and warmed["probe"]["cache_n"] == 0
    assert apart["prefilled_tokens"] > one["prefilled_tokens"] > 0
    assert warmed["prefilled_tokens"] < apart["prefilled_tokens"]
    assert apart["kept"]["domains"] == data["users"] + 1 and one["kept"]["domains"] == 1
    assert warmed["kept"]["system_states"] >= data["users"]
    assert "## domains: what keeping users apart costs" in (tmp_path / "README.md").read_text()


def test_turns(tmp_path: Path) -> None:
    """`--scenario turns` (opt-in, so run on its own): each kind of turn against llama-server alone. The counts are
    what each kind implies: a hot turn and a restored one prefill only the new message on slotkeeper, where
    llama-server alone prefills the whole conversation again after another took the slot; a restore's bytes and
    their read floor are measured; every part of slotkeeper's time is recorded."""
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "turns", "--small", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    kinds = load(tmp_path, "turns")["summary"]["kinds"]
    assert set(kinds) == {"cold", "hot", "restore", "switch", "side", "side-next", "new-system"}
    assert kinds["hot"]["slotkeeper_cache"] == ["hot"]
    for kind in ("restore", "switch"):
        k = kinds[kind]
        assert k["slotkeeper_cache"] == ["restored"]
        assert k["slotkeeper_prompt_n"] < 150 < k["llama_server_prompt_n"]
        assert k["restored_bytes"] > 0 and positive(k["read_floor_ms"]) and positive(k["restore_ms"])
        assert "added_over_hot_ms" in k and "added_over_own_hot_ms" in k and positive(k["restore_call_over_floor"])
    assert kinds["switch"]["save_ms"] > 0 and kinds["restore"]["save_ms"] == 0  # the pause let the idle save run
    assert kinds["cold"]["slotkeeper_prompt_n"] == kinds["cold"]["llama_server_prompt_n"]
    assert all(positive(k["lease_ms"]) or k["slotkeeper_cache"] == ["hot"] for k in kinds.values())
    assert "## turns: where each millisecond of a turn goes" in (tmp_path / "README.md").read_text()


def test_days(tmp_path: Path) -> None:
    """`--scenario days` (opt-in, so run on its own): both judged days, each target answering its own clients. The
    counts are what the days imply: no request fails, every target is sent the same number of requests, and
    slotkeeper prefills far less than llama-server alone on both, reusing most of what the prompts share."""
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "days", "--small", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    data = json.loads((tmp_path / "days.json").read_text())
    assert data["scenario"] == "days" and data["config"]["small"] is True
    assert data["targets"] == ["llama-server alone", "llama-server RAM cache", "slotkeeper"]
    assert "hearth-llm" in data["skipped_targets"]
    for day, kinds in (("ids", {"chat", "title", "tags", "follow_ups", "agent", "claude-code"}),
                       ("default", {"chat", "title", "tags", "follow_ups", "agent", "subagent"})):
        summary = data["days"][day]["summary"]
        assert len(data["days"][day]["rounds"]) == data["rounds"] == 2  # the CI size's rounds, each target in each
        assert {s["requests"] for s in summary.values()} == {summary["slotkeeper"]["requests"]}
        for name, s in summary.items():
            assert s["errors"] == 0, (day, name)
            assert set(s["by_kind"]) == kinds
            assert s["shared_prefix_tokens"] > 0 and positive(s["wall_s"]) and positive(s["side_tasks_s"])
        keeper, alone = summary["slotkeeper"], summary["llama-server alone"]
        assert keeper["prefilled"] < alone["prefilled"], day
        assert keeper["reuse"] >= 0.85 and keeper["reuse"] > alone["reuse"] + 0.3, (day, keeper, alone)
    assert "## days: the two judged days, replayed live" in (tmp_path / "README.md").read_text()
