"""A provider is one module: its registry entry is all that config, validation, the API and
delivery need to know about it.

These stories iterate `sigil_push.push.registry` rather than naming providers, so a provider
added there is checked by them without a line changed here.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from sigil_push import config as config_module
from sigil_push.config import Config, ConfigError, parse_config
from sigil_push.errors import BadRequest
from sigil_push.http.api import create_app
from sigil_push.http.validation import parse_device_token, parse_platform, parse_webpush_keys
from sigil_push.push import metrics, registry
from sigil_push.push.factory import build_senders
from sigil_push.push.provider import Provider
from sigil_push.push.registry import TABLES
from sigil_push.service import Service
from testkit.deadlines import COMMAND_SECONDS, scaled
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.harness import Credentials, provider_tables

PUBLIC_URL = "https://push.example.org"
"""An https:// origin, so a table may leave a VAPID-like contact to its default."""


def minimal_table(provider: Provider[Any], folder: Path) -> dict[str, Any]:
    """The smallest table the provider's dataclass accepts: its required keys only, file keys
    naming files that exist (config checks existence, not content)."""
    table: dict[str, Any] = {}
    for spec in dataclasses.fields(provider.table):
        if spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING:
            continue
        if spec.name in provider.file_keys:
            path = folder / f"{provider.name}-{spec.name}"
            path.write_text("placeholder")
            table[spec.name] = str(path)
        else:
            table[spec.name] = "X"
    return table


def config_with(providers: tuple[Provider[Any], ...], folder: Path) -> Config:
    document: dict[str, Any] = {"server": {"public_url": PUBLIC_URL}}
    document.update({p.name: minimal_table(p, folder) for p in providers})
    return parse_config(document, folder / "relays.toml", TABLES)


def test_every_config_key_has_its_readme_entry() -> None:
    """Each key of each table, the providers' included, has its row in README's table."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    tables: dict[str, Any] = {
        "server": config_module.ServerConfig, "limits": config_module.LimitsConfig,
        "bridge": config_module.BridgeConfig, "push": config_module.PushConfig,
        "canary": config_module.CanaryConfig,
    }
    tables.update({provider.name: provider.table for provider in registry.PROVIDERS})
    keys = [f"`{name}.{spec.name}`" for name, table in tables.items() for spec in dataclasses.fields(table)]
    keys += [f"`[[relay]] {spec.name}`" for spec in dataclasses.fields(config_module.RelayConfig)]
    assert [key for key in keys if key not in readme] == []


def test_every_platform_has_a_complete_declaration() -> None:
    """Each entry names a platform of its own, a typed frozen config table whose file keys are
    its fields, a token check, a factory and a delivery policy, and has metric series."""
    names = [p.name for p in registry.PROVIDERS]
    assert len(set(names)) == len(names) and len(set(registry.PLATFORMS)) == len(registry.PLATFORMS)
    assert registry.PLATFORMS == tuple(p.platform for p in registry.PROVIDERS)
    assert set(registry.PROVIDER_NAMES) == {*names, *registry.IRIS_SENDERS, "dryrun"}
    for provider in registry.PROVIDERS:
        assert dataclasses.is_dataclass(provider.table)
        assert provider.table.__dataclass_params__.frozen  # type: ignore[attr-defined]
        fields = {spec.name for spec in dataclasses.fields(provider.table)}
        assert set(provider.file_keys) <= fields, provider.name
        assert callable(provider.parse_token) and callable(provider.create)
        assert provider.policy.max_concurrency >= 1 and provider.policy.max_payload_bytes > 0
        assert registry.by_platform(provider.platform) is provider
        assert registry.policy(provider.name) is provider.policy
    for name in registry.PROVIDER_NAMES:
        assert metrics.PUSHES.labels(name, "accepted") is not None
        assert registry.policy(name).max_concurrency >= 1


@pytest.mark.parametrize("provider", registry.PROVIDERS, ids=lambda p: p.name)
def test_a_table_is_parsed_and_checked_by_its_provider(tmp_path: Path, provider: Provider[Any]) -> None:
    """`[name]` becomes the provider's typed table and enables exactly its platform; an
    unknown key or a missing file is one ConfigError naming `name.key`."""
    config = config_with((provider,), tmp_path)
    assert isinstance(registry.table(config, provider), provider.table)
    assert registry.platforms(config) == [provider.platform] and not config.dry_run

    document = {"server": {"public_url": PUBLIC_URL},
                provider.name: {**minimal_table(provider, tmp_path), "no_such_key": 1}}
    with pytest.raises(ConfigError) as unknown:
        parse_config(document, tmp_path / "relays.toml", TABLES)
    assert unknown.value.key == f"{provider.name}.no_such_key"

    for key in provider.file_keys:
        missing = {"server": {"public_url": PUBLIC_URL},
                   provider.name: {**minimal_table(provider, tmp_path), key: "absent.file"}}
        with pytest.raises(ConfigError) as absent:
            parse_config(missing, tmp_path / "relays.toml", TABLES)
        assert absent.value.key == f"{provider.name}.{key}"


@pytest.mark.parametrize("provider", registry.PROVIDERS, ids=lambda p: p.name)
def test_registration_checks_a_token_by_its_platforms_provider(provider: Provider[Any]) -> None:
    """The platform is one of the registry's; its token goes through that provider's check,
    and WebPush keys are accepted only where the provider declares them."""
    assert parse_platform(provider.platform) == provider.platform
    with pytest.raises(BadRequest) as bad:
        parse_device_token("!", provider.platform)
    assert bad.value.code == "invalid_device_token"
    subscriber = WebPushSubscriber.generate()
    keys = {"p256dh": subscriber.p256dh, "auth": subscriber.auth}
    if provider.webpush_keys:
        assert parse_webpush_keys(keys, provider.platform) is not None
    else:
        with pytest.raises(BadRequest):
            parse_webpush_keys(keys, provider.platform)
    with pytest.raises(BadRequest) as unknown:
        parse_platform("no-such-platform")
    assert unknown.value.code == "invalid_platform"


SUBSETS = [
    combination
    for size in range(len(registry.PROVIDERS) + 1)
    for combination in itertools.combinations(registry.PROVIDERS, size)
]


@pytest.mark.parametrize("providers", SUBSETS, ids=lambda ps: "+".join(p.name for p in ps) or "dry-run")
async def test_info_lists_exactly_the_configured_platforms(
    tmp_path: Path, providers: tuple[Provider[Any], ...]
) -> None:
    """`/info` names the configured providers' platforms in registry order (every platform in
    dry-run) and carries a provider's extra fields only when that provider is configured."""
    config = config_with(providers, tmp_path)
    transport = httpx.ASGITransport(create_app(Service(config)))  # no lifespan: not serving
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        info = (await client.get("/info")).json()

    expected = [p.platform for p in providers] or list(registry.PLATFORMS)
    assert info["platforms"] == expected
    assert info["dry_run"] is (not providers)
    extras = {key for p in providers if p.info is not None
              for key in p.info(registry.table(config, p), config.resolve)}
    standard = {"name", "version", "platforms", "relays", "pubkey", "dry_run"}
    assert set(info) - standard == extras
    assert all(info[key] is None for key in extras), "extras are published once serving"


async def test_the_factory_builds_each_configured_provider_from_its_entry(
    tmp_path: Path, credentials: Credentials, fake_apns: FakeApns, fake_fcm_server: tuple[FakeFcm, Path]
) -> None:
    """One sender per registry entry configured, keyed by its platform and carrying its name
    and policy, plus the Iris browser targets' Web Push sender (with UnifiedPush's VAPID
    identity; webhooks only with `[webhooks]`); dry-run builds a logging sender for every
    platform and Iris's."""
    tables = provider_tables(credentials, fake_apns, fake_fcm_server)
    assert set(tables) == {p.name for p in registry.PROVIDERS}, "the fakes cover every provider"
    config = parse_config({"server": {"public_url": PUBLIC_URL}, **tables}, tmp_path / "relays.toml", TABLES)
    senders = await build_senders(config)
    try:
        assert list(senders) == [*registry.PLATFORMS, "webpush"]
        assert senders["webpush"].provider == "webpush"
        for provider in registry.PROVIDERS:
            sender = senders[provider.platform]
            assert (sender.platform, sender.provider) == (provider.platform, provider.name)
            assert sender.max_concurrency == min(
                config.push.concurrency_per_provider, provider.policy.max_concurrency
            )
    finally:
        for sender in senders.values():
            await sender.close()

    dry = await build_senders(parse_config({"webhooks": {}}, tmp_path / "relays.toml"))
    assert list(dry) == [*registry.PLATFORMS, *registry.IRIS_SENDERS]
    assert {s.provider for s in dry.values()} == {"dryrun"}
    without_iris = parse_config({"iris": {"enabled": False}}, tmp_path / "relays.toml")
    assert list(await build_senders(without_iris)) == list(registry.PLATFORMS)


CLIENT_LIBRARIES = {"apns": "aioapns", "fcm": "firebase_admin", "unifiedpush": "pywebpush"}
"""What each provider's `create` loads; checked against the registry below."""


def test_a_providers_client_library_loads_only_when_its_table_is_configured(tmp_path: Path) -> None:
    """The service's modules (config, API, service, factory) import every declaration but no
    provider's client library; building the senders of a dry-run instance loads none either.
    Run in a fresh interpreter, since this test session has loaded them all."""
    assert set(CLIENT_LIBRARIES) == {p.name for p in registry.PROVIDERS}
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "import sigil_push.http.api, sigil_push.cli, sigil_push.service\n"
        "from sigil_push.config import parse_config\n"
        "from sigil_push.push.factory import build_senders\n"
        f"config = parse_config({{}}, Path({str(tmp_path / 'relays.toml')!r}))\n"
        "senders = asyncio.run(build_senders(config))\n"
        "print(len(senders), *sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *CLIENT_LIBRARIES.values()],
        capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS), check=False,
    )
    assert result.returncode == 0, result.stderr
    # dry-run: one logging sender per platform, and one for Iris's browser targets
    assert result.stdout.split() == [str(len(registry.PLATFORMS) + 1)]
