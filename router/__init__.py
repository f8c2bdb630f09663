"""prefix-router: the router, and in ``router.shared`` the core the worker and emulator share."""

import os

# transformers prints an advisory "PyTorch was not found ..." on import when torch is absent (the
# router and the workers use only its tokenizers and chat templates, never a model): a newcomer
# read it as a broken install. Advisory warnings only; errors and other warnings still print.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
