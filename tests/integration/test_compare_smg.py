"""The Shepherd Model Gateway (PyPI ``smg``, the SGLang gateway's successor) as a ``compare``
peer: a real ``smg launch`` in front of a real emulated fleet on loopback, every port it opens
bound to 127.0.0.1, and a tiny comparison of its ``cache_aware`` and ``prefix_hash`` policies.
Skipped when the ``peers`` extra is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from loadtest.cli import main
from loadtest.harness.fleet import (
    SMG,
    FleetConfig,
    LoopbackFleet,
    RouterSpec,
    http_get,
    peer_available,
)

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not peer_available(SMG), reason="smg is not installed (pip install 'prefix-router[peers]')"
    ),
]


def test_smg_binds_loopback_only_and_lists_every_replica(tmp_path: Path) -> None:
    config = FleetConfig(
        router=RouterSpec(SMG, "cache_aware"),
        replicas=2,
        num_gpu_blocks=2000,
        time_scale=20,
        log_dir=tmp_path / "logs",
    )
    with LoopbackFleet(config) as fleet:
        assert fleet.router_url is not None
        router = psutil.Process(fleet.pids["router"][0])
        listening = [
            c.laddr
            for p in (router, *router.children(recursive=True))
            for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        ]
        # the router port and the Prometheus port, nothing on a wildcard address
        assert len(listening) >= 2
        assert {addr.ip for addr in listening} == {"127.0.0.1"}
        status, body = http_get(fleet.router_url + "/workers")
        assert status == 200
        workers = json.loads(body)["workers"]
        assert {w["url"] for w in workers} == {r.url for r in fleet.replicas}
        assert all(w["is_healthy"] and w["connection_mode"] == "http" for w in workers)


def test_compare_runs_smg_cache_aware_and_prefix_hash(tmp_path: Path) -> None:
    out = tmp_path / "results"
    status = main(
        [
            "compare",
            "--policies",
            "smg:cache_aware,smg:prefix_hash",
            "--peers",
            "no",
            "--replicas",
            "2",
            "--limit",
            "30",
            "--speedup",
            "40",
            "--num-gpu-blocks",
            "8000",
            "--max-output-tokens",
            "32",
            "--progress-interval",
            "5",
            "--no-plots",
            "--no-bounds",
            "--output-dir",
            str(out),
        ]
    )
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == {"smg:cache_aware", "smg:prefix_hash"}
    assert results["failed"] == {}
    for label, m in results["policies"].items():
        assert m["num_requests"] == 30 and m["num_errors"] == 0, label
        # the engines counted every request and every prompt token of the text prompts
        assert sum(m["requests_per_replica"].values()) == 30, label
        assert 0.0 < m["token_hit_rate"] < 1.0, label  # block 0 is shared by every request
        assert m["router_cpu_s_per_request"] > 0, label
        assert m["cpu_s"]["router"] > 0 and m["cpu_s"]["emulator"] > 0, label
        assert m["fleet"]["hash_algo"] == "sha256", label
        records = [
            json.loads(line)
            for line in (out / f"records-{label.replace(':', '-')}.jsonl").read_text().splitlines()
        ]
        assert len(records) == 30
        # text prompts of exactly the trace's token counts (smg takes no token-id prompts)
        assert all(r["prompt_tokens"] == r["input_length"] for r in records)
    notes = " ".join(results.get("notes", []))
    assert "smg:cache_aware accepts only text prompts" in notes
