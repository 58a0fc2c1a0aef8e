"""Tracebacks in the service log keep the type and frames of an unexpected exception but not
its message, which can quote the key, token or URL it failed on (tracebacks.py)."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request

from sigil_push.delivery import Delivery
from sigil_push.http.api import _error_response
from sigil_push.http.server import _uvicorn_config
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.push.base import Outcome, WakeupMessage
from sigil_push.store.records import Device
from sigil_push.telemetry.tracebacks import withheld
from testkit.fakes.harness import Harness, apns_token, eventually

NPUB = encode_npub("cd" * 32)
TOKEN = "ab12" * 16


def _store_failure() -> asyncpg.UniqueViolationError:
    """What asyncpg raises for a duplicate row: str() appends the server's DETAIL, values included."""
    exc = asyncpg.UniqueViolationError('duplicate key value violates unique constraint "devices_pkey"')
    exc.detail = f"Key (pubkey, token)=({NPUB}, {TOKEN}) already exists."
    return exc


def _failing_write() -> None:
    try:
        raise ValueError(f"cannot parse {NPUB}")
    except ValueError as cause:
        raise _store_failure() from cause


def test_a_withheld_traceback_keeps_types_and_frames_not_messages(caplog: pytest.LogCaptureFixture) -> None:
    assert TOKEN in str(_store_failure())  # what a plain log.exception would have written
    try:
        _failing_write()
    except asyncpg.UniqueViolationError as exc:
        with caplog.at_level(logging.ERROR):
            logging.getLogger("sigil_push.test").error("write failed", exc_info=withheld(exc))
    text = caplog.text
    assert TOKEN not in text and NPUB not in text
    assert "asyncpg.exceptions.UniqueViolationError" in text and "builtins.ValueError" in text
    assert "_failing_write" in text and "direct cause" in text


def test_an_unhandled_api_error_logs_no_value_of_its_message(caplog: pytest.LogCaptureFixture) -> None:
    request = Request({"type": "http", "method": "POST", "path": "/register", "headers": [], "query_string": b""})
    try:
        _failing_write()
    except asyncpg.UniqueViolationError as exc:
        with caplog.at_level(logging.ERROR):
            response = _error_response(request, exc)
    assert response.status_code == 500
    assert "unhandled error on POST /register" in caplog.text
    assert "UniqueViolationError" in caplog.text
    assert TOKEN not in caplog.text and NPUB not in caplog.text


def test_uvicorn_logs_an_application_exception_without_its_message(caplog: pytest.LogCaptureFixture) -> None:
    """Starlette re-raises what the app's 500 handler answered, and uvicorn logs it again
    (`Exception in ASGI application`) with its traceback."""
    _uvicorn_config(object(), "127.0.0.1:0", "off")
    try:
        _failing_write()
    except asyncpg.UniqueViolationError as exc:
        with caplog.at_level(logging.ERROR):
            logging.getLogger("uvicorn.error").error("Exception in ASGI application\n", exc_info=exc)
    assert "Exception in ASGI application" in caplog.text and "UniqueViolationError" in caplog.text
    assert TOKEN not in caplog.text and NPUB not in caplog.text


class QuotingSender:
    """A provider client that fails unexpectedly and, as libraries do, quotes what it was given."""

    platform = "ios"
    provider = "apns"
    max_concurrency = 4

    def __init__(self) -> None:
        self.calls = 0

    def fits(self, data: dict[str, str]) -> bool:
        return True

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        self.calls += 1
        raise RuntimeError(f"stream reset while sending to /3/device/{device.token}")

    async def close(self) -> None:
        pass


async def test_an_unexpected_sender_failure_logs_no_token(
    make_harness: Any, caplog: pytest.LogCaptureFixture
) -> None:
    harness: Harness = await make_harness(start=False)
    sender = QuotingSender()
    harness.delivery = Delivery(
        harness.outbox, harness.devices, {"ios": sender}, harness.observations, True,
        harness.config.push, harness.config.limits,
    )
    token = apns_token()
    device = await harness.register("ios", token)
    with caplog.at_level(logging.ERROR, logger="sigil_push"):
        await harness.delivery.start()
        await harness.enqueue([device])
        await eventually(lambda: "sender failed unexpectedly" in caplog.text, what="the failure logged")
        await harness.stop_delivery()
    assert sender.calls >= 1
    assert "RuntimeError" in caplog.text and "send" in caplog.text
    assert token not in caplog.text
    assert harness.recipient_key.public_key_hex not in caplog.text
