"""The shared core: what the router, the worker and the emulator all use (Redis contract, block
hashing, the KV-event wire format and sources, settings, secrets, Redis client, logging, version,
interrupt handling, chat-message rendering rules). Imports nothing else of the project
(tests/unit/test_layering.py), so the worker never loads the router."""
