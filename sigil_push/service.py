"""The running service: builds every component from the config and starts and stops them together.

Start order follows the data flow backwards (store, log, delivery, then the bridge that feeds
them) so nothing produces work before its consumer exists; stop order is the reverse.
"""

from __future__ import annotations

import enum
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from sigil_push import outbound
from sigil_push.bridge import Bridge
from sigil_push.canary import canary_from_config
from sigil_push.config import Config
from sigil_push.delivery import Delivery
from sigil_push.identity import bridge_key
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.outbound import OutboundGuard
from sigil_push.push import registry
from sigil_push.push.factory import build_senders
from sigil_push.relays.delegated_auth import DelegatedAuth
from sigil_push.store.factory import open_store
from sigil_push.store.interface import (
    AuthIdStore,
    DeviceStore,
    IrisSubscriptionStore,
    OutboxStore,
    Shards,
)
from sigil_push.supervisor import Supervisor

log = logging.getLogger(__name__)

WORKER = Gauge(
    "sigil_push_worker_info", "This process (worker) of the instance and its storage engine",
    ["worker", "engine"],
)


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"


@dataclass
class Components:
    devices: DeviceStore
    auth_ids: AuthIdStore
    outbox: OutboxStore
    observations: ObservationLog
    delivery: Delivery
    key: SecretKey
    bridge: Bridge
    delegated_auth: DelegatedAuth
    iris: IrisSubscriptionStore


class Service:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = State.STARTING
        self._components: Components | None = None
        self._shards: Shards | None = None
        self.worker_id = ""
        self.worker_label = ""
        """The worker id where several workers share the store (their metrics differ by it),
        else empty."""
        self._running = AsyncExitStack()
        self.supervisor = Supervisor()

    @property
    def components(self) -> Components:
        if self._components is None:
            raise RuntimeError("service not started")
        return self._components

    async def start(self) -> None:
        """Start every component; if one fails, those already started are stopped again."""
        async with AsyncExitStack() as starting:
            await self._start_components(starting)
            self._running = starting.pop_all()
        self.state = State.SERVING

    async def _start_components(self, stack: AsyncExitStack) -> None:
        config = self.config
        outbound.configure(OutboundGuard.for_urls(
            config.server.allow_insecure_relays, [relay.url for relay in config.relays]
        ))
        store = await open_store(config)
        stack.push_async_callback(store.close)
        devices, outbox, coordination = store.devices, store.outbox, store.coordination
        await coordination.claim(stack)
        self.worker_id = store.worker_id
        # several workers: each labels its metrics and writes observation files of its own
        # (they may share one folder)
        self.worker_label = store.worker_id if coordination.several_workers else ""
        WORKER.labels(store.worker_id, store.engine).set(1)
        key = await bridge_key(
            store.meta, config.server.secret_key, config.resolve(config.server.secret_key_file)
        )
        await coordination.check_instance_key(key.public_key_hex)
        observations = ObservationLog(
            config.resolve(config.server.observations), config.server.observations_retention_days,
            self.worker_label,
        )
        await observations.start()
        stack.push_async_callback(observations.stop)
        senders = await build_senders(config)
        delivery = Delivery(
            outbox, devices, senders, observations, not config.dry_run, config.push, config.limits,
            self.supervisor, config.iris,
        )
        await delivery.start()
        stack.push_async_callback(delivery.stop)
        delegated_auth = DelegatedAuth(store.signer_sessions, store.auth_modes, key, devices)
        devices.add_listener(delegated_auth.registration_changed)
        await delegated_auth.start()
        stack.push_async_callback(delegated_auth.stop)
        # several workers: a signer session set through one worker reaches the others
        announce = await coordination.share_sessions(delegated_auth.adopt, stack)
        if announce is not None:
            delegated_auth.add_listener(announce)
        bridge = await Bridge.create(
            config, devices, outbox, observations, key, delegated_auth, self.supervisor,
            store.iris,
        )
        stack.push_async_callback(bridge.close)
        devices.add_listener(bridge.registration_changed)
        store.iris.add_listener(bridge.iris_changed)
        devices.add_rules_listener(bridge.rules_changed)
        canary = canary_from_config(config, key, observations)
        if canary is not None:
            bridge.add_probe(canary)
        # several workers: the bridge watches the keys of this worker's shards only
        shards = coordination.shards(bridge.reshard, config.bridge.lease_seconds)
        self._shards = shards
        await shards.start(stack)
        await bridge.start()
        stack.push_async_callback(bridge.stop)
        shards.watching(stack)
        if canary is not None:
            # several workers: only the holder of shard 0 probes, so N workers send one probe
            canary.start(shards.canary_gate())
            stack.push_async_callback(canary.stop)
        self._components = Components(
            devices, store.auth_ids, outbox, observations, delivery, key, bridge, delegated_auth,
            store.iris,
        )
        if config.dry_run:
            tables = [f"[{provider.name}]" for provider in registry.PROVIDERS]
            log.warning(
                "dry-run: no %s or %s configured; wakeups are logged, not sent",
                ", ".join(tables[:-1]), tables[-1],
            )
        log.info("bridge pubkey %s, %d configured relays", key.public_key_hex, len(config.relays))

    async def stop(self) -> None:
        """Stop in reverse start order: the producers first, the store last."""
        self.state = State.STOPPING
        await self._running.aclose()
        self._components = None

    def shards(self) -> list[int] | None:
        """The key shards this worker's bridge watches (None: one worker watches every key)."""
        return self._shards.held() if self._shards is not None else None

    def tasks_down(self) -> dict[str, str]:
        """Core tasks (e.g. `bridge-commit`) waiting to be restarted after an exception, or
        impaired (the committer while the database refuses writes), each with its reason; and
        on several workers, why keys may be unwatched (`Shards.problems`: the store
        unreachable, key shards held by no worker)."""
        down = self.supervisor.reasons()
        if self._shards is not None:
            down.update(self._shards.problems())
        return dict(sorted(down.items()))

    def relay_health(self) -> dict[str, dict[str, Any]]:
        """Per relay: whether it is connected and when it last delivered an event.

        Once the bridge runs it answers, adding its own detail per relay (state, gated, keys)
        and listing the user relays skipped because of `max_relays` with `"state": "skipped"`.
        """
        if self._components is not None:
            return self._components.bridge.health()
        return {
            relay.url: {"connected": False, "last_event_at": None}
            for relay in self.config.relays
            if relay.read
        }
