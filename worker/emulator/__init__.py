"""The engine emulator: vLLM-compatible replicas that run on a CPU.

``profiles`` (latency model), ``kv_cache`` (paged block pool with prefix caching)
and ``scheduler`` (continuous batching) are pure; ``publisher`` (ZMQ KV events),
``metrics`` (Prometheus) and ``app`` (aiohttp server and CLI) are the I/O edges.
"""
