"""Prompt-template audit: prefix families, near-miss prompts, block-boundary waste. Pure.

The seed's step 4 and two of its failure modes, found from the prompts the router already
tokenizes, in bounded memory:

* **near-miss prompts**: a per-request field (a timestamp, a user name, a request id) placed
  before shared content changes block 0's hash and with it every later block hash (vLLM chains
  each block hash to its parent), so prompts that share thousands of tokens hit nothing. The
  audit groups prompts into *families* whose heads share a long token span even when they
  differ inside their first blocks, and reports where they differ (token positions) and what
  the differing tokens say (decoded), with a guess of the field's kind;
* **block-boundary waste**: only full blocks are cached, so a shared prefix that ends a few
  tokens past a block boundary recomputes those tokens on every hit (a 40-token system prompt
  with 16-token blocks loses 8 of 40);
* **hit rate per family** (top K by traffic), from the engine's own ``cached_tokens`` where the
  replica reports them, else from the router's prediction.

How families are found: each prompt's first ``head_tokens`` tokens are fingerprinted with
content-defined anchors (hashes of ``ANCHOR_WINDOW``-token windows that fall in about one
position in ``ANCHOR_EVERY``; the same content gives the same anchors wherever it sits, so a
field of another length before it does not hide it). A prompt is compared with the exemplar
(first member) of each family sharing one of its anchors: the common prefix ``p``, and after a
difference, the next anchor both hold, extended back and forward to the whole shared span. The
best match sharing ``min_family_tokens`` or more tokens is its family; else it founds one. A
member that differs from the exemplar at token ``p`` and then shares ``min_shared_after_tokens``
or more again is a near miss: the blocks from ``p // block_size`` on could have been hit.

Memory: at most ``max_families`` families (least recently seen evicted), each holding its
exemplar head, ``MAX_ANCHORS`` anchors and ``MAX_EXAMPLES`` examples: about 10 KB a family.
Families are kept per tenant (with API keys on) so no tenant's text shows in another's view,
and a tenant's view counts its own requests only. A family id is keyed: the first 8 hex digits
of HMAC-SHA256 under ``id_key`` (with API keys on, derived from the salt secret) of the tenant
and the first block's tokens, so nobody without the secret can compute the id of a prompt he
knows and look for it in ``/metrics`` (issue 29; an unkeyed hash of the tokens and the tenant
name could be). Thread-safe (one lock); ``observe`` is meant for a background thread, not the
event loop.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

DEFAULT_HEAD_TOKENS: Final = 1024  # tokens of each prompt's head the audit looks at
DEFAULT_MAX_FAMILIES: Final = 256  # families kept (least recently seen evicted)
DEFAULT_TOP_K: Final = 10  # families reported (and exported as metrics), by traffic
DEFAULT_MIN_FAMILY_TOKENS: Final = 16  # tokens a prompt must share with a family's exemplar (a block)
DEFAULT_MIN_SHARED_AFTER_TOKENS: Final = 32  # shared again after a difference: a near miss
DEFAULT_WASTE_FRACTION: Final = 0.05  # flag a shared prefix losing this much of itself to rounding
ANCHOR_WINDOW: Final = 8  # tokens per anchor window
ANCHOR_EVERY: Final = 8  # about one anchor per this many positions (a power of two)
MAX_ANCHORS: Final = 128  # anchors a family's exemplar registers
MAX_CANDIDATES: Final = 4  # families a prompt is compared with
MAX_EXAMPLES: Final = 3  # near-miss examples kept per family
MAX_RESYNC_ANCHORS: Final = 16  # anchors after a difference tried for the shared run
CONTEXT_TOKENS: Final = 6  # tokens decoded either side of a differing span
_P: Final = np.uint64(0x100000001B3)  # FNV-64 prime: the window hash's multiplier
_MIX: Final = np.uint64(0xFF51AFD7ED558CCD)  # murmur3 finaliser constant
FAMILY_ID_HEX: Final = 8  # hex digits of a family id (32 bits: a metric label, not a secret)

_KINDS: Final = (  # (kind, pattern over the differing text with its context), first match wins
    ("timestamp", re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b1[6-9]\d{8}(\d{3})?\b|"
                             r"\b(Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*\b|\b(Jan|Feb|Mar|Apr|May|Jun|"
                             r"Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b \d", re.I)),
    ("request id", re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-|\b(?=[0-9a-z_-]*\d)(?=[0-9a-z_-]*[a-z])"
                              r"[0-9a-z_-]{12,}\b", re.I)),
    ("number", re.compile(r"^\W*\d+\W*$")),
    ("name", re.compile(r"^\W*[A-Z][a-z]+( [A-Z][a-z]+)?\W*$")),
)


def anchors(tokens: Sequence[int]) -> dict[int, int]:
    """``{anchor hash: first position}`` of a token sequence, in order of position: windows of
    ``ANCHOR_WINDOW`` tokens whose mixed polynomial hash is 0 modulo ``ANCHOR_EVERY``
    (content-defined, so the same content yields the same anchors at any offset)."""
    n = len(tokens) - ANCHOR_WINDOW + 1
    if n <= 0:
        return {}
    a = np.asarray(tokens, dtype=np.uint64)
    h = np.zeros(n, dtype=np.uint64)
    for j in range(ANCHOR_WINDOW):
        h = h * _P + a[j:j + n]  # wraps modulo 2**64, as intended
    h ^= h >> np.uint64(33)
    h *= _MIX
    h ^= h >> np.uint64(33)
    out: dict[int, int] = {}
    positions = np.nonzero((h & np.uint64(ANCHOR_EVERY - 1)) == 0)[0]
    # (converted in bulk: an element read per position cost as much as the hashing)
    for anchor, pos in zip(h[positions].tolist(), positions.tolist(), strict=True):
        out.setdefault(anchor, pos)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n


def classify(text: str) -> str:
    """A guess of what a variable field is from its decoded text (with context):
    ``timestamp``, ``request id``, ``number``, ``name`` or ``text``."""
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return "text"


@dataclass(slots=True)
class _Family:
    family_id: str
    tenant: str | None
    exemplar: array[int]  # the first member's head tokens
    exemplar_anchors: dict[int, int]  # {anchor hash: position in the exemplar}
    requests: int = 0
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    engine_prompt_tokens: int = 0  # of requests whose replica reported cached_tokens
    engine_hit_tokens: int = 0
    near_miss_requests: int = 0
    near_miss_lost_tokens: int = 0  # shared tokens after the difference, in full blocks
    shared_prefix_tokens: int | None = None  # min common prefix with the exemplar over members
    examples: list[dict[str, Any]] = field(default_factory=list)
    variable_kinds: dict[str, int] = field(default_factory=dict)  # {kind: near misses}
    variable_starts: dict[int, int] = field(default_factory=dict)  # {first differing pos: count}


@dataclass(slots=True)
class _TenantCounts:
    observed: int = 0
    near_misses: int = 0
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class _Match:
    family: _Family
    prefix: int  # common prefix with the exemplar
    shared_after: int  # tokens shared again after the difference (0: none found)
    member_end: int  # end of the differing span in the member
    exemplar_end: int  # end of the differing span in the exemplar

    @property
    def score(self) -> int:
        return self.prefix + self.shared_after


class PrefixAudit:
    """Bounded prefix-family statistics over a stream of prompt heads (see module docstring).

    ``decode(token_ids) -> str`` turns tokens back into text (None: reports show token ids).
    ``id_key``: the key of the family ids' HMAC (``router.edges.auth.derived_key``; empty without
    API keys, when nothing is secret from anyone who can read ``/debug/prefixes``).
    """

    def __init__(self, block_size: int, decode: Callable[[Sequence[int]], str] | None = None,
                 max_families: int = DEFAULT_MAX_FAMILIES,
                 head_tokens: int = DEFAULT_HEAD_TOKENS,
                 min_family_tokens: int = DEFAULT_MIN_FAMILY_TOKENS,
                 min_shared_after_tokens: int = DEFAULT_MIN_SHARED_AFTER_TOKENS,
                 id_key: bytes = b"") -> None:
        if block_size < 1 or max_families < 1 or head_tokens < ANCHOR_WINDOW:
            raise ValueError("block_size and max_families must be >= 1, head_tokens >= "
                             f"{ANCHOR_WINDOW}")
        self.block_size = block_size
        self.decode = decode
        self.max_families = max_families
        self.head_tokens = head_tokens
        self.min_family_tokens = min_family_tokens
        self.min_shared_after_tokens = min_shared_after_tokens
        self._id_key = id_key
        self._families: OrderedDict[str, _Family] = OrderedDict()  # LRU: last seen at the end
        self._by_anchor: dict[str | None, dict[int, str]] = {}  # {tenant: {anchor: family id}}
        self._lock = threading.Lock()
        self.observed = 0
        self.near_misses = 0
        self.dropped = 0  # observations the caller dropped (queue full): ``drop``
        # {tenant: its own counts}; tenants come from the key file, so this stays small
        self._counts: dict[str | None, _TenantCounts] = {}

    def _counts_of(self, tenant: str | None) -> _TenantCounts:
        counts = self._counts.get(tenant)
        if counts is None:
            counts = self._counts[tenant] = _TenantCounts()
        return counts

    def drop(self, tenant: str | None = None) -> None:
        """Count an observation of ``tenant``'s the caller dropped (its queue was full)."""
        with self._lock:
            self.dropped += 1
            self._counts_of(tenant).dropped += 1

    def observe(self, tokens: Sequence[int], prompt_tokens: int | None = None,
                predicted_hit_tokens: int = 0, cached_tokens: int | None = None,
                tenant: str | None = None) -> str | None:
        """Account one request: ``tokens`` its prompt (or at least its head), ``prompt_tokens``
        its length (default ``len(tokens)``), the router's predicted and the engine's reported
        hit tokens. Returns its family id (``None`` for prompts shorter than an anchor window)."""
        head = list(tokens[:self.head_tokens])
        if len(head) < ANCHOR_WINDOW:
            return None
        found = anchors(head)
        with self._lock:
            self.observed += 1
            self._counts_of(tenant).observed += 1
            match = self._best_match(head, found, tenant)
            if match is None:
                family = self._found(head, found, tenant)
            else:
                family = match.family
                self._families.move_to_end(family.family_id)
                self._account_match(family, head, match, tenant)
            n = prompt_tokens if prompt_tokens is not None else len(tokens)
            family.requests += 1
            family.prompt_tokens += n
            family.predicted_hit_tokens += predicted_hit_tokens
            if cached_tokens is not None:
                family.engine_prompt_tokens += n
                family.engine_hit_tokens += cached_tokens
            return family.family_id

    def _best_match(self, head: list[int], found: dict[int, int],
                    tenant: str | None) -> _Match | None:
        candidates: list[str] = []
        by_anchor = self._by_anchor.get(tenant, {})
        for anchor in found:  # (in order of position: ``anchors``)
            fid = by_anchor.get(anchor)
            if fid is not None and fid not in candidates:
                candidates.append(fid)
                if len(candidates) == MAX_CANDIDATES:
                    break
        best: _Match | None = None
        for fid in candidates:
            match = self._compare(self._families[fid], head, found)
            # a family shares a leading span, or (a near miss) a long span after a difference;
            # a short common tail alone (the same question after another system prompt) is not
            acceptable = (match.prefix >= self.min_family_tokens
                          or match.shared_after >= self.min_shared_after_tokens)
            if acceptable and (best is None or match.score > best.score):
                best = match
        return best

    def _compare(self, family: _Family, head: list[int], found: dict[int, int]) -> _Match:
        ex = family.exemplar
        p = common_prefix(head, ex)
        if p >= min(len(head), len(ex)):
            return _Match(family, p, 0, p, p)
        # resync: of the first anchors after the difference that the exemplar holds after it
        # too, the one starting the longest shared run (a field like "id 0f3a-40d2" vs
        # "1f3a-41d2" has short equal pieces inside it)
        best = _Match(family, p, 0, p, p)
        tried = 0
        for anchor, pos in found.items():  # (in order of position: ``anchors``)
            epos = family.exemplar_anchors.get(anchor)
            if pos <= p or epos is None or epos <= p or pos < best.member_end + best.shared_after:
                continue
            back = 0
            while (pos - back > p and epos - back > p
                   and head[pos - back - 1] == ex[epos - back - 1]):
                back += 1
            forward = common_prefix(head[pos:], ex[epos:])
            if back + forward > best.shared_after:
                best = _Match(family, p, back + forward, pos - back, epos - back)
            tried += 1
            if tried == MAX_RESYNC_ANCHORS or best.shared_after >= self.min_shared_after_tokens:
                break
        return best

    def _found(self, head: list[int], found: dict[int, int], tenant: str | None) -> _Family:
        while len(self._families) >= self.max_families:
            _, old = self._families.popitem(last=False)
            by_anchor = self._by_anchor.get(old.tenant, {})
            for anchor in old.exemplar_anchors:
                if by_anchor.get(anchor) == old.family_id:
                    del by_anchor[anchor]
        fid = self._family_id((tenant or "").encode() + b"\x00"
                              + array("q", head[:self.block_size]).tobytes())
        while fid in self._families:  # same first block, another family (e.g. a short header)
            fid = self._family_id(fid.encode())
        kept = dict(itertools.islice(found.items(), MAX_ANCHORS))  # the first, by position
        family = _Family(fid, tenant, array("q", head), kept)
        self._families[fid] = family
        by_anchor = self._by_anchor.setdefault(tenant, {})
        for anchor in kept:
            by_anchor.setdefault(anchor, fid)
        return family

    def _family_id(self, data: bytes) -> str:
        """``FAMILY_ID_HEX`` hex digits of HMAC-SHA256(``id_key``, ``data``): a PRF under a
        secret key, so neither computable nor invertible without it."""
        return hmac.new(self._id_key, data, hashlib.sha256).hexdigest()[:FAMILY_ID_HEX]

    def _account_match(self, family: _Family, head: list[int], m: _Match,
                       tenant: str | None) -> None:
        b = self.block_size
        family.shared_prefix_tokens = (m.prefix if family.shared_prefix_tokens is None
                                       else min(family.shared_prefix_tokens, m.prefix))
        if m.shared_after < self.min_shared_after_tokens:
            return
        # a near miss: everything after the difference could have been reused
        self.near_misses += 1
        self._counts_of(tenant).near_misses += 1
        family.near_miss_requests += 1
        shared_end = m.member_end + m.shared_after
        family.near_miss_lost_tokens += max(shared_end // b * b - m.prefix // b * b, 0)
        member_text = self._text(head[m.prefix:m.member_end])
        exemplar_text = self._text(family.exemplar[m.prefix:m.exemplar_end])
        context = self._text(head[max(m.prefix - CONTEXT_TOKENS, 0):m.member_end + CONTEXT_TOKENS])
        kind = classify(context) if context is not None else "tokens"
        family.variable_kinds[kind] = family.variable_kinds.get(kind, 0) + 1
        family.variable_starts[m.prefix] = family.variable_starts.get(m.prefix, 0) + 1
        if len(family.examples) < MAX_EXAMPLES:
            family.examples.append({
                "kind": kind,
                "first_differing_token": m.prefix, "first_differing_block": m.prefix // b,
                "member_tokens": [m.prefix, m.member_end],
                "exemplar_tokens": [m.prefix, m.exemplar_end],
                "member_text": member_text, "exemplar_text": exemplar_text,
                "context": context,
                "shared_after_tokens": m.shared_after,
            })

    def _text(self, tokens: Sequence[int]) -> str | None:
        if self.decode is None:
            return None
        try:
            return self.decode(list(tokens))
        except Exception:  # a decoder failing on odd ids must not break the audit
            return None

    def report(self, top_k: int = DEFAULT_TOP_K, tenant: str | None = None,
               all_tenants: bool = True) -> dict[str, Any]:
        """The top ``top_k`` families by requests, JSON-ready. ``all_tenants`` False: only
        ``tenant``'s families and request counts (what a tenant may see)."""
        with self._lock:
            families = [f for f in self._families.values() if all_tenants or f.tenant == tenant]
            families.sort(key=lambda f: (-f.requests, f.family_id))
            rows = [self._row(f) for f in families[:max(top_k, 0)]]
            counts = (_TenantCounts(self.observed, self.near_misses, self.dropped) if all_tenants
                      else self._counts.get(tenant, _TenantCounts()))
            return {"block_size": self.block_size, "head_tokens": self.head_tokens,
                    "observed_requests": counts.observed,
                    "near_miss_requests": counts.near_misses,
                    "dropped_requests": counts.dropped, "families_tracked": len(families),
                    "max_families": self.max_families, "families": rows}

    def top_families(self, top_k: int = DEFAULT_TOP_K) -> list[dict[str, Any]]:
        """``report(top_k)["families"]`` (for the metrics collector)."""
        return list(self.report(top_k)["families"])

    def _row(self, f: _Family) -> dict[str, Any]:
        b = self.block_size
        shared = f.shared_prefix_tokens
        waste: dict[str, Any] | None = None
        if shared is not None and 0 < shared < len(f.exemplar):
            lost = shared % b
            waste = {"shared_prefix_tokens": shared, "reusable_tokens": shared - lost,
                     "tokens_lost_to_rounding": lost,
                     "flagged": lost > 0 and lost / shared >= DEFAULT_WASTE_FRACTION}
        engine_rate = (f.engine_hit_tokens / f.engine_prompt_tokens
                       if f.engine_prompt_tokens else None)
        predicted_rate = f.predicted_hit_tokens / f.prompt_tokens if f.prompt_tokens else 0.0
        start = max(f.variable_starts.items(), key=lambda kv: kv[1])[0] if f.variable_starts else None
        finding = None
        if f.near_miss_requests:
            kind = max(f.variable_kinds.items(), key=lambda kv: kv[1])[0]
            finding = (f"{f.near_miss_requests} of {f.requests} requests differ from the first "
                       f"at token {start} (block {start // b if start is not None else '?'}) in "
                       f"what looks like a {kind}, then share "
                       f"{f.examples[0]['shared_after_tokens'] if f.examples else '?'}+ tokens: "
                       f"move the {kind} after the shared content")
        return {
            "family": f.family_id, "tenant": f.tenant, "name": self._name(f),
            "requests": f.requests, "prompt_tokens": f.prompt_tokens,
            "hit_rate": engine_rate if engine_rate is not None else predicted_rate,
            "hit_rate_source": "engine" if engine_rate is not None else "predicted",
            "engine_hit_rate": engine_rate, "predicted_hit_rate": predicted_rate,
            "near_miss_requests": f.near_miss_requests,
            "near_miss_lost_tokens": f.near_miss_lost_tokens,
            "variable_field": finding, "near_miss_examples": list(f.examples),
            "block_boundary": waste,
        }

    def _name(self, f: _Family) -> str:
        """The exemplar's first words, with a near-miss field shown as «...»."""
        ex = f.exemplar
        if f.examples:
            e = f.examples[0]
            start, end = e["exemplar_tokens"]
            before = self._text(ex[:start])
            after = self._text(ex[end:end + 12])
            if before is not None and after is not None:
                before = " ".join(before.split())
                before = before if len(before) <= 70 else "…" + before[-69:]
                return _squash(f"{before}«{e['exemplar_text']}»{after}")
        text = self._text(ex[:24])
        return _squash(text) if text is not None else " ".join(map(str, ex[:12]))


def _squash(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


HEAD_CHARS_PER_TOKEN: Final = 8  # characters of text tokenized per head token wanted (generous)


def prompt_head(spec: Any, tokenizer: Any, max_tokens: int) -> list[int] | None:
    """The first ``max_tokens`` prompt tokens of a parsed request (``router.request.prompts.PromptSpec``):
    token ids as given, else the head of its text (a chat request's rendering from the
    tokenizer's render cache) tokenized by ``tokenizer`` (``PromptTokenizer``) in the request's
    ``cache_salt`` partition of its caches (the tenant's, as routing used). The last few
    tokens of a cut text may differ from the whole text's and are dropped. ``None`` when the
    prompt cannot be had without rendering again or without a tokenizer."""
    if spec.token_ids is not None:
        return list(spec.token_ids[:max_tokens])
    if tokenizer is None:
        return None
    text = spec.text if spec.text is not None else tokenizer.rendered_chat(spec, cached_only=True)
    if text is None:
        return None
    limit = max_tokens * HEAD_CHARS_PER_TOKEN
    cut = len(text) > limit
    tokens = tokenizer.encode_text(text[:limit], spec.add_special_tokens, spec.cache_salt)
    if cut:
        tokens = tokens[:-ANCHOR_WINDOW]
    return list(tokens[:max_tokens])


def format_report(report: dict[str, Any]) -> str:
    """A ``report`` as the text ``prefix-router audit`` prints: one paragraph per family."""
    lines = [f"{report['observed_requests']} requests, {report['families_tracked']} prefix "
             f"families, {report['near_miss_requests']} near misses (block size "
             f"{report['block_size']})"]
    for f in report["families"]:
        lines.append("")
        lines.append(f"family {f['family']}: {f['requests']} requests, hit rate "
                     f"{f['hit_rate']:.1%} ({f['hit_rate_source']})  \"{f['name']}\"")
        if f["variable_field"]:
            lines.append(f"  near miss: {f['variable_field']} ({f['near_miss_lost_tokens']:,} "
                         f"reusable tokens lost in all)")
            for e in f["near_miss_examples"][:2]:
                lines.append(f"    tokens {e['member_tokens'][0]}-{e['member_tokens'][1]}: "
                             f"{e['member_text']!r} where the first had {e['exemplar_text']!r}")
        waste = f["block_boundary"]
        if waste and waste["flagged"]:
            lines.append(f"  block boundary: the shared prefix is {waste['shared_prefix_tokens']} "
                         f"tokens, {waste['tokens_lost_to_rounding']} past a block boundary: "
                         f"only {waste['reusable_tokens']} are reusable")
    return "\n".join(lines)
