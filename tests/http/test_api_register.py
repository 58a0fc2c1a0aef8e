"""Registration, listing and removal of devices through the real HTTP API."""

from __future__ import annotations

import base64
import secrets

import pytest

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth
from testkit.fakes.credentials import WebPushSubscriber
from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller


def ios_token() -> str:
    return secrets.token_hex(32)


def test_register_creates_then_updates(api: ApiCaller) -> None:
    """A new token answers 201, the same token again 200, and the body echoes the registration."""
    user, token = SdkUser(), ios_token()
    first = api.register(user, device_token=token, payload="event_id")
    assert first.status_code == 201, first.text
    assert first.json()["npub"] == user.npub
    assert first.json()["platform"] == "ios"
    assert first.json()["payload"] == "event_id"
    again = api.register(user, device_token=token)
    assert again.status_code == 200
    assert again.json()["payload"] == "opaque"


def test_hex_npub_is_accepted_and_echoed_as_bech32(api: ApiCaller) -> None:
    user = SdkUser()
    response = api.register(user, npub=user.hex, device_token=ios_token())
    assert response.status_code == 201
    assert response.json()["npub"] == user.npub


def test_registrations_lists_only_own_devices_with_suffixes(api: ApiCaller) -> None:
    """GET /registrations shows the caller's devices and never a whole token."""
    user, other = SdkUser(), SdkUser()
    token = ios_token()
    api.register(user, device_token=token)
    api.register(user, platform="android", device_token="fcm-token_" + secrets.token_urlsafe(40))
    api.register(other, device_token=ios_token())
    listing = api.call("GET", "/registrations", user)
    assert listing.status_code == 200
    devices = listing.json()["devices"]
    assert sorted(d["platform"] for d in devices) == ["android", "ios"]
    ios = next(d for d in devices if d["platform"] == "ios")
    assert ios["token_suffix"] == token[-6:]
    assert isinstance(ios["registered_at"], int)
    assert token not in listing.text


def test_service_log_never_holds_tokens_or_keys(api: ApiCaller, service: ServiceProcess) -> None:
    """Even at DEBUG, the log carries token suffixes only, and no npub or pubkey."""
    user, token = SdkUser(), ios_token()
    assert api.register(user, device_token=token).status_code == 201
    api.call("DELETE", "/unregister", user, {"device_token": token})
    log = service.log()
    assert token[-6:] in log
    for secret in (token, user.hex, user.npub):
        assert secret not in log


def test_unregister_removes_only_the_owners_token(api: ApiCaller) -> None:
    owner, stranger, token = SdkUser(), SdkUser(), ios_token()
    api.register(owner, device_token=token)
    refused = api.call("DELETE", "/unregister", stranger, {"device_token": token})
    assert refused.status_code == 200 and refused.json() == {"removed": 0}
    removed = api.call("DELETE", "/unregister", owner, {"device_token": token})
    assert removed.json() == {"removed": 1}
    assert api.call("GET", "/registrations", owner).json()["devices"] == []


def test_an_apns_token_is_found_whatever_its_case(api: ApiCaller) -> None:
    """APNs tokens are stored as their provider keeps them (lowercase): one registered in upper
    case is listed lowercase and removed by the app sending it in either case."""
    user, token = SdkUser(), ios_token()
    registered = api.register(user, device_token=token.upper())
    assert registered.status_code == 201 and registered.json()["token_suffix"] == token[-6:]
    removed = api.call("DELETE", "/unregister", user, {"device_token": token.upper()})
    assert removed.json() == {"removed": 1}
    mixed = token[:32].upper() + token[32:]
    assert api.register(user, device_token=mixed).status_code == 201
    assert api.call("DELETE", "/unregister", user, {"device_token": mixed}).json() == {"removed": 1}
    listed = api.call("GET", "/registrations", user)
    assert listed.json().get("devices") == [], listed.text


def test_token_registered_by_another_npub_is_a_second_account(api: ApiCaller) -> None:
    """Two accounts on one phone: each npub registers the token with its own NIP-98 and each
    keeps its own registration (the token never moves away from the first)."""
    first, second, token = SdkUser(), SdkUser(), ios_token()
    assert api.register(first, device_token=token).status_code == 201
    assert api.register(second, device_token=token, payload="event_id").status_code == 201
    assert api.register(second, device_token=token).status_code == 200
    for user in (first, second):
        [device] = api.call("GET", "/registrations", user).json()["devices"]
        assert device["token_suffix"] == token[-6:] and device["payload"] == "opaque"


def test_tokens_from_our_own_signer_are_accepted_too(api: ApiCaller) -> None:
    """The Python helper clients may use produces tokens the server accepts."""
    key = SecretKey.generate()
    body = (
        f'{{"npub": "{key.public_key_hex}", "platform": "ios", "device_token": "{ios_token()}"}}'
    ).encode()
    response = api.http.post(
        "/register",
        content=body,
        headers={
            "content-type": "application/json",
            "authorization": make_http_auth(key, api.public_url + "/register", "POST", body),
        },
    )
    assert response.status_code == 201, response.text


def test_user_relays_are_normalised_and_stored(api: ApiCaller) -> None:
    user = SdkUser()
    response = api.register(
        user, device_token=ios_token(), relays=["wss://inbox.example/", "wss://inbox.example"]
    )
    assert response.status_code == 201
    assert response.json()["relays"] == ["wss://inbox.example"]
    assert api.call("GET", "/registrations", user).json()["devices"][0]["relays"] == [
        "wss://inbox.example"
    ]


def test_unifiedpush_webpush_keys_accepted(api: ApiCaller) -> None:
    user = SdkUser()
    subscriber = WebPushSubscriber.generate()
    response = api.register(
        user,
        platform="unifiedpush",
        device_token="https://93.184.216.34/push/abc",
        keys={"p256dh": subscriber.p256dh, "auth": subscriber.auth},
    )
    assert response.status_code == 201, response.text
    [device] = api.call("GET", "/registrations", user).json()["devices"]
    assert device["encrypted"] is True


def _base64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        # base64url of the right form, but no key an RFC 8291 encryption can use: each of
        # these once got a 201 and then never a push (fixed bytes: xdist's workers must collect
        # the same ids)
        ("p256dh", _base64url(bytes(range(32)))),
        ("p256dh", _base64url(b"\x04" + bytes(64))),
        ("p256dh", _base64url(b"\x02" + bytes(range(64)))),
        ("auth", _base64url(bytes(range(12)))),
        ("auth", _base64url(bytes(range(32)))),
        ("auth", "A"),
    ],
    ids=["p256dh-short", "p256dh-off-curve", "p256dh-not-uncompressed", "auth-12-bytes",
         "auth-32-bytes", "auth-no-whole-byte"],
)
def test_unifiedpush_keys_that_no_push_could_use_are_refused(
    api: ApiCaller, field: str, bad: str
) -> None:
    """A registration with WebPush keys that RFC 8291 cannot encrypt to gets a clear 400 and
    stores nothing, rather than a registration whose every push fails."""
    user = SdkUser()
    subscriber = WebPushSubscriber.generate()
    keys = {"p256dh": subscriber.p256dh, "auth": subscriber.auth, field: bad}
    response = api.register(
        user, platform="unifiedpush", device_token="https://93.184.216.34/push/k", keys=keys
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_device_token"
    assert field in response.json()["message"]
    assert api.call("GET", "/registrations", user).json()["devices"] == []


def test_unifiedpush_without_keys_is_listed_as_not_encrypted(api: ApiCaller) -> None:
    """Older distributors get plain bodies; the listing says so, and only UnifiedPush
    devices carry the flag."""
    user = SdkUser()
    api.register(user, device_token=ios_token())
    response = api.register(user, platform="unifiedpush", device_token="https://93.184.216.34/push/plain")
    assert response.status_code == 201, response.text
    devices = {d["platform"]: d for d in api.call("GET", "/registrations", user).json()["devices"]}
    assert devices["unifiedpush"]["encrypted"] is False
    assert "encrypted" not in devices["ios"]
