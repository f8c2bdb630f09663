"""``python -m loadtest.bench.scale`` end to end on a tiny fleet, as a real process (its real
Redis, null replica and router): the writer pours the workers' own flushes
(``worker.flush_batch`` into ``worker.replica_store._FLUSH``) and the router keeps up. It had
called the flush script with an ARGV of an older contract and died on its first flush with a Lua
error ("attempt to get length of local 'blob' (a nil value)"), unnoticed for two sessions."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON

pytestmark = pytest.mark.timeout(300)


def test_the_scale_bench_writes_the_workers_flushes_and_the_router_keeps_up(
        tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [PYTHON, "-m", "loadtest.bench.scale", "--replicas", "4", "--rates", "50", "--strides",
         "1,16", "--seconds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["replicas"], r["stride"]) for r in rows] == [(4, 1), (4, 16)]
    for row in rows:
        for phase in ("upkeep", "routing"):
            figures = row[phase]
            assert figures["requests_written"] == 100, (phase, figures)  # 50/s for 2 s
            assert figures["keys_per_s"] > 0
            # the router read the stream to its end within 5 s after the writer stopped (inf:
            # it did not)
            assert math.isfinite(figures["catch_up_s"]), (phase, figures)
        assert row["routing"]["routed"] > 0
    # an index stride of 16 writes only the anchor positions: fewer keys than stride 1
    assert rows[1]["upkeep"]["keys_per_s"] < rows[0]["upkeep"]["keys_per_s"]
