"""Admission under overload: the benchmark of issue 33's targets. Does process, network and file
I/O.

    python -m loadtest.bench.admission [--replicas 2] [--time-scale 2] [--phase-s 30]
        [--repeat 2] [--peers smg|no] [--phases all|rate-limit|fairness] [--out DIR]

One emulated fleet (``loadtest.harness.fleet.LoopbackFleet``: Redis, emulator, workers) with several
prefix-routers over it (``LoopbackFleet.add_router``), every one with API keys on. Two tenants
split the packaged Mooncake slice: ``chat`` (every third request; the tenant file gives it the
``interactive`` class) and ``bulk`` (the rest; class ``batch``), each replayed by
``loadtest.replay.replayer`` with its own key, both on the trace's schedule. Every phase sends its
prompts under a token seed of its own (no phase hits another's cache) and starts once the
replicas are idle; each records the load average before and after.

1. **Capacity**: admission off, a closed loop of ``--probe-in-flight-per-replica`` requests
   per replica; the capacity is the rate of streams answered 200 that ended in the phase's
   last two thirds (``admission_figures.served_rps``).
2. **Calm**: admission off at half the capacity. The TTFT targets: ``interactive`` = its p90
   there x ``--interactive-factor``, ``batch`` = its p90 x ``--batch-factor``.
3. **Off against on** at 1.5x and 2x the capacity (the speedup ``speedup_for`` gives), the 2x
   pair ``--repeat`` times, interleaved. "On" is a router with those TTFT targets (SLO-aware
   admission), the tenant file, a per-replica limit on queued prefill (half the interactive
   target, predicted seconds) and on in-flight requests (``--inflight-per-replica``), and the
   batch target as the queue's wait bound; it is warmed by a short calm replay first (its
   learned prefill rate). Per phase: each class's TTFT p90 against its target, goodput
   (requests that met their class's target per second of offered load), answers by status
   (with Retry-After counted), the longest a refused request waited against the bound, and
   ``/ready``'s admission counts sampled 5 times a second.
4. **Client disconnects while queued**: a burst to "on" that fills its limits and queue, a
   second later 10 more requests (queued behind), whose clients hang up half a second later:
   how long until the router counted all 10 as cancelled in the queue, ``/ready`` before and
   after.
5. **Fairness**: two equal-weight tenants of one class offering 1x and 3x their half of what
   the fleet serves through an admission router without TTFT targets (measured first, at 2x),
   through a router off and one on; each tenant's share of the served prefill tokens (prompt
   minus cached, from usage), also over the phase's last two thirds, and per tenant the prompt
   tokens sent and served, the cached share and when its refused requests were sent.
   ``--phases fairness``: phases 1 and 2, one 2x round through "on", then these.
6. **Rate limit** (alongside the fairness phases; alone with ``--phases rate-limit``): two
   routers on the one Redis, a per-tenant requests-per-minute limit, short requests
   alternating between them at twice the limit for two minutes from a cold start: the
   requests served in each minute and within any 60 s against the limit.
7. **SMG** (``--peers smg``, the ``peers`` extra): the 2x load through SMG's
   ``--max-concurrent-requests`` (the in-flight count "on" settled at, pure concurrency:
   ``--rate-limit-tokens-per-second 0``) and queue (the same wait bound), text prompts of the
   same token counts (it refuses token ids); it has no classes and no Retry-After.

Writes ``results.json`` (every phase's figures) to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench import admission_figures as fig
from loadtest.compare.scraping import M_RUNNING, M_WAITING, scrape, scrape_counters_and_lag
from loadtest.data import packaged_trace_path
from loadtest.harness.fleet import OURS, SMG, FleetConfig, LoopbackFleet, RouterSpec, peer_available
from loadtest.replay.replayer import (
    DEFAULT_MODEL,
    DEFAULT_REQUEST_TIMEOUT_S,
    ReplayConfig,
    RequestRecord,
    replay,
    send_one,
    write_records,
)
from loadtest.replay.trace import read_trace, schedule_offsets
from router.edges.auth import hash_key, new_key
from router.tools.trace_format import TokenMapper, TraceRequest

INTERACTIVE, STANDARD, BATCH = "interactive", "standard", "batch"  # the router's default classes
CHAT, BULK = "chat", "bulk"  # the two tenants of the overload phases
FAIR_A, FAIR_B = "fair-a", "fair-b"  # the equal-weight tenants of the fairness phases
METERED = "metered"  # the rate-limited tenant
TENANT_CLASS = {CHAT: INTERACTIVE, BULK: BATCH}
CALM_LOAD = 0.5  # x capacity
LOADS = (1.5, 2.0)  # x capacity, the issue's
WARMUP_S = 12.0
DISCONNECTING = 10  # queued clients that hang up in the disconnect phase  # calm replay through a new router before it is measured (its learned rate)
IDLE_TIMEOUT_S = 120.0  # wait for the replicas to empty between phases, at most
RATE_LIMIT_PER_MIN = 120  # the rate phase's per-tenant limit, requests per minute
PROMPT_IDS = list(range(1000, 1016))  # the rate phase's short prompt (token ids)


@dataclass(frozen=True)
class Stream:
    """One tenant's share of a phase: its requests (trace order) and its request headers."""

    tenant: str
    requests: list[TraceRequest]
    headers: dict[str, str]


@dataclass
class Bench:
    """What every phase needs: the settings, the fleet, the trace, the tenants' keys."""

    args: argparse.Namespace
    fleet: LoopbackFleet
    requests: list[TraceRequest]
    keys: dict[str, str]  # {tenant: API key}
    native_rps: float  # the slice's arrival rate at speed 1
    capacity_rps: float = 0.0
    seed: int = 0  # the last phase's token seed

    def stream(self, tenant: str, requests: list[TraceRequest], auth: bool = True) -> Stream:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"} if auth else {}
        return Stream(tenant, requests, headers)

    def split(self, first: str, second: str, every: int, auth: bool = True) -> list[Stream]:
        """Request i to ``first`` when i % every == 0, else to ``second``."""
        return [self.stream(first, self.requests[::every], auth),
                self.stream(second, [r for i, r in enumerate(self.requests) if i % every], auth)]

    def speedup(self, load: float) -> float:
        return fig.speedup_for(load, self.capacity_rps, self.native_rps)


def write_tenant_files(out: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """API keys of every tenant, the key file, the salt secret and two tenant files (the
    overload phases': classes; the fairness phases': equal weights) under ``out``."""
    keys = {t: new_key() for t in (CHAT, BULK, FAIR_A, FAIR_B, METERED)}
    files = {"keys": out / "api-keys.txt", "secret": out / "salt-secret",
             "tenants": out / "tenants.yaml", "fair": out / "tenants-fair.yaml"}
    files["keys"].write_text("".join(f"{t} {hash_key(k)}\n" for t, k in keys.items()))
    files["secret"].write_text(new_key() + "\n")
    files["tenants"].write_text("tenants:\n" + "".join(
        f"  {t}: {{priority_class: {c}, weight: 1}}\n" for t, c in TENANT_CLASS.items()))
    files["fair"].write_text("tenants:\n" + "".join(
        f"  {t}: {{priority_class: {STANDARD}, weight: 1}}\n" for t in (FAIR_A, FAIR_B)))
    return keys, files


def native_rate(requests: Sequence[TraceRequest], window_s: float) -> float:
    """The slice's requests per second at speed 1 (its own schedule) over its first
    ``window_s`` seconds (the part the phases replay)."""
    offsets = schedule_offsets(requests, 1.0)
    return sum(1 for o in offsets if o < window_s) / window_s


# -- one phase ------------------------------------------------------------------------------

async def read_ready(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """``/ready``'s ``admission`` object ({} when absent)."""
    async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        body = await resp.json(content_type=None)
    return dict(body.get("admission") or {})


async def sample_ready(url: str, stop: asyncio.Event, out: list[dict[str, Any]]) -> None:
    """``/ready``'s admission counts 5 times a second until ``stop``."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                out.append(await read_ready(session, url))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


def ready_figures(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    admitted = [s.get("admitted", 0) for s in samples]
    return {"samples": len(samples),
            "max_queued": max((s.get("queued", 0) for s in samples), default=None),
            "max_oldest_wait_s": max((s.get("oldest_wait_s", 0.0) for s in samples), default=None),
            "mean_admitted": round(sum(admitted) / len(admitted), 1) if admitted else None}


async def replay_streams(url: str, streams: Sequence[Stream], speedup: float, seed: int,
                         args: argparse.Namespace, phase_s: float, prompt_format: str,
                         max_concurrency: int = 4096
                         ) -> tuple[dict[str, list[RequestRecord]], dict[str, Any]]:
    """Replay every stream at once against ``url`` for ``phase_s``; records per tenant (sent
    ones only) and the ``/ready`` figures."""
    stop = asyncio.Event()
    samples: list[dict[str, Any]] = []
    sampler = asyncio.create_task(sample_ready(url, stop, samples))
    configs = [ReplayConfig(target=url, speedup=speedup, max_duration_s=phase_s,
                            drain_timeout_s=args.drain_s, max_concurrency=max_concurrency,
                            max_output_tokens=args.max_tokens, token_seed=seed,
                            prompt_format=prompt_format, extra_headers=s.headers,
                            progress_interval_s=3600.0) for s in streams]
    try:
        results = await asyncio.gather(*(replay(s.requests, c) for s, c in zip(streams, configs,
                                                                              strict=True)))
    finally:
        stop.set()
        await sampler
    return ({s.tenant: fig.sent(rs) for s, rs in zip(streams, results, strict=True)},
            ready_figures(samples))


async def wait_idle(urls: Sequence[str], timeout_s: float) -> float:
    """Seconds until no replica has a request running or waiting (``timeout_s`` at most)."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - started < timeout_s:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                pages = await asyncio.gather(*(scrape(session, u, (M_RUNNING, M_WAITING))
                                               for u in urls))
                if all(p[M_RUNNING] + p[M_WAITING] == 0 for p in pages):
                    break
            await asyncio.sleep(0.5)
    return round(time.monotonic() - started, 1)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


Records = dict[str, list[RequestRecord]]  # {tenant: records of its sent requests}


def run_phase(bench: Bench, name: str, url: str, streams: Sequence[Stream], speedup: float,
              prompt_format: str = "token_ids", phase_s: float | None = None,
              max_concurrency: int = 4096) -> tuple[dict[str, Any], Records]:
    """Wait for idle replicas, replay ``streams`` through ``url`` for ``phase_s`` (default:
    ``--phase-s``; each stream at most ``max_concurrency`` requests in flight); the phase's
    common figures and the records per tenant."""
    phase_s = phase_s or bench.args.phase_s
    urls = [r.url for r in bench.fleet.replicas]
    idle_s = asyncio.run(wait_idle(urls, IDLE_TIMEOUT_S))
    bench.seed += 1
    print(f"phase {name}: speedup {speedup:.2f}, {url}", flush=True)
    before = load_average()
    lag_before = asyncio.run(scrape_counters_and_lag(urls, ()))[1]
    by_tenant, ready = asyncio.run(replay_streams(url, streams, speedup, bench.seed, bench.args,
                                                  phase_s, prompt_format, max_concurrency))
    lag = asyncio.run(scrape_counters_and_lag(urls, ()))[1].minus(lag_before)
    every = [r for rs in by_tenant.values() for r in rs]
    write_records(every, bench.args.out / f"records-{bench.seed:02d}.jsonl")
    counts = fig.statuses(every)
    offered = len(every) / phase_s
    out = {"phase": name, "speedup": round(speedup, 3), "offered_rps": round(offered, 2),
           "load_x": round(offered / bench.capacity_rps, 2) if bench.capacity_rps else None,
           "waited_for_idle_s": idle_s, "load_average": {"before": before, "after": load_average()},
           "statuses": counts, "nothing_lost": fig.nothing_lost(counts),
           "longest_refusal_s": fig.longest_refusal_s(every), "ready": ready,
           # how far the emulated engines ran behind their clock (a busy host): s per step
           "emulator_lag_p99_s": lag.quantile(0.99), "emulator_lag_max_s": lag.max_s}
    print(f"  {json.dumps(out)}", flush=True)
    return out, by_tenant


def classed_phase(bench: Bench, name: str, url: str, load: float, targets: dict[str, float],
                  prompt_format: str = "token_ids", auth: bool = True) -> dict[str, Any]:
    """An overload phase of the two classed tenants: per class figures and goodput."""
    out, by_tenant = run_phase(bench, name, url, bench.split(CHAT, BULK, 3, auth),
                               bench.speedup(load), prompt_format)
    by_class = {TENANT_CLASS[t]: rs for t, rs in by_tenant.items()}
    out["classes"] = {c: fig.class_figures(rs, targets.get(c)) for c, rs in by_class.items()}
    out["goodput_rps"] = round(fig.goodput_rps(by_class, targets, bench.args.phase_s), 3)
    return out


# -- the phases -----------------------------------------------------------------------------

async def closed_loop(url: str, streams: Sequence[Stream], in_flight: int, seed: int,
                      args: argparse.Namespace) -> list[RequestRecord]:
    """Each stream keeps ``in_flight`` requests running for ``args.phase_s`` (its requests in
    trace order, the next sent as soon as one ends: the body ``loadtest.replay.replayer`` sends); those
    still running then get ``args.drain_s`` more. The records of every request sent."""
    mapper = TokenMapper(seed=seed)
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def loop(session: aiohttp.ClientSession, stream: Stream,
                   todo: list[TraceRequest]) -> None:
        headers = {"content-type": "application/json", **stream.headers}
        while todo and time.perf_counter() - t0 < args.phase_s:
            req = todo.pop(0)
            record = RequestRecord(len(records), req.index, time.perf_counter() - t0,
                                   input_length=req.input_length, max_tokens=args.max_tokens)
            records.append(record)
            body = json.dumps({"model": DEFAULT_MODEL, "prompt": mapper.request_prompt(req),
                               "max_tokens": args.max_tokens, "ignore_eos": True,
                               "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            await send_one(session, url + "/v1/completions", body, record, t0, headers,
                           DEFAULT_REQUEST_TIMEOUT_S)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(loop(session, s, todo))
                 for s in streams for todo in [list(s.requests)] for _ in range(in_flight)]
        _, pending = await asyncio.wait(tasks, timeout=args.phase_s + args.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def capacity_probe(bench: Bench, url: str) -> dict[str, Any]:
    """Phase 1: a closed loop of ``--probe-in-flight-per-replica`` requests per replica
    (admission off); the capacity is the rate of streams that ended in the phase's last two
    thirds, while every replica was busy."""
    args = bench.args
    idle_s = asyncio.run(wait_idle([r.url for r in bench.fleet.replicas], IDLE_TIMEOUT_S))
    bench.seed += 1
    in_flight = max(1, args.probe_in_flight_per_replica * len(bench.fleet.replicas) // 2)
    print(f"phase capacity probe: {2 * in_flight} requests in flight, {url}", flush=True)
    before = load_average()
    records = asyncio.run(closed_loop(url, bench.split(CHAT, BULK, 3), in_flight, bench.seed,
                                      args))
    bench.capacity_rps = fig.served_rps(records, args.phase_s / 3, args.phase_s)
    out = {"phase": "capacity probe (admission off, closed loop)", "in_flight": 2 * in_flight,
           "capacity_rps": round(bench.capacity_rps, 3), "waited_for_idle_s": idle_s,
           "statuses": fig.statuses(records),
           "load_average": {"before": before, "after": load_average()}}
    print(f"  {json.dumps(out)}", flush=True)
    return out


def capacity_and_targets(bench: Bench, url: str) -> dict[str, Any]:
    """Phases 1 and 2: the fleet's capacity, then the calm run and the TTFT targets."""
    args = bench.args
    probe = capacity_probe(bench, url)
    calm, by_tenant = run_phase(bench, "calm (admission off)", url, bench.split(CHAT, BULK, 3),
                                bench.speedup(CALM_LOAD), phase_s=args.calm_s)
    p90 = {TENANT_CLASS[t]: fig.class_figures(rs, None)["ttft_p90_s"]
           for t, rs in by_tenant.items()}
    targets = {INTERACTIVE: round(p90[INTERACTIVE] * args.interactive_factor, 2),
               BATCH: round(p90[BATCH] * args.batch_factor, 2)}
    calm["classes"] = {c: fig.class_figures(rs, targets[c])
                       for c, rs in ((TENANT_CLASS[t], rs) for t, rs in by_tenant.items())}
    return {"probe": probe, "calm": calm, "targets_s": targets}


def admission_args(bench: Bench, targets: dict[str, float], tenants: Path,
                   slo: bool = True) -> list[str]:
    """The "on" router's flags: limits from the targets, the tenant file, SLO-aware admission."""
    flags = ["--admission-max-queued-prefill-s", f"{targets[INTERACTIVE] / 2:.3f}",
             "--admission-max-inflight-per-replica", str(bench.args.inflight_per_replica),
             "--admission-max-queue-wait-s", f"{targets[BATCH]:.3f}",
             "--admission-tenants-file", str(tenants)]
    if slo:
        for name, target in targets.items():
            flags += ["--admission-ttft-targets", f"{name}={target:.3f}"]
    return flags


def warm_up(bench: Bench, url: str) -> None:
    """A short calm replay through a new router, not measured: its learned prefill rate."""
    run_phase(bench, "warm-up (not measured)", url, bench.split(CHAT, BULK, 3),
              bench.speedup(CALM_LOAD), phase_s=WARMUP_S)


def off_against_on(bench: Bench, off_url: str, on_url: str,
                   targets: dict[str, float]) -> list[dict[str, Any]]:
    """Phase 3: 1.5x once, 2x ``--repeat`` times, off then on each time."""
    rounds: list[dict[str, Any]] = []
    loads = [LOADS[0], *([LOADS[1]] * bench.args.repeat)]
    for i, load in enumerate(loads):
        for label, url in (("off", off_url), ("on", on_url)):
            phase = classed_phase(bench, f"{load:g}x admission {label}", url, load, targets)
            phase.update(router=label, load=load, round=i)
            rounds.append(phase)
    return rounds


def one_on_round(bench: Bench, on_url: str, targets: dict[str, float]) -> dict[str, Any]:
    """``--phases fairness``: the 2x load through "on" once (what the fairness phases' load
    is set from), without its "off" pair."""
    phase = classed_phase(bench, f"{LOADS[1]:g}x admission on", on_url, LOADS[1], targets)
    phase.update(router="on", load=LOADS[1], round=0)
    return phase


async def cancelled_count(session: aiohttp.ClientSession, url: str) -> float:
    """``router_admission_requests_total{outcome="cancelled"}`` summed, from ``/metrics``."""
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("router_admission_requests_total{")
               and 'outcome="cancelled"' in line)


async def hang_up_while_queued(url: str, bodies: Sequence[bytes], headers: dict[str, str],
                               num_leaving: int) -> dict[str, Any]:
    """Phase 4: all but the last ``num_leaving`` of ``bodies`` at once (they fill the limits
    and the queue), a second later the last ones (queued behind them), half a second later
    those clients hang up. The queue before and after; how long until the router counted them
    all as cancelled in the queue (5 s at most)."""
    async def one(session: aiohttp.ClientSession, body: bytes) -> None:
        async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
            await resp.read()

    async with aiohttp.ClientSession() as probe, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0)) as session:
        staying = [asyncio.create_task(one(session, b)) for b in bodies[:-num_leaving]]
        await asyncio.sleep(1.0)
        leaving = [asyncio.create_task(one(session, b)) for b in bodies[-num_leaving:]]
        await asyncio.sleep(0.5)
        before, counted_before = await read_ready(probe, url), await cancelled_count(probe, url)
        hung_up = time.perf_counter()
        for task in leaving:
            task.cancel()
        await asyncio.gather(*leaving, return_exceptions=True)
        counted = 0.0
        while time.perf_counter() - hung_up < 5.0 and counted < num_leaving:
            counted = await cancelled_count(probe, url) - counted_before
            if counted < num_leaving:
                await asyncio.sleep(0.01)
        counted_s = time.perf_counter() - hung_up
        after = await read_ready(probe, url)
        for task in staying:
            task.cancel()
        await asyncio.gather(*staying, return_exceptions=True)
    return {"sent": len(bodies), "hung_up": num_leaving, "before_hang_up": before,
            "counted_cancelled": counted, "all_counted_after_s": round(counted_s, 3),
            "after": after}


def disconnect_phase(bench: Bench, url: str) -> dict[str, Any]:
    urls = [r.url for r in bench.fleet.replicas]
    idle_s = asyncio.run(wait_idle(urls, IDLE_TIMEOUT_S))
    bench.seed += 1
    mapper = TokenMapper(seed=bench.seed)
    bodies = [json.dumps({"model": bench.fleet.config.model, "prompt": mapper.request_prompt(r),
                          "max_tokens": bench.args.max_tokens, "ignore_eos": True,
                          "stream": True}).encode()
              for r in bench.requests[:bench.args.disconnect_burst + DISCONNECTING]]
    load_before = load_average()
    out = asyncio.run(hang_up_while_queued(url, bodies, {
        "Authorization": f"Bearer {bench.keys[BULK]}", "content-type": "application/json"},
        DISCONNECTING))
    out.update(phase="client disconnects while queued", waited_for_idle_s=idle_s,
               load_average={"before": load_before, "after": load_average()})
    print(f"  {json.dumps(out)}", flush=True)
    return out


def fairness_phases(bench: Bench, off_url: str, fair_url: str,
                    served_rps: float) -> list[dict[str, Any]]:
    """Phase 5: tenants A (1x its half) and B (3x its half), off and on. The whole is what the
    fair router serves: first measured with A and B offering 2x ``served_rps`` (what "on"
    served at 2x; the fair router, without TTFT targets, serves more), as requests answered
    200 per second of offered load; then A offers half of that, B three halves."""
    args = bench.args
    calibration, _ = run_phase(bench, "fairness calibration (admission on)", fair_url,
                               bench.split(FAIR_A, FAIR_B, 4),
                               fig.speedup_for(2.0, served_rps, bench.native_rps))
    whole_rps = calibration["statuses"].get("200", 0) / args.phase_s
    speedup = fig.speedup_for(2.0, whole_rps, bench.native_rps)
    out = []
    for label, url in (("off", off_url), ("on", fair_url)):
        phase, by_tenant = run_phase(bench, f"fairness 1x:3x admission {label}", url,
                                     bench.split(FAIR_A, FAIR_B, 4), speedup)
        shares = fig.prefill_shares(by_tenant)
        # the shares of the requests sent in the last two thirds: without the start, when the
        # replicas filled in arrival order before anything waited
        late = fig.prefill_shares({t: [r for r in rs if (r.send_s or 0.0) >= args.phase_s / 3]
                                   for t, rs in by_tenant.items()})
        phase.update(router=label, prefill_share={t: (round(s, 3) if s is not None else None)
                                                  for t, s in shares.items()},
                     prefill_share_last_two_thirds={t: (round(s, 3) if s is not None else None)
                                                    for t, s in late.items()},
                     tenants={t: fig.tenant_figures(rs) for t, rs in by_tenant.items()},
                     served={t: sum(r.ok for r in rs) for t, rs in by_tenant.items()},
                     sent={t: len(rs) for t, rs in by_tenant.items()},
                     whole_rps=round(whole_rps, 3))
        out.append(phase)
    return out


Answer = tuple[float, float, int, int, str | None]  # (sent, answered at (s from the start);
# router index; status (0: no answer); Retry-After)


async def alternate(urls: Sequence[str], key: str, model: str, rps: float,
                    seconds: float) -> list[Answer]:
    """Short completions at ``rps`` for ``seconds``, request i to ``urls[i % len(urls)]``; one
    ``Answer`` each."""
    body = json.dumps({"model": model, "prompt": PROMPT_IDS, "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    answers: list[Answer] = []
    started = time.perf_counter()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        which, sent = i % len(urls), time.perf_counter() - started
        try:
            async with session.post(urls[which] + "/v1/completions", data=body,
                                    headers=headers) as resp:
                await resp.read()
                answers.append((sent, time.perf_counter() - started, which, resp.status,
                                resp.headers.get("Retry-After")))
        except (aiohttp.ClientError, TimeoutError):
            answers.append((sent, time.perf_counter() - started, which, 0, None))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        tasks = []
        for i in range(int(rps * seconds)):
            await asyncio.sleep(max(0.0, started + i / rps - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, i)))
        await asyncio.gather(*tasks)
    return answers


def start_rate_limit_phase(bench: Bench, key_file_flags: list[str]
                           ) -> Callable[[], dict[str, Any]]:
    """Phase 6, started in a thread (its load is small: short prompts, one output token):
    two routers sharing one per-tenant limit through Redis, offered twice the limit for two
    minutes from a cold start. Figures: the requests served in each minute, and the most
    served within any 60 s (``admission_figures.most_in_any_window``), against the limit.
    Returns a function that waits for the end and returns the figures."""
    limit = RATE_LIMIT_PER_MIN
    urls = [bench.fleet.add_router(f"router-rate-{i}", [
        *key_file_flags, "--rate-limit-requests-per-min", str(limit)])[0] for i in range(2)]
    load_before = load_average()
    window_s = 60.0  # the limit's window: a minute
    pool = ThreadPoolExecutor(1)
    future = pool.submit(asyncio.run, alternate(urls, bench.keys[METERED],
                                                bench.fleet.config.model, 2 * limit / window_s,
                                                2 * window_s))

    def result() -> dict[str, Any]:
        answers = future.result()
        pool.shutdown()
        served = [a for a in answers if a[3] == 200]
        minutes = [[a for a in served if i * window_s <= a[0] < (i + 1) * window_s]
                   for i in range(2)]
        most = fig.most_in_any_window([(a[0], a[1], 1) for a in served], window_s)
        refused = [a for a in answers if a[3] == 429]
        out = {"phase": "rate limit, two routers on one Redis, two minutes from a cold start",
               "limit_per_min": limit, "offered": len(answers),
               "served_in_the_first_minute": len(minutes[0]),
               "served_in_the_second_minute": len(minutes[1]),
               "most_served_in_any_60_s": most,
               "served_per_router": [sum(1 for a in served if a[2] == i) for i in range(2)],
               "statuses": fig.statuses_of([a[3] for a in answers]),
               "refused_with_retry_after": sum(1 for a in refused if a[4]),
               "within_10_percent": all(abs(n - limit) <= 0.1 * limit
                                        for n in (*map(len, minutes), most)),
               "load_average": {"before": load_before, "after": load_average()}}
        print(f"  {json.dumps(out)}", flush=True)
        return out
    return result


def smg_phase(bench: Bench, on_phases: Sequence[dict[str, Any]],
              targets: dict[str, float]) -> dict[str, Any]:
    """Phase 7: the 2x load through SMG's concurrency limit and queue (a peer fleet over the
    same replicas)."""
    admitted = [p["ready"]["mean_admitted"] for p in on_phases
                if p["load"] == LOADS[1] and p["ready"]["mean_admitted"]]
    concurrency = max(len(bench.fleet.replicas), round(sum(admitted) / max(1, len(admitted))))
    wait_s = max(1, round(targets[BATCH]))
    smg_args = ("--max-concurrent-requests", str(concurrency), "--queue-size", "1024",
                "--queue-timeout-secs", str(wait_s), "--rate-limit-tokens-per-second", "0")
    config = FleetConfig(router=RouterSpec(SMG, "cache_aware"), replicas=len(bench.fleet.replicas),
                         model=bench.fleet.config.model, engines=tuple(bench.fleet.replicas),
                         router_args=smg_args, log_dir=bench.args.out / "logs" / "smg")
    with LoopbackFleet(config, progress=_progress) as peer:
        assert peer.router_url is not None
        phase = classed_phase(bench, f"{LOADS[1]:g}x SMG cache_aware", peer.router_url, LOADS[1],
                              targets, prompt_format="text", auth=False)
    phase.update(router="smg", load=LOADS[1], smg_args=list(smg_args))
    return phase


def _progress(line: str) -> None:
    print(line, flush=True)


# -- the report -----------------------------------------------------------------------------

def targets_met(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets against the phases' figures (a wait may pass its bound by the
    gate's 0.1 s timer tick and the HTTP round trip: ``WAIT_SLACK_S``)."""
    bound = results["targets_s"][BATCH]
    on = [p for p in results["overload"] if p["router"] == "on"]
    ratios: dict[str, list[float | None]] = {}
    for p in on:
        off = next((o for o in results["overload"]
                    if o["router"] == "off" and o["round"] == p["round"]), None)
        ratio = p["goodput_rps"] / off["goodput_rps"] if off and off["goodput_rps"] else None
        ratios.setdefault(f"{p['load']:g}x", []).append(round(ratio, 2) if ratio else None)
    waits = [max(p["longest_refusal_s"] or 0.0, p["ready"]["max_oldest_wait_s"] or 0.0)
             for p in on]
    fair = next((p for p in results.get("fairness", []) if p["router"] == "on"), None)
    return {
        "interactive_p90_within_target_at_2x": [p["classes"][INTERACTIVE]["p90_within_target"]
                                                for p in on if p["load"] == LOADS[1]],
        "goodput_on_over_off": ratios,
        "nothing_lost_with_admission_on": all(p["nothing_lost"] for p in on),
        "longest_wait_s_vs_bound": [max(waits, default=0.0), bound],
        "no_wait_past_bound": max(waits, default=0.0) <= bound + WAIT_SLACK_S,
        "hung_up_counted_cancelled": [results.get("disconnect", {}).get(k) for k in (
            "counted_cancelled", "hung_up", "all_counted_after_s")],
        "fair_shares": fair["prefill_share"] if fair else None,
        "fair_shares_at_least_45_percent": (all(s is not None and s >= 0.45
                                                for s in fair["prefill_share"].values())
                                            if fair else None),
        "rate_limit_within_10_percent": results.get("rate_limit", {}).get("within_10_percent"),
    }


WAIT_SLACK_S = 0.5


def _answers(counts: dict[str, int]) -> str:
    parts = [f"{counts.get('200', 0)} ok"]
    for status in ("429", "503"):
        if counts.get(status):
            parts.append(f"{counts[status]} {status} ({counts.get(f'{status} with Retry-After', 0)}"
                         " with Retry-After)")
    others = {k: v for k, v in counts.items() if k not in ("200", "429", "503")
              and "Retry-After" not in k}
    parts += [f"{v} {k}" for k, v in others.items()]
    return ", ".join(parts)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _cls(phase: dict[str, Any], name: str) -> tuple[str, str]:
    c = phase["classes"][name]
    return (f"{c['ttft_p90_s']} / {c['target_s']}", f"{c['served']} / {c['sent']}")


def format_table(results: dict[str, Any]) -> str:
    """The overload phases as a Markdown table, one row per phase."""
    lines = ["| phase | load (x capacity) | load avg before / after | interactive TTFT p90 / "
             "target (s) | interactive served / sent | batch TTFT p90 / target (s) | "
             "batch served / sent | goodput (req/s) | answers | longest refusal wait (s) | "
             "most queued |", "|" + "---|" * 11]
    phases = [results["calm"], *results["overload"], *results.get("smg", [])]
    for p in phases:
        i_p90, i_served = _cls(p, INTERACTIVE)
        b_p90, b_served = _cls(p, BATCH)
        lines.append(f"| {p['phase']} | {p['load_x']} | {p['load_average']['before'][0]} / "
                     f"{p['load_average']['after'][0]} | {i_p90} | {i_served} | {b_p90} | "
                     f"{b_served} | {p.get('goodput_rps', '-')} | {_answers(p['statuses'])} | "
                     f"{_dash(p['longest_refusal_s'])} | {_dash(p['ready']['max_queued'])} |")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="the emulator's; below the overload phases' replay speedup")
    parser.add_argument("--phase-s", type=float, default=30.0, help="seconds of load per phase")
    parser.add_argument("--drain-s", type=float, default=15.0,
                        help="after a phase, seconds its requests may still finish")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the 2x off/on pair")
    parser.add_argument("--probe-in-flight-per-replica", type=int, default=32,
                        help="the capacity probe's closed loop: requests in flight per replica")
    parser.add_argument("--calm-s", type=float, default=45.0,
                        help="seconds of the calm run (its p90s set the targets)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens, at most")
    parser.add_argument("--interactive-factor", type=float, default=2.0,
                        help="interactive TTFT target = the calm run's p90 x this")
    parser.add_argument("--batch-factor", type=float, default=5.0,
                        help="batch TTFT target (and the queue's wait bound) = calm p90 x this")
    parser.add_argument("--inflight-per-replica", type=int, default=16)
    parser.add_argument("--disconnect-burst", type=int, default=40)
    parser.add_argument("--policy", default="prefix")
    parser.add_argument("--peers", choices=("smg", "no"), default="smg")
    parser.add_argument("--phases", choices=("all", "rate-limit", "fairness"), default="all",
                        help="rate-limit: only the rate-limit phase (no probe, no targets); "
                             "fairness: the probe, the calm run, one 2x round on, fairness")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(os.environ.get("TMPDIR", "/tmp")) / (
            "bench-admission-" + dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S"))
    return args


def commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent).strip()
    return "unknown"


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    keys, files = write_tenant_files(args.out)
    key_flags = ["--api-keys", str(files["keys"]), "--cache-salt-secret-file",
                 str(files["secret"])]
    requests = read_trace(packaged_trace_path())
    config = FleetConfig(router=RouterSpec(OURS, args.policy), replicas=args.replicas,
                         time_scale=args.time_scale, router_args=tuple(key_flags),
                         log_dir=args.out / "logs")
    results: dict[str, Any] = {"commit": commit(), "args": {k: str(v) for k, v in
                                                             vars(args).items()}}
    with LoopbackFleet(config, progress=_progress) as fleet:
        assert fleet.router_url is not None
        bench = Bench(args, fleet, requests, keys, native_rate(requests, 150.0))
        results["native_rps"] = round(bench.native_rps, 3)
        if args.phases == "rate-limit":
            results["rate_limit"] = start_rate_limit_phase(bench, key_flags)()
            results["targets_met"] = {"rate_limit_within_10_percent":
                                      results["rate_limit"]["within_10_percent"]}
            return results
        results.update(capacity_and_targets(bench, fleet.router_url))
        save(results)
        targets = results["targets_s"]
        on_url, _ = fleet.add_router("router-on", [*key_flags, *admission_args(
            bench, targets, files["tenants"])])
        warm_up(bench, on_url)
        results["overload"] = (off_against_on(bench, fleet.router_url, on_url, targets)
                               if args.phases == "all" else [one_on_round(bench, on_url, targets)])
        save(results)
        if args.phases == "all":
            results["disconnect"] = disconnect_phase(bench, on_url)
        fair_url, _ = fleet.add_router("router-fair", [*key_flags, *admission_args(
            bench, targets, files["fair"], slo=False)])
        warm_up(bench, fair_url)
        rate_limit = (start_rate_limit_phase(bench, key_flags)  # alongside the fairness phases
                      if args.phases == "all" else None)
        served = [p["statuses"].get("200", 0) / args.phase_s for p in results["overload"]
                  if p["router"] == "on" and p["load"] == LOADS[1]]
        results["fairness"] = fairness_phases(bench, fleet.router_url, fair_url,
                                              sum(served) / len(served))
        if rate_limit is not None:
            results["rate_limit"] = rate_limit()
        save(results)
        if args.phases == "all" and args.peers == "smg" and not peer_available(SMG):
            results["smg_skipped"] = "smg is not installed (pip install -e '.[peers]')"
        elif args.phases == "all" and args.peers == "smg":
            on = [p for p in results["overload"] if p["router"] == "on"]
            results["smg"] = [smg_phase(bench, on, targets)]
    results["targets_met"] = targets_met(results)
    return results


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    def save(results: dict[str, Any]) -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    started = time.monotonic()
    results = run(args, save)
    results["wall_s"] = round(time.monotonic() - started, 1)
    save(results)
    if "overload" in results:
        print(format_table(results))
    print(json.dumps(results["targets_met"], indent=1))
    print(f"results: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
