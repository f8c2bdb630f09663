"""The request checks of an emulated replica's OpenAI front end, as vLLM 0.33's serving code
makes them (``../shared/vllm-spec.md`` §4): the error type the client sees, cache salts, token
ids against the vocabulary, sampling parameters, context length and the model name. Pure but
for ``read_body``, which reads an aiohttp request's body.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from aiohttp import web

from worker.emulator.config import EmulatorConfig

MAX_CACHE_SALT_CHARS: Final = 128  # vLLM validate_cache_salt
FORBIDDEN_SALT_CHARS: Final = ("@", "/", "\\", "\x00")

_json_decode = msgspec.json.decode


class ApiError(Exception):
    """An error the client sees as vLLM's JSON error body with ``status``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def validate_cache_salt(salt: Any) -> str | None:
    """vLLM 0.33 ``validate_cache_salt``: None, or 1-128 chars without ``@ / \\ NUL``."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise bad_request("cache_salt must be a string", "cache_salt")
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must be between 1 and {MAX_CACHE_SALT_CHARS} characters",
                          "cache_salt")
    if any(c in salt for c in FORBIDDEN_SALT_CHARS):
        raise bad_request("cache_salt must not contain '@', '/', '\\' or NUL characters",
                          "cache_salt")
    return salt


def check_vocab(token_ids: list[int], vocab_size: int) -> None:
    """Reject a prompt with an id >= ``vocab_size``: ApiError 400, param ``prompt``.

    vLLM 0.33 ``Processor._validate_model_input``: ``max(prompt_ids)`` above the largest
    valid id raises ``ValueError(f"Token id {max_input_id} is out of vocabulary")``, which the
    OpenAI server returns as a 400 BadRequestError.
    """
    top = max(token_ids)
    if top >= vocab_size:
        raise bad_request(f"Token id {top} is out of vocabulary", "prompt")


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        type(t) is int for t in value)


@functools.cache
def _valid_ids_type(vocab_size: int) -> Any:
    """``list[int]`` with every id in ``[0, vocab_size)``, for msgspec.convert (one pass in C)."""
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def valid_token_ids(value: Any, vocab_size: int) -> bool:
    """True if ``value`` is a non-empty list of ints in ``[0, vocab_size)`` (bools and floats
    are not ints). The common case, checked in C; the caller falls back to the per-item checks
    of ``PromptInput.completion_prompts`` for the error message when it is False."""
    if not isinstance(value, list) or not value:
        return False
    try:
        msgspec.convert(value, _valid_ids_type(vocab_size), strict=True)
    except msgspec.ValidationError:
        return False
    return True


@dataclass(slots=True)
class GenerationParams:
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None
    n: int


def generation_params(data: dict[str, Any], chat: bool) -> GenerationParams:
    """The sampling parameters of a completions (``chat`` False) or chat completions body.
    Raises ApiError 400 as vLLM's request models reject them."""
    max_tokens = data.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    if max_tokens is not None and type(max_tokens) is not int:
        raise bad_request("max_tokens must be an integer, got " + repr(max_tokens), "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("max_tokens must be at least 1, got " + repr(max_tokens), "max_tokens")
    n = data.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int or n < 1:
        raise bad_request("n must be at least 1", "n")
    stream = bool(data.get("stream", False))
    options = data.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.",
                              "stream_options")
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
    include_usage = bool(options.get("include_usage")) if options else False
    return GenerationParams(
        max_tokens=max_tokens, ignore_eos=bool(data.get("ignore_eos", False)), stream=stream,
        include_usage=include_usage, cache_salt=validate_cache_salt(data.get("cache_salt")),
        n=n)


def api_params(data: dict[str, Any], field: str) -> GenerationParams:
    """The sampling parameters of a Responses or Messages body (one sequence, usage always)
    whose token limit is ``data[field]`` (``max_output_tokens`` / ``max_tokens``: its errors
    name it)."""
    max_tokens = data.get(field)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise bad_request(f"{field} must be a positive integer, got {max_tokens!r}", field)
    stream, salt = bool(data.get("stream")), data.get("cache_salt")
    return GenerationParams(max_tokens=max_tokens, ignore_eos=False, stream=stream,
                            include_usage=True, cache_salt=validate_cache_salt(salt), n=1)


def check_length(config: EmulatorConfig, prompt_len: int, max_tokens: int | None) -> int:
    """The number of tokens to generate for a prompt of ``prompt_len`` tokens: ``max_tokens``,
    else up to ``eos_after_tokens`` within ``max_model_len``. ApiError 400 with vLLM's message
    when the prompt (and ``max_tokens``) do not fit the context."""
    limit = config.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input messages.")
    if max_tokens is None:
        return min(config.eos_after_tokens, limit - prompt_len)
    if prompt_len + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.")
    return max_tokens


def resolve_model(config: EmulatorConfig, lora_paths: Mapping[str, str],
                  data: dict[str, Any]) -> tuple[str, str | None]:
    """(model name echoed back, LoRA adapter name or None): a served model name, else one of
    ``lora_paths`` (the loaded adapters by name). ApiError 404 for unknown models."""
    model = data.get("model")
    if model is None:
        return config.served_model_names[0], None
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model in config.served_model_names:
        return model, None
    if model in lora_paths:
        return model, model
    raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body; ApiError 400 for invalid JSON or another JSON value."""
    raw = await request.read()
    try:
        data = _json_decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data
