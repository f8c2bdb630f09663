"""Priority classes and tenant traffic settings (issue 33, step 2): which class a request is in.
Pure tables for ``router.traffic.classes``."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from router.request.errors import BadRequest
from router.traffic.classes import (
    PriorityClasses,
    TenantFileError,
    TenantTraffic,
    parse_tenants,
    priority_classes,
)

TENANTS = {"chat": TenantTraffic("interactive", 3.0), "nightly": TenantTraffic("batch")}
CLASSES = priority_classes(["Interactive", "standard", "batch"], "Standard", TENANTS)


@pytest.mark.parametrize(("header", "priority", "tenant", "keys", "rank"), [
    (None, None, None, False, 1),  # the router's default
    (None, None, "chat", True, 0),  # the tenant's default
    (None, None, "unlisted", True, 1),
    ("batch", None, None, False, 2),  # the header wins over the body
    ("BATCH ", 0, None, False, 2),
    (None, 0, None, False, 0),  # vLLM's priority: lower first, clamped to the ranks
    (None, -5, None, False, 0),
    (None, 7, None, False, 2),
    ("interactive", None, "nightly", True, 2),  # with keys: never above the tenant's default
    ("batch", None, "chat", True, 2),  # but lower is fine
    ("interactive", None, "nightly", False, 0),  # without keys the tenant is no identity
])
def test_request_rank(header: str | None, priority: Any, tenant: str | None, keys: bool,
                      rank: int) -> None:
    assert CLASSES.request_rank(header, priority, tenant, keys) == rank


@pytest.mark.parametrize(("header", "priority", "message"), [
    ("urgent", None, "unknown priority class 'urgent'"),
    (None, "high", "'priority' must be an integer"),
    (None, True, "'priority' must be an integer"),
])
def test_bad_class_is_a_400(header: str | None, priority: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        CLASSES.request_rank(header, priority, None, False)


def test_weights() -> None:
    assert CLASSES.weight_of("chat") == 3.0 and CLASSES.weight_of("anyone") == 1.0


def test_classes_validated() -> None:
    with pytest.raises(ValueError, match="distinct"):
        PriorityClasses(("a", "a"), "a")
    with pytest.raises(ValueError, match="default priority class"):
        PriorityClasses(("a", "b"), "c")
    with pytest.raises(ValueError, match="tenant 'x'"):
        PriorityClasses(("a",), "a", {"x": TenantTraffic("b")})


def test_tenant_file() -> None:
    text = "tenants:\n  chat: {priority_class: Interactive, weight: 3}\n  nightly:\n"
    assert parse_tenants(yaml.safe_load(text), "t.yaml") == {
        "chat": TenantTraffic("interactive", 3.0), "nightly": TenantTraffic(None, 1.0)}
    for bad, message in (("[1]", "expected a mapping"),
                         ("tenants: {a: {weight: 0}}", "weight must be a number > 0"),
                         ("tenants: {a: {weight: yes}}", "weight must be a number > 0"),
                         ("tenants: {a: {class: x}}", "expected some of priority_class, weight"),
                         ("tenants: {a: {priority_class: 3}}", "priority_class must be a name")):
        with pytest.raises(TenantFileError, match=message):
            parse_tenants(yaml.safe_load(bad), "t.yaml")


def test_tenant_file_rate_limits() -> None:
    tenants = parse_tenants({"tenants": {"a": {"requests_per_min": 10, "tokens_per_min": 0},
                                         "b": {"weight": 2}}}, "t.yaml")
    assert (tenants["a"].requests_per_min, tenants["a"].tokens_per_min) == (10, 0)
    assert tenants["b"].requests_per_min is None  # the router's default
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(TenantFileError, match="requests_per_min"):
            parse_tenants({"tenants": {"a": {"requests_per_min": bad}}}, "t.yaml")
