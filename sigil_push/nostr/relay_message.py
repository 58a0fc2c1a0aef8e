"""Messages from a relay to a client (NIP-01 `EVENT` `EOSE` `OK` `CLOSED` `NOTICE`, NIP-42
`AUTH`, NIP-77 `NEG-MSG` `NEG-ERR`), parsed in one place into one value each.

A relay is untrusted: a frame that is not JSON, not a list with a string verb, or whose verb
does not have its NIP's shape raises `InvalidRelayMessage`, and what that costs is the
reader's to decide (a counted malformed frame, a failed exchange). The event inside an
`EVENT` is left as the relay sent it: checking it (`Event.from_json`, `verify`) is the
reader's costliest step and is paid only for the events it keeps. The bridge's reader keeps a
faster path of its own for the EVENT frames it sees most (`bridge/ingest.py`, `Ingest.text`)
and hands everything else here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class InvalidRelayMessage(ValueError):
    """Not a relay message this parser knows, or not in its NIP's shape."""


@dataclass(frozen=True, slots=True)
class EventMessage:
    """`["EVENT", sub_id, event]`: `event` as decoded from JSON, unchecked."""

    sub_id: str
    event: Any


@dataclass(frozen=True, slots=True)
class Eose:
    """`["EOSE", sub_id]`: the stored events of a subscription are all sent."""

    sub_id: str


@dataclass(frozen=True, slots=True)
class Closed:
    """`["CLOSED", sub_id, message]`: the relay ended a subscription (`message` unchecked,
    "" when absent)."""

    sub_id: str
    message: Any


@dataclass(frozen=True, slots=True)
class Notice:
    """`["NOTICE", message]` (`message` unchecked)."""

    message: Any


@dataclass(frozen=True, slots=True)
class AuthChallenge:
    """`["AUTH", challenge]` (NIP-42)."""

    challenge: str


@dataclass(frozen=True, slots=True)
class Ok:
    """`["OK", event_id, accepted, message]`: `accepted` only when the relay sent `true`;
    `message` unchecked, "" when absent."""

    event_id: str
    accepted: bool
    message: Any


@dataclass(frozen=True, slots=True)
class NegMsg:
    """`["NEG-MSG", sub_id, payload]` (NIP-77): `payload` is hex, not yet decoded."""

    sub_id: str
    payload: str


@dataclass(frozen=True, slots=True)
class NegErr:
    """`["NEG-ERR", sub_id, reason]` (NIP-77; `reason` unchecked)."""

    sub_id: str
    reason: Any


RelayMessage = EventMessage | Eose | Closed | Notice | AuthChallenge | Ok | NegMsg | NegErr


def parse_relay_message(frame: str | bytes) -> RelayMessage:
    """The message a frame carries; InvalidRelayMessage when it is none of them."""
    try:
        decoded = json.loads(frame)
    except (ValueError, RecursionError):
        # deeply nested JSON raises RecursionError: junk like any other
        raise InvalidRelayMessage("not JSON") from None
    return relay_message(decoded)


def relay_message(message: Any) -> RelayMessage:
    """`parse_relay_message` for a frame already decoded from JSON."""
    if not isinstance(message, list) or len(message) < 2 or not isinstance(message[0], str):
        raise InvalidRelayMessage("not a list of a verb and its arguments")
    verb, first, count = message[0], message[1], len(message)
    if verb == "EVENT" and count >= 3 and isinstance(first, str):
        return EventMessage(first, message[2])
    if verb == "EOSE" and isinstance(first, str):
        return Eose(first)
    if verb == "CLOSED" and isinstance(first, str):
        return Closed(first, message[2] if count > 2 else "")
    if verb == "NOTICE":
        return Notice(first)
    if verb == "AUTH" and isinstance(first, str):
        return AuthChallenge(first)
    if verb == "OK" and count >= 3 and isinstance(first, str):
        return Ok(first, message[2] is True, message[3] if count > 3 else "")
    if verb == "NEG-MSG" and count >= 3 and isinstance(first, str) and isinstance(message[2], str):
        return NegMsg(first, message[2])
    if verb == "NEG-ERR" and count >= 3 and isinstance(first, str):
        return NegErr(first, message[2])
    raise InvalidRelayMessage(f"not a relay message: {verb[:16]!r}")
