"""Child-process entry point that serves a GGUF with llama.cpp's own server from the `xllamacpp` package.

Run as `python -m slotkeeper.upstream.embedded --model M --port P --slot-dir D ...`; it exits when its parent dies,
when stdin closes, or on SIGTERM, so no server outlives slotkeeper.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import threading


def _die_with_parent() -> None:
    # SIGKILL, as slotkeeper's own spawn sets it: a SIGTERM handler may never get to run in a busy process, and
    # there is nothing to save once slotkeeper is gone.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotkeeper-embedded")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--slot-dir", required=True)
    parser.add_argument("--ctx-size", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--cache-ram", type=int, default=None)
    parser.add_argument("--alias", default=None)
    args = parser.parse_args(argv)
    _die_with_parent()
    parent = os.getppid()

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.n_ctx = args.ctx_size * args.parallel  # like llama-server's -c: the total, split across the slots
    params.n_parallel = args.parallel
    params.hostnames = [args.host]
    params.port = args.port
    params.slot_save_path = os.path.join(args.slot_dir, "")
    params.endpoint_slots = True
    params.endpoint_metrics = True
    if args.cache_ram is not None:
        params.cache_ram_mib = args.cache_ram
    if args.alias:
        params.model_alias = args.alias
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def watch_stdin() -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdin.buffer.read()
        stop.set()

    if not sys.stdin.isatty():
        threading.Thread(target=watch_stdin, daemon=True).start()
    server = xllamacpp.Server(params)
    while not stop.wait(1.0):
        if os.getppid() != parent:
            break
    # Exit without tearing the server down: slotkeeper has saved what it needs, and xllamacpp's teardown can hang.
    assert server is not None
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
