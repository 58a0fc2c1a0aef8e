"""Operator surface and secrets against the real service process (issue 9: admin_listen,
trusted_proxies, secret_key_file, file modes, and user relay URLs that point inside).

The bridge key's place (a private file, never the database) is checked on both engines. The
rest is not about the store, so it runs on the default engine: listeners, proxies and the
outbound guard behave the same whatever `server.database` names, and moving a key out of an
old database concerns SQLite files only (PostgreSQL instances never kept it there)."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sigil_push.http.ratelimit import client_address, trusted_networks
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.sqlite.database import open_database
from testkit.cli import assert_config_refused
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.relay import RelayProcess, free_port
from testkit.service import ServiceProcess
from testkit.stores import Engine, fetch
from tests.conftest import ApiCaller


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.slow
def test_public_listener_hides_metrics_and_relay_detail(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path / "svc", relays=["ws://127.0.0.1:1"]) as service:
        public = httpx.get(service.url + "/health", timeout=scaled(REQUEST_SECONDS))
        assert public.status_code == 200 and public.json() == {"status": "ok"}
        assert httpx.get(service.url + "/metrics", timeout=scaled(REQUEST_SECONDS)).status_code == 404
        admin = httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS)).json()
        assert "ws://127.0.0.1:1" in admin["relays"]
        assert "sigil_push_" in httpx.get(service.admin_url + "/metrics", timeout=scaled(REQUEST_SECONDS)).text
        # the admin listener is only the operator surface
        assert httpx.get(service.admin_url + "/info", timeout=scaled(REQUEST_SECONDS)).status_code == 404


def test_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    trusted = trusted_networks(["127.0.0.1", "10.0.0.0/8"])
    assert client_address("127.0.0.1", "6.6.6.6, 1.2.3.4", trusted) == "1.2.3.4"
    assert client_address("127.0.0.1", "1.2.3.4, 10.1.1.1", trusted) == "1.2.3.4"
    assert client_address("9.9.9.9", "1.2.3.4", trusted) == "9.9.9.9"
    assert client_address("127.0.0.1", "1.2.3.4", ()) == "127.0.0.1"
    assert client_address("127.0.0.1", "not-an-ip", trusted) == "127.0.0.1"


@pytest.mark.slow
def test_per_ip_limit_uses_the_forwarded_address_behind_a_trusted_proxy(tmp_path: Path) -> None:
    service = ServiceProcess(
        tmp_path / "svc", limits="requests_per_minute_per_ip = 3\nrequests_per_minute_per_npub = 0",
    )
    text = service.config_path.read_text().replace("[server]\n", '[server]\ntrusted_proxies = ["127.0.0.1"]\n', 1)
    service.config_path.write_text(text)
    with service:
        def info(forwarded: str) -> int:
            return httpx.get(service.url + "/info", headers={"X-Forwarded-For": forwarded}, timeout=scaled(REQUEST_SECONDS)).status_code

        assert [info("203.0.113.7") for _ in range(3)] == [200, 200, 200]
        assert info("203.0.113.7") == 429
        # another client behind the same proxy keeps its own budget
        assert info("203.0.113.8") == 200
        # a client cannot escape its budget by writing the header itself: the proxy appends
        assert info("198.51.100.1, 203.0.113.7") == 429
        # an IPv6 client is one client per /64: it holds 2^64 addresses to rotate through
        assert [info("2001:db8:1:2::1") for _ in range(3)] == [200, 200, 200]
        assert info("2001:db8:1:2::ffff") == 429
        assert info("2001:db8:1:3::1") == 200


@pytest.mark.slow
def test_key_file_and_database_files_are_private(tmp_path: Path, engine: Engine) -> None:
    """The bridge key lives in a 0600 file, never in the database; the SQLite files and the
    observation log are 0600 too."""
    folder = tmp_path / "svc"
    with RelayProcess(tmp_path / "relay") as relay, ServiceProcess(
        folder, relays=[relay.url], database=engine.database()
    ) as service:
        deadline = time.monotonic() + scaled(30)
        while not list((folder / "observations").glob("*.jsonl")):
            assert time.monotonic() < deadline, "no observation record written"
            time.sleep(0.1)
        pubkey = httpx.get(service.url + "/info", timeout=scaled(REQUEST_SECONDS)).json()["pubkey"]
        key_file = folder / "bridge.key"
        assert mode(key_file) == 0o600
        assert SecretKey(key_file.read_text().strip()).public_key_hex == pubkey
        if not engine.postgres:
            for name in ("sigil-push.db", "sigil-push.db-wal", "sigil-push.db-shm"):
                assert mode(folder / name) == 0o600, name
        assert fetch(service.database, "SELECT key FROM meta WHERE key = 'bridge_secret_key'") == []
        secret = key_file.read_text().strip()
        assert secret.encode() not in engine.at_rest(service.database)
        service.stop()
        records = list((folder / "observations").glob("*.jsonl"))
        assert records and all(mode(path) == 0o600 for path in records)
        # the same identity after a restart
        service.start()
        assert httpx.get(service.url + "/info", timeout=scaled(REQUEST_SECONDS)).json()["pubkey"] == pubkey


@pytest.mark.slow
def test_key_in_an_old_database_moves_to_the_key_file(tmp_path: Path) -> None:
    folder = tmp_path / "svc"
    folder.mkdir()
    old = SecretKey.generate()

    async def old_instance() -> None:
        db = await open_database(folder / "sigil-push.db")
        await db.execute("INSERT INTO meta (key, value) VALUES ('bridge_secret_key', ?)", (old.secret_hex,))
        await db.close()

    asyncio.run(old_instance())
    (folder / "sigil-push.db").chmod(0o644)
    with ServiceProcess(folder) as service:
        assert httpx.get(service.url + "/info", timeout=scaled(REQUEST_SECONDS)).json()["pubkey"] == old.public_key_hex
        assert SecretKey((folder / "bridge.key").read_text().strip()).secret_hex == old.secret_hex
        assert mode(folder / "sigil-push.db") == 0o600
        with sqlite3.connect(folder / "sigil-push.db") as db:
            assert db.execute("SELECT COUNT(*) FROM meta WHERE key = 'bridge_secret_key'").fetchone()[0] == 0


@pytest.fixture
def internal_listener() -> Iterator[tuple[int, list[str]]]:
    """A loopback TCP service standing in for something internal; records every connection."""
    accepted: list[str] = []
    server = socket.socket()
    server.bind(("127.0.0.1", free_port()))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            accepted.append(str(peer))
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.mark.slow
def test_user_relays_pointing_inside_are_never_contacted(
    tmp_path: Path, internal_listener: tuple[int, list[str]]
) -> None:
    """A user registers wss:// URLs for loopback (the service runs without the test switch):
    each is refused at registration with 400 invalid_relays (once accepted with 201 and then
    silently never connected); neither the relay nor its NIP-11 document is fetched, and
    /health reveals nothing. `127。0。0。1` (ideographic, fullwidth and halfwidth full stops)
    is the same address: it was accepted with 201 and refused only at connect time. Names that resolve inside are the connect-time guard's
    (test_outbound_guard.py)."""
    port, accepted = internal_listener
    with ServiceProcess(tmp_path / "svc", insecure_relays=False) as service, httpx.Client(
        base_url=service.url, timeout=scaled(REQUEST_SECONDS)
    ) as http:
        caller = ApiCaller(http, service.url)
        for relay in (f"wss://127.0.0.1:{port}", f"wss://localhost:{port}",
                      f"wss://127.1:{port}/?x=1", f"wss://127\u30020\u30020\u30021:{port}",
                      f"wss://127\uff0e0\uff0e0\uff0e1:{port}", f"wss://127\uff610\uff610\uff611:{port}"):
            answer = caller.register(SdkUser(), relays=[relay])
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"] == "invalid_relays"
        # the same spellings as a bunker relay: refused too, and no session is left pending
        user = SdkUser()
        signer = SecretKey.generate().public_key_hex
        answer = caller.register(user, auth_signer=f"bunker://{signer}?relay=wss://127\u30020\u30020\u30021:{port}")
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_auth_signer", answer.text
        assert caller.call("GET", "/registrations", user).json()["devices"] == []
        assert accepted == []
        assert str(port) not in http.get("/health").text


@pytest.mark.parametrize(("server", "key"), [
    ('admin_listen = "nowhere"', "server.admin_listen"),
    ('trusted_proxies = ["10.0.0.0/33"]', "server.trusted_proxies"),
    ('trusted_proxies = "127.0.0.1"', "server.trusted_proxies"),
    ("secret_key_file = 7", "server.secret_key_file"),
])
def test_bad_operator_keys_exit_2_naming_the_key(tmp_path: Path, server: str, key: str) -> None:
    assert_config_refused(tmp_path, f"[server]\n{server}\n", key)


@pytest.mark.parametrize("listener", ["admin", "public"])
def test_a_port_taken_fails_the_start_at_once_naming_it(tmp_path: Path, listener: str) -> None:
    """Both listeners are bound before the service starts anything: the one another process
    holds ends the start with exit 1 and says which address, and no relay is dialled."""
    service = ServiceProcess(tmp_path / "svc")
    port = service.admin_port if listener == "admin" else service.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        log = service.refuses_to_start()
    assert f"cannot listen on 127.0.0.1:{port}" in log, log
    assert "bridge" not in log.lower(), log
