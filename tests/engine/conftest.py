"""Real-engine tests: vLLM's CPU build (the ``vllm`` extra) serving the tiny Qwen3 model with
random weights, beside real workers, Redis and routers on loopback.

They skip, with the reason, where the build cannot run (``loadtest.vllm_engine.
unavailable_reason``: not x86-64 Linux, no AVX2, vLLM not installed). An engine takes about
3.7 GB and minutes to start on a busy machine, so engines are shared: one per module, or the
package's pair (``engine_pair``), which is stopped after the package's last test.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from loadtest.redis_server import RedisServer
from loadtest.vllm_engine import (
    BLOCK_SIZE,
    VllmEngine,
    get_json,
    make_model_dir,
    start_vllm_engine,
    unavailable_reason,
)
from tests.helpers import PYTHON, start_process, stop_process, wait_for, wait_ready

UNAVAILABLE = unavailable_reason()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if UNAVAILABLE is None:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"real-engine test skipped: {UNAVAILABLE}")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 model directory (config and tokenizer, no weights)."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-qwen3"))


def start_engines(model_dir: Path, count: int, **kwargs: object) -> list[VllmEngine]:
    """``count`` engines started one after the other (in parallel they only compete for the
    two cores); all stopped when one fails to start."""
    engines: list[VllmEngine] = []
    try:
        for _ in range(count):
            engines.append(start_vllm_engine(model_dir, **kwargs))  # type: ignore[arg-type]
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


TOOL_CALLING = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # Qwen3's parser
# the render endpoints (/v1/messages/render, /v1/responses/render): vLLM's token ids of a body
SCALE_OUT = ["--enable-scale-out"]


@pytest.fixture(scope="package")
def engine_pair(model_dir: Path) -> Iterator[list[VllmEngine]]:
    """Two engines with the default capacity (1 GiB of KV cache each), PYTHONHASHSEED 0, tool
    calling on (chat completions with ``tools`` need it) and the render endpoints."""
    engines = start_engines(model_dir, 2, extra_args=[*TOOL_CALLING, *SCALE_OUT])
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop()


class EngineFleet:
    """The package's two engines, a worker each (``engine-0``, ``engine-1``, the exact index:
    ``--index-stride 1``), and one router on the session's Redis, with the engines' tokenizer
    (the model directory) and block size."""

    def __init__(self, engines: list[VllmEngine], model_dir: Path, redis_url: str,
                 tmp: Path) -> None:
        self.engines = engines
        self.replica_ids = [f"engine-{i}" for i in range(len(engines))]
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rid, engine in zip(self.replica_ids, engines, strict=True):
                self.procs.append(start_process([
                    PYTHON, "-m", "worker.cli", "report", "--engine-url", engine.url,
                    "--kv-events-endpoint", engine.kv_events_endpoint,
                    "--kv-replay-endpoint", engine.kv_replay_endpoint, "--redis-url", redis_url,
                    "--replica-id", rid, "--advertise-url", engine.url, "--hash-seed", "0",
                    "--metrics-port", "0", "--index-stride", "1"]))
            ready = tmp / "router.json"
            self.router = start_process([
                PYTHON, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                "--ready-file", str(ready), "--redis-url", redis_url, "--tokenizer",
                str(model_dir), "--block-size", str(BLOCK_SIZE), "--hash-seed", "0",
                "--index-stride", "1"])
            self.procs.append(self.router)
            self.url = wait_ready(ready, self.procs, 120, "the router's ready file")["url"]
            wait_for(lambda: self.routable() == len(engines), 300,
                     message="both engines routable with verified hashes", procs=self.procs)
        except BaseException:
            self.stop()
            raise

    def ready(self) -> dict[str, Any]:
        return get_json(f"{self.url}/ready")

    def routable(self) -> int:
        return sum(bool(r["routable"] and r["affinity"] and r["hash_verified"] == "1")
                   for r in self.ready()["replicas"])

    def engine(self, replica_id: str) -> VllmEngine:
        return self.engines[self.replica_ids.index(replica_id)]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)


@pytest.fixture(scope="package")
def engine_fleet(engine_pair: list[VllmEngine], model_dir: Path, redis_server: RedisServer,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFleet]:
    """``engine_pair`` with workers and a router (Redis flushed first)."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    fleet = EngineFleet(engine_pair, model_dir, redis_server.url,
                        tmp_path_factory.mktemp("engine-fleet"))
    try:
        yield fleet
    finally:
        fleet.stop()
