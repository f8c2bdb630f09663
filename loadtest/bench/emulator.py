"""Benchmark of the engine emulator's CPU cost: ``python -m loadtest.bench.emulator``.

Starts one ``prefix-worker emulate`` process hosting ``--replicas`` replicas
(default 8) at ``--time-scale`` (default 10), drives it open-loop at ``--rate``
requests/s of distinct ``--prompt-tokens``-token token-id prompts (default
8192) spread round-robin over the replicas, and reports the sustained
completion rate, the emulator process's CPU seconds per request (user + system,
from /proc) and client-side latency percentiles. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtest.harness.processes import ProcessExited, cpu_seconds, start_emulator, stop_process


def _bodies(count: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [json.dumps({"prompt": [rng.randrange(1, 150000) for _ in range(prompt_tokens)],
                        "max_tokens": max_tokens, "ignore_eos": True}).encode()
            for _ in range(count)]


async def _drive(urls: list[str], bodies: list[bytes], rate: float) -> tuple[float, list[float], int]:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(i: int, body: bytes) -> None:
            nonlocal errors
            start = time.monotonic()
            try:
                async with session.post(urls[i % len(urls)] + "/v1/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.monotonic() - start)

        tasks = []
        t0 = time.monotonic()
        for i, body in enumerate(bodies):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, body)))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
    return elapsed, latencies, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.emulator", description=__doc__)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=60.0, help="offered requests/s")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of offered load")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)

    count = int(args.rate * args.duration)
    print(f"preparing {count} distinct {args.prompt_tokens}-token prompts ...", flush=True)
    bodies = _bodies(count, args.prompt_tokens, args.max_tokens, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        try:
            proc, replicas = start_emulator(ready, ["--replicas", str(args.replicas), "--time-scale",
                                                    str(args.time_scale), "--log-level", "warning"])
        except (TimeoutError, ProcessExited) as exc:
            print(f"emulator did not start: {exc}", file=sys.stderr)
            return 1
        try:
            urls = [r["url"] for r in replicas]
            cpu0 = cpu_seconds(proc.pid)
            elapsed, latencies, errors = asyncio.run(_drive(urls, bodies, args.rate))
            cpu = cpu_seconds(proc.pid) - cpu0
        finally:
            stop_process(proc)
    done = len(latencies)
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else 0.0

    print(json.dumps({
        "replicas": args.replicas, "time_scale": args.time_scale,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "offered_rps": args.rate, "completed": done, "errors": errors,
        "sustained_rps": round(done / elapsed, 1),
        "emulator_cpu_s": round(cpu, 2),
        "emulator_cpu_ms_per_request": round(1000 * cpu / max(done, 1), 2),
        "emulator_cpu_utilisation": round(cpu / elapsed, 2),
        "latency_ms_p50": round(pct(0.5), 1), "latency_ms_p99": round(pct(0.99), 1),
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
