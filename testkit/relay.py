"""A real Nostr relay process (the PyPI package `nostr-relay`) on 127.0.0.1 for tests."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import BinaryIO, Protocol, Self, TypeVar

from testkit.deadlines import STARTUP_SECONDS, STOP_SECONDS, scaled

PORTS = range(10000, 32000)
"""Ports handed to test servers lie below Linux's ephemeral range (32768-60999 by default), so
no outgoing connection is ever given one."""
PORTS_PER_BLOCK = 400
"""A block per process: far more ports than one xdist worker's session asks for at a time."""
BLOCK_LOCKS = Path(tempfile.gettempdir()) / "sigil-push-test-ports"
"""One lock file per block, shared by every test session on the machine."""

_claimed: tuple[int, BinaryIO] | None = None
_next_port = itertools.count()


def claim_block(folder: Path = BLOCK_LOCKS) -> tuple[int, BinaryIO]:
    """The first port of a block no other live process holds, and the open lock file that
    holds it: an exclusive `flock` on the block's file in `folder`, which the kernel releases
    when the file is closed or the process exits (even on SIGKILL). Blocks are tried from a
    random one, so sessions rarely contend for the same lock."""
    folder.mkdir(exist_ok=True)
    blocks = list(range(PORTS.start, PORTS.stop - PORTS_PER_BLOCK + 1, PORTS_PER_BLOCK))
    first = random.randrange(len(blocks))
    for block in blocks[first:] + blocks[:first]:
        handle = open(folder / f"{block}.lock", "ab")  # noqa: SIM115 - held while claimed
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return block, handle
    raise RuntimeError(f"every block of {PORTS_PER_BLOCK} ports in {PORTS} is claimed")


def _block() -> int:
    """This process's block, claimed on first use and held until it exits. Every process of
    every test session on the machine (two suites side by side, other checkouts' runs, their
    xdist workers) thus owns ports no other one hands out; a fixed block per xdist worker
    number collided across sessions, each with its own gw0."""
    global _claimed
    if _claimed is None:
        _claimed = claim_block()
    return _claimed[0]


def free_port() -> int:
    """A port for a server whose URL must be known before it starts, or kept across its
    restarts (a relay named in its own NIP-42 `relay` tag, a service's public URL): servers of
    our own bind port 0 and report theirs instead. Asking the OS for a port and releasing it
    races with every other process asking at the same time, so each process takes ports from a
    block of its own (`_block`) in turn, skipping any in use: no two processes get the same
    port, nor one a port back while a server it stopped may still hold it."""
    first = _block()
    for _ in range(PORTS_PER_BLOCK):
        port = first + next(_next_port) % PORTS_PER_BLOCK
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_BLOCK - 1}")


def wait_for_port(port: int, timeout: float = STARTUP_SECONDS) -> None:
    """Until something listens on `port`; `timeout` is scaled (testkit.deadlines)."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {scaled(timeout):.0f} s")


def start_listening(
    command: list[str], log_path: Path, port: int, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """`command` in a process group of its own (stopped by `stop_group`), its output appended
    to `log_path`, once it listens on `port`; stopped again if it never does."""
    with open(log_path, "ab") as log:  # the child keeps its own copy
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
    return _once_listening(process, port)


Started = TypeVar("Started", bound="Stoppable")


def _once_listening(process: Started, port: int) -> Started:
    """`process` once it listens on `port`; stopped again if it never does."""
    try:
        wait_for_port(port)
    except TimeoutError:
        stop_group(process)
        raise
    return process


class Stoppable(Protocol):
    """What `stop_group` needs of a process: `subprocess.Popen`, or a relay forked by
    testkit.relay_forkserver (`ForkedRelay`)."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedRelay:
    """A relay process forked by testkit.relay_forkserver: not this process's child (the fork
    server's, which lets the kernel reap it), so it is waited for until its pid is gone."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return 0  # the exit code went to the fork server, which dropped it
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)


_fork_lock = threading.Lock()
_fork_server: subprocess.Popen[str] | None = None
"""This process's testkit.relay_forkserver, started on first use (one per xdist worker)."""


def start_forked_relay(args: list[str], log_path: Path, port: int, cwd: Path) -> ForkedRelay:
    """`nostr-relay ARGS` forked from the pre-imported fork server, its output appended to
    `log_path`, once it listens on `port`; stopped again if it never does."""
    global _fork_server
    request = json.dumps({"args": args, "log": str(log_path), "cwd": str(cwd)})
    with _fork_lock:
        server = _fork_server
        if server is None or server.poll() is not None:
            server = _fork_server = subprocess.Popen(
                [sys.executable, "-m", "testkit.relay_forkserver"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, cwd=Path(__file__).resolve().parents[1],
            )
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(request + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
    if not answer:
        raise RuntimeError("the relay fork server exited")
    return _once_listening(ForkedRelay(int(answer)), port)


def stop_group(process: Stoppable) -> None:
    """SIGTERM to the process group of `process` (SIGKILL after the stop deadline); gone
    already is fine."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=scaled(STOP_SECONDS))
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
        self._process: ForkedRelay | None = None
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
        self._process = start_forked_relay(
            ["-c", str(self.config_path), "serve", "--use-uvicorn"],
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
