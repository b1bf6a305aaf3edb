"""Bringing up the backend for each mode: attach (a URL someone else runs), launch (a llama-server command line) and
embedded (llama.cpp's server from the xllamacpp package). The last two share ServerProcess: a child on a loopback
port that dies with slotkeeper, must answer /health before we go on, and is stopped (TERM, then KILL) at exit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from slotkeeper.config import Settings
from slotkeeper.files import make_private_dir
from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from slotkeeper.upstream.launchargs import kv_arguments, plan_launch
from slotkeeper.upstream.process import ServerProcess, ServerStartError

log = logging.getLogger("slotkeeper.launcher")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class StartedBackend:
    """Where the backend answers, and the process behind it when slotkeeper started one (launch and embedded)."""

    url: str
    model_alias: str | None = None
    server: ServerProcess | None = None
    embedded: bool = False  # the server is xllamacpp's (its package version names its llama.cpp build)
    # The options of its command that change the KV bytes (launch mode: launchargs.kv_arguments), for the fingerprint.
    kv_settings: tuple[str, ...] = ()

    async def stop(self, timeout: float) -> None:
        if self.server is not None:
            await self.server.stop(timeout)


async def start_backend(settings: Settings, slot_dir: Path, ram_dir: Path | None = None) -> StartedBackend:
    """Start (or, in attach mode, just name) the backend, and wait until it answers /health. The server started
    saves into `ram_dir` when there is one (cache/ramdir.py), else into `slot_dir`.

    Runs on the event loop's thread on purpose: see ServerProcess.spawn.
    """
    if settings.mode == "attach":
        assert settings.upstream is not None
        return StartedBackend(settings.upstream)
    if settings.mode == "launch":
        plan = plan_launch(settings.launch_command, slot_dir, free_port, ram_dir)
        for warning in plan.warnings:
            log.warning("%s", warning)
        if plan.added:
            log.info("launch mode: added %s to the llama-server command", " ".join(plan.added))
        server = ServerProcess("llama-server", plan.argv, plan.url, settings.cache_dir / "llama-server.log")
        alias = plan.alias
        kv_settings = kv_arguments(plan.argv[1:])
    else:
        model = settings.model if settings.model is not None else await asyncio.to_thread(
            _tiny_model, settings.cache_dir
        )
        port = free_port()
        server = ServerProcess("the embedded server", embedded_argv(settings, model, port, ram_dir or slot_dir),
                               f"http://127.0.0.1:{port}", settings.cache_dir / "embedded-server.log")
        alias = None
        kv_settings = ()
        log.info("starting the embedded llama.cpp server (xllamacpp) for %s on %s", model, server.url)
    server.spawn()
    try:
        await server.wait_ready(settings.start_timeout)
    except BaseException as exc:
        if isinstance(exc, ServerStartError):
            log.error("%s", exc)
        await asyncio.shield(server.stop(2.0))
        raise
    return StartedBackend(server.url, alias, server, embedded=settings.mode == "embedded", kv_settings=kv_settings)


def embedded_argv(settings: Settings, model: Path, port: int, slot_dir: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "slotkeeper.upstream.embedded", "--model", str(model), "--port", str(port),
        "--slot-dir", str(slot_dir), "--ctx-size", str(settings.ctx_size), "--parallel", str(settings.parallel),
    ]
    if settings.cache_ram_mib is not None:
        argv += ["--cache-ram", str(settings.cache_ram_mib)]
    elif settings.domains:  # its own RAM cache would hand one cache domain's prompt to another
        argv += ["--cache-ram", "0"]
    if settings.model_alias:
        argv += ["--alias", settings.model_alias]
    return argv


def _tiny_model(cache_dir: Path) -> Path:
    spec = TinyModelSpec()
    path = cache_dir / "models" / f"{spec.name}-{spec.seed}.gguf"
    if not path.exists():
        make_private_dir(path.parent)
        write_tiny_model(path, spec)
    log.info("no model given: using the generated tiny random-weight test model %s (its output is gibberish; "
             "pass --model PATH.gguf for a real one)", path)
    return path
