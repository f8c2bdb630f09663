"""The TTFT floor of a slice: each request's own chunked prefill alone, with the best possible hit."""

from __future__ import annotations

import pytest

from loadtest.compare.command import slice_ttft_floor
from loadtest.compare.report import format_bounds
from loadtest.replay.simulate import ttft_floor
from router.tools.trace_format import TraceRequest
from worker.emulator.profiles import LatencyModel


def req(index: int, tokens: int, hash_ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index=index, timestamp_ms=index, input_length=tokens, output_length=8,
                        hash_ids=hash_ids)


def test_one_request_is_its_own_chunked_prefill() -> None:
    latency = LatencyModel()
    # 10,000 tokens in chunks of 4,096: three steps, each attending to the tokens before it.
    expected = (latency.step_time_s([(4096, 0)], 0, 0) + latency.step_time_s([(4096, 4096)], 0, 0)
                + latency.step_time_s([(1808, 8192)], 0, 0)) / 10.0
    floor = ttft_floor([req(0, 10_000, tuple(range(20)))], latency, time_scale=10.0,
                       max_num_batched_tokens=4096)
    assert floor["p50_s"] == pytest.approx(expected)
    assert floor["no_hit_p50_s"] == pytest.approx(expected)  # nothing earlier to hit


def test_a_repeated_prefix_counts_as_hit() -> None:
    latency = LatencyModel()
    first = req(0, 2048, (1, 2, 3, 4))
    again = req(1, 2048 + 100, (1, 2, 3, 4, 5))  # shares four 512-token blocks with the first
    floor = ttft_floor([first, again, again], latency, time_scale=1.0,
                       max_num_batched_tokens=8192)
    alone_cold = latency.step_time_s([(2148, 0)], 0, 0)
    alone_hit = latency.step_time_s([(100, 2048)], 0, 0)
    assert floor["no_hit_p99_s"] == pytest.approx(alone_cold)
    # sorted floors: the third (hits 2,144 of 2,148: the floor((N-1)/B) cap), the second (hits
    # the first's 2,048), the first (cold); the median is the second's
    assert floor["p50_s"] == pytest.approx(alone_hit)
    assert alone_hit < alone_cold / 5


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        ttft_floor([], LatencyModel(), time_scale=1.0, max_num_batched_tokens=1)
    with pytest.raises(ValueError):
        ttft_floor([req(0, 10, (1,))], LatencyModel(), time_scale=0.0, max_num_batched_tokens=1)


def test_compare_uses_the_emulators_profile_and_prints_the_floor() -> None:
    requests = [req(0, 8192, tuple(range(16)))]
    default = slice_ttft_floor(requests, 16, 10.0, [])
    slower = slice_ttft_floor(requests, 16, 10.0, ["--gpu-tflops", "100"])
    assert default is not None and slower is not None
    assert slower["p50_s"] > 2 * default["p50_s"]  # a quarter of the default 400 TFLOP/s
    bounds = {"single_cache": {"token_hit_rate": 0.2}, "round_robin": {"token_hit_rate": 0.1},
              "replicas": 2, "capacity_blocks_per_replica": 10, "block_tokens": 512,
              "ttft_floor": default}
    text = format_bounds(bounds, {"prefix": {"token_hit_rate": 0.19}})
    assert f"p50 {default['p50_s']:.3f} s" in text and "TTFT floor" in text


def test_the_floor_is_taken_as_the_rows_are_so_no_row_beats_it() -> None:
    """200 requests of distinct sizes, each alone: a run that gave every request exactly its
    floor must read the floor's quantiles, not lower ones (the floor took a nearest rank and
    read p99 above such a run's interpolated p99: issue 34's reviewer saw rows under it)."""
    from loadtest.replay.replayer import percentile

    latency = LatencyModel()
    requests = [req(i, 600 + 37 * i, (10_000 + i,)) for i in range(200)]
    floor = ttft_floor(requests, latency, time_scale=1.0, max_num_batched_tokens=4096)
    each = floor["percentiles_s"]
    own = [ttft_floor([r], latency, time_scale=1.0, max_num_batched_tokens=4096)["p50_s"]
           for r in requests]
    for q, key in ((50, "p50_s"), (90, "p90_s"), (99, "p99_s")):
        assert floor[key] == pytest.approx(percentile(own, q))
        assert each[q] == pytest.approx(percentile(own, q))
