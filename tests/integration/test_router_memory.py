"""The router's memory after a burst of multi-MB prompts (issue 15 item 8): the prompt caches
stay within ``prompt_cache_mib`` (``router_prompt_cache_bytes``) and the idle trim gives the
burst's freed heap back, so RSS returns near where it was. A real router process with the
bundled tokenizer; prompts through ``/debug/route`` (tokenized, hashed and routed, not sent).

Memory, not speed: the assertions are on bytes.
"""

from __future__ import annotations

import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from router.service.heap import IDLE_TRIM_S
from tests.helpers import EMULATE, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import TOKENIZER, Router, read_json_file

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(TOKENIZER is None, reason="needs the Qwen3 tokenizer files")]

CACHE_MIB = 8
PROMPT_BYTES = 3 << 20
NUM_PROMPTS = 4


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def prompt_cache_bytes(router: Router) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in router.metrics().splitlines()
               if line.startswith("router_prompt_cache_bytes{"))


def text(rng: random.Random, size: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "router", "replica", "block", "prefix", "cache"]
    out: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(words) + str(rng.randrange(1000))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def burst_then_idle(router: Router) -> None:
    """Multi-MB prompts two at a time, checking the cache bound after each pair; then
    wait for the idle trim to bring RSS back near where it started."""
    rng = random.Random(5)
    small = {"prompt": "warm up the tokenizer threads " * 200}
    for _ in range(3):
        assert router.post("/debug/route", small)[0] == 200
    before = rss_bytes(router.proc.pid)
    peak = before
    bodies = [text(rng, PROMPT_BYTES) for _ in range(NUM_PROMPTS)]

    def send(i: int) -> None:
        request = ({"prompt": bodies[i]} if i % 2 else
                   {"messages": [{"role": "user", "content": bodies[i]}]})
        status, _, raw = router.post("/debug/route", request, timeout=60)
        assert status == 200, raw[:300]

    done = threading.Event()

    def sample_peak() -> None:  # the heap peaks during a request, not between them
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes(router.proc.pid))
            done.wait(0.01)

    sampler = threading.Thread(target=sample_peak, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(2) as pool:  # two at a time: both tokenizer threads busy
            for pair in range(0, NUM_PROMPTS, 2):
                list(pool.map(send, (pair, pair + 1)))
                # the caches' own estimate never exceeds the configured bound
                assert prompt_cache_bytes(router) <= CACHE_MIB << 20
    finally:
        done.set()
        sampler.join()
    # after the burst and the idle trim the freed heap is back with the OS (the bound is generous:
    # a busy machine delays the last requests and the trim, not the outcome)
    wait_for(lambda: rss_bytes(router.proc.pid) < before + (CACHE_MIB << 20) + (64 << 20),
             IDLE_TRIM_S + 120, message="router RSS back near its start after the burst")
    print(f"RSS before {before >> 20} MiB, peak {peak >> 20} MiB, "
          f"after {rss_bytes(router.proc.pid) >> 20} MiB; caches {prompt_cache_bytes(router):.0f} B")
    assert peak > before + (128 << 20)  # the burst did grow the heap: the check above means it


def test_prompt_caches_and_rss_stay_bounded_after_multi_mb_prompts(tmp_path: Path) -> None:
    ready = tmp_path / "emu.json"
    emulator = start_process([*EMULATE, "--ready-file", str(ready)])  # routable; never sent to
    router = None
    try:
        url = wait_for(lambda: read_json_file(ready), 60, message="emulator")["replicas"][0]["url"]
        router = started = Router(tmp_path, ["--replica", url, "--tokenizer", str(TOKENIZER),
                                             "--prompt-cache-mib", str(CACHE_MIB)])
        wait_for(lambda: started.ready()["ready"], 30, message="router ready")
        burst_then_idle(started)
    finally:
        if router is not None:
            router.stop()
        stop_process(emulator)
