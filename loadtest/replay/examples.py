"""The input files of the docs' worked examples (README.md and docs/*.md), generated (so every
example runs as printed from a fresh clone): ``python -m loadtest.replay.examples NAME > FILE``.
Writes to stdout only.

* ``audit-requests``: the seed's template-audit example, twelve chat requests: six whose
  system prompt starts with the current time, then a 700-token contract policy, then a question;
  six with a short shared system prompt (``prefix-router audit requests.jsonl --top 2``);
* ``doc-qa``: the seed's worked A/B example, a 12,000-token document followed by 20 questions
  of 100 tokens each, as token-id completions with ``max_tokens`` 1
  (``prefix-loadtest ab --requests seed-doc-qa.jsonl ...``).

The text and token ids are made up here (deterministic, no external data, the project's own
license).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["EXAMPLES", "audit_requests", "doc_qa", "main"]

MODEL = "emulated-llm"
POLICY = " ".join(f"Clause {i}: the supplier shall deliver the goods described in schedule {i} "
                  "within thirty days of the order." for i in range(30))  # about 700 tokens
QUESTIONS = ("What is the delivery deadline?", "Who pays for shipping?",
             "Can the buyer cancel an order?", "Which law governs the contract?",
             "Summarise clause 7.", "Is there a penalty for late delivery?")
TERSE = "You are terse. Answer in one word, never more, and never explain."
DOCUMENT_TOKENS = 12_000  # the seed's worked example
QUESTION_TOKENS = 100
NUM_QUESTIONS = 20
TOKEN_IDS = (1000, 100_000)  # ordinary vocabulary ids of a Qwen3-sized vocabulary


def _chat(system: str, question: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}


def audit_requests() -> Iterator[dict[str, Any]]:
    """Twelve chat bodies: six with a timestamp before the shared policy (a near miss the audit
    names), six with a short shared system prompt (24 tokens: a block boundary note)."""
    for i, question in enumerate(QUESTIONS):
        yield _chat(f"You are a contract assistant. Current time: 2026-12-01 21:{10 + i:02d}:"
                    f"{(7 * i) % 60:02d} UTC. {POLICY}", question)
    for question in QUESTIONS:
        yield _chat(TERSE, question)


def doc_qa(seed: int = 0) -> Iterator[dict[str, Any]]:
    """``NUM_QUESTIONS`` completion bodies: one ``DOCUMENT_TOKENS``-token document, then a
    different ``QUESTION_TOKENS``-token question each (token ids, seeded)."""
    rng = random.Random(seed)
    document = [rng.randrange(*TOKEN_IDS) for _ in range(DOCUMENT_TOKENS)]
    for _ in range(NUM_QUESTIONS):
        question = [rng.randrange(*TOKEN_IDS) for _ in range(QUESTION_TOKENS)]
        yield {"model": MODEL, "prompt": document + question, "max_tokens": 1}


EXAMPLES: dict[str, Callable[[], Iterator[dict[str, Any]]]] = {
    "audit-requests": audit_requests, "doc-qa": doc_qa}


def main(argv: list[str] | None = None) -> int:
    """Write the named example as JSONL to stdout; exit status 0 (2 for an unknown name)."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.replay.examples",
                                     description="write a README example's input as JSONL")
    parser.add_argument("name", choices=sorted(EXAMPLES))
    args = parser.parse_args(argv)
    for body in EXAMPLES[args.name]():
        sys.stdout.write(json.dumps(body, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
