"""Tenant isolation through real processes: Redis, one emulator replica (so every request
lands on the same engine cache), its worker, and routers with API keys on.

Tenant A's secret system prompt must give tenant B 0 cached tokens on the engine and 0
predicted hit blocks in ``/debug/route``, while A's own repeats (through another of A's keys,
too) still hit; keys are checked (401 in the OpenAI shape), a client's own ``cache_salt`` is
overridden or rejected per policy, and ``/metrics`` can be restricted to admin tenants.
Issue 29: an outsider without a key finds nothing derived from B's prompt on any open endpoint
(the template audit's family ids are keyed with the salt secret and left out of an open
``/metrics``), and a text B sent is a miss in every router cache for A.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client as http_client
import json
import random
import subprocess
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from router.edges.auth import FAMILY_ID_CONTEXT, derived_key, hash_key, new_key, tenant_salt
from tests.helpers import EMULATE, PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import (
    KV_EVENTS,
    TOKENIZER,
    Router,
    http,
    prometheus_value,
    read_json_file,
)

pytestmark = pytest.mark.timeout(120)

MODEL = "emulated-llm"
SECRET = b"0123456789abcdef-test-secret"
KEYS = {"a1": new_key(), "a2": new_key(), "b": new_key(), "ops": new_key()}
TENANT_OF = {"a1": "tenant-a", "a2": "tenant-a", "b": "tenant-b", "ops": "ops"}
ADAPTERS = {"a1": "adapter-1", "b": "adapter-2"}  # the LoRA adapter each tenant uses


class OneReplica:
    """Emulator (one replica) and its worker."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.redis_url = redis_url
        ready = tmp / "emulator.json"
        self.procs: list[subprocess.Popen[bytes]] = [start_process([
            *EMULATE, "--kv-events-config", KV_EVENTS, "--time-scale", "20",
            "--enable-prompt-tokens-details", "--ready-file", str(ready),
            "--lora-modules", *(f"{a}=/models/{a}" for a in ADAPTERS.values())],
            env={"PYTHONHASHSEED": "0"})]
        info = wait_for(lambda: read_json_file(ready) or self.procs[0].poll() is not None, 60,
                        message="emulator ready file")
        if not isinstance(info, dict):
            raise RuntimeError(self.stop())
        rep = info["replicas"][0]
        self.url = rep["url"]
        self.procs.append(start_process([
            PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
            "--kv-events-endpoint", rep["kv_events_endpoint"],
            "--kv-replay-endpoint", rep["kv_replay_endpoint"], "--redis-url", redis_url,
            "--replica-id", "replica-0", "--advertise-url", rep["url"], "--hash-seed", "0",
            "--metrics-port", "0", "--index-stride", "1"]))  # exact index: hits block for block

    def stop(self) -> str:
        return "\n".join(stop_process(p) for p in reversed(self.procs))


@pytest.fixture(scope="module")
def replica(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneReplica]:
    import redis

    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()  # the session's Redis: no other module's replicas
    one = OneReplica(tmp_path_factory.mktemp("tenants"), redis_server.url)
    yield one
    one.stop()


def write_auth_files(tmp: Path, as_directory: bool) -> tuple[Path, Path]:
    secret = tmp / "salt-secret"
    secret.write_bytes(SECRET + b"\n")
    if as_directory:  # a Kubernetes Secret volume: one file per tenant
        keys = tmp / "api-keys"
        keys.mkdir()
        for name, key in KEYS.items():
            path = keys / TENANT_OF[name]
            path.write_text((path.read_text() if path.exists() else "") + hash_key(key) + "\n")
    else:
        keys = tmp / "api-keys.txt"
        keys.write_text("# tenant key-hash\n" + "".join(
            f"{TENANT_OF[name]} {hash_key(key)}\n" for name, key in KEYS.items()))
    return keys, secret


def start_router(replica: OneReplica, tmp: Path, *extra: str, as_directory: bool = False) -> Router:
    keys, secret = write_auth_files(tmp, as_directory)
    router = Router(tmp, ["--redis-url", replica.redis_url, "--hash-seed", "0", "--index-stride", "1",
                          "--api-keys", str(keys), "--cache-salt-secret-file", str(secret),
                          "--admin-tenants", "ops", *extra])

    def routable() -> bool:
        reps = router.ready()["replicas"]
        return len(reps) == 1 and reps[0]["routable"] and reps[0]["affinity"]

    wait_for(routable, 30, message="replica routable with affinity")
    return router


def call(router: Router, who: str | None, path: str, body: Any = None,
         method: str = "POST") -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
    status, resp_headers, raw = http(method, router.url + path, body, headers=headers)
    try:
        return status, resp_headers, json.loads(raw)
    except ValueError:
        return status, resp_headers, raw


def complete(router: Router, who: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    status, _, body = call(router, who, "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields})
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def secret_prompt(seed: int) -> list[int]:
    return random.Random(seed).sample(range(1000, 100000), 320)  # 20 blocks


def family_ids(prompt: list[int], tenant: str) -> tuple[str, str]:
    """The template audit's id of ``prompt``'s family: as anyone could compute it before issue
    29 (xxh3 of the first block's ids and the tenant), and keyed with the salt secret now."""
    first_block = array("q", prompt[:16]).tobytes()
    old = xxhash.xxh3_64_hexdigest(first_block + tenant.encode())[:8]
    new = hmac.new(derived_key(SECRET, FAMILY_ID_CONTEXT), tenant.encode() + b"\x00" + first_block,
                   hashlib.sha256).hexdigest()[:8]
    return old, new


def audited(router: Router, requests: int) -> None:
    """Wait until the template audit has observed ``requests`` requests (admin view)."""
    wait_for(lambda: call(router, "ops", "/debug/prefixes", method="GET")[2][
        "observed_requests"] == requests, 15, message=f"the audit observed {requests} requests")


def test_keys_are_required_and_checked(replica: OneReplica, tmp_path: Path) -> None:
    router = start_router(replica, tmp_path)
    try:
        status, headers, body = call(router, None, "/v1/completions",
                                     {"model": MODEL, "prompt": [1, 2, 3]})
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401
        assert "param" in body["error"] and body["error"]["param"] is None  # vLLM's ErrorInfo
        status, _, raw = http("POST", router.url + "/v1/completions", {"model": MODEL},
                              headers={"Authorization": "Bearer sk-wrong"})
        assert status == 401 and b"Incorrect API key" in raw
        assert call(router, None, "/health", method="GET")[0] == 200
        assert call(router, None, "/ready", method="GET")[0] == 200
        assert call(router, None, "/metrics", method="GET")[0] == 200  # open unless restricted
        # /debug/* is for admin tenants by default
        assert call(router, "b", "/debug/route", {"model": MODEL, "prompt": [1]})[0] == 403
        assert call(router, "ops", "/debug/route", {"model": MODEL, "prompt": [1]})[0] == 200
        assert call(router, "b", "/v1/models", method="GET")[0] == 200
    finally:
        router.stop()


def test_tenant_b_never_hits_or_sees_tenant_a_prefix(replica: OneReplica, tmp_path: Path) -> None:
    router = start_router(replica, tmp_path, "--debug-access", "tenant", as_directory=True)
    try:
        prompt = secret_prompt(1)
        assert cached(complete(router, "a1", prompt)) == 0
        second = complete(router, "a1", prompt)
        assert cached(second) == 304  # 19 full blocks: A's repeat hits
        assert cached(complete(router, "a2", prompt)) == 304  # same tenant, another key

        def confirmed_for_a() -> bool:
            _, _, route = call(router, "a1", "/debug/route", {"model": MODEL, "prompt": prompt})
            return route["replicas"]["replica-0"]["confirmed_hit_blocks"] == 19
        wait_for(confirmed_for_a, 15, message="A's blocks in the router's index")
        _, _, route_b = call(router, "b", "/debug/route", {"model": MODEL, "prompt": prompt})
        assert route_b["hit_blocks"] == 0
        assert route_b["replicas"]["replica-0"]["confirmed_hit_blocks"] == 0
        # B sending A's salt itself does not help: the router overrides it
        a_salt = tenant_salt(SECRET, "tenant-a")
        assert cached(complete(router, "b", prompt, cache_salt=a_salt)) == 0
        assert cached(complete(router, "b", prompt)) == 304  # B's own repeat hits B's copy
        # the template audit keeps tenants apart too: B's view holds none of A's prompts
        wait_for(lambda: call(router, "ops", "/debug/prefixes", method="GET")[2][
            "observed_requests"] == 5, 15, message="the audit observed all five requests")
        _, _, mine = call(router, "b", "/debug/prefixes", method="GET")
        assert {f["tenant"] for f in mine["families"]} == {"tenant-b"}
        _, _, everyone = call(router, "ops", "/debug/prefixes", method="GET")
        assert {f["tenant"] for f in everyone["families"]} == {"tenant-a", "tenant-b"}
    finally:
        router.stop()


def test_client_salt_rejected_and_metrics_restricted(replica: OneReplica, tmp_path: Path) -> None:
    router = start_router(replica, tmp_path, "--client-cache-salt", "reject",
                          "--metrics-access", "admin")
    try:
        status, _, body = call(router, "b", "/v1/completions",
                               {"model": MODEL, "prompt": [5] * 40, "cache_salt": "mine"})
        assert status == 400 and "cache_salt" in body["error"]["message"]
        assert cached(complete(router, "b", secret_prompt(2))) == 0
        assert call(router, None, "/metrics", method="GET")[0] == 401
        assert call(router, "b", "/metrics", method="GET")[0] == 403
        audited(router, 1)
        status, _, text = call(router, "ops", "/metrics", method="GET")
        assert status == 200 and b'status="400"' in text
        # behind a key, the families are exported, under their keyed ids
        old_id, new_id = family_ids(secret_prompt(2), "tenant-b")
        assert f'router_prefix_family_requests{{family="{new_id}"}} 1.0'.encode() in text
        assert old_id.encode() not in text
    finally:
        router.stop()


def test_an_outsider_finds_nothing_derived_from_a_tenant_prompt(replica: OneReplica,
                                                                 tmp_path: Path) -> None:
    """Issue 29 item 2: the outsider knows B's prompt and computes its family id the old way
    and (were the secret his) the new way; neither, nor the tenant's name or salt, shows on any
    endpoint open without a key, in a body or a header. Tenant A's own views show none of B's."""
    router = start_router(replica, tmp_path, "--debug-access", "tenant")
    try:
        prompt = secret_prompt(3)
        complete(router, "b", prompt)
        complete(router, "a1", secret_prompt(4))
        audited(router, 2)
        old_id, new_id = family_ids(prompt, "tenant-b")
        secrets = [old_id, new_id, "tenant-b", tenant_salt(SECRET, "tenant-b")]
        seen = []
        for method, path, body in [("GET", "/metrics", None), ("GET", "/ready", None),
                                   ("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("GET", "/debug/prefixes", None),
                                   ("POST", "/debug/route", {"model": MODEL, "prompt": prompt}),
                                   ("POST", "/v1/completions", {"model": MODEL, "prompt": prompt}),
                                   ("GET", "/no-such-path", None)]:
            status, headers, raw = http(method, router.url + path, body)
            assert status in (200, 401, 404), (path, status)
            seen.append(raw.decode() + json.dumps(headers))
        for text in seen:
            assert not [s for s in secrets if s in text]
        metrics = seen[0]
        assert "router_prefix_family_requests" not in metrics  # no family series when open
        assert "router_prefix_near_miss_requests_total 0.0" in metrics  # the totals stay
        _, _, everyone = call(router, "ops", "/debug/prefixes", method="GET")
        assert new_id in {f["family"] for f in everyone["families"]}  # the id computed right
        # tenant A's own debug views: its families and counts only, nothing of B's
        _, _, mine = call(router, "a1", "/debug/prefixes", method="GET")
        assert {f["tenant"] for f in mine["families"]} == {"tenant-a"}
        assert mine["observed_requests"] == 1 and new_id not in json.dumps(mine)
        _, _, route = call(router, "a1", "/debug/route", {"model": MODEL, "prompt": prompt})
        assert route["hit_blocks"] == 0 and new_id not in json.dumps(route)
    finally:
        router.stop()


class HeldStream:
    """A long streamed completion of ``who`` through the router, read in a thread until
    ``close`` (so that it runs on the replica meanwhile)."""

    def __init__(self, router: Router, who: str, body: dict[str, Any]) -> None:
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        self.conn = http_client.HTTPConnection(host, int(port), timeout=60)
        self.conn.request("POST", "/v1/completions", json.dumps(body),
                          {"Authorization": f"Bearer {KEYS[who]}",
                           "Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed under it
            while self.resp.readline():
                pass

    def close(self) -> None:
        self.conn.close()  # the router closes the upstream: the engine aborts the request
        self._thread.join(10)


def test_open_metrics_and_ready_name_nothing_two_tenants_sent(replica: OneReplica,
                                                             tmp_path: Path) -> None:
    """Issue 29 review: after two tenants' traffic (streamed and not, each on its own LoRA
    adapter, with session ids) an outsider scraping ``/metrics`` (open) and ``/ready`` without a
    key finds neither tenant's name or salt, no family id of their prompts (computed either
    way), no session id and no adapter a tenant used: a LoRA request's TTFT is labelled
    ``lora-adapter``, and ``/ready`` counts the adapters running on a replica without naming
    them (it still lists the adapters the replica serves, configuration, not traffic). Without
    the change the TTFT series were labelled with the adapter and ``/ready`` named it while it
    ran."""
    router = start_router(replica, tmp_path)
    held: HeldStream | None = None
    try:
        secrets: list[str] = []
        for seed, who in enumerate(("a1", "b")):
            prompt = secret_prompt(40 + seed)
            tenant = TENANT_OF[who]
            session = f"session-{seed}-{new_key()[3:12]}"
            secrets += [tenant, tenant_salt(SECRET, tenant), session, ADAPTERS[who],
                        *family_ids(prompt, tenant)]
            for model, stream in ((ADAPTERS[who], True), (MODEL, True), (MODEL, False)):
                status, _, answer = http("POST", router.url + "/v1/completions", {
                    "model": model, "prompt": prompt, "max_tokens": 2, "stream": stream},
                    headers={"Authorization": f"Bearer {KEYS[who]}", "x-session-id": session})
                assert status == 200, answer[:300]
        audited(router, 6)
        held = HeldStream(router, "b", {"model": ADAPTERS["b"], "prompt": secret_prompt(42),
                                        "max_tokens": 30000, "ignore_eos": True, "stream": True})

        def adapter_running() -> bool:
            lora = router.ready()["replicas"][0]["lora"]  # (named in "running" before the fix)
            return lora is not None and bool(lora.get("num_running") or lora.get("running"))

        wait_for(adapter_running, 30, message="tenant b's adapter running, as /ready counts it")
        ready = json.loads(http("GET", router.url + "/ready")[2])
        metrics = http("GET", router.url + "/metrics")[2].decode()
    finally:
        if held is not None:
            held.close()
        router.stop()
    for rep in ready["replicas"]:
        assert sorted(rep.pop("lora_adapters")) == sorted(ADAPTERS.values())  # served: config
    shown = json.dumps(ready)
    assert not [s for s in secrets if s in metrics], [s for s in secrets if s in metrics]
    assert not [s for s in secrets if s in shown], shown
    assert ready["replicas"][0]["lora"]["num_running"] == 1
    assert 'model="lora-adapter"' in metrics and f'model="{MODEL}"' in metrics


def cache_lookups(router: Router) -> dict[tuple[str, str], float]:
    """``router_prompt_cache_lookups_total`` by (cache, result)."""
    text = call(router, "ops", "/metrics", method="GET")[2].decode()
    return {(cache, result): prometheus_value(
        text, f'router_prompt_cache_lookups_total{{cache="{cache}",result="{result}"}}')
        for cache in ("chain", "chunk_tokens", "rendered_chat") for result in ("hit", "miss")}


def lookups_during(router: Router, who: str, path: str, body: dict[str, Any]) -> dict[str, float]:
    """The cache lookups one request of ``who`` made: ``{"chain hit": n, ...}``."""
    before = cache_lookups(router)
    status, _, answer = call(router, who, path, {"model": MODEL, "max_tokens": 1, **body})
    assert status == 200, answer
    after = cache_lookups(router)
    return {f"{cache} {result}": after[cache, result] - before[cache, result]
            for cache, result in after}


@pytest.mark.skipif(TOKENIZER is None, reason="needs the Qwen3 tokenizer files")
def test_a_text_another_tenant_sent_is_a_miss_in_every_router_cache(replica: OneReplica,
                                                                     tmp_path: Path) -> None:
    """Issue 29 item 3: the chunk-token cache was keyed by text alone, so B's text routed faster
    for A (91 against 462 ms for 120k characters). Now every prompt cache is partitioned by the
    tenant's salt: A's request for B's text misses in each (it is tokenized and hashed anew),
    B's own repeat hits. Counted, not timed (loadtest/bench/tenant_cache.py times it)."""
    assert TOKENIZER is not None
    router = start_router(replica, tmp_path, "--tokenizer", TOKENIZER, "--audit-families", "0")
    try:
        rng = random.Random(29)
        # ~1,800 characters: tokenized on the event loop, whole (no lazy rest on another thread)
        text = ["".join(f"Clause {i}: " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(9))
                        + ".\n" for i in range(24)) for _ in range(2)]
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("/v1/completions", {"prompt": text[0]}, "chunk_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text[1]}]},
             "rendered_chat")]
        for path, body, cache in cases:
            first = lookups_during(router, "b", path, body)
            assert first[f"{cache} miss"] >= 1 and first[f"{cache} hit"] == 0
            other = lookups_during(router, "a1", path, body)
            assert other[f"{cache} miss"] >= 1 and other["chunk_tokens miss"] >= 1
            assert (other["chain hit"], other["chunk_tokens hit"], other["rendered_chat hit"]) == (
                0, 0, 0), other
            repeat = lookups_during(router, "b", path, body)
            assert repeat["chain hit"] >= 1 and repeat["chunk_tokens miss"] == 0, repeat
            if cache == "rendered_chat":
                assert repeat["rendered_chat hit"] >= 1
    finally:
        router.stop()


@pytest.mark.skipif(TOKENIZER is None, reason="needs the Qwen3 tokenizer files")
def test_messages_take_anthropics_x_api_key(replica: OneReplica, tmp_path: Path) -> None:
    """Issue 29 review: the Anthropic SDK sends its key as ``x-api-key``, not ``Authorization:
    Bearer``; on ``/v1/messages`` the router takes it as the API key (tenant-salted like any
    other), refuses a wrong or missing one with Anthropic's ``authentication_error``, and does
    not send it on to the engine. Other paths still want the Bearer header."""
    anthropic = pytest.importorskip("anthropic")
    assert TOKENIZER is not None
    router = start_router(replica, tmp_path, "--tokenizer", TOKENIZER)
    try:
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Say one word."}]}
        # as the Anthropic SDK before 2.x sends it (2.x sends Authorization: Bearer as well)
        status, _, raw_body = http("POST", router.url + "/v1/messages", body, headers={
            "x-api-key": KEYS["b"], "anthropic-version": "2023-06-01"})
        assert status == 200 and json.loads(raw_body)["content"], raw_body
        for headers in ({"x-api-key": "sk-wrong"}, {}):
            status, _, raw_body = http("POST", router.url + "/v1/messages", body, headers=headers)
            error = json.loads(raw_body)
            assert status == 401 and error["type"] == "error", error
            assert error["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=router.url, api_key="sk-wrong",
                                max_retries=0).messages.create(**body)
        status, _, _ = http("POST", router.url + "/v1/completions",
                            {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1},
                            headers={"x-api-key": KEYS["b"]})
        assert status == 401
    finally:
        router.stop()
