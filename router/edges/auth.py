"""Client API keys, tenants and per-tenant ``cache_salt``: tenant isolation of the prefix cache.

A prefix hit is measurably faster than a miss, so a client that can share another's
cache can probe whether someone sent a given prefix (the seed's "cross-tenant timing
signals"). vLLM folds ``cache_salt`` into block 0's hash, so requests with different
salts never share a block (vLLM 0.33 ``generate_block_hash_extra_keys``). With
authentication on, the router maps each API key to a tenant and sets every
generation request's ``cache_salt`` to ``HMAC-SHA256(secret, tenant)``: tenants
never hit each other's blocks, the router's own hit prediction (which hashes the
salt in too) never credits one tenant with another's prefix, and nobody can guess
another tenant's salt without the secret.

Key file format (what ``prefix-router auth add-key`` prints; keys are stored only as
SHA-256 hashes): one ``TENANT sha256:HEX`` per line, ``#`` comments. A directory (a
Kubernetes Secret mounted as a volume) holds one file per tenant, named after it,
each with one ``sha256:HEX`` per line. The file or directory is re-read when it
changes (Secret updates), checked at most every ``RELOAD_CHECK_S``.

``KeyStore`` and ``tenant_salt`` are pure apart from reading the key and secret
files; ``auth_middleware`` is the aiohttp edge.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from router.request.errors import BadRequest, RouterError

logger = logging.getLogger(__name__)

RELOAD_CHECK_S: Final = 5.0  # seconds between checks of the key file's modification time
SALT_CONTEXT: Final = b"prefix-router cache_salt v1\x00"  # HMAC domain separation
FAMILY_ID_CONTEXT: Final = b"prefix-router audit family id v1\x00"  # the template audit's id key
CLIENT_SALT_POLICIES: Final = ("override", "reject")
DEBUG_ACCESS: Final = ("admin", "tenant")  # who may call /debug/* when keys are on
METRICS_ACCESS: Final = ("open", "admin")  # who may scrape /metrics when keys are on
# the request's slots of the authenticated tenant's name and its admin flag (typed keys:
# ``request.get(TENANT_KEY)`` is ``str | None``; a plain "tenant" string would not find it)
TENANT_KEY: Final = web.RequestKey("tenant", str)
ADMIN_KEY: Final = web.RequestKey("tenant_is_admin", bool)
# paths where Anthropic's key header is accepted as the API key (Anthropic's SDK sends no
# Authorization header)
X_API_KEY_PATHS: Final = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
X_API_KEY_HEADER: Final = "x-api-key"
OPEN_PATHS: Final = frozenset({"/health", "/ready"})  # probes of the kubelet: never need a key
_HASH_RE: Final = re.compile(r"sha256:([0-9a-f]{64})")
_TENANT_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class AuthConfigError(ValueError):
    """The key file or the salt secret cannot be used."""


class Unauthorized(RouterError):
    status, error_type = 401, "AuthenticationError"


class Forbidden(RouterError):
    status, error_type = 403, "PermissionDeniedError"


def hash_key(api_key: str) -> str:
    """The at-rest form of an API key: ``sha256:`` + hex digest of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random API key (``sk-`` + 32 url-safe bytes)."""
    return "sk-" + secrets.token_urlsafe(32)


def tenant_salt(secret: bytes, tenant: str) -> str:
    """``cache_salt`` of ``tenant``: hex HMAC-SHA256 of the tenant under ``secret`` (64 chars,
    within vLLM's 1-128 characters and without ``@ / \\``)."""
    return hmac.new(secret, SALT_CONTEXT + tenant.encode(), hashlib.sha256).hexdigest()


def derived_key(secret: bytes, context: bytes) -> bytes:
    """A 32-byte key for one use (``context``, e.g. ``FAMILY_ID_CONTEXT``) derived from the salt
    secret: HMAC-SHA256(secret, context). Knowing one derived key or salt tells nothing of the
    secret or of the keys for other uses (HMAC is a pseudo-random function)."""
    return hmac.new(secret, context, hashlib.sha256).digest()


def parse_key_lines(text: str, source: str, tenant: str | None = None) -> dict[str, str]:
    """``{sha256 hex: tenant}`` from key-file text (``TENANT sha256:HEX`` lines, or
    ``sha256:HEX`` lines of one ``tenant``'s file). Raises ``AuthConfigError`` naming the line."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        owner, hashed = None, ""
        if tenant is not None and len(parts) == 1:
            owner, hashed = tenant, parts[0]
        elif tenant is None and len(parts) == 2:
            owner, hashed = parts[0], parts[1]
        match = _HASH_RE.fullmatch(hashed)
        if owner is None or match is None:
            raise AuthConfigError(f"{source}:{number}: expected "
                                  f"{'sha256:HEX' if tenant else 'TENANT sha256:HEX'} "
                                  f"(a hashed key, see `prefix-router auth add-key`)")
        if not _TENANT_RE.fullmatch(owner):
            raise AuthConfigError(f"{source}:{number}: bad tenant name {owner!r}")
        out[match.group(1)] = owner
    return out


class KeyStore:
    """API-key hashes -> tenant, from ``path`` (a file, or a directory of one file per tenant).

    ``tenant_of(api_key)`` is ``None`` for an unknown key. Raises ``AuthConfigError`` at
    construction when the file cannot be read; a later reload that fails keeps the last good
    keys (and logs it), so a half-written Secret update never locks everyone out.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._keys: dict[str, str] = {}  # {sha256 hex of a key: tenant}
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        self._load()

    def _current_stamp(self) -> tuple[float, int]:
        paths = sorted(self.path.iterdir()) if self.path.is_dir() else [self.path]
        stats = [p.stat() for p in paths if p.is_file()]
        return (max((s.st_mtime for s in stats), default=0.0), len(stats))

    def _load(self) -> None:
        try:
            stamp = self._current_stamp()
            keys: dict[str, str] = {}
            if self.path.is_dir():
                for item in sorted(self.path.iterdir()):
                    # a Secret volume also holds ..data links and dot-dirs: only plain tenant files
                    if item.is_file() and not item.name.startswith("."):
                        keys.update(parse_key_lines(item.read_text(), str(item), item.name))
            else:
                keys = parse_key_lines(self.path.read_text(), str(self.path))
        except OSError as exc:
            raise AuthConfigError(f"cannot read API keys from {self.path}: {exc}") from exc
        self._keys, self._stamp = keys, stamp

    def maybe_reload(self, now: float) -> None:
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            if self._current_stamp() != self._stamp:
                self._load()
                logger.info("reloaded %d API keys from %s", len(self._keys), self.path)
        except (OSError, AuthConfigError) as exc:
            logger.warning("API keys not reloaded, keeping the last good ones: %s", exc)

    def tenant_of(self, api_key: str) -> str | None:
        return self._keys.get(hashlib.sha256(api_key.encode()).hexdigest())

    def __len__(self) -> int:
        return len(self._keys)


def read_secret(path: str) -> bytes:
    """The salt secret (file contents, surrounding whitespace stripped; at least 16 bytes).
    Raises ``AuthConfigError``."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise AuthConfigError(f"cannot read the cache-salt secret {path}: {exc}") from exc
    if len(secret) < 16:
        raise AuthConfigError(f"the cache-salt secret in {path} is shorter than 16 bytes")
    return secret


def request_api_key(request: web.Request) -> str | None:
    """The API key a request carries: ``Authorization: Bearer KEY``, or on the Anthropic paths
    (``X_API_KEY_PATHS``) Anthropic's ``x-api-key: KEY`` header (what the Anthropic SDK sends;
    Anthropic's API reference, "Authentication"). ``None`` when there is none."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if request.path in X_API_KEY_PATHS:
        token = request.headers.get(X_API_KEY_HEADER, "").strip()
        if token:
            return token
    return None


class TenantAuth:
    """Authentication and salting policy of one router process.

    ``client_salt``: what happens to a ``cache_salt`` the client sent itself:
    ``override`` (replaced by the tenant's) or ``reject`` (400). ``debug_access``
    ``admin``: only ``admin_tenants`` may call ``/debug/*`` (``tenant``: any key, whose
    view is its own tenant's); ``metrics_access`` ``admin``: ``/metrics`` needs an admin
    key (``open``: no key).
    """

    def __init__(self, keys: KeyStore, secret: bytes, client_salt: str = "override",
                 admin_tenants: tuple[str, ...] = (), debug_access: str = "admin",
                 metrics_access: str = "open") -> None:
        for name, value, allowed in (("client cache_salt policy", client_salt, CLIENT_SALT_POLICIES),
                                     ("debug_access", debug_access, DEBUG_ACCESS),
                                     ("metrics_access", metrics_access, METRICS_ACCESS)):
            if value not in allowed:
                raise AuthConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        self.keys = keys
        self.secret = secret
        self.client_salt = client_salt
        self.admin_tenants = frozenset(admin_tenants)
        self.restrict_debug = debug_access == "admin"
        self.restrict_metrics = metrics_access == "admin"
        self._salts: dict[str, str] = {}  # {tenant: cache_salt}
        # the key of the template audit's family ids: no one without the secret can compute
        # the id of a prompt he knows and look for it in /metrics
        self.family_id_key = derived_key(secret, FAMILY_ID_CONTEXT)

    def salt_of(self, tenant: str) -> str:
        salt = self._salts.get(tenant)
        if salt is None:
            salt = self._salts[tenant] = tenant_salt(self.secret, tenant)
        return salt

    def authenticate(self, request: web.Request) -> None:
        """Set ``request[TENANT_KEY]`` (and ``ADMIN_KEY``) or raise ``Unauthorized`` /
        ``Forbidden``. Open paths pass without a key; ``/metrics`` too unless restricted."""
        path = request.path
        if path in OPEN_PATHS or (path == "/metrics" and not self.restrict_metrics):
            return
        token = request_api_key(request)
        if token is None:
            raise Unauthorized("You didn't provide an API key. Send it as 'Authorization: "
                               "Bearer YOUR_KEY'" + (" or 'x-api-key: YOUR_KEY'."
                                                     if path in X_API_KEY_PATHS else "."))
        self.keys.maybe_reload(time.monotonic())
        tenant = self.keys.tenant_of(token)
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.")
        admin = tenant in self.admin_tenants
        if not admin and ((path == "/metrics" and self.restrict_metrics)
                          or (path.startswith("/debug/") and self.restrict_debug)):
            raise Forbidden(f"{path} is restricted to admin tenants")
        request[TENANT_KEY] = tenant
        request[ADMIN_KEY] = admin

    def request_salt(self, request: web.Request) -> str | None:
        """The ``cache_salt`` the router sets on ``request``'s body: its tenant's, None without
        a tenant (an open path)."""
        tenant = request.get(TENANT_KEY)
        return None if tenant is None else self.salt_of(tenant)

    def check_client_salt(self, sent: Any) -> None:
        """``sent``: the body's own ``cache_salt`` (None: absent). Raises ``BadRequest`` when the
        client set one under the ``reject`` policy (``override`` replaces it)."""
        if sent is not None and self.client_salt == "reject":
            raise BadRequest("'cache_salt' is set by the router for your tenant; do not send it")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(auth: TenantAuth) -> Any:
    """aiohttp middleware running ``auth.authenticate`` before every handler (inside the error
    middleware, so a refusal is OpenAI-shaped JSON)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            auth.authenticate(request)
        except Unauthorized as exc:
            exc.headers["WWW-Authenticate"] = "Bearer"
            raise
        return await handler(request)

    return middleware


def load_tenant_auth(keys_path: str, secret_path: str | None, client_salt: str = "override",
                     admin_tenants: tuple[str, ...] = (), debug_access: str = "admin",
                     metrics_access: str = "open") -> TenantAuth:
    """``TenantAuth`` from the configured files. Raises ``AuthConfigError``."""
    if not secret_path:
        raise AuthConfigError("api_keys needs cache_salt_secret_file: every router process must "
                              "derive the same per-tenant salts")
    return TenantAuth(KeyStore(keys_path), read_secret(secret_path), client_salt,
                      admin_tenants, debug_access, metrics_access)
