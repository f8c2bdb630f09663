"""The pooling, scoring and tokenizer paths a vLLM replica serves, and how the router routes
them. Pure.

None of these requests generates, and the router does not render their bodies to token ids
(each API has its own input forms: texts, token ids, query/document pairs, chat messages), so
they have no block chain for the index: the router sends each to the least-loaded routable
replica serving its ``model``, with the same model filter, health, circuit breaker, panic mode
and retries as completions. (vLLM 0.32 does read the prefix cache for the ``embed``,
``classify`` and ``score`` tasks, ``PoolingParams._merge_default_parameters`` skips it only for
``token_embed`` and ``token_classify``: routing them by prefix is possible, not done here.
Since the cache is read, the pooling paths carry the tenant's ``cache_salt`` as generation
does: vLLM 0.32 ``PoolingBasicRequestMixin.cache_salt``.)
Paths from vLLM 0.32.0's API routers
(``vllm/entrypoints/pooling/{embed,pooling,classify,scoring}/api_router.py``,
``vllm/entrypoints/serve/tokenize/api_router.py``).
"""

from __future__ import annotations

from typing import Any, Final

from router.request.errors import BadRequest
from router.request.prompts import estimated_tokens

# {path: what it is} for the paths the router forwards to the least-loaded replica
POOLING_PATHS: Final = {
    "/v1/embeddings": "embeddings",  # OpenAI embeddings
    "/v2/embed": "embeddings",  # Cohere embed v2
    "/pooling": "pooling",  # raw pooler output
    "/classify": "classify",
    "/score": "score",  # (text_1, text_2), (queries, documents | items), (data_1, data_2)
    "/v1/score": "score",  # vLLM's deprecated spelling of /score
    "/rerank": "rerank",  # Jina / Cohere rerank
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
}
TOKENIZER_PATHS: Final = {
    "/tokenize": "tokenize",  # any replica of the model answers: its tokenizer is the model's
    # Anthropic count_tokens (vLLM 0.32 anthropic/api_router.py): the Messages body rendered
    # and counted, {"input_tokens": N}; errors in Anthropic's shape (router.apis.error_shapes)
    "/v1/messages/count_tokens": "count_tokens",
    "/detokenize": "detokenize",
}
FORWARDED_PATHS: Final = {**POOLING_PATHS, **TOKENIZER_PATHS}  # {path: kind}
# the paths whose body takes a cache_salt (vLLM 0.32 PoolingBasicRequestMixin): every pooling
# path but Cohere's /v2/embed (CohereEmbedRequest has no such field; the engine drops it)
SALTED_PATHS: Final = frozenset(POOLING_PATHS) - {"/v2/embed"}
# the stored Responses answers (vLLM 0.32 openai/responses/api_router.py): sent to the replica
# holding the id, as previous_response_id is (router.apis.affinity)
STORED_RESPONSE_PATHS: Final = {
    "/v1/responses/{response_id}": "GET",  # the stored response object (or its stream)
    "/v1/responses/{response_id}/cancel": "POST",  # cancel a background response
}


# the body fields that are no input: everything else a pooling or scoring body carries is
# counted (vLLM's request types name their inputs in many ways: "input", "texts", "inputs",
# "images", "data", "text_1", "queries", "documents", "messages", ...; a field left out of a
# list of inputs was a way to send unmetered work)
NOT_INPUT_FIELDS: Final = frozenset({"model", "cache_salt"})


def input_tokens(data: dict[str, Any]) -> int:
    """A pooling or scoring body's inputs in tokens, estimated before any tokenizer (the router
    renders none of them): each token id by itself, each text at 4 characters a token (the
    admission step's estimate, ``router.service.fleet_admission.prompt_tokens``), through every
    list and object of the body but ``NOT_INPUT_FIELDS`` (an option's value counts as the small
    text or number it is); at least 1. What the rate limits' tokens per minute count for these
    paths."""
    total = 0
    pending: list[Any] = [value for key, value in data.items() if key not in NOT_INPUT_FIELDS]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += estimated_tokens(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += 1  # a token id
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return max(1, total)


def request_model(data: Any) -> str | None:
    """The ``model`` a pooling, scoring or tokenizer body names, or ``None`` (vLLM then uses its
    first served model: any replica will do). Raises ``BadRequest`` for a body that is not a
    JSON object or a ``model`` that is not a string."""
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    return model
