"""Placement-only simulation of a Mooncake trace slice: hit-rate bounds without timing. Pure.

Each replica is an LRU cache of 512-token trace blocks (hash ids). A request hits its longest run
of leading hash ids present on the replica it goes to (hash ids are prefix hashes, so a present id
implies its whole prefix was cached together), capped at ``floor((N - 1) / block_size) *
block_size`` tokens (vLLM 0.33 kv_cache_manager: the last prompt token is always recomputed, only
full blocks hit); then all of its blocks become most recently used, its tail block least and its
head most (vLLM's block pool frees a finished request's blocks tail first, so shared heads are
evicted last), and the least recently used blocks beyond capacity are evicted. Requests are processed in trace order with no overlap in time,
so in-flight requests never pin blocks; this is why it is a bound, not a prediction.

Placements:

* ``single_cache``: one cache holding the whole fleet's capacity (``replicas`` x capacity): what a
  perfect router that turns the fleet's caches into one could reach, ignoring load;
* ``round_robin``: request ``i`` goes to replica ``i mod replicas``;
* ``single_cache_unlimited``: one cache without capacity limit (the slice's reuse ceiling);
* ``single_cache_two_tier`` (with a CPU tier): one cache of the fleet's GPU capacity backed by one
  host (CPU-tier) cache of the fleet's host capacity, as vLLM's native offloading runs it
  (``simulate_two_tier``): a request hits its GPU run, then the blocks past it the host holds;
  every block is written to both (write-through), each tier is LRU. What a perfect router could
  reach when the fleet's replicas offload to host memory.

And a timing floor (``ttft_floor``): each request's own prefill alone on an idle replica with
that ceiling's hit, in the emulator's roofline model: no policy's TTFT quantile can be lower.

And the two sticky placements the demo compares (``compare_placements``):

* ``WriteBalancedPlacement``: ``prefix``'s rule without timing: a request whose longest match
  (at least ``min_match`` trace blocks) is on some replicas goes to one of them, else (a new
  conversation) anywhere; among those, the replica that wrote the fewest blocks recently
  (exponential decay over written blocks, e-folding ``window`` x the fleet's capacity), optionally
  with uniform noise of ``perturb_blocks`` on each replica's count (live timing perturbs the
  router's choice about that much);
* ``ConsistentHashPlacement``: the ``consistent_hash`` baseline exactly: the router's ring
  (``router.decision.ring.HashRing``) over the given replica ids, keyed on the block key at token 1024 of
  the replayed tokens (``router.tools.trace_format.TokenMapper``, ``router.shared.hashing.BlockHasher`` defaults).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from router.tools.trace_format import TRACE_BLOCK_TOKENS, TraceRequest
from worker.emulator.profiles import LatencyModel


class LRUBlockCache:
    """An LRU set of hash ids with a capacity in 512-token blocks (None: unlimited)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity must be at least one block")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # {hash_id: None}, LRU first

    def lookup(self, hash_ids: Sequence[int]) -> int:
        """Number of leading ``hash_ids`` present."""
        n = 0
        for hash_id in hash_ids:
            if hash_id not in self._blocks:
                break
            n += 1
        return n

    def touch(self, hash_ids: Sequence[int]) -> None:
        """Make ``hash_ids`` most recently used (inserting missing ones) and evict beyond capacity."""
        for hash_id in hash_ids:
            self._blocks[hash_id] = None
            self._blocks.move_to_end(hash_id)
        if self.capacity_blocks is not None:
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)


def hit_tokens(req: TraceRequest, matched_blocks: int, block_size: int) -> int:
    """Tokens a request hits when its first ``matched_blocks`` trace blocks are cached."""
    cap = ((req.input_length - 1) // block_size) * block_size
    return min(matched_blocks * TRACE_BLOCK_TOKENS, cap)


def simulate(requests: Sequence[TraceRequest], caches: Sequence[LRUBlockCache],
             place: Callable[[int, TraceRequest], int], block_size: int = 16) -> dict[str, Any]:
    """Run ``requests`` in order, each on ``caches[place(i, req)]``; token hit rate and counts."""
    hits = 0
    total = 0
    per_replica = [0] * len(caches)
    for i, req in enumerate(requests):
        r = place(i, req)
        cache = caches[r]
        hits += hit_tokens(req, cache.lookup(req.hash_ids), block_size)
        total += req.input_length
        cache.touch(req.hash_ids[::-1])  # freed tail first: the head ends most recently used
        per_replica[r] += 1
    return {"token_hit_rate": hits / total if total else 0.0, "hit_tokens": hits,
            "input_tokens": total, "requests_per_replica": per_replica}


def simulate_two_tier(requests: Sequence[TraceRequest], gpu: LRUBlockCache, cpu: LRUBlockCache,
                      block_size: int = 16) -> dict[str, Any]:
    """Run ``requests`` in order on one GPU cache backed by one host (CPU-tier) cache.

    A request hits its leading run on ``gpu`` and then the blocks past it that ``cpu`` holds
    consecutively (vLLM: the offloading connector is asked for the blocks past the GPU hit), the
    total capped as ``hit_tokens``; then its blocks are touched in both (write-through; the host
    tier's LRU is touched by every lookup and store, ``worker/emulator/offload.py``). Returns the
    token hit rate of both tiers and of each (``gpu_token_hit_rate``, ``cpu_token_hit_rate``)."""
    gpu_hits = total_hits = total = 0
    for req in requests:
        ids = req.hash_ids
        g = gpu.lookup(ids)
        c = cpu.lookup(ids[g:])
        gpu_hit = hit_tokens(req, g, block_size)
        total_hit = hit_tokens(req, g + c, block_size)
        gpu_hits += gpu_hit
        total_hits += total_hit
        total += req.input_length
        order = ids[::-1]  # freed tail first: the head ends most recently used
        gpu.touch(order)
        cpu.touch(order)
    return {"token_hit_rate": total_hits / total if total else 0.0,
            "gpu_token_hit_rate": gpu_hits / total if total else 0.0,
            "cpu_token_hit_rate": (total_hits - gpu_hits) / total if total else 0.0,
            "hit_tokens": total_hits, "input_tokens": total}


def simulate_bounds(requests: Sequence[TraceRequest], replicas: int,
                    capacity_tokens_per_replica: int | None,
                    block_size: int = 16,
                    cpu_capacity_tokens_per_replica: int | None = None) -> dict[str, Any]:
    """Single-cache, round-robin and unlimited bounds for a slice on ``replicas`` replicas of
    ``capacity_tokens_per_replica`` tokens of KV each (None: unlimited), and with
    ``cpu_capacity_tokens_per_replica`` (a host tier per replica, tokens) the two-tier single
    cache. Raises ``ValueError`` for fewer than one replica."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    cap_blocks = (None if capacity_tokens_per_replica is None
                  else max(1, math.floor(capacity_tokens_per_replica / TRACE_BLOCK_TOKENS)))
    fleet_blocks = None if cap_blocks is None else cap_blocks * replicas
    single = simulate(requests, [LRUBlockCache(fleet_blocks)], lambda i, r: 0, block_size)
    rr = simulate(requests, [LRUBlockCache(cap_blocks) for _ in range(replicas)],
                  lambda i, r: i % replicas, block_size)
    unlimited = simulate(requests, [LRUBlockCache(None)], lambda i, r: 0, block_size)
    for result in (single, rr, unlimited):
        result.pop("requests_per_replica", None)
    out = {"replicas": replicas, "capacity_blocks_per_replica": cap_blocks,
           "block_tokens": TRACE_BLOCK_TOKENS, "num_requests": len(requests),
           "single_cache": single, "round_robin": rr, "single_cache_unlimited": unlimited}
    if cpu_capacity_tokens_per_replica and fleet_blocks is not None:
        cpu_blocks = max(1, math.floor(cpu_capacity_tokens_per_replica / TRACE_BLOCK_TOKENS))
        out["cpu_capacity_blocks_per_replica"] = cpu_blocks
        out["single_cache_two_tier"] = simulate_two_tier(
            requests, LRUBlockCache(fleet_blocks), LRUBlockCache(cpu_blocks * replicas),
            block_size)
    return out


class WriteBalancedPlacement:
    """``prefix``'s placement (see the module docstring) over ``caches``; call as ``place``.

    ``place(i, req)`` returns the index into ``caches`` and counts the request's new trace blocks
    (512 tokens each) as written there. The rule is ``router.decision.policy``'s cold placement without
    timing (its queue-slack filter and load bounds need live load, which a placement-only
    simulation does not have); ``window`` is the router's ``cold_write_window``."""

    def __init__(self, caches: Sequence[LRUBlockCache], window: float = 0.5,
                 perturb_blocks: float = 0.0, seed: int = 0, min_match: int = 2) -> None:
        capacity = sum(c.capacity_blocks or 0 for c in caches)
        self.caches = caches
        self.efold_blocks = max(window * capacity, 1.0)
        self.perturb_blocks = perturb_blocks
        self.rng = random.Random(seed)
        self.min_match = min_match
        self.writes = [0.0] * len(caches)  # decayed blocks written per replica

    def __call__(self, i: int, req: TraceRequest) -> int:
        depths = [c.lookup(req.hash_ids) for c in self.caches]
        best = max(depths)
        candidates = ([j for j, d in enumerate(depths) if d == best] if best >= self.min_match
                      else range(len(self.caches)))
        noise = self.perturb_blocks
        r = min(candidates, key=lambda j: self.writes[j] + (self.rng.uniform(0, noise) if noise else 0))
        new = len(req.hash_ids) - depths[r]
        decay = math.exp(-new / self.efold_blocks)
        self.writes = [w * decay for w in self.writes]
        self.writes[r] += new
        return r


class ConsistentHashPlacement:
    """The ``consistent_hash`` baseline's placement over replicas ``replica_ids`` (the index into
    ``replica_ids`` is the cache index): ``router.decision.policy.decide`` itself, given the block keys of
    the replayed tokens' first ``key_tokens`` (the router's ``consistent_hash_tokens``; the keys
    beyond them do not change its choice) and, for a prompt shorter than a block, the ring key the
    router computes from its head."""

    def __init__(self, replica_ids: Sequence[str], key_tokens: int = 1024,
                 block_size: int = 16) -> None:
        from router.decision.policy import Candidate, PolicyParams
        from router.decision.ring import HashRing
        from router.shared.hashing import BlockHasher
        from router.tools.trace_format import TokenMapper

        self.ring = HashRing(replica_ids)
        self.views = [Candidate(rid) for rid in replica_ids]
        self.index = {rid: j for j, rid in enumerate(replica_ids)}
        self.params = PolicyParams(block_size=block_size,
                                   consistent_hash_blocks=max(1, key_tokens // block_size))
        self.mapper = TokenMapper()
        self.hasher = BlockHasher(block_size)
        self.key_tokens = key_tokens

    def __call__(self, i: int, req: TraceRequest) -> int:
        import json

        from router.decision.policy import RouteInput, decide
        from router.decision.ring import text_key

        n = min(req.input_length, self.key_tokens)
        ids = req.hash_ids[:math.ceil(n / TRACE_BLOCK_TOKENS)]
        tokens = self.mapper.prompt(ids, min(req.input_length, len(ids) * TRACE_BLOCK_TOKENS))[:n]
        head = tokens[:self.hasher.block_size]
        request = RouteInput(self.hasher.keys(tokens), req.input_length, text_key(json.dumps(head)))
        decision = decide("consistent_hash", request, self.views, self.ring, params=self.params)
        return self.index[decision.replica_id]


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values`` by linear interpolation, as the replay's own
    rows are taken (``loadtest.replay.replayer.percentile``, numpy's default): a floor taken by
    nearest rank sat above the rows it bounds on short slices (p99 of 200 requests)."""
    return float(np.percentile(np.asarray(values, dtype=float), q * 100))


def ttft_floor(requests: Sequence[TraceRequest], latency: LatencyModel, *, time_scale: float,
               max_num_batched_tokens: int, block_size: int = 16) -> dict[str, Any]:
    """The lowest TTFT any placement could give each request of a slice, in wall seconds.

    Each request alone on an idle replica (no queue, no batch-mates), with the largest hit any
    placement could give it: every block an earlier request of the slice had (one cache without
    capacity limit, ``single_cache_unlimited``). Its prefill runs in chunks of
    ``max_num_batched_tokens`` (vLLM's chunked prefill), each chunk one step of ``latency``'s
    roofline model with the attention term against the tokens before it, divided by
    ``time_scale`` (the emulator's speed-up). Quantiles of it bound a measured run's TTFT
    quantiles from below: a policy cannot beat the GPU's own prefill time. Returns
    ``{"p50_s", "p90_s", "p99_s", "no_hit_p50_s", "no_hit_p99_s", "num_requests",
    "percentiles_s"}`` (``percentiles_s[k]`` the k-th percentile, k = 0..100: the floor's CDF
    for a plot); raises
    ``ValueError`` for an empty slice or a non-positive scale or chunk.
    """
    if not requests:
        raise ValueError("no requests")
    if time_scale <= 0 or max_num_batched_tokens < 1:
        raise ValueError("time_scale must be > 0 and max_num_batched_tokens >= 1")

    def alone_s(num_tokens: int, num_cached: int) -> float:
        engine_s = 0.0
        done = num_cached
        while done < num_tokens:
            chunk = min(max_num_batched_tokens, num_tokens - done)
            engine_s += latency.step_time_s([(chunk, done)], 0, 0)
            done += chunk
        return engine_s / time_scale

    cache = LRUBlockCache(None)
    best: list[float] = []
    cold: list[float] = []
    for req in requests:
        hit = hit_tokens(req, cache.lookup(req.hash_ids), block_size)
        cache.touch(req.hash_ids[::-1])
        best.append(alone_s(req.input_length, hit))
        cold.append(alone_s(req.input_length, 0))
    return {"p50_s": _quantile(best, 0.5), "p90_s": _quantile(best, 0.9),
            "p99_s": _quantile(best, 0.99), "no_hit_p50_s": _quantile(cold, 0.5),
            "no_hit_p99_s": _quantile(cold, 0.99), "num_requests": len(requests),
            "percentiles_s": [_quantile(best, k / 100) for k in range(101)]}


def compare_placements(requests: Sequence[TraceRequest], replicas: int, capacity_blocks: int,
                       ring_seeds: int = 4, perturb_blocks: float = 3.0,
                       perturb_seeds: int = 8) -> dict[str, Any]:
    """Token hit rates of the demo's sticky placements on one slice.

    ``consistent_hash``: one entry per ring; ring 0 uses the demo's replica ids
    (``replica-0``...), ring ``s`` > 0 the ids ``ring{s}-replica-0``... (another fleet's names).
    ``write_balanced``: exact (no noise), and ``perturb_seeds`` runs with ``perturb_blocks`` of
    noise (mean, standard deviation, min, max). Raises ``ValueError`` for fewer than 1 replica."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")

    def caches() -> list[LRUBlockCache]:
        return [LRUBlockCache(capacity_blocks) for _ in range(replicas)]

    def rate(fleet: list[LRUBlockCache], place: Callable[[int, TraceRequest], int]) -> float:
        return float(simulate(requests, fleet, place)["token_hit_rate"])

    rings = []
    for seed in range(ring_seeds):
        ids = [f"replica-{j}" if seed == 0 else f"ring{seed}-replica-{j}" for j in range(replicas)]
        rings.append(rate(caches(), ConsistentHashPlacement(ids)))
    fleet = caches()
    exact = rate(fleet, WriteBalancedPlacement(fleet))
    noisy = []
    for s in range(perturb_seeds):
        fleet = caches()
        noisy.append(rate(fleet, WriteBalancedPlacement(fleet, perturb_blocks=perturb_blocks, seed=s)))

    def summary(values: list[float]) -> dict[str, float]:
        return {"mean": statistics.mean(values), "sd": statistics.pstdev(values),
                "min": min(values), "max": max(values)} if values else {}

    return {"consistent_hash_per_ring": rings, "consistent_hash": summary(rings),
            "write_balanced": exact, "perturb_blocks": perturb_blocks,
            "write_balanced_perturbed": summary(noisy)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.replay.simulate [--limit N] [--replicas R] [--capacity-tokens T]``: print the
    bounds for a slice of the packaged (or given) trace."""
    import argparse
    import json

    from loadtest.data import packaged_trace_path
    from loadtest.replay.trace import read_trace

    p = argparse.ArgumentParser(prog="python -m loadtest.replay.simulate", description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=None)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=512_000,
                   help="KV capacity per replica in tokens (0: unlimited)")
    p.add_argument("--cpu-capacity-tokens", type=int, default=0,
                   help="host (CPU-tier) KV capacity per replica in tokens: adds the two-tier "
                        "single-cache bound (vLLM native offloading)")
    p.add_argument("--placements", action="store_true",
                   help="also simulate consistent_hash (several rings) and prefix's write-balanced "
                        "placement (exact and perturbed); needs a capacity")
    p.add_argument("--ring-seeds", type=int, default=4)
    p.add_argument("--perturb-blocks", type=float, default=3.0)
    p.add_argument("--perturb-seeds", type=int, default=8)
    args = p.parse_args(argv)
    requests = read_trace(args.trace or packaged_trace_path(), start=args.start, limit=args.limit)
    out = simulate_bounds(requests, args.replicas, args.capacity_tokens or None,
                          cpu_capacity_tokens_per_replica=args.cpu_capacity_tokens or None)
    if args.placements:
        if not args.capacity_tokens:
            p.error("--placements needs --capacity-tokens > 0")
        cap = max(1, args.capacity_tokens // TRACE_BLOCK_TOKENS)
        out["placements"] = compare_placements(requests, args.replicas, cap, args.ring_seeds,
                                               args.perturb_blocks, args.perturb_seeds)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
