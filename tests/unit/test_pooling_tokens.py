"""The rate limits' token estimate of a pooling or scoring body (``router.apis.pooling.
input_tokens``): every input shape vLLM's pooling and scoring requests take is counted, so no
field carries unmetered work; only the model and the salt are left out."""

from __future__ import annotations

from typing import Any

import pytest

from router.apis.pooling import input_tokens

TEXT = "x" * 40_000  # 10,000 tokens at 4 characters a token


@pytest.mark.parametrize("body", [
    {"model": "m", "input": TEXT},  # OpenAI embeddings
    {"model": "m", "input": [TEXT]},
    {"model": "m", "texts": [TEXT]},  # Cohere embed v2
    # Cohere embed v2's mixed inputs and images (a reviewer sent these as 1 token each)
    {"model": "m", "inputs": [{"content": [{"type": "text", "text": TEXT}]}]},
    {"model": "m", "images": ["data:image/png;base64," + TEXT]},
    {"model": "m", "data": {"prompt": TEXT}},  # /pooling with an IO processor
    {"model": "m", "text_1": "q", "text_2": [TEXT]},  # /score
    {"model": "m", "query": "q", "documents": [TEXT]},  # rerank
    {"model": "m", "messages": [{"role": "user", "content": TEXT}]},  # chat-style embeddings
], ids=["input", "input-list", "texts", "inputs", "images", "data", "score", "rerank",
        "messages"])
def test_every_input_shape_counts_its_text(body: dict[str, Any]) -> None:
    assert input_tokens(body) >= 10_000


def test_token_ids_count_one_each_and_the_model_and_salt_nothing() -> None:
    assert input_tokens({"model": "x" * 4000, "cache_salt": "s" * 4000,
                         "input": [list(range(300)), list(range(200))]}) == 500
    assert input_tokens({"model": "m"}) == 1  # at least one
    assert input_tokens({"model": "m", "input": True}) == 1  # a bool is no token id
