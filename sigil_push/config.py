"""Typed configuration from `relays.toml`, validated once at start-up.

Every problem is reported as a ConfigError naming the offending key, so the CLI can print one
clear line and exit 2 instead of failing later in some background task.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sigil_push.nostr.nip19 import InvalidKey, parse_secret_key

DEFAULT_CONFIG = "relays.toml"
CONFIG_ENV = "SIGIL_PUSH_CONFIG"


class ConfigError(Exception):
    """An invalid or unreadable configuration; `key` is the dotted name of the culprit."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


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
class ApnsConfig:
    team_id: str
    key_id: str
    key_file: str
    topic: str
    environment: str = "production"
    endpoint: str = ""
    ca_file: str = ""


@dataclass(frozen=True)
class FcmConfig:
    credentials_file: str
    endpoint: str = ""


@dataclass(frozen=True)
class UnifiedPushConfig:
    allow_private_endpoints: bool = False
    # RFC 8292 P-256 key (PEM, or the raw base64url private key web-push tools print);
    # generated 0600 on first start when the file does not exist
    vapid_private_key_file: str = "vapid.pem"
    # the JWT `sub` contact; empty: server.public_url when that is an https:// origin
    vapid_subject: str = ""


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
    # per-user connections to gated inboxes (delegated NIP-42 AUTH), one per (relay, user)
    max_user_connections: int = 1000
    # our own websocket receive limit per frame; a relay's NIP-11 never raises it
    max_frame_bytes: int = 4 * 1024 * 1024
    # a configured relay in mode "auto" switches from #p shards to the firehose above this
    firehose_above_keys: int = 2000
    # PostgreSQL: a dead worker's key shards move to the others within this time
    lease_seconds: float = 15.0


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


@dataclass(frozen=True)
class Config:
    path: Path
    server: ServerConfig
    relays: tuple[RelayConfig, ...]
    apns: ApnsConfig | None = None
    fcm: FcmConfig | None = None
    unifiedpush: UnifiedPushConfig | None = None
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    push: PushConfig = field(default_factory=PushConfig)
    canary: CanaryConfig | None = None

    @property
    def dry_run(self) -> bool:
        """No provider configured: wakeups are logged instead of sent."""
        return self.apns is None and self.fcm is None and self.unifiedpush is None

    @property
    def platforms(self) -> list[str]:
        """Platforms this instance accepts registrations for."""
        if self.dry_run:
            return ["ios", "android", "unifiedpush"]
        enabled = [("ios", self.apns), ("android", self.fcm), ("unifiedpush", self.unifiedpush)]
        return [name for name, table in enabled if table is not None]

    def resolve(self, relative: str) -> Path:
        """Paths in the config are relative to the config file's folder."""
        candidate = Path(relative).expanduser()
        return candidate if candidate.is_absolute() else self.path.parent / candidate


T = TypeVar("T")


def _expected_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = {
            "str": str, "int": int, "bool": bool, "float": float, "tuple[str, ...]": list,
        }[annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return typing.cast(type, annotation)


def _table(raw: Any, name: str, cls: type[T]) -> T:
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


def _check_listen(listen: str, key: str = "server.listen") -> None:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, "must be host:port, e.g. 127.0.0.1:8080")


def _check_http_url(key: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, "must be an http:// or https:// URL")


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
    """The `[canary]` table; `relays` is a list, which `_table`'s scalar checks do not cover."""
    if not isinstance(raw, dict):
        raise ConfigError("canary", "must be a table")
    relays = raw.get("relays", [])
    if not isinstance(relays, list) or not all(isinstance(url, str) for url in relays):
        raise ConfigError("canary.relays", "must be a list of ws:// or wss:// URLs")
    for url in relays:
        _check_relay_url("canary.relays", url)
    canary = _table({k: v for k, v in raw.items() if k != "relays"}, "canary", CanaryConfig)
    if canary.interval_seconds < MIN_CANARY_INTERVAL_SECONDS:
        raise ConfigError("canary.interval_seconds", "must be at least 1")
    if not canary.key_file:
        raise ConfigError("canary.key_file", "must not be empty")
    return dataclasses.replace(canary, relays=tuple(dict.fromkeys(relays)))


_MAILTO = re.compile(r"mailto:[^@\s]+@(localhost|[\w%-]+(\.[\w%-]+)+)", re.IGNORECASE)
_HTTPS_ORIGIN = re.compile(r"https://(localhost|[\w-]+(\.[\w-]+)+)", re.IGNORECASE)


def is_vapid_subject(value: str) -> bool:
    """A contact autopush and py-vapid accept as the VAPID `sub`: `mailto:name@domain`, or an
    `https://` origin (scheme and host only: py-vapid refuses a port or a path)."""
    return bool(_MAILTO.fullmatch(value) or _HTTPS_ORIGIN.fullmatch(value))


def _unifiedpush(raw: Any, public_url: str) -> UnifiedPushConfig:
    """The `[unifiedpush]` table, with `vapid_subject` resolved to the contact that is sent.

    Distributors behind autopush refuse a JWT without `sub`, and some push services refuse one
    they cannot reach, so no made-up address is ever filled in: the default is the instance's
    own public URL when that is an https:// origin, and otherwise the key must be set.
    """
    table = _table(raw, "unifiedpush", UnifiedPushConfig)
    if not table.vapid_private_key_file:
        raise ConfigError("unifiedpush.vapid_private_key_file", "must not be empty")
    subject = table.vapid_subject
    if not subject:
        if not is_vapid_subject(public_url):
            raise ConfigError(
                "unifiedpush.vapid_subject",
                "is required unless server.public_url is an https:// origin:"
                " set a contact such as mailto:ops@example.org",
            )
        subject = public_url
    elif not is_vapid_subject(subject):
        raise ConfigError(
            "unifiedpush.vapid_subject",
            "must be mailto:name@domain or an https:// origin such as https://push.example.org",
        )
    return dataclasses.replace(table, vapid_subject=subject)


def parse_config(document: dict[str, Any], path: Path) -> Config:
    """Validate a parsed TOML document into a Config."""
    known = {"server", "relay", "apns", "fcm", "unifiedpush", "limits", "bridge", "push", "canary"}
    for key in document:
        if key not in known:
            raise ConfigError(key, f"unknown table (known: {', '.join(sorted(known))})")
    server = _table(document.get("server", {}), "server", ServerConfig)
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
    _check_http_url("server.public_url", server.public_url)
    if server.public_url.endswith("/"):
        raise ConfigError("server.public_url", "must not end with '/'")
    raw_relays = document.get("relay", [])
    if not isinstance(raw_relays, list):
        raise ConfigError("relay", "must be an array of tables ([[relay]])")
    relays = tuple(_table(item, f"relay[{i}]", RelayConfig) for i, item in enumerate(raw_relays))
    for i, relay in enumerate(relays):
        _check_relay_url(f"relay[{i}].url", relay.url)
        if relay.mode not in RELAY_MODES:
            raise ConfigError(f"relay[{i}].mode", "must be 'filtered', 'firehose' or 'auto'")
    apns = _table(document["apns"], "apns", ApnsConfig) if "apns" in document else None
    if apns is not None:
        if apns.environment not in ("production", "sandbox"):
            raise ConfigError("apns.environment", "must be 'production' or 'sandbox'")
        if apns.endpoint:
            _check_http_url("apns.endpoint", apns.endpoint)
    fcm = _table(document["fcm"], "fcm", FcmConfig) if "fcm" in document else None
    if fcm is not None and fcm.endpoint:
        _check_http_url("fcm.endpoint", fcm.endpoint)
    unifiedpush = (
        _unifiedpush(document["unifiedpush"], server.public_url)
        if "unifiedpush" in document
        else None
    )
    config = Config(
        path=path,
        server=server,
        relays=relays,
        apns=apns,
        fcm=fcm,
        unifiedpush=unifiedpush,
        limits=_table(document.get("limits", {}), "limits", LimitsConfig),
        bridge=_table(document.get("bridge", {}), "bridge", BridgeConfig),
        push=_table(document.get("push", {}), "push", PushConfig),
        canary=_canary(document["canary"]) if "canary" in document else None,
    )
    for key, relative in (
        ("apns.key_file", apns.key_file if apns else ""),
        ("apns.ca_file", apns.ca_file if apns else ""),
        ("fcm.credentials_file", fcm.credentials_file if fcm else ""),
    ):
        if relative and not config.resolve(relative).is_file():
            raise ConfigError(key, f"file not found: {config.resolve(relative)}")
    return config


def config_path(cli_value: str | None) -> Path:
    """`--config`, else $SIGIL_PUSH_CONFIG, else ./relays.toml."""
    return Path(cli_value or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG).resolve()


def load_config(path: Path) -> Config:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path} is not valid TOML: {exc}") from None
    return parse_config(document, path)
