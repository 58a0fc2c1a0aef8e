"""NIP-57 zaps: who a zap receipt (kind 9735) says zapped.

A receipt is signed by the recipient's LNURL server, not by the zapper; the zapper is the
author of the zap request (kind 9734) whose JSON the receipt carries in its `description`
tag. That request is attacker-controlled text inside a verified event: it is bounded, parsed
and signature-checked here, and anything short of a valid 9734 makes the zap anonymous (mute
and follows-only then do not apply to it), with the reason counted by the caller.
"""

from __future__ import annotations

import orjson

from sigil_push.nostr.event import Event, InvalidEvent
from sigil_push.nostr.kinds import ZAP_REQUEST

MAX_DESCRIPTION_BYTES = 16 * 1024
"""A zap request is a small event (a few hundred bytes); a longer description is refused
unread."""
VALID, MISSING, NOT_JSON, INVALID, FORGED = "valid", "missing", "not_json", "invalid", "forged"
OUTCOMES = (VALID, MISSING, NOT_JSON, INVALID, FORGED)


def zap_request_author(receipt: Event) -> tuple[str | None, str]:
    """(the zapper's pubkey, VALID), or (None, why not): no `description` tag, not JSON (or
    too long), not a well-formed kind 9734, or its id or signature does not verify."""
    description = receipt.first_tag("description")
    if description is None:
        return None, MISSING
    if len(description) > MAX_DESCRIPTION_BYTES:
        return None, NOT_JSON
    try:
        raw = orjson.loads(description)
    except orjson.JSONDecodeError:
        return None, NOT_JSON
    try:
        request = Event.from_json(raw)
    except InvalidEvent:
        return None, INVALID
    if request.kind != ZAP_REQUEST:
        return None, INVALID
    try:
        request.verify()
    except InvalidEvent:
        return None, FORGED
    return request.pubkey, VALID
