"""KV-cache capacity and prefix-hit arithmetic of one model on one GPU (the seed's step 1). Pure.

``model_shape_from_config`` reads a transformers ``PretrainedConfig`` (the
caller loads it with ``AutoConfig``); ``plan`` turns a ``ModelShape`` and a
``GpuBudget`` into the figures an operator needs before deciding how much of
the KV pool to spend on retained prefixes:

* KV bytes per token, ``2 (K and V) x layers x KV heads x head_dim x dtype
  bytes``: GQA-aware because it counts KV heads, not query heads (vLLM
  ``FullAttentionSpec.page_size_bytes`` per token). MLA models (DeepSeek V2/V3:
  ``kv_lora_rank`` in the config) store one latent of ``kv_lora_rank +
  qk_rope_head_dim`` elements per layer and no separate V (vLLM
  ``MLAAttentionSpec``); sliding-window layers keep only the last
  ``sliding_window`` tokens, so no single per-token figure is right for them:
  ``plan`` then says so instead of printing a number (``kv_bytes_per_token``
  is ``None`` and ``notes`` explains);
* KV blocks per replica: ``(memory x gpu_memory_utilization x tp - weights) /
  (block_size x KV bytes per token)``, as vLLM sizes its pool (it also
  subtracts the activation peak it profiles, which this ignores);
* the HBM a shared prefix of T tokens holds (``ceil(T / block_size)`` blocks,
  the full ones reusable) and how many such prefixes fit in the pool;
* prefill FLOPs and time of a miss and of a hit: ``2 x params x n`` linear
  FLOPs plus causal attention ``4 x H x layers x n x (c + (n + 1) / 2)`` for
  ``n`` new tokens after ``c`` cached ones (``H`` = query heads x head_dim):
  for a cold prompt of N tokens that is the seed's ``2 x N^2 x H`` per layer,
  for a hit of C tokens its ``4 x (N - C) x N x H``.

Units: bytes, tokens, FLOPs, seconds; GPU memory in GB (1e9 bytes), as GPU
vendors state it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Final

DEFAULT_BLOCK_SIZE: Final = 16  # tokens; vLLM default
DEFAULT_GPU_MEMORY_UTILIZATION: Final = 0.9  # vLLM --gpu-memory-utilization default
DEFAULT_GPU_MEMORY_GB: Final = 80.0  # an H100 / A100-80GB
DEFAULT_TFLOPS: Final = 400.0  # sustained bf16 TFLOP/s on large prefills (the seed's assumption)
DEFAULT_PREFIX_TOKENS: Final = 12_000  # the seed's worked example: a 12,000-token contract
DEFAULT_SUFFIX_TOKENS: Final = 100  # ... and a 100-token question
KIB: Final = 1024
GIB: Final = 1024 ** 3

# bytes per element of a dtype as configs and vLLM's --kv-cache-dtype name them
DTYPE_BYTES: Final = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "int8": 1,
}


class CapacityError(ValueError):
    """A model shape or GPU budget that cannot be planned (bad or missing figures)."""


def dtype_bytes(name: str) -> int:
    """Bytes per element of ``name`` (``bfloat16``, ``fp8``, ...). Raises ``CapacityError``."""
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise CapacityError(f"unknown dtype {name!r}; one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the arithmetic needs of a decoder. ``params``: parameters (active per token for MoE
    FLOPs); ``weight_bytes``: bytes of all weights on the replica (``None``: params x
    ``weight_dtype_bytes``); ``mla_latent_dim``: ``kv_lora_rank + qk_rope_head_dim`` for MLA;
    ``sliding_layers``: layers with a sliding window of ``sliding_window`` tokens."""

    params: float
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2
    weight_dtype_bytes: int = 2
    weight_bytes: float | None = None
    weight_source: str = "params x dtype bytes"
    mla_latent_dim: int | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0
    name: str = "model"

    def __post_init__(self) -> None:
        for attr in ("params", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                     "kv_dtype_bytes", "weight_dtype_bytes"):
            if not getattr(self, attr) > 0:
                raise CapacityError(f"{attr} must be positive, got {getattr(self, attr)!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise CapacityError(f"query heads ({self.num_q_heads}) must be a multiple of KV "
                                f"heads ({self.num_kv_heads})")
        if not 0 <= self.sliding_layers <= self.num_layers:
            raise CapacityError("sliding_layers must be between 0 and num_layers")

    @property
    def query_width(self) -> int:
        """``H = q_heads x head_dim``, the attention width of the FLOP formula."""
        return self.num_q_heads * self.head_dim

    @property
    def kv_bytes_per_layer_token(self) -> int:
        """KV bytes of one token in one layer (K and V, or the MLA latent)."""
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim * self.kv_dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int | None:
        """KV bytes of one token over all layers; ``None`` with sliding-window layers (their KV
        does not grow with the prompt past the window, so no per-token figure is right)."""
        if self.sliding_layers:
            return None
        return self.num_layers * self.kv_bytes_per_layer_token

    @property
    def total_weight_bytes(self) -> float:
        return self.weight_bytes if self.weight_bytes is not None else (
            self.params * self.weight_dtype_bytes)


@dataclass(frozen=True, slots=True)
class GpuBudget:
    """One replica's accelerators: ``memory_gb`` per GPU (1e9 bytes), the fraction vLLM may use,
    tensor-parallel GPUs (weights and KV are split over them), sustained TFLOP/s per GPU."""

    memory_gb: float = DEFAULT_GPU_MEMORY_GB
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tensor_parallel_size: int = 1
    tflops: float = DEFAULT_TFLOPS
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if not self.memory_gb > 0 or not self.tflops > 0:
            raise CapacityError("GPU memory and TFLOP/s must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise CapacityError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.block_size < 1:
            raise CapacityError("tensor_parallel_size and block_size must be >= 1")


def prefill_flops(shape: ModelShape, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
    """FLOPs to prefill ``num_new_tokens`` after ``num_cached_tokens`` whose KV is cached:
    ``2 P n + 4 H layers n (c + (n + 1) / 2)`` (the seed: linear work per token, causal
    attention of each new token against the cached ones and the new ones before it)."""
    n, c = num_new_tokens, num_cached_tokens
    return 2.0 * shape.params * n + 4.0 * shape.query_width * shape.num_layers * n * (
        c + (n + 1) / 2.0)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The figures of ``plan``; ``None`` where the model's attention makes a figure wrong (see
    ``notes``). JSON-ready through ``as_dict``."""

    model: dict[str, Any]
    gpu: dict[str, Any]
    kv_bytes_per_token: int | None
    kv_bytes_per_block: int | None
    kv_formula: str
    weight_bytes: float
    kv_budget_bytes: float
    num_gpu_blocks: int | None
    kv_capacity_tokens: int | None
    prefix_tokens: int
    prefix_blocks: int  # blocks the prefix occupies (the last may be partial)
    prefix_reusable_tokens: int  # full blocks only are cached (vLLM)
    prefix_bytes: int | None
    prefix_pool_fraction: float | None
    prefixes_that_fit: int | None
    suffix_tokens: int
    miss_prefill_flops: float
    miss_prefill_s: float
    hit_prefill_flops: float
    hit_prefill_s: float
    saved_flops: float
    saved_s: float
    prefill_speedup: float
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kv_formula(shape: ModelShape) -> tuple[str, list[str]]:
    """How ``shape``'s KV bytes per token are made up, and the notes its attention needs (MLA's
    latent, sliding-window layers)."""
    notes: list[str] = []
    if shape.mla_latent_dim is not None:
        formula = (f"layers {shape.num_layers} x MLA latent {shape.mla_latent_dim} "
                   f"(kv_lora_rank + qk_rope_head_dim) x {shape.kv_dtype_bytes} bytes")
        notes.append("MLA: vLLM caches one compressed latent per token and layer (no separate K "
                     "and V, no per-head copies), so the figure is not 2 x KV heads x head_dim")
    else:
        formula = (f"2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                   f"{shape.head_dim} x {shape.kv_dtype_bytes} bytes")
    if shape.sliding_layers:
        full_layers = shape.num_layers - shape.sliding_layers
        notes.append(
            f"sliding window: {shape.sliding_layers} of {shape.num_layers} layers keep only the "
            f"last {shape.sliding_window} tokens, so KV does not grow linearly with the prompt and "
            f"no per-token figure, block count or prefix size from it would be right; the "
            f"{full_layers} full-attention layers alone take "
            f"{full_layers * shape.kv_bytes_per_layer_token:,} bytes per token")
    return formula, notes


def plan(shape: ModelShape, gpu: GpuBudget, prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
         suffix_tokens: int = DEFAULT_SUFFIX_TOKENS) -> CapacityPlan:
    """Capacity of one replica and what a hit on a ``prefix_tokens`` shared prefix followed by
    ``suffix_tokens`` new tokens saves. Raises ``CapacityError`` for negative token counts."""
    if prefix_tokens < 0 or suffix_tokens < 1:
        raise CapacityError("prefix tokens must be >= 0 and suffix tokens >= 1")
    formula, notes = _kv_formula(shape)
    b = gpu.block_size
    per_token = shape.kv_bytes_per_token
    weights = shape.total_weight_bytes
    budget = gpu.memory_gb * 1e9 * gpu.gpu_memory_utilization * gpu.tensor_parallel_size - weights
    if budget <= 0:
        notes.append(f"the weights ({weights / 1e9:.1f} GB) leave no room for KV at "
                     f"{gpu.gpu_memory_utilization:g} of {gpu.memory_gb:g} GB x "
                     f"{gpu.tensor_parallel_size} GPU(s)")
    block_bytes = per_token * b if per_token is not None else None
    num_blocks = int(budget // block_bytes) if block_bytes and budget > 0 else None
    prefix_blocks = -(-prefix_tokens // b)
    reusable = prefix_tokens // b * b
    prefix_bytes = prefix_blocks * block_bytes if block_bytes is not None else None
    fraction = prefix_blocks / num_blocks if num_blocks else None
    fit = num_blocks // prefix_blocks if num_blocks is not None and prefix_blocks else None
    rate = gpu.tflops * 1e12 * gpu.tensor_parallel_size
    miss = prefill_flops(shape, prefix_tokens + suffix_tokens)
    # a hit covers the prefix's full blocks, capped so the last prompt token still runs
    cached = min(reusable, (prefix_tokens + suffix_tokens - 1) // b * b)
    hit = prefill_flops(shape, prefix_tokens + suffix_tokens - cached, cached)
    if prefix_tokens % b:
        notes.append(f"the prefix ends {prefix_tokens % b} tokens past a block boundary: those "
                     f"tokens are recomputed on every hit (only full blocks are cached)")
    return CapacityPlan(
        model={"name": shape.name, "params": shape.params, "num_layers": shape.num_layers,
               "num_q_heads": shape.num_q_heads, "num_kv_heads": shape.num_kv_heads,
               "head_dim": shape.head_dim, "kv_dtype_bytes": shape.kv_dtype_bytes,
               "mla_latent_dim": shape.mla_latent_dim, "sliding_window": shape.sliding_window,
               "sliding_layers": shape.sliding_layers, "weight_source": shape.weight_source},
        gpu={"memory_gb": gpu.memory_gb, "gpu_memory_utilization": gpu.gpu_memory_utilization,
             "tensor_parallel_size": gpu.tensor_parallel_size, "tflops": gpu.tflops,
             "block_size": b},
        kv_bytes_per_token=per_token, kv_bytes_per_block=block_bytes, kv_formula=formula,
        weight_bytes=weights, kv_budget_bytes=budget, num_gpu_blocks=num_blocks,
        kv_capacity_tokens=num_blocks * b if num_blocks is not None else None,
        prefix_tokens=prefix_tokens, prefix_blocks=prefix_blocks, prefix_reusable_tokens=reusable,
        prefix_bytes=prefix_bytes, prefix_pool_fraction=fraction, prefixes_that_fit=fit,
        suffix_tokens=suffix_tokens, miss_prefill_flops=miss, miss_prefill_s=miss / rate,
        hit_prefill_flops=hit, hit_prefill_s=hit / rate, saved_flops=miss - hit,
        saved_s=(miss - hit) / rate, prefill_speedup=miss / hit, notes=notes)


def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def model_shape_from_config(config: Any, *, weight_bytes: float | None = None,
                            weight_source: str | None = None, kv_dtype: str | None = None,
                            params: float | None = None) -> ModelShape:
    """A ``ModelShape`` from a transformers config (``AutoConfig.from_pretrained(dir)``).

    Reads ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``
    (default: the query heads, i.e. no GQA), ``head_dim`` (default ``hidden_size /
    heads``), ``torch_dtype``, ``kv_lora_rank`` + ``qk_rope_head_dim`` (MLA),
    ``sliding_window`` with ``use_sliding_window`` / ``layer_types``. Multimodal configs
    use their ``text_config``. ``params`` (active per token) is estimated from the shape
    when not given: embeddings, attention projections and a gated MLP per layer (MoE:
    ``num_experts_per_tok`` experts active, all ``num_experts`` counted in the weights).
    ``kv_dtype``: vLLM ``--kv-cache-dtype`` (``auto`` = the model dtype).
    Raises ``CapacityError`` when a figure is missing.
    """
    text = getattr(config, "text_config", None) or config
    layers = _get(text, "num_hidden_layers", "n_layer", "num_layers")
    q_heads = _get(text, "num_attention_heads", "n_head")
    hidden = _get(text, "hidden_size", "n_embd", "d_model")
    if layers is None or q_heads is None or hidden is None:
        raise CapacityError("the config lacks num_hidden_layers, num_attention_heads or "
                            "hidden_size; give the shape with flags instead")
    kv_heads = _get(text, "num_key_value_heads", "num_kv_heads") or q_heads
    head_dim = _get(text, "head_dim") or hidden // q_heads
    dtype = _get(text, "torch_dtype", "dtype") or _get(config, "torch_dtype", "dtype") or "bfloat16"
    weight_dtype = dtype_bytes(str(dtype))
    kv_bytes = weight_dtype if kv_dtype in (None, "auto") else dtype_bytes(kv_dtype)
    mla = None
    if _get(text, "kv_lora_rank") is not None:
        mla = int(text.kv_lora_rank) + int(_get(text, "qk_rope_head_dim") or 0)
        # the query/key head width of MLA (for attention FLOPs): nope + rope parts
        head_dim = (int(_get(text, "qk_nope_head_dim") or 0)
                    + int(_get(text, "qk_rope_head_dim") or 0)) or head_dim
    window = _get(text, "sliding_window")
    sliding = 0
    layer_types = _get(text, "layer_types")
    if layer_types:
        sliding = sum(1 for t in layer_types if "sliding" in str(t))
    elif window and getattr(text, "use_sliding_window", True) is not False:
        # Qwen2-style configs: layers from max_window_layers on use the window; others all do
        first = _get(text, "max_window_layers")
        sliding = int(layers) - min(int(first), int(layers)) if first is not None else int(layers)
    if not sliding:
        window = None
    if params is None:
        params = _estimate_params(text, int(layers), int(q_heads), int(kv_heads), int(head_dim),
                                  int(hidden))
    total_params = _estimate_params(text, int(layers), int(q_heads), int(kv_heads),
                                    int(head_dim), int(hidden), all_experts=True)
    if weight_bytes is None:
        weight_bytes = total_params * weight_dtype
        weight_source = "estimated from config.json shape"
    name = _get(config, "_name_or_path") or _get(config, "model_type") or "model"
    return ModelShape(params=float(params), num_layers=int(layers), num_q_heads=int(q_heads),
                      num_kv_heads=int(kv_heads), head_dim=int(head_dim), kv_dtype_bytes=kv_bytes,
                      weight_dtype_bytes=weight_dtype, weight_bytes=weight_bytes,
                      weight_source=weight_source or "given", mla_latent_dim=mla,
                      sliding_window=int(window) if window else None, sliding_layers=sliding,
                      name=str(name))


def _estimate_params(text: Any, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                     hidden: int, all_experts: bool = False) -> float:
    """Parameters from the shape: embeddings (twice unless tied), q/k/v/o projections and a
    gated MLP (3 x hidden x intermediate) per layer; MoE layers count active or all experts."""
    vocab = int(_get(text, "vocab_size") or 0)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    embed = vocab * hidden * (1 if tied else 2)
    attention = hidden * head_dim * (2 * q_heads + 2 * kv_heads)
    intermediate = int(_get(text, "intermediate_size", "n_inner") or 4 * hidden)
    experts = _get(text, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        active = int(_get(text, "num_experts_per_tok") or 1)
        moe_inter = int(_get(text, "moe_intermediate_size") or intermediate)
        shared = int(_get(text, "n_shared_experts") or 0)
        mlp = 3 * hidden * moe_inter * ((int(experts) if all_experts else active) + shared)
    else:
        mlp = 3 * hidden * intermediate
    return float(embed + layers * (attention + mlp))


def format_plan(p: CapacityPlan) -> str:
    """The plan as the text ``prefix-router capacity`` prints."""
    m, g = p.model, p.gpu
    b = g["block_size"]
    lines = [f"model: {m['name']}: {m['params'] / 1e9:.1f}B params, {m['num_layers']} layers, "
             f"{m['num_q_heads']} query heads, {m['num_kv_heads']} KV heads x {m['head_dim']}, "
             f"KV {m['kv_dtype_bytes']} bytes/element"]
    if p.kv_bytes_per_token is not None:
        lines.append(f"KV per token: {p.kv_bytes_per_token:,} bytes "
                     f"({_size(p.kv_bytes_per_token)}) = {p.kv_formula}")
        assert p.kv_bytes_per_block is not None
        lines.append(f"KV per block of {b} tokens: {_size(p.kv_bytes_per_block)}")
    else:
        lines.append("KV per token: not computed (see notes)")
    lines.append(f"weights: {p.weight_bytes / 1e9:.1f} GB ({m['weight_source']})")
    if p.num_gpu_blocks is not None:
        lines.append(
            f"replica: {g['memory_gb']:g} GB x {g['gpu_memory_utilization']:g} x "
            f"{g['tensor_parallel_size']} GPU(s) - weights = {p.kv_budget_bytes / 1e9:.1f} GB for KV"
            f" -> {p.num_gpu_blocks:,} blocks ({p.kv_capacity_tokens:,} tokens)")
    lines.append(f"shared prefix of {p.prefix_tokens:,} tokens: {p.prefix_blocks:,} blocks "
                 f"({p.prefix_reusable_tokens:,} tokens reusable)"
                 + (f", {p.prefix_bytes / GIB:.2f} GiB of HBM" if p.prefix_bytes is not None else ""))
    if p.prefixes_that_fit is not None and p.prefix_pool_fraction is not None:
        lines.append(f"  {p.prefix_pool_fraction:.1%} of the replica's KV pool; "
                     f"{p.prefixes_that_fit:,} such prefixes fit")
    lines.append(f"prefill at {g['tflops']:g} TFLOP/s per GPU, {p.suffix_tokens:,}-token suffix:")
    lines.append(f"  miss: {p.prefix_tokens + p.suffix_tokens:,} tokens, "
                 f"{p.miss_prefill_flops:.2e} FLOPs, {_seconds(p.miss_prefill_s)}")
    lines.append(f"  hit:  {p.prefix_tokens + p.suffix_tokens - p.prefix_reusable_tokens:,} new "
                 f"tokens after {p.prefix_reusable_tokens:,} cached, {p.hit_prefill_flops:.2e} "
                 f"FLOPs, {_seconds(p.hit_prefill_s)}")
    lines.append(f"  a hit saves {p.saved_flops:.2e} FLOPs and {_seconds(p.saved_s)} of prefill "
                 f"({p.prefill_speedup:.0f}x; small prefills rarely reach peak throughput)")
    lines.extend(f"note: {note}" for note in p.notes)
    return "\n".join(lines)


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", KIB)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if math.isclose(value, round(value)) else f"{value:.2f} {unit}"
    return f"{num_bytes:.0f} bytes"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"
