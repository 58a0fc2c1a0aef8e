"""One connection to a gated inbox relay, authenticated as one user or as several.

It is both the `RelayConnection`'s handler and its `AuthResponder`: a challenge is answered
with one AUTH per user on the connection, each signed by that user's own NIP-46 signer (once
per challenge), and each user's REQ is sent again after their AUTH. Only the answer to a REQ
sent after *that user's* AUTH (or on a socket never challenged) counts as reading.

On a relay whose mode is still unknown it runs the probe that teaches `UserInboxes` whether the
relay keeps one authenticated key per connection or several (user_inbox.py explains the rules),
and it reports what the relay says to that: a second AUTH refused, a REQ refused after AUTH.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import Counter

from sigil_push.config import BridgeConfig
from sigil_push.nostr.kinds import DM_KINDS
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import AuthSigner, AuthUnavailable, RelayConnection
from sigil_push.relays.labels import series_label
from sigil_push.relays.port import BridgePort
from sigil_push.supervisor import BackgroundTasks
from sigil_push.telemetry.redaction import relay_label

log = logging.getLogger(__name__)

SUB_PREFIX = "dm."

AuthMode = Literal["unknown", "single", "multi"]

USER_AUTHS = Counter(
    "sigil_push_delegated_auth_relay_total",
    "Delegated AUTH attempts on gated relays, by outcome (no per-user labels)",
    ["relay", "outcome"],
)


@dataclass(slots=True, eq=False)
class _Member:
    """One user on one connection; the socket-bound fields reset on every open."""

    pubkey: str
    signer: AuthSigner
    sub_id: str | None = None
    authed: bool = False
    """This user's AUTH went out on the current socket."""
    accepted: bool = False
    """The relay answered this user's AUTH on the current socket with `OK true`."""
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


class InboxManager(Protocol):
    """What a connection reports to the set of per-user connections (`UserInboxes`), defined
    here so that this module needs nothing from the one that creates it."""

    @property
    def port(self) -> BridgePort: ...

    def baselines_of(self, url: str) -> set[str]:
        """The live set of keys baselined on `url`, shared with the pool's connection there."""
        ...

    def mode(self, url: str) -> AuthMode: ...

    def learned(
        self, connection: InboxConnection, mode: AuthMode, survivor: str | None, reason: str
    ) -> None: ...

    def evict(self, connection: InboxConnection, pubkey: str) -> None: ...

    def reserve(self, connection: InboxConnection, pubkey: str) -> None: ...

    def authenticated_changed(self, url: str, authenticated: bool) -> None: ...


class InboxConnection:
    """One connection to a gated relay, carrying one user or (on a `multi` relay) several.

    It is the connection's handler and its AuthResponder: it answers each challenge with one
    AUTH per user, from that user's signer, and subscribes each user again after their AUTH.
    """

    def __init__(
        self,
        url: str,
        manager: InboxManager,
        observations: ObservationLog,
        settings: BridgeConfig,
        solo: bool,
    ) -> None:
        self.url = url
        self.solo = solo
        """Reserved for one user (whose signer failed on a shared connection): nobody joins."""
        self.members: dict[str, _Member] = {}
        self._manager = manager
        self._port = manager.port
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
        self._auth_keys: set[str] = set()
        """Every key whose AUTH went out on the current socket, users moved off it since
        included: which one a one-key relay serves is its choice, not ours."""
        self._authenticating: Tally[str] = Tally()
        """Users whose signer is being asked right now, with how many requests: a request
        for a dead socket's challenge may still be out beside one for the new socket's."""
        self._tasks = BackgroundTasks("inbox-connection")
        self.connection = RelayConnection(
            url,
            self,
            self,
            observations,
            settings.reconnect_min_seconds,
            settings.reconnect_max_seconds,
            per_user=True,
            max_frame_bytes=settings.max_frame_bytes,
            heartbeat_seconds=settings.relay_heartbeat_seconds,
            open_timeout_seconds=settings.relay_open_timeout_seconds,
        )

    def start(self) -> None:
        self.connection.start()

    async def stop(self) -> None:
        await self.connection.stop()
        self._tasks.cancel()
        for member in self.members.values():
            self._set_authenticated(member, False)

    # membership (called by UserInboxes) --------------------------------------------------

    def add(self, pubkey: str, signer: AuthSigner) -> None:
        # on a relay not learned yet, one AUTH at a time: a second key goes out only as the probe
        busy = bool(self._authenticating) or any(
            m.authed and not m.failed for m in self.members.values()
        )
        member = self.members[pubkey] = _Member(pubkey, signer)
        if not self.connection.connected:
            return  # on_open subscribes every member
        if self._challenge is None:
            # may draw the challenge from a relay that only challenges a refused REQ
            self._subscribe(member)
        elif self._manager.mode(self.url) == "multi" or not busy:
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
        """The user to keep when the relay allows one key (see `_keeper`)."""
        return _keeper(list(self.members.values()))

    # AuthResponder ---------------------------------------------------------------------

    async def answer_challenge(self, connection: RelayConnection, challenge: str) -> None:
        """One AUTH per user: all at once on a `multi` relay; otherwise the first user whose
        signer signs (on an unknown relay the second key is tried only once the first reads).
        The one-at-a-time round ends with its socket: a signer can take seconds, and if the
        relay reconnected meanwhile, the next user's signer would be asked (and charged) for
        a challenge nobody can answer any more; the new socket's challenge starts a new round."""
        self._challenge = challenge
        generation = connection.socket_generation
        if self._manager.mode(self.url) == "multi":
            members = list(self.members.values())
            await asyncio.gather(*(self._authenticate(m, challenge, generation) for m in members))
            return
        for member in list(self.members.values()):
            if connection.socket_generation != generation:
                return
            if self.members.get(member.pubkey) is member and await self._authenticate(
                member, challenge, generation
            ):
                return

    def on_auth_result(
        self, connection: RelayConnection, event_id: str, accepted: bool, reason: str
    ) -> None:
        pubkey = self._auth_ids.pop(event_id, None)
        if pubkey is None:
            return
        if accepted:
            member = self.members.get(pubkey)
            if member is not None:
                member.accepted = True
            return
        if self._manager.mode(self.url) != "single" and self._others_authed(pubkey):
            # strfry: "already authenticated"
            self._verdict(
                "single", self._survivor(excluding=pubkey), "a second key's AUTH was refused"
            )
        # a lone user's refused AUTH shows as the CLOSED of the REQ that follows it

    async def _authenticate(self, member: _Member, challenge: str, generation: int) -> bool:
        """Ask the user's signer once for this challenge, send the AUTH, then the user's REQ.
        Nobody is asked for the challenge of a socket already gone (a task started late)."""
        if generation != self.connection.socket_generation:
            return False
        self._authenticating[member.pubkey] += 1
        try:
            event = await member.signer.sign_auth(self.url, challenge)
        except AuthUnavailable as exc:
            log.warning(
                "relay %s: cannot answer NIP-42 AUTH for a user (%s)", relay_label(self.url),
                type(exc).__name__,
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
        finally:
            self._authenticating[member.pubkey] -= 1
            if not self._authenticating[member.pubkey]:
                del self._authenticating[member.pubkey]
        if self.members.get(member.pubkey) is not member:
            return False
        self._auth_ids[event.id] = member.pubkey
        if not await self.connection.send_auth(event, generation):
            self._auth_ids.pop(event.id, None)
            return False
        self._auth_keys.add(member.pubkey)
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
        self._auth_keys.clear()
        self._challenge = None
        self._said_no = False
        self._probe = None
        for member in self.members.values():
            member.sub_id = None
            member.authed = False
            member.accepted = False
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
            self._port.ingest.user_event(
                self.url, member.pubkey, raw, received_ms, baseline, connection.budget
            )

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
                self._manager.baselines_of(self.url).add(pubkey)
                self._port.baselines.baselined(self.url, frozenset((pubkey,)))
            member.failed = False
            USER_AUTHS.labels(series_label(self.url), "authenticated").inc()
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
        if self._manager.mode(self.url) != "single" and self._others_authed(pubkey):
            # refused after AUTH while another key is authenticated here: the relay serves one
            # key per connection (or no longer several); this user gets a connection of their own
            self._verdict(
                "single", self._survivor(excluding=pubkey),
                "a REQ was refused after AUTH on a connection with another key",
            )
            if pubkey not in self.members:
                return
        if self._auth_keys - {pubkey}:
            # another key's AUTH went out on this socket too (its user was moved off it before
            # the relay's OK for it came): the relay may be serving that key, which says
            # nothing about this user. A socket of their own answers for them alone.
            self._spawn(self.connection.drop(self.connection.socket_generation))
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
        return self._port.flow.congested(connection.url)

    async def drained(self, connection: RelayConnection) -> None:
        await self._port.flow.drained(connection.url)

    # subscriptions ------------------------------------------------------------------------

    def _subscribe(self, member: _Member) -> str:
        """A new REQ for this user's DMs; the one it replaces is closed after it (no gap)."""
        member.fresh = member.pubkey not in self._manager.baselines_of(self.url)
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
            self._verdict("single", first.pubkey, "it never refuses a REQ out loud")
            return
        authed = next(
            (m for m in self.members.values() if m is not first and m.authed and not m.failed),
            None,
        )
        if authed is not None:
            # both keys' AUTHs are out already: a fresh REQ for each is the whole test
            self._probe = _Probe(first.pubkey, authed.pubkey)
            self._ask_both(self._probe, first, authed)
            return
        second = next(
            (
                m for m in self.members.values()
                if not m.authed and not m.failed and m.pubkey not in self._authenticating
            ),
            None,
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
        if self._probe is probe and second.sub_id is not None:
            probe.pending[second.sub_id] = second.pubkey
            probe.pending[self._subscribe(first)] = first.pubkey

    def _ask_both(self, probe: _Probe, first: _Member, second: _Member) -> None:
        """Both keys asked again after both AUTHs: a relay that let the second key replace the
        first (khatru) now refuses the first."""
        for member in (first, second):
            probe.pending[self._subscribe(member)] = member.pubkey

    def _probe_answer(self, sub_id: str, served: bool) -> None:
        probe = self._probe
        if probe is None or sub_id not in probe.pending:
            return
        pubkey = probe.pending.pop(sub_id)
        if not served:
            survivor = probe.second if pubkey == probe.first else probe.first
            self._verdict("single", survivor, "a REQ was refused after a second key's AUTH")
        else:
            probe.served.add(pubkey)
            if not probe.pending and probe.served == {probe.first, probe.second}:
                self._verdict("multi", None, "two keys' REQs were served after their AUTHs")

    def _verdict(self, mode: AuthMode, survivor: str | None, reason: str) -> None:
        self._probe = None
        self._manager.learned(self, mode, survivor, reason)

    def _others_authed(self, pubkey: str) -> bool:
        return any(m.authed for p, m in self.members.items() if p != pubkey)

    def _survivor(self, excluding: str) -> str | None:
        return _keeper([m for p, m in self.members.items() if p != excluding])

    # state ------------------------------------------------------------------------------

    def _refused(self, member: _Member) -> None:
        """The relay refused the user's own subscription even after the user's AUTH."""
        if not member.failed:
            log.info("relay %s refuses a user's subscription after delegated AUTH", relay_label(self.url))
        self._fail(member)
        self._set_authenticated(member, False)

    def _fail(self, member: _Member) -> None:
        member.failed = True
        USER_AUTHS.labels(series_label(self.url), "failed").inc()

    def _set_authenticated(self, member: _Member, value: bool) -> None:
        if value != member.authenticated:
            member.authenticated = value
            self._manager.authenticated_changed(self.url, value)

    def _spawn(self, coroutine: Coroutine[Any, Any, object]) -> None:
        self._tasks.spawn(coroutine)


def _keeper(members: list[_Member]) -> str | None:
    """Of `members`, the key a one-key relay keeps serving on their socket: one whose AUTH it
    accepted (strfry accepts the first AUTH *sent*, which under load need not be the first
    member's, nor one whose REQ has been answered yet), else one reading, else the first."""
    chosen = (
        next((m for m in members if m.accepted), None)
        or next((m for m in members if m.authenticated), None)
        or next(iter(members), None)
    )
    return None if chosen is None else chosen.pubkey
