"""Model aliases and canary splits of ``router.apis.aliases`` (pure)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from router.apis.aliases import Alias, AliasTable, AliasTarget, parse_alias
from router.service.config import load_config
from router.shared.settings import ConfigError


def test_a_plain_alias_keeps_colons_in_the_model_name() -> None:
    assert parse_alias("chat=Qwen/Qwen3-8B:fp8") == Alias(
        "chat", (AliasTarget("Qwen/Qwen3-8B:fp8"),)
    )


def test_a_split_names_each_model_with_its_weight() -> None:
    assert parse_alias(" chat = base:90 ; canary:v2:10 ") == Alias(
        "chat", (AliasTarget("base", 90), AliasTarget("canary:v2", 10))
    )


@pytest.mark.parametrize(
    "spec",
    [
        "chat",
        "=m",
        "chat=",
        "chat=a:90;b",
        "chat=a:0;b:1",
        "chat=a:x;b:1",
        "chat=a:1;a:2",
        "chat=:1;b:2",
        "c=" + ";".join(f"m{i}:1" for i in range(9)),
    ],
)
def test_malformed_aliases_are_config_errors_naming_the_setting(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_alias(spec)
    assert err.value.setting == "model_aliases"


def test_aliases_do_not_chain_and_are_declared_once() -> None:
    with pytest.raises(ConfigError, match="do not chain"):
        AliasTable.from_specs(["a=b", "b=m"])
    with pytest.raises(ConfigError, match="declared twice"):
        AliasTable.from_specs(["a=m", "a=n"])


def test_an_unknown_name_is_no_alias_and_a_plain_alias_always_resolves_to_its_model() -> None:
    table = AliasTable.from_specs(["chat=m"])
    assert table.resolve("other") is None
    assert [table.resolve("chat") for _ in range(3)] == ["m", "m", "m"]


def test_a_canary_split_is_honoured_within_five_percent_over_1000_requests() -> None:
    table = AliasTable.from_specs(["chat=base:90;canary:10", "embed=e1:1;e2:2"])
    counts = Counter(table.resolve("chat") for _ in range(1000))
    assert abs(counts["base"] / 1000 - 0.90) <= 0.05 and abs(counts["canary"] / 1000 - 0.10) <= 0.05
    # smooth weighted round-robin: exact in every window of sum(weights) requests, and spread
    # out (no run of ten canary requests in a row)
    assert counts == {"base": 900, "canary": 100}
    window = [table.resolve("chat") for _ in range(100)]
    assert window.count("canary") == 10 and "canary,canary" not in ",".join(window)
    # each alias keeps its own rotation
    assert Counter(table.resolve("embed") for _ in range(999)) == {"e1": 333, "e2": 666}


def test_cards_list_the_aliases_some_target_of_which_is_served() -> None:
    table = AliasTable.from_specs(["chat=base:90;canary:10", "gone=old", "solo=canary"])
    cards = table.cards({"canary": {"id": "canary"}})
    assert [c["id"] for c in cards] == ["chat", "solo"]
    assert cards[0]["root"] == "canary" and cards[0]["owned_by"] == "prefix-router"
    assert cards[0]["prefix_router_targets"] == [
        {"model": "base", "weight": 90},
        {"model": "canary", "weight": 10},
    ]


def test_aliases_come_from_flags_env_and_yaml_and_bad_ones_name_their_source(
    tmp_path: Path,
) -> None:
    base = ["--replica", "http://127.0.0.1:9"]
    cfg = load_config([*base, "--model-alias", "chat=m", "--model-alias", "c=a:9;b:1"], env={})
    assert cfg.model_aliases == ("chat=m", "c=a:9;b:1")
    env = {"ROUTER_MODEL_ALIASES": "chat=m,c=a:9;b:1"}
    assert load_config(base, env=env).model_aliases == ("chat=m", "c=a:9;b:1")
    path = tmp_path / "router.yaml"
    path.write_text("model_aliases: ['chat=m']\n")
    assert load_config([*base, "--config", str(path)], env={}).model_aliases == ("chat=m",)
    with pytest.raises(ConfigError, match="--model-alias"):
        load_config([*base, "--model-alias", "chat=a:90;b"], env={})
