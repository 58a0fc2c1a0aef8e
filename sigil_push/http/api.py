"""The REST API (CONTRACT section 3): registration of devices, discovery, health and metrics.

Handlers are short: they authenticate, validate into typed requests and call the store. Every
failure is a typed exception mapped to the contract's JSON error in one place, `_error_response`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sigil_push import __version__
from sigil_push.bridge.watches import mask_classes
from sigil_push.errors import ApiError, BadRequest, RateLimited
from sigil_push.http.cors import CorsMiddleware
from sigil_push.http.deadline import store_deadline
from sigil_push.http.iris import IrisRoutes
from sigil_push.http.metrics import MetricsMiddleware
from sigil_push.http.ratelimit import client_address, rate_limit_key, trusted_networks
from sigil_push.http.validation import (
    parse_json_object,
    parse_npub,
    parse_pair_token,
    parse_preferences,
    parse_presence_seconds,
    parse_register,
)
from sigil_push.http.worker_metrics import WorkerLabelled
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.nostr.nip98 import AuthError, AuthExpired, AuthMissing, verify_http_auth
from sigil_push.push import registry
from sigil_push.service import Service, State
from sigil_push.store.auth_ids import request_digest
from sigil_push.store.errors import (
    STORE_UNAVAILABLE,
    StoreUnavailable,
    TargetTaken,
    TooManyAccounts,
    TooManyDevices,
)
from sigil_push.store.records import Device, QuietHours
from sigil_push.telemetry.redaction import relay_label
from sigil_push.telemetry.tracebacks import withheld
from sigil_push.token_bucket import RateLimiter

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024
MAX_MUTE_BODY_BYTES = 80 * 1024
"""/preferences only: a private mute list of 1,000 npubs is about 66 KiB, past the 8 KiB of
every other route (/register keeps 8 KiB: a longer list is sent with /preferences)."""
UNLIMITED_ROUTES = ("/health", "/metrics")
def _path_as_sent(request: Request) -> str:
    """The request's path as the client sent it, percent-escapes and all: what a NIP-98 `u`
    tag names ("the absolute request URL"), so `/subscriptions/a%20b` is signed as that, not as
    the decoded `/subscriptions/a b` no client would write."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path


class Api:
    """Request handling bound to one running Service."""

    def __init__(self, service: Service) -> None:
        self.service = service
        limits = service.config.limits
        self.per_ip = RateLimiter(limits.requests_per_minute_per_ip, "rate_buckets_ip")
        self.per_npub = RateLimiter(limits.requests_per_minute_per_npub, "rate_buckets_npub")
        self.trusted_proxies = trusted_networks(service.config.server.trusted_proxies)
        self.admin_split = bool(service.config.server.admin_listen)
        self.exposition = WorkerLabelled(lambda: service.worker_label)

    # -- request plumbing ------------------------------------------------------------------

    def _require_serving(self) -> None:
        if self.service.state is not State.SERVING:
            raise ApiError(503, "unavailable", f"service is {self.service.state.value}")

    def _limit_ip(self, request: Request) -> None:
        peer = request.client.host if request.client else "unknown"
        client = client_address(peer, request.headers.get("x-forwarded-for"), self.trusted_proxies)
        wait = self.per_ip.check(rate_limit_key(client))
        if wait:
            raise RateLimited(wait)

    async def _read_body(self, request: Request, most: int = MAX_BODY_BYTES) -> bytes:
        """Read at most `most` bytes; larger bodies are refused without being buffered."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > most):
            raise ApiError(413, "body_too_large", f"body must be at most {most} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > most:
                raise ApiError(413, "body_too_large", f"body must be at most {most} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _json_body(self, request: Request, most: int = MAX_BODY_BYTES) -> bytes:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, "unsupported_media_type", "Content-Type must be application/json")
        return await self._read_body(request, most)

    async def _authenticate(self, request: Request, body: bytes, lenient: bool = False) -> str:
        """Verify NIP-98 for this exact request and spend the auth event; returns its pubkey.
        `lenient`: the Iris routes' NIP-98 (sigil_push/nostr/nip98.py)."""
        url = self.service.config.server.public_url + _path_as_sent(request)
        event = verify_http_auth(
            request.headers.get("authorization"), url, request.method, body, time.time(), lenient
        )
        spent_on = request_digest(request.method, url, body)
        if not await self.service.components.auth_ids.claim(event.id, event.sig, spent_on):
            raise ApiError(401, "auth_replayed", "this auth event was used for another request")
        wait = self.per_npub.check(event.pubkey)
        if wait:
            raise RateLimited(wait)
        return event.pubkey

    # -- routes ----------------------------------------------------------------------------

    async def register(self, request: Request) -> Response:
        self._require_serving()
        self._limit_ip(request)
        raw = await self._json_body(request)
        auth_pubkey = await self._authenticate(request, raw)
        body = parse_json_object(raw)
        pubkey = parse_npub(body.get("npub"))
        if pubkey != auth_pubkey:
            raise ApiError(403, "npub_mismatch", "the auth event must be signed by the npub's key")
        config = self.service.config
        wanted = parse_register(body, pubkey, config.server.allow_insecure_relays)
        if wanted.platform not in registry.platforms(config):
            raise BadRequest("platform_disabled", f"this instance does not send to {wanted.platform}")
        provider = registry.by_platform(wanted.platform)
        if provider.admit is not None:
            await provider.admit(registry.table(config, provider), wanted.device_token)
        registration = await self.service.components.devices.register(
            pubkey, wanted.platform, wanted.device_token, wanted.payload, wanted.relays,
            wanted.webpush_keys, config.limits.devices_per_npub, config.limits.accounts_per_device,
            device_key=wanted.device_key,
        )
        if wanted.auth_signer is not None:
            await self.service.components.delegated_auth.set_signer(pubkey, wanted.auth_signer)
        device = registration.device
        if not wanted.preferences.empty:
            device = await self.service.components.devices.set_preferences(
                pubkey, device.token, wanted.preferences
            ) or device
        log.info(
            "%s %s device …%s", "registered" if registration.created else "updated",
            device.platform, device.token_suffix,
        )
        return JSONResponse(
            {
                "npub": encode_npub(pubkey),
                "platform": device.platform,
                "payload": device.payload,
                "relays": list(device.relays),
                "token_suffix": device.token_suffix,
                "registered_at": device.registered_at,
                "sealed": device.device_key is not None,
                **_preferences(device, int(time.time())),
            },
            status_code=201 if registration.created else 200,
        )

    async def preferences(self, request: Request) -> Response:
        """POST /preferences: pause, follows-only, the private mute list, notification kinds
        and quiet hours of one pair.

        The pair is found before the preferences are parsed: a mute list of 1,000 npubs is
        the costliest body the API reads, and a key with no pair (free to make) must get its
        404 without making the instance decode it."""
        self._require_serving()
        self._limit_ip(request)
        raw = await self._json_body(request, MAX_MUTE_BODY_BYTES)
        pubkey = await self._authenticate(request, raw)
        body = parse_json_object(raw)
        token = parse_pair_token(body.get("device_token"))
        devices = self.service.components.devices
        stored = await self._own_pair(pubkey, token)
        now = int(time.time())
        change = parse_preferences(body, now)
        device = await devices.set_preferences(pubkey, stored, change)
        if device is None:  # unregistered meanwhile
            raise ApiError(404, "not_registered", "you have no registration with this device token")
        return JSONResponse(_preferences(device, now))

    async def _own_pair(self, pubkey: str, token: str) -> str:
        """The stored form of `token` among the caller's own pairs (as `_stored_forms` looks
        it up), or `404 not_registered`."""
        held = {device.token for device in await self.service.components.devices.of_pubkey(pubkey)}
        for stored in _stored_forms(token):
            if stored in held:
                return stored
        raise ApiError(404, "not_registered", "you have no registration with this device token")

    async def presence(self, request: Request) -> Response:
        """POST /presence: the app is in the foreground (no wakeups) for `seconds`; 0 ends it."""
        self._require_serving()
        self._limit_ip(request)
        raw = await self._json_body(request)
        pubkey = await self._authenticate(request, raw)
        body = parse_json_object(raw)
        token = parse_pair_token(body.get("device_token"))
        seconds = parse_presence_seconds(body.get("seconds"))
        until = int(time.time()) + seconds if seconds else None
        devices = self.service.components.devices
        for stored in _stored_forms(token):
            if await devices.set_presence(pubkey, stored, until):
                break
        else:
            raise ApiError(404, "not_registered", "you have no registration with this device token")
        return JSONResponse({"present_until": until})

    async def unregister(self, request: Request) -> Response:
        self._require_serving()
        self._limit_ip(request)
        raw = await self._json_body(request)
        pubkey = await self._authenticate(request, raw)
        token = parse_json_object(raw).get("device_token")
        if not isinstance(token, str) or not token:
            raise BadRequest("invalid_device_token", "'device_token' must be a non-empty string")
        removed = await self.service.components.devices.unregister(pubkey, token)
        if not removed:
            for stored in registry.stored_forms(token):
                removed = await self.service.components.devices.unregister(pubkey, stored)
                if removed:
                    break
        return JSONResponse({"removed": removed})

    async def registrations(self, request: Request) -> Response:
        self._require_serving()
        self._limit_ip(request)
        pubkey = await self._authenticate(request, await self._read_body(request))
        devices = await self.service.components.devices.of_pubkey(pubkey)
        delegated = self.service.components.delegated_auth
        now = int(time.time())
        signer_status = delegated.status(pubkey)
        return JSONResponse(
            {
                "devices": [
                    {
                        "platform": device.platform,
                        "payload": device.payload,
                        "token_suffix": device.token_suffix,
                        "registered_at": device.registered_at,
                        "sealed": device.device_key is not None,
                        "relays": list(device.relays),
                        "delegated_auth": signer_status == "active",
                        "auth_signer_status": signer_status,
                        "auth_signer_detail": delegated.detail(pubkey),
                        **_preferences(device, now),
                        "follows_known": bool(device.rules and device.rules.follows_known),
                        **_device_fields(device),
                    }
                    for device in devices
                ]
            }
        )

    async def health(self, request: Request) -> Response:
        """Public: the status, plus (without an admin listener) the operator's configured
        relays only: user-named relay URLs are other users' data and, listed with their
        state, would make /health a port scanner."""
        return self._health(detail=False)

    async def admin_health(self, request: Request) -> Response:
        return self._health(detail=True)

    def _health(self, detail: bool) -> Response:
        serving = self.service.state is State.SERVING
        body: dict[str, Any] = {"status": "ok" if serving else self.service.state.value}
        if detail or not self.admin_split:
            relays = self.service.relay_health() if serving else {}
            if not detail:
                # the bridge keys its report by relay_label (a URL may carry a key)
                configured = {relay_label(relay.url) for relay in self.service.config.relays}
                relays = {url: state for url, state in relays.items() if url in configured}
            body["relays"] = relays
            shards = self.service.shards() if serving else None
            if shards is not None:
                body.update(worker=self.service.worker_id, shards=shards)
        if not serving:
            body.update(error="unavailable", message=f"service is {self.service.state.value}")
        down = self.service.tasks_down() if serving else {}
        if down:
            body["status"] = "degraded"
            if detail or not self.admin_split:
                body.update(down=list(down), reasons=down)
        return JSONResponse(body, status_code=200 if serving and not down else 503)

    async def metrics(self, request: Request) -> Response:
        if self.admin_split:
            raise ApiError(404, "not_found", "metrics are served on the admin listener")
        return await self.admin_metrics(request)

    async def admin_metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.exposition), media_type=CONTENT_TYPE_LATEST)

    async def info(self, request: Request) -> Response:
        self._limit_ip(request)
        config = self.service.config
        return JSONResponse(
            {
                "name": "sigil-push",
                "version": __version__,
                "platforms": registry.platforms(config),
                "relays": [relay.url for relay in config.relays if relay.read],
                "pubkey": self.service.components.key.public_key_hex
                if self.service.state is State.SERVING
                else None,
                "dry_run": config.dry_run,
                **self._provider_info(),
            }
        )

    def _provider_info(self) -> dict[str, Any]:
        """The configured providers' extra fields (UnifiedPush: `vapid_public_key`), null
        until the service serves: their keys are loaded at start."""
        config = self.service.config
        serving = self.service.state is State.SERVING
        extras: dict[str, Any] = {}
        for provider in registry.PROVIDERS:
            table = registry.table(config, provider)
            if provider.info is not None and table is not None:
                extras.update(provider.info(table, config.resolve))
        return extras if serving else dict.fromkeys(extras)


def _stored_forms(token: str) -> tuple[str, ...]:
    """The token as given, then lowercased when it could be an APNs token (stored lowercase),
    as `unregister` looks a pair up."""
    if len(token) >= 64 and token != token.lower() and all(c in "0123456789abcdefABCDEF" for c in token):
        return (token, token.lower())
    return (token,)


def _preferences(device: Device, now: int) -> dict[str, Any]:
    """A pair's preferences as the API shows them (a pause already over shows as null)."""
    rules = device.rules
    if rules is None:
        return {"pause_until": None, "senders": "anyone", "muted_count": 0, "notify": ["dm"],
                "quiet": None}
    pause = rules.pause_until if rules.pause_until is not None and rules.pause_until > now else None
    quiet = rules.quiet
    return {
        "pause_until": pause, "senders": rules.senders, "muted_count": rules.muted_count,
        "notify": mask_classes(rules.notify),
        "quiet": None if quiet is None else {
            "from": QuietHours.clock(quiet.start), "to": QuietHours.clock(quiet.end),
            "tz": quiet.tz,
        },
    }


def _device_fields(device: Device) -> dict[str, Any]:
    """A device's provider-specific fields in `GET /registrations` (UnifiedPush: `encrypted`)."""
    if device.platform not in registry.PLATFORMS:  # a provider since removed from the registry
        return {}
    fields = registry.by_platform(device.platform).device_fields
    return fields(device) if fields is not None else {}


def _error_response(request: Request, exc: Exception) -> Response:
    """The one place where failures become HTTP answers."""
    if isinstance(exc, ApiError):
        status, code, message, headers = exc.status, exc.code, exc.message, exc.headers
    elif isinstance(exc, AuthError):
        code = {AuthMissing: "auth_missing", AuthExpired: "auth_expired"}.get(type(exc), "auth_invalid")
        status, message, headers = 401, exc.detail, {"WWW-Authenticate": "Nostr"}
    elif isinstance(exc, TooManyAccounts):
        status, code, message, headers = 409, "too_many_accounts", str(exc), {}
    elif isinstance(exc, TooManyDevices):
        status, code, message, headers = 409, "too_many_devices", str(exc), {}
    elif isinstance(exc, TargetTaken):
        status, code, headers = 400, "invalid_device_token", {}
        message = "a token cannot be both a registration's and an Iris subscription's target"
    elif isinstance(exc, STORE_UNAVAILABLE):
        log.warning("storage busy on %s %s: %s", request.method, request.url.path, exc)
        status, code, headers = 503, "unavailable", {"Retry-After": "1"}
        message = (
            "storage is unreachable; retry shortly" if isinstance(exc, StoreUnavailable)
            else "storage is busy; retry shortly"
        )
    elif isinstance(exc, HTTPException):
        status, headers = exc.status_code, dict(exc.headers or {})
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        message = str(exc.detail)
    else:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=withheld(exc))
        # Starlette answers a 500 from its outermost layer, outside CorsMiddleware: the header
        # is added here, or a browser app could not read why its call failed
        status, code, message, headers = 500, "internal", "internal error", {"Access-Control-Allow-Origin": "*"}
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers)


def create_admin_app(service: Service) -> Starlette:
    """The operator listener (`server.admin_listen`): metrics and per-relay health detail.

    It shares the public app's Service but not its lifespan, which the public app owns.
    """
    api = Api(service)
    return Starlette(
        routes=[
            Route("/health", api.admin_health, methods=["GET"]),
            Route("/metrics", api.admin_metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _error_response, Exception: _error_response},
    )


def create_app(service: Service) -> Starlette:
    api = Api(service)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    routes = [
        Route("/register", store_deadline(api.register), methods=["POST"]),
        Route("/unregister", store_deadline(api.unregister), methods=["DELETE"]),
        Route("/registrations", store_deadline(api.registrations), methods=["GET"]),
        Route("/preferences", store_deadline(api.preferences), methods=["POST"]),
        Route("/presence", store_deadline(api.presence), methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/info", api.info, methods=["GET"]),
    ]
    if service.config.iris.enabled:
        routes.extend(IrisRoutes(api).routes())
    return Starlette(
        routes=routes,
        # CORS outermost: a preflight is neither routed nor counted; every answer (errors too)
        # carries the allow-origin header
        middleware=[Middleware(CorsMiddleware), Middleware(MetricsMiddleware)],
        exception_handlers={
            ApiError: _error_response,
            AuthError: _error_response,
            TooManyDevices: _error_response,
            TooManyAccounts: _error_response,
            TargetTaken: _error_response,
            # each engine's "busy" error by name: a handler only for `Exception` answers
            # too, but then the server logs it as unhandled, with a traceback
            **dict.fromkeys(STORE_UNAVAILABLE, _error_response),
            HTTPException: _error_response,
            Exception: _error_response,
        },
        lifespan=lifespan,
    )
