"""The bridge's bookkeeping in isolation: shards, baselines, relay lists, relay choice, NIP-11
limits and the persisted dedupe. These are the rules the end-to-end tests rely on, checked
case by case where a real relay could not force the situation."""

from __future__ import annotations

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.relays.discovery import RelayLists, normalize_relay_url, relays_in_list
from sigil_push.relays.nip11 import RelayLimits, parse_limits
from sigil_push.relays.pool import RelayPlan
from sigil_push.relays.subscriptions import RelaySubscriptions
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.seen import SeenEvents
from tests.support.stores import seen_rows, sql_of

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
    assert subs.eose(req.sub_id) == ({KEYS[0]}, None)
    assert not subs.is_baseline(req.sub_id, KEYS[0])

    subs.add(KEYS[1])
    (second,) = subs.due(100, 200)
    assert second.close == req.sub_id
    assert subs.is_baseline(second.sub_id, KEYS[1])
    assert not subs.is_baseline(second.sub_id, KEYS[0]), "catch-up of a baselined key is pushed"


def test_an_answer_cut_by_the_relays_max_limit_is_paged_before_the_baseline() -> None:
    """When a relay returns as many stored events as its NIP-11 max_limit, the older ones are
    asked for with `until`, still as baseline; the key is baselined after the last page only."""
    subs = RelaySubscriptions(keys_per_filter=10, with_lists=False)
    subs.apply_limits(RelayLimits(max_limit=2))
    subs.add(KEYS[0])
    (req,) = subs.due(100, 200)
    subs.stored(req.sub_id, 500)
    subs.stored(req.sub_id, 400)
    newly, page = subs.eose(req.sub_id)
    assert newly == frozenset() and page is not None
    assert page.close is None, "the live REQ stays open"
    assert page.sub_id is not None and page.filters[0]["until"] == 400
    assert page.filters[0]["since"] == 100
    assert subs.is_baseline(page.sub_id, KEYS[0]) and not subs.live

    subs.stored(page.sub_id, 300)
    newly, last = subs.eose(page.sub_id)
    assert newly == {KEYS[0]}
    assert last is not None and last.close == page.sub_id and last.sub_id is None
    assert subs.live


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
    requests = subs.due(100, 200)
    assert len(requests) == 4
    assert all(len(r.filters) == 2 for r in requests)
    assert requests[0].filters[0]["kinds"] == [4, 1059]
    assert requests[0].filters[1] == {
        "kinds": [10050, 10002, 10000, 3],
        "authors": requests[0].filters[0]["#p"],
    }


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
    row = await db.execute_fetchall("SELECT relay FROM seen_events WHERE event_id = ?", (KEYS[0],))
    assert list(row) == [("wss://a wss://b wss://c",)], "further relays appended to its row once"
    again = SeenEvents(rows, retention_seconds=1000, cache_size=10)
    await again.lookup([KEYS[0]])
    assert all(again.delivered_by(KEYS[0], r) for r in ("wss://a", "wss://b", "wss://c"))
    # further relays recorded before they were appended in place are still read
    await db.execute(
        "INSERT INTO seen_on_relay (event_id, relay, keep_until) VALUES (?, ?, ?)",
        (KEYS[2], "wss://d wss://e", 2000),
    )
    legacy = SeenEvents(rows, retention_seconds=1000, cache_size=10)
    await legacy.lookup([KEYS[2]])
    assert all(legacy.delivered_by(KEYS[2], r) for r in ("wss://a", "wss://d", "wss://e"))
    assert await restarted.prune(now=1999) == 0
    assert await restarted.prune(now=2001) == 3
