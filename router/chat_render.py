"""Request-supplied chat templates, rendered in a child process that is killed when it overruns.

vLLM refuses a request's own ``chat_template`` unless the server runs with
``--trust-request-chat-template`` (vLLM 0.33 ``_validate_chat_template``); the
router does the same (``UNTRUSTED_TEMPLATE_MESSAGE``) unless
``trust_request_chat_template`` is set. A trusted template is still arbitrary
Jinja: two nested ``range`` loops run for minutes inside the sandbox, and a
thread cannot be stopped. So it is rendered by ``TemplateRenderer`` in one child
process (the tokenizer loaded there too, the render the same
``PromptTokenizer.render_chat``), given ``timeout_s`` and ``max_bytes`` of text and
an address-space limit; an overrun kills the child (a fresh one is started for the
next request) and the request gets a 400. The model's own template never goes
through here. Does I/O (a process and a pipe).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Final

from router.prompts import PromptError, PromptSpec

logger = logging.getLogger(__name__)

# vLLM's message, word for word, so a client sees the same refusal from the router and the engine
UNTRUSTED_TEMPLATE_MESSAGE: Final = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template.")
CHILD_START_TIMEOUT_S: Final = 60.0  # importing transformers and loading the tokenizer
CHILD_ADDRESS_SPACE_BYTES: Final = 8 << 30  # a template building a huge string fails, not the host


def has_request_template(spec: PromptSpec) -> bool:
    """True for a chat request that brings its own ``chat_template``."""
    return bool(spec.chat_options) and spec.chat_options.get("chat_template") is not None  # type: ignore[union-attr]


def _child_main(conn: Connection, source: str, max_bytes: int) -> None:
    """Child loop: load the tokenizer, then answer ``PromptSpec`` -> ``("ok", text)`` or
    ``("error", message)`` until the pipe closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE_BYTES, CHILD_ADDRESS_SPACE_BYTES))
    from router.prompts import PromptTokenizer

    tokenizer = PromptTokenizer(source, cache_chunks=16)
    conn.send(("ready", ""))
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            text = tokenizer.render_chat(spec)
            if len(text.encode()) > max_bytes:
                conn.send(("error", f"chat template rendered more than {max_bytes} bytes"))
            else:
                conn.send(("ok", text))
        except PromptError as exc:
            conn.send(("error", str(exc)))
        except MemoryError:
            conn.send(("error", "chat template render ran out of memory"))


class TemplateRenderer:
    """One child process rendering request chat templates, one at a time. Thread-safe.

    ``render(spec)`` blocks (call it off the event loop) for at most about
    ``timeout_s`` once the child is up; raises ``PromptError`` when the template fails,
    overruns ``timeout_s`` (the child is killed) or renders more than ``max_bytes``.
    """

    def __init__(self, source: str, timeout_s: float, max_bytes: int) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._ready = False  # the child said it loaded the tokenizer
        self.num_killed = 0

    def start(self) -> None:
        """Start the child now (it takes a few seconds), so the first request need not wait."""
        with self._lock:
            self._ensure_child()

    def _spawn(self) -> None:
        """Start a child; it reports ready once its tokenizer is loaded (``_ensure_child``)."""
        self._stop_child()
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child_main, args=(child, self.source, self.max_bytes),
                                       name="chat-template-render", daemon=True)
        self._proc.start()
        child.close()
        self._conn, self._ready = parent, False

    def _ensure_child(self) -> Connection:
        if self._proc is None or not self._proc.is_alive() or self._conn is None:
            self._spawn()
        assert self._conn is not None
        if not self._ready:
            if not self._conn.poll(CHILD_START_TIMEOUT_S):
                self._stop_child()
                raise PromptError("chat template renderer did not start")
            self._conn.recv()  # ("ready", "")
            self._ready = True
        return self._conn

    def _stop_child(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._proc = None

    def render(self, spec: PromptSpec) -> str:
        with self._lock:
            try:
                conn = self._ensure_child()
                conn.send(spec)
                started = time.monotonic()
                if not conn.poll(self.timeout_s):
                    self.num_killed += 1
                    logger.warning("request chat template still rendering after %.1f s: killed",
                                   time.monotonic() - started)
                    self._spawn()  # the next request finds a fresh child (nearly) ready
                    raise PromptError(f"chat template render took longer than "
                                      f"{self.timeout_s:g} s (trust_request_chat_template bound)")
                kind, text = conn.recv()
            except (EOFError, OSError) as exc:  # the child died (e.g. killed by the OOM killer)
                self._stop_child()
                raise PromptError(f"chat template render failed: {exc!r}") from exc
        if kind != "ok":
            raise PromptError(text if text.startswith("chat template") else
                              f"chat template error: {text}")
        return text

    def close(self) -> None:
        with self._lock:
            self._stop_child()
