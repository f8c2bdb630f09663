"""The hash probe's attempt budget (``worker.hash_check.HashCheck``): a probe that misses is
sent again up to ``PROBE_ATTEMPTS`` times, and an epoch change (``want``) during the backoff
gives the new engine all its attempts again (it used to get what the old one had left: one).
The worker here is a stand-in whose event socket never subscribes, so every probe misses
without any engine; the backoffs are shortened."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Callable

import pytest

import worker.hash_check as hash_check


class NeverSubscribed:
    endpoint = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.connected = asyncio.Event()


async def test_an_epoch_change_during_the_backoff_restores_every_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hash_check, "PROBE_RETRY_S", 0.01)
    monkeypatch.setattr(hash_check, "PROBE_BACKOFF_MAX_S", 0.02)
    worker = types.SimpleNamespace(
        engine_known=asyncio.Event(), subscriber=NeverSubscribed(), engine_block_size=16,
        hasher=lambda: types.SimpleNamespace(block_size=16),
        heartbeat=types.SimpleNamespace(models=types.SimpleNamespace(models=["m"])))
    worker.engine_known.set()
    check = hash_check.HashCheck(worker, timeout_s=0.001)  # type: ignore[arg-type]
    task = asyncio.create_task(check.run())
    try:
        async def until(cond: Callable[[], bool]) -> None:
            deadline = asyncio.get_running_loop().time() + 30
            while not cond():
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError("condition not met")
                await asyncio.sleep(0.001)

        await until(lambda: check.num_misses == hash_check.PROBE_ATTEMPTS - 1 and check.retrying)
        check.want()  # the epoch changed while the last attempt waited
        await until(lambda: check.num_misses >= 2 * hash_check.PROBE_ATTEMPTS - 1
                    and not check.retrying)
        await asyncio.sleep(0.2)  # and no more after the new epoch's last
        assert check.num_misses == 2 * hash_check.PROBE_ATTEMPTS - 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
