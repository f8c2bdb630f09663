"""Benchmark: the worker's CPU per KV event batch, full decode against lazy (one core).

Run: ``python -m loadtest.bench.kv_decode [--batches 200] [--rounds 15]``. Builds batches
of the demo's kind as vLLM 0.33 encodes them (one ``BlockStored`` of 32-512 blocks of 16
token ids drawn from a 151k vocabulary, with parent and per-block extra keys, plus one
one-block ``BlockRemoved`` per block it evicts, as a loaded replica publishes), then times, in
interleaved rounds (A, B, A, B, ...), ``decode_batch`` full and lazy alone and the worker's
whole pure path (``Worker.precheck``'s store count when it runs, decode, ``EventFilter``,
``ReplicaView.apply_batch``). Prints per variant the median and range over rounds of CPU
microseconds per batch and per stored block, and the median of the per-round ratios (a ratio
within one round is the figure to trust on a busy machine). Pure CPU, no I/O besides printing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from router.shared.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    count_blocks,
    decode_batch,
    encode_batch,
)
from worker.event_filter import EventFilter
from worker.replica_view import ReplicaView

BLOCK_SIZE = 16  # tokens; vLLM default
VOCAB = 151_000  # token ids of a Qwen-sized vocabulary: most take 5 bytes in msgpack


def demo_batches(num_batches: int, resident: int, rng: random.Random) -> tuple[list[bytes], int]:
    """``num_batches`` payloads and the blocks they store; the replica holds ``resident``
    blocks at most, evicting the oldest one event per block beyond that."""
    payloads: list[bytes] = []
    held: list[int] = []
    num_stored = 0
    for _ in range(num_batches):
        n = rng.randint(32, 512)
        hashes: list[int | bytes] = [rng.getrandbits(64) for _ in range(n)]
        events: list[Any] = [BlockStored(
            block_hashes=hashes, parent_block_hash=rng.getrandbits(64) if held else None,
            token_ids=[rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)],
            block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
            extra_keys=[None] * n, group_idx=0)]
        held.extend(h for h in hashes if isinstance(h, int))
        num_stored += n
        evicted, held = held[:max(0, len(held) - resident)], held[max(0, len(held) - resident):]
        events.extend(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in evicted)
        payloads.append(encode_batch(KVEventBatch(time.time(), events, 0)))
    return payloads, num_stored


def worker_path(lazy: bool, precheck: bool) -> Callable[[Sequence[bytes]], None]:
    """The worker's pure per-batch work over ``payloads`` (a fresh view each time)."""

    def run(payloads: Sequence[bytes]) -> None:
        event_filter = EventFilter(block_size=BLOCK_SIZE, dp_rank=0)
        view = ReplicaView(index_stride=1)
        for seq, payload in enumerate(payloads):
            if precheck:
                count_blocks(payload, removals=False)
            view.apply_batch(seq, event_filter.apply(decode_batch(payload, lazy=lazy)))

    return run


def decode_only(lazy: bool) -> Callable[[Sequence[bytes]], None]:
    def run(payloads: Sequence[bytes]) -> None:
        for payload in payloads:
            decode_batch(payload, lazy=lazy)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="batches per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--resident", type=int, default=20_000,
                        help="blocks the replica holds before each store evicts as many")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    payloads, num_stored = demo_batches(args.batches, args.resident, random.Random(args.seed))
    variants: dict[str, Callable[[Sequence[bytes]], None]] = {
        "decode full": decode_only(False),
        "decode lazy": decode_only(True),
        "worker path, full decode": worker_path(False, False),
        "worker path, lazy decode": worker_path(True, False),
        "worker path, lazy + count": worker_path(True, True),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():  # warm-up
        run(payloads[:10])
    for _ in range(args.rounds):
        for name, run in variants.items():
            start = time.process_time()
            run(payloads)
            samples[name].append(time.process_time() - start)
    size = sum(map(len, payloads))
    print(f"{len(payloads)} batches, {num_stored} stored blocks, {size / len(payloads):.0f} bytes "
          f"per batch, {args.rounds} interleaved rounds; CPU time (process_time)")
    print(f"{'variant':28s} {'us/batch median':>16s} {'range':>18s} {'us/stored block':>16s}")
    for name, values in samples.items():
        per_batch = [v / len(payloads) * 1e6 for v in values]
        print(f"{name:28s} {statistics.median(per_batch):16.1f} "
              f"{min(per_batch):8.1f}-{max(per_batch):<9.1f} "
              f"{statistics.median(values) / num_stored * 1e6:16.3f}")
    for a, b in (("decode full", "decode lazy"),
                 ("worker path, full decode", "worker path, lazy decode"),
                 ("worker path, full decode", "worker path, lazy + count")):
        ratios = [x / y for x, y in zip(samples[a], samples[b], strict=True)]
        print(f"{a} / {b}: median {statistics.median(ratios):.2f}x per round "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
