"""KV events as vLLM publishes them, through the real worker into Redis: one real engine (vLLM's
CPU build, a pool of ``NUM_BLOCKS`` blocks so that blocks are evicted: the package's
``small_pool_engine``) shared by the module, a worker per test, the session's Redis.

Every test also taps the engine's event stream itself (``KVEventTap``, a ZMQ subscriber of its
own), so the assertions are about what vLLM published, not only about what the worker made of
it; block keys are checked against ``router.shared.hashing.BlockHasher`` under the routers' settings.
"""

from __future__ import annotations

import ipaddress
import random
import subprocess
from collections.abc import Iterator

import psutil
import pytest

from loadtest.harness.vllm_engine import (
    BLOCK_SIZE,
    KVEventTap,
    VllmEngine,
    post_json,
)
from router.shared.hashing import BlockHasher
from router.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, event_hash_key
from tests.helpers import stop_process, wait_for
from tests.integration.test_worker_emulator import (
    SEED,
    Emulator,
    Redis,
    start_worker,
    verified,
)

# the package's engines start together when the first is needed: up to half an hour on a
# machine this busy
pytestmark = pytest.mark.timeout(2700)

NUM_BLOCKS = 64  # --num-gpu-blocks-override: 63 usable blocks (vLLM's null block), 2,016 tokens
HASHER = BlockHasher(BLOCK_SIZE, "sha256", SEED)
SETTLE_S = 120.0  # bound on waits for events to arrive and apply: generous on a busy machine


@pytest.fixture(scope="module")
def engine(small_pool_engine: VllmEngine) -> VllmEngine:
    assert small_pool_engine.num_gpu_blocks == NUM_BLOCKS
    return small_pool_engine


@pytest.fixture(scope="module", autouse=True)
def tap(engine: VllmEngine) -> Iterator[KVEventTap]:
    """Subscribed before the module's first request: it sees every event the engine publishes."""
    t = KVEventTap(engine.kv_events_endpoint)
    yield t
    t.close()


class Workers:
    """The workers one test starts on the module's engine (replica ``replica-0``, the exact
    index); ``close`` stops those still running and prints their output (shown on failure)."""

    def __init__(self, engine: VllmEngine, redis_url: str) -> None:
        self.engine = engine
        self.redis_url = redis_url
        self.rds = Redis(redis_url)
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, hash_seed: str = SEED, verify: bool = True) -> subprocess.Popen[bytes]:
        """A worker with ``--hash-seed hash_seed``; with ``verify``, once its probe agreed."""
        replica = Emulator(self.engine.proc, self.engine.url, self.engine.kv_events_endpoint,
                           self.engine.kv_replay_endpoint, (0, 0, 0))  # what start_worker reads
        worker = start_worker(replica, self.redis_url, hash_seed=hash_seed)
        self.running.append(worker)
        if verify:
            wait_for(lambda: verified(self.rds), SETTLE_S, message="hash probe verified",
                     procs=[worker])
        return worker

    def stop(self, worker: subprocess.Popen[bytes], kill: bool = False) -> str:
        """Stop ``worker`` (SIGKILL first with ``kill``); its output."""
        self.running.remove(worker)
        if kill:
            worker.kill()
        return stop_process(worker)

    def close(self) -> None:
        for worker in reversed(self.running):
            print(f"--- worker output (tail) ---\n{stop_process(worker)[-6000:]}")


@pytest.fixture
def workers(engine: VllmEngine, redis_url: str) -> Iterator[Workers]:
    w = Workers(engine, redis_url)
    yield w
    w.close()


def complete(engine: VllmEngine, tokens: list[int]) -> dict[str, object]:
    """One completion of token ids, ``max_tokens`` 1; returns the engine's usage."""
    body = {"model": engine.model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    usage: dict[str, object] = post_json(f"{engine.url}/v1/completions", body)["usage"]
    return usage


def prompt(num_tokens: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1_000, 100_000) for _ in range(num_tokens)]


def settled(rds: Redis, tap: KVEventTap) -> bool:
    """The worker's set equals the engine's resident keys as the tapped events say."""
    return rds.blocks() == tap.resident()


def test_hash_probe_agrees_with_the_engine(workers: Workers) -> None:
    worker = workers.start()
    heartbeat = workers.rds.heartbeat()
    assert (heartbeat["block_size"], heartbeat["hash_algo"]) == (str(BLOCK_SIZE), "sha256")
    assert heartbeat["key_mode"] == "engine"
    assert heartbeat["num_gpu_blocks"] == str(NUM_BLOCKS)
    log = workers.stop(worker)
    assert f"engine block hashes match this worker's hasher (sha256, block size {BLOCK_SIZE}" in log


def test_hash_probe_with_a_wrong_seed_fails_loudly(workers: Workers) -> None:
    worker = workers.start(hash_seed="1", verify=False)  # the engine's PYTHONHASHSEED is 0
    rds = workers.rds
    wait_for(lambda: verified(rds, "0"), SETTLE_S, message="hash probe mismatch", procs=[worker])
    wait_for(lambda: rds.heartbeat().get("key_mode") == "recomputed", SETTLE_S,
             message="key_mode recomputed")
    log = workers.stop(worker)
    assert "engine block hashes DIFFER from the routers'" in log
    assert "PYTHONHASHSEED: the engine's seed is '0'" in log


def test_block_stored_events_carry_the_routers_keys(engine: VllmEngine, tap: KVEventTap,
                                                    workers: Workers) -> None:
    workers.start()
    rds = workers.rds
    rng = random.Random(11)
    tokens = prompt(5 * BLOCK_SIZE + 7, rng)  # 5 full blocks and a partial one (never stored)
    seen = len(tap.events())
    complete(engine, tokens)
    expected = HASHER.keys(tokens)
    assert len(expected) == 5

    def stored() -> list[BlockStored]:
        return [e for e in tap.events()[seen:] if isinstance(e, BlockStored)
                and event_hash_key(e.block_hashes[0]) in expected]

    wait_for(lambda: sum(len(e.block_hashes) for e in stored()) == 5, SETTLE_S,
             message="BlockStored of the prompt's 5 full blocks")
    events = stored()
    assert [event_hash_key(h) for e in events for h in e.block_hashes] == expected
    assert [t for e in events for t in e.token_ids] == tokens[:5 * BLOCK_SIZE]
    assert events[0].parent_block_hash is None and events[0].block_size == BLOCK_SIZE
    wait_for(lambda: set(expected) <= rds.blocks(), SETTLE_S, message="the worker stored the keys")
    wait_for(lambda: settled(rds, tap), SETTLE_S, message="worker set == engine's resident keys")


def test_evictions_under_a_small_pool(engine: VllmEngine, tap: KVEventTap,
                                      workers: Workers) -> None:
    workers.start()
    rds = workers.rds
    rng = random.Random(12)
    prompts = [prompt(20 * BLOCK_SIZE, rng) for _ in range(4)]  # 80 blocks > the pool's 64
    seen = len(tap.events())
    for tokens in prompts:
        complete(engine, tokens)
    first, last = set(HASHER.keys(prompts[0])), set(HASHER.keys(prompts[-1]))

    def removed() -> set[int]:
        return {event_hash_key(h) for e in tap.events()[seen:] if isinstance(e, BlockRemoved)
                for h in e.block_hashes}

    wait_for(lambda: removed() & first, SETTLE_S, message="BlockRemoved of the first prompt's blocks")
    wait_for(lambda: last <= tap.resident(), SETTLE_S, message="the last prompt's blocks resident")
    wait_for(lambda: settled(rds, tap), SETTLE_S, message="worker set == engine's resident keys")
    assert len(rds.blocks()) <= NUM_BLOCKS


def test_reset_prefix_cache_publishes_all_blocks_cleared(engine: VllmEngine, tap: KVEventTap,
                                                         workers: Workers) -> None:
    """vLLM publishes a step's events after the step (``Scheduler.update_from_output``), so the
    ``AllBlocksCleared`` of ``/reset_prefix_cache`` goes out with the next request's batch, before
    that request's stores; nothing is published while the engine stays idle."""
    workers.start()
    rds = workers.rds
    rng = random.Random(13)
    tokens = prompt(3 * BLOCK_SIZE, rng)
    complete(engine, tokens)
    wait_for(lambda: set(HASHER.keys(tokens)[:2]) <= rds.blocks(), SETTLE_S, message="keys stored")
    wait_for(lambda: settled(rds, tap), SETTLE_S, message="worker set == engine's resident keys")
    epoch = rds.epoch()
    seen = len(tap.batches)
    assert post_json(f"{engine.url}/reset_prefix_cache", {}) == {"success": True}
    after = prompt(2 * BLOCK_SIZE + 1, rng)
    complete(engine, after)
    wait_for(lambda: set(HASHER.keys(after)) <= tap.resident(), SETTLE_S,
             message="the next request's stores")
    events = [e for _, batch in tap.batches[seen:] for e in batch.events]
    assert isinstance(events[0], AllBlocksCleared), events[:3]
    assert not any(isinstance(e, AllBlocksCleared) for e in events[1:])
    wait_for(lambda: rds.epoch() > epoch, SETTLE_S, message="the worker's epoch bump")
    wait_for(lambda: settled(rds, tap), SETTLE_S, message="worker set == engine's resident keys")
    assert set(HASHER.keys(after)) <= rds.blocks() and not set(HASHER.keys(tokens)) & rds.blocks()


def test_a_restarted_worker_replays_what_it_missed(engine: VllmEngine, tap: KVEventTap,
                                                   workers: Workers) -> None:
    worker = workers.start()
    rds = workers.rds
    rng = random.Random(14)
    complete(engine, prompt(3 * BLOCK_SIZE, rng))
    wait_for(lambda: settled(rds, tap), SETTLE_S, message="worker set == engine's resident keys")
    workers.stop(worker, kill=True)
    missed = prompt(4 * BLOCK_SIZE + 3, rng)  # published while no worker listens
    complete(engine, missed)
    keys = set(HASHER.keys(missed))
    wait_for(lambda: keys <= tap.resident(), SETTLE_S, message="the engine published the missed blocks")
    assert not keys & rds.blocks()
    workers.start()
    wait_for(lambda: keys <= rds.blocks(), SETTLE_S, message="missed keys replayed")
    wait_for(lambda: settled(rds, tap), SETTLE_S, message="worker set == engine's resident keys")


def test_the_engine_listens_on_loopback_only(engine: VllmEngine) -> None:
    """The launcher keeps the KV events on this host: they go over ipc:// sockets (vLLM would
    bind tcp://*:P on every interface), and no process of the engine listens on a TCP address
    other than loopback."""
    assert engine.kv_events_endpoint.startswith("ipc://")
    assert engine.kv_replay_endpoint.startswith("ipc://")
    root = psutil.Process(engine.proc.pid)
    pids = {root.pid, *(p.pid for p in root.children(recursive=True))}
    listening = [(c.pid, c.laddr) for c in psutil.net_connections("tcp")
                 if c.pid in pids and c.status == psutil.CONN_LISTEN]
    assert listening, "the engine's HTTP server listens"
    assert all(ipaddress.ip_address(addr.ip).is_loopback for _, addr in listening), listening
