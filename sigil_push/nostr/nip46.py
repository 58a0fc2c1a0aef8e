"""NIP-46 remote signing, restricted to what the bridge may ever ask: kind 22242 AUTH events.

Requests and responses are kind 24133 events whose content is NIP-44 encrypted JSON-RPC
between a client key (ours, one per user session) and the remote signer's key. This module
builds and reads those messages and refuses to build a signing request for any other kind,
so no code path can ask a user's signer for a note, a DM or a zap.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import nostr_sdk

from sigil_push.nostr.event import Event, InvalidEvent, sign_event
from sigil_push.nostr.keys import SecretKey, is_public_key
from sigil_push.nostr.kinds import CLIENT_AUTH, NOSTR_CONNECT

PERMISSIONS = f"sign_event:{CLIENT_AUTH}"
ALLOWED_METHODS = frozenset({"connect", "get_public_key", "sign_event"})
MAX_SIGNER_RELAYS = 5
MAX_SECRET_LENGTH = 256


class InvalidBunkerUri(ValueError):
    """A `bunker://` URI that cannot be used."""


class ForbiddenRequest(ValueError):
    """The bridge tried to ask the signer for something other than an AUTH signature."""


class SignerError(Exception):
    """The signer answered with an error (refusal, unknown method, bad request)."""


@dataclass(frozen=True, slots=True)
class BunkerUri:
    signer_pubkey: str
    relays: tuple[str, ...]
    secret: str | None

    @classmethod
    def parse(cls, uri: str, allow_insecure_relays: bool) -> BunkerUri:
        parts = urlsplit(uri)
        if parts.scheme != "bunker":
            raise InvalidBunkerUri("must be a bunker:// URI")
        signer = parts.netloc.lower()
        if not is_public_key(signer):
            # hex that is no point on the curve cannot be encrypted to: refused here, not
            # left to fail inside the session's task
            raise InvalidBunkerUri("the remote signer's key must be a public key (64 hex characters)")
        query = parse_qs(parts.query)
        schemes = ("wss://", "ws://") if allow_insecure_relays else ("wss://",)
        relays = tuple(dict.fromkeys(query.get("relay", [])))
        if not relays or len(relays) > MAX_SIGNER_RELAYS:
            raise InvalidBunkerUri(f"must name 1 to {MAX_SIGNER_RELAYS} relays")
        for relay in relays:
            relay_parts = urlsplit(relay)
            if not relay.startswith(schemes) or not relay_parts.hostname:
                raise InvalidBunkerUri(f"relays must be {' or '.join(schemes)} URLs")
        secrets = query.get("secret", [])
        if len(secrets) > 1 or (secrets and len(secrets[0]) > MAX_SECRET_LENGTH):
            raise InvalidBunkerUri("at most one secret of at most 256 characters")
        return cls(signer, relays, secrets[0] if secrets else None)


def _sdk_keys(secret: SecretKey, public_hex: str) -> tuple[nostr_sdk.SecretKey, nostr_sdk.PublicKey]:
    return nostr_sdk.SecretKey.parse(secret.secret_hex), nostr_sdk.PublicKey.parse(public_hex)


def _request(client: SecretKey, signer_pubkey: str, method: str, params: list[str]) -> tuple[str, Event]:
    if method not in ALLOWED_METHODS:
        raise ForbiddenRequest(f"the bridge never asks a signer to {method}")
    request_id = os.urandom(16).hex()
    plaintext = json.dumps({"id": request_id, "method": method, "params": params})
    secret, public = _sdk_keys(client, signer_pubkey)
    content = nostr_sdk.nip44_encrypt(secret, public, plaintext, nostr_sdk.Nip44Version.V2)
    return request_id, sign_event(client, NOSTR_CONNECT, content, [["p", signer_pubkey]])


def connect_request(client: SecretKey, bunker: BunkerUri) -> tuple[str, Event]:
    """`connect`, asking only for permission to sign AUTH events."""
    return _request(
        client, bunker.signer_pubkey, "connect",
        [bunker.signer_pubkey, bunker.secret or "", PERMISSIONS],
    )


def get_public_key_request(client: SecretKey, signer_pubkey: str) -> tuple[str, Event]:
    return _request(client, signer_pubkey, "get_public_key", [])


def sign_auth_request(
    client: SecretKey, signer_pubkey: str, relay_url: str, challenge: str, created_at: int
) -> tuple[str, Event]:
    """The only signing request that exists: a NIP-42 AUTH event for `relay_url`."""
    template = {
        "kind": CLIENT_AUTH,
        "content": "",
        "tags": [["relay", relay_url], ["challenge", challenge]],
        "created_at": created_at,
    }
    return _request(client, signer_pubkey, "sign_event", [json.dumps(template)])


@dataclass(frozen=True, slots=True)
class Response:
    request_id: str
    result: str | None
    error: str | None


def read_response(client: SecretKey, event: Event) -> Response:
    """Decrypt a kind 24133 answer addressed to `client`; raises SignerError if unreadable."""
    if event.kind != NOSTR_CONNECT:
        raise SignerError("not a NIP-46 message")
    secret, public = _sdk_keys(client, event.pubkey)
    try:
        payload: Any = json.loads(nostr_sdk.nip44_decrypt(secret, public, event.content))
    except Exception as exc:
        raise SignerError("undecryptable NIP-46 message") from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("id"), str):
        raise SignerError("malformed NIP-46 response")
    result, error = payload.get("result"), payload.get("error")
    return Response(
        payload["id"],
        result if isinstance(result, str) else None,
        error if isinstance(error, str) and error else None,
    )


def signed_auth_event(result: str, user_pubkey: str, relay_url: str, challenge: str) -> Event:
    """Check that the signer returned exactly the AUTH event asked for, signed by the user."""
    try:
        event = Event.from_json(json.loads(result))
        event.verify()
    except (ValueError, RecursionError, InvalidEvent) as exc:  # RecursionError: deep nesting
        raise SignerError("signer returned an invalid event") from exc
    if (
        event.kind != CLIENT_AUTH
        or event.pubkey != user_pubkey
        or event.first_tag("relay") != relay_url
        or event.first_tag("challenge") != challenge
    ):
        raise SignerError("signer returned a different event than the AUTH asked for")
    return event
