"""Pooling, scoring, rerank and tokenizer paths and model aliases through the router, on a
fleet of two real emulator processes (static replicas, real HTTP on loopback).

The pooling paths are load-balanced (least loaded, ties in turn) with the model filter and the
health rules of completions; a replica killed mid-test is skipped (its refused connection is
retried on the other, then it is out of rotation). Aliases rewrite the body's ``model``; a
canary split holds its weights over 1,000 requests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import start_emulator, stop_process, wait_for
from tests.integration.test_router_fleet import Router, http

pytestmark = pytest.mark.timeout(240)

BASE_MODEL = "emulated-llm"
LORA_NAME = "sql-lora"
REPLICA_HEADER = "x-prefix-router-replica"


class StaticFleet:
    """Two emulator processes of one replica each (so one can be killed alone)."""

    def __init__(self, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        for i in range(2):
            proc, replicas = start_emulator(
                tmp / f"emulator-{i}.json",
                ["--lora-modules", f"{LORA_NAME}=/models/{LORA_NAME}", "--time-scale", "20"],
            )
            self.procs.append(proc)
            self.urls.append(replicas[0]["url"])

    def replica_id(self, i: int) -> str:
        return self.urls[i].removeprefix("http://")

    def stop(self) -> str:
        return "\n".join(stop_process(p) for p in reversed(self.procs))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StaticFleet]:
    f = StaticFleet(tmp_path_factory.mktemp("pooling-fleet"))
    try:
        yield f
    finally:
        f.stop()


def start_router(fleet: StaticFleet, tmp: Path, *extra: str) -> Router:
    router = Router(
        tmp,
        [arg for url in fleet.urls for arg in ("--replica", url)] + ["--policy", "prefix", *extra],
    )
    wait_for(
        lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2,
        60,
        message="both static replicas routable",
    )
    return router


@pytest.fixture(scope="module")
def router(fleet: StaticFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = start_router(
        fleet,
        tmp_path_factory.mktemp("pooling-router"),
        "--model-alias",
        "chat=emulated-llm",
        "--model-alias",
        f"canary=emulated-llm:90;{LORA_NAME}:10",
    )
    try:
        yield r
    finally:
        r.stop()


def post_json(router: Router, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    status, headers, raw = router.post(path, body)
    assert status == 200, (path, status, raw[:300])
    return json.loads(raw), headers[REPLICA_HEADER]


BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": BASE_MODEL, "input": ["a cat", "a dog"]},
    "/pooling": {"model": BASE_MODEL, "input": "a cat"},
    "/score": {"model": BASE_MODEL, "queries": "a cat", "documents": ["a dog", "a cat"]},
    "/v1/score": {"model": BASE_MODEL, "text_1": "a cat", "text_2": "a cat"},
    "/rerank": {"model": BASE_MODEL, "query": "a cat", "documents": ["a dog", "a cat"], "top_n": 1},
    "/v1/rerank": {"model": BASE_MODEL, "query": "a cat", "documents": ["a dog", "a cat"]},
    "/v2/rerank": {"model": BASE_MODEL, "query": "a cat", "documents": ["a dog"]},
    "/tokenize": {"model": BASE_MODEL, "prompt": "a cat"},
    "/detokenize": {"model": BASE_MODEL, "tokens": [64, 8251]},
}


def test_pooling_scoring_and_tokenizer_paths_are_answered_in_vllms_shapes(router: Router) -> None:
    answers = {path: post_json(router, path, body)[0] for path, body in BODIES.items()}
    emb = answers["/v1/embeddings"]
    assert emb["object"] == "list" and [d["index"] for d in emb["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) > 0 for d in emb["data"])
    assert emb["usage"]["prompt_tokens"] > 0 and emb["model"] == BASE_MODEL
    assert answers["/pooling"]["data"][0]["object"] == "pooling"
    scores = answers["/score"]["data"]
    assert [s["object"] for s in scores] == ["score", "score"]
    assert scores[1]["score"] == pytest.approx(1.0)  # a text against itself
    top = answers["/rerank"]["results"]
    assert len(top) == 1 and top[0]["index"] == 1 and top[0]["document"]["text"] == "a cat"
    assert len(answers["/v1/rerank"]["results"]) == 2
    assert answers["/tokenize"]["count"] == len(answers["/tokenize"]["tokens"]) > 0
    assert isinstance(answers["/detokenize"]["prompt"], str)


def test_pooling_requests_are_balanced_over_the_replicas(
    router: Router, fleet: StaticFleet
) -> None:
    served = Counter(
        post_json(router, path, BODIES[path])[1]
        for _ in range(10)
        for path in ("/v1/embeddings", "/rerank")
    )
    # least loaded with ties taken in turn: sequential requests alternate
    assert served == {fleet.replica_id(0): 10, fleet.replica_id(1): 10}


def test_an_unknown_model_is_a_404_and_a_bad_body_a_400(router: Router) -> None:
    status, _, raw = router.post("/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and json.loads(raw)["error"]["type"] == "NotFoundError"
    status, _, raw = router.post("/rerank", {"model": 7, "query": "x", "documents": ["y"]})
    assert status == 400 and "'model' must be a string" in json.loads(raw)["error"]["message"]


def test_a_bad_input_error_names_the_field_the_client_sent(router: Router) -> None:
    """Issue 29 review: an embeddings body with no ``input`` was refused as "prompt is
    required" (the engine reads ``input`` as a completions ``prompt``): the client never sent a
    ``prompt``."""
    for body in ({"model": BASE_MODEL}, {"model": BASE_MODEL, "input": 7}):
        status, _, raw = router.post("/v1/embeddings", body)
        error = json.loads(raw)["error"]
        assert status == 400 and "input" in error["message"], error
        assert "prompt" not in error["message"] and error["param"] == "input", error


def test_models_list_the_aliases(router: Router) -> None:
    status, _, raw = http("GET", router.url + "/v1/models")
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    assert status == 200 and {BASE_MODEL, LORA_NAME, "chat", "canary"} <= cards.keys()
    assert cards["chat"]["root"] == BASE_MODEL and cards["chat"]["owned_by"] == "prefix-router"


def test_an_alias_is_rewritten_to_the_served_model(router: Router) -> None:
    status, _, raw = router.post(
        "/v1/completions", {"model": "chat", "prompt": [11, 12, 13], "max_tokens": 1}
    )
    assert status == 200, raw[:300]
    assert json.loads(raw)["model"] == BASE_MODEL  # the engine saw the served name
    status, _, raw = router.post("/debug/route", {"model": "chat", "prompt": [11, 12, 13]})
    assert status == 200 and json.loads(raw)["model"] == BASE_MODEL
    body, _ = post_json(router, "/v1/embeddings", {"model": "chat", "input": "x"})
    assert body["model"] == BASE_MODEL


def test_a_canary_split_is_honoured_within_five_percent_over_1000_requests(router: Router) -> None:
    models = Counter(
        post_json(router, "/v1/embeddings", {"model": "canary", "input": [5, 6]})[0]["model"]
        for _ in range(1000)
    )
    assert abs(models[BASE_MODEL] / 1000 - 0.9) <= 0.05, models
    assert abs(models[LORA_NAME] / 1000 - 0.1) <= 0.05, models


def test_a_dead_replica_is_skipped(fleet: StaticFleet, tmp_path: Path) -> None:
    """Its own router and fleet member: the module's other tests keep both replicas."""
    proc, replicas = start_emulator(tmp_path / "doomed.json", ["--time-scale", "20"])
    router = Router(tmp_path, ["--replica", fleet.urls[0], "--replica", replicas[0]["url"]])
    try:
        wait_for(
            lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2,
            60,
            message="both replicas routable",
        )
        dead = replicas[0]["url"].removeprefix("http://")
        stop_process(proc)
        served = [
            post_json(router, path, BODIES[path])[1]
            for _ in range(5)
            for path in ("/v1/embeddings", "/score", "/tokenize")
        ]
        # every request answered, each by the live replica (a refused connection is retried
        # on the other, then the replica is skipped)
        assert served == [fleet.replica_id(0)] * 15 and dead not in served
        wait_for(
            lambda: not {r["replica_id"]: r for r in router.ready()["replicas"]}[dead]["routable"],
            60,
            message="the dead replica out of rotation",
        )
    finally:
        router.stop()
        stop_process(proc)


def test_a_hung_replica_does_not_hold_pooling_requests(fleet: StaticFleet, tmp_path: Path) -> None:
    """Issue 35 review F2: an embeddings request sent to a replica that accepts connections and
    never answers (its emulator stopped by SIGSTOP) waited until the client gave up, although a
    non-streamed chat there moves at its first-byte deadline. Default deadline settings: every
    request is answered by the live replica (the one sent to the hung replica moved before its
    first byte), and the miss counts against the hung replica."""
    proc, replicas = start_emulator(tmp_path / "hung.json", ["--time-scale", "20"])
    router = Router(tmp_path, ["--replica", fleet.urls[0], "--replica", replicas[0]["url"]])
    hung = replicas[0]["url"].removeprefix("http://")
    try:
        wait_for(lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2, 60,
                 message="both replicas routable")
        os.kill(proc.pid, signal.SIGSTOP)
        served = []
        for i in range(4):  # ties go in turn: one of the first two is sent to the hung replica
            status, headers, raw = router.post("/v1/embeddings",
                                               {"model": BASE_MODEL, "input": f"x {i}"}, timeout=60)
            assert status == 200, (i, status, raw[:300])
            served.append(headers[REPLICA_HEADER])
        assert served == [fleet.replica_id(0)] * 4, served
        metrics = router.metrics()
        assert any(f'router_upstream_errors_total{{kind="{kind}",replica="{hung}"}}' in metrics
                   for kind in ("hung", "first_byte_deadline")), metrics
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        router.stop()
        stop_process(proc)
