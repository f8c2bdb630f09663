"""The pure core imports no I/O library: fleet state, errors, policy, load tracking, index,
hashing, prompt chains and caches are importable without aiohttp, redis or zmq (issue 14)."""

from __future__ import annotations

import json
import subprocess
import sys

PURE = ("router.fleet", "router.errors", "router.policy", "router.index", "router.contract",
        "router.hashing", "router.chain_cache", "router.prompts", "router.lru", "router.ring",
        "router.ttft", "router.health", "router.audit", "router.capacity", "router.prompt_path",
        "router.routing", "router.dispatch", "router.kv_event_sources", "worker.replica_view",
        "worker.block_set", "worker.block_keys", "worker.kv_events")
IO_LIBRARIES = ("aiohttp", "redis", "zmq")


def test_pure_modules_import_no_io_library() -> None:
    code = (f"import importlib, json, sys\nfor m in {PURE!r}: importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {IO_LIBRARIES!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert json.loads(out.splitlines()[-1]) == []


def test_the_io_edges_do_import_them() -> None:
    # the check above can fail: the HTTP and Redis edges do load aiohttp and redis
    code = ("import sys, router.proxy, worker.redis_writer\n"
            "print(all(m in sys.modules for m in ('aiohttp', 'redis')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.split()[-1] == "True"
