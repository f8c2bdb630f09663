"""Policy lab: the routing policies on a virtual-time fleet of emulated engines. Deterministic.

The demo (``prefix-loadtest demo``) runs real processes on a shared 2-core machine, about 40 s a
policy, and its TTFTs move with the machine's load. To design a policy one needs many
comparisons fast and free of that noise; this lab runs the same pieces without processes or
wall clock:

* the fleet: per replica the emulator's own block pool, cache manager and scheduler
  (``worker.emulator``) with its roofline step latency model, stepped on a virtual clock (an
  event heap); a decode burst is cut short when a request arrives, as in
  ``EmulatedEngine._engine_loop``;
* the router: ``router.decision.policy.decide`` with the router's own ``LoadTracker`` (dispatch, first
  token, finish; KV writes) and ``PrefillRateLearner`` (taught the predicted work and observed
  TTFT at every first token), on the virtual clock;
* the hits it sees: each replica's exact GPU prefix-cache residency at decision time plus the
  router's speculative placements of the last ``SPECULATIVE_S`` seconds (what the real router's
  index reports, without the coarse index's stride or the KV-event lag);
* with ``--cpu-tier-ratio R``: each replica's CPU tier (the emulator's ``CpuOffload``, vLLM native
  offloading: write-through stores, LRU, loads over the host link), which the router sees
  (``tiered`` depths) unless ``--tier-hidden``;
* one fixed ``--overhead-ms`` between the router's decision and the engine's arrival, added to
  every TTFT once (HTTP and the router's own CPU; the demo's records show 3-5 ms);
* ``dynamo`` (a reference peer model, not a router policy): NVIDIA Dynamo's KV-router cost,
  which vllm-router ``kv_aware`` follows: the lowest ``new prefill blocks + active blocks``
  (blocks of this router's in-flight requests there, prompt and output so far, plus the new
  request's).

The trace slice, speedup and fleet shape are the demo's (1,000 requests, 8 replicas of 32,000
blocks, speedup and time scale 10). What it does not model: several routers, the KV-event lag,
the coarse index, HTTP and CPU contention. So its figures are for comparing policies, not for
quoting as the demo's; the demo (real processes) is what docs/benchmarks.md's figures come from.

``python -m loadtest.lab.policy_lab --policies prefix,ttft,dynamo --limit 1000``
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loadtest.data import PACKAGED_ARRIVALS, packaged_arrivals_path, packaged_trace_path
from loadtest.replay.trace import arrival_offsets, read_arrival_times, read_trace, schedule_offsets
from router.decision.load import LoadTicket, LoadTracker
from router.decision.policy import POLICIES, Candidate, Decision, PolicyParams, RouteInput, decide
from router.decision.ring import HashRing
from router.decision.ttft import PrefillRateLearner
from router.shared.hashing import BlockHasher, block_keys, max_hit_blocks
from router.tools.trace_format import TokenMapper, TraceRequest
from worker.emulator.kv_cache import BlockPool, KVCacheManager
from worker.emulator.offload import CpuOffload
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
    busy_s: float = 0.0  # wall seconds it spent in steps
    offload: CpuOffload | None = None  # the CPU tier (vLLM native offloading)
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
    cpu_tier_ratio: float = 0.0  # host KV per replica, in multiples of its GPU KV (0: none)
    tier_visible: bool = True  # the router sees CPU-tier residency (False: GPU events only)
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
        offload = None
        if c.cpu_tier_ratio > 0:
            lm = self.latency
            offload = CpuOffload(int(c.cpu_tier_ratio * c.num_gpu_blocks), c.block_size,
                                 lm.model.kv_bytes_per_token * c.block_size,
                                 lm.gpu.host_link_gbps * 1e9, max_concurrent_loads=c.max_num_seqs,
                                 enable_events=False)
        sched = Scheduler(SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, burst_s),
                          kv, self.latency, self._extend_hashes, offload)
        return _Replica(rid, pool, kv, sched, offload=offload)

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

    def _depths(self, digests: Sequence[bytes], num_tokens: int
                ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        cap = max_hit_blocks(num_tokens, self.config.block_size)
        confirmed: dict[str, int] = {}
        combined: dict[str, int] = {}
        tiered: dict[str, int] = {}
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
            if rep.offload is not None and self.config.tier_visible:
                ready = rep.offload.is_ready
                tier = depth
                while tier < cap and ready(digests[tier]):
                    tier += 1
                tiered[rid] = tier
        return confirmed, combined, tiered

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
        confirmed, combined, tiered = self._depths(digests, num_tokens)
        if self.policy == DYNAMO:
            decision = self._dynamo(digests, num_tokens, combined)
        else:
            keys = block_keys(digests)
            request = RouteInput(keys, num_tokens, keys[0] if keys else index)
            decision = decide(self.policy, request, self._candidates(), self.ring,
                              confirmed=confirmed, combined=combined, tiered=tiered,
                              params=c.params,
                              rr_counter=self.rr, avg_prompt_tokens=self.tracker.avg_prompt_tokens,
                              avg_output_tokens=self.tracker.avg_output_tokens)
        self.rr += 1
        rid = decision.replica_id
        hit = combined[rid]
        loaded = decision.hit(rid).cpu_blocks  # from the CPU tier: not prefilled, not written
        ticket = self.tracker.dispatch(rid, max(num_tokens - (hit + loaded) * c.block_size, 1),
                                       num_tokens)
        self.tracker.record_writes(rid, max(num_tokens // c.block_size - hit - loaded, 0),
                                   self.window)
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
        rep.step = None
        offload = rep.offload
        if not rep.scheduler.has_work():
            if offload is not None and offload.next_done_s() is not None:
                self._await_transfer(rep)  # CPU-tier stores still copying
            return
        step = rep.scheduler.schedule(self.now * self.config.time_scale)
        if step is None:
            if offload is not None and offload.has_pending_loads():
                self._await_transfer(rep)  # every request waits for a CPU-tier load
            return
        rep.step, rep.step_start = step, self.now
        rep.token += 1
        end = self.now + step.duration_s / self.config.time_scale
        self._push(end, "step_end", (rep.rid, rep.token, step.max_repeat))

    def _await_transfer(self, rep: _Replica) -> None:
        """Idle until the CPU tier's next transfer ends (``EmulatedEngine._await_transfer``)."""
        assert rep.offload is not None
        done_s = rep.offload.next_done_s()
        assert done_s is not None
        self._push(max(done_s / self.config.time_scale, self.now), "transfer", rep.rid)

    def _transfer(self, rid: str) -> None:
        rep = self.replicas[rid]
        if rep.step is not None:
            return  # a step is under way: the next schedule() applies what ended
        assert rep.offload is not None
        if not rep.offload.has_pending_loads():  # only stores: schedule() would not run
            rep.offload.advance(self.now * self.config.time_scale)
        self._start_step(rep)

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
        rep.busy_s += self.now - rep.step_start
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
            elif kind == "transfer":
                self._transfer(data)
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
        span = max((f.finish_s or 0.0) for f in done) - min(f.arrival_s for f in done) if done else 0.0
        busy = sum(r.busy_s for r in self.replicas.values()) / len(self.replicas)
        return {"policy": self.policy, "requests": len(done),
                "busy": busy / span if span > 0 else 0.0,
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


_FRACTIONS = ("evicted_reuse", "decode_weight", "min_hit_fraction")  # PolicyParams in [0, 1]
_KNOWN = frozenset((*POLICIES, DYNAMO))


def _param(params: PolicyParams, item: str) -> PolicyParams:
    """``params`` with one ``NAME=VALUE`` applied. Raises ``ValueError`` naming the bad part."""
    name, sep, text = item.partition("=")
    fields = {f.name: f for f in dataclasses.fields(PolicyParams)}
    if not sep or name not in fields:
        raise ValueError(f"--param {item!r}: expected NAME=VALUE with NAME one of "
                         f"{', '.join(sorted(fields))}")
    kind = type(getattr(params, name))
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"--param {name}: {text!r} is not a {kind.__name__}") from None
    if not math.isfinite(value) or value < 0 or (name in _FRACTIONS and value > 1) or (
            value == 0 and name not in (*_FRACTIONS, "cold_candidates", "queue_slack_tokens",
                                        "cold_queue_slack_tokens", "load_headroom",
                                        "recompute_penalty", "min_affinity_blocks")):
        raise ValueError(f"--param {name}: {text!r} is out of range"
                         f"{' [0, 1]' if name in _FRACTIONS else ''}")
    return replace(params, **{name: value})


def _inputs(args: argparse.Namespace) -> tuple[list[TraceRequest], list[float], LabConfig]:
    """The slice, its send offsets and the lab's config from the CLI. Raises ``ValueError`` or
    ``OSError`` with a one-line reason."""
    policies = args.policies.split(",")
    unknown = [name for name in policies if name not in _KNOWN]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(sorted(_KNOWN))}")
    for name, least in (("limit", 1), ("replicas", 1), ("num_gpu_blocks", 2), ("start", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}")
    for name in ("speedup", "overhead_ms", "cpu_tier_ratio"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name == "speedup" and value == 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number"
                             f"{' > 0' if name == 'speedup' else ' >= 0'}")
    if args.tier_hidden and not args.cpu_tier_ratio:
        raise ValueError("--tier-hidden needs a CPU tier (--cpu-tier-ratio R)")
    params = PolicyParams()
    for item in args.param:
        params = _param(params, item)
    requests = read_trace(packaged_trace_path(), start=args.start, limit=args.limit)
    if not requests:
        raise ValueError(f"no requests in the packaged slice from --start {args.start}")
    if args.arrivals:
        if args.arrivals in PACKAGED_ARRIVALS or not Path(args.arrivals).suffix:
            path = packaged_arrivals_path(args.arrivals)  # ValueError lists the packaged names
        else:
            path = Path(args.arrivals)
        offsets = arrival_offsets(len(requests), read_arrival_times(path), args.speedup)
    else:
        offsets = schedule_offsets(requests, args.speedup)
    config = LabConfig(replicas=args.replicas, num_gpu_blocks=args.num_gpu_blocks,
                       block_size=params.block_size, time_scale=args.speedup,
                       overhead_s=args.overhead_ms / 1000, cpu_tier_ratio=args.cpu_tier_ratio,
                       tier_visible=not args.tier_hidden, params=params)
    return requests, offsets, config


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.lab.policy_lab", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="prefix,ttft,least_loaded,consistent_hash,dynamo")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--arrivals", default=None,
                   help="packaged arrival schedule name (e.g. azure-conv) or CSV path")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=32_000)
    p.add_argument("--overhead-ms", type=float, default=3.0)
    p.add_argument("--cpu-tier-ratio", type=float, default=0.0,
                   help="a CPU tier of R x the GPU KV per replica (vLLM native offloading)")
    p.add_argument("--tier-hidden", action="store_true",
                   help="the router sees GPU residency only (the CPU tier's events dropped)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a PolicyParams field, e.g. evicted_reuse=0.3 (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON line per policy")
    args = p.parse_args(argv)
    try:
        requests, offsets, config = _inputs(args)
    except (ValueError, OSError) as exc:
        p.error(str(exc))  # one line, exit 2

    def show(r: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['policy']:>16}  hit {r['hit_rate']:.1%}  TTFT p50 {r['ttft_p50']:.4f} "
                  f"p90 {r['ttft_p90']:.4f} p99 {r['ttft_p99']:.4f} s  e2e p50 {r['e2e_p50']:.3f} s  "
                  f"imbalance (work) {r['imbalance']:.2f}  replicas busy {r['busy']:.0%}", flush=True)

    run_policies(args.policies.split(","), requests, offsets, config, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
