"""/health names a core loop that is down: 503 with JSON `{"status": "degraded", "down": [...]}`
while the supervisor waits to restart it, back to 200 once it runs again. The real service's
components and its own supervisor, on each engine; the ASGI app called in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from sigil_push.config import Config, parse_config
from sigil_push.http.api import create_admin_app, create_app
from sigil_push.service import Service
from testkit.fakes.harness import eventually
from testkit.stores import Engine


async def test_health_is_503_naming_the_task_while_a_core_loop_is_down(
    tmp_path: Path, engine: Engine
) -> None:
    config = parse_config(
        {"server": {"database": engine.database("push.db"), "observations": "observations"}},
        tmp_path / "relays.toml",
    )
    await _story(config)


async def test_with_an_admin_listener_only_the_admin_health_names_the_down_task(
    tmp_path: Path,
) -> None:
    """The public listener then answers the status alone (CONTRACT): which loop is down, and
    why, is the operator's detail."""
    config = parse_config(
        {"server": {"database": str(tmp_path / "push.db"), "observations": "observations",
                    "admin_listen": "127.0.0.1:9464"}},
        tmp_path / "relays.toml",
    )
    await _story(config)


async def _story(config: Config) -> None:
    service = Service(config)
    await service.start()
    try:
        split = bool(config.server.admin_listen)
        admin_app = create_admin_app(service) if split else create_app(service)
        public = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                   base_url="http://test")
        admin = httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                  base_url="http://test")
        async with public, admin:
            assert (await public.get("/health")).status_code == 200
            failures = 0
            recovered = asyncio.Event()

            async def broken_loop() -> None:
                nonlocal failures
                if failures < 3:
                    failures += 1
                    raise RuntimeError("core loop died")
                await recovered.wait()

            task = service.supervisor.spawn("bridge-commit-probe", broken_loop, core=True)

            async def degraded() -> tuple[httpx.Response, httpx.Response] | None:
                detail, status_only = await admin.get("/health"), await public.get("/health")
                both_down = detail.status_code == status_only.status_code == 503
                return (detail, status_only) if both_down else None

            detail, status_only = await eventually(degraded, what="503 while the loop is down")
            assert detail.json()["status"] == "degraded"
            assert detail.json()["down"] == ["bridge-commit-probe"]
            assert set(detail.json()["reasons"]) == {"bridge-commit-probe"}
            if split:
                assert status_only.json() == {"status": "degraded"}
            else:
                assert status_only.json() == detail.json()

            async def healthy() -> bool:
                return (await admin.get("/health")).status_code == 200

            await eventually(healthy, what="200 once the loop runs again")
            recovered.set()
            await task
    finally:
        await service.stop()
