"""A push endpoint's Retry-After is untrusted text: `²` (a digit to str.isdigit, not to
float), 400 digits, or a date past year 9999 once raised out of the sender, logged a traceback
per push and left the push unrecorded. It is parsed strictly (ASCII delta-seconds or an
HTTP-date with a zone, capped at an hour); anything else counts as absent."""

from __future__ import annotations

from typing import Any

import pytest

from sigil_push.push.base import MAX_RETRY_AFTER_SECONDS, parse_retry_after
from testkit.fakes.fake_unifiedpush import FakeUnifiedPush
from testkit.fakes.harness import eventually


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("²", None), ("١٢", None), ("9" * 400, None), ("-1", None), ("1.5", None),
        ("Wed, 21 Oct 2015 07:28:00", None), ("x" * 10_000, None),
        ("120", 120.0), (" 7 ", 7.0), ("999999", MAX_RETRY_AFTER_SECONDS),
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER_SECONDS),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),
    ],
)
def test_retry_after_is_parsed_strictly(header: str, seconds: float | None) -> None:
    assert parse_retry_after(header) == seconds


@pytest.mark.parametrize("header", ["²", "9" * 400])
async def test_a_hostile_retry_after_is_recorded_as_a_plain_retry(
    make_harness: Any, fake_up: FakeUnifiedPush, header: str
) -> None:
    harness = await make_harness()
    fake_up.script.answers["odd"] = (429, header)
    await harness.enqueue([await harness.register("unifiedpush", fake_up.endpoint("odd"))])
    records = await eventually(lambda: harness.push_records())
    assert records[0]["status"] == "retry"
