"""Admission settings in the chart: ``router.admission`` reaches the router's YAML config under
the router's own setting names, the router's config loader takes it, and the schema refuses
what the router would (rendered offline, as in ``test_chart``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import helm_python as helm
import pytest

from tests.helm.test_chart import NAMESPACE, RELEASE, chart, one, render, router_config

if TYPE_CHECKING:
    from router.service.config import RouterConfig

__all__ = ["chart"]  # the module fixture, shared


def test_admission_values_reach_the_router(chart: helm.Chart, tmp_path: Path) -> None:
    from router.service.config import load_config

    assert router_config(render(chart, {}))["admission_max_inflight"] == 0  # off by default
    values = {"maxInflight": 64, "maxInflightPerReplica": 8, "maxQueuedPrefillSeconds": 2.5,
              "maxQueueLength": 200, "maxQueueWaitSeconds": 12}
    objects = render(chart, {"router": {"admission": values}})
    path = tmp_path / "router.yaml"
    path.write_text(one(objects, "ConfigMap", "-router")["data"]["router.yaml"])
    limits = load_config(["--config", str(path)], env={}).admission_limits()
    assert (limits.max_inflight, limits.max_inflight_per_replica, limits.max_queued_prefill_s,
            limits.max_queue_length, limits.max_queue_wait_s) == (64, 8, 2.5, 200, 12)
    assert limits.enabled


@pytest.mark.parametrize(("admission", "where"), [
    ({"maxInflight": -1}, "/router/admission/maxInflight"),
    ({"maxQueueLength": 0}, "/router/admission/maxQueueLength"),
    ({"maxQueueWaitSeconds": 0}, "/router/admission/maxQueueWaitSeconds"),
    ({"maxQueue": 5}, "/router/admission"),
])
def test_admission_values_the_router_would_refuse_fail_to_render(
        chart: helm.Chart, admission: dict[str, int], where: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render({"router": {"admission": admission}}, name=RELEASE, namespace=NAMESPACE)
    assert where in str(info.value)


def test_grafana_dashboard_shows_admission(chart: helm.Chart) -> None:
    cm = one(render(chart, {"grafana": {"dashboard": {"enabled": True}}}), "ConfigMap",
             "-dashboard")
    panels = json.loads(cm["data"]["prefix-router.json"])["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for series in ("router_admission_queue_length", "router_admission_inflight_requests",
                   "router_admission_requests_total", "router_admission_wait_seconds_bucket"):
        assert series in exprs
    assert len({p["id"] for p in panels}) == len(panels)


def _router_config(chart: helm.Chart, tmp_path: Path, router: dict[str, Any]) -> RouterConfig:
    """The router's config loaded from the chart rendered with ``router`` values."""
    from router.service.config import load_config

    path = tmp_path / "router.yaml"
    path.write_text(one(render(chart, {"router": router}), "ConfigMap",
                        "-router")["data"]["router.yaml"])
    return load_config(["--config", str(path)], env={})


def test_session_affinity_values_reach_the_router(chart: helm.Chart, tmp_path: Path) -> None:
    config = _router_config(chart, tmp_path, {"sessionAffinity": {"maxSessions": 500,
                                                                  "ttlSeconds": 90}})
    assert (config.session_affinity_max_sessions, config.session_affinity_ttl_s) == (500, 90)
    assert router_config(render(chart, {}))["session_affinity_max_sessions"] == 100_000
    for bad, where in (({"maxSessions": -1}, "maxSessions"), ({"ttlSeconds": 0}, "ttlSeconds")):
        with pytest.raises(helm.HelmError) as info:
            chart.render({"router": {"sessionAffinity": bad}}, name=RELEASE, namespace=NAMESPACE)
        assert f"/router/sessionAffinity/{where}" in str(info.value)


def test_rate_limit_values_reach_the_router(chart: helm.Chart, tmp_path: Path) -> None:
    config = _router_config(chart, tmp_path, {"rateLimits": {"requestsPerMinute": 600,
                                                             "tokensPerMinute": 200000}})
    assert (config.rate_limit_requests_per_min, config.rate_limit_tokens_per_min) == (600, 200000)
    assert router_config(render(chart, {}))["rate_limit_requests_per_min"] == 0  # off by default
    with pytest.raises(helm.HelmError) as info:
        chart.render({"router": {"rateLimits": {"tokensPerMinute": -1}}}, name=RELEASE,
                     namespace=NAMESPACE)
    assert "/router/rateLimits/tokensPerMinute" in str(info.value)
