"""/health names a core loop that is down: 503 with JSON `{"status": "degraded", "down": [...]}`
while the supervisor waits to restart it, back to 200 once it runs again. The real service's
components and its own supervisor, on each engine; the ASGI app called in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from sigil_push.api import create_app
from sigil_push.config import parse_config
from sigil_push.service import Service
from tests.fakes.harness import eventually
from tests.support.stores import Engine


async def test_health_is_503_naming_the_task_while_a_core_loop_is_down(
    tmp_path: Path, engine: Engine
) -> None:
    config = parse_config(
        {"server": {"database": engine.database("push.db"), "observations": "observations"}},
        tmp_path / "relays.toml",
    )
    service = Service(config)
    await service.start()
    try:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            failures = 0
            recovered = asyncio.Event()

            async def broken_loop() -> None:
                nonlocal failures
                if failures < 3:
                    failures += 1
                    raise RuntimeError("core loop died")
                await recovered.wait()

            task = service.supervisor.spawn("bridge-commit-probe", broken_loop, core=True)

            async def degraded() -> httpx.Response | None:
                response = await client.get("/health")
                return response if response.status_code == 503 else None

            response = await eventually(degraded, what="503 while the loop is down")
            assert response.json()["status"] == "degraded"
            assert response.json()["down"] == ["bridge-commit-probe"]

            async def healthy() -> bool:
                return (await client.get("/health")).status_code == 200

            await eventually(healthy, what="200 once the loop runs again")
            recovered.set()
            await task
    finally:
        await service.stop()
