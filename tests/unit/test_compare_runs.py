"""Which runs a ``compare --policies ... --peers ...`` asks for: own policies, named peers, and
the peers ``--peers auto`` adds or skips (with the reason) by what is installed here."""

from __future__ import annotations

import pytest

from loadtest.compare.runs import PEER_SPECS, resolve_runs
from loadtest.harness.fleet import OURS, SGLANG, SMG, RouterSpec, peer_available


def test_own_policies_and_named_peers_in_order() -> None:
    runs, skipped = resolve_runs("prefix, round_robin", "no")
    assert runs == (RouterSpec(OURS, "prefix"), RouterSpec(OURS, "round_robin"))
    assert skipped == {}


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        resolve_runs("prefix,fastest", "no")
    with pytest.raises(ValueError, match="unknown router 'nginx'"):
        resolve_runs("nginx:round_robin", "no")
    with pytest.raises(ValueError, match="--peers must be"):
        resolve_runs("prefix", "maybe")


@pytest.mark.skipif(peer_available(SGLANG), reason="sglang-router is installed here")
def test_a_named_peer_that_is_not_installed_is_refused_before_any_fleet_starts() -> None:
    with pytest.raises(ValueError, match="sglang is not installed, so sglang:cache_aware"):
        resolve_runs("prefix,sglang:cache_aware", "no")


def test_peers_auto_adds_smg_and_vllm_router_runs_or_says_why_not() -> None:
    runs, skipped = resolve_runs("prefix", "auto")
    assert runs[0] == RouterSpec(OURS, "prefix")
    assert {RouterSpec(SMG, "cache_aware"), RouterSpec(SMG, "prefix_hash")} <= set(PEER_SPECS)
    for spec in PEER_SPECS:
        if peer_available(spec.kind):
            assert spec in runs and spec.label not in skipped
        else:
            assert spec not in runs and "not installed" in skipped[spec.label]
    # the old gateway is no longer one of the default peers
    assert all(spec.kind != SGLANG for spec in runs)
