"""``prefix-loadtest replay --arrivals azure-conv`` against a real emulated replica on loopback:
the Mooncake prompts go out on the Azure conversation trace's arrival times."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.data import packaged_arrivals_path
from loadtest.replay.trace import arrival_offsets, read_arrival_times
from tests.helpers import EMULATE, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import read_json_file

pytestmark = pytest.mark.timeout(120)
SPEEDUP = 20.0


@pytest.fixture
def replica_url(tmp_path: Path) -> Iterator[str]:
    ready = tmp_path / "emulator.json"
    proc = start_process([*EMULATE, "--replicas", "1", "--time-scale", "20",
                          "--ready-file", str(ready)])
    try:
        info = wait_for(lambda: read_json_file(ready), 60, message="emulator ready file")
        yield info["replicas"][0]["url"]
    finally:
        stop_process(proc)


def test_replay_on_azure_arrival_times(replica_url: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "records.jsonl"
    status = main(["replay", "--target", replica_url, "--limit", "25", "--speedup", str(SPEEDUP),
                   "--arrivals", "azure-conv", "--max-output-tokens", "4", "--output", str(out)])
    assert status == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    expected = arrival_offsets(25, read_arrival_times(packaged_arrivals_path("azure-conv")),
                               SPEEDUP)
    assert [r["scheduled_s"] for r in records] == pytest.approx(expected)
    assert all(r["error"] is None and r["status"] == 200 for r in records)
    # sent on schedule: never before its arrival time (the replayer sleeps until it), and not
    # held back by the answers (25 requests in about 4 s). The lateness bound is an outer one:
    # at 0.5 s a busy machine's loop stall could break it (the replayer's own lag is its
    # max_send_lag_s, not the replayer's fault)
    assert all(r["send_s"] >= r["scheduled_s"] - 0.01 for r in records), records
    assert all(r["send_s"] - r["scheduled_s"] < 3.0 for r in records), records
    assert [r["input_length"] for r in records] == [r["prompt_tokens"] for r in records]

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--target", replica_url, "--arrivals", "no-such-trace"])
    assert exc.value.code == 2
    assert "--arrivals no-such-trace" in capsys.readouterr().err
