"""Replicas that fail or hang behind a live fleet: errors count as ill health, never as appeal.

One emulator process (2 replicas), a worker each, real Redis; replica-1 is reached through a
fault-injecting proxy (``loadtest.harness.fault_proxy``: its ``/health``, ``/metrics`` and
``/v1/models`` stay fine, generation requests answer 500 or hang). Each test starts its own
router on port 0.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.harness.redis_server import RedisServer
from tests.helpers import EMULATE, PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import KV_EVENTS, Router, http, read_json_file

pytestmark = pytest.mark.timeout(150)

BAD = "replica-1"


class FaultFleet:
    def __init__(self, tmp: Path, redis_url: str, time_scale: str = "50") -> None:
        self.procs: list[Any] = []
        ready = tmp / "emu.json"
        self.procs.append(start_process([
            *EMULATE, "--replicas", "2", "--kv-events-config", KV_EVENTS, "--time-scale", time_scale,
            "--ready-file", str(ready)], env={"PYTHONHASHSEED": "0"}))
        reps = wait_for(lambda: read_json_file(ready), 60, message="emulator")["replicas"]
        proxy_ready = tmp / "proxy.json"
        self.procs.append(start_process([PYTHON, "-m", "loadtest.harness.fault_proxy", "--target",
                                         reps[1]["url"], "--ready-file", str(proxy_ready)]))
        self.proxy_url = wait_for(lambda: read_json_file(proxy_ready), 30)["url"]
        self.good_url = reps[0]["url"]
        for rep in reps:
            # replica-1's worker polls its engine through the proxy too (a stalled engine)
            url = self.proxy_url if rep["index"] == 1 else rep["url"]
            self.procs.append(start_process([
                PYTHON, "-m", "worker.cli", "report", "--engine-url", url,
                "--kv-events-endpoint", rep["kv_events_endpoint"], "--kv-replay-endpoint",
                rep["kv_replay_endpoint"], "--redis-url", redis_url, "--replica-id",
                f"replica-{rep['index']}", "--advertise-url", url, "--hash-seed", "0",
                "--metrics-port", "0"]))
        self.redis_url = redis_url

    def fault(self, mode: str | None = None, scope: str = "generate") -> dict[str, Any]:
        body = None if mode is None else {"mode": mode, "scope": scope}
        return json.loads(http("POST" if mode else "GET", self.proxy_url + "/_fault", body)[2])

    def router(self, tmp: Path, *extra: str, static: bool = False) -> Router:
        source = (["--replica", self.good_url, "--replica", self.proxy_url] if static
                  else ["--redis-url", self.redis_url, "--hash-seed", "0"])
        router = Router(tmp, [*source, *extra])
        wait_for(lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2, 30,
                 message="both replicas routable")
        return router

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)


@pytest.fixture(scope="module")
def fleet(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFleet]:
    f = FaultFleet(tmp_path_factory.mktemp("faults"), redis_server.url)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def routers(fleet: FaultFleet) -> Iterator[list[Router]]:
    started: list[Router] = []
    yield started
    for router in started:
        print(router.stop()[-2000:])
    fleet.fault("pass")


def new_prompt(rng: random.Random, n: int = 256) -> list[int]:
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def replica_state(router: Router, rid: str) -> dict[str, Any]:
    return next(r for r in router.ready()["replicas"] if r["replica_id"] == rid)


def test_a_replica_answering_500_is_retried_elsewhere_and_its_circuit_opens(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    router = fleet.router(tmp_path, "--circuit-ejection-s", "1.5")
    routers.append(router)
    fleet.fault("500")
    before = fleet.fault()["generate_requests"]
    rng = random.Random(21)
    for _ in range(20):
        status, headers, raw = router.post("/v1/completions",
                                           {"prompt": new_prompt(rng), "max_tokens": 1})
        assert status == 200, raw[:300]  # the 500 was retried on the other replica
        assert headers["x-prefix-router-replica"] == "replica-0"
    # three consecutive failures open the circuit; while open it gets nothing
    got = fleet.fault()["generate_requests"] - before
    assert got <= 4, got
    state = replica_state(router, BAD)
    assert state["circuit"] in ("open", "half_open")
    assert f'router_upstream_errors_total{{kind="http_500",replica="{BAD}"}}' in router.metrics()

    # recovered: after the ejection one probe request closes the circuit again
    fleet.fault("pass")
    time.sleep(1.6)

    def served_by_bad() -> bool:
        status, headers, _ = router.post("/v1/completions",
                                         {"prompt": new_prompt(rng), "max_tokens": 1})
        return status == 200 and headers["x-prefix-router-replica"] == BAD

    wait_for(served_by_bad, 20, interval_s=0.0, message="traffic back on the recovered replica")
    assert replica_state(router, BAD)["circuit"] == "closed"


def test_failed_requests_never_make_a_replica_more_attractive(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    """Cold placement goes to the replica with the fewest recent KV writes; a request a replica
    failed must keep its writes counted, or a replica failing everything attracts every new
    prefix. The circuit breaker is off here, so only the write accounting is tested."""
    router = fleet.router(tmp_path, "--circuit-failures", "1000")
    routers.append(router)
    fleet.fault("500")
    before = fleet.fault()["generate_requests"]
    rng = random.Random(22)
    num = 16
    for _ in range(num):
        status, _, raw = router.post("/v1/completions", {"prompt": new_prompt(rng), "max_tokens": 1})
        assert status == 200, raw[:300]
    got = fleet.fault()["generate_requests"] - before
    assert got <= num * 0.6, f"the failing replica was sent {got} of {num} new prompts"


def _stream(router: Router, prompt: list[int], results: list[tuple[int, str, float]]) -> None:
    started = time.monotonic()
    status, headers, raw = router.post("/v1/completions", {
        "prompt": prompt, "max_tokens": 8, "stream": True}, timeout=60)
    ok = status == 200 and b"[DONE]" in raw and b'"error"' not in raw
    results.append((200 if ok else status or 599, headers.get("x-prefix-router-replica", ""),
                    time.monotonic() - started))


def test_a_hung_replica_is_benched_and_its_waiting_streams_move(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    stall_s = 2.0
    router = fleet.router(tmp_path, "--stall-timeout-s", str(stall_s))
    routers.append(router)
    fleet.fault("hang")
    rng = random.Random(23)
    results: list[tuple[int, str, float]] = []
    hung_at = time.monotonic()
    threads = []
    # a steady flow of streams (the healthy replica progresses) until the hung one is benched
    # and 1 s more, within a bound a busy machine cannot reach; the stall metric below says it
    # was the stall timeout that benched it (no wall-clock bound on when: that timed the machine)
    give_up_at = hung_at + stall_s + 60
    detected_at = None
    while time.monotonic() < (give_up_at if detected_at is None else detected_at + 1.0):
        t = threading.Thread(target=_stream, args=(router, new_prompt(rng), results))
        t.start()
        threads.append(t)
        time.sleep(0.1)
        if detected_at is None and replica_state(router, BAD)["circuit"] != "closed":
            detected_at = time.monotonic()
    assert detected_at is not None, "hung replica not benched"
    for t in threads:
        t.join(60)
    assert all(status == 200 for status, _, _ in results), results
    assert {rid for _, rid, _ in results} == {"replica-0"}  # moved ones end on the good replica
    metrics = router.metrics()
    assert f'router_upstream_errors_total{{kind="stalled",replica="{BAD}"}} 1.0' in metrics
    assert 'router_upstream_retries_total{cause="stalled"}' in metrics


def _closed_loop(router: Router, seed: int, stop: threading.Event,
                 results: list[tuple[int, str]]) -> None:
    """One client sending non-streamed prompts, each once the previous one is answered."""
    rng = random.Random(seed)
    while not stop.is_set():
        status, headers, _ = router.post("/v1/completions", {"prompt": new_prompt(rng),
                                                             "max_tokens": 1}, timeout=120)
        results.append((status, headers.get("x-prefix-router-replica", "")))


def _hang_under_two_clients(fleet: FaultFleet, router: Router, seed: int) -> tuple[
        dict[str, Any], threading.Event, list[tuple[int, str]], list[threading.Thread]]:
    """Both replicas answer a few prompts, then the bad one hangs and two ``_closed_loop``
    clients start. Returns the fault proxy's counts at the hang, the clients' stop event,
    their results and threads."""
    rng = random.Random(seed)
    for _ in range(4):  # a fleet at work: both replicas answered lately
        assert router.post("/v1/completions", {"prompt": new_prompt(rng), "max_tokens": 1})[0] == 200
    fleet.fault("hang")
    counts = fleet.fault()
    stop = threading.Event()
    results: list[tuple[int, str]] = []
    threads = [threading.Thread(target=_closed_loop, args=(router, seed + 1 + i, stop, results))
               for i in range(2)]
    for t in threads:
        t.start()
    return counts, stop, results, threads


def test_a_hung_replica_fed_only_non_streamed_prompts_is_benched_after_few(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    """Issue 29: a replica that accepts prompts and never answers kept drawing non-streamed
    ones under default settings (600 s first-byte timeout, stall detection for streams only).
    Default settings here. Two clients in a closed loop: at most two prompts wait on the hung
    replica at once, so it must be benched having been sent at most three (a half-open probe
    included), and every prompt sent there is answered by the other replica (moved before its
    first byte)."""
    router = fleet.router(tmp_path)
    routers.append(router)
    counts, stop, results, threads = _hang_under_two_clients(fleet, router, 29)
    before = counts["generate_requests"]
    try:
        wait_for(lambda: replica_state(router, BAD)["circuit"] != "closed", 90,
                 message="the hung replica benched")
        sent = fleet.fault()["generate_requests"] - before
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert 1 <= sent <= 3, sent
    assert results and all(status == 200 for status, _ in results), results
    assert {rid for _, rid in results} == {"replica-0"}, results
    metrics = router.metrics()
    assert any(f'router_upstream_errors_total{{kind="{kind}",replica="{BAD}"}}' in metrics
               for kind in ("hung", "first_byte_deadline")), metrics


def test_a_replica_busy_far_past_its_deadline_is_neither_benched_nor_moved(
        tmp_path: Path) -> None:
    """The other side of the deadlines: a healthy replica generating a long non-streamed answer
    sends no byte for far longer than its deadline (a 3 s floor and factor 1 here, an emulator
    at wall-clock speed: 1,500 tokens take about 8 s), while the other replica answered lately.
    Its engine reports the request running and its KV events keep coming: it stays in rotation
    and the request is answered where it was sent."""
    with RedisServer() as redis:
        fleet = FaultFleet(tmp_path, redis.url, time_scale="1")
        router = None
        try:
            router = fleet.router(tmp_path, "--first-byte-deadline-floor-s", "3",
                                  "--first-byte-deadline-factor", "1")
            rng = random.Random(31)
            served = set()
            while served != {"replica-0", "replica-1"}:  # both answered lately
                status, headers, _ = router.post("/v1/completions", {"prompt": new_prompt(rng),
                                                                     "max_tokens": 1})
                assert status == 200
                served.add(headers["x-prefix-router-replica"])
            started = time.monotonic()
            status, headers, raw = router.post("/v1/completions", {
                "prompt": new_prompt(rng), "max_tokens": 1500, "ignore_eos": True}, timeout=120)
            assert status == 200, raw[:300]
            assert time.monotonic() - started > 4.5  # far past the 3 s deadline: a real test
            metrics = router.metrics()
            for kind in ("hung", "first_byte_deadline"):
                assert f'kind="{kind}"' not in metrics, metrics
            assert all(r["circuit"] == "closed" for r in router.ready()["replicas"])
        finally:
            if router is not None:
                print(router.stop()[-2000:])
            fleet.stop()


def test_first_byte_timeouts_count_as_errors_and_bench_the_replica(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    router = fleet.router(tmp_path, "--first-byte-timeout-s", "0.5", "--circuit-failures", "2")
    routers.append(router)
    fleet.fault("hang")
    rng = random.Random(24)
    statuses = []
    for _ in range(8):
        status, headers, _ = router.post("/v1/completions", {"prompt": new_prompt(rng),
                                                             "max_tokens": 1})
        statuses.append((status, headers.get("x-prefix-router-replica")))
    timeouts = [s for s in statuses if s[0] == 504]
    assert all(rid == BAD for _, rid in timeouts)
    assert 1 <= len(timeouts) <= 2, statuses  # then its circuit is open
    assert all(s == (200, "replica-0") for s in statuses if s[0] != 504), statuses
    assert replica_state(router, BAD)["circuit"] == "open"
    assert (f'router_upstream_errors_total{{kind="first_byte_timeout",replica="{BAD}"}} '
            f'{float(len(timeouts))}' in router.metrics())


def test_a_4_s_stall_keeps_the_replica_in_rotation(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    """One slow probe is not an outage: neither the worker's engine polls (heartbeat) nor the
    router's /health probes of a static replica drop a replica that stalls for 4 s."""
    reported = fleet.router(tmp_path)
    static = fleet.router(tmp_path, "--static-probe-interval-s", "0.5", static=True)
    routers.extend([reported, static])
    static_bad = next(r["replica_id"] for r in static.ready()["replicas"]
                      if fleet.proxy_url.endswith(r["replica_id"]))
    fleet.fault("hang", scope="all")
    out = []
    until = time.monotonic() + 7.0  # the stall and the probes caught in it timing out
    try:
        while time.monotonic() < until:
            if time.monotonic() > until - 3.0:
                fleet.fault("pass")
            for router, rid in ((reported, BAD), (static, static_bad)):
                state = next((r for r in router.ready()["replicas"] if r["replica_id"] == rid),
                             None)
                if state is None or not state["routable"]:
                    out.append((rid, round(until - time.monotonic(), 1), state))
            time.sleep(0.2)
    finally:
        fleet.fault("pass")
    assert out == []


def probes(router: Router, result: str) -> float:
    """``router_circuit_probes_total`` of the bad replica with ``result``."""
    series = f'router_circuit_probes_total{{replica="{BAD}",result="{result}"}} '
    return sum(float(line[len(series):]) for line in router.metrics().splitlines()
               if line.startswith(series))


def test_a_hung_replica_gets_only_router_probes_and_traffic_back_once_one_succeeds(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path) -> None:
    """Issue 29: a benched replica's half-open probe was a client's prompt, which waited a whole
    deadline on a hung replica before moving (5 of 60 prompts reached one over 120 s). With a
    1 s ejection the circuit half-opens several times while two clients keep sending
    non-streamed prompts for 20 s: at most 3 client prompts ever reach the hung replica (those before it
    was benched), the rest there are the router's own probes. Once it answers again, a probe
    succeeds and it takes client prompts again."""
    router = fleet.router(tmp_path, "--circuit-ejection-s", "1", "--circuit-max-ejection-s", "2")
    routers.append(router)
    rng = random.Random(32)
    start, stop, results, threads = _hang_under_two_clients(fleet, router, 40)
    try:
        wait_for(lambda: replica_state(router, BAD)["circuit"] != "closed", 90,
                 message="the hung replica benched")
        # several half-open rounds (1 s, then 2 s ejections) with clients sending throughout
        time.sleep(20)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    end = fleet.fault()
    probed = end["probe_requests"] - start["probe_requests"]
    client_prompts = end["generate_requests"] - start["generate_requests"] - probed
    assert 1 <= client_prompts <= 3, (probed, client_prompts)
    assert probed >= 2 and probes(router, "failed") >= 2, probed
    assert results and all(status == 200 for status, _ in results), results
    assert {rid for _, rid in results} == {"replica-0"}, results

    fleet.fault("pass")  # recovered: the next probe succeeds and client prompts come back
    wait_for(lambda: replica_state(router, BAD)["circuit"] == "closed", 30,
             message="circuit closed after a successful probe")
    assert probes(router, "ok") >= 1

    def served_by_bad() -> bool:
        status, headers, _ = router.post("/v1/completions",
                                         {"prompt": new_prompt(rng), "max_tokens": 1})
        return status == 200 and headers["x-prefix-router-replica"] == BAD

    wait_for(served_by_bad, 30, interval_s=0.0, message="client prompts back on the replica")


@pytest.mark.parametrize("mode", ["401", "404"])
def test_a_probe_answered_by_the_api_server_alone_does_not_close_the_circuit(
        fleet: FaultFleet, routers: list[Router], tmp_path: Path, mode: str) -> None:
    """A half-open probe proves the replica serves only with a completion: a 401 (a replica
    with API keys of its own) or a 404 (a model it does not serve) comes from vLLM's API
    server without the engine. (Any answer below 500 closed the circuit.)"""
    router = fleet.router(tmp_path, "--circuit-ejection-s", "0.5", "--circuit-max-ejection-s",
                          "0.5")
    routers.append(router)
    rng = random.Random(int(mode))
    fleet.fault("500")
    for _ in range(6):
        router.post("/v1/completions", {"prompt": new_prompt(rng), "max_tokens": 1})
    wait_for(lambda: replica_state(router, BAD)["circuit"] != "closed", 30,
             message="circuit opened by 500s")
    fleet.fault(mode)
    failed = probes(router, "failed")
    wait_for(lambda: probes(router, "failed") >= failed + 3, 60,
             message=f"three probes answered {mode}")
    assert replica_state(router, BAD)["circuit"] != "closed"
    assert probes(router, "ok") == 0
    fleet.fault("pass")  # a completion: the next probe closes it
    wait_for(lambda: replica_state(router, BAD)["circuit"] == "closed", 30,
             message="circuit closed after a completion")
