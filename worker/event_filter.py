"""Which KV events the block index can use, before they reach the replica view. Pure: no I/O.

The index holds block keys of one block size, chained from block 0 (``router.shared.hashing``).
Real engines publish events it cannot place; they are skipped and counted by reason,
never treated as errors (one bad event must not cost the batch or fill the log):

* ``tier``: a medium the worker is not configured to index (``--kv-tiers``; ``GPU`` is
  always indexed; vLLM publishes ``"CPU"`` for native offloading, ``"STORAGE"`` for
  disk/remote tiers, which no router values yet, so it is never indexed; ``skipped_tiers``
  counts these by medium, any medium vLLM does not name as ``"other"``). With ``CPU``
  indexed, the view keeps the host tier's blocks in a set of their own (Redis contract
  version 4: resident keys per replica and tier), so a GPU eviction of a block the host
  still holds leaves it routable as a CPU-tier hit;
* ``group``: ``group_idx`` other than 0 (None counts as 0). Hybrid models (vLLM's hybrid
  KV-cache manager: full attention plus sliding-window or Mamba groups) publish one event
  stream per KV-cache group; the router follows group 0 only, so its hit depth is group
  0's. vLLM reports a hit only where every group agrees, so the router may over-estimate a
  hybrid model's hit where another group (a sliding window) has dropped blocks;
* ``block_size``: a ``BlockStored`` whose block size differs from the routers' (another
  group's size, or an offloaded block size larger than the GPU's): its hashes are of
  another granularity and match no key the routers compute;
* ``no_chain`` (decided by the view, ``worker.replica_view``, which knows the keys): a host
  store when keys are re-hashed from tokens (``key_mode=recomputed``) none of whose blocks the
  worker saw stored on the GPU: vLLM's offloading connector publishes ``BlockStored`` without
  ``token_ids`` and without a parent, so such a store cannot be re-hashed;
* ``unknown_type``: an event type this worker does not know (``UnknownEvent``);
* ``dp_rank``: every event of a batch whose ``data_parallel_rank`` is not the rank this view
  follows (``dp_rank``; a data-parallel engine publishes one stream per rank, and a stream
  connected to the wrong rank's port must not put that rank's blocks on this one).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from router.shared.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LazyBlockStored,
    UnknownEvent,
)

MEDIUM_GPU: Final = "GPU"
DEFAULT_KV_TIERS: Final = ("GPU", "CPU")  # mediums indexed by default (vLLM native offloading)
KNOWN_MEDIUMS: Final = ("GPU", "CPU", "STORAGE")
INDEXED_MEDIUMS: Final = ("GPU", "CPU")  # router.shared.contract.TIERS: the tiers routers value
SKIP_REASONS: Final = ("tier", "group", "no_chain", "block_size", "unknown_type", "dp_rank")
OTHER_MEDIUM: Final = "other"  # label of a skipped medium vLLM does not name (bounded labels)
_STORED_EVENTS: Final = frozenset({BlockStored, LazyBlockStored})  # (as decoded: full or lazy)
_BLOCK_EVENTS: Final = _STORED_EVENTS | {BlockRemoved}
_MEDIUM_GROUP: Final = operator.attrgetter("medium", "group_idx")


def parse_kv_tiers(text: str) -> frozenset[str]:
    """``"GPU,CPU"`` -> the mediums to index (upper-cased; GPU always). Raises ``ValueError``."""
    tiers = {part.strip().upper() for part in text.split(",") if part.strip()}
    unknown = tiers - set(KNOWN_MEDIUMS)
    if unknown:
        raise ValueError(f"unknown KV tiers {sorted(unknown)}; known: {', '.join(KNOWN_MEDIUMS)}")
    unvalued = tiers - set(INDEXED_MEDIUMS)
    if unvalued:
        raise ValueError(f"KV tiers {sorted(unvalued)} are not indexed (routers value a hit on "
                         f"{' and '.join(INDEXED_MEDIUMS)} only; their events are skipped as "
                         "'tier')")
    return frozenset(tiers | {MEDIUM_GPU})


@dataclass(slots=True)
class EventFilter:
    """Drops the events of a batch the index cannot use; counts them in ``skipped``.

    ``block_size``: the routers' (None: not checked); ``tiers``: mediums indexed (a None
    medium, as older vLLM releases publish, counts as GPU).
    """

    block_size: int | None = None
    tiers: frozenset[str] = frozenset(DEFAULT_KV_TIERS)
    dp_rank: int | None = None  # the engine's DP rank this view follows; None: any batch
    skipped: Counter[str] = field(default_factory=Counter)  # {reason: events skipped}
    skipped_tiers: Counter[str] = field(default_factory=Counter)  # {medium: events "tier"}

    def apply(self, batch: KVEventBatch) -> KVEventBatch:
        """``batch`` itself when every event is usable, else a copy without the others."""
        rank = batch.data_parallel_rank
        if self.dp_rank is not None and rank is not None and rank != self.dp_rank:
            self.skipped["dp_rank"] += len(batch.events)
            return KVEventBatch(batch.ts, [], rank)
        events = batch.events
        reasons = self._reasons_by_shape(events)
        if reasons is None:  # events of other types among them: one by one
            reasons = [self._reason(event) for event in events]
        if not any(reasons):
            return batch
        kept = []
        for event, reason in zip(events, reasons, strict=True):
            if reason:
                self.skipped[reason] += 1
                if reason == "tier":
                    medium = getattr(event, "medium", None)
                    self.skipped_tiers[medium if medium in KNOWN_MEDIUMS else OTHER_MEDIUM] += 1
            else:
                kept.append(event)
        return KVEventBatch(batch.ts, kept, batch.data_parallel_rank)

    def _reasons_by_shape(self, events: Sequence[object]) -> list[str | None] | None:
        """The reasons of a batch of stores and removals only, removals decided once per
        distinct (medium, group) rather than per event (a loaded replica publishes hundreds of
        one-block removals per batch; these maps run at C speed); stores one by one. ``None``
        when the batch holds other event types."""
        types = set(map(type, events))
        if not types <= _BLOCK_EVENTS:
            return None
        shapes = list(zip(map(type, events), map(_MEDIUM_GROUP, events), strict=True))
        decided: dict[Any, str | None] = {}
        for shape in set(shapes):
            if shape[0] is BlockRemoved:
                medium, group_idx = shape[1]
                decided[shape] = self._shape_reason(BlockRemoved, medium, group_idx, None)
        if types.isdisjoint(_STORED_EVENTS) and len(decided) == 1 and None in decided.values():
            return [None] * len(events)  # (the usual removal batch: all usable)
        return [decided[shape] if shape[0] is BlockRemoved else self._reason(event)
                for shape, event in zip(shapes, events, strict=True)]

    def _reason(self, event: object) -> str | None:
        if isinstance(event, BlockStored | BlockRemoved):
            return self._shape_reason(type(event), event.medium, event.group_idx,
                                      event.block_size if isinstance(event, BlockStored) else None)
        if isinstance(event, UnknownEvent):
            return "unknown_type"
        return None

    def skip_reason(self, stored: bool, medium: str | None, group_idx: int | None,
                    block_size: int | None, rank: int | None) -> str | None:
        """Why a store (``stored``) or removal of this shape in a batch of DP rank ``rank``
        would be skipped by ``apply`` (None: usable); counts nothing. For a batch not yet
        decoded (``router.shared.kv_events.count_blocks``)."""
        if self.dp_rank is not None and rank is not None and rank != self.dp_rank:
            return "dp_rank"
        return self._shape_reason(BlockStored if stored else BlockRemoved, medium, group_idx,
                                  block_size)

    def _shape_reason(self, event_type: type, medium: str | None, group_idx: int | None,
                      block_size: int | None) -> str | None:
        """Why a store or removal of this shape is skipped (None: usable)."""
        medium = medium or MEDIUM_GPU
        if medium not in self.tiers:
            return "tier"
        if group_idx:
            return "group"
        if issubclass(event_type, BlockStored) and (
                self.block_size is not None and block_size != self.block_size):
            return "block_size"
        return None

    def skipped_by_reason(self) -> Iterable[tuple[str, int]]:
        return ((reason, self.skipped.get(reason, 0)) for reason in SKIP_REASONS)
