"""vLLM 0.33 KV-cache event wire format: msgspec structs, encode and decode. Pure: no I/O.

Source: vLLM 0.33 ``vllm/distributed/kv_events.py``. A published batch is three
ZMQ frames ``[topic, seq (8-byte big-endian unsigned), msgpack(KVEventBatch)]``.
``KVEventBatch`` is a msgpack *array* ``[ts, events, data_parallel_rank]``; each
event is a msgpack *map* tagged by ``"type"`` (the class name) whose fields follow
in declaration order, defaults (None) omitted. Older vLLM releases (about 0.9 to
0.11) encoded events as arrays ``["BlockStored", block_hashes, parent, token_ids,
block_size, lora_id, medium]``; ``decode_batch`` accepts both, ignores fields it does
not know and turns events of types it does not know into ``UnknownEvent``.

Hashes in events are 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
the digest's last 8 bytes, big-endian) or raw digests (``=0``); ``event_hash_key``
reduces both to the project's 64-bit block key.

The worker decodes with ``decode_batch(payload, lazy=True)``: a ``BlockStored`` then comes as a
``LazyBlockStored`` whose token ids, extra keys and lookahead token ids stay undecoded msgpack
(``msgspec.Raw``, scanned but no Python int built), read on demand with ``stored_token_ids`` and
``stored_extra_keys`` (only ``key_mode=recomputed`` and the hash probe need them). Before that,
``count_blocks`` counts a batch's blocks without building any hash, so an impossible batch is
refused before it takes memory.
"""

from __future__ import annotations

import contextlib
import operator
import struct
from collections.abc import Sequence
from functools import partial
from itertools import compress
from typing import Any, Final, cast

import msgspec

from router.shared.contract import BlockKey
from router.shared.hashing import block_key

ExternalBlockHash = int | bytes

REPLAY_END_SEQ: Final = -1  # end marker seq of the replay socket, as a signed 8-byte int
_SEQ = struct.Struct(">Q")
_SIGNED_SEQ = struct.Struct(">q")
REPLAY_END_FRAME: Final = _SIGNED_SEQ.pack(REPLAY_END_SEQ)


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch (malformed msgpack or wrong shape)."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of all KV-cache events (vLLM 0.33: tagged map, defaults omitted)."""


class BlockStored(KVCacheEvent):
    """Blocks committed to the prefix cache; one event per run of consecutive new full blocks.

    ``block_hashes``: one hash per block; ``parent_block_hash``: hash of the block
    before the first, or None at block 0; ``token_ids``: the tokens of those blocks
    (``len == block_size * len(block_hashes)`` for a standard model);
    ``extra_keys``: one entry per block, None or the untagged extra-key values.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks evicted (one hash per evicted physical block)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


_NIL: Final = msgspec.Raw(b"\xc0")  # msgpack nil: an optional field the event left out


class LazyBlockStored(BlockStored, tag="BlockStored"):
    """A decoded ``BlockStored`` whose bulky fields the worker seldom reads stay msgpack.

    ``token_ids`` (``block_size`` ids per block: 16x the hashes), ``extra_keys`` (one entry
    per block) and ``lookahead_token_ids`` are ``msgspec.Raw`` slices of the payload: msgspec
    skips over them without building their ints (about 1.2 us per 16-token block saved).
    Read them with ``stored_token_ids`` / ``stored_extra_keys``. Re-encodes byte-identically.
    """

    token_ids: msgspec.Raw  # type: ignore[assignment]  # msgpack array of ints, decoded on demand
    extra_keys: msgspec.Raw = _NIL  # type: ignore[assignment]
    lookahead_token_ids: msgspec.Raw = _NIL  # type: ignore[assignment]


_token_ids_decoder = msgspec.msgpack.Decoder(list[int])
_extra_keys_decoder = msgspec.msgpack.Decoder(list[list[Any] | None] | None)


def stored_token_ids(event: BlockStored) -> list[int]:
    """The token ids of a ``BlockStored`` (decoded now for a ``LazyBlockStored``).

    Raises ``KVEventDecodeError`` when they are not a list of ints.
    """
    return cast(list[int], _decoded(event.token_ids, _token_ids_decoder, "token_ids"))


def stored_extra_keys(event: BlockStored) -> list[list[Any] | None] | None:
    """The per-block extra keys of a ``BlockStored`` (decoded now for a ``LazyBlockStored``).

    Raises ``KVEventDecodeError`` when they are not a list of lists or None.
    """
    return cast(list[list[Any] | None] | None,
                _decoded(event.extra_keys, _extra_keys_decoder, "extra_keys"))


def _decoded(value: object, decoder: msgspec.msgpack.Decoder[Any], name: str) -> object:
    """``value`` itself, or decoded by ``decoder`` when still msgpack (``msgspec.Raw``)."""
    if not isinstance(value, msgspec.Raw):
        return value
    try:
        return decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"malformed BlockStored {name}: {exc}") from exc


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset (``POST /reset_prefix_cache``)."""


class UnknownEvent(msgspec.Struct, gc=False):
    """An event of a type this decoder does not know (a newer vLLM's): kept so the consumer
    can count and skip it instead of dropping the whole batch. ``type``: its tag."""

    type: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_KNOWN_EVENTS: Final = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One scheduler step's events: ``ts`` unix seconds, ``events``, the publisher's DP rank."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent]
    data_parallel_rank: int | None = None


class _TypedBatch(msgspec.Struct, array_like=True, gc=False):
    """What the fast typed decoder reads: a batch of known events only."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _StoredCount(KVCacheEvent, tag="BlockStored"):
    """What ``count_blocks`` reads of a ``BlockStored``: no hash, token id or extra key built."""

    block_hashes: msgspec.Raw  # a msgpack array; only its length is read
    block_size: int
    medium: str | None
    group_idx: int | None = None


class _RemovedCount(KVCacheEvent, tag="BlockRemoved"):
    """What ``count_blocks`` reads of a ``BlockRemoved``."""

    block_hashes: msgspec.Raw
    medium: str | None
    group_idx: int | None = None


class _RemovedSkipped(KVCacheEvent, tag="BlockRemoved"):
    """A ``BlockRemoved`` when ``count_blocks`` counts stores only: every field skipped."""


def _batch_of(name: str, event: Any) -> type[msgspec.Struct]:
    """A batch struct (``[ts, events, data_parallel_rank]``) whose events decode as ``event``."""
    return msgspec.defstruct(name, [("ts", float), ("events", list[event]),
                                    ("data_parallel_rank", int | None, None)],
                             array_like=True, gc=False)


# known events, a store's bulky fields left msgpack
_LazyBatch: Final = _batch_of("_LazyBatch", LazyBlockStored | BlockRemoved | AllBlocksCleared)
_CountBatch: Final = _batch_of("_CountBatch", _StoredCount | _RemovedCount | AllBlocksCleared)
_StoresCountBatch: Final = _batch_of("_StoresCountBatch",
                                     _StoredCount | _RemovedSkipped | AllBlocksCleared)


class _RawEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: Any
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_TypedBatch)
_lazy_decoder: Final[msgspec.msgpack.Decoder[Any]] = msgspec.msgpack.Decoder(_LazyBatch)
# {count removals too: (batch decoder, one event's decoder)}
_count_decoders: Final[dict[bool, tuple[msgspec.msgpack.Decoder[Any], msgspec.msgpack.Decoder[Any]]]] = {
    True: (msgspec.msgpack.Decoder(_CountBatch),
           msgspec.msgpack.Decoder(_StoredCount | _RemovedCount | AllBlocksCleared)),
    False: (msgspec.msgpack.Decoder(_StoresCountBatch),
            msgspec.msgpack.Decoder(_StoredCount | _RemovedSkipped | AllBlocksCleared)),
}
_raw_events_decoder = msgspec.msgpack.Decoder(_RawEventsBatch)
_generic_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack payload of a batch, byte-identical to vLLM 0.33's publisher."""
    return _encoder.encode(batch)


def encode_event(event: KVCacheEvent) -> bytes:
    """msgpack of one event as it appears inside a batch's event list."""
    return _encoder.encode(event)


def seq_bytes(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame."""
    return _SEQ.pack(seq)


def parse_seq(frame: bytes) -> int:
    """Sequence number from its frame; ``REPLAY_END_SEQ`` for the replay end marker.

    Raises ``KVEventDecodeError`` unless the frame is 8 bytes.
    """
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    if frame == REPLAY_END_FRAME:
        return REPLAY_END_SEQ
    return int(_SEQ.unpack(frame)[0])


def event_hash_key(block_hash: ExternalBlockHash) -> BlockKey:
    """64-bit block key of an event hash (int form as is, raw digest reduced).

    Raises ``KVEventDecodeError`` for other types or ints outside 0..2**64-1.
    """
    if isinstance(block_hash, bool):
        raise KVEventDecodeError("block hash must be an int or bytes, got bool")
    if isinstance(block_hash, int):
        if not 0 <= block_hash < 1 << 64:
            raise KVEventDecodeError(f"int block hash out of 64-bit range: {block_hash}")
        return BlockKey(block_hash)
    if isinstance(block_hash, bytes | bytearray | memoryview):
        data = bytes(block_hash)
        if len(data) < 8:
            raise KVEventDecodeError(f"byte block hash too short: {len(data)} bytes")
        return block_key(data)
    raise KVEventDecodeError(f"block hash must be an int or bytes, got {type(block_hash).__name__}")


def _loose_event(item: Any) -> KVEvent | UnknownEvent:
    """Convert one event of a batch the typed decoder refused: a map (vLLM 0.33 shape) or an
    array (pre-0.12 shape), either of a type this decoder does not know (``UnknownEvent``)."""
    if isinstance(item, dict):
        kind = item.get("type")
        if not isinstance(kind, str):
            raise KVEventDecodeError(f"event map without a type: {item!r:.80}")
        if kind not in _KNOWN_EVENTS:
            return UnknownEvent(kind)
        try:
            return msgspec.convert(item, KVEvent)
        except msgspec.ValidationError as exc:
            raise KVEventDecodeError(f"malformed {kind} event: {exc}") from exc
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise KVEventDecodeError(f"unrecognised event: {item!r:.80}")
    if item[0] not in _KNOWN_EVENTS:
        return UnknownEvent(item[0])
    return _legacy_event(item[0], item[1:])


def _legacy_event(kind: str, fields: list[Any]) -> KVEvent:
    """Convert one array-encoded (pre-0.12) event; fields past the known ones are ignored."""
    try:
        if kind == "BlockStored":
            hashes, parent, token_ids, block_size, *rest = fields
            rest += [None] * (3 - len(rest))
            return BlockStored(
                block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(token_ids),
                block_size=int(block_size), lora_id=rest[0], medium=rest[1], lora_name=rest[2],
            )
        if kind == "BlockRemoved":
            hashes, *rest = fields
            return BlockRemoved(block_hashes=list(hashes), medium=rest[0] if rest else None)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (TypeError, ValueError) as exc:
        raise KVEventDecodeError(f"malformed {kind} event: {exc}") from exc
    raise KVEventDecodeError(f"unknown event type {kind!r}")  # pragma: no cover - checked above


def decode_batch(payload: bytes, *, lazy: bool = False) -> KVEventBatch:
    """Decode a batch payload (vLLM 0.33 map-encoded events, or legacy array-encoded, or a
    mix). Unknown fields are ignored; an event of an unknown type becomes ``UnknownEvent``.

    ``lazy``: a vLLM 0.33 ``BlockStored`` becomes a ``LazyBlockStored`` (token ids and extra
    keys left undecoded and unchecked until read with ``stored_token_ids`` /
    ``stored_extra_keys``); batches that need the loose path (legacy arrays, unknown event
    types) are decoded in full as without it.

    Raises ``KVEventDecodeError`` for anything else (not msgpack, not a batch, a known event
    with missing or mistyped fields).
    """
    try:
        typed = (_lazy_decoder if lazy else _decoder).decode(payload)
        return KVEventBatch(typed.ts, cast(list[Any], typed.events), typed.data_parallel_rank)
    except msgspec.DecodeError as typed_error:
        try:
            raw = _generic_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise KVEventDecodeError(f"not msgpack: {exc}") from exc
        if not (isinstance(raw, list) and len(raw) >= 2 and isinstance(raw[1], list)):
            raise KVEventDecodeError(f"not a KV event batch: {typed_error}") from typed_error
        try:
            ts = float(raw[0])
        except (TypeError, ValueError) as exc:
            raise KVEventDecodeError(f"bad batch timestamp {raw[0]!r}") from exc
        rank = raw[2] if len(raw) > 2 else None
        if rank is not None and not isinstance(rank, int):
            raise KVEventDecodeError(f"bad data_parallel_rank {rank!r}") from typed_error
        return KVEventBatch(ts=ts, events=[_loose_event(e) for e in raw[1]], data_parallel_rank=rank)


BlockShape = tuple[bool, int | None, str | None, int | None]
"""``(stored, block_size, medium, group_idx)`` of a store (``stored`` True; ``block_size`` None
for a removal) or a removal, as ``count_blocks`` groups them."""


def count_blocks(payload: bytes, *, removals: bool = True,
                 ) -> tuple[int | None, dict[BlockShape, int]] | None:
    """``(data_parallel_rank, {BlockShape: blocks})`` of a batch payload: the block hashes its
    stores and (``removals``) removals carry, by shape, read without building a hash, token id
    or extra key (lengths come from the msgpack array headers). Costs about a lazy
    ``decode_batch`` with stores only (a removal's fields are skipped), a few times more with
    removals (a Python step per event); for a few large events, small in memory.

    Events it cannot read this way (legacy arrays, unknown types, malformed) are left out;
    ``None`` when the payload is not a batch at all. Never raises: ``decode_batch`` is the
    judge of malformed input.
    """
    batch_decoder, event_decoder = _count_decoders[removals]
    try:
        batch = batch_decoder.decode(payload)
        rank, events = batch.data_parallel_rank, batch.events
    except msgspec.DecodeError:
        try:
            loose = _raw_events_decoder.decode(payload)
        except msgspec.DecodeError:
            return None
        rank = loose.data_parallel_rank if isinstance(loose.data_parallel_rank, int) else None
        events = []
        for raw in loose.events:
            with contextlib.suppress(msgspec.DecodeError):
                events.append(event_decoder.decode(raw))
    counts: dict[BlockShape, int] = {}
    types = list(map(type, events))  # (picked at C speed: a batch holds hundreds of removals)
    for stored in compress(events, map(partial(operator.is_, _StoredCount), types)):
        shape: BlockShape = (True, stored.block_size, stored.medium, stored.group_idx)
        counts[shape] = counts.get(shape, 0) + _array_length(stored.block_hashes)
    if removals:
        for removed in compress(events, map(partial(operator.is_, _RemovedCount), types)):
            shape = (False, None, removed.medium, removed.group_idx)
            counts[shape] = counts.get(shape, 0) + _array_length(removed.block_hashes)
    return rank, counts


def _array_length(raw: msgspec.Raw) -> int:
    """Items of the msgpack array ``raw`` from its header (0 for anything else)."""
    data = memoryview(raw)
    if not data:
        return 0
    head = data[0]
    if 0x90 <= head <= 0x9F:  # fixarray
        return head & 0x0F
    if head == 0xDC and len(data) >= 3:  # array 16
        return int.from_bytes(data[1:3], "big")
    if head == 0xDD and len(data) >= 5:  # array 32
        return int.from_bytes(data[1:5], "big")
    return 0


def to_event_extra_keys(extra_keys: Sequence[Any] | None) -> list[Any] | None:
    """Tagged hash extra keys of one block -> the untagged shape events carry.

    Source: vLLM 0.33 ``to_event_extra_keys``: ``("lora", name, path)`` -> name,
    ``("mm", id, offset)`` -> ``[id, offset]``, ``("cache_salt", s)`` -> s,
    ``("prompt_embeds", digest)`` -> digest. None stays None.
    """
    if not extra_keys:
        return None
    out: list[Any] = []
    for key in extra_keys:
        tag = key[0]
        if tag == "lora":
            out.append(key[1])
        elif tag == "mm":
            out.append([key[1], key[2]])
        elif tag in ("cache_salt", "prompt_embeds"):
            out.append(key[1])
        else:
            raise ValueError(f"unknown extra key tag {tag!r}")
    return out


def from_event_extra_keys(
    entry: Sequence[Any] | None,
    *,
    block_index: int,
    lora_name: str | None,
    lora_path: str | None,
) -> tuple[Any, ...] | None:
    """Re-tag one block's event extra keys so the block can be re-hashed.

    Inverse of ``to_event_extra_keys`` given the event's ``lora_name`` and the
    adapter's path (which events do not carry). ``block_index`` is the block's
    absolute index in the request (cache_salt only appears on block 0).
    Raises ``KVEventDecodeError`` for a LoRA key without a known path or an
    entry that fits no known shape.
    """
    if not entry:
        return None
    out: list[tuple[Any, ...]] = []
    for position, value in enumerate(entry):
        if isinstance(value, list | tuple) and len(value) == 2:
            out.append(("mm", value[0], value[1]))
        elif isinstance(value, bytes):
            out.append(("prompt_embeds", value))
        elif isinstance(value, str) and position == 0 and lora_name is not None and value == lora_name:
            if lora_path is None:
                raise KVEventDecodeError(f"no path known for LoRA adapter {lora_name!r}")
            out.append(("lora", value, lora_path))
        elif isinstance(value, str) and block_index == 0:
            out.append(("cache_salt", value))
        else:
            raise KVEventDecodeError(f"unrecognised extra key {value!r:.60} in block {block_index}")
    return tuple(out)
