"""LoRA affinity tiers (``router.apis.lora_load``), image keys (``router.apis.images``) and the
forwarded paths (``router.apis.pooling``): pure."""

from __future__ import annotations

import base64

import pytest

from router.apis.images import image_key, image_marker
from router.apis.lora_load import (
    FREE_SLOT,
    FULL,
    RUNNING,
    UNKNOWN,
    WAITING,
    lora_tier,
    prefer_loaded,
)
from router.apis.pooling import FORWARDED_PATHS, POOLING_PATHS, request_model
from router.request.errors import BadRequest
from router.shared.lora_state import LoraLoad, current_lora_load, split_names


def test_split_names_reads_vllms_comma_joined_label() -> None:
    assert split_names("") == frozenset()
    assert split_names("a,b") == {"a", "b"}


def test_lora_tiers() -> None:
    load = LoraLoad(frozenset({"a"}), frozenset({"b"}), max_lora=3)
    assert lora_tier(load, "a") == RUNNING
    assert lora_tier(load, "b") == WAITING
    assert lora_tier(load, "c") == FREE_SLOT  # 2 adapters in use of 3
    assert lora_tier(LoraLoad(frozenset({"a"}), frozenset({"b"}), max_lora=2), "c") == FULL
    assert lora_tier(LoraLoad(frozenset({"a"}), frozenset({"a"}), max_lora=2), "c") == FREE_SLOT
    assert lora_tier(None, "c") == UNKNOWN
    assert lora_tier(LoraLoad(), "c") == UNKNOWN  # no max_lora reported


def test_loaded_replicas_are_preferred_then_free_slots_then_full_ones() -> None:
    idle = LoraLoad(max_lora=1)
    busy_other = LoraLoad(frozenset({"other"}), max_lora=1)
    loaded = LoraLoad(frozenset({"sql"}), max_lora=1)
    queued = LoraLoad(waiting=frozenset({"sql"}), max_lora=1)
    pref = prefer_loaded("sql", {"r0": idle, "r1": loaded, "r2": busy_other, "r3": queued})
    assert pref.preferred == ("r1", "r3") and pref.tier == RUNNING
    assert pref.tiers == {"r0": FREE_SLOT, "r1": RUNNING, "r2": FULL, "r3": WAITING}
    pref = prefer_loaded("sql", {"r0": busy_other, "r1": idle, "r2": None})
    assert pref.preferred == ("r1", "r2") and pref.tier == FREE_SLOT
    assert prefer_loaded("sql", {"r0": busy_other}).preferred == ("r0",)
    with pytest.raises(ValueError):
        prefer_loaded("sql", {})


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def test_image_keys_digest_the_bytes_the_url_or_take_the_uuid() -> None:
    png = {"type": "image_url", "image_url": {"url": data_url(b"\x89PNG pixels")}}
    # the same bytes give the same key, whatever the line breaks of the base64 text
    wrapped = {
        "type": "input_image",
        "image_url": data_url(b"\x89PNG pixels").replace("base64,", "base64,\n"),
    }
    assert image_key(png) == image_key(wrapped) and image_key(png).startswith("bytes:")
    other = {"type": "image_url", "image_url": {"url": data_url(b"\x89PNG other")}}
    assert image_key(other) != image_key(png)
    remote = {"type": "image_url", "image_url": {"url": "https://x.test/cat.png"}}
    assert image_key(remote).startswith("url:")
    assert image_key(remote) == image_key(
        {"type": "input_image", "image_url": "https://x.test/cat.png"}
    )
    assert image_key({**remote, "uuid": "cat-1"}) == "uuid:cat-1"
    assert image_key({"type": "text", "text": "hi"}) is None
    assert image_key("plain") is None
    assert image_marker(remote) == f"<image {image_key(remote)}>"


def test_forwarded_paths_are_vllm_0_32s() -> None:
    assert set(POOLING_PATHS) == {
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
    assert {"/tokenize", "/detokenize"} <= set(FORWARDED_PATHS)


def test_request_model() -> None:
    assert request_model({"model": "m"}) == "m"
    assert request_model({}) is None
    with pytest.raises(BadRequest):
        request_model({"model": 3})
    with pytest.raises(BadRequest):
        request_model([1])


def test_the_current_lora_state_is_the_newest_series() -> None:
    assert current_lora_load([]) is None
    old = {"running_lora_adapters": "a", "waiting_lora_adapters": "", "max_lora": "2"}
    new = {"running_lora_adapters": "b,c", "waiting_lora_adapters": "a", "max_lora": "2"}
    assert current_lora_load([(old, 1700000000.5), (new, 1700000001.0)]) == LoraLoad(
        frozenset({"b", "c"}), frozenset({"a"}), 2
    )
    assert current_lora_load([({"max_lora": "x"}, 1.0)]) == LoraLoad()


def test_the_worker_reads_the_newest_lora_series_whatever_the_dp_rank() -> None:
    from router.shared import contract
    from worker.heartbeat import lora_fields, parse_metrics

    text = (
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,a",'
        'waiting_lora_adapters="c"} 1.8e9\n'
    )
    load = parse_metrics(text, engine="1")  # vLLM's LoRA gauge has no engine label
    assert load.num_running == 2 and load.lora == LoraLoad(
        frozenset({"a", "b"}), frozenset({"c"}), 2
    )
    assert lora_fields(load.lora) == {
        contract.F_LORA_RUNNING: "a,b",
        contract.F_LORA_WAITING: "c",
        contract.F_MAX_LORA: 2,
    }
    assert parse_metrics("vllm:num_requests_running 0\n").lora is None
    assert set(lora_fields(None).values()) == {""}


def test_the_router_keeps_the_heartbeats_lora_state() -> None:
    from router.decision.replica import lora_from_fields
    from router.shared import contract

    assert lora_from_fields({}) is None
    empty = {contract.F_LORA_RUNNING: "", contract.F_LORA_WAITING: "", contract.F_MAX_LORA: ""}
    assert lora_from_fields(empty) is None
    assert lora_from_fields({**empty, contract.F_MAX_LORA: "1"}) == LoraLoad(max_lora=1)
    assert lora_from_fields(
        {contract.F_LORA_RUNNING: "a,b", contract.F_LORA_WAITING: "c", contract.F_MAX_LORA: "x"}
    ) == LoraLoad(frozenset({"a", "b"}), frozenset({"c"}), None)
