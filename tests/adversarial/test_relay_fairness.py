"""Relay slots are shared fairly (issue 9, item 5): throwaway npubs naming many URLs cannot push
a real user's inbox relay out of `max_relays`, and one npub cannot hold more than its share.

RelayPlan is the pure ranking the pool applies (no I/O), tested directly; the per-user
connection ranking is tested through UserInboxes' own ordering function.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sigil_push.config import BridgeConfig
from sigil_push.observations import ObservationLog
from sigil_push.relays.pool import MAX_RELAYS_PER_KEY, RelayPlan
from sigil_push.relays.user_inbox import UserInboxes

CONFIGURED = ["wss://configured.example"]


def test_throwaway_keys_cannot_push_a_real_inbox_out() -> None:
    plan = RelayPlan(CONFIGURED, max_relays=1 + 5)
    spam = [f"wss://spam{i:03}.example" for i in range(40)]
    for n in range(3):  # three sybils agreeing on the same forty URLs: demand 3 each
        plan.set_key(f"sybil{n}", spam, inbox=spam)
    plan.set_key("real", ["wss://inbox.real.example"], inbox=["wss://inbox.real.example"])
    chosen = plan.choose()
    assert "wss://inbox.real.example" in chosen
    assert len(chosen) == 6


def test_every_key_gets_an_inbox_before_extra_relays() -> None:
    plan = RelayPlan(CONFIGURED, max_relays=1 + 3)
    extra = [f"wss://extra{i}.example" for i in range(10)]
    for n in range(5):  # popular non-inbox relays (e.g. registration relays beside a 10050 list)
        plan.set_key(f"crowd{n}", extra + [f"wss://inbox{n % 2}.example"], inbox=[f"wss://inbox{n % 2}.example"])
    plan.set_key("loner", ["wss://loner.example"], inbox=["wss://loner.example"])
    chosen = plan.choose()
    assert {"wss://inbox0.example", "wss://inbox1.example", "wss://loner.example"} <= set(chosen)
    assert not set(extra) & set(chosen)
    assert set(plan.skipped) == set(extra)


def test_one_key_counts_for_at_most_its_cap() -> None:
    plan = RelayPlan(CONFIGURED, max_relays=1000)
    many = [f"wss://r{i:03}.example" for i in range(200)]
    plan.set_key("greedy", many, inbox=many[:3])
    assert len(plan.own_relays["greedy"]) == MAX_RELAYS_PER_KEY
    assert set(many[:3]) <= plan.own_relays["greedy"]
    plan.remove_key("greedy")
    assert plan.choose() == CONFIGURED and plan.demand == {}


def test_many_throwaway_keys_each_get_one_vote() -> None:
    """Sybils each naming a unique URL tie with a real single-inbox user; a real user whose
    inbox is shared with other real users ranks above every sybil."""
    plan = RelayPlan(CONFIGURED, max_relays=1 + 3)
    for n in range(50):
        urls = [f"wss://sybil{n}-{i}.example" for i in range(20)]
        plan.set_key(f"sybil{n}", urls, inbox=urls)
    for n in range(2):
        plan.set_key(f"real{n}", ["wss://shared.inbox.example"], inbox=["wss://shared.inbox.example"])
    assert plan.choose()[1] == "wss://shared.inbox.example"


class _Sessions:
    def __init__(self, pubkeys: set[str]) -> None:
        self._pubkeys = pubkeys

    def active_pubkeys(self) -> set[str]:
        return self._pubkeys

    def signer_for(self, pubkey: str) -> Any:
        raise AssertionError("not used by the ranking")


class _Owner:
    def __init__(self, relays: dict[str, frozenset[str]]) -> None:
        self._relays = relays

    def gated(self) -> dict[str, str]:
        return dict.fromkeys(set().union(*self._relays.values()), "maybe_gated")

    def baselines_of(self, url: str) -> set[str]:
        raise AssertionError("not used by the ranking")

    def user_relays(self, pubkey: str) -> frozenset[str]:
        return self._relays.get(pubkey, frozenset())


def test_per_user_connections_go_round_robin_over_keys(tmp_path: Path) -> None:
    """A key (sorted first) with many gated inbox relays cannot spend max_user_connections
    before the next key gets its first connection."""
    relays = {
        "aaaa": frozenset(f"wss://gated{i}.example" for i in range(50)),
        "bbbb": frozenset({"wss://only.example"}),
    }
    owner = _Owner(relays)
    # the ranking reads only the pool's gated relays and the users' relays: no port
    inboxes = UserInboxes(
        _Sessions(set(relays)), ObservationLog(tmp_path),  # type: ignore[arg-type]
        BridgeConfig(max_user_connections=10), None, owner, owner,  # type: ignore[arg-type]
        asyncio.Event(),
    )
    wanted = inboxes._wanted(set(owner.gated()))
    keep = wanted[:10]
    assert ("wss://only.example", "bbbb") in keep
    assert wanted[:2] == [("wss://gated0.example", "aaaa"), ("wss://only.example", "bbbb")]


def test_a_wave_of_new_single_inbox_keys_cannot_push_an_older_only_inbox_out() -> None:
    """Throwaway keys registered after a real user, each naming one inbox URL of its own that
    sorts before the user's: they tie with the user on votes and tightness, and once won the
    tie by URL order; the older key's only inbox now keeps its slot."""
    plan = RelayPlan(CONFIGURED, max_relays=1 + 5)
    plan.set_key("real", ["wss://zz-inbox.example"], inbox=["wss://zz-inbox.example"])
    for n in range(50):
        url = f"wss://aa{n:03}.example"
        plan.set_key(f"throwaway{n}", [url], inbox=[url])
    assert "wss://zz-inbox.example" in plan.choose()
    # the real key re-registering (same inbox) keeps its seniority
    plan.set_key("real", ["wss://zz-inbox.example"], inbox=["wss://zz-inbox.example"])
    assert "wss://zz-inbox.example" in plan.choose()
