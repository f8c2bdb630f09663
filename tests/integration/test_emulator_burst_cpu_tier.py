"""A request whose prefix is only in the CPU tier, arriving while another request
decodes, must join the step after its load ends (vLLM checks finished loads at every
schedule()), not wait out the emulator's decode burst (0.2 engine s at time scale 10).
Real ``prefix-worker emulate`` process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from loadtest.compare import parse_metrics
from tests.helpers import start_emulator, stop_process

pytestmark = pytest.mark.timeout(120)

TTFT = "vllm:time_to_first_token_seconds"
DECODE_STEP_ENGINE_S = 0.0055  # one decode step of the 8B profile on an H100, engine seconds


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 7919 + k) % 150000 + 100 for k in range(n)]


async def _cpu_tier_ttfts(url: str, with_decoder: bool) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def ttft_sum() -> float:
            async with session.get(url + "/metrics") as resp:
                return parse_metrics(await resp.text(), (TTFT + "_sum",))[TTFT + "_sum"]

        async def complete(prompt: list[int], max_tokens: int) -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["usage"]["completion_tokens"] == max_tokens

        async def decoder() -> None:  # keeps the replica decoding in bursts
            while True:
                await complete(list(range(1, 65)), 1000)

        background = asyncio.create_task(decoder()) if with_decoder else None
        ttfts = []
        try:
            await asyncio.sleep(0.2)
            for r in range(4):
                prompt = _prompt(5000 + r, 1600)  # 100 blocks
                await complete(prompt, 1)  # computed, stored to the CPU tier
                await asyncio.sleep(0.05)
                for j in range(5):  # evicted from the 400-block GPU pool
                    await complete(_prompt(9000 + 10 * r + j, 1600), 1)
                await asyncio.sleep(0.05 + 0.007 * r)
                before = await ttft_sum()
                await complete(prompt, 1)  # a CPU-tier hit: loads, then recomputes 1 token
                ttfts.append(await ttft_sum() - before)
        finally:
            if background is not None:
                assert not background.done(), background
                background.cancel()
    return ttfts


def test_a_cpu_tier_load_ending_during_a_decode_burst_joins_the_next_step(tmp_path: Path
                                                                          ) -> None:
    proc, replicas = start_emulator(
        tmp_path / "ready.json", ["--time-scale", "10", "--num-gpu-blocks-override", "400",
                                  "--num-cpu-blocks-override", "3000"], timeout_s=30)
    try:
        idle = asyncio.run(_cpu_tier_ttfts(replicas[0]["url"], False))
        busy = asyncio.run(_cpu_tier_ttfts(replicas[0]["url"], True))
    finally:
        stop_process(proc)
    # the load and the recomputed token as on an idle replica, plus at most the decode
    # step under way when the load ended, with slack
    assert max(busy) < max(idle) + 4 * DECODE_STEP_ENGINE_S, (
        [round(t, 4) for t in idle], [round(t, 4) for t in busy])
