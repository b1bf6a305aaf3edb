"""The one Settings object: built once from command-line values, then SLOTKEEPER_* environment variables, then defaults.

Every other module receives the Settings (or the few values it needs) instead of reading the environment itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slotkeeper"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 11434
    # Attach mode: a running llama-server and the directory it was given as --slot-save-path.
    upstream: str | None = None
    slot_dir: Path | None = None
    # Embedded mode: a GGUF served by llama.cpp's server from the xllamacpp package (tiny model when unset).
    model: Path | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    ctx_size: int = 8192
    parallel: int = 1
    cache_ram_mib: int | None = None
    model_alias: str | None = None
    # Extra header names that carry a session id (checked after the built-in ones).
    session_headers: tuple[str, ...] = ()
    # A changed slot is saved after this many idle seconds (and always before its slot is reused, and at shutdown).
    save_idle_seconds: float = 2.0
    # A restore that would reuse fewer tokens than this is skipped (a prefill that short is as cheap).
    min_restore_tokens: int = 128
    # Requests allowed to wait for a slot; one more is answered 503 in the client's dialect (0: unbounded).
    max_queue: int = 64
    # Seconds to wait for a save, restore or erase (the backend defers them while the slot is busy).
    slot_op_timeout: float = 120.0
    # Seconds of silence from the backend before a generation is given up.
    upstream_read_timeout: float = 600.0
    log_level: str = "info"

    @property
    def index_path(self) -> Path:
        return self.cache_dir / "index.sqlite3"

    @property
    def embedded(self) -> bool:
        return self.upstream is None

    def effective_slot_dir(self) -> Path:
        """The backend's --slot-save-path: given in attach mode, ours under the cache dir in embedded mode."""
        if self.slot_dir is not None:
            return self.slot_dir
        return self.cache_dir / "slots"

    def validate(self) -> None:
        if self.upstream is not None and self.slot_dir is None:
            raise ValueError(
                "--upstream needs --slot-dir: the directory the llama-server was started with as --slot-save-path"
            )
        if self.upstream is not None and self.model is not None:
            raise ValueError("give either --upstream (attach to a running server) or --model (embedded), not both")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.parallel < 1:
            raise ValueError("--parallel must be at least 1")

    @classmethod
    def build(cls, cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
        """CLI values (None = not given) win over SLOTKEEPER_<NAME> variables, which win over defaults."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            cli_value = cli.get(f.name)
            if cli_value is not None and cli_value != ():
                values[f.name] = _convert(f.name, cli_value)
                continue
            env_value = env.get("SLOTKEEPER_" + f.name.upper())
            if env_value is not None and env_value != "":
                values[f.name] = _convert(f.name, env_value)
        settings = cls(**values)
        settings.validate()
        return settings


def _headers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(h.strip() for h in value.split(",") if h.strip())
    return tuple(str(h) for h in value)


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "port": int,
    "ctx_size": int,
    "parallel": int,
    "min_restore_tokens": int,
    "max_queue": int,
    "cache_ram_mib": int,
    "save_idle_seconds": float,
    "slot_op_timeout": float,
    "upstream_read_timeout": float,
    "slot_dir": lambda v: Path(v).expanduser(),
    "model": lambda v: Path(v).expanduser(),
    "cache_dir": lambda v: Path(v).expanduser(),
    "upstream": lambda v: str(v).rstrip("/"),
    "session_headers": _headers,
}


def _convert(name: str, value: Any) -> Any:
    converter = _CONVERTERS.get(name, str)
    try:
        return converter(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"setting {name}: cannot use {value!r}: {exc}") from exc
