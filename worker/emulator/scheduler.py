"""Continuous-batching scheduler of the engine emulator (vLLM v1 semantics). Pure: no I/O, no clock.

Modelled on vLLM 0.33 ``vllm/v1/core/sched/scheduler.py`` (FCFS policy):

* each step has a token budget (``max_num_batched_tokens``); running requests
  are served first (one token each in decode, a chunk of the remaining prompt in
  prefill: chunked prefill), then waiting requests are admitted in arrival order
  while the budget, ``max_num_seqs`` and free blocks allow;
* a waiting request is admitted only if blocks for all its tokens are free, not
  only for its first chunk (vLLM ``scheduler_reserve_full_isl``, on by default;
  prefix hits count, free-but-cached blocks are free); otherwise it and
  everything behind it wait;
* when a running request cannot get a block, the lowest-priority running request
  (the last admitted) is preempted by recompute: its blocks are freed, its
  computed tokens forgotten and it goes back to the head of the waiting queue;
* a step that finishes a request's prompt (or decodes) samples one token per request.

The caller drives it: ``schedule()`` returns a ``Step`` with its duration in
engine seconds (from ``LatencyModel``); after that much time, ``complete(step)``
applies it. A step made only of decodes may be repeated ``max_repeat`` times
in one go (blocks for all repeats are allocated up front) so the caller can
sleep once per burst of decode steps instead of once per token; it may apply
fewer repeats (``complete(step, repeats)``) when a new request arrives.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from worker.emulator.kv_cache import KVCacheBlock, KVCacheManager
from worker.emulator.offload import CpuOffload
from worker.emulator.profiles import LatencyModel

# vLLM's OpenAI-server defaults on a GPU of at least 70 GB that is not an A100, the emulator's
# H100-class profile (vllm/engine/arg_utils.py get_batch_defaults; 2048 and 256 below 70 GB,
# 2048 and 128 on a CPU)
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = 8192  # tokens per step
DEFAULT_MAX_NUM_SEQS: Final = 1024  # running requests
OUTPUT_TOKEN_BASE: Final = 1000  # generated token i is OUTPUT_TOKEN_BASE + i % OUTPUT_TOKEN_PERIOD
OUTPUT_TOKEN_PERIOD: Final = 1000


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


def output_token_id(index: int) -> int:
    """The deterministic token the emulator 'samples' as output number ``index`` (0-based).

    Identical prompts therefore produce identical outputs (as greedy decoding
    would), so output blocks hash identically too.
    """
    return OUTPUT_TOKEN_BASE + index % OUTPUT_TOKEN_PERIOD


@dataclass(eq=False, slots=True)
class Request:
    """One sequence in the engine. ``all_token_ids`` = prompt + generated tokens.

    ``max_output_tokens`` >= 1 is where it stops (``max_tokens``, or the emulated
    EOS point); ``finish_reason_at_limit`` says which.
    """

    request_id: str
    all_token_ids: list[int]
    max_output_tokens: int
    finish_reason_at_limit: FinishReason = FinishReason.LENGTH
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-hit tokens at first scheduling; -1 before
    num_preemptions: int = 0
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_offloaded_blocks: int = 0  # blocks from 0 already handed to the CPU tier
    finished: FinishReason | None = None
    sink: Any = None  # whatever the caller attaches to route outputs back

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request got from an applied step: ``num_new_tokens`` generated tokens
    (0 for a prefill chunk that did not finish the prompt), and ``finished`` if it ended."""

    request: Request
    num_new_tokens: int
    finished: FinishReason | None


@dataclass(slots=True)
class Step:
    """A scheduled step. ``scheduled``: ``(request, num_new_tokens)`` in schedule order;
    ``durations_s``: engine seconds of each repeat (one entry unless decode-only)."""

    scheduled: list[tuple[Request, int]]
    durations_s: list[float]
    num_preempted: int = 0

    @property
    def max_repeat(self) -> int:
        return len(self.durations_s)

    @property
    def duration_s(self) -> float:
        return sum(self.durations_s)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_decode_burst_s: float = 0.05  # engine seconds a decode-only burst may span

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


HashFn = Callable[[Request], None]  # extends request.block_hashes to its full blocks


class Scheduler:
    """FCFS continuous batching over a ``KVCacheManager``; see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        latency: LatencyModel,
        update_block_hashes: HashFn,
        offload: CpuOffload | None = None,
    ) -> None:
        self.config = config
        self.offload = offload  # the CPU tier (vLLM native offloading), None when off
        self.kv = kv
        self.latency = latency
        self._update_hashes = update_block_hashes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request; its prompt must already be hashed (``block_hashes``)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Requests waiting, running or loading from the CPU tier."""
        return bool(self.waiting or self.running) or (
            self.offload is not None and self.offload.has_pending_loads())

    def abort(self, request: Request) -> None:
        """Drop a request (client went away), freeing its blocks."""
        if request.finished is not None:
            return
        request.finished = FinishReason.ABORT
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass

    def schedule(self, now_s: float = 0.0) -> Step | None:
        """Build the next step, starting at engine time ``now_s``, allocating its blocks;
        None if nothing can run (with the CPU tier: also while every request waits for a load).
        """
        offload = self.offload
        if offload is not None:
            self._finish_transfers(now_s)
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        num_preempted = 0
        kv = self.kv
        running = self.running
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            while not kv.allocate_slots(request, num_new):
                victim = running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                if victim is request:
                    num_new = 0
                    break
            if num_new == 0:
                break
            scheduled[request] = num_new
            budget -= num_new
            index += 1
        if not num_preempted:
            self._admit(scheduled, budget, now_s)
        if not scheduled:
            return None
        step = Step(list(scheduled.items()), [], num_preempted)
        self._plan_durations(step, now_s)
        if offload is not None:
            offload.store(step.scheduled, now_s + step.durations_s[0])
        return step

    def _finish_transfers(self, now_s: float) -> None:
        """Apply the CPU-tier transfers that ended by ``now_s``: a request whose load ended
        gets its loaded blocks committed to the GPU prefix cache and rejoins the head of the
        queue with them computed (vLLM ``_update_waiting_for_remote_kv``; a full hit still
        recomputes the last token)."""
        assert self.offload is not None
        loaded = self.offload.advance(now_s)
        if not loaded:
            return
        size = self.kv.block_size
        ready: list[Request] = []
        for request in loaded:
            if request.finished is not None:  # aborted while loading
                self.kv.free(request)
                continue
            num_full = len(request.blocks)
            self.kv.pool.cache_full_blocks(request, num_full, size)
            num_computed = min(num_full * size, request.num_tokens)
            if num_computed == request.num_tokens:
                num_computed -= 1
            request.num_computed_tokens = num_computed
            ready.append(request)
        self.waiting.extendleft(reversed(ready))

    def _admit(self, scheduled: dict[Request, int], budget: int, now_s: float) -> None:
        kv = self.kv
        waiting = self.waiting
        offload = self.offload
        deferred: list[Request] = []
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = waiting[0]
            if request.num_computed_tokens:  # its CPU-tier load ended: no second lookup
                num_hit = request.num_computed_tokens
                num_new = min(request.num_tokens - num_hit, budget)
                if not kv.allocate_slots(request, num_new, full_sequence_must_fit=True):
                    break
                waiting.popleft()
            else:
                hits, num_hit = kv.get_computed_blocks(request)
                if offload is not None and kv.enable_caching:
                    num_external = offload.match(request, num_hit, request.num_tokens)
                    if num_external is None:  # deferred, as vLLM skips it this step
                        deferred.append(waiting.popleft())
                        continue
                    if num_external:
                        if not kv.allocate_slots(request, num_external, hits, cache=False,
                                                 full_sequence_must_fit=True):
                            break
                        waiting.popleft()
                        kv.record_lookup(request.num_tokens, num_hit, request.num_preemptions > 0)
                        offload.record(request.num_tokens, num_hit, num_external,
                                       request.num_preemptions > 0)
                        offload.start_load(request, num_hit // kv.block_size,
                                           num_external // kv.block_size, now_s)
                        continue
                num_new = min(request.num_tokens - num_hit, budget)
                if not kv.allocate_slots(request, num_new, hits, full_sequence_must_fit=True):
                    break
                waiting.popleft()
                kv.record_lookup(request.num_tokens, num_hit, request.num_preemptions > 0)
                if offload is not None and kv.enable_caching:
                    offload.record(request.num_tokens, num_hit, 0, request.num_preemptions > 0)
                request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new
        if deferred:
            waiting.extendleft(reversed(deferred))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _plan_durations(self, step: Step, now_s: float) -> None:
        prefills: list[tuple[int, int]] = []
        num_decodes = 0
        decode_ctx = 0
        for request, num_new in step.scheduled:
            if num_new == 1 and request.num_computed_tokens == request.num_tokens - 1 and (
                request.num_output_tokens > 0
            ):
                num_decodes += 1
                decode_ctx += request.num_computed_tokens
            else:
                prefills.append((num_new, request.num_computed_tokens))
        first = self.latency.step_time_s(prefills, num_decodes, decode_ctx)
        step.durations_s.append(first)
        if prefills or step.num_preempted:
            # A waiting request that was not admitted now stays blocked until a request
            # finishes (blocks, max_num_seqs), and a burst ends at the first finish.
            return
        # Decode-only: extend to a burst of identical steps, up to the first finish,
        # within max_decode_burst_s, while blocks for the extra tokens can be allocated; and
        # with a CPU-tier load under way, up to the step in which it ends: vLLM looks for
        # finished loads at every schedule(), so the request waiting for it joins the next step.
        remaining = min(r.max_output_tokens - r.num_output_tokens for r, _ in step.scheduled)
        limit_s = self.config.max_decode_burst_s
        load_done_s = self.offload.next_load_done_s() if self.offload is not None else None
        if load_done_s is not None:
            limit_s = min(limit_s, load_done_s - now_s)
        step.durations_s = self.latency.decode_burst_durations_s(num_decodes, decode_ctx, first,
                                                                 remaining, limit_s)
        repeats = len(step.durations_s)
        if repeats > 1:
            # complete() allocates each later step's slots as vLLM's schedule() would, step by
            # step; blocks for all of them must be free now (nothing is freed mid-burst).
            size = self.kv.block_size
            needed = sum(max(0, -(-(r.num_computed_tokens + repeats) // size) - len(r.blocks))
                         for r, _ in step.scheduled)
            if needed > self.kv.pool.num_free_blocks:
                del step.durations_s[1:]

    def complete(self, step: Step, repeats: int | None = None) -> list[RequestOutput]:
        """Apply ``repeats`` (default all) of ``step``'s repeats; return what each request got.

        Finished requests leave ``running`` and free their blocks (tail first).
        Requests aborted since ``schedule()`` are skipped.
        """
        repeats = step.max_repeat if repeats is None else max(1, min(repeats, step.max_repeat))
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        burst: list[tuple[Request, int]] = []  # (request, its tokens before this step)
        for request, num_new in step.scheduled:
            if request.finished is not None:
                continue
            if repeats == 1:
                request.num_computed_tokens += num_new
                if request.num_computed_tokens < request.num_tokens:
                    outputs.append(RequestOutput(request, 0, None))
                    continue
            start = request.num_output_tokens
            produced = min(repeats, request.max_output_tokens - start)
            if produced > 1:
                burst.append((request, request.num_tokens))
            request.all_token_ids.extend([OUTPUT_TOKEN_BASE + i % OUTPUT_TOKEN_PERIOD
                                          for i in range(start, start + produced)])
            request.num_computed_tokens = request.num_tokens - 1
            self._update_hashes(request)
            if request.num_output_tokens >= request.max_output_tokens:
                request.finished = request.finish_reason_at_limit
                finished.append(request)
            outputs.append(RequestOutput(request, produced, request.finished))
        if burst:
            self._allocate_burst(burst, repeats)
        if finished:
            done = set(finished)
            self.running = [r for r in self.running if r not in done]
            for request in finished:
                self.kv.free(request)
        return outputs

    def _allocate_burst(self, burst: list[tuple[Request, int]], repeats: int) -> None:
        """Allocate and commit the blocks of a decode burst's steps 2..``repeats`` in vLLM's
        order: step by step, request by request within a step (each step's ``schedule()`` calls
        ``allocate_slots`` for one token per running request, which takes a new block, evicting,
        when the token starts one and commits the blocks full up to it). ``burst``: each
        request with its tokens before the burst; their output tokens are appended already,
        and ``_plan_durations`` made sure the blocks are free.

        Only the calls with work are made (``next_work_total``: about two in a block's worth of
        steps), in that same order, from a heap of (step, position in the burst); the others
        would change nothing, and making them cost a call per request per step."""
        kv = self.kv
        heap: list[tuple[int, int]] = []
        for position, (request, num_before) in enumerate(burst):
            # step r of the burst brings the request to num_before + r tokens
            r = max(1, kv.next_work_total(request) - num_before)
            if r < repeats:
                heap.append((r, position))
        heapq.heapify(heap)
        while heap:
            r, position = heap[0]
            request, num_before = burst[position]
            request.num_computed_tokens = num_before + r - 1
            allocated = kv.allocate_slots(request, 1)
            assert allocated, "a decode burst's blocks were free when it was planned"
            r = max(r + 1, kv.next_work_total(request) - num_before)
            if r < repeats:
                heapq.heapreplace(heap, (r, position))
            else:
                heapq.heappop(heap)
        for request, _ in burst:
            request.num_computed_tokens = request.num_tokens - 1
