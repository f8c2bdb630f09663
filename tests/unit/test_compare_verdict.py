"""The comparison's yardstick: the emulator lag read from a replica's real metrics page, the
trust verdict both ways, medians and ranges over rounds, and the ranking check."""

from __future__ import annotations

import math
from typing import Any

import pytest

from loadtest.compare.orchestration import aggregate_rounds
from loadtest.compare.report import format_table, run_notes
from loadtest.compare.scraping import LagHistogram
from loadtest.compare.verdict import (
    TRUST_LAG_MAX_S,
    TRUST_LAG_P99_S,
    TRUST_MACHINE_BUSY,
    ranking,
    untrusted_causes,
    verdict,
    verdict_lines,
)
from loadtest.replay.replayer import RequestRecord, error_kinds, summarize
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
    records: list[dict[str, list[Any]]] = [{"prefix": [], "round_robin": [],
                                            "consistent_hash": []} for _ in rounds]
    policies, _ = aggregate_rounds(rounds, records)
    assert policies["prefix"]["ttft_p50_s"] == pytest.approx(0.06)
    assert policies["prefix"]["range"]["ttft_p50_s"] == [0.05, 0.07]
    assert policies["prefix"]["median_round"] == 3 and policies["prefix"]["trusted"]
    assert not policies["round_robin"]["trusted"]
    assert "round 2: machine 99% busy" in policies["round_robin"]["untrusted_reason"]
    table = format_table(policies)
    assert "0.060 (0.050-0.070)" in table and "NO" in table
    # an untrusted row is not ranked: with one trusted row left, no ranking to hold
    rank = ranking(rounds)
    assert "held" not in rank and rank["untrusted"] == ["round_robin"]
    assert rank["orders"][0] == ["prefix"]
    rounds[1]["round_robin"] = _run(ttft_p50_s=0.08, trusted=True, untrusted_reason=None)
    rank = ranking(rounds)
    assert rank["held"] and rank["orders"][0] == ["prefix", "round_robin"]
    # a flipped round breaks the ranking, and the closing lines say so
    rounds[0]["round_robin"] = _run(ttft_p50_s=0.01, trusted=True, untrusted_reason=None)
    rounds[2]["consistent_hash"] = _run(ttft_p50_s=0.2, trusted=False,
                                        untrusted_reason="machine 99% busy",
                                        untrusted_causes=["machine_busy"])
    assert not ranking(rounds)["held"]
    policies, _ = aggregate_rounds(rounds, records)
    lines = verdict_lines({"policies": policies, "ranking": ranking(rounds), "repeat": 3})
    assert lines[0].startswith("NOT TRUSTED: 1 of 3 rows")
    assert any("did NOT hold" in line for line in lines)
    assert not math.isnan(policies["round_robin"]["ttft_p50_s"])


def test_nothing_trusted_holds_no_ranking() -> None:
    """Every row untrusted (the newcomer's busy-machine runs): no ``held`` in results.json,
    and the closing lines say the ranking was not checked."""
    rounds = [{label: _run(ttft_p50_s=t, trusted=False, untrusted_reason="machine 99% busy",
                           untrusted_causes=["machine_busy"])
               for label, t in (("prefix", 0.05), ("round_robin", 0.09))} for _ in range(2)]
    rank = ranking(rounds)
    assert "held" not in rank and rank["untrusted"] == ["prefix", "round_robin"]
    policies, _ = aggregate_rounds(rounds, [{"prefix": [], "round_robin": []}] * 2)
    lines = verdict_lines({"policies": policies, "ranking": rank, "repeat": 2})
    assert "ranking: not checked (fewer than two rows trusted in every round)" in lines
    assert not any("held in all" in line for line in lines)


def test_each_row_names_only_its_own_causes() -> None:
    """One row failed on emulator lag alone at 62% busy, one on the machine, one on errors: the
    closing lines name each row's causes and no other's (the newcomer's run said "no CPU
    headroom" for rows that were 62-66% busy)."""
    lagging = _run(emulator_lag_p99_s=0.05)
    busy = _run(cpu_s={"machine_util": 0.97})
    failing = _run(num_requests=1000, num_errors=3, errors_by_kind=[
        {"status": 503, "reason": "no routable replica", "count": 2, "first_s": 12.0,
         "last_s": 13.5},
        {"status": 0, "reason": "timeout after 300.0 s", "count": 1, "first_s": 40.0,
         "last_s": 40.0}])
    policies = {}
    for label, m in (("prefix", lagging), ("ttft", busy), ("round_robin", failing),
                     ("least_loaded", _run())):
        m["trusted"], m["untrusted_reason"] = verdict(m)
        m["untrusted_causes"] = [c for c, _ in untrusted_causes(m)]
        policies[label] = m
    lines = verdict_lines({"policies": policies, "ranking": ranking([policies]), "repeat": 1})
    assert lines[0].startswith("NOT TRUSTED: 3 of 4 rows")
    row = {line.split(":")[0].strip(): line for line in lines[1:4]}
    assert "fell behind" in row["prefix"] and "headroom" not in row["prefix"]
    assert "headroom" in row["ttft"] and "fell behind" not in row["ttft"]
    assert "requests failed" in row["round_robin"] and "headroom" not in row["round_robin"]
    assert "2 x HTTP 503 'no routable replica' at 12.0-13.5 s" in row["round_robin"]
    assert "1 x no response 'timeout after 300.0 s' at 40.0 s" in row["round_robin"]
    assert "trusted: least_loaded" in lines
    notes = run_notes(policies)
    assert any(n.startswith("round_robin: 3 failed requests, by kind") for n in notes)


def test_table_has_full_names_a_legend_and_tier_columns_only_with_a_tier() -> None:
    policies = {"prefix": {**_run(), "trusted": True, "tiers_token_hit_rate": 0.15,
                           "num_requests": 10, "num_errors": 0}}
    table = format_table(policies)
    header = table.splitlines()[0]
    assert "busy max/mean" in header and "work max/mean" in header and "imbal" not in header
    assert "CPU tier" not in table
    assert "  busy max/mean: busy time of the busiest replica" in table
    assert "+CPU tier hit %" in format_table(policies, cpu_tier=True)


def test_failed_requests_are_counted_by_status_reason_and_time() -> None:
    body = '{"error": {"message": "no routable replica: every heartbeat is stale", "code": 503}}'
    records = [RequestRecord(0, 0, 0.0, send_s=0.0, status=200),
               RequestRecord(1, 1, 1.0, send_s=1.2, status=503, error=f"HTTP 503: {body}"),
               RequestRecord(2, 2, 3.0, send_s=3.5, status=503, error=f"HTTP 503: {body}"),
               RequestRecord(3, 3, 4.0, send_s=4.0, error="timeout after 300.0 s"),
               RequestRecord(4, 4, 9.0, error="not sent")]
    kinds = error_kinds(records)
    assert kinds[0] == {"status": 503, "reason": "no routable replica: every heartbeat is stale",
                        "count": 2, "first_s": 1.2, "last_s": 3.5}
    assert {(k["status"], k["reason"], k["count"], k["first_s"]) for k in kinds[1:]} == {
        (0, "timeout after 300.0 s", 1, 4.0), (0, "not sent", 1, 9.0)}
    assert summarize(records)["errors_by_kind"] == kinds
