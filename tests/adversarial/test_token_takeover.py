"""The hostile user who learned someone's device token (issue 9, "token takeover").

Before the many-accounts model, registering a token under a second npub moved it there: the
attacker then received nothing new, but the victim's wakeups stopped, and the attacker's
`DELETE /unregister` removed the victim's device for good. Now the attacker only ever adds or
removes a registration of its own. Real parts: a `nostr-relay` process, a dry-run
`sigil-push serve` process (a push is its `dry-run wakeup` log line), nostr-sdk users.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from testkit.bridge_harness import eventually, new_token, relay_live, wakeups
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.nostr_client import kind4_dm, publish
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller

pytestmark = pytest.mark.slow  # every story here starts its own processes


async def test_an_attacker_cannot_take_over_or_remove_a_victims_token(
    start_relay: Callable[..., RelayProcess], start_service: Callable[..., ServiceProcess]
) -> None:
    relay = start_relay("r")
    service = start_service([relay.url])
    victim, attacker, friend, token = SdkUser(), SdkUser(), SdkUser(), new_token()
    with httpx.Client(base_url=service.url, timeout=scaled(REQUEST_SECONDS)) as http:
        api = ApiCaller(http, service.url)
        assert api.register(victim, platform="android", device_token=token).status_code == 201
        await eventually(lambda: relay_live(service, relay.url, 1), "victim subscribed")

        taken = api.register(attacker, platform="android", device_token=token, payload="event")
        assert taken.status_code == 201, "the attacker gets a pair of its own, nothing more"
        [kept] = api.call("GET", "/registrations", victim).json()["devices"]
        assert kept["token_suffix"] == token[-6:] and kept["payload"] == "opaque"

        removed = api.call("DELETE", "/unregister", attacker, {"device_token": token})
        assert removed.json() == {"removed": 1}, "the attacker's own pair only"
        # signed a second earlier: the same request twice in one second would reuse an auth id
        earlier = victim.header(service.url + "/registrations", "GET", created_at=int(time.time()) - 1)
        listing = api.call("GET", "/registrations", None, headers={"authorization": earlier})
        assert len(listing.json()["devices"]) == 1

    dm = kind4_dm(friend.keys, victim.keys, "still reachable?")
    await publish(relay.url, dm)
    await eventually(lambda: wakeups(service)[dm["id"]] == 1, "the victim's wakeup")
