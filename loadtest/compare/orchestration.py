"""Side-by-side comparison of routing policies on an emulated fleet: the project's main benchmark.
Does process, network and file I/O.

For each policy a FRESH fleet is started (``loadtest.fleet.LoopbackFleet``: embedded Redis, emulator,
workers, router; or a peer router), so no run inherits another's KV cache; the same trace slice is
replayed through the router (``loadtest.replay``); then the emulator replicas' own counters are
read. Per policy (``results.json``, the table and the plots):

* ``token_hit_rate``: fleet prefix-cache hit rate, sum over replicas of
  ``vllm:prefix_cache_hits_total`` / sum of ``vllm:prefix_cache_queries_total`` (the increase over
  the replay; the engine's own counters, so peers are measured exactly like us);
* ``tiers_token_hit_rate``: the same with the CPU tier's hits (vLLM native offloading): GPU hits
  plus ``vllm:external_prefix_cache_hits_total`` (prompt tokens past the GPU hit found in host
  memory and loaded, not recomputed) over the same queries; ``cpu_tier_token_hit_rate`` the latter
  alone (both equal ``token_hit_rate`` / 0 on a fleet without a CPU tier);
* ``ttft_p50_s/p90_s/p99_s``, ``e2e_p50_s``: client-side, over successful requests;
* ``throughput_rps``: successful requests / (last completion - first send);
* ``imbalance``: max / mean over replicas of busy time, where a replica's busy time is the time
  during the replay in which it had at least one request running or waiting, integrated from
  its ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` gauges sampled every
  ``sample_interval_s`` (a GPU is busy exactly while it has work); ``imbalance_work`` is the same
  ratio for the integral of running + waiting requests (request-seconds), which still separates a
  replica holding 1 request from one holding 30 when both are always busy;
* ``requests_per_replica``: from the replicas' ``vllm:request_success_total`` (peers add no
  replica header; for prefix-router the router's ``x-prefix-router-replica`` header counts agree);
* ``router_cpu_s_per_request``: CPU seconds (user + system, psutil) the router process and its
  children used during the replay, per replayed request;
* ``cpu_s``: the same for every component (redis, emulator, workers, router, replayer) and the
  machine's busy share of all cores, to show whether the machine itself was the bottleneck;
  ``emulator_cpu_s_per_request`` the emulator's share per replayed request;
* ``emulator_lag_p50_s/p99_s/max_s``: how far the emulated engines ran behind their own clock
  (``emulator_engine_lag_seconds``, wall seconds per engine step, all replicas, over the replay);
* ``trusted`` / ``untrusted_reason``: the run's verdict (``verdict``): an emulator that fell
  behind, a machine with no CPU headroom or a replayer that could not send on time make every
  latency in the row include waits for a core that a real fleet would not have.

With ``repeat`` > 1 every policy runs that many times, interleaved (A B C A B C ...), each on a
fresh fleet; ``policies`` then holds per figure the median over the rounds with ``range``
[min, max], ``rounds`` each round's own figures, and ``ranking`` whether the order of the
policies by TTFT p50 held in every round. The emulator runs at a higher OS priority than
everything else where allowed (``loadtest.fleet.EMULATOR_NICE``; ``priority`` says what happened).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.data import packaged_trace_path
from loadtest.fleet import (
    DEFAULT_HASH_ALGO,
    OURS,
    SGLANG,
    SMG,
    VLLM_ROUTER,
    FleetConfig,
    FleetError,
    LoopbackFleet,
    RouterSpec,
    cpu_delta,
    cpu_sample,
    peer_available,
)
from loadtest.replay import ReplayConfig, RequestRecord, replay, summarize, write_records
from loadtest.trace import read_trace
from router.shared.contract import DEFAULT_INDEX_STRIDE
from router.tools.trace_format import TraceRequest

logger = logging.getLogger(__name__)

OWN_POLICIES = ("prefix", "ttft", "round_robin", "least_loaded", "consistent_hash")
PEER_SPECS = (RouterSpec(SMG, "cache_aware"), RouterSpec(SMG, "prefix_hash"),
              RouterSpec(VLLM_ROUTER, "cache_aware"), RouterSpec(VLLM_ROUTER, "kv_aware"))
PEER_KINDS = (SMG, VLLM_ROUTER, SGLANG)
# Peers whose OpenAI endpoints take only text prompts (a token-id array is a 400 for them).
TEXT_ONLY_PEERS = (SGLANG, SMG)
DEFAULT_SAMPLE_INTERVAL_S = 1.0  # gauge sampling for busy time; 8 scrapes per second at most

# The verdict's thresholds. Quiet-machine demo runs show an emulator lag p99 far below the TTFT
# p50 the demo compares (both: docs/benchmarks.md), so a typical step delayed by more than 20 ms
# moves the figures by more than the gaps between policies. A machine over 90% busy has no headroom:
# every process, the router stack included, queues for a core. A replayer that sends more than
# 250 ms late no longer offers the trace's arrival pattern.
TRUST_LAG_P99_S = 0.020
TRUST_LAG_MAX_S = 1.0
TRUST_MACHINE_BUSY = 0.90
TRUST_SEND_LAG_S = 0.25

M_QUERIES = "vllm:prefix_cache_queries_total"
M_HITS = "vllm:prefix_cache_hits_total"
M_SUCCESS = "vllm:request_success_total"
M_PROMPT = "vllm:prompt_tokens_total"
M_PROMPT_CACHED = "vllm:prompt_tokens_cached_total"
M_RUNNING = "vllm:num_requests_running"
M_WAITING = "vllm:num_requests_waiting"
M_PREEMPTIONS = "vllm:num_preemptions_total"
M_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens found in the CPU tier
COUNTERS = (M_QUERIES, M_HITS, M_SUCCESS, M_PROMPT, M_PROMPT_CACHED, M_PREEMPTIONS,
            M_EXTERNAL_HITS)
M_LAG = "emulator_engine_lag_seconds"
M_LAG_MAX = "emulator_engine_lag_max_seconds"

# vllm-router's kv_aware documents this as its tested setup (PEERS.md); the fleet for that peer
# runs with it so its hashes can match the engine's events.
KV_AWARE_HASH_ALGO = "sha256_cbor"
KV_AWARE_PYTHONHASHSEED = "0"


@dataclass(frozen=True)
class CompareConfig:
    """One comparison: the runs (``RouterSpec`` each, in order), the fleet shape shared by all
    runs, the replay settings, where to write results, and the sampling period for busy time."""

    runs: tuple[RouterSpec, ...]
    fleet: FleetConfig
    replay: ReplayConfig
    output_dir: Path
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S
    plots: bool = True
    repeat: int = 1  # rounds of every run, interleaved, each on a fresh fleet
    before_run: Callable[[], None] | None = None  # real engines: empty their prefix caches


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum every sample named in ``names`` over all label sets of a Prometheus text page."""
    wanted = set(names)
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] += float(sample.value)
    return out


@dataclass
class LagHistogram:
    """``emulator_engine_lag_seconds`` summed over replicas: cumulative count per bucket upper
    bound (seconds, ``inf`` last), and the largest ``emulator_engine_lag_max_seconds``."""

    buckets: dict[float, float] = field(default_factory=dict)
    max_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LagHistogram:
        out = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == M_LAG + "_bucket":
                    le = float(sample.labels["le"])
                    out.buckets[le] = out.buckets.get(le, 0.0) + float(sample.value)
                elif sample.name == M_LAG_MAX:
                    out.max_s = max(out.max_s, float(sample.value))
        return out

    def merged(self, other: LagHistogram) -> LagHistogram:
        keys = set(self.buckets) | set(other.buckets)
        return LagHistogram({k: self.buckets.get(k, 0.0) + other.buckets.get(k, 0.0)
                             for k in keys}, max(self.max_s, other.max_s))

    def minus(self, earlier: LagHistogram) -> LagHistogram:
        """The observations made since ``earlier`` (the max is the later one's: a run's fleet is
        fresh, so its max covers the run and its short start-up)."""
        return LagHistogram({k: v - earlier.buckets.get(k, 0.0) for k, v in self.buckets.items()},
                            self.max_s)

    @property
    def count(self) -> float:
        return self.buckets.get(math.inf, 0.0)

    def quantile(self, q: float) -> float | None:
        """Prometheus ``histogram_quantile``: linear within the bucket holding rank q x count;
        None without observations; the last finite bound if the rank is in the +Inf bucket."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le in sorted(self.buckets):
            cum = self.buckets[le]
            if cum >= rank:
                if math.isinf(le):
                    return lower
                width = cum - below
                return lower + (le - lower) * ((rank - below) / width if width > 0 else 1.0)
            lower, below = le, cum
        return lower


def _capped(value: float | None, cap: float) -> float | None:
    return None if value is None else min(value, cap)


# The causes a run can fail the verdict for, in the plain words the closing lines use.
CAUSE_WORDS = {
    "emulator_lag": "the emulated GPUs fell behind their own schedule",
    "machine_busy": "the machine had no CPU headroom, so every process waited for a core",
    "replayer_late": "the replayer could not send on the trace's schedule",
    "no_lag_figures": "the emulator reported no lag figures",
    "errors": "requests failed, so its latencies leave those requests out",
}


def untrusted_causes(m: dict[str, Any]) -> list[tuple[str, str]]:
    """Why one run's latencies cannot be trusted: ``(cause, figure)`` pairs, the cause a key of
    ``CAUSE_WORDS`` and the figure what was measured against which limit; empty when trusted.

    Untrusted when the emulated engines fell behind their own clock (lag p99 over
    ``TRUST_LAG_P99_S`` or max over ``TRUST_LAG_MAX_S``), when the machine was more than
    ``TRUST_MACHINE_BUSY`` busy, when the replayer sent more than ``TRUST_SEND_LAG_S`` late, or
    when requests failed (``num_errors``; the kinds from ``errors_by_kind``). A run without lag
    figures (an emulator that exports none) is untrusted too.
    """
    causes: list[tuple[str, str]] = []
    p99, lag_max = m.get("emulator_lag_p99_s"), m.get("emulator_lag_max_s")
    if m.get("engine") == "vllm":
        pass  # real engines keep no emulated clock to fall behind
    elif p99 is None or lag_max is None:
        causes.append(("no_lag_figures", "the emulator reported no lag figures"))
    else:
        if p99 > TRUST_LAG_P99_S:
            causes.append(("emulator_lag", f"emulator lag p99 {p99 * 1000:.0f} ms > "
                                           f"{TRUST_LAG_P99_S * 1000:.0f} ms"))
        if lag_max > TRUST_LAG_MAX_S:
            causes.append(("emulator_lag", f"emulator lag max {lag_max:.2f} s > "
                                           f"{TRUST_LAG_MAX_S:.2f} s"))
    busy = (m.get("cpu_s") or {}).get("machine_util")
    if busy is not None and busy > TRUST_MACHINE_BUSY:
        causes.append(("machine_busy", f"machine {busy:.1%} busy > {TRUST_MACHINE_BUSY:.0%}"))
    send_lag = m.get("max_send_lag_s")
    if send_lag is not None and send_lag > TRUST_SEND_LAG_S:
        causes.append(("replayer_late", f"replayer sent up to {send_lag:.2f} s late > "
                                        f"{TRUST_SEND_LAG_S:.2f} s"))
    num_errors = m.get("num_errors") or 0
    if num_errors:
        causes.append(("errors", f"{num_errors} of {m.get('num_requests', '?')} requests failed"
                                 + (f" ({describe_errors(m['errors_by_kind'], 3)})"
                                    if m.get("errors_by_kind") else "")))
    return causes


def verdict(m: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether one run's latencies can be trusted: (trusted, reason or None), the reason the
    ``untrusted_causes`` figures joined by "; "."""
    causes = untrusted_causes(m)
    return (not causes, "; ".join(figure for _, figure in causes) or None)


def describe_errors(kinds: Sequence[dict[str, Any]], top: int | None = None) -> str:
    """``errors_by_kind`` in one line: "141 x HTTP 503 'no routable replica' at 12.1-15.3 s"
    per kind, the ``top`` most frequent (all when None), then how many kinds were left out."""
    shown = list(kinds if top is None else kinds[:top])
    parts = []
    for k in shown:
        status = f"HTTP {k['status']}" if k["status"] else "no response"
        when = (f"{k['first_s']:.1f} s" if k["first_s"] == k["last_s"]
                else f"{k['first_s']:.1f}-{k['last_s']:.1f} s")
        parts.append(f"{k['count']} x {status} {k['reason']!r} at {when}")
    if len(kinds) > len(shown):
        parts.append(f"{len(kinds) - len(shown)} more kinds")
    return ", ".join(parts)


async def _page(session: aiohttp.ClientSession, url: str) -> str:
    """GET ``url``/metrics (raises ``aiohttp.ClientError``)."""
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        return await resp.text()


async def scrape_counters_and_lag(urls: Sequence[str], names: Sequence[str]
                                  ) -> tuple[list[dict[str, float]], LagHistogram]:
    """One /metrics page per replica: the named samples summed per replica (``parse_metrics``)
    and the lag histograms of all replicas merged (raises ``aiohttp.ClientError``)."""
    async with aiohttp.ClientSession() as session:
        pages = await asyncio.gather(*(_page(session, u) for u in urls))
    lag = LagHistogram()
    for page in pages:
        lag = lag.merged(LagHistogram.parse(page))
    return [parse_metrics(page, names) for page in pages], lag


async def scrape(session: aiohttp.ClientSession, url: str, names: Sequence[str]) -> dict[str, float]:
    """GET ``url``/metrics and sum the named samples (raises ``aiohttp.ClientError``)."""
    return parse_metrics(await _page(session, url), names)


@dataclass
class BusySampler:
    """Integrates per-replica busy time (running + waiting > 0) and work (running + waiting) from
    periodic gauge scrapes; a sample's value holds until the next one."""

    urls: Sequence[str]
    interval_s: float
    busy_s: list[float] = field(default_factory=list)
    work_request_s: list[float] = field(default_factory=list)
    num_samples: int = 0

    async def run(self) -> None:
        self.busy_s = [0.0] * len(self.urls)
        self.work_request_s = [0.0] * len(self.urls)
        last = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    pages = await asyncio.gather(
                        *(scrape(session, u, (M_RUNNING, M_WAITING)) for u in self.urls))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    logger.debug("busy sampler scrape failed: %s", exc)
                    pages = []
                now = time.perf_counter()
                span = now - last
                last = now
                for i, page in enumerate(pages):
                    active = page[M_RUNNING] + page[M_WAITING]
                    if active > 0:
                        self.busy_s[i] += span
                    self.work_request_s[i] += active * span
                if pages:
                    self.num_samples += 1
                await asyncio.sleep(self.interval_s)


def parse_router_metrics(text: str) -> dict[str, Any]:
    """prefix-router's own view of a run from its /metrics page: decisions per reason
    (``router_requests_total``), predicted hit rate (``router_predicted_hit_tokens_total`` over
    ``router_prompt_tokens_total``) and mean routing overhead (``router_overhead_seconds``)."""
    reasons: dict[str, float] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "router_requests_total":
                reason = sample.labels.get("reason", "")
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
            elif sample.name in ("router_predicted_hit_tokens_total", "router_prompt_tokens_total",
                                 "router_overhead_seconds_sum", "router_overhead_seconds_count"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    prompt = sums.get("router_prompt_tokens_total", 0.0)
    count = sums.get("router_overhead_seconds_count", 0.0)
    return {
        "decisions_per_reason": {k: int(v) for k, v in sorted(reasons.items())},
        "predicted_hit_rate": (sums.get("router_predicted_hit_tokens_total", 0.0) / prompt
                               if prompt else None),
        "mean_overhead_s": sums.get("router_overhead_seconds_sum", 0.0) / count if count else None,
    }


async def scrape_router(url: str) -> dict[str, Any] | None:
    """``parse_router_metrics`` of prefix-router at ``url``; None when it cannot be read."""
    try:
        async with aiohttp.ClientSession() as session, session.get(
                url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            return parse_router_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        logger.warning("cannot read the router's metrics: %s", exc)
        return None


def max_over_mean(values: Sequence[float]) -> float | None:
    """max / mean of ``values``; None when empty or all zero."""
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


@dataclass
class PolicyResult:
    """Everything measured for one run; ``metrics`` is what results.json carries per policy."""

    label: str
    metrics: dict[str, Any]
    records: list[RequestRecord]


async def _measure(fleet: LoopbackFleet, requests: Sequence[TraceRequest], config: CompareConfig,
                   progress: Callable[[str], None]) -> tuple[list[RequestRecord], dict[str, Any]]:
    urls = [r.url for r in fleet.replicas]
    before, lag_before = await scrape_counters_and_lag(urls, COUNTERS)
    cpu_before = cpu_sample(fleet.pids)
    sampler = BusySampler(urls, config.sample_interval_s)
    sampler_task = asyncio.create_task(sampler.run())
    assert fleet.router_url is not None
    replay_config = replace(config.replay, target=fleet.router_url)
    if fleet.config.router.kind in TEXT_ONLY_PEERS:
        # the SGLang gateways reject token-id prompts; send text of the same token counts
        replay_config = replace(replay_config, prompt_format="text")
    try:
        records = await replay(requests, replay_config, progress=progress)
    finally:
        sampler_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler_task
    cpu_after = cpu_sample(fleet.pids)
    after, lag_after = await scrape_counters_and_lag(urls, COUNTERS)
    lag = lag_after.minus(lag_before)
    router_view = (await scrape_router(fleet.router_url)
                   if fleet.config.router.kind == OURS else None)
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    queries = sum(d[M_QUERIES] for d in delta)
    hits = sum(d[M_HITS] for d in delta)
    cpu_hits = sum(d[M_EXTERNAL_HITS] for d in delta)
    summary = summarize(records)
    cpu = cpu_delta(cpu_before, cpu_after)
    ids = [r.replica_id for r in fleet.replicas]
    metrics: dict[str, Any] = {
        "token_hit_rate": hits / queries if queries > 0 else None,
        "tiers_token_hit_rate": (hits + cpu_hits) / queries if queries > 0 else None,
        "cpu_tier_token_hit_rate": cpu_hits / queries if queries > 0 else None,
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p90_s": summary["ttft_p90_s"],
        "ttft_p99_s": summary["ttft_p99_s"],
        "e2e_p50_s": summary["e2e_p50_s"],
        "throughput_rps": summary["throughput_rps"],
        "imbalance": max_over_mean(sampler.busy_s),
        "imbalance_work": max_over_mean(sampler.work_request_s),
        "num_requests": summary["num_requests"],
        "num_errors": summary["num_errors"],
        "errors_by_kind": summary["errors_by_kind"],
        "router_cpu_s_per_request": cpu.get("router", 0.0) / max(1, summary["num_sent"]),
        "requests_per_replica": {i: round(d[M_SUCCESS]) for i, d in zip(ids, delta, strict=True)},
        "requests_per_replica_header": summary["requests_per_replica_header"],
        "busy_s_per_replica": dict(zip(ids, (round(x, 3) for x in sampler.busy_s), strict=True)),
        "work_request_s_per_replica": dict(zip(ids, (round(x, 3) for x in sampler.work_request_s),
                                               strict=True)),
        "hit_rate_per_replica": {i: (d[M_HITS] / d[M_QUERIES] if d[M_QUERIES] else None)
                                 for i, d in zip(ids, delta, strict=True)},
        "prefill_tokens_per_replica": {i: int(d[M_QUERIES] - d[M_HITS])
                                       for i, d in zip(ids, delta, strict=True)},
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "client_token_hit_rate": summary["client_token_hit_rate"],
        "overestimate_request_rate": summary["overestimate_request_rate"],
        "overestimated_token_share": summary["overestimated_token_share"],
        "num_preemptions": sum(d[M_PREEMPTIONS] for d in delta),
        "max_send_lag_s": summary["max_send_lag_s"],
        "busy_samples": sampler.num_samples,
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "emulator_cpu_s_per_request": cpu.get("emulator", 0.0) / max(1, summary["num_sent"]),
        # (interpolation inside a bucket may pass the largest lag seen: capped there)
        "emulator_lag_p50_s": _capped(lag.quantile(0.5), lag.max_s),
        "emulator_lag_p99_s": _capped(lag.quantile(0.99), lag.max_s),
        "emulator_lag_max_s": lag.max_s if lag.count else None,
        "emulator_steps": int(lag.count),
        "router_view": router_view,
        "engine": "vllm" if fleet.config.engines else "emulator",
    }
    metrics["trusted"], metrics["untrusted_reason"] = verdict(metrics)
    metrics["untrusted_causes"] = list(dict.fromkeys(c for c, _ in untrusted_causes(metrics)))
    return records, metrics


def run_policy(spec: RouterSpec, requests: Sequence[TraceRequest], config: CompareConfig,
               progress: Callable[[str], None]) -> PolicyResult:
    """Start a fresh fleet for ``spec``, replay ``requests``, measure, tear down. Raises
    ``FleetError`` when the fleet does not start."""
    fleet_config = replace(config.fleet, router=spec,
                           log_dir=config.output_dir / "logs" / spec.label.replace(":", "-"))
    if spec.kind == VLLM_ROUTER and spec.policy == "kv_aware":
        fleet_config = replace(fleet_config, hash_algo=KV_AWARE_HASH_ALGO,
                               python_hash_seed=KV_AWARE_PYTHONHASHSEED, int_block_hashes=False)
    if config.before_run is not None:
        config.before_run()
    with LoopbackFleet(fleet_config, progress=progress) as fleet:
        progress(f"[{spec.label}] fleet ready: router {fleet.router_url}, "
                 f"{len(fleet.replicas)} replicas; replaying {len(requests)} requests")
        records, metrics = asyncio.run(_measure(
            fleet, requests, config, lambda line: progress(f"[{spec.label}] {line}")))
        fleet.check_alive()
    metrics["fleet"] = {"hash_algo": fleet_config.hash_algo,
                        "python_hash_seed": fleet_config.python_hash_seed,
                        "int_block_hashes": fleet_config.int_block_hashes}
    metrics["priority"] = fleet.priority
    return PolicyResult(spec.label, metrics, records)


# -- output ------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec)


TABLE_COLUMNS = (  # (header, key, format, scale, legend)
    ("policy", None, "", 1.0, ""),
    ("prefix hit %", "token_hit_rate", ".1f", 100.0,
     "share of prompt tokens the engines found in their GPU prefix cache (their own "
     "vllm:prefix_cache_hits / queries counters)"),
    ("+CPU tier hit %", "tiers_token_hit_rate", ".1f", 100.0,
     "the same with the prompt tokens loaded from the replicas' CPU tier added"),
    ("TTFT p50 s", "ttft_p50_s", ".3f", 1.0,
     "time to first token, seconds from sending to the first token (client side; successful "
     "requests only); p50/p90/p99 = median, 90th, 99th percentile"),
    ("TTFT p90 s", "ttft_p90_s", ".3f", 1.0, ""),
    ("TTFT p99 s", "ttft_p99_s", ".3f", 1.0, ""),
    ("e2e p50 s", "e2e_p50_s", ".2f", 1.0, "median end-to-end time of a request, seconds"),
    ("req/s", "throughput_rps", ".2f", 1.0, "successful requests per second"),
    ("busy max/mean", "imbalance", ".2f", 1.0,
     "busy time of the busiest replica over the mean of all replicas (1.00 = even load)"),
    ("work max/mean", "imbalance_work", ".2f", 1.0,
     "the same for request-seconds (requests running or waiting, integrated over time)"),
    ("requests", "num_requests", "d", 1.0, "requests replayed"),
    ("failed", "num_errors", "d", 1.0, "requests that failed (by kind in the notes below)"),
    ("router CPU ms/req", "router_cpu_s_per_request", ".2f", 1000.0,
     "CPU milliseconds the router process used per request"),
    ("trusted", "trusted", "t", 1.0,
     "whether the row's latencies can be trusted (why not: the verdict at the end)"),
)
TIER_KEYS = ("tiers_token_hit_rate",)  # columns shown only for a fleet with a CPU tier
RANGED = ("token_hit_rate", "tiers_token_hit_rate", "ttft_p50_s", "ttft_p99_s")  # shown as median (min-max)


def _cell(m: dict[str, Any], key: str, spec: str, scale: float) -> str:
    if spec == "d":
        return str(m.get(key, "-"))
    if spec == "t":
        return "-" if key not in m else ("yes" if m[key] else "NO")
    text = _fmt(m.get(key), spec, scale)
    span = (m.get("range") or {}).get(key)
    if span and key in RANGED:
        text += f" ({_fmt(span[0], spec, scale)}-{_fmt(span[1], spec, scale)})"
    return text


def _fixed_width(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as fixed-width lines, the first column left-aligned, a rule under the
    header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def format_table(policies: dict[str, dict[str, Any]], cpu_tier: bool = False,
                 legend: bool = True) -> str:
    """A fixed-width text table, one row per policy; with repeats, the medians, and the range
    over the rounds beside the hit rate and TTFT figures. The ``TIER_KEYS`` columns only with
    ``cpu_tier``; with ``legend``, one line per column under the table saying what it holds."""
    columns = [c for c in TABLE_COLUMNS if cpu_tier or c[1] not in TIER_KEYS]
    rows = [[name for name, *_ in columns]]
    for label, m in policies.items():
        row = [label]
        for _name, key, spec, scale, _legend in columns[1:]:
            assert key is not None
            row.append(_cell(m, key, spec, scale))
        rows.append(row)
    lines = _fixed_width(rows)
    if legend:
        rounds = max((m.get("rounds") or 1 for m in policies.values()), default=1)
        lines.append("")
        lines.extend(f"  {name}: {text}" for name, _key, _spec, _scale, text in columns if text)
        if rounds > 1:
            lines.append(f"  with {rounds} rounds: each figure is the median over the rounds, "
                         "(min-max) beside the hit rates and TTFT p50/p99")
    return "\n".join(lines)


def format_cpu_table(policies: dict[str, dict[str, Any]]) -> str:
    """CPU seconds per component during each replay (with repeats: of the median round), the
    machine's busy share of its cores, the emulator's CPU per request and its lag."""
    comps = ["redis", "emulator", "workers", "router", "replayer"]
    header = ["policy", *[f"{c} s" for c in comps], "wall s", "machine busy",
              "emulator ms/req", "emulator lag p50 / p99 / max s"]
    rows = [header]
    for label, m in policies.items():
        cpu = m.get("cpu_s", {})
        lag = " / ".join(_fmt(m.get(k), ".3f") for k in
                         ("emulator_lag_p50_s", "emulator_lag_p99_s", "emulator_lag_max_s"))
        rows.append([label, *[_fmt(cpu.get(c), ".1f") for c in comps], _fmt(cpu.get("wall_s"), ".1f"),
                     _fmt(cpu.get("machine_util"), ".1%"),
                     _fmt(m.get("emulator_cpu_s_per_request"), ".1f", 1000.0), lag])
    return "\n".join(_fixed_width(rows))


def write_plots(policies: dict[str, dict[str, Any]], records: dict[str, list[RequestRecord]],
                output_dir: Path, bounds: dict[str, Any] | None = None) -> list[Path]:
    """TTFT CDF per policy, hit rate per policy (with simulated bounds as lines), requests and
    busy time per replica per policy. Returns the written PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths: list[Path] = []
    labels = list(policies)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label in labels:
        recs = records.get(label, [])
        ttfts = np.sort([r.ttft_s for r in recs if r.ok and r.ttft_s is not None])
        failed = sum(1 for r in recs if not r.ok)
        trusted = policies[label].get("trusted", True)
        name = label + ("" if trusted else " (NOT TRUSTED)") + (f", {failed} failed" if failed else "")
        if len(ttfts):  # over all requests: failed ones never arrive, so the curve stops short of 1
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(recs), label=name,
                    linestyle="-" if trusted else "--")
        elif failed:
            ax.plot([], [], label=name + " (no successful request)")
    floor = (bounds or {}).get("ttft_floor") or {}
    if floor.get("percentiles_s"):
        ax.plot(floor["percentiles_s"], np.arange(len(floor["percentiles_s"])) / 100.0,
                color="black", linestyle=":", linewidth=1.5,
                label="TTFT floor: each prompt's own prefill on an idle replica "
                      "(no policy can be left of it)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT: seconds from sending a request to its first token (log scale)")
    ax.set_ylabel("fraction of all requests (failed ones never arrive)")
    ax.set_title("TTFT CDF per policy (dashed: an untrusted row, whose latencies include waits "
                 "for a core)", fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    path = output_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(8, 5))
    rates = [100.0 * (policies[label].get("token_hit_rate") or 0.0) for label in labels]
    default = f"{OWN_POLICIES[0]}"  # the router's default policy, green
    ax.bar(range(len(labels)), rates,
           color=["tab:green" if lb == default else "tab:gray" for lb in labels])
    # the values go under the bars, with the names, where no bound line can cross them
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{lb}\n{rate:.1f}%" for lb, rate in zip(labels, rates, strict=True)],
                       rotation=20, ha="right")
    handles: list[Any] = [Patch(color="tab:green", label=f"{default}: prefix-router's default "
                                                          "policy"),
                          Patch(color="tab:gray", label="other policies and routers")]
    if bounds:
        for key, style, what in (
                ("single_cache", "--", "single cache as large as the whole fleet's KV "
                                       "(the placement bound)"),
                ("round_robin", ":", "round-robin placement")):
            value = bounds.get(key, {}).get("token_hit_rate")
            if value is not None:
                handles.append(ax.axhline(100 * value, linestyle=style, color="black",
                                          label=f"simulated {what} ({100 * value:.1f}%)"))
    ax.legend(handles=handles, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=1)
    ax.set_ylabel("fleet token prefix-hit rate (%)")
    ax.set_title("Prefix-cache hit rate per policy (the engines' own counters)")
    path = output_dir / "hit_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    width = 0.8 / max(1, len(labels))
    for k, label in enumerate(labels):
        m = policies[label]
        for ax, key in zip(axes, ("requests_per_replica", "busy_s_per_replica"), strict=True):
            per = m.get(key) or {}
            xs = np.arange(len(per)) + k * width
            ax.bar(xs, list(per.values()), width=width, label=label)
    axes[0].set_ylabel("requests")
    axes[1].set_ylabel("busy time (s)")
    any_policy = next(iter(policies.values()), {})
    names = list((any_policy.get("requests_per_replica") or {}).keys())
    axes[1].set_xticks(np.arange(len(names)) + 0.4 - width / 2)
    axes[1].set_xticklabels(names, rotation=20, ha="right")
    axes[0].set_title("Load per replica per policy")
    handles, names_ = axes[0].get_legend_handles_labels()
    fig.legend(handles, names_, loc="lower center", ncol=4, fontsize="small")
    path = output_dir / "load_per_replica.png"
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


# -- the whole comparison ----------------------------------------------------------------------

@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so fleets are torn down on ``kill`` as on Ctrl-C."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _records_name(label: str, round_no: int, repeat: int) -> str:
    base = label.replace(":", "-")
    return f"records-{base}.jsonl" if repeat == 1 else f"records-{base}-r{round_no}.jsonl"


def run_compare(config: CompareConfig, requests: Sequence[TraceRequest],
                trace_info: dict[str, Any], progress: Callable[[str], None],
                bounds: dict[str, Any] | None = None,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every configured policy on a fresh fleet, ``config.repeat`` rounds interleaved, write
    ``results.json``, per-run records (``records-<label>.jsonl``, ``-r<round>`` with repeats)
    and plots into ``config.output_dir``; return the results dict. A run whose fleet fails is
    reported under ``failed`` and the others still run."""
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    repeat = max(1, config.repeat)
    rounds: list[dict[str, dict[str, Any]]] = [{} for _ in range(repeat)]
    round_records: list[dict[str, list[RequestRecord]]] = [{} for _ in range(repeat)]
    failed: dict[str, str] = {}
    started = time.monotonic()
    total = repeat * len(config.runs)
    with _sigterm_as_interrupt():
        n = 0
        for r in range(repeat):
            for spec in config.runs:
                n += 1
                tag = spec.label if repeat == 1 else f"{spec.label} round {r + 1}/{repeat}"
                progress(f"=== run {n}/{total}: {tag} "
                         f"({time.monotonic() - started:.0f} s elapsed) ===")
                try:
                    result = run_policy(spec, requests, config, progress)
                except (FleetError, OSError, aiohttp.ClientError, TimeoutError) as exc:
                    logger.error("run %s failed: %s", tag, exc)
                    progress(f"[{spec.label}] FAILED: {str(exc)[:2000]}")
                    failed[tag] = str(exc)[:4000]
                    continue
                rounds[r][spec.label] = result.metrics
                round_records[r][spec.label] = result.records
                write_records(result.records, out / _records_name(spec.label, r + 1, repeat))
                m = result.metrics
                progress(f"[{spec.label}] hit rate {_fmt(m['token_hit_rate'], '.1%')}, "
                         f"TTFT p50 {_fmt(m['ttft_p50_s'], '.3f')} s, errors {m['num_errors']}, "
                         f"emulator lag p99 {_fmt(m['emulator_lag_p99_s'], '.3f')} s, "
                         + ("trusted" if m["trusted"] else f"NOT TRUSTED: {m['untrusted_reason']}"))
    policies, records = aggregate_rounds(rounds, round_records)
    fleet_cfg = config.fleet
    results: dict[str, Any] = {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": list(argv) if argv is not None else None,
        "trace": trace_info,
        "fleet": {"engine": "vllm" if fleet_cfg.engines else "emulator",
                  "replicas": fleet_cfg.replicas, "model": fleet_cfg.model,
                  "block_size": fleet_cfg.block_size, "hash_algo": fleet_cfg.hash_algo,
                  "num_gpu_blocks_per_replica": fleet_cfg.num_gpu_blocks,
                  "time_scale": fleet_cfg.time_scale,
                  "emulator_args": list(fleet_cfg.emulator_args),
                  "router_args": list(fleet_cfg.router_args)},
        "replay": {k: v for k, v in asdict(config.replay).items() if k != "target"},
        "bounds": bounds,
        "repeat": repeat,
        "policies": policies,
        "ranking": ranking(rounds),
        "trust_thresholds": {"emulator_lag_p99_s": TRUST_LAG_P99_S,
                             "emulator_lag_max_s": TRUST_LAG_MAX_S,
                             "machine_busy": TRUST_MACHINE_BUSY,
                             "max_send_lag_s": TRUST_SEND_LAG_S},
        "failed": failed,
        "duration_s": round(time.monotonic() - started, 1),
    }
    if repeat > 1:
        results["rounds"] = rounds
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if config.plots and policies:
        results["plots"] = [str(p) for p in write_plots(policies, records, out, bounds)]
    return results


# Figures aggregated over rounds: the median, with the range beside it.
AGGREGATED = ("token_hit_rate", "tiers_token_hit_rate", "cpu_tier_token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s",
              "throughput_rps", "imbalance", "imbalance_work", "router_cpu_s_per_request",
              "emulator_cpu_s_per_request", "emulator_lag_p50_s", "emulator_lag_p99_s",
              "emulator_lag_max_s", "client_token_hit_rate", "max_send_lag_s")


def aggregate_rounds(rounds: Sequence[dict[str, dict[str, Any]]],
                     round_records: Sequence[dict[str, list[RequestRecord]]],
                     ) -> tuple[dict[str, dict[str, Any]], dict[str, list[RequestRecord]]]:
    """Per label, one metrics dict: with one round, that round's; with several, the round whose
    TTFT p50 is the median (its per-replica figures and records feed the plots), with every
    ``AGGREGATED`` figure replaced by its median over the rounds, ``range`` [min, max] per
    figure, ``rounds`` the number of rounds, and ``trusted`` only if every round was (the
    reasons of the untrusted rounds in ``untrusted_reason``)."""
    labels = list(dict.fromkeys(label for rnd in rounds for label in rnd))
    policies: dict[str, dict[str, Any]] = {}
    records: dict[str, list[RequestRecord]] = {}
    for label in labels:
        runs = [(i, rnd[label]) for i, rnd in enumerate(rounds) if label in rnd]
        if len(rounds) == 1:
            policies[label] = runs[0][1]
            records[label] = round_records[runs[0][0]][label]
            continue
        by_ttft = sorted(runs, key=lambda ir: (ir[1].get("ttft_p50_s") is None,
                                               ir[1].get("ttft_p50_s") or 0.0))
        mid_index, mid = by_ttft[(len(by_ttft) - 1) // 2]
        m = dict(mid)
        m["range"] = {}
        for key in AGGREGATED:
            values = [r[key] for _, r in runs if isinstance(r.get(key), int | float)]
            if values:
                m[key] = statistics.median(values)
                m["range"][key] = [min(values), max(values)]
        m["rounds"] = len(runs)
        m["median_round"] = mid_index + 1
        bad = [f"round {i + 1}: {r['untrusted_reason']}" for i, r in runs if not r.get("trusted")]
        m["trusted"] = not bad
        m["untrusted_reason"] = "; ".join(bad) or None
        m["untrusted_causes"] = list(dict.fromkeys(
            c for _, r in runs if not r.get("trusted") for c in r.get("untrusted_causes", [])))
        m["num_errors_all_rounds"] = sum(r.get("num_errors") or 0 for _, r in runs)
        m["errors_by_kind"] = [{"round": i + 1, **k} for i, r in runs
                               for k in r.get("errors_by_kind") or []]
        policies[label] = m
        records[label] = round_records[mid_index][label]
    return policies, records


def ranking(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The order by TTFT p50 in each round (fastest first) of the policies measured and trusted
    in every round, and whether it was the same in every round: ``held`` only with two rounds
    or more and at least two policies ranked (an order of untrusted latencies proves nothing, so
    with none trusted there is no ``held``). ``untrusted`` lists the policies measured in every round but not
    trusted in all, ``left_out`` those not measured in every round."""
    measured = [label for label in (rounds[0] if rounds else {})
                if all(label in rnd and rnd[label].get("ttft_p50_s") is not None
                       for rnd in rounds)]
    common = [label for label in measured if all(rnd[label].get("trusted") for rnd in rounds)]

    def order(rnd: dict[str, dict[str, Any]]) -> list[str]:
        return sorted(common, key=lambda label: float(rnd[label]["ttft_p50_s"]))

    orders = [order(rnd) for rnd in rounds]
    left_out = sorted({label for rnd in rounds for label in rnd} - set(measured))
    out: dict[str, Any] = {"by": "ttft_p50_s", "orders": orders, "left_out": left_out,
                           "untrusted": [label for label in measured if label not in common]}
    if len(common) >= 2 and len(rounds) > 1:
        out["held"] = all(o == orders[0] for o in orders)
    return out


def resolve_runs(policies: str, peers: str) -> tuple[tuple[RouterSpec, ...], dict[str, str]]:
    """Runs from a comma-separated policy list (own policy names, or ``smg:POLICY`` /
    ``vllm-router:POLICY`` / ``sglang:POLICY``) and the peers mode (``auto``: add the peer runs
    of ``PEER_SPECS`` when installed,
    ``yes``: add them and fail if missing, ``no``). Returns (runs, skipped label -> reason).
    Raises ``ValueError`` for an unknown name or a named peer that is not installed."""
    runs: list[RouterSpec] = []
    for name in (p.strip() for p in policies.split(",") if p.strip()):
        if ":" in name:
            kind, policy = name.split(":", 1)
            if kind not in PEER_KINDS:
                raise ValueError(f"unknown router {kind!r} in {name!r}")
            if not peer_available(kind):
                raise ValueError(f"{kind} is not installed, so {name} cannot run "
                                 "(pip install 'prefix-router[peers]')")
            runs.append(RouterSpec(kind, policy))
        elif name in OWN_POLICIES:
            runs.append(RouterSpec(OURS, name))
        else:
            raise ValueError(f"unknown policy {name!r}; own policies: {', '.join(OWN_POLICIES)}")
    skipped: dict[str, str] = {}
    if peers not in ("auto", "yes", "no"):
        raise ValueError("--peers must be auto, yes or no")
    if peers != "no":
        for spec in PEER_SPECS:
            if spec in runs:
                continue
            if peer_available(spec.kind):
                runs.append(spec)
            elif peers == "yes":
                raise ValueError(f"{spec.kind} is not installed (pip install 'prefix-router[peers]')")
            else:
                skipped[spec.label] = "not installed (pip install 'prefix-router[peers]')"
    return tuple(runs), skipped


# -- CLI ---------------------------------------------------------------------------------------

# The demo: the first 1,000 requests of the packaged Mooncake slice on 8 replicas of 32,000
# 16-token blocks each (512k tokens: an 8B-class model on an 80 GB GPU, the DESIGN.md reference
# point where capacity matters: the slice's single-cache bound is well above round-robin's hit
# rate), replayed up to 10x faster with the emulator as much faster, so the fleet is as loaded as
# in the real trace (the slice's figures and run times: docs/benchmarks.md). The speed is chosen
# from the machine's headroom before the first run (``loadtest.calibrate``) unless --speedup
# forces it.
DEMO_DEFAULTS: dict[str, Any] = {
    "replicas": 8,
    "limit": 1000,
    "num_gpu_blocks": 32_000,
}


def add_compare_parsers(sub: Any, add_slice_args: Callable[[argparse.ArgumentParser, int | None], None],
                        make_replay_config: Callable[[argparse.Namespace, str, str], ReplayConfig]) -> None:
    """Register ``compare`` and ``demo`` on the CLI's subparsers."""
    for name in ("compare", "demo"):
        demo = name == "demo"
        p = sub.add_parser(name, help=(
            "the main job: compare every policy on the packaged Mooncake slice (about 3 min; 5 with the peers)"
            if demo else "compare routing policies side by side, each on a fresh emulated fleet"))
        add_slice_args(p, DEMO_DEFAULTS["limit"] if demo else 1000)
        p.add_argument("--policies", default=",".join(OWN_POLICIES),
                       help="comma-separated: " + ", ".join(OWN_POLICIES) +
                            ", smg:cache_aware, smg:prefix_hash, vllm-router:cache_aware, "
                            "vllm-router:kv_aware (sglang:POLICY with sglang-router installed)")
        p.add_argument("--peers", choices=("auto", "yes", "no"), default="auto",
                       help="also run the peer routers (auto: when the peers extra is installed)")
        p.add_argument("--replicas", type=int, default=DEMO_DEFAULTS["replicas"])
        p.add_argument("--num-gpu-blocks", type=int,
                       default=DEMO_DEFAULTS["num_gpu_blocks"] if demo else None,
                       help="KV capacity per replica in block-size-token blocks "
                            "(emulator --num-gpu-blocks-override)")
        p.add_argument("--time-scale", type=float, default=None,
                       help="emulator time scale (default: equal to --speedup, so the fleet is as "
                            "loaded as in the real trace)")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--index-stride", type=int, default=DEFAULT_INDEX_STRIDE,
                       help="coarse-index stride of workers and router (1 = exact index)")
        p.add_argument("--model", default="emulated-llm")
        p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
        p.add_argument("--emulator-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for prefix-worker emulate (repeatable)")
        p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for the router of every run (repeatable)")
        p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for every worker (repeatable; e.g. "
                            "--worker-arg=--kv-tiers --worker-arg=GPU hides the CPU tier)")
        p.add_argument("--cpu-tier-ratio", type=float, default=0.0, metavar="R",
                       help="give every replica a CPU tier (vLLM native KV offloading) of R x "
                            "its GPU KV capacity (emulator --num-cpu-blocks-override; needs "
                            "--num-gpu-blocks); the bounds then include the two-tier single cache")
        p.add_argument("--sample-interval", type=float, default=DEFAULT_SAMPLE_INTERVAL_S,
                       help="seconds between gauge scrapes for busy time")
        p.add_argument("--output-dir", type=Path, default=None,
                       help="default: results/<command>-<timestamp>/")
        p.add_argument("--repeat", type=int, default=1, metavar="N",
                       help="run every policy N times, interleaved, each on a fresh fleet, and "
                            "report medians and ranges (default 1)")
        p.add_argument("--no-priority", action="store_true",
                       help="do not run the emulator at a higher OS priority than the rest")
        p.add_argument("--no-plots", action="store_true")
        p.add_argument("--no-bounds", action="store_true",
                       help="skip the placement-only simulation of the slice")
        p.add_argument("--engine", choices=("emulator", "vllm"), default="emulator",
                       help="the replicas: the emulator, or real vLLM CPU engines (the vllm "
                            "extra; --replicas of them, about 4 GB each, started once and "
                            "reset between runs; block size 32; their TTFT is CPU TTFT)")
        p.set_defaults(func=lambda a, _demo=demo: cmd_compare(a, make_replay_config, _demo))
        if demo:
            p.set_defaults(speedup=None)  # chosen from the machine's headroom (loadtest.calibrate)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_compare(args: argparse.Namespace,
                make_replay_config: Callable[[argparse.Namespace, str, str], ReplayConfig],
                demo: bool) -> int:
    try:
        runs, skipped = resolve_runs(args.policies, args.peers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for label, reason in skipped.items():
        _progress(f"note: skipping {label}: {reason}")
    trace_path = args.trace or packaged_trace_path()
    requests = read_trace(trace_path, start=args.start, limit=args.limit, window_s=args.window)
    if args.engine == "vllm":
        error = _check_vllm_args(args, runs)
        if error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        requests = _fitting_requests(args, requests)
    if not requests:
        print("no requests in the selected slice", file=sys.stderr)
        return 2
    if args.speedup is None:  # the demo without --speedup: fit the speed to this machine
        if not _choose_speed(args, requests):
            return 3
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    output_dir = args.output_dir or Path("results") / f"{'demo' if demo else 'compare'}-{stamp}"
    time_scale = args.time_scale if args.time_scale is not None else args.speedup
    emulator_args = list(args.emulator_arg)
    cpu_blocks = 0
    if args.cpu_tier_ratio:
        if args.cpu_tier_ratio < 0 or not args.num_gpu_blocks:
            print("error: --cpu-tier-ratio needs a ratio > 0 and --num-gpu-blocks", file=sys.stderr)
            return 2
        cpu_blocks = round(args.cpu_tier_ratio * args.num_gpu_blocks)
        emulator_args += ["--num-cpu-blocks-override", str(cpu_blocks)]
    fleet = FleetConfig(router=runs[0] if runs else RouterSpec(OURS, "prefix"),
                        replicas=args.replicas, model=args.model, block_size=args.block_size,
                        num_gpu_blocks=args.num_gpu_blocks, time_scale=time_scale,
                        redis_url=args.redis_url, emulator_args=tuple(emulator_args),
                        router_args=tuple(args.router_arg), worker_args=tuple(args.worker_arg),
                        emulator_priority=not args.no_priority, index_stride=args.index_stride)
    config = CompareConfig(runs=runs, fleet=fleet,
                           replay=make_replay_config(args, "http://unused", args.model),
                           output_dir=output_dir, sample_interval_s=args.sample_interval,
                           plots=not args.no_plots, repeat=args.repeat)
    if args.repeat < 1:
        print("error: --repeat must be at least 1", file=sys.stderr)
        return 2
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    trace_info = {"path": str(trace_path), "start": args.start, "limit": args.limit,
                  "window_s": args.window, "num_requests": len(requests),
                  "trace_span_s": span_s, "first_index": requests[0].index,
                  "last_index": requests[-1].index}
    bounds = None
    if not args.no_bounds:
        from loadtest.simulate import simulate_bounds

        capacity_tokens = (args.num_gpu_blocks * args.block_size) if args.num_gpu_blocks else None
        bounds = simulate_bounds(requests, args.replicas, capacity_tokens,
                                 cpu_capacity_tokens_per_replica=cpu_blocks * args.block_size)
        bounds["ttft_floor"] = (None if args.engine == "vllm" else slice_ttft_floor(
            requests, args.block_size, time_scale, args.emulator_arg))
    _progress(f"comparing {len(runs)} runs ({', '.join(s.label for s in runs)}"
              f"{f', {args.repeat} rounds interleaved' if args.repeat > 1 else ''}) on "
              f"{len(requests)} requests ({span_s:.0f} s of trace, about {span_s / args.speedup:.0f} s "
              f"each at speedup {args.speedup}), {args.replicas} replicas, "
              f"{args.num_gpu_blocks or 'default'} KV blocks each"
              f"{f' + a CPU tier of {cpu_blocks}' if cpu_blocks else ''}, time scale {time_scale}; "
              f"output in {output_dir}")
    try:
        with contextlib.ExitStack() as stack:
            if args.engine == "vllm":
                config = _on_vllm_engines(stack, config, args)
            results = run_compare(config, requests, trace_info, _progress, bounds,
                                  argv=sys.argv if argv_is_cli() else None)
    except KeyboardInterrupt:
        _progress("interrupted; fleets stopped")
        return 130
    results["skipped"] = skipped
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(format_table(results["policies"], cpu_tier=cpu_blocks > 0))
    print()
    print("CPU seconds per component during each replay:")
    print(format_cpu_table(results["policies"]))
    if bounds:
        print()
        print(format_bounds(bounds, results["policies"]))
    notes = run_notes(results["policies"])
    results["notes"] = notes
    results["verdict"] = verdict_lines(results)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    for note in notes:
        print(f"\nnote: {note}")
    print()
    for line in results["verdict"]:
        print(line)
    for label, reason in {**results["failed"], **skipped}.items():
        print(f"\n{label}: not measured: {reason.splitlines()[0] if reason else ''}")
    print(f"\nresults: {output_dir / 'results.json'}")
    print(f"records: {output_dir}/records-<policy>.jsonl (one line per request)")
    for plot in results.get("plots", []):
        print(f"plot:    {plot}")
    return 0 if results["policies"] and not results["failed"] else 1


def _check_vllm_args(args: argparse.Namespace, runs: Sequence[RouterSpec]) -> str | None:
    """Why ``--engine vllm`` cannot run as asked (None when it can); sets the block size and
    model to the engines' own."""
    import psutil

    from loadtest.vllm_engine import BLOCK_SIZE, MODEL_NAME, unavailable_reason
    from loadtest.vllm_fleet import ENGINE_BYTES, engines_that_fit

    reason = unavailable_reason()
    if reason is not None:
        return reason
    peers = [spec.label for spec in runs if spec.kind != OURS]
    if peers:
        return f"--engine vllm runs prefix-router's own policies only (not {', '.join(peers)})"
    if args.block_size not in (16, BLOCK_SIZE) or args.cpu_tier_ratio:
        return (f"vLLM's CPU build runs block size {BLOCK_SIZE} and has no CPU tier; drop "
                "--block-size and --cpu-tier-ratio")
    fit = engines_that_fit(psutil.virtual_memory().available)
    if args.replicas > fit:
        return (f"{args.replicas} vLLM engines need about {ENGINE_BYTES / 1e9:.0f} GB each; this "
                f"machine has room for {fit} now (--replicas {max(1, fit)})")
    args.block_size, args.model = BLOCK_SIZE, MODEL_NAME
    return None


def _fitting_requests(args: argparse.Namespace, requests: Sequence[TraceRequest],
                      ) -> list[TraceRequest]:
    """The requests whose prompt and output fit in the engines' ``max_model_len`` (vLLM
    refuses longer ones with a 400); says how many were left out."""
    from loadtest.vllm_fleet import max_model_len

    limit = max_model_len(args.num_gpu_blocks)
    cap = args.max_output_tokens

    def fits(r: TraceRequest) -> bool:
        return r.input_length + min(r.output_length, cap or r.output_length) <= limit

    kept = [r for r in requests if fits(r)]
    if len(kept) < len(requests):
        _progress(f"note: left out {len(requests) - len(kept)} of {len(requests)} requests longer "
                  f"than the engines' max_model_len of {limit} tokens")
    return kept


def _on_vllm_engines(stack: contextlib.ExitStack, config: CompareConfig,
                     args: argparse.Namespace) -> CompareConfig:
    """Start ``args.replicas`` vLLM CPU engines (stopped with ``stack``) and return ``config``
    with its fleet on them: PYTHONHASHSEED 0 as the engines, the model directory as the
    router's tokenizer, first-byte deadlines and a drain time for CPU engines, their prefix
    caches emptied before every run."""
    from loadtest.vllm_fleet import (
        DRAIN_TIMEOUT_S,
        ENGINE_FLEET_START_TIMEOUT_S,
        HASH_SEED,
        ROUTER_ARGS,
        started_engines,
    )

    engines = stack.enter_context(started_engines(
        args.replicas, args.num_gpu_blocks, config.output_dir / "logs", _progress))
    fleet = replace(config.fleet, engines=engines.replicas, engine_pids=engines.pids,
                    python_hash_seed=HASH_SEED, start_timeout_s=ENGINE_FLEET_START_TIMEOUT_S,
                    router_args=(*ROUTER_ARGS, *config.fleet.router_args,
                                 "--tokenizer", str(engines.model_dir)))
    replay = replace(config.replay, drain_timeout_s=max(config.replay.drain_timeout_s,
                                                        DRAIN_TIMEOUT_S))
    return replace(config, fleet=fleet, replay=replay, before_run=engines.reset)


def _choose_speed(args: argparse.Namespace, requests: Sequence[TraceRequest]) -> bool:
    """Measure the machine for a few seconds and set ``args.speedup`` (the time scale follows
    unless ``--time-scale`` was given); print what was chosen and why. False (after saying so)
    when even the slowest sensible speed would leave the machine over the verdict's limit."""
    from loadtest.calibrate import CALIBRATION_S, choose_speedup, measure_headroom

    _progress(f"measuring this machine's CPU headroom for {CALIBRATION_S:.0f} s to choose the "
              "replay speed (--speedup X skips this)")
    headroom = measure_headroom()
    span_s = max(1e-3, (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0)
    choice = choose_speedup(headroom, len(requests), span_s, limit_busy=TRUST_MACHINE_BUSY)
    wake = (f"; this process woke up to {headroom.wake_lag_p99_s * 1000:.1f} ms late (p99) from "
            "short sleeps")
    if not choice.can_trust:
        _progress(f"cannot fit the demo to this machine: {choice.why}{wake}. Every row would be "
                  "untrusted (its latencies would include waits for a core). Stop other work and "
                  f"run again, or force a speed with --speedup {choice.speedup:g} (fewer "
                  "--replicas or a smaller --limit also help).")
        return False
    args.speedup = choice.speedup
    _progress(f"replay speed {choice.speedup:g} (emulator time scale "
              f"{args.time_scale if args.time_scale is not None else choice.speedup:g}): "
              f"{choice.why}{wake}")
    return True


def run_notes(policies: dict[str, dict[str, Any]]) -> list[str]:
    """Caveats a reader of the table must know, derived from the runs that happened: every
    failed request by kind, and the peers' own conditions."""
    notes = []
    for label, m in policies.items():
        kinds = m.get("errors_by_kind") or []
        if kinds:
            rounds = sorted({k["round"] for k in kinds if "round" in k})
            per_round = [(f"round {r}: ", [k for k in kinds if k.get("round") == r])
                         for r in rounds] or [("", kinds)]
            total = sum(k["count"] for k in kinds)
            notes.append(f"{label}: {total} failed requests, by kind (HTTP status, reason, when "
                         "sent in seconds from the replay's start): "
                         + "; ".join(f"{head}{describe_errors(ks)}" for head, ks in per_round))
        if label.split(":", 1)[0] in TEXT_ONLY_PEERS:
            cpu = m.get("cpu_s", {})
            per_req = cpu.get("emulator", 0.0) / max(1, m.get("num_requests") or 1)
            notes.append(
                f"{label} accepts only text prompts over HTTP, so its run sends text of exactly the same "
                f"Qwen3 token counts and the emulator tokenizes it on this machine's CPU "
                f"({per_req * 1000:.0f} ms of emulator CPU per request in this run; the machine "
                f"was {cpu.get('machine_util', 0.0):.0%} busy): its hit rate and balance are "
                f"comparable, its TTFT and e2e latency are not.")
        if m.get("engine") == "vllm" and not any("CPU engines" in n for n in notes):
            from loadtest.vllm_fleet import CPU_TTFT_NOTE

            notes.append(CPU_TTFT_NOTE)
        if label == f"{VLLM_ROUTER}:kv_aware":
            notes.append(
                f"{label} ran on a fleet with {KV_AWARE_HASH_ALGO}, PYTHONHASHSEED="
                f"{KV_AWARE_PYTHONHASHSEED} and byte-form KV-event hashes (its documented tested "
                f"setup); every other run used {DEFAULT_HASH_ALGO} with integer event hashes.")
    return notes


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """The closing lines: which runs can be trusted and why not, what to do, and (with
    repeats) whether the ranking by TTFT p50 held in every round."""
    policies = results["policies"]
    bad = {label: m for label, m in policies.items() if not m.get("trusted")}
    lines: list[str] = []
    if not policies:
        return lines
    if bad:
        lines.append(f"NOT TRUSTED: {len(bad)} of {len(policies)} rows. Their latencies include "
                     "waits a real fleet would not have (or leave failed requests out), and their "
                     "ranking may be wrong. Do not quote them:")
        causes: set[str] = set()
        for label, m in bad.items():
            own = m.get("untrusted_causes") or []
            causes.update(own)
            words = "; ".join(CAUSE_WORDS[c] for c in own if c in CAUSE_WORDS)
            lines.append(f"  {label}: {words + ' (' if words else ''}{m['untrusted_reason']}"
                         f"{')' if words else ''}")
        good = [label for label in policies if label not in bad]
        if good:
            lines.append(f"trusted: {', '.join(good)}")
        todo = []
        if causes & {"emulator_lag", "machine_busy", "replayer_late"}:
            todo.append("stop other work on this machine and run again, or lower the load "
                        "(a lower --speedup, fewer --replicas)")
        if "errors" in causes:
            todo.append("see the errors note above and the logs under the output directory's "
                        "logs/")
        todo.append("--repeat N shows the spread")
        lines.append(f"  What to do: {'; '.join(todo)}.")
    else:
        lines.append(f"trusted: every row (emulator lag p99 <= {TRUST_LAG_P99_S * 1000:.0f} ms and "
                     f"max <= {TRUST_LAG_MAX_S:.0f} s, machine <= {TRUST_MACHINE_BUSY:.0%} busy, "
                     f"replayer on time within {TRUST_SEND_LAG_S * 1000:.0f} ms, no failed "
                     "requests).")
    rank = results.get("ranking") or {}
    if results.get("repeat", 1) > 1 and "held" in rank:
        if rank["held"]:
            lines.append(f"ranking by TTFT p50 of the trusted rows held in all "
                         f"{len(rank['orders'])} rounds: " + " < ".join(rank["orders"][0]))
        else:
            lines.append("ranking by TTFT p50 of the trusted rows did NOT hold in every round:")
            lines.extend(f"  round {i + 1}: " + " < ".join(order)
                         for i, order in enumerate(rank["orders"]))
    elif results.get("repeat", 1) > 1:
        lines.append("ranking: not checked (fewer than two rows trusted in every round)")
    if rank.get("left_out"):
        lines.append("not ranked (not measured in every round): " + ", ".join(rank["left_out"]))
    prio = next((m.get("priority") for m in policies.values() if m.get("priority")), None)
    if prio:
        lines.append(f"priority: {prio['note']}")
    return lines


def argv_is_cli() -> bool:
    return bool(sys.argv and sys.argv[0].endswith("prefix-loadtest"))


def slice_ttft_floor(requests: Sequence[TraceRequest], block_size: int, time_scale: float,
                     emulator_args: Sequence[str]) -> dict[str, Any] | None:
    """``loadtest.simulate.ttft_floor`` of the slice in the latency model the fleet's emulator
    runs (its profile flags among ``emulator_args``); None when those flags do not parse."""
    from loadtest.simulate import ttft_floor
    from worker.emulator.config import ConfigError as EmulatorConfigError
    from worker.emulator.config import from_args as emulator_config
    from worker.emulator.profiles import LatencyModel

    try:
        emu = emulator_config(["--block-size", str(block_size), *emulator_args])
    except (EmulatorConfigError, SystemExit):
        return None
    latency = LatencyModel(emu.model_profile, emu.gpu_profile, emu.step_overhead_s)
    return ttft_floor(requests, latency, time_scale=time_scale,
                      max_num_batched_tokens=emu.max_num_batched_tokens, block_size=block_size)


def format_bounds(bounds: dict[str, Any], policies: dict[str, dict[str, Any]]) -> str:
    """The simulated bounds and how close each measured policy came to the single-cache bound."""
    single = bounds["single_cache"]["token_hit_rate"]
    lines = [f"placement-only simulation of this slice ({bounds['replicas']} replicas, "
             f"{bounds['capacity_blocks_per_replica'] or 'unlimited'} {bounds['block_tokens']}-token "
             f"blocks each, LRU): single-cache bound {single:.1%}, round-robin "
             f"{bounds['round_robin']['token_hit_rate']:.1%}"]
    two_tier = bounds.get("single_cache_two_tier")
    if two_tier:
        lines.append(f"with a CPU tier of {bounds['cpu_capacity_blocks_per_replica']} blocks per "
                     f"replica (write-through, LRU): two-tier single-cache bound "
                     f"{two_tier['token_hit_rate']:.1%} (GPU {two_tier['gpu_token_hit_rate']:.1%} "
                     f"+ CPU tier {two_tier['cpu_token_hit_rate']:.1%})")
    for label, m in policies.items():
        rate = m.get("token_hit_rate")
        if rate is not None and single > 0:
            line = f"  {label}: {rate:.1%} = {rate / single:.0%} of the single-cache bound"
            both = m.get("tiers_token_hit_rate")
            if two_tier and both is not None and two_tier["token_hit_rate"] > 0:
                line += (f"; both tiers {both:.1%} = {both / two_tier['token_hit_rate']:.0%} of "
                         "the two-tier bound")
            lines.append(line)
    floor = bounds.get("ttft_floor")
    if floor:
        lines.append(
            f"TTFT floor of this slice (each request's own prefill alone on an idle replica, with "
            f"every block an earlier request had as a hit): p50 {floor['p50_s']:.3f} s, p90 "
            f"{floor['p90_s']:.3f} s, p99 {floor['p99_s']:.3f} s; no policy's quantile can be lower")
    return "\n".join(lines)
