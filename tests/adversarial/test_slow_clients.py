"""Slow and bloated HTTP clients against the API's own server settings (server.py's uvicorn
config, in process on 127.0.0.1): 200 connections that send half a request line and then a
byte at a time were never closed (uvicorn has no deadline for a request); now each must send a
whole request within the deadline, and /health keeps answering meanwhile. Header lines and
bytes are bounded before the app is called."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sigil_push.http import protocol as http_protocol
from sigil_push.http.protocol import MAX_HEADERS, REQUEST_DEADLINE_SECONDS
from sigil_push.http.server import _AdminServer, _uvicorn_config, warn_if_trusting_everyone
from testkit.deadlines import REQUEST_SECONDS, scaled

SLOW_CLIENTS = 200


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


@pytest.fixture
async def api_port() -> AsyncIterator[int]:
    app = Starlette(routes=[Route("/health", _health)])
    server = _AdminServer(_uvicorn_config(app, "127.0.0.1:0", "off"))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + scaled(30)
    while not server.started:
        assert time.monotonic() < deadline and not task.done(), "the server did not start"
        await asyncio.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    await task


async def _slow_client(port: int, closed: list[float], started: float) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /hea")
    try:
        for _ in range(120):  # a byte a second, for up to two minutes
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), timeout=1.0) == b"":  # a pace, not a deadline
                    break
            except TimeoutError:
                writer.write(b"l")
                continue
            break
    except ConnectionError:
        pass
    closed.append(time.monotonic() - started)
    writer.close()


@pytest.mark.slow  # waits on the real request deadline
async def test_slow_clients_are_closed_and_health_still_answers(api_port: int) -> None:
    closed: list[float] = []
    started = time.monotonic()
    clients = [asyncio.create_task(_slow_client(api_port, closed, started))
               for _ in range(SLOW_CLIENTS)]
    try:
        health_seconds = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=scaled(REQUEST_SECONDS)) as http:
            while len(closed) < SLOW_CLIENTS * 0.9 and time.monotonic() - started < scaled(60):
                asked = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                health_seconds.append(time.monotonic() - asked)
                await asyncio.sleep(0.5)
        assert len(closed) >= SLOW_CLIENTS * 0.9, f"only {len(closed)} closed within {scaled(60):.0f} s"
        assert min(closed) >= REQUEST_DEADLINE_SECONDS * 0.9
        assert health_seconds, "/health was asked while the slow clients were open"
    finally:
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)


async def test_header_count_and_size_are_bounded(api_port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=scaled(REQUEST_SECONDS)) as http:
        many = {f"x-h{i}": "1" for i in range(MAX_HEADERS + 1)}
        refused = await http.get("/health", headers=many)
        assert refused.status_code == 400 and refused.json()["error"] == "http_error"
        huge = {"x-big": "a" * 20_000}
        refused = await http.get("/health", headers=huge)
        assert refused.status_code == 400 and refused.json()["error"] == "http_error"
        assert (await http.get("/health", headers={"x-h": "1"})).status_code == 200


async def test_past_the_concurrency_limit_the_answer_is_a_json_503(
    api_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections past the limit get uvicorn's 503 at once, but as JSON with Retry-After (it
    was `text/plain` "Service Unavailable"); below it again, requests are served."""
    monkeypatch.setattr(http_protocol, "LIMIT_CONCURRENCY", 3)
    idle = [await asyncio.open_connection("127.0.0.1", api_port) for _ in range(3)]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=scaled(REQUEST_SECONDS)) as http:
            busy = await http.get("/health")
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"] == "unavailable"
    finally:
        for _, writer in idle:
            writer.close()
    monkeypatch.setattr(http_protocol, "LIMIT_CONCURRENCY", 1024)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=scaled(REQUEST_SECONDS)) as http:
        assert (await http.get("/health")).status_code == 200


def test_trusting_every_address_as_a_proxy_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="sigil_push.http.server"):
        assert not warn_if_trusting_everyone(("127.0.0.1", "10.0.0.0/8"))
        assert not caplog.records
        assert warn_if_trusting_everyone(("10.0.0.0/8", "::/0"))
    assert "trusted_proxies covers every address" in caplog.text
