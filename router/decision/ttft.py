"""Predicted time to first token: the prefill arithmetic and a prefill rate learned per replica.

Pure: no I/O, deterministic given its inputs (the ``ttft`` routing policy in ``router.decision.policy``
and the service's first-token observations call into it).

Work is counted in *prefill work tokens*: the linear-layer cost of one token. Computing ``n`` new
tokens after ``c`` cached ones costs ``2 * P * n`` linear FLOPs plus causal attention
``4 * H * L * n * (c + (n + 1) / 2)`` FLOPs (``../shared/seed-prefix-caching.txt``; the same
formula as the emulator's latency model ``worker/emulator/profiles.py``), that is
``n * (1 + k * (c + (n + 1) / 2))`` work tokens with ``k = 2 * H * L / P``. A prefix hit removes
the linear work of the cached tokens but never the attention the suffix does against them.

A replica's TTFT is modelled as ``overhead_s + work_tokens * s_per_token``, where
``work_tokens`` is the work queued ahead of the request there plus its own prefill work.
``PrefillRateLearner`` fits ``s_per_token`` and ``overhead_s`` per replica from what the router
observes anyway (the work it predicted at dispatch, and the time from dispatch to the first
byte) with a Theil-Sen line fit over the last ``WINDOW`` samples: a median of pairwise slopes,
so up to about a quarter of the samples can be outliers (a preempted request, a host stall)
without moving the estimate, and a replica that changes speed is followed within ``WINDOW``
requests.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Final

import numpy as np

# k = 2 * H * L / P for an 8B Llama-3-shaped model (H = 32 q-heads x 128 = 4,096, L = 32 layers,
# P = 8e9; the emulator's default profile): attention work per new token per token of context,
# in units of one token's linear work. 70B Llama-3 gives 1.9e-5, Qwen3-8B 3.6e-5: the order is the
# same for dense decoders, and the learned rate absorbs the rest.
ATTENTION_WORK_PER_CONTEXT_TOKEN: Final = 2 * 4096 * 32 / 8.0e9
DEFAULT_PRIOR_TOKENS_PER_S: Final = 25_000.0  # prefill work tokens/s before any sample: 8B bf16
# on an H100-class GPU, 400 TFLOP/s / (2 x 8e9 FLOPs per token) (the emulator's default profile)
DEFAULT_CPU_LOAD_TOKENS_PER_S: Final = 50e9 / (2 * 32 * 8 * 128 * 2)  # = 381k tokens/s loaded from
# the CPU tier (host memory) into the GPU: a 50 GB/s PCIe Gen5 host link (the emulator's
# --gpu-host-link-gbps) over 128 KiB of KV per token (8B Llama-3: K and V x 32 layers x 8 KV heads
# x 128 dims x 2 bytes); 15x the prior prefill rate, so a CPU-tier hit saves ~93% of a recompute
DECODE_READ_WORK_PER_KV_TOKEN: Final = (2 * 32 * 8 * 128 * 2) * 400e12 / (3000e9 * 2 * 8.0e9)
# = 1.09e-3: one decode step reads every running request's KV from HBM (memory bound), so each token
# of context held there costs each step kv_bytes_per_token / HBM bandwidth seconds: 128 KiB / 3 TB/s
# for an 8B Llama-3 shape on an H100-class GPU, in units of one token's prefill (2 x 8e9 FLOPs at
# 400 TFLOP/s); the emulator's default profile. Dense decoders keep this order (70B: 320 KiB per
# token over 2x the FLOPs per token)
DEFAULT_OUTPUT_TOKENS: Final = 256  # tokens a request is assumed to generate until usage reports
WINDOW: Final = 32  # samples per replica in the fit: "converges within a few dozen requests"
MIN_SAMPLES: Final = 4  # below this the prior rate stands (a median of 1-3 samples is noise)
SAME_RATE_BAND: Final = 1.3  # a replica whose fitted seconds per token is within this factor of the
# fleet's median counts as the median: over 32 samples of mixed queueing the fit is noisy (its
# error: docs/benchmarks.md, "Figures from the code's comments"), and acting on that noise
# herds cold prompts onto whichever replica looks fastest this minute (the delay term
# multiplies the difference by the fleet's queue); real differences (another GPU generation, a
# bigger tensor-parallel group) are 1.5x and more
MIN_WORK_SPREAD: Final = 0.25  # pairs whose work differs by less than this share of the larger
# are left out of the slopes: their slope is mostly noise


def prefill_work_tokens(num_new_tokens: int, num_cached_tokens: int) -> float:
    """Work tokens to prefill ``num_new_tokens`` after ``num_cached_tokens`` cached ones.

    ``n * (1 + k * (c + (n + 1) / 2))`` (see the module docstring); 0 for ``n <= 0``.
    """
    n, c = num_new_tokens, num_cached_tokens
    if n <= 0:
        return 0.0
    return n * (1.0 + ATTENTION_WORK_PER_CONTEXT_TOKEN * (c + (n + 1) / 2.0))


def decode_work_tokens(context_tokens: float, num_requests: float, own_context_tokens: int,
                       output_tokens: float) -> float:
    """Decode-step work (prefill work tokens) that placing a request on a replica adds: while it
    generates ``output_tokens``, every decode step there reads its ``own_context_tokens`` of KV on
    behalf of the ``num_requests`` running there (their steps get longer) and reads their
    ``context_tokens`` for it (its own steps are as long): ``DECODE_READ_WORK_PER_KV_TOKEN x
    output_tokens x (context_tokens + own_context_tokens x num_requests)``. 0 when nothing runs
    there. The step-time roofline of ``worker/emulator/profiles.py``: decode batches are bound by
    HBM reads of the KV they attend to."""
    return (DECODE_READ_WORK_PER_KV_TOKEN * output_tokens
            * (context_tokens + own_context_tokens * num_requests))


def cpu_hit_value(prefill_tokens_per_s: float, cpu_load_tokens_per_s: float) -> float:
    """The prefill time a CPU-tier hit saves, as a share of what a GPU hit of the same tokens
    saves: ``1 - prefill rate / load rate`` (dimensionless, clamped to [0, 1]). A hit token on
    the GPU costs nothing; one in host memory costs its transfer (``1 / cpu_load_tokens_per_s``
    seconds) instead of its prefill (``1 / prefill_tokens_per_s``). Rates in tokens per second.
    The attention a later token does against the loaded context stays the same either way.
    Raises ``ValueError`` for a rate <= 0."""
    if prefill_tokens_per_s <= 0 or cpu_load_tokens_per_s <= 0:
        raise ValueError("rates must be > 0 tokens/s")
    return min(max(1.0 - prefill_tokens_per_s / cpu_load_tokens_per_s, 0.0), 1.0)


@dataclass(frozen=True, slots=True)
class RateEstimate:
    """One replica's fitted TTFT line: ``overhead_s + work_tokens * s_per_token``.

    ``num_samples`` is how many observations the fit used (0: the prior).
    """

    s_per_token: float  # seconds per prefill work token (1 / prefill rate)
    overhead_s: float = 0.0  # seconds of TTFT that do not grow with work (network, one step)
    num_samples: int = 0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.s_per_token

    def predict_s(self, work_tokens: float) -> float:
        return self.overhead_s + work_tokens * self.s_per_token


class PrefillRateLearner:
    """Per-replica ``RateEstimate`` fitted online from (work tokens, observed TTFT) samples.

    ``observe`` adds a sample and refits that replica (about 100 us); ``estimate`` returns the
    current fit. A replica with fewer than ``MIN_SAMPLES`` samples is taken to be typical of the
    fleet (the median fit of the replicas that have one) or, before any replica has one, the prior
    (``prior_tokens_per_s``, no overhead): a pessimistic guess would starve a new replica of the
    very requests that would teach the router its rate. The slope is the (upper) median of the
    pairwise slopes of the last ``WINDOW`` samples (pairs whose work differs by at least
    ``MIN_WORK_SPREAD``), clamped to 1/100..100x the prior; with no such pair (every sample the
    same size) it is the median of ``ttft / work``. The overhead is the median residual, at least
    0. A replica whose slope is within ``SAME_RATE_BAND`` of the fleet's median is reported as the
    fleet's median fit, slope and overhead (noise is no difference). Raises ``ValueError`` for a non-positive prior.
    """

    __slots__ = ("_fits", "_prior", "_samples", "_typical")

    def __init__(self, prior_tokens_per_s: float = DEFAULT_PRIOR_TOKENS_PER_S) -> None:
        if not prior_tokens_per_s > 0:
            raise ValueError("prior_tokens_per_s must be positive")
        self._prior = RateEstimate(1.0 / prior_tokens_per_s)
        self._samples: dict[str, deque[tuple[float, float]]] = {}  # {replica_id: (work, ttft_s)}
        self._fits: dict[str, RateEstimate] = {}  # {replica_id: fit of its samples}
        self._typical = self._prior  # median fit over ``_fits`` (the prior while there is none)

    @property
    def prior(self) -> RateEstimate:
        return self._prior

    def estimate(self, replica_id: str) -> RateEstimate:
        fit = self._fits.get(replica_id)
        if fit is None:
            return self._typical
        typical = self._typical.s_per_token
        if typical / SAME_RATE_BAND < fit.s_per_token < typical * SAME_RATE_BAND:
            # like the fleet: its overhead too is the fleet's (a per-replica intercept is the
            # noisiest part of the fit, and it alone would decide between like replicas)
            return RateEstimate(typical, self._typical.overhead_s, fit.num_samples)
        return fit

    def fitted(self, replica_id: str) -> RateEstimate | None:
        """The replica's own fit, before ``estimate`` equates it with the fleet's median."""
        return self._fits.get(replica_id)

    def forget(self, replica_id: str) -> None:
        """Drop a replica's samples (it restarted or left the fleet)."""
        self._samples.pop(replica_id, None)
        if self._fits.pop(replica_id, None) is not None:
            self._update_typical()

    def _update_typical(self) -> None:
        if not self._fits:
            self._typical = self._prior
            return
        fits = self._fits.values()
        self._typical = RateEstimate(median(f.s_per_token for f in fits),
                                     median(f.overhead_s for f in fits), 0)

    def observe(self, replica_id: str, work_tokens: float, ttft_s: float) -> None:
        """One request's predicted work and its observed dispatch-to-first-token seconds.
        Samples with non-positive or non-finite values are ignored."""
        if not (work_tokens > 0 and ttft_s > 0 and math.isfinite(work_tokens)
                and math.isfinite(ttft_s)):
            return
        samples = self._samples.get(replica_id)
        if samples is None:
            samples = self._samples[replica_id] = deque(maxlen=WINDOW)
        samples.append((float(work_tokens), float(ttft_s)))
        if len(samples) >= MIN_SAMPLES:
            self._fits[replica_id] = self._fit(samples)
            self._update_typical()

    def _fit(self, samples: deque[tuple[float, float]]) -> RateEstimate:
        # (runs once per streamed answer: the pairs come from index arrays cached per sample
        # count, not from two n x n arrays and a triangular mask; the same slopes, in the same
        # order, so the same median)
        n = len(samples)
        work = np.fromiter((w for w, _ in samples), float, n)
        ttft = np.fromiter((t for _, t in samples), float, n)
        first, second = _pairs(n)
        dw = work[second] - work[first]
        usable = np.abs(dw) > MIN_WORK_SPREAD * np.maximum(work[second], work[first])
        if usable.any():
            slopes = (ttft[second] - ttft[first])[usable] / dw[usable]
            slope = float(np.partition(slopes, len(slopes) // 2)[len(slopes) // 2])
        else:
            slope = median(t / w for w, t in samples)
        prior = self._prior.s_per_token
        slope = min(max(slope, prior / 100.0), prior * 100.0)
        overhead = max(median(t - slope * w for w, t in samples), 0.0)
        return RateEstimate(slope, overhead, n)


@functools.lru_cache(maxsize=WINDOW + 1)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs (i, j), i < j, of ``n`` samples in row-major order (``np.triu``'s)."""
    return np.triu_indices(n, k=1)
