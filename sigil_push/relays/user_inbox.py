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
URL, and kept in the store (`store.auth_modes`), so a restart or another worker does not
probe the relay again (`auth_mode` in /health):

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
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

from sigil_push.config import BridgeConfig
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import AuthSigner
from sigil_push.relays.inbox_connection import USER_AUTHS, AuthMode, InboxConnection
from sigil_push.relays.port import BridgePort, UserRelays
from sigil_push.store.auth_modes import LearnedAuthModes
from sigil_push.store.errors import STORE_UNAVAILABLE
from sigil_push.supervisor import BackgroundTasks
from sigil_push.telemetry.redaction import relay_label

log = logging.getLogger(__name__)

USERS_PER_SHARED_CONNECTION = 50
"""Users on one connection to a relay that accepts several AUTHs: one REQ each, well inside
chorus's default 128 subscriptions per connection, and one socket's challenge answered by at
most this many signers at once."""
PROBE_USERS = 2
"""Users on the first connection to a relay whose mode is unknown: the key that reads first
and the one whose AUTH tests the relay."""
LEARN_SECONDS = 30.0
"""How long the other users of a relay wait for the probe's verdict before each gets a
connection of their own."""

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
MODES_LEARNED = Counter(
    "sigil_push_delegated_auth_modes_learned_total",
    "Relays learned to keep one authenticated key per connection (single) or several (multi)",
    ["mode"],
)


class SessionSource(Protocol):
    """The delegated AUTH sessions (sigil_push.relays.delegated_auth.DelegatedAuth)."""

    def active_pubkeys(self) -> set[str]: ...

    def signer_for(self, pubkey: str) -> AuthSigner: ...

    @property
    def learned_modes(self) -> LearnedAuthModes: ...


class SharedRelays(Protocol):
    """The relay pool's state the per-user connections share (`RelayPool`)."""

    def baselines_of(self, url: str) -> set[str]: ...

    def gated(self) -> Mapping[str, str]: ...


class UserInboxes:
    """Opens, fills and closes the per-user connections so they always match their inputs."""

    def __init__(
        self,
        sessions: SessionSource,
        observations: ObservationLog,
        settings: BridgeConfig,
        port: BridgePort,
        shared: SharedRelays,
        keys: UserRelays,
        wake: asyncio.Event,
    ) -> None:
        """`port`: where events, baselines and back-pressure go; `shared`: the pool, whose
        gated relays these connections serve and whose baselines they share; `keys`: each
        user's own relays; `wake` is set by whatever changes those (gating, relays,
        registrations), and the connections are reconciled soon after (coalesced)."""
        self.port = port
        self._shared = shared
        self._keys = keys
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
        self._wake = wake
        self._task: asyncio.Task[None] | None = None
        self._stopping = BackgroundTasks("user-inboxes")
        self._labelled: set[str] = set()
        GATED_RELAYS.set(0)
        USER_CONNECTIONS.set(0)
        USERS_SERVED.set(0)
        USER_CONNECTIONS_SKIPPED.set(0)
        for mode in ("single", "multi"):
            MODES_LEARNED.labels(mode)

    def baselines_of(self, url: str) -> set[str]:
        return self._shared.baselines_of(url)

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
        await asyncio.gather(*(c.stop() for c in connections), *self._stopping.running())

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
        await self._restore_modes()
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._reconcile()

    async def _restore_modes(self) -> None:
        """Before the first reconcile: the verdicts saved by an earlier run or another worker
        (one learned since start-up wins). Without the store, every relay is probed again."""
        try:
            saved = await self._sessions.learned_modes.load()
        except STORE_UNAVAILABLE as error:
            log.warning("learned AUTH modes not loaded: %s", type(error).__name__)
            return
        for url, mode in saved.items():
            self._modes.setdefault(url, mode)

    # what the connections report --------------------------------------------------------

    def learned(
        self, connection: InboxConnection, mode: AuthMode, survivor: str | None, reason: str
    ) -> None:
        """A connection's answers showed how many keys the relay keeps per connection. On a
        one-key relay the connection keeps `survivor` (the key the relay now serves); the
        others get connections of their own at the next reconcile."""
        url = connection.url
        if mode == "multi" and self.mode(url) == "single":
            return  # a late probe never undoes a relay's refusal: single stays single
        if self._modes.get(url) != mode:
            self._modes[url] = mode
            MODES_LEARNED.labels(mode).inc()
            if mode != "unknown":
                self._spawn_tracked(self._sessions.learned_modes.save(url, mode))
            log.info(
                "relay %s keeps %s (%s)", relay_label(url),
                "several authenticated keys per connection" if mode == "multi"
                else "one authenticated key per connection", reason,
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
                self._observations.relay_state(relay_label(url), "authenticated_as_user", "delegated AUTH")
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
            [(url, pubkey) for url in sorted(self._keys.user_relays(pubkey) & gated)]
            for pubkey in sorted(self._sessions.active_pubkeys())
        ]
        return [
            pairs[rank] for rank in range(max(map(len, per_key), default=0))
            for pairs in per_key if rank < len(pairs)
        ]

    def _reconcile(self) -> None:
        gated = set(self._shared.gated())
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
        if self._where.get((connection.url, pubkey)) is connection:
            del self._where[(connection.url, pubkey)]
        if connection.members:
            return
        connections = self._by_url.get(connection.url, [])
        if connection in connections:
            connections.remove(connection)
            if not connections:
                del self._by_url[connection.url]
            self._spawn_tracked(connection.stop())

    def _connection_count(self) -> int:
        return sum(len(connections) for connections in self._by_url.values())

    def _spawn_tracked(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` (a connection's stop, a verdict's save) in the background; `stop()`
        waits for every such task before it returns."""
        self._stopping.spawn(coroutine)

    # health -----------------------------------------------------------------------------

    def health(self) -> dict[str, dict[str, Any]]:
        """Per gated relay: users reading, failed and waiting for the mode to be learned, the
        connections carrying them, and what the relay's answers taught (`auth_mode`)."""
        report: dict[str, dict[str, Any]] = {}
        for url in set(self._by_url) | set(self._modes) | set(self._shared.gated()):
            members = [m for c in self._by_url.get(url, []) for m in c.members.values()]
            report[url] = {
                "users_authenticated": sum(m.authenticated for m in members),
                "users_failed": sum(m.failed for m in members),
                "users_waiting": self._waiting.get(url, 0),
                "user_connections": len(self._by_url.get(url, [])),
                "auth_mode": self.mode(url),
            }
        return report
