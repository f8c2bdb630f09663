"""previous_response_id affinity: the response id read from an answer's head, the local memory
of response holders (TTL), and the target or refusal of a continuation."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.apis.affinity import (
    PREVIOUS_RESPONSE_REASON,
    ResponseAffinity,
    ResponseNotFound,
    decode_record,
    holder_target,
    response_id_from_head,
)
from router.request.errors import NoRoutableReplica
from tests.unit.test_fleet_panic import fleet_of


def test_response_id_from_a_json_body_and_a_stream_head() -> None:
    body = b'{"id":"resp_abc","created_at":1,"output":[{"id":"msg_1"}]}'
    assert response_id_from_head(body) == "resp_abc"
    stream = (b'event: response.created\ndata: {"response":{"id":"resp_xyz","created_at":1},'
              b'"sequence_number":0,"type":"response.created"}\n\n')
    assert response_id_from_head(stream) == "resp_xyz"
    assert response_id_from_head(b'{"error":{"message":"bad"}}') is None
    assert response_id_from_head(b"") is None


def test_local_memory_remembers_until_the_ttl() -> None:
    affinity = ResponseAffinity(None, "pr", ttl_s=0.2)

    async def run() -> tuple[str | None, str | None, str | None]:
        await affinity.remember("resp_1", "r1", None)
        first = await affinity.holder("resp_1", None)
        unknown = await affinity.holder("resp_2", None)
        await asyncio.sleep(0.3)
        return first, unknown, await affinity.holder("resp_1", None)

    assert asyncio.run(run()) == ("r1", None, None)


def test_another_tenants_response_is_not_found() -> None:
    """A record is its tenant's: another tenant (or a request without one) finds nothing, as
    for an id never seen."""
    affinity = ResponseAffinity(None, "pr", ttl_s=60)

    async def run() -> list[str | None]:
        await affinity.remember("resp_a", "r1", "tenant-a")
        return [await affinity.holder("resp_a", who) for who in ("tenant-a", "tenant-b", None)]

    assert asyncio.run(run()) == ["r1", None, None]


def test_redis_records_with_and_without_a_tenant() -> None:
    assert decode_record(b'["r1","tenant-a"]') == ("r1", "tenant-a")
    assert decode_record(b'["r1",null]') == ("r1", None)
    assert decode_record(b"replica-0") == ("replica-0", None)  # written before tenants were kept
    with pytest.raises(ValueError):
        decode_record(b'["r1"]')


def test_a_continuation_goes_to_its_holder_only() -> None:
    fleet = fleet_of(3)
    decision, targets, lora = holder_target(fleet, "resp_1", "r2", "m", time.monotonic())
    assert (decision.replica_id, decision.reason, decision.fallbacks) == (
        "r2", PREVIOUS_RESPONSE_REASON, ())
    assert [t.replica_id for t in targets] == ["r2"] and targets[0].url.endswith(":9002")
    assert lora is None


def test_a_continuation_is_refused_when_unknown_gone_or_unroutable() -> None:
    fleet = fleet_of(3)
    now = time.monotonic()
    with pytest.raises(ResponseNotFound, match="no router saw it") as unknown:
        holder_target(fleet, "resp_1", None, "m", now)
    assert unknown.value.status == 404
    with pytest.raises(ResponseNotFound, match="left the fleet"):
        holder_target(fleet, "resp_1", "r9", "m", now)
    fleet.replicas["r1"].healthy = False
    with pytest.raises(NoRoutableReplica, match="not routable now"):
        holder_target(fleet, "resp_1", "r1", "m", now)
