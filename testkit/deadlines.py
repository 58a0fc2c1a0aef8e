"""How long the suite waits before it calls a wait a failure: one policy, in one place.

A deadline is a ceiling for failure, never a pace. Every wait in the suite polls a condition (a
port that answers, a row, a metric, a log line, a process that exits) and returns the moment it
holds, so a generous deadline costs a passing test nothing; only a failing test waits it out.
The numbers written at each wait are what an idle 2-core machine needs with room to spare;
`scaled` multiplies them by `SCALE`, which covers the slow day: a slower machine, or this one
running a second copy of the suite beside it (each worker then gets a fraction of a core, a
cold JVM takes minutes, a PostgreSQL `initdb` tens of seconds).

`SIGIL_PUSH_TEST_DEADLINE_SCALE` sets `SCALE` (default 4): raise it on a machine slower still,
lower it (e.g. 0.5) to see a hang fail sooner while debugging one test.

What is not a deadline is not scaled: a timeout the code under test is configured with (a send
timeout, a lease, a request deadline the test checks), or a window in which a test expects
nothing to happen. A test of the second kind waits instead for a later signal that proves the
thing did not happen (a marker event handled after it), since no window is long enough on a
loaded machine and every window is too long on an idle one.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

SCALE_VARIABLE = "SIGIL_PUSH_TEST_DEADLINE_SCALE"
DEFAULT_SCALE = 4.0
"""Measured: the suite's slowest waits took up to 3-4 times as long with a second suite running
beside it on the same 2 cores as they take on an idle machine (docs/performance.md)."""


def _scale() -> float:
    text = os.environ.get(SCALE_VARIABLE, "").strip()
    if not text:
        return DEFAULT_SCALE
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{SCALE_VARIABLE} must be a number, not {text!r}") from None
    if not value > 0:
        raise ValueError(f"{SCALE_VARIABLE} must be positive, not {text!r}")
    return value


SCALE = _scale()


def scaled(seconds: float) -> float:
    """`seconds` (enough on an idle machine) as the suite's deadline for one wait."""
    return seconds * SCALE


CONDITION_SECONDS = 30.0
"""The default for a condition a test waits on (a push sent, a row stored, a relay live)."""
STARTUP_SECONDS = 30.0
"""A process the suite starts (relay, `serve`, fake, browser) until it listens or answers."""
REQUEST_SECONDS = 10.0
"""One HTTP request to a local server, as the client's timeout."""
STOP_SECONDS = 15.0
"""A process asked to stop (SIGTERM) before it is killed."""
COMMAND_SECONDS = 60.0
"""A short command run to completion (`sigil-push migrate`, `psql`, `pg_ctl`, promtool)."""
JVM_SECONDS = 300.0
"""A cold JVM's work: a Spark session started, a `sigil-push analytics` or spark-submit job run
to completion. Starting the JVM alone took about 30 s on a loaded machine, and a job's first
stages compile their code."""


def deadline(seconds: float = CONDITION_SECONDS) -> float:
    """The `time.monotonic()` value past which a wait that began now has failed."""
    return time.monotonic() + scaled(seconds)


T = TypeVar("T")


def wait_until(
    check: Callable[[], T], what: str, seconds: float = CONDITION_SECONDS, every: float = 0.05
) -> T:
    """Polls `check` from synchronous code until it returns something truthy, and returns it."""
    end = deadline(seconds)
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {scaled(seconds):.0f} s waiting for {what}")
        time.sleep(every)


@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    what: str = ...,
    seconds: float = ...,
    every: float = ...,
) -> T: ...
@overload
async def eventually(
    check: Callable[[], T],
    what: str = ...,
    seconds: float = ...,
    every: float = ...,
) -> T: ...
async def eventually(
    check: Callable[[], T | Awaitable[T]],
    what: str = "condition",
    seconds: float = CONDITION_SECONDS,
    every: float = 0.02,
) -> T:
    """Polls `check` (sync or async) on the running loop until it returns something truthy."""
    end = deadline(seconds)
    while True:
        result = check()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {scaled(seconds):.0f} s waiting for {what}")
        await asyncio.sleep(every)
