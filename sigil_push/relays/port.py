"""The relay side's one way up: what the pool and the per-user connections hand the bridge.

Arrows run one way, relays → bridge, and only through this module: `relays/` never imports
`bridge/` (a test checks the import graph). The bridge builds one `BridgePort` from its parts
and gives it to the pool and to the per-user connections; each field is typed by the small
Protocol below that names what the relay side may ask, so "go to definition" on a call such
as `port.ingest.event(...)` lands on `FrameSink.event`, and the port's construction in
`bridge/facade.py` names the part that answers.

A frame goes up as a `Frame` that already carries its subscription context (`RelayFeed`: the
relay, whether it is configured, the REQs it answers); ingest answers with a `Verdict` that
the pool applies to its own subscriptions. Ingest never reads or writes the pool.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sigil_push.nostr.nip77_snapshot import SnapshotItems
from sigil_push.relays.budget import ConnectionBudget


class Subscriptions(Protocol):
    """What ingest may ask of the REQs a frame answered (`RelaySubscriptions`, read only)."""

    @property
    def keys(self) -> Mapping[str, int]: ...

    @property
    def firehose(self) -> bool: ...

    @property
    def streaming(self) -> bool: ...

    def is_baseline(self, sub_id: str, recipient: str) -> bool: ...

    def catching_up(self, sub_id: str, recipient: str) -> bool: ...

    def answering(self, sub_id: str) -> bool: ...


@dataclass(frozen=True, slots=True, eq=False)
class RelayFeed:
    """One shared connection's subscription context, made once when the pool opens the relay
    and carried by every frame from it."""

    url: str
    configured: bool
    """A configured relay: it carries every key, and relay lists are read there."""
    subs: Subscriptions


@dataclass(slots=True)
class Frame:
    """An EVENT frame from a shared connection: its feed, the REQ it answers, when it came."""

    feed: RelayFeed
    sub_id: str
    received_ms: int


@dataclass(slots=True)
class Stored:
    """Verdict: a DM took a place in the answer to REQ `sub_id` (the pool counts it towards
    that REQ's page, so an answer cut short by the relay's limit is paged on)."""

    sub_id: str
    event_id: str
    kind: int
    created_at: int


class Verdict(enum.Enum):
    """What ingest decided about a frame with nothing for the pool to count: `TAKEN`
    (handled), or `UNPARSED` (text frames only: not handled, the connection parses it)."""

    TAKEN = "taken"
    UNPARSED = "unparsed"


Outcome = Stored | Verdict
"""Ingest's answer for one frame: `Stored` is the verdict the pool applies to its REQs."""


class FrameSink(Protocol):
    """Ingest, as the relay side sees it: frames in, verdicts out."""

    def relay_added(self, url: str, budget: ConnectionBudget | None = None) -> None: ...

    def relay_removed(self, url: str) -> None: ...

    def event(self, frame: Frame, raw: Any) -> Outcome: ...

    def text(self, feed: RelayFeed, text: str, received_ms: int) -> Outcome: ...

    def user_event(
        self, url: str, pubkey: str, raw: Any, received_ms: int, baseline: bool,
        budget: ConnectionBudget | None = None,
    ) -> None: ...


class Baselines(Protocol):
    """The relay state the relay side reports to: new baselines and gated relays (what it
    reads of them, the live sets, is the pool's own)."""

    def baselined(self, url: str, keys: frozenset[str]) -> None: ...

    def relay_gated(self, url: str) -> None: ...

    async def stored_relay_state(
        self, url: str, keys: Sequence[str]
    ) -> tuple[set[str], int | None]:
        """For a relay opened again after it was dropped (its state freed): which of `keys`
        the store has baselined there, and its stored cursor."""
        ...


class UserRelays(Protocol):
    """A key's own relays (registration relays and its relay lists): the key registry, as the
    per-user connections read it (they are built after it, with it)."""

    def user_relays(self, pubkey: str) -> frozenset[str]: ...


class FlowControl(Protocol):
    """Back-pressure from the committer's queue, per relay."""

    def congested(self, url: str) -> bool: ...

    async def drained(self, url: str) -> None: ...


class CatchupItems(Protocol):
    """What a relay delivered before, for a negentropy reconciliation (the catch-up ledger)."""

    async def held(
        self, url: str, keys: list[str] | None, since: int
    ) -> tuple[SnapshotItems | None, dict[str, int]]:
        """A stored snapshot of the window (None: none) and event id → created_at beyond it."""
        ...


@dataclass(frozen=True, slots=True)
class BridgePort:
    """Everything the pool and the per-user connections hand up, as named parts."""

    ingest: FrameSink
    baselines: Baselines
    flow: FlowControl
    catchup: CatchupItems
