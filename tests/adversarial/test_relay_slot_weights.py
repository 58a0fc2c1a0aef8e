"""Relay slots weigh npubs, not URLs' popularity (issue 22): throwaway npubs are free to make, so
a relay many of them agree on once outranked a real user's only inbox (votes first). A relay that
is some key's only inbox is now served first, in the order those keys arrived; a hundred
throwaway npubs naming the same ten URLs, or each naming one of them as its only inbox after the
user registered, cannot push that user's only inbox out of `max_relays`.

RelayPlan is the pure ranking the pool applies (no I/O), tested directly.
"""

from __future__ import annotations

from sigil_push.relays.pool import RelayPlan

CONFIGURED = ["wss://configured.example"]
REAL_INBOX = "wss://zz-real-inbox.example"
SHARED = [f"wss://shared{i}.example" for i in range(10)]


def test_throwaways_agreeing_on_ten_urls_cannot_push_an_only_inbox_out() -> None:
    for room in (1, 2, 5):
        plan = RelayPlan(CONFIGURED, max_relays=len(CONFIGURED) + room)
        plan.set_key("real", [REAL_INBOX], inbox=[REAL_INBOX])
        for n in range(100):
            plan.set_key(f"throwaway{n}", SHARED, inbox=SHARED)
        chosen = plan.choose()
        assert REAL_INBOX in chosen, (room, chosen)
        assert len(chosen) == len(CONFIGURED) + room
        assert REAL_INBOX not in plan.skipped


def test_throwaways_each_with_one_of_ten_urls_as_only_inbox_come_after_the_user() -> None:
    """Each URL is the only inbox of ten throwaways: ten votes against the user's one."""
    plan = RelayPlan(CONFIGURED, max_relays=len(CONFIGURED) + 1)
    plan.set_key("real", [REAL_INBOX], inbox=[REAL_INBOX])
    for n in range(100):
        url = SHARED[n % len(SHARED)]
        plan.set_key(f"throwaway{n}", [url], inbox=[url])
    assert plan.choose() == CONFIGURED + [REAL_INBOX]


def test_throwaways_keep_what_is_left_and_sole_inboxes_come_before_them() -> None:
    """With room to spare the throwaways' relays fill it; a later real user's only inbox is
    still served before any relay that is nobody's only inbox."""
    plan = RelayPlan(CONFIGURED, max_relays=len(CONFIGURED) + 3)
    for n in range(100):
        plan.set_key(f"throwaway{n}", SHARED, inbox=SHARED)
    plan.set_key("late-real", [REAL_INBOX], inbox=[REAL_INBOX])
    chosen = plan.choose()
    assert chosen[1] == REAL_INBOX
    assert set(chosen[2:]) <= set(SHARED)
