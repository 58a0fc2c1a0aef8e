"""Store failures that are the database's state, not the request's or the batch's fault.

On SQLite that is a busy or locked file (`OperationalError` after the busy timeout); on
PostgreSQL a lost or refused connection, a lock not granted within `lock_timeout`, or a
serialization failure. The API answers them with 503 and Retry-After, the bridge retries them.
"""

from __future__ import annotations

import sqlite3

import asyncpg


class StoreUnavailable(Exception):
    """The database could not be reached: the connection was refused, lost or timed out, or
    the server is shutting down. Raised by the store in place of the driver's many forms of
    it (an OSError, asyncpg's connection and shutdown errors), so that every caller sees one
    type: the API answers `503 unavailable`, the bridge retries."""

    def __init__(self, engine: str, cause: BaseException) -> None:
        super().__init__(f"{engine} unreachable ({type(cause).__name__})")
        self.engine = engine


STORE_UNAVAILABLE: tuple[type[Exception], ...] = (
    StoreUnavailable,
    sqlite3.OperationalError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.TooManyConnectionsError,
    asyncpg.LockNotAvailableError,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.CannotConnectNowError,
)
POSTGRES_FAILURES: tuple[type[Exception], ...] = (
    StoreUnavailable,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
)
"""What a PostgreSQL call may end with that is the database's or the network's doing, for work
that is simply tried again later (a lease heartbeat, a NOTIFY): `StoreUnavailable` from the
repositories' handle, the driver's own errors from a pool or connection used directly."""
SKIPPABLE_WRITE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, *STORE_UNAVAILABLE)
"""What a write whose state also lives in memory (a signer session's status, kept for the next
start) survives with a log line: any SQLite error, or the store being unavailable."""
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (*STORE_UNAVAILABLE, OSError)
"""What the bridge's committer may retry: the above, and a connection that broke mid-batch;
`transient` then tells the retriable ones apart."""
SQLITE_TRANSIENT_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
"""SQLite's primary result codes for "another connection holds the file": worth a retry."""


def transient(exc: BaseException) -> bool:
    """Whether `exc` is the database's passing state (busy, locked, a lost connection), worth
    retrying for as long as it lasts, rather than what this statement will always get.

    sqlite3 raises `OperationalError` for a busy file but also for "too many SQL variables",
    "no such table" and other faults of the statement itself: retried forever, one of those
    would stop the committer for good. Only SQLITE_BUSY and SQLITE_LOCKED (with any extended
    code) are transient; the PostgreSQL classes in STORE_UNAVAILABLE and an OSError (a broken
    socket) are by their type."""
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None:  # raised by hand, not by SQLite: judge by the message
            return "locked" in str(exc) or "busy" in str(exc)
        return code & 0xFF in SQLITE_TRANSIENT_CODES
    return isinstance(exc, TRANSIENT_ERRORS)


def error_name(exc: BaseException) -> str:
    """`exc`'s type for a log line, with SQLite's own name of the error when it has one
    (`OperationalError SQLITE_IOERR_WRITE`): which fault it was, and no message, which may
    quote the statement's values."""
    name = getattr(exc, "sqlite_errorname", None)
    return type(exc).__name__ if name is None else f"{type(exc).__name__} {name}"


class TooManyDevices(Exception):
    """The npub already has the maximum number of devices."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} devices per npub")
        self.limit = limit


class TooManyAccounts(Exception):
    """The device token is already registered by the maximum number of npubs."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} accounts per device token")
        self.limit = limit


class TooManySubscriptions(Exception):
    """The npub already has the maximum number of Iris subscriptions."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} subscriptions per pubkey")
        self.limit = limit


class NotYours(Exception):
    """The Iris subscription id belongs to another pubkey (answered as not found)."""


class TargetTaken(Exception):
    """A push target of an Iris subscription is the token of one of the npub's registrations
    (POST /register): one row cannot be both."""
