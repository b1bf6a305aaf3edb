"""The one Settings object: built once from command-line values, then SLOTKEEPER_* environment variables, then a
TOML file (`--config`), then defaults. Every other module receives the Settings instead of reading the environment.

settingvalues.py turns each value given into its setting's type, and writes it back as TOML.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from slotkeeper.domains import KEY_NAME
from slotkeeper.settingvalues import (
    _FILE_TYPES,
    _SECRETS,
    BackendSpec,
    _convert,
    _toml_value,
    parse_duration,
    parse_size,
)
from slotkeeper.upstream.launchargs import check_command, launch_slot_dir, parse_command
from slotkeeper.upstream.wire import Origin
from slotkeeper.urls import is_url_pattern

# What other modules import from here (parse_size, parse_duration and BackendSpec live in settingvalues.py).
__all__ = [
    "MIN_SECRET_CHARS",
    "BackendSpec",
    "Settings",
    "ShutdownBudget",
    "default_cache_dir",
    "load_config_file",
    "parse_duration",
    "parse_size",
    "settings_toml",
]

# Where a RAM dir goes by default: the memory file system every Linux has.
_SHM = Path("/dev/shm")
# The shortest replica secret accepted.
MIN_SECRET_CHARS = 16


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
    # Launch mode: a llama-server command line (program first) that slotkeeper starts, supervises and stops.
    launch_command: tuple[str, ...] = ()
    # Seconds a launched or embedded server may take to answer /health (loading a big model takes a while).
    start_timeout: float = 600.0
    # Seconds from SIGTERM (or Ctrl-C) to exit: a third for running responses to finish, half for saving the
    # changed slots, a sixth for stopping a launched or embedded server (SIGTERM, then SIGKILL).
    shutdown_timeout: float = 30.0
    # Extra header names that carry a session id (checked after the built-in ones).
    session_headers: tuple[str, ...] = ()
    # Keep Claude Code's attribution line (x-anthropic-billing-header) in the system prompt; it changes between
    # requests, so keeping it means no reuse at all (dialects/anthropic/claudecode.py).
    keep_attribution_block: bool = False
    # The longest a changed slot stays idle unsaved (a state that saves quickly is saved sooner: idlesaves.py);
    # it is always saved before its slot is reused, and at shutdown.
    save_idle_seconds: float = 2.0
    # A restore that would reuse fewer tokens than this is skipped. None: a restore is made when it costs less time
    # than prefilling what it gives, both measured on the backend as it runs (cache/costs.py).
    min_restore_tokens: int | None = None
    # A new conversation starts from its system prompt's snapshot; a new system prompt is warmed up and saved once.
    system_snapshots: bool = True
    # The disk budget (0: no limit): total bytes of snapshots, seconds since last use, system snapshots per model.
    # Least recently used go first; pinned snapshots and those of sessions in a slot are never evicted.
    disk_budget: int = 0
    max_snapshot_age: float = 0.0
    max_system_snapshots: int = 0
    # The RAM dir (cache/ramdir.py): the backend's --slot-save-path on tmpfs, holding copies of recent snapshots
    # within `ram_budget` bytes and symlinks to the others; snapshots are still kept in the slot dir. None: a
    # directory under /dev/shm when slotkeeper starts the backend, none in attach mode (there: the directory on tmpfs
    # the running llama-server was given as --slot-save-path, `slot_dir` then being where snapshots are kept).
    ram_dir: Path | None = None
    # None: a quarter of the machine's memory, at most 8 GiB (llama-server's own --cache-ram default); 0: no RAM dir.
    ram_budget: int | None = None
    # Tokens per KV block of the block store (cache/blockstore.py): each saved state is kept as blocks of this many
    # tokens' KV, each stored once however many states share it, plus a tail. 0: every state kept as one whole file.
    # 64: measured (docs/blocks.md), the smallest store; 128 and 256 keep a larger partial block in every tail.
    block_tokens: int = 64
    # Requests allowed to wait for a slot; one more is answered 503 in the client's dialect (0: unbounded).
    max_queue: int = 64
    # Seconds to wait for a save, restore or erase (the backend defers them while the slot is busy).
    slot_op_timeout: float = 120.0
    # Seconds of silence from the backend before a generation is given up.
    upstream_read_timeout: float = 600.0
    # Seconds a request that arrives while the backend is down (restarting, or not answering) waits for it to come
    # back before it fails in its client's dialect; 0 fails it at once.
    backend_wait_seconds: float = 30.0
    # Seconds a side task (a title or tags request of OpenWebUI) waits before it asks for a slot, and queued side
    # tasks go after requests of conversations: OpenWebUI sends a new chat's title task just before the chat's own
    # request, and the user's answer should not wait for the title. 0: side tasks queue like any request.
    side_task_hold_seconds: float = 0.25
    # Router mode (llama-server --models-dir or --models-preset): how many models are loaded at once (0: the router's
    # own --models-max), and how long a request for a model that is not loaded waits for the turns of the model that
    # makes room for it to end, before it fails in its client's dialect.
    max_loaded: int = 0
    swap_wait_seconds: float = 300.0
    # Router mode: seconds a model stays loaded after its last turn when the request named no keep_alive (Ollama's
    # OLLAMA_KEEP_ALIVE); negative: until another model needs its room. Its changed slots are saved before it goes.
    keep_alive: float = -1.0
    log_level: str = "info"
    # One JSON object per log line (the request line's fields as keys) instead of text.
    log_json: bool = False
    # Access: a key for the model routes, a separate one for /api/sessions and other admin routes (either may be
    # sent as "Authorization: Bearer KEY" or "x-api-key"), Host names accepted besides loopback ones, body cap.
    api_key: str | None = None
    admin_key: str | None = None
    # Cache domains (domains.py, docs/domains.md): API keys with a name each, every name a domain of its
    # own; and the header a trusted front end forwards its user in (OpenWebUI's X-OpenWebUI-User-Id), each user then
    # a domain below the key's. Only behind a key: anyone who reaches the port can set a header.
    api_keys: tuple[tuple[str, str], ...] = ()
    user_header: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 1024 * 1024
    # Several models: one backend each, chosen by the request's model name (config file `[[backends]]` tables).
    # Each gets its own index, logs and default slot dir under <cache_dir>/backends/<name>.
    backends: tuple[BackendSpec, ...] = ()
    # A model on several backends (several [[backends]] tables of one name): a new session goes to a backend that
    # owns at most this many times the mean of active sessions, and a session moves off a backend past it.
    load_factor: float = 1.25
    # The shared tier (fleet/shared.py): snapshots also kept in an S3-compatible object store, s3://BUCKET/PREFIX,
    # that every host's slotkeeper reads; `shared_endpoint` for a store other than AWS (MinIO, Ceph RGW, R2, ...).
    # Credentials come from the usual AWS_* variables or profiles.
    shared_store: str | None = None
    shared_endpoint: str | None = None
    # Bytes of snapshot files the shared store may hold (0: no limit); the least recently saved go first.
    shared_budget: int = 0
    # The session directory several slotkeeper replicas share (directory.py): redis://HOST:PORT/DB (Redis or
    # Valkey), and the URL the other replicas reach this one at (default: http://<host>:<port>, with this
    # machine's name for a wildcard host).
    directory: str | None = None
    replica_url: str | None = None
    # With a directory: the secret the replicas of the set share (a forwarded request is signed with it, peers.py),
    # and the allow-list of their base URLs (`*` matches within one), the only replicas requests are forwarded to.
    replica_secret: str | None = None
    replicas: tuple[str, ...] = ()

    @property
    def index_path(self) -> Path:
        return self.cache_dir / "index.sqlite3"

    @property
    def mode(self) -> str:
        """attach (--upstream), launch (a llama-server command) or embedded (xllamacpp, the default)."""
        if self.launch_command:
            return "launch"
        return "attach" if self.upstream is not None else "embedded"

    @property
    def embedded(self) -> bool:
        return self.mode == "embedded"

    @property
    def shutdown_budget(self) -> ShutdownBudget:
        return ShutdownBudget(self.shutdown_timeout / 3, self.shutdown_timeout / 2, self.shutdown_timeout / 6)

    def effective_slot_dir(self) -> Path:
        """The backend's --slot-save-path: given in attach mode; in launch mode the command's own, else --slot-dir,
        else ours under the cache dir; in embedded mode --slot-dir or ours under the cache dir."""
        if self.launch_command:
            return launch_slot_dir(self.launch_command, self.slot_dir or self.cache_dir / "slots" / "launch")
        if self.slot_dir is not None:
            return self.slot_dir
        return self.cache_dir / "slots"

    def effective_ram_dir(self) -> Path | None:
        """The RAM dir, or None: turned off (--ram-budget 0), attach mode without --ram-dir, or no /dev/shm."""
        if self.ram_budget == 0:
            return None
        if self.ram_dir is not None:
            return self.ram_dir
        if self.mode == "attach" or not os.access(_SHM, os.W_OK | os.X_OK):
            return None
        slot_dir = str(self.effective_slot_dir().expanduser().resolve())
        return _SHM / f"slotkeeper-{os.getuid()}" / hashlib.sha256(slot_dir.encode()).hexdigest()[:16]

    @property
    def effective_ram_budget(self) -> int:
        if self.ram_budget is not None:
            return self.ram_budget
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            memory = 0
        return min(8 * 1024**3, memory // 4)

    def backend_settings(self) -> list[Settings]:
        """The settings of each backend: this object itself, or one per `[[backends]]` table (the shared settings
        plus the table's own, the table's name as the model name, and a cache dir of its own)."""
        if not self.backends:
            return [self]
        units = []
        seen: dict[str, int] = {}
        for spec in self.backends:
            seen[spec.name] = seen.get(spec.name, 0) + 1
            units.append(replace(
                self, backends=(), upstream=spec.upstream, slot_dir=spec.slot_dir, launch_command=spec.launch_command,
                model=spec.model, ctx_size=spec.ctx_size or self.ctx_size, parallel=spec.parallel or self.parallel,
                cache_ram_mib=spec.cache_ram_mib if spec.cache_ram_mib is not None else self.cache_ram_mib,
                model_alias=spec.name, cache_dir=self.cache_dir / "backends" / _dir_name(spec.name, seen[spec.name]),
                ram_dir=None,  # each backend gets its own, next to its slot dir's name
            ))
        return units

    @property
    def domains(self) -> bool:
        """Whether requests are kept apart by who sends them (named keys, a forwarded user): then the session API
        is scoped to the caller's domain, and the operator's views are the admin key's."""
        return bool(self.api_keys) or self.user_header is not None

    def effective_replica_url(self) -> str:
        if self.replica_url is not None:
            return self.replica_url
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def validate(self) -> None:
        if self.block_tokens != 0 and not 16 <= self.block_tokens <= 4096:
            raise ValueError(f"--block-tokens must be 0 (off) or 16-4096 tokens, not {self.block_tokens}")
        if self.directory is not None and not re.fullmatch(r"(redis|rediss|unix)://.+", self.directory):
            raise ValueError(f"the directory must look like redis://HOST:PORT/DB, not {self.directory!r}")
        if self.replica_url is not None and not re.fullmatch(r"https?://[^/]+", self.replica_url):
            raise ValueError(f"the replica URL must look like http://HOST:PORT, not {self.replica_url!r}")
        if self.directory is not None and (self.replica_secret is None
                                           or len(self.replica_secret) < MIN_SECRET_CHARS):
            raise ValueError(f"--directory needs --replica-secret (or SLOTKEEPER_REPLICA_SECRET): a secret of at least "
                             f"{MIN_SECRET_CHARS} characters that every replica of the set is given, e.g. from "
                             "`openssl rand -hex 32`; only requests signed with it count as forwarded")
        bad = [r for r in self.replicas if not is_url_pattern(r)]
        if bad:
            raise ValueError(f"--replica takes a replica's base URL such as http://gpu-2:11434 (`*` may match within "
                             f"it), not {bad[0]!r}")
        if self.shared_store is not None and not re.fullmatch(r"s3://[^/]+(/.*)?", self.shared_store):
            raise ValueError(f"the shared store must look like s3://BUCKET/PREFIX, not {self.shared_store!r}")
        self._validate_domains()
        if self.load_factor < 1:
            raise ValueError("load_factor must be 1 or more (1.25: no backend of a model owns more than 1.25 times "
                             "the mean of its active sessions)")
        if self.backends:
            self._validate_backends()
        if self.launch_command:
            if self.upstream is not None:
                raise ValueError("give either a llama-server command after -- (launch mode) or --upstream (attach "
                                 "to a running server), not both")
            if self.model is not None:
                raise ValueError("give either a llama-server command after -- (launch mode) or --model (embedded "
                                 "mode), not both; put the model in the command as -m PATH.gguf")
            check_command(self.launch_command, self.slot_dir)
        if self.upstream is not None and self.slot_dir is None:
            raise ValueError(
                "--upstream needs --slot-dir: the directory the llama-server was started with as --slot-save-path"
            )
        if self.ram_dir is not None and self.ram_dir.expanduser().resolve() == (
                self.effective_slot_dir().expanduser().resolve()):
            raise ValueError(f"--ram-dir and the slot dir are both {self.ram_dir}: the RAM dir (on tmpfs) holds "
                             "copies, the slot dir (on disk) the snapshots; give them different directories")
        if self.upstream is not None and self.model is not None:
            raise ValueError("give either --upstream (attach to a running server) or --model (embedded), not both")
        if self.upstream is not None:
            Origin.parse(self.upstream)  # a ValueError that names the URL
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.parallel < 1:
            raise ValueError("--parallel must be at least 1")
        if self.max_system_snapshots < 0:
            raise ValueError("--max-system-snapshots must be 0 (no limit) or more")
        if self.shutdown_timeout <= 0 or self.start_timeout <= 0:
            raise ValueError("--shutdown-timeout and --start-timeout must be more than 0 seconds")
        if self.backend_wait_seconds < 0:
            raise ValueError("--backend-wait-seconds must be 0 (fail at once) or more")
        if self.max_loaded < 0:
            raise ValueError("--max-loaded must be 0 (the router's own --models-max) or more")
        if self.swap_wait_seconds < 0:
            raise ValueError("--swap-wait-seconds must be 0 or more")
        if self.side_task_hold_seconds < 0:
            raise ValueError("--side-task-hold-seconds must be 0 (no hold) or more")

    def _validate_domains(self) -> None:
        names = [name for name, _ in self.api_keys]
        bad = next((n for n in names if not KEY_NAME.fullmatch(n)), None)
        if bad is not None:
            raise ValueError(f"api_keys: the name {bad!r} cannot name a cache domain: use 1-64 letters, digits, '.', "
                             "'_' or '-', starting with a letter or digit")
        keys = [key for _, key in self.api_keys]
        if len(set(names)) < len(names) or len(set(keys)) < len(keys):
            raise ValueError("api_keys: each name and each key must be given once")
        if any(not key for key in keys) or any(key in (self.api_key, self.admin_key) for key in keys):
            raise ValueError("api_keys: a named key must not be empty, nor be the api_key or the admin_key")
        if self.user_header is not None:
            if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", self.user_header):
                raise ValueError(f"--user-header must be a header name such as X-OpenWebUI-User-Id, not "
                                 f"{self.user_header!r}")
            if not self.api_keys and self.api_key is None:
                raise ValueError("--user-header needs an API key (--api-key or api_keys): anyone who can reach "
                                 "the port can set a header, so a forwarded user is trusted only behind a key")
        if self.domains and self.cache_ram_mib not in (None, 0):
            raise ValueError("with cache domains kept apart, llama-server's own prompt cache in RAM would hand one "
                             "domain's prompt to another: leave --cache-ram out (slotkeeper then starts the server "
                             "with 0) or give 0")
        if self.domains and self.launch_command and parse_command(self.launch_command).cache_ram != 0:
            raise ValueError("with cache domains kept apart, llama-server's own prompt cache in RAM (--cache-ram, "
                             "on by default) would hand one domain's prompt to another: add --cache-ram 0 to the "
                             "llama-server command")
        if self.domains and (self.shared_store is not None or self.directory is not None or self.replicas):
            raise ValueError("cache domains (api_keys, --user-header) are not carried to the shared store or a "
                             "directory of replicas yet: run them on one host without --shared-store, "
                             "--directory and --replica")

    def _validate_backends(self) -> None:
        if self.upstream is not None or self.launch_command or self.model is not None:
            raise ValueError("with [[backends]], give each backend's upstream, launch_command or model in its own "
                             "table, not at the top level")
        for spec in self.backends:
            embedded = spec.upstream is None and not spec.launch_command
            if embedded and sum(1 for b in self.backends if b.name == spec.name) > 1:
                raise ValueError(f"model {spec.name!r}: a model on several backends needs each to be attached "
                                 "(upstream) or launched (launch_command); the embedded server runs one per process")
        slot_dirs: dict[Path, str] = {}
        for unit in self.backend_settings():
            try:
                unit.validate()
            except ValueError as exc:
                raise ValueError(f"backend {unit.model_alias!r}: {exc}") from None
            slot_dir = unit.effective_slot_dir().expanduser().resolve()
            if slot_dir in slot_dirs:
                raise ValueError(f"backends {slot_dirs[slot_dir]!r} and {unit.model_alias!r} share the slot dir "
                                 f"{slot_dir}: each needs its own (its index would take the other's files for "
                                 "leftovers)")
            slot_dirs[slot_dir] = str(unit.model_alias)

    @classmethod
    def build(cls, cli: Mapping[str, Any], env: Mapping[str, str] | None = None,
              file: Mapping[str, Any] | None = None) -> Settings:
        """CLI values (None = not given) win over SLOTKEEPER_<NAME> variables, which win over the TOML file's keys
        (read from cli["config"] or SLOTKEEPER_CONFIG unless `file` is given), which win over defaults."""
        env = os.environ if env is None else env
        if file is None:
            path = cli.get("config") or env.get("SLOTKEEPER_CONFIG")
            file = load_config_file(Path(path).expanduser()) if path else {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            cli_value = cli.get(f.name)
            if cli_value is not None and cli_value != ():
                values[f.name] = _convert(f.name, cli_value)
                continue
            env_value = env.get("SLOTKEEPER_" + f.name.upper())
            if env_value is not None and env_value != "":
                values[f.name] = _convert(f.name, env_value)
                continue
            if f.name in file:
                values[f.name] = _convert(f.name, file[f.name])
        settings = cls(**values)
        settings.validate()
        return settings


@dataclass(frozen=True, slots=True)
class ShutdownBudget:
    """How shutdown_timeout is shared out, in seconds: running responses may finish (then they are cut, and what
    their slots hold is still saved), changed slots are saved, then a server slotkeeper started is stopped."""

    responses: float
    saving: float
    stopping: float


def load_config_file(path: Path) -> dict[str, Any]:
    """A TOML file whose top-level keys are Settings field names (`slot_dir` or `slot-dir`); unknown keys are errors."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"config file {path} cannot be read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from exc
    known = {f.name: f for f in fields(Settings)}
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key not in known:
            raise ValueError(f"config file {path}: unknown setting {raw_key!r} (known: {', '.join(sorted(known))})")
        expected = _FILE_TYPES.get(key, (str,))
        if (isinstance(value, bool) and bool not in expected) or not isinstance(value, expected):
            kinds = " or ".join(t.__name__ for t in expected)
            raise ValueError(f"config file {path}: {raw_key} must be {kinds}, not {type(value).__name__} {value!r}")
        values[key] = value
    return values


def settings_toml(settings: Settings) -> str:
    """The settings as a TOML file that `--config` reads back; keys are never printed, only whether they are set."""
    lines = []
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.name == "backends":
            continue  # tables come after every top-level key
        if f.name in _SECRETS:
            lines.append(f"# {f.name} is {'set (not shown)' if value else 'not set'}")
        elif value is None:
            lines.append(f"# {f.name} is not set")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for spec in settings.backends:
        lines += ["", "[[backends]]"]
        lines += [f"{f.name} = {_toml_value(getattr(spec, f.name))}" for f in fields(spec)
                  if getattr(spec, f.name) not in (None, ())]
    return "\n".join(lines) + "\n"


def _dir_name(name: str, nth: int = 1) -> str:
    """A directory name for a backend's own cache: readable, and distinct for names that differ (the second and
    later backends of one model get .2, .3...)."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
    suffix = "" if nth == 1 else f".{nth}"
    return f"{readable[:48]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}{suffix}"
