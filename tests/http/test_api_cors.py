"""CORS on every API route (CONTRACT section 3): a browser app on another origin (Iris) can
call the API, preflights included, and read the JSON of its errors."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sigil_push.config import parse_config
from sigil_push.http.api import create_app
from sigil_push.push.registry import TABLES
from sigil_push.service import Service
from testkit.nip98 import SdkUser
from tests.conftest import ApiCaller

ROUTES = ["/register", "/unregister", "/registrations", "/preferences", "/presence", "/info",
          "/health", "/subscriptions", "/subscriptions/", "/subscriptions/some-id"]


@pytest.mark.parametrize("path", ROUTES)
def test_a_preflight_is_answered_204_with_the_allowed_methods_and_headers(
    api: ApiCaller, path: str
) -> None:
    response = api.http.request("OPTIONS", path, headers={
        "origin": "https://iris.to", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    })
    assert response.status_code == 204
    assert response.content == b""
    headers = response.headers
    assert headers["access-control-allow-origin"] == "*"
    assert headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert headers["access-control-max-age"] == "86400"


def test_real_answers_carry_the_allow_origin_header_errors_included(api: ApiCaller) -> None:
    origin = {"origin": "https://iris.to"}
    info = api.http.get("/info", headers=origin)
    assert info.status_code == 200
    assert info.headers["access-control-allow-origin"] == "*"
    user = SdkUser()
    listed = api.call("GET", "/registrations", user, headers=origin)
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
    refused = api.http.get("/registrations", headers=origin)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "*"
    assert refused.json()["error"] == "auth_missing"
    missing = api.http.get("/nowhere", headers=origin)
    assert missing.status_code == 404
    assert missing.headers["access-control-allow-origin"] == "*"


async def test_an_unexpected_failure_is_a_json_500_a_browser_can_read(tmp_path: Path) -> None:
    """Starlette answers unhandled errors outside every middleware, CORS included."""
    config = parse_config({"server": {"database": str(tmp_path / "push.db")}},
                          tmp_path / "relays.toml", TABLES)
    app = create_app(Service(config))

    async def fail(request: Request) -> Response:
        raise RuntimeError("a bug")

    app.router.routes.append(Route("/fail", fail))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        response = await http.get("/fail", headers={"origin": "https://iris.to"})
    assert response.status_code == 500
    assert response.json() == {"error": "internal", "message": "internal error"}
    assert response.headers.get_list("access-control-allow-origin") == ["*"]
