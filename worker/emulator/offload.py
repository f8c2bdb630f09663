"""CPU tier of the engine emulator: vLLM's native KV offloading. Pure: no I/O, no clock.

What ``vllm serve --kv-offloading-backend native --kv-offloading-size GIB`` does, from
vLLM's ``OffloadingConnectorScheduler`` (``distributed/kv_transfer/kv_connector/v1/
offloading/scheduler.py``), ``LRUOffloadingManager`` (``v1/kv_offload/lru_manager.py``)
and the offloading worker:

* a host pool of ``num_cpu_blocks = floor(size_GiB * 2**30 / block_bytes)`` blocks, one per
  block hash, behind the GPU pool (same block size: the offloaded block size defaults to
  the GPU's);
* **write-through, not on eviction**: each scheduler step, the blocks that step makes full
  (``num_computed + num_scheduled``) are prepared for store; hashes already in the pool are
  skipped; when too few host blocks are free, the least recently used *ready* blocks with no
  load in flight are evicted (one ``BlockRemoved``, medium ``"CPU"``); when even that is not
  enough nothing is stored and the run is retried next step;
* the copy runs after the step (vLLM defers stores to the beginning of the next engine
  step) over the device-to-host link, one transfer after another; a block becomes visible
  to lookups, and is published (``BlockStored`` medium ``"CPU"``, ``parent_block_hash``
  None, ``token_ids`` [], no LoRA: the connector's ``take_events``), when its copy ends;
* a waiting request whose GPU hit ends at block ``g`` looks up its full blocks from ``g``
  on (every full block, the last one included); a hit of at least one block is loaded
  asynchronously over the host-to-device link: the request waits (vLLM
  ``WAITING_FOR_REMOTE_KVS``, no token budget) with its GPU blocks allocated, and is
  scheduled in the first step after the load ends; a lookup is deferred while any of its
  hit blocks is being loaded for another request, or while ``max_concurrent_loads``
  requests are loading;
* LRU order: a lookup touches all of the request's hashes, a store touches the request's
  blocks up to the stored end (``touch`` walks them reversed, so block 0 ends most recent).

Times are engine seconds; transfer times come from ``host_link_bytes_per_s``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

TIME_EPS_S = 1e-9  # engine seconds: a transfer due at t has ended at t despite float round trips
STORING = -1  # host block allocated, copy in flight: not ready (vLLM ``BlockStatus.ref_cnt == -1``)


@dataclass(frozen=True, slots=True)
class OffloadStored:
    """Event: host copies of these blocks are complete (raw digests)."""

    block_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class OffloadRemoved:
    """Event: these blocks were evicted from the host pool (raw digests)."""

    block_hashes: list[bytes]


OffloadEvent = OffloadStored | OffloadRemoved


class OffloadRequest(Protocol):
    """What the tier needs from a request (the scheduler's ``Request``)."""

    request_id: str
    block_hashes: list[bytes]
    num_offloaded_blocks: int


@dataclass(slots=True)
class OffloadStats:
    """Cumulative counters (vLLM ``vllm:external_prefix_cache_*`` and ``vllm:kv_offload_*``)."""

    external_queries: int = 0  # tokens looked up beyond the GPU hit
    external_hits: int = 0  # tokens found in the host pool
    store_bytes: int = 0  # GPU_to_CPU
    store_s: float = 0.0
    load_bytes: int = 0  # CPU_to_GPU
    load_s: float = 0.0


@dataclass(slots=True)
class _Transfer:
    done_s: float
    duration_s: float
    block_hashes: list[bytes]
    request: Any = None  # the loading request; None for a store


@dataclass(slots=True)
class CpuOffload:
    """The host pool and its two links. Invariant: ``len(_blocks) <= num_blocks``."""

    num_blocks: int
    block_size: int  # tokens
    block_bytes: int  # bytes of one block's KV (all layers)
    host_link_bytes_per_s: float
    max_concurrent_loads: int = 256  # vLLM: scheduler max_num_seqs
    enable_events: bool = True
    stats: OffloadStats = field(default_factory=OffloadStats)
    # {block_hash: STORING or the number of loads reading it}; order = LRU, head = next victim
    _blocks: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    _stores: deque[_Transfer] = field(default_factory=deque)  # done_s ascending (serial link)
    _loads: deque[_Transfer] = field(default_factory=deque)
    _being_loaded: dict[bytes, int] = field(default_factory=dict)  # {block_hash: loads}
    _d2h_free_s: float = 0.0
    _h2d_free_s: float = 0.0
    _events: list[OffloadEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the CPU tier needs at least one block")
        if self.host_link_bytes_per_s <= 0 or self.block_bytes <= 0:
            raise ValueError("host link bandwidth and block bytes must be positive")

    # ------------------------------------------------------------ state

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding a hash (stored or being stored), 0..1."""
        return len(self._blocks) / self.num_blocks

    def is_ready(self, block_hash: bytes) -> bool:
        state = self._blocks.get(block_hash)
        return state is not None and state != STORING

    def lru_order(self) -> list[bytes]:
        """Hashes in eviction order (head first); for tests and debugging."""
        return list(self._blocks)

    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def next_load_done_s(self) -> float | None:
        """Engine time the first CPU-to-GPU load under way ends (loads share the host link one
        after another, so the first queued ends first), or None when none is."""
        return self._loads[0].done_s if self._loads else None

    def next_done_s(self) -> float | None:
        """Engine time the next transfer (load or store) ends, or None when idle."""
        times = [q[0].done_s for q in (self._loads, self._stores) if q]
        return min(times) if times else None

    # ------------------------------------------------------------ lookup and load

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        blocks = self._blocks
        for block_hash in reversed(block_hashes):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)

    def match(self, request: OffloadRequest, num_gpu_hit_tokens: int, num_tokens: int) -> int | None:
        """Tokens the host pool adds beyond a GPU hit (vLLM ``get_num_new_matched_tokens``).

        Returns 0 for no usable hit, None when the lookup must wait (loads in flight),
        else a multiple of ``block_size``. Counts the lookup in ``stats`` only when it
        is decided (the caller records it once the request is admitted: ``record``).
        """
        if len(self._loads) >= self.max_concurrent_loads:
            return None
        hashes = request.block_hashes
        num_full = min(len(hashes), num_tokens // self.block_size)
        self.touch(hashes[:num_full])
        if num_full * self.block_size - num_gpu_hit_tokens < self.block_size:
            return 0
        start = num_gpu_hit_tokens // self.block_size
        blocks = self._blocks
        hits = 0
        for block_hash in hashes[start:num_full]:
            state = blocks.get(block_hash)
            if state is None or state == STORING:
                break
            hits += 1
        if not hits:
            return 0
        if self._being_loaded and any(h in self._being_loaded for h in hashes[start:start + hits]):
            return None
        return (start + hits) * self.block_size - num_gpu_hit_tokens

    def record(self, num_tokens: int, num_gpu_hit_tokens: int, num_hit_tokens: int,
               preempted: bool) -> None:
        """Count an admitted request's lookup: queries are the tokens beyond the GPU hit,
        recorded when nonzero; preempted requests' lookups are not in the counters (vLLM
        ``connector_prefix_cache_stats``, exposed from its non-preempted fields)."""
        queries = num_tokens - num_gpu_hit_tokens
        if queries and not preempted:
            self.stats.external_queries += queries
            self.stats.external_hits += num_hit_tokens

    def start_load(self, request: Any, start_block: int, num_blocks: int, now_s: float) -> float:
        """Begin copying ``num_blocks`` blocks from ``start_block`` to the GPU; return its end."""
        hashes = request.block_hashes[start_block:start_block + num_blocks]
        blocks = self._blocks
        being = self._being_loaded
        for block_hash in hashes:
            blocks[block_hash] += 1
            being[block_hash] = being.get(block_hash, 0) + 1
        duration = len(hashes) * self.block_bytes / self.host_link_bytes_per_s
        begin = max(now_s, self._h2d_free_s)
        self._h2d_free_s = done = begin + duration
        self._loads.append(_Transfer(done, duration, hashes, request))
        request.num_offloaded_blocks = start_block + num_blocks
        return done

    # ------------------------------------------------------------ store

    def store(self, scheduled: Sequence[tuple[Any, int]], start_s: float) -> None:
        """Prepare the stores of one step's newly full blocks (vLLM ``_get_reqs_to_store``).

        ``scheduled``: ``(request, num_new_tokens)`` with ``request.num_computed_tokens``
        as before the step; the copies start at ``start_s`` (the next step's start).
        """
        size = self.block_size
        for request, num_new in scheduled:
            num_blocks = min((request.num_computed_tokens + num_new) // size,
                             len(request.block_hashes))
            start = request.num_offloaded_blocks
            if num_blocks <= start:
                continue
            hashes = request.block_hashes
            to_store = self._prepare_store(hashes[start:num_blocks])
            if to_store is None:
                continue  # the pool is pinned by loads: retried next step, as vLLM does
            request.num_offloaded_blocks = num_blocks
            if not to_store:
                continue
            self.touch(hashes[:num_blocks])
            duration = len(to_store) * self.block_bytes / self.host_link_bytes_per_s
            begin = max(start_s, self._d2h_free_s)
            self._d2h_free_s = done = begin + duration
            self._stores.append(_Transfer(done, duration, to_store))

    def _prepare_store(self, block_hashes: Sequence[bytes]) -> list[bytes] | None:
        blocks = self._blocks
        new = [h for h in block_hashes if h not in blocks]
        if len(set(new)) != len(new):
            new = list(dict.fromkeys(new))
        num_to_evict = len(new) - (self.num_blocks - len(blocks))
        victims: list[bytes] = []
        if num_to_evict > 0:
            for block_hash, state in blocks.items():
                if state == 0:
                    victims.append(block_hash)
                    if len(victims) == num_to_evict:
                        break
            else:
                return None
            for block_hash in victims:
                del blocks[block_hash]
            if self.enable_events:
                self._events.append(OffloadRemoved(victims))
        for block_hash in new:
            blocks[block_hash] = STORING
        return new

    # ------------------------------------------------------------ time

    def advance(self, now_s: float) -> list[Any]:
        """Finish the transfers that ended by ``now_s``; return the requests whose loads did."""
        now_s += TIME_EPS_S
        blocks = self._blocks
        stats = self.stats
        for job in _ended(self._stores, now_s):
            stats.store_bytes += len(job.block_hashes) * self.block_bytes
            stats.store_s += job.duration_s
            ready = []
            for block_hash in job.block_hashes:
                if blocks.get(block_hash) == STORING:
                    blocks[block_hash] = 0
                    ready.append(block_hash)
            if ready and self.enable_events:
                self._events.append(OffloadStored(ready))
        done: list[Any] = []
        being = self._being_loaded
        for job in _ended(self._loads, now_s):
            stats.load_bytes += len(job.block_hashes) * self.block_bytes
            stats.load_s += job.duration_s
            for block_hash in job.block_hashes:
                blocks[block_hash] -= 1
                left = being[block_hash] - 1
                if left:
                    being[block_hash] = left
                else:
                    del being[block_hash]
            done.append(job.request)
        return done

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events


def _ended(transfers: deque[_Transfer], now_s: float) -> Iterator[_Transfer]:
    """Take the transfers that ended by ``now_s`` off the front of ``transfers`` (``done_s``
    ascending: one link, one transfer at a time), in order."""
    while transfers and transfers[0].done_s <= now_s:
        yield transfers.popleft()


def num_cpu_blocks(size_gib: float, block_bytes: int) -> int:
    """Host blocks of ``--kv-offloading-size`` (GiB, vLLM: ``size * 2**30`` bytes per rank)."""
    return int(size_gib * (1 << 30) // block_bytes)
