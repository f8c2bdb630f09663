"""``router.shared.logs.IntervalLog``: a repeated condition is one line per interval, with a count."""

from __future__ import annotations

import logging

import pytest

from router.shared.logs import IntervalLog


def test_one_line_per_interval_with_the_count_since_the_last(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = IntervalLog(logging.getLogger("interval-test"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "interval-test"):
        assert log(logging.WARNING, "down (%s)", "refused")  # the first one at once
        for step in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2):  # a retry loop's backoff: all within 10 s
            now[0] += step
            assert not log(logging.WARNING, "down (%s)", "refused")
        now[0] += 5.0  # 11.3 s after the first line
        assert log(logging.WARNING, "down (%s)", "refused")
        log.reset()  # it came back: the next failure is news
        assert log(logging.WARNING, "lost")
    assert [r.getMessage() for r in caplog.records] == [
        "down (refused)", "down (refused) (7 times since the last line)", "lost"]
