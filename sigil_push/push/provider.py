"""What a push provider declares about itself, so the rest of the service never names one.

Each provider module (`apns.py`, `fcm.py`, `unifiedpush.py`, and `dryrun.py` for instances
without any) exports one `Provider` value; `registry.py` lists them. Config, validation, the
API and delivery iterate the registry: adding a provider is one module and one registry line.

A declaration is cheap to import: its `create` imports the provider's client library (aioapns,
firebase-admin, pywebpush) only when it runs, which is only when the table is configured.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sigil_push.push.payload import MAX_PAYLOAD_BYTES
from sigil_push.store.records import Device

if TYPE_CHECKING:
    from sigil_push.push.base import Sender

T = TypeVar("T")

Resolve = Callable[[str], Path]
"""`Config.resolve`: a path from the config, relative to the config file's folder."""


@dataclass(frozen=True)
class DeliveryPolicy:
    """How delivery treats a provider's pushes.

    `max_concurrency`: the most sends its client handles well at once (the factory caps
    `push.concurrency_per_provider` to it). `per_host_caps`: its endpoints are user-chosen
    hosts, so each host may hold only a share of the provider's in-flight window, and one slow
    host cannot stall the others. `max_payload_bytes`: its payload limit (what `fits` checks).
    """

    max_concurrency: int
    per_host_caps: bool = False
    max_payload_bytes: int = MAX_PAYLOAD_BYTES


@dataclass(frozen=True)
class Provider(Generic[T]):
    """One push provider: its `relays.toml` table, its platform and everything keyed by them.

    - `name`: the config table's name and the metrics' `provider` label.
    - `platform`: the registration `platform` it serves.
    - `table`: the typed, frozen dataclass of its config table; `validate(table, public_url)`
      checks values beyond their types and returns the table as used (raising ConfigError
      naming the key); `file_keys` are the table's fields naming files that must exist.
    - `parse_token(token)`: the device token's syntax (raising BadRequest
      `invalid_device_token`), returning it as stored.
    - `admit(table, token)`: an optional check at registration that needs I/O (UnifiedPush
      resolves the endpoint's host); `table` is None in dry-run.
    - `webpush_keys`: whether registrations may carry RFC 8291 `keys`.
    - `info(table, resolve)`: extra `/info` fields (UnifiedPush: `vapid_public_key`).
    - `device_fields(device)`: extra fields of each device in `GET /registrations`.
    - `create(table, resolve, timeout_seconds)`: the async constructor of its Sender.
    """

    name: str
    platform: str
    table: type[T]
    parse_token: Callable[[str], str]
    policy: DeliveryPolicy
    create: Callable[[T, Resolve, float], Awaitable[Sender]]
    validate: Callable[[T, str], T] = lambda table, public_url: table
    file_keys: tuple[str, ...] = ()
    admit: Callable[[T | None, str], Awaitable[None]] | None = None
    webpush_keys: bool = False
    info: Callable[[T, Resolve], dict[str, Any]] | None = None
    device_fields: Callable[[Device], dict[str, Any]] | None = None
