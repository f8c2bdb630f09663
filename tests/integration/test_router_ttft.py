"""``router_ttft_seconds`` through real processes: one emulator replica (with
``--enable-prompt-tokens-details``) behind a router that knows it as a static
replica. A streamed request with usage is split by the engine's own
``cached_tokens`` (source=engine), one without usage by the router's prediction
(source=predicted); a non-streamed request is no TTFT sample at all."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import EMULATE, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import Router, read_json_file

pytestmark = pytest.mark.timeout(120)

MODEL = "emulated-llm"


@pytest.fixture(scope="module")
def replica_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ready = tmp_path_factory.mktemp("ttft-emulator") / "emulator.json"
    proc = start_process([*EMULATE, "--ready-file", str(ready),
                          "--enable-prompt-tokens-details", "--time-scale", "20"])
    try:
        info = wait_for(lambda: read_json_file(ready) or proc.poll() is not None, 60,
                        message="emulator ready file")
        if not isinstance(info, dict):
            raise RuntimeError(stop_process(proc))
        yield info["replicas"][0]["url"]
    finally:
        stop_process(proc)


@pytest.fixture
def router(replica_url: str, tmp_path: Path) -> Iterator[Router]:
    r = Router(tmp_path, ["--replica", replica_url])
    wait_for(lambda: r.ready()["ready"], 20, message="static replica routable")
    yield r
    r.stop()


def ttft_counts(router: Router) -> dict[tuple[str, str, str], float]:
    """``{(model, cache, source): sample count}`` from the router's /metrics."""
    out = {}
    for m in re.finditer(r'^router_ttft_seconds_count\{([^}]*)\} (\S+)$', router.metrics(), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[(labels["model"], labels["cache"], labels["source"])] = float(m.group(2))
    return out


def stream(router: Router, prompt: list[int], include_usage: bool) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    status, _, raw = router.post("/v1/completions", body)
    assert status == 200, raw
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"]


def test_streamed_ttft_split_by_engine_cached_tokens(router: Router) -> None:
    prompt = random.Random(18).sample(range(1000, 100000), 200)
    first = stream(router, prompt, include_usage=True)
    assert first[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ttft_counts(router) == {(MODEL, "miss", "engine"): 1.0}
    second = stream(router, prompt, include_usage=True)
    assert second[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 12 full blocks
    assert ttft_counts(router) == {(MODEL, "miss", "engine"): 1.0, (MODEL, "hit", "engine"): 1.0}


def test_without_usage_the_prediction_is_used_and_labelled(router: Router) -> None:
    # a static replica sends no KV events: the router predicts a hit there from its own
    # placement of the first request only, and the engine, asked, confirms it
    prompt = random.Random(19).sample(range(1000, 100000), 200)
    stream(router, prompt, include_usage=False)
    stream(router, prompt, include_usage=False)
    assert ttft_counts(router) == {(MODEL, "miss", "predicted"): 1.0,
                                   (MODEL, "hit", "predicted"): 1.0}
    last = stream(router, prompt, include_usage=True)
    assert last[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert ttft_counts(router) == {(MODEL, "miss", "predicted"): 1.0,
                                   (MODEL, "hit", "predicted"): 1.0,
                                   (MODEL, "hit", "engine"): 1.0}


def test_non_streamed_request_is_not_a_ttft_sample(router: Router) -> None:
    prompt = random.Random(20).sample(range(1000, 100000), 200)
    status, _, raw = router.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 2})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 'router_requests_total{endpoint="/v1/completions"' in router.metrics()
    assert ttft_counts(router) == {}
