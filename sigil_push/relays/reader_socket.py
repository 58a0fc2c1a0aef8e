"""The relay reader's websocket: aiohttp's client, opened through the outbound guard.

Why not websockets, which every other socket of the server uses (signer links, publishing,
the guard's own `open_relay_socket`): a firehose relay sends every DM on the network, most of
them for nobody here, so the cost of reading one frame is the cost of the firehose. Measured
(bench/reader.py, CPU per ~560-byte frame on this machine): websockets' asyncio client about
8 µs, most of it its pure-Python frame parser; aiohttp's C frame reader about 2 µs. aiohttp is
already a dependency (NIP-11, HTTP providers), so the bridge's readers moved to it; picows (about
1 µs) would have needed a new dependency and a message assembler of our own.

What the guard gives `open_relay_socket`, this gives the reader too: the destination checked
before connecting and the socket opened to exactly the checked address (aiohttp asks the
pinned resolver, TLS SNI and Host still carry the name), the per-host slot held while open,
one deadline for resolve + connect + handshake, the guard's frame ceiling, no proxy (not
even from the environment) and no redirects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import ClientHandlerType, ClientRequest, ClientResponse

from sigil_push.outbound import PinnedResolver, current_guard

ReaderSocket = aiohttp.ClientWebSocketResponse
CLOSE_TIMEOUT_SECONDS = 10.0


async def _no_redirects(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
    """A relay's 3xx ends the attempt: the guard checked this URL, not where it points to."""
    response = await handler(request)
    if 300 <= response.status < 400:
        response.release()
        raise aiohttp.WSServerHandshakeError(
            response.request_info, response.history, status=response.status,
            message="redirect refused", headers=response.headers,
        )
    return response


@contextlib.asynccontextmanager
async def open_reader(
    url: str,
    *,
    purpose: str,
    max_size: int,
    open_timeout: float,
    heartbeat: float,
    user_agent: str,
) -> AsyncIterator[ReaderSocket]:
    """A websocket to `url` for reading a relay; closed (code 1000) when the block exits.

    `heartbeat`: a ping after that many seconds without any data from the relay, and the
    socket fails if no pong (or any data) comes within half of it. `max_size`: the largest
    message accepted (bigger ones close the socket with 1009), capped by the guard's ceiling.
    """
    guard = current_guard()
    async with contextlib.AsyncExitStack() as stack:
        async with asyncio.timeout(open_timeout):
            target, address = await guard.check(url, purpose)
            stack.enter_context(guard.slot(url, target.host, purpose))
            connector = aiohttp.TCPConnector(
                resolver=None if address is None else PinnedResolver(address),
                use_dns_cache=False,
                limit=1,
            )
            session = await stack.enter_async_context(aiohttp.ClientSession(
                connector=connector, trust_env=False, middlewares=(_no_redirects,),
            ))
            ws = await stack.enter_async_context(session.ws_connect(
                url,
                max_msg_size=min(max_size, guard.max_frame_bytes),
                heartbeat=heartbeat,
                compress=0,
                proxy=None,
                headers={"User-Agent": user_agent},
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=CLOSE_TIMEOUT_SECONDS),
            ))
        yield ws
