"""One short ``prefix-loadtest compare`` end to end: real Redis, emulator, workers and router
processes on loopback, two policies, ~30 Mooncake requests at high speedup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.cli import main

pytestmark = pytest.mark.timeout(180)


def test_compare_two_policies_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    status = main([
        "compare", "--policies", "prefix,round_robin", "--peers", "no",
        "--replicas", "2", "--limit", "30", "--speedup", "40", "--num-gpu-blocks", "8000",
        "--max-output-tokens", "32", "--progress-interval", "5", "--output-dir", str(out),
    ])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == {"prefix", "round_robin"}
    assert results["failed"] == {}
    for label, m in results["policies"].items():
        assert m["num_requests"] == 30, label
        assert m["num_errors"] == 0, label
        # Engine counters saw every prompt token of the slice (the worker's hash probe may add
        # a few more queries of its own).
        assert m["prefix_cache_queries"] >= results["bounds"]["single_cache"]["input_tokens"]
        assert 0.0 < m["token_hit_rate"] < 1.0  # block 0 is shared by every Mooncake request
        assert 0.0 < m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["ttft_p99_s"]
        assert m["throughput_rps"] > 0
        assert m["imbalance"] is None or m["imbalance"] >= 1.0
        assert sum(m["requests_per_replica"].values()) == 30
        # prefix-router names the replica of every response; it agrees with the engines' counts
        assert m["requests_per_replica_header"] == m["requests_per_replica"]
        assert m["router_cpu_s_per_request"] > 0
        assert m["cpu_s"]["emulator"] > 0 and m["cpu_s"]["router"] > 0
        records = [json.loads(line) for line in
                   (out / f"records-{label}.jsonl").read_text().splitlines()]
        assert len(records) == 30
        assert all(r["prompt_tokens"] == r["input_length"] for r in records)
        assert all(r["completion_tokens"] == r["max_tokens"] for r in records)
    assert results["policies"]["round_robin"]["requests_per_replica"] == {
        "replica-0": 15, "replica-1": 15}
    for plot in ("ttft_cdf.png", "hit_rate.png", "load_per_replica.png"):
        assert (out / plot).stat().st_size > 1000
