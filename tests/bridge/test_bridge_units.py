"""The bridge's bookkeeping in isolation: shards, baselines, relay lists, relay choice, NIP-11
limits and the persisted dedupe. These are the rules the end-to-end tests rely on, checked
case by case where a real relay could not force the situation."""

from __future__ import annotations

import itertools

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip77 import SortedItems
from sigil_push.relays.discovery import RelayLists, normalize_relay_url, relays_in_list
from sigil_push.relays.nip11 import RelayLimits, parse_limits
from sigil_push.relays.nip77 import _slices
from sigil_push.relays.pool import RelayPlan
from sigil_push.relays.subscriptions import (
    MAX_PAGES_PER_CATCHUP,
    PAGES_IN_FLIGHT,
    RelaySubscriptions,
)
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.seen import SeenEvents
from testkit.stores import seen_rows, sql_of

KEYS = [f"{i:064x}" for i in range(1, 8)]


def test_a_new_key_changes_exactly_one_shard() -> None:
    """Registering or unregistering one key re-requests only its shard; the others stay."""
    subs = RelaySubscriptions(keys_per_filter=2, with_lists=False)
    for key in KEYS[:5]:
        subs.add(key)
    first = {r.sub_id: r for r in subs.due(100, 200)}
    assert len(first) == 3
    for sub_id in first:
        subs.eose(sub_id)

    subs.remove(KEYS[2])
    changed = subs.due(100, 200)
    assert len(changed) == 1 and changed[0].close is not None and changed[0].close in first

    subs.add(KEYS[5])
    added = subs.due(100, 200)
    assert len(added) == 1
    assert added[0].filters[0]["#p"].count(KEYS[5]) == 1


def test_events_before_eose_of_a_keys_first_req_are_baseline() -> None:
    """Pre-EOSE events for a fresh key are baseline; after EOSE, and for keys already
    baselined, they are pushed. A replaced REQ's late frames keep their own classification."""
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    assert req.fresh and req.filters[0]["since"] == 100
    assert subs.is_baseline(req.sub_id, KEYS[0])
    assert subs.eose(req.sub_id) == ({KEYS[0]}, [])
    assert not subs.is_baseline(req.sub_id, KEYS[0])

    subs.add(KEYS[1])
    (second,) = subs.due(100, 200)
    assert second.close == req.sub_id
    assert subs.is_baseline(second.sub_id, KEYS[1])
    assert not subs.is_baseline(second.sub_id, KEYS[0]), "catch-up of a baselined key is pushed"


def _ids(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(1000 + n * 100, 1000 + n * 100 + 50)]


def test_every_answer_is_paged_until_a_page_adds_nothing_new() -> None:
    """No NIP-11 limit at all: each DM filter that returned events is asked again with
    `until` = its oldest `created_at` (still as baseline for a fresh key) until a page adds
    nothing new; the key is baselined after the last page only."""
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    ids = _ids(0)
    subs.stored(req.sub_id, ids[0], 4, 500)
    subs.stored(req.sub_id, ids[1], 4, 400)
    newly, (page,) = subs.eose(req.sub_id)
    assert newly == frozenset()
    assert page.close is None, "the live REQ stays open"
    assert page.page and page.sub_id is not None
    assert page.filters == [{"kinds": [4], "#p": [KEYS[0]], "since": 100, "until": 400}], (
        "only the filter that returned events pages; the gift wraps' answer was empty"
    )
    assert subs.is_baseline(page.sub_id, KEYS[0]) and not subs.live

    subs.stored(page.sub_id, ids[1], 4, 400)  # the boundary again: not new
    subs.stored(page.sub_id, ids[2], 4, 300)
    newly, requests = subs.eose(page.sub_id)
    assert [r.close for r in requests] == [page.sub_id, None], "the finished page is closed"
    next_page = requests[1]
    assert newly == frozenset() and next_page.filters[0]["until"] == 300

    subs.stored(next_page.sub_id, ids[2], 4, 300)
    newly, (close,) = subs.eose(next_page.sub_id)
    assert newly == {KEYS[0]}
    assert close.close == next_page.sub_id and close.sub_id is None
    assert subs.live


def test_each_dm_filter_pages_from_its_own_oldest_event() -> None:
    """A relay caps each filter on its own: the kind 4 answer reached back to 150 while the
    gift wraps' stopped at 900 (the cap); the gift wraps page from 900, not from 150, so the
    back-dated wraps between are not skipped. A published max_limit only sizes the pages."""
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.apply_limits(RelayLimits(max_limit=2))
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    ids = _ids(1)
    subs.stored(req.sub_id, ids[0], 4, 150)
    subs.stored(req.sub_id, ids[1], 1059, 950)
    subs.stored(req.sub_id, ids[2], 1059, 900)
    _, (page,) = subs.eose(req.sub_id)
    until = {tuple(f["kinds"]): f["until"] for f in page.filters}
    assert until == {(4,): 150, (1059,): 900}
    assert all(f["limit"] == 2 for f in page.filters)


def test_equal_timestamps_at_a_page_boundary_are_not_lost_nor_looped() -> None:
    """Three events share the boundary second: the next page returns two of them again and
    a third one at that second, which is new; a page of only known boundary ids ends it."""
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    a, b, c = _ids(2)[:3]
    subs.stored(req.sub_id, a, 4, 300)
    subs.stored(req.sub_id, b, 4, 300)
    _, (page,) = subs.eose(req.sub_id)
    assert page.filters[0]["until"] == 300
    for event_id in (a, b, c):
        subs.stored(page.sub_id, event_id, 4, 300)
    _, (_, again) = subs.eose(page.sub_id)
    assert again.sub_id is not None and again.filters[0]["until"] == 300, "c was new"
    for event_id in (a, b, c):
        subs.stored(again.sub_id, event_id, 4, 300)
    newly, requests = subs.eose(again.sub_id)
    assert newly == {KEYS[0]} and [(r.close, r.sub_id) for r in requests] == [(again.sub_id, None)]


def test_pages_in_flight_are_bounded_per_relay_and_pages_per_shard() -> None:
    """With many shards paging at once, at most PAGES_IN_FLIGHT pages are open on the relay;
    the others wait and go out as pages finish. A shard stops paging at the cap."""
    subs = RelaySubscriptions(keys_per_filter=1, with_lists=False)
    for key in KEYS[:6]:
        subs.add(key)
    requests = subs.due(100, 200)
    pages = []
    for n, req in enumerate(requests):
        assert req.sub_id is not None
        subs.stored(req.sub_id, _ids(3)[n], 4, 500)
        pages.extend(subs.eose(req.sub_id)[1])
    assert len(pages) == PAGES_IN_FLIGHT and subs.pages_waiting == 6 - PAGES_IN_FLIGHT
    assert not subs.live
    _, after = subs.eose(pages[0].sub_id or "")
    assert after[0].close == pages[0].sub_id
    assert sum(1 for r in after if r.page) == 1, "a waiting page took the freed room"

    capped = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    capped.add(KEYS[0])
    (req,) = capped.due(100, 200)
    sub_id, created_at = req.sub_id or "", 10_000
    for n in range(MAX_PAGES_PER_CATCHUP + 1):
        created_at -= 1
        capped.stored(sub_id, f"{n:064x}", 4, created_at)
        _, follow = capped.eose(sub_id)
        nxt = [r for r in follow if r.page]
        if not nxt:
            break
        sub_id = nxt[0].sub_id or ""
    assert n == MAX_PAGES_PER_CATCHUP and capped.take_capped() == 1 and capped.live


def test_a_reconnect_catches_up_from_the_cursor_when_every_key_is_baselined() -> None:
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    subs.eose(req.sub_id)
    subs.connection_lost()
    (again,) = subs.due(100, 200)
    assert not again.fresh and again.close is None
    assert again.filters[0]["since"] == 200


def test_a_closed_req_keeps_its_keys_fresh_and_the_relay_not_live() -> None:
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    subs.closed(req.sub_id)
    assert not subs.live
    assert subs.is_baseline("unknown", KEYS[0])


def test_nip11_limits_shrink_shards_and_merge_filters() -> None:
    """A relay's max message length bounds the keys per REQ; max_filters merges the kinds."""
    subs = RelaySubscriptions(keys_per_filter=500, with_lists=True)
    for key in KEYS:
        subs.add(key)
    subs.apply_limits(RelayLimits(max_message_length=512 + 3 * 67 * 2, max_filters=2))
    subs.follows.add(KEYS[0])
    requests = subs.due(100, 200, 300)
    shards = requests
    assert len(shards) == 4
    assert all(len(r.filters) == 2 for r in shards)
    assert shards[0].filters[0]["kinds"] == [4, 1059]
    # one room for lists: one filter, with kind 3 since a key of the shard is follows-only,
    # whole since its keys are new here
    assert shards[0].filters[1] == {
        "kinds": [10050, 10002, 10000, 3],
        "authors": shards[0].filters[0]["#p"],
    }
    assert shards[1].filters[1]["kinds"] == [10050, 10002, 10000]


def test_a_relays_subscription_limit_grows_shards_then_leaves_keys_out() -> None:
    """With room for 2 subscriptions (one kept spare), shards grow up to the message size
    limit; keys beyond that wait unsubscribed and move in when a key leaves."""
    subs = RelaySubscriptions(keys_per_filter=1, with_lists=False)
    subs.apply_limits(RelayLimits(max_subscriptions=2, max_message_length=512 + 2 * 67 * 3))
    for key in KEYS[:5]:
        subs.add(key)
    assert len(subs.shards) == 1 and len(subs.keys) == 3
    assert subs.overflow == set(KEYS[3:5])
    subs.remove(KEYS[0])
    assert len(subs.keys) == 3 and len(subs.overflow) == 1


def test_a_freed_place_in_an_early_shard_is_filled_first() -> None:
    """Keys fill shards in order, and a key that leaves an early, full shard makes room there
    for the next key (only the shard with room changes), however many shards follow."""
    subs = RelaySubscriptions(keys_per_filter=2, with_lists=False)
    keys = [f"{i:064x}" for i in range(9)]
    for key in keys[:8]:
        subs.add(key)
    assert [len(shard.keys) for shard in subs.shards] == [2, 2, 2, 2]
    subs.remove(keys[2])
    for shard in subs.shards:
        shard.dirty = False
    subs.add(keys[8])
    assert subs.shard_of[keys[8]] == 1
    assert [shard.dirty for shard in subs.shards] == [False, True, False, False]
    subs.add(f"{99:064x}")
    assert len(subs.shards) == 5


def test_parse_limits_ignores_malformed_documents() -> None:
    assert parse_limits(
        {"limitation": {"max_subscriptions": 20, "max_filters": "x"}}
    ) == RelayLimits(max_subscriptions=20)
    assert parse_limits(["not", "a", "document"]) == RelayLimits()


def test_user_relay_urls_are_canonical_and_secure() -> None:
    assert normalize_relay_url("wss://Relay.Example.com/", False) == "wss://relay.example.com"
    assert normalize_relay_url("ws://relay.example.com", False) is None
    assert normalize_relay_url("ws://127.0.0.1:7000", True) == "ws://127.0.0.1:7000"
    assert normalize_relay_url("wss://user:pw@relay.example.com", False) is None
    assert normalize_relay_url("https://relay.example.com", False) is None
    assert normalize_relay_url("wss://relay.example.com:99999", False) is None


def test_relay_lists_prefer_kind_10050_and_keep_the_newest() -> None:
    owner = SecretKey.generate()
    general = sign_event(
        owner, 10002, "", [["r", "wss://read.example"], ["r", "wss://write.example", "write"]], 10
    )
    dm = sign_event(
        owner, 10050, "", [["relay", "wss://inbox.example"], ["relay", "ws://insecure.example"]], 20
    )
    older_dm = sign_event(owner, 10050, "", [["relay", "wss://old.example"]], 5)
    assert relays_in_list(general, False) == ("wss://read.example",)

    lists = RelayLists(state=None, allow_insecure=False)  # type: ignore[arg-type]
    assert lists.offer(general)
    assert lists.relays_of(owner.public_key_hex) == ("wss://read.example",)
    assert lists.offer(dm)
    assert lists.relays_of(owner.public_key_hex) == ("wss://inbox.example",)
    assert not lists.offer(older_dm)
    assert lists.relays_of(owner.public_key_hex) == ("wss://inbox.example",)


def test_the_relay_cap_keeps_the_most_wanted_and_reports_the_rest() -> None:
    plan = RelayPlan(["wss://configured.example"], max_relays=2)
    plan.set_key(KEYS[0], ["wss://popular.example", "wss://rare.example"])
    plan.set_key(KEYS[1], ["wss://popular.example", "wss://configured.example"])
    assert plan.choose() == ["wss://configured.example", "wss://popular.example"]
    assert plan.skipped == {"wss://rare.example": 1}
    plan.remove_key(KEYS[0])
    assert plan.choose() == ["wss://configured.example", "wss://popular.example"]
    assert plan.skipped == {}


def test_the_plan_holds_nothing_for_keys_without_relays_of_their_own() -> None:
    """Most keys name no relay (or only configured ones): the plan keeps no entry for them, so
    a million such keys cost it nothing; a key that drops its last own relay leaves no trace,
    and its inbox relay loses its vote."""
    plan = RelayPlan(["wss://configured.example"], max_relays=3)
    plan.set_key(KEYS[0], ())
    plan.set_key(KEYS[1], ["wss://configured.example"], ["wss://configured.example"])
    plan.set_key(KEYS[2], ["wss://inbox.example", "wss://other.example"], ["wss://inbox.example"])
    plan.set_key(KEYS[3], ["wss://other.example"])
    assert plan.own_relays.keys() == {KEYS[2], KEYS[3]} and plan.inbox.keys() == {KEYS[2]}
    assert plan.choose()[1] == "wss://inbox.example"

    plan.set_key(KEYS[2], ["wss://configured.example"], ["wss://configured.example"])
    assert plan.own_relays.keys() == {KEYS[3]} and plan.inbox == {}
    assert plan.choose() == ["wss://configured.example", "wss://other.example"]
    assert plan.demand == {"wss://other.example": {KEYS[3]}}


async def test_seen_events_survive_a_restart_and_memory_stays_bounded(
    store: SqliteStore | PostgresStore,
) -> None:
    """Ids saved by one instance are known to the next, with every relay that delivered them
    (those of the first batch share the id's row); the cache never exceeds its size; pruning
    forgets only ids past retention. On each engine."""
    db, rows = sql_of(store), seen_rows(store)
    seen = SeenEvents(rows, retention_seconds=1000, cache_size=2)
    await seen.lookup(KEYS[:3])
    pending: dict[str, tuple[str, ...]] = {}
    for key in KEYS[:3]:
        assert seen.first_delivery(key, "wss://a", pending) == (True, True)
    assert len(seen) == 0, "nothing is remembered before its write succeeds"
    seen.remember(pending)
    assert len(seen) == 2
    # KEYS[1] came from two relays in the batch that first handled it: one row lists both
    relays = {KEYS[1]: ("wss://a", "wss://c")}
    await seen.save([(k, relays.get(k, ("wss://a",)), 1_000_000, 1000) for k in KEYS[:3]], [])

    restarted = SeenEvents(rows, retention_seconds=1000, cache_size=10)
    await restarted.load()
    assert restarted.delivered_by(KEYS[0], "wss://a")
    assert not restarted.delivered_by(KEYS[0], "wss://c")
    assert restarted.delivered_by(KEYS[1], "wss://a") and restarted.delivered_by(KEYS[1], "wss://c")
    looked_up = SeenEvents(rows, retention_seconds=1000, cache_size=10)
    await looked_up.lookup([KEYS[1]])
    assert looked_up.first_delivery(KEYS[1], "wss://c", {}) == (False, False)
    assert restarted.first_delivery(KEYS[0], "wss://b", {}) == (False, True)
    await restarted.save([], [(KEYS[0], "wss://b"), (KEYS[0], "wss://c"), (KEYS[0], "wss://b")])
    row = await db.execute_fetchall(
        "SELECT relay FROM seen_events WHERE event_id = ?", (bytes.fromhex(KEYS[0]),)
    )
    assert list(row) == [("wss://a wss://b wss://c",)], "further relays appended to its row once"
    again = SeenEvents(rows, retention_seconds=1000, cache_size=10)
    await again.lookup([KEYS[0]])
    assert all(again.delivered_by(KEYS[0], r) for r in ("wss://a", "wss://b", "wss://c"))
    # further relays recorded before they were appended in place are still read (by a store
    # opened on them: no release writes them any more, so one found without them skips them)
    await db.execute(
        "INSERT INTO seen_on_relay (event_id, relay, keep_until) VALUES (?, ?, ?)",
        (KEYS[2], "wss://d wss://e", 2000),
    )
    legacy = SeenEvents(seen_rows(store), retention_seconds=1000, cache_size=10)
    await legacy.lookup([KEYS[2]])
    assert all(legacy.delivered_by(KEYS[2], r) for r in ("wss://a", "wss://d", "wss://e"))
    assert await restarted.prune(now=1999) == 0
    assert await restarted.prune(now=2001) == 3


def test_a_large_negentropy_window_is_reconciled_in_slices_that_cover_it_once() -> None:
    """Relays bound one reconciliation's set: more items than a slice holds cut the window
    at whole seconds, each item in exactly one slice (adjacent index ranges of the sorted
    items), the slices back to back from `since` to now (the last one open-ended)."""
    kept = SortedItems()
    kept.add({f"{i:064x}": 1_000 + i // 3 for i in range(100)})  # three per second
    slices = _slices(kept, {"kinds": [4, 1059], "since": 900}, 30)
    assert len(slices) == 4
    assert [lower for _, lower, _ in slices] == [0, *(upper for _, _, upper in slices[:-1])]
    assert slices[-1][2] == len(kept)
    windows = [(window["since"], window.get("until")) for window, _, _ in slices]
    assert windows[0][0] == 900 and windows[-1][1] is None
    for (_, until), (since, _) in itertools.pairwise(windows):
        assert until is not None and since == until + 1
    for window, lower, upper in slices:
        assert all(window["since"] <= t <= window.get("until", t)
                   for t, _, _ in kept.keys[lower:upper])
    assert _slices(kept, {"since": 1}, 100) == [({"since": 1}, 0, 100)]
