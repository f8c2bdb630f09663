"""vLLM-exact block hashing against the golden vectors produced by vLLM 0.33's own code."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.shared.hashing import (
    HASH_ALGOS,
    BlockHasher,
    HashConfigError,
    MultiModalItem,
    block_extra_keys,
    block_key,
    block_keys,
    max_hit_blocks,
)
from tests.conftest import load_vectors

VECTORS = load_vectors("vllm-block-hashes.json")


def _case_id(case: dict[str, Any]) -> str:
    return f"{case['algo']}-seed{case['pythonhashseed']}-{case['tokens']}-{case['variant']}"


def _case_digests(case: dict[str, Any]) -> list[bytes]:
    hasher = BlockHasher(case["block_size"], case["algo"], case["pythonhashseed"])
    lora = (case["lora_name"], case["lora_path"]) if case["lora_name"] else None
    mm = [MultiModalItem(m["identifier"], m["offset"], m["length"]) for m in case["mm"] or []]
    tokens = VECTORS["token_lists"][case["tokens"]]
    return hasher.digests(tokens, lora=lora, cache_salt=case["cache_salt"], mm_items=mm)


@pytest.mark.parametrize("case", VECTORS["cases"], ids=_case_id)
def test_vector_case(case: dict[str, Any]) -> None:
    hasher = BlockHasher(case["block_size"], case["algo"], case["pythonhashseed"])
    assert hasher.none_hash.hex() == case["none_hash_hex"]
    digests = _case_digests(case)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    assert [block_key(d) for d in digests] == case["event_block_hashes_int"]
    tokens = VECTORS["token_lists"][case["tokens"]]
    assert len(digests) == len(tokens) // case["block_size"]


@pytest.mark.parametrize("entry", VECTORS["none_hashes"], ids=lambda e: f"{e['algo']}-{e['pythonhashseed']}")
def test_none_hash(entry: dict[str, Any]) -> None:
    hasher = BlockHasher(16, entry["algo"], entry["pythonhashseed"])
    assert hasher.seed == entry["seed_string_hashed"]
    assert hasher.none_hash.hex() == entry["none_hash_hex"]


def test_block0_preimage_is_vllms_serialisation() -> None:
    cases = [c for c in VECTORS["cases"] if c.get("block0_preimage_hex")]
    assert cases, "vectors carry at least one preimage"
    for case in cases:
        hasher = BlockHasher(case["block_size"], case["algo"], case["pythonhashseed"])
        tokens = VECTORS["token_lists"][case["tokens"]][: case["block_size"]]
        lora = (case["lora_name"], case["lora_path"]) if case["lora_name"] else None
        extra = block_extra_keys(0, case["block_size"], lora=lora, cache_salt=case["cache_salt"])
        preimage = hasher._serialise((hasher.none_hash, tuple(tokens), extra))
        assert preimage.hex() == case["block0_preimage_hex"]


def test_xxhash_without_seed_is_refused() -> None:
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(HashConfigError, match="PYTHONHASHSEED"):
            BlockHasher(16, algo, None)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_block_size(bad: int) -> None:
    with pytest.raises(HashConfigError, match="block size"):
        BlockHasher(bad)


def test_unknown_algo() -> None:
    with pytest.raises(HashConfigError, match="unknown hash algorithm"):
        BlockHasher(16, "md5")


@pytest.mark.parametrize(("n", "b", "expected"), [(0, 16, 0), (1, 16, 0), (16, 16, 0), (17, 16, 1),
                                                  (32, 16, 1), (33, 16, 2), (1000, 16, 62), (992, 16, 61)])
def test_max_hit_blocks(n: int, b: int, expected: int) -> None:
    assert max_hit_blocks(n, b) == expected


def test_chain_continuation_matches_full_chain() -> None:
    hasher = BlockHasher(16, "sha256", "0")
    tokens = list(range(200))
    full = hasher.digests(tokens, cache_salt="s")
    head = hasher.digests(tokens, cache_salt="s", max_blocks=5)
    tail = hasher.digests(tokens, cache_salt="s", parent=head[-1], start_block=5)
    assert head + tail == full
    assert hasher.keys(tokens, cache_salt="s") == [block_key(d) for d in full]


token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80)


@settings(max_examples=150, deadline=None)
@given(a=token_lists, b=token_lists, algo=st.sampled_from(HASH_ALGOS),
       salt_a=st.sampled_from([None, "s1"]), salt_b=st.sampled_from([None, "s1", "s2"]),
       lora_a=st.booleans(), lora_b=st.booleans())
def test_chain_property(a: list[int], b: list[int], algo: str, salt_a: str | None,
                        salt_b: str | None, lora_a: bool, lora_b: bool) -> None:
    """Keys agree on the first k blocks exactly when tokens and extra keys agree on them."""
    bs = 8
    hasher = BlockHasher(bs, algo, "7")
    lora = ("ad", "/p/ad")
    ka = hasher.keys(a, cache_salt=salt_a, lora=lora if lora_a else None)
    kb = hasher.keys(b, cache_salt=salt_b, lora=lora if lora_b else None)
    same_extras = salt_a == salt_b and lora_a == lora_b
    for k in range(min(len(ka), len(kb))):
        same_blocks = a[: (k + 1) * bs] == b[: (k + 1) * bs]
        assert (ka[: k + 1] == kb[: k + 1]) == (same_blocks and same_extras)


@settings(max_examples=50, deadline=None)
@given(prefix=st.lists(st.integers(0, 150_000), min_size=16, max_size=64),
       suffix_a=token_lists, suffix_b=token_lists)
def test_shared_prefix_shares_keys(prefix: list[int], suffix_a: list[int], suffix_b: list[int]) -> None:
    hasher = BlockHasher(16)
    shared = len(prefix) // 16
    assert hasher.keys(prefix + suffix_a)[:shared] == hasher.keys(prefix + suffix_b)[:shared]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router.cli", "hash", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([8, 16, 32, 12, 3]).flatmap(
    lambda width: st.lists(st.binary(min_size=width, max_size=width), max_size=40)),
    st.lists(st.binary(min_size=8, max_size=40), max_size=3))
def test_bulk_block_keys_equal_one_by_one(digests: list[bytes], odd: list[bytes]) -> None:
    # one hasher's digests take the one-pass path; mixed or odd lengths the per-digest one
    for batch in (digests, digests + odd):
        assert block_keys(batch) == [block_key(d) for d in batch]


@pytest.mark.slow  # starts a Python process
def test_cli_prints_range40_vectors() -> None:
    case = next(c for c in VECTORS["cases"]
                if c["tokens"] == "range40" and c["variant"] == "plain" and c["algo"] == "sha256"
                and c["pythonhashseed"] is None)
    result = _cli("--tokens", str(list(range(40))))
    assert result.returncode == 0, result.stderr
    expected = [f"{h} {k}" for h, k in zip(case["block_hashes_hex"], case["event_block_hashes_int"], strict=True)]
    assert result.stdout.splitlines() == expected


@pytest.mark.slow  # starts a Python process
def test_cli_reads_stdin_and_extras() -> None:
    case = next(c for c in VECTORS["cases"]
                if c["tokens"] == "range40" and c["variant"] == "mm" and c["algo"] == "xxhash_cbor"
                and c["pythonhashseed"] == "0")
    mm = case["mm"][0]
    result = _cli("--hash-algo", "xxhash_cbor", "--hash-seed", "0",
                  "--mm", f"{mm['identifier']}:{mm['offset']}:{mm['length']}", stdin=str(list(range(40))))
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == case["block_hashes_hex"]

    salted = next(c for c in VECTORS["cases"]
                  if c["tokens"] == "exact32" and c["variant"] == "lora+salt" and c["algo"] == "sha256_cbor"
                  and c["pythonhashseed"] == "0")
    result = _cli("--hash-algo", "sha256_cbor", "--hash-seed", "0", "--cache-salt", salted["cache_salt"],
                  "--lora-name", salted["lora_name"], "--lora-path", salted["lora_path"],
                  "--tokens", str(VECTORS["token_lists"]["exact32"]))
    assert result.returncode == 0, result.stderr
    assert [int(line.split()[1]) for line in result.stdout.splitlines()] == salted["event_block_hashes_int"]


@pytest.mark.parametrize(("args", "stdin", "message"), [
    (["--tokens", "[1, 2, -3]"], None, "non-negative"),
    (["--tokens", "{\"a\": 1}"], None, "JSON array"),
    (["--tokens", "[1, 2"], None, "not valid JSON"),
    (["--tokens", "[1.5]"], None, "non-negative integers"),
    (["--tokens", "[true]"], None, "non-negative integers"),
    ([], "not json", "not valid JSON"),
    (["--hash-algo", "md5", "--tokens", "[1]"], None, "unknown hash algorithm"),
    (["--hash-algo", "xxhash", "--tokens", "[1]"], None, "PYTHONHASHSEED"),
    (["--block-size", "0", "--tokens", "[1]"], None, "block size"),
    (["--mm", "x:1", "--tokens", "[1]"], None, "ID:OFFSET:LENGTH"),
    (["--lora-name", "a", "--tokens", "[1]"], None, "together"),
    (["--block-size", "x", "--tokens", "[1]"], None, "invalid int value"),
    (["--no-such-flag"], None, "unknown argument --no-such-flag"),
    (["--tokens", "[1" + "0" * 5000 + "]"], None, "not a usable JSON array"),
])
@pytest.mark.slow  # starts a Python process
def test_cli_bad_input(args: list[str], stdin: str | None, message: str) -> None:
    result = _cli(*args, stdin=stdin)
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
