"""The REQs of indexed watches (Iris subscriptions) on one relay (`relays/watch_requests.py`),
without a socket: keys grouped by the kinds they want, cut to the relay's limits, a firehose
asking by kinds only, freshness kinds reaching back `stale_after` only, and a plan change
replacing the relay's REQs (new ones first, then the old ones closed)."""

from __future__ import annotations

import time

from sigil_push.relays.nip11 import RelayLimits
from sigil_push.relays.subscriptions import Request
from sigil_push.relays.watch_requests import (
    EOSE_TIMEOUT_SECONDS,
    MAX_PAGES_PER_FILTER,
    PAGES_IN_FLIGHT,
    RelayWatches,
    WatchPlan,
)

HOUR, WINDOW = 3600, 2 * 86_400
ME, SESSION, OTHER = "aa" * 32, "bb" * 32, "cc" * 32
MENTIONS = frozenset({1, 6, 7, 9735})
MESSAGES = frozenset({1060})


def keys(count: int, start: int = 1) -> list[str]:
    return [f"{n:064x}" for n in range(start, start + count)]


def _live(requests: list[Request]) -> list[Request]:
    """The live REQs and CLOSEs among `requests` (not the catch-up pages)."""
    return [r for r in requests if not r.page]


def _answer(watches: RelayWatches, requests: list[Request]) -> None:
    """The relay answers every REQ among `requests` in full (EOSE, no stored event), and the
    pages sent meanwhile, until nothing more is asked."""
    while requests:
        follow_ups: list[Request] = []
        for request in requests:
            if request.sub_id is not None:
                follow_ups += watches.eose(request.sub_id)
        requests = [r for r in follow_ups if r.sub_id is not None]


def test_keys_are_asked_by_index_and_kinds_with_their_own_reach_back() -> None:
    plan = WatchPlan()
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    assert watches.due(0, False) == []  # nothing planned: no REQ at all
    assert plan.replace({ME: MENTIONS}, {SESSION: MESSAGES, OTHER: None})
    now = int(time.time())
    [request] = _live(watches.due(now - WINDOW - 100, False))
    assert request.close is None and request.sub_id is not None and watches.owns(request.sub_id)
    by_key = {next(k for k in f if k in ("#p", "authors")): f for f in request.filters}
    assert set(by_key) == {"#p", "authors"}
    mentions = next(f for f in request.filters if "#p" in f)
    assert mentions["#p"] == [ME] and mentions["kinds"] == [1, 6, 7, 9735]
    assert mentions["since"] >= now - HOUR  # mentions and the like: `stale_after` back only
    authored = sorted((f for f in request.filters if "authors" in f), key=lambda f: "kinds" in f)
    # any kind; the live REQ asks new events only, its window is caught up by pages
    assert authored[0] == {"authors": [OTHER], "since": authored[0]["since"], "limit": 0}
    assert authored[1]["kinds"] == [1060] and authored[1]["authors"] == [SESSION]
    assert now - WINDOW <= authored[1]["since"] < now - HOUR  # as far back as DMs
    assert watches.due(now, False) == []  # in line with the plan: nothing to send


def test_a_plan_change_replaces_the_relays_requests_new_first() -> None:
    plan = WatchPlan()
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    plan.replace({ME: MENTIONS}, {})
    [first] = _live(watches.due(0, False))
    assert not plan.replace({ME: MENTIONS}, {})  # the same keys: no new version
    plan.replace({ME: MENTIONS}, {SESSION: MESSAGES})
    opened, closed = _live(watches.due(0, False))[:2]
    assert opened.sub_id != first.sub_id and opened.close is None
    assert closed.sub_id is None and closed.close == first.sub_id
    plan.replace({}, {})
    gone = _live(watches.due(0, False))
    assert opened.sub_id in [r.close for r in gone] and watches.subscription_count == 0
    # a lost connection sends everything again once it is back
    plan.replace({ME: MENTIONS}, {})
    watches.due(0, False)
    watches.connection_lost()
    [again] = _live(watches.due(0, False))
    assert again.close is None and again.sub_id is not None


def test_keys_are_cut_to_the_relays_limits() -> None:
    plan = WatchPlan()
    watches = RelayWatches(plan, 100, HOUR, WINDOW)
    watches.apply_limits(RelayLimits(max_filters=2, max_message_length=512 + 67 * 30))
    plan.replace({k: MENTIONS for k in keys(95)}, {k: MESSAGES for k in keys(10, 1000)})
    requests = _live(watches.due(0, False))
    filters = [f for r in requests for f in r.filters]
    assert all(len(r.filters) <= 2 for r in requests)
    assert all(len(f.get("#p", f.get("authors", []))) <= 30 for f in filters)
    assert sorted(k for f in filters for k in f.get("#p", [])) == keys(95)
    assert sorted(k for f in filters for k in f.get("authors", [])) == keys(10, 1000)


def test_a_firehose_asks_by_kinds_and_keeps_keys_only_for_any_kind() -> None:
    plan = WatchPlan()
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    plan.replace({ME: MENTIONS, OTHER: MENTIONS}, {SESSION: MESSAGES, OTHER: None})
    [request] = _live(watches.due(0, True))
    assert len(request.filters) == 3  # mentions once for both keys
    assert {tuple(f.get("kinds", ())) for f in request.filters} == {(1, 6, 7, 9735), (1060,), ()}
    assert [f["authors"] for f in request.filters if "kinds" not in f] == [[OTHER]]
    assert not any("#p" in f for f in request.filters)
    # switching mode re-sends
    assert watches.due(0, False)


def _lists(requests: list[Request]) -> list[dict[str, object]]:
    return [f for r in requests for f in r.filters if f.get("kinds") in ([3], [10000])]


def test_subscribers_lists_are_asked_whole_once_then_since_the_cursor() -> None:
    """Issue 33 with issue 34's item 2: a subscriber new on the relay has its whole kind 10000
    (and kind 3 if follows-only) asked once; every later plan change asks the known ones
    only since the relay's cursor, and a REQ lost with the connection asks them whole again."""
    plan, cursor = WatchPlan(), int(time.time()) - HOUR
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    plan.replace({ME: MENTIONS}, {}, {ME: False})
    requests = watches.due(0, False, cursor)
    assert _lists(requests) == [{"kinds": [10000], "authors": [ME]}]
    _answer(watches, requests)
    plan.replace({ME: MENTIONS, OTHER: MENTIONS}, {}, {ME: True, OTHER: False})
    requests = watches.due(0, False, cursor)
    assert sorted(_lists(requests), key=repr) == sorted([
        {"kinds": [10000], "authors": [ME], "since": cursor},
        {"kinds": [10000], "authors": [OTHER]},
        {"kinds": [3], "authors": [ME]},  # turned follows-only: its kind 3 whole, once
    ], key=repr)
    _answer(watches, requests)
    plan.replace({ME: MENTIONS}, {}, {ME: True})
    requests = watches.due(0, False, cursor)
    assert sorted(_lists(requests), key=repr) == sorted([
        {"kinds": [10000], "authors": [ME], "since": cursor},
        {"kinds": [3], "authors": [ME], "since": cursor},
    ], key=repr)
    _answer(watches, requests)
    plan.replace({ME: MENTIONS, OTHER: MENTIONS}, {}, {ME: True, SESSION: False})
    watches.due(0, False, cursor)
    watches.connection_lost()  # SESSION's whole list may not have come
    requests = watches.due(0, False, cursor)
    assert {"kinds": [10000], "authors": [SESSION]} in _lists(requests)
    assert {"kinds": [10000], "authors": [ME], "since": cursor} in _lists(requests)
    plan.replace({}, {}, {})
    assert _lists(watches.due(0, False, cursor)) == []


def test_a_whole_list_counts_as_fetched_only_at_the_eose_of_its_req() -> None:
    """Issue 33 item 3: a whole kind 10000 asked in a REQ that is replaced, or refused, before
    its EOSE is asked whole again; once a REQ asking it reaches EOSE, only since the cursor."""
    plan, cursor = WatchPlan(), int(time.time()) - HOUR
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    plan.replace({ME: MENTIONS}, {}, {ME: False})
    [first] = _live(watches.due(0, False, cursor))
    plan.replace({ME: MESSAGES}, {}, {ME: False})  # replaced before its EOSE
    second, closing = _live(watches.due(0, False, cursor))[:2]
    assert closing.close == first.sub_id
    assert _lists([second]) == [{"kinds": [10000], "authors": [ME]}], "asked whole again"
    watches.eose(str(first.sub_id))  # a replaced REQ's late EOSE confirms nothing
    assert second.sub_id is not None
    watches.closed(second.sub_id)  # refused: nothing came
    watches.refresh()  # AUTH answered: sent again
    third = _live(watches.due(0, False, cursor))[0]
    assert _lists([third]) == [{"kinds": [10000], "authors": [ME]}], "asked whole again"
    assert third.sub_id is not None
    watches.eose(third.sub_id)
    watches.refresh()
    fourth = _live(watches.due(0, False, cursor))[0]
    assert _lists([fourth]) == [{"kinds": [10000], "authors": [ME], "since": cursor}]


def test_the_relay_is_live_for_watches_only_once_every_req_has_answered() -> None:
    """Issue 33 item 1: the relay's cursor may move on only when every watch REQ reached EOSE;
    a refused REQ holds it like an unanswered one until it is sent again."""
    plan = WatchPlan()
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    watches.apply_limits(RelayLimits(max_filters=1))
    assert watches.live  # nothing asked
    plan.replace({ME: MENTIONS}, {SESSION: MESSAGES})
    requests = watches.due(0, False)
    one, two = _live(requests)
    assert one.sub_id is not None and two.sub_id is not None
    _answer(watches, [r for r in requests if r.page])  # the catch-up found nothing
    assert not watches.live
    watches.eose(one.sub_id)
    assert not watches.live, "one of two answered"
    watches.closed(two.sub_id)
    assert not watches.live, "a refused REQ holds the cursor too"
    watches.refresh()
    requests = watches.due(0, False)
    _answer(watches, [r for r in requests if r.page])
    assert not watches.live, "the live REQs are not answered yet"
    _answer(watches, requests)
    assert watches.live
    plan.replace({ME: MENTIONS, OTHER: MENTIONS}, {SESSION: MESSAGES})
    watches.due(0, False)
    assert not watches.live, "a plan change's new REQs hold it until answered"
    watches.connection_lost()
    assert watches.live, "nothing is open on a lost connection (the reconnect asks again)"


def test_a_relay_that_never_answers_holds_the_cursor_for_a_bounded_time() -> None:
    """Attacker mindset: a relay that never sends EOSE (or keeps a REQ refused) must not
    freeze the cursor for ever; after EOSE_TIMEOUT_SECONDS the REQ is given up on, with its
    reason for the metric, and the lists it asked stay to be asked whole."""
    plan, cursor = WatchPlan(), int(time.time()) - HOUR
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    watches.apply_limits(RelayLimits(max_filters=1))
    plan.replace({ME: MENTIONS}, {}, {ME: False})
    _silent, refused = _live(watches.due(0, False, cursor))
    assert refused.sub_id is not None
    watches.closed(refused.sub_id)
    start = time.monotonic()
    assert watches.expire(start + EOSE_TIMEOUT_SECONDS / 2) == ([], []) and not watches.live
    reasons, closing = watches.expire(start + EOSE_TIMEOUT_SECONDS + 1)
    assert sorted(reasons) == ["closed", "no_eose", "no_eose"], "the two REQs and the page"
    assert [r.close for r in closing if r.close] and watches.live
    plan.replace({ME: MESSAGES}, {}, {ME: False})
    assert {"kinds": [10000], "authors": [ME]} in _lists(watches.due(0, False, cursor))


def test_each_watch_filter_is_caught_up_by_pages_of_its_own() -> None:
    """Issue 33 item 2: the live REQs ask new events only (`limit` 0); each watch filter's
    window comes in page REQs of that one filter (so each event is counted towards the right
    filter), sized by the relay's `max_limit`, the next from the oldest `created_at` so far,
    until a page adds nothing new; at most PAGES_IN_FLIGHT at once, a filter's next page
    behind the other filters' waiting ones, and at most MAX_PAGES_PER_FILTER per filter."""
    plan, now = WatchPlan(), int(time.time())
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    watches.apply_limits(RelayLimits(max_limit=2))
    plan.replace({}, {SESSION: MESSAGES, OTHER: frozenset({4}), ME: frozenset({1059})})
    requests = watches.due(0, False)
    assert all(f["limit"] == 0 for r in _live(requests) for f in r.filters)
    pages = [r for r in requests if r.page]
    assert len(pages) == PAGES_IN_FLIGHT, "the third filter's page waits its turn"
    assert all(len(r.filters) == 1 and r.filters[0]["limit"] == 2 for r in pages)
    assert not any("until" in r.filters[0] for r in pages)
    first, second = pages
    assert first.sub_id is not None and second.sub_id is not None
    watches.stored(first.sub_id, "a" * 64, now - 10)
    watches.stored(first.sub_id, "b" * 64, now - 20)
    follow_ups = watches.eose(first.sub_id)
    assert follow_ups[0].close == first.sub_id
    [third] = [r for r in follow_ups if r.page]
    assert third.filters[0]["authors"] != first.filters[0]["authors"], "the waiting filter first"
    follow_ups = watches.eose(second.sub_id)  # nothing stored: that filter is caught up
    [again] = [r for r in follow_ups if r.page]
    assert again.filters[0]["authors"] == first.filters[0]["authors"]
    assert again.filters[0]["until"] == now - 20 and again.sub_id is not None
    watches.stored(again.sub_id, "b" * 64, now - 20)  # the boundary again: nothing new
    assert [r.close for r in watches.eose(again.sub_id)] == [again.sub_id]
    assert third.sub_id is not None
    watches.eose(third.sub_id)
    assert not watches.live, "the live REQs are still unanswered"
    _answer(watches, _live(requests))
    assert watches.live and watches.take_fetched() == 3


def test_a_filter_matching_a_flood_stops_paging_at_its_cap() -> None:
    """One subscriber's filter that keeps matching older events pages at most
    MAX_PAGES_PER_FILTER times (counted for the metric), then the relay is live again."""
    plan, now = WatchPlan(), int(time.time())
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    plan.replace({}, {SESSION: MESSAGES})
    requests = watches.due(0, False)
    _answer(watches, _live(requests))
    [page] = [r for r in requests if r.page]
    for number in range(MAX_PAGES_PER_FILTER):
        assert page.sub_id is not None
        watches.stored(page.sub_id, f"{number:064x}", now - 1 - number)
        follow_ups = [r for r in watches.eose(page.sub_id) if r.page]
        if number + 1 < MAX_PAGES_PER_FILTER:
            [page] = follow_ups
        else:
            assert follow_ups == []
    assert watches.take_capped() == 1 and watches.live


def test_a_refused_page_frees_its_room_and_holds_the_cursor() -> None:
    plan = WatchPlan()
    watches = RelayWatches(plan, 500, HOUR, WINDOW)
    watches.apply_limits(RelayLimits(max_subscriptions=5))  # one page at a time
    plan.replace({}, {SESSION: MESSAGES, OTHER: frozenset({4})})
    requests = watches.due(0, False)
    _answer(watches, _live(requests))
    [page] = [r for r in requests if r.page]
    assert page.sub_id is not None
    [waiting] = watches.closed(page.sub_id)
    assert waiting.page and waiting.filters != page.filters
    assert waiting.sub_id is not None
    watches.eose(waiting.sub_id)
    assert not watches.live, "the refused page holds the cursor until its timeout"
