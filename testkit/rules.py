"""The store's list checks asked as the committer asks them: a kind 4's facts and the real
wake rules (`bridge.choices.judge`), answered as reason names."""

from __future__ import annotations

import time
from collections.abc import Sequence

from sigil_push.bridge.choices import Facts, Rule, facts_of, judge
from sigil_push.store.preferences import AuthorCheck, Listed
from sigil_push.store.records import Device


def dm_checks(pairs: Sequence[tuple[str, Sequence[Device]]]) -> list[AuthorCheck[Facts]]:
    """(author hex, devices of one recipient) as the checks of kind 4s by those authors."""
    now = int(time.time())
    return [
        AuthorCheck(facts_of(4, author, now, (), "", 1, None, now, 10, 3600), devices)
        for author, devices in pairs
    ]


def reason_of(facts: Facts, device: Device, listed: Listed) -> str | None:
    """What keeps `device` asleep for the event, by name (None: it wakes)."""
    verdict = judge(facts, device, int(time.time()), listed)
    return verdict.reason if isinstance(verdict, Rule) else None
