"""API keys, tenants and the admin key.

Terms:

- *key hash*: `sha256:<64 hex digits>` of the key's UTF-8 bytes. Settings hold only hashes; the
  key itself never enters settings, logs, metrics or error bodies. `ragspeed keys hash KEY`
  prints the line to paste.
- *tenant*: who a key belongs to. Each tenant gets its own `cache_salt`, forced onto every
  request it sends (a client-sent `cache_salt` is overridden), so tenants never share, or time,
  each other's prefix cache.
- *principal*: the authenticated caller of one request: tenant, salt, admin or not, and the
  key's token buckets (requests and tokens per minute, see `gateway.limits.TokenBucket`).
- *admin paths*: everything under `ADMIN_PREFIXES`; only admin keys may call them.

Auth is off while no key is configured (local use); everything under `/v1/` needs a key as soon
as one is. `/healthz`, `/metrics` and the OpenAPI documents stay open.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any

import click
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.limits import (
    ASGIApp,
    Receive,
    Rejections,
    Scope,
    Send,
    TokenBucket,
    header,
    retry_after,
)

HASH_PREFIX = "sha256:"
ADMIN_PREFIXES = ("/v1/prompts", "/v1/collections", "/v1/experiments")
ADMIN_TENANT = "admin"

KeyHash = Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]


def hash_key(key: str) -> str:
    if not key:
        raise ValueError("the key is empty")
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def tenant_cache_salt(tenant: str) -> str:
    """The prefix-cache salt of a tenant: stable across restarts, so persisted caches stay valid."""
    return "tenant-" + hashlib.sha256(f"ragspeed-tenant\0{tenant}".encode()).hexdigest()[:32]


class TenantSalt(BaseModel):
    """Whose requests an admin body stores KV for (a pinned prompt, a collection's documents):
    a tenant's API keys, or requests sending a `cache_salt`, not both; neither: unsalted."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(None, min_length=1, description="For this tenant's API keys.")
    cache_salt: str | None = Field(None, min_length=1, description="For requests with this salt.")

    @model_validator(mode="after")
    def _one_salt(self) -> TenantSalt:
        if self.tenant is not None and self.cache_salt is not None:
            raise ValueError("give either tenant or cache_salt, not both")
        return self

    @property
    def salt(self) -> str | None:
        return tenant_cache_salt(self.tenant) if self.tenant is not None else self.cache_salt


class ApiKeyEntry(BaseModel):
    """One API key in settings. On the command line or in an environment variable it may be given
    as JSON or as `sha256:<hex>,tenant=NAME,requests_per_minute=N,tokens_per_minute=N`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hash: KeyHash = Field(description="sha256:<hex> of the key (ragspeed keys hash KEY).")
    tenant: str = Field(min_length=1, description="Tenant the key belongs to; sets its cache salt.")
    requests_per_minute: float | None = Field(None, gt=0, description="Request rate limit; none: unlimited.")
    tokens_per_minute: float | None = Field(
        None, gt=0, description="Prompt plus generated tokens a minute; none: unlimited."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("{"):
            return json.loads(text)
        first, *pairs = [part.strip() for part in text.split(",")]
        entry: dict[str, Any] = {"hash": first}
        for pair in pairs:
            name, sep, val = pair.partition("=")
            if not sep:
                raise ValueError(f"expected name=value after the hash, got {pair!r}")
            entry[name.strip()] = val.strip()
        return entry


@dataclass(frozen=True, eq=False)
class Principal:
    tenant: str
    cache_salt: str
    is_admin: bool = False
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None

    def admit_tokens(self, num_prompt_tokens: int) -> None:
        """Charge the prompt to the key's token budget; 429 while the budget is in debt."""
        if self.tokens is None:
            return
        wait_s = self.tokens.wait_s()
        if wait_s > 0:
            raise APIError(
                429,
                f"tenant '{self.tenant}' is over its tokens_per_minute limit of "
                f"{self.tokens.capacity:g}; retry in {wait_s:.1f} s",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after(wait_s)},
            )
        self.tokens.charge(num_prompt_tokens)

    def charge_tokens(self, num_tokens: int) -> None:
        if self.tokens is not None and num_tokens:
            self.tokens.charge(num_tokens)


# The principal of the request being served. Set by SecurityMiddleware around the app call, so it
# is request-scoped (each request runs in its own task context), never long-lived state.
_current_principal: ContextVar[Principal | None] = ContextVar("ragspeed_principal", default=None)


def current_principal() -> Principal | None:
    return _current_principal.get()


class KeyRing:
    """Configured keys by hash; `authenticate` compares against every one in constant time."""

    def __init__(
        self,
        entries: Sequence[ApiKeyEntry],
        admin_key_hashes: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._keys: list[tuple[bytes, Principal]] = []
        for entry in entries:
            self._add(
                entry.hash,
                Principal(
                    tenant=entry.tenant,
                    cache_salt=tenant_cache_salt(entry.tenant),
                    requests=TokenBucket(entry.requests_per_minute, clock)
                    if entry.requests_per_minute
                    else None,
                    tokens=TokenBucket(entry.tokens_per_minute, clock) if entry.tokens_per_minute else None,
                ),
            )
        for key_hash in admin_key_hashes:
            self._add(key_hash, Principal(ADMIN_TENANT, tenant_cache_salt(ADMIN_TENANT), is_admin=True))

    def _add(self, key_hash: str, principal: Principal) -> None:
        digest = bytes.fromhex(key_hash.removeprefix(HASH_PREFIX))
        if any(hmac.compare_digest(digest, known) for known, _ in self._keys):
            # Say which tenant, never which hash: the hash is as good as a key against a weak key.
            raise ValueError(f"an API key of tenant '{principal.tenant}' is configured twice")
        self._keys.append((digest, principal))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, key: str | None) -> Principal | None:
        if not key:
            return None
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        found = None
        for known, principal in self._keys:  # no early exit: the time does not tell which matched
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None


def is_admin_path(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in ADMIN_PREFIXES)


class SecurityMiddleware:
    """Authenticates every request under `/v1/`, guards admin paths, applies the request rate."""

    def __init__(self, app: ASGIApp, keyring: KeyRing, rejections: Rejections):
        self.app, self.keyring, self.rejections = app, keyring, rejections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or not self.keyring.enabled
            or not (path == "/v1" or path.startswith("/v1/"))
        ):
            return await self.app(scope, receive, send)
        principal = self.keyring.authenticate(bearer_key(header(scope, b"authorization")))
        if principal is None:
            return await self.rejections.send(
                send,
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if is_admin_path(path) and not principal.is_admin:
            return await self.rejections.send(
                send,
                403,
                f"{path} needs an admin key",
                code="admin_key_required",
                error_type="permission_error",
            )
        if principal.requests is not None:
            wait_s = principal.requests.try_take(1.0)
            if wait_s > 0:
                return await self.rejections.send(
                    send,
                    429,
                    f"tenant '{principal.tenant}' is over its requests_per_minute limit of "
                    f"{principal.requests.capacity:g}; retry in {wait_s:.1f} s",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": retry_after(wait_s)},
                )
        scope.setdefault("state", {})["principal"] = principal
        token = _current_principal.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            _current_principal.reset(token)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, keyring: KeyRing, logger: logging.Logger) -> bool:
    """Log a loud warning when the server listens beyond loopback with auth off; True if it did."""
    if keyring.enabled or is_loopback(host):
        return False
    bar = "!" * 78
    logger.warning(
        "%s\nragspeed listens on %s with NO API KEYS: anyone who can reach this port can use "
        "the model and the admin endpoints.\nConfigure api_keys and admin_key_hashes "
        "(ragspeed keys hash KEY) or listen on 127.0.0.1.\n%s",
        bar,
        host,
        bar,
    )
    return True


# ---------------------------------------------------------------------- CLI


@click.group(name="keys")
def keys() -> None:
    """API keys: make the hash lines that settings hold (api_keys, admin_key_hashes)."""


@keys.command("hash")
@click.argument("key")
def hash_command(key: str) -> None:
    """Print sha256:<hex> of KEY ('-' reads the key from stdin, keeping it out of shell history)."""
    if key == "-":
        key = sys.stdin.readline().rstrip("\r\n")
    try:
        click.echo(hash_key(key))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from exc


@keys.command("generate")
@click.option("--tenant", default=None, help="Also print a ready api_keys entry for this tenant.")
def generate_command(tenant: str | None) -> None:
    """Print a new random key and its hash line (give the key to the client, the hash to the server)."""
    key = "rs-" + secrets.token_urlsafe(32)
    click.echo(f"key:  {key}")
    click.echo(f"hash: {hash_key(key)}")
    if tenant:
        click.echo(f"api_keys entry: {{hash: '{hash_key(key)}', tenant: '{tenant}'}}")
