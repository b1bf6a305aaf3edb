#!/usr/bin/env bash
# The test command: on a fresh machine it builds llama-server once (cached outside the checkout), makes a venv,
# installs slotkeeper with its test extras, checks lint and types, and runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
SLOTKEEPER_LLAMA_SERVER="$(bash .ci/build-llama-server.sh)"
export SLOTKEEPER_LLAMA_SERVER
VENV="${SLOTKEEPER_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'
"$VENV/bin/ruff" check src tests bench
"$VENV/bin/mypy" src
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
