"""Each setting's value turned into its type, from wherever it was given: a command-line value, a SLOTKEEPER_*
variable's string (a size such as 20G, a duration such as 7d, a command line split like a shell would, `[[backends]]`
as JSON) or a value of the TOML config file, whose type is checked first (`_FILE_TYPES`); and a value written back as
TOML. The settings are known here by name only: Settings itself, its defaults and its checks are config.py's.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BackendSpec:
    """One backend (a `[[backends]]` table of the config file): requests naming `name` go to this backend. Several
    tables of one name are one model on several backends: each session goes to one of them (placement.py).

    Exactly as the single-backend settings of the same names: `upstream` + `slot_dir` attach, `launch_command`
    launches, otherwise `model` (or the tiny test model) runs on the embedded server.
    """

    name: str
    upstream: str | None = None
    slot_dir: Path | None = None
    launch_command: tuple[str, ...] = ()
    model: Path | None = None
    ctx_size: int | None = None
    parallel: int | None = None
    cache_ram_mib: int | None = None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string


def _named_keys(value: Any) -> tuple[tuple[str, str], ...]:
    """API keys with a name each (the cache domain of the requests that present it): a TOML table `[api_keys]` of
    `name = "key"`, or `name=key,name=key` in the environment."""
    if isinstance(value, Mapping):
        pairs = [(str(name), str(key)) for name, key in value.items()]
    else:
        pairs = []
        for item in str(value).split(","):
            name, sep, key = item.strip().partition("=")
            if item.strip() and not sep:
                raise ValueError("expected name=key pairs separated by commas")
            if sep:
                pairs.append((name.strip(), key.strip()))
    return tuple(pairs)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1024**3, "gib": 1024**3, "t": 1024**4, "tb": 1024**4, "tib": 1024**4}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _with_unit(value: Any, units: Mapping[str, int], what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected {what}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(value))
        if match is None:
            raise ValueError(f"expected {what}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in units or number < 0:
        raise ValueError(f"expected {what}")
    return number * units[unit]


def parse_size(value: Any) -> int:
    """Bytes from 123, "500M", "20GiB" (K, M, G, T are powers of 1024)."""
    return int(_with_unit(value, _SIZE_UNITS, "a size such as 500M or 20G"))


def parse_duration(value: Any) -> float:
    """Seconds from 90, "45m", "12h", "7d", "2w"."""
    return _with_unit(value, _DURATION_UNITS, "a duration such as 90s, 12h or 7d")


def _keep_alive(value: Any) -> float:
    """Seconds from a duration ("5m", "1h", 300), or -1 for "never" (any negative value)."""
    text = str(value).strip()
    if text.startswith("-"):
        return -1.0
    return parse_duration(value)


def _command(value: Any) -> tuple[str, ...]:
    """A command line: a list of words (TOML, the CLI), or one string split like a shell would (the environment)."""
    if isinstance(value, str):
        return tuple(shlex.split(value))
    return tuple(str(word) for word in value)


_BACKEND_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "name": str,
    "upstream": lambda v: str(v).rstrip("/"),
    "slot_dir": lambda v: Path(v).expanduser(),
    "launch_command": lambda v: _command(v),
    "model": lambda v: Path(v).expanduser(),
    "ctx_size": int,
    "parallel": int,
    "cache_ram_mib": int,
}


def _backends(value: Any) -> tuple[BackendSpec, ...]:
    """`[[backends]]` tables (or, from the environment, the same as a JSON list of objects)."""
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, BackendSpec):
        return (value,)
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of backend tables")
    specs = []
    for i, table in enumerate(value):
        if isinstance(table, BackendSpec):
            specs.append(table)
            continue
        if not isinstance(table, Mapping):
            raise ValueError(f"backend {i + 1} is not a table")
        unknown = set(table) - set(_BACKEND_CONVERTERS)
        if unknown:
            raise ValueError(f"backend {i + 1}: unknown key(s) {', '.join(sorted(unknown))} (known: "
                             f"{', '.join(_BACKEND_CONVERTERS)})")
        if not str(table.get("name") or "").strip():
            raise ValueError(f"backend {i + 1} needs a name: the model name clients ask for")
        specs.append(BackendSpec(**{k: _BACKEND_CONVERTERS[k](v) for k, v in table.items()}))
    return tuple(specs)


def _headers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(h.strip() for h in value.split(",") if h.strip())
    return tuple(str(h) for h in value)


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "port": int,
    "ctx_size": int,
    "parallel": int,
    "min_restore_tokens": int,
    "block_tokens": int,
    "max_queue": int,
    "cache_ram_mib": int,
    "save_idle_seconds": float,
    "slot_op_timeout": float,
    "upstream_read_timeout": float,
    "backend_wait_seconds": float,
    "side_task_hold_seconds": float,
    "max_loaded": int,
    "keep_alive": lambda v: _keep_alive(v),
    "swap_wait_seconds": float,
    "load_factor": float,
    "shared_endpoint": lambda v: str(v).rstrip("/"),
    "replica_url": lambda v: str(v).rstrip("/"),
    "replicas": lambda v: tuple(r.strip().rstrip("/") for item in ([v] if isinstance(v, str) else v)
                                for r in str(item).split(",") if r.strip()),
    "start_timeout": float,
    "shutdown_timeout": float,
    "launch_command": _command,
    "slot_dir": lambda v: Path(v).expanduser(),
    "model": lambda v: Path(v).expanduser(),
    "cache_dir": lambda v: Path(v).expanduser(),
    "upstream": lambda v: str(v).rstrip("/"),
    "session_headers": _headers,
    "allowed_hosts": _headers,
    "api_keys": _named_keys,
    "max_body_bytes": int,
    "log_json": _bool,
    "backends": _backends,
    "system_snapshots": _bool,
    "keep_attribution_block": _bool,
    "disk_budget": parse_size,
    "ram_budget": parse_size,
    "shared_budget": parse_size,
    "ram_dir": lambda v: Path(v).expanduser(),
    "max_snapshot_age": parse_duration,
    "max_system_snapshots": int,
}
_SECRETS = frozenset({"api_key", "admin_key", "api_keys", "replica_secret"})
# What a TOML value may be, per setting (default: a string).
_FILE_TYPES: dict[str, tuple[type, ...]] = {
    **{name: (int,) for name in ("port", "ctx_size", "parallel", "min_restore_tokens", "block_tokens", "max_queue",
                                 "cache_ram_mib", "max_loaded",
                                 "max_body_bytes")},
    **{name: (int, float) for name in ("save_idle_seconds", "slot_op_timeout", "upstream_read_timeout",
                                       "backend_wait_seconds", "start_timeout", "shutdown_timeout",
                                       "side_task_hold_seconds", "swap_wait_seconds", "load_factor")},
    "launch_command": (list, str),
    "keep_alive": (int, float, str),
    "session_headers": (list, str),
    "allowed_hosts": (list, str),
    "api_keys": (dict,),
    "replicas": (list, str),
    "log_json": (bool,),
    "backends": (list,),
    "system_snapshots": (bool,),
    "keep_attribution_block": (bool,),
    "disk_budget": (int, str),
    "ram_budget": (int, str),
    "shared_budget": (int, str),
    "max_snapshot_age": (int, float, str),
    "max_system_snapshots": (int,),
}


def _convert(name: str, value: Any) -> Any:
    converter = _CONVERTERS.get(name, str)
    try:
        return converter(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"setting {name}: cannot use {value!r}: {exc}") from exc
