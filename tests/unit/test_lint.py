"""ruff and mypy run clean over the code base (part of the test command, so CI enforces them)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # ruff and mypy over the tree: minutes


@pytest.mark.parametrize("tool", [
    [sys.executable, "-m", "ruff", "check", "router", "worker", "loadtest", "tests"],
    [sys.executable, "-m", "mypy", "--no-error-summary"],
], ids=["ruff", "mypy"])
def test_static_checks_clean(tool: list[str]) -> None:
    if shutil.which(tool[0]) is None:
        pytest.fail(f"{tool[0]} not found")
    result = subprocess.run(tool, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
