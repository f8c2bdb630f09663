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
* ``single_cache_unlimited``: one cache without capacity limit (the slice's reuse ceiling).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from loadtest.trace import TRACE_BLOCK_TOKENS, TraceRequest


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


def simulate_bounds(requests: Sequence[TraceRequest], replicas: int,
                    capacity_tokens_per_replica: int | None,
                    block_size: int = 16) -> dict[str, Any]:
    """Single-cache, round-robin and unlimited bounds for a slice on ``replicas`` replicas of
    ``capacity_tokens_per_replica`` tokens of KV each (None: unlimited). Raises ``ValueError`` for
    fewer than one replica."""
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
    return {"replicas": replicas, "capacity_blocks_per_replica": cap_blocks,
            "block_tokens": TRACE_BLOCK_TOKENS, "num_requests": len(requests),
            "single_cache": single, "round_robin": rr, "single_cache_unlimited": unlimited}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.simulate [--limit N] [--replicas R] [--capacity-tokens T]``: print the
    bounds for a slice of the packaged (or given) trace."""
    import argparse
    import json

    from loadtest.data import packaged_trace_path
    from loadtest.trace import read_trace

    p = argparse.ArgumentParser(prog="python -m loadtest.simulate", description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=None)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=512_000,
                   help="KV capacity per replica in tokens (0: unlimited)")
    args = p.parse_args(argv)
    requests = read_trace(args.trace or packaged_trace_path(), start=args.start, limit=args.limit)
    print(json.dumps(simulate_bounds(requests, args.replicas, args.capacity_tokens or None), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
