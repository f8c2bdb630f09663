"""Shared fixtures: a real Redis server on loopback, paths to the shared vectors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.harness.redis_server import RedisServer
from loadtest.harness.vllm_engine import hide_unmatched_torch_packages

# with the [vllm] extra installed, PyPI's torchvision beside vLLM's CPU torch breaks transformers
hide_unmatched_torch_packages()

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
VECTORS = SHARED / "vectors"
VENDORED_VECTORS = ROOT / "tests" / "vectors"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for the whole session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session's Redis, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


def load_vectors(name: str) -> Any:
    """A golden vector file from ../shared/vectors, else the vendored copy in tests/vectors."""
    path = VECTORS / name
    if not path.exists():
        path = VENDORED_VECTORS / name
    return json.loads(path.read_text())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test outside ``tests/unit`` starts processes (Redis, the emulator, workers, routers,
    helm, a real engine): mark it ``slow``, and the unit tests on the session's Redis; the unit
    tests that start another process are marked by hand (``tests/unit/conftest.py`` fails one
    that is not).
    ``pytest -m "not slow" tests/unit`` is the fast loop; CI runs everything."""
    unit = ROOT / "tests" / "unit"
    for item in items:
        # a unit test on the session's Redis starts redis-server (unless another started it)
        if not item.path.is_relative_to(unit) or "redis_server" in getattr(
                item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
