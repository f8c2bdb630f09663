"""Real-engine test: the emulator is request-for-request and event-for-event faithful to vLLM's
CPU build on a small multi-tenant sequence (``prefix-loadtest fidelity``, issue 30 item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.compare.fidelity import (
    FidelityConfig,
    format_report,
    run_fidelity,
    synthetic_workload,
)
from loadtest.harness.vllm_engine import unavailable_reason

UNAVAILABLE = unavailable_reason()
# An engine starts in 1-3 minutes on a busy machine and prefills the 40 prompts in about 2 more;
# 7.5 minutes in all measured here with the machine's load at 11 on 2 cores.
pytestmark = pytest.mark.timeout(1800)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"real-engine test skipped: {UNAVAILABLE}")
def test_emulator_cached_tokens_and_kv_events_equal_vllms(tmp_path: Path) -> None:
    # 48 blocks fewer than the default and a 1,024-token step budget: the sequence evicts,
    # chunks its long prompts and hits partially, so every rule fixed so far is exercised.
    config = FidelityConfig(num_gpu_blocks=112, max_num_batched_tokens=1024,
                            max_model_len=3072)
    prompts = synthetic_workload(40, seed=11, max_prompt_tokens=3071)
    report = run_fidelity(prompts, config, tmp_path)
    text = format_report(report, config, "synthetic seed 11, 40 requests")
    assert report["identical"], text
    counts = report["counts"]["vllm"]
    assert counts["BlockRemoved"] > 0, text  # blocks were evicted
    assert any(len(p) > config.max_num_batched_tokens for p in prompts)  # prompts were chunked
    assert 0 < report["cached_tokens_total"]["vllm"], text  # and hit
