"""The worker sidecar end to end: a real emulator process, a real worker process, a real Redis.

Block keys are checked against what ``prefix-router hash`` (a subprocess of the
router's CLI) prints for the same token ids, so worker, engine and router are
held to one definition of a block hash.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from router.shared import contract
from tests import helpers
from tests.helpers import PYTHON, free_port, start_process, stop_process, wait_for

pytestmark = pytest.mark.timeout(120)

SEED = "0"  # PYTHONHASHSEED of engines and --hash-seed of routers/workers in these tests
REPLICA = "replica-0"
KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq"}


@dataclass
class Emulator:
    proc: subprocess.Popen[bytes]
    url: str
    events: str
    replay: str
    ports: tuple[int, int, int]


def start_emulator(tmp: Path, *, seed: str = SEED, num_gpu_blocks: int = 4000,
                   ports: tuple[int, int, int] | None = None, extra: tuple[str, ...] = (),
                   events: str | None = None) -> Emulator:
    """An emulator publishing its KV events at ``events`` (default ``tcp://*:PORT``)."""
    port, ev, rp = ports or (free_port(), free_port(), free_port())
    ready = tmp / f"ready-{port}-{random.random()}.json"
    config = dict(KV_EVENTS, endpoint=events or f"tcp://*:{ev}", replay_endpoint=f"tcp://*:{rp}")
    proc, replicas = helpers.start_emulator(
        ready, ["--port", str(port), "--num-gpu-blocks-override", str(num_gpu_blocks),
                "--kv-events-config", json.dumps(config), *extra], {"PYTHONHASHSEED": seed})
    replica = replicas[0]
    return Emulator(proc, replica["url"], replica["kv_events_endpoint"], replica["kv_replay_endpoint"],
                    (port, ev, rp))


def start_worker(emu: Emulator, redis_url: str, *, hash_seed: str = SEED,
                 events: str | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    return start_process([PYTHON, "-m", "worker.cli", "report", "--engine-url", emu.url,
                          "--kv-events-endpoint", events or emu.events,
                          "--kv-replay-endpoint", emu.replay, "--redis-url", redis_url,
                          "--replica-id", REPLICA, "--hash-seed", hash_seed,
                          "--index-stride", "1",  # the exact index: every key is published
                          "--log-level", "debug", *extra])


def router_keys(tokens: list[int], seed: str = SEED) -> list[int]:
    """Block keys as the router computes them: ``prefix-router hash`` as a subprocess."""
    out = subprocess.run([PYTHON, "-m", "router.cli", "hash", "--hash-seed", seed,
                          "--tokens", json.dumps(tokens)], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return [int(line.split()[1]) for line in out.splitlines()]


def complete(emu: Emulator, tokens: list[int]) -> None:
    resp = requests.post(f"{emu.url}/v1/completions", timeout=30,
                         json={"model": "emulated-llm", "prompt": tokens, "max_tokens": 1})
    assert resp.status_code == 200, resp.text


def prompt(num_tokens: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 20_000) for _ in range(num_tokens)]


class Redis:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def blocks(self) -> set[int]:
        return {contract.unpack_key(m)
                for m in self.client.smembers(contract.blocks_key("pr", REPLICA))}  # type: ignore[union-attr]

    def cpu_blocks(self) -> set[int]:
        return {contract.unpack_key(m) for m in self.client.smembers(  # type: ignore[union-attr]
            contract.blocks_key("pr", REPLICA, contract.TIER_CPU))}

    def heartbeat(self) -> dict[str, str]:
        raw: Any = self.client.hgetall(contract.replica_key("pr", REPLICA))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def epoch(self) -> int:
        return int(self.heartbeat().get(contract.F_EPOCH, "-1"))

    def stream(self) -> list[dict[str, bytes]]:
        entries: Any = self.client.xrange(contract.events_key("pr"))
        return [{k.decode(): v for k, v in fields.items()} for _, fields in entries]


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="worker-it-") as name:
        yield Path(name)


@pytest.fixture
def rds(redis_url: str) -> Redis:
    return Redis(redis_url)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in reversed(started):
        output = stop_process(proc)
        print(f"--- {proc.args[3]} output (tail) ---\n{output[-6000:]}")  # shown on failure


def verified(rds: Redis, value: str = "1") -> bool:
    return rds.heartbeat().get(contract.F_HASH_VERIFIED) == value


def start_verified(tmp: Path, rds: Redis, redis_url: str,
                   procs: list[subprocess.Popen[bytes]]) -> tuple[Emulator, subprocess.Popen[bytes]]:
    """An emulator and its worker (both in ``procs``), once the worker's hash probe agreed."""
    emu = start_emulator(tmp)
    procs.append(emu.proc)
    worker = start_worker(emu, redis_url)
    procs.append(worker)
    wait_for(lambda: verified(rds), 30, message="hash probe verified")
    return emu, worker


def store_prompt(emu: Emulator, rds: Redis, rng: random.Random) -> list[int]:
    """Complete a new 40-token prompt on ``emu``; returns it once its block keys are in Redis."""
    tokens = prompt(40, rng)
    complete(emu, tokens)
    wait_for(lambda: set(router_keys(tokens)) <= rds.blocks(), 20, message="keys stored")
    return tokens


def settle(rds: Redis, emu_url: str) -> int:
    """Wait until the worker has caught up with every batch the engine published; return the seq."""
    def caught_up() -> bool:
        heartbeat = rds.heartbeat()
        return bool(heartbeat) and heartbeat.get(contract.F_NUM_BLOCKS) == str(len(rds.blocks()))
    wait_for(caught_up, 20, message="worker caught up")
    return int(rds.heartbeat()[contract.F_SEQ])


def test_request_keys_heartbeat_and_eviction(tmp: Path, rds: Redis, redis_url: str,
                                              procs: list[subprocess.Popen[bytes]]) -> None:
    rng = random.Random(1)
    emu = start_emulator(tmp, num_gpu_blocks=12)
    procs.append(emu.proc)
    procs.append(start_worker(emu, redis_url))
    wait_for(lambda: verified(rds), 30, message="hash probe verified")
    heartbeat = rds.heartbeat()
    assert heartbeat[contract.F_URL] == emu.url
    assert json.loads(heartbeat[contract.F_MODELS]) == ["emulated-llm"]
    assert json.loads(heartbeat[contract.F_LORA_ADAPTERS]) == {}
    assert (heartbeat[contract.F_BLOCK_SIZE], heartbeat[contract.F_HASH_ALGO]) == ("16", "sha256")
    assert heartbeat[contract.F_KEY_MODE] == "engine"
    assert heartbeat[contract.F_NUM_GPU_BLOCKS] == "12"
    assert float(heartbeat[contract.F_KV_USAGE]) >= 0.0
    ttl = rds.client.pttl(contract.replica_key("pr", REPLICA))
    assert 0 < ttl <= contract.HEARTBEAT_TTL_S * 1000  # type: ignore[operator]

    before = rds.blocks()  # the probe's blocks
    tokens_a = prompt(40, rng)
    keys_a = router_keys(tokens_a)
    assert len(keys_a) == 2
    complete(emu, tokens_a)
    wait_for(lambda: rds.blocks() == before | set(keys_a), 20, message="request A's keys")

    def last_stored() -> set[int]:
        stored = [e for e in rds.stream() if e["stored"]]
        return set(contract.unpack_keys(stored[-1]["stored"])) if stored else set()

    # the stream entry follows the set change (contract version 3: after the flush script)
    wait_for(lambda: bool(last_stored()) and last_stored() <= set(keys_a), 20,
             message="request A's stream entry")
    # Load from the engine's /metrics: the probe (33 tokens) and A (40) were queried.
    wait_for(lambda: int(rds.heartbeat()[contract.F_PREFIX_CACHE_QUERIES]) >= 73, 10,
             message="prefix cache counters")
    assert int(rds.heartbeat()[contract.F_NUM_RUNNING]) == 0

    # Two 170-token prompts need 11 blocks each of the 12: every older cached block is evicted.
    for _ in range(2):
        tokens_b = prompt(170, rng)
        complete(emu, tokens_b)
    keys_b = router_keys(tokens_b)
    wait_for(lambda: set(keys_b) <= rds.blocks() and not set(keys_a) & rds.blocks(), 20,
             message="eviction of A's keys")
    assert len(rds.blocks()) <= 12
    wait_for(lambda: any(e["removed"] for e in rds.stream()), 10, message="a removal entry")


def test_reset_prefix_cache_clears_and_bumps_epoch(tmp: Path, rds: Redis, redis_url: str,
                                                   procs: list[subprocess.Popen[bytes]]) -> None:
    rng = random.Random(2)
    emu, _ = start_verified(tmp, rds, redis_url, procs)
    store_prompt(emu, rds, rng)
    old_epoch = rds.epoch()
    old_blocks = rds.blocks()
    resp = requests.post(f"{emu.url}/reset_prefix_cache", timeout=10)
    assert resp.status_code == 200
    # the AllBlocksCleared goes out with the next step's batch (as vLLM's): a request shorter
    # than a block runs one step and stores nothing
    complete(emu, prompt(3, rng))
    wait_for(lambda: rds.epoch() > old_epoch, 20, message="epoch bump")
    # After the reset only a new probe's blocks may come back; none of the old keys.
    wait_for(lambda: not (rds.blocks() & old_blocks), 20, message="old keys gone")

    def cleared() -> list[dict[str, bytes]]:
        return [e for e in rds.stream() if e["cleared"] == b"1"]

    wait_for(lambda: bool(cleared()) and int(cleared()[-1]["epoch"]) > old_epoch, 10,
             message="the cleared entry of the new epoch")
    assert cleared()[-1]["replica"] == REPLICA.encode()


def test_engine_restart_is_detected(tmp: Path, rds: Redis, redis_url: str,
                                    procs: list[subprocess.Popen[bytes]]) -> None:
    rng = random.Random(3)
    emu, _ = start_verified(tmp, rds, redis_url, procs)
    store_prompt(emu, rds, rng)
    stale = rds.blocks()
    old_epoch = rds.epoch()
    procs.remove(emu.proc)
    stop_process(emu.proc)
    emu2 = start_emulator(tmp, ports=emu.ports)
    procs.append(emu2.proc)
    tokens2 = prompt(40, rng)
    keys2 = set(router_keys(tokens2))

    def recovered() -> bool:
        # The new engine's first batches may go out before the worker's SUB socket has
        # reconnected; later traffic (or its counters) reveals the restart and the replay
        # buffer supplies the rest. Keep sending the same prompt until that happens.
        complete(emu2, tokens2)
        return keys2 <= rds.blocks() and not (stale & rds.blocks())

    wait_for(recovered, 30, interval_s=0.3, message="stale keys gone, new keys present")
    wait_for(lambda: rds.epoch() > old_epoch, 10, message="epoch bump")


def test_killed_worker_restarts_with_a_correct_set(tmp: Path, rds: Redis, redis_url: str,
                                                   procs: list[subprocess.Popen[bytes]]) -> None:
    rng = random.Random(4)
    emu, worker = start_verified(tmp, rds, redis_url, procs)
    store_prompt(emu, rds, rng)
    settle(rds, emu.url)
    before = rds.blocks()
    procs.remove(worker)
    worker.kill()
    worker.wait()
    stop_process(worker)
    tokens2 = prompt(56, rng)  # published while no worker listens: only the replay buffer has it
    complete(emu, tokens2)
    keys2 = set(router_keys(tokens2))
    procs.append(start_worker(emu, redis_url))
    wait_for(lambda: keys2 <= rds.blocks(), 30, message="missed keys recovered")
    settle(rds, emu.url)
    blocks = rds.blocks()
    assert before | keys2 <= blocks
    # Besides those, only the restarted worker's own probe (two full blocks) may have been added.
    wait_for(lambda: len(rds.blocks() - (before | keys2)) == 2, 20, message="new probe blocks")


def test_probe_detects_seed_mismatch_and_recomputes(tmp: Path, rds: Redis, redis_url: str,
                                                    procs: list[subprocess.Popen[bytes]]) -> None:
    rng = random.Random(5)
    emu = start_emulator(tmp, seed="123")
    procs.append(emu.proc)
    worker = start_worker(emu, redis_url, hash_seed=SEED)
    procs.append(worker)
    wait_for(lambda: verified(rds, "0"), 30, message="hash probe mismatch")
    wait_for(lambda: rds.heartbeat().get(contract.F_KEY_MODE) == "recomputed", 10,
             message="key_mode recomputed")
    tokens = prompt(72, rng)  # 4 full blocks, stored in one event
    complete(emu, tokens)
    ours = set(router_keys(tokens, SEED))
    engines = set(router_keys(tokens, "123"))
    assert not ours & engines
    wait_for(lambda: ours <= rds.blocks(), 20, message="re-computed keys")
    assert not engines & rds.blocks()
    # Continuation blocks chain through the engine-hash map: extend the same prompt.
    tokens2 = tokens + prompt(32, rng)
    complete(emu, tokens2)
    wait_for(lambda: set(router_keys(tokens2, SEED)) <= rds.blocks(), 20,
             message="continuation keys re-computed")
    procs.remove(worker)
    log = stop_process(worker)
    assert "PYTHONHASHSEED" in log


def test_a_key_mode_switch_rekeys_the_engines_cached_blocks(tmp: Path, rds: Redis, redis_url: str,
                                                            procs: list[subprocess.Popen[bytes]]) -> None:
    """A switch of ``key_mode`` (either way) rebuilds the set from the engine's replay buffer.

    The engine keeps its cached blocks across the switch: they must stay visible under the
    new keys instead of the set starting empty (issue 15, item 7).
    """
    rng = random.Random(6)
    emu = start_emulator(tmp, seed="123")
    procs.append(emu.proc)
    tokens = prompt(72, rng)  # cached by the engine before any worker listens
    complete(emu, tokens)
    ours, engines = set(router_keys(tokens, SEED)), set(router_keys(tokens, "123"))

    # engine -> recomputed: the start-up replay stored engine hashes, the probe then disagreed
    worker = start_worker(emu, redis_url, hash_seed=SEED)
    procs.append(worker)
    wait_for(lambda: rds.heartbeat().get(contract.F_KEY_MODE) == "recomputed", 30,
             message="key_mode recomputed")
    wait_for(lambda: ours <= rds.blocks(), 10, message="cached blocks re-keyed as recomputed")
    assert not engines & rds.blocks()
    epoch = rds.epoch()

    # recomputed -> engine: a worker restarted with the engine's seed verifies the hashes
    procs.remove(worker)
    stop_process(worker)
    worker = start_worker(emu, redis_url, hash_seed="123")
    procs.append(worker)
    wait_for(lambda: verified(rds) and rds.heartbeat().get(contract.F_KEY_MODE) == "engine", 30,
             message="hash probe verified, key_mode engine")
    wait_for(lambda: engines <= rds.blocks(), 10, message="cached blocks re-keyed as engine hashes")
    assert not ours & rds.blocks()
    assert rds.epoch() > epoch


def worker_metric(port: int, name: str) -> float:
    """The value of the unlabelled metric ``name`` on the worker's ``/metrics`` at ``port``."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.split(" ", 1)[0] == name)


def test_a_missed_probe_is_sent_again_until_the_engines_events_arrive(
        tmp: Path, rds: Redis, redis_url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """A worker that cannot hear the engine's KV events at its first probe (the engine's
    publisher not reachable yet: here its endpoint appears only later) misses that probe, says
    so (a log line, ``worker_probe_misses_total``, ``worker_probe_retrying`` 1) and probes
    again until the events arrive; then ``hash_verified`` is 1. A probe used to be sent once:
    the worker stayed unverified (its hashes unknown to the router) until the engine restarted.
    """
    engine_events = tmp / "events.sock"
    emu = start_emulator(tmp, events=f"ipc://{engine_events}")
    procs.append(emu.proc)
    late = tmp / "late.sock"  # the worker's endpoint: a link to the engine's, made later
    metrics_port = free_port()
    worker = start_worker(emu, redis_url, events=f"ipc://{late}", extra=(
        "--probe-timeout-s", "1", "--metrics-port", str(metrics_port)))
    procs.append(worker)
    wait_for(lambda: worker_metric(metrics_port, "worker_probe_retrying") == 1, 30,
             message="a missed probe, waiting to probe again", procs=[worker])
    assert rds.heartbeat().get(contract.F_HASH_VERIFIED) == ""
    late.symlink_to(engine_events)
    wait_for(lambda: verified(rds), 60, message="hash probe verified", procs=[worker])
    assert worker_metric(metrics_port, "worker_probe_misses_total") >= 1
    assert worker_metric(metrics_port, "worker_probe_retrying") == 0
    procs.remove(worker)
    log = stop_process(worker)
    assert "hash probe 1/8: the KV event socket" in log
    assert "unverified, probing again" in log
