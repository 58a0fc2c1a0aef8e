"""A real PostgreSQL server for tests, started from the machine's own binaries.

initdb refuses to run as root, so when the tests run as root the cluster belongs to an
unprivileged `postgres` user (created if missing) and every server command runs through
`runuser`. The data directory is a fresh temporary folder owned by that user; the server listens
on a free loopback port and on a socket in that folder, with fsync off because a test cluster
is thrown away. Nothing is mocked: the tests talk to the real server over TCP with asyncpg.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import pytest

from testkit.deadlines import COMMAND_SECONDS, STARTUP_SECONDS, STOP_SECONDS, scaled
from testkit.relay import free_port, wait_for_port

SERVICE_USER = "postgres"


def find_binaries() -> Path | None:
    """The folder holding initdb and pg_ctl: PATH first, then Debian's versioned folders."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    return None


def _ensure_user() -> None:
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SERVICE_USER], check=True)


class PostgresServer:
    """One throw-away cluster; `url(database)` gives an asyncpg/libpq URL to it."""

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        self.port = 0
        """Chosen when the server starts (after initdb, tens of seconds on a loaded machine,
        during which a port chosen earlier sat unclaimed)."""
        self.root = Path(tempfile.mkdtemp(prefix="sigil-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as_root = os.geteuid() == 0
        self._options = ""

    def _run(self, *args: str, seconds: float = COMMAND_SECONDS) -> None:
        """One server command to completion; `seconds` is its deadline (scaled)."""
        command = [str(self.binaries / args[0]), *args[1:]]
        if self._as_root:
            command = ["runuser", "-u", SERVICE_USER, "--", *command]
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=scaled(seconds)
        )
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {done.stderr.strip()}\n{log[-2000:]}")

    def start(self) -> Self:
        if self._as_root:
            _ensure_user()
            user = pwd.getpwnam(SERVICE_USER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.port = free_port()
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            " -c max_connections=200"
        )
        self._options = options
        self.resume()
        return self

    def halt(self, mode: str = "fast") -> None:
        """Stop the server (`pg_ctl stop -m fast`: every connection is closed at once) and
        keep its data, for a database outage that `resume` ends on the same port."""
        wait = str(int(scaled(STOP_SECONDS)))
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", wait, "stop")

    def resume(self) -> None:
        """Start the (initialised) server on its port; after `halt`, the same cluster again."""
        # pg_ctl's own wait (-w) gives up after 60 s unless told otherwise (-t)
        wait = str(int(scaled(STARTUP_SECONDS)))
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", self._options, "-l", str(self.log), "-w",
            "-t", wait, "start", seconds=2 * STARTUP_SECONDS,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        """Stops the server and removes its folder in the background: after a whole suite it
        holds hundreds of databases (gigabytes, about 100k files), which took 20-100 s to
        delete at the end of the session; nothing reads the folder once the server is down."""
        if (self.data / "postmaster.pid").exists():
            wait = str(int(scaled(STOP_SECONDS)))
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", wait, "stop")
        subprocess.Popen(
            ["rm", "-rf", str(self.root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database (its URL), so tests never see each other's rows."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        self._run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-c",
            f"CREATE DATABASE {name}",
        )
        return self.url(name)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


REQUIRE_VARIABLE = "SIGIL_PUSH_REQUIRE_POSTGRES"
"""Set (to anything but empty or 0) by `.ci/run`: without PostgreSQL binaries every PostgreSQL
variant then fails instead of being skipped, so CI cannot pass on half the suite."""


def postgres_required() -> bool:
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def _binaries_or_skip() -> Path:
    """The PostgreSQL binaries, else the test is skipped (a developer machine without
    PostgreSQL) or fails (PostgreSQL required, as in CI)."""
    binaries = find_binaries()
    if binaries is None:
        missing = "PostgreSQL binaries (initdb, pg_ctl) not found on PATH or /usr/lib/postgresql"
        if postgres_required():
            pytest.fail(f"{missing}, and {REQUIRE_VARIABLE} is set", pytrace=False)
        pytest.skip(missing)
    return binaries


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL cluster for the whole test session. Without binaries its tests are
    skipped (a developer machine without PostgreSQL), or fail when PostgreSQL is required."""
    with PostgresServer(_binaries_or_skip()) as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a fresh database on the session's server."""
    return postgres_server.create_database()


@pytest.fixture
def own_postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of the test's own, which it may stop and start again (`halt`,
    `resume`) without taking the session's server from other tests."""
    with PostgresServer(_binaries_or_skip()) as server:
        yield server
