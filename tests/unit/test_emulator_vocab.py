"""Unit tests of the emulator's vocabulary bound (``--vocab-size``, vLLM's out-of-vocabulary 400)."""

from __future__ import annotations

import json
import os

import pytest

from router.tools.trace_format import DEFAULT_VOCAB_HIGH, DEFAULT_VOCAB_LOW
from worker.emulator.config import QWEN3_TOKENIZER_VOCAB_SIZE, ConfigError, from_args
from worker.emulator.http_checks import ApiError, check_vocab
from worker.emulator.tokenizer import default_tokenizer_dir


def test_default_vocab_size_is_len_of_the_shipped_qwen3_tokenizer() -> None:
    with open(os.path.join(default_tokenizer_dir(), "tokenizer.json"), encoding="utf-8") as fh:
        spec = json.load(fh)
    ids = set(spec["model"]["vocab"].values()) | {t["id"] for t in spec["added_tokens"]}
    assert ids == set(range(QWEN3_TOKENIZER_VOCAB_SIZE))


def test_vocab_size_flag_and_defaults() -> None:
    assert from_args([], env={}).vocab_size == QWEN3_TOKENIZER_VOCAB_SIZE
    assert from_args(["--vocab-size", "32000"], env={}).vocab_size == 32000
    # A custom tokenizer without --vocab-size: resolved from the tokenizer on first use.
    assert from_args(["--tokenizer", "/some/dir"], env={}).vocab_size is None
    assert from_args(["--tokenizer", "/d", "--vocab-size", "7"], env={}).vocab_size == 7
    with pytest.raises(ConfigError):
        from_args(["--vocab-size", "0"], env={})


def test_check_vocab_rejects_the_largest_id_as_vllm_does() -> None:
    check_vocab([0, QWEN3_TOKENIZER_VOCAB_SIZE - 1], QWEN3_TOKENIZER_VOCAB_SIZE)
    for bad in (QWEN3_TOKENIZER_VOCAB_SIZE, 1_000_000_000, 2**64):
        with pytest.raises(ApiError) as info:
            check_vocab([3, bad, 2], QWEN3_TOKENIZER_VOCAB_SIZE)
        assert info.value.status == 400
        assert info.value.body()["error"] == {
            "message": f"Token id {bad} is out of vocabulary", "type": "BadRequestError",
            "param": "prompt", "code": 400}
    with pytest.raises(ApiError, match="Token id 5 is out"):  # the largest id is reported
        check_vocab([4, 5, 0], 4)


def test_trace_replay_token_range_is_inside_the_default_vocabulary() -> None:
    assert 0 <= DEFAULT_VOCAB_LOW < DEFAULT_VOCAB_HIGH <= QWEN3_TOKENIZER_VOCAB_SIZE
