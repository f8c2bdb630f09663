"""A router service in the test process (no Redis connection, no HTTP) with worker-reported
replicas: for unit tests of the request path's steps."""

from __future__ import annotations

import time

from router.request.prompts import PromptTokenizer
from router.service.config import load_config
from router.service.server import RouterService
from router.shared import contract as c

MODEL = "m"


def service_with_replicas(n: int, tokenizer: PromptTokenizer | None = None,
                          index_stride: int = 1, policy: str | None = None) -> RouterService:
    """A router service (no Redis connection, no HTTP) with ``n`` worker-reported replicas
    (the exact index unless ``index_stride`` says otherwise; the default policy unless
    ``policy`` names one)."""
    config = load_config(["--model", MODEL, "--redis-url", "redis://127.0.0.1:1/0",
                          "--index-stride", str(index_stride),
                          *(["--policy", policy] if policy else [])], env={})
    service = RouterService(config, tokenizer=tokenizer)
    now = time.time()
    for i in range(n):
        service.fleet.apply_heartbeat(f"replica-{i}", {
            c.F_URL: f"http://127.0.0.1:{9000 + i}", c.F_MODELS: f'["{MODEL}"]',
            c.F_INDEX_STRIDE: str(index_stride), c.F_HEARTBEAT_TS: str(now)}, now)
    return service
