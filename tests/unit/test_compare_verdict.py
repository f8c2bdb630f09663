"""The comparison's yardstick: the emulator lag read from a replica's real metrics page, the
trust verdict both ways, medians and ranges over rounds, and the ranking check."""

from __future__ import annotations

import math
from typing import Any

import pytest

from loadtest.compare import (
    TRUST_LAG_MAX_S,
    TRUST_LAG_P99_S,
    TRUST_MACHINE_BUSY,
    LagHistogram,
    aggregate_rounds,
    format_table,
    ranking,
    verdict,
    verdict_lines,
)
from worker.emulator.metrics import ReplicaMetrics


def _metrics_page(lags: list[float]) -> str:
    m = ReplicaMetrics("m", {"block_size": "16"}, lambda: 0, lambda: 0, lambda: 0.0)
    for lag in lags:
        m.observe_lag(lag)
    return m.exposition().decode()


def test_lag_histogram_from_a_replica_metrics_page() -> None:
    # 98 steps on time, one 30 ms late, one 1.5 s late
    page = _metrics_page([0.0] * 98 + [0.03, 1.5])
    lag = LagHistogram.parse(page)
    assert lag.count == 100
    assert lag.max_s == pytest.approx(1.5)
    assert lag.quantile(0.5) is not None and lag.quantile(0.5) <= 0.0005
    # rank 99 of 100 lies in the (0.02, 0.05] bucket
    p99 = lag.quantile(0.99)
    assert p99 is not None and 0.02 < p99 <= 0.05
    # two replicas merge; the difference of two scrapes keeps only what came between
    later = LagHistogram.parse(_metrics_page([0.0] * 98 + [0.03, 1.5, 0.2, 0.2]))
    assert later.merged(lag).count == 202
    assert later.minus(lag).count == 2
    assert LagHistogram().quantile(0.99) is None


def _run(**over: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"emulator_lag_p99_s": 0.004, "emulator_lag_max_s": 0.05,
                         "cpu_s": {"machine_util": 0.6}, "max_send_lag_s": 0.01,
                         "token_hit_rate": 0.15, "ttft_p50_s": 0.05, "ttft_p99_s": 0.9}
    m.update(over)
    return m


def test_verdict_trusts_a_run_that_kept_time() -> None:
    assert verdict(_run()) == (True, None)


@pytest.mark.parametrize(("over", "phrase"), [
    ({"emulator_lag_p99_s": TRUST_LAG_P99_S * 2}, "emulator lag p99"),
    ({"emulator_lag_max_s": TRUST_LAG_MAX_S + 1}, "emulator lag max"),
    ({"cpu_s": {"machine_util": min(1.0, TRUST_MACHINE_BUSY + 0.05)}}, "busy"),
    ({"max_send_lag_s": 2.0}, "replayer sent"),
    ({"emulator_lag_p99_s": None}, "no lag figures"),
])
def test_verdict_names_why_a_run_is_not_trusted(over: dict[str, Any], phrase: str) -> None:
    trusted, reason = verdict(_run(**over))
    assert not trusted
    assert reason is not None and phrase in reason


def test_rounds_give_medians_ranges_and_the_ranking() -> None:
    fast = [_run(ttft_p50_s=t, trusted=True, untrusted_reason=None) for t in (0.05, 0.07, 0.06)]
    slow = [_run(ttft_p50_s=t, trusted=ok, untrusted_reason=None if ok else "machine 99% busy")
            for t, ok in ((0.09, True), (0.08, False), (0.10, True))]
    rounds = [{"prefix": f, "round_robin": s} for f, s in zip(fast, slow, strict=True)]
    records: list[dict[str, list[Any]]] = [{"prefix": [], "round_robin": []} for _ in rounds]
    policies, _ = aggregate_rounds(rounds, records)
    assert policies["prefix"]["ttft_p50_s"] == pytest.approx(0.06)
    assert policies["prefix"]["range"]["ttft_p50_s"] == [0.05, 0.07]
    assert policies["prefix"]["median_round"] == 3 and policies["prefix"]["trusted"]
    assert not policies["round_robin"]["trusted"]
    assert "round 2: machine 99% busy" in policies["round_robin"]["untrusted_reason"]
    table = format_table(policies)
    assert "0.060 (0.050-0.070)" in table and "NO" in table
    rank = ranking(rounds)
    assert rank["held"] and rank["orders"][0] == ["prefix", "round_robin"]
    # a flipped round breaks the ranking, and the closing lines say so
    rounds[0]["round_robin"] = _run(ttft_p50_s=0.01, trusted=True, untrusted_reason=None)
    assert not ranking(rounds)["held"]
    policies, _ = aggregate_rounds(rounds, records)
    lines = verdict_lines({"policies": policies, "ranking": ranking(rounds), "repeat": 3})
    assert lines[0].startswith("NOT TRUSTED: 1 of 2 rows")
    assert any("did NOT hold" in line for line in lines)
    assert not math.isnan(policies["round_robin"]["ttft_p50_s"])
