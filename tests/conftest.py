"""Fixtures shared by the whole suite: a running sigil-push process and an HTTP client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings

from sigil_push import outbound
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from testkit.slow_marks import slow_reason

# fixtures for every test module: the PostgreSQL server, the engine-parametrised stores and
# services, relay and service processes, the provider fakes (fake APNs, FCM and UnifiedPush
# servers). Listed before the modules that import them, so pytest rewrites their asserts.
# First, the bytecode caches every process of the run reads (testkit/bytecode.py).
pytest_plugins = (
    "testkit.bytecode", "testkit.postgres", "testkit.stores", "testkit.processes",
    "testkit.fakes.harness", "testkit.phones", "testkit.xdist_groups",
)

settings.register_profile(
    "suite", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("suite")
"""Hypothesis's own clocks (200 ms an example, a slow-generation check) are deadlines tuned to
an idle machine; the properties do not depend on time (testkit/deadlines.py)."""


@pytest.fixture(autouse=True)
def loopback_outbound() -> Iterator[None]:
    """In-process components reach the test relays on 127.0.0.1, as service processes do
    under `allow_insecure_relays = true`; tests of the guard itself install a strict one."""
    previous = outbound.current_guard()
    outbound.configure(outbound.OutboundGuard(allow_private=True))
    yield
    outbound.configure(previous)


@pytest.fixture(scope="session")
def client(service: ServiceProcess) -> Iterator[httpx.Client]:
    """One client per shared service: building one costs a TLS context (the CA bundle read,
    tenths of a second under load), and the API sets no cookies, so tests cannot leak state
    through it."""
    with httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS)) as http:
        yield http


class ApiCaller:
    """Makes correctly authenticated requests as a given user, or deliberately broken ones."""

    def __init__(self, http: httpx.Client, public_url: str) -> None:
        self.http = http
        self.public_url = public_url

    def call(
        self,
        method: str,
        path: str,
        user: SdkUser | None,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        content = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        sent_headers = {"content-type": "application/json"} if content else {}
        if user is not None:
            sent_headers["authorization"] = user.header(self.public_url + path, method, content)
        sent_headers.update(headers or {})
        return self.http.request(method, path, content=content, headers=sent_headers)

    def register(self, user: SdkUser, **fields: Any) -> httpx.Response:
        body = {"npub": user.npub, "platform": "ios", "device_token": "ab" * 32, **fields}
        return self.call("POST", "/register", user, body)


@pytest.fixture(scope="session")
def api(client: httpx.Client, service: ServiceProcess) -> ApiCaller:
    return ApiCaller(client, service.url)


PROCESS_FIXTURES = frozenset({"workers", "spark"})
"""Fixtures that hand a test processes it starts itself without starting one in their own
code (`workers` collects the test's services, `spark` is the Spark session): a test taking one
is `slow` without saying so. Fixtures and tests that start processes in their code are found by
testkit.slow_marks (README.md, Development)."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`slow` on every test that starts processes or waits on real timers, by the fixtures above,
    Spark (the `spark` marker) or its code (testkit.slow_marks); the tests sharing the
    `spark` session in one xdist group, so one worker starts that JVM (about 1.5 GB, 30 s under
    load). Those running Spark in processes of their own (the CLI, the standalone cluster) go to
    either worker."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        spark = "spark" in names or item.get_closest_marker("spark") is not None
        if spark or names & PROCESS_FIXTURES or (
            item.get_closest_marker("slow") is None and slow_reason(item) is not None
        ):
            item.add_marker(pytest.mark.slow)
        if "spark" in names:
            item.add_marker(pytest.mark.xdist_group("spark"))
