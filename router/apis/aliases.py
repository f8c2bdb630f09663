"""Model aliases: a client-facing model name mapped to a served model, or split by weight
between served models (a canary). Pure.

An alias is declared as one string (the ``model_aliases`` setting, one entry per alias):

- ``NAME=MODEL``: every request naming ``NAME`` goes to ``MODEL`` (a served base model or a
  LoRA adapter name);
- ``NAME=MODEL_A:WEIGHT_A;MODEL_B:WEIGHT_B``: a weighted split (a canary); weights are
  positive integers (percentages, or any other unit: only their ratio counts).

The request body's ``model`` is rewritten to the chosen served model before routing, so the
engine sees a name it serves and the router's model filter, LoRA keys and prefix index work as
for a request that named it. The split is smooth weighted round-robin (nginx's
``ngx_http_upstream_get_peer``): deterministic, and every run of ``sum(weights)`` consecutive
requests of an alias gives each target exactly its weight, so the split holds over any window,
not only on average. Each router process keeps its own rotation (several routers each honour
the weights, so their sum does too). A conversation whose turns are split between two models
does not keep its prefix cache across them: a canary trades that affinity for the split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.shared.settings import ConfigError

MAX_TARGETS: Final = 8  # targets of one alias (a canary uses two)
OWNED_BY: Final = "prefix-router"  # ``owned_by`` of an alias's /v1/models card


@dataclass(frozen=True, slots=True)
class AliasTarget:
    """One served model of an alias and its weight (a positive integer; 1 for a plain alias)."""

    model: str
    weight: int = 1


@dataclass(frozen=True, slots=True)
class Alias:
    """A client-facing ``name`` and the served models it maps to (one, or a weighted split)."""

    name: str
    targets: tuple[AliasTarget, ...]


def parse_alias(spec: str) -> Alias:
    """``NAME=MODEL`` or ``NAME=MODEL_A:WEIGHT_A;MODEL_B:WEIGHT_B`` -> ``Alias``.

    A single target takes the whole text after ``=`` as the model name (colons included); in a
    split each part's weight is what follows its last colon. Raises ``ConfigError`` for an
    empty name or model, a weight that is not a positive integer, a model named twice or more
    than ``MAX_TARGETS`` targets."""
    name, sep, rest = spec.partition("=")
    name, rest = name.strip(), rest.strip()
    if not sep or not name or not rest:
        raise ConfigError(
            f"model alias {spec!r}: expected NAME=MODEL or NAME=MODEL_A:WEIGHT_A;MODEL_B:WEIGHT_B",
            "model_aliases",
        )
    if ";" not in rest:
        return Alias(name, (AliasTarget(rest),))
    targets = []
    for part in rest.split(";"):
        model, colon, weight_text = part.strip().rpartition(":")
        model = model.strip()
        try:
            weight = int(weight_text)
        except ValueError:
            weight = 0
        if not colon or not model or weight < 1:
            raise ConfigError(
                f"model alias {name!r}: split part {part.strip()!r} must be "
                "MODEL:WEIGHT with a positive integer weight",
                "model_aliases",
            )
        targets.append(AliasTarget(model, weight))
    models = [t.model for t in targets]
    if len(set(models)) != len(models):
        raise ConfigError(f"model alias {name!r} names a model twice: {models}", "model_aliases")
    if len(targets) > MAX_TARGETS:
        raise ConfigError(f"model alias {name!r}: at most {MAX_TARGETS} targets", "model_aliases")
    return Alias(name, tuple(targets))


class AliasTable:
    """The configured aliases and each one's split rotation (mutable: ``resolve`` advances it).

    Raises ``ConfigError`` (construction) when a name is declared twice or a target is itself
    an alias (aliases do not chain: one rewrite, to a served model)."""

    def __init__(self, aliases: Iterable[Alias]) -> None:
        self.aliases: dict[str, Alias] = {}  # {alias name: Alias}
        for alias in aliases:
            if alias.name in self.aliases:
                raise ConfigError(f"model alias {alias.name!r} is declared twice", "model_aliases")
            self.aliases[alias.name] = alias
        for alias in self.aliases.values():
            for target in alias.targets:
                if target.model in self.aliases:
                    raise ConfigError(
                        f"model alias {alias.name!r} targets alias "
                        f"{target.model!r}: aliases do not chain",
                        "model_aliases",
                    )
        # smooth weighted round-robin state: {alias name: current weight per target}
        self._current: dict[str, list[int]] = {
            name: [0] * len(a.targets) for name, a in self.aliases.items()
        }

    @classmethod
    def from_specs(cls, specs: Sequence[str]) -> AliasTable:
        """The table of ``model_aliases`` strings (``parse_alias``). Raises ``ConfigError``."""
        return cls(parse_alias(spec) for spec in specs)

    def __bool__(self) -> bool:
        return bool(self.aliases)

    def __contains__(self, name: object) -> bool:
        return name in self.aliases

    def resolve(self, name: str, *, advance: bool = True) -> str | None:
        """The served model a request naming ``name`` goes to (advancing the alias's split
        unless ``advance`` is false: ``/debug/route`` only looks), or ``None`` when ``name`` is
        no alias. Smooth weighted round-robin: every target's current weight grows by its
        weight, the largest (first on ties) is chosen and loses the total."""
        alias = self.aliases.get(name)
        if alias is None:
            return None
        targets = alias.targets
        if len(targets) == 1:
            return targets[0].model
        current = self._current[name] if advance else list(self._current[name])
        total = 0
        best = 0
        for i, target in enumerate(targets):
            current[i] += target.weight
            total += target.weight
            if current[i] > current[best]:
                best = i
        current[best] -= total
        return targets[best].model

    def cards(self, served: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``/v1/models`` cards of the aliases some target of which is served (``served``:
        ``{model id: card}`` of the fleet's served models): ``root`` names the first served
        target, ``parent`` is null, ``owned_by`` is ``OWNED_BY``; the split is in
        ``prefix_router_targets`` (``[{"model", "weight"}]``)."""
        cards = []
        for name, alias in sorted(self.aliases.items()):
            live = [t.model for t in alias.targets if t.model in served]
            if not live:
                continue
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": OWNED_BY,
                    "root": live[0],
                    "parent": None,
                    "prefix_router_targets": [
                        {"model": t.model, "weight": t.weight} for t in alias.targets
                    ],
                }
            )
        return cards
