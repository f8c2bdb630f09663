"""The router Deployment stops gracefully: a preStop wait, then a grace period that covers the
router's own shutdown timeout (rendered offline, as in ``test_chart``)."""

from __future__ import annotations

from typing import Any

import helm_python as helm

from tests.helm.test_chart import chart, containers, env_of, one, render

__all__ = ["chart"]  # the module fixture, shared


def test_router_gets_a_prestop_wait_and_a_grace_period_covering_its_stream_timeout(
        chart: helm.Chart) -> None:
    for shutdown, grace in (({}, 5 + 120 + 5), ({"preStopSeconds": 10, "timeoutSeconds": 600},
                                                10 + 600 + 5)):
        values: dict[str, Any] = {"router": {"shutdown": shutdown}} if shutdown else {}
        objects = render(chart, values)
        pod = one(objects, "Deployment", "router")["spec"]["template"]["spec"]
        router = containers(objects, "Deployment", "router")["router"]
        assert pod["terminationGracePeriodSeconds"] == grace
        wait = str(shutdown.get("preStopSeconds", 5))
        assert router["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", wait]
        assert env_of(router)["ROUTER_SHUTDOWN_TIMEOUT_S"] == str(shutdown.get("timeoutSeconds",
                                                                              120))
