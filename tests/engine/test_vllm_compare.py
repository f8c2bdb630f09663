"""``prefix-loadtest compare`` on real engines (issue 30 item 4): the comparison's fleet runs on
the package's two vLLM CPU engines (``engine_pair``) instead of the emulator, each policy on a
fresh Redis, workers and router, the engines' prefix caches emptied before each run. The hit
rate of every row is the engines' own ``vllm:prefix_cache_hits`` / ``queries`` counters: it
equals what the engines reported request by request (``usage.prompt_tokens_details
.cached_tokens`` over ``prompt_tokens``), and the output says plainly that CPU TTFT is not GPU
TTFT.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.compare.orchestration import CompareConfig, run_compare
from loadtest.compare.report import run_notes
from loadtest.data import packaged_trace_path
from loadtest.harness.fleet import OURS, FleetConfig, RouterSpec
from loadtest.harness.vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine
from loadtest.harness.vllm_fleet import (
    CPU_TTFT_NOTE,
    DRAIN_TIMEOUT_S,
    ENGINE_FLEET_START_TIMEOUT_S,
    HASH_SEED,
    ROUTER_ARGS,
    EngineReplicas,
)
from loadtest.replay.replayer import ReplayConfig, read_records
from loadtest.replay.trace import read_trace

# the package's engines start together when the first is needed (conftest.EnginePool)
pytestmark = pytest.mark.timeout(2700)

POLICIES = ("prefix", "round_robin")
NUM_REQUESTS = 16
MAX_PROMPT_TOKENS = 12_000  # keeps the CPU prefill of the slice to a minute or two


def test_compare_on_real_engines_reports_the_engines_own_hit_rates(
        engine_pair: list[VllmEngine], model_dir: Path, tmp_path: Path) -> None:
    engines = EngineReplicas(engine_pair, model_dir)
    requests = [r for r in read_trace(packaged_trace_path(), limit=200)
                if r.input_length <= MAX_PROMPT_TOKENS][:NUM_REQUESTS]
    runs = tuple(RouterSpec(OURS, p) for p in POLICIES)
    fleet = FleetConfig(router=runs[0], replicas=len(engine_pair), model=MODEL_NAME,
                        block_size=BLOCK_SIZE, python_hash_seed=HASH_SEED,
                        engines=engines.replicas, engine_pids=engines.pids,
                        router_args=(*ROUTER_ARGS, "--tokenizer", str(model_dir)),
                        start_timeout_s=ENGINE_FLEET_START_TIMEOUT_S)
    config = CompareConfig(runs=runs, fleet=fleet, plots=False, output_dir=tmp_path,
                           replay=ReplayConfig(target="http://unused", model=MODEL_NAME,
                                               speedup=20.0, max_output_tokens=4,
                                               request_timeout_s=900.0,
                                               drain_timeout_s=DRAIN_TIMEOUT_S),
                           before_run=engines.reset)
    results = run_compare(config, requests, {"packaged": True}, print)
    assert not results["failed"], results["failed"]
    assert results["fleet"]["engine"] == "vllm"
    for label in POLICIES:
        m = results["policies"][label]
        records = read_records(tmp_path / f"records-{label}.jsonl")
        assert m["engine"] == "vllm" and m["num_errors"] == 0, m["errors_by_kind"]
        assert len(records) == NUM_REQUESTS and all(r.ok for r in records)
        # nothing preempted: vLLM counts a request's prefix-cache query once, when scheduled
        assert m["num_preemptions"] == 0
        # the engines' counters, over this run only, equal what they reported per request
        assert m["prefix_cache_queries"] == sum(r.prompt_tokens or 0 for r in records)
        assert m["prefix_cache_hits"] == sum(r.cached_tokens or 0 for r in records)
        assert m["token_hit_rate"] == m["prefix_cache_hits"] / m["prefix_cache_queries"]
        assert sum(m["requests_per_replica"].values()) == NUM_REQUESTS
        assert set(m["requests_per_replica"]) == {"engine-0", "engine-1"}
        # no emulator: the verdict does not ask for emulator lag figures
        assert "no_lag_figures" not in m["untrusted_causes"]
    assert results["policies"]["prefix"]["prefix_cache_hits"] > 0  # the slice shares prefixes
    assert CPU_TTFT_NOTE in run_notes(results["policies"])
