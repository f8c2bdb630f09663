"""``prefix-router`` command line: ``hash`` (debug hash agreement), ``capacity`` (KV arithmetic of a
model), ``audit`` (prompt-template audit of a request file) and ``serve`` (the router).

CLI edge: parses arguments, prints results, maps errors to exit codes.
"""

from __future__ import annotations

from router.shared.interrupt import exit_on_interrupt

with exit_on_interrupt():  # Ctrl-C while these load: exit 130, no traceback
    import argparse
    import dataclasses
    import json
    import sys
    from collections.abc import Sequence
    from pathlib import Path
    from typing import Any, NoReturn

    from router.decision import capacity
    from router.shared.hashing import (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_HASH_ALGO,
        HASH_ALGOS,
        BlockHasher,
        HashConfigError,
        MultiModalItem,
        block_key,
    )
    from router.shared.process import run_commands
    from router.shared.settings import usage_error_line
    from router.shared.version import version_line

class UsageError(ValueError):
    """Bad command-line input; reported as one line on stderr with exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr (exit 2), not a usage block, and
    takes ``--version`` like every command of the project (its subcommands' parsers too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=version_line("prefix-router"))

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {usage_error_line(self, message)}\n")


def _parse_mm(spec: str) -> MultiModalItem:
    parts = spec.rsplit(":", 2)
    if len(parts) != 3:
        raise UsageError(f"--mm expects ID:OFFSET:LENGTH, got {spec!r}")
    identifier, offset, length = parts
    try:
        item = MultiModalItem(identifier, int(offset), int(length))
    except ValueError as exc:
        raise UsageError(f"--mm expects integer OFFSET and LENGTH, got {spec!r}") from exc
    if not identifier or item.offset < 0 or item.length < 1:
        raise UsageError(f"--mm expects a non-empty ID, OFFSET >= 0 and LENGTH >= 1, got {spec!r}")
    return item


def _parse_tokens(text: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"tokens are not valid JSON: {exc.msg} at position {exc.pos}") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer beyond Python's digit limit
        raise UsageError(f"tokens are not a usable JSON array: {exc}") from exc
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise UsageError("tokens must be a JSON array of non-negative integers")
    return value


def _hash_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="prefix-router hash",
        description="Print vLLM's block hashes of a token-id prompt: one line per full block, "
        "'<hex digest> <64-bit event key>'.",
    )
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block")
    parser.add_argument("--hash-algo", default=DEFAULT_HASH_ALGO, help=f"one of {', '.join(HASH_ALGOS)}")
    parser.add_argument("--hash-seed", default=None, help="the engines' PYTHONHASHSEED value, if set")
    parser.add_argument("--cache-salt", default=None, help="request cache_salt (block 0 only)")
    parser.add_argument("--lora-name", default=None)
    parser.add_argument("--lora-path", default=None)
    parser.add_argument("--mm", action="append", default=[], metavar="ID:OFFSET:LENGTH",
                        help="multimodal item (repeatable), in prompt order")
    parser.add_argument("--tokens", default=None, help="JSON array of token ids (default: stdin)")
    return parser


def run_hash(argv: Sequence[str]) -> int:
    """The ``hash`` subcommand. Returns the process exit code."""
    parser = _hash_parser()
    args = parser.parse_args(argv)
    try:
        if (args.lora_name is None) != (args.lora_path is None):
            raise UsageError("--lora-name and --lora-path must be given together")
        mm_items = [_parse_mm(spec) for spec in args.mm]
        hasher = BlockHasher(args.block_size, args.hash_algo, args.hash_seed)
        tokens = _parse_tokens(args.tokens if args.tokens is not None else sys.stdin.read())
        lora = (args.lora_name, args.lora_path) if args.lora_name is not None else None
        digests = hasher.digests(tokens, lora=lora, cache_salt=args.cache_salt, mm_items=mm_items)
    except (UsageError, HashConfigError) as exc:
        print(f"prefix-router hash: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{d.hex()} {block_key(d)}\n" for d in digests))
    return 0


def _capacity_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="prefix-router capacity",
        description="KV bytes per token, KV blocks per replica, the HBM a shared prefix holds and "
        "the prefill a hit saves, from a model directory's config.json and/or shape flags "
        "(flags override the config).")
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="directory with config.json (and *.safetensors for the weight size)")
    shape = parser.add_argument_group("model shape (instead of, or over, config.json)")
    shape.add_argument("--params", type=float, default=None,
                       help="parameters active per token, e.g. 14e9")
    shape.add_argument("--layers", type=int, default=None)
    shape.add_argument("--q-heads", type=int, default=None)
    shape.add_argument("--kv-heads", type=int, default=None)
    shape.add_argument("--head-dim", type=int, default=None)
    shape.add_argument("--dtype", default=None, help="weight dtype (default: config, else bf16)")
    shape.add_argument("--kv-cache-dtype", default="auto",
                       help="vLLM --kv-cache-dtype: auto (the model dtype), fp8, bf16, ...")
    shape.add_argument("--weights-gb", type=float, default=None,
                       help="weight bytes on the replica in GB (default: safetensors files, "
                       "else params x dtype)")
    gpu = parser.add_argument_group("GPU and workload")
    gpu.add_argument("--gpu-memory-gb", type=float, default=capacity.DEFAULT_GPU_MEMORY_GB)
    gpu.add_argument("--gpu-memory-utilization", type=float,
                     default=capacity.DEFAULT_GPU_MEMORY_UTILIZATION)
    gpu.add_argument("--tensor-parallel-size", type=int, default=1)
    gpu.add_argument("--tflops", type=float, default=capacity.DEFAULT_TFLOPS,
                     help="sustained TFLOP/s per GPU on large prefills")
    gpu.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    gpu.add_argument("--prefix-tokens", type=int, default=capacity.DEFAULT_PREFIX_TOKENS,
                     help="length of the shared prefix (system prompt, document)")
    gpu.add_argument("--suffix-tokens", type=int, default=capacity.DEFAULT_SUFFIX_TOKENS,
                     help="new tokens after it (the question)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _safetensors_bytes(model_dir: Path) -> float | None:
    """Weight bytes of a model directory: the safetensors index's ``total_size``, else the sum
    of its ``*.safetensors`` file sizes (tensor data plus small headers); ``None`` if neither."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if isinstance(total, int | float) and total > 0:
            return float(total)
    files = list(model_dir.glob("*.safetensors"))
    return float(sum(f.stat().st_size for f in files)) if files else None


def _capacity_shape(args: argparse.Namespace) -> capacity.ModelShape:
    weights = args.weights_gb * 1e9 if args.weights_gb is not None else None
    source = "--weights-gb" if weights is not None else None
    if args.model_dir is not None:
        model_dir = Path(args.model_dir)
        if not model_dir.exists():
            raise UsageError(f"{model_dir}: no such directory (give a model directory holding "
                             "config.json, or the shape flags)")
        if not model_dir.is_dir():
            raise UsageError(f"{model_dir} is not a directory (give the model directory "
                             "holding config.json)")
        if not (model_dir / "config.json").is_file():
            raise UsageError(f"{model_dir} has no config.json")
        from transformers import AutoConfig  # heavy import, only for a model directory

        try:
            config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
        if weights is None:
            weights = _safetensors_bytes(model_dir)
            source = "safetensors files" if weights is not None else None
        shape = capacity.model_shape_from_config(
            config, weight_bytes=weights, weight_source=source, kv_dtype=args.kv_cache_dtype,
            params=args.params)
        overrides = {name: value for name, value in (
            ("num_layers", args.layers), ("num_q_heads", args.q_heads),
            ("num_kv_heads", args.kv_heads), ("head_dim", args.head_dim)) if value is not None}
        if args.dtype is not None:
            overrides["weight_dtype_bytes"] = capacity.dtype_bytes(args.dtype)
        return dataclasses.replace(shape, **overrides) if overrides else shape
    missing = [flag for flag, value in (("--params", args.params), ("--layers", args.layers),
                                        ("--q-heads", args.q_heads), ("--kv-heads", args.kv_heads),
                                        ("--head-dim", args.head_dim)) if value is None]
    if missing:
        raise UsageError(f"give MODEL_DIR or all of {', '.join(missing)}")
    weight_dtype = capacity.dtype_bytes(args.dtype or "bfloat16")
    kv_dtype = (weight_dtype if args.kv_cache_dtype == "auto"
                else capacity.dtype_bytes(args.kv_cache_dtype))
    return capacity.ModelShape(
        params=args.params, num_layers=args.layers, num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, kv_dtype_bytes=kv_dtype,
        weight_dtype_bytes=weight_dtype, weight_bytes=weights,
        weight_source=source or "params x dtype bytes", name=f"{args.params / 1e9:g}B (flags)")


def run_capacity(argv: Sequence[str]) -> int:
    """The ``capacity`` subcommand. Returns the process exit code."""
    args = _capacity_parser().parse_args(argv)
    try:
        shape = _capacity_shape(args)
        gpu = capacity.GpuBudget(args.gpu_memory_gb, args.gpu_memory_utilization,
                                 args.tensor_parallel_size, args.tflops, args.block_size)
        result = capacity.plan(shape, gpu, args.prefix_tokens, args.suffix_tokens)
    except (UsageError, capacity.CapacityError) as exc:
        print(f"prefix-router capacity: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(capacity.format_plan(result))
    return 0


def _audit_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="prefix-router audit",
        description="The router's template audit over a file of requests: prefix families, "
        "near-miss prompts (variable content inside the first blocks), block-boundary waste and "
        "each family's hit rate with one ideal (unbounded) prefix cache.")
    parser.add_argument("file", help="JSONL: a Mooncake trace (the replay's input) or OpenAI "
                        "request bodies (completions 'prompt' or chat 'messages')")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer dir for text and decoding (default: the bundled Qwen3)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--top", type=int, default=10, help="families to list")
    parser.add_argument("--limit", type=int, default=None, help="read at most N requests")
    parser.add_argument("--head-tokens", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def read_request_file(path: Path, limit: int | None) -> list[tuple[str, Any]]:
    """A JSONL file of requests as ``[(kind, parsed)]``: ``("trace", line)`` for a Mooncake trace
    line (``hash_ids``), ``("completion" | "chat", body)`` for an OpenAI body (``prompt`` /
    ``messages``). Raises ``UsageError`` naming the first bad line, ``OSError`` if unreadable."""
    out: list[tuple[str, Any]] = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{number}: not JSON: {exc.msg}") from exc
            if isinstance(data, dict) and "hash_ids" in data:
                out.append(("trace", data))
            elif isinstance(data, dict) and ("messages" in data or "prompt" in data):
                out.append(("chat" if "messages" in data else "completion", data))
            else:
                raise UsageError(f"{path}:{number}: neither a Mooncake trace line nor an OpenAI "
                                 f"body with 'prompt' or 'messages'")
    return out


def run_audit(argv: Sequence[str]) -> int:
    """The ``audit`` subcommand. Returns the process exit code."""
    from router.observability.audit import PrefixAudit, format_report
    from router.request.prompts import (
        PromptError,
        PromptTokenizer,
        default_tokenizer_dir,
        parse_prompt,
    )

    args = _audit_parser().parse_args(argv)
    try:
        requests = read_request_file(Path(args.file), args.limit)
        hasher = BlockHasher(args.block_size)
        source = args.tokenizer or default_tokenizer_dir()
        tokenizer = PromptTokenizer(source) if source else None
        audit = PrefixAudit(args.block_size, tokenizer.backend.decode if tokenizer else None,
                            head_tokens=args.head_tokens)
        mapper = None
        cache: set[int] = set()  # one ideal prefix cache: every block key seen so far
        for kind, data in requests:
            salt = None
            if kind == "trace":
                if mapper is None:
                    from router.tools.trace_format import (  # the replay's mapping
                        TokenMapper,
                        parse_trace_line,
                    )

                    mapper = TokenMapper()
                tokens = mapper.request_prompt(parse_trace_line(json.dumps(data), 0))
            else:
                spec = parse_prompt(kind, data)
                if spec.token_ids is not None:
                    tokens = spec.token_ids
                elif tokenizer is None:
                    raise UsageError("text prompts need --tokenizer")
                else:
                    tokens = tokenizer.prompt_tokens(spec)
                salt = spec.cache_salt
            keys = hasher.keys(tokens, cache_salt=salt)
            hit = 0
            for key in keys[:(len(tokens) - 1) // args.block_size]:
                if key not in cache:
                    break
                hit += 1
            cache.update(keys)
            audit.observe(tokens, len(tokens), hit * args.block_size, tenant=salt)
    except (UsageError, HashConfigError, PromptError, OSError, ValueError) as exc:
        print(f"prefix-router audit: error: {exc}", file=sys.stderr)
        return 2
    report = audit.report(args.top)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_report(report))
    return 0


def run_auth(argv: Sequence[str]) -> int:
    """The ``auth`` subcommand: ``add-key TENANT`` prints a new random API key (to give the
    tenant) and its key-file line (to store); ``hash-key`` prints the stored form of a key read
    from stdin. Returns the process exit code."""
    from router.edges.auth import hash_key, new_key

    parser = _OneLineParser(prog="prefix-router auth",
                            description="API keys for the router's --api-keys file.")
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add-key", help="make a key for TENANT; prints the key, then the line "
                         "to append to the --api-keys file")
    add.add_argument("tenant")
    sub.add_parser("hash-key", help="print the stored form (sha256:HEX) of the key on stdin")
    args = parser.parse_args(argv)
    if args.action == "add-key":
        key = new_key()
        print(f"api key (give it to the tenant, it is not stored): {key}")
        print(f"{args.tenant} {hash_key(key)}")
        return 0
    key = sys.stdin.read().strip()
    if not key:
        print("prefix-router auth: error: no key on stdin", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


COMMANDS = {"hash": "print vLLM block hashes of a token prompt",
            "capacity": "KV capacity and prefix-hit arithmetic of a model on a GPU",
            "audit": "prompt-template audit of a file of requests",
            "auth": "make or hash API keys for --api-keys",
            "serve": "run the router"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-router``: ``run_commands`` (status 130 on Ctrl-C while loading)."""
    return run_commands("prefix-router", argv, COMMANDS, _run)


def _run(command: str, rest: list[str]) -> int:
    tool = {"hash": run_hash, "capacity": run_capacity, "auth": run_auth,
            "audit": run_audit}.get(command)
    if tool is not None:
        return tool(rest)
    from router.service.server import main as serve_main  # heavy imports only when serving

    return serve_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
