"""A fresh emulator has loaded its tokenizer before it answers ``/health``, as vLLM does, so a
router's first text request behind it gets a 200: with the load on the first text prompt
(transformers' import plus the tokenizer files, seconds on a busy machine) both replicas went
past the router's first-byte deadline floor (5 s) and were benched as hung, and the request 502'd.

A real emulator process (two replicas) and a real router process on loopback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from router.request.prompts import default_tokenizer_dir
from tests.helpers import start_emulator, stop_process, wait_for
from tests.integration.test_router_fleet import Router, prometheus_value

pytestmark = pytest.mark.timeout(240)

TEXT = "The first text prompt this emulator sees. " + " ".join(f"word{i}" for i in range(200))


def loaded_libraries(pid: int) -> str:
    """The paths of the shared libraries mapped into process ``pid``."""
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_first_text_request_to_a_fresh_emulator_is_answered(tmp_path: Path) -> None:
    emulator, replicas = start_emulator(
        tmp_path / "emulator.json", ["--replicas", "2"], timeout_s=120
    )
    router = None
    try:
        # ready means the tokenizer is in: Hugging Face's tokenizers library is mapped already
        assert re.search(r"tokenizers[^/\n]*\.so", loaded_libraries(emulator.pid))
        router = Router(
            tmp_path,
            [arg for r in replicas for arg in ("--replica", r["url"])]
            + ["--tokenizer", default_tokenizer_dir()],
        )
        started = router
        wait_for(lambda: started.ready()["ready"], 120, message="router ready")

        status, _, raw = router.post(
            "/v1/completions",
            {"model": "emulated-llm", "prompt": TEXT, "max_tokens": 1},
            timeout=120,
        )
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] > 200

        ready = router.ready()
        assert [(r["routable"], r["circuit"]) for r in ready["replicas"]] == [(True, "closed")] * 2
        assert prometheus_value(router.metrics(), "router_upstream_errors_total") == 0
    finally:
        if router is not None:
            print(router.stop()[-3000:])
        stop_process(emulator)
