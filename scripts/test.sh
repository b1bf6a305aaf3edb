#!/usr/bin/env bash
# The test command: on a fresh machine it builds llama-server once (cached outside the checkout), makes a venv,
# installs slotkeeper with its test extras, checks lint and types, and runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
SLOTKEEPER_LLAMA_SERVER="$(bash .ci/build-llama-server.sh)"
# The coding agents tests/integration/test_real_agents.py drives, from the npm registry at pinned versions (cached
# outside the checkout); status 3 means the registry is unreachable, and those tests then skip.
bash scripts/install-agents.sh >/dev/null || [ $? -eq 3 ]
# The dashboard test drives Debian's chromium; install it once when we may (root) and it is missing.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2
    # Read whole before matching: with pipefail, `grep -q` closing the pipe early fails apt-cache with SIGPIPE.
    policy="$(apt-cache policy chromium)"
    if grep -q 'Candidate: [0-9]' <<<"$policy"; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
    else
      echo "scripts/test.sh: no chromium package available; the dashboard test will fail in CI" >&2
    fi
  else
    echo "scripts/test.sh: chromium is missing (apt-get install chromium); the dashboard test is skipped" >&2
  fi
fi
# The session-directory tests start Debian's redis-server on loopback (tests/support.RedisServer).
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
  else
    echo "scripts/test.sh: redis-server is missing (apt-get install redis-server); the directory tests will fail" >&2
  fi
fi
export SLOTKEEPER_LLAMA_SERVER
VENV="${SLOTKEEPER_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'
"$VENV/bin/ruff" check src tests bench
"$VENV/bin/mypy" src
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=40 "$@"
