"""Reading a llama-server command line for launch mode: the options slotkeeper depends on, what it must add, and the
settings that work against it. Pure functions: no I/O, no logging; the caller logs the warnings.

llama-server has no positional arguments, so every word is an option or an option's value. Options slotkeeper does
not know are kept as they are; a word after one of them that is not itself an option is taken as its value. The
options slotkeeper reads are accepted as `--option value` and `--option=value`; llama-server itself takes only the
first form, so the second is passed on split in two.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slotkeeper.loopback import is_loopback

# Options whose value slotkeeper reads, by every spelling llama-server accepts, mapped to one name.
VALUE_OPTIONS: dict[str, str] = {
    "--port": "port",
    "--host": "host",
    "-a": "alias",
    "--alias": "alias",
    "--slot-save-path": "slot_save_path",
    "-np": "parallel",
    "--parallel": "parallel",
    "-c": "ctx_size",
    "--ctx-size": "ctx_size",
    "-m": "model",
    "--model": "model",
    "-sps": "slot_prompt_similarity",
    "--slot-prompt-similarity": "slot_prompt_similarity",
    "-cram": "cache_ram",
    "--cache-ram": "cache_ram",
    "--api-key": "api_key",
    "--api-key-file": "api_key",
}
# Options without a value that slotkeeper looks at.
FLAG_OPTIONS: dict[str, str] = {
    "-kvu": "kv_unified",
    "--kv-unified": "kv_unified",
    "-no-kvu": "no_kv_unified",
    "--no-kv-unified": "no_kv_unified",
    "--cache-idle-slots": "cache_idle_slots",
    "--no-cache-idle-slots": "no_cache_idle_slots",
    "--swa-full": "swa_full",
    "--slots": "slots",
    "--no-slots": "no_slots",
}
# Options whose values change the KV bytes a server writes for the same tokens (the long spelling each short one is
# read as): part of the backend's fingerprint in launch mode (cache/fingerprint.py). Files among their values are
# named with their size and modification time, so an adapter replaced in place is another setting.
KV_OPTIONS: dict[str, str] = {
    "-ctk": "--cache-type-k", "--cache-type-k": "--cache-type-k",
    "-ctv": "--cache-type-v", "--cache-type-v": "--cache-type-v",
    "-fa": "--flash-attn", "--flash-attn": "--flash-attn",
    "--rope-scaling": "--rope-scaling", "--rope-scale": "--rope-scale", "--rope-freq-base": "--rope-freq-base",
    "--rope-freq-scale": "--rope-freq-scale", "--yarn-orig-ctx": "--yarn-orig-ctx",
    "--yarn-ext-factor": "--yarn-ext-factor", "--yarn-attn-factor": "--yarn-attn-factor",
    "--yarn-beta-slow": "--yarn-beta-slow", "--yarn-beta-fast": "--yarn-beta-fast",
    "--lora": "--lora", "--lora-scaled": "--lora-scaled", "--lora-init-without-apply": "--lora-init-without-apply",
    "--control-vector": "--control-vector", "--control-vector-scaled": "--control-vector-scaled",
    "--control-vector-layer-range": "--control-vector-layer-range", "--override-kv": "--override-kv",
    "--swa-full": "--swa-full", "-kvu": "--kv-unified", "--kv-unified": "--kv-unified",
    "-no-kvu": "--no-kv-unified", "--no-kv-unified": "--no-kv-unified",
}
# What llama-server does when the option is missing (documented defaults of the pinned build).
AUTO_SLOTS = 4
DEFAULT_CACHE_RAM_MIB = 8192
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


@dataclass(frozen=True, slots=True)
class LlamaServerArgs:
    """The parts of a llama-server command line slotkeeper depends on; None means "not given" (a later option of
    the same name wins, as in llama-server)."""

    program: str
    # The options as llama-server will get them (a known `--option=value` split into two words).
    args: tuple[str, ...]
    port: int | None = None
    host: str | None = None
    alias: str | None = None
    slot_save_path: str | None = None
    parallel: int | None = None
    ctx_size: int | None = None
    model: str | None = None
    slot_prompt_similarity: float | None = None
    cache_ram: int | None = None
    api_key: bool = False
    flags: frozenset[str] = frozenset()

    @property
    def auto_slots(self) -> bool:
        """-np missing or -1: llama-server picks 4 slots and turns unified KV on."""
        return self.parallel is None or self.parallel < 0

    @property
    def n_slots(self) -> int:
        return AUTO_SLOTS if self.auto_slots else max(self.parallel or 1, 1)

    @property
    def kv_unified(self) -> bool:
        if "no_kv_unified" in self.flags:
            return False
        return "kv_unified" in self.flags or self.auto_slots

    @property
    def clears_idle_slots(self) -> bool:
        """--cache-idle-slots (on by default) needs the RAM cache; with unified KV it empties idle slots."""
        return "no_cache_idle_slots" not in self.flags and self.cache_ram != 0

    @property
    def first_alias(self) -> str | None:
        """The first of the comma-separated aliases: the name the user wrote first."""
        if self.alias is None:
            return None
        names = [name.strip() for name in self.alias.split(",") if name.strip()]
        return names[0] if names else None


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How slotkeeper starts a llama-server command: the full argv (the user's words first, slotkeeper's additions
    after them), where it will answer, the slot dir, the model name clients see, and warnings to log."""

    argv: tuple[str, ...]
    url: str
    port: int
    slot_dir: Path
    alias: str | None
    model: str | None
    added: tuple[str, ...]
    warnings: tuple[str, ...]


def parse_command(command: Sequence[str]) -> LlamaServerArgs:
    """Read a llama-server command line; raises ValueError with a message that names the offending word."""
    if not command:
        raise ValueError("the launch command is empty: give the llama-server program and its options after --")
    program, *rest = command
    if program.startswith("-"):
        raise ValueError(f"the launch command must start with the llama-server program, not the option {program!r}")
    values: dict[str, str] = {}
    spelled: dict[str, str] = {}
    flags: set[str] = set()
    words: list[str] = []  # the command's words, with `--option=value` of a known option as two words
    i = 0
    while i < len(rest):
        word = rest[i]
        i += 1
        option, inline = word, None
        if word.startswith("--") and "=" in word:
            option, _, inline = word.partition("=")
        if option in VALUE_OPTIONS:
            name = VALUE_OPTIONS[option]
            if inline is not None:
                # llama-server (build 11434) refuses `--option=value`: it reads only `--option value`.
                words += [option, inline]
            else:
                if i >= len(rest):
                    raise ValueError(f"llama-server option {option} needs a value")
                inline = rest[i]
                i += 1
                if inline.startswith("-") and not _NUMBER.match(inline):
                    raise ValueError(f"llama-server option {option} needs a value, not the option {inline!r}")
                words += [word, inline]
            values[name], spelled[name] = inline, option
            continue
        words.append(word)
        if option in FLAG_OPTIONS:
            name = FLAG_OPTIONS[option]
            flags.add(name)
            flags.discard(_OPPOSITES.get(name, ""))
        elif inline is None and word.startswith("-") and i < len(rest) and _is_value(rest[i]):
            words.append(rest[i])  # an option slotkeeper does not read, and its value
            i += 1
    return LlamaServerArgs(
        program=program,
        args=tuple(words),
        port=_int(values, spelled, "port"),
        host=values.get("host"),
        alias=values.get("alias"),
        slot_save_path=values.get("slot_save_path"),
        parallel=_int(values, spelled, "parallel"),
        ctx_size=_int(values, spelled, "ctx_size"),
        model=values.get("model"),
        slot_prompt_similarity=_float(values, spelled, "slot_prompt_similarity"),
        cache_ram=_int(values, spelled, "cache_ram"),
        api_key="api_key" in values,
        flags=frozenset(flags),
    )


def kv_arguments(args: Sequence[str]) -> tuple[str, ...]:
    """The options among a llama-server command's words (without the program) that change the KV bytes, each as
    `--option value...` in the order given (a later one of the same name wins in llama-server, and the order of
    adapters matters); a value naming a readable file gets `@size:mtime`."""
    found: list[str] = []
    i = 0
    while i < len(args):
        option, _, inline = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        i += 1
        if option not in KV_OPTIONS:
            continue
        values = [inline] if inline else []
        while not inline and i < len(args) and _is_value(args[i]):
            values.append(args[i])
            i += 1
        found.append(" ".join([KV_OPTIONS[option], *map(_named_file, values)]))
    return tuple(found)


def _named_file(value: str) -> str:
    path = Path(value).expanduser()
    try:
        st = path.stat() if path.is_file() else None
    except OSError:
        st = None
    return value if st is None else f"{value}@{st.st_size}:{st.st_mtime_ns}"


def check_command(command: Sequence[str], slot_dir: Path | None = None) -> LlamaServerArgs:
    """Parse and refuse what cannot work behind slotkeeper; `slot_dir` is slotkeeper's --slot-dir, if given."""
    args = parse_command(command)
    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError(f"llama-server option --port {args.port} is out of range; give a fixed port or leave it out "
                         "and slotkeeper picks a free one")
    if args.host is not None and _first_host(args.host).endswith(".sock"):
        raise ValueError(f"the llama-server command listens on the UNIX socket {args.host}, but slotkeeper talks to "
                         "llama-server over TCP: leave --host out")
    if "no_slots" in args.flags:
        raise ValueError("the llama-server command has --no-slots, but slotkeeper needs llama-server's /slots "
                         "endpoint: remove --no-slots")
    if args.api_key:
        raise ValueError("the llama-server command has --api-key or --api-key-file, but slotkeeper does not send "
                         "llama-server a key: remove it (llama-server then listens on loopback only) and give "
                         "slotkeeper --api-key for its clients instead")
    if slot_dir is not None and args.slot_save_path is not None and Path(args.slot_save_path) != slot_dir:
        raise ValueError(f"--slot-dir {slot_dir} and the llama-server command's --slot-save-path "
                         f"{args.slot_save_path} differ: give only one of them")
    return args


def launch_slot_dir(command: Sequence[str], default: Path) -> Path:
    """The slot dir of a launch: the command's --slot-save-path when it has one, else `default`."""
    given = parse_command(command).slot_save_path
    return Path(given) if given is not None else default


def plan_launch(command: Sequence[str], default_slot_dir: Path, pick_port: Callable[[], int],
                ram_dir: Path | None = None) -> LaunchPlan:
    """The argv to start (the command plus --host, --port and --slot-save-path where missing) and what to warn about.

    `default_slot_dir` is used when the command has no --slot-save-path; `pick_port` is called only when it has no
    --port. With a `ram_dir` (cache/ramdir.py), that is the llama-server's --slot-save-path, in place of the
    command's own, which stays the slot dir: where the snapshots are kept.
    """
    args = check_command(command)
    words = args.args
    added: list[str] = []
    if args.host is None:
        added += ["--host", "127.0.0.1"]
    port = args.port
    if port is None:
        port = pick_port()
        added += ["--port", str(port)]
    slot_dir = Path(args.slot_save_path) if args.slot_save_path is not None else default_slot_dir
    if ram_dir is not None:
        words = _without_option(words, "slot_save_path")
        added += ["--slot-save-path", str(ram_dir)]
    elif args.slot_save_path is None:
        added += ["--slot-save-path", str(slot_dir)]
    return LaunchPlan(
        argv=(args.program, *words, *added),
        url=f"http://{_connect_host(args.host)}:{port}",
        port=port,
        slot_dir=slot_dir,
        alias=args.first_alias,
        model=args.model,
        added=tuple(added),
        warnings=tuple(launch_warnings(args)),
    )


def _without_option(words: Sequence[str], name: str) -> tuple[str, ...]:
    """The words without every occurrence of the value option `name` (any spelling) and its value; parse_command
    has already split `--option=value` into two words."""
    spellings = {option for option, known in VALUE_OPTIONS.items() if known == name}
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in spellings:
            skip = True
        else:
            out.append(word)
    return tuple(out)


def launch_warnings(args: LlamaServerArgs) -> list[str]:
    """Settings of the command that work against slotkeeper, each as a message that says what to change."""
    warnings = []
    if args.auto_slots and args.kv_unified and args.clears_idle_slots:
        warnings.append(
            f"the llama-server command has no -np (or -np -1): llama-server then runs {AUTO_SLOTS} slots on one "
            "unified KV cache and, with --cache-idle-slots (its default), empties every idle slot into its RAM "
            "cache, so slotkeeper's saves of idle slots hold nothing; give -np N, or add --no-cache-idle-slots or "
            "--no-kv-unified"
        )
    elif args.n_slots > 1 and args.kv_unified and args.clears_idle_slots:
        warnings.append(
            "the llama-server command has --kv-unified with several slots and --cache-idle-slots (its default): "
            "llama-server empties every idle slot into its RAM cache, so slotkeeper's saves of idle slots hold "
            "nothing; add --no-cache-idle-slots (or --cache-ram 0)"
        )
    if args.slot_prompt_similarity not in (None, 0.0) and args.n_slots > 1:
        warnings.append(
            f"the llama-server command has --slot-prompt-similarity {args.slot_prompt_similarity:g}: llama-server "
            "would pick the slot whose content looks most like a new prompt, but slotkeeper names the slot (id_slot) "
            "in every request, so the option has no effect on them; only a client that talks to llama-server "
            "directly could land in a slot slotkeeper keeps for another conversation. -sps 0 says so explicitly"
        )
    if args.cache_ram != 0:
        if args.cache_ram is None:
            size = f"{DEFAULT_CACHE_RAM_MIB} MiB by default"
        else:
            size = f"{args.cache_ram} MiB" if args.cache_ram > 0 else "no limit"
        warnings.append(
            f"llama-server keeps its own prompt cache in RAM (--cache-ram, {size}): it competes with slotkeeper's "
            "snapshots for memory and may swap a slot's state for another conversation's cached prompt behind "
            "slotkeeper's back; add --cache-ram 0 to leave caching to slotkeeper"
        )
    if args.host is not None and not is_loopback(_first_host(args.host)):
        warnings.append(
            f"llama-server listens on {args.host}, not on loopback: anyone who reaches it there can read "
            "conversations from its /slots endpoint and write slot files; slotkeeper needs only 127.0.0.1 (leave "
            "--host out)"
        )
    return warnings


# -- helpers ----------------------------------------------------------------------------------------------------------

_OPPOSITES = {
    "kv_unified": "no_kv_unified", "no_kv_unified": "kv_unified",
    "cache_idle_slots": "no_cache_idle_slots", "no_cache_idle_slots": "cache_idle_slots",
    "slots": "no_slots", "no_slots": "slots",
}


def _is_value(word: str) -> bool:
    return not word.startswith("-") or bool(_NUMBER.match(word))


def _int(values: dict[str, str], spelled: dict[str, str], name: str) -> int | None:
    if name not in values:
        return None
    try:
        return int(values[name])
    except ValueError:
        raise ValueError(f"llama-server option {spelled[name]} needs a whole number, not {values[name]!r}") from None


def _float(values: dict[str, str], spelled: dict[str, str], name: str) -> float | None:
    if name not in values:
        return None
    try:
        return float(values[name])
    except ValueError:
        raise ValueError(f"llama-server option {spelled[name]} needs a number, not {values[name]!r}") from None


def _first_host(host: str) -> str:
    return host.split(",", 1)[0].strip()


def _connect_host(host: str | None) -> str:
    """Where slotkeeper connects: loopback for a missing or wildcard address, else the (first) address given."""
    if host is None:
        return "127.0.0.1"
    first = _first_host(host).strip("[]")
    if first in ("", "0.0.0.0"):
        return "127.0.0.1"
    if first == "::":
        return "[::1]"
    return f"[{first}]" if ":" in first else first
