"""Single use of NIP-98 auth events, on each engine (a real SQLite file, a real PostgreSQL).

An auth event is the pair (id, signature): the same event is accepted again only for the
request it was first spent on (an idempotent retry); another signature of the same id is
another event (Iris's two requests in one second share an id).
"""

from __future__ import annotations

import asyncio
import time

from sigil_push.store.auth_ids import request_digest
from sigil_push.store.factory import PostgresStore, SqliteStore
from testkit.stores import open_test_store, sql_of

ID, SIG, OTHER_SIG = "a" * 64, "1" * 128, "2" * 128
POST_ONE = request_digest("POST", "https://push.example/subscriptions", b'{"one": 1}')
POST_TWO = request_digest("POST", "https://push.example/subscriptions", b'{"two": 2}')


def test_the_request_digest_covers_method_url_and_body() -> None:
    url = "https://push.example/subscriptions/"
    digests = {
        request_digest("POST", url, b"{}"), request_digest("DELETE", url, b"{}"),
        request_digest("POST", url + "x", b"{}"), request_digest("POST", url, b"{ }"),
    }
    assert len(digests) == 4
    assert request_digest("post", url, b"{}") == request_digest("POST", url, b"{}")


async def test_an_event_is_spent_on_one_request_and_expired_rows_are_pruned(
    store: SqliteStore | PostgresStore,
) -> None:
    ids = store.auth_ids
    assert await ids.claim(ID, SIG, POST_ONE)
    assert await ids.claim(ID, SIG, POST_ONE), "an idempotent retry is accepted"
    assert not await ids.claim(ID, SIG, POST_TWO), "never for another body"
    assert await ids.claim(ID, OTHER_SIG, POST_TWO), "another signature is another event"
    assert not await ids.claim(ID, OTHER_SIG, POST_ONE)
    await sql_of(store).execute(
        "INSERT INTO nip98_used VALUES (?, ?, ?, ?)", ("b" * 64, SIG, POST_ONE, int(time.time()) - 1)
    )
    assert await ids.prune() == 1
    assert not await ids.claim(ID, SIG, POST_TWO)


async def test_concurrent_claims_of_one_event_admit_one_request(
    store: SqliteStore | PostgresStore,
) -> None:
    """Requests racing with one auth event, batched together or not: every copy of the first
    request wins, every other request loses."""
    ids = store.auth_ids
    results = await asyncio.gather(
        *(ids.claim(f"{i % 50:064x}", SIG, POST_ONE if i < 100 else POST_TWO) for i in range(200))
    )
    assert results == [True] * 100 + [False] * 100
    again = await asyncio.gather(*(ids.claim(f"{i:064x}", SIG, POST_TWO) for i in range(60)))
    assert again == [False] * 50 + [True] * 10


async def test_an_event_spent_through_one_store_is_refused_through_another(database: str) -> None:
    """Two stores on one database (two workers on PostgreSQL, two processes on one SQLite
    file): the event is spent across both, because the database holds it, not memory."""
    first, second = await open_test_store(database, "w1"), await open_test_store(database, "w2")
    try:
        results = await asyncio.gather(*(
            store.auth_ids.claim(f"{i:064x}", SIG, body)
            for i in range(40) for store, body in ((first, POST_ONE), (second, POST_TWO))
        ))
        assert sum(results) == 40
        assert all(a != b for a, b in zip(results[::2], results[1::2], strict=True))
        winner = POST_ONE if results[0] else POST_TWO
        assert await second.auth_ids.claim(f"{0:064x}", SIG, winner)
        assert not await second.auth_ids.claim(f"{0:064x}", SIG, POST_ONE if winner == POST_TWO else POST_TWO)
    finally:
        await first.close()
        await second.close()
