"""Trace replay: reading and scheduling a trace (``trace``), prompts of exact token counts
(``text``), sending it to an endpoint and summarising the answers (``replayer``), the
placement-only simulation of a slice (``simulate``), the locust scenarios and example request
files."""
