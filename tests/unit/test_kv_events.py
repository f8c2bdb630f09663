"""vLLM 0.33 KV event codec against frames captured from vLLM's own ZmqEventPublisher."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.shared.hashing import BlockHasher, MultiModalItem, block_extra_keys
from router.shared.kv_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    LazyBlockStored,
    UnknownEvent,
    count_blocks,
    decode_batch,
    encode_batch,
    event_hash_key,
    from_event_extra_keys,
    parse_seq,
    seq_bytes,
    stored_extra_keys,
    stored_token_ids,
    to_event_extra_keys,
)
from tests.conftest import load_vectors

FRAMES = load_vectors("vllm-kv-event-frames.json")
RANGE40_KEYS = [3262291359910021016, 7142137847444424233]


@pytest.mark.parametrize("variant", FRAMES["variants"], ids=lambda v: f"int={v['int_block_hashes']}")
def test_captured_frames_decode(variant: dict[str, Any]) -> None:
    topic, seq, payload = (bytes.fromhex(f) for f in variant["frames_hex"])
    assert topic == variant["topic"].encode()
    assert parse_seq(seq) == 0
    batch = decode_batch(payload)
    assert batch.ts == FRAMES["ts"]
    assert batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert [event_hash_key(h) for h in stored.block_hashes] == RANGE40_KEYS
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(32))
    assert (stored.block_size, stored.medium, stored.group_idx) == (16, "GPU", 0)
    assert stored.extra_keys == [None, None]
    assert [event_hash_key(h) for h in removed.block_hashes] == RANGE40_KEYS[1:]
    if not variant["int_block_hashes"]:
        digests = BlockHasher().digests(list(range(40)))
        assert stored.block_hashes == digests
    # Re-encoding reproduces vLLM's bytes exactly.
    assert encode_batch(batch) == payload
    # The replay exchange: same payload, then the end marker.
    replies = variant["replay_reply_frames_hex"]
    assert bytes.fromhex(replies[0][3]) == payload
    assert parse_seq(bytes.fromhex(replies[-1][2])) == REPLAY_END_SEQ


def test_encoder_builds_vllm_bytes_from_scratch() -> None:
    variant = FRAMES["variants"][0]
    batch = KVEventBatch(
        ts=FRAMES["ts"],
        events=[
            BlockStored(block_hashes=RANGE40_KEYS, parent_block_hash=None, token_ids=list(range(32)),
                        block_size=16, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[None, None], group_idx=0),
            BlockRemoved(block_hashes=RANGE40_KEYS[1:], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert encode_batch(batch).hex() == variant["frames_hex"][2]
    assert seq_bytes(0).hex() == variant["frames_hex"][1]


def test_extra_keys_example_round_trip() -> None:
    example = FRAMES["extra_keys_example"]
    payload = bytes.fromhex(example["payload_hex"])
    batch = decode_batch(payload)
    assert encode_batch(batch) == payload
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    tagged = [tuple(tuple(k) for k in block) for block in example["tagged_extra_keys_used_in_hash"]]
    assert [to_event_extra_keys(t) for t in tagged] == stored.extra_keys
    assert stored.extra_keys is not None
    retagged = [
        from_event_extra_keys(entry, block_index=i, lora_name=stored.lora_name, lora_path="/models/sql-lora")
        for i, entry in enumerate(stored.extra_keys)
    ]
    assert retagged == tagged
    # The retagged keys are exactly what the hasher puts into the chain, so re-hashing works.
    expected = [block_extra_keys(i * 16, i * 16 + 16, lora=("sql-lora", "/models/sql-lora"),
                                 mm_items=[MultiModalItem("img-abc", 5, 20)], cache_salt="tenant-A-salt")
                for i in range(2)]
    assert retagged == expected
    hasher = BlockHasher()
    keys = hasher.keys(list(range(32)), lora=("sql-lora", "/models/sql-lora"), cache_salt="tenant-A-salt",
                       mm_items=[MultiModalItem("img-abc", 5, 20)])
    assert keys == stored.block_hashes


def test_legacy_array_encoded_events() -> None:
    legacy = msgspec.msgpack.encode([
        1.5,
        [["BlockStored", [1, 2], None, list(range(32)), 16, None],
         ["BlockStored", [3], 2, list(range(16)), 16, None, "GPU"],
         ["BlockRemoved", [1]],
         ["AllBlocksCleared"]],
    ])
    batch = decode_batch(legacy)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                         "AllBlocksCleared"]
    first = batch.events[0]
    assert isinstance(first, BlockStored) and first.block_hashes == [1, 2] and first.medium is None
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0, [["BlockStored"]]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    msgspec.msgpack.encode([1.0, [{"no": "type"}]]), msgspec.msgpack.encode(["x", []]),
    msgspec.msgpack.encode([1.0, [], "rank"]),
])
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_unknown_event_types_and_fields_do_not_cost_the_batch() -> None:
    stored = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
              "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
              "lora_name": None, "a_field_from_the_future": [1, 2]}
    payload = msgspec.msgpack.encode([2.0, [stored, {"type": "BlockPinned", "x": 1}], 0])
    batch = decode_batch(payload)
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].block_hashes == [7]
    assert batch.events[1] == UnknownEvent("BlockPinned")
    # Unknown fields alone keep the fast typed path; arrays of a new type are kept too.
    assert decode_batch(msgspec.msgpack.encode([2.0, [stored]])).events[0] == batch.events[0]
    legacy = decode_batch(msgspec.msgpack.encode(
        [2.0, [["Rebalanced", 1], ["BlockRemoved", [7], "CPU", "extra", 5]]]))
    assert legacy.events[0] == UnknownEvent("Rebalanced")
    assert legacy.events[1] == BlockRemoved(block_hashes=[7], medium="CPU")


def test_event_hash_key_forms() -> None:
    digest = bytes(range(32))
    assert event_hash_key(digest) == int.from_bytes(digest[-8:], "big")
    assert event_hash_key(5) == 5
    for bad in (-1, 1 << 64, "x", True, b"short"):
        with pytest.raises(KVEventDecodeError):
            event_hash_key(bad)  # type: ignore[arg-type]


def test_parse_seq_rejects_bad_frames() -> None:
    assert parse_seq(seq_bytes(2**63)) == 2**63
    with pytest.raises(KVEventDecodeError):
        parse_seq(b"\x00" * 4)


@pytest.mark.parametrize("variant", FRAMES["variants"], ids=lambda v: f"int={v['int_block_hashes']}")
def test_lazy_decode_leaves_token_ids_undecoded(variant: dict[str, Any]) -> None:
    payload = bytes.fromhex(variant["frames_hex"][2])
    full, lazy = decode_batch(payload), decode_batch(payload, lazy=True)
    stored = lazy.events[0]
    assert isinstance(stored, LazyBlockStored) and isinstance(stored, BlockStored)
    assert isinstance(stored.token_ids, msgspec.Raw)  # no int built until asked for
    assert stored_token_ids(stored) == list(range(32)) == stored_token_ids(full.events[0])
    assert stored_extra_keys(stored) == [None, None]
    assert stored.block_hashes == full.events[0].block_hashes
    assert (stored.parent_block_hash, stored.block_size, stored.medium, stored.group_idx) == (
        None, 16, "GPU", 0)
    assert lazy.events[1:] == full.events[1:]
    assert encode_batch(lazy) == payload  # the raw fields re-encode as they came


def test_lazy_decode_checks_token_ids_when_read() -> None:
    stored = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
              "token_ids": "not ids", "block_size": 16, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": 5}
    payload = msgspec.msgpack.encode([2.0, [stored], 0])
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)  # the full decode refuses the batch
    event = decode_batch(payload, lazy=True).events[0]
    assert isinstance(event, BlockStored) and event.block_hashes == [7]
    with pytest.raises(KVEventDecodeError):
        stored_token_ids(event)
    with pytest.raises(KVEventDecodeError):
        stored_extra_keys(event)
    # A batch the typed decoder refuses takes the loose path: fully decoded, read the same way.
    legacy = decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5] * 16, 16]]]),
                          lazy=True).events[0]
    assert isinstance(legacy, BlockStored) and stored_token_ids(legacy) == [5] * 16


def test_count_blocks_reads_lengths_without_decoding() -> None:
    payload = bytes.fromhex(FRAMES["variants"][0]["frames_hex"][2])
    assert count_blocks(payload) == (0, {(True, 16, "GPU", 0): 2, (False, None, "GPU", 0): 1})
    for n in (1, 15, 16, 65_535, 65_536):  # fixarray, array 16 and array 32 headers
        batch = KVEventBatch(1.0, [BlockStored(list(range(n)), None, [], 16, None, None, None),
                                   BlockRemoved([1] * n, "CPU", group_idx=1),
                                   BlockRemoved([2], "CPU", group_idx=1)], None)
        assert count_blocks(encode_batch(batch)) == (None, {(True, 16, None, None): n,
                                                            (False, None, "CPU", 1): n + 1})
    # events of unknown types or legacy arrays are left out; the known ones still counted
    mixed = msgspec.msgpack.encode([1.0, [{"type": "BlockPinned"}, ["BlockRemoved", [1, 2]],
                                          {"type": "BlockRemoved", "block_hashes": [3, 4, 5],
                                           "medium": None}], 2])
    assert count_blocks(mixed) == (2, {(False, None, None, None): 3})
    assert count_blocks(payload, removals=False) == (0, {(True, 16, "GPU", 0): 2})
    for not_a_batch in (b"", b"\xc1", msgspec.msgpack.encode({"a": 1})):
        assert count_blocks(not_a_batch) is None
