"""The Iris-compatible API (CONTRACT 3b) through the real HTTP face, on each storage engine:
Iris's own calls (trailing slashes, `btoa` NIP-98 without `payload`), what is stored and shown
back, ownership, and every validation limit with its error code."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Iterator

import asyncpg
import httpx
import pytest

from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.iris_client import BrowserKeys, IrisClient, btoa_header, iris_auth_event
from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from testkit.stores import BACKENDS, backend_service
from tests.conftest import ApiCaller

IRIS_TOML = """
[unifiedpush]
allow_private_endpoints = true
vapid_subject = "mailto:ops@example.org"

[webhooks]
allow_private_endpoints = true
"""
ENDPOINT = "http://127.0.0.1:9/push/"
API_ANSWER_SECONDS = 10.0
"""The most a route may take to answer while the database is locked or gone (issue 34)."""


@pytest.fixture(scope="module", params=BACKENDS)
def iris_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    folder = tmp_path_factory.mktemp(f"iris-{request.param}")
    service = ServiceProcess(folder, extra_toml=IRIS_TOML)
    with backend_service(request.param, request, service) as running:
        yield running


@pytest.fixture(scope="module")
def http(iris_service: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=iris_service.url, timeout=scaled(REQUEST_SECONDS)) as client:
        yield client


def iris(http: httpx.Client, service: ServiceProcess, user: SdkUser | None = None) -> IrisClient:
    return IrisClient(http, user or SdkUser(), service.url)


def subscription(user: SdkUser, keys: BrowserKeys, endpoint: str = ENDPOINT, **extra: object) -> dict[str, object]:
    return {
        "filter": {"#p": [user.hex], "kinds": [1, 6, 7, 9735]},
        "web_push_subscriptions": [keys.subscription(endpoint)],
        "webhooks": [],
        **extra,
    }


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"] == code
    assert response.json()["message"]


def test_iris_creates_two_subscriptions_on_one_endpoint_in_one_second_and_reads_them_back(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    """Iris's two syncs run together: same second, same auth event id, different signatures,
    different bodies. Both are created, and GET (with the slash) shows each exactly as sent."""
    client = iris(http, iris_service)
    keys = BrowserKeys()
    assert client.subscriptions() == {}
    session_key = SdkUser()
    bodies = [
        subscription(client.user, keys),
        {"filter": {"kinds": [1060], "authors": [session_key.hex]},
         "web_push_subscriptions": [keys.subscription(ENDPOINT)], "webhooks": []},
    ]
    now = int(time.time())
    url = client.public_base + "subscriptions"
    events = [iris_auth_event(client.user, url, "POST", created_at=now) for _ in bodies]
    assert events[0]["id"] == events[1]["id"] and events[0]["sig"] != events[1]["sig"]
    created = [
        client.request("POST", "subscriptions", body, header=btoa_header(event))
        for body, event in zip(bodies, events, strict=True)
    ]
    for response in created:
        assert response.status_code == 201, response.text
        assert response.json()["status"] == "Created"
    ids = [response.json()["id"] for response in created]
    shown = client.subscriptions()
    assert set(shown) == set(ids)
    for subscription_id, body in zip(ids, bodies, strict=True):
        assert {k: v for k, v in shown[subscription_id].items() if k != "subscriber"} == body
        assert shown[subscription_id]["subscriber"] == client.user.hex
    one = client.request("GET", f"subscriptions/{ids[1]}")
    assert one.status_code == 200 and one.json()["filter"] == bodies[1]["filter"]
    assert client.request("GET", "subscriptions").json() == shown, "without the slash too"


def test_the_same_auth_event_for_another_body_is_replayed_and_for_the_same_body_retried(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    client = iris(http, iris_service)
    keys = BrowserKeys()
    event = iris_auth_event(client.user, client.public_base + "subscriptions/", "POST")
    header = btoa_header(event)
    first = client.request("POST", "subscriptions/", subscription(client.user, keys), header=header)
    assert first.status_code == 201, first.text
    other = subscription(client.user, keys, social_graph_filter=True)
    assert_error(client.request("POST", "subscriptions/", other, header=header), 401, "auth_replayed")
    again = client.request("POST", "subscriptions/", subscription(client.user, keys), header=header)
    assert again.status_code == 201, "an idempotent retry of the very same request"
    assert again.json() == first.json(), "the retry names the subscription it made"
    assert list(client.subscriptions()) == [first.json()["id"]], "and makes no duplicate"


def test_url_safe_unpadded_auth_and_a_payload_tag_when_present_is_checked(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    client = iris(http, iris_service)
    url = client.public_base + "subscriptions"
    listed = client.request("GET", "subscriptions", header=btoa_header(
        iris_auth_event(client.user, url, "GET"), url_safe=True))
    assert listed.status_code == 200, listed.text
    body = subscription(client.user, BrowserKeys())
    wrong = iris_auth_event(client.user, url, "POST", tags=[["payload", "0" * 64]])
    assert_error(client.request("POST", "subscriptions", body, header=btoa_header(wrong)),
                 401, "auth_invalid")
    slashless = iris_auth_event(client.user, url, "GET")
    assert_error(client.request("GET", "subscriptions/", header=btoa_header(slashless)),
                 401, "auth_invalid")


def test_an_update_replaces_and_an_unknown_id_is_created_under_it(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    client = iris(http, iris_service)
    keys, rotated = BrowserKeys(), BrowserKeys()
    session_keys = [SdkUser().hex, SdkUser().hex]
    body = {"filter": {"kinds": [1060], "authors": session_keys[:1]},
            "web_push_subscriptions": [keys.subscription(ENDPOINT)]}
    chosen = "a3b1c2d4-0000-4000-8000-00000000abcd"
    created = client.request("POST", f"subscriptions/{chosen}", body)
    assert created.status_code == 200 and created.json() == {"status": "Updated"}
    update = {"filter": {"kinds": [1060], "authors": session_keys},
              "web_push_subscriptions": [rotated.subscription(ENDPOINT)], "webhooks": [],
              "subscriber": client.user.hex}
    assert client.request("POST", f"subscriptions/{chosen}", update).status_code == 200
    shown = client.request("GET", f"subscriptions/{chosen}").json()
    assert shown["filter"]["authors"] == session_keys
    assert shown["web_push_subscriptions"] == [rotated.subscription(ENDPOINT)]
    assert list(client.subscriptions()) == [chosen]


def test_another_users_subscription_is_not_found_for_every_method(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    owner, stranger = iris(http, iris_service), iris(http, iris_service)
    keys = BrowserKeys()
    subscription_id = owner.request("POST", "subscriptions", subscription(owner.user, keys)).json()["id"]
    assert_error(stranger.request("GET", f"subscriptions/{subscription_id}"), 404, "not_found")
    assert_error(stranger.request("DELETE", f"subscriptions/{subscription_id}"), 404, "not_found")
    assert_error(
        stranger.request("POST", f"subscriptions/{subscription_id}", subscription(stranger.user, keys)),
        404, "not_found",
    )
    assert stranger.subscriptions() == {}
    assert list(owner.subscriptions()) == [subscription_id]
    deleted = owner.request("DELETE", f"subscriptions/{subscription_id}")
    assert deleted.status_code == 204 and deleted.content == b""
    assert owner.subscriptions() == {}
    assert_error(owner.request("GET", f"subscriptions/{subscription_id}"), 404, "not_found")
    # an id no subscription could have is not the caller's either (after auth, as any other)
    for unusable in ("x" * 65, "a%20b", "%C3%A9"):
        assert_error(owner.request("GET", f"subscriptions/{unusable}"), 404, "not_found")
        assert_error(owner.request("DELETE", f"subscriptions/{unusable}"), 404, "not_found")
    unsigned = http.get(f"subscriptions/{'x' * 65}")
    assert_error(unsigned, 401, "auth_missing")


def _filters(count: int, user: SdkUser) -> list[dict[str, object]]:
    return [{"#p": [user.hex], "kinds": [1]} for _ in range(count)]


@pytest.mark.parametrize(("change", "status", "code"), [
    ({"filter": None}, 400, "invalid_filter"),
    ({"filter": {"kinds": [1]}}, 400, "invalid_filter"),
    ({"filter": {"#p": []}}, 400, "invalid_filter"),
    ({"filter": {"#e": ["a" * 64]}}, 400, "invalid_filter"),
    ({"filter": {"authors": ["npub1nothex"]}}, 400, "invalid_filter"),
    ({"filter": {"#p": ["a" * 64], "kinds": ["1"]}}, 400, "invalid_filter"),
    ({"filter": {"#p": ["a" * 64], "search": "x"}}, 400, "invalid_filter"),
    ({"filter": {"#p": ["a" * 64], "kinds": list(range(1001))}}, 400, "invalid_filter"),
    ({"filter": {"#p": ["a" * 64], "#t": [str(i) for i in range(1001)]}}, 400, "invalid_filter"),
    ({"filters": "many"}, 400, "invalid_filter"),
    ({"social_graph_filter": "yes"}, 400, "invalid_filter"),
    ({"web_push_subscriptions": []}, 400, "invalid_device_token"),
    ({"web_push_subscriptions": [{"endpoint": ENDPOINT, "auth": "AAAA", "p256dh": "BBBB"}]},
     400, "invalid_device_token"),
    ({"web_push_subscriptions": [{"endpoint": "ftp://127.0.0.1/x", "auth": "x", "p256dh": "y"}]},
     400, "invalid_device_token"),
    ({"webhooks": ["not a url"]}, 400, "invalid_device_token"),
    ({"fcm_tokens": ["token"]}, 400, "platform_disabled"),
    ({"apns_tokens": ["ab" * 32]}, 400, "platform_disabled"),
    # half a surrogate pair (a `\\ud800` escape): no UTF-8 store or answer could hold it
    ({"filter": {"#p": ["a" * 64], "#t": ["\ud800"]}}, 400, "invalid_json"),
    ({"webhooks": ["http://127.0.0.1:9/hook\udc00"]}, 400, "invalid_json"),
])
def test_invalid_subscriptions_are_refused_with_their_code(
    http: httpx.Client, iris_service: ServiceProcess, change: dict[str, object], status: int,
    code: str,
) -> None:
    client = iris(http, iris_service)
    body = {**subscription(client.user, BrowserKeys()), **change}
    if change.get("filter", 0) is None:
        del body["filter"]
    assert_error(client.request("POST", "subscriptions/", body), status, code)
    assert client.subscriptions() == {}


def test_the_limits_filters_targets_body_and_subscriptions_per_pubkey(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    client = iris(http, iris_service)
    keys = BrowserKeys()
    ten = subscription(client.user, keys, filters=_filters(9, client.user))
    assert client.request("POST", "subscriptions", ten).status_code == 201
    eleven = subscription(client.user, keys, filters=_filters(10, client.user))
    assert_error(client.request("POST", "subscriptions", eleven), 400, "invalid_filter")
    targets = [BrowserKeys().subscription(f"{ENDPOINT}{i}") for i in range(11)]
    many = {**subscription(client.user, keys), "web_push_subscriptions": targets}
    assert_error(client.request("POST", "subscriptions", many), 400, "invalid_filter")
    webhooks = {**subscription(client.user, keys), "webhooks": ["http://127.0.0.1:9/hook"]}
    assert client.request("POST", "subscriptions", webhooks).status_code == 201
    big = subscription(client.user, keys, pad="x" * (64 * 1024))
    assert_error(client.request("POST", "subscriptions", big), 413, "body_too_large")
    for _ in range(18):
        assert client.request("POST", "subscriptions", subscription(client.user, keys)).status_code == 201
    assert_error(
        client.request("POST", "subscriptions", subscription(client.user, keys)), 400, "invalid_filter"
    )
    assert len(client.subscriptions()) == 20


def test_iris_targets_are_not_registrations(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    """An endpoint in two subscriptions is one target row, yet never a registration: GET
    /registrations doesn't list it and it counts against no device limit."""
    client = iris(http, iris_service)
    keys = BrowserKeys()
    for _ in range(2):
        assert client.request("POST", "subscriptions", subscription(client.user, keys)).status_code == 201
    caller = ApiCaller(http, iris_service.url)
    listed = caller.call("GET", "/registrations", client.user)
    assert listed.status_code == 200 and listed.json()["devices"] == []
    registered = caller.call("POST", "/register", client.user, {
        "npub": client.user.npub, "platform": "unifiedpush", "device_token": ENDPOINT,
    })
    assert_error(registered, 400, "invalid_device_token")
    other = caller.call("POST", "/register", client.user, {
        "npub": client.user.npub, "platform": "unifiedpush", "device_token": ENDPOINT + "other",
    })
    assert other.status_code == 201, other.text
    taken = subscription(client.user, keys, endpoint=ENDPOINT + "other")
    assert_error(client.request("POST", "subscriptions", taken), 400, "invalid_device_token")


def test_webhooks_need_the_webhooks_table(api: ApiCaller) -> None:
    """The shared dry-run service has no [webhooks] table."""
    client = IrisClient(api.http, SdkUser(), api.public_url)
    body = {"filter": {"#p": [client.user.hex]}, "webhooks": ["https://hooks.example/x"]}
    assert_error(client.request("POST", "subscriptions", body), 400, "platform_disabled")
    assert json.loads(client.request("GET", "subscriptions/").content) == {}


@pytest.mark.slow  # waits out the real busy and lock timeouts (5 s)
def test_a_locked_store_answers_503_unavailable_within_10_s_on_every_iris_route(
    http: httpx.Client, iris_service: ServiceProcess
) -> None:
    """Issue 34, item 9: while another connection holds the database's lock (SQLite: the
    file's; PostgreSQL: the tables these routes write), each Iris route answers `503
    unavailable` with `Retry-After` within 10 s, never a 500 or a hang; then it works again."""
    client = iris(http, iris_service)
    keys = BrowserKeys()
    created = client.request("POST", "subscriptions", subscription(client.user, keys))
    assert created.status_code == 201, created.text
    path = f"subscriptions/{created.json()['id']}"
    calls = [("GET", "subscriptions", None), ("POST", "subscriptions/",
             subscription(client.user, keys)), ("DELETE", path, None)]

    def each_call_unavailable() -> None:
        for method, route, body in calls:
            started = time.monotonic()
            response = client.request(method, route, body)
            took = time.monotonic() - started
            assert_error(response, 503, "unavailable")
            assert response.headers["retry-after"] == "1"
            assert took < API_ANSWER_SECONDS, f"{method} /{route} took {took:.1f} s"

    if iris_service.database.startswith("postgresql://"):
        asyncio.run(_with_postgres_tables_locked(iris_service.database, each_call_unavailable))
    else:
        locker = sqlite3.connect(iris_service.database, timeout=scaled(REQUEST_SECONDS),
                                 isolation_level=None)
        try:
            locker.execute("BEGIN EXCLUSIVE")
            each_call_unavailable()
        finally:
            locker.execute("ROLLBACK")
            locker.close()
    assert client.request("DELETE", path).status_code == 204


async def _with_postgres_tables_locked(database: str, act: Callable[[], None]) -> None:
    locker = await asyncpg.connect(database)
    try:
        async with locker.transaction():
            await locker.execute("LOCK TABLE nip98_used, iris_subscriptions IN ACCESS EXCLUSIVE MODE")
            await asyncio.to_thread(act)
    finally:
        await locker.close()
