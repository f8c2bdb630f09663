"""Layers. The pure core imports no I/O library: fleet state, errors, policy, load tracking, index,
hashing, prompt chains and caches are importable without aiohttp, redis or zmq (issue 14). The
shared core (``router.shared``) imports nothing else of the project, the worker and the emulator
import nothing of the router but it, and the product (``router``, ``worker``) imports nothing of
``loadtest`` (issue 31)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PURE = ("router.decision.fleet", "router.request.errors", "router.decision.policy",
        "router.decision.index", "router.shared.contract", "router.shared.hashing",
        "router.request.chain_cache", "router.request.prompts", "router.request.lru",
        "router.decision.ring", "router.decision.ttft", "router.decision.health",
        "router.observability.audit", "router.decision.capacity", "router.request.prompt_path",
        "router.request.routing", "router.request.dispatch", "router.shared.kv_event_sources",
        "worker.replica_view", "worker.block_set", "worker.block_keys", "router.shared.kv_events",
        "router.shared.chat_messages", "router.apis.aliases", "router.apis.images",
        "router.apis.lora_load", "router.apis.pooling", "router.shared.lora_state",
        "router.traffic.admission", "router.traffic.scheduling", "router.traffic.classes",
        "router.traffic.gate", "router.decision.load", "router.decision.details")
IO_LIBRARIES = ("aiohttp", "redis", "zmq")


@pytest.mark.slow  # starts a Python process
def test_pure_modules_import_no_io_library() -> None:
    code = (f"import importlib, json, sys\nfor m in {PURE!r}: importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {IO_LIBRARIES!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert json.loads(out.splitlines()[-1]) == []


@pytest.mark.slow  # starts a Python process
def test_the_io_edges_do_import_them() -> None:
    # the check above can fail: the HTTP and Redis edges do load aiohttp and redis
    code = ("import sys, router.edges.proxy, worker.redis_writer\n"
            "print(all(m in sys.modules for m in ('aiohttp', 'redis')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.split()[-1] == "True"


def project_imports(package: str) -> dict[str, set[str]]:
    """The project modules (``router``, ``worker``, ``loadtest``) each file under ``package``
    imports, by file (relative to the repository root), from its syntax tree: lazy imports
    inside functions count too."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from router import x`` may name a module: count it as ``router.x``
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(ROOT))] = {
            n for n in names if n.split(".")[0] in ("router", "worker", "loadtest")}
    return found


def offending(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The project imports under ``package`` that start with none of ``allowed``, by file."""
    bad = {file: sorted(n for n in names if not n.startswith(allowed))
           for file, names in project_imports(package).items()}
    return {file: names for file, names in bad.items() if names}


def test_shared_core_imports_nothing_else_of_the_project() -> None:
    assert project_imports("router/shared"), "no shared core found"
    assert offending("router/shared", ("router.shared.",)) == {}


def test_worker_and_emulator_import_only_the_shared_core_of_the_router() -> None:
    assert offending("worker", ("router.shared.", "worker.")) == {}


def test_the_product_imports_nothing_of_loadtest() -> None:
    for package in ("router", "worker"):
        assert offending(package, ("router.", "worker.")) == {}


def test_the_checks_above_can_fail() -> None:
    # the import walk sees what the rules forbid: the load tests and the router's own service
    assert any(n.startswith("router.service.") for n in project_imports("router")["router/cli.py"])
    assert any(names for names in project_imports("loadtest").values())


@pytest.mark.slow  # starts a Python process
def test_the_worker_process_loads_only_the_shared_core() -> None:
    # at run time too: the worker's and the emulator's entry modules load no router module
    # outside router.shared (an import the syntax walk cannot see, e.g. through importlib)
    code = ("import sys, worker.cli, worker.report, worker.emulator.app\n"
            "print(sorted(m for m in sys.modules if m.startswith('router.')\n"
            "            and not m.startswith('router.shared')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.splitlines()[-1] == "[]"
