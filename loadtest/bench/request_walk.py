"""The walk of one request body through the router's code, from the HTTP handler to the proxy.

``python -m loadtest.bench.request_walk`` starts a real emulator (two replicas), runs the router
in-process against it as static replicas (no Redis), sends one warm-up and one measured request
of each kind (token ids, text, chat) over real HTTP, and records, with ``sys.setprofile`` on the
handler's own task only, every Python call into the ``router`` package between the handler's
entry and ``Proxy.forward``. It prints, per kind, for all calls and for the "steps" view (the
handler's file and the calls it makes into other files: ``STEP_DEPTH``):

- ``calls``: function calls into router modules (comprehensions and generator expressions not
  counted);
- ``stops``: runs of consecutive calls in one file (the walk's stops; a call into a file, then
  into another, then back is three stops);
- ``files``: distinct files visited;
- ``returns``: stops in a file the walk had already left (how often the body goes back).

The figures compare two trees by running this module in each (``PYTHONPATH=<tree>``); they are
counts of the code's structure, not timings. Output: one JSON object per kind, and the walk.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp

import router
from loadtest.harness.processes import start_emulator, stop_process
from router.edges.proxy import Proxy

ROUTER_DIR = str(Path(router.__file__).parent)
SKIPPED = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}
HANDLERS = {"handle_generate"}  # where the walk starts (the completions and chat handler)
# Where it ends: the proxy's forward, matched by its code object (not by a file name, which
# changes when the module moves: the walk recorded whole requests after phase 1 of issue #31).
PROXY_ENTRY = Proxy.forward.__code__
STEP_DEPTH = 2  # the "steps" view: the handler's file and what it calls in other files
CO_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


class WalkRecorder:
    """Records the router-package calls made by one request's handler task until the proxy."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.calls: list[tuple[str, str, int]] = []  # (file under router/, function, depth)
        self.done = False
        # coroutine frames already entered (a resume is not a call); kept alive so that no
        # later frame reuses a finished one's id
        self._resumable: dict[int, FrameType] = {}

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.done:
            return
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(ROUTER_DIR) or code.co_name in SKIPPED:
            return
        if code.co_flags & CO_RESUMABLE:
            if id(frame) in self._resumable:
                return  # a coroutine resumed after an await: not a new call
            self._resumable[id(frame)] = frame
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if self.task is None:
            if code.co_name not in HANDLERS:
                return
            self.task = task
        elif task is not self.task:
            return
        name = filename[len(ROUTER_DIR) + 1:]
        self.calls.append((name, code.co_qualname, _depth(frame)))
        if code is PROXY_ENTRY:
            self.done = True


def _depth(frame: FrameType) -> int:
    """Module depth of ``frame`` below the handler: 1 + the changes of file along the router
    frames from the handler down to it (the handler's file is depth 1, whatever private helpers
    it calls in its own file; what those call in another file depth 2; and so on)."""
    files: list[str] = []
    current: FrameType | None = frame
    while current is not None:
        filename = current.f_code.co_filename
        if filename.startswith(ROUTER_DIR):
            if not files or files[-1] != filename:
                files.append(filename)
            if current.f_code.co_name in HANDLERS:
                break
        current = current.f_back
    return len(files)


def summarise(calls: list[tuple[str, str, int]], max_depth: int | None = None) -> dict[str, Any]:
    """``calls`` (to ``max_depth`` below the handler, all without) -> counts: calls, stops (runs
    of one file), files, returns (stops in a file already left), the stops as ``file:function``."""
    stops: list[tuple[str, str]] = []
    for name, function, depth in calls:
        if max_depth is not None and depth > max_depth:
            continue
        if not stops or stops[-1][0] != name:
            stops.append((name, function))
    seen: set[str] = set()
    returns = 0
    for name, _ in stops:
        if name in seen:
            returns += 1
        seen.add(name)
    return {"calls": len(calls), "stops": len(stops), "files": len(seen), "returns": returns,
            "walk": [f"{name}:{function}" for name, function in stops]}


def request_bodies(model: str, salt: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """One body per kind; ``salt`` makes the prompt new (a warm-up and a measured one)."""
    text = f"{salt} " + " ".join(f"word{i}" for i in range(300))
    return {
        "token_ids": ("/v1/completions", {"model": model, "prompt": list(range(1000, 1400)),
                                          "max_tokens": 1, "cache_salt": salt}),
        "text": ("/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}),
        "chat": ("/v1/chat/completions", {"model": model, "max_tokens": 1, "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text}]}),
    }


async def walk(urls: list[str], model: str, tokenizer: str | None) -> dict[str, Any]:
    from aiohttp import web

    from router.request.prompts import PromptTokenizer
    from router.service.config import load_config

    args = ["--model", model, "--policy", "prefix", "--port", "0", "--host", "127.0.0.1"]
    for url in urls:
        args += ["--replica", url]
    config = load_config(args, env={})
    prompt_tokenizer = PromptTokenizer(tokenizer) if tokenizer else None
    from router.service import server

    service = server.RouterService(config, prompt_tokenizer)
    runner = web.AppRunner(service.build_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):  # the static prober marks replicas routable
                async with session.get(f"{base}/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
            for kind in ("token_ids", "text", "chat"):
                for salt in ("warm", "measured"):
                    path, body = request_bodies(model, salt)[kind]
                    recorder = WalkRecorder()
                    sys.setprofile(recorder.profile)
                    try:
                        async with session.post(f"{base}{path}", json=body) as resp:
                            await resp.read()
                            status = resp.status
                    finally:
                        sys.setprofile(None)
                    if status != 200:
                        raise RuntimeError(f"{kind} request answered {status}")
                    if not recorder.done:
                        raise RuntimeError(f"{kind} request never reached Proxy.forward")
                results[kind] = {"steps": summarise(recorder.calls, STEP_DEPTH),
                                 "all": summarise(recorder.calls)}
    finally:
        await runner.cleanup()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.request_walk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--walk", action="store_true", help="print every stop of the walk")
    args = parser.parse_args(argv)
    from router.request.prompts import default_tokenizer_dir

    tokenizer = default_tokenizer_dir()
    model = "Qwen/Qwen3-0.6B"
    with tempfile.TemporaryDirectory() as tmp:
        proc, replicas = start_emulator(Path(tmp) / "ready.json", ["--replicas", "2", "--model", model])
        try:
            urls = [r["url"] for r in replicas]
            time.sleep(0.2)
            results = asyncio.run(walk(urls, model, tokenizer))
        finally:
            stop_process(proc)
    for kind, views in results.items():
        for view, summary in views.items():
            shown = summary if args.walk else {k: v for k, v in summary.items() if k != "walk"}
            print(json.dumps({"kind": kind, "view": view, **shown}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
