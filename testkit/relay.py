"""A real Nostr relay process (the PyPI package `nostr-relay`) on 127.0.0.1 for tests."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Self

PORTS_PER_WORKER = 1500
FIRST_PORT = 20000
"""Ports handed out to xdist workers lie below Linux's ephemeral range (32768-60999 by
default), so no outgoing connection is ever given one, and each worker has a block of its own."""

_next_port = itertools.count(random.randrange(PORTS_PER_WORKER))
"""Where this process starts in its block: at random, so that two test sessions run side by
side (each with a worker gw0) do not walk the same ports in the same order."""


def free_port() -> int:
    """A port for a server whose URL must be known before it starts, or kept across its
    restarts (a relay named in its own NIP-42 `relay` tag, a service's public URL): servers of
    our own bind port 0 and report theirs instead. Asking the OS for a port and releasing it
    races with the other xdist workers asking at the same time; so each worker takes ports from
    its own block in turn (skipping any in use), and two workers never get the same one nor a
    worker one back while a server it stopped may still hold it. Outside xdist (a bench, one
    test run alone) the OS picks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    if not worker.isdigit():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    first = FIRST_PORT + PORTS_PER_WORKER * int(worker)
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_next_port) % PORTS_PER_WORKER
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def start_listening(
    command: list[str], log_path: Path, port: int, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """`command` in a process group of its own (stopped by `stop_group`), its output appended
    to `log_path`, once it listens on `port`; stopped again if it never does."""
    with open(log_path, "ab") as log:  # the child keeps its own copy
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
    try:
        wait_for_port(port)
    except TimeoutError:
        stop_group(process)
        raise
    return process


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group of `process` (SIGKILL after 10 s); gone already is fine."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _relay_command() -> list[str]:
    found = shutil.which("nostr-relay")
    if found:
        return [found]
    return [sys.executable, "-m", "nostr_relay.cli"]


class RelayProcess:
    """One `nostr-relay` server with its own SQLite file.

    `verify_signatures=False` leaves out the `is_signed` validator: the relay then stores and
    serves forged events, which makes it a faithful malicious relay.
    `auth` enables NIP-42 (`{"query": "r"}` makes reading require role r).
    """

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        verify_signatures: bool = True,
        auth_actions: dict[str, str] | None = None,
    ) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.config_path = folder / "relay.yaml"
        self._process: subprocess.Popen[bytes] | None = None
        self._write_config(verify_signatures, auth_actions)

    def _write_config(self, verify_signatures: bool, auth_actions: dict[str, str] | None) -> None:
        validators = ["nostr_relay.validators.is_signed"] if verify_signatures else []
        lines = [
            "storage:",
            f'  sqlalchemy.url: "sqlite+aiosqlite:///{(self.folder / "relay.sqlite3").resolve()}"',
            f"  validators: {validators!r}",
            "gunicorn:",
            f"  bind: 127.0.0.1:{self.port}",
            "  workers: 1",
            "max_event_size: 131072",
            "subscription_limit: 256",
            "message_timeout: 1800",
            "verification:",
            "  nip05_verification: disabled",
            "authentication:",
            f"  enabled: {'true' if auth_actions else 'false'}",
        ]
        if auth_actions:
            lines.append(f"  relay_urls: [{self.url}]")
            lines.append("  actions:")
            lines.extend(f"    {action}: {role}" for action, role in auth_actions.items())
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self) -> Self:
        self._start_in_wal_mode()
        self._process = start_listening(
            [*_relay_command(), "-c", str(self.config_path), "serve", "--use-uvicorn"],
            self.folder / "relay.log", self.port, cwd=self.folder,
        )
        return self

    def _start_in_wal_mode(self) -> None:
        """Creates the relay's database in WAL mode before its first start.

        nostr-relay sets `journal_mode = wal` on every new pooled connection. On a fresh file
        that pragma is a write (it rewrites the header). When the first REQs open two pooled
        connections at once, the two switches deadlock. SQLAlchemy then keeps both failed
        connections open, one of them holding the write lock and a journal. From then on every
        query and EVENT fails with "database is locked" until the relay stops (full-suite runs
        saw an EVENT go unanswered for 90 s). A file already in WAL mode makes the pragma a no-op.
        """
        database = self.folder / "relay.sqlite3"
        if database.exists():
            return
        with closing(sqlite3.connect(database)) as connection:
            connection.execute("PRAGMA journal_mode = wal")

    def stop(self) -> None:
        if self._process is not None:
            stop_group(self._process)
            self._process = None

    def grant_role(self, pubkey_hex: str, roles: str) -> None:
        subprocess.run(
            [*_relay_command(), "-c", str(self.config_path), "role", "set", "-p", pubkey_hex,
             "-r", roles],
            check=True, capture_output=True, cwd=self.folder,
        )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
