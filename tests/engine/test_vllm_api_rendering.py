"""Responses and Anthropic Messages bodies rendered as vLLM renders them: for each body of
``tests/vectors/vllm-api-conversions.json``, the token ids the router computes
(``POST /debug/route?api=...&token_ids=1``) equal those of vLLM's own render endpoints
(``/v1/messages/render``, ``/v1/responses/render``, served with ``--enable-scale-out``: the
same conversion and chat template path as ``/v1/messages`` and ``/v1/responses``). And both
APIs are answered through the router by the real engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.vllm_engine import HTTPError, post_json
from tests.engine.conftest import EngineFleet
from tests.engine.test_vllm_rendering import ids_mismatch

pytestmark = pytest.mark.timeout(1800)

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "vllm-api-conversions.json")
                     .read_text())


def _ids(engine_fleet: EngineFleet, api: str, body: dict[str, Any]) -> tuple[list[int], list[int]]:
    engine = engine_fleet.engines[0]
    try:
        theirs = post_json(f"{engine.url}/v1/{api}/render", body)["token_ids"]
    except HTTPError as exc:
        pytest.fail(f"vLLM refused the body: {exc.code} {exc.read()!r}")
    ours = post_json(f"{engine_fleet.url}/debug/route?api={api}&token_ids=1", body)["token_ids"]
    return ours, theirs


@pytest.mark.parametrize("name", sorted(VECTORS["messages"]))
def test_router_messages_ids_equal_vllms(engine_fleet: EngineFleet, name: str) -> None:
    body = {**VECTORS["messages"][name]["body"], "model": engine_fleet.engines[0].model}
    ours, theirs = _ids(engine_fleet, "messages", body)
    assert ours == theirs, ids_mismatch(ours, theirs)


@pytest.mark.parametrize("name", sorted(VECTORS["responses"]))
def test_router_responses_ids_equal_vllms(engine_fleet: EngineFleet, name: str) -> None:
    body = {**VECTORS["responses"][name]["body"], "model": engine_fleet.engines[0].model}
    ours, theirs = _ids(engine_fleet, "responses", body)
    assert ours == theirs, ids_mismatch(ours, theirs)


def test_both_apis_answered_through_the_router(engine_fleet: EngineFleet) -> None:
    model = engine_fleet.engines[0].model
    messages = post_json(f"{engine_fleet.url}/v1/messages", {
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]})
    assert messages["type"] == "message" and messages["usage"]["output_tokens"] >= 1
    response = post_json(f"{engine_fleet.url}/v1/responses",
                         {"model": model, "input": "Hi.", "max_output_tokens": 2})
    assert response["object"] == "response" and response["usage"]["output_tokens"] >= 1
