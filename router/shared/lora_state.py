"""A replica's LoRA state as vLLM exports it, read from ``/metrics`` by the worker and from the
heartbeat by the router. Pure.

vLLM 0.32 (``v1/metrics/loggers.py``) exports ``vllm:lora_requests_info`` when LoRA is on: a
gauge labelled ``running_lora_adapters`` and ``waiting_lora_adapters`` (adapter names of the
requests running and waiting, joined by ",") and ``max_lora`` (``--max-loras``), set to the
current time at every stats update; the series of earlier label sets stay on the page, so the
current state is the sample with the largest value. ``router.apis.lora_load`` ranks replicas by
it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

LORA_INFO_METRIC: Final = "vllm:lora_requests_info"


@dataclass(frozen=True, slots=True)
class LoraLoad:
    """One replica's LoRA state from ``vllm:lora_requests_info``: adapter names of the running
    and the waiting requests and ``max_lora`` (adapters per batch; ``None`` when not
    reported)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int | None = None

    @property
    def num_in_use(self) -> int:
        """Distinct adapters in use (running or waiting)."""
        return len(self.running | self.waiting)


def split_names(text: str) -> frozenset[str]:
    """A label's comma-separated adapter names (vLLM joins them with ","; "" is none)."""
    return frozenset(name for name in text.split(",") if name)


def current_lora_load(samples: Iterable[tuple[Mapping[str, str], float]]) -> LoraLoad | None:
    """The current ``LoraLoad`` from the ``vllm:lora_requests_info`` samples of one scrape
    (``(labels, value)`` pairs): the sample with the largest value (vLLM sets the current label
    set's series to the time of the update and leaves the earlier ones), or ``None`` when there
    is none (LoRA off, or an engine that does not export it). A ``max_lora`` that is not an
    integer is ``None``."""
    best: tuple[Mapping[str, str], float] | None = None
    for labels, value in samples:
        if best is None or value > best[1]:
            best = (labels, value)
    if best is None:
        return None
    labels = best[0]
    try:
        max_lora: int | None = int(labels.get("max_lora", ""))
    except ValueError:
        max_lora = None
    return LoraLoad(
        split_names(labels.get("running_lora_adapters", "")),
        split_names(labels.get("waiting_lora_adapters", "")),
        max_lora,
    )
