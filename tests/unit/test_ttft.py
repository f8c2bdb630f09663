"""The ttft policy and its prefill-rate learner: work arithmetic, convergence, decision table."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.decision.policy import Candidate, PolicyParams, RouteInput, decide
from router.decision.ttft import (
    MIN_SAMPLES,
    SAME_RATE_BAND,
    WINDOW,
    PrefillRateLearner,
    RateEstimate,
    prefill_work_tokens,
)
from tests.unit.policy_fleet import CHAIN, IDS, RING, home_of
from worker.emulator.profiles import LatencyModel

PARAMS = PolicyParams(block_size=16, ttft_prior_tokens_per_s=100_000.0)
SPT = 1.0 / 100_000.0  # the prior, seconds per work token


HOME = home_of(CHAIN[0])  # ring home of a cold prompt
HOT = next(rid for rid in IDS if rid != HOME)  # the replica that holds the hot prefix


def test_work_tokens_match_the_emulator_latency_model() -> None:
    """Same FLOP formula as the emulator (seed arithmetic), in units of one token's linear work."""
    model = LatencyModel()
    per_token = 2.0 * model.model.params
    for new, cached in ((8192, 0), (100, 12_000), (1, 0), (3000, 5000)):
        assert prefill_work_tokens(new, cached) == pytest.approx(
            model.prefill_flops(new, cached) / per_token, rel=1e-12)
    assert prefill_work_tokens(0, 500) == 0.0
    # the suffix still attends to the cached context: 100 new tokens after 12k cost more than 100
    assert prefill_work_tokens(100, 12_000) > 1.3 * prefill_work_tokens(100, 0)


def _samples(rng: random.Random, s_per_token: float, overhead_s: float, n: int,
             outlier_share: float = 0.0) -> list[tuple[float, float]]:
    out = []
    for _ in range(n):
        work = rng.uniform(500, 20_000)
        ttft = (overhead_s + work * s_per_token) * rng.uniform(0.9, 1.1)
        if rng.random() < outlier_share:
            ttft *= rng.choice((0.2, 8.0))  # a stall or a cached-elsewhere surprise
        out.append((work, ttft))
    return out


def test_learner_starts_at_the_prior_and_separates_two_replicas() -> None:
    learner = PrefillRateLearner(prior_tokens_per_s=25_000.0)
    assert learner.estimate("fast") == RateEstimate(1 / 25_000.0)
    rng = random.Random(7)
    # the fast replica is 10x the prior, the slow one 3x slower than the fast one; 15% outliers
    fast = _samples(rng, 1 / 250_000, 0.004, 30, outlier_share=0.15)
    slow = _samples(rng, 3 / 250_000, 0.004, 30, outlier_share=0.15)
    for i, ((wf, tf), (ws, ts)) in enumerate(zip(fast, slow, strict=True)):
        learner.observe("fast", wf, tf)
        learner.observe("slow", ws, ts)
        if i + 1 < MIN_SAMPLES:
            assert learner.estimate("fast") == learner.prior
    f, s = learner.estimate("fast"), learner.estimate("slow")
    assert f.tokens_per_s == pytest.approx(250_000, rel=0.15)
    assert s.tokens_per_s == pytest.approx(250_000 / 3, rel=0.15)
    assert f.overhead_s == pytest.approx(0.004, abs=0.003)
    assert f.num_samples == s.num_samples == 30
    # a replica not measured yet is taken to be typical of the fleet, not the (slow) prior
    new = learner.estimate("new")
    assert new.num_samples == 0
    assert min(f.s_per_token, s.s_per_token) <= new.s_per_token <= max(f.s_per_token, s.s_per_token)


def test_learner_follows_a_change_within_its_window_and_ignores_bad_samples() -> None:
    learner = PrefillRateLearner(prior_tokens_per_s=25_000.0)
    rng = random.Random(3)
    for work, ttft in _samples(rng, 1 / 50_000, 0.0, 40):
        learner.observe("r", work, ttft)
    assert learner.estimate("r").tokens_per_s == pytest.approx(50_000, rel=0.1)
    for work, ttft in _samples(rng, 1 / 20_000, 0.0, WINDOW):  # the replica got slower
        learner.observe("r", work, ttft)
    assert learner.estimate("r").tokens_per_s == pytest.approx(20_000, rel=0.1)
    before = learner.estimate("r")
    for bad in ((0.0, 1.0), (100.0, 0.0), (float("nan"), 1.0), (100.0, float("inf"))):
        learner.observe("r", *bad)
    assert learner.estimate("r") == before
    learner.forget("r")
    assert learner.estimate("r") == learner.prior  # no replica with a fit is left


def test_learner_with_equal_work_uses_the_median_ratio() -> None:
    learner = PrefillRateLearner(prior_tokens_per_s=25_000.0)
    for ttft in (0.1, 0.1, 0.1, 5.0, 0.1):
        learner.observe("r", 1000.0, ttft)
    assert learner.estimate("r").tokens_per_s == pytest.approx(10_000)
    with pytest.raises(ValueError):
        PrefillRateLearner(prior_tokens_per_s=0.0)


@dataclass
class Row:
    name: str
    expect: str
    expect_reason: str
    combined: dict[str, int] = field(default_factory=dict)
    confirmed: dict[str, int] | None = None  # None: same as combined
    views: dict[str, dict[str, Any]] = field(default_factory=dict)  # {rid: Candidate kwargs}
    num_tokens: int = 1030
    tokenized: bool = True
    avg_prompt_tokens: float = 1000.0


SLOW = {"s_per_token": 4 * SPT}
ROWS = [
    Row("idle fleet, cold prompt: nothing differs, ring home", HOME, "cold_ring"),
    Row("hot prefix: the replica holding it wins on prefill", HOT, "ttft_prefill",
        combined={HOT: 60}),
    Row("hot prefix behind a short queue stays", HOT, "ttft_prefill", combined={HOT: 60},
        views={HOT: {"inflight_prefill_tokens": 1000}}),
    Row("hot prefix behind a long queue moves to an idle replica (ring order among them)",
        next(r for r in RING.order(CHAIN[60]) if r != HOT), "ttft_wait", combined={HOT: 60},
        views={HOT: {"inflight_prefill_tokens": 8000}}),
    Row("idle fleet: a hit behind 8k queued tokens moves to a 3k queue",
        next(r for r in RING.order(CHAIN[60]) if r != HOT), "ttft_wait", combined={HOT: 60},
        views={rid: {"inflight_prefill_tokens": 8000 if rid == HOT else 3000} for rid in IDS}),
    Row("busy fleet (8 waiting per replica): the same hit stays, recomputing delays the rest",
        HOT, "ttft_prefill", combined={HOT: 60},
        views={rid: {"inflight_prefill_tokens": 8000 if rid == HOT else 3000,
                     "prefilling_requests": 8} for rid in IDS}),
    Row("cold burst: this router's speculative placement draws the rest", HOT, "ttft_prefill",
        combined={HOT: 64}, confirmed={}),
    Row("cold prompt avoids the replica that wrote the most KV lately", next(
        r for r in RING.order(CHAIN[0]) if r != HOME), "ttft_evict",
        views={HOME: {"recent_write_blocks": 5000.0}, **{
            r: {"recent_write_blocks": 100.0} for r in IDS if r != HOME}}),
    Row("slow replica (4x seconds per token) gets no cold work", next(
        r for r in RING.order(CHAIN[0]) if r != HOME), "ttft_prefill", views={HOME: SLOW}),
    Row("slow replica keeps a deep hit", HOT, "ttft_prefill", combined={HOT: 60},
        views={HOT: SLOW}),
    Row("replica far behind (other routers' queue in its heartbeat) loses its hit",
        next(r for r in RING.order(CHAIN[60]) if r != HOT), "ttft_wait", combined={HOT: 60},
        views={HOT: {"engine_waiting": 8}}),
    Row("over the bounded-load cap spills despite the hit",
        next(r for r in RING.order(CHAIN[60]) if r != HOT), "load_spill", combined={HOT: 60},
        views={HOT: {"inflight_requests": 20}}),
    Row("cold prompt avoids the replica whose decode batch holds the most KV",
        next(r for r in RING.order(CHAIN[0]) if r != HOME), "ttft_decode",
        views={HOME: {"inflight_requests": 12, "inflight_context_tokens": 12 * 8000}}),
    Row("a hot prefix stays despite a fuller decode batch there", HOT, "ttft_prefill",
        combined={HOT: 60}, views={HOT: {"inflight_requests": 3, "inflight_context_tokens": 24_000}}),
    Row("unverified hashes get no hit credit", HOME, "cold_ring", combined={HOT: 60},
        views={HOT: {"affinity": False}}),
    Row("untokenized prompt rides the ring on its text", home_of(42), "no_tokenizer_ring",
        tokenized=False),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_ttft_policy_table(row: Row) -> None:
    replicas = [Candidate(rid, **row.views.get(rid, {})) for rid in IDS]
    request = RouteInput(CHAIN if row.tokenized else [], row.num_tokens, ring_key=42,
                         tokenized=row.tokenized)
    decision = decide("ttft", request, replicas, RING,
                      confirmed=row.combined if row.confirmed is None else row.confirmed,
                      combined=row.combined, params=PARAMS,
                      avg_prompt_tokens=row.avg_prompt_tokens)
    assert (decision.replica_id, decision.reason) == (row.expect, row.expect_reason)
    assert sorted((decision.replica_id, *decision.fallbacks)) == sorted(IDS)
    for rid, d in decision.details.items():
        assert d["total_s"] == pytest.approx(
            d["wait_s"] + d["prefill_s"] + d["delay_s"] + d["evict_s"] + d["decode_s"], abs=1e-5)
        assert d["ttft_s"] == pytest.approx(d["wait_s"] + d["prefill_s"], abs=1e-5)
        view = next(r for r in replicas if r.replica_id == rid)
        assert d["wait_s"] == pytest.approx(
            view.queued_prefill_tokens(row.avg_prompt_tokens) * (view.s_per_token or SPT), abs=1e-6)


def test_ttft_details_give_the_seconds_of_each_term() -> None:
    """A hit of 960 tokens on a 1,030-token prompt: own work is the 70-token suffix with its
    attention against the cached 960, at the replica's learned rate plus overhead."""
    fast = Candidate(HOT, s_per_token=SPT / 2, overhead_s=0.003, inflight_prefill_tokens=400)
    others = [Candidate(rid) for rid in IDS if rid != HOT]
    decision = decide("ttft", RouteInput(CHAIN, 1030, 0), [fast, *others], RING,
                      confirmed={HOT: 60}, combined={HOT: 60}, params=PARAMS)
    d = decision.details[HOT]
    assert d["wait_s"] == pytest.approx(400 * SPT / 2, abs=1e-6)
    assert d["prefill_s"] == pytest.approx(0.003 + prefill_work_tokens(70, 960) * SPT / 2,
                                           abs=1e-6)
    assert d["tokens_per_s"] == pytest.approx(200_000)
    assert d["work_tokens"] == pytest.approx(400 + prefill_work_tokens(70, 960), abs=1e-3)
    assert d["delay_s"] == 0.0  # nobody is waiting in this fleet: no one is delayed
    assert d["decode_s"] == 0.0  # nothing runs there: nobody's decode steps get longer
    cold = decision.details[others[0].replica_id]
    # a fair write share (no writes yet: every replica counts as fair): evicted_reuse x new tokens
    assert cold["evict_s"] == pytest.approx(PARAMS.evicted_reuse * 64 * 16 * SPT, abs=1e-6)


def test_ttft_spreads_a_cold_stream_by_writes() -> None:
    """New prompts of equal size on an idle fleet: the write share term alone spreads them."""
    from router.decision.load import LoadTracker

    tracker = LoadTracker(clock=lambda: 0.0)
    window = 4 * 32_000 * 0.5
    chosen = []
    for conv in range(200):
        chain = [50_000 + conv * 100 + j for j in range(64)]
        views = [Candidate(rid, recent_write_blocks=tracker.recent_writes(rid, window))
                 for rid in IDS]
        d = decide("ttft", RouteInput(chain, 1030, 0), views, RING, params=PARAMS)
        tracker.record_writes(d.replica_id, 64, window)
        chosen.append(d.replica_id)
    counts = [chosen.count(rid) for rid in IDS]
    assert max(counts) - min(counts) <= 2


def test_ttft_delay_term_counts_the_fleet_queue() -> None:
    """Own work x seconds per token x the fleet's mean waiting requests (ours + other routers')."""
    views = [Candidate(IDS[0], prefilling_requests=3),
             Candidate(IDS[1], engine_waiting=5, engine_running=1),  # other routers' 6, 5 waiting
             Candidate(IDS[2]), Candidate(IDS[3])]
    d = decide("ttft", RouteInput(CHAIN, 1030, 0), views, RING, params=PARAMS).details
    waiting = (3 + 5) / 4
    for rid in IDS:
        assert d[rid]["delay_s"] == pytest.approx(prefill_work_tokens(1030, 0) * SPT * waiting,
                                                  abs=1e-6)


def test_learner_treats_rates_within_its_band_as_the_fleet_median() -> None:
    """Eight like replicas whose fits differ by noise get one rate (no herding onto whichever
    looks fastest); a replica twice as slow keeps its own."""
    learner = PrefillRateLearner(prior_tokens_per_s=25_000.0)
    rng = random.Random(11)
    truth = {f"r{i}": (1 + 0.05 * (i - 3)) / 100_000 for i in range(7)}  # within +-15%
    truth["slow"] = 2.0 / 100_000
    for rid, spt in truth.items():
        for work, ttft in _samples(rng, spt, 0.002, 32):
            learner.observe(rid, work, ttft)
    like = {learner.estimate(f"r{i}").s_per_token for i in range(7)}
    assert len(like) == 1
    assert len({learner.estimate(f"r{i}").overhead_s for i in range(7)}) == 1
    fits = [learner.fitted(f"r{i}") for i in range(7)]
    assert len({f.s_per_token for f in fits if f is not None}) == 7  # their own fits do differ
    (median_spt,) = like
    slow = learner.estimate("slow")
    assert slow.s_per_token > SAME_RATE_BAND * median_spt
    assert slow.tokens_per_s == pytest.approx(50_000, rel=0.15)


def test_decode_term_is_the_kv_the_decode_steps_read() -> None:
    """decode_s = decode_weight x s_per_token x DECODE_READ x mean output x (K + prompt x R): the
    KV of the requests running there (its own steps read it) plus its prompt's KV read once per
    step of each of them; 0 with decode_weight 0."""
    from router.decision.ttft import DECODE_READ_WORK_PER_KV_TOKEN, decode_work_tokens

    busy = Candidate(HOME, inflight_requests=5, inflight_context_tokens=40_000,
                     engine_running=7, ours_at_heartbeat=5)  # 2 requests of other routers
    others = [Candidate(rid) for rid in IDS if rid != HOME]
    request = RouteInput(CHAIN, 1030, 0)
    d = decide("ttft", request, [busy, *others], RING, params=PARAMS, avg_prompt_tokens=2000.0,
               avg_output_tokens=300.0).details[HOME]
    work = decode_work_tokens(40_000 + 2 * 2000.0, 7, 1030, 300.0)
    assert work == pytest.approx(DECODE_READ_WORK_PER_KV_TOKEN * 300 * (44_000 + 1030 * 7))
    assert d["decode_s"] == pytest.approx(PARAMS.decode_weight * SPT * work, rel=1e-9)
    off = PolicyParams(block_size=16, ttft_prior_tokens_per_s=100_000.0, decode_weight=0.0)
    assert decide("ttft", request, [busy, *others], RING, params=off,
                  avg_prompt_tokens=2000.0).details[HOME]["decode_s"] == 0.0


def test_load_tracker_counts_context_until_the_request_ends() -> None:
    """The KV a request holds (its prompt) counts from dispatch to finish, not only to its first
    token; the mean output starts at the default and follows what engines report."""
    from router.decision.load import LoadTracker
    from router.decision.ttft import DEFAULT_OUTPUT_TOKENS

    tracker = LoadTracker(clock=lambda: 0.0)
    a = tracker.dispatch("r", 300, context_tokens=1000)
    b = tracker.dispatch("r", 50, context_tokens=800)
    a.first_token()
    assert (tracker.prefill_tokens("r"), tracker.context_tokens("r")) == (50, 1800)
    a.finish()
    a.finish()  # idempotent
    assert tracker.context_tokens("r") == 800
    b.finish()
    assert tracker.context_tokens("r") == 0
    assert tracker.avg_output_tokens == DEFAULT_OUTPUT_TOKENS
    tracker.observe_output(100)
    tracker.observe_output(0)  # nothing reported: ignored
    assert tracker.avg_output_tokens == 100.0
