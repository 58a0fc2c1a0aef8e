"""A relay that publishes a small NIP-11 `max_limit` and honours it, like strfry's 500.

It stores the events it is given, answers each filter of a REQ with at most `max_limit` of
the newest matching ones (by `kinds`, `#p`, `authors`, `since`, `until`; fewer when the
filter's own `limit` is smaller, though a `limit` of 0 is ignored, as nostr-relay ignores it)
and then EOSE, and serves its information document to plain HTTP requests. Enough of NIP-01 and NIP-11 to test paging; it runs in the test's loop.
With `honours_since` False it serves stored events whatever a filter's `since`, as some relays
do (a client cannot rely on a relay's filtering for freshness).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from testkit.loopback_relay import LoopbackRelay


def _matches(event: dict[str, Any], query: dict[str, Any], since: bool = True) -> bool:
    if "kinds" in query and event["kind"] not in query["kinds"]:
        return False
    if "#p" in query and not any(t[0] == "p" and t[1] in query["#p"] for t in event["tags"]):
        return False
    if "authors" in query and event["pubkey"] not in query["authors"]:
        return False
    if since and "since" in query and event["created_at"] < query["since"]:
        return False
    return not ("until" in query and event["created_at"] > query["until"])


class PagingRelay(LoopbackRelay):
    def __init__(
        self, events: list[dict[str, Any]], max_limit: int, honours_since: bool = True
    ) -> None:
        self.events = events
        self.max_limit = max_limit
        self.honours_since = honours_since
        self.requests: list[list[dict[str, Any]]] = []

    def _serve_options(self) -> dict[str, Any]:
        return {"process_request": self._information}

    def _information(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None
        body = json.dumps({"name": "paging", "limitation": {"max_limit": self.max_limit}})
        headers = Headers([("Content-Type", "application/nostr+json")])
        return Response(HTTPStatus.OK.value, "OK", headers, body.encode())

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            async for text in ws:
                message = json.loads(text)
                if message[0] == "REQ":
                    await self._answer(ws, message[1], message[2:])
        except ConnectionClosed:
            return

    async def _answer(
        self, ws: ServerConnection, sub_id: str, queries: list[dict[str, Any]]
    ) -> None:
        self.requests.append(queries)
        for query in queries:
            found = [e for e in self.events if _matches(e, query, self.honours_since)]
            found.sort(key=lambda e: e["created_at"], reverse=True)
            limit = query.get("limit")
            cap = min(limit, self.max_limit) if isinstance(limit, int) and limit > 0 else (
                self.max_limit
            )
            for event in found[:cap]:
                await ws.send(json.dumps(["EVENT", sub_id, event]))
        await ws.send(json.dumps(["EOSE", sub_id]))
