"""Process and CLI of the engine emulator (``prefix-worker emulate``). Does I/O.

One process, one uvloop event loop, K replicas. Each replica is ``--data-parallel-size`` N
:class:`EmulatedEngine` s (DP ranks, each with its own KV block pool, scheduler, Prometheus
registry, KV-event publisher and engine task, ``worker.emulator.engine``) behind one
:class:`ReplicaServer` (its own aiohttp application on ``port + i``,
``worker.emulator.openai_server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import zmq

from router.shared.hashing import BlockHasher, HashConfigError
from router.shared.process import loop_factory, write_json_atomic
from worker.emulator.config import ConfigError, EmulatorConfig, from_args
from worker.emulator.engine import EmulatedEngine
from worker.emulator.openai_server import ReplicaServer
from worker.emulator.publisher import PublisherError
from worker.emulator.tokenizer import SharedTokenizer, TokenizerError

logger = logging.getLogger(__name__)


def make_hasher(config: EmulatorConfig) -> BlockHasher:
    if config.hash_seed_is_random:
        logger.warning(
            "PYTHONHASHSEED is not set: using a random NONE_HASH seed for %s, as vLLM does; "
            "no router can reproduce these block hashes. Set PYTHONHASHSEED on engines and router.",
            config.hash_algo)
    # The seed string is resolved already; BlockHasher takes it as PYTHONHASHSEED would.
    return BlockHasher(config.block_size, config.hash_algo, config.hash_seed)


class Emulator:
    """K replicas in this process; ``start()`` listens, ``stop()`` shuts down."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.hasher = make_hasher(config)
        self.tokenizer = SharedTokenizer(config.tokenizer)
        self.zmq_ctx: zmq.Context[Any] = zmq.Context()
        self.replicas = [
            ReplicaServer([EmulatedEngine(i, config, self.hasher, self.zmq_ctx, dp_rank=rank)
                           for rank in range(config.data_parallel_size)], self.tokenizer)
            for i in range(config.replicas)]

    async def start(self) -> None:
        # vLLM loads its tokenizer before its server answers /health; a lazy load on the first
        # text prompt (transformers' import plus the load, several seconds on a busy machine)
        # outlasted the router's first-byte deadline floor and got every replica benched.
        await self.tokenizer.get()
        for replica in self.replicas:
            port = self.config.port + replica.index if self.config.port else 0
            await replica.start(port)
        if self.config.ready_file:
            write_json_atomic(self.config.ready_file, {"replicas": [r.describe() for r in self.replicas]})
        logger.info("emulator ready: %s", json.dumps([r.describe() for r in self.replicas]))

    async def stop(self) -> None:
        for replica in self.replicas:
            await replica.stop()
        self.zmq_ctx.term()


async def _serve(config: EmulatorConfig) -> int:
    emulator = Emulator(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await emulator.start()
    except (OSError, PublisherError, ConfigError, TokenizerError) as exc:
        logger.error("emulator failed to start: %s", exc)
        await emulator.stop()
        return 1
    # The block pools (num_gpu_blocks objects per replica) live as long as the process: keep
    # the cyclic garbage collector from walking them in every full collection.
    gc.collect()
    gc.freeze()
    await stop.wait()
    logger.info("emulator shutting down")
    await emulator.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-worker emulate``; returns the exit code."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = from_args(argv)
    except (ConfigError, HashConfigError) as exc:
        print(f"prefix-worker emulate: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profile_path = os.environ.get("PREFIX_EMULATOR_PROFILE")
    if profile_path:
        # A deterministic CPU profile of the emulator's event loop, written at shutdown; for
        # finding the emulator's own costs (wall-clock samplers mislead on a busy machine).
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU of the event-loop thread
        profiler.enable()
        try:
            return _run(config)
        finally:
            profiler.disable()
            profiler.dump_stats(profile_path)
    return _run(config)


def _run(config: EmulatorConfig) -> int:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(_serve(config))

