"""Cross-tenant timing through the router's prompt caches (issue 29 item 3): does tenant A route a
text faster when tenant B sent it first?

``python -m loadtest.bench.tenant_cache [--pairs 20] [--chars 120000]`` starts a null replica
(``loadtest.bench.router --serve-null``: answers every completion at once) and a router in
front of it with API keys for two tenants, the Qwen3 tokenizer and ``--debug-access tenant``.
For each pair: B sends a real completion of a new text X (and the router finishes hashing its
rest); then A asks ``POST /debug/route`` (a dry run: the whole prompt tokenized and hashed, the
most a tenant can make the router compute, so the largest signal a cache could give) for X and
for an unseen text Y of the same length, in alternating order; then B asks for X again (the
control: the same-tenant hit the caches are for). Reported: the medians, A's paired
differences, and a significance test of "seen" against "unseen" (Mann-Whitney U from scipy if
installed, else a two-sided permutation test of the difference of medians in numpy). Figures,
not pass/fail; the test suite checks the behaviour (every cache misses for A) by counting.

To compare with another version of the router, copy this file into that checkout and run it
from there (``python -m`` puts the working directory first on the module path).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.harness.processes import PYTHON, start_process, stop_processes, wait_for, wait_ready
from router.edges.auth import hash_key, new_key
from router.request.prompts import default_tokenizer_dir

MODEL = "emulated-llm"
PERMUTATIONS = 20_000  # permutation-test resamples (p resolution 5e-5)
QUIET_POLLS = 6  # /metrics polls 0.25 s apart with unchanged prompt-cache series: rest hashed


def _post(url: str, body: dict[str, Any], key: str) -> tuple[float, dict[str, Any]]:
    """``(seconds, JSON answer)`` of one POST; raises on a status other than 200."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        raw = response.read()
    return time.perf_counter() - started, json.loads(raw)


def _cache_series(router_url: str, key: str) -> str:
    request = urllib.request.Request(router_url + "/metrics",
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text: str = response.read().decode()
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("router_prompt_cache_"))


def _settle(router_url: str, key: str) -> None:
    """Wait until the router's prompt-cache series (lookups; entries, refreshed every second)
    stop changing: the rest of a lazily hashed prompt is done."""
    seen: list[str] = []

    def quiet() -> bool:
        seen.append(_cache_series(router_url, key))
        return len(seen) > QUIET_POLLS and len(set(seen[-QUIET_POLLS:])) == 1

    wait_for(quiet, 120, 0.25, "the router's prompt caches to settle")


def make_text(rng: random.Random, chars: int) -> str:
    """Prose-like text of exactly ``chars`` characters: random words on lines of ~80 characters,
    words drawn from a large space so two texts share no line."""
    lines: list[str] = []
    total = 0
    while total < chars:
        line = " ".join(f"w{rng.randrange(10**7)}" for _ in range(10)) + ".\n"
        lines.append(line)
        total += len(line)
    return "".join(lines)[:chars]


def significance(seen: list[float], unseen: list[float]) -> tuple[str, float]:
    """``(test name, two-sided p)`` for "seen and unseen come from one distribution"."""
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:
        pass
    else:
        return "Mann-Whitney U", float(mannwhitneyu(seen, unseen, alternative="two-sided").pvalue)
    both = np.asarray(seen + unseen)
    n = len(seen)
    observed = abs(np.median(both[:n]) - np.median(both[n:]))
    rng = np.random.default_rng(0)
    perms = np.array([rng.permutation(both) for _ in range(PERMUTATIONS)])
    diffs = np.abs(np.median(perms[:, :n], axis=1) - np.median(perms[:, n:], axis=1))
    return "permutation (median difference)", float((np.sum(diffs >= observed) + 1)
                                                    / (PERMUTATIONS + 1))


def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_tenant_cache_"))
    keys = {"a": new_key(), "b": new_key()}
    (tmp / "keys.txt").write_text(f"tenant-a {hash_key(keys['a'])}\ntenant-b {hash_key(keys['b'])}\n")
    (tmp / "salt").write_text("bench-tenant-cache-secret-0123456789")
    replica = start_process([PYTHON, "-m", "loadtest.bench.router", "--serve-null",
                             str(tmp / "replica.json")], log_path=tmp / "replica.log")
    procs = [replica]
    try:
        replica_url = wait_ready(tmp / "replica.json", procs, 60)["replicas"][0]["url"]
        router = start_process([
            PYTHON, "-m", "router.cli", "serve", "--port", "0", "--replica", replica_url,
            "--tokenizer", str(default_tokenizer_dir()), "--api-keys", str(tmp / "keys.txt"),
            "--cache-salt-secret-file", str(tmp / "salt"), "--debug-access", "tenant",
            "--audit-families", "0", "--ready-file", str(tmp / "router.json"),
            "--log-level", "warning"], log_path=tmp / "router.log")
        procs.append(router)
        url = wait_ready(tmp / "router.json", procs, 120)["url"]
        rng = random.Random(args.seed)
        warm = make_text(rng, args.chars)  # the tokenizer's and the loop's first-use costs
        _post(url + "/debug/route", {"model": MODEL, "prompt": warm}, keys["a"])
        seen: list[float] = []
        unseen: list[float] = []
        repeat: list[float] = []
        for i in range(args.pairs):
            x, y = make_text(rng, args.chars), make_text(rng, args.chars)
            _post(url + "/v1/completions", {"model": MODEL, "prompt": x, "max_tokens": 1},
                  keys["b"])
            _settle(url, keys["a"])
            order = [("seen", x), ("unseen", y)] if i % 2 == 0 else [("unseen", y), ("seen", x)]
            for label, text in order:
                elapsed, answer = _post(url + "/debug/route", {"model": MODEL, "prompt": text},
                                        keys["a"])
                assert answer["tokenized"], answer
                (seen if label == "seen" else unseen).append(elapsed)
            repeat.append(_post(url + "/debug/route", {"model": MODEL, "prompt": x}, keys["b"])[0])
            print(f"pair {i + 1:2d}: A seen-by-B {seen[-1] * 1e3:7.1f} ms, unseen "
                  f"{unseen[-1] * 1e3:7.1f} ms; B's own repeat {repeat[-1] * 1e3:6.1f} ms",
                  flush=True)
    finally:
        stop_processes(procs)
    test, p = significance(seen, unseen)
    diffs = [s - u for s, u in zip(seen, unseen, strict=True)]
    print(f"\n{args.pairs} pairs, {args.chars:,}-character texts, A's POST /debug/route (whole "
          "prompt tokenized and hashed):")
    print(f"  A, text B had sent: median {statistics.median(seen) * 1e3:.1f} ms")
    print(f"  A, unseen text:     median {statistics.median(unseen) * 1e3:.1f} ms")
    print(f"  A's paired difference (seen - unseen): median {statistics.median(diffs) * 1e3:+.1f} "
          f"ms, seen faster in {sum(d < 0 for d in diffs)} of {len(diffs)} pairs")
    print(f"  {test}: p = {p:.3g} ({'significant' if p < 0.05 else 'no significant difference'} "
          "at 0.05)")
    print(f"  control, B's own repeat: median {statistics.median(repeat) * 1e3:.1f} ms (the "
          "same-tenant hit the caches are for)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="interleaved seen/unseen pairs")
    parser.add_argument("--chars", type=int, default=120_000, help="characters per text")
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
