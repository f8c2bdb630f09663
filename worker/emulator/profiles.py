"""Model and GPU profiles, and the step latency model of the engine emulator. Pure: no I/O.

The emulator does not run a model; it charges each scheduler step the time an
accelerator would need for it, from first principles (``../shared/seed-prefix-caching.txt``):

* prefill of ``n`` new tokens whose context starts at ``c`` (tokens already in
  the KV cache, from a prefix hit or an earlier chunk) costs
  ``2 * params * n`` linear FLOPs plus causal attention
  ``4 * H * layers * n * (c + (n + 1) / 2)`` FLOPs, ``H = q_heads * head_dim``
  (QK^T and AV, 2 FLOPs per multiply-add each, every new token against the
  ``c`` cached tokens and the new ones before it). For a cold prompt of ``N``
  tokens the attention term is the seed's ``2 * N^2 * H`` per layer; for a hit
  of ``C`` tokens the suffix still pays about ``4 * (N - C) * N * H`` per layer.
* a decode token costs ``2 * params`` linear FLOPs plus ``4 * H * layers * ctx``;
* every step reads the weights once and the KV cache of every scheduled request
  once (``kv_bytes_per_token * context``), and writes the new tokens' KV.

A step takes ``max(compute_s, memory_s) + step_overhead_s`` (a roofline: a
step is bound by whichever of tensor-core FLOPs and HBM bandwidth it exhausts;
large prefills are compute bound, decode batches memory bound). Times are
engine seconds; the app divides them by ``--time-scale`` to get wall time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

DEFAULT_GPU_MEMORY_UTILIZATION: Final = 0.9  # fraction of HBM vLLM may use; vLLM default


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A dense decoder's shape. Default: an 8B-class model shaped like Llama-3-8B.

    ``params`` parameters; ``num_layers``; ``num_q_heads`` and ``num_kv_heads``
    (GQA); ``head_dim``; ``kv_dtype_bytes`` bytes per KV element (2 = bf16);
    ``weight_dtype_bytes`` bytes per weight (2 = bf16).
    """

    params: float = 8.0e9
    num_layers: int = 32
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_dtype_bytes: int = 2
    weight_dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("params", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                     "kv_dtype_bytes", "weight_dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model profile {name} must be positive")

    @property
    def query_width(self) -> int:
        """``H = q_heads * head_dim``: the attention width the FLOP formulas use."""
        return self.num_q_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``2 * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """An accelerator. Default: H100-class (80 GB HBM, ~400 TFLOP/s sustained bf16 on
    large prefills, ~3000 GB/s sustained HBM bandwidth)."""

    tflops: float = 400.0  # sustained TFLOP/s
    hbm_gbps: float = 3000.0  # sustained GB/s
    memory_gb: float = 80.0  # HBM capacity, GB (1e9 bytes)
    # Sustained host<->GPU copy bandwidth per direction, GB/s: PCIe Gen5 x16 moves 64 GB/s
    # raw, about 50 GB/s from pinned host memory (the CPU tier's loads and stores).
    host_link_gbps: float = 50.0

    def __post_init__(self) -> None:
        if (self.tflops <= 0 or self.hbm_gbps <= 0 or self.memory_gb <= 0
                or self.host_link_gbps <= 0):
            raise ValueError("GPU profile figures must be positive")


def default_num_gpu_blocks(
    model: ModelProfile,
    gpu: GpuProfile,
    block_size: int,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> int:
    """KV blocks that fit next to the weights: ``(memory * utilization - weights) / block bytes``.

    vLLM sizes its pool the same way (minus activation peaks it profiles, which
    we ignore). 8B bf16 on 80 GB: (72 GB - 16 GB) / 2 MiB = 26,702 blocks of 16
    tokens (427k tokens). Raises ``ValueError`` if the weights do not fit.
    """
    budget = gpu.memory_gb * 1e9 * gpu_memory_utilization - model.weight_bytes
    block_bytes = model.kv_bytes_per_token * block_size
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise ValueError("the model's weights leave no room for KV blocks on this GPU profile")
    return blocks


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Engine-time cost of scheduler steps for one (model, GPU) pair. Immutable."""

    model: ModelProfile = field(default_factory=ModelProfile)
    gpu: GpuProfile = field(default_factory=GpuProfile)
    step_overhead_s: float = 0.0  # fixed per-step cost (scheduling, launch), engine seconds

    def prefill_flops(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """FLOPs to prefill ``num_new_tokens`` after ``num_context_tokens`` cached ones."""
        m = self.model
        n, c = num_new_tokens, num_context_tokens
        linear = 2.0 * m.params * n
        attention = 4.0 * m.query_width * m.num_layers * n * (c + (n + 1) / 2.0)
        return linear + attention

    def step_time_s(
        self,
        prefills: Sequence[tuple[int, int]],
        num_decodes: int,
        decode_context_tokens: int,
    ) -> float:
        """Engine seconds of one step.

        ``prefills``: ``(num_new_tokens, num_context_tokens)`` per prefill chunk;
        ``num_decodes``: requests decoding one token; ``decode_context_tokens``:
        the sum of their context lengths (tokens whose KV they read).
        """
        m = self.model
        flops = 0.0
        kv_tokens_touched = decode_context_tokens + num_decodes
        for new, ctx in prefills:
            flops += self.prefill_flops(new, ctx)
            kv_tokens_touched += new + ctx
        flops += 2.0 * m.params * num_decodes
        flops += 4.0 * m.query_width * m.num_layers * decode_context_tokens
        compute_s = flops / (self.gpu.tflops * 1e12)
        memory_s = (m.weight_bytes + m.kv_bytes_per_token * kv_tokens_touched) / (
            self.gpu.hbm_gbps * 1e9
        )
        return max(compute_s, memory_s) + self.step_overhead_s

    def decode_step_time_s(self, num_decodes: int, decode_context_tokens: int) -> float:
        """``step_time_s([], num_decodes, decode_context_tokens)`` without the prefill loop:
        a decode burst asks this once per step it plans."""
        m = self.model
        flops = 2.0 * m.params * num_decodes + (
            4.0 * m.query_width * m.num_layers * decode_context_tokens)
        memory_s = (m.weight_bytes + m.kv_bytes_per_token * (decode_context_tokens + num_decodes)
                    ) / (self.gpu.hbm_gbps * 1e9)
        return max(flops / (self.gpu.tflops * 1e12), memory_s) + self.step_overhead_s

    def decode_burst_durations_s(self, num_decodes: int, decode_context_tokens: int,
                                 first_s: float, max_steps: int, limit_s: float) -> list[float]:
        """Engine seconds of each step of a decode burst: ``first_s`` (its first step's), then
        ``decode_step_time_s(num_decodes, decode_context_tokens + k * num_decodes)`` for steps
        k = 1, 2, ... while there are fewer than ``max_steps`` and the burst so far is under
        ``limit_s``. The same floats as those calls (the same operations in the same order),
        with the profiles' figures read once per burst instead of once per step."""
        m = self.model
        decode_flops = 2.0 * m.params * num_decodes
        context_flops = 4.0 * m.query_width * m.num_layers
        weight_bytes = m.weight_bytes
        kv_bytes = m.kv_bytes_per_token
        hbm_bytes_s = self.gpu.hbm_gbps * 1e9
        flops_s = self.gpu.tflops * 1e12
        overhead = self.step_overhead_s
        durations = [first_s]
        burst_s = first_s
        context = decode_context_tokens
        while len(durations) < max_steps and burst_s < limit_s:
            context += num_decodes
            memory_s = (weight_bytes + kv_bytes * (context + num_decodes)) / hbm_bytes_s
            duration = max((decode_flops + context_flops * context) / flops_s, memory_s) + overhead
            durations.append(duration)
            burst_s += duration
        return durations

    def prefill_time_s(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float:
        """Engine seconds to prefill one prompt alone in one step (the seed's arithmetic)."""
        return self.step_time_s([(num_prompt_tokens - num_cached_tokens, num_cached_tokens)], 0, 0)
