"""Typed configuration from `relays.toml`, validated once at start-up.

Every problem is reported as a ConfigError naming the offending key, so the CLI can print one
clear line and exit 2 instead of failing later in some background task. The push providers'
tables are parsed by `push/` (`push.registry.TABLES`), which the CLI hands to `load_config`:
the core config sits below the providers and never imports one, and a provider module
validates its own table with `parse_table` from here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from sigil_push.hosts import is_public_suffix
from sigil_push.nostr.nip19 import InvalidKey, parse_secret_key

DEFAULT_CONFIG = "relays.toml"
CONFIG_ENV = "SIGIL_PUSH_CONFIG"


class ConfigError(Exception):
    """An invalid or unreadable configuration; `key` is the dotted name of the culprit."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


T = TypeVar("T")


def _expected_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = {
            "str": str, "int": int, "bool": bool, "float": float, "tuple[str, ...]": list,
        }[annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return typing.cast(type, annotation)


def parse_table(raw: Any, name: str, cls: type[T]) -> T:
    """Build dataclass `cls` from TOML table `raw`, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(name, "must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{name}.{key}", f"unknown key (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for key, spec in fields.items():
        if key not in raw:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{name}.{key}", "is required")
            continue
        value, expected = raw[key], _expected_type(spec.type)
        valid = isinstance(value, (int, float)) and not isinstance(value, bool) if expected is float else (
            type(value) is expected
        )
        if not valid:
            raise ConfigError(f"{name}.{key}", f"must be a {expected.__name__}")
        if expected in (int, float) and value < 0:
            raise ConfigError(f"{name}.{key}", "must not be negative")
        if expected is list:
            if not all(isinstance(item, str) for item in value):
                raise ConfigError(f"{name}.{key}", "must be a list of strings")
            value = tuple(value)
        values[key] = float(value) if expected is float else value
    return cls(**values)


def check_http_url(key: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, "must be an http:// or https:// URL")


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    public_url: str = "http://127.0.0.1:8080"
    database: str = "sigil-push.db"
    observations: str = "observations"
    secret_key: str = ""
    allow_insecure_relays: bool = False
    # hourly observation files older than this are deleted; 0 keeps them forever
    observations_retention_days: int = 30

    admin_listen: str = ""
    trusted_proxies: tuple[str, ...] = ()
    secret_key_file: str = "bridge.key"

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


@dataclass(frozen=True)
class RelayConfig:
    url: str
    read: bool = True
    # "filtered" (#p shards), "firehose" (kinds 4/1059 with no #p, matched locally) or "auto"
    # (firehose above bridge.firehose_above_keys keys on this relay)
    mode: str = "auto"


RELAY_MODES = ("filtered", "firehose", "auto")


@dataclass(frozen=True)
class LimitsConfig:
    """Abuse limits; 0 disables a limit."""

    requests_per_minute_per_ip: int = 120
    requests_per_minute_per_npub: int = 30
    devices_per_npub: int = 10
    # npubs that may register one device token (several accounts on one phone)
    accounts_per_device: int = 20
    wakeups_per_minute_per_device: int = 30
    coalesce_window_ms: int = 2000


@dataclass(frozen=True)
class BridgeConfig:
    """Relay-side tuning (an addition to the contract's tables)."""

    keys_per_filter: int = 500
    max_relays: int = 200
    catchup_seconds: int = 3 * 24 * 3600
    seen_retention_seconds: int = 3 * 24 * 3600
    seen_cache_size: int = 100_000
    reconnect_min_seconds: float = 1.0
    reconnect_max_seconds: float = 300.0
    # a ping after this long without any data from a relay; no pong (or data) within half of it
    # drops the socket: a dead connection is noticed within 1.5 times this, an idle one kept alive
    relay_heartbeat_seconds: float = 30.0
    # the most a websocket handshake with a relay may take (NIP-11 fetch apart)
    relay_open_timeout_seconds: float = 10.0
    # per-user connections to gated inboxes (delegated NIP-42 AUTH), one per (relay, user)
    max_user_connections: int = 1000
    # our own websocket receive limit per frame; a relay's NIP-11 never raises it
    max_frame_bytes: int = 4 * 1024 * 1024
    # a configured relay in mode "auto" switches from #p shards to the firehose above this
    firehose_above_keys: int = 2000
    # PostgreSQL: a dead worker's key shards move to the others within this time
    lease_seconds: float = 15.0
    # catch up with NIP-77 (negentropy) on relays that answer it; false: paged REQ only
    negentropy: bool = True
    # a public event (kinds 1, 6, 7, 16) naming more keys than this wakes no one ("crowded");
    # 0: no limit
    max_p_tags: int = 10
    # mentions, reposts, reactions and zaps older than this are not pushed ("stale"), nor
    # caught up further back: a number and a unit, s, m, h or d
    stale_after: str = "1h"

    @property
    def stale_after_seconds(self) -> int:
        return duration_seconds(self.stale_after)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
MAX_STALE_AFTER_SECONDS = 2 * 24 * 3600


def duration_seconds(text: str) -> int:
    """"90m", "1h", "3600s", "2d" (or bare seconds) as seconds; ValueError when malformed."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _DURATION_UNITS else (text, "s")
    if not number.isdigit() or len(number) > 9:
        raise ValueError(text)
    return int(number) * _DURATION_UNITS[unit]


STOP_GRACE_SECONDS = 5.0
"""How long delivery waits at shutdown for sends in flight. Here, low, because two layers need
it: delivery (its stop) and the store (an outbox claim outlives a send by this much)."""


@dataclass(frozen=True)
class PushConfig:
    """Delivery tuning (an addition to the contract's tables)."""

    max_wakeup_age_seconds: int = 3600
    send_timeout_seconds: float = 10.0
    concurrency_per_provider: int = 256
    max_attempts: int = 12
    retry_base_seconds: float = 2.0
    retry_max_seconds: float = 300.0


@dataclass(frozen=True)
class CanaryConfig:
    """Relay probes (sigil_push/canary.py). `relays` empty: the configured read relays."""

    enabled: bool = True
    interval_seconds: float = 300.0
    relays: tuple[str, ...] = ()
    # 0600 file holding the canary's secret key, generated on first start
    key_file: str = "canary.key"


DEFAULT_BROWSER_PUSH_SERVICES = (
    "fcm.googleapis.com", "updates.push.services.mozilla.com", "web.push.apple.com",
    "*.notify.windows.com",
)
"""The push services of Chrome (and Edge, Brave, Opera), Firefox, Safari and Edge on Windows
(WNS, regional subdomains): where nearly every browser's Web Push endpoint is."""
MAX_BROWSER_PUSH_SERVICES = 100
_HOST_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
MAX_HOST_NAME = 253


@dataclass(frozen=True)
class IrisConfig:
    """The Iris-compatible API (CONTRACT 3b, sigil_push/http/iris.py). On unless `enabled = false`."""

    enabled: bool = True
    # a push's "url": this, then the event's note1 id (the page Iris opens on a click)
    notification_url: str = "https://iris.to/"
    # Web Push hosts exempt from the per-host share of in flight pushes: operated services,
    # not user-chosen hosts that could hang ("*.domain": any name under it, not it)
    browser_push_services: tuple[str, ...] = DEFAULT_BROWSER_PUSH_SERVICES


@dataclass(frozen=True)
class WebhooksConfig:
    """`webhooks` in Iris subscriptions: refused unless the table is there and enabled."""

    enabled: bool = True
    # true only for tests: permits loopback/private hosts and plain http:// webhook URLs
    allow_private_endpoints: bool = False



@dataclass(frozen=True)
class Config:
    path: Path
    server: ServerConfig
    relays: tuple[RelayConfig, ...]
    # the configured providers' tables by provider name (parsed by push/registry.py's TABLES);
    # none: dry-run
    providers: dict[str, Any] = field(default_factory=dict)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    push: PushConfig = field(default_factory=PushConfig)
    canary: CanaryConfig | None = None
    iris: IrisConfig = field(default_factory=IrisConfig)
    webhooks: WebhooksConfig | None = None

    @property
    def webhooks_enabled(self) -> bool:
        return self.webhooks is not None and self.webhooks.enabled

    @property
    def dry_run(self) -> bool:
        """No provider configured: wakeups are logged instead of sent."""
        return not self.providers

    def resolve(self, relative: str) -> Path:
        """Paths in the config are relative to the config file's folder."""
        candidate = Path(relative).expanduser()
        return candidate if candidate.is_absolute() else self.path.parent / candidate


def _check_listen(listen: str, key: str = "server.listen") -> None:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, "must be host:port, e.g. 127.0.0.1:8080")


def _check_relay_url(key: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ConfigError(key, "must be a ws:// or wss:// URL")


POSTGRES_SCHEMES = ("postgresql", "postgres")


def is_postgres_url(database: str) -> bool:
    """True when `server.database` names a PostgreSQL server rather than a SQLite file."""
    return urlsplit(database).scheme in POSTGRES_SCHEMES


def _check_database(database: str) -> None:
    """A path (SQLite) or a postgresql:// URL; any other scheme is refused, never taken as a
    file name (a Windows drive letter such as C:\\ is a path, not a scheme)."""
    if not database:
        raise ConfigError("server.database", "must not be empty")
    scheme = urlsplit(database).scheme
    if "://" in database and scheme not in POSTGRES_SCHEMES:
        raise ConfigError(
            "server.database",
            f"unsupported URL scheme {scheme!r}: use a SQLite file path or a postgresql:// URL",
        )

MIN_CANARY_INTERVAL_SECONDS = 1.0


def _canary(raw: Any) -> CanaryConfig:
    """The `[canary]` table; `relays` is a list, which `parse_table`'s scalar checks do not cover."""
    if not isinstance(raw, dict):
        raise ConfigError("canary", "must be a table")
    relays = raw.get("relays", [])
    if not isinstance(relays, list) or not all(isinstance(url, str) for url in relays):
        raise ConfigError("canary.relays", "must be a list of ws:// or wss:// URLs")
    for url in relays:
        _check_relay_url("canary.relays", url)
    canary = parse_table({k: v for k, v in raw.items() if k != "relays"}, "canary", CanaryConfig)
    if canary.interval_seconds < MIN_CANARY_INTERVAL_SECONDS:
        raise ConfigError("canary.interval_seconds", "must be at least 1")
    if not canary.key_file:
        raise ConfigError("canary.key_file", "must not be empty")
    return dataclasses.replace(canary, relays=tuple(dict.fromkeys(relays)))


class ProviderTables(Protocol):
    """What the core config needs of the push providers' tables (implemented by
    `push.registry.TABLES`): their names, so an unknown table is still reported, and their
    parsing, into the `Config.providers` dict."""

    @property
    def names(self) -> Collection[str]: ...

    def parse(
        self, document: dict[str, Any], public_url: str, resolve: Callable[[str], Path]
    ) -> dict[str, Any]:
        """The configured providers' tables by name, validated (ConfigError naming the key)."""
        ...


class _NoProviders:
    names: tuple[str, ...] = ()

    def parse(
        self, document: dict[str, Any], public_url: str, resolve: Callable[[str], Path]
    ) -> dict[str, Any]:
        return {}


NO_PROVIDERS: ProviderTables = _NoProviders()
"""A config without provider tables (dry-run): what the store and bridge tools parse."""


def _check_push_service(entry: str) -> None:
    """A browser push service: a lowercase host name (A-labels, two labels or more, not an
    address), or `*.` and one that is not a public suffix (which would exempt every host
    anyone may register under it, a tarpit included)."""
    key = "iris.browser_push_services"
    name = entry.removeprefix("*.")
    labels = name.split(".")
    if len(name) > MAX_HOST_NAME or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(key, f"{entry[:80]!r} is not a lowercase host name or '*.' and one")
    if entry.startswith("*.") and is_public_suffix(name):
        raise ConfigError(key, f"{entry!r} would exempt every host under a public suffix")
    if len(labels) < 2:
        raise ConfigError(key, f"{entry!r} is not a lowercase host name or '*.' and one")
    if labels[-1].isdigit():
        raise ConfigError(key, f"{entry!r} is an address, not a push service's name")


def _iris(raw: Any) -> IrisConfig:
    iris = parse_table(raw, "iris", IrisConfig)
    check_http_url("iris.notification_url", iris.notification_url)
    if len(iris.browser_push_services) > MAX_BROWSER_PUSH_SERVICES:
        raise ConfigError(
            "iris.browser_push_services", f"at most {MAX_BROWSER_PUSH_SERVICES} hosts"
        )
    for entry in iris.browser_push_services:
        _check_push_service(entry)
    return iris


def parse_config(
    document: dict[str, Any], path: Path, providers: ProviderTables = NO_PROVIDERS
) -> Config:
    """Validate a parsed TOML document into a Config; `providers` parses the push providers'
    tables (`push.registry.TABLES`; without it a provider table is an unknown table)."""
    known = {"server", "relay", "limits", "bridge", "push", "canary", "iris", "webhooks"}
    known.update(providers.names)
    for key in document:
        if key not in known:
            raise ConfigError(key, f"unknown table (known: {', '.join(sorted(known))})")
    server = parse_table(document.get("server", {}), "server", ServerConfig)
    _check_listen(server.listen)
    _check_database(server.database)

    if server.admin_listen:
        _check_listen(server.admin_listen, "server.admin_listen")
        if server.admin_listen == server.listen:
            raise ConfigError("server.admin_listen", "must differ from server.listen")
    for proxy in server.trusted_proxies:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            raise ConfigError("server.trusted_proxies", f"not an address or CIDR: {proxy[:60]}") from None
    if server.secret_key:
        try:
            parse_secret_key(server.secret_key)
        except InvalidKey as exc:
            raise ConfigError("server.secret_key", str(exc)) from None
    check_http_url("server.public_url", server.public_url)
    if server.public_url.endswith("/"):
        raise ConfigError("server.public_url", "must not end with '/'")
    raw_relays = document.get("relay", [])
    if not isinstance(raw_relays, list):
        raise ConfigError("relay", "must be an array of tables ([[relay]])")
    relays = tuple(parse_table(item, f"relay[{i}]", RelayConfig) for i, item in enumerate(raw_relays))
    for i, relay in enumerate(relays):
        _check_relay_url(f"relay[{i}].url", relay.url)
        if relay.mode not in RELAY_MODES:
            raise ConfigError(f"relay[{i}].mode", "must be 'filtered', 'firehose' or 'auto'")
    limits = parse_table(document.get("limits", {}), "limits", LimitsConfig)
    bridge = parse_table(document.get("bridge", {}), "bridge", BridgeConfig)
    for key in ("relay_heartbeat_seconds", "relay_open_timeout_seconds"):
        if getattr(bridge, key) <= 0:
            raise ConfigError(f"bridge.{key}", "must be positive")
    if bridge.max_p_tags < 0:
        raise ConfigError("bridge.max_p_tags", "must be 0 (no limit) or more")
    try:
        stale = bridge.stale_after_seconds
    except ValueError:
        raise ConfigError(
            "bridge.stale_after", 'must be a number and a unit (s, m, h, d), like "1h"'
        ) from None
    if not 0 < stale <= MAX_STALE_AFTER_SECONDS:
        raise ConfigError("bridge.stale_after", "must be more than 0 and at most 2 days")
    config = Config(
        path=path,
        server=server,
        relays=relays,
        limits=limits,
        bridge=bridge,
        push=parse_table(document.get("push", {}), "push", PushConfig),
        canary=_canary(document["canary"]) if "canary" in document else None,
        iris=_iris(document.get("iris", {})),
        webhooks=(
            parse_table(document["webhooks"], "webhooks", WebhooksConfig)
            if "webhooks" in document else None
        ),
    )
    return dataclasses.replace(
        config, providers=providers.parse(document, server.public_url, config.resolve)
    )


def config_path(cli_value: str | None) -> Path:
    """`--config`, else $SIGIL_PUSH_CONFIG, else ./relays.toml."""
    return Path(cli_value or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG).resolve()


def load_config(path: Path, providers: ProviderTables = NO_PROVIDERS) -> Config:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path} is not valid TOML: {exc}") from None
    return parse_config(document, path, providers)
