"""Long-running tasks that cannot die unnoticed: every exception is logged, counted and the task
restarted with backoff.

A loop that dies silently (the commit loop on one hostile event) stops wakeups for every user
while `/health` still says ok. Under a Supervisor such a loop comes back, each restart shows in
`sigil_push_task_restarts_total{task}`, and while a *core* task waits out its backoff it is
listed by `down()`, which `/health` reports with a 503. A core task that runs but cannot do
its work (the committer while the database refuses writes) reports itself `impaired`, and is
listed the same way, with its reason, until it reports that it works again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from prometheus_client import Counter

log = logging.getLogger(__name__)

RESTARTS = Counter(
    "sigil_push_task_restarts_total", "Long-running tasks restarted after an exception", ["task"]
)
BACKGROUND_FAILURES = Counter(
    "sigil_push_background_task_failures_total",
    "One-off background tasks (an AUTH answer, a subscription sync, a connection's stop) that"
    " ended with an exception",
    ["task"],
)
BACKOFF_FIRST_SECONDS = 0.1
BACKOFF_MAX_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0
"""A task that ran this long before failing starts its backoff from the beginning again."""


RESTARTING = "restarting after an exception"


class Supervisor:
    """Runs named tasks, restarting each after an exception; `down()` lists core tasks that are
    currently waiting to be restarted or report themselves impaired."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._down: set[str] = set()
        self._impaired: dict[str, str] = {}

    def spawn(
        self, name: str, run: Callable[[], Awaitable[None]], core: bool = False
    ) -> asyncio.Task[None]:
        """Start `run()` as task `name`; it ends only when `run` returns or it is cancelled."""
        task = asyncio.create_task(self._supervise(name, run, core), name=name)
        self._tasks[name] = task
        task.add_done_callback(lambda done: self._forget(name, done))
        return task

    def _forget(self, name: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]
        self._down.discard(name)
        self._impaired.pop(name, None)

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]], core: bool) -> None:
        await _restarting(name, run, self._down if core else None)

    def impaired(self, name: str, reason: str | None) -> None:
        """Task `name` runs but cannot do its work, for `reason` (None: it works again). A
        state, not an event: the task says it once per outage, however often it retries."""
        if reason is None:
            self._impaired.pop(name, None)
        else:
            self._impaired[name] = reason

    def down(self) -> list[str]:
        """Core tasks currently down (between a failure and their restart, or impaired), sorted."""
        return sorted(self._down | self._impaired.keys())

    def reasons(self) -> dict[str, str]:
        """Why each task of `down()` is down, for `/health`."""
        return {name: self._impaired.get(name, RESTARTING) for name in self.down()}

    def running(self, name: str) -> bool:
        return name in self._tasks

    async def cancel(self, name: str) -> None:
        """Cancel one task and wait for it to end."""
        task = self._tasks.get(name)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def stop(self) -> None:
        """Cancel every task and wait for them all."""
        for name in list(self._tasks):
            await self.cancel(name)


def supervise(
    task: str, run: Callable[[], Awaitable[None]], name: str | None = None
) -> asyncio.Task[None]:
    """Start `run()` restarted with backoff after any exception, for tasks that are not core
    loops (one per relay or signer link): counted under the fixed label `task` (never a URL),
    with `name` (default `task`) as the asyncio task's name. Cancel the task to stop it."""
    return asyncio.create_task(_restarting(task, run, None), name=name or task)


async def _restarting(
    name: str, run: Callable[[], Awaitable[None]], down: set[str] | None
) -> None:
    RESTARTS.labels(name)  # pre-bound: the series exists at zero, so alerts and dashboards see it
    delay = BACKOFF_FIRST_SECONDS
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except Exception as exc:  # noqa: BLE001 - the point: nothing may end the task
            RESTARTS.labels(name).inc()
            if time.monotonic() - started >= HEALTHY_AFTER_SECONDS:
                delay = BACKOFF_FIRST_SECONDS
            # the exception's type only: its message may carry event data or a pubkey
            log.error("task %s failed (%s); restarting in %.1f s", name, type(exc).__name__, delay)
        if down is not None:
            down.add(name)
        try:
            await asyncio.sleep(delay)
        finally:
            if down is not None:
                down.discard(name)
        delay = min(BACKOFF_MAX_SECONDS, delay * 2)


class BackgroundTasks:
    """One-off tasks a component starts and does not await: an AUTH answer, a subscription
    sync, a closed connection's stop.

    asyncio keeps only weak references to tasks, so each is held here until it ends. A task
    that fails is not restarted (it was one step, and the component's own loop retries what
    matters), but it must not vanish either: asyncio would report it only when the task is
    garbage-collected, as "exception never retrieved" with a traceback that may carry event
    data. Here the failure is logged at once by its type and counted under the fixed label
    `kind` (never a URL).
    """

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._tasks: set[asyncio.Task[Any]] = set()
        BACKGROUND_FAILURES.labels(kind)  # the series exists at zero

    def spawn(self, coroutine: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            BACKGROUND_FAILURES.labels(self._kind).inc()
            log.error("background task %s failed (%s)", self._kind, type(error).__name__)

    def running(self) -> list[asyncio.Task[Any]]:
        """The tasks not yet ended (a copy: ending tasks leave the set meanwhile)."""
        return list(self._tasks)

    def cancel(self) -> None:
        """Cancel every task still running, without waiting for them."""
        for task in list(self._tasks):
            task.cancel()
