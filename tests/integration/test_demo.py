"""The main job end to end: ``prefix-loadtest demo`` as a newcomer runs it (a short slice of the
packaged trace, three policies, no peers, no plots), as a real process that starts its own
emulated fleet, embedded Redis, workers and routers. It exits 0, prints its comparison and
verdict, and writes results whose figures agree with each other: every request answered once,
by one replica the records name, the engines' own prefix-cache counters and the clients'
``cached_tokens`` telling the same hit rate, round robin spreading evenly. Latencies and the
trusted column depend on the machine, so nothing here judges them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loadtest.harness.processes import PYTHON

pytestmark = pytest.mark.timeout(600)

NUM_REQUESTS = 60
POLICIES = ("prefix", "round_robin", "consistent_hash")


def test_the_demo_runs_and_its_figures_agree(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run(
        [PYTHON, "-m", "loadtest.cli", "demo", "--limit", str(NUM_REQUESTS), "--policies",
         ",".join(POLICIES), "--peers", "no", "--no-plots", "--speedup", "5", "--replicas", "4",
         "--output-dir", str(out)],
        capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = done.stdout
    assert "TTFT p50 s" in printed and f"results: {out / 'results.json'}" in printed, printed

    results = json.loads((out / "results.json").read_text())
    assert results["failed"] == {} and results["trace"]["num_requests"] == NUM_REQUESTS
    assert results["verdict"] and all(line in printed for line in results["verdict"]), printed
    assert set(results["policies"]) == set(POLICIES)
    for policy, row in results["policies"].items():
        assert row["num_requests"] == NUM_REQUESTS and row["num_errors"] == 0, (policy, row)
        per_replica = row["requests_per_replica"]
        # the engines' request counters and the router's replica header name the same replicas
        assert sum(per_replica.values()) == NUM_REQUESTS, (policy, per_replica)
        assert per_replica == row["requests_per_replica_header"], policy
        records = (out / f"records-{policy}.jsonl").read_text().splitlines()
        assert len(records) == NUM_REQUESTS, policy
        # the engines' own counters (vllm:prefix_cache_hits / queries) and what the clients
        # saw in usage.prompt_tokens_details.cached_tokens: one hit rate
        assert 0 <= row["token_hit_rate"] <= 1
        assert row["client_token_hit_rate"] == pytest.approx(row["token_hit_rate"], abs=1e-3)
    spread = results["policies"]["round_robin"]["requests_per_replica"].values()
    assert max(spread) - min(spread) <= 2, spread  # one router, one turn each (a retry: 2)
