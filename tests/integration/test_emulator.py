"""Integration tests: real ``prefix-worker emulate`` processes on loopback, real HTTP and ZMQ."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

from router.shared.kv_events import BlockRemoved, BlockStored, decode_batch
from tests import helpers
from tests.helpers import stop_process
from worker.emulator.config import QWEN3_TOKENIZER_VOCAB_SIZE
from worker.emulator.generation import output_text
from worker.emulator.tokenizer import default_tokenizer_dir

pytestmark = pytest.mark.timeout(120)

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})


class Emulator:
    def __init__(self, proc: subprocess.Popen[bytes], replicas: list[dict[str, Any]]) -> None:
        self.proc = proc
        self.replicas = replicas
        self.url = replicas[0]["url"]


@pytest.fixture
def start_emulator(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Emulator:
        proc, replicas = helpers.start_emulator(tmp_path / f"ready-{len(started)}.json", args, env, timeout_s=180)
        started.append(proc)
        return Emulator(proc, replicas)

    yield start
    for proc in started:
        stop_process(proc)


def post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def metric(text: str, name: str) -> float:
    """Sum of every series of ``name`` (all label sets)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + "{", name + " "))]
    if not values:
        raise KeyError(name)
    return sum(values)


def replay_batches(endpoint: str) -> list[list[Any]]:
    """Every buffered batch of a replica (its events), through the replay socket (no PUB slow
    joiner)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[list[Any]] = []
        while True:
            frames = sock.recv_multipart()
            if frames[2] == b"\xff" * 8:
                return batches
            batches.append(list(decode_batch(frames[3]).events))
    finally:
        sock.close(linger=0)
        ctx.term()


def replay_events(endpoint: str) -> list[Any]:
    """Every buffered event of a replica, in order (``replay_batches`` flattened)."""
    return [event for batch in replay_batches(endpoint) for event in batch]


def completion(url: str, tokens: list[int], **extra: Any) -> dict[str, Any]:
    status, body = post(url + "/v1/completions", {"prompt": tokens, "max_tokens": 2, **extra})
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def test_prefix_hits_through_http(start_emulator: Any) -> None:
    emu = start_emulator("--enable-prompt-tokens-details", "--time-scale", "100")
    url = emu.url
    prompt = [(i * 7919) % 50000 for i in range(1000)]
    assert completion(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = completion(url, prompt)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 992
    text = get(url + "/metrics")
    assert metric(text, "vllm:prefix_cache_hits_total") == 992
    assert metric(text, "vllm:prefix_cache_queries_total") == 2000
    exact = [(i * 104729) % 50000 + 1 for i in range(992)]
    completion(url, exact)
    assert completion(url, exact)["usage"]["prompt_tokens_details"]["cached_tokens"] == 976
    text = get(url + "/metrics")
    assert metric(text, "vllm:prefix_cache_hits_total") == 992 + 976
    assert metric(text, "vllm:request_success_total") == 4
    assert metric(text, "vllm:generation_tokens_total") == 8
    assert 'block_size="16"' in text and 'num_gpu_blocks="26702"' in text


def test_eviction_takes_tails_before_shared_heads(start_emulator: Any) -> None:
    # 1 null block + 12 usable blocks of 16 tokens.
    emu = start_emulator("--num-gpu-blocks-override", "13", "--enable-prompt-tokens-details",
                         "--kv-events-config", EVENTS, "--time-scale", "100")
    url = emu.url
    head = list(range(1, 65))  # 4 shared blocks
    a = [*head, *range(1000, 1032)]  # head + 2 own blocks
    b = [*head, *range(2000, 2032)]
    completion(url, a, max_tokens=1)
    assert completion(url, b, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # Both finished. Free queue (head first): 4 never-used blocks, a's tail, b's tail (each
    # tail first), then the shared head. Two distinct 4-block prompts need 8 blocks: the
    # unused ones, then the tails; the second prompt's blocks come back behind the head.
    for k in range(2):
        completion(url, list(range(10000 * (k + 1), 10000 * (k + 1) + 64)), max_tokens=1)
    events = replay_events(emu.replicas[0]["kv_replay_endpoint"])
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    a_hashes, b_tail = stored[0].block_hashes, stored[1].block_hashes
    assert len(a_hashes) == 6 and len(b_tail) == 2
    assert stored[1].parent_block_hash == a_hashes[3]  # b stored only past the shared head
    assert removed == [a_hashes[5], a_hashes[4], b_tail[1], b_tail[0]]  # tails, tail first
    reply = completion(url, [*head, 7, 7, 7], max_tokens=1)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # the head survived


def test_block_stored_hashes_equal_prefix_router_hash(start_emulator: Any) -> None:
    env = {"PYTHONHASHSEED": "42"}
    emu = start_emulator("--kv-events-config", EVENTS, "--prefix-caching-hash-algo", "sha256_cbor",
                         "--lora-modules", "sql=/adapters/sql", "--time-scale", "100", env=env)
    tokens = list(range(500, 580))  # 5 full blocks
    completion(emu.url, tokens, model="sql", cache_salt="tenant-a", max_tokens=1)
    stored = [e for e in replay_events(emu.replicas[0]["kv_replay_endpoint"])
              if isinstance(e, BlockStored)]
    assert stored[0].lora_name == "sql" and stored[0].lora_id == 1
    assert stored[0].extra_keys == [["sql", "tenant-a"], ["sql"], ["sql"], ["sql"], ["sql"]]
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "hash", "--hash-algo", "sha256_cbor", "--hash-seed", "42",
         "--lora-name", "sql", "--lora-path", "/adapters/sql", "--cache-salt", "tenant-a",
         "--tokens", json.dumps(tokens)], capture_output=True, text=True, check=True, timeout=30)
    cli_keys = [int(line.split()[1]) for line in out.stdout.splitlines()]
    assert stored[0].block_hashes == cli_keys


def test_raw_digest_hashes_and_reset(start_emulator: Any) -> None:
    emu = start_emulator("--kv-events-config", EVENTS, "--time-scale", "100",
                         env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"})
    completion(emu.url, list(range(40)), max_tokens=1)
    status, _ = post(emu.url + "/reset_prefix_cache", {})
    assert status == 200
    replay = emu.replicas[0]["kv_replay_endpoint"]
    events = replay_events(replay)
    assert isinstance(events[0], BlockStored)
    assert events[0].block_hashes[0] == bytes.fromhex(
        "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798")
    # as vLLM 0.32: the reset's AllBlocksCleared is published with the next step's batch,
    # before that step's stores, and not while the engine is idle
    assert not any(type(e).__name__ == "AllBlocksCleared" for e in events)
    completion(emu.url, list(range(100, 140)), max_tokens=1)
    batches = replay_batches(replay)
    cleared = [b for b in batches if any(type(e).__name__ == "AllBlocksCleared" for e in b)]
    assert len(cleared) == 1 and type(cleared[0][0]).__name__ == "AllBlocksCleared", batches
    assert [type(e) for e in cleared[0][1:]] == [BlockStored], cleared
    sources = json.loads(get(emu.url + "/kv_event_sources"))
    assert sources[0]["endpoint"] == emu.replicas[0]["kv_events_endpoint"]


def test_http_surface(start_emulator: Any) -> None:
    emu = start_emulator("--replicas", "2", "--lora-modules", "sql=/adapters/sql",
                         "--served-model-name", "m1", "m2", "--time-scale", "100")
    url, url2 = emu.replicas[0]["url"], emu.replicas[1]["url"]
    models = json.loads(get(url + "/v1/models"))["data"]
    assert [m["id"] for m in models] == ["m1", "m2", "sql"]
    assert models[2]["root"] == "/adapters/sql" and models[2]["parent"] == "m1"
    assert json.loads(get(url + "/version"))["version"]
    # List of token-id prompts -> one choice per prompt; ignore_eos -> exactly max_tokens.
    status, body = post(url + "/v1/completions", {"prompt": [[1, 2, 3], [4, 5, 6]],
                                                   "max_tokens": 7, "ignore_eos": True})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 14 and body["usage"]["prompt_tokens"] == 6
    # Streaming: SSE chunks, usage chunk, [DONE].
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({
        "prompt": [1, 2, 3], "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln for ln in resp.read().decode().split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == output_text(0, 20)
    # Errors in vLLM's shape.
    status, body = post(url + "/v1/completions", {"prompt": [1, 2], "cache_salt": ""})
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400
    status, body = post(url + "/v1/completions", {"model": "nope", "prompt": [1]})
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    status, body = post(url + "/v1/completions", {"prompt": [1], "stream_options": {}})
    assert status == 400
    status, body = post(url + "/v1/completions", {"prompt": [1], "max_tokens": 0})
    assert status == 400
    # Each replica's /metrics shows only its own requests.
    assert metric(get(url + "/metrics"), "vllm:request_success_total") >= 1
    text2 = get(url2 + "/metrics")
    assert metric(text2, "vllm:prompt_tokens_total") == 0
    assert get(url2 + "/health") == ""


def test_text_and_chat_prompts_use_the_tokenizer(start_emulator: Any) -> None:
    emu = start_emulator("--time-scale", "100")
    url = emu.url
    status, tok = post(url + "/tokenize", {"prompt": "Hello world, hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0
    status, body = post(url + "/v1/completions", {"prompt": "Hello world, hello world",
                                                   "max_tokens": 3})
    assert status == 200 and body["usage"]["prompt_tokens"] == tok["count"]
    messages = [{"role": "user", "content": "What is prefix caching?"}]
    status, rendered = post(url + "/tokenize", {"messages": messages})
    assert status == 200
    status, chat_render = post(url + "/v1/chat/completions/render", {"messages": messages})
    assert status == 200 and chat_render["token_ids"] == rendered["tokens"]
    status, body = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert status == 200 and body["usage"]["prompt_tokens"] == rendered["count"]
    assert body["choices"][0]["message"]["role"] == "assistant"
    status, render = post(url + "/v1/completions/render", {"prompt": ["a b", [5, 6]]})
    assert status == 200 and render[1]["token_ids"] == [5, 6]
    status, detok = post(url + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "Hello world, hello world"


def test_chat_template_kwargs_tools_and_tokenize_render_as_vllm(start_emulator: Any) -> None:
    """Issue 35 review F4: vLLM 0.32 serves ``chat_template_kwargs`` "tools" (they replace the
    request's ``tools``) and "tokenize" (the template's own ids); both were a 400 here."""
    url = start_emulator("--time-scale", "100").url
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    other = {"type": "function", "function": {"name": "search", "parameters": {}}}
    messages = [{"role": "user", "content": "Weather?"}]

    def ids(body: dict[str, Any]) -> list[int]:
        status, render = post(url + "/v1/chat/completions/render", {"messages": messages, **body})
        assert status == 200, render
        return list(render["token_ids"])

    with_tools = ids({"tools": [tool]})
    assert ids({"chat_template_kwargs": {"tools": [tool]}}) == with_tools
    assert ids({"tools": [other], "chat_template_kwargs": {"tools": [tool]}}) == with_tools
    assert ids({"chat_template_kwargs": {"tokenize": True}}) == ids({})


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def _until_metric(session: aiohttp.ClientSession, url: str, name: str, value: float,
                        timeout_s: float) -> float:
    """Poll /metrics until ``name`` equals ``value``; returns the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    last = None
    while loop.time() - start < timeout_s:
        last = metric(await _metrics(session, url), name)
        if last == value:
            return loop.time() - start
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{name} stayed {last}, expected {value} within {timeout_s}s")


async def test_client_disconnect_aborts_the_request(start_emulator: Any) -> None:
    """vLLM aborts a request whose client went away: running drops to 0, blocks are freed
    (kept cached, so the same prompt then hits), for non-streamed and streamed requests."""
    emu = start_emulator("--enable-prompt-tokens-details", "--block-size", "16")
    url = emu.url
    prompt = list(range(2000, 2064))  # 4 full blocks
    body = {"prompt": prompt, "max_tokens": 3000, "ignore_eos": True}  # ~tens of seconds
    async with aiohttp.ClientSession() as session:
        # Non-streamed: the client gives up (timeout) while the request is running.
        post_task = asyncio.ensure_future(session.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1.5)))
        await _until_metric(session, url, "vllm:num_requests_running", 1, timeout_s=10)
        assert metric(await _metrics(session, url), "vllm:kv_cache_usage_perc") > 0
        with pytest.raises(asyncio.TimeoutError):
            await post_task
        await _until_metric(session, url, "vllm:num_requests_running", 0, timeout_s=3)
        text = await _metrics(session, url)
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        assert metric(text, "vllm:num_requests_waiting") == 0
        assert metric(text, "vllm:request_success_total") == 0
        # Streamed: the client reads one chunk, then cancels.
        stream_body = {**body, "stream": True}
        got_chunk = asyncio.Event()

        async def read_stream() -> None:
            async with session.post(url + "/v1/completions", json=stream_body) as resp:
                assert resp.status == 200
                async for _ in resp.content.iter_any():
                    got_chunk.set()

        stream_task = asyncio.ensure_future(read_stream())
        await asyncio.wait_for(got_chunk.wait(), timeout=10)
        assert metric(await _metrics(session, url), "vllm:num_requests_running") == 1
        stream_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream_task
        await _until_metric(session, url, "vllm:num_requests_running", 0, timeout_s=3)
        assert metric(await _metrics(session, url), "vllm:kv_cache_usage_perc") == 0
        # A request that runs to completion is unaffected; the aborted requests' prompt
        # blocks stayed cached (vLLM frees blocks on abort without dropping their hashes).
        async with session.post(url + "/v1/completions",
                                json={"prompt": prompt, "max_tokens": 5}) as resp:
            assert resp.status == 200
            done = await resp.json()
        assert done["usage"]["completion_tokens"] == 5
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert done["choices"][0]["text"] == output_text(0, 5)
        text = await _metrics(session, url)
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:request_success_total") == 1


def test_out_of_vocabulary_token_ids_are_rejected(start_emulator: Any) -> None:
    emu = start_emulator("--time-scale", "100")
    url = emu.url
    top = QWEN3_TOKENIZER_VOCAB_SIZE - 1
    for bad in (1_000_000_000, 18446744073709551616, QWEN3_TOKENIZER_VOCAB_SIZE):
        status, body = post(url + "/v1/completions", {"prompt": [bad, 2], "max_tokens": 1})
        assert status == 400, body
        assert body["error"] == {"message": f"Token id {bad} is out of vocabulary",
                                 "type": "BadRequestError", "param": "prompt", "code": 400}
    # One bad prompt in a batch rejects the request; render endpoints validate too.
    status, body = post(url + "/v1/completions", {"prompt": [[1, 2], [3, 10**9]]})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = post(url + "/v1/completions/render", {"prompt": [5, 10**9]})
    assert status == 400 and body["error"]["message"] == "Token id 1000000000 is out of vocabulary"
    assert completion(url, [top, 0])["usage"]["prompt_tokens"] == 2
    assert metric(get(url + "/metrics"), "vllm:request_success_total") == 1
    # --vocab-size sets the bound; with --tokenizer and no --vocab-size, the bound is that
    # tokenizer's len() (here the same Qwen3 files, loaded on the first token-id prompt).
    small = start_emulator("--time-scale", "100", "--vocab-size", "1000")
    assert post(small.url + "/v1/completions", {"prompt": [999], "max_tokens": 1})[0] == 200
    assert post(small.url + "/v1/completions", {"prompt": [1000], "max_tokens": 1})[0] == 400
    custom = start_emulator("--time-scale", "100", "--tokenizer", default_tokenizer_dir())
    assert post(custom.url + "/v1/completions", {"prompt": [top], "max_tokens": 1})[0] == 200
    status, body = post(custom.url + "/v1/completions", {"prompt": [top + 1], "max_tokens": 1})
    assert status == 400 and body["error"]["message"] == f"Token id {top + 1} is out of vocabulary"


def test_usage_counts_each_prompt_once_with_several_choices(start_emulator: Any) -> None:
    """vLLM's usage: prompt tokens (and their cached tokens) once per prompt, completion tokens
    of every choice; a batch of prompts adds each prompt once."""
    emu = start_emulator("--enable-prompt-tokens-details")
    url = emu.url + "/v1/completions"
    seen = False
    for body, prompt_tokens, completion_tokens in (
            ({"prompt": list(range(1, 41)), "max_tokens": 3, "n": 3}, 40, 9),
            ({"prompt": [list(range(1, 41)), [7, 8, 9]], "max_tokens": 2, "n": 2}, 43, 8)):
        for stream in (False, True):
            if stream:
                body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                              if line.startswith("data: {")]
                usage = events[-1]["usage"]
            else:
                status, answer = post(url, body)
                assert status == 200, answer
                usage = answer["usage"]
            assert usage["prompt_tokens"] == prompt_tokens, (body, usage)
            assert usage["completion_tokens"] == completion_tokens, (body, usage)
            assert usage["total_tokens"] == prompt_tokens + completion_tokens
            # once the 40-token prompt was seen: its 2 full blocks (cap floor(39/16)), counted
            # once, not once per choice
            assert usage["prompt_tokens_details"]["cached_tokens"] == (32 if seen else 0), usage
            seen = True
