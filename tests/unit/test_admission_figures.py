"""The admission benchmark's arithmetic (``loadtest.bench.admission_figures``): which requests met their
class's target, goodput, answers by status, prefill shares, capacity and speedup, the most a
rate limit let through in any window. Exact values on hand-made records; nothing timed."""

from __future__ import annotations

import pytest

from loadtest.bench import admission_figures as fig
from loadtest.replay.replayer import RequestRecord


def served(ttft_s: float, prompt: int = 100, cached: int = 0, send_s: float = 0.0,
           e2e_s: float = 1.0) -> RequestRecord:
    return RequestRecord(0, 0, send_s, send_s=send_s, ttft_s=ttft_s, e2e_s=e2e_s, status=200,
                         prompt_tokens=prompt, cached_tokens=cached)


def refused(status: int, retry_after: str | None, e2e_s: float = 0.5) -> RequestRecord:
    return RequestRecord(0, 0, 0.0, send_s=0.0, e2e_s=e2e_s, status=status,
                         error=f"HTTP {status}: ...", retry_after=retry_after)


def test_goodput_counts_the_served_requests_within_their_class_target() -> None:
    by_class = {"interactive": [served(0.5), served(1.0), served(1.01), refused(503, "2")],
                "batch": [served(4.0), served(9.0)]}
    # interactive: 0.5 and 1.0 meet 1.0 s (1.01 does not, the 503 never does); batch: 4.0
    assert fig.goodput_rps(by_class, {"interactive": 1.0, "batch": 5.0}, 10.0) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        fig.goodput_rps(by_class, {"interactive": 1.0}, 10.0)  # batch has no target
    with pytest.raises(ValueError):
        fig.goodput_rps(by_class, {"interactive": 1.0, "batch": 5.0}, 0.0)


def test_statuses_count_retry_after_and_unanswered_requests() -> None:
    never_sent = RequestRecord(9, 9, 99.0, error="not sent")
    gave_up = RequestRecord(1, 1, 0.0, send_s=0.0, error="cancelled")
    records = [served(0.1), refused(503, "3"), refused(503, None), refused(429, "1"), gave_up,
               never_sent]
    counts = fig.statuses(records)
    assert counts == {"200": 1, "429": 1, "429 with Retry-After": 1, "503": 2,
                      "503 with Retry-After": 1, fig.NO_ANSWER: 1}
    assert not fig.nothing_lost(counts)  # a 503 without Retry-After, and one unanswered
    assert fig.nothing_lost(fig.statuses([served(0.1), refused(503, "3"), refused(429, "1")]))
    assert fig.longest_refusal_s([refused(503, "1", 2.5), refused(429, "1", 0.2)]) == 2.5


def test_prefill_shares_count_computed_tokens_of_served_requests() -> None:
    a = [served(0.1, prompt=1000, cached=200), refused(503, "1")]  # 800 computed
    b = [served(0.1, prompt=500), served(0.1, prompt=700, cached=0)]  # 1200
    assert fig.prefill_shares({"a": a, "b": b}) == {"a": pytest.approx(0.4),
                                                    "b": pytest.approx(0.6)}
    assert fig.prefill_shares({"a": [refused(503, "1")]}) == {"a": None}


def test_class_figures() -> None:
    records = [served(t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] + [refused(503, "1")]
    out = fig.class_figures(records, 4.5)
    assert out["sent"] == 6 and out["served"] == 5 and out["met_target"] == 4
    assert out["ttft_p50_s"] == 3.0 and out["ttft_p90_s"] == pytest.approx(4.6)
    assert out["p90_within_target"] is False
    assert fig.class_figures(records, None)["met_target"] is None


def test_capacity_from_completions_and_the_speedup_for_a_load() -> None:
    records = [served(0.1, send_s=s, e2e_s=1.0) for s in (0.0, 4.0, 5.0, 6.0, 9.5)]
    # streams ending at 1, 5, 6, 7, 10.5: three in [5, 10)
    assert fig.served_rps(records, 5.0, 10.0) == pytest.approx(0.6)
    assert fig.speedup_for(2.0, 6.0, 3.0) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        fig.speedup_for(2.0, 0.0, 3.0)


def test_most_in_any_window_counts_requests_let_through_inside_one() -> None:
    spans = [(0.0, 0.1, 5), (0.5, 0.6, 1), (1.0, 1.2, 2), (2.05, 2.1, 3)]
    # from 0: the first three (answered before 2.0): 8; from 0.5: 1 + 2 + 3 (2.1 < 2.5): 6
    assert fig.most_in_any_window(spans, 2.0) == 8
    # a request answered after the window's end may have been let through after it: not counted
    assert fig.most_in_any_window([(0.0, 0.1, 1), (0.9, 1.05, 1)], 1.0) == 1
    assert fig.most_in_any_window([], 60.0) == 0
    with pytest.raises(ValueError):
        fig.most_in_any_window(spans, 0.0)


def test_tenant_figures_of_a_fairness_phase() -> None:
    records = [RequestRecord(0, 0, 0.0, send_s=1.0, status=200, input_length=100,
                             prompt_tokens=100, cached_tokens=20),
               RequestRecord(1, 1, 0.0, send_s=2.0, status=200, input_length=300,
                             prompt_tokens=300, cached_tokens=0),
               refused(503, "2"), RequestRecord(3, 3, 9.0)]  # the last was never sent
    out = fig.tenant_figures(records)
    assert (out["sent"], out["served"]) == (3, 2)
    assert (out["prompt_tokens_sent"], out["prompt_tokens_served"]) == (400, 400)
    assert out["cached_share"] == 0.05 and out["refused_sent_at_s"] == [0.0]
