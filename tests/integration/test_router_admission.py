"""Admission (issue 33, step 1) through real processes: a router in front of replicas that hold
every completion while a flag file exists, so the test decides when room frees.

Checked: a request beyond the limit waits in the router's queue (the replica never sees it);
a queued request whose client disconnects leaves the queue at once and takes no slot; a full
queue and a wait past its bound are 503s, OpenAI-shaped, with ``Retry-After``; the decision is
made among the replicas with room; with no limit set, nothing waits.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import FAKE_REPLICA_TAIL, start_script_replica, stop_process, wait_for
from tests.integration.test_router_fleet import Router, http

pytestmark = pytest.mark.timeout(180)

HOLDING_REPLICA = """
import asyncio, os, sys
from aiohttp import web

HOLD = os.environ["HOLD_FLAG"]
arrived = []  # the prompts, in arrival order
priorities = []  # their bodies' priority (None: none)

async def completions(request):
    body = await request.json()
    arrived.append(body["prompt"])
    priorities.append(body.get("priority"))
    while os.path.exists(HOLD):
        await asyncio.sleep(0.01)
    return web.json_response({"id": "c", "object": "text_completion", "model": "fixed",
                              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

async def stats(request):
    return web.json_response({"arrived": arrived, "priorities": priorities})
""" + FAKE_REPLICA_TAIL.replace(
    'app.router.add_get("/health", health)',
    'app.router.add_get("/health", health)\napp.router.add_get("/stats", stats)')


class HoldingReplica:
    """A replica process answering completions only once ``release()`` removed its hold flag;
    ``prompts()`` lists the prompts it received, in order."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.hold_flag = tmp / f"{name}.hold"
        self.hold_flag.touch()
        self.proc, port = start_script_replica(
            HOLDING_REPLICA, env={"HOLD_FLAG": str(self.hold_flag)}, name=f"replica {name}")
        self.url = f"http://127.0.0.1:{port}"

    def prompts(self) -> list[str]:
        return list(json.loads(http("GET", self.url + "/stats", timeout=2)[2])["arrived"])

    def priorities(self) -> list[int | None]:
        return list(json.loads(http("GET", self.url + "/stats", timeout=2)[2])["priorities"])

    def arrived(self) -> int:
        return len(self.prompts())

    def release(self) -> None:
        self.hold_flag.unlink(missing_ok=True)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[HoldingReplica]]:
    with contextlib.ExitStack() as stack:
        started = []
        for i in range(2):
            started.append(HoldingReplica(tmp_path, f"replica-{i}"))
            stack.callback(stop_process, started[-1].proc)
            stack.callback(started[-1].release)  # (callbacks run last first: released, stopped)
        yield started


def start_router(tmp: Path, replicas: list[HoldingReplica], *flags: str) -> Router:
    args = [a for r in replicas for a in ("--replica", r.url)]
    router = Router(tmp, [*args, *flags])
    wait_for(lambda: all(r["routable"] for r in router.ready()["replicas"]), 30,
             message="replicas routable", procs=[router.proc])
    return router


BODY = {"model": "fixed", "prompt": "hello admission", "max_tokens": 1}


class Call:
    """One completion request on its own thread (the test waits on the router meanwhile)."""

    def __init__(self, router: Router, body: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.result: tuple[int, dict[str, str], bytes] | None = None
        self._thread = threading.Thread(target=self._run, args=(router, body or BODY, headers),
                                        daemon=True)
        self._thread.start()

    def _run(self, router: Router, body: dict[str, Any], headers: dict[str, str] | None) -> None:
        self.result = router.post("/v1/completions", body, headers=headers, timeout=90)

    def wait(self) -> tuple[int, dict[str, str], bytes]:
        self._thread.join(120)
        assert self.result is not None, "no answer"
        return self.result


def sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def admission(router: Router) -> dict[str, Any]:
    state: dict[str, Any] = router.ready()["admission"]
    return state


def assert_overloaded(result: tuple[int, dict[str, str], bytes], setting: str) -> None:
    status, headers, body = result
    assert status == 503, body
    assert int(headers["retry-after"]) >= 1
    error = json.loads(body)["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert setting in error["message"]


def test_a_queued_request_whose_client_leaves_frees_its_place(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    router = start_router(tmp_path, replicas[:1], "--admission-max-inflight", "1")
    replica = replicas[0]
    try:
        first = Call(router)
        wait_for(lambda: replica.arrived() == 1, 30, message="first request at the replica")
        # a raw client that sends its request and leaves while it waits in the queue
        payload = json.dumps(BODY).encode()
        host, port = router.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(payload), payload))
            wait_for(lambda: admission(router)["queued"] == 1, 30, message="request queued")
        wait_for(lambda: admission(router)["queued"] == 0, 30, message="gone client dequeued")
        assert sample(router.metrics(), "router_admission_requests_total",
                      outcome="cancelled") == 1
        third = Call(router)
        wait_for(lambda: admission(router)["queued"] == 1, 30, message="third request queued")
        assert replica.arrived() == 1  # it waits in the router, not at the replica
        replica.release()
        assert first.wait()[0] == 200 and third.wait()[0] == 200
        assert replica.arrived() == 2  # the gone client's request never went out
        wait_for(lambda: admission(router)["admitted"] == 0, 30, message="slots released")
        metrics = router.metrics()
        assert sample(metrics, "router_admission_requests_total", outcome="admitted",
                      queued="1") == 1
        assert sample(metrics, "router_admission_wait_seconds_count") == 2
    finally:
        router.stop()


def test_full_queue_and_wait_bound_answer_503_with_retry_after(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    router = start_router(tmp_path, replicas[:1], "--admission-max-inflight", "1",
                          "--admission-max-queue-length", "1",
                          "--admission-max-queue-wait-s", "1")
    replica = replicas[0]
    try:
        first = Call(router)
        wait_for(lambda: replica.arrived() == 1, 30, message="first request at the replica")
        waiting = Call(router)
        wait_for(lambda: admission(router)["queued"] == 1, 30, message="second request queued")
        explained = json.loads(router.post("/debug/route", BODY)[2])["admission"]
        assert not explained["admit"] and explained["queued"] == 1
        assert "admission_max_inflight 1" in explained["wait_reason"]
        assert_overloaded(router.post("/v1/completions", BODY), "admission_max_queue_length")
        # the queued one gets its 503 at its bound, while the first still holds the slot
        assert_overloaded(waiting.wait(), "admission_max_queue_wait_s")
        assert first.result is None and replica.arrived() == 1
        replica.release()
        assert first.wait()[0] == 200
        metrics = router.metrics()
        for reason, queued in (("queue_full", "0"), ("queue_timeout", "1")):
            assert sample(metrics, "router_admission_requests_total", outcome="shed",
                          queued=queued, reason=reason) == 1
        assert sample(metrics, "router_requests_total", replica="", status="503") == 2
    finally:
        router.stop()


def test_the_decision_is_made_among_replicas_with_room(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    # one request per replica: the same prompt's ring home is taken, the second goes elsewhere
    router = start_router(tmp_path, replicas, "--admission-max-inflight-per-replica", "1")
    try:
        calls = [Call(router), Call(router)]
        wait_for(lambda: [r.arrived() for r in replicas] == [1, 1], 30,
                 message="one request on each replica")
        third = Call(router)
        wait_for(lambda: admission(router)["queued"] == 1, 30, message="third request queued")
        for replica in replicas:
            replica.release()
        assert [c.wait()[0] for c in (*calls, third)] == [200, 200, 200]
        assert sum(r.arrived() for r in replicas) == 3
    finally:
        router.stop()


def test_without_limits_nothing_waits(tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    router = start_router(tmp_path, replicas[:1])
    replica = replicas[0]
    try:
        assert admission(router)["enabled"] is False
        calls = [Call(router) for _ in range(4)]
        wait_for(lambda: replica.arrived() == 4, 30, message="every request at the replica")
        assert admission(router)["queued"] == 0
        replica.release()
        assert [c.wait()[0] for c in calls] == [200] * 4
    finally:
        router.stop()


def test_priority_classes_leave_the_queue_in_order(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    # no aging: the order is the classes' alone, however slowly this machine queues them
    router = start_router(tmp_path, replicas[:1], "--admission-max-inflight", "1",
                          "--admission-priority-aging-s", "0")
    replica = replicas[0]

    def body(prompt: str, **extra: Any) -> dict[str, Any]:
        return {**BODY, "prompt": prompt, **extra}

    try:
        first = Call(router, body("first"))
        wait_for(lambda: replica.arrived() == 1, 30, message="first request at the replica")
        queued = [Call(router, body("batch"), {"x-priority-class": "batch"}),
                  Call(router, body("standard")),  # the default class
                  Call(router, body("vllm-priority-0", priority=0))]  # the body's priority
        wait_for(lambda: admission(router)["queued"] == 3, 30, message="three requests queued")
        status, _, answer = router.post("/v1/completions", body("x"),
                                        headers={"x-priority-class": "urgent"})
        assert status == 400 and "unknown priority class 'urgent'" in answer.decode()
        replica.release()
        assert [c.wait()[0] for c in (first, *queued)] == [200] * 4
        assert replica.prompts() == ["first", "vllm-priority-0", "standard", "batch"]
        metrics = router.metrics()
        for cls, count in (("interactive", 1), ("standard", 2), ("batch", 1)):
            assert sample(metrics, "router_admission_requests_total", outcome="admitted",
                          priority_class=cls) == count
    finally:
        router.stop()


def test_the_class_reaches_the_engine_as_vllm_priority(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    router = start_router(tmp_path, replicas[:1], "--admission-max-inflight", "8",
                          "--admission-forward-priority")
    replica = replicas[0]
    replica.release()
    try:
        for headers in ({"x-priority-class": "batch"}, {}, {"x-priority-class": "interactive"}):
            assert router.post("/v1/completions", BODY, headers=headers)[0] == 200
        assert replica.priorities() == [2, 1, 0]  # vLLM serves lower values first
    finally:
        router.stop()


def test_no_tenant_sets_the_engines_priority_itself(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    """With API keys, a client's own body ``priority`` never reaches the engine: without
    forwarding it goes as vLLM's default 0, with forwarding (admission gate off) as the class
    rank (a reviewer's batch tenant sent -5 and it reached the engine as sent)."""
    from router.edges.auth import hash_key

    (tmp_path / "keys").write_text(f"tenant-b {hash_key('sk-b-key')}\n")
    (tmp_path / "secret").write_text("0123456789abcdef-test-secret\n")
    (tmp_path / "tenants.yaml").write_text("tenants:\n  tenant-b: {priority_class: batch}\n")
    keyed = ("--api-keys", str(tmp_path / "keys"), "--cache-salt-secret-file",
             str(tmp_path / "secret"), "--admission-tenants-file", str(tmp_path / "tenants.yaml"))
    auth = {"Authorization": "Bearer sk-b-key"}
    replica = replicas[0]
    replica.release()
    for flags, expected in (((), [0, None]), (("--admission-forward-priority",), [2, 2])):
        before = len(replica.priorities())
        router = start_router(tmp_path, replicas[:1], *keyed, *flags)
        try:
            assert router.post("/v1/completions", {**BODY, "priority": -5}, headers=auth)[0] == 200
            assert router.post("/v1/completions", BODY, headers=auth)[0] == 200
            assert replica.priorities()[before:] == expected
        finally:
            router.stop()


def test_tenants_of_one_class_take_turns_by_weight(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    """Deficit round robin between API-key tenants: a tenant that queued one request behind
    another's three goes second, not fourth; a tenant file's class is its requests' default."""
    from router.edges.auth import hash_key

    keys = {"tenant-a": "sk-a-key", "tenant-b": "sk-b-key", "nightly": "sk-n-key"}
    (tmp_path / "keys").write_text("".join(f"{t} {hash_key(k)}\n" for t, k in keys.items()))
    (tmp_path / "secret").write_text("0123456789abcdef-test-secret\n")
    (tmp_path / "tenants.yaml").write_text("tenants:\n  nightly: {priority_class: batch}\n")
    router = start_router(tmp_path, replicas[:1], "--admission-max-inflight", "1",
                          "--admission-priority-aging-s", "0",
                          "--api-keys", str(tmp_path / "keys"),
                          "--cache-salt-secret-file", str(tmp_path / "secret"),
                          "--admission-tenants-file", str(tmp_path / "tenants.yaml"))
    replica = replicas[0]

    def call(tenant: str, name: str, **headers: str) -> Call:
        # 100 tokens (at 4 characters a token): a prefill cost well above the fairness quantum
        return Call(router, {**BODY, "prompt": name + " pad" * 100},
                    {"Authorization": f"Bearer {keys[tenant]}", **headers})

    try:
        calls = [call("tenant-b", "first")]
        wait_for(lambda: replica.arrived() == 1, 30, message="first request at the replica")
        calls.append(call("nightly", "nightly"))  # the batch class: after both tenants
        for i in range(3):
            calls.append(call("tenant-b", f"b{i}"))
            wait_for(lambda i=i: admission(router)["queued"] == i + 2, 30, message="queued")
        # a tenant may lower its class, never raise it above its tenant file's
        calls.append(call("nightly", "nightly-claims-interactive",
                          **{"x-priority-class": "interactive"}))
        calls.append(call("tenant-a", "a0"))
        wait_for(lambda: admission(router)["queued"] == 6, 30, message="six requests queued")
        replica.release()
        assert [c.wait()[0] for c in calls] == [200] * len(calls)
        assert [p.split()[0] for p in replica.prompts()] == [
            "first", "b0", "a0", "b1", "b2", "nightly", "nightly-claims-interactive"]
    finally:
        router.stop()


def test_a_request_predicted_to_miss_its_ttft_target_waits_then_is_shed(
        tmp_path: Path, replicas: list[HoldingReplica]) -> None:
    # SLO-aware admission: at 100 prefill tokens/s (the prior: no first token observed) a
    # 400-character prompt (100 tokens) predicts 1 s on an idle replica, within the 1.5 s target;
    # behind the first one (held by the replica, its prefill still queued there) 2 s: it waits
    # while 1 s on an idle replica could still meet the target, then is shed
    router = start_router(tmp_path, replicas[:1], "--admission-max-inflight", "100",
                          "--ttft-prior-tokens-per-s", "100",
                          "--admission-ttft-targets", "interactive=1.5",
                          "--admission-default-priority-class", "interactive")
    body = {**BODY, "prompt": "x" * 400}
    replica = replicas[0]
    try:
        first = Call(router, body)
        wait_for(lambda: replica.arrived() == 1, 30, message="first request at the replica")
        explained = json.loads(router.post("/debug/route", body, timeout=10)[2])["admission"]
        assert explained["slo"] == "wait" and explained["ttft_target_s"] == 1.5, explained
        assert not explained["admit"] and "TTFT target" in explained["wait_reason"]
        second = Call(router, body)
        assert_overloaded(second.wait(), "TTFT target")
        assert replica.arrived() == 1  # never sent
        metrics = router.metrics()
        assert sample(metrics, "router_admission_requests_total", outcome="shed",
                      reason="ttft_target", priority_class="interactive") == 1
        assert sample(metrics, "router_admission_slo_requests_total", outcome="shed") == 1
        assert sample(metrics, "router_admission_slo_requests_total", outcome="meets") == 1
        replica.release()
        assert first.wait()[0] == 200
    finally:
        router.stop()
