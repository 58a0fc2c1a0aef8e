"""FCM HTTP v1 through firebase-admin's async API: data-only, high-priority wakeups.

Three things firebase-admin does not offer are arranged here, each through the narrowest
private hook 7.7 has (pinned in pyproject):
- `endpoint` (tests, gateways): the class attribute `_MessagingService.FCM_URL` is read when an
  app's messaging service is created, so it is set around that one creation only.
- its own retries (4 times on 500/503 with backoff) would stack under ours and hold a
  concurrency slot for seconds, so the service's async client is replaced by one without.
- the OAuth access token is refreshed with blocking `requests` inside the async send; it is
  refreshed ahead of time in a thread instead, so the event loop never waits on Google.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import firebase_admin
import google.auth.exceptions
import google.auth.transport.requests
from firebase_admin import (
    _http_client,
    credentials,
    exceptions,
    messaging,
)
from firebase_admin._retry import HttpxRetry

from sigil_push.config import ConfigError
from sigil_push.push.base import Outcome, Status, WakeupMessage, parse_retry_after
from sigil_push.push.provider import Provider
from sigil_push.store.records import Device


def fcm_size(data: dict[str, str]) -> int:
    """FCM counts the keys and values of a data message against its 4 KiB."""
    return sum(len(key.encode()) + len(value.encode()) for key, value in data.items())


OPAQUE_COLLAPSE_KEY = "wakeup"
"""One key for every opaque wakeup: an offline phone gets one of them, which is all it needs.
Other modes send none, since FCM keeps at most four collapse keys per device."""


def _outcome(error: exceptions.FirebaseError) -> Outcome:
    """Map a firebase-admin error to an outcome; `detail` is the error class, never the text."""
    detail = type(error).__name__
    if isinstance(error, (messaging.UnregisteredError, messaging.SenderIdMismatchError,
                          exceptions.NotFoundError)):
        return Outcome(Status.UNREGISTERED, detail=detail)
    if isinstance(error, exceptions.InvalidArgumentError):
        if "registration token" in str(error).lower():
            return Outcome(Status.UNREGISTERED, detail="InvalidRegistrationToken")
        return Outcome(Status.REJECTED, detail=detail)
    response = error.http_response
    retry_after = parse_retry_after(response.headers.get("retry-after")) if response else None
    if isinstance(error, (exceptions.ResourceExhaustedError, exceptions.UnavailableError,
                          exceptions.InternalError, exceptions.DeadlineExceededError,
                          exceptions.UnknownError, exceptions.UnauthenticatedError,
                          exceptions.PermissionDeniedError, messaging.ThirdPartyAuthError)):
        return Outcome(Status.RETRY, retry_after, detail)
    return Outcome(Status.REJECTED, detail=detail)


class FcmSender:

    def __init__(
        self, app: firebase_admin.App, timeout_seconds: float, declared: Provider[Any]
    ) -> None:
        self.platform = declared.platform
        self.provider = declared.name
        self.max_concurrency = declared.policy.max_concurrency
        self._max_payload = declared.policy.max_payload_bytes
        self._app = app
        self._timeout = timeout_seconds
        self._credential = app.credential.get_credential()
        self._refresh_lock = asyncio.Lock()

    @classmethod
    async def create(
        cls, endpoint: str, credentials_file: Path, timeout_seconds: float, declared: Provider[Any]
    ) -> FcmSender:
        """`endpoint`: the `[fcm]` table's override of Google's URL (empty: Google's);
        `declared`: the provider's declaration, whose name, platform and limits the sender takes
        (handed over, so the sender imports nothing back)."""
        try:
            info = json.loads(await asyncio.to_thread(credentials_file.read_text, encoding="utf-8"))
            credential = credentials.Certificate(info)
        except (ValueError, TypeError) as exc:
            raise ConfigError("fcm.credentials_file", f"not a service-account JSON: {exc}") from None
        app = firebase_admin.initialize_app(
            credential, {"httpTimeout": timeout_seconds}, name=f"sigil-push-{uuid4().hex}"
        )
        service_class = messaging._MessagingService
        default_url = service_class.FCM_URL
        if endpoint:
            service_class.FCM_URL = endpoint.rstrip("/") + "/v1/projects/{0}/messages:send"
        try:
            service = messaging._get_messaging_service(app)
        finally:
            service_class.FCM_URL = default_url
        service._async_client = _http_client.HttpxAsyncClient(
            credential=app.credential.get_credential(),
            timeout=timeout_seconds,
            retry_config=HttpxRetry(max_retries=0),
        )
        return cls(app, timeout_seconds, declared)

    def fits(self, data: dict[str, str]) -> bool:
        return fcm_size(data) <= self._max_payload

    async def _fresh_token(self) -> None:
        """Refresh the OAuth token off the event loop when it is missing or about to expire."""
        if self._credential.valid:
            return
        async with self._refresh_lock:
            if not self._credential.valid:
                request = google.auth.transport.requests.Request()
                await asyncio.to_thread(self._credential.refresh, request)

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        android = messaging.AndroidConfig(
            priority="high",
            ttl=timedelta(seconds=message.ttl_seconds),
            collapse_key=OPAQUE_COLLAPSE_KEY if message.opaque else None,
        )
        with warnings.catch_warnings():
            # 7.7 steers towards installation ids (`fid`); apps register registration tokens
            warnings.simplefilter("ignore", DeprecationWarning)
            fcm_message = messaging.Message(token=device.token, data=message.data, android=android)
        try:
            async with asyncio.timeout(self._timeout):
                await self._fresh_token()
                batch = await messaging.send_each_async([fcm_message], app=self._app)
        except TimeoutError:
            return Outcome(Status.RETRY, detail="timeout")
        except (google.auth.exceptions.GoogleAuthError, OSError) as exc:
            return Outcome(Status.RETRY, detail=f"oauth: {type(exc).__name__}")
        except exceptions.FirebaseError as exc:
            return _outcome(exc)
        response = batch.responses[0]
        if response.success:
            return Outcome(Status.ACCEPTED)
        return _outcome(response.exception)

    async def close(self) -> None:
        service = messaging._get_messaging_service(self._app)
        await service._async_client.aclose()
        # delete_app closes the async client with asyncio.run, which needs a thread of its own
        await asyncio.to_thread(firebase_admin.delete_app, self._app)
