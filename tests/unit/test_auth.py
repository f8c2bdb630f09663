"""API keys, tenants and tenant salts (router/auth.py): parsing, reloads, the salt's form."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.edges.auth import (
    AuthConfigError,
    KeyStore,
    hash_key,
    load_tenant_auth,
    new_key,
    parse_key_lines,
    tenant_salt,
)
from router.service.config import ConfigError, load_config


def test_key_file_lines_and_errors() -> None:
    key = new_key()
    assert parse_key_lines(f"# comment\nacme {hash_key(key)}  # ops key\n\n", "f") == {
        hash_key(key).removeprefix("sha256:"): "acme"}
    with pytest.raises(AuthConfigError, match="f:1: expected TENANT sha256:HEX"):
        parse_key_lines(f"acme {key}\n", "f")  # a raw key is never accepted at rest
    with pytest.raises(AuthConfigError, match="f:2: bad tenant name"):
        parse_key_lines(f"ok {hash_key('x')}\n../etc {hash_key('y')}\n", "f")
    with pytest.raises(AuthConfigError, match="expected sha256:HEX"):
        parse_key_lines("acme sha256:00\n", "f", tenant="acme")


def test_directory_store_reloads_and_keeps_last_good_keys(tmp_path: Path) -> None:
    (tmp_path / "acme").write_text(hash_key("k1") + "\n")
    (tmp_path / "..data").mkdir()  # what a Secret volume also holds
    store = KeyStore(str(tmp_path))
    assert store.tenant_of("k1") == "acme" and store.tenant_of("k2") is None
    (tmp_path / "globex").write_text(hash_key("k2") + "\n")
    store.maybe_reload(now=1e9)
    assert store.tenant_of("k2") == "globex"
    (tmp_path / "acme").write_text("not a hash\n")
    os.utime(tmp_path / "acme", (2e9, 2e9))
    store.maybe_reload(now=2e9)
    assert store.tenant_of("k1") == "acme", "a bad update keeps the last good keys"


def test_tenant_salt_is_keyed_and_valid_for_vllm() -> None:
    salt = tenant_salt(b"s" * 16, "acme")
    assert salt == tenant_salt(b"s" * 16, "acme") != tenant_salt(b"t" * 16, "acme")
    assert salt != tenant_salt(b"s" * 16, "acme2")
    assert len(salt) == 64 and not set(salt) & set("@/\\\0")  # vLLM validate_cache_salt


def test_config_needs_the_secret_and_known_policies(tmp_path: Path) -> None:
    base = ["--replica", "http://127.0.0.1:1"]
    with pytest.raises(ConfigError, match="api_keys needs cache_salt_secret_file"):
        load_config([*base, "--api-keys", "k"], env={})
    with pytest.raises(ConfigError, match="client_cache_salt must be one of override, reject"):
        load_config([*base, "--client-cache-salt", "merge"], env={})
    config = load_config([*base, "--admin-tenants", "ops,sre"], env={})
    assert config.admin_tenants == ("ops", "sre")
    short = tmp_path / "secret"
    short.write_text("short")
    (tmp_path / "keys").write_text("")
    with pytest.raises(AuthConfigError, match="shorter than 16 bytes"):
        load_tenant_auth(str(tmp_path / "keys"), str(short))
    with pytest.raises(AuthConfigError, match="cannot read API keys"):
        load_tenant_auth(str(tmp_path / "missing"), str(tmp_path / "keys"))


def test_auth_cli_makes_keys_the_store_accepts(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    assert main(["auth", "add-key", "acme"]) == 0
    key_line, file_line = capsys.readouterr().out.splitlines()
    key = key_line.rsplit(" ", 1)[1]
    (tmp_path / "keys").write_text(file_line + "\n")
    assert KeyStore(str(tmp_path / "keys")).tenant_of(key) == "acme"


def test_a_key_the_router_checked_stays_in_the_router(tmp_path: Path) -> None:
    """The authenticated tenant sits in the request's typed slot (``TENANT_KEY``), which is what
    the proxy reads to drop the client's ``Authorization`` from the upstream headers: the key is
    the client's secret, the engine never sees it. Without a key, the header goes upstream."""
    from aiohttp.test_utils import make_mocked_request

    from router.edges.auth import TENANT_KEY, TenantAuth
    from router.edges.proxy import upstream_headers

    key = new_key()
    (tmp_path / "keys").write_text(f"acme {hash_key(key)}\n")
    auth = TenantAuth(KeyStore(str(tmp_path / "keys")), b"s" * 32)
    request = make_mocked_request("POST", "/v1/completions",
                                  headers={"Authorization": f"Bearer {key}", "X-Other": "1"})
    auth.authenticate(request)
    assert request.get(TENANT_KEY) == "acme"
    headers = upstream_headers(request, "r1")
    assert "Authorization" not in headers and headers["X-Other"] == "1"
    unchecked = make_mocked_request("POST", "/v1/completions",
                                    headers={"Authorization": "Bearer engine-key"})
    assert upstream_headers(unchecked, "r2")["Authorization"] == "Bearer engine-key"
