"""Running a comparison of routing policies on an emulated fleet, the project's main benchmark:
its rounds, each run on a fresh fleet, and the figures of each run. Does process, network and
file I/O.

For each policy a FRESH fleet is started (``loadtest.harness.fleet.LoopbackFleet``: embedded Redis, emulator,
workers, router; or a peer router), so no run inherits another's KV cache; the same trace slice is
replayed through the router (``loadtest.replay.replayer``); then the emulator replicas' own counters are
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
* ``trusted`` / ``untrusted_reason``: the run's verdict (``loadtest.compare.verdict``): an emulator that fell
  behind, a machine with no CPU headroom or a replayer that could not send on time make every
  latency in the row include waits for a core that a real fleet would not have.

With ``repeat`` > 1 every policy runs that many times, interleaved (A B C A B C ...), each on a
fresh fleet; ``policies`` then holds per figure the median over the rounds with ``range``
[min, max], ``rounds`` each round's own figures, and ``ranking`` whether the order of the
policies by TTFT p50 held in every round. The emulator runs at a higher OS priority than
everything else where allowed (``loadtest.harness.fleet.EMULATOR_NICE``; ``priority`` says what happened).
"""


from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.compare.report import results_document, run_line, write_plots, write_results
from loadtest.compare.runs import TEXT_ONLY_PEERS, fleet_for
from loadtest.compare.scraping import (
    COUNTERS,
    M_EXTERNAL_HITS,
    M_HITS,
    M_PREEMPTIONS,
    M_QUERIES,
    M_SUCCESS,
    BusySampler,
    LagHistogram,
    cpu_delta,
    cpu_sample,
    scrape_counters_and_lag,
    scrape_router,
)
from loadtest.compare.verdict import untrusted_causes, verdict
from loadtest.harness.fleet import OURS, FleetConfig, FleetError, LoopbackFleet, RouterSpec
from loadtest.replay.replayer import ReplayConfig, RequestRecord, replay, summarize, write_records
from router.tools.trace_format import TraceRequest

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_INTERVAL_S = 1.0  # gauge sampling for busy time; 8 scrapes per second at most


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


@dataclass
class PolicyResult:
    """Everything measured for one run; ``metrics`` is what results.json carries per policy."""

    label: str
    metrics: dict[str, Any]
    records: list[RequestRecord]

async def _measure(fleet: LoopbackFleet, requests: Sequence[TraceRequest], config: CompareConfig,
                   progress: Callable[[str], None]) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Replay ``requests`` through ``fleet``'s router and measure it: the replicas' counters and
    lag histograms and the processes' CPU read before and after, busy time sampled during the
    replay; the records and the run's figures (module docstring) with its verdict."""
    urls = [r.url for r in fleet.replicas]
    before, lag_before = await scrape_counters_and_lag(urls, COUNTERS)
    cpu_before = cpu_sample(fleet.pids)
    records, sampler = await _replay_sampled(fleet, requests, config, progress)
    cpu_after = cpu_sample(fleet.pids)
    after, lag_after = await scrape_counters_and_lag(urls, COUNTERS)
    assert fleet.router_url is not None
    router_view = (await scrape_router(fleet.router_url)
                   if fleet.config.router.kind == OURS else None)
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    metrics = run_figures([r.replica_id for r in fleet.replicas], delta, summarize(records),
                          sampler, cpu_delta(cpu_before, cpu_after), lag_after.minus(lag_before))
    metrics["router_view"] = router_view
    metrics["engine"] = "vllm" if fleet.config.engines else "emulator"
    metrics["trusted"], metrics["untrusted_reason"] = verdict(metrics)
    metrics["untrusted_causes"] = list(dict.fromkeys(c for c, _ in untrusted_causes(metrics)))
    return records, metrics


async def _replay_sampled(fleet: LoopbackFleet, requests: Sequence[TraceRequest],
                          config: CompareConfig, progress: Callable[[str], None],
                          ) -> tuple[list[RequestRecord], BusySampler]:
    """Replay ``requests`` through ``fleet``'s router while a ``BusySampler`` scrapes the
    replicas' gauges; the records and the sampler's integrals."""
    sampler = BusySampler([r.url for r in fleet.replicas], config.sample_interval_s)
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
    return records, sampler


def _capped(value: float | None, cap: float) -> float | None:
    return None if value is None else min(value, cap)


def max_over_mean(values: Sequence[float]) -> float | None:
    """max / mean of ``values``; None when empty or all zero."""
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def run_figures(ids: Sequence[str], delta: Sequence[dict[str, float]], summary: dict[str, Any],
                sampler: BusySampler, cpu: dict[str, float], lag: LagHistogram) -> dict[str, Any]:
    """One run's figures (the module docstring names them) from the replicas' counter increases
    over the replay (``delta``, one dict per replica of ``ids``, keys ``COUNTERS``), the replay's
    ``summarize``, the busy-time sampler, the CPU seconds per component and the lag observed."""
    queries = sum(d[M_QUERIES] for d in delta)
    hits = sum(d[M_HITS] for d in delta)
    cpu_hits = sum(d[M_EXTERNAL_HITS] for d in delta)
    return {
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
    }


def run_policy(spec: RouterSpec, requests: Sequence[TraceRequest], config: CompareConfig,
               progress: Callable[[str], None]) -> PolicyResult:
    """Start a fresh fleet for ``spec``, replay ``requests``, measure, tear down. Raises
    ``FleetError`` when the fleet does not start."""
    fleet_config = replace(fleet_for(spec, config.fleet),
                           log_dir=config.output_dir / "logs" / spec.label.replace(":", "-"))
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
    started = time.monotonic()
    rounds, round_records, failed = _run_rounds(config, requests, progress, started)
    policies, records = aggregate_rounds(rounds, round_records)
    results = results_document(config.fleet, config.replay, trace_info, bounds, rounds, policies,
                               failed, argv, duration_s=round(time.monotonic() - started, 1))
    write_results(results, out)
    if config.plots and policies:
        results["plots"] = [str(p) for p in write_plots(policies, records, out, bounds)]
    return results


def _run_rounds(config: CompareConfig, requests: Sequence[TraceRequest],
                progress: Callable[[str], None], started: float,
                ) -> tuple[list[dict[str, dict[str, Any]]], list[dict[str, list[RequestRecord]]],
                           dict[str, str]]:
    """Every run of ``config``, ``config.repeat`` rounds interleaved (A B C A B C ...), each on a
    fresh fleet, its records written as it ends: per round the metrics and the records by label,
    and the runs that failed (tag -> error). SIGTERM stops it as Ctrl-C does."""
    repeat = max(1, config.repeat)
    rounds: list[dict[str, dict[str, Any]]] = [{} for _ in range(repeat)]
    round_records: list[dict[str, list[RequestRecord]]] = [{} for _ in range(repeat)]
    failed: dict[str, str] = {}
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
                write_records(result.records,
                              config.output_dir / _records_name(spec.label, r + 1, repeat))
                progress(run_line(spec.label, result.metrics))
    return rounds, round_records, failed



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
