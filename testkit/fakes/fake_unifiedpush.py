"""A local UnifiedPush distributor: RFC 8030 push resources under /up/<name>, with autopush's rules.

Like autopush (Mozilla's push server, behind the Sunup distributor), it refuses a POST without
`TTL` (400, errno 111) and a body over 4,096 bytes (413, errno 104). With `require_vapid` set it
also checks RFC 8292 as autopush does, answering 401 (errno 109) for a missing or malformed
`Authorization: vapid t=…,k=…`, a bad signature, an `aud` other than this server's origin, an
expired token or one that expires more than 24 h from now, or a token without `sub`; and for a
resource bound to a VAPID key (`restricted`, an AND_3 app that gave its distributor our key), a
request signed with another key. The JWT is checked with PyJWT, not with the py-vapid code that
signed it.

Otherwise it accepts with 201 (as ntfy and other distributors do), records headers, body and the
status it answered, and answers per resource name as scripted: any status with an optional
Retry-After, or a redirect (which a compliant sender must not follow: the redirect target
records whether it was hit).
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import time
from dataclasses import dataclass, field

import jwt
import uvicorn
from cryptography.hazmat.primitives.asymmetric import ec

from testkit.fakes.http_server import Receive, Scope, Send, ServerThread, read_body, respond

MAX_BODY_BYTES = 4096
MAX_VAPID_EXPIRY_SECONDS = 24 * 3600


@dataclass(frozen=True)
class PushRequest:
    name: str
    headers: dict[str, str]
    body: bytes
    status: int


@dataclass
class Script:
    answers: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    redirects: dict[str, str] = field(default_factory=dict)
    require_vapid: bool = False
    restricted: dict[str, str] = field(default_factory=dict)
    """Resource name → the base64url VAPID public key its subscription was created with."""
    vapid_key: str | None = None
    """The key every other resource is bound to (a benchmark's endpoints), if any."""


class Refused(Exception):
    def __init__(self, status: int, errno: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.errno = errno


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_vapid(header: str) -> tuple[str, str]:
    """(token, public key) from `vapid t=…, k=…`, parsed the way autopush does (spaces ignored)."""
    scheme, _, data = header.partition(" ")
    if scheme.lower() != "vapid" or not data:
        raise Refused(401, 109, "Unknown auth scheme")
    pairs = dict(item.split("=", 1) for item in data.replace(" ", "").split(",") if "=" in item)
    if "t" not in pairs or "k" not in pairs:
        raise Refused(401, 109, "Missing VAPID token or key")
    return pairs["t"], pairs["k"]


def verify_vapid(header: str | None, audience: str, bound_key: str | None) -> dict[str, object]:
    """The verified JWT claims; raises Refused with autopush's answer otherwise."""
    if not header:
        raise Refused(401, 109, "Missing VAPID authorization")
    token, key = parse_vapid(header)
    if bound_key is not None and key.rstrip("=") != bound_key.rstrip("="):
        raise Refused(401, 109, "VAPID public key mismatch")
    try:
        public_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), _b64url_decode(key))
    except ValueError:
        raise Refused(401, 109, "Invalid VAPID public key") from None
    try:
        claims = jwt.decode(
            token, public_key, algorithms=["ES256"], audience=audience,
            options={"require": ["aud", "exp", "sub"]},
        )
    except jwt.PyJWTError as exc:
        raise Refused(401, 109, f"Invalid VAPID token: {type(exc).__name__}") from None
    if int(claims["exp"]) > time.time() + MAX_VAPID_EXPIRY_SECONDS:
        raise Refused(401, 109, "The VAPID token expiration is too long")
    if not str(claims["sub"]).startswith(("mailto:", "https:")):
        raise Refused(401, 109, "Invalid VAPID subject")
    return dict(claims)


class FakeUnifiedPush:
    def __init__(self, record: bool = True, hosts: int = 0) -> None:
        self.record = record
        self.hosts = hosts
        self.script = Script()
        self.requests: list[PushRequest] = []
        self._thread: ServerThread | None = None

    port = 0

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self._thread.port if self._thread else self.port}"

    def endpoint(self, name: str) -> str:
        return f"{self.origin}/up/{name}"

    def _check(self, name: str, headers: dict[str, str], body: bytes) -> None:
        """autopush's order: headers first, then size, then authorization."""
        ttl = headers.get("ttl", "")
        if not ttl.isdigit():
            raise Refused(400, 111, "Missing TTL header")
        if len(body) > MAX_BODY_BYTES:
            raise Refused(413, 104, "Message payload too large")
        bound = self.script.restricted.get(name, self.script.vapid_key)
        if self.script.require_vapid or bound is not None:
            # listening on several loopback addresses (a benchmark's many push hosts), the
            # audience is the origin the request was sent to
            audience = f"http://{headers['host']}" if self.hosts else self.origin
            verify_vapid(headers.get("authorization"), audience, bound)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        path: str = scope["path"]
        if scope["method"] != "POST" or not path.startswith("/up/"):
            await respond(send, 404)
            return
        name = path.removeprefix("/up/")
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        try:
            self._check(name, headers, body)
        except Refused as refused:
            self.requests.append(PushRequest(name, headers, body, refused.status))
            error = {"code": refused.status, "errno": refused.errno, "message": str(refused)}
            await respond(send, refused.status, json.dumps(error).encode(),
                          {"content-type": "application/json"})
            return
        if name in self.script.redirects:
            self.requests.append(PushRequest(name, headers, body, 307))
            await respond(send, 307, headers={"location": self.endpoint(self.script.redirects[name])})
            return
        status, retry_after = self.script.answers.get(name, (201, None))
        if self.record:
            self.requests.append(PushRequest(name, headers, body, status))
        extra = {"retry-after": retry_after} if retry_after else {}
        location = {"location": f"/message/{len(self.requests)}"} if status == 201 else {}
        await respond(send, status, headers={**extra, **location})

    def received(self, name: str) -> list[PushRequest]:
        return [request for request in self.requests if request.name == name]

    def start(self) -> FakeUnifiedPush:
        self._thread = ServerThread(self).start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()


def loopback_host(number: int) -> str:
    """The `number`th (from 0) of the loopback addresses `--hosts` listens on: 127.0.1.1, ...
    Each is its own endpoint host (registrable domain) to the service."""
    return f"127.0.{1 + number // 250}.{1 + number % 250}"


def main() -> None:
    """`python -m testkit.fakes.fake_unifiedpush --port P [--vapid-key K] [--hosts N]`: serve
    until killed, checking every push's VAPID against K (benchmarks). With N, listen on P of N
    loopback addresses (`loopback_host`) besides 127.0.0.1, as N push hosts."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--vapid-key")
    parser.add_argument("--hosts", type=int, default=0)
    args = parser.parse_args()
    fake = FakeUnifiedPush(record=False, hosts=args.hosts)
    fake.port = args.port
    fake.script.vapid_key = args.vapid_key
    config = uvicorn.Config(fake, log_level="warning", access_log=False, lifespan="off")
    sockets = []
    for address in ["127.0.0.1", *(loopback_host(number) for number in range(args.hosts))]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, args.port))
        sock.listen(1024)
        sockets.append(sock)
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    main()
