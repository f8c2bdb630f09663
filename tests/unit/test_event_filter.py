"""Event formats real fleets run, on constructed frames: map vs array encodings, offload
tiers, hybrid-model groups, foreign block sizes and unknown types (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from prometheus_client import generate_latest

from router.shared.hashing import BlockHasher
from router.shared.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from worker.block_keys import RecomputedKeys
from worker.event_filter import EventFilter, parse_kv_tiers
from worker.metrics import WorkerSnapshot, make_registry
from worker.replica_view import ReplicaView

B = 16


def gpu_stored(hashes: list[int], parent: int | None = None, **extra: Any) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(range(B * len(hashes))), block_size=extra.pop("size", B),
                       lora_id=None, medium="GPU", lora_name=None, **extra)


def cpu_stored(hashes: list[int]) -> BlockStored:
    # vLLM OffloadingConnectorScheduler.take_events: no parent, no tokens, no LoRA.
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=B,
                       lora_id=None, medium="CPU", lora_name=None)


_decode_lazily = [False]  # how ``run`` decodes: every test using it runs both ways


@pytest.fixture(autouse=True, params=[False, True], ids=["full", "lazy"])
def decode_lazily(request: pytest.FixtureRequest) -> None:
    """The filter and the view behave the same on a lazily decoded batch (the worker's)."""
    _decode_lazily[0] = request.param


def run(view: ReplicaView, flt: EventFilter, *batches: list[Any]) -> set[int]:
    for events in batches:
        payload = encode_batch(KVEventBatch(1.0, events, 0))
        view.apply_batch(view.seq + 1, flt.apply(decode_batch(payload, lazy=_decode_lazily[0])))
    return set(view.blocks.keys())


def test_array_encoded_frames_decode_to_the_same_state_as_map_encoded() -> None:
    events = [gpu_stored([1, 2]), gpu_stored([3], parent=2), BlockRemoved([1], "GPU"),
              cpu_stored([1]), BlockRemoved([2], None)]
    maps = encode_batch(KVEventBatch(1.5, events, 0))
    arrays = msgspec.msgpack.encode([1.5, [
        ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"],
        ["BlockStored", [3], 2, list(range(16)), 16, None, "GPU", None],
        ["BlockRemoved", [1], "GPU"],
        ["BlockStored", [1], None, [], 16, None, "CPU"],
        ["BlockRemoved", [2]],  # before the medium field existed
    ], 0])
    states = []
    for payload in (maps, arrays):
        view, flt = ReplicaView(), EventFilter(block_size=B)
        view.apply_batch(0, flt.apply(decode_batch(payload)))
        states.append((set(view.blocks.keys()), set(view.cpu_blocks.keys()),
                       dict(view.stats.events_by_tier), dict(flt.skipped)))
    assert states[0] == states[1] == ({3}, {1}, {"GPU": 4, "CPU": 1}, {})


def test_gpu_demotion_to_the_cpu_tier_is_not_a_removal() -> None:
    view, flt = ReplicaView(), EventFilter(block_size=B)
    run(view, flt, [gpu_stored([1, 2, 3])], [cpu_stored([1, 2, 3])])
    assert set(view.cpu_blocks) == {1, 2, 3}
    # The GPU evicts all three; the CPU tier still holds them: still routable, as CPU-tier hits.
    assert run(view, flt, [BlockRemoved([3, 2, 1], "GPU")]) == set()
    assert set(view.cpu_blocks) == {1, 2, 3}
    run(view, flt, [BlockRemoved([3], "CPU")])
    assert set(view.cpu_blocks) == {1, 2}
    # Tier invisible to the router (--kv-tiers GPU): the demotion is a removal.
    view, flt = ReplicaView(), EventFilter(block_size=B, tiers=parse_kv_tiers("GPU"))
    run(view, flt, [gpu_stored([1, 2, 3])], [cpu_stored([1, 2, 3])])
    assert run(view, flt, [BlockRemoved([3, 2, 1], "GPU")]) == set()
    assert not view.cpu_blocks and flt.skipped == {"tier": 1}


def test_changes_name_their_tier_and_the_coarse_index_places_host_stores_by_gpu_depth() -> None:
    # Coarse index (stride 4: anchors at depths 0, 1, 3, 7, ...). The connector's host stores
    # carry no parent: their depth is the GPU store's of the same hash (write-through: first).
    view, flt = ReplicaView(index_stride=4), EventFilter(block_size=B)
    seq = 0
    def apply(*events: Any) -> list[tuple[str, str, list[int]]]:
        nonlocal seq
        seq += 1
        return [(ch.op, ch.tier, ch.keys) for ch in view.apply_batch(seq, flt.apply(
            KVEventBatch(1.0, list(events), 0)))]
    assert apply(gpu_stored([10, 11, 12, 13, 14])) == [("stored", "GPU", [10, 11, 13])]
    assert apply(cpu_stored([10, 11, 12, 13, 14])) == [("stored", "CPU", [10, 11, 13])]
    # a host store of a hash the GPU view never held has no depth: counted, not published
    assert apply(cpu_stored([99])) == []
    assert view.stats.num_unknown_depth_cpu_blocks == 1
    assert apply(BlockRemoved([13, 14], "GPU"), BlockRemoved([11], "CPU")) == [
        ("removed", "GPU", [13]), ("removed", "CPU", [11])]
    assert set(view.blocks) == {10, 11} and set(view.cpu_blocks) == {10, 13}
    whole = view.publish_whole()
    assert (whole.op, set(whole.keys), set(whole.cpu_keys)) == ("cleared", {10, 11}, {10, 13})


def test_hybrid_groups_and_foreign_block_sizes_are_skipped_and_counted() -> None:
    # A hybrid model: group 0 (full attention, the router's block size) and group 1 (e.g.
    # sliding window with a larger block). The router follows group 0 only.
    view, flt = ReplicaView(), EventFilter(block_size=B)
    keys = run(view, flt, [
        gpu_stored([1, 2], group_idx=0), gpu_stored([10, 20], group_idx=1, size=64),
        gpu_stored([30], group_idx=1), BlockRemoved([10], "GPU", group_idx=1),
        gpu_stored([40], size=32),  # a group 0 event of another block size: no key of ours
        BlockStored(block_hashes=[50], parent_block_hash=None, token_ids=[], block_size=64,
                    lora_id=None, medium="CPU", lora_name=None),  # offloaded at 4x the block
    ])
    assert keys == {1, 2}
    assert flt.skipped == {"group": 3, "block_size": 2}


def recomputed_view(stride: int = 1) -> ReplicaView:
    return ReplicaView(mapper=RecomputedKeys(BlockHasher(block_size=B), lambda _name: None),
                       index_stride=stride)


def test_offload_stores_under_recomputed_keys_take_the_gpu_stores_keys() -> None:
    # key_mode=recomputed re-hashes keys from tokens; the connector's host stores carry none,
    # so they take the digest the GPU store of the same engine hash gave (write-through).
    view, flt = recomputed_view(), EventFilter(block_size=B)
    ours = BlockHasher(block_size=B).keys(list(range(3 * B)))
    run(view, flt, [gpu_stored([1, 2, 3])], [cpu_stored([1, 2, 3])])
    assert set(view.blocks) == set(view.cpu_blocks) == set(ours)
    # the GPU evicts them: the host keys stay (the tier's own map outlives the GPU copy) ...
    run(view, flt, [BlockRemoved([3, 2, 1], "GPU")])
    assert not view.blocks and set(view.cpu_blocks) == set(ours)
    # ... a GPU store chaining on a block only the host still holds re-hashes the same ...
    run(view, flt, [gpu_stored([4], parent=3)])
    fourth = BlockHasher(block_size=B).keys([*range(3 * B), *range(B)])[3]
    assert set(view.blocks) == {fourth}
    # ... and the host's own removals map back through it
    run(view, flt, [BlockRemoved([2], "CPU")])
    assert set(view.cpu_blocks) == {ours[0], ours[2]}
    # a host store of hashes never seen stored: not placed, skipped as no_chain; a partly
    # known one places its known blocks and counts the others
    run(view, flt, [cpu_stored([98, 99])], [cpu_stored([4, 97])])
    assert set(view.cpu_blocks) == {ours[0], ours[2], fourth}
    assert view.stats.skipped == {"no_chain": 1} and view.stats.num_unknown_depth_cpu_blocks == 3
    assert view.stats.events_by_tier == {"GPU": 3, "CPU": 3} and view.stats.num_bad_events == 0
    assert flt.skipped == {}


def test_offload_stores_under_recomputed_keys_on_the_coarse_index() -> None:
    view, flt = recomputed_view(stride=4), EventFilter(block_size=B)
    ours = BlockHasher(block_size=B).keys(list(range(5 * B)))
    run(view, flt, [gpu_stored([10, 11, 12, 13, 14])], [cpu_stored([10, 11, 99, 13, 14])])
    anchors = {ours[0], ours[1], ours[3]}  # depths 0, 1, 3
    assert set(view.blocks) == anchors and set(view.cpu_blocks) == anchors


@pytest.mark.parametrize("key_mode", ["engine", "recomputed"])
def test_an_offload_tier_of_another_block_size_changes_no_set(key_mode: str) -> None:
    # vLLM's offloading with a host block of k GPU blocks keys each host block by the hash of
    # its last GPU block: its stores are skipped (block_size); its removals, which carry no
    # block size, find nothing resident on the CPU tier (counted) and never touch the GPU's.
    view = ReplicaView() if key_mode == "engine" else recomputed_view()
    flt = EventFilter(block_size=B)
    run(view, flt, [gpu_stored([1, 2, 3, 4])])
    gpu = set(view.blocks)
    run(view, flt, [BlockStored(block_hashes=[4], parent_block_hash=None, token_ids=[],
                                block_size=4 * B, lora_id=None, medium="CPU", lora_name=None)],
        [BlockRemoved([4], "CPU")])
    assert set(view.blocks) == gpu and len(gpu) == 4 and not view.cpu_blocks
    assert flt.skipped == {"block_size": 1} and view.num_unknown_removals == 1


def test_an_offload_store_with_tokens_but_no_parent_is_not_hashed_as_block_0() -> None:
    # a host store is keyed by its GPU store's key even if it carried tokens: without a parent
    # they would hash as the prompt's first block
    view, flt = recomputed_view(), EventFilter(block_size=B)
    run(view, flt, [gpu_stored([1, 2])],
        [BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=list(range(B, 2 * B)),
                     block_size=B, lora_id=None, medium="CPU", lora_name=None)])
    assert set(view.cpu_blocks) == {BlockHasher(block_size=B).keys(list(range(2 * B)))[1]}


def test_unknown_event_types_skipped_with_a_counter() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockPinned", "block_hashes": [9]},
                                            ["BlockStored", [5], None, list(range(16)), 16]], 0])
    view, flt = ReplicaView(), EventFilter(block_size=B)
    view.apply_batch(0, flt.apply(decode_batch(payload)))
    assert set(view.blocks.keys()) == {5} and view.stats.num_bad_events == 0
    assert flt.skipped == {"unknown_type": 1}
    text = generate_latest(make_registry(lambda: WorkerSnapshot(
        events_by_medium=dict(view.stats.events_by_tier),
        skipped_events=dict(flt.skipped_by_reason())))).decode()
    assert 'worker_skipped_events_total{reason="unknown_type"} 1.0' in text
    assert 'worker_skipped_events_total{reason="group"} 0.0' in text
    assert 'worker_tier_events_total{medium="GPU"} 1.0' in text


def test_usable_batch_passes_through_unchanged() -> None:
    batch = KVEventBatch(1.0, [gpu_stored([1]), cpu_stored([1])], 0)
    assert EventFilter(block_size=B).apply(batch) is batch
    with pytest.raises(ValueError, match="unknown KV tiers"):
        parse_kv_tiers("GPU,HBM")
    assert parse_kv_tiers("cpu") == {"GPU", "CPU"}
    with pytest.raises(ValueError, match="not indexed"):
        parse_kv_tiers("GPU,CPU,STORAGE")
