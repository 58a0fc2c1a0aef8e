"""Every error code of CONTRACT section 3, each provoked through the real HTTP API, on each
storage engine (the suite's `service` runs once on a SQLite file, once on PostgreSQL)."""

from __future__ import annotations

import base64
import json
import secrets
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser, encode_header
from testkit.service import ServiceProcess
from testkit.stores import backend_service
from tests.conftest import ApiCaller


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == code
    assert isinstance(body["message"], str) and body["message"]


def register_body(user: SdkUser, **fields: object) -> dict[str, object]:
    return {"npub": user.npub, "platform": "ios", "device_token": secrets.token_hex(32), **fields}


# -- body and media type -------------------------------------------------------------------


# nested deeper than Python's recursion limit: json.loads raises RecursionError, not ValueError
NESTED = b"[" * 5000


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b'"string"', NESTED])
def test_invalid_json(api: ApiCaller, raw: bytes) -> None:
    assert_error(api.call("POST", "/register", SdkUser(), raw=raw), 400, "invalid_json")


def test_unsupported_media_type(api: ApiCaller) -> None:
    user = SdkUser()
    response = api.call(
        "POST", "/register", user, register_body(user), headers={"content-type": "text/plain"}
    )
    assert_error(response, 415, "unsupported_media_type")


def test_body_too_large_by_declared_length(api: ApiCaller) -> None:
    user = SdkUser()
    response = api.call("POST", "/register", user, register_body(user, pad="x" * 9000))
    assert_error(response, 413, "body_too_large")


def test_body_too_large_when_streamed_without_length(api: ApiCaller) -> None:
    """A chunked body is cut off while reading, not buffered whole first."""

    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b" " * 1024

    response = api.http.post(
        "/register", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(response, 413, "body_too_large")


def _raw_answer(service: ServiceProcess, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as bytes on a socket of its own; the status, headers and body answered
    (read until the server closes)."""
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as sock:
        sock.sendall(request)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("length", [b"abc", b"12x", b"-5"])
def test_a_content_length_that_is_not_a_number_gets_a_json_error(
    api: ApiCaller, service: ServiceProcess, length: bytes
) -> None:
    """HTTP's own parser refuses the request before the app sees it: the answer is still the
    JSON every client parses (uvicorn's was `text/plain` "Invalid HTTP request received."),
    the connection is closed, and the instance answers the next request as usual."""
    status, headers, body = _raw_answer(service, (
        b"POST /register HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + length + b"\r\n\r\n{}"
    ))
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert headers["access-control-allow-origin"] == "*"
    answer = json.loads(body)
    assert answer["error"] == "http_error" and "Content-Length" in answer["message"]
    assert api.http.get("/health").status_code == 200


def test_headers_past_the_bounds_get_a_json_error(service: ServiceProcess) -> None:
    status, headers, body = _raw_answer(service, (
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + b"".join(b"X-Pad-%d: 1\r\n" % i for i in range(200)) + b"\r\n"
    ))
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"] == "http_error"


# -- NIP-98 ----------------------------------------------------------------------------------


def test_auth_missing(api: ApiCaller) -> None:
    assert_error(api.call("POST", "/register", None, register_body(SdkUser())), 401, "auth_missing")
    response = api.call(
        "GET", "/registrations", None, headers={"authorization": "Bearer abc"}
    )
    assert_error(response, 401, "auth_missing")


def _signed(api: ApiCaller, user: SdkUser, body: bytes, **kwargs: object) -> dict[str, object]:
    return user.auth_event(api.public_url + "/register", "POST", body, **kwargs)  # type: ignore[arg-type]


def _post_with_auth(api: ApiCaller, authorization: str, body: bytes) -> httpx.Response:
    return api.http.post(
        "/register",
        content=body,
        headers={"content-type": "application/json", "authorization": authorization},
    )


@pytest.mark.parametrize(
    "breakage",
    [
        "base64", "json", "nested", "kind", "id", "signature", "u", "method", "payload",
        "missing_payload",
    ],
)
def test_auth_invalid(api: ApiCaller, breakage: str) -> None:
    """Each NIP-98 check refuses with auth_invalid on its own."""
    user = SdkUser()
    body = json.dumps(register_body(user)).encode()
    event = _signed(api, user, body)
    if breakage == "base64":
        header = "Nostr %%%not-base64%%%"
    elif breakage == "json":
        header = "Nostr " + base64.b64encode(b"{not json").decode()
    elif breakage == "nested":
        header = "Nostr " + base64.b64encode(NESTED[:3000]).decode()
    elif breakage == "kind":
        header = encode_header(_signed(api, user, body, kind=1))
    elif breakage == "id":
        header = encode_header({**event, "id": "0" * 64})
    elif breakage == "signature":
        header = encode_header({**event, "sig": "ab" * 64})
    elif breakage == "u":
        header = encode_header(user.auth_event(api.public_url + "/registrations", "POST", body))
    elif breakage == "method":
        header = encode_header(user.auth_event(api.public_url + "/register", "PUT", body))
    elif breakage == "payload":
        header = encode_header(_signed(api, user, b'{"other": "body"}'))
    else:
        header = encode_header(_signed(api, user, b""))
    assert_error(_post_with_auth(api, header, body), 401, "auth_invalid")


def test_auth_u_tag_must_match_public_url_exactly(api: ApiCaller) -> None:
    user = SdkUser()
    body = json.dumps(register_body(user)).encode()
    header = encode_header(user.auth_event(api.public_url + "/register/", "POST", body))
    assert_error(_post_with_auth(api, header, body), 401, "auth_invalid")


@pytest.mark.parametrize("skew", [-120, 120])
def test_auth_expired(api: ApiCaller, skew: int) -> None:
    user = SdkUser()
    body = json.dumps(register_body(user)).encode()
    header = encode_header(_signed(api, user, body, created_at=int(time.time()) + skew))
    assert_error(_post_with_auth(api, header, body), 401, "auth_expired")


def test_an_auth_event_retried_for_the_same_request_is_accepted(api: ApiCaller) -> None:
    """Single use is about the request: a client retrying the very same request (same method,
    URL, body) within the auth event's minute is not refused. Another body would need another
    `payload` tag, so on these routes a changed request fails its signature check first; the
    `401 auth_replayed` of a spent event on another body is provoked on the Iris routes, which
    accept auth events without `payload` (tests/test_iris_api.py)."""
    user = SdkUser()
    body = json.dumps(register_body(user)).encode()
    header = encode_header(_signed(api, user, body))
    assert _post_with_auth(api, header, body).status_code == 201
    assert _post_with_auth(api, header, body).status_code == 200
    listing = user.header(api.public_url + "/registrations", "GET")
    for _ in range(2):
        response = api.http.get("/registrations", headers={"authorization": listing})
        assert response.status_code == 200, response.text
        assert len(response.json()["devices"]) == 1


def test_npub_mismatch(api: ApiCaller) -> None:
    signer, victim = SdkUser(), SdkUser()
    response = api.call("POST", "/register", signer, register_body(victim))
    assert_error(response, 403, "npub_mismatch")


# -- field validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "npub", ["npub1invalid", "A" * 64, "nsec1" + "q" * 58, 42, None, "ab" * 31]
)
def test_invalid_npub(api: ApiCaller, npub: object) -> None:
    user = SdkUser()
    assert_error(api.register(user, npub=npub), 400, "invalid_npub")


@pytest.mark.parametrize("platform", ["windows", "", None, ["ios"], "IOS"])
def test_invalid_platform(api: ApiCaller, platform: object) -> None:
    assert_error(api.register(SdkUser(), platform=platform), 400, "invalid_platform")


@pytest.mark.parametrize(
    ("platform", "token"),
    [
        ("ios", "ab" * 31),
        ("ios", "zz" * 32),
        ("ios", "ab" * 101),
        ("ios", 12345),
        ("android", "short"),
        ("android", "has spaces in it but long enough"),
        ("unifiedpush", "not a url"),
        ("unifiedpush", "https://127.0.0.1/push"),
        ("unifiedpush", "https://[::1]/push"),
        ("unifiedpush", "https://10.1.2.3/push"),
        ("unifiedpush", "http://93.184.216.34/push"),
    ],
)
def test_invalid_device_token(api: ApiCaller, platform: str, token: object) -> None:
    response = api.register(SdkUser(), platform=platform, device_token=token)
    assert_error(response, 400, "invalid_device_token")


@pytest.mark.parametrize("payload", ["full", "", 1, "OPAQUE"])
def test_invalid_payload(api: ApiCaller, payload: object) -> None:
    assert_error(api.register(SdkUser(), payload=payload), 400, "invalid_payload")


@pytest.mark.parametrize(
    "relays",
    [
        "wss://relay.example",
        ["https://relay.example"],
        ["wss://"],
        [f"wss://relay{i}.example" for i in range(11)],
        [42],
        ["wss://relay.example:99999"],
    ],
)
def test_invalid_relays(api: ApiCaller, relays: object) -> None:
    assert_error(api.register(SdkUser(), relays=relays), 400, "invalid_relays")


@pytest.mark.parametrize(
    "signer",
    [
        "nostrconnect://abc",
        7,
        "bunker://" + "ab" * 32,
        "bunker://npub1abc?relay=wss://r.example",
        "bunker://" + "ab" * 32 + "?relay=https://r.example",
        "bunker://" + "ab" * 32 + "".join(f"&relay=wss://r{i}.example" for i in range(6)),
        "bunker://" + "ab" * 32 + "?relay=wss://r.example&secret=a&secret=b",
        "bunker://" + "0" * 64 + "?relay=wss://r.example",  # hex, but no point on the curve
        "bunker://" + "5" * 64 + "?relay=wss://r.example",
    ],
)
def test_invalid_auth_signer(api: ApiCaller, signer: object) -> None:
    assert_error(api.register(SdkUser(), auth_signer=signer), 400, "invalid_auth_signer")


def test_unregister_requires_a_token(api: ApiCaller) -> None:
    response = api.call("DELETE", "/unregister", SdkUser(), {"device_token": ""})
    assert_error(response, 400, "invalid_device_token")


def test_unknown_route_and_method_are_json(api: ApiCaller) -> None:
    assert_error(api.http.get("/nowhere"), 404, "not_found")
    assert_error(api.http.get("/register"), 405, "method_not_allowed")


# -- instance-level limits and configuration ---------------------------------------------------


@pytest.fixture(scope="module")
def strict_service(
    request: pytest.FixtureRequest, service: ServiceProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServiceProcess]:
    """Only UnifiedPush enabled, wss-only user relays, two devices per npub, low rate limits
    (on the engine `service` runs on)."""
    limits = "requests_per_minute_per_ip = 8\nrequests_per_minute_per_npub = 5\ndevices_per_npub = 2"
    strict = ServiceProcess(
        tmp_path_factory.mktemp("strict"),
        extra_toml='[unifiedpush]\nallow_private_endpoints = true\nvapid_subject = "mailto:ops@example.org"\n',
        limits=limits,
        insecure_relays=False,
    )
    backend = "postgres" if service.database.startswith("postgresql://") else "sqlite"
    with backend_service(backend, request, strict) as running:
        yield running


@pytest.fixture
def strict_api(strict_service: ServiceProcess) -> Iterator[ApiCaller]:
    with httpx.Client(base_url=strict_service.url, timeout=scaled(REQUEST_SECONDS)) as http:
        yield ApiCaller(http, strict_service.url)


def test_limits_and_disabled_platforms(strict_api: ApiCaller) -> None:
    """One story so the per-IP budget of the strict instance is spent deliberately."""
    user = SdkUser()

    def up(n: int) -> dict[str, object]:
        return {"npub": user.npub, "platform": "unifiedpush", "device_token": f"http://127.0.0.1:1/{n}"}

    assert_error(strict_api.register(user), 400, "platform_disabled")
    assert_error(
        strict_api.call("POST", "/register", user, {**up(0), "relays": ["ws://127.0.0.1:1"]}),
        400, "invalid_relays",
    )
    assert strict_api.call("POST", "/register", user, up(1)).status_code == 201
    assert strict_api.call("POST", "/register", user, up(2)).status_code == 201
    too_many = strict_api.call("POST", "/register", user, up(3))
    assert_error(too_many, 409, "too_many_devices")
    limited = strict_api.call("POST", "/register", user, up(4))
    assert_error(limited, 429, "rate_limited")
    assert int(limited.headers["retry-after"]) >= 1
    assert strict_api.http.get("/health").status_code == 200


def test_per_ip_limit_spares_health_and_metrics(strict_api: ApiCaller, strict_service: ServiceProcess) -> None:
    statuses = [strict_api.http.get("/info").status_code for _ in range(12)]
    assert 429 in statuses
    limited = strict_api.http.get("/info")
    assert_error(limited, 429, "rate_limited")
    assert int(limited.headers["retry-after"]) >= 1
    assert strict_api.http.get("/health").status_code == 200
    assert httpx.get(strict_service.admin_url + "/metrics", timeout=scaled(REQUEST_SECONDS)).status_code == 200


@pytest.mark.slow  # waits out the real busy and lock timeouts (5 s)
def test_busy_storage_answers_503_with_retry_after(api: ApiCaller, service: ServiceProcess) -> None:
    """A database locked beyond the busy timeout is a temporary 503, never a 500, and one
    warning line in the log on either engine, not an unhandled error's traceback."""
    import sqlite3

    user = SdkUser()
    logged_before = len(service.log())
    if service.database.startswith("postgresql://"):
        _busy_postgres_answers_503(api, service, user)
    else:
        locker = sqlite3.connect(service.database, timeout=scaled(REQUEST_SECONDS), isolation_level=None)
        try:
            locker.execute("BEGIN EXCLUSIVE")
            response = api.register(user)
            assert_error(response, 503, "unavailable")
            assert response.headers["retry-after"] == "1"
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert api.register(user).status_code == 201
    logged = service.log()[logged_before:]
    assert "storage busy on POST /register" in logged
    assert "Traceback" not in logged


def _busy_postgres_answers_503(api: ApiCaller, service: ServiceProcess, user: SdkUser) -> None:
    """PostgreSQL: a lock held past `lock_timeout` (5 s) is the same 503 as SQLite's busy file."""
    import asyncio

    import asyncpg

    def register_on_new_connection() -> httpx.Response:
        with httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS)) as http:
            return ApiCaller(http, api.public_url).register(user)

    async def story() -> None:
        locker = await asyncpg.connect(service.database)
        try:
            async with locker.transaction():
                await locker.execute("LOCK TABLE nip98_used IN ACCESS EXCLUSIVE MODE")
                response = await asyncio.to_thread(register_on_new_connection)
                assert_error(response, 503, "unavailable")
                assert response.headers["retry-after"] == "1"
        finally:
            await locker.close()

    asyncio.run(story())
    assert register_on_new_connection().status_code == 201
