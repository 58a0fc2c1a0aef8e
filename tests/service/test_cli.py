"""The `sigil-push` command: configuration errors, migrations and a clean stop.

The clean stop runs on both engines. The migration checks here are SQLite's (a file and its
`schema_migrations`); `migrate` against PostgreSQL is tests/service/test_cli_postgres.py and
tests/store/test_pg_migrate.py. Configuration errors stop the process before any store is opened."""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest

from testkit.cli import assert_config_refused, run_cli
from testkit.service import ServiceProcess
from testkit.stores import Engine


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[server]\nlisten = "nowhere"\n', "server.listen"),
        ("[server]\nlisten = 8080\n", "server.listen"),
        ('[server]\ncolour = "blue"\n', "server.colour"),
        ('[[relay]]\nurl = "https://not-a-relay"\n', "relay[0].url"),
        ('[[relay]]\nurl = "wss://r.example"\nread = "yes"\n', "relay[0].read"),
        ("[limits]\ndevices_per_npub = -1\n", "limits.devices_per_npub"),
        ('[apns]\nteam_id = "T"\n', "apns.key_id"),
        ('[fcm]\ncredentials_file = "missing.json"\n', "fcm.credentials_file"),
        ('[server]\nsecret_key = "nsec1nope"\n', "server.secret_key"),
        ('[server]\npublic_url = "ftp://x"\n', "server.public_url"),
        ("[weird]\n", "weird"),
    ],
)
def test_invalid_config_exits_2_naming_the_key(tmp_path: Path, toml: str, key: str) -> None:
    assert_config_refused(tmp_path, toml, key)


def test_unparseable_and_missing_config_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    assert run_cli("serve", "--config", str(broken)).returncode == 2
    assert run_cli("serve", "--config", str(tmp_path / "absent.toml")).returncode == 2


def test_bad_usage_exits_2() -> None:
    assert run_cli("fly").returncode == 2
    assert run_cli().returncode == 2


def test_config_from_environment_variable(tmp_path: Path) -> None:
    """Without --config, $SIGIL_PUSH_CONFIG names the file (before ./relays.toml)."""
    config = tmp_path / "elsewhere.toml"
    config.write_text('[server]\ndatabase = "env.db"\n')
    result = run_cli("migrate", cwd=tmp_path, env={**os.environ, "SIGIL_PUSH_CONFIG": str(config)})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "env.db").exists()


def test_migrate_is_idempotent_and_recorded(tmp_path: Path) -> None:
    config = tmp_path / "relays.toml"
    config.write_text('[server]\ndatabase = "data/push.db"\n')
    first = run_cli("migrate", "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert "0001_foundation.sql" in first.stdout
    second = run_cli("migrate", "--config", str(config))
    assert second.returncode == 0
    assert "applied 0 migration(s)" in second.stdout
    with sqlite3.connect(tmp_path / "data" / "push.db") as db:
        versions = [row[0] for row in db.execute("SELECT version FROM schema_migrations ORDER BY 1")]
    assert versions == sorted(set(versions)) and versions[0] == 1


def test_database_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "relays.toml"
    config.write_text("")
    assert run_cli("migrate", "--config", str(config)).returncode == 0
    with sqlite3.connect(tmp_path / "sigil-push.db") as db:
        db.execute("INSERT INTO schema_migrations VALUES (9999, '9999_future.sql', 0)")
    result = run_cli("migrate", "--config", str(config))
    assert result.returncode == 1
    assert "9999" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_with_exit_0(tmp_path: Path, sig: int, engine: Engine) -> None:
    """On either engine: the store closes (and a PostgreSQL worker lets go of its leases)
    within the stop, and the process says so."""
    service = ServiceProcess(tmp_path, database=engine.database()).start()
    assert service.stop(sig) == 0
    assert "sigil-push stopped" in service.log()


@pytest.mark.slow
def test_dry_run_is_announced_at_start(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path) as service:
        assert "dry-run" in service.log()
