"""Benchmarks, one module each (``python -m loadtest.bench.NAME``), and the request walk."""
