"""Negentropy catch-up costs CPU for what is new, not for the window (issue 24): the nostr-sdk
items a reconciliation offers are built once per relay and kept across catch-ups and
reconnects (relays/nip77.py), bounded by the window and counted in sigil_push_memory_entries.
Against rust-nostr's relay (NIP-77)."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from sigil_push.relays.nip77 import Reconciler
from tests.support.nostr_client import hex_of, kind4_dm, user
from tests.support.rust_relay import RustRelay


def _kept_gauge() -> float:
    value = REGISTRY.get_sample_value(
        "sigil_push_memory_entries", {"structure": "negentropy_items"}
    )
    assert value is not None
    return value


async def test_a_second_reconciliation_builds_only_the_new_items() -> None:
    """Three DMs on the relay, two of them already had: the first catch-up builds two items
    and finds the third missing; the next, with the third now had too, builds only that one
    (the first two are kept, also across the socket closing in between); items that fall out
    of the window are forgotten, and the gauge follows."""
    sender, recipient = user(), user()
    now = int(time.time())
    dms = [kind4_dm(sender, recipient, f"dm {n}", now - 100 + n) for n in range(3)]
    async with RustRelay() as relay:
        await relay.publish(*dms)
        reconciler = Reconciler(relay.url)
        query = {"kinds": [4, 1059], "since": now - 3600}
        had = {dm["id"]: dm["created_at"] for dm in dms[:2]}
        try:
            assert await reconciler.missing(query, had) == [dms[2]["id"]]
            assert reconciler.converted_now == 2
        finally:
            await reconciler.close()
        assert _kept_gauge() >= 2

        had[dms[2]["id"]] = dms[2]["created_at"]
        try:
            assert await reconciler.missing(query, had) == []
            assert reconciler.converted_now == 1
            assert await reconciler.missing(query, had) == []
            assert reconciler.converted_now == 0
            keyed = {**query, "#p": [hex_of(recipient)]}
            assert await reconciler.missing(keyed, had) == []
            assert reconciler.converted_now == 0

            # the window moves past the first DM: it is forgotten from the kept set
            later = {**query, "since": dms[0]["created_at"] + 1}
            del had[dms[0]["id"]]
            assert await reconciler.missing(later, had) == []
            assert reconciler.converted_now == 0
            assert set(reconciler._converted) == set(had)
        finally:
            await reconciler.close()
