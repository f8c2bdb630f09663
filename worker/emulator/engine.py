"""The emulated engine of one replica: KV block pool, scheduler, CPU tier, KV-event publisher
and the engine loop on its own clock. Does no HTTP; ``worker.emulator.openai_server`` is its
OpenAI front end, as vLLM's ``AsyncLLM`` is behind its API server.

The engine loop runs scheduler steps and sleeps for each step's duration (engine seconds divided
by ``--time-scale``); an idle engine waits on a future, so an idle fleet costs no CPU. Its
collaborators: ``outputs`` hands each step's outputs to the requests, ``step_events`` publishes
each step's KV events.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from router.shared.hashing import BlockHasher
from worker.emulator.config import DEFAULT_STREAM_INTERVAL_S, EmulatorConfig
from worker.emulator.kv_cache import BlockPool, KVCacheManager
from worker.emulator.metrics import ReplicaMetrics
from worker.emulator.offload import CpuOffload
from worker.emulator.outputs import OutputCollector, OutputDelivery, Sink
from worker.emulator.profiles import LatencyModel
from worker.emulator.scheduler import (
    FinishReason,
    Request,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    Step,
)
from worker.emulator.step_events import StepEvents, engine_publisher

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SubmittedPrompt:
    """One prompt as the front end validated it: token ids and its output-token limit."""

    token_ids: list[int]
    max_output_tokens: int


class EmulatedEngine:
    """One emulated vLLM engine: block pool, cache manager, scheduler, CPU tier, publisher and
    the engine task. ``start()`` opens the publisher and starts the loop; ``stop()`` ends both.

    ``dp_rank``: this engine's data-parallel rank within replica ``index`` (vLLM: one EngineCore
    per DP rank behind one API server); it labels the metrics ``engine="<rank>"``, tags every
    ``KVEventBatch`` with ``data_parallel_rank`` and offsets the publisher's port.
    """

    def __init__(self, index: int, config: EmulatorConfig, hasher: BlockHasher,
                 zmq_ctx: zmq.Context[Any], dp_rank: int = 0) -> None:
        self.index = index
        self.dp_rank = dp_rank
        self.config = config
        self.hasher = hasher
        self.pool = BlockPool(config.num_gpu_blocks,
                              enable_kv_cache_events=config.kv_events.enabled)
        self.kv = KVCacheManager(self.pool, config.block_size,
                                 enable_caching=config.enable_prefix_caching)
        self.latency = LatencyModel(config.model_profile, config.gpu_profile,
                                    config.step_overhead_s)
        self.offload: CpuOffload | None = None
        if config.num_cpu_blocks:
            self.offload = CpuOffload(
                config.num_cpu_blocks, config.block_size,
                config.model_profile.kv_bytes_per_token * config.block_size,
                config.gpu_profile.host_link_gbps * 1e9,
                max_concurrent_loads=config.max_num_seqs,
                enable_events=config.kv_events.enabled)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            max_decode_burst_s=DEFAULT_STREAM_INTERVAL_S * config.time_scale),
            self.kv, self.latency, self._update_hashes, self.offload)
        self.lora_ids = {name: i + 1 for i, (name, _) in enumerate(config.lora_modules)}
        self.lora_paths = dict(config.lora_modules)
        self.metrics = ReplicaMetrics(
            config.model_name,
            {"block_size": str(config.block_size),
             "prefix_caching_hash_algo": config.hash_algo,
             "num_gpu_blocks": str(config.num_gpu_blocks),
             "enable_prefix_caching": str(config.enable_prefix_caching),
             "cache_dtype": "auto",
             "gpu_memory_utilization": "0.9",
             "engine": str(dp_rank)},
            self.num_running,
            self.num_waiting,
            lambda: self.pool.usage,
        )
        if config.lora_modules:  # vLLM exports it with LoRA on
            self.metrics.enable_lora_info(config.max_loras, self.lora_adapters)
        offload = self.offload
        self.publisher = engine_publisher(config, index, dp_rank, zmq_ctx)
        self.step_events = StepEvents(
            self.pool, offload,
            self.metrics.enable_offload(lambda: offload.usage) if offload is not None else None,
            self.publisher)
        self.outputs = OutputDelivery(self.kv, self.metrics, config.time_scale)
        self._waiter: asyncio.Future[None] | None = None
        # Requests that arrived (loop time) but are not yet the scheduler's, because the engine
        # clock has not reached their arrival (see _engine_loop).
        self._arrivals: deque[tuple[float, Request]] = deque()
        self.clock = 0.0  # engine time in loop-time seconds; set when the engine starts
        self._engine_task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- engine

    def num_running(self) -> int:
        """Requests in the running batch (``vllm:num_requests_running``)."""
        return len(self.scheduler.running)

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """LoRA adapter names of the running and of the waiting requests, each name once in
        first-seen order (vLLM 0.32 ``SchedulerStats.running_lora_adapters`` /
        ``waiting_lora_adapters``, ``v1/metrics/stats.py``)."""
        waiting = [*self.scheduler.waiting, *(request for _, request in self._arrivals)]
        return ([*dict.fromkeys(r.lora_name for r in self.scheduler.running if r.lora_name)],
                [*dict.fromkeys(r.lora_name for r in waiting if r.lora_name)])

    def num_waiting(self) -> int:
        """Requests queued, arrived or not yet admitted (``vllm:num_requests_waiting``)."""
        return len(self.scheduler.waiting) + len(self._arrivals)

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        if len(request.all_token_ids) // self.config.block_size <= len(hashes):
            return
        lora = None
        if request.lora_name is not None:
            lora = (request.lora_name, self.lora_paths[request.lora_name])
        hashes.extend(self.hasher.digests(
            request.all_token_ids, lora=lora, cache_salt=request.cache_salt,
            parent=hashes[-1] if hashes else None, start_block=len(hashes)))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep_until(self, deadline: float | None, interruptible: bool) -> None:
        loop = asyncio.get_running_loop()
        if deadline is not None and deadline <= loop.time():
            # Behind schedule: no sleep, but still yield once, so HTTP handlers (deliveries,
            # new arrivals) run between the steps the engine runs back to back to catch up.
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = loop.create_future()
        handle = None
        if deadline is not None:
            handle = loop.call_at(deadline, _resolve, fut)
        if interruptible:
            self._waiter = fut
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            if self._waiter is fut:
                self._waiter = None

    def _admit_arrivals(self, clock: float) -> None:
        """Hand the scheduler the requests that had arrived by engine time ``clock``.

        A request that arrived after the engine's current step started (in engine time) must
        not join it, even when the process runs that step late: the emulated GPU would not
        have seen it yet.
        """
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= clock:
            _, request = arrivals.popleft()
            if request.finished is None:  # aborted while it waited here
                self.scheduler.add_request(request)

    async def _engine_loop(self) -> None:
        """Run the engine on its own clock (``self.clock``, loop-time seconds).

        A step of ``d`` engine seconds ends ``d / time_scale`` after it started on that clock,
        not after the process got around to it: when the host keeps the process from running
        (a busy machine, SIGSTOP), the steps that fell due meanwhile run back to back until the
        clock has caught up with wall time, so the emulated GPU's capacity is never lost, only
        its outputs are delivered late. How late each step started is the lag
        (``emulator_engine_lag_seconds``); idle time is skipped, not caught up.
        """
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        scale = self.config.time_scale
        self.clock = loop.time()
        while True:
            try:
                self._admit_arrivals(self.clock)
                if not scheduler.has_work():
                    if self._arrivals:  # idle until the next arrival, in engine time
                        self.clock = max(self.clock, self._arrivals[0][0])
                        continue
                    if self.offload is not None and self.offload.next_done_s() is not None:
                        await self._await_transfer()  # CPU-tier stores still copying
                        continue
                    await self._sleep_until(None, interruptible=True)
                    self.clock = max(self.clock, loop.time())
                    continue
                step = scheduler.schedule(self.clock * scale)
                if step is None and self.offload is not None and self.offload.has_pending_loads():
                    await self._await_transfer()  # every request waits for a CPU-tier load
                    continue
                if step is None:
                    # Nothing fits even in an empty pool (cannot happen within max_model_len).
                    request = scheduler.waiting.popleft()
                    request.finished = FinishReason.ABORT
                    self.outputs.deliver([RequestOutput(request, 0, FinishReason.ABORT)],
                                         self.clock)
                    continue
                self.metrics.observe_lag(loop.time() - self.clock)
                end, repeats = await self._run_step(step)
                self.clock = end
                outputs = scheduler.complete(step, repeats)
                self.step_events.publish()
                if step.num_preempted:
                    self.metrics.num_preemptions.inc(step.num_preempted)
                self.outputs.deliver(outputs, end)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica %d: engine step failed", self.index)
                await asyncio.sleep(0.01)

    async def _run_step(self, step: Step) -> tuple[float, int]:
        """Sleep through ``step`` from the engine clock on; returns the engine time it ends at
        and how many of its repeats (a decode burst) ran."""
        scale = self.config.time_scale
        start = self.clock
        if step.max_repeat == 1:
            end = start + step.durations_s[0] / scale
            await self._sleep_until(end, interruptible=False)
            return end, 1
        ends: list[float] = []
        t = start
        for d in step.durations_s:
            t += d / scale
            ends.append(t)
        if not self._arrivals:  # only an arrival (``submit``) wakes the sleep
            await self._sleep_until(ends[-1], interruptible=True)
        repeats = len(ends)
        if self._arrivals:
            # A request arrived (it woke the burst, or it came after the burst's start in
            # engine time but before the loop got to sleep, when its wake-up found no waiter):
            # vLLM takes new requests between any two steps, so the burst ends with the step
            # under way when it arrived and the newcomer joins the next one. Ending it at the
            # steps done by the wake-up instead left the arrival after the engine clock; the
            # next burst then kept it waiting a whole stream interval.
            repeats = min(bisect.bisect_left(ends, self._arrivals[0][0]) + 1, repeats)
            await self._sleep_until(ends[repeats - 1], interruptible=False)
        return ends[repeats - 1], repeats

    async def _await_transfer(self) -> None:
        """Idle until the CPU tier's next transfer ends (engine time skips there, as it skips
        idle time to an arrival) or a request arrives; then apply what ended by then."""
        assert self.offload is not None
        done_s = self.offload.next_done_s()
        assert done_s is not None
        scale = self.config.time_scale
        target = done_s / scale
        await self._sleep_until(target, interruptible=True)
        self.clock = max(self.clock, min(target, asyncio.get_running_loop().time()))
        if not self.offload.has_pending_loads():  # only stores: schedule() would not run
            self.offload.advance(self.clock * scale)
            self.step_events.publish()

    # ---------------------------------------------------------------- requests

    def submit(self, prompts: list[SubmittedPrompt], *, n: int, finish_at_limit: FinishReason,
               lora: str | None, cache_salt: str | None,
               request_id: str) -> tuple[OutputCollector, list[Request]]:
        """Queue ``n`` sequences per prompt, arriving now; returns their collector and requests
        in choice order (choice ``p * n + j``). The block hashes are computed once per prompt.
        """
        collector = OutputCollector(arrival=asyncio.get_running_loop().time())
        lora_path = self.lora_paths[lora] if lora else None
        lora_key = (lora, lora_path) if lora and lora_path else None
        lora_id = self.lora_ids.get(lora) if lora else None
        requests: list[Request] = []
        for p_index, prompt in enumerate(prompts):
            hashes = self.hasher.digests(prompt.token_ids, lora=lora_key, cache_salt=cache_salt)
            for j in range(n):
                index = p_index * n + j
                request = Request(
                    request_id=f"{request_id}-{index}", all_token_ids=list(prompt.token_ids),
                    max_output_tokens=prompt.max_output_tokens,
                    finish_reason_at_limit=finish_at_limit, lora_id=lora_id, lora_name=lora,
                    cache_salt=cache_salt, block_hashes=list(hashes))
                request.sink = Sink(collector, index)
                requests.append(request)
                self._arrivals.append((collector.arrival, request))
        self._wake()
        return collector, requests

    def abort(self, requests: list[Request]) -> None:
        """Abort every request of ``requests`` that has not finished (a gone client)."""
        for request in requests:
            if request.finished is None:
                self.scheduler.abort(request)

    def reset_prefix_cache(self) -> bool:
        """vLLM ``reset_prefix_cache``: False (nothing done) while requests hold blocks. The
        ``AllBlocksCleared`` stays queued with the pool's events and goes out with the next
        step's batch, before that step's stores: vLLM 0.32 publishes a step's events after the
        step (``Scheduler.update_from_output`` takes the block pool's queue), so nothing is
        published while the engine stays idle."""
        return self.kv.reset_prefix_cache()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self._engine_task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def stop(self) -> None:
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
        if self.publisher is not None:
            self.publisher.close()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
