"""Runs the shell commands of the operator docs against a real slotkeeper, in the order the pages give them.

Convention: every ```bash block runs (with `bash -euo pipefail`) unless its first line is
`# docs-test: skip (REASON)`. The address http://127.0.0.1:11434 is replaced by the test server's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import Stack
from tests.support import REPO

pytestmark = pytest.mark.backend

PAGES = ["quickstart.md", "http-api.md", "config.md", "troubleshooting.md", "clients.md"]
_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_SKIP = re.compile(r"^# docs-test: skip \((.+)\)$")
DOCUMENTED_URL = "http://127.0.0.1:11434"


def blocks(page: str) -> list[str]:
    return _BLOCK.findall((REPO / "docs" / page).read_text())


def runnable(page: str) -> list[str]:
    return [b for b in blocks(page) if not _SKIP.match(b.splitlines()[0])]


@pytest.fixture
def backend_kind() -> str:
    return "binary"


@pytest.mark.parametrize("page", PAGES)
def test_skipped_blocks_say_why(page: str) -> None:
    for block in blocks(page):
        first = block.splitlines()[0]
        if first.startswith("# docs-test"):
            assert _SKIP.match(first), f"{page}: write '# docs-test: skip (REASON)', not {first!r}"
    assert runnable(page), f"{page} has no command that runs"


@pytest.mark.parametrize("page", PAGES)
def test_commands_in_docs_run(page: str, stack: Stack, tmp_path) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), SLOTKEEPER_URL=keeper.url,
               HOME=str(tmp_path))
    for block in runnable(page):
        script = block.replace(DOCUMENTED_URL, keeper.url)
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=120, check=False)
        assert result.returncode == 0, f"{page}:\n{block}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
