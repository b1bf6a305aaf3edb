"""A PNG chart of the results (`<out>/results.png`): median TTFT per target for each switch context size, the
restart comparison, new chats on a shared system prompt, and the agent workload's main turns. Needs matplotlib (in
the `dev` extra); without it no chart is drawn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_chart(out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels: list[tuple[str, list[str], list[float]]] = []
    switch_path = out / "switch.json"
    if switch_path.exists():
        switch: dict[str, Any] = json.loads(switch_path.read_text())
        for tokens, summary in switch["summary"].items():
            targets = list(summary["targets"])
            panels.append((f"switch, {tokens}-token sessions", targets,
                           [summary["targets"][t]["ttft_ms"]["median"] for t in targets]))
    restart_path = out / "restart.json"
    if restart_path.exists():
        restart: dict[str, Any] = json.loads(restart_path.read_text())
        targets = list(restart["summary"]["targets"])
        panels.append((f"after restart, {restart['summary']['tokens']} tokens", targets,
                       [restart["summary"]["targets"][t]["ttft_ms"]["median"] for t in targets]))
    system_path = out / "system.json"
    if system_path.exists():
        system: dict[str, Any] = json.loads(system_path.read_text())
        later = system["summary"]["later_conversations"]["targets"]
        panels.append(("new chat on a shared system prompt", list(later),
                       [later[t]["ttft_ms"]["median"] for t in later]))
    agent_path = out / "agent.json"
    if agent_path.exists():
        agent: dict[str, Any] = json.loads(agent_path.read_text())
        for slots, summary in agent["summary"].items():
            targets = list(summary["targets"])
            panels.append((f"agent + chat, switched turns, {slots} slot(s)", targets,
                           [summary["targets"][t]["switched_ttft_ms"]["median"] for t in targets]))
    if not panels:
        return None
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, labels, values) in zip(axes.flat, panels, strict=False):
        colors = ["#4c78a8" if "slotkeeper" not in label else "#f58518" for label in labels]
        bars = ax.bar(range(len(labels)), values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(labels)), [label.replace(" ", "\n", 1) for label in labels], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("median time to first token, ms", fontsize=8)
    fig.tight_layout()
    path = out / "results.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
