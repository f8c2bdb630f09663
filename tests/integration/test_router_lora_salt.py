"""Router routing paths through real processes: LoRA extra keys, cache_salt, baseline policies.

One fleet per module on loopback: a real Redis, one emulator process with two
replicas serving the base model and the LoRA adapter ``sql-lora``, and one
worker per replica publishing resident block keys to Redis. Each test starts
the router(s) it needs. The block keys the router, the engine and Redis agree
on are checked against ``prefix-router hash`` run as a separate process.
Prompts are token ids from seeded random vocabularies so tests never share
blocks by accident.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from router.shared.contract import DEFAULT_REDIS_PREFIX, blocks_key, unpack_key
from tests.helpers import EMULATE, PYTHON, start_process, stop_process, stopping, wait_for
from tests.integration.test_router_fleet import KV_EVENTS, Router, read_json_file

pytestmark = pytest.mark.timeout(120)

NUM_REPLICAS = 2
BLOCK_SIZE = 16
BASE_MODEL = "emulated-llm"
LORA_NAME = "sql-lora"
LORA_PATH = "/models/sql-lora"


class LoraFleet:
    """Emulator process (2 replicas, one LoRA adapter) and one worker per replica."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.redis_url = redis_url
        self.procs: list[subprocess.Popen[bytes]] = []
        ready = tmp / "emulator.json"
        self.procs.append(start_process([
            *EMULATE, "--replicas", str(NUM_REPLICAS), "--ready-file", str(ready),
            "--lora-modules", f"{LORA_NAME}={LORA_PATH}", "--enable-prompt-tokens-details",
            "--kv-events-config", KV_EVENTS, "--time-scale", "20"], env={"PYTHONHASHSEED": "0"}))
        info = wait_for(lambda: read_json_file(ready) or self.procs[0].poll() is not None, 60,
                        message="emulator ready file")
        if not isinstance(info, dict):
            raise RuntimeError(self.stop())
        self.replicas: list[dict[str, Any]] = info["replicas"]
        for rep in self.replicas:
            self.procs.append(start_process([
                PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
                "--kv-events-endpoint", rep["kv_events_endpoint"],
                "--kv-replay-endpoint", rep["kv_replay_endpoint"], "--redis-url", redis_url,
                "--replica-id", f"replica-{rep['index']}", "--advertise-url", rep["url"],
                "--hash-seed", "0", "--metrics-port", "0",
                "--index-stride", "1"]))  # the exact index: keys compared with the CLI's one by one

    def resident_keys(self, replica_id: str) -> set[int]:
        """The block keys the replica's worker published in ``pr:blocks:{replica}``."""
        import redis

        client = redis.Redis.from_url(self.redis_url)
        try:
            members = client.smembers(blocks_key(DEFAULT_REDIS_PREFIX, replica_id))
        finally:
            client.close()
        return {unpack_key(m) for m in cast("set[bytes]", members)}  # no decode_responses: bytes

    def stop(self) -> str:
        return "\n".join(stop_process(p) for p in reversed(self.procs))


@pytest.fixture(scope="module")
def fleet(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraFleet]:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    f = LoraFleet(tmp_path_factory.mktemp("lora-fleet"), redis_server.url)
    try:
        yield f
    finally:
        f.stop()


def start_router(fleet: LoraFleet, tmp: Path, policy: str = "prefix") -> Router:
    router = Router(tmp, ["--redis-url", fleet.redis_url, "--hash-seed", "0", "--policy", policy,
                          "--index-stride", "1"],
                    name=f"router-{policy}")

    def all_routable_with_lora() -> bool:
        reps = router.ready()["replicas"]
        return len(reps) == NUM_REPLICAS and all(
            r["routable"] and r["affinity"] and r["lora_adapters"] == [LORA_NAME] for r in reps)

    try:
        wait_for(all_routable_with_lora, 30, message="both replicas routable with the LoRA adapter")
    except TimeoutError:
        print(router.ready())
        print(router.stop())
        raise
    return router


@pytest.fixture(scope="module")
def prefix_router(fleet: LoraFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    with stopping(start_router(fleet, tmp_path_factory.mktemp("prefix-router"))) as r:
        yield r


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def cli_keys(toks: list[int], *extra: str) -> list[int]:
    """Block keys printed by ``prefix-router hash`` (a separate process), in chain order."""
    out = subprocess.run(
        [PYTHON, "-m", "router.cli", "hash", "--hash-seed", "0", "--tokens", json.dumps(toks), *extra],
        check=True, capture_output=True, text=True, timeout=30).stdout
    return [int(line.split()[1]) for line in out.splitlines()]


def complete(router: Router, body: dict[str, Any]) -> tuple[str, str, int]:
    """Send a completion through the router: (replica, reason, engine cached_tokens)."""
    status, headers, raw = router.post("/v1/completions", {"max_tokens": 1, **body})
    assert status == 200, raw[:300]
    cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
    return headers["x-prefix-router-replica"], headers["x-prefix-router-reason"], cached


def debug_route(router: Router, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = router.post("/debug/route", body)
    assert status == 200, raw[:300]
    result: dict[str, Any] = json.loads(raw)
    return result


def wait_confirmed(router: Router, body: dict[str, Any], replica: str, blocks: int) -> dict[str, Any]:
    """Wait until /debug/route shows ``blocks`` engine-confirmed hit blocks on ``replica``."""
    def confirmed() -> dict[str, Any]:
        d = debug_route(router, body)
        return d if d["replicas"][replica]["confirmed_hit_blocks"] == blocks else {}
    return wait_for(confirmed, 15, message=f"{blocks} confirmed blocks on {replica}")



def assert_no_hit_anywhere(router: Router, body: dict[str, Any]) -> None:
    """``/debug/route`` predicts no hit, confirmed or speculative, on any replica."""
    decision = debug_route(router, body)
    assert all(v["hit_blocks"] == 0 and v["confirmed_hit_blocks"] == 0
               for v in decision["replicas"].values()), decision["replicas"]


def test_lora_blocks_hit_match_cli_and_do_not_cross_hit_base(fleet: LoraFleet,
                                                              prefix_router: Router) -> None:
    rng = random.Random(101)
    n = 20 * BLOCK_SIZE + 5
    toks = tokens(rng, n)
    full_blocks = (n - 1) // BLOCK_SIZE
    lora_body = {"model": LORA_NAME, "prompt": toks}
    base_body = {"model": BASE_MODEL, "prompt": toks}

    before = debug_route(prefix_router, lora_body)
    assert before["chain_blocks"] == n // BLOCK_SIZE
    assert all(v["hit_blocks"] == 0 for v in before["replicas"].values()), before["replicas"]

    home, _, cached = complete(prefix_router, lora_body)
    assert cached == 0
    d = wait_confirmed(prefix_router, lora_body, home, full_blocks)
    assert d["replica"] == home and d["reason"] == "prefix_hit"
    assert d["hit_blocks"] == full_blocks and d["hit_tokens"] == full_blocks * BLOCK_SIZE

    lora_keys = cli_keys(toks, "--lora-name", LORA_NAME, "--lora-path", LORA_PATH)
    assert len(lora_keys) == n // BLOCK_SIZE
    wait_for(lambda: set(lora_keys) <= fleet.resident_keys(home), 10,
             message="LoRA block keys of the CLI in Redis")

    replica, reason, cached = complete(prefix_router, lora_body)
    assert (replica, reason) == (home, "prefix_hit")
    assert cached == d["hit_tokens"]

    # the same tokens under the base model are a different chain: no key, no hit in common
    base_keys = cli_keys(toks)
    assert len(base_keys) == len(lora_keys) and not set(base_keys) & set(lora_keys)
    for rep in fleet.replicas:
        assert not set(base_keys) & fleet.resident_keys(f"replica-{rep['index']}")
    assert_no_hit_anywhere(prefix_router, base_body)
    base_home, _, cached = complete(prefix_router, base_body)
    assert cached == 0
    wait_for(lambda: set(base_keys) <= fleet.resident_keys(base_home), 10,
             message="base-model block keys of the CLI in Redis")
    # base traffic created base blocks only: the LoRA chain keeps its depth, no more
    d = wait_confirmed(prefix_router, base_body, base_home, full_blocks)
    assert debug_route(prefix_router, lora_body)["replicas"][home]["confirmed_hit_blocks"] == full_blocks


def test_cache_salt_separates_blocks_and_same_salt_hits(fleet: LoraFleet, prefix_router: Router) -> None:
    rng = random.Random(202)
    n = 12 * BLOCK_SIZE + 3
    toks = tokens(rng, n)
    full_blocks = (n - 1) // BLOCK_SIZE
    body_a = {"model": BASE_MODEL, "prompt": toks, "cache_salt": "tenant-a"}
    body_b = {"model": BASE_MODEL, "prompt": toks, "cache_salt": "tenant-b"}

    home_a, _, cached = complete(prefix_router, body_a)
    assert cached == 0
    d = wait_confirmed(prefix_router, body_a, home_a, full_blocks)
    assert d["replica"] == home_a and d["reason"] == "prefix_hit"

    keys_a = cli_keys(toks, "--cache-salt", "tenant-a")
    keys_b = cli_keys(toks, "--cache-salt", "tenant-b")
    assert len(keys_a) == len(keys_b) == n // BLOCK_SIZE
    assert not set(keys_a) & set(keys_b) and not set(keys_a) & set(cli_keys(toks))
    wait_for(lambda: set(keys_a) <= fleet.resident_keys(home_a), 10,
             message="salted block keys of the CLI in Redis")

    # the other salt shares nothing, before it is sent and in the engine
    assert_no_hit_anywhere(prefix_router, body_b)
    home_b, _, cached = complete(prefix_router, body_b)
    assert cached == 0
    wait_for(lambda: set(keys_b) <= fleet.resident_keys(home_b), 10,
             message="second salt's block keys of the CLI in Redis")

    # the same salt again hits what the first request left
    replica, reason, cached = complete(prefix_router, body_a)
    assert (replica, reason) == (home_a, "prefix_hit")
    assert cached == d["hit_tokens"] == full_blocks * BLOCK_SIZE


def test_consistent_hash_baseline_keeps_a_prefix_on_one_replica(fleet: LoraFleet, tmp_path: Path) -> None:
    rng = random.Random(303)
    router = start_router(fleet, tmp_path, "consistent_hash")
    try:
        shared = tokens(rng, 1100)  # beyond the baseline's 1024 keyed tokens
        seen = [complete(router, {"model": BASE_MODEL, "prompt": shared + tokens(rng, 30)})[:2]
                for _ in range(5)]
        assert {reason for _, reason in seen} == {"consistent_hash"}
        assert len({replica for replica, _ in seen}) == 1, seen
        # unrelated prefixes are spread over the ring (fixed seed: deterministic)
        spread = {complete(router, {"model": BASE_MODEL, "prompt": tokens(rng, 40)})[0]
                  for _ in range(10)}
        assert len(spread) == NUM_REPLICAS, spread
    finally:
        router.stop()


def test_least_loaded_baseline_spreads_sequential_requests(fleet: LoraFleet, tmp_path: Path) -> None:
    rng = random.Random(404)
    router = start_router(fleet, tmp_path, "least_loaded")
    try:
        shared = tokens(rng, 200)
        seen = [complete(router, {"model": BASE_MODEL, "prompt": shared})[:2] for _ in range(6)]
        assert {reason for _, reason in seen} == {"least_loaded"}
        replicas = [replica for replica, _ in seen]
        assert len(set(replicas)) == NUM_REPLICAS, replicas
        assert max(replicas.count(r) for r in set(replicas)) <= 4, replicas
    finally:
        router.stop()
