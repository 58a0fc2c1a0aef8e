"""The one parser of relay messages: every verb the readers, publishers and signer links act
on comes out as its value, and a frame without its NIP's shape is refused, never guessed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sigil_push.nostr.relay_message import (
    AuthChallenge,
    Closed,
    Eose,
    EventMessage,
    InvalidRelayMessage,
    NegErr,
    NegMsg,
    Notice,
    Ok,
    parse_relay_message,
)

EVENT = {"id": "ab" * 32, "kind": 4}


@pytest.mark.parametrize(
    ("message", "parsed"),
    [
        (["EVENT", "s1", EVENT], EventMessage("s1", EVENT)),
        (["EOSE", "s1"], Eose("s1")),
        (["CLOSED", "s1", "auth-required: sign in"], Closed("s1", "auth-required: sign in")),
        (["CLOSED", "s1"], Closed("s1", "")),
        (["NOTICE", "slow down"], Notice("slow down")),
        (["AUTH", "challenge-1"], AuthChallenge("challenge-1")),
        (["OK", "ab" * 32, True, ""], Ok("ab" * 32, True, "")),
        (["OK", "ab" * 32, False, "blocked: no"], Ok("ab" * 32, False, "blocked: no")),
        (["OK", "ab" * 32, "true"], Ok("ab" * 32, False, "")),
        (["NEG-MSG", "n1", "6100"], NegMsg("n1", "6100")),
        (["NEG-ERR", "n1", "blocked: too big"], NegErr("n1", "blocked: too big")),
    ],
)
def test_each_verb_becomes_its_value(message: list[Any], parsed: object) -> None:
    assert parse_relay_message(json.dumps(message)) == parsed
    assert parse_relay_message(json.dumps(message).encode()) == parsed


@pytest.mark.parametrize(
    "frame",
    [
        "not json",
        "[" * 100_000,  # nesting deep enough to exhaust the decoder's recursion
        '{"EVENT": 1}',
        "[]",
        '["EVENT"]',
        '[1, "s1"]',
        '["EVENT", 5, {}]',
        '["EVENT", "s1"]',
        '["EOSE", 7]',
        '["AUTH", {}]',
        '["OK", "id"]',
        '["OK", 5, true]',
        '["NEG-MSG", "n1", 61]',
        '["COUNT", "s1", {"count": 1}]',
    ],
)
def test_a_frame_without_its_shape_is_refused(frame: str) -> None:
    with pytest.raises(InvalidRelayMessage):
        parse_relay_message(frame)
