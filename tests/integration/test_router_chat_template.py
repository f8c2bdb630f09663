"""A request's own ``chat_template``: refused like vLLM by default; when trusted, its render is
bounded (a child process killed on overrun) so it never stalls other requests.

A real emulator (one replica, static URL) and router processes with the bundled Qwen3 tokenizer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.request.chat_render import UNTRUSTED_TEMPLATE_MESSAGE
from tests.helpers import emulator_url, wait_for
from tests.integration.test_router_fleet import TOKENIZER, Router

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(TOKENIZER is None, reason="needs the Qwen3 tokenizer files")]

# 10^10 empty iterations inside Jinja's sandbox: about an hour of CPU
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                "{% endfor %}{{ messages[0].content }}")
MESSAGES = [{"role": "user", "content": "hello there"}]
RENDER_BOUND_S = 5  # --chat-template-timeout-s of the stall test: two kills hold the renderer
# 10 s, time for ten ordinary chats even at load 20 on 2 cores (~0.1-0.3 s each)


@pytest.fixture(scope="module")
def replica_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with emulator_url(tmp_path_factory.mktemp("emu") / "emu.json", "--time-scale", "50") as url:
        yield url


def router_for(url: str, tmp: Path, *extra: str) -> Router:
    assert TOKENIZER is not None
    router = Router(tmp, ["--replica", url, "--tokenizer", TOKENIZER, *extra])
    # ready once warm: the render children load the tokenizer (seconds, a minute when busy)
    wait_for(lambda: router.ready()["ready"], 120, message="router ready")
    return router


def chat(router: Router, **extra: Any) -> tuple[int, Any, float]:
    started = time.monotonic()
    status, _, raw = router.post("/v1/chat/completions", {
        "model": "emulated-llm", "messages": MESSAGES, "max_tokens": 1, **extra}, timeout=60)
    return status, json.loads(raw), time.monotonic() - started


def test_request_chat_template_is_refused_by_default(replica_url: str, tmp_path: Path) -> None:
    router = router_for(replica_url, tmp_path)
    try:
        status, body, _ = chat(router, chat_template=NESTED_LOOPS)
        assert status == 400
        assert body["error"] == {"message": UNTRUSTED_TEMPLATE_MESSAGE, "type": "BadRequestError",
                                 "param": None, "code": 400}
        assert chat(router)[0] == 200
    finally:
        router.stop()


def test_trusted_request_template_is_bounded_and_never_stalls_others(
        replica_url: str, tmp_path: Path) -> None:
    router = router_for(replica_url, tmp_path, "--trust-request-chat-template",
                        "--chat-template-timeout-s", str(RENDER_BOUND_S))
    try:
        # a benign request template is rendered (the routed prompt is its output, not the
        # model template's)
        own = json.loads(router.post("/debug/route", {
            "model": "emulated-llm", "messages": MESSAGES,
            "chat_template": "{{ messages[0].content }}"}, timeout=90)[2])
        default = json.loads(router.post("/debug/route", {
            "model": "emulated-llm", "messages": MESSAGES})[2])
        assert own["num_tokens"] == 2 and default["num_tokens"] > own["num_tokens"], (own, default)

        # Two renders that run until killed hold the renderer for 2 x RENDER_BOUND_S (one at a
        # time). Ordinary chats sent meanwhile must not wait for it: each is answered before
        # the second render is killed. Asserted as an order of events, not a duration (was:
        # every chat under 1.0 s with a 1 s bound, which a busy machine can break).
        attacks: list[tuple[int, Any, float, float]] = []  # status, body, elapsed, done at

        def attack() -> None:
            attacks.append((*chat(router, chat_template=NESTED_LOOPS), time.monotonic()))

        threads = [threading.Thread(target=attack) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        others = [(*chat(router), time.monotonic()) for _ in range(10)]  # ordinary chats
        for t in threads:
            t.join(4 * RENDER_BOUND_S + 60)
        assert all(status == 200 for status, _, _, _ in others)
        assert [status for status, _, _, _ in attacks] == [400, 400]
        assert all(f"took longer than {RENDER_BOUND_S} s" in body["error"]["message"]
                   for _, body, _, _ in attacks)
        # each render ran its full bound before the kill (not refused early); the pebble
        # timeout is what answered (its message above), not the hour the template would take
        assert all(elapsed >= RENDER_BOUND_S for _, _, elapsed, _ in attacks), attacks
        last_kill = max(done for _, _, _, done in attacks)
        assert max(done for _, _, _, done in others) < last_kill, (others, attacks)
        # and the renderer comes back for the next trusted template
        status, _, _ = chat(router, chat_template="{{ messages[0].content }}")
        assert status == 200
    finally:
        router.stop()


def test_the_router_is_ready_only_once_warm(replica_url: str, tmp_path: Path) -> None:
    """/ready turns true only after the tokenizer compiled the model's template and every
    render child warmed up, so the first chats after ready load nothing (a cold router made
    its first chats wait 3.1-3.4 s quiet, 16.6-16.9 s busy)."""
    assert TOKENIZER is not None
    router = Router(tmp_path, ["--replica", replica_url, "--tokenizer", TOKENIZER,
                               "--trust-request-chat-template"])
    try:
        seen: list[dict[str, Any]] = []

        def ready() -> bool:
            seen.append(router.ready())
            return bool(seen[-1]["ready"])

        wait_for(ready, 120, message="router ready")
        for state in seen:  # every answer while starting: ready only when warm
            warm = state["warm_up"]
            if state["ready"]:
                assert warm["warming"] is None and warm["template_loads"] == 1, state
                assert warm["render_processes_warmed"] == 2, state
        assert chat(router)[0] == 200
        assert chat(router, chat_template="{{ messages[0].content }}")[0] == 200
        after = router.ready()["warm_up"]
        # no template compile in the router, no render waiting for a child to start
        assert after["template_loads"] == 1 and after["cold_renders"] == 0, after
        assert after["render_processes_warmed"] == 2, after
    finally:
        router.stop()


def test_a_killed_render_leaves_a_warm_spare(replica_url: str, tmp_path: Path) -> None:
    """After a render is killed the next trusted render runs on the spare child, warm before
    it was asked (was: after a fresh child loads the tokenizer, 12.8-25.5 s loaded), and the
    child started in the killed one's place warms up before it takes a render."""
    router = router_for(replica_url, tmp_path, "--trust-request-chat-template",
                        "--chat-template-timeout-s", "1")
    benign = "{{ messages[0].content }}"
    try:
        assert chat(router, chat_template=benign)[0] == 200
        status, body, _ = chat(router, chat_template=NESTED_LOOPS)
        assert status == 400 and "took longer than 1 s" in body["error"]["message"], body
        assert chat(router, chat_template=benign)[0] == 200
        # the render after the kill waited for no child to start (the spare was warm)
        assert router.ready()["warm_up"]["cold_renders"] == 0
        # the killed child's replacement warmed itself: 2 at start + 1
        wait_for(lambda: router.ready()["warm_up"]["render_processes_warmed"] == 3, 120,
                 message="replacement render child warm")
        assert chat(router)[0] == 200  # ordinary chat requests never wait on the renderer
    finally:
        router.stop()
