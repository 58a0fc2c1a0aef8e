"""Issue 34, item 1: NIP-77 from a relay a user named cannot freeze the process. A relay
answered NEG-OPEN with messages of 630,000 Skip ranges (and one mismatch to keep going),
4 s of event-loop CPU each, round after round, and ended cleanly before the timeout, so it
was never marked as lacking NIP-77: `/health` went from 2 ms to a p50 of 3.3 s.

The hostile relay (tests/adversarial/negentropy_flooder.py) runs in its own thread. Against
our reconciler in the test's loop and against `sigil-push serve`: a message bigger than the
frame cap, or with more ranges than our previous message could produce, ends the exchange
(`violation`) after bounded work; an exchange that stays within those bounds but never ends
spends the relay's budget (`budget`); either way the relay falls back to paged REQ, is
counted, and the loop keeps turning."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Self

import httpx
import pytest

from sigil_push.nostr.nip77 import BUCKETS, STEP_UNITS
from sigil_push.relays.budget import RangeBudget
from sigil_push.relays.nip77 import NegentropyFailed, Reconciler
from testkit.bridge_harness import metric
from testkit.deadlines import REQUEST_SECONDS, scaled, wait_until
from testkit.nip98 import SdkUser
from testkit.processes import FAST_RECONNECT
from testkit.service import ServiceProcess
from tests.adversarial.negentropy_flooder import (
    NegentropyFlooder,
    mismatches,
    skips_then_a_mismatch,
)
from tests.conftest import ApiCaller

QUERY = {"kinds": [4, 1059], "since": 0}


def _items(count: int = 20_000) -> dict[str, int]:
    return {f"{n:064x}": 1_700_000_000 + n // 3 for n in range(1, count + 1)}


class LoopLag:
    """The longest the event loop went without running a 5 ms ticker, while it runs."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - 0.005)
            last = now


async def _fails(reconciler: Reconciler, items: dict[str, int]) -> str:
    with pytest.raises(NegentropyFailed) as failure:
        await reconciler.missing(QUERY, items)
    await reconciler.close()
    return failure.value.reason


async def test_more_ranges_than_our_message_could_produce_end_the_exchange_at_once() -> None:
    """170,000 Skip ranges (half a megabyte, under the frame cap) in answer to our sixteen
    fingerprints: refused after at most the ranges an honest answer could hold, while the
    loop keeps turning (the message was seconds of CPU in one pass)."""
    flooder = NegentropyFlooder(lambda: skips_then_a_mismatch(170_000)).start()
    try:
        reconciler = Reconciler(flooder.url)
        async with LoopLag() as lag:  # few items of ours: sorting them is not the relay's doing
            assert await _fails(reconciler, _items(2_000)) == "violation"
        assert reconciler.work <= (BUCKETS + 1) * 16 + 2 + STEP_UNITS
        assert lag.worst < 0.5, lag.worst
        assert flooder.sent("NEG-MSG") == [], "no answer to a message refused"
    finally:
        flooder.stop()


async def test_a_message_over_the_frame_cap_is_refused_unread() -> None:
    """The measured attack's own size (630,000 ranges, 3.8 MB as hex): over the frame cap,
    the socket closes before a byte of it is decoded."""
    flooder = NegentropyFlooder(lambda: skips_then_a_mismatch(630_000)).start()
    try:
        reconciler = Reconciler(flooder.url)
        assert await _fails(reconciler, _items(100)) == "violation"
        assert reconciler.work == 0
    finally:
        flooder.stop()


async def test_an_exchange_that_never_ends_spends_the_relays_budget() -> None:
    """Every round the same sixteen differing fingerprints, as honest-looking as can be: each
    round is within bounds, so only the relay's budget ends it, with the work it allowed
    (and a reconnect does not buy a new one)."""
    items = _items()
    times = sorted(items.values())
    bounds = [times[n * len(times) // 17] for n in range(1, 17)]
    flooder = NegentropyFlooder(lambda: mismatches(bounds)).start()
    try:
        reconciler = Reconciler(flooder.url)
        reconciler.budget = RangeBudget(burst=3_000, per_second=0.0)
        assert await _fails(reconciler, items) == "budget"
        spent = reconciler.work
        assert 3_000 <= spent <= 3_000 + STEP_UNITS + BUCKETS + 1
        assert len(flooder.sent("NEG-MSG")) < 20, "a few rounds, not MAX_ROUNDS"
        assert await _fails(reconciler, items) == "budget"
        assert reconciler.work - spent <= STEP_UNITS + BUCKETS + 1
    finally:
        flooder.stop()


@pytest.mark.slow
def test_a_user_relay_flooding_nip77_leaves_health_fast_and_falls_back(tmp_path: Path) -> None:
    """Against `sigil-push serve`: a user names the flooding relay at registration. Once the
    key is baselined there, the relay drops the connection, so the reconnect's catch-up tries
    NIP-77. The service refuses its NEG-MSG, counts the fallback, asks it by paged REQ
    instead, and answers `/health` quickly throughout (p50 of 3.3 s before)."""
    flooder = NegentropyFlooder(lambda: skips_then_a_mismatch(630_000), drop_first=True).start()
    try:
        with ServiceProcess(tmp_path / "svc", extra_toml=FAST_RECONNECT) as service, httpx.Client(
            base_url=service.url, timeout=scaled(REQUEST_SECONDS)
        ) as http:
            api = ApiCaller(http, service.url)
            assert api.register(SdkUser(), relays=[flooder.url]).status_code == 201
            wait_until(lambda: flooder.sent("NEG-OPEN"), "the service trying NIP-77 there")
            latencies = []
            for _ in range(15):
                started = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
            wait_until(lambda: metric(service, "sigil_push_catchup_fallbacks_total", reason="violation"),
                       "the violation counted")
            assert statistics.median(latencies) < 0.5, latencies
            opened = flooder.received.index(flooder.sent("NEG-OPEN")[0])
            # the fallback is counted before its first page is asked for: wait for the REQ
            wait_until(lambda: any(frame[0] == "REQ" for frame in flooder.received[opened:]),
                       "a paged REQ after the NEG-OPEN")
            assert flooder.sent("NEG-MSG") == []
            assert len(flooder.sent("NEG-OPEN")) == 1
    finally:
        flooder.stop()
