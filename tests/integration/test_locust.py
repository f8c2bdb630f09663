"""Locust smoke test: every scenario of ``loadtest/locustfile.py``, headless, against one emulated
replica on loopback; TTFT and end-to-end entries reported without failures."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import start_process, stop_process, wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("DocumentQAUser", "MultiTurnChatUser", "TenantUser", "UniquePromptUser")


def test_locust_scenarios_headless(tmp_path: Path) -> None:
    ready = tmp_path / "emulator.json"
    emulator = start_process([sys.executable, "-c",
                              "import sys; from worker.cli import main; sys.exit(main(sys.argv[1:]))",
                              "emulate", "--host", "127.0.0.1", "--port", "0", "--replicas", "1",
                              "--time-scale", "20", "--ready-file", str(ready)])
    try:
        wait_for(ready.exists, timeout_s=30, message="emulator ready file")
        url = json.loads(ready.read_text())["replicas"][0]["url"]
        locust = str(Path(sys.executable).parent / "locust")
        result = subprocess.run(
            [locust, "-f", str(ROOT / "loadtest" / "locustfile.py"), "--host", url, "--headless",
             "-u", "4", "-r", "4", "-t", "8s", "--only-summary", "--csv", str(tmp_path / "run"),
             *SCENARIOS],
            env={**_env(), "PREFIX_LOADTEST_MAX_TOKENS": "8"}, cwd=tmp_path,
            capture_output=True, text=True, timeout=90)
    finally:
        emulator_log = stop_process(emulator)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + emulator_log[-2000:]
    with open(tmp_path / "run_stats.csv", newline="") as fh:
        rows = {row["Name"]: row for row in csv.DictReader(fh)}
    for name in ("doc_qa", "chat", "tenants", "unique"):
        assert int(rows[name]["Request Count"]) >= 1, name
        assert int(rows[name]["Failure Count"]) == 0, name
        assert int(rows[f"TTFT {name}"]["Request Count"]) == int(rows[name]["Request Count"])
        assert float(rows[f"TTFT {name}"]["Median Response Time"]) <= float(
            rows[name]["Median Response Time"])


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
