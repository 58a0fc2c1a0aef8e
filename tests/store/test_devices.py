"""The device store on each engine (a real SQLite file, a real PostgreSQL): limits under
concurrency, (npub, token) pairs."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from sigil_push.store.errors import TooManyAccounts, TooManyDevices
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.interface import DeviceStore
from sigil_push.store.limits import Occupancy, refusal
from testkit.stores import sql_of


@pytest.fixture
def devices(store: SqliteStore | PostgresStore) -> DeviceStore:
    return store.devices


async def test_device_limit_holds_under_concurrent_registrations(devices: DeviceStore) -> None:
    """However many registrations race (one writer on SQLite, several connections on
    PostgreSQL), the limit holds: no more pairs than it allows, none refused below it."""
    pubkey = secrets.token_hex(32)

    async def attempt() -> bool:
        try:
            await devices.register(pubkey, "ios", secrets.token_hex(32), "opaque", (), None, 10)
            return True
        except TooManyDevices:
            return False

    outcomes = await asyncio.gather(*(attempt() for _ in range(40)))
    assert sum(outcomes) == 10
    assert len(await devices.of_pubkey(pubkey)) == 10


async def test_re_registering_an_owned_token_does_not_count_against_the_limit(devices: DeviceStore) -> None:
    pubkey = secrets.token_hex(32)
    tokens = [secrets.token_hex(32) for _ in range(2)]
    for token in tokens:
        await devices.register(pubkey, "ios", token, "opaque", (), None, 2)
    again = await devices.register(pubkey, "ios", tokens[0], "event_id", (), None, 2)
    assert not again.created and again.device.payload == "event_id"
    assert [d.token for d in await devices.of_pubkey(pubkey)] == tokens


async def test_a_token_registered_by_another_npub_becomes_a_second_pair(devices: DeviceStore) -> None:
    """The second npub gets its own registration; the first keeps its own, untouched, and only
    the registering npub's listeners fire."""
    first, second, token = secrets.token_hex(32), secrets.token_hex(32), secrets.token_hex(32)
    mine = await devices.register(first, "ios", token, "event_id", (), None, 2)
    changed: list[str] = []
    devices.add_listener(changed.append)
    theirs = await devices.register(second, "ios", token, "opaque", (), None, 2)
    assert theirs.created and theirs.device.id != mine.device.id
    assert changed == [second]
    [kept] = await devices.of_pubkey(first)
    assert kept == mine.device
    assert [d.pubkey for d in await devices.of_pubkeys([first, second])] == [first, second]


async def test_account_limit_holds_under_concurrent_registrations(
    store: SqliteStore | PostgresStore, devices: DeviceStore
) -> None:
    """40 npubs race to register one token with a cap of 20: exactly 20 pairs, the rest told
    which limit they hit."""
    token = secrets.token_hex(32)

    async def attempt() -> bool:
        try:
            await devices.register(
                secrets.token_hex(32), "ios", token, "opaque", (), None, 10, max_accounts=20
            )
            return True
        except TooManyAccounts:
            return False

    outcomes = await asyncio.gather(*(attempt() for _ in range(40)))
    assert sum(outcomes) == 20
    [(pairs,)] = await sql_of(store).execute_fetchall(
        "SELECT COUNT(*) FROM devices WHERE token = ?", (token,)
    )
    assert pairs == 20


async def test_an_existing_pair_stays_updatable_after_the_limits_were_lowered(devices: DeviceStore) -> None:
    token = secrets.token_hex(32)
    owners = [secrets.token_hex(32) for _ in range(3)]
    for owner in owners:
        await devices.register(owner, "ios", token, "opaque", (), None, 0, max_accounts=3)
    updated = await devices.register(owners[0], "ios", token, "event", (), None, 1, max_accounts=2)
    assert not updated.created and updated.device.payload == "event"
    try:
        await devices.register(secrets.token_hex(32), "ios", token, "opaque", (), None, 0, max_accounts=3)
    except TooManyAccounts as refused:
        assert refused.limit == 3
    else:
        raise AssertionError("a fourth account was accepted over the cap")


async def test_unregister_and_dead_tokens(devices: DeviceStore) -> None:
    """Unregister removes the caller's pair only; a dead token removes every pair with it on
    the platform that answered, and nothing registered under another platform."""
    alice, bob, carol = (secrets.token_hex(32) for _ in range(3))
    token = secrets.token_hex(32)
    for owner in (alice, bob):
        await devices.register(owner, "ios", token, "opaque", (), None, 0)
    await devices.register(carol, "android", token, "opaque", (), None, 0)
    assert await devices.unregister(carol, secrets.token_hex(32)) == 0
    assert await devices.unregister(bob, token) == 1
    assert [d.pubkey for d in await devices.of_pubkeys([alice, bob])] == [alice]
    await devices.register(bob, "ios", token, "opaque", (), None, 0)
    changed: list[str] = []
    devices.add_listener(changed.append)
    [named] = await devices.of_pubkey(bob)
    forgotten = await devices.forget(named.id)
    assert forgotten is not None and forgotten.pubkey == bob
    assert await devices.of_pubkeys([alice, bob]) == []
    assert sorted(changed) == sorted([alice, bob])
    assert [d.platform for d in await devices.of_pubkey(carol)] == ["android"]
    assert await devices.forget(named.id) is None


async def test_a_registration_over_both_limits_is_refused_for_the_npubs_limit(
    devices: DeviceStore,
) -> None:
    """Both limits reached by a new pair: the npub's own limit is the one reported, on either
    engine (the policy is decided once, `store.limits`; SQLite used to report the token's)."""
    full, token = secrets.token_hex(32), secrets.token_hex(32)
    await devices.register(full, "ios", secrets.token_hex(32), "opaque", (), None, 1)
    await devices.register(secrets.token_hex(32), "ios", token, "opaque", (), None, 1, 1)
    with pytest.raises(TooManyDevices):
        await devices.register(full, "ios", token, "opaque", (), None, 1, max_accounts=1)
    with pytest.raises(TooManyAccounts):
        await devices.register(secrets.token_hex(32), "ios", token, "opaque", (), None, 1, 1)
    assert len(await devices.of_pubkey(full)) == 1


def test_the_limit_policy_lets_an_existing_pair_through_and_counts_only_new_ones() -> None:
    """The one rule both engines apply: an existing pair is always updatable; a new pair
    needs room under each limit that is set (0: none)."""
    assert refusal(Occupancy(True, 99, 99), 1, 1) is None
    assert refusal(Occupancy(False, 9, 19), 10, 20) is None
    assert isinstance(refusal(Occupancy(False, 10, 0), 10, 20), TooManyDevices)
    assert isinstance(refusal(Occupancy(False, 0, 20), 10, 20), TooManyAccounts)
    assert isinstance(refusal(Occupancy(False, 10, 20), 10, 20), TooManyDevices)
    assert refusal(Occupancy(False, 10**6, 10**6), 0, 0) is None
