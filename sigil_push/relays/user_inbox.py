"""Per-user connections to gated inboxes, authenticated through each user's own NIP-46 signer.

Many NIP-17 inbox relays serve DMs only to their recipient after NIP-42 AUTH, so the bridge's
shared connection (authenticated as the bridge) is refused there. For a user whose delegated
AUTH session is active, and only on the gated relays that are that user's own DM relays
(registration `relays`, kind 10050/10002 list), `UserInboxes` keeps one extra connection that
answers the relay's challenge with the user's signer and subscribes to that user's DMs alone.
Events go into the bridge's normal ingest (verification, dedupe, the baseline rule, outbox).

A per-user connection sends its REQ as soon as it opens: many inboxes (khatru, strfry) never
challenge on connect and only answer a refused REQ with `["AUTH", challenge]`, before or after
the CLOSED. Each challenge is answered once by the user's signer, and the REQ is then sent again
under a new subscription id; only an answer to a REQ sent after that AUTH (or on a socket that
was never challenged) counts as reading, so a pre-AUTH EOSE with nothing in it, or the late
CLOSED of the pre-AUTH REQ, neither baselines the user nor marks the relay as refusing them.

The set of connections is recomputed from scratch whenever an input changes (a relay becomes
gated or not, a session's status, a user's relays, an unregistration): one coalesced pass over
the active sessions, cheap even for thousands of users, and never out of step with its inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter as Tally
from collections.abc import Coroutine
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

from sigil_push.config import BridgeConfig
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import AuthSigner, RelayConnection
from sigil_push.relays.subscriptions import DM_KINDS

log = logging.getLogger(__name__)

SUB_PREFIX = "dm."

GATED_RELAYS = Gauge(
    "sigil_push_relay_gated_relays",
    "Relays whose shared connection is refused even after AUTH (gated inboxes)",
)
USER_CONNECTIONS = Gauge(
    "sigil_push_delegated_auth_connections", "Per-user connections open for delegated AUTH"
)
USER_CONNECTIONS_SKIPPED = Gauge(
    "sigil_push_delegated_auth_connections_skipped",
    "Per-user connections wanted but not opened because of bridge.max_user_connections",
)
USER_AUTHS = Counter(
    "sigil_push_delegated_auth_relay_total",
    "Delegated AUTH attempts on gated relays, by outcome (no per-user labels)",
    ["relay", "outcome"],
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


class UserInbox:
    """One user's connection to one gated relay: the handler of a per-user RelayConnection.

    It subscribes at once and again after each AUTH the user's signer answered, and applies the
    baseline rule for (relay, user) with the same set the shared connection uses.
    """

    def __init__(
        self,
        url: str,
        pubkey: str,
        manager: UserInboxes,
        signer: AuthSigner,
        observations: ObservationLog,
        settings: BridgeConfig,
    ) -> None:
        self.url = url
        self.pubkey = pubkey
        self._manager = manager
        self._owner = manager.owner
        self._catchup = settings.catchup_seconds
        self.authenticated = False
        self.failed = False
        self._fresh = False
        self._eosed = False
        self._generation = 0
        self._sub_id: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.connection = RelayConnection(
            url,
            self,
            signer,
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
        self._set_authenticated(False)

    # connection callbacks ---------------------------------------------------------------

    def on_open(self, connection: RelayConnection) -> None:
        """Ask straight away: the relay may never challenge until it has a REQ to refuse."""
        self._sub_id = None
        self._eosed = False
        self._subscribe()

    def on_authenticated(self, connection: RelayConnection) -> None:
        """The user's AUTH went out: send the REQ again, now under the user's identity."""
        self._subscribe()

    def _subscribe(self) -> None:
        self._fresh = self.pubkey not in self._owner.baselines_of(self.url)
        old, self._generation = self._sub_id, self._generation + 1
        self._sub_id = f"{SUB_PREFIX}{self._generation}"
        since = int(time.time()) - self._catchup
        dm_filter = {"kinds": list(DM_KINDS), "#p": [self.pubkey], "since": since}
        task = asyncio.create_task(self._send(["REQ", self._sub_id, dm_filter], old))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, request: list[Any], replaces: str | None) -> None:
        """The new REQ first, then the CLOSE of the one it replaces (no gap)."""
        await self.connection.send(request)
        if replaces is not None:
            await self.connection.send(["CLOSE", replaces])

    def on_event(
        self, connection: RelayConnection, sub_id: str, raw: Any, received_ms: int
    ) -> None:
        if sub_id.startswith(SUB_PREFIX):
            # until a REQ that counts reached EOSE, what a fresh user gets predates them
            baseline = self._fresh and not self._eosed
            self._owner.on_user_event(self.url, self.pubkey, raw, received_ms, baseline)

    def on_eose(self, connection: RelayConnection, sub_id: str) -> None:
        if sub_id != self._sub_id or self._eosed or not connection.counts_as_read(sub_id):
            # a pre-AUTH answer (nostr-rs-relay leaves the DMs out silently) proves nothing
            return
        self._eosed = True
        if self._fresh:
            # stored after every event before this EOSE is committed (the bridge's rule)
            self._owner.baselines_of(self.url).add(self.pubkey)
            self._owner.baselined(self.url, frozenset((self.pubkey,)))
        self.failed = False
        USER_AUTHS.labels(self.url, "authenticated").inc()
        self._set_authenticated(True)

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None:
        """Only a CLOSED of the REQ sent after the user's AUTH is a refusal of the user; one for
        an earlier REQ is the relay asking for AUTH (or its late answer to a replaced REQ)."""
        epoch = connection.req_epoch(sub_id)
        if sub_id == self._sub_id and epoch is not None and epoch > 0:
            self._refused()

    def on_gated(self, connection: RelayConnection) -> None:
        if connection.gated_reason:
            self._refused()

    def on_auth_failed(self, connection: RelayConnection) -> None:
        """The signer could not sign; the connection closes and retries with backoff."""
        self._fail()

    def on_down(self, connection: RelayConnection) -> None:
        self._sub_id = None
        self._set_authenticated(False)

    def congested(self, connection: RelayConnection) -> bool:
        return self._owner.congested(connection.url)

    async def drained(self, connection: RelayConnection) -> None:
        await self._owner.drained(connection.url)

    # state ------------------------------------------------------------------------------

    def _refused(self) -> None:
        """The relay refused the user's own subscription even after the user's AUTH."""
        if not self.failed:
            log.info("relay %s refuses a user's subscription after delegated AUTH", self.url)
        self._fail()
        self._set_authenticated(False)

    def _fail(self) -> None:
        self.failed = True
        USER_AUTHS.labels(self.url, "failed").inc()

    def _set_authenticated(self, value: bool) -> None:
        if value != self.authenticated:
            self.authenticated = value
            self._manager.authenticated_changed(self.url, value)


class UserInboxes:
    """Opens and closes the per-user connections so they always match their inputs."""

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
        self._inboxes: dict[tuple[str, str], UserInbox] = {}
        self._authenticated: Tally[str] = Tally()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._labelled: set[str] = set()
        GATED_RELAYS.set(0)
        USER_CONNECTIONS.set(0)
        USER_CONNECTIONS_SKIPPED.set(0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="user-inboxes")
        self.changed()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        inboxes, self._inboxes = list(self._inboxes.values()), {}
        await asyncio.gather(*(inbox.stop() for inbox in inboxes), *self._stopping)

    def changed(self) -> None:
        """Some input changed (gating, relays, registrations): reconcile soon, coalesced."""
        self._wake.set()

    def session_changed(self, pubkey: str, status: str) -> None:
        """DelegatedAuth listener: a session became active, refused, unreachable or removed."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._reconcile()

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
        # connections already open keep their place under the cap: no churn when it is reached
        ordered = [k for k in wanted if k in self._inboxes] + [
            k for k in wanted if k not in self._inboxes
        ]
        keep = ordered[: self._settings.max_user_connections]
        USER_CONNECTIONS_SKIPPED.set(len(ordered) - len(keep))
        keep_set = set(keep)
        for key in [k for k in self._inboxes if k not in keep_set]:
            self._spawn_stop(self._inboxes.pop(key).stop())
        # a relay with no user connection left drops its labelled series (URLs churn)
        remaining = {url for url, _ in keep}
        for url in self._labelled - remaining:
            for outcome in ("authenticated", "failed"):
                with contextlib.suppress(KeyError):
                    USER_AUTHS.remove(url, outcome)
        self._labelled = remaining
        for url, pubkey in keep:
            if (url, pubkey) not in self._inboxes:
                inbox = UserInbox(
                    url,
                    pubkey,
                    self,
                    self._sessions.signer_for(pubkey),
                    self._observations,
                    self._settings,
                )
                self._inboxes[(url, pubkey)] = inbox
                inbox.start()
        USER_CONNECTIONS.set(len(self._inboxes))

    def _spawn_stop(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

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

    def health(self) -> dict[str, dict[str, int]]:
        """Per relay: how many users' connections are authenticated and how many failed."""
        report: dict[str, dict[str, int]] = {}
        for (url, _), inbox in self._inboxes.items():
            entry = report.setdefault(url, {"users_authenticated": 0, "users_failed": 0})
            entry["users_authenticated"] += inbox.authenticated
            entry["users_failed"] += inbox.failed
        return report
