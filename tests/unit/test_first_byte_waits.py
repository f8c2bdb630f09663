"""``FirstByteWaits``: the proxy's attempts waiting for a first byte, and their moving by the
stall watch (``router.edges.first_byte_waits``). Real asyncio timeouts on the test's loop."""

from __future__ import annotations

import asyncio

from router.decision.health import MISSED
from router.edges.first_byte_waits import GONE, FirstByteWaits


async def test_an_aborted_wait_expires_now_and_says_why() -> None:
    waits = FirstByteWaits()
    never = asyncio.Event()
    with_cause: list[str | None] = []

    async def attempt(token: int, replica_id: str) -> None:
        timeout = asyncio.timeout(60)
        try:
            async with timeout:
                waits.start(token, replica_id, timeout)
                await never.wait()
        except TimeoutError:
            with_cause.append(waits.aborted(token))
        finally:
            waits.end(token)

    tasks = [asyncio.create_task(attempt(token, rid))
             for token, rid in ((1, "r0"), (2, "r0"), (3, "r1"))]
    await asyncio.sleep(0)
    assert waits.waiting_replicas() == {"r0", "r1"}
    assert waits.abort_waiting("r0", GONE) == 2
    await asyncio.wait_for(asyncio.gather(*tasks[:2]), 5)  # long before their 60 s
    assert with_cause == [GONE, GONE]
    assert waits.waiting_replicas() == {"r1"}
    assert waits.abort_attempt(3, MISSED)
    await asyncio.wait_for(tasks[2], 5)
    assert with_cause == [GONE, GONE, MISSED]
    assert waits.waiting_replicas() == set()
    assert waits.aborted(3) is None  # forgotten with its wait


async def test_a_wait_that_ended_is_not_aborted() -> None:
    waits = FirstByteWaits()
    async with asyncio.timeout(60) as timeout:
        waits.start(7, "r0", timeout)
        await asyncio.sleep(0)  # (the first byte came)
        waits.end(7)
    assert not waits.abort_attempt(7, "stalled")
    assert waits.abort_waiting("r0") == 0
    assert waits.aborted(7) is None
