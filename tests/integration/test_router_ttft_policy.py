"""The ttft policy against real replicas of different speed: two emulator processes, one with a
quarter of the other's TFLOP/s, behind one router (static replica URLs). The router learns each
replica's prefill rate from streamed first-token times, and the slow one gets less cold work."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import EMULATE, start_process, stop_all, stop_process, wait_for
from tests.integration.test_router_fleet import Router, http, prometheus_value, read_json_file

pytestmark = pytest.mark.timeout(180)

TIME_SCALE = 5.0  # a cold 3k-token prefill: ~25 ms wall at 400 TFLOP/s, ~100 ms at 100
LEARNING_TIME_SCALE = 0.5  # the rate-learning test's: a cold 3k-token prefill ~0.25 s at 400
# TFLOP/s, ~1 s at 100, so the prefill the router learns dwarfs what a busy host adds to a TTFT.
# At 5x a host stall of 0.3-1.2 s in one of the slow replica's 4 samples made its rate 0.5x to
# 100x off (fast/slow 0.02 to 9.9 against 4, at load 15-24)


class Emulator:
    def __init__(self, tmp: Path, name: str, gpu_tflops: float,
                 time_scale: float = TIME_SCALE) -> None:
        ready = tmp / f"{name}.json"
        self.proc = start_process([
            *EMULATE, "--replicas", "1", "--time-scale", str(time_scale), "--gpu-tflops", str(gpu_tflops),
            "--ready-file", str(ready)], env={"PYTHONHASHSEED": "0"})
        info = wait_for(lambda: read_json_file(ready), 60, message=f"{name} ready file")
        self.url: str = info["replicas"][0]["url"]
        self.replica_id = self.url.removeprefix("http://")  # static replica ids are host:port


def behind_a_ttft_router(tmp: Path, first: tuple[str, float], second: tuple[str, float],
                         time_scale: float = TIME_SCALE,
                         ) -> Iterator[tuple[Emulator, Emulator, Router]]:
    """Two emulators, ``(name, gpu_tflops)`` each, behind a router on the ttft policy (static
    replica URLs); yields them once both are routable, then stops all three."""
    one = Emulator(tmp, *first, time_scale)
    try:
        two = Emulator(tmp, *second, time_scale)
    except BaseException:
        stop_process(one.proc)
        raise
    router = None
    try:
        router = Router(tmp, ["--replica", one.url, "--replica", two.url, "--policy", "ttft",
                              "--hash-seed", "0"])
        wait_for(lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2, 30,
                 message="both replicas routable")
        yield one, two, router
    finally:
        stop_all(router, two.proc, one.proc)


@pytest.fixture
def two_speeds(tmp_path: Path) -> Iterator[tuple[Emulator, Emulator, Router]]:
    yield from behind_a_ttft_router(tmp_path, ("fast", 400.0), ("slow", 100.0),
                                    LEARNING_TIME_SCALE)


async def _send(url: str, prompts: list[list[int]], concurrency: int) -> list[str]:
    """Streamed completions, ``concurrency`` at a time; returns the replica that served each."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(prompt: list[int]) -> str:
            async with gate, session.post(url + "/v1/completions", json={
                    "model": "emulated-llm", "prompt": prompt, "max_tokens": 2,
                    "stream": True}) as resp:
                await resp.read()
                assert resp.status == 200
                return resp.headers["x-prefix-router-replica"]
        return await asyncio.gather(*(one(p) for p in prompts))


async def _warm_up(router_url: str, replicas: list[str]) -> None:
    """The one-off costs of a fresh fleet (connections, each process's first request) kept out
    of the learner's samples: streamed requests straight to each replica, and non-streamed ones
    through the router (the learner takes only streamed first bytes)."""
    async with aiohttp.ClientSession() as session:
        async def one(url: str, stream: bool) -> None:
            async with session.post(url + "/v1/completions", json={
                    "model": "emulated-llm", "prompt": list(range(1000, 1064)), "max_tokens": 2,
                    "stream": stream}) as resp:
                await resp.read()
                assert resp.status == 200
        await asyncio.gather(*(one(url, True) for url in replicas),
                             *(one(router_url, False) for _ in range(4)))


@pytest.mark.timeout(360)  # 112-154 s at load 10-13 (two CPU hogs beside the test)
def test_learned_rates_separate_and_the_slow_replica_gets_less_cold_work(
        two_speeds: tuple[Emulator, Emulator, Router]) -> None:
    fast, slow, router = two_speeds
    rng = random.Random(16)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(rng.randrange(1500, 4500))]
               for _ in range(48)]  # all cold: no prompt shares a block with another
    asyncio.run(_warm_up(router.url, [fast.url, slow.url]))
    # two halves: the first teaches the learner, the second's prediction errors are judged
    learning, judged = prompts[:24], prompts[24:]
    served = asyncio.run(_send(router.url, learning, concurrency=3))
    after_learning = router.metrics()
    served += asyncio.run(_send(router.url, judged, concurrency=3))

    # a prompt not sent before: no replica holds any of it (static replicas count this router's
    # own placements as hits), so the two predictions differ only in the learned rates
    fresh = [rng.randrange(1000, 100_000) for _ in range(3000)]
    status, _, body = router.post("/debug/route", {"model": "emulated-llm", "prompt": fresh})
    assert status == 200
    debug: dict[str, Any] = json.loads(body)
    rates = debug["prefill_rates"]
    assert rates[fast.replica_id]["samples"] >= 4 and rates[slow.replica_id]["samples"] >= 4
    # The emulators differ 4x in TFLOP/s; the predicted prefill of a fresh 3k-token prompt must
    # show it. Judged on the prediction (overhead + work x seconds per token), not on the slope
    # alone: with the slow replica's few samples (4 in CI) the split between intercept and slope
    # is ill-determined. In CI (load of a whole suite) the slow replica's 4 samples fitted
    # 8,842 tokens/s + 0.80 s against the fast one's 11,970 + 0 (slopes 1.35x apart), while
    # their predictions for this prompt, computed from those fits, were 1.17 s against 0.28 s
    # (4.3x). The upper bound is loose: at load 15 with two CPU hogs, host delays of ~0.4 s in
    # the fast replica's samples made the slopes 9.0x apart in 1 run of 4. A learner that does
    # not learn gives 1 (or no samples).
    predicted = {rid: debug["replicas"][rid]["prefill_s"]
                 for rid in (fast.replica_id, slow.replica_id)}
    ratio = predicted[slow.replica_id] / predicted[fast.replica_id]
    assert 2.0 < ratio < 12.0, (predicted, rates)
    # every candidate's prediction is shown in seconds
    for rid in (fast.replica_id, slow.replica_id):
        shown = debug["replicas"][rid]
        assert shown["ttft_s"] == pytest.approx(shown["wait_s"] + shown["prefill_s"], abs=1e-5)

    num_slow = served.count(slow.replica_id)
    assert served.count(fast.replica_id) + num_slow == len(prompts)
    assert num_slow <= len(prompts) // 4, served
    assert num_slow >= 1  # it was tried (and so measured), not starved from the start

    metrics = router.metrics()
    observed = prometheus_value(metrics, "router_ttft_prediction_error_seconds_count")
    assert observed == len(prompts)
    # after learning, the predictions were close: most errors of the second half within a
    # quarter of its mean TTFT (the largest bucket edge under it). Relative, because a busy host
    # adds its delays to every TTFT; the prior alone (2x too fast for the fast replica) misses by
    # half. The first half is left out: judged over all 48, 22 were within at load 7-8 (two CPU
    # hogs beside the test), most of the misses before the slow replica had its 4 samples.
    def grown(name: str) -> float:
        return prometheus_value(metrics, name) - prometheus_value(after_learning, name)

    mean_ttft_s = grown("router_ttft_seconds_sum") / grown("router_ttft_seconds_count")
    edges = {float(line.split('le="', 1)[1].split('"', 1)[0]) for line in metrics.splitlines()
             if line.startswith("router_ttft_prediction_error_seconds_bucket")}
    edge = max(e for e in edges if 0 < e <= mean_ttft_s / 4)

    def at_most(text: str, le: float) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("router_ttft_prediction_error_seconds_bucket")
                   and f'le="{le}"' in line)

    within = (at_most(metrics, edge) - at_most(metrics, -edge)
              - at_most(after_learning, edge) + at_most(after_learning, -edge))
    assert within >= len(judged) // 2, (edge, mean_ttft_s, within)
    assert http("GET", router.url + "/health")[0] == 200


@pytest.fixture
def two_alike(tmp_path: Path) -> Iterator[tuple[Emulator, Emulator, Router]]:
    yield from behind_a_ttft_router(tmp_path, ("a", 400.0), ("b", 400.0))


def test_decoding_requests_count_as_decode_cost_until_they_end(
        two_alike: tuple[Emulator, Emulator, Router]) -> None:
    """Long generations held open through the router: /debug/route charges each replica the KV
    its running requests hold (decode_s), the usage the engine reports teaches the mean output
    length, and everything is released when the streams end, also when the client leaves."""
    _, _, router = two_alike
    rng = random.Random(7)
    probe = [rng.randrange(1000, 100_000) for _ in range(2000)]

    def debug() -> dict[str, Any]:
        status, _, body = router.post("/debug/route", {"model": "emulated-llm", "prompt": probe})
        assert status == 200
        return json.loads(body)

    assert debug()["avg_output_tokens"] == 256.0  # the default before any usage report

    async def hold() -> None:
        prompts = [[rng.randrange(1000, 100_000) for _ in range(3000)] for _ in range(4)]
        async with aiohttp.ClientSession() as session:
            responses = []
            try:
                for p in prompts:
                    resp = await session.post(router.url + "/v1/completions", json={
                        "model": "emulated-llm", "prompt": p, "max_tokens": 100_000,
                        "stream": True})
                    responses.append(resp)
                    assert resp.status == 200
                    # its first token: past its prefill, so the next is routed on decode load
                    await resp.content.readline()
                shown = debug()
                held = {rid: v["context_tokens"] for rid, v in shown["load"].items()}
                assert sum(held.values()) == 4 * 3000
                for rid, view in shown["replicas"].items():
                    assert (view["decode_s"] > 0) == (held.get(rid, 0) > 0)
                # the four long requests were spread, two each (each lengthens the other's steps)
                assert sorted(held.values()) == [6000, 6000]
            finally:
                for resp in responses:
                    resp.close()  # the client leaves mid-stream

    asyncio.run(hold())
    wait_for(lambda: all(v["context_tokens"] == 0 for v in debug()["load"].values()), 10,
             message="context released after the clients left")
    assert all(v["decode_s"] == 0.0 for v in debug()["replicas"].values())

    async def short() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(router.url + "/v1/completions", json={
                        "model": "emulated-llm", "prompt": probe[:100], "max_tokens": 7,
                        "stream": True, "stream_options": {"include_usage": True}}) as resp:
                    assert resp.status == 200
                    await resp.read()

    asyncio.run(short())
    assert debug()["avg_output_tokens"] == 7.0  # from the engines' usage.completion_tokens
