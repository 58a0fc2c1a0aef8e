"""Relays that do NIP-42 the way real inbox relays do, as a thin layer over a real `nostr-relay`.

The storage, subscriptions and event validation are the real `nostr-relay` process (started
without AUTH); this layer only adds each implementation's AUTH policy for DM reads (kinds 4 and
1059), as read from their sources (see FIELD-NOTES "How real relays do NIP-42"):

- `lazy` (khatru): no challenge on connect. A DM REQ from an unauthenticated connection, or for
  a `#p` that is not the authenticated key, gets `["AUTH", challenge]` then
  `["CLOSED", sub, "auth-required: ..."]`. One key per connection.
- `strfry` (restrictReadToInvolvedPubkey): a DM REQ must name only the authenticated key in
  `#p`, else AUTH then CLOSED auth-required; `closed_first=True` sends the CLOSED first.
  One key per connection.
- `multi` (chorus): AUTH on connect; DM REQs refused (CLOSED auth-required) unless every `#p`
  is authenticated; several keys may authenticate on one connection.
- `silent` (nostr-rs-relay with nip42_dms): AUTH on connect; DMs for anyone not authenticated
  as a party are left out without a word, so a REQ gets only EOSE.

A second key's AUTH on one connection is answered as each implementation does: `lazy` (khatru)
says OK and the new key replaces the first, `strfry` says `OK false "error: already
authenticated"`, `silent` (nostr-rs-relay) says OK and keeps the first key, `multi` adds it.
`late_closed=True` holds the CLOSED of a refused REQ back until the connection authenticated,
the order that made the bridge mistake its pre-AUTH REQ's answer for a refusal after AUTH.
`any_key_reads=True` lets any authenticated key read every DM (so the bridge's own key can).
`hold_reads(keys)` keeps the DM REQs it allows for those keys from the real relay (so they get
no EOSE) until `release_reads()`: a test decides when a key starts reading, as a slow relay
would. Each connection's DM REQs are recorded with their `#p` values, in arrival order.
`max_subscriptions` publishes that NIP-11 limit (otherwise the relay has no NIP-11 document).
`withhold_oks(keys)` accepts those keys' AUTHs without ever saying `OK` (a reply still under
way when the client acts).

It runs in its own thread and event loop (tests call the service synchronously), on a fixed
port so a restart keeps its URL. AUTH events are checked with nostr-sdk, not our own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from http import HTTPStatus
from pathlib import Path
from typing import Any

import nostr_sdk
from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from testkit.deadlines import STARTUP_SECONDS, STOP_SECONDS, scaled
from testkit.relay import RelayProcess

DM_KINDS = {4, 1059}
MODES = ("lazy", "strfry", "multi", "silent")


class AuthRelay:
    def __init__(
        self,
        folder: Path,
        mode: str,
        closed_first: bool = False,
        late_closed: bool = False,
        any_key_reads: bool = False,
        max_subscriptions: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode}")
        self.mode = mode
        self.closed_first = closed_first
        self.late_closed = late_closed
        self.any_key_reads = any_key_reads
        self.max_subscriptions = max_subscriptions
        self.upstream = RelayProcess(folder / "upstream")
        self.port = 0
        """0 until the first start binds a port of the OS's choosing; a restart binds it again."""
        # what the relay saw, for assertions (read from the test's thread)
        self.connections = 0
        self.auth_connections = 0
        """Connections on which at least one key authenticated."""
        self.open_sessions: set[_Session] = set()
        self.authenticated: list[str] = []
        self.refused_second_auth = 0
        self.refused_reqs = 0
        self.served_reqs = 0
        self.held_reads: set[str] = set()
        self.withheld_oks: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Server | None = None

    # lifecycle (test thread) ---------------------------------------------------------------

    def start(self) -> AuthRelay:
        self.upstream.start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(scaled(STARTUP_SECONDS))
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(scaled(STARTUP_SECONDS))
            loop.call_soon_threadsafe(loop.stop)
            thread.join(scaled(STOP_SECONDS))
            loop.close()
        self._loop = self._thread = None
        self.upstream.stop()

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the relay has no URL before it first starts")
        return f"ws://127.0.0.1:{self.port}"

    def grant_role(self, pubkey_hex: str, roles: str) -> None:
        """Every style here lets an authenticated recipient read their own DMs: nothing to do."""

    async def _serve(self) -> None:
        self._server = await serve(
            self._handle, "127.0.0.1", self.port, compression=None, max_size=None,
            process_request=self._nip11,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def _nip11(self, connection: ServerConnection, request: Request) -> Response | None:
        """The NIP-11 document, for a plain HTTP request asking for it."""
        if self.max_subscriptions is None or "application/nostr+json" not in request.headers.get(
            "Accept", ""
        ):
            return None
        document = {"limitation": {"max_subscriptions": self.max_subscriptions}}
        return connection.respond(HTTPStatus.OK, json.dumps(document))

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    # one client connection -------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        session = _Session(self, ws, secrets.token_hex(16))
        self.open_sessions.add(session)
        try:
            async with connect(self.upstream.url, proxy=None, max_size=None) as upstream:
                session.upstream = upstream
                pump = asyncio.create_task(session.pump())
                try:
                    await session.run()
                finally:
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                        await pump
        except (ConnectionClosed, OSError):
            return
        finally:
            self.open_sessions.discard(session)

    def withhold_oks(self, keys: set[str]) -> None:
        """Accepted AUTHs of `keys` get no `OK` frame."""
        self.withheld_oks = set(keys)

    def hold_reads(self, keys: set[str]) -> None:
        """Allowed DM REQs for `keys` wait here (no EOSE, no events) until `release_reads`."""
        self.held_reads = set(keys)

    def release_reads(self) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._release_reads(), self._loop).result(scaled(STARTUP_SECONDS))

    async def _release_reads(self) -> None:
        self.held_reads = set()
        for session in list(self.open_sessions):
            held, session.held_reqs = session.held_reqs, []
            for _, frame in held:
                with contextlib.suppress(ConnectionClosed):
                    await session.upstream.send(frame)

    def dm_requests_by_connection(self) -> list[list[list[str]]]:
        """The `#p` values of each open connection's DM REQs, in the order they arrived."""
        return [list(session.dm_requests) for session in list(self.open_sessions)]

    def keys_by_connection(self) -> list[list[str]]:
        """The keys each open connection is authenticated as (read from the test's thread)."""
        return [list(session.keys) for session in list(self.open_sessions) if session.keys]


class _Session:
    def __init__(self, relay: AuthRelay, ws: ServerConnection, challenge: str) -> None:
        self.relay = relay
        self.ws = ws
        self.challenge = challenge
        self.keys: list[str] = []
        self.held_closed: list[str] = []
        self.held_reqs: list[tuple[str, str | bytes]] = []
        self.dm_requests: list[list[str]] = []
        self.upstream: Any = None

    async def send(self, message: list[Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def pump(self) -> None:
        """Upstream frames to the client; `silent` leaves out DMs to non-parties."""
        async for frame in self.upstream:
            if self.relay.mode == "silent" and not self._party_to(frame):
                continue
            await self.ws.send(frame)

    def _party_to(self, frame: str | bytes) -> bool:
        message = json.loads(frame)
        if message[0] != "EVENT":
            return True
        event = message[2]
        if event.get("kind") not in DM_KINDS:
            return True
        parties = {t[1] for t in event.get("tags", []) if len(t) > 1 and t[0] == "p"}
        parties.add(event.get("pubkey"))
        return bool(parties & set(self.keys))

    async def run(self) -> None:
        if self.relay.mode in ("multi", "silent"):
            await self.send(["AUTH", self.challenge])
        async for frame in self.ws:
            message = json.loads(frame)
            verb = message[0]
            if verb == "REQ":
                self._record(message[2:])
            if verb == "AUTH":
                await self._auth(message[1])
            elif verb == "REQ" and not self._allowed(message[2:]):
                await self._refuse(message[1])
            elif verb == "REQ" and self._held(message[2:]):
                self.relay.served_reqs += 1
                self.held_reqs.append((message[1], frame))
            else:
                if verb == "REQ":
                    self.relay.served_reqs += 1
                elif verb == "CLOSE":
                    self.held_reqs = [(s, f) for s, f in self.held_reqs if s != message[1]]
                await self.upstream.send(frame)

    def _record(self, filters: list[Any]) -> None:
        for query in filters:
            if isinstance(query, dict) and DM_KINDS & set(query.get("kinds", [])):
                self.dm_requests.append([str(p) for p in query.get("#p", [])])

    def _held(self, filters: list[Any]) -> bool:
        held = self.relay.held_reads
        return any(
            isinstance(query, dict) and bool(held & set(query.get("#p", [])))
            for query in filters
        )

    async def _auth(self, raw: dict[str, Any]) -> None:
        event = nostr_sdk.Event.from_json(json.dumps(raw))
        tags = {t[0]: t[1] for t in raw.get("tags", []) if len(t) > 1}
        pubkey = event.author().to_hex()
        if not event.verify() or raw.get("kind") != 22242 or tags.get("challenge") != self.challenge:
            await self.send(["OK", raw.get("id", ""), False, "auth-required: bad AUTH event"])
            return
        if self.keys and self.relay.mode == "strfry":
            self.relay.refused_second_auth += 1
            await self.send(["OK", raw["id"], False, "error: already authenticated"])
            return
        if not self.keys:
            self.relay.auth_connections += 1
        if self.keys and self.relay.mode == "silent":
            pass  # nostr-rs-relay: "already authenticated", OK, the first key stays
        elif self.keys and self.relay.mode == "lazy":
            self.keys = [pubkey]  # khatru: the later AUTH replaces the authenticated key
            self.relay.authenticated.append(pubkey)
        elif pubkey not in self.keys:
            self.keys.append(pubkey)
            self.relay.authenticated.append(pubkey)
        if pubkey not in self.relay.withheld_oks:
            await self.send(["OK", raw["id"], True, ""])
        held, self.held_closed = self.held_closed, []
        for sub_id in held:
            await self.send(["CLOSED", sub_id, "auth-required: this REQ came before AUTH"])

    def _allowed(self, filters: list[Any]) -> bool:
        if self.relay.mode == "silent":
            return True
        for query in filters:
            if not isinstance(query, dict) or not DM_KINDS & set(query.get("kinds", [])):
                continue
            if not self.keys:
                return False
            if self.relay.any_key_reads:
                continue
            wanted = query.get("#p", [])
            if self.relay.mode == "strfry":
                if list(wanted) != [self.keys[0]]:
                    return False
            elif not wanted or not set(wanted) <= set(self.keys):
                return False
        return True

    async def _refuse(self, sub_id: str) -> None:
        self.relay.refused_reqs += 1
        closed = ["CLOSED", sub_id, "auth-required: DMs only for their recipient"]
        if self.relay.mode == "multi":
            await self.send(closed)
            return
        if self.relay.closed_first:
            await self.send(closed)
            await self.send(["AUTH", self.challenge])
            return
        await self.send(["AUTH", self.challenge])
        if self.relay.late_closed and not self.keys:
            self.held_closed.append(sub_id)
        else:
            await self.send(closed)
