"""The emulator's pooling, scoring and rerank answers: vLLM 0.32's request and response shapes
with made-up numbers. Pure.

Shapes copy vLLM 0.32 ``vllm/entrypoints/pooling/{embed,pooling,scoring}/protocol.py``
(``EmbeddingResponse``, ``PoolingResponse``, ``ScoreResponse``, ``RerankResponse``). The
numbers are the emulator's own: a prompt's embedding is a deterministic unit vector drawn from
its token ids (the same prompt always gives the same vector, different prompts nearly
orthogonal ones), a score is the cosine of two embeddings mapped to [0, 1]. A real engine
serves these paths only for a pooling model (``--runner pooling``); the emulator answers them
for any model it serves, so that routing and load balancing can be tested without one.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from array import array
from collections.abc import Sequence
from typing import Any, Final

import xxhash

EMBED_DIM: Final = 32  # emulator only: floats per embedding when the request names no dimensions
MAX_EMBED_DIM: Final = 4096


class PoolingInputError(ValueError):
    """A pooling, score or rerank body of the wrong shape (the server answers 400); ``param``
    names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def embedding(token_ids: Sequence[int], dim: int = EMBED_DIM) -> list[float]:
    """A unit vector of ``dim`` floats determined by ``token_ids`` (normalised, as vLLM's
    default ``normalize=True`` embed pooler gives)."""
    seed = xxhash.xxh3_64_intdigest(array("q", token_ids).tobytes())
    rng = random.Random(seed)
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


def score(a: Sequence[int], b: Sequence[int]) -> float:
    """The emulator's relevance of prompt ``b`` to ``a``: (cosine of their embeddings + 1) / 2,
    in [0, 1]; 1.0 for equal prompts."""
    cos = sum(x * y for x, y in zip(embedding(a), embedding(b), strict=True))
    return max(0.0, min(1.0, (cos + 1.0) / 2.0))


def texts_of(value: Any, param: str) -> list[str]:
    """A score/rerank side (``ScoreInput | list[ScoreInput]``, text inputs only here) as a list
    of texts. Raises ``PoolingInputError``."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(t, str) for t in items):
        raise PoolingInputError(f"{param} must be a string or a non-empty list of strings", param)
    return items


def score_sides(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The two sides of a ``/score`` body: ``queries`` with ``documents`` or ``items``,
    ``data_1``/``data_2`` or ``text_1``/``text_2`` (vLLM 0.32 ``ScoreRequest`` variants).
    Raises ``PoolingInputError``."""
    for first, second in (
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ):
        if first in data and second in data:
            return texts_of(data[first], first), texts_of(data[second], second)
    raise PoolingInputError(
        "a score request needs queries and documents (or items), "
        "data_1 and data_2, or text_1 and text_2"
    )


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """Index pairs scored (vLLM ``_validate_score_input_lens``): one first against each
    second (1:N), or pairwise for equal lengths (N:N). Raises ``PoolingInputError``."""
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first == num_second:
        return [(i, i) for i in range(num_first)]
    raise PoolingInputError("Input lengths must be either 1:1, 1:N or N:N")


def usage(num_prompt_tokens: int) -> dict[str, Any]:
    """vLLM ``UsageInfo`` of a pooling request (no completion tokens)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "total_tokens": num_prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _head(prefix: str, model: str) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
    }


# {path kind: (id prefix, item "object", the item's vector field)}: vLLM 0.32
# ``EmbeddingResponse`` (/v1/embeddings) and ``PoolingResponse`` (/pooling)
VECTOR_ANSWERS: Final = {
    "embeddings": ("embd", "embedding", "embedding"),
    "pooling": ("pool", "pooling", "data"),
}


def vectors_body(
    kind: str, model: str, prompts: Sequence[Sequence[int]], dim: int
) -> dict[str, Any]:
    """The ``/v1/embeddings`` (``kind`` "embeddings") or ``/pooling`` ("pooling") answer for
    tokenized ``prompts``: one vector of ``dim`` floats each, in order."""
    prefix, item, field = VECTOR_ANSWERS[kind]
    return {
        **_head(prefix, model),
        "data": [
            {"index": i, "object": item, field: embedding(p, dim)} for i, p in enumerate(prompts)
        ],
        "usage": usage(sum(len(p) for p in prompts)),
    }


def score_body(
    model: str, first: Sequence[Sequence[int]], second: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """``/score`` answer (``ScoreResponse``) for the tokenized sides. Raises
    ``PoolingInputError`` for lengths that do not pair."""
    pairs = score_pairs(len(first), len(second))
    return {
        **_head("score", model),
        "data": [
            {"index": k, "object": "score", "score": score(first[i], second[j])}
            for k, (i, j) in enumerate(pairs)
        ],
        "usage": usage(sum(len(first[i]) + len(second[j]) for i, j in pairs)),
    }


def rerank_body(
    model: str,
    query: Sequence[int],
    documents: Sequence[Sequence[int]],
    texts: Sequence[str],
    top_n: int,
) -> dict[str, Any]:
    """``/rerank`` answer (``RerankResponse``): documents by relevance, best first, the first
    ``top_n`` (0: all), each with its index and text."""
    scores = [score(query, doc) for doc in documents]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    results = [
        {
            "index": i,
            "document": {"text": texts[i], "multi_modal": None},
            "relevance_score": scores[i],
        }
        for i in order
    ]
    if top_n > 0:
        results = results[:top_n]
    num_tokens = sum(len(query) + len(d) for d in documents)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }
