"""A local FCM: the HTTP v1 `messages:send` endpoint and Google's OAuth 2.0 token endpoint.

The token endpoint verifies the service account's signed JWT assertion (RS256) like Google
does and hands out an access token; `messages:send` accepts only that token, validates the
message shape FCM validates, and answers per registration token as scripted: FCM's error
JSON (`status`, and `details[].errorCode` such as UNREGISTERED) with Retry-After when asked.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import jwt
import uvicorn

from testkit.fakes.credentials import PROJECT_ID
from testkit.fakes.http_server import Receive, Scope, Send, ServerThread, read_body, respond

GOOGLE_AUDIENCES = ["https://oauth2.googleapis.com/token"]
"""google-auth signs the assertion for Google's token URL even when posting it to `token_uri`."""

SEND_PATH = re.compile(r"^/v1/projects/([^/]+)/messages:send$")

ERRORS: dict[str, tuple[int, str, str, str]] = {
    "UNREGISTERED": (404, "NOT_FOUND", "UNREGISTERED", "Requested entity was not found."),
    "INVALID_TOKEN": (400, "INVALID_ARGUMENT", "INVALID_ARGUMENT",
                      "The registration token is not a valid FCM registration token"),
    "INVALID_ARGUMENT": (400, "INVALID_ARGUMENT", "INVALID_ARGUMENT", "Invalid value at message.data"),
    "QUOTA_EXCEEDED": (429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED", "Quota exceeded."),
    "UNAVAILABLE": (503, "UNAVAILABLE", "UNAVAILABLE", "The service is currently unavailable."),
    "INTERNAL": (500, "INTERNAL", "INTERNAL", "Internal error."),
}


@dataclass
class Script:
    """Per registration token: an ERRORS key and an optional Retry-After value."""

    answers: dict[str, tuple[str, str | None]] = field(default_factory=dict)


class FakeFcm:
    def __init__(self, service_account_public_key: bytes | None, record: bool = True) -> None:
        self.public_key = service_account_public_key
        self.record = record
        self.script = Script()
        self.messages: list[dict[str, Any]] = []
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.token_requests = 0
        self.send_attempts = 0
        self._access_tokens: set[str] = set()
        self._thread: ServerThread | None = None

    @property
    def url(self) -> str:
        assert self._thread is not None
        return f"http://127.0.0.1:{self._thread.port}"

    @property
    def token_uri(self) -> str:
        return f"{self.url}/token"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if scope["method"] == "POST" and scope["path"] == "/token":
            await self._token(send, body)
            return
        match = SEND_PATH.match(scope["path"])
        if scope["method"] != "POST" or match is None:
            await self._error(send, 404, "NOT_FOUND", None, "Not found")
            return
        await self._send(send, match.group(1), headers, body)

    async def _token(self, send: Send, body: bytes) -> None:
        self.token_requests += 1
        form = urllib.parse.parse_qs(body.decode())
        assertion = form.get("assertion", [""])[0]
        try:
            if self.public_key is not None:
                claims = jwt.decode(
                    assertion, self.public_key, algorithms=["RS256"], audience=GOOGLE_AUDIENCES + [self.token_uri]
                )
                if "cloud-platform" not in claims.get("scope", "") and "firebase.messaging" not in claims.get("scope", ""):
                    raise jwt.InvalidTokenError("scope")
        except jwt.PyJWTError:
            await respond(send, 400, b'{"error": "invalid_grant"}', {"content-type": "application/json"})
            return
        token = "ya29.fake-" + secrets.token_hex(8)
        self._access_tokens.add(token)
        reply = {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}
        await respond(send, 200, json.dumps(reply).encode(), {"content-type": "application/json"})

    async def _error(self, send: Send, status: int, code: str, error_code: str | None, message: str,
                     retry_after: str | None = None) -> None:
        error: dict[str, Any] = {"code": status, "message": message, "status": code}
        if error_code:
            error["details"] = [{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                                 "errorCode": error_code}]
        headers = {"content-type": "application/json"}
        if retry_after is not None:
            headers["retry-after"] = retry_after
        await respond(send, status, json.dumps({"error": error}).encode(), headers)

    async def _send(self, send: Send, project: str, headers: dict[str, str], body: bytes) -> None:
        self.send_attempts += 1
        if self.record:
            self.requests.append((headers, body))
        if headers.get("authorization", "").removeprefix("Bearer ") not in self._access_tokens:
            await self._error(send, 401, "UNAUTHENTICATED", None, "Request had invalid authentication credentials.")
            return
        if project != PROJECT_ID:
            await self._error(send, 403, "PERMISSION_DENIED", "SENDER_ID_MISMATCH", "SenderId mismatch")
            return
        try:
            message = json.loads(body)["message"]
            token = message["token"]
            data = message.get("data", {})
            if not all(isinstance(v, str) for v in data.values()):
                raise ValueError("data values must be strings")
        except (ValueError, KeyError, TypeError):
            await self._error(send, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT", "Invalid JSON payload")
            return
        if sum(len(k.encode()) + len(v.encode()) for k, v in data.items()) > 4096:
            await self._error(send, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT", "Message is too big")
            return
        if self.record:
            self.messages.append(message)
        answer = self.script.answers.get(token)
        if answer is not None:
            status, code, error_code, text = ERRORS[answer[0]]
            await self._error(send, status, code, error_code, text, answer[1])
            return
        name = f"projects/{project}/messages/{int(time.time() * 1e6)}"
        await respond(send, 200, json.dumps({"name": name}).encode(), {"content-type": "application/json"})

    def start(self, port: int = 0) -> FakeFcm:
        self._thread = ServerThread(self, port).start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()


def main() -> None:
    """`python -m testkit.fakes.fake_fcm --port P`: serve until killed (benchmark)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(FakeFcm(None, record=False), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
