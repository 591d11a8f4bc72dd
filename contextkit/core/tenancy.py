"""Who a request is, from its credentials, and what that tenant's cached state is keyed by.

A server (``contextkit serve``, ``contextkit proxy``) holds one ``Tenancy``:

- API keys, each mapped to a tenant. A request's tenant comes from its ``Authorization: Bearer`` key,
  never from the request body: a body ``contextkit.tenant`` is refused (403) unless the operator lets
  clients choose tenants (``allow_client_tenant``), and then it names a sub-tenant of the key's own
  (``<key tenant>:<name>``), so no key can reach another key's history. ``:`` is refused in key tenants
  (at load) and in requested names, so a sub-tenant is never the tenant of another key (``acme`` + ``eu``
  and a key of tenant ``acme:eu``) and its key tenant is read from its name (``Tenant.key_tenant``;
  queue shares, engine turns and per-key tables are per key tenant). A key uses at most
  ``max_sub_tenants`` sub-tenants at once (each used in the last ``sub_tenant_ttl_s``); one more is 429.
  Without any key the server is open (one shared tenant) and binds to loopback only; there a body names
  a top-level tenant (there is no key to charge it to: whoever reaches a loopback server is trusted).
- A server secret. vLLM's ``cache_salt`` is ``HMAC-SHA256(secret, tenant)``, never the tenant's name:
  a client cannot compute another tenant's salt, and a client's own ``cache_salt`` is mixed into the
  HMAC (a sub-partition of its tenant's cache), never sent as it is. The
  same secret keys the MAC of KV entries that leave the process (``derive(secret, "kv-mac")``).
  Several servers that share caches (vLLM behind several proxies, a Redis tier) share the secret.

Keys are held as their sha256 digests; a lookup compares digests, never the keys themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from cachetools import TTLCache

from contextkit.core.errors import AuthenticationError, ConfigError, InputError, PermissionDeniedError, RateLimitError
from contextkit.core.tenant import MAX_SUB_TENANTS, MAX_TENANT_CHARS, SUB, Tenant

SECRET_BYTES = 32
SECRET_FILE = "secret"  # under the cache dir, unless a path is configured


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose (cache salts, the KV MAC) from the server secret."""
    return hmac.new(secret, b"contextkit-v1\x00" + purpose.encode(), hashlib.sha256).digest()


PIC_SUFFIX = ":pic"


def pic_salt(salt: str, *, recompute_last: bool, variant: str = "") -> str:
    """The ``cache_salt`` of a request that loads position-free (approximate) span KV: the tenant's salt
    with the opt-in appended, so the blocks such a request leaves in vLLM's prefix cache are hit only by
    requests with the same opt-in (DESIGN.md: approximate KV is request-only). ``variant`` names the
    recompute setting a repaired request ran (``core.policy.variant``): KV repaired at one setting is
    never a prefix hit for a request asking another (a ratio 1.0 request must not reuse ratio 0's blocks).
    The proxy names requests with it and the KV connector accepts a pic request's span salt only when the
    request's own ``cache_salt`` is this function of it: one derivation on both sides of the boundary."""
    return f"{salt}{PIC_SUFFIX}{':last' if recompute_last else ''}{':r=' + variant if variant else ''}"


def load_secret(path: Path | str | None = None, value: str | None = None) -> bytes:
    """The server secret: ``value`` (hex, or any string of >= 32 characters), else the file at ``path``
    (created with 32 random bytes, mode 0600, when it does not exist yet)."""
    if value:
        if len(value) < 32:
            raise ConfigError("the server secret must be at least 32 characters (e.g. `openssl rand -hex 32`)")
        return hashlib.sha256(value.encode()).digest()
    if path is None:
        return secrets.token_bytes(SECRET_BYTES)  # this process only: salts change at restart
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
        data = path.read_bytes()
    if len(data) < SECRET_BYTES:
        raise ConfigError(f"the secret file {path} holds {len(data)} bytes, fewer than {SECRET_BYTES}; delete it "
                          "to have a new one made, or write a longer secret")
    return data


def deployment_secret(cache_dir: Path | str, value: str | None = None, path: Path | str | None = None) -> bytes:
    """The deployment's secret: ``value``, else the file at ``path`` (default ``<cache_dir>/secret``)."""
    return load_secret(path or Path(cache_dir).expanduser() / SECRET_FILE, value)


def load_api_keys(file: Path | str | None = None, keys: Mapping[str, str] | None = None) -> dict[str, str]:
    """API keys (key -> tenant name) from a JSON file ``{"key": "tenant", ...}`` and/or a mapping."""
    out: dict[str, str] = {}
    if file is not None:
        try:
            loaded = json.loads(Path(file).expanduser().read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read API keys from {file}: {exc}; it must be a JSON object "
                              "{\"<key>\": \"<tenant>\", ...}") from exc
        if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in loaded.items()):
            raise ConfigError(f"{file} must be a JSON object of strings {{\"<key>\": \"<tenant>\", ...}}")
        out.update(loaded)
    out.update(keys or {})
    return out


class Tenancy:
    """API keys -> tenants, and the server secret that derives each tenant's cache salt.

    Args:
        api_keys: key -> tenant name; empty: an open server (one shared tenant, loopback only).
        secret: the server secret (``load_secret``).
        allow_client_tenant: let a request name a sub-tenant of its key's tenant in its body.
        max_sub_tenants: sub-tenants one key may use at once; one more is refused (429).
        sub_tenant_ttl_s: a sub-tenant unused this long no longer counts (its place is free again).
        clock: seconds, for ``sub_tenant_ttl_s`` (tests pass a fake one).
    """

    def __init__(self, api_keys: Mapping[str, str] | None = None, secret: bytes | None = None,
                 allow_client_tenant: bool = False, *, max_sub_tenants: int = MAX_SUB_TENANTS,
                 sub_tenant_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if max_sub_tenants < 1 or sub_tenant_ttl_s <= 0:
            raise ConfigError(f"max_sub_tenants ({max_sub_tenants}) must be >= 1 and sub_tenant_ttl_s "
                              f"({sub_tenant_ttl_s}) > 0; to refuse client-chosen tenants "
                              "leave allow_client_tenant off")
        self._keys: dict[bytes, Tenant] = {}
        for key, name in (api_keys or {}).items():
            if len(key) < 8:
                raise ConfigError("API keys must be at least 8 characters long")
            if isinstance(name, str) and SUB in name:
                raise ConfigError(f"API key for tenant {name!r}: a key's tenant may not contain {SUB!r} (it separates "
                                  f"a key's tenant from its sub-tenants, so {name!r} could be another key's "
                                  f"sub-tenant); rename it, e.g. {name.replace(SUB, '-')!r}")
            try:
                self._keys[hashlib.sha256(key.encode()).digest()] = Tenant(name)
            except Exception as exc:  # an InputError about the name, reported as the operator's to fix
                raise ConfigError(f"API key for tenant {name!r}: {exc}") from None
        self._salt_key = derive(secret or load_secret(), "cache-salt")
        self.allow_client_tenant = allow_client_tenant
        self.max_sub_tenants, self.sub_tenant_ttl_s = max_sub_tenants, sub_tenant_ttl_s
        self._clock = clock
        # key tenant -> its sub-tenants in use (name -> last use): one bounded cache per key tenant, made
        # here, so the bookkeeping is bounded by the keys configured times max_sub_tenants
        self._subs = {t.name: TTLCache(max_sub_tenants, sub_tenant_ttl_s, timer=clock) for t in self._keys.values()}
        self._lock = threading.Lock()  # a server may resolve from several threads

    @property
    def key_count(self) -> int:
        return len(self._keys)

    @property
    def open(self) -> bool:
        """No keys: every request is the one default tenant (the server must stay on loopback)."""
        return not self._keys

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header value (``Bearer <key>``); 401 without a known key."""
        if self.open:
            return Tenant()
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("missing API key: send `Authorization: Bearer <key>`")
        tenant = self._keys.get(hashlib.sha256(key.strip().encode()).digest())
        if tenant is None:
            raise AuthenticationError("invalid API key")
        return tenant

    def resolve(self, authenticated: Tenant, requested: str | None) -> Tenant:
        """The tenant a request runs as: its key's, or (if the operator allows it) a sub-tenant named in
        the body. A body naming any other tenant is refused with 403, a name holding ``:`` with 422, a new
        sub-tenant past the key's ``max_sub_tenants`` in use with 429."""
        if requested is None or requested == "" or requested == authenticated.name:
            return authenticated
        if not self.allow_client_tenant:
            raise PermissionDeniedError(
                "contextkit.tenant is set by the server from your API key; remove it from the request (the "
                "operator can allow client-chosen sub-tenants with --allow-client-tenant)")
        if SUB in requested:
            raise InputError(f"tenant {requested[:40]!r} may not contain {SUB!r} (it separates your key's tenant "
                             "from the sub-tenant you name); name the sub-tenant without it", "tenant")
        if self.open:  # no key to charge it to: a top-level tenant, as named
            return Tenant(requested)
        name = f"{authenticated.name}{SUB}{requested}"
        if len(name) > MAX_TENANT_CHARS:
            raise PermissionDeniedError(f"tenant {name[:40]!r}... is over {MAX_TENANT_CHARS} characters")
        tenant = Tenant(name)
        self._count_sub(authenticated, tenant)
        return tenant

    def _count_sub(self, key_tenant: Tenant, sub: Tenant) -> None:
        """Mark ``sub`` as in use by its key; refuse (429) a new one past ``max_sub_tenants`` in use."""
        seen = self._subs.get(key_tenant.name)
        if seen is None:  # resolve() is for the tenant authenticate() returned, never a sub-tenant
            raise PermissionDeniedError(f"tenant {key_tenant.name[:40]!r} is no API key's tenant: "
                                        "it has no sub-tenants")
        with self._lock:
            seen.expire()
            if sub.name not in seen and len(seen) >= self.max_sub_tenants:
                retry = min(seen.values()) + self.sub_tenant_ttl_s - self._clock()  # when the oldest frees
                raise RateLimitError(
                    f"this API key already uses {len(seen)} sub-tenants (contextkit.tenant), the most the server "
                    f"allows at once; reuse one of them, or retry once one has been unused for "
                    f"{self.sub_tenant_ttl_s:g} s (the operator sets max_sub_tenants)", retry_after_s=max(retry, 0.0))
            seen[sub.name] = self._clock()  # (re)set: in use from now

    def cache_salt(self, tenant: Tenant, client_salt: str | None = None) -> str:
        """vLLM's ``cache_salt`` for ``tenant``: an HMAC of its name under the server secret (hex).

        A client's own ``cache_salt`` (to keep its end users apart) is mixed in, never used as it is:
        it partitions the tenant's cache further but cannot reach another tenant's.
        """
        msg = tenant.name.encode() + b"\x00" + (client_salt or "").encode()
        return hmac.new(self._salt_key, msg, hashlib.sha256).hexdigest()


def check_bind(tenancy: Tenancy, host: str) -> str:
    """Refuse to listen beyond loopback without API keys; the line a server prints at start otherwise."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if tenancy.open and not loopback:
        raise ConfigError(f"no API keys are configured, so listening on {host} would let anyone on the network "
                          "read and fill every cache; pass --api-key / --api-keys-file, or listen on 127.0.0.1")
    if tenancy.open:
        return f"no API keys: open to this machine only ({host}), every request is one shared tenant"
    return f"{tenancy.key_count} API key(s); a request's tenant comes from its key"
