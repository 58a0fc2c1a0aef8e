"""The wake rules (CONTRACT 4, "What wakes a device"), with no I/O: per (event, target), wake,
suppress with a reason, or defer with a reason (a wakeup later, once).

`RULES` is the table, in the contract's order; the first rule that applies names the reason,
and the metric's reasons (`SUPPRESS_REASONS`) are derived from it. Each rule says what it does:

- `IGNORE`: the event is no business of the target and is never counted (`self`: its own
  author's pairs);
- `SUPPRESS`: counted (`sigil_push_suppressed_total{reason}`, a `suppressed` record) and never
  pushed later (`crowded`, `stale`, `paused`, `muted`, `not_followed`);
- `DEFER`: counted, and the target is marked so that exactly one wakeup follows when the rule
  stops holding, if some marked event would still wake it then (`present`, `quiet`).

Two rules read the owner's stored lists (`needs_lists`: mute lists, contact list), which live
in the database, not in memory. `judge` is therefore asked twice for a target that has such
lists: first without them (`lists=None`, answering `ASK` when a list could decide), then, once
the committer has read the whole batch's lists in one go, with them. Everything else an event
contributes is computed once per event (`Facts`).

Iris targets (issue 33) are devices too, and use this same table with their own subset
(`IRIS_RULES`: self, crowded for `#p` matches, muted by the subscriber's kind 10000 `p` tags,
not_followed when the subscription has `social_graph_filter`); `rate_limited` is decided by
delivery and only named here so the metric's label set is one list. The committer asks `judge`
about an Iris target with `iris_facts` and `iris_device`, which leave nothing for the other
rules to act on: `judge` then decides by exactly `IRIS_RULES` (what
`judge(..., rules_in_play=IRIS_RULES)` would say), in the same batch list reads as every pair.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from sigil_push.bridge.watches import CLASS_OF_KIND, FRESHNESS_KINDS, IRIS, PUBLIC_KINDS
from sigil_push.store.preferences import Listed
from sigil_push.store.records import Device, Rules, has_key


class Effect(enum.Enum):
    IGNORE = "ignore"
    SUPPRESS = "suppress"
    DEFER = "defer"


class Rule(NamedTuple):
    reason: str
    effect: Effect
    needs_lists: bool
    """Decided only with the owner's stored lists (`Listed`)."""


SELF = Rule("self", Effect.IGNORE, False)
CROWDED = Rule("crowded", Effect.SUPPRESS, False)
STALE = Rule("stale", Effect.SUPPRESS, False)
PAUSED = Rule("paused", Effect.SUPPRESS, False)
MUTED = Rule("muted", Effect.SUPPRESS, True)
NOT_FOLLOWED = Rule("not_followed", Effect.SUPPRESS, True)
PRESENT = Rule("present", Effect.DEFER, False)
QUIET = Rule("quiet", Effect.DEFER, False)
RULES = (SELF, CROWDED, STALE, PAUSED, MUTED, NOT_FOLLOWED, PRESENT, QUIET)
"""Every rule, in the order the contract applies them."""
IRIS_RULES = (SELF, CROWDED, MUTED, NOT_FOLLOWED)
RATE_LIMITED = "rate_limited"
"""Decided by delivery (a target's own rate limit), counted under the same metric."""
SUPPRESS_REASONS = (
    *(rule.reason for rule in RULES if rule.effect is not Effect.IGNORE), RATE_LIMITED,
)
"""The labels of `sigil_push_suppressed_total` and the `suppressed` records' reasons."""
DEFER_REASONS = tuple(rule.reason for rule in RULES if rule.effect is Effect.DEFER)
_RANK = {rule: rank for rank, rule in enumerate(RULES)}


class Ask(enum.Enum):
    """`judge`'s answer when the owner's stored lists could decide: read them, ask again."""

    LISTS = "lists"


ASK = Ask.LISTS


class Facts(NamedTuple):
    """What the rules read of one event, computed once (`facts_of`)."""

    signer: str
    author: bytes | None
    """The visible author (32 bytes): the signer, or a zap's verified 9734 pubkey; None for a
    gift wrap or an anonymous zap (mute and follows-only do not apply)."""
    author_hex: str | None
    threads: tuple[bytes, ...]
    """A kind 1's NIP-10 root and reply `e` ids (32 bytes each)."""
    text: str | None
    """A kind 1's content, case-folded (muted words); None for other kinds."""
    crowded: bool
    stale: bool
    cls: str


MAX_THREAD_TAGS = 2
"""NIP-10: a reply names its root and the note it answers; no more are looked at."""


def thread_ids(tags: Sequence[Sequence[str]]) -> tuple[bytes, ...]:
    """A kind 1's root and reply `e` ids: the tags marked `root`/`reply`, else (old clients)
    the first and last `e` tags. Malformed ids are skipped."""
    marked: list[str] = []
    positional: list[str] = []
    for tag in tags:
        if len(tag) >= 2 and tag[0] == "e":
            if len(tag) >= 4 and tag[3] in ("root", "reply"):
                marked.append(tag[1])
            else:
                positional.append(tag[1])
    chosen = marked[:MAX_THREAD_TAGS] if marked else (
        [positional[0], positional[-1]] if positional else []
    )
    ids: list[bytes] = []
    for value in chosen:
        if len(value) == 64:
            try:
                ids.append(bytes.fromhex(value))
            except ValueError:
                continue
    return tuple(dict.fromkeys(ids))


def facts_of(
    kind: int,
    signer: str,
    created_at: int,
    tags: Sequence[Sequence[str]],
    content: str,
    p_count: int,
    zap_author: str | None,
    now: int,
    max_p_tags: int,
    stale_after: int,
) -> Facts:
    """The facts of a verified event: its visible author (`zap_author` for a 9735, which the
    caller verified, or None), thread ids and folded text for a kind 1, whether it is crowded
    (a public kind naming more than `max_p_tags` keys) or stale (a public kind or zap older
    than `stale_after` seconds)."""
    if kind == 1059:
        author_hex: str | None = None
    elif kind == 9735:
        author_hex = zap_author
    else:
        author_hex = signer
    author = bytes.fromhex(author_hex) if author_hex is not None else None
    is_note = kind == 1
    return Facts(
        signer,
        author,
        author_hex,
        thread_ids(tags) if is_note else (),
        content.casefold() if is_note else None,
        kind in PUBLIC_KINDS and max_p_tags > 0 and p_count > max_p_tags,
        kind in FRESHNESS_KINDS and stale_after > 0 and created_at < now - stale_after,
        CLASS_OF_KIND.get(kind, "dm"),
    )


def iris_facts(facts: Facts, by_p: bool, p_count: int, max_p_tags: int) -> Facts:
    """An event's facts as the Iris rules read them, for a target matched through a `#p`
    filter (`by_p`) or an `authors` one: crowded is any kind naming more than `max_p_tags`
    keys, and only for a `#p` match (NNS's rule); no staleness, no thread or word mutes (the
    subscriber's kind 10000 `p` tags only); class `iris`."""
    return facts._replace(
        crowded=by_p and max_p_tags > 0 and p_count > max_p_tags,
        stale=False, threads=(), text=None, cls=IRIS,
    )


def iris_device(device: Device, follows_only: bool) -> Device:
    """An Iris target as the rules see it for one subscription: its owner's stored lists
    (the device row's flags), `senders: "follows"` when the subscription has
    `social_graph_filter`, and none of a registration's own choices (no pause, presence,
    quiet hours or private mute list: a subscription has none)."""
    base = device.rules
    mute_list = base is not None and base.mute_list
    follows_known = base is not None and base.follows_known
    if not mute_list and not (follows_only and follows_known):
        return device if base is None else replace(device, rules=None)
    rules = Rules(None, "follows" if follows_only else "anyone", None, 0, mute_list,
                  follows_known)
    return replace(device, rules=rules)


def _reads_lists(rules: Rules, facts: Facts) -> bool:
    """Whether the owner's stored lists could suppress this event for the target."""
    if rules.muted_count and facts.author is not None:
        return True
    if rules.mute_list and (facts.author is not None or facts.threads or facts.text):
        return True
    return bool(rules.senders == "follows" and rules.follows_known and facts.author is not None)


def _muted(facts: Facts, listed: Listed) -> bool:
    author = facts.author
    if author is not None and (
        (listed.private is not None and has_key(listed.private, author))
        or (listed.mute_keys is not None and has_key(listed.mute_keys, author))
    ):
        return True
    threads = listed.mute_threads
    if threads and any(has_key(threads, thread) for thread in facts.threads):
        return True
    text = facts.text
    return bool(text and any(word in text for word in listed.mute_words))


def _not_followed(facts: Facts, rules: Rules, listed: Listed) -> bool:
    return (
        facts.author is not None
        and rules.senders == "follows"
        and rules.follows_known
        and listed.follows is not None
        and not has_key(listed.follows, facts.author)
    )


def judge(
    facts: Facts,
    device: Device,
    now: int,
    lists: Listed | None,
    rules_in_play: Sequence[Rule] = RULES,
) -> Rule | Ask | None:
    """The first rule of `rules_in_play` that keeps `device` asleep for this event, None to
    wake it, or `ASK` when `lists` is None and the owner's stored lists could decide."""
    if device.pubkey == facts.signer or device.pubkey == facts.author_hex:
        return SELF if SELF in rules_in_play else None
    if facts.crowded and CROWDED in rules_in_play:
        return CROWDED
    if facts.stale and STALE in rules_in_play:
        return STALE
    rules = device.rules
    if rules is None:
        return None
    if rules.pause_until is not None and rules.pause_until > now and PAUSED in rules_in_play:
        return PAUSED
    if _reads_lists(rules, facts):
        if lists is None:
            return ASK
        if MUTED in rules_in_play and _muted(facts, lists):
            return MUTED
        if NOT_FOLLOWED in rules_in_play and _not_followed(facts, rules, lists):
            return NOT_FOLLOWED
    if rules.present_until is not None and rules.present_until > now and PRESENT in rules_in_play:
        return PRESENT
    if rules.quiet is not None and QUIET in rules_in_play and rules.quiet.inside(now):
        return QUIET
    return None


def strongest(reasons: Sequence[Rule]) -> Rule:
    """Of the rules that kept an event's targets asleep, the one the record names: the first
    in table order."""
    return min(reasons, key=_RANK.__getitem__)
