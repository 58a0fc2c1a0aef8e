"""The REQs for indexed watches (issue 33's Iris subscriptions) on one relay.

Registrations are asked for by key shards (`relays/subscriptions.py`); watches that are not
registrations, today the filters of Iris subscriptions, are asked for here, apart, so a
subscription that changes re-sends only these REQs. `WatchPlan` is what the bridge wants
(each `#p` key and each author with the kinds its watches take, None: any kind), shared by
every relay; `RelayWatches` turns it into one relay's REQs:

- `{"kinds": K, "#p": [keys]}` and `{"kinds": K, "authors": [keys]}`, keys grouped by the
  kinds they want and cut to `keys_per_filter` and to the relay's `max_message_length`, as
  many filters per REQ as its `max_filters` allows (10 when it publishes none);
- on a firehose relay, one `{"kinds": K}` per group instead (the events are matched locally,
  as the firehose's DMs are), except for keys whose watches take any kind;
- the subscribers' own mute lists (kind 10000) and, for those with a `social_graph_filter`,
  contact lists (kind 3), by author on every relay: a subscriber new on the relay whole, once,
  the others only since the relay's cursor (`lists_since`), so a subscription change does not
  bring back every subscriber's lists (a kind 3 can weigh 200 KB), as for registrations;
- every other filter reaches back to the relay's cursor (a reconnect's catch-up; the
  committer's de-duplication drops what was handled), mentions, reposts, reactions and zaps
  only `stale_after` back (as for registrations), and no further than the catch-up window.
  The live REQ asks it with `limit` 0 (new events only), and its window is caught up by page
  REQs of that one filter (`WatchPage`), as a shard's DMs are: `until` = the oldest
  `created_at` so far, until a page adds nothing new or reaches `since`, whatever the relay's
  NIP-11 says (relays cap each filter's answer, often silently). One filter per page REQ
  tells whose answer each event is; at most PAGES_IN_FLIGHT are open at once, a filter's next
  page goes to the back of the queue (every filter gets its turn), and a filter pages at most
  MAX_PAGES_PER_FILTER times. The lists' filters are not paged (replaceable events: at most
  one per author and kind, within `keys_per_filter`).

A plan change replaces every REQ of the relay (the new ones first, then the old ones closed):
subscriptions change at a person's pace, not a firehose's.

The relay's cursor (what the next REQs reach back to) must not pass a window some REQ has not
answered in full: until a watch REQ's EOSE and every page of the catch-up, the relay is not
`live` here (`RelayPool` asks
before it moves the cursor), and a subscriber's whole list counts as fetched only at the EOSE
of the REQ that asked for it (a REQ replaced, refused or lost before then asks it whole again).
A REQ the relay refuses (CLOSED) holds the cursor as an unanswered one does, until it is sent
again (after AUTH, a plan change, a reconnect). A relay that never answers must not hold the
cursor for ever: a REQ unanswered after EOSE_TIMEOUT_SECONDS stops holding it, and is counted
(`expire`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST
from sigil_push.relays.nip11 import RelayLimits
from sigil_push.relays.subscriptions import (
    KEY_BYTES_IN_FILTER,
    REQ_OVERHEAD_BYTES,
    PageCursor,
    Request,
)

Kinds = frozenset[int] | None
"""The kinds a key's watches take; None: some watch takes any kind."""
DEFAULT_MAX_FILTERS = 10
FRESHNESS_KINDS = frozenset({1, 6, 7, 16, 9735})
"""Kinds asked for only `stale_after` back (the notification kinds of issue 32)."""
SUB_PREFIX = "iw"
EOSE_TIMEOUT_SECONDS = 120.0
"""How long a watch REQ may go without EOSE (or stay refused) before it stops holding the
relay's cursor: a relay that never answers would otherwise make every later catch-up reach
back to the same old cursor, for everyone on that relay."""

PAGES_IN_FLIGHT = 2
"""Catch-up page REQs of watches open at once on one relay (1 when it publishes
`max_subscriptions`); the other filters' pages wait their turn."""
MAX_PAGES_PER_FILTER = 100
"""Pages one filter's catch-up may ask for (50,000 events at a relay's usual 500 a page); past
it the filter stops paging, counted (`take_capped`), so one subscriber's filter matching a
flood of events costs the relay's other watches one turn in the queue per page, and no more
than this."""


@dataclass(slots=True)
class WatchPage:
    """One watch filter's catch-up: the filter as the live REQ asks it (its own `since`),
    where its paging stands (`PageCursor`: the `until` of the next page, the events the last
    one added) and how many pages it has asked."""

    query: dict[str, object]
    since: int
    cursor: PageCursor
    number: int = 1


@dataclass(slots=True)
class WatchReq:
    """A watch REQ sent and not yet answered in full: when (monotonic), which subscribers'
    whole lists it asked for (kind 10000; kind 3), whether the relay refused it, and the
    catch-up page it is (None: a live REQ)."""

    sent_at: float
    lists: frozenset[str] = frozenset()
    contacts: frozenset[str] = frozenset()
    refused: bool = False
    page: WatchPage | None = None


class WatchPlan:
    """What the bridge wants asked for, by index; `version` changes with every replacement."""

    def __init__(self) -> None:
        self.p: Mapping[str, Kinds] = {}
        self.authors: Mapping[str, Kinds] = {}
        self.lists: Mapping[str, bool] = {}
        """Subscribers whose own lists are wanted, each with whether its kind 3 is (follows-only
        subscriptions); its kind 10000 always is."""
        self.version = 0
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Be told when the relays must be asked for other keys or kinds (`replace`)."""
        self._listeners.append(listener)

    def replace(self, p: Mapping[str, Kinds], authors: Mapping[str, Kinds],
                lists: Mapping[str, bool] | None = None) -> bool:
        """The new keys; True (a new version, the listeners told) when they differ from the
        current ones."""
        lists = {} if lists is None else lists
        if p == self.p and authors == self.authors and lists == self.lists:
            return False
        self.p, self.authors, self.lists = dict(p), dict(authors), dict(lists)
        self.version += 1
        for listener in self._listeners:
            listener()
        return True

    def __bool__(self) -> bool:
        return bool(self.p or self.authors or self.lists)


def _whole(filters: list[dict[str, object]], kind: int, asked: set[str]) -> frozenset[str]:
    """The authors whose whole list of `kind` (no `since`) these filters ask for."""
    found: set[str] = set()
    for query in filters:
        if query.get("kinds") == [kind] and "since" not in query:
            authors = query.get("authors")
            if isinstance(authors, list):
                found.update(key for key in authors if key in asked)
    return frozenset(found)


def _since_of(query: dict[str, object]) -> int:
    since = query["since"]
    assert isinstance(since, int)
    return since


def _groups(keys: Mapping[str, Kinds]) -> dict[Kinds, list[str]]:
    grouped: dict[Kinds, list[str]] = {}
    for key, kinds in keys.items():
        grouped.setdefault(kinds, []).append(key)
    return grouped


class RelayWatches:
    """One relay's watch REQs: which are open, and what `due` must send to match the plan."""

    def __init__(self, plan: WatchPlan, keys_per_filter: int, stale_after: int,
                 window: int) -> None:
        self._plan = plan
        self._keys_per_filter = max(1, keys_per_filter)
        self._stale_after = stale_after
        self._window = window
        self._max_filters = DEFAULT_MAX_FILTERS
        self._max_limit: int | None = None
        self._page_room = PAGES_IN_FLIGHT
        self._length_cap = 1 << 30
        self._sent_version: int | None = None
        self._sent_firehose = False
        self._open: list[str] = []
        self._generation = 0
        self._unanswered: dict[str, WatchReq] = {}
        """REQs sent here and not answered in full yet (no EOSE): they hold the cursor."""
        # subscribers whose whole lists (kind 10000; kind 3) this relay answered in full
        self._listed: set[str] = set()
        self._contacts_listed: set[str] = set()
        self.pages: dict[str, WatchPage] = {}
        """Catch-up pages in flight, by subscription id: the REQs whose stored events count
        towards a page (ingest asks through `RelaySubscriptions.answering`). Never replaced,
        only changed: the relay's subscriptions hold this very dict."""
        self._pages_waiting: list[WatchPage] = []
        self._capped = 0
        self.fetched = 0
        """Stored events the pages returned, for metrics (`take_fetched`)."""

    def apply_limits(self, limits: RelayLimits) -> None:
        if limits.max_filters:
            self._max_filters = limits.max_filters
        self._max_limit = limits.max_limit
        self._page_room = 1 if limits.max_subscriptions else PAGES_IN_FLIGHT
        if limits.max_message_length:
            self._length_cap = max(
                1, (limits.max_message_length - REQ_OVERHEAD_BYTES) // KEY_BYTES_IN_FILTER
            )
        self._sent_version = None

    def connection_lost(self) -> None:
        """The relay forgot every REQ: all are sent again once it is back (a whole list not
        answered in full yet is asked whole again)."""
        self._open = []
        self._unanswered.clear()
        self.pages.clear()
        self._pages_waiting.clear()
        self._sent_version = None

    def refresh(self) -> None:
        """Send again (after AUTH: a REQ refused before it may be answered now)."""
        self._sent_version = None

    def owns(self, sub_id: str) -> bool:
        return sub_id.startswith(SUB_PREFIX)

    def eose(self, sub_id: str) -> list[Request]:
        """The relay answered `sub_id` in full: it no longer holds the cursor, and the whole
        lists it asked for count as fetched. A page is closed and its filter's next page
        queued (when it added something new and has not reached `since`); returns what to send
        next (the close, waiting pages that now have room)."""
        sent = self._unanswered.pop(sub_id, None)
        if sent is None:
            return []
        wanted = self._plan.lists
        self._listed |= {key for key in sent.lists if key in wanted}
        self._contacts_listed |= {key for key in sent.contacts if wanted.get(key)}
        page = sent.page
        if page is None:
            return []
        self.pages.pop(sub_id, None)
        if page.cursor.wants_more(page.since):
            if page.number >= MAX_PAGES_PER_FILTER:
                self._capped += 1
            else:
                page.cursor.next_page()
                page.number += 1
                self._pages_waiting.append(page)
        return [Request(sub_id, None, [], False), *self._pages_ready()]

    def closed(self, sub_id: str) -> list[Request]:
        """The relay ended `sub_id` without EOSE (refused it): it holds the cursor until it is
        sent again or times out, and its whole lists stay to be asked; a refused page frees
        its room for a waiting one (returned, to be sent)."""
        sent = self._unanswered.get(sub_id)
        if sent is None:
            return []
        sent.refused = True
        if sent.page is not None and self.pages.pop(sub_id, None) is not None:
            return self._pages_ready()
        return []

    def stored(self, sub_id: str, event_id: str, created_at: int) -> None:
        """A stored event a page returned before its EOSE, counted towards that page."""
        page = self.pages.get(sub_id)
        if page is not None:
            self.fetched += 1
            page.cursor.count(event_id, created_at)

    def expire(self, now: float | None = None) -> tuple[list[str], list[Request]]:
        """Stop waiting for REQs sent more than EOSE_TIMEOUT_SECONDS ago (monotonic `now`):
        the reason of each (`no_eose`, `closed`), for the caller to count and log, and what
        to send (an expired page is closed, its filter's catch-up ended, its room taken by a
        waiting page)."""
        now = time.monotonic() if now is None else now
        expired = [sub_id for sub_id, sent in self._unanswered.items()
                   if now - sent.sent_at >= EOSE_TIMEOUT_SECONDS]
        reasons: list[str] = []
        requests: list[Request] = []
        for sub_id in expired:
            sent = self._unanswered.pop(sub_id)
            reasons.append("closed" if sent.refused else "no_eose")
            if sent.page is not None:
                self.pages.pop(sub_id, None)
                requests.append(Request(sub_id, None, [], False))
        if requests:
            requests.extend(self._pages_ready())
        return reasons, requests

    def take_capped(self) -> int:
        """Filters whose catch-up stopped at MAX_PAGES_PER_FILTER since the last call."""
        capped, self._capped = self._capped, 0
        return capped

    def take_fetched(self) -> int:
        """Stored events the pages returned since the last call."""
        fetched, self.fetched = self.fetched, 0
        return fetched

    @property
    def live(self) -> bool:
        """Every watch REQ sent here was answered in full (or has given up: `expire`), and
        no catch-up page waits to be sent."""
        return not self._unanswered and not self._pages_waiting

    def _pages_ready(self) -> list[Request]:
        """Waiting pages that fit in the room for pages in flight, oldest first: one filter
        each, from its own `until`, sized by a published `max_limit`."""
        room = self._page_room - len(self.pages)
        ready, self._pages_waiting = (self._pages_waiting[: max(0, room)],
                                      self._pages_waiting[max(0, room):])
        requests: list[Request] = []
        sent_at = time.monotonic()
        for page in ready:
            self._generation += 1
            sub_id = f"{SUB_PREFIX}p.{self._generation}"
            query = dict(page.query)
            if page.cursor.until is not None:
                query["until"] = page.cursor.until
            if self._max_limit:
                query["limit"] = self._max_limit
            self.pages[sub_id] = page
            self._unanswered[sub_id] = WatchReq(sent_at, page=page)
            requests.append(Request(None, sub_id, [query], False, page=True))
        return requests

    @property
    def subscription_count(self) -> int:
        return len(self._open) + len(self.pages)

    def due(self, since: int, firehose: bool, lists_since: int | None = None) -> list[Request]:
        """The REQs (and CLOSEs) that bring the relay in line with the plan; none when it is.
        Subscribers' lists known here are asked from `lists_since` (None: every list whole)."""
        plan = self._plan
        if self._sent_version == plan.version and self._sent_firehose == firehose:
            return []
        self._sent_version, self._sent_firehose = plan.version, firehose
        lists, contacts = self._new_lists(lists_since)
        watched = self._filters(since, firehose)
        filters = [{**query, "limit": 0} for query in watched] + self._list_filters(
            lists_since, lists, contacts
        )
        per_req = max(1, self._max_filters)
        old = [*self._open, *self.pages]
        self._open = []
        for sub_id in old:
            # replaced: what it has not answered, its successor asks for again
            self._unanswered.pop(sub_id, None)
        # the new REQs' windows are caught up anew: the old catch-up's pages are moot
        self.pages.clear()
        self._pages_waiting = [
            WatchPage(query, since_of, PageCursor((), since=since_of))
            for query in watched
            for since_of in (_since_of(query),)
        ]
        requests: list[Request] = []
        sent_at = time.monotonic()
        for start in range(0, len(filters), per_req):
            self._generation += 1
            sub_id = f"{SUB_PREFIX}{start // per_req}.{self._generation}"
            self._open.append(sub_id)
            chunk = filters[start : start + per_req]
            self._unanswered[sub_id] = WatchReq(
                sent_at, _whole(chunk, MUTE_LIST, lists), _whole(chunk, CONTACTS, contacts)
            )
            requests.append(Request(None, sub_id, chunk, False))
        requests.extend(Request(sub_id, None, [], False) for sub_id in old)
        return requests + self._pages_ready()

    def _since(self, since: int, kinds: Kinds) -> int:
        now = int(time.time())
        since = max(since, now - self._window)
        if kinds and kinds <= FRESHNESS_KINDS:
            since = max(since, now - self._stale_after)
        return since

    def _new_lists(self, lists_since: int | None) -> tuple[set[str], set[str]]:
        """The subscribers whose kind 10000, and the follows-only ones whose kind 3, no REQ
        here has answered in full (every one without `lists_since`): asked whole. Those no
        longer wanted are forgotten."""
        wanted = self._plan.lists
        following = {key for key, contacts in wanted.items() if contacts}
        if lists_since is None:
            self._listed.clear()
            self._contacts_listed.clear()
        self._listed &= wanted.keys()
        self._contacts_listed &= following
        return set(wanted) - self._listed, following - self._contacts_listed

    def _list_filters(self, lists_since: int | None, new: set[str],
                      contacts_new: set[str]) -> list[dict[str, object]]:
        """Kind 10000 of every subscriber, kind 3 of the follows-only ones: whole for `new`
        (`contacts_new`), the others from `lists_since`."""
        wanted = self._plan.lists
        following = {key for key, contacts in wanted.items() if contacts}
        window: dict[str, object] = {} if lists_since is None else {"since": lists_since}
        per_filter = max(1, min(self._keys_per_filter, self._length_cap))
        filters: list[dict[str, object]] = []
        for kind, keys, asked in ((MUTE_LIST, set(wanted), new),
                                  (CONTACTS, following, contacts_new)):
            for members, reach in ((sorted(keys - asked), window), (sorted(asked), {})):
                for start in range(0, len(members), per_filter):
                    filters.append({"kinds": [kind],
                                    "authors": members[start : start + per_filter], **reach})
        return filters

    def _filters(self, since: int, firehose: bool) -> list[dict[str, object]]:
        plan = self._plan
        filters: list[dict[str, object]] = []
        per_filter = max(1, min(self._keys_per_filter, self._length_cap))
        for index, keys in (("#p", plan.p), ("authors", plan.authors)):
            for kinds, members in sorted(
                _groups(keys).items(), key=lambda item: sorted(item[0] or ())
            ):
                if firehose and kinds:
                    filters.append({"kinds": sorted(kinds), "since": self._since(since, kinds)})
                    continue
                members.sort()
                for start in range(0, len(members), per_filter):
                    query: dict[str, object] = {}
                    if kinds:
                        query["kinds"] = sorted(kinds)
                    query[index] = members[start : start + per_filter]
                    query["since"] = self._since(since, kinds)
                    filters.append(query)
        if firehose:
            # one filter per distinct kind set is enough: the same kinds twice would only
            # have the relay send each event twice
            unique: dict[str, dict[str, object]] = {}
            for query in filters:
                unique.setdefault(repr(sorted(query.items())), query)
            filters = list(unique.values())
        return filters
