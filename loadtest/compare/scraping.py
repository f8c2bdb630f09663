"""Reading a fleet during a comparison: the replicas' /metrics pages (the engines' own ``vllm:*``
counters, the emulator's lag histogram, the busy-time gauges sampled through a replay),
prefix-router's own /metrics, and the CPU seconds of every component's processes (psutil).
Does network and process I/O."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

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


@dataclass
class CPUSample:
    """CPU seconds (user + system) per component at one moment, children included, plus the
    machine's busy and total CPU seconds over all cores."""

    per_component: dict[str, float] = field(default_factory=dict)
    machine_busy_s: float = 0.0
    machine_total_s: float = 0.0
    wall_s: float = 0.0


def cpu_sample(pids: dict[str, list[int]]) -> CPUSample:
    """Snapshot CPU time of each component with its children (psutil; processes that have gone
    count 0) and of this process alone (``replayer``)."""
    import psutil

    sample = CPUSample(wall_s=time.monotonic())
    groups = {**pids, "replayer": [os.getpid()]}
    for name, plist in groups.items():
        total = 0.0
        for pid in plist:
            try:
                proc = psutil.Process(pid)
                # this process's children are the fleet itself, counted under their own names
                procs = [proc] if name == "replayer" else [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        sample.per_component[name] = total
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    total_s = sum(times)
    sample.machine_busy_s = total_s - idle
    sample.machine_total_s = total_s
    return sample


def cpu_delta(before: CPUSample, after: CPUSample) -> dict[str, float]:
    """CPU seconds each component used between two samples, plus ``machine_busy_s``,
    ``machine_util`` (busy share of all cores, 0-1) and ``wall_s``."""
    out = {name: max(0.0, after.per_component.get(name, 0.0) - before.per_component.get(name, 0.0))
           for name in after.per_component}
    out["wall_s"] = after.wall_s - before.wall_s
    busy = after.machine_busy_s - before.machine_busy_s
    total = after.machine_total_s - before.machine_total_s
    out["machine_busy_s"] = busy
    out["machine_util"] = busy / total if total > 0 else 0.0
    return out
