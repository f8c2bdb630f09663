"""Unit tests of `prefix-loadtest fidelity`'s pure parts: workloads, event flattening and the
comparison report."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.compare.fidelity import (
    EngineRun,
    FidelityConfig,
    compare,
    first_difference,
    flatten,
    format_report,
    load_run,
    save_run,
    synthetic_workload,
)
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)


def stored(*keys: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=list(keys), parent_block_hash=None,
                       token_ids=[0] * 32 * len(keys), block_size=32, lora_id=None,
                       medium=medium, lora_name=None)


def removed(*keys: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(keys), medium="GPU")


def batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)


def test_synthetic_workload_is_seeded_and_bounded() -> None:
    a = synthetic_workload(40, seed=3, max_prompt_tokens=2000)
    assert a == synthetic_workload(40, seed=3, max_prompt_tokens=2000)
    assert a != synthetic_workload(40, seed=4, max_prompt_tokens=2000)
    assert len(a) == 40 and all(1 <= len(p) <= 2000 for p in a)
    assert all(1000 <= t < 100_000 for p in a for t in p)
    # Shared prefixes recur: some pair of requests starts with the same 200 tokens.
    heads = [tuple(p[:200]) for p in a]
    assert len(set(heads)) < len(heads)


def test_flatten_is_block_by_block_and_skips_other_tiers() -> None:
    batches = [batch(stored(1, 2), removed(7)),
               batch(stored(9, medium="CPU"), AllBlocksCleared(), removed(1, 2))]
    assert flatten(batches) == [("stored", 1), ("stored", 2), ("removed", 7), ("cleared", None),
                                ("removed", 1), ("removed", 2)]


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_compare_reports_agreement_and_the_first_difference() -> None:
    emu = EngineRun("emulator", [0, 32, 64], [batch(stored(1, 2)), batch(removed(1), stored(3))])
    same = EngineRun("vllm", [0, 32, 64], [batch(stored(1, 2), removed(1)), batch(stored(3))])
    report = compare(emu, same, [40, 70, 100])
    # Batch boundaries may differ; the sequences may not.
    assert report["identical"] and report["agree"] == 3
    other = EngineRun("vllm", [0, 32, 96], [batch(stored(1, 2)), batch(removed(2), stored(3))])
    report = compare(emu, other, [40, 70, 130])
    assert not report["identical"] and report["agree"] == 2
    assert report["mismatches"] == [{"request": 2, "prompt_tokens": 130, "emulator": 64,
                                     "vllm": 96}]
    by_name = {s["name"]: s for s in report["sequences"]}
    assert by_name["stored"]["identical"]
    assert by_name["removed"]["first_difference"] == 0
    assert by_name["events"]["first_difference"] == 2
    assert by_name["events"]["emulator_at"][0] == ["removed", 1]
    assert report["cached_tokens_total"] == {"emulator": 96, "vllm": 128}
    text = format_report(report, FidelityConfig(), "test")
    assert "agree on 2 of 3" in text and text.endswith("DIFFERENT")


def test_a_failed_request_is_a_mismatch() -> None:
    emu = EngineRun("emulator", [0, None], [], errors=["request 1: HTTP 400"])
    real = EngineRun("vllm", [0, None], [])
    report = compare(emu, real, [10, 10])
    assert not report["identical"] and report["agree"] == 1
    assert report["errors"] == ["emulator: request 1: HTTP 400"]


def test_a_recorded_run_loads_back_only_for_its_workload_and_flags(tmp_path: Path) -> None:
    prompts = [[1000, 1001, 1002], [1000, 1001, 2000]]
    run = EngineRun("vllm", [0, 0], [batch(stored(1, 2)), batch(removed(1))], missed_batches=1)
    path = tmp_path / "vllm.run.json"
    save_run(run, path, prompts, FidelityConfig())
    back = load_run(path, prompts, FidelityConfig(concurrency=4))  # how it was sent may differ
    assert back.cached_tokens == [0, 0] and back.missed_batches == 1
    assert flatten(back.batches) == flatten(run.batches)
    with pytest.raises(ValueError, match="another workload"):
        load_run(path, [[1000]], FidelityConfig())
    with pytest.raises(ValueError, match="other flags"):
        load_run(path, prompts, FidelityConfig(num_gpu_blocks=99))


def test_output_blocks_compare_by_position_when_prompt_keys_are_given() -> None:
    """Blocks holding output tokens have engine-specific hashes: named by their parent chain."""
    def run(out1: int, out2: int) -> list[KVEventBatch]:
        first = stored(1, 2)
        outputs = BlockStored(block_hashes=[out1, out2], parent_block_hash=2,
                              token_ids=[0] * 64, block_size=32, lora_id=None, medium="GPU",
                              lora_name=None)
        return [batch(first), batch(outputs), batch(removed(out2, 1))]

    emu, real = run(500, 501), run(900, 901)
    assert flatten(emu) != flatten(real)
    assert flatten(emu, {1, 2}) == flatten(real, {1, 2}) == [
        ("stored", 1), ("stored", 2), ("stored", "2+o"), ("stored", "2+o+o"),
        ("removed", "2+o+o"), ("removed", 1)]
