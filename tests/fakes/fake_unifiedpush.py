"""A local UnifiedPush distributor: RFC 8030 push resources under /up/<name>.

Accepts a POST with 201 (as ntfy and other distributors do), records headers and body, and
answers per resource name as scripted: any status with an optional Retry-After, or a redirect
(which a compliant sender must not follow: the redirect target records whether it was hit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.fakes.http_server import Receive, Scope, Send, ServerThread, read_body, respond


@dataclass(frozen=True)
class PushRequest:
    name: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Script:
    answers: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    redirects: dict[str, str] = field(default_factory=dict)


class FakeUnifiedPush:
    def __init__(self) -> None:
        self.script = Script()
        self.requests: list[PushRequest] = []
        self._thread: ServerThread | None = None

    def endpoint(self, name: str) -> str:
        assert self._thread is not None
        return f"http://127.0.0.1:{self._thread.port}/up/{name}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        path: str = scope["path"]
        if scope["method"] != "POST" or not path.startswith("/up/"):
            await respond(send, 404)
            return
        name = path.removeprefix("/up/")
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests.append(PushRequest(name, headers, body))
        if name in self.script.redirects:
            await respond(send, 307, headers={"location": self.endpoint(self.script.redirects[name])})
            return
        status, retry_after = self.script.answers.get(name, (201, None))
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
