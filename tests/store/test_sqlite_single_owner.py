"""One `serve` per SQLite file, enforced: the store writes an event's wakeups once without a
(device, event) constraint (migration 0014), so a second process serving the same file would
push every DM twice. The claim is a kernel lock, so a killed owner never blocks the next one."""

from __future__ import annotations

import asyncio
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from sigil_push.store.factory import open_sqlite
from sigil_push.store.sqlite.coordination import StoreInUse
from testkit.deadlines import scaled


async def test_a_second_claim_on_one_file_is_refused_until_the_first_is_given_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "push.db"
    first, second = await open_sqlite(path), await open_sqlite(path)
    try:
        async with AsyncExitStack() as serving:
            await first.coordination.claim(serving)
            with pytest.raises(StoreInUse) as refused:
                await second.coordination.claim(AsyncExitStack())
            assert refused.value.key == "server.database"
            assert "push.db is already served by another process" in str(refused.value)
        async with AsyncExitStack() as next_serving:
            await second.coordination.claim(next_serving)
    finally:
        await first.close()
        await second.close()


async def test_another_file_in_the_same_folder_is_claimed_independently(tmp_path: Path) -> None:
    one, other = await open_sqlite(tmp_path / "a.db"), await open_sqlite(tmp_path / "b.db")
    try:
        async with AsyncExitStack() as serving:
            await one.coordination.claim(serving)
            await other.coordination.claim(serving)
    finally:
        await one.close()
        await other.close()


CLAIM_AND_WAIT = """
import asyncio, sys
from contextlib import AsyncExitStack
from pathlib import Path
from sigil_push.store.factory import open_sqlite

async def main() -> None:
    store = await open_sqlite(Path(sys.argv[1]))
    stack = AsyncExitStack()
    await store.coordination.claim(stack)
    print("claimed", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_owner_leaves_the_file_to_the_next_process(tmp_path: Path) -> None:
    path = tmp_path / "push.db"
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLAIM_AND_WAIT, str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert owner.stdout is not None
        line = await asyncio.wait_for(owner.stdout.readline(), scaled(60))
        assert line.strip() == b"claimed"
        store = await open_sqlite(path)
        try:
            with pytest.raises(StoreInUse):
                await store.coordination.claim(AsyncExitStack())
            owner.send_signal(signal.SIGKILL)
            await asyncio.wait_for(owner.wait(), scaled(60))
            async with AsyncExitStack() as serving:
                await store.coordination.claim(serving)
        finally:
            await store.close()
    finally:
        if owner.returncode is None:
            owner.kill()
            await owner.wait()
