"""The emulator keeps its own engine clock: a process the host stops for a while (SIGSTOP, as a
busy machine does to it in smaller doses) completes the same work by the same engine time once
it runs again, and its lag metric shows the stall; a request arriving, or a CPU-tier load
ending, during a decode burst joins the next step. Real ``prefix-worker emulate`` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.compare.scraping import LagHistogram
from loadtest.compare.scraping import parse_metrics as sum_samples
from tests.helpers import start_emulator, stop_process

pytestmark = pytest.mark.timeout(120)

STALL_S = 2.5  # longer than the work: it ends while the process is stopped
STALL_AT_S = 0.3
NUM_REQUESTS = 4
PROMPT_TOKENS = 2048
MAX_TOKENS = 256  # 8B profile, H100: ~1.8 engine s for the whole batch at time scale 1


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    proc, replicas = start_emulator(tmp_path / f"{name}.json", ["--time-scale", "1"], timeout_s=180)
    return proc, replicas[0]["url"]


async def _run(url: str, stall: subprocess.Popen[bytes] | None) -> dict[str, Any]:
    """Send the batch at once; optionally stop the process for STALL_S while it works."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(i: int) -> float:
            body = {"prompt": [(i * 7919 + k) % 150000 + 1 for k in range(PROMPT_TOKENS)],
                    "max_tokens": MAX_TOKENS, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            return time.monotonic()

        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(NUM_REQUESTS)]
        if stall is not None:
            await asyncio.sleep(STALL_AT_S)
            os.kill(stall.pid, signal.SIGSTOP)
            await asyncio.sleep(STALL_S)
            os.kill(stall.pid, signal.SIGCONT)
        done = await asyncio.gather(*tasks)
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    sums = sum_samples(text, ("vllm:e2e_request_latency_seconds_sum",
                              "vllm:e2e_request_latency_seconds_count"))
    return {"wall_s": max(done) - t0,
            "engine_e2e_s": sums["vllm:e2e_request_latency_seconds_sum"],
            "count": sums["vllm:e2e_request_latency_seconds_count"],
            "lag": LagHistogram.parse(text)}


def test_a_stopped_engine_catches_up_on_its_own_clock(tmp_path: Path) -> None:
    quiet_proc, quiet_url = _start(tmp_path, "quiet")
    stalled_proc, stalled_url = _start(tmp_path, "stalled")
    try:
        quiet = asyncio.run(_run(quiet_url, None))
        stalled = asyncio.run(_run(stalled_url, stalled_proc))
    finally:
        stop_process(quiet_proc)
        stop_process(stalled_proc)
    assert quiet["count"] == stalled["count"] == NUM_REQUESTS
    # The stall begins inside the work and outlasts it.
    assert STALL_AT_S + 0.5 < quiet["engine_e2e_s"] / NUM_REQUESTS < STALL_AT_S + STALL_S
    # Clients saw the stall (nothing could be answered while the process was stopped)...
    assert stalled["wall_s"] >= STALL_AT_S + STALL_S
    # ...but the engine lost no capacity: the same work ended at the same engine time (it
    # would be about STALL_S - STALL_AT_S per request later if a late step restarted the clock
    # at "now").
    per_request_gap = (stalled["engine_e2e_s"] - quiet["engine_e2e_s"]) / NUM_REQUESTS
    assert abs(per_request_gap) < 0.2, (quiet, stalled)
    # The lag metric shows the stall, and a quiet engine keeps time.
    assert stalled["lag"].max_s >= 0.8 * STALL_S
    assert stalled["lag"].count > 0 and quiet["lag"].count > 0
    # (relative to the quiet run on this machine now: a busy machine delays both alike)
    assert stalled["lag"].max_s - quiet["lag"].max_s >= 0.4 * STALL_S, (quiet, stalled)


NEWCOMERS = 12
DECODE_STEP_ENGINE_S = 0.0055  # one decode step of the 8B profile on an H100, engine seconds
TTFT = "vllm:time_to_first_token_seconds"


def _prompt(i: int, n: int) -> list[int]:
    """``n`` distinct token ids for prompt ``i`` (no prefix shared with another ``i``)."""
    return [(i * 7919 + k) % 150000 + 100 for k in range(n)]


async def _ttft_sums(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """The replica's engine-clock TTFT histogram: (sum in engine seconds, count)."""
    async with session.get(url + "/metrics") as resp:
        sums = sum_samples(await resp.text(), (TTFT + "_sum", TTFT + "_count"))
    return sums[TTFT + "_sum"], sums[TTFT + "_count"]


async def _newcomer_ttfts(url: str) -> list[float]:
    """Engine-clock TTFT (the replica's own ``vllm:time_to_first_token_seconds``) of
    ``NEWCOMERS`` one-block prompts, each sent while another request decodes there."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def decode() -> None:  # streams for far longer than the newcomers take
            body = {"prompt": list(range(1, 65)), "max_tokens": 30000, "ignore_eos": True,
                    "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for _ in resp.content.iter_any():
                    pass

        background = asyncio.create_task(decode())
        ttfts = []
        try:
            # it is decoding in bursts once its own first token is counted (a fixed sleep was
            # too short on a busy machine: its first token then landed in a newcomer's count)
            for _ in range(1200):  # up to 60 s
                if (await _ttft_sums(session, url))[1] >= 1:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            for i in range(NEWCOMERS):
                before = await _ttft_sums(session, url)
                body = {"prompt": _prompt(i, 16), "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                after = await _ttft_sums(session, url)
                assert after[1] == before[1] + 1
                ttfts.append(after[0] - before[0])
                await asyncio.sleep(0.013 * (i % 4))  # arrive at varied points of a burst
        finally:
            background.cancel()
    return ttfts


def test_a_request_arriving_during_a_decode_burst_joins_the_next_step(tmp_path: Path) -> None:
    """vLLM takes new requests between any two engine steps: a request arriving while another
    decodes waits for the step under way, never for the rest of the emulator's decode burst
    (up to one stream interval, 0.2 engine s at time scale 10). The burst used to stop at the
    steps done by the wake-up, which left the newcomer after the engine clock, and the next
    burst kept it waiting: about half of these newcomers then had a TTFT of 0.2 engine s
    against 0.012 s for the others."""
    proc, replicas = start_emulator(tmp_path / "ready.json", ["--time-scale", "10"],
                                    timeout_s=180)
    try:
        ttfts = asyncio.run(_newcomer_ttfts(replicas[0]["url"]))
    finally:
        stop_process(proc)
    # its own prefill step (one block) after at most the decode step under way, with slack
    assert max(ttfts) < 4 * DECODE_STEP_ENGINE_S, [round(t, 4) for t in ttfts]



async def _cpu_tier_ttfts(url: str, with_decoder: bool) -> list[float]:
    """Engine-clock TTFT of 4 prompts whose prefix is only in the CPU tier (computed, then
    pushed out of a 400-block GPU pool), optionally while another request keeps decoding."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
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
                before, _ = await _ttft_sums(session, url)
                await complete(prompt, 1)  # a CPU-tier hit: loads, then recomputes 1 token
                ttfts.append((await _ttft_sums(session, url))[0] - before)
        finally:
            if background is not None:
                assert not background.done(), background
                background.cancel()
    return ttfts


def test_a_cpu_tier_load_ending_during_a_decode_burst_joins_the_next_step(tmp_path: Path
                                                                          ) -> None:
    """vLLM looks for finished CPU-tier loads at every schedule(): the request waiting for one
    joins the step after the load ends, never waits out the emulator's decode burst (0.2
    engine s at time scale 10; it did, 0.21 against 0.0096 engine s on an idle replica)."""
    proc, replicas = start_emulator(
        tmp_path / "ready.json", ["--time-scale", "10", "--num-gpu-blocks-override", "400",
                                  "--num-cpu-blocks-override", "3000"], timeout_s=180)
    try:
        idle = asyncio.run(_cpu_tier_ttfts(replicas[0]["url"], False))
        busy = asyncio.run(_cpu_tier_ttfts(replicas[0]["url"], True))
    finally:
        stop_process(proc)
    # the load and the recomputed token as on an idle replica, plus at most the decode
    # step under way when the load ended, with slack
    assert max(busy) < max(idle) + 4 * DECODE_STEP_ENGINE_S, (
        [round(t, 4) for t in idle], [round(t, 4) for t in busy])
