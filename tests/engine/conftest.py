"""Real-engine tests: vLLM's CPU build (the ``vllm`` extra) serving the tiny Qwen3 model with
random weights, beside real workers, Redis and routers on loopback.

They skip, with the reason, where the build cannot run (``loadtest.harness.vllm_engine.
unavailable_reason``: not x86-64 Linux, no AVX2, vLLM not installed). An engine takes about
3.7 GB and minutes to start on a busy machine, so engines are shared and started together:
``EnginePool`` starts every engine the collected tests will use (``ENGINE_SPECS``) at once,
in parallel where the machine's free memory holds them all, when the first of them is needed;
a module's own engine is stopped after the module, the package's pair (``engine_pair``) after
the package's last test.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from loadtest.harness.processes import describe, output
from loadtest.harness.redis_server import RedisServer
from loadtest.harness.vllm_engine import (
    BLOCK_SIZE,
    START_TIMEOUT_S,
    KVEventTap,
    VllmEngine,
    get_json,
    make_model_dir,
    reset_prefix_cache,
    start_vllm_engine,
    unavailable_reason,
)
from router.shared.kv_events import AllBlocksCleared
from tests.helpers import PYTHON, start_process, stop_process, wait_for, wait_ready

UNAVAILABLE = unavailable_reason()
SETTLE_S = 120.0  # bound on waits for the router's index to catch up: generous when busy


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


TOOL_CALLING = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # Qwen3's parser
# the render endpoints (/v1/messages/render, /v1/responses/render): vLLM's token ids of a body
SCALE_OUT = ("--enable-scale-out",)
# The package's engines by name: start_vllm_engine's keywords. "pair-0"/"pair-1": the default
# capacity (1 GiB of KV cache each), tool calling on (chat completions with ``tools`` need it) and
# the render endpoints;
# "small-pool": 64 blocks, so that blocks are evicted (test_vllm_events); "data-parallel": one
# server with two ranks (test_vllm_data_parallel).
ENGINE_SPECS: dict[str, dict[str, Any]] = {
    "pair-0": {"extra_args": (*TOOL_CALLING, *SCALE_OUT)},
    "pair-1": {"extra_args": (*TOOL_CALLING, *SCALE_OUT)},
    "small-pool": {"num_gpu_blocks": 64},
    "data-parallel": {"num_gpu_blocks": 256, "data_parallel_size": 2},
}
# which engines a fixture needs, so the pool starts only those the collected tests will use
FIXTURE_ENGINES = {"engine_pair": ("pair-0", "pair-1"), "small_pool_engine": ("small-pool",),
                   "dp_engine": ("data-parallel",)}
# RSS of one engine over its processes: about 3.7 GB measured (1.1 GB API server, 0.8 GB engine
# core, the 1 GiB KV cache once touched), a data-parallel server one engine core more
ENGINE_BYTES = {"data-parallel": 5.5e9}
DEFAULT_ENGINE_BYTES = 4.0e9
HEADROOM_BYTES = 3.0e9  # left for the workers, routers, Redis and the test process


def available_bytes() -> float:
    """Memory available to new processes (``MemAvailable``); infinite where unknown."""
    import psutil

    try:
        return float(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return math.inf


class EnginePool:
    """The engines of ``ENGINE_SPECS`` that the collected tests use, started together when the
    first is asked for: all in parallel when the free memory holds them all (engine start-up is
    mostly single-threaded Python, so two starts share the two cores well), else one at a time
    as each fixture asks (a fixture's own engines in parallel when they fit). ``get`` waits for
    engines (re-raising a start failure), ``release`` stops one, ``close`` stops the rest
    (waiting for starts still running)."""

    def __init__(self, model_dir: Path, wanted: list[str]) -> None:
        self.model_dir = model_dir
        self.wanted = wanted
        self.futures: dict[str, Future[VllmEngine]] = {}
        self.executor = ThreadPoolExecutor(max_workers=max(1, len(wanted)),
                                           thread_name_prefix="engine-start")
        self.parallel = len(wanted) > 1 and self._fits(wanted)
        if self.parallel:
            self._submit(wanted)

    @staticmethod
    def _fits(names: list[str]) -> bool:
        need = sum(ENGINE_BYTES.get(n, DEFAULT_ENGINE_BYTES) for n in names) + HEADROOM_BYTES
        return available_bytes() >= need

    def _submit(self, names: list[str]) -> None:
        # N starts on the two cores at once take about N / 2 times as long as one
        timeout_s = START_TIMEOUT_S * max(1.0, len(names) / 2)
        for name in names:
            self.futures[name] = self.executor.submit(
                start_vllm_engine, self.model_dir, timeout_s=timeout_s, **ENGINE_SPECS[name])

    def get(self, *names: str) -> list[VllmEngine]:
        missing = [n for n in names if n not in self.futures]
        if len(missing) > 1 and self._fits(missing):
            self._submit(missing)
        for name in missing:
            if name not in self.futures:
                self._submit([name])
                self.futures[name].result()  # one at a time
        return [self.futures[n].result() for n in names]

    def release(self, name: str) -> None:
        future = self.futures.pop(name, None)
        if future is not None and future.exception() is None:
            future.result().stop()

    def close(self) -> None:
        for name in list(self.futures):
            self.release(name)
        self.executor.shutdown()


@pytest.fixture(scope="package")
def engine_pool(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[EnginePool]:
    """The package's ``EnginePool``, for the engines the session's collected tests use."""
    used = {name for item in request.session.items
            for name in getattr(item, "fixturenames", ())}
    wanted = [e for fixture, engines in FIXTURE_ENGINES.items() if fixture in used
              for e in engines]
    pool = EnginePool(model_dir, wanted)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="package")
def engine_pair(engine_pool: EnginePool) -> list[VllmEngine]:
    """The pool's two default-capacity engines (PYTHONHASHSEED 0, tool calling on), stopped
    with the package."""
    return engine_pool.get("pair-0", "pair-1")


@pytest.fixture(scope="module")
def small_pool_engine(engine_pool: EnginePool) -> Iterator[VllmEngine]:
    """The pool's 64-block engine, stopped after the module."""
    yield engine_pool.get("small-pool")[0]
    engine_pool.release("small-pool")


@pytest.fixture(scope="module")
def dp_engine(engine_pool: EnginePool) -> Iterator[VllmEngine]:
    """The pool's data-parallel server (two ranks, 256 blocks each), stopped after the module."""
    yield engine_pool.get("data-parallel")[0]
    engine_pool.release("data-parallel")


WAITED_FOR = "both engines routable with verified hashes"
# what /ready says of a replica that is not (routable, affinity, hash_verified "1")
NOT_READY_FIELDS = ("routable", "not_routable_reason", "affinity", "no_affinity_reason",
                    "hash_verified", "epoch", "index_blocks")


def ready_with_affinity(state: dict[str, Any]) -> bool:
    """A replica's ``/ready`` entry says it is routable with affinity and verified hashes."""
    return bool(state["routable"] and state["affinity"] and state["hash_verified"] == "1")


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
            try:
                wait_for(lambda: self.routable() == len(engines), 300, message=WAITED_FOR,
                         procs=self.procs)
            except TimeoutError as exc:
                # wait_for's message (what it waited for, its last error) without the tails
                # of every process's log: the replicas short of it and their workers' logs
                waited = str(exc).split("\n---", 1)[0]
                raise TimeoutError(f"{waited}\n{self.not_ready()}") from None
        except BaseException:
            self.stop()
            raise

    def ready(self) -> dict[str, Any]:
        return get_json(f"{self.url}/ready")

    def routable(self) -> int:
        return sum(ready_with_affinity(r) for r in self.ready()["replicas"])

    def not_ready(self) -> str:
        """Each replica short of ``WAITED_FOR``: what the router's ``/ready`` says of it and the
        tail of its worker's log (for a fixture that timed out)."""
        try:
            states = {r["replica_id"]: r for r in self.ready()["replicas"]}
        except (OSError, ValueError, KeyError) as exc:
            states, unread = {}, f" (the router's /ready did not answer: {exc!r})"
        else:
            unread = ""
        lines = []
        for rid, worker in zip(self.replica_ids, self.procs, strict=False):
            state = states.get(rid)
            if state is not None and ready_with_affinity(state):
                continue
            shown = ("not in the router's /ready" + unread if state is None else
                     ", ".join(f"{k} {state.get(k)!r}" for k in NOT_READY_FIELDS))
            lines.append(f"replica {rid} ({describe(worker)}): {shown}; its worker's log "
                         f"(tail):\n{output(worker)[-4000:]}")
        return "\n".join(lines)

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


@pytest.fixture(scope="module")
def taps(engine_fleet: EngineFleet) -> Iterator[dict[str, KVEventTap]]:
    """One tap per engine of ``engine_fleet``, keyed by replica id. A tap sees only what is
    published after it connects, so the engines' caches are reset first (which the workers
    follow)."""
    out = {rid: KVEventTap(engine_fleet.engine(rid).kv_events_endpoint)
           for rid in engine_fleet.replica_ids}
    try:
        for rid, tap in out.items():
            reset_prefix_cache(engine_fleet.engine(rid), SETTLE_S)
            wait_for(lambda t=tap: any(isinstance(e, AllBlocksCleared) for e in t.events()),
                     SETTLE_S, 0.1, "AllBlocksCleared")
        yield out
    finally:
        for tap in out.values():
            tap.close()


def index_matches_engines(fleet: EngineFleet, taps: dict[str, KVEventTap]) -> bool:
    """Each replica's block count in the router's index equals its engine's resident blocks as
    the engine's own events say (the router applies the workers' stream entries)."""
    counts = {r["replica_id"]: r["index_blocks"] for r in fleet.ready()["replicas"]}
    return all(counts.get(rid) == len(tap.resident()) for rid, tap in taps.items())
