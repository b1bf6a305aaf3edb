"""`python -m bench --scenario all --small` end to end against real llama-server processes: the result files are
written and well-formed. No timing is asserted (the numbers depend on the machine); only that they exist, are
positive and that the ratios were computed."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO

pytestmark = pytest.mark.backend


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0 and math.isfinite(value)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run([sys.executable, "-m", "bench", "--scenario", "all", "--small", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=280)
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
    for name in ("switch", "overhead", "restart"):
        assert (results / f"{name}.json").is_file()
    report = (results / "README.md").read_text()
    for heading in ("## switch", "## overhead", "## restart"):
        assert heading in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (results / "results.png").read_bytes().startswith(b"\x89PNG")


def test_switch(results: Path) -> None:
    data = load(results, "switch")
    config = data["config"]
    targets = data["targets"]
    assert targets == ["llama-server cram0", "llama-server default", "slotkeeper"]
    assert len(data["samples"]) == len(targets) * config["sessions"] * config["rounds"] * len(config["tokens"])
    for sample in data["samples"]:
        assert positive(sample["ttft_ms"]) and sample["total_ms"] >= sample["ttft_ms"]
        assert sample["prompt_n"] >= 1 and sample["cache_n"] >= 0
        if sample["target"] == "slotkeeper":
            assert sample["cache"] in {"hot", "restored", "prefix", "cold"}
            assert sample["restore_ms"] >= 0 and sample["save_ms"] >= 0
    for tokens in config["tokens"]:
        summary = data["summary"][str(tokens)]
        for target in targets:
            assert positive(summary["targets"][target]["ttft_ms"]["median"])
            assert positive(summary["targets"][target]["prompt_n_median"])
        assert "restore_ms" in summary["targets"]["slotkeeper"]
        for name in ("cram0_over_slotkeeper", "default_over_slotkeeper"):
            assert positive(summary["ratios"][name]["of_medians"])
            assert positive(summary["ratios"][name]["median_per_turn"])


def test_overhead(results: Path) -> None:
    data = load(results, "overhead")
    summary = data["summary"]
    assert summary["pairs"] == data["config"]["overhead_requests"] // 2
    assert len(data["samples"]) == 2 * summary["pairs"]
    for sample in data["samples"]:
        assert positive(sample["total_ms"]) and positive(sample["ttft_ms"])
        assert sample["chunks"] >= 1
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
