#!/usr/bin/env bash
# The run command: makes a venv on first use, installs slotkeeper with the embedded llama.cpp server, and runs
# `slotkeeper serve` on port 11434. With no arguments it serves a generated tiny test model; see `--help`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SLOTKEEPER_VENV:-.venv}"
if [ ! -x "$VENV/bin/slotkeeper" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[embedded]'
fi
exec "$VENV/bin/slotkeeper" serve "$@"
