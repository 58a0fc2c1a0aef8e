"""APNs delivery: the unmodified aioapns client against a local HTTP/2 APNs over TLS."""

from __future__ import annotations

import time
from typing import Any

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.exceptions import TooManyStreamsError
from h2.settings import SettingCodes
from prometheus_client import REGISTRY

from sigil_push.push.apns_sender import APS
from sigil_push.push.registry import TABLES
from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import (
    apns_token,
    eventually,
)


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_an_accepted_wakeup_is_an_alert_with_the_contract_body(make_harness, fake_apns: FakeApns) -> None:
    """An opaque wakeup reaches APNs as CONTRACT section 4 says, and leaves the outbox."""
    harness = await make_harness()
    token = apns_token()
    device = await harness.register("ios", token)
    event = await harness.enqueue([device])

    request = (await eventually(lambda: [r for r in fake_apns.requests if r.token == token]))[0]
    await eventually(harness.drained, what="outbox drained")

    assert request.body == {"aps": APS}
    assert request.body["aps"] == {
        "alert": {"title": "Sigil", "body": "New message"}, "mutable-content": 1, "sound": "default"
    }
    headers = request.headers
    assert headers["apns-push-type"] == "alert"
    assert headers["apns-priority"] == "10"
    assert headers["apns-topic"] == "chat.sigil.test"
    assert len(headers["apns-collapse-id"]) == 32
    assert 0 < int(headers["apns-expiration"]) - time.time() <= 3600
    records = await eventually(harness.push_records)
    assert [(r["event_id"], r["platform"], r["status"]) for r in records] == [(event.id, "ios", "accepted")]
    assert records[0]["latency_ms"] >= 0


async def test_dead_tokens_are_pruned(make_harness, fake_apns: FakeApns) -> None:
    """410 Unregistered and 400 BadDeviceToken forget the device; the next wakeup is not sent."""
    harness = await make_harness()
    gone, bad = apns_token(), apns_token()
    fake_apns.script.answers[gone] = (410, "Unregistered")
    fake_apns.script.answers[bad] = (400, "BadDeviceToken")
    pruned_before = _metric("sigil_push_push_pruned_tokens_total", provider="apns")
    devices = [await harness.register("ios", gone), await harness.register("ios", bad)]
    await harness.enqueue(devices)

    await eventually(harness.forgotten, what="devices forgotten")
    assert await harness.pending() == 0
    await eventually(lambda: len(harness.push_records()) >= 2, what="both answers logged")
    statuses = sorted(r["status"] for r in harness.push_records())
    assert statuses == ["unregistered", "unregistered"]

    # a forget is counted once its write returns, which a reader may see committed first
    def pruned() -> float:
        return _metric("sigil_push_push_pruned_tokens_total", provider="apns") - pruned_before

    await eventually(lambda: pruned() >= 2, what="both prunings counted")
    assert pruned() == 2


async def test_throttling_and_server_errors_are_retried_until_accepted(make_harness, fake_apns: FakeApns) -> None:
    """429 and 503 keep the wakeup in the outbox; it goes out once APNs recovers."""
    harness = await make_harness()
    token = apns_token()
    fake_apns.script.answers[token] = (429, "TooManyRequests")
    device = await harness.register("ios", token)
    await harness.enqueue([device])

    await eventually(lambda: len([r for r in fake_apns.requests if r.token == token]) >= 2, what="a retry")
    assert await harness.pending() == 1
    fake_apns.script.answers[token] = (503, "ServiceUnavailable")
    await eventually(lambda: len([r for r in fake_apns.requests if r.token == token]) >= 4, what="more retries")
    del fake_apns.script.answers[token]

    await eventually(harness.drained, what="delivered after recovery")
    await eventually(lambda: any(r["status"] == "accepted" for r in harness.push_records()))
    statuses = [r["status"] for r in harness.push_records()]
    assert statuses[-1] == "accepted" and set(statuses[:-1]) == {"retry"}
    assert await harness.devices.count() == 1


async def test_permanent_refusals_are_rejected_and_keep_the_device(make_harness, fake_apns: FakeApns) -> None:
    """A refusal that retrying cannot fix (e.g. BadTopic) is final but not a dead token."""
    harness = await make_harness()
    token = apns_token()
    fake_apns.script.answers[token] = (400, "BadTopic")
    device = await harness.register("ios", token)
    await harness.enqueue([device])

    records = await eventually(harness.push_records)
    assert [r["status"] for r in records] == ["rejected"]
    # a final answer's row leaves the outbox with its burst's DELETE, up to 20 ms after the
    # record (delivery.settle.COMPLETE_WITHIN_SECONDS)
    await eventually(harness.drained, what="the refused wakeup removed")
    assert await harness.devices.count() == 1


async def test_an_unanswered_send_times_out_and_is_retried(make_harness, fake_apns: FakeApns) -> None:
    """aioapns would wait forever for an answer; the send timeout turns silence into a retry."""
    harness = await make_harness(push={"send_timeout_seconds": 0.3})
    fake_apns.script.silent = True
    token = apns_token()
    device = await harness.register("ios", token)
    await harness.enqueue([device])

    await eventually(lambda: [r for r in harness.push_records() if r["status"] == "retry"], what="timeout")
    fake_apns.script.silent = False
    await eventually(harness.drained, what="delivered after silence")
    await eventually(lambda: [r["status"] for r in harness.push_records()][-1:] == ["accepted"])


async def test_a_wrong_signing_key_is_refused_by_apns_and_retried(make_harness, fake_apns: FakeApns, tmp_path) -> None:
    """The fake checks the ES256 provider token: a key APNs does not know gets 403 and no push."""
    from testkit.fakes.credentials import make_apns_key

    wrong_key, _ = make_apns_key(tmp_path)
    harness = await make_harness(start=False)
    harness.document["apns"]["key_file"] = str(wrong_key)
    from sigil_push.config import parse_config

    harness.config = parse_config(harness.document, harness.folder / "relays.toml", TABLES)
    await harness.start()
    token = apns_token()
    await harness.enqueue([await harness.register("ios", token)])

    records = await eventually(harness.push_records)
    assert records[0]["status"] == "retry"
    assert await harness.pending() == 1


async def test_environment_picks_apples_production_or_sandbox_host(credentials) -> None:
    """Without an endpoint override the sender talks to Apple's host for the environment."""
    from sigil_push.push.apns import PROVIDER, ApnsConfig
    from sigil_push.push.apns_sender import ApnsSender

    hosts = {}
    for environment in ("production", "sandbox"):
        config = ApnsConfig("TEAMID1234", "KEYID12345", str(credentials.apns_key), "chat.sigil.test",
                            environment)
        sender = await ApnsSender.create(config, credentials.apns_key, None, 5.0, PROVIDER)
        hosts[environment] = sender._client.pool.protocol_class.APNS_SERVER
        await sender.close()
    assert hosts == {"production": "api.push.apple.com", "sandbox": "api.development.push.apple.com"}


async def test_per_push_headers_stay_out_of_the_hpack_table(make_harness, fake_apns: FakeApns) -> None:
    """A push's path (the token), apns-id, collapse id and expiration are new nearly every time:
    the client sends them as literals that never enter the HTTP/2 header table, so the table
    keeps only the constant headers, and APNs (the fake decodes with h2's HPACK) still reads
    every header of every push."""
    harness = await make_harness()
    tokens = [apns_token() for _ in range(40)]
    for token in tokens:
        await harness.enqueue([await harness.register("ios", token, "event_id")])
    await eventually(harness.drained, what="outbox drained")

    requests = [r for r in fake_apns.requests if r.token in set(tokens)]
    assert sorted(r.token for r in requests) == sorted(tokens)
    assert len({r.headers["apns-id"] for r in requests}) == len(tokens)
    assert all(len(r.headers["apns-collapse-id"]) == 32 for r in requests)
    assert all(r.headers["authorization"].startswith("bearer ") for r in requests)
    assert all(r.headers[":path"] == f"/3/device/{r.token}" for r in requests)
    assert harness.delivery is not None
    sender = harness.delivery._senders["ios"].inner  # type: ignore[attr-defined]
    tables = [c.conn.encoder.header_table.dynamic_entries for c in sender._client.pool.connections]
    assert tables
    assert {name for table in tables for name, _ in table} == {
        b"host", b"apns-topic", b"apns-priority", b"apns-push-type"
    }


async def test_answered_pushes_leave_no_request_state_on_the_connection(
    make_harness, fake_apns: FakeApns
) -> None:
    """A long-lived connection keeps nothing per answered push: after hundreds of accepted
    pushes and some refused ones (with and without a reason), the client's maps of requests,
    streams and statuses are empty. aioapns kept every accepted push's stream entry, so a
    busy connection grew by about 150 bytes a push for as long as it lived."""
    harness = await make_harness()
    refused = apns_token()
    fake_apns.script.answers[refused] = (400, "BadCollapseId")
    tokens = [apns_token() for _ in range(300)]
    devices = [await harness.register("ios", token) for token in [*tokens, refused]]
    for start in range(0, len(devices), 50):
        await harness.enqueue(devices[start:start + 50])
    await eventually(
        lambda: {r.token for r in fake_apns.requests} >= {*tokens, refused}, what="all sent")
    await eventually(lambda: len(harness.push_records()) >= len(devices), what="all answered")

    assert harness.delivery is not None
    sender = harness.delivery._senders["ios"].inner  # type: ignore[attr-defined]
    connections = sender._client.pool.connections
    assert connections
    held = [(len(c.requests), len(c.request_streams), len(c.request_statuses))
            for c in connections]
    assert held == [(0, 0, 0)] * len(connections)


def test_closed_streams_remembered_are_bounded() -> None:
    """h2 remembers how each closed stream ended, up to a bound: the sender's connection keeps
    about a thousand, not h2's 65,536 (some 6 MB per busy connection)."""
    client, server = _connected_pair(1000)
    for _ in range(3000):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, _REQUEST, end_stream=True)
        _answer(client, server, stream_id)
    assert 0 < len(client._closed_streams) <= 1024


def _connected_pair(max_streams: int) -> tuple[Any, H2Connection]:
    """The sender's HTTP/2 client state and a real h2 server state that allows `max_streams`
    streams at once, with their SETTINGS exchanged in memory."""
    from sigil_push.push.apns_sender import _Http2Connection

    client = _Http2Connection()
    client.initiate_connection()
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    server.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return client, server


_REQUEST = [(":method", "POST"), (":scheme", "https"), (":path", "/3/device/x"), (":authority", "a")]


def _answer(client: Any, server: H2Connection, stream_id: int) -> None:
    server.receive_data(client.data_to_send())
    server.send_headers(stream_id, [(":status", "200")], end_stream=True)
    client.receive_data(server.data_to_send())


def test_the_peers_stream_limit_holds_as_in_h2() -> None:
    """The client counts open streams cheaply, but still refuses a stream beyond the peer's
    MAX_CONCURRENT_STREAMS exactly as h2 does, and allows one again once a stream ends."""
    client, server = _connected_pair(3)
    opened = []
    for _ in range(3):
        opened.append(client.get_next_available_stream_id())
        client.send_headers(opened[-1], _REQUEST, end_stream=True)
    with pytest.raises(TooManyStreamsError):
        client.send_headers(client.get_next_available_stream_id(), _REQUEST, end_stream=True)

    _answer(client, server, opened[0])
    client.send_headers(client.get_next_available_stream_id(), _REQUEST, end_stream=True)
    with pytest.raises(TooManyStreamsError):
        client.send_headers(client.get_next_available_stream_id(), _REQUEST, end_stream=True)


def test_answered_streams_are_dropped_in_batches() -> None:
    """Closed streams are not walked on every push, but they are still dropped: thousands of
    answered pushes with ten in flight leave a bounded number of streams held."""
    client, server = _connected_pair(1000)
    in_flight: list[int] = []
    most_held = 0
    for _ in range(3000):
        if len(in_flight) == 10:
            _answer(client, server, in_flight.pop(0))
        in_flight.append(client.get_next_available_stream_id())
        client.send_headers(in_flight[-1], _REQUEST, end_stream=True)
        most_held = max(most_held, len(client.streams))
    assert most_held <= 2 * 10 + 64 + 1
    assert sum(stream.open for stream in client.streams.values()) == 10
