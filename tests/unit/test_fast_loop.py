"""The fast loop's guard (``tests/unit/conftest.py``): an unmarked unit test that starts a
process fails with the command it started; marked ``slow``, it passes."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import ROOT

pytest_plugins = ["pytester"]

_TESTS = '''
import subprocess
import sys

import pytest


def test_unmarked_starts_a_process() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_marked_starts_a_process() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_in_process() -> None:
    assert sum(range(4)) == 6
'''


@pytest.mark.slow  # its inner tests start a Python process
def test_an_unmarked_unit_test_that_starts_a_process_fails(pytester: pytest.Pytester) -> None:
    shutil.copy(ROOT / "tests" / "unit" / "conftest.py", pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                     "markers =\n    slow: starts processes\n")
    pytester.makepyfile(test_guard=_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_starts_a_process starts a process "
                                 "(subprocess.Popen*mark it slow*"])
