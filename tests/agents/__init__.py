"""A harness that drives real coding agents (Claude Code, Codex, OpenCode, Qwen Code, installed from npm by
scripts/install-agents.sh) non-interactively through a recording proxy, in front of slotkeeper or llama-server alone,
and measures how much of their prompts the backend had to prefill.

- proxy.py: the recording proxy (caps the output tokens, records every request and what its response reported) and
  a refusing forward proxy the agents' outbound traffic is pointed at.
- drivers.py: one driver per agent (its own config in a temporary HOME, one non-interactive turn per call).
- runner.py: `run_sequence` (turns A1 B1 A2 B2 A3) and the metrics (llama-server's prefill counter, reuse
  efficiency computed with the backend's own template and tokenizer, error responses).
"""
