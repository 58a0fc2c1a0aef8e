"""The `sigil-push` command: serve, migrate, analytics.

Exit codes: 0 success, 2 bad usage or invalid configuration (one line on stderr naming the key
and the problem), 1 any other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from analytics.duration import DEFAULT_GRACE_MS, parse_duration_ms
from analytics.preflight import InputError, check_arguments
from sigil_push import __version__
from sigil_push.config import Config, ConfigError, config_path, load_config
from sigil_push.push.registry import TABLES

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
# The `analytics` extra: what `pip install .` leaves out because the bridge never needs it.
ANALYTICS_MODULES = ("pyspark", "matplotlib", "numpy")
ANALYTICS_INSTALL = "pip install '.[analytics]'"


def _parse_iso(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sigil-push", description="Private push notifications for Nostr direct messages."
    )
    parser.add_argument("--version", action="version", version=f"sigil-push {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the API and the relay bridge")
    serve.add_argument("--config", help="path to relays.toml (default: $SIGIL_PUSH_CONFIG, ./relays.toml)")
    migrate = commands.add_parser("migrate", help="apply database migrations and exit")
    migrate.add_argument("--config", help="path to relays.toml")
    migrate.add_argument(
        "--from", dest="source", metavar="SQLITE_DB",
        help="copy this SQLite instance into the PostgreSQL server.database (which must be empty)",
    )
    analytics = commands.add_parser("analytics", help="relay-health reports from the observation log")
    analytics.add_argument("--input", required=True, help="observation log folder (any Hadoop path)")
    analytics.add_argument("--output", required=True, help="report folder (any Hadoop path)")
    analytics.add_argument("--master", default="local[*]", help="Spark master URL")
    analytics.add_argument("--since", type=_parse_iso, help="ISO 8601 start (inclusive)")
    analytics.add_argument("--until", type=_parse_iso, help="ISO 8601 end (exclusive)")
    analytics.add_argument(
        "--grace",
        type=parse_duration_ms,
        default=DEFAULT_GRACE_MS,
        help="how late a relay may deliver a DM and not have missed it (e.g. 90s, 2m; default 2m)",
    )
    return parser


def _load(path_arg: str | None) -> Config:
    return load_config(config_path(path_arg), TABLES)


async def _preflight(config: Config) -> None:
    """Before a PostgreSQL worker starts listening: the database is reachable and migrated,
    and this worker's bridge key is the instance's (one line, not a traceback, when either
    fails). The CLI composes the two, so the store never imports the identity that uses it."""
    from sigil_push.identity import bridge_key
    from sigil_push.store.factory import migrated_instance

    async with migrated_instance(config) as instance:
        if instance is None:
            return
        key = await bridge_key(
            instance.meta, config.server.secret_key, config.resolve(config.server.secret_key_file)
        )
        await instance.check_key(key.public_key_hex)


def _serve(config: Config) -> int:
    # PostgreSQL: an unreachable or too new database (exit 1) or a bridge key other than the
    # instance's (exit 2) is one line here, before the listener starts
    asyncio.run(_preflight(config))
    from sigil_push.http.server import run_server

    return run_server(config)


def _migrate(config: Config, source: str | None = None) -> int:
    if source is not None:
        return _copy_from_sqlite(config, Path(source))
    from sigil_push.store.factory import migrate

    applied = asyncio.run(migrate(config))
    print(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))
    return EXIT_OK


def _copy_from_sqlite(config: Config, source: Path) -> int:
    from sigil_push.store.factory import copy_from_sqlite
    from sigil_push.store.records import BRIDGE_KEY_LEFT

    copied = asyncio.run(copy_from_sqlite(config, source))
    key_left = copied.pop(BRIDGE_KEY_LEFT, 0)
    print("copied " + ", ".join(f"{table}: {rows}" for table, rows in copied.items()))
    if key_left:
        print(
            f"the bridge key in {source}'s meta table was not copied (a database never holds"
            " it): start `sigil-push serve` once on the SQLite file to move it into"
            " server.secret_key_file, then give every PostgreSQL worker that file",
            file=sys.stderr,
        )
    return EXIT_OK


def _analytics(args: argparse.Namespace) -> int:
    # A missing local input or an inverted window is exit 2 in a second, before PySpark is
    # imported or a JVM started (a remote --input is checked once Spark can reach it).
    try:
        check_arguments(args.input, args.since, args.until)
    except InputError as exc:
        print(f"sigil-push: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        from analytics.run import run_all
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ANALYTICS_MODULES:
            raise
        print(
            f"sigil-push: analytics needs the analytics extra ({exc.name} is missing): "
            f"{ANALYTICS_INSTALL}",
            file=sys.stderr,
        )
        return EXIT_USAGE

    try:
        summary = run_all(
            args.input, args.output, args.master, args.since, args.until, args.grace
        )
    except InputError as exc:
        print(f"sigil-push: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"read {summary.records_read} records from {summary.files_read} files"
        f" ({summary.corrupt_lines} corrupt lines, {summary.records_in_window} in the window);"
        f" wrote {', '.join(f'{name}: {rows} rows' for name, rows in summary.rows.items())}"
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and EXIT_USAGE
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("aiosqlite").setLevel(logging.INFO)
    try:
        if args.command == "analytics":
            return _analytics(args)
        config = _load(args.config)
        if args.command == "serve":
            return _serve(config)
        return _migrate(config, args.source)
    except ConfigError as exc:
        print(f"sigil-push: invalid config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:  # the CLI's last resort: one line, exit 1
        logging.getLogger("sigil_push").debug("fatal error", exc_info=True)
        print(f"sigil-push: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
