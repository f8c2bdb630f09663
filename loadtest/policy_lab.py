"""Policy lab: the routing policies on a virtual-time fleet of emulated engines. Deterministic.

The demo (``prefix-loadtest demo``) runs real processes on a shared 2-core machine, about 40 s a
policy, and its TTFTs move with the machine's load. To design a policy one needs many
comparisons fast and free of that noise; this lab runs the same pieces without processes or
wall clock:

* the fleet: per replica the emulator's own block pool, cache manager and scheduler
  (``worker.emulator``) with its roofline step latency model, stepped on a virtual clock (an
  event heap); a decode burst is cut short when a request arrives, as in
  ``EmulatedEngine._engine_loop``;
* the router: ``router.policy.decide`` with the router's own ``LoadTracker`` (dispatch, first
  token, finish; KV writes) and ``PrefillRateLearner`` (taught the predicted work and observed
  TTFT at every first token), on the virtual clock;
* the hits it sees: each replica's exact GPU prefix-cache residency at decision time plus the
  router's speculative placements of the last ``SPECULATIVE_S`` seconds (what the real router's
  index reports, without the coarse index's stride or the KV-event lag);
* one fixed ``--overhead-ms`` between the router's decision and the engine's arrival, added to
  every TTFT once (HTTP and the router's own CPU; the demo's records show 3-5 ms);
* ``dynamo`` (a reference peer model, not a router policy): NVIDIA Dynamo's KV-router cost,
  which vllm-router ``kv_aware`` follows: the lowest ``new prefill blocks + active blocks``
  (blocks of this router's in-flight requests there, prompt and output so far, plus the new
  request's).

The trace slice, speedup and fleet shape are the demo's (1,000 requests, 8 replicas of 32,000
blocks, speedup and time scale 10). What it does not model: several routers, the KV-event lag,
the coarse index, HTTP and CPU contention. So its figures are for comparing policies, not for
quoting as the demo's; the demo (real processes) is what the README's figures come from.

``python -m loadtest.policy_lab --policies prefix,ttft,dynamo --limit 1000``
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.data import packaged_arrivals_path, packaged_trace_path
from loadtest.trace import (
    TokenMapper,
    TraceRequest,
    arrival_offsets,
    read_arrival_times,
    read_trace,
    schedule_offsets,
)
from router.hashing import BlockHasher, block_keys, max_hit_blocks
from router.policy import (
    Candidate,
    Decision,
    LoadTicket,
    LoadTracker,
    PolicyParams,
    RouteInput,
    decide,
)
from router.ring import HashRing
from router.ttft import PrefillRateLearner
from worker.emulator.kv_cache import BlockPool, KVCacheManager
from worker.emulator.profiles import LatencyModel
from worker.emulator.scheduler import Request, Scheduler, SchedulerConfig, Step

SPECULATIVE_S = 5.0  # seconds a placement counts as held before the engine confirms it
DYNAMO = "dynamo"


@dataclass(slots=True)
class _Flight:
    """One request's life in the lab."""

    index: int
    arrival_s: float
    request: Request
    replica: str
    ticket: LoadTicket
    work_tokens: float | None
    first_token_s: float | None = None
    finish_s: float | None = None


@dataclass(slots=True)
class _Replica:
    rid: str
    pool: BlockPool
    kv: KVCacheManager
    scheduler: Scheduler
    step: Step | None = None
    step_start: float = 0.0
    token: int = 0  # invalidates a step-end event when the step was cut short
    speculative: dict[bytes, float] = field(default_factory=dict)  # {digest: placed at}
    flights: dict[str, _Flight] = field(default_factory=dict)  # in flight, by request id


@dataclass(frozen=True, slots=True)
class LabConfig:
    replicas: int = 8
    num_gpu_blocks: int = 32_000
    block_size: int = 16
    time_scale: float = 10.0
    overhead_s: float = 0.003
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cold_write_window: float = 0.5
    params: PolicyParams = field(default_factory=PolicyParams)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Lab:
    """One policy's run over ``requests`` arriving at ``offsets`` (wall seconds)."""

    def __init__(self, policy: str, config: LabConfig, hasher: BlockHasher) -> None:
        self.policy = policy
        self.config = config
        self.hasher = hasher
        self.now = 0.0
        self.latency = LatencyModel()
        self.tracker = LoadTracker(clock=lambda: self.now)
        self.learner = PrefillRateLearner(config.params.ttft_prior_tokens_per_s)
        ids = [f"replica-{i}" for i in range(config.replicas)]
        self.ring = HashRing(ids)
        self.replicas = {rid: self._replica(rid) for rid in ids}
        self.window = config.cold_write_window * config.replicas * config.num_gpu_blocks
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.flights: list[_Flight] = []
        self.rr = 0

    def _replica(self, rid: str) -> _Replica:
        c = self.config
        pool = BlockPool(c.num_gpu_blocks, enable_kv_cache_events=False)
        kv = KVCacheManager(pool, c.block_size, enable_caching=True)
        burst_s = 0.02 * c.time_scale  # the emulator's stream interval, in engine seconds
        sched = Scheduler(SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, burst_s),
                          kv, self.latency, self._extend_hashes)
        return _Replica(rid, pool, kv, sched)

    def _extend_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        if len(request.all_token_ids) // self.config.block_size <= len(hashes):
            return
        hashes.extend(self.hasher.digests(request.all_token_ids,
                                          parent=hashes[-1] if hashes else None,
                                          start_block=len(hashes)))

    def _push(self, at: float, kind: str, data: Any) -> None:
        heapq.heappush(self.events, (at, next(self._seq), kind, data))

    # -- the router --------------------------------------------------------------------------

    def _depths(self, digests: Sequence[bytes], num_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
        cap = max_hit_blocks(num_tokens, self.config.block_size)
        confirmed: dict[str, int] = {}
        combined: dict[str, int] = {}
        horizon = self.now - SPECULATIVE_S
        for rid, rep in self.replicas.items():
            table = rep.pool._hash_to_blocks
            spec = rep.speculative
            depth = held = 0
            for d in digests[:cap]:
                if d in table:
                    depth += 1
                    if depth - 1 == held:
                        held += 1
                    continue
                placed = spec.get(d)
                if placed is not None and placed >= horizon:
                    depth += 1
                    continue
                break
            confirmed[rid], combined[rid] = held, depth
        return confirmed, combined

    def _candidates(self) -> list[Candidate]:
        tracker = self.tracker
        out = []
        for rid in self.replicas:
            rate = self.learner.estimate(rid)
            out.append(Candidate(
                rid, inflight_requests=tracker.requests(rid),
                inflight_prefill_tokens=tracker.prefill_tokens(rid),
                prefilling_requests=tracker.prefilling(rid),
                recent_write_blocks=tracker.recent_writes(rid, self.window),
                inflight_context_tokens=tracker.context_tokens(rid),
                s_per_token=rate.s_per_token, overhead_s=rate.overhead_s))
        return out

    def _dynamo(self, digests: Sequence[bytes], num_tokens: int,
                combined: dict[str, int]) -> Decision:
        size = self.config.block_size
        blocks = -(-num_tokens // size)

        def cost(rid: str) -> tuple[float, int]:
            active = sum(-(-f.request.num_tokens // size) for f in self.replicas[rid].flights.values())
            prefill = blocks - combined[rid]
            return (prefill + active + blocks, order.index(rid))

        order = list(self.replicas)
        chosen = min(order, key=cost)
        return Decision(chosen, "dynamo", (), combined[chosen], len(digests))

    def route(self, index: int, tokens: list[int], output_len: int) -> None:
        c = self.config
        digests = self.hasher.digests(tokens)
        num_tokens = len(tokens)
        confirmed, combined = self._depths(digests, num_tokens)
        if self.policy == DYNAMO:
            decision = self._dynamo(digests, num_tokens, combined)
        else:
            keys = block_keys(digests)
            request = RouteInput(keys, num_tokens, keys[0] if keys else index)
            decision = decide(self.policy, request, self._candidates(), self.ring,
                              confirmed=confirmed, combined=combined, params=c.params,
                              rr_counter=self.rr, avg_prompt_tokens=self.tracker.avg_prompt_tokens,
                              avg_output_tokens=self.tracker.avg_output_tokens)
        self.rr += 1
        rid = decision.replica_id
        hit = combined[rid]
        ticket = self.tracker.dispatch(rid, max(num_tokens - hit * c.block_size, 1), num_tokens)
        self.tracker.record_writes(rid, max(num_tokens // c.block_size - hit, 0), self.window)
        rep = self.replicas[rid]
        for d in digests[hit:max_hit_blocks(num_tokens, c.block_size)]:
            rep.speculative[d] = self.now
        prediction = decision.predictions.get(rid)
        req = Request(f"r{index}", list(tokens), max(1, output_len),
                      block_hashes=list(digests))
        flight = _Flight(index, self.now, req, rid, ticket,
                         prediction.work_tokens if prediction is not None else None)
        self.flights.append(flight)
        rep.flights[req.request_id] = flight
        self._push(self.now + c.overhead_s, "enqueue", (rid, req))

    # -- the engines -------------------------------------------------------------------------

    def _start_step(self, rep: _Replica) -> None:
        if not rep.scheduler.has_work():
            rep.step = None
            return
        step = rep.scheduler.schedule(self.now * self.config.time_scale)
        if step is None:
            rep.step = None
            return
        rep.step, rep.step_start = step, self.now
        rep.token += 1
        end = self.now + step.duration_s / self.config.time_scale
        self._push(end, "step_end", (rep.rid, rep.token, step.max_repeat))

    def _enqueue(self, rid: str, req: Request) -> None:
        rep = self.replicas[rid]
        rep.scheduler.add_request(req)
        step = rep.step
        if step is None:
            self._start_step(rep)
        elif step.max_repeat > 1:
            # a decode burst is woken by an arrival: it stops after the repeat under way (a GPU
            # step is not interrupted), and the newcomer joins the next step
            scale = self.config.time_scale
            t, repeats = rep.step_start, 0
            for d in step.durations_s:
                t += d / scale
                repeats += 1
                if t >= self.now:
                    break
            end = rep.step_start + sum(step.durations_s[:repeats]) / scale
            rep.token += 1
            self._push(end, "step_end", (rid, rep.token, repeats))

    def _step_end(self, rid: str, token: int, repeats: int) -> None:
        rep = self.replicas[rid]
        if token != rep.token or rep.step is None:
            return
        outputs = rep.scheduler.complete(rep.step, repeats)
        rep.step = None
        for out in outputs:
            flight = rep.flights.get(out.request.request_id)
            if flight is None:
                continue
            if out.num_new_tokens > 0 and flight.first_token_s is None:
                flight.first_token_s = self.now + self.config.overhead_s
                flight.ticket.first_token()
                if flight.work_tokens is not None:
                    self.learner.observe(rid, flight.work_tokens,
                                         flight.first_token_s - flight.arrival_s)
            if out.finished is not None:
                flight.finish_s = self.now + self.config.overhead_s
                flight.ticket.finish()
                self.tracker.observe_output(out.request.num_output_tokens)
                del rep.flights[out.request.request_id]
        self._start_step(rep)

    # -- the run -----------------------------------------------------------------------------

    def run(self, requests: Sequence[TraceRequest], offsets: Sequence[float],
            mapper: TokenMapper) -> dict[str, Any]:
        for i, (req, at) in enumerate(zip(requests, offsets, strict=True)):
            self._push(at, "arrive", (i, req))
        while self.events:
            at, _, kind, data = heapq.heappop(self.events)
            self.now = at
            if kind == "arrive":
                i, req = data
                self.route(i, mapper.request_prompt(req), req.output_length)
            elif kind == "enqueue":
                self._enqueue(*data)
            else:
                self._step_end(*data)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        done = [f for f in self.flights if f.first_token_s is not None]
        ttft = [f.first_token_s - f.arrival_s for f in done]  # type: ignore[operator]
        prompt = sum(f.request.num_prompt_tokens for f in done)
        cached = sum(max(f.request.num_cached_tokens, 0) for f in done)
        work: dict[str, float] = {rid: 0.0 for rid in self.replicas}
        for f in done:
            work[f.replica] += f.request.num_prompt_tokens - max(f.request.num_cached_tokens, 0)
        mean = sum(work.values()) / len(work)
        held: dict[str, float] = {rid: 0.0 for rid in self.replicas}  # request-seconds
        for f in done:
            if f.finish_s is not None:
                held[f.replica] += f.finish_s - f.arrival_s
        mean_held = sum(held.values()) / len(held)
        e2e = [f.finish_s - f.arrival_s for f in done if f.finish_s is not None]
        return {"policy": self.policy, "requests": len(done),
                "hit_rate": cached / prompt if prompt else 0.0,
                "ttft_p50": _quantile(ttft, 0.5), "ttft_p90": _quantile(ttft, 0.9),
                "ttft_p99": _quantile(ttft, 0.99),
                "e2e_p50": _quantile(e2e, 0.5),
                "imbalance_prefill": max(work.values()) / mean if mean else 0.0,
                "imbalance": max(held.values()) / mean_held if mean_held else 0.0}


def run_policies(policies: Sequence[str], requests: Sequence[TraceRequest],
                 offsets: Sequence[float], config: LabConfig,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Each policy on a fresh virtual fleet; one summary dict per policy (TTFT in wall seconds,
    hit rate as a fraction of prompt tokens, imbalance = max/mean uncached prompt tokens)."""
    hasher = BlockHasher(block_size=config.block_size)
    mapper = TokenMapper()
    results = []
    for policy in policies:
        result = Lab(policy, config, hasher).run(requests, offsets, mapper)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.policy_lab", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="prefix,ttft,least_loaded,consistent_hash,dynamo")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--arrivals", default=None,
                   help="packaged arrival schedule name (e.g. azure-conv) or CSV path")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=32_000)
    p.add_argument("--overhead-ms", type=float, default=3.0)
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a PolicyParams field, e.g. evicted_reuse=0.3 (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON line per policy")
    args = p.parse_args(argv)
    requests = read_trace(packaged_trace_path(), start=args.start, limit=args.limit)
    if args.arrivals:
        try:
            path = packaged_arrivals_path(args.arrivals)
        except ValueError:
            path = args.arrivals
        offsets = arrival_offsets(len(requests), read_arrival_times(path), args.speedup)
    else:
        offsets = schedule_offsets(requests, args.speedup)
    params = PolicyParams()
    for item in args.param:
        name, _, value = item.partition("=")
        params = replace(params, **{name: type(getattr(params, name))(value)})
    config = LabConfig(replicas=args.replicas, num_gpu_blocks=args.num_gpu_blocks,
                       time_scale=args.speedup, overhead_s=args.overhead_ms / 1000, params=params)

    def show(r: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['policy']:>16}  hit {r['hit_rate']:.1%}  TTFT p50 {r['ttft_p50']:.4f} "
                  f"p90 {r['ttft_p90']:.4f} p99 {r['ttft_p99']:.4f} s  e2e p50 {r['e2e_p50']:.3f} s  "
                  f"imbalance (work) {r['imbalance']:.2f}", flush=True)

    run_policies(args.policies.split(","), requests, offsets, config, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
