"""Data-parallel engines in the chart (``fleet.dataParallelSize``), rendered offline as in
``test_chart``: the engine gets ``--data-parallel-size``, the worker sidecar follows every rank
(checked by feeding the rendered arguments and environment to the emulator's and the worker's
own parsers and port rules), the pod's ports stay distinct, every rank's worker metrics port is
listed, scraped and let through the NetworkPolicy, one rank renders as before, and values whose
rank ports overlap fail the render with a message that names them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import requests

from loadtest.harness.processes import stop_processes
from tests.helm.test_chart import (
    FULLNAME,
    NAMESPACE,
    RELEASE,
    chart,
    containers,
    env_of,
    flag,
    one,
    render,
)
from tests.helpers import PYTHON, free_port, free_port_run, start_process, wait_for

__all__ = ["chart"]  # the module fixture, shared

POD = f"{FULLNAME}-fleet-0"
SCRAPERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
OBSERVED = {"networkPolicy": {"enabled": True, "metricsFrom": SCRAPERS},
            "metrics": {"serviceMonitor": {"enabled": True}}}
DP_VLLM = {"fleet": {"dataParallelSize": 2, "vllm": {"tensorParallelSize": 2}}, **OBSERVED}
DP_EMULATOR = {"fleet": {"engine": "emulator", "dataParallelSize": 4}, **OBSERVED}


def pod_env(worker: dict[str, Any]) -> dict[str, str]:
    """The worker's environment as the kubelet gives it: downward-API values filled in for pod
    ``POD`` and ``$(VAR)`` references expanded."""
    env: dict[str, str] = {}
    for name, value in env_of(worker).items():
        if isinstance(value, dict):
            field = value["fieldRef"]["fieldPath"]
            value = {"metadata.name": POD, "metadata.namespace": NAMESPACE}[field]
        env[name] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
    return env


def tcp_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def fleet_ports(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The fleet pod's ports as each object lists them: the worker's container ports, the
    headless Service's, the fleet ServiceMonitor's endpoints and the NetworkPolicy's scraper
    rule."""
    worker = containers(objects, "StatefulSet", "-fleet")["worker"]
    service = one(objects, "Service", "-fleet")["spec"]["ports"]
    monitor = one(objects, "ServiceMonitor", "-fleet")["spec"]["endpoints"]
    policy = one(objects, "NetworkPolicy", "-fleet")["spec"]["ingress"]
    (scrape_rule,) = [r for r in policy if r["from"] == SCRAPERS]
    return {
        "container": {p["name"]: p["containerPort"] for p in worker["ports"]},
        "service": {p["name"]: (p["port"], p["targetPort"]) for p in service},
        "scraped": [e["port"] for e in monitor],
        "allowed": [p["port"] for p in scrape_rule["ports"]],
    }


def test_one_rank_renders_as_before(chart: helm.Chart) -> None:
    """fleet.dataParallelSize 1 (the default) adds nothing: no DP flag or variable, replay on
    5558, one worker metrics port. (The whole render of every value set of ``test_chart`` was
    also compared byte for byte with the chart before the option.)"""
    values = {"fleet": {"dataParallelSize": 1, "vllm": {"tensorParallelSize": 2}}, **OBSERVED}
    objects = render(chart, values)
    assert objects == render(chart, {**OBSERVED, "fleet": {"vllm": {"tensorParallelSize": 2}}})
    engine, worker = (containers(objects, "StatefulSet", "-fleet")[c] for c in ("engine", "worker"))
    assert "--data-parallel-size" not in engine["args"]
    assert "WORKER_DATA_PARALLEL_SIZE" not in env_of(worker)
    kv = json.loads(flag(engine["args"], "--kv-events-config") or "{}")
    assert (kv["endpoint"], kv["replay_endpoint"]) == ("ipc:///run/kv-events/publisher",
                                                       "tcp://127.0.0.1:5558")
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert fleet_ports(objects) == {
        "container": {"worker-metrics": 9100},
        "service": {"http": (8000, "http"), "worker-metrics": (9100, "worker-metrics")},
        "scraped": ["http", "worker-metrics"],
        "allowed": ["http", "worker-metrics"],
    }


@pytest.mark.parametrize("values", [DP_VLLM, DP_EMULATOR], ids=["vllm-dp2-tp2", "emulator-dp4"])
def test_every_rank_is_followed_on_its_own_ports_and_scraped(
        chart: helm.Chart, values: dict[str, Any]) -> None:
    from router.shared.kv_event_sources import offset_sources
    from worker.emulator.config import from_args, replica_endpoint
    from worker.report import rank_configs
    from worker.report_config import load_config

    dp = values["fleet"]["dataParallelSize"]
    emulated = values["fleet"].get("engine") == "emulator"
    objects = render(chart, values)
    engine, worker = (containers(objects, "StatefulSet", "-fleet")[c] for c in ("engine", "worker"))
    args = engine["args"]
    assert flag(args, "--data-parallel-size") == str(dp)

    # where each rank binds: the emulator's own rule on its parsed arguments, vLLM's
    # offset_endpoint_port (the tcp port + the rank) on the --kv-events-config JSON
    kv = json.loads(flag(args, "--kv-events-config") or "{}")
    if emulated:
        env = {k: v for k, v in env_of(engine).items() if isinstance(v, str)}
        cfg = from_args(args, env)
        assert cfg.data_parallel_size == dp and cfg.replicas == 1
        ev = cfg.kv_events
        assert ev.replay_endpoint is not None
        bound = [(tcp_port(replica_endpoint(ev.endpoint, 0, cfg.host, r, dp).address),
                  tcp_port(replica_endpoint(ev.replay_endpoint, 0, cfg.host, r, dp).address))
                 for r in range(dp)]
    else:
        assert flag(args, "--tensor-parallel-size") == "2"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2 * dp, "one TP group per rank"
        assert engine["resources"]["requests"]["nvidia.com/gpu"] == 2 * dp
        bound = [(tcp_port(kv["endpoint"]) + r, tcp_port(kv["replay_endpoint"]) + r)
                 for r in range(dp)]

    # the worker's own loader and rank split: one worker per rank, on that rank's sockets
    config = load_config([], pod_env(worker))
    assert config.data_parallel_size == dp
    sources = offset_sources(config.kv_events_endpoint, config.kv_replay_endpoint,
                             config.kv_events_topic, config.data_parallel_size)
    ranks = rank_configs(config, sources)
    assert [c.replica_id for c in ranks] == [f"{POD}#{r}" for r in range(dp)]
    assert [(tcp_port(c.kv_events_endpoint), tcp_port(c.kv_replay_endpoint or "")) for c in ranks] == bound
    assert all(c.kv_events_endpoint.startswith("tcp://127.0.0.1:") for c in ranks)

    # every port in the pod is distinct
    engine_port = engine["ports"][0]["containerPort"]
    metrics = [c.metrics_port for c in ranks]
    in_pod = [engine_port, *(p for pair in bound for p in pair), *metrics]
    assert len(set(in_pod)) == len(in_pod) == 1 + 3 * dp, in_pod

    # each rank's metrics port (where its worker serves) is listed, in the Service, scraped
    # and let through by the scrapers' NetworkPolicy rule
    names = ["worker-metrics", *(f"worker-dp{r}" for r in range(1, dp))]
    ports = fleet_ports(objects)
    assert ports["container"] == dict(zip(names, metrics, strict=True))
    assert all(len(n) <= 15 for n in names), "a container port name has at most 15 characters"
    assert ports["service"] == {"http": (engine_port, "http")} | {
        n: (p, n) for n, p in zip(names, metrics, strict=True)}
    assert ports["scraped"] == ports["allowed"] == ["http", *names]
    # the worker's probes stay on rank 0's port (one process serves every rank)
    assert worker["livenessProbe"]["httpGet"]["port"] == "worker-metrics"


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        ({"dataParallelSize": 2, "kvEvents": {"replayPort": 5558}},
         "fleet ports collide with fleet.dataParallelSize=2: port 5558 is both rank 1's KV events "
         "port (fleet.kvEvents.port + 1) and rank 0's KV replay port (fleet.kvEvents.replayPort + 0)"),
        ({"dataParallelSize": 4, "worker": {"metricsPort": 5563}},
         "port 5563 is both rank 2's KV replay port (fleet.kvEvents.replayPort + 2) and rank 0's "
         "worker metrics port (fleet.worker.metricsPort + 0)"),
        ({"dataParallelSize": 2, "port": 5558},
         "port 5558 is both the engine's HTTP port (fleet.port) and rank 1's KV events port"),
        ({"dataParallelSize": 2, "kvEvents": {"port": 65534}},
         "fleet.dataParallelSize=2 puts rank 0's KV replay port (fleet.kvEvents.replayPort + 0) "
         "at 65536, beyond 65535"),
        ({"dataParallelSize": 0}, "at '/fleet/dataParallelSize': minimum: got 0, want 1"),
        ({"dataParallelSize": 1.5}, "at '/fleet/dataParallelSize'"),
    ],
    ids=["replay-on-rank-1-events", "metrics-on-replay", "http-on-events", "beyond-65535",
         "zero-ranks", "fractional"],
)
def test_overlapping_rank_ports_fail_the_render(
        chart: helm.Chart, fleet: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render({"fleet": fleet}, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)


def test_explicit_replay_port_renders_while_the_ranges_are_apart(chart: helm.Chart) -> None:
    """The refusal is about overlap, not about setting the port: 5558 is fine for one rank, and
    a replay range placed apart is used as given."""
    for fleet, replay in (({"kvEvents": {"replayPort": 5558}}, 5558),
                          ({"dataParallelSize": 8, "kvEvents": {"replayPort": 5657}}, 5657)):
        engine = containers(render(chart, {"fleet": fleet}), "StatefulSet", "-fleet")["engine"]
        kv = json.loads(flag(engine["args"], "--kv-events-config") or "{}")
        assert kv["replay_endpoint"] == f"tcp://127.0.0.1:{replay}"


@pytest.mark.timeout(120)
def test_the_rendered_pod_runs_every_rank(chart: helm.Chart, redis_url: str, tmp_path: Path) -> None:
    """Run the rendered emulator command and worker environment of a DP=2 pod (on loopback, the
    ports moved to free ones through the chart's own values, the Redis URL the test's): the worker
    reports both ranks as replicas <pod>#0 and <pod>#1 with the engine's URL and their rank, and
    serves each rank's metrics on the port the chart lists for it."""
    import redis as redis_lib

    from router.shared import contract
    from worker.emulator.tokenizer import default_tokenizer_dir

    dp = 2
    values = {"fleet": {"engine": "emulator", "dataParallelSize": dp, "port": free_port(),
                        "kvEvents": {"port": free_port_run(2 * dp)},
                        "worker": {"metricsPort": free_port_run(dp)}}}
    objects = render(chart, values)
    engine, worker = (containers(objects, "StatefulSet", "-fleet")[c] for c in ("engine", "worker"))
    assert engine["command"] == ["prefix-worker", "emulate"]
    args = ["127.0.0.1" if a == "0.0.0.0" else a for a in engine["args"]]
    args[args.index("--tokenizer") + 1] = default_tokenizer_dir()
    engine_env = {k: v for k, v in env_of(engine).items() if isinstance(v, str)}
    engine_env["HF_HOME"] = str(tmp_path / "hf")
    env = pod_env(worker) | {"WORKER_REDIS_URL": redis_url, "WORKER_METRICS_HOST": "127.0.0.1"}
    assert worker["command"] == ["prefix-worker", "report"] and "args" not in worker
    procs = [start_process([PYTHON, "-m", "worker.cli", "emulate", *args], env=engine_env),
             start_process([PYTHON, "-m", "worker.cli", "report"], env=env)]
    client = redis_lib.Redis.from_url(redis_url)
    try:
        def beat(rank: int) -> dict[str, str]:
            raw: Any = client.hgetall(contract.replica_key("pr", f"{POD}#{rank}"))
            return {k.decode(): v.decode() for k, v in raw.items()}

        wait_for(lambda: all(beat(r) for r in range(dp)), 60, message="both ranks reported",
                 procs=procs)
        engine_url = f"http://127.0.0.1:{values['fleet']['port']}"
        for rank in range(dp):
            fields = beat(rank)
            assert fields[contract.F_DP_RANK] == str(rank)
            assert fields[contract.F_URL] == env["WORKER_ADVERTISE_URL"] != engine_url
        listed = {p["name"]: p["containerPort"] for p in worker["ports"]}
        assert len(listed) == dp
        for name, port in listed.items():
            page = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert page.status_code == 200 and "worker_" in page.text, name
    finally:
        client.close()
        stop_processes(procs)
