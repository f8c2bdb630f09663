"""``python -m loadtest.bench.worker`` on bad input, as a real process (its real Redis, emulator
and worker): a bad flag value, its own or one passed on to the worker, is one line naming it."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import PYTHON

pytestmark = pytest.mark.timeout(120)


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "loadtest.bench.worker", "--keys", "200", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("bad", ["-5", "nan", "inf"])
def test_a_bad_batch_interval_is_refused_before_anything_starts(bad: str) -> None:
    """A negative or nan interval used to run unpaced, reporting it as if paced; inf slept
    forever after the first batch."""
    done = run_bench(f"--batch-interval-ms={bad}")
    assert done.returncode == 2, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "--batch-interval-ms" in last and bad in last
    assert done.stdout == ""


def test_a_worker_flag_the_worker_refuses_ends_the_bench_with_its_error() -> None:
    """The worker exits at once on a bad ``--worker-arg`` value; the bench used to wait 30 s
    for its heartbeat and end in a ``TimeoutError`` traceback without the worker's reason."""
    done = run_bench("--worker-arg=--event-window-s", "--worker-arg=2")
    assert done.returncode == 1, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "worker exited with status 2" in lines[0]
    assert "--event-window-s" in lines[0] and "0..1" in lines[0]


@pytest.mark.parametrize("bad", [["--min-batch", "0", "--max-batch", "0"], ["--keys", "0"],
                                 ["--min-batch", "8", "--max-batch", "4"]])
def test_batch_sizes_that_cannot_make_the_keys_are_refused(bad: list[str]) -> None:
    """0-block batches used to be generated without end (memory growing until killed); no keys
    divided by zero after the run; a max below the min raised inside ``random``."""
    done = run_bench(*bad)
    assert done.returncode == 2, done.stdout
    assert "--min-batch <= --max-batch" in done.stderr.strip().splitlines()[-1]
