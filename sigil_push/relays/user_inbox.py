"""Per-user connections to gated inboxes, authenticated through each user's own NIP-46 signer.

Many NIP-17 inbox relays serve DMs only to their recipient after NIP-42 AUTH, so the bridge's
shared connection (authenticated as the bridge) is refused there. For a user whose delegated
AUTH session is active, and only on the gated relays that are that user's own DM relays
(registration `relays`, kind 10050/10002 list), `UserInboxes` reads the user's DMs over a
connection that answers the relay's challenge with the user's signer and subscribes to that
user's DMs alone (one REQ per user). Events go into the bridge's normal ingest (verification,
dedupe, the baseline rule, outbox).

A connection sends each user's REQ as soon as it opens: many inboxes (khatru, strfry) never
challenge on connect and only answer a refused REQ with `["AUTH", challenge]`, before or after
the CLOSED. Each challenge is answered once per user by that user's signer, and the user's REQ
is then sent again under a new subscription id; only an answer to a REQ sent after *that
user's* AUTH (or on a socket that was never challenged) counts as reading, so a pre-AUTH EOSE
with nothing in it, or the late CLOSED of the pre-AUTH REQ, neither baselines the user nor marks
the relay as refusing them.

One key per connection, or several: strfry refuses a second AUTH (`OK false`), khatru lets it
replace the first key, nostr-rs-relay answers `OK true` and keeps the first; chorus accepts
several keys on one connection. Which one a relay does is learned from its answers, per relay
URL, for the life of the process (`auth_mode` in /health):

- `unknown`: one *probe* connection takes two users; the rest wait for the verdict (at most
  LEARN_SECONDS, then each gets a connection of their own, which is always safe). Once the first
  user reads, the second user's AUTH goes out, then a fresh REQ for each of the two keys.
- `multi`: both fresh REQs are served, and the relay had refused a pre-AUTH REQ out loud on that
  socket (so its silence is not a refusal in disguise). Users then share connections, up to
  USERS_PER_SHARED_CONNECTION each (fewer if NIP-11 `max_subscriptions` says so).
- `single`: the second AUTH is refused, or either fresh REQ is refused (a replaced key), or the
  relay never refuses out loud (nostr-rs-relay leaves DMs out silently, so a second key's EOSE
  would prove nothing). Every user gets a connection of their own. A `multi` relay that later
  refuses an AUTH or a REQ after AUTH on a shared connection falls back to `single`.

A user whose signer cannot sign on a shared connection leaves it for a connection of their own,
which closes and reconnects with backoff when its only signer fails, so a broken signer never
holds back the other users and is asked at most once per challenge. The fairness caps hold:
pairs are served round-robin over keys, and `bridge.max_user_connections` caps connections.

The set of connections is recomputed from scratch whenever an input changes (a relay becomes
gated or not, a session's status, a user's relays, an unregistration, a learned mode): one
coalesced pass over the active sessions, cheap even for thousands of users, and never out of
step with its inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter as Tally
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import Counter, Gauge

from sigil_push.config import BridgeConfig
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import AuthSigner, AuthUnavailable, RelayConnection
from sigil_push.relays.subscriptions import DM_KINDS

log = logging.getLogger(__name__)

SUB_PREFIX = "dm."
USERS_PER_SHARED_CONNECTION = 50
"""Users on one connection to a relay that accepts several AUTHs: one REQ each, well inside
chorus's default 128 subscriptions per connection, and one socket's challenge answered by at
most this many signers at once."""
PROBE_USERS = 2
LEARN_SECONDS = 30.0
"""How long the other users of a relay wait for the probe's verdict before each gets a
connection of their own."""

AuthMode = Literal["unknown", "single", "multi"]

GATED_RELAYS = Gauge(
    "sigil_push_relay_gated_relays",
    "Relays whose shared connection is refused even after AUTH (gated inboxes)",
)
USER_CONNECTIONS = Gauge(
    "sigil_push_delegated_auth_connections", "Per-user connections open for delegated AUTH"
)
USERS_SERVED = Gauge(
    "sigil_push_delegated_auth_users",
    "(relay, user) pairs carried by per-user connections, shared ones included",
)
USER_CONNECTIONS_SKIPPED = Gauge(
    "sigil_push_delegated_auth_connections_skipped",
    "(relay, user) pairs wanted but not served because of bridge.max_user_connections",
)
USER_AUTHS = Counter(
    "sigil_push_delegated_auth_relay_total",
    "Delegated AUTH attempts on gated relays, by outcome (no per-user labels)",
    ["relay", "outcome"],
)
MODES_LEARNED = Counter(
    "sigil_push_delegated_auth_modes_learned_total",
    "Relays learned to keep one authenticated key per connection (single) or several (multi)",
    ["mode"],
)


class InboxOwner(Protocol):
    """What the per-user connections need from the bridge."""

    def gated_relays(self) -> set[str]: ...

    def user_relays(self, pubkey: str) -> frozenset[str]: ...

    def baselines_of(self, url: str) -> set[str]: ...

    def baselined(self, url: str, keys: frozenset[str]) -> None: ...

    def on_user_event(
        self, url: str, pubkey: str, raw: Any, received_ms: int, baseline: bool
    ) -> None: ...

    def congested(self, url: str) -> bool: ...

    async def drained(self, url: str) -> None: ...


class SessionSource(Protocol):
    """The delegated AUTH sessions (sigil_push.delegated_auth.DelegatedAuth)."""

    def active_pubkeys(self) -> set[str]: ...

    def signer_for(self, pubkey: str) -> AuthSigner: ...


@dataclass(slots=True, eq=False)
class _Member:
    """One user on one connection; the socket-bound fields reset on every open."""

    pubkey: str
    signer: AuthSigner
    sub_id: str | None = None
    authed: bool = False
    """This user's AUTH went out on the current socket."""
    fresh: bool = False
    eosed: bool = False
    authenticated: bool = False
    failed: bool = False


@dataclass(slots=True)
class _Probe:
    """The second-key test: after `second`'s AUTH, a fresh REQ for each key, by subscription."""

    first: str
    second: str
    pending: dict[str, str] = field(default_factory=dict)
    served: set[str] = field(default_factory=set)


class InboxConnection:
    """One connection to a gated relay, carrying one user or (on a `multi` relay) several.

    It is the connection's handler and its AuthResponder: it answers each challenge with one
    AUTH per user, from that user's signer, and subscribes each user again after their AUTH.
    """

    def __init__(
        self,
        url: str,
        manager: UserInboxes,
        observations: ObservationLog,
        settings: BridgeConfig,
        solo: bool,
    ) -> None:
        self.url = url
        self.solo = solo
        """Reserved for one user (whose signer failed on a shared connection): nobody joins."""
        self.members: dict[str, _Member] = {}
        self.opened_at = time.monotonic()
        self._manager = manager
        self._owner = manager.owner
        self._catchup = settings.catchup_seconds
        # sub id -> (pubkey, sent after that user's AUTH); kept until the socket resets, so a
        # late answer to a replaced REQ is still recognised for what it was
        self._subs: dict[str, tuple[str, bool]] = {}
        self._sub_seq = 0
        self._challenge: str | None = None
        self._said_no = False
        """The relay refused a pre-AUTH REQ out loud on this socket (CLOSED or NOTICE)."""
        self._probe: _Probe | None = None
        self._auth_ids: dict[str, str] = {}
        self._tasks: set[asyncio.Task[object]] = set()
        self.connection = RelayConnection(
            url,
            self,
            self,
            observations,
            settings.reconnect_min_seconds,
            settings.reconnect_max_seconds,
            per_user=True,
            max_frame_bytes=settings.max_frame_bytes,
        )

    def start(self) -> None:
        self.connection.start()

    async def stop(self) -> None:
        await self.connection.stop()
        for task in list(self._tasks):
            task.cancel()
        for member in self.members.values():
            self._set_authenticated(member, False)

    # membership (called by UserInboxes) --------------------------------------------------

    def add(self, pubkey: str, signer: AuthSigner) -> None:
        others_authed = any(m.authed and not m.failed for m in self.members.values())
        member = self.members[pubkey] = _Member(pubkey, signer)
        if not self.connection.connected:
            return  # on_open subscribes every member
        if self._challenge is None:
            # may draw the challenge from a relay that only challenges a refused REQ
            self._subscribe(member)
        elif self._manager.mode(self.url) == "multi" or not others_authed:
            generation = self.connection.socket_generation
            self._spawn(self._authenticate(member, self._challenge, generation))
        else:
            self._maybe_probe()

    def remove(self, pubkey: str) -> None:
        member = self.members.pop(pubkey, None)
        if member is None:
            return
        if member.sub_id is not None and self.connection.connected:
            self._spawn(self._close(member.sub_id))
        for sub_id in [s for s, (p, _) in self._subs.items() if p == pubkey]:
            del self._subs[sub_id]
        self._set_authenticated(member, False)
        if self._probe is not None and pubkey in (self._probe.first, self._probe.second):
            self._probe = None

    def primary(self) -> str | None:
        """The user to keep when the relay allows one key: the first one reading, else the first."""
        reading = next((p for p, m in self.members.items() if m.authenticated), None)
        return reading or next(iter(self.members), None)

    # AuthResponder ---------------------------------------------------------------------

    async def answer_challenge(self, connection: RelayConnection, challenge: str) -> None:
        """One AUTH per user: all at once on a `multi` relay; otherwise the first user whose
        signer signs (on an unknown relay the second key is tried only once the first reads)."""
        self._challenge = challenge
        generation = connection.socket_generation
        if self._manager.mode(self.url) == "multi":
            members = list(self.members.values())
            await asyncio.gather(*(self._authenticate(m, challenge, generation) for m in members))
            return
        for member in list(self.members.values()):
            if self.members.get(member.pubkey) is member and await self._authenticate(
                member, challenge, generation
            ):
                return

    def on_auth_result(
        self, connection: RelayConnection, event_id: str, accepted: bool, reason: str
    ) -> None:
        pubkey = self._auth_ids.pop(event_id, None)
        if pubkey is None or accepted:
            return
        probe = self._probe
        if probe is not None and pubkey == probe.second:
            # strfry: "already authenticated"
            self._verdict("single", probe.first)
        elif self._manager.mode(self.url) == "multi" and self._others_authed(pubkey):
            self._verdict("single", self._survivor(excluding=pubkey))
        # a lone user's refused AUTH shows as the CLOSED of the REQ that follows it

    async def _authenticate(self, member: _Member, challenge: str, generation: int) -> bool:
        """Ask the user's signer once for this challenge, send the AUTH, then the user's REQ."""
        try:
            event = await member.signer.sign_auth(self.url, challenge)
        except AuthUnavailable as exc:
            log.warning(
                "relay %s: cannot answer NIP-42 AUTH for a user (%s)", self.url, type(exc).__name__
            )
            self._fail(member)
            if self.members.get(member.pubkey) is member:
                if len(self.members) == 1:
                    # the relay will not challenge this socket again: reconnect with backoff
                    self._manager.reserve(self, member.pubkey)
                    await self.connection.drop(generation)
                else:
                    self._manager.evict(self, member.pubkey)
            return False
        if self.members.get(member.pubkey) is not member:
            return False
        self._auth_ids[event.id] = member.pubkey
        if not await self.connection.send_auth(event, generation):
            self._auth_ids.pop(event.id, None)
            return False
        if self.members.get(member.pubkey) is not member:
            return False  # the relay's answer to this AUTH already moved the user elsewhere
        member.authed = True
        self._subscribe(member)
        return True

    # connection callbacks ---------------------------------------------------------------

    def on_open(self, connection: RelayConnection) -> None:
        """Ask straight away: the relay may never challenge until it has a REQ to refuse."""
        self._subs.clear()
        self._auth_ids.clear()
        self._challenge = None
        self._said_no = False
        self._probe = None
        for member in self.members.values():
            member.sub_id = None
            member.authed = False
            member.eosed = False
        for member in list(self.members.values()):
            self._subscribe(member)

    def on_authenticated(self, connection: RelayConnection) -> None:
        """Not called: this connection answers challenges itself (answer_challenge)."""

    def on_auth_failed(self, connection: RelayConnection) -> None:
        """Not called: signer failures are handled per user in _authenticate."""

    def on_event(
        self, connection: RelayConnection, sub_id: str, raw: Any, received_ms: int
    ) -> None:
        entry = self._subs.get(sub_id)
        member = self.members.get(entry[0]) if entry is not None else None
        if member is not None:
            # until a REQ that counts reached EOSE, what a fresh user gets predates them
            baseline = member.fresh and not member.eosed
            self._owner.on_user_event(self.url, member.pubkey, raw, received_ms, baseline)

    def on_eose(self, connection: RelayConnection, sub_id: str) -> None:
        entry = self._subs.get(sub_id)
        if entry is None:
            return
        pubkey, after_auth = entry
        member = self.members.get(pubkey)
        # a pre-AUTH answer proves nothing (nostr-rs-relay leaves the DMs out silently)
        if (
            member is not None
            and sub_id == member.sub_id
            and not member.eosed
            and (after_auth or not connection.challenged)
        ):
            member.eosed = True
            if member.fresh:
                # stored after every event before this EOSE is committed (the bridge's rule)
                self._owner.baselines_of(self.url).add(pubkey)
                self._owner.baselined(self.url, frozenset((pubkey,)))
            member.failed = False
            USER_AUTHS.labels(self.url, "authenticated").inc()
            self._set_authenticated(member, True)
        self._probe_answer(sub_id, served=True)
        self._maybe_probe()

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None:
        """Only a CLOSED of a REQ sent after its user's AUTH is a refusal of that user; one
        for an earlier REQ is the relay asking for AUTH, and shows that it says no out loud."""
        entry = self._subs.get(sub_id)
        if entry is None:
            return
        pubkey, after_auth = entry
        if not after_auth:
            if connection.refusal(sub_id):
                self._said_no = True
            return
        self._probe_answer(sub_id, served=False)
        member = self.members.get(pubkey)
        if member is None or sub_id != member.sub_id:
            return
        if self._manager.mode(self.url) == "multi" and self._others_authed(pubkey):
            # a shared connection's REQ refused after AUTH: the relay no longer serves several
            self._verdict("single", self._survivor(excluding=pubkey))
            if pubkey not in self.members:
                return
        self._refused(member)

    def on_gated(self, connection: RelayConnection) -> None:
        """A relay that refuses and never challenges refuses every user on this socket; a
        refusal after AUTH arrives per REQ through on_closed."""
        if connection.gated_reason and not connection.challenged:
            for member in list(self.members.values()):
                self._refused(member)

    def on_down(self, connection: RelayConnection) -> None:
        self._probe = None
        for member in self.members.values():
            member.sub_id = None
            self._set_authenticated(member, False)

    def congested(self, connection: RelayConnection) -> bool:
        return self._owner.congested(connection.url)

    async def drained(self, connection: RelayConnection) -> None:
        await self._owner.drained(connection.url)

    # subscriptions ------------------------------------------------------------------------

    def _subscribe(self, member: _Member) -> str:
        """A new REQ for this user's DMs; the one it replaces is closed after it (no gap)."""
        member.fresh = member.pubkey not in self._owner.baselines_of(self.url)
        self._sub_seq += 1
        old, member.sub_id = member.sub_id, f"{SUB_PREFIX}{self._sub_seq}"
        self._subs[member.sub_id] = (member.pubkey, member.authed)
        since = int(time.time()) - self._catchup
        dm_filter = {"kinds": list(DM_KINDS), "#p": [member.pubkey], "since": since}
        self._spawn(self._send(["REQ", member.sub_id, dm_filter], old))
        return member.sub_id

    async def _send(self, request: list[Any], replaces: str | None) -> None:
        await self.connection.send(request)
        if replaces is not None:
            await self._close(replaces)

    async def _close(self, sub_id: str) -> None:
        await self.connection.send(["CLOSE", sub_id])

    # learning ---------------------------------------------------------------------------

    def _maybe_probe(self) -> None:
        """On a relay of unknown mode, once one user reads after AUTH, try a second key."""
        if (
            self._probe is not None
            or self._challenge is None
            or self._manager.mode(self.url) != "unknown"
        ):
            return
        first = next((m for m in self.members.values() if m.authenticated and m.authed), None)
        if first is None:
            return
        if not self._said_no:
            # a relay that never refuses out loud would answer a second key's REQ with EOSE
            # whether it serves that key or not: nothing to learn, so one key per connection
            self._verdict("single", first.pubkey)
            return
        second = next(
            (m for m in self.members.values() if not m.authed and not m.failed), None
        )
        if second is None:
            return
        self._probe = _Probe(first.pubkey, second.pubkey)
        generation = self.connection.socket_generation
        self._spawn(self._run_probe(self._probe, first, second, self._challenge, generation))

    async def _run_probe(
        self, probe: _Probe, first: _Member, second: _Member, challenge: str, generation: int
    ) -> None:
        if not await self._authenticate(second, challenge, generation):
            if self._probe is probe:
                self._probe = None
            return
        if self._probe is not probe or second.sub_id is None:
            return
        # both keys asked again after the second AUTH: a relay that let the second key replace
        # the first (khatru) now refuses the first
        probe.pending[second.sub_id] = second.pubkey
        probe.pending[self._subscribe(first)] = first.pubkey

    def _probe_answer(self, sub_id: str, served: bool) -> None:
        probe = self._probe
        if probe is None or sub_id not in probe.pending:
            return
        pubkey = probe.pending.pop(sub_id)
        if not served:
            self._verdict("single", probe.second if pubkey == probe.first else probe.first)
        else:
            probe.served.add(pubkey)
            if not probe.pending and probe.served == {probe.first, probe.second}:
                self._verdict("multi", None)

    def _verdict(self, mode: AuthMode, survivor: str | None) -> None:
        self._probe = None
        self._manager.learned(self, mode, survivor)

    def _others_authed(self, pubkey: str) -> bool:
        return any(m.authed for p, m in self.members.items() if p != pubkey)

    def _survivor(self, excluding: str) -> str | None:
        return next(
            (p for p, m in self.members.items() if p != excluding and m.authenticated),
            next((p for p in self.members if p != excluding), None),
        )

    # state ------------------------------------------------------------------------------

    def _refused(self, member: _Member) -> None:
        """The relay refused the user's own subscription even after the user's AUTH."""
        if not member.failed:
            log.info("relay %s refuses a user's subscription after delegated AUTH", self.url)
        self._fail(member)
        self._set_authenticated(member, False)

    def _fail(self, member: _Member) -> None:
        member.failed = True
        USER_AUTHS.labels(self.url, "failed").inc()

    def _set_authenticated(self, member: _Member, value: bool) -> None:
        if value != member.authenticated:
            member.authenticated = value
            self._manager.authenticated_changed(self.url, value)

    def _spawn(self, coroutine: Coroutine[Any, Any, object]) -> None:
        task: asyncio.Task[object] = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class UserInboxes:
    """Opens, fills and closes the per-user connections so they always match their inputs."""

    def __init__(
        self,
        owner: InboxOwner,
        sessions: SessionSource,
        observations: ObservationLog,
        settings: BridgeConfig,
    ) -> None:
        self.owner = owner
        self._sessions = sessions
        self._observations = observations
        self._settings = settings
        self._by_url: dict[str, list[InboxConnection]] = {}
        self._where: dict[tuple[str, str], InboxConnection] = {}
        self._solo: set[tuple[str, str]] = set()
        self._modes: dict[str, AuthMode] = {}
        self._learning_since: dict[str, float] = {}
        self._gave_up: set[str] = set()
        self._waiting: Tally[str] = Tally()
        self._authenticated: Tally[str] = Tally()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._labelled: set[str] = set()
        GATED_RELAYS.set(0)
        USER_CONNECTIONS.set(0)
        USERS_SERVED.set(0)
        USER_CONNECTIONS_SKIPPED.set(0)
        for mode in ("single", "multi"):
            MODES_LEARNED.labels(mode)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="user-inboxes")
        self.changed()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        connections = [c for conns in self._by_url.values() for c in conns]
        self._by_url, self._where = {}, {}
        await asyncio.gather(*(c.stop() for c in connections), *self._stopping)

    def changed(self) -> None:
        """Some input changed (gating, relays, registrations): reconcile soon, coalesced."""
        self._wake.set()

    def session_changed(self, pubkey: str, status: str) -> None:
        """DelegatedAuth listener: a session became active, refused, unreachable or removed.
        A new or renewed session gets another chance to share a connection."""
        self._solo = {key for key in self._solo if key[1] != pubkey}
        self._wake.set()

    def mode(self, url: str) -> AuthMode:
        return self._modes.get(url, "unknown")

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._reconcile()

    # what the connections report --------------------------------------------------------

    def learned(self, connection: InboxConnection, mode: AuthMode, survivor: str | None) -> None:
        """A connection's answers showed how many keys the relay keeps per connection. On a
        one-key relay the connection keeps `survivor` (the key the relay now serves); the
        others get connections of their own at the next reconcile."""
        url = connection.url
        if self._modes.get(url) != mode:
            self._modes[url] = mode
            MODES_LEARNED.labels(mode).inc()
            log.info(
                "relay %s keeps %s", url,
                "several authenticated keys per connection" if mode == "multi"
                else "one authenticated key per connection",
            )
        if mode == "single":
            for pubkey in [p for p in connection.members if p != survivor]:
                self._detach(connection, pubkey)
        self.changed()

    def evict(self, connection: InboxConnection, pubkey: str) -> None:
        """The user's signer failed on a shared connection: they get a connection of their
        own, so the others keep reading."""
        self._solo.add((connection.url, pubkey))
        self._detach(connection, pubkey)
        self.changed()

    def reserve(self, connection: InboxConnection, pubkey: str) -> None:
        """A lone user's signer failed: the connection stays theirs (nobody joins a connection
        that is about to back off)."""
        connection.solo = True
        self._solo.add((connection.url, pubkey))

    def authenticated_changed(self, url: str, authenticated: bool) -> None:
        """Count authenticated users per relay; the log notes only that some user is, once per
        stretch in which at least one is (no pubkeys, no counts)."""
        if authenticated:
            self._authenticated[url] += 1
            if self._authenticated[url] == 1:
                self._observations.relay_state(url, "authenticated_as_user", "delegated AUTH")
        else:
            self._authenticated[url] -= 1
            if self._authenticated[url] <= 0:
                del self._authenticated[url]

    # reconciling ------------------------------------------------------------------------

    def _wanted(self, gated: set[str]) -> list[tuple[str, str]]:
        """Round-robin over keys: every key's first gated relay before any key's second, so a
        key naming many gated relays cannot spend `max_user_connections` on itself alone."""
        if not gated:
            return []
        per_key = [
            [(url, pubkey) for url in sorted(self.owner.user_relays(pubkey) & gated)]
            for pubkey in sorted(self._sessions.active_pubkeys())
        ]
        return [
            pairs[rank] for rank in range(max(map(len, per_key), default=0))
            for pairs in per_key if rank < len(pairs)
        ]

    def _reconcile(self) -> None:
        gated = self.owner.gated_relays()
        GATED_RELAYS.set(len(gated))
        wanted = self._wanted(gated)
        wanted_set = set(wanted)
        for key in [k for k in self._where if k not in wanted_set]:
            self._detach(self._where[key], key[1])
        self._solo &= wanted_set
        for url, connections in list(self._by_url.items()):
            if self.mode(url) == "single":
                for shared in list(connections):
                    keep = shared.primary()
                    for pubkey in [p for p in shared.members if p != keep]:
                        self._detach(shared, pubkey)
        # pairs already served keep their place under the cap: no churn when it is reached
        skipped = 0
        self._waiting.clear()
        for key in wanted:
            if key in self._where:
                continue
            url, pubkey = key
            connection = self._room_on(url, key)
            if connection is None:
                if self._learning(url):
                    self._waiting[url] += 1
                    continue
                if self._connection_count() >= self._settings.max_user_connections:
                    skipped += 1
                    continue
                connection = self._open(url, solo=key in self._solo)
            connection.add(pubkey, self._sessions.signer_for(pubkey))
            self._where[key] = connection
        USER_CONNECTIONS_SKIPPED.set(skipped)
        USER_CONNECTIONS.set(self._connection_count())
        USERS_SERVED.set(len(self._where))
        # a relay with no user connection left drops its labelled series (URLs churn)
        remaining = set(self._by_url)
        for url in self._labelled - remaining:
            for outcome in ("authenticated", "failed"):
                with contextlib.suppress(KeyError):
                    USER_AUTHS.remove(url, outcome)
        self._labelled = remaining

    def _placement(self, url: str) -> AuthMode:
        """How users are placed on `url`: its learned mode, and `single` once an unknown
        relay's probe has had LEARN_SECONDS without a verdict."""
        mode = self.mode(url)
        return "single" if mode == "unknown" and url in self._gave_up else mode

    def _room_on(self, url: str, key: tuple[str, str]) -> InboxConnection | None:
        """An open connection on `url` this pair may join, if the relay allows sharing."""
        placement = self._placement(url)
        if key in self._solo or placement == "single":
            return None
        limit = self._group_size(url) if placement == "multi" else PROBE_USERS
        return next(
            (c for c in self._by_url.get(url, []) if not c.solo and len(c.members) < limit),
            None,
        )

    def _learning(self, url: str) -> bool:
        """Whether new users of `url` wait for the probe's verdict (a bounded while)."""
        if self._placement(url) != "unknown" or not any(
            not c.solo for c in self._by_url.get(url, [])
        ):
            return False
        started = self._learning_since.get(url)
        if started is None:
            # the clock starts when the first user has to wait
            started = self._learning_since[url] = time.monotonic()
            asyncio.get_running_loop().call_later(LEARN_SECONDS + 0.1, self.changed)
        if time.monotonic() - started >= LEARN_SECONDS:
            self._gave_up.add(url)
            return False
        return True

    def _group_size(self, url: str) -> int:
        limits = next(
            (c.connection.limits for c in self._by_url.get(url, []) if c.connection.limits), None
        )
        if limits is not None and limits.max_subscriptions:
            # one REQ per user, and room for each user's replacement REQ in flight
            return max(1, min(USERS_PER_SHARED_CONNECTION, limits.max_subscriptions // 2))
        return USERS_PER_SHARED_CONNECTION

    def _open(self, url: str, solo: bool) -> InboxConnection:
        connection = InboxConnection(url, self, self._observations, self._settings, solo)
        self._by_url.setdefault(url, []).append(connection)
        connection.start()
        return connection

    def _detach(self, connection: InboxConnection, pubkey: str) -> None:
        """Take the user off the connection; a connection left without users closes."""
        connection.remove(pubkey)
        self._where.pop((connection.url, pubkey), None)
        if connection.members:
            return
        connections = self._by_url.get(connection.url, [])
        if connection in connections:
            connections.remove(connection)
            if not connections:
                del self._by_url[connection.url]
            self._spawn_stop(connection.stop())

    def _connection_count(self) -> int:
        return sum(len(connections) for connections in self._by_url.values())

    def _spawn_stop(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    # health -----------------------------------------------------------------------------

    def health(self) -> dict[str, dict[str, Any]]:
        """Per gated relay: users reading, failed and waiting for the mode to be learned, the
        connections carrying them, and what the relay's answers taught (`auth_mode`)."""
        report: dict[str, dict[str, Any]] = {}
        for url in set(self._by_url) | set(self._modes) | self.owner.gated_relays():
            members = [m for c in self._by_url.get(url, []) for m in c.members.values()]
            report[url] = {
                "users_authenticated": sum(m.authenticated for m in members),
                "users_failed": sum(m.failed for m in members),
                "users_waiting": self._waiting.get(url, 0),
                "user_connections": len(self._by_url.get(url, [])),
                "auth_mode": self.mode(url),
            }
        return report
