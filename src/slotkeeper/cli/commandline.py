"""The `slotkeeper` command: thin argument parsing that builds Settings and calls the library."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from slotkeeper import __version__

_SERVE_DESCRIPTION = """\
Run the proxy. Three modes:

  launch    everything after -- is a llama-server command line. slotkeeper starts it (adding
            --host 127.0.0.1, a free --port and --slot-save-path <cache dir>/slots/launch when
            they are missing), restarts it if it exits on its own, and stops it after saving
            the slots. It dies with slotkeeper, even on kill -9. Its output goes to
            <cache dir>/llama-server.log.
  attach    --upstream URL --slot-dir DIR: a llama-server you run yourself.
  embedded  neither: --model (or a generated tiny test model) on llama.cpp's server from the
            xllamacpp package.

Every option can also be set as an environment variable SLOTKEEPER_<OPTION> (e.g. SLOTKEEPER_PORT)
or as a key of the TOML file given with --config (e.g. port = 11500); flags win over the
environment, which wins over the file. The launch command can come from SLOTKEEPER_LAUNCH_COMMAND
(one string, split like a shell would) or launch_command (a list of words) in the file.
"""

_SERVE_EPILOG = """\
examples:
  slotkeeper serve -- llama-server -m model.gguf -c 65536 -np 2 --cache-ram 0
  slotkeeper serve --port 11500 -- /opt/llama/llama-server -m model.gguf -np 4 --slot-save-path /srv/slots
  slotkeeper serve --upstream http://127.0.0.1:8080 --slot-dir /var/cache/llama-slots
  slotkeeper serve --model model.gguf --ctx-size 16384

SIGTERM or Ctrl-C: running responses get a third of --shutdown-timeout to finish (then they are cut),
the changed slots are saved, then a server slotkeeper started is stopped (SIGTERM, then SIGKILL);
slotkeeper exits within --shutdown-timeout (default 30 s).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotkeeper",
        description="Session-aware KV-cache proxy for llama.cpp's llama-server. Speaks the Ollama, OpenAI and "
        "Anthropic APIs on port 11434 and keeps each conversation's slot state on disk.",
    )
    parser.add_argument("--version", action="version", version=f"slotkeeper {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the proxy", usage="%(prog)s [options] [-- /path/to/llama-server [llama-server options ...]]",
        description=_SERVE_DESCRIPTION, epilog=_SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", metavar="FILE.toml", help="read settings from this TOML file (keys: the option "
                       "names with underscores, e.g. slot_dir; default $SLOTKEEPER_CONFIG)")
    serve.add_argument("--print-config", action="store_true",
                       help="print the settings that would be used, as TOML, and exit")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 11434)")
    serve.add_argument("--upstream", metavar="URL", help="a running llama-server, e.g. http://127.0.0.1:8080")
    serve.add_argument("--slot-dir", metavar="DIR",
                       help="with --upstream: the directory llama-server was started with as --slot-save-path; in "
                       "launch mode: the --slot-save-path to give llama-server when its command has none (default "
                       "<cache dir>/slots/launch)")
    serve.add_argument("--model", metavar="PATH.gguf", help="embedded mode: the GGUF to serve")
    serve.add_argument("--cache-dir", metavar="DIR",
                       help="index, embedded slot files, logs (default ~/.cache/slotkeeper)")
    serve.add_argument("--ctx-size", type=int, help="embedded mode: context tokens per slot (default 8192)")
    serve.add_argument("--parallel", type=int, help="embedded mode: number of slots (default 1)")
    serve.add_argument("--cache-ram", dest="cache_ram_mib", type=int, metavar="MIB",
                       help="embedded mode: llama.cpp's host prompt cache size in MiB (0 turns it off)")
    serve.add_argument("--model-alias", metavar="NAME", help="the model name clients see (default: the file name)")
    serve.add_argument("--session-header", dest="session_headers", action="append", metavar="NAME",
                       help="another header that carries a session id (repeatable)")
    serve.add_argument("--keep-attribution-block", action=argparse.BooleanOptionalAction, default=None,
                       help="keep Claude Code's attribution line (x-anthropic-billing-header) in the system prompt; "
                       "it changes between requests, so nothing is reused (default: taken out)")
    serve.add_argument("--save-idle-seconds", type=float, metavar="S",
                       help="save a changed slot after at most S idle seconds, a state that saves quickly sooner "
                       "(after twice its save time, at least 0.25 s) while no other slot generates (default 2; "
                       "negative: only on switch/exit)")
    serve.add_argument("--min-restore-tokens", type=int, metavar="N",
                       help="skip restores that would reuse fewer than N tokens, a fixed floor (default: restore "
                       "when it costs less than prefilling what it gives, both measured on the backend)")
    serve.add_argument("--system-snapshots", action=argparse.BooleanOptionalAction, default=None,
                       help="start new conversations from a saved snapshot of their system prompt and tools, warming "
                       "a new one up once (default on)")
    serve.add_argument("--disk-budget", metavar="SIZE",
                       help="keep the snapshots under SIZE in total (e.g. 50G), evicting the least recently used "
                       "(default 0: no limit)")
    serve.add_argument("--block-tokens", type=int, metavar="N",
                       help="keep saved states as blocks of N tokens' KV, each stored once however many states "
                       "share it (default 64; 0: one whole file per state)")
    serve.add_argument("--ram-budget", metavar="SIZE",
                       help="RAM for copies of recent snapshots in the RAM dir, where the backend saves and restores "
                       "at memory speed (default: a quarter of the memory, at most 8G; 0: no RAM dir, the backend "
                       "uses the slot dir)")
    serve.add_argument("--ram-dir", metavar="DIR",
                       help="the RAM dir, on tmpfs (default: one under /dev/shm when slotkeeper starts the backend); "
                       "with --upstream: the directory on tmpfs llama-server was started with as --slot-save-path, "
                       "while --slot-dir is where the snapshots are kept")
    serve.add_argument("--max-snapshot-age", metavar="DURATION",
                       help="evict snapshots unused for longer than DURATION (e.g. 7d, 12h; default 0: never)")
    serve.add_argument("--max-system-snapshots", type=int, metavar="N",
                       help="keep at most N system-prompt snapshots per model, the most recently used "
                       "(default 0: no limit; 1 keeps one)")
    serve.add_argument("--max-queue", type=int, metavar="N",
                       help="requests that may wait for a slot before new ones get 503 (default 64; 0: no limit)")
    serve.add_argument("--api-key", metavar="KEY", help="require this key on the model routes")
    serve.add_argument("--admin-key", metavar="KEY",
                       help="require this key on /api/sessions and the other admin routes (default: the API key)")
    serve.add_argument("--user-header", metavar="NAME",
                       help="the header a trusted front end forwards its user in (OpenWebUI: X-OpenWebUI-User-Id); "
                       "each user's states are then kept apart from every other's; needs an API key. Named keys, "
                       "one cache domain each, go in the config file's [api_keys] table (docs/domains.md)")
    serve.add_argument("--allowed-hosts", action="append", metavar="NAME",
                       help="Host header names accepted besides loopback ones (repeatable; needed when listening "
                       "on a network address, to keep the DNS-rebinding check)")
    serve.add_argument("--max-body-bytes", type=int, metavar="N", help="largest request body (default 32 MiB)")
    serve.add_argument("--upstream-read-timeout", type=float, metavar="S",
                       help="give up on a backend that sends nothing for S seconds (default 600)")
    serve.add_argument("--backend-wait-seconds", type=float, metavar="S",
                       help="a request that arrives while the backend is down waits up to S seconds for it to come "
                       "back (default 30; 0: fail at once)")
    serve.add_argument("--side-task-hold-seconds", type=float, metavar="S",
                       help="a side task (OpenWebUI's title, tags) waits up to S seconds, until a conversation's "
                       "request comes, before it asks for a slot, and goes after conversations' requests, so a new "
                       "chat's answer is not held up by its title "
                       "(default 0.25; 0: no hold)")
    serve.add_argument("--max-loaded", type=int, metavar="N",
                       help="at most N models loaded at once, in front of a llama-server router (--models-dir or "
                       "--models-preset) or among the config file's [[backends]] that slotkeeper starts; to load "
                       "another, slotkeeper saves the changed slots of the least recently used one and unloads it "
                       "(default 0: the router's own --models-max; every [[backends]] table running)")
    serve.add_argument("--swap-wait-seconds", type=float, metavar="S",
                       help="router mode: a request for a model that is not loaded waits up to S seconds for the "
                       "answers running on the model that makes room for it (default 300)")
    serve.add_argument("--keep-alive", metavar="DURATION",
                       help="router mode: how long a model stays loaded after its last turn when a request names no "
                       "keep_alive, e.g. 5m (its changed slots are saved before it is unloaded; default -1: until "
                       "another model needs its room)")
    serve.add_argument("--load-factor", type=float, metavar="F",
                       help="a model on several backends (config file: several [[backends]] of one name): a new "
                       "session goes to a backend owning at most F times the mean of active sessions, and a "
                       "session moves off one past that (default 1.25)")
    serve.add_argument("--shared-store", metavar="s3://BUCKET/PREFIX",
                       help="also keep snapshots in this S3-compatible object store, which every host's slotkeeper "
                       "reads: saves are uploaded after their commit, and a session or system prompt this host "
                       "lacks is brought from there (credentials: the AWS_* variables)")
    serve.add_argument("--shared-endpoint", metavar="URL",
                       help="the object store's endpoint when it is not AWS (MinIO, Ceph RGW, R2, ...)")
    serve.add_argument("--shared-budget", metavar="SIZE",
                       help="keep the shared store's snapshot files under SIZE (e.g. 2T), removing the least "
                       "recently saved (default 0: no limit; or use the store's own lifecycle rules)")
    serve.add_argument("--directory", metavar="redis://HOST:PORT/DB",
                       help="several slotkeeper replicas behind one address: share a session directory in this "
                       "Redis or Valkey; each request runs on the replica holding its session's lease (others "
                       "forward it there), and new sessions are spread over every replica's backends")
    serve.add_argument("--replica-url", metavar="URL",
                       help="the URL the other replicas reach this one at (default: http://HOST:PORT of --host "
                       "and --port)")
    serve.add_argument("--replica-secret", metavar="SECRET",
                       help="with --directory (required): a secret every replica of the set shares (at least 16 "
                       "characters; better given as SLOTKEEPER_REPLICA_SECRET): requests one replica forwards to "
                       "another are signed with it, and forwarding headers from anyone else are ignored")
    serve.add_argument("--replica", dest="replicas", action="append", metavar="URL",
                       help="with --directory: a replica requests may be forwarded to, with the clients' "
                       "credentials (its base URL, e.g. http://gpu-2:11434; `*` matches within it, e.g. "
                       "'http://10.0.0.*:11434'); give it once per replica, or a comma list. Replicas the "
                       "directory names that are not listed are never contacted")
    serve.add_argument("--slot-op-timeout", type=float, metavar="S",
                       help="give up on a slot save, restore or erase after S seconds (default 120)")
    serve.add_argument("--start-timeout", type=float, metavar="S",
                       help="launch and embedded modes: seconds the server may take to answer /health (default 600)")
    serve.add_argument("--shutdown-timeout", type=float, metavar="S",
                       help="seconds from SIGTERM to exit: a third for running responses, half for saving slots, "
                       "a sixth for stopping the server slotkeeper started (default 30)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    serve.add_argument("--log-json", action="store_const", const=True,
                       help="log one JSON object per line (a request's line carries its fields as keys)")

    from slotkeeper.cli.manage import add_commands

    add_commands(sub)

    tiny = sub.add_parser("tiny-model", help="write a deterministic random-weight test model",
                          description="Write a tiny random-weight GGUF with a synthetic vocab: llama (dense, the "
                          "default), mamba (recurrent Mamba-1), jamba (Mamba-1 + attention), lfm2 (short convolution "
                          "+ attention) or gemma3 (sliding-window attention), with a ChatML or a Qwen3-style chat "
                          "template. Same options, same bytes. Its output is gibberish: it exists for tests and demos.")
    tiny.add_argument("out", metavar="OUT.gguf")
    # The choices repeat slotkeeper.tinymodel.ARCHS and TEMPLATES, so that parsing does not import numpy and gguf.
    tiny.add_argument("--arch", choices=["llama", "mamba", "jamba", "lfm2", "gemma3"], default="llama",
                      help="llama (KV cache), mamba (recurrent state; ignores --n-head, --n-head-kv, --n-ff), jamba "
                      "or lfm2 (hybrid: attention on the odd layers), gemma3 (even layers with a 64-token sliding "
                      "window, odd layers global)")
    tiny.add_argument("--template", choices=["chatml", "qwen3"], default="chatml",
                      help="chatml, or qwen3: a Qwen3-style template with tools, tool calls and <think> reasoning "
                      "dropped from earlier turns (adds <think>, </think>, <tool_call>, </tool_call> to the vocab)")
    tiny.add_argument("--fim", action="store_true",
                      help="add fill-in-the-middle tokens to the vocab, for llama-server's /infill (llama.vim, "
                      "llama.vscode)")
    tiny.add_argument("--seed", type=int, default=1234)
    tiny.add_argument("--n-embd", type=int, help="default 256 (llama, mamba) or 128 (jamba, lfm2, gemma3)")
    tiny.add_argument("--n-layer", type=int, default=4)
    tiny.add_argument("--n-head", type=int, help="default 8, or 4 for jamba, lfm2, gemma3")
    tiny.add_argument("--n-head-kv", type=int, help="default 4, or 2 for jamba, lfm2, gemma3")
    tiny.add_argument("--n-ff", type=int, help="default 768, or 256 for jamba, lfm2, gemma3")
    tiny.add_argument("--context-length", type=int, default=32768)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is the llama-server command of launch mode, kept word for word.
    launch: list[str] | None = None
    if "--" in words:
        cut = words.index("--")
        words, launch = words[:cut], words[cut + 1:]
    args = parser.parse_args(words)
    if launch is not None and args.command != "serve":
        parser.error("only `slotkeeper serve` takes a command after --")
    if args.command == "tiny-model":
        return _tiny_model(args)
    if args.command == "serve":
        if launch is not None and not launch:
            print("slotkeeper: nothing after --: give the llama-server command, e.g. "
                  "`slotkeeper serve -- llama-server -m model.gguf -np 2`", file=sys.stderr)
            return 2
        return _serve(args, tuple(launch or ()))
    if args.command in ("sessions", "backends", "models", "doctor", "prewarm", "export", "import"):
        from slotkeeper.cli.manage import run

        try:
            return run(args)
        except BrokenPipeError:  # the reader closed the pipe (`| head`, `| grep -q`): it has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush fails no more
            return 0
    parser.print_help()
    return 2


SWITCH_INTERVAL_SECONDS = 0.0005


def _serve(args: argparse.Namespace, launch_command: tuple[str, ...]) -> int:
    from slotkeeper.config import Settings, settings_toml
    from slotkeeper.logfmt import configure_logging

    cli = {k: v for k, v in vars(args).items() if k not in ("command", "print_config")}
    cli["launch_command"] = launch_command
    try:
        settings = Settings.build(cli)
    except ValueError as exc:
        print(f"slotkeeper: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(settings_toml(settings), end="")
        return 0
    configure_logging(settings.log_level, settings.log_json)
    # The GIL passes between threads every 0.5 ms instead of Python's 5: a turn's index look-up, run in a worker
    # thread, no longer waits up to 5 ms (on each way) behind the Python work of a commit or of the event loop.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    import uvicorn

    from slotkeeper.web.app import create_app

    # Running responses get a third of shutdown_timeout (whole seconds) before uvicorn cuts them; the app's
    # shutdown then saves the slots and stops a server it started within the rest (see Settings.shutdown_budget).
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                            timeout_graceful_shutdown=int(settings.shutdown_budget.responses), access_log=False)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def _tiny_model(args: argparse.Namespace) -> int:
    from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(arch=args.arch, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                         n_head_kv=args.n_head_kv, n_ff=args.n_ff, context_length=args.context_length, seed=args.seed,
                         template=args.template, fim=args.fim)
    try:
        n_bytes = write_tiny_model(Path(args.out), spec)
    except ValueError as exc:
        print(f"slotkeeper: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({n_bytes} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
