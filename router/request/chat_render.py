"""Request-supplied chat templates, rendered in child processes that are killed when they overrun.

vLLM refuses a request's own ``chat_template`` unless the server runs with
``--trust-request-chat-template`` (vLLM 0.33 ``_validate_chat_template``); the
router does the same (``UNTRUSTED_TEMPLATE_MESSAGE``) unless
``trust_request_chat_template`` is set. A trusted template is still arbitrary
Jinja: two nested ``range`` loops run for minutes inside the sandbox, and a
thread cannot be stopped. So it is rendered by ``TemplateRenderer`` in a pebble
``ProcessPool`` of two children (each loads the tokenizer once, renders a chat to warm
up before it takes requests, and renders with the same ``PromptTokenizer.render_chat``), given ``timeout_s`` and ``max_bytes`` of text
and an address-space limit; an overrun kills that child and the request gets a 400.
Renders go one at a time, so the other child is always a warm spare: the next render
runs there at once while pebble restarts the killed one (loading the tokenizer takes
seconds, more on a loaded machine). The model's own template never goes through here.
Does I/O (processes and pipes).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from concurrent.futures import CancelledError
from typing import Any, Final

from pebble import ProcessExpired, ProcessPool

from router.request.prompts import PromptError, PromptSpec

logger = logging.getLogger(__name__)

# vLLM's message, word for word, so a client sees the same refusal from the router and the engine
UNTRUSTED_TEMPLATE_MESSAGE: Final = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template.")
CHILD_START_TIMEOUT_S: Final = 60.0  # importing transformers and loading the tokenizer
CHILD_ADDRESS_SPACE_BYTES: Final = 8 << 30  # a template building a huge string fails, not the host
WARM_POLL_S: Final = 0.05  # how often wait_warm looks at the children's warm-up count


def has_request_template(spec: PromptSpec) -> bool:
    """True for a chat request that brings its own ``chat_template``."""
    return bool(spec.chat_options) and spec.chat_options.get("chat_template") is not None  # type: ignore[union-attr]


RENDER_PROCESSES: Final = 2  # one renders, one waits warm: a kill never leaves none ready

_tokenizer: Any = None  # the child's own PromptTokenizer (set by _child_init)
_warm_seq = 0  # the child's place in its pool's warm-up order, 1-based (set by _child_init)
# what a child renders once at start: a request template as small as a real one gets
WARM_UP_TEMPLATE: Final = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def _child_init(source: str, warmed: Any) -> None:
    """Child start: bound the address space, load the tokenizer (seconds), render a chat with
    the model's template and with a request template (Jinja's import, transformers' chat
    utilities, a compile), then count itself in ``warmed`` (a shared ``multiprocessing.Value``):
    its first request renders as fast as its tenth. A child pebble starts after a kill runs
    this too, so it joins warm."""
    import resource

    global _tokenizer, _warm_seq
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE_BYTES, CHILD_ADDRESS_SPACE_BYTES))
    from router.request.prompts import WARM_UP_MESSAGES, PromptTokenizer

    _tokenizer = PromptTokenizer(source, cache_chunks=16)
    try:
        _tokenizer.warm()
        _tokenizer.render_chat(PromptSpec(
            "chat", None, messages=[dict(m) for m in WARM_UP_MESSAGES],
            chat_options={"chat_template": WARM_UP_TEMPLATE}))
    except PromptError:  # the model's template refuses a plain chat: requests see it, not start-up
        pass
    with warmed.get_lock():
        warmed.value += 1
        _warm_seq = warmed.value


def _child_render(spec: PromptSpec, max_bytes: int) -> tuple[str, str, int]:
    """In the child: ``PromptSpec`` -> ``("ok", text, seq)`` or ``("error", message, seq)``,
    ``seq`` the child's place in the warm-up order."""
    try:
        text = _tokenizer.render_chat(spec)
    except PromptError as exc:
        return "error", str(exc), _warm_seq
    except MemoryError:
        return "error", "chat template render ran out of memory", _warm_seq
    if len(text.encode()) > max_bytes:
        return "error", f"chat template rendered more than {max_bytes} bytes", _warm_seq
    return "ok", text, _warm_seq


def _noop() -> None:
    """A task that makes the pool start its children."""


class TemplateRenderer:
    """Two child processes rendering request chat templates, one render at a time. Thread-safe.

    ``render(spec)`` blocks (call it off the event loop) for at most about ``timeout_s``
    once a child is up; raises ``PromptError`` when the template fails, overruns
    ``timeout_s`` (its child is killed and restarted by the pool while the spare takes the
    next render) or renders more than ``max_bytes``.
    """

    def __init__(self, source: str, timeout_s: float, max_bytes: int) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one render at a time: the other child stays a spare
        context = multiprocessing.get_context("spawn")  # no fork of the router's threads
        self._warmed = context.Value("i", 0)  # children that finished their warm-up, ever
        self._closed = threading.Event()  # set by close(): ends wait_warm
        self._pool = ProcessPool(max_workers=RENDER_PROCESSES, initializer=_child_init,
                                 initargs=(source, self._warmed), context=context)
        self.num_killed = 0
        # renders that ran on a child warmed after the render was asked for: the request
        # waited for a child to start (none should, with a warm spare and a warm start)
        self.num_cold_renders = 0

    @property
    def num_warmed(self) -> int:
        """Children that finished their warm-up since the pool started (replacements too)."""
        return int(self._warmed.value)

    def wait_warm(self, timeout_s: float) -> bool:
        """Block until every child of the first start is warm (``num_warmed`` >=
        ``RENDER_PROCESSES``) or ``timeout_s`` passes. Returns whether they are."""
        deadline = time.monotonic() + timeout_s
        while self.num_warmed < RENDER_PROCESSES:
            if time.monotonic() >= deadline or self._closed.wait(WARM_POLL_S):
                return False
        return True

    def start(self) -> None:
        """Start the children now (loading the tokenizer takes seconds), so the first request
        need not wait."""
        self._pool.schedule(_noop)

    def render(self, spec: PromptSpec) -> str:
        with self._lock:
            warm_before = self.num_warmed
            future = self._pool.schedule(_child_render, args=(spec, self.max_bytes),
                                         timeout=self.timeout_s)  # counted from the render's start
            try:
                kind, text, warm_seq = future.result(CHILD_START_TIMEOUT_S + self.timeout_s)
                if warm_seq > warm_before:
                    self.num_cold_renders += 1
            except TimeoutError as exc:
                if not future.done():  # our wait ran out: no child came up in time
                    future.cancel()
                    raise PromptError("chat template renderer did not start") from exc
                # the pool's timeout: it killed the child and starts a new one
                self.num_killed += 1
                logger.warning("request chat template still rendering after %.1f s: killed",
                               self.timeout_s)
                raise PromptError(f"chat template render took longer than "
                                  f"{self.timeout_s:g} s (trust_request_chat_template bound)") from exc
            except (ProcessExpired, CancelledError, OSError) as exc:  # e.g. the OOM killer
                raise PromptError(f"chat template render failed: {exc!r}") from exc
        if kind != "ok":
            raise PromptError(text if text.startswith("chat template") else
                              f"chat template error: {text}")
        return text

    def close(self) -> None:
        self._closed.set()
        self._pool.stop()
        self._pool.join(5)
