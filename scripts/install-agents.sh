#!/usr/bin/env bash
# Installs the four coding agents that tests/integration/test_real_agents.py and `python -m bench --scenario agents`
# drive (Claude Code, Codex, OpenCode, Qwen Code) from the npm registry, at pinned versions, into a cache outside the
# checkout, and prints the bin directory that holds their commands. The cache is keyed by the pinned list, so changing
# a version installs afresh; a `.complete` marker says an install finished. Exit status 3 means the registry could not
# be reached (the tests skip on that, and only on that).
set -euo pipefail
PINNED=(
  "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION:-2.1.328}"
  "@openai/codex@${CODEX_VERSION:-0.169.0}"
  "opencode-ai@${OPENCODE_VERSION:-1.18.33}"
  "@qwen-code/qwen-code@${QWEN_CODE_VERSION:-0.24.4}"
)
CACHE_ROOT="${SLOTKEEPER_AGENTS_CACHE:-$HOME/.cache/slotkeeper-agents}"
key=$(printf '%s\n' "${PINNED[@]}" "node-$(node --version 2>/dev/null || echo none)" | sha256sum | cut -c1-12)
prefix="$CACHE_ROOT/$key"
marker="$prefix/.complete"
if [ ! -f "$marker" ]; then
  command -v npm >/dev/null 2>&1 || { echo "install-agents.sh: npm is missing (Node.js 20 or later)" >&2; exit 2; }
  registry="$(npm config get registry)"
  if ! npm view --silent --fetch-retries=0 --fetch-timeout=20000 "${PINNED[0]}" version >/dev/null 2>&1; then
    echo "install-agents.sh: the npm registry ($registry) is unreachable" >&2
    exit 3
  fi
  echo "installing ${PINNED[*]} into $prefix (about a minute; about 0.5 GB)" >&2
  rm -rf "$prefix"
  mkdir -p "$prefix"
  # --ignore-scripts is not used: Codex and OpenCode pick their platform binary in optional dependencies and
  # postinstall steps. No audit, no funding banner, no update notice: nothing but the packages is fetched.
  npm install --prefix "$prefix" --no-audit --no-fund --no-update-notifier --loglevel=error \
    --save-exact "${PINNED[@]}" >&2
  for cmd in claude codex opencode qwen; do
    [ -x "$prefix/node_modules/.bin/$cmd" ] || { echo "install-agents.sh: $cmd missing after install" >&2; exit 1; }
  done
  printf '%s\n' "${PINNED[@]}" >"$prefix/pinned.txt"
  touch "$marker"
fi
echo "$prefix/node_modules/.bin"
