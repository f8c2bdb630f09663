"""Real vLLM CPU engines as the replicas of a benchmark fleet (``prefix-loadtest compare
--engine vllm``): started once, in parallel, and shared by every run of a comparison, their
prefix caches emptied before each run so that no run inherits another's cache. Does process,
network and file I/O.

An engine is vLLM's CPU build serving the tiny Qwen3 model with random weights
(``loadtest.harness.vllm_engine``): its tokenizer, prefix cache, KV events and ``vllm:*`` counters are
vLLM's own, so hit rates per policy are real engines' hit rates; its latencies are those of a
CPU sharing the machine's cores with the router, workers and replayer, not a GPU's.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from loadtest.harness.fleet import ReplicaInfo
from loadtest.harness.vllm_engine import (
    BLOCK_SIZE,
    MODEL_NAME,
    TINY_QWEN3_CONFIG,
    VllmEngine,
    make_model_dir,
    reset_prefix_cache,
    start_vllm_engines,
    unavailable_reason,
)

logger = logging.getLogger(__name__)

ENGINE_BYTES: Final = 4.0e9  # RSS of one engine over its three processes (3.7 GB measured)
HASH_SEED: Final = "0"  # the engines' PYTHONHASHSEED, so workers and router use it too
# bound on each start-up wait of a run's workers and router, the hash probes included: a probe
# request runs on a CPU engine sharing two cores
ENGINE_FLEET_START_TIMEOUT_S: Final = 300.0
# The router's first-byte deadline follows its TTFT model of a GPU replica (floor 5 s): a CPU
# engine prefilling thousands of tokens on two busy cores takes longer and would be benched as
# hung (seen: every request of a run 502 "replica engine-1: hung"). Slow is not hung here.
# the replay's wait for requests still running after its last send (120 s by default): a CPU
# engine's queue of long prompts takes many minutes to drain on a busy machine
DRAIN_TIMEOUT_S: Final = 1800.0
ROUTER_ARGS: Final = ("--first-byte-deadline-floor-s", "900", "--first-byte-timeout-s", "900",
                      "--stall-timeout-s", "900")
CPU_TTFT_NOTE: Final = (
    "these replicas are vLLM CPU engines (a tiny random-weight Qwen3 on this machine's cores, "
    "shared with the router, workers and replayer): their prefix-cache hit rates are real "
    "engines' own counters, but their TTFT and e2e latencies are CPU latencies, not GPU TTFT; "
    "compare policies by hit rate, not by latency")


def max_model_len(num_gpu_blocks: int | None) -> int:
    """The longest request (prompt plus output, tokens) an engine of ``num_gpu_blocks`` blocks
    serves: ``start_vllm_engine``'s ``--max-model-len`` (vLLM keeps block 0 as its null block),
    at most the model's 32,768."""
    longest = int(TINY_QWEN3_CONFIG["max_position_embeddings"])
    return longest if num_gpu_blocks is None else min(longest, (num_gpu_blocks - 1) * BLOCK_SIZE)


def engines_that_fit(available_bytes: float) -> int:
    """How many engines ``available_bytes`` of free memory holds, leaving 2 GB for the rest."""
    return max(0, int((available_bytes - 2e9) // ENGINE_BYTES))


@dataclass
class EngineReplicas:
    """Running engines as a fleet's replicas: ``replicas`` (``engine-<i>``), their process leaders'
    ``pids``, the model directory (the router's ``--tokenizer``), each engine's ``max_model_len``
    (tokens) and its command line."""

    engines: list[VllmEngine]
    model_dir: Path

    @property
    def replicas(self) -> tuple[ReplicaInfo, ...]:
        return tuple(ReplicaInfo(i, f"engine-{i}", e.url, e.kv_events_endpoint,
                                 e.kv_replay_endpoint) for i, e in enumerate(self.engines))

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(e.proc.pid for e in self.engines)

    @property
    def max_model_len(self) -> int:
        return max_model_len(self.engines[0].num_gpu_blocks)

    def reset(self) -> None:
        """Empty every engine's prefix cache (``reset_prefix_cache``); raises ``TimeoutError``
        when one keeps refusing."""
        for engine in self.engines:
            reset_prefix_cache(engine)

    def describe(self) -> dict[str, Any]:
        """For results.json: what the replicas were."""
        return {"engine": "vllm", "model": MODEL_NAME, "block_size": BLOCK_SIZE,
                "max_model_len": self.max_model_len,
                "args": [e.args[1:] for e in self.engines[:1]]}


@contextlib.contextmanager
def started_engines(count: int, num_gpu_blocks: int | None = None, log_dir: Path | None = None,
                 progress: Callable[[str], None] = lambda line: None,
                 extra_args: Sequence[str] = ()) -> Iterator[EngineReplicas]:
    """``count`` engines started in parallel (block size 32, sha256, PYTHONHASHSEED 0, KV
    events on ipc sockets; ``num_gpu_blocks`` per engine, default what 1 GiB of KV cache holds),
    stopped after the ``with`` block. Raises ``RuntimeError`` where the build cannot run
    (``unavailable_reason``), or the first engine's start failure."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-") as tmp:
        model_dir = make_model_dir(Path(tmp) / "tiny-qwen3")
        progress(f"starting {count} vLLM CPU engines in parallel (minutes on a busy machine)")
        engines = start_vllm_engines(model_dir, count, num_gpu_blocks=num_gpu_blocks,
                                     hash_seed=HASH_SEED, extra_args=extra_args)
        fleet = EngineReplicas(engines, model_dir)
        try:
            progress("engines ready: " + ", ".join(e.url for e in engines))
            yield fleet
        finally:
            for i, engine in enumerate(engines):
                text = engine.stop()
                if log_dir is not None:
                    log_dir.mkdir(parents=True, exist_ok=True)
                    (log_dir / f"engine-{i}.log").write_text(text)
