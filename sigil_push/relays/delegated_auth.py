"""Delegated NIP-42 AUTH: reading gated inboxes through each user's own NIP-46 signer.

A user who registers an `auth_signer` grants the bridge a remote-signer session limited to
kind 22242 AUTH events. This module keeps those sessions (sealed at rest), establishes them
(`connect`, then `get_public_key`, which must be the user's key), and signs AUTH answers on
the user's behalf, rate-limited per user so a reconnect storm never floods a signer app.
Statuses: pending, active, refused (the signer said no, or holds another key: not retried
until the user registers again), unreachable (retried with growing pauses), failed (the
session's own code raised something unexpected: logged by its type, counted, and retried with
the same pauses, so no session stays `pending` with its task silently gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from sigil_push.nostr.event import Event
from sigil_push.nostr.keys import SecretKey, is_public_key
from sigil_push.nostr.nip46 import (
    BunkerUri,
    Response,
    SignerError,
    connect_request,
    get_public_key_request,
    sign_auth_request,
    signed_auth_event,
)
from sigil_push.relays.connection import AuthUnavailable
from sigil_push.relays.signer_link import SignerLinks, SignerUnreachable
from sigil_push.sealed import Sealer, UnreadableSecret
from sigil_push.store.auth_modes import LearnedAuthModes
from sigil_push.store.errors import SKIPPABLE_WRITE_ERRORS
from sigil_push.store.interface import AuthModeStore, DeviceStore, SignerSessionStore
from sigil_push.store.records import StoredSession
from sigil_push.supervisor import BackgroundTasks
from sigil_push.telemetry.tracebacks import withheld
from sigil_push.token_bucket import RateLimiter

log = logging.getLogger(__name__)

STATUSES = ("pending", "active", "refused", "unreachable", "failed")
RETRIED = frozenset({"unreachable", "failed"})
REQUEST_TIMEOUT_SECONDS = 15.0
SIGNS_PER_MINUTE_PER_USER = 6
RETRY_FIRST_SECONDS = 60.0
RETRY_MAX_SECONDS = 3600.0

SESSIONS = Gauge("sigil_push_delegated_auth_sessions", "Signer sessions by status", ["status"])
SIGNER_REQUESTS = Counter(
    "sigil_push_delegated_auth_signer_requests_total", "Requests sent to users' signers", ["method"]
)
SIGNATURES = Counter(
    "sigil_push_delegated_auth_signatures_total", "AUTH signatures asked of signers, by outcome",
    ["outcome"],
)
SESSION_FAILURES = Counter(
    "sigil_push_delegated_auth_session_failures_total",
    "Signer session attempts that ended in an unexpected exception (status `failed`)",
)
for _status in STATUSES:
    SESSIONS.labels(_status)
for _method in ("connect", "get_public_key", "sign_event"):
    SIGNER_REQUESTS.labels(_method)
for _outcome in ("signed", "throttled", "refused", "unreachable"):
    SIGNATURES.labels(_outcome)


class DelegatedAuthUnavailable(AuthUnavailable):
    """No AUTH can be had for this user now (no active session, throttled, or signer failed).

    An AuthUnavailable, so a per-user relay connection backs off instead of failing its task."""


@dataclass
class Session:
    pubkey: str
    signer_pubkey: str
    relays: tuple[str, ...]
    secret: str | None
    client: SecretKey
    status: str
    detail: str
    retry_after: float = 0.0


StatusListener = Callable[[str, str], None]


class DelegatedAuth:
    def __init__(
        self,
        sessions: SignerSessionStore,
        modes: AuthModeStore,
        bridge_key: SecretKey,
        devices: DeviceStore,
    ) -> None:
        self._stored = sessions
        self._devices = devices
        self._sealer = Sealer(bridge_key, "nip46-sessions")
        self._sessions: dict[str, Session] = {}
        self._links = SignerLinks()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._throttle = RateLimiter(SIGNS_PER_MINUTE_PER_USER, "signer_rate_buckets")
        self._listeners: list[StatusListener] = []
        # a failed clean-up is logged by its type (its message may quote the pubkey), not
        # left to asyncio's "Task exception was never retrieved" traceback
        self._housekeeping = BackgroundTasks("signer-sessions")
        self.learned_modes = LearnedAuthModes(modes)
        """What gated relays taught about NIP-42, kept beside the sessions it serves."""

    def add_listener(self, listener: StatusListener) -> None:
        """Be told (pubkey, status) whenever a session changes status."""
        self._listeners.append(listener)

    async def start(self) -> None:
        for stored in await self._stored.all():
            try:
                secret, client = self._open(stored)
            except UnreadableSecret:
                log.warning("a signer session was sealed under another bridge key; marked refused")
                await self._stored.set_status(
                    stored.pubkey, "refused",
                    "sealed under another bridge key; register the signer again", None,
                )
                continue
            session = Session(
                stored.pubkey, stored.signer_pubkey, stored.relays, secret, client,
                stored.status, stored.detail,
            )
            self._sessions[stored.pubkey] = session
            if stored.status in ("pending", "unreachable"):
                self._establish_soon(session)
        self._count()

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self._links.close()

    def status(self, pubkey: str) -> str | None:
        session = self._sessions.get(pubkey)
        return session.status if session else None

    def detail(self, pubkey: str) -> str:
        session = self._sessions.get(pubkey)
        return session.detail if session else ""

    def registration_changed(self, pubkey: str) -> None:
        """Devices listener: the session ends with the npub's last device."""
        if pubkey in self._sessions:
            self._housekeeping.spawn(self._forget_if_unregistered(pubkey))

    async def _forget_if_unregistered(self, pubkey: str) -> None:
        if not await self._devices.of_pubkey(pubkey):
            await self.remove(pubkey)

    def active_pubkeys(self) -> set[str]:
        return {p for p, s in self._sessions.items() if s.status == "active"}

    async def set_signer(self, pubkey: str, bunker: BunkerUri) -> None:
        """Replace the user's session with a new one for `bunker` and start establishing it."""
        await self.remove(pubkey)
        session = Session(
            pubkey, bunker.signer_pubkey, bunker.relays, bunker.secret, SecretKey.generate(),
            "pending", "",
        )
        await self._stored.put(
            StoredSession(
                pubkey, bunker.signer_pubkey, bunker.relays,
                self._sealer.seal(bunker.secret) if bunker.secret else None,
                self._sealer.seal(session.client.secret_hex), "pending", "",
            ),
            int(time.time()),
        )
        self._sessions[pubkey] = session
        self._count()
        self._establish_soon(session)

    async def remove(self, pubkey: str) -> None:
        session = self._sessions.pop(pubkey, None)
        task = self._tasks.pop(pubkey, None)
        if task is not None:
            task.cancel()
        await self._stored.delete(pubkey)
        if session is not None:
            for url in session.relays:
                await self._links.release(url, session.client.public_key_hex)
            self._count()
            self._notify(pubkey, "removed")

    async def sign_auth(self, pubkey: str, relay_url: str, challenge: str) -> Event:
        """AUTH as the user for `relay_url`'s challenge; the one thing a signer is asked to sign."""
        session = self._sessions.get(pubkey)
        if session is None or session.status != "active":
            raise DelegatedAuthUnavailable("no active signer session")
        if self._throttle.check(pubkey):
            SIGNATURES.labels("throttled").inc()
            raise DelegatedAuthUnavailable("signer requests for this user are rate-limited")
        request_id, message = sign_auth_request(
            session.client, session.signer_pubkey, relay_url, challenge, int(time.time())
        )
        try:
            answer = await self._ask(session, request_id, message, "sign_event")
            if answer.error or answer.result is None:
                raise SignerError(answer.error or "empty answer")
            event = signed_auth_event(answer.result, pubkey, relay_url, challenge)
        except SignerUnreachable:
            SIGNATURES.labels("unreachable").inc()
            raise DelegatedAuthUnavailable("the signer is unreachable") from None
        except SignerError:
            SIGNATURES.labels("refused").inc()
            raise DelegatedAuthUnavailable("the signer refused to sign") from None
        SIGNATURES.labels("signed").inc()
        return event

    def signer_for(self, pubkey: str) -> UserAuthSigner:
        return UserAuthSigner(self, pubkey)

    # -- establishing sessions -----------------------------------------------------------------

    def _establish_soon(self, session: Session) -> None:
        previous = self._tasks.pop(session.pubkey, None)
        if previous is not None:
            previous.cancel()
        self._tasks[session.pubkey] = asyncio.create_task(
            self._establish(session), name="nip46-connect"
        )

    async def _establish(self, session: Session) -> None:
        pause = RETRY_FIRST_SECONDS
        while True:
            await asyncio.sleep(max(0.0, session.retry_after - time.monotonic()))
            status, detail = await self._attempt(session)
            await self._set_status(session, status, detail)
            if status not in RETRIED:
                return
            session.retry_after = time.monotonic() + pause
            pause = min(RETRY_MAX_SECONDS, pause * 2)

    async def _attempt(self, session: Session) -> tuple[str, str]:
        """One handshake's outcome as (status, detail), whatever it raised: a task that died
        here left the session `pending` for good, with nothing logged."""
        try:
            return await self._handshake(session)
        except SignerUnreachable as exc:
            return "unreachable", str(exc)
        except Exception as exc:  # the point: every failure becomes a status
            SESSION_FAILURES.inc()
            log.error("signer session failed (%s); retried with pauses", type(exc).__name__,
                      exc_info=withheld(exc))
            return "failed", f"the session failed on the server ({type(exc).__name__}); retried with pauses"

    async def _handshake(self, session: Session) -> tuple[str, str]:
        if not is_public_key(session.signer_pubkey):  # stored before registration checked it
            return "refused", "the signer's key is not a public key; register the signer again"
        bunker = BunkerUri(session.signer_pubkey, session.relays, session.secret)
        request_id, message = connect_request(session.client, bunker)
        answer = await self._ask(session, request_id, message, "connect")
        if answer.error:
            return "refused", "the signer refused the connection"
        request_id, message = get_public_key_request(session.client, session.signer_pubkey)
        answer = await self._ask(session, request_id, message, "get_public_key")
        if answer.error or answer.result is None:
            return "refused", "the signer did not reveal its key"
        if answer.result.lower() != session.pubkey:
            return "refused", "the signer holds another key than the registered npub"
        return "active", ""

    async def _ask(self, session: Session, request_id: str, message: Event, method: str) -> Response:
        """Send one request over the first of the signer's relays that answers."""
        SIGNER_REQUESTS.labels(method).inc()
        failure: SignerUnreachable | None = None
        for url in session.relays:
            try:
                link = await self._links.get(url, session.pubkey)
                return await link.request(session.client, request_id, message, REQUEST_TIMEOUT_SECONDS)
            except SignerUnreachable as exc:
                failure = exc
        raise failure or SignerUnreachable("the signer has no relays")

    async def _set_status(self, session: Session, status: str, detail: str) -> None:
        """The in-memory status is what the bridge acts on; storing it is for the next start,
        which re-establishes whatever it finds pending, so a busy database only logs."""
        session.status, session.detail = status, detail
        try:
            await self._stored.set_status(session.pubkey, status, detail, int(time.time()))
        except SKIPPABLE_WRITE_ERRORS as exc:
            log.warning("could not store a signer session's status (%s)", exc)
        except Exception as exc:  # the status in memory stands; say why it is not stored
            SESSION_FAILURES.inc()
            log.error("could not store a signer session's status (%s)", type(exc).__name__,
                      exc_info=withheld(exc))
        log.info("signer session %s%s", status, f": {detail}" if detail else "")
        self._count()
        self._notify(session.pubkey, status)

    def _notify(self, pubkey: str, status: str) -> None:
        for listener in self._listeners:
            listener(pubkey, status)

    def _open(self, stored: StoredSession) -> tuple[str | None, SecretKey]:
        """The session's secret and client key, unsealed (`UnreadableSecret` when sealed
        under another bridge key)."""
        secret = self._sealer.open(stored.sealed_secret) if stored.sealed_secret else None
        return secret, SecretKey(self._sealer.open(stored.sealed_client_key))

    def _count(self) -> None:
        for status in STATUSES:
            SESSIONS.labels(status).set(sum(s.status == status for s in self._sessions.values()))

    # -- sessions another worker changed (PostgreSQL: sigil_push/store/postgres/signers.py) ----

    async def adopt(self, pubkey: str) -> None:
        """Take `pubkey`'s session as another worker stored it: that worker establishes it,
        this one uses it as it is (the signer is asked to connect once), and listeners (the
        bridge's user inboxes) hear of the change as of a local one."""
        stored = await self._stored.get(pubkey)
        current = self._sessions.get(pubkey)
        if stored is None:
            if current is not None:
                await self._drop(current)
                self._count()
                self._notify(pubkey, "removed")
            return
        status, detail = stored.status, stored.detail
        try:
            secret, client = self._open(stored)
        except UnreadableSecret:
            return  # sealed under another bridge key: the workers' start-up check refuses it
        if current is None or current.client.secret_hex != client.secret_hex:
            if current is not None:
                await self._drop(current)
            current = Session(pubkey, stored.signer_pubkey, stored.relays, secret, client, "", "")
            self._sessions[pubkey] = current
        elif (current.status, current.detail) == (status, detail):
            return
        current.status, current.detail = status, detail
        self._count()
        self._notify(pubkey, status)

    async def _drop(self, session: Session) -> None:
        """Forget a session here only (its row is already gone or replaced)."""
        self._sessions.pop(session.pubkey, None)
        task = self._tasks.pop(session.pubkey, None)
        if task is not None:
            task.cancel()
        for url in session.relays:
            await self._links.release(url, session.client.public_key_hex)


class UserAuthSigner:
    """The AuthSigner a per-user relay connection uses: AUTH as that user via their signer."""

    def __init__(self, delegated: DelegatedAuth, pubkey: str) -> None:
        self._delegated = delegated
        self._pubkey = pubkey

    async def sign_auth(self, relay_url: str, challenge: str) -> Event:
        return await self._delegated.sign_auth(self._pubkey, relay_url, challenge)
