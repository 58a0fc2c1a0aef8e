"""The registration limits, decided once for both engines.

`devices_per_npub` bounds the (npub, token) pairs of one npub, `accounts_per_device` the npubs
that registered one token (0: no limit). An existing pair may always be updated, even after a
limit was lowered: only a new pair needs room. When both limits are reached, the npub's own
limit is the one reported.

What differs per engine is only how the counts stay true until the write: PostgreSQL locks the
npub and the token (advisory locks) and counts inside that transaction
(`store.postgres.devices`); SQLite's one writer inserts only if the counts it read still hold,
in the inserting statement itself, and reads again when they moved (`store.sqlite.devices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sigil_push.store.errors import TargetTaken, TooManyAccounts, TooManyDevices


@dataclass(frozen=True)
class Occupancy:
    """What a registration of (npub, token) finds in the store."""

    pair_exists: bool
    of_npub: int
    """Pairs of the npub (any token)."""
    of_token: int
    """Pairs of the token (any npub)."""
    iris_target: bool = False
    """The npub's Iris subscriptions push to this token (not counted above)."""


def refusal(
    found: Occupancy, max_devices: int, max_accounts: int
) -> TooManyDevices | TooManyAccounts | TargetTaken | None:
    """Why this registration may not be written, or None when it may. One row cannot be both
    a registration and an Iris target (CONTRACT 3b)."""
    if found.iris_target:
        return TargetTaken()
    if found.pair_exists:
        return None
    if max_devices and found.of_npub >= max_devices:
        return TooManyDevices(max_devices)
    if max_accounts and found.of_token >= max_accounts:
        return TooManyAccounts(max_accounts)
    return None
