"""The router's prediction held against real engines: two vLLM CPU engines, their workers, Redis
and a router (the package's ``engine_fleet``, exact index). For a multi-tenant request sequence
the router's predicted hit on the replica it chose (``x-prefix-router-confirmed-hit-tokens``)
equals the engine's own ``usage.prompt_tokens_details.cached_tokens`` for every request, and a
tenant's ``cache_salt`` keeps its blocks from every other tenant in the engine itself.

Before each request the test waits until the router's index holds exactly what each engine's
KV events say it caches (``KVEventTap``): the claim is that the prediction is exact once the
events have arrived, not that they arrive within some time.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from loadtest.harness.vllm_engine import KVEventTap, post_json
from loadtest.replay.text import default_vocabulary
from tests.engine.conftest import SETTLE_S, EngineFleet, index_matches_engines
from tests.helpers import wait_for
from tests.integration.test_router_fleet import http

# the package's engines start together when the first is needed (conftest.EnginePool)
pytestmark = pytest.mark.timeout(2700)

def make_text(rng: random.Random, num_tokens: int) -> str:
    """Text of ``num_tokens`` Qwen3 tokens, drawn from ``rng``."""
    return default_vocabulary().text_of_length(num_tokens, rng.randrange(1 << 30))


HIT_HEADER = "x-prefix-router-confirmed-hit-tokens"
REPLICA_HEADER = "x-prefix-router-replica"


def send(fleet: EngineFleet, taps: dict[str, KVEventTap], path: str,
         body: dict[str, Any]) -> tuple[str, int, int]:
    """Send ``body`` through the router once its index has caught up with the engines:
    ``(replica, predicted hit tokens, engine cached_tokens)``."""
    wait_for(lambda: index_matches_engines(fleet, taps), SETTLE_S, 0.1,
             "the router's index to match the engines' KV events")
    status, headers, raw = http("POST", fleet.url + path,
                                {**body, "max_tokens": 1, "temperature": 0}, timeout=300)
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    return (headers[REPLICA_HEADER], int(headers[HIT_HEADER]),
            int(usage["prompt_tokens_details"]["cached_tokens"]))


def tenant_sequence(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """A multi-tenant sequence: three tenants (two with a ``cache_salt``) sharing one long
    system prompt, each in a multi-turn chat over a shared document, plus completions of a
    shared text prefix; repeated bodies, growing conversations, interleaved tenants."""
    system = make_text(rng, 900)
    document = make_text(rng, 1400)
    salts = {"a": "tenant-a-salt", "b": "tenant-b-salt", "c": None}
    convos: dict[str, list[dict[str, str]]] = {
        t: [{"role": "system", "content": system},
            {"role": "user", "content": f"{document}\n\nSummarise it for {t}."}] for t in salts}
    steps: list[tuple[str, dict[str, Any]]] = []
    for turn in range(3):
        for tenant, salt in salts.items():
            body: dict[str, Any] = {"messages": list(convos[tenant])}
            if salt is not None:
                body["cache_salt"] = salt
            steps.append(("/v1/chat/completions", body))
            convos[tenant] += [{"role": "assistant", "content": make_text(rng, 120)},
                               {"role": "user", "content": f"Follow-up {turn}: {make_text(rng, 60)}"}]
        prefix = f"{system}\n{document}\n"
        steps.append(("/v1/completions", {"prompt": prefix + make_text(rng, 200)}))
        steps.append(("/v1/completions", {"prompt": prefix + make_text(rng, 200),
                                          "cache_salt": salts["a"]}))
    steps.append(steps[0])  # an exact repeat: the whole prompt cached but its last token
    return steps


def test_predicted_hits_equal_the_engines_cached_tokens(engine_fleet: EngineFleet,
                                                        taps: dict[str, KVEventTap]) -> None:
    rng = random.Random(21)
    results = []
    for path, body in tenant_sequence(rng):
        body = {"model": engine_fleet.engines[0].model, **body}
        results.append(send(engine_fleet, taps, path, body))
    mismatches = [(i, r) for i, r in enumerate(results) if r[1] != r[2]]
    assert not mismatches, f"(request, (replica, predicted, cached)): {mismatches}"
    assert sum(cached for _, _, cached in results) > 0  # the sequence did hit


def test_cache_salt_isolates_tenants_in_the_engine(engine_fleet: EngineFleet,
                                                   taps: dict[str, KVEventTap]) -> None:
    rng = random.Random(22)
    engine = engine_fleet.engines[0]
    messages = [{"role": "system", "content": make_text(rng, 800)},
                {"role": "user", "content": make_text(rng, 100)}]

    def direct(salt: str | None) -> int:
        """cached_tokens of the body sent straight to engine 0."""
        body: dict[str, Any] = {"model": engine.model, "messages": messages, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        usage = post_json(f"{engine.url}/v1/chat/completions", body)["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    assert direct("tenant-a") == 0
    warm = direct("tenant-a")
    assert warm > 0  # the same tenant hits its own blocks
    assert direct("tenant-b") == 0  # another tenant's salt: nothing cached for it
    assert direct(None) == 0  # and no salt at all
    # the router predicts the same: tenant a holds a hit on engine 0, a tenant that has sent
    # nothing yet none anywhere (tenant b's request above stored b's own blocks)
    wait_for(lambda: index_matches_engines(engine_fleet, taps), SETTLE_S, 0.1,
             "index caught up")
    for salt, expected in (("tenant-a", warm), ("tenant-c", 0)):
        route = post_json(f"{engine_fleet.url}/debug/route",
                          {"model": engine.model, "messages": messages, "cache_salt": salt})
        hits = {rid: d["hit_blocks"] * route["block_size"]
                for rid, d in route["replicas"].items()}
        assert hits.get("engine-0") == expected, route
        assert max(hits.values()) == expected, route
