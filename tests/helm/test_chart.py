"""Offline tests of the Helm chart in ``helm/prefix-router``.

No cluster and no ``helm`` binary: the chart is rendered and linted by Helm's own
Go engine through ``helm-python-sdk`` (``helm_python``, which bundles libhelm),
every rendered object is validated with ``kubernetes-validate --strict`` against
Kubernetes ``KUBE_VERSION``, and the invariants the fleet depends on are
asserted on the parsed YAML: router and engines share block size, hash
algorithm and seed; every engine pod has a worker sidecar that subscribes to its
own pod's KV events and reports to the chart's Redis; bad values fail the
render with a clear message. Where the component's own config parser is in the
tree, the rendered config and arguments are also fed to it (router
``load_config``, emulator ``from_args``), so the chart cannot drift from the CLIs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "prefix-router"
RELEASE = "rel"
NAMESPACE = "llm"
FULLNAME = "rel-prefix-router"
KUBE_VERSION = "1.33.0"
# Custom resources: kubernetes-validate ships only the core API schemas, so these
# kinds are skipped explicitly (and only these; any other missing schema fails).
CRD_KINDS = frozenset({("monitoring.coreos.com/v1", "ServiceMonitor"),
                       ("gateway.networking.k8s.io/v1", "HTTPRoute")})
PRODUCTION_EXAMPLE = CHART_DIR / "examples" / "production-16.yaml"

# (value-set name, values, rendered objects)
Rendered = tuple[str, dict[str, Any], list[dict[str, Any]]]

BUNDLED_REDIS_URL = f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"
KV_IPC = "ipc:///run/kv-events/publisher"  # the engine's KV events PUB socket (one rank)

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "production-16": yaml.safe_load(PRODUCTION_EXAMPLE.read_text()),
    "edge-netpol-tracing": {
        "router": {
            "ingress": {"enabled": True, "className": "nginx",
                        "hosts": [{"host": "llm.example.com"}, {"host": "", "paths": [
                            {"path": "/v1", "pathType": "Prefix"}]}],
                        "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]},
            "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "gateway"}],
                          "hostnames": ["llm.example.com"], "timeouts": {"request": "600s"}},
            "autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None,
                            "inflightRequests": {"enabled": True, "targetAverageValue": 100}},
            "priorityClassName": "llm-routing", "logFormat": "json",
        },
        "fleet": {"priorityClassName": "llm-serving", "pdb": {"maxUnavailable": 2}},
        "redis": {"bundled": {"priorityClassName": "llm-state"}},
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        "tracing": {"otlpTracesEndpoint": "http://otel-collector.obs.svc:4318/v1/traces"},
    },
    "redis-cluster": {
        "redis": {"external": {"cluster": {"nodes": ["rc-0.rc:6379", "rc-1.rc:6379", "rc-2.rc:6379"]},
                               "tls": {"enabled": True, "caSecret": "redis-ca"}},
                  "auth": {"existingSecret": "redis-auth"}},
        "networkPolicy": {"enabled": True},
        "fleet": {"pdb": {"enabled": False}},
    },
    "redis-sentinel": {
        "redis": {"external": {"sentinel": {"nodes": ["s-0.s:26379", "s-1.s:26379"],
                                            "masterName": "mymaster", "db": 3}}},
    },
    "external-redis-tls": {
        "redis": {
            "external": {"url": "rediss://redis.example.com:6380/2", "tls": {"caSecret": "redis-ca"}},
            "auth": {"existingSecret": "redis-auth", "existingSecretPasswordKey": "password"},
        },
    },
    "tenant-auth": {
        # one Secret for the key file and the salt; every restriction on; Prometheus sends a key
        "router": {"auth": {"enabled": True, "existingSecret": "prefix-router-auth",
                            "keysKey": "api-keys", "saltSecret": {"name": "prefix-router-auth"},
                            "clientSalt": "reject", "adminTenants": ["ops", "sre.team"],
                            "debugAccess": "tenant", "metricsAccess": "admin"}},
        "metrics": {"serviceMonitor": {"enabled": True, "bearerTokenSecret": {
            "name": "prom-router-key", "key": "token"}}},
    },
    "tenant-auth-dir": {
        # keys as a directory Secret (one key per tenant), the salt in its own Secret
        "router": {"auth": {"enabled": True, "existingSecret": "tenant-keys",
                            "saltSecret": {"name": "salt", "key": "secret"}}},
    },
    "emulator": {
        "fleet": {"engine": "emulator", "replicas": 3, "emulator": {"timeScale": 0.5, "numGpuBlocks": 2048}},
    },
    "data-parallel": {
        # two ranks of TP 2 per replica, scraped and fenced per rank
        "fleet": {"dataParallelSize": 2, "vllm": {"tensorParallelSize": 2}},
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "data-parallel-emulator": {
        "fleet": {"engine": "emulator", "dataParallelSize": 4},
    },
    "hpa-pdb": {
        "router": {
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "pdb": {"enabled": True, "minAvailable": 1},
        },
    },
    "lora": {
        "model": {
            "loraAdapters": [
                {"name": "sql-lora", "path": "/adapters/sql-lora"},
                {"name": "chat-lora", "path": "org/chat-lora"},
            ],
        },
    },
    "xxhash-seed": {
        "model": {"hashAlgo": "xxhash", "hashSeed": "12345", "blockSize": 32},
        "redis": {"indexStride": 1},  # the exact index
        "fleet": {"vllm": {"tensorParallelSize": 4}},
    },
    "everything": {
        # a numeric seed (as `--set model.hashSeed=7` gives) and every optional object
        "model": {
            "hashAlgo": "xxhash_cbor", "hashSeed": 4294967295, "blockSize": 64,
            "servedModelName": "qwen3", "loraAdapters": [{"name": "a", "path": "/adapters/a"}],
            "hfToken": {"existingSecret": "hf"},
        },
        "redis": {
            "auth": {"existingSecret": "redis-auth"},
            "bundled": {"persistence": {"enabled": True}, "maxmemory": "2gb"},
        },
        "router": {
            "autoscaling": {"enabled": True}, "pdb": {"enabled": True},
            "extraVolumes": [{"name": "tok", "configMap": {"name": "tokenizer"}}],
            "extraVolumeMounts": [{"name": "tok", "mountPath": "/tokenizer", "readOnly": True}],
        },
        "fleet": {"engine": "emulator", "emulator": {"numGpuBlocks": 1000000}},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "grafana": {"dashboard": {"enabled": True}},
        "imagePullSecrets": [{"name": "regcred"}],
    },
}


# ------------------------------------------------------------------ rendering


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Render with Helm's engine; return every object, each tagged with its template path."""
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template__"] = path
                objects.append(doc)
    return objects


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, chart: helm.Chart) -> Rendered:
    values = VALUE_SETS[request.param]
    return request.param, values, render(chart, values)


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def router_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    cm = one(objects, "ConfigMap", "-router")
    cfg = yaml.safe_load(cm["data"]["router.yaml"])
    assert isinstance(cfg, dict)
    return cfg


def containers(objects: list[dict[str, Any]], kind: str, name_suffix: str) -> dict[str, dict[str, Any]]:
    pod = one(objects, kind, name_suffix)["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """{name: value or valueFrom} of a container's env list."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def flag(args: list[str], name: str) -> str | None:
    """Value following ``name`` in an argument list (None when absent)."""
    if name not in args:
        return None
    return args[args.index(name) + 1]


def flag_values(args: list[str], name: str) -> list[str]:
    """Values of an nargs='+' flag: everything after ``name`` up to the next ``--flag``."""
    if name not in args:
        return []
    out = []
    for arg in args[args.index(name) + 1:]:
        if arg.startswith("--"):
            break
        out.append(arg)
    return out


# ----------------------------------------------------------- lint & validation


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint_strict(value_set: str) -> None:
    report = helm.lint(CHART_DIR, VALUE_SETS[value_set], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_every_object_validates_strictly(rendered: Rendered) -> None:
    name, _, objects = rendered
    validated = []
    for obj in objects:
        template = obj.pop("__template__")
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"[{name}] {template}: {obj['kind']}/{obj['metadata']['name']} "
                        f"at {'.'.join(map(str, exc.path))}: {exc.message}")
        finally:
            obj["__template__"] = template
        validated.append(obj["kind"])
    for kind in ("Deployment", "Service", "ConfigMap", "StatefulSet", "ServiceAccount", "Pod"):
        assert kind in validated, f"[{name}] no {kind} rendered"


def test_strict_validation_can_fail() -> None:
    """The validator rejects an unknown field (guards against a validation that passes everything)."""
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}, "spce": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_expected_objects_per_value_set(rendered: Rendered) -> None:
    _, values, objects = rendered
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    external = external_redis_url(values) is not None
    router = values.get("router", {})
    assert (("Ingress", f"{FULLNAME}-router") in kinds) is router.get("ingress", {}).get("enabled", False)
    assert (("HTTPRoute", f"{FULLNAME}-router") in kinds) is router.get("httpRoute", {}).get("enabled", False)
    assert (("PodDisruptionBudget", f"{FULLNAME}-fleet") in kinds) is values.get("fleet", {}).get(
        "pdb", {}).get("enabled", True), "the fleet PDB is on by default"
    policies = {name for kind, name in kinds if kind == "NetworkPolicy"}
    if values.get("networkPolicy", {}).get("enabled"):
        want = {f"{FULLNAME}-fleet", f"{FULLNAME}-router"} | ({f"{FULLNAME}-redis"} if not external else set())
        assert policies == want
    else:
        assert policies == set()
    assert (("StatefulSet", f"{FULLNAME}-redis") in kinds) is not external
    assert (("Service", f"{FULLNAME}-redis") in kinds) is not external
    assert (("HorizontalPodAutoscaler", f"{FULLNAME}-router") in kinds) is router.get("autoscaling", {}).get("enabled", False)
    assert (("PodDisruptionBudget", f"{FULLNAME}-router") in kinds) is router.get("pdb", {}).get("enabled", False)
    monitors = [k for k in kinds if k[0] == "ServiceMonitor"]
    assert len(monitors) == (2 if values.get("metrics", {}).get("serviceMonitor", {}).get("enabled") else 0)
    deployment = one(objects, "Deployment", "-router")
    if router.get("autoscaling", {}).get("enabled"):
        assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    else:
        assert deployment["spec"]["replicas"] == 2


# ----------------------------------------------------------------- invariants


def external_redis_url(values: dict[str, Any]) -> str | None:
    """The external Redis URL ``values`` ask for (before the CA option), None for the bundled one:
    written here from the values' meaning, independently of the chart's helper."""
    ext = values.get("redis", {}).get("external", {})
    tls = "s" if ext.get("tls", {}).get("enabled") else ""
    if ext.get("url"):
        return str(ext["url"])
    if ext.get("cluster", {}).get("nodes"):
        return f"redis{tls}+cluster://" + ",".join(ext["cluster"]["nodes"])
    sentinel = ext.get("sentinel", {})
    if sentinel.get("nodes"):
        return (f"redis{tls}+sentinel://" + ",".join(sentinel["nodes"])
                + f"/{sentinel['masterName']}/{sentinel.get('db', 0)}")
    return None


def engine_settings(engine: dict[str, Any]) -> tuple[int, str, str | None]:
    args = engine["args"]
    env = env_of(engine)
    block_size = flag(args, "--block-size")
    algo = flag(args, "--prefix-caching-hash-algo")
    assert block_size is not None and algo is not None, args
    return int(block_size), algo, env.get("PYTHONHASHSEED")


def test_router_and_engines_agree_on_block_hashing(
    rendered: Rendered,
) -> None:
    name, values, objects = rendered
    model = values.get("model", {})
    cfg = router_config(objects)
    fleet = containers(objects, "StatefulSet", "-fleet")
    engine, worker = fleet["engine"], fleet["worker"]
    block_size, algo, seed = engine_settings(engine)
    worker_seed = env_of(worker).get("WORKER_HASH_SEED")

    assert (cfg["block_size"], cfg["hash_algo"]) == (block_size, algo), name
    assert cfg.get("hash_seed") == seed == worker_seed, name
    # ... and they are what the operator asked for (or vLLM's defaults)
    assert block_size == model.get("blockSize", 16)
    assert algo == model.get("hashAlgo", "sha256")
    want_seed = model.get("hashSeed")
    assert seed == (None if want_seed in (None, "") else str(want_seed))
    if algo.startswith("xxhash"):
        assert seed is not None and re.fullmatch(r"[0-9]+", seed)
    # one coarse-index stride for the routers and every worker, from redis.indexStride
    stride = values.get("redis", {}).get("indexStride", 16)
    assert cfg["index_stride"] == int(env_of(worker)["WORKER_INDEX_STRIDE"]) == stride, name
    # one served model name for clients, router and engine
    served = flag_values(engine["args"], "--served-model-name")
    assert served == [cfg["model"]] == [model.get("servedModelName") or model.get("name", "Qwen/Qwen3-8B")]


def test_lora_adapters_reach_the_engine_exactly(
    rendered: Rendered,
) -> None:
    _, values, objects = rendered
    adapters = values.get("model", {}).get("loraAdapters", [])
    engine = containers(objects, "StatefulSet", "-fleet")["engine"]
    args = engine["args"]
    assert flag_values(args, "--lora-modules") == [f"{a['name']}={a['path']}" for a in adapters]
    is_vllm = engine["command"] == ["vllm", "serve"]
    assert ("--enable-lora" in args) is (bool(adapters) and is_vllm)
    # the router learns adapters (name and path) from worker heartbeats, not from its config
    assert "lora_modules" not in router_config(objects)


def test_worker_sidecar_follows_its_own_engine(
    rendered: Rendered,
) -> None:
    _, values, objects = rendered
    sts = one(objects, "StatefulSet", "-fleet")
    pod = sts["spec"]["template"]["spec"]
    fleet = {c["name"]: c for c in pod["containers"]}
    assert set(fleet) == {"engine", "worker"}, "every engine pod carries exactly one worker sidecar"
    engine, worker = fleet["engine"], fleet["worker"]
    wenv = env_of(worker)
    assert worker["command"] == ["prefix-worker", "report"]

    # the engine publishes on pod-local sockets (ipc, loopback); the worker connects to them
    kv = json.loads(flag(engine["args"], "--kv-events-config") or "{}")
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    if int(values.get("fleet", {}).get("dataParallelSize", 1)) > 1:  # vLLM offsets tcp only
        port = int(kv["endpoint"].removeprefix("tcp://*:"))
        assert wenv["WORKER_KV_EVENTS_ENDPOINT"] == f"tcp://127.0.0.1:{port}"
    else:
        assert wenv["WORKER_KV_EVENTS_ENDPOINT"] == kv["endpoint"] == KV_IPC
    assert wenv["WORKER_KV_REPLAY_ENDPOINT"] == kv["replay_endpoint"]
    assert kv["replay_endpoint"].startswith("tcp://127.0.0.1:")
    engine_port = int(flag(engine["args"], "--port") or 0)
    assert engine["ports"][0]["containerPort"] == engine_port
    assert wenv["WORKER_ENGINE_URL"] == f"http://127.0.0.1:{engine_port}"

    # replica id and advertised URL come from the pod's own name via the downward API
    assert wenv["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    names = [e["name"] for e in worker["env"]]
    assert names.index("POD_NAME") < names.index("WORKER_REPLICA_ID") < names.index("WORKER_ADVERTISE_URL")
    assert wenv["WORKER_REPLICA_ID"] == "$(POD_NAME)"
    headless = one(objects, "Service", "-fleet")
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert wenv["WORKER_ADVERTISE_URL"] == (
        f"http://$(POD_NAME).{headless['metadata']['name']}.{NAMESPACE}.svc:{engine_port}")

    # the worker reports to the chart's Redis, the same one the routers read
    external = external_redis_url(values)
    cfg = router_config(objects)
    assert wenv["WORKER_REDIS_URL"] == cfg["redis_url"]
    assert wenv["WORKER_REDIS_PREFIX"] == cfg["redis_prefix"] == "pr"
    if external:
        assert cfg["redis_url"].startswith(external)
    else:
        assert cfg["redis_url"] == BUNDLED_REDIS_URL
        redis_svc = one(objects, "Service", "-redis")
        assert redis_svc["spec"]["ports"][0]["port"] == 6379


def bound_publicly(endpoint: str) -> bool:
    """Whether a ZMQ endpoint the engine binds listens beyond the pod (every address)."""
    return endpoint.startswith("tcp://") and endpoint[len("tcp://"):].rpartition(":")[0] in (
        "*", "0.0.0.0", "[::]", "::")


@pytest.mark.parametrize("dp", [1, 2])
def test_the_kv_event_sockets_stay_inside_the_pod(chart: helm.Chart, dp: int) -> None:
    """Issue 29 review: the engine's KV events sockets are reached from its own pod only. One
    rank: the PUB socket is an ipc socket in a memory volume only the engine and the worker
    mount, the replay socket binds loopback (vLLM binds a PUB endpoint only for ipc/inproc, "*"
    or "::"; its replay socket always). Data parallel: the PUBs bind every address (vLLM offsets
    only tcp ports per rank), and the NetworkPolicy admits no peer to those ports. (Before: both
    sockets bound tcp://*.)"""
    values = {"fleet": {"dataParallelSize": dp}, "networkPolicy": {"enabled": True}}
    objects = render(chart, values)
    pod = one(objects, "StatefulSet", "-fleet")["spec"]["template"]["spec"]
    fleet = {c["name"]: c for c in pod["containers"]}
    kv = json.loads(flag(fleet["engine"]["args"], "--kv-events-config") or "{}")
    assert kv["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert bound_publicly(kv["endpoint"]) is (dp > 1)
    if dp == 1:
        assert kv["endpoint"] == KV_IPC == env_of(fleet["worker"])["WORKER_KV_EVENTS_ENDPOINT"]
        volume = next(v for v in pod["volumes"] if v["name"] == "kv-events")
        assert volume["emptyDir"]["medium"] == "Memory"
        mounted = {name for name, c in fleet.items()
                   if any(m["name"] == "kv-events" and KV_IPC.startswith(
                       "ipc://" + m["mountPath"] + "/") for m in c["volumeMounts"])}
        assert mounted == {"engine", "worker"}
    policy = one(objects, "NetworkPolicy", "-fleet")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed <= {"http", "worker-metrics", *(f"worker-dp{r}" for r in range(1, dp))}


def test_external_redis_password_and_tls() -> None:
    with helm.Chart.load(CHART_DIR) as loaded:
        objects = render(loaded, VALUE_SETS["external-redis-tls"])
    cfg = router_config(objects)
    ca_path = "/etc/prefix-router/redis-tls/ca.crt"
    assert cfg["redis_url"] == f"rediss://redis.example.com:6380/2?ssl_ca_certs={ca_path}"
    assert "redis_password" not in cfg, "the password never lands in a ConfigMap"
    router = containers(objects, "Deployment", "-router")["router"]
    worker = containers(objects, "StatefulSet", "-fleet")["worker"]
    assert cfg["redis_password_file"] == env_of(worker)["WORKER_REDIS_PASSWORD_FILE"] == PASSWORD_FILE
    for kind, suffix, container in (("Deployment", "-router", router), ("StatefulSet", "-fleet", worker)):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["redis-tls"] + "/ca.crt" == ca_path
        volumes = {v["name"]: v for v in one(objects, kind, suffix)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["redis-tls"]["secret"]["secretName"] == "redis-ca"
        assert_password_mounted(objects, kind, suffix, container, "redis-auth", "password")


PASSWORD_FILE = "/etc/prefix-router/redis-auth/redis-password"


def assert_password_mounted(objects: list[dict[str, Any]], kind: str, suffix: str,
                            container: dict[str, Any], secret: str, key: str) -> None:
    """The Redis password reaches ``container`` as PASSWORD_FILE from Secret ``secret``/``key``,
    and neither as an environment value nor on its command line."""
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["redis-auth"]["mountPath"] + "/redis-password" == PASSWORD_FILE
    assert mounts["redis-auth"]["readOnly"] is True
    volumes = {v["name"]: v for v in one(objects, kind, suffix)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["redis-auth"]["secret"]["secretName"] == secret
    assert volumes["redis-auth"]["secret"]["items"] == [{"key": key, "path": "redis-password"}]
    words = " ".join(container.get("command", []) + container.get("args", []))
    assert "requirepass $(" not in words.replace("requirepass $(cat", "")
    assert not any(e["name"].endswith("REDIS_PASSWORD") for e in container.get("env", []))


def test_bundled_redis_with_password() -> None:
    with helm.Chart.load(CHART_DIR) as loaded:
        objects = render(loaded, {"redis": {"auth": {"existingSecret": "redis-auth"}}})
    redis = containers(objects, "StatefulSet", "-redis")["redis"]
    assert "--requirepass" not in redis["args"], "a password argument shows in ps"
    assert flag(redis["args"], "--maxmemory-policy") == "noeviction"
    ref = {"secretKeyRef": {"name": "redis-auth", "key": "redis-password"}}
    assert env_of(redis)["REDISCLI_AUTH"] == ref  # the readiness probe's redis-cli
    for kind, suffix, container in (
            ("StatefulSet", "-redis", redis),
            ("Deployment", "-router", containers(objects, "Deployment", "-router")["router"]),
            ("StatefulSet", "-fleet", containers(objects, "StatefulSet", "-fleet")["worker"])):
        assert_password_mounted(objects, kind, suffix, container, "redis-auth", "redis-password")
    assert router_config(objects)["redis_password_file"] == PASSWORD_FILE


def test_bundled_redis_command_runs_and_requires_the_password(tmp_path: Path) -> None:
    """Run the rendered bundled-Redis command (sh script and arguments) with a real redis-server:
    it must start, refuse clients without the password, and carry the password on no command line."""
    import shutil
    import subprocess

    import redis as redis_lib

    from loadtest.harness.redis_server import free_port, redis_server_binary
    from tests.helpers import wait_for

    with helm.Chart.load(CHART_DIR) as loaded:
        objects = render(loaded, {"redis": {"auth": {"existingSecret": "redis-auth"}}})
    container = containers(objects, "StatefulSet", "-redis")["redis"]
    secret = tmp_path / "redis-password"
    secret.write_text("pw-9d1e\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(redis_server_binary())
    port = free_port()
    command = [c.replace(PASSWORD_FILE, str(secret)) for c in container["command"]]
    args = [str(port) if a == "6379" else str(tmp_path) if a == "/data" else a
            for a in container["args"]] + ["--bind", "127.0.0.1"]
    assert shutil.which("sh")
    proc = subprocess.Popen(command + args, env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis_lib.Redis(port=port, password="pw-9d1e", socket_connect_timeout=1)
        wait_for(lambda: proc.poll() is not None or client.ping(), 10, message="redis up")
        assert client.ping()
        with pytest.raises(redis_lib.AuthenticationError):
            redis_lib.Redis(port=port).ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline, "exec: redis-server is the container's process"
        assert b"pw-9d1e" not in cmdline
    finally:
        proc.terminate()
        proc.wait(10)


def test_vllm_engine_arguments_and_gpus(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["xxhash-seed"])
    engine = containers(objects, "StatefulSet", "-fleet")["engine"]
    args = engine["args"]
    assert engine["image"] == "docker.io/vllm/vllm-openai:v0.33.0"
    assert engine["command"] == ["vllm", "serve"] and args[0] == "Qwen/Qwen3-8B"
    assert flag(args, "--tensor-parallel-size") == "4"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert "--enable-prefix-caching" in args
    volumes = {v["name"]: v for v in one(objects, "StatefulSet", "-fleet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"


def test_emulator_fleet(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["emulator"])
    sts = one(objects, "StatefulSet", "-fleet")
    assert sts["spec"]["replicas"] == 3
    engine = containers(objects, "StatefulSet", "-fleet")["engine"]
    assert engine["command"] == ["prefix-worker", "emulate"]
    assert engine["image"] == containers(objects, "Deployment", "-router")["router"]["image"]
    assert not any("gpu" in k for k in engine["resources"].get("limits", {}))
    args = engine["args"]
    assert flag(args, "--replicas") == "1" and flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--time-scale") == "0.5" and flag(args, "--num-gpu-blocks-override") == "2048"
    # router and emulator tokenize with the same files
    assert flag(args, "--tokenizer") == router_config(objects)["tokenizer"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"


def test_large_numbers_render_as_integers(chart: helm.Chart) -> None:
    """Helm decodes numbers as float64; seeds and block counts must not turn into 4.294967295e+09."""
    objects = render(chart, VALUE_SETS["everything"])
    engine = containers(objects, "StatefulSet", "-fleet")["engine"]
    assert env_of(engine)["PYTHONHASHSEED"] == "4294967295"
    assert flag(engine["args"], "--num-gpu-blocks-override") == "1000000"
    assert router_config(objects)["hash_seed"] == "4294967295"


def test_rendered_config_is_accepted_by_the_router(
    rendered: Rendered, tmp_path: Path,
) -> None:
    """Feed the rendered router.yaml to the router's own config loader (unknown keys fail there)."""
    config_mod = pytest.importorskip("router.service.config")
    name, _, objects = rendered
    path = tmp_path / "router.yaml"
    secret = tmp_path / "redis-password"  # what the Secret volume holds in the pod
    secret.write_text("pw\n")
    path.write_text(one(objects, "ConfigMap", "-router")["data"]["router.yaml"].replace(
        PASSWORD_FILE, str(secret)))
    args = containers(objects, "Deployment", "-router")["router"]["args"]
    assert args[:3] == ["serve", "--config", "/etc/prefix-router/router.yaml"]
    cfg = config_mod.load_config(["--config", str(path)], env={})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 8000), name
    assert cfg.redis_url and cfg.block_size >= 1


def test_rendered_emulator_args_are_accepted_by_the_emulator(chart: helm.Chart) -> None:
    """Feed the rendered emulator command line to the emulator's own parser."""
    emulator_config = pytest.importorskip("worker.emulator.config")
    for value_set in ("emulator", "everything"):
        objects = render(chart, VALUE_SETS[value_set])
        engine = containers(objects, "StatefulSet", "-fleet")["engine"]
        env = {k: v for k, v in env_of(engine).items() if isinstance(v, str)}
        cfg = emulator_config.from_args(engine["args"], env)
        block_size, algo, seed = engine_settings(engine)
        assert (cfg.block_size, cfg.hash_algo) == (block_size, algo)
        assert cfg.hash_seed == seed if seed is not None else not cfg.hash_seed_is_random
        assert cfg.kv_events.enabled and cfg.kv_events.endpoint == KV_IPC


# ------------------------------------------------------- operator conventions


def test_labels_security_and_probes(rendered: Rendered) -> None:
    name, _, objects = rendered
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                    "helm.sh/chart"):
            assert key in labels, f"[{name}] {obj['kind']}/{obj['metadata']['name']} lacks {key}"
        if obj["kind"] in ("Deployment", "StatefulSet", "Pod"):
            spec = obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert spec["automountServiceAccountToken"] is False
            assert spec["serviceAccountName"] == FULLNAME
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
                assert "resources" in c
                if obj["kind"] != "Pod":
                    assert "livenessProbe" in c and "readinessProbe" in c, f"{c['name']} lacks probes"
    router = containers(objects, "Deployment", "-router")["router"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["securityContext"]["readOnlyRootFilesystem"] is True
    worker = containers(objects, "StatefulSet", "-fleet")["worker"]
    metrics_port = next(p for p in worker["ports"] if p["name"] == "worker-metrics")
    assert worker["livenessProbe"]["httpGet"]["port"] == metrics_port["name"]
    assert env_of(worker)["WORKER_METRICS_PORT"] == str(metrics_port["containerPort"])
    assert env_of(worker)["WORKER_METRICS_HOST"] == "0.0.0.0", "probes come from the kubelet, not loopback"


def test_config_change_rolls_the_routers(chart: helm.Chart) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(render(chart, values), "Deployment", "-router")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"model": {"blockSize": 32}})
    assert checksum({}) != checksum({"router": {"policy": "least_loaded"}})


def test_every_router_policy_can_be_chosen_in_the_values(chart: helm.Chart, tmp_path: Path) -> None:
    """The schema's policy list is the router's (it lacked ``ttft``: the chart refused it), and
    the router's own config loader takes each rendered config."""
    from router.decision.policy import POLICIES
    from router.service.config import load_config

    for policy in POLICIES:
        objects = render(chart, {"router": {"policy": policy}})
        assert router_config(objects)["policy"] == policy
        path = tmp_path / f"{policy}.yaml"
        path.write_text(one(objects, "ConfigMap", "-router")["data"]["router.yaml"])
        assert load_config(["--config", str(path)], env={}).policy == policy
    with pytest.raises(helm.HelmError) as info:
        chart.render({"router": {"policy": "fastest"}}, name=RELEASE, namespace=NAMESPACE)
    assert "at '/router/policy': value must be one of" in str(info.value)


def test_grafana_dashboard_panels(chart: helm.Chart) -> None:
    assert not [o for o in render(chart, {}) if o["metadata"]["name"].endswith("-dashboard")]
    cm = one(render(chart, {"grafana": {"dashboard": {"enabled": True}}}), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["prefix-router.json"])
    exprs = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in dashboard["panels"]}
    hit_rate = ("sum by (model_name) (rate(vllm:prefix_cache_hits_total[5m])) / "
                "sum by (model_name) (rate(vllm:prefix_cache_queries_total[5m]))")
    assert exprs["Token prefix-cache hit rate per model"] == [hit_rate]
    by_title = {p["title"]: p for p in dashboard["panels"]}
    for source, hit, miss in (
            ("engine", "TTFT, prefix hit (engine cached_tokens > 0)",
             "TTFT, prefix miss (engine cached_tokens = 0)"),
            ("predicted", "TTFT, predicted hit (no engine report)",
             "TTFT, predicted miss (no engine report)")):
        assert by_title[hit]["gridPos"]["y"] == by_title[miss]["gridPos"]["y"], "side by side"
        for title, cache in ((hit, "hit"), (miss, "miss")):
            assert exprs[title] and all(
                f'router_ttft_seconds_bucket{{cache="{cache}",source="{source}"}}' in e
                and "sum by (le, model)" in e for e in exprs[title])
    assert "sum by (pod) (vllm:num_requests_running)" in exprs["Engine load per replica"]
    assert exprs["Router in-flight requests per replica"] == ["sum by (replica) (router_inflight_requests)"]
    assert exprs["Routing reasons"] == ["sum by (reason) (rate(router_requests_total[5m]))"]


def test_helm_test_hook_sends_a_completion_through_the_router(chart: helm.Chart) -> None:
    objects = render(chart, {"model": {"servedModelName": "qwen3"}})
    pod = one(objects, "Pod", "-test-completion")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    env = env_of(pod["spec"]["containers"][0])
    service = one(objects, "Service", FULLNAME)
    port = service["spec"]["ports"][0]["port"]
    assert env["ROUTER_URL"] == f"http://{FULLNAME}.{NAMESPACE}.svc:{port}/v1/completions"
    assert json.loads(env["BODY"])["model"] == "qwen3"
    script = pod["spec"]["containers"][0]["args"][0]
    compile(script, "helm-test", "exec")  # the hook's Python is at least valid
    assert "x-prefix-router-replica" in script


def test_scrape_annotations(chart: helm.Chart) -> None:
    objects = render(chart, {})
    for kind, suffix in (("Deployment", "-router"), ("StatefulSet", "-fleet")):
        ann = one(objects, kind, suffix)["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    objects = render(chart, {"metrics": {"podAnnotations": False}})
    ann = one(objects, "Deployment", "-router")["spec"]["template"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in ann


# ------------------------------------------------------------- invalid values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"blockSize": 0}}, "at '/model/blockSize': minimum: got 0, want 1"),
        ({"model": {"hashAlgo": "md5"}}, "at '/model/hashAlgo': value must be one of"),
        ({"model": {"hashAlgo": "xxhash"}}, "model.hashSeed is required when model.hashAlgo is xxhash"),
        ({"model": {"hashAlgo": "xxhash_cbor", "hashSeed": ""}},
         "model.hashSeed is required when model.hashAlgo is xxhash_cbor"),
        ({"model": {"hashSeed": "random"}}, "at '/model/hashSeed'"),
        ({"model": {"blocksize": 32}}, "additional properties 'blocksize' not allowed"),
        ({"fleet": {"engine": "sglang"}}, "at '/fleet/engine': value must be one of"),
        ({"redis": {"external": {"url": "http://redis:6379"}}}, "at '/redis/external/url'"),
        ({"redis": {"indexStride": 0}}, "at '/redis/indexStride': minimum: got 0, want 1"),
        ({"router": {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}}},
         "router.autoscaling needs targetCPUUtilizationPercentage"),
        ({"redis": {"external": {"url": "redis://r:6379/0", "cluster": {"nodes": ["a:6379"]}}}},
         "set one of redis.external.url, redis.external.cluster.nodes and redis.external.sentinel.nodes"),
        ({"redis": {"external": {"sentinel": {"nodes": ["s:26379"]}}}},
         "redis.external.sentinel.nodes needs redis.external.sentinel.masterName"),
        ({"redis": {"external": {"cluster": {"nodes": ["a:6379/0"]}}}}, "at '/redis/external/cluster/nodes/0'"),
        ({"router": {"httpRoute": {"enabled": True}}}, "router.httpRoute.enabled needs router.httpRoute.parentRefs"),
        ({"router": {"logFormat": "xml"}}, "at '/router/logFormat': value must be one of"),
        ({"tracing": {"otlpTracesEndpoint": "otel:4317"}}, "at '/tracing/otlpTracesEndpoint'"),
    ],
    ids=["block-size-0", "unknown-algo", "xxhash-no-seed", "xxhash-cbor-empty-seed", "seed-not-integer",
         "misspelt-key", "unknown-engine", "redis-url-scheme", "index-stride-0", "hpa-no-metric",
         "redis-two-forms", "sentinel-no-master", "cluster-node-path", "httproute-no-parent",
         "log-format", "otlp-scheme"],
)
def test_invalid_values_fail_with_a_clear_message(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)


AUTH_FIELDS = ("api_keys", "cache_salt_secret_file", "client_cache_salt", "admin_tenants",
               "debug_access", "metrics_access")


def project_secret_volumes(pod: dict[str, Any], mounts: list[dict[str, Any]], root: Path,
                           secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """Lay out under ``root`` what the kubelet would mount for the pod's Secret volumes (all keys,
    or only ``items`` at their paths) from ``secrets`` ({name: {key: value}}), with the ``..data``
    link a Secret volume has; return {mountPath: local directory}."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for mount in mounts:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        data = secrets[secret["secretName"]]
        items = secret.get("items") or [{"key": k, "path": k} for k in data]
        local = root / mount["name"]
        stamp = local / "..2026_12_01_22_00_00.1"
        stamp.mkdir(parents=True)
        for item in items:
            (stamp / item["path"]).write_text(data[item["key"]])
            (local / item["path"]).symlink_to(stamp.name + "/" + item["path"])
        (local / "..data").symlink_to(stamp.name)
        out[mount["mountPath"]] = str(local)
    return out


@pytest.mark.parametrize("value_set", ["tenant-auth", "tenant-auth-dir"])
def test_tenant_auth_values_reach_the_router(chart: helm.Chart, tmp_path: Path, value_set: str) -> None:
    """router.auth mounts the key and salt Secrets read-only (whole directories, so Secret
    updates arrive), names their files in router.yaml, puts nothing on the command line, and the
    router's own loaders read keys and salt from the layout the kubelet would mount."""
    config_mod = pytest.importorskip("router.service.config")
    auth_mod = pytest.importorskip("router.edges.auth")
    values = VALUE_SETS[value_set]
    auth = values["router"]["auth"]
    objects = render(chart, values)
    pod = one(objects, "Deployment", "-router")["spec"]["template"]["spec"]
    router = containers(objects, "Deployment", "-router")["router"]
    mounts = [m for m in router["volumeMounts"] if m["name"] in ("api-keys", "cache-salt")]
    assert len(mounts) == 2 and all(m["readOnly"] and "subPath" not in m for m in mounts)
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if v["name"] in ("api-keys", "cache-salt")}
    assert volumes["api-keys"]["secretName"] == auth["existingSecret"]
    assert volumes["cache-salt"]["secretName"] == auth["saltSecret"]["name"]
    assert all(v["defaultMode"] == 0o440 for v in volumes.values())
    assert ("items" in volumes["api-keys"]) is bool(auth.get("keysKey"))
    text = json.dumps([router.get("args"), router.get("env"), router.get("command")])
    assert "api-keys" not in text and "salt" not in text, "secrets never reach the command line"

    key_a, key_ops = auth_mod.new_key(), auth_mod.new_key()
    salt, salt_key = "s" * 32, auth["saltSecret"].get("key", "cache-salt-secret")
    if auth.get("keysKey"):
        secrets = {auth["existingSecret"]: {
            auth["keysKey"]: f"a {auth_mod.hash_key(key_a)}\nops {auth_mod.hash_key(key_ops)}\n",
            salt_key: salt, "unrelated": "not a key file"}}
    else:
        secrets = {auth["existingSecret"]: {"a": auth_mod.hash_key(key_a) + "\n",
                                            "ops": auth_mod.hash_key(key_ops) + "\n"},
                   auth["saltSecret"]["name"]: {salt_key: salt}}
    local = project_secret_volumes(pod, mounts, tmp_path / "pod", secrets)
    text = one(objects, "ConfigMap", "-router")["data"]["router.yaml"]
    for mount_path, directory in local.items():
        text = text.replace(mount_path, directory)
    path = tmp_path / "router.yaml"
    path.write_text(text)
    cfg = config_mod.load_config(["--config", str(path)], env={})
    store = auth_mod.KeyStore(str(cfg.api_keys))
    assert (store.tenant_of(key_a), store.tenant_of(key_ops), len(store)) == ("a", "ops", 2)
    assert auth_mod.read_secret(str(cfg.cache_salt_secret_file)) == salt.encode()
    assert cfg.client_cache_salt == auth.get("clientSalt", "override")
    assert cfg.admin_tenants == tuple(auth.get("adminTenants", ()))
    assert cfg.debug_access == auth.get("debugAccess", "admin")
    assert cfg.metrics_access == auth.get("metricsAccess", "open")


def test_auth_off_by_default(chart: helm.Chart) -> None:
    objects = render(chart, {})
    assert not set(AUTH_FIELDS) & set(router_config(objects))
    pod = one(objects, "Deployment", "-router")["spec"]["template"]["spec"]
    assert not {v["name"] for v in pod["volumes"]} & {"api-keys", "cache-salt"}


def test_servicemonitor_sends_the_bearer_token_to_the_router_only(chart: helm.Chart) -> None:
    """With metricsAccess=admin Prometheus authenticates as an admin tenant on the router's
    /metrics; the engines' and workers' /metrics are not behind the router's keys."""
    monitors = {o["metadata"]["name"]: o for o in render(chart, VALUE_SETS["tenant-auth"])
                if o["kind"] == "ServiceMonitor"}
    router = monitors[f"{FULLNAME}-router"]["spec"]["endpoints"]
    assert [e["authorization"] for e in router] == [
        {"type": "Bearer", "credentials": {"name": "prom-router-key", "key": "token"}}]
    assert all("authorization" not in e for e in monitors[f"{FULLNAME}-fleet"]["spec"]["endpoints"])
    plain = render(chart, {"metrics": {"serviceMonitor": {"enabled": True}}})
    assert all("authorization" not in e for o in plain if o["kind"] == "ServiceMonitor"
               for e in o["spec"]["endpoints"])


def test_auth_change_rolls_the_routers(chart: helm.Chart) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(render(chart, values), "Deployment", "-router")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    on = VALUE_SETS["tenant-auth-dir"]
    assert checksum({}) != checksum(on)
    assert checksum(on) != checksum({"router": {"auth": {**on["router"]["auth"], "clientSalt": "reject"}}})


AUTH_ON = {"enabled": True, "existingSecret": "keys", "saltSecret": {"name": "salt"}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"router": {"auth": {"enabled": True, "saltSecret": {"name": "salt"}}}},
         "router.auth.enabled needs router.auth.existingSecret"),
        ({"router": {"auth": {"enabled": True, "existingSecret": "keys"}}},
         "router.auth.enabled needs router.auth.saltSecret.name"),
        ({"router": {"auth": {**AUTH_ON, "saltSecret": {"name": "keys"}}}},
         "whose every key is read as a tenant's key file"),
        ({"router": {"auth": AUTH_ON, "extraConfig": {"api_keys": "/keys"}}},
         "router.extraConfig.api_keys conflicts with router.auth.enabled"),
        ({"router": {"auth": {**AUTH_ON, "metricsAccess": "admin"}},
          "metrics": {"serviceMonitor": {"enabled": True}}},
         "needs metrics.serviceMonitor.bearerTokenSecret"),
        ({"router": {"auth": {**AUTH_ON, "clientSalt": "ignore"}}},
         "at '/router/auth/clientSalt': value must be one of"),
        ({"router": {"auth": {**AUTH_ON, "metricsAccess": "tenant"}}},
         "at '/router/auth/metricsAccess': value must be one of"),
        ({"router": {"auth": {**AUTH_ON, "adminTenants": ["bad tenant"]}}},
         "at '/router/auth/adminTenants/0'"),
        ({"router": {"auth": {**AUTH_ON, "apiKeys": "/keys"}}},
         "additional properties 'apiKeys' not allowed"),
    ],
    ids=["no-key-secret", "no-salt-secret", "salt-in-key-dir", "extraconfig-conflict",
         "admin-metrics-no-token", "client-salt", "metrics-access", "tenant-name", "misspelt"],
)
def test_invalid_auth_values_fail_with_a_clear_message(
        chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(info.value)


def pod_labels(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, str]:
    labels: dict[str, str] = one(objects, kind, suffix)["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a matchLabels selector selects pods with ``labels``."""
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def container_port_names(objects: list[dict[str, Any]], kind: str, suffix: str) -> set[str]:
    pod = one(objects, kind, suffix)["spec"]["template"]["spec"]
    return {p["name"] for c in pod["containers"] for p in c.get("ports", [])}


def test_ingress_and_httproute_reach_the_router_service(chart: helm.Chart) -> None:
    values = VALUE_SETS["edge-netpol-tracing"]
    objects = render(chart, values)
    service = one(objects, "Service", FULLNAME)
    assert selects({"matchLabels": service["spec"]["selector"]},
                   pod_labels(objects, "Deployment", "-router"))
    port = service["spec"]["ports"][0]
    ingress = one(objects, "Ingress", "-router")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    assert ingress["tls"] == [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]
    rules = ingress["rules"]
    assert [r.get("host") for r in rules] == ["llm.example.com", None]
    paths = [p for r in rules for p in r["http"]["paths"]]
    assert [(p["path"], p["pathType"]) for p in paths] == [("/", "Prefix"), ("/v1", "Prefix")]
    for p in paths:
        assert p["backend"]["service"] == {"name": FULLNAME, "port": {"name": port["name"]}}
    route = one(objects, "HTTPRoute", "-router")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert spec["parentRefs"] == [{"name": "gw", "namespace": "gateway"}]
    assert spec["hostnames"] == ["llm.example.com"]
    (rule,) = spec["rules"]
    assert rule["backendRefs"] == [{"name": FULLNAME, "port": port["port"]}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"] == {"request": "600s"}


@pytest.mark.parametrize("value_set", ["edge-netpol-tracing", "redis-cluster", "production-16",
                                       "data-parallel"])
def test_network_policies_let_only_the_router_reach_engines_and_only_clients_reach_redis(
        chart: helm.Chart, value_set: str) -> None:
    values = VALUE_SETS[value_set]
    objects = render(chart, values)
    router_pods = pod_labels(objects, "Deployment", "-router")
    fleet_pods = pod_labels(objects, "StatefulSet", "-fleet")
    policies = {o["metadata"]["name"].removeprefix(FULLNAME + "-"): o["spec"]
                for o in objects if o["kind"] == "NetworkPolicy"}
    # each policy selects exactly its component's pods
    assert selects(policies["fleet"]["podSelector"], fleet_pods)
    assert not selects(policies["fleet"]["podSelector"], router_pods)
    assert selects(policies["router"]["podSelector"], router_pods)
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]
    # the engine port: the router pods only (plus the named metrics scrapers)
    fleet_ports = container_port_names(objects, "StatefulSet", "-fleet")
    engine_rule, *metrics_rules = policies["fleet"]["ingress"]
    (peer,) = engine_rule["from"]
    assert set(peer) == {"podSelector"} and selects(peer["podSelector"], router_pods)
    assert not selects(peer["podSelector"], fleet_pods)
    assert [p["port"] for p in engine_rule["ports"]] == ["http"] and "http" in fleet_ports
    scrapers = values.get("networkPolicy", {}).get("metricsFrom", [])
    assert [r["from"] for r in metrics_rules] == ([scrapers] if scrapers else [])
    worker = containers(objects, "StatefulSet", "-fleet")["worker"]
    worker_metrics = {p["name"] for p in worker["ports"]}  # one per data-parallel rank
    assert "worker-metrics" in worker_metrics
    for rule in metrics_rules:
        assert {p["port"] for p in rule["ports"]} == {"http"} | worker_metrics <= fleet_ports
    # the router: its port, from networkPolicy.router.from (default everyone)
    (router_rule,) = policies["router"]["ingress"]
    assert router_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert router_rule.get("from", []) == values["networkPolicy"].get("router", {}).get("from", [])
    # the bundled Redis: router and fleet pods (the worker sidecars), nothing else
    if external_redis_url(values) is None:
        redis_pods = pod_labels(objects, "StatefulSet", "-redis")
        assert selects(policies["redis"]["podSelector"], redis_pods)
        (rule,) = policies["redis"]["ingress"]
        peers = [p["podSelector"] for p in rule["from"]]
        assert len(peers) == 2
        assert any(selects(p, router_pods) for p in peers) and any(selects(p, fleet_pods) for p in peers)
        assert not any(selects(p, redis_pods) for p in peers)
        assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
        assert "redis" in container_port_names(objects, "StatefulSet", "-redis")
    else:
        assert "redis" not in policies


def test_fleet_pdb_covers_the_engines_only(chart: helm.Chart) -> None:
    objects = render(chart, {})
    pdb = one(objects, "PodDisruptionBudget", "-fleet")["spec"]
    assert pdb == {"maxUnavailable": 1, "selector": pdb["selector"]}
    assert selects(pdb["selector"], pod_labels(objects, "StatefulSet", "-fleet"))
    assert not selects(pdb["selector"], pod_labels(objects, "Deployment", "-router"))
    objects = render(chart, {"fleet": {"pdb": {"minAvailable": "75%"}}})
    assert one(objects, "PodDisruptionBudget", "-fleet")["spec"]["minAvailable"] == "75%"
    assert "maxUnavailable" not in one(objects, "PodDisruptionBudget", "-fleet")["spec"]


def test_router_hpa_scales_on_cpu_and_in_flight_requests(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["production-16"])
    hpa = one(objects, "HorizontalPodAutoscaler", "-router")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": f"{FULLNAME}-router"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (4, 16)
    by_type = {m["type"]: m for m in hpa["metrics"]}
    assert by_type["Resource"]["resource"] == {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}
    assert by_type["Pods"]["pods"] == {"metric": {"name": "prefix_router_inflight_requests"},
                                       "target": {"type": "AverageValue", "averageValue": "256"}}
    # the in-flight metric alone is enough to autoscale
    objects = render(chart, VALUE_SETS["edge-netpol-tracing"])
    metrics = one(objects, "HorizontalPodAutoscaler", "-router")["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Pods"]


def test_topology_spread_selects_its_own_pods(chart: helm.Chart) -> None:
    for values in ({}, VALUE_SETS["production-16"]):
        objects = render(chart, values)
        for kind, suffix, component in (("Deployment", "-router", "router"),
                                        ("StatefulSet", "-fleet", "fleet")):
            pod = one(objects, kind, suffix)["spec"]["template"]["spec"]
            constraints = pod["topologySpreadConstraints"]
            want = values.get(component, {}).get("topologySpreadConstraints")
            assert [c["topologyKey"] for c in constraints] == (
                [c["topologyKey"] for c in want] if want else
                ["kubernetes.io/hostname" if component == "router" else "topology.kubernetes.io/zone"])
            for c in constraints:
                assert selects(c["labelSelector"], pod_labels(objects, kind, suffix))
                other = pod_labels(objects, "StatefulSet" if component == "router" else "Deployment",
                                   "-fleet" if component == "router" else "-router")
                assert not selects(c["labelSelector"], other)
    own = {"matchLabels": {"team": "llm"}}
    objects = render(chart, {"router": {"topologySpreadConstraints": [
        {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule", "labelSelector": own}]}})
    (c,) = one(objects, "Deployment", "-router")["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert c["labelSelector"] == own and c["maxSkew"] == 2


def test_priority_classes(chart: helm.Chart) -> None:
    objects = render(chart, VALUE_SETS["edge-netpol-tracing"])
    for kind, suffix, name in (("Deployment", "-router", "llm-routing"),
                               ("StatefulSet", "-fleet", "llm-serving"),
                               ("StatefulSet", "-redis", "llm-state")):
        assert one(objects, kind, suffix)["spec"]["template"]["spec"]["priorityClassName"] == name
    for obj in render(chart, {}):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            assert "priorityClassName" not in obj["spec"]["template"]["spec"]


@pytest.mark.parametrize("value_set", ["redis-cluster", "redis-sentinel", "production-16"])
def test_external_cluster_and_sentinel_urls(chart: helm.Chart, value_set: str) -> None:
    """The URL rendered from cluster seeds or a Sentinel set is what the values ask for, the
    one the router and worker parse, with no bundled Redis and the CA mounted for TLS."""
    from router.shared.redis_client import parse_redis_url

    values = VALUE_SETS[value_set]
    objects = render(chart, values)
    cfg = router_config(objects)
    worker = containers(objects, "StatefulSet", "-fleet")["worker"]
    assert env_of(worker)["WORKER_REDIS_URL"] == cfg["redis_url"]
    want = external_redis_url(values)
    assert want is not None
    ext = values["redis"]["external"]
    if ext.get("tls", {}).get("caSecret"):
        assert cfg["redis_url"] == f"{want}?ssl_ca_certs=/etc/prefix-router/redis-tls/ca.crt"
        router = containers(objects, "Deployment", "-router")["router"]
        assert {m["name"] for m in router["volumeMounts"]} >= {"redis-tls"}
    else:
        assert cfg["redis_url"] == want
    target = parse_redis_url(cfg["redis_url"])
    if "cluster" in ext:
        assert target.mode == "cluster" and target.tls is bool(ext.get("tls", {}).get("enabled"))
        assert [f"{h}:{p}" for h, p in target.hosts] == ext["cluster"]["nodes"]
    else:
        assert target.mode == "sentinel" and target.service == ext["sentinel"]["masterName"]
        assert [f"{h}:{p}" for h, p in target.hosts] == ext["sentinel"]["nodes"]
        assert target.db == ext["sentinel"].get("db", 0)
    assert not [o for o in objects if o["metadata"]["name"] == f"{FULLNAME}-redis"]


def test_tracing_and_json_logs(chart: helm.Chart) -> None:
    endpoint = VALUE_SETS["edge-netpol-tracing"]["tracing"]["otlpTracesEndpoint"]
    objects = render(chart, VALUE_SETS["edge-netpol-tracing"])
    cfg = router_config(objects)
    assert (cfg["otlp_traces_endpoint"], cfg["log_format"]) == (endpoint, "json")
    engine = containers(objects, "StatefulSet", "-fleet")["engine"]
    assert flag(engine["args"], "--otlp-traces-endpoint") == endpoint  # vLLM joins the traces
    defaults = render(chart, {})
    assert "otlp_traces_endpoint" not in router_config(defaults)
    assert "--otlp-traces-endpoint" not in containers(defaults, "StatefulSet", "-fleet")["engine"]["args"]
    emulated = render(chart, {**VALUE_SETS["edge-netpol-tracing"], "fleet": {"engine": "emulator"}})
    assert "--otlp-traces-endpoint" not in containers(emulated, "StatefulSet", "-fleet")["engine"]["args"]


def test_production_example_is_a_16_replica_gpu_fleet(chart: helm.Chart) -> None:
    values = VALUE_SETS["production-16"]
    objects = render(chart, values)
    sts = one(objects, "StatefulSet", "-fleet")
    assert sts["spec"]["replicas"] == 16
    engine = containers(objects, "StatefulSet", "-fleet")["engine"]
    assert engine["command"] == ["vllm", "serve"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert one(objects, "PodDisruptionBudget", "-fleet")["spec"]["maxUnavailable"] == 1
    assert one(objects, "PodDisruptionBudget", "-router")["spec"]["maxUnavailable"] == 1
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Ingress", "NetworkPolicy", "HorizontalPodAutoscaler", "ServiceMonitor"}
    assert router_config(objects)["redis_url"].startswith("redis+sentinel://")
    assert router_config(objects)["log_format"] == "json"


def test_model_aliases_reach_the_router(chart: helm.Chart, tmp_path: Path) -> None:
    """``router.modelAliases`` renders into the router's ``model_aliases``, which its own
    config loader takes; a string without ``=`` is refused by the schema."""
    from router.service.config import load_config

    aliases = ["chat=Qwen/Qwen3-8B", "canary=Qwen/Qwen3-8B:90;sql-lora:10"]
    objects = render(chart, {"router": {"modelAliases": aliases}})
    assert router_config(objects)["model_aliases"] == aliases
    assert "model_aliases" not in router_config(render(chart, {}))
    path = tmp_path / "router.yaml"
    path.write_text(one(objects, "ConfigMap", "-router")["data"]["router.yaml"])
    assert load_config(["--config", str(path)], env={}).model_aliases == tuple(aliases)
    with pytest.raises(helm.HelmError) as info:
        chart.render({"router": {"modelAliases": ["chat"]}}, name=RELEASE, namespace=NAMESPACE)
    assert "/router/modelAliases/0" in str(info.value)
