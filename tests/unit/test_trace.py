"""Mooncake trace reading, the hash-id -> token mapping and the replay schedule (pure code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.data import packaged_arrivals_path, packaged_trace_path
from loadtest.replay.replayer import ReplayConfig, send_offsets
from loadtest.replay.trace import (
    arrival_offsets,
    read_arrival_times,
    read_trace,
    schedule_offsets,
    select_requests,
)
from router.tools.trace_format import (
    TRACE_BLOCK_TOKENS,
    TokenMapper,
    TraceFormatError,
    TraceRequest,
    parse_trace_line,
)


def _req(index: int, ts: int, hash_ids: list[int], input_length: int | None = None,
         output_length: int = 10) -> TraceRequest:
    length = input_length if input_length is not None else 512 * len(hash_ids)
    return TraceRequest(index=index, timestamp_ms=ts, input_length=length,
                        output_length=output_length, hash_ids=tuple(hash_ids))


def test_same_hash_id_same_tokens_across_mappers() -> None:
    a, b = TokenMapper(seed=7), TokenMapper(seed=7)
    assert a.block(42) == b.block(42)
    assert len(a.block(42)) == TRACE_BLOCK_TOKENS
    assert a.block(42) != a.block(43)
    assert TokenMapper(seed=8).block(42) != a.block(42)


def test_mapping_is_pinned() -> None:
    # The mapping must never drift between versions: replays and saved results depend on it.
    # (values computed once with SHAKE-128 over b"0:0" and b"0:12345")
    assert TokenMapper(seed=0).block(0)[:4] == (55678, 87296, 74316, 12122)
    assert TokenMapper(seed=0).block(12345)[-2:] == (77078, 15544)


def test_tokens_stay_in_vocab_range() -> None:
    mapper = TokenMapper(seed=1, vocab_low=1000, vocab_high=1010)
    tokens = mapper.prompt([1, 2, 3], 3 * 512)
    assert min(tokens) >= 1000 and max(tokens) < 1010
    default = TokenMapper().prompt(list(range(20)), 20 * 512)
    assert min(default) >= 1000 and max(default) < 100_000


def test_prefix_sharing_preserved() -> None:
    mapper = TokenMapper()
    a = mapper.prompt([0, 1, 2, 3], 4 * 512)
    b = mapper.prompt([0, 1, 5], 2 * 512 + 100)
    assert a[:1024] == b[:1024]
    assert a[1024] != b[1024] or a[1024:1124] != b[1024:1124]
    # no sharing beyond the common ids: the third blocks differ
    assert a[1024:1124] != b[1024:1124]
    c = mapper.prompt([9, 1], 1024)
    assert c[:512] != a[:512]
    assert c[512:] == a[512:1024]  # the block of an id does not depend on its position


def test_last_block_cut_keeps_its_first_tokens() -> None:
    mapper = TokenMapper()
    tokens = mapper.prompt([0, 1, 2], 1024 + 37)
    assert len(tokens) == 1024 + 37
    assert tokens[1024:] == list(mapper.block(2)[:37])
    assert len(mapper.prompt([5], 1)) == 1
    assert len(mapper.prompt([5, 6], 1024)) == 1024


@pytest.mark.parametrize("length", [1024, 1024 + 513, 0])
def test_bad_lengths_rejected(length: int) -> None:
    with pytest.raises(ValueError):
        TokenMapper().prompt([0, 1, 2], length)


def test_request_prompt_matches_input_length() -> None:
    req = _req(0, 0, [0, 1, 2, 3], input_length=3 * 512 + 5)
    assert req.last_block_tokens == 5
    assert len(TokenMapper().request_prompt(req)) == req.input_length


def test_parse_line_and_errors() -> None:
    req = parse_trace_line('{"timestamp": 3000, "input_length": 600, "output_length": 5, '
                           '"hash_ids": [0, 7]}', 4)
    assert req == TraceRequest(4, 3000, 600, 5, (0, 7))
    with pytest.raises(TraceFormatError):
        parse_trace_line('{"timestamp": 0, "input_length": 600, "output_length": 5, '
                         '"hash_ids": [0]}', 0)
    with pytest.raises(TraceFormatError):
        parse_trace_line('{"timestamp": 0}', 0)
    with pytest.raises(TraceFormatError):
        parse_trace_line("not json", 0)


def _trace() -> list[TraceRequest]:
    # steps of 3 s: 3 requests at 0, 2 at 3000, 1 at 6000, 2 at 9000
    stamps = [0, 0, 0, 3000, 3000, 6000, 9000, 9000]
    return [_req(i, ts, [0, 100 + i]) for i, ts in enumerate(stamps)]


def test_schedule_spreads_within_step() -> None:
    offsets = schedule_offsets(_trace(), speedup=1.0)
    assert offsets == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.5, 6.0, 9.0, 10.5])


def test_schedule_burst_and_speedup() -> None:
    assert schedule_offsets(_trace(), speedup=2.0, spread=False) == pytest.approx(
        [0, 0, 0, 1.5, 1.5, 3.0, 4.5, 4.5])
    assert schedule_offsets(_trace(), speedup=3.0) == pytest.approx(
        [x / 3.0 for x in [0.0, 1.0, 2.0, 3.0, 4.5, 6.0, 9.0, 10.5]])


def test_schedule_is_shifted_to_slice_start_and_monotonic() -> None:
    sliced = select_requests(_trace(), start=3)
    offsets = schedule_offsets(sliced, speedup=1.0)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert offsets == pytest.approx([0.0, 1.5, 3.0, 6.0, 7.5])


def test_schedule_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        schedule_offsets(_trace(), speedup=0)
    with pytest.raises(ValueError):
        schedule_offsets([_req(0, 3000, [0]), _req(1, 0, [0])])
    assert schedule_offsets([]) == []
    assert schedule_offsets([_req(0, 5000, [0]), _req(1, 5000, [0])]) == [0.0, 0.0]


def test_select_start_limit_window() -> None:
    trace = _trace()
    assert [r.index for r in select_requests(trace, start=2, limit=3)] == [2, 3, 4]
    assert [r.index for r in select_requests(trace, start=3, window_s=3.0)] == [3, 4, 5]
    assert [r.index for r in select_requests(trace, window_s=0)] == [0, 1, 2]
    assert select_requests(trace, limit=0) == []
    with pytest.raises(ValueError):
        select_requests(trace, start=-1)


def test_read_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": r.timestamp_ms, "input_length": r.input_length,
              "output_length": r.output_length, "hash_ids": list(r.hash_ids)} for r in _trace()]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = read_trace(path, start=1, limit=4)
    assert [r.index for r in got] == [1, 2, 3, 4]
    assert got[0] == _trace()[1]


def test_packaged_trace_slice_is_consistent() -> None:
    from loadtest.data import packaged_trace_path

    path = packaged_trace_path()
    requests = read_trace(path, limit=200)
    assert len(requests) == 200
    assert all(r.hash_ids[0] == 0 for r in requests)  # the trace's common first block
    offsets = schedule_offsets(requests, speedup=10.0)
    assert offsets == sorted(offsets)


def test_text_prompts_have_exact_token_counts_and_share_prefixes() -> None:
    from loadtest.replay.text import TextMapper, default_vocabulary

    vocab = default_vocabulary()
    mapper = TextMapper(TokenMapper(), vocab)
    a = mapper.prompt([0, 1, 2], 1024 + 300)
    b = mapper.prompt([0, 1, 7], 1024 + 20)
    assert vocab.count_tokens(a) == 1024 + 300
    assert vocab.count_tokens(b) == 1024 + 20
    shared = mapper.prompt([0, 1], 1024)
    assert a.startswith(shared) and b.startswith(shared)
    assert vocab.count_tokens(vocab.text_of_length(12_000, seed=3)) == 12_000


def test_simulated_bounds_single_cache_and_round_robin() -> None:
    from loadtest.replay.simulate import simulate_bounds

    # two conversations of two turns each; turn 2 extends turn 1's full blocks
    reqs = [_req(0, 0, [0, 1], 1024), _req(1, 0, [0, 2], 1024),
            _req(2, 3000, [0, 1, 3], 1100), _req(3, 3000, [0, 2, 4], 1100)]
    bounds = simulate_bounds(reqs, replicas=2, capacity_tokens_per_replica=None)
    total = 1024 * 2 + 1100 * 2
    # single cache: block 0 hits for request 1, two blocks for requests 2 and 3
    assert bounds["single_cache"]["hit_tokens"] == 512 + 1024 + 1024
    assert bounds["single_cache"]["token_hit_rate"] == pytest.approx(2560 / total)
    # round robin on 2 replicas: each conversation stays on its replica by parity
    assert bounds["round_robin"]["hit_tokens"] == 1024 + 1024
    # one 512-token block of capacity: only the last-touched block survives, and that is each
    # request's head (vLLM frees a request's blocks tail first), so requests 1-3 hit block 0
    tiny = simulate_bounds(reqs, replicas=1, capacity_tokens_per_replica=512)
    assert tiny["single_cache"]["hit_tokens"] == 3 * 512
    # the hit never covers the last prompt token (vLLM recomputes it): 1024 tokens, 2 blocks
    capped = simulate_bounds([_req(0, 0, [0, 1]), _req(1, 0, [0, 1])], 1, None)
    assert capped["single_cache"]["hit_tokens"] == 1008


def test_write_balanced_placement_follows_prefixes_and_balances_new_conversations() -> None:
    from loadtest.replay.simulate import LRUBlockCache, WriteBalancedPlacement, simulate

    caches = [LRUBlockCache(100) for _ in range(2)]
    place = WriteBalancedPlacement(caches)
    # two new conversations (only the shared block 0 in common), then their follow-ups
    reqs = [_req(0, 0, [0, 1, 2]), _req(1, 0, [0, 3]), _req(2, 0, [0, 4, 5, 6]),
            _req(3, 0, [0, 1, 2, 7]), _req(4, 0, [0, 3, 8])]
    chosen = []
    for i, req in enumerate(reqs):
        r = place(i, req)
        chosen.append(r)
        caches[r].touch(req.hash_ids[::-1])
    # conversation 1 lands where conversation 0 did not write; conversation 2 goes to the replica
    # with fewer recent writes (replica 1 has written 2 blocks, replica 0 three); follow-ups stick
    assert chosen[:3] == [0, 1, 1]
    assert chosen[3:] == [chosen[0], chosen[1]]
    fresh = [LRUBlockCache(100) for _ in range(2)]
    assert simulate(reqs, fresh, WriteBalancedPlacement(fresh))["hit_tokens"] > 0


def test_consistent_hash_placement_is_the_router_ring_on_the_first_1024_tokens() -> None:
    from loadtest.replay.simulate import ConsistentHashPlacement, compare_placements
    from router.decision.ring import HashRing
    from router.shared.hashing import BlockHasher
    from router.tools.trace_format import TokenMapper

    ids = [f"replica-{j}" for j in range(4)]
    place = ConsistentHashPlacement(ids)
    ring = HashRing(ids)
    for hid in range(20):
        first = _req(0, 0, [0, 100 + hid, 200 + hid], 1400)
        later = _req(1, 0, [0, 100 + hid, 300 + hid, 400 + hid], 2000)  # same first 1024 tokens
        key = BlockHasher(16).keys(TokenMapper().prompt([0, 100 + hid], 1024))[63]
        assert ids[place(0, first)] == ring.order(key)[0] == ids[place(1, later)]
    reqs = [_req(i, 0, [0, 100 + i % 5, 200 + i], 1400) for i in range(30)]
    result = compare_placements(reqs, replicas=3, capacity_blocks=4, ring_seeds=2,
                                perturb_blocks=2.0, perturb_seeds=3)
    assert len(result["consistent_hash_per_ring"]) == 2
    assert all(0 < rate < 1 for rate in result["consistent_hash_per_ring"])
    noisy = result["write_balanced_perturbed"]
    assert 0 < noisy["min"] <= noisy["mean"] <= noisy["max"] < 1


def test_packaged_azure_arrivals_are_the_trace_head_and_burstier_than_mooncake() -> None:
    times = read_arrival_times(packaged_arrivals_path("azure-conv"))
    assert len(times) == 3000
    assert times[0] == 0.0 and times == sorted(times)
    # first rows of AzureLLMInferenceTrace_conv.csv: 18:15:46.6805900, then 18:15:50.9951690
    assert times[1] == pytest.approx(4.314579, abs=1e-6)
    assert 600 < times[-1] < 660  # 3,000 requests in about 10.5 minutes (4.8 requests/s)
    requests = read_trace(packaged_trace_path(), limit=2000)
    own = send_offsets(requests, ReplayConfig(target="http://unused", speedup=10.0))
    borrowed = send_offsets(requests, ReplayConfig(target="http://unused", speedup=10.0,
                                                   arrivals="azure-conv"))
    assert borrowed == pytest.approx([t / 10.0 for t in times[:2000]])

    def busiest_second(offsets: list[float]) -> int:
        per_s: dict[int, int] = {}
        for t in offsets:
            per_s[int(t * 10.0)] = per_s.get(int(t * 10.0), 0) + 1  # trace seconds
        return max(per_s.values())

    # the same 2,000 prompts arrive 1.6x faster and in sharper bursts
    assert own[-1] / borrowed[-1] > 1.5
    assert busiest_second(borrowed) >= 1.5 * busiest_second(own)


def test_arrival_offsets_and_bad_arrival_files(tmp_path: Path) -> None:
    assert arrival_offsets(3, [5.0, 5.5, 7.0, 9.0], speedup=2.0) == [0.0, 0.25, 1.0]
    assert arrival_offsets(0, []) == []
    with pytest.raises(ValueError):
        arrival_offsets(5, [0.0, 1.0])
    with pytest.raises(ValueError):
        arrival_offsets(1, [0.0], speedup=0)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(TraceFormatError):
        read_arrival_times(bad)
    back = tmp_path / "back.csv"
    back.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,1,2\n2023-11-16 18:15:40.0000000,1,2\n")
    with pytest.raises(TraceFormatError):
        read_arrival_times(back)
    with pytest.raises(ValueError):
        packaged_arrivals_path("azure-nope")


def test_mappers_are_freed_without_the_cyclic_garbage_collector() -> None:
    """A filled mapper goes away when the replay drops it: no reference cycle through its block
    cache. A cycle left the freeing of every run's cache (millions of ints) to a full garbage
    collection, which in the demo fell mid-replay and held the replayer for 0.4 s."""
    import gc
    import weakref

    from loadtest.replay.text import TextMapper, default_vocabulary

    vocab = default_vocabulary()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tokens = TokenMapper()
        text = TextMapper(TokenMapper(), vocab)
        assert tokens.prompt([0, 1, 2], 1300) and text.prompt([0, 1, 2], 1300)
        refs = [weakref.ref(tokens), weakref.ref(text), weakref.ref(text.mapper)]
        del tokens, text
        assert [r() for r in refs] == [None, None, None]
    finally:
        if was_enabled:
            gc.enable()
