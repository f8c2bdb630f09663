"""Locust smoke test: every scenario of ``loadtest/replay/locustfile.py``, headless, against one emulated
replica on loopback; TTFT and end-to-end entries reported without failures."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.helpers import start_emulator, stop_process

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("DocumentQAUser", "MultiTurnChatUser", "TenantUser", "UniquePromptUser")


def test_locust_scenarios_headless(tmp_path: Path) -> None:
    ready = tmp_path / "emulator.json"
    emulator, replicas = start_emulator(ready, ["--replicas", "1", "--time-scale", "20"], timeout_s=180)
    try:
        url = replicas[0]["url"]
        # The emulator loads its tokenizer (transformers) on the first text prompt: ~1.5 s idle,
        # ~20 s at load average 10. One chat request first keeps that out of the 8 s run.
        warm = requests.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "emulated-llm", "max_tokens": 1,
            "messages": [{"role": "user", "content": "warm up"}]})
        assert warm.status_code == 200, warm.text
        locust = str(Path(sys.executable).parent / "locust")
        # --stop-timeout: requests in flight when the 8 s end are finished and counted, not
        # dropped (a 12,000-token prompt on a busy machine can take seconds).
        result = subprocess.run(
            [locust, "-f", str(ROOT / "loadtest" / "replay" / "locustfile.py"), "--host", url, "--headless",
             "-u", "4", "-r", "4", "-t", "8s", "--stop-timeout", "30", "--only-summary",
             "--csv", str(tmp_path / "run"), *SCENARIOS],
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


def test_vocabulary_built_at_init_before_the_run() -> None:
    """The locustfile builds the word vocabulary at locust's ``init`` event, which fires before
    the run and its ``-t`` clock start (so no user's ``on_start`` pays for it inside the run),
    and leaves gevent's cached clock, from which that timer counts, past the build.
    In a subprocess: importing locust monkey-patches the interpreter with gevent."""
    code = (
        "from locust.env import Environment\n"
        "import loadtest.replay.locustfile as lf\n"
        "from loadtest.replay.text import default_vocabulary\n"
        "env = Environment(user_classes=[lf.DocumentQAUser], events=lf.events)\n"
        "env.create_local_runner()\n"
        "import gevent, time\n"
        "loop = gevent.get_hub().loop\n"
        "assert default_vocabulary.cache_info().currsize == 0\n"
        "clock, wall = loop.now(), time.monotonic()\n"
        "env.events.init.fire(environment=env, runner=env.runner, web_ui=None)\n"
        "took = time.monotonic() - wall\n"
        "lag = took - (loop.now() - clock)\n"
        "print(default_vocabulary.cache_info().currsize, len(default_vocabulary().words), lag,"
        " took)\n")
    result = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    built, words, lag, took = result.stdout.split()
    assert int(built) == 1 and int(words) >= 1000
    # gevent's clock (which locust's -t timer counts from) has moved past the build: it lags
    # wall time by far less than the build took (a stale clock lags by all of it); relative
    # to the build on this machine now, so a busy machine slows both alike
    assert float(lag) < max(0.05, float(took) / 2), (lag, took)


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
