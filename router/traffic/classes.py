"""Priority classes and tenant traffic settings: which class a request is in, and each tenant's
default class and fair-share weight. Pure apart from reading the tenant file.

A request's class comes from, first to last: the ``x-priority-class`` header (a class name),
the body's ``priority`` (vLLM's integer field, lower first: clamped to the class ranks, so 0 is
the highest class and anything past the last is the last), the tenant's default class, the
router's default class. With API keys on, a request may lower its class below its tenant's
default but never raise it above (a header is the client's claim; the tenant file is the
operator's).

Tenant file (YAML), one entry per tenant (the API-key file's tenant names)::

    tenants:
      chat-app: {priority_class: interactive, weight: 3}
      nightly-batch: {priority_class: batch, requests_per_min: 600, tokens_per_min: 2000000}
      support-bot: {priority_class: interactive, ttft_targets_s: {interactive: 1.5}}

``weight`` (> 0, default 1) is the tenant's share of the fleet against the other tenants of its
class while requests wait (``router.traffic.scheduling``). ``requests_per_min`` and
``tokens_per_min`` (integers >= 0; 0: none) replace the router's default rate limits for the
tenant (``router.traffic.rate_limits``). ``ttft_targets_s`` (``{class: seconds > 0}``)
replaces the router's TTFT targets (``admission_ttft_targets``) of those classes for the
tenant's requests (SLO-aware admission, ``router.traffic.admission.slo_verdict``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from router.request.errors import BadRequest

PRIORITY_HEADER: Final = "x-priority-class"
DEFAULT_CLASSES: Final = ("interactive", "standard", "batch")
DEFAULT_CLASS: Final = "standard"
DEFAULT_AGING_S: Final = 10.0  # seconds of waiting that raise a class one rank: the lowest of the
# three default classes reaches the top after 20 s, within the default 30 s wait bound


class TenantFileError(ValueError):
    """The tenant file cannot be used (the message names the file and the entry)."""


@dataclass(frozen=True, slots=True)
class TenantTraffic:
    """One tenant's traffic settings."""

    priority_class: str | None = None  # None: the router's default class
    weight: float = 1.0
    requests_per_min: int | None = None  # rate limits (router.traffic.rate_limits); None: the
    tokens_per_min: int | None = None  # router's defaults; 0: none
    # {class name: TTFT target seconds} replacing the router's for this tenant's requests
    ttft_targets_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PriorityClasses:
    """The class names, highest first (rank = position), and the default class.

    Raises ``ValueError`` for no class, a repeated name or a default not among them.
    """

    names: tuple[str, ...] = DEFAULT_CLASSES
    default: str = DEFAULT_CLASS
    tenants: Mapping[str, TenantTraffic] = field(default_factory=dict)  # {tenant: settings}
    ttft_targets_s: Mapping[str, float] = field(default_factory=dict)  # {class: TTFT target s}

    def __post_init__(self) -> None:
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError("priority classes must be distinct names, at least one")
        if self.default not in self.names:
            raise ValueError(f"default priority class {self.default!r} is not one of "
                             f"{', '.join(self.names)}")
        self._check_targets("TTFT targets", self.ttft_targets_s)
        for tenant, traffic in self.tenants.items():
            if traffic.priority_class is not None and traffic.priority_class not in self.names:
                raise ValueError(f"tenant {tenant!r}: priority class {traffic.priority_class!r} "
                                 f"is not one of {', '.join(self.names)}")
            self._check_targets(f"tenant {tenant!r}: ttft_targets_s", traffic.ttft_targets_s)

    def _check_targets(self, what: str, targets: Mapping[str, float]) -> None:
        for name, seconds in targets.items():
            if name not in self.names:
                raise ValueError(f"{what}: {name!r} is not one of {', '.join(self.names)}")
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{what}: {name}'s target must be > 0 seconds, got {seconds}")

    def ttft_target_s(self, rank: int, tenant: str | None) -> float | None:
        """The TTFT target (seconds) of a request of class ``rank`` from ``tenant``: the
        tenant file's for that class, else the router's; None: no target."""
        name = self.names[min(rank, len(self.names) - 1)]
        traffic = self.tenants.get(tenant) if tenant is not None else None
        if traffic is not None and name in traffic.ttft_targets_s:
            return traffic.ttft_targets_s[name]
        return self.ttft_targets_s.get(name)

    def rank(self, name: str) -> int:
        """The rank of class ``name`` (0 the highest). Raises ``BadRequest`` if unknown."""
        try:
            return self.names.index(name.strip().lower())
        except ValueError:
            raise BadRequest(f"unknown priority class {name!r} ({PRIORITY_HEADER}): one of "
                             f"{', '.join(self.names)}") from None

    def tenant_rank(self, tenant: str | None) -> int:
        """The default rank of ``tenant``'s requests (the router's default class if unlisted)."""
        traffic = self.tenants.get(tenant) if tenant is not None else None
        name = traffic.priority_class if traffic is not None else None
        return self.names.index(name or self.default)

    def weight_of(self, tenant: str) -> float:
        """``tenant``'s fair-share weight (1 if unlisted)."""
        traffic = self.tenants.get(tenant)
        return traffic.weight if traffic is not None else 1.0

    def request_rank(self, header: str | None, body_priority: Any, tenant: str | None,
                     authenticated: bool) -> int:
        """The rank of one request (see the module docstring). Raises ``BadRequest`` for an
        unknown class name or a ``priority`` that is not an integer."""
        default = self.tenant_rank(tenant)
        if header is not None:
            rank = self.rank(header)
        elif body_priority is not None:
            if isinstance(body_priority, bool) or not isinstance(body_priority, int):
                raise BadRequest("'priority' must be an integer")
            rank = min(max(body_priority, 0), len(self.names) - 1)
        else:
            return default
        return max(rank, default) if authenticated else rank


_TENANT_KEYS: Final = ("priority_class", "weight", "requests_per_min", "tokens_per_min",
                        "ttft_targets_s")


def parse_ttft_targets(specs: Sequence[str]) -> dict[str, float]:
    """``{class: seconds}`` from ``CLASS=SECONDS`` strings (``admission_ttft_targets``), class
    names lower-cased. Raises ``ValueError`` for a malformed entry or a repeated class."""
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip().lower()
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not sep or not name or not math.isfinite(seconds) or name in out:
            raise ValueError(f"expected distinct CLASS=SECONDS entries, got {spec!r}")
        out[name] = seconds
    return out


def parse_tenants(data: Any, source: str) -> dict[str, TenantTraffic]:
    """``{tenant: TenantTraffic}`` from a tenant file's parsed YAML (``{"tenants": {...}}``).
    Raises ``TenantFileError`` naming ``source`` and the bad entry."""
    if not isinstance(data, Mapping) or not isinstance(data.get("tenants", {}), Mapping):
        raise TenantFileError(f"{source}: expected a mapping with a 'tenants' mapping")
    out: dict[str, TenantTraffic] = {}
    for tenant, entry in data.get("tenants", {}).items():
        entry = entry or {}
        if not isinstance(entry, Mapping) or set(entry) - set(_TENANT_KEYS):
            raise TenantFileError(f"{source}: tenant {tenant!r}: expected some of "
                                  f"{', '.join(_TENANT_KEYS)}, got {entry!r}")
        rates = {key: entry.get(key) for key in ("requests_per_min", "tokens_per_min")}
        for key, rate in rates.items():
            if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int)
                                     or rate < 0):
                raise TenantFileError(f"{source}: tenant {tenant!r}: {key} must be an integer "
                                      f">= 0, got {rate!r}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise TenantFileError(f"{source}: tenant {tenant!r}: weight must be a number > 0, "
                                  f"got {weight!r}")
        cls = entry.get("priority_class")
        if cls is not None and not isinstance(cls, str):
            raise TenantFileError(f"{source}: tenant {tenant!r}: priority_class must be a name")
        targets = entry.get("ttft_targets_s") or {}
        if not isinstance(targets, Mapping) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in targets.values()):
            raise TenantFileError(f"{source}: tenant {tenant!r}: ttft_targets_s must map class "
                                  f"names to seconds, got {targets!r}")
        out[str(tenant)] = TenantTraffic(
            cls.strip().lower() if cls else None, float(weight), **rates,
            ttft_targets_s={str(k).strip().lower(): float(v) for k, v in targets.items()})
    return out


def load_tenant_file(path: str) -> dict[str, TenantTraffic]:
    """The tenant file at ``path`` (module docstring). Raises ``TenantFileError``."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TenantFileError(f"cannot read tenant file {path}: {exc}") from exc
    return parse_tenants(data or {}, path)


def priority_classes(names: Sequence[str], default: str,
                     tenants: Mapping[str, TenantTraffic] | None = None,
                     ttft_targets: Sequence[str] = ()) -> PriorityClasses:
    """``PriorityClasses`` with names lower-cased, ``ttft_targets`` as ``CLASS=SECONDS``
    strings. Raises ``ValueError`` as it and ``parse_ttft_targets`` do."""
    return PriorityClasses(tuple(n.strip().lower() for n in names), default.strip().lower(),
                           dict(tenants or {}), parse_ttft_targets(ttft_targets))
