"""A local APNs: HTTP/2 over TLS with the `h2` library, speaking the provider API's wire format.

It checks what Apple checks (POST /3/device/<token>, the ES256 provider token signed by the
team's key with the right `kid`/`iss`, `apns-topic`, `apns-push-type`) and answers as Apple
does: `:status` with the request's `apns-id` echoed, and on errors a JSON `reason` (410 adds a
`timestamp`). Tests script answers per device token and read back every request received.
Runs on its own event loop in a thread (tests) or as its own process (`python -m`, benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import uvloop
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes

from testkit.deadlines import STOP_SECONDS, scaled
from testkit.fakes.credentials import KEY_ID, TEAM_ID, TOPIC


@dataclass(frozen=True)
class ApnsRequest:
    token: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw_body: bytes


@dataclass
class Script:
    """How the fake answers: per-token (status, reason), an optional delay, or not at all."""

    answers: dict[str, tuple[int, str]] = field(default_factory=dict)
    delay_seconds: float = 0.0
    silent: bool = False


def _text(field: str | bytes) -> str:
    """A header field as text: h2 decodes them (header_encoding) but types them as either."""
    return field.decode() if isinstance(field, bytes) else field


class _Connection(asyncio.Protocol):
    def __init__(self, server: FakeApns) -> None:
        self.server = server
        self.conn = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, tuple[dict[str, str], bytearray]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.conn.initiate_connection()
        self.conn.update_settings({
            SettingCodes.MAX_CONCURRENT_STREAMS: 1000, SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20,
        })
        self.conn.increment_flow_control_window(1 << 24)
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)

    def flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except ProtocolError:
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            if isinstance(event, RequestReceived):
                headers = {_text(name): _text(value) for name, value in event.headers or ()}
                self.streams[event.stream_id] = (headers, bytearray())
            elif isinstance(event, DataReceived):
                self.streams[event.stream_id][1].extend(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamEnded):
                headers, body = self.streams.pop(event.stream_id)
                self.server.handle(self, event.stream_id, headers, bytes(body))
            elif isinstance(event, StreamReset):
                self.streams.pop(event.stream_id, None)
            elif isinstance(event, ConnectionTerminated) and self.transport is not None:
                self.transport.close()
        self.flush()

    def respond(self, stream_id: int, apns_id: str, status: int, reason: str, flush: bool) -> None:
        """Queue an answer; `flush` only outside data_received, which flushes once per read."""
        if self.transport is None or self.transport.is_closing():
            return
        headers = [(":status", str(status)), ("apns-id", apns_id)]
        if status == 200:
            self.conn.send_headers(stream_id, headers, end_stream=True)
        else:
            error: dict[str, Any] = {"reason": reason}
            if status == 410:
                error["timestamp"] = int(time.time() * 1000)
            payload = json.dumps(error).encode()
            self.conn.send_headers(stream_id, [*headers, ("content-type", "application/json")])
            self.conn.send_data(stream_id, payload, end_stream=True)
        if flush:
            self.flush()


class FakeApns:
    def __init__(self, cert_file: Path, key_file: Path, public_key_pem: bytes, record: bool = True) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.public_key = public_key_pem
        self.record = record
        self.script = Script()
        self.requests: list[ApnsRequest] = []
        self.answered = 0
        self.port = 0
        self._verified_tokens: set[str] = set()
        self.connections: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _auth_error(self, headers: dict[str, str]) -> str | None:
        authorization = headers.get("authorization", "")
        if not authorization.startswith("bearer "):
            return "MissingProviderToken"
        token = authorization.removeprefix("bearer ")
        if token in self._verified_tokens:
            return None
        try:
            if jwt.get_unverified_header(token).get("kid") != KEY_ID:
                return "InvalidProviderToken"
            claims = jwt.decode(token, self.public_key, algorithms=["ES256"])
        except jwt.PyJWTError:
            return "InvalidProviderToken"
        if claims.get("iss") != TEAM_ID or abs(time.time() - int(claims.get("iat", 0))) > 3600:
            return "InvalidProviderToken"
        self._verified_tokens.add(token)
        return None

    def _check(self, headers: dict[str, str], token: str, body: bytes) -> tuple[int, str] | None:
        if headers.get(":method") != "POST" or not headers.get(":path", "").startswith("/3/device/"):
            return 405, "MethodNotAllowed"
        auth_error = self._auth_error(headers)
        if auth_error:
            return 403, auth_error
        if headers.get("apns-topic") != TOPIC:
            return 400, "BadTopic"
        if headers.get("apns-push-type") not in ("alert", "background"):
            return 400, "InvalidPushType"
        if len(body) > 4096:
            return 413, "PayloadTooLarge"
        try:
            json.loads(body)
        except ValueError:
            return 400, "PayloadEmpty"
        if len(token) < 64 or any(c not in "0123456789abcdefABCDEF" for c in token):
            return 400, "BadDeviceToken"
        return None

    def handle(self, connection: _Connection, stream_id: int, headers: dict[str, str], body: bytes) -> None:
        token = headers.get(":path", "").removeprefix("/3/device/")
        apns_id = headers.get("apns-id") or str(uuid.uuid4())
        if self.record:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = {}
            self.requests.append(ApnsRequest(token, headers, parsed, body))
        script = self.script
        answer = self._check(headers, token, body) or script.answers.get(token, (200, ""))
        if script.silent:
            return
        if script.delay_seconds:
            assert self._loop is not None
            self._loop.call_later(
                script.delay_seconds, self._respond, connection, stream_id, apns_id, answer, True
            )
        else:
            self._respond(connection, stream_id, apns_id, answer, False)

    def _respond(
        self, connection: _Connection, stream_id: int, apns_id: str, answer: tuple[int, str], flush: bool
    ) -> None:
        connection.respond(stream_id, apns_id, *answer, flush)
        self.answered += 1

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        context.set_alpn_protocols(["h2"])
        return context

    async def serve(self, port: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), "127.0.0.1", port, ssl=self._ssl_context()
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self, port: int = 0) -> FakeApns:
        """Serve from a thread with its own event loop; returns once listening."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            loop.run_until_complete(self.serve(port))
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-apns", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise TimeoutError("fake APNs did not start")
        return self

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None:
            return

        async def shutdown() -> None:
            server.close()
            for connection in list(self.connections):
                if connection.transport is not None:
                    connection.transport.abort()
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        if self._thread is not None:
            self._thread.join(scaled(STOP_SECONDS))
        self._loop = self._server = None

    def tokens(self) -> list[str]:
        return [request.token for request in self.requests]


def main() -> None:
    """`python -m testkit.fakes.fake_apns`: serve until killed; prints the port when listening."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--public-key", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    fake = FakeApns(args.cert, args.key, args.public_key.read_bytes(), record=False)

    async def run() -> None:
        await fake.serve(args.port)
        print(fake.port, flush=True)
        await asyncio.Event().wait()

    uvloop.run(run())  # the fake must not be the bottleneck of the benchmark


if __name__ == "__main__":
    main()
