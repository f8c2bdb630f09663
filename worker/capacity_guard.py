"""The worker's guard against batches no engine could have sent: more GPU-tier blocks resident
than the engine's KV cache holds (``num_gpu_blocks`` of ``vllm:cache_config_info``). vLLM's
``BlockPool`` cannot hold more, so such a batch is a rogue or broken publisher's and none of it
may reach Redis. Does no I/O (``BatchRefused``, the refusal, is the subscriber's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockShape,
    BlockStored,
    count_blocks,
)
from worker.event_filter import EventFilter
from worker.subscriber import BatchRefused

# payload bytes from which a batch's blocks are counted before it is decoded: a legitimate
# step's batch is tens of KB (8,192 tokens of 16-token blocks: about 40 KB) and a smaller one
# builds at most a few MB of hashes before ``check_capacity`` refuses it (the count costs about
# as much as the lazy decode, so the usual batch skips it)
PRECHECK_MIN_BYTES: Final = 256 * 1024


def resident_after(num_resident: int, events: Sequence[object]) -> int:
    """GPU-tier blocks resident after ``events``, from ``num_resident`` before them: a store adds
    its blocks, an eviction takes them off, an ``AllBlocksCleared`` empties the cache (vLLM
    publishes it with the next step's batch, so the stores after it in the same batch start
    from nothing). Counts blocks, not distinct keys: a real engine's count never exceeds its
    ``num_gpu_blocks``, and the view's distinct keys never exceed the engine's count."""
    num = num_resident
    for event in events:
        if isinstance(event, AllBlocksCleared):
            num = 0
        elif isinstance(event, BlockStored) and event.medium in (None, "GPU"):
            num += len(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium in (None, "GPU"):
            num -= len(event.block_hashes)
    return num


def check_capacity(num_resident: int, events: Sequence[object], capacity: int | None) -> None:
    """Raise ``BatchRefused`` when ``events`` would leave more GPU-tier blocks resident than
    ``capacity`` (None or 0: not known yet, nothing refused). A store counts each block, an
    eviction takes one off; the view holds at most as many distinct keys as the engine holds
    blocks, so ``num_resident`` is the view's block count."""
    if not capacity:
        return
    num_after = resident_after(num_resident, events)
    if num_after > capacity:
        raise BatchRefused(f"{num_resident} resident blocks would become "
                           f"{num_after}, over the engine's KV capacity of {capacity} blocks")


def gpu_delta(counted: tuple[int | None, dict[BlockShape, int]] | None,
              event_filter: EventFilter) -> int:
    """GPU-tier blocks stored minus removed by the events ``event_filter`` would keep (0 for a
    payload that is not a batch: the decode counts it as malformed)."""
    if counted is None:
        return 0
    rank, counts = counted
    delta = 0
    for (stored, block_size, medium, group_idx), num_blocks in counts.items():
        if (medium or "GPU") == "GPU" and event_filter.skip_reason(
                stored, medium, group_idx, block_size, rank) is None:
            delta += num_blocks if stored else -num_blocks
    return delta


def precheck(payload: bytes, capacity: int | None, event_filter: EventFilter) -> None:
    """Raise ``BatchRefused`` for a batch payload whose GPU-tier stores net of its GPU-tier
    evictions exceed the engine's whole KV capacity (``capacity``, ``num_gpu_blocks``):
    impossible from any state, so refused before the decode, its block hashes and token ids
    never built (a 2,000,000-block batch fits under a 500,000-block engine's ``MAXMSGSIZE``).
    Counted from the msgpack array headers (``count_blocks``), over the events
    ``event_filter`` keeps (its ``block_size`` set by the caller); the state-dependent
    ``check_capacity`` follows the decode."""
    # every block hash takes a byte at least: a payload this small cannot be impossible;
    # below PRECHECK_MIN_BYTES the decode is cheap and ``check_capacity`` refuses it after
    if not capacity or len(payload) <= max(capacity, PRECHECK_MIN_BYTES):
        return
    # the stores first (cheap: removals skipped), the removals only when they matter
    delta = gpu_delta(count_blocks(payload, removals=False), event_filter)
    if delta > capacity:
        delta = gpu_delta(count_blocks(payload), event_filter)
    if delta > capacity:
        raise BatchRefused(f"{delta:+d} resident blocks exceed the engine's whole KV "
                           f"capacity of {capacity} blocks (refused before decoding)")
