"""`server.database` as a URL through the real CLI: postgresql:// migrates a real server, other
schemes are refused with exit 2, and serve takes the URL as PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from tests.service.test_cli import run_cli


@pytest.mark.parametrize(
    "url", ["mysql://u@127.0.0.1/db", "sqlite:///tmp/x.db", "http://127.0.0.1/db", "redis://h/0"]
)
def test_other_url_schemes_exit_2_naming_server_database(tmp_path: Path, url: str) -> None:
    config = tmp_path / "relays.toml"
    config.write_text(f'[server]\ndatabase = "{url}"\n')
    for command in ("migrate", "serve"):
        result = run_cli(command, "--config", str(config))
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "server.database" in lines[0]
    assert list(tmp_path.iterdir()) == [config]  # nothing was created as a file


def test_serve_with_an_unreachable_postgres_url_exits_1_and_creates_no_file(tmp_path: Path) -> None:
    """serve takes the URL as PostgreSQL (never as a SQLite file name); a server that cannot
    be reached is one line and exit 1, without the password."""
    config = tmp_path / "relays.toml"
    config.write_text('[server]\ndatabase = "postgresql://postgres:hunter2@127.0.0.1:1/x"\n')
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "hunter2" not in result.stderr
    assert list(tmp_path.iterdir()) == [config]


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
async def test_migrate_applies_postgres_migrations_once(
    tmp_path: Path, postgres_url: str, scheme: str
) -> None:
    url = scheme + postgres_url.removeprefix("postgresql")
    config = tmp_path / "relays.toml"
    config.write_text(f'[server]\ndatabase = "{url}"\n')
    first = run_cli("migrate", "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert "0001_foundation.sql" in first.stdout
    second = run_cli("migrate", "--config", str(config))
    assert second.returncode == 0 and "applied 0 migration(s)" in second.stdout
    assert list(tmp_path.iterdir()) == [config]
    connection = await asyncpg.connect(postgres_url)
    try:
        assert await connection.fetchval("SELECT count(*) FROM schema_migrations") >= 2
    finally:
        await connection.close()


def test_unreachable_postgres_exits_1_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "relays.toml"
    config.write_text('[server]\ndatabase = "postgresql://postgres:hunter2@127.0.0.1:1/x"\n')
    result = run_cli("migrate", "--config", str(config))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "hunter2" not in result.stderr


def test_empty_database_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "relays.toml"
    config.write_text('[server]\ndatabase = ""\n')
    result = run_cli("migrate", "--config", str(config))
    assert result.returncode == 2 and "server.database" in result.stderr
