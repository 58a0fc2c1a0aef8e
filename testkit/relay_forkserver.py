"""Starts `nostr-relay` processes by forking one that has already imported it.

A relay started with `nostr-relay serve` spends about 1.1 s of CPU before it listens, most of
it importing (SQLAlchemy, alembic, falcon, uvicorn) and running its migrations' code; a full
suite starts about 160 relays, which made the relays' start-up a sixth of the suite's CPU on a
2-core machine. This process imports all of that once; each relay is then a fork of it that
runs the same command-line entry point (`nostr_relay.cli.main`) with the same arguments, in a
session of its own, its output in the relay's log: the process tests talk to, signal and
kill is the real relay, as before.

Protocol, one line each way: the test process writes a JSON request
`{"args": [...], "log": path, "cwd": path}` to stdin and reads the child's pid back on stdout.
The server ignores SIGCHLD, so the kernel reaps its children: a relay that has exited is gone
(`os.kill(pid, 0)` fails), which is how `testkit.relay.ForkedRelay` tells it stopped.
Run as `python -m testkit.relay_forkserver`; it exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any


def _preload() -> None:
    """What `nostr-relay serve --use-uvicorn` imports before it listens."""
    import alembic.command
    import alembic.config  # noqa: F401
    import nostr_relay.cli
    import nostr_relay.storage.db
    import nostr_relay.web  # noqa: F401
    import uvicorn  # noqa: F401


def _run_relay(request: dict[str, Any]) -> int:
    """In the forked child: the relay's own session, its log as stdout and stderr, and the
    command line's entry point; the exit code it ends with."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(nothing)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 is the process's own
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    import nostr_relay.cli

    try:
        nostr_relay.cli.main(args=request["args"], prog_name="nostr-relay")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the relay's log, as its CLI would
        import traceback

        traceback.print_exc()
        return 1
    return 0


def serve_forks() -> None:
    _preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_relay(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve_forks()
