"""`RecentlyVerified` is the copy path: on the real network a DM arrives from several relays
within a second, and a copy of an id verified moments ago reuses the verified original instead
of its own body, so it costs a dictionary lookup rather than a parse and a signature check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sigil_push.telemetry.memory_gauges import track

if TYPE_CHECKING:
    from sigil_push.bridge.pending import Arrival
    from sigil_push.nostr.event import Event


class Verified:
    """A verified event, its distinct `p` tag values in order (read once, not again for each
    relay's copy), and whether it was already handed to the committer (then a copy from
    another relay only records that relay's delivery and spends no recipient quota), as
    `arrival` (a copy is folded into it while it waits in the queue)."""

    __slots__ = ("arrival", "enqueued", "event", "tagged")

    def __init__(self, event: Event) -> None:
        self.event = event
        tags = event.tags
        if len(tags) == 1 and len(tags[0]) >= 2 and tags[0][0] == "p":  # nearly every DM
            self.tagged: tuple[str, ...] = (tags[0][1],)
        else:
            self.tagged = tuple(dict.fromkeys(event.tag_values("p")))
        self.enqueued = False
        self.arrival: Arrival | None = None


class RecentlyVerified:
    """The last `size` to `2 * size` verified events by id, in two generations (cheaper than
    an LRU's bookkeeping on the hot path).

    Only events whose id and signature verified are put here, and a copy is matched by id
    alone: whatever body a relay sends along with a known id is ignored, so a relay that
    repeats an id with another content or signature gets nothing of it trusted, only its
    delivery of that id recorded.
    """

    def __init__(self, size: int) -> None:
        self._size = max(1, size)
        self._young: dict[str, Verified] = {}
        self._old: dict[str, Verified] = {}
        track("recently_verified", self, lambda r: len(r._young) + len(r._old))

    def get(self, event_id: str) -> Verified | None:
        found = self._young.get(event_id)
        return found if found is not None else self._old.get(event_id)

    def add(self, event: Event) -> Verified:
        entry = self._young[event.id] = Verified(event)
        if len(self._young) >= self._size:
            self._old, self._young = self._young, {}
        return entry
