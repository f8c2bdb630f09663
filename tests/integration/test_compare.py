"""One short ``prefix-loadtest compare`` end to end: real Redis, emulator, workers and router
processes on loopback, two policies, ~30 Mooncake requests at high speedup."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loadtest.cli import main
from loadtest.compare.verdict import verdict

pytestmark = pytest.mark.timeout(180)


def test_compare_two_policies_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    status = main([
        "compare", "--policies", "prefix,round_robin", "--peers", "no",
        "--replicas", "2", "--limit", "30", "--speedup", "40", "--num-gpu-blocks", "8000",
        "--max-output-tokens", "32", "--progress-interval", "5", "--output-dir", str(out),
        "--repeat", "2",
    ])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == {"prefix", "round_robin"}
    assert results["failed"] == {}
    # two interleaved rounds, each policy's figures the median of its rounds, with the range
    assert results["repeat"] == 2 and len(results["rounds"]) == 2
    assert len(results["ranking"]["orders"]) == 2
    assert results["verdict"]
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
        assert m["rounds"] == 2
        low, high = m["range"]["ttft_p50_s"]
        assert low <= m["ttft_p50_s"] <= high
        # every run carries its lag figures and its verdict, consistent with its own figures
        for rnd in results["rounds"]:
            run = rnd[label]
            assert run["emulator_steps"] > 0
            assert 0 <= run["emulator_lag_p50_s"] <= run["emulator_lag_p99_s"] <= run[
                "emulator_lag_max_s"]
            assert run["trusted"] == verdict(run)[0]
            assert run["priority"]["note"]
        records = [json.loads(line) for line in
                   (out / f"records-{label}-r2.jsonl").read_text().splitlines()]
        assert len(records) == 30
        assert all(r["prompt_tokens"] == r["input_length"] for r in records)
        assert all(r["completion_tokens"] == r["max_tokens"] for r in records)
    assert results["policies"]["round_robin"]["requests_per_replica"] == {
        "replica-0": 15, "replica-1": 15}
    for plot in ("ttft_cdf.png", "hit_rate.png", "load_per_replica.png"):
        assert (out / plot).stat().st_size > 1000


def test_a_run_whose_emulator_stalls_is_not_trusted(tmp_path: Path) -> None:
    """SIGSTOP the emulator in the middle of a replay: the run is marked untrusted, in
    results.json and in the closing lines, with the lag as the reason."""
    out = tmp_path / "results"
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.cli", "compare", "--policies", "round_robin",
         "--peers", "no", "--replicas", "1", "--limit", "60", "--speedup", "5",
         # engine time = wall time and long outputs: several requests are always in flight when
         # the stall comes, so steps fall due while the process is stopped
         "--time-scale", "1", "--max-output-tokens", "256",
         "--num-gpu-blocks", "8000", "--no-bounds", "--no-plots",
         "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "replaying" in line:
            break
    emulator = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                    if "emulate" in " ".join(p.cmdline()))
    time.sleep(1.0)
    emulator.suspend()
    time.sleep(2.0)
    emulator.resume()
    rest, _ = proc.communicate(timeout=150)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    run = json.loads((out / "results.json").read_text())["policies"]["round_robin"]
    assert run["emulator_lag_max_s"] >= 1.5
    assert run["trusted"] is False
    assert "emulator lag max" in run["untrusted_reason"]
    assert "NOT TRUSTED: 1 of 1 rows" in output
