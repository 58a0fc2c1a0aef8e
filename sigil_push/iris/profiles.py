"""Authors' names and pictures for Iris pushes: their kind 0, fetched on demand.

A push's title names the author when their kind 0 is known; nothing else needs it, so it is
fetched only when a push is about to go, from the relay the event came from (the one place
known to have the author's events), through the outbound guard like every relay socket.
Answers are cached (authors with no kind 0 too), the cache and the fetches in flight are
bounded, and a push waits at most `WAIT_SECONDS` for a name: a slow relay costs a push its
name, never its delivery. A fetch that outlives the wait still fills the cache for the next
push, within its own deadline.

A relay is attacker-controlled: only a kind 0 of the author whose id and signature verify is
read, frames are bounded in size and number, and what the profile says is bounded
(`payload.profile_of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict

import orjson
from prometheus_client import Counter

from sigil_push.iris.payload import UNKNOWN_PROFILE, Profile, profile_of
from sigil_push.nostr.event import Event, InvalidEvent
from sigil_push.nostr.kinds import METADATA
from sigil_push.outbound import OutboundGuard, open_relay_socket
from sigil_push.telemetry.memory_gauges import track
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

WAIT_SECONDS = 1.0
"""The longest a push waits for its author's name (CONTRACT 3b: never more than a second)."""
FETCH_SECONDS = 5.0
CACHE_SECONDS = 3600.0
MAX_CACHED = 10_000
MAX_FETCHES = 16
MAX_FRAMES = 20
MAX_FRAME_BYTES = 128 * 1024

LOOKUPS = Counter(
    "sigil_push_iris_profile_lookups_total",
    "Author names looked up for Iris pushes, by result",
    ["result"],
)
RESULTS = ("cached", "fetched", "not_found", "late", "busy", "failed")
_BY_RESULT = {result: LOOKUPS.labels(result) for result in RESULTS}


class Profiles:
    """The authors' profiles cache, keyed by hex pubkey, with the fetches in flight."""

    def __init__(
        self,
        wait_seconds: float = WAIT_SECONDS,
        fetch_seconds: float = FETCH_SECONDS,
        guard: OutboundGuard | None = None,
    ) -> None:
        self._wait = wait_seconds
        self._fetch_seconds = fetch_seconds
        self._guard = guard
        self._cache: OrderedDict[str, tuple[Profile, float]] = OrderedDict()
        self._fetching: dict[str, asyncio.Task[Profile]] = {}
        track("iris_profiles", self, lambda p: len(p._cache))

    async def lookup(self, author: str, relay: str) -> Profile:
        """The author's profile, or UNKNOWN_PROFILE when it is not known within the wait."""
        cached = self._cache.get(author)
        if cached is not None and cached[1] > time.monotonic():
            self._cache.move_to_end(author)
            _BY_RESULT["cached"].inc()
            return cached[0]
        task = self._fetching.get(author)
        if task is None:
            if len(self._fetching) >= MAX_FETCHES or not relay.startswith(("wss://", "ws://")):
                _BY_RESULT["busy"].inc()
                return UNKNOWN_PROFILE
            task = asyncio.create_task(self._fetch(author, relay), name="iris profile")
            self._fetching[author] = task
            task.add_done_callback(lambda _: self._fetching.pop(author, None))
        try:
            async with asyncio.timeout(self._wait):
                profile = await asyncio.shield(task)
        except TimeoutError:
            _BY_RESULT["late"].inc()
            return UNKNOWN_PROFILE
        _BY_RESULT["fetched" if profile is not UNKNOWN_PROFILE else "not_found"].inc()
        return profile

    async def _fetch(self, author: str, relay: str) -> Profile:
        profile = UNKNOWN_PROFILE
        try:
            async with asyncio.timeout(self._fetch_seconds):
                profile = await self._request(author, relay)
        except Exception as exc:  # a relay's failure costs a name, counted
            _BY_RESULT["failed"].inc()
            log.debug("profile fetch failed", exc_info=withheld(exc))
        self._cache[author] = (profile, time.monotonic() + CACHE_SECONDS)
        self._cache.move_to_end(author)
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return profile

    async def _request(self, author: str, relay: str) -> Profile:
        """The newest verified kind 0 of `author` that `relay` returns before EOSE."""
        subscription = "p" + secrets.token_hex(4)
        newest: Event | None = None
        async with open_relay_socket(
            relay, self._guard, purpose="profiles", open_timeout=self._fetch_seconds,
            max_size=MAX_FRAME_BYTES, compression=None, user_agent_header="sigil-push",
        ) as ws:
            request = ["REQ", subscription, {"kinds": [METADATA], "authors": [author], "limit": 1}]
            await ws.send(orjson.dumps(request).decode())
            for _ in range(MAX_FRAMES):
                message = orjson.loads(await ws.recv())
                if not isinstance(message, list) or len(message) < 2 or message[1] != subscription:
                    continue
                if message[0] in ("EOSE", "CLOSED"):
                    break
                if message[0] != "EVENT" or len(message) < 3:
                    continue
                try:
                    event = Event.from_json(message[2])
                    if event.kind != METADATA or event.pubkey != author:
                        continue
                    event.verify()
                except InvalidEvent:
                    continue
                if newest is None or event.created_at > newest.created_at:
                    newest = event
            with contextlib.suppress(Exception):
                await ws.send(orjson.dumps(["CLOSE", subscription]).decode())
        return UNKNOWN_PROFILE if newest is None else profile_of(newest.content)

    async def close(self) -> None:
        """Cancel the fetches in flight."""
        tasks = list(self._fetching.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
