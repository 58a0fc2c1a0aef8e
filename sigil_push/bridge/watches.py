"""What a registration watches, as data (issue 32; the seam issue 33's Iris API builds on).

No I/O. A `Watch` is (owner pubkey, target device id, class, compiled filter): the filter's
`kinds`, ONE index key kind (`#p` values or `authors` values) and optional further constraints
(other `#x` tags, `ids`). Two producers make watches:

- a registration (an (npub, token) pair) compiles its `notify` classes into one `#p` watch on
  its npub (`registration_watch`): dm -> kinds {4, 1059}, mention -> {1}, repost -> {6, 16},
  reaction -> {7}, zap -> {9735};
- an Iris subscription (issue 33) compiles each NIP-01 filter, which names `#p` or `authors`,
  into watches of class `iris` (`filter_watches`).

`WatchIndex` answers "who might this event wake" from the raw frame's `p` tags and `pubkey`
BEFORE any signature check (`candidates`): an event that matches no watch never pays for one.
What the bridge asks relays follows the same data: `KINDS_OF` and `notify_mask`/`mask_kinds`
turn a pair's `notify` into the kinds its key's REQs carry (`relays/subscriptions.py` asks
each relay, per shard, for the union of the kinds its keys want, `{"kinds": K, "#p": keys}`).

Registrations keep their `notify` as a bit mask (`notify_mask`, stored in `devices.notify`,
migration 0017): the device read of every event, the ingest's hot path, reads one integer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sigil_push.nostr import kinds

DM, MENTION, REPOST, REACTION, ZAP, IRIS = "dm", "mention", "repost", "reaction", "zap", "iris"
NOTIFY_CLASSES = (DM, MENTION, REPOST, REACTION, ZAP)
"""The values of a pair's `notify` (CONTRACT 3), in the order the API shows them."""
CLASSES = (*NOTIFY_CLASSES, IRIS)
"""Every class a record or metric may name (`suppressed` records' `class`)."""
KINDS_OF: Mapping[str, tuple[int, ...]] = {
    DM: kinds.DM_KINDS,
    MENTION: (1,),
    REPOST: (6, 16),
    REACTION: (7,),
    ZAP: (kinds.ZAP_RECEIPT,),
}
CLASS_OF_KIND: Mapping[int, str] = {kind: name for name, kinds in KINDS_OF.items() for kind in kinds}
"""The notification class of each kind a registration can watch."""
DM_KINDS = KINDS_OF[DM]
PUBLIC_KINDS = frozenset({1, 6, 7, 16})
"""Kinds `bridge.max_p_tags` applies to (a hellthread wakes no one: `crowded`)."""
FRESHNESS_KINDS = frozenset({1, 6, 7, 16, 9735})
"""Kinds caught up only `bridge.stale_after` back (DMs: two days) and suppressed `stale`
when older."""
WATCHABLE_KINDS = frozenset(CLASS_OF_KIND)
ZAP_RECEIPT = kinds.ZAP_RECEIPT

_BIT = {name: 1 << index for index, name in enumerate(NOTIFY_CLASSES)}
DEFAULT_MASK = _BIT[DM]
"""`["dm"]`: every registration before issue 32, and nearly every one after."""
ALL_MASK = (1 << len(NOTIFY_CLASSES)) - 1


def notify_mask(classes: Iterable[str]) -> int:
    """The bit mask of `notify` classes (each one of NOTIFY_CLASSES; the caller validated)."""
    mask = 0
    for name in classes:
        mask |= _BIT[name]
    return mask


def mask_classes(mask: int) -> list[str]:
    """The classes of a mask, in NOTIFY_CLASSES order (as `GET /registrations` shows them)."""
    return [name for name in NOTIFY_CLASSES if mask & _BIT[name]]


def mask_kinds(mask: int) -> frozenset[int]:
    """Every kind the classes of `mask` watch."""
    return frozenset(kind for name in mask_classes(mask) for kind in KINDS_OF[name])


def wants_kind(mask: int, kind: int) -> bool:
    """Whether a pair with this `notify` mask is woken by `kind` at all (not a suppression:
    a pair that did not ask for a kind is no target of it)."""
    name = CLASS_OF_KIND.get(kind)
    return name is not None and bool(mask & _BIT[name])


@dataclass(frozen=True, slots=True)
class Watch:
    """One compiled filter of one target. `index` is "#p" or "authors" and `keys` its values
    (hex pubkeys); `tags` holds further `#x` constraints (x -> allowed values) and `ids` an
    optional id constraint. `kinds` empty means any kind (NIP-01: an absent `kinds`)."""

    owner: str
    target: int
    cls: str
    kinds: frozenset[int]
    index: str
    keys: frozenset[str]
    tags: Mapping[str, frozenset[str]] = field(default_factory=dict)
    ids: frozenset[str] | None = None
    authors: frozenset[str] | None = None
    """A `#p`-indexed filter that also names `authors`: a constraint, not its index."""
    targets: tuple[int, ...] = ()
    """An Iris subscription's filter watches for every target of the subscription at once
    (`subscription_watches`): one watch per filter, not one per (filter, target), so a
    subscription's index entries do not multiply by its targets. Empty: just `target`."""
    follows_only: bool = False
    """The subscription's `social_graph_filter`: only authors its owner follows (kind 3)."""

    @property
    def devices(self) -> tuple[int, ...]:
        """The device ids this watch may wake."""
        return self.targets or (self.target,)

    def matches(self, kind: int, author: str, tags: Sequence[Sequence[str]], event_id: str) -> bool:
        """The whole filter, on a verified event's fields."""
        if self.kinds and kind not in self.kinds:
            return False
        if self.ids is not None and event_id not in self.ids:
            return False
        if self.authors is not None and author not in self.authors:
            return False
        if self.index == "authors":
            if author not in self.keys:
                return False
        elif not any(len(t) >= 2 and t[0] == "p" and t[1] in self.keys for t in tags):
            return False
        for name, allowed in self.tags.items():
            if not any(len(t) >= 2 and t[0] == name and t[1] in allowed for t in tags):
                return False
        return True


def registration_watch(owner: str, target: int, mask: int) -> Watch:
    """The `#p` watch of one registration: its npub, the kinds of its `notify` classes. Its
    class is per event (`CLASS_OF_KIND`), so the watch's own `cls` is the first of them."""
    classes = mask_classes(mask) or [DM]
    return Watch(owner, target, classes[0], mask_kinds(mask), "#p", frozenset((owner,)))


class InvalidFilter(ValueError):
    """A NIP-01 filter that cannot be a watch (no `#p` nor `authors`, a bad value)."""


def filter_watches(owner: str, target: int, nip01: Mapping[str, Any]) -> Watch:
    """An Iris subscription's filter as a watch of class `iris`: indexed by `#p` when it names
    one (the usual `{"#p": [me], "kinds": [...]}`), else by `authors`. `since`, `until` and
    `limit` are ignored; other keys refuse the filter."""
    kinds: frozenset[int] = frozenset()
    tags: dict[str, frozenset[str]] = {}
    ids: frozenset[str] | None = None
    authors: frozenset[str] | None = None
    for key, value in nip01.items():
        if key in ("since", "until", "limit"):
            continue
        if not isinstance(value, list) or not value:
            raise InvalidFilter(f"'{key}' must be a non-empty list")
        if key == "kinds":
            if not all(type(k) is int and 0 <= k < 65536 for k in value):
                raise InvalidFilter("'kinds' must be integers from 0 to 65535")
            kinds = frozenset(value)
        elif not all(isinstance(v, str) for v in value):
            raise InvalidFilter(f"'{key}' must be a list of strings")
        elif key == "ids":
            ids = frozenset(value)
        elif key == "authors":
            authors = frozenset(value)
        elif len(key) == 2 and key[0] == "#":
            tags[key[1]] = frozenset(value)
        else:
            raise InvalidFilter(f"unknown filter key '{key[:20]}'")
    tagged = tags.pop("p", None)
    if tagged is not None:
        # both named: indexed by `#p`, `authors` kept as a constraint
        return Watch(owner, target, IRIS, kinds, "#p", tagged, tags, ids, authors)
    if authors is None:
        raise InvalidFilter("a filter must name '#p' or 'authors'")
    return Watch(owner, target, IRIS, kinds, "authors", authors, tags, ids)


def subscription_watches(
    owner: str, device_ids: Sequence[int], document: Mapping[str, Any]
) -> list[Watch]:
    """An Iris subscription as stored (its document as received, CONTRACT 3b) compiled into
    one watch per filter (`filter` OR each of `filters`), each for all of its targets
    (`device_ids`). The API validated the document; a filter that cannot be a watch anyway
    (a document stored before a rule changed) is skipped, not fatal."""
    if not device_ids:
        return []
    filters: list[Any] = [document.get("filter")]
    extra = document.get("filters")
    if isinstance(extra, list):
        filters.extend(extra)
    follows_only = document.get("social_graph_filter") is True
    targets = tuple(sorted(device_ids))
    watches: list[Watch] = []
    for nip01 in filters:
        if not isinstance(nip01, Mapping):
            continue
        try:
            watch = filter_watches(owner, targets[0], nip01)
        except InvalidFilter:
            continue
        watches.append(replace(watch, targets=targets, follows_only=follows_only))
    return watches


class WatchIndex:
    """`#p` key -> watches and author -> watches, for the watches that are not plain
    registrations (registrations are matched by the key registry's `keys` and each pair's
    `notify` mask, read with its device: a million keys cost one set slot each, no Watch).

    `candidates` is what ingest asks of a raw frame before verifying anything: the watches an
    event with these `p` tag values and this author could match (whole-filter checks follow
    the signature check, `Watch.matches`). Changes are per owner (`replace_owner`: an Iris
    subscriber's watches, compiled again whenever one of their subscriptions changes) and
    cost what that owner's watches cost, whatever the number of other owners."""

    def __init__(self) -> None:
        self._by_p: dict[str, list[Watch]] = {}
        self._by_author: dict[str, list[Watch]] = {}
        self._of_owner: dict[str, list[Watch]] = {}

    def add(self, watch: Watch) -> None:
        table = self._by_author if watch.index == "authors" else self._by_p
        for key in watch.keys:
            table.setdefault(key, []).append(watch)
        self._of_owner.setdefault(watch.owner, []).append(watch)

    def _drop(self, watches: Iterable[Watch]) -> None:
        for watch in watches:
            table = self._by_author if watch.index == "authors" else self._by_p
            for key in watch.keys:
                found = table.get(key)
                if found is None:
                    continue
                kept = [w for w in found if w is not watch]
                if kept:
                    table[key] = kept
                else:
                    del table[key]

    def replace_owner(self, owner: str, watches: Sequence[Watch]) -> None:
        """`owner`'s watches are now `watches` (none: the owner has no subscription left)."""
        self._drop(self._of_owner.pop(owner, ()))
        for watch in watches:
            self.add(watch)

    def remove_target(self, owner: str, target: int) -> None:
        """Drop every watch of `owner`'s `target` (a subscription replaced or deleted)."""
        mine = self._of_owner.get(owner, [])
        self.replace_owner(owner, [w for w in mine if w.target != target])

    def owners(self) -> frozenset[str]:
        return frozenset(self._of_owner)

    def has_owner(self, owner: str) -> bool:
        return owner in self._of_owner

    def follows_only(self, owner: str) -> bool:
        """Some subscription of `owner` is follows-only: its kind 3 is read."""
        return any(watch.follows_only for watch in self._of_owner.get(owner, ()))

    def p_keys(self) -> frozenset[str]:
        return frozenset(self._by_p)

    def author_keys(self) -> frozenset[str]:
        return frozenset(self._by_author)

    def kinds_for(self, index: str, key: str) -> frozenset[int] | None:
        """The union of kinds the watches on `key` want (None: some watch takes any kind)."""
        table = self._by_author if index == "authors" else self._by_p
        kinds: set[int] = set()
        for watch in table.get(key, ()):
            if not watch.kinds:
                return None
            kinds |= watch.kinds
        return frozenset(kinds)

    def candidates(self, p_values: Iterable[str], author: str | None) -> list[Watch]:
        """Watches an event naming `p_values` and signed by `author` might match (cheap: one
        hash lookup per value; nothing verified yet)."""
        found: list[Watch] = []
        by_p = self._by_p
        if by_p:
            for value in p_values:
                watches = by_p.get(value)
                if watches is not None:
                    found.extend(watches)
        if author is not None and self._by_author:
            found.extend(self._by_author.get(author, ()))
        return found

    def watches_p(self, value: str) -> bool:
        return value in self._by_p

    def watches_author(self, value: str) -> bool:
        return value in self._by_author

    @property
    def by_authors(self) -> bool:
        """Some watch is indexed by author (a raw frame's `pubkey` must then be read too)."""
        return bool(self._by_author)

    def __bool__(self) -> bool:
        return bool(self._by_p or self._by_author)

    def __len__(self) -> int:
        return sum(len(watches) for watches in self._of_owner.values())
