"""The worker's view of one replica's prefix cache: events in, Redis changes out. Pure: no I/O.

``ReplicaView`` applies decoded KV event batches (vLLM 0.33 ``KVEventBatch``) to
a reference-counted ``BlockSet`` through a ``KeyMapper`` and returns the
externally visible ``Change``s: keys that became resident (``stored``), keys
that stopped being resident (``removed``), or a reset (``cleared``: the set is
replaced by ``keys``, usually empty, under a new ``epoch``). The Redis writer
turns each flush of changes into set updates plus one ``{prefix}:events`` stream entry.

With ``index_stride`` N > 1 (the coarse index, ``router.shared.contract.is_anchor``)
only the keys at anchor positions of their chain enter the set: the view keeps
the chain depth of every resident block ({engine key: depth}), a
stored block's depth being its parent's plus one (vLLM 0.33 ``BlockStored``:
``parent_block_hash`` is None for block 0). A store whose parent the view never
saw has no known depth and publishes no anchors (``num_unknown_depth_blocks``):
the index under-reports, it never over-reports.

Tiers (``router.shared.contract.TIERS``): events with ``medium`` ``"CPU"`` (vLLM native offloading)
change a second set, ``cpu_blocks``; every ``Change`` names its ``tier``. vLLM's offloading
connector publishes a host store without parent or token ids, so on the coarse index the view
takes a CPU block's depth from the GPU store of the same hash, which comes first (offloading is
write-through: a block is copied to the host once the GPU has it); a host store of a hash the
GPU view does not hold (any more) has no known depth and is counted like any other. With
keys re-hashed from tokens (``key_mode=recomputed``) a host store is keyed by the digest the GPU
store of the same hash gave (``worker.block_keys.RecomputedKeys``); its blocks the worker never
saw stored are not placed (counted as unknown-depth blocks), and a host store none of whose
blocks can be placed is skipped (``stats.skipped["no_chain"]``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.shared.contract import (
    OP_CLEARED,
    OP_REMOVED,
    OP_STORED,
    TIER_CPU,
    TIER_GPU,
    BlockKey,
    anchor_positions_between,
    is_anchor,
)
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    event_hash_key,
)
from router.shared.logs import IntervalLog
from worker.block_keys import KEY_MODE_ENGINE, EngineKeys, KeyMapper
from worker.block_set import BlockSet

logger = logging.getLogger(__name__)

NO_SEQ = -1  # last applied seq before any batch
BAD_EVENT_LOG_INTERVAL_S = 10.0  # one warning line per this many seconds of bad events


@dataclass(frozen=True, slots=True)
class Change:
    """One externally visible change of the replica's resident sets.

    ``op``: ``stored`` / ``removed`` (``keys`` = the 0->1 or 1->0 transitions of ``tier``'s
    set) or ``cleared`` (every tier's set is replaced: the GPU set by ``keys``, the CPU set by
    ``cpu_keys``, under ``epoch``); ``seq``: the KV event batch sequence number it came from
    (``NO_SEQ`` when none).
    """

    op: str
    keys: list[BlockKey]
    epoch: int
    seq: int
    tier: str = TIER_GPU  # router.shared.contract.TIERS; a ``cleared`` change covers every tier
    cpu_keys: list[BlockKey] = field(default_factory=list)  # ``cleared`` only: the new CPU set


@dataclass(slots=True)
class ViewStats:
    """Cumulative counters read by the metrics collector."""

    events: Counter[str] = field(default_factory=Counter)  # {event type: events applied}
    num_bad_events: int = 0  # events dropped because their keys could not be computed
    num_epoch_resets: int = 0
    num_unknown_depth_blocks: int = 0  # stored blocks whose chain depth is unknown (stride > 1)
    num_unknown_depth_cpu_blocks: int = 0  # of them, host (CPU-tier) stores
    events_by_tier: Counter[str] = field(default_factory=Counter)  # {tier: events applied}
    skipped: Counter[str] = field(default_factory=Counter)  # {reason: events the view skipped}
    last_batch_ts: float = 0.0  # engine timestamp (unix s) of the last applied batch


class ReplicaView:
    """Resident block keys of one replica, its ``epoch`` and last applied ``seq``.

    ``epoch`` increases on every reset (engine restart, cache clear, resync,
    Redis rewrite, key-mode switch: ``rekeyed``); ``seq`` is the last KV event batch applied.
    """

    def __init__(self, epoch: int = 0, seq: int = NO_SEQ, keys: list[BlockKey] | None = None,
                 mapper: KeyMapper | None = None, index_stride: int = 1,
                 cpu_keys: list[BlockKey] | None = None) -> None:
        if index_stride < 1:
            raise ValueError(f"index_stride must be >= 1, got {index_stride}")
        self.blocks = BlockSet(keys or ())  # GPU tier; anchor keys only when index_stride > 1
        self.cpu_blocks = BlockSet(cpu_keys or ())  # CPU tier (host memory), the same way
        self.epoch = epoch
        self.seq = seq
        self.mapper: KeyMapper = mapper if mapper is not None else EngineKeys()
        self.index_stride = index_stride
        self._depth: dict[int, int] = {}  # {engine block key: chain depth} of resident blocks
        self._extra_copies: dict[int, int] = {}  # {engine block key: copies beyond the first}
        self.stats = ViewStats()
        self._bad_log = IntervalLog(logger, BAD_EVENT_LOG_INTERVAL_S)  # one line per interval

    @property
    def key_mode(self) -> str:
        return self.mapper.mode

    @property
    def num_unknown_removals(self) -> int:
        """Removed blocks that were not resident on their tier (both tiers; under
        ``key_mode=recomputed`` the engine hashes the key map never saw stored)."""
        return (self.blocks.num_unknown_removals + self.cpu_blocks.num_unknown_removals
                + self.mapper.num_unknown_removals)

    def apply_batch(self, seq: int, batch: KVEventBatch) -> list[Change]:
        """Apply one batch; return its changes in order, consecutive same-op runs merged.

        An ``AllBlocksCleared`` resets the set and bumps ``epoch`` (vLLM 0.33
        ``reset_prefix_cache``); changes before it in the batch are superseded.
        An event whose keys cannot be computed is dropped and counted.
        """
        changes: list[Change] = []
        stats = self.stats
        for event in _coalesced_removals(batch.events, self.mapper.mode == KEY_MODE_ENGINE):
            try:
                if isinstance(event, BlockStored | BlockRemoved | _RemovedRun):
                    medium = (event.merged if isinstance(event, _RemovedRun) else event).medium
                    medium = medium or TIER_GPU
                    if medium not in (TIER_GPU, TIER_CPU):
                        continue  # another offload tier (the EventFilter counts these)
                    tier = medium
                if isinstance(event, BlockStored):
                    op, keys = OP_STORED, self._stored(event, tier)
                elif isinstance(event, BlockRemoved):
                    op, keys = OP_REMOVED, self._removed(event, tier)
                elif isinstance(event, AllBlocksCleared):
                    stats.events["AllBlocksCleared"] += 1
                    self.seq = seq
                    changes = [self._reset("engine cleared its prefix cache (AllBlocksCleared)")]
                    continue
                elif isinstance(event, _RemovedRun):
                    op, keys = OP_REMOVED, self._removed_run(event, stats, seq, tier)
                else:  # pragma: no cover - decode_batch only yields the three types
                    raise KVEventDecodeError(f"unknown event {type(event).__name__}")
            except _Skipped as skip:
                stats.skipped[skip.reason] += 1
                continue
            except KVEventDecodeError as exc:
                stats.num_bad_events += 1
                self._bad_log.warning("dropping %s in batch seq %d: %s", _event_name(event),
                                      seq, exc)
                continue
            if not isinstance(event, _RemovedRun):
                stats.events[_event_name(event)] += 1
                stats.events_by_tier[tier] += 1
            if not keys:
                continue
            if changes and changes[-1].op == op and changes[-1].tier == tier:
                changes[-1].keys.extend(keys)
            else:
                changes.append(Change(op, keys, self.epoch, seq, tier))
        self.seq = seq
        stats.last_batch_ts = batch.ts
        return changes

    def _stored(self, event: BlockStored, tier: str) -> list[BlockKey]:
        if tier != TIER_GPU and self.mapper.mode != KEY_MODE_ENGINE:
            event = self._placeable(event)
        keys = self.mapper.stored(event, tier)
        if self.index_stride > 1:
            # a host-tier store has no parent of its own: it takes the depth of the GPU store
            # of the same hash (write-through: that store came first)
            keys = (self._anchors(event, keys) if tier == TIER_GPU
                    else self._cpu_anchors(event, keys))
        return self._tier_blocks(tier).store(keys)

    def _placeable(self, event: BlockStored) -> BlockStored:
        """A host store (no tokens, no parent) restricted to the blocks whose keys the mapper
        knows from their GPU stores; raises ``_Skipped`` when it knows none."""
        hashes = self.mapper.placeable(event)
        unplaced = len(event.block_hashes) - len(hashes)
        if not unplaced:
            return event
        self.stats.num_unknown_depth_blocks += unplaced
        self.stats.num_unknown_depth_cpu_blocks += unplaced
        if not hashes:
            raise _Skipped("no_chain")
        return msgspec.structs.replace(event, block_hashes=hashes)

    def _removed(self, event: BlockRemoved, tier: str) -> list[BlockKey]:
        keys = self.mapper.removed(event, tier)
        blocks = self._tier_blocks(tier)
        if self.index_stride > 1:
            if tier == TIER_GPU:
                self._forget_depths(event, keys)
            # non-anchors were never published; a key gone by an earlier removal of the same
            # run is skipped as it would be one event at a time (checked before each removal)
            return blocks.discard(keys)
        return blocks.remove(keys)

    def _tier_blocks(self, tier: str) -> BlockSet:
        return self.blocks if tier == TIER_GPU else self.cpu_blocks

    def _removed_run(self, run: _RemovedRun, stats: ViewStats, seq: int,
                     tier: str) -> list[BlockKey]:
        """A run of consecutive evictions applied as one event (same state, changes and
        counters as one by one: tests/unit/test_removal_runs.py); if a hash in it is bad,
        event by event, so only the bad event is dropped. Only for key mappers whose
        ``removed`` changes nothing before it raises (``EngineKeys``)."""
        try:
            keys = self._removed(run.merged, tier)
        except KVEventDecodeError:
            keys = []
            for event in run.events:
                try:
                    keys.extend(self._removed(event, tier))
                except KVEventDecodeError as exc:
                    stats.num_bad_events += 1
                    self._bad_log.warning("dropping BlockRemoved in batch seq %d: %s", seq, exc)
                    continue
                stats.events["BlockRemoved"] += 1
                stats.events_by_tier[tier] += 1
            return keys
        stats.events["BlockRemoved"] += len(run.events)
        stats.events_by_tier[tier] += len(run.events)
        return keys

    def _engine_keys(self, hashes: list[Any], keys: list[BlockKey]) -> list[BlockKey]:
        # in key_mode=engine the mapper's keys ARE the engine keys: no second reduction
        return keys if self.mapper.mode == KEY_MODE_ENGINE else [event_hash_key(h) for h in hashes]

    def _anchors(self, event: BlockStored, keys: list[BlockKey]) -> list[BlockKey]:
        """Record the depths of a stored run; return its keys at anchor positions."""
        depth = self._depth
        if event.parent_block_hash is None:
            base = 0
        else:
            parent = depth.get(event_hash_key(event.parent_block_hash))
            if parent is None:
                self.stats.num_unknown_depth_blocks += len(keys)
                return []
            base = parent + 1
        engine_keys = self._engine_keys(event.block_hashes, keys)
        again = list(filter(depth.__contains__, engine_keys))  # (``keys() &`` copies the dict)
        if again:  # another copy of a resident hash (same hash: same chain, same depth)
            extra = self._extra_copies
            for key in again:
                extra[key] = extra.get(key, 0) + 1
        depth.update(zip(engine_keys, range(base, base + len(engine_keys)), strict=False))
        return [keys[p - base] for p in anchor_positions_between(base, base + len(keys),
                                                                 self.index_stride)]

    def _cpu_anchors(self, event: BlockStored, keys: list[BlockKey]) -> list[BlockKey]:
        """The keys of a host (CPU-tier) store at anchor positions, placed by the depth the GPU
        store of the same hash recorded (the connector publishes no parent)."""
        depth, stride = self._depth, self.index_stride
        out: list[BlockKey] = []
        for engine_key, key in zip(self._engine_keys(event.block_hashes, keys), keys, strict=True):
            d = depth.get(engine_key)
            if d is None:
                self.stats.num_unknown_depth_blocks += 1
                self.stats.num_unknown_depth_cpu_blocks += 1
            elif is_anchor(d, stride):
                out.append(key)
        return out

    def _forget_depths(self, event: BlockRemoved, keys: list[BlockKey]) -> None:
        depth, extra = self._depth, self._extra_copies
        for key in self._engine_keys(event.block_hashes, keys):
            copies = extra.get(key) if extra else None
            if copies is None:
                depth.pop(key, None)
            elif copies == 1:
                del extra[key]
            else:
                extra[key] = copies - 1

    def reset(self, reason: str, seq: int | None = None) -> Change:
        """Forget everything (the view is no longer trustworthy); bump ``epoch``.

        ``seq`` (when given) becomes the last applied sequence number.
        """
        if seq is not None:
            self.seq = seq
        return self._reset(reason)

    def rewrite(self, reason: str) -> Change:
        """Keep the keys but bump ``epoch`` and publish the whole set (after a Redis outage)."""
        self.epoch += 1
        self.stats.num_epoch_resets += 1
        logger.warning("epoch %d: republishing %d blocks (%d on the CPU tier): %s", self.epoch,
                       len(self.blocks), len(self.cpu_blocks), reason)
        return self.publish_whole()

    def rekeyed(self, mapper: KeyMapper, reason: str) -> ReplicaView:
        """An empty view under ``mapper`` at the next epoch, to be filled from the engine's replay.

        The current keys mean nothing under another mapper; rather than clearing this view
        and waiting for new events (the engine's cached blocks would stay invisible until
        evicted and stored again), the caller re-applies the replay buffer to the returned
        view and publishes it whole (``publish_whole``). Counters are shared with this view.
        """
        view = ReplicaView(epoch=self.epoch + 1, mapper=mapper, index_stride=self.index_stride)
        view.stats = self.stats
        self.stats.num_epoch_resets += 1
        logger.warning("epoch %d: re-keying the replica view from the engine's replay: %s",
                       view.epoch, reason)
        return view

    def publish_whole(self) -> Change:
        """Every tier's whole set as one change that replaces what Redis holds (same epoch and
        seq)."""
        return Change(OP_CLEARED, self.blocks.keys(), self.epoch, self.seq,
                      cpu_keys=self.cpu_blocks.keys())

    def _reset(self, reason: str) -> Change:
        self.blocks.clear()
        self.cpu_blocks.clear()
        self.mapper.clear()
        self._depth.clear()
        self._extra_copies.clear()
        self.epoch += 1
        self.stats.num_epoch_resets += 1
        logger.warning("epoch %d: replica view reset: %s", self.epoch, reason)
        return Change(OP_CLEARED, [], self.epoch, self.seq)


def _event_name(event: object) -> str:
    """An event's type as vLLM names it (a ``LazyBlockStored`` is a ``BlockStored``)."""
    return "BlockStored" if isinstance(event, BlockStored) else type(event).__name__


class _Skipped(Exception):
    """An event the view cannot use, skipped and counted under ``reason`` (not an error)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _RemovedRun:
    """Consecutive ``BlockRemoved`` events of one medium and group, and their merge."""

    events: list[BlockRemoved]
    merged: BlockRemoved


def _coalesced_removals(events: list[Any], enabled: bool) -> list[Any]:
    """``events`` with each run of consecutive ``BlockRemoved`` of one medium and group (vLLM
    publishes one per evicted block, ``_maybe_evict_cached_block``: about 96% of a loaded
    replica's events) as one ``_RemovedRun``: the per-event work is then done once per run."""
    if not enabled or len(events) < 2:
        return events
    out: list[Any] = []
    run: list[BlockRemoved] = []

    def close() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            first = run[0]
            hashes = [h for event in run for h in event.block_hashes]
            out.append(_RemovedRun(list(run), BlockRemoved(
                block_hashes=hashes, medium=first.medium, group_idx=first.group_idx)))
        run.clear()

    for event in events:
        if type(event) is BlockRemoved:
            if run and (event.medium != run[0].medium or event.group_idx != run[0].group_idx):
                close()
            run.append(event)
        else:
            close()
            out.append(event)
    close()
    return out
