"""Block index cost: bytes per resident block at 1M blocks over 64 replicas, chain lookup time.

``python -m loadtest.bench.index [--blocks N] [--replicas R] [--chain 2048] [--stride 16]``. Memory is measured
with tracemalloc around building the index (keys are 64-bit ints as in production). Reports
figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from router.decision.index import BlockIndex, SpeculativePlacements
from router.shared.contract import BlockKey, anchor_keys


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct resident block keys")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--copies", type=float, default=1.0,
                        help="mean replicas holding each key (1.0: every key on one replica)")
    parser.add_argument("--chain", type=int, default=2048, help="blocks in the looked-up chain")
    parser.add_argument("--stride", type=int, default=1,
                        help="index_stride: each replica's keys form one chain and only its anchor "
                             "keys enter the index, as workers publish them (1 = every key)")
    parser.add_argument("--sweep-keys", type=int, default=5_000,
                        help="keys per background sweep step (router.service.background.SWEEP_KEYS_PER_STEP)")
    return parser.parse_args()


def _build_index(args: argparse.Namespace, rng: random.Random, replica_ids: list[str],
                 ) -> tuple[BlockIndex, list[BlockKey], int, float, float]:
    """The index of ``args.blocks`` random keys spread over ``replica_ids``, built under
    tracemalloc: the index, the first replica's first ``args.chain`` keys, the (key, replica)
    pairs, the build time (seconds) and the bytes the index holds."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    # key ints are created under tracing: in production the Redis reader creates them
    per_replica: dict[str, list[BlockKey]] = {rid: [] for rid in replica_ids}
    extra = args.copies - 1.0
    for _ in range(args.blocks):
        key = BlockKey(rng.getrandbits(64))
        per_replica[rng.choice(replica_ids)].append(key)
        if extra > 0 and rng.random() < extra:
            per_replica[rng.choice(replica_ids)].append(key)
    resident = sum(len(v) for v in per_replica.values())
    index = BlockIndex(args.stride)
    t0 = time.perf_counter()
    for rid, held in per_replica.items():
        index.add(rid, anchor_keys(held, args.stride))
    build_s = time.perf_counter() - t0
    holder = replica_ids[0]
    full_chain = list(per_replica[holder][: args.chain])
    del per_replica, held  # the index now owns the only references to the key ints
    used = tracemalloc.get_traced_memory()[0] - base - 8 * len(full_chain) - 36 * len(full_chain)
    tracemalloc.stop()
    return index, full_chain, resident, build_s, used


def main() -> None:
    args = _arguments()
    rng = random.Random(1)
    replica_ids = [f"replica-{i}" for i in range(args.replicas)]
    index, full_chain, resident, build_s, used = _build_index(args, rng, replica_ids)

    # a chain whose first 2/3 is held by one replica (a long conversation)
    chain = full_chain[: args.chain * 2 // 3]
    chain += [BlockKey(rng.getrandbits(64)) for _ in range(args.chain - len(chain))]
    mask = index.mask_of(replica_ids)
    spec = SpeculativePlacements(10.0)
    spec.place(index.bit(replica_ids[1]), chain[:100], now=0.0)

    def time_lookup(c: list[BlockKey], rounds: int = 200) -> float:
        t = time.perf_counter()
        for _ in range(rounds):
            index.hit_depths(c, mask, spec, now=1.0)
        return (time.perf_counter() - t) / rounds * 1e6

    cold = [BlockKey(rng.getrandbits(64)) for _ in range(args.chain)]
    print(f"index: {len(index):,} distinct keys, {resident:,} (key, replica) pairs, "
          f"{args.replicas} replicas; build {build_s:.2f} s")
    print(f"memory: {used / 1e6:.1f} MB = {used / len(index):.1f} bytes per key in the index "
          f"({used / resident:.1f} per resident (block, replica) pair; stride {args.stride})")
    print(f"lookup, {args.chain}-block chain: fully held {time_lookup(full_chain):.0f} us, "
          f"2/3 held {time_lookup(chain):.0f} us, nothing held {time_lookup(cold):.1f} us")
    t = time.perf_counter()
    index.clear(replica_ids[2])
    clear_s = time.perf_counter() - t
    t = time.perf_counter()
    index.drop(replica_ids[3])
    drop_s = time.perf_counter() - t
    print(f"clear one replica (epoch reset): {clear_s * 1e6:.1f} us; drop one (expiry): "
          f"{drop_s * 1e6:.1f} us; lookups see it at once")
    steps, worst, t = 0, 0.0, time.perf_counter()
    while index.sweep_pending:
        s = time.perf_counter()
        index.sweep_step(args.sweep_keys)
        worst = max(worst, time.perf_counter() - s)
        steps += 1
    print(f"background sweep of the 2 retired slots: {(time.perf_counter() - t) * 1e3:.0f} ms in "
          f"{steps} steps of {args.sweep_keys:,} keys, longest step {worst * 1e3:.1f} ms "
          f"(the event loop runs between steps)")


if __name__ == "__main__":
    main()
