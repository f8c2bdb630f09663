"""LoRA affinity by what is loaded, end to end with real emulator metrics: a real Redis, one
emulator process with two replicas (two LoRA adapters, ``--max-loras 1``), a worker per
replica reading ``vllm:lora_requests_info`` from its replica's ``/metrics`` into the heartbeat,
and a router on the ``least_loaded`` policy (so that load alone would pick the other replica).

A long LoRA request sent straight to replica 0 keeps ``sql-lora`` running there; replica 1 is
idle with a free LoRA slot. A ``sql-lora`` request then goes to replica 0 (the adapter is
loaded there), and a request for the other adapter to replica 1 (replica 0's only slot is
taken).
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import PYTHON, start_emulator, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import KV_EVENTS, Router

pytestmark = pytest.mark.timeout(180)

LORA = "sql-lora"
OTHER_LORA = "chat-lora"


class LoraFleet:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.redis_url = redis_url
        self.emulator, self.replicas = start_emulator(
            tmp / "emulator.json",
            [
                "--replicas",
                "2",
                "--lora-modules",
                f"{LORA}=/models/{LORA}",
                f"{OTHER_LORA}=/models/{OTHER_LORA}",
                "--max-loras",
                "1",
                "--kv-events-config",
                KV_EVENTS,
                "--time-scale",
                "1",
            ],
            env={"PYTHONHASHSEED": "0"},
        )
        self.workers = [
            start_process(
                [
                    PYTHON,
                    "-m",
                    "worker.cli",
                    "report",
                    "--engine-url",
                    rep["url"],
                    "--kv-events-endpoint",
                    rep["kv_events_endpoint"],
                    "--kv-replay-endpoint",
                    rep["kv_replay_endpoint"],
                    "--redis-url",
                    redis_url,
                    "--replica-id",
                    f"replica-{rep['index']}",
                    "--advertise-url",
                    rep["url"],
                    "--hash-seed",
                    "0",
                    "--metrics-port",
                    "0",
                ]
            )
            for rep in self.replicas
        ]

    def stop(self) -> str:
        return "\n".join(stop_process(p) for p in [*self.workers, self.emulator])


@pytest.fixture(scope="module")
def fleet(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraFleet]:
    import redis

    with contextlib.closing(redis.Redis.from_url(redis_server.url)) as client:
        client.flushall()  # no replica of another module's fleet
    lora_fleet = LoraFleet(tmp_path_factory.mktemp("lora-loaded"), redis_server.url)
    yield lora_fleet
    lora_fleet.stop()


def replica_state(router: Router) -> dict[str, dict[str, Any]]:
    return {r["replica_id"]: r for r in router.ready()["replicas"]}


class HeldRequest:
    """A streamed LoRA completion sent straight to one replica and read slowly in a thread, so
    that it keeps running there until ``close``."""

    def __init__(self, url: str, model: str) -> None:
        body = json.dumps(
            {
                "model": model,
                "prompt": [7] * 40,
                "max_tokens": 4000,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        req = urllib.request.Request(
            url + "/v1/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        self.resp = urllib.request.urlopen(req, timeout=120)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed under it
            while not self._stop.is_set() and self.resp.readline():
                pass

    def close(self) -> None:
        self._stop.set()
        self.resp.close()  # the engine aborts the request when its client goes
        self.thread.join(timeout=10)


def test_a_lora_request_goes_where_its_adapter_is_loaded(fleet: LoraFleet, tmp_path: Path) -> None:
    router = Router(
        tmp_path, ["--redis-url", fleet.redis_url, "--hash-seed", "0", "--policy", "least_loaded"]
    )
    held: HeldRequest | None = None
    try:
        wait_for(
            lambda: (
                len(replica_state(router)) == 2
                and all(
                    r["routable"] and r["lora"]["max_lora"] == 1
                    for r in replica_state(router).values()
                )
            ),
            60,
            message="both replicas routable, reporting their LoRA state",
        )
        held = HeldRequest(fleet.replicas[0]["url"], LORA)
        wait_for(
            lambda: (
                replica_state(router)["replica-0"]["lora"]["running"] == [LORA]
                and replica_state(router)["replica-0"]["num_running"] == 1
            ),
            60,
            message="sql-lora running on replica-0, as its heartbeat reports it",
        )
        assert replica_state(router)["replica-1"]["lora"]["running"] == []

        status, _, raw = router.post("/debug/route", {"model": LORA, "prompt": [9] * 50})
        route = json.loads(raw)
        assert status == 200, raw[:300]
        # load alone picks replica-1 (replica-0 runs the held request); the loaded adapter wins
        assert route["replica"] == "replica-0"
        assert route["lora_affinity"] == {
            "adapter": LORA,
            "tier": "running",
            "replicas": {"replica-0": "running", "replica-1": "free_slot"},
        }
        status, headers, raw = router.post(
            "/v1/completions", {"model": LORA, "prompt": [9] * 50, "max_tokens": 1}
        )
        assert status == 200 and headers["x-prefix-router-replica"] == "replica-0", raw[:300]

        # the other adapter: replica-0's one slot is taken, replica-1 has a free one
        status, _, raw = router.post("/debug/route", {"model": OTHER_LORA, "prompt": [9] * 50})
        route = json.loads(raw)
        assert route["replica"] == "replica-1"
        assert route["lora_affinity"]["replicas"] == {"replica-0": "full", "replica-1": "free_slot"}
        # a base-model request has no LoRA preference
        status, _, raw = router.post("/debug/route", {"model": "emulated-llm", "prompt": [9] * 50})
        assert json.loads(raw)["lora_affinity"] is None
    finally:
        if held is not None:
            held.close()
        router.stop()
