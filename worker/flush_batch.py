"""What the writer sends its two scripts (pure, no I/O): the net effect of queued changes per
tier (``net_changes``), one flush's ARGV and stream entry (``flush_batch``) and one heartbeat's
ARGV (``heartbeat_args``), in the layout ``worker/replica_store.py``'s ``_FLUSH`` and
``_HEARTBEAT`` read (``router/shared/contract.py``, version 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.shared import contract
from router.shared.contract import OP_CLEARED, OP_STORED, TIER_CPU, TIER_GPU, BlockKey
from worker.replica_view import Change


def net_changes(changes: list[Change], tier: str = TIER_GPU,
                ) -> tuple[bool, list[BlockKey], list[BlockKey]]:
    """Net effect of queued changes on ``tier``'s set: ``(cleared, stored, removed)``; a key's
    last change wins.

    ``cleared``: some change reset the sets (it and what follows are kept, what came before
    it is superseded). Every key is in at most one of ``stored`` and ``removed``.
    """
    cleared = False
    last: dict[BlockKey, bool] = {}  # {block key: True if its last change stored it}
    for change in changes:
        if change.op == OP_CLEARED:
            cleared = True
            last = dict.fromkeys(change.keys if tier == TIER_GPU else change.cpu_keys, True)
        elif change.tier != tier:
            continue
        elif change.op == OP_STORED:
            last.update(dict.fromkeys(change.keys, True))
        else:
            last.update(dict.fromkeys(change.keys, False))
    stored = [k for k, v in last.items() if v]
    removed = [] if cleared else [k for k, v in last.items() if not v]
    return cleared, stored, removed


@dataclass(frozen=True, slots=True)
class FlushBatch:
    """One flush: the script's ARGV and the stream entry that follows it."""

    epoch: int
    seq: int
    entry_seq: int  # of ``entry``, or the last one written when there is none
    args: list[Any]  # the flush script's ARGV
    entry: dict[Any, Any] | None  # the stream entry; None when nothing changed
    num_keys: int  # keys stored or removed, both tiers


def flush_batch(changes: list[Change], position: tuple[int, int], entry_seq: int,
                replica_id: str, state_ttl_ms: int,
                heartbeat: tuple[dict[Any, Any], int] | None) -> FlushBatch:
    """The flush of ``changes`` at ``position`` (epoch, seq), after stream entry ``entry_seq``;
    ``heartbeat`` ``(fields, ttl_ms)`` makes it re-create the heartbeat hash (its epoch, seq and
    entry_seq fields are the script's own, so they are dropped from ``fields``)."""
    cleared, stored, removed = net_changes(changes)
    _, cpu_stored, cpu_removed = net_changes(changes, TIER_CPU)
    epoch, seq = position
    has_entry = cleared or bool(stored or removed or cpu_stored or cpu_removed)
    if has_entry:
        entry_seq += 1
    packed_stored, packed_removed = contract.pack_keys(stored), contract.pack_keys(removed)
    packed_cpu_stored = contract.pack_keys(cpu_stored)
    packed_cpu_removed = contract.pack_keys(cpu_removed)
    args: list[Any] = [epoch, seq, "1" if cleared else "0", packed_stored, packed_removed,
                       entry_seq]
    if heartbeat is not None:
        mapping, ttl_ms = heartbeat
        for name in (contract.F_EPOCH, contract.F_SEQ, contract.F_ENTRY_SEQ):
            mapping.pop(name, None)
        args += [ttl_ms, packed_cpu_stored, packed_cpu_removed, state_ttl_ms]
        for name, value in mapping.items():
            args += [name, value]
    else:
        args += ["", packed_cpu_stored, packed_cpu_removed, state_ttl_ms]
    entry: dict[Any, Any] = {
        contract.E_REPLICA: replica_id, contract.E_EPOCH: epoch,
        contract.E_ENTRY_SEQ: entry_seq, contract.E_CLEARED: "1" if cleared else "0",
        contract.E_STORED: packed_stored, contract.E_REMOVED: packed_removed}
    if cpu_stored:
        entry[contract.E_CPU_STORED] = packed_cpu_stored
    if cpu_removed:
        entry[contract.E_CPU_REMOVED] = packed_cpu_removed
    return FlushBatch(epoch, seq, entry_seq, args, entry if has_entry else None,
                      len(stored) + len(removed) + len(cpu_stored) + len(cpu_removed))


def heartbeat_args(fields: dict[Any, Any], sent: dict[Any, Any], ttl_ms: int, state_ttl_ms: int,
                   *, hash_expected: bool, oom_form: bool) -> list[Any]:
    """The heartbeat script's ARGV: the hash's TTL, whether it must exist (``hash_expected``),
    the sets' TTL, the HSET's place (before the PEXPIREs, or after them in the out-of-memory
    form) and the ``fields`` whose value differs from ``sent`` (all of them when the hash is
    not expected: it was lost, or is new)."""
    # only fields that changed since the last heartbeat this writer wrote: the hash keeps
    # the others (a lost hash is detected and rewritten in full)
    sent = sent if hash_expected else {}
    args: list[Any] = [ttl_ms, "1" if hash_expected else "0", state_ttl_ms,
                       "1" if not oom_form else "0"]
    for name, value in fields.items():
        if sent.get(name) != value:
            args += [name, value]
    return args
