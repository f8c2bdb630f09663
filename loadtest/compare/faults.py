"""Fault measurements on a real loopback fleet (issue 15's scenarios, re-runnable). Process I/O.

``python -m loadtest.compare.faults SCENARIO`` starts what the scenario needs (real Redis, one emulator
process with 4 replicas, a worker each, a ``loadtest.harness.fault_proxy`` in front of replica-3 that
its worker polls too, the router on port 0), prints one JSON line of figures and stops it all:

* ``refuse``: share of 40 new 1,000-token prompts sent to a replica answering 500 to
  generation (and the same with every replica well, the baseline);
* ``hang``: share of the next 20 new prompts sent to a replica that never answers them
  (router ``--first-byte-timeout-s 2``), and the time from the hang until the replica is
  benched while streamed requests flow (default ``stall_timeout_s``);
* ``hang-unstreamed``: a replica that never answers, non-streamed traffic only, default router
  settings (issue 29): 60 new 1,000-token prompts, one every 2 s from its own client (30 s
  client timeout); prompts sent to the hung replica before it is benched and in all (the
  router's own half-open probes among them), seconds from the hang to the bench, the clients'
  statuses;
* ``template``: latency of 10 ordinary chat requests sent while two nested-loop
  ``chat_template`` requests are in flight, with the default (refused) and trusted settings;
* ``cold``: a router started while Redis is down: seconds from its start to its first 200,
  with the fleet cache file and with a ``--fallback-replica`` only;
* ``stall``: the shortest whole-replica stall (every request, ``/health`` and the worker's
  engine polls hang) that takes the replica out of rotation, worker-reported and static;
* ``slow-clients``: 300 slow-header and 300 slow-body connections held for 60 s; the router's
  open fds before, with them open and after, and when the last one was closed.
* ``rss``: the router's resident memory (VmRSS) before, after 12 distinct 2 MB text prompts
  and 36 distinct 2 MB chat prompts (``/debug/route``: parsed, rendered, tokenized, hashed),
  its peak, and after 12 s idle; the prompt caches' sizes from ``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.harness import processes
from loadtest.harness.redis_server import RedisServer

KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                "{% endfor %}{{ messages[0].content }}")
BAD = "replica-3"


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
    except (OSError, urllib.error.URLError):
        return 0, {}, b""


def wait_for(cond: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    """``loadtest.harness.processes.wait_for`` with this module's positional timeout."""
    return processes.wait_for(cond, timeout_s, interval_s)


class Lab:
    """The processes of one scenario (``loadtest.harness.processes``), stopped newest first."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="faults-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.redis: RedisServer | None = None

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``python -m ARGS`` (or the command ``ARGS`` when it starts with the interpreter)."""
        command = list(args) if args[0] == processes.PYTHON else [processes.PYTHON, "-m", *args]
        proc = processes.start_process(command, env, self.tmp / f"p{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def ready(self, name: str) -> Path:
        return self.tmp / f"{name}-{time.monotonic_ns()}.json"

    def emulator(self, *args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """An emulator process (``processes.EMULATE`` plus ``args``); its replicas once ready."""
        proc, replicas = processes.start_emulator(self.ready("emu"), args, env,
                                                self.tmp / f"p{len(self.procs)}.log", 90)
        self.procs.append(proc)
        return replicas

    def fleet(self, replicas: int = 4) -> tuple[list[dict[str, Any]], str]:
        """Redis, emulators and workers; replica-3 behind the fault proxy. Returns the replicas
        and the proxy URL."""
        self.redis = RedisServer().start()
        reps = self.emulator("--replicas", str(replicas), "--kv-events-config", KV_EVENTS,
                             "--time-scale", "20", env={"PYTHONHASHSEED": "0"})
        proxy_ready = self.ready("proxy")
        proc = self.spawn("loadtest.harness.fault_proxy", "--target", reps[-1]["url"], "--ready-file",
                          str(proxy_ready))
        proxy = processes.wait_ready(proxy_ready, [proc], 30)["url"]
        for rep in reps:
            url = proxy if rep["index"] == replicas - 1 else rep["url"]
            self.spawn("worker.cli", "report", "--engine-url", url, "--kv-events-endpoint",
                       rep["kv_events_endpoint"], "--kv-replay-endpoint", rep["kv_replay_endpoint"],
                       "--redis-url", self.redis.url, "--replica-id", f"replica-{rep['index']}",
                       "--advertise-url", url, "--hash-seed", "0", "--metrics-port", "0")
        return reps, proxy

    def router(self, *args: str, wait: int | None = None) -> tuple[str, subprocess.Popen[bytes]]:
        ready = self.ready("router")
        proc = self.spawn("router.cli", "serve", "--port", "0", "--ready-file", str(ready), *args)
        url: str = processes.wait_ready(ready, [proc])["url"]
        if wait is not None:
            processes.wait_for(lambda: sum(r["routable"] for r in ready_of(url)["replicas"]) == wait,
                             60, message=f"{wait} routable replicas", procs=[proc])
        return url, proc

    def close(self) -> None:
        processes.stop_processes(self.procs)
        if self.redis is not None:
            self.redis.stop()


def ready_of(url: str) -> dict[str, Any]:
    return json.loads(http("GET", url + "/ready", timeout=10)[2])


def fault(proxy: str, mode: str | None = None, scope: str = "generate") -> dict[str, Any]:
    body = None if mode is None else {"mode": mode, "scope": scope}
    return json.loads(http("POST" if mode else "GET", proxy + "/_fault", body)[2])


def new_prompt(seed: int, n: int = 1000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def _share(router: str, proxy: str, num: int, seed: int) -> dict[str, Any]:
    before = fault(proxy)["generate_requests"]
    statuses: dict[str, int] = {}
    served: dict[str, int] = {}
    for i in range(num):
        status, headers, _ = http("POST", router + "/v1/completions",
                                  {"prompt": new_prompt(seed + i), "max_tokens": 1})
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        rid = headers.get("x-prefix-router-replica", "")
        served[rid] = served.get(rid, 0) + 1
    return {"sent_to_faulty": fault(proxy)["generate_requests"] - before, "of": num,
            "statuses": statuses, "answered_by": dict(sorted(served.items()))}


def scenario_refuse(lab: Lab) -> dict[str, Any]:
    _, proxy = lab.fleet()
    router, _ = lab.router("--redis-url", lab.redis.url if lab.redis else "", "--hash-seed", "0",
                           wait=4)
    baseline = _share(router, proxy, 40, 1000)
    fault(proxy, "500")
    return {"baseline": baseline, "replica_answering_500": _share(router, proxy, 40, 2000)}


def _stream(router: str, seed: int, out: list[int]) -> None:
    status, _, raw = http("POST", router + "/v1/completions", {
        "prompt": new_prompt(seed, 256), "max_tokens": 16, "stream": True}, timeout=120)
    out.append(200 if status == 200 and b"[DONE]" in raw and b'"error"' not in raw else status)


def scenario_hang(lab: Lab) -> dict[str, Any]:
    _, proxy = lab.fleet()
    redis_url = lab.redis.url if lab.redis else ""
    router, _ = lab.router("--redis-url", redis_url, "--hash-seed", "0",
                           "--first-byte-timeout-s", "2", wait=4)
    fault(proxy, "hang")
    share = _share(router, proxy, 20, 3000)
    fault(proxy, "pass")
    # detection with the default stall timeout, a fresh router, streams flowing
    router2, _ = lab.router("--redis-url", redis_url, "--hash-seed", "0", wait=4)
    results: list[int] = []
    fault(proxy, "hang")
    hung_at = time.monotonic()
    detected = None
    threads = []
    seed = 4000
    while detected is None and time.monotonic() - hung_at < 60:
        t = threading.Thread(target=_stream, args=(router2, seed, results))
        t.start()
        threads.append(t)
        seed += 1
        time.sleep(0.2)
        state = {r["replica_id"]: r for r in ready_of(router2)["replicas"]}[BAD]
        if state["circuit"] != "closed":
            detected = time.monotonic() - hung_at
    for t in threads:
        t.join(120)
    return {"first_byte_timeout_2s": share, "stall_detected_s": detected,
            "streams": {"ok": results.count(200), "failed": len(results) - results.count(200)}}


def scenario_hang_unstreamed(lab: Lab) -> dict[str, Any]:
    _, proxy = lab.fleet()
    router, _ = lab.router("--redis-url", lab.redis.url if lab.redis else "", "--hash-seed", "0",
                           wait=4)
    fault(proxy, "hang")
    start = fault(proxy)
    before, probes = start["generate_requests"], start.get("probe_requests", 0)
    statuses: list[int] = []

    def send(seed: int) -> None:
        statuses.append(http("POST", router + "/v1/completions",
                             {"prompt": new_prompt(seed), "max_tokens": 16}, timeout=30)[0])

    hung_at = time.monotonic()
    benched: dict[str, Any] = {}
    threads = []
    for i in range(60):
        t = threading.Thread(target=send, args=(5000 + i,))
        t.start()
        threads.append(t)
        next_at = hung_at + 2.0 * (i + 1)
        while time.monotonic() < next_at:
            if not benched:
                state = {r["replica_id"]: r for r in ready_of(router)["replicas"]}[BAD]
                if state["circuit"] != "closed":
                    benched = {"after_s": round(time.monotonic() - hung_at, 1),
                               "prompts_sent_to_it": fault(proxy)["generate_requests"] - before}
            time.sleep(0.2)
    for t in threads:
        t.join(150)
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    end = fault(proxy)
    return {"benched": benched or None, "sent_to_hung_in_120_s": end["generate_requests"]
            - before, "of": 60, "router_probes_among_them": end.get("probe_requests", 0) - probes,
            "statuses": counts}


def scenario_template(lab: Lab) -> dict[str, Any]:
    from router.request.prompts import default_tokenizer_dir

    tokenizer = default_tokenizer_dir() or ""
    url = lab.emulator("--time-scale", "20")[0]["url"]
    messages = [{"role": "user", "content": "hello there"}]
    out: dict[str, Any] = {}
    for label, extra in (("default", []), ("trusted", ["--trust-request-chat-template"])):
        router, _ = lab.router("--replica", url, "--tokenizer", tokenizer, *extra, wait=1)
        # warm up: the first chat render compiles the model's template
        http("POST", router + "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        if extra:  # let the render child load its tokenizer before the measurement
            http("POST", router + "/debug/route", {"messages": messages,
                                                   "chat_template": "{{ messages[0].content }}"})
        attacks: list[tuple[int, float]] = []

        def attack(router: str = router, attacks: list[tuple[int, float]] = attacks) -> None:
            started = time.monotonic()
            status, _, _ = http("POST", router + "/v1/chat/completions", {
                "messages": messages, "max_tokens": 1, "chat_template": NESTED_LOOPS})
            attacks.append((status, round(time.monotonic() - started, 2)))

        threads = [threading.Thread(target=attack) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        latencies = []
        for i in range(10):
            started = time.monotonic()
            status, _, _ = http("POST", router + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 1})
            latencies.append((status, round(time.monotonic() - started, 3)))
        for t in threads:
            t.join(120)
        out[label] = {"other_chat_requests": {"statuses": sorted({s for s, _ in latencies}),
                                              "max_s": max(t for _, t in latencies)},
                      "template_requests": attacks}
    return out


def scenario_cold(lab: Lab) -> dict[str, Any]:
    reps, _ = lab.fleet()
    assert lab.redis is not None
    redis_url = lab.redis.url
    cache = lab.tmp / "fleet-cache.json"
    lab.router("--redis-url", redis_url, "--hash-seed", "0", "--fleet-cache-file", str(cache),
               wait=4)
    wait_for(lambda: len(json.loads(cache.read_text())["replicas"]) == 4, 30)
    lab.redis.stop()
    out: dict[str, Any] = {}
    for label, extra in (("fleet_cache_file", ["--fleet-cache-file", str(cache)]),
                         ("fallback_replica", ["--fallback-replica", reps[0]["url"]]),
                         ("neither", [])):
        started = time.monotonic()
        router, proc = lab.router("--redis-url", redis_url, "--hash-seed", "0", *extra)
        def answered(router: str = router) -> bool:
            return http("POST", router + "/v1/completions", {"prompt": [1, 2, 3],
                                                             "max_tokens": 1})[0] == 200

        try:
            wait_for(answered, 20)
            out[label] = {"first_200_after_start_s": round(time.monotonic() - started, 2)}
        except TimeoutError:
            status = http("POST", router + "/v1/completions", {"prompt": [1, 2, 3]})[0]
            out[label] = {"first_200_after_start_s": None, "status_after_20_s": status}
        proc.terminate()
    return out


def scenario_stall(lab: Lab) -> dict[str, Any]:
    reps, proxy = lab.fleet()
    redis_url = lab.redis.url if lab.redis else ""
    reported, _ = lab.router("--redis-url", redis_url, "--hash-seed", "0", wait=4)
    static, _ = lab.router(*(a for r in reps[:-1] for a in ("--replica", r["url"])),
                           "--replica", proxy, wait=4)
    static_bad = proxy.removeprefix("http://")
    out: dict[str, Any] = {}
    for stall_s in (2, 4, 6, 8, 10, 12, 14):
        removed = {"worker_reported": False, "static": False}
        fault(proxy, "hang", scope="all")
        started = time.monotonic()
        while time.monotonic() - started < stall_s + 8:
            if time.monotonic() - started >= stall_s:
                fault(proxy, "pass")
            for label, router, rid in (("worker_reported", reported, BAD),
                                       ("static", static, static_bad)):
                state = {r["replica_id"]: r for r in ready_of(router)["replicas"]}.get(rid)
                if state is None or not state["routable"]:
                    removed[label] = True
            time.sleep(0.2)
        fault(proxy, "pass")
        out[f"{stall_s}s"] = removed
        wait_for(lambda: all(r["routable"] for r in ready_of(reported)["replicas"])
                 and len(ready_of(reported)["replicas"]) == 4, 30)
        wait_for(lambda: all(r["routable"] for r in ready_of(static)["replicas"]), 30)
    return out


def scenario_slow_clients(lab: Lab) -> dict[str, Any]:
    router, proc = lab.router("--replica", "http://127.0.0.1:9")

    def fds() -> int:
        return len(os.listdir(f"/proc/{proc.pid}/fd"))

    host, port = router.removeprefix("http://").split(":")
    before = fds()
    heads, bodies = [], []
    for i in range(600):
        sock = socket.create_connection((host, int(port)), timeout=10)
        if i < 300:
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            heads.append(sock)
        else:
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
            bodies.append(sock)
        sock.setblocking(False)
    time.sleep(1.0)
    opened = fds()
    started = time.monotonic()
    open_socks = set(heads + bodies)
    last_closed = None
    while time.monotonic() - started < 60:
        for sock in list(open_socks):
            try:
                sock.send(b"a")  # a byte every ~0.5 s per connection: never idle, never done
                if sock.recv(65536) == b"":
                    raise ConnectionResetError
            except BlockingIOError:
                pass
            except OSError:
                open_socks.discard(sock)
        if not open_socks and last_closed is None:
            last_closed = time.monotonic() - started
        time.sleep(0.5)
    after = fds()
    for sock in heads + bodies:
        sock.close()
    return {"router_fds": {"before": before, "with_600_slow_connections": opened,
                           "after_60_s": after},
            "still_open_after_60_s": len(open_socks), "all_closed_after_s": last_closed}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise ValueError("no VmRSS")


def _text(seed: int, num_chars: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "block", "router", "replica",
             "prefix", "token", "tier", "ring", "load", "engine", "stream"]
    rng = random.Random(seed)
    out, size = [], 0
    while size < num_chars:
        line = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(12)) + "\n"
        out.append(line)
        size += len(line)
    return "".join(out)


def scenario_rss(lab: Lab) -> dict[str, Any]:
    from router.request.prompts import default_tokenizer_dir

    url = lab.emulator("--time-scale", "20")[0]["url"]
    router, proc = lab.router("--replica", url, "--tokenizer", default_tokenizer_dir() or "",
                              wait=1)
    http("POST", router + "/debug/route", {"prompt": "warm up"})
    before = _rss_mib(proc.pid)
    peak = before
    for i in range(12):
        status, _, body = http("POST", router + "/debug/route", {"prompt": _text(i, 2 << 20)})
        assert status == 200, body[:200]
        peak = max(peak, _rss_mib(proc.pid))
    after_text = _rss_mib(proc.pid)
    for i in range(36):
        status, _, body = http("POST", router + "/debug/route", {
            "messages": [{"role": "user", "content": _text(100 + i, 2 << 20)}]})
        assert status == 200, body[:200]
        peak = max(peak, _rss_mib(proc.pid))
    after_chat = _rss_mib(proc.pid)
    time.sleep(12)
    metrics = http("GET", router + "/metrics")[2].decode()
    caches = [line for line in metrics.splitlines()
              if line.startswith("router_prompt_cache")]
    return {"router_rss_mib": {"before": before, "after_12_text_2mb": after_text,
                               "after_36_chat_2mb": after_chat, "peak": peak,
                               "after_12_s_idle": _rss_mib(proc.pid)}, "cache_metrics": caches}


SCENARIOS: dict[str, Callable[[Lab], dict[str, Any]]] = {
    "refuse": scenario_refuse, "hang": scenario_hang, "hang-unstreamed": scenario_hang_unstreamed,
    "template": scenario_template,
    "cold": scenario_cold, "stall": scenario_stall, "slow-clients": scenario_slow_clients,
    "rss": scenario_rss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.compare.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    args = parser.parse_args(argv)
    lab = Lab()
    try:
        result = SCENARIOS[args.scenario](lab)
    finally:
        lab.close()
    print(json.dumps({"scenario": args.scenario, **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
