"""``router.request.body.RequestBody``: the body decoded at most once, sent byte for byte unless
the router set a field, and the same JSON whichever path (decoded or not) applies the edit."""

from __future__ import annotations

import json

import pytest

from router.request.body import RequestBody
from router.request.prompts import PromptError

RAW = b'{"model":"alias","prompt":[1,2,3],"cache_salt":"client","x":{"y":[1.5,"\\u00e9"]}}'


def test_unchanged_body_is_sent_byte_for_byte() -> None:
    body = RequestBody(RAW)
    assert body.data()["prompt"] == [1, 2, 3]
    assert body.encoded() is RAW


@pytest.mark.parametrize("decoded", [True, False], ids=["decoded", "never-decoded"])
def test_set_fields_replace_in_place_and_append(decoded: bool) -> None:
    body = RequestBody(RAW)
    if decoded:
        body.data()
    body.set("model", "served")
    body.set("priority", 2)
    out = json.loads(body.encoded())
    assert list(out) == ["model", "prompt", "cache_salt", "x", "priority"]
    assert out == {**json.loads(RAW), "model": "served", "priority": 2}
    assert body.data()["model"] == "served"  # the decoded view carries the edits too


def test_decoded_once() -> None:
    body = RequestBody(RAW)
    assert body.data() is body.data()


def test_not_json_is_a_400() -> None:
    with pytest.raises(PromptError, match="not valid JSON"):
        RequestBody(b"{nope").data()
