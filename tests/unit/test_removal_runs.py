"""Coalesced KV event application against event-by-event application (pure, property-based).

The worker applies each run of consecutive ``BlockRemoved`` as one merged removal and the
event filter decides removals once per (medium, group) shape; both are optimisations only.
These properties check they change nothing observable: the resident set and its reference
counts, the chain depths, the published changes, epoch and seq, and every counter, for
random batches mixing stores, removals (with bad hashes among them), clears, mediums, groups,
key modes and index strides. The reference applies the same events one per call.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.shared.contract import OP_CLEARED
from router.shared.hashing import BlockHasher
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    UnknownEvent,
)
from worker.block_keys import EngineKeys, RecomputedKeys
from worker.event_filter import EventFilter
from worker.replica_view import Change, ReplicaView

B = 4  # tokens per block: small, so recomputed keys hash quickly
HASHES = st.integers(0, 5)  # a small pool: duplicates, re-stores and unknown removals are common
BAD_HASHES = st.sampled_from([1 << 64, -1, True, b"short", "text"])  # event_hash_key refuses each
MEDIUMS = st.sampled_from(["GPU", None, "CPU", "STORAGE"])
GROUPS = st.sampled_from([None, 0, 1])


@st.composite
def stores(draw: st.DrawFn) -> BlockStored:
    hashes = draw(st.lists(HASHES, min_size=1, max_size=4))
    parent = draw(st.none() | HASHES)
    size = draw(st.sampled_from([B, B, B, 2 * B]))  # sometimes a foreign block size
    medium = draw(st.sampled_from(["GPU", "GPU", None, "CPU"]))
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=[h % 5 for h in hashes for _ in range(size)], block_size=size,
                       lora_id=None, medium=medium, lora_name=None, group_idx=draw(GROUPS))


@st.composite
def removals(draw: st.DrawFn) -> BlockRemoved:
    # vLLM publishes one hash per evicted block; a few multi-hash events and bad hashes too
    hashes: list[Any] = draw(st.lists(HASHES | BAD_HASHES if draw(st.booleans()) else HASHES,
                                      min_size=1, max_size=draw(st.sampled_from([1, 1, 3]))))
    return BlockRemoved(block_hashes=hashes, medium=draw(MEDIUMS), group_idx=draw(GROUPS))


def events() -> st.SearchStrategy[list[Any]]:
    # removals weighted up, as on a loaded replica, so runs of them are long and mixed
    one = st.one_of(stores(), removals(), removals(), removals(),
                    st.just(AllBlocksCleared()), st.just(UnknownEvent("BlockPinned")))
    return st.lists(one, max_size=40)


def make_view(stride: int, key_mode: str) -> ReplicaView:
    mapper = (EngineKeys() if key_mode == "engine"
              else RecomputedKeys(BlockHasher(block_size=B), lambda _name: None))
    return ReplicaView(mapper=mapper, index_stride=stride)


def state(view: ReplicaView) -> tuple[Any, ...]:
    stats = view.stats
    return (dict(view.blocks._counts), view.blocks.num_unknown_removals, dict(view._depth),
            dict(view._extra_copies), view.epoch, view.seq, dict(stats.events),
            stats.num_bad_events, stats.num_unknown_depth_blocks, stats.num_epoch_resets,
            stats.last_batch_ts, dict(stats.events_by_tier), dict(stats.skipped), len(view.mapper) if isinstance(view.mapper, RecomputedKeys) else 0)


def merged(changes: list[Change]) -> list[tuple[str, list[int], int, int, str]]:
    """Per-event changes merged the way ``apply_batch`` merges a batch's: consecutive runs of
    the same op on the same tier joined, a clear superseding what came before it."""
    out: list[tuple[str, list[int], int, int, str]] = []
    for change in changes:
        if change.op == OP_CLEARED:
            out = []
        if out and out[-1][0] == change.op and out[-1][4] == change.tier:
            out[-1][1].extend(change.keys)
        else:
            out.append((change.op, list(change.keys), change.epoch, change.seq, change.tier))
    return out


def as_tuples(changes: list[Change]) -> list[tuple[str, list[int], int, int, str]]:
    return [(c.op, list(c.keys), c.epoch, c.seq, c.tier) for c in changes]


def block_events(items: list[Any]) -> list[Any]:
    return [e for e in items if not isinstance(e, UnknownEvent)]


@settings(max_examples=400, deadline=None)
@given(prelude=events(), batch=events(), stride=st.sampled_from([1, 2, 4]),
       key_mode=st.sampled_from(["engine", "recomputed"]))
def test_a_batch_applies_as_its_events_one_by_one(prelude: list[Any], batch: list[Any],
                                                  stride: int, key_mode: str) -> None:
    whole, single = make_view(stride, key_mode), make_view(stride, key_mode)
    for view in (whole, single):  # the same history first, applied one event per batch
        for event in block_events(prelude):
            view.apply_batch(view.seq + 1, KVEventBatch(1.0, [event], 0))
    assert state(whole) == state(single)
    seq = whole.seq + 1
    changes = whole.apply_batch(seq, KVEventBatch(2.0, block_events(batch), 0))
    per_event = single.apply_batch(seq, KVEventBatch(2.0, [], 0))  # (an empty batch moves seq)
    for event in block_events(batch):
        per_event.extend(single.apply_batch(seq, KVEventBatch(2.0, [event], 0)))
    assert state(whole) == state(single)
    assert as_tuples(changes) == merged(per_event)


@settings(max_examples=400, deadline=None)
@given(batch=events(), tiers=st.sampled_from([("GPU",), ("GPU", "CPU"), ("GPU", "CPU", "STORAGE")]),
       block_size=st.sampled_from([B, None]))
def test_the_filter_decides_each_event_as_it_would_alone(batch: list[Any], tiers: tuple[str, ...],
                                                         block_size: int | None) -> None:
    whole, single = (EventFilter(block_size=block_size, tiers=frozenset(tiers)) for _ in range(2))
    kept = whole.apply(KVEventBatch(1.0, batch, 0)).events
    reasons = [single._reason(e) for e in batch]  # the per-event decision
    assert kept == [e for e, reason in zip(batch, reasons, strict=True) if reason is None]
    single.skipped.update(reason for reason in reasons if reason)
    single.skipped_tiers.update(e.medium or "GPU" for e, reason in zip(batch, reasons, strict=True)
                                if reason == "tier")
    assert (whole.skipped, whole.skipped_tiers) == (single.skipped, single.skipped_tiers)


@settings(max_examples=200, deadline=None)
@given(prelude=events(), batch=events(), stride=st.sampled_from([1, 4]),
       key_mode=st.sampled_from(["engine", "recomputed"]))
def test_filter_then_view_on_a_batch_equals_both_per_event(prelude: list[Any], batch: list[Any],
                                                           stride: int, key_mode: str) -> None:
    pipes = [(EventFilter(block_size=B), make_view(stride, key_mode)) for _ in range(2)]
    for flt, view in pipes:
        for event in prelude:
            view.apply_batch(view.seq + 1, flt.apply(KVEventBatch(1.0, [event], 0)))
    (flt_whole, whole), (flt_single, single) = pipes
    seq = whole.seq + 1
    changes = whole.apply_batch(seq, flt_whole.apply(KVEventBatch(2.0, batch, 0)))
    per_event = single.apply_batch(seq, KVEventBatch(2.0, [], 0))
    for event in batch:
        per_event.extend(single.apply_batch(seq, flt_single.apply(KVEventBatch(2.0, [event], 0))))
    assert state(whole) == state(single)
    assert as_tuples(changes) == merged(per_event)
    assert (flt_whole.skipped, flt_whole.skipped_tiers) == (flt_single.skipped,
                                                             flt_single.skipped_tiers)


def test_a_bad_hash_in_a_run_drops_only_its_event() -> None:
    view = ReplicaView()
    view.apply_batch(0, KVEventBatch(1.0, [BlockStored(
        block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=[0] * 64, block_size=16,
        lora_id=None, medium="GPU", lora_name=None)], 0))
    changes = view.apply_batch(1, KVEventBatch(2.0, [
        BlockRemoved([1], "GPU"), BlockRemoved([2, 1 << 64], "GPU"), BlockRemoved([3], "GPU")], 0))
    assert as_tuples(changes) == [("removed", [1, 3], 0, 1, "GPU")]
    assert sorted(view.blocks) == [2, 4]
    assert view.stats.num_bad_events == 1 and view.stats.events["BlockRemoved"] == 2


def test_a_twice_removed_anchor_is_no_unknown_removal_when_merged() -> None:
    # stride 4: block 0 is an anchor with one copy; two removals of it in one run. One by one
    # the second finds it gone (no anchor: never published); merged it must not count either.
    view = ReplicaView(index_stride=4)
    view.apply_batch(0, KVEventBatch(1.0, [BlockStored(
        block_hashes=[7], parent_block_hash=None, token_ids=[0] * 16, block_size=16,
        lora_id=None, medium="GPU", lora_name=None)], 0))
    changes = view.apply_batch(1, KVEventBatch(2.0, [BlockRemoved([7], "GPU"),
                                                     BlockRemoved([7], "GPU")], 0))
    assert as_tuples(changes) == [("removed", [7], 0, 1, "GPU")]
    assert view.blocks.num_unknown_removals == 0 and len(view.blocks) == 0
