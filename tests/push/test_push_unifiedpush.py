"""UnifiedPush delivery per AND_3 (RFC 8030 POST, RFC 8291 encryption, RFC 8292 VAPID) and its
SSRF guard."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import re
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sigil_push import cli, outbound
from sigil_push.config import Config, ConfigError, parse_config
from sigil_push.errors import BadRequest
from sigil_push.identity import KeyFileError, create_private_file
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.observations import now_ms
from sigil_push.push import registry, unifiedpush
from sigil_push.push.endpoint_guard import (
    UnsafeEndpoint,
    check_endpoint,
    is_public_address,
    parse_endpoint,
)
from sigil_push.push.registry import TABLES
from sigil_push.push.vapid import (
    VapidSigner,
    load_or_create_key,
    loaded_public_key,
    origin,
    public_key_b64,
)
from sigil_push.store.records import WebPushKeys
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.harness import (
    RELAY,
    VAPID_SUBJECT,
    eventually,
    toml_tables,
)
from testkit.service import ServiceProcess
from testkit.stores import Engine, opened
from tests.adversarial.fake_dns import FakeDns


async def test_without_keys_the_body_is_the_plain_json_wakeup(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    device = await harness.register("unifiedpush", fake_up.endpoint("plain"))
    await harness.enqueue([device])

    request = (await eventually(lambda: fake_up.received("plain")))[0]
    assert json.loads(request.body) == {"type": "wakeup"}
    assert request.headers["content-type"] == "application/json"
    assert 3500 < int(request.headers["ttl"]) <= 3600
    assert request.headers["topic"] == "wakeup"
    await eventually(harness.drained)
    assert [r["status"] for r in await eventually(harness.push_records)] == ["accepted"]


async def test_with_webpush_keys_the_body_is_rfc8291_encrypted(make_harness, fake_up: FakeUnifiedPush) -> None:
    """Only the holder of the subscription's private key can read the wakeup."""
    harness = await make_harness()
    subscriber = WebPushSubscriber.generate()
    device = await harness.register(
        "unifiedpush", fake_up.endpoint("encrypted"), payload="event_id",
        keys=WebPushKeys(subscriber.p256dh, subscriber.auth),
    )
    event = await harness.enqueue([device])

    request = (await eventually(lambda: fake_up.received("encrypted")))[0]
    assert request.headers["content-encoding"] == "aes128gcm"
    assert event.id.encode() not in request.body
    assert json.loads(subscriber.decrypt(request.body)) == {
        "type": "wakeup", "event_id": event.id, "relay": "wss://relay.example.com"
    }


@pytest.mark.parametrize("status", [404, 410])
async def test_a_gone_endpoint_is_pruned(make_harness, fake_up: FakeUnifiedPush, status: int) -> None:
    harness = await make_harness()
    name = f"gone-{status}"
    fake_up.script.answers[name] = (status, None)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint(name))])

    await eventually(harness.forgotten, what="device forgotten")
    assert [r["status"] for r in await eventually(harness.push_records)] == ["unregistered"]


async def test_too_large_is_rejected_and_keeps_the_device(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    fake_up.script.answers["large"] = (413, None)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("large"))])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    await eventually(harness.drained)
    assert await harness.devices.count() == 1


async def test_slow_down_honours_retry_after(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    fake_up.script.answers["slow"] = (429, "20")
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("slow"))])

    await eventually(lambda: harness.push_records())
    answered = harness.push_records()[0]["ts"]
    rows = await eventually(lambda: _released(harness))
    assert rows[0][4] >= answered + 20_000 - 100
    assert len(fake_up.received("slow")) == 1


async def _released(harness):
    rows = await harness.outbox_rows()
    return rows if rows and rows[0][5] is None else None


async def test_server_errors_are_retried(make_harness, fake_up: FakeUnifiedPush) -> None:
    harness = await make_harness()
    fake_up.script.answers["flaky"] = (500, None)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("flaky"))])

    await eventually(lambda: len(fake_up.received("flaky")) >= 2, what="retries")
    del fake_up.script.answers["flaky"]
    await eventually(harness.drained)
    await eventually(lambda: [r["status"] for r in harness.push_records()][-1:] == ["accepted"])


async def test_redirects_are_not_followed(make_harness, fake_up: FakeUnifiedPush) -> None:
    """A distributor answering 307 elsewhere gets no second request: the push is rejected."""
    harness = await make_harness()
    fake_up.script.redirects["bouncer"] = "inside"
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("bouncer"))])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    assert fake_up.received("inside") == []


def _private_hostname() -> str:
    """This machine's name: an ordinary DNS name (no `localhost` suffix) that resolves to a
    loopback or private address, as a rebinding attacker's name would."""
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, 443)}
    except OSError:
        pytest.skip("the host name does not resolve here")
    if any(is_public_address(ipaddress.ip_address(a)) for a in addresses):
        pytest.skip("the host name resolves to a public address here")
    return name


async def test_send_time_check_refuses_names_resolving_to_private_addresses(
    make_harness, fake_up: FakeUnifiedPush
) -> None:
    """A registration whose name resolves (now) to a private address is refused at send time,
    at connection time inside the HTTP client, so nothing reaches the fake."""
    harness = await make_harness(providers={"unifiedpush": {"vapid_subject": "mailto:ops@example.org"}})
    port = fake_up.endpoint("x").split(":")[2].split("/")[0]
    device = await harness.register("unifiedpush", f"https://{_private_hostname()}:{port}/up/rebound")
    await harness.enqueue([device])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    assert fake_up.received("rebound") == []


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/up", "https://10.1.2.3/up", "https://169.254.169.254/latest",
    "https://100.64.0.1/", "https://0.0.0.0/", "https://224.0.0.1/",
    "https://[::1]/up", "https://[::ffff:127.0.0.1]/up", "https://[::ffff:10.0.0.1]/up",
    "https://[fe80::1%25eth0]/up", "https://[fc00::1]/up", "https://[2002:7f00:1::]/up",
    "https://[64:ff9b::a00:1]/up", "https://[::]/up", "https://[ff02::1]/up",
    "https://localhost/up", "https://LOCALHOST./up", "https://push.localhost/up",
    "https://printer.local/up", "http://push.example.com/up", "ftp://push.example.com/up",
    "https://user:pass@push.example.com/up", "not a url", "https:///up",
])
def test_unsafe_endpoints_are_refused_without_dns(url: str) -> None:
    with pytest.raises(UnsafeEndpoint):
        parse_endpoint(url, allow_private=False)


@pytest.mark.parametrize("url", ["https://127.1/up", "https://2130706433/up", "https://0x7f000001/up"])
def test_ipv4_shorthands_are_refused_as_the_addresses_they_are(url: str) -> None:
    """Not IP literals to a URL parser, but clients connect to them as 127.0.0.1."""
    with pytest.raises(UnsafeEndpoint):
        parse_endpoint(url, allow_private=False)


async def test_dns_names_resolving_to_private_addresses_are_refused() -> None:
    with pytest.raises(UnsafeEndpoint):
        await check_endpoint(f"https://{_private_hostname()}/up", allow_private=False)


@pytest.mark.parametrize("url", ["https://8.8.8.8/up", "https://[2606:4700:4700::1111]/up"])
async def test_public_addresses_pass(url: str) -> None:
    await check_endpoint(url, allow_private=False)


def test_tests_may_allow_private_http_endpoints() -> None:
    assert parse_endpoint("http://127.0.0.1:8080/up", allow_private=True) == ("127.0.0.1", 8080)


# --- AND_3: VAPID, TTL, the 4,096-byte limit, against a distributor with autopush's rules ---


@pytest.fixture
def autopush(fake_up: FakeUnifiedPush) -> Iterator[FakeUnifiedPush]:
    """The fake distributor checking VAPID as autopush does, for this test only."""
    fake_up.script.require_vapid = True
    fake_up.script.restricted.clear()
    yield fake_up
    fake_up.script.require_vapid = False
    fake_up.script.restricted.clear()


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _public_key_of(key_file: Path) -> str:
    """The base64url uncompressed point of the PEM key in `key_file`, read with cryptography."""
    private = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    return _b64url(private.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    ))


def vapid_claims(authorization: str, public_key: str, audience: str) -> dict[str, Any]:
    """Check an RFC 8292 header against `public_key` with PyJWT; returns the JWT claims."""
    scheme, _, rest = authorization.partition(" ")
    assert scheme == "vapid"
    parts = dict(item.strip().split("=", 1) for item in rest.split(","))
    assert parts["k"] == public_key
    point = base64.urlsafe_b64decode(public_key + "=" * (-len(public_key) % 4))
    verifying_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    return dict(jwt.decode(
        parts["t"], verifying_key, algorithms=["ES256"], audience=audience,
        options={"require": ["aud", "exp", "sub"]},
    ))


def _check_claims(claims: dict[str, Any], audience: str) -> None:
    now = time.time()
    assert claims["aud"] == audience
    assert claims["sub"] == VAPID_SUBJECT
    assert now < claims["exp"] <= now + 24 * 3600


async def test_every_post_is_vapid_signed_for_the_endpoint_origin(
    make_harness, autopush: FakeUnifiedPush
) -> None:
    """Encrypted or not, each POST carries a JWT for the distributor's origin, signed with the
    key in vapid.pem, and an endpoint bound to that key (an AND_3 app that gave its
    distributor our key) accepts it."""
    harness = await make_harness()
    our_key = _public_key_of(harness.folder / "vapid.pem")
    autopush.script.restricted["bound"] = our_key
    subscriber = WebPushSubscriber.generate()
    plain = await harness.register("unifiedpush", autopush.endpoint("unbound"))
    bound = await harness.register(
        "unifiedpush", autopush.endpoint("bound"), keys=WebPushKeys(subscriber.p256dh, subscriber.auth)
    )
    await harness.enqueue([plain, bound])

    await eventually(lambda: autopush.received("unbound") and autopush.received("bound"))
    for name in ("unbound", "bound"):
        request = autopush.received(name)[0]
        assert request.status == 201
        _check_claims(vapid_claims(request.headers["authorization"], our_key, autopush.origin),
                      autopush.origin)
    await eventually(lambda: len(harness.push_records()) == 2, what="both outcomes recorded")
    assert [r["status"] for r in harness.push_records()] == ["accepted"] * 2


async def test_an_opaque_wakeup_decrypts_to_the_wakeup_alone(make_harness, autopush: FakeUnifiedPush) -> None:
    """RFC 8291 body, TTL, Urgency and Topic; nothing in body or headers names the message,
    its sender or its recipient."""
    harness = await make_harness()
    subscriber = WebPushSubscriber.generate()
    device = await harness.register(
        "unifiedpush", autopush.endpoint("opaque"), keys=WebPushKeys(subscriber.p256dh, subscriber.auth)
    )
    event = await harness.enqueue([device])

    request = (await eventually(lambda: autopush.received("opaque")))[0]
    assert request.status == 201
    assert json.loads(subscriber.decrypt(request.body)) == {"type": "wakeup"}
    assert request.headers["content-encoding"] == "aes128gcm"
    assert request.headers["urgency"] == "high"
    assert request.headers["topic"] == "wakeup"
    assert 0 < int(request.headers["ttl"]) <= 3600
    wire = json.dumps(request.headers) + request.body.hex()
    claims = vapid_claims(request.headers["authorization"], _public_key_of(harness.folder / "vapid.pem"),
                          autopush.origin)
    secrets = [event.content, event.id, harness.sender_key.public_key_hex,
               harness.recipient_key.public_key_hex, encode_npub(harness.recipient_key.public_key_hex),
               encode_npub(harness.sender_key.public_key_hex)]
    for secret in secrets:
        assert secret not in wire and secret not in json.dumps(claims)


def _wakeup_plaintext(event_json: str) -> int:
    """Bytes of the `event` wakeup before encryption, computed here rather than by the service."""
    return len(json.dumps({"type": "wakeup", "event": event_json}, separators=(",", ":"),
                          ensure_ascii=False).encode())


def _event_of_plaintext_size(harness, size: int):
    """A signed kind 1059 event whose `event` wakeup is exactly `size` bytes of cleartext."""
    def build(length: int):
        event = harness.event("a" * length, kind=1059)
        return event, _wakeup_plaintext(json.dumps(event.to_json(), separators=(",", ":"), ensure_ascii=False))

    _, measured = build(100)
    event, exact = build(100 + size - measured)
    assert exact == size
    return event


async def test_the_encrypted_body_stays_within_4096_bytes(make_harness, autopush: FakeUnifiedPush) -> None:
    """AND_3 allows 4,096 encrypted bytes (3,993 of cleartext): an `event` wakeup of exactly
    that size goes out whole, one byte more falls back to `event_id`, and the distributor
    (which answers 413 above 4,096) accepts both."""
    harness = await make_harness()
    subscriber = WebPushSubscriber.generate()
    device = await harness.register(
        "unifiedpush", autopush.endpoint("limit"), payload="event",
        keys=WebPushKeys(subscriber.p256dh, subscriber.auth),
    )
    fitting = _event_of_plaintext_size(harness, 3993)
    await harness.enqueue([device], fitting)
    first = (await eventually(lambda: autopush.received("limit")))[0]
    oversize = _event_of_plaintext_size(harness, 3994)
    await harness.enqueue([device], oversize)
    second = (await eventually(lambda: autopush.received("limit")[1:]))[0]

    assert (first.status, len(first.body)) == (201, 4096)
    assert json.loads(json.loads(subscriber.decrypt(first.body))["event"]) == fitting.to_json()
    assert second.status == 201 and len(second.body) < 4096
    assert json.loads(subscriber.decrypt(second.body)) == {
        "type": "wakeup", "event_id": oversize.id, "relay": RELAY
    }


async def test_a_distributor_refusing_our_vapid_rejects_and_keeps_the_device(
    make_harness, autopush: FakeUnifiedPush
) -> None:
    """An endpoint bound to another server's key answers 401: the push is rejected, not retried,
    and the registration stays (the fault may be ours, e.g. a replaced vapid.pem)."""
    harness = await make_harness()
    other = WebPushSubscriber.generate()  # any P-256 key stands for another server's
    autopush.script.restricted["foreign"] = other.p256dh
    await harness.enqueue([await harness.register("unifiedpush", autopush.endpoint("foreign"))])

    assert [r["status"] for r in await eventually(harness.push_records)] == ["rejected"]
    await eventually(harness.drained)
    assert [r.status for r in autopush.received("foreign")] == [401]
    assert await harness.devices.count() == 1


def test_the_fake_distributor_enforces_autopush_rules(autopush: FakeUnifiedPush, tmp_path: Path) -> None:
    """The checks the tests above rely on do refuse: no TTL, too big, unsigned, wrong audience,
    a token valid for more than 24 h, no `sub`, another key than the bound one."""
    vapid = load_or_create_key(tmp_path / "vapid.pem")
    key = public_key_b64(vapid)

    def header(claims: dict[str, Any]) -> str:
        return str(vapid.sign(claims)["Authorization"])

    good = {"aud": autopush.origin, "exp": int(time.time()) + 3600, "sub": VAPID_SUBJECT}
    ttl = {"TTL": "60"}
    autopush.script.restricted["bound"] = WebPushSubscriber.generate().p256dh
    cases = [
        ("no-ttl", {"Authorization": header(good)}, b"x", 400),
        ("too-big", {**ttl, "Authorization": header(good)}, b"x" * 4097, 413),
        ("unsigned", ttl, b"x", 401),
        ("audience", {**ttl, "Authorization": header({**good, "aud": "https://push.example.org"})}, b"x", 401),
        ("too-long", {**ttl, "Authorization": header({**good, "exp": int(time.time()) + 25 * 3600})}, b"x", 401),
        ("bound", {**ttl, "Authorization": header(good)}, b"x", 401),
        ("good", {**ttl, "Authorization": header(good)}, b"x" * 4096, 201),
    ]
    for name, headers, body, status in cases:
        answer = httpx.post(autopush.endpoint(name), content=body, headers=headers, timeout=scaled(REQUEST_SECONDS))
        assert answer.status_code == status, name
    # py-vapid will not sign without `sub`, so that token is made with PyJWT
    no_sub = jwt.encode({"aud": good["aud"], "exp": good["exp"]}, vapid.private_key, algorithm="ES256")
    answer = httpx.post(autopush.endpoint("no-sub"), content=b"x", timeout=scaled(REQUEST_SECONDS),
                        headers={**ttl, "Authorization": f"vapid t={no_sub}, k={key}"})
    assert answer.status_code == 401


def test_vapid_headers_are_cached_per_origin_until_near_expiry(tmp_path: Path) -> None:
    """One signature per distributor origin, reused while it has over an hour left and never
    valid for more than 24 h; the audience is the origin (default ports dropped)."""
    clock = [1_800_000_000.0]
    signer = VapidSigner(load_or_create_key(tmp_path / "vapid.pem"), VAPID_SUBJECT, lambda: clock[0])

    first = signer.authorization("https://ntfy.example.org/upAAA")
    assert signer.authorization("https://NTFY.example.org:443/upBBB?x=1") == first
    other = signer.authorization("https://ntfy.example.org:8443/upAAA")
    assert other != first
    claims = vapid_claims(first, signer.public_key, "https://ntfy.example.org")
    assert claims["exp"] <= clock[0] + 24 * 3600
    assert vapid_claims(other, signer.public_key, "https://ntfy.example.org:8443")["aud"] == (
        "https://ntfy.example.org:8443"
    )

    clock[0] = claims["exp"] - 3601
    assert signer.authorization("https://ntfy.example.org/upAAA") == first
    clock[0] = claims["exp"] - 3599
    renewed = signer.authorization("https://ntfy.example.org/upAAA")
    assert renewed != first
    assert jwt.decode(renewed.split("t=")[1].split(",")[0], options={"verify_signature": False})["exp"] > claims["exp"]


def test_the_origin_is_scheme_host_and_non_default_port() -> None:
    assert origin("https://Push.Example.org/wpush/v2/abc") == "https://push.example.org"
    assert origin("https://push.example.org:443/x") == "https://push.example.org"
    assert origin("http://127.0.0.1:8080/up/x") == "http://127.0.0.1:8080"
    assert origin("https://push.example.org:8443/x") == "https://push.example.org:8443"
    assert origin("https://[2001:DB8::1]:8443/x") == "https://[2001:db8::1]:8443"


def test_headers_follow_rfc_8292_for_any_origin(tmp_path: Path) -> None:
    """`vapid t=<JWT>, k=<key>`, IPv6 literal origins included (py-vapid's wrapper refuses
    those as `aud`, which is why the signer calls its JWT function directly)."""
    signer = VapidSigner(load_or_create_key(tmp_path / "vapid.pem"), VAPID_SUBJECT)
    header = signer.authorization("https://[2001:db8::1]/push/abc")

    assert re.fullmatch(r"vapid t=[\w-]+\.[\w-]+\.[\w-]+, k=[\w-]{87}", header)
    _check_claims(vapid_claims(header, signer.public_key, "https://[2001:db8::1]"),
                  "https://[2001:db8::1]")


def test_the_vapid_key_file_is_generated_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "vapid.pem"
    first = public_key_b64(load_or_create_key(path))

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_key_b64(load_or_create_key(path)) == first == _public_key_of(path)
    assert loaded_public_key(path) == first


def test_a_key_file_created_meanwhile_by_another_worker_wins(tmp_path: Path) -> None:
    """Workers sharing a config folder end up with one key, whichever wrote it first."""
    path = tmp_path / "vapid.pem"
    first = load_or_create_key(path)
    theirs = path.read_text()

    assert create_private_file(path, "our candidate") == theirs.strip()
    assert path.read_text() == theirs
    assert public_key_b64(load_or_create_key(path)) == public_key_b64(first)


def test_an_operator_may_bring_a_raw_base64url_key(tmp_path: Path) -> None:
    """The form `vapid --gen` and web-push tools print: 32 bytes of private scalar."""
    private = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "vapid.key"
    path.write_text(_b64url(private.private_numbers().private_value.to_bytes(32, "big")) + "\n")

    expected = _b64url(private.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    ))
    assert public_key_b64(load_or_create_key(path)) == expected


@pytest.mark.parametrize("content", ["not a key", "", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----"])
def test_a_key_file_that_holds_no_p256_key_stops_start_up(tmp_path: Path, content: str) -> None:
    path = tmp_path / "vapid.pem"
    path.write_text(content)
    with pytest.raises(KeyFileError, match="vapid.pem"):
        load_or_create_key(path)
    assert path.read_text() == content, "a bad key file is reported, never replaced"


@pytest.mark.slow
def test_a_bad_key_file_stops_the_service_naming_the_key(tmp_path: Path) -> None:
    """The real service refuses to start rather than sign with a new key that no endpoint
    bound to the old one would accept; the file is left for the operator."""
    extra = toml_tables({"unifiedpush": {"vapid_subject": VAPID_SUBJECT}})
    service = ServiceProcess(tmp_path / "service", extra_toml=extra)
    key_file = service.folder / "vapid.pem"
    key_file.write_text("not a key\n")
    assert "unifiedpush.vapid_private_key_file" in service.refuses_to_start()
    assert key_file.read_text() == "not a key\n"


def _unifiedpush_config(tmp_path: Path, table: dict[str, Any], public_url: str) -> Config:
    return parse_config({"server": {"public_url": public_url}, "unifiedpush": table}, tmp_path / "relays.toml", TABLES)


def test_the_subject_defaults_to_an_https_public_url(tmp_path: Path) -> None:
    config = _unifiedpush_config(tmp_path, {}, "https://push.example.org")
    table = registry.table(config, unifiedpush.PROVIDER)
    assert table is not None
    assert table.vapid_subject == "https://push.example.org"
    assert config.resolve(table.vapid_private_key_file) == tmp_path / "vapid.pem"


@pytest.mark.parametrize(("table", "public_url"), [
    ({}, "http://127.0.0.1:8080"),
    ({}, "https://example.org/push"),
    ({"vapid_subject": "ops@example.org"}, "https://push.example.org"),
    ({"vapid_subject": "http://example.org"}, "https://push.example.org"),
    ({"vapid_subject": "https://example.org/contact"}, "https://push.example.org"),
    ({"vapid_subject": "mailto:ops"}, "https://push.example.org"),
])
def test_a_missing_or_invalid_subject_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: dict[str, Any], public_url: str
) -> None:
    config = tmp_path / "relays.toml"
    lines = [f'[server]\npublic_url = "{public_url}"\n[unifiedpush]']
    lines += [f'{key} = "{value}"' for key, value in table.items()]
    config.write_text("\n".join(lines) + "\n")

    assert cli.main(["serve", "--config", str(config)]) == 2
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and "unifiedpush.vapid_subject" in stderr[0]
    assert not (tmp_path / "vapid.pem").exists()


@pytest.mark.parametrize("subject", ["mailto:ops@example.org", "https://push.example.org"])
def test_valid_subjects_are_ones_py_vapid_signs(tmp_path: Path, subject: str) -> None:
    config = _unifiedpush_config(tmp_path, {"vapid_subject": subject}, "http://127.0.0.1:8080")
    table = registry.table(config, unifiedpush.PROVIDER)
    assert table is not None and table.vapid_subject == subject
    signer = VapidSigner(load_or_create_key(tmp_path / "vapid.pem"), subject)
    assert vapid_claims(signer.authorization("https://push.example.org/x"), signer.public_key,
                        "https://push.example.org")["sub"] == subject


# --- the real service process: /info publishes the key it signs with, across restarts ---


async def _queue_for(database: str, endpoint: str, subscriber: WebPushSubscriber) -> str:
    """Register a UnifiedPush device and queue one DM for it, as the bridge would have."""
    async with opened(database) as store:
        recipient, sender = SecretKey.generate(), SecretKey.generate()
        device = (await store.devices.register(
            recipient.public_key_hex, "unifiedpush", endpoint, "opaque", (),
            WebPushKeys(subscriber.p256dh, subscriber.auth), 0,
        )).device
        event = sign_event(sender, 4, "secret words", [["p", recipient.public_key_hex]])
        await store.outbox.enqueue(event, RELAY, now_ms(), [device])
        return event.id


def _wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + scaled(timeout)
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return result


@pytest.mark.slow
def test_the_service_publishes_its_vapid_key_and_signs_with_it_across_restarts(
    tmp_path: Path, autopush: FakeUnifiedPush, engine: Engine
) -> None:
    """`sigil-push serve` creates vapid.pem (0600) at first start, `/info` publishes its public
    key, and the pushes before and after a restart verify against that same key."""
    extra = toml_tables({"unifiedpush": {"allow_private_endpoints": True, "vapid_subject": VAPID_SUBJECT}})
    service = ServiceProcess(tmp_path / "service", extra_toml=extra, database=engine.database())
    subscriber = WebPushSubscriber.generate()
    published = []
    for round_ in ("first", "restarted"):
        name = f"svc-{engine.name}-{round_}"  # the fake lives for the session
        asyncio.run(_queue_for(service.database, autopush.endpoint(name), subscriber))
        service.start()
        try:
            info = httpx.get(f"{service.url}/info", timeout=scaled(REQUEST_SECONDS)).json()
            request = _wait_for(lambda name=name: autopush.received(name), "the push")[0]
        finally:
            service.stop()
        published.append(info["vapid_public_key"])
        assert request.status == 201
        _check_claims(vapid_claims(request.headers["authorization"], info["vapid_public_key"],
                                   autopush.origin), autopush.origin)
        assert json.loads(subscriber.decrypt(request.body)) == {"type": "wakeup"}

    key_file = service.folder / "vapid.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert published[0] == published[1] == _public_key_of(key_file)
    assert len(base64.urlsafe_b64decode(published[0] + "=")) == 65


async def test_registration_waits_for_the_endpoint_host_as_long_as_configured(
    tmp_path: Path
) -> None:
    """`unifiedpush.endpoint_check_timeout_seconds` bounds how long a registration waits for the
    endpoint's host to resolve: a host still unresolved then is refused, naming why, and one that
    resolves is admitted. It defaults to 3 s, and a value that would refuse every endpoint
    stops start-up naming the key. (The guard's resolver asks a name server on 127.0.0.1 that
    never answers for the slow name.)"""
    config = _unifiedpush_config(tmp_path, {"endpoint_check_timeout_seconds": 0.5}, "https://push.example.org")
    table = registry.table(config, unifiedpush.PROVIDER)
    assert table is not None and unifiedpush.PROVIDER.admit is not None
    async with FakeDns({"fast.example.org": ["93.184.216.34"]}, silent={"slow.example.org"}) as dns:
        outbound.use_nameservers([dns.server])
        try:
            with pytest.raises(BadRequest) as refused:
                await unifiedpush.PROVIDER.admit(table, "https://slow.example.org/up/1")
            assert refused.value.code == "invalid_device_token"
            assert refused.value.message == "endpoint host did not resolve in time"
            await unifiedpush.PROVIDER.admit(table, "https://fast.example.org/up/1")
        finally:
            outbound.use_nameservers(None)

    default = _unifiedpush_config(tmp_path, {}, "https://push.example.org")
    assert registry.table(default, unifiedpush.PROVIDER).endpoint_check_timeout_seconds == 3.0
    with pytest.raises(ConfigError) as zero:
        _unifiedpush_config(tmp_path, {"endpoint_check_timeout_seconds": 0}, "https://push.example.org")
    assert zero.value.key == "unifiedpush.endpoint_check_timeout_seconds"
