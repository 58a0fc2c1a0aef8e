"""Discovery, health and metrics routes, and the answers while the service is not serving."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sigil_push.config import load_config
from sigil_push.http.api import create_app
from sigil_push.http.deadline import store_deadline
from sigil_push.http.metrics import route_label
from sigil_push.push.registry import TABLES
from sigil_push.service import Service
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller


def test_info_describes_the_instance(api: ApiCaller) -> None:
    info = api.http.get("/info").json()
    assert info["name"] == "sigil-push"
    assert info["platforms"] == ["ios", "android", "unifiedpush"]
    assert isinstance(info["relays"], list)
    assert len(info["pubkey"]) == 64 and int(info["pubkey"], 16) >= 0
    assert "vapid_public_key" not in info, "published only when UnifiedPush is on"


def test_health_reports_serving(api: ApiCaller, service: ServiceProcess) -> None:
    """With admin_listen set, the public /health says the status alone; detail is on admin."""
    health = api.http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    detail = httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS))
    assert detail.status_code == 200 and isinstance(detail.json()["relays"], dict)


def test_metrics_count_requests_by_route_and_status(api: ApiCaller, service: ServiceProcess) -> None:
    api.register(SdkUser(), platform="nope")
    assert api.http.get("/metrics").status_code == 404
    text = httpx.get(service.admin_url + "/metrics", timeout=scaled(REQUEST_SECONDS)).text
    # on PostgreSQL every series also names its worker (`worker="..."`)
    counted = [line for line in text.splitlines() if line.startswith("sigil_push_http_requests_total{")]
    wanted = ('method="POST"', 'route="/register"', 'status="400"')
    assert any(all(label in line for label in wanted) for line in counted), counted
    assert "sigil_push_http_request_duration_seconds_bucket" in text


def test_metrics_label_unusual_methods_as_other(api: ApiCaller, service: ServiceProcess) -> None:
    """A client may send any token as its HTTP method: each one must not become a series of
    its own (nor carry whatever text a client chose into /metrics)."""
    for method in ("PROPFIND", "MKCOL", "PURGE"):
        api.http.request(method, "/register")
    text = httpx.get(service.admin_url + "/metrics", timeout=scaled(REQUEST_SECONDS)).text
    counted = [line for line in text.splitlines() if line.startswith("sigil_push_http_requests_total{")]
    methods = set(re.findall(r'method="([^"]*)"', "\n".join(counted)))
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}, methods
    assert "other" in methods


async def test_not_serving_answers_503(tmp_path: Path) -> None:
    """Before start-up completes (and while stopping) health and the API say 503 unavailable."""
    config_file = tmp_path / "relays.toml"
    config_file.write_text("")
    service = Service(load_config(config_file, TABLES))
    transport = httpx.ASGITransport(app=create_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as http:
        health = await http.get("/health")
        assert health.status_code == 503
        assert health.json()["error"] == "unavailable"
        register = await http.post(
            "/register", content=b"{}", headers={"content-type": "application/json"}
        )
        assert register.status_code == 503
        assert register.json()["error"] == "unavailable"


def test_every_api_route_has_its_own_metrics_label(tmp_path: Path) -> None:
    """Each route of the public app is labelled by its path in the request metrics, not lumped
    into `other` with scanners' paths (/preferences and /presence once were)."""
    config_file = tmp_path / "relays.toml"
    config_file.write_text("")
    app = create_app(Service(load_config(config_file, TABLES)))
    paths = {getattr(route, "path", "") for route in app.routes}
    assert {"/preferences", "/presence", "/register"} <= paths
    assert sorted(path for path in paths if route_label(path) != path) == []
    assert route_label("/subscriptions/0b1c") == "/subscriptions/{id}"


STORELESS_ROUTES = {"/health", "/metrics", "/info"}


def test_every_route_that_touches_the_store_answers_by_the_deadline(tmp_path: Path) -> None:
    """Issue 34, item 9: a database outage gives `503 unavailable` within 10 s on every route
    that reads or writes the store, never a hang: each public route but /health, /metrics and
    /info (no store) runs inside `store_deadline` (the Iris routes once did not)."""
    config_file = tmp_path / "relays.toml"
    config_file.write_text("[iris]\nenabled = true\n")
    app = create_app(Service(load_config(config_file, TABLES)))

    async def handler(request: Request) -> Response:
        return Response()

    bounded = store_deadline(handler).__code__
    routes = [route for route in app.routes if isinstance(route, Route)]
    unbounded = sorted(
        f"{sorted(route.methods or ())} {route.path}" for route in routes
        if route.path not in STORELESS_ROUTES and route.endpoint.__code__ is not bounded
    )
    assert any(route.path.startswith("/subscriptions") for route in routes)
    assert unbounded == []
