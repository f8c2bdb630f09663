"""The router's start-up warm-up: the tokenizer (the model's chat template compiled, a first
encode) and then the chat render children, while /ready answers 503. Runs the steps on the
tokenizer's and the renderer's executors.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any

from router.request.chat_render import CHILD_START_TIMEOUT_S, RENDER_PROCESSES, TemplateRenderer
from router.request.prompts import PromptError, PromptTokenizer

logger = logging.getLogger(__name__)


class WarmUp:
    """``run()`` once at start-up; ``warming`` names the step under way ("" once warm), which
    keeps /ready false: no request pays for start-up (the first chats after start waited
    3.1-3.4 s on a quiet machine, 16.6-16.9 s on a busy one)."""

    def __init__(self, tokenizer: PromptTokenizer | None, tokenizer_executor: Executor,
                 renderer: TemplateRenderer | None, render_executor: Executor) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_executor = tokenizer_executor
        self.renderer = renderer
        self.render_executor = render_executor
        self.warming = "start-up" if tokenizer is not None else ""

    async def run(self) -> None:
        """Warm the tokenizer, then the render children (``TemplateRenderer.wait_warm``). Each
        step is bounded; one that fails or overruns is logged and the router gets ready
        without it."""
        loop = asyncio.get_running_loop()
        try:
            if self.tokenizer is not None:
                self.warming = "the tokenizer (chat template, first encode)"
                try:
                    await loop.run_in_executor(self.tokenizer_executor, self.tokenizer.warm)
                except PromptError as exc:
                    logger.warning("tokenizer warm-up: %s", exc)
            if self.renderer is not None:
                self.warming = "the chat render processes"
                if not await loop.run_in_executor(self.render_executor, self.renderer.wait_warm,
                                                  CHILD_START_TIMEOUT_S):
                    logger.warning("chat render processes not warm after %g s (%d of %d): "
                                   "ready without them", CHILD_START_TIMEOUT_S,
                                   self.renderer.num_warmed, RENDER_PROCESSES)
        finally:
            self.warming = ""
        logger.info("warm: tokenizer and chat render processes ready")

    def state(self) -> dict[str, Any]:
        """/ready's ``warm_up``: the step under way (``warming``, null once warm), the model
        template's compiles so far and the render children's warm-ups and cold renders."""
        renderer = self.renderer
        return {
            "warming": self.warming or None,
            "template_loads": self.tokenizer.num_template_loads if self.tokenizer else None,
            "render_processes": RENDER_PROCESSES if renderer else 0,
            "render_processes_warmed": renderer.num_warmed if renderer else None,
            "cold_renders": renderer.num_cold_renders if renderer else None,
        }
