"""The Iris-compatible routes (CONTRACT 3b): nostr-notification-server's API on our listener.

Iris joins its configured server URL and `subscriptions/` by plain concatenation, so both
`/subscriptions` and `/subscriptions/` are routes (a redirect would cost a preflight and break
the NIP-98 `u` tag). Its NIP-98 has no `payload` tag, so these routes verify leniently
(sigil_push/nostr/nip98.py), and its auth events are spent per request like every other
(sigil_push/store/auth_ids.py). Handlers check shape and size first (http/iris_subscription.py),
then where the targets lead (DNS, as UnifiedPush registrations), then write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sigil_push.errors import ApiError, BadRequest
from sigil_push.http.deadline import store_deadline
from sigil_push.http.iris_subscription import (
    APNS,
    FCM,
    MAX_BODY_BYTES,
    MAX_SUBSCRIPTIONS_PER_PUBKEY,
    Accepted,
    Subscription,
    check_subscription_id,
    parse_subscription,
)
from sigil_push.http.validation import parse_json_object
from sigil_push.iris.payload import WEBHOOK, WEBPUSH
from sigil_push.push import registry
from sigil_push.push.endpoint_guard import UnsafeEndpoint, check_endpoint
from sigil_push.service import Service
from sigil_push.store.errors import NotYours, TooManySubscriptions
from sigil_push.store.interface import IrisSubscriptionStore, IrisTarget, StoredSubscription

log = logging.getLogger(__name__)

ENDPOINT_CHECK_SECONDS = 3.0
"""How long a target's host may take to resolve before the subscription is refused."""
_PLATFORM_OF_PROVIDER = {"unifiedpush": WEBPUSH, "ios": APNS, "android": FCM}


class ApiEdge(Protocol):
    """What these routes use of the API's plumbing (sigil_push/api.py's `Api`)."""

    service: Service

    def _require_serving(self) -> None: ...

    def _limit_ip(self, request: Request) -> None: ...

    async def _read_body(self, request: Request, most: int = ...) -> bytes: ...

    async def _authenticate(self, request: Request, body: bytes, lenient: bool = ...) -> str: ...


def _not_found() -> ApiError:
    return ApiError(404, "not_found", "no subscription with this id is yours")


_CREATED_IDS = uuid.UUID("5b0e7f64-4c1e-4d0b-9a53-2f6c1f0e9a11")
"""The namespace of `_created_id`'s UUIDs (any fixed one: they only need to differ by header)."""


def _created_id(request: Request) -> str:
    """A new subscription's id, from its request's `Authorization` header (a UUID, as NNS
    makes). The very same auth event is accepted again only for the very same request (an
    idempotent retry, CONTRACT 3): such a retry then replaces the subscription it created
    with the same document, under the same id, instead of making a duplicate. Two requests
    signed apart differ in their signatures (BIP-340 draws fresh randomness), so in their ids,
    even within one second, as Iris's two syncs are."""
    header = request.headers.get("authorization", "")
    return str(uuid.uuid5(_CREATED_IDS, header))


def _existing_id(request: Request) -> str:
    """The path's subscription id for a GET or DELETE: one that no subscription could have
    (over 64 characters, or not URL-safe) is simply not the caller's (`404`, as the contract
    says), not a malformed request."""
    try:
        return check_subscription_id(request.path_params["id"])
    except BadRequest:
        raise _not_found() from None


def _shown(stored: StoredSubscription) -> dict[str, Any]:
    """The document as stored, plus its `subscriber` (Iris copies it into its updates)."""
    document: dict[str, Any] = json.loads(stored.document)
    return {**document, "subscriber": stored.pubkey}


class IrisRoutes:
    """The handlers, bound to the API's plumbing (auth, limits, bodies) and its store. The
    store tells its listeners of every write (the bridges' watches follow, on every worker)."""

    def __init__(self, api: ApiEdge) -> None:
        self._api = api

    @property
    def _store(self) -> IrisSubscriptionStore:
        return self._api.service.components.iris

    def _accepted(self) -> Accepted:
        config = self._api.service.config
        unifiedpush = config.providers.get("unifiedpush")
        webhooks = config.webhooks
        return Accepted(
            platforms=frozenset(_PLATFORM_OF_PROVIDER[p] for p in registry.platforms(config)),
            webhooks=config.webhooks_enabled,
            private_push=bool(unifiedpush and unifiedpush.allow_private_endpoints),
            private_webhooks=bool(webhooks and webhooks.allow_private_endpoints),
        )

    async def _caller(self, request: Request, body: bytes = b"") -> str:
        self._api._require_serving()
        self._api._limit_ip(request)
        return await self._api._authenticate(request, body, lenient=True)

    async def _subscription(self, request: Request) -> tuple[str, Subscription]:
        """The caller and the subscription in the body, its targets' hosts checked."""
        self._api._require_serving()
        self._api._limit_ip(request)
        raw = await self._api._read_body(request, MAX_BODY_BYTES)
        pubkey = await self._api._authenticate(request, raw, lenient=True)
        accepted = self._accepted()
        subscription = parse_subscription(parse_json_object(raw), accepted)
        await self._check_hosts(subscription, accepted)
        return pubkey, subscription

    async def _check_hosts(self, subscription: Subscription, accepted: Accepted) -> None:
        """Every endpoint and webhook resolves to public addresses only (SSRF), in parallel."""
        checks = [
            check_endpoint(
                target.token,
                accepted.private_webhooks if target.platform == WEBHOOK else accepted.private_push,
            )
            for target in subscription.targets if target.platform in (WEBPUSH, WEBHOOK)
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*checks), ENDPOINT_CHECK_SECONDS)
        except TimeoutError:
            raise BadRequest("invalid_device_token", "a target's host did not resolve in time") from None
        except UnsafeEndpoint as exc:
            raise BadRequest("invalid_device_token", str(exc)) from None

    async def _put(self, subscription_id: str, pubkey: str, subscription: Subscription) -> bool:
        targets = [
            IrisTarget(
                t.platform, t.token, t.keys.p256dh if t.keys else None,
                t.keys.auth if t.keys else None,
            )
            for t in subscription.targets
        ]
        document = json.dumps(subscription.document, separators=(",", ":"), ensure_ascii=False)
        try:
            created = await self._store.put(
                subscription_id, pubkey, document, targets, MAX_SUBSCRIPTIONS_PER_PUBKEY
            )
        except NotYours:
            raise _not_found() from None
        except TooManySubscriptions as exc:
            raise BadRequest("invalid_filter", str(exc)) from None
        return created

    # -- routes ----------------------------------------------------------------------------

    async def list_all(self, request: Request) -> Response:
        pubkey = await self._caller(request, await self._api._read_body(request))
        stored = await self._store.of_pubkey(pubkey)
        return JSONResponse({s.id: _shown(s) for s in stored})

    async def create(self, request: Request) -> Response:
        pubkey, subscription = await self._subscription(request)
        subscription_id = _created_id(request)
        await self._put(subscription_id, pubkey, subscription)
        log.info("Iris subscription created (%d targets)", len(subscription.targets))
        return JSONResponse({"id": subscription_id, "status": "Created"}, status_code=201)

    async def get(self, request: Request) -> Response:
        pubkey = await self._caller(request, await self._api._read_body(request))
        stored = await self._store.get(_existing_id(request))
        if stored is None or stored.pubkey != pubkey:
            raise _not_found()
        return JSONResponse(_shown(stored))

    async def update(self, request: Request) -> Response:
        subscription_id = check_subscription_id(request.path_params["id"])
        pubkey, subscription = await self._subscription(request)
        await self._put(subscription_id, pubkey, subscription)
        return JSONResponse({"status": "Updated"})

    async def delete(self, request: Request) -> Response:
        pubkey = await self._caller(request, await self._api._read_body(request))
        if not await self._store.delete(_existing_id(request), pubkey):
            raise _not_found()
        return Response(status_code=204)

    def routes(self) -> list[Route]:
        """Every route reads or writes the store: each answers 503 within 10 s, as the API's."""
        return [
            Route("/subscriptions", store_deadline(self.list_all), methods=["GET"]),
            Route("/subscriptions/", store_deadline(self.list_all), methods=["GET"]),
            Route("/subscriptions", store_deadline(self.create), methods=["POST"]),
            Route("/subscriptions/", store_deadline(self.create), methods=["POST"]),
            Route("/subscriptions/{id}", store_deadline(self.get), methods=["GET"]),
            Route("/subscriptions/{id}", store_deadline(self.update), methods=["POST"]),
            Route("/subscriptions/{id}", store_deadline(self.delete), methods=["DELETE"]),
        ]
