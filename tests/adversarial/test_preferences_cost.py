"""A key with no pair sends `/preferences` a private mute list of 1,000 npubs (67 KB, the
costliest body the API reads) over and over (issue 34, item 3). Against the running service
(the suite's dry-run `service`, on SQLite and on PostgreSQL): the pair is looked up before
the list is parsed, so the flood gets its 404s without making the instance decode a list,
and the instance's CPU for it is that of a request with an empty list; a registered user's
own list is still parsed, checked and stored meanwhile."""

from __future__ import annotations

import json
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nostr_sdk

from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller

FLOOD = 100
NPUBS = [str(nostr_sdk.Keys.generate().public_key().to_bech32()) for _ in range(1_000)]


def _cpu_seconds(service: ServiceProcess) -> float:
    """The service process's user and system CPU time so far."""
    assert service._process is not None
    stat = Path(f"/proc/{service._process.pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flood(api: ApiCaller, service: ServiceProcess, muted: list[str]) -> float:
    """FLOOD requests of fresh keys without a pair, 4 at a time; the service's CPU seconds."""
    def one(_: int) -> int:
        user = SdkUser()
        response = api.call("POST", "/preferences", user,
                            {"device_token": secrets.token_hex(32), "muted": muted})
        assert response.json()["error"] == "not_registered", response.text
        return response.status_code

    before = _cpu_seconds(service)
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(one, range(FLOOD))) == {404}
    return _cpu_seconds(service) - before


def test_no_pair_means_404_before_the_list_is_read(api: ApiCaller) -> None:
    """A list whose last entry is broken: without a pair the answer is 404 (the list was
    never read; it was 400 invalid_preferences), with one it is the 400 naming `muted`."""
    broken = [*NPUBS[:-1], "npub1notakey"]
    stranger = SdkUser()
    refused = api.call("POST", "/preferences", stranger,
                       {"device_token": secrets.token_hex(32), "muted": broken})
    assert refused.status_code == 404 and refused.json()["error"] == "not_registered"
    owner, token = SdkUser(), secrets.token_hex(32)
    registered = api.call("POST", "/register", owner,
                          {"npub": owner.npub, "platform": "ios", "device_token": token})
    assert registered.status_code == 201, registered.text
    refused = api.call("POST", "/preferences", owner, {"device_token": token, "muted": broken})
    assert refused.status_code == 400 and "muted" in refused.json()["message"]
    stored = api.call("POST", "/preferences", owner, {"device_token": token, "muted": NPUBS})
    assert stored.status_code == 200 and stored.json()["muted_count"] == len(NPUBS)
    # the APNs token's upper-case form names the same pair, as /unregister's lookup does
    upper = api.call("POST", "/preferences", owner, {"device_token": token.upper(), "muted": []})
    assert upper.status_code == 200 and upper.json()["muted_count"] == 0


def test_a_flood_of_lists_without_a_pair_costs_what_empty_ones_cost(
    api: ApiCaller, service: ServiceProcess
) -> None:
    """The victim's view: while the flood runs, a registered user's 1,000-npub list is
    stored and /health answers; the flood's CPU is that of the same requests with an empty
    list (decoding the 1,000 npubs first made each request cost about 25 times more)."""
    body_bytes = len(json.dumps({"muted": NPUBS}))
    assert body_bytes > 60_000
    victim, token = SdkUser(), secrets.token_hex(32)
    assert api.call("POST", "/register", victim,
                    {"npub": victim.npub, "platform": "ios", "device_token": token}).status_code == 201
    empty = min(_flood(api, service, []) for _ in range(3))
    with ThreadPoolExecutor(1) as side:
        victims_list = side.submit(
            api.call, "POST", "/preferences", victim, {"device_token": token, "muted": NPUBS}
        )
        floods = [_flood(api, service, NPUBS)]
        assert victims_list.result().json()["muted_count"] == len(NPUBS)
    assert api.http.get("/health").status_code == 200
    # measured again once the victim's list is stored: its decoding is the instance's CPU
    # too, and on a loaded machine it lasted into the next flood
    full = min(floods + [_flood(api, service, NPUBS) for _ in range(2)])
    # a CPU-clock tick of slack on each side, and four times the empty flood's cost: the
    # list is still received and JSON-parsed (67 KB a request), never decoded. Decoding it
    # cost 25 times the empty flood; twice, the bound was within reach of the service's own
    # background work on a loaded machine (it failed once beside three other test runs)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert full <= 4 * (empty + tick) + tick, (full, empty)
