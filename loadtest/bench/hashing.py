"""Benchmark: vLLM block hashing speed per algorithm and prompt length (one core).

Run: ``python -m loadtest.bench.hashing [--repeat 30]``. Prints milliseconds per
prompt (best and median of the repeats) and microseconds per block for 1k, 8k
and 32k-token prompts, for every algorithm, plus the ratio to sha256. Pure CPU,
no I/O besides printing. Not a pass/fail test: the figures go into notes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from router.shared.hashing import HASH_ALGOS, BlockHasher

PROMPT_LENGTHS = (1_024, 8_192, 32_768)  # tokens


def measure(hasher: BlockHasher, tokens: Sequence[int], repeat: int) -> list[float]:
    """Seconds per ``hasher.keys(tokens)`` call, ``repeat`` samples after one warm-up."""
    hasher.keys(tokens)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        hasher.keys(tokens)
        samples.append(time.perf_counter() - start)
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = {n: [rng.randrange(0, 151_000) for _ in range(n)] for n in PROMPT_LENGTHS}
    print(f"{'algo':12s} {'tokens':>7s} {'best ms':>8s} {'median ms':>10s} {'us/block':>9s} {'vs sha256':>10s}")
    baseline: dict[int, float] = {}
    for algo in HASH_ALGOS:
        hasher = BlockHasher(args.block_size, algo, "0")
        for n, tokens in prompts.items():
            samples = measure(hasher, tokens, args.repeat)
            median = statistics.median(samples)
            baseline.setdefault(n, median)
            per_block_us = median / (n // args.block_size) * 1e6
            print(f"{algo:12s} {n:7d} {min(samples) * 1e3:8.2f} {median * 1e3:10.2f} "
                  f"{per_block_us:9.2f} {median / baseline[n]:9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
