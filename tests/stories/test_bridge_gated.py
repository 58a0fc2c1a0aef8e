"""Gated inboxes read through the user's own NIP-46 signer (issue 6), end to end.

Real parts only: a gated inbox, an independent nostr-sdk remote signer on another, open relay,
and `sigil-push serve`. The inbox is each way real relays gate DMs: `nostr-relay` serving reads
only to keys granted role `r` (AUTH on connect, `restricted:` NOTICE), and the khatru, strfry
(CLOSED after or before AUTH), chorus and nostr-rs-relay styles of testkit/auth_relay.py. A push is
what the dry-run sender logs; every wait polls with a generous deadline.

The stories about what the store keeps run on both engines: the first story (the sessions,
their sealed secrets at rest, the registrations) against `nostr-relay` on PostgreSQL too, and
the learned mode surviving a restart in both its styles. The others are about how each relay
style gates reads and how the bridge shares connections, which the store does not change: they
run on SQLite (every style where they take `parts`); the store's side of them (sessions, auth
modes) is checked on both engines in process (tests/bridge/test_delegated_auth.py,
tests/store/test_auth_modes_store.py, tests/stories/test_pg_delegated_auth.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import nostr_sdk
import pytest

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth
from testkit.auth_relay import AuthRelay
from testkit.bridge_harness import (
    assert_private,
    eventually,
    health,
    metric,
    new_token,
    register,
    unregister,
    wakeups,
)
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nostr_client import gift_wrap, hex_of, npub_of, publish, secret_hex_of, user
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess, free_port
from testkit.remote_signer import RemoteSigner
from testkit.service import ServiceProcess
from testkit.stores import Engine, engine_of

pytestmark = pytest.mark.slow  # every story here starts its own processes

GATED = {"save": "a", "query": "r"}
# how each style reports the shared connection: refused after AUTH, or silently served nothing
STYLES = {
    "nostr-relay": "restricted",
    "khatru-lazy": "auth-required",
    "strfry": "auth-required",
    "strfry-closed-first": "auth-required",
    "chorus-multi": "auth-required",
    "nostr-rs-silent": None,
}


def gated_inbox(folder: Path, style: str) -> RelayProcess | AuthRelay:
    if style == "nostr-relay":
        return RelayProcess(folder, auth_actions=GATED)
    mode = {"khatru-lazy": "lazy", "chorus-multi": "multi", "nostr-rs-silent": "silent"}
    return AuthRelay(
        folder, mode.get(style, "strfry"), closed_first=style == "strfry-closed-first"
    )


Inbox = TypeVar("Inbox", bound="RelayProcess | AuthRelay")


@contextmanager
def delegating(
    tmp_path: Path, gated: Inbox, engine: Engine, bridge: str = ""
) -> Iterator[tuple[RelayProcess, Inbox, ServiceProcess, list[Any]]]:
    """An open relay for the signers (also the operator's configured relay), the `gated` inbox
    started, and a service on `engine` (not started: the test starts it once its signers are
    up) with `bridge` added to the fast-reconnect [bridge] table. Everything in the yielded
    list, where a test adds its signers, is stopped in reverse order on the way out."""
    open_relay = RelayProcess(tmp_path / "open").start()
    gated.start()
    started: list[Any] = [open_relay, gated]
    service = ServiceProcess(
        tmp_path / "service", [open_relay.url], FAST_RECONNECT + bridge,
        database=engine.database(),
    )
    started.append(service)
    try:
        yield open_relay, gated, service, started
    finally:
        for part in reversed(started):
            part.stop()


def delegating_users(
    service: ServiceProcess, open_relay: RelayProcess, gated_url: str, started: list[Any], count: int
) -> list[RemoteSigner]:
    """`count` users, each with a signer on `open_relay`, registered with `gated_url` as their
    DM relay once the service is started; the signers are stopped with the rest of `started`."""
    signers = [RemoteSigner(open_relay.url).start() for _ in range(count)]
    started += signers
    service.start()
    for signer in signers:
        register(service, signer.user, new_token(), [gated_url], signer.bunker_uri)
    return signers


def store_url(inbox: RelayProcess | AuthRelay) -> str:
    """Where the tests publish: the relay itself, or the real relay behind the AUTH layer."""
    return inbox.upstream.url if isinstance(inbox, AuthRelay) else inbox.url


def registrations(service: ServiceProcess, keys: nostr_sdk.Keys) -> list[dict[str, Any]]:
    """The owner's view. Calls for one key must be a second apart: the same NIP-98 event made
    twice in one second has the same id and is refused as a replay."""
    path = "/registrations"
    header = make_http_auth(SecretKey(secret_hex_of(keys)), service.url + path, "GET", b"")
    response = httpx.get(service.url + path, headers={"authorization": header}, timeout=scaled(REQUEST_SECONDS))
    assert response.status_code == 200, response.text
    return list(response.json()["devices"])


async def signer_status_becomes(
    service: ServiceProcess, keys: nostr_sdk.Keys, wanted: str, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        await asyncio.sleep(1.05)
        if registrations(service, keys)[0]["auth_signer_status"] == wanted:
            return
    raise AssertionError(f"signer status never became {wanted}")


def users_on(service: ServiceProcess, url: str) -> tuple[int, int]:
    entry = health(service)["relays"].get(url, {})
    return entry.get("users_authenticated", 0), entry.get("users_failed", 0)


def sign_requests(signer: RemoteSigner) -> int:
    return signer.methods().count("sign_event")


STYLES_ON_SQLITE = [pytest.param((style, "sqlite"), id=f"{style}-sqlite") for style in STYLES]
STYLES_BY_ENGINE = [
    *STYLES_ON_SQLITE, pytest.param(("nostr-relay", "postgres"), id="nostr-relay-postgres")
]
SQLITE = Engine("sqlite", None)
"""The engine of the stories about relays and connections rather than the store."""
on_sqlite = pytest.mark.parametrize("parts", STYLES_ON_SQLITE, indirect=True)
on_both_auth_timings = pytest.mark.parametrize(
    "parts",
    [pytest.param((style, "sqlite"), id=f"{style}-sqlite") for style in ("nostr-relay", "khatru-lazy")],
    indirect=True,
)
"""For stories about what the bridge does once a challenge reaches it (asking the signer, backing
off), which the styles differ in only by when they challenge: on connect, or only after a
refused REQ. The styles' own differences are the gift-wrap and sharing stories' (`on_sqlite`)."""


@pytest.fixture(params=STYLES_BY_ENGINE)
def parts(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """An open relay for the signers (also the operator's configured relay), a gated inbox of
    the style, and a service (not started) on the engine, which tests also use for services
    of their own."""
    style, backend = request.param
    engine = engine_of(backend, request)
    started: list[Any] = []
    open_relay = RelayProcess(tmp_path / "open").start()
    started.append(open_relay)
    gated = gated_inbox(tmp_path / "gated", style).start()
    started.append(gated)
    service = ServiceProcess(
        tmp_path / "service", [open_relay.url], FAST_RECONNECT, database=engine.database()
    )
    yield {
        "open": open_relay,
        "gated": gated,
        "service": service,
        "started": started,
        "style": style,
        "engine": engine,
    }
    service.stop()
    for part in reversed(started):
        part.stop()


async def test_gift_wraps_on_a_gated_inbox_are_pushed_only_through_delegated_auth(
    parts: dict[str, Any],
) -> None:
    open_relay, gated, service = parts["open"], parts["gated"], parts["service"]
    secret = "bunker-secret-" + secrets.token_hex(12)
    alice_signer = RemoteSigner(open_relay.url, secret=secret).start()
    carol_signer = RemoteSigner(open_relay.url, refuse=True).start()
    dana_signer = RemoteSigner(f"ws://127.0.0.1:{free_port()}")  # never started: unreachable
    parts["started"] += [alice_signer, carol_signer]
    alice, carol = alice_signer.user, carol_signer.user
    bob, dana, sender = user(), user(), user()
    # every recipient may read the inbox once authenticated as themselves: only delegated
    # AUTH (which alice alone has working) decides who gets pushed
    for recipient in (alice, bob, carol, dana):
        gated.grant_role(hex_of(recipient), "r")
    service.start()
    alice_token = new_token()
    register(service, alice, alice_token, [gated.url], alice_signer.bunker_uri)
    register(service, bob, new_token(), [gated.url])
    register(service, carol, new_token(), [gated.url], carol_signer.bunker_uri)
    register(service, dana, new_token(), [gated.url], dana_signer.bunker_uri)

    await eventually(lambda: users_on(service, gated.url) == (1, 0), "alice authenticated", 45)
    report = health(service)["relays"][gated.url]
    assert report["gated"] == STYLES[parts["style"]]
    # a relay that silently serves nothing is not an error, only flagged (no npub in /health)
    assert report["maybe_gated"] is (STYLES[parts["style"]] is None)
    assert metric(service, "sigil_push_relay_gated_relays") == 1
    assert (
        metric(
            service,
            "sigil_push_delegated_auth_relay_total",
            relay="user",  # a user relay: the users' shared label
            outcome="authenticated",
        )
        == 1
    )

    to_alice = gift_wrap(sender, alice, "only alice's signer opens this door")
    to_bob = gift_wrap(sender, bob, "bob has no signer")
    to_carol = gift_wrap(sender, carol, "carol's signer refuses")
    to_dana = gift_wrap(sender, dana, "dana's signer is unreachable")
    await publish(store_url(gated), to_bob, to_carol, to_dana, to_alice)
    await eventually(lambda: wakeups(service)[to_alice["id"]] == 1, "alice's gift wrap pushed")

    # a refused and an unreachable signer are reported to their owners, not retried in a storm
    await signer_status_becomes(service, carol, "refused")
    assert registrations(service, dana)[0]["delegated_auth"] is False
    assert registrations(service, bob)[0]["delegated_auth"] is False
    assert registrations(service, alice)[0]["auth_signer_status"] == "active"

    # the relay restarts: alice's connection authenticates again, with exactly one more request
    assert sign_requests(alice_signer) == 1
    gated.stop()
    gated.start()
    await eventually(lambda: sign_requests(alice_signer) == 2, "re-authenticated once", 45)
    await eventually(lambda: users_on(service, gated.url) == (1, 0), "alice back", 45)
    after_restart = gift_wrap(sender, alice, "still reachable")
    await publish(store_url(gated), after_restart)
    await eventually(lambda: wakeups(service)[after_restart["id"]] == 1, "pushed after restart")

    pushed = wakeups(service)
    assert pushed[to_alice["id"]] == 1
    for other in (to_bob, to_carol, to_dana):
        assert pushed[other["id"]] == 0, "only delegated AUTH may open a gated inbox"
    assert sign_requests(alice_signer) == 2, "exactly one signer request per connection"
    # the bridge asked alice's signer for the handshake and AUTH events, and nothing else
    assert alice_signer.methods() == ["connect", "get_public_key", "sign_event", "sign_event"]
    assert {r.signed_kind for r in alice_signer.requests if r.method == "sign_event"} == {22242}
    assert carol_signer.methods() == ["connect"], "a refused signer is not asked again"
    await signer_status_becomes(service, dana, "unreachable")
    # alice, carol and dana once each; an unreachable signer is retried after a minute, then
    # after pauses that double, so at most one retry can fit in this test, never a storm
    assert metric(service, "sigil_push_delegated_auth_signer_requests_total", method="connect") <= 4

    # what the operator sees: the shared connection is gated, a user connection authenticated
    relay_records = [
        r for r in service.observation_records() if r["type"] == "relay" and r["relay"] == gated.url
    ]
    states = [r["state"] for r in relay_records]
    assert "authenticated_as_user" in states
    assert ("auth_required" in states) is (STYLES[parts["style"]] is not None)
    # the per-user connection writes no connected/disconnected records of its own: the shared
    # connection's two connects (start, relay restart) are all there is
    assert states.count("connected") == 2

    # the user leaves: their connection to the gated relay closes with their last device
    unregister(service, alice, alice_token)
    await eventually(
        lambda: metric(service, "sigil_push_delegated_auth_connections") == 0,
        "per-user connection closed",
    )
    assert users_on(service, gated.url) == (0, 0)
    assert sign_requests(alice_signer) == 2

    # the secret never reaches the database in clear (its files or a dump), nor any log
    service.stop()
    engine: Engine = parts["engine"]
    assert secret.encode() not in engine.at_rest(service.database)
    assert secret not in engine.dump(service.database)
    assert_private(
        service,
        [
            secret,
            *(hex_of(k) for k in (alice, bob, carol, dana)),
            *(npub_of(k) for k in (alice, bob, carol, dana)),
        ],
    )


@on_both_auth_timings
async def test_a_signer_that_will_not_sign_is_not_asked_in_a_storm(parts: dict[str, Any]) -> None:
    """The session is active but the signer refuses every AUTH signature: the per-user
    connection backs off (default 1 s doubling), the per-user rate limit caps what reaches the
    signer, the failure is counted and the gated DM is not pushed."""
    open_relay, gated = parts["open"], parts["gated"]
    service = ServiceProcess(
        parts["service"].folder.parent / "service-default", [open_relay.url],
        database=parts["engine"].database(),
    )
    parts["started"].append(service)
    signer = RemoteSigner(open_relay.url, refuse_signing=True).start()
    parts["started"].append(signer)
    gated.grant_role(signer.user_hex, "r")
    service.start()
    register(service, signer.user, new_token(), [gated.url], signer.bunker_uri)

    await eventually(lambda: users_on(service, gated.url) == (0, 1), "failure reported", 45)
    wrap = gift_wrap(user(), signer.user, "unreadable without AUTH")
    await publish(store_url(gated), wrap)
    started = time.monotonic()
    await eventually(lambda: time.monotonic() - started > 10, "ten seconds of backoff")  # a pace, not a deadline
    asked = sign_requests(signer)
    assert 1 <= asked <= 6, f"{asked} signature requests in the first minute"
    assert {r.signed_kind for r in signer.requests if r.method == "sign_event"} == {22242}
    assert (
        metric(service, "sigil_push_delegated_auth_relay_total", relay="user", outcome="failed")
        >= 1
    )
    assert users_on(service, gated.url) == (0, 1)
    assert wakeups(service)[wrap["id"]] == 0


@pytest.mark.parametrize(
    "parts", [pytest.param(("nostr-relay", "sqlite"), id="nostr-relay-sqlite")], indirect=True
)
async def test_user_connections_respect_their_cap(parts: dict[str, Any]) -> None:
    """With max_user_connections = 0 an active session opens no connection: it is counted as
    skipped, and the gated relay stays unread. No connection means no relay style to tell
    apart: one gated inbox is enough."""
    open_relay, gated = parts["open"], parts["gated"]
    service = ServiceProcess(
        parts["service"].folder.parent / "service-capped",
        [open_relay.url],
        FAST_RECONNECT + "max_user_connections = 0\n",
        database=parts["engine"].database(),
    )
    parts["started"].append(service)
    signer = RemoteSigner(open_relay.url).start()
    parts["started"].append(signer)
    gated.grant_role(signer.user_hex, "r")
    service.start()
    register(service, signer.user, new_token(), [gated.url], signer.bunker_uri)
    await eventually(
        lambda: metric(service, "sigil_push_delegated_auth_connections_skipped") == 1,
        "the wanted connection counted as skipped",
        45,
    )
    assert users_on(service, gated.url) == (0, 0)
    assert sign_requests(signer) == 0


# how many authenticated keys each style keeps per connection, as the bridge should learn it
AUTH_MODES = {
    "nostr-relay": "multi",  # any key granted `r` reads every DM: both probe REQs are served
    "khatru-lazy": "single",  # a later AUTH replaces the key: the first key's REQ is refused
    "strfry": "single",  # "already authenticated"
    "strfry-closed-first": "single",
    "chorus-multi": "multi",
    "nostr-rs-silent": "single",  # never refuses out loud: a second key proves nothing
}


def start_signers(open_relay: RelayProcess, count: int, parts: dict[str, Any]) -> list[RemoteSigner]:
    signers = [RemoteSigner(open_relay.url).start() for _ in range(count)]
    parts["started"] += signers
    return signers


@on_sqlite
async def test_users_share_a_connection_only_where_the_relay_accepts_several_auths(
    parts: dict[str, Any],
) -> None:
    """Five delegating users on one gated inbox. The bridge learns from the relay's answers
    whether it keeps several authenticated keys per connection (chorus: the users share one)
    or one (strfry, khatru, nostr-rs-relay: a connection each), shows it in /health, and every
    user's DM is pushed once. Each signer is asked once per connection it is on."""
    open_relay, gated, service = parts["open"], parts["gated"], parts["service"]
    users = 5
    signers = start_signers(open_relay, users, parts)
    for signer in signers:
        gated.grant_role(signer.user_hex, "r")
    service.start()
    for signer in signers:
        register(service, signer.user, new_token(), [gated.url], signer.bunker_uri)

    await eventually(lambda: users_on(service, gated.url) == (users, 0), "all users reading", 90)
    report = health(service)["relays"][gated.url]
    expected = AUTH_MODES[parts["style"]]
    assert report["auth_mode"] == expected
    if expected == "multi":
        assert report["user_connections"] < users
    else:
        assert report["user_connections"] == users
    if isinstance(gated, AuthRelay):
        # the relay's own view: which keys each open connection is authenticated as
        carried = gated.keys_by_connection()
        user_keys = {s.user_hex for s in signers}
        on_user_connections = [keys for keys in carried if set(keys) & user_keys]
        if expected == "multi":
            assert len(on_user_connections) < users
            assert set().union(*map(set, on_user_connections)) == user_keys
        else:
            assert sorted(k for keys in on_user_connections for k in keys) == sorted(user_keys)
            assert all(len(keys) == 1 for keys in on_user_connections)

    sender = user()
    wraps = [gift_wrap(sender, s.user, f"to user {n}") for n, s in enumerate(signers)]
    await publish(store_url(gated), *wraps)
    for wrap in wraps:
        await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "every user's DM pushed")

    asked = [sign_requests(s) for s in signers]
    if expected == "multi":
        assert asked == [1] * users, "one signer request per user on a shared connection"
    else:
        # the probe's second user may be asked on the probe connection and on their own
        assert all(1 <= n <= 2 for n in asked) and sum(asked) <= users + 1, asked
    for signer in signers:
        assert {r.signed_kind for r in signer.requests if r.method == "sign_event"} == {22242}
    assert metric(service, "sigil_push_delegated_auth_users") == users
    assert_private(service, [s.user_hex for s in signers] + [npub_of(s.user) for s in signers])


async def test_a_shared_relay_that_turns_one_key_per_connection_is_read_per_user(
    tmp_path: Path
) -> None:
    """A relay learned to accept several AUTHs restarts as strfry (one key per connection, a
    second AUTH refused): the bridge falls back to a connection per user and every user reads
    again, without being told."""
    with delegating(tmp_path, AuthRelay(tmp_path / "gated", "multi"), SQLITE) as (
        open_relay, gated, service, started
    ):
        signers = delegating_users(service, open_relay, gated.url, started, 3)
        await eventually(lambda: users_on(service, gated.url) == (3, 0), "all reading", 90)
        assert health(service)["relays"][gated.url]["auth_mode"] == "multi"
        assert len([k for k in gated.keys_by_connection() if len(k) > 1]) == 1

        gated.stop()
        gated.mode = "strfry"
        gated.start()
        await eventually(
            lambda: health(service)["relays"][gated.url]["auth_mode"] == "single",
            "fell back to one key per connection",
            60,
        )
        await eventually(lambda: users_on(service, gated.url) == (3, 0), "all reading again", 90)
        carried = [k for k in gated.keys_by_connection() if set(k) & {s.user_hex for s in signers}]
        assert sorted(len(k) for k in carried) == [1, 1, 1]
        sender = user()
        wraps = [gift_wrap(sender, s.user, "after the change") for s in signers]
        await publish(gated.upstream.url, *wraps)
        for wrap in wraps:
            await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "pushed per user")


def _restart_as_strfry_with_signers_held(
    gated: AuthRelay, signers: list[RemoteSigner]
) -> dict[str, int]:
    """Hold every signer's answers, then restart the relay as strfry (one key per connection,
    the first AUTH sent wins); how often each user's signer had been asked before."""
    for signer in signers:
        signer.hold()
    asked_before = {s.user_hex: sign_requests(s) for s in signers}
    gated.stop()
    gated.mode = "strfry"
    gated.start()
    return asked_before


async def test_a_one_key_relay_keeps_the_key_it_accepted_when_auths_arrive_out_of_order(
    tmp_path: Path
) -> None:
    """The interleaving behind a flake of the test above under load, forced: after the shared
    relay restarts as strfry, the last user on the shared connection gets its AUTH to the relay
    first (its signer answers first) and is accepted, and before its REQ is answered the other
    users' AUTHs are refused ("already authenticated"). The bridge keeps the key the relay
    accepted on the shared connection (its signer asked once), moves the others to connections
    of their own, and every user reads: nobody is taken as refused. It used to keep the first
    other member instead, whose own AUTH the relay then refused, and mark that user failed."""
    with delegating(tmp_path, AuthRelay(tmp_path / "gated", "multi"), SQLITE) as (
        open_relay, gated, service, started
    ):
        signers = delegating_users(service, open_relay, gated.url, started, 3)
        by_key = {s.user_hex: s for s in signers}
        await eventually(lambda: users_on(service, gated.url) == (3, 0), "all reading", 90)
        assert health(service)["relays"][gated.url]["auth_mode"] == "multi"

        asked_before = _restart_as_strfry_with_signers_held(gated, signers)

        def shared_order() -> list[str] | None:
            """The users' keys in the order the shared connection asked for them again."""
            for requests in gated.dm_requests_by_connection():
                keys = [r[0] for r in requests if len(r) == 1 and r[0] in by_key]
                if len(set(keys)) == len(by_key):
                    return list(dict.fromkeys(keys))
            return None

        await eventually(lambda: shared_order() is not None, "the shared connection back", 60)
        order = shared_order()
        assert order is not None
        accepted, *refused = reversed(order)
        gated.hold_reads({accepted})
        by_key[accepted].release()
        await eventually(
            lambda: [accepted] in gated.keys_by_connection(), "the last user's AUTH accepted"
        )
        for key in refused:
            by_key[key].release()
        await eventually(
            lambda: health(service)["relays"][gated.url]["auth_mode"] == "single",
            "fell back to one key per connection",
            60,
        )
        gated.release_reads()

        await eventually(lambda: users_on(service, gated.url) == (3, 0), "all reading again", 90)
        carried = [k for k in gated.keys_by_connection() if set(k) & set(by_key)]
        assert sorted(len(k) for k in carried) == [1, 1, 1]
        asked = {key: sign_requests(s) - asked_before[key] for key, s in by_key.items()}
        assert asked[accepted] == 1, "the accepted key stays on the shared connection"
        assert all(asked[key] == 2 for key in refused), asked
        wraps = [gift_wrap(user(), s.user, "after the change") for s in signers]
        await publish(gated.upstream.url, *wraps)
        for wrap in wraps:
            await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "pushed per user")


def challenges_signed(signer: RemoteSigner) -> list[str]:
    """The NIP-42 challenge in each AUTH template the signer was asked to sign, in order."""
    return [
        tag[1]
        for r in list(signer.requests) if r.method == "sign_event"
        for tag in json.loads(r.params[0])["tags"] if tag[0] == "challenge"
    ]


async def test_a_reconnect_while_one_signer_signs_asks_nobody_else_for_the_old_challenge(
    tmp_path: Path
) -> None:
    """On a relay whose mode is not learned yet (strfry here), the probe connection's two users
    are asked one after the other for each challenge. The relay restarts while the first user's
    signer is signing: that signature is for a socket that is gone, and the second user's signer
    must not then be asked for the old socket's challenge (a wasted request, charged to that
    user's rate limit, for an AUTH that can never be sent). The new socket's challenge starts a
    fresh round, and both users read.

    The round for the first socket's challenge holds the first user alone (the second joins
    after it began), so the relay restarts twice with every signer held: the second socket's
    round holds both users, and the third socket replaces it while the first user's signer is
    still signing for the second."""
    with delegating(tmp_path, AuthRelay(tmp_path / "gated", "strfry"), SQLITE) as (
        open_relay, gated, service, started
    ):
        signers = [RemoteSigner(open_relay.url).start() for _ in range(2)]
        started += signers
        for signer in signers:
            signer.hold()
        service.start()
        for signer in signers:
            register(service, signer.user, new_token(), [gated.url], signer.bunker_uri)
        keys = {s.user_hex for s in signers}

        def on_one_connection() -> bool:
            return any(
                {k for p in requests for k in p} >= keys
                for requests in gated.dm_requests_by_connection()
            )

        def asked(count: int) -> bool:
            sent = "sigil_push_delegated_auth_signer_requests_total"
            return metric(service, sent, method="sign_event") == count

        # the service counts a request as it sends it, the held signer records it as it takes
        # it up, through the relay a moment later: wait for both
        await eventually(
            lambda: on_one_connection() and asked(1) and sum(map(sign_requests, signers)) == 1,
            "the first user asked", 60,
        )
        # only the first one so far
        first, second = sorted(signers, key=sign_requests, reverse=True)
        assert (sign_requests(first), sign_requests(second)) == (1, 0)
        for restart in (2, 3):
            _restart_as_strfry_with_signers_held(gated, signers)
            await eventually(
                lambda n=restart: on_one_connection() and asked(n),
                f"the first user asked again on socket {restart}",
                60,
            )
        for signer in signers:
            signer.release()

        await eventually(lambda: users_on(service, gated.url) == (2, 0), "both reading", 90)
        assert health(service)["relays"][gated.url]["auth_mode"] == "single"
        carried = [k for k in gated.keys_by_connection() if set(k) & keys]
        assert sorted(carried) == sorted([k] for k in keys), "a connection each"
        live = {session.challenge for session in list(gated.open_sessions)}
        asked_first, asked_second = challenges_signed(first), challenges_signed(second)
        dead = asked_first[:2]
        assert len(asked_first) == 3 and asked_first[2] in live and not set(dead) & live
        assert not set(dead) & set(asked_second), "asked to sign a dead socket's challenge"
        assert asked_second and set(asked_second) <= live, asked_second
        wraps = [gift_wrap(user(), s.user, "after the restarts") for s in signers]
        await publish(gated.upstream.url, *wraps)
        for wrap in wraps:
            await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "pushed per user")


@pytest.mark.parametrize("ok", ["said", "withheld"])
async def test_every_shared_connection_keeps_the_key_its_relay_serves(
    tmp_path: Path, ok: str
) -> None:
    """Two shared connections of two users each (NIP-11 `max_subscriptions = 4`) when the
    relay restarts as strfry. On the second connection the second user's AUTH reaches the
    relay first and is accepted; then the first connection's answers turn the relay `single`,
    and each connection keeps one user. The second connection keeps the user the relay accepted
    when its `OK` has come (`said`: asked once, the other user moves). When the `OK` has not
    come (`withheld`), it can only keep its first user, whose own AUTH the relay then refuses:
    that refusal is the relay serving the other key, so the connection reconnects for that
    user alone instead of marking them failed. Either way every user reads."""
    relay = AuthRelay(tmp_path / "gated", "multi", max_subscriptions=4)
    with delegating(tmp_path, relay, SQLITE) as (open_relay, gated, service, started):
        signers = delegating_users(service, open_relay, gated.url, started, 4)
        by_key = {s.user_hex: s for s in signers}
        await eventually(lambda: users_on(service, gated.url) == (4, 0), "all reading", 90)
        carried = [k for k in gated.keys_by_connection() if set(k) & set(by_key)]
        assert sorted(len(k) for k in carried) == [2, 2]

        asked_before = _restart_as_strfry_with_signers_held(gated, signers)

        def shared_orders() -> list[list[str]]:
            """Per user connection, its users' keys in the order it asked for them again."""
            orders = []
            for requests in gated.dm_requests_by_connection():
                keys = [r[0] for r in requests if len(r) == 1 and r[0] in by_key]
                orders.append(list(dict.fromkeys(keys)))
            return sorted(o for o in orders if len(o) == 2)

        await eventually(lambda: len(shared_orders()) == 2, "both shared connections back", 60)
        (refused, first_accepted), (kept_first, accepted_second) = shared_orders()
        gated.hold_reads({first_accepted, accepted_second})
        if ok == "withheld":
            gated.withhold_oks({accepted_second})
        by_key[first_accepted].release()
        by_key[accepted_second].release()
        await eventually(
            lambda: {(first_accepted,), (accepted_second,)}
            <= set(map(tuple, gated.keys_by_connection())),
            "each connection's second user accepted",
        )
        by_key[refused].release()
        await eventually(
            lambda: health(service)["relays"][gated.url]["auth_mode"] == "single",
            "fell back to one key per connection",
            60,
        )
        by_key[kept_first].release()
        gated.release_reads()

        await eventually(lambda: users_on(service, gated.url) == (4, 0), "all reading again", 90)
        carried = [k for k in gated.keys_by_connection() if set(k) & set(by_key)]
        assert sorted(len(k) for k in carried) == [1, 1, 1, 1]
        asked = {key: sign_requests(s) - asked_before[key] for key, s in by_key.items()}
        assert (asked[first_accepted], asked[refused]) == (1, 2), asked
        if ok == "said":
            assert (asked[accepted_second], asked[kept_first]) == (1, 2), asked
        wraps = [gift_wrap(user(), s.user, "after the change") for s in signers]
        await publish(gated.upstream.url, *wraps)
        for wrap in wraps:
            await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "pushed per user")


@pytest.mark.parametrize("style", ["chorus-multi", "strfry"])
async def test_the_connection_cap_counts_connections_not_users(tmp_path: Path, style: str) -> None:
    """max_user_connections = 2 and four delegating users: on a relay that accepts several
    AUTHs all four read over the allowed connections; on a one-key relay two read and two are
    counted as skipped."""
    with delegating(
        tmp_path, gated_inbox(tmp_path / "gated", style), SQLITE, "max_user_connections = 2\n"
    ) as (open_relay, gated, service, started):
        signers = delegating_users(service, open_relay, gated.url, started, 4)
        reading = 4 if style == "chorus-multi" else 2
        await eventually(
            lambda: users_on(service, gated.url)[0] == reading, f"{reading} users reading", 90
        )
        await eventually(
            lambda: metric(service, "sigil_push_delegated_auth_connections_skipped")
            == 4 - reading,
            "the rest counted as skipped",
            45,
        )
        assert metric(service, "sigil_push_delegated_auth_connections") <= 2
        assert isinstance(gated, AuthRelay)
        user_keys = {s.user_hex for s in signers}
        assert len([k for k in gated.keys_by_connection() if set(k) & user_keys]) <= 2


async def test_a_signer_that_will_not_sign_leaves_a_shared_connection(
    tmp_path: Path
) -> None:
    """On a relay that accepts several AUTHs, one user whose signer refuses to sign does not
    hold the others back: they read over the shared connection, and the refusing user gets a
    connection of their own that backs off, reported as failed."""
    with delegating(tmp_path, AuthRelay(tmp_path / "gated", "multi"), SQLITE) as (
        open_relay, gated, service, started
    ):
        good = [RemoteSigner(open_relay.url).start() for _ in range(3)]
        refusing = RemoteSigner(open_relay.url, refuse_signing=True).start()
        started += [*good, refusing]
        service.start()
        for signer in [good[0], good[1], refusing, good[2]]:
            register(service, signer.user, new_token(), [gated.url], signer.bunker_uri)
        await eventually(lambda: users_on(service, gated.url) == (3, 1), "3 reading, 1 failed", 90)
        report = health(service)["relays"][gated.url]
        assert report["auth_mode"] == "multi"
        assert report["user_connections"] == 2
        good_keys = {s.user_hex for s in good}
        assert any(set(keys) == good_keys for keys in gated.keys_by_connection())
        assert refusing.user_hex not in gated.authenticated
        wraps = [gift_wrap(user(), s.user, "shared") for s in [*good, refusing]]
        await publish(gated.upstream.url, *wraps)
        for wrap in wraps[:3]:
            await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "good users pushed")
        assert wakeups(service)[wraps[3]["id"]] == 0
        assert all(sign_requests(s) == 1 for s in good)


@pytest.mark.parametrize("style", ["strfry", "chorus-multi"])
async def test_a_learned_auth_mode_outlives_a_restart(
    tmp_path: Path, style: str, engine: Engine
) -> None:
    """What a relay's answers taught is kept in the store: after a restart the bridge uses it
    at once (no probe, nothing learned again) and each user's signer is asked exactly once,
    for the user's new connection. Without it, strfry's probe would ask its second user twice
    and chorus would be learned again."""
    with delegating(tmp_path, gated_inbox(tmp_path / "gated", style), engine) as (
        open_relay, gated, service, started
    ):
        signers = delegating_users(service, open_relay, gated.url, started, 3)
        expected = AUTH_MODES[style]
        await eventually(lambda: users_on(service, gated.url) == (3, 0), "all reading", 90)
        assert health(service)["relays"][gated.url]["auth_mode"] == expected
        learned = "sigil_push_delegated_auth_modes_learned_total"
        assert metric(service, learned, mode=expected) == 1

        service.stop()
        asked_before = [sign_requests(s) for s in signers]
        service.start()
        await eventually(lambda: users_on(service, gated.url) == (3, 0), "reading again", 90)
        assert health(service)["relays"][gated.url]["auth_mode"] == expected
        assert metric(service, learned) == 0
        asked = [sign_requests(s) - before for s, before in zip(signers, asked_before, strict=True)]
        assert asked == [1, 1, 1]
        wraps = [gift_wrap(user(), s.user, "after the restart") for s in signers]
        await publish(store_url(gated), *wraps)
        for wrap in wraps:
            await eventually(lambda w=wrap: wakeups(service)[w["id"]] == 1, "pushed once each")
