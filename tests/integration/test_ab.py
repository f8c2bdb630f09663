"""``prefix-loadtest ab`` end to end: two fresh emulator processes (prefix caching on, then
``--no-enable-prefix-caching``), a JSONL file of OpenAI bodies shaped like the seed's document
questions (one long shared document, short questions after it), results and plot on disk."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loadtest.cli import main as loadtest_main
from loadtest.compare.ab import ABError, Measured, Prompt, analyse, file_prompts

pytestmark = pytest.mark.timeout(180)

DOC_TOKENS = 4000  # 250 full blocks
QUESTIONS = 6


def write_requests(path: Path) -> None:
    rng = random.Random(5)
    document = rng.sample(range(1000, 100000), DOC_TOKENS)
    with path.open("w") as out:
        for _ in range(QUESTIONS):
            question = rng.sample(range(1000, 100000), 50)
            out.write(json.dumps({"model": "emulated-llm", "prompt": document + question,
                                  "max_tokens": 64}) + "\n")


def test_ab_on_fresh_emulators(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = tmp_path / "requests.jsonl"
    write_requests(requests)
    out_dir = tmp_path / "ab"
    assert loadtest_main(["ab", "--requests", str(requests), "--output-dir", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "prefix/suffix" in text and "(64, inf]" not in text
    results = json.loads((out_dir / "results.json").read_text())
    assert (out_dir / "ab.png").stat().st_size > 10_000
    prompts = results["prompts"]
    assert len(prompts) == QUESTIONS and not results["failed"] and not results["warnings"]
    # the first question misses in both runs; every later one hits the whole document when on
    assert [p["prefix_tokens"] for p in prompts] == [0] + [DOC_TOKENS] * (QUESTIONS - 1)
    assert all(p["prompt_tokens"] == DOC_TOKENS + 50 for p in prompts)
    hits = [b for b in results["buckets"] if b["ratio"] == "> 64"]
    assert hits and hits[0]["prompts"] == QUESTIONS - 1
    assert hits[0]["median_expected_speedup"] == pytest.approx((DOC_TOKENS + 50) / 50)
    # measured in this run, on and off side by side: a hit is many times faster
    assert hits[0]["median_speedup"] > 5
    assert "on = fresh emulator --enable-prefix-caching" in text


def test_caching_off_engine_reporting_hits_is_flagged() -> None:
    prompts = [Prompt("/v1/completions", {"prompt": [1]}, "p0")]
    report = analyse(prompts, [Measured(0.01, 4050, 4000, None)], [Measured(0.2, 4050, 4000, None)])
    assert report.prompts[0].ratio == 80 and report.prompts[0].saving_s == pytest.approx(0.19)
    assert any("really off" in w for w in report.warnings)


def test_bad_request_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": [1, 2]}\n{"input": "x"}\n')
    with pytest.raises(ABError, match=r"bad\.jsonl:2: neither a Mooncake trace line nor an OpenAI body"):
        file_prompts(path)
