"""Checks of an analytics run's arguments that need no Spark, made before a JVM starts.

Starting Spark costs 10-30 s; a mistyped ``--input`` or an inverted window must not cost that
to be told. Pure Python on purpose, like ``analytics.duration``: ``sigil-push analytics`` may
run it before it knows whether the analytics extra (PySpark) is installed.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

# Hadoop resolves these against the driver's own disk; any other scheme (hdfs:, s3a:, ...)
# only Hadoop can check, so those paths are left to the run (observations.select_files).
_LOCAL_SCHEMES = ("", "file")


class InputError(ValueError):
    """The input path cannot be read as an observation log (bad usage, not a crash)."""


def to_epoch_ms(moment: datetime) -> int:
    """Milliseconds since the epoch; a naive datetime is taken to be UTC, like the log."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def local_path(path: str) -> Path | None:
    """The file or folder a Hadoop path names on the local disk, None for a remote one."""
    parts = urlsplit(path)
    if parts.scheme.lower() not in _LOCAL_SCHEMES or parts.netloc not in ("", "localhost"):
        return None
    return Path(parts.path if parts.scheme else path)


def check_window(since_ms: int | None, until_ms: int | None) -> None:
    """Raise ``InputError`` for an empty or inverted ``[since, until)``."""
    if since_ms is not None and until_ms is not None and since_ms >= until_ms:
        raise InputError("--since must be before --until")


def check_arguments(input_path: str, since: datetime | None, until: datetime | None) -> None:
    """Raise ``InputError`` for a local ``input_path`` that does not exist or a bad window."""
    check_window(
        None if since is None else to_epoch_ms(since), None if until is None else to_epoch_ms(until)
    )
    local = local_path(input_path)
    if local is not None and not local.exists():
        raise InputError(f"--input: {input_path} does not exist")
